//! One test per defect of the old serving loop (issue 15): each fails on the loop it replaced.

use servelab_core::engine::PrefillLbPolicy;
use servelab_core::{
    ChainBuilder, Nanos, Request, RequestId, SegmentId, SessionId, SwaConfig, TrafficClass,
};
use servelab_sim::service::{ServiceConfig, run};
use servelab_workloads::generate::{WorkloadConfig, generate};
use std::sync::Arc;

fn unit(prefill_gpus: u32) -> ServiceConfig {
    let mut c = ServiceConfig::default();
    c.prefill.gpus = prefill_gpus;
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

/// `n` cold requests of `prompt` tokens, all arriving at time 0, each on its own chain.
fn simultaneous(n: u64, prompt: u32) -> Vec<Request> {
    (0..n)
        .map(|i| {
            let mut b = ChainBuilder::new(128);
            b.push(SegmentId(100 + i), prompt + 64);
            Request {
                id: RequestId(i),
                session: Some(SessionId(i)),
                class: TrafficClass::Chat,
                arrival: Nanos::ZERO,
                prompt_tokens: prompt,
                output_tokens: 4,
                content: Arc::new(b.finish()),
            }
        })
        .collect()
}

fn workload() -> WorkloadConfig {
    toml::from_str(
        r#"
        [agent]
        sessions = 12
        session_rate_per_s = 2.0
        turns = { kind = "uniform", min = 3, max = 8 }
        system_prompts = 2
        system_prompt_tokens = { kind = "fixed", value = 4000 }
        task_tokens = { kind = "uniform", min = 200, max = 2000 }
        reply_tokens = { kind = "uniform", min = 50, max = 300 }
        tool_result_tokens = { kind = "uniform", min = 200, max = 4000 }
        think_time_s = { kind = "exponential", mean = 2.0 }
        [documents]
        requests = 10
        rate_per_s = 1.0
        system_prompts = 1
        system_prompt_tokens = { kind = "fixed", value = 500 }
        document_tokens = { kind = "uniform", min = 20000, max = 300000 }
        question_tokens = { kind = "uniform", min = 20, max = 100 }
        answer_tokens = { kind = "uniform", min = 50, max = 300 }
        repeat_probability = 0.3
        "#,
    )
    .unwrap()
}

/// Four requests at once on four idle engines: each engine runs one. The old pull order let
/// engine 0 pull all four (it was under its quota) while engines 1–3 stayed idle.
#[test]
fn idle_engines_are_served_before_a_busy_one_hoards() {
    let rep = run(&unit(4), &simultaneous(4, 2_000), 1).unwrap();
    let steps: Vec<u64> = rep
        .engines
        .iter()
        .filter(|e| e.pool == "prefill")
        .map(|e| e.steps)
        .collect();
    assert_eq!(steps, vec![1, 1, 1, 1], "one prefill step per engine");
    // Every request's prefill started at once: no queueing behind a busy engine.
    assert!(rep.all.queue_ns.max() < 1_000, "{}", rep.all.queue_ns.max());
}

/// Strict tiered mode (no stealing): a tier with queued requests but no new submissions keeps
/// an engine, so the run ends. The old balancer gave such a tier no engine and the loop ticked
/// forever.
#[test]
fn strict_tiered_mode_finishes() {
    let trace = generate(&workload(), 5, 128).unwrap();
    let mut c = unit(4);
    c.prefill.lb = PrefillLbPolicy::Tiered {
        tier_bounds_tokens: vec![16_384, 65_536, 262_144],
        round: Nanos::from_secs(1),
        quota: Nanos::from_millis(300),
        steal_when_idle: false,
    };
    let rep = run(&c, &trace.requests, 5).unwrap();
    assert_eq!(rep.completed, rep.arrivals);
    assert!(rep.prefill_lb_rounds > 1);
}

/// Push balancers queue what the chosen engine cannot take yet. With one engine of one job
/// slot the old ones rejected every request that found the slot taken (a loss system).
#[test]
fn push_balancers_queue_instead_of_dropping() {
    let trace = generate(&workload(), 9, 128).unwrap();
    for lb in [PrefillLbPolicy::RoundRobin, PrefillLbPolicy::LeastLoaded] {
        let mut c = unit(1);
        c.prefill.lb = lb.clone();
        c.prefill.max_jobs_per_engine = 1;
        let rep = run(&c, &trace.requests, 9).unwrap();
        assert_eq!(rep.rejected_total(), 0, "{lb:?}: {:?}", rep.rejected);
        assert_eq!(rep.completed, rep.arrivals);
        // Requests did wait: the one slot serialises them.
        assert!(rep.all.queue_ns.mean() > 0.0);
    }
}

/// A full balancer queue still rejects, with the reason, and the latency tables say how many.
#[test]
fn a_full_queue_rejects_and_reports_it() {
    let mut c = unit(1);
    c.prefill.max_jobs_per_engine = 1;
    c.prefill.max_queued_requests = 1;
    let rep = run(&c, &simultaneous(5, 20_000), 2).unwrap();
    assert_eq!(rep.completed + rep.rejected_total(), 5);
    assert!(rep.rejected_total() > 0);
    let measured: u64 = rep.rejected_by_class.iter().map(|(_, n)| n).sum();
    assert_eq!(measured, rep.rejected_total());
    assert_eq!(rep.measured_arrivals, 5);
}
