//! The autoscaler over a compressed diurnal load (a 20-minute "day"): the pools follow the
//! load within their bounds, no request is lost, and the autoscaled pools pay for fewer
//! GPU-hours than the fixed pools sized for the peak.

use servelab_core::{Nanos, SwaConfig};
use servelab_sim::service::{ServiceConfig, ServiceReport, run};
use servelab_workloads::generate::{WorkloadConfig, generate};

fn unit(autoscale: &str) -> ServiceConfig {
    let mut c = ServiceConfig::default();
    c.prefill.gpus = 8;
    c.decode.groups = 4;
    c.decode.ranks = 2;
    c.decode.max_seqs_per_rank = 8;
    c.swa = SwaConfig {
        machines: 4,
        slots_per_machine: 2000,
        lifetime: Nanos::from_secs(180),
    };
    c.warmup = Nanos::ZERO;
    c.sample_every = 10;
    if !autoscale.is_empty() {
        c.autoscale = Some(toml::from_str(autoscale).unwrap());
    }
    c
}

fn day() -> WorkloadConfig {
    toml::from_str(
        r#"
        [diurnal]
        amplitude = 0.9
        period = "20min"
        peak_at = "10min"
        [agent]
        sessions = 1200
        session_rate_per_s = 1.0
        turns = { kind = "uniform", min = 4, max = 10 }
        system_prompts = 4
        system_prompt_tokens = { kind = "fixed", value = 6000 }
        task_tokens = { kind = "uniform", min = 500, max = 4000 }
        reply_tokens = { kind = "uniform", min = 100, max = 600 }
        tool_result_tokens = { kind = "uniform", min = 500, max = 8000 }
        think_time_s = { kind = "exponential", mean = 3.0 }
        "#,
    )
    .unwrap()
}

fn serve(autoscale: &str) -> ServiceReport {
    let trace = generate(&day(), 3, 128).unwrap();
    let rep = run(&unit(autoscale), &trace.requests, 1).unwrap();
    assert_eq!(
        rep.completed + rep.rejected_total(),
        rep.arrivals,
        "no lost request"
    );
    rep
}

const BOUNDS: &str = "provision_delay = \"30s\"\ndown_after = 3\ncooldown = \"60s\"\nprefill = { min = 1, max = 8, initial = 2 }\ndecode = { min = 1, max = 4, initial = 1 }\n";

const UTIL: &str = "policy = { kind = \"utilisation\", prefill_busy = 0.6, decode_occupancy = 0.6, band = 0.25, queue_per_engine = 2.0 }\n";
const SLO: &str = "policy = { kind = \"slo\", ttft = \"2s\", tpot = \"20ms\", low = 0.3 }\n";

/// GPU-hours of the pools sized for the peak (every configured GPU for the whole run).
fn peak_gpu_hours(r: &ServiceReport) -> f64 {
    (8.0 + 4.0 * 2.0) * r.simulated_s / 3600.0
}

fn check_bounds(r: &ServiceReport) {
    for row in &r.autoscale.as_ref().unwrap().rows {
        assert!((1..=8).contains(&row.prefill_engines), "{row:?}");
        assert!((1..=4).contains(&row.decode_groups), "{row:?}");
    }
}

/// Both policies resize both ways within their bounds, lose nothing, and pay for fewer
/// GPU-hours than the pools sized for the peak; the fixed policy changes nothing.
#[test]
fn policies_follow_the_load_within_bounds() {
    let util = serve(&format!("{UTIL}{BOUNDS}"));
    let a = util.autoscale.as_ref().unwrap();
    assert_eq!(a.policy, "utilisation");
    assert!(a.prefill_ups > 0 && a.prefill_downs > 0, "{a:?}");
    assert!(
        a.decode_ups > 0 && a.decode_downs > 0,
        "{:?}",
        (a.decode_ups, a.decode_downs)
    );
    assert!(a.gpu_hours() < peak_gpu_hours(&util) / 2.0);
    check_bounds(&util);
    let slo = serve(&format!("{SLO}{BOUNDS}"));
    let s = slo.autoscale.as_ref().unwrap();
    assert!(s.prefill_ups > 0 && s.prefill_downs > 0);
    check_bounds(&slo);
    let fixed = serve(&format!("policy = {{ kind = \"fixed\" }}\n{BOUNDS}"));
    let f = fixed.autoscale.as_ref().unwrap();
    assert_eq!(
        (f.prefill_ups, f.prefill_downs, f.decode_ups, f.decode_downs),
        (0, 0, 0, 0)
    );
    assert!(
        f.rows
            .iter()
            .all(|r| r.prefill_engines == 2 && r.decode_groups == 1)
    );
    // Paid: 2 engines + 1 group of 2 ranks for every interval of the run.
    let want = 4.0 * f.rows.last().unwrap().t_s / 3600.0;
    assert!(
        (f.gpu_hours() - want).abs() < 1e-9,
        "{} vs {want}",
        f.gpu_hours()
    );
}

/// The same seed gives the same decisions.
#[test]
fn autoscaling_is_deterministic() {
    let a = serve(&format!("{UTIL}{BOUNDS}"));
    let b = serve(&format!("{UTIL}{BOUNDS}"));
    assert_eq!(format!("{:?}", a.autoscale), format!("{:?}", b.autoscale));
    assert_eq!(a.all.ttft_ns, b.all.ttft_ns);
}

/// Bad autoscaler keys are errors naming the field.
#[test]
fn bad_autoscaler_keys_name_the_field() {
    let err = |t: &str| {
        let c = unit(t);
        run(&c, &[], 1).unwrap_err().to_string()
    };
    let b = BOUNDS.replace("decode = { min = 1, max = 4", "decode = { min = 3, max = 2");
    let e = err(&format!("{UTIL}{b}"));
    assert!(
        e.contains("autoscale.decode.min") && e.contains("above max"),
        "{e}"
    );
    let b = BOUNDS.replace("max = 8", "max = 9");
    let e = err(&format!("{UTIL}{b}"));
    assert!(e.contains("autoscale.prefill.max"), "{e}");
    let e = err(&format!(
        "{}{BOUNDS}",
        UTIL.replace("band = 0.25", "band = 0.7")
    ));
    assert!(e.contains("autoscale.policy.band"), "{e}");
}
