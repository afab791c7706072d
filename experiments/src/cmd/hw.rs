//! `servelab hw`: the GPU engine's commands (issue 6): calibrate a hardware profile, run the
//! conformance comparison with the simulator, measure speed against the GPU's own ceilings,
//! and check kernels and the backend. Each needs a GPU (except `conformance --record`, which
//! analyses an earlier GPU run); without one it says so and fails. On a GPU machine without a
//! Rust toolchain, `servelab-gpu` (hw/README.md) runs the same commands.

use anyhow::{Result, anyhow};
use servelab_hw::clock::ClockKind;
use servelab_hw::commands::{
    self, CalibrateOptions, CommandError, ConformanceOptions, RefitOptions,
};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub command: HwCommand,
}

#[derive(clap::Subcommand)]
pub enum HwCommand {
    /// Sweep prefill and decode step shapes through the CUDA backend, fit the simulator's
    /// cost model and write the hardware profile (plus the raw sweep as FILE.sweep.json).
    Calibrate {
        /// Profile to write, e.g. sim/profiles/h200-measured.toml.
        #[arg(long)]
        out: PathBuf,
        /// Small model and few shapes (a smoke run).
        #[arg(long)]
        quick: bool,
        /// Profile name.
        #[arg(long, default_value = "h200-measured")]
        name: String,
        /// Date written into the profile's header.
        #[arg(long, default_value = "unknown")]
        date: String,
        /// Commit written into the profile's header.
        #[arg(long, default_value = "unknown")]
        commit: String,
        /// Driver version written into the profile's header (as nvidia-smi reports it).
        #[arg(long)]
        driver: Option<String>,
        /// A conformance config whose workload (run under --workload-seed) joins the fit, so
        /// the profile sees the step shapes of a running engine as well as the grid.
        #[arg(long)]
        workload: Option<PathBuf>,
        /// Seed of that workload run (default: the config's seed + 1).
        #[arg(long)]
        workload_seed: Option<u64>,
    },
    /// Run a workload through the same policies on the GPU and in the simulator (SPEC §16):
    /// decisions replayed plan by plan, step-time error, TTFT/TPOT distributions.
    Conformance {
        /// Conformance config, e.g. experiments/configs/conformance.toml.
        config: PathBuf,
        /// Folder for conformance.md, conformance.json and conformance-record.json.
        #[arg(long, default_value = "results/conformance")]
        out: PathBuf,
        /// Profile (shipped name or .toml) instead of the config's `profile`.
        #[arg(long)]
        profile: Option<String>,
        /// Analyse the record of an earlier GPU run instead of running the GPU (no GPU needed).
        #[arg(long)]
        record: Option<PathBuf>,
        /// Clock of the GPU run: `wall` (arrivals released in real time and admitted while the
        /// device runs a step on its own thread) or `virtual` (time moves by the CUDA-event
        /// durations). The free-running simulation always uses the virtual clock; a record
        /// carries its own.
        #[arg(long, value_enum, default_value_t = ClockKind::Wall)]
        clock: ClockKind,
        #[arg(long, default_value = "unknown")]
        date: String,
        #[arg(long, default_value = "unknown")]
        commit: String,
        /// Prefix of the output file names (e.g. 2026-11-29-nvidia-h200-).
        #[arg(long, default_value = "")]
        prefix: String,
    },
    /// Re-fit a profile from a saved calibration sweep (no GPU needed); with a conformance
    /// record, its first decode steps set the engine-loop offset and the rest are held out, and
    /// the record is re-analysed with the new profile.
    Refit {
        /// The sweep JSON `calibrate` wrote (FILE.sweep.json).
        #[arg(long)]
        sweep: PathBuf,
        /// Profile to write.
        #[arg(long)]
        out: PathBuf,
        /// A conformance record of the same GPU.
        #[arg(long)]
        record: Option<PathBuf>,
        /// Share of the record's decode steps (in run order) that set the offset.
        #[arg(long, default_value_t = 0.5)]
        decode_offset_fraction: f64,
        /// Folder for the re-analysis (conformance-refit.md/.json) when a record is given.
        #[arg(long, default_value = "results/conformance")]
        report_dir: PathBuf,
        #[arg(long, default_value = "")]
        prefix: String,
        #[arg(long, default_value = "h200-measured")]
        name: String,
        /// Header facts of the original calibration (the sweep does not hold them).
        #[arg(long, default_value = "unknown")]
        gpu: String,
        #[arg(long, default_value = "unknown")]
        driver: String,
        #[arg(long, default_value = "unknown")]
        date: String,
        #[arg(long, default_value = "unknown")]
        commit: String,
    },
    /// Decode attention, prefill GEMMs and block swap as ratios to this GPU's ceilings.
    Speed {
        /// Small sizes (a smoke run).
        #[arg(long)]
        quick: bool,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Folder for speed.md / speed.json (printed only when absent).
        #[arg(long)]
        out: Option<PathBuf>,
        #[arg(long, default_value = "unknown")]
        date: String,
    },
    /// Every kernel against its CPU reference, then the backend's cache-hit and replay checks.
    Check {
        /// Small backend model for the backend checks.
        #[arg(long)]
        quick: bool,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Folder for test-report.* and backend-check.* (printed only when absent).
        #[arg(long)]
        out: Option<PathBuf>,
        #[arg(long, default_value = "unknown")]
        date: String,
    },
}

fn log(line: &str) {
    eprintln!("{line}");
}

fn gpu() -> Result<Arc<commands::GpuContext>> {
    commands::open_gpu().map(Arc::new).map_err(wrap)
}

/// The hw crate's errors, whose messages already name what failed.
fn wrap(e: CommandError) -> anyhow::Error {
    anyhow!("{e}")
}

pub fn run(args: Args) -> Result<()> {
    match args.command {
        HwCommand::Refit {
            sweep,
            out,
            record,
            decode_offset_fraction,
            report_dir,
            prefix,
            name,
            gpu,
            driver,
            date,
            commit,
        } => {
            if !(0.0..=1.0).contains(&decode_offset_fraction) {
                return Err(anyhow!("--decode-offset-fraction must be in [0, 1]"));
            }
            let o = RefitOptions {
                sweep: sweep.clone(),
                record: record.clone(),
                decode_offset_fraction,
                out: out.clone(),
                name,
                gpu,
                driver,
                date,
                commit,
            };
            let r = commands::refit(&o).map_err(wrap)?;
            println!(
                "wrote {} (decode engine offset {:.3} ms)",
                out.display(),
                r.decode_offset_ns / 1e6
            );
            if let Some(rec) = record {
                let sources = format!(
                    "Cost-model shapes fitted on the sweep `{}`; the decode engine offset on the first {:.0}% of the record's decode steps; the remaining steps are held out.",
                    sweep.display(),
                    100.0 * decode_offset_fraction
                );
                commands::refit_conformance(&rec, &r, &report_dir, &prefix, &sources)
                    .map_err(wrap)?;
                println!(
                    "wrote {}",
                    report_dir
                        .join(format!("{prefix}conformance-refit.md"))
                        .display()
                );
            }
        }
        HwCommand::Calibrate {
            out,
            quick,
            name,
            date,
            commit,
            driver,
            workload,
            workload_seed,
        } => {
            let o = CalibrateOptions {
                out: out.clone(),
                sweep_out: None,
                quick,
                name,
                date,
                commit,
                driver,
                workload,
                workload_seed,
            };
            commands::calibrate(gpu()?, &o, &mut log).map_err(wrap)?;
            println!("wrote {}", out.display());
        }
        HwCommand::Conformance {
            config,
            out,
            profile,
            record,
            clock,
            date,
            commit,
            prefix,
        } => {
            let o = ConformanceOptions {
                config,
                out,
                profile,
                record,
                clock,
                date,
                commit,
                prefix,
            };
            let a = commands::conformance(&o, &mut log).map_err(wrap)?;
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
        }
        HwCommand::Speed {
            quick,
            seed,
            out,
            date,
        } => {
            let g = gpu()?;
            let md =
                commands::speed(&g, quick, seed, out.as_deref(), &date, &mut log).map_err(wrap)?;
            println!("{md}");
        }
        HwCommand::Check {
            quick,
            seed,
            out,
            date,
        } => {
            let md = commands::check(gpu()?, seed, quick, out.as_deref(), &date).map_err(wrap)?;
            println!("{md}");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
