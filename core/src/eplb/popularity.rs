//! Per-step expert loads: how many tokens each expert of each layer receives.
//!
//! Each step, for every layer, the generator forms the step's popularity weights
//! `w_e = exp(base_e + phase_e + drift_e(now) + batch_e)` (see [`SkewConfig`]), turns them into
//! the probability `q_e` that a token has expert `e` among its top-k (proportional to `w_e`,
//! capped at 1 and water-filled so that `Σ q_e = k`), and draws the expert's token count as
//! Binomial(tokens, `q_e`). Tokens are routed independently of each other given the step's
//! popularity; the correlation inside a request is what the batch noise stands for.

use super::config::{MoeModel, Phase, SkewConfig};
use super::random::Stream;
use crate::error::ConfigError;
use crate::seed::sub_seed;
use crate::time::Nanos;

/// What one engine step routes through the MoE layers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MoeBatch {
    /// Tokens in the step, over all data-parallel ranks of the EP group.
    pub tokens: u64,
    /// Distinct requests those tokens come from (their topics average out).
    pub sequences: u64,
}

/// The seeded source of per-step expert token counts for one phase.
pub struct ExpertLoadGenerator {
    layers: usize,
    experts: usize,
    top_k: usize,
    skew: SkewConfig,
    /// `[layer × expert]`: fixed log-popularity (Zipf rank plus the phase offset).
    fixed_log: Vec<f64>,
    /// `[layer × expert]`: drift state at tick `drift_ticks`.
    drift_log: Vec<f64>,
    drift_ticks: u64,
    drift_seed: u64,
    batch_seed: u64,
    steps: u64,
    counts: Vec<u32>,
    weights: Vec<f64>,
    capped: Vec<bool>,
}

impl ExpertLoadGenerator {
    /// `seed` is the run seed: the base popularity (same model) and the drift (same traffic mix)
    /// derive from it alone, so every engine of a phase sees the same popularity; `stream` names
    /// the engine whose own batches are drawn (its batch noise and token sampling).
    pub fn new(
        model: &MoeModel,
        phase: Phase,
        skew: &SkewConfig,
        seed: u64,
        stream: &str,
    ) -> Result<Self, ConfigError> {
        model.validate()?;
        skew.validate("skew")?;
        let (layers, experts) = (model.layers, model.experts);
        let rank_seed = sub_seed(seed, "eplb.popularity");
        let phase_seed = sub_seed(seed, &format!("eplb.popularity.{}", phase.name()));
        let mut fixed_log = vec![0.0; layers * experts];
        for l in 0..layers {
            // A seeded permutation per layer: which expert holds each popularity rank.
            let mut perm: Vec<usize> = (0..experts).collect();
            let mut s = Stream::keyed(rank_seed, l as u64, 0);
            for i in (1..experts).rev() {
                perm.swap(i, s.below(i + 1));
            }
            let mut p = Stream::keyed(phase_seed, l as u64, 0);
            for (rank, &e) in perm.iter().enumerate() {
                fixed_log[l * experts + e] = -skew.zipf_exponent * ((rank + 1) as f64).ln();
            }
            for e in 0..experts {
                fixed_log[l * experts + e] += skew.phase_sigma * p.normal();
            }
        }
        let drift_seed = sub_seed(seed, &format!("eplb.drift.{}", phase.name()));
        // Start the drift in its stationary distribution so that time 0 is not special.
        let mut drift_log = vec![0.0; layers * experts];
        for l in 0..layers {
            let mut s = Stream::keyed(drift_seed, 0, l as u64);
            for e in 0..experts {
                drift_log[l * experts + e] = skew.drift_sigma * s.normal();
            }
        }
        Ok(ExpertLoadGenerator {
            layers,
            experts,
            top_k: model.top_k,
            skew: skew.clone(),
            fixed_log,
            drift_log,
            drift_ticks: 0,
            drift_seed,
            batch_seed: sub_seed(seed, &format!("eplb.batch.{}.{stream}", phase.name())),
            steps: 0,
            counts: vec![0; layers * experts],
            weights: vec![0.0; experts],
            capped: vec![false; experts],
        })
    }

    pub fn layers(&self) -> usize {
        self.layers
    }

    pub fn experts(&self) -> usize {
        self.experts
    }

    /// Advances the drift to `now` (in whole ticks; time never runs backwards here).
    fn advance_drift(&mut self, now: Nanos) {
        let target = now.0 / self.skew.drift_tick.0;
        if target <= self.drift_ticks {
            return;
        }
        if self.skew.drift_sigma > 0.0 {
            // Exact OU transition over the elapsed ticks, keyed by the tick it lands on.
            let dt = (target - self.drift_ticks) as f64 * self.skew.drift_tick.0 as f64;
            let rho = (-dt / self.skew.drift_timescale.0 as f64).exp();
            let kick = self.skew.drift_sigma * (1.0 - rho * rho).sqrt();
            for l in 0..self.layers {
                let mut s = Stream::keyed(self.drift_seed, target, l as u64);
                for x in &mut self.drift_log[l * self.experts..(l + 1) * self.experts] {
                    *x = *x * rho + kick * s.normal();
                }
            }
        }
        self.drift_ticks = target;
    }

    /// The expected share of a layer's routed tokens that each expert receives at the current
    /// drift state, without batch noise (Σ = 1). For inspection and tests.
    pub fn expected_share(&self, layer: usize) -> Vec<f64> {
        let range = layer * self.experts..(layer + 1) * self.experts;
        let mut w: Vec<f64> = self.fixed_log[range.clone()]
            .iter()
            .zip(&self.drift_log[range])
            .map(|(a, b)| a + b)
            .collect();
        exp_relative(&mut w);
        let mut q = vec![0.0; self.experts];
        let mut capped = vec![false; self.experts];
        water_fill(&w, self.top_k, &mut q, &mut capped);
        q.iter().map(|x| x / self.top_k as f64).collect()
    }

    /// Draws one step's token counts, `[layer × expert]` (layer-major).
    pub fn sample(&mut self, now: Nanos, batch: MoeBatch) -> &[u32] {
        self.advance_drift(now);
        let step = self.steps;
        self.steps += 1;
        if batch.tokens == 0 {
            self.counts.iter_mut().for_each(|c| *c = 0);
            return &self.counts;
        }
        // Averaging S log-normal topics leaves a spread whose variance is (e^{σ²} − 1)/S; match
        // it with one log-normal of that variance.
        let s = batch.sequences.max(1) as f64;
        let sigma2 = self.skew.sequence_sigma * self.skew.sequence_sigma;
        let batch_sigma = (1.0 + sigma2.exp_m1() / s).ln().sqrt();
        let mut q = vec![0.0; self.experts];
        for l in 0..self.layers {
            let mut rng = Stream::keyed(self.batch_seed, step, l as u64);
            let base = l * self.experts;
            for e in 0..self.experts {
                let x = self.fixed_log[base + e] + self.drift_log[base + e];
                self.weights[e] = x + batch_sigma * rng.normal();
            }
            exp_relative(&mut self.weights);
            water_fill(&self.weights, self.top_k, &mut q, &mut self.capped);
            for (count, &p) in self.counts[base..base + self.experts].iter_mut().zip(&q) {
                *count = u32::try_from(rng.binomial(batch.tokens, p)).unwrap_or(u32::MAX);
            }
        }
        &self.counts
    }
}

/// Log-weights to weights relative to the largest (`exp(x − max)`, the largest is 1). At any
/// skew nothing overflows to infinity (which made 0 · ∞ = NaN probabilities and steps that
/// routed nothing), and nothing underflows to zero: a weight is at least e^-700, so the
/// water-filling still finds every expert a token can be routed to and `Σ q = k` holds.
fn exp_relative(x: &mut [f64]) {
    let max = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    for v in x.iter_mut() {
        *v = (*v - max).max(-700.0).exp();
    }
}

/// Sets `q[e] = min(1, c · w[e])` with `c` such that `Σ q = k` (k ≤ len): the probability that an
/// expert is among a token's top-k, no expert being chosen twice by one token.
fn water_fill(w: &[f64], k: usize, q: &mut [f64], capped: &mut [bool]) {
    capped.iter_mut().for_each(|c| *c = false);
    let mut budget = k as f64;
    loop {
        let free: f64 = w
            .iter()
            .zip(capped.iter())
            .filter(|(_, c)| !**c)
            .map(|(x, _)| x)
            .sum();
        let scale = if free > 0.0 { budget / free } else { 0.0 };
        let mut newly = 0usize;
        for e in 0..w.len() {
            if !capped[e] && w[e] * scale >= 1.0 {
                capped[e] = true;
                newly += 1;
            }
        }
        if newly == 0 {
            for e in 0..w.len() {
                q[e] = if capped[e] { 1.0 } else { w[e] * scale };
            }
            return;
        }
        budget -= newly as f64;
        if budget <= 0.0 {
            for e in 0..w.len() {
                q[e] = if capped[e] { 1.0 } else { 0.0 };
            }
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn skew() -> SkewConfig {
        SkewConfig {
            zipf_exponent: 0.6,
            phase_sigma: 0.2,
            drift_sigma: 0.3,
            drift_timescale: Nanos::from_secs(300),
            drift_tick: Nanos::from_secs(1),
            sequence_sigma: 0.5,
        }
    }

    fn small() -> MoeModel {
        MoeModel {
            layers: 3,
            experts: 16,
            groups: 4,
            top_k: 4,
            expert_bytes: 1,
        }
    }

    #[test]
    fn water_fill_caps_and_keeps_the_sum() {
        let mut q = vec![0.0; 4];
        let mut c = vec![false; 4];
        water_fill(&[100.0, 1.0, 1.0, 2.0], 2, &mut q, &mut c);
        // Expert 0 is capped at 1; the other unit of budget is split 1:1:2.
        assert_eq!(q, vec![1.0, 0.25, 0.25, 0.5]);
        water_fill(&[1.0, 1.0, 1.0, 1.0], 4, &mut q, &mut c);
        assert_eq!(q, vec![1.0; 4]);
    }

    #[test]
    fn same_seed_same_counts_and_streams_differ() {
        let batch = MoeBatch {
            tokens: 5_000,
            sequences: 4,
        };
        let mut a = ExpertLoadGenerator::new(&small(), Phase::Prefill, &skew(), 9, "e0").unwrap();
        let mut b = ExpertLoadGenerator::new(&small(), Phase::Prefill, &skew(), 9, "e0").unwrap();
        let mut c = ExpertLoadGenerator::new(&small(), Phase::Prefill, &skew(), 9, "e1").unwrap();
        for i in 0..5 {
            let now = Nanos::from_secs(i * 7);
            let x = a.sample(now, batch).to_vec();
            assert_eq!(x, b.sample(now, batch));
            assert_ne!(x, c.sample(now, batch));
        }
        // Same model and traffic mix: the expected popularity is shared across engines.
        assert_eq!(a.expected_share(1), c.expected_share(1));
    }

    #[test]
    fn counts_average_to_tokens_times_k() {
        let mut g = ExpertLoadGenerator::new(&small(), Phase::Decode, &skew(), 1, "e").unwrap();
        let batch = MoeBatch {
            tokens: 10_000,
            sequences: 100,
        };
        let mut total = 0u64;
        for i in 0..50 {
            total += g
                .sample(Nanos::from_millis(i * 20), batch)
                .iter()
                .map(|&c| u64::from(c))
                .sum::<u64>();
        }
        let expected = 50.0 * 3.0 * 10_000.0 * 4.0;
        assert!(
            (total as f64 / expected - 1.0).abs() < 0.01,
            "{total} vs {expected}"
        );
        let empty = g.sample(Nanos::from_secs(2), MoeBatch::default());
        assert!(empty.iter().all(|&c| c == 0));
    }

    /// At extreme skew every token still picks `top_k` experts (no weight overflows to ∞ or
    /// underflows to 0, so no probability is NaN and no step routes nothing): the hottest
    /// `top_k` experts take every token.
    #[test]
    fn extreme_skew_still_routes_every_token_k_times() {
        for (zipf, sigma) in [(64.0, 0.0), (0.7, 16.0), (64.0, 16.0)] {
            let sk = SkewConfig {
                zipf_exponent: zipf,
                phase_sigma: sigma,
                drift_sigma: sigma,
                sequence_sigma: sigma,
                ..skew()
            };
            let mut g = ExpertLoadGenerator::new(&small(), Phase::Decode, &sk, 1, "e").unwrap();
            let batch = MoeBatch {
                tokens: 1_000,
                sequences: 1,
            };
            let counts = g.sample(Nanos::from_secs(1), batch).to_vec();
            for layer in counts.chunks(16) {
                let total: u64 = layer.iter().map(|&c| u64::from(c)).sum();
                // Σ q = k exactly; the binomial draws of the uncapped experts add noise.
                assert!(
                    (3_000..=5_000).contains(&total),
                    "{zipf} {sigma}: {layer:?}"
                );
            }
            let share = g.expected_share(0);
            assert!(share.iter().all(|x| x.is_finite()), "{share:?}");
            assert!((share.iter().sum::<f64>() - 1.0).abs() < 1e-9, "{share:?}");
        }
    }

    #[test]
    fn phases_differ_and_skew_follows_the_exponent() {
        let p = ExpertLoadGenerator::new(&small(), Phase::Prefill, &skew(), 3, "e").unwrap();
        let d = ExpertLoadGenerator::new(&small(), Phase::Decode, &skew(), 3, "e").unwrap();
        assert_ne!(p.expected_share(0), d.expected_share(0));
        let flat = SkewConfig {
            zipf_exponent: 0.0,
            phase_sigma: 0.0,
            drift_sigma: 0.0,
            ..skew()
        };
        let u = ExpertLoadGenerator::new(&small(), Phase::Prefill, &flat, 3, "e").unwrap();
        for x in u.expected_share(2) {
            assert!((x - 1.0 / 16.0).abs() < 1e-12);
        }
        let steep = SkewConfig {
            zipf_exponent: 1.0,
            phase_sigma: 0.0,
            drift_sigma: 0.0,
            ..skew()
        };
        let z = ExpertLoadGenerator::new(&small(), Phase::Prefill, &steep, 3, "e").unwrap();
        let mut share = z.expected_share(0);
        share.sort_by(|a, b| b.total_cmp(a));
        // Zipf with exponent 1 over 16 experts, top-4: the top expert would have q = 4/H16 > 1,
        // so it is capped (every token picks it: share 1/4); the rest keep the Zipf ratios.
        assert!((share[0] - 0.25).abs() < 1e-12);
        assert!((share[1] / share[2] - 1.5).abs() < 1e-9);
    }

    #[test]
    fn drift_moves_popularity_over_its_timescale() {
        let mut g = ExpertLoadGenerator::new(&small(), Phase::Prefill, &skew(), 5, "e").unwrap();
        let at0 = g.expected_share(0);
        g.sample(Nanos::from_millis(500), MoeBatch::default());
        // Less than one tick: unchanged.
        assert_eq!(g.expected_share(0), at0);
        g.sample(Nanos::from_secs(3_000), MoeBatch::default());
        let later = g.expected_share(0);
        let moved: f64 = at0.iter().zip(&later).map(|(a, b)| (a - b).abs()).sum();
        assert!(
            moved > 0.05,
            "ten timescales later the popularity should have moved: {moved}"
        );
    }
}
