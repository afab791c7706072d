//! Event-timed repetitions on the device stream.

use cudarc::driver::sys::CUevent_flags;
use servelab_kernels::{GpuContext, KernelError};

/// Median and spread of event-timed repetitions, in milliseconds.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Timing {
    pub median_ms: f64,
    pub min_ms: f64,
    pub max_ms: f64,
    pub reps: usize,
}

/// Runs `f` `warmup` times, then times `reps` runs one by one with device events.
pub fn time_ms(
    gpu: &GpuContext,
    warmup: usize,
    reps: usize,
    mut f: impl FnMut() -> Result<(), KernelError>,
) -> Result<Timing, KernelError> {
    for _ in 0..warmup {
        f()?;
    }
    gpu.stream.synchronize()?;
    let mut v = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let start = gpu.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        let end = gpu.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        start.record(&gpu.stream)?;
        f()?;
        end.record(&gpu.stream)?;
        v.push(start.elapsed_ms(&end)? as f64);
    }
    Ok(summarize(v))
}

pub fn summarize(mut v: Vec<f64>) -> Timing {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let median_ms = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    Timing {
        median_ms,
        min_ms: v[0],
        max_ms: v[n - 1],
        reps: n,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_even_and_odd() {
        assert_eq!(summarize(vec![3.0, 1.0, 2.0]).median_ms, 2.0);
        let t = summarize(vec![4.0, 1.0, 2.0, 3.0]);
        assert_eq!(
            (t.median_ms, t.min_ms, t.max_ms, t.reps),
            (2.5, 1.0, 4.0, 4)
        );
    }
}
