//! Which storage nodes can answer (SPEC §7), and what that means for the erasure-coded groups.
//!
//! An object lives on the `data + parity` consecutive nodes starting at its *start* node
//! ([`super::KvStore::placement`]), so there are as many groups as nodes, one per start. A group
//! with up to `parity` nodes unavailable still decodes every object (degraded reads: fewer or no
//! spare answers); with more, its objects are lost. A node is unavailable from its failure
//! until its replacement has rebuilt its shards.

use crate::ids::StorageNodeId;
use serde::{Deserialize, Serialize};

/// One storage node's condition.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeState {
    Up,
    /// Failed: answers nothing, receives no writes.
    Down,
    /// A replacement rebuilding the failed node's shards from the survivors: it receives new
    /// writes but answers no reads until the rebuild is done.
    Rebuilding,
}

/// The nodes' states and, per group, how many of its nodes are unavailable.
#[derive(Clone, Debug)]
pub struct NodeSet {
    state: Vec<NodeState>,
    /// Per start node: unavailable nodes among the group's.
    unavailable_in: Vec<u32>,
    group: u32,
    parity: u32,
    /// Nodes not up.
    unavailable: u32,
    /// Groups with more than `parity` nodes unavailable.
    lost: u32,
}

impl NodeSet {
    /// `nodes` nodes, all up, in groups of `data + parity` consecutive nodes.
    pub fn new(nodes: u32, data: u32, parity: u32) -> Self {
        NodeSet {
            state: vec![NodeState::Up; nodes as usize],
            unavailable_in: vec![0; nodes as usize],
            group: data + parity,
            parity,
            unavailable: 0,
            lost: 0,
        }
    }

    pub fn len(&self) -> u32 {
        self.state.len() as u32
    }
    pub fn is_empty(&self) -> bool {
        self.state.is_empty()
    }
    pub fn state(&self, node: StorageNodeId) -> NodeState {
        self.state[node.0 as usize]
    }
    /// The node answers reads.
    #[inline]
    pub fn is_up(&self, node: StorageNodeId) -> bool {
        self.state[node.0 as usize] == NodeState::Up
    }
    /// Some node is not up (the fast paths skip every check while all are).
    #[inline]
    pub fn any_unavailable(&self) -> bool {
        self.unavailable > 0
    }
    pub fn unavailable_nodes(&self) -> u32 {
        self.unavailable
    }
    /// Some group has lost its objects.
    #[inline]
    pub fn any_lost(&self) -> bool {
        self.lost > 0
    }
    pub fn lost_groups(&self) -> u32 {
        self.lost
    }
    /// Unavailable nodes of the group starting at `start`.
    #[inline]
    pub fn unavailable_in(&self, start: u32) -> u32 {
        self.unavailable_in[start as usize]
    }
    /// The group starting at `start` has lost its objects.
    #[inline]
    pub fn is_lost(&self, start: u32) -> bool {
        self.unavailable_in[start as usize] > self.parity
    }

    /// The start nodes of the groups `node` belongs to (`node`, `node − 1`, …, wrapping).
    pub fn starts_of(&self, node: u32) -> impl Iterator<Item = u32> + use<> {
        let n = self.len();
        (0..self.group).map(move |k| (node + n - k) % n)
    }

    /// Sets `node`'s state; returns the start nodes of the groups whose loss changed
    /// (newly lost when the node became unavailable, no longer lost when it came back).
    pub fn set(&mut self, node: StorageNodeId, to: NodeState) -> Vec<u32> {
        let from = std::mem::replace(&mut self.state[node.0 as usize], to);
        let (was_up, is_up) = (from == NodeState::Up, to == NodeState::Up);
        if was_up == is_up {
            return Vec::new();
        }
        let mut changed = Vec::new();
        for s in self.starts_of(node.0) {
            let c = &mut self.unavailable_in[s as usize];
            let before = *c > self.parity;
            if is_up {
                *c -= 1;
            } else {
                *c += 1;
            }
            if before != (*c > self.parity) {
                changed.push(s);
            }
        }
        if is_up {
            self.unavailable -= 1;
            self.lost -= changed.len() as u32;
        } else {
            self.unavailable += 1;
            self.lost += changed.len() as u32;
        }
        changed
    }

    /// The per-group counts agree with the node states.
    pub fn check(&self) -> Result<(), String> {
        let n = self.len();
        let mut lost = 0;
        for s in 0..n {
            let down = (0..self.group)
                .filter(|k| self.state[((s + k) % n) as usize] != NodeState::Up)
                .count() as u32;
            if down != self.unavailable_in[s as usize] {
                return Err(format!(
                    "group {s}: {down} nodes unavailable, counted {}",
                    self.unavailable_in[s as usize]
                ));
            }
            lost += u32::from(down > self.parity);
        }
        let unavailable = self.state.iter().filter(|&&s| s != NodeState::Up).count() as u32;
        if unavailable != self.unavailable || lost != self.lost {
            return Err("node availability counters drifted".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Nodes 5, 6, 7 of 15 in groups of 12: the groups holding all three (starts 11..=14 and
    /// 0..=5, by hand: a group starting at s covers s..s+11 mod 15) are lost; repairing one
    /// node recovers them.
    #[test]
    fn three_down_loses_the_groups_that_hold_all_three() {
        let mut s = NodeSet::new(15, 10, 2);
        assert!(s.set(StorageNodeId(5), NodeState::Down).is_empty());
        assert!(s.set(StorageNodeId(6), NodeState::Down).is_empty());
        let mut lost = s.set(StorageNodeId(7), NodeState::Down);
        lost.sort();
        assert_eq!(lost, vec![0, 1, 2, 3, 4, 5, 11, 12, 13, 14]);
        assert_eq!((s.lost_groups(), s.unavailable_nodes()), (10, 3));
        assert!(s.is_lost(0) && !s.is_lost(6) && s.unavailable_in(6) == 2);
        // Down → rebuilding changes no availability.
        assert!(s.set(StorageNodeId(6), NodeState::Rebuilding).is_empty());
        assert_eq!(s.set(StorageNodeId(6), NodeState::Up).len(), 10);
        assert!(!s.any_lost());
        s.check().unwrap();
    }

    #[test]
    fn check_catches_a_drifted_count() {
        let mut s = NodeSet::new(13, 10, 2);
        s.set(StorageNodeId(3), NodeState::Down);
        s.check().unwrap();
        s.unavailable_in[0] += 1;
        assert!(s.check().is_err());
    }
}
