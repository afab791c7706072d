//! The scaled-down model shaped like SPEC §1 and its random bf16 weights.
//!
//! A causal encoder–decoder (YOCO-like): `encoder_layers` layers run over every prompt token,
//! each with sliding-window attention plus attention over its own paged global KV (one MLA-like
//! row of `kv_heads × head_dim` per token, values are the row itself, 128-token blocks), both
//! added to the residual, then MoE; the encoder's final hidden state is projected once into the
//! shared global KV the decoder reads. `decoder_layers` layers of sliding-window self-attention,
//! cross-attention over the global KV and MoE run only over the replayed tail (prefill) and the
//! decode tokens. Simplification: the decoder's input is the token embedding (not the encoder's
//! hidden state), so a decoder replay of any length needs no encoder activations; the costs are
//! those of the real structure.

use cudarc::driver::CudaSlice;
use half::bf16;
use servelab_core::ConfigError;
use servelab_core::seed::sub_seed;
use servelab_kernels::fill::fill_uniform_bf16;
use servelab_kernels::{GpuContext, KernelError};

/// Every dimension of the model (SPEC §1 defaults: 20 + 20 layers, window 128, 128-token blocks).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelShape {
    pub encoder_layers: usize,
    pub decoder_layers: usize,
    pub hidden: usize,
    /// KV heads of both the SWA and the global attention (one row of `kv_heads × head_dim`).
    pub kv_heads: usize,
    /// Query heads per KV head.
    pub group: usize,
    /// Head width; a multiple of 32 (the tensor-core attention kernel's chunk).
    pub head_dim: usize,
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
            kv_heads: 4,
            group: 4,
            head_dim: 128,
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

impl ModelShape {
    pub fn q_dim(&self) -> usize {
        self.kv_heads * self.group * self.head_dim
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

    /// Weight elements of the whole model.
    pub fn parameters(&self) -> usize {
        let (h, q, r) = (self.hidden, self.q_dim(), self.kv_row());
        let moe = self.experts * (h + 3 * self.expert_ffn * h) + 3 * self.shared_ffn * h;
        let enc = 2 * h + q * h + r * h + h * q + moe;
        let dec = enc + h + q * h + h * q;
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
        let (h, q, r, f) = (
            shape.hidden,
            shape.q_dim(),
            shape.kv_row(),
            shape.expert_ffn,
        );
        let wq = self.mat(q, h)?;
        let wk = self.mat(r, h)?;
        let wo = self.mat(h, q)?;
        let cross = if cross {
            Some(CrossWeights {
                norm: self.ones(h)?,
                wq: self.mat(q, h)?,
                wo: self.mat(h, q)?,
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
        assert_eq!(s.kv_row(), 512);
        assert_eq!(s.block_bytes(), 21 * 128 * 512 * 2);
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
            kv_heads: 1,
            group: 1,
            head_dim: 32,
            experts: 1,
            top_k: 1,
            expert_ffn: 8,
            vocab: 4,
            ..ModelShape::default()
        };
        // enc: norms 16 + wq 256 + wk 256 + wo 256 + moe (router 8 + 3*64) = 984
        // dec: 984 + cross norm 8 + wq 256 + wo 256 = 1504
        // global norm 8 + kv 256 + final norm 8 + embed 32 + head 32 = 336
        assert_eq!(s.parameters(), 984 + 1504 + 336);
        // a shared expert of width 4 adds 3 x 4 x 8 weights to each of the 2 layers
        let with_shared = ModelShape { shared_ffn: 4, ..s };
        assert_eq!(with_shared.parameters(), 984 + 1504 + 336 + 2 * 96);
    }
}
