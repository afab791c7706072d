//! The `autoscale-day` experiment (issue 19): 24 simulated hours of a diurnal mix served by
//! fixed pools sized for the peak and by each autoscaler policy, on the same trace and seed.
//! Per policy and hour: GPU-hours paid, SLO attainment (TTFT and TPOT of the sampled requests
//! against the SLOs) and revenue at valley or peak prices (SPEC §12: peak prices are twice the
//! valley ones); per policy: revenue per GPU-hour. The unit and the load are scaled down so a
//! day runs in minutes on two cores (the config says by how much); revenue per hour comes from
//! the 1-in-`sample_every` request sample, and the summary gives that sample's error against
//! the exact token totals of the whole day.

use super::RunContext;
use crate::config::ExperimentHeader;
use crate::output::{Manifest, RunOutput, markdown_table};
use crate::speed::Speed;
use anyhow::{Result, anyhow, bail};
use polars::prelude::*;
use serde::Deserialize;
use servelab_core::Nanos;
use servelab_core::unit::AutoscaleConfig;
use servelab_sim::service::{ServiceConfig, ServiceReport, run as simulate};
use servelab_workloads::generate::WorkloadConfig;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    #[allow(dead_code)]
    experiment: ExperimentHeader,
    service: ServiceConfig,
    workload: WorkloadConfig,
    day: Day,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Day {
    ttft_slo: Nanos,
    tpot_slo: Nanos,
    /// Valley prices, USD per million tokens (SPEC §12).
    hit_price: f64,
    miss_price: f64,
    output_price: f64,
    /// Hours [start, end) of the day at peak prices (× `peak_factor`).
    peak_hours: [u32; 2],
    peak_factor: f64,
    policies: Vec<Policy>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Policy {
    name: String,
    /// Absent: the fixed pools of `[service]`, sized for the peak.
    #[serde(default)]
    autoscale: Option<AutoscaleConfig>,
}

struct Hour {
    gpu_hours: f64,
    /// Hours of the run inside this hour (1 but for the last, which the drain ends early).
    span_h: f64,
    requests: u64,
    met_slo: u64,
    revenue: f64,
}

struct Outcome {
    name: String,
    rep: ServiceReport,
    hours: Vec<Hour>,
}

impl Day {
    fn price(&self, hour: usize) -> f64 {
        let h = (hour % 24) as u32;
        if h >= self.peak_hours[0] && h < self.peak_hours[1] {
            self.peak_factor
        } else {
            1.0
        }
    }
    /// Revenue (USD, valley prices) of `hit`, `miss` input and `out` output tokens.
    fn revenue(&self, hit: f64, miss: f64, out: f64) -> f64 {
        (hit * self.hit_price + miss * self.miss_price + out * self.output_price) / 1e6
    }
}

pub fn run(ctx: &RunContext) -> Result<()> {
    let cfg: Config = ctx.config.parse()?;
    let path = ctx.config.path.display().to_string();
    let seed = ctx.seed();
    if cfg.day.policies.is_empty() {
        bail!("{path}: day.policies: at least one policy");
    }
    let trace = servelab_workloads::generate::generate(
        &cfg.workload,
        seed,
        cfg.service.constants.block_tokens,
    )
    .map_err(|e| anyhow!("{path}: {e}"))?;
    let mut outcomes = Vec::new();
    let mut speeds = Vec::new();
    for p in &cfg.day.policies {
        let mut s = cfg.service.clone();
        s.autoscale = p.autoscale.clone();
        let started = std::time::Instant::now();
        let rep = simulate(&s, &trace.requests, seed)
            .map_err(|e| anyhow!("{path}: policy {}: {e}", p.name))?;
        speeds.push(Speed::of_service(&p.name, started, &rep));
        let hours = hours(&rep, &s, &cfg.day);
        outcomes.push(Outcome {
            name: p.name.clone(),
            rep,
            hours,
        });
    }
    let mut out = RunOutput::create(&ctx.out)?;
    out.write_table("hours", &mut hours_table(&outcomes)?)?;
    out.write_table("policies", &mut policy_table(&outcomes, &cfg.day)?)?;
    plots(&mut out, &outcomes)?;
    let text = summary(&outcomes, &cfg.day, cfg.service.sample_every);
    out.write_text("summary.md", &text)?;
    let mut headline = std::collections::BTreeMap::new();
    for o in &outcomes {
        headline.insert(format!("{}.gpu_hours", o.name), gpu_hours(o));
        headline.insert(format!("{}.slo_attainment", o.name), attainment(o));
    }
    out.write_summary_json(&headline)?;
    out.write_manifest(
        &Manifest::new("autoscale-day", &ctx.config.path, &ctx.config.text, seed),
        &speeds,
    )?;
    println!("{text}");
    crate::speed::print(&speeds);
    Ok(())
}

/// Per hour of the run: GPU-hours (from the autoscaler's rows, or every GPU of the fixed
/// pools), sampled requests, those within both SLOs, and revenue (the sample × its rate).
fn hours(rep: &ServiceReport, s: &ServiceConfig, day: &Day) -> Vec<Hour> {
    let n = (rep.simulated_s / 3600.0).ceil().max(1.0) as usize;
    let fixed_gpus = f64::from(s.gpus());
    let mut h: Vec<Hour> = (0..n)
        .map(|i| {
            let span = (rep.simulated_s - 3600.0 * i as f64).clamp(0.0, 3600.0);
            Hour {
                span_h: span / 3600.0,
                gpu_hours: if rep.autoscale.is_some() {
                    0.0
                } else {
                    fixed_gpus * span / 3600.0
                },
                requests: 0,
                met_slo: 0,
                revenue: 0.0,
            }
        })
        .collect();
    if let Some(a) = &rep.autoscale {
        let mut last = 0.0;
        for r in &a.rows {
            let i = ((last / 3600.0) as usize).min(n - 1);
            h[i].gpu_hours += f64::from(r.prefill_gpus + r.decode_gpus) * (r.t_s - last) / 3600.0;
            last = r.t_s;
        }
    }
    let every = f64::from(s.sample_every);
    for r in &rep.requests {
        let i = ((r.arrival_s / 3600.0) as usize).min(n - 1);
        h[i].requests += 1;
        if r.outcome != "completed" {
            continue;
        }
        // A one-token reply has no TPOT (NaN): only its TTFT counts.
        let tpot_ok = r.tpot_ms.is_nan() || r.tpot_ms <= day.tpot_slo.as_secs_f64() * 1e3;
        let ok = r.ttft_ms <= day.ttft_slo.as_secs_f64() * 1e3 && tpot_ok;
        h[i].met_slo += u64::from(ok);
        let hit = f64::from(r.hit_tokens);
        let miss = f64::from(r.prompt_tokens - r.hit_tokens);
        h[i].revenue += every * day.price(i) * day.revenue(hit, miss, f64::from(r.output_tokens));
    }
    h
}

/// GPUs paid for and SLO attainment, per hour and policy.
fn plots(out: &mut RunOutput, outcomes: &[Outcome]) -> Result<()> {
    let per_hour = |f: &dyn Fn(&Hour) -> f64| -> Vec<(String, Vec<(f64, f64)>)> {
        outcomes
            .iter()
            .map(|o| {
                let pts = o
                    .hours
                    .iter()
                    .enumerate()
                    .map(|(i, h)| (i as f64, f(h)))
                    .collect();
                (o.name.clone(), pts)
            })
            .collect()
    };
    let p = out.path("gpus.svg");
    // GPUs on average over the part of the hour the run lasted, so the last, partial hour of
    // the drain does not read as a scale-down.
    crate::plot::lines(
        &p,
        "GPUs paid for (mean over each hour)",
        "hour",
        "GPUs",
        &per_hour(&|h| h.gpu_hours / h.span_h.max(1e-9)),
    )?;
    let p = out.path("slo.svg");
    let att = |h: &Hour| h.met_slo as f64 / h.requests.max(1) as f64;
    crate::plot::lines(
        &p,
        "SLO attainment",
        "hour",
        "fraction of sampled requests",
        &per_hour(&att),
    )
}

fn gpu_hours(o: &Outcome) -> f64 {
    o.hours.iter().map(|h| h.gpu_hours).sum()
}
fn attainment(o: &Outcome) -> f64 {
    let n: u64 = o.hours.iter().map(|h| h.requests).sum();
    o.hours.iter().map(|h| h.met_slo).sum::<u64>() as f64 / n.max(1) as f64
}
fn revenue(o: &Outcome) -> f64 {
    o.hours.iter().map(|h| h.revenue).sum()
}

fn hours_table(outcomes: &[Outcome]) -> Result<DataFrame> {
    let rows: Vec<(&Outcome, usize, &Hour)> = outcomes
        .iter()
        .flat_map(|o| o.hours.iter().enumerate().map(move |(i, h)| (o, i, h)))
        .collect();
    Ok(df!(
        "policy" => rows.iter().map(|r| r.0.name.clone()).collect::<Vec<_>>(),
        "hour" => rows.iter().map(|r| r.1 as u32).collect::<Vec<_>>(),
        "gpu_hours" => rows.iter().map(|r| r.2.gpu_hours).collect::<Vec<_>>(),
        "sampled_requests" => rows.iter().map(|r| r.2.requests).collect::<Vec<_>>(),
        "slo_attainment" => rows.iter().map(|r| r.2.met_slo as f64 / r.2.requests.max(1) as f64).collect::<Vec<_>>(),
        "revenue_usd" => rows.iter().map(|r| r.2.revenue).collect::<Vec<_>>(),
    )?)
}

fn policy_table(outcomes: &[Outcome], _day: &Day) -> Result<DataFrame> {
    Ok(df!(
        "policy" => outcomes.iter().map(|o| o.name.clone()).collect::<Vec<_>>(),
        "gpu_hours" => outcomes.iter().map(gpu_hours).collect::<Vec<_>>(),
        "revenue_usd" => outcomes.iter().map(revenue).collect::<Vec<_>>(),
        "revenue_per_gpu_hour" => outcomes.iter().map(|o| revenue(o) / gpu_hours(o).max(1e-9)).collect::<Vec<_>>(),
        "slo_attainment" => outcomes.iter().map(attainment).collect::<Vec<_>>(),
        "arrivals" => outcomes.iter().map(|o| o.rep.arrivals).collect::<Vec<_>>(),
        "rejected" => outcomes.iter().map(|o| o.rep.rejected_total()).collect::<Vec<_>>(),
        "lost" => outcomes.iter().map(|o| o.rep.arrivals as i64 - o.rep.completed as i64 - o.rep.rejected_total() as i64).collect::<Vec<_>>(),
        "ups" => outcomes.iter().map(|o| o.rep.autoscale.as_ref().map_or(0, |a| a.prefill_ups + a.decode_ups)).collect::<Vec<_>>(),
        "downs" => outcomes.iter().map(|o| o.rep.autoscale.as_ref().map_or(0, |a| a.prefill_downs + a.decode_downs)).collect::<Vec<_>>(),
    )?)
}

/// The whole day's revenue from the report's exact token totals (valley prices only: the
/// totals are not split by hour), to measure the request sample against.
fn exact_valley_revenue(rep: &ServiceReport, day: &Day) -> f64 {
    let hit = rep.hit_tokens as f64;
    let miss = (rep.input_tokens - rep.hit_tokens) as f64;
    day.revenue(hit, miss, rep.output_tokens as f64)
}

fn sampled_valley_revenue(rep: &ServiceReport, day: &Day, every: u32) -> f64 {
    rep.requests
        .iter()
        .filter(|r| r.outcome == "completed")
        .map(|r| {
            let hit = f64::from(r.hit_tokens);
            let miss = f64::from(r.prompt_tokens - r.hit_tokens);
            f64::from(every) * day.revenue(hit, miss, f64::from(r.output_tokens))
        })
        .sum()
}

fn summary(outcomes: &[Outcome], day: &Day, every: u32) -> String {
    let mut s = String::from("# Autoscaler over a day\n\n");
    let header = [
        "policy",
        "GPU-hours",
        "revenue (USD)",
        "USD per GPU-hour",
        "SLO attainment",
        "lost",
    ];
    let rows: Vec<Vec<String>> = outcomes
        .iter()
        .map(|o| {
            vec![
                o.name.clone(),
                format!("{:.1}", gpu_hours(o)),
                format!("{:.2}", revenue(o)),
                format!("{:.2}", revenue(o) / gpu_hours(o).max(1e-9)),
                format!("{:.4}", attainment(o)),
                (o.rep.arrivals as i64 - o.rep.completed as i64 - o.rep.rejected_total() as i64)
                    .to_string(),
            ]
        })
        .collect();
    s += &markdown_table(&header, &rows);
    s += &format!(
        "\nSLO: TTFT ≤ {:.2} s and TPOT ≤ {:.1} ms; peak prices ({}× the valley's) from hour {} to {}.\n\n",
        day.ttft_slo.as_secs_f64(),
        day.tpot_slo.as_secs_f64() * 1e3,
        day.peak_factor,
        day.peak_hours[0],
        day.peak_hours[1]
    );
    let base = &outcomes[0];
    for o in &outcomes[1..] {
        s += &format!(
            "- **{}** paid for {:.1} GPU-hours, {:+.1}% against {} ({:.1}), at SLO attainment {:.4} against {:.4}; revenue per GPU-hour {:+.1}%.\n",
            o.name,
            gpu_hours(o),
            100.0 * (gpu_hours(o) / gpu_hours(base).max(1e-9) - 1.0),
            base.name,
            gpu_hours(base),
            attainment(o),
            attainment(base),
            100.0
                * ((revenue(o) / gpu_hours(o).max(1e-9))
                    / (revenue(base) / gpu_hours(base).max(1e-9))
                    - 1.0),
        );
    }
    let exact = exact_valley_revenue(&base.rep, day);
    let sampled = sampled_valley_revenue(&base.rep, day, every);
    s += &format!(
        "\nRevenue comes from the 1-in-{every} request sample: for {} its day at valley prices is {:.2} USD from the sample and {:.2} USD from the exact token totals ({:+.2}%).\n",
        base.name,
        sampled,
        exact,
        100.0 * (sampled / exact.max(1e-12) - 1.0)
    );
    s
}
