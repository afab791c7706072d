//! The EP all-to-all through NCCL: one communicator rank per GPU of the decode group, in one
//! process (`ncclCommInitAll`), rows exchanged with grouped send/receive calls (NCCL has no
//! all-to-all-v collective; a group of point-to-point calls is how one is written).
//!
//! NVLink multicast (NVLS) stays off: [`NcclAllToAll::new`] sets `NCCL_NVLS_ENABLE=0` before
//! the first communicator is made (the device notes say why), and never touches multicast
//! objects itself.

use std::sync::{Arc, Once};

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use cudarc::nccl::Comm;
use cudarc::nccl::result::{group_end, group_start};

use super::{AllToAll, check_counts};

/// Whether libnccl can be loaded (the device machine's has to be on the library path).
pub fn nccl_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

/// Turns NVLink multicast off for every communicator of this process.
fn nvls_off() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // SAFETY: runs once, before this process creates any NCCL communicator (NCCL reads its
        // environment at initialisation); the callers are the constructors below, which the
        // test runner calls with one test thread on the device machine.
        unsafe { std::env::set_var("NCCL_NVLS_ENABLE", "0") };
    });
}

/// What one exchange moved and how long it took.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ExchangeTiming {
    /// Bytes that left their rank (rows to itself excluded).
    pub remote_bytes: u64,
    /// Every row's bytes, rows to itself included.
    pub bytes: u64,
    /// The slowest rank's CUDA-event time of the grouped calls.
    pub duration_ns: u64,
}

/// One NCCL rank per context.
pub struct NcclAllToAll {
    comms: Vec<Comm>,
    /// The last exchange's timing.
    pub last: ExchangeTiming,
}

impl NcclAllToAll {
    /// A communicator over `ctxs` (rank i on `ctxs[i]`'s device; the devices must differ: NCCL
    /// does not put two ranks of one communicator on one GPU).
    pub fn new(ctxs: &[Arc<CudaContext>]) -> Result<Self, String> {
        if !nccl_present() {
            return Err("libnccl is not on the library path".into());
        }
        nvls_off();
        let streams = ctxs
            .iter()
            .map(|c| c.new_stream())
            .collect::<Result<Vec<Arc<CudaStream>>, _>>()
            .map_err(|e| e.to_string())?;
        let comms = Comm::from_devices(streams).map_err(|e| format!("NCCL init: {e:?}"))?;
        Ok(NcclAllToAll {
            comms,
            last: ExchangeTiming::default(),
        })
    }

    pub fn ranks(&self) -> usize {
        self.comms.len()
    }

    /// Rank r's stream (its buffers are used there).
    pub fn stream(&self, r: usize) -> Arc<CudaStream> {
        self.comms[r].stream()
    }

    /// Exchanges device rows: `send[r]` on rank r holds its rows for rank 0, 1, … by
    /// `counts[r]`; `recv[r]` receives them by source rank. Waits for the exchange.
    pub fn exchange(
        &mut self,
        send: &[CudaSlice<f32>],
        recv: &mut [CudaSlice<f32>],
        counts: &[Vec<usize>],
        width: usize,
    ) -> Result<ExchangeTiming, String> {
        let n = self.comms.len();
        let err = |e: cudarc::driver::DriverError| e.to_string();
        let nerr = |e: cudarc::nccl::result::NcclError| format!("NCCL: {e:?}");
        let mut events = Vec::with_capacity(n);
        for c in &self.comms {
            let ctx = c.context();
            let a = ctx
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(err)?;
            let b = ctx
                .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(err)?;
            a.record(&c.stream()).map_err(err)?;
            events.push((a, b));
        }
        group_start().map_err(nerr)?;
        let issued = self.issue(send, recv, counts, width);
        group_end().map_err(nerr)?;
        issued?;
        let mut t = ExchangeTiming::default();
        for (r, (c, (a, b))) in self.comms.iter().zip(&events).enumerate() {
            b.record(&c.stream()).map_err(err)?;
            let ms = a.elapsed_ms(b).map_err(err)? as f64;
            t.duration_ns = t.duration_ns.max((ms * 1e6).round() as u64);
            for (p, &rows) in counts[r].iter().enumerate() {
                let bytes = (rows * width * 4) as u64;
                t.bytes += bytes;
                if p != r {
                    t.remote_bytes += bytes;
                }
            }
        }
        self.last = t;
        Ok(t)
    }

    /// The grouped calls of one exchange (between `group_start` and `group_end`).
    fn issue(
        &self,
        send: &[CudaSlice<f32>],
        recv: &mut [CudaSlice<f32>],
        counts: &[Vec<usize>],
        width: usize,
    ) -> Result<(), String> {
        let nerr = |e: cudarc::nccl::result::NcclError| format!("NCCL: {e:?}");
        for (r, comm) in self.comms.iter().enumerate() {
            let (mut s_at, mut r_at) = (0, 0);
            for (p, from_p) in counts.iter().enumerate() {
                let out = counts[r][p] * width;
                if out > 0 {
                    comm.send(&send[r].slice(s_at..s_at + out), p as i32)
                        .map_err(nerr)?;
                }
                s_at += out;
                let inc = from_p[r] * width;
                if inc > 0 {
                    comm.recv(&mut recv[r].slice_mut(r_at..r_at + inc), p as i32)
                        .map_err(nerr)?;
                }
                r_at += inc;
            }
        }
        Ok(())
    }
}

impl AllToAll for NcclAllToAll {
    /// Uploads every rank's rows to its GPU, exchanges them there and brings them back.
    fn all_to_all(
        &mut self,
        send: &[Vec<f32>],
        counts: &[Vec<usize>],
        width: usize,
    ) -> Result<Vec<Vec<f32>>, String> {
        check_counts(send, counts, width)?;
        if send.len() != self.ranks() {
            return Err(format!(
                "{} ranks' rows for {} ranks",
                send.len(),
                self.ranks()
            ));
        }
        let err = |e: cudarc::driver::DriverError| e.to_string();
        let n = self.ranks();
        let mut dev_send = Vec::with_capacity(n);
        let mut dev_recv = Vec::with_capacity(n);
        for (r, buf) in send.iter().enumerate() {
            let s = self.stream(r);
            let rows: usize = (0..n).map(|p| counts[p][r]).sum();
            // One value at least: an empty allocation has no address to hand NCCL.
            dev_send.push(s.clone_htod(&pad(buf)).map_err(err)?);
            dev_recv.push(s.alloc_zeros::<f32>((rows * width).max(1)).map_err(err)?);
        }
        self.exchange(&dev_send, &mut dev_recv, counts, width)?;
        (0..n)
            .map(|r| {
                let rows: usize = (0..n).map(|p| counts[p][r]).sum();
                let mut v = self.stream(r).clone_dtoh(&dev_recv[r]).map_err(err)?;
                v.truncate(rows * width);
                Ok(v)
            })
            .collect()
    }
}

fn pad(buf: &[f32]) -> Vec<f32> {
    if buf.is_empty() {
        vec![0.0]
    } else {
        buf.to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{expert, layer};
    use super::super::*;
    use super::*;

    /// GPUs of this machine (0 without the driver library).
    fn gpu_count() -> usize {
        // SAFETY: only asks whether the library loads.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return 0;
        }
        CudaContext::device_count().unwrap_or(0).max(0) as usize
    }

    /// The first `want` GPUs as NCCL ranks (None, printing why: fewer GPUs or no libnccl).
    fn ctxs(want: usize) -> Option<Vec<Arc<CudaContext>>> {
        let n = gpu_count();
        if n == 0 {
            println!("skipped: no GPU");
            return None;
        }
        if n < want {
            println!("skipped: {n} GPU(s), this test needs {want}");
            return None;
        }
        if !nccl_present() {
            println!("skipped: libnccl is not on the library path");
            return None;
        }
        Some((0..want).map(|o| CudaContext::new(o).unwrap()).collect())
    }

    /// The EP layer through a one-rank NCCL communicator equals the direct computation and the
    /// in-memory exchange (every row goes to the one rank and back).
    #[test]
    fn gpu_nccl_one_rank_ep_layer_matches_the_reference() {
        let Some(c) = ctxs(1) else { return };
        let mut nccl = NcclAllToAll::new(&c).unwrap();
        let (routes, xs) = layer(1, 64, 16, 32, 4, 3);
        let l = EpLayout::contiguous(32, 1).unwrap();
        let got = ep_moe(&l, &routes, &xs, 16, &expert, &mut nccl).unwrap();
        assert_eq!(got, reference_moe(&routes, &xs, 16, &expert));
        assert_eq!(nccl.last.remote_bytes, 0);
        assert_eq!(nccl.last.bytes, 64 * 4 * 16 * 4);
        println!(
            "one rank: {} B to itself in {:.1} us",
            nccl.last.bytes,
            nccl.last.duration_ns as f64 / 1e3
        );
    }

    /// Every GPU of the machine a rank: the EP layer with EPLB replicas equals the direct
    /// computation and the in-memory exchange; prints the exchange time of a decode-sized step.
    #[test]
    fn gpu_nccl_ep_layer_over_every_gpu() {
        let n = gpu_count();
        let Some(c) = ctxs(n.max(2)) else { return };
        let mut nccl = NcclAllToAll::new(&c).unwrap();
        let (routes, xs) = layer(n, 128, 64, 64, 6, 11);
        let counts = vec![vec![1.0f32; 64]];
        let p = rebalance_experts(&counts, 64 + 2 * n, 1, 1, n).unwrap();
        let l = EpLayout::from_placement(&p, 0, n).unwrap();
        let want = reference_moe(&routes, &xs, 64, &expert);
        let got = ep_moe(&l, &routes, &xs, 64, &expert, &mut nccl).unwrap();
        assert_eq!(got, want);
        let local = ep_moe(&l, &routes, &xs, 64, &expert, &mut LocalAllToAll).unwrap();
        assert_eq!(local, want);
        let t = nccl.last;
        println!(
            "{n} ranks: {} B ({} B remote) in {:.1} us = {:.1} GB/s remote",
            t.bytes,
            t.remote_bytes,
            t.duration_ns as f64 / 1e3,
            t.remote_bytes as f64 / t.duration_ns.max(1) as f64
        );
    }
    /// The exchange of uniform all-to-alls on every GPU of the machine (one GPU: NCCL's copy of
    /// a rank to itself), from a decode step's dispatch of the conformance model (32 sequences
    /// x 6 query tokens x top-2 rows of 1,024 f32) up to 64 MiB per rank, reported as
    /// nccl-tests reports alltoall (algorithm bandwidth = bytes per rank / time; bus bandwidth =
    /// algorithm bandwidth x (n - 1) / n), so the two tables compare.
    #[test]
    fn gpu_nccl_all_to_all_bandwidth() {
        let n = gpu_count();
        let Some(c) = ctxs(n.max(1)) else { return };
        let mut nccl = NcclAllToAll::new(&c).unwrap();
        let decode_rows = 32 * 6 * 2;
        for (name, rows_per_rank, width) in [
            ("decode dispatch", decode_rows, 1024),
            ("1 MiB", 256, 1024),
            ("16 MiB", 4096, 1024),
            ("64 MiB", 16384, 1024),
        ] {
            let per_peer = rows_per_rank / n;
            let counts = vec![vec![per_peer; n]; n];
            let len = per_peer * n * width;
            let send: Vec<CudaSlice<f32>> = (0..n)
                .map(|r| nccl.stream(r).alloc_zeros::<f32>(len).unwrap())
                .collect();
            let mut recv: Vec<CudaSlice<f32>> = (0..n)
                .map(|r| nccl.stream(r).alloc_zeros::<f32>(len).unwrap())
                .collect();
            for r in 0..n {
                nccl.stream(r).synchronize().unwrap();
            }
            nccl.exchange(&send, &mut recv, &counts, width).unwrap();
            let best = (0..5)
                .map(|_| {
                    nccl.exchange(&send, &mut recv, &counts, width)
                        .unwrap()
                        .duration_ns
                })
                .min()
                .unwrap();
            let bytes = (len * 4) as f64;
            let alg = bytes / best.max(1) as f64;
            println!(
                "all-to-all {name} on {n} rank(s): {:.0} KiB per rank in {:.1} us: algbw {alg:.1} \
                 GB/s, busbw {:.1} GB/s",
                bytes / 1024.0,
                best as f64 / 1e3,
                alg * (n as f64 - 1.0) / n as f64
            );
            assert!(best > 0);
        }
    }
}
