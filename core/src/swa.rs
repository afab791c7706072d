//! The SWA state cache of SPEC §5: one fixed-size slot per stored state in the host memory of
//! the machine that produced it, a lifetime of about 3 minutes, and an in-memory directory of
//! which machine holds the state for which prefix.

use crate::content::{BlockKey, prefetch_read};
use crate::error::ConfigError;
use crate::ids::MachineId;
use crate::time::Nanos;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// The most SWA slots (all machines together) a cache preallocates: 2^26, about 2.3 GB of
/// bookkeeping and 95 TB of host memory at SPEC §5's 1.4 MB a state (the shipped configs use
/// 800,000).
pub const MAX_SWA_SLOTS: u64 = 1 << 26;
/// Bookkeeping per slot: the slot, its free-list entry and order entry, and its directory share.
const SLOT_BOOKKEEPING_BYTES: u64 = 36;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SwaConfig {
    /// Machines whose host memory holds SWA slots (prefill machines of one unit: 64 GPUs / 8).
    pub machines: u32,
    /// Slots per machine. At 1,415,040 bytes a slot, 100,000 slots are 141 GB of host memory.
    pub slots_per_machine: u32,
    /// A state is dropped this long after it was stored.
    pub lifetime: Nanos,
}

impl Default for SwaConfig {
    fn default() -> Self {
        SwaConfig {
            machines: 8,
            slots_per_machine: 100_000,
            lifetime: Nanos::from_secs(180),
        }
    }
}

impl SwaConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.machines == 0 {
            return Err(ConfigError::invalid("swa.machines", "must be positive"));
        }
        if self.slots_per_machine == 0 {
            return Err(ConfigError::invalid(
                "swa.slots_per_machine",
                "must be positive",
            ));
        }
        let total = u64::from(self.machines) * u64::from(self.slots_per_machine);
        if total > MAX_SWA_SLOTS {
            return Err(ConfigError::invalid(
                "swa.slots_per_machine",
                format!(
                    "{} machines × {} slots = {total} slots is more than the {MAX_SWA_SLOTS} \
                     the cache preallocates (about {} bytes of bookkeeping each)",
                    self.machines, self.slots_per_machine, SLOT_BOOKKEEPING_BYTES
                ),
            ));
        }
        if self.lifetime == Nanos::ZERO {
            return Err(ConfigError::invalid("swa.lifetime", "must be positive"));
        }
        if self.lifetime > Nanos::HORIZON {
            return Err(ConfigError::invalid(
                "swa.lifetime",
                format!("{} is beyond the horizon of 146 years", self.lifetime),
            ));
        }
        Ok(())
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SwaStats {
    pub stores: u64,
    pub refreshes: u64,
    pub lookups: u64,
    pub hits: u64,
    pub expirations: u64,
    pub evictions: u64,
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    key: BlockKey,
    stored_at: Nanos,
}

/// One machine's share of the slots. Slot numbers are global (machine × slots per machine +
/// slot), the index the directory stores.
#[derive(Clone, Debug)]
struct Machine {
    free: Vec<u32>,
    /// Slots in storing order (= expiry order, since the lifetime is constant); stale entries
    /// (slot reused or refreshed since) are skipped by comparing `stored_at`.
    order: VecDeque<(u32, Nanos)>,
    used: u32,
}

/// One directory entry: a prefix key and the global slot holding its state, plus one (0 =
/// empty).
#[derive(Clone, Copy, Debug, Default)]
struct DirSlot {
    key: u64,
    at: u32,
}

/// Prefix key → global slot: open addressing with linear probing and backward-shift deletion,
/// the full key in each 16-byte entry. With over a million states a probe is a cache miss; a
/// general hash map read a control group and then a bucket, and a table of fingerprints must
/// confirm a match in the slot array (a second miss): this one answers from one line. Keys are
/// uniform hashes already: one multiply spreads them.
#[derive(Clone, Debug)]
struct SwaDir {
    slots: Vec<DirSlot>,
    shift: u32,
    len: usize,
}

impl SwaDir {
    const MIN_BITS: u32 = 4;

    fn new() -> Self {
        SwaDir {
            slots: vec![DirSlot::default(); 1 << Self::MIN_BITS],
            shift: 64 - Self::MIN_BITS,
            len: 0,
        }
    }
    #[inline]
    fn home(&self, key: u64) -> usize {
        (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> self.shift) as usize
    }
    /// The entry holding `key`, or the empty one where it would go.
    #[inline]
    fn find(&self, key: u64) -> (usize, bool) {
        let mask = self.slots.len() - 1;
        let mut i = self.home(key);
        loop {
            let s = self.slots[i];
            if s.at == 0 {
                return (i, false);
            }
            if s.key == key {
                return (i, true);
            }
            i = (i + 1) & mask;
        }
    }
    /// Asks the CPU to start loading the line where `key`'s probe starts.
    #[inline]
    fn prefetch(&self, key: u64) {
        prefetch_read(&raw const self.slots[self.home(key)]);
    }
    fn get(&self, key: BlockKey) -> Option<u32> {
        match self.find(key.0) {
            (i, true) => Some(self.slots[i].at - 1),
            _ => None,
        }
    }
    /// Names global slot `slot` for `key`, which is not in the directory.
    fn insert(&mut self, key: BlockKey, slot: u32) {
        // At most 3/4 full keeps probes short.
        if (self.len + 1) * 4 > self.slots.len() * 3 {
            self.grow();
        }
        let (i, found) = self.find(key.0);
        debug_assert!(!found, "key already in the directory");
        self.slots[i] = DirSlot {
            key: key.0,
            at: slot + 1,
        };
        self.len += 1;
    }
    #[cold]
    fn grow(&mut self) {
        let bits = 64 - self.shift + 1;
        let old = std::mem::replace(&mut self.slots, vec![DirSlot::default(); 1 << bits]);
        self.shift = 64 - bits;
        let mask = self.slots.len() - 1;
        for s in old.into_iter().filter(|s| s.at != 0) {
            let mut i = self.home(s.key);
            while self.slots[i].at != 0 {
                i = (i + 1) & mask;
            }
            self.slots[i] = s;
        }
    }
    fn remove(&mut self, key: BlockKey) -> Option<u32> {
        let (mut hole, found) = self.find(key.0);
        if !found {
            return None;
        }
        let at = self.slots[hole].at - 1;
        let mask = self.slots.len() - 1;
        let mut j = hole;
        // Backward shift: move later entries of the cluster into the hole when their probe
        // start is not between the hole and where they sit.
        loop {
            j = (j + 1) & mask;
            let s = self.slots[j];
            if s.at == 0 {
                break;
            }
            let home = self.home(s.key);
            if (j.wrapping_sub(home) & mask) >= (j.wrapping_sub(hole) & mask) {
                self.slots[hole] = s;
                hole = j;
            }
        }
        self.slots[hole] = DirSlot::default();
        self.len -= 1;
        Some(at)
    }
}

/// Directory plus per-machine slots. Deterministic; sans-IO.
#[derive(Clone, Debug)]
pub struct SwaCache {
    cfg: SwaConfig,
    dir: SwaDir,
    /// Every machine's slots, machine after machine.
    slots: Vec<Option<Slot>>,
    machines: Vec<Machine>,
    now: Nanos,
    /// No state expires before this: the earliest expiry of the machines' oldest entries when
    /// they were last looked at (stores only append later ones), so most calls skip the scan
    /// over every machine.
    next_expiry: Nanos,
    stats: SwaStats,
}

impl SwaCache {
    pub fn new(cfg: SwaConfig) -> Result<Self, ConfigError> {
        cfg.validate()?;
        let per = cfg.slots_per_machine;
        let machines = (0..cfg.machines)
            .map(|m| Machine {
                free: (m * per..(m + 1) * per).rev().collect(),
                order: VecDeque::new(),
                used: 0,
            })
            .collect();
        Ok(SwaCache {
            slots: vec![None; cfg.machines as usize * per as usize],
            cfg,
            dir: SwaDir::new(),
            machines,
            now: Nanos::ZERO,
            next_expiry: Nanos::NEVER,
            stats: SwaStats::default(),
        })
    }

    pub fn config(&self) -> &SwaConfig {
        &self.cfg
    }
    pub fn stats(&self) -> &SwaStats {
        &self.stats
    }
    pub fn used_slots(&self, m: MachineId) -> u32 {
        self.machines[m.0 as usize].used
    }

    /// Asks the CPU to start loading the directory entry of prefix `key` (a hint: a caller that
    /// will look it up or store it soon overlaps the cache miss with other work).
    #[inline]
    pub fn prefetch(&self, key: BlockKey) {
        self.dir.prefetch(key.0);
    }

    /// Drops every state older than its lifetime.
    pub fn advance(&mut self, now: Nanos) {
        // The clock is finite (`NEVER` is not a time).
        let now = now.min(Nanos::MAX);
        if now > self.now {
            self.now = now;
        }
        if self.now < self.next_expiry {
            return;
        }
        let mut next = Nanos::NEVER;
        for mi in 0..self.machines.len() {
            while let Some(&(slot, at)) = self.machines[mi].order.front() {
                let expires = at.saturating_add(self.cfg.lifetime);
                if expires > self.now {
                    next = next.min(expires);
                    break;
                }
                self.machines[mi].order.pop_front();
                self.prefetch_oldest(mi);
                if self.slot_is(slot, at) {
                    self.stats.expirations += 1;
                    self.free_slot(mi, slot);
                }
            }
        }
        self.next_expiry = next;
    }

    /// Starts loading what dropping machine `mi`'s oldest states (expired or evicted) will
    /// read, one state ahead: the directory entry of the oldest, whose slot the previous call
    /// started loading, and the slot of the one after it.
    #[inline]
    fn prefetch_oldest(&self, mi: usize) {
        let order = &self.machines[mi].order;
        if let Some(&(slot, at)) = order.front()
            && let Some(s) = self.slots[slot as usize]
            && s.stored_at == at
        {
            self.dir.prefetch(s.key.0);
        }
        if let Some(&(next, _)) = order.get(1) {
            prefetch_read(&raw const self.slots[next as usize]);
        }
    }

    fn slot_is(&self, slot: u32, at: Nanos) -> bool {
        matches!(self.slots[slot as usize], Some(s) if s.stored_at == at)
    }

    /// Frees global slot `slot` of machine `mi`.
    fn free_slot(&mut self, mi: usize, slot: u32) {
        if let Some(s) = self.slots[slot as usize] {
            self.dir.remove(s.key);
            self.slots[slot as usize] = None;
            let m = &mut self.machines[mi];
            m.free.push(slot);
            m.used -= 1;
        }
    }

    /// The machine of global slot `slot`.
    fn machine_of(&self, slot: u32) -> usize {
        (slot / self.cfg.slots_per_machine) as usize
    }

    /// Stores the state for prefix `key` on `machine` (after prefill, or at the end of decode).
    /// A state already stored for the same prefix is replaced by the newer copy.
    pub fn store(&mut self, now: Nanos, machine: MachineId, key: BlockKey) {
        self.advance(now);
        let mi = machine.0 as usize % self.machines.len();
        if let Some(old) = self.dir.get(key) {
            self.stats.refreshes += 1;
            self.free_slot(self.machine_of(old), old);
        }
        if self.machines[mi].free.is_empty() {
            // Full: drop the oldest state on this machine.
            while let Some((slot, at)) = self.machines[mi].order.pop_front() {
                if self.slot_is(slot, at) {
                    self.stats.evictions += 1;
                    self.free_slot(mi, slot);
                    break;
                }
            }
        }
        let m = &mut self.machines[mi];
        let slot = m.free.pop().expect("a slot was freed above");
        m.order.push_back((slot, self.now));
        m.used += 1;
        self.slots[slot as usize] = Some(Slot {
            key,
            stored_at: self.now,
        });
        self.next_expiry = self
            .next_expiry
            .min(self.now.saturating_add(self.cfg.lifetime));
        self.dir.insert(key, slot);
        self.stats.stores += 1;
        // The state this machine drops next when full: loaded by its next store.
        self.prefetch_oldest(mi);
    }

    /// Machine `machine`'s host failed: every state it holds is gone (later lookups miss and
    /// the hit rule backs off to an earlier state or none). Returns how many were lost.
    pub fn lose_machine(&mut self, now: Nanos, machine: MachineId) -> u64 {
        self.advance(now);
        let mi = machine.0 as usize % self.machines.len();
        let order = std::mem::take(&mut self.machines[mi].order);
        let mut lost = 0;
        for (slot, at) in order {
            if self.slot_is(slot, at) {
                self.free_slot(mi, slot);
                lost += 1;
            }
        }
        lost
    }

    /// Which machine holds live state for prefix `key`, if any.
    pub fn lookup(&mut self, now: Nanos, key: BlockKey) -> Option<MachineId> {
        self.advance(now);
        self.stats.lookups += 1;
        let found = self
            .dir
            .get(key)
            .map(|g| MachineId(self.machine_of(g) as u32));
        if found.is_some() {
            self.stats.hits += 1;
        }
        found
    }

    /// Slots are conserved: used + free = capacity on every machine, and the directory
    /// names exactly the used slots.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut dir_entries = 0usize;
        let per = self.cfg.slots_per_machine as usize;
        for (mi, m) in self.machines.iter().enumerate() {
            let mine = &self.slots[mi * per..(mi + 1) * per];
            let used = mine.iter().filter(|s| s.is_some()).count();
            if used as u32 != m.used || used + m.free.len() != per {
                return Err(format!("machine {mi}: slots not conserved"));
            }
            if m.free.iter().any(|&f| f as usize / per != mi) {
                return Err(format!("machine {mi}: another machine's slot is free here"));
            }
            for (i, s) in mine.iter().enumerate() {
                if let Some(s) = s {
                    let g = (mi * per + i) as u32;
                    if self.dir.get(s.key) != Some(g) {
                        return Err(format!("machine {mi} slot {i} missing from directory"));
                    }
                    if s.stored_at.saturating_add(self.cfg.lifetime) <= self.now {
                        return Err(format!("machine {mi} slot {i} outlived its lifetime"));
                    }
                    dir_entries += 1;
                }
            }
        }
        if dir_entries != self.dir.len {
            return Err("directory names slots that do not exist".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cfg(slots: u32) -> SwaConfig {
        SwaConfig {
            machines: 2,
            slots_per_machine: slots,
            lifetime: Nanos(180),
        }
    }

    #[test]
    fn lifetime_and_directory() {
        let mut c = SwaCache::new(cfg(4)).unwrap();
        c.store(Nanos(0), MachineId(1), BlockKey(7));
        assert_eq!(c.lookup(Nanos(179), BlockKey(7)), Some(MachineId(1)));
        assert_eq!(c.lookup(Nanos(180), BlockKey(7)), None);
        assert_eq!(c.stats().expirations, 1);
        c.check_invariants().unwrap();
    }

    #[test]
    fn sizes_and_lifetimes_are_bounded() {
        let e = SwaConfig {
            machines: 1 << 16,
            slots_per_machine: 1 << 16,
            lifetime: Nanos(1),
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.contains("swa.slots_per_machine"), "{e}");
        let e = SwaConfig {
            lifetime: Nanos::NEVER,
            ..Default::default()
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.contains("horizon"), "{e}");
        // A saturated clock expires states; it is a time, not "never".
        let mut c = SwaCache::new(cfg(2)).unwrap();
        c.store(Nanos(0), MachineId(0), BlockKey(1));
        assert_eq!(c.lookup(Nanos::NEVER, BlockKey(1)), None);
        c.check_invariants().unwrap();
    }

    #[test]
    fn full_machine_drops_oldest_and_refresh_moves() {
        let mut c = SwaCache::new(cfg(2)).unwrap();
        c.store(Nanos(0), MachineId(0), BlockKey(1));
        c.store(Nanos(1), MachineId(0), BlockKey(2));
        c.store(Nanos(2), MachineId(0), BlockKey(3));
        assert_eq!(c.lookup(Nanos(2), BlockKey(1)), None);
        assert_eq!(c.stats().evictions, 1);
        c.store(Nanos(3), MachineId(1), BlockKey(2));
        assert_eq!(c.lookup(Nanos(3), BlockKey(2)), Some(MachineId(1)));
        assert_eq!(c.used_slots(MachineId(0)), 1);
        c.check_invariants().unwrap();
    }

    proptest! {
        #[test]
        fn slots_conserved(ops in proptest::collection::vec((0u32..3, 0u64..20, 0u64..50), 1..200)) {
            let mut c = SwaCache::new(cfg(3)).unwrap();
            let mut now = 0;
            for (m, key, dt) in ops {
                now += dt;
                c.store(Nanos(now), MachineId(m), BlockKey(key));
                let _ = c.lookup(Nanos(now), BlockKey(key / 2));
                c.check_invariants().map_err(TestCaseError::fail)?;
            }
        }
    }

    proptest! {
        /// Lookups agree with a plain model: per machine a list of (key, stored at) in storing
        /// order, the oldest dropped when full, a refresh moving the key, states gone at their
        /// lifetime. Keys that share probe starts and fingerprint bits exercise the directory's
        /// collisions, growth and deletions.
        #[test]
        fn lookups_match_a_model(ops in proptest::collection::vec((0u32..3, 0u64..40, 0u64..30, any::<bool>()), 1..400)) {
            let mut c = SwaCache::new(SwaConfig { machines: 3, slots_per_machine: 5, lifetime: Nanos(100) }).unwrap();
            let mut model: Vec<Vec<(BlockKey, u64)>> = vec![Vec::new(); 3];
            let key = |k: u64| BlockKey(if k.is_multiple_of(2) { k << 40 } else { k });
            let mut now = 0;
            for (m, k, dt, is_store) in ops {
                now += dt;
                for list in &mut model {
                    list.retain(|&(_, at)| at + 100 > now);
                }
                if is_store {
                    c.store(Nanos(now), MachineId(m), key(k));
                    for list in &mut model {
                        list.retain(|&(x, _)| x != key(k));
                    }
                    let list = &mut model[m as usize];
                    if list.len() == 5 {
                        list.remove(0);
                    }
                    list.push((key(k), now));
                } else {
                    let want = model.iter().position(|l| l.iter().any(|&(x, _)| x == key(k)));
                    prop_assert_eq!(c.lookup(Nanos(now), key(k)), want.map(|m| MachineId(m as u32)));
                }
                for (mi, list) in model.iter().enumerate() {
                    prop_assert_eq!(c.used_slots(MachineId(mi as u32)) as usize, list.len());
                }
                c.check_invariants().map_err(TestCaseError::fail)?;
            }
        }
    }

    #[test]
    fn too_many_slots_is_a_config_error() {
        let e = SwaCache::new(SwaConfig {
            machines: 1 << 16,
            slots_per_machine: 1 << 16,
            lifetime: Nanos(1),
        })
        .unwrap_err();
        assert!(e.to_string().contains("swa.slots_per_machine"), "{e}");
    }
}
