//! The CUDA side of servelab: GPU measurements (speed against the device's own ceilings), the
//! CUDA backend, and the GPU environment of the serving unit (`servelab_core::unit`) on a
//! virtual or a wall clock; no serving loop of its own, and no dependency on the simulator.
//! The `servelab-gpu` binary runs these on a GPU machine without the main binary (which needs
//! polars).

pub mod affinity;
pub mod backend;
pub mod calibrate;
pub mod checks;
pub mod cli;
pub mod clock;
pub mod commands;
pub mod conformance;
pub mod env;
pub mod ep;
pub mod multi_gpu;
pub mod peer;
pub mod placement;
pub mod report;
pub mod speed;
pub mod timing;
