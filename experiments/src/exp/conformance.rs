//! Conformance analysis (SPEC §16, issue 15 item 3): a GPU record of the serving unit
//! (`servelab_hw::conformance`) against the simulator's run of the SAME unit config.
//!
//! 1. Decisions: the record replayed through the unit (`servelab_hw::env::ReplayEnv`): every
//!    plan must be identical.
//! 2. Step time, plan by plan: the simulator's cost model ([`CostModel`]) with the measured
//!    profile predicts each recorded plan (decode at the drafts the GPU verified).
//! 3. Handoff time, request by request: the measured device-to-device copy against the
//!    config's handoff link model (`[conformance.handoff]`), which the simulator uses.
//! 4. Latency: the unit's report of the GPU run against the unit's report of two simulator
//!    runs of the same config and workload: the simulator's environment
//!    (`servelab_sim::service`, `VirtualEnv` with `placement = one-gpu`: the devices share one
//!    GPU, as on the H200), and the GPU environment on the virtual clock with the cost model as
//!    its device.
//! 5. What the decode steps' predicted time is made of (the cost model's terms), and how large
//!    a uniform error of the profile the targets detect (the analysis repeated with the
//!    profile's times scaled).

use serde::Serialize;
use servelab_core::engine::{Backend, StepPlan, StepReport};
use servelab_core::profile::HardwareProfile;
use servelab_core::{ConfigError, Nanos};
use servelab_hw::backend::HandoffCopy;
use servelab_hw::clock::ClockKind;
use servelab_hw::conformance::HandoffSection;
use servelab_hw::conformance::{
    self as hwc, ConformanceError, ConformanceFile, HostOverhead, Record, ReplayCheck, percentile,
};
use servelab_hw::env::{HandoffJob, RecordedStep, RunOutcome, UnitDevice, request_outcomes};
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

/// The simulator's model of the run's placement: every device on GPUs of its own
/// (`own-gpus`), or every device on the one GPU (`one-gpu`). A placement in between (some
/// devices sharing a GPU, others not) has no model in the simulator.
fn sim_placement(file: &ConformanceFile) -> Result<Placement, ConformanceError> {
    if file.own_gpus() {
        return Ok(Placement::OwnGpus);
    }
    let p = file.placement();
    let mut lists = p.prefill.iter().chain(&p.decode);
    let first = lists.next().cloned();
    let shared =
        first.as_ref().is_none_or(|f| f.len() == 1) && lists.all(|l| Some(l) == first.as_ref());
    if shared {
        Ok(Placement::OneGpu)
    } else {
        Err(ConfigError::invalid(
            "placement",
            "the simulator models a unit whose devices all share one GPU or each have GPUs of \
             their own; this placement is neither",
        )
        .into())
    }
}

/// The service config of the conformance unit: the same [`servelab_core::unit::UnitConfig`]
/// (pools, policies, cost models), and an environment that matches one GPU host: the prefix
/// is in host memory and swapped in inside the prefill step (no store read time, overlapped
/// swap-in in the cost model), the handoff a device-to-device copy timed by the config's
/// handoff model (no link time where the pool is shared), no MoE skew, and
/// the run's placement.
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
            handoff_bytes_per_s_per_machine: if c.handoff.copy {
                c.handoff.bytes_per_s
            } else {
                instant
            },
            handoff_latency: if c.handoff.copy {
                c.handoff.latency
            } else {
                Nanos::ZERO
            },
            swa_pull_bytes_per_s: instant,
            swa_pull_latency: Nanos::ZERO,
        },
        swap_in: SwapIn::Overlapped,
        acceptance: matched_acceptance(file),
        moe: MoeImbalance::Fixed,
        arrivals: Default::default(),
        placement: sim_placement(file)?,
        warmup: unit.warmup,
        measure_until: unit.measure_until,
        series_interval: unit.series_interval,
        sample_every: unit.sample_every,
        touch_coalesce: unit.touch_coalesce,
        faults: Default::default(),
        autoscale: None,
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

/// The cost model as the GPU environment's device: steps as the simulator predicts them,
/// handoffs as the config's handoff model times them.
pub struct CostDevice {
    pub cost: CostModel,
    pub handoff: Option<HandoffSection>,
}

impl UnitDevice for CostDevice {
    fn step(&mut self, plan: &StepPlan, report: &mut StepReport) -> Result<(), String> {
        self.cost.execute(Nanos::ZERO, plan, report);
        Ok(())
    }
    fn handoff(&mut self, job: &HandoffJob) -> Result<HandoffCopy, String> {
        Ok(hwc::model_handoff(self.handoff.as_ref(), job))
    }
}

/// The handoffs of a run against the handoff model.
#[derive(Clone, Debug, Default, Serialize)]
pub struct HandoffStats {
    pub handoffs: usize,
    /// Handoffs whose copy moved something (0 when the pool is shared).
    pub copied: usize,
    /// Median bytes the unit says move, and the device copied.
    pub unit_bytes_median: f64,
    pub copied_bytes_median: f64,
    /// The copy's CUDA-event time: median and P99, µs.
    pub duration_median_us: f64,
    pub duration_p99_us: f64,
    /// The model's time for the unit's bytes, median µs.
    pub predicted_median_us: f64,
    /// |predicted / measured − 1| over the copies, and its signed median.
    pub error: ErrorStats,
    /// From the unit's request to `HandoffDone` (queue + copy): median and P99, µs.
    pub wait_median_us: f64,
    pub wait_p99_us: f64,
    /// Handoffs whose group changed between the copy and the unit's pick.
    pub rerouted: usize,
}

pub fn handoff_stats(run: &RunOutcome, model: &HandoffSection) -> HandoffStats {
    let hs = &run.handoffs;
    let copied: Vec<_> = hs.iter().filter(|h| h.duration_ns > 0).collect();
    let us = |v: Vec<f64>, q: f64| percentile(&v, q) / 1e3;
    let pairs: Vec<(f64, f64)> = copied
        .iter()
        .map(|h| (h.duration_ns as f64, model.predict_ns(h.unit_bytes)))
        .collect();
    let wait: Vec<f64> = hs
        .iter()
        .filter(|h| h.end_ns > 0)
        .map(|h| (h.end_ns - h.start_ns) as f64)
        .collect();
    HandoffStats {
        handoffs: hs.len(),
        copied: copied.len(),
        unit_bytes_median: percentile(
            &hs.iter().map(|h| h.unit_bytes as f64).collect::<Vec<_>>(),
            0.5,
        ),
        copied_bytes_median: percentile(
            &copied.iter().map(|h| h.bytes as f64).collect::<Vec<_>>(),
            0.5,
        ),
        duration_median_us: us(pairs.iter().map(|p| p.0).collect(), 0.5),
        duration_p99_us: us(pairs.iter().map(|p| p.0).collect(), 0.99),
        predicted_median_us: us(pairs.iter().map(|p| p.1).collect(), 0.5),
        error: error_stats(&pairs),
        wait_median_us: us(wait.clone(), 0.5),
        wait_p99_us: us(wait, 0.99),
        rerouted: hs
            .iter()
            .filter(|h| {
                h.picked
                    .is_some_and(|g| h.to != servelab_core::unit::DeviceId::Decode(g))
            })
            .count(),
    }
}

/// Shares of the decode steps' predicted time by cost-model term, summed over the recorded
/// decode steps (each share: the time the prediction loses without that term).
#[derive(Clone, Debug, Default, Serialize)]
pub struct DecodeTerms {
    pub steps: usize,
    pub predicted_ms: f64,
    /// Per KV token summed over the sequences, and per KV token of the longest one.
    pub kv: f64,
    pub base: f64,
    pub per_seq: f64,
    /// Per query token and per query token squared.
    pub tokens: f64,
    pub experts: f64,
    /// Sequences per decode step: median, P10 and P90.
    pub batch_median: f64,
    pub batch_p10: f64,
    pub batch_p90: f64,
    /// KV tokens per sequence over the decode steps: median.
    pub kv_per_seq_median: f64,
}

pub fn decode_terms(
    model: &servelab_core::engine::DecodeTimeModel,
    steps: &[RecordedStep],
) -> DecodeTerms {
    let decode: Vec<&RecordedStep> = steps
        .iter()
        .filter(|s| matches!(s.plan, StepPlan::Decode(_)))
        .collect();
    let total = |m: &servelab_core::engine::DecodeTimeModel| -> f64 {
        decode
            .iter()
            .filter_map(|s| hwc::predict_decode_ns(m, s))
            .sum()
    };
    let full = total(model);
    let without = |f: &dyn Fn(&mut servelab_core::engine::DecodeTimeModel)| {
        let mut m = model.clone();
        f(&mut m);
        if full > 0.0 {
            1.0 - total(&m) / full
        } else {
            0.0
        }
    };
    let batch: Vec<f64> = decode
        .iter()
        .filter_map(|s| match &s.plan {
            StepPlan::Decode(d) => Some(d.seqs.len() as f64),
            _ => None,
        })
        .collect();
    let kv_per_seq: Vec<f64> = decode
        .iter()
        .flat_map(|s| match &s.plan {
            StepPlan::Decode(d) => d.seqs.iter().map(|q| f64::from(q.kv_tokens)).collect(),
            _ => Vec::new(),
        })
        .collect();
    DecodeTerms {
        steps: decode.len(),
        predicted_ms: full / 1e6,
        kv: without(&|m| {
            m.per_kv_token_ns = 0.0;
            m.per_max_kv_token_ns = 0.0;
        }),
        base: without(&|m| m.base_ns = 0.0),
        per_seq: without(&|m| m.per_seq_ns = 0.0),
        tokens: without(&|m| {
            m.per_token_ns = 0.0;
            m.per_token_sq_ns = 0.0;
        }),
        experts: without(&|m| m.active_experts = None),
        batch_median: percentile(&batch, 0.5),
        batch_p10: percentile(&batch, 0.1),
        batch_p90: percentile(&batch, 0.9),
        kv_per_seq_median: percentile(&kv_per_seq, 0.5),
    }
}

/// `p` with every time scaled by `factor` (rates divided by it): a uniform profile error.
pub fn scaled_profile(p: &HardwareProfile, factor: f64) -> HardwareProfile {
    let mut q = p.clone();
    q.name = format!("{} x {factor}", p.name);
    let pre = &mut q.prefill;
    pre.base_ns *= factor;
    pre.per_layer_token_ns *= factor;
    pre.per_layer_token_ctx_ns *= factor;
    pre.per_layer_replay_ctx_ns *= factor;
    if let Some(a) = &mut pre.active_experts {
        a.per_expert_ns *= factor;
    }
    let d = &mut q.decode;
    d.base_ns *= factor;
    d.per_seq_ns *= factor;
    d.per_kv_token_ns *= factor;
    d.per_max_kv_token_ns *= factor;
    d.per_token_ns *= factor;
    d.per_token_sq_ns *= factor;
    d.dynamic_overhead_ns *= factor;
    if let Some(a) = &mut d.active_experts {
        a.per_expert_ns *= factor;
    }
    q.transfer.swap_in_bytes_per_s /= factor;
    q.transfer.sync_gap = Nanos((q.transfer.sync_gap.0 as f64 * factor).round() as u64);
    q
}

/// The targets with the profile scaled by `factor`.
#[derive(Clone, Debug, Serialize)]
pub struct Sensitivity {
    pub factor: f64,
    pub step_median: f64,
    /// TTFT P50 and P99 errors against the simulator's environment.
    pub ttft_p50: f64,
    pub ttft_p99: f64,
    pub passes: bool,
}

/// The config a record ran with, its handoff timing model replaced by `handoff` when given.
/// Only the timing moves: whether the GPU copied (`copy`) is what the record did, so a model
/// for the other layout is refused.
fn record_file(
    record: &Record,
    handoff: Option<&HandoffSection>,
) -> Result<ConformanceFile, ConformanceError> {
    let mut file = ConformanceFile::parse(&record.config, "record.config")?;
    if let Some(h) = handoff {
        if h.copy != file.conformance.handoff.copy {
            return Err(ConformanceError::Config(ConfigError::invalid(
                "conformance.handoff.copy",
                format!(
                    "the record ran with copy = {}; a handoff model for copy = {} cannot time it",
                    file.conformance.handoff.copy, h.copy
                ),
            )));
        }
        h.validate()?;
        file.conformance.handoff = h.clone();
    }
    Ok(file)
}

/// The scale factors the sensitivity table tries.
pub const SENSITIVITY_FACTORS: [f64; 6] = [0.90, 0.95, 0.97, 1.03, 1.05, 1.10];

pub fn sensitivity(
    record: &Record,
    profile: &HardwareProfile,
    handoff: Option<&HandoffSection>,
    factors: &[f64],
) -> Result<Vec<Sensitivity>, ConformanceError> {
    let file = record_file(record, handoff)?;
    let reqs = hwc::workload(&file)?;
    let mut rows = Vec::new();
    for &factor in factors {
        let p = scaled_profile(profile, factor);
        let steps = step_errors(&prediction_cost(&file, p.clone())?, &record.run.steps);
        let sims = simulate(&file, &p, &reqs, &record.run)?;
        let ttft = |label: &str| {
            sims[0]
                .latency
                .iter()
                .find(|r| r.metric == label)
                .map_or(0.0, |r| r.error)
        };
        let (p50, p99) = (ttft("TTFT P50"), ttft("TTFT P99"));
        rows.push(Sensitivity {
            factor,
            step_median: steps.all.abs_median,
            ttft_p50: p50,
            ttft_p99: p99,
            passes: steps.all.abs_median <= STEP_ERROR_MEDIAN_TARGET
                && p50.abs() <= TTFT_TARGET
                && p99.abs() <= TTFT_TARGET,
        });
    }
    Ok(rows)
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
    /// EP ranks of each decode group (its GPUs in the placement).
    pub decode_ranks: u32,
    /// Where the devices ran: "all on the one GPU", or the placement's GPU count.
    pub placement: String,
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
    pub handoffs: HandoffStats,
    /// The same for the GPU environment's run with the cost model as its device.
    pub model_handoffs: HandoffStats,
    /// The handoff timing model the simulator used (`[conformance.handoff]`).
    pub handoff_model: HandoffSection,
    pub decode_terms: DecodeTerms,
    /// The simulator's environment, then the GPU environment with the cost model as device.
    pub sims: Vec<SimRun>,
    /// The targets under uniformly scaled profiles (empty unless asked for).
    pub sensitivity: Vec<Sensitivity>,
}

/// Replays, predicts and simulates a record. `profile` is what the simulator predicts with
/// (normally the policies' profile, i.e. the one measured on the same GPU).
/// `handoff` replaces the record's handoff timing model (the simulator's side, like `profile`);
/// None keeps the one the record ran with.
pub fn analyze(
    record: &Record,
    profile: HardwareProfile,
    handoff: Option<&HandoffSection>,
) -> Result<Analysis, ConformanceError> {
    let file = record_file(record, handoff)?;
    let policy = hwc::parse_profile(&record.policy_profile, "record.profile")?;
    let reqs = hwc::workload(&file)?;
    let replay = hwc::replay_check(&file, &policy, &reqs, &record.run)?;
    let step_errors = step_errors(&prediction_cost(&file, profile.clone())?, &record.run.steps);
    let (sims, model_run) = simulate_with_run(&file, &profile, &reqs, &record.run)?;
    let run = &record.run;
    let hand = &file.conformance.handoff;
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
        decode_ranks: file.decode_ranks(),
        placement: placement_words(&file),
        clock: run.clock,
        pinned_cpu: run.pinned_cpu,
        gpu_run_ms: run.end_ns as f64 / 1e6,
        device_ms: run.steps.iter().map(|s| s.duration_ns as f64).sum::<f64>() / 1e6,
        hit_tokens: run.requests.iter().map(|r| u64::from(r.hit_tokens)).sum(),
        prompt_tokens: reqs.iter().map(|r| u64::from(r.prompt_tokens)).sum(),
        host: hwc::host_overhead(run),
        replay,
        step_errors,
        handoffs: handoff_stats(run, hand),
        model_handoffs: handoff_stats(&model_run, hand),
        handoff_model: hand.clone(),
        decode_terms: decode_terms(&profile.decode, &run.steps),
        sims,
        sensitivity: Vec::new(),
    })
}

/// The two simulator runs of the record's config, compared with the GPU run.
fn simulate(
    file: &ConformanceFile,
    profile: &HardwareProfile,
    reqs: &[servelab_core::Request],
    gpu: &RunOutcome,
) -> Result<Vec<SimRun>, ConformanceError> {
    Ok(simulate_with_run(file, profile, reqs, gpu)?.0)
}

/// [`simulate`], and the GPU environment's run with the cost model as its device.
fn simulate_with_run(
    file: &ConformanceFile,
    profile: &HardwareProfile,
    reqs: &[servelab_core::Request],
    gpu: &RunOutcome,
) -> Result<(Vec<SimRun>, RunOutcome), ConformanceError> {
    let seed = servelab_core::seed::sub_seed(file.seed()?, "conformance.sim");
    let cfg = service_config(file, profile)?;
    let report = servelab_sim::service::run_with_profile(&cfg, profile.clone(), reqs, seed)
        .map_err(|e| ConformanceError::Device(format!("simulator: {e}")))?;
    let mut sim = gpu.clone();
    sim.requests = request_outcomes(reqs, &report.requests);
    let service = SimRun {
        environment: if file.own_gpus() {
            "simulator (VirtualEnv, each device on GPUs of its own)"
        } else {
            "simulator (VirtualEnv, the devices on one GPU)"
        },
        run_ms: report.simulated_s * 1e3,
        completed: report.completed,
        rejected: report.rejected_total(),
        latency: latency_comparison(gpu, &sim),
    };
    let hand = &file.conformance.handoff;
    let mut device = CostDevice {
        cost: prediction_cost(file, profile.clone())?,
        handoff: hand.copy.then(|| hand.clone()),
    };
    let (shared, report) = hwc::run_virtual(file, profile, reqs, &mut device)?;
    let one_gpu = SimRun {
        environment: if file.own_gpus() {
            "GPU environment, cost-model device (the run's placement)"
        } else {
            "GPU environment, cost-model device (devices share one GPU)"
        },
        run_ms: shared.end_ns as f64 / 1e6,
        completed: report.completed,
        rejected: report.rejected_total(),
        latency: latency_comparison(gpu, &shared),
    };
    Ok((vec![service, one_gpu], shared))
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
    s.push_str(&handoff_table(
        &a.handoffs,
        &a.model_handoffs,
        &a.handoff_model,
    ));
    for sim in &a.sims {
        s.push_str(&latency_table(sim));
    }
    s.push_str(&terms_table(&a.decode_terms));
    if !a.sensitivity.is_empty() {
        s.push_str(&sensitivity_table(&a.sensitivity));
    }
    s
}

fn handoff_table(h: &HandoffStats, model: &HandoffStats, m: &HandoffSection) -> String {
    let mut s = String::from(
        "## 3. Handoff, request by request (device-to-device copy vs the handoff model)\n\n",
    );
    if h.copied == 0 {
        s.push_str(&format!(
            "{} handoffs, none copied (one shared pool, or a record from before the split).\n\n",
            h.handoffs
        ));
        return s;
    }
    s.push_str(&format!(
        "{} handoffs, {} copied; median {:.2} MB per handoff as the unit counts it, {:.2} MB \
         copied (whole blocks and the SWA ring); {} re-routed (the unit picked another group \
         than the copy went to).\n\n\
         | quantity | GPU | model |\n|---|---|---|\n\
         | copy time median µs | {:.1} | {:.1} |\n\
         | copy time P99 µs | {:.1} | {:.1} |\n\
         | ask to HandoffDone median µs | {:.1} | {:.1} |\n\
         | ask to HandoffDone P99 µs | {:.1} | {:.1} |\n\n\
         Copy time per handoff, model ({:.1} µs + bytes / {:.3e} B/s) vs measured: median abs \
         error {}, P90 {}, median signed {}.\n\n",
        h.handoffs,
        h.copied,
        h.unit_bytes_median / 1e6,
        h.copied_bytes_median / 1e6,
        h.rerouted,
        h.duration_median_us,
        h.predicted_median_us,
        h.duration_p99_us,
        model.duration_p99_us,
        h.wait_median_us,
        model.wait_median_us,
        h.wait_p99_us,
        model.wait_p99_us,
        m.latency.as_secs_f64() * 1e6,
        m.bytes_per_s,
        upct(h.error.abs_median),
        upct(h.error.abs_p90),
        pct(h.error.signed_median),
    ));
    s
}

fn terms_table(t: &DecodeTerms) -> String {
    format!(
        "## 5. What decode time is made of (the cost model's terms over the recorded decode \
         steps)\n\n{} decode steps, {:.1} ms predicted; sequences per step median {:.0} (P10 \
         {:.0}, P90 {:.0}); KV tokens per sequence median {:.0}.\n\n\
         | term | share of predicted decode time |\n|---|---|\n\
         | KV (per KV token, and per KV token of the longest sequence) | {} |\n\
         | base | {} |\n| per sequence | {} |\n| per query token | {} |\n\
         | active experts | {} |\n\n",
        t.steps,
        t.predicted_ms,
        t.batch_median,
        t.batch_p10,
        t.batch_p90,
        t.kv_per_seq_median,
        upct(t.kv),
        upct(t.base),
        upct(t.per_seq),
        upct(t.tokens),
        upct(t.experts),
    )
}

fn sensitivity_table(rows: &[Sensitivity]) -> String {
    let mut s = String::from(
        "## 6. Sensitivity: the targets with every time of the profile scaled\n\n\
         | scale | step-time median error | TTFT P50 | TTFT P99 | targets |\n|---|---|---|---|---|\n",
    );
    for r in rows {
        s.push_str(&format!(
            "| {:.2} | {} | {} | {} | {} |\n",
            r.factor,
            upct(r.step_median),
            pct(r.ttft_p50),
            pct(r.ttft_p99),
            if r.passes { "pass" } else { "**fail**" }
        ));
    }
    s.push('\n');
    s
}

/// The run's placement in words for the report.
fn placement_words(file: &ConformanceFile) -> String {
    let p = file.placement();
    if file.own_gpus() {
        format!("each on GPUs of its own ({} logical GPUs)", p.gpus)
    } else if p.gpus == 1 {
        "all on the one GPU".to_string()
    } else {
        format!("placed on {} logical GPUs, some shared", p.gpus)
    }
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
                               (steps queued FIFO on each GPU); host time is not counted.\n\n"
            .to_string(),
    };
    format!(
        "# Conformance: the serving unit on the GPU vs in the simulator (SPEC §16)\n\n\
         GPU: {}; date {}; commit {}; profile `{}`.\n\n\
         Unit: {} prefill engine(s) and {} decode group(s) of {} rank(s), {}. \
         {} requests, {} prompt tokens ({} hit, {:.1}%); {} steps ({} prefill, {} decode); \
         GPU run {:.1} ms on its clock ({:.1} ms of device time in steps).\n\n{clock}",
        a.gpu,
        a.date,
        a.commit,
        a.profile,
        a.prefill_engines,
        a.decode_groups,
        a.decode_ranks,
        a.placement,
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
        "## 4. Latency: GPU run vs {} ({:.1} ms, {} completed, {} rejected)\n\n\
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
            let a = analyze(&rec, profile, None).unwrap();
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

    /// The simulator models the run's placement: the one GPU without `[placement]` (or with
    /// every device on one GPU), `own-gpus` where no GPU holds two devices, and no model for
    /// a placement in between.
    #[test]
    fn the_simulator_takes_the_runs_placement() {
        let p = HardwareProfile::resolve("sm100-published").unwrap();
        let placed = |table: &str| {
            let text = format!("{}\n[placement]\n{table}", wide(&small(CONFIG)));
            ConformanceFile::parse(&text, "placed.toml").unwrap()
        };
        let plain = ConformanceFile::parse(&wide(&small(CONFIG)), "c.toml").unwrap();
        assert_eq!(
            service_config(&plain, &p).unwrap().placement,
            Placement::OneGpu
        );
        let own = placed("gpus = 4\nprefill = [[0], [1]]\ndecode = [[2], [3]]\n");
        assert_eq!(
            service_config(&own, &p).unwrap().placement,
            Placement::OwnGpus
        );
        let one = placed("gpus = 1\nprefill = [[0], [0]]\ndecode = [[0], [0]]\n");
        assert_eq!(
            service_config(&one, &p).unwrap().placement,
            Placement::OneGpu
        );
        let mixed = placed("gpus = 3\nprefill = [[0], [0]]\ndecode = [[1], [2]]\n");
        let e = service_config(&mixed, &p).unwrap_err().to_string();
        assert!(e.contains("placement") && e.contains("neither"), "{e}");
    }
}
