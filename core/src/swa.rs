//! The SWA state cache of SPEC §5: one fixed-size slot per stored state in the host memory of
//! the machine that produced it, a lifetime of about 3 minutes, and an in-memory directory of
//! which machine holds the state for which prefix.

use crate::content::{BlockKey, KeyMap};
use crate::error::ConfigError;
use crate::ids::MachineId;
use crate::time::Nanos;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

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
        if self.lifetime == Nanos::ZERO {
            return Err(ConfigError::invalid("swa.lifetime", "must be positive"));
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

#[derive(Clone, Debug)]
struct Machine {
    slots: Vec<Option<Slot>>,
    free: Vec<u32>,
    /// Slots in storing order (= expiry order, since the lifetime is constant); stale entries
    /// (slot reused or refreshed since) are skipped by comparing `stored_at`.
    order: VecDeque<(u32, Nanos)>,
    used: u32,
}

/// Directory plus per-machine slots. Deterministic; sans-IO.
#[derive(Clone, Debug)]
pub struct SwaCache {
    cfg: SwaConfig,
    dir: KeyMap<(MachineId, u32)>,
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
        let machines = (0..cfg.machines)
            .map(|_| Machine {
                slots: vec![None; cfg.slots_per_machine as usize],
                free: (0..cfg.slots_per_machine).rev().collect(),
                order: VecDeque::new(),
                used: 0,
            })
            .collect();
        Ok(SwaCache {
            cfg,
            dir: KeyMap::default(),
            machines,
            now: Nanos::ZERO,
            next_expiry: Nanos::MAX,
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

    /// Drops every state older than its lifetime.
    pub fn advance(&mut self, now: Nanos) {
        if now > self.now {
            self.now = now;
        }
        if self.now < self.next_expiry {
            return;
        }
        let mut next = Nanos::MAX;
        for mi in 0..self.machines.len() {
            while let Some(&(slot, at)) = self.machines[mi].order.front() {
                let expires = at.saturating_add(self.cfg.lifetime);
                if expires > self.now {
                    next = next.min(expires);
                    break;
                }
                self.machines[mi].order.pop_front();
                if self.slot_is(mi, slot, at) {
                    self.stats.expirations += 1;
                    self.free_slot(mi, slot);
                }
            }
        }
        self.next_expiry = next;
    }

    fn slot_is(&self, mi: usize, slot: u32, at: Nanos) -> bool {
        matches!(self.machines[mi].slots[slot as usize], Some(s) if s.stored_at == at)
    }

    fn free_slot(&mut self, mi: usize, slot: u32) {
        let m = &mut self.machines[mi];
        if let Some(s) = m.slots[slot as usize].take() {
            self.dir.remove(&s.key);
            m.free.push(slot);
            m.used -= 1;
        }
    }

    /// Stores the state for prefix `key` on `machine` (after prefill, or at the end of decode).
    /// A state already stored for the same prefix is replaced by the newer copy.
    pub fn store(&mut self, now: Nanos, machine: MachineId, key: BlockKey) {
        self.advance(now);
        let mi = machine.0 as usize % self.machines.len();
        if let Some(&(old_m, old_slot)) = self.dir.get(&key) {
            self.stats.refreshes += 1;
            self.free_slot(old_m.0 as usize, old_slot);
        }
        if self.machines[mi].free.is_empty() {
            // Full: drop the oldest state on this machine.
            while let Some((slot, at)) = self.machines[mi].order.pop_front() {
                if self.slot_is(mi, slot, at) {
                    self.stats.evictions += 1;
                    self.free_slot(mi, slot);
                    break;
                }
            }
        }
        let m = &mut self.machines[mi];
        let slot = m.free.pop().expect("a slot was freed above");
        m.slots[slot as usize] = Some(Slot {
            key,
            stored_at: self.now,
        });
        m.order.push_back((slot, self.now));
        m.used += 1;
        self.next_expiry = self
            .next_expiry
            .min(self.now.saturating_add(self.cfg.lifetime));
        self.dir.insert(key, (MachineId(mi as u32), slot));
        self.stats.stores += 1;
    }

    /// Which machine holds live state for prefix `key`, if any.
    pub fn lookup(&mut self, now: Nanos, key: BlockKey) -> Option<MachineId> {
        self.advance(now);
        self.stats.lookups += 1;
        let found = self.dir.get(&key).map(|&(m, _)| m);
        if found.is_some() {
            self.stats.hits += 1;
        }
        found
    }

    /// Slots are conserved: used + free = capacity on every machine, and the directory
    /// names exactly the used slots.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut dir_entries = 0usize;
        for (mi, m) in self.machines.iter().enumerate() {
            let used = m.slots.iter().filter(|s| s.is_some()).count();
            if used as u32 != m.used || used + m.free.len() != self.cfg.slots_per_machine as usize {
                return Err(format!("machine {mi}: slots not conserved"));
            }
            for (i, s) in m.slots.iter().enumerate() {
                if let Some(s) = s {
                    if self.dir.get(&s.key) != Some(&(MachineId(mi as u32), i as u32)) {
                        return Err(format!("machine {mi} slot {i} missing from directory"));
                    }
                    if s.stored_at.saturating_add(self.cfg.lifetime) <= self.now {
                        return Err(format!("machine {mi} slot {i} outlived its lifetime"));
                    }
                    dir_entries += 1;
                }
            }
        }
        if dir_entries != self.dir.len() {
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
}
