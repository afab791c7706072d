//! A closed-loop decode benchmark for DSpark (SPEC §10): one EP group with a fixed number of
//! sequences per rank (a finished sequence is replaced at once, like an offline benchmark),
//! run with one verification policy. The experiment compares fixed-5 with dynamic.

use crate::acceptance::AcceptanceModel;
use crate::cost::{CostModel, SwapIn};
use crate::profile::HardwareProfile;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use servelab_core::engine::{
    Backend, DecodeGroup, DecodeGroupConfig, DecodePlan, Scheduling, SeqEmission, StepPlan,
    StepReport, VerificationPolicy,
};
use servelab_core::{ConfigError, EngineId, Nanos, RequestId};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DsparkPoint {
    pub ranks: u32,
    pub seqs_per_rank: u32,
    pub steps: u32,
    /// Steps run before measuring.
    pub warmup_steps: u32,
    /// KV length of a new sequence, uniform in this range (tokens).
    pub kv_tokens_min: u32,
    pub kv_tokens_max: u32,
    /// Output length of a sequence, uniform in this range.
    pub output_tokens_min: u32,
    pub output_tokens_max: u32,
    pub draft_tokens: u32,
    pub expert_imbalance: f64,
    pub scheduling: Scheduling,
}

impl DsparkPoint {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.ranks == 0 || self.seqs_per_rank == 0 || self.steps == 0 {
            return Err(ConfigError::invalid(
                "seqs_per_rank",
                "ranks, sequences per rank and steps must be positive",
            ));
        }
        if self.kv_tokens_min > self.kv_tokens_max
            || self.output_tokens_min == 0
            || self.output_tokens_min > self.output_tokens_max
        {
            return Err(ConfigError::invalid(
                "point.output_tokens_min",
                "ranges must be non-empty (and outputs positive)",
            ));
        }
        Ok(())
    }
}

/// Measured over the steps after warm-up.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DsparkResult {
    pub tokens_per_s_per_rank: f64,
    /// Tokens emitted per live sequence-step (accepted drafts + 1).
    pub accepted_length: f64,
    /// Drafts verified per sequence-step.
    pub verified_per_step: f64,
    pub mean_step_ms: f64,
    /// Share of measured steps that ran in dynamic mode.
    pub dynamic_share: f64,
    /// Simulated time of the whole run, warm-up included (for its speed figures).
    pub simulated_s: f64,
    /// Sequences the run admitted, the initial batch included.
    pub sequences: u64,
}

pub fn run_point(
    point: &DsparkPoint,
    verification: &VerificationPolicy,
    profile: &HardwareProfile,
    acceptance: &AcceptanceModel,
    seed: u64,
) -> Result<DsparkResult, ConfigError> {
    point.validate()?;
    acceptance.validate()?;
    let group = DecodeGroup::new(
        EngineId(0),
        group_config(point, verification),
        profile.decode.clone(),
    )?;
    let mut backend = CostModel::new(
        profile.clone(),
        acceptance,
        point.draft_tokens,
        SwapIn::Overlapped,
        seed,
    );
    let mut lp = ClosedLoop::fill(point, group, seed);
    let mut plans = [
        StepPlan::Decode(empty_plan()),
        StepPlan::Decode(empty_plan()),
    ];
    let mut report = StepReport::default();
    let mut out: Vec<SeqEmission> = Vec::new();
    let (mut now, mut t0) = (Nanos::ZERO, Nanos::ZERO);
    let mut tally = Tally::default();
    let asynchronous = point.scheduling == Scheduling::Async;
    let sync_gap = sync_gap(point, profile);
    // Async: the plan of step N+1 exists before N's report is applied.
    if let StepPlan::Decode(p) = &mut plans[0] {
        lp.group.plan_step(p);
    }
    for step in 0..point.warmup_steps + point.steps {
        let (cur, next) = plans.split_at_mut(1);
        let (cur, next) = (&mut cur[0], &mut next[0]);
        backend.execute(now, cur, &mut report);
        if asynchronous && let StepPlan::Decode(p) = next {
            lp.group.plan_step(p);
        }
        let StepPlan::Decode(cp) = &*cur else {
            unreachable!("decode plans only")
        };
        lp.group.apply_report(cp, &report, &mut out);
        now = now + report.duration + sync_gap;
        if step == point.warmup_steps {
            t0 = now - report.duration - sync_gap;
        }
        if step >= point.warmup_steps {
            tally.add(&out, &report, cp.dynamic);
        }
        for e in out.iter().filter(|e| e.finished) {
            let r = lp.rank_of[e.request.0 as usize];
            lp.admit(r);
        }
        if !asynchronous && let StepPlan::Decode(p) = next {
            lp.group.plan_step(p);
        }
        plans.swap(0, 1);
    }
    lp.group
        .check_invariants()
        .map_err(|e| ConfigError::invalid("dspark", e))?;
    let measured_s = (now - t0).as_secs_f64();
    Ok(tally.result(point, measured_s, now.as_secs_f64(), lp.next_id))
}

/// CPU time between decode steps: none under asynchronous scheduling, which hides it behind
/// the GPU.
fn sync_gap(point: &DsparkPoint, profile: &HardwareProfile) -> Nanos {
    if point.scheduling == Scheduling::Async {
        Nanos::ZERO
    } else {
        profile.transfer.sync_gap
    }
}

/// One EP group sized for the point: every rank holds its sequences at their longest.
fn group_config(point: &DsparkPoint, verification: &VerificationPolicy) -> DecodeGroupConfig {
    let max_ctx = u64::from(point.kv_tokens_max) + u64::from(point.output_tokens_max);
    DecodeGroupConfig {
        ranks: point.ranks,
        max_seqs_per_rank: point.seqs_per_rank,
        kv_capacity_tokens_per_rank: max_ctx * u64::from(point.seqs_per_rank),
        max_waiting_per_rank: point.seqs_per_rank,
        draft_tokens: point.draft_tokens,
        verification: verification.clone(),
        scheduling: point.scheduling,
        expert_imbalance: point.expert_imbalance,
    }
}

/// The group with its sequences, each replaced on its rank as it finishes; their KV and output
/// lengths drawn from the point's ranges.
struct ClosedLoop<'a> {
    point: &'a DsparkPoint,
    group: DecodeGroup,
    rng: ChaCha8Rng,
    next_id: u64,
    /// The rank of each request, indexed by its id.
    rank_of: Vec<u32>,
}

impl<'a> ClosedLoop<'a> {
    /// The group with every rank full, ranks in order.
    fn fill(point: &'a DsparkPoint, group: DecodeGroup, seed: u64) -> Self {
        let rng = ChaCha8Rng::seed_from_u64(servelab_core::seed::sub_seed(seed, "dspark.requests"));
        let mut lp = ClosedLoop {
            point,
            group,
            rng,
            next_id: 0,
            rank_of: Vec::new(),
        };
        for r in 0..point.ranks {
            for _ in 0..point.seqs_per_rank {
                lp.admit(r);
            }
        }
        lp
    }

    /// A new sequence on rank `r`.
    fn admit(&mut self, r: u32) {
        let p = self.point;
        let kv = self.rng.random_range(p.kv_tokens_min..=p.kv_tokens_max);
        let out = self
            .rng
            .random_range(p.output_tokens_min..=p.output_tokens_max);
        self.group
            .admit(r, RequestId(self.next_id), kv, out)
            .expect("closed loop never overfills");
        self.rank_of.push(r);
        self.next_id += 1;
    }
}

/// Totals over the measured steps.
#[derive(Default)]
struct Tally {
    tokens: u64,
    seq_steps: u64,
    verified: u64,
    dyn_steps: u64,
}

impl Tally {
    /// One step: its emissions, its report and whether it ran in dynamic mode.
    fn add(&mut self, out: &[SeqEmission], report: &StepReport, dynamic: bool) {
        self.tokens += out.iter().map(|e| u64::from(e.tokens)).sum::<u64>();
        self.seq_steps += out.len() as u64;
        self.verified += report
            .seqs
            .iter()
            .map(|s| u64::from(s.verified))
            .sum::<u64>();
        self.dyn_steps += u64::from(dynamic);
    }

    /// The rates over `secs` of measured time, in a run of `simulated_s` in all that admitted
    /// `sequences`.
    fn result(
        &self,
        point: &DsparkPoint,
        secs: f64,
        simulated_s: f64,
        sequences: u64,
    ) -> DsparkResult {
        let plan_seqs = self.seq_steps.max(1) as f64;
        DsparkResult {
            tokens_per_s_per_rank: self.tokens as f64 / secs / f64::from(point.ranks),
            accepted_length: self.tokens as f64 / plan_seqs,
            verified_per_step: self.verified as f64 / plan_seqs,
            mean_step_ms: secs * 1e3 / f64::from(point.steps),
            dynamic_share: self.dyn_steps as f64 / f64::from(point.steps),
            simulated_s,
            sequences,
        }
    }
}

fn empty_plan() -> DecodePlan {
    DecodePlan {
        engine: EngineId(0),
        ranks: Vec::new(),
        seqs: Vec::new(),
        dynamic: false,
        expert_imbalance: 1.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::ProfileFiles;

    fn point(b: u32) -> DsparkPoint {
        DsparkPoint {
            ranks: 4,
            seqs_per_rank: b,
            steps: 300,
            warmup_steps: 20,
            kv_tokens_min: 1024,
            kv_tokens_max: 131_072,
            output_tokens_min: 256,
            output_tokens_max: 2048,
            draft_tokens: 5,
            expert_imbalance: 1.09,
            scheduling: Scheduling::Async,
        }
    }

    #[test]
    fn dynamic_verifies_fewer_drafts_and_gains_at_large_batches() {
        let prof = HardwareProfile::resolve("sm100-published").unwrap();
        let acc = AcceptanceModel::default();
        let fixed = run_point(
            &point(96),
            &VerificationPolicy::Fixed { drafts: 5 },
            &prof,
            &acc,
            1,
        )
        .unwrap();
        let dynamic = VerificationPolicy::Dynamic {
            min_seqs_per_rank: 0,
            vote: Default::default(),
            confirmation_rounds: 1,
            budget: Default::default(),
        };
        let dy = run_point(&point(96), &dynamic, &prof, &acc, 1).unwrap();
        assert!((fixed.verified_per_step - 5.0).abs() < 0.05, "{fixed:?}");
        assert!(dy.verified_per_step < 4.5, "{dy:?}");
        assert!(dy.accepted_length < fixed.accepted_length);
        assert!(dy.tokens_per_s_per_rank > fixed.tokens_per_s_per_rank);
        assert_eq!(dy.dynamic_share, 1.0);
    }

    #[test]
    fn same_seed_same_result() {
        let prof = HardwareProfile::resolve("sm100-published").unwrap();
        let a = run_point(
            &point(8),
            &VerificationPolicy::Fixed { drafts: 5 },
            &prof,
            &AcceptanceModel::default(),
            3,
        )
        .unwrap();
        let b = run_point(
            &point(8),
            &VerificationPolicy::Fixed { drafts: 5 },
            &prof,
            &AcceptanceModel::default(),
            3,
        )
        .unwrap();
        assert_eq!(a, b);
    }
}
