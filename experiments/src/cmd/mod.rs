//! One module per subcommand: its clap arguments and its entry point.
pub mod econ;
pub mod eplb;
pub mod hit;
pub mod hw;
pub mod mrc;
pub mod plan;
pub mod replay;
pub mod run;
