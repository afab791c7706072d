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

/// A store over `nodes` nodes in groups of `data + parity`, per-node GC with nodes of
/// `node_bytes` bytes, evicting exactly what does not fit; blocks of 100 bytes.
fn per_node(nodes: u32, data: u32, parity: u32, node_bytes: u64) -> KvStore {
    let cfg = StoreConfig {
        storage_nodes: nodes,
        ec_data_shards: data,
        ec_parity_shards: parity,
        gc: GcPolicy::PerNodeLru,
        node: StorageNodeConfig {
            ssds: 1,
            ssd_bytes: node_bytes,
            ..Default::default()
        },
        high_watermark: 1.0,
        low_watermark: 1.0,
        ttl: ClassTtl::none(),
        ..Default::default()
    };
    KvStore::new(cfg, 100).unwrap()
}

fn put_key(s: &mut KvStore, t: u64, key: u64) -> bool {
    s.put(Nanos(t), BlockKey(key), 100, TrafficClass::Chat)
}

fn held(s: &KvStore, keys: &[u64]) -> Vec<u64> {
    keys.iter()
        .copied()
        .filter(|&k| s.holds(BlockKey(k)))
        .collect()
}

/// 2 + 1 coding over 6 nodes: an object starting at s sits on s, s+1, s+2 (mod 6), 50 bytes
/// a node; a node holds 100 bytes (two shards). Keys are their own start nodes mod 6.
/// A(0) on 0,1,2; B(3) on 3,4,5; C(1) on 1,2,3; D(4) on 4,5,0: every node is full. Writing
/// E(2) on 2,3,4, by hand:
/// node 2 holds A, C (full): its GC evicts its oldest, A; node 3 holds B, C: evicts B; node 4
/// then holds D only. Kept: C, D, E. A global LRU of the same four blocks would evict only A.
#[test]
fn per_node_gc_evicts_the_full_nodes_oldest() {
    let mut s = per_node(6, 2, 1, 100);
    for (t, k) in [0, 3, 1, 4].into_iter().enumerate() {
        assert!(put_key(&mut s, t as u64, k));
    }
    assert_eq!(s.node_bytes(), &[100; 6], "every node holds two shards");
    assert!(put_key(&mut s, 10, 2));
    assert_eq!(held(&s, &[0, 1, 2, 3, 4]), vec![1, 2, 4]);
    assert_eq!(s.stats().evictions, 2);
    s.check_invariants().unwrap();
    // The same writes with B touched before E: node 2 evicts A, node 3 now C (B is newer),
    // and node 4 (B, D) its oldest, D. Kept: B, E.
    let mut s = per_node(6, 2, 1, 100);
    for (t, k) in [0, 3, 1, 4].into_iter().enumerate() {
        put_key(&mut s, t as u64, k);
    }
    assert!(!put_key(&mut s, 5, 3), "a touch, not a write");
    assert!(put_key(&mut s, 10, 2));
    assert_eq!(held(&s, &[0, 1, 2, 3, 4]), vec![2, 3]);
    assert_eq!(s.stats().evictions, 3);
    s.check_invariants().unwrap();
}

/// 10 + 2 over 15 nodes, blocks 0..30 (start = key mod 15). Nodes 5 and 6 down: every group
/// still decodes. Node 7 too: the groups holding 5, 6 and 7 (starts 11..=14 and 0..=5, by hand)
/// lose their objects: 2 blocks each, 20 blocks, 2,000 bytes. Their writes are refused until a
/// repaired node is rebuilt; the rebuild of node 7 covers the surviving groups it belongs to
/// (starts 6 and 7: blocks 6, 7, 21, 22 → 4 shards of 10 bytes).
#[test]
fn three_down_loses_exactly_these_blocks() {
    let cfg = StoreConfig {
        storage_nodes: 15,
        ttl: ClassTtl::none(),
        ..Default::default()
    };
    let mut s = KvStore::new(cfg, 100).unwrap();
    for k in 0..30 {
        put_key(&mut s, 1, k);
    }
    let before = s.change_generation();
    for n in [5, 6] {
        let c = s.fail_node(Nanos(2), StorageNodeId(n));
        assert!(c.changed && c.groups_lost == 0 && c.objects_lost == 0);
    }
    assert_eq!(
        s.nodes().unavailable_in(5),
        2,
        "group 5 holds nodes 5 and 6"
    );
    assert!(s.is_readable(BlockKey(0)));
    let c = s.fail_node(Nanos(3), StorageNodeId(7));
    assert_eq!(
        (c.groups_lost, c.objects_lost, c.bytes_lost),
        (10, 20, 2000)
    );
    let all: Vec<u64> = (0..30).collect();
    assert_eq!(held(&s, &all), vec![6, 7, 8, 9, 10, 21, 22, 23, 24, 25]);
    assert_eq!(s.cluster_stats().lost_bytes, 2000);
    assert_eq!(
        s.change_generation(),
        before + 20,
        "the session memos see the loss"
    );
    assert!(
        !s.fail_node(Nanos(3), StorageNodeId(7)).changed,
        "already down"
    );
    assert!(!put_key(&mut s, 4, 45), "group 0 lost its objects");
    assert_eq!(s.cluster_stats().writes_refused, 1);
    assert!(
        put_key(&mut s, 4, 36),
        "group 6 survives with two nodes down"
    );
    s.check_invariants().unwrap();
    let plan = s.repair_node(Nanos(5), StorageNodeId(7)).unwrap();
    assert_eq!(plan.bytes, 50, "blocks 6, 7, 21, 22, 36");
    assert_eq!(plan.groups, vec![(7, 20), (6, 30)]);
    assert!(s.repair_node(Nanos(5), StorageNodeId(7)).is_none());
    assert!(!put_key(&mut s, 6, 45), "rebuilding: still lost");
    assert!(s.node_rebuilt(Nanos(7), StorageNodeId(7)));
    assert!(!s.nodes().any_lost());
    assert!(put_key(&mut s, 8, 45), "two down again: writable");
    s.check_invariants().unwrap();
}

/// A write charges its share to every node of its group that is not down, drained once.
#[test]
fn node_writes_are_drained_once_and_skip_down_nodes() {
    let cfg = StoreConfig {
        storage_nodes: 13,
        ..Default::default()
    };
    let mut s = KvStore::new(cfg, 100).unwrap();
    put_key(&mut s, 1, 3);
    let mut got = Vec::new();
    s.drain_node_writes(|n, b| got.push((n.0, b)));
    let want: Vec<(u32, u64)> = (3..15).map(|n| (n % 13, 10)).collect();
    assert_eq!(got, want);
    got.clear();
    s.drain_node_writes(|n, b| got.push((n.0, b)));
    assert!(got.is_empty());
    s.fail_node(Nanos(2), StorageNodeId(5));
    put_key(&mut s, 3, 16); // start 3 again
    put_key(&mut s, 3, 3); // a touch writes nothing
    s.drain_node_writes(|n, b| got.push((n.0, b)));
    assert_eq!(got.len(), 11);
    assert!(got.iter().all(|&(n, b)| n != 5 && b == 10));
    assert_eq!(s.cluster_stats().physical_bytes_written, 230);
}

/// Every bad failure key is an error naming the field.
#[test]
fn bad_failure_schedules_name_the_field() {
    let fail =
        |node: Option<u32>, nodes: Vec<u32>, at: u64, repair: Option<u64>| ScheduledFailure {
            node,
            nodes,
            at: Nanos::from_secs(at),
            repair_at: repair.map(Nanos::from_secs),
        };
    let err = |f: &dyn Fn(&mut StoreConfig)| {
        let mut c = StoreConfig {
            storage_nodes: 20,
            ..Default::default()
        };
        f(&mut c);
        c.validate(100).unwrap_err().to_string()
    };
    type Edit<'a> = Box<dyn Fn(&mut StoreConfig) + 'a>;
    let cases: Vec<(Edit, &str)> = vec![
        (
            Box::new(|c| {
                c.failures = vec![
                    fail(Some(1), vec![], 10, None),
                    fail(Some(20), vec![], 5, None),
                ]
            }),
            "store.failures[1].node",
        ),
        (
            Box::new(|c| c.failures = vec![fail(None, vec![3, 40], 10, None)]),
            "store.failures[0].nodes[1]",
        ),
        (
            Box::new(|c| c.failures = vec![fail(Some(2), vec![], 10, Some(5))]),
            "store.failures[0].repair_at",
        ),
        (
            Box::new(|c| c.failures = vec![fail(None, (0..21).collect(), 10, None)]),
            "store.failures[0].nodes",
        ),
        (
            Box::new(|c| c.failures = vec![fail(None, vec![4, 4], 10, None)]),
            "store.failures[0].nodes[1]",
        ),
        (
            Box::new(|c| c.failures = vec![fail(None, vec![], 10, None)]),
            "store.failures[0].nodes",
        ),
        (
            Box::new(|c| {
                c.failures = vec![
                    fail(Some(4), vec![], 10, Some(30)),
                    fail(Some(4), vec![], 20, None),
                ]
            }),
            "store.failures[1].at",
        ),
        (Box::new(|c| c.storage_nodes = 0), "store.storage_nodes"),
        (
            Box::new(|c| {
                c.random_failures = Some(RandomFailures {
                    mtbf: Nanos::from_secs(3600),
                    mttr: Nanos::ZERO,
                })
            }),
            "store.random_failures.mttr",
        ),
        (
            Box::new(|c| c.node.write_bytes_per_s = 0.0),
            "store.node.write_bytes_per_s",
        ),
        (Box::new(|c| c.node.ssds = 0), "store.node.ssds"),
        (
            Box::new(|c| c.rebuild.chunk_bytes = 0),
            "store.rebuild.chunk_bytes",
        ),
        (
            Box::new(|c| {
                c.gc = GcPolicy::PerNodeLru;
                c.capacity_bytes = Some(1 << 30);
            }),
            "store.capacity_bytes",
        ),
    ];
    for (f, field) in &cases {
        let e = err(f.as_ref());
        assert!(e.contains(&format!("`{field}`")), "{field}: {e}");
    }
    // A failure after the repair of the same node is fine, and so is a failure of its own.
    let mut c = StoreConfig {
        storage_nodes: 20,
        ..Default::default()
    };
    c.failures = vec![
        fail(Some(4), vec![], 10, Some(20)),
        fail(Some(4), vec![], 20, None),
    ];
    c.validate(100).unwrap();
    let parsed: StoreConfig = toml::from_str(
        "gc = \"per-node-lru\"\n[[failures]]\nnodes = [1, 2]\nat = \"5min\"\nrepair_at = \"1h\"\n\
         [random_failures]\nmtbf = \"30d\"\nmttr = \"2h\"\n",
    )
    .unwrap();
    assert_eq!(parsed.failures[0].failed_nodes(), vec![1, 2]);
    assert_eq!(parsed.gc, GcPolicy::PerNodeLru);
    parsed.validate(113_920).unwrap();
    assert!(
        toml::from_str::<StoreConfig>("[[failures]]\nnode = 1\nat = \"1s\"\nrepiar_at = \"2s\"\n")
            .is_err()
    );
}

proptest! {
    /// Under writes, touches, node failures, repairs and rebuilds, with either GC: nothing is
    /// stored over a node's capacity or in a group that lost its objects, lookups find only
    /// what is held, and every structure agrees with its counters.
    #[test]
    fn failures_and_gc_keep_the_invariants(
        ops in proptest::collection::vec((0u8..8, 0u64..40, 1u64..20), 1..200),
        per in any::<bool>(),
    ) {
        let mut s = if per {
            per_node(14, 10, 2, 60)
        } else {
            let cfg = StoreConfig {
                storage_nodes: 14,
                capacity_bytes: Some(2_000),
                ttl: ClassTtl::uniform(Some(Nanos(300))),
                ..Default::default()
            };
            KvStore::new(cfg, 100).unwrap()
        };
        let mut now = 0;
        for (op, x, dt) in ops {
            now += dt;
            let node = StorageNodeId((x % 14) as u32);
            match op {
                0 => { s.fail_node(Nanos(now), node); }
                1 => { s.repair_node(Nanos(now), node); }
                2 => { s.node_rebuilt(Nanos(now), node); }
                _ => {
                    let ks: Vec<BlockKey> = (x..x + 5).map(BlockKey).collect();
                    let lost = |s: &KvStore, k: BlockKey| !s.is_readable(k);
                    let refused = s.cluster_stats().writes_refused;
                    let would_refuse = ks.iter().filter(|&&k| lost(&s, k)).count() as u64;
                    s.touch_or_insert(Nanos(now), &ks, TrafficClass::Agent);
                    prop_assert_eq!(s.cluster_stats().writes_refused, refused + would_refuse);
                    let run = s.lookup_prefix(Nanos(now), &ks);
                    prop_assert!(ks[..run].iter().all(|&k| s.holds(k) && s.is_readable(k)));
                }
            }
            if let Some(cap) = s.node_capacity_bytes() {
                prop_assert!(s.node_bytes().iter().all(|&b| b <= cap));
            }
            s.check_light().map_err(TestCaseError::fail)?;
            s.check_invariants().map_err(TestCaseError::fail)?;
        }
    }
}
