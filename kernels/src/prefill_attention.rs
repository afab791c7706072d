//! Causal prefill attention on tensor cores over the paged global KV (FlashAttention-2 style).
//!
//! The decode kernels of [`crate::attention`] treat each prefill query row like a decode row:
//! every group of at most 2–4 query tokens re-reads its whole key range. Here one CTA takes a
//! tile of `16 × warps` query rows (consecutive tokens of one sequence × the heads of one KV
//! head that share it), streams the sequence's keys once through shared memory in
//! `keys_per_tile`-key tiles (cached prefix and the chunk's own keys alike, through the block
//! table) and runs both products on `mma.sync.m16n8k16` with an online softmax. The rows, the
//! pool layout ([`KvLayout`]) and the semantics are those of [`crate::attention`]: row `i` sees
//! keys `[kv_start[i], kv_end[i])` of table row `table_row[i]`, values are the first `d_v`
//! elements of each key row.

use cudarc::driver::{CudaFunction, CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use half::bf16;

use crate::attention::{
    BlockTables, KvLayout, PagedAttentionShape, QueryGroup, QueryRows, paged_attention_cpu,
    random_tables,
};
use crate::check::{BF16_TOL, CheckResult};
use crate::error::{KernelError, ensure};
use crate::gpu::GpuContext;
use crate::testdata::{ErrorStats, random_bf16, rng};

pub(crate) const SRC: &str = include_str!("cuda/prefill_attention.cu");
/// Opt-in shared memory per block on sm_90 (227 KiB).
const MAX_DYNAMIC_SMEM: usize = 227 * 1024;
/// Widest head the kernel takes: the f32 output tile lives in registers (`d_v / 2` per lane).
pub const MAX_HEAD_DIM: usize = 256;

/// Tile parameters of the prefill kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PrefillTiles {
    /// Keys per shared-memory tile (a multiple of 16).
    pub keys_per_tile: usize,
    /// Warps per CTA, `16 * m_tiles` query rows each.
    pub warps: usize,
    /// 16-row MMA tiles per warp (1 or 2). With two, every K and V fragment a warp reads from
    /// shared memory feeds two MMAs instead of one: shared-memory reads per MMA, which bound
    /// the one-tile kernel, fall by a third, for twice the accumulator registers.
    #[serde(default = "one_m_tile")]
    pub m_tiles: usize,
    /// Key tiles in flight (cp.async ring depth), at least 2.
    pub stages: usize,
    /// CTAs per SM asked of the compiler (`__launch_bounds__`), which caps registers.
    pub min_blocks: usize,
}

/// Records written before `m_tiles` existed ran one tile per warp.
fn one_m_tile() -> usize {
    1
}

impl PrefillTiles {
    /// Query rows of one CTA.
    pub fn rows(&self) -> usize {
        16 * self.warps * self.m_tiles
    }

    /// Query heads of one KV head that a CTA takes together: the largest power of two that
    /// divides `group` while leaving at least 16 tokens per CTA (one warp's rows are then 16
    /// tokens of one head). Packing heads shortens the CTA's causal diagonal; the keys loaded
    /// per CTA serve `rows()` query rows either way.
    pub fn heads_per_cta(&self, shape: &PagedAttentionShape) -> usize {
        let mut h = 1;
        while shape.group.is_multiple_of(2 * h) && 2 * h * 16 <= self.rows() {
            h *= 2;
        }
        h
    }

    /// Consecutive query tokens of one CTA.
    pub fn tokens_per_cta(&self, shape: &PagedAttentionShape) -> usize {
        self.rows() / self.heads_per_cta(shape)
    }

    /// Shared row in bf16 elements: an odd number of 16-byte chunks, so the eight rows of one
    /// ldmatrix phase fall in distinct bank groups.
    pub fn row(d_qk: usize) -> usize {
        d_qk + if (d_qk / 8).is_multiple_of(2) { 8 } else { 0 }
    }

    /// Dynamic shared memory of one CTA: the Q tile and the key ring.
    pub fn smem_bytes(&self, shape: &PagedAttentionShape) -> usize {
        (self.rows() + self.stages * self.keys_per_tile) * Self::row(shape.d_qk) * 2
    }

    pub fn validate_for(&self, shape: &PagedAttentionShape) -> Result<(), KernelError> {
        ensure(
            self.keys_per_tile >= 16 && self.keys_per_tile.is_multiple_of(16),
            || {
                format!(
                    "keys_per_tile = {} must be a positive multiple of 16",
                    self.keys_per_tile
                )
            },
        )?;
        ensure((1..=16).contains(&self.warps), || {
            format!("warps = {} must be in 1..=16", self.warps)
        })?;
        ensure(self.stages >= 2, || "stages must be at least 2".into())?;
        // each lane holds `m_tiles * d_v / 2` f32 accumulators; past 128 they spill
        ensure(
            (1..=2).contains(&self.m_tiles) && self.m_tiles * shape.d_v <= MAX_HEAD_DIM,
            || {
                format!(
                    "m_tiles = {} must be 1 or 2, with m_tiles x d_v = {} at most {MAX_HEAD_DIM}",
                    self.m_tiles,
                    self.m_tiles * shape.d_v
                )
            },
        )?;
        ensure((1..=8).contains(&self.min_blocks), || {
            "min_blocks must be in 1..=8".into()
        })?;
        ensure(self.smem_bytes(shape) <= MAX_DYNAMIC_SMEM, || {
            format!(
                "{self:?} needs {} B of shared memory (limit {MAX_DYNAMIC_SMEM})",
                self.smem_bytes(shape)
            )
        })
    }
}

/// Whether the kernel takes `shape`: head widths multiples of 16 (the MMA's k), at most
/// [`MAX_HEAD_DIM`].
pub fn supports(shape: &PagedAttentionShape) -> bool {
    shape.validate().is_ok()
        && shape.d_qk.is_multiple_of(16)
        && shape.d_v.is_multiple_of(16)
        && shape.d_qk <= MAX_HEAD_DIM
}

/// Default tiles for `shape`, or `None` when the kernel does not take it: 32-key tiles. At
/// d <= 128, 8 warps of two 16-row MMA tiles each (256 query rows per CTA) in a three-deep ring,
/// one CTA per SM (255 registers, no spills): each K and V fragment read from shared memory
/// feeds two MMAs, and each key tile loaded serves twice the rows. Wider heads keep one MMA tile
/// per warp (128 rows, two stages, one CTA per SM), as two would not fit the registers.
/// Measured on the H200 (`prefill_bench`, kvh 4 x group 8 x d 128, 8,192 causal tokens; see
/// hw/measurements/2026-12-04-nvidia-h200-prefill-step.md): 251-261 TFLOP/s alone (four stages
/// 261-264, no faster in the whole step), against 246-250 for one MMA tile per warp at 128 rows
/// and two CTAs per SM, and the fastest whole step of the tiles tried in both runs.
pub fn default_tiles(shape: &PagedAttentionShape) -> Option<PrefillTiles> {
    if !supports(shape) {
        return None;
    }
    let small = shape.d_qk <= 128 && shape.d_v <= 128;
    let t = if small {
        PrefillTiles {
            keys_per_tile: 32,
            warps: 8,
            m_tiles: 2,
            stages: 3,
            min_blocks: 1,
        }
    } else {
        PrefillTiles {
            keys_per_tile: 32,
            warps: 8,
            m_tiles: 1,
            stages: 2,
            min_blocks: 1,
        }
    };
    t.validate_for(shape).ok().map(|_| t)
}

pub(crate) fn defines(shape: &PagedAttentionShape, t: &PrefillTiles) -> Vec<(&'static str, usize)> {
    let hpc = t.heads_per_cta(shape);
    vec![
        ("D_QK", shape.d_qk),
        ("D_V", shape.d_v),
        ("GROUP", shape.group),
        ("HPC", hpc),
        ("QTOK", t.rows() / hpc),
        ("BN", t.keys_per_tile),
        ("WARPS", t.warps),
        ("MT", t.m_tiles),
        ("STAGES", t.stages),
        ("MINB", t.min_blocks),
        ("ROWP", PrefillTiles::row(shape.d_qk)),
    ]
}

/// CPU reference in f64: the same semantics as [`paged_attention_cpu`] (each row's key range
/// through its block-table row), which it runs.
pub fn prefill_attention_cpu(
    shape: &PagedAttentionShape,
    layout: &KvLayout,
    q: &[bf16],
    kv: &[bf16],
    tables: &BlockTables,
    rows: &QueryRows,
    scale: f64,
) -> Result<Vec<f64>, KernelError> {
    paged_attention_cpu(shape, layout, q, kv, tables, rows, scale)
}

/// The query groups of one launch on the device (one CTA column each), heaviest first.
pub struct PrefillRows {
    row: CudaSlice<i32>,
    start: CudaSlice<i32>,
    end: CudaSlice<i32>,
    q0: CudaSlice<i32>,
    qn: CudaSlice<i32>,
    tables: CudaSlice<i32>,
    max_blocks: usize,
    groups: usize,
    num_q: usize,
    /// Tokens per group the rows were cut for (must match the kernel's tiles).
    tokens_per_group: usize,
}

impl PrefillRows {
    pub fn num_q(&self) -> usize {
        self.num_q
    }

    /// Query groups (CTAs per head chunk).
    pub fn groups(&self) -> usize {
        self.groups
    }
}

/// The compiled prefill kernel for one shape and tiles.
pub struct PrefillAttention {
    pub shape: PagedAttentionShape,
    tiles: PrefillTiles,
    func: CudaFunction,
    sm_count: usize,
}

impl PrefillAttention {
    /// The kernel with [`default_tiles`]; an error for shapes it does not take.
    pub fn new(gpu: &GpuContext, shape: PagedAttentionShape) -> Result<Self, KernelError> {
        let t = default_tiles(&shape).ok_or_else(|| {
            KernelError::shape(format!("the prefill kernel does not take {shape:?}"))
        })?;
        Self::with_tiles(gpu, shape, t)
    }

    pub fn with_tiles(
        gpu: &GpuContext,
        shape: PagedAttentionShape,
        tiles: PrefillTiles,
    ) -> Result<Self, KernelError> {
        ensure(supports(&shape), || {
            format!("the prefill kernel does not take {shape:?}")
        })?;
        tiles.validate_for(&shape)?;
        let func = gpu
            .functions(
                "prefill_attention",
                SRC,
                &defines(&shape, &tiles),
                &["prefill_attention"],
            )?
            .remove(0);
        func.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            tiles.smem_bytes(&shape) as i32,
        )?;
        let sm_count = gpu
            .ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map(|v| v.max(1) as usize)
            .unwrap_or(132);
        Ok(Self {
            shape,
            tiles,
            func,
            sm_count,
        })
    }

    pub fn tiles(&self) -> PrefillTiles {
        self.tiles
    }

    /// Registers per thread and local-memory (spill) bytes of the compiled kernel.
    pub fn resources(&self) -> (i32, i32) {
        use cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES;
        (
            self.func.num_regs().unwrap_or(-1),
            self.func
                .get_attribute(CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)
                .unwrap_or(-1),
        )
    }

    /// CTAs of a launch over `rows` (uploaded).
    pub fn ctas(&self, rows: &PrefillRows) -> usize {
        rows.groups * self.head_chunks_total()
    }

    /// CTAs a launch over `rows` would have (before upload).
    pub fn ctas_for(&self, rows: &QueryRows) -> usize {
        rows.groups(self.tiles.tokens_per_cta(&self.shape)).len() * self.head_chunks_total()
    }

    /// Whether a launch over `rows` has at least one CTA per SM. With fewer, the SMs left idle
    /// stay idle for the whole key range (the kernel does not split keys): short query runs over
    /// long prefixes (a decoder replay) go faster through the split decode kernels.
    pub fn fills_device(&self, rows: &QueryRows) -> bool {
        self.ctas_for(rows) >= self.sm_count
    }

    /// (KV head, head chunk) columns of the grid.
    fn head_chunks_total(&self) -> usize {
        self.shape.num_kv_heads * (self.shape.group / self.heads_per_cta())
    }

    fn heads_per_cta(&self) -> usize {
        self.tiles.heads_per_cta(&self.shape)
    }

    /// Validates `rows` against the tables and the pool (bad input is an error, not a fault),
    /// cuts them into groups of consecutive causal tokens (at most one CTA's tokens each) and
    /// uploads them, longest key range first so the heaviest CTAs start in the first wave.
    pub fn upload(
        &self,
        gpu: &GpuContext,
        layout: &KvLayout,
        tables: &BlockTables,
        rows: &QueryRows,
    ) -> Result<PrefillRows, KernelError> {
        let sh = &self.shape;
        layout.validate(sh)?;
        ensure(
            rows.kv_start.len() == rows.len() && rows.kv_end.len() == rows.len(),
            || "row vectors differ in length".into(),
        )?;
        ensure(
            tables.max_blocks > 0 && tables.entries.len().is_multiple_of(tables.max_blocks),
            || "block table is not rows x max_blocks".into(),
        )?;
        let tpg = self.tiles.tokens_per_cta(sh);
        let mut groups = rows.groups(tpg);
        for g in &groups {
            validate_group(sh, layout, tables, g)?;
        }
        groups.sort_by_key(|g| std::cmp::Reverse(g.kv_end - g.kv_start));
        let s = &gpu.stream;
        let col = |f: fn(&QueryGroup) -> i32| {
            let v: Vec<i32> = groups.iter().map(f).collect();
            if v.is_empty() { vec![0] } else { v }
        };
        let entries = if tables.entries.is_empty() {
            vec![0]
        } else {
            tables.entries.clone()
        };
        Ok(PrefillRows {
            row: s.clone_htod(&col(|g| g.table_row))?,
            start: s.clone_htod(&col(|g| g.kv_start))?,
            end: s.clone_htod(&col(|g| g.kv_end))?,
            q0: s.clone_htod(&col(|g| g.first_row))?,
            qn: s.clone_htod(&col(|g| g.len))?,
            tables: s.clone_htod(&entries)?,
            max_blocks: tables.max_blocks,
            groups: groups.len(),
            num_q: rows.len(),
            tokens_per_group: tpg,
        })
    }

    /// out `[num_q, num_heads, d_v]` = causal attention of `q` `[num_q, num_heads, d_qk]` over
    /// the pool `kv` (rows as uploaded).
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        gpu: &GpuContext,
        q: &CudaSlice<bf16>,
        kv: &CudaView<'_, bf16>,
        layout: &KvLayout,
        rows: &PrefillRows,
        scale: f32,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), KernelError> {
        self.run_window(gpu, q, kv, layout, rows, scale, None, out)
    }

    /// [`Self::run`] with a sliding window: a row whose keys end at `e` sees only
    /// `[max(kv_start, e - window), e)` (`None`: no window).
    #[allow(clippy::too_many_arguments)]
    pub fn run_window(
        &self,
        gpu: &GpuContext,
        q: &CudaSlice<bf16>,
        kv: &CudaView<'_, bf16>,
        layout: &KvLayout,
        rows: &PrefillRows,
        scale: f32,
        window: Option<usize>,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), KernelError> {
        let sh = &self.shape;
        let window = self.check_run_window(q, kv, layout, rows, window, out)?;
        if rows.groups == 0 {
            return Ok(());
        }
        let (block_stride, row_stride) = (layout.block_stride as i64, layout.row_stride as i32);
        let (max_blocks, kvh, bs) = (
            rows.max_blocks as i32,
            sh.num_kv_heads as i32,
            sh.block_size as i32,
        );
        let chunks = sh.group / self.heads_per_cta();
        let cfg = LaunchConfig {
            grid_dim: (rows.groups as u32, (sh.num_kv_heads * chunks) as u32, 1),
            block_dim: ((self.tiles.warps * 32) as u32, 1, 1),
            shared_mem_bytes: self.tiles.smem_bytes(sh) as u32,
        };
        let mut b = gpu.stream.launch_builder(&self.func);
        b.arg(q)
            .arg(kv)
            .arg(&rows.tables)
            .arg(&max_blocks)
            .arg(&rows.row)
            .arg(&rows.start)
            .arg(&rows.end)
            .arg(&rows.q0)
            .arg(&rows.qn)
            .arg(&block_stride)
            .arg(&row_stride)
            .arg(&kvh)
            .arg(&bs)
            .arg(&scale)
            .arg(&window)
            .arg(out);
        // SAFETY: buffer lengths checked above; every block id a group reaches was checked on
        // upload against a pool of `layout.num_blocks` blocks.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// The window, the layout and the sizes of `q`, `out` and `kv` fit `rows`, cut for these
    /// tiles; returns the window as the kernel takes it (`i32::MAX`: none).
    fn check_run_window(
        &self,
        q: &CudaSlice<bf16>,
        kv: &CudaView<'_, bf16>,
        layout: &KvLayout,
        rows: &PrefillRows,
        window: Option<usize>,
        out: &CudaSlice<bf16>,
    ) -> Result<i32, KernelError> {
        let sh = &self.shape;
        ensure(window != Some(0), || "window must be positive".into())?;
        let window = window.map_or(i32::MAX, |w| w.min(i32::MAX as usize) as i32);
        layout.validate(sh)?;
        ensure(q.len() >= rows.num_q * sh.num_heads() * sh.d_qk, || {
            "q is too short".into()
        })?;
        ensure(out.len() >= rows.num_q * sh.num_heads() * sh.d_v, || {
            "out is too short".into()
        })?;
        ensure(kv.len() >= layout.min_len(sh), || {
            "kv view is shorter than the layout".into()
        })?;
        ensure(
            rows.tokens_per_group == self.tiles.tokens_per_cta(sh),
            || {
                format!(
                    "rows were cut for {} tokens per CTA, the tiles take {}: upload again",
                    rows.tokens_per_group,
                    self.tiles.tokens_per_cta(sh)
                )
            },
        )?;
        Ok(window)
    }
}

/// One group's table row, key range and every block it reaches.
fn validate_group(
    shape: &PagedAttentionShape,
    layout: &KvLayout,
    tables: &BlockTables,
    g: &QueryGroup,
) -> Result<(), KernelError> {
    crate::attention::validate_key_range(
        g.first_row as usize,
        (g.table_row, g.kv_start, g.kv_end),
        shape,
        layout,
        tables,
    )
}

/// Prefill chunks `(prefix, chunk)` of several sequences in one launch: sequence `i` is table
/// row `i`, its chunk's token `j` sees keys `[0, prefix + j + 1)`.
pub fn chunk_rows(chunks: &[(usize, usize)]) -> QueryRows {
    let mut r = QueryRows::default();
    for (i, &(prefix, n)) in chunks.iter().enumerate() {
        for j in 0..n {
            r.push(i, 0, prefix + j + 1);
        }
    }
    r
}

/// One GPU check: `chunks` of several sequences over random block tables against the CPU
/// reference.
fn check_case(
    gpu: &GpuContext,
    seed: u64,
    shape: PagedAttentionShape,
    tiles: Option<PrefillTiles>,
    chunks: &[(usize, usize)],
    window: Option<usize>,
) -> Result<CheckResult, KernelError> {
    let mut r = rng(seed);
    let bs = shape.block_size;
    let max_blocks = chunks
        .iter()
        .map(|&(p, n)| (p + n).div_ceil(bs))
        .max()
        .unwrap_or(1)
        .max(1);
    // a pool with spare blocks, dealt out at random: tables are not the identity
    let num_blocks = chunks.len() * max_blocks + 3;
    let tables = random_tables(seed, chunks.len(), max_blocks, num_blocks);
    let rows = chunk_rows(chunks);
    let layout = KvLayout::packed(&shape, num_blocks);
    let kv = random_bf16(&mut r, layout.min_len(&shape), 1.0);
    let q = random_bf16(&mut r, rows.len() * shape.num_heads() * shape.d_qk, 1.0);
    let scale = 1.0 / (shape.d_qk as f64).sqrt();
    // the reference sees the window as each row's own key start
    let mut ref_rows = rows.clone();
    if let Some(w) = window {
        for (s, &e) in ref_rows.kv_start.iter_mut().zip(&rows.kv_end) {
            *s = (*s).max(e - w as i32);
        }
    }
    let reference = prefill_attention_cpu(&shape, &layout, &q, &kv, &tables, &ref_rows, scale)?;
    let att = match tiles {
        Some(t) => PrefillAttention::with_tiles(gpu, shape, t)?,
        None => PrefillAttention::new(gpu, shape)?,
    };
    let d_rows = att.upload(gpu, &layout, &tables, &rows)?;
    let (dq, dkv) = (gpu.stream.clone_htod(&q)?, gpu.stream.clone_htod(&kv)?);
    // Poison the output so unwritten elements show up as NaN.
    let mut out = gpu.stream.clone_htod(&vec![bf16::NAN; reference.len()])?;
    att.run_window(
        gpu,
        &dq,
        &dkv.as_view(),
        &layout,
        &d_rows,
        scale as f32,
        window,
        &mut out,
    )?;
    let got: Vec<f64> = gpu
        .stream
        .clone_dtoh(&out)?
        .iter()
        .map(|v| v.to_f64())
        .collect();
    let detail = case_detail(&shape, &att.tiles(), chunks, window);
    Ok(CheckResult::from_stats(
        "prefill_attention",
        detail,
        ErrorStats::of(&got, &reference),
        BF16_TOL,
    ))
}

/// The description of one check case: the shape, the tiles, the chunks and the window.
fn case_detail(
    shape: &PagedAttentionShape,
    t: &PrefillTiles,
    chunks: &[(usize, usize)],
    window: Option<usize>,
) -> String {
    format!(
        "kvh={} group={} d_qk={} d_v={} block {} tiles {}x{} keys ({} warps x {} MMA tiles, {} heads x {} tokens per CTA, {} stages) chunks (prefix, tokens) {chunks:?}{}",
        shape.num_kv_heads,
        shape.group,
        shape.d_qk,
        shape.d_v,
        shape.block_size,
        t.rows(),
        t.keys_per_tile,
        t.warps,
        t.m_tiles,
        t.heads_per_cta(shape),
        t.tokens_per_cta(shape),
        t.stages,
        match window {
            Some(w) => format!(" window {w}"),
            None => String::new(),
        }
    )
}

pub fn check_gpu(gpu: &GpuContext, seed: u64) -> Result<Vec<CheckResult>, KernelError> {
    let s = |num_kv_heads, group, d_qk, d_v, block_size| PagedAttentionShape {
        num_kv_heads,
        group,
        d_qk,
        d_v,
        block_size,
    };
    // prefix 0, ragged chunk lengths (not multiples of any tile), a single token, a prefix
    // that ends inside a block; several sequences share each launch
    let mixed: &[(usize, usize)] = &[(0, 200), (261, 37), (128, 1), (5, 130)];
    /// (shape, tiles (default when `None`), (prefix, chunk tokens) per sequence, window)
    type Case<'a> = (
        PagedAttentionShape,
        Option<PrefillTiles>,
        &'a [(usize, usize)],
        Option<usize>,
    );
    let tiles = |keys_per_tile, warps, m_tiles, stages, min_blocks| {
        Some(PrefillTiles {
            keys_per_tile,
            warps,
            m_tiles,
            stages,
            min_blocks,
        })
    };
    let cases: Vec<Case<'_>> = vec![
        (s(2, 4, 128, 128, 128), None, mixed, None),
        (s(2, 4, 128, 128, 128), None, &[(0, 77)], None),
        (s(2, 4, 128, 128, 128), None, &[(300, 160), (0, 33)], None),
        // 8 heads per KV head: 32 tokens per CTA
        (s(1, 8, 128, 128, 128), None, mixed, None),
        // 16-token blocks: every key tile spans several blocks
        (s(2, 2, 128, 128, 16), None, mixed, None),
        // a group with no power-of-two factor: one head per CTA, 256 tokens
        (s(1, 3, 64, 64, 32), None, mixed, None),
        // keys wider than values
        (s(1, 4, 192, 128, 128), None, &[(70, 90), (0, 140)], None),
        (s(2, 2, 256, 256, 128), None, &[(0, 150), (200, 45)], None),
        // other tiles, one 16-row MMA tile per warp: 8 warps (128 rows), 4 warps (64 rows)
        // with a deeper ring, 64- and 128-key tiles
        (s(2, 4, 128, 128, 128), tiles(32, 8, 1, 3, 2), mixed, None),
        (s(2, 4, 128, 128, 128), tiles(32, 4, 1, 3, 2), mixed, None),
        (s(2, 4, 128, 128, 128), tiles(64, 8, 1, 2, 1), mixed, None),
        (s(2, 4, 128, 128, 64), tiles(128, 8, 1, 2, 1), mixed, None),
        // two MMA tiles per warp at 4 warps (128 rows, 32 tokens of 4 heads), 16-key tiles, and
        // one head per CTA, where a warp's two tiles are different tokens
        (s(2, 4, 128, 128, 128), tiles(32, 4, 2, 3, 2), mixed, None),
        (s(1, 8, 128, 128, 128), tiles(16, 4, 2, 4, 2), mixed, None),
        (s(1, 3, 64, 64, 32), tiles(32, 4, 2, 2, 2), mixed, None),
        // sliding windows: the backend's 128, and one that is no multiple of the tile
        (s(2, 4, 128, 128, 128), None, mixed, Some(128)),
        (
            s(1, 8, 64, 64, 32),
            tiles(64, 8, 1, 2, 1),
            &[(0, 300), (90, 41)],
            Some(50),
        ),
        (
            s(1, 8, 64, 64, 32),
            tiles(32, 4, 2, 2, 2),
            &[(0, 300), (90, 41)],
            Some(50),
        ),
    ];
    cases
        .into_iter()
        .enumerate()
        .map(|(i, (shape, tiles, chunks, window))| {
            check_case(gpu, seed + i as u64, shape, tiles, chunks, window)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::gpu_or_skip;

    fn shape(group: usize, d: usize) -> PagedAttentionShape {
        PagedAttentionShape {
            num_kv_heads: 2,
            group,
            d_qk: d,
            d_v: d,
            block_size: 128,
        }
    }

    #[test]
    fn ctas_pack_the_heads_that_share_a_kv_head() {
        let t = default_tiles(&shape(4, 128)).unwrap();
        // 8 warps of two 16-row MMA tiles each
        assert_eq!(
            (t.rows(), t.warps, t.m_tiles, t.keys_per_tile, t.stages),
            (256, 8, 2, 32, 3)
        );
        assert_eq!(t.min_blocks, 1);
        assert_eq!(t.heads_per_cta(&shape(4, 128)), 4);
        assert_eq!(t.tokens_per_cta(&shape(4, 128)), 64);
        assert_eq!(t.heads_per_cta(&shape(8, 128)), 8);
        assert_eq!(t.tokens_per_cta(&shape(8, 128)), 32);
        let one = PrefillTiles { m_tiles: 1, ..t };
        assert_eq!(one.rows(), 128);
        // at most 8 heads, so a warp's 16 rows are 16 tokens of one head
        assert_eq!(one.heads_per_cta(&shape(16, 128)), 8);
        assert_eq!(one.heads_per_cta(&shape(12, 128)), 4);
        assert_eq!(one.heads_per_cta(&shape(3, 128)), 1);
        assert_eq!(one.tokens_per_cta(&shape(3, 128)), 128);
        let small = PrefillTiles { warps: 2, ..one };
        assert_eq!(small.heads_per_cta(&shape(8, 128)), 2);
        // two MMA tiles per warp double the rows, and the heads packed with them
        let two = PrefillTiles { warps: 2, ..t };
        assert_eq!((two.rows(), two.heads_per_cta(&shape(8, 128))), (64, 4));
    }

    #[test]
    fn shapes_and_tiles_are_checked() {
        assert!(default_tiles(&shape(4, 128)).is_some());
        assert_eq!(default_tiles(&shape(4, 256)).unwrap().min_blocks, 1);
        assert!(default_tiles(&shape(4, 120)).is_none());
        assert!(default_tiles(&shape(4, 512)).is_none());
        let t = default_tiles(&shape(4, 128)).unwrap();
        // Q tile 256 rows + 3 x 32 keys, rows of 136 bf16
        assert_eq!(t.smem_bytes(&shape(4, 128)), (256 + 96) * 136 * 2);
        assert_eq!(PrefillTiles::row(192), 200);
        assert_eq!(PrefillTiles::row(64), 72);
        let bad = PrefillTiles {
            keys_per_tile: 24,
            ..t
        };
        assert!(bad.validate_for(&shape(4, 128)).is_err());
        // two MMA tiles per warp hold 2 x d_v / 2 accumulators per lane: not at d_v 256
        let wide = default_tiles(&shape(4, 256)).unwrap();
        assert_eq!(wide.m_tiles, 1);
        assert!(
            PrefillTiles { m_tiles: 2, ..wide }
                .validate_for(&shape(4, 256))
                .is_err()
        );
        assert!(
            PrefillTiles { m_tiles: 3, ..t }
                .validate_for(&shape(4, 64))
                .is_err()
        );
        assert!(
            PrefillTiles { m_tiles: 0, ..t }
                .validate_for(&shape(4, 64))
                .is_err()
        );
        let huge = PrefillTiles {
            stages: 12,
            m_tiles: 1,
            ..t
        };
        assert!(huge.validate_for(&shape(4, 256)).is_err());
    }

    #[test]
    fn chunk_rows_are_causal_per_sequence() {
        let r = chunk_rows(&[(3, 2), (0, 3)]);
        assert_eq!(r.table_row, vec![0, 0, 1, 1, 1]);
        assert_eq!(r.kv_end, vec![4, 5, 1, 2, 3]);
        let g = r.groups(2);
        let lens: Vec<i32> = g.iter().map(|g| g.len).collect();
        assert_eq!(lens, vec![2, 2, 1]);
    }

    #[test]
    fn cpu_reference_is_causal() {
        // one KV head, one query head, d 16: key t has value e_t (the t-th unit vector) and
        // zero scores, so row j's output is the mean of e_0..e_j
        let shape = PagedAttentionShape {
            num_kv_heads: 1,
            group: 1,
            d_qk: 16,
            d_v: 16,
            block_size: 4,
        };
        let layout = KvLayout::packed(&shape, 2);
        let mut kv = vec![bf16::ZERO; layout.min_len(&shape)];
        for t in 0..8 {
            kv[t * 16 + t] = bf16::ONE;
        }
        let tables = BlockTables {
            max_blocks: 2,
            entries: vec![0, 1],
        };
        let rows = chunk_rows(&[(2, 3)]);
        let q = vec![bf16::ZERO; 3 * 16];
        let out = prefill_attention_cpu(&shape, &layout, &q, &kv, &tables, &rows, 1.0).unwrap();
        for (j, row) in out.chunks(16).enumerate() {
            let n = 2 + j + 1;
            for (t, &x) in row.iter().enumerate() {
                let want = if t < n { 1.0 / n as f64 } else { 0.0 };
                assert!((x - want).abs() < 1e-12, "row {j} dim {t}: {x} vs {want}");
            }
        }
    }

    #[test]
    fn gpu_matches_cpu() {
        let Some(gpu) = gpu_or_skip() else { return };
        crate::check::assert_all_passed(&check_gpu(&gpu, 21).unwrap());
    }

    /// Bad rows are errors on upload, never out-of-pool reads.
    #[test]
    fn gpu_rejects_rows_outside_the_pool() {
        let Some(gpu) = gpu_or_skip() else { return };
        let sh = shape(4, 128);
        let att = PrefillAttention::new(&gpu, sh).unwrap();
        let layout = KvLayout::packed(&sh, 2);
        let tables = BlockTables {
            max_blocks: 2,
            entries: vec![0, 7],
        };
        let err = att
            .upload(&gpu, &layout, &tables, &chunk_rows(&[(100, 60)]))
            .err()
            .expect("block 7 is outside a pool of 2");
        assert!(err.to_string().contains("block 7"), "{err}");
    }
}
