//! The store as a cluster of storage nodes that fail (SPEC §7): a node failure makes its groups
//! degraded, and a group with more than `parity` nodes unavailable loses its objects, which
//! the store then drops (deterministically: in expiry-list order), so their blocks are misses;
//! such a group refuses writes until enough of its nodes are back. A repair starts a rebuild
//! (the environment moves its bytes and says when it is done). The store also counts the shard
//! bytes written to every node, which the environment drains to charge the nodes' write
//! bandwidth.

use super::{KvStore, NIL};
use crate::content::BlockKey;
use crate::ids::StorageNodeId;
use crate::store::nodes::NodeState;
use crate::time::Nanos;
use serde::{Deserialize, Serialize};

/// What the cluster went through.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterStats {
    /// Failures of a node that was not down.
    pub node_failures: u64,
    /// Repairs of a node that was down (rebuilds started).
    pub node_repairs: u64,
    pub rebuilds_completed: u64,
    /// Times a group lost its objects (more than `parity` of its nodes unavailable).
    pub group_losses: u64,
    pub lost_objects: u64,
    /// Logical bytes of the lost objects.
    pub lost_bytes: u64,
    /// Writes refused because their group had lost its objects.
    pub writes_refused: u64,
    pub writes_refused_bytes: u64,
    /// Shard bytes written to the nodes that were not down (writes of new objects; a rebuild
    /// is the environment's).
    pub physical_bytes_written: u64,
}

/// What a node failure did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeChange {
    /// False when the node was down already (nothing changed).
    pub changed: bool,
    /// The node was rebuilding: its rebuild is abandoned.
    pub aborted_rebuild: bool,
    pub groups_lost: u32,
    pub objects_lost: u64,
    pub bytes_lost: u64,
}

/// What a repaired node must get back: the bytes of its shards, per group it belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RebuildPlan {
    pub node: StorageNodeId,
    pub bytes: u64,
    /// (the group's start node, bytes of this node's shards in that group), groups with
    /// nothing to rebuild left out.
    pub groups: Vec<(u32, u64)>,
}

impl KvStore {
    /// Node `node` fails at `now`: it answers nothing until repaired and rebuilt; groups that
    /// now have more than `parity` nodes unavailable lose their objects.
    pub fn fail_node(&mut self, now: Nanos, node: StorageNodeId) -> NodeChange {
        self.advance(now);
        let was = self.nodes.state(node);
        if was == NodeState::Down {
            return NodeChange::default();
        }
        self.cluster.node_failures += 1;
        let lost = self.nodes.set(node, NodeState::Down);
        self.cluster.group_losses += lost.len() as u64;
        let (objects_lost, bytes_lost) = self.drop_groups(&lost);
        NodeChange {
            changed: true,
            aborted_rebuild: was == NodeState::Rebuilding,
            groups_lost: lost.len() as u32,
            objects_lost,
            bytes_lost,
        }
    }

    /// A replacement for the failed `node` comes up at `now` and starts rebuilding: it takes
    /// writes from now on, and answers reads once [`Self::node_rebuilt`]. None if the node was
    /// not down.
    pub fn repair_node(&mut self, now: Nanos, node: StorageNodeId) -> Option<RebuildPlan> {
        self.advance(now);
        if self.nodes.state(node) != NodeState::Down {
            return None;
        }
        self.cluster.node_repairs += 1;
        self.nodes.set(node, NodeState::Rebuilding);
        let groups: Vec<(u32, u64)> = self
            .nodes
            .starts_of(node.0)
            .map(|s| (s, self.start_shares[s as usize]))
            .filter(|&(_, b)| b > 0)
            .collect();
        Some(RebuildPlan {
            node,
            bytes: self.node_bytes[node.0 as usize],
            groups,
        })
    }

    /// The rebuilding `node` has its shards back at `now` and answers reads again. False if it
    /// was not rebuilding (it failed again meanwhile).
    pub fn node_rebuilt(&mut self, now: Nanos, node: StorageNodeId) -> bool {
        self.advance(now);
        if self.nodes.state(node) != NodeState::Rebuilding {
            return false;
        }
        self.cluster.rebuilds_completed += 1;
        self.nodes.set(node, NodeState::Up);
        true
    }

    /// Deletes every object of the groups starting at `starts`, in expiry-list order (classes
    /// in order, oldest first): (objects, logical bytes).
    fn drop_groups(&mut self, starts: &[u32]) -> (u64, u64) {
        if starts.iter().all(|&s| self.start_objects[s as usize] == 0) {
            return (0, 0);
        }
        let mut lost = vec![false; self.cfg.storage_nodes as usize];
        for &s in starts {
            lost[s as usize] = true;
        }
        let mut victims = Vec::new();
        for list in self.expiry {
            let mut i = list.head;
            while i != NIL {
                let e = &self.slab[i as usize];
                if lost[self.start_of(e.key) as usize] {
                    victims.push(i);
                }
                i = e.exp_next;
            }
        }
        let mut bytes = 0;
        for &v in &victims {
            bytes += self.bytes_of(v);
            self.remove(v);
        }
        self.cluster.lost_objects += victims.len() as u64;
        self.cluster.lost_bytes += bytes;
        (victims.len() as u64, bytes)
    }

    /// Counts the shard bytes a new object of `bytes` bytes in the group starting at `first`
    /// writes to every node of the group that is not down (a down node's share is rebuilt when
    /// it is repaired).
    pub(super) fn record_writes(&mut self, first: u32, bytes: u64) {
        let share = self.share_of(bytes);
        if share == 0 {
            return;
        }
        let check = self.nodes.any_unavailable();
        for node in self.group_nodes(first) {
            if check && self.nodes.state(node) == NodeState::Down {
                continue;
            }
            let p = &mut self.pending_writes[node.0 as usize];
            if *p == 0 {
                self.dirty_nodes.push(node.0);
            }
            *p += share;
            self.cluster.physical_bytes_written += share;
        }
    }

    /// Hands `f` the shard bytes written to each node since the last call (nodes in order of
    /// their first write since then) and forgets them.
    pub fn drain_node_writes(&mut self, mut f: impl FnMut(StorageNodeId, u64)) {
        for node in self.dirty_nodes.drain(..) {
            let p = std::mem::take(&mut self.pending_writes[node as usize]);
            f(StorageNodeId(node), p);
        }
    }

    /// Whether a read of `key`'s group can be decoded now (at most `parity` nodes unavailable).
    #[inline]
    pub fn is_readable(&self, key: BlockKey) -> bool {
        !self.nodes.any_lost() || !self.nodes.is_lost(self.start_of(key))
    }
}
