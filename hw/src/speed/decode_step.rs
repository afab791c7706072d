//! Whole decode steps of the backend per [`DecodeMode`] (issue 18, item 3): the host's issue
//! time and the CUDA-event step time of the same steps, on an idle host and with spinning
//! threads sharing the launching thread's CPU, to show whether a step's device time follows
//! the host. Also the largest logit difference of each device-bound mode from the eager step
//! at the same positions.
//!
//! Each mode decodes the same positions (`context`, `context + q`, ...) of the same sequences,
//! whose KV is random (no prefill: a random model's KV content does not change the work). The
//! logits are compared on the first step of every mode, taken before any mode decodes
//! further: later positions overwrite ring slots of that step's window.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use servelab_core::engine::plan::{DecodePlan, DecodeRankPlan, DecodeSeq, StepPlan, StepReport};
use servelab_core::ids::{EngineId, RequestId};
use servelab_kernels::GpuContext;
use servelab_kernels::fill::fill_uniform_bf16;

use crate::backend::{
    BackendConfig, BackendError, CudaBackend, DecodeMode, GraphStats, ModelShape,
};
use crate::timing::{Timing, summarize};

#[derive(Debug, Clone, serde::Serialize)]
pub struct DecodeStepConfig {
    pub model: ModelShape,
    /// Sequences per step.
    pub batches: Vec<usize>,
    /// Verified drafts per sequence (query tokens = 1 + drafts).
    pub drafts: u32,
    /// KV length of every sequence at the first step.
    pub context: usize,
    pub warmup: usize,
    pub steps: usize,
    /// Spinning threads sharing the launching thread's CPU, one row set per entry (0: idle).
    pub loads: Vec<usize>,
    pub seed: u64,
}

impl DecodeStepConfig {
    /// The default 20 + 20-layer MLA model at 8 and 64 sequences of 4K tokens, idle and with
    /// one and three spinning threads on the launching CPU (about half and a quarter of its
    /// speed).
    pub fn full() -> Self {
        Self {
            model: ModelShape::default(),
            batches: vec![8, 64],
            drafts: 0,
            context: 4096,
            warmup: 5,
            steps: 60,
            loads: vec![0, 1, 3],
            seed: 1,
        }
    }
}

/// One (mode, batch, load) cell: medians over its measured steps.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DecodeStepRow {
    pub mode: DecodeMode,
    pub seqs: usize,
    pub query_tokens: usize,
    pub context: usize,
    pub load_threads: usize,
    /// Host wall time from the step's start until its last launch was issued.
    pub host_issue_ms: Timing,
    /// CPU time of the launching thread over the whole step (CUDA's waits spin, so this counts
    /// waiting too).
    pub host_cpu_ms: Timing,
    /// CUDA-event duration of the step on the compute stream (what the simulator is fit to).
    pub device_ms: Timing,
    /// Host wall time of the whole `try_execute` call.
    pub wall_ms: Timing,
    /// Graph statistics accumulated over the cell's steps (warm-up included).
    pub graphs: GraphStats,
    /// Largest |logit| difference from the eager step at the same positions (idle rows).
    pub max_logit_diff: Option<f64>,
    pub max_logit: Option<f64>,
    /// Non-finite logits of that step (eager's in the eager row).
    pub non_finite_logits: Option<usize>,
    /// Token rows of that step with a logit more than 5 % of the largest |logit| away.
    pub rows_over_tolerance: Option<usize>,
}

/// A mode's first step against eager's: largest |logit| difference, largest eager |logit|,
/// the mode's non-finite logits, and the token rows whose largest difference exceeds 5 % of
/// the largest eager |logit|.
type LogitDiff = (f64, f64, usize, usize);

/// The first step (at the context length) in every mode, before any mode decodes further
/// (later positions would overwrite ring slots of the window): per mode, the largest |logit|
/// difference from eager, the largest eager |logit| and the mode's non-finite logits.
fn logit_diffs(
    b: &mut CudaBackend,
    modes: &[DecodeMode],
    p: &StepPlan,
) -> Result<Vec<Option<LogitDiff>>, BackendError> {
    let mut report = StepReport::default();
    let mut eager: Option<Vec<f32>> = None;
    let mut out = Vec::new();
    for &mode in modes {
        b.set_decode_mode(mode)?;
        b.keep_logits = true;
        b.try_execute(p, &mut report)?;
        b.keep_logits = false;
        let l = std::mem::take(&mut b.last_logits);
        let e = eager.get_or_insert_with(|| l.clone());
        let d = e
            .iter()
            .zip(&l)
            .map(|(a, c)| (a - c).abs() as f64)
            .fold(0.0, f64::max);
        let scale = e.iter().map(|x| x.abs() as f64).fold(0.0, f64::max);
        let vocab = b.config().model.vocab;
        let rows_over = e
            .chunks(vocab)
            .zip(l.chunks(vocab))
            .filter(|(a, c)| {
                a.iter()
                    .zip(c.iter())
                    .any(|(x, y)| ((x - y).abs() as f64) > 0.05 * scale)
            })
            .count();
        out.push(Some((
            d,
            scale,
            l.iter().filter(|x| !x.is_finite()).count(),
            rows_over,
        )));
    }
    Ok(out)
}

#[cfg(target_os = "linux")]
fn thread_cpu_ms() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes one timespec for the calling thread's clock.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 * 1e3 + ts.tv_nsec as f64 / 1e6
}

#[cfg(not(target_os = "linux"))]
fn thread_cpu_ms() -> f64 {
    0.0
}

fn plan(first_request: u64, seqs: usize, kv: usize, drafts: u32) -> StepPlan {
    StepPlan::Decode(DecodePlan {
        engine: EngineId(0),
        ranks: vec![DecodeRankPlan {
            seq_start: 0,
            seq_end: seqs as u32,
            verify_budget: seqs as u32 * drafts,
        }],
        seqs: (0..seqs)
            .map(|i| DecodeSeq {
                request: RequestId(first_request + i as u64),
                kv_tokens: kv as u32,
                max_drafts: drafts,
                slot: i as u32,
            })
            .collect(),
        dynamic: false,
        expert_imbalance: 1.0,
    })
}

/// Spinning threads on the calling thread's CPU mask until dropped.
struct Load {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Load {
    fn start(n: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..n)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let mut x = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        x = std::hint::black_box(
                            x.wrapping_mul(6364136223846793005).wrapping_add(1),
                        );
                    }
                })
            })
            .collect();
        Self { stop, threads }
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Runs the sweep of `cfg` on one backend; `log` gets a line per row.
pub fn measure_decode_steps(
    gpu: Arc<GpuContext>,
    cfg: &DecodeStepConfig,
    log: &mut impl FnMut(&str),
) -> Result<Vec<DecodeStepRow>, BackendError> {
    let m = cfg.model.clone();
    let q = 1 + cfg.drafts as usize;
    let modes = [DecodeMode::Eager, DecodeMode::DeviceMoe, DecodeMode::Graph];
    let max_batch = cfg.batches.iter().copied().max().unwrap_or(1);
    let per_seq = (cfg.context + (cfg.warmup + cfg.steps + 1) * q).div_ceil(m.block_size);
    let copies = cfg.batches.len();
    let bcfg = BackendConfig {
        model: m.clone(),
        hbm_blocks: copies * max_batch * per_seq + 8,
        host_blocks: 8,
        ring_slots: copies * max_batch + 1,
        swa_host_slots: 4,
        seed: cfg.seed,
        ..BackendConfig::default()
    };
    let mut b = CudaBackend::new(gpu, bcfg)?;
    // every mode on the backend's own stream, the one graphs are captured on
    b.set_decode_mode(DecodeMode::Graph)?;
    fill_uniform_bf16(&b.gpu, &mut b.pool, cfg.seed ^ 0x5eed, 1.0)?;
    fill_uniform_bf16(&b.gpu, &mut b.rings, cfg.seed ^ 0x7155, 1.0)?;
    b.gpu.stream.synchronize()?;
    let _pin = crate::affinity::pin_to_current_cpu();
    let mut rows = Vec::new();
    let mut report = StepReport::default();
    for &load in &cfg.loads {
        let _load = Load::start(load);
        for (bi, &seqs) in cfg.batches.iter().enumerate() {
            // the same sequences in every mode: token ids hash the request id
            let first = (bi * max_batch) as u64 + 1;
            let diffs = if load == 0 {
                logit_diffs(&mut b, &modes, &plan(first, seqs, cfg.context, cfg.drafts))?
            } else {
                vec![None; modes.len()]
            };
            for (&mode, &diff) in modes.iter().zip(&diffs) {
                b.set_decode_mode(mode)?;
                let before = b.graph_stats();
                let (mut issue, mut cpu, mut dev, mut wall) = (vec![], vec![], vec![], vec![]);
                for j in 1..cfg.warmup + cfg.steps {
                    let p = plan(first, seqs, cfg.context + j * q, cfg.drafts);
                    let (c0, w0) = (thread_cpu_ms(), Instant::now());
                    b.try_execute(&p, &mut report)?;
                    let (c1, w1) = (thread_cpu_ms(), w0.elapsed());
                    if j >= cfg.warmup {
                        issue.push(b.last_host_issue.as_secs_f64() * 1e3);
                        cpu.push(c1 - c0);
                        dev.push(report.duration.0 as f64 / 1e6);
                        wall.push(w1.as_secs_f64() * 1e3);
                    }
                }
                let after = b.graph_stats();
                let row = DecodeStepRow {
                    mode,
                    seqs,
                    query_tokens: q,
                    context: cfg.context,
                    load_threads: load,
                    host_issue_ms: summarize(issue),
                    host_cpu_ms: summarize(cpu),
                    device_ms: summarize(dev),
                    wall_ms: summarize(wall),
                    graphs: GraphStats {
                        captures: after.captures - before.captures,
                        replays: after.replays - before.replays,
                        eager_steps: after.eager_steps - before.eager_steps,
                    },
                    max_logit_diff: diff.map(|d| d.0),
                    max_logit: diff.map(|d| d.1),
                    non_finite_logits: diff.map(|d| d.2),
                    rows_over_tolerance: diff.map(|d| d.3),
                };
                log(&format!(
                    "{:?} seqs {seqs} x {q} tokens @ {} load {load}: host issue {:.3} ms, host CPU {:.3} ms, device {:.3} ms, wall {:.3} ms; graphs {:?}; logit diff, largest, non-finite {:?}",
                    mode,
                    cfg.context,
                    row.host_issue_ms.median_ms,
                    row.host_cpu_ms.median_ms,
                    row.device_ms.median_ms,
                    row.wall_ms.median_ms,
                    row.graphs,
                    diff
                ));
                rows.push(row);
            }
        }
    }
    b.set_decode_mode(DecodeMode::Eager)?;
    Ok(rows)
}

/// Markdown table of the rows.
pub fn markdown(rows: &[DecodeStepRow]) -> String {
    let mut s = String::from(
        "| mode | seqs x tokens | context | spinning threads | host issue ms (median) | host CPU ms | device step ms (median [min, max]) | wall ms | captures / replays | max logit diff vs eager (non-finite; rows over 5 %) |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        s.push_str(&format!(
            "| {:?} | {} x {} | {} | {} | {:.3} | {:.3} | {:.3} [{:.3}, {:.3}] | {:.3} | {} / {} | {} |\n",
            r.mode,
            r.seqs,
            r.query_tokens,
            r.context,
            r.load_threads,
            r.host_issue_ms.median_ms,
            r.host_cpu_ms.median_ms,
            r.device_ms.median_ms,
            r.device_ms.min_ms,
            r.device_ms.max_ms,
            r.wall_ms.median_ms,
            r.graphs.captures,
            r.graphs.replays,
            match (
                r.max_logit_diff,
                r.max_logit,
                r.non_finite_logits,
                r.rows_over_tolerance,
            ) {
                (Some(d), Some(m), Some(n), Some(o)) => {
                    format!("{d:.3e} (largest |logit| {m:.2}; {n}; {o} rows)")
                }
                _ => "-".into(),
            }
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The full sweep on the default model, for a short device run:
    /// `servelab_hw-* --ignored decode_step_bench --nocapture`; writes `decode-steps.json`
    /// and `decode-steps.md` to `$OUT` when set. `DECODE_BENCH_DRAFTS=2` verifies two drafts
    /// per sequence, `DECODE_BENCH_BATCHES=8,64` and `DECODE_BENCH_LOADS=0,1,3` pick the cells,
    /// `DECODE_BENCH_QUICK=1` shrinks it to one short cell.
    #[test]
    #[ignore = "full-size GPU benchmark"]
    fn decode_step_bench() {
        let Some(gpu) = servelab_kernels::gpu::gpu_or_skip() else {
            return;
        };
        let mut cfg = DecodeStepConfig::full();
        if std::env::var("DECODE_BENCH_DRAFTS").is_ok_and(|v| !v.is_empty()) {
            cfg.drafts = std::env::var("DECODE_BENCH_DRAFTS")
                .unwrap()
                .parse()
                .unwrap();
        }
        let list = |name: &str| -> Option<Vec<usize>> {
            let v = std::env::var(name).ok()?;
            Some(v.split(',').map(|x| x.trim().parse().unwrap()).collect())
        };
        if let Some(b) = list("DECODE_BENCH_BATCHES") {
            cfg.batches = b;
        }
        if let Some(l) = list("DECODE_BENCH_LOADS") {
            cfg.loads = l;
        }
        if std::env::var("DECODE_BENCH_QUICK").is_ok_and(|v| v == "1") {
            cfg.batches = vec![8];
            cfg.steps = 10;
            cfg.loads = vec![0];
        }
        let rows = measure_decode_steps(Arc::new(gpu), &cfg, &mut |l| println!("{l}")).unwrap();
        let md = markdown(&rows);
        println!("{md}");
        if let Ok(out) = std::env::var("OUT") {
            let dir = std::path::Path::new(&out);
            let json = serde_json::json!({ "config": cfg, "rows": rows });
            std::fs::write(
                dir.join("decode-steps.json"),
                serde_json::to_string_pretty(&json).unwrap(),
            )
            .unwrap();
            std::fs::write(dir.join("decode-steps.md"), md).unwrap();
        }
    }
}
