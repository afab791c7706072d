//! The expert-load model an engine drives: one phase's load generator and one placement policy.

use super::config::{ExpertLoadConfig, PlacementPolicy};
use super::placer::{ExpertPlacer, StepMoe};
use super::popularity::{ExpertLoadGenerator, MoeBatch};
use crate::error::ConfigError;
use crate::time::Nanos;

/// Expert load and placement of one EP instance (see the module docs of [`crate::eplb`]).
pub struct ExpertLoadModel {
    generator: ExpertLoadGenerator,
    placer: ExpertPlacer,
}

impl ExpertLoadModel {
    /// `seed` is the run seed; `stream` names the instance (e.g. `"decode.3"`), so instances of
    /// one phase share popularity and drift but draw their own batches.
    pub fn new(cfg: &ExpertLoadConfig, seed: u64, stream: &str) -> Result<Self, ConfigError> {
        cfg.validate()?;
        Ok(ExpertLoadModel {
            generator: ExpertLoadGenerator::new(&cfg.model, cfg.phase, &cfg.skew, seed, stream)?,
            placer: ExpertPlacer::new(&cfg.model, &cfg.ep, &cfg.placement)?,
        })
    }

    /// One engine step at `now` routing `batch`: its imbalance, and the cost of any reassignment
    /// made after it (to be charged before the next step).
    pub fn step(&mut self, now: Nanos, batch: MoeBatch) -> StepMoe {
        let counts = self.generator.sample(now, batch);
        self.placer.observe(counts)
    }

    pub fn policy(&self) -> &PlacementPolicy {
        self.placer.policy()
    }

    pub fn placer(&self) -> &ExpertPlacer {
        &self.placer
    }

    pub fn generator(&self) -> &ExpertLoadGenerator {
        &self.generator
    }
}

#[cfg(test)]
mod tests {
    use super::super::config::{EpGroup, EplbScope, EplbSettings, MoeModel, Phase, SkewConfig};
    use super::*;

    fn cfg(placement: PlacementPolicy) -> ExpertLoadConfig {
        ExpertLoadConfig {
            model: MoeModel {
                layers: 4,
                experts: 64,
                groups: 8,
                top_k: 6,
                expert_bytes: 1_000_000,
            },
            phase: Phase::Decode,
            ep: EpGroup {
                gpus: 16,
                nodes: 2,
                link_bytes_per_s: 50e9,
            },
            skew: SkewConfig {
                zipf_exponent: 0.6,
                phase_sigma: 0.2,
                drift_sigma: 0.2,
                drift_timescale: Nanos::from_secs(600),
                drift_tick: Nanos::from_secs(1),
                sequence_sigma: 0.5,
            },
            placement,
        }
    }

    fn run(placement: PlacementPolicy, seed: u64) -> Vec<StepMoe> {
        let mut m = ExpertLoadModel::new(&cfg(placement), seed, "t").unwrap();
        let batch = MoeBatch {
            tokens: 20_000,
            sequences: 500,
        };
        (0..300)
            .map(|i| m.step(Nanos::from_millis(20 * i), batch))
            .collect()
    }

    #[test]
    fn reproducible_and_eplb_beats_static_placement() {
        let eplb = PlacementPolicy::Eplb(EplbSettings {
            redundant_per_gpu: 1,
            window_steps: 50,
            reassign_every_steps: 100,
            scope: EplbScope::Global,
        });
        let a = run(eplb.clone(), 4);
        assert_eq!(a, run(eplb, 4));
        let b = run(PlacementPolicy::NoRedundancy, 4);
        let mean = |v: &[StepMoe]| {
            v[50..].iter().map(|s| s.imbalance).sum::<f64>() / (v.len() - 50) as f64
        };
        let (with, without) = (mean(&a), mean(&b));
        assert!(with < without - 0.1, "eplb {with} vs static {without}");
        assert!(with >= 1.0);
        let reassigned: Vec<usize> = a
            .iter()
            .enumerate()
            .filter(|(_, s)| s.reassigned)
            .map(|(i, _)| i)
            .collect();
        assert_eq!(reassigned, vec![49, 149, 249]);
        assert!(a[49].reassignment_cost_ns > Nanos::ZERO);
        assert!(
            b.iter()
                .all(|s| !s.reassigned && s.reassignment_cost_ns == Nanos::ZERO)
        );
    }

    #[test]
    fn bad_config_is_an_error_not_a_panic() {
        let mut c = cfg(PlacementPolicy::RoundRobin);
        c.ep.gpus = 7;
        c.ep.nodes = 1;
        assert!(ExpertLoadModel::new(&c, 1, "t").is_err());
    }
}
