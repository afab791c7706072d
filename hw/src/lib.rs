//! The CUDA side of servelab: GPU measurements (speed against the device's own ceilings), the
//! CUDA backend, and the engine loop that drives it with the `core` policies on a virtual or a
//! wall clock. The `servelab-gpu` binary runs these on a GPU machine without the main binary
//! (which needs polars).

pub mod affinity;
pub mod backend;
pub mod calibrate;
pub mod checks;
pub mod cli;
pub mod clock;
pub mod commands;
pub mod conformance;
pub mod report;
pub mod speed;
pub mod timing;
