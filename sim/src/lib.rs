//! servelab-sim: the trace-level replay and the discrete-event serving simulator.

pub mod acceptance;
pub mod cluster;
pub mod cost;
pub mod dspark;
pub mod env;
pub mod events;
pub mod metrics;
pub mod mrc;
pub mod profile;
pub mod replay;
pub mod service;
mod windows;
