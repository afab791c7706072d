//! The store's two garbage collectors (SPEC §7: "a GC worker on every storage node evicts in
//! LRU order past a watermark"):
//!
//! - global LRU: one LRU list over the store, bounded by `capacity_bytes` (logical bytes);
//! - per-node LRU: every node is bounded by its own capacity (physical bytes of shards). Past
//!   its high watermark, the node's worker evicts the least recently used object with a shard
//!   on the node (the oldest head among the lists of the groups the node belongs to: every
//!   object is on its group's list, stamped when last used) until the node is back at its low
//!   watermark. An evicted object is deleted from every node of its group, so one node's GC
//!   also frees its neighbours. A node that is down still counts the shards it is owed (its
//!   replacement rebuilds them), so its bound still applies to its groups' writes.

use super::{KvStore, NIL};

impl KvStore {
    /// Evicts what must go for an object of `bytes` bytes in the group starting at `start` to
    /// fit before it is written; false if it can never fit.
    pub(super) fn make_room(&mut self, start: u32, bytes: u64) -> bool {
        if self.per_node {
            let share = self.share_of(bytes);
            if share > self.node_cap_bytes {
                return false;
            }
            for node in self.group_nodes(start) {
                let j = node.0 as usize;
                while self.node_bytes[j] + share > self.node_cap_bytes {
                    if !self.evict_from_node(node.0) {
                        break;
                    }
                }
            }
            return true;
        }
        let cap = self.cfg.capacity_bytes.unwrap_or(u64::MAX);
        if bytes > cap {
            return false;
        }
        while self.stats.used_bytes + bytes > cap {
            if !self.evict_one() {
                break;
            }
        }
        true
    }

    /// After an object was written in the group starting at `start`: the GC of the store (or
    /// of each node of the group) runs if usage passed the high watermark, down to the low one.
    pub(super) fn collect_after_insert(&mut self, start: u32) {
        if self.per_node {
            for node in self.group_nodes(start) {
                let j = node.0 as usize;
                if self.node_bytes[j] > self.node_high_bytes {
                    while self.node_bytes[j] > self.node_low_bytes {
                        if !self.evict_from_node(node.0) {
                            break;
                        }
                    }
                }
            }
            return;
        }
        if self.stats.used_bytes > self.high_bytes {
            while self.stats.used_bytes > self.low_bytes {
                if !self.evict_one() {
                    break;
                }
            }
        }
    }

    /// Global LRU: evicts the least recently used object of the store.
    pub(super) fn evict_one(&mut self) -> bool {
        let h = self.lru.head;
        if h == NIL {
            return false;
        }
        self.evict(h);
        true
    }

    /// Per-node LRU: evicts the least recently used object with a shard on `node`.
    pub(super) fn evict_from_node(&mut self, node: u32) -> bool {
        let mut oldest = NIL;
        for s in self.nodes.starts_of(node) {
            let h = self.start_lru[s as usize].head;
            if h != NIL
                && (oldest == NIL
                    || self.recency[h as usize].stamp < self.recency[oldest as usize].stamp)
            {
                oldest = h;
            }
        }
        if oldest == NIL {
            return false;
        }
        self.evict(oldest);
        true
    }

    fn evict(&mut self, idx: u32) {
        self.stats.evictions += 1;
        self.stats.evicted_bytes += self.bytes_of(idx);
        self.remove(idx);
    }
}
