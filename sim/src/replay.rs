//! Trace-level replay (no timing of compute): requests in arrival order through the KV store,
//! the SWA cache and one or more hit rules, counting hit tokens, encoder and decoder tokens,
//! layer-tokens (SPEC §4 accounting) and store statistics.
//!
//! Time still matters for TTLs and the SWA lifetime: a request's prompt blocks are written at
//! its arrival, and its outputs (and end-of-decode SWA state) at its estimated end of decode
//! (arrival + TTFT + output / decode rate). Writes due before an arrival are applied first.
//!
//! The store and the SWA cache evolve the same way whatever the hit rule decides (every prompt
//! block is touched or written), so one pass evaluates many rules at once. The exception is
//! SWA-on-SSD, whose SWA objects occupy the store: it gets a pass of its own.

use serde::{Deserialize, Serialize};
use servelab_core::hit::baseline_layer_tokens;
use servelab_core::{
    BlockKey, ConfigError, HitInputs, HitPolicy, KvStore, MachineId, Nanos, PerfectCache, Request,
    ServingConstants, StoreConfig, StoreStats, SwaCache, SwaConfig, SwaSource, SwaStats,
    TrafficClass,
};
use servelab_workloads::Trace;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReplayConfig {
    pub constants: ServingConstants,
    pub store: StoreConfig,
    pub swa: SwaConfig,
    /// Write each request's output blocks back to the store at the end of decode (SPEC §3.7).
    pub cache_outputs: bool,
    /// Estimated time to first token, seconds: when prefill's SWA state is stored.
    pub ttft_s: f64,
    /// Per-request generation speed, tokens/s: when outputs and end-of-decode SWA are stored.
    pub decode_tokens_per_s: f64,
}

impl Default for ReplayConfig {
    fn default() -> Self {
        ReplayConfig {
            constants: ServingConstants::default(),
            store: StoreConfig::default(),
            swa: SwaConfig::default(),
            cache_outputs: true,
            ttft_s: 0.4,
            decode_tokens_per_s: 230.0,
        }
    }
}

/// The replays have no storage nodes to fail: a failure schedule would be ignored, so it is an
/// error (the service simulator applies it).
fn no_node_failures(store: &StoreConfig) -> Result<(), ConfigError> {
    if store.has_failures() {
        let field = if store.failures.is_empty() {
            "store.random_failures"
        } else {
            "store.failures"
        };
        return Err(ConfigError::invalid(
            field,
            "the trace-level replay models no storage nodes; node failures need the service \
             simulator",
        ));
    }
    Ok(())
}

impl ReplayConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.constants.validate()?;
        self.store.validate(self.constants.block_bytes())?;
        no_node_failures(&self.store)?;
        self.swa.validate()?;
        if !(self.ttft_s.is_finite() && self.ttft_s >= 0.0) {
            return Err(ConfigError::invalid("timing.ttft_s", "must be >= 0"));
        }
        if !(self.decode_tokens_per_s.is_finite() && self.decode_tokens_per_s > 0.0) {
            return Err(ConfigError::invalid(
                "timing.decode_tokens_per_s",
                "must be positive",
            ));
        }
        Ok(())
    }
}

/// Totals for one hit rule over a replay.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct PolicyTotals {
    pub policy: String,
    pub hit_tokens: u64,
    pub encoder_tokens: u64,
    pub encoder_replay_tokens: u64,
    pub decoder_tokens: u64,
    pub layer_tokens: u64,
    /// Hits that used SWA state held by a machine other than the one serving the request.
    pub swa_cross_machine_pulls: u64,
    /// How often each reason decided (sorted by name).
    pub reasons: BTreeMap<String, u64>,
}

/// What a replay measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ReplayReport {
    pub requests: u64,
    pub input_tokens: u64,
    pub output_tokens: u64,
    /// Σ 40 × L: the no-cache ordinary-model baseline.
    pub baseline_layer_tokens: u64,
    /// Σ tokens of the longest previously seen prefix (perfect cache).
    pub perfect_hit_tokens: u64,
    /// Σ b: tokens of the leading run of full blocks found in the store.
    pub cached_block_tokens: u64,
    pub prompt_blocks: u64,
    pub prompt_blocks_hit: u64,
    pub per_policy: Vec<PolicyTotals>,
    pub store: StoreStats,
    pub swa: SwaStats,
}

impl ReplayReport {
    pub fn policy(&self, p: HitPolicy) -> Option<&PolicyTotals> {
        self.per_policy.iter().find(|t| t.policy == p.name())
    }
    pub fn hit_rate(&self, p: HitPolicy) -> Option<f64> {
        self.policy(p)
            .map(|t| ratio(t.hit_tokens, self.input_tokens))
    }
    pub fn compute_share(&self, p: HitPolicy) -> Option<f64> {
        self.policy(p)
            .map(|t| ratio(t.layer_tokens, self.baseline_layer_tokens))
    }
}

pub fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

/// Replays `trace` under every rule in `policies` (each rule's totals in `per_policy`, in the
/// given order). Store and SWA statistics are those of the first pass.
pub fn replay(
    trace: &Trace,
    cfg: &ReplayConfig,
    policies: &[HitPolicy],
) -> Result<ReplayReport, ConfigError> {
    cfg.validate()?;
    if trace.block_tokens != cfg.constants.block_tokens {
        return Err(ConfigError::invalid(
            "constants.block_tokens",
            format!(
                "the trace is keyed at {} tokens per block but the replay uses {}",
                trace.block_tokens, cfg.constants.block_tokens
            ),
        ));
    }
    let (ssd, host): (Vec<HitPolicy>, Vec<HitPolicy>) = policies
        .iter()
        .partition(|p| p.swa_source() == SwaSource::BlockStore);
    let mut report: Option<ReplayReport> = None;
    for group in [host, ssd] {
        if group.is_empty() {
            continue;
        }
        let r = ReplayPass::with(cfg, &group, group[0] == HitPolicy::SwaOnSsd)?.run(trace);
        match &mut report {
            None => report = Some(r),
            Some(rep) => rep.per_policy.extend(r.per_policy),
        }
    }
    let mut rep = match report {
        Some(r) => r,
        None => ReplayPass::with(cfg, &[], false)?.run(trace),
    };
    // Restore the caller's order.
    rep.per_policy
        .sort_by_key(|t| policies.iter().position(|p| p.name() == t.policy));
    Ok(rep)
}

/// A request whose outputs (and end-of-decode SWA state) are written at `at`.
struct PendingOutput {
    at: Nanos,
    seq: u64,
    req: Request,
}

impl PartialEq for PendingOutput {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}
impl Eq for PendingOutput {}
impl PartialOrd for PendingOutput {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for PendingOutput {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

/// What one request found in a replay.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestHits {
    /// Tokens of the leading run of full blocks found in the store.
    pub cached_block_tokens: u32,
    /// Tokens of the longest prefix seen before (a perfect cache).
    pub perfect_hit_tokens: u32,
}

/// One replay pass, fed a request at a time in arrival order ([`Self::push`]): what
/// [`replay`] runs over a trace, and what a stream of requests (days of them) runs through
/// without holding them. Holds only the requests whose outputs are still to be written.
pub struct ReplayPass<'a> {
    cfg: &'a ReplayConfig,
    policies: Vec<HitPolicy>,
    swa_in_store: bool,
    store: KvStore,
    swa: SwaCache,
    perfect: PerfectCache,
    pending: BinaryHeap<Reverse<PendingOutput>>,
    seq: u64,
    policy_hits: Vec<u32>,
    report: ReplayReport,
}

impl<'a> ReplayPass<'a> {
    /// A pass evaluating `policies`, which must all take their SWA state from the same
    /// place (SWA-on-SSD keeps it in the store and needs a pass of its own).
    pub fn new(cfg: &'a ReplayConfig, policies: &[HitPolicy]) -> Result<Self, ConfigError> {
        cfg.validate()?;
        let in_store = |p: &HitPolicy| p.swa_source() == SwaSource::BlockStore;
        if policies.iter().any(in_store) && !policies.iter().all(in_store) {
            return Err(ConfigError::invalid(
                "policies",
                "rules that keep SWA state in the store and rules that do not need separate passes",
            ));
        }
        Self::with(
            cfg,
            policies,
            policies.first() == Some(&HitPolicy::SwaOnSsd),
        )
    }

    fn with(
        cfg: &'a ReplayConfig,
        policies: &[HitPolicy],
        swa_in_store: bool,
    ) -> Result<Self, ConfigError> {
        Ok(ReplayPass {
            cfg,
            policies: policies.to_vec(),
            swa_in_store,
            store: KvStore::new(cfg.store.clone(), cfg.constants.block_bytes())?,
            swa: SwaCache::new(cfg.swa.clone())?,
            perfect: PerfectCache::new(),
            pending: BinaryHeap::new(),
            seq: 0,
            policy_hits: vec![0; policies.len()],
            report: ReplayReport {
                per_policy: policies
                    .iter()
                    .map(|p| PolicyTotals {
                        policy: p.name().to_string(),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            },
        })
    }

    pub fn store(&self) -> &KvStore {
        &self.store
    }

    /// Moves the replay to `now` with no request: the outputs due by then are written and the
    /// objects whose TTL passed are deleted (to read the store at a time of the caller's).
    pub fn advance(&mut self, now: Nanos) {
        self.apply_pending(now);
        self.store.advance(now);
    }

    /// Hit tokens of the last request pushed, per policy (in the order given).
    pub fn policy_hits(&self) -> &[u32] {
        &self.policy_hits
    }

    fn machine_for(&self, req: &Request) -> MachineId {
        // The prefill LB has no prefix affinity: requests spread over machines.
        MachineId((req.id.0 % u64::from(self.cfg.swa.machines)) as u32)
    }

    /// The serving unit's key of an SWA-state object (one key function for every driver).
    fn swa_object(key: BlockKey) -> BlockKey {
        servelab_core::unit::swa_object_key(key)
    }

    /// Stores SWA state for `req`'s prefix ending at the last block boundary ≤ `end`.
    fn store_swa(&mut self, now: Nanos, req: &Request, end: u32) {
        let bs = self.cfg.constants.block_tokens;
        let pos = (end / bs) * bs;
        let Some(key) = (pos > 0).then(|| req.key_at(pos)).flatten() else {
            return;
        };
        if self.swa_in_store {
            let bytes = self.cfg.constants.swa_state_bytes();
            self.store.put(now, Self::swa_object(key), bytes, req.class);
        } else {
            let m = self.machine_for(req);
            self.swa.store(now, m, key);
        }
    }

    /// Writes the outputs due by `upto`.
    fn apply_pending(&mut self, upto: Nanos) {
        while self.pending.peek().is_some_and(|p| p.0.at <= upto) {
            let Reverse(PendingOutput { at: t, req, .. }) = self.pending.pop().expect("peeked");
            if self.cfg.cache_outputs {
                self.store
                    .touch_or_insert(t, req.output_blocks(), req.class);
            }
            self.store_swa(t, &req, req.context_tokens());
            self.perfect.record_output(&req);
        }
    }

    /// Every rule's decision for `req`, added to its totals (and kept in [`Self::policy_hits`]).
    fn decide_all(&mut self, req: &Request, input: HitInputs) {
        let c = &self.cfg.constants;
        let now = req.arrival;
        let me = self.machine_for(req);
        for (pi, &p) in self.policies.iter().enumerate() {
            let mut holder = None;
            let d = match p.swa_source() {
                SwaSource::HostCache => {
                    let swa = &mut self.swa;
                    p.decide(c, input, |pos| {
                        holder = req.key_at(pos).and_then(|k| swa.lookup(now, k));
                        holder.is_some()
                    })
                }
                SwaSource::BlockStore => {
                    let store = &mut self.store;
                    p.decide(c, input, |pos| {
                        req.key_at(pos)
                            .is_some_and(|k| store.contains(now, Self::swa_object(k)))
                    })
                }
                SwaSource::NotNeeded => p.decide(c, input, |_| false),
            };
            self.policy_hits[pi] = d.hit_tokens;
            let t = &mut self.report.per_policy[pi];
            t.hit_tokens += u64::from(d.hit_tokens);
            t.encoder_tokens += u64::from(d.encoder_tokens);
            t.encoder_replay_tokens += u64::from(d.encoder_replay_tokens);
            t.decoder_tokens += u64::from(d.decoder_tokens);
            t.layer_tokens += d.layer_tokens(c);
            if d.swa_state_at.is_some() && holder.is_some_and(|m| m != me) {
                t.swa_cross_machine_pulls += 1;
            }
            *t.reasons.entry(format!("{:?}", d.reason)).or_default() += 1;
        }
    }

    /// Replays one request (arrivals must not go back in time): what it found, then its
    /// blocks touched or written and its outputs queued for the end of its decode.
    pub fn push(&mut self, req: &Request) -> RequestHits {
        let c = &self.cfg.constants;
        let now = req.arrival;
        self.apply_pending(now);
        let blocks = req.prompt_blocks();
        let run = self.store.lookup_prefix(now, blocks);
        let cached = run as u32 * c.block_tokens;
        let perfect = self.perfect.hit_tokens(req);
        let input = HitInputs {
            prompt_tokens: req.prompt_tokens,
            cached_block_tokens: cached,
            perfect_hit_tokens: perfect,
        };
        self.decide_all(req, input);
        let c = &self.cfg.constants;
        let r = &mut self.report;
        r.requests += 1;
        r.input_tokens += u64::from(req.prompt_tokens);
        r.output_tokens += u64::from(req.output_tokens);
        r.baseline_layer_tokens += baseline_layer_tokens(c, req.prompt_tokens);
        r.perfect_hit_tokens += u64::from(perfect);
        r.cached_block_tokens += u64::from(cached);
        r.prompt_blocks += blocks.len() as u64;
        r.prompt_blocks_hit += run as u64;
        // Every prompt block is touched or written; SWA state is stored after prefill.
        self.store.touch_or_insert(now, blocks, req.class);
        let prefill_done = now + Nanos::from_secs_f64(self.cfg.ttft_s);
        self.store_swa(prefill_done.min(now), req, req.prompt_tokens);
        self.perfect.record_prompt(req);
        let decode_done = prefill_done
            + Nanos::from_secs_f64(f64::from(req.output_tokens) / self.cfg.decode_tokens_per_s);
        self.seq += 1;
        self.pending.push(Reverse(PendingOutput {
            at: decode_done,
            seq: self.seq,
            req: req.clone(),
        }));
        RequestHits {
            cached_block_tokens: cached,
            perfect_hit_tokens: perfect,
        }
    }

    /// Writes what is still pending and returns the totals.
    pub fn finish(mut self) -> ReplayReport {
        self.apply_pending(Nanos::MAX);
        self.report.store = self.store.stats().clone();
        self.report.swa = self.swa.stats().clone();
        self.report
    }

    fn run(mut self, trace: &Trace) -> ReplayReport {
        for req in &trace.requests {
            self.push(req);
        }
        self.finish()
    }
}

/// The block-level replay of `servelab replay`: a request's hit is the leading run of its blocks
/// (full blocks plus its partial tail block) found in the store; hit tokens = min(block × run,
/// L); then all its blocks are touched or inserted; outputs are written only if asked.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct BlockReplayReport {
    pub requests: u64,
    pub input_tokens: u64,
    pub hit_tokens: u64,
    pub token_hit_rate: f64,
    pub blocks: u64,
    pub block_hits: u64,
    pub block_hit_rate: f64,
    pub per_class: BTreeMap<String, ClassHits>,
    pub store: StoreStats,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ClassHits {
    pub requests: u64,
    pub input_tokens: u64,
    pub hit_tokens: u64,
}

/// Runs the block-level replay. `block_bytes` is the size charged per block.
pub fn block_replay(
    trace: &Trace,
    store_cfg: &StoreConfig,
    block_bytes: u64,
    cache_outputs: bool,
) -> Result<BlockReplayReport, ConfigError> {
    let mut store = KvStore::new(store_cfg.clone(), block_bytes)?;
    no_node_failures(store_cfg)?;
    let mut rep = BlockReplayReport::default();
    let mut keys: Vec<BlockKey> = Vec::new();
    for req in &trace.requests {
        let now = req.arrival;
        keys.clear();
        keys.extend_from_slice(req.prompt_blocks());
        keys.extend(req.tail_key());
        let run = store.lookup_prefix(now, &keys);
        let hit = (u64::from(trace.block_tokens) * run as u64).min(u64::from(req.prompt_tokens));
        rep.requests += 1;
        rep.input_tokens += u64::from(req.prompt_tokens);
        rep.hit_tokens += hit;
        rep.blocks += keys.len() as u64;
        rep.block_hits += run as u64;
        let class = rep
            .per_class
            .entry(req.class.name().to_string())
            .or_default();
        class.requests += 1;
        class.input_tokens += u64::from(req.prompt_tokens);
        class.hit_tokens += hit;
        store.touch_or_insert(now, &keys, req.class);
        if cache_outputs {
            // Outputs are written when the request is replayed: the block replay has no timing.
            keys.clear();
            keys.extend_from_slice(req.output_blocks());
            if req.context_tokens() % trace.block_tokens != 0 {
                keys.extend(req.key_at(req.context_tokens()));
            }
            store.touch_or_insert(now, &keys, req.class);
        }
    }
    rep.token_hit_rate = ratio(rep.hit_tokens, rep.input_tokens);
    rep.block_hit_rate = ratio(rep.block_hits, rep.blocks);
    rep.store = store.stats().clone();
    Ok(rep)
}

/// Per-class breakdown helper for reports.
pub fn class_name(c: TrafficClass) -> &'static str {
    c.name()
}
