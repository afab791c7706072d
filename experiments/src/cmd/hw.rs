//! `servelab hw`: the GPU engine's commands (issue 6): calibrate a hardware profile, run the
//! conformance comparison with the simulator, measure speed against the GPU's own ceilings,
//! and check kernels and the backend. Each needs a GPU (except `conformance --record` and
//! `--dry-run`, and `refit`); without one it says so and fails. The commands and their
//! dispatcher live in `servelab_hw::cli`, which the standalone `servelab-gpu` (hw/README.md)
//! shares; `conformance` (without `--dry-run`) is run here: the GPU side (record and replay)
//! is `servelab_hw::commands::conformance`, the comparison with the simulator is
//! [`crate::exp::conformance`] (the hw crate does not depend on the simulator).

use anyhow::{Result, anyhow};
pub use servelab_hw::cli::HwCommand;
use servelab_hw::commands::{self, ConformanceOptions};
use servelab_hw::conformance::{ConformanceFile, HandoffSection};
use servelab_sim::profile::{HardwareProfile, ProfileFiles};

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub command: HwCommand,
}

/// The hw crate's errors already name what failed.
pub fn run(args: Args) -> Result<()> {
    let log = &mut |l: &str| eprintln!("{l}");
    let cmd = args.command;
    // Without `--dry-run`, conformance is run here: the comparison needs the simulator.
    if matches!(cmd, HwCommand::Conformance { dry_run: false, .. }) {
        let (o, sensitivity) = cmd.into_conformance().expect("a conformance command");
        return conformance(&o, sensitivity, log);
    }
    servelab_hw::cli::run(cmd, log).map_err(|e| anyhow!("{e}"))
}

/// Records (or loads) and replays the GPU run, then compares it with the simulator's runs of
/// the same unit; writes `conformance.md` and `conformance.json` under `out`.
fn conformance(o: &ConformanceOptions, sensitivity: bool, log: &mut dyn FnMut(&str)) -> Result<()> {
    let (record, _) = commands::conformance(o, log).map_err(|e| anyhow!("{e}"))?;
    let profile = match &o.profile {
        Some(spec) => HardwareProfile::resolve(spec)?,
        None => servelab_hw::conformance::parse_profile(&record.policy_profile, "record.profile")?,
    };
    let handoff = handoff_model(o)?;
    let mut a = crate::exp::conformance::analyze(&record, profile.clone(), handoff.as_ref())
        .map_err(|e| anyhow!("{e}"))?;
    if sensitivity {
        a.sensitivity = crate::exp::conformance::sensitivity(
            &record,
            &profile,
            handoff.as_ref(),
            &crate::exp::conformance::SENSITIVITY_FACTORS,
        )
        .map_err(|e| anyhow!("{e}"))?;
    }
    let md = crate::exp::conformance::markdown(&a);
    std::fs::create_dir_all(&o.out)?;
    let md_path = o.out.join(format!("{}conformance.md", o.prefix));
    std::fs::write(&md_path, &md).map_err(|e| anyhow!("{}: {e}", md_path.display()))?;
    let json_path = o.out.join(format!("{}conformance.json", o.prefix));
    std::fs::write(&json_path, serde_json::to_string_pretty(&a)?)
        .map_err(|e| anyhow!("{}: {e}", json_path.display()))?;
    println!("{md}");
    println!(
        "{} plans, {} mismatched; step-time error median {:.1}%, P90 {:.1}%",
        a.steps,
        a.replay.mismatched_steps,
        100.0 * a.step_errors.all.abs_median,
        100.0 * a.step_errors.all.abs_p90
    );
    if a.replay.mismatched_steps > 0 {
        return Err(anyhow!(
            "{} of {} plans differ between the GPU run and its replay",
            a.replay.mismatched_steps,
            a.replay.recorded_steps
        ));
    }
    Ok(())
}

/// With `--record`, the simulator times handoffs with CONFIG's `[conformance.handoff]` model
/// (refitted models are tried on old records as `--profile` tries profiles); the GPU's side of
/// the record is left as it ran. Without a record the GPU runs CONFIG itself.
fn handoff_model(o: &ConformanceOptions) -> Result<Option<HandoffSection>> {
    if o.record.is_none() {
        return Ok(None);
    }
    let origin = o.config.display().to_string();
    let text = std::fs::read_to_string(&o.config).map_err(|e| anyhow!("{origin}: {e}"))?;
    let file = ConformanceFile::parse(&text, &origin)?;
    Ok(Some(file.conformance.handoff))
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
                sensitivity: false,
            },
        })
        .unwrap_err();
        assert!(e.to_string().contains("/nonexistent/record.json"), "{e}");
    }
}
