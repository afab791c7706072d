//! What a serving unit reports at the end of a run: the same report whichever environment
//! drove it, so a simulator run and a GPU run of one config compare field by field.

use crate::unit::histogram::Histogram;
use serde::{Deserialize, Serialize};

/// One sampled request (completed or rejected).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RequestRow {
    pub request: u64,
    pub class: &'static str,
    pub arrival_s: f64,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    pub hit_tokens: u32,
    pub outcome: &'static str,
    pub queue_ms: f64,
    pub ttft_ms: f64,
    pub tpot_ms: f64,
    pub max_gap_ms: f64,
    pub e2e_s: f64,
}

/// One interval of the run.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SeriesRow {
    pub t_s: f64,
    pub arrivals: u64,
    pub completions: u64,
    pub rejections: u64,
    pub prefill_tokens_per_s_per_gpu: f64,
    pub decode_tokens_per_s_per_gpu: f64,
    /// Busy fraction of the prefill pool in the interval.
    pub prefill_busy: f64,
    pub decode_seqs_per_rank: f64,
    pub kv_occupancy: f64,
    pub prefill_queued: u64,
}

/// Per engine (a prefill GPU, or a decode EP group).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EngineRow {
    pub pool: &'static str,
    pub engine: u32,
    /// Fraction of the run the engine was running a step.
    pub busy_fraction: f64,
    pub tokens_per_s_per_gpu: f64,
    pub steps: u64,
    /// Requests per prefill step; sequences per rank per decode step.
    pub mean_batch: f64,
    pub mean_kv_occupancy: f64,
    /// The prefill balancer's tier for this engine at the end of the run (tiered balancer);
    /// -1 for decode groups and push balancers.
    pub tier: i32,
}

/// Latency distributions of measured requests.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Latencies {
    pub ttft_ns: Histogram,
    pub tpot_ns: Histogram,
    pub e2e_ns: Histogram,
    pub queue_ns: Histogram,
    pub gap_ns: Histogram,
}

/// The unit in steady state: steps that started after the warm-up and before the last arrival
/// (ramp-up and drain excluded), comparable with the published steady-load operating points.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SteadyState {
    pub start_s: f64,
    pub end_s: f64,
    /// Output tokens per busy second per decode GPU.
    pub decode_tokens_per_s_per_gpu: f64,
    /// Output tokens per wall second per decode GPU (including idle time).
    pub decode_tokens_per_s_per_gpu_wall: f64,
    /// Running sequences per decode rank, averaged over steps.
    pub decode_seqs_per_rank: f64,
    /// `decode_seqs_per_rank` ÷ the rank's sequence slots: how full decode is.
    pub decode_slot_occupancy: f64,
    /// Fraction of the window a decode group was running a step.
    pub decode_busy_fraction: f64,
    pub decode_step_ms: f64,
    pub verified_drafts_per_seq_step: f64,
    pub accepted_length: f64,
    /// Non-cached input tokens per busy second per prefill GPU.
    pub prefill_tokens_per_s_per_gpu: f64,
    pub prefill_busy_fraction: f64,
}

/// Requests that did not complete, per reason.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RejectionCount {
    pub reason: &'static str,
    pub requests: u64,
    /// Of them, those that arrived inside the measured window.
    pub measured: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ServiceReport {
    pub arrivals: u64,
    pub completed: u64,
    pub rejected: Vec<RejectionCount>,
    /// Requests that arrived in the measured window (completed or rejected).
    pub measured_arrivals: u64,
    /// Measured rejections per traffic class.
    pub rejected_by_class: Vec<(&'static str, u64)>,
    /// Of them, those that completed (the latency histograms hold these).
    pub measured_requests: u64,
    pub measured_span_s: f64,
    pub simulated_s: f64,
    pub events: u64,
    pub all: Latencies,
    pub by_class: Vec<(&'static str, Latencies)>,
    pub input_tokens: u64,
    pub hit_tokens: u64,
    pub encoder_tokens: u64,
    pub output_tokens: u64,
    pub prefill_tokens_per_s_per_gpu: f64,
    pub decode_tokens_per_s_per_gpu: f64,
    /// Running sequences per decode rank, averaged over steps.
    pub decode_seqs_per_rank: f64,
    /// `decode_seqs_per_rank` ÷ `decode.max_seqs_per_rank`.
    pub decode_slot_occupancy: f64,
    pub verified_drafts_per_seq_step: f64,
    pub accepted_length: f64,
    /// Fraction of the run the prefill GPUs were running a step.
    pub prefill_busy_fraction: f64,
    /// Fraction of the run the decode groups were running a step.
    pub decode_busy_fraction: f64,
    pub swa_hit_rate: f64,
    pub store_used_bytes: u64,
    /// Bytes of SWA state written to the store (SWA-on-SSD rules; 0 otherwise).
    pub swa_store_bytes_written: u64,
    /// Mean expert imbalance (slowest rank ÷ mean) over prefill and decode steps.
    pub prefill_mean_imbalance: f64,
    pub decode_mean_imbalance: f64,
    /// EPLB reassignments and the engine time they cost (all engines; filled in by an
    /// environment that models them).
    pub moe_reassignments: u64,
    pub moe_reassignment_s: f64,
    /// Balancer rounds of the tiered prefill balancer, and its engines per tier at the end.
    pub prefill_lb_rounds: u64,
    pub prefill_tier_engines: Vec<u32>,
    /// Rates between the warm-up and the last arrival.
    pub steady: SteadyState,
    pub full_prefix_lookups: u64,
    pub memo_prefix_lookups: u64,
    pub requests: Vec<RequestRow>,
    pub series: Vec<SeriesRow>,
    pub engines: Vec<EngineRow>,
}

impl ServiceReport {
    pub fn hit_rate(&self) -> f64 {
        self.hit_tokens as f64 / self.input_tokens.max(1) as f64
    }
    pub fn rejected_total(&self) -> u64 {
        self.rejected.iter().map(|r| r.requests).sum()
    }
    /// Rejected ÷ arrived, in the measured window.
    pub fn measured_rejection_rate(&self) -> f64 {
        let rejected: u64 = self.rejected.iter().map(|r| r.measured).sum();
        rejected as f64 / self.measured_arrivals.max(1) as f64
    }
}
