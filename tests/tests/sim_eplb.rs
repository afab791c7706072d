//! Expert imbalance from the expert-load model inside the serving simulator (SPEC §9).

use servelab_core::Nanos;
use servelab_sim::service::{MoeImbalance, ServiceConfig, ServiceReport, run};
use servelab_workloads::generate::{WorkloadConfig, generate};

fn workload() -> WorkloadConfig {
    toml::from_str(
        r#"
        [agent]
        sessions = 400
        session_rate_per_s = 100.0
        turns = { kind = "uniform", min = 3, max = 5 }
        system_prompts = 2
        system_prompt_tokens = { kind = "fixed", value = 4000 }
        task_tokens = { kind = "uniform", min = 200, max = 2000 }
        reply_tokens = { kind = "uniform", min = 1000, max = 3000 }
        tool_result_tokens = { kind = "uniform", min = 200, max = 2000 }
        think_time_s = { kind = "exponential", mean = 2.0 }
        "#,
    )
    .unwrap()
}

/// An 8 + 8 unit whose decode group's MoE time comes from the load model with `placement`.
fn run_with(placement: &str) -> ServiceReport {
    let mut cfg = ServiceConfig::default();
    cfg.prefill.gpus = 8;
    cfg.decode.ranks = 8;
    cfg.swa.machines = 2;
    cfg.warmup = Nanos::ZERO;
    let decode = toml::from_str(&format!(
        r#"
        phase = "decode"
        model = {{ layers = 8, experts = 64, groups = 8, top_k = 6, expert_bytes = 1000000 }}
        ep = {{ gpus = 8, nodes = 1, link_bytes_per_s = 50e9 }}
        skew = {{ zipf_exponent = 0.8, phase_sigma = 0.2, drift_sigma = 0.2, drift_timescale = "10min", drift_tick = "1s", sequence_sigma = 0.5 }}
        placement = {placement}
        "#
    ))
    .unwrap();
    cfg.moe = MoeImbalance::Model {
        prefill: None,
        decode: Some(Box::new(decode)),
    };
    let reqs = generate(&workload(), 5, cfg.constants.block_tokens)
        .unwrap()
        .requests;
    run(&cfg, &reqs, 5).unwrap()
}

fn mean_decode_step_ns(r: &ServiceReport) -> f64 {
    let d = r.engines.iter().find(|e| e.pool == "decode").unwrap();
    d.busy_fraction * r.simulated_s * 1e9 / d.steps as f64
}

#[test]
fn eplb_shortens_decode_steps_against_no_redundancy() {
    let eplb = run_with(
        r#"{ policy = "eplb", redundant_per_gpu = 1, window_steps = 50, reassign_every_steps = 200, scope = "global" }"#,
    );
    let none = run_with(r#"{ policy = "no-redundancy" }"#);
    assert!(eplb.moe_reassignments > 0, "EPLB reassigned");
    assert_eq!(none.moe_reassignments, 0);
    assert!(
        eplb.decode_mean_imbalance < none.decode_mean_imbalance - 0.05,
        "imbalance {} (eplb) vs {} (none)",
        eplb.decode_mean_imbalance,
        none.decode_mean_imbalance
    );
    assert!(
        none.decode_mean_imbalance > 1.09,
        "skewed routing is worse than the profile's reference"
    );
    let (a, b) = (mean_decode_step_ns(&eplb), mean_decode_step_ns(&none));
    assert!(a < b, "mean decode step {a} ns (eplb) vs {b} ns (none)");
    assert_eq!(eplb.completed, eplb.arrivals);
}

#[test]
fn decode_model_must_match_the_group() {
    let mut cfg = ServiceConfig::default();
    cfg.decode.ranks = 16;
    cfg.moe = MoeImbalance::Model {
        prefill: None,
        decode: Some(Box::new(
            toml::from_str(
                r#"
                phase = "decode"
                ep = { gpus = 64, nodes = 8, link_bytes_per_s = 50e9 }
                skew = { zipf_exponent = 0.5, phase_sigma = 0.2, drift_sigma = 0.3, drift_timescale = "20min", drift_tick = "1s", sequence_sigma = 0.6 }
                placement = { policy = "no-redundancy" }
                "#,
            )
            .unwrap(),
        )),
    };
    let e = run(&cfg, &[], 1).unwrap_err().to_string();
    assert!(e.contains("moe.decode.ep.gpus"), "{e}");
}
