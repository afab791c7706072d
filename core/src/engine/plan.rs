//! Step plans (what an engine asks a backend to run) and step reports (what the backend says
//! happened). Plans carry everything a cost model or a GPU needs and nothing about who runs them.

use crate::engine::dspark::ConfidenceHistogram;
use crate::ids::{EngineId, RequestId};
use crate::time::Nanos;
use serde::{Deserialize, Serialize};

/// One request's share of a prefill step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefillChunk {
    pub request: RequestId,
    /// Tokens computed in this chunk (encoder tokens, including any encoder-side replay).
    pub new_tokens: u32,
    /// Context already present before this chunk: the reused prefix plus earlier chunks.
    pub prefix_tokens: u32,
    /// Layers the new tokens go through (20 for this model's encoder, 40 for a decoder-only one).
    pub new_token_layers: u32,
    /// Decoder-side replay tokens computed in this chunk (the last chunk only).
    pub decoder_tokens: u32,
    /// Layers the decoder replay goes through.
    pub decoder_layers: u32,
    /// Cached KV swapped host → HBM during this chunk (the first chunk of a hit).
    pub swap_in_bytes: u64,
}

/// A prefill step of one engine.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PrefillPlan {
    pub engine: EngineId,
    pub chunks: Vec<PrefillChunk>,
    /// Slowest rank / mean of the MoE layers in this step (SPEC §9); 1.0 = perfectly balanced.
    pub expert_imbalance: f64,
}

impl PrefillPlan {
    pub fn new_tokens(&self) -> u64 {
        self.chunks.iter().map(|c| u64::from(c.new_tokens)).sum()
    }
}

/// One sequence of a decode step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecodeSeq {
    pub request: RequestId,
    /// KV length before this step.
    pub kv_tokens: u32,
    /// Drafts this sequence may verify at most (fewer near the end of its output).
    pub max_drafts: u32,
    /// The engine's slot for this sequence (its KV location on a GPU).
    pub slot: u32,
}

/// One DP rank's part of a decode step: `seqs[seq_start..seq_end]` of the plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DecodeRankPlan {
    pub seq_start: u32,
    pub seq_end: u32,
    /// Drafts this rank verifies in total; the backend splits it per sequence by confidence
    /// (the GPU kernel of SPEC §10). With fixed verification it is the sum of `max_drafts`.
    pub verify_budget: u32,
}

/// A lockstep decode step of one EP group (every rank steps together).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DecodePlan {
    pub engine: EngineId,
    pub ranks: Vec<DecodeRankPlan>,
    pub seqs: Vec<DecodeSeq>,
    /// True when the backend must split each rank's budget by confidence (dynamic
    /// verification); false when every sequence verifies its `max_drafts`.
    pub dynamic: bool,
    pub expert_imbalance: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum StepPlan {
    Prefill(PrefillPlan),
    Decode(DecodePlan),
}

impl StepPlan {
    pub fn as_prefill(&self) -> Option<&PrefillPlan> {
        match self {
            StepPlan::Prefill(p) => Some(p),
            StepPlan::Decode(_) => None,
        }
    }
    pub fn as_prefill_mut(&mut self) -> Option<&mut PrefillPlan> {
        match self {
            StepPlan::Prefill(p) => Some(p),
            StepPlan::Decode(_) => None,
        }
    }
    pub fn as_decode(&self) -> Option<&DecodePlan> {
        match self {
            StepPlan::Decode(p) => Some(p),
            StepPlan::Prefill(_) => None,
        }
    }
    pub fn as_decode_mut(&mut self) -> Option<&mut DecodePlan> {
        match self {
            StepPlan::Decode(p) => Some(p),
            StepPlan::Prefill(_) => None,
        }
    }
}

/// What happened to one decode sequence in a step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeqOutcome {
    /// Drafts verified.
    pub verified: u8,
    /// Drafts accepted (the verified prefix that matched); the step also emits one more token.
    pub accepted: u8,
}

/// Per-rank feedback a decode step returns: the confidences the draft head produced, which the
/// scheduler uses to fix the budget of a later step.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RankOutcome {
    pub confidence: ConfidenceHistogram,
}

/// The backend's answer to one plan.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepReport {
    pub duration: Nanos,
    /// One per `DecodePlan::seqs` entry (empty for prefill).
    pub seqs: Vec<SeqOutcome>,
    /// One per `DecodePlan::ranks` entry (empty for prefill).
    pub ranks: Vec<RankOutcome>,
}

/// Executes plans. The simulator implements it with a cost model, the GPU engine with kernels;
/// engines and balancers never know which one runs them. Object-safe: `&mut dyn Backend`.
pub trait Backend {
    /// Runs `plan`, started at `now`, and reports its duration and (for decode) what each
    /// sequence verified and accepted. `report` is reused between calls to avoid allocation.
    fn execute(&mut self, now: Nanos, plan: &StepPlan, report: &mut StepReport);
}
