//! MLA-shaped decode attention on tensor cores: one latent KV row per token (576 wide in the
//! served model, the first 512 elements also the value), many query heads per latent (16 by
//! default), paged 128-token blocks, and 1–6 query tokens per sequence (DSpark verification).
//!
//! The GQA tensor-core kernel of [`crate::attention`] gives each warp its own split and keeps a
//! whole 16-row output tile in one warp's registers, which caps the value width at 256. Here a
//! CTA streams each key tile once through shared memory and all its warps share it: each warp
//! computes the scores of a slice of the tile's keys for every row, the warps agree on the
//! running max through shared memory, and each warp accumulates a slice of the 512 value dims.
//! The key range is split across CTAs (flash-decoding style) so that 64 sequences fill 132 SMs;
//! a reduce kernel merges the splits.
//!
//! Semantics, pool layout and block tables are those of [`crate::attention`]
//! ([`PagedAttentionShape`] with `num_kv_heads` latent heads, [`KvLayout`], [`BlockTables`],
//! [`QueryRows`]), and [`paged_attention_cpu`] is the reference.

use std::sync::Mutex;

use cudarc::driver::{CudaFunction, CudaSlice, CudaView, LaunchConfig, PushKernelArg};
use half::bf16;

use crate::attention::{
    AttentionWorkspace, BlockTables, KvLayout, PagedAttentionShape, QueryRows, check_run_buffers,
    paged_attention_cpu, pick_tokens_per_split, random_tables,
};
use crate::check::{BF16_TOL, CheckResult};
use crate::error::{KernelError, ensure};
use crate::gpu::GpuContext;
use crate::testdata::{ErrorStats, random_bf16, rng};

pub(crate) const SRC: &str = include_str!("cuda/mla_attention.cu");
/// Opt-in shared memory per block on sm_90 (227 KiB).
const MAX_DYNAMIC_SMEM: usize = 227 * 1024;
/// Most query tokens of one group: DSpark verifies up to 1 + 5 drafts.
pub const MAX_QUERY_TOKENS: usize = 8;
const REDUCE_THREADS: u32 = 128;

/// Tile parameters of the MLA kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct MlaConfig {
    /// Keys per shared-memory tile (16, 32 or 64; at most the block size).
    pub keys_per_tile: usize,
    /// Warps per CTA: each scores `keys_per_tile / warps` keys and owns `d_v / warps` dims.
    pub warps: usize,
    /// Key tiles in flight (cp.async ring depth), at least 2.
    pub stages: usize,
    /// 16-row m-tiles of (token, head) rows per CTA; a group with more rows takes several CTAs
    /// per split.
    pub m_tiles: usize,
    /// CTAs per SM asked of the compiler (`__launch_bounds__`).
    pub min_blocks: usize,
    /// Q's MMA fragments held in registers for the whole split (one m-tile only) instead of
    /// re-read from shared memory for every key tile.
    #[serde(default)]
    pub q_in_registers: bool,
    /// `cp.async` with the L2 256-byte prefetch hint.
    #[serde(default)]
    pub l2_prefetch: bool,
    /// The swapped-operand kernel (`mla_decode_swapped`): each warp owns 8 (token, head) rows,
    /// every key of a tile and every value dim, so the softmax stays inside the warp and a tile
    /// costs one barrier. `warps` is then the number of 8-row n-tiles per CTA and `m_tiles`
    /// must be 1.
    #[serde(default)]
    pub swapped: bool,
    /// Every key tile through the general copy (per-chunk block choice and bounds check),
    /// also where its rows are contiguous in the pool; for comparing the two copies.
    #[serde(default)]
    pub general_copy: bool,
}

impl MlaConfig {
    /// (token, head) rows of one CTA.
    pub fn rows(&self) -> usize {
        if self.swapped {
            8 * self.warps
        } else {
            16 * self.m_tiles
        }
    }

    /// CTAs per split that cover a group of `max_rows` (token, head) rows.
    pub fn chunks(&self, max_rows: usize) -> usize {
        if self.swapped {
            max_rows.div_ceil(self.rows()).max(1)
        } else {
            row_chunks(max_rows, self.m_tiles).1
        }
    }

    /// The swapped kernel's tiles for `max_rows` rows: the fewest CTAs of at most `most_warps`
    /// warps (8 rows each), then the fewest warps that still cover the rows.
    pub fn swapped_for(
        max_rows: usize,
        most_warps: usize,
        keys_per_tile: usize,
        stages: usize,
        min_blocks: usize,
        q_in_registers: bool,
    ) -> Self {
        let ntiles = max_rows.div_ceil(8).max(1);
        let chunks = ntiles.div_ceil(most_warps.max(1));
        Self {
            keys_per_tile,
            warps: ntiles.div_ceil(chunks),
            stages,
            m_tiles: 1,
            min_blocks,
            q_in_registers,
            l2_prefetch: false,
            swapped: true,
            general_copy: false,
        }
    }

    /// The split kernel's name in the CUDA source.
    pub fn kernel_name(&self) -> &'static str {
        if self.swapped {
            "mla_decode_swapped"
        } else {
            "mla_decode_split"
        }
    }

    /// Shared latent row in bf16 elements: an odd number of 16-byte chunks, so the eight rows
    /// of one ldmatrix phase fall in distinct bank groups.
    pub fn row(d_qk: usize) -> usize {
        d_qk + if (d_qk / 8).is_multiple_of(2) { 8 } else { 0 }
    }

    /// Shared P row (bf16 elements), padded the same way.
    pub fn p_row(&self) -> usize {
        Self::row(self.keys_per_tile)
    }

    /// Dynamic shared memory of one CTA: Q rows, the key ring, the P tile, the max exchange.
    pub fn smem_bytes(&self, shape: &PagedAttentionShape) -> usize {
        let row = Self::row(shape.d_qk);
        if self.swapped {
            // the key ring, and Q's rows unless they stay in registers
            let q_rows = if self.q_in_registers { 0 } else { self.rows() };
            return (self.stages * self.keys_per_tile + q_rows) * row * 2;
        }
        (self.rows() + self.stages * self.keys_per_tile) * row * 2
            + self.rows() * self.p_row() * 2
            + self.warps * self.rows() * 4
    }

    pub fn validate_for(&self, shape: &PagedAttentionShape) -> Result<(), KernelError> {
        if self.swapped {
            return self.validate_swapped(shape);
        }
        ensure(matches!(self.keys_per_tile, 16 | 32 | 64), || {
            format!(
                "keys_per_tile = {} must be 16, 32 or 64",
                self.keys_per_tile
            )
        })?;
        ensure(matches!(self.warps, 2 | 4 | 8), || {
            format!("warps = {} must be 2, 4 or 8", self.warps)
        })?;
        let kpw = self.keys_per_tile / self.warps;
        ensure(kpw == 8 || kpw.is_multiple_of(16), || {
            format!(
                "{} keys per warp: must be 8 or a multiple of 16",
                self.keys_per_tile / self.warps
            )
        })?;
        ensure(
            shape.d_v.is_multiple_of(16 * self.warps) && shape.d_v <= shape.d_qk,
            || {
                format!(
                    "d_v = {} must be a multiple of 16 x warps and at most d_qk",
                    shape.d_v
                )
            },
        )?;
        self.validate_rows_and_blocks(shape)?;
        ensure(self.stages >= 2 && (1..=4).contains(&self.m_tiles), || {
            "stages must be >= 2 and m_tiles in 1..=4".into()
        })?;
        ensure((1..=4).contains(&self.min_blocks), || {
            "min_blocks must be in 1..=4".into()
        })?;
        ensure(!self.q_in_registers || self.m_tiles == 1, || {
            "Q in registers takes one m-tile".into()
        })?;
        // f32 output accumulators per lane: m_tiles x 16 rows x d_v / warps dims / 32 lanes
        let acc = self.m_tiles * 16 * shape.d_v / self.warps / 32;
        ensure(acc <= 128, || {
            format!("{self:?} needs {acc} output registers per lane (at most 128)")
        })?;
        self.validate_shared_memory(shape)
    }

    fn validate_swapped(&self, shape: &PagedAttentionShape) -> Result<(), KernelError> {
        ensure(matches!(self.keys_per_tile, 16 | 32 | 64), || {
            format!(
                "keys_per_tile = {} must be 16, 32 or 64",
                self.keys_per_tile
            )
        })?;
        ensure((1..=8).contains(&self.warps), || {
            format!("warps = {} must be in 1..=8", self.warps)
        })?;
        ensure(self.m_tiles == 1, || {
            "the swapped kernel takes m_tiles = 1".into()
        })?;
        ensure(
            shape.d_v.is_multiple_of(16) && shape.d_v <= shape.d_qk && shape.d_v <= 512,
            || {
                format!(
                    "d_v = {} must be a multiple of 16, at most d_qk and at most 512",
                    shape.d_v
                )
            },
        )?;
        self.validate_rows_and_blocks(shape)?;
        ensure(self.stages >= 2, || "stages must be >= 2".into())?;
        ensure((1..=8).contains(&self.min_blocks), || {
            "min_blocks must be in 1..=8".into()
        })?;
        self.validate_shared_memory(shape)
    }

    /// The checks both kernels share: a key row of whole 32-dim chunks, tiles inside a block.
    fn validate_rows_and_blocks(&self, shape: &PagedAttentionShape) -> Result<(), KernelError> {
        ensure(shape.d_qk.is_multiple_of(32), || {
            format!("d_qk = {} must be a multiple of 32", shape.d_qk)
        })?;
        ensure(shape.block_size >= self.keys_per_tile, || {
            format!(
                "block_size = {} must hold a whole tile of {} keys",
                shape.block_size, self.keys_per_tile
            )
        })?;
        Ok(())
    }

    /// `min_blocks` CTAs of this variant fit in one SM's shared memory.
    fn validate_shared_memory(&self, shape: &PagedAttentionShape) -> Result<(), KernelError> {
        ensure(
            self.smem_bytes(shape) * self.min_blocks <= MAX_DYNAMIC_SMEM,
            || {
                format!(
                    "{self:?} needs {} B of shared memory per CTA (limit {MAX_DYNAMIC_SMEM} per SM)",
                    self.smem_bytes(shape)
                )
            },
        )
    }

    /// The `#define`s of this variant.
    fn defines(&self, shape: &PagedAttentionShape) -> Vec<(&'static str, usize)> {
        if self.swapped {
            let ksteps = shape.d_qk / 16;
            // k-steps loaded together: 4 when they divide the steps and one 16-key m-tile
            // leaves the registers for it, else 2 (ldmatrix of Q loads two steps at once)
            let qg = if ksteps.is_multiple_of(4) && self.keys_per_tile == 16 {
                4
            } else {
                2
            };
            let dtiles = shape.d_v / 16;
            let vg = [4, 2, 1]
                .into_iter()
                .find(|v| dtiles.is_multiple_of(*v))
                .unwrap_or(1);
            return vec![
                ("D_QK", shape.d_qk),
                ("D_V", shape.d_v),
                ("GROUP", shape.group),
                ("MT", 1),
                ("TK", self.keys_per_tile),
                ("NW", self.warps),
                ("STAGES", self.stages),
                ("MINB", self.min_blocks),
                ("ROWP", Self::row(shape.d_qk)),
                ("PROWP", self.p_row()),
                ("QREG", self.q_in_registers as usize),
                ("PF", self.l2_prefetch as usize),
                ("GC", self.general_copy as usize),
                ("SWAPPED", 1),
                ("QG", qg),
                ("VG", vg),
            ];
        }
        vec![
            ("D_QK", shape.d_qk),
            ("D_V", shape.d_v),
            ("GROUP", shape.group),
            ("MT", self.m_tiles),
            ("TK", self.keys_per_tile),
            ("NW", self.warps),
            ("STAGES", self.stages),
            ("MINB", self.min_blocks),
            ("ROWP", Self::row(shape.d_qk)),
            ("PROWP", self.p_row()),
            ("QREG", self.q_in_registers as usize),
            ("PF", self.l2_prefetch as usize),
            ("GC", self.general_copy as usize),
        ]
    }
}

/// The `#define`s of the split kernel for `shape` with tiles `cfg`.
pub(crate) fn defines(shape: &PagedAttentionShape, cfg: &MlaConfig) -> Vec<(&'static str, usize)> {
    cfg.defines(shape)
}

/// Rows of the largest group, m-tiles per CTA and CTAs per split: the fewest CTAs that hold the
/// rows (at most `max_m_tiles` m-tiles each), then the fewest m-tiles that still do, so that a
/// 6-token group of 16 heads (96 rows) runs as 2 CTAs of 3 m-tiles rather than 4 + 2.
pub fn row_chunks(max_rows: usize, max_m_tiles: usize) -> (usize, usize) {
    let tiles = max_rows.div_ceil(16).max(1);
    let chunks = tiles.div_ceil(max_m_tiles.max(1));
    (tiles.div_ceil(chunks), chunks)
}

/// The default tiles for groups of at most `max_rows` (token, head) rows.
///
/// Up to 16 rows (a single-token decode of 16 heads): the shared-tile kernel with 16-key tiles,
/// two warps and four CTAs per SM, with the contiguous copy of whole key tiles; the swapped
/// kernel with the same tiles (see [`MlaConfig::swapped`]) was a few percent slower on the
/// H200, so removing the max exchange's barriers does not pay when the key rows have one
/// m-tile. Tiles of 64 keys shared by 8 warps with Q in registers were 2–3 % faster at 64
/// sequences of 16K, with one CTA per SM; the 16-key tiles stay the default, as they also fill
/// the SMs when a launch has few or short key ranges.
///
/// More rows (DSpark verification, 2–6 tokens of 16 heads): the swapped kernel with 32-key
/// tiles and CTAs of at most 4 warps (32 rows each), two CTAs per SM, through the general copy,
/// which the H200 ran 3–4 % faster than the contiguous one for this kernel (the reverse of the
/// shared-tile kernel, where the contiguous copy gains 10 %; see
/// `hw/measurements/2026-12-02-nvidia-h200-mla-contiguous-copy.md`).
/// Where those do not fit: 64-key tiles shared by 8 warps and the fewest CTAs per split whose
/// m-tiles fit (three m-tiles of 16 rows is the most whose Q rows, key ring and accumulators
/// fit one SM).
pub fn default_config(shape: &PagedAttentionShape, max_rows: usize) -> Option<MlaConfig> {
    let base = MlaConfig {
        keys_per_tile: 64,
        warps: 8,
        stages: 2,
        m_tiles: 1,
        min_blocks: 1,
        q_in_registers: false,
        l2_prefetch: false,
        swapped: false,
        general_copy: false,
    };
    let narrow = MlaConfig {
        keys_per_tile: 32,
        warps: 4,
        ..base
    };
    let single = MlaConfig {
        keys_per_tile: 16,
        warps: 2,
        min_blocks: 4,
        ..base
    };
    // `attention_bench` sweeps both kernels around these tiles, and both copies of each.
    let first = if max_rows <= 16 {
        single
    } else {
        MlaConfig {
            general_copy: true,
            ..MlaConfig::swapped_for(max_rows, 4, 32, 2, 2, false)
        }
    };
    std::iter::once(first)
        .chain([3, 2, 1].into_iter().flat_map(|most| {
            let (m_tiles, _) = row_chunks(max_rows, most);
            [
                MlaConfig { m_tiles, ..base },
                MlaConfig { m_tiles, ..narrow },
            ]
        }))
        .find(|c| c.validate_for(shape).is_ok())
}

/// The query groups of one launch on the device (struct of arrays), validated on upload.
pub struct MlaRows {
    row: CudaSlice<i32>,
    start: CudaSlice<i32>,
    end: CudaSlice<i32>,
    q0: CudaSlice<i32>,
    qn: CudaSlice<i32>,
    groups: usize,
    kv_start: CudaSlice<i32>,
    kv_end: CudaSlice<i32>,
    tables: CudaSlice<i32>,
    max_blocks: usize,
    num_q: usize,
    max_len: usize,
    /// Rows of the largest group (tokens x heads per latent).
    max_rows: usize,
}

impl MlaRows {
    pub fn num_q(&self) -> usize {
        self.num_q
    }

    pub fn max_rows(&self) -> usize {
        self.max_rows
    }
}

/// The compiled MLA decode kernels for one shape.
pub struct MlaAttention {
    pub shape: PagedAttentionShape,
    reduce: CudaFunction,
    /// Tiles forced by [`Self::set_config`]; otherwise [`default_config`] per launch.
    forced: Option<MlaConfig>,
    /// Loaded split kernels with their resident CTAs per SM.
    loaded: Mutex<Vec<(MlaConfig, CudaFunction, usize)>>,
    sm_count: usize,
}

impl MlaAttention {
    pub fn new(gpu: &GpuContext, shape: PagedAttentionShape) -> Result<Self, KernelError> {
        shape.validate()?;
        let probe = default_config(&shape, 16)
            .ok_or_else(|| KernelError::shape(format!("the MLA kernel does not take {shape:?}")))?;
        let reduce = gpu
            .functions(
                "mla_attention",
                SRC,
                &probe.defines(&shape),
                &["mla_reduce"],
            )?
            .remove(0);
        let sm_count = gpu
            .ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map(|v| v.max(1) as usize)
            .unwrap_or(132);
        Ok(Self {
            shape,
            reduce,
            forced: None,
            loaded: Mutex::new(Vec::new()),
            sm_count,
        })
    }

    /// Forces the tiles of every later launch (`None`: the default per launch).
    pub fn set_config(&mut self, cfg: Option<MlaConfig>) -> Result<(), KernelError> {
        if let Some(c) = &cfg {
            c.validate_for(&self.shape)?;
        }
        self.forced = cfg;
        Ok(())
    }

    /// The tiles a launch over `rows` uses.
    pub fn config_for(&self, rows: &MlaRows) -> Result<MlaConfig, KernelError> {
        match self.forced {
            Some(c) => Ok(c),
            None => default_config(&self.shape, rows.max_rows)
                .ok_or_else(|| KernelError::shape(format!("no MLA tiles for {:?}", self.shape))),
        }
    }

    fn kernel(
        &self,
        gpu: &GpuContext,
        cfg: &MlaConfig,
    ) -> Result<(CudaFunction, usize), KernelError> {
        let mut loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, f, b)) = loaded.iter().find(|(c, _, _)| c == cfg) {
            return Ok((f.clone(), *b));
        }
        cfg.validate_for(&self.shape)?;
        let f = gpu
            .functions(
                "mla_attention",
                SRC,
                &cfg.defines(&self.shape),
                &[cfg.kernel_name()],
            )?
            .remove(0);
        let smem = cfg.smem_bytes(&self.shape);
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )?;
        let per_sm = f
            .occupancy_max_active_blocks_per_multiprocessor((cfg.warps * 32) as u32, smem, None)
            .map(|b| b.max(1) as usize)
            .unwrap_or(1);
        loaded.push((*cfg, f.clone(), per_sm));
        Ok((f, per_sm))
    }

    /// CTAs of the split kernel for `cfg` resident on one SM (the occupancy API).
    pub fn resident_per_sm(&self, gpu: &GpuContext, cfg: &MlaConfig) -> Result<usize, KernelError> {
        Ok(self.kernel(gpu, cfg)?.1)
    }

    /// Registers per thread and local-memory (spill) bytes of the split kernel for `cfg`.
    pub fn resources(&self, gpu: &GpuContext, cfg: &MlaConfig) -> Result<(i32, i32), KernelError> {
        use cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES;
        let (f, _) = self.kernel(gpu, cfg)?;
        Ok((
            f.num_regs().unwrap_or(-1),
            f.get_attribute(CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)
                .unwrap_or(-1),
        ))
    }

    pub fn upload(
        &self,
        gpu: &GpuContext,
        layout: &KvLayout,
        tables: &BlockTables,
        rows: &QueryRows,
    ) -> Result<MlaRows, KernelError> {
        layout.validate(&self.shape)?;
        rows.validate(&self.shape, layout, tables)?;
        let g = rows.groups(MAX_QUERY_TOKENS);
        let s = &gpu.stream;
        let nonempty = |v: Vec<i32>| if v.is_empty() { vec![0] } else { v };
        let col = |f: fn(&crate::attention::QueryGroup) -> i32| {
            nonempty(g.iter().map(f).collect::<Vec<_>>())
        };
        Ok(MlaRows {
            row: s.clone_htod(&col(|g| g.table_row))?,
            start: s.clone_htod(&col(|g| g.kv_start))?,
            end: s.clone_htod(&col(|g| g.kv_end))?,
            q0: s.clone_htod(&col(|g| g.first_row))?,
            qn: s.clone_htod(&col(|g| g.len))?,
            groups: g.len(),
            kv_start: s.clone_htod(&nonempty(rows.kv_start.clone()))?,
            kv_end: s.clone_htod(&nonempty(rows.kv_end.clone()))?,
            tables: s.clone_htod(&nonempty(tables.entries.clone()))?,
            max_blocks: tables.max_blocks,
            num_q: rows.len(),
            max_len: g
                .iter()
                .map(|g| (g.kv_end - g.kv_start).max(0) as usize)
                .max()
                .unwrap_or(0),
            max_rows: g.iter().map(|g| g.len as usize).max().unwrap_or(0) * self.shape.group,
        })
    }

    /// As [`Self::upload`], into the buffers of `dst` where they are large enough (new ones,
    /// with room to grow, where not or when `dst` is empty), with the launches planned for key
    /// ranges up to `pad_len` (at least the longest uploaded): splits beyond a row's end are
    /// empty and the reduction skips them, so the output is the same, while the launch
    /// parameters stay fixed as the sequences grow up to `pad_len`. A CUDA graph captured over
    /// these rows then replays for every later upload with the same [`Self::launch_key`].
    /// Returns whether any buffer was reallocated (its address changed). The copies are
    /// synchronous (pageable host memory).
    pub fn upload_into(
        &self,
        gpu: &GpuContext,
        layout: &KvLayout,
        tables: &BlockTables,
        rows: &QueryRows,
        pad_len: usize,
        dst: &mut Option<MlaRows>,
    ) -> Result<bool, KernelError> {
        layout.validate(&self.shape)?;
        rows.validate(&self.shape, layout, tables)?;
        let g = rows.groups(MAX_QUERY_TOKENS);
        let s = &gpu.stream;
        let nonempty = |v: Vec<i32>| if v.is_empty() { vec![0] } else { v };
        let col = |f: fn(&crate::attention::QueryGroup) -> i32| {
            nonempty(g.iter().map(f).collect::<Vec<_>>())
        };
        let data = [
            col(|g| g.table_row),
            col(|g| g.kv_start),
            col(|g| g.kv_end),
            col(|g| g.first_row),
            col(|g| g.len),
            nonempty(rows.kv_start.clone()),
            nonempty(rows.kv_end.clone()),
            nonempty(tables.entries.clone()),
        ];
        let max_len = g
            .iter()
            .map(|g| (g.kv_end - g.kv_start).max(0) as usize)
            .max()
            .unwrap_or(0)
            .max(pad_len);
        let max_rows = g.iter().map(|g| g.len as usize).max().unwrap_or(0) * self.shape.group;
        let mut moved = false;
        let r = match dst.take() {
            Some(r) => r,
            None => {
                moved = true;
                let z = || s.alloc_zeros::<i32>(1);
                MlaRows {
                    row: z()?,
                    start: z()?,
                    end: z()?,
                    q0: z()?,
                    qn: z()?,
                    groups: 0,
                    kv_start: z()?,
                    kv_end: z()?,
                    tables: z()?,
                    max_blocks: 0,
                    num_q: 0,
                    max_len: 0,
                    max_rows: 0,
                }
            }
        };
        let mut r = r;
        let bufs = [
            &mut r.row,
            &mut r.start,
            &mut r.end,
            &mut r.q0,
            &mut r.qn,
            &mut r.kv_start,
            &mut r.kv_end,
            &mut r.tables,
        ];
        for (buf, v) in bufs.into_iter().zip(&data) {
            if buf.len() < v.len() {
                *buf = s.alloc_zeros::<i32>(v.len().next_power_of_two())?;
                moved = true;
            }
            s.memcpy_htod(v, &mut buf.slice_mut(..v.len()))?;
        }
        r.groups = g.len();
        r.max_blocks = tables.max_blocks;
        r.num_q = rows.len();
        r.max_len = max_len;
        r.max_rows = max_rows;
        *dst = Some(r);
        Ok(moved)
    }

    /// Everything the launches over `rows` depend on besides buffer addresses: query rows,
    /// groups, table width, longest key range and largest group. Two uploads with the same key
    /// into the same buffers launch identically.
    pub fn launch_key(rows: &MlaRows) -> [usize; 5] {
        [
            rows.num_q,
            rows.groups,
            rows.max_blocks,
            rows.max_len,
            rows.max_rows,
        ]
    }

    /// Keys per split by [`pick_tokens_per_split`]: one CTA per split, units are (group, latent
    /// head, row chunk), as many CTAs at once as the occupancy API allows.
    pub fn default_tokens_per_split(
        &self,
        gpu: &GpuContext,
        rows: &MlaRows,
    ) -> Result<usize, KernelError> {
        let cfg = self.config_for(rows)?;
        let (_, per_sm) = self.kernel(gpu, &cfg)?;
        let chunks = cfg.chunks(rows.max_rows);
        let units = rows.groups * self.shape.num_kv_heads * chunks;
        Ok(pick_tokens_per_split(
            rows.max_len,
            units,
            1,
            self.sm_count * per_sm,
            128,
        ))
    }

    /// Partial slots (row, head, split) a launch over `rows` at `tokens_per_split` needs in its
    /// workspace ([`Self::ensure_workspace`] allocates exactly this when it must).
    pub fn workspace_slots(&self, rows: &MlaRows, tokens_per_split: usize) -> usize {
        let splits = rows.max_len.div_ceil(tokens_per_split.max(1)).max(1);
        rows.num_q * self.shape.num_heads() * splits
    }

    pub fn workspace(
        &self,
        gpu: &GpuContext,
        rows: &MlaRows,
        tokens_per_split: usize,
    ) -> Result<AttentionWorkspace, KernelError> {
        let splits = rows.max_len.div_ceil(tokens_per_split.max(1)).max(1);
        let n = (rows.num_q * self.shape.num_heads() * splits).max(1);
        AttentionWorkspace::new(gpu, n, self.shape.d_v)
    }

    /// Makes `ws` large enough for `rows` at `tokens_per_split`, keeping it when it already is.
    pub fn ensure_workspace(
        &self,
        gpu: &GpuContext,
        rows: &MlaRows,
        tokens_per_split: usize,
        ws: &mut Option<AttentionWorkspace>,
    ) -> Result<(), KernelError> {
        let splits = rows.max_len.div_ceil(tokens_per_split.max(1)).max(1);
        let n = rows.num_q * self.shape.num_heads() * splits;
        if !ws.as_ref().is_some_and(|w| w.holds(n, self.shape.d_v)) {
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
        rows: &MlaRows,
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
            ws.holds(rows.num_q * sh.num_heads() * max_splits, sh.d_v),
            || "workspace too small for this split".into(),
        )?;
        self.launch_split(
            gpu,
            q,
            kv,
            layout,
            rows,
            (tokens_per_split, max_splits),
            ws,
            scale,
        )?;
        let (tps, ms) = (tokens_per_split as i32, max_splits as i32);
        self.launch_reduce(gpu, rows, (tps, ms), ws, out)
    }

    /// Launches the split kernel of the rows' tiles (compiled on first use): each split's
    /// partial max, sum and output into `ws`, one CTA per row chunk, split and group.
    #[allow(clippy::too_many_arguments)]
    fn launch_split(
        &self,
        gpu: &GpuContext,
        q: &CudaSlice<bf16>,
        kv: &CudaView<'_, bf16>,
        layout: &KvLayout,
        rows: &MlaRows,
        (tokens_per_split, max_splits): (usize, usize),
        ws: &mut AttentionWorkspace,
        scale: f32,
    ) -> Result<(), KernelError> {
        let sh = &self.shape;
        let cfg = self.config_for(rows)?;
        let (f, _) = self.kernel(gpu, &cfg)?;
        let chunks = cfg.chunks(rows.max_rows);
        let (block_stride, row_stride) = (layout.block_stride as i64, layout.row_stride as i32);
        let (max_blocks, kvh, bs) = (
            rows.max_blocks as i32,
            sh.num_kv_heads as i32,
            sh.block_size as i32,
        );
        let (tps, ms) = (tokens_per_split as i32, max_splits as i32);
        let launch = LaunchConfig {
            grid_dim: (
                chunks as u32,
                max_splits as u32,
                (rows.groups * sh.num_kv_heads) as u32,
            ),
            block_dim: ((cfg.warps * 32) as u32, 1, 1),
            shared_mem_bytes: cfg.smem_bytes(sh) as u32,
        };
        let (pm, pl, pacc) = ws.parts_mut();
        let mut b = gpu.stream.launch_builder(&f);
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
            .arg(&tps)
            .arg(&ms)
            .arg(&scale)
            .arg(pm)
            .arg(pl)
            .arg(pacc);
        // SAFETY: shapes were checked above and every block id reachable from the rows on
        // upload; the grid covers exactly the groups, splits and row chunks uploaded.
        unsafe { b.launch(launch) }?;
        Ok(())
    }

    /// Launches the reduction of the splits in `ws` into `out`.
    fn launch_reduce(
        &self,
        gpu: &GpuContext,
        rows: &MlaRows,
        (tps, ms): (i32, i32),
        ws: &mut AttentionWorkspace,
        out: &mut CudaSlice<bf16>,
    ) -> Result<(), KernelError> {
        let sh = &self.shape;
        let heads = sh.num_heads() as i32;
        let cfg_r = LaunchConfig {
            grid_dim: (rows.num_q as u32, sh.num_heads() as u32, 1),
            block_dim: (REDUCE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (pm, pl, pacc) = ws.parts_mut();
        let mut b = gpu.stream.launch_builder(&self.reduce);
        b.arg(&rows.kv_start)
            .arg(&rows.kv_end)
            .arg(&tps)
            .arg(&ms)
            .arg(&heads)
            .arg(&*pm)
            .arg(&*pl)
            .arg(&*pacc)
            .arg(out);
        // SAFETY: workspace and output sizes checked above.
        unsafe { b.launch(cfg_r) }?;
        Ok(())
    }
}

/// The served model's MLA shape: one latent of 576 (512 value + 64 rope dims), `group` query
/// heads, 128-token blocks.
pub fn spec_shape(group: usize) -> PagedAttentionShape {
    PagedAttentionShape {
        num_kv_heads: 1,
        group,
        d_qk: 576,
        d_v: 512,
        block_size: 128,
    }
}

/// One GPU check: `kv_lens[i]` keys and `query_lens[i]` verification tokens per sequence.
fn check_case(
    gpu: &GpuContext,
    seed: u64,
    shape: PagedAttentionShape,
    kv_lens: &[usize],
    query_lens: &[usize],
    cfg: Option<MlaConfig>,
    tokens_per_split: usize,
) -> Result<CheckResult, KernelError> {
    let mut r = rng(seed);
    let bs = shape.block_size;
    let max_blocks = kv_lens.iter().max().copied().unwrap_or(1).div_ceil(bs);
    let nb = kv_lens.len() * max_blocks + 3;
    let tables = random_tables(seed, kv_lens.len(), max_blocks, nb);
    let rows = QueryRows::decode_verify(kv_lens, query_lens);
    let layout = KvLayout::packed(&shape, nb);
    let kv = random_bf16(&mut r, layout.min_len(&shape), 1.0);
    let q = random_bf16(&mut r, rows.len() * shape.num_heads() * shape.d_qk, 1.0);
    let scale = 1.0 / (shape.d_qk as f64).sqrt();
    let reference = paged_attention_cpu(&shape, &layout, &q, &kv, &tables, &rows, scale)?;
    let mut att = MlaAttention::new(gpu, shape)?;
    att.set_config(cfg)?;
    let d_rows = att.upload(gpu, &layout, &tables, &rows)?;
    let used = att.config_for(&d_rows)?;
    let (dq, dkv) = (gpu.stream.clone_htod(&q)?, gpu.stream.clone_htod(&kv)?);
    // Poisoned output and partials: anything the kernels do not write shows up as NaN.
    let mut out = gpu.stream.clone_htod(&vec![bf16::NAN; reference.len()])?;
    let mut ws = att.workspace(gpu, &d_rows, tokens_per_split)?;
    ws.poison(gpu)?;
    att.run(
        gpu,
        &dq,
        &dkv.as_view(),
        &layout,
        &d_rows,
        tokens_per_split,
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
    Ok(CheckResult::from_stats(
        "mla_attention",
        format!(
            "kvh={} group={} d_qk={} d_v={} bs={} kv lens {kv_lens:?} query tokens {query_lens:?} split {tokens_per_split}; {} tiles {} keys x {} warps x {} stages x {} m-tiles{}{}",
            shape.num_kv_heads,
            shape.group,
            shape.d_qk,
            shape.d_v,
            shape.block_size,
            if used.swapped { "swapped" } else { "shared" },
            used.keys_per_tile,
            used.warps,
            used.stages,
            used.m_tiles,
            if used.q_in_registers {
                ", Q in registers"
            } else {
                ""
            },
            if used.general_copy {
                ", general copy"
            } else {
                ""
            }
        ),
        ErrorStats::of(&got, &reference),
        BF16_TOL,
    ))
}

/// Ragged lengths: a single key, lengths inside and at block ends, tiles crossing blocks
/// (splits of 96 or 200 keys).
const DECODE_LENS: [usize; 6] = [1, 127, 128, 3 * 128 + 17, 5 * 128 + 1, 1000];
/// Verification over keys of such lengths, with every verification length of DSpark.
const VERIFY_LENS: [usize; 6] = [6, 131, 256, 589, 700, 1500];
const VERIFY_Q: [usize; 6] = [6, 1, 4, 3, 5, 2];
const ONES: [usize; 6] = [1; 6];

/// (shape, kv lens, query tokens, tiles (default when `None`), tokens per split)
type MlaCase = (
    PagedAttentionShape,
    &'static [usize],
    &'static [usize],
    Option<MlaConfig>,
    usize,
);

/// Shared-tile kernel tiles with K and V from shared memory.
fn shared_tiles(
    keys_per_tile: usize,
    warps: usize,
    stages: usize,
    m_tiles: usize,
) -> Option<MlaConfig> {
    Some(MlaConfig {
        keys_per_tile,
        warps,
        stages,
        m_tiles,
        min_blocks: 1,
        q_in_registers: false,
        l2_prefetch: false,
        swapped: false,
        general_copy: false,
    })
}

/// Shared-tile kernel tiles with Q in registers and the L2 prefetch.
fn qreg_tiles(keys_per_tile: usize, warps: usize, min_blocks: usize) -> Option<MlaConfig> {
    Some(MlaConfig {
        keys_per_tile,
        warps,
        stages: 2,
        m_tiles: 1,
        min_blocks,
        q_in_registers: true,
        l2_prefetch: true,
        swapped: false,
        general_copy: false,
    })
}

/// The swapped kernel for `rows` rows, CTAs of at most `most` warps.
fn swapped_tiles(
    rows: usize,
    most: usize,
    keys_per_tile: usize,
    stages: usize,
    q_in_registers: bool,
) -> Option<MlaConfig> {
    Some(MlaConfig::swapped_for(
        rows,
        most,
        keys_per_tile,
        stages,
        1,
        q_in_registers,
    ))
}

/// The shared-tile kernel at the served shape: default and swept tiles, decode and
/// verification, splits inside and across blocks.
fn shared_kernel_cases() -> Vec<MlaCase> {
    let spec = spec_shape(16);
    let (c, qreg) = (shared_tiles, qreg_tiles);
    vec![
        (spec, &DECODE_LENS, &ONES, None, 256),
        (spec, &DECODE_LENS, &ONES, None, 96),
        (spec, &VERIFY_LENS, &VERIFY_Q, None, 256),
        (spec, &VERIFY_LENS, &VERIFY_Q, c(32, 4, 3, 2), 128),
        (spec, &DECODE_LENS, &ONES, c(32, 4, 4, 1), 384),
        (spec, &VERIFY_LENS, &VERIFY_Q, c(64, 4, 2, 1), 512),
        (spec, &VERIFY_LENS, &VERIFY_Q, c(64, 8, 2, 2), 2048),
        (spec, &DECODE_LENS, &ONES, c(16, 2, 2, 1), 128),
        (spec, &VERIFY_LENS, &VERIFY_Q, c(16, 2, 3, 1), 96),
        (spec, &DECODE_LENS, &ONES, qreg(64, 8, 1), 256),
        (spec, &DECODE_LENS, &ONES, qreg(32, 4, 2), 96),
        // every tile through the general copy, also the contiguous ones
        (
            spec,
            &DECODE_LENS,
            &ONES,
            c(16, 2, 2, 1).map(|t| MlaConfig {
                general_copy: true,
                ..t
            }),
            256,
        ),
    ]
}

/// The swapped kernel: 64-key tiles across block ends (splits of 96), 16-key tiles across
/// them (splits of 200), verification over 6 and 5 warps per CTA (the last CTA of a group,
/// and groups of fewer tokens, have warps with no rows), Q in registers, two latent heads and
/// 64-token blocks.
fn swapped_kernel_cases() -> Vec<MlaCase> {
    let spec = spec_shape(16);
    let sw = swapped_tiles;
    vec![
        (spec, &DECODE_LENS, &ONES, sw(16, 2, 64, 2, false), 96),
        (spec, &DECODE_LENS, &ONES, sw(16, 2, 16, 4, false), 200),
        (spec, &DECODE_LENS, &ONES, sw(16, 2, 16, 4, true), 128),
        (spec, &DECODE_LENS, &ONES, sw(16, 1, 32, 3, false), 384),
        (spec, &VERIFY_LENS, &VERIFY_Q, sw(96, 8, 16, 3, false), 256),
        (
            spec,
            &VERIFY_LENS,
            &VERIFY_Q,
            Some(MlaConfig {
                warps: 5,
                ..MlaConfig::swapped_for(96, 8, 32, 2, 1, false)
            }),
            200,
        ),
        (spec, &VERIFY_LENS, &VERIFY_Q, sw(96, 4, 16, 2, true), 96),
        (
            PagedAttentionShape {
                num_kv_heads: 2,
                group: 8,
                ..spec
            },
            &VERIFY_LENS,
            &VERIFY_Q,
            sw(48, 8, 16, 3, false),
            256,
        ),
        (
            PagedAttentionShape {
                block_size: 64,
                ..spec
            },
            &VERIFY_LENS,
            &VERIFY_Q,
            sw(96, 4, 64, 2, false),
            96,
        ),
    ]
}

/// Other shapes at the default tiles.
fn other_shape_cases() -> Vec<MlaCase> {
    let spec = spec_shape(16);
    vec![
        // 8 heads per latent: two tokens per m-tile; two latent heads
        (
            PagedAttentionShape {
                num_kv_heads: 2,
                group: 8,
                ..spec
            },
            &VERIFY_LENS,
            &VERIFY_Q,
            None,
            256,
        ),
        // 64-token blocks: tiles of 64 keys at split starts inside a block
        (
            PagedAttentionShape {
                block_size: 64,
                ..spec
            },
            &VERIFY_LENS,
            &VERIFY_Q,
            None,
            96,
        ),
    ]
}

pub fn check_gpu(gpu: &GpuContext, seed: u64) -> Result<Vec<CheckResult>, KernelError> {
    let cases = shared_kernel_cases()
        .into_iter()
        .chain(swapped_kernel_cases())
        .chain(other_shape_cases());
    let mut out = Vec::new();
    for (i, (shape, lens, qlens, cfg, tps)) in cases.enumerate() {
        out.push(check_case(
            gpu,
            seed + i as u64,
            shape,
            lens,
            qlens,
            cfg,
            tps,
        )?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::gpu_or_skip;

    #[test]
    fn default_tiles_fit_the_spec_shape() {
        let s = spec_shape(16);
        for rows in [16, 32, 48, 64, 96, 128] {
            let c = default_config(&s, rows).unwrap();
            c.validate_for(&s).unwrap();
            assert!(c.smem_bytes(&s) <= MAX_DYNAMIC_SMEM, "{c:?}");
        }
        let one = default_config(&s, 16).unwrap();
        let swapped = MlaConfig::swapped_for(16, 2, 16, 3, 3, false);
        assert!(swapped.swapped);
        swapped.validate_for(&s).unwrap();
        // three stages of 16 x 584 and Q 16 x 584 (bf16): three CTAs fit in 227 KiB
        assert_eq!(swapped.smem_bytes(&s), (48 + 16) * 584 * 2);
        let shared = MlaConfig {
            keys_per_tile: 16,
            warps: 2,
            stages: 2,
            m_tiles: 1,
            min_blocks: 4,
            q_in_registers: false,
            l2_prefetch: false,
            swapped: false,
            general_copy: false,
        };
        assert_eq!(one, shared);
        // Q 16 x 584, two stages of 16 x 584, P 16 x 24 (bf16), maxima 2 x 16 (f32): four
        // CTAs fit in 227 KiB
        assert_eq!(
            shared.smem_bytes(&s),
            (16 + 32) * 584 * 2 + 16 * 24 * 2 + 2 * 16 * 4
        );
        shared.validate_for(&s).unwrap();
        // Verification: 6 tokens x 16 heads = 12 n-tiles of 8 rows, 3 swapped CTAs of 4 warps
        // over 32-key tiles, two per SM.
        let six = default_config(&s, 96).unwrap();
        assert!(six.swapped);
        assert_eq!(
            (six.keys_per_tile, six.warps, six.chunks(96), six.min_blocks),
            (32, 4, 3, 2)
        );
        let two = default_config(&s, 32).unwrap();
        assert_eq!((two.swapped, two.warps, two.chunks(32)), (true, 4, 1));
        // the swapped kernel copies through the general path, the shared-tile one does not
        assert!(six.general_copy && two.general_copy && !one.general_copy);
    }

    #[test]
    fn swapped_tiles_cover_the_rows_with_the_fewest_warps() {
        let s = spec_shape(16);
        let c = |rows, most| MlaConfig::swapped_for(rows, most, 16, 2, 1, false);
        // 6 tokens x 16 heads = 12 n-tiles of 8 rows: 2 CTAs of 6 warps
        assert_eq!((c(96, 8).warps, c(96, 8).chunks(96)), (6, 2));
        assert_eq!((c(96, 2).warps, c(96, 2).chunks(96)), (2, 6));
        assert_eq!((c(16, 8).warps, c(16, 8).chunks(16)), (2, 1));
        // a chunk of 5 warps over 96 rows: 3 CTAs, the last with 16 live rows
        let five = MlaConfig {
            warps: 5,
            ..c(96, 8)
        };
        assert_eq!(five.chunks(96), 3);
        for rows in [16, 32, 64, 96] {
            c(rows, 8).validate_for(&s).unwrap();
        }
        // the swapped kernel takes one m-tile and at most 8 warps
        assert!(
            MlaConfig {
                m_tiles: 2,
                ..c(16, 2)
            }
            .validate_for(&s)
            .is_err()
        );
        assert!(
            MlaConfig {
                warps: 9,
                ..c(16, 2)
            }
            .validate_for(&s)
            .is_err()
        );
        // five 16-key stages and Q (96 KB) do not fit three times in one SM
        assert!(
            MlaConfig {
                stages: 5,
                min_blocks: 3,
                ..c(16, 2)
            }
            .validate_for(&s)
            .is_err()
        );
    }

    #[test]
    fn rows_split_into_even_chunks() {
        assert_eq!(row_chunks(16, 2), (1, 1));
        assert_eq!(row_chunks(32, 2), (2, 1));
        // 6 verification tokens x 16 heads = 96 rows: 3 CTAs of 2 m-tiles
        assert_eq!(row_chunks(96, 2), (2, 3));
        assert_eq!(row_chunks(96, 4), (3, 2));
        assert_eq!(row_chunks(80, 4), (3, 2));
        assert_eq!(row_chunks(0, 2), (1, 1));
    }

    #[test]
    fn invalid_tiles_are_errors() {
        let s = spec_shape(16);
        // The shared-tile kernel's tiles for 2 tokens of 16 heads (32 rows, two m-tiles).
        let ok = MlaConfig {
            keys_per_tile: 64,
            warps: 8,
            stages: 2,
            m_tiles: 2,
            min_blocks: 1,
            q_in_registers: false,
            l2_prefetch: false,
            swapped: false,
            general_copy: false,
        };
        ok.validate_for(&s).unwrap();
        // 4 keys per warp
        assert!(
            MlaConfig {
                keys_per_tile: 32,
                warps: 8,
                ..ok
            }
            .validate_for(&s)
            .is_err()
        );
        // three 64-key stages of 576-wide rows exceed shared memory
        assert!(MlaConfig { stages: 3, ..ok }.validate_for(&s).is_err());
        // Q in registers takes one m-tile
        assert!(
            MlaConfig {
                q_in_registers: true,
                ..ok
            }
            .validate_for(&s)
            .is_err()
        );
        // 4 m-tiles x 16 rows x 128 dims per warp = 256 accumulators per lane
        assert!(
            MlaConfig {
                warps: 4,
                m_tiles: 4,
                keys_per_tile: 32,
                min_blocks: 1,
                ..ok
            }
            .validate_for(&s)
            .is_err()
        );
        // a tile may not span more than two blocks
        let small = PagedAttentionShape {
            block_size: 32,
            ..s
        };
        assert!(ok.validate_for(&small).is_err());
    }

    #[test]
    fn reference_reads_values_from_the_latent_prefix() {
        // One key: the output of every head is the key's first d_v elements (small integers,
        // exact in bf16).
        let shape = PagedAttentionShape {
            num_kv_heads: 1,
            group: 16,
            d_qk: 576,
            d_v: 512,
            block_size: 128,
        };
        let layout = KvLayout::packed(&shape, 1);
        let kv: Vec<bf16> = (0..layout.min_len(&shape))
            .map(|i| bf16::from_f32((i % 128) as f32))
            .collect();
        let tables = BlockTables {
            max_blocks: 1,
            entries: vec![0],
        };
        let q = vec![bf16::from_f32(0.25); 16 * 576];
        let out = paged_attention_cpu(
            &shape,
            &layout,
            &q,
            &kv,
            &tables,
            &QueryRows::decode(&[1]),
            0.1,
        )
        .unwrap();
        for h in 0..16 {
            for d in [0usize, 100, 511] {
                assert_eq!(out[h * 512 + d], (d % 128) as f64);
            }
        }
    }

    #[test]
    fn gpu_matches_cpu() {
        let Some(gpu) = gpu_or_skip() else { return };
        crate::check::assert_all_passed(&check_gpu(&gpu, 91).unwrap());
    }

    /// Verification rows (3 query tokens per sequence) of the served shape uploaded in place
    /// with the launches planned for a longer key range ([`MlaAttention::upload_into`]), and
    /// uploaded plainly, each at its default split, against the CPU reference; the in-place
    /// upload is reused for a second set of rows.
    #[test]
    fn gpu_padded_plan_matches_cpu() {
        let Some(gpu) = gpu_or_skip() else { return };
        let shape = spec_shape(16);
        let att = MlaAttention::new(&gpu, shape).unwrap();
        let mut kept = None;
        for (seed, seqs, q, kv0) in [
            (5u64, 32usize, 3usize, 900usize),
            (6, 8, 1, 1000),
            (7, 32, 3, 1100),
        ] {
            let kv_lens: Vec<usize> = (0..seqs).map(|i| kv0 + 3 * i).collect();
            let q_lens = vec![q; seqs];
            let mut r = rng(seed);
            let bs = shape.block_size;
            let max_kv = kv_lens.iter().max().copied().unwrap() + q;
            let max_blocks = max_kv.div_ceil(bs);
            let nb = seqs * max_blocks + 3;
            let tables = random_tables(seed, seqs, max_blocks, nb);
            let rows = QueryRows::decode_verify(&kv_lens, &q_lens);
            let layout = KvLayout::packed(&shape, nb);
            let kv = random_bf16(&mut r, layout.min_len(&shape), 1.0);
            let qv = random_bf16(&mut r, rows.len() * shape.num_heads() * shape.d_qk, 1.0);
            let scale = 1.0 / (shape.d_qk as f64).sqrt();
            let reference =
                paged_attention_cpu(&shape, &layout, &qv, &kv, &tables, &rows, scale).unwrap();
            let s = &gpu.stream;
            let (dq, dkv) = (s.clone_htod(&qv).unwrap(), s.clone_htod(&kv).unwrap());
            let plain = att.upload(&gpu, &layout, &tables, &rows).unwrap();
            att.upload_into(&gpu, &layout, &tables, &rows, 2048, &mut kept)
                .unwrap();
            for (what, d_rows) in [("plain", &plain), ("padded", kept.as_ref().unwrap())] {
                let tps = att.default_tokens_per_split(&gpu, d_rows).unwrap();
                let mut ws = att.workspace(&gpu, d_rows, tps).unwrap();
                ws.poison(&gpu).unwrap();
                let mut out = s.clone_htod(&vec![bf16::NAN; reference.len()]).unwrap();
                att.run(
                    &gpu,
                    &dq,
                    &dkv.as_view(),
                    &layout,
                    d_rows,
                    tps,
                    &mut ws,
                    scale as f32,
                    &mut out,
                )
                .unwrap();
                let got: Vec<f64> = s
                    .clone_dtoh(&out)
                    .unwrap()
                    .iter()
                    .map(|v| v.to_f64())
                    .collect();
                let res = CheckResult::from_stats(
                    "mla_attention",
                    format!("{what}: {seqs} seqs x {q} tokens from {kv0} keys, split {tps}"),
                    ErrorStats::of(&got, &reference),
                    crate::check::BF16_TOL,
                );
                println!("{res:?}");
                crate::check::assert_all_passed(&[res]);
            }
        }
    }
}
