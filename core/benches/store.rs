//! The replay hot path: prefix lookups in the LRU store, and lookup + touch of a whole prompt.
//! Target (workspace issue): >= 20 million block lookups per second on one core.

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use servelab_core::content::mix64;
use servelab_core::{BlockKey, ClassTtl, KvStore, Nanos, StoreConfig, TrafficClass};
use std::hint::black_box;

const CHAIN: usize = 1024;
const CHAINS: usize = 256;

fn chains() -> Vec<Vec<BlockKey>> {
    (0..CHAINS)
        .map(|c| {
            (0..CHAIN)
                .map(|i| BlockKey(mix64((c * CHAIN + i) as u64)))
                .collect()
        })
        .collect()
}

fn store(cap_blocks: Option<u64>, chains: &[Vec<BlockKey>]) -> KvStore {
    let cfg = StoreConfig {
        capacity_bytes: cap_blocks.map(|b| b * 113_920),
        ttl: ClassTtl::published(),
        ..StoreConfig::default()
    };
    let mut s = KvStore::new(cfg, 113_920).expect("valid config");
    for c in chains {
        s.touch_or_insert(Nanos(1), c, TrafficClass::Agent);
    }
    s
}

fn bench(c: &mut Criterion) {
    let chains = chains();
    let mut g = c.benchmark_group("store");
    g.throughput(Throughput::Elements((CHAIN * CHAINS) as u64));

    // 262,144 resident blocks (30 GB of KV): every lookup hits, so each chain is walked fully.
    let mut s = store(None, &chains);
    g.bench_function("lookup_prefix_hits", |b| {
        b.iter(|| {
            let mut n = 0;
            for ch in &chains {
                n += s.lookup_prefix(Nanos(2), black_box(ch));
            }
            n
        })
    });

    // The replay step: look up the prefix, then touch every block (LRU move + TTL refresh).
    let mut s = store(None, &chains);
    g.bench_function("lookup_and_touch", |b| {
        b.iter(|| {
            for ch in &chains {
                let run = s.lookup_prefix(Nanos(3), black_box(ch));
                s.touch_or_insert(Nanos(3), &ch[..run.max(1)], TrafficClass::Agent);
            }
        })
    });

    // Capacity-bound: half the blocks fit, so every pass evicts and rewrites (LRU churn).
    g.bench_function("insert_with_eviction", |b| {
        b.iter_batched(
            || store(Some((CHAIN * CHAINS / 2) as u64), &chains[..CHAINS / 2]),
            |mut s| {
                for ch in &chains {
                    s.touch_or_insert(Nanos(4), ch, TrafficClass::Chat);
                }
                s
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
