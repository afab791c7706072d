//! The store cluster's nodes in the simulator (SPEC §7): every node is one FIFO queue of
//! device time that reads, writes and rebuilds share.
//!
//! - **Reads.** A fetch is issued as erasure-coded stripe reads, each sent to `data + 1` nodes
//!   of its group and done at the `data`-th answer, with exponential answer tails. With nodes
//!   unavailable the read goes to the group's available nodes in placement order: with one
//!   down (of 10 + 2) it still has a spare answer; with two down the 10 survivors must all
//!   answer (slower: no spare answer hides a tail). A stripe of a group that lost its objects
//!   after its hit was decided is not read (the data is gone) and is counted.
//! - **Writes.** The store counts the shard bytes every write-back puts on each node
//!   ([`KvStore::drain_node_writes`]); before each input the environment drains them and
//!   charges them at the node's write bandwidth in the same queue as its reads.
//! - **Failures and rebuilds.** The failure schedule ([`FailureSchedule`]) is applied to the
//!   store as its events come due. A repaired node rebuilds in rounds of `rebuild.chunk_bytes`:
//!   each round reads, from the available survivors of every group the node belongs to, that
//!   group's part of the round (`data` shards per shard rebuilt, spread evenly over the
//!   survivors) and writes the round to the new node; the next round starts when this one is
//!   done, so reads queue between the rounds. The node answers reads again after the last.

use crate::events::EventQueue;
use crate::service::FetchConfig;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use servelab_core::store::{FailureSchedule, NodeEventKind, RebuildPlan};
use servelab_core::unit::report::{NodeFailureRow, RebuildRow, StorageReport};
use servelab_core::unit::shared::StoreAccess;
use servelab_core::{BlockKey, KvStore, Nanos, StorageNodeId, StoreConfig};

/// The cluster's own events (the failure schedule's come from the store's config).
#[derive(Clone, Copy, Debug)]
enum Rebuilding {
    /// The next round of `node`'s rebuild starts (`epoch` names the rebuild: a node that fails
    /// again abandons its rebuild, whose later events are then ignored).
    Round {
        node: u32,
        epoch: u64,
    },
    Done {
        node: u32,
        epoch: u64,
    },
}

struct Rebuild {
    epoch: u64,
    plan: RebuildPlan,
    remaining: u64,
    /// Its row in the report.
    row: usize,
}

pub struct StorageCluster {
    cfg: FetchConfig,
    ec_data: usize,
    ec_parity: usize,
    write_bytes_per_s: f64,
    charge_writes: bool,
    chunk_bytes: u64,
    node_busy: Vec<Nanos>,
    rng: ChaCha8Rng,
    stripe_keys: Vec<BlockKey>,
    schedule: FailureSchedule,
    events: EventQueue<Rebuilding>,
    rebuilds: Vec<Option<Rebuild>>,
    epochs: u64,
    /// Per node, bytes a rebuild round reads from it (nodes in `touched`).
    round_reads: Vec<f64>,
    touched: Vec<u32>,
    /// When the writes the store counts now were made: the last input's time.
    last_input: Nanos,
    report: StorageReport,
}

/// [`Nanos::from_secs_f64`], bit for bit, without a call to libm's `round`: for positive `v`
/// below 2^63, `v - trunc(v)` is exact, so comparing it with 0.5 rounds half away from zero as
/// `round` does. (A fetch converts dozens of tail draws; `round` was a visible share of it.)
#[inline]
pub(crate) fn nanos_from_secs(s: f64) -> Nanos {
    if s.is_nan() || s <= 0.0 {
        return Nanos(0);
    }
    if s >= u64::MAX as f64 / 1e9 {
        return Nanos::MAX;
    }
    let v = s * 1e9;
    // `i64::MAX as f64` is 2^63 exactly.
    if v < i64::MAX as f64 {
        // Below 2^63 the signed conversions (one instruction each way on x86_64, where the
        // unsigned ones are emulated) give the same values.
        let t = v as i64;
        return Nanos(t as u64 + u64::from(v - t as f64 >= 0.5));
    }
    let t = v as u64;
    Nanos(t + u64::from(v - t as f64 >= 0.5))
}

/// The `k`-th smallest of `xs` (1-based), which it may reorder. A stripe read is done at its
/// `data`-th of `data + 1` answers: the largest or second largest, found in one pass.
pub(crate) fn kth_smallest(xs: &mut [Nanos], k: usize) -> Nanos {
    if k == xs.len() {
        return xs.iter().copied().max().unwrap_or(Nanos::ZERO);
    }
    if k + 1 == xs.len() {
        let (mut hi, mut second) = (Nanos::ZERO, Nanos::ZERO);
        for &x in xs.iter() {
            if x > hi {
                second = hi;
                hi = x;
            } else if x > second {
                second = x;
            }
        }
        return second;
    }
    *xs.select_nth_unstable(k - 1).1
}

/// Takes `bytes` of a node's time at `per_s` bytes per second from `at` on (FIFO after what the
/// node already has queued); returns when it is done.
#[inline]
fn occupy(busy: &mut Nanos, at: Nanos, bytes: f64, per_s: f64) -> Nanos {
    *busy = (*busy).max(at) + nanos_from_secs(bytes / per_s);
    *busy
}

impl StorageCluster {
    pub fn new(cfg: &FetchConfig, store: &StoreConfig, seed: u64) -> Self {
        let n = store.storage_nodes as usize;
        StorageCluster {
            cfg: cfg.clone(),
            ec_data: store.ec_data_shards as usize,
            ec_parity: store.ec_parity_shards as usize,
            write_bytes_per_s: store.node.write_bytes_per_s,
            charge_writes: store.node.charge_writes,
            chunk_bytes: store.rebuild.chunk_bytes,
            node_busy: vec![Nanos::ZERO; n],
            rng: ChaCha8Rng::seed_from_u64(servelab_core::seed::sub_seed(seed, "service.fetch")),
            stripe_keys: Vec::new(),
            schedule: FailureSchedule::new(store, seed),
            events: EventQueue::new(),
            rebuilds: (0..n).map(|_| None).collect(),
            epochs: 0,
            round_reads: vec![0.0; n],
            touched: Vec::new(),
            last_input: Nanos::ZERO,
            report: StorageReport::default(),
        }
    }

    /// Until `node`'s queue is free (tests and checks).
    pub fn node_busy_until(&self, node: StorageNodeId) -> Nanos {
        self.node_busy[node.0 as usize]
    }

    /// Reads `bytes` spread over the blocks `keys` (`fallback` keys a request with no full
    /// block) starting at `now`; returns when every stripe is done.
    pub fn fetch(
        &mut self,
        now: Nanos,
        store: &KvStore,
        keys: &[BlockKey],
        fallback: BlockKey,
        bytes: u64,
    ) -> Nanos {
        let f = &self.cfg;
        let stripes = (f.stripes as usize).min(keys.len()).max(1);
        let data = self.ec_data;
        let per_node = bytes as f64 / stripes as f64 / data as f64;
        let transfer = Nanos::from_secs_f64(per_node / f.node_read_bytes_per_s);
        let mut done = now;
        // The stripes' keys sit far apart in a long chain: load them all before the loop
        // below, so their cache misses overlap instead of stalling one stripe each.
        let mut stripe_keys = std::mem::take(&mut self.stripe_keys);
        stripe_keys.clear();
        stripe_keys.extend((0..stripes).map(|s| {
            keys.get(s * keys.len() / stripes)
                .copied()
                .unwrap_or(fallback)
        }));
        let degraded = store.nodes().any_unavailable();
        self.report.stripe_reads += stripes as u64;
        for &key in &stripe_keys {
            let end = if degraded {
                self.read_degraded(now, store, key, transfer)
            } else {
                Some(self.read_stripe(now, store.placement_nodes(key), transfer))
            };
            if let Some(end) = end {
                done = done.max(end);
            }
        }
        self.stripe_keys = stripe_keys;
        done
    }

    /// One stripe read from `nodes` (the first `data + 1` asked), done at the `data`-th answer.
    fn read_stripe(
        &mut self,
        now: Nanos,
        nodes: impl Iterator<Item = StorageNodeId>,
        transfer: Nanos,
    ) -> Nanos {
        let f = &self.cfg;
        let data = self.ec_data;
        let ask = (data + 1).min(data + self.ec_parity);
        let tail_mean_s = f.tail_mean.as_secs_f64();
        let mut answers = [Nanos::ZERO; 64];
        let mut asked = 0;
        for (a, node) in nodes.take(ask).enumerate() {
            let busy = &mut self.node_busy[node.0 as usize];
            let start = (*busy).max(now);
            *busy = start + transfer;
            // Ziggurat sampling: almost never a logarithm.
            let x: f64 = self.rng.sample(rand_distr::Exp1);
            let tail = nanos_from_secs(x * tail_mean_s);
            answers[a.min(63)] = *busy + f.latency + tail;
            asked = a + 1;
        }
        let got = &mut answers[..asked.min(64)];
        let k = data.min(got.len());
        kth_smallest(got, k)
    }

    /// A stripe read while some node is unavailable: from the group's available nodes; None
    /// (not read) if fewer than `data` are left: the group lost its objects after the hit.
    fn read_degraded(
        &mut self,
        now: Nanos,
        store: &KvStore,
        key: BlockKey,
        transfer: Nanos,
    ) -> Option<Nanos> {
        let nodes = store.nodes();
        let unavailable = nodes.unavailable_in(store.start_of(key)) as usize;
        let available =
            self.ec_data + self.ec_parity - unavailable.min(self.ec_data + self.ec_parity);
        if available < self.ec_data {
            self.report.lost_stripe_reads += 1;
            return None;
        }
        if unavailable > 0 {
            self.report.degraded_stripe_reads += 1;
        }
        if available == self.ec_data {
            self.report.no_spare_stripe_reads += 1;
        }
        let up = store.placement_nodes(key).filter(|&n| nodes.is_up(n));
        Some(self.read_stripe(now, up, transfer))
    }

    /// Before the input at `now`: charges the writes the last input made, then applies the
    /// failure schedule and the rebuilds' rounds due by `now`, in time order.
    pub fn update(&mut self, now: Nanos, store: &mut StoreAccess) {
        self.charge_writes(self.last_input, store);
        // A store shared by a parallel cluster run has no failures (the cluster refuses them).
        let Some(store) = store.owned_mut() else {
            self.last_input = self.last_input.max(now);
            return;
        };
        loop {
            let failure = self.schedule.next_at().filter(|&t| t <= now);
            let rebuild = self.events.peek_time().filter(|&t| t <= now);
            match (failure, rebuild) {
                (Some(f), r) if r.is_none_or(|r| f <= r) => {
                    let Some(e) = self.schedule.pop_due(now) else {
                        break;
                    };
                    match e.kind {
                        NodeEventKind::Fail => self.fail(e.at, e.node, store),
                        NodeEventKind::Repair => self.repair(e.at, e.node, store),
                    }
                }
                (_, Some(_)) => {
                    let Some((t, ev)) = self.events.pop() else {
                        break;
                    };
                    match ev {
                        Rebuilding::Round { node, epoch } => self.round(t, node, epoch, store),
                        Rebuilding::Done { node, epoch } => self.rebuilt(t, node, epoch, store),
                    }
                }
                _ => break,
            }
        }
        self.last_input = self.last_input.max(now);
    }

    /// Charges the shard bytes written since the last drain to their nodes at `at`.
    fn charge_writes(&mut self, at: Nanos, store: &mut StoreAccess) {
        let (busy, report) = (&mut self.node_busy, &mut self.report);
        let (charge, per_s) = (self.charge_writes, self.write_bytes_per_s);
        store.drain_node_writes(|node, bytes| {
            report.write_bytes += bytes;
            if charge {
                let b = &mut busy[node.0 as usize];
                let start = (*b).max(at);
                let end = occupy(b, at, bytes as f64, per_s);
                report.write_busy_s += (end - start).as_secs_f64();
            }
        });
    }

    fn fail(&mut self, at: Nanos, node: StorageNodeId, store: &mut KvStore) {
        let c = store.fail_node(at, node);
        if !c.changed {
            return;
        }
        self.report.failures.push(NodeFailureRow {
            node: node.0,
            at_s: at.as_secs_f64(),
            groups_lost: c.groups_lost,
            lost_objects: c.objects_lost,
            lost_bytes: c.bytes_lost,
        });
        if let Some(r) = self.rebuilds[node.0 as usize].take() {
            self.report.rebuilds[r.row].outcome = "aborted";
        }
    }

    fn repair(&mut self, at: Nanos, node: StorageNodeId, store: &mut KvStore) {
        let Some(plan) = store.repair_node(at, node) else {
            return;
        };
        self.epochs += 1;
        let epoch = self.epochs;
        self.report.rebuilds.push(RebuildRow {
            node: node.0,
            started_s: at.as_secs_f64(),
            finished_s: f64::NAN,
            duration_s: f64::NAN,
            bytes: plan.bytes,
            read_bytes: 0,
            outcome: "unfinished",
        });
        let row = self.report.rebuilds.len() - 1;
        let remaining = plan.bytes;
        self.rebuilds[node.0 as usize] = Some(Rebuild {
            epoch,
            plan,
            remaining,
            row,
        });
        let first = if remaining == 0 {
            Rebuilding::Done {
                node: node.0,
                epoch,
            }
        } else {
            Rebuilding::Round {
                node: node.0,
                epoch,
            }
        };
        self.events.push(at, first);
    }

    /// One round of `node`'s rebuild at `t`: reads from the survivors, writes to the node.
    fn round(&mut self, t: Nanos, node: u32, epoch: u64, store: &KvStore) {
        let Some(r) = self.rebuilds[node as usize]
            .as_mut()
            .filter(|r| r.epoch == epoch)
        else {
            return;
        };
        let chunk = self.chunk_bytes.min(r.remaining);
        r.remaining -= chunk;
        let share = chunk as f64 / r.plan.bytes as f64;
        let (data, group) = (self.ec_data, (self.ec_data + self.ec_parity) as u32);
        let nodes = store.nodes();
        let n = nodes.len();
        for &(start, bytes) in &r.plan.groups {
            let survivors = (0..group)
                .map(|k| StorageNodeId((start + k) % n))
                .filter(|&m| m.0 != node && nodes.is_up(m));
            let k = survivors.clone().count();
            // A group left with fewer than `data` survivors lost its objects: nothing to read.
            if k < data {
                continue;
            }
            let each = bytes as f64 * share * data as f64 / k as f64;
            for m in survivors {
                if self.round_reads[m.0 as usize] == 0.0 {
                    self.touched.push(m.0);
                }
                self.round_reads[m.0 as usize] += each;
            }
        }
        let read_bw = self.cfg.node_read_bytes_per_s;
        let mut done = occupy(
            &mut self.node_busy[node as usize],
            t,
            chunk as f64,
            self.write_bytes_per_s,
        );
        let mut read = 0.0;
        for m in self.touched.drain(..) {
            let b = std::mem::take(&mut self.round_reads[m as usize]);
            read += b;
            done = done.max(occupy(&mut self.node_busy[m as usize], t, b, read_bw));
        }
        let row = &mut self.report.rebuilds[r.row];
        row.read_bytes += read.round() as u64;
        self.report.rebuild_bytes += chunk;
        self.report.rebuild_read_bytes += read.round() as u64;
        let next = if r.remaining == 0 {
            Rebuilding::Done { node, epoch }
        } else {
            Rebuilding::Round { node, epoch }
        };
        self.events.push(done, next);
    }

    fn rebuilt(&mut self, t: Nanos, node: u32, epoch: u64, store: &mut KvStore) {
        let Some(r) = self.rebuilds[node as usize].take_if(|r| r.epoch == epoch) else {
            return;
        };
        if store.node_rebuilt(t, StorageNodeId(node)) {
            let row = &mut self.report.rebuilds[r.row];
            row.finished_s = t.as_secs_f64();
            row.duration_s = row.finished_s - row.started_s;
            row.outcome = "done";
        }
    }

    /// The report at the end of the run: charges the last writes and adds the store's counts.
    pub fn finish(&mut self, store: &mut StoreAccess) -> StorageReport {
        self.charge_writes(self.last_input, store);
        let c = store.cluster_stats();
        StorageReport {
            node_failures: c.node_failures,
            node_repairs: c.node_repairs,
            rebuilds_completed: c.rebuilds_completed,
            group_losses: c.group_losses,
            lost_objects: c.lost_objects,
            lost_bytes: c.lost_bytes,
            writes_refused: c.writes_refused,
            writes_refused_bytes: c.writes_refused_bytes,
            ..self.report.clone()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use servelab_core::{ClassTtl, TrafficClass};

    /// 12 nodes (one group: 10 + 2), blocks of 100 bytes, reads at `read_bw` and writes at
    /// `write_bw` bytes per second, 100 µs answer latency, no tails, one stripe per fetch.
    fn cluster(read_bw: f64, write_bw: f64) -> (StorageCluster, KvStore) {
        let mut store = StoreConfig {
            storage_nodes: 12,
            ttl: ClassTtl::none(),
            ..Default::default()
        };
        store.node.write_bytes_per_s = write_bw;
        store.rebuild.chunk_bytes = 1 << 20;
        let fetch = FetchConfig {
            node_read_bytes_per_s: read_bw,
            latency: Nanos::from_micros(100),
            tail_mean: Nanos::ZERO,
            stripes: 1,
        };
        let c = StorageCluster::new(&fetch, &store, 1);
        (c, KvStore::new(store, 100).unwrap())
    }

    /// A read of 10 MB from the group starting at node 0 at 1 GB/s: 1 MB a node, 1 ms, plus
    /// 100 µs. Node 3 is busy until 5 ms. By hand:
    /// - all up: nodes 0..=10 asked, done at the 10th answer: 1.1 ms (node 3's late answer is
    ///   the spare one);
    /// - node 0 down: nodes 1..=11 asked, still one spare: 1.1 ms;
    /// - nodes 0 and 11 down: the 10 survivors must all answer, node 3 included:
    ///   5 + 1 + 0.1 = 6.1 ms;
    /// - node 5 down too: the group lost its objects; nothing is read.
    #[test]
    fn degraded_read_times_by_hand() {
        let (mut c, mut store) = cluster(1e9, 5e9);
        let key = BlockKey(0);
        let read = |c: &mut StorageCluster, store: &KvStore| {
            c.node_busy = vec![Nanos::ZERO; 12];
            c.node_busy[3] = Nanos::from_millis(5);
            c.fetch(Nanos::ZERO, store, &[key], key, 10_000_000)
        };
        assert_eq!(read(&mut c, &store), Nanos::from_micros(1100));
        store.fail_node(Nanos::ZERO, StorageNodeId(0));
        assert_eq!(read(&mut c, &store), Nanos::from_micros(1100));
        store.fail_node(Nanos::ZERO, StorageNodeId(11));
        assert_eq!(read(&mut c, &store), Nanos::from_micros(6100));
        store.fail_node(Nanos::ZERO, StorageNodeId(5));
        assert_eq!(read(&mut c, &store), Nanos::ZERO, "not read: done at once");
        let r = &c.report;
        assert_eq!(
            (
                r.stripe_reads,
                r.degraded_stripe_reads,
                r.no_spare_stripe_reads
            ),
            (4, 2, 1)
        );
        assert_eq!(r.lost_stripe_reads, 1);
    }

    /// A block written at 0 puts a 10-byte shard on each of the 12 nodes; at 10 bytes/s each
    /// node is busy writing until 1 s, so a read at 0.5 s (100 bytes a node at 100 bytes/s)
    /// starts at 1 s and is done at 2 s + 100 µs.
    #[test]
    fn writes_and_reads_share_a_node() {
        let (mut c, store) = cluster(100.0, 10.0);
        let mut store = StoreAccess::Owned(store);
        store.put(Nanos::ZERO, BlockKey(0), 100, TrafficClass::Agent);
        c.update(Nanos::ZERO, &mut store); // the input that wrote it
        c.update(Nanos::from_millis(500), &mut store);
        assert_eq!(c.node_busy_until(StorageNodeId(7)), Nanos::from_secs(1));
        let done = c.fetch(
            Nanos::from_millis(500),
            &store,
            &[BlockKey(0)],
            BlockKey(0),
            1000,
        );
        assert_eq!(done, Nanos::from_secs(2) + Nanos::from_micros(100));
        assert_eq!(c.report.write_bytes, 120);
        assert!((c.report.write_busy_s - 12.0).abs() < 1e-9);
    }

    /// Twelve blocks (one per start node) give every node twelve 10-byte shards. Node 0 fails
    /// and is repaired at 0: its rebuild (one round) writes 120 bytes at 120 bytes/s (1 s) and
    /// reads 10 shards per shard rebuilt, 1,200 bytes spread over the 11 survivors: 109.09 bytes
    /// each at 100 bytes/s, 1.0909 s, the round's end. A read at 0.5 s (100 bytes a node, 1 s)
    /// waits for the survivors' rebuild reads: done at 1.0909 + 1 s + 100 µs; node 0 answers
    /// again from 1.0909 s.
    #[test]
    fn rebuild_traffic_competes_with_reads() {
        let (mut c, store) = cluster(100.0, 120.0);
        let mut store = StoreAccess::Owned(store);
        for k in 0..12 {
            store.put(Nanos::ZERO, BlockKey(k), 100, TrafficClass::Agent);
        }
        c.update(Nanos::ZERO, &mut store);
        c.node_busy = vec![Nanos::ZERO; 12]; // forget the writes
        c.schedule = FailureSchedule::none();
        c.fail(Nanos::ZERO, StorageNodeId(0), store.owned_mut().unwrap());
        c.repair(Nanos::ZERO, StorageNodeId(0), store.owned_mut().unwrap());
        c.update(Nanos::from_millis(500), &mut store);
        let round = Nanos::from_secs_f64(1200.0 / 11.0 / 100.0);
        assert_eq!(c.node_busy_until(StorageNodeId(1)), round);
        assert_eq!(c.node_busy_until(StorageNodeId(0)), Nanos::from_secs(1));
        let done = c.fetch(
            Nanos::from_millis(500),
            &store,
            &[BlockKey(0)],
            BlockKey(0),
            1000,
        );
        assert_eq!(done, round + Nanos::from_secs(1) + Nanos::from_micros(100));
        assert!(!store.nodes().is_up(StorageNodeId(0)));
        c.update(round, &mut store);
        assert!(store.nodes().is_up(StorageNodeId(0)));
        let rep = c.finish(&mut store);
        let row = &rep.rebuilds[0];
        assert_eq!(
            (row.outcome, row.bytes, row.read_bytes),
            ("done", 120, 1200)
        );
        assert!((row.duration_s - round.as_secs_f64()).abs() < 1e-12);
        assert_eq!(
            (rep.node_failures, rep.node_repairs, rep.rebuilds_completed),
            (1, 1, 1)
        );
    }

    proptest! {
        #[test]
        fn nanos_from_secs_matches_nanos(s in prop_oneof![0.0..1e-3f64, 0.0..1e3f64, -1.0..1e11f64],
                                         half in 0u64..1_000_000) {
            prop_assert_eq!(nanos_from_secs(s), Nanos::from_secs_f64(s));
            // Exact halves of a nanosecond round away from zero.
            let h = (half as f64 + 0.5) / 1e9;
            prop_assert_eq!(nanos_from_secs(h), Nanos::from_secs_f64(h));
        }

        /// The one-pass largest / second largest agrees with sorting, duplicates included.
        #[test]
        fn kth_smallest_matches_sorting(xs in proptest::collection::vec(0u64..20, 1..14), pick in 0usize..3) {
            let mut v: Vec<Nanos> = xs.iter().map(|&x| Nanos(x)).collect();
            let mut sorted = v.clone();
            sorted.sort();
            let k = v.len().saturating_sub(pick).max(1);
            prop_assert_eq!(kth_smallest(&mut v, k), sorted[k - 1]);
        }
    }
}
