//! The caches a serving unit reads and writes but does not own: the KV store, the SWA state
//! cache and the perfect cache (for the perfect-cache baselines). They live outside the unit
//! and are passed into every call, so several units can share one store.

use crate::error::ConfigError;
use crate::perfect::PerfectCache;
use crate::store::{KvStore, StoreConfig};
use crate::swa::{SwaCache, SwaConfig};

pub struct SharedCache {
    pub store: KvStore,
    pub swa: SwaCache,
    pub perfect: PerfectCache,
}

impl SharedCache {
    pub fn new(store: StoreConfig, swa: SwaConfig, block_bytes: u64) -> Result<Self, ConfigError> {
        Ok(SharedCache {
            store: KvStore::new(store, block_bytes)?,
            swa: SwaCache::new(swa)?,
            perfect: PerfectCache::new(),
        })
    }

    /// Changes of the store after which a block once found or written may be missing
    /// (evictions, expirations, objects lost with their group, refused writes): while it does
    /// not change, a block found present is still present.
    pub fn generation(&self) -> u64 {
        self.store.change_generation()
    }

    /// Every invariant of the store and the SWA cache.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.swa.check_invariants()?;
        self.store.check_invariants()
    }
}
