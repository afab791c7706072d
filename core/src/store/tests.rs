//! Unit tests of the store.

use super::*;
use proptest::prelude::*;

proptest! {
    /// The open-addressing table agrees with a standard map under inserts and removals
    /// (small key space, so clusters, wrap-around and backward shifts all happen).
    #[test]
    fn key_table_matches_a_hash_map(ops in proptest::collection::vec((any::<bool>(), 0u64..64), 0..400)) {
        let mut t = KeyTable::new();
        let mut want: std::collections::HashMap<BlockKey, u32> = std::collections::HashMap::new();
        // Few distinct probe starts: keys differing only in high bits collide.
        let key_at = |x: u64| if x.is_multiple_of(2) {
            BlockKey(x.wrapping_mul(0x0100_0000_0000_0001) % 97)
        } else {
            BlockKey(x << 32 | 5)
        };
        // The "slab": the key inserted at index n is op n's key.
        let slab: Vec<u64> = ops.iter().map(|&(_, x)| key_at(x).0).collect();
        let key_of = |i: u32| slab[i as usize];
        for (n, &(insert, x)) in ops.iter().enumerate() {
            let key = key_at(x);
            if insert {
                t.reserve(1);
                match t.find(key.0, key_of) {
                    (_, true) => {}
                    (at, false) => {
                        t.fill(at, key, n as u32);
                        want.insert(key, n as u32);
                    }
                }
            } else {
                prop_assert_eq!(t.remove(key, key_of), want.remove(&key));
            }
            prop_assert_eq!(t.len(), want.len());
        }
        for (k, v) in &want {
            prop_assert_eq!(t.get(*k, key_of), Some(*v));
        }
        prop_assert_eq!(t.iter(key_of).filter(|&(ok, _)| ok).count(), want.len());
    }
}

/// Corrupting a map entry (a fingerprint, or the object it names) or an expiry link is
/// caught by the end-of-run check.
#[test]
fn check_catches_corruption() {
    let fresh = || {
        let mut s = KvStore::new(StoreConfig::default(), 100).unwrap();
        s.touch_or_insert(Nanos(1), &keys(0..50), TrafficClass::Agent);
        s.touch_or_insert(Nanos(2), &keys(10..20), TrafficClass::Chat);
        s.check_invariants().unwrap();
        s
    };
    let first = |s: &KvStore| s.map.slots.iter().position(|&x| x != 0).unwrap();
    let mut s = fresh();
    let at = first(&s);
    s.map.slots[at] ^= 1 << 40;
    assert!(s.check_invariants().is_err(), "fingerprint");
    let mut s = fresh();
    let (a, b) = {
        let mut full = s.map.slots.iter().enumerate().filter(|&(_, &x)| x != 0);
        (full.next().unwrap().0, full.next().unwrap().0)
    };
    let (x, y) = (s.map.slots[a], s.map.slots[b]);
    s.map.slots[a] = (x & KeyTable::HASH_BITS) | (y & !KeyTable::HASH_BITS);
    assert!(
        s.check_invariants().is_err(),
        "two entries naming one object"
    );
    let mut s = fresh();
    let h = s.expiry[TrafficClass::Agent as usize].head as usize;
    s.slab[h].expires = Nanos::NEVER;
    assert!(s.check_invariants().is_err(), "expiry order");
    // The unbounded store keeps no LRU list: its stored objects are the slots not free.
    let mut s = fresh();
    s.free.push(3);
    assert!(
        s.check_invariants().is_err(),
        "a stored object on the free list"
    );
    let mut s = fresh();
    s.slab.push(s.slab[0]);
    assert!(
        s.check_invariants().is_err(),
        "an object missing from the map"
    );
    // With a capacity, the LRU list's links are checked.
    let bounded = || {
        let cfg = StoreConfig {
            capacity_bytes: Some(1_000_000),
            ..Default::default()
        };
        let mut s = KvStore::new(cfg, 100).unwrap();
        s.touch_or_insert(Nanos(1), &keys(0..50), TrafficClass::Agent);
        s.touch_or_insert(Nanos(2), &keys(10..20), TrafficClass::Chat);
        s.check_invariants().unwrap();
        s
    };
    let mut s = bounded();
    let t = s.lru.tail as usize;
    s.lru_links[t].prev = NIL;
    assert!(s.check_invariants().is_err(), "LRU back link");
    let mut s = bounded();
    s.lru.tail = s.lru.head;
    assert!(s.check_invariants().is_err(), "LRU tail");
}

/// Reserving room up front (one rebuild to the final size) changes no answer, and objects
/// of other sizes than a block are charged their own size.
#[test]
fn reserve_and_object_sizes() {
    let run = |reserve: usize| {
        let mut s = KvStore::new(StoreConfig::default(), 100).unwrap();
        s.reserve(reserve);
        s.touch_or_insert(Nanos(1), &keys(0..300), TrafficClass::Agent);
        assert!(s.put(Nanos(2), k(1000), 7, TrafficClass::Chat));
        assert!(s.put(Nanos(2), k(1001), 1 << 40, TrafficClass::Other));
        s.touch_or_insert(Nanos(3), &keys(200..400), TrafficClass::Chat);
        s.check_invariants().unwrap();
        let found = s.lookup_prefix(Nanos(4), &keys(0..500));
        (found, s.len(), s.used_bytes(), s.stats().clone())
    };
    let want = run(0);
    assert_eq!(want.0, 400);
    assert_eq!(want.2, 400 * 100 + 7 + (1 << 40));
    assert_eq!(run(10_000), want);
    assert_eq!(run(1), want);
}

fn k(i: u64) -> BlockKey {
    BlockKey(crate::content::mix64(i))
}
fn keys(r: std::ops::Range<u64>) -> Vec<BlockKey> {
    r.map(k).collect()
}

#[test]
fn lru_evicts_oldest_past_high_watermark() {
    let cfg = StoreConfig {
        capacity_bytes: Some(10 * 100),
        high_watermark: 0.9,
        low_watermark: 0.5,
        ttl: ClassTtl::none(),
        ..Default::default()
    };
    let mut s = KvStore::new(cfg, 100).unwrap();
    s.touch_or_insert(Nanos(1), &keys(0..9), TrafficClass::Chat); // 900 = high: no GC yet
    assert_eq!(s.len(), 9);
    s.touch_or_insert(Nanos(2), &keys(0..1), TrafficClass::Chat); // block 0 becomes MRU
    s.touch_or_insert(Nanos(3), &keys(9..10), TrafficClass::Chat); // 1000 > 900 → down to 500
    assert_eq!(s.used_bytes(), 500);
    assert_eq!(s.stats().evictions, 5);
    // Evicted 1..=5; kept 6, 7, 8, 0, 9.
    assert!(s.contains(Nanos(3), k(0)));
    assert!(!s.contains(Nanos(3), k(1)));
    assert!(s.contains(Nanos(3), k(6)));
    s.check_invariants().unwrap();
}

#[test]
fn ttl_per_class_and_from_last_access() {
    let cfg = StoreConfig {
        ttl: ClassTtl {
            agent: Some(Nanos(100)),
            chat: Some(Nanos(300)),
            other: None,
        },
        ..Default::default()
    };
    let mut s = KvStore::new(cfg, 10).unwrap();
    s.touch_or_insert(Nanos(0), &keys(0..2), TrafficClass::Agent);
    s.touch_or_insert(Nanos(0), &keys(2..3), TrafficClass::Chat);
    s.touch_or_insert(Nanos(0), &keys(3..4), TrafficClass::Other);
    s.touch_or_insert(Nanos(50), &keys(1..2), TrafficClass::Agent); // refresh block 1
    assert_eq!(s.lookup_prefix(Nanos(99), &keys(0..1)), 1);
    assert_eq!(
        s.lookup_prefix(Nanos(100), &keys(0..1)),
        0,
        "expires at exactly its TTL"
    );
    assert_eq!(s.lookup_prefix(Nanos(149), &keys(1..2)), 1);
    assert_eq!(s.lookup_prefix(Nanos(150), &keys(1..2)), 0);
    assert_eq!(s.lookup_prefix(Nanos(299), &keys(2..3)), 1);
    assert_eq!(s.lookup_prefix(Nanos(1_000_000), &keys(3..4)), 1);
    assert_eq!(s.stats().expirations, 3);
    s.check_invariants().unwrap();
}

/// A clock that saturated (a huge time) is still a finite time: objects with a TTL expire
/// there, objects without one ("never") do not, and neither does `NEVER` as a `now`.
#[test]
fn a_saturated_clock_is_not_never() {
    let cfg = StoreConfig {
        ttl: ClassTtl {
            agent: Some(Nanos::from_secs(3 * 86_400)),
            chat: None,
            other: None,
        },
        ..Default::default()
    };
    let mut s = KvStore::new(cfg, 10).unwrap();
    s.touch_or_insert(Nanos(0), &keys(0..1), TrafficClass::Agent);
    s.touch_or_insert(Nanos(0), &keys(1..2), TrafficClass::Chat);
    assert_eq!(s.lookup_prefix(Nanos::NEVER, &keys(1..2)), 1);
    assert_eq!(s.lookup_prefix(Nanos::MAX, &keys(0..1)), 0);
    assert_eq!(s.lookup_prefix(Nanos::MAX, &keys(1..2)), 1);
    // Written at the saturated time with a TTL: expires at MAX, not never.
    s.touch_or_insert(Nanos::MAX, &keys(5..6), TrafficClass::Agent);
    assert_eq!(s.lookup_prefix(Nanos::MAX, &keys(5..6)), 0);
    s.check_invariants().unwrap();
    assert_eq!(s.stats().expirations, 2);
}

#[test]
fn config_sums_and_sizes_are_checked() {
    let bad = |cfg: StoreConfig| cfg.validate(100).unwrap_err().to_string();
    let e = bad(StoreConfig {
        ec_data_shards: u32::MAX,
        ec_parity_shards: 2,
        storage_nodes: u32::MAX,
        ..Default::default()
    });
    assert!(e.contains("storage_nodes"), "{e}");
    let e = bad(StoreConfig {
        ec_data_shards: u32::MAX,
        ec_parity_shards: 2,
        storage_nodes: 1000,
        ..Default::default()
    });
    assert!(e.contains("overflows"), "{e}");
    let e = bad(StoreConfig {
        ttl: ClassTtl::uniform(Some(Nanos::NEVER)),
        ..Default::default()
    });
    assert!(e.contains("horizon"), "{e}");
}

#[test]
fn ttl_from_write_ignores_reads() {
    let cfg = StoreConfig {
        ttl: ClassTtl::uniform(Some(Nanos(100))),
        ttl_from: TtlFrom::Write,
        ..Default::default()
    };
    let mut s = KvStore::new(cfg, 10).unwrap();
    s.touch_or_insert(Nanos(0), &keys(0..1), TrafficClass::Agent);
    s.touch_or_insert(Nanos(90), &keys(0..1), TrafficClass::Agent);
    assert!(!s.contains(Nanos(100), k(0)));
}

#[test]
fn placement_is_a_full_group() {
    let s = KvStore::new(StoreConfig::default(), 10).unwrap();
    let g = s.placement(k(7));
    assert_eq!(g.nodes.len(), 12);
    let mut n = g.nodes.clone();
    n.sort();
    n.dedup();
    assert_eq!(n.len(), 12);
}

/// Each object charges its share to exactly the nodes of its placement, groups that wrap
/// past the last node included, and a removal takes it back.
#[test]
fn node_charges_follow_placement() {
    let cfg = StoreConfig {
        storage_nodes: 15,
        ttl: ClassTtl::uniform(Some(Nanos(10))),
        ..Default::default()
    };
    let mut s = KvStore::new(cfg, 100).unwrap();
    let mut want = [0u64; 15];
    for i in 0..40 {
        s.touch_or_insert(Nanos(1), &keys(i..i + 1), TrafficClass::Agent);
        for n in s.placement(k(i)).nodes {
            want[n.0 as usize] += 10;
        }
        assert_eq!(s.node_bytes(), &want[..]);
    }
    s.advance(Nanos(11));
    assert!(s.node_bytes().iter().all(|&b| b == 0));
}

#[test]
fn placement_nodes_match_placement() {
    let s = KvStore::new(StoreConfig::default(), 10).unwrap();
    for i in 0..200 {
        let want = s.placement(k(i)).nodes;
        assert_eq!(s.placement_nodes(k(i)).collect::<Vec<_>>(), want);
    }
}

#[test]
fn rejects_bad_configs() {
    let tiny = StoreConfig {
        capacity_bytes: Some(5),
        ..Default::default()
    };
    assert!(
        KvStore::new(tiny, 10)
            .unwrap_err()
            .to_string()
            .contains("capacity_bytes")
    );
    let marks = StoreConfig {
        high_watermark: 0.5,
        low_watermark: 0.8,
        ..Default::default()
    };
    assert!(KvStore::new(marks, 10).is_err());
    let nodes = StoreConfig {
        storage_nodes: 5,
        ..Default::default()
    };
    assert!(
        KvStore::new(nodes, 10)
            .unwrap_err()
            .to_string()
            .contains("storage_nodes")
    );
}

proptest! {
    #[test]
    fn never_over_capacity_never_past_ttl(ops in proptest::collection::vec((0u64..60, 0u64..40, 0u8..3, 1u64..30), 1..300),
                                          cap_blocks in 1u64..40, ttl in 1u64..200) {
        let cfg = StoreConfig {
            capacity_bytes: Some(cap_blocks * 10),
            ttl: ClassTtl { agent: Some(Nanos(ttl)), chat: Some(Nanos(ttl * 2)), other: None },
            ..Default::default()
        };
        let mut s = KvStore::new(cfg, 10).unwrap();
        let mut now = 0u64;
        let mut last_write: std::collections::HashMap<u64, (u64, u8)> = Default::default();
        for (start, len, class, dt) in ops {
            now += dt;
            let class = TrafficClass::ALL[class as usize];
            let ks = keys(start..start + len % 8);
            let run = s.lookup_prefix(Nanos(now), &ks);
            // Everything served was touched within its TTL.
            for i in start..start + run as u64 {
                let (t, c) = last_write[&i];
                let ttl_c = match c { 0 => Some(ttl), 1 => Some(ttl * 2), _ => None };
                if let Some(d) = ttl_c { prop_assert!(now < t + d); }
            }
            s.touch_or_insert(Nanos(now), &ks, class);
            for i in start..start + len % 8 { last_write.insert(i, (now, class as u8)); }
            prop_assert!(s.used_bytes() <= cap_blocks * 10);
            s.check_invariants().map_err(TestCaseError::fail)?;
        }
    }
}
