//! The forward pass of prefill and decode plans (see the module docs of `backend`).

use cudarc::driver::CudaSlice;
use half::bf16;
use servelab_core::engine::plan::{DecodePlan, PrefillPlan};
use servelab_kernels::GpuContext;
use servelab_kernels::attention::{BlockTables, DeviceRows, KvLayout, QueryRows};
use servelab_kernels::gemm::{linear_bf16, linear_bf16_beta};
use servelab_kernels::swa::SwaRange;

use super::model::{LayerWeights, ModelShape};
use super::{BackendError, CudaBackend, Kernels, Moves};

/// Per-step activations, sized for `t` tokens.
struct Scratch {
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
        Ok(Self {
            h: s.alloc_zeros(t1 * m.hidden)?,
            xn: s.alloc_zeros(t1 * m.hidden)?,
            q: s.alloc_zeros(t1 * m.q_dim())?,
            k: s.alloc_zeros(t1 * m.kv_row())?,
            att: s.alloc_zeros(t1 * m.q_dim())?,
            rl_bf: s.alloc_zeros(t1 * m.experts)?,
            rl_f: s.alloc_zeros(t1 * m.experts)?,
            xs: s.alloc_zeros(tk * m.hidden)?,
            gu: s.alloc_zeros(tk * 2 * m.expert_ffn)?,
            act: s.alloc_zeros(tk * m.expert_ffn)?,
            ys: s.alloc_zeros(tk * m.hidden)?,
            moe_out: s.alloc_zeros(t1 * m.hidden)?,
            kbuf: s.alloc_zeros(kbuf_rows.max(1) * m.kv_row())?,
        })
    }
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
    Chunks(&'a [SwaChunk]),
    /// Decode: every token's window through the rings with the paged kernel.
    Ring(&'a DeviceRows),
}

/// Attention rows over a global KV layer: the encoder layer's own (`own` is its global layer
/// index and `slots` where this step's rows go) or the decoder's shared one.
struct Cross<'a> {
    rows: &'a DeviceRows,
    /// Encoder layers: (global layer, device slots of the new rows).
    own: Option<(usize, &'a CudaSlice<i64>)>,
}

struct Ctx<'a> {
    gpu: &'a GpuContext,
    k: &'a Kernels,
    m: &'a ModelShape,
    ring_layout: KvLayout,
    global_layout: KvLayout,
}

fn ring_slot(m: &ModelShape, ring: u32, pos: usize) -> i64 {
    let phys = ring as usize * 2 + (pos / m.block_size) % 2;
    (phys * m.block_size + pos % m.block_size) as i64
}

/// One transformer layer over `t` tokens of `sc.h`, in place.
#[allow(clippy::too_many_arguments)]
fn layer(
    c: &Ctx<'_>,
    lw: &LayerWeights,
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
    let (hd, qd, row) = (m.hidden, m.q_dim(), m.kv_row());
    let scale = 1.0 / (m.head_dim as f32).sqrt();
    let s = &g.stream;
    k.norm
        .run(g, &sc.h, &lw.attn_norm, t, hd, m.norm_eps, &mut sc.xn)?;
    linear_bf16(g, &sc.xn, &lw.wq, &mut sc.q, t, qd, hd)?;
    linear_bf16(g, &sc.xn, &lw.wk, &mut sc.k, t, row, hd)?;
    k.rope_q.run(g, &mut sc.q, pos)?;
    k.rope_k.run(g, &mut sc.k, pos)?;
    let layer_off = ring_layer * m.block_size * row;
    let rl = &c.ring_layout;
    match swa {
        Swa::Chunks(chunks) => {
            for ch in chunks.iter() {
                // the window before the chunk, from the ring, in runs inside one ring block
                let mut p = ch.lo;
                let mut dst = ch.kb0;
                while p < ch.pos0 {
                    let run = (ch.pos0 - p).min(m.block_size - p % m.block_size);
                    let src = layer_off
                        + ring_slot(m, ch.ring, p) as usize / m.block_size * rl.block_stride
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
            }
            let mut view = rings.slice_mut(layer_off..);
            // SAFETY: every slot was built by `ring_slot` for a ring the tiers handed out.
            unsafe {
                k.att
                    .write_kv_unchecked(g, &sc.k, t, ring_slots, &mut view, rl)
            }?;
            for ch in chunks.iter().filter(|c| c.n > 0) {
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
                k.swa.run(
                    g,
                    &range,
                    &sc.q.slice(ch.tok0 * qd..(ch.tok0 + ch.n) * qd),
                    &kv,
                    &kv,
                    scale,
                    &mut sc.att.slice_mut(ch.tok0 * qd..(ch.tok0 + ch.n) * qd),
                )?;
            }
        }
        Swa::Ring(rows) => {
            {
                let mut view = rings.slice_mut(layer_off..);
                // SAFETY: as above.
                unsafe {
                    k.att
                        .write_kv_unchecked(g, &sc.k, t, ring_slots, &mut view, rl)
                }?;
            }
            let tps = k.att.default_tokens_per_split(rows);
            let mut ws = k.att.workspace(g, rows, tps)?;
            let view = rings.slice(layer_off..);
            k.att
                .run(g, &sc.q, &view, rl, rows, tps, &mut ws, scale, &mut sc.att)?;
        }
    }
    linear_bf16_beta(g, &sc.att, &lw.wo, &mut sc.h, t, hd, qd, true)?;
    if let Some(Cross {
        rows,
        own: Some((gl_layer, slots)),
    }) = cross
    {
        // encoder: the same rows also go to this layer's global KV, attended causally from 0
        let off = gl_layer * m.block_size * row;
        {
            let mut view = pool.slice_mut(off..);
            // SAFETY: slots address blocks the tiers placed for the step's sequences.
            unsafe {
                k.att
                    .write_kv_unchecked(g, &sc.k, t, slots, &mut view, &c.global_layout)
            }?;
        }
        let tps = k.att.default_tokens_per_split(rows);
        let mut ws = k.att.workspace(g, rows, tps)?;
        let view = pool.slice(off..);
        k.att.run(
            g,
            &sc.q,
            &view,
            &c.global_layout,
            rows,
            tps,
            &mut ws,
            scale,
            &mut sc.att,
        )?;
        linear_bf16_beta(g, &sc.att, &lw.wo, &mut sc.h, t, hd, qd, true)?;
    }
    if let (Some(cw), Some(cr)) = (&lw.cross, cross) {
        k.norm
            .run(g, &sc.h, &cw.norm, t, hd, m.norm_eps, &mut sc.xn)?;
        linear_bf16(g, &sc.xn, &cw.wq, &mut sc.q, t, qd, hd)?;
        let tps = k.att.default_tokens_per_split(cr.rows);
        let mut ws = k.att.workspace(g, cr.rows, tps)?;
        let off = m.encoder_layers * m.block_size * row;
        k.att.run(
            g,
            &sc.q,
            &pool.slice(off..),
            &c.global_layout,
            cr.rows,
            tps,
            &mut ws,
            scale,
            &mut sc.att,
        )?;
        linear_bf16_beta(g, &sc.att, &cw.wo, &mut sc.h, t, hd, qd, true)?;
    }
    k.norm
        .run(g, &sc.h, &lw.ffn_norm, t, hd, m.norm_eps, &mut sc.xn)?;
    moe(c, lw, t, sc)?;
    k.ops.add(g, &mut sc.h, &sc.moe_out, t * hd)?;
    Ok(())
}

/// Routed experts over `sc.xn` into `sc.moe_out`. The per-expert row counts come back to the
/// host (one small synchronous copy per layer) to size each expert's GEMM.
fn moe(c: &Ctx<'_>, lw: &LayerWeights, t: usize, sc: &mut Scratch) -> Result<(), BackendError> {
    let (g, k, m) = (c.gpu, c.k, c.m);
    let (hd, f, e) = (m.hidden, m.expert_ffn, m.experts);
    linear_bf16(g, &sc.xn, &lw.router, &mut sc.rl_bf, t, e, hd)?;
    k.ops.to_f32(g, &sc.rl_bf, &mut sc.rl_f, t * e)?;
    let r = k.router.route(g, &sc.rl_f, t, true)?;
    let counts: Vec<i32> = g.stream.clone_dtoh(&r.counts)?;
    k.router.gather(g, &sc.xn, &r, t, hd, &mut sc.xs)?;
    let mut off = 0usize;
    for (ex, &cnt) in lw.experts.iter().zip(&counts) {
        let n = cnt.max(0) as usize;
        if n > 0 {
            linear_bf16(
                g,
                &sc.xs.slice(off * hd..(off + n) * hd),
                &ex.w_gate_up,
                &mut sc.gu.slice_mut(off * 2 * f..(off + n) * 2 * f),
                n,
                2 * f,
                hd,
            )?;
        }
        off += n;
    }
    k.ops.silu_mul(g, &sc.gu, &mut sc.act, off, f)?;
    let mut off = 0usize;
    for (ex, &cnt) in lw.experts.iter().zip(&counts) {
        let n = cnt.max(0) as usize;
        if n > 0 {
            linear_bf16(
                g,
                &sc.act.slice(off * f..(off + n) * f),
                &ex.w_down,
                &mut sc.ys.slice_mut(off * hd..(off + n) * hd),
                n,
                hd,
                f,
            )?;
        }
        off += n;
    }
    k.router.combine(g, &sc.ys, &r, t, hd, &mut sc.moe_out)?;
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

pub(super) fn prefill(b: &mut CudaBackend, p: &PrefillPlan) -> Result<(), BackendError> {
    let m = b.cfg.model.clone();
    let bs = m.block_size;
    let mut moves = Moves::default();
    let mut seqs = Vec::new();
    for c in &p.chunks {
        let total = c.prefix_tokens as usize + c.new_tokens as usize;
        if c.decoder_tokens as usize > total {
            return Err(BackendError::Plan(format!(
                "request {}: decoder replay of {} tokens exceeds its {} tokens",
                c.request.0, c.decoder_tokens, total
            )));
        }
        seqs.push((c.request.0, total));
    }
    // Sequences new to this backend with a cached prefix get it from the host tier (the
    // content is whatever the host blocks hold: the random model has no real prefix KV).
    let fresh: Vec<bool> = p
        .chunks
        .iter()
        .map(|c| !b.tiers.seqs.contains_key(&c.request.0))
        .collect();
    let blocks = b.place(&seqs, &mut moves)?;
    for (i, c) in p.chunks.iter().enumerate() {
        if fresh[i] && c.swap_in_bytes > 0 {
            let n = (c.prefix_tokens as usize).div_ceil(bs);
            for (j, &d) in blocks[i].iter().take(n).enumerate() {
                moves.swap_in.push(((j % b.cfg.host_blocks) as u32, d));
            }
        }
    }
    b.issue_moves(&moves)?;

    // ---- encoder over the new tokens
    let mut tokens = Vec::new();
    let mut positions = Vec::new();
    let mut ring_slots = Vec::new();
    let mut global_slots = Vec::new();
    let mut chunks = Vec::new();
    let mut kb = 0usize;
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
        chunks.push(SwaChunk {
            tok0: tokens.len(),
            n,
            pos0: pp,
            lo,
            trunc,
            ring,
            kb0: kb,
        });
        kb += pp - lo + n;
        for j in 0..n {
            let pos = pp + j;
            tokens.push(b.token_id(c.request.0, pos));
            positions.push(pos as i32);
            ring_slots.push(if pos + m.window >= pp + n {
                ring_slot(&m, ring, pos)
            } else {
                -1
            });
            let blk = blocks[i][pos / bs] as usize;
            global_slots.push((blk * bs + pos % bs) as i64);
        }
    }
    let t = tokens.len();
    let g = b.gpu.clone();
    let s = g.stream.clone();
    let mut sc = Scratch::new(&g, &m, t, kb)?;
    if t > 0 {
        embed(b, &tokens, &mut sc)?;
        let d_pos = s.clone_htod(&positions)?;
        let d_ring = s.clone_htod(&ring_slots)?;
        let d_global = s.clone_htod(&global_slots)?;
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
        let d_enc_rows =
            b.k.att
                .upload(&g, &b.global_layout(), &tables(&enc_tables), &enc_rows)?;
        // the encoder's global attention reads the cached prefix (swapped-in blocks)
        s.join(&b.copy)?;
        let ctx = Ctx {
            gpu: &g,
            k: &b.k,
            m: &m,
            ring_layout: b.ring_layout(),
            global_layout: b.global_layout(),
        };
        for (l, lw) in b.w.encoder.iter().enumerate() {
            layer(
                &ctx,
                lw,
                l,
                &mut b.rings,
                &mut b.pool,
                t,
                &d_pos,
                &d_ring,
                &Swa::Chunks(&chunks),
                Some(&Cross {
                    rows: &d_enc_rows,
                    own: Some((l, &d_global)),
                }),
                &mut sc,
            )?;
        }
        // shared global KV of the new tokens (the decoder's)
        b.k.norm.run(
            &g,
            &sc.h,
            &b.w.global_norm,
            t,
            m.hidden,
            m.norm_eps,
            &mut sc.xn,
        )?;
        linear_bf16(
            &g,
            &sc.xn,
            &b.w.w_global_kv,
            &mut sc.k,
            t,
            m.kv_row(),
            m.hidden,
        )?;
        let gl = b.global_layout();
        let off = b.global_layer_offset(m.encoder_layers);
        let mut view = b.pool.slice_mut(off..);
        // SAFETY: slots address blocks the tiers placed for these sequences.
        unsafe {
            b.k.att
                .write_kv_unchecked(&g, &sc.k, t, &d_global, &mut view, &gl)
        }?;
        for c in &p.chunks {
            let st = b.tiers.seqs.get_mut(&c.request.0).expect("placed");
            st.ring_valid_to = (c.prefix_tokens + c.new_tokens) as usize;
        }
    }
    s.join(&b.copy)?;

    // ---- decoder replay over the last `decoder_tokens` positions
    let mut tokens = Vec::new();
    let mut positions = Vec::new();
    let mut ring_slots = Vec::new();
    let mut dchunks = Vec::new();
    let mut rows = QueryRows::default();
    let mut per_seq = Vec::new();
    let mut last_rows = Vec::new();
    for (i, c) in p.chunks.iter().enumerate() {
        let r = c.decoder_tokens as usize;
        if r == 0 {
            continue;
        }
        let l_tot = (c.prefix_tokens + c.new_tokens) as usize;
        let start = l_tot - r;
        let ring = b.tiers.seqs[&c.request.0].ring.expect("placed");
        dchunks.push(SwaChunk {
            tok0: tokens.len(),
            n: r,
            pos0: start,
            lo: start,
            trunc: start,
            ring,
            kb0: tokens.len(),
        });
        for j in 0..r {
            let pos = start + j;
            tokens.push(b.token_id(c.request.0, pos));
            positions.push(pos as i32);
            ring_slots.push(if pos + m.window >= l_tot {
                ring_slot(&m, ring, pos)
            } else {
                -1
            });
            rows.push(per_seq.len(), 0, pos + 1);
        }
        last_rows.push(tokens.len() as i32 - 1);
        per_seq.push(blocks[i].iter().map(|&x| x as i32).collect::<Vec<_>>());
    }
    let t = tokens.len();
    if t > 0 {
        let mut sc = Scratch::new(&g, &m, t, t)?;
        embed(b, &tokens, &mut sc)?;
        let d_pos = s.clone_htod(&positions)?;
        let d_ring = s.clone_htod(&ring_slots)?;
        let gl = b.global_layout();
        let d_rows = b.k.att.upload(&g, &gl, &tables(&per_seq), &rows)?;
        let ctx = Ctx {
            gpu: &g,
            k: &b.k,
            m: &m,
            ring_layout: b.ring_layout(),
            global_layout: gl,
        };
        for (l, lw) in b.w.decoder.iter().enumerate() {
            layer(
                &ctx,
                lw,
                m.encoder_layers + l,
                &mut b.rings,
                &mut b.pool,
                t,
                &d_pos,
                &d_ring,
                &Swa::Chunks(&dchunks),
                Some(&Cross {
                    rows: &d_rows,
                    own: None,
                }),
                &mut sc,
            )?;
        }
        logits(b, &mut sc, t, &last_rows)?;
        // SWA state stored at the end of prefill (SPEC §3 step 5)
        let mut moves = Moves::default();
        for c in p.chunks.iter().filter(|c| c.decoder_tokens > 0) {
            b.tiers.store_ring(c.request.0, &mut moves);
        }
        b.issue_moves(&moves)?;
    }
    Ok(())
}

pub(super) fn decode(
    b: &mut CudaBackend,
    d: &DecodePlan,
    verified: &[u32],
) -> Result<(), BackendError> {
    let m = b.cfg.model.clone();
    let bs = m.block_size;
    if m.window + 1 + verified.iter().copied().max().unwrap_or(0) as usize > 2 * bs {
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
    let blocks = b.place(&seqs, &mut moves)?;
    b.issue_moves(&moves)?;
    let mut tokens = Vec::new();
    let mut positions = Vec::new();
    let mut ring_slots = Vec::new();
    let mut global_slots = Vec::new();
    let mut ring_rows = QueryRows::default();
    let mut rings = Vec::new();
    let (mut kv_lens, mut q_lens) = (Vec::new(), Vec::new());
    for (i, s) in d.seqs.iter().enumerate() {
        let n = 1 + verified[i] as usize;
        let k0 = s.kv_tokens as usize;
        let ring = b.tiers.seqs[&s.request.0].ring.expect("placed");
        rings.push(ring);
        for j in 0..n {
            let pos = k0 + j;
            tokens.push(b.token_id(s.request.0, pos));
            positions.push(pos as i32);
            ring_slots.push(ring_slot(&m, ring, pos));
            global_slots.push((blocks[i][pos / bs] as usize * bs + pos % bs) as i64);
            ring_rows.push(i, (pos + 1).saturating_sub(m.window), pos + 1);
        }
        kv_lens.push(k0 + n);
        q_lens.push(n);
    }
    let t = tokens.len();
    if t == 0 {
        return Ok(());
    }
    let g = b.gpu.clone();
    let s = g.stream.clone();
    let max_pos = kv_lens.iter().copied().max().unwrap_or(1);
    let rl = b.ring_layout();
    let gl = b.global_layout();
    let d_ring_rows =
        b.k.att
            .upload(&g, &rl, &ring_tables(&m, &rings, max_pos), &ring_rows)?;
    let per_seq: Vec<Vec<i32>> = blocks
        .iter()
        .map(|v| v.iter().map(|&x| x as i32).collect())
        .collect();
    let d_cross = b.k.att.upload(
        &g,
        &gl,
        &tables(&per_seq),
        &QueryRows::decode_verify(&kv_lens, &q_lens),
    )?;
    let d_pos = s.clone_htod(&positions)?;
    let d_ring = s.clone_htod(&ring_slots)?;
    let d_global = s.clone_htod(&global_slots)?;
    let mut sc = Scratch::new(&g, &m, t, 0)?;
    embed(b, &tokens, &mut sc)?;
    s.join(&b.copy)?;
    let ctx = Ctx {
        gpu: &g,
        k: &b.k,
        m: &m,
        ring_layout: rl,
        global_layout: gl,
    };
    for (l, lw) in b.w.encoder.iter().enumerate() {
        layer(
            &ctx,
            lw,
            l,
            &mut b.rings,
            &mut b.pool,
            t,
            &d_pos,
            &d_ring,
            &Swa::Ring(&d_ring_rows),
            Some(&Cross {
                rows: &d_cross,
                own: Some((l, &d_global)),
            }),
            &mut sc,
        )?;
    }
    b.k.norm.run(
        &g,
        &sc.h,
        &b.w.global_norm,
        t,
        m.hidden,
        m.norm_eps,
        &mut sc.xn,
    )?;
    linear_bf16(
        &g,
        &sc.xn,
        &b.w.w_global_kv,
        &mut sc.k,
        t,
        m.kv_row(),
        m.hidden,
    )?;
    {
        let off = b.global_layer_offset(m.encoder_layers);
        let mut view = b.pool.slice_mut(off..);
        // SAFETY: slots address blocks the tiers placed for these sequences.
        unsafe {
            b.k.att
                .write_kv_unchecked(&g, &sc.k, t, &d_global, &mut view, &gl)
        }?;
    }
    // the decoder restarts from the embeddings (see the model docs)
    embed(b, &tokens, &mut sc)?;
    let ctx = Ctx {
        gpu: &g,
        k: &b.k,
        m: &m,
        ring_layout: rl,
        global_layout: gl,
    };
    for (l, lw) in b.w.decoder.iter().enumerate() {
        layer(
            &ctx,
            lw,
            m.encoder_layers + l,
            &mut b.rings,
            &mut b.pool,
            t,
            &d_pos,
            &d_ring,
            &Swa::Ring(&d_ring_rows),
            Some(&Cross {
                rows: &d_cross,
                own: None,
            }),
            &mut sc,
        )?;
    }
    let all: Vec<i32> = (0..t as i32).collect();
    logits(b, &mut sc, t, &all)?;
    for (s, &kv) in d.seqs.iter().zip(&kv_lens) {
        if let Some(st) = b.tiers.seqs.get_mut(&s.request.0) {
            st.ring_valid_to = kv;
        }
    }
    Ok(())
}
