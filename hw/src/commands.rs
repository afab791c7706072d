//! The GPU commands shared by `servelab-gpu` (runs on a GPU machine without the main binary)
//! and `servelab hw`: calibrate, conformance, speed, check. Each writes its files to a folder
//! and reports progress through `log`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

pub use servelab_kernels::GpuContext;

use crate::backend::{AttentionKind, BackendConfig, BackendError, CudaBackend, ModelShape};
use crate::clock::ClockKind;
use crate::conformance::{self, ConformanceError, ConformanceFile, Record, parse_profile};
use crate::{calibrate, checks, report, speed};

/// Why a command failed.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error(
        "no GPU: the CUDA driver library (libcuda) was not found or no device is visible; run \
         this on a GPU machine (see hw/README.md for the build-here, run-there bundle)"
    )]
    NoGpu,
    #[error("GPU present but unusable: {0}")]
    Gpu(#[from] servelab_kernels::KernelError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Conformance(#[from] ConformanceError),
    #[error(transparent)]
    Config(#[from] servelab_core::ConfigError),
    #[error("{path}: {cause}")]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("{path}: {cause}")]
    Json {
        path: PathBuf,
        cause: serde_json::Error,
    },
    #[error("{0}")]
    Failed(String),
}

/// The first GPU, or [`CommandError::NoGpu`].
pub fn open_gpu() -> Result<GpuContext, CommandError> {
    match GpuContext::try_new()? {
        Some(g) => Ok(g),
        None => Err(CommandError::NoGpu),
    }
}

/// Writes `text` to `dir/name`, gzip-compressed when the name ends in `.gz` (records and
/// calibration sweeps are megabytes of JSON).
pub fn write(dir: &Path, name: &str, text: &str) -> Result<PathBuf, CommandError> {
    let path = dir.join(name);
    std::fs::create_dir_all(dir)
        .and_then(|_| {
            if name.ends_with(".gz") {
                std::fs::write(&path, gzip(text.as_bytes())?)
            } else {
                std::fs::write(&path, text)
            }
        })
        .map_err(|cause| CommandError::Io {
            path: path.clone(),
            cause,
        })?;
    Ok(path)
}

fn gzip(bytes: &[u8]) -> std::io::Result<Vec<u8>> {
    use std::io::Write;
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    enc.write_all(bytes)?;
    enc.finish()
}

/// Reads a text file, decompressing it when its name ends in `.gz`.
pub fn read_text(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    if path.extension().is_some_and(|e| e == "gz") {
        let mut text = String::new();
        flate2::read::GzDecoder::new(std::fs::File::open(path)?).read_to_string(&mut text)?;
        Ok(text)
    } else {
        std::fs::read_to_string(path)
    }
}

fn read(path: &Path) -> Result<String, CommandError> {
    read_text(path).map_err(|cause| CommandError::Io {
        path: path.to_path_buf(),
        cause,
    })
}

/// The backend the calibration and the backend checks use (`quick`: 4 + 4 small layers).
pub fn bench_backend(
    gpu: Arc<GpuContext>,
    quick: bool,
    hbm_blocks: usize,
) -> Result<CudaBackend, BackendError> {
    bench_backend_of(gpu, bench_model(quick), hbm_blocks)
}

/// The model [`bench_backend`] builds: the default shape, or a small one for `--quick`.
pub fn bench_model(quick: bool) -> ModelShape {
    if quick {
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
    }
}

/// A benchmark backend (small host tiers, `hbm_blocks` in HBM) for `model`.
pub fn bench_backend_of(
    gpu: Arc<GpuContext>,
    model: ModelShape,
    hbm_blocks: usize,
) -> Result<CudaBackend, BackendError> {
    CudaBackend::new(
        gpu,
        BackendConfig {
            model,
            hbm_blocks,
            host_blocks: 256,
            ring_slots: 80,
            swa_host_slots: 16,
            ..BackendConfig::default()
        },
    )
}

/// Options of the calibration.
#[derive(Debug, Clone)]
pub struct CalibrateOptions {
    pub out: PathBuf,
    /// Raw sweep JSON (default: next to the profile, `.sweep.json`).
    pub sweep_out: Option<PathBuf>,
    pub quick: bool,
    pub name: String,
    pub date: String,
    pub commit: String,
    pub driver: Option<String>,
    /// A conformance config whose workload, run under `workload_seed`, joins the fit.
    pub workload: Option<PathBuf>,
    /// Seed of that run (default: the config's seed + 1, so a conformance run of the same
    /// config stays held out).
    pub workload_seed: Option<u64>,
}

/// The shipped profile fitted to the published operating points (the simulator's default; the
/// file stays with the simulator's profiles, this crate only reads its text).
pub const SM100_PUBLISHED: &str = include_str!("../../sim/profiles/sm100-published.toml");

/// The text of the profile `spec` names (`sm100-published` or a `.toml` path), validated.
pub fn profile_text(spec: &str) -> Result<String, CommandError> {
    let text = match spec {
        "sm100-published" => SM100_PUBLISHED.to_string(),
        s if s.ends_with(".toml") => read(Path::new(s))?,
        other => {
            return Err(servelab_core::ConfigError::invalid(
                "profile",
                format!("unknown profile `{other}` (shipped: sm100-published; or a .toml path)"),
            )
            .into());
        }
    };
    parse_profile(&text, spec)?;
    Ok(text)
}

/// A calibration workload's config: where it came from, its text and the parsed file.
type WorkloadConfig = (String, String, ConformanceFile);

fn read_workload_config(path: Option<&Path>) -> Result<Option<WorkloadConfig>, CommandError> {
    let Some(path) = path else {
        return Ok(None);
    };
    let origin = path.display().to_string();
    let config_text = read(path)?;
    let file = ConformanceFile::parse(&config_text, &origin)?;
    Ok(Some((origin, config_text, file)))
}

/// Swap-in rate (bytes/s) of SPEC-sized blocks (128 tokens x 890 B), gather kernel over
/// mapped pinned memory: the path the backend uses. A failed measurement is logged and the
/// rate falls back to 50 GB/s.
fn measure_swap_in_rate(b: &CudaBackend, quick: bool, log: &mut dyn FnMut(&str)) -> f64 {
    match speed::measure_swap(b.gpu(), 128 * 890, if quick { 64 } else { 2048 }, 5, 1) {
        Ok((r, _)) => r
            .iter()
            .find(|r| r.what.contains("gather"))
            .map(|r| r.rate * 1e9),
        Err(e) => {
            log(&format!("swap measurement failed: {e}"));
            None
        }
    }
    .unwrap_or(5.0e10)
}

/// Runs the calibration workload into `sweep` on a backend of its own: the grid's backend `b`
/// goes first (one backend at a time). Fails when the workload's model is not the calibrated
/// model `m`.
fn add_calibration_workload(
    gpu: &Arc<GpuContext>,
    b: CudaBackend,
    (origin, config_text, file): WorkloadConfig,
    o: &CalibrateOptions,
    m: &ModelShape,
    sweep: &mut calibrate::Sweep,
    log: &mut dyn FnMut(&str),
) -> Result<(), CommandError> {
    if file.backend.model != *m {
        return Err(CommandError::Failed(format!(
            "{origin}: [backend.model] differs from the calibrated model; the workload's \
             steps would describe another model"
        )));
    }
    let w = calibrate::CalibrationWorkload {
        profile_text: profile_text(&file.conformance.profile)?,
        seed: match o.workload_seed {
            Some(s) => s,
            None => file.seed()?.wrapping_add(1),
        },
        config_text,
        origin,
    };
    // One backend at a time: the grid's pools go before the workload's are made.
    drop(b);
    let t1 = Instant::now();
    calibrate::add_workload(gpu.clone(), sweep, &w)?;
    log(&format!(
        "calibration workload (seed {}): {} steps in {:.1} s",
        w.seed,
        sweep.workload.len(),
        t1.elapsed().as_secs_f64()
    ));
    Ok(())
}

/// The model line of a profile's header.
fn model_summary(m: &ModelShape) -> String {
    let attention = match m.attention {
        AttentionKind::Gqa => format!("{} kv heads x {} x d {}", m.kv_heads, m.group, m.head_dim),
        AttentionKind::Mla => format!(
            "MLA latent {} (value {}, rope {}) x {} heads",
            m.head_dim, m.value_dim, m.rope_dim, m.group
        ),
    };
    format!(
        "{}+{} layers, hidden {}, {attention}, {} experts top-{} ffn {}",
        m.encoder_layers, m.decoder_layers, m.hidden, m.experts, m.top_k, m.expert_ffn
    )
}

/// The header of a freshly calibrated profile: this GPU, its driver, the options' facts.
fn calibrated_header(
    gpu: &GpuContext,
    o: &CalibrateOptions,
    m: &ModelShape,
) -> calibrate::ProfileHeader {
    calibrate::ProfileHeader {
        name: o.name.clone(),
        gpu: gpu.name(),
        driver: format!(
            "{}, CUDA driver API {}",
            o.driver.clone().unwrap_or_else(|| "unknown".into()),
            gpu.driver_version()
        ),
        date: o.date.clone(),
        commit: o.commit.clone(),
        model: model_summary(m),
        notes: Vec::new(),
    }
}

/// Writes the profile to `o.out` and the raw sweep with its config, model and fit next to it
/// (or to `o.sweep_out`).
fn write_calibration(
    o: &CalibrateOptions,
    text: &str,
    json: &serde_json::Value,
) -> Result<(), CommandError> {
    let dir = o.out.parent().unwrap_or(Path::new("."));
    let name = o
        .out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "profile.toml".into());
    write(dir, &name, text)?;
    let sweep_path = o
        .sweep_out
        .clone()
        .unwrap_or_else(|| o.out.with_extension("sweep.json.gz"));
    write(
        sweep_path.parent().unwrap_or(Path::new(".")),
        &sweep_path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "sweep.json".into()),
        &serde_json::to_string_pretty(json).unwrap_or_default(),
    )?;
    Ok(())
}

/// Sweeps step shapes through the CUDA backend, fits the profile and writes it. Returns the
/// profile text.
pub fn calibrate(
    gpu: Arc<GpuContext>,
    o: &CalibrateOptions,
    log: &mut dyn FnMut(&str),
) -> Result<String, CommandError> {
    // Timed steps are host-bound: keep the launching thread on one CPU (see affinity.rs), as
    // the conformance runs that are compared with this profile do.
    let pin = crate::affinity::pin_to_current_cpu();
    log(&match &pin {
        Some(p) => format!("pinned to CPU {}", p.cpu),
        None => "not pinned to a CPU".to_string(),
    });
    // With a calibration workload the grid runs on the workload's model (its
    // `[backend.model]`), so grid points and workload steps describe one model.
    let workload = read_workload_config(o.workload.as_deref())?;
    let model = match &workload {
        Some((_, _, file)) if !o.quick => file.backend.model.clone(),
        _ => bench_model(o.quick),
    };
    let t0 = Instant::now();
    let mut b = bench_backend_of(gpu.clone(), model, if o.quick { 512 } else { 8448 })?;
    log(&format!(
        "backend ready in {:.1} s",
        t0.elapsed().as_secs_f64()
    ));
    let cfg = if o.quick {
        calibrate::CalibrateConfig::quick()
    } else {
        calibrate::CalibrateConfig::full()
    };
    let mut sweep = calibrate::sweep(&mut b, &cfg, &mut *log)?;
    let swap = measure_swap_in_rate(&b, o.quick, log);
    let m = b.config().model.clone();
    match workload {
        Some(w) => add_calibration_workload(&gpu, b, w, o, &m, &mut sweep, log)?,
        None => drop(b),
    }
    let fit = calibrate::fit(&sweep, m.encoder_layers, m.decoder_layers, swap);
    let header = calibrated_header(&gpu, o, &m);
    let text = calibrate::profile_toml(&fit, &sweep, &header);
    let json = serde_json::json!({"config": cfg, "model": m, "sweep": sweep, "fit": fit});
    write_calibration(o, &text, &json)?;
    log(&format!(
        "calibration done in {:.1} s",
        t0.elapsed().as_secs_f64()
    ));
    Ok(text)
}

/// Options of an offline re-fit: a saved calibration sweep (and optionally a saved
/// conformance record) to a profile, without a GPU.
#[derive(Debug, Clone)]
pub struct RefitOptions {
    /// The sweep JSON `calibrate` wrote (`{"config", "model", "sweep", "fit"}`).
    pub sweep: PathBuf,
    /// A conformance record of the same GPU: its first `decode_offset_fraction` of decode steps
    /// (in run order) set the decode engine offset; the rest of the run is held out.
    pub record: Option<PathBuf>,
    pub decode_offset_fraction: f64,
    /// Where the profile goes.
    pub out: PathBuf,
    pub name: String,
    /// Header facts of the original calibration (the sweep does not hold them).
    pub gpu: String,
    pub driver: String,
    pub date: String,
    pub commit: String,
}

/// What [`refit`] produced.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Refit {
    pub profile_text: String,
    /// Added to the sweep-fitted decode base (0 without a record).
    pub decode_offset_ns: f64,
    /// Steps of the record before this index (holding the fitted share of its decode steps)
    /// set the offset; the steps from it on are held out.
    pub fit_steps: usize,
}

/// The sweep, model and swap-in rate (bytes/s) a calibration saved.
fn read_saved_sweep(path: &Path) -> Result<(calibrate::Sweep, ModelShape, f64), CommandError> {
    let json_err = |cause| CommandError::Json {
        path: path.to_path_buf(),
        cause,
    };
    let v: serde_json::Value = serde_json::from_str(&read(path)?).map_err(json_err)?;
    let mut sweep: calibrate::Sweep =
        serde_json::from_value(v["sweep"].clone()).map_err(json_err)?;
    let m: ModelShape = serde_json::from_value(v["model"].clone()).map_err(json_err)?;
    if sweep.experts == 0 {
        // Sweeps saved before the active-expert term: the model section has the counts.
        (sweep.experts, sweep.top_k) = (m.experts, m.top_k);
    }
    let swap = v["fit"]["swap_in_bytes_per_s"].as_f64().ok_or_else(|| {
        CommandError::Failed(format!(
            "{}: fit.swap_in_bytes_per_s missing",
            path.display()
        ))
    })?;
    Ok((sweep, m, swap))
}

/// Adds the decode engine offset of the record at `path` (its first `fraction` of decode
/// steps against the sweep-only fit) to the fit's decode base and residuals, with header
/// notes saying so. Returns the offset and the first held-out step.
fn apply_decode_offset(
    path: &Path,
    fraction: f64,
    fit: &mut calibrate::Fit,
    sweep: &calibrate::Sweep,
    header: &mut calibrate::ProfileHeader,
) -> Result<(f64, usize), CommandError> {
    let record: Record =
        serde_json::from_str(&read(path)?).map_err(|cause| CommandError::Json {
            path: path.to_path_buf(),
            cause,
        })?;
    let text = calibrate::profile_toml(fit, sweep, header);
    let sweep_only = parse_profile(&text, "refit")?;
    let split = conformance::decode_split(&record.run.steps, fraction);
    let offset = conformance::decode_offset_ns(&sweep_only.decode, &record.run.steps[..split]);
    fit.decode.base_ns = (fit.decode.base_ns + offset).max(0.0);
    for r in &mut fit.decode_residuals {
        r.1 += offset;
    }
    header.notes.push(format!(
        "Decode base includes an engine offset of {:+.3} ms: the median of measured - predicted over",
        offset / 1e6
    ));
    header.notes.push(format!(
        "the first {:.0}% of the decode steps (run steps 0..{split}) of the conformance record {}",
        100.0 * fraction,
        file_name(path)
    ));
    header.notes.push(
        "(the engine loop's decode steps run slower than isolated sweep steps of the same shape); the"
            .into(),
    );
    header.notes.push(
        "decode residuals below include it. The rest of that record is held out for evaluation."
            .into(),
    );
    Ok((offset, split))
}

/// Re-fits a profile from a saved sweep: the cost-model forms of [`calibrate::fit`], the
/// transfer rates and model shape the sweep recorded, and, given a record, the decode engine
/// offset ([`conformance::decode_offset_ns`]) from the record's first decode steps.
pub fn refit(o: &RefitOptions) -> Result<Refit, CommandError> {
    let (sweep, m, swap) = read_saved_sweep(&o.sweep)?;
    let mut fit = calibrate::fit(&sweep, m.encoder_layers, m.decoder_layers, swap);
    let mut header = calibrate::ProfileHeader {
        name: o.name.clone(),
        gpu: o.gpu.clone(),
        driver: o.driver.clone(),
        date: o.date.clone(),
        commit: o.commit.clone(),
        model: model_summary(&m),
        notes: vec![format!(
            "Re-fitted offline (`hw::commands::refit`) from the saved sweep {}.",
            file_name(&o.sweep)
        )],
    };
    let (offset, split) = match &o.record {
        Some(path) => apply_decode_offset(
            path,
            o.decode_offset_fraction,
            &mut fit,
            &sweep,
            &mut header,
        )?,
        None => (0.0, 0),
    };
    let text = calibrate::profile_toml(&fit, &sweep, &header);
    parse_profile(&text, "refit")?;
    let dir = o.out.parent().unwrap_or(Path::new("."));
    write(dir, &file_name(&o.out), &text)?;
    Ok(Refit {
        profile_text: text,
        decode_offset_ns: offset,
        fit_steps: split,
    })
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Options of the conformance run.
#[derive(Debug, Clone)]
pub struct ConformanceOptions {
    pub config: PathBuf,
    pub out: PathBuf,
    /// Profile for the policies and the prediction, instead of the config's `profile`.
    pub profile: Option<String>,
    /// Analyse this record (from an earlier GPU run) instead of running the GPU.
    pub record: Option<PathBuf>,
    /// The GPU run's clock (a record carries its own).
    pub clock: ClockKind,
    pub date: String,
    pub commit: String,
    /// File name prefix of the outputs (e.g. `2026-11-29-nvidia-h200-`).
    pub prefix: String,
}

/// Reads a record written by [`conformance`].
pub fn read_record(path: &Path) -> Result<Record, CommandError> {
    serde_json::from_str(&read(path)?).map_err(|cause| CommandError::Json {
        path: path.to_path_buf(),
        cause,
    })
}

/// Runs the GPU record (or loads it with `--record`) and replays it through the unit; writes
/// `conformance-record.json` (a GPU run) and `conformance-replay.md` under `out`. The
/// comparison with the simulator is `servelab hw conformance` (servelab-experiments), which
/// calls this first.
pub fn conformance(
    o: &ConformanceOptions,
    log: &mut dyn FnMut(&str),
) -> Result<(Record, conformance::ReplayCheck), CommandError> {
    let record = match &o.record {
        Some(path) => read_record(path)?,
        None => {
            let rec = gpu_record(o, log)?;
            write(
                &o.out,
                &format!("{}conformance-record.json.gz", o.prefix),
                &serde_json::to_string(&rec).unwrap_or_default(),
            )?;
            rec
        }
    };
    let check = conformance::replay_record(&record)?;
    let md = replay_markdown(&record, &check);
    write(&o.out, &format!("{}conformance-replay.md", o.prefix), &md)?;
    log(&md);
    Ok((record, check))
}

fn gpu_record(o: &ConformanceOptions, log: &mut dyn FnMut(&str)) -> Result<Record, CommandError> {
    let origin = o.config.display().to_string();
    let text = read(&o.config)?;
    let file = ConformanceFile::parse(&text, &origin)?;
    let spec = o
        .profile
        .clone()
        .unwrap_or_else(|| file.conformance.profile.clone());
    // Loaded (and validated) here; its text goes into the record.
    let profile_text = profile_text(&spec)?;
    let gpu = Arc::new(open_gpu()?);
    let t0 = Instant::now();
    let rec = match o.clock {
        ClockKind::Virtual if file.placement().physical_ordinals().len() > 1 => {
            let pin = crate::affinity::pin_to_current_cpu();
            let gpus = file
                .placement()
                .physical_ordinals()
                .iter()
                .map(|&o| GpuContext::new(o as usize).map(Arc::new))
                .collect::<Result<Vec<_>, _>>()?;
            drop(gpu);
            let mut rec =
                conformance::run_on_gpus(gpus, &text, &origin, &profile_text, &o.date, &o.commit)?;
            rec.run.pinned_cpu = pin.as_ref().map(|p| p.cpu);
            rec
        }
        ClockKind::Virtual => {
            // As in calibration and the wall clock: one CPU for the launching thread.
            let pin = crate::affinity::pin_to_current_cpu();
            let mut b = CudaBackend::new(gpu, file.backend_config())?;
            log(&format!(
                "backend ready in {:.1} s",
                t0.elapsed().as_secs_f64()
            ));
            let mut rec =
                conformance::run_on_gpu(&mut b, &text, &origin, &profile_text, &o.date, &o.commit)?;
            rec.run.pinned_cpu = pin.as_ref().map(|p| p.cpu);
            let g = b.graph_stats();
            log(&format!(
                "decode mode {:?}: {} graph captures, {} replays, {} device-bound steps launch \
                 by launch",
                b.decode_mode(),
                g.captures,
                g.replays,
                g.eager_steps
            ));
            rec
        }
        // The backend is built and warmed up on the device thread first.
        ClockKind::Wall => {
            conformance::run_on_gpu_wall(gpu, &text, &origin, &profile_text, &o.date, &o.commit)?
        }
    };
    let device_ns: u64 = rec.run.steps.iter().map(|s| s.duration_ns).sum();
    log(&format!(
        "GPU run ({} clock): {} steps, run {:.1} ms on its clock, {:.1} ms of device time, {} \
         arrivals handled during a step; {:.1} s with backend set-up",
        rec.run.clock,
        rec.run.steps.len(),
        rec.run.end_ns as f64 / 1e6,
        device_ns as f64 / 1e6,
        rec.run.admitted_in_flight,
        t0.elapsed().as_secs_f64()
    ));
    Ok(rec)
}

/// The replay's result in a few lines.
pub fn replay_markdown(record: &Record, c: &conformance::ReplayCheck) -> String {
    let mut md = format!(
        "# Conformance record: replay through the serving unit\n\n\
         GPU: {}; date {}; commit {}; {} clock; {} inputs, {} steps, {} requests.\n\n",
        record.gpu,
        record.date,
        record.commit,
        record.run.clock,
        record.run.inputs.len(),
        record.run.steps.len(),
        record.run.requests.len()
    );
    if c.replayable {
        md.push_str(&format!(
            "{} recorded plans, {} replayed, **{} mismatched**; request outcomes identical: {}.\n",
            c.recorded_steps, c.replayed_steps, c.mismatched_steps, c.outcomes_identical
        ));
    } else {
        md.push_str("Not replayable: the record has no input log (the engine loop before the serving unit).\n");
    }
    for m in &c.first_mismatches {
        md.push_str(&format!("- {m}\n"));
    }
    md
}

/// Speed against this GPU's own ceilings; writes `speed.md` / `.json`. Returns the markdown.
pub fn speed(
    gpu: &GpuContext,
    quick: bool,
    seed: u64,
    out: Option<&Path>,
    date: &str,
    log: &mut dyn FnMut(&str),
) -> Result<String, CommandError> {
    let cfg = if quick {
        speed::SpeedConfig::quick(seed)
    } else {
        speed::SpeedConfig::full(seed)
    };
    let rep = speed::run(gpu, &cfg, &mut *log)?;
    let md = format!(
        "{}{}",
        report::header(&rep.gpu, rep.compute_capability, rep.driver_version, date),
        report::speed_markdown(&rep)
    );
    if let Some(dir) = out {
        write(dir, "speed.md", &md)?;
        write(
            dir,
            "speed.json",
            &serde_json::to_string_pretty(&rep).unwrap_or_default(),
        )?;
    }
    Ok(md)
}

/// The NVRTC compile of every kernel variant and every kernel check against its CPU
/// reference, appended to `md` (and written as `test-report.*` under `out`). Returns the
/// failed and total check counts.
fn kernel_checks(
    gpu: &Arc<GpuContext>,
    seed: u64,
    out: Option<&Path>,
    md: &mut String,
) -> Result<(usize, usize), CommandError> {
    let t0 = Instant::now();
    match servelab_kernels::sources::compile_all(gpu.compute_capability()) {
        Ok(v) => md.push_str(&format!(
            "NVRTC compiled {} kernel variants in {:.2} s.\n\n",
            v.len(),
            t0.elapsed().as_secs_f64()
        )),
        Err(e) => md.push_str(&format!("NVRTC compile FAILED: {e}\n\n")),
    }
    let results = servelab_kernels::check::run_all(gpu, seed);
    md.push_str(&report::checks_markdown(&results));
    let failed = results
        .iter()
        .filter(|r| !matches!(r, Ok(c) if c.passed))
        .count();
    md.push_str(&format!("\n{} checks, {failed} failed.\n", results.len()));
    if let Some(dir) = out {
        write(dir, "test-report.md", md)?;
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
            dir,
            "test-report.json",
            &serde_json::to_string_pretty(&json).unwrap_or_default(),
        )?;
    }
    Ok((failed, results.len()))
}

/// The backend's cache-hit and replay checks as a markdown table (also written as
/// `backend-check.*` under `out`).
fn backend_checks(
    gpu: Arc<GpuContext>,
    quick: bool,
    out: Option<&Path>,
) -> Result<String, CommandError> {
    let mut b = bench_backend(gpu, quick, 256)?;
    let prompts: &[(usize, usize)] = if quick {
        &[(300, 256)]
    } else {
        &[(600, 384), (2000, 1280)]
    };
    let diffs = checks::replay_checks(&mut b, prompts, 140)?;
    let mut bm = String::from(
        "| comparison | max abs logit diff | mean abs | top-token agreement |\n|---|---|---|---|\n",
    );
    for d in &diffs {
        bm.push_str(&format!(
            "| {} | {:.4e} | {:.4e} | {:.0}% |\n",
            d.what,
            d.max_abs,
            d.mean_abs,
            100.0 * d.top_token_agreement
        ));
    }
    if let Some(dir) = out {
        write(dir, "backend-check.md", &bm)?;
        write(
            dir,
            "backend-check.json",
            &serde_json::to_string_pretty(&diffs).unwrap_or_default(),
        )?;
    }
    Ok(bm)
}

/// Kernel checks against the CPU references (after compiling every variant) and the backend's
/// cache-hit and replay checks; writes `test-report.*` and `backend-check.*`. Fails if any
/// kernel check fails.
pub fn check(
    gpu: Arc<GpuContext>,
    seed: u64,
    quick: bool,
    out: Option<&Path>,
    date: &str,
) -> Result<String, CommandError> {
    let mut md = report::header(
        &gpu.name(),
        gpu.compute_capability(),
        gpu.driver_version(),
        date,
    );
    let (failed, total) = kernel_checks(&gpu, seed, out, &mut md)?;
    let bm = backend_checks(gpu, quick, out)?;
    md.push_str("\n## Backend checks\n\n");
    md.push_str(&bm);
    if failed > 0 {
        return Err(CommandError::Failed(format!(
            "{failed} of {total} kernel checks failed\n{md}"
        )));
    }
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a GPU the error says so; with one, a GPU opens.
    #[test]
    fn no_gpu_message_is_clear() {
        match open_gpu() {
            Ok(_) => {}
            Err(CommandError::NoGpu) => {
                let msg = CommandError::NoGpu.to_string();
                assert!(msg.starts_with("no GPU"), "{msg}");
            }
            Err(e) => panic!("unexpected: {e}"),
        }
    }

    /// The conformance command replays a record without a GPU (a dry run stands in for the
    /// GPU run), and reports a missing record by its path.
    #[test]
    fn conformance_replays_a_record_without_a_gpu() {
        let dir = std::env::temp_dir().join(format!("servelab-hw-conf-{}", std::process::id()));
        let missing = conformance_opts(&dir, Some(dir.join("nope.json")));
        let e = conformance(&missing, &mut |_| {}).unwrap_err().to_string();
        assert!(e.contains("nope.json"), "{e}");
        let config = include_str!("../../experiments/configs/conformance.toml").to_string();
        let file = ConformanceFile::parse(&config, "conformance.toml").unwrap();
        let mut rec = conformance::dry_run(&file, SM100_PUBLISHED).unwrap();
        rec.config = config;
        let path = dir.join("rec.json");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(&path, serde_json::to_string(&rec).unwrap()).unwrap();
        let (_, check) = conformance(&conformance_opts(&dir, Some(path)), &mut |_| {}).unwrap();
        assert!(check.replayable);
        assert_eq!(check.mismatched_steps, 0, "{:?}", check.first_mismatches);
        assert!(check.outcomes_identical);
        let md = std::fs::read_to_string(dir.join("t-conformance-replay.md")).unwrap();
        assert!(md.contains("**0 mismatched**"), "{md}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn conformance_opts(dir: &Path, record: Option<PathBuf>) -> ConformanceOptions {
        ConformanceOptions {
            config: dir.join("unused.toml"),
            out: dir.to_path_buf(),
            profile: None,
            record,
            clock: ClockKind::Wall,
            date: "d".into(),
            commit: "c".into(),
            prefix: "t-".into(),
        }
    }
}
