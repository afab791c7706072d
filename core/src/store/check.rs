//! The store's invariants: the structure agrees with its counters, nothing is stored past its
//! TTL or over capacity, nothing is stored in a group that lost its objects, and the node and
//! group byte counters add up.

use super::table::KeyTable;
use super::{KvStore, List, NIL};
use crate::content::mix64;

impl KvStore {
    /// Checks the structure against its counters; used by tests and at the end of every
    /// simulation (not per event: on a store of tens of millions of blocks one check costs
    /// seconds; [`Self::check_light`] is the per-event one).
    pub fn check_invariants(&self) -> Result<(), String> {
        let listed = self.listed_slots()?;
        self.check_objects(&listed)?;
        self.check_expiry_links(&listed)?;
        self.check_nodes()
    }

    /// What can be checked in time independent of the objects stored: capacity (of the store
    /// or of every node), the expiry lists' heads not past their TTL, lost groups empty, and
    /// the node availability counters.
    pub fn check_light(&self) -> Result<(), String> {
        if let Some(cap) = self.cfg.capacity_bytes
            && self.stats.used_bytes > cap
        {
            return Err(format!(
                "{} bytes stored over capacity {cap}",
                self.stats.used_bytes
            ));
        }
        for list in &self.expiry {
            if list.head != NIL && self.slab[list.head as usize].expires <= self.now {
                return Err("an object past its TTL is still stored".into());
            }
        }
        for (s, &objects) in self.start_objects.iter().enumerate() {
            if objects > 0 && self.nodes.is_lost(s as u32) {
                return Err(format!("group {s} lost its objects but holds {objects}"));
            }
        }
        self.check_nodes()
    }

    /// Every node's bytes are the sum of its groups' shares and within its capacity (per-node
    /// GC); the availability counters agree with the node states.
    fn check_nodes(&self) -> Result<(), String> {
        for (j, &b) in self.node_bytes.iter().enumerate() {
            let sum: u64 = self
                .nodes
                .starts_of(j as u32)
                .map(|s| self.start_shares[s as usize])
                .sum();
            if sum != b {
                return Err(format!(
                    "node {j}: {b} bytes counted, its groups hold {sum}"
                ));
            }
            if self.per_node && b > self.node_cap_bytes {
                return Err(format!(
                    "node {j} holds {b} bytes over its capacity {}",
                    self.node_cap_bytes
                ));
            }
        }
        self.nodes.check()
    }

    /// The slots holding an object as a bitmap: those on the LRU lists when the store keeps
    /// them (their links checked on the way), else every slot not on the free list. The map is
    /// then checked against them with one sequential pass over the map instead of a random
    /// hash probe per object.
    fn listed_slots(&self) -> Result<Vec<u64>, String> {
        let n = self.slab.len();
        let mut listed = vec![0u64; n.div_ceil(64)];
        if !self.tracks_lru() {
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
            return Ok(listed);
        }
        if self.lru_links.len() != n || (self.per_node && self.recency.len() != n) {
            return Err("LRU links do not cover the slab".into());
        }
        if self.per_node {
            for (s, list) in self.start_lru.iter().enumerate() {
                self.walk_lru(list, Some(s as u32), &mut listed)?;
            }
        } else {
            self.walk_lru(&self.lru, None, &mut listed)?;
        }
        for &f in &self.free {
            if listed
                .get(f as usize / 64)
                .is_none_or(|w| w & (1 << (f % 64)) != 0)
            {
                return Err("a free slot is on the LRU list".into());
            }
        }
        Ok(listed)
    }

    /// Walks one LRU list, marking its objects in `listed`; a group's list (`start`) holds
    /// only that group's objects, in increasing recency stamps.
    fn walk_lru(&self, list: &List, start: Option<u32>, listed: &mut [u64]) -> Result<(), String> {
        let (mut i, mut prev) = (list.head, NIL);
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
            if let Some(s) = start {
                let r = self.recency[i as usize];
                if self.start_of(self.slab[i as usize].key) != s || r.start != s {
                    return Err(format!("group {s}'s LRU list holds another group's object"));
                }
                if prev != NIL && self.recency[prev as usize].stamp >= r.stamp {
                    return Err(format!("group {s}'s LRU list is out of recency order"));
                }
            }
            listed[i as usize / 64] |= 1 << (i % 64);
            prev = i;
            i = l.next;
        }
        if list.tail != prev {
            return Err("LRU tail is not the list's last object".into());
        }
        Ok(())
    }

    /// The listed objects: within their TTL, sized, counted, named by the map exactly once,
    /// and adding up to the store's, the groups' and the capacity's byte counts.
    fn check_objects(&self, listed: &[u64]) -> Result<(), String> {
        let t = self.tally_listed(listed)?;
        if t.count + self.free.len() as u64 != self.slab.len() as u64 {
            return Err("slab slots neither stored nor free".into());
        }
        if t.count != self.map.len() as u64 || t.count != self.stats.objects {
            return Err(format!(
                "{} objects in LRU, {} in map",
                t.count,
                self.map.len()
            ));
        }
        self.check_map_names(listed, t.want_slots)?;
        let bytes = t.bytes;
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
        if t.shares != self.start_shares || t.objects != self.start_objects {
            return Err("per-group accounting drifted".into());
        }
        Ok(())
    }

    /// Checks each listed object (within its TTL, sized, in a group that kept its objects)
    /// and sums them up.
    fn tally_listed(&self, listed: &[u64]) -> Result<ListedTally, String> {
        let groups = self.cfg.storage_nodes as usize;
        let mut t = ListedTally {
            shares: vec![0u64; groups],
            objects: vec![0u32; groups],
            count: 0,
            bytes: 0,
            want_slots: 0,
        };
        for i in set_bits(listed) {
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
            let s = self.start_of(e.key) as usize;
            t.shares[s] += self.share_of(size);
            t.objects[s] += 1;
            if self.nodes.is_lost(s as u32) {
                return Err(format!(
                    "object {:?} is stored in group {s}, which lost its objects",
                    e.key
                ));
            }
            t.count += 1;
            t.bytes += size;
            t.want_slots = t.want_slots.wrapping_add(mix64(KeyTable::pack(e.key.0, i)));
        }
        Ok(t)
    }

    /// The map names each listed slot exactly once (as many entries as listed slots, each
    /// naming a distinct listed slot), and its entries carry the fingerprints of the listed
    /// keys: the sums of mix64 over the slots the map holds and over the slots the list
    /// implies (`want_slots`) agree (a wrong fingerprint changes the sum but for a 2^-64
    /// chance). One sequential pass over the map, reading nothing else: checking each entry's
    /// key in the slab instead costs a cache and TLB miss per object on a GiB-sized slab.
    /// The slots the map names go in a second bitmap (in hash order, so one random access per
    /// entry: reading the listed bitmap there too doubled them); named twice is caught there,
    /// and named but not listed by comparing the bitmaps word by word after.
    fn check_map_names(&self, listed: &[u64], want_slots: u64) -> Result<(), String> {
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
        Ok(())
    }

    /// The expiry lists: one pass over the listed slots in slab order checks every link.
    fn check_expiry_links(&self, listed: &[u64]) -> Result<(), String> {
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
        for i in set_bits(listed) {
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

/// What the listed objects add up to, per start group and in all.
struct ListedTally {
    shares: Vec<u64>,
    objects: Vec<u32>,
    count: u64,
    bytes: u64,
    /// Σ mix64 of the map slot each listed object should have (fingerprint and index).
    want_slots: u64,
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
