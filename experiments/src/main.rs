//! `servelab`: experiments, trace replay, single-decision explanations and instruments.

use clap::{Parser, Subcommand};
use std::process::ExitCode;

mod cmd;
mod config;
mod exp;
mod output;
mod plot;
mod sweep;

#[derive(Parser)]
#[command(
    name = "servelab",
    version,
    about = "Policies of large-scale LLM serving, measured in a simulator and on a GPU"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
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

fn main() -> ExitCode {
    servelab_hw::cli::end_quietly_on_closed_pipe();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(a) => cmd::run::run(a),
        Command::Hit(a) => cmd::hit::run(a),
        Command::Replay(a) => cmd::replay::run(a),
        Command::Mrc(a) => cmd::mrc::run(a),
        Command::Eplb(a) => cmd::eplb::run(a),
        Command::Econ(a) => cmd::econ::run(a),
        Command::Plan(a) => cmd::plan::run(a),
        Command::Hw(a) => cmd::hw::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
