//! The `faults` experiment (issue 19): one unit under one workload, run once per case of a
//! failure campaign (storage nodes lost per group, GPU failures at a given MTBF, a decode
//! drain, an SWA host loss). Per case: lost requests (must be 0), lost bytes, hit rate, TTFT
//! and TPOT before, during and after the case's event, the storage rebuild time and what the
//! compute faults moved. Every sentence of the summary is computed from these numbers.

use super::RunContext;
use crate::config::ExperimentHeader;
use crate::output::{Manifest, RunOutput, markdown_table};
use crate::speed::Speed;
use anyhow::{Result, anyhow};
use polars::prelude::*;
use serde::Deserialize;
use servelab_core::Nanos;
use servelab_core::store::ScheduledFailure;
use servelab_sim::env::faults::FaultsConfig;
use servelab_sim::service::{RequestRow, ServiceConfig, ServiceReport, run as simulate};
use servelab_workloads::generate::WorkloadConfig;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    #[allow(dead_code)]
    experiment: ExperimentHeader,
    service: ServiceConfig,
    workload: WorkloadConfig,
    campaign: Campaign,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Campaign {
    /// Requests arriving in [at, at + window) count as "during" a case's event, later ones as
    /// "after", earlier ones as "before".
    window: Nanos,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Case {
    name: String,
    /// The time the windows are counted from.
    at: Nanos,
    #[serde(default)]
    store_failures: Vec<ScheduledFailure>,
    #[serde(default)]
    faults: Option<FaultsConfig>,
}

/// Means over the sampled requests of one window.
#[derive(Clone, Copy, Default)]
struct Window {
    requests: usize,
    hit_rate: f64,
    ttft_ms: f64,
    tpot_ms: f64,
    /// The longest pause between two tokens of any request of the window (a displaced
    /// request's stall: its forward, or its prefill again).
    worst_gap_ms: f64,
}

fn window(rows: &[RequestRow], from: f64, to: f64) -> Window {
    let done: Vec<&RequestRow> = rows
        .iter()
        .filter(|r| r.arrival_s >= from && r.arrival_s < to && r.outcome == "completed")
        .collect();
    let n = done.len().max(1) as f64;
    let prompt: f64 = done.iter().map(|r| f64::from(r.prompt_tokens)).sum();
    let hit: f64 = done.iter().map(|r| f64::from(r.hit_tokens)).sum();
    let tpot: Vec<f64> = done
        .iter()
        .map(|r| r.tpot_ms)
        .filter(|t| t.is_finite())
        .collect();
    Window {
        requests: done.len(),
        hit_rate: hit / prompt.max(1.0),
        ttft_ms: done.iter().map(|r| r.ttft_ms).sum::<f64>() / n,
        tpot_ms: tpot.iter().sum::<f64>() / tpot.len().max(1) as f64,
        worst_gap_ms: done
            .iter()
            .map(|r| r.max_gap_ms)
            .filter(|g| g.is_finite())
            .fold(0.0, f64::max),
    }
}

struct Row {
    name: String,
    rep: ServiceReport,
    before: Window,
    during: Window,
    after: Window,
    /// The whole run: the requests a fault displaced were running when it struck, so they
    /// arrived before the "during" window.
    all: Window,
    rebuild_s: f64,
}

impl Row {
    fn lost(&self) -> i64 {
        self.rep.arrivals as i64 - self.rep.completed as i64 - self.rep.rejected_total() as i64
    }
}

pub fn run(ctx: &RunContext) -> Result<()> {
    let cfg: Config = ctx.config.parse()?;
    let path = ctx.config.path.display().to_string();
    let seed = ctx.seed();
    let bs = cfg.service.constants.block_tokens;
    let trace = servelab_workloads::generate::generate(&cfg.workload, seed, bs)
        .map_err(|e| anyhow!("{path}: {e}"))?;
    let mut rows = Vec::new();
    let mut speeds = Vec::new();
    for case in &cfg.campaign.cases {
        let mut s = cfg.service.clone();
        s.store.failures.extend(case.store_failures.iter().cloned());
        if let Some(f) = &case.faults {
            s.faults = f.clone();
        }
        let started = std::time::Instant::now();
        let rep = simulate(&s, &trace.requests, seed)
            .map_err(|e| anyhow!("{path}: case {}: {e}", case.name))?;
        speeds.push(Speed::of_service(&case.name, started, &rep));
        let at = case.at.as_secs_f64();
        let w = cfg.campaign.window.as_secs_f64();
        let rebuild_s = rep
            .storage
            .rebuilds
            .iter()
            .filter(|r| r.outcome == "done")
            .map(|r| r.duration_s)
            .fold(0.0, f64::max);
        rows.push(Row {
            name: case.name.clone(),
            before: window(&rep.requests, 0.0, at),
            during: window(&rep.requests, at, at + w),
            after: window(&rep.requests, at + w, f64::INFINITY),
            all: window(&rep.requests, 0.0, f64::INFINITY),
            rebuild_s,
            rep,
        });
    }
    let mut out = RunOutput::create(&ctx.out)?;
    let mut df = table(&rows)?;
    out.write_table("cases", &mut df)?;
    write_plots(&mut out, &rows)?;
    let text = summary(&rows, &cfg.campaign);
    out.write_text("summary.md", &text)?;
    let mut headline = std::collections::BTreeMap::new();
    headline.insert(
        "lost_requests".to_string(),
        rows.iter().map(|r| r.lost() as f64).sum(),
    );
    out.write_summary_json(&headline)?;
    out.write_manifest(
        &Manifest::new("faults", &ctx.config.path, &ctx.config.text, seed),
        &speeds,
    )?;
    println!("{text}");
    crate::speed::print(&speeds);
    Ok(())
}

/// Per case, TTFT and hit rate of the requests that arrived before, during and after the
/// case's event: what a failure costs while it lasts and whether the unit recovers.
fn write_plots(out: &mut RunOutput, rows: &[Row]) -> Result<()> {
    let cases: Vec<String> = rows.iter().map(|r| r.name.clone()).collect();
    let by_window = |f: fn(&Window) -> f64| {
        vec![
            (
                "before".to_string(),
                rows.iter().map(|r| f(&r.before)).collect(),
            ),
            (
                "during".to_string(),
                rows.iter().map(|r| f(&r.during)).collect(),
            ),
            (
                "after".to_string(),
                rows.iter().map(|r| f(&r.after)).collect(),
            ),
        ]
    };
    crate::plot::grouped_bars(
        &out.path("ttft.svg"),
        "TTFT mean by case: requests arriving before, during and after the event",
        "TTFT mean (ms)",
        &cases,
        &by_window(|w| w.ttft_ms),
    )?;
    crate::plot::grouped_bars(
        &out.path("hit_rate.svg"),
        "Input hit rate by case: before, during and after the event",
        "hit rate",
        &cases,
        &by_window(|w| w.hit_rate),
    )?;
    Ok(())
}

fn table(rows: &[Row]) -> Result<DataFrame> {
    let col = |f: &dyn Fn(&Row) -> f64| rows.iter().map(f).collect::<Vec<f64>>();
    let cnt = |f: &dyn Fn(&Row) -> u64| rows.iter().map(f).collect::<Vec<u64>>();
    let df = df!(
        "case" => rows.iter().map(|r| r.name.clone()).collect::<Vec<_>>(),
        "arrivals" => cnt(&|r| r.rep.arrivals),
        "completed" => cnt(&|r| r.rep.completed),
        "rejected" => cnt(&|r| r.rep.rejected_total()),
        "lost_requests" => rows.iter().map(Row::lost).collect::<Vec<_>>(),
        "lost_bytes" => cnt(&|r| r.rep.storage.lost_bytes),
        "group_losses" => cnt(&|r| r.rep.storage.group_losses),
        "degraded_stripe_reads" => cnt(&|r| r.rep.storage.degraded_stripe_reads),
        "rebuild_s" => col(&|r| r.rebuild_s),
        "hit_rate" => col(&|r| r.rep.hit_rate()),
        "hit_rate_before" => col(&|r| r.before.hit_rate),
        "hit_rate_during" => col(&|r| r.during.hit_rate),
        "hit_rate_after" => col(&|r| r.after.hit_rate),
        "ttft_ms_before" => col(&|r| r.before.ttft_ms),
        "ttft_ms_during" => col(&|r| r.during.ttft_ms),
        "ttft_ms_after" => col(&|r| r.after.ttft_ms),
        "tpot_ms_before" => col(&|r| r.before.tpot_ms),
        "tpot_ms_during" => col(&|r| r.during.tpot_ms),
        "tpot_ms_after" => col(&|r| r.after.tpot_ms),
        "worst_gap_ms" => col(&|r| r.all.worst_gap_ms),
        "sampled_during" => rows.iter().map(|r| r.during.requests as u64).collect::<Vec<_>>(),
        "gpu_failures" => cnt(&|r| r.rep.faults.decode_rank_failures + r.rep.faults.prefill_engine_failures),
        "forwarded_requests" => cnt(&|r| r.rep.faults.forwarded_requests),
        "forwarded_bytes" => cnt(&|r| r.rep.faults.forwarded_bytes),
        "reprefilled_requests" => cnt(&|r| r.rep.faults.reprefilled_requests),
        "reprefill_tokens" => cnt(&|r| r.rep.faults.reprefill_tokens),
        "lost_decode_steps" => cnt(&|r| r.rep.faults.lost_decode_steps),
        "requeued_prefill_jobs" => cnt(&|r| r.rep.faults.requeued_prefill_jobs),
        "swa_states_lost" => cnt(&|r| r.rep.faults.swa_states_lost),
        "swa_hit_rate" => col(&|r| r.rep.swa_hit_rate),
    )?;
    Ok(df)
}

/// The change of `x` against the baseline's, in percent.
fn pct(x: f64, base: f64) -> f64 {
    if base == 0.0 {
        0.0
    } else {
        100.0 * (x / base - 1.0)
    }
}

fn summary(rows: &[Row], c: &Campaign) -> String {
    let mut s = String::from("# Fault campaign\n\n");
    let lost: i64 = rows.iter().map(Row::lost).sum();
    let cases = rows.len();
    s += &format!(
        "{cases} cases were run on the same trace and seed; {} requests were lost in total{}.\n\n",
        lost,
        if lost == 0 {
            " (each ended completed or rejected with a reason)"
        } else {
            ": a bug"
        }
    );
    let header = [
        "case",
        "lost req",
        "lost bytes",
        "hit rate",
        "TTFT during (ms)",
        "TTFT after (ms)",
        "TPOT during (ms)",
        "worst gap (ms)",
        "rebuild (s)",
    ];
    let body: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.name.clone(),
                r.lost().to_string(),
                r.rep.storage.lost_bytes.to_string(),
                format!("{:.4}", r.rep.hit_rate()),
                format!("{:.1}", r.during.ttft_ms),
                format!("{:.1}", r.after.ttft_ms),
                format!("{:.3}", r.during.tpot_ms),
                format!("{:.0}", r.all.worst_gap_ms),
                format!("{:.3}", r.rebuild_s),
            ]
        })
        .collect();
    s += &markdown_table(&header, &body);
    s += &format!(
        "\n\"During\" is the {:.0} s after each case's event, \"after\" the rest of the run.\n\n",
        c.window.as_secs_f64()
    );
    let Some(base) = rows.first() else { return s };
    for r in &rows[1..] {
        s += &sentence(r, base);
    }
    s += &survivors(rows);
    s
}

/// Migration against prefilling again, when the campaign has a case of each for the same
/// failure (names ending in "-migrate" and "-reprefill").
fn survivors(rows: &[Row]) -> String {
    let find = |suffix: &str| rows.iter().find(|r| r.name.ends_with(suffix));
    let (Some(m), Some(p)) = (find("-migrate"), find("-reprefill")) else {
        return String::new();
    };
    let (fm, fp) = (&m.rep.faults, &p.rep.faults);
    format!(
        "
Survivors of a failed rank: migrating them ({}) moved {} requests' KV ({} bytes) and prefilled {} again; prefilling them all ({}) recomputed {} tokens for {} requests instead of {}. The longest pause between two tokens was {:.0} ms migrating and {:.0} ms prefilling again; mean TPOT over the run {:.3} ms against {:.3} ms.\n",
        m.name,
        fm.forwarded_requests,
        fm.forwarded_bytes,
        fm.reprefilled_requests,
        p.name,
        fp.reprefill_tokens,
        fp.reprefilled_requests,
        fm.reprefill_tokens,
        m.all.worst_gap_ms,
        p.all.worst_gap_ms,
        m.all.tpot_ms,
        p.all.tpot_ms,
    )
}

/// One sentence per case against the first case (the baseline).
fn sentence(r: &Row, base: &Row) -> String {
    let f = &r.rep.faults;
    let mut parts = vec![format!(
        "**{}**: hit rate {:.4} ({:+.2}% against {}), TTFT during {:.1} ms ({:+.0}%)",
        r.name,
        r.rep.hit_rate(),
        pct(r.rep.hit_rate(), base.rep.hit_rate()),
        base.name,
        r.during.ttft_ms,
        pct(r.during.ttft_ms, base.during.ttft_ms),
    )];
    if r.rep.storage.lost_bytes > 0 {
        parts.push(format!(
            "{} groups lost {} bytes",
            r.rep.storage.group_losses, r.rep.storage.lost_bytes
        ));
    }
    if r.rebuild_s > 0.0 {
        parts.push(format!("the longest rebuild took {:.3} s", r.rebuild_s));
    }
    let gpus = f.decode_rank_failures + f.prefill_engine_failures;
    if gpus > 0 || f.drains > 0 {
        parts.push(format!(
            "{gpus} GPUs failed and {} decode groups were drained; the longest pause between two tokens of any request was {:.0} ms against {:.0} ms",
            f.drains, r.all.worst_gap_ms, base.all.worst_gap_ms
        ));
    }
    if f.forwarded_requests + f.reprefilled_requests > 0 {
        parts.push(format!(
            "{} requests were migrated with {} bytes of KV and {} prefilled again ({} tokens recomputed)",
            f.forwarded_requests, f.forwarded_bytes, f.reprefilled_requests, f.reprefill_tokens
        ));
    }
    if f.requeued_prefill_jobs > 0 {
        parts.push(format!(
            "{} prefill jobs went back to the balancer",
            f.requeued_prefill_jobs
        ));
    }
    if f.swa_states_lost > 0 {
        parts.push(format!(
            "{} SWA states were lost and the SWA hit rate went from {:.3} to {:.3}",
            f.swa_states_lost, base.rep.swa_hit_rate, r.rep.swa_hit_rate
        ));
    }
    format!("- {}.\n", parts.join("; "))
}
