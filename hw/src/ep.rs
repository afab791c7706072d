//! Expert parallelism across the GPUs of a decode group (SPEC §9): which rank holds each
//! expert (an EPLB placement's physical slots split evenly over the ranks), the dispatch of
//! every token's top-k routes to the rank holding the chosen replica, and the combine of the
//! expert outputs back on the token's own rank, through an all-to-all of rows.
//!
//! The layout logic is plain data ([`EpLayout`], [`Dispatch`]) so it is checked on the CPU
//! against a direct computation; the all-to-all is a trait ([`AllToAll`]) with an in-memory
//! exchange ([`LocalAllToAll`], for tests with the owners split over any number of ranks) and
//! the NCCL one ([`nccl::NcclAllToAll`], grouped send/receive, one communicator rank per GPU).
//!
//! Replicas of an expert share its routes round-robin in (source rank, token, k) order, so
//! each replica serves 1 / (replica count) of the expert's load, the share EPLB assumes.

use servelab_core::eplb::{EplbPlacement, rebalance_experts};

pub mod nccl;

/// One MoE layer's experts over the EP ranks of a group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EpLayout {
    ranks: usize,
    slots_per_rank: usize,
    /// Physical slot → logical expert.
    slot_expert: Vec<u32>,
    /// Logical expert → its slots (replicas), ascending.
    replicas: Vec<Vec<u32>>,
}

impl EpLayout {
    /// Layer `layer` of an EPLB placement on `ranks` ranks: slot s lives on rank
    /// s / (slots / ranks), as [`EplbPlacement`] defines it.
    pub fn from_placement(p: &EplbPlacement, layer: usize, ranks: usize) -> Result<Self, String> {
        let row = p
            .phy2log
            .get(layer)
            .ok_or_else(|| format!("layer {layer} of a {}-layer placement", p.num_layers()))?;
        Self::from_slots(row.iter().map(|&e| e as u32).collect(), ranks)
    }

    /// Every expert once, `experts / ranks` consecutive experts per rank (no redundancy).
    pub fn contiguous(experts: usize, ranks: usize) -> Result<Self, String> {
        Self::from_slots((0..experts as u32).collect(), ranks)
    }

    fn from_slots(slot_expert: Vec<u32>, ranks: usize) -> Result<Self, String> {
        if ranks == 0 || slot_expert.is_empty() || !slot_expert.len().is_multiple_of(ranks) {
            return Err(format!(
                "{} slots do not split evenly over {ranks} ranks",
                slot_expert.len()
            ));
        }
        let experts = slot_expert.iter().max().map_or(0, |&e| e as usize + 1);
        let mut replicas = vec![Vec::new(); experts];
        for (s, &e) in slot_expert.iter().enumerate() {
            replicas[e as usize].push(s as u32);
        }
        if let Some(e) = replicas.iter().position(Vec::is_empty) {
            return Err(format!("expert {e} has no slot"));
        }
        Ok(EpLayout {
            ranks,
            slots_per_rank: slot_expert.len() / ranks,
            slot_expert,
            replicas,
        })
    }

    pub fn ranks(&self) -> usize {
        self.ranks
    }
    pub fn experts(&self) -> usize {
        self.replicas.len()
    }
    /// The rank holding physical slot `slot`.
    pub fn owner(&self, slot: u32) -> usize {
        slot as usize / self.slots_per_rank
    }
    /// The logical expert of physical slot `slot`.
    pub fn expert_of(&self, slot: u32) -> u32 {
        self.slot_expert[slot as usize]
    }

    /// Rows each rank computes when expert e gets `counts[e]` routes, dealt round-robin over
    /// its replicas as [`plan_dispatch`] deals them.
    pub fn rank_loads(&self, counts: &[u64]) -> Vec<u64> {
        let mut load = vec![0u64; self.ranks];
        for (reps, &n) in self.replicas.iter().zip(counts) {
            let r = reps.len() as u64;
            for (j, &s) in reps.iter().enumerate() {
                load[self.owner(s)] += n / r + u64::from((j as u64) < n % r);
            }
        }
        load
    }
}

/// The slowest rank's rows ÷ the mean rank's (1 when nothing is routed).
pub fn imbalance(loads: &[u64]) -> f64 {
    let total: u64 = loads.iter().sum();
    if total == 0 {
        return 1.0;
    }
    let max = loads.iter().copied().max().unwrap_or(0);
    max as f64 * loads.len() as f64 / total as f64
}

/// Expert imbalance of routed `counts` (`[layer][expert]`) on `ranks` ranks without
/// redundancy (experts split contiguously) and with EPLB's placement of `redundant` extra
/// slots per rank computed from the same counts: (without, with), each the sum over layers of
/// the slowest rank's rows ÷ the sum of the mean rank's (each layer waits for its slowest rank).
pub fn eplb_imbalance(
    counts: &[Vec<u64>],
    ranks: usize,
    redundant: usize,
) -> Result<(f64, f64), String> {
    let experts = counts.first().map_or(0, Vec::len);
    let weight: Vec<Vec<f32>> = counts
        .iter()
        .map(|l| l.iter().map(|&c| c as f32).collect())
        .collect();
    let slots = experts + redundant * ranks;
    let p = rebalance_experts(&weight, slots, 1, 1, ranks).map_err(|e| e.to_string())?;
    let plain = EpLayout::contiguous(experts, ranks)?;
    let (mut max0, mut max1, mut sum) = (0.0, 0.0, 0.0);
    for (l, c) in counts.iter().enumerate() {
        let eplb = EpLayout::from_placement(&p, l, ranks)?;
        let a = plain.rank_loads(c);
        let b = eplb.rank_loads(c);
        max0 += a.iter().copied().max().unwrap_or(0) as f64;
        max1 += b.iter().copied().max().unwrap_or(0) as f64;
        sum += a.iter().sum::<u64>() as f64 / ranks as f64;
    }
    if sum == 0.0 {
        return Ok((1.0, 1.0));
    }
    Ok((max0 / sum, max1 / sum))
}

/// Each rank's tokens with their top-k routes: `experts[t * k + j]` and `weights[..]`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Routes {
    pub k: usize,
    pub experts: Vec<u32>,
    pub weights: Vec<f32>,
}

impl Routes {
    pub fn tokens(&self) -> usize {
        self.experts.len().checked_div(self.k).unwrap_or(0)
    }
}

/// Where every route goes and comes back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dispatch {
    /// `[src][dst]`: rows rank src sends to rank dst.
    pub counts: Vec<Vec<usize>>,
    /// Per source rank, its send buffer's rows in order (by destination, then token, then
    /// k): the (token, k) each row carries.
    pub send_rows: Vec<Vec<(u32, u8)>>,
    /// Per destination rank, its receive buffer's rows in order (by source, then as sent):
    /// the physical slot each row is computed by.
    pub recv_slots: Vec<Vec<u32>>,
}

/// Plans the dispatch of every rank's routes (`routes[rank]`) under `layout`.
pub fn plan_dispatch(layout: &EpLayout, routes: &[Routes]) -> Result<Dispatch, String> {
    let n = layout.ranks();
    if routes.len() != n {
        return Err(format!("routes of {} ranks for {n}", routes.len()));
    }
    let mut next = vec![0usize; layout.experts()];
    // (src, dst) → rows, each (token, k, slot), in (token, k) order.
    let mut by_pair: Vec<Vec<Vec<(u32, u8, u32)>>> = vec![vec![Vec::new(); n]; n];
    for (src, r) in routes.iter().enumerate() {
        for (i, &e) in r.experts.iter().enumerate() {
            let reps = layout.replicas.get(e as usize).ok_or_else(|| {
                format!("rank {src} routes to expert {e} of {}", layout.experts())
            })?;
            let slot = reps[next[e as usize] % reps.len()];
            next[e as usize] += 1;
            let (t, j) = (i / r.k, i % r.k);
            by_pair[src][layout.owner(slot)].push((t as u32, j as u8, slot));
        }
    }
    let counts = by_pair
        .iter()
        .map(|row| row.iter().map(Vec::len).collect())
        .collect();
    let send_rows = by_pair
        .iter()
        .map(|row| row.iter().flatten().map(|&(t, j, _)| (t, j)).collect())
        .collect();
    let recv_slots = (0..n)
        .map(|dst| {
            (0..n)
                .flat_map(|src| by_pair[src][dst].iter().map(|&(_, _, s)| s))
                .collect()
        })
        .collect();
    Ok(Dispatch {
        counts,
        send_rows,
        recv_slots,
    })
}

/// An exchange of rows of `width` f32 between the ranks: rank src's buffer holds its rows for
/// rank 0, then rank 1, … (`counts[src][dst]` each); rank dst receives rank 0's rows for it,
/// then rank 1's, … .
pub trait AllToAll {
    fn all_to_all(
        &mut self,
        send: &[Vec<f32>],
        counts: &[Vec<usize>],
        width: usize,
    ) -> Result<Vec<Vec<f32>>, String>;
}

/// The exchange in host memory: what the NCCL exchange must reproduce.
pub struct LocalAllToAll;

impl AllToAll for LocalAllToAll {
    fn all_to_all(
        &mut self,
        send: &[Vec<f32>],
        counts: &[Vec<usize>],
        width: usize,
    ) -> Result<Vec<Vec<f32>>, String> {
        let n = send.len();
        check_counts(send, counts, width)?;
        let mut recv = vec![Vec::new(); n];
        for (src, buf) in send.iter().enumerate() {
            let mut at = 0;
            for (dst, out) in recv.iter_mut().enumerate() {
                let len = counts[src][dst] * width;
                out.extend_from_slice(&buf[at..at + len]);
                at += len;
            }
        }
        Ok(recv)
    }
}

/// Every rank's buffer matches its counts.
pub fn check_counts(send: &[Vec<f32>], counts: &[Vec<usize>], width: usize) -> Result<(), String> {
    let n = send.len();
    if counts.len() != n || counts.iter().any(|c| c.len() != n) {
        return Err(format!("counts are not {n} x {n}"));
    }
    for (src, buf) in send.iter().enumerate() {
        let rows: usize = counts[src].iter().sum();
        if buf.len() != rows * width {
            return Err(format!(
                "rank {src} sends {} values for {rows} rows of {width}",
                buf.len()
            ));
        }
    }
    Ok(())
}

/// The transpose of a counts matrix (the combine's counts are the dispatch's, reversed).
pub fn transpose(counts: &[Vec<usize>]) -> Vec<Vec<usize>> {
    let n = counts.len();
    (0..n)
        .map(|i| (0..n).map(|j| counts[j][i]).collect())
        .collect()
}

/// One MoE layer across the ranks: dispatch every rank's token rows (`x[rank]`,
/// `[tokens][width]`) to the ranks holding their experts, compute `expert(logical expert,
/// row)` there, send the outputs back and combine each token's k outputs with its weights
/// (in k order, as [`reference_moe`] does). Returns every rank's `[tokens][width]` output.
pub fn ep_moe(
    layout: &EpLayout,
    routes: &[Routes],
    x: &[Vec<f32>],
    width: usize,
    expert: &dyn Fn(u32, &[f32]) -> Vec<f32>,
    exchange: &mut dyn AllToAll,
) -> Result<Vec<Vec<f32>>, String> {
    let d = plan_dispatch(layout, routes)?;
    let send: Vec<Vec<f32>> = d
        .send_rows
        .iter()
        .zip(x)
        .map(|(rows, xs)| {
            rows.iter()
                .flat_map(|&(t, _)| xs[t as usize * width..][..width].iter().copied())
                .collect()
        })
        .collect();
    let recv = exchange.all_to_all(&send, &d.counts, width)?;
    let computed: Vec<Vec<f32>> = recv
        .iter()
        .zip(&d.recv_slots)
        .map(|(rows, slots)| {
            rows.chunks(width)
                .zip(slots)
                .flat_map(|(row, &s)| expert(layout.expert_of(s), row))
                .collect()
        })
        .collect();
    let back = exchange.all_to_all(&computed, &transpose(&d.counts), width)?;
    Ok(combine(routes, &d, &back, width))
}

/// Puts each returned row at its (token, k) and sums each token's k rows in k order.
fn combine(routes: &[Routes], d: &Dispatch, back: &[Vec<f32>], width: usize) -> Vec<Vec<f32>> {
    routes
        .iter()
        .zip(&d.send_rows)
        .zip(back)
        .map(|((r, rows), buf)| {
            let mut by_route = vec![0f32; r.experts.len() * width];
            for (&(t, j), row) in rows.iter().zip(buf.chunks(width)) {
                let at = (t as usize * r.k + j as usize) * width;
                by_route[at..at + width].copy_from_slice(row);
            }
            let mut out = vec![0f32; r.tokens() * width];
            for t in 0..r.tokens() {
                for j in 0..r.k {
                    let w = r.weights[t * r.k + j];
                    let row = &by_route[(t * r.k + j) * width..][..width];
                    for (o, &v) in out[t * width..][..width].iter_mut().zip(row) {
                        *o += w * v;
                    }
                }
            }
            out
        })
        .collect()
}

/// The same layer without parallelism: each token's k expert outputs summed in k order.
pub fn reference_moe(
    routes: &[Routes],
    x: &[Vec<f32>],
    width: usize,
    expert: &dyn Fn(u32, &[f32]) -> Vec<f32>,
) -> Vec<Vec<f32>> {
    routes
        .iter()
        .zip(x)
        .map(|(r, xs)| {
            let mut out = vec![0f32; r.tokens() * width];
            for t in 0..r.tokens() {
                let row = &xs[t * width..][..width];
                for j in 0..r.k {
                    let y = expert(r.experts[t * r.k + j], row);
                    let w = r.weights[t * r.k + j];
                    for (o, v) in out[t * width..][..width].iter_mut().zip(y) {
                        *o += w * v;
                    }
                }
            }
            out
        })
        .collect()
}

/// A seeded test layer: `tokens` tokens per rank of `width` values, top-`k` of `experts`
/// skewed towards low ids (so EPLB has something to balance), and an expert function that is
/// a different affine map per expert.
#[cfg(test)]
pub(crate) mod testing {
    use super::Routes;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    pub fn layer(
        ranks: usize,
        tokens: usize,
        width: usize,
        experts: usize,
        k: usize,
        seed: u64,
    ) -> (Vec<Routes>, Vec<Vec<f32>>) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut routes = Vec::new();
        let mut xs = Vec::new();
        for _ in 0..ranks {
            let mut r = Routes {
                k,
                ..Default::default()
            };
            for _ in 0..tokens {
                let mut chosen: Vec<u32> = Vec::new();
                while chosen.len() < k {
                    // Squaring a uniform draw favours low expert ids.
                    let u: f64 = rng.random();
                    let e = ((u * u) * experts as f64) as u32 % experts as u32;
                    if !chosen.contains(&e) {
                        chosen.push(e);
                    }
                }
                for e in chosen {
                    r.experts.push(e);
                    r.weights.push(rng.random_range(0.1f32..1.0));
                }
            }
            routes.push(r);
            xs.push(
                (0..tokens * width)
                    .map(|_| rng.random_range(-1f32..1.0))
                    .collect(),
            );
        }
        (routes, xs)
    }

    pub fn expert(e: u32, row: &[f32]) -> Vec<f32> {
        let a = 1.0 + e as f32 * 0.25;
        row.iter()
            .enumerate()
            .map(|(i, &v)| a * v + (e as f32 - i as f32) * 0.01)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{expert, layer};
    use super::*;

    #[test]
    fn layouts_from_placements() {
        let p = EplbPlacement::from_phy2log(vec![vec![0, 1, 2, 3, 0, 1]], 4).unwrap();
        let l = EpLayout::from_placement(&p, 0, 3).unwrap();
        assert_eq!((l.ranks(), l.experts()), (3, 4));
        assert_eq!((l.owner(3), l.owner(4), l.expert_of(4)), (1, 2, 0));
        // Expert 0: 5 routes over slots 0 (rank 0) and 4 (rank 2): 3 and 2.
        assert_eq!(l.rank_loads(&[5, 0, 0, 0]), vec![3, 0, 2]);
        assert!(EpLayout::from_placement(&p, 0, 4).is_err());
        assert!(EpLayout::from_placement(&p, 1, 3).is_err());
        assert!(EpLayout::from_slots(vec![0, 2], 1).is_err());
        assert_eq!(imbalance(&[3, 1]), 1.5);
        assert_eq!(imbalance(&[0, 0]), 1.0);
    }

    /// The dispatch sends every route exactly once, to the rank holding its slot, and the
    /// receivers' slot lists line up with what was sent.
    #[test]
    fn dispatch_covers_every_route_once() {
        let (routes, _) = layer(4, 50, 1, 16, 4, 1);
        let w = vec![vec![5.0f32; 16]];
        let p = rebalance_experts(&w, 24, 1, 1, 4).unwrap();
        let l = EpLayout::from_placement(&p, 0, 4).unwrap();
        let d = plan_dispatch(&l, &routes).unwrap();
        for (src, rows) in d.send_rows.iter().enumerate() {
            assert_eq!(rows.len(), routes[src].experts.len());
            assert_eq!(d.counts[src].iter().sum::<usize>(), rows.len());
            let mut seen: Vec<(u32, u8)> = rows.clone();
            seen.sort_unstable();
            seen.dedup();
            assert_eq!(seen.len(), rows.len());
        }
        for (dst, slots) in d.recv_slots.iter().enumerate() {
            assert_eq!(slots.len(), (0..4).map(|s| d.counts[s][dst]).sum::<usize>());
            assert!(slots.iter().all(|&s| l.owner(s) == dst));
        }
        let bad = vec![Routes {
            k: 1,
            experts: vec![99],
            weights: vec![1.0],
        }];
        assert!(plan_dispatch(&EpLayout::contiguous(4, 1).unwrap(), &bad).is_err());
    }

    /// Dispatch, expert compute on the owning rank and combine give exactly the direct
    /// computation, for owners split over 1, 2, 4 and 8 ranks, with and without replicas.
    #[test]
    fn ep_moe_matches_the_reference_on_any_rank_count() {
        for ranks in [1, 2, 4, 8] {
            let (routes, xs) = layer(ranks, 37, 8, 32, 4, ranks as u64);
            let want = reference_moe(&routes, &xs, 8, &expert);
            let counts = vec![vec![3.0f32; 32]];
            let eplb = rebalance_experts(&counts, 32 + 2 * ranks, 1, 1, ranks).unwrap();
            for l in [
                EpLayout::contiguous(32, ranks).unwrap(),
                EpLayout::from_placement(&eplb, 0, ranks).unwrap(),
            ] {
                let got = ep_moe(&l, &routes, &xs, 8, &expert, &mut LocalAllToAll).unwrap();
                assert_eq!(got, want, "{ranks} ranks");
            }
        }
    }

    /// A skewed routing: EPLB's replicas cut the slowest rank's share, and the loads the layout
    /// predicts are the rows the dispatch actually sends.
    #[test]
    fn eplb_cuts_the_imbalance_of_a_skewed_routing() {
        let (routes, _) = layer(8, 200, 1, 64, 6, 5);
        let mut counts = vec![0u64; 64];
        for r in &routes {
            for &e in &r.experts {
                counts[e as usize] += 1;
            }
        }
        let (plain, eplb) = eplb_imbalance(std::slice::from_ref(&counts), 8, 2).unwrap();
        assert!(plain > 1.5, "{plain}");
        assert!(eplb < plain && eplb < 1.2, "{eplb} vs {plain}");
        let w = vec![counts.iter().map(|&c| c as f32).collect::<Vec<_>>()];
        let p = rebalance_experts(&w, 64 + 16, 1, 1, 8).unwrap();
        let l = EpLayout::from_placement(&p, 0, 8).unwrap();
        let d = plan_dispatch(&l, &routes).unwrap();
        let received: Vec<u64> = d.recv_slots.iter().map(|s| s.len() as u64).collect();
        assert_eq!(received, l.rank_loads(&counts));
        assert_eq!(eplb_imbalance(&[vec![0; 64]], 8, 2).unwrap(), (1.0, 1.0));
    }
    proptest::proptest! {
        /// Any ranks, tokens (none on a rank included), experts, top-k and replicas: the EP
        /// layer equals the direct computation.
        #[test]
        fn ep_moe_is_the_reference_for_any_shape(
            ranks in 1usize..6,
            tokens in 0usize..12,
            experts_per_rank in 1usize..5,
            k in 1usize..4,
            redundant in 0usize..3,
            seed in 0u64..1000,
        ) {
            let experts = experts_per_rank * ranks;
            let k = k.min(experts);
            let (routes, xs) = layer(ranks, tokens, 3, experts, k, seed);
            let w = vec![(0..experts).map(|e| (e * 7 % 5) as f32 + 1.0).collect::<Vec<_>>()];
            let p = rebalance_experts(&w, experts + redundant * ranks, 1, 1, ranks).unwrap();
            let l = EpLayout::from_placement(&p, 0, ranks).unwrap();
            let got = ep_moe(&l, &routes, &xs, 3, &expert, &mut LocalAllToAll).unwrap();
            proptest::prop_assert_eq!(got, reference_moe(&routes, &xs, 3, &expert));
        }
    }
}
