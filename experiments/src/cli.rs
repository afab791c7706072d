//! The `servelab` command line: its clap definition and the dispatch to each subcommand. The
//! Python package parses its keyword arguments with the same definition, so both reject a bad
//! flag value with the same message.

use crate::cmd;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "servelab",
    version,
    about = "Policies of large-scale LLM serving, measured in a simulator and on a GPU"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand)]
pub enum Command {
    /// Run an experiment config (tables, plots, summary and manifest).
    Run(cmd::run::Args),
    /// Explain one hit decision.
    Hit(cmd::hit::Args),
    /// Replay a trace through the block store (no timing) and print hit rates.
    Replay(cmd::replay::Args),
    /// Hit-rate curves of a trace for every store capacity and TTL in one pass.
    Mrc(cmd::mrc::Args),
    /// DeepSeek EPLB: place redundant experts on GPUs.
    Eplb(cmd::eplb::Args),
    /// Economics of SPEC §12: revenue, pool sizes and the storage band.
    Econ(cmd::econ::Args),
    /// Capacity planning: the fewest prefill and decode GPUs meeting SLOs, and the store size.
    Plan(cmd::plan::Args),
    /// The GPU engine: calibration, conformance with the simulator, speed ratios, checks.
    Hw(cmd::hw::Args),
}

/// Runs one parsed command as the binary does (printing its report).
pub fn dispatch(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Run(a) => cmd::run::run(a),
        Command::Hit(a) => cmd::hit::run(a),
        Command::Replay(a) => cmd::replay::run(a),
        Command::Mrc(a) => cmd::mrc::run(a),
        Command::Eplb(a) => cmd::eplb::run(a),
        Command::Econ(a) => cmd::econ::run(a),
        Command::Plan(a) => cmd::plan::run(a),
        Command::Hw(a) => cmd::hw::run(a),
    }
}
