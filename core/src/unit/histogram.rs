//! Streaming latency histograms: log buckets under 1 % wide, so percentiles are kept without
//! storing every sample and do not move in visible steps near an SLO.

use serde::{Deserialize, Serialize};

/// Sub-buckets per power of two, as a power of two: 2^7 = 128 sub-buckets, so a bucket spans
/// at most 1/128 (0.78 %) of its lower edge and the reported midpoint is within 0.4 % of any
/// value in it. Values below 128 are exact.
const SUB_BITS: u32 = 7;
const SUB: u32 = 1 << SUB_BITS;

/// A histogram of non-negative integers (nanoseconds, tokens) with relative-error buckets.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Histogram {
    counts: Vec<u64>,
    n: u64,
    sum: f64,
    max: u64,
}

#[inline]
fn bucket(v: u64) -> usize {
    if v < u64::from(SUB) {
        return v as usize;
    }
    let msb = 63 - v.leading_zeros();
    let shift = msb - SUB_BITS;
    let top = (v >> shift) as u32 & (SUB - 1);
    ((msb - SUB_BITS + 1) * SUB + top) as usize
}

/// Lower edge of a bucket (saturating at `u64::MAX` past the last one).
fn bucket_value(b: usize) -> u64 {
    let b = b as u32;
    if b < SUB {
        return u64::from(b);
    }
    let msb = b / SUB + SUB_BITS - 1;
    let top = u128::from(b % SUB);
    let v = (1u128 << msb) | (top << (msb - SUB_BITS));
    u64::try_from(v).unwrap_or(u64::MAX)
}

impl Histogram {
    #[inline]
    pub fn record(&mut self, v: u64) {
        self.record_n(v, 1);
    }
    /// `n` samples of value `v`: the same histogram as `n` calls of [`Self::record`] (the sum
    /// is exact while it stays below 2^53).
    #[inline]
    pub fn record_n(&mut self, v: u64, n: u64) {
        if n == 0 {
            return;
        }
        let b = bucket(v);
        if b >= self.counts.len() {
            self.counts.resize(b + 1, 0);
        }
        self.counts[b] += n;
        self.n += n;
        self.sum += (v as f64) * (n as f64);
        self.max = self.max.max(v);
    }
    pub fn count(&self) -> u64 {
        self.n
    }
    pub fn mean(&self) -> f64 {
        if self.n == 0 {
            0.0
        } else {
            self.sum / self.n as f64
        }
    }
    pub fn max(&self) -> u64 {
        self.max
    }
    /// The `q`-quantile (0..=1), as the midpoint of its bucket (exact below 128), never above
    /// the largest sample.
    pub fn quantile(&self, q: f64) -> f64 {
        if self.n == 0 {
            return 0.0;
        }
        let target = ((q.clamp(0.0, 1.0) * self.n as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (b, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= target {
                let lo = bucket_value(b);
                let hi = bucket_value(b + 1);
                return if hi - lo <= 1 {
                    lo as f64
                } else {
                    (lo as f64 + hi as f64) / 2.0
                }
                .min(self.max as f64);
            }
        }
        self.max as f64
    }
    /// Relative width of the bucket holding the `q`-quantile: how far the reported value may
    /// be from the exact one (0 for exact buckets).
    pub fn quantile_resolution(&self, q: f64) -> f64 {
        let v = self.quantile(q);
        if v < f64::from(SUB) {
            0.0
        } else {
            1.0 / f64::from(SUB)
        }
    }
    pub fn merge(&mut self, o: &Histogram) {
        if o.counts.len() > self.counts.len() {
            self.counts.resize(o.counts.len(), 0);
        }
        for (a, b) in self.counts.iter_mut().zip(&o.counts) {
            *a += b;
        }
        self.n += o.n;
        self.sum += o.sum;
        self.max = self.max.max(o.max);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn small_values_exact_and_golden_quantiles() {
        let mut h = Histogram::default();
        for v in 1..=10 {
            h.record(v);
        }
        assert_eq!(h.quantile(0.5), 5.0);
        assert_eq!(h.quantile(1.0), 10.0);
        assert_eq!(h.mean(), 5.5);
    }

    #[test]
    fn buckets_near_one_second_are_under_one_percent_wide() {
        let b = bucket(1_000_000_000);
        let (lo, hi) = (bucket_value(b), bucket_value(b + 1));
        assert!(lo <= 1_000_000_000 && 1_000_000_000 < hi);
        assert!(((hi - lo) as f64) / (lo as f64) <= 0.01, "{lo}..{hi}");
        assert_eq!(bucket_value(bucket(u64::MAX) + 1), u64::MAX);
    }

    proptest! {
        #[test]
        fn quantiles_within_bucket_error(vs in proptest::collection::vec(1u64..10_000_000_000, 1..300), q in 0.0f64..1.0) {
            let mut h = Histogram::default();
            for &v in &vs { h.record(v); }
            let mut s = vs.clone();
            s.sort();
            let exact = s[((q * s.len() as f64).ceil() as usize).max(1) - 1] as f64;
            let got = h.quantile(q);
            prop_assert!((got - exact).abs() <= exact / 128.0 + 1.0, "{} vs {}", got, exact);
        }

        /// Runs recorded at once give the histogram that one record per sample gives.
        #[test]
        fn record_n_matches_repeated_records(runs in proptest::collection::vec((0u64..10_000_000_000, 0u64..50), 0..40)) {
            let (mut one, mut batched) = (Histogram::default(), Histogram::default());
            for &(v, n) in &runs {
                for _ in 0..n { one.record(v); }
                batched.record_n(v, n);
            }
            prop_assert_eq!(one, batched);
        }

        #[test]
        fn buckets_are_monotone(a in 0u64..u64::MAX / 2, d in 0u64..1000) {
            prop_assert!(bucket(a) <= bucket(a + d));
            prop_assert!(bucket_value(bucket(a)) <= a);
            prop_assert!(a < bucket_value(bucket(a) + 1));
        }
    }
}
