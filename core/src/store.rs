//! The KV cache store of SPEC §7: capacity in bytes, TTL per traffic class set on the storage
//! side, LRU eviction past a high watermark down to a low watermark, 10+2 erasure-coded
//! placement on storage nodes.
//!
//! The hot path (prefix lookups and writes of runs of blocks) is a probe per block in an
//! open-addressing table keyed by the block hash; LRU order and expiry order are intrusive lists
//! inside one slab, so nothing allocates per lookup. With tens of millions of blocks every probe
//! is a cache miss, so runs of keys prefetch their slots a few keys ahead.

use crate::content::{BlockKey, mix64};
use crate::error::ConfigError;
use crate::ids::StorageNodeId;
use crate::request::TrafficClass;
use crate::time::Nanos;
use serde::{Deserialize, Serialize};

const NIL: u32 = u32::MAX;
/// The most storage nodes a store accounts for (a byte counter each): far beyond the 180 of
/// SPEC §7, small enough that a mistyped count cannot take the machine's memory.
pub const MAX_STORAGE_NODES: u32 = 1 << 20;
/// How many keys ahead a run of lookups or writes prefetches its table slots: enough to overlap
/// the misses of a run, few enough that the lines are still cached when used.
const PREFETCH_AHEAD: usize = 16;

/// Block key → slab index, open addressing with linear probing and backward-shift deletion.
/// A slot is 8 bytes: the high 32 bits of the key's spread hash above the slab index + 1 (0 =
/// empty), so eight slots share a cache line and the table of tens of millions of blocks is
/// half the memory (and half the page faults while it grows). The probe start is the top bits
/// of the same hash, so growing and backward-shift deletion work from the slots alone; a hash
/// match is confirmed against the full key in the slab, which a hit then touches anyway. Block
/// keys are already uniform hashes; one multiply spreads them over the table. Unlike a general-purpose map it
/// exposes where a key's probe starts, so runs can prefetch it.
#[derive(Clone, Debug)]
struct KeyTable {
    slots: Vec<u64>,
    shift: u32,
    len: usize,
}

impl KeyTable {
    const MIN_BITS: u32 = 4;

    fn new() -> Self {
        KeyTable {
            slots: vec![0; 1 << Self::MIN_BITS],
            shift: 64 - Self::MIN_BITS,
            len: 0,
        }
    }
    fn len(&self) -> usize {
        self.len
    }
    #[inline]
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }
    const HASH_BITS: u64 = !0xffff_ffff;
    #[inline]
    fn hash(key: u64) -> u64 {
        key.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }
    #[inline]
    fn home(&self, key: u64) -> usize {
        (Self::hash(key) >> self.shift) as usize
    }
    /// A full slot's probe start (the table never has more than 2^32 slots).
    #[inline]
    fn slot_home(&self, slot: u64) -> usize {
        (slot >> self.shift) as usize
    }
    #[inline]
    fn pack(key: u64, idx: u32) -> u64 {
        (Self::hash(key) & Self::HASH_BITS) | (u64::from(idx) + 1)
    }
    /// The slab index a full slot holds.
    #[inline]
    fn idx(slot: u64) -> u32 {
        (slot as u32).wrapping_sub(1)
    }
    /// Asks the CPU to start loading `key`'s first slot.
    #[inline]
    fn prefetch(&self, key: u64) {
        #[cfg(target_arch = "x86_64")]
        {
            let p = self.slots.as_ptr().wrapping_add(self.home(key));
            // SAFETY: SSE is part of the x86_64 baseline, and a prefetch never dereferences its
            // address architecturally: it cannot fault and only warms the cache.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast());
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = key;
    }
    /// The slot holding `key`, or the empty slot where it would go; `key_of` gives the full key
    /// stored at a slab index.
    #[inline]
    fn find(&self, key: u64, key_of: impl Fn(u32) -> u64) -> (usize, bool) {
        let mask = self.mask();
        let fp = Self::hash(key) & Self::HASH_BITS;
        let mut i = self.home(key);
        loop {
            let s = self.slots[i];
            if s == 0 {
                return (i, false);
            }
            if s & Self::HASH_BITS == fp && key_of(Self::idx(s)) == key {
                return (i, true);
            }
            i = (i + 1) & mask;
        }
    }
    #[inline]
    fn get(&self, key: BlockKey, key_of: impl Fn(u32) -> u64) -> Option<u32> {
        match self.find(key.0, key_of) {
            (i, true) => Some(Self::idx(self.slots[i])),
            _ => None,
        }
    }
    /// Grows (at most 3/4 full keeps probes within a line) so `more` keys fit; a run grows the
    /// table before its slots are prefetched.
    #[inline]
    fn reserve(&mut self, more: usize) {
        if (self.len + more) * 4 > self.slots.len() * 3 {
            self.grow(self.len + more);
        }
    }
    /// `n` empty slots, written once in order. A zeroed allocation (`vec![0; n]`) maps the
    /// shared zero page on each page's first probe (a read) and faults again, copying, on its
    /// first write: on a table of hundreds of MB that doubles the page faults, and the faults
    /// were most of the cost of growing. One sequential pass faults each page once.
    #[allow(clippy::slow_vector_initialization)] // on purpose: `vec![0; n]` faults twice
    fn zeroed(n: usize) -> Vec<u64> {
        let mut v = Vec::with_capacity(n);
        v.resize(n, 0);
        v
    }
    /// Rebuilds the table at the smallest power-of-two size that holds `keys` keys at most 3/4
    /// full, in one pass (reserving for many keys does not rebuild at every doubling).
    #[cold]
    fn grow(&mut self, keys: usize) {
        let mut bits = 64 - self.shift;
        while keys * 4 > (3usize << bits) {
            bits += 1;
        }
        assert!(bits <= 32, "key table past 2^32 slots");
        let old = std::mem::replace(&mut self.slots, Self::zeroed(1 << bits));
        self.shift = 64 - bits;
        let mask = self.mask();
        for s in old.into_iter().filter(|&s| s != 0) {
            let mut i = self.slot_home(s);
            while self.slots[i] != 0 {
                i = (i + 1) & mask;
            }
            self.slots[i] = s;
        }
    }
    /// Stores `idx` in the empty slot `at` found by [`Self::find`] after [`Self::reserve`].
    #[inline]
    fn fill(&mut self, at: usize, key: BlockKey, idx: u32) {
        self.slots[at] = Self::pack(key.0, idx);
        self.len += 1;
    }
    fn remove(&mut self, key: BlockKey, key_of: impl Fn(u32) -> u64) -> Option<u32> {
        let (mut hole, found) = self.find(key.0, &key_of);
        if !found {
            return None;
        }
        let idx = Self::idx(self.slots[hole]);
        let mask = self.mask();
        let mut j = hole;
        // Backward shift: move later entries of the cluster into the hole when their probe
        // start is not between the hole and where they sit.
        loop {
            j = (j + 1) & mask;
            let s = self.slots[j];
            if s == 0 {
                break;
            }
            let home = self.slot_home(s);
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.slots[hole] = s;
                hole = j;
            }
        }
        self.slots[hole] = 0;
        self.len -= 1;
        Some(idx)
    }
    /// (whether `key_of` gives a key matching the slot, slab index) of every stored key.
    #[cfg(test)]
    fn iter<'a>(
        &'a self,
        key_of: impl Fn(u32) -> u64 + 'a,
    ) -> impl Iterator<Item = (bool, u32)> + 'a {
        self.slots.iter().filter(|&&s| s != 0).map(move |&s| {
            let idx = Self::idx(s);
            (Self::pack(key_of(idx), idx) == s, idx)
        })
    }
}

/// TTL per traffic class; a missing class never expires.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassTtl {
    #[serde(default)]
    pub agent: Option<Nanos>,
    #[serde(default)]
    pub chat: Option<Nanos>,
    #[serde(default)]
    pub other: Option<Nanos>,
}

impl ClassTtl {
    /// SPEC §7: 3 days for agent traffic, 7 days for chat. The brief is silent on other traffic
    /// (documents): 3 days, the cheaper of the two.
    pub fn published() -> Self {
        ClassTtl {
            agent: Some(Nanos::from_secs(3 * 86_400)),
            chat: Some(Nanos::from_secs(7 * 86_400)),
            other: Some(Nanos::from_secs(3 * 86_400)),
        }
    }
    pub fn none() -> Self {
        ClassTtl {
            agent: None,
            chat: None,
            other: None,
        }
    }
    pub fn uniform(ttl: Option<Nanos>) -> Self {
        ClassTtl {
            agent: ttl,
            chat: ttl,
            other: ttl,
        }
    }
    pub fn get(&self, class: TrafficClass) -> Option<Nanos> {
        match class {
            TrafficClass::Agent => self.agent,
            TrafficClass::Chat => self.chat,
            TrafficClass::Other => self.other,
        }
    }
}

impl Default for ClassTtl {
    fn default() -> Self {
        Self::published()
    }
}

/// What a TTL counts from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum TtlFrom {
    /// Every read or write restarts the clock (a block in constant use never expires).
    #[default]
    LastAccess,
    /// Only writes set the clock (file-age TTL on the storage side).
    Write,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// Logical KV bytes the store may hold (before erasure coding); absent = unbounded.
    pub capacity_bytes: Option<u64>,
    /// GC starts evicting in LRU order when usage exceeds this share of capacity…
    pub high_watermark: f64,
    /// …and stops when usage is back at or below this share.
    pub low_watermark: f64,
    pub ttl: ClassTtl,
    pub ttl_from: TtlFrom,
    /// Storage nodes in the cluster (100 PiB / 20 × 30.73 TB ≈ 180 servers).
    pub storage_nodes: u32,
    pub ec_data_shards: u32,
    pub ec_parity_shards: u32,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            capacity_bytes: None,
            high_watermark: 0.95,
            low_watermark: 0.90,
            ttl: ClassTtl::published(),
            ttl_from: TtlFrom::LastAccess,
            storage_nodes: 180,
            ec_data_shards: 10,
            ec_parity_shards: 2,
        }
    }
}

impl StoreConfig {
    pub fn validate(&self, block_bytes: u64) -> Result<(), ConfigError> {
        let bad = |f: &str, why: String| Err(ConfigError::invalid(format!("store.{f}"), why));
        if !(self.low_watermark > 0.0
            && self.low_watermark <= self.high_watermark
            && self.high_watermark <= 1.0)
        {
            return bad(
                "high_watermark",
                format!(
                    "need 0 < low_watermark ({}) <= high_watermark ({}) <= 1",
                    self.low_watermark, self.high_watermark
                ),
            );
        }
        if let Some(cap) = self.capacity_bytes
            && cap < block_bytes
        {
            return bad(
                "capacity_bytes",
                format!("{cap} bytes cannot hold one block of {block_bytes} bytes"),
            );
        }
        if self.ec_data_shards == 0 {
            return bad("ec_data_shards", "must be positive".into());
        }
        if self.storage_nodes > MAX_STORAGE_NODES {
            return bad(
                "storage_nodes",
                format!(
                    "{} nodes is more than the {MAX_STORAGE_NODES} the store accounts for \
                     (one byte counter per node)",
                    self.storage_nodes
                ),
            );
        }
        let Some(group) = self.ec_data_shards.checked_add(self.ec_parity_shards) else {
            return bad(
                "ec_parity_shards",
                format!(
                    "{} data + {} parity shards overflows",
                    self.ec_data_shards, self.ec_parity_shards
                ),
            );
        };
        if self.storage_nodes < group {
            return bad(
                "storage_nodes",
                format!(
                    "{} nodes cannot hold a {group}-node erasure-coded group",
                    self.storage_nodes
                ),
            );
        }
        for class in TrafficClass::ALL {
            let field = format!("ttl.{}", class.name());
            match self.ttl.get(class) {
                Some(Nanos::ZERO) => {
                    return bad(
                        &field,
                        "a zero TTL would expire blocks as they are written".into(),
                    );
                }
                Some(t) if t > Nanos::HORIZON => {
                    return bad(
                        &field,
                        format!(
                            "{t} is beyond the horizon of 146 years: leave the class out for \
                             blocks that never expire"
                        ),
                    );
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Physical bytes on SSD per logical byte (12 / 10 with 10+2 coding).
    pub fn ec_overhead(&self) -> f64 {
        f64::from(self.ec_data_shards + self.ec_parity_shards) / f64::from(self.ec_data_shards)
    }
}

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
    lru: List,
    /// One expiry list per class: with a constant TTL per class and non-decreasing `now`,
    /// append order is expiry order.
    expiry: [List; 3],
    node_bytes: Vec<u64>,
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
        Ok(KvStore {
            node_bytes: vec![0; cfg.storage_nodes as usize],
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
    }
    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }
    /// Logical bytes held per storage node (each node of a group holds 1/data of an object).
    pub fn node_bytes(&self) -> &[u64] {
        &self.node_bytes
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
        if self.cfg.capacity_bytes.is_none() {
            return self.put_unbounded(key, bytes, class);
        }
        let slab = &self.slab;
        if let Some(idx) = self.map.get(key, |i| slab[i as usize].key.0) {
            self.touch_at_now(idx, class);
            return false;
        }
        let cap = self.cfg.capacity_bytes.unwrap_or(u64::MAX);
        if bytes > cap {
            // Cannot be stored at all: counted as written-and-dropped would lie, so skip.
            return false;
        }
        while self.stats.used_bytes + bytes > cap {
            if !self.evict_one() {
                break;
            }
        }
        self.map.reserve(1);
        let idx = self.slot_for(key, bytes, class);
        let slab = &self.slab;
        let (at, _) = self.map.find(key.0, |i| slab[i as usize].key.0);
        self.map.fill(at, key, idx);
        self.link_new(idx, key, bytes);
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
                let idx = self.slot_for(key, bytes, class);
                self.map.fill(at, key, idx);
                self.link_new(idx, key, bytes);
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

    /// Stores a new entry in the slab (reusing a freed slot first) and returns its index.
    fn slot_for(&mut self, key: BlockKey, bytes: u64, class: TrafficClass) -> u32 {
        let entry = Entry {
            key,
            expires: self.expiry_for(class),
            exp_prev: NIL,
            exp_next: NIL,
            size: self.size_of(bytes),
            class: class as u8,
        };
        match self.free.pop() {
            Some(i) => {
                self.slab[i as usize] = entry;
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

    #[inline]
    fn tracks_lru(&self) -> bool {
        self.cfg.capacity_bytes.is_some()
    }

    /// Links a new entry into the LRU and expiry lists, charges it, and evicts past the high
    /// watermark.
    fn link_new(&mut self, idx: u32, key: BlockKey, bytes: u64) {
        self.lru_push_back(idx);
        self.exp_push_back(idx);
        self.charge_nodes(key, bytes, true);
        self.stats.inserts += 1;
        self.stats.objects += 1;
        self.stats.bytes_written += bytes;
        self.stats.used_bytes += bytes;
        self.stats.peak_bytes = self.stats.peak_bytes.max(self.stats.used_bytes);
        if self.stats.used_bytes > self.high_bytes {
            while self.stats.used_bytes > self.low_bytes {
                if !self.evict_one() {
                    break;
                }
            }
        }
    }

    /// The erasure-coded group that holds `key`: `data + parity` consecutive nodes starting at
    /// a node chosen by the key's hash, so placement is uniform and needs no directory.
    pub fn placement(&self, key: BlockKey) -> EcGroup {
        let n = self.cfg.storage_nodes;
        let first = (key.0 % u64::from(n)) as u32;
        let group = self.cfg.ec_data_shards + self.cfg.ec_parity_shards;
        EcGroup {
            nodes: (0..group).map(|i| StorageNodeId((first + i) % n)).collect(),
            data_shards: self.cfg.ec_data_shards,
        }
    }

    /// The nodes of [`Self::placement`] in the same order, without allocating (fetch path).
    pub fn placement_nodes(&self, key: BlockKey) -> impl Iterator<Item = StorageNodeId> + use<> {
        let n = self.cfg.storage_nodes;
        let first = (key.0 % u64::from(n)) as u32;
        let group = self.cfg.ec_data_shards + self.cfg.ec_parity_shards;
        // `first + i` wraps at most once (the group is no larger than the node count): a
        // compare instead of a division per node (the fetch path asks for 88 nodes a request).
        (first..first + group).map(move |i| StorageNodeId(if i >= n { i - n } else { i }))
    }

    fn charge_nodes(&mut self, key: BlockKey, bytes: u64, add: bool) {
        let n = self.cfg.storage_nodes;
        let first = (key.0 % u64::from(n)) as u32;
        let share = bytes.div_ceil(u64::from(self.cfg.ec_data_shards));
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

    fn evict_one(&mut self) -> bool {
        let h = self.lru.head;
        if h == NIL {
            return false;
        }
        self.stats.evictions += 1;
        self.stats.evicted_bytes += self.bytes_of(h);
        self.remove(h);
        true
    }

    fn remove(&mut self, idx: u32) {
        self.lru_unlink(idx);
        self.exp_unlink(idx);
        let e = self.slab[idx as usize];
        let bytes = self.sizes[e.size as usize];
        let slab = &self.slab;
        self.map.remove(e.key, |i| slab[i as usize].key.0);
        self.charge_nodes(e.key, bytes, false);
        self.stats.used_bytes -= bytes;
        self.stats.objects -= 1;
        self.free.push(idx);
    }

    fn lru_push_back(&mut self, idx: u32) {
        if !self.tracks_lru() {
            return;
        }
        let tail = self.lru.tail;
        self.lru_links[idx as usize] = Link {
            prev: tail,
            next: NIL,
        };
        if tail == NIL {
            self.lru.head = idx;
        } else {
            self.lru_links[tail as usize].next = idx;
        }
        self.lru.tail = idx;
    }

    fn lru_unlink(&mut self, idx: u32) {
        if !self.tracks_lru() {
            return;
        }
        let Link { prev: p, next: n } = self.lru_links[idx as usize];
        if p == NIL {
            self.lru.head = n;
        } else {
            self.lru_links[p as usize].next = n;
        }
        if n == NIL {
            self.lru.tail = p;
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

    /// Checks the structure against its counters; used by tests and at the end of every
    /// simulation (not per event: on a store of tens of millions of blocks one check costs
    /// seconds).
    pub fn check_invariants(&self) -> Result<(), String> {
        // The slots holding an object: those on the LRU list when the store keeps one (its
        // links checked on the way), else every slot not on the free list. The map is then
        // checked against them with one sequential pass over the map instead of a random hash
        // probe per object.
        let n = self.slab.len();
        let mut listed = vec![0u64; n.div_ceil(64)];
        if self.tracks_lru() {
            if self.lru_links.len() != n {
                return Err("LRU links do not cover the slab".into());
            }
            let (mut i, mut prev) = (self.lru.head, NIL);
            while i != NIL {
                let Some(l) = self.lru_links.get(i as usize) else {
                    return Err("LRU link past the slab".into());
                };
                if l.prev != prev {
                    return Err("broken LRU back link".into());
                }
                if listed[i as usize / 64] & (1 << (i % 64)) != 0 {
                    return Err("LRU list has a cycle".into());
                }
                listed[i as usize / 64] |= 1 << (i % 64);
                prev = i;
                i = l.next;
            }
            if self.lru.tail != prev {
                return Err("LRU tail is not the list's last object".into());
            }
            for &f in &self.free {
                if listed
                    .get(f as usize / 64)
                    .is_none_or(|w| w & (1 << (f % 64)) != 0)
                {
                    return Err("a free slot is on the LRU list".into());
                }
            }
        } else {
            listed.fill(!0);
            if !n.is_multiple_of(64) {
                listed[n / 64] = (1 << (n % 64)) - 1;
            }
            for &f in &self.free {
                let Some(w) = listed.get_mut(f as usize / 64) else {
                    return Err("free slot past the slab".into());
                };
                if *w & (1 << (f % 64)) == 0 {
                    return Err("a slot is freed twice".into());
                }
                *w &= !(1 << (f % 64));
            }
        }
        let mut count = 0u64;
        let mut bytes = 0u64;
        // Σ mix64 of the map slot each listed object should have (fingerprint and index).
        let mut want_slots = 0u64;
        for i in set_bits(&listed) {
            let e = &self.slab[i as usize];
            if e.expires <= self.now {
                return Err(format!(
                    "object {:?} is past its TTL but still stored",
                    e.key
                ));
            }
            let Some(&size) = self.sizes.get(e.size as usize) else {
                return Err(format!("object {:?} has no size", e.key));
            };
            count += 1;
            bytes += size;
            want_slots = want_slots.wrapping_add(mix64(KeyTable::pack(e.key.0, i)));
        }
        if count + self.free.len() as u64 != n as u64 {
            return Err("slab slots neither stored nor free".into());
        }
        if count != self.map.len() as u64 || count != self.stats.objects {
            return Err(format!("{count} objects in LRU, {} in map", self.map.len()));
        }
        // The map names each listed slot exactly once (as many entries as listed slots, each
        // naming a distinct listed slot), and its entries carry the fingerprints of the listed
        // keys: the sums of mix64 over the slots the map holds and over the slots the list
        // implies agree (a wrong fingerprint changes the sum but for a 2^-64 chance). One
        // sequential pass over the map, reading nothing else: checking each entry's key in the
        // slab instead costs a cache and TLB miss per object on a GiB-sized slab.
        // The slots the map names go in a second bitmap (in hash order, so one random access
        // per entry: reading the listed bitmap there too doubled them); named twice is caught
        // there, and named but not listed by comparing the bitmaps word by word after.
        let mut named = vec![0u64; listed.len()];
        let mut have_slots = 0u64;
        for &slot in self.map.slots.iter().filter(|&&s| s != 0) {
            let idx = KeyTable::idx(slot);
            let (w, bit) = (idx as usize / 64, 1u64 << (idx % 64));
            let Some(word) = named.get_mut(w) else {
                return Err("map entry past the slab".into());
            };
            if *word & bit != 0 {
                return Err("two map entries name one object".into());
            }
            *word |= bit;
            have_slots = have_slots.wrapping_add(mix64(slot));
        }
        if named != listed {
            return Err("LRU entry missing from map".into());
        }
        if have_slots != want_slots {
            return Err("map entry does not match its object's key".into());
        }
        if bytes != self.stats.used_bytes {
            return Err(format!(
                "{bytes} bytes listed, {} counted",
                self.stats.used_bytes
            ));
        }
        if let Some(cap) = self.cfg.capacity_bytes
            && bytes > cap
        {
            return Err(format!("{bytes} bytes stored over capacity {cap}"));
        }
        let node_total: u128 = self.node_bytes.iter().map(|&b| u128::from(b)).sum();
        let group = u128::from(self.cfg.ec_data_shards) + u128::from(self.cfg.ec_parity_shards);
        let bytes128 = u128::from(bytes);
        if node_total < bytes128
            || node_total
                > (bytes128 + u128::from(count) * u128::from(self.cfg.ec_data_shards)) * group
        {
            return Err("node accounting drifted".into());
        }
        // Expiry lists: one pass over the listed slots in slab order checks every link
        // (successor in order, of the same class, linking back; ends at the list's head and
        // tail), so every list walked from its head is in order. Its reads of successors are
        // independent of each other, unlike a walk of the list, which waits on one cache miss
        // per object.
        let is_listed = |i: u32| {
            listed
                .get(i as usize / 64)
                .is_some_and(|w| w & (1 << (i % 64)) != 0)
        };
        for i in set_bits(&listed) {
            let e = &self.slab[i as usize];
            let c = e.class as usize;
            if c >= self.expiry.len() {
                return Err(format!("object {:?} has no expiry class", e.key));
            }
            if e.exp_prev == NIL && self.expiry[c].head != i {
                return Err("expiry list has two heads".into());
            }
            if e.exp_next == NIL {
                if self.expiry[c].tail != i {
                    return Err("expiry list has two tails".into());
                }
                continue;
            }
            if !is_listed(e.exp_next) {
                return Err("expiry link to an object not stored".into());
            }
            let n = &self.slab[e.exp_next as usize];
            if n.exp_prev != i || n.class != e.class {
                return Err("broken expiry back link".into());
            }
            if n.expires < e.expires {
                return Err("expiry list out of order".into());
            }
        }
        for list in &self.expiry {
            if list.head != NIL
                && (!is_listed(list.head) || self.slab[list.head as usize].exp_prev != NIL)
            {
                return Err("expiry list head is not a stored object".into());
            }
        }
        Ok(())
    }
}

/// Indices of the set bits of a bitmap, in ascending order.
fn set_bits(words: &[u64]) -> impl Iterator<Item = u32> + '_ {
    words.iter().enumerate().flat_map(|(w, &word)| {
        let mut bits = word;
        std::iter::from_fn(move || {
            (bits != 0).then(|| {
                let i = (w * 64) as u32 + bits.trailing_zeros();
                bits &= bits - 1;
                i
            })
        })
    })
}

#[cfg(test)]
mod tests {
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
}
