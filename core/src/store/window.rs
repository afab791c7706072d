//! A serving unit's view of a store that several units share, for one window of a parallel
//! cluster run, and the merge that applies every unit's writes at the window's end.
//!
//! During a window each unit reads the store as the last merge left it (read-only, shared by
//! every thread) plus what it wrote itself since (its overlay), and logs its writes. At the
//! window's end the logs of all units are applied to the store in (time, unit, sequence) order.
//! So what one unit writes becomes visible to the others at the next window boundary, at most
//! one window later than in a sequential run, and nothing a unit sees depends on how the units
//! were spread over threads: the same config gives the same bytes on 1 thread or 8.
//!
//! The view answers as the store would under that rule: a block is present if the unit wrote
//! or touched it in the window and it has not expired since, or if the store held it at the
//! last merge and its TTL has not passed. Evictions for capacity happen only at merges.

use super::{KvStore, TtlFrom};
use crate::content::{BlockKey, KeyMap};
use crate::ids::StorageNodeId;
use crate::request::TrafficClass;
use crate::time::Nanos;
use std::sync::Arc;

/// One write a unit made during a window.
#[derive(Clone, Copy, Debug)]
struct StoreOp {
    at: Nanos,
    kind: OpKind,
}

#[derive(Clone, Copy, Debug)]
enum OpKind {
    /// `touch_or_insert` of `keys[start..end]` of the window's key buffer.
    Blocks {
        start: u32,
        end: u32,
        class: TrafficClass,
    },
    /// `put` of one object.
    Put {
        key: BlockKey,
        bytes: u64,
        class: TrafficClass,
    },
}

/// A unit's view of the shared store during one window.
#[derive(Debug, Default)]
pub struct StoreWindow {
    base: Option<Arc<KvStore>>,
    /// Keys this unit wrote or touched in the window, and when they expire.
    overlay: KeyMap<Nanos>,
    keys: Vec<BlockKey>,
    ops: Vec<StoreOp>,
    /// Bytes of objects the unit wrote in the window that the store did not hold.
    new_bytes: u64,
    lookups: u64,
    lookup_hits: u64,
    /// The earliest expiry of anything the view holds, and how many times the unit's clock
    /// has been moved past it: while both stay put, nothing the unit found has expired.
    next_expiry: Nanos,
    expired_moves: u64,
    /// Shard bytes the last merge wrote to each storage node for this unit's writes.
    node_writes: Vec<(StorageNodeId, u64)>,
}

impl StoreWindow {
    /// Opens the next window on `base`, the store as the last merge left it.
    pub fn open(&mut self, base: Arc<KvStore>) {
        self.next_expiry = base.next_expiry();
        self.base = Some(base);
    }

    /// The unit's clock moved to `now` ([`KvStore::advance`]): nothing is deleted (the merge
    /// does that), but once `now` passes an expiry, blocks found before may be gone.
    #[inline]
    pub fn advance(&mut self, now: Nanos) {
        if now >= self.next_expiry {
            self.expired_moves += 1;
        }
    }

    /// The store the window reads.
    ///
    /// # Panics
    /// Between windows (after [`merge`] took the store back): a bug in the cluster driver.
    pub fn base(&self) -> &KvStore {
        self.base
            .as_deref()
            .expect("a store window is read only while it is open")
    }

    /// Gives the store back (the merge needs it alone).
    pub fn close(&mut self) -> Option<Arc<KvStore>> {
        self.base.take()
    }

    /// Changes after which a block once found may be missing: the store's removals (a merge
    /// that only adds the other units' blocks removes nothing, so it does not count: counting
    /// it would void every session memo at every window and make each turn look up its whole
    /// prefix again) and every move of the clock past an expiry.
    pub fn change_generation(&self) -> u64 {
        self.base().change_generation() + self.expired_moves
    }

    /// Bytes held: the store's at the last merge and what the unit wrote since.
    pub fn used_bytes(&self) -> u64 {
        self.base().used_bytes() + self.new_bytes
    }

    fn expiry(&self, at: Nanos, class: TrafficClass) -> Nanos {
        match self.base().cfg.ttl.get(class) {
            Some(ttl) => at.saturating_add(ttl).min(Nanos::MAX),
            None => Nanos::NEVER,
        }
    }

    /// Whether `key` is present at `now` for this unit.
    #[inline]
    fn present(&self, now: Nanos, key: BlockKey) -> bool {
        if let Some(&expires) = self.overlay.get(&key)
            && expires > now
        {
            return true;
        }
        self.base().holds_at(now, key)
    }

    /// [`KvStore::lookup_prefix`] on the view.
    pub fn lookup_prefix(&mut self, now: Nanos, keys: &[BlockKey]) -> usize {
        let mut run = 0;
        for &k in keys {
            self.lookups += 1;
            if !self.present(now, k) {
                break;
            }
            run += 1;
        }
        self.lookup_hits += run as u64;
        run
    }

    /// [`KvStore::contains`] on the view.
    pub fn contains(&self, now: Nanos, key: BlockKey) -> bool {
        self.present(now, key)
    }

    /// Logs a write of `key` at `at` and records it in the overlay. Returns whether the view
    /// held it before (a touch) or not (a write).
    fn note(&mut self, at: Nanos, key: BlockKey, bytes: u64, class: TrafficClass) -> bool {
        let held = self.present(at, key);
        let refreshes = self.base().cfg.ttl_from == TtlFrom::LastAccess;
        if !held || refreshes {
            let expires = self.expiry(at, class);
            self.next_expiry = self.next_expiry.min(expires);
            self.overlay.insert(key, expires);
        }
        if !held {
            self.new_bytes += bytes;
        }
        !held
    }

    /// [`KvStore::touch_or_insert`] on the view.
    pub fn touch_or_insert(&mut self, now: Nanos, keys: &[BlockKey], class: TrafficClass) {
        let bytes = self.base().block_bytes;
        for &k in keys {
            self.note(now, k, bytes, class);
        }
        let start = self.keys.len() as u32;
        self.keys.extend_from_slice(keys);
        let end = self.keys.len() as u32;
        self.ops.push(StoreOp {
            at: now,
            kind: OpKind::Blocks { start, end, class },
        });
    }

    /// [`KvStore::put`] on the view: whether the object was new to the unit's view.
    pub fn put(&mut self, now: Nanos, key: BlockKey, bytes: u64, class: TrafficClass) -> bool {
        let written = self.note(now, key, bytes, class);
        self.ops.push(StoreOp {
            at: now,
            kind: OpKind::Put { key, bytes, class },
        });
        written
    }

    /// Hands the node writes of the unit's last merged window to `f`, once.
    pub fn drain_node_writes(&mut self, mut f: impl FnMut(StorageNodeId, u64)) {
        for (node, bytes) in self.node_writes.drain(..) {
            f(node, bytes);
        }
    }

    /// Applies op `i` to `store` and keeps the node writes it made.
    fn apply(&mut self, i: usize, store: &mut KvStore) {
        let op = self.ops[i];
        match op.kind {
            OpKind::Blocks { start, end, class } => {
                let keys = &self.keys[start as usize..end as usize];
                store.touch_or_insert(op.at, keys, class);
            }
            OpKind::Put { key, bytes, class } => {
                store.put(op.at, key, bytes, class);
            }
        }
        let writes = &mut self.node_writes;
        store.drain_node_writes(|node, bytes| writes.push((node, bytes)));
    }

    /// Empties the window's log and overlay for the next window.
    fn reset(&mut self) {
        self.overlay.clear();
        self.keys.clear();
        self.ops.clear();
        self.new_bytes = 0;
        self.lookups = 0;
        self.lookup_hits = 0;
    }
}

/// Applies the windows' writes to `store` in (time, unit, sequence) order (`windows` in unit
/// order, each closed), advances it to `end` (the window's end) and resets the windows.
pub fn merge(store: &mut KvStore, windows: &mut [&mut StoreWindow], end: Nanos) {
    let mut next = vec![0usize; windows.len()];
    loop {
        // A few units: a scan for the earliest head is cheaper than a heap.
        let mut pick: Option<(Nanos, usize)> = None;
        for (u, w) in windows.iter().enumerate() {
            if let Some(op) = w.ops.get(next[u])
                && pick.is_none_or(|(t, _)| op.at < t)
            {
                pick = Some((op.at, u));
            }
        }
        let Some((_, u)) = pick else {
            break;
        };
        windows[u].apply(next[u], store);
        next[u] += 1;
    }
    for w in windows.iter_mut() {
        store.stats.block_lookups += w.lookups;
        store.stats.block_lookup_hits += w.lookup_hits;
        w.reset();
    }
    store.advance(end);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{ClassTtl, StoreConfig};

    fn store() -> KvStore {
        let cfg = StoreConfig {
            ttl: ClassTtl::uniform(Some(Nanos::from_secs(100))),
            ..StoreConfig::default()
        };
        KvStore::new(cfg, 10).unwrap()
    }

    fn keys(range: std::ops::Range<u64>) -> Vec<BlockKey> {
        range.map(|k| BlockKey(k * 7919 + 1)).collect()
    }

    /// A store holding `held` blocks written at 1 s, and two units' windows open on it.
    fn two_views(held: u64) -> (Arc<KvStore>, StoreWindow, StoreWindow) {
        let mut s = store();
        s.touch_or_insert(Nanos::from_secs(1), &keys(0..held), TrafficClass::Chat);
        let base = Arc::new(s);
        let (mut a, mut b) = (StoreWindow::default(), StoreWindow::default());
        a.open(base.clone());
        b.open(base.clone());
        (base, a, b)
    }

    #[test]
    fn a_unit_sees_its_own_writes_and_the_others_only_after_the_merge() {
        let (base, mut a, mut b) = two_views(4);
        let t = Nanos::from_secs(2);
        assert_eq!(a.lookup_prefix(t, &keys(0..8)), 4);
        a.touch_or_insert(t, &keys(0..8), TrafficClass::Chat);
        assert_eq!(a.lookup_prefix(t, &keys(0..8)), 8);
        assert_eq!(b.lookup_prefix(t, &keys(0..8)), 4);
        assert_eq!(a.used_bytes(), base.used_bytes() + 40);
        a.close();
        b.close();
        let mut s2 = Arc::try_unwrap(base).unwrap();
        merge(&mut s2, &mut [&mut a, &mut b], Nanos::from_secs(3));
        assert_eq!(s2.len(), 8);
        // Every key checked counts, the first missing one included: 5 + 8 + 5.
        assert_eq!(s2.stats().block_lookups, 5 + 8 + 5);
        let base = Arc::new(s2);
        b.open(base);
        assert_eq!(b.lookup_prefix(Nanos::from_secs(3), &keys(0..8)), 8);
        assert!(a.ops.is_empty() && a.overlay.is_empty());
    }

    #[test]
    fn a_merge_that_only_adds_keeps_the_generation_and_an_expiry_moves_it() {
        let (base, mut a, mut b) = two_views(2);
        let before = a.change_generation();
        b.touch_or_insert(Nanos::from_secs(2), &keys(2..6), TrafficClass::Chat);
        a.close();
        b.close();
        let mut s = Arc::try_unwrap(base).unwrap();
        merge(&mut s, &mut [&mut a, &mut b], Nanos::from_secs(3));
        let base = Arc::new(s);
        a.open(base.clone());
        // Nothing was removed: what a found before is still there, so its memos stay valid.
        assert_eq!(a.change_generation(), before);
        assert_eq!(a.lookup_prefix(Nanos::from_secs(3), &keys(0..8)), 6);
        // The blocks written at 1 s expire at 101 s: moving the clock past that counts.
        a.advance(Nanos::from_secs(101));
        assert!(a.change_generation() > before);
        a.close();
        b.open(base.clone());
        b.close();
        let mut s = Arc::try_unwrap(base).unwrap();
        merge(&mut s, &mut [&mut a, &mut b], Nanos::from_secs(102));
        assert!(
            s.change_generation() > 0,
            "the merge expired the blocks of 1 s"
        );
    }

    #[test]
    fn the_view_honours_ttls_and_the_merge_orders_writes_by_time() {
        let (base, mut a, mut b) = two_views(2);
        // Expired at 101 s (written at 1 s with a 100 s TTL) although no call removed it.
        assert!(a.contains(Nanos::from_secs(100), keys(0..1)[0]));
        assert!(!a.contains(Nanos::from_secs(101), keys(0..1)[0]));
        // b writes the same new block earlier than a: b's write is the one that counts.
        assert!(a.put(Nanos::from_secs(60), BlockKey(99), 10, TrafficClass::Chat));
        assert!(b.put(Nanos::from_secs(50), BlockKey(99), 10, TrafficClass::Chat));
        a.close();
        b.close();
        let mut s = Arc::try_unwrap(base).unwrap();
        merge(&mut s, &mut [&mut a, &mut b], Nanos::from_secs(61));
        assert_eq!(s.stats().inserts, 3);
        assert_eq!(s.stats().touches, 1);
        // TTLs run from the last access: a's touch at 60 s keeps it until 160 s.
        assert!(s.holds_at(Nanos::from_secs(159), BlockKey(99)));
        assert!(!s.holds_at(Nanos::from_secs(160), BlockKey(99)));
    }
}
