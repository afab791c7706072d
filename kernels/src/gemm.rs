//! GEMMs through cuBLAS, in the row-major `Linear` convention: y[m, n] = x[m, k] · W[n, k]ᵀ.

use cudarc::cublas::{Gemm, GemmConfig, sys::cublasOperation_t};
use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;

use crate::check::{BF16_TOL, CheckResult};
use crate::error::{KernelError, ensure};
use crate::gpu::GpuContext;
use crate::testdata::{ErrorStats, random_bf16, rng};

/// CPU reference in f64.
pub fn linear_cpu(x: &[bf16], w: &[bf16], m: usize, n: usize, k: usize) -> Vec<f64> {
    let mut y = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            y[i * n + j] = (0..k)
                .map(|l| x[i * k + l].to_f64() * w[j * k + l].to_f64())
                .sum();
        }
    }
    y
}

/// y = x · Wᵀ with bf16 operands and f32 accumulation (cublasGemmEx).
/// cuBLAS is column-major: row-major y[m, n] is column-major yᵀ[n, m] = W · xᵀ.
#[allow(clippy::too_many_arguments)]
pub fn linear_bf16<X: DevicePtr<bf16>, W: DevicePtr<bf16>, Y: DevicePtrMut<bf16>>(
    gpu: &GpuContext,
    x: &X,
    w: &W,
    y: &mut Y,
    m: usize,
    n: usize,
    k: usize,
) -> Result<(), KernelError> {
    linear_bf16_beta(gpu, x, w, y, m, n, k, false)
}

/// y = x · Wᵀ, or y += x · Wᵀ when `accumulate` (a residual connection fused into the GEMM).
#[allow(clippy::too_many_arguments)]
pub fn linear_bf16_beta<X: DevicePtr<bf16>, W: DevicePtr<bf16>, Y: DevicePtrMut<bf16>>(
    gpu: &GpuContext,
    x: &X,
    w: &W,
    y: &mut Y,
    m: usize,
    n: usize,
    k: usize,
    accumulate: bool,
) -> Result<(), KernelError> {
    ensure(
        x.len() >= m * k && w.len() >= n * k && y.len() >= m * n,
        || format!("buffers too short for {m}x{n}x{k}"),
    )?;
    ensure(m.max(n).max(k) <= i32::MAX as usize, || {
        "dimension exceeds i32".into()
    })?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    let cfg = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_T,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: n as i32,
        n: m as i32,
        k: k as i32,
        alpha: bf16::ONE,
        lda: k as i32,
        ldb: k as i32,
        beta: if accumulate { bf16::ONE } else { bf16::ZERO },
        ldc: n as i32,
    };
    // SAFETY: buffer lengths checked against the shape above.
    unsafe { gpu.blas.gemm(cfg, w, x, y) }?;
    Ok(())
}

pub fn check_gpu(gpu: &GpuContext, seed: u64) -> Result<Vec<CheckResult>, KernelError> {
    let mut out = Vec::new();
    for (i, (m, n, k)) in [(1usize, 256usize, 512usize), (37, 96, 200), (128, 128, 64)]
        .into_iter()
        .enumerate()
    {
        let mut r = rng(seed + i as u64);
        let x = random_bf16(&mut r, m * k, 1.0);
        let w = random_bf16(&mut r, n * k, 1.0);
        let mut reference = linear_cpu(&x, &w, m, n, k);
        let s = &gpu.stream;
        let (dx, dw) = (s.clone_htod(&x)?, s.clone_htod(&w)?);
        let mut dy = s.clone_htod(&vec![bf16::NAN; m * n])?;
        linear_bf16(gpu, &dx, &dw, &mut dy, m, n, k)?;
        // and accumulate a second product on top: y = 2 x Wᵀ (rounded once in between)
        let first = s.clone_dtoh(&dy)?;
        linear_bf16_beta(gpu, &dx, &dw, &mut dy, m, n, k, true)?;
        for (r, f) in reference.iter_mut().zip(&first) {
            *r += f.to_f64();
        }
        let got: Vec<f64> = s.clone_dtoh(&dy)?.iter().map(|v| v.to_f64()).collect();
        out.push(CheckResult::from_stats(
            "gemm_bf16",
            format!("m={m} n={n} k={k}"),
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
    fn linear_hand_computed() {
        let b = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
        // x = [[1, 2]], W = [[3, 4], [5, 6]] -> y = [[11, 17]]
        assert_eq!(
            linear_cpu(&b(&[1.0, 2.0]), &b(&[3.0, 4.0, 5.0, 6.0]), 1, 2, 2),
            vec![11.0, 17.0]
        );
    }

    #[test]
    fn gpu_matches_cpu() {
        let Some(gpu) = gpu_or_skip() else { return };
        crate::check::assert_all_passed(&check_gpu(&gpu, 71).unwrap());
    }
}
