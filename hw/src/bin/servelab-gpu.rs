//! `servelab-gpu`: runs the GPU checks, speed measurements, calibration and conformance on a
//! GPU machine, without the main `servelab` binary (which needs polars). The commands are
//! `servelab hw`'s (`servelab_hw::cli`). See hw/README.md.

use clap::Parser;
use servelab_hw::cli::{self, HwCommand};
use servelab_hw::commands::CommandError;

#[derive(Parser)]
#[command(
    name = "servelab-gpu",
    about = "GPU kernel checks, speed, calibration and conformance"
)]
struct Cli {
    #[command(subcommand)]
    cmd: HwCommand,
}

fn main() {
    cli::end_quietly_on_closed_pipe();
    if let Err(e) = cli::run(Cli::parse().cmd, &mut |l| eprintln!("{l}")) {
        eprintln!("error: {e}");
        std::process::exit(match e {
            CommandError::NoGpu => 2,
            _ => 1,
        });
    }
}
