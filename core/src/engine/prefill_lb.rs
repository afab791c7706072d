//! The prefill load balancer (SPEC §6) and its simpler alternatives.
//!
//! DeepInfer buckets requests by total context length into four tiers, assigns engines to tiers
//! each round in proportion to the tier's share of the previous round's compute demand, and
//! lets engines *pull* work while their queued compute is under a quota. No prefix affinity:
//! any engine can hit any prefix. The alternatives push each request to an engine at once.

use crate::error::ConfigError;
use crate::ids::{EngineId, RequestId};
use crate::time::Nanos;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum PrefillLbPolicy {
    /// Four tiers by context length, proportional engine assignment, quota pull.
    Tiered {
        /// Upper bounds of all tiers but the last, increasing (SPEC: 16K, 64K, 256K).
        tier_bounds_tokens: Vec<u32>,
        /// How often engines are re-assigned to tiers.
        round: Nanos,
        /// An engine pulls while its queued predicted compute is below this.
        quota: Nanos,
        /// An engine with nothing queued may pull from another tier (oldest request first)
        /// rather than idle. The published design is silent; off reproduces it strictly.
        steal_when_idle: bool,
    },
    /// Engine i mod n.
    RoundRobin,
    /// The engine with the least queued predicted compute (ties: lowest index).
    LeastLoaded,
}

impl PrefillLbPolicy {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if let PrefillLbPolicy::Tiered {
            tier_bounds_tokens,
            round,
            quota,
            ..
        } = self
        {
            if tier_bounds_tokens.windows(2).any(|w| w[0] >= w[1])
                || tier_bounds_tokens.first() == Some(&0)
            {
                return Err(ConfigError::invalid(
                    "prefill.lb.tier_bounds_tokens",
                    "must be positive and increasing",
                ));
            }
            if *round == Nanos::ZERO {
                return Err(ConfigError::invalid("prefill.lb.round", "must be positive"));
            }
            if *quota == Nanos::ZERO {
                return Err(ConfigError::invalid("prefill.lb.quota", "must be positive"));
            }
        }
        Ok(())
    }
}

/// A request waiting for a prefill engine.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QueuedPrefill {
    pub request: RequestId,
    pub context_tokens: u32,
    /// Predicted compute, nanoseconds (the tier's demand).
    pub compute_ns: f64,
    pub queued_at: Nanos,
}

/// Where a submitted request went.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Submitted {
    /// Pushed to this engine now.
    Routed(EngineId, QueuedPrefill),
    /// Waiting in a tier for an engine to pull it.
    Queued,
    /// The balancer's queue is full.
    Rejected(QueuedPrefill),
}

#[derive(Clone, Debug)]
pub struct PrefillBalancer {
    policy: PrefillLbPolicy,
    engines: u32,
    max_queued: usize,
    tiers: Vec<VecDeque<QueuedPrefill>>,
    engine_tier: Vec<usize>,
    demand_ns: Vec<f64>,
    next_round: Nanos,
    rr: u32,
    rounds: u64,
    /// Push policies: requests whose engine could not take them yet, oldest first; the next
    /// engine with room takes them.
    held: VecDeque<QueuedPrefill>,
}

impl PrefillBalancer {
    pub fn new(
        policy: PrefillLbPolicy,
        engines: u32,
        max_queued: usize,
    ) -> Result<Self, ConfigError> {
        policy.validate()?;
        if engines == 0 {
            return Err(ConfigError::invalid("prefill.gpus", "must be positive"));
        }
        let tiers = match &policy {
            PrefillLbPolicy::Tiered {
                tier_bounds_tokens, ..
            } => tier_bounds_tokens.len() + 1,
            _ => 1,
        };
        let mut b = PrefillBalancer {
            policy,
            engines,
            max_queued,
            tiers: vec![VecDeque::new(); tiers],
            engine_tier: vec![0; engines as usize],
            demand_ns: vec![0.0; tiers],
            next_round: Nanos::ZERO,
            rr: 0,
            rounds: 0,
            held: VecDeque::new(),
        };
        // Before any demand is seen, spread engines evenly.
        let even = vec![1.0; tiers];
        b.assign(&even);
        Ok(b)
    }

    /// Engines pull work: always for the tiered policy, and for a push policy while it holds
    /// requests its chosen engines could not take.
    pub fn pulls(&self) -> bool {
        self.pulls_by_tier() || !self.held.is_empty()
    }
    /// The tiered policy (engines belong to tiers).
    pub fn pulls_by_tier(&self) -> bool {
        matches!(self.policy, PrefillLbPolicy::Tiered { .. })
    }
    pub fn queued(&self) -> usize {
        self.tiers.iter().map(VecDeque::len).sum::<usize>() + self.held.len()
    }
    /// When the next round re-assigns engines to tiers (tiered policy only).
    pub fn next_round(&self) -> Option<Nanos> {
        self.pulls_by_tier().then_some(self.next_round)
    }

    /// A push policy's request that its engine could not take yet: held until an engine
    /// with room pulls it. False when the balancer's queue is full (the request is rejected).
    pub fn hold(&mut self, q: QueuedPrefill) -> bool {
        if self.queued() >= self.max_queued {
            return false;
        }
        self.held.push_back(q);
        true
    }
    pub fn engine_tier(&self, e: EngineId) -> usize {
        self.engine_tier[e.0 as usize]
    }
    pub fn tier_engines(&self) -> Vec<u32> {
        let mut n = vec![0; self.tiers.len()];
        for &t in &self.engine_tier {
            n[t] += 1;
        }
        n
    }
    pub fn rounds(&self) -> u64 {
        self.rounds
    }

    pub fn tier_of(&self, context_tokens: u32) -> usize {
        match &self.policy {
            PrefillLbPolicy::Tiered {
                tier_bounds_tokens, ..
            } => tier_bounds_tokens.partition_point(|&b| b <= context_tokens),
            _ => 0,
        }
    }

    /// Largest-remainder split of the engines over the tiers by `demand`; a tier with demand
    /// gets at least one engine when there are enough engines. Contiguous engine ranges.
    fn assign(&mut self, demand: &[f64]) {
        let total: f64 = demand.iter().sum();
        if total <= 0.0 {
            return;
        }
        let e = self.engines as usize;
        let t = demand.len();
        let mut n: Vec<usize> = demand
            .iter()
            .map(|d| (d / total * e as f64).floor() as usize)
            .collect();
        let wanting = demand.iter().filter(|&&d| d > 0.0).count();
        if wanting <= e {
            for i in 0..t {
                if demand[i] > 0.0 && n[i] == 0 {
                    n[i] = 1;
                }
            }
        }
        // Take back over-assignment from the tiers with the most engines, then hand out the
        // rest by largest fractional share (ties: lower tier).
        while n.iter().sum::<usize>() > e {
            let i = (0..t)
                .max_by_key(|&i| (n[i], std::cmp::Reverse(i)))
                .expect("tiers exist");
            n[i] -= 1;
        }
        let mut order: Vec<usize> = (0..t).collect();
        order.sort_by(|&a, &b| {
            let fa = demand[a] / total * e as f64 - n[a] as f64;
            let fb = demand[b] / total * e as f64 - n[b] as f64;
            fb.total_cmp(&fa).then(a.cmp(&b))
        });
        let mut k = 0;
        while n.iter().sum::<usize>() < e {
            n[order[k % t]] += 1;
            k += 1;
        }
        let mut eng = 0;
        for (tier, &count) in n.iter().enumerate() {
            for _ in 0..count {
                self.engine_tier[eng] = tier;
                eng += 1;
            }
        }
    }

    fn maybe_new_round(&mut self, now: Nanos) {
        if let PrefillLbPolicy::Tiered { round, .. } = self.policy
            && now >= self.next_round
        {
            // A tier's demand is what it received last round plus what it still holds: a tier
            // with queued work but no new submissions keeps its claim to an engine.
            let mut demand = std::mem::replace(&mut self.demand_ns, vec![0.0; self.tiers.len()]);
            for (d, tier) in demand.iter_mut().zip(&self.tiers) {
                *d += tier.iter().map(|q| q.compute_ns.max(1.0)).sum::<f64>();
            }
            self.assign(&demand);
            self.next_round = now + round;
            self.rounds += 1;
        }
    }

    /// Submits a request. Push policies route it now using `loads_ns` (each engine's queued
    /// predicted compute); the tiered policy queues it for a pull.
    pub fn submit(&mut self, now: Nanos, q: QueuedPrefill, loads_ns: &[f64]) -> Submitted {
        self.maybe_new_round(now);
        match self.policy {
            PrefillLbPolicy::RoundRobin => {
                let e = self.rr % self.engines;
                self.rr = self.rr.wrapping_add(1);
                Submitted::Routed(EngineId(e), q)
            }
            PrefillLbPolicy::LeastLoaded => {
                let mut best = 0usize;
                for (i, &l) in loads_ns.iter().enumerate() {
                    if l < loads_ns[best] {
                        best = i;
                    }
                }
                Submitted::Routed(EngineId(best as u32), q)
            }
            PrefillLbPolicy::Tiered { .. } => {
                if self.queued() >= self.max_queued {
                    return Submitted::Rejected(q);
                }
                let t = self.tier_of(q.context_tokens);
                self.demand_ns[t] += q.compute_ns;
                self.tiers[t].push_back(q);
                Submitted::Queued
            }
        }
    }

    /// Engine `e`, whose queued compute is `load_ns`, asks for work. Returns one request or
    /// nothing (quota reached, or nothing to pull); call again until it returns `None`.
    pub fn pull(&mut self, now: Nanos, e: EngineId, load_ns: f64) -> Option<QueuedPrefill> {
        match self.source(now, e, load_ns)? {
            PullSource::Held => self.held.pop_front(),
            PullSource::Tier(t) => self.tiers[t].pop_front(),
        }
    }

    /// Whether [`Self::pull`] would give engine `e` a request now (nothing is taken).
    pub fn can_pull(&mut self, now: Nanos, e: EngineId, load_ns: f64) -> bool {
        self.source(now, e, load_ns).is_some()
    }

    /// The queue engine `e` would pull from now.
    fn source(&mut self, now: Nanos, e: EngineId, load_ns: f64) -> Option<PullSource> {
        if !self.pulls_by_tier() {
            // Push policies pull only what they held back, whoever has room first.
            return (!self.held.is_empty()).then_some(PullSource::Held);
        }
        self.maybe_new_round(now);
        let PrefillLbPolicy::Tiered {
            quota,
            steal_when_idle,
            ..
        } = self.policy
        else {
            return None;
        };
        if load_ns >= quota.0 as f64 {
            return None;
        }
        let t = self.engine_tier[e.0 as usize];
        if !self.tiers[t].is_empty() {
            return Some(PullSource::Tier(t));
        }
        if steal_when_idle && load_ns == 0.0 {
            let oldest = (0..self.tiers.len())
                .filter_map(|i| self.tiers[i].front().map(|q| (q.queued_at, i)))
                .min()?;
            return Some(PullSource::Tier(oldest.1));
        }
        None
    }
}

/// Where a pull takes its request from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PullSource {
    /// A push balancer's held-back requests.
    Held,
    /// A tier's queue.
    Tier(usize),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiered(steal: bool) -> PrefillLbPolicy {
        PrefillLbPolicy::Tiered {
            tier_bounds_tokens: vec![16_384, 65_536, 262_144],
            round: Nanos(100),
            quota: Nanos(1000),
            steal_when_idle: steal,
        }
    }
    fn q(id: u64, ctx: u32, ns: f64, at: u64) -> QueuedPrefill {
        QueuedPrefill {
            request: RequestId(id),
            context_tokens: ctx,
            compute_ns: ns,
            queued_at: Nanos(at),
        }
    }

    #[test]
    fn tiers_by_context() {
        let b = PrefillBalancer::new(tiered(false), 8, 100).unwrap();
        assert_eq!(b.tier_of(100), 0);
        assert_eq!(b.tier_of(16_384), 1);
        assert_eq!(b.tier_of(70_000), 2);
        assert_eq!(b.tier_of(300_000), 3);
        assert_eq!(b.tier_engines(), vec![2, 2, 2, 2]);
    }

    #[test]
    fn engines_follow_previous_round_demand() {
        let mut b = PrefillBalancer::new(tiered(false), 10, 100).unwrap();
        // Round 1 starts at 0. Demand 1:0:3:0 → 10 engines split 2.5 / 7.5 → 3 and 7 by
        // largest remainder (tie → lower tier).
        b.submit(Nanos(0), q(1, 1_000, 100.0, 0), &[]);
        b.submit(Nanos(1), q(2, 100_000, 300.0, 1), &[]);
        assert_eq!(b.tier_engines(), vec![3, 3, 2, 2]); // still the even start
        b.submit(Nanos(100), q(3, 1_000, 1.0, 100), &[]);
        assert_eq!(b.tier_engines(), vec![3, 0, 7, 0]);
        assert_eq!(b.rounds(), 2);
    }

    #[test]
    fn pull_respects_quota_and_tier() {
        let mut b = PrefillBalancer::new(tiered(false), 4, 100).unwrap();
        b.submit(Nanos(0), q(1, 1_000, 10.0, 0), &[]);
        b.submit(Nanos(0), q(2, 100_000, 10.0, 0), &[]);
        // Engine 0 serves tier 0, engine 2 tier 2.
        assert_eq!(b.pull(Nanos(1), EngineId(0), 1000.0), None, "over quota");
        assert_eq!(
            b.pull(Nanos(1), EngineId(0), 0.0).unwrap().request,
            RequestId(1)
        );
        assert_eq!(b.pull(Nanos(1), EngineId(0), 0.0), None);
        assert_eq!(
            b.pull(Nanos(1), EngineId(2), 5.0).unwrap().request,
            RequestId(2)
        );
    }

    #[test]
    fn idle_engine_steals_oldest_when_allowed() {
        let mut b = PrefillBalancer::new(tiered(true), 4, 100).unwrap();
        b.submit(Nanos(0), q(1, 100_000, 10.0, 5), &[]);
        b.submit(Nanos(0), q(2, 300_000, 10.0, 3), &[]);
        assert_eq!(b.pull(Nanos(6), EngineId(0), 1.0), None, "not idle");
        assert_eq!(
            b.pull(Nanos(6), EngineId(0), 0.0).unwrap().request,
            RequestId(2)
        );
    }

    /// Strict mode: a tier whose requests are still queued keeps an engine in the next round
    /// although nothing new was submitted to it (the old demand was last round's submissions
    /// only, which gave such a tier no engine and, without stealing, no one to pull it).
    #[test]
    fn a_tier_with_queued_work_keeps_an_engine() {
        let mut b = PrefillBalancer::new(tiered(false), 4, 100).unwrap();
        b.submit(Nanos(0), q(1, 100_000, 10.0, 0), &[]);
        b.submit(Nanos(100), q(2, 1_000, 1.0, 100), &[]);
        assert_eq!(b.tier_engines()[2], 4, "round 2: only tier 2 had demand");
        // Round 3: tier 0 submitted, tier 2 submitted nothing but still holds request 1.
        assert!(b.pull(Nanos(200), EngineId(0), 0.0).is_some());
        let n = b.tier_engines();
        assert!(n[0] >= 1 && n[2] >= 1, "{n:?}");
    }

    /// Push policies hold what their engine could not take; the first engine with room pulls it.
    #[test]
    fn push_policies_hold_and_any_engine_pulls() {
        let mut rr = PrefillBalancer::new(PrefillLbPolicy::RoundRobin, 2, 2).unwrap();
        assert!(!rr.pulls());
        assert!(rr.hold(q(7, 1, 1.0, 0)));
        assert!(rr.hold(q(8, 1, 1.0, 0)));
        assert!(!rr.hold(q(9, 1, 1.0, 0)), "the queue holds two");
        assert!(rr.pulls());
        assert_eq!(rr.queued(), 2);
        assert_eq!(
            rr.pull(Nanos(1), EngineId(1), 1e9).unwrap().request,
            RequestId(7)
        );
        assert_eq!(
            rr.pull(Nanos(1), EngineId(0), 0.0).unwrap().request,
            RequestId(8)
        );
        assert!(rr.pull(Nanos(1), EngineId(0), 0.0).is_none());
        assert_eq!(rr.next_round(), None);
    }

    #[test]
    fn push_policies_and_bounds() {
        let mut rr = PrefillBalancer::new(PrefillLbPolicy::RoundRobin, 3, 10).unwrap();
        let got: Vec<_> = (0..4)
            .map(|i| match rr.submit(Nanos(0), q(i, 1, 1.0, 0), &[]) {
                Submitted::Routed(e, _) => e.0,
                _ => 99,
            })
            .collect();
        assert_eq!(got, vec![0, 1, 2, 0]);
        let mut ll = PrefillBalancer::new(PrefillLbPolicy::LeastLoaded, 3, 10).unwrap();
        assert!(matches!(
            ll.submit(Nanos(0), q(0, 1, 1.0, 0), &[5.0, 2.0, 2.0]),
            Submitted::Routed(EngineId(1), _)
        ));
        let mut full = PrefillBalancer::new(tiered(false), 2, 1).unwrap();
        assert_eq!(
            full.submit(Nanos(0), q(0, 1, 1.0, 0), &[]),
            Submitted::Queued
        );
        assert!(matches!(
            full.submit(Nanos(0), q(1, 1, 1.0, 0), &[]),
            Submitted::Rejected(_)
        ));
        let bad = PrefillLbPolicy::Tiered {
            tier_bounds_tokens: vec![5, 5],
            round: Nanos(1),
            quota: Nanos(1),
            steal_when_idle: false,
        };
        assert!(bad.validate().is_err());
    }
}
