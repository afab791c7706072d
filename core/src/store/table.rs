//! The store's key table: block key → slab index, open addressing.

use crate::content::BlockKey;

/// Block key → slab index, open addressing with linear probing and backward-shift deletion.
/// A slot is 8 bytes: the high 32 bits of the key's spread hash above the slab index + 1 (0 =
/// empty), so eight slots share a cache line and the table of tens of millions of blocks is
/// half the memory (and half the page faults while it grows). The probe start is the top bits
/// of the same hash, so growing and backward-shift deletion work from the slots alone; a hash
/// match is confirmed against the full key in the slab, which a hit then touches anyway. Block
/// keys are already uniform hashes; one multiply spreads them over the table. Unlike a general-purpose map it
/// exposes where a key's probe starts, so runs can prefetch it.
#[derive(Clone, Debug)]
pub(super) struct KeyTable {
    pub(super) slots: Vec<u64>,
    shift: u32,
    len: usize,
}

impl KeyTable {
    const MIN_BITS: u32 = 4;

    pub(super) fn new() -> Self {
        KeyTable {
            slots: vec![0; 1 << Self::MIN_BITS],
            shift: 64 - Self::MIN_BITS,
            len: 0,
        }
    }
    pub(super) fn len(&self) -> usize {
        self.len
    }
    #[inline]
    pub(super) fn mask(&self) -> usize {
        self.slots.len() - 1
    }
    pub(super) const HASH_BITS: u64 = !0xffff_ffff;
    #[inline]
    pub(super) fn hash(key: u64) -> u64 {
        key.wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }
    #[inline]
    pub(super) fn home(&self, key: u64) -> usize {
        (Self::hash(key) >> self.shift) as usize
    }
    /// A full slot's probe start (the table never has more than 2^32 slots).
    #[inline]
    pub(super) fn slot_home(&self, slot: u64) -> usize {
        (slot >> self.shift) as usize
    }
    #[inline]
    pub(super) fn pack(key: u64, idx: u32) -> u64 {
        (Self::hash(key) & Self::HASH_BITS) | (u64::from(idx) + 1)
    }
    /// The slab index a full slot holds.
    #[inline]
    pub(super) fn idx(slot: u64) -> u32 {
        (slot as u32).wrapping_sub(1)
    }
    /// Asks the CPU to start loading `key`'s first slot.
    #[inline]
    pub(super) fn prefetch(&self, key: u64) {
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
    pub(super) fn find(&self, key: u64, key_of: impl Fn(u32) -> u64) -> (usize, bool) {
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
    pub(super) fn get(&self, key: BlockKey, key_of: impl Fn(u32) -> u64) -> Option<u32> {
        match self.find(key.0, key_of) {
            (i, true) => Some(Self::idx(self.slots[i])),
            _ => None,
        }
    }
    /// Grows (at most 3/4 full keeps probes within a line) so `more` keys fit; a run grows the
    /// table before its slots are prefetched.
    #[inline]
    pub(super) fn reserve(&mut self, more: usize) {
        if (self.len + more) * 4 > self.slots.len() * 3 {
            self.grow(self.len + more);
        }
    }
    /// `n` empty slots, written once in order. A zeroed allocation (`vec![0; n]`) maps the
    /// shared zero page on each page's first probe (a read) and faults again, copying, on its
    /// first write: on a table of hundreds of MB that doubles the page faults, and the faults
    /// were most of the cost of growing. One sequential pass faults each page once.
    #[allow(clippy::slow_vector_initialization)] // on purpose: `vec![0; n]` faults twice
    pub(super) fn zeroed(n: usize) -> Vec<u64> {
        let mut v = Vec::with_capacity(n);
        v.resize(n, 0);
        v
    }
    /// Rebuilds the table at the smallest power-of-two size that holds `keys` keys at most 3/4
    /// full, in one pass (reserving for many keys does not rebuild at every doubling).
    #[cold]
    pub(super) fn grow(&mut self, keys: usize) {
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
    pub(super) fn fill(&mut self, at: usize, key: BlockKey, idx: u32) {
        self.slots[at] = Self::pack(key.0, idx);
        self.len += 1;
    }
    pub(super) fn remove(&mut self, key: BlockKey, key_of: impl Fn(u32) -> u64) -> Option<u32> {
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
    pub(super) fn iter<'a>(
        &'a self,
        key_of: impl Fn(u32) -> u64 + 'a,
    ) -> impl Iterator<Item = (bool, u32)> + 'a {
        self.slots.iter().filter(|&&s| s != 0).map(move |&s| {
            let idx = Self::idx(s);
            (Self::pack(key_of(idx), idx) == s, idx)
        })
    }
}
