//! A serving unit given its requests as a stream: the same run as the unit given the whole
//! table, while holding only the requests in flight.

use servelab_core::unit::drive::Observer;
use servelab_core::unit::{ServiceReport, ServingUnit, SharedCache};
use servelab_core::{ConfigError, Nanos, Request, SwaConfig};
use servelab_sim::env::RequestFeed;
use servelab_sim::profile::{HardwareProfile, ProfileFiles};
use servelab_sim::service::{
    Arrivals, ServiceConfig, ServiceError, run_observed, run_streamed, run_with_profile,
};
use servelab_workloads::generate::{WorkloadConfig, generate};

fn unit() -> ServiceConfig {
    let mut c = ServiceConfig::default();
    c.prefill.gpus = 8;
    c.decode.ranks = 8;
    c.swa = SwaConfig {
        machines: 2,
        slots_per_machine: 1000,
        lifetime: Nanos::from_secs(180),
    };
    c.warmup = Nanos::from_secs(5);
    c.sample_every = 1;
    c
}

/// Agent and chat sessions and documents at a steady rate; `sessions` sets the run's length.
fn workload(sessions: u32) -> WorkloadConfig {
    toml::from_str(&format!(
        r#"
        [agent]
        sessions = {sessions}
        session_rate_per_s = 1.0
        turns = {{ kind = "uniform", min = 3, max = 8 }}
        system_prompts = 2
        system_prompt_tokens = {{ kind = "fixed", value = 4000 }}
        task_tokens = {{ kind = "uniform", min = 200, max = 2000 }}
        reply_tokens = {{ kind = "uniform", min = 50, max = 400 }}
        tool_result_tokens = {{ kind = "uniform", min = 200, max = 4000 }}
        think_time_s = {{ kind = "exponential", mean = 2.0 }}
        [chat]
        sessions = {sessions}
        session_rate_per_s = 1.0
        turns = {{ kind = "fixed", value = 3 }}
        system_prompts = 2
        system_prompt_tokens = {{ kind = "fixed", value = 1000 }}
        user_tokens = {{ kind = "uniform", min = 20, max = 300 }}
        reply_tokens = {{ kind = "uniform", min = 50, max = 500 }}
        think_time_s = {{ kind = "exponential", mean = 5.0 }}
        "#
    ))
    .unwrap()
}

fn profile() -> HardwareProfile {
    HardwareProfile::resolve("sm100-published").unwrap()
}

fn feed(reqs: Vec<Request>) -> RequestFeed {
    Box::new(reqs.into_iter().map(Ok))
}

/// The most requests the unit held after any input.
#[derive(Default)]
struct PeakHeld(usize);

impl Observer for PeakHeld {
    fn after_input(&mut self, _now: Nanos, unit: &ServingUnit, _shared: &SharedCache) {
        self.0 = self.0.max(unit.requests_held());
    }
}

fn streamed(
    cfg: &ServiceConfig,
    reqs: Vec<Request>,
) -> Result<(ServiceReport, usize), ServiceError> {
    let last = reqs.iter().map(|r| r.arrival).max().unwrap_or(Nanos::ZERO);
    let mut peak = PeakHeld::default();
    let rep = run_streamed(cfg, profile(), feed(reqs), last, 3, &mut peak)?;
    Ok((rep, peak.0))
}

fn json(r: &ServiceReport) -> String {
    serde_json::to_string(r).unwrap()
}

#[test]
fn a_streamed_run_is_the_table_run_byte_for_byte() {
    let trace = generate(&workload(40), 3, 128).unwrap();
    let cfg = unit();
    let table = run_with_profile(&cfg, profile(), &trace.requests, 3).unwrap();
    let (stream, peak) = streamed(&cfg, trace.requests.clone()).unwrap();
    assert!(table.completed > 100, "{}", table.completed);
    assert_eq!(json(&table), json(&stream));
    assert!(
        peak < trace.len() / 3,
        "the streamed unit held {peak} of {} requests at once",
        trace.len()
    );
}

#[test]
fn what_a_streamed_unit_holds_does_not_grow_with_the_run() {
    let cfg = unit();
    let short = generate(&workload(40), 5, 128).unwrap();
    let long = generate(&workload(160), 5, 128).unwrap();
    let (_, peak_short) = streamed(&cfg, short.requests.clone()).unwrap();
    let (rep, peak_long) = streamed(&cfg, long.requests.clone()).unwrap();
    assert_eq!(rep.completed, long.len() as u64);
    // Four times the requests at the same rate: the requests in flight are alike, so what is
    // held is too (its peak grows only as the longest request's span does).
    assert!(
        peak_long < 2 * peak_short + 8,
        "held at most {peak_short} of {} and {peak_long} of {}",
        short.len(),
        long.len()
    );
    // And the table run holds every request it has not yet finished.
    let mut peak = PeakHeld::default();
    run_observed(&cfg, profile(), &long.requests, 5, &mut peak).unwrap();
    assert!(peak.0 > 4 * peak_long, "{} vs {peak_long}", peak.0);
}

#[test]
fn a_stream_runs_open_loop_only() {
    let mut cfg = unit();
    cfg.arrivals = Arrivals::ClosedLoop {
        ttft: Nanos::from_secs(1),
        decode_tokens_per_s: 30.0,
    };
    let trace = generate(&workload(4), 3, 128).unwrap();
    let e = streamed(&cfg, trace.requests).unwrap_err().to_string();
    assert!(
        e.contains("service.arrivals") && e.contains("open loop"),
        "{e}"
    );
}

#[test]
fn a_stream_out_of_order_or_at_another_block_size_is_an_error() {
    let cfg = unit();
    let mut reqs = generate(&workload(4), 3, 128).unwrap().requests;
    let n = reqs.len();
    reqs.swap(n / 2, n - 1);
    let e = streamed(&cfg, reqs).unwrap_err().to_string();
    assert!(e.contains("not sorted by arrival"), "{e}");

    let reqs = generate(&workload(4), 3, 64).unwrap().requests;
    let e = streamed(&cfg, reqs).unwrap_err().to_string();
    assert!(e.contains("constants.block_tokens"), "{e}");

    let bad: RequestFeed =
        Box::new([Err(ConfigError::invalid("workload.agent.turns", "bad"))].into_iter());
    let e = run_streamed(
        &cfg,
        profile(),
        bad,
        Nanos::ZERO,
        3,
        &mut PeakHeld::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("workload.agent.turns"), "{e}");
}
