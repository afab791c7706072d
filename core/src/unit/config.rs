//! The serving unit's own configuration: its pools and what it measures. The environment's
//! parts (storage reads, links, the cost model's profile) are configured by the environment.

use crate::consts::ServingConstants;
use crate::engine::{
    ChunkPolicy, DecodeGroupConfig, DecodeLbPolicy, DecodeTimeModel, PrefillCostModel,
    PrefillLbPolicy, Scheduling, VerificationPolicy,
};
use crate::error::ConfigError;
use crate::hit::HitPolicy;
use crate::time::Nanos;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrefillPoolConfig {
    /// GPUs in the prefill pool; each is one engine (a DP rank of an EP4/DP4 instance).
    pub gpus: u32,
    pub gpus_per_machine: u32,
    pub chunking: ChunkPolicy,
    pub lb: PrefillLbPolicy,
    pub max_jobs_per_engine: u32,
    /// Requests waiting in the balancer; beyond it arrivals are rejected.
    pub max_queued_requests: u32,
    pub expert_imbalance: f64,
}

impl Default for PrefillPoolConfig {
    fn default() -> Self {
        PrefillPoolConfig {
            gpus: 64,
            gpus_per_machine: 8,
            chunking: ChunkPolicy::TimeBudgeted {
                token_budget: 32_768,
                time_budget: Nanos::from_millis(250),
                min_chunk_tokens: 128,
            },
            lb: PrefillLbPolicy::Tiered {
                tier_bounds_tokens: vec![16_384, 65_536, 262_144],
                round: Nanos::from_secs(1),
                quota: Nanos::from_millis(300),
                steal_when_idle: true,
            },
            max_jobs_per_engine: 64,
            max_queued_requests: 100_000,
            expert_imbalance: 1.074,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DecodePoolConfig {
    /// EP groups; each has `ranks` GPUs.
    pub groups: u32,
    pub gpus_per_machine: u32,
    pub ranks: u32,
    pub max_seqs_per_rank: u32,
    pub kv_capacity_tokens_per_rank: u64,
    pub max_waiting_per_rank: u32,
    pub verification: VerificationPolicy,
    pub scheduling: Scheduling,
    pub lb: DecodeLbPolicy,
    pub expert_imbalance: f64,
}

impl Default for DecodePoolConfig {
    fn default() -> Self {
        DecodePoolConfig {
            groups: 1,
            gpus_per_machine: 8,
            ranks: 64,
            max_seqs_per_rank: 128,
            // ~100 GB of HBM for KV at 890 B/token.
            kv_capacity_tokens_per_rank: 112_000_000,
            max_waiting_per_rank: 4096,
            verification: VerificationPolicy::Dynamic {
                min_seqs_per_rank: 0,
                vote: Default::default(),
                confirmation_rounds: 1,
                budget: Default::default(),
            },
            scheduling: Scheduling::Async,
            lb: DecodeLbPolicy::CountAndKv,
            expert_imbalance: 1.09,
        }
    }
}

/// How the unit's decode groups shut down and fail over (SPEC §8).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ElasticConfig {
    /// A decode group told to shut down keeps decoding this long, then forwards what is left.
    pub drain_grace: Nanos,
    /// From a decode rank's failure to its group's restart on the ranks left (EP failover).
    pub decode_recovery: Nanos,
    /// Where the sequences of a failed group's surviving ranks go.
    pub survivors: SurvivorPolicy,
}

/// What happens to the sequences on the surviving ranks of a group whose rank failed (those
/// on the dead rank lost their KV and are always prefilled again).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SurvivorPolicy {
    /// Their KV is still in HBM: migrated to another group over the handoff link.
    #[default]
    Migrate,
    /// Prefilled again like the dead rank's (the prompt from the store's hits): the
    /// comparison baseline for the migration.
    Reprefill,
}

impl Default for ElasticConfig {
    fn default() -> Self {
        ElasticConfig {
            drain_grace: Nanos::from_secs(60),
            // servelab's choice: detection, a new EP communicator and the experts' weights
            // loaded onto the survivors.
            decode_recovery: Nanos::from_secs(30),
            survivors: SurvivorPolicy::Migrate,
        }
    }
}

/// Everything a [`crate::unit::ServingUnit`] is built from.
#[derive(Clone, Debug, PartialEq)]
pub struct UnitConfig {
    pub constants: ServingConstants,
    pub hit_policy: HitPolicy,
    pub prefill: PrefillPoolConfig,
    pub decode: DecodePoolConfig,
    /// The chunk scheduler's and the balancer's prefill cost model.
    pub prefill_cost: PrefillCostModel,
    /// The DSpark budget's decode time model.
    pub decode_time: DecodeTimeModel,
    /// CPU time between decode steps under synchronous scheduling.
    pub sync_gap: Nanos,
    /// Requests arriving before this are served but not measured.
    pub warmup: Nanos,
    /// End of the measured window (None: the last arrival).
    pub measure_until: Option<Nanos>,
    pub series_interval: Nanos,
    /// One request in this many (by index) is written to the per-request table.
    pub sample_every: u32,
    /// A session's reused blocks are re-touched at most this often (0 = every turn).
    pub touch_coalesce: Nanos,
    pub elastic: ElasticConfig,
    /// Pools sized over time (None: fixed pools as configured).
    pub autoscale: Option<crate::unit::autoscale::AutoscaleConfig>,
}

impl UnitConfig {
    /// Checks the unit's own keys, named as in a service config (`prefill.gpus`, ...).
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.constants.validate()?;
        let p = &self.prefill;
        let d = &self.decode;
        if p.gpus == 0 || p.gpus_per_machine == 0 {
            return Err(ConfigError::invalid(
                "prefill.gpus",
                "pool and machine sizes must be positive",
            ));
        }
        if p.max_jobs_per_engine == 0 {
            return Err(ConfigError::invalid(
                "prefill.max_jobs_per_engine",
                "must be positive",
            ));
        }
        if !(p.expert_imbalance >= 1.0 && p.expert_imbalance.is_finite()) {
            return Err(ConfigError::invalid(
                "prefill.expert_imbalance",
                "must be at least 1",
            ));
        }
        p.chunking.validate()?;
        p.lb.validate()?;
        if d.groups == 0 || d.gpus_per_machine == 0 {
            return Err(ConfigError::invalid(
                "decode.groups",
                "pool and machine sizes must be positive",
            ));
        }
        if u64::from(d.groups) * u64::from(d.ranks) > u64::from(u32::MAX) {
            return Err(ConfigError::invalid(
                "decode.groups",
                "groups × ranks must be below 2^32",
            ));
        }
        self.group_config().validate()?;
        self.prefill_cost.validate("profile.prefill")?;
        self.decode_time.validate("profile.decode")?;
        if let Some(end) = self.measure_until
            && end <= self.warmup
        {
            return Err(ConfigError::invalid(
                "measure_until",
                format!("{end} must be later than warmup ({})", self.warmup),
            ));
        }
        if self.series_interval == Nanos::ZERO {
            return Err(ConfigError::invalid("series_interval", "must be positive"));
        }
        if self.sample_every == 0 {
            return Err(ConfigError::invalid("sample_every", "must be positive"));
        }
        if let Some(a) = &self.autoscale {
            a.validate(p.gpus, d.groups)?;
        }
        Ok(())
    }

    /// Machines of the unit: prefill machines first, then decode machines.
    pub fn machines(&self) -> u32 {
        let p = &self.prefill;
        let d = &self.decode;
        p.gpus.div_ceil(p.gpus_per_machine) + (d.groups * d.ranks).div_ceil(d.gpus_per_machine)
    }

    pub fn prefill_machines(&self) -> u32 {
        self.prefill.gpus.div_ceil(self.prefill.gpus_per_machine)
    }

    /// One decode group's engine configuration.
    pub fn group_config(&self) -> DecodeGroupConfig {
        let d = &self.decode;
        DecodeGroupConfig {
            ranks: d.ranks,
            max_seqs_per_rank: d.max_seqs_per_rank,
            kv_capacity_tokens_per_rank: d.kv_capacity_tokens_per_rank,
            max_waiting_per_rank: d.max_waiting_per_rank,
            draft_tokens: self.constants.draft_tokens,
            verification: d.verification.clone(),
            scheduling: d.scheduling,
            expert_imbalance: d.expert_imbalance,
        }
    }
}
