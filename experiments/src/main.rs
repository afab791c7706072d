//! `servelab`: experiments, trace replay, single-decision explanations and instruments. The
//! commands themselves live in the library (`servelab_experiments::cli`), which the Python
//! package shares.

use clap::Parser;
use servelab_experiments::cli::{Cli, dispatch};
use std::process::ExitCode;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    servelab_hw::cli::end_quietly_on_closed_pipe();
    match dispatch(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
