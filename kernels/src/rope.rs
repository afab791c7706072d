//! Rotary position embedding (rotate-half layout over `rot_dim` elements of a head from
//! `rot_start` on).

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
    /// First rotated element of each head (0 for GQA; MLA rotates the latent's tail).
    pub rot_start: usize,
    /// Rotated elements of each head; even, `rot_start + rot_dim` at most `head_dim`.
    pub rot_dim: usize,
    pub theta: f64,
}

impl RopeShape {
    fn validate(&self) -> Result<(), KernelError> {
        ensure(
            self.rot_dim.is_multiple_of(2)
                && self.rot_dim > 0
                && self.rot_start + self.rot_dim <= self.head_dim,
            || {
                format!(
                    "rot_dim = {} must be even and positive, and rot_start + rot_dim at most head_dim",
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
            let row = &mut out[(t * shape.heads + h) * shape.head_dim + shape.rot_start..]
                [..shape.rot_dim];
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
        self.run_rows(gpu, x, positions, positions.len())
    }

    /// As [`Self::run`] over the first `n` rows of `x` and `positions` (a positions buffer
    /// kept between steps is sized for the largest step, not for this one).
    pub fn run_rows(
        &self,
        gpu: &GpuContext,
        x: &mut CudaSlice<bf16>,
        positions: &CudaSlice<i32>,
        n: usize,
    ) -> Result<(), KernelError> {
        let sh = &self.shape;
        ensure(
            positions.len() >= n && x.len() >= n * sh.heads * sh.head_dim,
            || "x or positions too short for the rows".into(),
        )?;
        let total = n * sh.rot_dim / 2;
        if total == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (total.div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let ints = [n, sh.heads, sh.head_dim, sh.rot_start, sh.rot_dim].map(|v| v as i32);
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

/// A head's leading part rotated (GQA) and an MLA-like latent's tail rotated, each against
/// [`rope_cpu`] (which also checks that the elements outside the rotated range are untouched).
pub fn check_gpu(gpu: &GpuContext, seed: u64) -> Result<Vec<CheckResult>, KernelError> {
    let lead = RopeShape {
        heads: 4,
        head_dim: 96,
        rot_start: 0,
        rot_dim: 64,
        theta: 10000.0,
    };
    let tail = RopeShape {
        heads: 2,
        head_dim: 576,
        rot_start: 512,
        rot_dim: 64,
        theta: 10000.0,
    };
    let mut r = rng(seed);
    let positions: Vec<i32> = vec![0, 1, 2, 127, 128, 4095, 65_537, 1_000_003];
    let s = &gpu.stream;
    let mut out = Vec::new();
    for shape in [lead, tail] {
        let rope = Rope::new(gpu, shape)?;
        let x = random_bf16(&mut r, positions.len() * shape.heads * shape.head_dim, 1.0);
        let reference = rope_cpu(&shape, &x, &positions);
        let mut dx = s.clone_htod(&x)?;
        rope.run(gpu, &mut dx, &s.clone_htod(&positions)?)?;
        let got: Vec<f64> = s.clone_dtoh(&dx)?.iter().map(|v| v.to_f64()).collect();
        out.push(CheckResult::from_stats(
            "rope",
            format!("{shape:?} positions {positions:?}"),
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
    fn position_zero_is_identity_and_tail_is_untouched() {
        let shape = RopeShape {
            heads: 1,
            head_dim: 6,
            rot_start: 0,
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
        // the same rotation on the tail of the row leaves its head untouched
        let tail = RopeShape {
            rot_start: 2,
            ..shape
        };
        let x: Vec<bf16> = [5, 6, 1, 2, 3, 4]
            .iter()
            .map(|&v| bf16::from_f32(v as f32))
            .collect();
        let z = rope_cpu(&tail, &x, &[1]);
        assert_eq!(&z[..2], &[5.0, 6.0]);
        assert_eq!(&z[2..], &y[..4]);
    }

    #[test]
    fn gpu_matches_cpu() {
        let Some(gpu) = gpu_or_skip() else { return };
        crate::check::assert_all_passed(&check_gpu(&gpu, 41).unwrap());
    }
}
