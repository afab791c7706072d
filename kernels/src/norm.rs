//! RMSNorm over rows of bf16.

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};
use half::bf16;

use crate::check::{BF16_TOL, CheckResult};
use crate::error::{KernelError, ensure};
use crate::gpu::GpuContext;
use crate::testdata::{ErrorStats, random_bf16, rng};

pub(crate) const SRC: &str = include_str!("cuda/rmsnorm.cu");

/// y = x / sqrt(mean(x²) + eps) * w, per row of `dim`, in f64.
pub fn rmsnorm_cpu(x: &[bf16], w: &[bf16], dim: usize, eps: f64) -> Vec<f64> {
    x.chunks(dim)
        .flat_map(|row| {
            let ms = row.iter().map(|v| v.to_f64().powi(2)).sum::<f64>() / dim as f64;
            let inv = 1.0 / (ms + eps).sqrt();
            row.iter()
                .zip(w)
                .map(move |(v, g)| v.to_f64() * inv * g.to_f64())
        })
        .collect()
}

pub struct RmsNorm {
    func: CudaFunction,
}

impl RmsNorm {
    pub fn new(gpu: &GpuContext) -> Result<Self, KernelError> {
        Ok(Self {
            func: gpu.functions("rmsnorm", SRC, &[], &["rmsnorm"])?.remove(0),
        })
    }

    /// `y[rows, dim] = rmsnorm(x) * w`.
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        gpu: &GpuContext,
        x: &CudaSlice<bf16>,
        w: &CudaSlice<bf16>,
        rows: usize,
        dim: usize,
        eps: f32,
        y: &mut CudaSlice<bf16>,
    ) -> Result<(), KernelError> {
        ensure(dim > 0 && w.len() >= dim, || {
            "weight shorter than dim".into()
        })?;
        ensure(x.len() >= rows * dim && y.len() >= rows * dim, || {
            "x or y too short".into()
        })?;
        if rows == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let d = dim as i32;
        let mut b = gpu.stream.launch_builder(&self.func);
        b.arg(x).arg(w).arg(y).arg(&d).arg(&eps);
        // SAFETY: lengths checked above.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

pub fn check_gpu(gpu: &GpuContext, seed: u64) -> Result<Vec<CheckResult>, KernelError> {
    let norm = RmsNorm::new(gpu)?;
    let mut out = Vec::new();
    for (i, (rows, dim)) in [(7usize, 1000usize), (33, 4096), (1, 3)]
        .into_iter()
        .enumerate()
    {
        let mut r = rng(seed + i as u64);
        let x = random_bf16(&mut r, rows * dim, 2.0);
        let w = random_bf16(&mut r, dim, 1.5);
        let reference = rmsnorm_cpu(&x, &w, dim, 1e-6);
        let s = &gpu.stream;
        let (dx, dw) = (s.clone_htod(&x)?, s.clone_htod(&w)?);
        let mut dy = s.clone_htod(&vec![bf16::NAN; rows * dim])?;
        norm.run(gpu, &dx, &dw, rows, dim, 1e-6, &mut dy)?;
        let got: Vec<f64> = s.clone_dtoh(&dy)?.iter().map(|v| v.to_f64()).collect();
        out.push(CheckResult::from_stats(
            "rmsnorm",
            format!("rows={rows} dim={dim}"),
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
    fn hand_computed_row() {
        // x = [3, 4]: mean square 12.5, so y = x / sqrt(12.5) * w.
        let x = [bf16::from_f32(3.0), bf16::from_f32(4.0)];
        let w = [bf16::from_f32(1.0), bf16::from_f32(2.0)];
        let y = rmsnorm_cpu(&x, &w, 2, 0.0);
        assert!((y[0] - 3.0 / 12.5f64.sqrt()).abs() < 1e-12);
        assert!((y[1] - 8.0 / 12.5f64.sqrt()).abs() < 1e-12);
    }

    #[test]
    fn gpu_matches_cpu() {
        let Some(gpu) = gpu_or_skip() else { return };
        crate::check::assert_all_passed(&check_gpu(&gpu, 31).unwrap());
    }
}
