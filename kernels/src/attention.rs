//! Paged attention over 128-token blocks of compressed global KV, for decode and for prefill
//! chunks over a cached prefix.
//!
//! The KV pool holds one latent row per token and KV head (`d_qk` wide; values are its first
//! `d_v` elements, MLA's absorbed form). Each query row names a block-table row and the key
//! range `[kv_start, kv_end)` it sees: a decode row sees `[0, len)`, a prefill token at
//! position `p` sees `[0, p + 1)`. Key ranges are split across warps and merged afterwards.

use cudarc::driver::{CudaFunction, CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};
use half::bf16;

use crate::check::{BF16_TOL, CheckResult};
use crate::error::{KernelError, ensure};
use crate::gpu::{GpuContext, lane_split};
use crate::testdata::{ErrorStats, random_bf16, rng};

const SRC: &str = include_str!("cuda/paged_attention.cu");
const TILED_SRC: &str = include_str!("cuda/paged_attention_tiled.cu");
const MMA_SRC: &str = include_str!("cuda/paged_attention_mma.cu");
/// Opt-in shared memory per block on sm_90 (227 KiB).
const MAX_DYNAMIC_SMEM: usize = 227 * 1024;
const WARPS: usize = 4;
const UNROLL: usize = 2;
const REDUCE_THREADS: u32 = 128;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct PagedAttentionShape {
    pub num_kv_heads: usize,
    /// Query heads per KV head.
    pub group: usize,
    /// Row width (keys); a multiple of 8.
    pub d_qk: usize,
    /// Value width: the first `d_v` elements of each row.
    pub d_v: usize,
    /// Tokens per KV block (128 in the served system).
    pub block_size: usize,
}

impl PagedAttentionShape {
    pub fn num_heads(&self) -> usize {
        self.num_kv_heads * self.group
    }

    pub fn validate(&self) -> Result<(), KernelError> {
        ensure(self.num_kv_heads > 0 && self.group > 0, || {
            "num_kv_heads and group must be positive".into()
        })?;
        ensure(self.d_qk > 0 && self.d_qk.is_multiple_of(8), || {
            format!("d_qk = {} must be a positive multiple of 8", self.d_qk)
        })?;
        ensure(self.d_v > 0 && self.d_v <= self.d_qk, || {
            format!("d_v = {} must be in 1..=d_qk", self.d_v)
        })?;
        ensure(self.block_size > 0, || "block_size must be positive".into())?;
        Ok(())
    }
}

/// Where rows live in the pool (all strides in bf16 elements). A layer's view of a pool laid
/// out block-major over layers (`[block][layer][token][row]`) has
/// `block_stride = layers * block_size * row_stride`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub block_stride: usize,
    pub row_stride: usize,
    pub num_blocks: usize,
}

impl KvLayout {
    /// One layer's pool of `num_blocks` blocks, rows packed.
    pub fn packed(shape: &PagedAttentionShape, num_blocks: usize) -> Self {
        let row_stride = shape.num_kv_heads * shape.d_qk;
        Self {
            block_stride: shape.block_size * row_stride,
            row_stride,
            num_blocks,
        }
    }

    /// Offset of (block, token slot, kv head) in elements.
    pub fn offset(
        &self,
        shape: &PagedAttentionShape,
        block: usize,
        slot: usize,
        kv_head: usize,
    ) -> usize {
        block * self.block_stride + slot * self.row_stride + kv_head * shape.d_qk
    }

    /// Smallest view length that holds every block.
    pub fn min_len(&self, shape: &PagedAttentionShape) -> usize {
        if self.num_blocks == 0 {
            0
        } else {
            (self.num_blocks - 1) * self.block_stride + shape.block_size * self.row_stride
        }
    }

    pub(crate) fn validate(&self, shape: &PagedAttentionShape) -> Result<(), KernelError> {
        ensure(
            self.row_stride >= shape.num_kv_heads * shape.d_qk && self.row_stride.is_multiple_of(8),
            || {
                format!(
                    "row_stride = {} must be >= num_kv_heads * d_qk and a multiple of 8",
                    self.row_stride
                )
            },
        )?;
        ensure(
            self.block_stride >= shape.block_size * self.row_stride
                && self.block_stride.is_multiple_of(8),
            || {
                format!(
                    "block_stride = {} must be >= block_size * row_stride and a multiple of 8",
                    self.block_stride
                )
            },
        )
    }
}

/// Block tables: `rows` rows of `max_blocks` physical block ids (row-major).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockTables {
    pub max_blocks: usize,
    pub entries: Vec<i32>,
}

/// Query `query` reads keys `[start, end)` of table row `row`: the row exists, the range lies
/// inside the table, and every block it reaches is inside the pool.
pub(crate) fn validate_key_range(
    query: usize,
    (row, s, e): (i32, i32, i32),
    shape: &PagedAttentionShape,
    layout: &KvLayout,
    tables: &BlockTables,
) -> Result<(), KernelError> {
    ensure(row >= 0 && (row as usize) < tables.rows(), || {
        format!("query {query}: table row {row} out of range")
    })?;
    ensure(
        0 <= s && s <= e && (e as usize) <= tables.max_blocks * shape.block_size,
        || {
            format!(
                "query {query}: key range [{s}, {e}) outside the table's {} tokens",
                tables.max_blocks * shape.block_size
            )
        },
    )?;
    if s < e {
        for b in (s as usize / shape.block_size)..=((e as usize - 1) / shape.block_size) {
            let phys = tables.get(row as usize, b);
            ensure(phys >= 0 && (phys as usize) < layout.num_blocks, || {
                format!(
                    "query {query}: block {phys} outside the pool of {}",
                    layout.num_blocks
                )
            })?;
        }
    }
    Ok(())
}

impl BlockTables {
    pub fn rows(&self) -> usize {
        self.entries.len().checked_div(self.max_blocks).unwrap_or(0)
    }

    pub fn get(&self, row: usize, logical_block: usize) -> i32 {
        self.entries[row * self.max_blocks + logical_block]
    }
}

/// The query rows of one launch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueryRows {
    pub table_row: Vec<i32>,
    pub kv_start: Vec<i32>,
    pub kv_end: Vec<i32>,
}

impl QueryRows {
    /// Decode: query `i` uses table row `i` and sees `[0, lens[i])`.
    pub fn decode(lens: &[usize]) -> Self {
        let mut r = Self::default();
        for (i, &len) in lens.iter().enumerate() {
            r.push(i, 0, len);
        }
        r
    }

    /// A prefill chunk of `chunk` tokens after a cached prefix of `prefix` tokens, causal.
    pub fn prefill_chunk(table_row: usize, prefix: usize, chunk: usize) -> Self {
        let mut r = Self::default();
        for i in 0..chunk {
            r.push(table_row, 0, prefix + i + 1);
        }
        r
    }

    /// Decode with verification: sequence `i` (table row `i`) has `kv_lens[i]` keys after this
    /// step's `query_lens[i]` tokens were written; its token `j` sees
    /// `[0, kv_lens[i] - query_lens[i] + j + 1)`.
    pub fn decode_verify(kv_lens: &[usize], query_lens: &[usize]) -> Self {
        let mut r = Self::default();
        for (i, (&len, &n)) in kv_lens.iter().zip(query_lens).enumerate() {
            for j in 0..n.min(len) {
                r.push(i, 0, len - n.min(len) + j + 1);
            }
        }
        r
    }

    pub fn push(&mut self, table_row: usize, kv_start: usize, kv_end: usize) {
        self.table_row.push(table_row as i32);
        self.kv_start.push(kv_start as i32);
        self.kv_end.push(kv_end as i32);
    }

    pub fn len(&self) -> usize {
        self.table_row.len()
    }

    pub fn is_empty(&self) -> bool {
        self.table_row.is_empty()
    }

    /// Checks every row against the tables and the pool: bad input is an error, not a fault.
    pub fn validate(
        &self,
        shape: &PagedAttentionShape,
        layout: &KvLayout,
        tables: &BlockTables,
    ) -> Result<(), KernelError> {
        ensure(
            self.kv_start.len() == self.len() && self.kv_end.len() == self.len(),
            || "row vectors differ in length".into(),
        )?;
        ensure(
            tables.max_blocks > 0 && tables.entries.len().is_multiple_of(tables.max_blocks),
            || "block table is not rows x max_blocks".into(),
        )?;
        for i in 0..self.len() {
            validate_key_range(
                i,
                (self.table_row[i], self.kv_start[i], self.kv_end[i]),
                shape,
                layout,
                tables,
            )?;
        }
        Ok(())
    }

    /// Runs of consecutive causal rows of one sequence (same table row and start, ends rising
    /// by one), at most `max_tokens` each: the query groups of the tensor-core kernel.
    pub fn groups(&self, max_tokens: usize) -> Vec<QueryGroup> {
        let mut out: Vec<QueryGroup> = Vec::new();
        for i in 0..self.len() {
            let (row, s, e) = (self.table_row[i], self.kv_start[i], self.kv_end[i]);
            if let Some(g) = out.last_mut()
                && g.table_row == row
                && g.kv_start == s
                && g.kv_end + 1 == e
                && (g.len as usize) < max_tokens
            {
                g.kv_end = e;
                g.len += 1;
                continue;
            }
            out.push(QueryGroup {
                table_row: row,
                kv_start: s,
                kv_end: e,
                first_row: i as i32,
                len: 1,
            });
        }
        out
    }

    fn max_len(&self) -> usize {
        self.kv_start
            .iter()
            .zip(&self.kv_end)
            .map(|(s, e)| (e - s).max(0) as usize)
            .max()
            .unwrap_or(0)
    }
}

/// Consecutive query rows `first_row..first_row + len` of one sequence; row `first_row + j`
/// sees `[kv_start, kv_end - (len - 1 - j))`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueryGroup {
    pub table_row: i32,
    pub kv_start: i32,
    /// Key range end of the group's last row.
    pub kv_end: i32,
    pub first_row: i32,
    pub len: i32,
}

/// CPU reference in f64 over the bf16 inputs. `q` is `[rows, num_heads, d_qk]`; returns
/// `[rows, num_heads, d_v]`. Rows with no visible key give zeros.
pub fn paged_attention_cpu(
    shape: &PagedAttentionShape,
    layout: &KvLayout,
    q: &[bf16],
    kv: &[bf16],
    tables: &BlockTables,
    rows: &QueryRows,
    scale: f64,
) -> Result<Vec<f64>, KernelError> {
    shape.validate()?;
    layout.validate(shape)?;
    rows.validate(shape, layout, tables)?;
    let h = shape.num_heads();
    ensure(q.len() == rows.len() * h * shape.d_qk, || {
        "q has the wrong length".into()
    })?;
    ensure(kv.len() >= layout.min_len(shape), || {
        "kv pool is shorter than the layout".into()
    })?;
    let mut out = vec![0.0; rows.len() * h * shape.d_v];
    for i in 0..rows.len() {
        let (row, s, e) = (
            rows.table_row[i] as usize,
            rows.kv_start[i] as usize,
            rows.kv_end[i] as usize,
        );
        for head in 0..h {
            let kvh = head / shape.group;
            let qv = &q[(i * h + head) * shape.d_qk..][..shape.d_qk];
            let mut scores = Vec::with_capacity(e - s);
            let mut offs = Vec::with_capacity(e - s);
            for t in s..e {
                let phys = tables.get(row, t / shape.block_size) as usize;
                let off = layout.offset(shape, phys, t % shape.block_size, kvh);
                let dot: f64 = qv
                    .iter()
                    .zip(&kv[off..off + shape.d_qk])
                    .map(|(a, b)| a.to_f64() * b.to_f64())
                    .sum();
                scores.push(dot * scale);
                offs.push(off);
            }
            let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let den: f64 = scores.iter().map(|x| (x - mx).exp()).sum();
            let o = &mut out[(i * h + head) * shape.d_v..][..shape.d_v];
            for (sc, off) in scores.iter().zip(&offs) {
                let p = (sc - mx).exp() / den;
                for (d, od) in o.iter_mut().enumerate() {
                    *od += p * kv[off + d].to_f64();
                }
            }
        }
    }
    Ok(out)
}

/// Query rows, block tables and their key ranges on the device, validated on upload.
pub struct DeviceRows {
    groups: Option<DeviceGroups>,
    table_row: CudaSlice<i32>,
    kv_start: CudaSlice<i32>,
    kv_end: CudaSlice<i32>,
    tables: CudaSlice<i32>,
    max_blocks: usize,
    num_q: usize,
    max_len: usize,
    total_len: usize,
}

impl DeviceRows {
    pub fn num_q(&self) -> usize {
        self.num_q
    }

    /// Sum over rows of the keys each sees.
    pub fn total_len(&self) -> usize {
        self.total_len
    }
}

/// The query groups of the tensor-core kernel (struct of arrays).
struct DeviceGroups {
    row: CudaSlice<i32>,
    start: CudaSlice<i32>,
    end: CudaSlice<i32>,
    q0: CudaSlice<i32>,
    qn: CudaSlice<i32>,
    count: usize,
    /// Longest group (query tokens): a kernel with fewer tokens per group cannot run these.
    max_len: usize,
}

/// Split partials: (max, sum, weighted values) per (row, head, split).
pub struct AttentionWorkspace {
    m: CudaSlice<f32>,
    l: CudaSlice<f32>,
    acc: CudaSlice<f32>,
}

impl AttentionWorkspace {
    /// Partials for `n` (row, head, split) slots of `d_v` values each.
    pub(crate) fn new(gpu: &GpuContext, n: usize, d_v: usize) -> Result<Self, KernelError> {
        let s = &gpu.stream;
        Ok(Self {
            m: s.alloc_zeros(n)?,
            l: s.alloc_zeros(n)?,
            acc: s.alloc_zeros(n * d_v)?,
        })
    }

    /// Whether it holds `n` slots of `d_v` values.
    pub(crate) fn holds(&self, n: usize, d_v: usize) -> bool {
        self.m.len() >= n && self.acc.len() >= n * d_v
    }

    pub(crate) fn parts_mut(
        &mut self,
    ) -> (
        &mut CudaSlice<f32>,
        &mut CudaSlice<f32>,
        &mut CudaSlice<f32>,
    ) {
        (&mut self.m, &mut self.l, &mut self.acc)
    }

    /// Fills every partial with NaN, so a reduce that read one the split pass did not write
    /// would show in the output.
    pub fn poison(&mut self, gpu: &GpuContext) -> Result<(), KernelError> {
        for buf in [&mut self.m, &mut self.l, &mut self.acc] {
            let nan = vec![f32::NAN; buf.len()];
            gpu.stream.memcpy_htod(&nan, buf)?;
        }
        Ok(())
    }
}

/// Compile-time constants of the kernels for one shape.
pub(crate) fn defines(shape: &PagedAttentionShape) -> [(&'static str, usize); 8] {
    let (lpt, cpl) = lane_split(shape.d_qk);
    [
        ("TILE", tiled_tile(shape).unwrap_or(32)),
        ("D_QK", shape.d_qk),
        ("D_V", shape.d_v),
        ("GROUP", shape.group),
        ("LPT", lpt),
        ("CPL", cpl),
        ("WARPS", WARPS),
        ("UNROLL", UNROLL),
    ]
}

/// Tokens per shared-memory tile of the tiled kernel, or `None` when the shape does not suit it
/// (value width not a multiple of 32, or the tiles would not fit in 48 KB of shared memory).
pub fn tiled_tile(shape: &PagedAttentionShape) -> Option<usize> {
    if !shape.d_v.is_multiple_of(32) {
        return None;
    }
    [32usize, 16].into_iter().find(|&tile| {
        let smem = shape.group * shape.d_qk * 4
            + WARPS * tile * (shape.d_qk + 8) * 2
            + WARPS * tile * shape.group * 4;
        smem <= 48 * 1024
    })
}

/// Tile parameters of the tensor-core kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MmaConfig {
    /// Keys per shared-memory tile (16 or 32).
    pub keys_per_tile: usize,
    /// Tiles in flight per warp (cp.async pipeline depth), at least 2.
    pub stages: usize,
    /// Warps per block (each one an independent split).
    pub warps: usize,
    /// Blocks per SM asked of the compiler (`__launch_bounds__`): caps registers so that many
    /// warps keep tiles in flight.
    pub min_blocks: usize,
    /// XOR-swizzled unpadded shared rows instead of padded ones (`d_qk` a multiple of 64):
    /// 20% less shared memory per tile at d 128, so more tiles fit in flight.
    pub swizzle: bool,
    /// `cp.async` with the L2 256-byte prefetch hint.
    pub l2_prefetch: bool,
    /// Skip the output rescale when no row's running max moved in a tile (exact).
    #[serde(default)]
    pub lazy_rescale: bool,
    /// Swapped operands (kernel `paged_attention_mma_t`): keys are the 16 MMA rows and up to
    /// 8 query rows the 8 columns (Sᵀ = K·Qᵀ, Oᵀ = Vᵀ·Pᵀ), half the MMAs per key when the
    /// group's query rows fit in 8 (at most 8 heads per KV head). Shared rows are padded to an
    /// odd number of 16-byte chunks (or XOR-swizzled by row mod 8) for conflict-free ldmatrix.
    #[serde(default)]
    pub swap_operands: bool,
}

impl MmaConfig {
    /// Padded shared-memory row (bf16 elements): row bytes / 4 ≡ 16 (mod 32) so that the eight
    /// lanes of one 16-byte access phase (two keys × four chunks) fall in distinct banks.
    pub fn padded_row(d_qk: usize) -> usize {
        d_qk + (32 + 64 - d_qk % 64) % 64
    }

    /// Padded shared row of the swapped kernel (bf16 elements): an odd number of 16-byte
    /// chunks, so the eight rows of one ldmatrix phase fall in distinct bank groups.
    pub fn padded_row_swapped(d_qk: usize) -> usize {
        d_qk + if (d_qk / 8).is_multiple_of(2) { 8 } else { 0 }
    }

    /// Shared row of this configuration, bf16 elements.
    pub fn row(&self, d_qk: usize) -> usize {
        if self.swizzle {
            d_qk
        } else if self.swap_operands {
            Self::padded_row_swapped(d_qk)
        } else {
            Self::padded_row(d_qk)
        }
    }

    /// Dynamic shared memory of one block: every warp's tile ring, plus Q (16 rows) for the
    /// plain kernel (the swapped one keeps Q in registers).
    pub fn smem_bytes(&self, shape: &PagedAttentionShape) -> usize {
        let q_rows = if self.swap_operands { 0 } else { 16 };
        (q_rows + self.warps * self.stages * self.keys_per_tile) * self.row(shape.d_qk) * 2
    }

    /// Query tokens per group of the plain kernel: the 16 MMA rows hold `group` heads for each
    /// token.
    pub fn query_tokens(shape: &PagedAttentionShape) -> usize {
        (16 / shape.group).max(1)
    }

    /// Query tokens per group of this configuration: 16 (plain) or 8 (swapped) query rows of
    /// `group` heads each.
    pub fn tokens_per_group(&self, shape: &PagedAttentionShape) -> usize {
        let rows = if self.swap_operands { 8 } else { 16 };
        (rows / shape.group).max(1)
    }

    /// Name of the kernel function these tiles compile to.
    pub fn function_name(&self) -> &'static str {
        if self.swap_operands {
            "paged_attention_mma_t"
        } else {
            "paged_attention_mma"
        }
    }

    /// Whether this configuration is valid for `shape`.
    pub fn validate_for(&self, shape: &PagedAttentionShape) -> bool {
        self.validate(shape).is_ok()
    }

    fn validate(&self, shape: &PagedAttentionShape) -> Result<(), KernelError> {
        ensure(matches!(self.keys_per_tile, 16 | 32), || {
            format!("keys_per_tile = {} must be 16 or 32", self.keys_per_tile)
        })?;
        ensure(
            self.stages >= 2 && self.warps >= 1 && self.warps <= 16,
            || "stages must be >= 2 and warps in 1..=16".into(),
        )?;
        ensure(!self.swizzle || shape.d_qk.is_multiple_of(64), || {
            format!("swizzled rows need d_qk % 64 == 0, not {}", shape.d_qk)
        })?;
        ensure((1..=16).contains(&self.min_blocks), || {
            "min_blocks must be in 1..=16".into()
        })?;
        ensure(!self.swap_operands || shape.group <= 8, || {
            format!(
                "swapped operands hold at most 8 query rows, not group {}",
                shape.group
            )
        })?;
        ensure(self.smem_bytes(shape) <= MAX_DYNAMIC_SMEM, || {
            format!(
                "{self:?} needs {} B of shared memory (limit {MAX_DYNAMIC_SMEM})",
                self.smem_bytes(shape)
            )
        })
    }
}

/// The tensor-core kernel's default tiles for `shape`, or `None` when it does not take the
/// shape: widths must be multiples of 32, values at most 256 wide (the f32 output lives in
/// registers), at most 16 query heads per KV head (one 16-row MMA tile).
pub fn mma_config(shape: &PagedAttentionShape) -> Option<MmaConfig> {
    if !(shape.d_qk.is_multiple_of(32)
        && shape.d_v.is_multiple_of(32)
        && shape.d_v <= 256
        && shape.group <= 16)
    {
        return None;
    }
    // Measured best on the H200 (`servelab-gpu speed` sweeps the alternatives): many warps
    // with a two-stage cp.async ring. At d <= 128 with at most 8 heads per KV head the
    // swapped-operand kernel with the L2 prefetch hint (85 % of copy bandwidth at kvh 8 x
    // group 4, vs 69 % for the best plain tiles; 116 registers, no spills); otherwise
    // the plain kernel, where padded rows beat the swizzled three-stage ring at d 128 and at
    // d 256 the swizzled rows fit two blocks/SM.
    let cfg = if shape.d_qk <= 128 && shape.group <= 8 {
        MmaConfig {
            keys_per_tile: 16,
            stages: 2,
            warps: 16,
            min_blocks: 1,
            swizzle: false,
            l2_prefetch: true,
            lazy_rescale: true,
            swap_operands: true,
        }
    } else if shape.d_qk <= 128 {
        MmaConfig {
            keys_per_tile: 16,
            stages: 2,
            warps: 16,
            min_blocks: 1,
            swizzle: false,
            l2_prefetch: false,
            lazy_rescale: true,
            swap_operands: false,
        }
    } else {
        MmaConfig {
            keys_per_tile: 16,
            stages: 2,
            warps: 4,
            min_blocks: 2,
            swizzle: shape.d_qk.is_multiple_of(64),
            l2_prefetch: false,
            lazy_rescale: true,
            swap_operands: false,
        }
    };
    let cfg = if cfg.validate(shape).is_ok() {
        cfg
    } else {
        MmaConfig {
            keys_per_tile: 16,
            stages: 2,
            warps: 4,
            min_blocks: 1,
            swizzle: false,
            l2_prefetch: false,
            lazy_rescale: true,
            swap_operands: false,
        }
    };
    cfg.validate(shape).ok().map(|_| cfg)
}

pub(crate) fn mma_defines(
    shape: &PagedAttentionShape,
    cfg: &MmaConfig,
) -> Vec<(&'static str, usize)> {
    vec![
        ("D_QK", shape.d_qk),
        ("D_V", shape.d_v),
        ("GROUP", shape.group),
        ("QT", cfg.tokens_per_group(shape)),
        ("TK", cfg.keys_per_tile),
        ("STAGES", cfg.stages),
        ("WARPS", cfg.warps),
        ("MINB", cfg.min_blocks),
        ("SWZ", cfg.swizzle as usize),
        ("PF", cfg.l2_prefetch as usize),
        ("LAZY", cfg.lazy_rescale as usize),
        ("SWAP", cfg.swap_operands as usize),
        ("ROWP", cfg.row(shape.d_qk)),
    ]
}

pub(crate) const MMA_SOURCE: &str = MMA_SRC;

/// Which split kernel runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub enum AttentionKernel {
    /// Lanes split each row; online softmax per token; any shape.
    Warp,
    /// Shared-memory tiles; online softmax per tile (see [`tiled_tile`] for the shapes it takes).
    Tiled,
    /// Tensor cores (mma.sync m16n8k16) over cp.async-staged tiles (see [`mma_config`]).
    Mma,
}

/// The source compiled for one shape: the warp kernel, reduce and write, plus the tiled kernel
/// where the shape suits it.
pub(crate) fn source_for(shape: &PagedAttentionShape) -> String {
    if tiled_tile(shape).is_some() {
        format!("{SRC}\n{TILED_SRC}")
    } else {
        SRC.to_string()
    }
}

/// The compiled kernels for one shape.
pub struct PagedAttention {
    pub shape: PagedAttentionShape,
    split: CudaFunction,
    tiled: Option<CudaFunction>,
    mma: Option<(CudaFunction, MmaConfig)>,
    kernel: AttentionKernel,
    reduce: CudaFunction,
    write: CudaFunction,
    sm_count: usize,
    /// Resident blocks per SM of each split kernel (occupancy API), for the split-size rule.
    blocks_per_sm: BlocksPerSm,
}

#[derive(Debug, Clone, Copy)]
struct BlocksPerSm {
    warp: usize,
    tiled: usize,
    mma: usize,
}

fn occupancy(f: &CudaFunction, threads: usize, smem: usize) -> usize {
    f.occupancy_max_active_blocks_per_multiprocessor(threads as u32, smem, None)
        .map(|b| b.max(1) as usize)
        .unwrap_or(1)
}

/// Split-size cost model, in key-equivalents per warp: the fixed cost of one split (Q load,
/// cp.async pipeline fill, the partial write and its share of the reduce). Measured on the
/// H200 (64 x 16K decode): 1,024-token splits beat 512 and 2,048.
pub const SPLIT_OVERHEAD_KEYS: usize = 256;

/// Tokens per split (a multiple of `granule`) for `units` independent key ranges (query row or
/// group x KV head) of at most `max_len` keys, when a block runs `warps_per_block` consecutive
/// splits of one unit and `concurrent_blocks` blocks fit on the device at once. Minimises
/// `waves x (tokens per split + SPLIT_OVERHEAD_KEYS)`: whole waves, because a block's warps
/// finish together and a partial last wave costs a full one on the SMs it occupies; blocks
/// whose warps have no split are counted, so a split count that leaves warps idle loses. Ties
/// go to the larger split (fewer partials).
pub fn pick_tokens_per_split(
    max_len: usize,
    units: usize,
    warps_per_block: usize,
    concurrent_blocks: usize,
    granule: usize,
) -> usize {
    let granule = granule.max(1);
    let max_len = max_len.max(1);
    let (units, warps, conc) = (
        units.max(1),
        warps_per_block.max(1),
        concurrent_blocks.max(1),
    );
    let most_splits = max_len.div_ceil(granule).clamp(1, 4096);
    let mut best: Option<(usize, usize)> = None; // (cost, tokens per split)
    for splits in 1..=most_splits {
        let tps = max_len.div_ceil(splits).div_ceil(granule) * granule;
        let real_splits = max_len.div_ceil(tps);
        let blocks = real_splits.div_ceil(warps) * units;
        let waves = blocks.div_ceil(conc);
        let cost = waves * (tps.min(max_len) + SPLIT_OVERHEAD_KEYS);
        if best.is_none_or(|(c, _)| cost < c) {
            best = Some((cost, tps));
        }
    }
    best.map_or(granule, |(_, t)| t)
}

impl PagedAttention {
    pub fn new(gpu: &GpuContext, shape: PagedAttentionShape) -> Result<Self, KernelError> {
        shape.validate()?;
        let defines = defines(&shape);
        let src = source_for(&shape);
        let has_tiled = tiled_tile(&shape).is_some();
        let mut names = vec![
            "paged_attention_split",
            "paged_attention_reduce",
            "paged_kv_write",
        ];
        if has_tiled {
            names.push("paged_attention_tiled");
        }
        let mut f = gpu
            .functions("paged_attention", &src, &defines, &names)?
            .into_iter();
        let (split, reduce, write) = (
            f.next().expect("split"),
            f.next().expect("reduce"),
            f.next().expect("write"),
        );
        let tiled = f.next();
        let mma = match mma_config(&shape) {
            Some(cfg) => Some((load_mma(gpu, &shape, &cfg)?, cfg)),
            None => None,
        };
        let kernel = if mma.is_some() {
            AttentionKernel::Mma
        } else if tiled.is_some() {
            AttentionKernel::Tiled
        } else {
            AttentionKernel::Warp
        };
        let sm_count = gpu
            .ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map(|v| v.max(1) as usize)
            .unwrap_or(132);
        let blocks_per_sm = BlocksPerSm {
            warp: occupancy(&split, WARPS * 32, 0),
            tiled: tiled.as_ref().map_or(1, |f| occupancy(f, WARPS * 32, 0)),
            mma: mma
                .as_ref()
                .map_or(1, |(f, c)| occupancy(f, c.warps * 32, c.smem_bytes(&shape))),
        };
        Ok(Self {
            shape,
            split,
            tiled,
            mma,
            kernel,
            reduce,
            write,
            sm_count,
            blocks_per_sm,
        })
    }

    /// Registers per thread and local-memory (spill) bytes of the split kernel in use.
    pub fn split_resources(&self) -> (i32, i32) {
        use cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES;
        let f = self.split_fn();
        (
            f.num_regs().unwrap_or(-1),
            f.get_attribute(CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)
                .unwrap_or(-1),
        )
    }

    pub fn kernel(&self) -> AttentionKernel {
        self.kernel
    }

    /// Selects the split kernel; `Tiled` or `Mma` is an error for shapes it does not take.
    pub fn set_kernel(&mut self, k: AttentionKernel) -> Result<(), KernelError> {
        let ok = match k {
            AttentionKernel::Warp => true,
            AttentionKernel::Tiled => self.tiled.is_some(),
            AttentionKernel::Mma => self.mma.is_some(),
        };
        ensure(ok, || {
            format!("the {k:?} kernel does not take {:?}", self.shape)
        })?;
        self.kernel = k;
        Ok(())
    }

    /// Kernels this shape can run, fastest first.
    pub fn available_kernels(&self) -> Vec<AttentionKernel> {
        let mut v = Vec::new();
        if self.mma.is_some() {
            v.push(AttentionKernel::Mma);
        }
        if self.tiled.is_some() {
            v.push(AttentionKernel::Tiled);
        }
        v.push(AttentionKernel::Warp);
        v
    }

    /// The tensor-core kernel's tiles, if the shape takes it.
    pub fn mma_tiles(&self) -> Option<MmaConfig> {
        self.mma.as_ref().map(|(_, c)| *c)
    }

    /// Recompiles the tensor-core kernel with other tiles (and selects it).
    pub fn set_mma_tiles(&mut self, gpu: &GpuContext, cfg: MmaConfig) -> Result<(), KernelError> {
        ensure(mma_config(&self.shape).is_some(), || {
            format!("the Mma kernel does not take {:?}", self.shape)
        })?;
        cfg.validate(&self.shape)?;
        let f = load_mma(gpu, &self.shape, &cfg)?;
        self.blocks_per_sm.mma = occupancy(&f, cfg.warps * 32, cfg.smem_bytes(&self.shape));
        self.mma = Some((f, cfg));
        self.kernel = AttentionKernel::Mma;
        Ok(())
    }

    fn split_fn(&self) -> &CudaFunction {
        match (&self.kernel, &self.tiled, &self.mma) {
            (AttentionKernel::Tiled, Some(f), _) => f,
            (AttentionKernel::Mma, _, Some((f, _))) => f,
            _ => &self.split,
        }
    }

    pub fn upload(
        &self,
        gpu: &GpuContext,
        layout: &KvLayout,
        tables: &BlockTables,
        rows: &QueryRows,
    ) -> Result<DeviceRows, KernelError> {
        layout.validate(&self.shape)?;
        rows.validate(&self.shape, layout, tables)?;
        let s = &gpu.stream;
        let nonempty = |v: &[i32]| if v.is_empty() { vec![0] } else { v.to_vec() };
        let groups = if let Some((_, cfg)) = &self.mma {
            let g = rows.groups(cfg.tokens_per_group(&self.shape));
            let col = |f: fn(&QueryGroup) -> i32| nonempty(&g.iter().map(f).collect::<Vec<_>>());
            Some(DeviceGroups {
                row: s.clone_htod(&col(|g| g.table_row))?,
                start: s.clone_htod(&col(|g| g.kv_start))?,
                end: s.clone_htod(&col(|g| g.kv_end))?,
                q0: s.clone_htod(&col(|g| g.first_row))?,
                qn: s.clone_htod(&col(|g| g.len))?,
                count: g.len(),
                max_len: g.iter().map(|g| g.len as usize).max().unwrap_or(0),
            })
        } else {
            None
        };
        Ok(DeviceRows {
            groups,
            table_row: s.clone_htod(&nonempty(&rows.table_row))?,
            kv_start: s.clone_htod(&nonempty(&rows.kv_start))?,
            kv_end: s.clone_htod(&nonempty(&rows.kv_end))?,
            tables: s.clone_htod(&nonempty(&tables.entries))?,
            max_blocks: tables.max_blocks,
            num_q: rows.len(),
            max_len: rows.max_len(),
            total_len: rows
                .kv_start
                .iter()
                .zip(&rows.kv_end)
                .map(|(a, b)| (b - a) as usize)
                .sum(),
        })
    }

    /// Keys per warp, by [`pick_tokens_per_split`] over the kernel in use: its warps per block
    /// and resident blocks per SM, in multiples of 128 keys. The tensor-core kernel reads each
    /// query group's keys once, so its units are groups, not rows. (The old rule, total keys /
    /// (16 warps x SMs), picked 4,096 for 64 x 16K decode, where only 4 of a block's 16 warps
    /// had a split; 1,024 measured 2.0x faster.)
    pub fn default_tokens_per_split(&self, rows: &DeviceRows) -> usize {
        let kvh = self.shape.num_kv_heads;
        let (units, warps, per_sm) = match (&self.kernel, &rows.groups, &self.mma) {
            (AttentionKernel::Mma, Some(g), Some((_, c))) => {
                (g.count * kvh, c.warps, self.blocks_per_sm.mma)
            }
            (AttentionKernel::Tiled, _, _) => (rows.num_q * kvh, WARPS, self.blocks_per_sm.tiled),
            _ => (rows.num_q * kvh, WARPS, self.blocks_per_sm.warp),
        };
        pick_tokens_per_split(rows.max_len, units, warps, self.sm_count * per_sm, 128)
    }

    pub fn workspace(
        &self,
        gpu: &GpuContext,
        rows: &DeviceRows,
        tokens_per_split: usize,
    ) -> Result<AttentionWorkspace, KernelError> {
        let splits = rows.max_len.div_ceil(tokens_per_split.max(1)).max(1);
        let n = (rows.num_q * self.shape.num_heads() * splits).max(1);
        let s = &gpu.stream;
        Ok(AttentionWorkspace {
            m: s.alloc_zeros(n)?,
            l: s.alloc_zeros(n)?,
            acc: s.alloc_zeros(n * self.shape.d_v)?,
        })
    }

    /// Makes `ws` large enough for `rows` at `tokens_per_split`, keeping it when it already is.
    /// Old contents do not matter: the split pass writes every partial the reduce pass reads
    /// (the GPU checks run on a NaN-poisoned workspace to hold that). A layer loop that
    /// allocated and zeroed a workspace per attention call spent more host time on it than on
    /// the launch.
    pub fn ensure_workspace(
        &self,
        gpu: &GpuContext,
        rows: &DeviceRows,
        tokens_per_split: usize,
        ws: &mut Option<AttentionWorkspace>,
    ) -> Result<(), KernelError> {
        let splits = rows.max_len.div_ceil(tokens_per_split.max(1)).max(1);
        let n = rows.num_q * self.shape.num_heads() * splits;
        let fits = ws
            .as_ref()
            .is_some_and(|w| w.m.len() >= n && w.acc.len() >= n * self.shape.d_v);
        if !fits {
            // Free the old one first: both at once could be the step's largest allocation twice.
            *ws = None;
            *ws = Some(self.workspace(gpu, rows, tokens_per_split)?);
        }
        Ok(())
    }

    /// out `[num_q, num_heads, d_v]` = attention of `q` `[num_q, num_heads, d_qk]` over `kv`.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        gpu: &GpuContext,
        q: &CudaSlice<bf16>,
        kv: &CudaView<'_, bf16>,
        layout: &KvLayout,
        rows: &DeviceRows,
        tokens_per_split: usize,
        ws: &mut AttentionWorkspace,
        scale: f32,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), KernelError> {
        let sh = &self.shape;
        check_run_buffers(
            &self.shape,
            q,
            kv,
            layout,
            rows.num_q,
            tokens_per_split,
            out,
        )?;
        if rows.num_q == 0 {
            return Ok(());
        }
        let max_splits = rows.max_len.div_ceil(tokens_per_split).max(1);
        ensure(
            ws.m.len() >= rows.num_q * sh.num_heads() * max_splits,
            || "workspace too small for this split".into(),
        )?;
        let cfg = self.split_launch_config(rows, max_splits)?;
        let (tps, ms) = (tokens_per_split as i32, max_splits as i32);
        self.launch_split(gpu, q, kv, layout, rows, (tps, ms), ws, scale, cfg)?;
        self.launch_reduce(gpu, rows, (tps, ms), ws, out)
    }

    /// The split kernel's launch shape over `rows` in `max_splits` splits: per group of query
    /// tokens on the tensor-core kernel (whose rows must have been grouped for its tiles), per
    /// query token otherwise.
    fn split_launch_config(
        &self,
        rows: &DeviceRows,
        max_splits: usize,
    ) -> Result<LaunchConfig, KernelError> {
        let sh = &self.shape;
        match (&self.kernel, &self.mma, &rows.groups) {
            (AttentionKernel::Mma, Some((_, mc)), Some(g)) => {
                ensure(g.max_len <= mc.tokens_per_group(sh), || {
                    format!(
                        "rows were grouped for {} query tokens, the tiles take {}: upload again",
                        g.max_len,
                        mc.tokens_per_group(sh)
                    )
                })?;
                Ok(LaunchConfig {
                    grid_dim: (
                        max_splits.div_ceil(mc.warps) as u32,
                        g.count as u32,
                        sh.num_kv_heads as u32,
                    ),
                    block_dim: ((mc.warps * 32) as u32, 1, 1),
                    shared_mem_bytes: mc.smem_bytes(sh) as u32,
                })
            }
            (AttentionKernel::Mma, _, _) => Err(KernelError::shape(
                "rows were uploaded without the tensor-core kernel's groups",
            )),
            _ => Ok(LaunchConfig {
                grid_dim: (
                    max_splits.div_ceil(WARPS) as u32,
                    rows.num_q as u32,
                    sh.num_kv_heads as u32,
                ),
                block_dim: ((WARPS * 32) as u32, 1, 1),
                shared_mem_bytes: 0,
            }),
        }
    }

    /// Launches the split kernel: each split's partial max, sum and output into `ws`.
    #[allow(clippy::too_many_arguments)]
    fn launch_split(
        &self,
        gpu: &GpuContext,
        q: &CudaSlice<bf16>,
        kv: &CudaView<'_, bf16>,
        layout: &KvLayout,
        rows: &DeviceRows,
        (tps, ms): (i32, i32),
        ws: &mut AttentionWorkspace,
        scale: f32,
        cfg: LaunchConfig,
    ) -> Result<(), KernelError> {
        let sh = &self.shape;
        let (block_stride, row_stride) = (layout.block_stride as i64, layout.row_stride as i32);
        let (max_blocks, kvh, bs) = (
            rows.max_blocks as i32,
            sh.num_kv_heads as i32,
            sh.block_size as i32,
        );
        let mut b = gpu.stream.launch_builder(self.split_fn());
        b.arg(q).arg(kv).arg(&rows.tables).arg(&max_blocks);
        match (&self.kernel, &self.mma, &rows.groups) {
            (AttentionKernel::Mma, Some(_), Some(g)) => {
                b.arg(&g.row)
                    .arg(&g.start)
                    .arg(&g.end)
                    .arg(&g.q0)
                    .arg(&g.qn);
            }
            _ => {
                b.arg(&rows.table_row).arg(&rows.kv_start).arg(&rows.kv_end);
            }
        }
        b.arg(&block_stride)
            .arg(&row_stride)
            .arg(&kvh)
            .arg(&bs)
            .arg(&tps)
            .arg(&ms)
            .arg(&scale);
        b.arg(&mut ws.m).arg(&mut ws.l).arg(&mut ws.acc);
        // SAFETY: shapes and every block id reachable from the rows were checked above/on upload.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Launches the reduction of the splits in `ws` into `out`.
    fn launch_reduce(
        &self,
        gpu: &GpuContext,
        rows: &DeviceRows,
        (tps, ms): (i32, i32),
        ws: &AttentionWorkspace,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), KernelError> {
        let sh = &self.shape;
        let heads = sh.num_heads() as i32;
        let cfg = LaunchConfig {
            grid_dim: (rows.num_q as u32, sh.num_heads() as u32, 1),
            block_dim: (REDUCE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = gpu.stream.launch_builder(&self.reduce);
        b.arg(&rows.kv_start)
            .arg(&rows.kv_end)
            .arg(&tps)
            .arg(&ms)
            .arg(&heads);
        b.arg(&ws.m).arg(&ws.l).arg(&ws.acc).arg(out);
        // SAFETY: workspace and output sizes checked above.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Writes `n` rows of `src` (`[n, num_kv_heads * d_qk]`) to the pool at `slots`
    /// (`physical_block * block_size + offset`; negative slots are skipped).
    pub fn write_kv(
        &self,
        gpu: &GpuContext,
        src: &CudaSlice<bf16>,
        slots: &[i64],
        kv: &mut CudaViewMut<'_, bf16>,
        layout: &KvLayout,
    ) -> Result<(), KernelError> {
        let sh = &self.shape;
        layout.validate(sh)?;
        ensure(src.len() >= slots.len() * sh.num_kv_heads * sh.d_qk, || {
            "src is too short".into()
        })?;
        ensure(kv.len() >= layout.min_len(sh), || {
            "kv view is shorter than the layout".into()
        })?;
        for &s in slots {
            ensure(s < (layout.num_blocks * sh.block_size) as i64, || {
                format!("slot {s} outside the pool")
            })?;
        }
        if slots.is_empty() {
            return Ok(());
        }
        let d_slots = gpu.stream.clone_htod(slots)?;
        // SAFETY: the host copy of the slots was checked against the pool just above.
        unsafe { self.write_kv_unchecked(gpu, src, slots.len(), &d_slots, kv, layout) }
    }

    /// [`Self::write_kv`] with the slots already on the device (no host round trip).
    ///
    /// # Safety
    /// Every slot in `d_slots[..n]` must be negative or inside the pool described by `layout`,
    /// and `src` must hold `n` rows.
    pub unsafe fn write_kv_unchecked(
        &self,
        gpu: &GpuContext,
        src: &CudaSlice<bf16>,
        n: usize,
        d_slots: &CudaSlice<i64>,
        kv: &mut CudaViewMut<'_, bf16>,
        layout: &KvLayout,
    ) -> Result<(), KernelError> {
        let sh = &self.shape;
        ensure(d_slots.len() >= n, || "slot array too short".into())?;
        if n == 0 {
            return Ok(());
        }
        layout.validate(sh)?;
        ensure(src.len() >= n * sh.num_kv_heads * sh.d_qk, || {
            "src is too short".into()
        })?;
        let (block_stride, row_stride) = (layout.block_stride as i64, layout.row_stride as i32);
        let (kvh, bs) = (sh.num_kv_heads as i32, sh.block_size as i32);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = gpu.stream.launch_builder(&self.write);
        b.arg(src)
            .arg(d_slots)
            .arg(kv)
            .arg(&block_stride)
            .arg(&row_stride)
            .arg(&kvh)
            .arg(&bs);
        // SAFETY: the caller guarantees every slot is inside the pool.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

/// Compiles and loads the tensor-core kernel for `shape` with tiles `cfg`, raising its dynamic
/// shared-memory limit.
fn load_mma(
    gpu: &GpuContext,
    shape: &PagedAttentionShape,
    cfg: &MmaConfig,
) -> Result<CudaFunction, KernelError> {
    let f = gpu
        .functions(
            cfg.function_name(),
            MMA_SRC,
            &mma_defines(shape, cfg),
            &[cfg.function_name()],
        )?
        .remove(0);
    f.set_attribute(
        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        cfg.smem_bytes(shape) as i32,
    )?;
    Ok(f)
}

/// CPU reference of [`PagedAttention::write_kv`].
pub fn paged_kv_write_cpu(
    shape: &PagedAttentionShape,
    layout: &KvLayout,
    src: &[bf16],
    slots: &[i64],
    kv: &mut [bf16],
) {
    let w = shape.num_kv_heads * shape.d_qk;
    for (i, &s) in slots.iter().enumerate() {
        if s < 0 {
            continue;
        }
        let (b, o) = (s as usize / shape.block_size, s as usize % shape.block_size);
        let off = b * layout.block_stride + o * layout.row_stride;
        kv[off..off + w].copy_from_slice(&src[i * w..(i + 1) * w]);
    }
}

/// A random permutation of `num_blocks` pool blocks dealt out to `rows` table rows.
pub fn random_tables(seed: u64, rows: usize, max_blocks: usize, num_blocks: usize) -> BlockTables {
    use rand::seq::SliceRandom;
    let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
    ids.shuffle(&mut rng(seed));
    let entries = (0..rows * max_blocks)
        .map(|i| ids[i % num_blocks])
        .collect();
    BlockTables {
        max_blocks,
        entries,
    }
}

/// Which query rows a check uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CaseKind {
    /// One token per sequence, ragged lengths.
    Decode,
    /// 1 + verified drafts tokens per sequence (causal inside the step).
    Verify,
    /// A prefill chunk over a cached prefix.
    Prefill,
}

/// The query rows of a check of `kind` at block size `bs`, random block tables (from
/// `seed`) over a pool of as many blocks as returned, and the case's description.
fn case_rows(kind: CaseKind, bs: usize, seed: u64) -> (QueryRows, BlockTables, usize, String) {
    if kind == CaseKind::Decode {
        let lens = [1usize, bs - 1, bs, 3 * bs + 17, 5 * bs + 1, 0];
        let max_blocks = 6;
        let nb = lens.len() * max_blocks;
        (
            QueryRows::decode(&lens),
            random_tables(seed, lens.len(), max_blocks, nb),
            nb,
            format!("decode lens {lens:?}"),
        )
    } else if kind == CaseKind::Verify {
        let lens = [6usize, bs + 3, 2 * bs, 4 * bs + 77];
        let qlens = [6usize, 1, 4, 3];
        let max_blocks = lens.iter().max().unwrap_or(&1).div_ceil(bs);
        let nb = lens.len() * max_blocks;
        (
            QueryRows::decode_verify(&lens, &qlens),
            random_tables(seed, lens.len(), max_blocks, nb),
            nb,
            format!("verify lens {lens:?} query tokens {qlens:?}"),
        )
    } else {
        let (prefix, chunk) = (2 * bs + 5, 37);
        let max_blocks = (prefix + chunk).div_ceil(bs);
        (
            QueryRows::prefill_chunk(0, prefix, chunk),
            random_tables(seed, 1, max_blocks, max_blocks + 3),
            max_blocks + 3,
            format!("prefill prefix {prefix} chunk {chunk}"),
        )
    }
}

/// One GPU check: decode rows of ragged lengths, verification rows, or a prefill chunk over a
/// cached prefix.
fn check_case(
    gpu: &GpuContext,
    seed: u64,
    shape: PagedAttentionShape,
    kind: CaseKind,
    kernel: AttentionKernel,
    tiles: Option<MmaConfig>,
) -> Result<CheckResult, KernelError> {
    let mut r = rng(seed);
    let bs = shape.block_size;
    let (rows, tables, num_blocks, what) = case_rows(kind, bs, seed);
    let layout = KvLayout::packed(&shape, num_blocks);
    let kv = random_bf16(&mut r, layout.min_len(&shape), 1.0);
    let q = random_bf16(&mut r, rows.len() * shape.num_heads() * shape.d_qk, 1.0);
    let scale = 1.0 / (shape.d_qk as f64).sqrt();
    let reference = paged_attention_cpu(&shape, &layout, &q, &kv, &tables, &rows, scale)?;
    let mut att = PagedAttention::new(gpu, shape)?;
    att.set_kernel(kernel)?;
    if let Some(c) = tiles {
        att.set_mma_tiles(gpu, c)?;
    }
    let d_rows = att.upload(gpu, &layout, &tables, &rows)?;
    let (dq, dkv) = (gpu.stream.clone_htod(&q)?, gpu.stream.clone_htod(&kv)?);
    // Poison the output so unwritten elements show up as NaN.
    let mut out = gpu.stream.clone_htod(&vec![bf16::NAN; reference.len()])?;
    // A small split forces several partials per row, exercising the merge.
    let tps = 64;
    let mut ws = att.workspace(gpu, &d_rows, tps)?;
    // Partials the reduce reads must all come from this run (the backend reuses workspaces).
    ws.poison(gpu)?;
    att.run(
        gpu,
        &dq,
        &dkv.as_view(),
        &layout,
        &d_rows,
        tps,
        &mut ws,
        scale as f32,
        &mut out,
    )?;
    let got: Vec<f64> = gpu
        .stream
        .clone_dtoh(&out)?
        .iter()
        .map(|v| v.to_f64())
        .collect();
    let detail = case_detail(kernel, tiles, &shape, &what);
    Ok(CheckResult::from_stats(
        "paged_attention",
        detail,
        ErrorStats::of(&got, &reference),
        BF16_TOL,
    ))
}

/// The description of one check case: the kernel, its tiles, the shape and the rows.
fn case_detail(
    kernel: AttentionKernel,
    tiles: Option<MmaConfig>,
    shape: &PagedAttentionShape,
    what: &str,
) -> String {
    let variant = match tiles {
        Some(c) => format!(
            " {} ({} keys, swizzle {})",
            if c.swap_operands { "swapped" } else { "plain" },
            c.keys_per_tile,
            c.swizzle
        ),
        None => String::new(),
    };
    format!(
        "{kernel:?}{variant} kvh={} group={} d_qk={} d_v={} {what}",
        shape.num_kv_heads, shape.group, shape.d_qk, shape.d_v
    )
}

fn check_write(gpu: &GpuContext, seed: u64) -> Result<CheckResult, KernelError> {
    let shape = PagedAttentionShape {
        num_kv_heads: 2,
        group: 1,
        d_qk: 64,
        d_v: 64,
        block_size: 16,
    };
    // A wider block stride, as in the block-major multi-layer pool.
    let base = KvLayout::packed(&shape, 4);
    let layout = KvLayout {
        block_stride: base.block_stride * 3,
        ..base
    };
    let mut r = rng(seed);
    let mut pool = random_bf16(&mut r, layout.min_len(&shape), 1.0);
    let slots: Vec<i64> = vec![0, 17, -1, 63, 35];
    let src = random_bf16(&mut r, slots.len() * shape.num_kv_heads * shape.d_qk, 1.0);
    let att = PagedAttention::new(gpu, shape)?;
    let mut dpool = gpu.stream.clone_htod(&pool)?;
    let dsrc = gpu.stream.clone_htod(&src)?;
    att.write_kv(gpu, &dsrc, &slots, &mut dpool.as_view_mut(), &layout)?;
    paged_kv_write_cpu(&shape, &layout, &src, &slots, &mut pool);
    let got = gpu.stream.clone_dtoh(&dpool)?;
    let mismatches = got
        .iter()
        .zip(&pool)
        .filter(|(a, b)| a.to_bits() != b.to_bits())
        .count();
    Ok(CheckResult::exact(
        "paged_kv_write",
        format!("slots {slots:?}, block stride x3"),
        mismatches,
    ))
}

/// Tensor-core tiles checked against the CPU reference besides the default: the plain kernel
/// with the default's tiles, and swapped operands with padded rows, 32-key tiles, and swizzled
/// rows with a deeper ring (those that the shape takes).
fn tile_variants(default: &MmaConfig) -> [MmaConfig; 4] {
    let sw = MmaConfig {
        swap_operands: true,
        swizzle: false,
        ..*default
    };
    [
        MmaConfig {
            swap_operands: false,
            ..*default
        },
        sw,
        MmaConfig {
            keys_per_tile: 32,
            warps: 4,
            ..sw
        },
        MmaConfig {
            swizzle: true,
            stages: 3,
            warps: 4,
            lazy_rescale: false,
            ..sw
        },
    ]
}

/// The kernels (and tensor-core tiles) a shape is checked with: the warp kernel, the tiled one
/// and the tensor-core one where the shape takes them, the latter also at every
/// [`tile_variants`] it takes.
fn kernels_to_check(s: &PagedAttentionShape) -> Vec<(AttentionKernel, Option<MmaConfig>)> {
    let mut kernels = vec![(AttentionKernel::Warp, None)];
    if tiled_tile(s).is_some() {
        kernels.push((AttentionKernel::Tiled, None));
    }
    if let Some(cfg) = mma_config(s) {
        kernels.push((AttentionKernel::Mma, None));
        kernels.extend(
            tile_variants(&cfg)
                .into_iter()
                .filter(|c| *c != cfg && c.validate_for(s))
                .map(|c| (AttentionKernel::Mma, Some(c))),
        );
    }
    kernels
}

pub fn check_gpu(gpu: &GpuContext, seed: u64) -> Result<Vec<CheckResult>, KernelError> {
    let shapes = [
        PagedAttentionShape {
            num_kv_heads: 2,
            group: 4,
            d_qk: 128,
            d_v: 128,
            block_size: 128,
        },
        PagedAttentionShape {
            num_kv_heads: 1,
            group: 8,
            d_qk: 192,
            d_v: 128,
            block_size: 128,
        },
        PagedAttentionShape {
            num_kv_heads: 1,
            group: 2,
            d_qk: 576,
            d_v: 512,
            block_size: 128,
        },
        // tensor-core kernel: 16 heads per KV head (one token per group)
        PagedAttentionShape {
            num_kv_heads: 1,
            group: 16,
            d_qk: 96,
            d_v: 64,
            block_size: 64,
        },
        // takes the tiled kernel with 16-token tiles
        PagedAttentionShape {
            num_kv_heads: 4,
            group: 2,
            d_qk: 256,
            d_v: 256,
            block_size: 128,
        },
    ];
    let mut out = Vec::new();
    for (i, s) in shapes.iter().enumerate() {
        for (k, tiles) in kernels_to_check(s) {
            for (j, kind) in [CaseKind::Decode, CaseKind::Verify, CaseKind::Prefill]
                .into_iter()
                .enumerate()
            {
                out.push(check_case(
                    gpu,
                    seed + 3 * i as u64 + j as u64,
                    *s,
                    kind,
                    k,
                    tiles,
                )?);
            }
        }
    }
    out.push(check_write(gpu, seed + 100)?);
    Ok(out)
}

/// The layout and the sizes of `q`, `out` and `kv` fit `num_q` query tokens of `sh`, with a
/// positive split: what every paged decode kernel (GQA and MLA) checks before a launch.
pub(crate) fn check_run_buffers(
    sh: &PagedAttentionShape,
    q: &CudaSlice<bf16>,
    kv: &CudaView<'_, bf16>,
    layout: &KvLayout,
    num_q: usize,
    tokens_per_split: usize,
    out: &CudaSlice<bf16>,
) -> Result<(), KernelError> {
    layout.validate(sh)?;
    ensure(tokens_per_split > 0, || {
        "tokens_per_split must be positive".into()
    })?;
    ensure(q.len() >= num_q * sh.num_heads() * sh.d_qk, || {
        "q is too short".into()
    })?;
    ensure(out.len() >= num_q * sh.num_heads() * sh.d_v, || {
        "out is too short".into()
    })?;
    ensure(kv.len() >= layout.min_len(sh), || {
        "kv view is shorter than the layout".into()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::gpu_or_skip;

    fn tiny() -> PagedAttentionShape {
        PagedAttentionShape {
            num_kv_heads: 1,
            group: 2,
            d_qk: 8,
            d_v: 4,
            block_size: 2,
        }
    }

    #[test]
    fn one_key_returns_its_value_prefix() {
        let shape = tiny();
        let layout = KvLayout::packed(&shape, 2);
        let kv: Vec<bf16> = (0..layout.min_len(&shape))
            .map(|i| bf16::from_f32(i as f32))
            .collect();
        let tables = BlockTables {
            max_blocks: 2,
            entries: vec![1, 0],
        };
        let rows = QueryRows::decode(&[1]);
        let q = vec![bf16::from_f32(0.5); 2 * 8];
        let out = paged_attention_cpu(&shape, &layout, &q, &kv, &tables, &rows, 1.0).unwrap();
        // logical token 0 is physical block 1, slot 0: elements 16..24; values are its first 4.
        assert_eq!(out, vec![16.0, 17.0, 18.0, 19.0, 16.0, 17.0, 18.0, 19.0]);
    }

    #[test]
    fn equal_scores_average_the_values() {
        let shape = tiny();
        let layout = KvLayout::packed(&shape, 1);
        let mut kv = vec![bf16::ZERO; layout.min_len(&shape)];
        kv[0] = bf16::from_f32(2.0); // token 0, value dim 0
        kv[8] = bf16::from_f32(4.0); // token 1, value dim 0
        let tables = BlockTables {
            max_blocks: 1,
            entries: vec![0],
        };
        // q is zero: every score is 0, so the output is the mean of the values.
        let q = vec![bf16::ZERO; 16];
        let out = paged_attention_cpu(
            &shape,
            &layout,
            &q,
            &kv,
            &tables,
            &QueryRows::decode(&[2]),
            1.0,
        )
        .unwrap();
        assert_eq!(out[0], 3.0);
    }

    #[test]
    fn out_of_pool_block_is_an_error_not_a_fault() {
        let shape = tiny();
        let layout = KvLayout::packed(&shape, 1);
        let tables = BlockTables {
            max_blocks: 2,
            entries: vec![0, 5],
        };
        let err = QueryRows::decode(&[3])
            .validate(&shape, &layout, &tables)
            .unwrap_err();
        assert!(err.to_string().contains("block 5"), "{err}");
        assert!(
            QueryRows::decode(&[5])
                .validate(&shape, &layout, &tables)
                .is_err()
        );
    }

    #[test]
    fn tiled_kernel_takes_shapes_whose_tiles_fit() {
        let s = |group, d_qk, d_v| PagedAttentionShape {
            num_kv_heads: 1,
            group,
            d_qk,
            d_v,
            block_size: 128,
        };
        assert_eq!(tiled_tile(&s(4, 128, 128)), Some(32));
        assert_eq!(tiled_tile(&s(2, 256, 256)), Some(16));
        assert_eq!(tiled_tile(&s(16, 576, 512)), None);
        assert_eq!(tiled_tile(&s(4, 128, 120)), None);
    }

    #[test]
    fn verify_rows_group_by_sequence() {
        let r = QueryRows::decode_verify(&[10, 3, 7], &[3, 1, 5]);
        assert_eq!(r.kv_end, vec![8, 9, 10, 3, 3, 4, 5, 6, 7]);
        let g = r.groups(4);
        let lens: Vec<i32> = g.iter().map(|g| g.len).collect();
        assert_eq!(lens, vec![3, 1, 4, 1]);
        assert_eq!((g[2].first_row, g[2].kv_end), (4, 6));
        assert_eq!((g[3].first_row, g[3].kv_end), (8, 7));
        // every row lands in exactly one group, in order
        let covered: i32 = g.iter().map(|g| g.len).sum();
        assert_eq!(covered as usize, r.len());
    }

    #[test]
    fn mma_kernel_takes_shapes_that_fit_its_tiles() {
        let s = |group, d_qk, d_v| PagedAttentionShape {
            num_kv_heads: 1,
            group,
            d_qk,
            d_v,
            block_size: 128,
        };
        assert!(mma_config(&s(4, 128, 128)).is_some());
        assert!(mma_config(&s(2, 256, 256)).is_some());
        assert!(mma_config(&s(16, 576, 512)).is_none());
        assert!(mma_config(&s(32, 128, 128)).is_none());
        assert!(mma_config(&s(4, 120, 120)).is_none());
        let c = mma_config(&s(2, 256, 256)).unwrap();
        assert!(c.swizzle && c.row(256) == 256);
        let c96 = mma_config(&s(16, 96, 64)).unwrap();
        assert!(
            !c96.swizzle
                && !MmaConfig {
                    swizzle: true,
                    ..c96
                }
                .validate_for(&s(16, 96, 64))
        );
        for d in [32usize, 64, 96, 128, 192, 256, 576] {
            let row = MmaConfig::padded_row(d);
            assert!(row >= d && (row / 2) % 32 == 16, "d={d} row={row}");
        }
    }

    #[test]
    fn swapped_tiles_hold_eight_query_rows_and_pad_rows_for_ldmatrix() {
        let s = |group, d_qk, d_v| PagedAttentionShape {
            num_kv_heads: 1,
            group,
            d_qk,
            d_v,
            block_size: 128,
        };
        let sw = mma_config(&s(4, 128, 128)).unwrap();
        let base = MmaConfig {
            swap_operands: false,
            ..sw
        };
        // the default where it applies (d <= 128, at most 8 heads per KV head)
        assert!(sw.swap_operands && sw.validate_for(&s(4, 128, 128)));
        assert!(!mma_config(&s(16, 96, 64)).unwrap().swap_operands);
        assert!(!mma_config(&s(2, 256, 256)).unwrap().swap_operands);
        // 8 query rows: two decode-verify tokens of 4 heads (the plain kernel takes four)
        assert_eq!(sw.tokens_per_group(&s(4, 128, 128)), 2);
        assert_eq!(base.tokens_per_group(&s(4, 128, 128)), 4);
        assert_eq!(sw.tokens_per_group(&s(8, 192, 128)), 1);
        assert!(sw.validate_for(&s(8, 192, 128)));
        assert!(!sw.validate_for(&s(16, 96, 64)));
        assert_eq!(sw.function_name(), "paged_attention_mma_t");
        // rows of an odd number of 16-byte chunks: 136 bf16 = 17 chunks at d 128
        assert_eq!(sw.row(128), 136);
        for d in [32usize, 64, 96, 128, 192, 256] {
            let row = MmaConfig::padded_row_swapped(d);
            assert!(row >= d && (row / 8) % 2 == 1, "d={d} row={row}");
        }
        // no shared Q rows: 16 warps x 2 stages x 16 keys x 136 x 2 B
        assert_eq!(sw.smem_bytes(&s(4, 128, 128)), 16 * 2 * 16 * 136 * 2);
        assert_eq!(
            base.smem_bytes(&s(4, 128, 128)),
            (16 + 16 * 2 * 16) * 160 * 2
        );
    }

    #[test]
    fn split_rule_fills_whole_blocks_and_waves() {
        // 64 seqs x 16K decode, 8 KV heads, 16-warp blocks, one block on each of 132 SMs:
        // 16 splits of 1,024 fill every warp in 4 waves (4 x 1,280); 4,096 leaves 12 warps
        // idle (4 x 4,352), 512 needs 8 waves (8 x 768).
        assert_eq!(pick_tokens_per_split(16_384, 512, 16, 132, 128), 1024);
        // one short sequence: as many splits as keep it in one wave, down to one granule
        assert_eq!(pick_tokens_per_split(2_000, 4, 16, 132, 128), 128);
        // a single split when splitting cannot shorten the critical path: one unit whose
        // splits all fit in one block anyway picks the smallest granule...
        assert_eq!(pick_tokens_per_split(1_024, 1, 8, 132, 128), 128);
        // ...and many units still fill each block's warps (a block holds one unit's splits)
        assert_eq!(pick_tokens_per_split(512, 100_000, 4, 132, 128), 128);
        // 8-warp blocks, two per SM: 8 splits of 2,048 = 512 blocks in 2 waves (2 x 2,304)
        // beat 16 of 1,024 (1,024 blocks, 4 waves: 4 x 1,280)
        assert_eq!(pick_tokens_per_split(16_384, 512, 8, 264, 128), 2048);
        // degenerate inputs never divide by zero
        assert_eq!(pick_tokens_per_split(0, 0, 0, 0, 0), 1);
    }

    #[test]
    fn prefill_rows_are_causal() {
        let r = QueryRows::prefill_chunk(3, 10, 3);
        assert_eq!(r.kv_end, vec![11, 12, 13]);
        assert_eq!(r.table_row, vec![3, 3, 3]);
    }

    #[test]
    fn gpu_matches_cpu() {
        let Some(gpu) = gpu_or_skip() else { return };
        crate::check::assert_all_passed(&check_gpu(&gpu, 11).unwrap());
    }
}
