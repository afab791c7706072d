//! The whole prefill step at each of the prefill kernel's tile options, and a short device
//! benchmark of the prefill rows alone (`prefill_bench`, below): the GEMM ceiling, the GEMMs
//! only, the attention kernel's tile sweep, the whole steps of the speed report and the whole
//! fresh-prompt step per tiles.

use servelab_kernels::prefill_attention::PrefillAttention;
use servelab_kernels::{GpuContext, KernelError};

use super::{
    PrefillShape, Rate, attention_shape, backend_error, measure_step_row, prefill_step_backend,
    prefill_step_model, prefill_tile_options,
};

/// The whole fresh-prompt step (prefix 0) of [`super::measure_prefill_steps`] with the prefill
/// kernel at each of the kernel-only measurement's tile options (the backend's default first),
/// so that tiles are chosen on the step they serve and not on the kernel alone.
pub fn measure_prefill_step_tiles(
    gpu: &GpuContext,
    p: &PrefillShape,
    reps: usize,
    ceiling_tflops: f64,
) -> Result<Vec<Rate>, KernelError> {
    let model = prefill_step_model(p)?;
    let shape = attention_shape(&model);
    let mut b = prefill_step_backend(gpu, &model, p, &[0])?;
    let mut rows = Vec::new();
    for t in prefill_tile_options(&shape) {
        b.set_prefill_tiles(t).map_err(backend_error)?;
        let resources = PrefillAttention::with_tiles(b.gpu(), shape, t)?.resources();
        let (rate, _) = measure_step_row(&mut b, &model, p, 0, reps, ceiling_tflops, resources)?;
        rows.push(rate);
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::speed::{SpeedConfig, measure_gemm_ceiling, measure_prefill_rows};

    /// The prefill rows alone at full size, for a short device run:
    /// `servelab_hw-* --ignored prefill_bench --nocapture`; writes `prefill-bench.json` to
    /// `$OUT` when set.
    #[test]
    #[ignore = "full-size GPU benchmark"]
    fn prefill_bench() {
        let Some(gpu) = servelab_kernels::gpu::gpu_or_skip() else {
            return;
        };
        let cfg = SpeedConfig::full(1);
        let gemm = measure_gemm_ceiling(&gpu, cfg.gemm_ceiling_dim, cfg.reps).unwrap();
        println!("{}: {:.1} TFLOP/s", gemm.what, gemm.rate);
        let mut log = |l: &str| println!("{l}");
        let pf = measure_prefill_rows(&gpu, &cfg, gemm.rate, &mut log).unwrap();
        let reps = cfg.reps.min(10);
        // The tile sweep takes most of the bench's device time: PREFILL_TILES=0 skips it.
        let per_tiles = if std::env::var("PREFILL_TILES").is_ok_and(|v| v == "0") {
            Vec::new()
        } else {
            measure_prefill_step_tiles(&gpu, &cfg.prefill, reps, gemm.rate).unwrap()
        };
        for r in &per_tiles {
            println!(
                "{}: {:.1} TFLOP/s ({:.3}) {:.3} ms; {}",
                r.what,
                r.rate,
                r.ratio.unwrap_or(0.0),
                r.timing.median_ms,
                r.note
            );
        }
        if let Ok(dir) = std::env::var("OUT") {
            let path = std::path::Path::new(&dir).join("prefill-bench.json");
            let json = serde_json::json!({
                "gemm_ceiling": gemm,
                "prefill_gemms_only": pf.gemms_only,
                "prefill_attention": pf.attention,
                "prefill_steps": pf.steps,
                "prefill_phases": pf.phases,
                "prefill_step_per_tiles": per_tiles,
            });
            std::fs::write(path, serde_json::to_string_pretty(&json).unwrap()).unwrap();
        }
    }
}
