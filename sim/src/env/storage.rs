//! Reads of a hit prefix from the store cluster (SPEC §7): each fetch is issued as erasure-coded
//! stripe reads, each sent to data + 1 nodes of its group and done at the data-th answer, with
//! per-node bandwidth queues and exponential answer tails.

use crate::service::FetchConfig;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use servelab_core::{BlockKey, KvStore, Nanos};

pub struct StorageReads {
    cfg: FetchConfig,
    ec_data: usize,
    ec_parity: usize,
    node_busy: Vec<Nanos>,
    rng: ChaCha8Rng,
    stripe_keys: Vec<BlockKey>,
}

/// [`Nanos::from_secs_f64`], bit for bit, without a call to libm's `round`: for positive `v`
/// below 2^63, `v - trunc(v)` is exact, so comparing it with 0.5 rounds half away from zero as
/// `round` does. (A fetch converts dozens of tail draws; `round` was a visible share of it.)
#[inline]
pub(crate) fn nanos_from_secs(s: f64) -> Nanos {
    if s.is_nan() || s <= 0.0 {
        return Nanos(0);
    }
    if s >= u64::MAX as f64 / 1e9 {
        return Nanos::MAX;
    }
    let v = s * 1e9;
    // `i64::MAX as f64` is 2^63 exactly.
    if v < i64::MAX as f64 {
        // Below 2^63 the signed conversions (one instruction each way on x86_64, where the
        // unsigned ones are emulated) give the same values.
        let t = v as i64;
        return Nanos(t as u64 + u64::from(v - t as f64 >= 0.5));
    }
    let t = v as u64;
    Nanos(t + u64::from(v - t as f64 >= 0.5))
}

/// The `k`-th smallest of `xs` (1-based), which it may reorder. A stripe read is done at its
/// `data`-th of `data + 1` answers: the largest or second largest, found in one pass.
pub(crate) fn kth_smallest(xs: &mut [Nanos], k: usize) -> Nanos {
    if k == xs.len() {
        return xs.iter().copied().max().unwrap_or(Nanos::ZERO);
    }
    if k + 1 == xs.len() {
        let (mut hi, mut second) = (Nanos::ZERO, Nanos::ZERO);
        for &x in xs.iter() {
            if x > hi {
                second = hi;
                hi = x;
            } else if x > second {
                second = x;
            }
        }
        return second;
    }
    *xs.select_nth_unstable(k - 1).1
}

impl StorageReads {
    pub fn new(cfg: &FetchConfig, store: &servelab_core::StoreConfig, seed: u64) -> Self {
        StorageReads {
            cfg: cfg.clone(),
            ec_data: store.ec_data_shards as usize,
            ec_parity: store.ec_parity_shards as usize,
            node_busy: vec![Nanos::ZERO; store.storage_nodes as usize],
            rng: ChaCha8Rng::seed_from_u64(servelab_core::seed::sub_seed(seed, "service.fetch")),
            stripe_keys: Vec::new(),
        }
    }

    /// Reads `bytes` spread over the blocks `keys` (`fallback` keys a request with no full
    /// block) starting at `now`; returns when every stripe is done.
    pub fn fetch(
        &mut self,
        now: Nanos,
        store: &KvStore,
        keys: &[BlockKey],
        fallback: BlockKey,
        bytes: u64,
    ) -> Nanos {
        let f = &self.cfg;
        let stripes = (f.stripes as usize).min(keys.len()).max(1);
        let data = self.ec_data;
        let ask = (data + 1).min(data + self.ec_parity);
        let per_node = bytes as f64 / stripes as f64 / data as f64;
        let transfer = Nanos::from_secs_f64(per_node / f.node_read_bytes_per_s);
        let mut done = now;
        let mut answers = [Nanos::ZERO; 64];
        // The stripes' keys sit far apart in a long chain: load them all before the loop
        // below, so their cache misses overlap instead of stalling one stripe each.
        let mut stripe_keys = std::mem::take(&mut self.stripe_keys);
        stripe_keys.clear();
        stripe_keys.extend((0..stripes).map(|s| {
            keys.get(s * keys.len() / stripes)
                .copied()
                .unwrap_or(fallback)
        }));
        let tail_mean_s = f.tail_mean.as_secs_f64();
        for &key in &stripe_keys {
            for (a, node) in store.placement_nodes(key).take(ask).enumerate() {
                let busy = &mut self.node_busy[node.0 as usize];
                let start = (*busy).max(now);
                *busy = start + transfer;
                // Ziggurat sampling: almost never a logarithm.
                let x: f64 = self.rng.sample(rand_distr::Exp1);
                let tail = nanos_from_secs(x * tail_mean_s);
                answers[a.min(63)] = *busy + f.latency + tail;
            }
            let got = &mut answers[..ask.min(64)];
            let k = data.min(got.len());
            done = done.max(kth_smallest(got, k));
        }
        self.stripe_keys = stripe_keys;
        done
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn nanos_from_secs_matches_nanos(s in prop_oneof![0.0..1e-3f64, 0.0..1e3f64, -1.0..1e11f64],
                                         half in 0u64..1_000_000) {
            prop_assert_eq!(nanos_from_secs(s), Nanos::from_secs_f64(s));
            // Exact halves of a nanosecond round away from zero.
            let h = (half as f64 + 0.5) / 1e9;
            prop_assert_eq!(nanos_from_secs(h), Nanos::from_secs_f64(h));
        }

        /// The one-pass largest / second largest agrees with sorting, duplicates included.
        #[test]
        fn kth_smallest_matches_sorting(xs in proptest::collection::vec(0u64..20, 1..14), pick in 0usize..3) {
            let mut v: Vec<Nanos> = xs.iter().map(|&x| Nanos(x)).collect();
            let mut sorted = v.clone();
            sorted.sort();
            let k = v.len().saturating_sub(pick).max(1);
            prop_assert_eq!(kth_smallest(&mut v, k), sorted[k - 1]);
        }
    }
}
