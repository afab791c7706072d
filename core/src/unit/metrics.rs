//! What a serving unit measures while it runs: latencies, throughputs, per-engine and
//! per-interval rows, the steady-state window. Every environment gets the same figures.

use crate::engine::{DecodePlan, PrefillPlan, StepReport};
use crate::request::{Request, TrafficClass};
use crate::time::Nanos;
use crate::unit::config::UnitConfig;
use crate::unit::io::Rejection;
use crate::unit::report::{
    EngineRow, Latencies, RejectionCount, RequestRow, SeriesRow, ServiceReport, SteadyState,
    StorageReport,
};
use crate::unit::state::{RequestState, Status};

#[derive(Default, Clone, Copy)]
struct SteadyCounters {
    decode_busy_ns: u64,
    decode_steps: u64,
    decode_tokens: u64,
    decode_seq_steps: u64,
    decode_emissions: u64,
    decode_rank_steps: u64,
    verified: u64,
    prefill_busy_ns: u64,
    prefill_tokens: u64,
}

#[derive(Default, Clone, Copy)]
pub struct EngineStats {
    pub busy_ns: u64,
    pub steps: u64,
    pub tokens: u64,
    pub batch: u64,
    pub kv_weighted: f64,
}

/// Counters of the interval in progress.
#[derive(Default)]
struct Interval {
    row: SeriesRow,
    prefill_tokens: u64,
    decode_tokens: u64,
    prefill_busy: u64,
    decode_seq_steps: u64,
    decode_rank_steps: u64,
    kv: f64,
}

/// Token totals of measured, completed requests.
#[derive(Default, Clone, Copy)]
struct Tokens {
    input: u64,
    hit: u64,
    encoder: u64,
    output: u64,
}

pub struct UnitMetrics {
    warmup: Nanos,
    measure_until: Option<Nanos>,
    series_interval: Nanos,
    sample_every: u32,
    /// [warm-up, last arrival): the steady-state window.
    steady_window: (Nanos, Nanos),
    steady: SteadyCounters,
    pub(crate) rejected: [u64; Rejection::COUNT],
    rejected_measured: [u64; Rejection::COUNT],
    /// Measured rejections per traffic class.
    rejected_class: [u64; 3],
    pub(crate) completed: u64,
    measured_arrivals: u64,
    pub(crate) lat: Latencies,
    lat_class: [Latencies; 3],
    measured: u64,
    measured_first: Nanos,
    measured_last: Nanos,
    tokens: Tokens,
    verified: u64,
    seq_steps: u64,
    series: Vec<SeriesRow>,
    cur: Interval,
    rows: Vec<RequestRow>,
    pub(crate) prefill_stats: Vec<EngineStats>,
    pub(crate) decode_stats: Vec<EngineStats>,
    /// (Σ imbalance, steps) for prefill and decode.
    prefill_imbalance: (f64, u64),
    decode_imbalance: (f64, u64),
    pub(crate) swa_store_bytes: u64,
}

impl UnitMetrics {
    pub fn new(cfg: &UnitConfig, last_arrival: Nanos) -> Self {
        UnitMetrics {
            warmup: cfg.warmup,
            measure_until: cfg.measure_until,
            series_interval: cfg.series_interval,
            sample_every: cfg.sample_every,
            steady_window: (
                cfg.warmup,
                cfg.measure_until
                    .map_or(last_arrival, |m| m.min(last_arrival)),
            ),
            steady: SteadyCounters::default(),
            rejected: [0; Rejection::COUNT],
            rejected_measured: [0; Rejection::COUNT],
            rejected_class: [0; 3],
            completed: 0,
            measured_arrivals: 0,
            lat: Latencies::default(),
            lat_class: Default::default(),
            measured: 0,
            measured_first: Nanos::MAX,
            measured_last: Nanos::ZERO,
            tokens: Tokens::default(),
            verified: 0,
            seq_steps: 0,
            series: Vec::new(),
            cur: Interval::default(),
            rows: Vec::new(),
            prefill_stats: vec![EngineStats::default(); cfg.prefill.gpus as usize],
            decode_stats: vec![EngineStats::default(); cfg.decode.groups as usize],
            prefill_imbalance: (0.0, 0),
            decode_imbalance: (0.0, 0),
            swa_store_bytes: 0,
        }
    }

    /// A request that arrived at `arrival` is measured.
    #[inline]
    pub fn measured(&self, arrival: Nanos) -> bool {
        arrival >= self.warmup && self.measure_until.is_none_or(|m| arrival < m)
    }

    /// The bounds every decode emission checks ([`Self::measured`] by value).
    pub fn window(&self) -> (Nanos, Option<Nanos>) {
        (self.warmup, self.measure_until)
    }

    #[inline]
    pub fn in_steady(&self, t: Nanos) -> bool {
        t >= self.steady_window.0 && t < self.steady_window.1
    }

    pub fn on_arrival(&mut self, arrival: Nanos) {
        self.cur.row.arrivals += 1;
        if self.measured(arrival) {
            self.measured_arrivals += 1;
        }
    }

    pub fn on_rejection(&mut self, i: usize, r: &Request, st: &RequestState, why: Rejection) {
        self.rejected[why.index()] += 1;
        self.cur.row.rejections += 1;
        if self.measured(st.arrival) {
            self.rejected_measured[why.index()] += 1;
            self.rejected_class[r.class.index()] += 1;
        }
        self.sample_row(i, r, st);
    }

    /// A prefill step of engine `e` that started at `start` and ran `duration`.
    pub fn on_prefill_step(&mut self, e: usize, start: Nanos, plan: &PrefillPlan, d: Nanos) {
        self.prefill_imbalance.0 += plan.expert_imbalance;
        self.prefill_imbalance.1 += 1;
        let s = &mut self.prefill_stats[e];
        let toks = plan.new_tokens();
        s.busy_ns += d.0;
        s.steps += 1;
        s.tokens += toks;
        s.batch += plan.chunks.len() as u64;
        self.cur.prefill_tokens += toks;
        self.cur.prefill_busy += d.0;
        if self.in_steady(start) {
            self.steady.prefill_busy_ns += d.0;
            self.steady.prefill_tokens += toks;
        }
    }

    /// A decode step of group `g` (of `ranks` ranks) that started at `start`, with
    /// `kv_fraction` of the group's KV capacity held when it started.
    pub fn on_decode_step(
        &mut self,
        g: usize,
        start: Nanos,
        plan: &DecodePlan,
        report: &StepReport,
        ranks: u32,
        kv_fraction: f64,
    ) {
        self.decode_imbalance.0 += plan.expert_imbalance;
        self.decode_imbalance.1 += 1;
        let dur = report.duration;
        let s = &mut self.decode_stats[g];
        s.busy_ns += dur.0;
        s.steps += 1;
        s.batch += plan.seqs.len() as u64;
        s.kv_weighted += kv_fraction * dur.0 as f64;
        self.cur.kv += kv_fraction * dur.0 as f64;
        self.cur.decode_seq_steps += plan.seqs.len() as u64;
        self.cur.decode_rank_steps += u64::from(ranks);
        let verified: u64 = report.seqs.iter().map(|o| u64::from(o.verified)).sum();
        self.verified += verified;
        if self.in_steady(start) {
            let st = &mut self.steady;
            st.decode_busy_ns += dur.0;
            st.decode_steps += 1;
            st.decode_seq_steps += plan.seqs.len() as u64;
            st.decode_rank_steps += u64::from(ranks);
            st.verified += verified;
        }
    }

    /// What a decode step of group `g` emitted (`steady`: it started in the steady window).
    pub fn on_decode_emissions(
        &mut self,
        g: usize,
        steady: bool,
        emissions: u64,
        tokens: u64,
        measured_tokens: u64,
    ) {
        if steady {
            self.steady.decode_emissions += emissions;
            self.steady.decode_tokens += tokens;
        }
        self.decode_stats[g].tokens += tokens;
        self.cur.decode_tokens += tokens;
        self.seq_steps += emissions;
        self.tokens.output += measured_tokens;
    }

    pub fn on_swa_store_write(&mut self, bytes: u64) {
        self.swa_store_bytes += bytes;
    }

    /// Request `i` completed at `now`.
    pub fn on_complete(&mut self, now: Nanos, i: usize, r: &Request, st: &RequestState) {
        self.completed += 1;
        self.cur.row.completions += 1;
        if self.measured(st.arrival) {
            self.measured += 1;
            self.measured_first = self.measured_first.min(st.arrival);
            self.measured_last = self.measured_last.max(now);
            let ttft = st.first_token - st.arrival;
            let e2e = st.last_token - st.arrival;
            let queue = st.first_step - st.arrival;
            for l in [&mut self.lat, &mut self.lat_class[r.class.index()]] {
                l.ttft_ns.record(ttft.0);
                l.e2e_ns.record(e2e.0);
                l.queue_ns.record(queue.0);
                if r.output_tokens > 1 {
                    l.tpot_ns.record(
                        (st.last_token - st.first_token).0 / u64::from(r.output_tokens - 1),
                    );
                }
            }
            self.tokens.input += u64::from(r.prompt_tokens);
            self.tokens.hit += u64::from(st.hit_tokens);
            self.tokens.encoder += u64::from(st.encoder_tokens);
        }
        self.sample_row(i, r, st);
    }

    fn sample_row(&mut self, i: usize, r: &Request, st: &RequestState) {
        if !i.is_multiple_of(self.sample_every as usize) {
            return;
        }
        let done = st.status == Status::Done;
        let ms = |n: Nanos| n.as_millis_f64();
        let when = |v: f64| if done { v } else { f64::NAN };
        self.rows.push(RequestRow {
            request: r.id.0,
            class: r.class.name(),
            arrival_s: st.arrival.as_secs_f64(),
            prompt_tokens: r.prompt_tokens,
            output_tokens: r.output_tokens,
            hit_tokens: st.hit_tokens,
            outcome: match st.status {
                Status::Done => "completed",
                Status::Rejected(why) => why.name(),
                Status::Pending | Status::Future => "pending",
            },
            queue_ms: when(ms(st.first_step.saturating_sub(st.arrival))),
            ttft_ms: when(ms(st.first_token.saturating_sub(st.arrival))),
            tpot_ms: if done && r.output_tokens > 1 {
                ms(st.last_token - st.first_token) / f64::from(r.output_tokens - 1)
            } else {
                f64::NAN
            },
            max_gap_ms: when(ms(st.max_gap)),
            e2e_s: when(st.last_token.saturating_sub(st.arrival).as_secs_f64()),
        });
    }

    /// Closes the interval ending at `now`; `queued` prefill requests are waiting; `gpus` are
    /// the (prefill, decode) pool sizes.
    pub fn tick(&mut self, now: Nanos, queued: u64, gpus: (u32, u32), decode_groups: u32) {
        let dt = self.series_interval.as_secs_f64();
        let (prefill_gpus, decode_gpus) = gpus;
        let prefill_gpus = f64::from(prefill_gpus);
        let busy_ns = dt * 1e9;
        let cur = std::mem::take(&mut self.cur);
        let mut row = cur.row;
        row.t_s = now.as_secs_f64();
        row.prefill_tokens_per_s_per_gpu = cur.prefill_tokens as f64 / dt / prefill_gpus;
        row.decode_tokens_per_s_per_gpu = cur.decode_tokens as f64 / dt / f64::from(decode_gpus);
        row.prefill_busy = cur.prefill_busy as f64 / busy_ns / prefill_gpus;
        row.decode_seqs_per_rank =
            cur.decode_seq_steps as f64 / cur.decode_rank_steps.max(1) as f64;
        row.kv_occupancy = cur.kv / busy_ns / f64::from(decode_groups);
        row.prefill_queued = queued;
        self.series.push(row);
    }

    /// Prefill engine time spent in steps in the current interval (ns).
    pub fn interval_prefill_busy_ns(&self) -> u64 {
        self.cur.prefill_busy
    }

    /// Rows of interval series written so far.
    pub fn series_len(&self) -> usize {
        self.series.len()
    }
}

/// What the report needs from the rest of the unit at the end.
pub struct FinalState {
    pub arrivals: u64,
    pub end: Nanos,
    pub events: u64,
    pub prefill_gpus: u32,
    pub decode_groups: u32,
    pub decode_ranks: u32,
    pub max_seqs_per_rank: u32,
    pub swa_hit_rate: f64,
    pub store_used_bytes: u64,
    pub full_lookups: u64,
    pub memo_lookups: u64,
    pub prefill_lb_rounds: u64,
    pub prefill_tier_engines: Vec<u32>,
    /// Tier of each prefill engine (-1: no tiers).
    pub engine_tiers: Vec<i32>,
}

impl UnitMetrics {
    fn engine_rows(&self, f: &FinalState, t: f64) -> Vec<EngineRow> {
        let mut engines = Vec::new();
        for (i, s) in self.prefill_stats.iter().enumerate() {
            engines.push(EngineRow {
                pool: "prefill",
                engine: i as u32,
                busy_fraction: s.busy_ns as f64 / (t * 1e9),
                tokens_per_s_per_gpu: s.tokens as f64 / t,
                steps: s.steps,
                mean_batch: s.batch as f64 / s.steps.max(1) as f64,
                mean_kv_occupancy: f64::NAN,
                tier: f.engine_tiers.get(i).copied().unwrap_or(-1),
            });
        }
        let ranks = f64::from(f.decode_ranks);
        for (i, s) in self.decode_stats.iter().enumerate() {
            engines.push(EngineRow {
                pool: "decode",
                engine: i as u32,
                busy_fraction: s.busy_ns as f64 / (t * 1e9),
                tokens_per_s_per_gpu: s.tokens as f64 / t / ranks,
                steps: s.steps,
                mean_batch: s.batch as f64 / s.steps.max(1) as f64 / ranks,
                mean_kv_occupancy: s.kv_weighted / s.busy_ns.max(1) as f64,
                tier: -1,
            });
        }
        engines
    }

    fn steady_state(&self, f: &FinalState) -> SteadyState {
        let st = &self.steady;
        let (w0, w1) = self.steady_window;
        let span_ns = w1.saturating_sub(w0).0.max(1) as f64;
        let ranks = f64::from(f.decode_ranks);
        let decode_gpus = f64::from(f.decode_groups) * ranks;
        let seqs_per_rank = st.decode_seq_steps as f64 / st.decode_rank_steps.max(1) as f64;
        SteadyState {
            start_s: w0.as_secs_f64(),
            end_s: w1.max(w0).as_secs_f64(),
            decode_tokens_per_s_per_gpu: st.decode_tokens as f64
                / (st.decode_busy_ns.max(1) as f64 / 1e9)
                / ranks,
            decode_tokens_per_s_per_gpu_wall: st.decode_tokens as f64
                / (span_ns / 1e9)
                / decode_gpus,
            decode_seqs_per_rank: seqs_per_rank,
            decode_slot_occupancy: seqs_per_rank / f64::from(f.max_seqs_per_rank),
            decode_busy_fraction: st.decode_busy_ns as f64 / span_ns / f64::from(f.decode_groups),
            decode_step_ms: st.decode_busy_ns as f64 / st.decode_steps.max(1) as f64 / 1e6,
            verified_drafts_per_seq_step: st.verified as f64 / st.decode_seq_steps.max(1) as f64,
            accepted_length: st.decode_tokens as f64 / st.decode_emissions.max(1) as f64,
            prefill_tokens_per_s_per_gpu: st.prefill_tokens as f64
                / (st.prefill_busy_ns.max(1) as f64 / 1e9),
            prefill_busy_fraction: st.prefill_busy_ns as f64 / span_ns / f64::from(f.prefill_gpus),
        }
    }

    /// Rejections per reason: every reason of [`Rejection::ALL`], and the fault reasons that
    /// happened (so that runs without faults keep their report byte for byte).
    fn rejection_counts(&self) -> Vec<RejectionCount> {
        Rejection::ALL
            .iter()
            .chain(
                Rejection::FAULTS
                    .iter()
                    .filter(|r| self.rejected[r.index()] > 0),
            )
            .map(|r| RejectionCount {
                reason: r.name(),
                requests: self.rejected[r.index()],
                measured: self.rejected_measured[r.index()],
            })
            .collect()
    }

    pub fn into_report(self, f: FinalState) -> ServiceReport {
        let t = f.end.as_secs_f64().max(1e-9);
        let engines = self.engine_rows(&f, t);
        let steady = self.steady_state(&f);
        let span = (self.measured_last.saturating_sub(self.measured_first))
            .as_secs_f64()
            .max(1e-9);
        let ranks = f64::from(f.decode_ranks);
        let sum = |v: &[EngineStats], g: fn(&EngineStats) -> u64| v.iter().map(g).sum::<u64>();
        let busy_p = sum(&self.prefill_stats, |s| s.busy_ns);
        let busy_d = sum(&self.decode_stats, |s| s.busy_ns);
        let tok_p = sum(&self.prefill_stats, |s| s.tokens);
        let tok_d = sum(&self.decode_stats, |s| s.tokens);
        let seqs = sum(&self.decode_stats, |s| s.batch);
        let steps = sum(&self.decode_stats, |s| s.steps);
        let seqs_per_rank = seqs as f64 / steps.max(1) as f64 / ranks;
        ServiceReport {
            arrivals: f.arrivals,
            completed: self.completed,
            rejected: self.rejection_counts(),
            measured_arrivals: self.measured_arrivals,
            rejected_by_class: TrafficClass::ALL
                .iter()
                .map(|c| (c.name(), self.rejected_class[c.index()]))
                .collect(),
            measured_requests: self.measured,
            measured_span_s: span,
            simulated_s: t,
            events: f.events,
            by_class: TrafficClass::ALL
                .iter()
                .map(|c| (c.name(), self.lat_class[c.index()].clone()))
                .collect(),
            all: self.lat,
            input_tokens: self.tokens.input,
            hit_tokens: self.tokens.hit,
            encoder_tokens: self.tokens.encoder,
            output_tokens: self.tokens.output,
            // Busy-time rates: what a GPU delivers while it works (the published figures are
            // per busy GPU), alongside the busy fractions.
            prefill_tokens_per_s_per_gpu: tok_p as f64 / (busy_p.max(1) as f64 / 1e9),
            decode_tokens_per_s_per_gpu: tok_d as f64 / (busy_d.max(1) as f64 / 1e9) / ranks,
            decode_seqs_per_rank: seqs_per_rank,
            decode_slot_occupancy: seqs_per_rank / f64::from(f.max_seqs_per_rank),
            verified_drafts_per_seq_step: self.verified as f64 / seqs.max(1) as f64,
            accepted_length: tok_d as f64 / self.seq_steps.max(1) as f64,
            prefill_busy_fraction: busy_p as f64 / (t * 1e9) / f64::from(f.prefill_gpus),
            decode_busy_fraction: busy_d as f64 / (t * 1e9) / f64::from(f.decode_groups),
            swa_hit_rate: f.swa_hit_rate,
            store_used_bytes: f.store_used_bytes,
            swa_store_bytes_written: self.swa_store_bytes,
            prefill_mean_imbalance: self.prefill_imbalance.0
                / self.prefill_imbalance.1.max(1) as f64,
            decode_mean_imbalance: self.decode_imbalance.0 / self.decode_imbalance.1.max(1) as f64,
            moe_reassignments: 0,
            moe_reassignment_s: 0.0,
            prefill_lb_rounds: f.prefill_lb_rounds,
            prefill_tier_engines: f.prefill_tier_engines,
            steady,
            full_prefix_lookups: f.full_lookups,
            memo_prefix_lookups: f.memo_lookups,
            requests: self.rows,
            series: self.series,
            engines,
            storage: StorageReport::default(),
            faults: Default::default(),
            autoscale: None,
        }
    }
}
