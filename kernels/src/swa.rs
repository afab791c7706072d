//! Sliding-window attention with a truncation start (bounded replay).
//!
//! Query `i` sits at absolute position `q_pos0 + i`; key row `j` at `k_pos0 + j`. A query at
//! position `p` sees keys in `[max(trunc_start, p - window + 1), p]`. Replaying the segment
//! `[H - 128, H)` with `trunc_start = H - 128` reads nothing below `H - 128`; with
//! `trunc_start <= p - window + 1` for every query it is exact sliding-window attention.

use cudarc::driver::{CudaFunction, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};
use half::bf16;

use crate::check::{BF16_TOL, CheckResult};
use crate::error::{KernelError, ensure};
use crate::gpu::{GpuContext, lane_split};
use crate::testdata::{ErrorStats, random_bf16, rng};

const SRC: &str = include_str!("cuda/swa_attention.cu");
const WARPS: usize = 4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SwaShape {
    pub num_kv_heads: usize,
    pub group: usize,
    pub head_dim: usize,
}

/// Positions and the window of one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SwaRange {
    pub num_q: usize,
    pub num_k: usize,
    pub q_pos0: usize,
    pub k_pos0: usize,
    pub window: usize,
    pub trunc_start: usize,
}

impl SwaShape {
    pub fn num_heads(&self) -> usize {
        self.num_kv_heads * self.group
    }

    fn validate(&self) -> Result<(), KernelError> {
        ensure(self.num_kv_heads > 0 && self.group > 0, || {
            "num_kv_heads and group must be positive".into()
        })?;
        ensure(self.head_dim > 0 && self.head_dim.is_multiple_of(8), || {
            format!(
                "head_dim = {} must be a positive multiple of 8",
                self.head_dim
            )
        })
    }
}

impl SwaRange {
    /// The key rows query `i` sees, as a half-open range of row indices (empty if none).
    pub fn visible(&self, i: usize) -> std::ops::Range<usize> {
        let p = self.q_pos0 + i;
        let lo = self
            .trunc_start
            .max((p + 1).saturating_sub(self.window))
            .max(self.k_pos0);
        let hi = (p + 1).min(self.k_pos0 + self.num_k);
        if lo >= hi {
            0..0
        } else {
            lo - self.k_pos0..hi - self.k_pos0
        }
    }

    fn validate(&self) -> Result<(), KernelError> {
        ensure(self.window > 0, || "window must be positive".into())?;
        ensure(
            self.q_pos0 + self.num_q < i32::MAX as usize
                && self.k_pos0 + self.num_k < i32::MAX as usize,
            || "positions overflow i32".into(),
        )
    }
}

/// CPU reference in f64: q `[num_q, heads, d]`, k and v `[num_k, kv_heads, d]`.
pub fn swa_attention_cpu(
    shape: &SwaShape,
    range: &SwaRange,
    q: &[bf16],
    k: &[bf16],
    v: &[bf16],
    scale: f64,
) -> Vec<f64> {
    let (h, d) = (shape.num_heads(), shape.head_dim);
    let mut out = vec![0.0; range.num_q * h * d];
    for i in 0..range.num_q {
        let vis = range.visible(i);
        for head in 0..h {
            let kvh = head / shape.group;
            let qv = &q[(i * h + head) * d..][..d];
            let scores: Vec<f64> = vis
                .clone()
                .map(|j| {
                    let kr = &k[(j * shape.num_kv_heads + kvh) * d..][..d];
                    qv.iter()
                        .zip(kr)
                        .map(|(a, b)| a.to_f64() * b.to_f64())
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let den: f64 = scores.iter().map(|s| (s - mx).exp()).sum();
            let o = &mut out[(i * h + head) * d..][..d];
            for (j, s) in vis.clone().zip(&scores) {
                let p = (s - mx).exp() / den;
                let vr = &v[(j * shape.num_kv_heads + kvh) * d..][..d];
                for (od, vv) in o.iter_mut().zip(vr) {
                    *od += p * vv.to_f64();
                }
            }
        }
    }
    out
}

pub(crate) fn defines(shape: &SwaShape) -> [(&'static str, usize); 5] {
    let (lpt, cpl) = lane_split(shape.head_dim);
    [
        ("D", shape.head_dim),
        ("GROUP", shape.group),
        ("LPT", lpt),
        ("CPL", cpl),
        ("WARPS", WARPS),
    ]
}

pub(crate) const SOURCE: &str = SRC;

pub struct SwaAttention {
    pub shape: SwaShape,
    func: CudaFunction,
}

impl SwaAttention {
    pub fn new(gpu: &GpuContext, shape: SwaShape) -> Result<Self, KernelError> {
        shape.validate()?;
        let defines = defines(&shape);
        let func = gpu
            .functions("swa_attention", SRC, &defines, &["swa_attention"])?
            .remove(0);
        Ok(Self { shape, func })
    }

    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        gpu: &GpuContext,
        range: &SwaRange,
        q: &CudaView<'_, bf16>,
        k: &CudaView<'_, bf16>,
        v: &CudaView<'_, bf16>,
        scale: f32,
        out: &mut CudaViewMut<'_, bf16>,
    ) -> Result<(), KernelError> {
        range.validate()?;
        let (h, d) = (self.shape.num_heads(), self.shape.head_dim);
        ensure(
            q.len() >= range.num_q * h * d && out.len() >= range.num_q * h * d,
            || "q or out too short".into(),
        )?;
        let kv_len = range.num_k * self.shape.num_kv_heads * d;
        ensure(k.len() >= kv_len && v.len() >= kv_len, || {
            "k or v too short".into()
        })?;
        if range.num_q == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (
                range.num_q.div_ceil(WARPS) as u32,
                self.shape.num_kv_heads as u32,
                1,
            ),
            block_dim: ((WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        let ints = [
            range.num_q,
            range.num_k,
            self.shape.num_kv_heads,
            range.q_pos0,
            range.k_pos0,
            range.window.min(i32::MAX as usize),
            range.trunc_start.min(i32::MAX as usize),
        ]
        .map(|x| x as i32);
        let mut b = gpu.stream.launch_builder(&self.func);
        b.arg(q).arg(k).arg(v);
        for x in &ints {
            b.arg(x);
        }
        b.arg(&scale).arg(out);
        // SAFETY: buffer lengths checked above; the kernel reads only rows [0, num_k).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

/// The SWA GPU check's cases: a bounded replay, an exact window and a decode step.
fn check_cases() -> [(&'static str, SwaRange); 3] {
    let h = 300; // replay boundary
    [
        // bounded replay of [h - 128, h) plus 40 new tokens, truncated at h - 128
        (
            "bounded replay",
            SwaRange {
                num_q: 168,
                num_k: 168,
                q_pos0: h - 128,
                k_pos0: h - 128,
                window: 128,
                trunc_start: h - 128,
            },
        ),
        // exact window over a segment long enough that truncation never bites
        (
            "exact window",
            SwaRange {
                num_q: 50,
                num_k: 300,
                q_pos0: 250,
                k_pos0: 0,
                window: 128,
                trunc_start: 0,
            },
        ),
        // decode of 4 tokens over a buffer holding the window before them
        (
            "decode",
            SwaRange {
                num_q: 4,
                num_k: 131,
                q_pos0: 1000,
                k_pos0: 873,
                window: 128,
                trunc_start: 0,
            },
        ),
    ]
}

pub fn check_gpu(gpu: &GpuContext, seed: u64) -> Result<Vec<CheckResult>, KernelError> {
    let shape = SwaShape {
        num_kv_heads: 2,
        group: 4,
        head_dim: 64,
    };
    let cases = check_cases();
    let sw = SwaAttention::new(gpu, shape)?;
    let mut out = Vec::new();
    for (i, (name, range)) in cases.iter().enumerate() {
        let mut r = rng(seed + i as u64);
        let (nh, d) = (shape.num_heads(), shape.head_dim);
        let q = random_bf16(&mut r, range.num_q * nh * d, 1.0);
        let k = random_bf16(&mut r, range.num_k * shape.num_kv_heads * d, 1.0);
        let v = random_bf16(&mut r, range.num_k * shape.num_kv_heads * d, 1.0);
        let scale = 1.0 / (d as f64).sqrt();
        let reference = swa_attention_cpu(&shape, range, &q, &k, &v, scale);
        let s = &gpu.stream;
        let (dq, dk, dv) = (s.clone_htod(&q)?, s.clone_htod(&k)?, s.clone_htod(&v)?);
        let mut dout = s.clone_htod(&vec![bf16::NAN; reference.len()])?;
        sw.run(
            gpu,
            range,
            &dq.as_view(),
            &dk.as_view(),
            &dv.as_view(),
            scale as f32,
            &mut dout.as_view_mut(),
        )?;
        let got: Vec<f64> = s.clone_dtoh(&dout)?.iter().map(|x| x.to_f64()).collect();
        out.push(CheckResult::from_stats(
            "swa_attention",
            format!("{name}: {range:?}"),
            ErrorStats::of(&got, &reference),
            BF16_TOL,
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::gpu_or_skip;

    #[test]
    fn truncation_hides_keys_below_the_segment() {
        let r = SwaRange {
            num_q: 10,
            num_k: 10,
            q_pos0: 200,
            k_pos0: 200,
            window: 128,
            trunc_start: 200,
        };
        assert_eq!(r.visible(0), 0..1);
        assert_eq!(r.visible(9), 0..10);
        let exact = SwaRange {
            num_q: 1,
            num_k: 300,
            q_pos0: 299,
            k_pos0: 0,
            window: 128,
            trunc_start: 0,
        };
        assert_eq!(exact.visible(0), 172..300);
    }

    #[test]
    fn replay_at_least_the_window_equals_the_exact_path() {
        // When the replayed segment starts a full window before the first query, truncation
        // removes nothing: bounded replay and the exact path agree to the bit.
        let shape = SwaShape {
            num_kv_heads: 1,
            group: 1,
            head_dim: 8,
        };
        let mut r = rng(5);
        let (nk, w) = (40, 16);
        let k = random_bf16(&mut r, nk * 8, 1.0);
        let v = random_bf16(&mut r, nk * 8, 1.0);
        let q = random_bf16(&mut r, 8 * 8, 1.0);
        let exact = SwaRange {
            num_q: 8,
            num_k: nk,
            q_pos0: 32,
            k_pos0: 0,
            window: w,
            trunc_start: 0,
        };
        let bounded = SwaRange {
            trunc_start: 32 - w + 1,
            ..exact
        };
        assert_eq!(
            swa_attention_cpu(&shape, &exact, &q, &k, &v, 0.3),
            swa_attention_cpu(&shape, &bounded, &q, &k, &v, 0.3)
        );
        let cut = SwaRange {
            trunc_start: 32,
            ..exact
        };
        assert_ne!(
            swa_attention_cpu(&shape, &exact, &q, &k, &v, 0.3),
            swa_attention_cpu(&shape, &cut, &q, &k, &v, 0.3)
        );
    }

    #[test]
    fn gpu_matches_cpu() {
        let Some(gpu) = gpu_or_skip() else { return };
        crate::check::assert_all_passed(&check_gpu(&gpu, 21).unwrap());
    }
}
