//! The decode side: an EP group of DP ranks stepping in lockstep with DSpark verification and
//! async or synchronous scheduling, and the decode load balancer (SPEC §6, §10).
//!
//! Sequences live in per-rank slots that stay put while a step is in flight, so a plan built
//! before the previous step's report (async scheduling) still names the right sequences; an
//! outcome for a sequence that finished in the meantime is discarded (the wasted slot is the
//! price of async scheduling, as the CPU does not yet know how many drafts were accepted).

use crate::engine::dspark::{
    BudgetInputs, BudgetScope, ConfidenceHistogram, DecodeTimeModel, VerificationPolicy,
    budget_within, choose_budget,
};
use crate::engine::plan::{DecodePlan, DecodeRankPlan, DecodeSeq, SeqOutcome, StepReport};
use crate::engine::vote::GroupVote;
use crate::error::ConfigError;
use crate::ids::{EngineId, RequestId};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// When the CPU prepares a step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scheduling {
    /// Step N+1 is planned while step N runs, from what was known before N's report.
    #[default]
    Async,
    /// Step N+1 is planned after N's report; the planning time sits between steps.
    Sync,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecodeGroupConfig {
    pub ranks: u32,
    pub max_seqs_per_rank: u32,
    /// KV tokens a rank may hold; a sequence reserves its whole context on admission (decode
    /// is not capacity-bound and never offloads, SPEC §7).
    pub kv_capacity_tokens_per_rank: u64,
    /// Handed-off requests waiting for a slot, per rank.
    pub max_waiting_per_rank: u32,
    pub draft_tokens: u32,
    pub verification: VerificationPolicy,
    pub scheduling: Scheduling,
    pub expert_imbalance: f64,
}

impl DecodeGroupConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |f: &str, why: &str| Err(ConfigError::invalid(format!("decode.{f}"), why));
        if self.ranks == 0 {
            return bad("ranks", "must be positive");
        }
        if self.max_seqs_per_rank == 0 {
            return bad("max_seqs_per_rank", "must be positive");
        }
        if u64::from(self.ranks) * u64::from(self.max_seqs_per_rank) > u64::from(u32::MAX) {
            return bad(
                "max_seqs_per_rank",
                "ranks × max_seqs_per_rank must be below 2^32 (slots are numbered in 32 bits)",
            );
        }
        if self.kv_capacity_tokens_per_rank == 0 {
            return bad("kv_capacity_tokens_per_rank", "must be positive");
        }
        if self.draft_tokens > u32::from(u8::MAX) {
            return bad("draft_tokens", "must be at most 255");
        }
        if !(self.expert_imbalance >= 1.0 && self.expert_imbalance.is_finite()) {
            return bad(
                "expert_imbalance",
                "must be at least 1 (slowest rank / mean)",
            );
        }
        self.verification.validate(self.draft_tokens)
    }
}

#[derive(Clone, Copy, Debug)]
struct Seq {
    request: RequestId,
    kv_tokens: u32,
    /// Tokens still to emit. The KV reserved for the whole context is `kv_tokens + remaining`
    /// (emitting moves tokens from one to the other), so it is not stored: 24-byte slots.
    remaining: u32,
    done: bool,
}

impl Seq {
    fn reserved(&self) -> u64 {
        u64::from(self.kv_tokens) + u64::from(self.remaining)
    }
}

#[derive(Clone, Copy, Debug)]
struct Waiting {
    request: RequestId,
    kv_tokens: u32,
    remaining: u32,
}

#[derive(Clone, Debug, Default)]
struct Rank {
    slots: Vec<Option<Seq>>,
    free: Vec<u32>,
    active: u32,
    reserved: u64,
    kv_tokens: u64,
    waiting: VecDeque<Waiting>,
    waiting_kv: u64,
    seen: ConfidenceHistogram,
    /// Slots holding a finished sequence, freed by the next `plan_step` in slot order (as a
    /// scan of the slots would: the free list's order decides where admitted sequences go).
    finished: Vec<u32>,
}

/// What one sequence emitted in a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqEmission {
    pub request: RequestId,
    pub tokens: u32,
    pub finished: bool,
}

/// A sequence taken out of a group by [`DecodeGroup::evict_all`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Evicted {
    pub request: RequestId,
    /// The rank (of the group as it was) holding its KV.
    pub rank: u32,
    /// Its slot key ([`DecodeGroup::apply_report_with`]), or None when it was still waiting.
    pub slot_key: Option<u32>,
    pub kv_tokens: u32,
    pub remaining: u32,
}

/// One EP group of decode ranks.
#[derive(Clone, Debug)]
pub struct DecodeGroup {
    id: EngineId,
    cfg: DecodeGroupConfig,
    model: DecodeTimeModel,
    ranks: Vec<Rank>,
    vote: Option<GroupVote>,
    wasted_slots: u64,
    /// Scratch: every rank's last confidences pooled.
    pooled: ConfidenceHistogram,
    /// Scratch of [`Self::plan_and_apply_taking`]: KV each rank's sequences emitted.
    kv_added: Vec<u64>,
}

impl DecodeGroup {
    pub fn new(
        id: EngineId,
        cfg: DecodeGroupConfig,
        model: DecodeTimeModel,
    ) -> Result<Self, ConfigError> {
        cfg.validate()?;
        model.validate("decode_model")?;
        let vote = match &cfg.verification {
            VerificationPolicy::Dynamic {
                min_seqs_per_rank,
                vote,
                confirmation_rounds,
                ..
            } => Some(GroupVote::new(
                *vote,
                *confirmation_rounds,
                *min_seqs_per_rank == 0,
            )),
            VerificationPolicy::Fixed { .. } => None,
        };
        let ranks = (0..cfg.ranks)
            .map(|_| Rank {
                slots: Vec::new(),
                free: Vec::new(),
                ..Default::default()
            })
            .collect();
        Ok(DecodeGroup {
            id,
            cfg,
            model,
            ranks,
            vote,
            wasted_slots: 0,
            pooled: ConfidenceHistogram::default(),
            kv_added: Vec::new(),
        })
    }

    pub fn id(&self) -> EngineId {
        self.id
    }
    pub fn config(&self) -> &DecodeGroupConfig {
        &self.cfg
    }
    pub fn ranks(&self) -> u32 {
        self.cfg.ranks
    }
    /// (sequences running or waiting, KV tokens reserved or waiting) of a rank: the balancer's view.
    pub fn rank_load(&self, r: u32) -> (u32, u64) {
        let k = &self.ranks[r as usize];
        (k.active + k.waiting.len() as u32, k.reserved + k.waiting_kv)
    }
    /// (running sequences, KV tokens held) of a rank.
    pub fn rank_occupancy(&self, r: u32) -> (u32, u64) {
        let k = &self.ranks[r as usize];
        (k.active, k.kv_tokens)
    }
    pub fn is_idle(&self) -> bool {
        self.ranks
            .iter()
            .all(|r| r.active == 0 && r.waiting.is_empty())
    }
    pub fn sequences(&self) -> u64 {
        self.ranks
            .iter()
            .map(|r| u64::from(r.active) + r.waiting.len() as u64)
            .sum()
    }
    pub fn wasted_slots(&self) -> u64 {
        self.wasted_slots
    }
    pub fn dynamic_active(&self) -> bool {
        self.vote.as_ref().is_some_and(GroupVote::active)
    }

    /// Queues a handed-off request on rank `r`: `kv_tokens` of context so far, `remaining`
    /// tokens to emit. A full waiting queue, or a context larger than a rank's KV, hands it back.
    pub fn admit(
        &mut self,
        r: u32,
        request: RequestId,
        kv_tokens: u32,
        remaining: u32,
    ) -> Result<(), RequestId> {
        let cap = self.cfg.max_waiting_per_rank as usize;
        let too_big =
            u64::from(kv_tokens) + u64::from(remaining) > self.cfg.kv_capacity_tokens_per_rank;
        let rank = &mut self.ranks[r as usize];
        if rank.waiting.len() >= cap || too_big {
            return Err(request);
        }
        rank.waiting_kv += u64::from(kv_tokens) + u64::from(remaining);
        rank.waiting.push_back(Waiting {
            request,
            kv_tokens,
            remaining,
        });
        Ok(())
    }

    /// Builds the next step into `plan`. Releases finished sequences, admits waiting ones that
    /// fit, votes on the verification mode and fixes each rank's budget. Returns false when no
    /// rank has a sequence.
    pub fn plan_step(&mut self, plan: &mut DecodePlan) -> bool {
        self.begin_plan(plan);
        let drafts = self.per_seq_drafts();
        let mut yes = 0;
        for rank in &mut self.ranks {
            yes += u32::from(Self::plan_rank(rank, &self.cfg, plan, drafts));
        }
        self.finish_plan(plan, yes);
        !plan.seqs.is_empty()
    }

    /// `plan_step(next)` followed by `apply_report_taking(cur, report, emit)` (async scheduling:
    /// step N+1 is planned from what was known before step N's report, then N's report is
    /// applied), rank by rank so that each rank's slots are read twice while they are in L1
    /// rather than once per pass over the whole group. Same plan, emissions (in the same
    /// order), state and return value as the two calls. Panics, as `apply_report_taking` does,
    /// when `cur` has more ranks than the group.
    pub fn plan_and_apply_taking(
        &mut self,
        next: &mut DecodePlan,
        cur: &DecodePlan,
        report: &mut StepReport,
        mut emit: impl FnMut(u32, SeqEmission),
    ) -> bool {
        assert!(
            cur.ranks.len() <= self.ranks.len(),
            "a plan of {} ranks applied to a group of {}",
            cur.ranks.len(),
            self.ranks.len()
        );
        self.begin_plan(next);
        let drafts = self.per_seq_drafts();
        let max = self.cfg.max_seqs_per_rank;
        let outcomes = &report.seqs;
        let mut yes = 0;
        // The step's new KV per rank, added after the budgets below are fixed on the KV
        // before the report (as `plan_step` would see it).
        self.kv_added.clear();
        for (r, rank) in self.ranks.iter_mut().enumerate() {
            yes += u32::from(Self::plan_rank(rank, &self.cfg, next, drafts));
            let mut added = 0u64;
            let range = cur
                .ranks
                .get(r)
                .map_or(0..0, |rp| rp.seq_start as usize..rp.seq_end as usize);
            for i in range {
                let e = &cur.seqs[i];
                let outcome = outcomes.get(i).copied().unwrap_or_default();
                let slot = rank.slots.get_mut(e.slot as usize).and_then(Option::as_mut);
                let Some(s) = slot.filter(|s| s.request == e.request && !s.done) else {
                    self.wasted_slots += 1;
                    continue;
                };
                let em = Self::emit_seq(s, e, outcome, &mut rank.finished);
                added += u64::from(em.tokens);
                emit(r as u32 * max + e.slot, em);
            }
            self.kv_added.push(added);
        }
        self.finish_plan(next, yes);
        let ranks = &mut report.ranks;
        for (r, (rank, &added)) in self.ranks.iter_mut().zip(&self.kv_added).enumerate() {
            rank.kv_tokens += added;
            if let Some(o) = ranks.get_mut(r).filter(|_| r < cur.ranks.len())
                && o.confidence.seqs > 0
            {
                std::mem::swap(&mut rank.seen, &mut o.confidence);
            }
        }
        !next.seqs.is_empty()
    }

    fn begin_plan(&self, plan: &mut DecodePlan) {
        plan.engine = self.id;
        plan.ranks.clear();
        plan.seqs.clear();
        plan.expert_imbalance = self.cfg.expert_imbalance;
    }

    fn per_seq_drafts(&self) -> u32 {
        match self.cfg.verification {
            VerificationPolicy::Fixed { drafts } => drafts,
            VerificationPolicy::Dynamic { .. } => self.cfg.draft_tokens,
        }
    }

    /// Releases the rank's finished sequences (in slot order) and admits waiting ones that fit.
    /// Returns whether the rank votes for dynamic verification.
    /// One rank's part of the next plan: releases its finished sequences, admits waiting ones,
    /// appends its live sequences and its rank plan (budget = the sum of their drafts). Returns
    /// the rank's vote, as [`Self::release_and_admit`].
    fn plan_rank(
        rank: &mut Rank,
        cfg: &DecodeGroupConfig,
        plan: &mut DecodePlan,
        drafts: u32,
    ) -> bool {
        let vote = Self::release_and_admit(rank, cfg);
        let start = plan.seqs.len() as u32;
        let mut max_total = 0u32;
        for (i, s) in rank.slots.iter().enumerate() {
            if let Some(s) = s
                && !s.done
            {
                max_total += Self::push_seq(plan, s, i as u32, drafts);
            }
        }
        plan.ranks.push(DecodeRankPlan {
            seq_start: start,
            seq_end: plan.seqs.len() as u32,
            verify_budget: max_total,
        });
        vote
    }

    fn release_and_admit(rank: &mut Rank, cfg: &DecodeGroupConfig) -> bool {
        let (max, cap) = (cfg.max_seqs_per_rank, cfg.kv_capacity_tokens_per_rank);
        rank.finished.sort_unstable();
        for &i in &rank.finished {
            if let Some(s) = rank.slots[i as usize]
                && s.done
            {
                rank.slots[i as usize] = None;
                rank.free.push(i);
                rank.active -= 1;
                rank.reserved -= s.reserved();
                rank.kv_tokens -= u64::from(s.kv_tokens);
            }
        }
        rank.finished.clear();
        while rank.active < max {
            let Some(w) = rank.waiting.front().copied() else {
                break;
            };
            let need = u64::from(w.kv_tokens) + u64::from(w.remaining);
            if rank.reserved + need > cap {
                break;
            }
            rank.waiting.pop_front();
            rank.waiting_kv -= need;
            let seq = Seq {
                request: w.request,
                kv_tokens: w.kv_tokens,
                remaining: w.remaining,
                done: false,
            };
            match rank.free.pop() {
                Some(i) => rank.slots[i as usize] = Some(seq),
                None => rank.slots.push(Some(seq)),
            }
            rank.active += 1;
            rank.reserved += need;
            rank.kv_tokens += u64::from(w.kv_tokens);
        }
        matches!(cfg.verification, VerificationPolicy::Dynamic { min_seqs_per_rank, .. }
            if rank.active >= min_seqs_per_rank)
    }

    /// Plans live sequence `s` in `slot`; returns its drafts.
    #[inline]
    fn push_seq(plan: &mut DecodePlan, s: &Seq, slot: u32, drafts: u32) -> u32 {
        let d = drafts.min(s.remaining.saturating_sub(1));
        plan.seqs.push(DecodeSeq {
            request: s.request,
            kv_tokens: s.kv_tokens,
            max_drafts: d,
            slot,
        });
        d
    }

    /// Votes on the mode and fixes the budgets of a plan whose sequences are in place.
    fn finish_plan(&mut self, plan: &mut DecodePlan, yes: u32) {
        let dynamic = match &mut self.vote {
            Some(v) => v.round(yes, self.cfg.ranks),
            None => false,
        };
        plan.dynamic = dynamic;
        if dynamic {
            self.fix_budgets(plan);
        }
    }

    /// Dynamic verification: replaces each rank's budget (set to its maximum) by the chosen one.
    fn fix_budgets(&mut self, plan: &mut DecodePlan) {
        let imbalance = self.cfg.expert_imbalance;
        let inputs = |rank: &Rank, rp: &DecodeRankPlan| BudgetInputs {
            seqs: rp.seq_end - rp.seq_start,
            kv_tokens: rank.kv_tokens,
            max_drafts: rp.verify_budget,
            imbalance,
        };
        let Some(BudgetScope::Group) = self.budget_scope() else {
            for (rank, rp) in self.ranks.iter().zip(plan.ranks.iter_mut()) {
                rp.verify_budget = choose_budget(&self.model, &rank.seen, inputs(rank, rp));
            }
            return;
        };
        // The rank predicted slowest with everything verified sets the group's step time.
        let mut slowest: Option<(f64, usize)> = None;
        self.pooled.clear();
        for (r, (rank, rp)) in self.ranks.iter().zip(plan.ranks.iter()).enumerate() {
            self.pooled.merge(&rank.seen);
            let at = inputs(rank, rp);
            if at.seqs == 0 {
                continue;
            }
            let t = self.model.predict_ns(
                at.seqs,
                at.kv_tokens,
                at.seqs + at.max_drafts,
                true,
                imbalance,
            );
            if slowest.is_none_or(|(best, _)| t > best) {
                slowest = Some((t, r));
            }
        }
        let Some((_, slow)) = slowest else { return };
        let at = inputs(&self.ranks[slow], &plan.ranks[slow]);
        let b = choose_budget(&self.model, &self.pooled, at);
        let limit = self
            .model
            .predict_ns(at.seqs, at.kv_tokens, at.seqs + b, true, imbalance);
        for (rank, rp) in self.ranks.iter().zip(plan.ranks.iter_mut()) {
            let at = inputs(rank, rp);
            if at.seqs > 0 {
                rp.verify_budget = budget_within(&self.model, at, true, limit);
            }
        }
    }

    fn budget_scope(&self) -> Option<BudgetScope> {
        match self.cfg.verification {
            VerificationPolicy::Dynamic { budget, .. } => Some(budget),
            VerificationPolicy::Fixed { .. } => None,
        }
    }

    /// Applies a step's report: each live sequence emits its accepted drafts plus one token.
    /// Emissions go to `out` (cleared first).
    pub fn apply_report(
        &mut self,
        plan: &DecodePlan,
        report: &StepReport,
        out: &mut Vec<SeqEmission>,
    ) {
        out.clear();
        self.apply_report_with(plan, report, |_, e| out.push(e));
    }

    /// [`Self::apply_report`] handing each emission to `emit` with its sequence's slot key
    /// `rank × max_seqs_per_rank + slot` (below [`Self::slot_keys`]), in the same order. The
    /// key names the sequence while it runs, so a caller can keep per-sequence state in a
    /// dense array instead of looking it up by request.
    pub fn apply_report_with(
        &mut self,
        plan: &DecodePlan,
        report: &StepReport,
        emit: impl FnMut(u32, SeqEmission),
    ) {
        self.apply(
            plan,
            &report.seqs,
            |r, seen| {
                if let Some(o) = report.ranks.get(r)
                    && o.confidence.seqs > 0
                {
                    seen.clone_from(&o.confidence);
                }
            },
            emit,
        );
    }

    /// [`Self::apply_report_with`] that moves each rank's confidences out of `report` instead
    /// of copying them (64 histograms a step): `report.ranks` is left with stale histograms,
    /// which the backend's next `execute` overwrites.
    pub fn apply_report_taking(
        &mut self,
        plan: &DecodePlan,
        report: &mut StepReport,
        emit: impl FnMut(u32, SeqEmission),
    ) {
        let StepReport { seqs, ranks, .. } = report;
        self.apply(
            plan,
            seqs,
            |r, seen| {
                if let Some(o) = ranks.get_mut(r)
                    && o.confidence.seqs > 0
                {
                    std::mem::swap(seen, &mut o.confidence);
                }
            },
            emit,
        );
    }

    fn apply(
        &mut self,
        plan: &DecodePlan,
        outcomes: &[SeqOutcome],
        mut confidences: impl FnMut(usize, &mut ConfidenceHistogram),
        mut emit: impl FnMut(u32, SeqEmission),
    ) {
        let max = self.cfg.max_seqs_per_rank;
        for (r, rp) in plan.ranks.iter().enumerate() {
            let rank = &mut self.ranks[r];
            confidences(r, &mut rank.seen);
            for i in rp.seq_start as usize..rp.seq_end as usize {
                let e = &plan.seqs[i];
                let outcome = outcomes.get(i).copied().unwrap_or_default();
                let slot = rank.slots.get_mut(e.slot as usize).and_then(Option::as_mut);
                let Some(s) = slot.filter(|s| s.request == e.request && !s.done) else {
                    self.wasted_slots += 1;
                    continue;
                };
                let em = Self::emit_seq(s, e, outcome, &mut rank.finished);
                rank.kv_tokens += u64::from(em.tokens);
                emit(r as u32 * max + e.slot, em);
            }
        }
    }

    /// Live sequence `s` (planned as `e`) emits its accepted drafts plus one token; a finished
    /// one is listed for release. The rank's KV count is the caller's to update.
    #[inline]
    fn emit_seq(
        s: &mut Seq,
        e: &DecodeSeq,
        outcome: SeqOutcome,
        finished: &mut Vec<u32>,
    ) -> SeqEmission {
        let tokens = (u32::from(outcome.accepted) + 1).min(s.remaining);
        s.remaining -= tokens;
        s.kv_tokens += tokens;
        s.done = s.remaining == 0;
        if s.done {
            finished.push(e.slot);
        }
        SeqEmission {
            request: e.request,
            tokens,
            finished: s.done,
        }
    }

    /// Removes every unfinished sequence, running or waiting, into `out` (in rank order, slots
    /// before the waiting queue), leaving the group empty. Sequences finished by the last step
    /// but not yet released are dropped silently: they have completed. Call it only between
    /// steps: a plan built before it names slots that no longer exist.
    pub fn evict_all(&mut self, out: &mut Vec<Evicted>) {
        let max = self.cfg.max_seqs_per_rank;
        for (r, rank) in self.ranks.iter_mut().enumerate() {
            let r = r as u32;
            for (slot, s) in rank.slots.iter().enumerate() {
                if let Some(s) = s.filter(|s| !s.done) {
                    out.push(Evicted {
                        request: s.request,
                        rank: r,
                        slot_key: Some(r * max + slot as u32),
                        kv_tokens: s.kv_tokens,
                        remaining: s.remaining,
                    });
                }
            }
            for w in &rank.waiting {
                out.push(Evicted {
                    request: w.request,
                    rank: r,
                    slot_key: None,
                    kv_tokens: w.kv_tokens,
                    remaining: w.remaining,
                });
            }
            *rank = Rank::default();
        }
    }

    /// Adds an empty rank at the end (a repaired GPU rejoining the group between steps).
    pub fn push_rank(&mut self) {
        self.cfg.ranks += 1;
        self.ranks.push(Rank::default());
    }

    /// Sets the slowest-rank ÷ mean factor of the group's MoE part (after experts are
    /// re-placed on a different set of ranks).
    pub fn set_expert_imbalance(&mut self, f: f64) {
        self.cfg.expert_imbalance = f;
    }

    /// Slot keys of [`Self::apply_report_with`] lie below this.
    pub fn slot_keys(&self) -> u32 {
        self.cfg.ranks * self.cfg.max_seqs_per_rank
    }

    /// KV and slot accounting agrees with the sequences held, and no rank exceeds its limits.
    pub fn check_invariants(&self) -> Result<(), String> {
        for (i, r) in self.ranks.iter().enumerate() {
            let live: Vec<&Seq> = r.slots.iter().flatten().collect();
            if live.len() as u32 != r.active || live.len() + r.free.len() != r.slots.len() {
                return Err(format!("decode rank {i}: slots not conserved"));
            }
            if r.active > self.cfg.max_seqs_per_rank {
                return Err(format!(
                    "decode rank {i}: {} sequences over the limit",
                    r.active
                ));
            }
            let done = live.iter().filter(|s| s.done).count();
            let listed_done = r.finished.iter().all(|&k| {
                r.slots
                    .get(k as usize)
                    .is_some_and(|s| s.is_some_and(|s| s.done))
            });
            if done != r.finished.len() || !listed_done {
                return Err(format!(
                    "decode rank {i}: finished sequences not all listed for release"
                ));
            }
            let kv: u64 = live.iter().map(|s| u64::from(s.kv_tokens)).sum();
            let reserved: u64 = live.iter().map(|s| s.reserved()).sum();
            if kv != r.kv_tokens || reserved != r.reserved || kv > reserved {
                return Err(format!(
                    "decode rank {i}: KV accounting drifted ({kv} held, {} counted)",
                    r.kv_tokens
                ));
            }
            let waiting: u64 = r
                .waiting
                .iter()
                .map(|w| u64::from(w.kv_tokens) + u64::from(w.remaining))
                .sum();
            if waiting != r.waiting_kv || r.waiting.len() > self.cfg.max_waiting_per_rank as usize {
                return Err(format!("decode rank {i}: waiting queue accounting drifted"));
            }
        }
        Ok(())
    }
}

/// How the decode balancer picks a rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DecodeLbPolicy {
    /// Request count and KV length together (DualPath): the rank minimising the larger of its
    /// two utilisations after placement, so short requests go where requests are few and long
    /// ones where KV is short. Ties: smaller sum, then lower rank.
    #[default]
    CountAndKv,
    RoundRobin,
    /// Fewest sequences (ties: lower rank).
    LeastLoaded,
}

#[derive(Clone, Debug, Default)]
pub struct DecodeBalancer {
    policy: DecodeLbPolicy,
    rr: u64,
}

impl DecodeBalancer {
    pub fn new(policy: DecodeLbPolicy) -> Self {
        DecodeBalancer { policy, rr: 0 }
    }

    /// Picks (group index, rank) for a request of `context_tokens` (prompt + output).
    pub fn pick(&mut self, groups: &[DecodeGroup], context_tokens: u64) -> (usize, u32) {
        self.pick_up(groups, None, context_tokens).unwrap_or((0, 0))
    }

    /// [`Self::pick`] among the groups marked in `up` (all when None); None when no group is
    /// up. Round robin skips the ranks of groups that are down, keeping its turn.
    pub fn pick_up(
        &mut self,
        groups: &[DecodeGroup],
        up: Option<&[bool]>,
        context_tokens: u64,
    ) -> Option<(usize, u32)> {
        let is_up = |gi: usize| up.is_none_or(|u| u[gi]);
        match self.policy {
            DecodeLbPolicy::RoundRobin => {
                let total: u64 = groups.iter().map(|g| u64::from(g.ranks())).sum();
                for _ in 0..total {
                    let i = self.rr % total.max(1);
                    self.rr += 1;
                    let hit = flat_rank(groups, i);
                    if is_up(hit.0) {
                        return Some(hit);
                    }
                }
                None
            }
            DecodeLbPolicy::LeastLoaded => {
                let mut best = None;
                for (gi, g) in groups.iter().enumerate().filter(|(gi, _)| is_up(*gi)) {
                    for r in 0..g.ranks() {
                        let key = (g.rank_load(r).0, gi, r);
                        if best.is_none_or(|(k, _)| key < k) {
                            best = Some((key, (gi, r)));
                        }
                    }
                }
                best.map(|b| b.1)
            }
            DecodeLbPolicy::CountAndKv => Self::count_and_kv(groups, is_up, context_tokens),
        }
    }

    fn count_and_kv(
        groups: &[DecodeGroup],
        is_up: impl Fn(usize) -> bool,
        context_tokens: u64,
    ) -> Option<(usize, u32)> {
        let mut best: Option<(f64, f64, (usize, u32))> = None;
        for (gi, g) in groups.iter().enumerate().filter(|(gi, _)| is_up(*gi)) {
            let c = g.config();
            for r in 0..g.ranks() {
                let (n, kv) = g.rank_load(r);
                let a = f64::from(n + 1) / f64::from(c.max_seqs_per_rank);
                // max(a, b) >= a: a rank whose count share alone exceeds the best larger
                // share cannot win, and its KV share (a division) is not needed.
                if best.is_some_and(|(bh, _, _)| a > bh) {
                    continue;
                }
                let b = (kv + context_tokens) as f64 / c.kv_capacity_tokens_per_rank as f64;
                let (hi, sum) = (a.max(b), a + b);
                if best.is_none_or(|(bh, bs, _)| hi < bh || (hi == bh && sum < bs)) {
                    best = Some((hi, sum, (gi, r)));
                }
            }
        }
        best.map(|b| b.2)
    }
}

/// The (group, rank) of flat rank index `i` over the groups in order.
fn flat_rank(groups: &[DecodeGroup], mut i: u64) -> (usize, u32) {
    for (gi, g) in groups.iter().enumerate() {
        if i < u64::from(g.ranks()) {
            return (gi, i as u32);
        }
        i -= u64::from(g.ranks());
    }
    (0, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::dspark::BudgetScope;
    use crate::engine::plan::{RankOutcome, SeqOutcome};
    use crate::engine::vote::VoteMode;

    fn model() -> DecodeTimeModel {
        DecodeTimeModel {
            base_ns: 1000.0,
            per_seq_ns: 0.0,
            per_kv_token_ns: 0.0,
            per_token_ns: 100.0,
            per_token_sq_ns: 0.0,
            dynamic_overhead_ns: 0.0,
            moe_share: 0.0,
            reference_imbalance: 1.0,
            per_max_kv_token_ns: 0.0,
            active_experts: None,
        }
    }
    fn cfg(
        ranks: u32,
        verification: VerificationPolicy,
        scheduling: Scheduling,
    ) -> DecodeGroupConfig {
        DecodeGroupConfig {
            ranks,
            max_seqs_per_rank: 2,
            kv_capacity_tokens_per_rank: 1000,
            max_waiting_per_rank: 4,
            draft_tokens: 5,
            verification,
            scheduling,
            expert_imbalance: 1.0,
        }
    }
    fn empty() -> DecodePlan {
        DecodePlan {
            engine: EngineId(0),
            ranks: vec![],
            seqs: vec![],
            dynamic: false,
            expert_imbalance: 1.0,
        }
    }
    fn report(plan: &DecodePlan, accepted: u8) -> StepReport {
        StepReport {
            duration: crate::time::Nanos(1),
            seqs: plan
                .seqs
                .iter()
                .map(|s| SeqOutcome {
                    verified: s.max_drafts as u8,
                    accepted: accepted.min(s.max_drafts as u8),
                })
                .collect(),
            ranks: plan.ranks.iter().map(|_| RankOutcome::default()).collect(),
        }
    }

    #[test]
    fn fixed_verification_emits_until_done() {
        let mut g = DecodeGroup::new(
            EngineId(0),
            cfg(1, VerificationPolicy::Fixed { drafts: 5 }, Scheduling::Sync),
            model(),
        )
        .unwrap();
        g.admit(0, RequestId(7), 100, 10).unwrap();
        let mut p = empty();
        let mut out = vec![];
        assert!(g.plan_step(&mut p));
        assert_eq!(p.seqs[0].max_drafts, 5);
        assert_eq!(p.ranks[0].verify_budget, 5);
        g.apply_report(&p, &report(&p, 3), &mut out);
        assert_eq!(
            out,
            vec![SeqEmission {
                request: RequestId(7),
                tokens: 4,
                finished: false
            }]
        );
        assert_eq!(g.rank_occupancy(0), (1, 104));
        // 6 left: drafts capped at 5, 4 accepted + 1 = 5, then 1 left: no drafts.
        g.plan_step(&mut p);
        g.apply_report(&p, &report(&p, 4), &mut out);
        g.plan_step(&mut p);
        assert_eq!(p.seqs[0].max_drafts, 0);
        g.apply_report(&p, &report(&p, 0), &mut out);
        assert!(out[0].finished);
        assert!(!g.plan_step(&mut p));
        assert!(g.is_idle());
        g.check_invariants().unwrap();
    }

    #[test]
    fn finished_sequences_must_be_listed_for_release() {
        let mut g = DecodeGroup::new(
            EngineId(0),
            cfg(1, VerificationPolicy::Fixed { drafts: 0 }, Scheduling::Sync),
            model(),
        )
        .unwrap();
        g.admit(0, RequestId(1), 10, 1).unwrap();
        g.admit(0, RequestId(2), 10, 5).unwrap();
        let mut plan = empty();
        assert!(g.plan_step(&mut plan));
        let mut out = Vec::new();
        g.apply_report(&plan, &report(&plan, 0), &mut out);
        assert!(out[0].finished && !out[1].finished);
        g.check_invariants().unwrap();
        let listed = std::mem::take(&mut g.ranks[0].finished);
        assert!(g.check_invariants().is_err());
        g.ranks[0].finished = listed;
        // The next plan releases the finished slot and plans only the other sequence.
        assert!(g.plan_step(&mut plan));
        assert_eq!(plan.seqs.len(), 1);
        assert_eq!(plan.seqs[0].request, RequestId(2));
        g.check_invariants().unwrap();
    }

    #[test]
    fn async_plan_discards_finished_sequence() {
        let mut g = DecodeGroup::new(
            EngineId(0),
            cfg(
                1,
                VerificationPolicy::Fixed { drafts: 5 },
                Scheduling::Async,
            ),
            model(),
        )
        .unwrap();
        g.admit(0, RequestId(1), 10, 2).unwrap();
        let (mut p1, mut p2, mut out) = (empty(), empty(), vec![]);
        g.plan_step(&mut p1);
        g.plan_step(&mut p2); // planned before step 1 reports
        g.apply_report(&p1, &report(&p1, 1), &mut out);
        assert!(out[0].finished);
        g.apply_report(&p2, &report(&p2, 1), &mut out);
        assert!(out.is_empty());
        assert_eq!(g.wasted_slots(), 1);
        g.check_invariants().unwrap();
    }

    #[test]
    fn admission_respects_slots_and_kv() {
        let mut g = DecodeGroup::new(
            EngineId(0),
            cfg(1, VerificationPolicy::Fixed { drafts: 5 }, Scheduling::Sync),
            model(),
        )
        .unwrap();
        g.admit(0, RequestId(1), 500, 100).unwrap();
        g.admit(0, RequestId(2), 500, 100).unwrap(); // 1200 > 1000: waits
        g.admit(0, RequestId(3), 1, 1).unwrap();
        g.admit(0, RequestId(4), 1, 1).unwrap();
        assert_eq!(g.admit(0, RequestId(5), 1, 1), Err(RequestId(5)));
        let mut p = empty();
        g.plan_step(&mut p);
        assert_eq!(p.seqs.len(), 1);
        assert_eq!(g.rank_load(0), (4, 600 + 600 + 4));
        g.check_invariants().unwrap();
    }

    #[test]
    fn vote_gates_dynamic_mode() {
        let pol = VerificationPolicy::Dynamic {
            min_seqs_per_rank: 1,
            vote: VoteMode::All,
            confirmation_rounds: 0,
            budget: BudgetScope::Rank,
        };
        let mut g = DecodeGroup::new(EngineId(0), cfg(2, pol, Scheduling::Sync), model()).unwrap();
        g.admit(0, RequestId(1), 10, 100).unwrap();
        let mut p = empty();
        g.plan_step(&mut p);
        assert!(!p.dynamic, "rank 1 is empty: mode A waits for every rank");
        g.admit(1, RequestId(2), 10, 100).unwrap();
        g.plan_step(&mut p);
        assert!(p.dynamic);
        // Without history the budget is everything.
        assert_eq!(p.ranks[0].verify_budget, 5);
    }

    /// Rank 0 holds 2 sequences, rank 1 one; every sequence's drafts have cumulative
    /// confidences 0.9, 0.05, 0.05, 0.05, 0.05; a step costs 1000 + 100 per query token.
    fn budgets_after_history(budget: BudgetScope) -> Vec<u32> {
        let pol = VerificationPolicy::Dynamic {
            min_seqs_per_rank: 0,
            vote: VoteMode::All,
            confirmation_rounds: 0,
            budget,
        };
        let mut g = DecodeGroup::new(EngineId(0), cfg(2, pol, Scheduling::Sync), model()).unwrap();
        g.admit(0, RequestId(1), 10, 100).unwrap();
        g.admit(0, RequestId(2), 10, 100).unwrap();
        g.admit(1, RequestId(3), 10, 100).unwrap();
        let (mut p, mut out) = (empty(), vec![]);
        g.plan_step(&mut p);
        assert!(p.dynamic);
        assert_eq!(
            p.ranks.iter().map(|r| r.verify_budget).collect::<Vec<_>>(),
            [10, 5],
            "no history: everything"
        );
        let mut rep = report(&p, 0);
        for (r, n) in [(0, 2), (1, 1)] {
            rep.ranks[r]
                .confidence
                .add(&[0.9, 0.05, 0.05, 0.05, 0.05], n);
        }
        g.apply_report(&p, &rep, &mut out);
        g.plan_step(&mut p);
        p.ranks.iter().map(|r| r.verify_budget).collect()
    }

    /// Taking the confidences out of the report and handing emissions with slot keys gives
    /// the same emissions, the same later plans and distinct keys below `slot_keys`.
    #[test]
    fn taking_apply_matches_apply_report() {
        let pol = VerificationPolicy::Dynamic {
            min_seqs_per_rank: 0,
            vote: VoteMode::All,
            confirmation_rounds: 0,
            budget: BudgetScope::Group,
        };
        let mut a = DecodeGroup::new(EngineId(0), cfg(2, pol, Scheduling::Sync), model()).unwrap();
        for (r, id, out) in [(0, 1, 9), (0, 2, 3), (1, 3, 20), (1, 4, 2)] {
            a.admit(r, RequestId(id), 10, out).unwrap();
        }
        let mut b = a.clone();
        let (mut pa, mut pb) = (empty(), empty());
        let (mut out, mut keys) = (vec![], vec![]);
        for step in 0..6u8 {
            a.plan_step(&mut pa);
            b.plan_step(&mut pb);
            assert_eq!(pa, pb);
            let mut rep = report(&pa, step % 3);
            for (r, h) in rep.ranks.iter_mut().enumerate() {
                h.confidence
                    .add(&[0.9, 0.5 - 0.1 * f64::from(step), 0.1], r as u32 + 1);
            }
            a.apply_report(&pa, &rep, &mut out);
            let mut got = vec![];
            b.apply_report_taking(&pb, &mut rep, |k, e| {
                keys.push(k);
                got.push(e);
            });
            assert_eq!(got, out);
            assert!(keys.iter().all(|&k| k < b.slot_keys()));
            let n = keys.len();
            keys.sort_unstable();
            keys.dedup();
            assert_eq!(keys.len(), n, "one key per running sequence");
            keys.clear();
        }
        assert_eq!(a.wasted_slots(), b.wasted_slots());
        b.check_invariants().unwrap();
    }

    /// Async scheduling through the fused call gives the same plans, emissions (keys and
    /// order), wasted slots, confidences and state as `plan_step` then `apply_report_taking`,
    /// with admissions into freed slots, finishes mid-flight and the group budget in play.
    #[test]
    fn plan_and_apply_matches_plan_then_apply() {
        let pol = VerificationPolicy::Dynamic {
            min_seqs_per_rank: 0,
            vote: VoteMode::All,
            confirmation_rounds: 0,
            budget: BudgetScope::Group,
        };
        let base = DecodeGroupConfig {
            max_seqs_per_rank: 3,
            ..cfg(2, pol, Scheduling::Async)
        };
        // KV enters the step time, so budgets fixed on the KV after the report would differ.
        let kv_model = DecodeTimeModel {
            per_kv_token_ns: 5.0,
            ..model()
        };
        let mut a = DecodeGroup::new(EngineId(0), base, kv_model).unwrap();
        let mut b = a.clone();
        let (mut pa, mut pb) = ([empty(), empty()], [empty(), empty()]);
        a.plan_step(&mut pa[0]);
        b.plan_step(&mut pb[0]);
        let mut next_id = 1u64;
        let (mut out_a, mut out_b) = (vec![], vec![]);
        let mut total_wasted = 0;
        for step in 0..24u32 {
            // New arrivals on both groups alike, some of them straight into freed slots.
            for r in 0..2 {
                if (step + r) % 3 == 0 {
                    let out = 1 + (step * 7 + r * 5) % 9;
                    let x = a.admit(r, RequestId(next_id), 10 + step, out);
                    assert_eq!(x, b.admit(r, RequestId(next_id), 10 + step, out));
                    next_id += 1;
                }
            }
            let mut rep = report(&pa[0], (step % 4) as u8);
            for (r, h) in rep.ranks.iter_mut().enumerate() {
                h.confidence
                    .add(&[0.9, 0.6 - 0.02 * f64::from(step), 0.2], r as u32 + 1);
            }
            let mut rep_b = rep.clone();
            let [cur_a, next_a] = &mut pa;
            let built_a = a.plan_step(next_a);
            out_a.clear();
            a.apply_report_taking(cur_a, &mut rep, |k, e| out_a.push((k, e)));
            let [cur_b, next_b] = &mut pb;
            out_b.clear();
            let built_b = b.plan_and_apply_taking(next_b, cur_b, &mut rep_b, |k, e| {
                out_b.push((k, e));
            });
            assert_eq!(built_a, built_b);
            assert_eq!(pa[1], pb[1], "step {step}");
            assert_eq!(out_a, out_b, "step {step}");
            assert_eq!(a.wasted_slots(), b.wasted_slots());
            for (ra, rb) in a.ranks.iter().zip(&b.ranks) {
                assert_eq!(ra.seen, rb.seen);
                assert_eq!(
                    (ra.kv_tokens, ra.reserved, ra.active),
                    (rb.kv_tokens, rb.reserved, rb.active)
                );
                assert_eq!(ra.finished, rb.finished);
                assert_eq!(ra.free, rb.free);
            }
            a.check_invariants().unwrap();
            b.check_invariants().unwrap();
            total_wasted = b.wasted_slots();
            pa.swap(0, 1);
            pb.swap(0, 1);
        }
        assert!(total_wasted > 0, "the run must exercise stale sequences");
        assert!(next_id > 10);
    }

    #[test]
    fn group_budget_fills_faster_ranks_up_to_the_slowest() {
        // Slowest rank 0 (2 sequences): verifying its two 0.9 drafts gives 3.8 tokens in
        // 1400 ns, the best rate; rank 1 then verifies 3 drafts, as many as fit in 1400 ns.
        assert_eq!(budgets_after_history(BudgetScope::Group), [2, 3]);
        // Alone, rank 1 would stop after its 0.9 draft (1.9 tokens in 1200 ns).
        assert_eq!(budgets_after_history(BudgetScope::Rank), [2, 1]);
    }

    #[test]
    fn count_and_kv_balancer_sends_long_requests_to_short_kv() {
        let mut g = DecodeGroup::new(
            EngineId(0),
            DecodeGroupConfig {
                max_seqs_per_rank: 10,
                ..cfg(2, VerificationPolicy::Fixed { drafts: 5 }, Scheduling::Sync)
            },
            model(),
        )
        .unwrap();
        // Rank 0: 1 request with much KV. Rank 1: 3 short requests.
        g.admit(0, RequestId(1), 300, 0).unwrap();
        for i in 0..3 {
            g.admit(1, RequestId(10 + i), 10, 0).unwrap();
        }
        let groups = [g];
        let mut b = DecodeBalancer::new(DecodeLbPolicy::CountAndKv);
        // Short request: rank 0 → max(0.2, 0.31) = 0.31; rank 1 → max(0.4, 0.04) = 0.4: it
        // goes to the rank with few requests but much KV.
        assert_eq!(b.pick(&groups, 10), (0, 0));
        // Long request: rank 0 → max(0.2, 0.8); rank 1 → max(0.4, 0.53): the rank with little KV.
        assert_eq!(b.pick(&groups, 500), (0, 1));
        let mut ll = DecodeBalancer::new(DecodeLbPolicy::LeastLoaded);
        assert_eq!(ll.pick(&groups, 10), (0, 0));
        let mut rr = DecodeBalancer::new(DecodeLbPolicy::RoundRobin);
        assert_eq!(
            (
                rr.pick(&groups, 1),
                rr.pick(&groups, 1),
                rr.pick(&groups, 1)
            ),
            ((0, 0), (0, 1), (0, 0))
        );
    }
}
