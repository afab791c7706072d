//! MoE routing: softmax top-k over expert logits, an expert-major permutation of the
//! (token, slot) assignments, gather of token rows into that order and a weighted combine back.
//! The permutation is deterministic: within an expert, assignments keep their index order.

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};
use half::bf16;

use crate::check::{BF16_TOL, CheckResult};
use crate::error::{KernelError, ensure};
use crate::gpu::GpuContext;
use crate::testdata::{ErrorStats, random_bf16, random_f32, rng};
use rand_chacha::ChaCha8Rng;

pub(crate) const SRC: &str = include_str!("cuda/moe.cu");

/// Top-k by softmax probability (ties to the lower expert), weights renormalised over the k
/// chosen when `renorm`. Returns (ids `[n, k]`, weights `[n, k]`).
pub fn topk_softmax_cpu(
    logits: &[f32],
    num_experts: usize,
    top_k: usize,
    renorm: bool,
) -> (Vec<i32>, Vec<f64>) {
    let mut ids = Vec::new();
    let mut weights = Vec::new();
    for row in logits.chunks(num_experts) {
        let mx = row
            .iter()
            .map(|&v| v as f64)
            .fold(f64::NEG_INFINITY, f64::max);
        let p: Vec<f64> = row.iter().map(|&v| (v as f64 - mx).exp()).collect();
        let sum: f64 = p.iter().sum();
        let mut order: Vec<usize> = (0..num_experts).collect();
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        let chosen = &order[..top_k];
        let chosen_sum: f64 = chosen.iter().map(|&e| p[e] / sum).sum();
        for &e in chosen {
            ids.push(e as i32);
            weights.push(if renorm {
                p[e] / sum / chosen_sum
            } else {
                p[e] / sum
            });
        }
    }
    (ids, weights)
}

/// The expert-major permutation: `offsets[e]..offsets[e+1]` are expert e's positions,
/// `sorted_token[pos]` the token at each position, `slot_pos[a]` the position of assignment a.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permutation {
    pub offsets: Vec<i32>,
    pub sorted_token: Vec<i32>,
    pub slot_pos: Vec<i32>,
}

pub fn permutation_cpu(ids: &[i32], num_experts: usize, top_k: usize) -> Permutation {
    let mut order: Vec<usize> = (0..ids.len()).collect();
    order.sort_by_key(|&a| (ids[a], a)); // stable by construction
    let mut offsets = vec![0i32; num_experts + 1];
    for &e in ids {
        offsets[e as usize + 1] += 1;
    }
    for e in 0..num_experts {
        offsets[e + 1] += offsets[e];
    }
    let mut slot_pos = vec![0i32; ids.len()];
    let sorted_token = order
        .iter()
        .enumerate()
        .map(|(pos, &a)| {
            slot_pos[a] = pos as i32;
            (a / top_k) as i32
        })
        .collect();
    Permutation {
        offsets,
        sorted_token,
        slot_pos,
    }
}

/// The padded expert-major layout of the same order: expert e owns positions
/// `e * cap..(e + 1) * cap`, its assignments first (in index order), the rest -1. Returns
/// (`sorted_token` `[E cap]`, `slot_pos` `[n k]`); `cap` must hold every expert's count.
pub fn padded_permutation_cpu(
    ids: &[i32],
    num_experts: usize,
    top_k: usize,
    cap: usize,
) -> (Vec<i32>, Vec<i32>) {
    let mut sorted = vec![-1i32; num_experts * cap];
    let mut slot_pos = vec![0i32; ids.len()];
    let mut used = vec![0usize; num_experts];
    for (a, &e) in ids.iter().enumerate() {
        let e = e as usize;
        let pos = e * cap + used[e];
        assert!(
            used[e] < cap,
            "expert {e} holds more than {cap} assignments"
        );
        used[e] += 1;
        sorted[pos] = (a / top_k) as i32;
        slot_pos[a] = pos as i32;
    }
    (sorted, slot_pos)
}

/// out[t] = Σ_j w[t, j] · ys[slot_pos[t k + j]].
pub fn combine_cpu(
    ys: &[bf16],
    slot_pos: &[i32],
    weights: &[f32],
    top_k: usize,
    dim: usize,
) -> Vec<f64> {
    let n = slot_pos.len() / top_k;
    let mut out = vec![0.0; n * dim];
    for t in 0..n {
        for j in 0..top_k {
            let w = weights[t * top_k + j] as f64;
            let row = &ys[slot_pos[t * top_k + j] as usize * dim..][..dim];
            for (o, y) in out[t * dim..(t + 1) * dim].iter_mut().zip(row) {
                *o += w * y.to_f64();
            }
        }
    }
    out
}

/// Device outputs of routing.
pub struct Routing {
    pub ids: CudaSlice<i32>,
    pub weights: CudaSlice<f32>,
    pub counts: CudaSlice<i32>,
    pub offsets: CudaSlice<i32>,
    pub sorted_token: CudaSlice<i32>,
    pub slot_pos: CudaSlice<i32>,
}

impl Routing {
    /// Buffers for routing up to `tokens` tokens over `num_experts` experts, `top_k` each.
    pub fn alloc(
        gpu: &GpuContext,
        tokens: usize,
        num_experts: usize,
        top_k: usize,
    ) -> Result<Self, KernelError> {
        let s = &gpu.stream;
        let na = (tokens * top_k).max(1);
        Ok(Self {
            ids: s.alloc_zeros(na)?,
            weights: s.alloc_zeros(na)?,
            counts: s.alloc_zeros(num_experts)?,
            offsets: s.alloc_zeros(num_experts + 1)?,
            sorted_token: s.alloc_zeros(na)?,
            slot_pos: s.alloc_zeros(na)?,
        })
    }

    /// Tokens these buffers can route at `top_k` experts each.
    pub fn tokens(&self, top_k: usize) -> usize {
        self.ids.len() / top_k.max(1)
    }
}

pub struct MoeRouter {
    pub num_experts: usize,
    pub top_k: usize,
    topk: CudaFunction,
    count: CudaFunction,
    offsets: CudaFunction,
    rank: CudaFunction,
    rank_padded: CudaFunction,
    gather: CudaFunction,
    combine: CudaFunction,
}

impl MoeRouter {
    pub fn new(gpu: &GpuContext, num_experts: usize, top_k: usize) -> Result<Self, KernelError> {
        ensure(
            num_experts > 0 && (1..=32.min(num_experts)).contains(&top_k),
            || format!("top_k = {top_k} must be in 1..=min(32, num_experts = {num_experts})"),
        )?;
        let names = [
            "moe_topk_softmax",
            "moe_count",
            "moe_offsets",
            "moe_rank",
            "moe_rank_padded",
            "moe_gather",
            "moe_combine",
        ];
        let mut f = gpu.functions("moe", SRC, &[], &names)?.into_iter();
        let mut next = || f.next().expect("seven functions");
        Ok(Self {
            num_experts,
            top_k,
            topk: next(),
            count: next(),
            offsets: next(),
            rank: next(),
            rank_padded: next(),
            gather: next(),
            combine: next(),
        })
    }

    /// Routes `n` tokens from `logits` `[n, E]` (f32) and builds the permutation.
    pub fn route(
        &self,
        gpu: &GpuContext,
        logits: &CudaSlice<f32>,
        n: usize,
        renorm: bool,
    ) -> Result<Routing, KernelError> {
        let mut r = Routing::alloc(gpu, n, self.num_experts, self.top_k)?;
        self.route_into(gpu, logits, n, renorm, &mut r)?;
        Ok(r)
    }

    /// As [`Self::route`], into `r`, which must hold at least `n` tokens of this router (see
    /// [`Routing::alloc`]). Every entry the permutation kernels read for these `n` tokens is
    /// written here, so `r` can be reused from call to call: a layer loop that allocated and
    /// zeroed six buffers per MoE layer spent more host time on that than on the routing.
    pub fn route_into(
        &self,
        gpu: &GpuContext,
        logits: &CudaSlice<f32>,
        n: usize,
        renorm: bool,
        r: &mut Routing,
    ) -> Result<(), KernelError> {
        let (e, k) = (self.num_experts, self.top_k);
        ensure(logits.len() >= n * e, || "logits too short".into())?;
        ensure(
            r.tokens(k) >= n && r.counts.len() == e && r.offsets.len() == e + 1,
            || {
                format!(
                    "routing buffers hold {} tokens of {} experts, need {n} of {e}",
                    r.tokens(k),
                    r.counts.len()
                )
            },
        )?;
        if n == 0 {
            return Ok(());
        }
        self.launch_topk(gpu, logits, n, renorm, r)?;
        self.launch_permutation(gpu, n, r)
    }

    /// As [`Self::route_into`], into the padded layout of [`padded_permutation_cpu`]:
    /// `sorted` `[E cap]` receives each expert's tokens from position `e * cap` (the rest -1)
    /// and `r.slot_pos` the padded position of every assignment; `r.counts` is written,
    /// `r.offsets` and `r.sorted_token` are not. With `cap = n` (top-k picks distinct experts)
    /// every expert GEMM can run at `cap` rows: nothing needs to come back to the host to size
    /// them, so a layer loop issues without waiting on the device and can be captured in a
    /// CUDA graph.
    #[allow(clippy::too_many_arguments)]
    pub fn route_padded_into(
        &self,
        gpu: &GpuContext,
        logits: &CudaSlice<f32>,
        n: usize,
        renorm: bool,
        cap: usize,
        r: &mut Routing,
        sorted: &mut CudaSlice<i32>,
    ) -> Result<(), KernelError> {
        let (e, k) = (self.num_experts, self.top_k);
        ensure(logits.len() >= n * e, || "logits too short".into())?;
        ensure(cap >= n, || {
            format!("capacity {cap} below the {n} tokens one expert may receive")
        })?;
        ensure(
            r.tokens(k) >= n && r.counts.len() == e && sorted.len() >= e * cap,
            || format!("padded routing buffers too small for {n} tokens at capacity {cap}"),
        )?;
        ensure(e * cap <= i32::MAX as usize, || {
            "padded layout exceeds i32".into()
        })?;
        if n == 0 {
            return Ok(());
        }
        self.launch_topk(gpu, logits, n, renorm, r)?;
        let (ki, nai, ci) = (k as i32, (n * k) as i32, cap as i32);
        let mut b = gpu.stream.launch_builder(&self.rank_padded);
        b.arg(&r.ids)
            .arg(&nai)
            .arg(&ki)
            .arg(&ci)
            .arg(&mut r.counts)
            .arg(sorted)
            .arg(&mut r.slot_pos);
        // SAFETY: positions are < E * cap (checked above); slot_pos holds n * k entries.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (e as u32, 1, 1),
                block_dim: (1024, 1, 1),
                shared_mem_bytes: 0,
            })
        }?;
        Ok(())
    }

    /// xs `[rows, dim]` = rows of x in the order of `sorted` (`[rows]`, from
    /// [`Self::route_padded_into`]), zero rows where it holds -1.
    pub fn gather_padded(
        &self,
        gpu: &GpuContext,
        x: &CudaSlice<bf16>,
        sorted: &CudaSlice<i32>,
        rows: usize,
        dim: usize,
        xs: &mut CudaSlice<bf16>,
    ) -> Result<(), KernelError> {
        ensure(sorted.len() >= rows && xs.len() >= rows * dim, || {
            "sorted or xs too short".into()
        })?;
        if rows == 0 {
            return Ok(());
        }
        let d = dim as i32;
        let mut b = gpu.stream.launch_builder(&self.gather);
        b.arg(x).arg(sorted).arg(&d).arg(xs);
        // SAFETY: entries of `sorted` are -1 or token ids of x's rows (route_padded_into).
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            })
        }?;
        Ok(())
    }

    /// Launches the top-k kernel: each token's experts and weights into `r`.
    fn launch_topk(
        &self,
        gpu: &GpuContext,
        logits: &CudaSlice<f32>,
        n: usize,
        renorm: bool,
        r: &mut Routing,
    ) -> Result<(), KernelError> {
        let (e, k) = (self.num_experts, self.top_k);
        let (ni, ei, ki) = (n as i32, e as i32, k as i32);
        let warps = 4u32;
        let cfg = LaunchConfig {
            grid_dim: ((n as u32).div_ceil(warps), 1, 1),
            block_dim: (warps * 32, 1, 1),
            shared_mem_bytes: warps * e as u32 * 4,
        };
        ensure(cfg.shared_mem_bytes <= 48 * 1024, || {
            "too many experts for the top-k kernel".into()
        })?;
        let rn = renorm as i32;
        let mut b = gpu.stream.launch_builder(&self.topk);
        b.arg(logits)
            .arg(&ni)
            .arg(&ei)
            .arg(&ki)
            .arg(&rn)
            .arg(&mut r.ids)
            .arg(&mut r.weights);
        // SAFETY: outputs hold n * k entries, shared memory sized for `warps` rows of E.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Launches the kernels that build the permutation from the chosen experts: per-expert
    /// counts, their offsets, then each pick's position in expert-major order.
    fn launch_permutation(
        &self,
        gpu: &GpuContext,
        n: usize,
        r: &mut Routing,
    ) -> Result<(), KernelError> {
        let s = &gpu.stream;
        let (e, k) = (self.num_experts, self.top_k);
        let (ei, ki, nai) = (e as i32, k as i32, (n * k) as i32);
        let mut b = s.launch_builder(&self.count);
        b.arg(&r.ids).arg(&nai).arg(&mut r.counts);
        // SAFETY: one block per expert writes counts[e].
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (e as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            })
        }?;
        let mut b = s.launch_builder(&self.offsets);
        b.arg(&r.counts).arg(&ei).arg(&mut r.offsets);
        // SAFETY: offsets holds E + 1 entries.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (1, 1, 1),
                block_dim: (32, 1, 1),
                shared_mem_bytes: 0,
            })
        }?;
        let mut b = s.launch_builder(&self.rank);
        b.arg(&r.ids)
            .arg(&nai)
            .arg(&ki)
            .arg(&r.offsets)
            .arg(&mut r.sorted_token)
            .arg(&mut r.slot_pos);
        // SAFETY: positions are < n * k by construction of the offsets.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (e as u32, 1, 1),
                block_dim: (1024, 1, 1),
                shared_mem_bytes: 0,
            })
        }?;
        Ok(())
    }

    /// xs `[n k, dim]` = rows of x `[n, dim]` in expert-major order.
    pub fn gather(
        &self,
        gpu: &GpuContext,
        x: &CudaSlice<bf16>,
        r: &Routing,
        n: usize,
        dim: usize,
        xs: &mut CudaSlice<bf16>,
    ) -> Result<(), KernelError> {
        let na = n * self.top_k;
        ensure(x.len() >= n * dim && xs.len() >= na * dim, || {
            "x or xs too short".into()
        })?;
        if na == 0 {
            return Ok(());
        }
        let d = dim as i32;
        let mut b = gpu.stream.launch_builder(&self.gather);
        b.arg(x).arg(&r.sorted_token).arg(&d).arg(xs);
        // SAFETY: sorted_token entries are token ids < n.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (na as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            })
        }?;
        Ok(())
    }

    /// out `[n, dim]` = weighted sum of each token's k expert outputs `ys` `[n k, dim]`.
    pub fn combine(
        &self,
        gpu: &GpuContext,
        ys: &CudaSlice<bf16>,
        r: &Routing,
        n: usize,
        dim: usize,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), KernelError> {
        ensure(
            ys.len() >= n * self.top_k * dim && out.len() >= n * dim,
            || "ys or out too short".into(),
        )?;
        if n == 0 {
            return Ok(());
        }
        let (k, d) = (self.top_k as i32, dim as i32);
        let mut b = gpu.stream.launch_builder(&self.combine);
        b.arg(ys)
            .arg(&r.slot_pos)
            .arg(&r.weights)
            .arg(&k)
            .arg(&d)
            .arg(out);
        // SAFETY: slot positions are < n * k.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (n as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            })
        }?;
        Ok(())
    }
}

/// Sizes of the MoE GPU check: tokens, experts, picks per token, row width.
const CHECK_N: usize = 77;
const CHECK_E: usize = 64;
const CHECK_K: usize = 6;
const CHECK_DIM: usize = 96;

/// Entries that differ between two permutations (the offsets counting once).
fn permutation_mismatches(got: &Permutation, want: &Permutation) -> usize {
    (got.offsets != want.offsets) as usize
        + got
            .sorted_token
            .iter()
            .zip(&want.sorted_token)
            .filter(|(a, b)| a != b)
            .count()
        + got
            .slot_pos
            .iter()
            .zip(&want.slot_pos)
            .filter(|(a, b)| a != b)
            .count()
}

/// Reused buffers (as the backend's layer loop keeps them): room for twice the tokens,
/// holding another routing (drawn from `r`) first; the tokens' arrays of routing `logits`
/// again must come out as `fresh` and its permutation `got` did. Returns the arrays that
/// differ.
fn reused_routing_mismatches(
    gpu: &GpuContext,
    router: &MoeRouter,
    r: &mut ChaCha8Rng,
    logits: &[f32],
    fresh: &Routing,
    (ids, got): (&[i32], &Permutation),
) -> Result<usize, KernelError> {
    let (n, e, k) = (CHECK_N, CHECK_E, CHECK_K);
    let s = &gpu.stream;
    let mut reused = Routing::alloc(gpu, 2 * n, e, k)?;
    let other = random_f32(r, 2 * n * e, 4.0);
    router.route_into(gpu, &s.clone_htod(&other)?, 2 * n, true, &mut reused)?;
    router.route_into(gpu, &s.clone_htod(logits)?, n, true, &mut reused)?;
    let na = n * k;
    Ok([
        (s.clone_dtoh(&reused.ids)?[..na] != ids[..]) as usize,
        (s.clone_dtoh(&reused.weights)?[..na] != s.clone_dtoh(&fresh.weights)?[..]) as usize,
        (s.clone_dtoh(&reused.counts)? != s.clone_dtoh(&fresh.counts)?) as usize,
        (s.clone_dtoh(&reused.offsets)? != got.offsets) as usize,
        (s.clone_dtoh(&reused.sorted_token)?[..na] != got.sorted_token[..]) as usize,
        (s.clone_dtoh(&reused.slot_pos)?[..na] != got.slot_pos[..]) as usize,
    ]
    .iter()
    .sum())
}

/// Gathers `x` into expert order on the GPU; returns the rows that are not bit-exact copies
/// of the rows `perm` names.
fn gather_mismatches(
    gpu: &GpuContext,
    router: &MoeRouter,
    routing: &Routing,
    x: &[bf16],
    perm: &Permutation,
) -> Result<usize, KernelError> {
    let (n, k, dim) = (CHECK_N, CHECK_K, CHECK_DIM);
    let s = &gpu.stream;
    let dx = s.clone_htod(x)?;
    let mut xs = s.clone_htod(&vec![bf16::NAN; n * k * dim])?;
    router.gather(gpu, &dx, routing, n, dim, &mut xs)?;
    let xs_host = s.clone_dtoh(&xs)?;
    Ok((0..n * k)
        .filter(|&p| {
            xs_host[p * dim..(p + 1) * dim]
                .iter()
                .zip(&x[perm.sorted_token[p] as usize * dim..][..dim])
                .any(|(a, b)| a.to_bits() != b.to_bits())
        })
        .count())
}

/// "Expert outputs": random rows (drawn from `r`) in permuted order, combined back per token
/// on the GPU against the CPU combine.
fn check_combine(
    gpu: &GpuContext,
    router: &MoeRouter,
    r: &mut ChaCha8Rng,
    routing: &Routing,
    perm: &Permutation,
    detail: String,
) -> Result<CheckResult, KernelError> {
    let (n, k, dim) = (CHECK_N, CHECK_K, CHECK_DIM);
    let s = &gpu.stream;
    let ys = random_bf16(r, n * k * dim, 1.0);
    let mut dout = s.clone_htod(&vec![bf16::NAN; n * dim])?;
    router.combine(gpu, &s.clone_htod(&ys)?, routing, n, dim, &mut dout)?;
    let w32 = s.clone_dtoh(&routing.weights)?;
    let reference = combine_cpu(&ys, &perm.slot_pos, &w32, k, dim);
    let got: Vec<f64> = s.clone_dtoh(&dout)?.iter().map(|v| v.to_f64()).collect();
    Ok(CheckResult::from_stats(
        "moe_combine",
        detail,
        ErrorStats::of(&got, &reference),
        BF16_TOL,
    ))
}

pub fn check_gpu(gpu: &GpuContext, seed: u64) -> Result<Vec<CheckResult>, KernelError> {
    let (n, e, k, dim) = (CHECK_N, CHECK_E, CHECK_K, CHECK_DIM);
    let router = MoeRouter::new(gpu, e, k)?;
    let mut r = rng(seed);
    let logits = random_f32(&mut r, n * e, 4.0);
    let x = random_bf16(&mut r, n * dim, 1.0);
    let s = &gpu.stream;
    let routing = router.route(gpu, &s.clone_htod(&logits)?, n, true)?;
    let (ref_ids, ref_w) = topk_softmax_cpu(&logits, e, k, true);
    let ids = s.clone_dtoh(&routing.ids)?;
    let w: Vec<f64> = s
        .clone_dtoh(&routing.weights)?
        .iter()
        .map(|&v| v as f64)
        .collect();
    let detail = format!("n={n} experts={e} top_k={k} dim={dim}");
    let mut out = vec![
        CheckResult::exact(
            "moe_topk_ids",
            detail.clone(),
            ids.iter().zip(&ref_ids).filter(|(a, b)| a != b).count(),
        ),
        CheckResult::from_stats(
            "moe_topk_weights",
            detail.clone(),
            ErrorStats::of(&w, &ref_w),
            1e-5,
        ),
    ];
    // The permutation is checked against the CPU one built from the GPU's own ids.
    let perm = permutation_cpu(&ids, e, k);
    let got = Permutation {
        offsets: s.clone_dtoh(&routing.offsets)?,
        sorted_token: s.clone_dtoh(&routing.sorted_token)?,
        slot_pos: s.clone_dtoh(&routing.slot_pos)?,
    };
    let mism = permutation_mismatches(&got, &perm);
    out.push(CheckResult::exact("moe_permutation", detail.clone(), mism));
    let reuse_mism =
        reused_routing_mismatches(gpu, &router, &mut r, &logits, &routing, (&ids, &got))?;
    out.push(CheckResult::exact(
        "moe_route_into_reused",
        format!("{detail}, buffers for {} tokens, used before", 2 * n),
        reuse_mism,
    ));
    let gather_mism = gather_mismatches(gpu, &router, &routing, &x, &perm)?;
    out.push(CheckResult::exact(
        "moe_gather",
        detail.clone(),
        gather_mism,
    ));
    out.push(check_combine(
        gpu,
        &router,
        &mut r,
        &routing,
        &perm,
        detail.clone(),
    )?);
    out.push(check_padded(gpu, &router, &logits, &ids, &x, detail)?);
    Ok(out)
}

/// The padded layout on the GPU (reused buffers for more tokens, written before with another
/// routing) against [`padded_permutation_cpu`] of the GPU's ids: positions, slots, counts, and
/// the gathered rows (zeros at unused positions), all exact.
fn check_padded(
    gpu: &GpuContext,
    router: &MoeRouter,
    logits: &[f32],
    ids: &[i32],
    x: &[bf16],
    detail: String,
) -> Result<CheckResult, KernelError> {
    let (n, e, k, dim) = (CHECK_N, CHECK_E, CHECK_K, CHECK_DIM);
    let s = &gpu.stream;
    let cap = n;
    let mut routing = Routing::alloc(gpu, n, e, k)?;
    let mut sorted = s.clone_htod(&vec![7i32; e * cap])?;
    router.route_padded_into(
        gpu,
        &s.clone_htod(logits)?,
        n,
        true,
        cap,
        &mut routing,
        &mut sorted,
    )?;
    let (want_sorted, want_slots) = padded_permutation_cpu(ids, e, k, cap);
    let mut bad = (s.clone_dtoh(&sorted)? != want_sorted) as usize;
    bad += (s.clone_dtoh(&routing.slot_pos)?[..n * k] != want_slots[..]) as usize;
    let mut counts = vec![0i32; e];
    for &i in ids {
        counts[i as usize] += 1;
    }
    bad += (s.clone_dtoh(&routing.counts)? != counts) as usize;
    let mut xs = s.clone_htod(&vec![bf16::NAN; e * cap * dim])?;
    router.gather_padded(gpu, &s.clone_htod(x)?, &sorted, e * cap, dim, &mut xs)?;
    let xs = s.clone_dtoh(&xs)?;
    bad += (0..e * cap)
        .filter(|&p| {
            let row = &xs[p * dim..(p + 1) * dim];
            match want_sorted[p] {
                t if t < 0 => row.iter().any(|v| v.to_bits() != 0),
                t => row
                    .iter()
                    .zip(&x[t as usize * dim..][..dim])
                    .any(|(a, b)| a.to_bits() != b.to_bits()),
            }
        })
        .count();
    Ok(CheckResult::exact(
        "moe_padded_layout",
        format!("{detail}, capacity {cap}"),
        bad,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::gpu_or_skip;

    #[test]
    fn topk_breaks_ties_to_lower_expert_and_renormalises() {
        let (ids, w) = topk_softmax_cpu(&[1.0, 3.0, 3.0, 0.0], 4, 2, true);
        assert_eq!(ids, vec![1, 2]);
        assert!((w[0] - 0.5).abs() < 1e-12 && (w[1] - 0.5).abs() < 1e-12);
    }

    #[test]
    fn permutation_is_expert_major_and_stable() {
        // tokens 0,1,2 with k = 2: assignments (0:e1,e0) (1:e1,e2) (2:e0,e1)
        let ids = [1, 0, 1, 2, 0, 1];
        let p = permutation_cpu(&ids, 3, 2);
        assert_eq!(p.offsets, vec![0, 2, 5, 6]);
        assert_eq!(p.sorted_token, vec![0, 2, 0, 1, 2, 1]);
        assert_eq!(p.slot_pos, vec![2, 0, 3, 5, 1, 4]);
    }

    #[test]
    fn padded_permutation_keeps_the_order_within_each_expert() {
        // as in the test above: (0:e1,e0) (1:e1,e2) (2:e0,e1), capacity 3 per expert
        let ids = [1, 0, 1, 2, 0, 1];
        let (sorted, slots) = padded_permutation_cpu(&ids, 3, 2, 3);
        assert_eq!(sorted, vec![0, 2, -1, 0, 1, 2, 1, -1, -1]);
        assert_eq!(slots, vec![3, 0, 4, 6, 1, 5]);
    }

    proptest::proptest! {
        #[test]
        fn permutation_inverts(ids in proptest::collection::vec(0i32..5, 0..60)) {
            let k = 3;
            let ids = &ids[..ids.len() / k * k];
            let p = permutation_cpu(ids, 5, k);
            for (a, &pos) in p.slot_pos.iter().enumerate() {
                proptest::prop_assert_eq!(p.sorted_token[pos as usize], (a / k) as i32);
                let e = ids[a] as usize;
                proptest::prop_assert!(p.offsets[e] <= pos && pos < p.offsets[e + 1]);
            }
        }
    }

    #[test]
    fn gpu_matches_cpu() {
        let Some(gpu) = gpu_or_skip() else { return };
        crate::check::assert_all_passed(&check_gpu(&gpu, 51).unwrap());
    }
}
