//! Random inputs and error metrics shared by the CPU/GPU checks.

use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

/// `n` values uniform in [-scale, scale), rounded to bf16.
pub fn random_bf16(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<bf16> {
    (0..n)
        .map(|_| bf16::from_f32(rng.random_range(-scale..scale)))
        .collect()
}

pub fn random_f32(rng: &mut ChaCha8Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

pub fn to_f64(x: &[bf16]) -> Vec<f64> {
    x.iter().map(|v| v.to_f64()).collect()
}

/// Comparison of an output with its reference.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct ErrorStats {
    /// ‖out − ref‖₂ / ‖ref‖₂ (NaN anywhere makes it NaN, which fails every tolerance).
    pub rel_l2: f64,
    pub max_abs: f64,
}

impl ErrorStats {
    pub fn of(out: &[f64], reference: &[f64]) -> Self {
        assert_eq!(
            out.len(),
            reference.len(),
            "output and reference lengths differ"
        );
        let mut num = 0.0;
        let mut den = 0.0;
        let mut max_abs: f64 = 0.0;
        for (o, r) in out.iter().zip(reference) {
            let d = o - r;
            num += d * d;
            den += r * r;
            max_abs = if d.is_nan() {
                f64::NAN
            } else {
                max_abs.max(d.abs())
            };
        }
        let rel_l2 = if den > 0.0 {
            (num / den).sqrt()
        } else {
            num.sqrt()
        };
        Self { rel_l2, max_abs }
    }

    pub fn within(&self, rel_tol: f64) -> bool {
        self.rel_l2 <= rel_tol && self.max_abs.is_finite()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_stats_hand_computed() {
        let e = ErrorStats::of(&[3.0, 4.0], &[3.0, 0.0]);
        assert_eq!(e.max_abs, 4.0);
        assert!((e.rel_l2 - 4.0 / 3.0).abs() < 1e-12);
        assert!(!ErrorStats::of(&[f64::NAN], &[1.0]).within(1.0));
    }
}
