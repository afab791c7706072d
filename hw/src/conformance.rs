//! Conformance (issue 6 item 5, issue 15, SPEC §16): one workload through the serving unit of
//! `servelab_core::unit` on the GPU, recorded so that it can be replayed and compared with the
//! simulator's run of the same unit (the comparison lives in `servelab-experiments`, which
//! has the simulator; this crate does not depend on it).
//!
//! The `[conformance]` section maps onto a [`UnitConfig`] ([`ConformanceFile::unit_config`]):
//! a prefill pool of `prefill.gpus` engines and a decode pool of `decode.groups` one-rank
//! groups, every one of them a device of the unit sharing the one GPU ([`crate::env`]). One
//! engine and one group reproduce the one-device conformance run of before the unit; two and
//! two put the tiered prefill balancer and the count + KV decode balancer to work. The
//! model-shaped serving constants (layers, window, block size, KV bytes per token) are taken
//! from `[backend.model]`, so hits, chunks and swap-in sizes describe the model the GPU runs.

use serde::{Deserialize, Serialize};
use servelab_core::engine::{
    ChunkPolicy, DecodeLbPolicy, DecodeTimeModel, PrefillLbPolicy, Scheduling, StepPlan,
    StepReport, VerificationPolicy,
};
use servelab_core::profile::HardwareProfile;
use servelab_core::unit::drive::NoObserver;
use servelab_core::unit::{
    DecodePoolConfig, Environment, PrefillPoolConfig, ServiceReport, ServingUnit, SharedCache,
    UnitConfig,
};
use servelab_core::{
    ConfigError, EngineId, HitPolicy, Nanos, Request, RequestId, ServingConstants, StoreConfig,
    SwaConfig,
};
use servelab_workloads::generate::WorkloadConfig;

use crate::backend::{BackendConfig, CudaBackend, ModelShape};
use crate::clock::WallDevice;
use crate::env::{GpuEnv, HandoffJob, ReplayEnv, RunOutcome, UnitDevice, request_outcomes};
use crate::multi_gpu::{DeviceMap, MultiGpuDevice};
use crate::placement::{PlacementConfig, UnitShape};

/// The conformance config file (`experiments/configs/conformance.toml`).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConformanceFile {
    /// The `[experiment]` header every servelab config carries; only `seed` is read here.
    #[serde(default)]
    pub experiment: Option<toml::Table>,
    pub conformance: ConformanceConfig,
    #[serde(default)]
    pub backend: BackendConfig,
    pub workload: WorkloadConfig,
    /// The GPUs of each prefill engine and decode group (absent: every device on the one GPU).
    /// A decode group's GPUs are its EP ranks.
    #[serde(default)]
    pub placement: Option<PlacementConfig>,
}

/// The unit's policies for the run.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ConformanceConfig {
    /// Hardware profile (shipped name or `.toml` path): the cost models the chunk scheduler,
    /// the balancer and the DSpark budget use, and what the simulator predicts with.
    pub profile: String,
    #[serde(default = "deepinfer")]
    pub hit_policy: HitPolicy,
    /// Tokens DSpark drafts per step (SPEC §10: 5).
    #[serde(default = "five")]
    pub draft_tokens: u32,
    /// Decoder-side bounded replay (SPEC §2: 140).
    #[serde(default = "replay_140")]
    pub decoder_replay_tokens: u32,
    #[serde(default)]
    pub store: StoreConfig,
    #[serde(default)]
    pub swa: SwaConfig,
    /// `prefill.chunking` of the unit.
    pub chunking: ChunkPolicy,
    /// `prefill.max_jobs_per_engine`.
    pub max_prefill_jobs: u32,
    /// `decode.max_seqs_per_rank`.
    pub max_seqs: u32,
    /// `decode.kv_capacity_tokens_per_rank`.
    pub kv_capacity_tokens: u64,
    /// `decode.max_waiting_per_rank`.
    pub max_waiting: u32,
    pub verification: VerificationPolicy,
    #[serde(default)]
    pub prefill: PrefillSection,
    #[serde(default)]
    pub decode: DecodeSection,
    #[serde(default)]
    pub handoff: HandoffSection,
    /// Throwaway plans run on the GPU before the recorded run (cuBLAS heuristics, allocator).
    #[serde(default = "warmups")]
    pub warmup_steps: u32,
    /// Seed of a whole throwaway run of the workload before the recorded one (absent: none):
    /// the ladder of `warmup_steps` does not warm everything a long run touches (prefill steps
    /// early in a run took up to twice their later time without it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup_run_seed: Option<u64>,
}

/// The unit's prefill pool on the one GPU.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrefillSection {
    /// Prefill engines (devices of the unit sharing the GPU).
    pub gpus: u32,
    /// With one engine the push balancer queues what the engine cannot take yet, as the
    /// one-device loop's backlog did.
    pub lb: PrefillLbPolicy,
    pub max_queued_requests: u32,
}

impl Default for PrefillSection {
    fn default() -> Self {
        PrefillSection {
            gpus: 1,
            lb: PrefillLbPolicy::LeastLoaded,
            max_queued_requests: 100_000,
        }
    }
}

/// The unit's decode pool: one-rank EP groups on the one GPU.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct DecodeSection {
    pub groups: u32,
    pub lb: DecodeLbPolicy,
    /// Synchronous (the next plan after the report) unless set: the GPU run's host planning is
    /// real time, the profile's `sync_gap` is what the simulator adds for it.
    pub scheduling: Scheduling,
}

impl Default for DecodeSection {
    fn default() -> Self {
        DecodeSection {
            groups: 1,
            lb: DecodeLbPolicy::CountAndKv,
            scheduling: Scheduling::Sync,
        }
    }
}

/// The handoff from a prefill engine to a decode group on the one GPU.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct HandoffSection {
    /// Each prefill engine and decode group keeps its own KV region of the backend's pool and
    /// the handoff copies the request's KV blocks and SWA ring between them (device to
    /// device); false: one shared pool, the handoff answered at once.
    pub copy: bool,
    /// The simulator's handoff link for this GPU (`LinkConfig`): bytes per second of the
    /// device-to-device copy, and its fixed cost per handoff (id uploads, launch, events).
    pub bytes_per_s: f64,
    pub latency: Nanos,
}

impl Default for HandoffSection {
    /// The H200's device-to-device copy (4.26 TB/s counting reads and writes, so 2.13 TB/s of
    /// bytes moved; /work GPU notes) and a fixed cost of a few launches.
    fn default() -> Self {
        HandoffSection {
            copy: true,
            bytes_per_s: 2.13e12,
            latency: Nanos::from_micros(30),
        }
    }
}

impl HandoffSection {
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(self.bytes_per_s.is_finite() && self.bytes_per_s > 0.0) {
            return Err(ConfigError::invalid(
                "conformance.handoff.bytes_per_s",
                format!("{} must be a positive number", self.bytes_per_s),
            ));
        }
        Ok(())
    }

    /// The modelled time of a handoff of `bytes`.
    pub fn predict_ns(&self, bytes: u64) -> f64 {
        self.latency.0 as f64 + bytes as f64 / self.bytes_per_s * 1e9
    }
}

fn deepinfer() -> HitPolicy {
    HitPolicy::Deepinfer
}
fn five() -> u32 {
    5
}
fn replay_140() -> u32 {
    140
}
fn warmups() -> u32 {
    3
}

/// Parses a hardware profile's TOML text (the text a record carries; files and shipped names
/// are resolved by the caller).
pub fn parse_profile(text: &str, origin: &str) -> Result<HardwareProfile, ConfigError> {
    let p: HardwareProfile = toml::from_str(text)
        .map_err(|e| ConfigError::invalid(origin, e.to_string().trim_end().to_string()))?;
    p.validate()?;
    Ok(p)
}

impl ConformanceFile {
    pub fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let f: ConformanceFile = toml::from_str(text)
            .map_err(|e| ConfigError::invalid(origin, e.to_string().trim_end().to_string()))?;
        f.backend_config().validate()?;
        f.conformance.handoff.validate()?;
        f.workload.validate()?;
        if let Some(p) = &f.placement {
            p.validate("placement", f.unit_shape(), None)?;
        }
        Ok(f)
    }

    /// The unit's devices as a placement must cover them (a decode group's ranks are its GPUs).
    fn unit_shape(&self) -> UnitShape {
        UnitShape {
            prefill_engines: self.conformance.prefill.gpus,
            decode_groups: self.conformance.decode.groups,
            decode_ranks: None,
        }
    }

    /// The run's placement: `[placement]`, or every device on the one GPU.
    pub fn placement(&self) -> PlacementConfig {
        self.placement.clone().unwrap_or_else(|| {
            PlacementConfig::shared(
                self.conformance.prefill.gpus,
                self.conformance.decode.groups,
            )
        })
    }

    /// EP ranks of each decode group: its GPUs in the placement (1 on the one GPU).
    pub fn decode_ranks(&self) -> u32 {
        self.placement
            .as_ref()
            .and_then(|p| p.decode.first())
            .map_or(1, |g| g.len() as u32)
    }

    /// Whether every device of the unit has GPUs of its own, so the simulator's matching
    /// model is its `own-gpus` placement (otherwise `one-gpu`: devices share the GPU).
    pub fn own_gpus(&self) -> bool {
        self.placement
            .as_ref()
            .is_some_and(PlacementConfig::own_gpus)
    }

    /// Checks the placement's physical ordinals against the machine's `devices` GPUs.
    pub fn check_placement_fits(&self, devices: usize) -> Result<(), ConfigError> {
        match &self.placement {
            Some(p) => p.validate("placement", self.unit_shape(), Some(devices)),
            None => Ok(()),
        }
    }

    /// The backend the GPU runs: `[backend]`, its pool split into one region per device of
    /// the unit when the handoff copies.
    pub fn backend_config(&self) -> BackendConfig {
        let mut b = self.backend.clone();
        if self.conformance.handoff.copy {
            b.unit_devices = Some((
                self.conformance.prefill.gpus,
                self.conformance.decode.groups,
            ));
        }
        b
    }

    /// The run's seed: `[experiment] seed` (42 when absent, as for every servelab config).
    pub fn seed(&self) -> Result<u64, ConfigError> {
        match self.experiment.as_ref().and_then(|t| t.get("seed")) {
            None => Ok(42),
            Some(toml::Value::Integer(s)) if *s >= 0 => Ok(*s as u64),
            Some(v) => Err(ConfigError::invalid(
                "experiment.seed",
                format!("{v} is not a non-negative integer"),
            )),
        }
    }

    /// The serving constants of the scaled-down model.
    pub fn constants(&self) -> Result<ServingConstants, ConfigError> {
        constants_for(&self.backend.model, &self.conformance)
    }

    /// The unit the config describes, with `profile`'s cost models; every request measured,
    /// every request in the report's table.
    pub fn unit_config(&self, profile: &HardwareProfile) -> Result<UnitConfig, ConfigError> {
        let c = &self.conformance;
        if !matches!(
            c.hit_policy,
            HitPolicy::Deepinfer | HitPolicy::SwaOnSsd | HitPolicy::VllmEncoderReplay
        ) {
            return Err(ConfigError::invalid(
                "conformance.hit_policy",
                format!(
                    "`{}` needs a perfect cache or a decoder-only model; the GPU model is the \
                     encoder-decoder one (use deepinfer, swa-on-ssd or vllm-encoder-replay)",
                    c.hit_policy.name()
                ),
            ));
        }
        let unit = UnitConfig {
            constants: self.constants()?,
            hit_policy: c.hit_policy,
            prefill: PrefillPoolConfig {
                gpus: c.prefill.gpus,
                gpus_per_machine: 8,
                chunking: c.chunking.clone(),
                lb: c.prefill.lb.clone(),
                max_jobs_per_engine: c.max_prefill_jobs,
                max_queued_requests: c.prefill.max_queued_requests,
                expert_imbalance: 1.0,
            },
            decode: DecodePoolConfig {
                groups: c.decode.groups,
                gpus_per_machine: 8,
                ranks: self.decode_ranks(),
                max_seqs_per_rank: c.max_seqs,
                kv_capacity_tokens_per_rank: c.kv_capacity_tokens,
                max_waiting_per_rank: c.max_waiting,
                verification: c.verification.clone(),
                scheduling: c.decode.scheduling,
                lb: c.decode.lb,
                expert_imbalance: 1.0,
            },
            prefill_cost: profile.prefill.clone(),
            decode_time: profile.decode.clone(),
            sync_gap: profile.transfer.sync_gap,
            warmup: Nanos::ZERO,
            measure_until: None,
            series_interval: Nanos::from_secs(1),
            sample_every: 1,
            touch_coalesce: Nanos::ZERO,
            elastic: Default::default(),
            autoscale: None,
        };
        unit.validate().map_err(|e| prefixed(e, "conformance"))?;
        if c.swa.machines < unit.machines() {
            return Err(ConfigError::invalid(
                "conformance.swa.machines",
                format!(
                    "{} machines hold SWA state but the unit has {} (prefill + decode)",
                    c.swa.machines,
                    unit.machines()
                ),
            ));
        }
        Ok(unit)
    }

    /// The store and SWA cache the unit reads and writes.
    pub fn shared_cache(&self) -> Result<SharedCache, ConfigError> {
        let k = self.constants()?;
        SharedCache::new(
            self.conformance.store.clone(),
            self.conformance.swa.clone(),
            k.block_bytes(),
        )
    }
}

fn prefixed(e: ConfigError, section: &str) -> ConfigError {
    ConfigError::invalid(section, e.to_string())
}

/// Serving constants of the scaled-down model: SPEC §2 defaults with the model's dimensions.
pub fn constants_for(
    m: &ModelShape,
    c: &ConformanceConfig,
) -> Result<ServingConstants, ConfigError> {
    let k = ServingConstants {
        window_tokens: m.window as u32,
        block_tokens: m.block_size as u32,
        draft_tokens: c.draft_tokens,
        backtrack_tokens: c.draft_tokens + 1,
        decoder_replay_tokens: c.decoder_replay_tokens,
        encoder_layers: m.encoder_layers as u32,
        decoder_layers: m.decoder_layers as u32,
        kv_bytes_per_token: (m.block_bytes() / m.block_size) as u32,
        swa_state_layers: m.encoder_layers as u32,
        ..ServingConstants::default()
    };
    k.validate()?;
    Ok(k)
}

/// What a GPU run leaves behind: enough to replay and analyse it anywhere.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Record {
    /// The config file's text.
    pub config: String,
    /// The profile the policies used (its TOML text).
    pub policy_profile: String,
    pub gpu: String,
    pub date: String,
    pub commit: String,
    pub run: RunOutcome,
}

/// Why a GPU conformance run failed.
#[derive(Debug, thiserror::Error)]
pub enum ConformanceError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Backend(#[from] crate::backend::BackendError),
    #[error("{0}")]
    Run(#[from] servelab_core::unit::RunError),
    #[error("device: {0}")]
    Device(String),
}

/// The generated workload of a config (ids = arrival order).
pub fn workload(file: &ConformanceFile) -> Result<Vec<Request>, ConfigError> {
    workload_with_seed(file, file.seed()?)
}

/// The config's workload under `seed` instead of its own.
pub fn workload_with_seed(file: &ConformanceFile, seed: u64) -> Result<Vec<Request>, ConfigError> {
    let trace = servelab_workloads::generate::generate(
        &file.workload,
        seed,
        file.backend.model.block_size as u32,
    )?;
    if let Some((i, r)) = trace
        .requests
        .iter()
        .enumerate()
        .find(|(i, r)| r.id.0 != *i as u64)
    {
        return Err(ConfigError::invalid(
            "workload",
            format!(
                "request {} at index {i}: ids must be 0..n in arrival order",
                r.id
            ),
        ));
    }
    Ok(trace.requests)
}

/// Runs the config's unit over `reqs` in the environment `make_env` builds, through the one
/// driver loop; the environment's record gets the report's request table.
pub fn run_unit<E: Environment>(
    file: &ConformanceFile,
    profile: &HardwareProfile,
    reqs: &[Request],
    make_env: impl FnOnce(&ServingUnit) -> E,
    into_run: impl FnOnce(E) -> RunOutcome,
) -> Result<(RunOutcome, ServiceReport), ConformanceError> {
    let mut unit = ServingUnit::new(file.unit_config(profile)?, reqs)?;
    let mut shared = file.shared_cache()?;
    let mut env = make_env(&unit);
    let end = servelab_core::unit::run(&mut unit, &mut shared, &mut env, &mut NoObserver)?;
    let report = unit.finish(&shared, end.end, end.inputs)?;
    let mut run = into_run(env);
    run.requests = request_outcomes(reqs, &report.requests);
    Ok((run, report))
}

/// The unit on the virtual clock, `device` running each plan and handoff.
pub fn run_virtual(
    file: &ConformanceFile,
    profile: &HardwareProfile,
    reqs: &[Request],
    device: &mut dyn UnitDevice,
) -> Result<(RunOutcome, ServiceReport), ConformanceError> {
    run_unit(
        file,
        profile,
        reqs,
        |u| match &file.placement {
            Some(p) => GpuEnv::virtual_placed(device, u, p.clone()),
            None => GpuEnv::virtual_clock(device, u),
        },
        GpuEnv::finish,
    )
}

/// Result of replaying a record through the unit.
#[derive(Clone, Debug, Serialize)]
pub struct ReplayCheck {
    pub recorded_steps: usize,
    pub replayed_steps: usize,
    pub mismatched_steps: usize,
    /// Handoffs in the record, and asked for by the replay (checked one by one: request, size,
    /// time).
    #[serde(default)]
    pub recorded_handoffs: usize,
    #[serde(default)]
    pub replayed_handoffs: usize,
    /// The first few mismatches, described.
    pub first_mismatches: Vec<String>,
    /// Request outcomes (first and last token times) identical to the recorded run.
    pub outcomes_identical: bool,
    /// False for records of the engine loop before the serving unit (no input log).
    pub replayable: bool,
}

/// Feeds `recorded`'s inputs back to the config's unit ([`ReplayEnv`]) and compares every
/// launched plan with the record's, and the request outcomes.
pub fn replay_check(
    file: &ConformanceFile,
    profile: &HardwareProfile,
    reqs: &[Request],
    recorded: &RunOutcome,
) -> Result<ReplayCheck, ConformanceError> {
    if recorded.inputs.is_empty() {
        return Ok(ReplayCheck {
            recorded_steps: recorded.steps.len(),
            replayed_steps: 0,
            mismatched_steps: 0,
            recorded_handoffs: recorded.handoffs.len(),
            replayed_handoffs: 0,
            first_mismatches: vec![
                "no input log: recorded by the one-device engine loop before the serving unit"
                    .into(),
            ],
            outcomes_identical: false,
            replayable: false,
        });
    }
    let mut out = (0, 0, Vec::new());
    let replay = run_unit(
        file,
        profile,
        reqs,
        |_| ReplayEnv::new(recorded),
        |env| {
            out = (env.launches(), env.handoffs(), env.mismatches);
            RunOutcome::empty(recorded.clock)
        },
    );
    let (launches, handoffs, mut mismatches) = out;
    let outcomes_identical = match replay {
        Ok((run, _)) => run.requests == recorded.requests,
        Err(e) => {
            mismatches.push(format!("the replay failed: {e}"));
            false
        }
    };
    if launches < recorded.steps.len() {
        mismatches.push(format!(
            "the replay stopped after {launches} of {} recorded steps",
            recorded.steps.len()
        ));
    }
    Ok(ReplayCheck {
        recorded_steps: recorded.steps.len(),
        replayed_steps: launches,
        mismatched_steps: mismatches.len(),
        recorded_handoffs: recorded.handoffs.len(),
        replayed_handoffs: handoffs,
        first_mismatches: mismatches.iter().take(5).cloned().collect(),
        outcomes_identical,
        replayable: true,
    })
}

/// Replays a record with the policies' own profile (the text it carries).
pub fn replay_record(record: &Record) -> Result<ReplayCheck, ConformanceError> {
    let file = ConformanceFile::parse(&record.config, "record.config")?;
    let profile = parse_profile(&record.policy_profile, "record.profile")?;
    let reqs = workload(&file)?;
    replay_check(&file, &profile, &reqs, &record.run)
}

/// A CPU stand-in for the GPU: step times from the profile's cost models (prefill compute,
/// decode at the verified drafts), drafts verified and accepted as the CUDA backend does them
/// (budget dealt round-robin, each accepted with `draft_acceptance` while the prefix holds).
/// Handoffs take the `[conformance.handoff]` model's time for the unit's bytes when one is set.
/// For dry runs (sizing a config) and tests without a GPU.
pub struct ModelDevice {
    profile: HardwareProfile,
    acceptance: f64,
    rng: rand_chacha::ChaCha8Rng,
    handoff: Option<HandoffSection>,
}

impl ModelDevice {
    pub fn new(profile: HardwareProfile, acceptance: f64, seed: u64) -> Self {
        use rand::SeedableRng;
        ModelDevice {
            profile,
            acceptance,
            rng: rand_chacha::ChaCha8Rng::seed_from_u64(seed),
            handoff: None,
        }
    }

    /// Handoffs timed by `model` (None, or `copy = false`: answered at once).
    pub fn with_handoff(mut self, model: &HandoffSection) -> Self {
        self.handoff = model.copy.then(|| model.clone());
        self
    }

    pub fn run(&mut self, plan: &StepPlan, report: &mut StepReport) -> Result<(), String> {
        use rand::Rng;
        report.seqs.clear();
        report.ranks.clear();
        let d = match plan {
            StepPlan::Prefill(p) => {
                let ns = self.profile.prefill.step_ns(&p.chunks, p.expert_imbalance);
                report.duration = Nanos(ns.round().max(1.0) as u64);
                return Ok(());
            }
            StepPlan::Decode(d) => d,
        };
        let verified = crate::backend::deal_verified(d).map_err(|e| e.to_string())?;
        for &v in &verified {
            let v = v.min(u32::from(u8::MAX)) as u8;
            let mut accepted = 0u8;
            while accepted < v && self.rng.random::<f64>() < self.acceptance {
                accepted += 1;
            }
            report.seqs.push(servelab_core::engine::SeqOutcome {
                verified: v,
                accepted,
            });
        }
        report
            .ranks
            .extend(crate::backend::confidences(d, self.acceptance));
        let ns = decode_ns(&self.profile.decode, d, &verified);
        report.duration = Nanos(ns.round().max(1.0) as u64);
        Ok(())
    }
}

impl UnitDevice for ModelDevice {
    fn step(&mut self, plan: &StepPlan, report: &mut StepReport) -> Result<(), String> {
        self.run(plan, report)
    }
    fn handoff(&mut self, job: &HandoffJob) -> Result<crate::backend::HandoffCopy, String> {
        Ok(model_handoff(self.handoff.as_ref(), job))
    }
}

/// A handoff as `model` times it (nothing moves without a model).
pub fn model_handoff(
    model: Option<&HandoffSection>,
    job: &HandoffJob,
) -> crate::backend::HandoffCopy {
    match model {
        Some(m) => crate::backend::HandoffCopy {
            bytes: job.bytes,
            evicted_blocks: 0,
            duration_ns: m.predict_ns(job.bytes).round().max(1.0) as u64,
        },
        None => crate::backend::HandoffCopy::default(),
    }
}

/// The decode model's time of a step at the drafts each sequence verified, slowest rank.
pub fn decode_ns(
    model: &DecodeTimeModel,
    d: &servelab_core::engine::DecodePlan,
    verified: &[u32],
) -> f64 {
    d.ranks
        .iter()
        .map(|r| {
            let (a, b) = (r.seq_start as usize, r.seq_end as usize);
            let seqs = &d.seqs[a.min(d.seqs.len())..b.min(d.seqs.len())];
            let kv: u64 = seqs.iter().map(|s| u64::from(s.kv_tokens)).sum();
            let max_kv = seqs
                .iter()
                .map(|s| u64::from(s.kv_tokens))
                .max()
                .unwrap_or(0);
            let v: u32 = verified.get(a..b).map_or(0, |v| v.iter().sum());
            let n = seqs.len() as u32;
            model.predict_with_max_ns(n, kv, max_kv, n + v, d.dynamic, d.expert_imbalance)
        })
        .fold(0.0, f64::max)
}

/// The decode model's prediction of a recorded decode step, at the verification the GPU
/// actually did (None for prefill steps).
pub fn predict_decode_ns(model: &DecodeTimeModel, step: &crate::env::RecordedStep) -> Option<f64> {
    let StepPlan::Decode(d) = &step.plan else {
        return None;
    };
    let verified: Vec<u32> = step.seqs.iter().map(|o| u32::from(o.verified)).collect();
    Some(decode_ns(model, d, &verified))
}

/// The workload on the [`ModelDevice`] with the policies' own profile, on the virtual clock.
pub fn dry_run(file: &ConformanceFile, profile_text: &str) -> Result<Record, ConformanceError> {
    let profile = parse_profile(profile_text, &file.conformance.profile)?;
    let reqs = workload(file)?;
    let seed = servelab_core::seed::sub_seed(file.seed()?, "conformance.dry");
    let mut dev = ModelDevice::new(profile.clone(), file.backend.draft_acceptance, seed)
        .with_handoff(&file.conformance.handoff);
    let (run, _) = run_virtual(file, &profile, &reqs, &mut dev)?;
    Ok(Record {
        config: String::new(),
        policy_profile: profile_text.to_string(),
        gpu: "none (dry run: the profile's cost models)".into(),
        date: String::new(),
        commit: String::new(),
        run,
    })
}

/// What every GPU run of part 1 starts from: the config, the policies' profile and the
/// config's workload.
fn run_inputs(
    config_text: &str,
    origin: &str,
    profile_text: &str,
) -> Result<(ConformanceFile, HardwareProfile, Vec<Request>), ConformanceError> {
    let file = ConformanceFile::parse(config_text, origin)?;
    let profile = parse_profile(profile_text, &file.conformance.profile)?;
    let reqs = workload(&file)?;
    Ok((file, profile, reqs))
}

impl Record {
    /// A GPU run's record: the texts it ran from, on which GPU(s), when and at which commit.
    fn of_gpu_run(
        config_text: &str,
        profile_text: &str,
        gpu: String,
        date: &str,
        commit: &str,
        run: RunOutcome,
    ) -> Record {
        Record {
            config: config_text.to_string(),
            policy_profile: profile_text.to_string(),
            gpu,
            date: date.to_string(),
            commit: commit.to_string(),
            run,
        }
    }
}

/// Part 1 on the virtual clock: the workload of `config_text` on the GPU, the policies using
/// `profile_text`, the backend on this thread (time moves by the CUDA-event durations).
/// `b` must have been built from the config's `[backend]` section.
pub fn run_on_gpu(
    b: &mut CudaBackend,
    config_text: &str,
    origin: &str,
    profile_text: &str,
    date: &str,
    commit: &str,
) -> Result<Record, ConformanceError> {
    let (file, profile, reqs) = run_inputs(config_text, origin, profile_text)?;
    let devices =
        cudarc::driver::CudaContext::device_count().map_err(crate::backend::BackendError::from)?;
    file.check_placement_fits(devices.max(0) as usize)?;
    if file.placement().physical_ordinals().len() > 1 {
        return Err(ConformanceError::Device(
            "the placement uses several physical GPUs: run it with run_on_gpus".into(),
        ));
    }
    if b.config().unit_devices != file.backend_config().unit_devices {
        return Err(ConformanceError::Device(
            "the backend was not built from the config's backend_config()".into(),
        ));
    }
    warm_up(b, &file, &profile)?;
    let (run, _) = run_virtual(&file, &profile, &reqs, b)?;
    Ok(Record::of_gpu_run(
        config_text,
        profile_text,
        b.gpu().name(),
        date,
        commit,
        run,
    ))
}

/// Part 1 on the wall clock: as [`run_on_gpu`], but the backend is built (from the config's
/// `[backend]`) and warmed up on the device thread, and the run's times are wall times from
/// when the device was ready: arrivals are released when their time comes and handled while
/// steps are in flight, and a step ends when the loop sees it complete. Each step's
/// `duration_ns` is still the CUDA-event time.
pub fn run_on_gpu_wall(
    gpu: std::sync::Arc<servelab_kernels::GpuContext>,
    config_text: &str,
    origin: &str,
    profile_text: &str,
    date: &str,
    commit: &str,
) -> Result<Record, ConformanceError> {
    let (file, profile, reqs) = run_inputs(config_text, origin, profile_text)?;
    if file.own_gpus() || file.placement().physical_ordinals().len() > 1 {
        return Err(ConformanceError::Device(
            "the wall clock runs every device of the unit on one device thread (one GPU); a \
             placement with GPUs of their own runs on the virtual clock"
                .into(),
        ));
    }
    let name = gpu.name();
    let (device_file, device_profile) = (file.clone(), profile.clone());
    // Before the device thread exists, so it (and the disk tier's thread) inherit the mask.
    let pin = crate::affinity::pin_to_current_cpu();
    let device = WallDevice::spawn(move |_| {
        // The context is current on this thread for every call that follows (cudarc binds it
        // for its own calls; the backend also makes raw driver calls).
        let made = (|| -> Result<CudaBackend, ConformanceError> {
            gpu.ctx
                .bind_to_thread()
                .map_err(crate::backend::BackendError::from)?;
            let mut b = CudaBackend::new(gpu, device_file.backend_config())?;
            warm_up(&mut b, &device_file, &device_profile)?;
            Ok(b)
        })();
        made.map_err(|e| e.to_string())
    })
    .map_err(ConformanceError::Device)?;
    let (mut run, _) = run_unit(
        &file,
        &profile,
        &reqs,
        |u| GpuEnv::wall_clock(device, u),
        GpuEnv::finish,
    )?;
    run.pinned_cpu = pin.as_ref().map(|p| p.cpu);
    drop(pin);
    Ok(Record::of_gpu_run(
        config_text,
        profile_text,
        name,
        date,
        commit,
        run,
    ))
}

/// Throwaway prefill and decode plans on request ids outside the workload, then a reset: a
/// ladder of prefill chunk sizes (128 to 8,192 new tokens, cold and over a cached prefix) and
/// of decode batch sizes (1 to `max_seqs`, six query tokens each), `warmup_steps` times. One
/// size is not enough: kernels load lazily and cuBLAS picks per GEMM shape on first use, and
/// activation buffers grow to the largest step seen (without it the first cold 3–4K-token
/// prefill steps took 2–4x their later time and set the TTFT tail). Then, with
/// `warmup_run_seed`, a whole throwaway run of the unit under that seed.
fn warm_up(
    b: &mut CudaBackend,
    file: &ConformanceFile,
    profile: &HardwareProfile,
) -> Result<(), ConformanceError> {
    warm_up_ladder(b, file)?;
    if let Some(seed) = file.conformance.warmup_run_seed {
        let reqs = workload_with_seed(file, seed)?;
        run_virtual(file, profile, &reqs, b)?;
        b.reset();
    }
    Ok(())
}

/// The ladder of [`warm_up`], `warmup_steps` times, on the kinds of device `b` holds (a
/// backend of several GPUs' may hold only prefill engines or only decode groups), then a reset.
fn warm_up_ladder(b: &mut CudaBackend, file: &ConformanceFile) -> Result<(), ConformanceError> {
    let mut report = StepReport::default();
    let split = b.config().unit_devices;
    let decode = split.is_none_or(|(_, g)| g > 0);
    let plans = ladder_for(warm_up_plans(&b.config().model, file), split);
    for _ in 0..file.conformance.warmup_steps {
        for plan in &plans {
            b.try_execute(plan, &mut report)?;
            // The handoff copy's kernels too: the prefill's KV to decode group 0.
            if let StepPlan::Prefill(p) = plan
                && split.is_some()
                && decode
            {
                b.handoff(p.chunks[0].request.0, 0)?;
            }
            b.reset();
        }
    }
    b.reset();
    Ok(())
}

/// The ladder's plans a backend holding `split` (prefill engines, decode groups) can run.
fn ladder_for(plans: Vec<StepPlan>, split: Option<(u32, u32)>) -> Vec<StepPlan> {
    let (prefill, decode) = split.map_or((true, true), |(p, g)| (p > 0, g > 0));
    plans
        .into_iter()
        .filter(|p| match p {
            StepPlan::Prefill(_) => prefill,
            StepPlan::Decode(_) => decode,
        })
        .collect()
}

/// Part 1 on several GPUs, on the virtual clock: the placement's devices on one backend per
/// physical ordinal ([`MultiGpuDevice`]; `gpus[i]` the context of the placement's i-th
/// ordinal, ascending), handoffs between backends as peer copies. Each backend is warmed up
/// with the ladder of the devices it holds, then the throwaway run (`warmup_run_seed`) goes
/// through the whole device.
pub fn run_on_gpus(
    gpus: Vec<std::sync::Arc<servelab_kernels::GpuContext>>,
    config_text: &str,
    origin: &str,
    profile_text: &str,
    date: &str,
    commit: &str,
) -> Result<Record, ConformanceError> {
    let (file, profile, reqs) = run_inputs(config_text, origin, profile_text)?;
    file.check_placement_fits(gpus.len())?;
    if !file.conformance.handoff.copy {
        return Err(ConformanceError::Device(
            "a placement over several GPUs needs conformance.handoff.copy = true (each GPU \
             its own pool)"
                .into(),
        ));
    }
    let (map, ordinals) =
        DeviceMap::by_ordinal(&file.placement()).map_err(ConformanceError::Device)?;
    if ordinals.len() != gpus.len() {
        return Err(ConformanceError::Device(format!(
            "{} GPU contexts for the placement's ordinals {ordinals:?}",
            gpus.len()
        )));
    }
    let name = format!("{} x {}", gpus.len(), gpus[0].name());
    let mut backends = Vec::with_capacity(gpus.len());
    for (gpu, &local) in gpus.into_iter().zip(&map.local) {
        gpu.ctx
            .bind_to_thread()
            .map_err(crate::backend::BackendError::from)?;
        let cfg = BackendConfig {
            unit_devices: Some(local),
            ..file.backend_config()
        };
        let mut b = CudaBackend::new(gpu, cfg)?;
        warm_up_ladder(&mut b, &file)?;
        backends.push(b);
    }
    let mut dev = MultiGpuDevice::new(map, backends).map_err(ConformanceError::Device)?;
    if let Some(seed) = file.conformance.warmup_run_seed {
        run_virtual(&file, &profile, &workload_with_seed(&file, seed)?, &mut dev)?;
        dev.reset();
    }
    let (run, _) = run_virtual(&file, &profile, &reqs, &mut dev)?;
    Ok(Record::of_gpu_run(
        config_text,
        profile_text,
        name,
        date,
        commit,
        run,
    ))
}

/// The warm-up ladder: one prefill per chunk size, cold and over a prefix, and one decode step per
/// power-of-two batch up to `max_seqs`, each under its own fresh request ids.
fn warm_up_plans(m: &ModelShape, file: &ConformanceFile) -> Vec<StepPlan> {
    use servelab_core::engine::{DecodePlan, DecodeRankPlan, DecodeSeq, PrefillChunk, PrefillPlan};
    let mut plans = Vec::new();
    let mut next = u64::MAX / 2;
    let mut fresh = || {
        next += 1;
        RequestId(next)
    };
    for new_tokens in [128u32, 256, 512, 1024, 2048, 4096, 8192] {
        for prefix_tokens in [0u32, 2048] {
            plans.push(StepPlan::Prefill(PrefillPlan {
                engine: EngineId(0),
                chunks: vec![PrefillChunk {
                    request: fresh(),
                    new_tokens,
                    prefix_tokens,
                    new_token_layers: m.encoder_layers as u32,
                    // The replay cannot be longer than the sequence itself.
                    decoder_tokens: 140.min(new_tokens + prefix_tokens),
                    decoder_layers: m.decoder_layers as u32,
                    swap_in_bytes: 0,
                }],
                expert_imbalance: 1.0,
            }));
        }
    }
    let mut batch = 1u32;
    while batch <= file.conformance.max_seqs.max(1) {
        let seqs: Vec<DecodeSeq> = (0..batch)
            .map(|slot| DecodeSeq {
                request: fresh(),
                kv_tokens: 2049,
                max_drafts: 5,
                slot,
            })
            .collect();
        plans.push(StepPlan::Decode(DecodePlan {
            engine: EngineId(0),
            ranks: vec![DecodeRankPlan {
                seq_start: 0,
                seq_end: batch,
                verify_budget: 5 * batch,
            }],
            seqs,
            dynamic: false,
            expert_imbalance: 1.0,
        }));
        batch *= 2;
    }
    plans
}

/// Nearest-rank percentile (`q` in [0, 1]) of unsorted values; 0 for none.
pub fn percentile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = (q * s.len() as f64).ceil().max(1.0) as usize;
    s[rank.min(s.len()) - 1]
}

/// Host time the run's clock saw beyond the device: per step, end − start − duration − the
/// wait behind other devices' steps (admission and planning before the launch, host work
/// outside the CUDA-event span, completion latency). 0 on the virtual clock.
#[derive(Clone, Debug, Default, Serialize)]
pub struct HostOverhead {
    pub steps: usize,
    pub sum_ms: f64,
    pub median_ms: f64,
    pub p90_ms: f64,
    /// Arrivals handled while a step was in flight.
    pub admitted_in_flight: u64,
    pub requests: usize,
}

pub fn host_overhead(run: &RunOutcome) -> HostOverhead {
    let v: Vec<f64> = run
        .steps
        .iter()
        .map(|s| s.host_overhead_ns() as f64 / 1e6)
        .collect();
    HostOverhead {
        steps: v.len(),
        sum_ms: v.iter().sum(),
        median_ms: percentile(&v, 0.5),
        p90_ms: percentile(&v, 0.9),
        admitted_in_flight: run.admitted_in_flight,
        requests: run.requests.len(),
    }
}

/// The index that splits `steps` so the part before it holds the first `fraction` (0–1) of
/// the decode steps, in run order: a time-ordered fit / held-out split.
pub fn decode_split(steps: &[crate::env::RecordedStep], fraction: f64) -> usize {
    let total = steps
        .iter()
        .filter(|s| matches!(s.plan, StepPlan::Decode(_)))
        .count();
    let want = (total as f64 * fraction.clamp(0.0, 1.0)).round() as usize;
    if want == 0 {
        return 0;
    }
    let mut seen = 0;
    for (i, s) in steps.iter().enumerate() {
        if matches!(s.plan, StepPlan::Decode(_)) {
            seen += 1;
            if seen == want {
                return i + 1;
            }
        }
    }
    steps.len()
}

/// Median of measured − predicted over the decode steps of `steps` (0 if none): the time the
/// engine's decode steps take beyond what isolated calibration steps of the same shape take
/// (host planning with live sequences, under the same CUDA-event span).
pub fn decode_offset_ns(model: &DecodeTimeModel, steps: &[crate::env::RecordedStep]) -> f64 {
    let mut d: Vec<f64> = steps
        .iter()
        .filter_map(|s| predict_decode_ns(model, s).map(|p| s.duration_ns as f64 - p))
        .collect();
    if d.is_empty() {
        return 0.0;
    }
    d.sort_by(f64::total_cmp);
    let n = d.len();
    if n % 2 == 1 {
        d[n / 2]
    } else {
        (d[n / 2 - 1] + d[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ClockKind;
    use crate::env::RecordedStep;
    use servelab_core::content::{ChainBuilder, SegmentId};
    use servelab_core::engine::PrefillCostModel;
    use servelab_core::profile::TransferProfile;
    use servelab_core::unit::{DeviceId, Input};
    use servelab_core::{SessionId, TrafficClass};
    use std::sync::Arc;

    fn profile() -> HardwareProfile {
        HardwareProfile {
            name: "test".into(),
            description: String::new(),
            prefill: PrefillCostModel {
                base_ns: 1e6,
                per_layer_token_ns: 10.0,
                per_layer_token_ctx_ns: 0.001,
                moe_share: 0.0,
                reference_imbalance: 1.0,
                attention_ramp_tokens: 0.0,
                per_layer_replay_ctx_ns: 0.0,
                active_experts: None,
            },
            decode: DecodeTimeModel {
                base_ns: 1e6,
                per_seq_ns: 1e3,
                per_kv_token_ns: 1.0,
                per_token_ns: 1e4,
                per_token_sq_ns: 0.0,
                dynamic_overhead_ns: 0.0,
                moe_share: 0.0,
                reference_imbalance: 1.0,
                per_max_kv_token_ns: 0.0,
                active_experts: None,
            },
            transfer: TransferProfile {
                swap_in_bytes_per_s: 5e10,
                sync_gap: Nanos(0),
            },
        }
    }

    const CONFIG: &str = r#"
[experiment]
kind = "conformance"
seed = 9

[conformance]
profile = "unused.toml"
chunking = { kind = "time-budgeted", token_budget = 2048, time_budget = "30ms", min_chunk_tokens = 128 }
max_prefill_jobs = 8
max_seqs = 16
kv_capacity_tokens = 1000000
max_waiting = 64
verification = { kind = "dynamic", min_seqs_per_rank = 0 }

[conformance.swa]
machines = 2

[workload.agent]
sessions = 3
session_rate_per_s = 5.0
turns = { kind = "fixed", value = 3 }
system_prompts = 1
system_prompt_tokens = { kind = "fixed", value = 1500 }
task_tokens = { kind = "fixed", value = 300 }
reply_tokens = { kind = "fixed", value = 40 }
tool_result_tokens = { kind = "fixed", value = 400 }
think_time_s = { kind = "fixed", value = 0.2 }
"#;

    fn file() -> ConformanceFile {
        ConformanceFile::parse(CONFIG, "test.toml").unwrap()
    }

    /// The whole unit: two prefill engines behind the tiered balancer, two decode groups.
    fn wide_file() -> ConformanceFile {
        ConformanceFile::parse(&wide_text(), "wide.toml").unwrap()
    }

    fn dry(f: &ConformanceFile) -> (RunOutcome, ServiceReport) {
        let reqs = workload(f).unwrap();
        let mut dev = ModelDevice::new(profile(), 0.75, 3);
        let mut run = |p: &StepPlan, r: &mut StepReport| dev.run(p, r);
        run_virtual(f, &profile(), &reqs, &mut run).unwrap()
    }

    fn replay(f: &ConformanceFile, run: &RunOutcome) -> ReplayCheck {
        replay_check(f, &profile(), &workload(f).unwrap(), run).unwrap()
    }

    #[test]
    fn warm_up_plans_are_valid_for_the_backend() {
        // A 128-token cold chunk must not ask for a 140-token replay. The backend's own plan
        // check runs without a GPU.
        let f = file();
        let plans = warm_up_plans(&f.backend.model, &f);
        assert!(plans.len() >= 14, "{} plans", plans.len());
        for plan in &plans {
            if let StepPlan::Prefill(p) = plan {
                crate::backend::check_prefill_plan(p).unwrap();
            }
        }
    }

    /// A backend of prefill engines only warms up prefill plans, one of decode groups only
    /// decode plans.
    #[test]
    fn the_ladder_follows_the_devices_a_backend_holds() {
        let f = file();
        let all = warm_up_plans(&f.backend.model, &f);
        let n = all.len();
        let prefills = all
            .iter()
            .filter(|p| matches!(p, StepPlan::Prefill(_)))
            .count();
        assert!(prefills > 0 && prefills < n);
        assert_eq!(ladder_for(all.clone(), None).len(), n);
        assert_eq!(ladder_for(all.clone(), Some((1, 1))).len(), n);
        let p = ladder_for(all.clone(), Some((2, 0)));
        assert_eq!(p.len(), prefills);
        assert!(p.iter().all(|p| matches!(p, StepPlan::Prefill(_))));
        let d = ladder_for(all, Some((0, 1)));
        assert_eq!(d.len(), n - prefills);
        assert!(d.iter().all(|p| matches!(p, StepPlan::Decode(_))));
    }

    #[test]
    fn config_errors_name_the_field() {
        let e = ConformanceFile::parse(&CONFIG.replace("max_seqs", "max_seq"), "c.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("c.toml") && e.contains("max_seq"), "{e}");
        let bad = CONFIG.replace(
            "[conformance]\n",
            "[conformance]\nhit_policy = \"ordinary-model\"\n",
        );
        let e = ConformanceFile::parse(&bad, "c.toml")
            .unwrap()
            .unit_config(&profile())
            .unwrap_err();
        assert!(e.to_string().contains("hit_policy"), "{e}");
        let bad = CONFIG.replace("seed = 9", "seed = -1");
        let e = ConformanceFile::parse(&bad, "c.toml")
            .unwrap()
            .seed()
            .unwrap_err();
        assert!(e.to_string().contains("experiment.seed"), "{e}");
        let bad = CONFIG.replace("machines = 2", "machines = 1");
        let e = ConformanceFile::parse(&bad, "c.toml")
            .unwrap()
            .unit_config(&profile())
            .unwrap_err();
        assert!(e.to_string().contains("swa.machines"), "{e}");
    }

    /// `[backend] decode_mode` reaches the backend config by its kebab-case name, is eager
    /// when absent, and a misspelt mode is an error naming the field.
    #[test]
    fn the_decode_mode_is_read_from_the_backend_table() {
        use crate::backend::DecodeMode;
        assert_eq!(file().backend_config().decode_mode, DecodeMode::Eager);
        let graph = format!("{CONFIG}\n[backend]\ndecode_mode = \"graph\"\n");
        let f = ConformanceFile::parse(&graph, "c.toml").unwrap();
        assert_eq!(f.backend_config().decode_mode, DecodeMode::Graph);
        let bad = format!("{CONFIG}\n[backend]\ndecode_mode = \"graphs\"\n");
        let e = ConformanceFile::parse(&bad, "c.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("c.toml") && e.contains("decode_mode"), "{e}");
    }

    /// The unit on the model device runs every request to completion, later turns hit the
    /// store, and a replay of its own record reproduces every plan and outcome.
    #[test]
    fn replay_of_a_record_reproduces_every_plan() {
        let f = file();
        let (run, report) = dry(&f);
        assert_eq!(run.requests.len(), 9);
        assert_eq!(report.completed, 9);
        assert!(run.requests.iter().all(|r| r.last_token_ns.is_some()));
        assert!(run.requests.iter().filter(|r| r.hit_tokens > 0).count() >= 3);
        assert!(
            run.steps
                .iter()
                .any(|s| matches!(&s.plan, StepPlan::Decode(d) if d.dynamic))
        );
        let check = replay(&f, &run);
        assert!(check.replayable);
        assert_eq!(check.mismatched_steps, 0, "{:?}", check.first_mismatches);
        assert!(check.outcomes_identical);
        assert_eq!(check.replayed_steps, run.steps.len());
        // Through JSON, as committed records are read.
        let back: RunOutcome = serde_json::from_str(&serde_json::to_string(&run).unwrap()).unwrap();
        assert_eq!(back, run);
    }

    /// A record whose durations or step ends were changed drives different plans or times;
    /// the check reports it.
    #[test]
    fn a_tampered_record_is_reported() {
        let f = file();
        let (run, _) = dry(&f);
        let mut longer = run.clone();
        longer.steps[0].end_ns += 50_000_000;
        let check = replay(&f, &longer);
        assert!(check.mismatched_steps > 0 || !check.outcomes_identical);
        assert!(!check.first_mismatches.is_empty() || !check.outcomes_identical);
        let mut moved = run.clone();
        let mid = moved.steps.len() / 2;
        moved.steps[mid].end_ns += 40_000_000;
        let check = replay(&f, &moved);
        assert!(check.mismatched_steps > 0 || !check.outcomes_identical);
    }

    /// Two prefill engines and two decode groups share the one device: the balancers use
    /// both of each, steps never overlap on the device, and the record replays exactly.
    #[test]
    fn the_whole_unit_shares_one_device_and_replays() {
        let f = wide_file();
        let (run, report) = dry(&f);
        assert_eq!(report.completed, 9);
        for d in [
            DeviceId::Prefill(0),
            DeviceId::Prefill(1),
            DeviceId::Decode(0),
            DeviceId::Decode(1),
        ] {
            assert!(
                run.steps.iter().any(|s| s.device == Some(d)),
                "no step on {d:?}"
            );
        }
        // FIFO on one device: each step starts (start + queued) after the previous ended.
        let mut free = 0;
        for s in &run.steps {
            let begin = s.start_ns + s.queued_ns;
            assert!(begin >= free, "{s:?}");
            assert_eq!(s.end_ns, begin + s.duration_ns.max(1));
            free = s.end_ns;
        }
        assert!(run.steps.iter().any(|s| s.queued_ns > 0));
        let check = replay(&f, &run);
        assert_eq!(check.mismatched_steps, 0, "{:?}", check.first_mismatches);
        assert!(check.outcomes_identical);
    }

    /// A fixed-duration device that never accepts drafts.
    fn fixed(ns: u64) -> impl FnMut(&StepPlan, &mut StepReport) -> Result<(), String> {
        move |plan, report| {
            report.duration = Nanos(ns);
            report.seqs.clear();
            report.ranks.clear();
            if let StepPlan::Decode(d) = plan {
                report.seqs.resize(d.seqs.len(), Default::default());
                report.ranks.resize_with(d.ranks.len(), Default::default);
            }
            Ok(())
        }
    }

    /// Hand-computed: a 300-token prompt in 256-token chunks takes two 1 ms prefill steps (TTFT
    /// 2 ms from arrival at 5 ms); 3 more tokens, one per 1 ms decode step, end at 10 ms.
    #[test]
    fn golden_single_request() {
        let mut f = file();
        f.conformance.chunking = ChunkPolicy::FixedSize { chunk_tokens: 256 };
        let mut b = ChainBuilder::new(128);
        b.push(SegmentId(1), 304);
        let reqs = vec![Request {
            id: RequestId(0),
            session: Some(SessionId(0)),
            class: TrafficClass::Agent,
            arrival: Nanos(5_000_000),
            prompt_tokens: 300,
            output_tokens: 4,
            content: Arc::new(b.finish()),
        }];
        let (run, _) = run_virtual(&f, &profile(), &reqs, &mut fixed(1_000_000)).unwrap();
        let r = &run.requests[0];
        assert_eq!(r.ttft_ns(), Some(2_000_000));
        assert_eq!(r.last_token_ns, Some(10_000_000));
        assert_eq!(r.tpot_ns(), Some(1_000_000.0));
        assert_eq!(run.steps.len(), 5);
        assert_eq!(run.steps[0].start_ns, 5_000_000);
        assert_eq!(run.steps[0].end_ns, 6_000_000);
        assert_eq!(run.steps[4].end(), 10_000_000);
        assert_eq!(run.clock, ClockKind::Virtual);
        assert_eq!(host_overhead(&run).sum_ms, 0.0);
        let StepPlan::Prefill(p) = &run.steps[1].plan else {
            panic!("second step is prefill")
        };
        assert_eq!(
            (p.chunks[0].new_tokens, p.chunks[0].prefix_tokens),
            (44, 256)
        );
        assert_eq!(p.chunks[0].decoder_tokens, 140);
    }

    /// The split holds the wanted share of decode steps; the offset is the median residual of
    /// the decode steps before it, and 0 for a device the decode model predicts exactly.
    #[test]
    fn decode_offset_is_the_median_residual_before_the_split() {
        let f = file();
        let (mut run, _) = dry(&f);
        let decodes: Vec<usize> = (0..run.steps.len())
            .filter(|&i| matches!(run.steps[i].plan, StepPlan::Decode(_)))
            .collect();
        assert!(decodes.len() >= 4);
        let split = decode_split(&run.steps, 0.5);
        let want = (decodes.len() as f64 * 0.5).round() as usize;
        assert_eq!(split, decodes[want - 1] + 1);
        assert_eq!(decode_split(&run.steps, 0.0), 0);
        let model = profile().decode;
        assert!(decode_offset_ns(&model, &run.steps[..split]).abs() <= 1.0);
        for s in run.steps.iter_mut() {
            if matches!(s.plan, StepPlan::Decode(_)) {
                s.duration_ns += 2_000_000;
            }
        }
        let off = decode_offset_ns(&model, &run.steps[..split]);
        assert!((off - 2e6).abs() <= 1.0, "{off}");
    }

    /// The wall clock on a paced device (the model device's time / 50, slept on the device
    /// thread): every request completes, arrivals are handled while a step is in flight (the
    /// device holds its first step until one has been, so this does not depend on timing),
    /// and the record, through JSON, replays with identical plans and outcomes. A record with
    /// one step's end moved does not.
    #[test]
    fn wall_clock_run_replays_exactly() {
        for f in [file(), wide_file()] {
            let mut reqs = workload(&f).unwrap();
            // Arrivals 4x closer (the workload spans 1.7 s): the test takes under a second.
            for r in &mut reqs {
                r.arrival = Nanos(r.arrival.0 / 4);
            }
            let device = WallDevice::<String>::spawn(move |probe| {
                let mut dev = ModelDevice::new(profile(), 0.75, 3);
                let mut first = true;
                Ok(move |plan: &StepPlan, r: &mut StepReport| {
                    let t = std::time::Instant::now();
                    dev.run(plan, r)?;
                    std::thread::sleep(std::time::Duration::from_nanos(r.duration.0 / 50));
                    if std::mem::take(&mut first) {
                        let give_up = t + std::time::Duration::from_secs(10);
                        while probe.admitted() == 0 && std::time::Instant::now() < give_up {
                            std::thread::sleep(std::time::Duration::from_micros(200));
                        }
                    }
                    // The device's own measurement of the step.
                    r.duration = Nanos(t.elapsed().as_nanos() as u64);
                    Ok(())
                })
            })
            .unwrap();
            let (run, report) = run_unit(
                &f,
                &profile(),
                &reqs,
                |u| GpuEnv::wall_clock(device, u),
                GpuEnv::finish,
            )
            .unwrap();
            assert_eq!(run.clock, ClockKind::Wall);
            assert_eq!(report.completed, 9);
            assert!(!run.handoffs.is_empty());
            assert!(
                run.handoffs
                    .iter()
                    .all(|h| h.end_ns >= h.start_ns && h.picked.is_some())
            );
            assert!(run.admitted_in_flight >= 1);
            for s in &run.steps {
                assert!(s.start_ns < s.end_ns, "{s:?}");
            }
            let h = host_overhead(&run);
            assert_eq!(h.admitted_in_flight, run.admitted_in_flight);
            let rec: RunOutcome =
                serde_json::from_str(&serde_json::to_string(&run).unwrap()).unwrap();
            let check = replay_check(&f, &profile(), &reqs, &rec).unwrap();
            assert_eq!(check.mismatched_steps, 0, "{:?}", check.first_mismatches);
            assert!(check.outcomes_identical);
            assert_eq!(check.replayed_steps, run.steps.len());
            let mut moved = rec.clone();
            let last = moved.steps.len() - 1;
            moved.steps[last / 2].end_ns += 50_000_000;
            let check = replay_check(&f, &profile(), &reqs, &moved).unwrap();
            assert!(check.mismatched_steps > 0 || !check.outcomes_identical);
        }
    }

    /// The handoff on the model device: every handed-off request has one record, the copy
    /// queues behind the GPU's earlier work and `HandoffDone` comes when it ends; the replay
    /// checks each handoff, and a record whose handoff moved is reported.
    #[test]
    fn handoffs_are_timed_recorded_and_replayed() {
        let f = wide_file();
        let reqs = workload(&f).unwrap();
        let model = HandoffSection {
            copy: true,
            bytes_per_s: 1e9,
            latency: Nanos::from_micros(200),
        };
        let mut dev = ModelDevice::new(profile(), 0.75, 3).with_handoff(&model);
        let (run, report) = run_virtual(&f, &profile(), &reqs, &mut dev).unwrap();
        assert_eq!(report.completed, 9);
        let decoding = reqs.iter().filter(|r| r.output_tokens > 1).count();
        assert_eq!(run.handoffs.len(), decoding);
        for h in &run.handoffs {
            assert!(matches!(h.from, DeviceId::Prefill(_)) && matches!(h.to, DeviceId::Decode(_)));
            assert_eq!(h.bytes, h.unit_bytes);
            assert_eq!(h.duration_ns, model.predict_ns(h.bytes).round() as u64);
            assert_eq!(h.end_ns, h.start_ns + h.queued_ns + h.duration_ns, "{h:?}");
            assert!(h.picked.is_some());
            let fed = run
                .inputs
                .iter()
                .find(|l| l.input == Input::HandoffDone(h.request))
                .unwrap();
            assert_eq!(fed.at_ns, h.end_ns);
        }
        assert!(run.handoffs.iter().any(|h| h.from == DeviceId::Prefill(1)));
        assert!(run.handoffs.iter().any(|h| h.to == DeviceId::Decode(1)));
        let check = replay(&f, &run);
        assert_eq!(check.mismatched_steps, 0, "{:?}", check.first_mismatches);
        assert_eq!(
            (check.recorded_handoffs, check.replayed_handoffs),
            (decoding, decoding)
        );
        assert!(check.outcomes_identical);
        // A slower copy moves the requests' decode: the record no longer replays as recorded.
        let slow = HandoffSection {
            bytes_per_s: 1e8,
            ..model.clone()
        };
        let mut dev = ModelDevice::new(profile(), 0.75, 3).with_handoff(&slow);
        let (slower, _) = run_virtual(&f, &profile(), &reqs, &mut dev).unwrap();
        assert!(slower.requests[0].last_token_ns > run.requests[0].last_token_ns);
        let mut moved = run.clone();
        moved.handoffs[0].unit_bytes += 1;
        let check = replay(&f, &moved);
        assert!(
            check
                .first_mismatches
                .iter()
                .any(|m| m.contains("handoff 0")),
            "{check:?}"
        );
    }

    /// The wide unit with `placement` appended as its `[placement]` table.
    fn placed_file(placement: &str) -> ConformanceFile {
        let f = wide_file();
        let text = format!("{}\n[placement]\n{placement}", wide_text());
        let placed = ConformanceFile::parse(&text, "placed.toml").unwrap();
        assert_eq!(placed.conformance.prefill.gpus, f.conformance.prefill.gpus);
        placed
    }

    /// The whole unit's config text; sessions start together, so the engines and groups have
    /// work at once.
    fn wide_text() -> String {
        CONFIG
            .replace(
                "\n[workload.agent]",
                "\n[conformance.prefill]\ngpus = 2\nlb = { kind = \"tiered\", tier_bounds_tokens = \
                 [1000], round = \"100ms\", quota = \"1ms\", steal_when_idle = true }\n\n\
                 [conformance.decode]\ngroups = 2\nscheduling = \"async\"\n\n[workload.agent]",
            )
            .replace("session_rate_per_s = 5.0", "session_rate_per_s = 5000.0")
    }

    /// Each step starts after the previous step of every GPU of its device ended, and never
    /// before its planned start.
    fn check_per_gpu_fifo(run: &RunOutcome, p: &PlacementConfig) {
        let mut free = vec![0u64; p.gpus as usize];
        for s in &run.steps {
            let begin = s.start_ns + s.queued_ns;
            let gpus = p.gpus_of(s.device.unwrap());
            for &g in gpus {
                assert!(begin >= free[g as usize], "GPU {g}: {s:?}");
            }
            assert_eq!(s.end_ns, begin + s.duration_ns.max(1));
            for &g in gpus {
                free[g as usize] = s.end_ns;
            }
        }
    }

    /// Prefill engines and decode groups on GPUs of their own (four logical GPUs on ordinal 0):
    /// steps of different devices overlap, each GPU stays FIFO, every handoff is a peer copy
    /// beside the compute, the run ends no later than on the one shared GPU, and the record
    /// replays with 0 mismatched plans.
    #[test]
    fn a_disaggregated_placement_overlaps_and_replays() {
        let f = placed_file(
            "gpus = 4\nordinals = [0, 0, 0, 0]\nprefill = [[0], [1]]\ndecode = [[2], [3]]\n",
        );
        assert!(f.own_gpus() && !wide_file().own_gpus());
        let reqs = workload(&f).unwrap();
        let model = HandoffSection {
            copy: true,
            bytes_per_s: 1e9,
            latency: Nanos::from_micros(200),
        };
        let mut dev = ModelDevice::new(profile(), 0.75, 3).with_handoff(&model);
        let (run, report) = run_virtual(&f, &profile(), &reqs, &mut dev).unwrap();
        assert_eq!(report.completed, 9);
        assert_eq!(run.placement.as_ref(), Some(&f.placement()));
        check_per_gpu_fifo(&run, &f.placement());
        let overlapping = run
            .steps
            .windows(2)
            .any(|w| w[0].device != w[1].device && w[1].start_ns + w[1].queued_ns < w[0].end_ns);
        assert!(overlapping, "no two devices' steps overlapped");
        assert!(!run.handoffs.is_empty() && run.handoffs.iter().all(|h| h.peer));
        for h in &run.handoffs {
            assert_eq!(h.end_ns, h.start_ns + h.queued_ns + h.duration_ns, "{h:?}");
            assert!(h.bytes_per_s() > 0.0);
        }
        let mut dev = ModelDevice::new(profile(), 0.75, 3).with_handoff(&model);
        let (shared, _) = run_virtual(&wide_file(), &profile(), &reqs, &mut dev).unwrap();
        assert!(shared.handoffs.iter().all(|h| !h.peer));
        assert!(
            run.end_ns <= shared.end_ns,
            "{} > {}",
            run.end_ns,
            shared.end_ns
        );
        let check = replay(&f, &run);
        assert_eq!(check.mismatched_steps, 0, "{:?}", check.first_mismatches);
        assert!(check.outcomes_identical);
        // Through JSON, placement included.
        let back: RunOutcome = serde_json::from_str(&serde_json::to_string(&run).unwrap()).unwrap();
        assert_eq!(back, run);
    }

    /// Decode groups of two EP ranks on two GPUs each: the unit plans two ranks per group, a
    /// group's step holds both its GPUs, and the record replays exactly.
    #[test]
    fn decode_groups_span_their_gpus() {
        let f = placed_file(
            "gpus = 6\nordinals = [0, 0, 0, 0, 0, 0]\nprefill = [[0], [1]]\ndecode = [[2, 3], [4, 5]]\n",
        );
        assert_eq!(f.decode_ranks(), 2);
        assert_eq!(f.unit_config(&profile()).unwrap().decode.ranks, 2);
        let (run, report) = dry(&f);
        assert_eq!(report.completed, 9);
        assert!(
            run.steps
                .iter()
                .any(|s| matches!(&s.plan, StepPlan::Decode(d) if d.ranks.len() == 2))
        );
        check_per_gpu_fifo(&run, &f.placement());
        let check = replay(&f, &run);
        assert_eq!(check.mismatched_steps, 0, "{:?}", check.first_mismatches);
        assert!(check.outcomes_identical);
    }

    /// A placement that does not fit the unit or the machine names its field.
    #[test]
    fn placement_errors_name_the_field() {
        let text = format!(
            "{}\n[placement]\ngpus = 3\nprefill = [[0]]\ndecode = [[1], [2]]\n",
            wide_text()
        );
        let e = ConformanceFile::parse(&text, "p.toml")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("placement.prefill") && e.contains("2 prefill engines"),
            "{e}"
        );
        let text = format!(
            "{}\n[placement]\ngpus = 4\nprefill = [[0], [1]]\ndecode = [[2], [3]]\nextra = 1\n",
            wide_text()
        );
        let e = ConformanceFile::parse(&text, "p.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("extra"), "{e}");
        let f = placed_file("gpus = 4\nprefill = [[0], [1]]\ndecode = [[2], [3]]\n");
        let e = f.check_placement_fits(1).unwrap_err().to_string();
        assert!(e.contains("placement.ordinals"), "{e}");
        f.check_placement_fits(4).unwrap();
    }

    /// The config's handoff section: the default copies, errors name the field, and the
    /// backend's pool is split by unit device only when the handoff copies.
    #[test]
    fn the_handoff_section_splits_the_pool() {
        let f = wide_file();
        assert!(f.conformance.handoff.copy);
        assert_eq!(f.backend_config().unit_devices, Some((2, 2)));
        assert_eq!(f.backend_config().region_blocks().len(), 4);
        let off = CONFIG.replace(
            "[conformance.swa]",
            "[conformance.handoff]\ncopy = false\n\n[conformance.swa]",
        );
        let f = ConformanceFile::parse(&off, "c.toml").unwrap();
        assert_eq!(f.backend_config().unit_devices, None);
        let bad = CONFIG.replace(
            "[conformance.swa]",
            "[conformance.handoff]\nbytes_per_s = 0.0\n\n[conformance.swa]",
        );
        let e = ConformanceFile::parse(&bad, "c.toml").unwrap_err();
        assert!(e.to_string().contains("handoff.bytes_per_s"), "{e}");
        let bad = CONFIG.replace(
            "[conformance.swa]",
            "[backend]\nhbm_blocks = 64\nprefill_region_blocks = 64\n\n[conformance.swa]",
        );
        let e = ConformanceFile::parse(&bad, "c.toml").unwrap_err();
        assert!(e.to_string().contains("prefill_region_blocks"), "{e}");
    }

    /// Loads a committed (gzip-compressed) record, or None where the file has not been
    /// committed.
    fn committed(run: &str) -> Option<Record> {
        let path = format!(
            "{}/measurements/2026-11-29-nvidia-h200-{run}-record.json.gz",
            env!("CARGO_MANIFEST_DIR")
        );
        let text = crate::commands::read_text(std::path::Path::new(&path)).ok()?;
        Some(serde_json::from_str(&text).unwrap())
    }

    /// The records of the one-device engine loop (before the serving unit) still load, their steps
    /// keep their plans and times, and the replay says plainly that they have no input log.
    #[test]
    fn committed_records_of_the_old_loop_load() {
        let mut seen = 0;
        for run in [
            "run4-conformance",
            "run8-conformance",
            "run14-conformance-wall",
            "run17-wide-conformance-wall",
        ] {
            let Some(rec) = committed(run) else { continue };
            seen += 1;
            assert!(!rec.run.steps.is_empty(), "{run}");
            assert!(rec.run.inputs.is_empty());
            assert!(
                rec.run
                    .steps
                    .iter()
                    .all(|s: &RecordedStep| s.device.is_none())
            );
            let check = replay_record(&rec).unwrap();
            assert!(!check.replayable, "{run}");
        }
        assert!(seen >= 1, "no committed record found");
    }
}
