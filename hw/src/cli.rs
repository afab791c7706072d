//! The GPU engine's command line, shared by `servelab hw` (the main binary) and the standalone
//! `servelab-gpu` (for GPU machines without a Rust toolchain, hw/README.md): one set of
//! subcommands and one dispatcher, so the two cannot drift apart.

use std::path::PathBuf;
use std::sync::Arc;

use crate::clock::ClockKind;
use crate::commands::{self, CalibrateOptions, CommandError, ConformanceOptions, RefitOptions};
use crate::conformance::{ConformanceFile, dry_run};
use servelab_core::engine::StepPlan;

/// For a command-line tool's `main`, before anything is printed: Rust ignores SIGPIPE, so a
/// print into a closed pipe (`servelab ... | head`) panics. Like other Unix tools, end quietly
/// (killed by the signal) instead. Used by both binaries.
pub fn end_quietly_on_closed_pipe() {
    #[cfg(unix)]
    // SAFETY: restores the default action of one signal; called at the start of `main`,
    // before any thread is started.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

#[derive(clap::Subcommand, Debug)]
pub enum HwCommand {
    /// Sweep prefill and decode step shapes through the CUDA backend, fit the simulator's
    /// cost model and write the hardware profile (plus the raw sweep as FILE.sweep.json.gz).
    Calibrate {
        /// Profile to write, e.g. sim/profiles/h200-measured.toml.
        #[arg(long)]
        out: PathBuf,
        /// Raw sweep (JSON, gzip-compressed when the name ends in .gz); next to the profile
        /// unless given.
        #[arg(long)]
        sweep_out: Option<PathBuf>,
        /// Small model and few shapes (a smoke run).
        #[arg(long)]
        quick: bool,
        /// Profile name.
        #[arg(long, default_value = "h200-measured")]
        name: String,
        /// Date written into the profile's header.
        #[arg(long, default_value = "unknown")]
        date: String,
        /// Commit the binary was built from, written into the profile's header.
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
        /// Free-run the cost model only, to size a config (no GPU needed; virtual clock).
        #[arg(long)]
        dry_run: bool,
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
        /// Also repeat the comparison with every time of the profile scaled by 0.90–1.10
        /// (`servelab hw conformance` only: the simulator is needed).
        #[arg(long)]
        sensitivity: bool,
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
    /// Every kernel against its CPU reference (NVRTC-compiling every variant), then the
    /// backend's cache-hit and replay checks.
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

fn gpu() -> Result<Arc<commands::GpuContext>, CommandError> {
    commands::open_gpu().map(Arc::new)
}

fn read(path: &std::path::Path) -> Result<String, CommandError> {
    commands::read_text(path).map_err(|cause| CommandError::Io {
        path: path.to_path_buf(),
        cause,
    })
}

impl HwCommand {
    /// A `conformance` command's options and its `--sensitivity` flag (`None` for another
    /// command).
    pub fn into_conformance(self) -> Option<(ConformanceOptions, bool)> {
        match self {
            HwCommand::Conformance {
                config,
                out,
                profile,
                record,
                clock,
                date,
                commit,
                prefix,
                sensitivity,
                ..
            } => Some((
                ConformanceOptions {
                    config,
                    out,
                    profile,
                    record,
                    clock,
                    date,
                    commit,
                    prefix,
                },
                sensitivity,
            )),
            _ => None,
        }
    }
}

/// Runs one command: results to stdout, progress through `log`. Fails when a GPU command
/// finds no GPU ([`CommandError::NoGpu`]) and when a conformance record does not replay to
/// the same plans.
pub fn run(cmd: HwCommand, log: &mut dyn FnMut(&str)) -> Result<(), CommandError> {
    match cmd {
        HwCommand::Refit { .. } => refit(cmd),
        HwCommand::Calibrate { .. } => calibrate(cmd, log),
        HwCommand::Conformance {
            config,
            out,
            profile,
            record: None,
            dry_run: true,
            ..
        } => conformance_dry_run(&config, &out, profile),
        HwCommand::Conformance { .. } => conformance(cmd, log),
        HwCommand::Speed {
            quick,
            seed,
            out,
            date,
        } => {
            let g = gpu()?;
            let md = commands::speed(&g, quick, seed, out.as_deref(), &date, log)?;
            println!("{md}");
            Ok(())
        }
        HwCommand::Check {
            quick,
            seed,
            out,
            date,
        } => {
            let md = commands::check(gpu()?, seed, quick, out.as_deref(), &date)?;
            println!("{md}");
            Ok(())
        }
    }
}

/// `refit`: the profile from a saved sweep (a record sets its decode offset), then how to
/// re-analyse the record with it.
fn refit(cmd: HwCommand) -> Result<(), CommandError> {
    let HwCommand::Refit {
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
    } = cmd
    else {
        unreachable!("run passes only refit commands here");
    };
    if !(0.0..=1.0).contains(&decode_offset_fraction) {
        return Err(CommandError::Failed(
            "--decode-offset-fraction must be in [0, 1]".into(),
        ));
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
    let r = commands::refit(&o)?;
    println!(
        "wrote {} (decode engine offset {:.3} ms)",
        out.display(),
        r.decode_offset_ns / 1e6
    );
    if let Some(rec) = record {
        // The re-analysis needs the simulator: `servelab hw refit` does it
        // (servelab-experiments); here the record only set the decode offset.
        println!(
            "decode offset from {} (steps 0..{}); re-analyse with `servelab hw \
             conformance CONFIG --record {} --profile {}` (report in {}{prefix})",
            rec.display(),
            r.fit_steps,
            rec.display(),
            out.display(),
            report_dir.display()
        );
    }
    Ok(())
}

/// `calibrate`: sweeps the GPU, prints the profile and where it went.
fn calibrate(cmd: HwCommand, log: &mut dyn FnMut(&str)) -> Result<(), CommandError> {
    let HwCommand::Calibrate {
        out,
        sweep_out,
        quick,
        name,
        date,
        commit,
        driver,
        workload,
        workload_seed,
    } = cmd
    else {
        unreachable!("run passes only calibrate commands here");
    };
    let o = CalibrateOptions {
        out: out.clone(),
        sweep_out,
        quick,
        name,
        date,
        commit,
        driver,
        workload,
        workload_seed,
    };
    let text = commands::calibrate(gpu()?, &o, log)?;
    println!("{text}");
    println!("wrote {}", out.display());
    Ok(())
}

/// `conformance --dry-run`: free-runs the cost model over the config's workload and writes
/// the record (no GPU).
fn conformance_dry_run(
    config: &std::path::Path,
    out: &std::path::Path,
    profile: Option<String>,
) -> Result<(), CommandError> {
    let text = read(config)?;
    let file = ConformanceFile::parse(&text, &config.display().to_string())?;
    let spec = profile.unwrap_or_else(|| file.conformance.profile.clone());
    let ptext = commands::profile_text(&spec)?;
    let mut rec = dry_run(&file, &ptext)?;
    rec.config = text;
    commands::write(
        out,
        "dry-run-record.json.gz",
        &serde_json::to_string(&rec).unwrap_or_default(),
    )?;
    let run = rec.run;
    let pre = run
        .steps
        .iter()
        .filter(|s| matches!(s.plan, StepPlan::Prefill(_)))
        .count();
    println!(
        "dry run: {} requests, {} steps ({pre} prefill), {:.1} ms of simulated device time (record: {}/dry-run-record.json.gz)",
        run.requests.len(),
        run.steps.len(),
        run.end_ns as f64 / 1e6,
        out.display()
    );
    Ok(())
}

/// `conformance`: the GPU run (or a record) replayed plan by plan; fails on a mismatch.
fn conformance(cmd: HwCommand, log: &mut dyn FnMut(&str)) -> Result<(), CommandError> {
    let (o, _) = cmd
        .into_conformance()
        .expect("run passes only conformance commands here");
    let (_, check) = commands::conformance(&o, log)?;
    println!(
        "{} plans, {} mismatched in the replay (the comparison with the simulator: \
         `servelab hw conformance --record`)",
        check.recorded_steps, check.mismatched_steps
    );
    if check.mismatched_steps > 0 {
        return Err(CommandError::Failed(format!(
            "{} of {} plans differ between the GPU run and its replay",
            check.mismatched_steps, check.recorded_steps
        )));
    }
    Ok(())
}
