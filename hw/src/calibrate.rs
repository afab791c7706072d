//! Calibration (issue 6, item 4): sweeps prefill and decode step shapes through the
//! [`CudaBackend`], fits the simulator's cost-model form by weighted least squares and writes a
//! hardware profile in the format of `sim/profiles/sm100-published.toml`.
//!
//! Prefill: `t = base + L_enc·(a·n + b·ramp(n)·n·(p + n/2)) + L_dec·(a·r + b·r²/2 + x·r·(p + n))`
//! (n new tokens, p prefix, r decoder replay, `ramp(n) = min(1, n / n_ramp)` for a one-chunk
//! step; see
//! [`PrefillCostModel`]). `n_ramp` is not linear: each candidate (0 = no ramp, and every swept
//! chunk size) is fitted and the one with the smallest weighted residual kept. Decode:
//! `t = base + c_seq·B + c_kv·ΣKV + c_tok·N + c_sq·N² + c_exp·E(1 − (1 − k/E)^N)` (B sequences,
//! N = query tokens, the last term the experts N tokens activate on an E-expert top-k model).
//!
//! Besides the grid, the fit takes the steps of a calibration workload (the conformance config
//! run on the GPU under another seed): isolated grid steps after a reset and the same shapes
//! inside a running engine differ by more than the target error (small hit-suffix prefill
//! steps ran 20–30 % faster in the engine on the H200), so the fit sees both.
//! Residuals are relative (each point weighs 1/t), so short and long steps count alike; a
//! coefficient the fit makes negative is pinned at 0 and the rest refitted (non-negative least
//! squares by elimination).

use std::time::Instant;

use servelab_core::engine::plan::{
    DecodePlan, DecodeRankPlan, DecodeSeq, PrefillChunk, PrefillPlan, StepPlan, StepReport,
};
use servelab_core::engine::{ActiveExpertTerm, DecodeTimeModel, PrefillCostModel};
use servelab_core::ids::{EngineId, RequestId};

use crate::backend::{BackendError, CudaBackend};
use crate::conformance::ConformanceError;
use crate::env::RecordedStep;

/// What to sweep.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CalibrateConfig {
    pub prefill_new: Vec<usize>,
    pub prefill_prefix: Vec<usize>,
    pub replay_tokens: usize,
    pub decode_batch: Vec<usize>,
    pub decode_kv: Vec<usize>,
    /// Query tokens per sequence (1 + verified drafts).
    pub decode_query: Vec<usize>,
    pub reps: usize,
}

/// A workload whose executed steps join the fit: a conformance config and the seed to run it
/// under (not the conformance run's own seed, so the conformance steps stay held out).
#[derive(Debug, Clone)]
pub struct CalibrationWorkload {
    pub config_text: String,
    pub origin: String,
    /// The profile the workload's policies plan with (TOML text).
    pub profile_text: String,
    pub seed: u64,
}

impl CalibrateConfig {
    /// The operating range of the conformance workload and of SPEC-like steps on the small
    /// model: chunks of 128–8,192 tokens over prefixes up to 16K, decode batches of 1–64 with
    /// 1–6 query tokens. Five timed repetitions per shape: step times on this backend carry
    /// host-side jitter (eager launches, one host sync per MoE layer), so medians need them.
    pub fn full() -> Self {
        Self {
            prefill_new: vec![128, 512, 1024, 2048, 4096, 8192],
            prefill_prefix: vec![0, 2048, 8192, 16_384],
            replay_tokens: 140,
            decode_batch: vec![1, 2, 4, 8, 16, 32, 64],
            decode_kv: vec![1024, 4096, 8192, 16_384],
            decode_query: vec![1, 3, 6],
            reps: 5,
        }
    }

    pub fn quick() -> Self {
        Self {
            prefill_new: vec![256, 1024],
            prefill_prefix: vec![0, 1024],
            replay_tokens: 140,
            decode_batch: vec![1, 4],
            decode_kv: vec![512, 2048],
            decode_query: vec![1, 3],
            reps: 2,
        }
    }
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct PrefillPoint {
    pub new_tokens: usize,
    pub prefix_tokens: usize,
    pub decoder_tokens: usize,
    pub durations_ns: Vec<u64>,
    pub median_ns: f64,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct DecodePoint {
    pub batch: usize,
    pub kv_tokens: usize,
    pub query_tokens: usize,
    pub durations_ns: Vec<u64>,
    pub median_ns: f64,
    /// Wall time of `try_execute` minus the event-timed duration (host work outside the
    /// stream's busy span), median.
    pub host_gap_ns: f64,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Sweep {
    pub prefill: Vec<PrefillPoint>,
    pub decode: Vec<DecodePoint>,
    /// Routed experts and picks per token of the swept model (0: no active-expert term; sweeps
    /// saved before it existed).
    #[serde(default)]
    pub experts: usize,
    #[serde(default)]
    pub top_k: usize,
    /// Seed of the calibration workload, when one ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workload_seed: Option<u64>,
    /// Its executed steps, measured like the grid (CUDA events), each fitted as one point.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub workload: Vec<RecordedStep>,
}

/// Runs `w` on the GPU through the conformance engine loop, on a backend built from the
/// config's `[backend]` section (as the conformance run builds it), and adds its steps to
/// `sweep`. Call it after the grid: the grid's backend should be dropped first to free HBM.
pub fn add_workload(
    gpu: std::sync::Arc<servelab_kernels::GpuContext>,
    sweep: &mut Sweep,
    w: &CalibrationWorkload,
) -> Result<(), ConformanceError> {
    let bad = |e: String| servelab_core::ConfigError::invalid(&w.origin, e.trim_end().to_string());
    let mut doc: toml::Table = toml::from_str(&w.config_text).map_err(|e| bad(e.to_string()))?;
    let exp = doc
        .entry("experiment")
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    let toml::Value::Table(t) = exp else {
        return Err(bad("[experiment] is not a table".into()).into());
    };
    t.insert("seed".into(), toml::Value::Integer(w.seed as i64));
    let text = toml::to_string(&doc).map_err(|e| bad(e.to_string()))?;
    let file = crate::conformance::ConformanceFile::parse(&text, &w.origin)?;
    let mut b = CudaBackend::new(gpu, file.backend_config())?;
    let rec = crate::conformance::run_on_gpu(&mut b, &text, &w.origin, &w.profile_text, "", "")?;
    sweep.workload_seed = Some(w.seed);
    sweep.workload = rec.run.steps;
    Ok(())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        0.0
    } else if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// The swept prefill shapes (new tokens, prefix, decoder replay): every chunk size after every
/// prefix with a replay, then each chunk size as a middle chunk after the longest prefix.
fn prefill_shapes(cfg: &CalibrateConfig) -> Vec<(usize, usize, usize)> {
    let mut shapes = Vec::new();
    for &n in &cfg.prefill_new {
        for &p in &cfg.prefill_prefix {
            shapes.push((n, p, cfg.replay_tokens.min(n + p)));
        }
        // a middle chunk: no decoder replay
        shapes.push((n, cfg.prefill_prefix.last().copied().unwrap_or(0), 0));
    }
    shapes
}

/// A sweep in progress: the backend, the config and the next request id (every timed step
/// runs on fresh ones).
struct Sweeper<'a> {
    b: &'a mut CudaBackend,
    cfg: &'a CalibrateConfig,
    next_req: u64,
    report: StepReport,
}

impl Sweeper<'_> {
    /// One prefill shape from an empty backend, `reps` times after one warm-up.
    fn prefill_point(
        &mut self,
        (n, p, r): (usize, usize, usize),
    ) -> Result<PrefillPoint, BackendError> {
        let m = self.b.config().model.clone();
        let mut d = Vec::new();
        for rep in 0..=self.cfg.reps {
            self.b.reset();
            self.next_req += 1;
            let plan = StepPlan::Prefill(PrefillPlan {
                engine: EngineId(0),
                chunks: vec![PrefillChunk {
                    request: RequestId(self.next_req),
                    new_tokens: n as u32,
                    prefix_tokens: p as u32,
                    new_token_layers: m.encoder_layers as u32,
                    decoder_tokens: r as u32,
                    decoder_layers: m.decoder_layers as u32,
                    swap_in_bytes: 0,
                }],
                expert_imbalance: 1.0,
            });
            self.b.try_execute(&plan, &mut self.report)?;
            if rep > 0 {
                d.push(self.report.duration.0);
            }
        }
        let med = median(&mut d.iter().map(|&x| x as f64).collect::<Vec<_>>());
        Ok(PrefillPoint {
            new_tokens: n,
            prefix_tokens: p,
            decoder_tokens: r,
            durations_ns: d,
            median_ns: med,
        })
    }

    /// `bsz` fresh sequences of `kv` cached tokens, each with `q` query tokens.
    fn decode_plan(&mut self, bsz: usize, kv: usize, q: usize) -> StepPlan {
        let seqs: Vec<DecodeSeq> = (0..bsz)
            .map(|i| DecodeSeq {
                request: RequestId(self.next_req + 1 + i as u64),
                kv_tokens: kv as u32,
                max_drafts: (q - 1) as u32,
                slot: i as u32,
            })
            .collect();
        self.next_req += bsz as u64 + 1;
        StepPlan::Decode(DecodePlan {
            engine: EngineId(0),
            ranks: vec![DecodeRankPlan {
                seq_start: 0,
                seq_end: bsz as u32,
                verify_budget: (bsz * (q - 1)) as u32,
            }],
            seqs,
            dynamic: false,
            expert_imbalance: 1.0,
        })
    }

    /// One decode shape after a reset, `reps` times after one warm-up (the same sequences
    /// each time), with the host time outside the stream's busy span.
    fn decode_point(
        &mut self,
        bsz: usize,
        kv: usize,
        q: usize,
    ) -> Result<DecodePoint, BackendError> {
        self.b.reset();
        let plan = self.decode_plan(bsz, kv, q);
        let (mut d, mut gaps) = (Vec::new(), Vec::new());
        for rep in 0..=self.cfg.reps {
            let t0 = Instant::now();
            self.b.try_execute(&plan, &mut self.report)?;
            let wall = t0.elapsed().as_nanos() as f64;
            if rep > 0 {
                d.push(self.report.duration.0);
                gaps.push((wall - self.report.duration.0 as f64).max(0.0));
            }
        }
        let med = median(&mut d.iter().map(|&x| x as f64).collect::<Vec<_>>());
        Ok(DecodePoint {
            batch: bsz,
            kv_tokens: kv,
            query_tokens: q,
            durations_ns: d,
            median_ns: med,
            host_gap_ns: median(&mut gaps),
        })
    }
}

/// Runs every shape `reps` times after one warm-up, each on fresh request ids.
pub fn sweep(
    b: &mut CudaBackend,
    cfg: &CalibrateConfig,
    mut log: impl FnMut(&str),
) -> Result<Sweep, BackendError> {
    let m = b.config().model.clone();
    let mut sw = Sweeper {
        b,
        cfg,
        next_req: 1_000_000,
        report: StepReport::default(),
    };
    let mut prefill = Vec::new();
    for shape in prefill_shapes(cfg) {
        let pt = sw.prefill_point(shape)?;
        let (n, p, r) = shape;
        log(&format!(
            "prefill n={n} p={p} r={r}: {:.2} ms",
            pt.median_ns / 1e6
        ));
        prefill.push(pt);
    }
    let mut decode = Vec::new();
    for &bsz in &cfg.decode_batch {
        for &kv in &cfg.decode_kv {
            for &q in &cfg.decode_query {
                let pt = sw.decode_point(bsz, kv, q)?;
                log(&format!(
                    "decode B={bsz} kv={kv} q={q}: {:.2} ms",
                    pt.median_ns / 1e6
                ));
                decode.push(pt);
            }
        }
    }
    Ok(Sweep {
        prefill,
        decode,
        experts: m.experts,
        top_k: m.top_k,
        workload_seed: None,
        workload: Vec::new(),
    })
}

/// Weighted non-negative least squares: minimises Σ ((x_i·c − y_i) / y_i)² over c ≥ 0 by
/// dropping the most negative coefficient and refitting until none is negative.
pub fn fit_nonneg(x: &[Vec<f64>], y: &[f64]) -> Vec<f64> {
    let k = x.first().map_or(0, |r| r.len());
    let mut active: Vec<bool> = vec![true; k];
    loop {
        let idx: Vec<usize> = (0..k).filter(|&j| active[j]).collect();
        let c = solve_weighted(x, y, &idx);
        let mut full = vec![0.0; k];
        for (&j, &v) in idx.iter().zip(&c) {
            full[j] = v;
        }
        match idx
            .iter()
            .zip(&c)
            .filter(|(_, v)| **v < 0.0)
            .min_by(|a, b| a.1.total_cmp(b.1))
        {
            Some((&j, _)) => active[j] = false,
            None => return full,
        }
    }
}

/// Least squares on the columns `idx`, rows weighted by 1/y, via normal equations with
/// column scaling (features span many orders of magnitude).
fn solve_weighted(x: &[Vec<f64>], y: &[f64], idx: &[usize]) -> Vec<f64> {
    let k = idx.len();
    if k == 0 {
        return Vec::new();
    }
    let scale: Vec<f64> = idx
        .iter()
        .map(|&j| {
            x.iter()
                .zip(y)
                .map(|(r, yi)| (r[j] / yi).abs())
                .fold(0.0, f64::max)
                .max(1e-300)
        })
        .collect();
    let mut a = vec![vec![0.0; k + 1]; k];
    for (r, &yi) in x.iter().zip(y) {
        let f: Vec<f64> = idx
            .iter()
            .zip(&scale)
            .map(|(&j, s)| r[j] / yi / s)
            .collect();
        for p in 0..k {
            for q in 0..k {
                a[p][q] += f[p] * f[q];
            }
            a[p][k] += f[p]; // target y / y = 1
        }
    }
    // Gaussian elimination with partial pivoting (tiny ridge keeps rank-deficient sets finite).
    for (p, row) in a.iter_mut().enumerate() {
        row[p] += 1e-12;
    }
    for col in 0..k {
        let piv = (col..k)
            .max_by(|&i, &j| a[i][col].abs().total_cmp(&a[j][col].abs()))
            .unwrap_or(col);
        a.swap(col, piv);
        let d = a[col][col];
        if d.abs() < 1e-300 {
            continue;
        }
        let pivot_row = a[col].clone();
        for (r, row) in a.iter_mut().enumerate() {
            if r != col {
                let f = row[col] / d;
                for (x, p) in row.iter_mut().zip(&pivot_row).skip(col) {
                    *x -= f * p;
                }
            }
        }
    }
    (0..k)
        .map(|p| {
            if a[p][p].abs() < 1e-300 {
                0.0
            } else {
                a[p][k] / a[p][p] / scale[p]
            }
        })
        .collect()
}

/// The fitted profile and its residuals.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Fit {
    pub prefill: PrefillCostModel,
    pub decode: DecodeTimeModel,
    /// (measured ns, predicted ns) per point: the grid in sweep order, then the workload's
    /// steps in run order.
    pub prefill_residuals: Vec<(f64, f64)>,
    pub decode_residuals: Vec<(f64, f64)>,
    pub swap_in_bytes_per_s: f64,
    pub sync_gap_ns: f64,
}

/// Columns: base, a, b, x (the coefficients of [`PrefillCostModel`] at the ramp `ramp_tokens`),
/// summed over the step's chunks, and the step's expert reads; the ramp follows the step's new
/// tokens, as in [`PrefillCostModel::step_ns`].
fn prefill_features(
    chunks: &[PrefillChunk],
    ramp_tokens: f64,
    experts: &Option<ActiveExpertTerm>,
) -> Vec<f64> {
    let rows: f64 = chunks.iter().map(|c| f64::from(c.new_tokens)).sum();
    let ramp = if ramp_tokens > 0.0 {
        (rows / ramp_tokens).min(1.0)
    } else {
        1.0
    };
    let mut f = vec![1.0, 0.0, 0.0, 0.0, 0.0];
    for c in chunks {
        let (n, pre, r) = (
            f64::from(c.new_tokens),
            f64::from(c.prefix_tokens),
            f64::from(c.decoder_tokens),
        );
        let (enc, dec) = (f64::from(c.new_token_layers), f64::from(c.decoder_layers));
        f[1] += enc * n + dec * r;
        f[2] += enc * ramp * n * (pre + n / 2.0) + dec * r * r / 2.0;
        f[3] += dec * r * (pre + n);
    }
    if let Some(a) = experts {
        f[4] = a.prefill_layer_reads(chunks);
    }
    f
}

/// Every prefill step the fit sees (grid points, then workload steps) and its duration.
fn prefill_steps(
    sweep: &Sweep,
    encoder_layers: usize,
    decoder_layers: usize,
) -> (Vec<Vec<PrefillChunk>>, Vec<f64>) {
    let mut shapes = Vec::new();
    let mut y = Vec::new();
    for p in &sweep.prefill {
        shapes.push(vec![PrefillChunk {
            request: RequestId(0),
            new_tokens: p.new_tokens as u32,
            prefix_tokens: p.prefix_tokens as u32,
            new_token_layers: encoder_layers as u32,
            decoder_tokens: p.decoder_tokens as u32,
            decoder_layers: decoder_layers as u32,
            swap_in_bytes: 0,
        }]);
        y.push(p.median_ns);
    }
    for s in &sweep.workload {
        if let StepPlan::Prefill(p) = &s.plan
            && !p.chunks.is_empty()
        {
            shapes.push(p.chunks.clone());
            y.push(s.duration_ns.max(1) as f64);
        }
    }
    (shapes, y)
}

/// Σ ((predicted − measured) / measured)²: what the weighted fit minimises.
fn weighted_sse(x: &[Vec<f64>], y: &[f64], c: &[f64]) -> f64 {
    x.iter()
        .zip(y)
        .map(|(f, &yi)| {
            let p: f64 = f.iter().zip(c).map(|(a, b)| a * b).sum();
            (p / yi - 1.0).powi(2)
        })
        .sum()
}

/// Columns: base, c_seq, c_kv, c_tok, c_sq, c_exp, c_maxkv for a step of `b` sequences, `kv`
/// KV tokens (the longest sequence `max_kv`) and `n` query tokens.
fn decode_features(
    b: f64,
    kv: f64,
    max_kv: f64,
    n: u32,
    experts: &Option<ActiveExpertTerm>,
) -> Vec<f64> {
    let q = f64::from(n);
    let active = experts.as_ref().map_or(0.0, |a| a.expected_active(n));
    vec![1.0, b, kv, q, q * q, active, max_kv]
}

/// Every decode step the fit sees (grid points, then workload steps) and its duration.
fn decode_steps(sweep: &Sweep, experts: &Option<ActiveExpertTerm>) -> (Vec<Vec<f64>>, Vec<f64>) {
    let mut x = Vec::new();
    let mut y = Vec::new();
    for d in &sweep.decode {
        let b = d.batch as f64;
        let n = (d.batch * d.query_tokens) as u32;
        let kv = d.kv_tokens as f64;
        x.push(decode_features(b, b * kv, kv, n, experts));
        y.push(d.median_ns);
    }
    for s in &sweep.workload {
        if let StepPlan::Decode(p) = &s.plan
            && !p.seqs.is_empty()
        {
            let kv: f64 = p.seqs.iter().map(|q| f64::from(q.kv_tokens)).sum();
            let max_kv = p.seqs.iter().map(|q| q.kv_tokens).max().unwrap_or(0);
            let verified: u32 = s.seqs.iter().map(|o| u32::from(o.verified)).sum();
            let n = p.seqs.len() as u32 + verified;
            x.push(decode_features(
                p.seqs.len() as f64,
                kv,
                f64::from(max_kv),
                n,
                experts,
            ));
            y.push(s.duration_ns.max(1) as f64);
        }
    }
    (x, y)
}

/// The prefill fit at the best ramp: the model with its features, targets and coefficients
/// (for the residuals).
struct PrefillFit {
    model: PrefillCostModel,
    x: Vec<Vec<f64>>,
    y: Vec<f64>,
    c: Vec<f64>,
}

/// Fits the prefill model once per ramp candidate (none, and every swept chunk size) and
/// keeps the one with the smallest weighted residual.
fn fit_prefill(
    sweep: &Sweep,
    encoder_layers: usize,
    decoder_layers: usize,
    experts: &Option<ActiveExpertTerm>,
) -> PrefillFit {
    let (pshapes, py) = prefill_steps(sweep, encoder_layers, decoder_layers);
    // The ramp candidates: none, and every swept chunk size (ascending, so ties keep the
    // smaller ramp).
    let mut ramps: Vec<f64> = sweep.prefill.iter().map(|p| p.new_tokens as f64).collect();
    ramps.push(0.0);
    ramps.sort_by(f64::total_cmp);
    ramps.dedup();
    // (weighted SSE, ramp, features, coefficients) of the best ramp so far
    type Candidate = (f64, f64, Vec<Vec<f64>>, Vec<f64>);
    let mut best: Option<Candidate> = None;
    for ramp in ramps {
        let px: Vec<Vec<f64>> = pshapes
            .iter()
            .map(|c| prefill_features(c, ramp, experts))
            .collect();
        let pc = fit_nonneg(&px, &py);
        let sse = weighted_sse(&px, &py, &pc);
        if best.as_ref().is_none_or(|b| sse < b.0) {
            best = Some((sse, ramp, px, pc));
        }
    }
    let (_, ramp, px, mut pc) = best.unwrap_or((0.0, 0.0, Vec::new(), Vec::new()));
    // An empty sweep fits nothing: zero coefficients (the profile then fails validation).
    pc.resize(5, 0.0);
    let model = PrefillCostModel {
        base_ns: pc[0],
        per_layer_token_ns: pc[1].max(1e-6),
        per_layer_token_ctx_ns: pc[2],
        moe_share: 0.6,
        reference_imbalance: 1.0,
        attention_ramp_tokens: ramp,
        per_layer_replay_ctx_ns: pc[3],
        active_experts: experts.as_ref().map(|a| ActiveExpertTerm {
            per_expert_ns: pc[4],
            ..a.clone()
        }),
    };
    PrefillFit {
        model,
        x: px,
        y: py,
        c: pc,
    }
}

/// The decode model fitted to the sweep's decode points and workload steps, with its
/// features, targets and coefficients.
fn fit_decode(
    sweep: &Sweep,
    experts: Option<ActiveExpertTerm>,
) -> (DecodeTimeModel, Vec<Vec<f64>>, Vec<f64>, Vec<f64>) {
    let (dx, dy) = decode_steps(sweep, &experts);
    let mut dc = fit_nonneg(&dx, &dy);
    dc.resize(7, 0.0);
    let decode = DecodeTimeModel {
        base_ns: dc[0],
        per_seq_ns: dc[1],
        per_kv_token_ns: dc[2],
        per_token_ns: dc[3],
        per_token_sq_ns: dc[4],
        dynamic_overhead_ns: 0.0,
        moe_share: 0.6,
        reference_imbalance: 1.0,
        per_max_kv_token_ns: dc[6],
        active_experts: experts.map(|a| ActiveExpertTerm {
            per_expert_ns: dc[5],
            ..a
        }),
    };
    (decode, dx, dy, dc)
}

/// (measured, fitted) of every point.
fn residuals(x: &[Vec<f64>], y: &[f64], c: &[f64]) -> Vec<(f64, f64)> {
    let dot = |f: &[f64], c: &[f64]| f.iter().zip(c).map(|(a, b)| a * b).sum::<f64>();
    x.iter().zip(y).map(|(f, &y)| (y, dot(f, c))).collect()
}

/// Fits both models. `moe_share` and the reference imbalances are not identifiable from a
/// single-GPU sweep at imbalance 1.0: they are kept at the published profile's values.
pub fn fit(
    sweep: &Sweep,
    encoder_layers: usize,
    decoder_layers: usize,
    swap_in_bytes_per_s: f64,
) -> Fit {
    // The active-expert terms need the model's expert count (old sweeps did not save it).
    let experts = (sweep.experts > 0 && sweep.top_k > 0 && sweep.top_k <= sweep.experts).then_some(
        ActiveExpertTerm {
            per_expert_ns: 0.0,
            experts: sweep.experts as u32,
            top_k: sweep.top_k as u32,
        },
    );
    let pf = fit_prefill(sweep, encoder_layers, decoder_layers, &experts);
    let (decode, dx, dy, dc) = fit_decode(sweep, experts);
    let mut gaps: Vec<f64> = sweep.decode.iter().map(|d| d.host_gap_ns).collect();
    Fit {
        prefill: pf.model,
        decode,
        prefill_residuals: residuals(&pf.x, &pf.y, &pf.c),
        decode_residuals: residuals(&dx, &dy, &dc),
        swap_in_bytes_per_s,
        sync_gap_ns: median(&mut gaps),
    }
}

/// Header facts written into the profile.
#[derive(Debug, Clone)]
pub struct ProfileHeader {
    pub name: String,
    pub gpu: String,
    pub driver: String,
    pub date: String,
    pub commit: String,
    pub model: String,
    /// Extra comment lines (how the profile was made, beyond a plain calibration).
    pub notes: Vec<String>,
}

/// The comment lines on where the profile comes from and what the fit keeps fixed.
fn push_provenance(s: &mut String, h: &ProfileHeader) {
    s.push_str(&format!(
        "# Hardware profile measured on {} (driver {}), {}, commit {}.\n",
        h.gpu, h.driver, h.date, h.commit
    ));
    s.push_str(
        "# Written by `servelab-gpu calibrate`: step plans executed by servelab-hw's CudaBackend\n",
    );
    s.push_str(&format!(
        "# on the scaled-down SPEC §1 model ({}),\n",
        h.model
    ));
    s.push_str(
        "# timed with CUDA events, fitted by weighted non-negative least squares (weights 1/t).\n",
    );
    s.push_str("# One GPU, imbalance 1.0: moe_share is the published profile's 0.6 (not identifiable here),\n");
    s.push_str(
        "# reference_imbalance 1.0; dynamic_overhead_ns 0 (the backend has no split kernel).\n#\n",
    );
    for line in &h.notes {
        s.push_str(&format!("# {line}\n"));
    }
    if !h.notes.is_empty() {
        s.push_str("#\n");
    }
}

/// The prefill model's form and the grid's measured and fitted times, as comments.
fn push_prefill_residuals(s: &mut String, fit: &Fit, sweep: &Sweep) {
    s.push_str("# PREFILL  t = base + sum over chunks L_enc(a n + b ramp(N) n (p + n/2)) + L_dec(a r + b r^2/2 + x r (p + n))\n");
    s.push_str("#              + c_exp (L_enc A(N) + L_dec A(R)),\n");
    s.push_str(&format!(
        "#          N = the step's new tokens, R its replayed tokens, ramp(N) = min(1, N / {:.0}) (1 if 0),\n",
        fit.prefill.attention_ramp_tokens
    ));
    s.push_str(
        "#          A(N) = E (1 - (1 - k/E)^N) the experts N tokens activate (c_exp per layer)\n",
    );
    s.push_str("#   n      p      r    measured ms  fitted ms  error\n");
    for (pt, (y, f)) in sweep.prefill.iter().zip(&fit.prefill_residuals) {
        s.push_str(&format!(
            "# {:6} {:6} {:4} {:12.3} {:10.3} {:+6.1}%\n",
            pt.new_tokens,
            pt.prefix_tokens,
            pt.decoder_tokens,
            y / 1e6,
            f / 1e6,
            100.0 * (f / y - 1.0)
        ));
    }
}

/// The decode model's form and the grid's measured and fitted times, as comments.
fn push_decode_residuals(s: &mut String, fit: &Fit, sweep: &Sweep) {
    s.push_str("#\n# DECODE  t = base + c_seq B + c_kv sum(KV) + c_maxkv max(KV) + c_tok N + c_sq N^2 + c_exp E (1 - (1 - k/E)^N)\n");
    s.push_str("#   B     KV  q    measured ms  fitted ms  error\n");
    for (pt, (y, f)) in sweep.decode.iter().zip(&fit.decode_residuals) {
        s.push_str(&format!(
            "# {:3} {:6} {:2} {:12.3} {:10.3} {:+6.1}%\n",
            pt.batch,
            pt.kv_tokens,
            pt.query_tokens,
            y / 1e6,
            f / 1e6,
            100.0 * (f / y - 1.0)
        ));
    }
}

/// Median and max |relative error| of (measured, fitted) pairs.
fn relative_errors(v: &[(f64, f64)]) -> (f64, f64) {
    let mut e: Vec<f64> = v.iter().map(|(y, f)| (f / y - 1.0).abs()).collect();
    let mx = e.iter().cloned().fold(0.0, f64::max);
    (median(&mut e), mx)
}

/// The error summary comments: on the grid, then on the calibration workload's steps (the
/// residuals after the grid's) when one ran.
fn push_error_summary(s: &mut String, fit: &Fit, sweep: &Sweep) {
    let (ng_p, ng_d) = (sweep.prefill.len(), sweep.decode.len());
    let (pg, pw) = fit
        .prefill_residuals
        .split_at(ng_p.min(fit.prefill_residuals.len()));
    let (dg, dw) = fit
        .decode_residuals
        .split_at(ng_d.min(fit.decode_residuals.len()));
    let (pm, px) = relative_errors(pg);
    let (dm, dx) = relative_errors(dg);
    s.push_str(&format!(
        "#\n# |relative error| on the grid: prefill median {:.1}% max {:.1}%; decode median {:.1}% max {:.1}%\n",
        pm * 100.0,
        px * 100.0,
        dm * 100.0,
        dx * 100.0
    ));
    if let Some(seed) = sweep.workload_seed {
        let (wpm, wpx) = relative_errors(pw);
        let (wdm, wdx) = relative_errors(dw);
        s.push_str(&format!(
            "# calibration workload (the conformance config under seed {seed}, fitted with the grid): {} prefill steps, |error| median {:.1}% max {:.1}%; {} decode steps, median {:.1}% max {:.1}%\n",
            pw.len(),
            wpm * 100.0,
            wpx * 100.0,
            dw.len(),
            wdm * 100.0,
            wdx * 100.0
        ));
    }
}

/// The `[prefill]`, `[decode]` and `[transfer]` sections (and their active-expert tables).
fn push_sections(s: &mut String, fit: &Fit) {
    let p = &fit.prefill;
    s.push_str(&format!(
        "[prefill]\nbase_ns = {:.1}\nper_layer_token_ns = {:.6}\nper_layer_token_ctx_ns = {:.9}\nattention_ramp_tokens = {:.1}\nper_layer_replay_ctx_ns = {:.9}\nmoe_share = {}\nreference_imbalance = {}\n\n",
        p.base_ns, p.per_layer_token_ns, p.per_layer_token_ctx_ns, p.attention_ramp_tokens, p.per_layer_replay_ctx_ns, p.moe_share, p.reference_imbalance
    ));
    if let Some(a) = &p.active_experts {
        s.push_str(&format!(
            "[prefill.active_experts]\nper_expert_ns = {:.1}\nexperts = {}\ntop_k = {}\n\n",
            a.per_expert_ns, a.experts, a.top_k
        ));
    }
    let d = &fit.decode;
    s.push_str(&format!(
        "[decode]\nbase_ns = {:.1}\nper_seq_ns = {:.3}\nper_kv_token_ns = {:.6}\nper_max_kv_token_ns = {:.6}\nper_token_ns = {:.3}\nper_token_sq_ns = {:.6}\ndynamic_overhead_ns = {:.1}\nmoe_share = {}\nreference_imbalance = {}\n\n",
        d.base_ns, d.per_seq_ns, d.per_kv_token_ns, d.per_max_kv_token_ns, d.per_token_ns, d.per_token_sq_ns, d.dynamic_overhead_ns, d.moe_share, d.reference_imbalance
    ));
    if let Some(a) = &d.active_experts {
        s.push_str(&format!(
            "[decode.active_experts]\nper_expert_ns = {:.1}\nexperts = {}\ntop_k = {}\n\n",
            a.per_expert_ns, a.experts, a.top_k
        ));
    }
    s.push_str(&format!(
        "[transfer]\nswap_in_bytes_per_s = {:.4e}\nsync_gap = \"{}us\"\n",
        fit.swap_in_bytes_per_s,
        (fit.sync_gap_ns / 1e3).round() as u64
    ));
}

/// The profile text: comments (provenance, fit, residuals), then the sections the simulator's
/// `HardwareProfile` reads.
pub fn profile_toml(fit: &Fit, sweep: &Sweep, h: &ProfileHeader) -> String {
    let mut s = String::new();
    push_provenance(&mut s, h);
    push_prefill_residuals(&mut s, fit, sweep);
    push_decode_residuals(&mut s, fit, sweep);
    push_error_summary(&mut s, fit, sweep);
    s.push_str("# transfer: swap_in_bytes_per_s = the gather kernel over mapped pinned memory;\n");
    s.push_str("# sync_gap = median host time of a decode step outside its event-timed span.\n");
    s.push_str(&format!("name = \"{}\"\n", h.name));
    s.push_str(&format!(
        "description = \"Measured on {} with the servelab-hw CudaBackend ({}); see comments\"\n\n",
        h.gpu, h.date
    ));
    push_sections(&mut s, fit);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nonneg_fit_recovers_exact_coefficients() {
        // y = 5 + 2 x1 + 0.5 x2, no noise
        let x: Vec<Vec<f64>> = (1..8)
            .map(|i| vec![1.0, i as f64, (i * i) as f64])
            .collect();
        let y: Vec<f64> = x.iter().map(|r| 5.0 + 2.0 * r[1] + 0.5 * r[2]).collect();
        let c = fit_nonneg(&x, &y);
        for (got, want) in c.iter().zip([5.0, 2.0, 0.5]) {
            assert!((got - want).abs() < 1e-6, "{c:?}");
        }
    }

    #[test]
    fn negative_coefficients_are_pinned_at_zero() {
        // y = 10 + 3 x1 exactly; x2 is noise that would get a negative weight if free
        let x: Vec<Vec<f64>> = (1..10)
            .map(|i| vec![1.0, i as f64, if i % 2 == 0 { 1.0 } else { 0.0 }])
            .collect();
        let y: Vec<f64> = x.iter().map(|r| 10.0 + 3.0 * r[1] - 0.5 * r[2]).collect();
        let c = fit_nonneg(&x, &y);
        assert_eq!(c[2], 0.0);
        assert!(c.iter().all(|v| *v >= 0.0));
    }

    /// Points generated by the cost model itself (one chunk per step, 20 + 20 layers): the fit
    /// finds the ramp among the swept sizes and recovers every coefficient.
    #[test]
    fn prefill_fit_recovers_ramp_and_replay_cross_attention() {
        let truth = PrefillCostModel {
            base_ns: 15e6,
            per_layer_token_ns: 500.0,
            per_layer_token_ctx_ns: 0.8,
            moe_share: 0.6,
            reference_imbalance: 1.0,
            attention_ramp_tokens: 1024.0,
            per_layer_replay_ctx_ns: 0.25,
            active_experts: None,
        };
        let mut prefill = Vec::new();
        for n in [128u32, 512, 1024, 2048, 4096] {
            for (p, r) in [(0u32, 140u32), (2048, 140), (8192, 140), (8192, 0)] {
                let c = PrefillChunk {
                    request: RequestId(0),
                    new_tokens: n,
                    prefix_tokens: p,
                    new_token_layers: 20,
                    decoder_tokens: r,
                    decoder_layers: 20,
                    swap_in_bytes: 0,
                };
                prefill.push(PrefillPoint {
                    new_tokens: n as usize,
                    prefix_tokens: p as usize,
                    decoder_tokens: r as usize,
                    durations_ns: vec![],
                    median_ns: truth.step_ns(&[c], 1.0),
                });
            }
        }
        let f = fit(
            &Sweep {
                prefill,
                decode: vec![],
                experts: 0,
                top_k: 0,
                workload_seed: None,
                workload: vec![],
            },
            20,
            20,
            5e10,
        );
        let p = &f.prefill;
        assert_eq!(p.attention_ramp_tokens, 1024.0);
        for (got, want) in [
            (p.base_ns, truth.base_ns),
            (p.per_layer_token_ns, truth.per_layer_token_ns),
            (p.per_layer_token_ctx_ns, truth.per_layer_token_ctx_ns),
            (p.per_layer_replay_ctx_ns, truth.per_layer_replay_ctx_ns),
        ] {
            assert!((got / want - 1.0).abs() < 1e-6, "{p:?}");
        }
    }

    #[test]
    fn profile_text_has_every_section_and_parses() {
        let sweep = Sweep {
            prefill: vec![PrefillPoint {
                new_tokens: 512,
                prefix_tokens: 0,
                decoder_tokens: 140,
                durations_ns: vec![1_000_000],
                median_ns: 1e6,
            }],
            decode: vec![DecodePoint {
                batch: 1,
                kv_tokens: 1024,
                query_tokens: 1,
                durations_ns: vec![500_000],
                median_ns: 5e5,
                host_gap_ns: 1e5,
            }],
            experts: 8,
            top_k: 2,
            workload_seed: Some(3),
            workload: vec![],
        };
        let f = fit(&sweep, 20, 20, 5e10);
        let text = profile_toml(
            &f,
            &sweep,
            &ProfileHeader {
                name: "t".into(),
                gpu: "g".into(),
                driver: "d".into(),
                date: "x".into(),
                commit: "c".into(),
                model: "m".into(),
                notes: vec!["refitted".into()],
            },
        );
        let v: toml::Value = toml::from_str(&text).unwrap();
        for k in ["prefill", "decode", "transfer"] {
            assert!(v.get(k).is_some(), "{k}");
        }
        let p: PrefillCostModel = v["prefill"].clone().try_into().unwrap();
        p.validate("prefill").unwrap();
        let d: DecodeTimeModel = v["decode"].clone().try_into().unwrap();
        d.validate("decode").unwrap();
        assert_eq!(d.active_experts.map(|a| (a.experts, a.top_k)), Some((8, 2)));
        assert!(text.contains("calibration workload"), "{text}");
    }

    /// Decode grid points and workload steps (two-chunk prefill, dynamic decode) generated by
    /// the cost models themselves: the fit recovers the active-expert term and the prefill
    /// coefficients from the mixture, and every point is predicted exactly.
    #[test]
    fn fit_recovers_active_experts_from_grid_and_workload_steps() {
        use servelab_core::engine::plan::SeqOutcome;
        let dtruth = DecodeTimeModel {
            base_ns: 10e6,
            per_seq_ns: 0.0,
            per_kv_token_ns: 15.0,
            per_token_ns: 30_000.0,
            per_token_sq_ns: 0.0,
            dynamic_overhead_ns: 0.0,
            moe_share: 0.6,
            reference_imbalance: 1.0,
            per_max_kv_token_ns: 0.0,
            active_experts: Some(ActiveExpertTerm {
                per_expert_ns: 700_000.0,
                experts: 8,
                top_k: 2,
            }),
        };
        let ptruth = PrefillCostModel {
            base_ns: 12e6,
            per_layer_token_ns: 800.0,
            per_layer_token_ctx_ns: 0.05,
            moe_share: 0.6,
            reference_imbalance: 1.0,
            attention_ramp_tokens: 0.0,
            per_layer_replay_ctx_ns: 0.5,
            active_experts: Some(ActiveExpertTerm {
                per_expert_ns: 300_000.0,
                experts: 8,
                top_k: 2,
            }),
        };
        let mut decode = Vec::new();
        for b in [1usize, 2, 4, 8, 16] {
            for kv in [1024usize, 8192] {
                for q in [1usize, 3, 6] {
                    let n = (b * q) as u32;
                    decode.push(DecodePoint {
                        batch: b,
                        kv_tokens: kv,
                        query_tokens: q,
                        durations_ns: vec![],
                        median_ns: dtruth.predict_ns(b as u32, (b * kv) as u64, n, false, 1.0),
                        host_gap_ns: 0.0,
                    });
                }
            }
        }
        let chunk = |req: u64, n: u32, p: u32, r: u32| PrefillChunk {
            request: RequestId(req),
            new_tokens: n,
            prefix_tokens: p,
            new_token_layers: 20,
            decoder_tokens: r,
            decoder_layers: 20,
            swap_in_bytes: 0,
        };
        let mut workload = Vec::new();
        // Two-chunk steps, then chunks of a few tokens without replay, which touch only some
        // experts: they set the expert term apart from the base.
        for (i, (n1, p1, n2, p2)) in [
            (300u32, 2000u32, 700u32, 0u32),
            (150, 4000, 200, 3000),
            (2000, 0, 100, 6000),
            (900, 1500, 400, 2500),
            (64, 8000, 1000, 0),
            (500, 500, 500, 500),
            (2, 1000, 1, 3000),
            (4, 500, 2, 100),
        ]
        .into_iter()
        .enumerate()
        {
            let replay = if n1 > 8 { 140 } else { 0 };
            let chunks = vec![
                chunk(2 * i as u64, n1, p1, replay),
                chunk(2 * i as u64 + 1, n2, p2, 0),
            ];
            let t = ptruth.step_ns(&chunks, 1.0);
            workload.push(RecordedStep {
                start_ns: 0,
                end_ns: 0,
                duration_ns: t.round() as u64,
                device: None,
                queued_ns: 0,
                plan: StepPlan::Prefill(PrefillPlan {
                    engine: EngineId(0),
                    chunks,
                    expert_imbalance: 1.0,
                }),
                seqs: vec![],
                ranks: vec![],
            });
        }
        for (b, v) in [(3u32, 2u8), (5, 1), (7, 4)] {
            let seqs: Vec<DecodeSeq> = (0..b)
                .map(|i| DecodeSeq {
                    request: RequestId(u64::from(i)),
                    kv_tokens: 2000 + 100 * i,
                    max_drafts: 5,
                    slot: i,
                })
                .collect();
            let kv: u64 = seqs.iter().map(|s| u64::from(s.kv_tokens)).sum();
            let t = dtruth.predict_ns(b, kv, b * (1 + u32::from(v)), true, 1.0);
            workload.push(RecordedStep {
                start_ns: 0,
                end_ns: 0,
                duration_ns: t.round() as u64,
                device: None,
                queued_ns: 0,
                plan: StepPlan::Decode(DecodePlan {
                    engine: EngineId(1),
                    ranks: vec![DecodeRankPlan {
                        seq_start: 0,
                        seq_end: b,
                        verify_budget: b * u32::from(v),
                    }],
                    seqs,
                    dynamic: true,
                    expert_imbalance: 1.0,
                }),
                seqs: vec![
                    SeqOutcome {
                        verified: v,
                        accepted: 0
                    };
                    b as usize
                ],
                ranks: vec![],
            });
        }
        let sweep = Sweep {
            prefill: vec![],
            decode,
            experts: 8,
            top_k: 2,
            workload_seed: Some(1),
            workload,
        };
        let f = fit(&sweep, 20, 20, 5e10);
        let a = f.decode.active_experts.as_ref().unwrap();
        assert!((a.per_expert_ns / 700_000.0 - 1.0).abs() < 1e-3, "{a:?}");
        assert!(
            (f.decode.base_ns / 10e6 - 1.0).abs() < 1e-3,
            "{:?}",
            f.decode
        );
        assert!(
            (f.prefill.per_layer_replay_ctx_ns / 0.5 - 1.0).abs() < 1e-3,
            "{:?}",
            f.prefill
        );
        let pa = f.prefill.active_experts.as_ref().unwrap();
        assert!((pa.per_expert_ns / 300_000.0 - 1.0).abs() < 1e-3, "{pa:?}");
        assert!(
            (f.prefill.base_ns / 12e6 - 1.0).abs() < 1e-3,
            "{:?}",
            f.prefill
        );
        assert_eq!(f.decode_residuals.len(), 30 + 3);
        assert_eq!(f.prefill_residuals.len(), 8);
        for (y, p) in f.decode_residuals.iter().chain(&f.prefill_residuals) {
            assert!((p / y - 1.0).abs() < 1e-3, "{y} vs {p}");
        }
    }
}
