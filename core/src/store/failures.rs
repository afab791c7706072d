//! When storage nodes fail and get their replacements (SPEC §7): the scheduled failures of the
//! config and, if configured, independent random failures of every server, merged into one
//! stream of events in (time, sequence) order. Sans-IO: the environment pops the events due
//! and applies them to the store ([`super::KvStore::fail_node`], [`super::KvStore::repair_node`]).
//!
//! Random draws are counter-based (the `k`-th draw of node `n` hashes the sub-seed, `n` and
//! `k`), so a node's failure times do not depend on when the other nodes' events are consumed.

use crate::content::hash2;
use crate::ids::StorageNodeId;
use crate::seed::sub_seed;
use crate::store::config::StoreConfig;
use crate::time::Nanos;
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// What happens to a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum NodeEventKind {
    /// The node fails (a failure of a node already down changes nothing).
    Fail,
    /// A replacement comes up and starts rebuilding (a repair of a node that is not down
    /// changes nothing).
    Repair,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeEvent {
    pub at: Nanos,
    pub node: StorageNodeId,
    pub kind: NodeEventKind,
}

/// Where an event came from: random events schedule their node's next one when popped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Origin {
    Scheduled,
    Random,
}

/// (time, sequence, node, kind, origin), earliest first.
type Slot = Reverse<(Nanos, u64, u32, NodeEventKind, Origin)>;

#[derive(Clone, Debug)]
struct RandomDraws {
    seed: u64,
    mtbf_s: f64,
    mttr_s: f64,
    /// Draws taken per node.
    taken: Vec<u64>,
}

impl RandomDraws {
    /// The next exponential draw of `node` with mean `mean_s` seconds.
    fn draw(&mut self, node: u32, mean_s: f64) -> Nanos {
        let k = &mut self.taken[node as usize];
        let bits = hash2(hash2(self.seed, u64::from(node)), *k);
        *k += 1;
        // 53 random bits → u in [0, 1); 1 − u in (0, 1] keeps the logarithm finite.
        let u = (bits >> 11) as f64 / (1u64 << 53) as f64;
        Nanos::from_secs_f64(-(1.0 - u).ln() * mean_s).max(Nanos(1))
    }
}

/// The merged stream of node events.
#[derive(Clone, Debug)]
pub struct FailureSchedule {
    heap: BinaryHeap<Slot>,
    seq: u64,
    random: Option<RandomDraws>,
}

impl FailureSchedule {
    /// The events of `cfg` (validated) for a run with seed `seed`: every scheduled failure and
    /// repair, and each node's first random failure.
    pub fn new(cfg: &StoreConfig, seed: u64) -> Self {
        let mut s = FailureSchedule {
            heap: BinaryHeap::new(),
            seq: 0,
            random: None,
        };
        for f in &cfg.failures {
            for node in f.failed_nodes() {
                s.push(f.at, node, NodeEventKind::Fail, Origin::Scheduled);
                if let Some(r) = f.repair_at {
                    s.push(r, node, NodeEventKind::Repair, Origin::Scheduled);
                }
            }
        }
        if let Some(r) = &cfg.random_failures {
            let mut draws = RandomDraws {
                seed: sub_seed(seed, "store.failures"),
                mtbf_s: r.mtbf.as_secs_f64(),
                mttr_s: r.mttr.as_secs_f64(),
                taken: vec![0; cfg.storage_nodes as usize],
            };
            for node in 0..cfg.storage_nodes {
                let at = draws.draw(node, draws.mtbf_s);
                s.push(at, node, NodeEventKind::Fail, Origin::Random);
            }
            s.random = Some(draws);
        }
        s
    }

    /// No events at all.
    pub fn none() -> Self {
        FailureSchedule {
            heap: BinaryHeap::new(),
            seq: 0,
            random: None,
        }
    }

    fn push(&mut self, at: Nanos, node: u32, kind: NodeEventKind, origin: Origin) {
        self.heap.push(Reverse((at, self.seq, node, kind, origin)));
        self.seq += 1;
    }

    /// The time of the next event, if any.
    pub fn next_at(&self) -> Option<Nanos> {
        self.heap.peek().map(|Reverse(e)| e.0)
    }

    /// Pops the next event if it is due at or before `now`. A random failure schedules its
    /// repair (an exponential time with mean `mttr` later) and a random repair the node's
    /// next failure (mean `mtbf` after the repair).
    pub fn pop_due(&mut self, now: Nanos) -> Option<NodeEvent> {
        if self.next_at()? > now {
            return None;
        }
        let Reverse((at, _, node, kind, origin)) = self.heap.pop()?;
        if origin == Origin::Random
            && let Some(r) = self.random.as_mut()
        {
            let (next, mean) = match kind {
                NodeEventKind::Fail => (NodeEventKind::Repair, r.mttr_s),
                NodeEventKind::Repair => (NodeEventKind::Fail, r.mtbf_s),
            };
            let after = r.draw(node, mean);
            self.push(at.saturating_add(after), node, next, Origin::Random);
        }
        Some(NodeEvent {
            at,
            node: StorageNodeId(node),
            kind,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::config::{RandomFailures, ScheduledFailure};

    fn drain(s: &mut FailureSchedule, until: Nanos) -> Vec<NodeEvent> {
        std::iter::from_fn(|| s.pop_due(until)).collect()
    }

    #[test]
    fn scheduled_events_come_in_time_order() {
        let cfg = StoreConfig {
            storage_nodes: 20,
            failures: vec![
                ScheduledFailure {
                    node: None,
                    nodes: vec![4, 3],
                    at: Nanos(50),
                    repair_at: Some(Nanos(90)),
                },
                ScheduledFailure {
                    node: Some(9),
                    nodes: vec![],
                    at: Nanos(10),
                    repair_at: None,
                },
            ],
            ..Default::default()
        };
        let mut s = FailureSchedule::new(&cfg, 1);
        assert_eq!(s.next_at(), Some(Nanos(10)));
        assert!(s.pop_due(Nanos(9)).is_none());
        let got: Vec<(u64, u32, NodeEventKind)> = drain(&mut s, Nanos::MAX)
            .iter()
            .map(|e| (e.at.0, e.node.0, e.kind))
            .collect();
        use NodeEventKind::*;
        assert_eq!(
            got,
            vec![
                (10, 9, Fail),
                (50, 4, Fail),
                (50, 3, Fail),
                (90, 4, Repair),
                (90, 3, Repair)
            ]
        );
    }

    /// Random failures alternate fail / repair per node, have about the configured means, and
    /// are the same for the same seed whatever else is popped.
    #[test]
    fn random_failures_alternate_with_their_means() {
        let cfg = StoreConfig {
            storage_nodes: 12,
            random_failures: Some(RandomFailures {
                mtbf: Nanos::from_secs(1000),
                mttr: Nanos::from_secs(100),
            }),
            ..Default::default()
        };
        let mut s = FailureSchedule::new(&cfg, 7);
        let events = drain(&mut s, Nanos::from_secs(2_000_000));
        let mut last: Vec<Option<(NodeEventKind, Nanos)>> = vec![None; 12];
        let (mut up_s, mut down_s, mut fails) = (0.0, 0.0, 0u32);
        for e in &events {
            let l = &mut last[e.node.0 as usize];
            let gap = e.at.as_secs_f64() - l.map_or(0.0, |(_, t)| t.as_secs_f64());
            match (l.map(|(k, _)| k), e.kind) {
                (None | Some(NodeEventKind::Repair), NodeEventKind::Fail) => {
                    up_s += gap;
                    fails += 1;
                }
                (Some(NodeEventKind::Fail), NodeEventKind::Repair) => down_s += gap,
                other => panic!("out of order: {other:?}"),
            }
            *l = Some((e.kind, e.at));
        }
        let (mtbf, mttr) = (up_s / f64::from(fails), down_s / f64::from(fails));
        assert!((900.0..1100.0).contains(&mtbf), "mtbf {mtbf}");
        assert!((85.0..115.0).contains(&mttr), "mttr {mttr}");
        let mut again = FailureSchedule::new(&cfg, 7);
        assert_eq!(drain(&mut again, Nanos::from_secs(2_000_000)), events);
        let mut other = FailureSchedule::new(&cfg, 8);
        assert_ne!(drain(&mut other, Nanos::from_secs(2_000_000)), events);
    }
}
