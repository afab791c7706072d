//! Sampling: greedy argmax and seeded Gumbel-max sampling over rows of f32 logits.

use cudarc::driver::{CudaFunction, CudaSlice, LaunchConfig, PushKernelArg};

use crate::check::CheckResult;
use crate::error::{KernelError, ensure};
use crate::gpu::GpuContext;
use crate::testdata::{random_f32, rng};

pub(crate) const SRC: &str = include_str!("cuda/sampling.cu");

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The kernel's uniform draw in (0, 1) for (seed, row, column), bit-exact.
pub fn uniform01(seed: u64, row: u32, col: u32) -> f32 {
    let h = splitmix64(seed ^ splitmix64(((row as u64) << 32) | col as u64));
    ((h >> 40) as f32 + 0.5) * (1.0 / 16_777_216.0)
}

/// Index of the largest value, lowest index on ties; rows of only NaN give 0.
pub fn argmax_cpu(row: &[f32]) -> i32 {
    let mut best = f32::NEG_INFINITY;
    let mut bi = row.len();
    for (i, &x) in row.iter().enumerate() {
        if x > best || (x == best && i < bi) {
            best = x;
            bi = i;
        }
    }
    if bi < row.len() { bi as i32 } else { 0 }
}

/// Gumbel-max draw: argmax of logit / temperature − ln(−ln u).
pub fn gumbel_sample_cpu(row: &[f32], row_index: u32, temperature: f32, seed: u64) -> i32 {
    let keys: Vec<f32> = row
        .iter()
        .enumerate()
        .map(|(c, &x)| x * (1.0 / temperature) - (-uniform01(seed, row_index, c as u32).ln()).ln())
        .collect();
    argmax_cpu(&keys)
}

pub struct Sampler {
    argmax: CudaFunction,
    gumbel: CudaFunction,
}

impl Sampler {
    pub fn new(gpu: &GpuContext) -> Result<Self, KernelError> {
        let mut f = gpu
            .functions("sampling", SRC, &[], &["argmax_rows", "gumbel_sample_rows"])?
            .into_iter();
        Ok(Self {
            argmax: f.next().expect("argmax"),
            gumbel: f.next().expect("gumbel"),
        })
    }

    fn cfg(rows: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// ids[r] = argmax of row r of `logits` `[rows, vocab]`.
    pub fn greedy(
        &self,
        gpu: &GpuContext,
        logits: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        ids: &mut CudaSlice<i32>,
    ) -> Result<(), KernelError> {
        ensure(
            vocab > 0 && logits.len() >= rows * vocab && ids.len() >= rows,
            || "logits or ids too short".into(),
        )?;
        if rows == 0 {
            return Ok(());
        }
        let v = vocab as i32;
        let mut b = gpu.stream.launch_builder(&self.argmax);
        b.arg(logits).arg(&v).arg(ids);
        // SAFETY: lengths checked.
        unsafe { b.launch(Self::cfg(rows)) }?;
        Ok(())
    }

    /// Seeded sampling at `temperature` (> 0).
    #[allow(clippy::too_many_arguments)]
    pub fn sample(
        &self,
        gpu: &GpuContext,
        logits: &CudaSlice<f32>,
        rows: usize,
        vocab: usize,
        temperature: f32,
        seed: u64,
        ids: &mut CudaSlice<i32>,
    ) -> Result<(), KernelError> {
        ensure(temperature > 0.0 && temperature.is_finite(), || {
            format!("temperature = {temperature} must be positive")
        })?;
        ensure(
            vocab > 0 && logits.len() >= rows * vocab && ids.len() >= rows,
            || "logits or ids too short".into(),
        )?;
        if rows == 0 {
            return Ok(());
        }
        let v = vocab as i32;
        let mut b = gpu.stream.launch_builder(&self.gumbel);
        b.arg(logits).arg(&v).arg(&temperature).arg(&seed).arg(ids);
        // SAFETY: lengths checked.
        unsafe { b.launch(Self::cfg(rows)) }?;
        Ok(())
    }
}

pub fn check_gpu(gpu: &GpuContext, seed: u64) -> Result<Vec<CheckResult>, KernelError> {
    let (rows, vocab) = (16usize, 5000usize);
    let sampler = Sampler::new(gpu)?;
    let mut r = rng(seed);
    let mut logits = random_f32(&mut r, rows * vocab, 8.0);
    // planted ties and a NaN row: lowest index must win, NaN-only rows give 0
    logits[3 * vocab + 100] = 50.0;
    logits[3 * vocab + 4000] = 50.0;
    for x in &mut logits[5 * vocab..6 * vocab] {
        *x = f32::NAN;
    }
    let s = &gpu.stream;
    let dl = s.clone_htod(&logits)?;
    let mut ids = s.alloc_zeros::<i32>(rows)?;
    sampler.greedy(gpu, &dl, rows, vocab, &mut ids)?;
    let got = s.clone_dtoh(&ids)?;
    let want: Vec<i32> = logits.chunks(vocab).map(argmax_cpu).collect();
    let detail = format!("rows={rows} vocab={vocab}, planted tie and NaN row");
    let mut out = vec![CheckResult::exact(
        "argmax",
        detail,
        got.iter().zip(&want).filter(|(a, b)| a != b).count(),
    )];
    let (t, sd) = (0.8f32, seed ^ 0xabcdef);
    sampler.sample(gpu, &dl, rows, vocab, t, sd, &mut ids)?;
    let got = s.clone_dtoh(&ids)?;
    let want: Vec<i32> = logits
        .chunks(vocab)
        .enumerate()
        .map(|(i, row)| gumbel_sample_cpu(row, i as u32, t, sd))
        .collect();
    out.push(CheckResult::exact(
        "gumbel_sample",
        format!("rows={rows} vocab={vocab} T={t}"),
        got.iter().zip(&want).filter(|(a, b)| a != b).count(),
    ));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::gpu_or_skip;

    #[test]
    fn argmax_ties_and_nan() {
        assert_eq!(argmax_cpu(&[1.0, 3.0, 3.0]), 1);
        assert_eq!(argmax_cpu(&[f32::NAN, f32::NAN]), 0);
        assert_eq!(argmax_cpu(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
    }

    #[test]
    fn uniform_is_open_interval_and_gumbel_follows_softmax() {
        for c in 0..1000 {
            let u = uniform01(7, 3, c);
            assert!(u > 0.0 && u < 1.0);
        }
        // With logits ln(1), ln(3) the second index should win ~75% of the time.
        let row = [0.0f32, 3f32.ln()];
        let wins = (0..4000u32)
            .filter(|&i| gumbel_sample_cpu(&row, i, 1.0, 99) == 1)
            .count();
        assert!((2800..3200).contains(&wins), "wins = {wins}");
    }

    #[test]
    fn gpu_matches_cpu() {
        let Some(gpu) = gpu_or_skip() else { return };
        crate::check::assert_all_passed(&check_gpu(&gpu, 61).unwrap());
    }
}
