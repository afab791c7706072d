//! Counter-based random draws for the expert-load model.
//!
//! Every draw is a pure function of (run seed, subsystem, step, layer, position): a SplitMix64
//! stream keyed by those words. So a draw never depends on how many draws another part of the run
//! made, two placement policies fed from one load generator see the same loads, and core needs no
//! RNG dependency.

use crate::content::{hash2, mix64};

const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// A SplitMix64 stream.
pub struct Stream {
    state: u64,
    spare_normal: Option<f64>,
}

impl Stream {
    /// The stream for `(seed, a, b)`; distinct keys give independent-looking streams.
    pub fn keyed(seed: u64, a: u64, b: u64) -> Self {
        Stream {
            state: hash2(hash2(seed, a), b),
            spare_normal: None,
        }
    }

    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN);
        mix64(self.state)
    }

    /// Uniform in the open interval (0, 1).
    #[inline]
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in `0..n` (n ≥ 1), by multiply-shift (bias below 2^-32 for n < 2^32).
    #[inline]
    pub fn below(&mut self, n: usize) -> usize {
        ((u128::from(self.next_u64()) * n as u128) >> 64) as usize
    }

    /// Standard normal (Box–Muller, both outputs used).
    #[inline]
    pub fn normal(&mut self) -> f64 {
        if let Some(z) = self.spare_normal.take() {
            return z;
        }
        let r = (-2.0 * self.uniform().ln()).sqrt();
        let (s, c) = (std::f64::consts::TAU * self.uniform()).sin_cos();
        self.spare_normal = Some(r * s);
        r * c
    }

    /// Binomial(n, p): exact inversion while the mean is small, the normal approximation (rounded,
    /// clamped to `0..=n`) once `n·min(p, 1−p)` reaches 30, where its error is far below the
    /// sampling noise it stands for.
    pub fn binomial(&mut self, n: u64, p: f64) -> u64 {
        if n == 0 || p <= 0.0 || p.is_nan() {
            return 0;
        }
        if p >= 1.0 {
            return n;
        }
        if p > 0.5 {
            return n - self.binomial(n, 1.0 - p);
        }
        let mean = n as f64 * p;
        if mean < 30.0 {
            let q = 1.0 - p;
            let s = p / q;
            let a = (n as f64 + 1.0) * s;
            let mut r = q.powf(n as f64);
            let mut u = self.uniform();
            let mut x = 0u64;
            while u > r && x < n {
                u -= r;
                x += 1;
                r *= a / x as f64 - s;
                if r <= 0.0 {
                    break;
                }
            }
            x
        } else {
            let sd = (mean * (1.0 - p)).sqrt();
            let x = (mean + sd * self.normal()).round();
            x.clamp(0.0, n as f64) as u64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moments(xs: &[f64]) -> (f64, f64) {
        let m = xs.iter().sum::<f64>() / xs.len() as f64;
        let v = xs.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / xs.len() as f64;
        (m, v)
    }

    #[test]
    fn streams_are_keyed_and_reproducible() {
        let a: Vec<u64> = (0..4)
            .map(|_| 0)
            .scan(Stream::keyed(1, 2, 3), |s, _| Some(s.next_u64()))
            .collect();
        let b: Vec<u64> = (0..4)
            .map(|_| 0)
            .scan(Stream::keyed(1, 2, 3), |s, _| Some(s.next_u64()))
            .collect();
        let c: Vec<u64> = (0..4)
            .map(|_| 0)
            .scan(Stream::keyed(1, 2, 4), |s, _| Some(s.next_u64()))
            .collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn normal_has_unit_moments() {
        let mut s = Stream::keyed(7, 0, 0);
        let xs: Vec<f64> = (0..200_000).map(|_| s.normal()).collect();
        let (m, v) = moments(&xs);
        assert!(m.abs() < 0.01, "mean {m}");
        assert!((v - 1.0).abs() < 0.02, "var {v}");
    }

    #[test]
    fn binomial_moments_in_both_regimes() {
        for &(n, p) in &[
            (20u64, 0.3f64),
            (1000, 0.01),
            (100_000, 0.02),
            (50, 0.9),
            (10, 1.0),
            (10, 0.0),
        ] {
            let mut s = Stream::keyed(11, n, p.to_bits());
            let xs: Vec<f64> = (0..50_000).map(|_| s.binomial(n, p) as f64).collect();
            assert!(xs.iter().all(|&x| x >= 0.0 && x <= n as f64));
            let (m, v) = moments(&xs);
            let (em, ev) = (n as f64 * p, n as f64 * p * (1.0 - p));
            assert!(
                (m - em).abs() <= 0.02 * em.max(1.0),
                "n={n} p={p}: mean {m} vs {em}"
            );
            assert!(
                (v - ev).abs() <= 0.05 * ev.max(1.0),
                "n={n} p={p}: var {v} vs {ev}"
            );
        }
    }

    #[test]
    fn below_stays_in_range() {
        let mut s = Stream::keyed(3, 0, 0);
        let mut hits = [0usize; 5];
        for _ in 0..10_000 {
            hits[s.below(5)] += 1;
        }
        assert!(hits.iter().all(|&h| h > 1_800), "{hits:?}");
    }
}
