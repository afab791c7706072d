//! Random fill of device buffers and a block gather (the zero-copy swap path).

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg, sys::CUdeviceptr};
use half::bf16;

use crate::error::{KernelError, ensure};
use crate::gpu::GpuContext;

pub(crate) const SRC: &str = include_str!("cuda/fill.cu");

/// Fills `x` with values uniform in [-scale, scale) derived from `seed`.
pub fn fill_uniform_bf16(
    gpu: &GpuContext,
    x: &mut CudaSlice<bf16>,
    seed: u64,
    scale: f32,
) -> Result<(), KernelError> {
    let f = gpu
        .functions("fill", SRC, &[], &["fill_uniform_bf16"])?
        .remove(0);
    let n = x.len() as i64;
    if n == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: (((n as u64).div_ceil(256)).min(65_536) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = gpu.stream.launch_builder(&f);
    b.arg(x).arg(&n).arg(&seed).arg(&scale);
    // SAFETY: the kernel writes indices < n = x.len().
    unsafe { b.launch(cfg) }?;
    Ok(())
}

/// Copies blocks `src_ids[i]` of `src` to blocks `dst_ids[i]` of `dst`, each `block_bytes`.
///
/// # Safety
/// `src` and `dst` must be device-accessible addresses (device memory, or mapped pinned host
/// memory) holding every block named by the ids; the ids are device arrays of `n` entries.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gather_blocks_raw(
    gpu: &GpuContext,
    src: CUdeviceptr,
    src_ids: &CudaSlice<i32>,
    dst: CUdeviceptr,
    dst_ids: &CudaSlice<i32>,
    n: usize,
    block_bytes: usize,
) -> Result<(), KernelError> {
    ensure(block_bytes.is_multiple_of(16), || {
        format!("block_bytes = {block_bytes} must be a multiple of 16")
    })?;
    ensure(src_ids.len() >= n && dst_ids.len() >= n, || {
        "id arrays too short".into()
    })?;
    if n == 0 {
        return Ok(());
    }
    // SAFETY: forwarded from the caller.
    unsafe { gather_blocks_on(gpu, &gpu.stream, src, src_ids, dst, dst_ids, n, block_bytes) }
}

/// [`gather_blocks_raw`] on another stream (a copy stream that overlaps compute).
///
/// # Safety
/// As for [`gather_blocks_raw`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn gather_blocks_on(
    gpu: &GpuContext,
    stream: &std::sync::Arc<cudarc::driver::CudaStream>,
    src: CUdeviceptr,
    src_ids: &CudaSlice<i32>,
    dst: CUdeviceptr,
    dst_ids: &CudaSlice<i32>,
    n: usize,
    block_bytes: usize,
) -> Result<(), KernelError> {
    ensure(block_bytes.is_multiple_of(16), || {
        format!("block_bytes = {block_bytes} must be a multiple of 16")
    })?;
    ensure(src_ids.len() >= n && dst_ids.len() >= n, || {
        "id arrays too short".into()
    })?;
    if n == 0 {
        return Ok(());
    }
    let f = gpu
        .functions("fill", SRC, &[], &["gather_blocks"])?
        .remove(0);
    let bb = block_bytes as i64;
    let cfg = LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = stream.launch_builder(&f);
    b.arg(&src).arg(src_ids).arg(&dst).arg(dst_ids).arg(&bb);
    // SAFETY: the caller guarantees the addresses and ids.
    unsafe { b.launch(cfg) }?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::gpu_or_skip;

    #[test]
    fn gpu_fill_is_random_in_range_and_gather_moves_blocks() {
        let Some(gpu) = gpu_or_skip() else { return };
        let mut x = gpu.stream.alloc_zeros::<bf16>(10_000).unwrap();
        fill_uniform_bf16(&gpu, &mut x, 3, 2.0).unwrap();
        let v = gpu.stream.clone_dtoh(&x).unwrap();
        assert!(v.iter().all(|x| x.to_f32().abs() <= 2.0));
        assert!(v.iter().filter(|x| x.to_f32() == 0.0).count() < 100);
        // gather: dst block 1 <- src block 3, dst block 0 <- src block 0 (block = 16 elems)
        let src: Vec<bf16> = (0..64).map(|i| bf16::from_f32(i as f32)).collect();
        let dsrc = gpu.stream.clone_htod(&src).unwrap();
        let mut ddst = gpu.stream.alloc_zeros::<bf16>(32).unwrap();
        let (sids, dids) = (
            gpu.stream.clone_htod(&[3i32, 0]).unwrap(),
            gpu.stream.clone_htod(&[1i32, 0]).unwrap(),
        );
        {
            use cudarc::driver::{DevicePtr, DevicePtrMut};
            let (sp, _g1) = dsrc.device_ptr(&gpu.stream);
            let (dp, _g2) = ddst.device_ptr_mut(&gpu.stream);
            // SAFETY: both buffers hold the named blocks.
            unsafe { gather_blocks_raw(&gpu, sp, &sids, dp, &dids, 2, 32).unwrap() };
        }
        let got = gpu.stream.clone_dtoh(&ddst).unwrap();
        assert_eq!(&got[..16], &src[..16]);
        assert_eq!(&got[16..], &src[48..]);
    }
}
