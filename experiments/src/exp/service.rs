//! One 64 + 64 unit under a mixed workload, side by side with SPEC §11.

use super::RunContext;
use super::trace_source::TraceFile;
use crate::config::ExperimentHeader;
use crate::output::{Manifest, RunOutput, markdown_table};
use crate::speed::Speed;
use anyhow::{Result, anyhow};
use polars::prelude::*;
use serde::Deserialize;
use servelab_sim::service::{Latencies, ServiceConfig, ServiceReport, run_owned as simulate};
use servelab_workloads::generate::WorkloadConfig;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    #[allow(dead_code)]
    experiment: ExperimentHeader,
    service: ServiceConfig,
    /// Generated requests, or
    #[serde(default)]
    workload: Option<WorkloadConfig>,
    /// a real trace.
    #[serde(default)]
    trace: Option<TraceFile>,
}

pub fn run(ctx: &RunContext) -> Result<()> {
    let cfg: Config = ctx.config.parse()?;
    let path = ctx.config.path.display().to_string();
    let seed = ctx.seed();
    let trace = super::trace_source::load(
        cfg.workload.as_ref(),
        cfg.trace.as_ref(),
        &ctx.config.path,
        seed,
        cfg.service.constants.block_tokens,
    )?;
    if cfg.trace.is_some() {
        let ttl = &cfg.service.store.ttl;
        let ttls: Vec<(String, servelab_core::Nanos)> = servelab_core::TrafficClass::ALL
            .iter()
            .filter(|&&c| trace.requests.iter().any(|r| r.class == c))
            .filter_map(|&c| Some((format!("service.store.ttl.{}", c.name()), ttl.get(c)?)))
            .collect();
        super::trace_source::print_warnings(super::trace_source::ttl_warnings(&trace, &ttls));
    }
    // Wall time goes to stdout only: output files stay a pure function of config and seed.
    let started = std::time::Instant::now();
    // Given up to the run, which drops each request once served (the trace is most of the
    // memory a table run holds besides the store).
    let rep = simulate(&cfg.service, trace.requests, seed).map_err(|e| anyhow!("{path}: {e}"))?;
    let wall = started.elapsed().as_secs_f64();
    println!(
        "simulated {:.0} s in {:.1} s wall: {:.0}x real time ({} requests, {:.0} requests/s, {} \
         events, {:.2} M events/s)",
        rep.simulated_s,
        wall,
        rep.simulated_s / wall,
        rep.arrivals,
        rep.arrivals as f64 / wall,
        rep.events,
        rep.events as f64 / wall / 1e6
    );
    let speed = Speed::new("service", wall, rep.simulated_s, rep.arrivals);
    let mut out = RunOutput::create(&ctx.out)?;
    write_tables(&mut out, &rep)?;
    let summary = summary(&rep, &cfg.service);
    out.write_text("summary.md", &summary)?;
    write_plots(&mut out, &rep)?;
    out.write_summary_json(&crate::sweep::headline::service(&rep))?;
    out.write_manifest(
        &Manifest::new("service", &ctx.config.path, &ctx.config.text, seed),
        &[speed],
    )?;
    println!("{summary}");
    Ok(())
}

/// The time series with the steady window the report measures shaded and the published
/// operating point (SPEC §11) as dashed references.
fn write_plots(out: &mut RunOutput, rep: &ServiceReport) -> Result<()> {
    use crate::plot::{Marks, Reference};
    let series_plot = |f: fn(&servelab_sim::service::SeriesRow) -> f64| {
        rep.series.iter().map(|s| (s.t_s, f(s))).collect::<Vec<_>>()
    };
    let st = &rep.steady;
    let window = Some((
        format!("steady window [{:.0} s, {:.0} s)", st.start_s, st.end_s),
        st.start_s,
        st.end_s,
    ));
    let level = |label: &str, series: usize, low: f64, high: f64| Reference {
        label: label.to_string(),
        series,
        low,
        high,
    };
    let p = out.path("decode_batch.svg");
    let s = PUBLISHED.decode_seqs_per_rank;
    crate::plot::lines_marked(
        &p,
        "Decode sequences per rank",
        "time (s)",
        "sequences per rank",
        &[("decode".into(), series_plot(|s| s.decode_seqs_per_rank))],
        &Marks {
            window: window.clone(),
            references: vec![level("published (SPEC §11)", 0, s, s)],
        },
    )?;
    let p = out.path("throughput.svg");
    let (lo, hi) = PUBLISHED.prefill_tokens_per_s_per_gpu;
    let d = PUBLISHED.decode_tokens_per_s_per_gpu;
    crate::plot::lines_marked(
        &p,
        "Tokens/s per GPU",
        "time (s)",
        "tokens/s per GPU",
        &[
            (
                "prefill (non-cached input)".into(),
                series_plot(|s| s.prefill_tokens_per_s_per_gpu),
            ),
            (
                "decode (output)".into(),
                series_plot(|s| s.decode_tokens_per_s_per_gpu),
            ),
        ],
        &Marks {
            window,
            references: vec![
                level("prefill, published range (SPEC §11)", 0, lo, hi),
                level("decode, published (SPEC §11)", 1, d, d),
            ],
        },
    )?;
    Ok(())
}

/// One table per part of the report: requests, time series, engines, latency, rejections and
/// the unit's scalars.
fn write_tables(out: &mut RunOutput, rep: &ServiceReport) -> Result<()> {
    write_requests_table(out, rep)?;
    write_series_table(out, rep)?;
    write_engines_table(out, rep)?;
    write_latency_table(out, rep)?;
    write_rejections_table(out, rep)?;
    write_unit_table(out, rep)
}

/// The sampled requests, one row each.
fn write_requests_table(out: &mut RunOutput, rep: &ServiceReport) -> Result<()> {
    let r = &rep.requests;
    let mut df = df!(
        "request" => r.iter().map(|x| x.request).collect::<Vec<_>>(),
        "class" => r.iter().map(|x| x.class).collect::<Vec<_>>(),
        "arrival_s" => r.iter().map(|x| x.arrival_s).collect::<Vec<_>>(),
        "prompt_tokens" => r.iter().map(|x| x.prompt_tokens).collect::<Vec<_>>(),
        "output_tokens" => r.iter().map(|x| x.output_tokens).collect::<Vec<_>>(),
        "hit_tokens" => r.iter().map(|x| x.hit_tokens).collect::<Vec<_>>(),
        "outcome" => r.iter().map(|x| x.outcome).collect::<Vec<_>>(),
        "queue_ms" => r.iter().map(|x| x.queue_ms).collect::<Vec<_>>(),
        "ttft_ms" => r.iter().map(|x| x.ttft_ms).collect::<Vec<_>>(),
        "tpot_ms" => r.iter().map(|x| x.tpot_ms).collect::<Vec<_>>(),
        "max_gap_ms" => r.iter().map(|x| x.max_gap_ms).collect::<Vec<_>>(),
        "e2e_s" => r.iter().map(|x| x.e2e_s).collect::<Vec<_>>(),
    )?;
    out.write_table("requests_sample", &mut df)
}

/// The time series, one row per interval.
fn write_series_table(out: &mut RunOutput, rep: &ServiceReport) -> Result<()> {
    let s = &rep.series;
    let mut df = df!(
        "t_s" => s.iter().map(|x| x.t_s).collect::<Vec<_>>(),
        "arrivals" => s.iter().map(|x| x.arrivals).collect::<Vec<_>>(),
        "completions" => s.iter().map(|x| x.completions).collect::<Vec<_>>(),
        "rejections" => s.iter().map(|x| x.rejections).collect::<Vec<_>>(),
        "prefill_tokens_per_s_per_gpu" => s.iter().map(|x| x.prefill_tokens_per_s_per_gpu).collect::<Vec<_>>(),
        "decode_tokens_per_s_per_gpu" => s.iter().map(|x| x.decode_tokens_per_s_per_gpu).collect::<Vec<_>>(),
        "prefill_busy" => s.iter().map(|x| x.prefill_busy).collect::<Vec<_>>(),
        "decode_seqs_per_rank" => s.iter().map(|x| x.decode_seqs_per_rank).collect::<Vec<_>>(),
        "kv_occupancy" => s.iter().map(|x| x.kv_occupancy).collect::<Vec<_>>(),
        "prefill_queued" => s.iter().map(|x| x.prefill_queued).collect::<Vec<_>>(),
    )?;
    out.write_table("series", &mut df)
}

/// One row per engine of either pool.
fn write_engines_table(out: &mut RunOutput, rep: &ServiceReport) -> Result<()> {
    let e = &rep.engines;
    let mut df = df!(
        "pool" => e.iter().map(|x| x.pool).collect::<Vec<_>>(),
        "engine" => e.iter().map(|x| x.engine).collect::<Vec<_>>(),
        "busy_fraction" => e.iter().map(|x| x.busy_fraction).collect::<Vec<_>>(),
        "tokens_per_s_per_gpu" => e.iter().map(|x| x.tokens_per_s_per_gpu).collect::<Vec<_>>(),
        "steps" => e.iter().map(|x| x.steps).collect::<Vec<_>>(),
        "mean_batch" => e.iter().map(|x| x.mean_batch).collect::<Vec<_>>(),
        "mean_kv_occupancy" => e.iter().map(|x| x.mean_kv_occupancy).collect::<Vec<_>>(),
        "tier" => e.iter().map(|x| x.tier).collect::<Vec<_>>(),
    )?;
    out.write_table("engines", &mut df)
}

/// Latency statistics, overall and per class, one row per metric.
fn write_latency_table(out: &mut RunOutput, rep: &ServiceReport) -> Result<()> {
    let mut names = Vec::new();
    let mut metric = Vec::new();
    let (mut mean, mut p50, mut p90, mut p99, mut n) = (vec![], vec![], vec![], vec![], vec![]);
    let mut rejected = Vec::new();
    let mut push = |class: &str, l: &Latencies, rej: u64| {
        for (m, h) in [
            ("ttft_ms", &l.ttft_ns),
            ("tpot_ms", &l.tpot_ns),
            ("e2e_ms", &l.e2e_ns),
            ("queue_ms", &l.queue_ns),
            ("gap_ms", &l.gap_ns),
        ] {
            names.push(class.to_string());
            metric.push(m);
            mean.push(h.mean() / 1e6);
            p50.push(h.quantile(0.5) / 1e6);
            p90.push(h.quantile(0.9) / 1e6);
            p99.push(h.quantile(0.99) / 1e6);
            n.push(h.count());
            rejected.push(rej);
        }
    };
    let all_rejected: u64 = rep.rejected_by_class.iter().map(|(_, n)| n).sum();
    push("all", &rep.all, all_rejected);
    for ((c, l), (_, rej)) in rep.by_class.iter().zip(&rep.rejected_by_class) {
        push(c, l, *rej);
    }
    // `completed` counts the requests the percentiles describe; `rejected` the measured
    // arrivals of the class that never completed (not in the percentiles).
    let mut df = df!("class" => names, "metric" => metric, "mean" => mean, "p50" => p50, "p90" => p90, "p99" => p99, "completed" => n, "rejected" => rejected)?;
    out.write_table("latency", &mut df)
}

/// Rejected requests per reason.
fn write_rejections_table(out: &mut RunOutput, rep: &ServiceReport) -> Result<()> {
    let mut df = df!(
        "reason" => rep.rejected.iter().map(|r| r.reason).collect::<Vec<_>>(),
        "requests" => rep.rejected.iter().map(|r| r.requests).collect::<Vec<_>>(),
        "measured" => rep.rejected.iter().map(|r| r.measured).collect::<Vec<_>>(),
    )?;
    out.write_table("rejections", &mut df)
}

/// The unit's scalar metrics.
fn write_unit_table(out: &mut RunOutput, rep: &ServiceReport) -> Result<()> {
    let mut df = df!(
        "metric" => ["prefill_mean_imbalance", "decode_mean_imbalance", "moe_reassignments", "moe_reassignment_s", "swa_hit_rate", "swa_store_bytes_written", "store_used_bytes", "prefill_lb_rounds", "decode_slot_occupancy", "decode_seqs_per_rank", "prefill_busy_fraction", "decode_busy_fraction"],
        "value" => [rep.prefill_mean_imbalance, rep.decode_mean_imbalance, rep.moe_reassignments as f64, rep.moe_reassignment_s, rep.swa_hit_rate, rep.swa_store_bytes_written as f64, rep.store_used_bytes as f64, rep.prefill_lb_rounds as f64, rep.decode_slot_occupancy, rep.decode_seqs_per_rank, rep.prefill_busy_fraction, rep.decode_busy_fraction],
    )?;
    out.write_table("unit", &mut df)
}

/// SPEC §11's published operating points that the summary compares with (values, not prose).
struct Published {
    ttft_mean_ms: f64,
    ttft_p99_ms: f64,
    tokens_per_s_per_request: f64,
    decode_tokens_per_s_per_gpu: f64,
    decode_seqs_per_rank: f64,
    prefill_tokens_per_s_per_gpu: (f64, f64),
    hit_rate: f64,
    input_per_request: f64,
    swa_hit_rate: f64,
    accepted_length: f64,
}

const PUBLISHED: Published = Published {
    ttft_mean_ms: 400.0,
    ttft_p99_ms: 1000.0,
    tokens_per_s_per_request: 230.0,
    decode_tokens_per_s_per_gpu: 14_500.0,
    decode_seqs_per_rank: 60.0,
    prefill_tokens_per_s_per_gpu: (60_000.0, 89_500.0),
    hit_rate: 0.96,
    input_per_request: 77_000.0,
    swa_hit_rate: 0.98,
    accepted_length: 3.20,
};

/// "+12%" / "−3%" of `sim` against `published`, and whether it is within `tol` (relative).
fn versus(sim: f64, published: f64, tol: f64) -> String {
    let d = sim / published - 1.0;
    let verdict = if d.abs() <= tol {
        "within"
    } else if d > 0.0 {
        "above"
    } else {
        "below"
    };
    format!("{:+.0}% ({verdict} ±{:.0}%)", 100.0 * d, 100.0 * tol)
}

/// Against a published range: inside it, or how far outside.
fn versus_range(sim: f64, lo: f64, hi: f64) -> String {
    if sim < lo {
        format!("{:+.0}% below the range", 100.0 * (sim / lo - 1.0))
    } else if sim > hi {
        format!("{:+.0}% above the range", 100.0 * (sim / hi - 1.0))
    } else {
        "inside the range".into()
    }
}

/// The summary's table: the run against SPEC §11's published operating points, one row each.
fn summary_rows(rep: &ServiceReport) -> Vec<Vec<String>> {
    let mut rows = latency_rows(rep);
    rows.extend(throughput_rows(rep));
    rows.extend(cache_rows(rep));
    rows
}

/// TTFT mean and P99, and the generation speed per request.
fn latency_rows(rep: &ServiceReport) -> Vec<Vec<String>> {
    let p = &PUBLISHED;
    let ttft_mean = rep.all.ttft_ns.mean() / 1e6;
    let ttft_p99 = rep.all.ttft_ns.quantile(0.99) / 1e6;
    let tpot = rep.all.tpot_ns.mean();
    let speed = 1e9 / tpot.max(1.0);
    vec![
        vec![
            "TTFT mean".into(),
            format!("{ttft_mean:.0} ms"),
            format!("{:.0} ms", p.ttft_mean_ms),
            versus(ttft_mean, p.ttft_mean_ms, 0.10),
        ],
        vec![
            "TTFT P99".into(),
            format!("{ttft_p99:.0} ms"),
            format!("{:.0} ms", p.ttft_p99_ms),
            versus(ttft_p99, p.ttft_p99_ms, 0.10),
        ],
        vec![
            "generation per request".into(),
            format!("{speed:.0} tok/s (TPOT {:.2} ms)", tpot / 1e6),
            format!("{:.0} tok/s", p.tokens_per_s_per_request),
            versus(speed, p.tokens_per_s_per_request, 0.10),
        ],
    ]
}

/// Decode and prefill throughput per GPU in the steady state.
fn throughput_rows(rep: &ServiceReport) -> Vec<Vec<String>> {
    let p = &PUBLISHED;
    let st = &rep.steady;
    let (plo, phi) = p.prefill_tokens_per_s_per_gpu;
    vec![
        vec![
            "decode tok/s per GPU, steady state (busy)".into(),
            format!(
                "{:.0} at {:.1} seq/rank",
                st.decode_tokens_per_s_per_gpu, st.decode_seqs_per_rank
            ),
            format!(
                "~{:.0} at {:.0} seq/rank",
                p.decode_tokens_per_s_per_gpu, p.decode_seqs_per_rank
            ),
            format!(
                "{}; batch {}",
                versus(
                    st.decode_tokens_per_s_per_gpu,
                    p.decode_tokens_per_s_per_gpu,
                    0.10
                ),
                versus(st.decode_seqs_per_rank, p.decode_seqs_per_rank, 0.10)
            ),
        ],
        vec![
            "prefill non-cached tok/s per GPU, steady state (busy)".into(),
            format!("{:.0}", st.prefill_tokens_per_s_per_gpu),
            format!("{plo:.0}–{phi:.0}"),
            versus_range(st.prefill_tokens_per_s_per_gpu, plo, phi),
        ],
    ]
}

/// The input and SWA hit rates, the input per request and the accepted length.
fn cache_rows(rep: &ServiceReport) -> Vec<Vec<String>> {
    let p = &PUBLISHED;
    let st = &rep.steady;
    let per_req_input = rep.input_tokens as f64 / rep.measured_requests.max(1) as f64;
    vec![
        vec![
            "input hit rate".into(),
            format!("{:.1}%", 100.0 * rep.hit_rate()),
            format!("~{:.0}%", 100.0 * p.hit_rate),
            format!("{:+.1} pp", 100.0 * (rep.hit_rate() - p.hit_rate)),
        ],
        vec![
            "average input per request".into(),
            format!("{per_req_input:.0}"),
            format!("{:.0}", p.input_per_request),
            versus(per_req_input, p.input_per_request, 0.10),
        ],
        vec![
            "SWA state hit rate".into(),
            format!("{:.1}%", 100.0 * rep.swa_hit_rate),
            format!("> {:.0}%", 100.0 * p.swa_hit_rate),
            format!("{:+.1} pp", 100.0 * (rep.swa_hit_rate - p.swa_hit_rate)),
        ],
        vec![
            "accepted length, steady state".into(),
            format!("{:.2}", st.accepted_length),
            format!("{:.2}", p.accepted_length),
            versus(st.accepted_length, p.accepted_length, 0.10),
        ],
    ]
}

/// Sentences computed from the run's own numbers: where the time goes and how loaded it was.
fn summary_notes(rep: &ServiceReport) -> String {
    let st = &rep.steady;
    let mut notes = Vec::new();
    let ttft = rep.all.ttft_ns.mean();
    let queue = rep.all.queue_ns.mean();
    if ttft > 0.0 {
        notes.push(format!(
            "Of the mean TTFT, {:.0}% is spent before the first prefill step (balancer queue and prefix fetch); the rest is prefill compute of the non-cached part ({:.0} of {:.0} input tokens per request).",
            100.0 * queue / ttft,
            rep.encoder_tokens as f64 / rep.measured_requests.max(1) as f64,
            rep.input_tokens as f64 / rep.measured_requests.max(1) as f64
        ));
    }
    let worst = rep
        .by_class
        .iter()
        .filter(|(_, l)| l.ttft_ns.count() > 0)
        .map(|(c, l)| (*c, l.ttft_ns.quantile(0.99), l.ttft_ns.count()))
        .max_by(|a, b| a.1.total_cmp(&b.1));
    if let Some((c, p99, n)) = worst {
        notes.push(format!(
            "The TTFT tail is `{c}` ({n} requests, P99 {:.0} ms).",
            p99 / 1e6
        ));
    }
    notes.push(format!(
        "In the steady window the prefill pool was busy {:.0}% of the time and the decode groups {:.0}%, holding {:.1} sequences per rank ({:.0}% of the {} slots).",
        100.0 * st.prefill_busy_fraction,
        100.0 * st.decode_busy_fraction,
        st.decode_seqs_per_rank,
        100.0 * st.decode_slot_occupancy,
        (st.decode_seqs_per_rank / st.decode_slot_occupancy.max(1e-12)).round()
    ));
    let rate = rep.measured_rejection_rate();
    notes.push(if rate > 0.0 {
        format!(
            "{:.2}% of the measured arrivals were rejected; the latency figures cover only the completed ones.",
            100.0 * rate
        )
    } else {
        "No measured arrival was rejected.".into()
    });
    if !rep.prefill_tier_engines.is_empty() {
        notes.push(format!(
            "The tiered prefill balancer ran {} rounds and ended with {:?} engines per context tier.",
            rep.prefill_lb_rounds, rep.prefill_tier_engines
        ));
    }
    notes.push(format!(
        "Expert imbalance (slowest rank ÷ mean) averaged {:.3} on prefill steps and {:.3} on decode steps, with {} EPLB reassignments costing {:.2} s of engine time.",
        rep.prefill_mean_imbalance, rep.decode_mean_imbalance, rep.moe_reassignments, rep.moe_reassignment_s
    ));
    notes.join(" ")
}

fn summary(rep: &ServiceReport, cfg: &ServiceConfig) -> String {
    let st = &rep.steady;
    let rejected: Vec<String> = rep
        .rejected
        .iter()
        .filter(|r| r.requests > 0)
        .map(|r| format!("{} {}", r.requests, r.reason))
        .collect();
    format!(
        "# Service: {} prefill + {} decode GPUs\n\n{} requests ({} arrived in the measured window [{:.0} s, {:.0} s), {} of them completed), {} completed in all, {} rejected{}; {:.0} s simulated, {} events. Prefix lookups: {} via the session memo, {} full. Steady state: steps started in [{:.0} s, {:.0} s).\n\n{}\n\nThe published column is SPEC §11's; the difference is computed, with ±10% as the band for a match. {}\n",
        cfg.prefill.gpus,
        cfg.decode.groups * cfg.decode.ranks,
        rep.arrivals,
        rep.measured_arrivals,
        st.start_s,
        st.end_s,
        rep.measured_requests,
        rep.completed,
        rep.rejected_total(),
        if rejected.is_empty() {
            String::new()
        } else {
            format!(" ({})", rejected.join(", "))
        },
        rep.simulated_s,
        rep.events,
        rep.memo_prefix_lookups,
        rep.full_prefix_lookups,
        st.start_s,
        st.end_s,
        markdown_table(
            &["metric", "simulated", "SPEC §11", "difference"],
            &summary_rows(rep)
        ),
        summary_notes(rep)
    )
}
