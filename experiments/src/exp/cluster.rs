//! The `cluster` experiment: several serving units (any sizes) behind one entrypoint that
//! routes whole sessions, all sharing one KV store, against the same units each on a store of
//! its own (the baseline beside the policy). Per unit and in all: requests, hit rate, TTFT and
//! TPOT; the store the cluster holds.

use super::RunContext;
use crate::config::ExperimentHeader;
use crate::output::{Manifest, RunOutput, markdown_table};
use crate::speed::Speed;
use anyhow::{Result, anyhow};
use polars::prelude::*;
use rayon::prelude::*;
use serde::Deserialize;
use servelab_core::Nanos;
use servelab_core::unit::ServiceReport;
use servelab_sim::cluster::{ClusterReport, ClusterRun, UnitSize, route, run_with, unit_service};
use servelab_sim::service::{ServiceConfig, run as simulate};
use servelab_workloads::generate::WorkloadConfig;
use std::collections::BTreeMap;
use std::time::Instant;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    #[allow(dead_code)]
    experiment: ExperimentHeader,
    /// Everything but the units' sizes, shared by every unit (the store among them).
    service: ServiceConfig,
    cluster: Cluster,
    workload: WorkloadConfig,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Cluster {
    units: Vec<UnitSize>,
    /// 0 (the default): the units one input at a time, every write visible at once. Otherwise
    /// the units also run side by side in windows this long, once per entry of `threads`
    /// (side by side in one run: the speed-up, and a check that outputs do not move).
    #[serde(default)]
    window: Nanos,
    #[serde(default = "one_thread")]
    threads: Vec<u32>,
}

fn one_thread() -> Vec<u32> {
    vec![1]
}

/// One timed run of the shared-store cluster.
struct Timed {
    label: String,
    threads: u32,
    wall_s: f64,
    report: ClusterReport,
}

/// One unit's figures in one arrangement.
struct Row {
    arrangement: String,
    unit: String,
    gpus: u32,
    rep: ServiceReport,
}

pub fn run(ctx: &RunContext) -> Result<()> {
    let cfg: Config = ctx.config.parse()?;
    let path = ctx.config.path.display().to_string();
    let seed = ctx.seed();
    let bs = cfg.service.constants.block_tokens;
    let trace = servelab_workloads::generate::generate(&cfg.workload, seed, bs)
        .map_err(|e| anyhow!("{path}: {e}"))?;
    let services: Vec<ServiceConfig> = cfg
        .cluster
        .units
        .iter()
        .map(|u| unit_service(&cfg.service, u))
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow!("{path}: {e}"))?;
    let runs = shared_runs(&cfg, &trace.requests, seed).map_err(|e| anyhow!("{path}: {e}"))?;
    check_thread_counts(&runs)?;
    let mut rows = Vec::new();
    // The sequential run, and the windowed run on the most threads (the others gave the same).
    let shown = if runs.len() > 1 {
        vec![&runs[0], &runs[runs.len() - 1]]
    } else {
        vec![&runs[0]]
    };
    for t in shown {
        rows.extend(
            t.report
                .units
                .iter()
                .zip(&services)
                .map(|((unit, rep), s)| Row {
                    arrangement: t.label.clone(),
                    unit: unit.clone(),
                    gpus: s.gpus(),
                    rep: rep.clone(),
                }),
        );
    }
    // The baseline: the same units and the same routed requests, each on a store of its own
    // (independent runs, so in parallel).
    let tables = route(&trace.requests, &services, seed);
    let own: Vec<Row> = (0..services.len())
        .into_par_iter()
        .map(|k| {
            let (u, s) = (&cfg.cluster.units[k], &services[k]);
            let rep = simulate(s, &tables[k], seed)
                .map_err(|e| anyhow!("{path}: unit {}: {e}", u.name))?;
            Ok(Row {
                arrangement: "own stores".into(),
                unit: u.name.clone(),
                gpus: s.gpus(),
                rep,
            })
        })
        .collect::<Result<_>>()?;
    rows.extend(own);
    let mut out = RunOutput::create(&ctx.out)?;
    out.write_table("units", &mut units_table(&rows)?)?;
    out.write_table("speed", &mut speed_table(&runs, trace.requests.len())?)?;
    let peak = runs[0].report.store_peak_bytes;
    let text =
        summary(&rows, cfg.cluster.units.len(), peak) + &speed_summary(&runs, cfg.cluster.window);
    out.write_text("summary.md", &text)?;
    out.write_summary_json(&headline(&rows, &runs))?;
    let simulated = rows.iter().map(|r| r.rep.simulated_s).fold(0.0, f64::max);
    let requests = trace.requests.len() as u64;
    let speeds: Vec<Speed> = runs
        .iter()
        .map(|t| {
            let plural = if t.threads == 1 { "" } else { "s" };
            let label = format!("{}, {} thread{plural}", t.label, t.threads);
            Speed::new(label, t.wall_s, simulated, requests)
        })
        .collect();
    let m = Manifest::new("cluster", &ctx.config.path, &ctx.config.text, seed);
    out.write_manifest(&m, &speeds)?;
    println!("{text}");
    crate::speed::print(&speeds);
    Ok(())
}

/// The shared-store cluster one input at a time, then (with a window) in windows on each
/// thread count, each run timed.
fn shared_runs(cfg: &Config, requests: &[servelab_core::Request], seed: u64) -> Result<Vec<Timed>> {
    let mut runs = Vec::new();
    let mut hows = vec![("shared store".to_string(), ClusterRun::default())];
    if cfg.cluster.window > Nanos::ZERO {
        for &threads in &cfg.cluster.threads {
            let how = ClusterRun {
                window: cfg.cluster.window,
                threads,
            };
            hows.push((format!("shared store, {} windows", cfg.cluster.window), how));
        }
    }
    for (label, how) in hows {
        let started = Instant::now();
        let report = run_with(&cfg.service, &cfg.cluster.units, requests, seed, how)?;
        runs.push(Timed {
            label,
            threads: how.threads,
            wall_s: started.elapsed().as_secs_f64(),
            report,
        });
    }
    Ok(runs)
}

/// What a unit reported, for the check that thread counts change nothing.
fn unit_figures(r: &ServiceReport) -> String {
    format!(
        "{} {} {} {} {} {:?} {:?} {:?}",
        r.arrivals,
        r.completed,
        r.hit_tokens,
        r.input_tokens,
        r.events,
        r.all.ttft_ns,
        r.all.tpot_ns,
        r.storage
    )
}

/// Every windowed run gives the same figures, whatever its thread count (a bug otherwise).
fn check_thread_counts(runs: &[Timed]) -> Result<()> {
    let windowed: Vec<&Timed> = runs.iter().skip(1).collect();
    let Some(first) = windowed.first() else {
        return Ok(());
    };
    let figures = |t: &Timed| -> Vec<String> {
        t.report
            .units
            .iter()
            .map(|(_, r)| unit_figures(r))
            .collect()
    };
    for t in &windowed[1..] {
        if figures(t) != figures(first)
            || t.report.store_peak_bytes != first.report.store_peak_bytes
        {
            return Err(anyhow!(
                "the windowed cluster gave different results on {} and {} threads",
                first.threads,
                t.threads
            ));
        }
    }
    Ok(())
}

fn speed_table(runs: &[Timed], requests: usize) -> Result<DataFrame> {
    let base = runs.get(1).map_or(runs[0].wall_s, |t| t.wall_s);
    Ok(df!(
        "run" => runs.iter().map(|t| t.label.clone()).collect::<Vec<_>>(),
        "threads" => runs.iter().map(|t| t.threads).collect::<Vec<_>>(),
        "wall_s" => runs.iter().map(|t| t.wall_s).collect::<Vec<_>>(),
        "requests_per_wall_s" => runs.iter().map(|t| requests as f64 / t.wall_s.max(1e-9)).collect::<Vec<_>>(),
        "speedup_vs_one_thread_windows" => runs.iter().map(|t| base / t.wall_s.max(1e-9)).collect::<Vec<_>>(),
        "hit_rate" => runs.iter().map(|t| t.report.hit_rate()).collect::<Vec<_>>(),
    )?)
}

/// The windows against the sequential run (accuracy) and against one thread (speed).
fn speed_summary(runs: &[Timed], window: Nanos) -> String {
    let exact = &runs[0];
    let Some(one) = runs.get(1) else {
        return format!(
            "\nThe units ran one input at a time on one thread, in {:.1} s of wall time.\n",
            exact.wall_s
        );
    };
    let mut s = format!(
        "\nIn windows of {window} (a unit sees the others' writes from the next window on), the \
         cluster hits {:.3}% against {:.3}% one input at a time ({:+.3} points).",
        100.0 * one.report.hit_rate(),
        100.0 * exact.report.hit_rate(),
        100.0 * (one.report.hit_rate() - exact.report.hit_rate())
    );
    for t in &runs[2..] {
        s += &format!(
            " On {} threads it took {:.1} s against {:.1} s on one ({:.2}x), with the same results.",
            t.threads,
            t.wall_s,
            one.wall_s,
            one.wall_s / t.wall_s.max(1e-9)
        );
    }
    s + &format!(
        " One input at a time (no windows) took {:.1} s.\n",
        exact.wall_s
    )
}

fn hit_rate(r: &ServiceReport) -> f64 {
    r.hit_tokens as f64 / r.input_tokens.max(1) as f64
}

fn units_table(rows: &[Row]) -> Result<DataFrame> {
    let ms = |h: &servelab_core::unit::Histogram, q: Option<f64>| {
        q.map_or(h.mean(), |q| h.quantile(q)) / 1e6
    };
    Ok(df!(
        "arrangement" => rows.iter().map(|r| r.arrangement.clone()).collect::<Vec<_>>(),
        "unit" => rows.iter().map(|r| r.unit.clone()).collect::<Vec<_>>(),
        "gpus" => rows.iter().map(|r| r.gpus).collect::<Vec<_>>(),
        "arrivals" => rows.iter().map(|r| r.rep.arrivals).collect::<Vec<_>>(),
        "input_tokens" => rows.iter().map(|r| r.rep.input_tokens).collect::<Vec<_>>(),
        "hit_rate" => rows.iter().map(|r| hit_rate(&r.rep)).collect::<Vec<_>>(),
        "ttft_mean_ms" => rows.iter().map(|r| ms(&r.rep.all.ttft_ns, None)).collect::<Vec<_>>(),
        "ttft_p99_ms" => rows.iter().map(|r| ms(&r.rep.all.ttft_ns, Some(0.99))).collect::<Vec<_>>(),
        "tpot_mean_ms" => rows.iter().map(|r| ms(&r.rep.all.tpot_ns, None)).collect::<Vec<_>>(),
        "rejected" => rows.iter().map(|r| r.rep.rejected_total()).collect::<Vec<_>>(),
    )?)
}

/// Hit rate over every unit of one arrangement.
fn overall(rows: &[Row], arrangement: &str) -> f64 {
    let (h, i) = rows
        .iter()
        .filter(|r| r.arrangement == arrangement)
        .fold((0u64, 0u64), |(h, i), r| {
            (h + r.rep.hit_tokens, i + r.rep.input_tokens)
        });
    h as f64 / i.max(1) as f64
}

fn summary(rows: &[Row], units: usize, store_peak_bytes: u64) -> String {
    let header = [
        "arrangement",
        "unit",
        "GPUs",
        "requests",
        "hit rate",
        "TTFT mean ms",
        "TTFT P99 ms",
    ];
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.arrangement.to_string(),
                r.unit.clone(),
                r.gpus.to_string(),
                r.rep.arrivals.to_string(),
                format!("{:.2}%", 100.0 * hit_rate(&r.rep)),
                format!("{:.1}", r.rep.all.ttft_ns.mean() / 1e6),
                format!("{:.1}", r.rep.all.ttft_ns.quantile(0.99) / 1e6),
            ]
        })
        .collect();
    let shared_label = &rows[0].arrangement;
    let (shared, own) = (overall(rows, shared_label), overall(rows, "own stores"));
    let gain = 100.0 * (shared - own);
    let reading = if gain.abs() < 0.1 {
        "sessions stay on their unit, so sharing only adds what one unit wrote and another \
         reads (system prompts, repeated documents), and here that is little"
    } else if gain > 0.0 {
        "what one unit wrote (system prompts, repeated documents) the others find"
    } else {
        "the shared store holds less of each unit's working set than its own store would"
    };
    format!(
        "# A cluster of {} units\n\n{}\nSessions are routed whole, by a hash of their id, in \
         proportion to the units' GPUs. Sharing one store, the cluster hits {:.2}% of its input \
         tokens against {:.2}% with a store per unit ({gain:+.2} points): {reading}. The shared \
         store held at most {:.2} GiB.\n",
        units,
        markdown_table(&header, &table),
        100.0 * shared,
        100.0 * own,
        store_peak_bytes as f64 / 2f64.powi(30)
    )
}

fn headline(rows: &[Row], runs: &[Timed]) -> BTreeMap<String, f64> {
    let mut h = BTreeMap::new();
    h.insert("shared.hit_rate".into(), runs[0].report.hit_rate());
    h.insert("own.hit_rate".into(), overall(rows, "own stores"));
    if let Some(w) = runs.get(1) {
        h.insert("windows.hit_rate".into(), w.report.hit_rate());
    }
    h
}
