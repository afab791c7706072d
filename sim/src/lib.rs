//! servelab-sim: the trace-level replay and the discrete-event serving simulator.

pub mod replay;
