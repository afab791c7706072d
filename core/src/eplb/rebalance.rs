//! `rebalance_experts`: DeepSeek's open EPLB (SPEC §9), reimplemented from its description.
//!
//! The output is decided exactly by these rules, so that a placement computed here matches the
//! reference for the same inputs:
//!
//! - loads are `f32`; a group's load is the sum of its experts' loads, computed in `f64` and rounded
//!   once (identical to any `f32` summation order whenever that one is exact, e.g. token counts
//!   below 2^24);
//! - *balanced packing* of `n` items into `m` packs of exactly `n / m` items: items are visited in
//!   descending weight with a stable sort (equal weights keep index order) and each goes to the
//!   pack with the smallest `f32` running weight that still has room, lowest pack index on ties.
//!   With one item per pack the packing is the identity (item `i` in pack `i`);
//! - *replication*: each redundant slot goes to the expert with the highest `weight / count`
//!   (`f32` division), lowest index on ties; the new replica's rank is the expert's count before
//!   the increment;
//! - *hierarchical* policy when `num_groups % num_nodes == 0`: pack groups onto nodes, renumber
//!   experts node by node (group order within a node is the group's rank in its pack), replicate
//!   within each node to `num_replicas / num_nodes` slots (ties therefore break on the node-local
//!   index), then pack each node's physical replicas, weighted by `weight / count`, onto its GPUs;
//!   a GPU's slots are ordered by rank in its pack. Otherwise the *global* policy runs the same
//!   pipeline with one group and one node.
//!
//! Unlike the reference, shapes are validated up front and reported as [`EplbError`]s instead of
//! assertions, and exactly the shapes the reference accepts are accepted: every count positive,
//! `num_replicas` a multiple of `num_gpus` and at least the number of experts, and, for the
//! hierarchical policy only, `num_experts % num_groups == 0` and `num_gpus % num_nodes == 0`. The
//! global policy runs with one group on one node, so there the experts need not divide by the
//! groups nor the GPUs by the nodes. Beyond the reference, sizes whose output would not fit in
//! memory ([`MAX_REPLICAS`] slots a layer, [`MAX_CELLS`] entries in a table) are refused.

use serde::Serialize;
use thiserror::Error;

/// Why a set of inputs has no placement.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum EplbError {
    #[error("the load matrix has no layers")]
    NoLayers,
    #[error("the load matrix has no experts (layer 0 is empty)")]
    NoExperts,
    #[error(
        "layer {layer} has {len} experts but layer 0 has {expected} (rows must all have the same length)"
    )]
    RaggedRows {
        layer: usize,
        len: usize,
        expected: usize,
    },
    #[error(
        "load of layer {layer}, expert {expert} is {value}: loads must be finite and non-negative"
    )]
    BadLoad {
        layer: usize,
        expert: usize,
        value: f32,
    },
    #[error("`{name}` must be at least 1")]
    Zero { name: &'static str },
    #[error("num_replicas ({replicas}) is not a multiple of num_gpus ({gpus})")]
    ReplicasNotMultipleOfGpus { replicas: usize, gpus: usize },
    #[error(
        "num_replicas ({replicas}) is smaller than the number of logical experts ({experts}): every expert needs a slot"
    )]
    FewerReplicasThanExperts { replicas: usize, experts: usize },
    #[error("the number of logical experts ({experts}) is not divisible by num_groups ({groups})")]
    ExpertsNotDivisibleByGroups { experts: usize, groups: usize },
    #[error("num_gpus ({gpus}) is not divisible by num_nodes ({nodes})")]
    GpusNotDivisibleByNodes { gpus: usize, nodes: usize },
    #[error("{what} would hold {cells} entries, more than the {max} accepted")]
    TooLarge {
        what: &'static str,
        cells: u128,
        max: u64,
    },
}

/// The most physical slots per layer accepted (DeepSeek's deployments use a few hundred).
pub const MAX_REPLICAS: usize = 1 << 20;
/// The most entries accepted in one output table (`phy2log`, `log2phy`: layers × slots, layers ×
/// experts × the largest replica count), 2^26: at most 512 MiB each.
pub const MAX_CELLS: u64 = 1 << 26;

/// Whether DeepSeek's reference takes the hierarchical policy for these counts (it does when the
/// groups divide over the nodes; otherwise it runs the global policy: one group, one node).
pub fn is_hierarchical(num_groups: usize, num_nodes: usize) -> bool {
    num_nodes != 0 && num_groups.is_multiple_of(num_nodes)
}

/// The placement of physical expert slots, per layer.
///
/// Physical slot `s` lives on GPU `s / (num_replicas / num_gpus)`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct EplbPlacement {
    /// `[layer][slot]`: the logical expert held by each physical slot.
    pub phy2log: Vec<Vec<usize>>,
    /// `[layer][expert][rank]`: the slot of each replica of an expert, by replica rank, padded
    /// with -1 to the largest replica count of any expert in any layer.
    pub log2phy: Vec<Vec<Vec<i64>>>,
    /// `[layer][expert]`: how many slots hold each logical expert.
    pub logcnt: Vec<Vec<usize>>,
}

impl EplbPlacement {
    /// Builds a placement from `phy2log` alone: replica ranks follow slot order, and every expert
    /// in `0..num_experts` must appear at least once. Used for static placements.
    pub fn from_phy2log(phy2log: Vec<Vec<usize>>, num_experts: usize) -> Result<Self, EplbError> {
        let ranks = phy2log
            .iter()
            .map(|row| {
                let mut seen = vec![0usize; num_experts];
                row.iter()
                    .map(|&e| {
                        let r = seen[e];
                        seen[e] += 1;
                        r
                    })
                    .collect()
            })
            .collect::<Vec<Vec<usize>>>();
        let logcnt: Vec<Vec<usize>> = phy2log
            .iter()
            .map(|row| {
                let mut c = vec![0usize; num_experts];
                for &e in row {
                    c[e] += 1;
                }
                c
            })
            .collect();
        if let Some((layer, expert)) = logcnt
            .iter()
            .enumerate()
            .find_map(|(l, c)| c.iter().position(|&n| n == 0).map(|e| (l, e)))
        {
            return Err(EplbError::FewerReplicasThanExperts {
                replicas: phy2log[layer].len(),
                experts: num_experts.max(expert + 1),
            });
        }
        Ok(Self::assemble(phy2log, &ranks, logcnt))
    }

    fn assemble(phy2log: Vec<Vec<usize>>, ranks: &[Vec<usize>], logcnt: Vec<Vec<usize>>) -> Self {
        let max_cnt = logcnt.iter().flatten().copied().max().unwrap_or(0);
        let log2phy = phy2log
            .iter()
            .zip(ranks)
            .zip(&logcnt)
            .map(|((row, rank), cnt)| {
                let mut m = vec![vec![-1i64; max_cnt]; cnt.len()];
                for (slot, (&e, &r)) in row.iter().zip(rank).enumerate() {
                    m[e][r] = slot as i64;
                }
                m
            })
            .collect();
        EplbPlacement {
            phy2log,
            log2phy,
            logcnt,
        }
    }

    pub fn num_layers(&self) -> usize {
        self.phy2log.len()
    }

    pub fn num_slots(&self) -> usize {
        self.phy2log.first().map_or(0, Vec::len)
    }

    pub fn num_experts(&self) -> usize {
        self.logcnt.first().map_or(0, Vec::len)
    }
}

/// Checks the shape of `weight` and the parameters; returns the number of experts.
fn validate(
    weight: &[Vec<f32>],
    num_replicas: usize,
    num_groups: usize,
    num_nodes: usize,
    num_gpus: usize,
) -> Result<usize, EplbError> {
    for (name, v) in [
        ("num_replicas", num_replicas),
        ("num_groups", num_groups),
        ("num_nodes", num_nodes),
        ("num_gpus", num_gpus),
    ] {
        if v == 0 {
            return Err(EplbError::Zero { name });
        }
    }
    let experts = validate_loads(weight)?;
    validate_replicas(weight.len(), experts, num_replicas, num_gpus)?;
    // The global policy is the hierarchical one with one group on one node: these two checks
    // are the reference's only for the hierarchical policy.
    if is_hierarchical(num_groups, num_nodes) {
        if !experts.is_multiple_of(num_groups) {
            return Err(EplbError::ExpertsNotDivisibleByGroups {
                experts,
                groups: num_groups,
            });
        }
        if !num_gpus.is_multiple_of(num_nodes) {
            return Err(EplbError::GpusNotDivisibleByNodes {
                gpus: num_gpus,
                nodes: num_nodes,
            });
        }
    }
    Ok(experts)
}

/// Checks that `weight` has layers of one nonzero width and only finite, non-negative loads;
/// returns the width (the number of experts).
fn validate_loads(weight: &[Vec<f32>]) -> Result<usize, EplbError> {
    let first = weight.first().ok_or(EplbError::NoLayers)?;
    let experts = first.len();
    if experts == 0 {
        return Err(EplbError::NoExperts);
    }
    for (layer, row) in weight.iter().enumerate() {
        if row.len() != experts {
            return Err(EplbError::RaggedRows {
                layer,
                len: row.len(),
                expected: experts,
            });
        }
        // `!(v >= 0)` also catches NaN.
        if let Some((expert, &value)) = row
            .iter()
            .enumerate()
            .find(|(_, v)| !(**v >= 0.0 && v.is_finite()))
        {
            return Err(EplbError::BadLoad {
                layer,
                expert,
                value,
            });
        }
    }
    Ok(experts)
}

/// Checks that `num_replicas` slots spread evenly over the GPUs, hold every expert, and stay
/// within the accepted sizes over `layers` layers.
fn validate_replicas(
    layers: usize,
    experts: usize,
    num_replicas: usize,
    num_gpus: usize,
) -> Result<(), EplbError> {
    if !num_replicas.is_multiple_of(num_gpus) {
        return Err(EplbError::ReplicasNotMultipleOfGpus {
            replicas: num_replicas,
            gpus: num_gpus,
        });
    }
    if num_replicas < experts {
        return Err(EplbError::FewerReplicasThanExperts {
            replicas: num_replicas,
            experts,
        });
    }
    if num_replicas > MAX_REPLICAS {
        return Err(EplbError::TooLarge {
            what: "a layer of num_replicas slots",
            cells: num_replicas as u128,
            max: MAX_REPLICAS as u64,
        });
    }
    let cells = layers as u128 * num_replicas as u128;
    if cells > u128::from(MAX_CELLS) {
        return Err(EplbError::TooLarge {
            what: "phy2log (layers × num_replicas)",
            cells,
            max: MAX_CELLS,
        });
    }
    Ok(())
}

/// Places `num_replicas` physical expert slots over `num_gpus` GPUs for every layer of
/// `weight` (`[layers][logical experts]`, e.g. token counts over a statistics window).
///
/// See the module docs for the exact rules. Errors name the impossible shape; valid inputs never
/// panic.
pub fn rebalance_experts(
    weight: &[Vec<f32>],
    num_replicas: usize,
    num_groups: usize,
    num_nodes: usize,
    num_gpus: usize,
) -> Result<EplbPlacement, EplbError> {
    let experts = validate(weight, num_replicas, num_groups, num_nodes, num_gpus)?;
    let (groups, nodes) = if is_hierarchical(num_groups, num_nodes) {
        (num_groups, num_nodes)
    } else {
        (1, 1)
    };
    let shape = Shape {
        experts,
        replicas: num_replicas,
        groups,
        nodes,
        gpus: num_gpus,
    };
    let mut scratch = PackScratch::default();
    let mut phy2log = Vec::with_capacity(weight.len());
    let mut ranks = Vec::with_capacity(weight.len());
    let mut logcnt = Vec::with_capacity(weight.len());
    for row in weight {
        let (p, r, c) = rebalance_layer(row, &shape, &mut scratch);
        phy2log.push(p);
        ranks.push(r);
        logcnt.push(c);
    }
    // log2phy is padded to the largest replica count: bounded before it is allocated.
    let max_cnt = logcnt.iter().flatten().copied().max().unwrap_or(0);
    let cells = weight.len() as u128 * experts as u128 * max_cnt as u128;
    if cells > u128::from(MAX_CELLS) {
        return Err(EplbError::TooLarge {
            what: "log2phy (layers × experts × the largest replica count)",
            cells,
            max: MAX_CELLS,
        });
    }
    Ok(EplbPlacement::assemble(phy2log, &ranks, logcnt))
}

/// The validated shape of one hierarchical run (groups and nodes already chosen by policy).
struct Shape {
    experts: usize,
    replicas: usize,
    groups: usize,
    nodes: usize,
    gpus: usize,
}

/// Buffers of [`balanced_packing`], reused across layers so that a rebalance allocates little.
#[derive(Default)]
pub struct PackScratch {
    order: Vec<usize>,
    pack_weight: Vec<f32>,
    pack_items: Vec<usize>,
}

/// One layer: returns (phy2log, replica rank per slot, logcnt).
fn rebalance_layer(
    w: &[f32],
    s: &Shape,
    scratch: &mut PackScratch,
) -> (Vec<usize>, Vec<usize>, Vec<usize>) {
    let group_size = s.experts / s.groups;
    let groups_per_node = s.groups / s.nodes;
    let experts_per_node = s.experts / s.nodes;
    let slots_per_node = s.replicas / s.nodes;
    let gpus_per_node = s.gpus / s.nodes;
    let slots_per_gpu = s.replicas / s.gpus;

    // Step 1: pack groups onto nodes, then number experts node by node ("mlog" order).
    let group_load: Vec<f32> = w
        .chunks_exact(group_size)
        .map(|g| g.iter().map(|&x| f64::from(x)).sum::<f64>() as f32)
        .collect();
    let (group_pack, group_rank) = balanced_packing(&group_load, s.nodes, scratch);
    let mut mlog2log = vec![0usize; s.experts];
    for g in 0..s.groups {
        let base = (group_pack[g] * groups_per_node + group_rank[g]) * group_size;
        for j in 0..group_size {
            mlog2log[base + j] = g * group_size + j;
        }
    }

    let mut phy2log = vec![0usize; s.replicas];
    let mut phy_rank = vec![0usize; s.replicas];
    let mut logcnt = vec![0usize; s.experts];
    for node in 0..s.nodes {
        let mlog = &mlog2log[node * experts_per_node..(node + 1) * experts_per_node];
        let node_load: Vec<f32> = mlog.iter().map(|&e| w[e]).collect();

        // Step 2: replicate within the node.
        let (phy2mlog, rank, mlogcnt) = replicate_experts(&node_load, slots_per_node);

        // Step 3: pack the node's physical replicas onto its GPUs by per-replica load.
        let replica_load: Vec<f32> = phy2mlog
            .iter()
            .map(|&m| node_load[m] / mlogcnt[m] as f32)
            .collect();
        let (gpu, rank_on_gpu) = balanced_packing(&replica_load, gpus_per_node, scratch);
        let out = &mut phy2log[node * slots_per_node..(node + 1) * slots_per_node];
        let out_rank = &mut phy_rank[node * slots_per_node..(node + 1) * slots_per_node];
        for phy in 0..slots_per_node {
            let local_slot = gpu[phy] * slots_per_gpu + rank_on_gpu[phy];
            out[local_slot] = mlog[phy2mlog[phy]];
            out_rank[local_slot] = rank[phy];
        }
        for (m, &cnt) in mlogcnt.iter().enumerate() {
            logcnt[mlog[m]] = cnt;
        }
    }
    (phy2log, phy_rank, logcnt)
}

/// Packs `weight.len()` items into `num_packs` packs of exactly `len / num_packs` items each;
/// returns (pack of each item, rank of the item within its pack). `len` must be a multiple of
/// `num_packs`.
pub fn balanced_packing(
    weight: &[f32],
    num_packs: usize,
    scratch: &mut PackScratch,
) -> (Vec<usize>, Vec<usize>) {
    let n = weight.len();
    let per_pack = n / num_packs;
    if per_pack == 1 {
        return ((0..n).collect(), vec![0; n]);
    }
    let order = &mut scratch.order;
    order.clear();
    order.extend(0..n);
    // `sort_by` is stable; validated loads are never NaN.
    order.sort_by(|&a, &b| {
        weight[b]
            .partial_cmp(&weight[a])
            .unwrap_or(std::cmp::Ordering::Equal)
    });
    scratch.pack_weight.clear();
    scratch.pack_weight.resize(num_packs, 0.0);
    scratch.pack_items.clear();
    scratch.pack_items.resize(num_packs, 0);
    let mut pack = vec![usize::MAX; n];
    let mut rank = vec![usize::MAX; n];
    for &item in order.iter() {
        let mut best = usize::MAX;
        for p in 0..num_packs {
            if scratch.pack_items[p] < per_pack
                && (best == usize::MAX || scratch.pack_weight[p] < scratch.pack_weight[best])
            {
                best = p;
            }
        }
        pack[item] = best;
        rank[item] = scratch.pack_items[best];
        scratch.pack_weight[best] += weight[item];
        scratch.pack_items[best] += 1;
    }
    (pack, rank)
}

/// Replicates `weight.len()` logical experts into `num_phy` slots: slot `i < len` holds expert
/// `i`; each further slot goes to the expert with the highest `weight / count`. Returns
/// (expert of each slot, replica rank of each slot, replica count of each expert).
pub fn replicate_experts(weight: &[f32], num_phy: usize) -> (Vec<usize>, Vec<usize>, Vec<usize>) {
    let num_log = weight.len();
    let mut phy2log: Vec<usize> = (0..num_log).collect();
    let mut rank = vec![0usize; num_log];
    let mut cnt = vec![1usize; num_log];
    // Per-replica load, kept in step with `cnt` (same f32 division as recomputing it each time).
    let mut per_replica: Vec<f32> = weight.to_vec();
    for _ in num_log..num_phy {
        let mut best = 0;
        for e in 1..num_log {
            if per_replica[e] > per_replica[best] {
                best = e;
            }
        }
        phy2log.push(best);
        rank.push(cnt[best]);
        cnt[best] += 1;
        per_replica[best] = weight[best] / cnt[best] as f32;
    }
    (phy2log, rank, cnt)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn spec_weight() -> Vec<Vec<f32>> {
        vec![
            vec![
                90., 132., 40., 61., 104., 165., 39., 4., 73., 56., 183., 86.,
            ],
            vec![
                20., 107., 104., 64., 19., 197., 187., 157., 172., 86., 16., 27.,
            ],
        ]
    }

    /// SPEC §9's public example, hierarchical (4 groups over 2 nodes).
    #[test]
    fn spec_example_hierarchical() {
        let p = rebalance_experts(&spec_weight(), 16, 4, 2, 8).unwrap();
        assert_eq!(
            p.phy2log,
            vec![
                vec![5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                vec![7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
            ]
        );
        assert_eq!(
            p.logcnt,
            vec![
                vec![1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1],
                vec![1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1],
            ]
        );
        // log2phy padded to 2 replicas; layer 0, expert 5 is in slots 0 (rank 0) and 2 (rank 1).
        assert_eq!(p.log2phy[0][5], vec![0, 2]);
        assert_eq!(p.log2phy[0][0], vec![12, -1]);
        // Layer 1, expert 1: the original (rank 0) is packed into slot 15 and the replica made by
        // replication (rank 1) into slot 11 (worked by hand from the packing order).
        assert_eq!(p.log2phy[1][1], vec![15, 11]);
    }

    /// Hand-computed global case: 3 groups do not divide over 2 nodes, so one group, one node.
    #[test]
    fn global_policy_hand_computed() {
        let w = vec![vec![6., 1., 3., 2., 0., 0.]];
        // 6 experts, 3 groups, 2 nodes → 3 % 2 != 0 → global; 8 slots over 2 GPUs.
        let p = rebalance_experts(&w, 8, 3, 2, 2).unwrap();
        // Replication: slot 6 → expert 0 (6), slot 7 → expert 0 (3 vs 3, lowest index).
        assert_eq!(p.logcnt[0], vec![3, 1, 1, 1, 1, 1]);
        // Per-replica loads by physical index: [2,1,3,2,0,0,2,2]. Stable descending order:
        // 2(3), 0(2), 3(2), 6(2), 7(2), 1(1), 4(0), 5(0). Packs of 4:
        // 2→A(3); 0→B(2); 3→B(4); 6→A(5); 7→B(6); 1→A(6)? A=5<B=6 → A(6); 4→ tie 6/6 → A; A full
        // now (2,6,1,4) → 5→B. A = [2,6,1,4], B = [0,3,7,5].
        assert_eq!(p.phy2log[0], vec![2, 0, 1, 4, 0, 3, 0, 5]);
        assert_eq!(p.log2phy[0][0], vec![4, 1, 6]);
    }

    #[test]
    fn one_item_per_pack_is_identity() {
        let mut s = PackScratch::default();
        let (pack, rank) = balanced_packing(&[1.0, 5.0, 3.0], 3, &mut s);
        assert_eq!(pack, vec![0, 1, 2]);
        assert_eq!(rank, vec![0, 0, 0]);
    }

    #[test]
    fn packing_ties_go_to_lowest_pack() {
        let mut s = PackScratch::default();
        let (pack, rank) = balanced_packing(&[1.0, 1.0, 1.0, 1.0], 2, &mut s);
        assert_eq!(pack, vec![0, 1, 0, 1]);
        assert_eq!(rank, vec![0, 0, 1, 1]);
    }

    #[test]
    fn replication_prefers_lowest_index_on_ties() {
        let (phy2log, rank, cnt) = replicate_experts(&[4.0, 4.0, 1.0], 5);
        assert_eq!(phy2log, vec![0, 1, 2, 0, 1]);
        assert_eq!(rank, vec![0, 0, 0, 1, 1]);
        assert_eq!(cnt, vec![2, 2, 1]);
    }

    #[test]
    fn impossible_shapes_are_errors() {
        let w = spec_weight();
        assert_eq!(
            rebalance_experts(&w, 18, 4, 2, 8),
            Err(EplbError::ReplicasNotMultipleOfGpus {
                replicas: 18,
                gpus: 8
            })
        );
        assert_eq!(
            rebalance_experts(&w, 8, 4, 2, 8),
            Err(EplbError::FewerReplicasThanExperts {
                replicas: 8,
                experts: 12
            })
        );
        assert_eq!(
            rebalance_experts(&w, 16, 5, 1, 8),
            Err(EplbError::ExpertsNotDivisibleByGroups {
                experts: 12,
                groups: 5
            })
        );
        // 4 groups over 2 nodes: hierarchical, where 9 GPUs must divide over the 2 nodes.
        assert_eq!(
            rebalance_experts(&w, 18, 4, 2, 9),
            Err(EplbError::GpusNotDivisibleByNodes { gpus: 9, nodes: 2 })
        );
        assert!(matches!(
            rebalance_experts(&w, MAX_REPLICAS + 8, 4, 2, 8),
            Err(EplbError::TooLarge { .. })
        ));
        assert!(matches!(
            rebalance_experts(&vec![vec![1.0; 12]; 1 << 10], 1 << 17, 4, 2, 8),
            Err(EplbError::TooLarge { .. })
        ));
        assert_eq!(
            rebalance_experts(&[], 16, 4, 2, 8),
            Err(EplbError::NoLayers)
        );
        assert_eq!(
            rebalance_experts(&[vec![]], 16, 4, 2, 8),
            Err(EplbError::NoExperts)
        );
        assert_eq!(
            rebalance_experts(&[vec![1.0; 12], vec![1.0; 11]], 16, 4, 2, 8),
            Err(EplbError::RaggedRows {
                layer: 1,
                len: 11,
                expected: 12
            })
        );
        let mut bad = spec_weight();
        bad[1][3] = -1.0;
        assert!(matches!(
            rebalance_experts(&bad, 16, 4, 2, 8),
            Err(EplbError::BadLoad {
                layer: 1,
                expert: 3,
                ..
            })
        ));
        bad[1][3] = f32::NAN;
        assert!(matches!(
            rebalance_experts(&bad, 16, 4, 2, 8),
            Err(EplbError::BadLoad {
                layer: 1,
                expert: 3,
                ..
            })
        ));
        bad[1][3] = f32::INFINITY;
        assert!(rebalance_experts(&bad, 16, 4, 2, 8).is_err());
        assert_eq!(
            rebalance_experts(&w, 16, 4, 0, 8),
            Err(EplbError::Zero { name: "num_nodes" })
        );
    }

    /// Issue 16 item 4: when the groups do not divide over the nodes the reference runs the
    /// global policy (one group, one node), so neither the experts need divide by the groups nor
    /// the GPUs by the nodes.
    #[test]
    fn global_fallback_accepts_what_the_reference_accepts() {
        let w = spec_weight();
        let global = rebalance_experts(&w, 16, 1, 1, 8).unwrap();
        // 12 experts, 5 groups, 2 nodes: 5 % 2 != 0 → global, and 12 % 5 != 0 is fine.
        assert_eq!(rebalance_experts(&w, 16, 5, 2, 8).unwrap(), global);
        // 4 groups, 3 nodes: global, and 8 GPUs need not divide over 3 nodes.
        assert_eq!(rebalance_experts(&w, 16, 4, 3, 8).unwrap(), global);
        // More groups than experts, still global.
        assert_eq!(rebalance_experts(&w, 16, 13, 2, 8).unwrap(), global);
        // Hierarchical (5 % 1 == 0) keeps the reference's checks.
        assert!(rebalance_experts(&w, 16, 5, 1, 8).is_err());
    }

    /// The shapes the reference (DeepSeek's eplb.py) accepts, stated from its assertions, not
    /// from this module's code.
    fn reference_accepts(e: usize, r: usize, g: usize, n: usize, p: usize) -> bool {
        if e == 0 || r == 0 || g == 0 || n == 0 || p == 0 {
            return false;
        }
        let (g, n) = if g.is_multiple_of(n) { (g, n) } else { (1, 1) };
        e.is_multiple_of(g) && p.is_multiple_of(n) && r.is_multiple_of(p) && r >= e
    }

    proptest! {
        /// Every small shape is accepted exactly when the reference accepts it, and a global
        /// fallback gives the global placement.
        #[test]
        fn accepts_exactly_the_reference_shapes(e in 1usize..13, r in 0usize..30, g in 0usize..14,
                                                n in 0usize..6, p in 0usize..9, seed in 0u32..1000) {
            let w: Vec<Vec<f32>> = (0..2u32)
                .map(|l| (0..e as u32).map(|x| ((x * 7919 + l * 31 + seed) % 97) as f32).collect())
                .collect();
            let got = rebalance_experts(&w, r, g, n, p);
            prop_assert_eq!(got.is_ok(), reference_accepts(e, r, g, n, p), "{:?}", got);
            if let Ok(placement) = got
                && g % n != 0
            {
                prop_assert_eq!(placement, rebalance_experts(&w, r, 1, 1, p).unwrap());
            }
        }
    }

    #[test]
    fn from_phy2log_builds_the_inverse() {
        let p = EplbPlacement::from_phy2log(vec![vec![1, 0, 1, 2]], 3).unwrap();
        assert_eq!(p.logcnt, vec![vec![1, 2, 1]]);
        assert_eq!(p.log2phy, vec![vec![vec![1, -1], vec![0, 2], vec![3, -1]]]);
        assert!(EplbPlacement::from_phy2log(vec![vec![0, 0, 1]], 3).is_err());
    }

    /// A valid (shape, loads) case: R = P * (slots per GPU), E = G * group size, P = N * gpus/node.
    fn case() -> impl Strategy<Value = (Vec<Vec<f32>>, usize, usize, usize, usize)> {
        (
            1usize..4,
            1usize..5,
            1usize..4,
            1usize..4,
            1usize..4,
            0usize..4,
            1usize..4,
        )
            .prop_flat_map(
                |(layers, groups, group_size, nodes, gpus_per_node, extra_per_gpu, _)| {
                    let experts = groups * group_size;
                    let gpus = nodes * gpus_per_node;
                    // Smallest multiple of `gpus` that is ≥ experts, plus some redundancy.
                    let base = experts.div_ceil(gpus) * gpus;
                    let replicas = base + extra_per_gpu * gpus;
                    (
                        proptest::collection::vec(
                            proptest::collection::vec(
                                prop_oneof![
                                    Just(0.0f32),
                                    0.0f32..1000.0,
                                    (0u32..20).prop_map(|x| x as f32)
                                ],
                                experts,
                            ),
                            layers,
                        ),
                        Just(replicas),
                        Just(groups),
                        Just(nodes),
                        Just(gpus),
                    )
                },
            )
    }

    proptest! {
        #[test]
        fn placement_invariants((w, replicas, groups, nodes, gpus) in case()) {
            let p = rebalance_experts(&w, replicas, groups, nodes, gpus).unwrap();
            let experts = w[0].len();
            let per_gpu = replicas / gpus;
            prop_assert_eq!(p.num_layers(), w.len());
            for (l, wl) in w.iter().enumerate() {
                // Every logical expert has at least one replica; counts sum to R.
                prop_assert!(p.logcnt[l].iter().all(|&c| c >= 1));
                prop_assert_eq!(p.logcnt[l].iter().sum::<usize>(), replicas);
                // phy2log has R slots, so every GPU holds exactly R/P of them; count per expert
                // in phy2log matches logcnt.
                prop_assert_eq!(p.phy2log[l].len(), replicas);
                let mut seen = vec![0usize; experts];
                for &e in &p.phy2log[l] {
                    seen[e] += 1;
                }
                prop_assert_eq!(&seen, &p.logcnt[l]);
                // log2phy and phy2log describe the same mapping.
                let mut covered = vec![false; replicas];
                for e in 0..experts {
                    let row = &p.log2phy[l][e];
                    for (r, &slot) in row.iter().enumerate() {
                        if r < p.logcnt[l][e] {
                            prop_assert!(slot >= 0);
                            prop_assert_eq!(p.phy2log[l][slot as usize], e);
                            prop_assert!(!covered[slot as usize]);
                            covered[slot as usize] = true;
                        } else {
                            prop_assert_eq!(slot, -1);
                        }
                    }
                }
                prop_assert!(covered.iter().all(|&c| c));
                // Packing conserves load: per-GPU loads (weight / count per slot) sum to the total.
                let gpu_total: f64 = (0..gpus)
                    .map(|g| {
                        p.phy2log[l][g * per_gpu..(g + 1) * per_gpu]
                            .iter()
                            .map(|&e| f64::from(wl[e]) / p.logcnt[l][e] as f64)
                            .sum::<f64>()
                    })
                    .sum();
                let total: f64 = wl.iter().map(|&x| f64::from(x)).sum();
                prop_assert!((gpu_total - total).abs() <= 1e-9 * total.max(1.0), "{} vs {}", gpu_total, total);
            }
        }

        #[test]
        fn deterministic((w, replicas, groups, nodes, gpus) in case()) {
            prop_assert_eq!(
                rebalance_experts(&w, replicas, groups, nodes, gpus),
                rebalance_experts(&w, replicas, groups, nodes, gpus)
            );
        }
    }
}
