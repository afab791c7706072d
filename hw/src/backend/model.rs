//! The scaled-down model shaped like SPEC §1 and its random bf16 weights.
//!
//! A causal encoder–decoder (YOCO-like): `encoder_layers` layers run over every prompt token,
//! each with sliding-window attention plus attention over its own paged global KV (one row of
//! `kv_heads × head_dim` per token, 128-token blocks), both added to the residual, then MoE;
//! the encoder's final hidden state is projected once into the
//! shared global KV the decoder reads. `decoder_layers` layers of sliding-window self-attention,
//! cross-attention over the global KV and MoE run only over the replayed tail (prefill) and the
//! decode tokens. Simplification: the decoder's input is the token embedding (not the encoder's
//! hidden state), so a decoder replay of any length needs no encoder activations; the costs are
//! those of the real structure.
//!
//! The attention has one of two shapes ([`AttentionKind`]). MLA, the default and SPEC §1's:
//! one latent row of 576 per token (`kv_heads = 1`, `head_dim = 576`) read by 16 query heads,
//! whose first `value_dim` (512) elements are also the value and whose last `rope_dim` (64)
//! carry the rotary position. GQA, kept for the measured conformance models: `kv_heads` rows
//! of `head_dim`, each its own value, rotated whole.

use cudarc::driver::CudaSlice;
use half::bf16;
use servelab_core::ConfigError;
use servelab_core::seed::sub_seed;
use servelab_kernels::fill::fill_uniform_bf16;
use servelab_kernels::{GpuContext, KernelError};

/// The shape of every attention of the model (SWA and global alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttentionKind {
    /// Multi-head latent attention: the value is the first `value_dim` elements of the key
    /// row, RoPE turns its last `rope_dim`, and the MLA decode kernel runs every attention.
    Mla,
    /// Grouped-query attention: each head's value is its whole key row, RoPE turns it whole.
    Gqa,
}

/// Every dimension of the model (SPEC §1 defaults: 20 + 20 layers, MLA with a 576-wide
/// latent and 16 heads, window 128, 128-token blocks).
///
/// A model table without `attention` that sets `kv_heads`, `group` or `head_dim` is GQA: every
/// config and record written before MLA became the default describes a GQA model that way,
/// and must keep meaning it (see [`RawShape`]).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(from = "RawShape")]
pub struct ModelShape {
    pub encoder_layers: usize,
    pub decoder_layers: usize,
    pub hidden: usize,
    pub attention: AttentionKind,
    /// KV heads of both the SWA and the global attention (one row of `kv_heads × head_dim`);
    /// MLA has one latent.
    pub kv_heads: usize,
    /// Query heads per KV head.
    pub group: usize,
    /// Key row width per KV head; a multiple of 32 (the tensor-core attention kernels' chunk).
    pub head_dim: usize,
    /// MLA: the value's width, the first elements of the latent (GQA: unused, the value is the
    /// whole row).
    pub value_dim: usize,
    /// MLA: the rotary part of the latent, its last elements (GQA: unused, RoPE turns the
    /// whole row).
    pub rope_dim: usize,
    pub experts: usize,
    pub top_k: usize,
    pub expert_ffn: usize,
    /// Width of the shared expert every token runs besides its routed ones (SPEC §1 has one);
    /// 0: none.
    pub shared_ffn: usize,
    pub vocab: usize,
    /// Sliding window (SPEC §2: 128).
    pub window: usize,
    /// Tokens per KV block (SPEC §2: 128).
    pub block_size: usize,
    pub rope_theta: f64,
    pub norm_eps: f32,
    /// Seed of the random weights.
    pub seed: u64,
}

impl Default for ModelShape {
    fn default() -> Self {
        Self {
            encoder_layers: 20,
            decoder_layers: 20,
            hidden: 1024,
            attention: AttentionKind::Mla,
            kv_heads: 1,
            group: 16,
            head_dim: 576,
            value_dim: 512,
            rope_dim: 64,
            experts: 8,
            top_k: 2,
            expert_ffn: 1024,
            shared_ffn: 0,
            vocab: 8192,
            window: 128,
            block_size: 128,
            rope_theta: 10_000.0,
            norm_eps: 1e-6,
            seed: 1,
        }
    }
}

/// A model table as written: the attention's widths optional, so that a table without
/// `attention` can be told apart by whether it names GQA's widths (see [`ModelShape`]).
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawShape {
    encoder_layers: usize,
    decoder_layers: usize,
    hidden: usize,
    attention: Option<AttentionKind>,
    kv_heads: Option<usize>,
    group: Option<usize>,
    head_dim: Option<usize>,
    value_dim: Option<usize>,
    rope_dim: Option<usize>,
    experts: usize,
    top_k: usize,
    expert_ffn: usize,
    shared_ffn: usize,
    vocab: usize,
    window: usize,
    block_size: usize,
    rope_theta: f64,
    norm_eps: f32,
    seed: u64,
}

impl Default for RawShape {
    fn default() -> Self {
        let d = ModelShape::default();
        Self {
            encoder_layers: d.encoder_layers,
            decoder_layers: d.decoder_layers,
            hidden: d.hidden,
            attention: None,
            kv_heads: None,
            group: None,
            head_dim: None,
            value_dim: None,
            rope_dim: None,
            experts: d.experts,
            top_k: d.top_k,
            expert_ffn: d.expert_ffn,
            shared_ffn: d.shared_ffn,
            vocab: d.vocab,
            window: d.window,
            block_size: d.block_size,
            rope_theta: d.rope_theta,
            norm_eps: d.norm_eps,
            seed: d.seed,
        }
    }
}

impl From<RawShape> for ModelShape {
    fn from(r: RawShape) -> Self {
        let names_gqa = r.kv_heads.is_some() || r.group.is_some() || r.head_dim.is_some();
        let attention = r.attention.unwrap_or(if names_gqa {
            AttentionKind::Gqa
        } else {
            AttentionKind::Mla
        });
        let base = match attention {
            AttentionKind::Mla => ModelShape::default(),
            AttentionKind::Gqa => ModelShape::default().gqa(GQA_KV_HEADS, GQA_GROUP, GQA_HEAD_DIM),
        };
        Self {
            encoder_layers: r.encoder_layers,
            decoder_layers: r.decoder_layers,
            hidden: r.hidden,
            attention,
            kv_heads: r.kv_heads.unwrap_or(base.kv_heads),
            group: r.group.unwrap_or(base.group),
            head_dim: r.head_dim.unwrap_or(base.head_dim),
            value_dim: r.value_dim.unwrap_or(base.value_dim),
            rope_dim: r.rope_dim.unwrap_or(base.rope_dim),
            experts: r.experts,
            top_k: r.top_k,
            expert_ffn: r.expert_ffn,
            shared_ffn: r.shared_ffn,
            vocab: r.vocab,
            window: r.window,
            block_size: r.block_size,
            rope_theta: r.rope_theta,
            norm_eps: r.norm_eps,
            seed: r.seed,
        }
    }
}

/// The GQA widths a model table with `attention = "gqa"` and no widths gets: the backend's
/// shape before MLA became the default (a 512-wide KV row, the nearest to MLA's 576 of 128-wide
/// heads).
pub const GQA_KV_HEADS: usize = 4;
pub const GQA_GROUP: usize = 4;
pub const GQA_HEAD_DIM: usize = 128;

impl ModelShape {
    /// The GQA shape of `kv_heads` rows of `head_dim` (`group` query heads each), the rest of
    /// the dimensions as `self`.
    pub fn gqa(self, kv_heads: usize, group: usize, head_dim: usize) -> Self {
        Self {
            attention: AttentionKind::Gqa,
            kv_heads,
            group,
            head_dim,
            ..self
        }
    }

    /// Query heads.
    pub fn heads(&self) -> usize {
        self.kv_heads * self.group
    }

    pub fn q_dim(&self) -> usize {
        self.heads() * self.head_dim
    }

    /// Width of one head's value (and of its attention output).
    pub fn d_v(&self) -> usize {
        match self.attention {
            AttentionKind::Mla => self.value_dim,
            AttentionKind::Gqa => self.head_dim,
        }
    }

    /// The attention output of one token, all heads: the output projection's input.
    pub fn o_dim(&self) -> usize {
        self.heads() * self.d_v()
    }

    /// The rotated range of each head's row: (first element, width).
    pub fn rope_range(&self) -> (usize, usize) {
        match self.attention {
            AttentionKind::Mla => (self.head_dim - self.rope_dim, self.rope_dim),
            AttentionKind::Gqa => (0, self.head_dim),
        }
    }

    /// The paged-attention shape of every attention of the model.
    pub fn attention_shape(&self) -> servelab_kernels::attention::PagedAttentionShape {
        servelab_kernels::attention::PagedAttentionShape {
            num_kv_heads: self.kv_heads,
            group: self.group,
            d_qk: self.head_dim,
            d_v: self.d_v(),
            block_size: self.block_size,
        }
    }

    /// One token's KV row (global pool and SWA rings), in bf16 elements.
    pub fn kv_row(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    pub fn layers(&self) -> usize {
        self.encoder_layers + self.decoder_layers
    }

    /// Layers of the paged global KV: one per encoder layer (each attends over its own
    /// compressed KV) plus the shared one the decoder layers read.
    pub fn global_layers(&self) -> usize {
        self.encoder_layers + 1
    }

    /// Bytes of one global KV block (every global layer's rows of 128 tokens).
    pub fn block_bytes(&self) -> usize {
        self.global_layers() * self.block_size * self.kv_row() * 2
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let pos = |name: &str, v: usize| {
            if v == 0 {
                Err(ConfigError::invalid(
                    format!("model.{name}"),
                    "must be positive",
                ))
            } else {
                Ok(())
            }
        };
        for (n, v) in [
            ("encoder_layers", self.encoder_layers),
            ("decoder_layers", self.decoder_layers),
            ("hidden", self.hidden),
            ("kv_heads", self.kv_heads),
            ("group", self.group),
            ("head_dim", self.head_dim),
            ("experts", self.experts),
            ("top_k", self.top_k),
            ("expert_ffn", self.expert_ffn),
            ("vocab", self.vocab),
            ("window", self.window),
            ("block_size", self.block_size),
        ] {
            pos(n, v)?;
        }
        if !self.head_dim.is_multiple_of(32) {
            return Err(ConfigError::invalid(
                "model.head_dim",
                format!("{} must be a multiple of 32", self.head_dim),
            ));
        }
        self.validate_mla()?;
        if !self.hidden.is_multiple_of(8) {
            return Err(ConfigError::invalid(
                "model.hidden",
                format!("{} must be a multiple of 8", self.hidden),
            ));
        }
        if self.top_k > self.experts.min(32) {
            return Err(ConfigError::invalid(
                "model.top_k",
                format!("{} must be at most min(32, experts)", self.top_k),
            ));
        }
        if self.window > self.block_size {
            // The SWA ring holds two blocks: the window plus one step's new tokens must fit.
            return Err(ConfigError::invalid(
                "model.window",
                format!(
                    "{} must be at most block_size = {}",
                    self.window, self.block_size
                ),
            ));
        }
        if self.rope_theta.is_nan() || self.rope_theta <= 1.0 {
            return Err(ConfigError::invalid("model.rope_theta", "must exceed 1"));
        }
        Ok(())
    }

    /// MLA's own rules: one latent, a value and a rotary part that fit in it without
    /// overlapping (the value must not be rotated), widths the MLA kernel takes.
    fn validate_mla(&self) -> Result<(), ConfigError> {
        if self.attention != AttentionKind::Mla {
            return Ok(());
        }
        if self.kv_heads != 1 {
            return Err(ConfigError::invalid(
                "model.kv_heads",
                format!("{} must be 1 with MLA (one latent)", self.kv_heads),
            ));
        }
        let (v, r, d) = (self.value_dim, self.rope_dim, self.head_dim);
        if v == 0 || !v.is_multiple_of(32) || r == 0 || !r.is_multiple_of(2) || v + r > d {
            return Err(ConfigError::invalid(
                "model.value_dim",
                format!(
                    "value_dim = {v} (a positive multiple of 32) and rope_dim = {r} (positive, \
                     even) must fit head_dim = {d} together"
                ),
            ));
        }
        Ok(())
    }

    /// Weight elements of the whole model.
    pub fn parameters(&self) -> usize {
        let (h, q, r, o) = (self.hidden, self.q_dim(), self.kv_row(), self.o_dim());
        let moe = self.experts * (h + 3 * self.expert_ffn * h) + 3 * self.shared_ffn * h;
        let enc = 2 * h + q * h + r * h + h * o + moe;
        let dec = enc + h + q * h + h * o;
        self.encoder_layers * enc + self.decoder_layers * dec + h + r * h + h + 2 * self.vocab * h
    }
}

/// One expert's gate|up `[2 ffn, hidden]` and down `[hidden, ffn]` projections.
pub struct ExpertWeights {
    pub w_gate_up: CudaSlice<bf16>,
    pub w_down: CudaSlice<bf16>,
}

/// One layer; `cross` is present in decoder layers only, `shared` when `shared_ffn > 0`.
pub struct LayerWeights {
    pub attn_norm: CudaSlice<bf16>,
    pub wq: CudaSlice<bf16>,
    pub wk: CudaSlice<bf16>,
    pub wo: CudaSlice<bf16>,
    pub cross: Option<CrossWeights>,
    pub ffn_norm: CudaSlice<bf16>,
    pub router: CudaSlice<bf16>,
    pub experts: Vec<ExpertWeights>,
    pub shared: Option<ExpertWeights>,
}

/// Cross-attention over the global KV (decoder layers).
pub struct CrossWeights {
    pub norm: CudaSlice<bf16>,
    pub wq: CudaSlice<bf16>,
    pub wo: CudaSlice<bf16>,
}

pub struct ModelWeights {
    pub embed: CudaSlice<bf16>,
    pub encoder: Vec<LayerWeights>,
    pub decoder: Vec<LayerWeights>,
    /// Encoder output → global KV row.
    pub global_norm: CudaSlice<bf16>,
    pub w_global_kv: CudaSlice<bf16>,
    pub final_norm: CudaSlice<bf16>,
    pub lm_head: CudaSlice<bf16>,
}

/// Draws a model's random weights on the device in a fixed order: every matrix takes the next
/// sub-seed of `base`.
struct WeightDraws<'a> {
    gpu: &'a GpuContext,
    base: u64,
    counter: u64,
}

impl WeightDraws<'_> {
    /// A `[rows, cols]` matrix, uniform in ±1/√cols.
    fn mat(&mut self, rows: usize, cols: usize) -> Result<CudaSlice<bf16>, KernelError> {
        let mut w = self.gpu.stream.alloc_zeros::<bf16>(rows * cols)?;
        self.counter += 1;
        fill_uniform_bf16(
            self.gpu,
            &mut w,
            self.base ^ self.counter.wrapping_mul(0x9e37_79b9_7f4a_7c15),
            1.0 / (cols as f32).sqrt(),
        )?;
        Ok(w)
    }

    /// Norm gains of 1 (no draw).
    fn ones(&self, n: usize) -> Result<CudaSlice<bf16>, KernelError> {
        Ok(self.gpu.stream.clone_htod(&vec![bf16::ONE; n])?)
    }

    /// One expert's gate|up and down projections for an FFN width `f`.
    fn expert(&mut self, h: usize, f: usize) -> Result<ExpertWeights, KernelError> {
        Ok(ExpertWeights {
            w_gate_up: self.mat(2 * f, h)?,
            w_down: self.mat(h, f)?,
        })
    }

    /// One layer (with cross-attention for a decoder layer).
    fn layer(&mut self, shape: &ModelShape, cross: bool) -> Result<LayerWeights, KernelError> {
        let (h, q, r, o, f) = (
            shape.hidden,
            shape.q_dim(),
            shape.kv_row(),
            shape.o_dim(),
            shape.expert_ffn,
        );
        let wq = self.mat(q, h)?;
        let wk = self.mat(r, h)?;
        let wo = self.mat(h, o)?;
        let cross = if cross {
            Some(CrossWeights {
                norm: self.ones(h)?,
                wq: self.mat(q, h)?,
                wo: self.mat(h, o)?,
            })
        } else {
            None
        };
        let router = self.mat(shape.experts, h)?;
        let experts = (0..shape.experts)
            .map(|_| self.expert(h, f))
            .collect::<Result<Vec<_>, KernelError>>()?;
        // drawn after the routed experts, so a model without one keeps its other weights
        let shared = if shape.shared_ffn > 0 {
            Some(self.expert(h, shape.shared_ffn)?)
        } else {
            None
        };
        Ok(LayerWeights {
            attn_norm: self.ones(h)?,
            wq,
            wk,
            wo,
            cross,
            ffn_norm: self.ones(h)?,
            router,
            experts,
            shared,
        })
    }
}

impl ModelWeights {
    /// Uniform random weights in ±1/√fan_in (norm gains 1), drawn on the device from
    /// `shape.seed`: each matrix has its own sub-seed, so a shape change elsewhere never
    /// changes a matrix's values.
    pub fn random(gpu: &GpuContext, shape: &ModelShape) -> Result<Self, KernelError> {
        let base = sub_seed(shape.seed, "hw.weights");
        let mut w = WeightDraws {
            gpu,
            base,
            counter: 0,
        };
        let encoder = (0..shape.encoder_layers)
            .map(|_| w.layer(shape, false))
            .collect::<Result<Vec<_>, _>>()?;
        let decoder = (0..shape.decoder_layers)
            .map(|_| w.layer(shape, true))
            .collect::<Result<Vec<_>, _>>()?;
        let (h, r) = (shape.hidden, shape.kv_row());
        // Embeddings of unit scale so the first norm sees O(1) values.
        let mut embed = gpu.stream.alloc_zeros::<bf16>(shape.vocab * h)?;
        fill_uniform_bf16(gpu, &mut embed, base ^ 0xe5b, 1.0)?;
        Ok(Self {
            embed,
            encoder,
            decoder,
            global_norm: w.ones(h)?,
            w_global_kv: w.mat(r, h)?,
            final_norm: w.ones(h)?,
            lm_head: w.mat(shape.vocab, h)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_shape_is_spec_shaped_and_valid() {
        let s = ModelShape::default();
        s.validate().unwrap();
        assert_eq!((s.encoder_layers, s.decoder_layers), (20, 20));
        assert_eq!((s.window, s.block_size), (128, 128));
        // MLA: one 576-wide latent (512 value + 64 rotary) for 16 heads
        assert_eq!(s.attention, AttentionKind::Mla);
        assert_eq!(
            (s.kv_row(), s.q_dim(), s.o_dim()),
            (576, 16 * 576, 16 * 512)
        );
        assert_eq!(s.rope_range(), (512, 64));
        assert_eq!(s.block_bytes(), 21 * 128 * 576 * 2);
        let a = s.attention_shape();
        assert_eq!((a.num_kv_heads, a.group, a.d_qk, a.d_v), (1, 16, 576, 512));
    }

    #[test]
    fn gqa_stays_an_option_and_old_model_tables_keep_meaning_it() {
        let g = ModelShape::default().gqa(GQA_KV_HEADS, GQA_GROUP, GQA_HEAD_DIM);
        g.validate().unwrap();
        assert_eq!(
            (g.kv_row(), g.o_dim(), g.rope_range()),
            (512, 2048, (0, 128))
        );
        assert_eq!(g.block_bytes(), 21 * 128 * 512 * 2);
        let parse = |t: &str| -> ModelShape { toml::from_str(t).unwrap() };
        // a table written before MLA was the default (the conformance configs' and records')
        let old = parse("hidden = 8192\nkv_heads = 4\ngroup = 4\nhead_dim = 128\n");
        assert_eq!(
            old,
            ModelShape {
                hidden: 8192,
                ..g.clone()
            }
        );
        // naming the kind: its widths default to that kind's
        assert_eq!(parse("attention = \"gqa\"\n"), g);
        assert_eq!(parse(""), ModelShape::default());
        let mla = parse("attention = \"mla\"\ngroup = 8\n");
        assert_eq!(
            (mla.attention, mla.group, mla.head_dim),
            (AttentionKind::Mla, 8, 576)
        );
        // a serialized shape reads back as itself, whichever the kind
        for m in [ModelShape::default(), g] {
            let back: ModelShape =
                serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
            assert_eq!(back, m);
        }
        assert!(toml::from_str::<ModelShape>("heads = 3\n").is_err());
    }

    #[test]
    fn bad_mla_shapes_name_the_field() {
        for (bad, field) in [
            (
                ModelShape {
                    kv_heads: 2,
                    ..ModelShape::default()
                },
                "kv_heads",
            ),
            (
                ModelShape {
                    value_dim: 544,
                    ..ModelShape::default()
                },
                "value_dim",
            ),
            (
                ModelShape {
                    rope_dim: 0,
                    ..ModelShape::default()
                },
                "value_dim",
            ),
        ] {
            let e = bad.validate().unwrap_err();
            assert!(e.to_string().contains(field), "{e}");
        }
        // the same widths are a valid GQA model: MLA's rules do not apply to it
        ModelShape {
            value_dim: 544,
            ..ModelShape::default()
        }
        .gqa(1, 16, 576)
        .validate()
        .unwrap();
    }

    #[test]
    fn bad_shapes_name_the_field() {
        let e = ModelShape {
            head_dim: 100,
            ..ModelShape::default()
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("head_dim"), "{e}");
        let e = ModelShape {
            window: 200,
            ..ModelShape::default()
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("window"), "{e}");
        let e = ModelShape {
            top_k: 9,
            ..ModelShape::default()
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("top_k"), "{e}");
    }

    #[test]
    fn parameter_count_hand_computed_for_a_tiny_shape() {
        let s = ModelShape {
            encoder_layers: 1,
            decoder_layers: 1,
            hidden: 8,
            experts: 1,
            top_k: 1,
            expert_ffn: 8,
            vocab: 4,
            ..ModelShape::default()
        }
        .gqa(1, 1, 32);
        // enc: norms 16 + wq 256 + wk 256 + wo 256 + moe (router 8 + 3*64) = 984
        // dec: 984 + cross norm 8 + wq 256 + wo 256 = 1504
        // global norm 8 + kv 256 + final norm 8 + embed 32 + head 32 = 336
        assert_eq!(s.parameters(), 984 + 1504 + 336);
        // a shared expert of width 4 adds 3 x 4 x 8 weights to each of the 2 layers
        let with_shared = ModelShape {
            shared_ffn: 4,
            ..s.clone()
        };
        assert_eq!(with_shared.parameters(), 984 + 1504 + 336 + 2 * 96);
        // MLA with a latent of 64 (value 32) for 2 heads: wq 128 x 8 = 1024, wk 512, and the
        // output projections read 2 x 32 = 64: wo 512 in each layer, the cross wo too
        let mla = ModelShape {
            attention: AttentionKind::Mla,
            group: 2,
            head_dim: 64,
            value_dim: 32,
            rope_dim: 32,
            ..s
        };
        mla.validate().unwrap();
        // enc: 16 + 1024 + 512 + 512 + 200 = 2264; dec: 2264 + 8 + 1024 + 512 = 3808;
        // global norm 8 + kv 512 + final norm 8 + embed 32 + head 32 = 592
        assert_eq!(mla.parameters(), 2264 + 3808 + 592);
    }
}
