//! Sweeps: a `[sweep]` table in any experiment config runs the experiment at every point of a
//! grid (and a zip) of config keys, for every seed, and tabulates the headline metrics
//! (`summary.json`) of every run.
//!
//! Each point × seed runs as its own `servelab run --point` process (in parallel, `--jobs` at a
//! time, over rayon's pool), into `points/<id>/` under the output folder, where `<id>` is a
//! hash of the point's effective config (the file, the overrides and the seed). A finished
//! point leaves `point.json` there; a sweep started again into the same folder skips those, so
//! an interrupted sweep resumes where it stopped. Outputs:
//!
//! - `sweep.{csv,parquet}`: one row per point × seed, a column per swept key, the seed, and a
//!   column per metric;
//! - `sweep_summary.{csv,parquet}`: one row per point × metric: mean, standard deviation and the
//!   95 % Student-t interval over the seeds;
//! - `plots/<metric>.svg`: the mean against the first numeric swept key, one line per value of
//!   the others, with the interval as a band;
//! - `summary.md` (with warnings: keys that change nothing, percentiles that do not move),
//!   `summary.json` (each point's mean of each metric) and `manifest.json`.

pub mod headline;
pub mod spec;
pub mod stats;

use crate::config::{LoadedConfig, Override, ParsedOnly};
use crate::output::{self, Manifest, RunOutput, markdown_table};
use crate::plot;
use anyhow::{Context, Result, anyhow, bail};
use headline::Metrics;
use polars::prelude::*;
use rayon::prelude::*;
use serde::Serialize;
use spec::{Point, Spec, Val};
use stats::Interval;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};

/// How the sweep was asked for.
pub struct Options<'a> {
    pub out: PathBuf,
    pub quiet: bool,
    pub force: bool,
    pub json: bool,
    /// Points run at once (default: the cores).
    pub jobs: Option<usize>,
    /// `--set` overrides of the whole sweep (every point gets them first).
    #[allow(dead_code)]
    pub base_overrides: &'a [Override],
    /// How each point × seed runs.
    pub runner: Runner,
}

/// How the local runner runs a point × seed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Runner {
    /// As a `servelab run --point` child process of the running binary (the command line's
    /// way: a crash or an abort takes down one point, and its output goes to `log.txt`).
    Process,
    /// In this process, through [`run_point_in_process`] (the Python package's way, whose
    /// executable is the interpreter, not `servelab`).
    InProcess,
}

/// One run of the sweep: a point and a seed.
struct Job {
    point: usize,
    seed: u64,
    id: String,
    dir: PathBuf,
}

/// 64-bit FNV-1a: a stable hash (the same on every platform and version) for point ids.
fn fnv1a(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The effective config of a point, checked like a single run's (unknown keys, types, values
/// that fail to parse) without running anything.
fn point_config(base: &LoadedConfig, p: &Point) -> Result<LoadedConfig> {
    let mut o = base.overrides.clone();
    o.extend(p.overrides.iter().cloned());
    LoadedConfig::from_text(&base.path, base.text.clone(), o)
}

fn check_point(cfg: LoadedConfig, kind: &str, out: &Path) -> Result<String> {
    if cfg.header.kind != kind {
        bail!(
            "it changes the experiment kind from `{kind}` to `{}`",
            cfg.header.kind
        );
    }
    let canonical = cfg.canonical_text()?;
    let mut cfg = cfg;
    cfg.check_only = true;
    let ctx = crate::exp::RunContext {
        config: cfg,
        out: out.to_path_buf(),
        quiet: true,
    };
    match crate::cmd::run::dispatch(&ctx) {
        Ok(()) => Ok(canonical),
        Err(e) if e.is::<ParsedOnly>() => Ok(canonical),
        Err(e) => Err(e),
    }
}

/// Every point checked (a bad key or value fails now, naming the point and the key) and every
/// point × seed with its id and folder; nothing runs.
fn plan(base: &LoadedConfig, spec: &Spec, out: &Path) -> Result<(Vec<Point>, Vec<Job>)> {
    let kind = base.header.kind.clone();
    let points = spec.points();
    let mut jobs = Vec::new();
    for (i, p) in points.iter().enumerate() {
        let cfg = point_config(base, p)
            .map_err(|e| anyhow!("sweep point {} ({}): {e:#}", i, spec.point_label(p)))?;
        let canonical = check_point(cfg, &kind, out).map_err(|e| {
            anyhow!(
                "sweep point {i} ({}): {:#}",
                spec.point_label(p),
                base.explain_error(e)
            )
        })?;
        for &seed in &spec.seeds {
            let id = format!("{:016x}", fnv1a(&format!("{canonical}\nseed = {seed}\n")));
            jobs.push(Job {
                point: i,
                seed,
                dir: out.join("points").join(&id),
                id,
            });
        }
    }
    Ok((points, jobs))
}

fn is_done(j: &Job) -> bool {
    j.dir.join("point.json").is_file() && j.dir.join("summary.json").is_file()
}

/// One point × seed for a runner outside this process (Ray): where its files go, the overrides
/// and seed it runs with, and the `point.json` that marks it finished.
#[derive(Clone, Debug, Serialize)]
pub struct ExternalJob {
    pub id: String,
    pub point: usize,
    pub seed: u64,
    pub dir: PathBuf,
    /// The sweep's own overrides, then the point's.
    pub overrides: Vec<String>,
    pub done: bool,
    /// The contents of `point.json`, to be written once the point's files are in `dir`.
    pub record: String,
}

/// Checks the sweep, prepares its folder (resuming, as the local runner does) and lists the
/// distinct points × seeds for an outside runner; [`finish_external`] then tabulates them.
pub fn plan_external(
    base: &LoadedConfig,
    spec: &Spec,
    out: &Path,
    force: bool,
) -> Result<Vec<ExternalJob>> {
    let (points, jobs) = plan(base, spec, out)?;
    prepare(out, force)?;
    let mut v: Vec<ExternalJob> = Vec::new();
    for j in &jobs {
        if v.iter().any(|x| x.id == j.id) {
            continue;
        }
        let p = &points[j.point];
        v.push(ExternalJob {
            id: j.id.clone(),
            point: j.point,
            seed: j.seed,
            dir: j.dir.clone(),
            overrides: base
                .overrides
                .iter()
                .chain(&p.overrides)
                .map(|o| o.to_string())
                .collect(),
            done: is_done(j),
            record: point_record(j, p)?,
        });
    }
    Ok(v)
}

/// Tabulates a sweep whose points an outside runner finished (see [`plan_external`]).
pub fn finish_external(base: LoadedConfig, spec: Spec, opt: &Options) -> Result<()> {
    let (points, jobs) = plan(&base, &spec, &opt.out)?;
    if let Some(j) = jobs.iter().find(|j| !is_done(j)) {
        bail!(
            "sweep point {} (seed {}) has not finished: no point.json and summary.json in {}",
            j.point,
            j.seed,
            j.dir.display()
        );
    }
    finish(&base, &spec, &points, &jobs, opt)
}

pub fn run(base: LoadedConfig, spec: Spec, opt: &Options) -> Result<()> {
    let path = base.path.display().to_string();
    let kind = base.header.kind.clone();
    let out = &opt.out;
    let (points, jobs) = plan(&base, &spec, out)?;
    prepare(out, opt.force)?;
    let done = is_done;
    // Two points with the same effective config share one run.
    let mut todo: Vec<&Job> = Vec::new();
    for j in jobs.iter().filter(|j| !done(j)) {
        if !todo.iter().any(|t| t.id == j.id) {
            todo.push(j);
        }
    }
    let n_jobs = opt
        .jobs
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    let header = format!(
        "servelab sweep: {path} (kind {kind}): {} points × {} seeds = {} runs, {} already done, \
         {} at a time; output {}",
        points.len(),
        spec.seeds.len(),
        jobs.len(),
        jobs.iter().filter(|j| done(j)).count(),
        n_jobs.min(todo.len().max(1)),
        out.display()
    );
    // With --json, stdout carries the JSON alone.
    if opt.json {
        eprintln!("{header}");
    } else {
        println!("{header}");
    }
    run_jobs(&base, &spec, &points, &todo, n_jobs, opt)?;
    finish(&base, &spec, &points, &jobs, opt)
}

/// Gathers every point's summary.json and writes the sweep's tables, plots and summaries.
fn finish(
    base: &LoadedConfig,
    spec: &Spec,
    points: &[Point],
    jobs: &[Job],
    opt: &Options,
) -> Result<()> {
    let path = base.path.display().to_string();
    let kind = base.header.kind.clone();
    let out = &opt.out;
    let results = gather(jobs)?;
    let names = metric_names(&results);
    if let Some(want) = &spec.metrics
        && let Some(bad) = want.iter().find(|w| !names.contains(w))
    {
        bail!(
            "{path}: sweep.metrics: no metric `{bad}` in this experiment's summary.json (it has: {})",
            names.join(", ")
        );
    }
    let mut w = RunOutput::create(out)?;
    let mut tidy = tidy_table(spec, points, jobs, &results, &names)?;
    w.write_table("sweep", &mut tidy)?;
    let stats = point_stats(points, jobs, &results, &names);
    let mut st = summary_table(spec, points, &names, &stats)?;
    w.write_table("sweep_summary", &mut st)?;
    let warnings = warnings(spec, points, jobs, &results, &names, &stats);
    for wmsg in &warnings {
        eprintln!("warning: {wmsg}");
    }
    let plotted = plot_metrics(spec, &names, &stats);
    if !plotted.is_empty() {
        std::fs::create_dir_all(out.join("plots"))?;
    }
    for m in &plotted {
        let p = w.path(&format!("plots/{}.svg", file_slug(m)));
        plot_metric(&p, spec, points, m, &stats)?;
    }
    let flat = flat_means(spec, points, &names, &stats);
    w.write_summary_json(&flat)?;
    let md = summary_md(
        &path, &kind, spec, points, &names, &plotted, &stats, &warnings,
    );
    w.write_text("summary.md", &md)?;
    let mut m = Manifest::new(
        &format!("sweep of {kind}"),
        &base.path,
        &base.text,
        base.header.seed,
    );
    m.overrides = base.overrides.iter().map(|o| o.to_string()).collect();
    // Each point's own manifest holds that run's speed figures.
    w.write_manifest(&m, &[])?;
    if opt.json {
        print!("{}", output::summary_json(&flat)?);
    } else {
        println!("{md}");
        println!("wrote {}", out.display());
    }
    Ok(())
}

/// Every job's summary.json, in job order.
fn gather(jobs: &[Job]) -> Result<Vec<Metrics>> {
    let mut results: Vec<Metrics> = Vec::new();
    for j in jobs {
        let p = j.dir.join("summary.json");
        let text =
            std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
        let m: Metrics = serde_json::from_str(&text)
            .with_context(|| format!("{}: not a flat map of metric → number", p.display()))?;
        results.push(m);
    }
    Ok(results)
}

/// The metrics any job reported, sorted.
fn metric_names(results: &[Metrics]) -> Vec<String> {
    let mut all: Vec<String> = results.iter().flat_map(|m| m.keys().cloned()).collect();
    all.sort();
    all.dedup();
    all
}

/// The sweep's summary.json: each metric's mean at each point, `metric @ key=label, …`.
fn flat_means(spec: &Spec, points: &[Point], names: &[String], stats: &Stats) -> Metrics {
    let mut flat = Metrics::new();
    for (i, p) in points.iter().enumerate() {
        for m in names {
            if let Some(s) = stats.get(&(i, m.clone())) {
                let at = if spec.dims.is_empty() {
                    String::new()
                } else {
                    format!(" @ {}", spec.point_label(p))
                };
                flat.insert(format!("{m}{at}"), s.mean);
            }
        }
    }
    flat
}

/// A sweep folder resumes: its finished points are kept. Any other folder with files is refused
/// unless `force`, which also clears a previous sweep's points.
fn prepare(out: &Path, force: bool) -> Result<()> {
    let is_sweep = out.join("points").is_dir();
    if force || !is_sweep {
        output::prepare_out_dir(out, force, &["points", "plots"])?;
    } else {
        // Resuming: the folder's tables and plots are derived and rewritten; drop the old ones.
        output::remove_previous_outputs(out)?;
        output::probe_writable(out)?;
    }
    std::fs::create_dir_all(out.join("points"))
        .with_context(|| format!("creating {}", out.join("points").display()))?;
    Ok(())
}

fn run_jobs(
    base: &LoadedConfig,
    spec: &Spec,
    points: &[Point],
    todo: &[&Job],
    n_jobs: usize,
    opt: &Options,
) -> Result<()> {
    if todo.is_empty() {
        return Ok(());
    }
    let exe = match opt.runner {
        Runner::Process => Some(std::env::current_exe().context("locating the servelab binary")?),
        Runner::InProcess => None,
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (cores / n_jobs.min(todo.len())).max(1);
    let pb = progress(opt.quiet, todo.len() as u64);
    let stop = AtomicBool::new(false);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(n_jobs)
        .build()
        .context("starting the sweep's thread pool")?;
    let finished = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<Result<()>> = pool.install(|| {
        todo.par_iter()
            .map(|j| {
                if stop.load(Ordering::Relaxed) {
                    return Ok(());
                }
                let p = &points[j.point];
                let started = std::time::Instant::now();
                let r = run_one(opt.runner, exe.as_deref(), base, p, j, threads);
                if r.is_err() {
                    stop.store(true, Ordering::Relaxed);
                }
                let n = finished.fetch_add(1, Ordering::Relaxed) + 1;
                let label = spec.point_label(p);
                let label = if label.is_empty() {
                    String::new()
                } else {
                    format!("{label}, ")
                };
                let line = format!(
                    "[{n}/{}] point {} ({label}seed {}): {} in {:.1} s",
                    todo.len(),
                    j.point,
                    j.seed,
                    if r.is_ok() { "done" } else { "FAILED" },
                    started.elapsed().as_secs_f64()
                );
                print_progress_line(&pb, opt.quiet, line);
                r.map_err(|e| anyhow!("sweep point {} ({label}seed {}): {e:#}", j.point, j.seed))
            })
            .collect()
    });
    pb.finish_and_clear();
    let errors: Vec<anyhow::Error> = results.into_iter().filter_map(|r| r.err()).collect();
    if let Some(e) = errors.into_iter().next() {
        return Err(e.context(
            "the sweep stopped; finished points are kept and a new run into the same folder \
             resumes",
        ));
    }
    Ok(())
}

/// One finished point's line, above the progress bar when it shows, else on stderr unless
/// quiet; then the bar moves on.
fn print_progress_line(pb: &indicatif::ProgressBar, quiet: bool, line: String) {
    if pb.is_hidden() {
        if !quiet {
            eprintln!("{line}");
        }
    } else {
        pb.println(line);
    }
    pb.inc(1);
}

fn progress(quiet: bool, len: u64) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if quiet || !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let pb = indicatif::ProgressBar::new(len);
    pb.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg:>8} [{bar:40}] {pos}/{len} {elapsed_precise} eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    pb.set_message("points");
    pb
}

/// Runs one point × seed with the sweep's runner, then marks it finished with `point.json`.
fn run_one(
    runner: Runner,
    exe: Option<&Path>,
    base: &LoadedConfig,
    p: &Point,
    j: &Job,
    threads: usize,
) -> Result<()> {
    std::fs::create_dir_all(&j.dir).with_context(|| format!("creating {}", j.dir.display()))?;
    let overrides: Vec<Override> = base.overrides.iter().chain(&p.overrides).cloned().collect();
    match (runner, exe) {
        (Runner::Process, Some(exe)) => run_child(exe, base, &overrides, j, threads)?,
        _ => run_point_in_process(&base.path, base.text.clone(), overrides, j.seed, &j.dir)?,
    }
    let record = point_record(j, p)?;
    std::fs::write(j.dir.join("point.json"), record)
        .with_context(|| format!("writing {}", j.dir.join("point.json").display()))?;
    Ok(())
}

/// The `point.json` of a finished point × seed.
fn point_record(j: &Job, p: &Point) -> Result<String> {
    let record = serde_json::json!({
        "id": j.id,
        "point": j.point,
        "seed": j.seed,
        "overrides": p.overrides.iter().map(|o| o.to_string()).collect::<Vec<_>>(),
    });
    Ok(serde_json::to_string_pretty(&record)? + "\n")
}

/// Runs one point × seed as a `servelab run --point` child process; its stdout and stderr go
/// to `log.txt` in its folder.
fn run_child(
    exe: &Path,
    base: &LoadedConfig,
    overrides: &[Override],
    j: &Job,
    threads: usize,
) -> Result<()> {
    let log_path = j.dir.join("log.txt");
    let log = std::fs::File::create(&log_path)
        .with_context(|| format!("creating {}", log_path.display()))?;
    let mut cmd = Command::new(exe);
    cmd.arg("run")
        .arg(&base.path)
        .arg("--point")
        .arg("--out")
        .arg(&j.dir)
        .arg("--seed")
        .arg(j.seed.to_string())
        .arg("--quiet")
        .arg("--force");
    for o in overrides {
        cmd.arg("--set").arg(o.to_string());
    }
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        cmd.env("RAYON_NUM_THREADS", threads.to_string());
    }
    let status = cmd
        .stdout(Stdio::from(log.try_clone()?))
        .stderr(Stdio::from(log))
        .status()
        .with_context(|| format!("starting {}", exe.display()))?;
    if !status.success() {
        let text = std::fs::read_to_string(&log_path).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(12).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        bail!(
            "{} (log {}):\n{}",
            status,
            log_path.display(),
            tail.join("\n")
        );
    }
    Ok(())
}

/// Runs one point × seed in this process into `dir`, as `servelab run CONFIG --point --seed
/// SEED --set ... --out DIR --force --quiet` does: the config's text (with its `[sweep]` table,
/// which a point ignores) under its path, which names it in errors and anchors its relative
/// paths. The Ray runner calls this on its workers with the text the driver read.
pub fn run_point_in_process(
    path: &Path,
    text: String,
    overrides: Vec<Override>,
    seed: u64,
    dir: &Path,
) -> Result<()> {
    let set: Vec<String> = overrides.iter().map(|o| o.to_string()).collect();
    let mut cfg = LoadedConfig::from_text(path, text, overrides)?;
    cfg.header.seed = seed;
    output::prepare_out_dir(dir, true, &[])?;
    let mut command_line: Vec<String> = vec![
        "servelab".into(),
        "run".into(),
        path.display().to_string(),
        "--point".into(),
        "--out".into(),
        dir.display().to_string(),
        "--seed".into(),
        seed.to_string(),
        "--quiet".into(),
        "--force".into(),
    ];
    for o in &set {
        command_line.push("--set".into());
        command_line.push(o.clone());
    }
    let ctx = crate::exp::RunContext {
        config: cfg,
        out: dir.to_path_buf(),
        quiet: true,
    };
    output::with_run_info(command_line, set, || crate::cmd::run::dispatch(&ctx))
}

/// The column of one swept key, typed by its values.
fn axis_column(name: &str, vals: Vec<&Val>, labels: Vec<&str>) -> Column {
    if vals.iter().all(|v| matches!(v, Val::Int(_))) {
        let v: Vec<i64> = vals
            .iter()
            .map(|v| match v {
                Val::Int(i) => *i,
                _ => 0,
            })
            .collect();
        Column::new(name.into(), v)
    } else if vals
        .iter()
        .all(|v| matches!(v, Val::Int(_) | Val::Float(_)))
    {
        let v: Vec<f64> = vals
            .iter()
            .map(|v| match v {
                Val::Int(i) => *i as f64,
                Val::Float(f) => *f,
                _ => 0.0,
            })
            .collect();
        Column::new(name.into(), v)
    } else if vals.iter().all(|v| matches!(v, Val::Bool(_))) {
        let v: Vec<bool> = vals.iter().map(|v| matches!(v, Val::Bool(true))).collect();
        Column::new(name.into(), v)
    } else {
        Column::new(name.into(), labels)
    }
}

fn axis_columns(spec: &Spec, points: &[Point], rows: &[usize]) -> Vec<Column> {
    let mut cols = Vec::new();
    for (d, dim) in spec.dims.iter().enumerate() {
        for a in &dim.axes {
            let vals: Vec<&Val> = rows
                .iter()
                .map(|&r| &a.values[points[r].coords[d]].val)
                .collect();
            let labels: Vec<&str> = rows
                .iter()
                .map(|&r| a.values[points[r].coords[d]].label.as_str())
                .collect();
            cols.push(axis_column(&a.key, vals, labels));
        }
    }
    cols
}

fn tidy_table(
    spec: &Spec,
    points: &[Point],
    jobs: &[Job],
    results: &[Metrics],
    names: &[String],
) -> Result<DataFrame> {
    let rows: Vec<usize> = jobs.iter().map(|j| j.point).collect();
    let mut cols = vec![
        Column::new(
            "point".into(),
            jobs.iter().map(|j| j.point as u32).collect::<Vec<_>>(),
        ),
        Column::new(
            "point_id".into(),
            jobs.iter().map(|j| j.id.clone()).collect::<Vec<_>>(),
        ),
    ];
    cols.extend(axis_columns(spec, points, &rows));
    cols.push(Column::new(
        "seed".into(),
        jobs.iter().map(|j| j.seed).collect::<Vec<_>>(),
    ));
    for m in names {
        let v: Vec<Option<f64>> = results.iter().map(|r| r.get(m).copied()).collect();
        cols.push(Column::new(m.as_str().into(), v));
    }
    let height = cols.first().map_or(0, |c| c.len());
    Ok(DataFrame::new(height, cols)?)
}

type Stats = BTreeMap<(usize, String), Interval>;

fn point_stats(points: &[Point], jobs: &[Job], results: &[Metrics], names: &[String]) -> Stats {
    let mut s = Stats::new();
    for i in 0..points.len() {
        for m in names {
            let xs: Vec<f64> = jobs
                .iter()
                .zip(results)
                .filter(|(j, _)| j.point == i)
                .filter_map(|(_, r)| r.get(m).copied())
                .collect();
            if let Some(iv) = Interval::of(&xs) {
                s.insert((i, m.clone()), iv);
            }
        }
    }
    s
}

fn summary_table(
    spec: &Spec,
    points: &[Point],
    names: &[String],
    stats: &Stats,
) -> Result<DataFrame> {
    let keys: Vec<&(usize, String)> = (0..points.len())
        .flat_map(|i| names.iter().map(move |m| (i, m)))
        .filter_map(|(i, m)| stats.get_key_value(&(i, m.clone())).map(|(k, _)| k))
        .collect();
    let rows: Vec<usize> = keys.iter().map(|k| k.0).collect();
    let get = |f: &dyn Fn(&Interval) -> Option<f64>| -> Vec<Option<f64>> {
        keys.iter().map(|k| f(&stats[*k])).collect()
    };
    let mut cols = vec![Column::new(
        "point".into(),
        rows.iter().map(|&r| r as u32).collect::<Vec<_>>(),
    )];
    cols.extend(axis_columns(spec, points, &rows));
    cols.push(Column::new(
        "metric".into(),
        keys.iter().map(|k| k.1.clone()).collect::<Vec<_>>(),
    ));
    cols.push(Column::new(
        "n".into(),
        keys.iter().map(|k| stats[*k].n as u32).collect::<Vec<_>>(),
    ));
    cols.push(Column::new("mean".into(), get(&|i| Some(i.mean))));
    cols.push(Column::new("std".into(), get(&|i| i.std)));
    cols.push(Column::new("ci95_low".into(), get(&|i| i.low())));
    cols.push(Column::new("ci95_high".into(), get(&|i| i.high())));
    let height = cols.first().map_or(0, |c| c.len());
    Ok(DataFrame::new(height, cols)?)
}

/// Is the metric the same (exactly) at every point?
fn constant_over_points(n_points: usize, m: &str, stats: &Stats) -> bool {
    let means: Vec<f64> = (0..n_points)
        .filter_map(|i| stats.get(&(i, m.to_string())).map(|s| s.mean))
        .collect();
    means.windows(2).all(|w| w[0] == w[1])
}

/// The metrics to plot: those asked for, else those that vary across points (a dozen at most).
fn plot_metrics(spec: &Spec, names: &[String], stats: &Stats) -> Vec<String> {
    if spec.dims.is_empty() {
        return Vec::new();
    }
    if let Some(m) = &spec.metrics {
        return m.clone();
    }
    let n_points = stats.keys().map(|k| k.0).max().map_or(0, |m| m + 1);
    let mut moving: Vec<&String> = names
        .iter()
        .filter(|m| !constant_over_points(n_points, m, stats))
        .collect();
    // Headline metrics first: a service run's whole-run latencies and steady state come before
    // the per-class and per-reason breakdowns, which alphabetically would fill every plot.
    moving.sort_by_key(|m| (headline_rank(m), *m));
    moving.into_iter().take(MAX_PLOTS).cloned().collect()
}

/// 0 for whole-run latencies (`all.`), 1 for the steady state, 2 for other top-level metrics,
/// 3 for breakdowns (per class, per rejection reason).
fn headline_rank(m: &str) -> u8 {
    if m.starts_with("all.") {
        0
    } else if m.starts_with("steady.") {
        1
    } else if !m.contains('.') {
        2
    } else {
        3
    }
}

const MAX_PLOTS: usize = 12;

fn file_slug(m: &str) -> String {
    m.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The x dimension of the plots: the first whose values are all numbers or durations, else the
/// first (as categories).
fn x_dim(spec: &Spec) -> (usize, Option<Vec<f64>>) {
    for (d, dim) in spec.dims.iter().enumerate() {
        if let Some(x) = dim.axes[0].numeric() {
            return (d, Some(x));
        }
    }
    (0, None)
}

fn plot_metric(path: &Path, spec: &Spec, points: &[Point], m: &str, stats: &Stats) -> Result<()> {
    let (xd, numeric) = x_dim(spec);
    let dim = &spec.dims[xd];
    let labels: Vec<String> = (0..dim.n_values()).map(|i| dim.label(i)).collect();
    // One series per combination of the other dimensions.
    let mut series: BTreeMap<Vec<usize>, (String, Vec<plot::BandPoint>)> = BTreeMap::new();
    for (i, p) in points.iter().enumerate() {
        let Some(s) = stats.get(&(i, m.to_string())) else {
            continue;
        };
        let others: Vec<usize> = p
            .coords
            .iter()
            .enumerate()
            .filter(|(d, _)| *d != xd)
            .map(|(_, c)| *c)
            .collect();
        let name = spec
            .dims
            .iter()
            .zip(&p.coords)
            .enumerate()
            .filter(|(d, _)| *d != xd)
            .map(|(_, (dim, &c))| format!("{} = {}", dim.name(), dim.label(c)))
            .collect::<Vec<_>>()
            .join(", ");
        let c = p.coords[xd];
        let x = numeric.as_ref().map_or(c as f64, |v| v[c]);
        series
            .entry(others)
            .or_insert_with(|| (name, Vec::new()))
            .1
            .push(plot::BandPoint {
                x,
                mean: s.mean,
                low: s.low(),
                high: s.high(),
            });
    }
    let series: Vec<(String, Vec<plot::BandPoint>)> = series
        .into_values()
        .map(|(n, mut pts)| {
            pts.sort_by(|a, b| a.x.total_cmp(&b.x));
            (if n.is_empty() { m.to_string() } else { n }, pts)
        })
        .collect();
    let xs: Vec<(f64, String)> = match &numeric {
        Some(v) => v.iter().copied().zip(labels).collect(),
        None => labels
            .into_iter()
            .enumerate()
            .map(|(i, l)| (i as f64, l))
            .collect(),
    };
    let seeds = spec.seeds.len();
    let title = if seeds > 1 {
        format!("{m}: mean and 95 % interval over {seeds} seeds")
    } else {
        format!("{m} (one seed)")
    };
    plot::bands(
        path,
        &title,
        &dim.name(),
        m,
        &xs,
        numeric.is_some(),
        &series,
    )
}

/// Keys that change nothing, and percentiles that do not move while their mean does.
fn warnings(
    spec: &Spec,
    points: &[Point],
    jobs: &[Job],
    results: &[Metrics],
    names: &[String],
    stats: &Stats,
) -> Vec<String> {
    let mut w = Vec::new();
    if points.len() > 1 {
        // Results of every point, per seed, to compare points exactly.
        let by: BTreeMap<(usize, u64), &Metrics> = jobs
            .iter()
            .zip(results)
            .map(|(j, r)| ((j.point, j.seed), r))
            .collect();
        let same_points = |a: usize, b: usize| {
            spec.seeds
                .iter()
                .all(|&s| by.get(&(a, s)) == by.get(&(b, s)))
        };
        if (1..points.len()).all(|b| same_points(0, b)) {
            w.push(format!(
                "all {} points of the sweep give identical results (every metric, every seed): \
                 the swept keys change nothing this experiment measures here (e.g. a TTL longer \
                 than the workload lasts, a capacity the working set never fills, or a key the \
                 experiment does not use)",
                points.len()
            ));
        } else {
            for (d, dim) in spec.dims.iter().enumerate() {
                identical_values_warnings(points, d, dim, &same_points, &mut w);
            }
        }
        stuck_percentile_warnings(points.len(), names, stats, &mut w);
    }
    w
}

/// Values of dimension `d` that give identical results wherever the others are, one warning
/// per group of two or more.
#[allow(clippy::needless_range_loop)]
fn identical_values_warnings(
    points: &[Point],
    d: usize,
    dim: &spec::Dim,
    same_points: &impl Fn(usize, usize) -> bool,
    w: &mut Vec<String>,
) {
    let n = dim.n_values();
    let mut class: Vec<usize> = (0..n).collect();
    for a in 0..n {
        for b in a + 1..n {
            if class[b] != b {
                continue;
            }
            let same = points.iter().enumerate().all(|(i, p)| {
                if p.coords[d] != a {
                    return true;
                }
                let mut q = p.coords.clone();
                q[d] = b;
                match points.iter().position(|x| x.coords == q) {
                    Some(k) => same_points(i, k),
                    None => true,
                }
            });
            if same {
                class[b] = a;
            }
        }
    }
    for a in 0..n {
        let group: Vec<String> = (0..n)
            .filter(|&b| class[b] == a)
            .map(|b| dim.label(b))
            .collect();
        if group.len() > 1 {
            w.push(format!(
                "`{}` = {} give identical results (every metric, every seed): \
                 between these values the key changes nothing measured here",
                dim.name(),
                group.join(", ")
            ));
        }
    }
}

/// Percentiles constant over the points while their mean moves.
fn stuck_percentile_warnings(
    n_points: usize,
    names: &[String],
    stats: &Stats,
    w: &mut Vec<String>,
) {
    for m in names {
        let Some((pct, mean_name)) = percentile_counterpart(m) else {
            continue;
        };
        if !names.contains(&mean_name) {
            continue;
        }
        if constant_over_points(n_points, m, stats)
            && !constant_over_points(n_points, &mean_name, stats)
        {
            let v = stats.get(&(0, m.clone())).map_or(f64::NAN, |s| s.mean);
            let means: Vec<f64> = (0..n_points)
                .filter_map(|i| stats.get(&(i, mean_name.clone())).map(|s| s.mean))
                .collect();
            let (lo, hi) = means
                .iter()
                .fold((f64::MAX, f64::MIN), |(l, h), &x| (l.min(x), h.max(x)));
            w.push(format!(
                "`{m}` is {v:.4} at every point while `{mean_name}` moves ({lo:.4} to \
                 {hi:.4}): a {pct} is read off a log-bucket histogram, as the midpoint of the \
                 bucket it falls in (buckets under 1 % wide), so a tail that moves less \
                 than one bucket reports the same value; the {pct} may also be set by a class \
                 of requests the swept key does not touch (see the per-class metrics). \
                 Compare means, or sweep wider."
            ));
        }
    }
}

/// `all.ttft_ms.p99` → ("P99", `all.ttft_ms.mean`); `p8_d8.ttft_p99_ms` → ("P99",
/// `p8_d8.ttft_mean_ms`).
fn percentile_counterpart(m: &str) -> Option<(String, String)> {
    let (head, last) = match m.rsplit_once('.') {
        Some((h, l)) => (format!("{h}."), l),
        None => (String::new(), m),
    };
    let parts: Vec<&str> = last.split('_').collect();
    let k = parts.iter().position(|p| {
        p.len() >= 2 && p.starts_with('p') && p[1..].bytes().all(|b| b.is_ascii_digit())
    })?;
    let pct = parts[k].to_uppercase();
    let mut q = parts.clone();
    q[k] = "mean";
    Some((pct, format!("{head}{}", q.join("_"))))
}

fn fmt_num(x: f64) -> String {
    let a = x.abs();
    if a == 0.0 {
        "0".into()
    } else if !(1e-3..1e6).contains(&a) {
        format!("{x:.3e}")
    } else if a >= 100.0 {
        format!("{x:.1}")
    } else {
        format!("{x:.4}")
    }
}

#[allow(clippy::too_many_arguments)]
fn summary_md(
    path: &str,
    kind: &str,
    spec: &Spec,
    points: &[Point],
    names: &[String],
    plotted: &[String],
    stats: &Stats,
    warnings: &[String],
) -> String {
    let mut s = format!(
        "# Sweep of `{kind}`\n\nConfig `{path}`: {} points × {} seeds ({}).\n\n",
        points.len(),
        spec.seeds.len(),
        spec.seeds
            .iter()
            .map(|s| s.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    for d in &spec.dims {
        s.push_str(&format!(
            "- `{}`: {}\n",
            d.name(),
            (0..d.n_values())
                .map(|i| d.label(i))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    s.push_str(&means_section(spec, points, names, plotted, stats));
    if !warnings.is_empty() {
        s.push_str("\n## Warnings\n\n");
        for w in warnings {
            s.push_str(&format!("- {w}\n"));
        }
    }
    s.push_str(
        "\n## Files\n\n- `sweep.csv`/`.parquet`: one row per point × seed (a column per swept \
         key, the seed, a column per metric).\n- `sweep_summary.csv`/`.parquet`: per point and \
         metric, the mean, standard deviation and 95 % interval over the seeds.\n- `plots/`: \
         each plotted metric against the first numeric swept key.\n- `points/<id>/`: every \
         run's own outputs.\n",
    );
    s
}

/// The table of means (with interval half-widths over several seeds) per point, of the plotted
/// metrics, or of the first ones when none is plotted.
fn means_section(
    spec: &Spec,
    points: &[Point],
    names: &[String],
    plotted: &[String],
    stats: &Stats,
) -> String {
    let shown: Vec<&String> = if plotted.is_empty() {
        names.iter().take(MAX_PLOTS).collect()
    } else {
        plotted.iter().collect()
    };
    let ci = spec.seeds.len() > 1;
    let mut s = format!(
        "\nMean{} of each metric per point{}:\n\n",
        if ci {
            " ± 95 % interval half-width (Student t)"
        } else {
            ""
        },
        if shown.len() < names.len() {
            format!(
                " ({} of {} metrics; all are in `sweep_summary.csv`)",
                shown.len(),
                names.len()
            )
        } else {
            String::new()
        }
    );
    let mut header: Vec<String> = spec.dims.iter().map(|d| d.name()).collect();
    header.extend(shown.iter().map(|m| m.to_string()));
    let rows: Vec<Vec<String>> = points
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut r: Vec<String> = spec
                .dims
                .iter()
                .zip(&p.coords)
                .map(|(d, &c)| d.label(c))
                .collect();
            for m in &shown {
                r.push(match stats.get(&(i, m.to_string())) {
                    Some(iv) => match iv.half_width {
                        Some(h) => format!("{} ± {}", fmt_num(iv.mean), fmt_num(h)),
                        None => fmt_num(iv.mean),
                    },
                    None => "—".into(),
                });
            }
            r
        })
        .collect();
    let hdr: Vec<&str> = header.iter().map(|h| h.as_str()).collect();
    s.push_str(&markdown_table(&hdr, &rows));
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentile_names_pair_with_their_mean() {
        assert_eq!(
            percentile_counterpart("all.ttft_ms.p99"),
            Some(("P99".into(), "all.ttft_ms.mean".into()))
        );
        assert_eq!(
            percentile_counterpart("p16_d16.ttft_p99_ms"),
            Some(("P99".into(), "p16_d16.ttft_mean_ms".into()))
        );
        assert_eq!(percentile_counterpart("hit_rate"), None);
    }

    #[test]
    fn headline_metrics_rank_before_breakdowns() {
        let mut names = vec![
            "agent.ttft_ms.mean",
            "rejected.queue_full",
            "hit_rate",
            "steady.decode_seqs_per_rank",
            "all.ttft_ms.p99",
        ];
        names.sort_by_key(|m| (headline_rank(m), *m));
        assert_eq!(
            names,
            [
                "all.ttft_ms.p99",
                "steady.decode_seqs_per_rank",
                "hit_rate",
                "agent.ttft_ms.mean",
                "rejected.queue_full"
            ]
        );
    }

    #[test]
    fn point_ids_are_stable() {
        assert_eq!(fnv1a(""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a("a"), 0xaf63_dc4c_8601_ec8c);
    }
}
