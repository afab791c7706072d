//! The caches a serving unit reads and writes but does not own: the KV store, the SWA state
//! cache and the perfect cache (for the perfect-cache baselines). They live outside the unit
//! and are passed into every call, so several units can share one store.

use crate::content::BlockKey;
use crate::error::ConfigError;
use crate::ids::StorageNodeId;
use crate::perfect::PerfectCache;
use crate::request::TrafficClass;
use crate::store::window::StoreWindow;
use crate::store::{KvStore, StoreConfig};
use crate::swa::{SwaCache, SwaConfig};
use crate::time::Nanos;
use std::ops::Deref;

pub struct SharedCache {
    pub store: StoreAccess,
    pub swa: SwaCache,
    pub perfect: PerfectCache,
}

/// How a unit reaches the KV store: the store itself (one unit, or the units of a cluster
/// run one input at a time), or its view of a store shared with units on other threads for
/// one window of a parallel run ([`crate::store::window`]). Reads that do not move the store's
/// clock go through `Deref`; the calls below are the ones a unit makes.
// One per unit, and the owned store is the single-unit hot path: a box would add an
// indirection to every lookup for no memory worth saving.
#[allow(clippy::large_enum_variant)]
pub enum StoreAccess {
    Owned(KvStore),
    Window(StoreWindow),
}

impl Deref for StoreAccess {
    type Target = KvStore;
    #[inline]
    fn deref(&self) -> &KvStore {
        match self {
            StoreAccess::Owned(s) => s,
            StoreAccess::Window(w) => w.base(),
        }
    }
}

impl StoreAccess {
    /// The store itself, where the unit owns it (failures, repairs and reports need it).
    #[inline]
    pub fn owned_mut(&mut self) -> Option<&mut KvStore> {
        match self {
            StoreAccess::Owned(s) => Some(s),
            StoreAccess::Window(_) => None,
        }
    }
    /// The window, in a parallel run.
    pub fn window_mut(&mut self) -> Option<&mut StoreWindow> {
        match self {
            StoreAccess::Owned(_) => None,
            StoreAccess::Window(w) => Some(w),
        }
    }
    /// The store, where the unit owns it.
    ///
    /// # Panics
    /// On a window: the callers (reports at the end of a run) run after the cluster took
    /// the store back.
    pub fn into_owned(self) -> KvStore {
        match self {
            StoreAccess::Owned(s) => s,
            StoreAccess::Window(_) => panic!("a store window has no store of its own"),
        }
    }
    /// [`KvStore::advance`]; a window deletes nothing (its merge does).
    #[inline]
    pub fn advance(&mut self, now: Nanos) {
        match self {
            StoreAccess::Owned(s) => s.advance(now),
            StoreAccess::Window(w) => w.advance(now),
        }
    }
    #[inline]
    pub fn lookup_prefix(&mut self, now: Nanos, keys: &[BlockKey]) -> usize {
        match self {
            StoreAccess::Owned(s) => s.lookup_prefix(now, keys),
            StoreAccess::Window(w) => w.lookup_prefix(now, keys),
        }
    }
    #[inline]
    pub fn contains(&mut self, now: Nanos, key: BlockKey) -> bool {
        match self {
            StoreAccess::Owned(s) => s.contains(now, key),
            StoreAccess::Window(w) => w.contains(now, key),
        }
    }
    #[inline]
    pub fn touch_or_insert(&mut self, now: Nanos, keys: &[BlockKey], class: TrafficClass) {
        match self {
            StoreAccess::Owned(s) => s.touch_or_insert(now, keys, class),
            StoreAccess::Window(w) => w.touch_or_insert(now, keys, class),
        }
    }
    #[inline]
    pub fn put(&mut self, now: Nanos, key: BlockKey, bytes: u64, class: TrafficClass) -> bool {
        match self {
            StoreAccess::Owned(s) => s.put(now, key, bytes, class),
            StoreAccess::Window(w) => w.put(now, key, bytes, class),
        }
    }
    #[inline]
    pub fn used_bytes(&self) -> u64 {
        match self {
            StoreAccess::Owned(s) => s.used_bytes(),
            StoreAccess::Window(w) => w.used_bytes(),
        }
    }
    #[inline]
    pub fn change_generation(&self) -> u64 {
        match self {
            StoreAccess::Owned(s) => s.change_generation(),
            StoreAccess::Window(w) => w.change_generation(),
        }
    }
    /// [`KvStore::drain_node_writes`]: a window hands over its unit's writes of the last
    /// merge.
    #[inline]
    pub fn drain_node_writes(&mut self, f: impl FnMut(StorageNodeId, u64)) {
        match self {
            StoreAccess::Owned(s) => s.drain_node_writes(f),
            StoreAccess::Window(w) => w.drain_node_writes(f),
        }
    }
    /// [`KvStore::reserve`] (a hint; a window reserves nothing).
    pub fn reserve(&mut self, objects: usize) {
        if let StoreAccess::Owned(s) = self {
            s.reserve(objects);
        }
    }
}

impl SharedCache {
    pub fn new(store: StoreConfig, swa: SwaConfig, block_bytes: u64) -> Result<Self, ConfigError> {
        Ok(SharedCache {
            store: StoreAccess::Owned(KvStore::new(store, block_bytes)?),
            swa: SwaCache::new(swa)?,
            perfect: PerfectCache::new(),
        })
    }

    /// Changes of the store after which a block once found or written may be missing
    /// (evictions, expirations, objects lost with their group, refused writes, and in a
    /// parallel run's window, the clock passing an expiry): while it does not change, a block found present is still present.
    pub fn generation(&self) -> u64 {
        self.store.change_generation()
    }

    /// Every invariant of the store and the SWA cache.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.swa.check_invariants()?;
        self.store.check_invariants()
    }
}
