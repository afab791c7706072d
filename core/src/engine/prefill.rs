//! The prefill engine (one DP rank) and its chunk scheduler (SPEC §6).
//!
//! The scheduler predicts a step's time with a fitted quadratic model — linear in the new tokens,
//! plus attention to the prefix already computed — and fills each step with the largest chunks
//! that fit both a token budget (32,768) and a time budget. The simpler alternative cuts
//! fixed-size chunks by token count alone.

use crate::engine::dspark::ActiveExpertTerm;
use crate::engine::plan::{PrefillChunk, PrefillPlan};
use crate::error::ConfigError;
use crate::ids::{EngineId, RequestId};
use crate::time::Nanos;
use serde::{Deserialize, Serialize};
use std::cell::Cell;
use std::collections::VecDeque;

/// Predicted prefill step time: `base + Σ L_enc·(a·n + b·ramp(n)·n·(p + n/2)) + L_dec·(a·r +
/// b·r²/2 + x·r·(p + n))` over the chunks, the token terms scaled by the expert imbalance on
/// their MoE share. `ramp(n) = min(1, N / attention_ramp_tokens)` (1 when that is 0), N the
/// step's new tokens: an attention kernel run once over the step's query rows whose cost per
/// query–key pair grows with the rows until it saturates (it splits the KV across more blocks
/// for fewer rows; measured on the H200 backend, 512-row steps pay a quarter of the per-pair
/// cost of 2,048-row ones). `x` is the decoder replay's cross-attention, which reads the whole
/// context, not only the replayed segment. Both extra terms default to 0 (the published form).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrefillCostModel {
    pub base_ns: f64,
    /// Per token per layer (projections, MoE).
    pub per_layer_token_ns: f64,
    /// Per token per layer per token of context it attends to.
    pub per_layer_token_ctx_ns: f64,
    pub moe_share: f64,
    /// Imbalance the profile was measured at (SPEC §9: 1.074 at EP4/DP4).
    pub reference_imbalance: f64,
    /// Chunk size (new tokens) from which the encoder attention pays its full per-pair cost;
    /// smaller chunks pay `n / attention_ramp_tokens` of it. 0: every chunk pays the full cost.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub attention_ramp_tokens: f64,
    /// Decoder replay cross-attention: per layer, per replayed token, per context token
    /// (prefix + new) it reads. 0: the replay attends only inside the replayed segment.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub per_layer_replay_ctx_ns: f64,
    /// Cost per layer per distinct expert the step's tokens route to (absent: none): each
    /// layer stack reads the weights of every expert its rows activate, once per step, however
    /// many rows it has. Small steps of a model with large experts are bound by these reads
    /// (on the H200 backend's wide conformance model a 128-token chunk pays more for them than
    /// for its arithmetic). `per_expert_ns` is per layer here, unlike the decode model's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_experts: Option<ActiveExpertTerm>,
}

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

impl PrefillCostModel {
    /// Compute of one chunk, without the step's base cost, as if it were alone in its step.
    pub fn chunk_ns(&self, c: &PrefillChunk, imbalance: f64) -> f64 {
        self.chunk_in_step_ns(c, c.new_tokens, imbalance)
    }

    /// Compute of one chunk in a step of `step_new_tokens` new tokens: the attention kernel
    /// runs once over every query row of the step, so the ramp follows the step's rows.
    pub fn chunk_in_step_ns(&self, c: &PrefillChunk, step_new_tokens: u32, imbalance: f64) -> f64 {
        let n = f64::from(c.new_tokens);
        let p = f64::from(c.prefix_tokens);
        let r = f64::from(c.decoder_tokens);
        let ramp = if self.attention_ramp_tokens > 0.0 {
            (f64::from(step_new_tokens) / self.attention_ramp_tokens).min(1.0)
        } else {
            1.0
        };
        let enc = f64::from(c.new_token_layers)
            * (self.per_layer_token_ns * n
                + self.per_layer_token_ctx_ns * ramp * n * (p + n / 2.0));
        // The decoder replay's self-attention stays inside the replayed segment (bounded
        // replay); its cross-attention reads the whole context.
        let dec = f64::from(c.decoder_layers)
            * (self.per_layer_token_ns * r
                + self.per_layer_token_ctx_ns * r * r / 2.0
                + self.per_layer_replay_ctx_ns * r * (p + n));
        let scale = 1.0 - self.moe_share + self.moe_share * imbalance / self.reference_imbalance;
        (enc + dec) * scale
    }

    pub fn step_ns(&self, chunks: &[PrefillChunk], imbalance: f64) -> f64 {
        if chunks.is_empty() {
            return 0.0;
        }
        let rows = chunks.iter().map(|c| c.new_tokens).sum();
        self.base_ns
            + chunks
                .iter()
                .map(|c| self.chunk_in_step_ns(c, rows, imbalance))
                .sum::<f64>()
            + self.expert_reads_ns(chunks)
    }

    /// The step's expert weight reads ([`Self::active_experts`]): the encoder layers run once
    /// over all new tokens of the step, the decoder layers once over all replayed tokens.
    pub fn expert_reads_ns(&self, chunks: &[PrefillChunk]) -> f64 {
        self.active_experts
            .as_ref()
            .map_or(0.0, |a| a.per_expert_ns * a.prefill_layer_reads(chunks))
    }

    /// An upper bound of [`Self::expert_reads_ns`] for a step whose stacks have `layers` layers
    /// in all: every expert of every layer. The chunk scheduler budgets it up front, as the
    /// base, since a step of more than a few tokens activates every expert anyway.
    pub fn expert_reads_bound_ns(&self, layers: u32) -> f64 {
        self.active_experts.as_ref().map_or(0.0, |a| {
            a.per_expert_ns * f64::from(a.experts) * f64::from(layers)
        })
    }

    pub fn validate(&self, field: &str) -> Result<(), ConfigError> {
        for (name, v) in [
            ("base_ns", self.base_ns),
            ("per_layer_token_ns", self.per_layer_token_ns),
            ("per_layer_token_ctx_ns", self.per_layer_token_ctx_ns),
            ("attention_ramp_tokens", self.attention_ramp_tokens),
            ("per_layer_replay_ctx_ns", self.per_layer_replay_ctx_ns),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(ConfigError::invalid(
                    format!("{field}.{name}"),
                    format!("{v} must be a finite non-negative number"),
                ));
            }
        }
        if self.per_layer_token_ns <= 0.0 {
            return Err(ConfigError::invalid(
                format!("{field}.per_layer_token_ns"),
                "must be positive",
            ));
        }
        if let Some(a) = &self.active_experts {
            a.validate(&format!("{field}.active_experts"))?;
        }
        super::validate_moe(field, self.moe_share, self.reference_imbalance)
    }
}

impl ActiveExpertTerm {
    /// Expert weight reads of a prefill step, in (layer × expert) units: the encoder layers
    /// once over all new tokens of the step, the decoder layers once over all replayed tokens.
    /// [`PrefillCostModel::expert_reads_ns`] prices them; calibration fits the price.
    pub fn prefill_layer_reads(&self, chunks: &[PrefillChunk]) -> f64 {
        let (mut new, mut replay, mut enc, mut dec) = (0u32, 0u32, 0u32, 0u32);
        for c in chunks {
            new += c.new_tokens;
            replay += c.decoder_tokens;
            if c.new_tokens > 0 {
                enc = enc.max(c.new_token_layers);
            }
            if c.decoder_tokens > 0 {
                dec = dec.max(c.decoder_layers);
            }
        }
        f64::from(enc) * self.expected_active(new) + f64::from(dec) * self.expected_active(replay)
    }
}

/// How a prefill step is cut into chunks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum ChunkPolicy {
    /// DeepInfer: largest chunks within `token_budget` whose predicted step time stays within
    /// `time_budget`. A step that cannot fit even `min_chunk_tokens` of its first request
    /// takes that much anyway, so every step makes progress.
    TimeBudgeted {
        token_budget: u32,
        time_budget: Nanos,
        min_chunk_tokens: u32,
    },
    /// Token count only: up to `chunk_tokens` per step, whatever the prefixes cost.
    FixedSize { chunk_tokens: u32 },
}

impl ChunkPolicy {
    pub fn validate(&self) -> Result<(), ConfigError> {
        match self {
            ChunkPolicy::TimeBudgeted {
                token_budget,
                time_budget,
                min_chunk_tokens,
            } => {
                if *token_budget == 0 {
                    return Err(ConfigError::invalid(
                        "chunking.token_budget",
                        "must be positive",
                    ));
                }
                if *time_budget == Nanos::ZERO {
                    return Err(ConfigError::invalid(
                        "chunking.time_budget",
                        "must be positive",
                    ));
                }
                if *min_chunk_tokens == 0 || min_chunk_tokens > token_budget {
                    return Err(ConfigError::invalid(
                        "chunking.min_chunk_tokens",
                        "must lie in [1, token_budget]",
                    ));
                }
                Ok(())
            }
            ChunkPolicy::FixedSize { chunk_tokens: 0 } => Err(ConfigError::invalid(
                "chunking.chunk_tokens",
                "must be positive",
            )),
            ChunkPolicy::FixedSize { .. } => Ok(()),
        }
    }
}

/// One request's prefill work on an engine.
#[derive(Clone, Debug, PartialEq)]
pub struct PrefillJob {
    pub request: RequestId,
    pub prompt_tokens: u32,
    /// Reused prefix (its KV is fetched and swapped in).
    pub hit_tokens: u32,
    /// Tokens through the encoder: `prompt − hit`, including any encoder-side replay.
    pub encoder_tokens: u32,
    pub new_token_layers: u32,
    pub decoder_tokens: u32,
    pub decoder_layers: u32,
    pub swap_in_bytes: u64,
    /// KV fetched into host memory (and SWA state pulled): the job may be scheduled.
    pub ready: bool,
    pub done_tokens: u32,
    pub first_step_at: Option<Nanos>,
}

impl PrefillJob {
    fn remaining(&self) -> u32 {
        self.encoder_tokens - self.done_tokens
    }
    fn chunk(&self, n: u32) -> PrefillChunk {
        let last = n == self.remaining();
        PrefillChunk {
            request: self.request,
            new_tokens: n,
            prefix_tokens: self.prompt_tokens - self.encoder_tokens + self.done_tokens,
            new_token_layers: self.new_token_layers,
            decoder_tokens: if last { self.decoder_tokens } else { 0 },
            decoder_layers: self.decoder_layers,
            swap_in_bytes: if self.done_tokens == 0 {
                self.swap_in_bytes
            } else {
                0
            },
        }
    }
}

/// One prefill engine: a FIFO of jobs, one step at a time.
#[derive(Clone, Debug)]
pub struct PrefillEngine {
    id: EngineId,
    policy: ChunkPolicy,
    model: PrefillCostModel,
    imbalance: f64,
    max_jobs: usize,
    queue: VecDeque<PrefillJob>,
    busy: bool,
    /// [`Self::remaining_ns`] as last computed; cleared by every change to the queue. A pull
    /// balancer asks every engine for it on every pull, far more often than queues change.
    remaining_cache: Cell<Option<f64>>,
}

impl PrefillEngine {
    pub fn new(
        id: EngineId,
        policy: ChunkPolicy,
        model: PrefillCostModel,
        imbalance: f64,
        max_jobs: usize,
    ) -> Self {
        PrefillEngine {
            id,
            policy,
            model,
            imbalance,
            max_jobs,
            queue: VecDeque::new(),
            busy: false,
            remaining_cache: Cell::new(None),
        }
    }
    pub fn id(&self) -> EngineId {
        self.id
    }
    pub fn busy(&self) -> bool {
        self.busy
    }
    pub fn jobs(&self) -> usize {
        self.queue.len()
    }
    pub fn has_room(&self) -> bool {
        self.queue.len() < self.max_jobs
    }

    /// Predicted compute still queued here (each job as one chunk, without step bases): what a
    /// pull balancer compares with the engine's quota.
    pub fn remaining_ns(&self) -> f64 {
        if let Some(ns) = self.remaining_cache.get() {
            return ns;
        }
        let ns = self
            .queue
            .iter()
            .map(|j| self.model.chunk_ns(&j.chunk(j.remaining()), self.imbalance))
            .sum();
        self.remaining_cache.set(Some(ns));
        ns
    }

    /// Predicted compute of a whole job on an idle engine.
    pub fn job_ns(model: &PrefillCostModel, job: &PrefillJob, imbalance: f64) -> f64 {
        model.chunk_ns(&job.chunk(job.remaining()), imbalance)
    }

    /// Adds a job; a full engine hands it back.
    pub fn enqueue(&mut self, job: PrefillJob) -> Result<(), PrefillJob> {
        if !self.has_room() {
            return Err(job);
        }
        self.queue.push_back(job);
        self.remaining_cache.set(None);
        Ok(())
    }

    /// The engine failed: takes every job it holds (running or queued) into `out`, each reset
    /// to start over (no tokens done, its prefix to fetch again), and forgets its step.
    pub fn take_jobs(&mut self, out: &mut Vec<PrefillJob>) {
        self.busy = false;
        self.remaining_cache.set(None);
        for mut j in self.queue.drain(..) {
            j.done_tokens = 0;
            j.first_step_at = None;
            out.push(j);
        }
    }

    /// Marks a job's KV as fetched. Returns false if the engine does not hold it.
    pub fn set_ready(&mut self, request: RequestId) -> bool {
        self.remaining_cache.set(None);
        match self.queue.iter_mut().find(|j| j.request == request) {
            Some(j) => {
                j.ready = true;
                true
            }
            None => false,
        }
    }

    /// Plans the next step into `plan` (cleared first). Returns false when nothing is ready or
    /// a step is already running.
    pub fn plan_step(&mut self, now: Nanos, plan: &mut PrefillPlan) -> bool {
        plan.engine = self.id;
        plan.chunks.clear();
        plan.expert_imbalance = self.imbalance;
        self.remaining_cache.set(None);
        if self.busy {
            return false;
        }
        match self.policy.clone() {
            ChunkPolicy::FixedSize { chunk_tokens } => self.plan_fixed(chunk_tokens, plan),
            ChunkPolicy::TimeBudgeted {
                token_budget,
                time_budget,
                min_chunk_tokens,
            } => self.plan_time_budgeted(token_budget, time_budget, min_chunk_tokens, plan),
        }
        if plan.chunks.is_empty() {
            return false;
        }
        for c in &plan.chunks {
            if let Some(j) = self.queue.iter_mut().find(|j| j.request == c.request) {
                j.first_step_at.get_or_insert(now);
            }
        }
        self.busy = true;
        true
    }

    /// Ready jobs in queue order, each as much as fits in `chunk_tokens` tokens in all.
    fn plan_fixed(&self, chunk_tokens: u32, plan: &mut PrefillPlan) {
        let mut left = chunk_tokens;
        for j in self.queue.iter().filter(|j| j.ready) {
            if left == 0 {
                break;
            }
            let n = j.remaining().min(left);
            plan.chunks.push(j.chunk(n));
            left -= n;
        }
    }

    /// Ready jobs in queue order, each chunk as long as the predicted step stays within
    /// `time_budget` and `token_budget` tokens; the first chunk has at least
    /// `min_chunk_tokens` (or all its job has left).
    fn plan_time_budgeted(
        &self,
        token_budget: u32,
        time_budget: Nanos,
        min_chunk_tokens: u32,
        plan: &mut PrefillPlan,
    ) {
        let limit = time_budget.0 as f64;
        let mut left = token_budget;
        let mut used = self.model.base_ns;
        if let Some(j) = self.queue.iter().find(|j| j.ready) {
            used += self
                .model
                .expert_reads_bound_ns(j.new_token_layers + j.decoder_layers);
        }
        for j in self.queue.iter().filter(|j| j.ready) {
            if left == 0 {
                break;
            }
            let cap = j.remaining().min(left);
            let cost = |n: u32| self.model.chunk_ns(&j.chunk(n), self.imbalance);
            let n = largest_within(cap, |n| used + cost(n) <= limit);
            let n = if plan.chunks.is_empty() {
                n.max(min_chunk_tokens.min(cap))
            } else {
                n
            };
            if n == 0 {
                break;
            }
            used += cost(n);
            plan.chunks.push(j.chunk(n));
            left -= n;
        }
    }

    /// Applies a finished step: advances each chunk's job and moves completed jobs to `done`.
    pub fn complete_step(&mut self, plan: &PrefillPlan, done: &mut Vec<PrefillJob>) {
        self.busy = false;
        self.remaining_cache.set(None);
        for c in &plan.chunks {
            if let Some(j) = self.queue.iter_mut().find(|j| j.request == c.request) {
                j.done_tokens += c.new_tokens;
            }
        }
        let mut i = 0;
        while i < self.queue.len() {
            if self.queue[i].remaining() == 0 {
                done.extend(self.queue.remove(i));
            } else {
                i += 1;
            }
        }
    }
}

/// The largest n in [1, cap] for which `fits(n)` holds, 0 when none does; `fits` must hold
/// for every n below one it holds for (a cost that grows with n under a limit).
fn largest_within(cap: u32, fits: impl Fn(u32) -> bool) -> u32 {
    if fits(cap) {
        cap
    } else if !fits(1) {
        0
    } else {
        let (mut lo, mut hi) = (1, cap);
        while lo < hi {
            let mid = lo + (hi - lo).div_ceil(2);
            if fits(mid) {
                lo = mid;
            } else {
                hi = mid - 1;
            }
        }
        lo
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> PrefillCostModel {
        PrefillCostModel {
            base_ns: 1000.0,
            per_layer_token_ns: 1.0,
            per_layer_token_ctx_ns: 0.0,
            moe_share: 0.0,
            reference_imbalance: 1.0,
            attention_ramp_tokens: 0.0,
            per_layer_replay_ctx_ns: 0.0,
            active_experts: None,
        }
    }
    fn job(id: u64, prompt: u32, hit: u32) -> PrefillJob {
        PrefillJob {
            request: RequestId(id),
            prompt_tokens: prompt,
            hit_tokens: hit,
            encoder_tokens: prompt - hit,
            new_token_layers: 1,
            decoder_tokens: 10,
            decoder_layers: 1,
            swap_in_bytes: 99,
            ready: true,
            done_tokens: 0,
            first_step_at: None,
        }
    }
    fn empty() -> PrefillPlan {
        PrefillPlan {
            engine: EngineId(0),
            chunks: vec![],
            expert_imbalance: 1.0,
        }
    }

    #[test]
    fn quadratic_cost_golden() {
        let m = PrefillCostModel {
            per_layer_token_ctx_ns: 0.5,
            ..model()
        };
        // n = 100, p = 1000, 2 layers: 2 × (100 + 0.5 × 100 × 1050) = 105,200; decoder 10 tokens
        // × 1 layer: 10 + 0.5 × 50 = 35.
        let c = PrefillChunk {
            request: RequestId(0),
            new_tokens: 100,
            prefix_tokens: 1000,
            new_token_layers: 2,
            decoder_tokens: 10,
            decoder_layers: 1,
            swap_in_bytes: 0,
        };
        assert_eq!(m.chunk_ns(&c, 1.0), 105_235.0);
        assert_eq!(m.step_ns(&[c], 1.0), 106_235.0);
    }

    #[test]
    fn ramp_and_replay_cross_attention_golden() {
        let m = PrefillCostModel {
            per_layer_token_ctx_ns: 0.5,
            attention_ramp_tokens: 400.0,
            per_layer_replay_ctx_ns: 0.25,
            ..model()
        };
        // n = 100 is a quarter of the ramp: 2 × (100 + 0.25 × 0.5 × 100 × 1050) = 26,450;
        // decoder 10 tokens × 1 layer: 10 + 0.5 × 50 + 0.25 × 10 × 1100 = 2,785.
        let mut c = PrefillChunk {
            request: RequestId(0),
            new_tokens: 100,
            prefix_tokens: 1000,
            new_token_layers: 2,
            decoder_tokens: 10,
            decoder_layers: 1,
            swap_in_bytes: 0,
        };
        assert_eq!(m.chunk_ns(&c, 1.0), 29_235.0);
        // past the ramp the full per-pair cost: 2 × (800 + 0.5 × 800 × 1400) = 1,121,600;
        // decoder 10 + 25 + 0.25 × 10 × 1800 = 4,535.
        c.new_tokens = 800;
        assert_eq!(m.chunk_ns(&c, 1.0), 1_126_135.0);
        // Two 100-token chunks share one attention launch of 200 rows: each pays half the
        // per-pair cost, 2 × (100 + 0.5 × 0.5 × 100 × 1050) + 2,785 = 55,485, plus the base.
        c.new_tokens = 100;
        let step = m.step_ns(&[c, c], 1.0);
        assert_eq!(step, 1_000.0 + 2.0 * 55_485.0);
    }

    #[test]
    fn extra_terms_default_to_the_published_form() {
        let text = "base_ns = 1000.0\nper_layer_token_ns = 1.0\nper_layer_token_ctx_ns = 0.5\n\
                    moe_share = 0.0\nreference_imbalance = 1.0\n";
        let m: PrefillCostModel = toml::from_str(text).unwrap();
        assert_eq!(m.attention_ramp_tokens, 0.0);
        assert_eq!(m.per_layer_replay_ctx_ns, 0.0);
        let back = toml::to_string(&m).unwrap();
        assert!(!back.contains("ramp") && !back.contains("replay"), "{back}");
        let bad = PrefillCostModel {
            attention_ramp_tokens: -1.0,
            ..model()
        };
        let e = bad.validate("prefill").unwrap_err().to_string();
        assert!(e.contains("prefill.attention_ramp_tokens"), "{e}");
    }

    #[test]
    fn expert_reads_golden() {
        let m = PrefillCostModel {
            active_experts: Some(ActiveExpertTerm {
                per_expert_ns: 100.0,
                experts: 8,
                top_k: 2,
            }),
            ..model()
        };
        let chunk = |new_tokens, decoder_tokens| PrefillChunk {
            request: RequestId(0),
            new_tokens,
            prefix_tokens: 500,
            new_token_layers: 2,
            decoder_tokens,
            decoder_layers: 3,
            swap_in_bytes: 0,
        };
        // Two chunks of one new token each (2 tokens miss an expert with (6/8)^2, so 3.5 are
        // active) through 2 encoder layers; one replays 2 tokens (3.5 experts) through 3
        // decoder layers: 100 x (2 x 3.5 + 3 x 3.5) = 1,750, once for the step.
        let (a, b) = (chunk(1, 0), chunk(1, 2));
        assert_eq!(m.expert_reads_ns(&[a, b]), 1750.0);
        assert_eq!(
            m.step_ns(&[a, b], 1.0) - model().step_ns(&[a, b], 1.0),
            1750.0
        );
        // No replay: the decoder layers read nothing.
        assert_eq!(m.expert_reads_ns(&[a]), 100.0 * 2.0 * 2.0);
        // Many tokens activate every expert: the bound.
        let big = chunk(4096, 140);
        assert!((m.expert_reads_ns(&[big]) - m.expert_reads_bound_ns(5)).abs() < 1e-6);
        assert_eq!(m.expert_reads_bound_ns(5), 100.0 * 8.0 * 5.0);
        assert_eq!(model().expert_reads_ns(&[big]), 0.0);
        // Read from TOML, written back only when present; bad values name the field.
        let text = "base_ns = 1000.0\nper_layer_token_ns = 1.0\nper_layer_token_ctx_ns = 0.5\n\
                    moe_share = 0.0\nreference_imbalance = 1.0\n\
                    [active_experts]\nper_expert_ns = 100.0\nexperts = 8\ntop_k = 2\n";
        let parsed: PrefillCostModel = toml::from_str(text).unwrap();
        assert_eq!(parsed.active_experts, m.active_experts);
        assert!(
            !toml::to_string(&model())
                .unwrap()
                .contains("active_experts")
        );
        let bad = PrefillCostModel {
            active_experts: Some(ActiveExpertTerm {
                per_expert_ns: 1.0,
                experts: 2,
                top_k: 3,
            }),
            ..model()
        };
        let e = bad.validate("prefill").unwrap_err().to_string();
        assert!(e.contains("prefill.active_experts.top_k"), "{e}");
    }

    #[test]
    fn time_budget_counts_the_expert_reads() {
        // As `time_budget_cuts_the_chunk`, with the expert reads budgeted up front
        // (1 ns x 8 experts x (1 + 1) layers = 16 ns): 500 - 16 = 484 tokens fit.
        let m = PrefillCostModel {
            active_experts: Some(ActiveExpertTerm {
                per_expert_ns: 1.0,
                experts: 8,
                top_k: 2,
            }),
            ..model()
        };
        let pol = ChunkPolicy::TimeBudgeted {
            token_budget: 32_768,
            time_budget: Nanos(1500),
            min_chunk_tokens: 1,
        };
        let mut e = PrefillEngine::new(EngineId(0), pol, m, 1.0, 8);
        e.enqueue(job(1, 2000, 1000)).unwrap();
        let mut p = empty();
        assert!(e.plan_step(Nanos(5), &mut p));
        assert_eq!(p.chunks[0].new_tokens, 484);
    }

    #[test]
    fn time_budget_cuts_the_chunk() {
        // Budget 1000 + 500 ns: 500 ns of tokens at 1 ns each, minus the replay of the last chunk.
        let pol = ChunkPolicy::TimeBudgeted {
            token_budget: 32_768,
            time_budget: Nanos(1500),
            min_chunk_tokens: 1,
        };
        let mut e = PrefillEngine::new(EngineId(0), pol, model(), 1.0, 8);
        e.enqueue(job(1, 2000, 1000)).unwrap();
        let mut p = empty();
        assert!(e.plan_step(Nanos(5), &mut p));
        assert_eq!(p.chunks.len(), 1);
        assert_eq!(p.chunks[0].new_tokens, 500);
        assert_eq!(p.chunks[0].prefix_tokens, 1000);
        assert_eq!(p.chunks[0].swap_in_bytes, 99);
        assert!(!e.plan_step(Nanos(5), &mut empty()), "busy");
        let mut done = vec![];
        e.complete_step(&p, &mut done);
        assert!(done.is_empty());
        assert!(e.plan_step(Nanos(9), &mut p));
        // 500 left: 500 + 10 replay = 510 > 500, so 499 tokens, no replay yet.
        assert_eq!(
            (p.chunks[0].new_tokens, p.chunks[0].decoder_tokens),
            (499, 0)
        );
        assert_eq!(p.chunks[0].swap_in_bytes, 0);
        e.complete_step(&p, &mut done);
        assert!(e.plan_step(Nanos(9), &mut p));
        assert_eq!(
            (p.chunks[0].new_tokens, p.chunks[0].decoder_tokens),
            (1, 10)
        );
        e.complete_step(&p, &mut done);
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].first_step_at, Some(Nanos(5)));
    }

    #[test]
    fn fixed_chunks_and_token_budget_span_jobs() {
        let mut e = PrefillEngine::new(
            EngineId(0),
            ChunkPolicy::FixedSize { chunk_tokens: 300 },
            model(),
            1.0,
            8,
        );
        e.enqueue(job(1, 200, 0)).unwrap();
        let mut unready = job(2, 500, 0);
        unready.ready = false;
        e.enqueue(unready).unwrap();
        e.enqueue(job(3, 500, 0)).unwrap();
        let mut p = empty();
        assert!(e.plan_step(Nanos(0), &mut p));
        let got: Vec<_> = p
            .chunks
            .iter()
            .map(|c| (c.request.0, c.new_tokens))
            .collect();
        assert_eq!(got, vec![(1, 200), (3, 100)]);
        assert!(e.set_ready(RequestId(2)));
        assert!(!e.set_ready(RequestId(7)));
    }

    #[test]
    fn bounded_queue_and_bad_policies() {
        let mut e = PrefillEngine::new(
            EngineId(0),
            ChunkPolicy::FixedSize { chunk_tokens: 1 },
            model(),
            1.0,
            1,
        );
        e.enqueue(job(1, 10, 0)).unwrap();
        assert!(e.enqueue(job(2, 10, 0)).is_err());
        assert!(
            ChunkPolicy::FixedSize { chunk_tokens: 0 }
                .validate()
                .is_err()
        );
        let bad = ChunkPolicy::TimeBudgeted {
            token_budget: 10,
            time_budget: Nanos(1),
            min_chunk_tokens: 11,
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("min_chunk_tokens")
        );
    }
}
