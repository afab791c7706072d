//! EP failover's expert re-placement (SPEC §8–§9): when a decode group restarts on fewer (or
//! more) ranks, its experts are re-placed with DeepSeek's EPLB ([`rebalance_experts`]) on the
//! ranks it has, and the group's MoE imbalance factor follows the new placement.
//!
//! The placement is computed from the expected routing shares of the expert-load model's
//! base popularity (Zipf exponent 0.5 and a per-phase offset of deviation 0.2, no drift or
//! batch noise; *servelab's choice*), seeded by a constant: the factor depends only on the
//! rank count, so a restart is reproducible whatever else the run did. The group's factor is
//! its configured `expert_imbalance` × (EPLB imbalance on `n` ranks ÷ EPLB imbalance on the
//! configured ranks), so a group at full size keeps its configured factor exactly.

use crate::eplb::{ExpertLoadGenerator, MoeModel, Phase, SkewConfig, rebalance_experts};
use crate::time::Nanos;
use std::collections::BTreeMap;

/// Redundant expert slots per GPU of decode's EPLB (SPEC §9).
const REDUNDANT_PER_GPU: usize = 1;

/// Expected per-layer shares of the routed tokens, `[layer][expert]`.
fn expected_weights(model: &MoeModel) -> Vec<Vec<f32>> {
    let skew = SkewConfig {
        zipf_exponent: 0.5,
        phase_sigma: 0.2,
        drift_sigma: 0.0,
        drift_timescale: Nanos::from_secs(1200),
        drift_tick: Nanos::from_secs(1),
        sequence_sigma: 0.0,
    };
    let generator = ExpertLoadGenerator::new(model, Phase::Decode, &skew, 0, "failover")
        .expect("the failover's load model is valid");
    (0..model.layers)
        .map(|l| {
            generator
                .expected_share(l)
                .iter()
                .map(|&q| q as f32)
                .collect()
        })
        .collect()
}

/// Σ over layers of the busiest GPU's expected load ÷ Σ of the mean GPU's, for EPLB's
/// placement of `weights` on `gpus` GPUs (slots: the experts plus one redundant slot per GPU,
/// rounded up to a multiple of the GPUs).
pub fn eplb_imbalance(weights: &[Vec<f32>], gpus: usize) -> f64 {
    let experts = weights.first().map_or(0, Vec::len);
    let gpus = gpus.max(1);
    let slots = (experts + REDUNDANT_PER_GPU * gpus).div_ceil(gpus) * gpus;
    let Ok(p) = rebalance_experts(weights, slots, 1, 1, gpus) else {
        return 1.0;
    };
    let per_gpu = slots / gpus;
    let (mut max_sum, mut mean_sum) = (0.0f64, 0.0f64);
    for (layer, row) in weights.iter().enumerate() {
        let mut load = vec![0.0f64; gpus];
        for (slot, &e) in p.phy2log[layer].iter().enumerate() {
            load[slot / per_gpu] += f64::from(row[e]) / p.logcnt[layer][e] as f64;
        }
        max_sum += load.iter().copied().fold(0.0, f64::max);
        mean_sum += load.iter().sum::<f64>() / gpus as f64;
    }
    if mean_sum > 0.0 {
        max_sum / mean_sum
    } else {
        1.0
    }
}

/// The imbalance factor of a decode group by rank count, computed once per count.
pub struct Failover {
    base_factor: f64,
    base_ranks: u32,
    weights: Option<Vec<Vec<f32>>>,
    by_ranks: BTreeMap<u32, f64>,
}

impl Failover {
    /// Groups configured with `ranks` ranks and factor `expert_imbalance`.
    pub fn new(ranks: u32, expert_imbalance: f64) -> Self {
        Failover {
            base_factor: expert_imbalance,
            base_ranks: ranks,
            weights: None,
            by_ranks: BTreeMap::new(),
        }
    }

    /// The factor of a group restarted on `ranks` ranks.
    pub fn factor(&mut self, ranks: u32) -> f64 {
        if ranks == self.base_ranks {
            return self.base_factor;
        }
        if let Some(&f) = self.by_ranks.get(&ranks) {
            return f;
        }
        let w = self
            .weights
            .get_or_insert_with(|| expected_weights(&MoeModel::default()));
        let ratio = eplb_imbalance(w, ranks as usize) / eplb_imbalance(w, self.base_ranks as usize);
        // A factor is at least 1 (slowest rank ÷ mean) whatever the ratio.
        let f = (self.base_factor * ratio).max(1.0);
        self.by_ranks.insert(ranks, f);
        f
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_load_on_a_divisible_count_is_balanced() {
        // 8 experts of equal load on 4 GPUs: 12 slots, 3 per GPU; every GPU carries 2 of 8.
        let w = vec![vec![1.0f32; 8]];
        let f = eplb_imbalance(&w, 4);
        assert!((f - 1.0).abs() < 1e-9, "{f}");
    }

    #[test]
    fn full_size_keeps_the_configured_factor_and_fewer_ranks_change_it() {
        let mut fo = Failover::new(64, 1.09);
        assert_eq!(fo.factor(64), 1.09);
        let f63 = fo.factor(63);
        assert!(f63 >= 1.0 && f63.is_finite());
        assert_ne!(
            f63, 1.09,
            "63 ranks hold 319 → 320 slots, a different packing"
        );
        assert_eq!(fo.factor(63), f63, "cached");
    }
}
