//! The KV cache store of SPEC §7: capacity in bytes, TTL per traffic class set on the storage
//! side, LRU eviction past a high watermark down to a low watermark (one LRU over the store,
//! or a GC worker per storage node), 10+2 erasure-coded placement on storage nodes, and what
//! node failures do to it (degraded groups, lost groups, rebuilds).
//!
//! The hot path (prefix lookups and writes of runs of blocks) is a probe per block in an
//! open-addressing table keyed by the block hash; LRU order and expiry order are intrusive lists
//! inside one slab, so nothing allocates per lookup. With tens of millions of blocks every probe
//! is a cache miss, so runs of keys prefetch their slots a few keys ahead.
//!
//! Modules: [`config`] (the keys and their checks), [`table`] (the key table), [`nodes`] (which
//! nodes answer, per group), [`failures`] (the failure schedule), `gc` (the two collectors),
//! `cluster` (failures, repairs and the write counters), `check` (the invariants).

mod check;
mod cluster;
pub mod config;
pub mod failures;
mod gc;
pub mod nodes;
mod table;
#[cfg(test)]
mod tests;
pub mod window;

pub use cluster::{ClusterStats, NodeChange, RebuildPlan};
pub use config::{
    ClassTtl, GcPolicy, MAX_STORAGE_NODES, RandomFailures, RebuildConfig, ScheduledFailure,
    StorageNodeConfig, StoreConfig, TtlFrom,
};
pub use failures::{FailureSchedule, NodeEvent, NodeEventKind};
pub use nodes::{NodeSet, NodeState};

use crate::content::BlockKey;
use crate::error::ConfigError;
use crate::ids::StorageNodeId;
use crate::request::TrafficClass;
use crate::time::Nanos;
use serde::{Deserialize, Serialize};
use table::KeyTable;

const NIL: u32 = u32::MAX;
/// How many keys ahead a run of lookups or writes prefetches its table slots: enough to overlap
/// the misses of a run, few enough that the lines are still cached when used.
const PREFETCH_AHEAD: usize = 16;

/// Counters a replay or simulation reports.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreStats {
    pub block_lookups: u64,
    pub block_lookup_hits: u64,
    pub inserts: u64,
    pub touches: u64,
    pub evictions: u64,
    pub evicted_bytes: u64,
    pub expirations: u64,
    pub expired_bytes: u64,
    pub bytes_written: u64,
    pub used_bytes: u64,
    pub peak_bytes: u64,
    pub objects: u64,
}

/// The 12 nodes holding one erasure-coded object; any `data_shards` answers decode it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EcGroup {
    pub nodes: Vec<StorageNodeId>,
    pub data_shards: u32,
}

/// One stored object: 32 bytes (tens of millions of them). Its size is an index into the
/// store's distinct object sizes (blocks are all one size); its LRU links live apart, in
/// [`KvStore::lru_links`], only when the store has a capacity to evict for.
#[derive(Clone, Copy, Debug)]
struct Entry {
    key: BlockKey,
    expires: Nanos,
    exp_prev: u32,
    exp_next: u32,
    size: u32,
    class: u8,
}

#[derive(Clone, Copy, Debug)]
struct Link {
    prev: u32,
    next: u32,
}

/// Per-node GC, per slab entry: when the object was last used (a store-wide counter) and its
/// group (kept so that relinking it does not divide its key by the node count again).
#[derive(Clone, Copy, Debug)]
struct Recency {
    stamp: u64,
    start: u32,
}

#[derive(Clone, Copy, Debug)]
struct List {
    head: u32,
    tail: u32,
}

impl List {
    const EMPTY: List = List {
        head: NIL,
        tail: NIL,
    };
}

/// The store. Deterministic: no iteration over the hash map decides anything.
#[derive(Clone, Debug)]
pub struct KvStore {
    cfg: StoreConfig,
    block_bytes: u64,
    high_bytes: u64,
    low_bytes: u64,
    map: KeyTable,
    slab: Vec<Entry>,
    free: Vec<u32>,
    /// Distinct object sizes (index 0: a block), and their indices.
    sizes: Vec<u64>,
    size_index: std::collections::HashMap<u64, u32>,
    /// LRU links per slab entry, kept only with a capacity: an unbounded store never evicts,
    /// so recency decides nothing there and touches skip the relinking.
    lru_links: Vec<Link>,
    /// The one LRU list of the global GC.
    lru: List,
    /// The per-node GC: one LRU list per group (by start node), each object on its group's,
    /// with a recency stamp per slab entry; a node's LRU order is the merge of its groups'.
    per_node: bool,
    start_lru: Vec<List>,
    recency: Vec<Recency>,
    stamp_clock: u64,
    /// Per-node GC: a node's capacity and watermarks, physical bytes of shards.
    node_cap_bytes: u64,
    node_high_bytes: u64,
    node_low_bytes: u64,
    /// One expiry list per class: with a constant TTL per class and non-decreasing `now`,
    /// append order is expiry order.
    expiry: [List; 3],
    /// Physical bytes of shards each node holds, and per group (by start node) the bytes of
    /// one node's shards and the objects.
    node_bytes: Vec<u64>,
    start_shares: Vec<u64>,
    start_objects: Vec<u32>,
    nodes: NodeSet,
    /// Shard bytes written per node since the environment last drained them, and the nodes
    /// with a count (in order of their first write since then).
    pending_writes: Vec<u64>,
    dirty_nodes: Vec<u32>,
    cluster: ClusterStats,
    now: Nanos,
    stats: StoreStats,
}

impl KvStore {
    pub fn new(cfg: StoreConfig, block_bytes: u64) -> Result<Self, ConfigError> {
        cfg.validate(block_bytes)?;
        let (high_bytes, low_bytes) = match cfg.capacity_bytes {
            Some(c) => (
                (c as f64 * cfg.high_watermark) as u64,
                (c as f64 * cfg.low_watermark) as u64,
            ),
            None => (u64::MAX, u64::MAX),
        };
        let n = cfg.storage_nodes as usize;
        let per_node = cfg.gc == GcPolicy::PerNodeLru;
        let node_cap = cfg.node.capacity_bytes();
        Ok(KvStore {
            node_bytes: vec![0; n],
            start_shares: vec![0; n],
            start_objects: vec![0; n],
            nodes: NodeSet::new(cfg.storage_nodes, cfg.ec_data_shards, cfg.ec_parity_shards),
            pending_writes: vec![0; n],
            dirty_nodes: Vec::new(),
            cluster: ClusterStats::default(),
            per_node,
            start_lru: if per_node {
                vec![List::EMPTY; n]
            } else {
                Vec::new()
            },
            recency: Vec::new(),
            stamp_clock: 0,
            node_cap_bytes: node_cap,
            node_high_bytes: (node_cap as f64 * cfg.high_watermark) as u64,
            node_low_bytes: (node_cap as f64 * cfg.low_watermark) as u64,
            cfg,
            block_bytes,
            high_bytes,
            low_bytes,
            map: KeyTable::new(),
            slab: Vec::new(),
            free: Vec::new(),
            sizes: vec![block_bytes],
            size_index: [(block_bytes, 0)].into_iter().collect(),
            lru_links: Vec::new(),
            lru: List::EMPTY,
            expiry: [List::EMPTY; 3],
            now: Nanos::ZERO,
            stats: StoreStats::default(),
        })
    }

    pub fn config(&self) -> &StoreConfig {
        &self.cfg
    }
    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
    }
    pub fn stats(&self) -> &StoreStats {
        &self.stats
    }
    pub fn used_bytes(&self) -> u64 {
        self.stats.used_bytes
    }
    pub fn len(&self) -> usize {
        self.map.len()
    }
    /// Makes room for `objects` more objects up front (a hint: results do not depend on it).
    /// A caller that knows roughly how many blocks a run will write saves the table's rebuilds
    /// and page faults on the way there.
    pub fn reserve(&mut self, objects: usize) {
        self.map.reserve(objects);
        let more = objects.saturating_sub(self.free.len());
        self.slab.reserve(more);
        if self.tracks_lru() {
            self.lru_links.reserve(more);
        }
        if self.per_node {
            self.recency.reserve(more);
        }
    }
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }
    /// Bytes of shards held per storage node (each node of a group holds 1/data of an
    /// object), those owed to a node that is down included.
    pub fn node_bytes(&self) -> &[u64] {
        &self.node_bytes
    }
    /// Which nodes answer, and which groups lost their objects.
    pub fn nodes(&self) -> &NodeSet {
        &self.nodes
    }
    /// Failures, losses, refused writes and the bytes written to the nodes.
    pub fn cluster_stats(&self) -> &ClusterStats {
        &self.cluster
    }
    /// The store's clock (the latest `now` it was given).
    pub fn now(&self) -> Nanos {
        self.now
    }
    /// The capacity of one node under the per-node GC (physical bytes of shards).
    pub fn node_capacity_bytes(&self) -> Option<u64> {
        self.per_node.then_some(self.node_cap_bytes)
    }
    /// Counts every change after which a block once found or written may be missing:
    /// evictions, expirations, objects lost with their group and refused writes. While it
    /// stays put, what a caller found present is still present.
    pub fn change_generation(&self) -> u64 {
        self.stats.evictions
            + self.stats.expirations
            + self.cluster.lost_objects
            + self.cluster.writes_refused
    }
    /// Whether `key` is stored, without moving the clock (objects past their TTL that no call
    /// has expired yet count as stored).
    pub fn holds(&self, key: BlockKey) -> bool {
        let slab = &self.slab;
        self.map.find(key.0, |i| slab[i as usize].key.0).1
    }

    /// Whether `key` is stored and its TTL has not passed at `now`, without moving the clock:
    /// what [`Self::contains`] would answer, read-only (a store shared by the threads of a
    /// parallel run is read through this).
    #[inline]
    pub fn holds_at(&self, now: Nanos, key: BlockKey) -> bool {
        let slab = &self.slab;
        match self.map.get(key, |i| slab[i as usize].key.0) {
            Some(idx) => slab[idx as usize].expires > now.max(self.now),
            None => false,
        }
    }

    /// When the next object expires (`NEVER` if none will).
    pub fn next_expiry(&self) -> Nanos {
        (0..3)
            .map(|c| self.expiry[c].head)
            .filter(|&h| h != NIL)
            .map(|h| self.slab[h as usize].expires)
            .min()
            .unwrap_or(Nanos::NEVER)
    }

    /// Moves the store's clock to `now` and deletes every object whose TTL has passed.
    /// Time never goes backwards: an earlier `now` is treated as the current time.
    pub fn advance(&mut self, now: Nanos) {
        // The clock is finite: `NEVER` is not a time, and treating it as one would expire the
        // objects that never expire.
        let now = now.min(Nanos::MAX);
        if now > self.now {
            self.now = now;
        }
        for c in 0..3 {
            loop {
                let h = self.expiry[c].head;
                if h == NIL || self.slab[h as usize].expires > self.now {
                    break;
                }
                self.stats.expirations += 1;
                self.stats.expired_bytes += self.bytes_of(h);
                self.remove(h);
            }
        }
    }

    /// Starts loading the table slots of a run's first keys (the loop over the run prefetches
    /// the rest ahead of use); a run is often shorter than the prefetch distance.
    #[inline]
    fn prefetch_run(&self, keys: &[BlockKey]) {
        for k in &keys[..keys.len().min(PREFETCH_AHEAD)] {
            self.map.prefetch(k.0);
        }
    }

    /// Length of the leading run of `keys` held by the store (SPEC §3.1 prefix match).
    /// Lookups do not refresh recency: the request then touches what it uses.
    pub fn lookup_prefix(&mut self, now: Nanos, keys: &[BlockKey]) -> usize {
        self.advance(now);
        // Most look-ups (a session's next turn, past its memo) stop at their first key: the
        // run's slots are prefetched only once that one is found (the caller may have
        // prefetched it, see [`Self::prefetch`]), not sixteen at a time for nothing.
        let Some(first) = keys.first() else {
            return 0;
        };
        self.stats.block_lookups += 1;
        let slab = &self.slab;
        if !self.map.find(first.0, |i| slab[i as usize].key.0).1 {
            return 0;
        }
        let rest = &keys[1..];
        let mut run = 1;
        self.prefetch_run(rest);
        for (i, k) in rest.iter().enumerate() {
            if let Some(a) = rest.get(i + PREFETCH_AHEAD) {
                self.map.prefetch(a.0);
            }
            self.stats.block_lookups += 1;
            let slab = &self.slab;
            if self.map.find(k.0, |i| slab[i as usize].key.0).1 {
                run += 1;
            } else {
                break;
            }
        }
        self.stats.block_lookup_hits += run as u64;
        run
    }

    /// Asks the CPU to start loading the table slot where `key` would be found (a hint: a
    /// caller that will look it up soon overlaps the cache miss with other work).
    #[inline]
    pub fn prefetch(&self, key: BlockKey) {
        self.map.prefetch(key.0);
    }

    pub fn contains(&mut self, now: Nanos, key: BlockKey) -> bool {
        self.advance(now);
        let slab = &self.slab;
        self.map.find(key.0, |i| slab[i as usize].key.0).1
    }

    /// Touches the blocks present and writes the missing ones (each of `block_bytes`).
    pub fn touch_or_insert(&mut self, now: Nanos, keys: &[BlockKey], class: TrafficClass) {
        self.advance(now);
        self.map.reserve(keys.len());
        self.prefetch_run(keys);
        for (i, &k) in keys.iter().enumerate() {
            if let Some(a) = keys.get(i + PREFETCH_AHEAD) {
                self.map.prefetch(a.0);
            }
            self.put_at_now(k, self.block_bytes, class);
        }
    }

    /// Touches `key` or writes it as an object of `bytes` bytes. Returns true if written.
    pub fn put(&mut self, now: Nanos, key: BlockKey, bytes: u64, class: TrafficClass) -> bool {
        self.advance(now);
        self.put_at_now(key, bytes, class)
    }

    fn put_at_now(&mut self, key: BlockKey, bytes: u64, class: TrafficClass) -> bool {
        // KV accounting is exact integer arithmetic: an object whose bytes would overflow the
        // counters cannot be stored (every other counter, per node included, is at most the
        // bytes written).
        if self.stats.bytes_written.checked_add(bytes).is_none() {
            return false;
        }
        // A group that lost its objects cannot take new ones until enough of its nodes are back
        // (SPEC §7: 10 + 2 survives two failures). It has no objects to touch either.
        if self.nodes.any_lost() && self.nodes.is_lost(self.start_of(key)) {
            self.cluster.writes_refused += 1;
            self.cluster.writes_refused_bytes += bytes;
            return false;
        }
        if !self.tracks_lru() {
            return self.put_unbounded(key, bytes, class);
        }
        let slab = &self.slab;
        if let Some(idx) = self.map.get(key, |i| slab[i as usize].key.0) {
            self.touch_at_now(idx, class);
            return false;
        }
        let start = self.start_of(key);
        if !self.make_room(start, bytes) {
            // Cannot be stored at all: counted as written-and-dropped would lie, so skip.
            return false;
        }
        self.map.reserve(1);
        let idx = self.slot_for(key, bytes, class, start);
        let slab = &self.slab;
        let (at, _) = self.map.find(key.0, |i| slab[i as usize].key.0);
        self.map.fill(at, key, idx);
        self.link_new(idx, start, bytes);
        true
    }

    /// [`Self::put_at_now`] without a capacity: nothing is evicted between the probe and the
    /// insert, so one hash probe does both (the unbounded store is the simulator's hot path).
    fn put_unbounded(&mut self, key: BlockKey, bytes: u64, class: TrafficClass) -> bool {
        self.map.reserve(1);
        let slab = &self.slab;
        match self.map.find(key.0, |i| slab[i as usize].key.0) {
            (at, true) => {
                let idx = KeyTable::idx(self.map.slots[at]);
                self.touch_at_now(idx, class);
                false
            }
            (at, false) => {
                let start = self.start_of(key);
                let idx = self.slot_for(key, bytes, class, start);
                self.map.fill(at, key, idx);
                self.link_new(idx, start, bytes);
                true
            }
        }
    }

    fn touch_at_now(&mut self, idx: u32, class: TrafficClass) {
        self.stats.touches += 1;
        self.lru_unlink(idx);
        self.lru_push_back(idx);
        if self.cfg.ttl_from == TtlFrom::LastAccess {
            self.exp_unlink(idx);
            let expires = self.expiry_for(class);
            let e = &mut self.slab[idx as usize];
            e.class = class as u8;
            e.expires = expires;
            self.exp_push_back(idx);
        }
    }

    /// Stores a new entry in the slab (reusing a freed slot first) and returns its index;
    /// `start` is its group.
    fn slot_for(&mut self, key: BlockKey, bytes: u64, class: TrafficClass, start: u32) -> u32 {
        let entry = Entry {
            key,
            expires: self.expiry_for(class),
            exp_prev: NIL,
            exp_next: NIL,
            size: self.size_of(bytes),
            class: class as u8,
        };
        let recency = Recency { stamp: 0, start };
        match self.free.pop() {
            Some(i) => {
                self.slab[i as usize] = entry;
                if self.per_node {
                    self.recency[i as usize] = recency;
                }
                i
            }
            None => {
                self.slab.push(entry);
                if self.tracks_lru() {
                    self.lru_links.push(Link {
                        prev: NIL,
                        next: NIL,
                    });
                }
                if self.per_node {
                    self.recency.push(recency);
                }
                (self.slab.len() - 1) as u32
            }
        }
    }

    /// The index of object size `bytes` (blocks: 0).
    #[inline]
    fn size_of(&mut self, bytes: u64) -> u32 {
        if bytes == self.block_bytes {
            return 0;
        }
        let next = self.sizes.len() as u32;
        let i = *self.size_index.entry(bytes).or_insert(next);
        if i == next {
            self.sizes.push(bytes);
        }
        i
    }

    #[inline]
    fn bytes_of(&self, idx: u32) -> u64 {
        self.sizes[self.slab[idx as usize].size as usize]
    }

    /// Whether the store keeps LRU order: only a bounded store evicts.
    #[inline]
    fn tracks_lru(&self) -> bool {
        self.per_node || self.cfg.capacity_bytes.is_some()
    }

    /// Links a new entry into the LRU and expiry lists, charges it, and evicts past the high
    /// watermark.
    fn link_new(&mut self, idx: u32, start: u32, bytes: u64) {
        self.lru_push_back(idx);
        self.exp_push_back(idx);
        self.charge_nodes(start, bytes, true);
        self.stats.inserts += 1;
        self.stats.objects += 1;
        self.stats.bytes_written += bytes;
        self.stats.used_bytes += bytes;
        self.stats.peak_bytes = self.stats.peak_bytes.max(self.stats.used_bytes);
        self.record_writes(start, bytes);
        self.collect_after_insert(start);
    }

    /// The node where `key`'s group starts (the group's number).
    #[inline]
    pub fn start_of(&self, key: BlockKey) -> u32 {
        (key.0 % u64::from(self.cfg.storage_nodes)) as u32
    }

    /// The erasure-coded group that holds `key`: `data + parity` consecutive nodes starting at
    /// a node chosen by the key's hash, so placement is uniform and needs no directory.
    pub fn placement(&self, key: BlockKey) -> EcGroup {
        let n = self.cfg.storage_nodes;
        let first = self.start_of(key);
        let group = self.cfg.ec_data_shards + self.cfg.ec_parity_shards;
        EcGroup {
            nodes: (0..group).map(|i| StorageNodeId((first + i) % n)).collect(),
            data_shards: self.cfg.ec_data_shards,
        }
    }

    /// The nodes of [`Self::placement`] in the same order, without allocating (fetch path).
    pub fn placement_nodes(&self, key: BlockKey) -> impl Iterator<Item = StorageNodeId> + use<> {
        self.group_nodes(self.start_of(key))
    }

    /// The nodes of the group starting at node `first`, in placement order.
    #[inline]
    pub fn group_nodes(&self, first: u32) -> impl Iterator<Item = StorageNodeId> + use<> {
        let n = self.cfg.storage_nodes;
        let group = self.cfg.ec_data_shards + self.cfg.ec_parity_shards;
        // `first + i` wraps at most once (the group is no larger than the node count): a
        // compare instead of a division per node (the fetch path asks for 88 nodes a request).
        (first..first + group).map(move |i| StorageNodeId(if i >= n { i - n } else { i }))
    }

    /// The bytes of one node's shard of an object of `bytes` bytes.
    #[inline]
    fn share_of(&self, bytes: u64) -> u64 {
        bytes.div_ceil(u64::from(self.cfg.ec_data_shards))
    }

    /// Adds (or takes back) an object of `bytes` bytes in the group starting at `first` to the
    /// group's and its nodes' counters.
    fn charge_nodes(&mut self, first: u32, bytes: u64, add: bool) {
        let n = self.cfg.storage_nodes;
        let share = self.share_of(bytes);
        let (shares, objects) = (
            &mut self.start_shares[first as usize],
            &mut self.start_objects[first as usize],
        );
        if add {
            *shares += share;
            *objects += 1;
        } else {
            *shares -= share;
            *objects -= 1;
        }
        // The group is `first..first + group`, wrapping at most once (it is no larger than the
        // node count): two runs of consecutive counters, which the compiler vectorises.
        let (first, group) = (
            first as usize,
            (self.cfg.ec_data_shards + self.cfg.ec_parity_shards) as usize,
        );
        let (before, from) = self.node_bytes.split_at_mut(first);
        let wrapped = (first + group).saturating_sub(n as usize);
        for node in from[..group - wrapped]
            .iter_mut()
            .chain(&mut before[..wrapped])
        {
            if add {
                *node += share;
            } else {
                *node -= share;
            }
        }
    }

    fn expiry_for(&self, class: TrafficClass) -> Nanos {
        // A finite TTL gives a finite expiry (at worst `Nanos::MAX`, which a saturated clock
        // reaches); only a class without a TTL gets `NEVER`, which no clock reaches.
        match self.cfg.ttl.get(class) {
            Some(ttl) => self.now.saturating_add(ttl).min(Nanos::MAX),
            None => Nanos::NEVER,
        }
    }

    fn remove(&mut self, idx: u32) {
        self.lru_unlink(idx);
        self.exp_unlink(idx);
        let e = self.slab[idx as usize];
        let bytes = self.sizes[e.size as usize];
        let slab = &self.slab;
        self.map.remove(e.key, |i| slab[i as usize].key.0);
        let start = if self.per_node {
            self.recency[idx as usize].start
        } else {
            self.start_of(e.key)
        };
        self.charge_nodes(start, bytes, false);
        self.stats.used_bytes -= bytes;
        self.stats.objects -= 1;
        self.free.push(idx);
    }

    /// Makes `idx` the most recently used object (of the store, or of its group).
    fn lru_push_back(&mut self, idx: u32) {
        if !self.tracks_lru() {
            return;
        }
        let list = if self.per_node {
            let r = &mut self.recency[idx as usize];
            r.stamp = self.stamp_clock;
            self.stamp_clock += 1;
            &mut self.start_lru[r.start as usize]
        } else {
            &mut self.lru
        };
        let tail = list.tail;
        self.lru_links[idx as usize] = Link {
            prev: tail,
            next: NIL,
        };
        if tail == NIL {
            list.head = idx;
        } else {
            self.lru_links[tail as usize].next = idx;
        }
        list.tail = idx;
    }

    fn lru_unlink(&mut self, idx: u32) {
        if !self.tracks_lru() {
            return;
        }
        let list = if self.per_node {
            &mut self.start_lru[self.recency[idx as usize].start as usize]
        } else {
            &mut self.lru
        };
        let Link { prev: p, next: n } = self.lru_links[idx as usize];
        if p == NIL {
            list.head = n;
        } else {
            self.lru_links[p as usize].next = n;
        }
        if n == NIL {
            list.tail = p;
        } else {
            self.lru_links[n as usize].prev = p;
        }
    }

    fn exp_push_back(&mut self, idx: u32) {
        let c = self.slab[idx as usize].class as usize;
        let tail = self.expiry[c].tail;
        {
            let e = &mut self.slab[idx as usize];
            e.exp_prev = tail;
            e.exp_next = NIL;
        }
        if tail == NIL {
            self.expiry[c].head = idx;
        } else {
            self.slab[tail as usize].exp_next = idx;
        }
        self.expiry[c].tail = idx;
    }

    fn exp_unlink(&mut self, idx: u32) {
        let (p, n, c) = {
            let e = &self.slab[idx as usize];
            (e.exp_prev, e.exp_next, e.class as usize)
        };
        if p == NIL {
            self.expiry[c].head = n;
        } else {
            self.slab[p as usize].exp_next = n;
        }
        if n == NIL {
            self.expiry[c].tail = p;
        } else {
            self.slab[n as usize].exp_prev = p;
        }
    }
}
