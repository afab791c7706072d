//! Sans-IO engine state machines, the step plans they emit and the [`Backend`] that runs them.
//!
//! The prefill and decode engines and the balancers never execute anything and never read a
//! clock: an engine is asked for a [`StepPlan`] at `now`, something executes it (the simulator's
//! cost model, or the GPU engine), and the engine consumes the [`StepReport`] that comes back.
//! The simulator and the GPU engine differ only in the [`Backend`] and in where `now` comes from
//! (SPEC §16), so the same plans can be compared plan by plan.

pub mod decode;
pub mod dspark;
pub mod plan;
pub mod prefill;
pub mod prefill_lb;
pub mod vote;

pub use decode::{
    DecodeBalancer, DecodeGroup, DecodeGroupConfig, DecodeLbPolicy, Evicted, Scheduling,
    SeqEmission,
};
pub use dspark::{
    ActiveExpertTerm, BudgetScope, ConfidenceHistogram, DecodeTimeModel, VerificationPolicy,
};
pub use plan::{
    Backend, DecodePlan, DecodeRankPlan, DecodeSeq, PrefillChunk, PrefillPlan, RankOutcome,
    SeqOutcome, StepPlan, StepReport,
};
pub use prefill::{ChunkPolicy, PrefillCostModel, PrefillEngine, PrefillJob};
pub use prefill_lb::{PrefillBalancer, PrefillLbPolicy, QueuedPrefill};
pub use vote::{GroupVote, VoteMode};

/// The MoE part of a cost model, shared by the prefill and decode forms: the share of step time
/// spent in MoE layers and the imbalance at which the coefficients were measured.
pub(crate) fn validate_moe(
    field: &str,
    moe_share: f64,
    reference_imbalance: f64,
) -> Result<(), crate::ConfigError> {
    if !(0.0..=1.0).contains(&moe_share) {
        return Err(crate::ConfigError::invalid(
            format!("{field}.moe_share"),
            "must lie in [0, 1]",
        ));
    }
    if !(reference_imbalance >= 1.0 && reference_imbalance.is_finite()) {
        return Err(crate::ConfigError::invalid(
            format!("{field}.reference_imbalance"),
            "must be at least 1",
        ));
    }
    Ok(())
}
