//! `servelab-gpu`: runs the GPU checks, speed measurements, calibration and conformance on a
//! GPU machine, without the main `servelab` binary (which needs polars). See hw/README.md.

use std::path::PathBuf;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use servelab_hw::clock::ClockKind;
use servelab_hw::commands::{self, CalibrateOptions, CommandError, ConformanceOptions};
use servelab_hw::conformance::{ConformanceFile, dry_run};

#[derive(Parser)]
#[command(
    name = "servelab-gpu",
    about = "GPU kernel checks, speed, calibration and conformance"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// NVRTC-compile every kernel variant, check every kernel against its CPU reference, then
    /// the backend's cache-hit and replay checks.
    Check {
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Directory for test-report.* and backend-check.*
        #[arg(long)]
        out: Option<PathBuf>,
        /// Date stamped into the report (the script passes `date -u +%F`)
        #[arg(long, default_value = "unknown")]
        date: String,
        /// Small backend model for the backend checks
        #[arg(long)]
        quick: bool,
    },
    /// Measure speed against this GPU's own copy / GEMM / pinned-copy ceilings.
    Speed {
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Small sizes (smoke run)
        #[arg(long)]
        quick: bool,
        #[arg(long)]
        out: Option<PathBuf>,
        #[arg(long, default_value = "unknown")]
        date: String,
    },
    /// Sweep prefill and decode step shapes through the CUDA backend and write a fitted
    /// hardware profile (the simulator's format) plus the raw sweep.
    Calibrate {
        /// Profile file to write (e.g. sim/profiles/h200-measured.toml)
        #[arg(long)]
        out: PathBuf,
        /// Raw sweep (JSON) next to the profile unless given
        #[arg(long)]
        sweep_out: Option<PathBuf>,
        #[arg(long)]
        quick: bool,
        #[arg(long, default_value = "h200-measured")]
        name: String,
        #[arg(long, default_value = "unknown")]
        date: String,
        /// Commit the binary was built from (the bundle script records it)
        #[arg(long, default_value = "unknown")]
        commit: String,
        /// Driver version as nvidia-smi reports it (the script passes it)
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
    /// Run a workload through the policies on the GPU, replay it, predict every step with the
    /// simulator and compare latency distributions (SPEC §16).
    Conformance {
        config: PathBuf,
        #[arg(long, default_value = ".")]
        out: PathBuf,
        /// Profile (name or .toml) instead of the config's `profile`
        #[arg(long)]
        profile: Option<String>,
        /// Analyse a record of an earlier GPU run (no GPU needed)
        #[arg(long)]
        record: Option<PathBuf>,
        /// Free-run the cost model only (sizing a config; no GPU needed; virtual clock)
        #[arg(long)]
        dry_run: bool,
        /// Clock of the GPU run: `wall` (arrivals released in real time, admitted while the
        /// device runs a step on its own thread) or `virtual` (time moves by the CUDA-event
        /// durations). The simulation always runs on the virtual clock.
        #[arg(long, value_enum, default_value_t = ClockKind::Wall)]
        clock: ClockKind,
        #[arg(long, default_value = "unknown")]
        date: String,
        #[arg(long, default_value = "unknown")]
        commit: String,
        /// File name prefix of the outputs
        #[arg(long, default_value = "")]
        prefix: String,
    },
}

fn log(l: &str) {
    eprintln!("{l}");
}

fn gpu() -> Result<Arc<servelab_kernels::GpuContext>, CommandError> {
    commands::open_gpu().map(Arc::new)
}

fn run(cmd: Cmd) -> Result<(), CommandError> {
    match cmd {
        Cmd::Check {
            seed,
            out,
            date,
            quick,
        } => {
            let md = commands::check(gpu()?, seed, quick, out.as_deref(), &date)?;
            println!("{md}");
        }
        Cmd::Speed {
            seed,
            quick,
            out,
            date,
        } => {
            let g = gpu()?;
            let md = commands::speed(&g, quick, seed, out.as_deref(), &date, &mut log)?;
            println!("{md}");
        }
        Cmd::Calibrate {
            out,
            sweep_out,
            quick,
            name,
            date,
            commit,
            driver,
            workload,
            workload_seed,
        } => {
            let o = CalibrateOptions {
                out,
                sweep_out,
                quick,
                name,
                date,
                commit,
                driver,
                workload,
                workload_seed,
            };
            let text = commands::calibrate(gpu()?, &o, &mut log)?;
            println!("{text}");
        }
        Cmd::Conformance {
            config,
            out,
            profile,
            record,
            dry_run: true,
            ..
        } if record.is_none() => {
            let text = std::fs::read_to_string(&config).map_err(|cause| CommandError::Io {
                path: config.clone(),
                cause,
            })?;
            let file = ConformanceFile::parse(&text, &config.display().to_string())?;
            let spec = profile.unwrap_or_else(|| file.conformance.profile.clone());
            let ptext = std::fs::read_to_string(&spec).map_err(|cause| CommandError::Io {
                path: PathBuf::from(&spec),
                cause,
            })?;
            let run = dry_run(&file, &ptext)?;
            let pre = run
                .steps
                .iter()
                .filter(|s| matches!(s.plan, servelab_core::engine::StepPlan::Prefill(_)))
                .count();
            println!(
                "dry run: {} requests, {} steps ({pre} prefill), {:.1} ms of simulated device time (out {})",
                run.requests.len(),
                run.steps.len(),
                run.end_ns as f64 / 1e6,
                out.display()
            );
        }
        Cmd::Conformance {
            config,
            out,
            profile,
            record,
            clock,
            date,
            commit,
            prefix,
            ..
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
            commands::conformance(&o, &mut log)?;
        }
    }
    Ok(())
}

fn main() {
    if let Err(e) = run(Cli::parse().cmd) {
        eprintln!("error: {e}");
        std::process::exit(match e {
            CommandError::NoGpu => 2,
            _ => 1,
        });
    }
}
