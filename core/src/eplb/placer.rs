//! A placement policy at work: observes each step's expert token counts, reports how unevenly
//! they land on the EP ranks, keeps the window statistics and reassigns experts on schedule.

use super::config::{EpGroup, MoeModel, PlacementPolicy};
use super::rebalance::{EplbPlacement, rebalance_experts};
use crate::error::ConfigError;
use crate::time::Nanos;

/// What the MoE part of one step cost in balance, and any reassignment made after it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepMoe {
    /// Slowest rank's load ÷ mean rank load, summed over layers (each layer waits for its slowest
    /// rank): `Σ_l max_g load[l][g] / Σ_l mean_g load[l][g]`; 1 for a step that routed nothing.
    pub imbalance: f64,
    /// Token-expert assignments on the slowest rank, summed over layers.
    pub max_rank_tokens: f64,
    /// Token-expert assignments of the mean rank, summed over layers.
    pub mean_rank_tokens: f64,
    /// True when this step ended a statistics window and the placement was recomputed; the new
    /// placement serves from the next step.
    pub reassigned: bool,
    /// Expert weight bytes copied by the reassignment, over all GPUs and layers.
    pub bytes_moved: u64,
    /// Time to copy them: GPUs receive in parallel, each over its own link, so the GPU that
    /// receives the most sets it. Zero without a reassignment. The engine charges it.
    pub reassignment_cost_ns: Nanos,
}

/// One EP group's placement under one policy.
pub struct ExpertPlacer {
    model: MoeModel,
    ep: EpGroup,
    policy: PlacementPolicy,
    slots_per_gpu: usize,
    placement: EplbPlacement,
    /// `[layer × expert]`: 1 / replica count, the share of an expert's tokens each replica serves.
    replica_share: Vec<f64>,
    /// `[layer × expert]`: token counts over the current statistics window.
    window: Vec<u64>,
    steps: u64,
    reassignments: u64,
    gpu_load: Vec<f64>,
}

impl ExpertPlacer {
    pub fn new(
        model: &MoeModel,
        ep: &EpGroup,
        policy: &PlacementPolicy,
    ) -> Result<Self, ConfigError> {
        model.validate()?;
        ep.validate(model, policy)?;
        let slots = ep.slots(model, policy);
        let (layers, experts, gpus) = (model.layers, model.experts, ep.gpus);
        let per_gpu = slots / gpus;
        let invalid = |e: super::EplbError| ConfigError::invalid("placement", e.to_string());
        let placement = match policy {
            PlacementPolicy::NoRedundancy => {
                EplbPlacement::from_phy2log(vec![(0..experts).collect(); layers], experts)
                    .map_err(invalid)?
            }
            PlacementPolicy::RoundRobin => {
                let row: Vec<usize> = (0..slots)
                    .map(|s| (s % per_gpu) * gpus + s / per_gpu)
                    .collect();
                EplbPlacement::from_phy2log(vec![row; layers], experts).map_err(invalid)?
            }
            // Before any statistics exist every expert looks equally loaded.
            PlacementPolicy::Eplb(s) => {
                let (groups, nodes) = s.groups_and_nodes(model, ep);
                rebalance_experts(
                    &vec![vec![1.0; experts]; layers],
                    slots,
                    groups,
                    nodes,
                    gpus,
                )
                .map_err(invalid)?
            }
        };
        let mut placer = ExpertPlacer {
            model: model.clone(),
            ep: ep.clone(),
            policy: policy.clone(),
            slots_per_gpu: per_gpu,
            replica_share: Vec::new(),
            placement,
            window: vec![0; layers * experts],
            steps: 0,
            reassignments: 0,
            gpu_load: vec![0.0; gpus],
        };
        placer.refresh_shares();
        Ok(placer)
    }

    fn refresh_shares(&mut self) {
        self.replica_share = self
            .placement
            .logcnt
            .iter()
            .flat_map(|row| row.iter().map(|&c| 1.0 / c as f64))
            .collect();
    }

    pub fn placement(&self) -> &EplbPlacement {
        &self.placement
    }

    pub fn policy(&self) -> &PlacementPolicy {
        &self.policy
    }

    pub fn reassignments(&self) -> u64 {
        self.reassignments
    }

    /// Per-GPU load of one layer for `counts` (`[layer × expert]`), tokens split evenly over an
    /// expert's replicas.
    pub fn layer_gpu_loads(&self, counts: &[u32], layer: usize) -> Vec<f64> {
        let mut loads = vec![0.0; self.ep.gpus];
        self.fill_layer_loads(counts, layer, &mut loads);
        loads
    }

    fn fill_layer_loads(&self, counts: &[u32], layer: usize, loads: &mut [f64]) {
        let base = layer * self.model.experts;
        for (g, chunk) in self.placement.phy2log[layer]
            .chunks_exact(self.slots_per_gpu)
            .enumerate()
        {
            loads[g] = chunk
                .iter()
                .map(|&e| f64::from(counts[base + e]) * self.replica_share[base + e])
                .sum();
        }
    }

    /// Observes one step's token counts (`[layer × expert]`, as from
    /// [`super::ExpertLoadGenerator::sample`]) and returns its balance; under EPLB, reassigns when
    /// the step completes a statistics window (windows are the last `window_steps` steps of
    /// each `reassign_every_steps` period, the first one starting at step 0).
    pub fn observe(&mut self, counts: &[u32]) -> StepMoe {
        debug_assert_eq!(counts.len(), self.model.layers * self.model.experts);
        let mut loads = std::mem::take(&mut self.gpu_load);
        let (mut max_sum, mut total) = (0.0, 0.0);
        for l in 0..self.model.layers {
            self.fill_layer_loads(counts, l, &mut loads);
            max_sum += loads.iter().copied().fold(0.0, f64::max);
            total += loads.iter().sum::<f64>();
        }
        self.gpu_load = loads;
        let mean_sum = total / self.ep.gpus as f64;
        let mut out = StepMoe {
            imbalance: if mean_sum > 0.0 {
                max_sum / mean_sum
            } else {
                1.0
            },
            max_rank_tokens: max_sum,
            mean_rank_tokens: mean_sum,
            ..StepMoe::default()
        };
        let step = self.steps;
        self.steps += 1;
        if let PlacementPolicy::Eplb(s) = &self.policy {
            let phase = step % s.reassign_every_steps;
            if phase < s.window_steps {
                for (w, &c) in self.window.iter_mut().zip(counts) {
                    *w += u64::from(c);
                }
            }
            if phase + 1 == s.window_steps {
                let (bytes, cost) = self.reassign();
                out.reassigned = true;
                out.bytes_moved = bytes;
                out.reassignment_cost_ns = cost;
            }
        }
        out
    }

    /// Recomputes the placement from the window, clears it, and returns (bytes moved, time).
    fn reassign(&mut self) -> (u64, Nanos) {
        let experts = self.model.experts;
        // EPLB's loads are float32 (large counts round, as in the reference).
        let weight: Vec<Vec<f32>> = self
            .window
            .chunks_exact(experts)
            .map(|r| r.iter().map(|&c| c as f32).collect())
            .collect();
        self.window.iter_mut().for_each(|w| *w = 0);
        let slots = self.ep.slots(&self.model, &self.policy);
        let (groups, nodes) = match &self.policy {
            PlacementPolicy::Eplb(s) => s.groups_and_nodes(&self.model, &self.ep),
            PlacementPolicy::NoRedundancy | PlacementPolicy::RoundRobin => {
                (self.model.groups, self.ep.nodes)
            }
        };
        let Ok(next) = rebalance_experts(&weight, slots, groups, nodes, self.ep.gpus) else {
            // Shapes were validated at construction and counts are finite and non-negative.
            return (0, Nanos::ZERO);
        };
        let gpu_in = incoming_slots(&self.placement, &next, self.slots_per_gpu, experts);
        self.placement = next;
        self.refresh_shares();
        self.reassignments += 1;
        // Saturating: `expert_bytes` is a config value, and a count of bytes past 2^64 is
        // reported as the largest one rather than wrapped.
        let total: u64 = gpu_in
            .iter()
            .sum::<u64>()
            .saturating_mul(self.model.expert_bytes);
        let worst = gpu_in
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
            .saturating_mul(self.model.expert_bytes);
        let cost = Nanos::from_secs_f64(worst as f64 / self.ep.link_bytes_per_s);
        (total, cost)
    }
}

/// Per GPU, summed over layers: expert weights the GPU must receive to go from `old` to `new`
/// (experts it newly holds, counted with multiplicity, that it did not already hold).
pub fn incoming_slots(
    old: &EplbPlacement,
    new: &EplbPlacement,
    slots_per_gpu: usize,
    experts: usize,
) -> Vec<u64> {
    let gpus = new.num_slots() / slots_per_gpu;
    let mut incoming = vec![0u64; gpus];
    let mut have = vec![0i64; experts];
    for (old_row, new_row) in old.phy2log.iter().zip(&new.phy2log) {
        for ((gpu_in, old_gpu), new_gpu) in incoming
            .iter_mut()
            .zip(old_row.chunks_exact(slots_per_gpu))
            .zip(new_row.chunks_exact(slots_per_gpu))
        {
            for &e in old_gpu {
                have[e] += 1;
            }
            for &e in new_gpu {
                if have[e] > 0 {
                    have[e] -= 1;
                } else {
                    *gpu_in += 1;
                }
            }
            for &e in old_gpu {
                have[e] = 0;
            }
        }
    }
    incoming
}

#[cfg(test)]
mod tests {
    use super::super::config::{EplbScope, EplbSettings};
    use super::*;

    fn model() -> MoeModel {
        MoeModel {
            layers: 2,
            experts: 8,
            groups: 2,
            top_k: 2,
            expert_bytes: 1_000,
        }
    }

    fn ep(gpus: usize) -> EpGroup {
        EpGroup {
            gpus,
            nodes: 1,
            link_bytes_per_s: 1e6,
        }
    }

    #[test]
    fn static_layouts() {
        let p = ExpertPlacer::new(&model(), &ep(4), &PlacementPolicy::NoRedundancy).unwrap();
        assert_eq!(p.placement().phy2log[0], vec![0, 1, 2, 3, 4, 5, 6, 7]);
        let r = ExpertPlacer::new(&model(), &ep(4), &PlacementPolicy::RoundRobin).unwrap();
        // GPU g holds experts g and g + 4.
        assert_eq!(r.placement().phy2log[1], vec![0, 4, 1, 5, 2, 6, 3, 7]);
    }

    #[test]
    fn imbalance_is_slowest_over_mean_summed_over_layers() {
        let mut p = ExpertPlacer::new(&model(), &ep(2), &PlacementPolicy::NoRedundancy).unwrap();
        // Layer 0: GPU0 gets 10, GPU1 gets 30. Layer 1: 20 and 20.
        let counts = [1, 2, 3, 4, 5, 6, 7, 12, 5, 5, 5, 5, 5, 5, 5, 5];
        let s = p.observe(&counts);
        assert_eq!(p.layer_gpu_loads(&counts, 0), vec![10.0, 30.0]);
        assert_eq!(s.max_rank_tokens, 50.0);
        assert_eq!(s.mean_rank_tokens, 40.0);
        assert_eq!(s.imbalance, 1.25);
        assert!(!s.reassigned);
        assert_eq!(p.observe(&[0; 16]).imbalance, 1.0);
    }

    #[test]
    fn eplb_reassigns_on_schedule_and_balances_a_hot_expert() {
        let policy = PlacementPolicy::Eplb(EplbSettings {
            redundant_per_gpu: 1,
            window_steps: 2,
            reassign_every_steps: 5,
            scope: EplbScope::Hierarchical,
        });
        let mut p = ExpertPlacer::new(&model(), &ep(2), &policy).unwrap();
        // Expert 3 is hot in both layers.
        let mut counts = [10u32; 16];
        counts[3] = 80;
        counts[8 + 3] = 80;
        let flags: Vec<bool> = (0..12).map(|_| p.observe(&counts).reassigned).collect();
        // Windows are steps 0–1, 5–6, 10–11: reassignments after steps 1, 6 and 11.
        let expected: Vec<bool> = (0..12).map(|s| s == 1 || s == 6 || s == 11).collect();
        assert_eq!(flags, expected);
        assert_eq!(p.reassignments(), 3);
        // Both redundant slots go to the hot expert (80 > 10, then 40 > 10): three replicas of
        // 80/3. Packing 5 slots per GPU, heaviest first: GPU 0 gets two hot replicas and three
        // 10s (250/3), GPU 1 one hot replica and four 10s; the mean is 75, so 10/9.
        assert_eq!(p.placement().logcnt[0][3], 3);
        let s = p.observe(&counts);
        assert!((s.imbalance - 10.0 / 9.0).abs() < 1e-6, "{}", s.imbalance);
        let mut flat = ExpertPlacer::new(&model(), &ep(2), &PlacementPolicy::NoRedundancy).unwrap();
        assert!(flat.observe(&counts).imbalance > 1.3);
    }

    #[test]
    fn reassignment_cost_counts_new_weights_on_the_busiest_gpu() {
        let m = model();
        let old = EplbPlacement::from_phy2log(vec![vec![0, 1, 2, 3, 4, 5, 6, 7]; 2], 8).unwrap();
        let new = EplbPlacement::from_phy2log(
            vec![vec![1, 0, 2, 3, 4, 5, 6, 7], vec![0, 1, 2, 7, 4, 5, 6, 3]],
            8,
        )
        .unwrap();
        // 2 GPUs of 4 slots: layer 0 only reorders GPU 0; layer 1 swaps 3 and 7 across GPUs.
        assert_eq!(incoming_slots(&old, &new, 4, m.experts), vec![1, 1]);
        assert_eq!(incoming_slots(&old, &old, 4, m.experts), vec![0, 0]);
    }

    #[test]
    fn first_reassignment_reports_bytes_and_time() {
        let policy = PlacementPolicy::Eplb(EplbSettings {
            redundant_per_gpu: 1,
            window_steps: 1,
            reassign_every_steps: 1,
            scope: EplbScope::Global,
        });
        let mut p = ExpertPlacer::new(&model(), &ep(2), &policy).unwrap();
        let before = p.placement().clone();
        let mut counts = [1u32; 16];
        counts[5] = 100;
        counts[8 + 6] = 100;
        let s = p.observe(&counts);
        assert!(s.reassigned);
        let gpu_in = incoming_slots(&before, p.placement(), 5, 8);
        assert!(gpu_in.iter().sum::<u64>() > 0);
        assert_eq!(s.bytes_moved, gpu_in.iter().sum::<u64>() * 1_000);
        let worst = *gpu_in.iter().max().unwrap() * 1_000;
        // 1e6 bytes/s: 1,000 bytes take 1 ms.
        assert_eq!(s.reassignment_cost_ns, Nanos::from_millis(worst / 1_000));
    }
}
