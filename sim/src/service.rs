//! The discrete-event simulation of one serving unit (SPEC §3, §6–§8):
//!
//! arrival → entrypoint prefix match (real [`KvStore`], [`HitPolicy`], [`SwaCache`]) → prefill
//! balancer → KV fetch from the store (10+2 erasure-coded reads, each finishing at its 10th of
//! 11 answers) and SWA pull → prefill chunk scheduler (swap-in overlapped with compute) → SWA
//! state stored → prefill-to-decode handoff over the PD link → decode balancer → decode group
//! (DSpark, async scheduling) → outputs written to the store.
//!
//! Single-threaded and deterministic: integer time, events ordered by (time, seq), every random
//! draw from a sub-seed of the run seed. Every arrival ends completed or rejected with a reason,
//! checked at the end of every run together with KV and SWA slot conservation.
//!
//! Per-request work does not grow with the context when most of it is a hit: the entrypoint
//! remembers, per session, how many leading blocks it found present and at which store
//! "removal generation" (evictions + expirations); while nothing was removed since, a turn only
//! looks up and writes its new blocks. Re-touching the reused run (for LRU recency and
//! last-access TTLs) is coalesced to once per `touch_coalesce` per session.

use crate::acceptance::AcceptanceModel;
use crate::cost::{CostModel, SwapIn};
use crate::events::EventQueue;
use crate::metrics::Histogram;
use crate::profile::HardwareProfile;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use servelab_core::content::{KeyBuildHasher, hash2, prefetch_read};
use servelab_core::engine::prefill_lb::Submitted;
use servelab_core::engine::{
    Backend, ChunkPolicy, DecodeBalancer, DecodeGroup, DecodeGroupConfig, DecodeLbPolicy,
    DecodePlan, PrefillBalancer, PrefillEngine, PrefillJob, PrefillLbPolicy, PrefillPlan,
    QueuedPrefill, Scheduling, SeqEmission, StepPlan, StepReport, VerificationPolicy,
};
use servelab_core::eplb::{ExpertLoadConfig, ExpertLoadModel, MoeBatch};
use servelab_core::{
    BlockKey, ConfigError, EngineId, HitInputs, HitPolicy, KvStore, MachineId, Nanos, PerfectCache,
    Request, RequestId, ServingConstants, SessionId, StoreConfig, SwaCache, SwaConfig, SwaSource,
    TrafficClass,
};
use std::collections::HashMap;

/// Tags an SWA-state object in the store (SWA-on-SSD) apart from the block with that key.
const SWA_OBJECT_TAG: u64 = 0x53a5_7a7e;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrefillPoolConfig {
    /// GPUs in the prefill pool; each is one engine (a DP rank of an EP4/DP4 instance).
    pub gpus: u32,
    pub gpus_per_machine: u32,
    pub chunking: ChunkPolicy,
    pub lb: PrefillLbPolicy,
    pub max_jobs_per_engine: u32,
    /// Requests waiting in the balancer; beyond it arrivals are rejected.
    pub max_queued_requests: u32,
    pub expert_imbalance: f64,
}

impl Default for PrefillPoolConfig {
    fn default() -> Self {
        PrefillPoolConfig {
            gpus: 64,
            gpus_per_machine: 8,
            chunking: ChunkPolicy::TimeBudgeted {
                token_budget: 32_768,
                time_budget: Nanos::from_millis(250),
                min_chunk_tokens: 128,
            },
            lb: PrefillLbPolicy::Tiered {
                tier_bounds_tokens: vec![16_384, 65_536, 262_144],
                round: Nanos::from_secs(1),
                quota: Nanos::from_millis(300),
                steal_when_idle: true,
            },
            max_jobs_per_engine: 64,
            max_queued_requests: 100_000,
            expert_imbalance: 1.074,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DecodePoolConfig {
    /// EP groups; each has `ranks` GPUs.
    pub groups: u32,
    pub gpus_per_machine: u32,
    pub ranks: u32,
    pub max_seqs_per_rank: u32,
    pub kv_capacity_tokens_per_rank: u64,
    pub max_waiting_per_rank: u32,
    pub verification: VerificationPolicy,
    pub scheduling: Scheduling,
    pub lb: DecodeLbPolicy,
    pub expert_imbalance: f64,
}

impl Default for DecodePoolConfig {
    fn default() -> Self {
        DecodePoolConfig {
            groups: 1,
            gpus_per_machine: 8,
            ranks: 64,
            max_seqs_per_rank: 128,
            // ~100 GB of HBM for KV at 890 B/token.
            kv_capacity_tokens_per_rank: 112_000_000,
            max_waiting_per_rank: 4096,
            verification: VerificationPolicy::Dynamic {
                min_seqs_per_rank: 0,
                vote: Default::default(),
                confirmation_rounds: 1,
                budget: Default::default(),
            },
            scheduling: Scheduling::Async,
            lb: DecodeLbPolicy::CountAndKv,
            expert_imbalance: 1.09,
        }
    }
}

/// Reads of the hit prefix from the store cluster.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FetchConfig {
    /// Read bandwidth of one storage node available to this unit.
    pub node_read_bytes_per_s: f64,
    /// Latency of one node's answer, plus an exponential tail with mean `tail_mean`.
    pub latency: Nanos,
    pub tail_mean: Nanos,
    /// A fetch is issued as this many erasure-coded stripe reads (at most one per block).
    pub stripes: u32,
}

impl Default for FetchConfig {
    fn default() -> Self {
        FetchConfig {
            node_read_bytes_per_s: 40e9,
            latency: Nanos::from_micros(200),
            tail_mean: Nanos::from_micros(300),
            stripes: 8,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LinkConfig {
    /// PD handoff: bytes per second per prefill machine (400 Gbps per 8 GPUs).
    pub handoff_bytes_per_s_per_machine: f64,
    pub handoff_latency: Nanos,
    /// Cross-machine SWA pull over the VLAN.
    pub swa_pull_bytes_per_s: f64,
    pub swa_pull_latency: Nanos,
}

impl Default for LinkConfig {
    fn default() -> Self {
        LinkConfig {
            handoff_bytes_per_s_per_machine: 50e9,
            handoff_latency: Nanos::from_micros(50),
            swa_pull_bytes_per_s: 50e9,
            swa_pull_latency: Nanos::from_micros(50),
        }
    }
}

/// Where the MoE part of a step's time comes from.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum MoeImbalance {
    /// Every step uses the pool's `expert_imbalance` (the published average, SPEC §9): cheap.
    #[default]
    Fixed,
    /// An expert-load model per engine ([`ExpertLoadModel`]: skewed, drifting routing and a
    /// placement policy: EPLB, static or no redundancy) gives each step the slowest rank's load
    /// ÷ the mean, and EPLB reassignments add their weight-shuffle time to the engine's step.
    /// A pool left out keeps its fixed factor. `prefill.ep.gpus` GPUs share one prefill
    /// instance's experts; `decode.ep.gpus` must equal the decode group's ranks.
    Model {
        #[serde(default)]
        prefill: Option<Box<ExpertLoadConfig>>,
        #[serde(default)]
        decode: Option<Box<ExpertLoadConfig>>,
    },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServiceConfig {
    pub profile: String,
    pub constants: ServingConstants,
    pub hit_policy: HitPolicy,
    pub store: StoreConfig,
    pub swa: SwaConfig,
    pub prefill: PrefillPoolConfig,
    pub decode: DecodePoolConfig,
    pub fetch: FetchConfig,
    pub links: LinkConfig,
    pub swap_in: SwapIn,
    pub acceptance: AcceptanceModel,
    pub moe: MoeImbalance,
    /// Requests arriving before this are simulated but not measured.
    pub warmup: Nanos,
    /// End of the measured window (default: the last arrival). Requests arriving after it, and
    /// steps started after it, are simulated but not measured: with session traffic the last
    /// few minutes of arrivals are a ramp-down (no new sessions) at a fraction of the load.
    pub measure_until: Option<Nanos>,
    pub series_interval: Nanos,
    /// One request in this many (by arrival order) is written to the per-request table.
    pub sample_every: u32,
    /// A session's reused blocks are re-touched at most this often (0 = every turn).
    pub touch_coalesce: Nanos,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        ServiceConfig {
            profile: "sm100-published".into(),
            constants: ServingConstants::default(),
            hit_policy: HitPolicy::Deepinfer,
            store: StoreConfig::default(),
            swa: SwaConfig {
                machines: 16,
                ..SwaConfig::default()
            },
            prefill: PrefillPoolConfig::default(),
            decode: DecodePoolConfig::default(),
            fetch: FetchConfig::default(),
            links: LinkConfig::default(),
            swap_in: SwapIn::Overlapped,
            acceptance: AcceptanceModel::default(),
            moe: MoeImbalance::Fixed,
            warmup: Nanos::from_secs(60),
            measure_until: None,
            series_interval: Nanos::from_secs(10),
            sample_every: 100,
            touch_coalesce: Nanos::from_secs(60),
        }
    }
}

impl ServiceConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.constants.validate()?;
        let p = &self.prefill;
        let d = &self.decode;
        if p.gpus == 0 || p.gpus_per_machine == 0 {
            return Err(ConfigError::invalid(
                "prefill.gpus",
                "pool and machine sizes must be positive",
            ));
        }
        if p.max_jobs_per_engine == 0 {
            return Err(ConfigError::invalid(
                "prefill.max_jobs_per_engine",
                "must be positive",
            ));
        }
        if !(p.expert_imbalance >= 1.0 && p.expert_imbalance.is_finite()) {
            return Err(ConfigError::invalid(
                "prefill.expert_imbalance",
                "must be at least 1",
            ));
        }
        p.chunking.validate()?;
        p.lb.validate()?;
        if d.groups == 0 || d.gpus_per_machine == 0 {
            return Err(ConfigError::invalid(
                "decode.groups",
                "pool and machine sizes must be positive",
            ));
        }
        let machines =
            p.gpus.div_ceil(p.gpus_per_machine) + (d.groups * d.ranks).div_ceil(d.gpus_per_machine);
        if self.swa.machines < machines {
            return Err(ConfigError::invalid(
                "swa.machines",
                format!(
                    "{} machines hold SWA state but the unit has {machines} (prefill + decode)",
                    self.swa.machines
                ),
            ));
        }
        for (f, v) in [
            (
                "fetch.node_read_bytes_per_s",
                self.fetch.node_read_bytes_per_s,
            ),
            (
                "links.handoff_bytes_per_s_per_machine",
                self.links.handoff_bytes_per_s_per_machine,
            ),
            (
                "links.swa_pull_bytes_per_s",
                self.links.swa_pull_bytes_per_s,
            ),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(ConfigError::invalid(f, "must be positive"));
            }
        }
        if let Some(end) = self.measure_until
            && end <= self.warmup
        {
            return Err(ConfigError::invalid(
                "measure_until",
                format!("{end} must be later than warmup ({})", self.warmup),
            ));
        }
        if self.fetch.stripes == 0 {
            return Err(ConfigError::invalid("fetch.stripes", "must be positive"));
        }
        if self.series_interval == Nanos::ZERO || self.sample_every == 0 {
            return Err(ConfigError::invalid(
                "series_interval",
                "series_interval and sample_every must be positive",
            ));
        }
        if let MoeImbalance::Model { prefill, decode } = &self.moe {
            if let Some(c) = prefill {
                c.validate()
                    .map_err(|e| ConfigError::invalid("moe.prefill", e.to_string()))?;
            }
            if let Some(c) = decode {
                c.validate()
                    .map_err(|e| ConfigError::invalid("moe.decode", e.to_string()))?;
                if c.ep.gpus != d.ranks as usize {
                    return Err(ConfigError::invalid(
                        "moe.decode.ep.gpus",
                        format!(
                            "{} GPUs, but a decode group has {} ranks",
                            c.ep.gpus, d.ranks
                        ),
                    ));
                }
            }
        }
        self.acceptance.validate()
    }

    fn group_config(&self) -> DecodeGroupConfig {
        let d = &self.decode;
        DecodeGroupConfig {
            ranks: d.ranks,
            max_seqs_per_rank: d.max_seqs_per_rank,
            kv_capacity_tokens_per_rank: d.kv_capacity_tokens_per_rank,
            max_waiting_per_rank: d.max_waiting_per_rank,
            draft_tokens: self.constants.draft_tokens,
            verification: d.verification.clone(),
            scheduling: d.scheduling,
            expert_imbalance: d.expert_imbalance,
        }
    }
}

/// Why a request did not complete.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Rejection {
    PrefillQueueFull,
    PrefillEngineFull,
    DecodeQueueFull,
    ContextTooLarge,
}

impl Rejection {
    pub const ALL: [Rejection; 4] = [
        Rejection::PrefillQueueFull,
        Rejection::PrefillEngineFull,
        Rejection::DecodeQueueFull,
        Rejection::ContextTooLarge,
    ];
    pub fn name(self) -> &'static str {
        match self {
            Rejection::PrefillQueueFull => "prefill_queue_full",
            Rejection::PrefillEngineFull => "prefill_engine_full",
            Rejection::DecodeQueueFull => "decode_queue_full",
            Rejection::ContextTooLarge => "context_too_large",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    Pending,
    Done,
    Rejected(Rejection),
}

#[derive(Clone, Copy, Debug)]
struct ReqState {
    status: Status,
    hit_tokens: u32,
    encoder_tokens: u32,
    engine: u32,
    swa_machine: Option<MachineId>,
    first_step: Nanos,
    first_token: Nanos,
    last_token: Nanos,
    max_gap: Nanos,
    emitted: u32,
    decode_group: u32,
}

/// One sampled request.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RequestRow {
    pub request: u64,
    pub class: &'static str,
    pub arrival_s: f64,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    pub hit_tokens: u32,
    pub outcome: &'static str,
    pub queue_ms: f64,
    pub ttft_ms: f64,
    pub tpot_ms: f64,
    pub max_gap_ms: f64,
    pub e2e_s: f64,
}

/// One interval of the run.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SeriesRow {
    pub t_s: f64,
    pub arrivals: u64,
    pub completions: u64,
    pub prefill_tokens_per_s_per_gpu: f64,
    pub decode_tokens_per_s_per_gpu: f64,
    pub prefill_busy: f64,
    pub decode_seqs_per_rank: f64,
    pub kv_occupancy: f64,
    pub prefill_queued: u64,
}

/// Per engine (a prefill GPU, or a decode EP group).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EngineRow {
    pub pool: &'static str,
    pub engine: u32,
    pub utilisation: f64,
    pub tokens_per_s_per_gpu: f64,
    pub steps: u64,
    pub mean_batch: f64,
    pub mean_kv_occupancy: f64,
}

/// Latency distributions of measured requests.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Latencies {
    pub ttft_ns: Histogram,
    pub tpot_ns: Histogram,
    pub e2e_ns: Histogram,
    pub queue_ns: Histogram,
    pub gap_ns: Histogram,
}

/// The unit in steady state: steps that started after the warm-up and before the last arrival
/// (ramp-up and drain excluded), comparable with the published steady-load operating points.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SteadyState {
    pub start_s: f64,
    pub end_s: f64,
    /// Output tokens per busy second per decode GPU.
    pub decode_tokens_per_s_per_gpu: f64,
    /// Output tokens per wall second per decode GPU (including idle time).
    pub decode_tokens_per_s_per_gpu_wall: f64,
    pub decode_seqs_per_rank: f64,
    pub decode_utilisation: f64,
    pub decode_step_ms: f64,
    pub verified_drafts_per_seq_step: f64,
    pub accepted_length: f64,
    /// Non-cached input tokens per busy second per prefill GPU.
    pub prefill_tokens_per_s_per_gpu: f64,
    pub prefill_utilisation: f64,
}

#[derive(Default, Clone, Copy)]
struct SteadyCounters {
    decode_busy_ns: u64,
    decode_steps: u64,
    decode_tokens: u64,
    decode_seq_steps: u64,
    decode_emissions: u64,
    decode_rank_steps: u64,
    verified: u64,
    prefill_busy_ns: u64,
    prefill_tokens: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ServiceReport {
    pub arrivals: u64,
    pub completed: u64,
    pub rejected: Vec<(&'static str, u64)>,
    pub measured_requests: u64,
    pub measured_span_s: f64,
    pub simulated_s: f64,
    pub events: u64,
    pub all: Latencies,
    pub by_class: Vec<(&'static str, Latencies)>,
    pub input_tokens: u64,
    pub hit_tokens: u64,
    pub encoder_tokens: u64,
    pub output_tokens: u64,
    pub prefill_tokens_per_s_per_gpu: f64,
    pub decode_tokens_per_s_per_gpu: f64,
    pub decode_seqs_per_rank: f64,
    pub verified_drafts_per_seq_step: f64,
    pub accepted_length: f64,
    pub prefill_utilisation: f64,
    pub decode_utilisation: f64,
    pub swa_hit_rate: f64,
    pub store_used_bytes: u64,
    /// Mean expert imbalance (slowest rank ÷ mean) over prefill and decode steps.
    pub prefill_mean_imbalance: f64,
    pub decode_mean_imbalance: f64,
    /// EPLB reassignments and the engine time they cost (all engines).
    pub moe_reassignments: u64,
    pub moe_reassignment_s: f64,
    /// Rates between the warm-up and the last arrival.
    pub steady: SteadyState,
    pub full_prefix_lookups: u64,
    pub memo_prefix_lookups: u64,
    pub requests: Vec<RequestRow>,
    pub series: Vec<SeriesRow>,
    pub engines: Vec<EngineRow>,
}

impl ServiceReport {
    pub fn hit_rate(&self) -> f64 {
        self.hit_tokens as f64 / self.input_tokens.max(1) as f64
    }
}

#[derive(Clone, Copy, Debug)]
enum Ev {
    Arrival(u32),
    Ready(u32),
    PrefillDone(u32),
    Handoff(u32),
    DecodeDone(u32),
    Tick,
}

#[derive(Clone, Copy, Debug)]
struct Memo {
    /// The chain the memo is about ([`ReqIx::chain`]); [`Memo::NONE`]'s matches none.
    chain: u32,
    blocks: u32,
    generation: u64,
    touched_at: Nanos,
}

impl Memo {
    /// A session not seen yet: no chain matches it.
    const NONE: Memo = Memo {
        chain: u32::MAX,
        blocks: 0,
        generation: 0,
        touched_at: Nanos::ZERO,
    };
}

/// A request's session and content chain as dense numbers (in order of first appearance),
/// one array read in arrival order.
#[derive(Clone, Copy, Debug)]
struct ReqIx {
    /// Index into the memos, or [`NO_SESSION`].
    session: u32,
    /// Index into the chains' keys.
    chain: u32,
}

/// No session (a request outside any session).
const NO_SESSION: u32 = u32::MAX;

/// The key of the prefix `[0, pos)` of a request whose chain's full-block keys are `keys`
/// ([`Request::key_at`]): a block boundary from the keys, a segment end from the chain's marks.
#[inline]
fn key_at(keys: &[BlockKey], r: &Request, block_tokens: u32, pos: u32) -> Option<BlockKey> {
    if pos == 0 {
        None
    } else if pos.is_multiple_of(block_tokens) {
        keys.get((pos / block_tokens) as usize - 1).copied()
    } else {
        r.key_at(pos)
    }
}

/// Asks the CPU to start loading the last four cache lines of `keys`: a caller that will look
/// those keys up soon overlaps their cache misses with other work. No effect on results.
#[inline]
fn prefetch_tail(keys: &[BlockKey]) {
    const KEYS_PER_LINE: usize = 64 / std::mem::size_of::<BlockKey>();
    let end = keys.len();
    let start = end.saturating_sub(4 * KEYS_PER_LINE);
    for i in (start..end).step_by(KEYS_PER_LINE) {
        prefetch_read(&raw const keys[i]);
    }
    if start < end {
        prefetch_read(&raw const keys[end - 1]);
    }
}

#[derive(Default, Clone, Copy)]
struct EngineStats {
    busy_ns: u64,
    steps: u64,
    tokens: u64,
    batch: u64,
    kv_weighted: f64,
}

/// A running decode sequence's emission state, kept beside its slot (a dense array walked in
/// plan order) rather than in the request table (a cache miss per sequence-step); written back
/// to the request when it finishes.
#[derive(Clone, Copy, Debug)]
struct SeqTrack {
    request: u32,
    measured: bool,
    last_token: Nanos,
    max_gap: Nanos,
    emitted: u32,
}

impl SeqTrack {
    const NONE: SeqTrack = SeqTrack {
        request: u32::MAX,
        measured: false,
        last_token: Nanos::ZERO,
        max_gap: Nanos::ZERO,
        emitted: 0,
    };
}

/// What a decode step's emissions update, handed each emission in turn by the group. A method
/// forced inline rather than one large closure: the group calls it from more than one place,
/// and a closure called from several is compiled out of line (a call per sequence-step).
struct Emissions<'s> {
    now: Nanos,
    warmup: Nanos,
    until: Option<Nanos>,
    reqs: &'s [Request],
    state: &'s mut [ReqState],
    side: &'s mut [SeqTrack],
    gaps: &'s mut Histogram,
    finished: &'s mut Vec<u32>,
    emissions: u64,
    tokens: u64,
    measured_tokens: u64,
    /// (gap, how many) not yet in `gaps`: [`Self::finish`] records it.
    gap_run: (u64, u64),
}

impl Emissions<'_> {
    /// Records the pending run of gaps; returns (emissions, tokens, measured tokens).
    fn finish(self) -> (u64, u64, u64) {
        self.gaps.record_n(self.gap_run.0, self.gap_run.1);
        (self.emissions, self.tokens, self.measured_tokens)
    }

    #[inline(always)]
    fn emit(&mut self, k: u32, e: SeqEmission) {
        let i = e.request.0 as usize;
        let t = &mut self.side[k as usize];
        if t.request != i as u32 {
            // The sequence's first step: its running state moves next to its slot.
            let st = &self.state[i];
            let a = self.reqs[i].arrival;
            *t = SeqTrack {
                request: i as u32,
                measured: a >= self.warmup && self.until.is_none_or(|m| a < m),
                last_token: st.last_token,
                max_gap: st.max_gap,
                emitted: st.emitted,
            };
        }
        let gap = self.now - t.last_token;
        t.max_gap = t.max_gap.max(gap);
        t.last_token = self.now;
        t.emitted += e.tokens;
        self.emissions += 1;
        self.tokens += u64::from(e.tokens);
        if t.measured {
            // The sequences of a step mostly share one gap (the step time): a run of equal
            // gaps is recorded at once.
            if gap.0 == self.gap_run.0 {
                self.gap_run.1 += 1;
            } else {
                self.gaps.record_n(self.gap_run.0, self.gap_run.1);
                self.gap_run = (gap.0, 1);
            }
            self.measured_tokens += u64::from(e.tokens);
        }
        if e.finished {
            let st = &mut self.state[i];
            st.last_token = t.last_token;
            st.max_gap = t.max_gap;
            st.emitted = t.emitted;
            self.finished.push(i as u32);
        }
    }
}

struct DecodeDriver {
    /// Per slot key of the group ([`DecodeGroup::apply_report_with`]).
    side: Vec<SeqTrack>,
    plans: [StepPlan; 2],
    report: StepReport,
    in_flight: bool,
    /// Async: plans[1] was built for the next step.
    next_built: bool,
    first_rank_gpu: u32,
}

struct Sim<'a> {
    cfg: &'a ServiceConfig,
    reqs: &'a [Request],
    state: Vec<ReqState>,
    q: EventQueue<Ev>,
    store: KvStore,
    swa: SwaCache,
    perfect: PerfectCache,
    /// Per session, by dense session number: a direct index rather than a hash map keyed by
    /// session id (two cache misses per look-up in a map of tens of thousands of sessions).
    memo: Vec<Memo>,
    /// Per request.
    ix: Vec<ReqIx>,
    /// Every full-block key of each chain (by [`ReqIx::chain`]). Read through these slices,
    /// a chain's keys are one load away: through the request's `Arc`, its header (scattered
    /// over hundreds of MB of trace) comes first, a cache and TLB miss at every event.
    chain_keys: Vec<&'a [BlockKey]>,
    backend: CostModel,
    prefill: Vec<PrefillEngine>,
    prefill_plans: Vec<StepPlan>,
    prefill_stats: Vec<EngineStats>,
    lb: PrefillBalancer,
    groups: Vec<DecodeGroup>,
    decode: Vec<DecodeDriver>,
    decode_stats: Vec<EngineStats>,
    dlb: DecodeBalancer,
    node_busy: Vec<Nanos>,
    handoff_busy: Vec<Nanos>,
    rng: ChaCha8Rng,
    report: StepReport,
    finished_seqs: Vec<u32>,
    stripe_keys: Vec<BlockKey>,
    finished_jobs: Vec<PrefillJob>,
    /// Jobs built at arrival, waiting for an engine.
    waiting_jobs: HashMap<u64, PrefillJob, KeyBuildHasher>,
    loads: Vec<f64>,
    pending: u64,
    completed: u64,
    rejected: [u64; 4],
    lat: Latencies,
    lat_class: [Latencies; 3],
    measured: u64,
    measured_first: Nanos,
    measured_last: Nanos,
    tokens: [u64; 4],
    verified: u64,
    seq_steps: u64,
    series: Vec<SeriesRow>,
    cur: SeriesRow,
    cur_prefill_tokens: u64,
    cur_decode_tokens: u64,
    cur_prefill_busy: u64,
    cur_decode_seq_steps: u64,
    cur_decode_steps: u64,
    cur_kv: f64,
    full_lookups: u64,
    memo_lookups: u64,
    rows: Vec<RequestRow>,
    /// [warm-up, last arrival): the steady-state window.
    steady_window: (Nanos, Nanos),
    steady: SteadyCounters,
    prefill_moe: Vec<ExpertLoadModel>,
    /// DP ranks of a prefill EP instance (`moe.prefill.ep.gpus`).
    prefill_moe_dp: u64,
    decode_moe: Vec<ExpertLoadModel>,
    /// (Σ imbalance, steps) for prefill and decode.
    imbalance_sums: [(f64, u64); 2],
    reassignments: u64,
    reassignment_ns: u64,
}

/// Runs the unit over `requests` (sorted by arrival) to completion.
pub fn run(
    cfg: &ServiceConfig,
    requests: &[Request],
    seed: u64,
) -> Result<ServiceReport, ConfigError> {
    cfg.validate()?;
    let profile = HardwareProfile::resolve(&cfg.profile)?;
    if let Some(r) = requests.windows(2).find(|w| w[1].arrival < w[0].arrival) {
        return Err(ConfigError::invalid(
            "workload",
            format!("requests not sorted by arrival at {}", r[1].id),
        ));
    }
    if let Some(r) = requests
        .iter()
        .find(|r| r.block_tokens() != cfg.constants.block_tokens)
    {
        return Err(ConfigError::invalid(
            "constants.block_tokens",
            format!(
                "request {} is keyed at {} tokens per block, the unit at {}",
                r.id,
                r.block_tokens(),
                cfg.constants.block_tokens
            ),
        ));
    }
    let mut sim = Sim::new(cfg, requests, profile, seed)?;
    sim.run()?;
    sim.finish()
}

/// [`Nanos::from_secs_f64`], bit for bit, without a call to libm's `round` (88 per fetch):
/// for positive `v` below 2^63, `v - trunc(v)` is exact, so comparing it with 0.5 rounds half
/// away from zero as `round` does.
#[inline]
fn nanos_from_secs(s: f64) -> Nanos {
    if s.is_nan() || s <= 0.0 {
        return Nanos(0);
    }
    if s >= u64::MAX as f64 / 1e9 {
        return Nanos::MAX;
    }
    let v = s * 1e9;
    // `i64::MAX as f64` is 2^63 exactly.
    if v < i64::MAX as f64 {
        // Below 2^63 the signed conversions (one instruction each way on x86_64, where the
        // unsigned ones are emulated) give the same values.
        let t = v as i64;
        return Nanos(t as u64 + u64::from(v - t as f64 >= 0.5));
    }
    let t = v as u64;
    Nanos(t + u64::from(v - t as f64 >= 0.5))
}

/// The `k`-th smallest of `xs` (1-based), which it may reorder. A stripe read is done at its
/// `data`-th of `data + 1` answers: the largest or second largest, found in one pass.
fn kth_smallest(xs: &mut [Nanos], k: usize) -> Nanos {
    if k == xs.len() {
        return xs.iter().copied().max().unwrap_or(Nanos::ZERO);
    }
    if k + 1 == xs.len() {
        let (mut hi, mut second) = (Nanos::ZERO, Nanos::ZERO);
        for &x in xs.iter() {
            if x > hi {
                second = hi;
                hi = x;
            } else if x > second {
                second = x;
            }
        }
        return second;
    }
    *xs.select_nth_unstable(k - 1).1
}

fn empty_decode_plan() -> StepPlan {
    StepPlan::Decode(DecodePlan {
        engine: EngineId(0),
        ranks: Vec::new(),
        seqs: Vec::new(),
        dynamic: false,
        expert_imbalance: 1.0,
    })
}

impl<'a> Sim<'a> {
    fn new(
        cfg: &'a ServiceConfig,
        reqs: &'a [Request],
        profile: HardwareProfile,
        seed: u64,
    ) -> Result<Self, ConfigError> {
        let c = &cfg.constants;
        // Session ids are arbitrary integers (imported traces) and chains are shared by
        // address: both numbered densely, in order of first appearance, once.
        let mut sessions: HashMap<SessionId, u32, KeyBuildHasher> = HashMap::default();
        let mut chains: HashMap<usize, u32, KeyBuildHasher> = HashMap::default();
        let mut chain_keys: Vec<&'a [BlockKey]> = Vec::new();
        // The longest context each chain is read to.
        let mut chain_upto: Vec<u32> = Vec::new();
        let ix: Vec<ReqIx> = reqs
            .iter()
            .map(|r| {
                let session = match r.session {
                    Some(s) => {
                        let next = sessions.len() as u32;
                        *sessions.entry(s).or_insert(next)
                    }
                    None => NO_SESSION,
                };
                let next = chains.len() as u32;
                let chain = *chains
                    .entry(std::sync::Arc::as_ptr(&r.content) as usize)
                    .or_insert(next);
                if chain == next {
                    chain_keys.push(r.content.full_blocks(u32::MAX));
                    chain_upto.push(0);
                }
                let upto = &mut chain_upto[chain as usize];
                *upto = (*upto).max(r.context_tokens());
                ReqIx { session, chain }
            })
            .collect();
        let sessions = sessions.len();
        drop(chains);
        let mut store = KvStore::new(cfg.store.clone(), c.block_bytes())?;
        // Sized once for the whole run: growing the table of tens of millions of blocks step by
        // step rebuilt it many times (and took most of the run's page faults).
        store.reserve(Self::blocks_written_bound(
            cfg,
            reqs.len(),
            &chain_keys,
            &chain_upto,
        ));
        let swa = SwaCache::new(cfg.swa.clone())?;
        let lb = PrefillBalancer::new(
            cfg.prefill.lb.clone(),
            cfg.prefill.gpus,
            cfg.prefill.max_queued_requests as usize,
        )?;
        let prefill = (0..cfg.prefill.gpus)
            .map(|i| {
                PrefillEngine::new(
                    EngineId(i),
                    cfg.prefill.chunking.clone(),
                    profile.prefill.clone(),
                    cfg.prefill.expert_imbalance,
                    cfg.prefill.max_jobs_per_engine as usize,
                )
            })
            .collect();
        let mut decode = Vec::new();
        let mut groups = Vec::new();
        for g in 0..cfg.decode.groups {
            let group = DecodeGroup::new(EngineId(g), cfg.group_config(), profile.decode.clone())?;
            decode.push(DecodeDriver {
                side: vec![SeqTrack::NONE; group.slot_keys() as usize],
                plans: [empty_decode_plan(), empty_decode_plan()],
                report: StepReport::default(),
                in_flight: false,
                next_built: false,
                first_rank_gpu: g * cfg.decode.ranks,
            });
            groups.push(group);
        }
        let backend = CostModel::new(profile, &cfg.acceptance, c.draft_tokens, cfg.swap_in, seed);
        let prefill_machines = cfg.prefill.gpus.div_ceil(cfg.prefill.gpus_per_machine);
        let n = reqs.len();
        let (mut prefill_moe, mut decode_moe) = (Vec::new(), Vec::new());
        if let MoeImbalance::Model { prefill, decode } = &cfg.moe {
            if let Some(c) = prefill {
                for e in 0..cfg.prefill.gpus {
                    prefill_moe.push(ExpertLoadModel::new(c, seed, &format!("prefill.{e}"))?);
                }
            }
            if let Some(c) = decode {
                for g in 0..cfg.decode.groups {
                    decode_moe.push(ExpertLoadModel::new(c, seed, &format!("decode.{g}"))?);
                }
            }
        }
        Ok(Sim {
            cfg,
            reqs,
            state: vec![
                ReqState {
                    status: Status::Pending,
                    hit_tokens: 0,
                    encoder_tokens: 0,
                    engine: 0,
                    swa_machine: None,
                    first_step: Nanos::ZERO,
                    first_token: Nanos::ZERO,
                    last_token: Nanos::ZERO,
                    max_gap: Nanos::ZERO,
                    emitted: 0,
                    decode_group: 0,
                };
                n
            ],
            q: EventQueue::new(),
            store,
            swa,
            perfect: PerfectCache::new(),
            memo: vec![Memo::NONE; sessions],
            ix,
            chain_keys,
            backend,
            prefill,
            prefill_plans: (0..cfg.prefill.gpus)
                .map(|_| {
                    StepPlan::Prefill(PrefillPlan {
                        engine: EngineId(0),
                        chunks: Vec::new(),
                        expert_imbalance: 1.0,
                    })
                })
                .collect(),
            prefill_stats: vec![EngineStats::default(); cfg.prefill.gpus as usize],
            lb,
            decode_stats: vec![EngineStats::default(); cfg.decode.groups as usize],
            decode,
            groups,
            dlb: DecodeBalancer::new(cfg.decode.lb),
            node_busy: vec![Nanos::ZERO; cfg.store.storage_nodes as usize],
            handoff_busy: vec![Nanos::ZERO; prefill_machines as usize],
            rng: ChaCha8Rng::seed_from_u64(servelab_core::seed::sub_seed(seed, "service.fetch")),
            report: StepReport::default(),
            finished_seqs: Vec::new(),
            stripe_keys: Vec::new(),
            finished_jobs: Vec::new(),
            waiting_jobs: HashMap::default(),
            loads: vec![0.0; cfg.prefill.gpus as usize],
            pending: 0,
            completed: 0,
            rejected: [0; 4],
            lat: Latencies::default(),
            lat_class: Default::default(),
            measured: 0,
            measured_first: Nanos::MAX,
            measured_last: Nanos::ZERO,
            tokens: [0; 4],
            verified: 0,
            seq_steps: 0,
            series: Vec::new(),
            cur: SeriesRow::default(),
            cur_prefill_tokens: 0,
            cur_decode_tokens: 0,
            cur_prefill_busy: 0,
            cur_decode_seq_steps: 0,
            cur_decode_steps: 0,
            cur_kv: 0.0,
            full_lookups: 0,
            memo_lookups: 0,
            rows: Vec::new(),
            steady_window: {
                let last = reqs.last().map_or(Nanos::ZERO, |r| r.arrival);
                (cfg.warmup, cfg.measure_until.map_or(last, |m| m.min(last)))
            },
            steady: SteadyCounters::default(),
            prefill_moe,
            prefill_moe_dp: match &cfg.moe {
                MoeImbalance::Model {
                    prefill: Some(c), ..
                } => c.ep.gpus as u64,
                _ => 1,
            },
            decode_moe,
            imbalance_sums: [(0.0, 0); 2],
            reassignments: 0,
            reassignment_ns: 0,
        })
    }

    /// At most how many objects the run writes to the store: the full blocks of every distinct
    /// chain up to its longest context (a prefix shared by several chains counts once per
    /// chain), plus two SWA objects per request (after prefill and after decode) when SWA
    /// state lives in the store.
    fn blocks_written_bound(
        cfg: &ServiceConfig,
        requests: usize,
        chain_keys: &[&[BlockKey]],
        chain_upto: &[u32],
    ) -> usize {
        let bs = cfg.constants.block_tokens;
        let mut blocks: usize = chain_keys
            .iter()
            .zip(chain_upto)
            .map(|(keys, &t)| ((t / bs) as usize).min(keys.len()))
            .sum();
        if cfg.hit_policy.swa_source() == SwaSource::BlockStore {
            blocks += 2 * requests;
        }
        blocks
    }

    /// Every full-block key of request `i`'s chain.
    #[inline]
    fn keys(&self, i: usize) -> &'a [BlockKey] {
        self.chain_keys[self.ix[i].chain as usize]
    }

    /// Keys of the full blocks inside the first `tokens` tokens of request `i`'s chain
    /// ([`servelab_core::ContentChain::full_blocks`]).
    #[inline]
    fn blocks_within(&self, i: usize, tokens: u32) -> &'a [BlockKey] {
        let keys = self.keys(i);
        &keys[..((tokens / self.cfg.constants.block_tokens) as usize).min(keys.len())]
    }

    fn in_steady(&self, t: Nanos) -> bool {
        t >= self.steady_window.0 && t < self.steady_window.1
    }

    fn measured(&self, i: usize) -> bool {
        let a = self.reqs[i].arrival;
        a >= self.cfg.warmup && self.cfg.measure_until.is_none_or(|m| a < m)
    }

    fn run(&mut self) -> Result<(), ConfigError> {
        // Arrivals are fed one at a time so the heap holds only what is in flight.
        if !self.reqs.is_empty() {
            self.q.push(self.reqs[0].arrival, Ev::Arrival(0));
            self.q.push(self.cfg.series_interval, Ev::Tick);
        }
        while let Some((now, ev)) = self.q.pop() {
            match ev {
                Ev::Arrival(i) => {
                    if (i as usize) + 1 < self.reqs.len() {
                        let next = i + 1;
                        self.q
                            .push(self.reqs[next as usize].arrival, Ev::Arrival(next));
                    }
                    self.arrive(now, i as usize);
                }
                Ev::Ready(i) => {
                    let e = self.state[i as usize].engine;
                    self.prefill[e as usize].set_ready(RequestId(u64::from(i)));
                    self.start_prefill(now, e as usize);
                }
                Ev::PrefillDone(e) => self.prefill_done(now, e as usize),
                Ev::Handoff(i) => self.handoff(now, i as usize),
                Ev::DecodeDone(g) => self.decode_done(now, g as usize),
                Ev::Tick => {
                    self.tick(now);
                    if self.pending > 0 || !self.q.is_empty() {
                        self.q.push(now + self.cfg.series_interval, Ev::Tick);
                    }
                }
            }
        }
        Ok(())
    }

    fn generation(&self) -> u64 {
        let s = self.store.stats();
        s.evictions + s.expirations
    }

    /// Entrypoint prefix match: leading full blocks of the prompt present in the store.
    fn cached_blocks(&mut self, now: Nanos, i: usize) -> u32 {
        let blocks = self.blocks_within(i, self.reqs[i].prompt_tokens);
        let ReqIx { session: s, chain } = self.ix[i];
        self.store.advance(now);
        let generation = self.generation();
        let start = match self.memo.get(s as usize) {
            Some(m) if m.chain == chain && m.generation == generation => {
                self.memo_lookups += 1;
                (m.blocks as usize).min(blocks.len())
            }
            _ => {
                self.full_lookups += 1;
                0
            }
        };
        let b = start + self.store.lookup_prefix(now, &blocks[start..]);
        if let Some(m) = self.memo.get_mut(s as usize) {
            if m.chain != chain {
                m.touched_at = Nanos::ZERO;
            }
            m.chain = chain;
            m.blocks = b as u32;
            m.generation = generation;
        }
        b as u32
    }

    /// Where request `i`'s prefix look-up will start, by its session's memo now (a hint for
    /// prefetching: the store may change before it arrives).
    fn lookup_start_hint(&self, i: usize) -> usize {
        let ReqIx { session, chain } = self.ix[i];
        match self.memo.get(session as usize) {
            Some(m) if m.chain == chain => m.blocks as usize,
            _ => 0,
        }
    }

    /// Writes (or touches) the blocks `[0, upto)` of `r`'s chain; with a valid memo only the
    /// new ones, re-touching the reused run at most once per `touch_coalesce`.
    fn write_blocks(&mut self, now: Nanos, i: usize, upto_tokens: u32) {
        let all = self.blocks_within(i, upto_tokens);
        let ReqIx { session, chain } = self.ix[i];
        let s = session as usize;
        self.store.advance(now);
        let before = self.generation();
        let coalesce = self.cfg.touch_coalesce;
        let memo = self.memo.get(s).copied();
        let start = match memo {
            Some(m)
                if m.chain == chain
                    && m.generation == before
                    && now.saturating_sub(m.touched_at) < coalesce =>
            {
                (m.blocks as usize).min(all.len())
            }
            _ => 0,
        };
        self.store
            .touch_or_insert(now, &all[start..], self.reqs[i].class);
        let after = self.generation();
        if let Some(m) = self.memo.get_mut(s) {
            // (A session's first write finds no memo of its chain: start is 0.)
            if start == 0 {
                m.touched_at = now;
            }
            m.chain = chain;
            // Removals during the write may have taken our own blocks: trust nothing then.
            m.blocks = if after == before { all.len() as u32 } else { 0 };
            m.generation = after;
        }
    }

    fn swa_key(key: BlockKey) -> BlockKey {
        BlockKey(hash2(key.0, SWA_OBJECT_TAG))
    }

    fn reject(&mut self, i: usize, why: Rejection) {
        self.state[i].status = Status::Rejected(why);
        self.rejected[why as usize] += 1;
        self.pending -= 1;
        self.sample_row(i);
    }

    /// Before writing several requests' blocks: starts loading the keys below `upto` tokens,
    /// so the cache misses of the whole batch overlap.
    fn prefetch_chains(&self, reqs: impl Iterator<Item = usize>, upto: impl Fn(&Request) -> u32) {
        for i in reqs {
            prefetch_tail(self.blocks_within(i, upto(&self.reqs[i])));
        }
    }

    /// Before request `i`'s blocks below `upto` tokens are written (one request of a batch
    /// ahead: its keys, from [`Self::prefetch_chains`], have arrived by then), starts loading
    /// what the write will probe: the store slot of the first block past the session's memo
    /// and the SWA directory entry of the state stored at the last full block.
    fn prefetch_write(&self, i: usize, upto: u32) {
        let blocks = self.blocks_within(i, upto);
        if let Some(&k) = blocks.get(self.lookup_start_hint(i)) {
            self.store.prefetch(k);
        }
        if self.cfg.hit_policy.swa_source() == SwaSource::HostCache
            && let Some(&k) = blocks.last()
        {
            self.swa.prefetch(k);
        }
    }

    /// One arrival ahead of request `i`: starts loading what its arrival will probe, by its
    /// session's memo now (the store may change before it arrives, so these are hints): the
    /// table slot of its look-up's first key and, under the SWA host cache, the directory entry
    /// the hit rule asks for and the keys of the fetch's stripes (`fetch`: the hit ends at the
    /// cached prefix capped at L − margin, and so does the reused run in both of the rule's
    /// cases).
    fn prefetch_arrival(&self, i: usize) {
        let r = &self.reqs[i];
        let blocks = self.blocks_within(i, r.prompt_tokens);
        let start = self.lookup_start_hint(i);
        if let Some(&k) = blocks.get(start) {
            self.store.prefetch(k);
        }
        if self.cfg.hit_policy.swa_source() != SwaSource::HostCache {
            return;
        }
        let c = &self.cfg.constants;
        let cap = (r.prompt_tokens.saturating_sub(c.hit_margin_tokens()) / c.block_tokens) as usize;
        let hit = start.min(blocks.len()).min(cap);
        if hit == 0 {
            return;
        }
        self.swa.prefetch(blocks[hit - 1]);
        let stripes = (self.cfg.fetch.stripes as usize).min(hit);
        for s in 0..stripes {
            prefetch_read(&raw const blocks[s * hit / stripes]);
        }
    }

    fn arrive(&mut self, now: Nanos, i: usize) {
        // The trace's chains were built long ago and are cold, and so is the store's table:
        // a pipeline over the next arrivals starts loading, two ahead, the keys it will look up
        // (its prompt's last blocks) and its session's memo; one ahead, what it will probe.
        if let Some(r) = self.reqs.get(i + 2) {
            prefetch_tail(self.blocks_within(i + 2, r.prompt_tokens));
            if let Some(m) = self.memo.get(self.ix[i + 2].session as usize) {
                prefetch_read(m);
            }
        }
        if i + 1 < self.reqs.len() {
            self.prefetch_arrival(i + 1);
        }
        let r = &self.reqs[i];
        let c = &self.cfg.constants;
        self.pending += 1;
        self.cur.arrivals += 1;
        if u64::from(r.context_tokens()) > self.cfg.decode.kv_capacity_tokens_per_rank {
            self.reject(i, Rejection::ContextTooLarge);
            return;
        }
        let policy = self.cfg.hit_policy;
        let perfect_hit = if policy.uses_perfect_cache() {
            self.perfect.hit_tokens(r)
        } else {
            0
        };
        let cached = if policy.uses_perfect_cache() {
            0
        } else {
            self.cached_blocks(now, i) * c.block_tokens
        };
        let inputs = HitInputs {
            prompt_tokens: r.prompt_tokens,
            cached_block_tokens: cached,
            perfect_hit_tokens: if policy.uses_perfect_cache() {
                perfect_hit
            } else {
                cached
            },
        };
        let mut swa_machine = None;
        let keys = self.keys(i);
        let decision = {
            let (store, swa) = (&mut self.store, &mut self.swa);
            policy.decide(c, inputs, |p| {
                let Some(key) = key_at(keys, r, c.block_tokens, p) else {
                    return false;
                };
                match policy.swa_source() {
                    SwaSource::HostCache => {
                        swa_machine = swa.lookup(now, key);
                        swa_machine.is_some()
                    }
                    SwaSource::BlockStore => store.contains(now, Self::swa_key(key)),
                    SwaSource::NotNeeded => true,
                }
            })
        };
        if policy.uses_perfect_cache() {
            self.perfect.record_prompt(r);
        }
        let st = &mut self.state[i];
        st.hit_tokens = decision.hit_tokens;
        st.encoder_tokens = decision.encoder_tokens;
        st.swa_machine = if decision.swa_state_at.is_some() {
            swa_machine
        } else {
            None
        };
        let (layers, dec_layers) = if decision.decoder_only {
            (c.total_layers(), 0)
        } else {
            (c.encoder_layers, c.decoder_layers)
        };
        let job = PrefillJob {
            request: RequestId(i as u64),
            prompt_tokens: r.prompt_tokens,
            hit_tokens: decision.hit_tokens,
            encoder_tokens: decision.encoder_tokens,
            new_token_layers: layers,
            decoder_tokens: if decision.decoder_only {
                0
            } else {
                decision.decoder_tokens
            },
            decoder_layers: dec_layers,
            swap_in_bytes: u64::from(decision.reused_kv_tokens()) * u64::from(c.kv_bytes_per_token),
            ready: false,
            done_tokens: 0,
            first_step_at: None,
        };
        let compute_ns = PrefillEngine::job_ns(
            &self.backend.profile().prefill,
            &job,
            self.cfg.prefill.expert_imbalance,
        );
        let qp = QueuedPrefill {
            request: job.request,
            context_tokens: r.prompt_tokens,
            compute_ns,
            queued_at: now,
        };
        self.waiting_jobs.insert(i as u64, job);
        if matches!(self.cfg.prefill.lb, PrefillLbPolicy::LeastLoaded) {
            for (l, e) in self.loads.iter_mut().zip(&self.prefill) {
                *l = e.remaining_ns();
            }
        }
        match self.lb.submit(now, qp, &self.loads) {
            Submitted::Routed(e, _) => self.assign(now, i, e.0 as usize),
            Submitted::Queued => self.pull_all(now),
            Submitted::Rejected(_) => {
                self.waiting_jobs.remove(&(i as u64));
                self.reject(i, Rejection::PrefillQueueFull)
            }
        }
    }

    fn pull_all(&mut self, now: Nanos) {
        if !self.lb.pulls() {
            return;
        }
        for e in 0..self.prefill.len() {
            if self.lb.queued() == 0 {
                return;
            }
            while self.prefill[e].has_room() {
                let load = self.prefill[e].remaining_ns();
                let Some(q) = self.lb.pull(now, EngineId(e as u32), load) else {
                    break;
                };
                self.assign(now, q.request.0 as usize, e);
            }
        }
    }

    /// The request's job joins engine `e`; its KV fetch and SWA pull start now.
    fn assign(&mut self, now: Nanos, i: usize, e: usize) {
        let c = &self.cfg.constants;
        let st = self.state[i];
        let job = self
            .waiting_jobs
            .remove(&(i as u64))
            .expect("a submitted request has its job");
        // The hit and the encoder-replayed blocks are both read from the store.
        let reused = (job.swap_in_bytes / u64::from(c.kv_bytes_per_token)) as u32;
        self.state[i].engine = e as u32;
        if self.prefill[e].enqueue(job).is_err() {
            self.reject(i, Rejection::PrefillEngineFull);
            return;
        }
        let mut ready = now;
        if reused > 0 {
            ready = ready.max(self.fetch(now, i, reused));
        }
        let machine = e as u32 / self.cfg.prefill.gpus_per_machine;
        if let Some(m) = st.swa_machine
            && m.0 != machine
        {
            let bytes = c.swa_state_bytes() as f64;
            let t = Nanos::from_secs_f64(bytes / self.cfg.links.swa_pull_bytes_per_s)
                + self.cfg.links.swa_pull_latency;
            ready = ready.max(now + t);
        }
        if ready == now {
            self.prefill[e].set_ready(RequestId(i as u64));
            self.start_prefill(now, e);
        } else {
            self.q.push(ready, Ev::Ready(i as u32));
        }
    }

    /// Reads `tokens` of `r`'s prefix from the store: `stripes` erasure-coded reads, each sent
    /// to data + 1 nodes of its group and done at the data-th answer. Returns when all are done.
    fn fetch(&mut self, now: Nanos, i: usize, tokens: u32) -> Nanos {
        let c = &self.cfg.constants;
        let f = &self.cfg.fetch;
        let r = &self.reqs[i];
        let keys = self.blocks_within(i, tokens.div_ceil(c.block_tokens) * c.block_tokens);
        let bytes = u64::from(tokens) * u64::from(c.kv_bytes_per_token);
        let stripes = (f.stripes as usize).min(keys.len()).max(1);
        let data = self.cfg.store.ec_data_shards as usize;
        let ask = (data + 1).min(data + self.cfg.store.ec_parity_shards as usize);
        let per_node = bytes as f64 / stripes as f64 / data as f64;
        let transfer = Nanos::from_secs_f64(per_node / f.node_read_bytes_per_s);
        let mut done = now;
        let mut answers = [Nanos::ZERO; 64];
        // The stripes' keys sit far apart in a long chain: load them all before the loop
        // below, so their cache misses overlap instead of stalling one stripe each.
        let mut stripe_keys = std::mem::take(&mut self.stripe_keys);
        stripe_keys.clear();
        stripe_keys.extend((0..stripes).map(|s| {
            keys.get(s * keys.len() / stripes)
                .copied()
                .unwrap_or(BlockKey(r.id.0))
        }));
        for &key in &stripe_keys {
            for (a, node) in self.store.placement_nodes(key).take(ask).enumerate() {
                let busy = &mut self.node_busy[node.0 as usize];
                let start = (*busy).max(now);
                *busy = start + transfer;
                // Ziggurat sampling: almost never a logarithm (88 draws per fetch).
                let x: f64 = self.rng.sample(rand_distr::Exp1);
                let tail = nanos_from_secs(x * f.tail_mean.as_secs_f64());
                answers[a.min(63)] = *busy + f.latency + tail;
            }
            let got = &mut answers[..ask.min(64)];
            let k = data.min(got.len());
            done = done.max(kth_smallest(got, k));
        }
        self.stripe_keys = stripe_keys;
        done
    }

    fn start_prefill(&mut self, now: Nanos, e: usize) {
        let StepPlan::Prefill(plan) = &mut self.prefill_plans[e] else {
            unreachable!("prefill plan")
        };
        if !self.prefill[e].plan_step(now, plan) {
            return;
        }
        let mut extra = Nanos::ZERO;
        if let Some(m) = self.prefill_moe.get_mut(e) {
            // The instance's DP ranks run similar batches: its MoE layers see `ep.gpus` of them.
            let dp = self.prefill_moe_dp;
            let moe = m.step(
                now,
                MoeBatch {
                    tokens: plan.new_tokens() * dp,
                    sequences: plan.chunks.len() as u64 * dp,
                },
            );
            plan.expert_imbalance = moe.imbalance;
            extra = moe.reassignment_cost_ns;
            self.reassignments += u64::from(moe.reassigned);
            self.reassignment_ns += extra.0;
        }
        self.imbalance_sums[0].0 += plan.expert_imbalance;
        self.imbalance_sums[0].1 += 1;
        for c in &plan.chunks {
            let st = &mut self.state[c.request.0 as usize];
            if st.first_step == Nanos::ZERO {
                st.first_step = now.max(Nanos(1));
            }
        }
        self.backend
            .execute(now, &self.prefill_plans[e], &mut self.report);
        let d = self.report.duration + extra;
        let s = &mut self.prefill_stats[e];
        s.busy_ns += d.0;
        s.steps += 1;
        let StepPlan::Prefill(plan) = &self.prefill_plans[e] else {
            unreachable!("prefill plan")
        };
        let toks = plan.new_tokens();
        s.tokens += toks;
        s.batch += plan.chunks.len() as u64;
        self.cur_prefill_tokens += toks;
        self.cur_prefill_busy += d.0;
        if self.in_steady(now) {
            self.steady.prefill_busy_ns += d.0;
            self.steady.prefill_tokens += toks;
        }
        self.q.push(now + d, Ev::PrefillDone(e as u32));
    }

    fn prefill_done(&mut self, now: Nanos, e: usize) {
        let StepPlan::Prefill(plan) = &self.prefill_plans[e] else {
            unreachable!("prefill plan")
        };
        let mut done = std::mem::take(&mut self.finished_jobs);
        done.clear();
        self.prefill[e].complete_step(plan, &mut done);
        let c = self.cfg.constants.clone();
        let machine = MachineId(e as u32 / self.cfg.prefill.gpus_per_machine);
        self.prefetch_chains(done.iter().map(|j| j.request.0 as usize), |r| {
            r.prompt_tokens
        });
        for (n, job) in done.iter().enumerate() {
            if let Some(next) = done.get(n + 1) {
                let j = next.request.0 as usize;
                self.prefetch_write(j, self.reqs[j].prompt_tokens);
            }
            let i = job.request.0 as usize;
            let r = &self.reqs[i];
            self.state[i].first_token = now;
            self.state[i].last_token = now;
            self.state[i].emitted = 1;
            self.write_blocks(now, i, r.prompt_tokens);
            // SWA state at the last 128-multiple of the prompt (SPEC §5).
            let at = (r.prompt_tokens / c.block_tokens) * c.block_tokens;
            if let Some(key) = key_at(self.keys(i), r, c.block_tokens, at) {
                self.store_swa(now, machine, key, r.class);
            }
            if r.output_tokens <= 1 {
                self.complete(now, i);
                continue;
            }
            let bytes =
                u64::from(r.prompt_tokens) * u64::from(c.kv_bytes_per_token) + c.swa_state_bytes();
            let m = machine.0 as usize;
            let start = self.handoff_busy[m].max(now);
            self.handoff_busy[m] = start
                + Nanos::from_secs_f64(
                    bytes as f64 / self.cfg.links.handoff_bytes_per_s_per_machine,
                );
            self.q.push(
                self.handoff_busy[m] + self.cfg.links.handoff_latency,
                Ev::Handoff(i as u32),
            );
        }
        self.finished_jobs = done;
        self.pull_all(now);
        self.start_prefill(now, e);
    }

    fn store_swa(&mut self, now: Nanos, machine: MachineId, key: BlockKey, class: TrafficClass) {
        match self.cfg.hit_policy.swa_source() {
            SwaSource::HostCache => self.swa.store(now, machine, key),
            SwaSource::BlockStore => {
                self.store.put(
                    now,
                    Self::swa_key(key),
                    self.cfg.constants.swa_state_bytes(),
                    class,
                );
            }
            SwaSource::NotNeeded => {}
        }
    }

    fn handoff(&mut self, now: Nanos, i: usize) {
        let r = &self.reqs[i];
        let (g, rank) = self.dlb.pick(&self.groups, u64::from(r.context_tokens()));
        self.state[i].decode_group = g as u32;
        // The first token came from prefill; decode holds prompt + 1 and emits the rest.
        if self.groups[g]
            .admit(
                rank,
                RequestId(i as u64),
                r.prompt_tokens + 1,
                r.output_tokens - 1,
            )
            .is_err()
        {
            self.reject(i, Rejection::DecodeQueueFull);
            return;
        }
        if !self.decode[g].in_flight {
            self.start_decode(now, g);
        }
    }

    /// Starts group `g`'s next step at `now` (building its plan unless async already did).
    fn start_decode(&mut self, now: Nanos, g: usize) {
        let d = &mut self.decode[g];
        let group = &mut self.groups[g];
        if d.next_built {
            d.plans.swap(0, 1);
            d.next_built = false;
        } else {
            let StepPlan::Decode(p) = &mut d.plans[0] else {
                unreachable!("decode plan")
            };
            group.plan_step(p);
        }
        let StepPlan::Decode(p) = &d.plans[0] else {
            unreachable!("decode plan")
        };
        if p.seqs.is_empty() {
            d.in_flight = false;
            return;
        }
        d.in_flight = true;
        if let Some(m) = self.decode_moe.get_mut(g) {
            let StepPlan::Decode(p) = &mut d.plans[0] else {
                unreachable!("decode plan")
            };
            let queries: u64 = p
                .ranks
                .iter()
                .map(|r| u64::from(r.seq_end - r.seq_start) + u64::from(r.verify_budget))
                .sum();
            let moe = m.step(
                now,
                MoeBatch {
                    tokens: queries,
                    sequences: p.seqs.len() as u64,
                },
            );
            p.expert_imbalance = moe.imbalance;
            // The weight shuffle runs after the step, before the next one.
            d.report.duration = moe.reassignment_cost_ns;
            self.reassignments += u64::from(moe.reassigned);
            self.reassignment_ns += moe.reassignment_cost_ns.0;
        } else {
            d.report.duration = Nanos::ZERO;
        }
        let extra = d.report.duration;
        let StepPlan::Decode(p) = &d.plans[0] else {
            unreachable!("decode plan")
        };
        self.imbalance_sums[1].0 += p.expert_imbalance;
        self.imbalance_sums[1].1 += 1;
        self.backend.execute(now, &d.plans[0], &mut d.report);
        d.report.duration += extra;
        let dur = d.report.duration;
        let s = &mut self.decode_stats[g];
        s.busy_ns += dur.0;
        s.steps += 1;
        s.batch += p.seqs.len() as u64;
        let cap = self.cfg.decode.kv_capacity_tokens_per_rank as f64 * f64::from(group.ranks());
        let kv: u64 = (0..group.ranks()).map(|r| group.rank_occupancy(r).1).sum();
        s.kv_weighted += kv as f64 / cap * dur.0 as f64;
        self.cur_kv += kv as f64 / cap * dur.0 as f64;
        self.cur_decode_seq_steps += p.seqs.len() as u64;
        self.cur_decode_steps += u64::from(group.ranks());
        let verified = d
            .report
            .seqs
            .iter()
            .map(|o| u64::from(o.verified))
            .sum::<u64>();
        self.verified += verified;
        if now >= self.steady_window.0 && now < self.steady_window.1 {
            let st = &mut self.steady;
            st.decode_busy_ns += dur.0;
            st.decode_steps += 1;
            st.decode_seq_steps += p.seqs.len() as u64;
            st.decode_rank_steps += u64::from(group.ranks());
            st.verified += verified;
        }
        self.q.push(now + dur, Ev::DecodeDone(g as u32));
    }

    fn decode_done(&mut self, now: Nanos, g: usize) {
        let asynchronous = self.cfg.decode.scheduling == Scheduling::Async;
        // Credited to the step's start, like its busy time.
        let steady = self.in_steady(now - self.decode[g].report.duration);
        let d = &mut self.decode[g];
        let group = &mut self.groups[g];
        self.finished_seqs.clear();
        let mut em = Emissions {
            now,
            warmup: self.cfg.warmup,
            until: self.cfg.measure_until,
            reqs: self.reqs,
            state: &mut self.state,
            side: &mut d.side,
            gaps: &mut self.lat.gap_ns,
            finished: &mut self.finished_seqs,
            emissions: 0,
            tokens: 0,
            measured_tokens: 0,
            gap_run: (0, 0),
        };
        let [StepPlan::Decode(cur), StepPlan::Decode(next)] = &mut d.plans else {
            unreachable!("decode plans")
        };
        if asynchronous {
            // The CPU built step N+1 while step N ran, before knowing N's acceptances: planned
            // in the same pass over the slots that applies N's report.
            d.next_built =
                group.plan_and_apply_taking(next, cur, &mut d.report, |k, e| em.emit(k, e));
        } else {
            group.apply_report_taking(cur, &mut d.report, |k, e| em.emit(k, e));
        }
        let (emissions, tokens, measured_tokens) = em.finish();
        if steady {
            self.steady.decode_emissions += emissions;
            self.steady.decode_tokens += tokens;
        }
        self.decode_stats[g].tokens += tokens;
        self.cur_decode_tokens += tokens;
        self.seq_steps += emissions;
        self.tokens[3] += measured_tokens;
        let finished = std::mem::take(&mut self.finished_seqs);
        self.prefetch_chains(finished.iter().map(|&i| i as usize), |r| r.context_tokens());
        for (n, &i) in finished.iter().enumerate() {
            if let Some(&j) = finished.get(n + 1) {
                let j = j as usize;
                self.prefetch_write(j, self.reqs[j].context_tokens());
            }
            self.complete(now, i as usize);
        }
        self.finished_seqs = finished;
        self.decode[g].in_flight = false;
        let start = if asynchronous {
            now
        } else {
            now + self.backend.profile().transfer.sync_gap
        };
        self.start_decode(start, g);
    }

    fn complete(&mut self, now: Nanos, i: usize) {
        let r = &self.reqs[i];
        let c = &self.cfg.constants;
        self.state[i].status = Status::Done;
        self.pending -= 1;
        self.completed += 1;
        self.cur.completions += 1;
        if r.output_tokens > 1 {
            self.write_blocks(now, i, r.context_tokens());
            let at = (r.context_tokens() / c.block_tokens) * c.block_tokens;
            let machine = self
                .cfg
                .prefill
                .gpus
                .div_ceil(self.cfg.prefill.gpus_per_machine)
                + self.decode[self.state[i].decode_group as usize].first_rank_gpu
                    / self.cfg.decode.gpus_per_machine;
            if let Some(key) = key_at(self.keys(i), r, c.block_tokens, at) {
                self.store_swa(now, MachineId(machine), key, r.class);
            }
        }
        if self.cfg.hit_policy.uses_perfect_cache() {
            self.perfect.record_output(r);
        }
        if self.measured(i) {
            let st = self.state[i];
            self.measured += 1;
            self.measured_first = self.measured_first.min(r.arrival);
            self.measured_last = self.measured_last.max(now);
            let ttft = st.first_token - r.arrival;
            let e2e = st.last_token - r.arrival;
            let queue = st.first_step - r.arrival;
            for l in [&mut self.lat, &mut self.lat_class[r.class.index()]] {
                l.ttft_ns.record(ttft.0);
                l.e2e_ns.record(e2e.0);
                l.queue_ns.record(queue.0);
                if r.output_tokens > 1 {
                    l.tpot_ns.record(
                        (st.last_token - st.first_token).0 / u64::from(r.output_tokens - 1),
                    );
                }
            }
            self.tokens[0] += u64::from(r.prompt_tokens);
            self.tokens[1] += u64::from(st.hit_tokens);
            self.tokens[2] += u64::from(st.encoder_tokens);
        }
        self.sample_row(i);
    }

    fn sample_row(&mut self, i: usize) {
        if !i.is_multiple_of(self.cfg.sample_every as usize) {
            return;
        }
        let r = &self.reqs[i];
        let st = self.state[i];
        let done = st.status == Status::Done;
        let ms = |n: Nanos| n.as_millis_f64();
        self.rows.push(RequestRow {
            request: r.id.0,
            class: r.class.name(),
            arrival_s: r.arrival.as_secs_f64(),
            prompt_tokens: r.prompt_tokens,
            output_tokens: r.output_tokens,
            hit_tokens: st.hit_tokens,
            outcome: match st.status {
                Status::Done => "completed",
                Status::Rejected(why) => why.name(),
                Status::Pending => "pending",
            },
            queue_ms: if done {
                ms(st.first_step - r.arrival)
            } else {
                f64::NAN
            },
            ttft_ms: if done {
                ms(st.first_token - r.arrival)
            } else {
                f64::NAN
            },
            tpot_ms: if done && r.output_tokens > 1 {
                ms(st.last_token - st.first_token) / f64::from(r.output_tokens - 1)
            } else {
                f64::NAN
            },
            max_gap_ms: if done { ms(st.max_gap) } else { f64::NAN },
            e2e_s: if done {
                (st.last_token - r.arrival).as_secs_f64()
            } else {
                f64::NAN
            },
        });
    }

    fn tick(&mut self, now: Nanos) {
        let dt = self.cfg.series_interval.as_secs_f64();
        let decode_gpus = f64::from(self.cfg.decode.groups * self.cfg.decode.ranks);
        let prefill_gpus = f64::from(self.cfg.prefill.gpus);
        let busy_ns = dt * 1e9;
        let mut row = std::mem::take(&mut self.cur);
        row.t_s = now.as_secs_f64();
        row.prefill_tokens_per_s_per_gpu = self.cur_prefill_tokens as f64 / dt / prefill_gpus;
        row.decode_tokens_per_s_per_gpu = self.cur_decode_tokens as f64 / dt / decode_gpus;
        row.prefill_busy = self.cur_prefill_busy as f64 / busy_ns / prefill_gpus;
        row.decode_seqs_per_rank =
            self.cur_decode_seq_steps as f64 / self.cur_decode_steps.max(1) as f64;
        row.kv_occupancy = self.cur_kv / busy_ns / f64::from(self.cfg.decode.groups);
        row.prefill_queued =
            self.lb.queued() as u64 + self.prefill.iter().map(|e| e.jobs() as u64).sum::<u64>();
        self.series.push(row);
        self.cur_prefill_tokens = 0;
        self.cur_decode_tokens = 0;
        self.cur_prefill_busy = 0;
        self.cur_decode_seq_steps = 0;
        self.cur_decode_steps = 0;
        self.cur_kv = 0.0;
    }

    fn finish(self) -> Result<ServiceReport, ConfigError> {
        let fail = |why: String| Err(ConfigError::invalid("invariant", why));
        let arrivals = self.reqs.len() as u64;
        let rejected: u64 = self.rejected.iter().sum();
        if let Some(i) = self.state.iter().position(|s| s.status == Status::Pending) {
            return fail(format!(
                "request {} neither completed nor rejected",
                self.reqs[i].id
            ));
        }
        if self.completed + rejected != arrivals || self.pending != 0 {
            return fail(format!(
                "{arrivals} arrivals but {} completed + {rejected} rejected",
                self.completed
            ));
        }
        for g in &self.groups {
            g.check_invariants()
                .map_err(|e| ConfigError::invalid("invariant", e))?;
            if !g.is_idle() {
                return fail("a decode group still holds sequences".into());
            }
        }
        if self.prefill.iter().any(|e| e.jobs() > 0) || self.lb.queued() > 0 {
            return fail("prefill work left over".into());
        }
        self.swa
            .check_invariants()
            .map_err(|e| ConfigError::invalid("invariant", e))?;
        self.store
            .check_invariants()
            .map_err(|e| ConfigError::invalid("invariant", e))?;
        let end = self.q.now();
        let span = (self.measured_last - self.measured_first)
            .as_secs_f64()
            .max(1e-9);
        let prefill_gpus = f64::from(self.cfg.prefill.gpus);
        let decode_gpus = f64::from(self.cfg.decode.groups * self.cfg.decode.ranks);
        let total_busy_p: u64 = self.prefill_stats.iter().map(|s| s.busy_ns).sum();
        let total_busy_d: u64 = self.decode_stats.iter().map(|s| s.busy_ns).sum();
        let total_tok_p: u64 = self.prefill_stats.iter().map(|s| s.tokens).sum();
        let total_tok_d: u64 = self.decode_stats.iter().map(|s| s.tokens).sum();
        let seqs: u64 = self.decode_stats.iter().map(|s| s.batch).sum();
        let steps: u64 = self.decode_stats.iter().map(|s| s.steps).sum();
        let t = end.as_secs_f64().max(1e-9);
        let mut engines = Vec::new();
        for (i, s) in self.prefill_stats.iter().enumerate() {
            engines.push(EngineRow {
                pool: "prefill",
                engine: i as u32,
                utilisation: s.busy_ns as f64 / (t * 1e9),
                tokens_per_s_per_gpu: s.tokens as f64 / t,
                steps: s.steps,
                mean_batch: s.batch as f64 / s.steps.max(1) as f64,
                mean_kv_occupancy: f64::NAN,
            });
        }
        for (i, s) in self.decode_stats.iter().enumerate() {
            let ranks = f64::from(self.cfg.decode.ranks);
            engines.push(EngineRow {
                pool: "decode",
                engine: i as u32,
                utilisation: s.busy_ns as f64 / (t * 1e9),
                tokens_per_s_per_gpu: s.tokens as f64 / t / ranks,
                steps: s.steps,
                mean_batch: s.batch as f64 / s.steps.max(1) as f64 / ranks,
                mean_kv_occupancy: s.kv_weighted / s.busy_ns.max(1) as f64,
            });
        }
        let swa = self.swa.stats();
        let st = &self.steady;
        let (w0, w1) = self.steady_window;
        let span_ns = w1.saturating_sub(w0).0.max(1) as f64;
        let ranks = f64::from(self.cfg.decode.ranks);
        let steady = SteadyState {
            start_s: w0.as_secs_f64(),
            end_s: w1.max(w0).as_secs_f64(),
            decode_tokens_per_s_per_gpu: st.decode_tokens as f64
                / (st.decode_busy_ns.max(1) as f64 / 1e9)
                / ranks,
            decode_tokens_per_s_per_gpu_wall: st.decode_tokens as f64
                / (span_ns / 1e9)
                / decode_gpus,
            decode_seqs_per_rank: st.decode_seq_steps as f64 / st.decode_rank_steps.max(1) as f64,
            decode_utilisation: st.decode_busy_ns as f64
                / span_ns
                / f64::from(self.cfg.decode.groups),
            decode_step_ms: st.decode_busy_ns as f64 / st.decode_steps.max(1) as f64 / 1e6,
            verified_drafts_per_seq_step: st.verified as f64 / st.decode_seq_steps.max(1) as f64,
            accepted_length: st.decode_tokens as f64 / st.decode_emissions.max(1) as f64,
            prefill_tokens_per_s_per_gpu: st.prefill_tokens as f64
                / (st.prefill_busy_ns.max(1) as f64 / 1e9),
            prefill_utilisation: st.prefill_busy_ns as f64 / span_ns / prefill_gpus,
        };
        Ok(ServiceReport {
            arrivals,
            completed: self.completed,
            rejected: Rejection::ALL
                .iter()
                .map(|r| (r.name(), self.rejected[*r as usize]))
                .collect(),
            measured_requests: self.measured,
            measured_span_s: span,
            simulated_s: t,
            events: self.q.popped(),
            by_class: TrafficClass::ALL
                .iter()
                .map(|c| (c.name(), self.lat_class[c.index()].clone()))
                .collect(),
            all: self.lat,
            input_tokens: self.tokens[0],
            hit_tokens: self.tokens[1],
            encoder_tokens: self.tokens[2],
            output_tokens: self.tokens[3],
            // Busy-time rates: what a GPU delivers while it works (the published figures are
            // per busy GPU), alongside utilisation.
            prefill_tokens_per_s_per_gpu: total_tok_p as f64 / (total_busy_p.max(1) as f64 / 1e9),
            decode_tokens_per_s_per_gpu: total_tok_d as f64
                / (total_busy_d.max(1) as f64 / 1e9)
                / f64::from(self.cfg.decode.ranks),
            decode_seqs_per_rank: seqs as f64
                / steps.max(1) as f64
                / f64::from(self.cfg.decode.ranks),
            verified_drafts_per_seq_step: self.verified as f64 / seqs.max(1) as f64,
            accepted_length: total_tok_d as f64 / self.seq_steps.max(1) as f64,
            prefill_utilisation: total_busy_p as f64 / (t * 1e9) / prefill_gpus,
            decode_utilisation: total_busy_d as f64
                / (t * 1e9)
                / (decode_gpus / f64::from(self.cfg.decode.ranks)),
            swa_hit_rate: swa.hits as f64 / swa.lookups.max(1) as f64,
            store_used_bytes: self.store.used_bytes(),
            prefill_mean_imbalance: self.imbalance_sums[0].0
                / self.imbalance_sums[0].1.max(1) as f64,
            decode_mean_imbalance: self.imbalance_sums[1].0
                / self.imbalance_sums[1].1.max(1) as f64,
            moe_reassignments: self.reassignments,
            moe_reassignment_s: self.reassignment_ns as f64 / 1e9,
            steady,
            full_prefix_lookups: self.full_lookups,
            memo_prefix_lookups: self.memo_lookups,
            requests: self.rows,
            series: self.series,
            engines,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn nanos_from_secs_matches_nanos(s in prop_oneof![0.0..1e-3f64, 0.0..1e3f64, -1.0..1e11f64],
                                         half in 0u64..1_000_000) {
            prop_assert_eq!(nanos_from_secs(s), Nanos::from_secs_f64(s));
            // Exact halves of a nanosecond round away from zero.
            let h = (half as f64 + 0.5) / 1e9;
            prop_assert_eq!(nanos_from_secs(h), Nanos::from_secs_f64(h));
        }

        /// The one-pass largest / second largest agrees with sorting, duplicates included.
        #[test]
        fn kth_smallest_matches_sorting(xs in proptest::collection::vec(0u64..20, 1..14), pick in 0usize..3) {
            let mut v: Vec<Nanos> = xs.iter().map(|&x| Nanos(x)).collect();
            let mut sorted = v.clone();
            sorted.sort();
            let k = v.len().saturating_sub(pick).max(1);
            prop_assert_eq!(kth_smallest(&mut v, k), sorted[k - 1]);
        }
    }
}
