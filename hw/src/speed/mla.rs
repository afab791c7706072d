//! MLA-shaped decode attention (one 576-wide latent per token, values its first 512, many
//! query heads per latent) at the served model's batch: bandwidth against the ceilings.

use cudarc::driver::CudaSlice;
use half::bf16;
use servelab_kernels::attention::{KvLayout, PagedAttentionShape, QueryRows, random_tables};
use servelab_kernels::fill::fill_uniform_bf16;
use servelab_kernels::mla_attention::{MlaAttention, MlaConfig, MlaRows, default_config};
use servelab_kernels::{GpuContext, KernelError};

use super::ceilings::Ceilings;
use super::{Rate, gbps};
use crate::timing::{Timing, time_ms};

/// Tiles swept besides the default: (keys per tile, warps, stages, m-tiles, CTAs per SM, Q in
/// registers, L2 prefetch). Configurations the shape does not take (shared memory, registers)
/// are skipped.
const SWEEP: [(usize, usize, usize, usize, usize, bool, bool); 8] = [
    (16, 2, 2, 1, 4, false, false),
    (16, 2, 2, 1, 4, false, true),
    (16, 2, 3, 1, 3, false, false),
    (32, 4, 2, 1, 2, false, false),
    (64, 8, 2, 1, 1, true, false),
    (64, 8, 2, 2, 1, false, false),
    (64, 8, 2, 3, 1, false, false),
    (32, 4, 2, 2, 1, false, false),
];

/// Swapped-kernel tiles swept for groups of `max_rows` rows: (most warps per CTA, keys per
/// tile, stages, CTAs per SM, Q in registers). Configurations the shape does not take are
/// skipped; the CTAs per SM are a bound for the compiler, the occupancy API gives the real
/// count.
const SWAPPED_SWEEP: [(usize, usize, usize, usize, bool); 14] = [
    (2, 16, 2, 4, false),
    (2, 16, 3, 3, false),
    (2, 16, 4, 2, false),
    (2, 16, 2, 4, true),
    (2, 16, 3, 4, true),
    (2, 16, 4, 3, true),
    (2, 32, 2, 3, false),
    (2, 32, 3, 2, false),
    (4, 16, 3, 2, false),
    (4, 16, 3, 2, true),
    (4, 32, 2, 2, false),
    (8, 16, 3, 1, false),
    (8, 16, 4, 1, true),
    (8, 32, 2, 1, false),
];

/// The device side of an MLA measurement: random block tables and KV, `query_tokens` query
/// rows per sequence.
struct MlaBench {
    layout: KvLayout,
    rows: MlaRows,
    kv: CudaSlice<bf16>,
    q: CudaSlice<bf16>,
    out: CudaSlice<bf16>,
    scale: f32,
}

fn mla_bench(
    gpu: &GpuContext,
    att: &MlaAttention,
    shape: &PagedAttentionShape,
    (seqs, context, query_tokens): (usize, usize, usize),
    seed: u64,
) -> Result<MlaBench, KernelError> {
    let blocks_per_seq = context.div_ceil(shape.block_size);
    let num_blocks = seqs * blocks_per_seq;
    let layout = KvLayout::packed(shape, num_blocks);
    let tables = random_tables(seed, seqs, blocks_per_seq, num_blocks);
    let rows = QueryRows::decode_verify(&vec![context; seqs], &vec![query_tokens; seqs]);
    let d_rows = att.upload(gpu, &layout, &tables, &rows)?;
    let s = &gpu.stream;
    let mut kv = s.alloc_zeros::<bf16>(layout.min_len(shape))?;
    fill_uniform_bf16(gpu, &mut kv, seed, 1.0)?;
    let mut q = s.alloc_zeros::<bf16>(rows.len() * shape.num_heads() * shape.d_qk)?;
    fill_uniform_bf16(gpu, &mut q, seed + 1, 1.0)?;
    let out = s.alloc_zeros::<bf16>(rows.len() * shape.num_heads() * shape.d_v)?;
    Ok(MlaBench {
        layout,
        rows: d_rows,
        kv,
        q,
        out,
        scale: 1.0 / (shape.d_qk as f32).sqrt(),
    })
}

/// The default tiles for groups of `max_rows` rows, then with `sweep` every tile of [`SWEEP`]
/// and [`SWAPPED_SWEEP`] the shape takes.
fn mla_configs(
    shape: &PagedAttentionShape,
    max_rows: usize,
    sweep: bool,
) -> Result<Vec<MlaConfig>, KernelError> {
    let default = default_config(shape, max_rows)
        .ok_or_else(|| KernelError::shape(format!("no MLA tiles for {shape:?}")))?;
    let mut configs = vec![default];
    if !sweep {
        return Ok(configs);
    }
    // the default with the other copy of its key tiles: the two copies compared in one run
    configs.push(MlaConfig {
        general_copy: !default.general_copy,
        ..default
    });
    for (keys_per_tile, warps, stages, m_tiles, min_blocks, q_in_registers, l2_prefetch) in SWEEP {
        let c = MlaConfig {
            keys_per_tile,
            warps,
            stages,
            m_tiles,
            min_blocks,
            q_in_registers,
            l2_prefetch,
            swapped: false,
            general_copy: false,
        };
        if !configs.contains(&c) && c.validate_for(shape).is_ok() {
            configs.push(c);
        }
    }
    for (most, keys, stages, min_blocks, qreg) in SWAPPED_SWEEP {
        let c = MlaConfig::swapped_for(max_rows, most, keys, stages, min_blocks, qreg);
        if !configs.contains(&c) && c.validate_for(shape).is_ok() {
            configs.push(c);
        }
    }
    Ok(configs)
}

/// The fastest point of a sweep: tokens per split, tiles, timing, (registers, local bytes).
type BestMla = (usize, MlaConfig, Timing, (i32, i32));

struct MlaSweep {
    best: BestMla,
    /// The default tiles at the split rule: tokens per split, timing, resources.
    default_row: Option<(usize, Timing, (i32, i32))>,
    /// One label per timed point (see [`trial_label`]).
    trials: Vec<String>,
}

/// A trial's label in the row's note: `[T]keys x warps x stages x m-tiles/CTAs per SM
/// bound(resident)[Q][P][G] @tokens per split: GB/s`.
fn trial_label(cfg: &MlaConfig, resident: usize, tps: usize, gbps: f64) -> String {
    format!(
        "{}{}x{}x{}x{}/{}({resident}){}{}{} @{tps}: {:.0}",
        if cfg.swapped { "T" } else { "" },
        cfg.keys_per_tile,
        cfg.warps,
        cfg.stages,
        cfg.m_tiles,
        cfg.min_blocks,
        if cfg.q_in_registers { "Q" } else { "" },
        if cfg.l2_prefetch { "P" } else { "" },
        if cfg.general_copy { "G" } else { "" },
        gbps
    )
}

/// Times every configuration at its split rule's size and, with `sweep`, fixed sizes below
/// twice the context.
#[allow(clippy::too_many_arguments)]
fn sweep_mla(
    gpu: &GpuContext,
    att: &mut MlaAttention,
    bench: &mut MlaBench,
    configs: &[MlaConfig],
    context: usize,
    sweep: bool,
    kv_bytes: f64,
    reps: usize,
) -> Result<MlaSweep, KernelError> {
    let mut best: Option<BestMla> = None;
    let mut default_row: Option<(usize, Timing, (i32, i32))> = None;
    let mut tried = Vec::new();
    let mut trials: Vec<String> = Vec::new();
    for (ci, cfg) in configs.iter().enumerate() {
        att.set_config(Some(*cfg))?;
        let rule = att.default_tokens_per_split(gpu, &bench.rows)?;
        let resources = att.resources(gpu, cfg)?;
        let resident = att.resident_per_sm(gpu, cfg)?;
        let mut sizes = vec![rule];
        if sweep {
            sizes.extend([1024, 2048, 4096]);
        }
        sizes.dedup();
        for tps in sizes {
            if tried.contains(&(tps, *cfg)) || (tps != rule && tps >= context * 2) {
                continue;
            }
            let mut ws = att.workspace(gpu, &bench.rows, tps)?;
            let kvv = bench.kv.as_view();
            let (q, layout, rows, scale) = (&bench.q, &bench.layout, &bench.rows, bench.scale);
            let out = &mut bench.out;
            let t = time_ms(gpu, 2, reps, || {
                att.run(gpu, q, &kvv, layout, rows, tps, &mut ws, scale, out)
            })?;
            tried.push((tps, *cfg));
            trials.push(trial_label(cfg, resident, tps, gbps(kv_bytes, &t)));
            if ci == 0 && tps == rule {
                default_row = Some((tps, t, resources));
            }
            if best
                .as_ref()
                .is_none_or(|(_, _, b, _)| t.median_ms < b.median_ms)
            {
                best = Some((tps, *cfg, t, resources));
            }
        }
    }
    Ok(MlaSweep {
        best: best.expect("at least one configuration"),
        default_row,
        trials,
    })
}

/// The backend default's figure in the row's note (empty when it was not timed).
fn mla_default_note(
    default: &MlaConfig,
    default_row: Option<(usize, Timing, (i32, i32))>,
    kv_bytes: f64,
    ceilings: &Ceilings,
) -> String {
    match default_row {
        Some((dt, dtm, (dr, dl))) => {
            let r = gbps(kv_bytes, &dtm);
            format!(
                "; backend default ({} tiles {} keys x {} warps x {} stages x {} m-tiles, rule {dt} tokens/split; {dr} regs, {dl} B local) {r:.1} GB/s = {}",
                if default.swapped { "swapped" } else { "shared" },
                default.keys_per_tile,
                default.warps,
                default.stages,
                default.m_tiles,
                ceilings.note(r)
            )
        }
        None => String::new(),
    }
}

/// Decode (or verification with `query_tokens` per sequence) over `seqs` sequences of
/// `context` keys each, randomly placed blocks. With `sweep` the tiles of [`SWEEP`] and fixed
/// split sizes are tried too; the row is the best, its note gives the default's figure.
#[allow(clippy::too_many_arguments)]
pub fn measure_mla_decode(
    gpu: &GpuContext,
    shape: PagedAttentionShape,
    seqs: usize,
    context: usize,
    query_tokens: usize,
    reps: usize,
    ceilings: &Ceilings,
    sweep: bool,
    seed: u64,
) -> Result<Rate, KernelError> {
    let mut att = MlaAttention::new(gpu, shape)?;
    let mut bench = mla_bench(gpu, &att, &shape, (seqs, context, query_tokens), seed)?;
    let kv_bytes = (seqs * context * shape.num_kv_heads * shape.d_qk * 2) as f64;
    let configs = mla_configs(&shape, bench.rows.max_rows(), sweep)?;
    let sw = sweep_mla(
        gpu, &mut att, &mut bench, &configs, context, sweep, kv_bytes, reps,
    )?;
    let (tps, cfg, t, (regs, local)) = sw.best;
    let per_sm = att.resident_per_sm(gpu, &cfg)?;
    let rate = gbps(kv_bytes, &t);
    let default_note = mla_default_note(&configs[0], sw.default_row, kv_bytes, ceilings);
    Ok(Rate {
        what: format!(
            "MLA decode attention (Mma) latent {} / value {}, {} heads per latent, {query_tokens} query token{} per seq, {seqs} seqs x {context} tokens",
            shape.d_qk,
            shape.d_v,
            shape.group,
            if query_tokens == 1 { "" } else { "s" }
        ),
        timing: t,
        amount: kv_bytes,
        rate,
        unit: "GB/s",
        ratio: Some(rate / ceilings.copy),
        note: format!(
            "KV bytes read; {}; best {} tiles {} keys x {} warps x {} stages x {} m-tiles ({} CTAs/SM bound, {per_sm} resident, Q in registers {}, L2 prefetch {}), {tps} tokens/split, of {} tiles tried; {regs} regs, {local} B local{default_note}; every trial ([T: swapped kernel]keys x warps x stages x m-tiles/CTAs per SM bound(resident)[Q: Q in registers][P: L2 prefetch][G: general copy] @tokens per split: GB/s): {}",
            ceilings.note(rate),
            if cfg.swapped { "swapped" } else { "shared" },
            cfg.keys_per_tile,
            cfg.warps,
            cfg.stages,
            cfg.m_tiles,
            cfg.min_blocks,
            cfg.q_in_registers,
            cfg.l2_prefetch,
            configs.len(),
            sw.trials.join(", ")
        ),
    })
}
