//! The simulator's [`Backend`]: step durations from a hardware profile, decode acceptance from
//! the tabulated acceptance model. The GPU engine implements the same trait with kernels.

use crate::acceptance::{AcceptanceModel, AcceptanceTable, RankScratch};
use crate::profile::HardwareProfile;
use serde::{Deserialize, Serialize};
use servelab_core::Nanos;
use servelab_core::engine::{
    Backend, DecodePlan, PrefillPlan, RankOutcome, SeqOutcome, StepPlan, StepReport,
};

/// How the hit prefix's KV reaches HBM.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SwapIn {
    /// Layer by layer over the NIC while the forward pass runs (SPEC §3.4): only the first
    /// layer's copy is exposed.
    #[default]
    Overlapped,
    /// Copy everything, then compute.
    Serial,
}

/// SplitMix64 (Steele, Lea & Flood 2014): one add and two multiplies per word. Each decode
/// sequence-step needs one random word; ChaCha8 costs several times more per word, and the draws
/// only pick a tabulated profile and a uniform, so a small statistically sound generator seeded
/// from the run's sub-seed keeps the run deterministic at a fraction of the cost.
#[derive(Clone, Debug)]
struct SplitMix64(u64);

impl SplitMix64 {
    #[inline]
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

pub struct CostModel {
    profile: HardwareProfile,
    table: AcceptanceTable,
    swap_in: SwapIn,
    rng: SplitMix64,
    scratch: RankScratch,
}

impl CostModel {
    pub fn new(
        profile: HardwareProfile,
        acceptance: &AcceptanceModel,
        draft_tokens: u32,
        swap_in: SwapIn,
        seed: u64,
    ) -> Self {
        let table = AcceptanceTable::new(
            acceptance,
            draft_tokens,
            servelab_core::seed::sub_seed(seed, "acceptance.table"),
        );
        CostModel {
            profile,
            table,
            swap_in,
            rng: SplitMix64(servelab_core::seed::sub_seed(seed, "acceptance.draws")),
            scratch: RankScratch::default(),
        }
    }
    pub fn profile(&self) -> &HardwareProfile {
        &self.profile
    }

    pub fn prefill_ns(&self, plan: &PrefillPlan) -> f64 {
        let compute = self
            .profile
            .prefill
            .step_ns(&plan.chunks, plan.expert_imbalance);
        let bytes: u64 = plan.chunks.iter().map(|c| c.swap_in_bytes).sum();
        if bytes == 0 {
            return compute;
        }
        let swap = bytes as f64 / self.profile.transfer.swap_in_bytes_per_s * 1e9;
        match self.swap_in {
            SwapIn::Serial => compute + swap,
            SwapIn::Overlapped => {
                let layers = plan
                    .chunks
                    .iter()
                    .map(|c| c.new_token_layers)
                    .max()
                    .unwrap_or(1)
                    .max(1);
                compute.max(swap) + swap / f64::from(layers)
            }
        }
    }

    fn decode(&mut self, plan: &DecodePlan, report: &mut StepReport) -> f64 {
        let model = &self.profile.decode;
        report.seqs.clear();
        report.seqs.resize(plan.seqs.len(), SeqOutcome::default());
        report
            .ranks
            .resize_with(plan.ranks.len(), RankOutcome::default);
        let mut slowest = 0.0f64;
        for (r, rp) in plan.ranks.iter().enumerate() {
            let (start, end) = (rp.seq_start as usize, rp.seq_end as usize);
            let hist = &mut report.ranks[r].confidence;
            if start == end {
                hist.clear();
                continue;
            }
            let rng = &mut self.rng;
            let step = self.table.step_rank(
                &plan.seqs[start..end],
                plan.dynamic.then_some(rp.verify_budget),
                || rng.next_u64(),
                &mut self.scratch,
                &mut report.seqs[start..end],
                hist,
            );
            let n = (end - start) as u32;
            let t = model.predict_with_max_ns(
                n,
                step.kv_tokens,
                step.max_kv_tokens,
                n + step.verified,
                plan.dynamic,
                plan.expert_imbalance,
            );
            slowest = slowest.max(t);
        }
        slowest
    }
}

impl Backend for CostModel {
    fn execute(&mut self, _now: Nanos, plan: &StepPlan, report: &mut StepReport) {
        let ns = match plan {
            StepPlan::Prefill(p) => {
                report.seqs.clear();
                report.ranks.clear();
                self.prefill_ns(p)
            }
            StepPlan::Decode(p) => self.decode(p, report),
        };
        // At least 1 ns, so a step always moves time forward.
        report.duration = Nanos((ns.round() as u64).max(1));
    }
}
