//! End-to-end runs of the serving simulator: invariants, determinism, policy alternatives.

use servelab_core::engine::{
    ChunkPolicy, DecodeLbPolicy, PrefillLbPolicy, Scheduling, VerificationPolicy,
};
use servelab_core::{
    ChainBuilder, Nanos, Request, RequestId, SegmentId, SessionId, SwaConfig, TrafficClass,
};
use servelab_sim::service::{ServiceConfig, run};
use servelab_workloads::generate::{WorkloadConfig, generate};
use std::sync::Arc;

fn small_unit() -> ServiceConfig {
    let mut c = ServiceConfig::default();
    c.prefill.gpus = 8;
    c.decode.ranks = 8;
    c.swa = SwaConfig {
        machines: 2,
        slots_per_machine: 1000,
        lifetime: Nanos::from_secs(180),
    };
    c.warmup = Nanos::ZERO;
    c.sample_every = 1;
    c
}

fn workload() -> WorkloadConfig {
    toml::from_str(
        r#"
        [agent]
        sessions = 20
        session_rate_per_s = 2.0
        turns = { kind = "uniform", min = 5, max = 15 }
        system_prompts = 2
        system_prompt_tokens = { kind = "fixed", value = 4000 }
        task_tokens = { kind = "uniform", min = 200, max = 2000 }
        reply_tokens = { kind = "uniform", min = 50, max = 400 }
        tool_result_tokens = { kind = "uniform", min = 200, max = 4000 }
        think_time_s = { kind = "exponential", mean = 2.0 }
        [chat]
        sessions = 20
        session_rate_per_s = 2.0
        turns = { kind = "fixed", value = 4 }
        system_prompts = 2
        system_prompt_tokens = { kind = "fixed", value = 1000 }
        user_tokens = { kind = "uniform", min = 20, max = 300 }
        reply_tokens = { kind = "uniform", min = 50, max = 500 }
        think_time_s = { kind = "exponential", mean = 5.0 }
        [documents]
        requests = 10
        rate_per_s = 1.0
        system_prompts = 1
        system_prompt_tokens = { kind = "fixed", value = 500 }
        document_tokens = { kind = "uniform", min = 20000, max = 60000 }
        question_tokens = { kind = "uniform", min = 20, max = 100 }
        answer_tokens = { kind = "uniform", min = 50, max = 300 }
        repeat_probability = 0.3
        "#,
    )
    .unwrap()
}

#[test]
fn every_arrival_completes_and_sessions_hit() {
    let trace = generate(&workload(), 7, 128).unwrap();
    let rep = run(&small_unit(), &trace.requests, 7).unwrap();
    assert_eq!(rep.arrivals, trace.len() as u64);
    assert_eq!(
        rep.completed + rep.rejected.iter().map(|r| r.requests).sum::<u64>(),
        rep.arrivals
    );
    assert_eq!(rep.completed, rep.arrivals, "{:?}", rep.rejected);
    assert!(
        rep.hit_rate() > 0.5,
        "agent turns reuse their context: {}",
        rep.hit_rate()
    );
    assert!(rep.all.ttft_ns.quantile(0.5) > 0.0);
    assert!(rep.all.tpot_ns.count() > 0);
    assert!(
        rep.memo_prefix_lookups > 0,
        "later turns use the session memo"
    );
    assert!(rep.decode_seqs_per_rank > 0.0);
}

#[test]
fn same_seed_same_report() {
    let trace = generate(&workload(), 3, 128).unwrap();
    let a = run(&small_unit(), &trace.requests, 3).unwrap();
    let b = run(&small_unit(), &trace.requests, 3).unwrap();
    // Debug text, so the NaNs of not-applicable fields compare equal.
    assert_eq!(format!("{a:?}"), format!("{b:?}"));
    let c = run(&small_unit(), &trace.requests, 4).unwrap();
    assert_ne!(format!("{a:?}"), format!("{c:?}"), "the seed matters");
}

#[test]
fn simpler_alternatives_run_and_conserve() {
    let trace = generate(&workload(), 5, 128).unwrap();
    type Variant = Box<dyn Fn(&mut ServiceConfig)>;
    let variants: Vec<Variant> = vec![
        Box::new(|c| c.prefill.lb = PrefillLbPolicy::RoundRobin),
        Box::new(|c| c.prefill.lb = PrefillLbPolicy::LeastLoaded),
        Box::new(|c| c.prefill.chunking = ChunkPolicy::FixedSize { chunk_tokens: 8192 }),
        Box::new(|c| c.decode.verification = VerificationPolicy::Fixed { drafts: 5 }),
        Box::new(|c| c.decode.scheduling = Scheduling::Sync),
        Box::new(|c| c.decode.lb = DecodeLbPolicy::RoundRobin),
        Box::new(|c| c.decode.lb = DecodeLbPolicy::LeastLoaded),
        Box::new(|c| c.hit_policy = servelab_core::HitPolicy::SwaOnSsd),
        Box::new(|c| c.hit_policy = servelab_core::HitPolicy::PerfectCache),
        Box::new(|c| c.hit_policy = servelab_core::HitPolicy::OrdinaryModel),
    ];
    for (k, v) in variants.iter().enumerate() {
        let mut c = small_unit();
        v(&mut c);
        let rep = run(&c, &trace.requests, 5).unwrap_or_else(|e| panic!("variant {k}: {e}"));
        assert_eq!(rep.completed, rep.arrivals, "variant {k}");
    }
}

#[test]
fn bounded_queues_reject_with_a_reason() {
    let trace = generate(&workload(), 9, 128).unwrap();
    let mut c = small_unit();
    c.prefill.max_queued_requests = 1;
    c.prefill.max_jobs_per_engine = 1;
    c.prefill.gpus = 1;
    let rep = run(&c, &trace.requests, 9).unwrap();
    let rejected: u64 = rep.rejected.iter().map(|r| r.requests).sum();
    assert!(rejected > 0);
    assert_eq!(rep.completed + rejected, rep.arrivals);
    assert!(
        rep.requests
            .iter()
            .any(|r| r.outcome == "prefill_queue_full")
    );
}

#[test]
fn bad_configs_name_the_field() {
    let mut c = small_unit();
    c.swa.machines = 1;
    assert!(
        run(&c, &[], 1)
            .unwrap_err()
            .to_string()
            .contains("swa.machines")
    );
    let e = toml::from_str::<ServiceConfig>("[prefill]\ngpu = 3\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("gpu"), "{e}");
}

/// The measured window: only arrivals in [warmup, measure_until) count, the rest still run
/// to completion, and an empty window is a config error naming the field.
#[test]
fn measure_until_bounds_the_measured_window() {
    let trace = generate(&workload(), 11, 128).unwrap();
    let mut c = small_unit();
    c.warmup = Nanos::from_secs(2);
    c.measure_until = Some(Nanos::from_secs(6));
    let rep = run(&c, &trace.requests, 11).unwrap();
    let in_window = trace
        .requests
        .iter()
        .filter(|r| r.arrival >= c.warmup && r.arrival < Nanos::from_secs(6))
        .count() as u64;
    assert!(in_window > 0 && in_window < rep.arrivals);
    assert_eq!(rep.measured_requests, in_window);
    assert_eq!(rep.all.ttft_ns.count(), in_window);
    assert_eq!(rep.completed, rep.arrivals, "everything still completes");
    assert_eq!((rep.steady.start_s, rep.steady.end_s), (2.0, 6.0));
    c.measure_until = Some(Nanos::from_secs(2));
    assert!(
        run(&c, &trace.requests, 11)
            .unwrap_err()
            .to_string()
            .contains("measure_until")
    );
    let parsed: ServiceConfig =
        toml::from_str("warmup = \"10s\"\nmeasure_until = \"1min\"\n").unwrap();
    assert_eq!(parsed.measure_until, Some(Nanos::from_secs(60)));
}

/// Two turns of one session, hand-built: the second hits on the first's prompt and output.
#[test]
fn golden_second_turn_hits() {
    let mut b = ChainBuilder::new(128);
    b.push(SegmentId(1), 10_000)
        .push(SegmentId(2), 300)
        .push(SegmentId(3), 2_000);
    let chain = Arc::new(b.finish());
    let mk = |id, at_s, prompt, out| Request {
        id: RequestId(id),
        session: Some(SessionId(1)),
        class: TrafficClass::Agent,
        arrival: Nanos::from_secs(at_s),
        prompt_tokens: prompt,
        output_tokens: out,
        content: chain.clone(),
    };
    let reqs = vec![mk(0, 0, 10_000, 300), mk(1, 30, 12_300, 10)];
    let rep = run(&small_unit(), &reqs, 1).unwrap();
    let second = &rep.requests[1];
    // Turn 1 wrote blocks up to floor(10,300 / 128) = 80 blocks and SWA state at 10,240; turn 2
    // (L = 12,300, cap floor(12,166/128)·128 = 12,160) finds 80 blocks = 10,240 tokens with SWA
    // state there: the hit is 10,240.
    assert_eq!(rep.requests[0].hit_tokens, 0);
    assert_eq!(second.hit_tokens, 10_240);
    assert_eq!(second.outcome, "completed");
}

/// With every device on one GPU, steps never overlap: the devices' busy fractions add up to at
/// most the whole run; on GPUs of their own the same unit and workload keep several busy at once.
#[test]
fn one_gpu_placement_serialises_the_devices_steps() {
    use servelab_sim::service::Placement;
    let mut trace = generate(&workload(), 7, 128).unwrap();
    // Ten times the arrival rate, so that devices have work at the same time.
    for r in &mut trace.requests {
        r.arrival = Nanos(r.arrival.0 / 10);
    }
    let busy = |placement| {
        let mut c = small_unit();
        c.placement = placement;
        let rep = run(&c, &trace.requests, 7).unwrap();
        assert_eq!(rep.completed, rep.arrivals, "{placement:?}");
        rep.engines.iter().map(|e| e.busy_fraction).sum::<f64>()
    };
    let own = busy(Placement::OwnGpus);
    let one = busy(Placement::OneGpu);
    assert!(one <= 1.0 + 1e-9, "one GPU busy {one}");
    assert!(
        own > 1.0,
        "own GPUs busy {own}: the workload must keep devices busy at once"
    );
}
