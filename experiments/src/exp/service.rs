//! One 64 + 64 unit under a mixed workload, side by side with SPEC §11.

use super::RunContext;
use crate::config::ExperimentHeader;
use crate::output::{Manifest, RunOutput, markdown_table};
use anyhow::{Result, anyhow};
use polars::prelude::*;
use serde::Deserialize;
use servelab_sim::service::{Latencies, ServiceConfig, ServiceReport, run as simulate};
use servelab_workloads::generate::{WorkloadConfig, generate};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    #[allow(dead_code)]
    experiment: ExperimentHeader,
    service: ServiceConfig,
    workload: WorkloadConfig,
}

pub fn run(ctx: &RunContext) -> Result<()> {
    let cfg: Config = ctx.config.parse()?;
    let path = ctx.config.path.display().to_string();
    let seed = ctx.seed();
    let trace = generate(&cfg.workload, seed, cfg.service.constants.block_tokens)
        .map_err(|e| anyhow!("{path}: {e}"))?;
    // Wall time goes to stdout only: output files stay a pure function of config and seed.
    let started = std::time::Instant::now();
    let rep = simulate(&cfg.service, &trace.requests, seed).map_err(|e| anyhow!("{path}: {e}"))?;
    let wall = started.elapsed().as_secs_f64();
    println!(
        "simulated {:.0} s in {:.1} s wall: {:.0}x real time ({} requests, {} events, {:.2} M events/s)",
        rep.simulated_s,
        wall,
        rep.simulated_s / wall,
        rep.arrivals,
        rep.events,
        rep.events as f64 / wall / 1e6
    );
    let mut out = RunOutput::create(&ctx.out)?;
    write_tables(&mut out, &rep)?;
    let summary = summary(&rep, &cfg.service);
    out.write_text("summary.md", &summary)?;
    let series_plot = |f: fn(&servelab_sim::service::SeriesRow) -> f64| {
        rep.series.iter().map(|s| (s.t_s, f(s))).collect::<Vec<_>>()
    };
    let p = out.path("decode_batch.svg");
    crate::plot::lines(
        &p,
        "Decode sequences per rank",
        "time (s)",
        "sequences per rank",
        &[("decode".into(), series_plot(|s| s.decode_seqs_per_rank))],
    )?;
    let p = out.path("throughput.svg");
    crate::plot::lines(
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
    )?;
    out.write_summary_json(&crate::sweep::headline::service(&rep))?;
    out.write_manifest(&Manifest::new(
        "service",
        &ctx.config.path,
        &ctx.config.text,
        seed,
    ))?;
    println!("{summary}");
    Ok(())
}

fn write_tables(out: &mut RunOutput, rep: &ServiceReport) -> Result<()> {
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
    out.write_table("requests_sample", &mut df)?;
    let s = &rep.series;
    let mut df = df!(
        "t_s" => s.iter().map(|x| x.t_s).collect::<Vec<_>>(),
        "arrivals" => s.iter().map(|x| x.arrivals).collect::<Vec<_>>(),
        "completions" => s.iter().map(|x| x.completions).collect::<Vec<_>>(),
        "prefill_tokens_per_s_per_gpu" => s.iter().map(|x| x.prefill_tokens_per_s_per_gpu).collect::<Vec<_>>(),
        "decode_tokens_per_s_per_gpu" => s.iter().map(|x| x.decode_tokens_per_s_per_gpu).collect::<Vec<_>>(),
        "prefill_busy" => s.iter().map(|x| x.prefill_busy).collect::<Vec<_>>(),
        "decode_seqs_per_rank" => s.iter().map(|x| x.decode_seqs_per_rank).collect::<Vec<_>>(),
        "kv_occupancy" => s.iter().map(|x| x.kv_occupancy).collect::<Vec<_>>(),
        "prefill_queued" => s.iter().map(|x| x.prefill_queued).collect::<Vec<_>>(),
    )?;
    out.write_table("series", &mut df)?;
    let e = &rep.engines;
    let mut df = df!(
        "pool" => e.iter().map(|x| x.pool).collect::<Vec<_>>(),
        "engine" => e.iter().map(|x| x.engine).collect::<Vec<_>>(),
        "utilisation" => e.iter().map(|x| x.utilisation).collect::<Vec<_>>(),
        "tokens_per_s_per_gpu" => e.iter().map(|x| x.tokens_per_s_per_gpu).collect::<Vec<_>>(),
        "steps" => e.iter().map(|x| x.steps).collect::<Vec<_>>(),
        "mean_batch" => e.iter().map(|x| x.mean_batch).collect::<Vec<_>>(),
        "mean_kv_occupancy" => e.iter().map(|x| x.mean_kv_occupancy).collect::<Vec<_>>(),
    )?;
    out.write_table("engines", &mut df)?;
    let mut names = Vec::new();
    let mut metric = Vec::new();
    let (mut mean, mut p50, mut p90, mut p99, mut n) = (vec![], vec![], vec![], vec![], vec![]);
    let mut push = |class: &str, l: &Latencies| {
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
        }
    };
    push("all", &rep.all);
    for (c, l) in &rep.by_class {
        push(c, l);
    }
    let mut df = df!("class" => names, "metric" => metric, "mean" => mean, "p50" => p50, "p90" => p90, "p99" => p99, "count" => n)?;
    out.write_table("latency", &mut df)
}

fn summary(rep: &ServiceReport, cfg: &ServiceConfig) -> String {
    let ms = |v: f64| format!("{:.0} ms", v / 1e6);
    let tpot = rep.all.tpot_ns.mean();
    let per_req_input = rep.input_tokens as f64 / rep.measured_requests.max(1) as f64;
    let st = &rep.steady;
    // The class whose P99 TTFT is worst explains the tail.
    let worst = rep
        .by_class
        .iter()
        .filter(|(_, l)| l.ttft_ns.count() > 0)
        .map(|(c, l)| (*c, l.ttft_ns.quantile(0.99), l.ttft_ns.count()))
        .max_by(|a, b| a.1.total_cmp(&b.1));
    let worst_text = worst.map_or(String::new(), |(c, p99, n)| {
        format!(
            " The tail is `{c}` ({n} requests, P99 {:.0} ms).",
            p99 / 1e6
        )
    });
    let queue = rep.all.queue_ns.mean();
    let rows = vec![
        vec![
            "TTFT mean".into(),
            ms(rep.all.ttft_ns.mean()),
            "400 ms".into(),
            format!(
                "Queueing + fetch before the first step average {:.0} ms; the rest is prefill compute of the non-cached part ({:.0} of {per_req_input:.0} input tokens per request on average need compute).",
                queue / 1e6,
                rep.encoder_tokens as f64 / rep.measured_requests.max(1) as f64
            ),
        ],
        vec![
            "TTFT P99".into(),
            ms(rep.all.ttft_ns.quantile(0.99)),
            "1,000 ms".into(),
            format!(
                "Fresh long prompts (no hit) need seconds of compute even in 32K-token chunks, and with the prefill pool busy most of the time (SPEC §12: near saturation at 1:1 pools) short requests queue behind them.{worst_text}"
            ),
        ],
        vec![
            "generation per request".into(),
            format!(
                "{:.0} tok/s (TPOT {:.2} ms)",
                1e9 / tpot.max(1.0),
                tpot / 1e6
            ),
            "230 tok/s".into(),
            format!(
                "Accepted length {:.2} per step of {:.1} ms in steady state at {:.1} seq/rank: per-request speed is the GPU's rate divided by the batch ({:.0} / {:.1} = {:.0} tok/s while busy), so it falls as the batch grows past 60; production also pays online overheads (SPEC §8: ~80% of offline).",
                st.accepted_length,
                st.decode_step_ms,
                st.decode_seqs_per_rank,
                st.decode_tokens_per_s_per_gpu,
                st.decode_seqs_per_rank,
                st.decode_tokens_per_s_per_gpu / st.decode_seqs_per_rank.max(1e-9)
            ),
        ],
        vec![
            "decode tok/s per GPU, steady state (busy)".into(),
            format!(
                "{:.0} at {:.1} seq/rank (utilisation {:.0}%)",
                st.decode_tokens_per_s_per_gpu,
                st.decode_seqs_per_rank,
                100.0 * st.decode_utilisation
            ),
            "~14,500 at 60 seq/rank".into(),
            "Steps started in the measured window (after the warm-up, before new sessions stop). Throughput per GPU follows the batch, and the batch follows Little's law (arrival rate × output length / per-request speed): near 60 seq/rank the pool is at its knee, so a few % more arrivals add many sequences. KV lengths are the workload's (mostly shorter than the 131K of the offline benchmark), which makes steps a little cheaper.".into(),
        ],
        vec![
            "decode tok/s per GPU, whole run (busy)".into(),
            format!(
                "{:.0} at {:.1} seq/rank",
                rep.decode_tokens_per_s_per_gpu, rep.decode_seqs_per_rank
            ),
            "—".into(),
            "Includes ramp-up (sessions still arriving) and drain (the last requests finishing on a nearly empty pool): small batches pull the average down.".into(),
        ],
        vec![
            "prefill non-cached tok/s per GPU, steady state (busy)".into(),
            format!(
                "{:.0} (utilisation {:.0}%)",
                st.prefill_tokens_per_s_per_gpu,
                100.0 * st.prefill_utilisation
            ),
            "60,000–89,500".into(),
            "The rate rises with step size (profile fit); steps are mostly small tool-result chunks over long cached prefixes. The pool is sized 1:1 with decode (SPEC §8) and runs near saturation, as SPEC §12's arithmetic predicts; it is kept below 100% on purpose: agent turns arrive on the workload's pacing (400 ms TTFT + 230 tok/s), so once prefill queues push a turn's reply past its pacing the next turn arrives before that reply is stored, the reply becomes a miss too and the load runs away (queues fill, requests are rejected).".into(),
        ],
        vec![
            "input hit rate".into(),
            format!("{:.1}%", 100.0 * rep.hit_rate()),
            "~96% (1.5M vs 60K tok/s, 25×)".into(),
            "Agent sessions re-send their whole history; each turn misses only its tool result (the reply was stored when it finished), plus documents without repeats and first turns. SPEC §12's 1:1 arithmetic at ~96% puts prefill at 100%; at that miss share an open-loop trace collapses (see the prefill row), so the mix keeps a little more of each turn cached.".into(),
        ],
        vec![
            "average input per request".into(),
            format!("{per_req_input:.0}"),
            "77K".into(),
            "A property of the synthetic mix: agent sessions ~38 turns deep on average (requests weighted by turn) over a ~10K system prompt, minus short chat turns; the workload section sets it.".into(),
        ],
        vec![
            "SWA state hit rate".into(),
            format!("{:.1}%", 100.0 * rep.swa_hit_rate),
            "> 98%".into(),
            "State lives 3 minutes: turns after a longer pause, and first turns, miss.".into(),
        ],
        vec![
            "drafts verified / accepted length, steady state".into(),
            format!(
                "{:.2} / {:.2}",
                st.verified_drafts_per_seq_step, st.accepted_length
            ),
            "3.2–4.4 / 3.20".into(),
            "Dynamic verification; smaller batches verify more drafts (verifying is cheaper when the step is small).".into(),
        ],
    ];
    let rejected: u64 = rep.rejected.iter().map(|r| r.1).sum();
    format!(
        "# Service: {} prefill + {} decode GPUs\n\n{} requests ({} measured: arrivals in [{:.0} s, {:.0} s)), {} completed, {} rejected {:?}; {:.0} s simulated, {} events. Prefix lookups: {} via the session memo, {} full. Steady state: steps started in [{:.0} s, {:.0} s) (after the warm-up, before new sessions stop: the ramp-down after it is simulated, not measured).\n\n{}",
        cfg.prefill.gpus,
        cfg.decode.groups * cfg.decode.ranks,
        rep.arrivals,
        rep.measured_requests,
        st.start_s,
        st.end_s,
        rep.completed,
        rejected,
        rep.rejected,
        rep.simulated_s,
        rep.events,
        rep.memo_prefix_lookups,
        rep.full_prefix_lookups,
        st.start_s,
        st.end_s,
        markdown_table(
            &["metric", "simulated", "SPEC §11", "why they differ"],
            &rows
        )
    )
}
