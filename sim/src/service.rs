//! The discrete-event simulation of one serving unit (SPEC §3, §6–§8): the unit of
//! [`servelab_core::unit`] driven by the simulator's environment ([`crate::env::VirtualEnv`]:
//! virtual clock, cost-model devices, erasure-coded store reads, links, MoE skew) through the one
//! driver loop. This module holds the service config (the unit's keys and the environment's)
//! and [`run`].
//!
//! Single-threaded and deterministic: integer time, events ordered by (time, seq), every random
//! draw from a sub-seed of the run seed. Every arrival ends completed or rejected with a reason,
//! checked at the end of every run together with KV and SWA slot conservation.

use crate::acceptance::AcceptanceModel;
use crate::cost::{CostModel, SwapIn};
use crate::env::faults::{FaultsConfig, UnitShape};
use crate::env::{RequestFeed, VirtualEnv};
use crate::profile::{HardwareProfile, ProfileFiles};
use serde::{Deserialize, Serialize};
use servelab_core::eplb::ExpertLoadConfig;
use servelab_core::unit::drive::{NoObserver, Observer};
use servelab_core::unit::{AutoscaleConfig, RunError, ServingUnit, SharedCache, UnitConfig};
use servelab_core::{
    ConfigError, HitPolicy, Nanos, Request, ServingConstants, StoreConfig, SwaConfig,
};

pub use servelab_core::unit::{
    DecodePoolConfig, EngineRow, Latencies, PrefillPoolConfig, Rejection, RejectionCount,
    RequestRow, SeriesRow, ServiceReport, SteadyState,
};

/// Reads of the hit prefix from the store cluster.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FetchConfig {
    /// Read bandwidth of one storage node available to this unit.
    pub node_read_bytes_per_s: f64,
    /// Latency of one node's answer, plus an exponential tail with mean `tail_mean`.
    pub latency: Nanos,
    pub tail_mean: Nanos,
    /// A fetch is issued as this many erasure-coded stripe reads (at most one per block).
    pub stripes: u32,
}

impl Default for FetchConfig {
    fn default() -> Self {
        FetchConfig {
            node_read_bytes_per_s: 40e9,
            latency: Nanos::from_micros(200),
            tail_mean: Nanos::from_micros(300),
            stripes: 8,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LinkConfig {
    /// PD handoff: bytes per second per prefill machine (400 Gbps per 8 GPUs).
    pub handoff_bytes_per_s_per_machine: f64,
    pub handoff_latency: Nanos,
    /// Cross-machine SWA pull over the VLAN.
    pub swa_pull_bytes_per_s: f64,
    pub swa_pull_latency: Nanos,
}

impl Default for LinkConfig {
    fn default() -> Self {
        LinkConfig {
            handoff_bytes_per_s_per_machine: 50e9,
            handoff_latency: Nanos::from_micros(50),
            swa_pull_bytes_per_s: 50e9,
            swa_pull_latency: Nanos::from_micros(50),
        }
    }
}

/// How a session's turns arrive.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Arrivals {
    /// At the times in the workload: a turn arrives whether or not the reply to the previous
    /// one has finished, so an overloaded unit sees its load run away.
    #[default]
    OpenLoop,
    /// A session's next turn arrives when the previous reply ended (completed or rejected) plus
    /// the user's think time. The think time is recovered from the workload: its gap between
    /// the two turns minus the reply time it assumed (`ttft` + output ÷ `decode_tokens_per_s`,
    /// the generator's pacing), never below zero. First turns and requests outside a session
    /// arrive at their own times.
    ClosedLoop {
        ttft: Nanos,
        decode_tokens_per_s: f64,
    },
}

/// Which GPUs the unit's devices (prefill engines, decode groups) run on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Placement {
    /// Every device on GPUs of its own, as in production: steps of different devices overlap.
    #[default]
    OwnGpus,
    /// Every device shares one GPU, as the GPU engine runs a whole unit on one H200: steps run
    /// one at a time in launch order, each from the later of its planned start and the end of
    /// the step launched before it.
    OneGpu,
}

/// Where the MoE part of a step's time comes from.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum MoeImbalance {
    /// Every step uses the pool's `expert_imbalance` (the published average, SPEC §9): cheap.
    #[default]
    Fixed,
    /// An expert-load model per engine ([`ExpertLoadModel`]: skewed, drifting routing and a
    /// placement policy: EPLB, static or no redundancy) gives each step the slowest rank's load
    /// ÷ the mean, and EPLB reassignments add their weight-shuffle time to the engine's step.
    /// A pool left out keeps its fixed factor. `prefill.ep.gpus` GPUs share one prefill
    /// instance's experts; `decode.ep.gpus` must equal the decode group's ranks.
    Model {
        #[serde(default)]
        prefill: Option<Box<ExpertLoadConfig>>,
        #[serde(default)]
        decode: Option<Box<ExpertLoadConfig>>,
    },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServiceConfig {
    pub profile: String,
    pub constants: ServingConstants,
    pub hit_policy: HitPolicy,
    pub store: StoreConfig,
    pub swa: SwaConfig,
    pub prefill: PrefillPoolConfig,
    pub decode: DecodePoolConfig,
    pub fetch: FetchConfig,
    pub links: LinkConfig,
    pub swap_in: SwapIn,
    pub acceptance: AcceptanceModel,
    pub moe: MoeImbalance,
    pub arrivals: Arrivals,
    pub placement: Placement,
    /// Requests arriving before this are simulated but not measured.
    pub warmup: Nanos,
    /// End of the measured window (default: the last arrival). Requests arriving after it, and
    /// steps started after it, are simulated but not measured: with session traffic the last
    /// few minutes of arrivals are a ramp-down (no new sessions) at a fraction of the load.
    pub measure_until: Option<Nanos>,
    pub series_interval: Nanos,
    /// One request in this many (by arrival order) is written to the per-request table.
    pub sample_every: u32,
    /// A session's reused blocks are re-touched at most this often (0 = every turn).
    pub touch_coalesce: Nanos,
    /// Decode drains and compute failures ([`crate::env::faults`]); none by default.
    #[serde(skip_serializing_if = "FaultsConfig::is_default")]
    pub faults: FaultsConfig,
    /// Pools sized over time within `prefill.gpus` engines and `decode.groups` groups
    /// ([`servelab_core::unit::autoscale`]); fixed pools when absent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub autoscale: Option<AutoscaleConfig>,
}

impl Default for ServiceConfig {
    fn default() -> Self {
        ServiceConfig {
            profile: "sm100-published".into(),
            constants: ServingConstants::default(),
            hit_policy: HitPolicy::Deepinfer,
            store: StoreConfig::default(),
            swa: SwaConfig {
                machines: 16,
                ..SwaConfig::default()
            },
            prefill: PrefillPoolConfig::default(),
            decode: DecodePoolConfig::default(),
            fetch: FetchConfig::default(),
            links: LinkConfig::default(),
            swap_in: SwapIn::Overlapped,
            acceptance: AcceptanceModel::default(),
            moe: MoeImbalance::Fixed,
            arrivals: Arrivals::OpenLoop,
            placement: Placement::OwnGpus,
            warmup: Nanos::from_secs(60),
            measure_until: None,
            series_interval: Nanos::from_secs(10),
            sample_every: 100,
            touch_coalesce: Nanos::from_secs(60),
            faults: FaultsConfig::default(),
            autoscale: None,
        }
    }
}

impl ServiceConfig {
    /// Checks the environment's keys here and the unit's through [`UnitConfig::validate`]
    /// (with the shipped profile's models; a profile file is checked when it is loaded).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let profile = HardwareProfile::resolve("sm100-published")?;
        self.unit_config(&profile).validate()?;
        self.validate_environment()
    }

    /// GPUs of the unit: its prefill engines and the ranks of its decode groups (saturating:
    /// the counts come from input).
    pub fn gpus(&self) -> u32 {
        let decode = self.decode.groups.saturating_mul(self.decode.ranks);
        self.prefill.gpus.saturating_add(decode)
    }

    /// Machines of the unit, prefill and decode (each holds SWA state). In 64 bits: groups ×
    /// ranks comes from input and may not fit in 32. Machine sizes must be positive.
    pub fn machines(&self) -> u64 {
        let (p, d) = (&self.prefill, &self.decode);
        u64::from(p.gpus).div_ceil(u64::from(p.gpus_per_machine.max(1)))
            + (u64::from(d.groups) * u64::from(d.ranks))
                .div_ceil(u64::from(d.gpus_per_machine.max(1)))
    }

    fn validate_environment(&self) -> Result<(), ConfigError> {
        let p = &self.prefill;
        let d = &self.decode;
        if p.gpus_per_machine == 0 || d.gpus_per_machine == 0 {
            return Err(ConfigError::invalid(
                "prefill.gpus_per_machine",
                "machine sizes must be positive",
            ));
        }
        let machines = self.machines();
        if u64::from(self.swa.machines) < machines {
            return Err(ConfigError::invalid(
                "swa.machines",
                format!(
                    "{} machines hold SWA state but the unit has {machines} (prefill + decode)",
                    self.swa.machines
                ),
            ));
        }
        for (f, v) in [
            (
                "fetch.node_read_bytes_per_s",
                self.fetch.node_read_bytes_per_s,
            ),
            (
                "links.handoff_bytes_per_s_per_machine",
                self.links.handoff_bytes_per_s_per_machine,
            ),
            (
                "links.swa_pull_bytes_per_s",
                self.links.swa_pull_bytes_per_s,
            ),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(ConfigError::invalid(f, "must be positive"));
            }
        }
        if let Arrivals::ClosedLoop {
            decode_tokens_per_s,
            ..
        } = self.arrivals
            && !(decode_tokens_per_s.is_finite() && decode_tokens_per_s > 0.0)
        {
            return Err(ConfigError::invalid(
                "arrivals.decode_tokens_per_s",
                "must be positive",
            ));
        }
        if self.fetch.stripes == 0 {
            return Err(ConfigError::invalid("fetch.stripes", "must be positive"));
        }
        self.validate_moe()?;
        self.validate_faults()?;
        self.acceptance.validate()
    }

    /// The MoE skew models, and a decode model whose EP width is the group's.
    fn validate_moe(&self) -> Result<(), ConfigError> {
        let d = &self.decode;
        if let MoeImbalance::Model { prefill, decode } = &self.moe {
            if let Some(c) = prefill {
                c.validate()
                    .map_err(|e| ConfigError::invalid("moe.prefill", e.to_string()))?;
            }
            if let Some(c) = decode {
                c.validate()
                    .map_err(|e| ConfigError::invalid("moe.decode", e.to_string()))?;
                if c.ep.gpus != d.ranks as usize {
                    return Err(ConfigError::invalid(
                        "moe.decode.ep.gpus",
                        format!(
                            "{} GPUs, but a decode group has {} ranks",
                            c.ep.gpus, d.ranks
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The unit's shape as the fault schedule sees it.
    pub fn unit_shape(&self) -> UnitShape {
        let p = &self.prefill;
        let d = &self.decode;
        UnitShape {
            prefill_gpus: p.gpus,
            decode_groups: d.groups,
            decode_ranks: d.ranks,
            machines: p.gpus.div_ceil(p.gpus_per_machine.max(1))
                + (d.groups.saturating_mul(d.ranks)).div_ceil(d.gpus_per_machine.max(1)),
        }
    }

    fn validate_faults(&self) -> Result<(), ConfigError> {
        self.faults.validate(self.unit_shape())?;
        let rank_faults = self.faults.random.is_some()
            || self
                .faults
                .events
                .iter()
                .any(|e| e.kind == crate::env::faults::FaultKind::DecodeRank);
        if rank_faults
            && let MoeImbalance::Model {
                decode: Some(_), ..
            } = &self.moe
        {
            // The decode expert-load model is built for a fixed EP size; a group re-sized
            // around a dead GPU gets its factor from EPLB on the ranks left instead.
            return Err(ConfigError::invalid(
                "faults",
                "decode-rank failures need `moe.decode` unset (the fixed imbalance factor)",
            ));
        }
        Ok(())
    }

    /// The serving unit's part of the config, with `profile`'s cost models.
    pub fn unit_config(&self, profile: &HardwareProfile) -> UnitConfig {
        UnitConfig {
            constants: self.constants.clone(),
            hit_policy: self.hit_policy,
            prefill: self.prefill.clone(),
            decode: self.decode.clone(),
            prefill_cost: profile.prefill.clone(),
            decode_time: profile.decode.clone(),
            sync_gap: profile.transfer.sync_gap,
            warmup: self.warmup,
            measure_until: self.measure_until,
            series_interval: self.series_interval,
            sample_every: self.sample_every,
            touch_coalesce: self.touch_coalesce,
            elastic: self.faults.elastic(),
            autoscale: self.autoscale.clone(),
        }
    }
}

/// Why a service run failed.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Run(#[from] RunError),
}

/// Runs the unit over `requests` (sorted by arrival) to completion.
pub fn run(
    cfg: &ServiceConfig,
    requests: &[Request],
    seed: u64,
) -> Result<ServiceReport, ServiceError> {
    let profile = HardwareProfile::resolve(&cfg.profile)?;
    run_with_profile(cfg, profile, requests, seed)
}

/// [`run`] over a table the caller gives up: in open loop the unit is given the requests one at
/// a time as they arrive and each is dropped once served, so the run holds the requests in
/// flight (and the chains still used), not the whole trace. Byte-identical to [`run`]: a
/// streamed unit is the table unit (`tests/streamed_unit.rs`), and the store is sized from the
/// same bound. Closed loop needs the table (a turn's time depends on the session's next turn).
pub fn run_owned(
    cfg: &ServiceConfig,
    requests: Vec<Request>,
    seed: u64,
) -> Result<ServiceReport, ServiceError> {
    let profile = HardwareProfile::resolve(&cfg.profile)?;
    if !matches!(cfg.arrivals, Arrivals::OpenLoop) {
        return run_with_profile(cfg, profile, &requests, seed);
    }
    cfg.validate_environment()?;
    check_sorted_by_arrival(&requests)?;
    let last = requests.last().map_or(Nanos::ZERO, |r| r.arrival);
    let mut unit = ServingUnit::streaming(cfg.unit_config(&profile), last)?;
    unit.bound_store_objects(&requests);
    let feed = crate::env::arrivals::table_feed(requests);
    serve(cfg, profile, unit, seed, &mut NoObserver, |backend| {
        VirtualEnv::streamed(cfg, backend, feed, seed)
    })
}

/// A table's requests must come in arrival order: the environments release them in turn.
fn check_sorted_by_arrival(requests: &[Request]) -> Result<(), ServiceError> {
    match requests.windows(2).find(|w| w[1].arrival < w[0].arrival) {
        Some(r) => Err(ConfigError::invalid(
            "workload",
            format!("requests not sorted by arrival at {}", r[1].id),
        )
        .into()),
        None => Ok(()),
    }
}

/// [`run`] with the hardware profile already loaded.
pub fn run_with_profile(
    cfg: &ServiceConfig,
    profile: HardwareProfile,
    requests: &[Request],
    seed: u64,
) -> Result<ServiceReport, ServiceError> {
    run_observed(cfg, profile, requests, seed, &mut NoObserver)
}

/// [`run_with_profile`] with an observer that sees every input and output and the unit and
/// caches after each input (checkers, recorders).
pub fn run_observed<O: Observer>(
    cfg: &ServiceConfig,
    profile: HardwareProfile,
    requests: &[Request],
    seed: u64,
    observer: &mut O,
) -> Result<ServiceReport, ServiceError> {
    cfg.validate_environment()?;
    check_sorted_by_arrival(requests)?;
    let unit = ServingUnit::new(cfg.unit_config(&profile), requests)?;
    serve(cfg, profile, unit, seed, observer, |backend| {
        VirtualEnv::new(cfg, backend, requests, seed)
    })
}

/// Runs the unit over the requests of `feed` (sorted by arrival; open loop), read as the run
/// goes: the unit and its environment hold the requests in flight, not the trace. The
/// arrivals end by `last_arrival` (the steady-state window ends there at the latest).
pub fn run_streamed<O: Observer>(
    cfg: &ServiceConfig,
    profile: HardwareProfile,
    feed: RequestFeed,
    last_arrival: Nanos,
    seed: u64,
    observer: &mut O,
) -> Result<ServiceReport, ServiceError> {
    cfg.validate_environment()?;
    let unit = ServingUnit::streaming(cfg.unit_config(&profile), last_arrival)?;
    serve(cfg, profile, unit, seed, observer, |backend| {
        VirtualEnv::streamed(cfg, backend, feed, seed)
    })
}

/// Runs `unit` in the environment `make_env` builds around the cost model, to its report.
fn serve<O: Observer>(
    cfg: &ServiceConfig,
    profile: HardwareProfile,
    mut unit: ServingUnit,
    seed: u64,
    observer: &mut O,
    make_env: impl FnOnce(CostModel) -> Result<VirtualEnv, ServiceError>,
) -> Result<ServiceReport, ServiceError> {
    unit.set_fetch_stripes(cfg.fetch.stripes as usize);
    let mut shared = SharedCache::new(
        cfg.store.clone(),
        cfg.swa.clone(),
        cfg.constants.block_bytes(),
    )?;
    // Sized once for the whole run: growing the table of tens of millions of blocks step by
    // step rebuilt it many times (and took most of the run's page faults).
    shared.store.reserve(unit.store_objects_bound());
    let backend = CostModel::new(
        profile,
        &cfg.acceptance,
        cfg.constants.draft_tokens,
        cfg.swap_in,
        seed,
    );
    let mut env = make_env(backend)?;
    servelab_core::unit::run(&mut unit, &mut shared, &mut env, observer)?;
    let mut report = unit.finish(&shared, env.now(), env.events())?;
    report.moe_reassignments = env.moe().reassignments;
    report.moe_reassignment_s = env.moe().reassignment_ns as f64 / 1e9;
    report.storage = env.storage_mut().finish(&mut shared.store);
    Ok(report)
}
