//! Speed against the same GPU's measured ceilings (issue 6, item 6):
//! decode attention bandwidth over device-to-device copy bandwidth; the GEMMs of a prefill step
//! over a large cuBLAS bf16 GEMM; host-to-device block swap over one large pinned copy.

use cudarc::driver::sys;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;
use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use servelab_kernels::attention::{
    AttentionKernel, KvLayout, MmaConfig, PagedAttention, PagedAttentionShape, QueryRows,
    mma_config, random_tables, tiled_tile,
};
use servelab_kernels::fill::{fill_uniform_bf16, gather_blocks_raw};
use servelab_kernels::gemm::linear_bf16;
use servelab_kernels::{GpuContext, KernelError};

use crate::timing::{Timing, time_ms};

/// What to measure; `quick` shrinks every size for a smoke run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SpeedConfig {
    pub copy_bytes: usize,
    pub gemm_ceiling_dim: usize,
    pub decode_seqs: usize,
    pub decode_context: usize,
    pub decode_shapes: Vec<PagedAttentionShape>,
    pub prefill: PrefillShape,
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
            prefill: PrefillShape::scaled_default(8192),
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
            prefill: PrefillShape {
                experts: 8,
                ..PrefillShape::scaled_default(512)
            },
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
    pub gemm_ceiling: Rate,
    pub decode: Vec<Rate>,
    pub prefill: Rate,
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
    // The tensor-core kernel's tiles are swept too (each variant is one NVRTC compile).
    let tile_options: Vec<Option<MmaConfig>> = match (kernel, att.mma_tiles()) {
        (AttentionKernel::Mma, Some(default)) => {
            let mut v = vec![Some(default)];
            for t_swap in [
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
                // run4: fewer warps with headroom under the register cap (the 16-warp
                // default spills 72 B), and 32-key tiles on padded rows
                (16, 2, 12, 1, false, false, false),
                (16, 2, 16, 1, false, true, false),
                (32, 2, 8, 1, false, false, false),
                (32, 2, 6, 1, false, false, false),
                // run6: the lazy rescale on the best run3/run4 shapes
                (16, 2, 16, 1, false, false, true),
                (16, 2, 16, 1, false, true, true),
                (16, 2, 16, 1, true, true, true),
                (16, 3, 16, 1, true, false, true),
                (16, 2, 12, 1, false, false, true),
                (16, 2, 8, 2, false, false, true),
                (32, 2, 8, 1, false, false, true),
                (16, 2, 4, 2, true, false, true),
            ]
            .into_iter()
            .map(|t| (t, false))
            .chain(
                // run7: swapped operands (keys as the MMA's M, query rows as N): half the
                // MMAs at group <= 8 and half the output registers, so fewer warps with more
                // keys in flight and deeper rings become affordable
                [
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
                ]
                .into_iter()
                .map(|t| (t, true)),
            ) {
                let (
                    (keys_per_tile, stages, warps, min_blocks, swizzle, l2_prefetch, lazy_rescale),
                    swap_operands,
                ) = t_swap;
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
                if c != default
                    && c.validate_for(&shape)
                    && c.smem_bytes(&shape) * min_blocks <= 227 * 1024
                {
                    v.push(Some(c));
                }
            }
            v
        }
        _ => vec![None],
    };
    let blocks_per_seq = context.div_ceil(shape.block_size);
    let num_blocks = seqs * blocks_per_seq;
    let layout = KvLayout::packed(&shape, num_blocks);
    let tables = random_tables(seed, seqs, blocks_per_seq, num_blocks);
    let rows = QueryRows::decode(&vec![context; seqs]);
    let d_rows = att.upload(gpu, &layout, &tables, &rows)?;
    let s = &gpu.stream;
    let mut kv = s.alloc_zeros::<bf16>(layout.min_len(&shape))?;
    fill_uniform_bf16(gpu, &mut kv, seed, 1.0)?;
    let mut q = s.alloc_zeros::<bf16>(seqs * shape.num_heads() * shape.d_qk)?;
    fill_uniform_bf16(gpu, &mut q, seed + 1, 1.0)?;
    let mut out = s.alloc_zeros::<bf16>(seqs * shape.num_heads() * shape.d_v)?;
    let scale = 1.0 / (shape.d_qk as f32).sqrt();
    let kv_bytes = (seqs * context * shape.num_kv_heads * shape.d_qk * 2) as f64;
    // Sweep the split size: the default heuristic and fixed sizes; report the best.
    let default_tps = att.default_tokens_per_split(&d_rows);
    // (tokens per split, tiles, timing, (registers, local bytes))
    type Best = (usize, Option<MmaConfig>, Timing, (i32, i32));
    let mut best: Option<Best> = None;
    let mut tried = Vec::new();
    // the backend's choice: default tiles with the split rule (recomputed per tile shape)
    let mut default_timing: Option<(usize, Timing)> = None;
    for (ti, tiles) in tile_options.iter().enumerate() {
        if let Some(c) = tiles {
            att.set_mma_tiles(gpu, *c)?;
        }
        let rule_tps = att.default_tokens_per_split(&d_rows);
        let resources = att.split_resources();
        for tps in [rule_tps, default_tps, 256, 512, 768, 1024, 1536, 2048, 4096] {
            if tried.contains(&(tps, *tiles)) {
                continue;
            }
            let mut ws = att.workspace(gpu, &d_rows, tps)?;
            let kvv = kv.as_view();
            let t = time_ms(gpu, 2, reps, || {
                att.run(
                    gpu, &q, &kvv, &layout, &d_rows, tps, &mut ws, scale, &mut out,
                )
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
    let (tps, tiles, t, (regs, local)) = best.expect("at least one split size");
    let tried_tps: Vec<usize> = {
        let mut v: Vec<usize> = tried.iter().map(|(t, _)| *t).collect();
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
            tile_options.len()
        ),
        None => String::new(),
    };
    let rate = gbps(kv_bytes, &t);
    let default_note = match &default_timing {
        Some((dt, dtm)) => {
            let r = gbps(kv_bytes, dtm);
            format!(
                "; backend default (rule {dt} tokens/split, default tiles) {r:.1} GB/s = {:.1}%",
                100.0 * r / copy_gbps
            )
        }
        None => String::new(),
    };
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
        note: format!(
            "KV bytes read; best tokens/split {tps} of {tried_tps:?} (default {default_tps}){tiles_note}; split kernel {regs} regs, {local} B local{default_note}"
        ),
    })
}

pub fn measure_prefill(
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
            "prefill-step GEMMs, {} tokens, one layer ({} GEMMs)",
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

fn xorshift_fill(buf: &mut [u8], mut state: u64) {
    for chunk in buf.chunks_mut(8) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let b = state.to_le_bytes();
        chunk.copy_from_slice(&b[..chunk.len()]);
    }
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
    if !block_bytes.is_multiple_of(16) || n == 0 {
        return Err(KernelError::shape(format!(
            "block_bytes = {block_bytes} must be a multiple of 16 and blocks > 0"
        )));
    }
    let pool_blocks = 2 * n;
    let pool_bytes = pool_blocks * block_bytes;
    let s = &gpu.stream;
    // SAFETY: filled right below before any read.
    let mut host = unsafe {
        gpu.ctx.alloc_pinned_with_flags::<u8>(
            pool_bytes,
            sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
        )
    }?;
    xorshift_fill(host.as_mut_slice()?, seed | 1);
    // SAFETY: as above; used only as a D2H destination.
    let mut back = unsafe {
        gpu.ctx
            .alloc_pinned_with_flags::<u8>(n * block_bytes, sys::CU_MEMHOSTALLOC_PORTABLE)
    }?;
    let mut dev = s.alloc_zeros::<u8>(pool_bytes)?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut src_ids: Vec<i32> = (0..pool_blocks as i32).collect();
    src_ids.shuffle(&mut rng);
    src_ids.truncate(n);
    let mut dst_ids: Vec<i32> = (0..pool_blocks as i32).collect();
    dst_ids.shuffle(&mut rng);
    dst_ids.truncate(n);
    let total = (n * block_bytes) as f64;
    let mut rates = Vec::new();

    // 1. the ceiling: one pinned copy of n blocks' bytes
    let t_one = {
        let h = host.as_slice()?;
        let (dptr, _g) = dev.device_ptr_mut(s);
        time_ms(gpu, 2, reps, || {
            // SAFETY: dev holds pool_bytes >= n * block_bytes; host stays alive and pinned.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    dptr,
                    &h[..n * block_bytes],
                    s.cu_stream(),
                )
            }
            .map_err(KernelError::from)
        })?
    };
    let ceiling = gbps(total, &t_one);
    rates.push(Rate {
        what: format!("H2D one pinned copy of {} MiB", (n * block_bytes) >> 20),
        rate: ceiling,
        timing: t_one,
        amount: total,
        unit: "GB/s",
        ratio: None,
        note: "pinned copy ceiling".into(),
    });

    // 2. one cuMemcpyHtoDAsync per block (scattered ids)
    let t_blocks = {
        let h = host.as_slice()?;
        let (dptr, _g) = dev.device_ptr_mut(s);
        time_ms(gpu, 2, reps, || {
            for (&si, &di) in src_ids.iter().zip(&dst_ids) {
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
        })?
    };
    let r = gbps(total, &t_blocks);
    rates.push(Rate {
        what: format!("H2D swap-in, one copy per {block_bytes} B block, {n} blocks"),
        rate: r,
        timing: t_blocks,
        amount: total,
        unit: "GB/s",
        ratio: Some(r / ceiling),
        note: "copy engine, per-copy issue cost".into(),
    });

    // 3. zero-copy gather kernel reading mapped pinned memory
    let (d_src, d_dst) = (s.clone_htod(&src_ids)?, s.clone_htod(&dst_ids)?);
    let mut host_dptr: sys::CUdeviceptr = 0;
    // SAFETY: the pool was allocated with DEVICEMAP; this only queries its device address.
    unsafe {
        sys::cuMemHostGetDevicePointer_v2(
            &mut host_dptr,
            host.as_mut_ptr()? as *mut std::ffi::c_void,
            0,
        )
    }
    .result()?;
    let t_gather = {
        let (dptr, _g) = dev.device_ptr_mut(s);
        time_ms(gpu, 2, reps, || {
            // SAFETY: host_dptr maps the whole host pool; dptr the whole device pool; ids are in range.
            unsafe { gather_blocks_raw(gpu, host_dptr, &d_src, dptr, &d_dst, n, block_bytes) }
        })?
    };
    let r = gbps(total, &t_gather);
    rates.push(Rate {
        what: format!("H2D swap-in, gather kernel over mapped pinned memory, {n} blocks"),
        rate: r,
        timing: t_gather,
        amount: total,
        unit: "GB/s",
        ratio: Some(r / ceiling),
        note: "SMs read the host over PCIe; one launch".into(),
    });

    // Round trip: swap the blocks in (per-block copies), out to `back`, compare bytes.
    {
        let h = host.as_slice()?;
        let (dptr, _g) = dev.device_ptr_mut(s);
        for (&si, &di) in src_ids.iter().zip(&dst_ids) {
            // SAFETY: as in method 2.
            unsafe {
                cudarc::driver::result::memcpy_htod_async(
                    dptr + (di as usize * block_bytes) as u64,
                    &h[si as usize * block_bytes..][..block_bytes],
                    s.cu_stream(),
                )
            }?;
        }
    }
    {
        let b = back.as_mut_slice()?;
        let (dptr, _g) = dev.device_ptr(s);
        for (i, &di) in dst_ids.iter().enumerate() {
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
    let (h, b) = (host.as_slice()?, back.as_slice()?);
    let identical = src_ids.iter().enumerate().all(|(i, &si)| {
        h[si as usize * block_bytes..][..block_bytes] == b[i * block_bytes..][..block_bytes]
    });
    Ok((rates, identical))
}

pub fn run(
    gpu: &GpuContext,
    cfg: &SpeedConfig,
    mut log: impl FnMut(&str),
) -> Result<SpeedReport, KernelError> {
    let copy = measure_copy(gpu, cfg.copy_bytes, cfg.reps)?;
    log(&format!("copy: {:.0} GB/s", copy.rate));
    let gemm = measure_gemm_ceiling(gpu, cfg.gemm_ceiling_dim, cfg.reps)?;
    log(&format!("gemm ceiling: {:.0} TFLOP/s", gemm.rate));
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
                copy.rate,
                cfg.seed + i as u64,
            )?;
            log(&format!(
                "{}: {:.0} GB/s ({:.2})",
                r.what,
                r.rate,
                r.ratio.unwrap_or(0.0)
            ));
            decode.push(r);
        }
    }
    let prefill = measure_prefill(gpu, &cfg.prefill, cfg.reps.min(10), gemm.rate)?;
    log(&format!(
        "prefill: {:.0} TFLOP/s ({:.2})",
        prefill.rate,
        prefill.ratio.unwrap_or(0.0)
    ));
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
        gemm_ceiling: gemm,
        decode,
        prefill,
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
    fn quick_run_on_gpu() {
        let Some(gpu) = servelab_kernels::gpu::gpu_or_skip() else {
            return;
        };
        let rep = run(&gpu, &SpeedConfig::quick(1), |_| {}).unwrap();
        assert!(rep.swap_roundtrip_bit_identical);
        assert!(rep.copy_ceiling.rate > 0.0 && rep.prefill.rate > 0.0);
    }
}
