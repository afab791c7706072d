//! `servelab-gpu`: runs the GPU checks and speed measurements on a GPU machine, without the
//! main `servelab` binary. See hw/README.md.

use std::path::PathBuf;
use std::time::Instant;

use clap::{Parser, Subcommand};
use servelab_hw::backend::{BackendConfig, CudaBackend, ModelShape};
use servelab_hw::{calibrate, checks, report, speed};
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
    },
    /// Backend correctness: cache hit + compute vs the cold path, bounded vs full replay.
    BackendCheck {
        #[arg(long)]
        out: Option<PathBuf>,
        #[arg(long)]
        quick: bool,
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
        Cmd::Calibrate {
            out,
            sweep_out,
            quick,
            name,
            date,
            commit,
            driver,
        } => calibrate(out, sweep_out, quick, name, date, commit, driver),
        Cmd::BackendCheck { out, quick } => backend_check(out, quick),
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

fn backend(quick: bool, hbm_blocks: usize) -> CudaBackend {
    let gpu = std::sync::Arc::new(open_gpu());
    let model = if quick {
        ModelShape {
            encoder_layers: 4,
            decoder_layers: 4,
            hidden: 512,
            experts: 4,
            expert_ffn: 512,
            vocab: 2048,
            ..ModelShape::default()
        }
    } else {
        ModelShape::default()
    };
    let cfg = BackendConfig {
        model,
        hbm_blocks,
        host_blocks: 256,
        ring_slots: 80,
        swa_host_slots: 16,
        ..BackendConfig::default()
    };
    match CudaBackend::new(gpu, cfg) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("backend init failed: {e}");
            std::process::exit(1);
        }
    }
}

fn calibrate(
    out: PathBuf,
    sweep_out: Option<PathBuf>,
    quick: bool,
    name: String,
    date: String,
    commit: String,
    driver: Option<String>,
) {
    let t0 = Instant::now();
    let mut b = backend(quick, if quick { 512 } else { 8448 });
    eprintln!("backend ready in {:.1} s", t0.elapsed().as_secs_f64());
    let cfg = if quick {
        calibrate::CalibrateConfig::quick()
    } else {
        calibrate::CalibrateConfig::full()
    };
    let sweep = match calibrate::sweep(&mut b, &cfg, |l| eprintln!("{l}")) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("calibration sweep failed: {e}");
            std::process::exit(1);
        }
    };
    // Swap-in rate of SPEC-sized blocks (128 tokens x 890 B), gather kernel over mapped
    // pinned memory: the path the backend uses.
    let swap = match speed::measure_swap(b.gpu(), 128 * 890, if quick { 64 } else { 2048 }, 5, 1) {
        Ok((r, _)) => r
            .iter()
            .find(|r| r.what.contains("gather"))
            .map(|r| r.rate * 1e9),
        Err(e) => {
            eprintln!("swap measurement failed: {e}");
            None
        }
    }
    .unwrap_or(5.0e10);
    let m = b.config().model.clone();
    let fit = calibrate::fit(&sweep, m.encoder_layers, m.decoder_layers, swap);
    let g = b.gpu();
    let header = calibrate::ProfileHeader {
        name,
        gpu: g.name(),
        driver: format!(
            "{}, CUDA driver API {}",
            driver.unwrap_or_else(|| "unknown".into()),
            g.driver_version()
        ),
        date,
        commit,
        model: format!(
            "{}+{} layers, hidden {}, {} kv heads x {} x d {}, {} experts top-{} ffn {}",
            m.encoder_layers,
            m.decoder_layers,
            m.hidden,
            m.kv_heads,
            m.group,
            m.head_dim,
            m.experts,
            m.top_k,
            m.expert_ffn
        ),
    };
    let text = calibrate::profile_toml(&fit, &sweep, &header);
    println!("{text}");
    if let Some(dir) = out.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    if let Err(e) = std::fs::write(&out, &text) {
        eprintln!("cannot write {}: {e}", out.display());
        std::process::exit(1);
    }
    let sweep_path = sweep_out.unwrap_or_else(|| out.with_extension("sweep.json"));
    let json = serde_json::json!({"config": cfg, "model": m, "sweep": sweep, "fit": fit});
    if let Err(e) = std::fs::write(
        &sweep_path,
        serde_json::to_string_pretty(&json).unwrap_or_default(),
    ) {
        eprintln!("cannot write {}: {e}", sweep_path.display());
    }
    eprintln!("calibration done in {:.1} s", t0.elapsed().as_secs_f64());
}

fn backend_check(out: Option<PathBuf>, quick: bool) {
    let mut b = backend(quick, 256);
    let prompts: &[(usize, usize)] = if quick {
        &[(300, 256)]
    } else {
        &[(600, 384), (2000, 1280)]
    };
    match checks::replay_checks(&mut b, prompts, 140) {
        Ok(v) => {
            let mut md = String::from(
                "| comparison | max abs logit diff | mean abs | top-token agreement |\n|---|---|---|---|\n",
            );
            for d in &v {
                md.push_str(&format!(
                    "| {} | {:.4e} | {:.4e} | {:.0}% |\n",
                    d.what,
                    d.max_abs,
                    d.mean_abs,
                    100.0 * d.top_token_agreement
                ));
            }
            println!("{md}");
            write(&out, "backend-check.md", &md);
            write(
                &out,
                "backend-check.json",
                &serde_json::to_string_pretty(&v).unwrap_or_default(),
            );
        }
        Err(e) => {
            eprintln!("backend check failed: {e}");
            std::process::exit(1);
        }
    }
}
