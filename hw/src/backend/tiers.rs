//! Where each sequence's state lives: global KV blocks in an HBM pool, a pinned host pool or
//! an SSD file below it, and SWA rings in HBM or in host slots. Pure bookkeeping (no GPU
//! calls), so the placement rules are unit-tested without a device; the backend turns the
//! moves into copies and file I/O.
//!
//! Tier order: HBM → host → disk. A sequence evicted from HBM goes to host; when the host pool
//! is full, the least recently used sequences' host blocks go to disk first (the victim is
//! dropped only when disk is full too). A disk block needed on the device is read into a host
//! block (staging, freed at the next step) and swapped in from there.
//!
//! HBM blocks and rings are split into regions, one per device of the serving unit that shares
//! the GPU (each prefill engine and each decode group its own KV pool): a sequence's HBM blocks
//! and ring lie in one region, evictions stay inside the region that needs room, and a sequence
//! placed in another region moves there by device-to-device copies ([`Moves::dtod`]). Host,
//! disk and SWA host slots are one shared tier.

use std::collections::{BTreeMap, BTreeSet};

/// Where one 128-token global KV block of a sequence lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockLoc {
    Hbm(u32),
    Host(u32),
    Disk(u32),
}

/// One sequence's placement.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SeqPlacement {
    pub blocks: Vec<BlockLoc>,
    /// Device SWA ring slot (encoder and decoder windows of every layer).
    pub ring: Option<u32>,
    /// Host SWA slot holding the ring while it is not on the device (or its stored copy).
    pub swa_host: Option<u32>,
    /// The encoder ring holds the window ending at this position (0: nothing valid).
    pub ring_valid_to: usize,
    /// Logical clock of the last step that touched the sequence (LRU order).
    pub last_used: u64,
    /// The region holding its HBM blocks and ring.
    pub region: u32,
}

/// Copies one step needs, in block/slot ids.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Moves {
    /// (host block, HBM block): swap-in.
    pub swap_in: Vec<(u32, u32)>,
    /// (HBM block, host block): swap-out.
    pub swap_out: Vec<(u32, u32)>,
    /// (ring slot, host SWA slot): save a ring to host.
    pub ring_out: Vec<(u32, u32)>,
    /// (host SWA slot, ring slot): restore a ring.
    pub ring_in: Vec<(u32, u32)>,
    /// (host block, disk block): spill to disk. Runs first: the host block may be reused by
    /// this step's swap-outs and disk reads.
    pub host_to_disk: Vec<(u32, u32)>,
    /// (disk block, host block): read back into a host block, before the swap-in that reads it.
    pub disk_to_host: Vec<(u32, u32)>,
    /// (HBM block, HBM block) in another region: a device-to-device copy, after the swap-outs
    /// (an evicted block may be the destination) and before the swap-ins.
    pub dtod: Vec<(u32, u32)>,
    /// (ring slot, ring slot) in another region, ordered as `dtod`.
    pub ring_dtod: Vec<(u32, u32)>,
}

impl Moves {
    pub fn is_empty(&self) -> bool {
        self.swap_in.is_empty()
            && self.swap_out.is_empty()
            && self.ring_out.is_empty()
            && self.ring_in.is_empty()
            && self.host_to_disk.is_empty()
            && self.disk_to_host.is_empty()
            && self.dtod.is_empty()
            && self.ring_dtod.is_empty()
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TierError {
    #[error(
        "a step needs {needed} HBM blocks but the pool has {capacity} (raise backend.hbm_blocks)"
    )]
    HbmFull { needed: usize, capacity: usize },
    #[error("a step touches more sequences than the {0} SWA ring slots (raise backend.ring_slots)")]
    RingsFull(usize),
    #[error("region {region} does not exist (the pool has {regions})")]
    NoRegion { region: u32, regions: usize },
    #[error(
        "a step reads {needed} blocks from disk but only {free} host blocks can stage them (raise backend.host_blocks)"
    )]
    HostFull { needed: usize, free: usize },
}

/// The block and ring allocator of both tiers.
#[derive(Debug, Clone)]
pub struct Tiers {
    /// Free HBM blocks of each region.
    hbm_free: Vec<BTreeSet<u32>>,
    /// HBM blocks and rings left by sequences that moved to another region this step: free from
    /// the next step on (a copy of this step may still read them).
    moved_pending: Vec<(u32, Option<u32>, Option<u32>)>,
    host_free: BTreeSet<u32>,
    /// Host blocks read by this step's swap-ins, free from the next step on.
    host_pending: Vec<u32>,
    /// Host blocks written by this step's swap-outs: their data is not there yet, so they
    /// cannot be spilled to disk before the next step.
    host_fresh: BTreeSet<u32>,
    disk_free: BTreeSet<u32>,
    /// Disk blocks read by this step, free from the next step on (a later write in the same
    /// step must not overtake the read).
    disk_pending: Vec<u32>,
    ring_free: Vec<BTreeSet<u32>>,
    swa_host_free: BTreeSet<u32>,
    hbm_blocks: Vec<usize>,
    ring_slots: Vec<usize>,
    pub seqs: BTreeMap<u64, SeqPlacement>,
    clock: u64,
}

impl Tiers {
    pub fn new(
        hbm_blocks: usize,
        host_blocks: usize,
        disk_blocks: usize,
        ring_slots: usize,
        swa_host_slots: usize,
    ) -> Self {
        Self::with_regions(
            &[hbm_blocks],
            &[ring_slots],
            host_blocks,
            disk_blocks,
            swa_host_slots,
        )
    }

    /// HBM blocks and rings split into regions (`hbm_blocks[r]` blocks and `ring_slots[r]`
    /// rings in region `r`, numbered consecutively); the host, disk and SWA host tiers shared.
    pub fn with_regions(
        hbm_blocks: &[usize],
        ring_slots: &[usize],
        host_blocks: usize,
        disk_blocks: usize,
        swa_host_slots: usize,
    ) -> Self {
        let set = |n: usize| (0..n as u32).collect::<BTreeSet<_>>();
        let ranges = |sizes: &[usize]| {
            let mut base = 0u32;
            sizes
                .iter()
                .map(|&n| {
                    let r = (base..base + n as u32).collect::<BTreeSet<_>>();
                    base += n as u32;
                    r
                })
                .collect::<Vec<_>>()
        };
        Self {
            hbm_free: ranges(hbm_blocks),
            moved_pending: Vec::new(),
            host_free: set(host_blocks),
            host_pending: Vec::new(),
            host_fresh: BTreeSet::new(),
            disk_free: set(disk_blocks),
            disk_pending: Vec::new(),
            ring_free: ranges(ring_slots),
            swa_host_free: set(swa_host_slots),
            hbm_blocks: hbm_blocks.to_vec(),
            ring_slots: ring_slots.to_vec(),
            seqs: BTreeMap::new(),
            clock: 0,
        }
    }

    pub fn regions(&self) -> usize {
        self.hbm_blocks.len()
    }

    /// Free HBM blocks over every region.
    pub fn hbm_free(&self) -> usize {
        self.hbm_free.iter().map(BTreeSet::len).sum()
    }

    /// Free HBM blocks of one region.
    pub fn hbm_free_in(&self, region: u32) -> usize {
        self.hbm_free.get(region as usize).map_or(0, BTreeSet::len)
    }

    fn check_region(&self, region: u32) -> Result<(), TierError> {
        if (region as usize) < self.regions() {
            Ok(())
        } else {
            Err(TierError::NoRegion {
                region,
                regions: self.regions(),
            })
        }
    }

    /// Starts a step: the LRU clock advances once per step. Within a step the backend runs
    /// every swap-out and ring save before any swap-in, restore or compute, because evicted
    /// HBM blocks and rings are reused in the same step.
    pub fn begin_step(&mut self) {
        self.clock += 1;
        for (region, block, ring) in self.moved_pending.drain(..) {
            if let Some(b) = block {
                self.hbm_free[region as usize].insert(b);
            }
            if let Some(r) = ring {
                self.ring_free[region as usize].insert(r);
            }
        }
        self.host_free.extend(self.host_pending.drain(..));
        self.disk_free.extend(self.disk_pending.drain(..));
        self.host_fresh.clear();
    }

    pub fn host_free(&self) -> usize {
        self.host_free.len()
    }

    pub fn disk_free(&self) -> usize {
        self.disk_free.len()
    }

    /// Makes `seq`'s blocks `[0, blocks)` resident in HBM region `region` and gives it a ring
    /// there, evicting sequences of that region not in `protected` (least recently used first)
    /// as needed. New blocks are allocated; blocks in host memory are swapped in; a sequence
    /// held by another region moves ([`Self::relocate`]). Returns the HBM id of every block.
    pub fn make_resident(
        &mut self,
        seq: u64,
        blocks: usize,
        region: u32,
        protected: &BTreeSet<u64>,
        moves: &mut Moves,
    ) -> Result<Vec<u32>, TierError> {
        self.check_region(region)?;
        let clock = self.clock;
        let mut st = self.seqs.remove(&seq).unwrap_or(SeqPlacement {
            region,
            ..SeqPlacement::default()
        });
        st.last_used = clock;
        // The sequence stays out of `seqs` while it is placed, so evictions never pick it; it
        // goes back whatever the outcome.
        let placed = self.place(seq, &mut st, blocks, region, protected, moves);
        self.seqs.insert(seq, st);
        placed
    }

    /// [`Self::make_resident`] on `st`, taken out of `seqs`.
    fn place(
        &mut self,
        seq: u64,
        st: &mut SeqPlacement,
        blocks: usize,
        region: u32,
        protected: &BTreeSet<u64>,
        moves: &mut Moves,
    ) -> Result<Vec<u32>, TierError> {
        if st.region != region {
            self.relocate(st, region, protected, moves)?;
        }
        self.reserve_hbm(st, blocks, region, protected, moves)?;
        self.reserve_staging(seq, st, blocks, protected, moves)?;
        let ids = (0..blocks)
            .map(|i| self.bring_in(st, i, region as usize, moves))
            .collect();
        if st.ring.is_none() {
            self.give_ring(st, region, protected, moves)?;
        }
        Ok(ids)
    }

    /// Frees enough HBM blocks in `region` for the blocks of `[0, blocks)` that `st` does not
    /// hold there yet, evicting unprotected sequences.
    fn reserve_hbm(
        &mut self,
        st: &SeqPlacement,
        blocks: usize,
        region: u32,
        protected: &BTreeSet<u64>,
        moves: &mut Moves,
    ) -> Result<(), TierError> {
        let r = region as usize;
        let need_hbm = blocks.saturating_sub(
            st.blocks
                .iter()
                .take(blocks)
                .filter(|b| matches!(b, BlockLoc::Hbm(_)))
                .count(),
        );
        let capacity = self.hbm_blocks[r];
        if need_hbm > capacity {
            return Err(TierError::HbmFull {
                needed: need_hbm,
                capacity,
            });
        }
        while self.hbm_free[r].len() < need_hbm {
            if !self.evict_blocks(region, protected, moves) {
                return Err(TierError::HbmFull {
                    needed: need_hbm,
                    capacity,
                });
            }
        }
        Ok(())
    }

    /// Frees a host block for each of `st`'s blocks on disk in `[0, blocks)`: they are staged
    /// through host memory on their way to HBM.
    fn reserve_staging(
        &mut self,
        seq: u64,
        st: &SeqPlacement,
        blocks: usize,
        protected: &BTreeSet<u64>,
        moves: &mut Moves,
    ) -> Result<(), TierError> {
        let need_stage = st
            .blocks
            .iter()
            .take(blocks)
            .filter(|b| matches!(b, BlockLoc::Disk(_)))
            .count();
        if need_stage > 0 {
            let mut keep = protected.clone();
            keep.insert(seq);
            if !self.make_host_room(need_stage, &keep, moves) {
                return Err(TierError::HostFull {
                    needed: need_stage,
                    free: self.host_free.len(),
                });
            }
        }
        Ok(())
    }

    /// The HBM id of `st`'s block `i` in region `r`: kept when it is there, else taken from
    /// the blocks reserved above (swapped in from host, staged from disk, or new).
    fn bring_in(&mut self, st: &mut SeqPlacement, i: usize, r: usize, moves: &mut Moves) -> u32 {
        match st.blocks.get(i).copied() {
            Some(BlockLoc::Hbm(id)) => id,
            Some(BlockLoc::Disk(d)) => {
                let id = self.hbm_free[r].pop_first().expect("reserved above");
                let h = self.host_free.pop_first().expect("made room above");
                moves.disk_to_host.push((d, h));
                moves.swap_in.push((h, id));
                self.host_pending.push(h);
                self.disk_pending.push(d);
                st.blocks[i] = BlockLoc::Hbm(id);
                id
            }
            Some(BlockLoc::Host(h)) => {
                let id = self.hbm_free[r].pop_first().expect("reserved above");
                moves.swap_in.push((h, id));
                // Freed at the next step: this step's swap-outs must not overwrite it.
                self.host_pending.push(h);
                st.blocks[i] = BlockLoc::Hbm(id);
                id
            }
            None => {
                let id = self.hbm_free[r].pop_first().expect("reserved above");
                st.blocks.push(BlockLoc::Hbm(id));
                id
            }
        }
    }

    /// Gives `st` a ring in `region` (evicting an unprotected sequence's ring if none is
    /// free), restored from its saved SWA state when it has one.
    fn give_ring(
        &mut self,
        st: &mut SeqPlacement,
        region: u32,
        protected: &BTreeSet<u64>,
        moves: &mut Moves,
    ) -> Result<(), TierError> {
        let r = region as usize;
        if self.ring_free[r].is_empty() && !self.evict_ring(region, protected, moves) {
            return Err(TierError::RingsFull(self.ring_slots[r]));
        }
        let slot = self.ring_free[r].pop_first().expect("freed above");
        if let Some(h) = st.swa_host {
            moves.ring_in.push((h, slot));
        } else {
            st.ring_valid_to = 0;
        }
        st.ring = Some(slot);
        Ok(())
    }

    /// Moves `st`'s HBM blocks and ring into region `to` (device-to-device copies, after
    /// evicting unprotected sequences of `to` as needed); its blocks elsewhere stay where they
    /// are. The blocks and ring it leaves are free from the next step on.
    fn relocate(
        &mut self,
        st: &mut SeqPlacement,
        to: u32,
        protected: &BTreeSet<u64>,
        moves: &mut Moves,
    ) -> Result<(), TierError> {
        let r = to as usize;
        let on_hbm = st
            .blocks
            .iter()
            .filter(|b| matches!(b, BlockLoc::Hbm(_)))
            .count();
        let capacity = self.hbm_blocks[r];
        while self.hbm_free[r].len() < on_hbm {
            if !self.evict_blocks(to, protected, moves) {
                return Err(TierError::HbmFull {
                    needed: on_hbm,
                    capacity,
                });
            }
        }
        if st.ring.is_some()
            && self.ring_free[r].is_empty()
            && !self.evict_ring(to, protected, moves)
        {
            return Err(TierError::RingsFull(self.ring_slots[r]));
        }
        let from = st.region;
        for b in st.blocks.iter_mut() {
            if let BlockLoc::Hbm(id) = *b {
                let new = self.hbm_free[r].pop_first().expect("freed above");
                moves.dtod.push((id, new));
                self.moved_pending.push((from, Some(id), None));
                *b = BlockLoc::Hbm(new);
            }
        }
        if let Some(old) = st.ring {
            let new = self.ring_free[r].pop_first().expect("freed above");
            moves.ring_dtod.push((old, new));
            self.moved_pending.push((from, None, Some(old)));
            st.ring = Some(new);
        }
        st.region = to;
        Ok(())
    }

    /// Moves `seq`'s HBM blocks and ring into region `to` (the handoff from a prefill engine's
    /// pool to a decode group's); false when the sequence is unknown or already there.
    pub fn move_to_region(
        &mut self,
        seq: u64,
        to: u32,
        moves: &mut Moves,
    ) -> Result<bool, TierError> {
        self.check_region(to)?;
        let Some(mut st) = self.seqs.remove(&seq) else {
            return Ok(false);
        };
        if st.region == to {
            self.seqs.insert(seq, st);
            return Ok(false);
        }
        st.last_used = self.clock;
        let moved = self.relocate(&mut st, to, &BTreeSet::from([seq]), moves);
        self.seqs.insert(seq, st);
        moved.map(|()| true)
    }

    /// Forgets `seq` (a finished request): its blocks, ring and SWA host slot are free again.
    /// Called between steps, so nothing in flight reads them.
    pub fn release(&mut self, seq: u64) {
        let Some(st) = self.seqs.remove(&seq) else {
            return;
        };
        let r = st.region as usize;
        for b in st.blocks {
            match b {
                BlockLoc::Hbm(id) => {
                    self.hbm_free[r].insert(id);
                }
                BlockLoc::Host(h) => self.host_pending.push(h),
                BlockLoc::Disk(d) => self.disk_pending.push(d),
            }
        }
        if let Some(slot) = st.ring {
            self.ring_free[r].insert(slot);
        }
        if let Some(h) = st.swa_host {
            self.swa_host_free.insert(h);
        }
    }

    /// The region holding `seq`, if the tiers know it.
    pub fn region_of(&self, seq: u64) -> Option<u32> {
        self.seqs.get(&seq).map(|st| st.region)
    }

    /// Saves `seq`'s ring to a host SWA slot (the SWA store after prefill); keeps the ring.
    pub fn store_ring(&mut self, seq: u64, moves: &mut Moves) {
        let Some(st) = self.seqs.get_mut(&seq) else {
            return;
        };
        let Some(r) = st.ring else { return };
        if st.swa_host.is_none() {
            st.swa_host = self.swa_host_free.pop_first();
        }
        if let Some(h) = st.swa_host {
            moves.ring_out.push((r, h));
        }
    }

    fn lru_victim(
        &self,
        protected: &BTreeSet<u64>,
        pred: impl Fn(&SeqPlacement) -> bool,
    ) -> Option<u64> {
        self.seqs
            .iter()
            .filter(|(id, st)| !protected.contains(id) && pred(st))
            .min_by_key(|(id, st)| (st.last_used, **id))
            .map(|(id, _)| *id)
    }

    /// Moves the LRU unprotected sequence's HBM blocks to host, or drops the sequence's KV
    /// when the host pool cannot take them all (that sequence then starts from scratch). False
    /// when nothing can be evicted.
    fn evict_blocks(&mut self, region: u32, protected: &BTreeSet<u64>, moves: &mut Moves) -> bool {
        let Some(victim) = self.lru_victim(protected, |st| {
            st.region == region && st.blocks.iter().any(|b| matches!(b, BlockLoc::Hbm(_)))
        }) else {
            return false;
        };
        let st = self.seqs.get_mut(&victim).expect("victim exists");
        let on_hbm = st
            .blocks
            .iter()
            .filter(|b| matches!(b, BlockLoc::Hbm(_)))
            .count();
        if on_hbm > self.host_free.len() {
            let mut keep = protected.clone();
            keep.insert(victim);
            self.make_host_room(on_hbm, &keep, moves);
        }
        let st = self.seqs.get_mut(&victim).expect("victim exists");
        if on_hbm <= self.host_free.len() {
            for b in st.blocks.iter_mut() {
                if let BlockLoc::Hbm(id) = *b {
                    let h = self.host_free.pop_first().expect("counted above");
                    moves.swap_out.push((id, h));
                    self.host_fresh.insert(h);
                    *b = BlockLoc::Host(h);
                    self.hbm_free[region as usize].insert(id);
                }
            }
        } else {
            let blocks: Vec<BlockLoc> = st.blocks.drain(..).collect();
            st.ring_valid_to = 0;
            for b in blocks {
                match b {
                    BlockLoc::Hbm(id) => {
                        self.hbm_free[region as usize].insert(id);
                    }
                    BlockLoc::Host(h) => self.host_pending.push(h),
                    BlockLoc::Disk(d) => self.disk_pending.push(d),
                }
            }
        }
        true
    }

    /// Frees host blocks until `needed` are free by spilling the least recently used
    /// sequences' host blocks (not of `keep`, none written this step) to disk, or dropping such
    /// a sequence's KV when the disk cannot take its host blocks. False when it cannot.
    fn make_host_room(&mut self, needed: usize, keep: &BTreeSet<u64>, moves: &mut Moves) -> bool {
        while self.host_free.len() < needed {
            let fresh = &self.host_fresh;
            let Some(victim) = self.lru_victim(keep, |st| {
                st.blocks.iter().any(|b| matches!(b, BlockLoc::Host(_)))
                    && !st
                        .blocks
                        .iter()
                        .any(|b| matches!(b, BlockLoc::Host(h) if fresh.contains(h)))
            }) else {
                return false;
            };
            let st = self.seqs.get_mut(&victim).expect("victim exists");
            let on_host = st
                .blocks
                .iter()
                .filter(|b| matches!(b, BlockLoc::Host(_)))
                .count();
            if on_host <= self.disk_free.len() {
                for b in st.blocks.iter_mut() {
                    if let BlockLoc::Host(h) = *b {
                        let d = self.disk_free.pop_first().expect("counted above");
                        moves.host_to_disk.push((h, d));
                        *b = BlockLoc::Disk(d);
                        // reusable at once: the spill reads the block before anything else runs
                        self.host_free.insert(h);
                    }
                }
            } else {
                let blocks: Vec<BlockLoc> = st.blocks.drain(..).collect();
                st.ring_valid_to = 0;
                let region = st.region as usize;
                for b in blocks {
                    match b {
                        BlockLoc::Hbm(id) => {
                            self.hbm_free[region].insert(id);
                        }
                        // not read this step (the victim is not protected) nor written
                        // (no fresh block): free at once
                        BlockLoc::Host(h) => {
                            self.host_free.insert(h);
                        }
                        BlockLoc::Disk(d) => self.disk_pending.push(d),
                    }
                }
            }
        }
        true
    }

    fn evict_ring(&mut self, region: u32, protected: &BTreeSet<u64>, moves: &mut Moves) -> bool {
        let Some(victim) =
            self.lru_victim(protected, |st| st.region == region && st.ring.is_some())
        else {
            return false;
        };
        let st = self.seqs.get_mut(&victim).expect("victim exists");
        let r = st.ring.take().expect("has a ring");
        if st.swa_host.is_none() {
            st.swa_host = self.swa_host_free.pop_first();
        }
        match st.swa_host {
            Some(h) => moves.ring_out.push((r, h)),
            None => st.ring_valid_to = 0,
        }
        self.ring_free[region as usize].insert(r);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_blocks_are_lowest_free_ids_and_reuse_is_stable() {
        let mut t = Tiers::new(8, 8, 0, 2, 2);
        let mut m = Moves::default();
        t.begin_step();
        let p = BTreeSet::from([1u64]);
        assert_eq!(t.make_resident(1, 3, 0, &p, &mut m).unwrap(), vec![0, 1, 2]);
        assert_eq!(
            t.make_resident(1, 4, 0, &p, &mut m).unwrap(),
            vec![0, 1, 2, 3]
        );
        assert!(m.is_empty());
        assert_eq!(t.hbm_free(), 4);
    }

    #[test]
    fn pressure_swaps_the_lru_sequence_out_and_back_in() {
        let mut t = Tiers::new(4, 8, 0, 2, 2);
        let mut m = Moves::default();
        t.begin_step();
        t.make_resident(1, 3, 0, &BTreeSet::from([1]), &mut m)
            .unwrap();
        t.begin_step();
        t.make_resident(2, 1, 0, &BTreeSet::from([2]), &mut m)
            .unwrap();
        t.begin_step();
        // seq 3 needs 2 blocks: only seq 1 (LRU) is evicted, its 3 blocks go to host 0..3
        let ids = t
            .make_resident(3, 2, 0, &BTreeSet::from([3]), &mut m)
            .unwrap();
        assert_eq!(m.swap_out, vec![(0, 0), (1, 1), (2, 2)]);
        assert_eq!(ids, vec![0, 1]);
        let mut m = Moves::default();
        t.begin_step();
        // seq 1 returns: its host blocks 0..3 are swapped back in
        let ids = t
            .make_resident(1, 3, 0, &BTreeSet::from([1]), &mut m)
            .unwrap();
        // one free block: seq 2 (LRU) and then seq 3 go out to host blocks 3, 4, 5
        assert_eq!(m.swap_out, vec![(3, 3), (0, 4), (1, 5)]);
        assert_eq!(
            m.swap_in.iter().map(|(h, _)| *h).collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
        assert_eq!(ids.len(), 3);
        let placed = &t.seqs[&1];
        assert!(placed.blocks.iter().all(|b| matches!(b, BlockLoc::Hbm(_))));
    }

    #[test]
    fn a_full_host_pool_drops_the_victim_instead() {
        let mut t = Tiers::new(2, 1, 0, 2, 2);
        let mut m = Moves::default();
        t.begin_step();
        t.make_resident(1, 2, 0, &BTreeSet::from([1]), &mut m)
            .unwrap();
        t.begin_step();
        t.make_resident(2, 2, 0, &BTreeSet::from([2]), &mut m)
            .unwrap();
        assert!(m.swap_out.is_empty());
        assert!(t.seqs[&1].blocks.is_empty());
    }

    #[test]
    fn a_step_larger_than_the_pool_is_an_error() {
        let mut t = Tiers::new(2, 2, 0, 1, 1);
        let e = t
            .make_resident(1, 3, 0, &BTreeSet::from([1]), &mut Moves::default())
            .unwrap_err();
        assert_eq!(
            e,
            TierError::HbmFull {
                needed: 3,
                capacity: 2
            }
        );
    }

    #[test]
    fn a_full_host_pool_spills_the_lru_host_blocks_to_disk_and_reads_them_back() {
        // 4 HBM, 2 host, 4 disk blocks
        let mut t = Tiers::new(4, 2, 4, 4, 4);
        let one = |s: u64| BTreeSet::from([s]);
        let mut m = Moves::default();
        t.begin_step();
        assert_eq!(
            t.make_resident(1, 2, 0, &one(1), &mut m).unwrap(),
            vec![0, 1]
        );
        let mut m = Moves::default();
        t.begin_step();
        // seq 2 takes all 4 HBM blocks: seq 1 goes to host 0, 1
        t.make_resident(2, 4, 0, &one(2), &mut m).unwrap();
        assert_eq!(m.swap_out, vec![(0, 0), (1, 1)]);
        assert!(m.host_to_disk.is_empty());
        let mut m = Moves::default();
        t.begin_step();
        // seq 3 evicts seq 2 (4 blocks): the host pool is full, so seq 1's host blocks spill
        // to disk 0, 1 first; 2 free host blocks still cannot take 4, so seq 2 is dropped
        t.make_resident(3, 4, 0, &one(3), &mut m).unwrap();
        assert_eq!(m.host_to_disk, vec![(0, 0), (1, 1)]);
        assert!(m.swap_out.is_empty());
        assert_eq!(
            t.seqs[&1].blocks,
            vec![BlockLoc::Disk(0), BlockLoc::Disk(1)]
        );
        assert!(t.seqs[&2].blocks.is_empty());
        assert_eq!((t.host_free(), t.disk_free()), (2, 2));
        let mut m = Moves::default();
        t.begin_step();
        // seq 1 returns: seq 3 (4 HBM blocks) must leave; 2 host blocks cannot take it and no
        // other host blocks can spill (seq 1 is protected), so it is dropped; seq 1's disk
        // blocks are staged through host 0, 1 and swapped in
        let ids = t.make_resident(1, 2, 0, &one(1), &mut m).unwrap();
        assert_eq!(ids, vec![0, 1]);
        assert_eq!(m.disk_to_host, vec![(0, 0), (1, 1)]);
        assert_eq!(m.swap_in, vec![(0, 0), (1, 1)]);
        assert!(m.host_to_disk.is_empty());
        assert!(t.seqs[&3].blocks.is_empty());
        // staging host blocks and read disk blocks are free only from the next step on
        assert_eq!((t.host_free(), t.disk_free()), (0, 2));
        t.begin_step();
        assert_eq!((t.host_free(), t.disk_free()), (2, 4));
    }

    #[test]
    fn blocks_swapped_out_this_step_do_not_spill_before_they_land() {
        // 4 HBM, 2 host, 4 disk blocks; seq 1 is older than seq 4
        let mut t = Tiers::new(4, 2, 4, 4, 4);
        let mut m = Moves::default();
        t.begin_step();
        t.make_resident(1, 2, 0, &BTreeSet::from([1]), &mut m)
            .unwrap();
        t.begin_step();
        t.make_resident(4, 2, 0, &BTreeSet::from([4]), &mut m)
            .unwrap();
        let mut m = Moves::default();
        t.begin_step();
        let both = BTreeSet::from([2, 3]);
        // seq 2 evicts seq 1 to host 0, 1 (written by this step's swap-out)
        t.make_resident(2, 2, 0, &both, &mut m).unwrap();
        assert_eq!(m.swap_out, vec![(0, 0), (1, 1)]);
        // seq 3 evicts seq 4 with the host pool full: seq 1's host blocks hold no data yet,
        // so they must not spill to disk; seq 4 is dropped instead
        t.make_resident(3, 2, 0, &both, &mut m).unwrap();
        assert!(m.host_to_disk.is_empty());
        assert_eq!(
            t.seqs[&1].blocks,
            vec![BlockLoc::Host(0), BlockLoc::Host(1)]
        );
        assert!(t.seqs[&4].blocks.is_empty());
    }

    #[test]
    fn a_disk_read_needs_host_staging_room() {
        let mut t = Tiers::new(4, 2, 4, 4, 4);
        let mut m = Moves::default();
        t.begin_step();
        t.make_resident(1, 2, 0, &BTreeSet::from([1]), &mut m)
            .unwrap();
        t.seqs.get_mut(&1).unwrap().blocks = vec![BlockLoc::Disk(0), BlockLoc::Disk(1)];
        // host blocks 0, 1 held by seq 2, which is protected in the same step
        t.seqs.insert(
            2,
            SeqPlacement {
                blocks: vec![BlockLoc::Host(0), BlockLoc::Host(1)],
                ..SeqPlacement::default()
            },
        );
        t.host_free.clear();
        let e = t
            .make_resident(1, 2, 0, &BTreeSet::from([1, 2]), &mut m)
            .unwrap_err();
        assert_eq!(e, TierError::HostFull { needed: 2, free: 0 });
    }

    #[test]
    fn rings_are_saved_to_host_on_eviction_and_restored() {
        let mut t = Tiers::new(8, 8, 0, 1, 2);
        let mut m = Moves::default();
        t.begin_step();
        t.make_resident(1, 1, 0, &BTreeSet::from([1]), &mut m)
            .unwrap();
        t.seqs.get_mut(&1).unwrap().ring_valid_to = 300;
        t.begin_step();
        t.make_resident(2, 1, 0, &BTreeSet::from([2]), &mut m)
            .unwrap();
        assert_eq!(m.ring_out, vec![(0, 0)]);
        let mut m = Moves::default();
        t.begin_step();
        t.make_resident(1, 1, 0, &BTreeSet::from([1]), &mut m)
            .unwrap();
        assert_eq!(m.ring_in, vec![(0, 0)]);
        assert_eq!(t.seqs[&1].ring_valid_to, 300);
    }

    /// Two regions: each allocates from its own id range and evicts only its own sequences.
    #[test]
    fn regions_allocate_and_evict_apart() {
        let mut t = Tiers::with_regions(&[2, 3], &[1, 1], 8, 0, 4);
        let mut m = Moves::default();
        t.begin_step();
        assert_eq!(
            t.make_resident(1, 2, 0, &BTreeSet::from([1]), &mut m)
                .unwrap(),
            vec![0, 1]
        );
        assert_eq!(
            t.make_resident(2, 3, 1, &BTreeSet::from([2]), &mut m)
                .unwrap(),
            vec![2, 3, 4]
        );
        assert!(m.is_empty());
        t.begin_step();
        // region 0 is full: seq 3 evicts seq 1 (region 0), not seq 2 (LRU too, but region 1)
        t.make_resident(3, 1, 0, &BTreeSet::from([3]), &mut m)
            .unwrap();
        assert_eq!(m.swap_out.len(), 2);
        assert!(
            t.seqs[&2]
                .blocks
                .iter()
                .all(|b| matches!(b, BlockLoc::Hbm(_)))
        );
        assert_eq!(t.region_of(3), Some(0));
        let e = t
            .make_resident(4, 4, 1, &BTreeSet::from([4]), &mut Moves::default())
            .unwrap_err();
        assert_eq!(
            e,
            TierError::HbmFull {
                needed: 4,
                capacity: 3
            }
        );
        assert!(matches!(
            t.make_resident(5, 1, 2, &BTreeSet::new(), &mut Moves::default()),
            Err(TierError::NoRegion {
                region: 2,
                regions: 2
            })
        ));
    }

    /// A handoff moves the HBM blocks and the ring into the other region by device copies;
    /// the blocks it left are free from the next step on; a release frees everything.
    #[test]
    fn move_to_region_copies_and_frees_the_old_blocks_a_step_later() {
        let mut t = Tiers::with_regions(&[3, 3], &[1, 1], 8, 0, 4);
        let mut m = Moves::default();
        t.begin_step();
        t.make_resident(1, 2, 0, &BTreeSet::from([1]), &mut m)
            .unwrap();
        let mut m = Moves::default();
        assert!(t.move_to_region(1, 1, &mut m).unwrap());
        assert_eq!(m.dtod, vec![(0, 3), (1, 4)]);
        assert_eq!(m.ring_dtod, vec![(0, 1)]);
        assert!(m.swap_out.is_empty());
        assert_eq!(t.region_of(1), Some(1));
        assert_eq!(t.seqs[&1].blocks, vec![BlockLoc::Hbm(3), BlockLoc::Hbm(4)]);
        // the copies may still read blocks 0 and 1 in this step
        assert_eq!(t.hbm_free_in(0), 1);
        t.begin_step();
        assert_eq!(t.hbm_free_in(0), 3);
        // already there, or unknown: nothing moves
        assert!(!t.move_to_region(1, 1, &mut Moves::default()).unwrap());
        assert!(!t.move_to_region(9, 1, &mut Moves::default()).unwrap());
        // the decode step reads the moved blocks in place and appends in region 1
        let mut m = Moves::default();
        let ids = t
            .make_resident(1, 3, 1, &BTreeSet::from([1]), &mut m)
            .unwrap();
        assert_eq!(ids, vec![3, 4, 5]);
        assert!(m.is_empty());
        t.release(1);
        assert_eq!(t.hbm_free(), 6);
        assert!(t.seqs.is_empty());
        let mut m = Moves::default();
        t.make_resident(2, 1, 0, &BTreeSet::from([2]), &mut m)
            .unwrap();
        assert_eq!(t.seqs[&2].ring, Some(0));
    }

    /// Moving into a full region evicts that region's least recently used sequence first.
    #[test]
    fn a_move_into_a_full_region_evicts_there() {
        let mut t = Tiers::with_regions(&[2, 2], &[1, 1], 8, 0, 4);
        let mut m = Moves::default();
        t.begin_step();
        t.make_resident(1, 2, 1, &BTreeSet::from([1]), &mut m)
            .unwrap();
        t.begin_step();
        t.make_resident(2, 2, 0, &BTreeSet::from([2]), &mut m)
            .unwrap();
        let mut m = Moves::default();
        t.begin_step();
        assert!(t.move_to_region(2, 1, &mut m).unwrap());
        assert_eq!(m.swap_out, vec![(2, 0), (3, 1)]);
        assert_eq!(m.ring_out.len(), 1);
        assert_eq!(m.dtod, vec![(0, 2), (1, 3)]);
        assert_eq!(
            t.seqs[&1].blocks,
            vec![BlockLoc::Host(0), BlockLoc::Host(1)]
        );
    }
}
