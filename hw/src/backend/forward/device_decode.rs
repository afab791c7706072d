//! Device-bound decode steps ([`DecodeMode::DeviceMoe`] and [`DecodeMode::Graph`]).
//!
//! An eager decode step of the 20 + 20-layer model issues well over a thousand launches and,
//! in every MoE layer, waits for the per-expert counts to reach the host; its device time is
//! then mostly the host's issue time, and it follows the host CPU's speed. Here nothing in
//! the step waits on the device: the routed experts run in the padded layout of
//! [`PaddedMoe`], and every per-step input (token ids, positions, KV slots, attention rows)
//! is copied into buffers kept between steps before the first launch. The launches of the
//! step then read only fixed addresses, so in graph mode they are captured once into a CUDA
//! graph and replayed with a single launch by every later step of the same launch shape.
//!
//! The launch shape is the token count and, per attention (SWA over the rings, global KV),
//! the query rows and groups, table width, longest key range and largest group (see
//! [`MlaAttention::launch_key`]). Key ranges and table widths are planned for a bucket above
//! the step's longest sequence ([`bucket`]): splits past a row's end are empty and skipped by
//! the reduction, so a growing batch keeps replaying one graph until its longest sequence
//! crosses the bucket. Graphs are captured only for the MLA model (its attention rows can be
//! uploaded in place); a GQA model runs the same device-sized step without a graph.

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaSlice};
use half::bf16;
use servelab_kernels::GpuContext;
use servelab_kernels::attention::{AttentionWorkspace, BlockTables, QueryRows};
use servelab_kernels::gemm::linear_bf16;
use servelab_kernels::mla_attention::{MlaAttention, MlaRows};

use super::{
    BackendError, CudaBackend, DecodeInputs, DecodeMode, GlobalRows, ModelShape, PaddedMoe,
    Scratch, Stack, StackInputs, Swa, UploadedRows, ensure_pad, ring_tables, run_stack,
    take_scratch, upload_split, write_global_kv,
};

/// Captured graphs kept at once; the oldest is dropped beyond this (one per launch shape a
/// serving mix visits, e.g. a few batch sizes at a few buckets).
const MAX_GRAPHS: usize = 16;

/// Per-step inputs and outputs of device-bound decode steps, kept between steps so their
/// addresses stay fixed, with the captured graphs that read them.
pub(crate) struct DecodeBuffers {
    tokens: usize,
    ids: CudaSlice<i32>,
    pos: CudaSlice<i32>,
    ring_slots: CudaSlice<i64>,
    global_slots: CudaSlice<i64>,
    /// 0..tokens: every decode row's logits are sampled.
    rows: CudaSlice<i32>,
    sel: CudaSlice<bf16>,
    lg: CudaSlice<bf16>,
    lf: CudaSlice<f32>,
    out: CudaSlice<i32>,
    ring_rows: Option<MlaRows>,
    cross_rows: Option<MlaRows>,
    /// The padded MoE layout and the attention workspace of decode steps, swapped into the
    /// scratch for the step: prefill steps share the scratch and may replace its workspace,
    /// which a captured graph must not see.
    pad: Option<PaddedMoe>,
    att_ws: Option<AttentionWorkspace>,
    ws_slots: usize,
    /// Bumped whenever a buffer above moves; with the scratch's id it names the addresses
    /// the graphs were captured over.
    generation: u64,
    graphs_over: (u64, u64),
    graphs: Vec<(Vec<usize>, CudaGraph)>,
    pub(crate) stats: GraphStats,
}

/// Graph captures and replays of device-bound decode steps so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct GraphStats {
    pub captures: u64,
    pub replays: u64,
    /// Device-bound steps that ran launch by launch (device-MoE mode, GQA, phase timing on).
    pub eager_steps: u64,
}

impl DecodeBuffers {
    fn new(gpu: &GpuContext, m: &ModelShape, tokens: usize) -> Result<Self, BackendError> {
        let s = &gpu.stream;
        let all: Vec<i32> = (0..tokens as i32).collect();
        Ok(Self {
            tokens,
            ids: s.alloc_zeros(tokens)?,
            pos: s.alloc_zeros(tokens)?,
            ring_slots: s.alloc_zeros(tokens)?,
            global_slots: s.alloc_zeros(tokens)?,
            rows: s.clone_htod(&all)?,
            sel: s.alloc_zeros(tokens * m.hidden)?,
            lg: s.alloc_zeros(tokens * m.vocab)?,
            lf: s.alloc_zeros(tokens * m.vocab)?,
            out: s.alloc_zeros(tokens)?,
            ring_rows: None,
            cross_rows: None,
            pad: None,
            att_ws: None,
            ws_slots: 0,
            generation: 0,
            graphs_over: (u64::MAX, u64::MAX),
            graphs: Vec::new(),
            stats: GraphStats::default(),
        })
    }
}

/// The key-range bucket of a step whose longest sequence holds `len` keys: `len` rounded up
/// to a multiple of an eighth of its next power of two, or of 256 keys when that is larger.
/// Planned ranges then exceed the real ones by less than 256 keys or an eighth of the next
/// power of two, and a graph serves every step until the longest sequence crosses a bucket.
pub(crate) fn bucket(len: usize) -> usize {
    let step = (len.max(1).next_power_of_two() / 8).max(256);
    len.max(1).next_multiple_of(step)
}

/// Block tables at least `min_blocks` wide (padded with block 0, which no row reads).
fn tables_at_least(per_seq: &[Vec<i32>], min_blocks: usize) -> BlockTables {
    let max_blocks = per_seq
        .iter()
        .map(|v| v.len())
        .max()
        .unwrap_or(0)
        .max(min_blocks)
        .max(1);
    let mut entries = Vec::with_capacity(per_seq.len() * max_blocks);
    for v in per_seq {
        entries.extend_from_slice(v);
        entries.extend(std::iter::repeat_n(0, max_blocks - v.len()));
    }
    BlockTables {
        max_blocks,
        entries,
    }
}

/// The device buffers the launches of one step read and write.
struct StepIo<'a> {
    tokens: &'a [i32],
    ids: &'a CudaSlice<i32>,
    global_slots: &'a CudaSlice<i64>,
    rows: &'a CudaSlice<i32>,
    sel: &'a mut CudaSlice<bf16>,
    lg: &'a mut CudaSlice<bf16>,
    lf: &'a mut CudaSlice<f32>,
    out: &'a mut CudaSlice<i32>,
}

/// Every launch of a decode step after its inputs are on the device: both stacks, the shared
/// global KV, the LM head and the greedy tokens into `io.out`. Nothing here copies, allocates
/// or waits, so it can run inside a stream capture.
fn launches(
    b: &mut CudaBackend,
    sc: &mut Scratch,
    stack: &StackInputs<'_>,
    io: &mut StepIo<'_>,
) -> Result<(), BackendError> {
    let g = b.gpu.clone();
    let m = b.cfg.model.clone();
    let t = stack.t;
    let embed = |b: &CudaBackend, sc: &mut Scratch| {
        b.k.ops.select_rows(
            &g, &b.w.embed, m.vocab, io.tokens, io.ids, &mut sc.h, m.hidden,
        )
    };
    embed(b, sc)?;
    let encoder = Stack::Encoder {
        global_slots: io.global_slots,
    };
    run_stack(b, &encoder, stack, sc)?;
    write_global_kv(b, sc, t, io.global_slots, false)?;
    // the decoder restarts from the embeddings (see the model docs)
    embed(b, sc)?;
    run_stack(b, &Stack::Decoder, stack, sc)?;
    b.k.norm.run(
        &g,
        &sc.h,
        &b.w.final_norm,
        t,
        m.hidden,
        m.norm_eps,
        &mut sc.xn,
    )?;
    let rows: Vec<i32> = (0..t as i32).collect();
    b.k.ops
        .select_rows(&g, &sc.xn, t, &rows, io.rows, io.sel, m.hidden)?;
    linear_bf16(&g, io.sel, &b.w.lm_head, io.lg, t, m.vocab, m.hidden)?;
    b.k.ops.to_f32(&g, io.lg, io.lf, t * m.vocab)?;
    b.k.sampler.greedy(&g, io.lf, t, m.vocab, io.out)?;
    Ok(())
}

/// A device-bound decode step (see the module docs): inputs copied into the kept buffers,
/// then the launches, replayed from a graph in graph mode when one matches.
pub(super) fn decode(
    b: &mut CudaBackend,
    blocks: &[Vec<u32>],
    inp: &DecodeInputs,
) -> Result<(), BackendError> {
    let t = inp.rows.tokens.len();
    let g = b.gpu.clone();
    let m = b.cfg.model.clone();
    let mut db = match b.decode_bufs.take() {
        Some(db) if db.tokens >= t => db,
        old => {
            let (stats, gen_) = old
                .as_ref()
                .map_or((GraphStats::default(), 0), |o| (o.stats, o.generation + 1));
            drop(old);
            let mut db = DecodeBuffers::new(&g, &m, t.next_power_of_two())?;
            db.stats = stats;
            db.generation = gen_;
            db
        }
    };
    let r = step(b, blocks, inp, &mut db);
    b.decode_bufs = Some(db);
    r
}

fn step(
    b: &mut CudaBackend,
    blocks: &[Vec<u32>],
    inp: &DecodeInputs,
    db: &mut DecodeBuffers,
) -> Result<(), BackendError> {
    let t = inp.rows.tokens.len();
    let g = b.gpu.clone();
    let s = g.stream.clone();
    let m = b.cfg.model.clone();
    s.memcpy_htod(&inp.rows.tokens, &mut db.ids.slice_mut(..t))?;
    s.memcpy_htod(&inp.rows.positions, &mut db.pos.slice_mut(..t))?;
    s.memcpy_htod(&inp.rows.ring_slots, &mut db.ring_slots.slice_mut(..t))?;
    s.memcpy_htod(&inp.global_slots, &mut db.global_slots.slice_mut(..t))?;
    let max_kv = inp.kv_lens.iter().copied().max().unwrap_or(1);
    let (rl, gl) = (b.ring_layout(), b.global_layout());
    let per_seq: Vec<Vec<i32>> = blocks
        .iter()
        .map(|v| v.iter().map(|&x| x as i32).collect())
        .collect();
    let cross_rows = QueryRows::decode_verify(&inp.kv_lens, &inp.q_lens);
    // MLA: rows uploaded in place, planned for the bucket; GQA: fresh rows, no graph
    let mut fresh: Option<(UploadedRows, UploadedRows)> = None;
    if let Some(mla) = &b.k.mla {
        let pad = bucket(max_kv);
        let ring_t = ring_tables(&m, &inp.rings, pad);
        let cross_t = tables_at_least(&per_seq, pad.div_ceil(m.block_size));
        let mut moved = mla.upload_into(
            &g,
            &rl,
            &ring_t,
            &inp.ring_rows,
            m.window,
            &mut db.ring_rows,
        )?;
        moved |= mla.upload_into(&g, &gl, &cross_t, &cross_rows, pad, &mut db.cross_rows)?;
        if moved {
            db.generation += 1;
        }
    } else {
        let ring_t = ring_tables(&m, &inp.rings, max_kv);
        fresh = Some((
            upload_split(b, &rl, &ring_t, &inp.ring_rows)?,
            upload_split(b, &gl, &super::tables(&per_seq), &cross_rows)?,
        ));
    }
    let mut sc = take_scratch(b, t, 0)?;
    // the decode step's own padded layout and workspace (see DecodeBuffers)
    if db.pad.as_ref().is_none_or(|p| p.tokens < t) {
        db.generation += 1;
    }
    std::mem::swap(&mut sc.pad, &mut db.pad);
    std::mem::swap(&mut sc.att_ws, &mut db.att_ws);
    let r = run(b, &mut sc, db, fresh.as_ref(), inp, t);
    std::mem::swap(&mut sc.pad, &mut db.pad);
    std::mem::swap(&mut sc.att_ws, &mut db.att_ws);
    b.scratch = Some(sc);
    r?;
    b.mark_issued()?;
    b.last_tokens = s.clone_dtoh(&db.out.slice(..t))?;
    if b.keep_logits {
        b.last_logits = s.clone_dtoh(&db.lf.slice(..t * m.vocab))?;
    }
    Ok(())
}

/// Sizes the step's padded MoE layout and attention workspace, then issues (or replays) the
/// launches.
fn run(
    b: &mut CudaBackend,
    sc: &mut Scratch,
    db: &mut DecodeBuffers,
    fresh: Option<&(UploadedRows, UploadedRows)>,
    inp: &DecodeInputs,
    t: usize,
) -> Result<(), BackendError> {
    let g = b.gpu.clone();
    let s = g.stream.clone();
    let m = b.cfg.model.clone();
    ensure_pad(&g, &m, sc, t)?;
    let (ring, cross) = match fresh {
        Some((r, c)) => (r.as_global(), c.as_global()),
        None => (
            GlobalRows::Mla(db.ring_rows.as_ref().expect("uploaded above")),
            GlobalRows::Mla(db.cross_rows.as_ref().expect("uploaded above")),
        ),
    };
    // Size the workspace for both attentions now: inside a capture it must not move.
    if let (Some(mla), GlobalRows::Mla(rr), GlobalRows::Mla(cr)) = (&b.k.mla, ring, cross) {
        for r in [rr, cr] {
            let tps = mla.default_tokens_per_split(&g, r)?;
            let need = mla.workspace_slots(r, tps);
            if need > db.ws_slots || sc.att_ws.is_none() {
                db.ws_slots = db.ws_slots.max(need);
                db.generation += 1;
            }
            mla.ensure_workspace(&g, r, tps, &mut sc.att_ws)?;
        }
    }
    // swap-ins on the copy stream land before the global KV is read
    s.join(&b.copy)?;
    let stack = StackInputs {
        t,
        first_projected: false,
        pos: &db.pos,
        ring_slots: &db.ring_slots,
        swa: Swa::Ring(ring),
        cross,
        padded_moe: true,
    };
    let mut io = StepIo {
        tokens: &inp.rows.tokens,
        ids: &db.ids,
        global_slots: &db.global_slots,
        rows: &db.rows,
        sel: &mut db.sel,
        lg: &mut db.lg,
        lf: &mut db.lf,
        out: &mut db.out,
    };
    let graph = b.cfg.decode_mode == DecodeMode::Graph && fresh.is_none() && b.phases.is_none();
    if !graph {
        db.stats.eager_steps += 1;
        return launches(b, sc, &stack, &mut io);
    }
    let (GlobalRows::Mla(rr), GlobalRows::Mla(cr)) = (ring, cross) else {
        unreachable!("graphs run only over in-place MLA rows");
    };
    let mut key = vec![t];
    key.extend(MlaAttention::launch_key(rr));
    key.extend(MlaAttention::launch_key(cr));
    let over = (sc.id, db.generation);
    if db.graphs_over != over {
        db.graphs.clear();
        db.graphs_over = over;
    }
    let i = match db.graphs.iter().position(|(k, _)| *k == key) {
        Some(i) => {
            db.stats.replays += 1;
            i
        }
        None => {
            if db.graphs.len() >= MAX_GRAPHS {
                db.graphs.remove(0);
            }
            // Relaxed: module loads for kernel tiles not used before may happen inside.
            s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)?;
            let issued = launches(b, sc, &stack, &mut io);
            // end the capture whatever happened, so the stream is usable again
            let captured = s.end_capture(CUgraphInstantiate_flags(0));
            issued?;
            let graph = captured?.ok_or_else(|| {
                BackendError::Plan("stream capture of the decode step gave no graph".into())
            })?;
            db.stats.captures += 1;
            db.graphs.push((key, graph));
            db.graphs.len() - 1
        }
    };
    db.graphs[i].1.launch()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_round_up_by_at_most_an_eighth() {
        assert_eq!(bucket(1), 256);
        assert_eq!(bucket(256), 256);
        assert_eq!(bucket(257), 512);
        assert_eq!(bucket(4096), 4096);
        assert_eq!(bucket(4097), 5120);
        assert_eq!(bucket(16_000), 16_384);
        for len in [300, 1000, 5000, 70_000] {
            let b = bucket(len);
            assert!(b >= len, "{len} -> {b}");
            assert!(
                b - len < 256 || (b - len) * 8 <= len.next_power_of_two(),
                "{len} -> {b}"
            );
        }
    }

    #[test]
    fn tables_pad_to_the_planned_width() {
        let t = tables_at_least(&[vec![3, 4], vec![5]], 4);
        assert_eq!(t.max_blocks, 4);
        assert_eq!(t.entries, vec![3, 4, 0, 0, 5, 0, 0, 0]);
        assert_eq!(tables_at_least(&[vec![1, 2, 3]], 2).max_blocks, 3);
    }
}
