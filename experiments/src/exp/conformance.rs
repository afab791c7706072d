//! Conformance analysis (SPEC §16, issue 15 item 3): a GPU record of the serving unit
//! (`servelab_hw::conformance`) against the simulator's run of the SAME unit config.
//!
//! 1. Decisions: the record replayed through the unit (`servelab_hw::env::ReplayEnv`): every
//!    plan must be identical.
//! 2. Step time, plan by plan: the simulator's cost model ([`CostModel`]) with the measured
//!    profile predicts each recorded plan (decode at the drafts the GPU verified).
//! 3. Latency: the unit's report of the GPU run against the unit's report of two simulator
//!    runs of the same config and workload: the simulator's environment
//!    (`servelab_sim::service`, `VirtualEnv` with `placement = one-gpu`: the devices share one
//!    GPU, as on the H200), and the GPU environment on the virtual clock with the cost model as
//!    its device.

use serde::Serialize;
use servelab_core::Nanos;
use servelab_core::engine::{Backend, StepPlan, StepReport};
use servelab_core::profile::HardwareProfile;
use servelab_hw::clock::ClockKind;
use servelab_hw::conformance::{
    self as hwc, ConformanceError, ConformanceFile, HostOverhead, Record, ReplayCheck, percentile,
};
use servelab_hw::env::{RecordedStep, RunOutcome, request_outcomes};
use servelab_sim::acceptance::AcceptanceModel;
use servelab_sim::cost::{CostModel, SwapIn};
use servelab_sim::service::{FetchConfig, LinkConfig, MoeImbalance, Placement, ServiceConfig};

/// Targets of issue 6 item 5 and issue 15 item 3.
pub const STEP_ERROR_MEDIAN_TARGET: f64 = 0.05;
pub const TTFT_TARGET: f64 = 0.10;

/// The simulator's acceptance model matched to the GPU backend's draw: every verified draft
/// accepted with probability `draft_acceptance` while the prefix holds, confidences exact.
pub fn matched_acceptance(file: &ConformanceFile) -> AcceptanceModel {
    let p = file.backend.draft_acceptance.clamp(1e-6, 1.0 - 1e-6);
    AcceptanceModel {
        mean_logit: (p / (1.0 - p)).ln(),
        seq_sigma: 0.0,
        token_sigma: 0.0,
        position_decay: 0.0,
        confidence_noise: 0.0,
        profiles: 1,
    }
}

/// The service config of the conformance unit: the same [`servelab_core::unit::UnitConfig`]
/// (pools, policies, cost models), and an environment that matches one GPU host: the prefix
/// is in host memory and swapped in inside the prefill step (no store read time, overlapped
/// swap-in in the cost model), the handoff stays in one HBM pool (no link time), no MoE skew.
pub fn service_config(
    file: &ConformanceFile,
    profile: &HardwareProfile,
) -> Result<ServiceConfig, ConformanceError> {
    let unit = file.unit_config(profile)?;
    let c = &file.conformance;
    let instant = 1e18;
    Ok(ServiceConfig {
        profile: profile.name.clone(),
        constants: unit.constants,
        hit_policy: unit.hit_policy,
        store: c.store.clone(),
        swa: c.swa.clone(),
        prefill: unit.prefill,
        decode: unit.decode,
        fetch: FetchConfig {
            node_read_bytes_per_s: instant,
            latency: Nanos::ZERO,
            tail_mean: Nanos::ZERO,
            stripes: 1,
        },
        links: LinkConfig {
            handoff_bytes_per_s_per_machine: instant,
            handoff_latency: Nanos::ZERO,
            swa_pull_bytes_per_s: instant,
            swa_pull_latency: Nanos::ZERO,
        },
        swap_in: SwapIn::Overlapped,
        acceptance: matched_acceptance(file),
        moe: MoeImbalance::Fixed,
        arrivals: Default::default(),
        // The GPU engine runs every device of the unit on the one GPU.
        placement: Placement::OneGpu,
        warmup: unit.warmup,
        measure_until: unit.measure_until,
        series_interval: unit.series_interval,
        sample_every: unit.sample_every,
        touch_coalesce: unit.touch_coalesce,
    })
}

/// The cost model that predicts a config's recorded steps with `profile`.
pub fn prediction_cost(
    file: &ConformanceFile,
    profile: HardwareProfile,
) -> Result<CostModel, ConformanceError> {
    Ok(CostModel::new(
        profile,
        &matched_acceptance(file),
        file.conformance.draft_tokens,
        SwapIn::Overlapped,
        servelab_core::seed::sub_seed(file.seed()?, "conformance.sim"),
    ))
}

/// The cost model's duration for a recorded step: prefill with overlapped swap-in; decode at
/// the verification the GPU actually did (the cost model's own acceptance draw is for
/// free-running runs), slowest rank.
pub fn predict_ns(cost: &CostModel, step: &RecordedStep) -> f64 {
    match &step.plan {
        StepPlan::Prefill(p) => cost.prefill_ns(p),
        StepPlan::Decode(_) => hwc::predict_decode_ns(&cost.profile().decode, step).unwrap_or(0.0),
    }
}

/// Relative step-time errors of one kind of step.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ErrorStats {
    pub steps: usize,
    /// Median and P90 of |predicted / measured − 1|.
    pub abs_median: f64,
    pub abs_p90: f64,
    /// Median of predicted / measured − 1 (the sign says over- or under-prediction).
    pub signed_median: f64,
    /// Σ predicted / Σ measured − 1.
    pub total: f64,
}

fn error_stats(pairs: &[(f64, f64)]) -> ErrorStats {
    let rel: Vec<f64> = pairs.iter().map(|(m, p)| p / m - 1.0).collect();
    let abs: Vec<f64> = rel.iter().map(|e| e.abs()).collect();
    let (sm, sp) = pairs
        .iter()
        .fold((0.0, 0.0), |(a, b), (m, p)| (a + m, b + p));
    ErrorStats {
        steps: pairs.len(),
        abs_median: percentile(&abs, 0.5),
        abs_p90: percentile(&abs, 0.9),
        signed_median: percentile(&rel, 0.5),
        total: if sm > 0.0 { sp / sm - 1.0 } else { 0.0 },
    }
}

/// Step-time prediction errors over every recorded plan.
#[derive(Clone, Debug, Serialize)]
pub struct StepErrors {
    pub all: ErrorStats,
    pub prefill: ErrorStats,
    pub decode: ErrorStats,
}

pub fn step_errors(cost: &CostModel, steps: &[RecordedStep]) -> StepErrors {
    let (mut all, mut pre, mut dec) = (vec![], vec![], vec![]);
    for s in steps {
        let pair = (s.duration_ns.max(1) as f64, predict_ns(cost, s));
        all.push(pair);
        match s.plan {
            StepPlan::Prefill(_) => pre.push(pair),
            StepPlan::Decode(_) => dec.push(pair),
        }
    }
    StepErrors {
        all: error_stats(&all),
        prefill: error_stats(&pre),
        decode: error_stats(&dec),
    }
}

/// P50 and P99 of one latency in two runs.
#[derive(Clone, Debug, Serialize)]
pub struct LatencyRow {
    pub metric: String,
    pub gpu_ms: f64,
    pub sim_ms: f64,
    /// sim / gpu − 1.
    pub error: f64,
}

/// TTFT and TPOT percentiles (nearest rank over the completed requests) of two runs.
pub fn latency_comparison(gpu: &RunOutcome, sim: &RunOutcome) -> Vec<LatencyRow> {
    let ttft = |o: &RunOutcome| -> Vec<f64> {
        o.requests
            .iter()
            .filter_map(|r| r.ttft_ns().map(|t| t as f64 / 1e6))
            .collect()
    };
    let tpot = |o: &RunOutcome| -> Vec<f64> {
        o.requests
            .iter()
            .filter_map(|r| r.tpot_ns().map(|t| t / 1e6))
            .collect()
    };
    let mut rows = Vec::new();
    for (name, g, s) in [
        ("TTFT", ttft(gpu), ttft(sim)),
        ("TPOT", tpot(gpu), tpot(sim)),
    ] {
        for (q, label) in [(0.5, "P50"), (0.99, "P99")] {
            let (a, b) = (percentile(&g, q), percentile(&s, q));
            rows.push(LatencyRow {
                metric: format!("{name} {label}"),
                gpu_ms: a,
                sim_ms: b,
                error: if a > 0.0 { b / a - 1.0 } else { 0.0 },
            });
        }
    }
    rows
}

/// One simulator run of the conformance unit, reduced to what the comparison reads.
#[derive(Clone, Debug, Serialize)]
pub struct SimRun {
    pub environment: &'static str,
    pub run_ms: f64,
    pub completed: u64,
    pub rejected: u64,
    pub latency: Vec<LatencyRow>,
}

/// The analysis of one record.
#[derive(Clone, Debug, Serialize)]
pub struct Analysis {
    pub gpu: String,
    pub date: String,
    pub commit: String,
    pub profile: String,
    pub requests: usize,
    pub steps: usize,
    pub prefill_steps: usize,
    pub decode_steps: usize,
    pub prefill_engines: u32,
    pub decode_groups: u32,
    /// The GPU run's clock: on the wall clock its times (run length, TTFT, TPOT) are wall times.
    pub clock: ClockKind,
    pub pinned_cpu: Option<usize>,
    pub gpu_run_ms: f64,
    /// Σ of the steps' device durations (CUDA events).
    pub device_ms: f64,
    pub hit_tokens: u64,
    pub prompt_tokens: u64,
    pub host: HostOverhead,
    pub replay: ReplayCheck,
    pub step_errors: StepErrors,
    /// The simulator's environment, then the GPU environment with the cost model as device.
    pub sims: Vec<SimRun>,
}

/// Replays, predicts and simulates a record. `profile` is what the simulator predicts with
/// (normally the policies' profile, i.e. the one measured on the same GPU).
pub fn analyze(record: &Record, profile: HardwareProfile) -> Result<Analysis, ConformanceError> {
    let file = ConformanceFile::parse(&record.config, "record.config")?;
    let policy = hwc::parse_profile(&record.policy_profile, "record.profile")?;
    let reqs = hwc::workload(&file)?;
    let replay = hwc::replay_check(&file, &policy, &reqs, &record.run)?;
    let step_errors = step_errors(&prediction_cost(&file, profile.clone())?, &record.run.steps);
    let sims = simulate(&file, &profile, &reqs, &record.run)?;
    let run = &record.run;
    let count = |decode: bool| {
        run.steps
            .iter()
            .filter(|s| matches!(s.plan, StepPlan::Decode(_)) == decode)
            .count()
    };
    let c = &file.conformance;
    Ok(Analysis {
        gpu: record.gpu.clone(),
        date: record.date.clone(),
        commit: record.commit.clone(),
        profile: profile.name.clone(),
        requests: reqs.len(),
        steps: run.steps.len(),
        prefill_steps: count(false),
        decode_steps: count(true),
        prefill_engines: c.prefill.gpus,
        decode_groups: c.decode.groups,
        clock: run.clock,
        pinned_cpu: run.pinned_cpu,
        gpu_run_ms: run.end_ns as f64 / 1e6,
        device_ms: run.steps.iter().map(|s| s.duration_ns as f64).sum::<f64>() / 1e6,
        hit_tokens: run.requests.iter().map(|r| u64::from(r.hit_tokens)).sum(),
        prompt_tokens: reqs.iter().map(|r| u64::from(r.prompt_tokens)).sum(),
        host: hwc::host_overhead(run),
        replay,
        step_errors,
        sims,
    })
}

/// The two simulator runs of the record's config, compared with the GPU run.
fn simulate(
    file: &ConformanceFile,
    profile: &HardwareProfile,
    reqs: &[servelab_core::Request],
    gpu: &RunOutcome,
) -> Result<Vec<SimRun>, ConformanceError> {
    let seed = servelab_core::seed::sub_seed(file.seed()?, "conformance.sim");
    let cfg = service_config(file, profile)?;
    let report = servelab_sim::service::run_with_profile(&cfg, profile.clone(), reqs, seed)
        .map_err(|e| ConformanceError::Device(format!("simulator: {e}")))?;
    let mut sim = gpu.clone();
    sim.requests = request_outcomes(reqs, &report.requests);
    let service = SimRun {
        environment: "simulator (VirtualEnv, the devices on one GPU)",
        run_ms: report.simulated_s * 1e3,
        completed: report.completed,
        rejected: report.rejected_total(),
        latency: latency_comparison(gpu, &sim),
    };
    let mut cost = prediction_cost(file, profile.clone())?;
    let mut device = |p: &StepPlan, r: &mut StepReport| {
        cost.execute(Nanos::ZERO, p, r);
        Ok(())
    };
    let (shared, report) = hwc::run_virtual(file, profile, reqs, &mut device)?;
    let one_gpu = SimRun {
        environment: "GPU environment, cost-model device (devices share one GPU)",
        run_ms: shared.end_ns as f64 / 1e6,
        completed: report.completed,
        rejected: report.rejected_total(),
        latency: latency_comparison(gpu, &shared),
    };
    Ok(vec![service, one_gpu])
}

/// The markdown report.
pub fn markdown(a: &Analysis) -> String {
    let mut s = header(a);
    let r = &a.replay;
    s.push_str("## 1. Decisions (the record replayed through the unit at the recorded times)\n\n");
    if r.replayable {
        s.push_str(&format!(
            "{} recorded plans, {} replayed, **{} mismatched**; request outcomes identical: {}.\n\n",
            r.recorded_steps, r.replayed_steps, r.mismatched_steps, r.outcomes_identical
        ));
    } else {
        s.push_str("Not replayable: the record has no input log (recorded by the one-device engine loop before the serving unit); its steps still analyse.\n\n");
    }
    for m in &r.first_mismatches {
        s.push_str(&format!("- {m}\n"));
    }
    s.push_str(&step_table(&a.step_errors));
    for sim in &a.sims {
        s.push_str(&latency_table(sim));
    }
    s
}

fn header(a: &Analysis) -> String {
    let h = &a.host;
    let clock = match a.clock {
        ClockKind::Wall => format!(
            "Clock: **wall**. Arrivals were released at their wall time; the device ran on its \
             own thread while the unit handled inputs: {} of {} requests arrived while a step \
             was in flight. Host time per step beyond the device duration and the wait behind \
             other devices (end − start − duration − queued): sum {:.1} ms, median {:.3} ms, \
             P90 {:.3} ms over {} steps. {}\n\n",
            h.admitted_in_flight,
            h.requests,
            h.sum_ms,
            h.median_ms,
            h.p90_ms,
            h.steps,
            match a.pinned_cpu {
                Some(c) => format!("Every thread of the run was pinned to CPU {c}."),
                None => "The run's threads were not pinned to a CPU.".to_string(),
            }
        ),
        ClockKind::Virtual => "Clock: **virtual**. Time moved by the CUDA-event step durations \
                               (steps queued FIFO on the one GPU); host time is not counted.\n\n"
            .to_string(),
    };
    format!(
        "# Conformance: the serving unit on the GPU vs in the simulator (SPEC §16)\n\n\
         GPU: {}; date {}; commit {}; profile `{}`.\n\n\
         Unit: {} prefill engine(s) and {} one-rank decode group(s), all on the one GPU. \
         {} requests, {} prompt tokens ({} hit, {:.1}%); {} steps ({} prefill, {} decode); \
         GPU run {:.1} ms on its clock ({:.1} ms of device time in steps).\n\n{clock}",
        a.gpu,
        a.date,
        a.commit,
        a.profile,
        a.prefill_engines,
        a.decode_groups,
        a.requests,
        a.prompt_tokens,
        a.hit_tokens,
        100.0 * a.hit_tokens as f64 / a.prompt_tokens.max(1) as f64,
        a.steps,
        a.prefill_steps,
        a.decode_steps,
        a.gpu_run_ms,
        a.device_ms,
    )
}

fn pct(x: f64) -> String {
    format!("{:+.1}%", 100.0 * x)
}
fn upct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}
fn met(ok: bool) -> &'static str {
    if ok { "met" } else { "**not met**" }
}

fn step_table(e: &StepErrors) -> String {
    let mut s = String::from(
        "## 2. Step time, plan by plan (cost model with the measured profile)\n\n\
         | steps | n | median abs error | P90 abs error | median signed | total |\n\
         |---|---|---|---|---|---|\n",
    );
    for (name, st) in [
        ("all", &e.all),
        ("prefill", &e.prefill),
        ("decode", &e.decode),
    ] {
        s.push_str(&format!(
            "| {name} | {} | {} | {} | {} | {} |\n",
            st.steps,
            upct(st.abs_median),
            upct(st.abs_p90),
            pct(st.signed_median),
            pct(st.total)
        ));
    }
    s.push_str(&format!(
        "\nTarget median ≤ {}: {}.\n\n",
        upct(STEP_ERROR_MEDIAN_TARGET),
        met(e.all.abs_median <= STEP_ERROR_MEDIAN_TARGET)
    ));
    s
}

fn latency_table(sim: &SimRun) -> String {
    let mut s = format!(
        "## 3. Latency: GPU run vs {} ({:.1} ms, {} completed, {} rejected)\n\n\
         | metric | GPU ms | simulator ms | error |\n|---|---|---|---|\n",
        sim.environment, sim.run_ms, sim.completed, sim.rejected
    );
    for row in &sim.latency {
        s.push_str(&format!(
            "| {} | {:.2} | {:.2} | {} |\n",
            row.metric,
            row.gpu_ms,
            row.sim_ms,
            pct(row.error)
        ));
    }
    let ok = sim
        .latency
        .iter()
        .filter(|r| r.metric.starts_with("TTFT"))
        .all(|r| r.error.abs() <= TTFT_TARGET);
    s.push_str(&format!(
        "\nTarget TTFT P50 and P99 within {}: {}.\n\n",
        upct(TTFT_TARGET),
        met(ok)
    ));
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use servelab_sim::profile::{ProfileFiles, SM100_PUBLISHED};

    const CONFIG: &str = include_str!("../../configs/conformance.toml");

    fn small(text: &str) -> String {
        // A tenth of the sessions: the test runs in a second.
        text.replace("sessions = 30", "sessions = 3")
            .replace("sessions = 20", "sessions = 2")
            .replace("system_prompts = 10", "system_prompts = 1")
    }

    fn dry_record(config: &str) -> Record {
        let file = ConformanceFile::parse(config, "conformance.toml").unwrap();
        let mut rec = hwc::dry_run(&file, SM100_PUBLISHED).unwrap();
        rec.config = config.to_string();
        rec
    }

    /// One config through the simulator's environment and through the replay of a recorded
    /// run of the GPU environment (a dry run, no GPU): the replay reproduces every plan, the
    /// simulator runs the same unit config to completion, and a record that is its own
    /// prediction has no step error.
    #[test]
    fn a_dry_record_replays_and_compares_with_the_simulator() {
        for config in [small(CONFIG), small(&wide(CONFIG))] {
            let rec = dry_record(&config);
            let profile = HardwareProfile::resolve("sm100-published").unwrap();
            let a = analyze(&rec, profile).unwrap();
            assert!(a.replay.replayable);
            assert_eq!(
                a.replay.mismatched_steps, 0,
                "{:?}",
                a.replay.first_mismatches
            );
            assert!(a.replay.outcomes_identical);
            assert_eq!(a.sims.len(), 2);
            for sim in &a.sims {
                assert_eq!(sim.completed as usize, a.requests, "{}", sim.environment);
            }
            let md = markdown(&a);
            assert!(md.contains("**0 mismatched**"), "{md}");
        }
    }

    /// The simulator's environment and the GPU environment with the cost model as its device
    /// make the same decisions where the environments agree: one prefill engine, one decode
    /// group, nothing else on the device while a step runs.
    #[test]
    fn service_config_is_the_same_unit() {
        let file = ConformanceFile::parse(&small(CONFIG), "c.toml").unwrap();
        let p = HardwareProfile::resolve("sm100-published").unwrap();
        let cfg = service_config(&file, &p).unwrap();
        assert_eq!(cfg.unit_config(&p), file.unit_config(&p).unwrap());
    }

    /// The whole unit: two prefill engines (tiered balancer) and two decode groups.
    fn wide(text: &str) -> String {
        text.replace(
            "\n[conformance.swa]",
            "\n[conformance.prefill]\ngpus = 2\nlb = { kind = \"tiered\", tier_bounds_tokens = [2048], \
             round = \"1s\", quota = \"50ms\", steal_when_idle = true }\n\n\
             [conformance.decode]\ngroups = 2\n\n[conformance.swa]",
        )
    }
}
