//! Bandwidth ceilings the attention kernels are judged against: a device-to-device copy (reads
//! and writes), a read-only stream (what attention does: it reads its KV and writes almost
//! nothing), and the vendor's datasheet figure.

use servelab_kernels::bandwidth::read_stream;
use servelab_kernels::fill::fill_uniform_bf16;
use servelab_kernels::{GpuContext, KernelError};

use super::{Rate, gbps};
use crate::timing::{Timing, time_ms};

/// HBM bandwidth by the vendor's datasheet, GB/s, for the GPUs this project has run on.
pub fn datasheet_gbps(gpu_name: &str) -> Option<f64> {
    if gpu_name.contains("H200") {
        Some(4800.0)
    } else if gpu_name.contains("H100") && !gpu_name.contains("PCIe") {
        Some(3350.0)
    } else {
        None
    }
}

/// The three ceilings a bandwidth figure is compared with, GB/s.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Ceilings {
    pub copy: f64,
    pub read: f64,
    pub datasheet: Option<f64>,
}

impl Ceilings {
    /// "x% of copy, y% of read-only, z% of datasheet" for a rate in GB/s.
    pub fn note(&self, gbps: f64) -> String {
        let mut s = format!(
            "{:.1}% of copy, {:.1}% of read-only stream",
            100.0 * gbps / self.copy,
            100.0 * gbps / self.read
        );
        if let Some(d) = self.datasheet {
            s.push_str(&format!(
                ", {:.1}% of datasheet {d:.0} GB/s",
                100.0 * gbps / d
            ));
        }
        s
    }
}

/// Resident-thread shapes the read-only stream is swept over: (blocks per SM, threads).
const READ_SHAPES: [(usize, usize); 6] = [
    (2, 1024),
    (4, 512),
    (8, 256),
    (4, 1024),
    (8, 512),
    (16, 256),
];

/// The read-only streaming ceiling: `bytes` of random data read once per run, the best of
/// [`READ_SHAPES`] (the note says which).
pub fn measure_read(gpu: &GpuContext, bytes: usize, reps: usize) -> Result<Rate, KernelError> {
    let n = bytes / 2 / 8 * 8;
    let mut a = gpu.stream.alloc_zeros::<half::bf16>(n)?;
    fill_uniform_bf16(gpu, &mut a, 7, 1.0)?;
    // SAFETY: reinterprets the same allocation as bytes (n bf16 = 2n bytes, a multiple of 16).
    let bytes_view = unsafe { a.transmute::<u8>(2 * n) }
        .ok_or_else(|| KernelError::shape("cannot view the buffer as bytes"))?;
    let sms = gpu
        .ctx
        .attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )
        .map(|v| v.max(1) as usize)
        .unwrap_or(132);
    let mut sink = gpu.stream.alloc_zeros::<u32>(16 * sms)?;
    let mut best: Option<(Timing, usize, usize)> = None;
    let mut tried = Vec::new();
    for (per_sm, threads) in READ_SHAPES {
        let blocks = per_sm * sms;
        let t = time_ms(gpu, 2, reps, || {
            read_stream(gpu, &bytes_view, blocks, threads, &mut sink)
        })?;
        tried.push(format!(
            "{per_sm}x{threads}: {:.0}",
            gbps((2 * n) as f64, &t)
        ));
        if best
            .as_ref()
            .is_none_or(|(b, _, _)| t.median_ms < b.median_ms)
        {
            best = Some((t, per_sm, threads));
        }
    }
    let (t, per_sm, threads) = best.expect("at least one shape");
    let moved = (2 * n) as f64;
    Ok(Rate {
        what: format!("read-only stream {} MiB", (2 * n) >> 20),
        rate: gbps(moved, &t),
        timing: t,
        amount: moved,
        unit: "GB/s",
        ratio: None,
        note: format!(
            "bytes read; 16-byte non-coherent loads, 4 in flight per thread; best {per_sm} blocks/SM x {threads} threads of [{}] GB/s",
            tried.join(", ")
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datasheet_figures_and_notes() {
        assert_eq!(datasheet_gbps("NVIDIA H200"), Some(4800.0));
        assert_eq!(datasheet_gbps("NVIDIA H100 80GB HBM3"), Some(3350.0));
        assert_eq!(datasheet_gbps("NVIDIA A10"), None);
        let c = Ceilings {
            copy: 4000.0,
            read: 4400.0,
            datasheet: Some(4800.0),
        };
        assert_eq!(
            c.note(3600.0),
            "90.0% of copy, 81.8% of read-only stream, 75.0% of datasheet 4800 GB/s"
        );
    }
}
