//! Element-wise helpers of the engine's forward pass (dtype conversion, gated activation,
//! residual add, row selection), with CPU references.

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};
use half::bf16;

use crate::check::{BF16_TOL, CheckResult};
use crate::error::{KernelError, ensure};
use crate::gpu::GpuContext;
use crate::testdata::{ErrorStats, random_bf16, rng};

pub(crate) const SRC: &str = include_str!("cuda/ops.cu");

/// silu(gate) · up for `gu` rows laid out `[gate (ffn) | up (ffn)]`, in f64.
pub fn silu_mul_cpu(gu: &[bf16], ffn: usize) -> Vec<f64> {
    gu.chunks(2 * ffn)
        .flat_map(|row| {
            (0..ffn).map(move |c| {
                let g = row[c].to_f64();
                g / (1.0 + (-g).exp()) * row[ffn + c].to_f64()
            })
        })
        .collect()
}

pub struct Ops {
    to_f32: CudaFunction,
    silu_mul: CudaFunction,
    add: CudaFunction,
    select: CudaFunction,
}

fn grid(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(256).clamp(1, 4096) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl Ops {
    pub fn new(gpu: &GpuContext) -> Result<Self, KernelError> {
        let mut f = gpu
            .functions(
                "ops",
                SRC,
                &[],
                &["bf16_to_f32", "silu_mul", "add_inplace", "select_rows"],
            )?
            .into_iter();
        let mut next = || f.next().expect("four functions");
        Ok(Self {
            to_f32: next(),
            silu_mul: next(),
            add: next(),
            select: next(),
        })
    }

    /// `y[..n] = x[..n]` as f32.
    pub fn to_f32(
        &self,
        gpu: &GpuContext,
        x: &CudaSlice<bf16>,
        y: &mut CudaSlice<f32>,
        n: usize,
    ) -> Result<(), KernelError> {
        ensure(x.len() >= n && y.len() >= n, || "x or y too short".into())?;
        if n == 0 {
            return Ok(());
        }
        let ni = n as i64;
        let mut b = gpu.stream.launch_builder(&self.to_f32);
        b.arg(x).arg(y).arg(&ni);
        // SAFETY: both buffers hold n elements.
        unsafe { b.launch(grid(n)) }?;
        Ok(())
    }

    /// `y[rows, ffn] = silu(gu[:, :ffn]) * gu[:, ffn:]`.
    pub fn silu_mul(
        &self,
        gpu: &GpuContext,
        gu: &CudaSlice<bf16>,
        y: &mut CudaSlice<bf16>,
        rows: usize,
        ffn: usize,
    ) -> Result<(), KernelError> {
        ensure(gu.len() >= rows * 2 * ffn && y.len() >= rows * ffn, || {
            "gu or y too short".into()
        })?;
        if rows * ffn == 0 {
            return Ok(());
        }
        let (r, f) = (rows as i64, ffn as i32);
        let mut b = gpu.stream.launch_builder(&self.silu_mul);
        b.arg(gu).arg(y).arg(&r).arg(&f);
        // SAFETY: lengths checked.
        unsafe { b.launch(grid(rows * ffn)) }?;
        Ok(())
    }

    /// `x[..n] += y[..n]`.
    pub fn add(
        &self,
        gpu: &GpuContext,
        x: &mut CudaSlice<bf16>,
        y: &CudaSlice<bf16>,
        n: usize,
    ) -> Result<(), KernelError> {
        ensure(x.len() >= n && y.len() >= n, || "x or y too short".into())?;
        if n == 0 {
            return Ok(());
        }
        let ni = n as i64;
        let mut b = gpu.stream.launch_builder(&self.add);
        b.arg(x).arg(y).arg(&ni);
        // SAFETY: lengths checked.
        unsafe { b.launch(grid(n)) }?;
        Ok(())
    }

    /// `dst[i] = src[rows[i]]` for rows of `dim`; `src_rows` bounds the ids (checked on the host
    /// copy `rows_host`).
    #[allow(clippy::too_many_arguments)]
    pub fn select_rows(
        &self,
        gpu: &GpuContext,
        src: &CudaSlice<bf16>,
        src_rows: usize,
        rows_host: &[i32],
        rows: &CudaSlice<i32>,
        dst: &mut CudaSlice<bf16>,
        dim: usize,
    ) -> Result<(), KernelError> {
        ensure(
            rows_host.iter().all(|&r| r >= 0 && (r as usize) < src_rows),
            || "row id out of range".into(),
        )?;
        ensure(
            src.len() >= src_rows * dim
                && dst.len() >= rows_host.len() * dim
                && rows.len() >= rows_host.len(),
            || "buffers too short".into(),
        )?;
        if rows_host.is_empty() {
            return Ok(());
        }
        let d = dim as i32;
        let mut b = gpu.stream.launch_builder(&self.select);
        b.arg(src).arg(rows).arg(dst).arg(&d);
        // SAFETY: ids checked against src_rows.
        unsafe {
            b.launch(LaunchConfig {
                grid_dim: (rows_host.len() as u32, 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            })
        }?;
        Ok(())
    }
}

pub fn check_gpu(gpu: &GpuContext, seed: u64) -> Result<Vec<CheckResult>, KernelError> {
    let ops = Ops::new(gpu)?;
    let s = &gpu.stream;
    let mut r = rng(seed);
    let mut out = Vec::new();
    // 300: the scalar path; 256: the 8-wide vector path.
    for (rows, ffn) in [(7usize, 300usize), (5, 256)] {
        let gu = random_bf16(&mut r, rows * 2 * ffn, 4.0);
        let mut y = s.clone_htod(&vec![bf16::NAN; rows * ffn])?;
        ops.silu_mul(gpu, &s.clone_htod(&gu)?, &mut y, rows, ffn)?;
        let got: Vec<f64> = s.clone_dtoh(&y)?.iter().map(|v| v.to_f64()).collect();
        out.push(CheckResult::from_stats(
            "silu_mul",
            format!("rows={rows} ffn={ffn}"),
            ErrorStats::of(&got, &silu_mul_cpu(&gu, ffn)),
            BF16_TOL,
        ));
    }
    let (a, b) = (
        random_bf16(&mut r, 1003, 2.0),
        random_bf16(&mut r, 1003, 2.0),
    );
    // 1000: the 8-wide vector path alone; 1003: three more elements past it
    for n in [1000usize, 1003] {
        let mut da = s.clone_htod(&a[..n])?;
        ops.add(gpu, &mut da, &s.clone_htod(&b[..n])?, n)?;
        let got: Vec<f64> = s.clone_dtoh(&da)?.iter().map(|v| v.to_f64()).collect();
        let want: Vec<f64> = a[..n]
            .iter()
            .zip(&b)
            .map(|(x, y)| x.to_f64() + y.to_f64())
            .collect();
        out.push(CheckResult::from_stats(
            "add_inplace",
            format!("n={n}"),
            ErrorStats::of(&got, &want),
            BF16_TOL,
        ));
    }
    let a = &a[..1000];
    let mut f = s.clone_htod(&vec![f32::NAN; 1000])?;
    ops.to_f32(gpu, &s.clone_htod(a)?, &mut f, 1000)?;
    let mismatches = s
        .clone_dtoh(&f)?
        .iter()
        .zip(a)
        .filter(|(x, y)| **x != y.to_f32())
        .count();
    out.push(CheckResult::exact(
        "bf16_to_f32",
        "n=1000".into(),
        mismatches,
    ));
    let ids = [4i32, 0, 4];
    // rows of 100: element by element; rows of 96: 16 bytes at a time
    for dim in [100usize, 96] {
        let mut dst = s.clone_htod(&vec![bf16::NAN; 3 * dim])?;
        let src = s.clone_htod(&a[..5 * dim])?;
        ops.select_rows(gpu, &src, 5, &ids, &s.clone_htod(&ids)?, &mut dst, dim)?;
        let got = s.clone_dtoh(&dst)?;
        let mismatches = ids
            .iter()
            .enumerate()
            .map(|(i, &row)| {
                (0..dim)
                    .filter(|&c| got[i * dim + c].to_bits() != a[row as usize * dim + c].to_bits())
                    .count()
            })
            .sum();
        out.push(CheckResult::exact(
            "select_rows",
            format!("rows {ids:?} of {dim}"),
            mismatches,
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::gpu_or_skip;

    #[test]
    fn silu_mul_hand_computed() {
        let b = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
        // gate 0 -> silu 0; gate 2 -> 2 / (1 + e^-2) times up 3
        let y = silu_mul_cpu(&b(&[0.0, 2.0, 5.0, 3.0]), 2);
        assert_eq!(y[0], 0.0);
        assert!((y[1] - 3.0 * 2.0 / (1.0 + (-2f64).exp())).abs() < 1e-12);
    }

    #[test]
    fn gpu_matches_cpu() {
        let Some(gpu) = gpu_or_skip() else { return };
        crate::check::assert_all_passed(&check_gpu(&gpu, 81).unwrap());
    }
}
