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

/// One node failure of the run.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct NodeFailureRow {
    pub node: u32,
    pub at_s: f64,
    /// Groups that lost their objects with this failure, and what they held.
    pub groups_lost: u32,
    pub lost_objects: u64,
    pub lost_bytes: u64,
}

/// One rebuild of a replaced node.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RebuildRow {
    pub node: u32,
    pub started_s: f64,
    /// When the node answered reads again (NaN unless `outcome` is "done").
    pub finished_s: f64,
    /// `finished_s − started_s`: the rebuild time.
    pub duration_s: f64,
    /// Bytes of the node's shards to rebuild, and those read from the survivors for them.
    pub bytes: u64,
    pub read_bytes: u64,
    /// "done", "aborted" (the node failed again) or "unfinished" (the run ended first).
    pub outcome: &'static str,
}

/// The storage cluster over the run (SPEC §7): node failures, objects lost with their groups,
/// degraded reads, rebuilds and the write path. Filled in by an environment that models the
/// storage nodes (the simulator); all zero otherwise.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct StorageReport {
    pub node_failures: u64,
    pub node_repairs: u64,
    pub rebuilds_completed: u64,
    /// Times a group lost its objects (more than `parity` of its nodes unavailable).
    pub group_losses: u64,
    pub lost_objects: u64,
    /// Logical bytes of the objects lost (they are misses from then on).
    pub lost_bytes: u64,
    /// Writes refused because their group had lost its objects.
    pub writes_refused: u64,
    pub writes_refused_bytes: u64,
    /// Shard bytes the write-back wrote to the nodes (prefill blocks, replies, SWA objects).
    pub write_bytes: u64,
    /// Node time the writes took, summed over the nodes (0 with `store.node.charge_writes`
    /// off).
    pub write_busy_s: f64,
    /// Erasure-coded stripe reads of the hit prefixes.
    pub stripe_reads: u64,
    /// Of them, reads of a group with a node unavailable (degraded)…
    pub degraded_stripe_reads: u64,
    /// …and those with only `data` nodes left, all of which had to answer (no spare answer to
    /// hide a tail).
    pub no_spare_stripe_reads: u64,
    /// Stripes of hits decided before their group lost its objects and read after: not read,
    /// the data is gone. The unit still counts their tokens as hits (it cannot re-plan a job
    /// whose fetch failed), so this bounds the hits it overstates.
    pub lost_stripe_reads: u64,
    /// Bytes rebuilt onto replacement nodes, and read from the survivors for them.
    pub rebuild_bytes: u64,
    pub rebuild_read_bytes: u64,
    pub failures: Vec<NodeFailureRow>,
    pub rebuilds: Vec<RebuildRow>,
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
    /// The storage cluster: failures, losses, degraded reads, rebuilds, writes.
    pub storage: StorageReport,
    /// Drains, compute failures and what they moved (left out of the report when none).
    #[serde(skip_serializing_if = "FaultReport::is_empty")]
    pub faults: FaultReport,
    /// The autoscaler's decisions and GPU time (only with an autoscaler).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub autoscale: Option<AutoscaleReport>,
}

/// What the autoscaler did.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct AutoscaleReport {
    pub policy: &'static str,
    /// GPU-seconds paid for (provisioning, serving or draining), per pool.
    pub prefill_gpu_s: f64,
    pub decode_gpu_s: f64,
    /// Engines / groups added and removed.
    pub prefill_ups: u64,
    pub prefill_downs: u64,
    pub decode_ups: u64,
    pub decode_downs: u64,
    /// One row per metrics interval.
    pub rows: Vec<ScaleRow>,
}

impl AutoscaleReport {
    pub fn gpu_hours(&self) -> f64 {
        (self.prefill_gpu_s + self.decode_gpu_s) / 3600.0
    }
}

/// The pools and what the controller saw at the end of one interval.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ScaleRow {
    pub t_s: f64,
    /// Engines open / groups in service, as the controller counts them.
    pub prefill_engines: u32,
    pub decode_groups: u32,
    /// GPUs paid for in the interval.
    pub prefill_gpus: u32,
    pub decode_gpus: u32,
    pub prefill_busy: f64,
    pub decode_occupancy: f64,
    /// p90 TTFT / TPOT of the interval (NaN: no request).
    pub ttft_p90_s: f64,
    pub tpot_p90_s: f64,
}

/// What the unit's drains and compute failures did.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct FaultReport {
    /// Decode groups told to shut down, and those already down when told.
    pub drains: u64,
    pub drains_ignored: u64,
    /// Decode ranks, prefill engines and SWA hosts that failed; failures of a device already
    /// down (ignored); repairs.
    pub decode_rank_failures: u64,
    pub prefill_engine_failures: u64,
    pub swa_host_failures: u64,
    pub failures_ignored: u64,
    pub repairs: u64,
    /// Decode groups restarted on the ranks left, and the ranks they restarted with.
    pub group_restarts: u64,
    pub restart_ranks: Vec<u32>,
    /// Decode steps in flight on a failed group (their tokens are lost and decoded again).
    pub lost_decode_steps: u64,
    /// Unfinished requests forwarded with their KV to another group, and the bytes moved.
    pub forwarded_requests: u64,
    pub forwarded_bytes: u64,
    /// Requests whose KV died with a rank, prefilled again (prompt from the store's hits, the
    /// tokens emitted so far recomputed), and the tokens recomputed.
    pub reprefilled_requests: u64,
    pub reprefill_tokens: u64,
    /// Prefill jobs taken off a failed engine and given back to the balancer.
    pub requeued_prefill_jobs: u64,
    /// SWA states lost with their host.
    pub swa_states_lost: u64,
    /// Requests that waited for a decode group to come back up.
    pub parked_requests: u64,
}

impl FaultReport {
    pub fn is_empty(&self) -> bool {
        *self == FaultReport::default()
    }
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
