//! Markdown rendering of the GPU reports.

use servelab_kernels::KernelError;
use servelab_kernels::check::CheckResult;

use crate::speed::{Rate, SpeedReport};

pub fn header(gpu: &str, cc: (i32, i32), driver: i32, date: &str) -> String {
    format!(
        "GPU: {gpu} (sm_{}{}), CUDA driver {}.{}, date {date}\n\n",
        cc.0,
        cc.1,
        driver / 1000,
        (driver % 1000) / 10
    )
}

pub fn checks_markdown(results: &[Result<CheckResult, (String, KernelError)>]) -> String {
    let mut s = String::from(
        "| check | detail | rel L2 | max abs | tol | result |\n|---|---|---|---|---|---|\n",
    );
    for r in results {
        match r {
            Ok(c) => s.push_str(&format!(
                "| {} | {} | {:.2e} | {:.2e} | {:.0e} | {} |\n",
                c.name,
                c.detail.replace('|', "/"),
                c.rel_l2,
                c.max_abs,
                c.rel_tol,
                if c.passed { "pass" } else { "FAIL" }
            )),
            Err((name, e)) => s.push_str(&format!(
                "| {name} | error: {} | | | | FAIL |\n",
                e.to_string().replace('\n', " ").replace('|', "/")
            )),
        }
    }
    s
}

fn rate_row(r: &Rate, target: Option<f64>) -> String {
    let ratio = r
        .ratio
        .map(|x| format!("{:.1}%", 100.0 * x))
        .unwrap_or_default();
    let verdict = match (r.ratio, target) {
        (Some(x), Some(t)) => {
            if x >= t {
                format!("meets >= {:.0}%", 100.0 * t)
            } else {
                format!("below {:.0}%", 100.0 * t)
            }
        }
        _ => String::new(),
    };
    format!(
        "| {} | {:.1} {} | {:.3} ms (min {:.3}, max {:.3}, n={}) | {ratio} | {verdict} | {} |\n",
        r.what,
        r.rate,
        r.unit,
        r.timing.median_ms,
        r.timing.min_ms,
        r.timing.max_ms,
        r.timing.reps,
        r.note
    )
}

pub fn speed_markdown(rep: &SpeedReport) -> String {
    let mut s = String::from(
        "| measurement | rate | median time | ratio to ceiling | target (issue 6) | note |\n|---|---|---|---|---|---|\n",
    );
    s.push_str(&rate_row(&rep.copy_ceiling, None));
    s.push_str(&rate_row(&rep.gemm_ceiling, None));
    for d in &rep.decode {
        s.push_str(&rate_row(d, Some(0.7)));
    }
    // issue 6's prefill target is judged on the whole step (fresh 8K chunk); the rest explain it
    s.push_str(&rate_row(&rep.prefill, Some(0.5)));
    for r in &rep.prefill_after_prefix {
        s.push_str(&rate_row(r, None));
    }
    s.push_str(&rate_row(&rep.prefill_gemms_only, None));
    for r in &rep.prefill_attention {
        s.push_str(&rate_row(r, None));
    }
    for (i, w) in rep.swap.iter().enumerate() {
        s.push_str(&rate_row(w, if i == 0 { None } else { Some(0.8) }));
    }
    s.push_str(&format!(
        "\nSwap round trip (in then out, per-block copies) bit-identical: **{}**\n",
        rep.swap_roundtrip_bit_identical
    ));
    s.push_str(
        "\nWhere the whole prefill steps' device time goes (one diagnostic rep each, events at phase boundaries):\n\n| prefix | prefill kernel | GEMMs ms (TFLOP/s) | global attention ms (TFLOP/s) | SWA ms | MoE routing ms | MoE gather/combine ms | elementwise ms | setup ms | sum ms |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for p in &rep.prefill_phases {
        let t = &p.phases;
        s.push_str(&format!(
            "| {} | {} | {:.3} ({:.0}) | {:.3} ({:.0}) | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} |\n",
            p.prefix,
            if p.with_prefill_kernel { "yes" } else { "no" },
            t.gemm_ms,
            p.gemm_tflops,
            t.attention_ms,
            p.attention_tflops,
            t.swa_ms,
            t.routing_ms,
            t.permute_ms,
            t.elementwise_ms,
            t.setup_ms,
            t.total_ms()
        ));
    }
    s
}
