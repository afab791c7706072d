//! The CUDA backend: executes the simulator's step plans on a GPU for the scaled-down model of
//! [`model`], timing each plan with CUDA events.
//!
//! * Prefill chunks run the encoder over their new tokens (sliding-window attention continuing
//!   from the sequence's SWA ring, or truncated at the chunk start when the ring does not hold
//!   the window: encoder-side bounded replay), project the global KV and write it into the
//!   paged HBM pool (128-token blocks, one block table row per sequence); a chunk with
//!   `decoder_tokens > 0` then runs the decoder over the last `decoder_tokens` positions with
//!   its SWA truncated at the replay start (decoder-side bounded replay) and cross-attention
//!   over the whole global KV, computes the last token's logits and stores the SWA rings to a
//!   host slot.
//! * Decode steps run each sequence's 1 + verified drafts query tokens through both stacks
//!   (SWA through the rings with the paged kernel, global KV causal inside the step) and the LM
//!   head. The model is random, so acceptance cannot come from the logits: the accepted prefix
//!   is a seeded draw where each verified draft is accepted with probability
//!   [`BackendConfig::draft_acceptance`] while the prefix holds.
//! * Blocks and rings move between HBM and pinned host memory ([`tiers`]); swap-ins run as a
//!   gather kernel over mapped pinned memory on a copy stream that overlaps the encoder, and
//!   join the compute stream before the decoder reads the global KV. Below the host pool, an
//!   optional SSD tier ([`disk`], `disk_blocks > 0`): host blocks of the least recently used
//!   sequences spill to a file on a background thread, and are read back into pinned host
//!   blocks when a step needs them on the device.
//!
//! Token ids are a hash of (seed, request, position): the plans carry no text.

pub mod disk;
pub mod model;
pub mod tiers;
mod transfer;

pub(crate) mod forward;

pub use forward::PhaseTimes;
#[cfg(test)]
pub(crate) use forward::check_prefill_plan;
pub use forward::device_decode::GraphStats;

use std::collections::BTreeSet;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUevent_flags};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, PinnedHostSlice};
use half::bf16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use servelab_core::ConfigError;
use servelab_core::engine::plan::{
    Backend, DecodePlan, PrefillPlan, RankOutcome, SeqOutcome, StepPlan, StepReport,
};
use servelab_core::seed::sub_seed;
use servelab_core::time::Nanos;
use servelab_kernels::attention::{KvLayout, PagedAttention};
use servelab_kernels::fill::gather_blocks_on;
use servelab_kernels::mla_attention::MlaAttention;
use servelab_kernels::moe::MoeRouter;
use servelab_kernels::norm::RmsNorm;
use servelab_kernels::ops::Ops;
use servelab_kernels::prefill_attention::{self, PrefillAttention};
use servelab_kernels::rope::{Rope, RopeShape};
use servelab_kernels::sampling::Sampler;
use servelab_kernels::swa::{SwaAttention, SwaShape};
use servelab_kernels::{GpuContext, KernelError};

pub use disk::DiskTier;
pub use model::{AttentionKind, ModelShape, ModelWeights};
pub use tiers::{BlockLoc, Moves, TierError, Tiers};

/// Sizes of the pools and the acceptance draw.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BackendConfig {
    pub model: ModelShape,
    /// Global KV blocks in HBM.
    pub hbm_blocks: usize,
    /// Global KV blocks in pinned host memory (the swap tier).
    pub host_blocks: usize,
    /// Global KV blocks in the SSD tier's file (0: no SSD tier; host evictions drop KV).
    pub disk_blocks: usize,
    /// Folder of the SSD tier's file (default: the system temporary folder).
    pub disk_dir: Option<std::path::PathBuf>,
    /// Sequences whose SWA rings fit on the device at once.
    pub ring_slots: usize,
    /// Host SWA slots (stored rings).
    pub swa_host_slots: usize,
    /// Probability that each verified draft is accepted, given the drafts before it were.
    pub draft_acceptance: f64,
    /// Seed of the acceptance draw and of the token ids.
    pub seed: u64,
    /// HBM blocks of each prefill engine's region when the pool is split by unit device
    /// ([`Self::unit_devices`]); 0: every region gets an equal share of `hbm_blocks`.
    pub prefill_region_blocks: usize,
    /// The serving unit's devices sharing this GPU, (prefill engines, decode groups): the HBM
    /// pool is split into one region per device and every region gets `ring_slots` rings
    /// ([`tiers`]). None: one region that every plan uses (calibration, benches).
    #[serde(skip)]
    pub unit_devices: Option<(u32, u32)>,
    /// How decode steps run ([`DecodeMode`]): `eager` (the default), `device-moe` or `graph`.
    /// Written in the config, so that a conformance record says which mode made it.
    pub decode_mode: DecodeMode,
}

impl Default for BackendConfig {
    fn default() -> Self {
        Self {
            model: ModelShape::default(),
            hbm_blocks: 4096,
            host_blocks: 1024,
            disk_blocks: 0,
            disk_dir: None,
            ring_slots: 256,
            swa_host_slots: 512,
            draft_acceptance: 0.75,
            seed: 1,
            prefill_region_blocks: 0,
            unit_devices: None,
            decode_mode: DecodeMode::Eager,
        }
    }
}

impl BackendConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.model.validate()?;
        for (name, v) in [
            ("hbm_blocks", self.hbm_blocks),
            ("host_blocks", self.host_blocks),
            ("ring_slots", self.ring_slots),
            ("swa_host_slots", self.swa_host_slots),
        ] {
            if v == 0 || v > i32::MAX as usize / 2 {
                return Err(ConfigError::invalid(
                    format!("backend.{name}"),
                    format!("{v} must be in 1..2^30"),
                ));
            }
        }
        if self.disk_blocks > i32::MAX as usize / 2 {
            return Err(ConfigError::invalid(
                "backend.disk_blocks",
                format!("{} must be below 2^30", self.disk_blocks),
            ));
        }
        if !(0.0..=1.0).contains(&self.draft_acceptance) {
            return Err(ConfigError::invalid(
                "backend.draft_acceptance",
                "must lie in [0, 1]",
            ));
        }
        if self.unit_devices.is_some() {
            let blocks = self.region_blocks();
            if blocks.contains(&0) {
                return Err(ConfigError::invalid(
                    "backend.prefill_region_blocks",
                    format!(
                        "{} blocks per prefill engine leave {:?} for the regions of the unit's \
                         devices (raise backend.hbm_blocks = {})",
                        self.prefill_region_blocks, blocks, self.hbm_blocks
                    ),
                ));
            }
        }
        Ok(())
    }

    /// HBM blocks of each region: prefill engines first, then decode groups (one region of
    /// `hbm_blocks` without [`Self::unit_devices`]).
    pub fn region_blocks(&self) -> Vec<usize> {
        let Some((p, g)) = self.unit_devices else {
            return vec![self.hbm_blocks];
        };
        let (p, g) = (p as usize, g as usize);
        let n = (p + g).max(1);
        let pre = if self.prefill_region_blocks > 0 {
            self.prefill_region_blocks
        } else {
            self.hbm_blocks / n
        };
        let rest = self.hbm_blocks.saturating_sub(p * pre);
        let dec = rest.checked_div(g).unwrap_or(0);
        let mut v = vec![pre; p];
        v.extend(std::iter::repeat_n(dec, g));
        v
    }

    /// Rings in all regions together.
    fn total_ring_slots(&self) -> usize {
        self.ring_slots * self.region_blocks().len()
    }

    /// Elements of one SWA ring slot: two blocks of every layer.
    pub(crate) fn ring_slot_elems(&self) -> usize {
        2 * self.model.layers() * self.model.block_size * self.model.kv_row()
    }
}

/// Why a plan could not run.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error(transparent)]
    Tier(#[from] TierError),
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("invalid plan: {0}")]
    Plan(String),
    #[error("SSD tier: {0}")]
    Disk(#[from] std::io::Error),
}

/// How decode steps run on the device. Prefill steps always run launch by launch with
/// host-sized MoE (their expert GEMMs are large and device-bound already).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DecodeMode {
    /// Launch by launch; each MoE layer copies its per-expert counts to the host to size the
    /// expert GEMMs, and the step's buffers are allocated per step.
    #[default]
    Eager,
    /// Launch by launch, but nothing waits on the device: experts sized on the device (a
    /// padded layout, see `forward::PaddedMoe`) and inputs in buffers kept between steps.
    DeviceMoe,
    /// As `DeviceMoe`, with the step's launches captured once per launch shape into a CUDA
    /// graph and replayed (MLA models; a GQA model runs as `DeviceMoe`).
    Graph,
}

/// The compiled kernels the forward pass uses.
pub(crate) struct Kernels {
    /// The GQA split kernels, and the KV row writes of both shapes.
    pub att: PagedAttention,
    /// The MLA decode kernel, which runs every attention of an MLA model (global and sliding
    /// window, decode and prefill); `None` for GQA.
    pub mla: Option<MlaAttention>,
    /// Tensor-core causal prefill attention (`None` for head widths it does not take, and
    /// for MLA).
    pub prefill: Option<PrefillAttention>,
    /// The CUDA-core sliding-window kernel (GQA only).
    pub swa: Option<SwaAttention>,
    pub norm: RmsNorm,
    pub rope_q: Rope,
    pub rope_k: Rope,
    pub router: MoeRouter,
    pub ops: Ops,
    pub sampler: Sampler,
}

/// Executes [`StepPlan`]s on one GPU. See the module docs.
pub struct CudaBackend {
    pub(crate) gpu: Arc<GpuContext>,
    pub(crate) cfg: BackendConfig,
    pub(crate) w: ModelWeights,
    pub(crate) k: Kernels,
    /// Global KV pool `[hbm_blocks][global layers][block_size][kv_row]`.
    pub(crate) pool: CudaSlice<bf16>,
    /// SWA rings `[ring_slots * 2][layers][block_size][kv_row]`.
    pub(crate) rings: CudaSlice<bf16>,
    /// Kept alive: the gather kernel reads and writes it through `host_pool_dptr`.
    #[allow(dead_code)]
    host_pool: PinnedHostSlice<u8>,
    host_pool_dptr: sys::CUdeviceptr,
    swa_host: PinnedHostSlice<bf16>,
    copy: Arc<CudaStream>,
    disk: Option<DiskTier>,
    pub(crate) tiers: Tiers,
    accept_rng: ChaCha8Rng,
    /// Greedy token of the last row of each prefill chunk with a decoder replay, and of every
    /// decode query token, from the last plan (for correctness checks).
    pub last_tokens: Vec<i32>,
    /// The f32 logits behind `last_tokens` when [`Self::keep_logits`] is set.
    pub last_logits: Vec<f32>,
    pub keep_logits: bool,
    /// Activations kept between steps (the largest a step needed so far).
    pub(crate) scratch: Option<forward::Scratch>,
    /// Phase boundaries of the running step, when phase timing is on.
    pub(crate) phases: Option<forward::PhaseLog>,
    /// Device time of the last step by phase, when phase timing is on.
    pub last_phases: Option<PhaseTimes>,
    /// Host wall time of the last plan from the start of [`Self::try_execute`] until its last
    /// launch was issued (before the greedy tokens are copied back, or the end event when
    /// none are): planning, copies, launches, and every wait on the device inside the step.
    pub last_host_issue: std::time::Duration,
    /// When the running step issued its last launch (set before the tokens' copy back).
    pub(crate) issued_at: Option<std::time::Instant>,
    /// The running decode step's end event, and whether [`Self::mark_issued`] recorded it.
    pub(crate) decode_end: Option<(cudarc::driver::CudaEvent, bool)>,
    /// Kept inputs, outputs and graphs of device-bound decode steps.
    pub(crate) decode_bufs: Option<forward::DecodeBuffers>,
    /// Routed rows per (layer, expert) since logging was turned on ([`Self::log_routing`]).
    pub(crate) route_log: Option<std::cell::RefCell<Vec<Vec<u64>>>>,
}

impl CudaBackend {
    /// Compiles the kernels, draws the weights and allocates both tiers.
    pub fn new(gpu: Arc<GpuContext>, cfg: BackendConfig) -> Result<Self, BackendError> {
        cfg.validate()
            .map_err(|e| BackendError::Plan(e.to_string()))?;
        let m = &cfg.model;
        let shape = m.attention_shape();
        let (rot_start, rot_dim) = m.rope_range();
        let rope = |heads| RopeShape {
            heads,
            head_dim: m.head_dim,
            rot_start,
            rot_dim,
            theta: m.rope_theta,
        };
        let mla = m.attention == AttentionKind::Mla;
        let prefill = match prefill_attention::default_tiles(&shape) {
            Some(t) if !mla => Some(PrefillAttention::with_tiles(&gpu, shape, t)?),
            _ => None,
        };
        let swa_shape = SwaShape {
            num_kv_heads: m.kv_heads,
            group: m.group,
            head_dim: m.head_dim,
        };
        let k = Kernels {
            att: PagedAttention::new(&gpu, shape)?,
            mla: if mla {
                Some(MlaAttention::new(&gpu, shape)?)
            } else {
                None
            },
            prefill,
            swa: if mla {
                None
            } else {
                Some(SwaAttention::new(&gpu, swa_shape)?)
            },
            norm: RmsNorm::new(&gpu)?,
            rope_q: Rope::new(&gpu, rope(m.kv_heads * m.group))?,
            rope_k: Rope::new(&gpu, rope(m.kv_heads))?,
            router: MoeRouter::new(&gpu, m.experts, m.top_k)?,
            ops: Ops::new(&gpu)?,
            sampler: Sampler::new(&gpu)?,
        };
        let w = ModelWeights::random(&gpu, m)?;
        let s = &gpu.stream;
        let pool = s.alloc_zeros::<bf16>(cfg.hbm_blocks * m.block_bytes() / 2)?;
        let rings = s.alloc_zeros::<bf16>(cfg.total_ring_slots() * cfg.ring_slot_elems())?;
        // SAFETY: pinned allocations; contents are written before any read (zeroed below).
        let mut host_pool = unsafe {
            gpu.ctx.alloc_pinned_with_flags::<u8>(
                cfg.host_blocks * m.block_bytes(),
                sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        }?;
        host_pool.as_mut_slice()?.fill(0);
        let mut host_pool_dptr: sys::CUdeviceptr = 0;
        // SAFETY: the pool was allocated with DEVICEMAP; this only queries its device address.
        unsafe {
            sys::cuMemHostGetDevicePointer_v2(
                &mut host_pool_dptr,
                host_pool.as_mut_ptr()? as *mut std::ffi::c_void,
                0,
            )
        }
        .result()?;
        // SAFETY: as above.
        let mut swa_host = unsafe {
            gpu.ctx.alloc_pinned_with_flags::<bf16>(
                cfg.swa_host_slots * cfg.ring_slot_elems(),
                sys::CU_MEMHOSTALLOC_PORTABLE,
            )
        }?;
        swa_host.as_mut_slice()?.fill(bf16::ZERO);
        let copy = gpu.ctx.new_stream()?;
        // With a second stream cudarc would record and wait on two events per buffer argument of
        // every launch and GEMM (and create two per allocation) to order streams for us. Decode
        // steps here are host-bound, and that bookkeeping was a large share of their host time.
        // The backend orders its two streams itself: the copy stream joins the compute stream
        // before it touches the pools, and the compute stream joins it back before reading them
        // (`issue_moves`, `try_execute`), and buffers used on the copy stream are allocated on it.
        // SAFETY: as above; every cross-stream use goes through those joins.
        unsafe { gpu.ctx.disable_event_tracking() };
        let disk = if cfg.disk_blocks > 0 {
            let dir = cfg.disk_dir.clone().unwrap_or_else(std::env::temp_dir);
            Some(DiskTier::create(&dir, cfg.disk_blocks, m.block_bytes())?)
        } else {
            None
        };
        let tiers = new_tiers(&cfg);
        let accept_rng = ChaCha8Rng::seed_from_u64(sub_seed(cfg.seed, "hw.acceptance"));
        s.synchronize()?;
        let mode = cfg.decode_mode;
        let mut b = Self {
            gpu,
            cfg,
            w,
            k,
            pool,
            rings,
            host_pool,
            host_pool_dptr,
            swa_host,
            copy,
            disk,
            tiers,
            accept_rng,
            last_tokens: Vec::new(),
            last_logits: Vec::new(),
            keep_logits: false,
            scratch: None,
            phases: None,
            last_phases: None,
            last_host_issue: std::time::Duration::ZERO,
            issued_at: None,
            decode_end: None,
            decode_bufs: None,
            route_log: None,
        };
        b.set_decode_mode(mode)?;
        Ok(b)
    }

    /// Chooses how decode steps run ([`DecodeMode`]). A device-bound mode moves the backend's
    /// compute work to a stream of its own (the legacy default stream cannot be captured into
    /// a graph); it stays there for every later step, eager ones included.
    pub fn set_decode_mode(&mut self, mode: DecodeMode) -> Result<(), BackendError> {
        if mode != DecodeMode::Eager && self.gpu.stream.cu_stream().is_null() {
            self.gpu.stream.synchronize()?;
            self.copy.synchronize()?;
            self.scratch = None;
            self.decode_bufs = None;
            self.gpu = Arc::new(self.gpu.on_new_stream()?);
            if self.phases.is_some() {
                self.phases = Some(forward::PhaseLog::new(&self.gpu));
            }
        }
        self.cfg.decode_mode = mode;
        Ok(())
    }

    /// Called right after a step's last launch, before the host waits for its tokens: notes
    /// the time and, in a decode step, records the step's end event (see
    /// [`Self::try_execute`]).
    pub(crate) fn mark_issued(&mut self) -> Result<(), BackendError> {
        self.issued_at = Some(std::time::Instant::now());
        if let Some((e, recorded)) = &mut self.decode_end {
            e.record(&self.gpu.stream)?;
            *recorded = true;
        }
        Ok(())
    }

    pub fn decode_mode(&self) -> DecodeMode {
        self.cfg.decode_mode
    }

    /// Graph captures and replays of device-bound decode steps so far.
    pub fn graph_stats(&self) -> GraphStats {
        self.decode_bufs
            .as_ref()
            .map(|d| d.stats)
            .unwrap_or_default()
    }

    /// Counts the rows the router sends to each expert of each layer (`on`; off drops the
    /// counts). Only the eager decode mode and prefill steps count: the device-sized modes
    /// never bring the counts to the host.
    pub fn log_routing(&mut self, on: bool) {
        self.route_log = on.then(Default::default);
    }

    /// Routed rows per (layer, expert) since [`Self::log_routing`], up to the last layer that
    /// routed anything.
    pub fn routed_counts(&self) -> Option<Vec<Vec<u64>>> {
        self.route_log.as_ref().map(|l| l.borrow().clone())
    }

    /// Diagnostic: records an event at every phase boundary of each step (GEMMs, global
    /// attention, SWA, the rest) and leaves the split in [`Self::last_phases`]. The events cost
    /// host time and device idle, so time steps with it off.
    pub fn set_phase_timing(&mut self, on: bool) {
        self.phases = on.then(|| forward::PhaseLog::new(&self.gpu));
        self.last_phases = None;
    }

    /// The prefill attention kernel's tiles (`None`: the split decode kernels run prefill).
    pub fn prefill_tiles(&self) -> Option<prefill_attention::PrefillTiles> {
        self.k.prefill.as_ref().map(|p| p.tiles())
    }

    /// Runs prefill attention through the tensor-core prefill kernel (`true`, the default where
    /// it takes the shape) or through the split decode kernels (`false`), e.g. to compare them.
    pub fn use_prefill_kernel(&mut self, on: bool) -> Result<(), BackendError> {
        self.k.prefill = match prefill_attention::default_tiles(&self.k.att.shape) {
            Some(t) if on && self.k.mla.is_none() => Some(PrefillAttention::with_tiles(
                &self.gpu,
                self.k.att.shape,
                t,
            )?),
            _ => None,
        };
        Ok(())
    }

    /// Replaces the prefill attention kernel's tiles (recompiled), e.g. to compare tiles.
    pub fn set_prefill_tiles(
        &mut self,
        tiles: prefill_attention::PrefillTiles,
    ) -> Result<(), BackendError> {
        if self.k.mla.is_some() {
            return Err(BackendError::Plan(
                "the MLA model runs no prefill attention kernel".into(),
            ));
        }
        let shape = self.k.att.shape;
        self.k.prefill = Some(PrefillAttention::with_tiles(&self.gpu, shape, tiles)?);
        Ok(())
    }

    /// Drops `request`'s encoder window (as after a cache hit with no SWA state): its next
    /// chunk truncates the window at its start.
    pub fn forget_window(&mut self, request: u64) {
        if let Some(st) = self.tiers.seqs.get_mut(&request) {
            st.ring_valid_to = 0;
        }
    }

    pub fn config(&self) -> &BackendConfig {
        &self.cfg
    }

    pub fn gpu(&self) -> &GpuContext {
        &self.gpu
    }

    /// Forgets every sequence (blocks and rings return to the free lists).
    pub fn reset(&mut self) {
        self.tiers = new_tiers(&self.cfg);
    }

    /// The HBM region a plan's device owns: prefill engine `e` region `e`, decode group `g`
    /// region `prefill engines + g`; 0 for every plan of an unsplit pool.
    pub fn region_of(&self, plan: &StepPlan) -> Result<u32, BackendError> {
        match plan {
            StepPlan::Prefill(x) => self.region_for(false, x.engine.0),
            StepPlan::Decode(x) => self.region_for(true, x.engine.0),
        }
    }

    pub(crate) fn region_for(&self, decode: bool, engine: u32) -> Result<u32, BackendError> {
        let Some((p, g)) = self.cfg.unit_devices else {
            return Ok(0);
        };
        let (region, count, kind) = if decode {
            (p + engine, g, "decode group")
        } else {
            (engine, p, "prefill engine")
        };
        if engine >= count {
            return Err(BackendError::Plan(format!(
                "{kind} {engine} is not a device of the unit ({p} prefill engines, {g} decode \
                 groups)"
            )));
        }
        Ok(region)
    }

    /// The handoff of `request` to decode group `group`: its HBM blocks and SWA ring move
    /// from the region that holds them (its prefill engine's) into the group's region by
    /// device-to-device copies, timed with CUDA events on the compute stream like a step. Blocks
    /// in the host tier stay there (the group's first step swaps them in). Nothing moves when
    /// the pool is not split or the KV is already there (duration 0).
    pub fn handoff(&mut self, request: u64, group: u32) -> Result<HandoffCopy, BackendError> {
        let Some((p, g)) = self.cfg.unit_devices else {
            return Ok(HandoffCopy::default());
        };
        if group >= g {
            return Err(BackendError::Plan(format!(
                "handoff to decode group {group} of {g}"
            )));
        }
        let s = self.gpu.stream.clone();
        let start = self
            .gpu
            .ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        let end = self
            .gpu
            .ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        self.tiers.begin_step();
        let mut moves = Moves::default();
        if !self.tiers.move_to_region(request, p + group, &mut moves)? {
            return Ok(HandoffCopy::default());
        }
        start.record(&s)?;
        self.issue_moves(&moves)?;
        s.join(&self.copy)?;
        end.record(&s)?;
        let ms = start.elapsed_ms(&end)? as f64;
        let m = &self.cfg.model;
        Ok(HandoffCopy {
            bytes: (moves.dtod.len() * m.block_bytes()
                + moves.ring_dtod.len() * self.cfg.ring_slot_elems() * 2) as u64,
            evicted_blocks: moves.swap_out.len() as u32,
            duration_ns: (ms * 1e6).round().max(1.0) as u64,
        })
    }

    /// Forgets a finished request: its blocks, ring and SWA slot are free for others.
    pub fn release(&mut self, request: u64) {
        self.tiers.release(request);
    }

    /// One global layer's view of the pool `[block][global layer][token][row]`.
    pub(crate) fn global_layout(&self) -> KvLayout {
        let m = &self.cfg.model;
        KvLayout {
            block_stride: m.global_layers() * m.block_size * m.kv_row(),
            row_stride: m.kv_row(),
            num_blocks: self.cfg.hbm_blocks,
        }
    }

    /// One layer's view of the rings: physical ring block `slot * 2 + b`, block-major over layers.
    pub(crate) fn ring_layout(&self) -> KvLayout {
        let m = &self.cfg.model;
        KvLayout {
            block_stride: m.layers() * m.block_size * m.kv_row(),
            row_stride: m.kv_row(),
            num_blocks: 2 * self.cfg.total_ring_slots(),
        }
    }

    /// Element offset of global layer `l`'s view in `pool`.
    pub(crate) fn global_layer_offset(&self, l: usize) -> usize {
        l * self.cfg.model.block_size * self.cfg.model.kv_row()
    }

    /// Runs one plan and returns its duration (CUDA events on the compute stream, from before
    /// the first copy or launch to after the last, host-side planning included). A decode
    /// step's end event is recorded right after its last launch, before the host waits for
    /// the greedy tokens: otherwise the duration would also hold the time the launching thread
    /// takes to be scheduled again once the device is done, which on a loaded host is a
    /// scheduler time slice, not device work. (With phase timing on, the end stays after the
    /// last phase mark.)
    pub fn try_execute(
        &mut self,
        plan: &StepPlan,
        report: &mut StepReport,
    ) -> Result<(), BackendError> {
        let issue_start = std::time::Instant::now();
        self.issued_at = None;
        let s = self.gpu.stream.clone();
        let start = self
            .gpu
            .ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        let mut end = Some(
            self.gpu
                .ctx
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
        );
        self.decode_end = None;
        if matches!(plan, StepPlan::Decode(_)) && self.phases.is_none() {
            self.decode_end = end.take().map(|e| (e, false));
        }
        report.seqs.clear();
        report.ranks.clear();
        self.last_tokens.clear();
        self.last_logits.clear();
        start.record(&s)?;
        if let Some(l) = &self.phases {
            l.mark(forward::Phase::Setup)?;
        }
        match plan {
            StepPlan::Prefill(p) => self.run_prefill(p)?,
            StepPlan::Decode(d) => self.run_decode(d, report)?,
        }
        s.join(&self.copy)?;
        if let Some(l) = &self.phases {
            l.mark(forward::Phase::Setup)?;
            self.last_phases = Some(l.finish()?);
        }
        self.last_host_issue = self
            .issued_at
            .unwrap_or_else(std::time::Instant::now)
            .saturating_duration_since(issue_start);
        let end = match (end, self.decode_end.take()) {
            (_, Some((e, true))) => e,
            (Some(e), _) | (None, Some((e, false))) => {
                e.record(&s)?;
                e
            }
            (None, None) => unreachable!("the end event is in one of the two"),
        };
        let ms = start.elapsed_ms(&end)? as f64;
        report.duration = Nanos((ms * 1e6).round().max(0.0) as u64);
        Ok(())
    }

    /// Token id of `request` at `position` (the model is random; ids only pick embeddings).
    pub(crate) fn token_id(&self, request: u64, position: usize) -> i32 {
        let h = servelab_core::content::hash2(
            sub_seed(self.cfg.seed, "hw.tokens") ^ request,
            position as u64,
        );
        (h % self.cfg.model.vocab as u64) as i32
    }

    /// Issues this step's moves: saves and swap-outs first (their sources are reused within
    /// the step), then restores and swap-ins, all on the copy stream after the compute stream's
    /// earlier work. Swap-outs are joined back into the compute stream at once; swap-ins are
    /// left in flight (the caller joins before the global KV is read).
    pub(crate) fn issue_moves(&mut self, moves: &Moves) -> Result<(), BackendError> {
        if moves.is_empty() {
            return Ok(());
        }
        let s = self.gpu.stream.clone();
        let c = self.copy.clone();
        let bb = self.cfg.model.block_bytes();
        let disk_io = !moves.host_to_disk.is_empty() || !moves.disk_to_host.is_empty();
        if disk_io {
            // The host blocks involved may still be written (earlier swap-outs) or read
            // (earlier swap-ins, whose staging blocks are free again) by the copy stream.
            c.synchronize()?;
            let disk = self
                .disk
                .as_ref()
                .ok_or_else(|| BackendError::Plan("disk moves without an SSD tier".into()))?;
            // Spills first: their host blocks are reused by this step's swap-outs and reads.
            let host = self.host_pool.as_slice()?;
            for &(h, d) in &moves.host_to_disk {
                disk.write(d, host[h as usize * bb..][..bb].to_vec())?;
            }
        }
        c.join(&s)?;
        let ring_elems = self.cfg.ring_slot_elems();
        let (pool_ptr, _g) = self.pool.device_ptr(&c);
        if !moves.swap_out.is_empty() {
            let (src, dst): (Vec<i32>, Vec<i32>) = moves
                .swap_out
                .iter()
                .map(|&(d, h)| (d as i32, h as i32))
                .unzip();
            let (src, dst) = (c.clone_htod(&src)?, c.clone_htod(&dst)?);
            // SAFETY: ids come from the tiers' free lists, inside both pools; the host pool is
            // mapped (DEVICEMAP).
            unsafe {
                gather_blocks_on(
                    &self.gpu,
                    &c,
                    pool_ptr,
                    &src,
                    self.host_pool_dptr,
                    &dst,
                    moves.swap_out.len(),
                    bb,
                )
            }?;
        }
        {
            let (ring_ptr, _gr) = self.rings.device_ptr(&c);
            let host = self.swa_host.as_mut_slice()?;
            for &(r, h) in &moves.ring_out {
                let dst = &mut host[h as usize * ring_elems..][..ring_elems];
                // SAFETY: ring slot r and host slot h lie inside their pools; the host buffer
                // is pinned and outlives the copy (it lives in self).
                unsafe {
                    cudarc::driver::result::memcpy_dtoh_async(
                        dst,
                        ring_ptr + (r as usize * ring_elems * 2) as u64,
                        c.cu_stream(),
                    )
                }?;
            }
        }
        self.issue_region_copies(moves, pool_ptr)?;
        s.join(&c)?;
        {
            let (ring_ptr, _gr) = self.rings.device_ptr(&c);
            let host = self.swa_host.as_slice()?;
            for &(h, r) in &moves.ring_in {
                // SAFETY: as above.
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(
                        ring_ptr + (r as usize * ring_elems * 2) as u64,
                        &host[h as usize * ring_elems..][..ring_elems],
                        c.cu_stream(),
                    )
                }?;
            }
        }
        if !moves.disk_to_host.is_empty() {
            let disk = self.disk.as_ref().expect("checked above");
            let slots: Vec<u32> = moves.disk_to_host.iter().map(|&(d, _)| d).collect();
            // The reads run on the disk tier's thread while the swap-outs above run on the GPU.
            let blocks = disk.read_blocks(&slots)?;
            let host = self.host_pool.as_mut_slice()?;
            for (&(_, h), data) in moves.disk_to_host.iter().zip(&blocks) {
                host[h as usize * bb..][..bb].copy_from_slice(data);
            }
        }
        if !moves.swap_in.is_empty() {
            let (src, dst): (Vec<i32>, Vec<i32>) = moves
                .swap_in
                .iter()
                .map(|&(h, d)| (h as i32, d as i32))
                .unzip();
            let (src, dst) = (c.clone_htod(&src)?, c.clone_htod(&dst)?);
            // SAFETY: as for the swap-out.
            unsafe {
                gather_blocks_on(
                    &self.gpu,
                    &c,
                    self.host_pool_dptr,
                    &src,
                    pool_ptr,
                    &dst,
                    moves.swap_in.len(),
                    bb,
                )
            }?;
        }
        Ok(())
    }

    /// The device-to-device copies of sequences that move between regions, on the copy stream
    /// (after the swap-outs and ring saves that freed their destinations).
    fn issue_region_copies(
        &self,
        moves: &Moves,
        pool_ptr: sys::CUdeviceptr,
    ) -> Result<(), BackendError> {
        let c = self.copy.clone();
        if !moves.dtod.is_empty() {
            let (src, dst): (Vec<i32>, Vec<i32>) = moves
                .dtod
                .iter()
                .map(|&(a, b)| (a as i32, b as i32))
                .unzip();
            let (src, dst) = (c.clone_htod(&src)?, c.clone_htod(&dst)?);
            // SAFETY: both ids come from the tiers' regions of the one pool, and no block is
            // both a source and a destination (a moved block is free from the next step on).
            unsafe {
                gather_blocks_on(
                    &self.gpu,
                    &c,
                    pool_ptr,
                    &src,
                    pool_ptr,
                    &dst,
                    moves.dtod.len(),
                    self.cfg.model.block_bytes(),
                )
            }?;
        }
        let ring_bytes = self.cfg.ring_slot_elems() * 2;
        let (ring_ptr, _gr) = self.rings.device_ptr(&c);
        for &(a, b) in &moves.ring_dtod {
            // SAFETY: both slots lie inside the ring buffer (slot r spans 2 ring blocks).
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    ring_ptr + (b as usize * ring_bytes) as u64,
                    ring_ptr + (a as usize * ring_bytes) as u64,
                    ring_bytes,
                    c.cu_stream(),
                )
            }?;
        }
        Ok(())
    }

    /// Makes every sequence of the plan resident; returns the HBM block ids per sequence.
    pub(crate) fn place(
        &mut self,
        seqs: &[(u64, usize)],
        region: u32,
        moves: &mut Moves,
    ) -> Result<Vec<Vec<u32>>, BackendError> {
        self.tiers.begin_step();
        let protected: BTreeSet<u64> = seqs.iter().map(|(r, _)| *r).collect();
        let bs = self.cfg.model.block_size;
        seqs.iter()
            .map(|&(r, tokens)| {
                self.tiers
                    .make_resident(r, tokens.div_ceil(bs), region, &protected, moves)
                    .map_err(BackendError::from)
            })
            .collect()
    }

    fn run_prefill(&mut self, p: &PrefillPlan) -> Result<(), BackendError> {
        forward::prefill(self, p)
    }

    fn run_decode(&mut self, d: &DecodePlan, report: &mut StepReport) -> Result<(), BackendError> {
        let verified = deal_verified(d)?;
        forward::decode(self, d, &verified)?;
        let pa = self.cfg.draft_acceptance;
        for &v in &verified {
            let v = v.min(u8::MAX as u32) as u8;
            let mut accepted = 0u8;
            while accepted < v && self.accept_rng.random::<f64>() < pa {
                accepted += 1;
            }
            report.seqs.push(SeqOutcome {
                verified: v,
                accepted,
            });
        }
        report.ranks.extend(confidences(d, pa));
        Ok(())
    }
}

/// One handoff's device-to-device copy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HandoffCopy {
    /// Bytes copied (KV blocks and the SWA ring).
    pub bytes: u64,
    /// Blocks of the destination region swapped out to make room.
    pub evicted_blocks: u32,
    /// CUDA-event time of the copies (0: nothing moved).
    pub duration_ns: u64,
}

fn new_tiers(cfg: &BackendConfig) -> Tiers {
    let blocks = cfg.region_blocks();
    let rings = vec![cfg.ring_slots; blocks.len()];
    Tiers::with_regions(
        &blocks,
        &rings,
        cfg.host_blocks,
        cfg.disk_blocks,
        cfg.swa_host_slots,
    )
}

/// Verified drafts per sequence of a decode plan: fixed = `max_drafts`; dynamic = the rank's
/// budget dealt one draft at a time round-robin (the random model gives no confidences to
/// sort by).
pub fn deal_verified(d: &DecodePlan) -> Result<Vec<u32>, BackendError> {
    let mut verified = vec![0u32; d.seqs.len()];
    for rank in &d.ranks {
        let (a, b) = (rank.seq_start as usize, rank.seq_end as usize);
        if a > b || b > d.seqs.len() {
            return Err(BackendError::Plan(format!(
                "rank seqs {a}..{b} outside the plan's {}",
                d.seqs.len()
            )));
        }
        let span = &mut verified[a..b];
        let caps = &d.seqs[a..b];
        if !d.dynamic {
            for (v, s) in span.iter_mut().zip(caps) {
                *v = s.max_drafts;
            }
            continue;
        }
        let mut left = rank.verify_budget;
        let mut progress = true;
        while left > 0 && progress {
            progress = false;
            for (v, s) in span.iter_mut().zip(caps) {
                if left > 0 && *v < s.max_drafts {
                    *v += 1;
                    left -= 1;
                    progress = true;
                }
            }
        }
    }
    Ok(verified)
}

/// The draft head's confidences per rank: every draft accepted with probability `pa` while
/// the prefix holds, so draft i's cumulative product is `pa^i`.
pub fn confidences(d: &DecodePlan, pa: f64) -> Vec<RankOutcome> {
    d.ranks
        .iter()
        .map(|rank| {
            let mut out = RankOutcome::default();
            for s in &d.seqs[rank.seq_start as usize..rank.seq_end as usize] {
                let cum: Vec<f64> = (1..=s.max_drafts).map(|i| pa.powi(i as i32)).collect();
                out.confidence.add(&cum, 1);
            }
            out
        })
        .collect()
}

/// The GPU environment's device: plans, handoff copies into the decode group's region, and
/// releases of finished requests.
impl crate::clock::UnitDevice for CudaBackend {
    fn step(&mut self, plan: &StepPlan, report: &mut StepReport) -> Result<(), String> {
        self.try_execute(plan, report).map_err(|e| e.to_string())
    }
    fn handoff(&mut self, job: &crate::clock::HandoffJob) -> Result<HandoffCopy, String> {
        CudaBackend::handoff(self, u64::from(job.request), job.to_group).map_err(|e| e.to_string())
    }
    fn release(&mut self, request: u32) {
        CudaBackend::release(self, u64::from(request));
    }
}

impl Backend for CudaBackend {
    /// Runs the plan. The trait has no error path: a GPU failure (or a plan that does not fit
    /// the pools) panics with its cause; use [`CudaBackend::try_execute`] to handle it.
    fn execute(&mut self, _now: Nanos, plan: &StepPlan, report: &mut StepReport) {
        if let Err(e) = self.try_execute(plan, report) {
            panic!("CudaBackend: {e}");
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use servelab_core::engine::plan::{DecodeRankPlan, DecodeSeq, PrefillChunk};
    use servelab_core::ids::{EngineId, RequestId};

    /// A small GQA model (2 KV heads x 4 x d 64), which the tensor-core prefill kernel takes.
    pub(crate) fn tiny() -> BackendConfig {
        let m = tiny_mla().model.gqa(2, 4, 64);
        BackendConfig {
            model: m,
            ..tiny_mla()
        }
    }

    /// The handoff tests' request 5: a 300-token cold prefill that replays 140 tokens.
    pub(crate) fn handoff_prefill(m: &ModelShape) -> StepPlan {
        StepPlan::Prefill(PrefillPlan {
            engine: EngineId(0),
            chunks: vec![PrefillChunk {
                request: RequestId(5),
                new_tokens: 300,
                prefix_tokens: 0,
                new_token_layers: m.encoder_layers as u32,
                decoder_tokens: 140,
                decoder_layers: m.decoder_layers as u32,
                swap_in_bytes: 0,
            }],
            expert_imbalance: 1.0,
        })
    }

    /// One decode step of the handoff tests' request 5 (two drafts) on decode group `group`.
    pub(crate) fn handoff_decode(group: u32) -> StepPlan {
        StepPlan::Decode(DecodePlan {
            engine: EngineId(group),
            ranks: vec![DecodeRankPlan {
                seq_start: 0,
                seq_end: 1,
                verify_budget: 2,
            }],
            seqs: vec![DecodeSeq {
                request: RequestId(5),
                kv_tokens: 301,
                max_drafts: 2,
                slot: 0,
            }],
            dynamic: false,
            expert_imbalance: 1.0,
        })
    }

    /// The largest absolute difference of two logit vectors, which must be of one length.
    pub(crate) fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max)
    }

    /// A small MLA model: one latent of 96 (value 64, rotary 32) read by 4 heads.
    fn tiny_mla() -> BackendConfig {
        BackendConfig {
            model: ModelShape {
                encoder_layers: 2,
                decoder_layers: 2,
                hidden: 256,
                group: 4,
                head_dim: 96,
                value_dim: 64,
                rope_dim: 32,
                experts: 4,
                top_k: 2,
                expert_ffn: 128,
                vocab: 512,
                ..ModelShape::default()
            },
            hbm_blocks: 8,
            host_blocks: 16,
            ring_slots: 2,
            swa_host_slots: 4,
            ..BackendConfig::default()
        }
    }

    #[test]
    fn both_tiny_shapes_are_valid_and_their_kernels_chosen_by_kind() {
        let (g, m) = (tiny().model, tiny_mla().model);
        g.validate().unwrap();
        m.validate().unwrap();
        assert_eq!(
            (g.attention, m.attention),
            (AttentionKind::Gqa, AttentionKind::Mla)
        );
        assert_eq!((g.o_dim(), g.q_dim()), (512, 512));
        // MLA: 4 heads x value 64 out of a 96-wide latent, the last 32 rotated
        assert_eq!((m.o_dim(), m.q_dim(), m.kv_row()), (256, 384, 96));
        assert_eq!(m.rope_range(), (64, 32));
    }

    #[test]
    fn config_errors_name_the_field() {
        let e = BackendConfig {
            draft_acceptance: 1.5,
            ..tiny()
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("draft_acceptance"), "{e}");
        let e = BackendConfig {
            hbm_blocks: 0,
            ..tiny()
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("hbm_blocks"), "{e}");
    }

    /// A block goes HBM -> host -> SSD -> host -> HBM (through the backend's own placement and
    /// copies) and comes back bit-identical.
    #[test]
    fn gpu_block_round_trip_through_the_ssd_tier_is_bit_identical() {
        let Some(gpu) = servelab_kernels::gpu::gpu_or_skip() else {
            return;
        };
        let cfg = BackendConfig {
            hbm_blocks: 4,
            host_blocks: 2,
            disk_blocks: 4,
            ..tiny()
        };
        let mut b = CudaBackend::new(Arc::new(gpu), cfg).unwrap();
        let bs = b.config().model.block_size;
        let elems = b.config().model.block_bytes() / 2;
        servelab_kernels::fill::fill_uniform_bf16(&b.gpu, &mut b.pool, 77, 1.0).unwrap();
        let bits = |b: &CudaBackend, ids: &[u32]| -> Vec<u16> {
            b.copy.synchronize().unwrap();
            b.gpu.stream.synchronize().unwrap();
            let pool = b.gpu.stream.clone_dtoh(&b.pool).unwrap();
            ids.iter()
                .flat_map(|&i| {
                    pool[i as usize * elems..][..elems]
                        .iter()
                        .map(|x| x.to_bits())
                })
                .collect()
        };
        let step = |b: &mut CudaBackend, seq: u64, blocks: usize| {
            let mut m = Moves::default();
            let ids = b.place(&[(seq, blocks * bs)], 0, &mut m).unwrap().remove(0);
            b.issue_moves(&m).unwrap();
            (ids, m)
        };
        let (ids_a, _) = step(&mut b, 1, 2);
        let golden = bits(&b, &ids_a);
        // seq 2 fills HBM: seq 1 -> host
        let (_, m) = step(&mut b, 2, 4);
        assert_eq!(m.swap_out.len(), 2);
        // seq 3 evicts seq 2 with the host pool full: seq 1 -> disk, seq 2 dropped
        let (_, m) = step(&mut b, 3, 4);
        assert_eq!(m.host_to_disk.len(), 2);
        // overwrite the whole HBM pool, so nothing can come back from a stale device copy
        servelab_kernels::fill::fill_uniform_bf16(&b.gpu, &mut b.pool, 78, 1.0).unwrap();
        // seq 1 returns: disk -> host -> HBM
        let (ids_back, m) = step(&mut b, 1, 2);
        assert_eq!((m.disk_to_host.len(), m.swap_in.len()), (2, 2));
        let back = bits(&b, &ids_back);
        assert_eq!(back.len(), golden.len());
        assert!(
            back == golden,
            "block changed on its way through host and SSD"
        );
        println!(
            "SSD tier round trip: {} blocks of {} B bit-identical",
            ids_back.len(),
            elems * 2
        );
    }

    /// The tensor-core prefill kernel against the split decode kernels on the same prompts:
    /// one chunk, and two chunks (a cached prefix) whose decoder replay is long enough to run
    /// through the prefill kernel too. Logits agree up to bf16 rounding.
    #[test]
    fn gpu_prefill_kernel_matches_the_split_kernels() {
        let Some(gpu) = servelab_kernels::gpu::gpu_or_skip() else {
            return;
        };
        let cfg = BackendConfig {
            hbm_blocks: 64,
            ring_slots: 4,
            ..tiny()
        };
        let mut b = CudaBackend::new(Arc::new(gpu), cfg).unwrap();
        assert!(b.prefill_tiles().is_some(), "d 64 takes the prefill kernel");
        let m = b.config().model.clone();
        let chunk = |new: u32, prefix: u32, replay: u32| {
            StepPlan::Prefill(PrefillPlan {
                engine: EngineId(0),
                chunks: vec![PrefillChunk {
                    request: RequestId(5),
                    new_tokens: new,
                    prefix_tokens: prefix,
                    new_token_layers: m.encoder_layers as u32,
                    decoder_tokens: replay,
                    decoder_layers: m.decoder_layers as u32,
                    swap_in_bytes: 0,
                }],
                expert_imbalance: 1.0,
            })
        };
        // (chunks, replay): 5 x 128 = 640 > 132 SMs' worth of CTAs for the 2,600-token replay
        let cases: [(&[u32], u32); 2] = [(&[700], 140), (&[1800, 800], 2600)];
        for (splits, replay) in cases {
            let mut logits = Vec::new();
            for on in [true, false] {
                b.use_prefill_kernel(on).unwrap();
                b.reset();
                b.keep_logits = true;
                let mut rep = StepReport::default();
                let mut done = 0;
                for (i, &n) in splits.iter().enumerate() {
                    let r = if i + 1 == splits.len() { replay } else { 0 };
                    b.try_execute(&chunk(n, done, r), &mut rep).unwrap();
                    done += n;
                }
                logits.push(b.last_logits.clone());
            }
            let (a, c) = (&logits[0], &logits[1]);
            assert_eq!(a.len(), c.len());
            let diffs: Vec<f64> = a.iter().zip(c).map(|(x, y)| (x - y).abs() as f64).collect();
            let max = diffs.iter().cloned().fold(0.0, f64::max);
            let mean = diffs.iter().sum::<f64>() / diffs.len().max(1) as f64;
            let scale = c.iter().map(|x| x.abs() as f64).fold(0.0, f64::max);
            println!(
                "chunks {splits:?} replay {replay}: prefill kernel vs split kernels: max abs logit diff {max:.3e}, mean {mean:.3e} (largest |logit| {scale:.3})"
            );
            assert!(a.iter().all(|x| x.is_finite()));
            assert!(
                max <= 0.05 * scale.max(1.0),
                "max diff {max} vs logits up to {scale}"
            );
            assert!(mean <= 0.01 * scale.max(1.0), "mean diff {mean}");
        }
        b.use_prefill_kernel(true).unwrap();
    }

    /// The handoff copies a prefilled request's KV and SWA ring from the prefill engine's
    /// region into a decode group's: a decode step on that group then gives the same logits
    /// as on a backend with one shared pool, and the copy is timed and sized.
    #[test]
    fn gpu_handoff_copy_keeps_the_decode_exact() {
        let Some(gpu) = servelab_kernels::gpu::gpu_or_skip() else {
            return;
        };
        let gpu = Arc::new(gpu);
        let m = tiny().model;
        let prefill = handoff_prefill(&m);
        let decode = handoff_decode;
        let mut logits = Vec::new();
        for split in [false, true] {
            let cfg = BackendConfig {
                hbm_blocks: 24,
                ring_slots: 2,
                unit_devices: split.then_some((1, 2)),
                ..tiny()
            };
            let mut b = CudaBackend::new(gpu.clone(), cfg).unwrap();
            b.keep_logits = true;
            let mut rep = StepReport::default();
            b.try_execute(&prefill, &mut rep).unwrap();
            let copy = b.handoff(5, 1).unwrap();
            if split {
                assert_eq!(b.tiers.region_of(5), Some(2));
                let ring = b.cfg.ring_slot_elems() * 2;
                assert_eq!(copy.bytes as usize, 3 * m.block_bytes() + ring);
                assert!(copy.duration_ns > 0);
                println!(
                    "handoff copy: {} B in {:.1} us ({:.1} GB/s)",
                    copy.bytes,
                    copy.duration_ns as f64 / 1e3,
                    copy.bytes as f64 / copy.duration_ns as f64
                );
                // the prefill engine's region is free again from the next step on
                b.tiers.begin_step();
                assert_eq!(b.tiers.hbm_free_in(0), 8);
            } else {
                assert_eq!(copy, HandoffCopy::default());
            }
            b.try_execute(&decode(if split { 1 } else { 0 }), &mut rep)
                .unwrap();
            logits.push(b.last_logits.clone());
        }
        let max = max_abs_diff(&logits[0], &logits[1]);
        println!("decode after the handoff vs one shared pool: max abs logit diff {max:.3e}");
        assert!(max <= 1e-3, "max diff {max}");
    }

    /// The routing log counts every routed row of a prefill chunk (tokens x top-k in each
    /// encoder layer, the replayed tokens x top-k in each decoder layer), and those real
    /// counts give the expert imbalance over EP ranks with and without EPLB's replicas.
    #[test]
    fn gpu_routing_log_counts_every_route() {
        let Some(gpu) = servelab_kernels::gpu::gpu_or_skip() else {
            return;
        };
        let mut cfg = BackendConfig {
            hbm_blocks: 64,
            ..tiny()
        };
        cfg.model.experts = 64;
        cfg.model.top_k = 6;
        let m = cfg.model.clone();
        let mut b = CudaBackend::new(Arc::new(gpu), cfg).unwrap();
        b.log_routing(true);
        let (new, replay) = (4096u32, 140u32);
        let plan = StepPlan::Prefill(PrefillPlan {
            engine: EngineId(0),
            chunks: vec![PrefillChunk {
                request: RequestId(3),
                new_tokens: new,
                prefix_tokens: 0,
                new_token_layers: m.encoder_layers as u32,
                decoder_tokens: replay,
                decoder_layers: m.decoder_layers as u32,
                swap_in_bytes: 0,
            }],
            expert_imbalance: 1.0,
        });
        b.try_execute(&plan, &mut StepReport::default()).unwrap();
        let counts = b.routed_counts().unwrap();
        assert_eq!(counts.len(), m.layers());
        for (l, c) in counts.iter().enumerate() {
            let tokens = if l < m.encoder_layers { new } else { replay };
            assert_eq!(c.iter().sum::<u64>(), u64::from(tokens) * 6, "layer {l}");
        }
        for ranks in [2, 4, 8] {
            let (plain, eplb) = crate::ep::eplb_imbalance(&counts, ranks, 1).unwrap();
            println!(
                "routing imbalance over {ranks} ranks ({} layers, 64 experts top-6): {plain:.3} \
                 without EPLB, {eplb:.3} with 1 redundant expert per rank",
                counts.len()
            );
        }
        b.log_routing(false);
        assert!(b.routed_counts().is_none());
    }

    /// Prefill, decode with verification, and enough sequences to force swap-out and swap-in,
    /// on both attention shapes.
    #[test]
    fn gpu_backend_runs_plans_and_swaps() {
        let Some(gpu) = servelab_kernels::gpu::gpu_or_skip() else {
            return;
        };
        let gpu = Arc::new(gpu);
        for cfg in [tiny(), tiny_mla()] {
            runs_plans_and_swaps(CudaBackend::new(gpu.clone(), cfg).unwrap());
        }
    }

    /// An MLA model's prompt in two chunks (the window carried in the ring) and with a full
    /// decoder replay gives the logits of one chunk up to rounding, as the GQA model's does
    /// (`servelab-gpu check` reports the same comparisons on the default model).
    #[test]
    fn gpu_mla_chunked_prefill_matches_one_chunk() {
        let Some(gpu) = servelab_kernels::gpu::gpu_or_skip() else {
            return;
        };
        let cfg = BackendConfig {
            hbm_blocks: 64,
            ring_slots: 4,
            ..tiny_mla()
        };
        let mut b = CudaBackend::new(Arc::new(gpu), cfg).unwrap();
        assert!(b.k.mla.is_some() && b.k.swa.is_none() && b.prefill_tiles().is_none());
        let diffs = crate::checks::replay_checks(&mut b, &[(700, 384)], 140).unwrap();
        for d in &diffs {
            println!(
                "{}: max abs {:.3e}, mean {:.3e}",
                d.what, d.max_abs, d.mean_abs
            );
            assert!(d.max_abs.is_finite(), "{}", d.what);
        }
        // warm vs cold, and the exact path (chunked vs one chunk with a full replay): the
        // split kernels cut the key ranges at other points, so only rounding differs; the
        // truncated window and the bounded replay are approximations (about 0.3-0.5 here on
        // the GQA model) and are not bounded
        for d in [&diffs[0], &diffs[2]] {
            assert!(d.max_abs <= 0.05, "{}: {}", d.what, d.max_abs);
            assert!(d.mean_abs <= 0.01, "{}: {}", d.what, d.mean_abs);
        }
    }

    /// Decode steps in every [`DecodeMode`] from the same prefilled state, on both attention
    /// shapes: the device-sized MoE (and the padded attention plan of the MLA model) and the
    /// replayed graph give the eager logits up to rounding.
    #[test]
    fn gpu_device_bound_decode_matches_eager() {
        let Some(gpu) = servelab_kernels::gpu::gpu_or_skip() else {
            return;
        };
        let gpu = Arc::new(gpu);
        for cfg in [tiny_mla(), tiny()] {
            let mla = cfg.model.attention == AttentionKind::Mla;
            let mut per_mode = Vec::new();
            for mode in [DecodeMode::Eager, DecodeMode::DeviceMoe, DecodeMode::Graph] {
                let cfg = BackendConfig {
                    hbm_blocks: 16,
                    ring_slots: 4,
                    ..cfg.clone()
                };
                let mut b = CudaBackend::new(gpu.clone(), cfg).unwrap();
                b.set_decode_mode(mode).unwrap();
                // The MLA model decodes one token per sequence: its eager path gives
                // non-finite logits for a sequence verifying two drafts at this tiny shape (in
                // every mode alike), which is a separate issue of the MLA kernel. The GQA
                // model's three tokens leave the kept buffers (sized 4) larger than the step.
                let (logits, stats) = decode_steps(&mut b, if mla { 0 } else { 1 });
                println!("{mode:?} (MLA {mla}): graphs {stats:?}");
                match mode {
                    DecodeMode::Graph if mla => {
                        assert_eq!((stats.captures, stats.replays), (1, 3), "{stats:?}")
                    }
                    DecodeMode::Eager => assert_eq!(stats, GraphStats::default()),
                    _ => assert_eq!(stats.eager_steps, 4, "{stats:?}"),
                }
                per_mode.push(logits);
            }
            for (step, eager) in per_mode[0].iter().enumerate() {
                for (m, other) in [(1, &per_mode[1][step]), (2, &per_mode[2][step])] {
                    assert_eq!(eager.len(), other.len());
                    let max = eager
                        .iter()
                        .zip(other)
                        .map(|(x, y)| (x - y).abs() as f64)
                        .fold(0.0, f64::max);
                    let mean = eager
                        .iter()
                        .zip(other)
                        .map(|(x, y)| (x - y).abs() as f64)
                        .sum::<f64>()
                        / eager.len() as f64;
                    let scale = eager.iter().map(|x| x.abs() as f64).fold(0.0, f64::max);
                    println!(
                        "MLA {mla} step {step} mode {m} vs eager: max abs logit diff {max:.3e}, mean {mean:.3e} (largest |logit| {scale:.3})"
                    );
                    assert!(eager.iter().all(|x| x.is_finite()));
                    assert!(other.iter().all(|x| x.is_finite()));
                    assert!(max <= 0.05 * scale.max(1.0), "max diff {max}");
                    assert!(mean <= 0.01 * scale.max(1.0), "mean diff {mean}");
                }
                // Replayed graph against the same launches issued one by one. They run on
                // separate backends, and the tiny MLA shape's logits are not reproducible bit
                // for bit from backend to backend (they vary at the 1e-3 level in every mode),
                // so this is a tolerance, not an equality.
                let (a, c) = (&per_mode[1][step], &per_mode[2][step]);
                let max = a
                    .iter()
                    .zip(c)
                    .map(|(x, y)| (x - y).abs() as f64)
                    .fold(0.0, f64::max);
                let scale = a.iter().map(|x| x.abs() as f64).fold(0.0, f64::max);
                println!(
                    "MLA {mla} step {step} graph vs launch by launch: max abs logit diff {max:.3e}"
                );
                assert!(max <= 0.05 * scale.max(1.0), "graph vs launches: {max}");
            }
        }
    }

    /// Two prompts, then four decode steps of both (the first verifying `drafts` drafts);
    /// returns every step's logits and the graph statistics.
    fn decode_steps(b: &mut CudaBackend, drafts: u32) -> (Vec<Vec<f32>>, GraphStats) {
        let m = b.config().model.clone();
        let mut rep = StepReport::default();
        for req in 0..2u64 {
            let plan = StepPlan::Prefill(PrefillPlan {
                engine: EngineId(0),
                chunks: vec![PrefillChunk {
                    request: RequestId(req),
                    new_tokens: 300,
                    prefix_tokens: 0,
                    new_token_layers: m.encoder_layers as u32,
                    decoder_tokens: 140,
                    decoder_layers: m.decoder_layers as u32,
                    swap_in_bytes: 0,
                }],
                expert_imbalance: 1.0,
            });
            b.try_execute(&plan, &mut rep).unwrap();
        }
        b.keep_logits = true;
        let mut out = Vec::new();
        for step in 0..4u32 {
            let plan = StepPlan::Decode(DecodePlan {
                engine: EngineId(0),
                ranks: vec![DecodeRankPlan {
                    seq_start: 0,
                    seq_end: 2,
                    verify_budget: drafts,
                }],
                seqs: vec![
                    DecodeSeq {
                        request: RequestId(0),
                        kv_tokens: 300 + (1 + drafts) * step,
                        max_drafts: drafts,
                        slot: 0,
                    },
                    DecodeSeq {
                        request: RequestId(1),
                        kv_tokens: 300 + step,
                        max_drafts: 0,
                        slot: 1,
                    },
                ],
                dynamic: false,
                expert_imbalance: 1.0,
            });
            b.try_execute(&plan, &mut rep).unwrap();
            assert_eq!(b.last_tokens.len(), 2 + drafts as usize);
            assert!(b.last_host_issue > std::time::Duration::ZERO);
            out.push(b.last_logits.clone());
        }
        (out, b.graph_stats())
    }

    fn runs_plans_and_swaps(mut b: CudaBackend) {
        let m = b.config().model.clone();
        let mut rep = StepReport::default();
        for req in 0..3u64 {
            let plan = StepPlan::Prefill(PrefillPlan {
                engine: EngineId(0),
                chunks: vec![PrefillChunk {
                    request: RequestId(req),
                    new_tokens: 300,
                    prefix_tokens: 0,
                    new_token_layers: m.encoder_layers as u32,
                    decoder_tokens: 140,
                    decoder_layers: m.decoder_layers as u32,
                    swap_in_bytes: 0,
                }],
                expert_imbalance: 1.0,
            });
            b.try_execute(&plan, &mut rep).unwrap();
            assert!(rep.duration.0 > 0);
            assert_eq!(b.last_tokens.len(), 1);
        }
        // 3 x 3 blocks > 8: request 0 was swapped out; decoding it swaps it back in
        let plan = StepPlan::Decode(DecodePlan {
            engine: EngineId(0),
            ranks: vec![DecodeRankPlan {
                seq_start: 0,
                seq_end: 2,
                verify_budget: 3,
            }],
            seqs: vec![
                DecodeSeq {
                    request: RequestId(0),
                    kv_tokens: 300,
                    max_drafts: 5,
                    slot: 0,
                },
                DecodeSeq {
                    request: RequestId(2),
                    kv_tokens: 300,
                    max_drafts: 1,
                    slot: 1,
                },
            ],
            dynamic: true,
            expert_imbalance: 1.0,
        });
        b.try_execute(&plan, &mut rep).unwrap();
        assert_eq!(rep.seqs.len(), 2);
        // budget 3 dealt round-robin: 2 + 1
        assert_eq!((rep.seqs[0].verified, rep.seqs[1].verified), (2, 1));
        assert!(rep.seqs.iter().all(|s| s.accepted <= s.verified));
        assert_eq!(b.last_tokens.len(), 3 + 2);
        assert_eq!(rep.ranks.len(), 1);
    }
}
