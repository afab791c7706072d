//! Speed against the same GPU's measured ceilings (issue 6, item 6):
//! decode attention bandwidth over device-to-device copy bandwidth; a whole prefill step of the
//! CUDA backend on an 8K-token chunk (every kernel of the step, not only its GEMMs) over a large
//! cuBLAS bf16 GEMM; host-to-device block swap over one large pinned copy. Attention bandwidth
//! is also reported against a read-only streaming ceiling and the datasheet ([`ceilings`]), and
//! the MLA-shaped decode kernel is measured at the served batch ([`mla`]).

pub mod ceilings;
pub mod decode_step;
pub mod mla;
pub mod prefill;

use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, PinnedHostSlice};
use half::bf16;
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use servelab_core::engine::plan::{PrefillChunk, PrefillPlan, StepPlan, StepReport};
use servelab_core::ids::{EngineId, RequestId};
use servelab_kernels::attention::{
    AttentionKernel, DeviceRows, KvLayout, MmaConfig, PagedAttention, PagedAttentionShape,
    QueryRows, mma_config, random_tables, tiled_tile,
};
use servelab_kernels::fill::{fill_uniform_bf16, gather_blocks_raw};
use servelab_kernels::gemm::linear_bf16;
use servelab_kernels::prefill_attention::{
    PrefillAttention, PrefillTiles, chunk_rows, default_tiles,
};
use servelab_kernels::{GpuContext, KernelError};

use crate::backend::{BackendConfig, BackendError, CudaBackend, ModelShape, PhaseTimes};
use crate::timing::{Timing, summarize, time_ms};
use ceilings::{Ceilings, datasheet_gbps, measure_read};
use mla::measure_mla_decode;

/// What to measure; `quick` shrinks every size for a smoke run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SpeedConfig {
    pub copy_bytes: usize,
    pub gemm_ceiling_dim: usize,
    pub decode_seqs: usize,
    pub decode_context: usize,
    pub decode_shapes: Vec<PagedAttentionShape>,
    /// The MLA kernel's shape (latent 576, value 512, heads per latent) and the query tokens
    /// per sequence it is measured at (1: decode; more: DSpark verification).
    pub mla_shape: PagedAttentionShape,
    pub mla_query_tokens: Vec<usize>,
    pub prefill: PrefillShape,
    /// Cached prefixes of the whole-step measurement: the judged row is the first (0: a fresh
    /// prompt's first chunk); the others are a chunk after a cached prefix (a cache hit).
    pub prefill_step_prefixes: Vec<usize>,
    pub swap_block_bytes: usize,
    pub swap_blocks: usize,
    pub reps: usize,
    pub seed: u64,
}

impl SpeedConfig {
    pub fn full(seed: u64) -> Self {
        Self {
            copy_bytes: 1 << 30,
            gemm_ceiling_dim: 8192,
            decode_seqs: 64,
            decode_context: 16_384,
            decode_shapes: vec![
                PagedAttentionShape {
                    num_kv_heads: 8,
                    group: 4,
                    d_qk: 128,
                    d_v: 128,
                    block_size: 128,
                },
                PagedAttentionShape {
                    num_kv_heads: 4,
                    group: 2,
                    d_qk: 256,
                    d_v: 256,
                    block_size: 128,
                },
                PagedAttentionShape {
                    num_kv_heads: 1,
                    group: 16,
                    d_qk: 576,
                    d_v: 512,
                    block_size: 128,
                },
            ],
            mla_shape: servelab_kernels::mla_attention::spec_shape(16),
            mla_query_tokens: vec![1, 2, 4, 6],
            prefill: PrefillShape::scaled_default(8192),
            prefill_step_prefixes: vec![0, 8192],
            // 128 tokens x 890 B of global KV per token (SPEC §1)
            swap_block_bytes: 128 * 890,
            swap_blocks: 2048,
            reps: 20,
            seed,
        }
    }

    pub fn quick(seed: u64) -> Self {
        Self {
            copy_bytes: 64 << 20,
            gemm_ceiling_dim: 2048,
            decode_seqs: 4,
            decode_context: 1024,
            mla_query_tokens: vec![1, 3],
            prefill: PrefillShape {
                experts: 8,
                hidden: 1024,
                q_dim: 1024,
                expert_ffn: 256,
                shared_ffn: 512,
                ..PrefillShape::scaled_default(512)
            },
            prefill_step_prefixes: vec![0, 256],
            swap_blocks: 64,
            reps: 3,
            ..Self::full(seed)
        }
    }
}

/// The GEMMs of one prefill layer of the scaled-down model.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct PrefillShape {
    pub tokens: usize,
    pub hidden: usize,
    pub q_dim: usize,
    pub kv_dim: usize,
    pub experts: usize,
    pub top_k: usize,
    pub expert_ffn: usize,
    pub shared_ffn: usize,
}

impl PrefillShape {
    pub fn scaled_default(tokens: usize) -> Self {
        Self {
            tokens,
            hidden: 4096,
            q_dim: 4096,
            kv_dim: 576,
            experts: 64,
            top_k: 8,
            expert_ffn: 1024,
            shared_ffn: 2048,
        }
    }

    /// (m, n, k) of every GEMM in the layer, routed tokens spread evenly over experts.
    pub fn gemms(&self) -> Vec<(usize, usize, usize)> {
        let t = self.tokens;
        let mut g = vec![
            (t, self.q_dim, self.hidden),
            (t, self.kv_dim, self.hidden),
            (t, self.hidden, self.q_dim),
            (t, 2 * self.shared_ffn, self.hidden),
            (t, self.hidden, self.shared_ffn),
        ];
        let rows = (t * self.top_k).div_ceil(self.experts.max(1));
        for _ in 0..self.experts {
            g.push((rows, 2 * self.expert_ffn, self.hidden));
            g.push((rows, self.hidden, self.expert_ffn));
        }
        g
    }
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Rate {
    pub what: String,
    pub timing: Timing,
    /// Bytes moved (GB/s rows) or FLOP (TFLOP/s rows) per run.
    pub amount: f64,
    pub rate: f64,
    pub unit: &'static str,
    /// rate / the ceiling it is compared with.
    pub ratio: Option<f64>,
    pub note: String,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct SpeedReport {
    pub gpu: String,
    pub compute_capability: (i32, i32),
    pub driver_version: i32,
    pub config: SpeedConfig,
    pub copy_ceiling: Rate,
    /// Bytes read by a kernel that only reads: the fair ceiling for attention.
    pub read_ceiling: Rate,
    /// Copy, read-only and datasheet bandwidth (GB/s) every decode row is also compared with.
    pub ceilings: Ceilings,
    pub gemm_ceiling: Rate,
    pub decode: Vec<Rate>,
    /// The whole prefill step on an 8K-token chunk (fresh prompt) through the CUDA backend:
    /// the row issue 6's prefill target is judged on.
    pub prefill: Rate,
    /// The same step after a cached prefix, per `prefill_step_prefixes[1..]`, then the first
    /// prefix's step without the prefill kernel (split decode kernels and the CUDA-core SWA
    /// kernel: the path before it).
    pub prefill_after_prefix: Vec<Rate>,
    /// Where the whole steps' device time goes (one diagnostic rep each, same order).
    pub prefill_phases: Vec<PrefillPhases>,
    /// The prefill attention kernel alone at the step's shape, per tiles (default first).
    pub prefill_attention: Vec<Rate>,
    /// Only the GEMMs of one SPEC-shaped prefill layer, back to back (an upper bound).
    pub prefill_gemms_only: Rate,
    pub swap: Vec<Rate>,
    pub swap_roundtrip_bit_identical: bool,
}

fn gbps(bytes: f64, t: &Timing) -> f64 {
    bytes / (t.median_ms * 1e-3) / 1e9
}

pub fn measure_copy(gpu: &GpuContext, bytes: usize, reps: usize) -> Result<Rate, KernelError> {
    let n = bytes / 2;
    let mut a = gpu.stream.alloc_zeros::<bf16>(n)?;
    fill_uniform_bf16(gpu, &mut a, 1, 1.0)?;
    let mut b = gpu.stream.alloc_zeros::<bf16>(n)?;
    let t = time_ms(gpu, 3, reps, || {
        gpu.stream
            .memcpy_dtod(&a, &mut b)
            .map_err(KernelError::from)
    })?;
    let moved = 2.0 * (n * 2) as f64;
    Ok(Rate {
        what: format!("D2D copy {} MiB", bytes >> 20),
        rate: gbps(moved, &t),
        timing: t,
        amount: moved,
        unit: "GB/s",
        ratio: None,
        note: "bytes read + written".into(),
    })
}

pub fn measure_gemm_ceiling(
    gpu: &GpuContext,
    dim: usize,
    reps: usize,
) -> Result<Rate, KernelError> {
    let s = &gpu.stream;
    let mut x = s.alloc_zeros::<bf16>(dim * dim)?;
    let mut w = s.alloc_zeros::<bf16>(dim * dim)?;
    fill_uniform_bf16(gpu, &mut x, 2, 1.0)?;
    fill_uniform_bf16(gpu, &mut w, 3, 1.0)?;
    let mut y = s.alloc_zeros::<bf16>(dim * dim)?;
    let t = time_ms(gpu, 3, reps, || {
        linear_bf16(gpu, &x, &w, &mut y, dim, dim, dim)
    })?;
    let flop = 2.0 * (dim as f64).powi(3);
    Ok(Rate {
        what: format!("cuBLAS bf16 GEMM {dim}^3"),
        rate: flop / (t.median_ms * 1e-3) / 1e12,
        timing: t,
        amount: flop,
        unit: "TFLOP/s",
        ratio: None,
        note: "random inputs".into(),
    })
}

/// A swept tensor-core tile shape: keys per tile, stages, warps, blocks per SM bound, swizzle,
/// L2 prefetch, lazy rescale.
type TileShape = (usize, usize, usize, usize, bool, bool, bool);

/// Tile shapes of the tensor-core decode kernel swept beside its default.
const MMA_TILE_SWEEP: &[TileShape] = &[
    (16, 2, 16, 1, false, false, false),
    (16, 3, 16, 1, true, false, false),
    (16, 3, 16, 1, true, true, false),
    (16, 2, 16, 1, true, true, false),
    (16, 4, 12, 1, true, false, false),
    (16, 3, 8, 2, true, false, false),
    (16, 3, 8, 1, true, false, false),
    (16, 4, 8, 1, true, false, false),
    (32, 2, 8, 1, true, false, false),
    (16, 2, 8, 2, false, false, false),
    (16, 2, 4, 2, true, false, false),
    // fewer warps with headroom under the register cap (16 warps spill 72 B),
    // and 32-key tiles on padded rows
    (16, 2, 12, 1, false, false, false),
    (16, 2, 16, 1, false, true, false),
    (32, 2, 8, 1, false, false, false),
    (32, 2, 6, 1, false, false, false),
    // the lazy rescale on the best shapes above
    (16, 2, 16, 1, false, false, true),
    (16, 2, 16, 1, false, true, true),
    (16, 2, 16, 1, true, true, true),
    (16, 3, 16, 1, true, false, true),
    (16, 2, 12, 1, false, false, true),
    (16, 2, 8, 2, false, false, true),
    (32, 2, 8, 1, false, false, true),
    (16, 2, 4, 2, true, false, true),
];

/// Tile shapes swept with swapped operands (keys as the MMA's M, query rows as N): half the
/// MMAs at group <= 8 and half the output registers, so fewer warps with more keys in flight
/// and deeper rings become affordable.
const SWAPPED_MMA_TILE_SWEEP: &[TileShape] = &[
    (16, 2, 16, 1, false, true, true),
    (16, 2, 16, 1, false, false, true),
    (16, 2, 16, 1, true, true, true),
    (16, 3, 16, 1, true, true, true),
    (32, 2, 8, 1, false, true, true),
    (32, 2, 8, 2, false, true, true),
    (32, 3, 8, 1, true, true, true),
    (16, 4, 8, 1, true, true, true),
    (16, 2, 8, 2, false, true, true),
    (32, 2, 4, 4, true, true, true),
];

/// The tiles a decode measurement sweeps: the tensor-core kernel's default first, then every
/// swept shape valid at `shape` (each variant is one NVRTC compile); `[None]` for the other
/// kernels.
fn decode_tile_options(
    kernel: AttentionKernel,
    att: &PagedAttention,
    shape: &PagedAttentionShape,
) -> Vec<Option<MmaConfig>> {
    let (AttentionKernel::Mma, Some(default)) = (kernel, att.mma_tiles()) else {
        return vec![None];
    };
    let mut v = vec![Some(default)];
    let sweep = MMA_TILE_SWEEP
        .iter()
        .map(|&t| (t, false))
        .chain(SWAPPED_MMA_TILE_SWEEP.iter().map(|&t| (t, true)));
    for (t, swap_operands) in sweep {
        let (keys_per_tile, stages, warps, min_blocks, swizzle, l2_prefetch, lazy_rescale) = t;
        let c = MmaConfig {
            keys_per_tile,
            stages,
            warps,
            min_blocks,
            swizzle,
            l2_prefetch,
            lazy_rescale,
            swap_operands,
        };
        // every block the launch bounds ask for must fit in the SM's shared memory
        if c != default && c.validate_for(shape) && c.smem_bytes(shape) * min_blocks <= 227 * 1024 {
            v.push(Some(c));
        }
    }
    v
}

/// The device side of a decode measurement: random block tables and KV, one query token per
/// sequence.
struct DecodeBench {
    layout: KvLayout,
    rows: DeviceRows,
    kv: CudaSlice<bf16>,
    q: CudaSlice<bf16>,
    out: CudaSlice<bf16>,
    scale: f32,
}

fn decode_bench(
    gpu: &GpuContext,
    att: &PagedAttention,
    shape: &PagedAttentionShape,
    seqs: usize,
    context: usize,
    seed: u64,
) -> Result<DecodeBench, KernelError> {
    let blocks_per_seq = context.div_ceil(shape.block_size);
    let num_blocks = seqs * blocks_per_seq;
    let layout = KvLayout::packed(shape, num_blocks);
    let tables = random_tables(seed, seqs, blocks_per_seq, num_blocks);
    let rows = QueryRows::decode(&vec![context; seqs]);
    let d_rows = att.upload(gpu, &layout, &tables, &rows)?;
    let s = &gpu.stream;
    let mut kv = s.alloc_zeros::<bf16>(layout.min_len(shape))?;
    fill_uniform_bf16(gpu, &mut kv, seed, 1.0)?;
    let mut q = s.alloc_zeros::<bf16>(seqs * shape.num_heads() * shape.d_qk)?;
    fill_uniform_bf16(gpu, &mut q, seed + 1, 1.0)?;
    let out = s.alloc_zeros::<bf16>(seqs * shape.num_heads() * shape.d_v)?;
    Ok(DecodeBench {
        layout,
        rows: d_rows,
        kv,
        q,
        out,
        scale: 1.0 / (shape.d_qk as f32).sqrt(),
    })
}

/// The fastest point of a split sweep: tokens per split, tiles, timing, (registers, local
/// bytes) of the split kernel.
type BestSplit = (usize, Option<MmaConfig>, Timing, (i32, i32));

struct SplitSweep {
    best: BestSplit,
    tried: Vec<(usize, Option<MmaConfig>)>,
    /// The backend's choice: default tiles with the split rule (recomputed per tile shape).
    default_timing: Option<(usize, Timing)>,
}

/// Times every tile option at the split rule's size, `default_tps` and fixed sizes.
fn sweep_decode_splits(
    gpu: &GpuContext,
    att: &mut PagedAttention,
    bench: &mut DecodeBench,
    tile_options: &[Option<MmaConfig>],
    default_tps: usize,
    reps: usize,
) -> Result<SplitSweep, KernelError> {
    let mut best: Option<BestSplit> = None;
    let mut tried = Vec::new();
    let mut default_timing: Option<(usize, Timing)> = None;
    for (ti, tiles) in tile_options.iter().enumerate() {
        if let Some(c) = tiles {
            att.set_mma_tiles(gpu, *c)?;
        }
        let rule_tps = att.default_tokens_per_split(&bench.rows);
        let resources = att.split_resources();
        for tps in [rule_tps, default_tps, 256, 512, 768, 1024, 1536, 2048, 4096] {
            if tried.contains(&(tps, *tiles)) {
                continue;
            }
            let mut ws = att.workspace(gpu, &bench.rows, tps)?;
            let kvv = bench.kv.as_view();
            let (q, layout, rows, scale) = (&bench.q, &bench.layout, &bench.rows, bench.scale);
            let out = &mut bench.out;
            let t = time_ms(gpu, 2, reps, || {
                att.run(gpu, q, &kvv, layout, rows, tps, &mut ws, scale, out)
            })?;
            tried.push((tps, *tiles));
            if ti == 0 && tps == rule_tps {
                default_timing = Some((tps, t));
            }
            if best
                .as_ref()
                .is_none_or(|(_, _, b, _)| t.median_ms < b.median_ms)
            {
                best = Some((tps, *tiles, t, resources));
            }
        }
    }
    Ok(SplitSweep {
        best: best.expect("at least one split size"),
        tried,
        default_timing,
    })
}

/// The note of a decode row: the best split and tiles of the sweep, the split kernel's
/// resources and the backend default's rate.
fn decode_note(
    sweep: &SplitSweep,
    default_tps: usize,
    tile_options: usize,
    kv_bytes: f64,
    copy_gbps: f64,
) -> String {
    let (tps, tiles, _, (regs, local)) = &sweep.best;
    let tried_tps: Vec<usize> = {
        let mut v: Vec<usize> = sweep.tried.iter().map(|(t, _)| *t).collect();
        v.sort_unstable();
        v.dedup();
        v
    };
    let tiles_note = match tiles {
        Some(c) => format!(
            "; best tiles {} keys x {} stages x {} warps, {} blocks/SM bound, swizzle {}, L2 prefetch {}, lazy rescale {}, swapped operands {}, of {} tried",
            c.keys_per_tile,
            c.stages,
            c.warps,
            c.min_blocks,
            c.swizzle,
            c.l2_prefetch,
            c.lazy_rescale,
            c.swap_operands,
            tile_options
        ),
        None => String::new(),
    };
    let default_note = match &sweep.default_timing {
        Some((dt, dtm)) => {
            let r = gbps(kv_bytes, dtm);
            format!(
                "; backend default (rule {dt} tokens/split, default tiles) {r:.1} GB/s = {:.1}%",
                100.0 * r / copy_gbps
            )
        }
        None => String::new(),
    };
    format!(
        "KV bytes read; best tokens/split {tps} of {tried_tps:?} (default {default_tps}){tiles_note}; split kernel {regs} regs, {local} B local{default_note}"
    )
}

/// Decode over `seqs` sequences of `context` tokens with random block tables.
#[allow(clippy::too_many_arguments)]
pub fn measure_decode(
    gpu: &GpuContext,
    shape: PagedAttentionShape,
    kernel: AttentionKernel,
    seqs: usize,
    context: usize,
    reps: usize,
    copy_gbps: f64,
    seed: u64,
) -> Result<Rate, KernelError> {
    let mut att = PagedAttention::new(gpu, shape)?;
    att.set_kernel(kernel)?;
    let tile_options = decode_tile_options(kernel, &att, &shape);
    let mut bench = decode_bench(gpu, &att, &shape, seqs, context, seed)?;
    let kv_bytes = (seqs * context * shape.num_kv_heads * shape.d_qk * 2) as f64;
    // Sweep the split size: the default heuristic and fixed sizes; report the best.
    let default_tps = att.default_tokens_per_split(&bench.rows);
    let sweep = sweep_decode_splits(gpu, &mut att, &mut bench, &tile_options, default_tps, reps)?;
    let note = decode_note(&sweep, default_tps, tile_options.len(), kv_bytes, copy_gbps);
    let t = sweep.best.2;
    let rate = gbps(kv_bytes, &t);
    Ok(Rate {
        what: format!(
            "decode attention ({kernel:?}) kvh={} group={} d_qk={} d_v={}, {seqs} seqs x {context} tokens",
            shape.num_kv_heads, shape.group, shape.d_qk, shape.d_v
        ),
        timing: t,
        amount: kv_bytes,
        rate,
        unit: "GB/s",
        ratio: Some(rate / copy_gbps),
        note,
    })
}

/// Only the GEMMs of one prefill layer, back to back with one input: an upper bound for the
/// step (no attention, norms, routing or gathers; experts evenly loaded).
pub fn measure_prefill_gemms(
    gpu: &GpuContext,
    p: &PrefillShape,
    reps: usize,
    ceiling_tflops: f64,
) -> Result<Rate, KernelError> {
    let s = &gpu.stream;
    let gemms = p.gemms();
    let max_in = gemms.iter().map(|&(m, _, k)| m * k).max().unwrap_or(1);
    let max_out = gemms.iter().map(|&(m, n, _)| m * n).max().unwrap_or(1);
    let mut x = s.alloc_zeros::<bf16>(max_in)?;
    fill_uniform_bf16(gpu, &mut x, 10, 1.0)?;
    let mut ws: Vec<CudaSlice<bf16>> = Vec::with_capacity(gemms.len());
    for (i, &(_, n, k)) in gemms.iter().enumerate() {
        let mut w = s.alloc_zeros::<bf16>(n * k)?;
        fill_uniform_bf16(gpu, &mut w, 100 + i as u64, 0.05)?;
        ws.push(w);
    }
    let mut y = s.alloc_zeros::<bf16>(max_out)?;
    let t = time_ms(gpu, 2, reps, || {
        for (&(m, n, k), w) in gemms.iter().zip(&ws) {
            linear_bf16(gpu, &x, w, &mut y, m, n, k)?;
        }
        Ok(())
    })?;
    let flop: f64 = gemms
        .iter()
        .map(|&(m, n, k)| 2.0 * (m * n * k) as f64)
        .sum();
    let rate = flop / (t.median_ms * 1e-3) / 1e12;
    Ok(Rate {
        what: format!(
            "prefill GEMMs only (not the step), {} tokens, one layer ({} GEMMs)",
            p.tokens,
            gemms.len()
        ),
        timing: t,
        amount: flop,
        rate,
        unit: "TFLOP/s",
        ratio: Some(rate / ceiling_tflops),
        note: format!("{p:?}; experts run one cuBLAS call each, routed tokens spread evenly"),
    })
}

/// Head width of the whole-step model's attention (the backend's default, and the prefill
/// kernel's main shape).
pub const STEP_HEAD_DIM: usize = 128;

/// The backend model of the whole-step measurement: one encoder layer of `p`'s widths (plus the
/// one decoder layer the model requires, which a chunk without decoder replay does not run),
/// with the backend's GQA attention in place of MLA: heads of [`STEP_HEAD_DIM`], and the KV-head
/// count whose row (`kv_heads x head_dim`) is nearest `p.kv_dim` among the divisors of the query
/// heads (ties: fewer KV heads). SPEC widths: 32 query heads over 4 KV heads, a 512-wide KV row
/// for MLA's 576.
pub fn prefill_step_model(p: &PrefillShape) -> Result<ModelShape, KernelError> {
    if p.q_dim == 0 || !p.q_dim.is_multiple_of(STEP_HEAD_DIM) {
        return Err(KernelError::shape(format!(
            "q_dim = {} must be a positive multiple of {STEP_HEAD_DIM}",
            p.q_dim
        )));
    }
    let heads = p.q_dim / STEP_HEAD_DIM;
    let kv_heads = (1..=heads)
        .filter(|k| heads.is_multiple_of(*k))
        .min_by_key(|&k| (k * STEP_HEAD_DIM).abs_diff(p.kv_dim))
        .unwrap_or(1);
    let m = ModelShape {
        encoder_layers: 1,
        decoder_layers: 1,
        hidden: p.hidden,
        experts: p.experts,
        top_k: p.top_k,
        expert_ffn: p.expert_ffn,
        shared_ffn: p.shared_ffn,
        vocab: 4096,
        ..ModelShape::default()
    }
    .gqa(kv_heads, heads / kv_heads, STEP_HEAD_DIM);
    m.validate()
        .map_err(|e| KernelError::shape(e.to_string()))?;
    Ok(m)
}

/// Analytic FLOPs of one prefill chunk of `tokens` tokens after `prefix` cached ones through
/// the encoder layers of `m` (no decoder replay), as the backend executes it.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct StepFlops {
    /// Every GEMM: Q and K projections, the output projection after the sliding window and
    /// again after the global attention (the backend adds both to the residual), router,
    /// routed experts (`top_k` per token, however they spread), shared expert, and the global
    /// KV projection.
    pub gemm: f64,
    /// QKᵀ and PV of the global attention, causal over prefix + chunk.
    pub attention: f64,
    /// QKᵀ and PV of the sliding window (truncated at the chunk start when `window_truncated`).
    pub swa: f64,
}

impl StepFlops {
    pub fn total(&self) -> f64 {
        self.gemm + self.attention + self.swa
    }

    pub fn of(m: &ModelShape, prefix: usize, tokens: usize, window_truncated: bool) -> Self {
        let (t, h, q, r, o) = (
            tokens as f64,
            m.hidden as f64,
            m.q_dim() as f64,
            m.kv_row() as f64,
            m.o_dim() as f64,
        );
        let per_layer = 2.0 * t * (q * h + r * h)
            + 2.0 * 2.0 * t * h * o
            + 2.0 * t * m.experts as f64 * h
            + 6.0 * t * m.top_k as f64 * m.expert_ffn as f64 * h
            + 6.0 * t * m.shared_ffn as f64 * h;
        let gemm = m.encoder_layers as f64 * per_layer + 2.0 * t * r * h;
        // per visible key: QKᵀ 2·d_qk and PV 2·d_v per query head
        let per_key = 2.0 * (m.heads() * (m.head_dim + m.d_v())) as f64;
        let global_keys: f64 = (0..tokens).map(|j| (prefix + j + 1) as f64).sum();
        let trunc = if window_truncated { prefix } else { 0 };
        let swa_keys: f64 = (0..tokens)
            .map(|j| {
                let pos = prefix + j;
                let lo = trunc.max((pos + 1).saturating_sub(m.window));
                (pos + 1 - lo) as f64
            })
            .sum();
        let layers = m.encoder_layers as f64;
        Self {
            gemm,
            attention: layers * per_key * global_keys,
            swa: layers * per_key * swa_keys,
        }
    }
}

/// The diagnostic split of one whole prefill step.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct PrefillPhases {
    pub prefix: usize,
    /// False for the reference path (split decode kernels and the CUDA-core SWA kernel).
    pub with_prefill_kernel: bool,
    pub tokens: usize,
    pub flops: StepFlops,
    pub phases: PhaseTimes,
    /// GEMM FLOPs over the time in GEMMs.
    pub gemm_tflops: f64,
    /// Global attention FLOPs over the time in it.
    pub attention_tflops: f64,
}

fn backend_error(e: BackendError) -> KernelError {
    match e {
        BackendError::Kernel(k) => k,
        BackendError::Driver(d) => KernelError::Driver(d),
        other => KernelError::shape(other.to_string()),
    }
}

/// A backend with one SPEC-shaped encoder layer and room for a chunk of `p.tokens` after the
/// longest of `prefixes`.
fn prefill_step_backend(
    gpu: &GpuContext,
    model: &ModelShape,
    p: &PrefillShape,
    prefixes: &[usize],
) -> Result<CudaBackend, KernelError> {
    let most = prefixes.iter().copied().max().unwrap_or(0) + p.tokens;
    let cfg = BackendConfig {
        model: model.clone(),
        hbm_blocks: most.div_ceil(model.block_size) + 8,
        host_blocks: 4,
        ring_slots: 2,
        swa_host_slots: 2,
        ..BackendConfig::default()
    };
    // The backend owns its context handle; this one shares the device's primary context.
    let own = Arc::new(GpuContext::new(gpu.ctx.ordinal())?);
    CudaBackend::new(own, cfg).map_err(backend_error)
}

/// One chunk of `tokens` new tokens after `prefix` cached ones, without a decoder replay.
fn prefill_step_plan(model: &ModelShape, tokens: usize, prefix: usize) -> StepPlan {
    StepPlan::Prefill(PrefillPlan {
        engine: EngineId(0),
        chunks: vec![PrefillChunk {
            request: RequestId(1),
            new_tokens: tokens as u32,
            prefix_tokens: prefix as u32,
            new_token_layers: model.encoder_layers as u32,
            decoder_tokens: 0,
            decoder_layers: model.decoder_layers as u32,
            swap_in_bytes: 0,
        }],
        expert_imbalance: 1.0,
    })
}

/// Times `plan` from an empty backend each rep (two warm-up reps first), then runs one more
/// rep with phase timing on; returns the timing, the diagnostic rep's milliseconds and its
/// phase split.
fn time_prefill_step(
    b: &mut CudaBackend,
    plan: &StepPlan,
    reps: usize,
) -> Result<(Timing, f64, PhaseTimes), KernelError> {
    let mut report = StepReport::default();
    let mut step = |b: &mut CudaBackend| -> Result<f64, KernelError> {
        b.reset();
        b.try_execute(plan, &mut report).map_err(backend_error)?;
        Ok(report.duration.0 as f64 / 1e6)
    };
    for _ in 0..2 {
        step(b)?;
    }
    let mut v = Vec::with_capacity(reps.max(1));
    for _ in 0..reps.max(1) {
        v.push(step(b)?);
    }
    let t = summarize(v);
    b.set_phase_timing(true);
    let diag_ms = step(b)?;
    let split = b.last_phases.unwrap_or_default();
    b.set_phase_timing(false);
    Ok((t, diag_ms, split))
}

/// TFLOP/s of `f` FLOPs in `ms` milliseconds (0 when no time was spent).
fn tflops_in(f: f64, ms: f64) -> f64 {
    if ms > 0.0 {
        f / (ms * 1e-3) / 1e12
    } else {
        0.0
    }
}

/// The note of a whole prefill step row: the model's widths, the FLOPs by kind and the
/// diagnostic rep's phases.
fn prefill_step_note(model: &ModelShape, ph: &PrefillPhases, diag_ms: f64, tiles: &str) -> String {
    let (flops, split) = (&ph.flops, &ph.phases);
    format!(
        "hidden {} q {} ({} heads x {}) kv {} ({} KV heads x {}; MLA 576 in SPEC) {} experts top-{} ffn {} + shared {}; {:.3} TFLOP = GEMMs {:.3} + global attention {:.3} + SWA {:.3}; phases of one diagnostic rep ({diag_ms:.3} ms with its events): GEMMs {:.3} ms ({:.0} TFLOP/s), global attention {:.3} ms ({:.0} TFLOP/s), SWA {:.3} ms, MoE routing {:.3} ms, MoE gather/combine {:.3} ms, elementwise {:.3} ms, setup {:.3} ms; {tiles}",
        model.hidden,
        model.q_dim(),
        model.kv_heads * model.group,
        model.head_dim,
        model.kv_row(),
        model.kv_heads,
        model.head_dim,
        model.experts,
        model.top_k,
        model.expert_ffn,
        model.shared_ffn,
        flops.total() / 1e12,
        flops.gemm / 1e12,
        flops.attention / 1e12,
        flops.swa / 1e12,
        split.gemm_ms,
        ph.gemm_tflops,
        split.attention_ms,
        ph.attention_tflops,
        split.swa_ms,
        split.routing_ms,
        split.permute_ms,
        split.elementwise_ms,
        split.setup_ms,
    )
}

/// The prefill kernel's tiles in words.
fn tiles_label(t: &PrefillTiles) -> String {
    format!(
        "tiles {} rows ({} warps x {} MMA tiles) x {} keys x {} stages, {} CTAs/SM bound",
        t.rows(),
        t.warps,
        t.m_tiles,
        t.keys_per_tile,
        t.stages,
        t.min_blocks
    )
}

/// Which attention path a step row took: the prefill kernel's tiles and resources, or the
/// reference path.
fn prefill_tiles_note(b: &CudaBackend, with_kernel: bool, (regs, local): (i32, i32)) -> String {
    b.prefill_tiles()
        .filter(|_| with_kernel)
        .map(|t| {
            format!(
                "prefill attention {} ({regs} regs, {local} B local)",
                tiles_label(&t)
            )
        })
        .unwrap_or_else(|| {
            "reference path: global attention through the split decode kernels, SWA through the CUDA-core kernel".into()
        })
}

/// The whole prefill step, executed by the CUDA backend: a chunk of `p.tokens` new tokens after
/// each of `prefixes` cached tokens, one SPEC-shaped encoder layer ([`prefill_step_model`]), no
/// decoder replay. Each rep starts from an empty backend (`reset`), so a nonzero prefix is a
/// cache hit without SWA state (the window is truncated at the chunk start); the timing is the
/// backend's own step duration (CUDA events from before the first launch to after the last,
/// host planning, uploads and allocations included). Returns one rate per prefix (ratio to
/// `ceiling_tflops`) and a phase split of one extra rep each.
pub fn measure_prefill_steps(
    gpu: &GpuContext,
    p: &PrefillShape,
    prefixes: &[usize],
    reps: usize,
    ceiling_tflops: f64,
) -> Result<(Vec<Rate>, Vec<PrefillPhases>), KernelError> {
    let model = prefill_step_model(p)?;
    let mut b = prefill_step_backend(gpu, &model, p, prefixes)?;
    let resources = b
        .prefill_tiles()
        .and_then(|t| {
            PrefillAttention::with_tiles(b.gpu(), attention_shape(&model), t)
                .ok()
                .map(|k| k.resources())
        })
        .unwrap_or((-1, -1));
    let mut rates = Vec::new();
    let mut phases = Vec::new();
    // every prefix with the prefill kernel, then the first again through the split decode
    // kernels and the CUDA-core SWA kernel (the path before it), for comparison
    let mut variants: Vec<(usize, bool)> = prefixes.iter().map(|&p| (p, true)).collect();
    variants.extend(prefixes.first().map(|&p| (p, false)));
    for (prefix, with_kernel) in variants {
        b.use_prefill_kernel(with_kernel).map_err(backend_error)?;
        let (rate, ph) =
            measure_step_row(&mut b, &model, p, prefix, reps, ceiling_tflops, resources)?;
        rates.push(rate);
        phases.push(ph);
    }
    b.use_prefill_kernel(true).map_err(backend_error)?;
    Ok((rates, phases))
}

/// One whole-step row: `p.tokens` new tokens after `prefix` cached ones on `b` as it is
/// configured (prefill kernel and tiles), its rate against `ceiling_tflops` and the phases of
/// one diagnostic rep; `resources` are the prefill kernel's (registers, local bytes).
pub(crate) fn measure_step_row(
    b: &mut CudaBackend,
    model: &ModelShape,
    p: &PrefillShape,
    prefix: usize,
    reps: usize,
    ceiling_tflops: f64,
    resources: (i32, i32),
) -> Result<(Rate, PrefillPhases), KernelError> {
    let with_kernel = b.prefill_tiles().is_some();
    let plan = prefill_step_plan(model, p.tokens, prefix);
    let (t, diag_ms, split) = time_prefill_step(b, &plan, reps)?;
    let flops = StepFlops::of(model, prefix, p.tokens, prefix > 0);
    let rate = flops.total() / (t.median_ms * 1e-3) / 1e12;
    let ph = PrefillPhases {
        prefix,
        with_prefill_kernel: with_kernel,
        tokens: p.tokens,
        flops,
        phases: split,
        gemm_tflops: tflops_in(flops.gemm, split.gemm_ms),
        attention_tflops: tflops_in(flops.attention, split.attention_ms),
    };
    let tiles = prefill_tiles_note(b, with_kernel, resources);
    let rate = Rate {
        what: format!(
            "prefill step, whole (CUDA backend{}), {} tokens after a {prefix}-token {}, 1 encoder layer",
            if with_kernel {
                ""
            } else {
                ", without the prefill kernel"
            },
            p.tokens,
            if prefix == 0 {
                "prefix (fresh prompt)"
            } else {
                "cached prefix (hit, window truncated)"
            }
        ),
        timing: t,
        amount: flops.total(),
        rate,
        unit: "TFLOP/s",
        ratio: Some(rate / ceiling_tflops),
        note: prefill_step_note(model, &ph, diag_ms, &tiles),
    };
    Ok((rate, ph))
}

/// The paged-attention shape of the backend model `m`.
fn attention_shape(m: &ModelShape) -> PagedAttentionShape {
    m.attention_shape()
}

/// Tiles the kernel-only measurement compares with the default: (keys per tile, warps, MMA
/// tiles per warp, stages, CTAs per SM bound), one and two MMA tiles per warp.
fn prefill_tile_options(shape: &PagedAttentionShape) -> Vec<PrefillTiles> {
    let mut v: Vec<PrefillTiles> = default_tiles(shape).into_iter().collect();
    for (keys_per_tile, warps, m_tiles, stages, min_blocks) in [
        (32, 8, 1, 3, 2),
        (32, 8, 1, 2, 2),
        (64, 8, 1, 2, 1),
        (32, 4, 1, 2, 3),
        (32, 4, 2, 3, 2),
        (32, 4, 2, 2, 2),
        (32, 4, 2, 4, 2),
        (16, 4, 2, 4, 2),
        (32, 8, 2, 3, 1),
        (32, 8, 2, 4, 1),
        (16, 8, 2, 4, 1),
    ] {
        let t = PrefillTiles {
            keys_per_tile,
            warps,
            m_tiles,
            stages,
            min_blocks,
        };
        if !v.contains(&t)
            && t.validate_for(shape).is_ok()
            && t.smem_bytes(shape) * min_blocks <= 227 * 1024
        {
            v.push(t);
        }
    }
    v
}

/// The prefill attention kernel alone on the whole-step model's shape: one causal chunk of
/// `p.tokens` tokens (prefix 0) over a randomly placed pool, per tiles (default first).
pub fn measure_prefill_attention(
    gpu: &GpuContext,
    p: &PrefillShape,
    reps: usize,
    ceiling_tflops: f64,
    seed: u64,
) -> Result<Vec<Rate>, KernelError> {
    let m = prefill_step_model(p)?;
    let shape = attention_shape(&m);
    let rows = chunk_rows(&[(0, p.tokens)]);
    let blocks = p.tokens.div_ceil(shape.block_size);
    let layout = KvLayout::packed(&shape, blocks);
    let tables = random_tables(seed, 1, blocks, blocks);
    let s = &gpu.stream;
    let mut kv = s.alloc_zeros::<bf16>(layout.min_len(&shape))?;
    fill_uniform_bf16(gpu, &mut kv, seed, 1.0)?;
    let mut q = s.alloc_zeros::<bf16>(p.tokens * shape.num_heads() * shape.d_qk)?;
    fill_uniform_bf16(gpu, &mut q, seed + 1, 1.0)?;
    let mut out = s.alloc_zeros::<bf16>(p.tokens * shape.num_heads() * shape.d_v)?;
    let scale = 1.0 / (shape.d_qk as f32).sqrt();
    let keys = (p.tokens * (p.tokens + 1) / 2) as f64;
    let flop = 2.0 * (shape.num_heads() * (shape.d_qk + shape.d_v)) as f64 * keys;
    let mut v = Vec::new();
    for (i, t) in prefill_tile_options(&shape).into_iter().enumerate() {
        let k = PrefillAttention::with_tiles(gpu, shape, t)?;
        let d_rows = k.upload(gpu, &layout, &tables, &rows)?;
        let kvv = kv.as_view();
        let tm = time_ms(gpu, 2, reps, || {
            k.run(gpu, &q, &kvv, &layout, &d_rows, scale, &mut out)
        })?;
        let (regs, local) = k.resources();
        let rate = flop / (tm.median_ms * 1e-3) / 1e12;
        v.push(Rate {
            what: format!(
                "prefill attention kernel alone{}, kvh={} group={} d={}, {} tokens causal, {}",
                if i == 0 { " (default tiles)" } else { "" },
                shape.num_kv_heads,
                shape.group,
                shape.d_qk,
                p.tokens,
                tiles_label(&t)
            ),
            timing: tm,
            amount: flop,
            rate,
            unit: "TFLOP/s",
            ratio: Some(rate / ceiling_tflops),
            note: format!(
                "QKᵀ + PV FLOPs of the causal half; {} CTAs; {regs} regs, {local} B local",
                k.ctas(&d_rows)
            ),
        });
    }
    Ok(v)
}

fn xorshift_fill(buf: &mut [u8], mut state: u64) {
    for chunk in buf.chunks_mut(8) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let b = state.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
}

/// The buffers of a swap measurement: a pinned host pool of `2 n` random blocks, a pinned
/// destination for the round trip, a device pool, and `n` shuffled source and destination ids.
struct SwapBench {
    host: PinnedHostSlice<u8>,
    back: PinnedHostSlice<u8>,
    dev: CudaSlice<u8>,
    src_ids: Vec<i32>,
    dst_ids: Vec<i32>,
    block_bytes: usize,
    n: usize,
}

fn swap_bench(
    gpu: &GpuContext,
    block_bytes: usize,
    n: usize,
    seed: u64,
) -> Result<SwapBench, KernelError> {
    if !block_bytes.is_multiple_of(16) || n == 0 {
        return Err(KernelError::shape(format!(
            "block_bytes = {block_bytes} must be a multiple of 16 and blocks > 0"
        )));
    }
    let pool_blocks = 2 * n;
    let pool_bytes = pool_blocks * block_bytes;
    // SAFETY: filled right below before any read.
    let mut host = unsafe {
        gpu.ctx.alloc_pinned_with_flags::<u8>(
            pool_bytes,
            sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
        )
    }?;
    xorshift_fill(host.as_mut_slice()?, seed | 1);
    // SAFETY: as above; used only as a D2H destination.
    let back = unsafe {
        gpu.ctx
            .alloc_pinned_with_flags::<u8>(n * block_bytes, sys::CU_MEMHOSTALLOC_PORTABLE)
    }?;
    let dev = gpu.stream.alloc_zeros::<u8>(pool_bytes)?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut src_ids: Vec<i32> = (0..pool_blocks as i32).collect();
    src_ids.shuffle(&mut rng);
    src_ids.truncate(n);
    let mut dst_ids: Vec<i32> = (0..pool_blocks as i32).collect();
    dst_ids.shuffle(&mut rng);
    dst_ids.truncate(n);
    Ok(SwapBench {
        host,
        back,
        dev,
        src_ids,
        dst_ids,
        block_bytes,
        n,
    })
}

/// A GB/s row of `bytes` moved per run, compared with `ceiling` when given.
fn gbps_rate(what: String, timing: Timing, bytes: f64, ceiling: Option<f64>, note: &str) -> Rate {
    let rate = gbps(bytes, &timing);
    Rate {
        what,
        rate,
        timing,
        amount: bytes,
        unit: "GB/s",
        ratio: ceiling.map(|c| rate / c),
        note: note.into(),
    }
}

/// The ceiling: one pinned copy of the `n` blocks' bytes.
fn time_one_copy(gpu: &GpuContext, sb: &mut SwapBench, reps: usize) -> Result<Timing, KernelError> {
    let s = &gpu.stream;
    let bytes = sb.n * sb.block_bytes;
    let h = sb.host.as_slice()?;
    let (dptr, _g) = sb.dev.device_ptr_mut(s);
    time_ms(gpu, 2, reps, || {
        // SAFETY: dev holds pool_bytes >= n * block_bytes; host stays alive and pinned.
        unsafe { cudarc::driver::result::memcpy_htod_async(dptr, &h[..bytes], s.cu_stream()) }
            .map_err(KernelError::from)
    })
}

/// Issues one `cuMemcpyHtoDAsync` per block, from each source id to its destination id.
fn copy_blocks_in(gpu: &GpuContext, sb: &mut SwapBench) -> Result<(), KernelError> {
    let (s, block_bytes) = (&gpu.stream, sb.block_bytes);
    let h = sb.host.as_slice()?;
    let (dptr, _g) = sb.dev.device_ptr_mut(s);
    for (&si, &di) in sb.src_ids.iter().zip(&sb.dst_ids) {
        // SAFETY: both ids address whole blocks inside their pools.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(
                dptr + (di as usize * block_bytes) as u64,
                &h[si as usize * block_bytes..][..block_bytes],
                s.cu_stream(),
            )
        }?;
    }
    Ok(())
}

/// One `cuMemcpyHtoDAsync` per block (scattered ids).
fn time_block_copies(
    gpu: &GpuContext,
    sb: &mut SwapBench,
    reps: usize,
) -> Result<Timing, KernelError> {
    let (s, block_bytes) = (&gpu.stream, sb.block_bytes);
    let h = sb.host.as_slice()?;
    let (dptr, _g) = sb.dev.device_ptr_mut(s);
    time_ms(gpu, 2, reps, || {
        for (&si, &di) in sb.src_ids.iter().zip(&sb.dst_ids) {
            let src = &h[si as usize * block_bytes..][..block_bytes];
            // SAFETY: both ids address whole blocks inside their pools.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    dptr + (di as usize * block_bytes) as u64,
                    src,
                    s.cu_stream(),
                )
            }?;
        }
        Ok(())
    })
}

/// The zero-copy gather kernel reading mapped pinned memory, from the device copies of the
/// source and destination ids.
fn time_gather(
    gpu: &GpuContext,
    sb: &mut SwapBench,
    (d_src, d_dst): (&CudaSlice<i32>, &CudaSlice<i32>),
    reps: usize,
) -> Result<Timing, KernelError> {
    let s = &gpu.stream;
    let mut host_dptr: sys::CUdeviceptr = 0;
    // SAFETY: the pool was allocated with DEVICEMAP; this only queries its device address.
    unsafe {
        sys::cuMemHostGetDevicePointer_v2(
            &mut host_dptr,
            sb.host.as_mut_ptr()? as *mut std::ffi::c_void,
            0,
        )
    }
    .result()?;
    let (n, block_bytes) = (sb.n, sb.block_bytes);
    let (dptr, _g) = sb.dev.device_ptr_mut(s);
    time_ms(gpu, 2, reps, || {
        // SAFETY: host_dptr maps the whole host pool; dptr the whole device pool; ids are in range.
        unsafe { gather_blocks_raw(gpu, host_dptr, d_src, dptr, d_dst, n, block_bytes) }
    })
}

/// Round trip: swaps the blocks in (per-block copies), out to `back`, and compares the bytes.
fn swap_round_trip(gpu: &GpuContext, sb: &mut SwapBench) -> Result<bool, KernelError> {
    let (s, block_bytes) = (&gpu.stream, sb.block_bytes);
    copy_blocks_in(gpu, sb)?;
    {
        let b = sb.back.as_mut_slice()?;
        let (dptr, _g) = sb.dev.device_ptr(s);
        for (i, &di) in sb.dst_ids.iter().enumerate() {
            // SAFETY: the destination range lies inside `back`; the source block inside `dev`.
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(
                    &mut b[i * block_bytes..][..block_bytes],
                    dptr + (di as usize * block_bytes) as u64,
                    s.cu_stream(),
                )
            }?;
        }
    }
    s.synchronize()?;
    let (h, b) = (sb.host.as_slice()?, sb.back.as_slice()?);
    Ok(sb.src_ids.iter().enumerate().all(|(i, &si)| {
        h[si as usize * block_bytes..][..block_bytes] == b[i * block_bytes..][..block_bytes]
    }))
}

/// Host-to-device swap-in of `n` blocks scattered in a pinned host pool to scattered device
/// blocks, three ways, against one large pinned copy of the same bytes.
pub fn measure_swap(
    gpu: &GpuContext,
    block_bytes: usize,
    n: usize,
    reps: usize,
    seed: u64,
) -> Result<(Vec<Rate>, bool), KernelError> {
    let mut sb = swap_bench(gpu, block_bytes, n, seed)?;
    let total = (n * block_bytes) as f64;
    let t_one = time_one_copy(gpu, &mut sb, reps)?;
    let ceiling = gbps(total, &t_one);
    let mut rates = vec![gbps_rate(
        format!("H2D one pinned copy of {} MiB", (n * block_bytes) >> 20),
        t_one,
        total,
        None,
        "pinned copy ceiling",
    )];
    let t_blocks = time_block_copies(gpu, &mut sb, reps)?;
    rates.push(gbps_rate(
        format!("H2D swap-in, one copy per {block_bytes} B block, {n} blocks"),
        t_blocks,
        total,
        Some(ceiling),
        "copy engine, per-copy issue cost",
    ));
    let s = &gpu.stream;
    let (d_src, d_dst) = (s.clone_htod(&sb.src_ids)?, s.clone_htod(&sb.dst_ids)?);
    let t_gather = time_gather(gpu, &mut sb, (&d_src, &d_dst), reps)?;
    rates.push(gbps_rate(
        format!("H2D swap-in, gather kernel over mapped pinned memory, {n} blocks"),
        t_gather,
        total,
        Some(ceiling),
        "SMs read the host over PCIe; one launch",
    ));
    let identical = swap_round_trip(gpu, &mut sb)?;
    Ok((rates, identical))
}

/// The copy and read-only bandwidth ceilings, with the datasheet's; the copy row's note
/// carries the read ceiling, since the markdown table has no row for it.
fn measure_bandwidth_ceilings(
    gpu: &GpuContext,
    cfg: &SpeedConfig,
    log: &mut impl FnMut(&str),
) -> Result<(Rate, Rate, Ceilings), KernelError> {
    let mut copy = measure_copy(gpu, cfg.copy_bytes, cfg.reps)?;
    log(&format!("copy: {:.0} GB/s", copy.rate));
    let read = measure_read(gpu, cfg.copy_bytes, cfg.reps)?;
    log(&format!("read-only stream: {:.0} GB/s", read.rate));
    let ceilings = Ceilings {
        copy: copy.rate,
        read: read.rate,
        datasheet: datasheet_gbps(&gpu.name()),
    };
    copy.note = format!(
        "{}; read-only stream ({}) {:.1} GB/s = {:.1}% of copy{}",
        copy.note,
        read.what,
        read.rate,
        100.0 * read.rate / copy.rate,
        ceilings
            .datasheet
            .map(|d| format!(
                "; datasheet {d:.0} GB/s: copy {:.1}%, read {:.1}%",
                100.0 * copy.rate / d,
                100.0 * read.rate / d
            ))
            .unwrap_or_default()
    );
    Ok((copy, read, ceilings))
}

/// Decode attention rows: every kernel that takes each decode shape, then the MLA-shaped
/// kernel at each query-token count.
fn measure_decode_rows(
    gpu: &GpuContext,
    cfg: &SpeedConfig,
    ceilings: &Ceilings,
    log: &mut impl FnMut(&str),
) -> Result<Vec<Rate>, KernelError> {
    let mut decode = Vec::new();
    for (i, shape) in cfg.decode_shapes.iter().enumerate() {
        let mut kernels = vec![AttentionKernel::Warp];
        if tiled_tile(shape).is_some() {
            kernels.push(AttentionKernel::Tiled);
        }
        if mma_config(shape).is_some() {
            kernels.push(AttentionKernel::Mma);
        }
        for kernel in kernels {
            let r = measure_decode(
                gpu,
                *shape,
                kernel,
                cfg.decode_seqs,
                cfg.decode_context,
                cfg.reps,
                ceilings.copy,
                cfg.seed + i as u64,
            )?;
            let r = Rate {
                note: format!("{}; {}", ceilings.note(r.rate), r.note),
                ..r
            };
            log(&format!(
                "{}: {:.0} GB/s ({:.2})",
                r.what,
                r.rate,
                r.ratio.unwrap_or(0.0)
            ));
            decode.push(r);
        }
    }
    for (i, &qt) in cfg.mla_query_tokens.iter().enumerate() {
        let r = measure_mla_decode(
            gpu,
            cfg.mla_shape,
            cfg.decode_seqs,
            cfg.decode_context,
            qt,
            cfg.reps,
            ceilings,
            // the backend's default tiles and split rule only: the tile sweep is
            // `attention_bench` (below), which would add a minute here
            false,
            cfg.seed + 50 + i as u64,
        )?;
        log(&format!("{}: {:.0} GB/s; {}", r.what, r.rate, r.note));
        decode.push(r);
    }
    Ok(decode)
}

/// Logs a TFLOP/s row with its ratio, median time and note.
fn log_tflops_row(log: &mut impl FnMut(&str), r: &Rate) {
    log(&format!(
        "{}: {:.0} TFLOP/s ({:.2}) {:.3} ms; {}",
        r.what,
        r.rate,
        r.ratio.unwrap_or(0.0),
        r.timing.median_ms,
        r.note
    ));
}

/// The prefill rows: GEMMs only, the attention kernel alone, and whole steps.
struct PrefillMeasurements {
    gemms_only: Rate,
    attention: Vec<Rate>,
    /// One whole step per `prefill_step_prefixes` entry, then the reference path's.
    steps: Vec<Rate>,
    phases: Vec<PrefillPhases>,
}

fn measure_prefill_rows(
    gpu: &GpuContext,
    cfg: &SpeedConfig,
    gemm_tflops: f64,
    log: &mut impl FnMut(&str),
) -> Result<PrefillMeasurements, KernelError> {
    let reps = cfg.reps.min(10);
    let gemms_only = measure_prefill_gemms(gpu, &cfg.prefill, reps, gemm_tflops)?;
    log(&format!(
        "prefill GEMMs only: {:.0} TFLOP/s ({:.2})",
        gemms_only.rate,
        gemms_only.ratio.unwrap_or(0.0)
    ));
    let attention = measure_prefill_attention(gpu, &cfg.prefill, reps, gemm_tflops, cfg.seed)?;
    for r in &attention {
        log_tflops_row(log, r);
    }
    let (steps, phases) = measure_prefill_steps(
        gpu,
        &cfg.prefill,
        &cfg.prefill_step_prefixes,
        reps,
        gemm_tflops,
    )?;
    for r in &steps {
        log_tflops_row(log, r);
    }
    Ok(PrefillMeasurements {
        gemms_only,
        attention,
        steps,
        phases,
    })
}

pub fn run(
    gpu: &GpuContext,
    cfg: &SpeedConfig,
    mut log: impl FnMut(&str),
) -> Result<SpeedReport, KernelError> {
    let (copy, read, ceilings) = measure_bandwidth_ceilings(gpu, cfg, &mut log)?;
    let gemm = measure_gemm_ceiling(gpu, cfg.gemm_ceiling_dim, cfg.reps)?;
    log(&format!("gemm ceiling: {:.0} TFLOP/s", gemm.rate));
    let decode = measure_decode_rows(gpu, cfg, &ceilings, &mut log)?;
    let mut pf = measure_prefill_rows(gpu, cfg, gemm.rate, &mut log)?;
    if pf.steps.is_empty() {
        return Err(KernelError::shape("prefill_step_prefixes is empty"));
    }
    let prefill = pf.steps.remove(0);
    let (swap, identical) = measure_swap(
        gpu,
        cfg.swap_block_bytes,
        cfg.swap_blocks,
        cfg.reps,
        cfg.seed,
    )?;
    log(&format!("swap round trip bit-identical: {identical}"));
    Ok(SpeedReport {
        gpu: gpu.name(),
        compute_capability: gpu.compute_capability(),
        driver_version: gpu.driver_version(),
        config: cfg.clone(),
        copy_ceiling: copy,
        read_ceiling: read,
        ceilings,
        gemm_ceiling: gemm,
        decode,
        prefill,
        prefill_after_prefix: pf.steps,
        prefill_phases: pf.phases,
        prefill_attention: pf.attention,
        prefill_gemms_only: pf.gemms_only,
        swap,
        swap_roundtrip_bit_identical: identical,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_gemm_list_counts_every_expert() {
        let p = PrefillShape {
            tokens: 64,
            hidden: 32,
            q_dim: 32,
            kv_dim: 16,
            experts: 4,
            top_k: 2,
            expert_ffn: 8,
            shared_ffn: 8,
        };
        let g = p.gemms();
        assert_eq!(g.len(), 5 + 2 * 4);
        // 64 tokens x 2 slots over 4 experts = 32 rows each
        assert_eq!(g[5], (32, 16, 32));
        assert_eq!(g[6], (32, 32, 8));
    }

    #[test]
    fn spec_step_model_is_gqa_nearest_the_mla_kv_width() {
        let m = prefill_step_model(&PrefillShape::scaled_default(8192)).unwrap();
        // 32 query heads of 128; 4 KV heads (512) is nearest MLA's 576 among 1, 2, 4, 8, ...
        assert_eq!((m.kv_heads, m.group, m.head_dim), (4, 8, 128));
        assert_eq!((m.q_dim(), m.kv_row()), (4096, 512));
        assert_eq!(
            (m.experts, m.top_k, m.expert_ffn, m.shared_ffn),
            (64, 8, 1024, 2048)
        );
        assert_eq!(m.encoder_layers, 1);
        let bad = PrefillShape {
            q_dim: 100,
            ..PrefillShape::scaled_default(8)
        };
        assert!(prefill_step_model(&bad).is_err());
    }

    #[test]
    fn step_flops_hand_computed() {
        let m = ModelShape {
            encoder_layers: 1,
            hidden: 2,
            experts: 1,
            top_k: 1,
            expert_ffn: 1,
            shared_ffn: 1,
            window: 2,
            ..ModelShape::default()
        }
        .gqa(1, 1, 1);
        // 3 tokens: wq + wk 2·3·(2 + 2) = 24, wo twice 24, router 12, expert 36, shared 36,
        // global KV projection 12
        let f = StepFlops::of(&m, 0, 3, false);
        assert_eq!(f.gemm, 144.0);
        // 4 FLOPs per key and query head: global keys 1 + 2 + 3, window of 2: 1 + 2 + 2
        assert_eq!((f.attention, f.swa), (24.0, 20.0));
        assert_eq!(f.total(), 188.0);
        // after a 2-token prefix: keys 3 + 4; the window truncated at 2 sees 1 + 2, else 2 + 2
        let hit = StepFlops::of(&m, 2, 2, true);
        assert_eq!((hit.attention, hit.swa), (28.0, 12.0));
        assert_eq!(StepFlops::of(&m, 2, 2, false).swa, 16.0);
        // MLA: a latent of 3 (value 2) read by 2 heads. Per key and head QKᵀ 2·3 + PV 2·2 =
        // 10; the output projections read 2 heads x 2 values: wq 2·3·6·2 = 72 + wk 2·3·3·2
        // = 36, wo twice 2·2·3·2·4 = 96, router 12, experts 72, global KV 36
        let mla = ModelShape {
            attention: crate::backend::AttentionKind::Mla,
            kv_heads: 1,
            group: 2,
            head_dim: 3,
            value_dim: 2,
            rope_dim: 1,
            ..m
        };
        let f = StepFlops::of(&mla, 0, 3, false);
        assert_eq!(f.gemm, 72.0 + 36.0 + 96.0 + 12.0 + 72.0 + 36.0);
        assert_eq!((f.attention, f.swa), (2.0 * 10.0 * 6.0, 2.0 * 10.0 * 5.0));
    }

    /// The attention rows alone at full size (ceilings, the GQA tensor-core kernel's sweep and
    /// the MLA kernel at 1, 2, 4 and 6 query tokens), for a short device run:
    /// `servelab_hw-* --ignored attention_bench --nocapture`; writes `attention-bench.json`
    /// to `$OUT` when set.
    #[test]
    #[ignore = "full-size GPU benchmark"]
    fn attention_bench() {
        let Some(gpu) = servelab_kernels::gpu::gpu_or_skip() else {
            return;
        };
        let cfg = SpeedConfig::full(1);
        let copy = measure_copy(&gpu, cfg.copy_bytes, cfg.reps).unwrap();
        let read = measure_read(&gpu, cfg.copy_bytes, cfg.reps).unwrap();
        let ceilings = Ceilings {
            copy: copy.rate,
            read: read.rate,
            datasheet: datasheet_gbps(&gpu.name()),
        };
        println!("{}: {:.1} GB/s", copy.what, copy.rate);
        println!("{}: {:.1} GB/s; {}", read.what, read.rate, read.note);
        let mut rows = vec![copy, read];
        for &qt in &cfg.mla_query_tokens {
            let r = measure_mla_decode(
                &gpu,
                cfg.mla_shape,
                cfg.decode_seqs,
                cfg.decode_context,
                qt,
                cfg.reps,
                &ceilings,
                true,
                50 + qt as u64,
            )
            .unwrap();
            println!(
                "{}: {:.1} GB/s {:.3} ms; {}",
                r.what, r.rate, r.timing.median_ms, r.note
            );
            rows.push(r);
        }
        let gqa = cfg.decode_shapes[0];
        let r = measure_decode(
            &gpu,
            gqa,
            AttentionKernel::Mma,
            cfg.decode_seqs,
            cfg.decode_context,
            cfg.reps,
            ceilings.copy,
            1,
        )
        .unwrap();
        println!(
            "{}: {:.1} GB/s {:.3} ms; {}; {}",
            r.what,
            r.rate,
            r.timing.median_ms,
            ceilings.note(r.rate),
            r.note
        );
        rows.push(r);
        if let Ok(dir) = std::env::var("OUT") {
            let path = std::path::Path::new(&dir).join("attention-bench.json");
            std::fs::write(
                path,
                serde_json::to_string_pretty(&(ceilings, rows)).unwrap(),
            )
            .unwrap();
        }
    }

    #[test]
    fn quick_run_on_gpu() {
        let Some(gpu) = servelab_kernels::gpu::gpu_or_skip() else {
            return;
        };
        let rep = run(&gpu, &SpeedConfig::quick(1), |_| {}).unwrap();
        assert!(rep.swap_roundtrip_bit_identical);
        assert!(rep.copy_ceiling.rate > 0.0 && rep.prefill.rate > 0.0);
        assert!(rep.prefill_gemms_only.rate > 0.0 && !rep.prefill_attention.is_empty());
        // the hit, then the fresh prompt without the prefill kernel
        assert_eq!(rep.prefill_after_prefix.len(), 2);
        // the phases of a diagnostic rep cover the whole step
        let ph = &rep.prefill_phases[0];
        assert!(ph.phases.gemm_ms > 0.0 && ph.phases.attention_ms > 0.0);
    }
}
