//! The forward pass of prefill and decode plans (see the module docs of `backend`).

use std::cell::RefCell;
use std::sync::Arc;

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, CudaView};
use half::bf16;
use servelab_core::engine::plan::{DecodePlan, PrefillPlan};
use servelab_kernels::GpuContext;
use servelab_kernels::attention::{
    AttentionWorkspace, BlockTables, DeviceRows, KvLayout, QueryRows,
};
use servelab_kernels::gemm::{linear_bf16, linear_bf16_beta};
use servelab_kernels::mla_attention::MlaRows;
use servelab_kernels::moe::Routing;
use servelab_kernels::prefill_attention::PrefillRows;
use servelab_kernels::swa::SwaRange;

use super::model::{CrossWeights, ExpertWeights, LayerWeights, ModelShape};
use super::{BackendError, CudaBackend, DecodeMode, Kernels, Moves};

pub(crate) mod device_decode;

pub(crate) use device_decode::DecodeBuffers;

/// Per-step activations, sized for up to `tokens` tokens and `kbuf_rows` SWA key rows. The
/// backend keeps the largest one between steps ([`take_scratch`]): allocating and zeroing
/// ~1.7 GB of activations each step cost ~1 ms of a 8K-token SPEC-shaped prefill step. Every
/// element a step reads, it writes first.
pub(crate) struct Scratch {
    /// Distinct for every scratch allocated (graphs captured over one must not replay over
    /// another, even at reused addresses).
    id: u64,
    tokens: usize,
    kbuf_rows: usize,
    h: CudaSlice<bf16>,
    xn: CudaSlice<bf16>,
    q: CudaSlice<bf16>,
    k: CudaSlice<bf16>,
    att: CudaSlice<bf16>,
    rl_bf: CudaSlice<bf16>,
    rl_f: CudaSlice<f32>,
    xs: CudaSlice<bf16>,
    gu: CudaSlice<bf16>,
    act: CudaSlice<bf16>,
    ys: CudaSlice<bf16>,
    moe_out: CudaSlice<bf16>,
    kbuf: CudaSlice<bf16>,
    /// Routing buffers for `tokens` tokens and the attention workspace (grown on demand),
    /// reused by every layer: allocating and zeroing them per layer was ~18 driver calls a
    /// layer in host-bound decode steps.
    routing: Routing,
    att_ws: Option<AttentionWorkspace>,
    /// The padded expert layout of device-sized MoE ([`PaddedMoe`]), allocated by the first
    /// step that uses it.
    pad: Option<PaddedMoe>,
    /// Streams of their own (each with its cuBLAS handle) that a large step's routed-expert
    /// GEMMs spread over ([`expert_gemms`]), opened by the first step that uses them and
    /// handed on to a larger scratch.
    lanes: Vec<GpuContext>,
}

/// Streams the routed-expert GEMMs of a step of at least [`LANE_MIN_TOKENS`] tokens spread
/// over. One expert's GEMM (a 64th of the step's routed rows) has too few output tiles to fill
/// the device; several in flight at once fill it.
const EXPERT_LANES: usize = 4;

/// Smallest step whose routed experts go to [`EXPERT_LANES`]: below it (decode steps) the
/// extra event records and waits would cost more host time than the overlap gains.
const LANE_MIN_TOKENS: usize = 2048;

/// Buffers of the padded expert layout: expert `e`'s rows at `e * t..(e + 1) * t` for a step of
/// `t` tokens (one expert receives at most `t`, top-k picks distinct experts), so every expert
/// GEMM runs at `t` rows and nothing about the routing has to reach the host. Sized for up to
/// `tokens` tokens. This costs `experts / top_k` times the routed-expert FLOPs, which decode
/// steps (a few hundred tokens at most, their GEMMs bound by weight reads and launch latency)
/// can afford and prefill steps cannot; prefill keeps the host-sized path.
pub(crate) struct PaddedMoe {
    tokens: usize,
    sorted: CudaSlice<i32>,
    xs: CudaSlice<bf16>,
    gu: CudaSlice<bf16>,
    act: CudaSlice<bf16>,
    ys: CudaSlice<bf16>,
}

impl PaddedMoe {
    fn new(gpu: &GpuContext, m: &ModelShape, tokens: usize) -> Result<Self, BackendError> {
        let s = &gpu.stream;
        let rows = m.experts * tokens.max(1);
        Ok(Self {
            tokens,
            sorted: s.alloc_zeros(rows)?,
            xs: s.alloc_zeros(rows * m.hidden)?,
            gu: s.alloc_zeros(rows * 2 * m.expert_ffn)?,
            act: s.alloc_zeros(rows * m.expert_ffn)?,
            ys: s.alloc_zeros(rows * m.hidden)?,
        })
    }
}

/// Makes `sc` hold a padded expert layout for `t` tokens.
fn ensure_pad(
    gpu: &GpuContext,
    m: &ModelShape,
    sc: &mut Scratch,
    t: usize,
) -> Result<(), BackendError> {
    if sc.pad.as_ref().is_none_or(|p| p.tokens < t) {
        sc.pad = None;
        sc.pad = Some(PaddedMoe::new(gpu, m, t)?);
    }
    Ok(())
}

impl Scratch {
    fn new(
        gpu: &GpuContext,
        m: &ModelShape,
        t: usize,
        kbuf_rows: usize,
    ) -> Result<Self, BackendError> {
        let s = &gpu.stream;
        let t1 = t.max(1);
        let tk = t1 * m.top_k;
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Ok(Self {
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            tokens: t,
            kbuf_rows,
            h: s.alloc_zeros(t1 * m.hidden)?,
            xn: s.alloc_zeros(t1 * m.hidden)?,
            q: s.alloc_zeros(t1 * m.q_dim())?,
            k: s.alloc_zeros(t1 * m.kv_row())?,
            att: s.alloc_zeros(t1 * m.o_dim())?,
            rl_bf: s.alloc_zeros(t1 * m.experts)?,
            rl_f: s.alloc_zeros(t1 * m.experts)?,
            xs: s.alloc_zeros(tk * m.hidden)?,
            gu: s.alloc_zeros((tk * 2 * m.expert_ffn).max(t1 * 2 * m.shared_ffn))?,
            act: s.alloc_zeros((tk * m.expert_ffn).max(t1 * m.shared_ffn))?,
            ys: s.alloc_zeros(tk * m.hidden)?,
            moe_out: s.alloc_zeros(t1 * m.hidden)?,
            kbuf: s.alloc_zeros(kbuf_rows.max(1) * m.kv_row())?,
            routing: Routing::alloc(gpu, t1, m.experts, m.top_k)?,
            att_ws: None,
            pad: None,
            lanes: Vec::new(),
        })
    }
}

/// The backend's kept scratch if it holds `t` tokens and `kbuf_rows` key rows, else a new one
/// large enough for both (the old one is freed first).
fn take_scratch(b: &mut CudaBackend, t: usize, kbuf_rows: usize) -> Result<Scratch, BackendError> {
    match b.scratch.take() {
        Some(sc) if sc.tokens >= t && sc.kbuf_rows >= kbuf_rows => Ok(sc),
        old => {
            let (t0, k0) = old.as_ref().map_or((0, 0), |o| (o.tokens, o.kbuf_rows));
            let lanes = old.map(|o| o.lanes).unwrap_or_default();
            let mut sc = Scratch::new(&b.gpu, &b.cfg.model, t.max(t0), kbuf_rows.max(k0))?;
            sc.lanes = lanes;
            Ok(sc)
        }
    }
}

/// The SWA of a prefill stack on the tensor-core prefill kernel with a sliding window, or on
/// the MLA kernel: each chunk's keys (window before the chunk, then the chunk) lie in `kbuf`
/// from block-aligned row `kb0`, read through an identity block table; token `i` of a chunk
/// sees rows `[max(0, e - window), e)` with `e = pos0 - lo + i + 1`, i.e. positions
/// `[max(lo, p - window + 1), p]`, as [`SwaRange::visible`]. The prefill kernel cuts the
/// window itself; the MLA kernel's rows start at the window.
pub(crate) struct SwaTiles {
    rows: UploadedRows,
    layout: KvLayout,
}

fn swa_tiles(
    b: &CudaBackend,
    chunks: &[SwaChunk],
    kbuf_rows: usize,
) -> Result<Option<SwaTiles>, BackendError> {
    if b.k.prefill.is_none() && b.k.mla.is_none() {
        return Ok(None);
    }
    let m = &b.cfg.model;
    let bs = m.block_size;
    let mut rows = QueryRows::default();
    let mut per_chunk = Vec::new();
    for ch in chunks.iter().filter(|c| c.n > 0) {
        let num_k = ch.pos0 - ch.lo + ch.n;
        // row kb0 holds position lo, at offset lo % bs of its block (see `kbuf_row`)
        let off = ch.kb0 % bs;
        for i in 0..ch.n {
            let e = off + ch.pos0 - ch.lo + i + 1;
            let s = if b.k.prefill.is_some() {
                off
            } else {
                off.max(e.saturating_sub(m.window))
            };
            rows.push(per_chunk.len(), s, e);
        }
        per_chunk.push(
            (0..(off + num_k).div_ceil(bs))
                .map(|j| (ch.kb0 / bs + j) as i32)
                .collect::<Vec<_>>(),
        );
    }
    let layout = KvLayout {
        block_stride: bs * m.kv_row(),
        row_stride: m.kv_row(),
        num_blocks: kbuf_rows / bs,
    };
    let tables = tables(&per_chunk);
    let rows = match &b.k.prefill {
        Some(pk) => UploadedRows::Prefill(pk.upload(&b.gpu, &layout, &tables, &rows)?),
        None => upload_split(b, &layout, &tables, &rows)?,
    };
    Ok(Some(SwaTiles { rows, layout }))
}

/// Where a chunk whose window starts at position `lo` puts its keys in `kbuf`, from row `*kb`
/// on: returns the chunk's first key row (`kb0`) and advances `*kb` past the `num_k` rows. The
/// rows start in a fresh block at offset `lo % block_size`, so key tiles of the prefill kernel
/// fall on the same positions however a prompt was chunked, and a warm chunk's window equals
/// the cold run's bit for bit.
fn kbuf_row(kb: &mut usize, lo: usize, num_k: usize, block_size: usize) -> usize {
    let off = lo % block_size;
    let kb0 = *kb + off;
    *kb += (off + num_k).next_multiple_of(block_size);
    kb0
}

/// One sequence's share of a prefill stack's SWA: tokens `tok0..tok0 + n` of the batch at
/// positions `pos0..`, seeing keys from `lo` (window start, or the truncation point) on.
struct SwaChunk {
    tok0: usize,
    n: usize,
    pos0: usize,
    lo: usize,
    trunc: usize,
    ring: u32,
    kb0: usize,
}

enum Swa<'a> {
    /// Prefill: each chunk's window gathered into `kbuf`, then the SWA kernel per chunk, or,
    /// when given, the tensor-core prefill kernel or the MLA kernel over all of them.
    Chunks(&'a [SwaChunk], Option<&'a SwaTiles>),
    /// Decode: every token's window through the rings with the split kernels.
    Ring(GlobalRows<'a>),
}

/// What the device time of a step goes to (the diagnostic breakdown of
/// [`super::CudaBackend::set_phase_timing`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// cuBLAS GEMMs (projections, router, experts, shared expert, global KV projection).
    Gemm,
    /// Attention over the paged global KV (the encoder's own layer, decoder cross-attention).
    Attention,
    /// Sliding-window attention, with its window gathering and ring writes.
    Swa,
    /// MoE routing: logits to f32, softmax top-k, counts (and their copy to the host).
    Routing,
    /// MoE gather of token rows into expert order and the weighted combine back.
    Permute,
    /// Norms, RoPE, KV writes, activations, residual adds, LM head selection.
    Elementwise,
    /// Host planning, block placement and moves, uploads, scratch, embeddings.
    Setup,
}

/// Device milliseconds of one step by [`Phase`]; they add up to the step's duration.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct PhaseTimes {
    pub gemm_ms: f64,
    pub attention_ms: f64,
    pub swa_ms: f64,
    pub routing_ms: f64,
    pub permute_ms: f64,
    pub elementwise_ms: f64,
    pub setup_ms: f64,
}

impl PhaseTimes {
    pub fn total_ms(&self) -> f64 {
        self.gemm_ms
            + self.attention_ms
            + self.swa_ms
            + self.routing_ms
            + self.permute_ms
            + self.elementwise_ms
            + self.setup_ms
    }
}

/// Timing events recorded at phase boundaries on the compute stream: the time between a mark
/// and the next is the earlier mark's phase.
pub(crate) struct PhaseLog {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    marks: RefCell<Vec<(Phase, CudaEvent)>>,
}

impl PhaseLog {
    pub(crate) fn new(gpu: &GpuContext) -> Self {
        Self {
            ctx: gpu.ctx.clone(),
            stream: gpu.stream.clone(),
            marks: RefCell::new(Vec::new()),
        }
    }

    pub(crate) fn mark(&self, p: Phase) -> Result<(), BackendError> {
        let ev = self.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        ev.record(&self.stream)?;
        self.marks.borrow_mut().push((p, ev));
        Ok(())
    }

    /// Sums the marks so far (the last one closes the step) and clears them.
    pub(crate) fn finish(&self) -> Result<PhaseTimes, BackendError> {
        let marks = std::mem::take(&mut *self.marks.borrow_mut());
        let mut t = PhaseTimes::default();
        for w in marks.windows(2) {
            let ms = w[0].1.elapsed_ms(&w[1].1)? as f64;
            match w[0].0 {
                Phase::Gemm => t.gemm_ms += ms,
                Phase::Attention => t.attention_ms += ms,
                Phase::Swa => t.swa_ms += ms,
                Phase::Routing => t.routing_ms += ms,
                Phase::Permute => t.permute_ms += ms,
                Phase::Elementwise => t.elementwise_ms += ms,
                Phase::Setup => t.setup_ms += ms,
            }
        }
        Ok(t)
    }
}

/// Query rows over a paged KV layer, uploaded for the kernel that runs them: the tensor-core
/// prefill kernel (a tile of query rows per CTA, keys read once per tile), the GQA split
/// decode kernels (short runs of query tokens over long key ranges), or the MLA kernel (every
/// attention of an MLA model).
#[derive(Clone, Copy)]
enum GlobalRows<'a> {
    Split(&'a DeviceRows),
    Prefill(&'a PrefillRows),
    Mla(&'a MlaRows),
}

/// Attention rows over a global KV layer: the encoder layer's own (`own` is its global layer
/// index and `slots` where this step's rows go) or the decoder's shared one.
struct Cross<'a> {
    rows: GlobalRows<'a>,
    /// Encoder layers: (global layer, device slots of the new rows).
    own: Option<(usize, &'a CudaSlice<i64>)>,
}

struct Ctx<'a> {
    gpu: &'a GpuContext,
    k: &'a Kernels,
    m: &'a ModelShape,
    ring_layout: KvLayout,
    global_layout: KvLayout,
    phases: Option<&'a PhaseLog>,
    /// Size the routed experts on the device ([`PaddedMoe`]) instead of from counts copied
    /// back to the host every layer.
    padded_moe: bool,
    /// Routed rows per (layer, expert), summed over steps, when the backend logs routing.
    route_log: Option<&'a std::cell::RefCell<Vec<Vec<u64>>>>,
}

impl Ctx<'_> {
    fn mark(&self, p: Phase) -> Result<(), BackendError> {
        match self.phases {
            Some(l) => l.mark(p),
            None => Ok(()),
        }
    }

    /// `out` = attention of `q` over one global KV layer (`view` starts at the layer).
    fn global_attention(
        &self,
        rows: &GlobalRows<'_>,
        q: &CudaSlice<bf16>,
        view: &CudaView<'_, bf16>,
        scale: f32,
        out: &mut CudaSlice<bf16>,
        ws: &mut Option<AttentionWorkspace>,
    ) -> Result<(), BackendError> {
        self.mark(Phase::Attention)?;
        let layout = self.global_layout;
        self.attend(rows, q, view, &layout, scale, out, ws)?;
        self.mark(Phase::Elementwise)
    }

    /// `out` = attention of `q` over the paged KV `view` laid out as `layout`, on the kernel
    /// the rows were uploaded for.
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        rows: &GlobalRows<'_>,
        q: &CudaSlice<bf16>,
        view: &CudaView<'_, bf16>,
        layout: &KvLayout,
        scale: f32,
        out: &mut CudaSlice<bf16>,
        ws: &mut Option<AttentionWorkspace>,
    ) -> Result<(), BackendError> {
        let g = self.gpu;
        match rows {
            GlobalRows::Split(r) => {
                let tps = self.k.att.default_tokens_per_split(r);
                self.k.att.ensure_workspace(g, r, tps, ws)?;
                let ws = ws.as_mut().expect("ensured above");
                self.k.att.run(g, q, view, layout, r, tps, ws, scale, out)?;
            }
            GlobalRows::Prefill(r) => {
                let pk = self.k.prefill.as_ref().ok_or_else(|| {
                    BackendError::Plan("prefill rows without the prefill kernel".into())
                })?;
                pk.run(g, q, view, layout, r, scale, out)?;
            }
            GlobalRows::Mla(r) => {
                let mla =
                    self.k.mla.as_ref().ok_or_else(|| {
                        BackendError::Plan("MLA rows without the MLA kernel".into())
                    })?;
                let tps = mla.default_tokens_per_split(g, r)?;
                mla.ensure_workspace(g, r, tps, ws)?;
                let ws = ws.as_mut().expect("ensured above");
                mla.run(g, q, view, layout, r, tps, ws, scale, out)?;
            }
        }
        Ok(())
    }
}

fn ring_slot(m: &ModelShape, ring: u32, pos: usize) -> i64 {
    let phys = ring as usize * 2 + (pos / m.block_size) % 2;
    (phys * m.block_size + pos % m.block_size) as i64
}

/// One transformer layer over `t` tokens of `sc.h`, in place; `projected`: its query and key
/// projections are already in `sc.q` and `sc.k` ([`project_qk`]).
#[allow(clippy::too_many_arguments)]
fn layer(
    c: &Ctx<'_>,
    lw: &LayerWeights,
    projected: bool,
    ring_layer: usize,
    rings: &mut CudaSlice<bf16>,
    pool: &mut CudaSlice<bf16>,
    t: usize,
    pos: &CudaSlice<i32>,
    ring_slots: &CudaSlice<i64>,
    swa: &Swa<'_>,
    cross: Option<&Cross<'_>>,
    sc: &mut Scratch,
) -> Result<(), BackendError> {
    let (g, k, m) = (c.gpu, c.k, c.m);
    let (hd, od) = (m.hidden, m.o_dim());
    let scale = 1.0 / (m.head_dim as f32).sqrt();
    if !projected {
        project_qk(c, lw, t, pos, sc)?;
    }
    let layer_off = ring_layer * m.block_size * m.kv_row();
    c.mark(Phase::Swa)?;
    match swa {
        Swa::Chunks(chunks, tiles) => {
            swa_chunks(
                c, chunks, *tiles, rings, layer_off, t, ring_slots, scale, sc,
            )?;
        }
        Swa::Ring(rows) => swa_ring(c, rows, rings, layer_off, t, ring_slots, scale, sc)?,
    }
    c.mark(Phase::Gemm)?;
    linear_bf16_beta(g, &sc.att, &lw.wo, &mut sc.h, t, hd, od, true)?;
    c.mark(Phase::Elementwise)?;
    if let Some(Cross {
        rows,
        own: Some((gl_layer, slots)),
    }) = cross
    {
        own_global_attention(c, lw, pool, *gl_layer, slots, rows, t, scale, sc)?;
    }
    if let (Some(cw), Some(cr)) = (&lw.cross, cross) {
        cross_attention(c, cw, &cr.rows, pool, t, scale, sc)?;
    }
    k.norm
        .run(g, &sc.h, &lw.ffn_norm, t, hd, m.norm_eps, &mut sc.xn)?;
    moe(c, lw, ring_layer, t, sc)?;
    k.ops.add(g, &mut sc.h, &sc.moe_out, t * hd)?;
    Ok(())
}

/// The attention norm of `sc.h` into `sc.xn`, then the query and key projections with RoPE
/// into `sc.q` and `sc.k`.
fn project_qk(
    c: &Ctx<'_>,
    lw: &LayerWeights,
    t: usize,
    pos: &CudaSlice<i32>,
    sc: &mut Scratch,
) -> Result<(), BackendError> {
    let (g, k, m) = (c.gpu, c.k, c.m);
    let (hd, qd, row) = (m.hidden, m.q_dim(), m.kv_row());
    c.mark(Phase::Elementwise)?;
    k.norm
        .run(g, &sc.h, &lw.attn_norm, t, hd, m.norm_eps, &mut sc.xn)?;
    c.mark(Phase::Gemm)?;
    linear_bf16(g, &sc.xn, &lw.wq, &mut sc.q, t, qd, hd)?;
    linear_bf16(g, &sc.xn, &lw.wk, &mut sc.k, t, row, hd)?;
    c.mark(Phase::Elementwise)?;
    k.rope_q.run_rows(g, &mut sc.q, pos, t)?;
    k.rope_k.run_rows(g, &mut sc.k, pos, t)?;
    Ok(())
}

/// Prefill SWA into `sc.att`: each chunk's window and new keys gathered into `kbuf`, the
/// step's rows written to the rings, then the tensor-core prefill kernel over every chunk when
/// it has tiles, else the SWA kernel chunk by chunk.
#[allow(clippy::too_many_arguments)]
fn swa_chunks(
    c: &Ctx<'_>,
    chunks: &[SwaChunk],
    tiles: Option<&SwaTiles>,
    rings: &mut CudaSlice<bf16>,
    layer_off: usize,
    t: usize,
    ring_slots: &CudaSlice<i64>,
    scale: f32,
    sc: &mut Scratch,
) -> Result<(), BackendError> {
    let (g, k, m) = (c.gpu, c.k, c.m);
    for ch in chunks.iter() {
        gather_window(c, ch, rings, layer_off, sc)?;
    }
    let mut view = rings.slice_mut(layer_off..);
    // SAFETY: every slot was built by `ring_slot` for a ring the tiers handed out.
    unsafe {
        k.att
            .write_kv_unchecked(g, &sc.k, t, ring_slots, &mut view, &c.ring_layout)
    }?;
    match (tiles, &k.prefill) {
        (
            Some(SwaTiles {
                rows: UploadedRows::Prefill(r),
                layout,
            }),
            Some(pk),
        ) => {
            pk.run_window(
                g,
                &sc.q,
                &sc.kbuf.as_view(),
                layout,
                r,
                scale,
                Some(m.window),
                &mut sc.att,
            )?;
        }
        (Some(st), _) => {
            let rows = st.rows.as_global();
            let kbuf = sc.kbuf.as_view();
            c.attend(
                &rows,
                &sc.q,
                &kbuf,
                &st.layout,
                scale,
                &mut sc.att,
                &mut sc.att_ws,
            )?;
        }
        (None, _) => {
            for ch in chunks.iter().filter(|c| c.n > 0) {
                swa_chunk(c, ch, scale, sc)?;
            }
        }
    }
    Ok(())
}

/// Copies a chunk's window before the chunk from the ring (in runs inside one ring block),
/// then the chunk's own keys, into `kbuf` from row `kb0`.
fn gather_window(
    c: &Ctx<'_>,
    ch: &SwaChunk,
    rings: &CudaSlice<bf16>,
    layer_off: usize,
    sc: &mut Scratch,
) -> Result<(), BackendError> {
    let (m, s) = (c.m, &c.gpu.stream);
    let row = m.kv_row();
    let mut p = ch.lo;
    let mut dst = ch.kb0;
    while p < ch.pos0 {
        let run = (ch.pos0 - p).min(m.block_size - p % m.block_size);
        let src = layer_off
            + ring_slot(m, ch.ring, p) as usize / m.block_size * c.ring_layout.block_stride
            + (p % m.block_size) * row;
        s.memcpy_dtod(
            &rings.slice(src..src + run * row),
            &mut sc.kbuf.slice_mut(dst * row..(dst + run) * row),
        )?;
        p += run;
        dst += run;
    }
    if ch.n > 0 {
        s.memcpy_dtod(
            &sc.k.slice(ch.tok0 * row..(ch.tok0 + ch.n) * row),
            &mut sc.kbuf.slice_mut(dst * row..(dst + ch.n) * row),
        )?;
    }
    Ok(())
}

/// The SWA kernel over one chunk's queries and its keys in `kbuf`.
fn swa_chunk(c: &Ctx<'_>, ch: &SwaChunk, scale: f32, sc: &mut Scratch) -> Result<(), BackendError> {
    let m = c.m;
    let (qd, od, row) = (m.q_dim(), m.o_dim(), m.kv_row());
    let swa =
        c.k.swa
            .as_ref()
            .ok_or_else(|| BackendError::Plan("no SWA kernel for this attention shape".into()))?;
    let num_k = ch.pos0 - ch.lo + ch.n;
    let range = SwaRange {
        num_q: ch.n,
        num_k,
        q_pos0: ch.pos0,
        k_pos0: ch.lo,
        window: m.window,
        trunc_start: ch.trunc,
    };
    let kv = sc.kbuf.slice(ch.kb0 * row..(ch.kb0 + num_k) * row);
    swa.run(
        c.gpu,
        &range,
        &sc.q.slice(ch.tok0 * qd..(ch.tok0 + ch.n) * qd),
        &kv,
        &kv,
        scale,
        &mut sc.att.slice_mut(ch.tok0 * od..(ch.tok0 + ch.n) * od),
    )?;
    Ok(())
}

/// Decode SWA into `sc.att`: the step's rows written to the rings, then every token's window
/// through the rings with the paged kernel.
#[allow(clippy::too_many_arguments)]
fn swa_ring(
    c: &Ctx<'_>,
    rows: &GlobalRows<'_>,
    rings: &mut CudaSlice<bf16>,
    layer_off: usize,
    t: usize,
    ring_slots: &CudaSlice<i64>,
    scale: f32,
    sc: &mut Scratch,
) -> Result<(), BackendError> {
    let (g, k) = (c.gpu, c.k);
    let rl = &c.ring_layout;
    {
        let mut view = rings.slice_mut(layer_off..);
        // SAFETY: every slot was built by `ring_slot` for a ring the tiers handed out.
        unsafe {
            k.att
                .write_kv_unchecked(g, &sc.k, t, ring_slots, &mut view, rl)
        }?;
    }
    let view = rings.slice(layer_off..);
    c.attend(rows, &sc.q, &view, rl, scale, &mut sc.att, &mut sc.att_ws)
}

/// An encoder layer's own global attention: the step's rows also go to global layer
/// `gl_layer` of the pool, attended causally from position 0, and the output projection adds
/// the result to `sc.h`.
#[allow(clippy::too_many_arguments)]
fn own_global_attention(
    c: &Ctx<'_>,
    lw: &LayerWeights,
    pool: &mut CudaSlice<bf16>,
    gl_layer: usize,
    slots: &CudaSlice<i64>,
    rows: &GlobalRows<'_>,
    t: usize,
    scale: f32,
    sc: &mut Scratch,
) -> Result<(), BackendError> {
    let (g, k, m) = (c.gpu, c.k, c.m);
    let (hd, od) = (m.hidden, m.o_dim());
    let off = gl_layer * m.block_size * m.kv_row();
    {
        let mut view = pool.slice_mut(off..);
        // SAFETY: slots address blocks the tiers placed for the step's sequences.
        unsafe {
            k.att
                .write_kv_unchecked(g, &sc.k, t, slots, &mut view, &c.global_layout)
        }?;
    }
    c.global_attention(
        rows,
        &sc.q,
        &pool.slice(off..),
        scale,
        &mut sc.att,
        &mut sc.att_ws,
    )?;
    c.mark(Phase::Gemm)?;
    linear_bf16_beta(g, &sc.att, &lw.wo, &mut sc.h, t, hd, od, true)?;
    c.mark(Phase::Elementwise)
}

/// A decoder layer's cross-attention over the shared global KV layer, added to `sc.h`.
fn cross_attention(
    c: &Ctx<'_>,
    cw: &CrossWeights,
    rows: &GlobalRows<'_>,
    pool: &CudaSlice<bf16>,
    t: usize,
    scale: f32,
    sc: &mut Scratch,
) -> Result<(), BackendError> {
    let (g, k, m) = (c.gpu, c.k, c.m);
    let (hd, qd, od) = (m.hidden, m.q_dim(), m.o_dim());
    k.norm
        .run(g, &sc.h, &cw.norm, t, hd, m.norm_eps, &mut sc.xn)?;
    c.mark(Phase::Gemm)?;
    linear_bf16(g, &sc.xn, &cw.wq, &mut sc.q, t, qd, hd)?;
    let off = m.encoder_layers * m.block_size * m.kv_row();
    c.global_attention(
        rows,
        &sc.q,
        &pool.slice(off..),
        scale,
        &mut sc.att,
        &mut sc.att_ws,
    )?;
    c.mark(Phase::Gemm)?;
    linear_bf16_beta(g, &sc.att, &cw.wo, &mut sc.h, t, hd, od, true)?;
    c.mark(Phase::Elementwise)
}

/// Routed experts over `sc.xn` into `sc.moe_out`, then the shared expert. With
/// `c.padded_moe` the experts are sized on the device ([`moe_padded`]); otherwise the
/// per-expert row counts come back to the host (one small synchronous copy per layer) to size
/// each expert's GEMM.
fn moe(
    c: &Ctx<'_>,
    lw: &LayerWeights,
    layer: usize,
    t: usize,
    sc: &mut Scratch,
) -> Result<(), BackendError> {
    let (g, k, m) = (c.gpu, c.k, c.m);
    let (hd, e) = (m.hidden, m.experts);
    c.mark(Phase::Gemm)?;
    linear_bf16(g, &sc.xn, &lw.router, &mut sc.rl_bf, t, e, hd)?;
    c.mark(Phase::Routing)?;
    k.ops.to_f32(g, &sc.rl_bf, &mut sc.rl_f, t * e)?;
    if c.padded_moe {
        moe_padded(c, lw, t, sc)?;
    } else {
        moe_host_sized(c, lw, layer, t, sc)?;
    }
    shared_expert(c, lw, t, sc)
}

/// The routed experts sized by counts copied to the host: each expert's GEMM covers exactly
/// its rows of the packed expert-major layout.
fn moe_host_sized(
    c: &Ctx<'_>,
    lw: &LayerWeights,
    layer: usize,
    t: usize,
    sc: &mut Scratch,
) -> Result<(), BackendError> {
    let (g, k, m) = (c.gpu, c.k, c.m);
    let (hd, f) = (m.hidden, m.expert_ffn);
    k.router.route_into(g, &sc.rl_f, t, true, &mut sc.routing)?;
    let counts: Vec<i32> = g.stream.clone_dtoh(&sc.routing.counts)?;
    if let Some(log) = c.route_log {
        let mut log = log.borrow_mut();
        if log.len() <= layer {
            log.resize(layer + 1, vec![0; counts.len()]);
        }
        for (sum, &n) in log[layer].iter_mut().zip(&counts) {
            *sum += n.max(0) as u64;
        }
    }
    if t >= LANE_MIN_TOKENS && sc.lanes.is_empty() {
        for _ in 0..EXPERT_LANES {
            sc.lanes.push(g.on_new_stream()?);
        }
    }
    let lanes: &[GpuContext] = if t >= LANE_MIN_TOKENS { &sc.lanes } else { &[] };
    c.mark(Phase::Permute)?;
    k.router.gather(g, &sc.xn, &sc.routing, t, hd, &mut sc.xs)?;
    c.mark(Phase::Gemm)?;
    let rows: usize = counts.iter().map(|&n| n.max(0) as usize).sum();
    expert_gemms(
        g,
        lanes,
        &lw.experts,
        |e| &e.w_gate_up,
        &counts,
        &sc.xs,
        &mut sc.gu,
        2 * f,
        hd,
    )?;
    c.mark(Phase::Elementwise)?;
    k.ops.silu_mul(g, &sc.gu, &mut sc.act, rows, f)?;
    c.mark(Phase::Gemm)?;
    expert_gemms(
        g,
        lanes,
        &lw.experts,
        |e| &e.w_down,
        &counts,
        &sc.act,
        &mut sc.ys,
        hd,
        f,
    )?;
    c.mark(Phase::Permute)?;
    k.router
        .combine(g, &sc.ys, &sc.routing, t, hd, &mut sc.moe_out)?;
    Ok(())
}

/// One GEMM per expert over its `counts[e]` rows of the packed expert-major layout,
/// `y[rows of e] = x[rows of e] · w(e)ᵀ` (`n` outputs, `k` inputs per row). With `lanes` the
/// GEMMs go round-robin to the lanes' streams, which start after the compute stream's work so
/// far and which the compute stream then waits for; without, all run on the compute stream.
#[allow(clippy::too_many_arguments)]
fn expert_gemms(
    gpu: &GpuContext,
    lanes: &[GpuContext],
    experts: &[ExpertWeights],
    w: fn(&ExpertWeights) -> &CudaSlice<bf16>,
    counts: &[i32],
    x: &CudaSlice<bf16>,
    y: &mut CudaSlice<bf16>,
    n: usize,
    k: usize,
) -> Result<(), BackendError> {
    if !lanes.is_empty() {
        let fork = gpu.stream.record_event(None)?;
        for l in lanes {
            l.stream.wait(&fork)?;
        }
    }
    let mut off = 0usize;
    for (e, (ex, &cnt)) in experts.iter().zip(counts).enumerate() {
        let rows = cnt.max(0) as usize;
        if rows > 0 {
            let on = if lanes.is_empty() {
                gpu
            } else {
                &lanes[e % lanes.len()]
            };
            linear_bf16(
                on,
                &x.slice(off * k..(off + rows) * k),
                w(ex),
                &mut y.slice_mut(off * n..(off + rows) * n),
                rows,
                n,
                k,
            )?;
        }
        off += rows;
    }
    for l in lanes {
        gpu.stream.join(&l.stream)?;
    }
    Ok(())
}

/// The routed experts in the padded layout of [`PaddedMoe`] (which `sc.pad` must hold for `t`
/// tokens): routing, gather, expert GEMMs of `t` rows each, activation and combine all read
/// their sizes from the host-known `t`, never from the routing, so the layer issues without
/// waiting on the device. Unused rows are zero; the combine reads only routed ones.
fn moe_padded(
    c: &Ctx<'_>,
    lw: &LayerWeights,
    t: usize,
    sc: &mut Scratch,
) -> Result<(), BackendError> {
    let (g, k, m) = (c.gpu, c.k, c.m);
    let (hd, f, e) = (m.hidden, m.expert_ffn, m.experts);
    let Scratch {
        xn,
        rl_f,
        routing,
        moe_out,
        pad,
        ..
    } = sc;
    let p = pad
        .as_mut()
        .filter(|p| p.tokens >= t)
        .ok_or_else(|| BackendError::Plan("padded MoE buffers not sized for the step".into()))?;
    k.router
        .route_padded_into(g, rl_f, t, true, t, routing, &mut p.sorted)?;
    c.mark(Phase::Permute)?;
    k.router
        .gather_padded(g, xn, &p.sorted, e * t, hd, &mut p.xs)?;
    c.mark(Phase::Gemm)?;
    for (i, ex) in lw.experts.iter().enumerate() {
        let r0 = i * t;
        linear_bf16(
            g,
            &p.xs.slice(r0 * hd..(r0 + t) * hd),
            &ex.w_gate_up,
            &mut p.gu.slice_mut(r0 * 2 * f..(r0 + t) * 2 * f),
            t,
            2 * f,
            hd,
        )?;
    }
    c.mark(Phase::Elementwise)?;
    k.ops.silu_mul(g, &p.gu, &mut p.act, e * t, f)?;
    c.mark(Phase::Gemm)?;
    for (i, ex) in lw.experts.iter().enumerate() {
        let r0 = i * t;
        linear_bf16(
            g,
            &p.act.slice(r0 * f..(r0 + t) * f),
            &ex.w_down,
            &mut p.ys.slice_mut(r0 * hd..(r0 + t) * hd),
            t,
            hd,
            f,
        )?;
    }
    c.mark(Phase::Permute)?;
    k.router.combine(g, &p.ys, routing, t, hd, moe_out)?;
    Ok(())
}

/// The shared expert over every token of `sc.xn`, added to `sc.moe_out` (none when the model
/// has none).
fn shared_expert(
    c: &Ctx<'_>,
    lw: &LayerWeights,
    t: usize,
    sc: &mut Scratch,
) -> Result<(), BackendError> {
    let (g, k, m) = (c.gpu, c.k, c.m);
    let hd = m.hidden;
    if let Some(sh) = &lw.shared {
        // the shared expert over every token, added to the routed experts' output (the routed
        // buffers are free again: gu and act hold at least t x 2 x shared_ffn, see Scratch)
        let sf = m.shared_ffn;
        c.mark(Phase::Gemm)?;
        linear_bf16(g, &sc.xn, &sh.w_gate_up, &mut sc.gu, t, 2 * sf, hd)?;
        c.mark(Phase::Elementwise)?;
        k.ops.silu_mul(g, &sc.gu, &mut sc.act, t, sf)?;
        c.mark(Phase::Gemm)?;
        linear_bf16_beta(g, &sc.act, &sh.w_down, &mut sc.moe_out, t, hd, sf, true)?;
        c.mark(Phase::Elementwise)?;
    }
    Ok(())
}

/// Embeddings of `tokens` into `sc.h`.
fn embed(b: &CudaBackend, tokens: &[i32], sc: &mut Scratch) -> Result<(), BackendError> {
    if tokens.is_empty() {
        return Ok(());
    }
    let g = &*b.gpu;
    let ids = g.stream.clone_htod(tokens)?;
    let m = &b.cfg.model;
    b.k.ops
        .select_rows(g, &b.w.embed, m.vocab, tokens, &ids, &mut sc.h, m.hidden)?;
    Ok(())
}

/// Final norm, LM head and greedy tokens of batch rows `rows`.
fn logits(
    b: &mut CudaBackend,
    sc: &mut Scratch,
    t: usize,
    rows: &[i32],
) -> Result<(), BackendError> {
    if rows.is_empty() {
        return Ok(());
    }
    let g = b.gpu.clone();
    let m = b.cfg.model.clone();
    let s = &g.stream;
    b.k.norm.run(
        &g,
        &sc.h,
        &b.w.final_norm,
        t,
        m.hidden,
        m.norm_eps,
        &mut sc.xn,
    )?;
    let d_rows = s.clone_htod(rows)?;
    let mut sel = s.alloc_zeros::<bf16>(rows.len() * m.hidden)?;
    b.k.ops
        .select_rows(&g, &sc.xn, t, rows, &d_rows, &mut sel, m.hidden)?;
    let mut lg = s.alloc_zeros::<bf16>(rows.len() * m.vocab)?;
    linear_bf16(
        &g,
        &sel,
        &b.w.lm_head,
        &mut lg,
        rows.len(),
        m.vocab,
        m.hidden,
    )?;
    let mut lf = s.alloc_zeros::<f32>(rows.len() * m.vocab)?;
    b.k.ops.to_f32(&g, &lg, &mut lf, rows.len() * m.vocab)?;
    let mut ids = s.alloc_zeros::<i32>(rows.len())?;
    b.k.sampler.greedy(&g, &lf, rows.len(), m.vocab, &mut ids)?;
    b.mark_issued()?;
    b.last_tokens = s.clone_dtoh(&ids)?;
    if b.keep_logits {
        b.last_logits = s.clone_dtoh(&lf)?;
    }
    Ok(())
}

fn tables(per_seq: &[Vec<i32>]) -> BlockTables {
    let max_blocks = per_seq.iter().map(|v| v.len()).max().unwrap_or(0).max(1);
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

/// Ring table rows: logical block `i` of a sequence maps to ring block `ring * 2 + i % 2`.
fn ring_tables(m: &ModelShape, rings: &[u32], max_pos: usize) -> BlockTables {
    let nb = max_pos.div_ceil(m.block_size).max(1);
    let per: Vec<Vec<i32>> = rings
        .iter()
        .map(|&r| (0..nb).map(|i| (r as usize * 2 + i % 2) as i32).collect())
        .collect();
    tables(&per)
}

/// The shape rules a prefill plan must keep before the backend places anything.
pub(crate) fn check_prefill_plan(p: &PrefillPlan) -> Result<(), BackendError> {
    for c in &p.chunks {
        let total = c.prefix_tokens as usize + c.new_tokens as usize;
        if c.decoder_tokens as usize > total {
            return Err(BackendError::Plan(format!(
                "request {}: decoder replay of {} tokens exceeds its {} tokens",
                c.request.0, c.decoder_tokens, total
            )));
        }
    }
    Ok(())
}

pub(super) fn prefill(b: &mut CudaBackend, p: &PrefillPlan) -> Result<(), BackendError> {
    let blocks = place_prefill(b, p)?;
    let s = b.gpu.stream.clone();
    encode_prefill(b, p, &blocks)?;
    s.join(&b.copy)?;
    replay_decoder(b, p, &blocks)
}

/// Makes every chunk's sequence resident and issues the moves; returns the HBM blocks per
/// chunk.
fn place_prefill(b: &mut CudaBackend, p: &PrefillPlan) -> Result<Vec<Vec<u32>>, BackendError> {
    let bs = b.cfg.model.block_size;
    let mut moves = Moves::default();
    let mut seqs = Vec::new();
    check_prefill_plan(p)?;
    for c in &p.chunks {
        seqs.push((
            c.request.0,
            c.prefix_tokens as usize + c.new_tokens as usize,
        ));
    }
    // Sequences new to this backend with a cached prefix get it from the host tier (the
    // content is whatever the host blocks hold: the random model has no real prefix KV).
    let fresh: Vec<bool> = p
        .chunks
        .iter()
        .map(|c| !b.tiers.seqs.contains_key(&c.request.0))
        .collect();
    let region = b.region_for(false, p.engine.0)?;
    let blocks = b.place(&seqs, region, &mut moves)?;
    for (i, c) in p.chunks.iter().enumerate() {
        if fresh[i] && c.swap_in_bytes > 0 {
            let n = (c.prefix_tokens as usize).div_ceil(bs);
            for (j, &d) in blocks[i].iter().take(n).enumerate() {
                moves.swap_in.push(((j % b.cfg.host_blocks) as u32, d));
            }
        }
    }
    b.issue_moves(&moves)?;
    Ok(blocks)
}

/// Per token of a stack pass: its id, position and ring slot (-1 for rows that leave the
/// window before the step ends, so the ring keeps the window the next step needs).
#[derive(Default)]
struct TokenRows {
    tokens: Vec<i32>,
    positions: Vec<i32>,
    ring_slots: Vec<i64>,
}

/// The host side of a prefill's encoder pass over the chunks' new tokens.
#[derive(Default)]
struct EncoderInputs {
    rows: TokenRows,
    /// Pool slot of each token's row in every global layer.
    global_slots: Vec<i64>,
    chunks: Vec<SwaChunk>,
    /// Rows of `kbuf` the chunks' windows take (see [`kbuf_row`]).
    kbuf_rows: usize,
}

fn encoder_inputs(b: &CudaBackend, p: &PrefillPlan, blocks: &[Vec<u32>]) -> EncoderInputs {
    let m = &b.cfg.model;
    let bs = m.block_size;
    let mut inp = EncoderInputs::default();
    let r = &mut inp.rows;
    for (i, c) in p.chunks.iter().enumerate() {
        let (pp, n) = (c.prefix_tokens as usize, c.new_tokens as usize);
        let st = &b.tiers.seqs[&c.request.0];
        let ring = st.ring.expect("placed sequences have a ring");
        // The ring holds [P - W + 1, P) if it was written up to at least P and not wrapped
        // past it since; otherwise the window is truncated at P (encoder-side bounded replay).
        let valid = st.ring_valid_to;
        let trunc = if pp == 0 || (valid >= pp && valid - pp <= 2 * bs - m.window) {
            0
        } else {
            pp
        };
        let lo = trunc.max((pp + 1).saturating_sub(m.window));
        inp.chunks.push(SwaChunk {
            tok0: r.tokens.len(),
            n,
            pos0: pp,
            lo,
            trunc,
            ring,
            kb0: kbuf_row(&mut inp.kbuf_rows, lo, pp - lo + n, bs),
        });
        for j in 0..n {
            let pos = pp + j;
            r.tokens.push(b.token_id(c.request.0, pos));
            r.positions.push(pos as i32);
            r.ring_slots.push(if pos + m.window >= pp + n {
                ring_slot(m, ring, pos)
            } else {
                -1
            });
            let blk = blocks[i][pos / bs] as usize;
            inp.global_slots.push((blk * bs + pos % bs) as i64);
        }
    }
    inp
}

/// Query rows as uploaded for one of the kernels (see [`GlobalRows`]).
enum UploadedRows {
    Split(DeviceRows),
    Prefill(PrefillRows),
    Mla(MlaRows),
}

impl UploadedRows {
    fn as_global(&self) -> GlobalRows<'_> {
        match self {
            UploadedRows::Split(r) => GlobalRows::Split(r),
            UploadedRows::Prefill(r) => GlobalRows::Prefill(r),
            UploadedRows::Mla(r) => GlobalRows::Mla(r),
        }
    }
}

/// `rows` uploaded for the split kernels of the model's shape: the MLA kernel, or the GQA
/// split decode kernels.
fn upload_split(
    b: &CudaBackend,
    layout: &KvLayout,
    tables: &BlockTables,
    rows: &QueryRows,
) -> Result<UploadedRows, BackendError> {
    let g = &*b.gpu;
    Ok(match &b.k.mla {
        Some(mla) => UploadedRows::Mla(mla.upload(g, layout, tables, rows)?),
        None => UploadedRows::Split(b.k.att.upload(g, layout, tables, rows)?),
    })
}

/// Which layers a stack pass runs: the encoder's, each also writing its own global KV layer
/// at `global_slots`, or the decoder's, cross-attending to the shared one.
enum Stack<'a> {
    Encoder { global_slots: &'a CudaSlice<i64> },
    Decoder,
}

/// The device inputs every layer of a stack pass reads.
struct StackInputs<'a> {
    t: usize,
    /// The first layer's query and key projections are already in the scratch.
    first_projected: bool,
    pos: &'a CudaSlice<i32>,
    ring_slots: &'a CudaSlice<i64>,
    swa: Swa<'a>,
    cross: GlobalRows<'a>,
    /// Device-sized MoE ([`PaddedMoe`], which the scratch must hold for `t` tokens).
    padded_moe: bool,
}

/// The forward pass's view of the backend.
fn ctx(b: &CudaBackend, padded_moe: bool) -> Ctx<'_> {
    Ctx {
        gpu: &b.gpu,
        k: &b.k,
        m: &b.cfg.model,
        ring_layout: b.ring_layout(),
        global_layout: b.global_layout(),
        phases: b.phases.as_ref(),
        padded_moe,
        route_log: b.route_log.as_ref(),
    }
}

/// Runs every layer of `stack` over `inp.t` tokens of `sc.h`, in place.
fn run_stack(
    b: &mut CudaBackend,
    stack: &Stack<'_>,
    inp: &StackInputs<'_>,
    sc: &mut Scratch,
) -> Result<(), BackendError> {
    // built field by field (not with [`ctx`]): the layers below also borrow the rings and the
    // pool mutably
    let ctx = Ctx {
        gpu: &b.gpu,
        k: &b.k,
        m: &b.cfg.model,
        ring_layout: b.ring_layout(),
        global_layout: b.global_layout(),
        phases: b.phases.as_ref(),
        padded_moe: inp.padded_moe,
        route_log: b.route_log.as_ref(),
    };
    let (layers, first, own) = match stack {
        Stack::Encoder { global_slots } => (&b.w.encoder, 0, Some(*global_slots)),
        Stack::Decoder => (&b.w.decoder, b.cfg.model.encoder_layers, None),
    };
    for (l, lw) in layers.iter().enumerate() {
        layer(
            &ctx,
            lw,
            l == 0 && inp.first_projected,
            first + l,
            &mut b.rings,
            &mut b.pool,
            inp.t,
            inp.pos,
            inp.ring_slots,
            &inp.swa,
            Some(&Cross {
                rows: inp.cross,
                own: own.map(|s| (l, s)),
            }),
            sc,
        )?;
    }
    Ok(())
}

/// The shared global KV of the step's `t` tokens (global norm, then the KV projection),
/// written to the pool at `slots`. Prefill steps mark its phases when `marked`; decode steps
/// leave them to the last layer's mark.
fn write_global_kv(
    b: &mut CudaBackend,
    sc: &mut Scratch,
    t: usize,
    slots: &CudaSlice<i64>,
    marked: bool,
) -> Result<(), BackendError> {
    let g = b.gpu.clone();
    let m = b.cfg.model.clone();
    let gl = b.global_layout();
    let phases = if marked { b.phases.as_ref() } else { None };
    let mark = |p: Phase| phases.map_or(Ok(()), |l| l.mark(p));
    mark(Phase::Elementwise)?;
    b.k.norm.run(
        &g,
        &sc.h,
        &b.w.global_norm,
        t,
        m.hidden,
        m.norm_eps,
        &mut sc.xn,
    )?;
    mark(Phase::Gemm)?;
    linear_bf16(
        &g,
        &sc.xn,
        &b.w.w_global_kv,
        &mut sc.k,
        t,
        m.kv_row(),
        m.hidden,
    )?;
    mark(Phase::Elementwise)?;
    let off = b.global_layer_offset(m.encoder_layers);
    let mut view = b.pool.slice_mut(off..);
    // SAFETY: slots address blocks the tiers placed for these sequences.
    unsafe {
        b.k.att
            .write_kv_unchecked(&g, &sc.k, t, slots, &mut view, &gl)
    }?;
    Ok(())
}

/// The encoder over the chunks' new tokens, then the shared global KV of those tokens; every
/// chunk's ring is then valid up to the chunk's end.
fn encode_prefill(
    b: &mut CudaBackend,
    p: &PrefillPlan,
    blocks: &[Vec<u32>],
) -> Result<(), BackendError> {
    let inp = encoder_inputs(b, p, blocks);
    let mut sc = take_scratch(b, inp.rows.tokens.len(), inp.kbuf_rows)?;
    if !inp.rows.tokens.is_empty() {
        run_encoder(b, p, blocks, &inp, &mut sc)?;
    }
    b.scratch = Some(sc);
    Ok(())
}

/// The chunks' causal attention over prefix + chunk, uploaded for the tensor-core prefill
/// kernel whenever it takes the shape (always at the backend's head widths).
fn encoder_rows(
    b: &CudaBackend,
    p: &PrefillPlan,
    blocks: &[Vec<u32>],
) -> Result<UploadedRows, BackendError> {
    let mut enc_rows = QueryRows::default();
    let mut enc_tables = Vec::new();
    for (i, c) in p
        .chunks
        .iter()
        .enumerate()
        .filter(|(_, c)| c.new_tokens > 0)
    {
        for j in 0..c.new_tokens as usize {
            enc_rows.push(enc_tables.len(), 0, c.prefix_tokens as usize + j + 1);
        }
        enc_tables.push(blocks[i].iter().map(|&x| x as i32).collect::<Vec<_>>());
    }
    let enc_tables = tables(&enc_tables);
    let (g, gl) = (&*b.gpu, b.global_layout());
    Ok(match &b.k.prefill {
        Some(pk) => UploadedRows::Prefill(pk.upload(g, &gl, &enc_tables, &enc_rows)?),
        None => upload_split(b, &gl, &enc_tables, &enc_rows)?,
    })
}

fn run_encoder(
    b: &mut CudaBackend,
    p: &PrefillPlan,
    blocks: &[Vec<u32>],
    inp: &EncoderInputs,
    sc: &mut Scratch,
) -> Result<(), BackendError> {
    let s = b.gpu.stream.clone();
    embed(b, &inp.rows.tokens, sc)?;
    let d_pos = s.clone_htod(&inp.rows.positions)?;
    let t = inp.rows.tokens.len();
    // The first layer's norm and projections go to the device before the host builds and
    // uploads the attention rows, so that host work overlaps device work instead of leaving
    // the device idle at the start of the step.
    let first_projected = match b.w.encoder.first() {
        Some(lw) => {
            let c = ctx(b, false);
            project_qk(&c, lw, t, &d_pos, sc)?;
            c.mark(Phase::Setup)?;
            true
        }
        None => false,
    };
    let d_ring = s.clone_htod(&inp.rows.ring_slots)?;
    let d_global = s.clone_htod(&inp.global_slots)?;
    let enc_rows = encoder_rows(b, p, blocks)?;
    let swa_enc = swa_tiles(b, &inp.chunks, inp.kbuf_rows)?;
    // the encoder's global attention reads the cached prefix (swapped-in blocks)
    s.join(&b.copy)?;
    let stack = StackInputs {
        t,
        first_projected,
        pos: &d_pos,
        ring_slots: &d_ring,
        swa: Swa::Chunks(&inp.chunks, swa_enc.as_ref()),
        cross: enc_rows.as_global(),
        padded_moe: false,
    };
    let encoder = Stack::Encoder {
        global_slots: &d_global,
    };
    run_stack(b, &encoder, &stack, sc)?;
    // shared global KV of the new tokens (the decoder's)
    write_global_kv(b, sc, t, &d_global, true)?;
    for c in &p.chunks {
        let st = b.tiers.seqs.get_mut(&c.request.0).expect("placed");
        st.ring_valid_to = (c.prefix_tokens + c.new_tokens) as usize;
    }
    Ok(())
}

/// The host side of a prefill's decoder replay over the last `decoder_tokens` positions of
/// each chunk.
#[derive(Default)]
struct ReplayInputs {
    rows: TokenRows,
    chunks: Vec<SwaChunk>,
    kbuf_rows: usize,
    /// Cross-attention rows over each replaying sequence's whole global KV.
    query: QueryRows,
    tables: Vec<Vec<i32>>,
    /// The batch row of each replaying sequence's last token (its logits are sampled).
    last_rows: Vec<i32>,
}

fn replay_inputs(b: &CudaBackend, p: &PrefillPlan, blocks: &[Vec<u32>]) -> ReplayInputs {
    let m = &b.cfg.model;
    let mut inp = ReplayInputs::default();
    let r = &mut inp.rows;
    for (i, c) in p.chunks.iter().enumerate() {
        let n = c.decoder_tokens as usize;
        if n == 0 {
            continue;
        }
        let l_tot = (c.prefix_tokens + c.new_tokens) as usize;
        let start = l_tot - n;
        let ring = b.tiers.seqs[&c.request.0].ring.expect("placed");
        inp.chunks.push(SwaChunk {
            tok0: r.tokens.len(),
            n,
            pos0: start,
            lo: start,
            trunc: start,
            ring,
            kb0: kbuf_row(&mut inp.kbuf_rows, start, n, m.block_size),
        });
        for j in 0..n {
            let pos = start + j;
            r.tokens.push(b.token_id(c.request.0, pos));
            r.positions.push(pos as i32);
            r.ring_slots.push(if pos + m.window >= l_tot {
                ring_slot(m, ring, pos)
            } else {
                -1
            });
            inp.query.push(inp.tables.len(), 0, pos + 1);
        }
        inp.last_rows.push(r.tokens.len() as i32 - 1);
        inp.tables
            .push(blocks[i].iter().map(|&x| x as i32).collect::<Vec<_>>());
    }
    inp
}

/// The decoder replay of a prefill step, its greedy tokens, and the SWA state stored at the
/// end of prefill (SPEC §3 step 5).
fn replay_decoder(
    b: &mut CudaBackend,
    p: &PrefillPlan,
    blocks: &[Vec<u32>],
) -> Result<(), BackendError> {
    if let Some(l) = &b.phases {
        l.mark(Phase::Setup)?;
    }
    let inp = replay_inputs(b, p, blocks);
    let t = inp.rows.tokens.len();
    if t == 0 {
        return Ok(());
    }
    let g = b.gpu.clone();
    let s = g.stream.clone();
    let mut sc = take_scratch(b, t, inp.kbuf_rows)?;
    embed(b, &inp.rows.tokens, &mut sc)?;
    let d_pos = s.clone_htod(&inp.rows.positions)?;
    let d_ring = s.clone_htod(&inp.rows.ring_slots)?;
    let gl = b.global_layout();
    // cross-attention of the replayed tail over the whole global KV: the prefill kernel
    // when the replay has enough query tiles to fill the device, else the split kernels
    // (a short replay over a long prompt is decode-like)
    let per_seq = tables(&inp.tables);
    let dec_rows = match &b.k.prefill {
        Some(pk) if pk.fills_device(&inp.query) => {
            UploadedRows::Prefill(pk.upload(&g, &gl, &per_seq, &inp.query)?)
        }
        _ => upload_split(b, &gl, &per_seq, &inp.query)?,
    };
    let swa_dec = swa_tiles(b, &inp.chunks, inp.kbuf_rows)?;
    let stack = StackInputs {
        t,
        first_projected: false,
        pos: &d_pos,
        ring_slots: &d_ring,
        swa: Swa::Chunks(&inp.chunks, swa_dec.as_ref()),
        cross: dec_rows.as_global(),
        padded_moe: false,
    };
    run_stack(b, &Stack::Decoder, &stack, &mut sc)?;
    logits(b, &mut sc, t, &inp.last_rows)?;
    b.scratch = Some(sc);
    let mut moves = Moves::default();
    for c in p.chunks.iter().filter(|c| c.decoder_tokens > 0) {
        b.tiers.store_ring(c.request.0, &mut moves);
    }
    b.issue_moves(&moves)?;
    Ok(())
}

/// The host side of a decode step: every sequence's next token and its verified ones.
#[derive(Default)]
struct DecodeInputs {
    rows: TokenRows,
    global_slots: Vec<i64>,
    /// SWA rows of every query token over its window in the sequence's ring.
    ring_rows: QueryRows,
    rings: Vec<u32>,
    kv_lens: Vec<usize>,
    q_lens: Vec<usize>,
}

fn decode_inputs(
    b: &CudaBackend,
    d: &DecodePlan,
    verified: &[u32],
    blocks: &[Vec<u32>],
) -> DecodeInputs {
    let m = &b.cfg.model;
    let bs = m.block_size;
    let mut inp = DecodeInputs::default();
    let r = &mut inp.rows;
    for (i, s) in d.seqs.iter().enumerate() {
        let n = 1 + verified[i] as usize;
        let k0 = s.kv_tokens as usize;
        let ring = b.tiers.seqs[&s.request.0].ring.expect("placed");
        inp.rings.push(ring);
        for j in 0..n {
            let pos = k0 + j;
            r.tokens.push(b.token_id(s.request.0, pos));
            r.positions.push(pos as i32);
            r.ring_slots.push(ring_slot(m, ring, pos));
            inp.global_slots
                .push((blocks[i][pos / bs] as usize * bs + pos % bs) as i64);
            inp.ring_rows
                .push(i, (pos + 1).saturating_sub(m.window), pos + 1);
        }
        inp.kv_lens.push(k0 + n);
        inp.q_lens.push(n);
    }
    inp
}

/// Makes every decoding sequence resident for its next token and its verified ones (after
/// checking they fit the SWA ring) and issues the moves; returns the HBM blocks per sequence.
fn place_decode(
    b: &mut CudaBackend,
    d: &DecodePlan,
    verified: &[u32],
) -> Result<Vec<Vec<u32>>, BackendError> {
    let m = &b.cfg.model;
    if m.window + 1 + verified.iter().copied().max().unwrap_or(0) as usize > 2 * m.block_size {
        return Err(BackendError::Plan(
            "window + query tokens exceed the two-block SWA ring".into(),
        ));
    }
    let mut moves = Moves::default();
    let seqs: Vec<(u64, usize)> = d
        .seqs
        .iter()
        .zip(verified)
        .map(|(s, &v)| (s.request.0, s.kv_tokens as usize + 1 + v as usize))
        .collect();
    let region = b.region_for(true, d.engine.0)?;
    let blocks = b.place(&seqs, region, &mut moves)?;
    b.issue_moves(&moves)?;
    Ok(blocks)
}

pub(super) fn decode(
    b: &mut CudaBackend,
    d: &DecodePlan,
    verified: &[u32],
) -> Result<(), BackendError> {
    let blocks = place_decode(b, d, verified)?;
    let inp = decode_inputs(b, d, verified, &blocks);
    if inp.rows.tokens.is_empty() {
        return Ok(());
    }
    match b.cfg.decode_mode {
        DecodeMode::Eager => decode_eager(b, &blocks, &inp)?,
        DecodeMode::DeviceMoe | DecodeMode::Graph => device_decode::decode(b, &blocks, &inp)?,
    }
    for (s, &kv) in d.seqs.iter().zip(&inp.kv_lens) {
        if let Some(st) = b.tiers.seqs.get_mut(&s.request.0) {
            st.ring_valid_to = kv;
        }
    }
    Ok(())
}

/// A decode step issued launch by launch, MoE sized on the host, buffers allocated per step.
fn decode_eager(
    b: &mut CudaBackend,
    blocks: &[Vec<u32>],
    inp: &DecodeInputs,
) -> Result<(), BackendError> {
    let t = inp.rows.tokens.len();
    let g = b.gpu.clone();
    let s = g.stream.clone();
    let m = b.cfg.model.clone();
    let max_pos = inp.kv_lens.iter().copied().max().unwrap_or(1);
    let (rl, gl) = (b.ring_layout(), b.global_layout());
    let ring_tables = ring_tables(&m, &inp.rings, max_pos);
    let d_ring_rows = upload_split(b, &rl, &ring_tables, &inp.ring_rows)?;
    let per_seq: Vec<Vec<i32>> = blocks
        .iter()
        .map(|v| v.iter().map(|&x| x as i32).collect())
        .collect();
    let cross_rows = QueryRows::decode_verify(&inp.kv_lens, &inp.q_lens);
    let d_cross = upload_split(b, &gl, &tables(&per_seq), &cross_rows)?;
    let d_pos = s.clone_htod(&inp.rows.positions)?;
    let d_ring = s.clone_htod(&inp.rows.ring_slots)?;
    let d_global = s.clone_htod(&inp.global_slots)?;
    let mut sc = take_scratch(b, t, 0)?;
    embed(b, &inp.rows.tokens, &mut sc)?;
    s.join(&b.copy)?;
    let stack = StackInputs {
        t,
        first_projected: false,
        pos: &d_pos,
        ring_slots: &d_ring,
        swa: Swa::Ring(d_ring_rows.as_global()),
        cross: d_cross.as_global(),
        padded_moe: false,
    };
    let encoder = Stack::Encoder {
        global_slots: &d_global,
    };
    run_stack(b, &encoder, &stack, &mut sc)?;
    write_global_kv(b, &mut sc, t, &d_global, false)?;
    // the decoder restarts from the embeddings (see the model docs)
    embed(b, &inp.rows.tokens, &mut sc)?;
    run_stack(b, &Stack::Decoder, &stack, &mut sc)?;
    let all: Vec<i32> = (0..t as i32).collect();
    logits(b, &mut sc, t, &all)?;
    b.scratch = Some(sc);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use servelab_kernels::check::BF16_TOL;
    use servelab_kernels::gemm::linear_cpu;
    use servelab_kernels::testdata::{ErrorStats, random_bf16, rng};

    /// Routed-expert GEMMs spread over lanes give what the compute stream alone gives: each
    /// expert's rows (one expert with none) against the CPU product, on both paths.
    #[test]
    fn gpu_expert_gemms_on_lanes_match_the_cpu() {
        let Some(gpu) = servelab_kernels::gpu::gpu_or_skip() else {
            return;
        };
        // SAFETY: as in the backend: the only cross-stream uses below are the lanes', which
        // `expert_gemms` orders with explicit events.
        unsafe { gpu.ctx.disable_event_tracking() };
        let (n, k) = (48, 64);
        let counts = [3i32, 0, 5, 2, 7];
        let rows: usize = counts.iter().map(|&c| c as usize).sum();
        let mut r = rng(5);
        let x = random_bf16(&mut r, rows * k, 1.0);
        let ws: Vec<Vec<bf16>> = counts
            .iter()
            .map(|_| random_bf16(&mut r, n * k, 1.0))
            .collect();
        let s = &gpu.stream;
        let experts: Vec<ExpertWeights> = ws
            .iter()
            .map(|w| ExpertWeights {
                w_gate_up: s.clone_htod(w).unwrap(),
                w_down: s.clone_htod(w).unwrap(),
            })
            .collect();
        let mut want = Vec::new();
        let mut off = 0;
        for (w, &c) in ws.iter().zip(&counts) {
            let c = c as usize;
            want.extend(linear_cpu(&x[off * k..(off + c) * k], w, c, n, k));
            off += c;
        }
        let dx = s.clone_htod(&x).unwrap();
        let lanes: Vec<GpuContext> = (0..2).map(|_| gpu.on_new_stream().unwrap()).collect();
        for on in [&lanes[..0], &lanes[..]] {
            let mut y = s.clone_htod(&vec![bf16::NAN; rows * n]).unwrap();
            expert_gemms(
                &gpu,
                on,
                &experts,
                |e| &e.w_gate_up,
                &counts,
                &dx,
                &mut y,
                n,
                k,
            )
            .unwrap();
            let got: Vec<f64> = s
                .clone_dtoh(&y)
                .unwrap()
                .iter()
                .map(|v| v.to_f64())
                .collect();
            let e = ErrorStats::of(&got, &want);
            println!("{} lanes: rel_l2 {:.3e}", on.len(), e.rel_l2);
            assert!(e.rel_l2 < BF16_TOL, "{} lanes: {e:?}", on.len());
        }
    }

    #[test]
    fn kbuf_rows_start_blocks_at_the_window_offset() {
        let mut kb = 0;
        // a fresh prompt: window from position 0, 300 keys in 3 blocks
        assert_eq!(kbuf_row(&mut kb, 0, 300, 128), 0);
        assert_eq!(kb, 384);
        // a later chunk whose window starts at 200: offset 72 in a fresh block
        assert_eq!(kbuf_row(&mut kb, 200, 50, 128), 384 + 72);
        assert_eq!(kb, 512);
        // 72 + 100 keys cross into a second block
        assert_eq!(kbuf_row(&mut kb, 200, 100, 128), 512 + 72);
        assert_eq!(kb, 768);
    }
}
