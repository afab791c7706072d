//! The `cluster` experiment: several serving units (any sizes) behind one entrypoint that
//! routes whole sessions, all sharing one KV store, against the same units each on a store of
//! its own (the baseline beside the policy). Per unit and in all: requests, hit rate, TTFT and
//! TPOT; the store the cluster holds.

use super::RunContext;
use crate::config::ExperimentHeader;
use crate::output::{Manifest, RunOutput, markdown_table};
use anyhow::{Result, anyhow};
use polars::prelude::*;
use rayon::prelude::*;
use serde::Deserialize;
use servelab_core::unit::ServiceReport;
use servelab_sim::cluster::{UnitSize, route, run as run_cluster, unit_service};
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
}

/// One unit's figures in one arrangement.
struct Row {
    arrangement: &'static str,
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
    let started = Instant::now();
    let shared = run_cluster(&cfg.service, &cfg.cluster.units, &trace.requests, seed)
        .map_err(|e| anyhow!("{path}: {e}"))?;
    let wall = started.elapsed().as_secs_f64();
    let mut rows: Vec<Row> = shared
        .units
        .into_iter()
        .zip(&services)
        .map(|((unit, rep), s)| Row {
            arrangement: "shared store",
            unit,
            gpus: s.gpus(),
            rep,
        })
        .collect();
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
                arrangement: "own stores",
                unit: u.name.clone(),
                gpus: s.gpus(),
                rep,
            })
        })
        .collect::<Result<_>>()?;
    rows.extend(own);
    let mut out = RunOutput::create(&ctx.out)?;
    out.write_table("units", &mut units_table(&rows)?)?;
    let text = summary(&rows, shared.store_peak_bytes);
    out.write_text("summary.md", &text)?;
    out.write_summary_json(&headline(&rows))?;
    let simulated = rows.iter().map(|r| r.rep.simulated_s).fold(0.0, f64::max);
    let speed = serde_json::json!({
        "wall_s": wall,
        "simulated_per_wall": simulated / wall.max(1e-9),
        "requests_per_wall_s": trace.requests.len() as f64 / wall.max(1e-9),
    });
    let m = Manifest::new("cluster", &ctx.config.path, &ctx.config.text, seed);
    out.write_manifest_with_speed(&m, speed)?;
    println!("{text}");
    println!(
        "cluster: {simulated:.0} s simulated in {wall:.1} s wall ({:.0}x real time, {:.0} requests/s)",
        simulated / wall.max(1e-9),
        trace.requests.len() as f64 / wall.max(1e-9)
    );
    Ok(())
}

fn hit_rate(r: &ServiceReport) -> f64 {
    r.hit_tokens as f64 / r.input_tokens.max(1) as f64
}

fn units_table(rows: &[Row]) -> Result<DataFrame> {
    let ms = |h: &servelab_core::unit::Histogram, q: Option<f64>| {
        q.map_or(h.mean(), |q| h.quantile(q)) / 1e6
    };
    Ok(df!(
        "arrangement" => rows.iter().map(|r| r.arrangement).collect::<Vec<_>>(),
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

fn summary(rows: &[Row], store_peak_bytes: u64) -> String {
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
    let (shared, own) = (overall(rows, "shared store"), overall(rows, "own stores"));
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
        rows.len() / 2,
        markdown_table(&header, &table),
        100.0 * shared,
        100.0 * own,
        store_peak_bytes as f64 / 2f64.powi(30)
    )
}

fn headline(rows: &[Row]) -> BTreeMap<String, f64> {
    let mut h = BTreeMap::new();
    h.insert("shared.hit_rate".into(), overall(rows, "shared store"));
    h.insert("own.hit_rate".into(), overall(rows, "own stores"));
    h
}
