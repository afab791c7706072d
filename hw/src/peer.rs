//! Device-to-device copies between the GPUs of a placement, timed with CUDA events: the
//! transport of the prefill-to-decode handoff when the two devices sit on different GPUs.
//!
//! A [`PeerLink`] joins a source and a destination context. Inside one context the copy is a
//! plain device copy (`cuMemcpyDtoDAsync`); between contexts it is a peer copy
//! (`cuMemcpyPeerAsync`), which the driver routes over NVLink or PCIe between two devices, or
//! inside the device when both contexts are on one (the case a one-GPU machine can test). Peer
//! access is enabled in both directions where the devices allow it, so copies go GPU to GPU
//! without a host bounce. Nothing here touches NVLink multicast.
//!
//! A handoff's blocks are scattered over both pools; [`coalesce`] turns (source block,
//! destination block) pairs into runs of consecutive blocks on both sides, one copy per run,
//! since each copy costs a few microseconds to issue.

use std::sync::Arc;

use cudarc::driver::sys::{self, CUevent_flags};
use cudarc::driver::{CudaContext, CudaStream, DriverError};

/// One contiguous copy: `bytes` from `src` (an address in the source context) to `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CopyRange {
    pub src: sys::CUdeviceptr,
    pub dst: sys::CUdeviceptr,
    pub bytes: usize,
}

/// How a link copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum LinkKind {
    /// Both sides in one context: a device copy.
    SameContext,
    /// Two contexts of one device: a peer copy that stays inside the device.
    SameDevice,
    /// Two devices with peer access enabled: GPU to GPU over NVLink or PCIe.
    Peer,
    /// Two devices without peer access: the driver stages the copy through the host.
    Staged,
}

/// What one batch of copies moved and how long it took on the device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct CopyTiming {
    pub bytes: u64,
    pub copies: u32,
    /// CUDA-event time from before the first copy to after the last.
    pub duration_ns: u64,
}

impl CopyTiming {
    /// Bytes moved per second (0 when nothing was timed).
    pub fn bytes_per_s(&self) -> f64 {
        if self.duration_ns == 0 {
            return 0.0;
        }
        self.bytes as f64 / (self.duration_ns as f64 * 1e-9)
    }
}

/// A copy path from one context to another, with its own stream on the source context.
pub struct PeerLink {
    src: Arc<CudaContext>,
    dst: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kind: LinkKind,
}

impl PeerLink {
    /// The link from `src` to `dst`: enables peer access both ways between two devices that
    /// allow it (an already enabled access is fine).
    pub fn new(src: &Arc<CudaContext>, dst: &Arc<CudaContext>) -> Result<Self, DriverError> {
        let kind = if src.cu_ctx() == dst.cu_ctx() {
            LinkKind::SameContext
        } else if src.cu_device() == dst.cu_device() {
            LinkKind::SameDevice
        } else if can_access(src, dst)? && can_access(dst, src)? {
            enable_access(src, dst)?;
            enable_access(dst, src)?;
            LinkKind::Peer
        } else {
            LinkKind::Staged
        };
        Ok(PeerLink {
            src: src.clone(),
            dst: dst.clone(),
            stream: src.new_stream()?,
            kind,
        })
    }

    pub fn kind(&self) -> LinkKind {
        self.kind
    }

    /// The stream the copies run on (in the source context): join it before reading the
    /// destination, and make it wait for the writes of the source first.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Issues every range on the link's stream between two timing events and waits for them.
    ///
    /// # Safety
    /// Every `src` must be a device address of at least `bytes` in the source context and
    /// every `dst` one in the destination context, neither freed nor written by other work
    /// until this returns, and no destination range may overlap another range.
    pub unsafe fn copy(&self, ranges: &[CopyRange]) -> Result<CopyTiming, DriverError> {
        self.src.bind_to_thread()?;
        let start = self.src.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        let end = self.src.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        start.record(&self.stream)?;
        let s = self.stream.cu_stream();
        let mut bytes = 0u64;
        for r in ranges {
            // SAFETY: the caller guarantees both ranges; the stream belongs to the bound
            // source context.
            unsafe {
                match self.kind {
                    LinkKind::SameContext => sys::cuMemcpyDtoDAsync_v2(r.dst, r.src, r.bytes, s),
                    _ => sys::cuMemcpyPeerAsync(
                        r.dst,
                        self.dst.cu_ctx(),
                        r.src,
                        self.src.cu_ctx(),
                        r.bytes,
                        s,
                    ),
                }
            }
            .result()?;
            bytes += r.bytes as u64;
        }
        end.record(&self.stream)?;
        let ms = start.elapsed_ms(&end)? as f64;
        Ok(CopyTiming {
            bytes,
            copies: ranges.len() as u32,
            duration_ns: (ms * 1e6).round().max(0.0) as u64,
        })
    }
}

fn can_access(a: &CudaContext, b: &CudaContext) -> Result<bool, DriverError> {
    let mut ok = 0;
    // SAFETY: both are valid device handles of live contexts.
    unsafe { sys::cuDeviceCanAccessPeer(&mut ok, a.cu_device(), b.cu_device()) }.result()?;
    Ok(ok != 0)
}

/// Lets `from` access `to`'s memory (idempotent).
fn enable_access(from: &CudaContext, to: &CudaContext) -> Result<(), DriverError> {
    from.bind_to_thread()?;
    // SAFETY: `to` is a live context of another device; flags must be 0.
    match unsafe { sys::cuCtxEnablePeerAccess(to.cu_ctx(), 0) } {
        sys::cudaError_enum::CUDA_SUCCESS
        | sys::cudaError_enum::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
        e => e.result(),
    }
}

/// Runs of consecutive blocks: `pairs` of (source block, destination block), in order, become
/// (first source, first destination, length) runs where both sides advance by one block.
pub fn coalesce(pairs: &[(u32, u32)]) -> Vec<(u32, u32, u32)> {
    let mut runs: Vec<(u32, u32, u32)> = Vec::new();
    for &(a, b) in pairs {
        match runs.last_mut() {
            Some((s, d, n)) if *s + *n == a && *d + *n == b => *n += 1,
            _ => runs.push((a, b, 1)),
        }
    }
    runs
}

/// The copies of `runs` of blocks of `block_bytes` between two pools at `src` and `dst`.
pub fn block_ranges(
    runs: &[(u32, u32, u32)],
    src: sys::CUdeviceptr,
    dst: sys::CUdeviceptr,
    block_bytes: usize,
) -> Vec<CopyRange> {
    runs.iter()
        .map(|&(a, b, n)| CopyRange {
            src: src + (a as usize * block_bytes) as u64,
            dst: dst + (b as usize * block_bytes) as u64,
            bytes: n as usize * block_bytes,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::DevicePtr;

    #[test]
    fn coalesce_joins_runs_on_both_sides() {
        assert_eq!(coalesce(&[]), vec![]);
        let runs = coalesce(&[(4, 10), (5, 11), (6, 12), (9, 13), (10, 20), (11, 21)]);
        assert_eq!(runs, vec![(4, 10, 3), (9, 13, 1), (10, 20, 2)]);
        // A run on one side only is not a run.
        assert_eq!(coalesce(&[(1, 1), (2, 5)]), vec![(1, 1, 1), (2, 5, 1)]);
        let r = block_ranges(&runs, 1000, 5000, 8);
        assert_eq!(
            r[0],
            CopyRange {
                src: 1032,
                dst: 5080,
                bytes: 24
            }
        );
        assert_eq!(r.iter().map(|c| c.bytes).sum::<usize>(), 6 * 8);
    }

    fn gpus() -> Option<usize> {
        // SAFETY: only asks whether the library loads.
        if !unsafe { sys::is_culib_present() } {
            return None;
        }
        CudaContext::device_count().ok().map(|n| n as usize)
    }

    /// Copies `blocks` scattered blocks of `bb` bytes from a pool in `a` to a pool in `b`
    /// through a link, checks every destination byte and returns the timing.
    fn scattered_copy(
        a: &Arc<CudaContext>,
        b: &Arc<CudaContext>,
        blocks: u32,
        bb: usize,
    ) -> (LinkKind, CopyTiming) {
        let sa = a.default_stream();
        let sb = b.default_stream();
        let host: Vec<u8> = (0..blocks as usize * bb)
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        let src = sa.clone_htod(&host).unwrap();
        let mut dst = sb.alloc_zeros::<u8>(2 * blocks as usize * bb).unwrap();
        sb.synchronize().unwrap();
        // Source block i goes to destination block 2i when i is even (no runs), 2i+1 otherwise.
        let pairs: Vec<(u32, u32)> = (0..blocks).map(|i| (i, 2 * i + i % 2)).collect();
        let link = PeerLink::new(a, b).unwrap();
        let t = {
            let (ps, _g) = src.device_ptr(&sa);
            let (pd, _h) = dst.device_ptr(&sb);
            let ranges = block_ranges(&coalesce(&pairs), ps, pd, bb);
            // SAFETY: both pools are live, sized for every range, idle (synchronized above).
            unsafe { link.copy(&ranges) }.unwrap()
        };
        let got = sb.clone_dtoh(&dst).unwrap();
        let _ = &mut dst;
        for (i, d) in pairs {
            let want = &host[i as usize * bb..][..bb];
            assert_eq!(&got[d as usize * bb..][..bb], want, "block {i}");
        }
        assert_eq!(t.bytes, u64::from(blocks) * bb as u64);
        (link.kind(), t)
    }

    /// Inside one context, and between two contexts of one device: every block arrives.
    #[test]
    fn gpu_peer_copy_on_one_device() {
        let Some(n) = gpus().filter(|&n| n > 0) else {
            println!("skipped: no GPU");
            return;
        };
        let a = CudaContext::new(0).unwrap();
        let (kind, t) = scattered_copy(&a, &a, 64, 64 << 10);
        assert_eq!(kind, LinkKind::SameContext);
        println!(
            "same context: {} B in {} copies, {:.1} us, {:.1} GB/s",
            t.bytes,
            t.copies,
            t.duration_ns as f64 / 1e3,
            t.bytes_per_s() / 1e9
        );
        let b = CudaContext::new_non_primary(0, 0).unwrap();
        let (kind, t) = scattered_copy(&a, &b, 64, 64 << 10);
        assert_eq!(kind, LinkKind::SameDevice);
        println!(
            "two contexts of GPU 0 ({n} GPU(s)): {} B, {:.1} us, {:.1} GB/s",
            t.bytes,
            t.duration_ns as f64 / 1e3,
            t.bytes_per_s() / 1e9
        );
    }

    /// Between GPU 0 and every other GPU, both ways: every block arrives, over peer access
    /// where the devices allow it.
    #[test]
    fn gpu_peer_copy_between_gpus() {
        let n = gpus().unwrap_or(0);
        if n < 2 {
            println!("skipped: {n} GPU(s), the peer copy between GPUs needs 2");
            return;
        }
        let c0 = CudaContext::new(0).unwrap();
        for o in 1..n {
            let c = CudaContext::new(o).unwrap();
            for (a, b, name) in [
                (&c0, &c, format!("0 -> {o}")),
                (&c, &c0, format!("{o} -> 0")),
            ] {
                let (kind, t) = scattered_copy(a, b, 256, 256 << 10);
                println!(
                    "GPU {name} ({kind:?}): {} B in {} copies, {:.1} us, {:.1} GB/s",
                    t.bytes,
                    t.copies,
                    t.duration_ns as f64 / 1e3,
                    t.bytes_per_s() / 1e9
                );
            }
        }
    }

    /// The ceiling a handoff is compared with: one large copy per link kind this machine has
    /// (inside a context, between two contexts of GPU 0, GPU 0 to GPU 1 when there is one).
    #[test]
    fn gpu_peer_copy_ceiling() {
        let n = gpus().unwrap_or(0);
        if n == 0 {
            println!("skipped: no GPU");
            return;
        }
        let bytes = 256usize << 20;
        let a = CudaContext::new(0).unwrap();
        let mut pairs = vec![(a.clone(), a.clone())];
        pairs.push((a.clone(), CudaContext::new_non_primary(0, 0).unwrap()));
        if n >= 2 {
            pairs.push((a.clone(), CudaContext::new(1).unwrap()));
        } else {
            println!("GPU 0 -> GPU 1 skipped: {n} GPU(s)");
        }
        for (x, y) in pairs {
            let (sx, sy) = (x.default_stream(), y.default_stream());
            let src = sx.alloc_zeros::<u8>(bytes).unwrap();
            let dst = sy.alloc_zeros::<u8>(bytes).unwrap();
            sx.synchronize().unwrap();
            sy.synchronize().unwrap();
            let link = PeerLink::new(&x, &y).unwrap();
            let (ps, _g) = src.device_ptr(&sx);
            let (pd, _h) = dst.device_ptr(&sy);
            let one = [CopyRange {
                src: ps,
                dst: pd,
                bytes,
            }];
            // SAFETY: both buffers are live, idle and `bytes` long. The first copy warms up.
            unsafe { link.copy(&one) }.unwrap();
            let best = (0..5)
                // SAFETY: as above.
                .map(|_| unsafe { link.copy(&one) }.unwrap().duration_ns)
                .min()
                .unwrap();
            let t = CopyTiming {
                bytes: bytes as u64,
                copies: 1,
                duration_ns: best,
            };
            assert!(t.duration_ns > 0);
            println!(
                "ceiling {:?}: 256 MiB in {:.1} us = {:.1} GB/s of bytes moved",
                link.kind(),
                best as f64 / 1e3,
                t.bytes_per_s() / 1e9
            );
        }
    }
}
