//! Rotary position embedding (rotate-half layout over the first `rot_dim` elements of a head).

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};
use half::bf16;

use crate::check::{BF16_TOL, CheckResult};
use crate::error::{KernelError, ensure};
use crate::gpu::GpuContext;
use crate::testdata::{ErrorStats, random_bf16, rng};

pub(crate) const SRC: &str = include_str!("cuda/rope.cu");

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeShape {
    pub heads: usize,
    pub head_dim: usize,
    /// Rotated prefix of each head; even, at most `head_dim`.
    pub rot_dim: usize,
    pub theta: f64,
}

impl RopeShape {
    fn validate(&self) -> Result<(), KernelError> {
        ensure(
            self.rot_dim.is_multiple_of(2) && self.rot_dim > 0 && self.rot_dim <= self.head_dim,
            || {
                format!(
                    "rot_dim = {} must be even and in 2..=head_dim",
                    self.rot_dim
                )
            },
        )?;
        ensure(self.theta > 1.0, || "theta must exceed 1".into())
    }
}

/// Applies RoPE to `x` `[n, heads, head_dim]` (values from bf16), returning f64.
pub fn rope_cpu(shape: &RopeShape, x: &[bf16], positions: &[i32]) -> Vec<f64> {
    let mut out: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
    let half = shape.rot_dim / 2;
    for (t, &pos) in positions.iter().enumerate() {
        for h in 0..shape.heads {
            let row = &mut out[(t * shape.heads + h) * shape.head_dim..][..shape.head_dim];
            for i in 0..half {
                let inv_freq = shape.theta.powf(-2.0 * i as f64 / shape.rot_dim as f64);
                let (s, c) = (pos as f64 * inv_freq).sin_cos();
                let (a, b) = (row[i], row[i + half]);
                row[i] = a * c - b * s;
                row[i + half] = b * c + a * s;
            }
        }
    }
    out
}

pub struct Rope {
    pub shape: RopeShape,
    func: CudaFunction,
}

impl Rope {
    pub fn new(gpu: &GpuContext, shape: RopeShape) -> Result<Self, KernelError> {
        shape.validate()?;
        Ok(Self {
            shape,
            func: gpu.functions("rope", SRC, &[], &["rope"])?.remove(0),
        })
    }

    /// In place on `x` `[positions.len(), heads, head_dim]`.
    pub fn run(
        &self,
        gpu: &GpuContext,
        x: &mut CudaSlice<bf16>,
        positions: &CudaSlice<i32>,
    ) -> Result<(), KernelError> {
        let n = positions.len();
        let sh = &self.shape;
        ensure(x.len() >= n * sh.heads * sh.head_dim, || {
            "x too short for positions".into()
        })?;
        let total = n * sh.heads * sh.rot_dim / 2;
        if total == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (total.div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let ints = [n, sh.heads, sh.head_dim, sh.rot_dim].map(|v| v as i32);
        let mut b = gpu.stream.launch_builder(&self.func);
        b.arg(x).arg(positions);
        for v in &ints {
            b.arg(v);
        }
        b.arg(&sh.theta);
        // SAFETY: x holds n * heads * head_dim elements.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

pub fn check_gpu(gpu: &GpuContext, seed: u64) -> Result<Vec<CheckResult>, KernelError> {
    let shape = RopeShape {
        heads: 4,
        head_dim: 96,
        rot_dim: 64,
        theta: 10000.0,
    };
    let rope = Rope::new(gpu, shape)?;
    let mut r = rng(seed);
    let positions: Vec<i32> = vec![0, 1, 2, 127, 128, 4095, 65_537, 1_000_003];
    let x = random_bf16(&mut r, positions.len() * shape.heads * shape.head_dim, 1.0);
    let reference = rope_cpu(&shape, &x, &positions);
    let s = &gpu.stream;
    let mut dx = s.clone_htod(&x)?;
    rope.run(gpu, &mut dx, &s.clone_htod(&positions)?)?;
    let got: Vec<f64> = s.clone_dtoh(&dx)?.iter().map(|v| v.to_f64()).collect();
    Ok(vec![CheckResult::from_stats(
        "rope",
        format!("{shape:?} positions {positions:?}"),
        ErrorStats::of(&got, &reference),
        BF16_TOL,
    )])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::gpu_or_skip;

    #[test]
    fn position_zero_is_identity_and_tail_is_untouched() {
        let shape = RopeShape {
            heads: 1,
            head_dim: 6,
            rot_dim: 4,
            theta: 10000.0,
        };
        let x: Vec<bf16> = (1..=6).map(|v| bf16::from_f32(v as f32)).collect();
        assert_eq!(
            rope_cpu(&shape, &x, &[0]),
            vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        );
        let y = rope_cpu(&shape, &x, &[1]);
        // pair (0, 2) rotates by 1 radian (inv_freq 1 for i = 0)
        let (s, c) = 1f64.sin_cos();
        assert!((y[0] - (c - 3.0 * s)).abs() < 1e-12 && (y[2] - (3.0 * c + s)).abs() < 1e-12);
        assert_eq!(&y[4..], &[5.0, 6.0]);
    }

    #[test]
    fn gpu_matches_cpu() {
        let Some(gpu) = gpu_or_skip() else { return };
        crate::check::assert_all_passed(&check_gpu(&gpu, 41).unwrap());
    }
}
