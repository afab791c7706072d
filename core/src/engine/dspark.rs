//! DSpark verification (SPEC §10): which drafts a decode step verifies.
//!
//! The draft module proposes `D` tokens per sequence and a confidence head predicts each one's
//! acceptance probability given the ones before it. The expected return of verifying drafts
//! `1..=j` of a sequence is the cumulative product of its confidences up to `j`, which falls
//! with `j`; sorting every draft of a rank by that product and verifying the top `V` therefore
//! verifies a prefix of each sequence. The CPU scheduler cannot see step N's confidences when it
//! plans step N+1, so it fixes only the rank's total `V` from confidences it has seen
//! ([`choose_budget`]); the backend splits `V` per sequence with this step's confidences
//! ([`split_budget`], the GPU kernel: cumulative product, global sort, scatter).

use crate::engine::vote::VoteMode;
use crate::error::ConfigError;
use serde::{Deserialize, Serialize};

/// Bins of a [`ConfidenceHistogram`] over the cumulative-product range [0, 1].
pub const CONFIDENCE_BINS: usize = 64;

/// How a decode group chooses how many drafts to verify.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum VerificationPolicy {
    /// Verify `drafts` drafts of every sequence (5 = everything DSpark drafts).
    Fixed { drafts: u32 },
    /// Budget per rank maximising expected throughput, split per sequence by confidence.
    /// The group switches to it only while the in-group vote passes: a rank votes yes when it
    /// holds at least `min_seqs_per_rank` sequences (below that, verification is nearly free
    /// and dynamic mode loses accepted tokens). `min_seqs_per_rank = 0` means always dynamic.
    Dynamic {
        #[serde(default)]
        min_seqs_per_rank: u32,
        #[serde(default)]
        vote: VoteMode,
        /// Extra consecutive rounds a switch must be confirmed in (SPEC §6: a second round).
        #[serde(default = "one")]
        confirmation_rounds: u32,
        /// Whose confidences and step time fix each rank's budget.
        #[serde(default)]
        budget: BudgetScope,
    },
}

/// How the ranks of a lockstep group get their verification budgets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BudgetScope {
    /// The group step lasts as long as its slowest rank: the budget is optimised for the rank
    /// predicted slowest, on the confidences of every rank pooled (thousands of drafts, so the
    /// budget does not follow one rank's noise), and every other rank verifies as many drafts
    /// as fit in that rank's predicted time (verifying more costs the group nothing).
    #[default]
    Group,
    /// Each rank optimises its own budget on its own last confidences, as if it ran alone (the
    /// simpler alternative: the slowest rank's noise sets the group's step time).
    Rank,
}

fn one() -> u32 {
    1
}

impl VerificationPolicy {
    pub fn validate(&self, draft_tokens: u32) -> Result<(), ConfigError> {
        match self {
            VerificationPolicy::Fixed { drafts } if *drafts > draft_tokens => {
                Err(ConfigError::invalid(
                    "verification.drafts",
                    format!(
                        "{drafts} is more than the {draft_tokens} tokens DSpark drafts per step"
                    ),
                ))
            }
            VerificationPolicy::Dynamic { vote, .. } => vote.validate(),
            _ => Ok(()),
        }
    }
}

/// The step-time model of a decode rank: what the scheduler predicts (and, in the simulator,
/// what the cost model charges). Token terms cover every verified position plus the one token
/// each sequence always emits; the quadratic term is the MoE GEMMs leaving the memory-bound
/// regime as the step grows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecodeTimeModel {
    /// Fixed cost of a step (weights, all-to-all latency, launch).
    pub base_ns: f64,
    /// Per sequence (draft module, sampling, bookkeeping).
    pub per_seq_ns: f64,
    /// Per KV token attended, summed over sequences (attention reads the whole KV once).
    pub per_kv_token_ns: f64,
    /// Per query token (1 + verified drafts per sequence).
    pub per_token_ns: f64,
    /// Per query token squared.
    pub per_token_sq_ns: f64,
    /// The split-and-sort kernel dynamic verification adds to a step.
    pub dynamic_overhead_ns: f64,
    /// Share of the token terms spent in MoE layers, scaled by the expert imbalance.
    pub moe_share: f64,
    /// Imbalance the profile was measured at (SPEC §9: 1.09 for EP64 decode).
    pub reference_imbalance: f64,
    /// Per KV token of the step's longest sequence: the critical path of a partly occupied
    /// GPU, where the longest sequence's attention finishes last (0: not modelled).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub per_max_kv_token_ns: f64,
    /// Cost per expert the step activates (absent: none). A small step touches few experts;
    /// each one it touches costs its weight reads and launches whatever its token count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_experts: Option<ActiveExpertTerm>,
}

/// The decode step's cost per distinct expert its query tokens route to. With `experts`
/// routed experts per rank and `top_k` picks per token, uniform routing activates
/// `E·(1 − (1 − k/E)^N)` experts in expectation for N query tokens: 2 for one token and all 8
/// by about 16 tokens on an 8-expert top-2 model, which is why a 1-sequence step on the H200
/// backend grows by ~0.65 ms per extra verified token and a 64-sequence step by ~0.03 ms.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActiveExpertTerm {
    pub per_expert_ns: f64,
    pub experts: u32,
    pub top_k: u32,
}

impl ActiveExpertTerm {
    /// Expected distinct experts `query_tokens` tokens activate. Not inlined: the compiler
    /// would otherwise evaluate the power (a library call) on every step-time prediction,
    /// before testing whether the model has the term at all.
    #[inline(never)]
    pub fn expected_active(&self, query_tokens: u32) -> f64 {
        let e = f64::from(self.experts);
        let miss = 1.0 - f64::from(self.top_k) / e;
        e * (1.0 - miss.powi(query_tokens as i32))
    }

    pub(crate) fn validate(&self, field: &str) -> Result<(), ConfigError> {
        if !(self.per_expert_ns.is_finite() && self.per_expert_ns >= 0.0) {
            return Err(ConfigError::invalid(
                format!("{field}.per_expert_ns"),
                format!(
                    "{} must be a finite non-negative number",
                    self.per_expert_ns
                ),
            ));
        }
        if self.top_k == 0 || self.top_k > self.experts {
            return Err(ConfigError::invalid(
                format!("{field}.top_k"),
                format!(
                    "{} must be at least 1 and at most experts ({})",
                    self.top_k, self.experts
                ),
            ));
        }
        Ok(())
    }
}

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

impl DecodeTimeModel {
    /// Predicted step time of one rank, nanoseconds, when only the KV total is known: the
    /// longest sequence is taken to hold the mean (what a scheduler choosing a verification
    /// budget needs; the term does not depend on the budget).
    pub fn predict_ns(
        &self,
        seqs: u32,
        kv_tokens: u64,
        query_tokens: u32,
        dynamic: bool,
        imbalance: f64,
    ) -> f64 {
        self.curve(seqs, kv_tokens, dynamic, imbalance)
            .at(query_tokens)
    }

    /// Predicted step time of one rank, nanoseconds, knowing its longest sequence's KV tokens.
    pub fn predict_with_max_ns(
        &self,
        seqs: u32,
        kv_tokens: u64,
        max_kv_tokens: u64,
        query_tokens: u32,
        dynamic: bool,
        imbalance: f64,
    ) -> f64 {
        self.curve_with_max(seqs, kv_tokens, max_kv_tokens, dynamic, imbalance)
            .at(query_tokens)
    }

    /// [`Self::predict_ns`] as a function of the query tokens alone, for a search over budgets.
    pub fn curve(&self, seqs: u32, kv_tokens: u64, dynamic: bool, imbalance: f64) -> StepCurve<'_> {
        let mean = if seqs == 0 {
            0
        } else {
            kv_tokens.div_ceil(u64::from(seqs))
        };
        self.curve_with_max(seqs, kv_tokens, mean, dynamic, imbalance)
    }

    /// [`Self::predict_with_max_ns`] as a function of the query tokens alone.
    pub fn curve_with_max(
        &self,
        seqs: u32,
        kv_tokens: u64,
        max_kv_tokens: u64,
        dynamic: bool,
        imbalance: f64,
    ) -> StepCurve<'_> {
        StepCurve {
            model: self,
            empty: seqs == 0,
            // The leading terms of the step time's sum, added in the same order as always.
            fixed: self.base_ns
                + self.per_seq_ns * f64::from(seqs)
                + self.per_kv_token_ns * kv_tokens as f64
                + self.per_max_kv_token_ns * max_kv_tokens as f64,
            scale: 1.0 - self.moe_share + self.moe_share * imbalance / self.reference_imbalance,
            dynamic_ns: if dynamic {
                self.dynamic_overhead_ns
            } else {
                0.0
            },
        }
    }

    pub fn validate(&self, field: &str) -> Result<(), ConfigError> {
        for (name, v) in [
            ("base_ns", self.base_ns),
            ("per_seq_ns", self.per_seq_ns),
            ("per_kv_token_ns", self.per_kv_token_ns),
            ("per_max_kv_token_ns", self.per_max_kv_token_ns),
            ("per_token_ns", self.per_token_ns),
            ("per_token_sq_ns", self.per_token_sq_ns),
            ("dynamic_overhead_ns", self.dynamic_overhead_ns),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(ConfigError::invalid(
                    format!("{field}.{name}"),
                    format!("{v} must be a finite non-negative number"),
                ));
            }
        }
        if self.base_ns + self.per_seq_ns + self.per_token_ns <= 0.0 {
            return Err(ConfigError::invalid(
                format!("{field}.base_ns"),
                "a step must take some time",
            ));
        }
        if let Some(a) = &self.active_experts {
            a.validate(&format!("{field}.active_experts"))?;
        }
        super::validate_moe(field, self.moe_share, self.reference_imbalance)
    }
}

/// One rank's predicted step time as a function of its query tokens: the terms that do not
/// depend on them are summed once, so a search over budgets evaluates only the rest, with the
/// same operations in the same order as [`DecodeTimeModel::predict_with_max_ns`] (same bits).
#[derive(Clone, Copy, Debug)]
pub struct StepCurve<'a> {
    model: &'a DecodeTimeModel,
    empty: bool,
    fixed: f64,
    scale: f64,
    dynamic_ns: f64,
}

impl StepCurve<'_> {
    /// The real query-token count at which the step time reaches `limit_ns`, solving the
    /// quadratic in the token terms; None when the model has an active-expert term or the
    /// time does not rise with the tokens. Only a starting point: rounding may put the exact
    /// answer one token either side.
    pub fn tokens_within(&self, limit_ns: f64) -> Option<f64> {
        let m = self.model;
        if self.empty || m.active_experts.is_some() {
            return None;
        }
        let (a, b) = (m.per_token_sq_ns * self.scale, m.per_token_ns * self.scale);
        let c = limit_ns - self.fixed - self.dynamic_ns;
        let n = if a > 0.0 {
            (-b + (b * b + 4.0 * a * c).max(0.0).sqrt()) / (2.0 * a)
        } else if b > 0.0 {
            c / b
        } else {
            return None;
        };
        n.is_finite().then_some(n)
    }

    /// Predicted step time, nanoseconds, for `query_tokens` query tokens (0 without sequences).
    #[inline]
    pub fn at(&self, query_tokens: u32) -> f64 {
        if self.empty {
            return 0.0;
        }
        let m = self.model;
        let n = f64::from(query_tokens);
        let token = m.per_token_ns * n + m.per_token_sq_ns * n * n;
        self.fixed
            + token * self.scale
            + self.dynamic_ns
            + m.active_experts
                .as_ref()
                .map_or(0.0, |a| a.per_expert_ns * a.expected_active(query_tokens))
    }
}

/// The cumulative-product confidences of one rank's drafts, binned: what a step reports so a
/// later step's budget can be fixed without seeing that step's own confidences.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ConfidenceHistogram {
    /// Sequences the histogram was taken over.
    pub seqs: u32,
    pub count: Vec<u32>,
    /// Sum of the cumulative products in each bin (the expected accepted drafts they carry).
    pub sum: Vec<f64>,
}

impl Default for ConfidenceHistogram {
    fn default() -> Self {
        ConfidenceHistogram {
            seqs: 0,
            count: vec![0; CONFIDENCE_BINS],
            sum: vec![0.0; CONFIDENCE_BINS],
        }
    }
}

impl ConfidenceHistogram {
    /// Adds another histogram's counts (pooling ranks).
    pub fn merge(&mut self, other: &ConfidenceHistogram) {
        self.seqs += other.seqs;
        for (a, b) in self.count.iter_mut().zip(&other.count) {
            *a += b;
        }
        for (a, b) in self.sum.iter_mut().zip(&other.sum) {
            *a += b;
        }
    }
    pub fn clear(&mut self) {
        self.seqs = 0;
        self.count.iter_mut().for_each(|c| *c = 0);
        self.sum.iter_mut().for_each(|s| *s = 0.0);
    }
    pub fn bin(cumprod: f64) -> usize {
        ((cumprod.clamp(0.0, 1.0) * CONFIDENCE_BINS as f64) as usize).min(CONFIDENCE_BINS - 1)
    }
    /// Adds `times` sequences whose drafts have these cumulative products.
    pub fn add(&mut self, cumprods: &[f64], times: u32) {
        self.seqs += times;
        for &c in cumprods {
            let b = Self::bin(c);
            self.count[b] += times;
            self.sum[b] += c * f64::from(times);
        }
    }
}

/// Inputs of [`choose_budget`] for one rank.
#[derive(Clone, Copy, Debug)]
pub struct BudgetInputs {
    pub seqs: u32,
    pub kv_tokens: u64,
    /// Sum of the sequences' `max_drafts`: the budget never exceeds it.
    pub max_drafts: u32,
    pub imbalance: f64,
}

/// The rank budget maximising expected tokens per second, judged on `seen` (confidences of an
/// earlier step, rescaled to this batch). With no history it verifies everything.
pub fn choose_budget(model: &DecodeTimeModel, seen: &ConfidenceHistogram, at: BudgetInputs) -> u32 {
    if seen.seqs == 0 || at.seqs == 0 {
        return at.max_drafts;
    }
    let scale = f64::from(at.seqs) / f64::from(seen.seqs);
    let curve = model.curve(at.seqs, at.kv_tokens, true, at.imbalance);
    let rate = |drafts: f64, expected: f64| {
        let q = at.seqs + drafts.round() as u32;
        (f64::from(at.seqs) + expected) / curve.at(q)
    };
    let mut best = (rate(0.0, 0.0), 0.0);
    let (mut drafts, mut expected) = (0.0, 0.0);
    for b in (0..CONFIDENCE_BINS).rev() {
        if seen.count[b] == 0 {
            continue;
        }
        drafts += f64::from(seen.count[b]) * scale;
        expected += seen.sum[b] * scale;
        let r = rate(drafts, expected);
        if r > best.0 {
            best = (r, drafts);
        }
    }
    (best.1.round() as u32).min(at.max_drafts)
}

/// The largest budget `b <= max_drafts` whose predicted step time stays within `limit_ns`
/// (0 when even no drafts exceed it): a rank that is not the slowest of a lockstep group verifies
/// for free up to the slowest rank's time.
pub fn budget_within(
    model: &DecodeTimeModel,
    at: BudgetInputs,
    dynamic: bool,
    limit_ns: f64,
) -> u32 {
    let curve = model.curve(at.seqs, at.kv_tokens, dynamic, at.imbalance);
    let t = |b: u32| curve.at(at.seqs + b);
    if t(at.max_drafts) <= limit_ns {
        return at.max_drafts;
    }
    // Step time rises with the budget: search for the last budget within the limit, keeping
    // t(lo) <= limit < t(hi).
    let (mut lo, mut hi) = (0u32, at.max_drafts);
    if t(0) > limit_ns {
        return 0;
    }
    // The quadratic's real root lands on (or next to) the answer: the search starts with the
    // budgets around it and narrows by halves only if they do not settle it (the real-valued
    // guess may be off by rounding; the bounds stay exact either way).
    if let Some(tokens) = curve.tokens_within(limit_ns).filter(|_| hi >= 2) {
        let g = (tokens.floor() - f64::from(at.seqs)).clamp(1.0, f64::from(hi - 1)) as u32;
        if t(g) <= limit_ns {
            if t(g + 1) > limit_ns {
                return g;
            }
            lo = g + 1;
        } else {
            if t(g - 1) <= limit_ns {
                return g - 1;
            }
            hi = g - 1;
        }
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if t(mid) <= limit_ns {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo
}

/// The split kernel: verify the `budget` drafts with the highest cumulative confidence. `conf`
/// holds each sequence's `draft_tokens` per-position confidences (conditional on the earlier
/// drafts being accepted); `max_drafts[s]` limits sequence `s`; the lengths go to `lens`. Ties
/// go to the lower sequence, then the earlier position, so every sequence gets a prefix.
pub fn split_budget(
    conf: &[f64],
    draft_tokens: usize,
    max_drafts: &[u32],
    budget: u32,
    lens: &mut [u8],
) {
    let seqs = max_drafts.len();
    debug_assert_eq!(conf.len(), seqs * draft_tokens);
    let mut items: Vec<(f64, usize, usize)> = Vec::with_capacity(seqs * draft_tokens);
    for s in 0..seqs {
        let mut cp = 1.0;
        for p in 0..(max_drafts[s] as usize).min(draft_tokens) {
            cp *= conf[s * draft_tokens + p];
            items.push((cp, s, p));
        }
    }
    items.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    lens[..seqs].iter_mut().for_each(|l| *l = 0);
    for &(_, s, p) in items.iter().take(budget as usize) {
        lens[s] = lens[s].max(p as u8 + 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn split_takes_top_cumulative_products() {
        // Seq 0: 0.9, 0.9·0.9 = 0.81, 0.81·0.1 = 0.081. Seq 1: 0.5, 0.25, 0.125.
        let conf = [0.9, 0.9, 0.1, 0.5, 0.5, 0.5];
        let mut lens = [0u8; 2];
        split_budget(&conf, 3, &[3, 3], 3, &mut lens);
        assert_eq!(lens, [2, 1]); // 0.9, 0.81, 0.5
        split_budget(&conf, 3, &[3, 3], 5, &mut lens);
        assert_eq!(lens, [2, 3]); // + 0.25, 0.125 beat 0.081
        split_budget(&conf, 3, &[1, 3], 6, &mut lens);
        assert_eq!(lens, [1, 3]); // seq 0 is capped at 1 draft
    }

    #[test]
    fn split_gives_prefixes_and_ties_go_to_lower_seq() {
        let conf = [1.0, 1.0, 1.0, 1.0];
        let mut lens = [0u8; 2];
        split_budget(&conf, 2, &[2, 2], 3, &mut lens);
        assert_eq!(lens, [2, 1]);
    }

    #[test]
    fn budget_golden() {
        // One sequence; step = 1000 + 100 × (1 + v) ns. Drafts with cumulative products 0.9
        // and 0.05: rate(0) = 1/1100, rate(1) = 1.9/1200 = 1/631, rate(2) = 1.95/1300 = 1/667.
        let mut h = ConfidenceHistogram::default();
        h.add(&[0.9, 0.05], 1);
        let at = BudgetInputs {
            seqs: 1,
            kv_tokens: 0,
            max_drafts: 2,
            imbalance: 1.0,
        };
        assert_eq!(choose_budget(&model(), &h, at), 1);
        // With free verification everything is verified.
        let free = DecodeTimeModel {
            per_token_ns: 0.0,
            ..model()
        };
        assert_eq!(choose_budget(&free, &h, at), 2);
        // Without history: everything.
        assert_eq!(
            choose_budget(&model(), &ConfidenceHistogram::default(), at),
            2
        );
    }

    #[test]
    fn budget_within_a_time_limit() {
        // One sequence, 1000 + 100 × (1 + b) ns.
        let at = BudgetInputs {
            seqs: 1,
            kv_tokens: 0,
            max_drafts: 10,
            imbalance: 1.0,
        };
        assert_eq!(budget_within(&model(), at, false, 1500.0), 4);
        assert_eq!(budget_within(&model(), at, false, 1499.0), 3);
        assert_eq!(budget_within(&model(), at, false, 100.0), 0);
        assert_eq!(budget_within(&model(), at, false, 1e9), 10);
    }

    /// The step-time formula as one expression (how `predict_with_max_ns` was written before
    /// the curve split its terms): the curve must give these bits.
    fn formula(
        m: &DecodeTimeModel,
        seqs: u32,
        kv: u64,
        max_kv: u64,
        q: u32,
        dynamic: bool,
        imb: f64,
    ) -> f64 {
        if seqs == 0 {
            return 0.0;
        }
        let n = f64::from(q);
        let token = m.per_token_ns * n + m.per_token_sq_ns * n * n;
        let scale = 1.0 - m.moe_share + m.moe_share * imb / m.reference_imbalance;
        m.base_ns
            + m.per_seq_ns * f64::from(seqs)
            + m.per_kv_token_ns * kv as f64
            + m.per_max_kv_token_ns * max_kv as f64
            + token * scale
            + if dynamic { m.dynamic_overhead_ns } else { 0.0 }
            + m.active_experts
                .as_ref()
                .map_or(0.0, |a| a.per_expert_ns * a.expected_active(q))
    }

    fn any_model() -> impl proptest::strategy::Strategy<Value = DecodeTimeModel> {
        use proptest::prelude::*;
        (
            (
                0.0..5e6f64,
                0.0..2e5f64,
                0.0..1.0f64,
                0.0..1e4f64,
                0.0..50.0f64,
            ),
            (0.0..3e5f64, 0.0..1.0f64, 1.0..1.5f64, 0.0..1.0f64),
            proptest::option::of((0.0..1e6f64, 1u32..16, 1u32..4)),
        )
            .prop_map(
                |((base, seq, kv, tok, sq), (dynamic, moe, reference, max_kv), experts)| {
                    DecodeTimeModel {
                        base_ns: base,
                        per_seq_ns: seq,
                        per_kv_token_ns: kv,
                        per_token_ns: tok,
                        // Often exactly linear, to cover the linear root.
                        per_token_sq_ns: if sq < 10.0 { 0.0 } else { sq },
                        dynamic_overhead_ns: dynamic,
                        moe_share: moe,
                        reference_imbalance: reference,
                        per_max_kv_token_ns: max_kv,
                        active_experts: experts.map(|(per_expert_ns, experts, k)| {
                            ActiveExpertTerm {
                                per_expert_ns,
                                experts: experts.max(k),
                                top_k: k,
                            }
                        }),
                    }
                },
            )
    }

    proptest::proptest! {
        #[test]
        fn curve_gives_the_formulas_bits(m in any_model(), seqs in 0u32..200, kv in 0u64..20_000_000,
                                         max_kv in 0u64..200_000, q in 0u32..2000, dynamic in proptest::bool::ANY,
                                         imb in 1.0..2.0f64) {
            let want = formula(&m, seqs, kv, max_kv, q, dynamic, imb);
            proptest::prop_assert_eq!(m.predict_with_max_ns(seqs, kv, max_kv, q, dynamic, imb).to_bits(), want.to_bits());
            let mean = if seqs == 0 { 0 } else { kv.div_ceil(u64::from(seqs)) };
            let want = formula(&m, seqs, kv, mean, q, dynamic, imb);
            proptest::prop_assert_eq!(m.predict_ns(seqs, kv, q, dynamic, imb).to_bits(), want.to_bits());
        }

        /// The root-guided search finds the last budget within the limit, as a scan does,
        /// whether the limit falls on a budget's exact time, between two, or outside them all.
        #[test]
        fn budget_within_matches_a_scan(m in any_model(), seqs in 1u32..130, kv in 0u64..20_000_000,
                                        max_drafts in 0u32..700, pick in 0u32..800, jitter in -2i32..3,
                                        dynamic in proptest::bool::ANY, imb in 1.0..2.0f64) {
            let at = BudgetInputs { seqs, kv_tokens: kv, max_drafts, imbalance: imb };
            let t = |b: u32| m.predict_ns(seqs, kv, seqs + b, dynamic, imb);
            let exact = t(pick);
            let limit = match jitter {
                0 => exact,
                j => f64::from_bits(exact.to_bits().wrapping_add_signed(i64::from(j))),
            };
            let want = (0..=max_drafts).rev().find(|&b| t(b) <= limit).unwrap_or(0);
            proptest::prop_assert_eq!(budget_within(&m, at, dynamic, limit), want);
        }
    }

    #[test]
    fn merged_histograms_add_up() {
        let (mut a, mut b) = (
            ConfidenceHistogram::default(),
            ConfidenceHistogram::default(),
        );
        a.add(&[0.9, 0.5], 2);
        b.add(&[0.9], 1);
        a.merge(&b);
        assert_eq!(a.seqs, 3);
        assert_eq!(a.count[ConfidenceHistogram::bin(0.9)], 3);
        assert!((a.sum[ConfidenceHistogram::bin(0.9)] - 2.7).abs() < 1e-12);
    }

    #[test]
    fn budget_rescales_history_to_the_batch() {
        let mut h = ConfidenceHistogram::default();
        h.add(&[0.99, 0.98, 0.97, 0.001, 0.0005], 10);
        let at = BudgetInputs {
            seqs: 20,
            kv_tokens: 0,
            max_drafts: 100,
            imbalance: 1.0,
        };
        assert_eq!(choose_budget(&model(), &h, at), 60);
    }

    #[test]
    fn active_expert_term_counts_expected_distinct_experts() {
        let m = DecodeTimeModel {
            per_max_kv_token_ns: 0.0,
            active_experts: Some(ActiveExpertTerm {
                per_expert_ns: 100.0,
                experts: 8,
                top_k: 2,
            }),
            ..model()
        };
        // one token picks 2 of 8 experts; two tokens miss a given expert with (6/8)² = 9/16,
        // so 8 × 7/16 = 3.5 experts are active.
        assert_eq!(m.predict_ns(1, 0, 1, false, 1.0), 1000.0 + 100.0 + 200.0);
        assert_eq!(m.predict_ns(1, 0, 2, false, 1.0), 1000.0 + 200.0 + 350.0);
        // many tokens: every expert
        assert!((m.predict_ns(1, 0, 200, false, 1.0) - (1000.0 + 20_000.0 + 800.0)).abs() < 1e-6);
        let bad = DecodeTimeModel {
            per_max_kv_token_ns: 0.0,
            active_experts: Some(ActiveExpertTerm {
                per_expert_ns: 100.0,
                experts: 2,
                top_k: 3,
            }),
            ..model()
        };
        let e = bad.validate("decode").unwrap_err().to_string();
        assert!(e.contains("decode.active_experts.top_k"), "{e}");
    }

    #[test]
    fn imbalance_scales_moe_share_only() {
        let m = DecodeTimeModel {
            moe_share: 0.5,
            reference_imbalance: 1.0,
            ..model()
        };
        // token part = 100 × 10 = 1000; half of it doubles at imbalance 2.
        assert_eq!(m.predict_ns(1, 0, 10, false, 1.0), 2000.0);
        assert_eq!(m.predict_ns(1, 0, 10, false, 2.0), 2500.0);
        assert_eq!(m.predict_ns(0, 0, 0, false, 1.0), 0.0);
    }

    #[test]
    fn rejects_bad_values() {
        let bad = DecodeTimeModel {
            per_token_ns: f64::NAN,
            ..model()
        };
        assert!(
            bad.validate("decode")
                .unwrap_err()
                .to_string()
                .contains("decode.per_token_ns")
        );
        assert!(VerificationPolicy::Fixed { drafts: 6 }.validate(5).is_err());
    }
}
