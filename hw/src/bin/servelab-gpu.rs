//! `servelab-gpu`: runs the GPU checks and speed measurements on a GPU machine, without the
//! main `servelab` binary. See hw/README.md.

use std::path::PathBuf;
use std::time::Instant;

use clap::{Parser, Subcommand};
use servelab_hw::{report, speed};
use servelab_kernels::GpuContext;

#[derive(Parser)]
#[command(name = "servelab-gpu", about = "GPU kernel checks and speed report")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// NVRTC-compile every kernel variant, then check every kernel against its CPU reference.
    TestReport {
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Directory for test-report.md / .json
        #[arg(long)]
        out: Option<PathBuf>,
        /// Date stamped into the report (the script passes `date -u +%F`)
        #[arg(long, default_value = "unknown")]
        date: String,
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
}

fn write(out: &Option<PathBuf>, name: &str, text: &str) {
    let Some(dir) = out else { return };
    if let Err(e) = std::fs::create_dir_all(dir).and_then(|_| std::fs::write(dir.join(name), text))
    {
        eprintln!("cannot write {}: {e}", dir.join(name).display());
    }
}

fn open_gpu() -> GpuContext {
    match GpuContext::try_new() {
        Ok(Some(g)) => g,
        Ok(None) => {
            eprintln!("no GPU: libcuda not found or no device");
            std::process::exit(2);
        }
        Err(e) => {
            eprintln!("GPU present but unusable: {e}");
            std::process::exit(1);
        }
    }
}

fn main() {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::TestReport { seed, out, date } => {
            let gpu = open_gpu();
            let mut md = report::header(
                &gpu.name(),
                gpu.compute_capability(),
                gpu.driver_version(),
                &date,
            );
            let t0 = Instant::now();
            match servelab_kernels::sources::compile_all(gpu.compute_capability()) {
                Ok(v) => md.push_str(&format!(
                    "NVRTC compiled {} kernel variants in {:.2} s.\n\n",
                    v.len(),
                    t0.elapsed().as_secs_f64()
                )),
                Err(e) => md.push_str(&format!("NVRTC compile FAILED: {e}\n\n")),
            }
            let results = servelab_kernels::check::run_all(&gpu, seed);
            md.push_str(&report::checks_markdown(&results));
            let failed = results
                .iter()
                .filter(|r| !matches!(r, Ok(c) if c.passed))
                .count();
            md.push_str(&format!("\n{} checks, {failed} failed.\n", results.len()));
            println!("{md}");
            write(&out, "test-report.md", &md);
            let json: Vec<serde_json::Value> = results
                .iter()
                .map(|r| match r {
                    Ok(c) => serde_json::to_value(c).unwrap_or_default(),
                    Err((n, e)) => {
                        serde_json::json!({"name": n, "error": e.to_string(), "passed": false})
                    }
                })
                .collect();
            write(
                &out,
                "test-report.json",
                &serde_json::to_string_pretty(&json).unwrap_or_default(),
            );
            if failed > 0 {
                std::process::exit(1);
            }
        }
        Cmd::Speed {
            seed,
            quick,
            out,
            date,
        } => {
            let gpu = open_gpu();
            let cfg = if quick {
                speed::SpeedConfig::quick(seed)
            } else {
                speed::SpeedConfig::full(seed)
            };
            match speed::run(&gpu, &cfg, |l| eprintln!("{l}")) {
                Ok(rep) => {
                    let md = format!(
                        "{}{}",
                        report::header(&rep.gpu, rep.compute_capability, rep.driver_version, &date),
                        report::speed_markdown(&rep)
                    );
                    println!("{md}");
                    write(&out, "speed.md", &md);
                    write(
                        &out,
                        "speed.json",
                        &serde_json::to_string_pretty(&rep).unwrap_or_default(),
                    );
                }
                Err(e) => {
                    eprintln!("speed failed: {e}");
                    std::process::exit(1);
                }
            }
        }
    }
}
