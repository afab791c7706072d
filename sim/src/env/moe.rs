//! The MoE part of a step's time in the simulator (SPEC §9): with an expert-load model per
//! engine, each step's expert imbalance (slowest rank ÷ mean) comes from skewed, drifting
//! routing and the placement policy, and EPLB reassignments add their weight-shuffle time to the
//! engine's step. On a GPU the real routing provides both; here they decorate the plan before
//! the cost model runs it.

use crate::service::MoeImbalance;
use servelab_core::engine::StepPlan;
use servelab_core::eplb::{ExpertLoadModel, MoeBatch};
use servelab_core::unit::DeviceId;
use servelab_core::{ConfigError, Nanos};

#[derive(Default)]
pub struct MoeSkew {
    prefill: Vec<ExpertLoadModel>,
    /// DP ranks of a prefill EP instance (`moe.prefill.ep.gpus`).
    prefill_dp: u64,
    decode: Vec<ExpertLoadModel>,
    pub reassignments: u64,
    pub reassignment_ns: u64,
}

impl MoeSkew {
    pub fn new(
        moe: &MoeImbalance,
        prefill_gpus: u32,
        decode_groups: u32,
        seed: u64,
    ) -> Result<Self, ConfigError> {
        let mut m = MoeSkew {
            prefill_dp: 1,
            ..MoeSkew::default()
        };
        if let MoeImbalance::Model { prefill, decode } = moe {
            if let Some(c) = prefill {
                m.prefill_dp = c.ep.gpus as u64;
                for e in 0..prefill_gpus {
                    m.prefill
                        .push(ExpertLoadModel::new(c, seed, &format!("prefill.{e}"))?);
                }
            }
            if let Some(c) = decode {
                for g in 0..decode_groups {
                    m.decode
                        .push(ExpertLoadModel::new(c, seed, &format!("decode.{g}"))?);
                }
            }
        }
        Ok(m)
    }

    /// Sets the plan's expert imbalance from the device's model (if it has one) and returns
    /// the reassignment time to add to the step.
    pub fn decorate(&mut self, now: Nanos, device: DeviceId, plan: &mut StepPlan) -> Nanos {
        let (model, batch, imbalance) = match (device, plan) {
            (DeviceId::Prefill(e), StepPlan::Prefill(p)) => {
                let Some(m) = self.prefill.get_mut(e as usize) else {
                    return Nanos::ZERO;
                };
                // The instance's DP ranks run similar batches: its MoE layers see `ep.gpus`
                // of them.
                let dp = self.prefill_dp;
                let batch = MoeBatch {
                    tokens: p.new_tokens() * dp,
                    sequences: p.chunks.len() as u64 * dp,
                };
                (m, batch, &mut p.expert_imbalance)
            }
            (DeviceId::Decode(g), StepPlan::Decode(p)) => {
                let Some(m) = self.decode.get_mut(g as usize) else {
                    return Nanos::ZERO;
                };
                let queries: u64 = p
                    .ranks
                    .iter()
                    .map(|r| u64::from(r.seq_end - r.seq_start) + u64::from(r.verify_budget))
                    .sum();
                let batch = MoeBatch {
                    tokens: queries,
                    sequences: p.seqs.len() as u64,
                };
                (m, batch, &mut p.expert_imbalance)
            }
            _ => return Nanos::ZERO,
        };
        let step = model.step(now, batch);
        *imbalance = step.imbalance;
        self.reassignments += u64::from(step.reassigned);
        self.reassignment_ns += step.reassignment_cost_ns.0;
        step.reassignment_cost_ns
    }
}
