//! The `sampling` experiment: a serving unit simulated on 1 in R of its sessions, with its
//! capacities scaled by 1/R to match (spatial sampling, as SHARDS does for caches), against
//! the unsampled run of the same config and seed. Per rate: the hit rate, TTFT and TPOT (mean,
//! P99), rejections, and their errors against the least-sampled run, with the targets' verdicts.
//!
//! What scales by 1/R: prefill engines, decode groups (each keeps its ranks: the EP width and
//! so the per-rank cost model stay the same), the machines holding SWA state, the storage
//! nodes, the store's capacity and the prefill queue bound. What does not: every per-GPU and
//! per-request quantity. A rate that does not divide a count is an error naming both.

use super::RunContext;
use crate::config::ExperimentHeader;
use crate::output::{Manifest, RunOutput, markdown_table};
use crate::speed::Speed;
use anyhow::{Result, anyhow, bail};
use polars::prelude::*;
use rayon::prelude::*;
use serde::Deserialize;
use servelab_core::seed::sub_seed;
use servelab_sim::service::{ServiceConfig, ServiceReport, run as simulate};
use servelab_workloads::Trace;
use servelab_workloads::generate::{WorkloadConfig, generate_sampled};
use servelab_workloads::stream::SessionSample;
use std::collections::BTreeMap;
use std::time::Instant;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    #[allow(dead_code)]
    experiment: ExperimentHeader,
    service: ServiceConfig,
    workload: WorkloadConfig,
    sampling: Sampling,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Sampling {
    /// Sampling rates; the smallest is the reference (1: every session).
    one_in: Vec<u32>,
    /// Targets: hit rate within this many points, latencies within this relative error.
    hit_pp: f64,
    latency_rel: f64,
}

struct Point {
    one_in: u32,
    gpus: u32,
    rep: ServiceReport,
    wall_s: f64,
}

/// The figures compared across rates.
#[derive(Clone, Copy)]
struct Figures {
    hit_rate: f64,
    ttft_mean_ms: f64,
    ttft_p99_ms: f64,
    tpot_mean_ms: f64,
    tpot_p99_ms: f64,
    rejected_share: f64,
}

impl Point {
    fn figures(&self) -> Figures {
        let r = &self.rep;
        let ms = 1e-6;
        Figures {
            hit_rate: r.hit_tokens as f64 / r.input_tokens.max(1) as f64,
            ttft_mean_ms: r.all.ttft_ns.mean() * ms,
            ttft_p99_ms: r.all.ttft_ns.quantile(0.99) * ms,
            tpot_mean_ms: r.all.tpot_ns.mean() * ms,
            tpot_p99_ms: r.all.tpot_ns.quantile(0.99) * ms,
            rejected_share: r.rejected_total() as f64 / r.arrivals.max(1) as f64,
        }
    }
}

/// `n` divided by `one_in`, or an error naming the count.
fn divide(n: u32, one_in: u32, field: &str) -> Result<u32> {
    if !n.is_multiple_of(one_in) {
        bail!("sampling.one_in: 1 in {one_in} does not divide service.{field} ({n})");
    }
    Ok(n / one_in)
}

/// The unit that serves 1 in `one_in` sessions.
pub(crate) fn scaled(s: &ServiceConfig, one_in: u32) -> Result<ServiceConfig> {
    if s.autoscale.is_some() || !s.faults.is_default() || s.store.has_failures() {
        bail!("sampling: the autoscaler and fault schedules are not scaled; remove them");
    }
    let mut c = s.clone();
    c.prefill.gpus = divide(s.prefill.gpus, one_in, "prefill.gpus")?;
    c.decode.groups = divide(s.decode.groups, one_in, "decode.groups")?;
    c.swa.machines = divide(s.swa.machines, one_in, "swa.machines")?;
    // A sample smaller than a machine still has one prefill and one decode machine: the SWA
    // slots (1/R of them) are spread over those.
    let machines = u32::try_from(c.machines()).unwrap_or(u32::MAX);
    if c.swa.machines < machines {
        let slots = u64::from(c.swa.machines) * u64::from(s.swa.slots_per_machine);
        c.swa.slots_per_machine = u32::try_from(slots.div_ceil(u64::from(machines)))?;
        c.swa.machines = machines;
    }
    // An erasure-coded group needs its 12 nodes; the rest scales with the traffic.
    let group = s.store.ec_data_shards + s.store.ec_parity_shards;
    c.store.storage_nodes = s.store.storage_nodes.div_ceil(one_in).max(group);
    c.store.capacity_bytes = s.store.capacity_bytes.map(|b| b / u64::from(one_in));
    c.prefill.max_queued_requests = s.prefill.max_queued_requests.div_ceil(one_in);
    Ok(c)
}

/// The trace of 1 in `one_in` sessions of `w` (all of them at 1).
pub(crate) fn sampled_trace(w: &WorkloadConfig, seed: u64, bs: u32, one_in: u32) -> Result<Trace> {
    let sample = (one_in > 1).then(|| SessionSample {
        one_in,
        seed: sub_seed(seed, "sampling.sessions"),
    });
    Ok(generate_sampled(w, seed, bs, sample)?)
}

fn run_point(cfg: &Config, seed: u64, one_in: u32) -> Result<Point> {
    let started = Instant::now();
    let s = scaled(&cfg.service, one_in)?;
    let t = sampled_trace(&cfg.workload, seed, s.constants.block_tokens, one_in)?;
    let rep = simulate(&s, &t.requests, seed)?;
    Ok(Point {
        one_in,
        gpus: s.gpus(),
        rep,
        wall_s: started.elapsed().as_secs_f64(),
    })
}

pub fn run(ctx: &RunContext) -> Result<()> {
    let cfg: Config = ctx.config.parse()?;
    let path = ctx.config.path.display().to_string();
    let sm = &cfg.sampling;
    if sm.one_in.is_empty() || sm.one_in.contains(&0) {
        bail!("{path}: sampling.one_in: at least one rate, each at least 1");
    }
    if !(sm.hit_pp > 0.0 && sm.latency_rel > 0.0) {
        bail!("{path}: sampling.hit_pp and sampling.latency_rel must be positive");
    }
    let seed = ctx.seed();
    let mut rates = sm.one_in.clone();
    rates.sort_unstable();
    rates.dedup();
    let points: Vec<Point> = rates
        .par_iter()
        .map(|&r| run_point(&cfg, seed, r))
        .collect::<Result<_>>()
        .map_err(|e| anyhow!("{path}: {e}"))?;
    let mut out = RunOutput::create(&ctx.out)?;
    out.write_table("points", &mut points_table(&points)?)?;
    plot(&mut out, &points)?;
    let text = summary(sm, &points);
    out.write_text("summary.md", &text)?;
    out.write_summary_json(&headline(&points))?;
    let m = Manifest::new("sampling", &ctx.config.path, &ctx.config.text, seed);
    let speeds = speeds(&points);
    out.write_manifest(&m, &speeds)?;
    println!("{text}");
    crate::speed::print(&speeds);
    Ok(())
}

/// Relative error of `x` against `base`.
fn rel(x: f64, base: f64) -> f64 {
    x / base - 1.0
}

fn points_table(points: &[Point]) -> Result<DataFrame> {
    let f: Vec<Figures> = points.iter().map(Point::figures).collect();
    let b = f[0];
    let col = |g: fn(&Figures) -> f64| f.iter().map(g).collect::<Vec<_>>();
    Ok(df!(
        "one_in" => points.iter().map(|p| p.one_in).collect::<Vec<_>>(),
        "gpus" => points.iter().map(|p| p.gpus).collect::<Vec<_>>(),
        "arrivals" => points.iter().map(|p| p.rep.arrivals).collect::<Vec<_>>(),
        "hit_rate" => col(|x| x.hit_rate),
        "ttft_mean_ms" => col(|x| x.ttft_mean_ms),
        "ttft_p99_ms" => col(|x| x.ttft_p99_ms),
        "tpot_mean_ms" => col(|x| x.tpot_mean_ms),
        "tpot_p99_ms" => col(|x| x.tpot_p99_ms),
        "rejected_share" => col(|x| x.rejected_share),
        "hit_error_pp" => f.iter().map(|x| 100.0 * (x.hit_rate - b.hit_rate)).collect::<Vec<_>>(),
        "ttft_mean_error" => f.iter().map(|x| rel(x.ttft_mean_ms, b.ttft_mean_ms)).collect::<Vec<_>>(),
        "ttft_p99_error" => f.iter().map(|x| rel(x.ttft_p99_ms, b.ttft_p99_ms)).collect::<Vec<_>>(),
        "tpot_mean_error" => f.iter().map(|x| rel(x.tpot_mean_ms, b.tpot_mean_ms)).collect::<Vec<_>>(),
    )?)
}

fn plot(out: &mut RunOutput, points: &[Point]) -> Result<()> {
    let f: Vec<Figures> = points.iter().map(Point::figures).collect();
    let b = f[0];
    let series = |name: &str, g: &dyn Fn(&Figures) -> f64| {
        let pts = points
            .iter()
            .zip(&f)
            .map(|(p, x)| (f64::from(p.one_in).log2(), 100.0 * g(x)))
            .collect();
        (name.to_string(), pts)
    };
    let p = out.path("errors.svg");
    crate::plot::lines(
        &p,
        &format!("Error against 1 in {} sessions", points[0].one_in),
        "log2 R (1 in R sessions)",
        "error (%; hit rate: points)",
        &[
            series("TTFT mean", &|x| rel(x.ttft_mean_ms, b.ttft_mean_ms)),
            series("TTFT P99", &|x| rel(x.ttft_p99_ms, b.ttft_p99_ms)),
            series("TPOT mean", &|x| rel(x.tpot_mean_ms, b.tpot_mean_ms)),
            series("hit rate (points)", &|x| x.hit_rate - b.hit_rate),
        ],
    )
}

fn summary(sm: &Sampling, points: &[Point]) -> String {
    let f: Vec<Figures> = points.iter().map(Point::figures).collect();
    let b = f[0];
    let header = [
        "1 in",
        "GPUs",
        "requests",
        "hit rate",
        "TTFT mean ms",
        "TTFT P99 ms",
        "TPOT mean ms",
        "rejected",
    ];
    let rows: Vec<Vec<String>> = points
        .iter()
        .zip(&f)
        .map(|(p, x)| {
            vec![
                p.one_in.to_string(),
                p.gpus.to_string(),
                p.rep.arrivals.to_string(),
                format!("{:.2}%", 100.0 * x.hit_rate),
                format!("{:.1}", x.ttft_mean_ms),
                format!("{:.1}", x.ttft_p99_ms),
                format!("{:.2}", x.tpot_mean_ms),
                format!("{:.2}%", 100.0 * x.rejected_share),
            ]
        })
        .collect();
    let points_word = if sm.hit_pp == 1.0 { "point" } else { "points" };
    let mut s = format!(
        "# Sampled units against 1 in {}\n\n{}\nTargets: hit rate within {} {points_word}, TTFT \
         mean and P99 within {:.0}%.\n\n",
        points[0].one_in,
        markdown_table(&header, &rows),
        sm.hit_pp,
        100.0 * sm.latency_rel
    );
    for (p, x) in points.iter().zip(&f).skip(1) {
        let errs = [
            ("TTFT mean", rel(x.ttft_mean_ms, b.ttft_mean_ms)),
            ("TTFT P99", rel(x.ttft_p99_ms, b.ttft_p99_ms)),
        ];
        let hit = 100.0 * (x.hit_rate - b.hit_rate);
        let missed: Vec<&str> = errs
            .iter()
            .filter(|e| e.1.abs() > sm.latency_rel)
            .map(|e| e.0)
            .chain((hit.abs() > sm.hit_pp).then_some("hit rate"))
            .collect();
        let verdict = if missed.is_empty() {
            "every target met".to_string()
        } else {
            format!("missed: {}", missed.join(", "))
        };
        s += &format!(
            "- 1 in {} ({} GPUs): hit rate {:+.2} points, TTFT mean {:+.1}%, P99 {:+.1}%, TPOT \
             mean {:+.1}%: {verdict}.\n",
            p.one_in,
            p.gpus,
            hit,
            100.0 * errs[0].1,
            100.0 * errs[1].1,
            100.0 * rel(x.tpot_mean_ms, b.tpot_mean_ms),
        );
    }
    s
}

fn headline(points: &[Point]) -> BTreeMap<String, f64> {
    let mut h = BTreeMap::new();
    for p in points {
        let x = p.figures();
        h.insert(format!("1_in_{}.hit_rate", p.one_in), x.hit_rate);
        h.insert(format!("1_in_{}.ttft_mean_ms", p.one_in), x.ttft_mean_ms);
        h.insert(format!("1_in_{}.ttft_p99_ms", p.one_in), x.ttft_p99_ms);
    }
    h
}

fn speeds(points: &[Point]) -> Vec<Speed> {
    points
        .iter()
        .map(|p| {
            let label = format!("1 in {}", p.one_in);
            Speed::new(label, p.wall_s, p.rep.simulated_s, p.rep.arrivals)
        })
        .collect()
}
