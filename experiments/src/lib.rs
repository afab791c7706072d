//! servelab's experiments, outputs and command line as a library: the `servelab` binary
//! (`src/main.rs`) and the Python package (`experiments/python`) both call [`api`] and [`cli`],
//! so a number printed by the command and one returned to Python come from the same code.

pub mod api;
pub mod cli;
pub mod cmd;
pub mod config;
pub mod exp;
pub mod output;
pub mod plot;
pub mod speed;
pub mod sweep;
