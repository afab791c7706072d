//! The CUDA side of servelab: GPU measurements (speed against the device's own ceilings) and,
//! later, the engine backend. The `servelab-gpu` binary runs these on a GPU machine without the
//! main binary (which needs polars).

pub mod backend;
pub mod calibrate;
pub mod checks;
pub mod commands;
pub mod conformance;
pub mod report;
pub mod speed;
pub mod timing;
