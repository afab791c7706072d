//! `servelab hw`: the GPU engine's commands (issue 6): calibrate a hardware profile, run the
//! conformance comparison with the simulator, measure speed against the GPU's own ceilings,
//! and check kernels and the backend. Each needs a GPU (except `conformance --record` and
//! `--dry-run`, and `refit`); without one it says so and fails. The commands and their
//! dispatcher live in `servelab_hw::cli`, which the standalone `servelab-gpu` (hw/README.md)
//! shares.

use anyhow::{Result, anyhow};
pub use servelab_hw::cli::HwCommand;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub command: HwCommand,
}

/// The hw crate's errors already name what failed.
pub fn run(args: Args) -> Result<()> {
    servelab_hw::cli::run(args.command, &mut |l| eprintln!("{l}")).map_err(|e| anyhow!("{e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use servelab_hw::clock::ClockKind;
    use servelab_hw::commands;
    use std::path::PathBuf;

    /// Without a GPU every GPU command fails with the no-GPU message (with one, nothing to
    /// check here: the GPU tests live in servelab-hw).
    #[test]
    fn without_a_gpu_commands_say_so() {
        if commands::open_gpu().is_ok() {
            return;
        }
        let e = run(Args {
            command: HwCommand::Speed {
                quick: true,
                seed: 1,
                out: None,
                date: "d".into(),
            },
        })
        .unwrap_err();
        assert!(e.to_string().starts_with("no GPU"), "{e}");
    }

    /// A missing record is reported by its path, before any GPU is needed.
    #[test]
    fn conformance_names_a_missing_record() {
        let e = run(Args {
            command: HwCommand::Conformance {
                config: PathBuf::from("experiments/configs/conformance.toml"),
                out: std::env::temp_dir(),
                profile: None,
                record: Some(PathBuf::from("/nonexistent/record.json")),
                dry_run: false,
                clock: ClockKind::Wall,
                date: "d".into(),
                commit: "c".into(),
                prefix: String::new(),
            },
        })
        .unwrap_err();
        assert!(e.to_string().contains("/nonexistent/record.json"), "{e}");
    }
}
