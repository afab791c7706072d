//! A read-only streaming kernel: the device-memory read ceiling that decode attention (which
//! reads its KV and writes almost nothing) is fairly compared with, beside the copy ceiling.

use cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};

use crate::check::CheckResult;
use crate::error::{KernelError, ensure};
use crate::gpu::GpuContext;
use crate::testdata::rng;

pub(crate) const SRC: &str = include_str!("cuda/bandwidth.cu");

/// Reads every byte of `x` (a multiple of 16 bytes long) with `blocks` x `threads` threads and
/// writes each block's XOR of the buffer's 32-bit words it read to `sink[block]`.
pub fn read_stream(
    gpu: &GpuContext,
    x: &CudaView<'_, u8>,
    blocks: usize,
    threads: usize,
    sink: &mut CudaSlice<u32>,
) -> Result<(), KernelError> {
    ensure(x.len().is_multiple_of(16), || {
        format!("{} bytes is not a multiple of 16", x.len())
    })?;
    ensure(blocks > 0 && sink.len() >= blocks, || {
        "sink must hold one word per block".into()
    })?;
    ensure(
        threads.is_multiple_of(32) && (32..=1024).contains(&threads),
        || format!("threads = {threads} must be a multiple of 32 in 32..=1024"),
    )?;
    let f = gpu
        .functions("bandwidth", SRC, &[], &["read_stream"])?
        .remove(0);
    let n16 = (x.len() / 16) as i64;
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(x).arg(&n16).arg(sink);
    // SAFETY: the kernel reads 16-byte words < n16 of x and writes sink[0..blocks].
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// XOR of the little-endian 32-bit words of `bytes` (the CPU reference of the sink's XOR).
pub fn xor_words(bytes: &[u8]) -> u32 {
    bytes
        .chunks_exact(4)
        .fold(0, |a, w| a ^ u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
}

pub fn check_gpu(gpu: &GpuContext, seed: u64) -> Result<Vec<CheckResult>, KernelError> {
    use rand::Rng;
    let mut r = rng(seed);
    let mut out = Vec::new();
    // sizes that leave a remainder after the four-load loop, and a grid larger than the buffer
    for (words16, blocks, threads) in [(100_003usize, 40usize, 256usize), (7, 8, 64)] {
        let host: Vec<u8> = (0..words16 * 16).map(|_| r.random()).collect();
        let x = gpu.stream.clone_htod(&host)?;
        let mut sink = gpu.stream.alloc_zeros::<u32>(blocks)?;
        read_stream(gpu, &x.as_view(), blocks, threads, &mut sink)?;
        let got = gpu.stream.clone_dtoh(&sink)?.iter().fold(0, |a, b| a ^ b);
        out.push(CheckResult::exact(
            "read_stream",
            format!(
                "{} B, {blocks} x {threads} threads: XOR of every word",
                host.len()
            ),
            usize::from(got != xor_words(&host)),
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::gpu_or_skip;

    #[test]
    fn xor_of_words_hand_computed() {
        assert_eq!(xor_words(&[1, 0, 0, 0, 3, 0, 0, 0]), 2);
        assert_eq!(xor_words(&[0xff, 0, 0, 1]), 0x0100_00ff);
    }

    #[test]
    fn gpu_matches_cpu() {
        let Some(gpu) = gpu_or_skip() else { return };
        crate::check::assert_all_passed(&check_gpu(&gpu, 5).unwrap());
    }
}
