//! Capacity planning with the simulator (`servelab plan`): for a traffic description and SLOs,
//! the fewest prefill and decode GPUs that meet them, and the smallest store that reaches a
//! target hit rate.
//!
//! Capacity is sized for the daily peak: with a diurnal amplitude A the arrival rates are
//! simulated at (1 + A) × their mean. Every (prefill GPUs, decode GPUs) candidate runs the same
//! trace through `servelab_sim::service::run`, in parallel; a candidate is feasible when it
//! rejects no more than allowed and meets every SLO. The store is sized with the trace-level
//! replay, which gives the same hit rate as the simulator's entrypoint for a given capacity at a
//! tiny fraction of the cost. At the chosen point the result is cross-checked against the
//! economics model of SPEC §12 (`servelab econ`) fed the throughputs the simulation measured.

use super::{RunContext, progress};
use crate::config::ExperimentHeader;
use crate::output::{Manifest, RunOutput, markdown_table};
use crate::plot;
use crate::speed::Speed;
use anyhow::{Result, anyhow, bail};
use polars::prelude::*;
use rayon::prelude::*;
use serde::Deserialize;
use servelab_core::{Nanos, StoreConfig};
use servelab_sim::replay::{ReplayConfig, replay};
use servelab_sim::service::{ServiceConfig, ServiceReport, run as simulate};
use servelab_workloads::Trace;
use servelab_workloads::generate::{WorkloadConfig, generate};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanConfig {
    pub experiment: ExperimentHeader,
    pub slo: Slo,
    pub search: Search,
    #[serde(default)]
    pub store_search: Option<StoreSearch>,
    #[serde(default)]
    pub service: ServiceConfig,
    pub workload: WorkloadConfig,
}

/// Service-level objectives over the measured requests.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Slo {
    pub ttft_mean: Nanos,
    pub ttft_p99: Nanos,
    /// Mean time per output token (1 / generation speed per request).
    pub tpot_mean: Nanos,
    /// Share of arrivals that may be rejected (queues are bounded).
    #[serde(default)]
    pub max_rejected_share: f64,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Search {
    /// Prefill pool sizes to try, GPUs.
    pub prefill_gpus: Vec<u32>,
    /// Decode pool sizes to try: GPUs of one EP group (its rank count).
    pub decode_gpus: Vec<u32>,
    /// Only try equal pools (SPEC §8: prefill : decode ≈ 1 : 1).
    #[serde(default)]
    pub one_to_one: bool,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StoreSearch {
    /// The hit rate (share of input tokens) the store must reach.
    pub target_hit_rate: f64,
    /// Logical capacities to try, TB (10¹² bytes), smallest first.
    pub capacities_tb: Vec<f64>,
}

/// One simulated candidate.
#[derive(Clone, Debug)]
pub struct Candidate {
    pub prefill_gpus: u32,
    pub decode_gpus: u32,
    pub report: ServiceReport,
    pub rejected_share: f64,
    pub feasible: bool,
    pub why_not: String,
    /// Its simulation's speed (differs between two runs of the same inputs: stdout and the
    /// manifest only).
    pub speed: Speed,
}

impl Candidate {
    pub fn gpus(&self) -> u32 {
        self.prefill_gpus + self.decode_gpus
    }
}

/// The peak-hour trace: rates × (1 + amplitude), diurnal shape removed.
pub fn peak_workload(w: &WorkloadConfig) -> WorkloadConfig {
    let mut w = w.clone();
    if let Some(d) = w.diurnal.take() {
        let f = 1.0 + d.amplitude;
        if let Some(a) = &mut w.agent {
            a.session_rate_per_s *= f;
        }
        if let Some(c) = &mut w.chat {
            c.session_rate_per_s *= f;
        }
        if let Some(d) = &mut w.documents {
            d.rate_per_s *= f;
        }
    }
    w
}

fn check(cfg: &PlanConfig, path: &str) -> Result<()> {
    let s = &cfg.search;
    if s.prefill_gpus.is_empty() || s.decode_gpus.is_empty() {
        bail!("{path}: search.prefill_gpus and search.decode_gpus must not be empty");
    }
    if let Some(&g) = s.prefill_gpus.iter().find(|&&g| g == 0) {
        bail!("{path}: search.prefill_gpus: {g} GPUs is not a pool");
    }
    if let Some(&g) = s.decode_gpus.iter().find(|&&g| g == 0) {
        bail!("{path}: search.decode_gpus: {g} GPUs is not a pool");
    }
    if !(0.0..1.0).contains(&cfg.slo.max_rejected_share) {
        bail!("{path}: slo.max_rejected_share must be in [0, 1)");
    }
    for (f, v) in [
        ("ttft_mean", cfg.slo.ttft_mean),
        ("ttft_p99", cfg.slo.ttft_p99),
        ("tpot_mean", cfg.slo.tpot_mean),
    ] {
        if v == Nanos::ZERO {
            bail!("{path}: slo.{f} must be positive");
        }
    }
    if let Some(st) = &cfg.store_search {
        if !(0.0..=1.0).contains(&st.target_hit_rate) {
            bail!("{path}: store_search.target_hit_rate must be in [0, 1]");
        }
        if st.capacities_tb.is_empty()
            || st
                .capacities_tb
                .iter()
                .any(|&c| !(c.is_finite() && c > 0.0))
        {
            bail!("{path}: store_search.capacities_tb must list positive capacities");
        }
    }
    Ok(())
}

/// Runs every candidate (in parallel) and judges it against the SLOs.
pub fn simulate_candidates(
    cfg: &PlanConfig,
    trace: &Trace,
    seed: u64,
    pb: &indicatif::ProgressBar,
) -> Result<Vec<Candidate>> {
    let mut pairs = Vec::new();
    for &p in &cfg.search.prefill_gpus {
        for &d in &cfg.search.decode_gpus {
            if !cfg.search.one_to_one || p == d {
                pairs.push((p, d));
            }
        }
    }
    if pairs.is_empty() {
        bail!("search.one_to_one leaves no candidate: no prefill size equals a decode size");
    }
    pb.set_length(pairs.len() as u64);
    let results: Vec<Result<Candidate>> = pairs
        .par_iter()
        .map(|&(p, d)| {
            let mut sc = cfg.service.clone();
            sc.prefill.gpus = p;
            sc.decode.groups = 1;
            sc.decode.ranks = d;
            // SWA slots live on every machine of the unit.
            sc.swa.machines = p.div_ceil(sc.prefill.gpus_per_machine.max(1))
                + d.div_ceil(sc.decode.gpus_per_machine.max(1));
            let started = std::time::Instant::now();
            let report = simulate(&sc, &trace.requests, seed)
                .map_err(|e| anyhow!("candidate {p} prefill + {d} decode GPUs: {e}"))?;
            let speed = Speed::of_service(format!("{p} + {d} GPUs"), started, &report);
            pb.inc(1);
            Ok(judge(&cfg.slo, p, d, report, speed))
        })
        .collect();
    results.into_iter().collect()
}

fn judge(slo: &Slo, p: u32, d: u32, report: ServiceReport, speed: Speed) -> Candidate {
    let rejected: u64 = report.rejected.iter().map(|r| r.requests).sum();
    let rejected_share = rejected as f64 / report.arrivals.max(1) as f64;
    let mut why = Vec::new();
    if rejected_share > slo.max_rejected_share {
        why.push(format!("rejects {:.2}%", 100.0 * rejected_share));
    }
    let lat = &report.all;
    if lat.ttft_ns.count() == 0 {
        why.push("no measured request".to_string());
    } else {
        let (mean, p99, tpot) = (
            lat.ttft_ns.mean(),
            lat.ttft_ns.quantile(0.99),
            lat.tpot_ns.mean(),
        );
        if mean > slo.ttft_mean.0 as f64 {
            why.push(format!("TTFT mean {:.0} ms", mean / 1e6));
        }
        if p99 > slo.ttft_p99.0 as f64 {
            why.push(format!("TTFT P99 {:.0} ms", p99 / 1e6));
        }
        if tpot > slo.tpot_mean.0 as f64 {
            why.push(format!("TPOT {:.2} ms", tpot / 1e6));
        }
    }
    Candidate {
        prefill_gpus: p,
        decode_gpus: d,
        feasible: why.is_empty(),
        why_not: why.join("; "),
        rejected_share,
        report,
        speed,
    }
}

/// The feasible candidate with the fewest GPUs (ties: fewer prefill GPUs).
pub fn best(c: &[Candidate]) -> Option<&Candidate> {
    c.iter()
        .filter(|c| c.feasible)
        .min_by_key(|c| (c.gpus(), c.prefill_gpus))
}

/// For each prefill size, the fewest decode GPUs that meet the SLOs.
pub fn frontier(c: &[Candidate]) -> Vec<(u32, u32)> {
    let mut f: Vec<(u32, u32)> = Vec::new();
    for x in c.iter().filter(|c| c.feasible) {
        match f.iter_mut().find(|(p, _)| *p == x.prefill_gpus) {
            Some(e) => e.1 = e.1.min(x.decode_gpus),
            None => f.push((x.prefill_gpus, x.decode_gpus)),
        }
    }
    f.sort();
    f
}

/// The economics model's pool sizes for the traffic of the trace, set beside the planner's
/// chosen point. The model gets what the simulation did not produce: the offered load (the
/// trace's input and output tokens per second) and SPEC §11's published per-GPU rates with
/// SPEC §8's live-service efficiency; from the simulation it takes only the hit rate. So it can
/// disagree with the planner: the planner's pools are sized by SLOs under queueing, the model's
/// by throughput alone at the published rates.
pub struct EconCheck {
    pub input_tokens_per_s: f64,
    pub output_tokens_per_s: f64,
    pub sim_hit_rate: f64,
    pub econ_prefill_gpus: f64,
    pub econ_decode_gpus: f64,
}

pub fn econ_check(c: &Candidate, trace: &Trace) -> Result<EconCheck> {
    use servelab_core::econ::defaults;
    let r = &trace.requests;
    let (Some(first), Some(last)) = (r.first(), r.last()) else {
        bail!("economics cross-check: the trace is empty");
    };
    let span_s = (last.arrival.saturating_sub(first.arrival)).as_secs_f64();
    if span_s <= 0.0 {
        bail!("economics cross-check: every request arrives at once (no rate)");
    }
    let input: u64 = r.iter().map(|q| u64::from(q.prompt_tokens)).sum();
    let output: u64 = r.iter().map(|q| u64::from(q.output_tokens)).sum();
    let input_tokens_per_s = input as f64 / span_s;
    let output_tokens_per_s = output as f64 / span_s;
    let h = c.report.hit_rate();
    let prefill_tps = defaults::PREFILL_TPS * defaults::EFFICIENCY;
    let decode_tps = defaults::DECODE_TPS * defaults::EFFICIENCY;
    Ok(EconCheck {
        input_tokens_per_s,
        output_tokens_per_s,
        sim_hit_rate: h,
        econ_prefill_gpus: input_tokens_per_s * (1.0 - h) / prefill_tps,
        econ_decode_gpus: output_tokens_per_s / decode_tps,
    })
}

/// Smallest capacity (of those listed) whose DeepInfer hit rate reaches the target.
pub fn size_store(
    cfg: &PlanConfig,
    st: &StoreSearch,
    trace: &Trace,
) -> Result<Vec<(f64, f64, bool)>> {
    let rows: Vec<Result<(f64, f64)>> = st
        .capacities_tb
        .par_iter()
        .map(|&tb| {
            let rc = ReplayConfig {
                constants: cfg.service.constants.clone(),
                store: StoreConfig {
                    capacity_bytes: Some((tb * 1e12) as u64),
                    ..cfg.service.store.clone()
                },
                swa: cfg.service.swa.clone(),
                ..ReplayConfig::default()
            };
            let r = replay(trace, &rc, &[cfg.service.hit_policy])
                .map_err(|e| anyhow!("store search: {e}"))?;
            Ok((tb, r.hit_rate(cfg.service.hit_policy).unwrap_or(0.0)))
        })
        .collect();
    let rows: Vec<(f64, f64)> = rows.into_iter().collect::<Result<_>>()?;
    Ok(rows
        .into_iter()
        .map(|(tb, h)| (tb, h, h >= st.target_hit_rate))
        .collect())
}

pub fn run(ctx: &RunContext) -> Result<()> {
    let cfg: PlanConfig = ctx.config.parse()?;
    let path = ctx.config.path.display().to_string();
    check(&cfg, &path)?;
    let seed = ctx.seed();
    let peak = peak_workload(&cfg.workload);
    let trace = generate(&peak, seed, cfg.service.constants.block_tokens)
        .map_err(|e| anyhow!("{path}: {e}"))?;
    let pb = progress(ctx, 1, "candidates");
    let cands = simulate_candidates(&cfg, &trace, seed, &pb).map_err(|e| anyhow!("{path}: {e}"))?;
    pb.finish_and_clear();
    let stores = match &cfg.store_search {
        Some(st) => Some(size_store(&cfg, st, &trace)?),
        None => None,
    };

    let mut out = RunOutput::create(&ctx.out)?;
    write_candidates_table(&mut out, &cands)?;
    let front = frontier(&cands);
    let mut fdf = df!(
        "prefill_gpus" => front.iter().map(|f| f.0).collect::<Vec<_>>(),
        "min_decode_gpus" => front.iter().map(|f| f.1).collect::<Vec<_>>(),
    )?;
    out.write_table("frontier", &mut fdf)?;
    if let Some(s) = &stores {
        let mut sdf = df!(
            "capacity_tb" => s.iter().map(|r| r.0).collect::<Vec<_>>(),
            "hit_rate" => s.iter().map(|r| r.1).collect::<Vec<_>>(),
            "meets_target" => s.iter().map(|r| r.2).collect::<Vec<_>>(),
        )?;
        out.write_table("store", &mut sdf)?;
    }
    plot_ttft_p99(&mut out, &cfg, &cands)?;
    plot_frontier(&mut out, &front)?;

    let summary = summary_md(&cfg, &path, seed, &trace, &cands, stores.as_deref())?;
    let speeds: Vec<Speed> = cands.iter().map(|c| c.speed.clone()).collect();
    out.write_text("summary.md", &summary)?;
    out.write_summary_json(&crate::sweep::headline::plan(&cands, best(&cands)))?;
    out.write_manifest(
        &Manifest::new("plan", &ctx.config.path, &ctx.config.text, seed),
        &speeds,
    )?;
    println!("{summary}");
    crate::speed::print(&speeds);
    Ok(())
}

/// Nanoseconds to milliseconds.
fn ms(v: f64) -> f64 {
    v / 1e6
}

fn write_candidates_table(out: &mut RunOutput, cands: &[Candidate]) -> Result<()> {
    let mut df = df!(
        "prefill_gpus" => cands.iter().map(|c| c.prefill_gpus).collect::<Vec<_>>(),
        "decode_gpus" => cands.iter().map(|c| c.decode_gpus).collect::<Vec<_>>(),
        "gpus" => cands.iter().map(|c| c.gpus()).collect::<Vec<_>>(),
        "feasible" => cands.iter().map(|c| c.feasible).collect::<Vec<_>>(),
        "why_not" => cands.iter().map(|c| c.why_not.clone()).collect::<Vec<_>>(),
        "ttft_mean_ms" => cands.iter().map(|c| ms(c.report.all.ttft_ns.mean())).collect::<Vec<_>>(),
        "ttft_p99_ms" => cands.iter().map(|c| ms(c.report.all.ttft_ns.quantile(0.99))).collect::<Vec<_>>(),
        "tpot_mean_ms" => cands.iter().map(|c| ms(c.report.all.tpot_ns.mean())).collect::<Vec<_>>(),
        "rejected_share" => cands.iter().map(|c| c.rejected_share).collect::<Vec<_>>(),
        "hit_rate" => cands.iter().map(|c| c.report.hit_rate()).collect::<Vec<_>>(),
        "prefill_busy_fraction" => cands.iter().map(|c| c.report.prefill_busy_fraction).collect::<Vec<_>>(),
        "decode_busy_fraction" => cands.iter().map(|c| c.report.decode_busy_fraction).collect::<Vec<_>>(),
        "decode_seqs_per_rank" => cands.iter().map(|c| c.report.decode_seqs_per_rank).collect::<Vec<_>>(),
    )?;
    out.write_table("candidates", &mut df)
}

/// TTFT P99 against prefill GPUs, one line per decode size, with the SLO as a line.
fn plot_ttft_p99(out: &mut RunOutput, cfg: &PlanConfig, cands: &[Candidate]) -> Result<()> {
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    let mut decode_sizes: Vec<u32> = cands.iter().map(|c| c.decode_gpus).collect();
    decode_sizes.sort();
    decode_sizes.dedup();
    for d in &decode_sizes {
        let mut pts: Vec<(f64, f64)> = cands
            .iter()
            .filter(|c| c.decode_gpus == *d)
            .map(|c| {
                (
                    f64::from(c.prefill_gpus),
                    ms(c.report.all.ttft_ns.quantile(0.99)),
                )
            })
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        series.push((format!("{d} decode GPUs"), pts));
    }
    let xs: Vec<f64> = cfg
        .search
        .prefill_gpus
        .iter()
        .map(|&p| f64::from(p))
        .collect();
    let (lo, hi) = (
        xs.iter().copied().fold(f64::MAX, f64::min),
        xs.iter().copied().fold(f64::MIN, f64::max),
    );
    series.push((
        "TTFT P99 SLO".into(),
        vec![
            (lo, ms(cfg.slo.ttft_p99.0 as f64)),
            (hi, ms(cfg.slo.ttft_p99.0 as f64)),
        ],
    ));
    let p = out.path("ttft_p99.svg");
    plot::lines(
        &p,
        "TTFT P99 by pool size",
        "prefill GPUs",
        "TTFT P99 (ms)",
        &series,
    )
}

/// The fewest decode GPUs meeting the SLOs per prefill size, when any candidate does.
fn plot_frontier(out: &mut RunOutput, front: &[(u32, u32)]) -> Result<()> {
    if front.is_empty() {
        return Ok(());
    }
    let p = out.path("frontier.svg");
    plot::lines(
        &p,
        "Fewest decode GPUs meeting the SLOs",
        "prefill GPUs",
        "decode GPUs",
        &[(
            "frontier".into(),
            front
                .iter()
                .map(|&(p, d)| (f64::from(p), f64::from(d)))
                .collect(),
        )],
    )
}

/// The summary: traffic and SLOs, every candidate, the pick with its economics cross-check,
/// and the store size where one was searched.
fn summary_md(
    cfg: &PlanConfig,
    path: &str,
    seed: u64,
    trace: &Trace,
    cands: &[Candidate],
    stores: Option<&[(f64, f64, bool)]>,
) -> Result<String> {
    let mut summary = format!(
        "# Capacity plan\n\nConfig `{path}`, seed {seed}. {} requests at the daily peak{}. SLOs: TTFT mean ≤ {}, TTFT P99 ≤ {}, TPOT ≤ {}, rejected ≤ {:.2}%.\n\n",
        trace.len(),
        cfg.workload
            .diurnal
            .as_ref()
            .map(|d| format!(
                " (rates × {:.2} for diurnal amplitude {})",
                1.0 + d.amplitude,
                d.amplitude
            ))
            .unwrap_or_default(),
        cfg.slo.ttft_mean,
        cfg.slo.ttft_p99,
        cfg.slo.tpot_mean,
        100.0 * cfg.slo.max_rejected_share
    );
    summary.push_str(&candidates_md(cands));
    match best(cands) {
        Some(b) => summary.push_str(&best_md(b, trace)?),
        None => summary.push_str("\n**No candidate meets the SLOs**: widen `search`.\n"),
    }
    if let Some(d) = &cfg.experiment.description {
        summary.push_str(&format!("\n## Traffic and SLOs\n\n{}\n", d.trim()));
    }
    if let (Some(st), Some(s)) = (&cfg.store_search, stores) {
        let pick = s.iter().find(|r| r.2);
        summary.push_str(&format!(
            "\nStore for a {:.1}% hit rate (DeepInfer rules, trace-level replay): {}\n",
            100.0 * st.target_hit_rate,
            match pick {
                Some(r) => format!("{} TB logical ({:.2}% measured).", r.0, 100.0 * r.1),
                None => "none of the listed capacities reaches it.".into(),
            }
        ));
    }
    Ok(summary)
}

fn candidates_md(cands: &[Candidate]) -> String {
    let rows: Vec<Vec<String>> = cands
        .iter()
        .map(|c| {
            vec![
                c.prefill_gpus.to_string(),
                c.decode_gpus.to_string(),
                format!("{:.0}", ms(c.report.all.ttft_ns.mean())),
                format!("{:.0}", ms(c.report.all.ttft_ns.quantile(0.99))),
                format!("{:.2}", ms(c.report.all.tpot_ns.mean())),
                format!("{:.1}%", 100.0 * c.report.hit_rate()),
                if c.feasible {
                    "yes".into()
                } else {
                    format!("no: {}", c.why_not)
                },
            ]
        })
        .collect();
    markdown_table(
        &[
            "prefill GPUs",
            "decode GPUs",
            "TTFT mean ms",
            "TTFT P99 ms",
            "TPOT ms",
            "hit rate",
            "meets SLOs",
        ],
        &rows,
    )
}

/// The cheapest feasible candidate and the economics model's GPU counts for the same load.
fn best_md(b: &Candidate, trace: &Trace) -> Result<String> {
    let mut s = format!(
        "\n**Fewest GPUs meeting the SLOs: {} prefill + {} decode = {}.**\n",
        b.prefill_gpus,
        b.decode_gpus,
        b.gpus()
    );
    let e = econ_check(b, trace)?;
    let ratio = |model: f64, planned: u32| model / f64::from(planned).max(1e-12);
    s.push_str(&format!(
        "\nEconomics cross-check (throughput only, SPEC §11 rates × {:.0}% efficiency, the trace's offered load of {:.0} input and {:.0} output tok/s, the simulated {:.2}% hit rate): {:.1} prefill + {:.1} decode GPUs, against the planner's {} + {} ({:.2}× and {:.2}×). Where the model needs fewer GPUs than the planner, the SLOs (queueing, tail latency) set the size; where it needs more, the simulated unit runs faster per GPU than the published operating point.\n",
        100.0 * servelab_core::econ::defaults::EFFICIENCY,
        e.input_tokens_per_s,
        e.output_tokens_per_s,
        100.0 * e.sim_hit_rate,
        e.econ_prefill_gpus,
        e.econ_decode_gpus,
        b.prefill_gpus,
        b.decode_gpus,
        ratio(e.econ_prefill_gpus, b.prefill_gpus),
        ratio(e.econ_decode_gpus, b.decode_gpus),
    ));
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: &str = r#"
[experiment]
kind = "plan"
seed = 3

[slo]
ttft_mean = "5s"
ttft_p99 = "30s"
tpot_mean = "50ms"

[search]
prefill_gpus = [8, 16]
decode_gpus = [8, 16]
one_to_one = true

[store_search]
target_hit_rate = 0.5
capacities_tb = [0.001, 0.01, 1.0]

[service]
warmup = "10s"

[workload.agent]
sessions = 40
session_rate_per_s = 1.0
turns = { kind = "fixed", value = 6 }
system_prompts = 2
system_prompt_tokens = { kind = "fixed", value = 4000 }
task_tokens = { kind = "fixed", value = 500 }
reply_tokens = { kind = "fixed", value = 200 }
tool_result_tokens = { kind = "uniform", min = 200, max = 2000 }
think_time_s = { kind = "fixed", value = 2.0 }
"#;

    #[test]
    fn planner_and_an_independent_economics_check() {
        let cfg: PlanConfig = toml::from_str(SMALL).unwrap();
        check(&cfg, "small").unwrap();
        let trace = generate(&peak_workload(&cfg.workload), 3, 128).unwrap();
        let pb = indicatif::ProgressBar::hidden();
        let cands = simulate_candidates(&cfg, &trace, 3, &pb).unwrap();
        assert_eq!(cands.len(), 2, "one_to_one keeps 8+8 and 16+16");
        let b = best(&cands).expect("loose SLOs are met");
        assert_eq!(
            (b.prefill_gpus, b.decode_gpus),
            (8, 8),
            "the smaller pool suffices"
        );
        let e = econ_check(b, &trace).unwrap();
        // The model takes the offered load, not the simulated rates: its pools follow the
        // hit rate it is given, so a worse hit rate must ask for more prefill GPUs.
        let mut worse = b.clone();
        worse.report.hit_tokens /= 2;
        let w = econ_check(&worse, &trace).unwrap();
        assert!(w.econ_prefill_gpus > e.econ_prefill_gpus);
        assert_eq!(w.econ_decode_gpus, e.econ_decode_gpus);
        assert!(e.econ_prefill_gpus > 0.0 && e.econ_decode_gpus > 0.0);
        assert_eq!(frontier(&cands), vec![(8, 8), (16, 16)]);
        let st = size_store(&cfg, cfg.store_search.as_ref().unwrap(), &trace).unwrap();
        assert!(
            st[0].1 <= st[2].1,
            "more capacity never lowers the hit rate"
        );
        assert!(st[2].2, "1 TB holds this small trace");
    }

    #[test]
    fn impossible_searches_are_rejected() {
        let mut cfg: PlanConfig = toml::from_str(SMALL).unwrap();
        cfg.search.prefill_gpus = vec![0];
        assert!(
            check(&cfg, "f.toml")
                .unwrap_err()
                .to_string()
                .contains("prefill_gpus")
        );
        let mut cfg: PlanConfig = toml::from_str(SMALL).unwrap();
        cfg.search.decode_gpus = vec![24];
        let pb = indicatif::ProgressBar::hidden();
        let trace = generate(&cfg.workload, 1, 128).unwrap();
        assert!(
            simulate_candidates(&cfg, &trace, 1, &pb)
                .unwrap_err()
                .to_string()
                .contains("one_to_one")
        );
        let bad = SMALL.replace(
            "tpot_mean = \"50ms\"",
            "tpot_mean = \"50ms\"\ntpot_p90 = \"1s\"",
        );
        assert!(
            toml::from_str::<PlanConfig>(&bad)
                .unwrap_err()
                .to_string()
                .contains("tpot_p90")
        );
    }
}
