//! The serving unit, written once (SPEC §3, §6–§8): entrypoint → prefill pool → handoff →
//! decode pool → write-back, as a sans-IO state machine. [`ServingUnit::handle`] takes `now`
//! and an [`Input`] and appends [`Output`]s; an environment (the simulator's virtual
//! environment, the GPU engine) carries them out and answers with later inputs, through the
//! one loop in [`drive`]. The caches it reads and writes ([`SharedCache`]) are passed in, so
//! several units can share one store.
//!
//! Components, each in its own module: [`entry`] (prefix match, hit rule, session memo, SWA
//! key, write-back), [`prefill_pool`] (balancer + engines), [`decode_pool`] (balancer + EP
//! groups, async double buffer), [`metrics`] (what the report is built from).

pub mod autoscale;
pub mod config;
pub mod decode_pool;
pub mod drive;
pub mod entry;
pub mod failover;
pub mod faults;
pub mod histogram;
pub mod io;
pub mod metrics;
pub mod prefill_faults;
pub mod prefill_pool;
pub mod report;
pub mod scaling;
pub mod shared;
pub mod state;
pub mod table;

pub use autoscale::{AutoscaleConfig, Bounds, ScalePolicy};
pub use config::{DecodePoolConfig, ElasticConfig, PrefillPoolConfig, SurvivorPolicy, UnitConfig};
pub use drive::{Environment, Lookahead, Member, Observer, RunError, run, run_cluster};
pub use entry::swa_object_key;
pub use histogram::Histogram;
pub use io::{DeviceId, Fault, Input, Outcome, Output, Rejection, Timer};
pub use report::{
    AutoscaleReport, EngineRow, FaultReport, Latencies, RejectionCount, RequestRow, ScaleRow,
    SeriesRow, ServiceReport, SteadyState,
};
pub use shared::SharedCache;

use crate::engine::{StepPlan, StepReport};
use crate::error::ConfigError;
use crate::ids::MachineId;
use crate::request::Request;
use crate::time::Nanos;
use decode_pool::{DecodePool, GroupStatus};
use entry::Entrypoint;
use faults::FaultState;
use metrics::{FinalState, UnitMetrics};
use prefill_pool::{Placed, PrefillPool};
use state::{RequestState, Status};
use table::Window;

pub struct ServingUnit {
    cfg: UnitConfig,
    /// The requests held ([`table`]): from the oldest that has not ended on.
    reqs: Window<Request>,
    state: Window<RequestState>,
    entry: Entrypoint,
    prefill: PrefillPool,
    decode: DecodePool,
    metrics: UnitMetrics,
    pending: u64,
    arrived: u64,
    /// Stripes of a store fetch (only used to prefetch the keys the fetch will read).
    fetch_stripes: usize,
    /// At most how many objects the run writes to the store, when the unit was given its
    /// requests up front (0 otherwise).
    objects_bound: usize,
    faults: FaultState,
    scaling: Option<scaling::Scaling>,
}

impl ServingUnit {
    /// A unit serving `reqs` (its requests, numbered by their index: inputs name them so).
    /// `reqs` must be keyed at the unit's block size.
    pub fn new(cfg: UnitConfig, reqs: &[Request]) -> Result<Self, ConfigError> {
        let last = reqs.iter().map(|r| r.arrival).max().unwrap_or(Nanos::ZERO);
        let mut unit = Self::streaming(cfg, last)?;
        unit.reqs = Window::with_capacity(reqs.len());
        unit.state = Window::with_capacity(reqs.len());
        for r in reqs {
            unit.push_request(r.clone())?;
        }
        unit.bound_store_objects(reqs);
        Ok(unit)
    }

    /// A unit given its requests one at a time ([`Self::push_request`]), by an environment
    /// that reads them from a stream. `last_arrival` bounds the arrivals (the steady-state
    /// window ends there or at `measure_until`, whichever is first).
    pub fn streaming(cfg: UnitConfig, last_arrival: Nanos) -> Result<Self, ConfigError> {
        cfg.validate()?;
        let mut unit = ServingUnit {
            entry: Entrypoint::new(cfg.constants.clone(), cfg.hit_policy, cfg.touch_coalesce),
            prefill: PrefillPool::new(&cfg.prefill, &cfg.prefill_cost)?,
            faults: FaultState::new(
                cfg.decode.groups,
                cfg.decode.ranks,
                cfg.decode.expert_imbalance,
            ),
            decode: DecodePool::new(&cfg)?,
            metrics: UnitMetrics::new(&cfg, last_arrival),
            state: Window::default(),
            reqs: Window::default(),
            pending: 0,
            arrived: 0,
            fetch_stripes: 8,
            objects_bound: 0,
            scaling: cfg.autoscale.clone().map(scaling::Scaling::new),
            cfg,
        };
        unit.scale_to_initial();
        Ok(unit)
    }

    /// Gives the unit its next request; returns the number inputs name it by. It must be
    /// keyed at the unit's block size. The environment gives a request before its
    /// [`Input::Arrival`], and a couple ahead of it when it can (the unit prefetches what the
    /// next arrivals will read).
    pub fn push_request(&mut self, r: Request) -> Result<u32, ConfigError> {
        let bs = self.cfg.constants.block_tokens;
        if r.block_tokens() != bs {
            return Err(ConfigError::invalid(
                "constants.block_tokens",
                format!(
                    "request {} is keyed at {} tokens per block, the unit at {bs}",
                    r.id,
                    r.block_tokens()
                ),
            ));
        }
        if self.reqs.end() >= u32::MAX as usize {
            return Err(ConfigError::invalid(
                "workload",
                "a unit serves fewer than 2^32 - 1 requests",
            ));
        }
        self.entry.push(&r);
        self.state.push(RequestState::NEW);
        Ok(self.reqs.push(r) as u32)
    }

    /// Forgets the oldest requests that have ended (and whose stale fetch answers are in),
    /// so that what the unit holds follows the requests in flight. Called at the start of
    /// each input, so that the environment may still read a request it was just told ended.
    fn forget_ended(&mut self) {
        while let Some(st) = self.state.front() {
            if !matches!(st.status, Status::Done | Status::Rejected(_)) || st.stale_ready > 0 {
                return;
            }
            self.state.pop_front();
            self.reqs.pop_front();
            self.entry.forget_front();
        }
    }

    /// Sets how many stripes the environment's store fetch reads (a prefetching hint only).
    pub fn set_fetch_stripes(&mut self, stripes: usize) {
        self.fetch_stripes = stripes.max(1);
    }

    pub fn config(&self) -> &UnitConfig {
        &self.cfg
    }
    /// Request `i`, while the unit holds it: from when it was given until the input after
    /// the one it ended in (and while later requests are still held: the unit forgets the
    /// oldest first).
    pub fn request(&self, i: u32) -> Option<&Request> {
        self.reqs.get(i as usize)
    }
    /// How many requests the unit was given.
    pub fn requests_given(&self) -> u32 {
        self.reqs.end() as u32
    }
    /// How many requests the unit holds now (given and not forgotten).
    pub fn requests_held(&self) -> usize {
        self.reqs.held()
    }
    /// Requests arrived and not yet ended.
    pub fn pending(&self) -> u64 {
        self.pending
    }
    pub fn arrived(&self) -> u64 {
        self.arrived
    }
    /// Requests arrived and still pending, in index order (for a stuck run's error).
    pub fn pending_requests(&self, at_most: usize) -> Vec<u64> {
        self.state
            .iter()
            .filter(|(_, s)| s.status == Status::Pending)
            .take(at_most)
            .map(|(i, _)| self.reqs[i].id.0)
            .collect()
    }
    /// An upper bound on the objects a run writes to the store (to reserve its table).
    /// (0 when the requests are streamed: nothing is known of them up front, unless
    /// [`Self::bound_store_objects`] was given them.)
    pub fn store_objects_bound(&self) -> usize {
        self.objects_bound
    }
    /// Sets [`Self::store_objects_bound`] from `reqs`, the table a streaming unit will be
    /// given one request at a time: sized once, the store does not rebuild its key table and
    /// copy its slab at every doubling, as it does when nothing is known up front.
    pub fn bound_store_objects(&mut self, reqs: &[Request]) {
        self.objects_bound =
            entry::blocks_written_bound(reqs, self.cfg.constants.block_tokens, self.cfg.hit_policy);
    }
    /// Keys of the full blocks inside the first `tokens` tokens of request `i`'s chain.
    pub fn blocks_within(&self, i: usize, tokens: u32) -> &[crate::content::BlockKey] {
        self.entry.blocks_within(i, tokens)
    }
    /// The machine (numbered across the unit, prefill first) of prefill engine `e`.
    pub fn prefill_machine(&self, e: u32) -> MachineId {
        MachineId(e / self.cfg.prefill.gpus_per_machine)
    }
    pub fn prefill_pool(&self) -> &PrefillPool {
        &self.prefill
    }
    pub fn decode_pool(&self) -> &DecodePool {
        &self.decode
    }

    /// The plan to run on `device` (after [`Output::Launch`]) and the report to fill in.
    pub fn launch_mut(&mut self, device: DeviceId) -> (&mut StepPlan, &mut StepReport) {
        match device {
            DeviceId::Prefill(e) => self.prefill.launch_mut(e as usize),
            DeviceId::Decode(g) => self.decode.launch_mut(g as usize),
        }
    }

    /// Handles one input at `now`, appending what the environment must do to `out`.
    pub fn handle(
        &mut self,
        now: Nanos,
        input: Input,
        sh: &mut SharedCache,
        out: &mut Vec<Output>,
    ) {
        self.forget_ended();
        match input {
            Input::Arrival(i) => self.arrival(now, i as usize, sh, out),
            Input::PrefixReady(i) => {
                let st = &mut self.state[i as usize];
                if st.stale_ready > 0 {
                    // The answer of a fetch onto an engine that failed since.
                    st.stale_ready -= 1;
                    return;
                }
                let e = st.engine as usize;
                self.prefill.set_ready(e, u64::from(i));
                self.start_prefill(now, e, out);
            }
            Input::StepDone(DeviceId::Prefill(e)) => {
                if !self.prefill_step_aborted(now, e as usize, out) {
                    self.prefill_done(now, e as usize, sh, out);
                }
            }
            Input::StepDone(DeviceId::Decode(g)) => {
                let g = g as usize;
                if self.decode.status(g) == (GroupStatus::Evicting { discard: true }) {
                    // The group failed during this step: its tokens are lost.
                    self.faults.report.lost_decode_steps += 1;
                    self.decode.step_lost(g);
                    self.evict_group(now, g, sh, out);
                } else {
                    self.decode_done(now, g, sh, out);
                }
            }
            Input::HandoffDone(i) => self.place_in_decode(now, i as usize, out),
            Input::Tick => {
                if self.scaling.is_some() {
                    self.autoscale_tick(now, out);
                }
                let gpus = (
                    self.cfg.prefill.gpus,
                    self.cfg.decode.groups * self.cfg.decode.ranks,
                );
                let queued = self.prefill.queued();
                self.metrics.tick(now, queued, gpus, self.cfg.decode.groups);
            }
            Input::WakeUp => {
                self.prefill.woke(now);
                self.pull_all(now, out);
            }
            Input::Drain(g) => self.drain(now, g as usize, out),
            Input::Fault(f) => self.fault(now, f, sh, out),
            Input::Repair(f) => self.repair(now, f, out),
            Input::Timer(t) => self.timer(now, t, sh, out),
        }
    }

    fn arrival(&mut self, now: Nanos, i: usize, sh: &mut SharedCache, out: &mut Vec<Output>) {
        // The trace's chains were built long ago and are cold, and so is the store's table:
        // a pipeline over the next arrivals starts loading, two ahead, the keys it will look up
        // and its session's memo; one ahead, what it will probe.
        for (ahead, near) in [(2, false), (1, true)] {
            if let Some(r) = self.reqs.get(i + ahead) {
                self.entry.prefetch_arrival(
                    i + ahead,
                    r.prompt_tokens,
                    near,
                    self.fetch_stripes,
                    sh,
                );
            }
        }
        let r = &self.reqs[i];
        let st = &mut self.state[i];
        st.status = Status::Pending;
        st.arrival = now;
        self.pending += 1;
        self.arrived += 1;
        self.metrics.on_arrival(now);
        if u64::from(r.context_tokens()) > self.cfg.decode.kv_capacity_tokens_per_rank {
            self.reject(i, Rejection::ContextTooLarge, out);
            return;
        }
        let adm = self.entry.admit(now, i, r, sh);
        let st = &mut self.state[i];
        st.hit_tokens = adm.decision.hit_tokens;
        st.encoder_tokens = adm.decision.encoder_tokens;
        st.swa_machine = adm.swa_machine;
        match self.prefill.submit(now, adm.job, r.prompt_tokens) {
            Placed::Engine(e) => self.assign(now, i, e as usize, out),
            Placed::Queued => self.pull_all(now, out),
            Placed::Rejected => self.reject(i, Rejection::PrefillQueueFull, out),
        }
    }

    fn reject(&mut self, i: usize, why: Rejection, out: &mut Vec<Output>) {
        self.state[i].status = Status::Rejected(why);
        self.pending -= 1;
        self.metrics
            .on_rejection(i, &self.reqs[i], &self.state[i], why);
        out.push(Output::Finished {
            request: i as u32,
            outcome: Outcome::Rejected(why),
        });
    }

    /// Lets engines pull queued requests (idle first, then the most quota left).
    fn pull_all(&mut self, now: Nanos, out: &mut Vec<Output>) {
        if !self.prefill.begin_pulls() {
            return;
        }
        while let Some((e, q)) = self.prefill.next_pull(now) {
            self.assign(now, q.request.0 as usize, e, out);
        }
        if let Some(at) = self.prefill.wake_needed() {
            out.push(Output::WakeAt(at));
        }
    }

    /// Request `i`'s job joins engine `e`; its KV fetch and SWA pull start now.
    fn assign(&mut self, now: Nanos, i: usize, e: usize, out: &mut Vec<Output>) {
        let swap_in_bytes = self.prefill.enqueue(i as u64, e);
        let reused = (swap_in_bytes / u64::from(self.cfg.constants.kv_bytes_per_token)) as u32;
        let machine = self.prefill_machine(e as u32);
        let st = &mut self.state[i];
        st.engine = e as u32;
        let swa_pull = st.swa_machine.is_some_and(|m| m != machine);
        if reused > 0 || swa_pull {
            out.push(Output::Fetch {
                request: i as u32,
                engine: e as u32,
                reused_tokens: reused,
                swa_pull,
            });
        } else {
            self.prefill.set_ready(e, i as u64);
            self.start_prefill(now, e, out);
        }
    }

    fn start_prefill(&mut self, now: Nanos, e: usize, out: &mut Vec<Output>) {
        if !self.prefill.plan_step(now, e) {
            return;
        }
        for c in &self.prefill.plan(e).chunks {
            let st = &mut self.state[c.request.0 as usize];
            if st.first_step == Nanos::ZERO {
                st.first_step = now.max(Nanos(1));
            }
        }
        out.push(Output::Launch {
            device: DeviceId::Prefill(e as u32),
            start: now,
        });
    }

    fn prefill_done(&mut self, now: Nanos, e: usize, sh: &mut SharedCache, out: &mut Vec<Output>) {
        let duration = self.prefill.report(e).duration;
        self.metrics
            .on_prefill_step(e, self.prefill.started(e), self.prefill.plan(e), duration);
        self.prefill.complete_step(e);
        let done = std::mem::take(&mut self.prefill.finished);
        let machine = self.prefill_machine(e as u32);
        self.entry.prefetch_chains(done.iter().map(|j| {
            (
                j.request.0 as usize,
                self.reqs[j.request.0 as usize].prompt_tokens,
            )
        }));
        let kv_bytes = u64::from(self.cfg.constants.kv_bytes_per_token);
        let swa_bytes = self.cfg.constants.swa_state_bytes();
        for (n, job) in done.iter().enumerate() {
            if let Some(next) = done.get(n + 1) {
                let j = next.request.0 as usize;
                self.entry.prefetch_write(j, self.reqs[j].prompt_tokens, sh);
            }
            let i = job.request.0 as usize;
            let (prompt, output) = (self.reqs[i].prompt_tokens, self.reqs[i].output_tokens);
            if self.state[i].reprefill {
                // Its KV is rebuilt; its first token and its blocks were out long ago.
                self.state[i].reprefill = false;
                out.push(Output::Handoff {
                    request: i as u32,
                    machine,
                    bytes: u64::from(job.prompt_tokens) * kv_bytes + swa_bytes,
                });
                continue;
            }
            if let Some(s) = self.scaling.as_mut() {
                s.on_first_token(now - self.state[i].arrival);
            }
            let st = &mut self.state[i];
            st.first_token = now;
            st.last_token = now;
            st.emitted = 1;
            self.entry.write_blocks(now, i, &self.reqs[i], prompt, sh);
            // SWA state at the last 128-multiple of the prompt (SPEC §5).
            self.store_swa(now, i, prompt, machine, sh);
            if output <= 1 {
                self.complete(now, i, sh, out);
                continue;
            }
            out.push(Output::Handoff {
                request: i as u32,
                machine,
                bytes: u64::from(prompt) * kv_bytes + swa_bytes,
            });
        }
        self.prefill.finished = done;
        self.pull_all(now, out);
        self.start_prefill(now, e, out);
    }

    fn store_swa(
        &mut self,
        now: Nanos,
        i: usize,
        at: u32,
        machine: MachineId,
        sh: &mut SharedCache,
    ) {
        let before = sh.store.used_bytes();
        let r = &self.reqs[i];
        self.entry.store_swa(now, i, r, at, machine, sh);
        if self.entry.policy().swa_source() == crate::hit::SwaSource::BlockStore {
            let after = sh.store.used_bytes();
            if after > before {
                self.metrics.on_swa_store_write(after - before);
            }
        }
    }

    fn start_decode(&mut self, start: Nanos, g: usize, out: &mut Vec<Output>) {
        if self.decode.plan_step(start, g) {
            out.push(Output::Launch {
                device: DeviceId::Decode(g as u32),
                start,
            });
        }
    }

    fn decode_done(&mut self, now: Nanos, g: usize, sh: &mut SharedCache, out: &mut Vec<Output>) {
        let ranks = self.decode.groups()[g].ranks();
        self.metrics.on_decode_step(
            g,
            self.decode.started(g),
            self.decode.plan(g),
            self.decode.report(g),
            ranks,
            self.decode.kv_fraction(g),
        );
        let window = self.metrics.window();
        let (step, next_start) = self.decode.step_done(
            now,
            g,
            &mut self.state,
            window,
            &mut self.metrics.lat.gap_ns,
        );
        // Credited to the step's start, like its busy time.
        let steady = self.metrics.in_steady(step.started);
        self.metrics.on_decode_emissions(
            g,
            steady,
            step.emissions,
            step.tokens,
            step.measured_tokens,
        );
        let finished = std::mem::take(&mut self.decode.finished);
        self.entry.prefetch_chains(
            finished
                .iter()
                .map(|&i| (i as usize, self.reqs[i as usize].context_tokens())),
        );
        for (n, &i) in finished.iter().enumerate() {
            if let Some(&j) = finished.get(n + 1) {
                let j = j as usize;
                self.entry
                    .prefetch_write(j, self.reqs[j].context_tokens(), sh);
            }
            self.complete(now, i as usize, sh, out);
        }
        self.decode.finished = finished;
        if matches!(self.decode.status(g), GroupStatus::Evicting { .. }) {
            // The grace period ended during this step: what is left leaves now.
            self.evict_group(now, g, sh, out);
        } else {
            self.start_decode(next_start, g, out);
        }
    }

    fn complete(&mut self, now: Nanos, i: usize, sh: &mut SharedCache, out: &mut Vec<Output>) {
        let (output, context) = (self.reqs[i].output_tokens, self.reqs[i].context_tokens());
        self.state[i].status = Status::Done;
        self.pending -= 1;
        if output > 1 {
            self.entry.write_blocks(now, i, &self.reqs[i], context, sh);
            let group = self.state[i].decode_group as usize;
            let machine = self.cfg.prefill_machines()
                + self.decode.first_rank_gpu(group) / self.cfg.decode.gpus_per_machine;
            self.store_swa(now, i, context, MachineId(machine), sh);
        }
        self.entry.record_output(&self.reqs[i], sh);
        if let Some(s) = self.scaling.as_mut() {
            let st = &self.state[i];
            if st.emitted > 1 {
                s.on_complete(Nanos(
                    (st.last_token - st.first_token).0 / u64::from(st.emitted - 1),
                ));
            }
        }
        self.metrics
            .on_complete(now, i, &self.reqs[i], &self.state[i]);
        out.push(Output::Finished {
            request: i as u32,
            outcome: Outcome::Completed,
        });
    }

    /// Checks that the run is over and consistent, and builds its report (`end`: the run's
    /// last time; `events`: inputs handled).
    pub fn finish(
        self,
        sh: &SharedCache,
        end: Nanos,
        events: u64,
    ) -> Result<ServiceReport, RunError> {
        let bad = |what: String| Err(RunError::Invariant(what));
        if let Some((i, _)) = self.state.iter().find(|(_, s)| s.status == Status::Pending) {
            return bad(format!(
                "request {} neither completed nor rejected",
                self.reqs[i].id
            ));
        }
        let rejected: u64 = self.metrics.rejected.iter().sum();
        if self.metrics.completed + rejected != self.arrived || self.pending != 0 {
            return bad(format!(
                "{} arrivals but {} completed + {rejected} rejected",
                self.arrived, self.metrics.completed
            ));
        }
        if self.faults.parked() > 0 {
            return bad(format!(
                "{} requests still wait for a decode group",
                self.faults.parked()
            ));
        }
        self.decode
            .check_invariants()
            .map_err(RunError::Invariant)?;
        self.prefill.check_idle().map_err(RunError::Invariant)?;
        // The caches' structural check walks every stored object (a few percent of a
        // production-size run in release builds); debug builds, which every test runs, do it,
        // and the swarm test checks them after every event.
        if cfg!(debug_assertions) {
            sh.check_invariants().map_err(RunError::Invariant)?;
        }
        let swa = sh.swa.stats();
        let lb = self.prefill.balancer();
        let f = FinalState {
            arrivals: self.arrived,
            end,
            events,
            prefill_gpus: self.cfg.prefill.gpus,
            decode_groups: self.cfg.decode.groups,
            decode_ranks: self.cfg.decode.ranks,
            max_seqs_per_rank: self.cfg.decode.max_seqs_per_rank,
            swa_hit_rate: swa.hits as f64 / swa.lookups.max(1) as f64,
            store_used_bytes: sh.store.used_bytes(),
            full_lookups: self.entry.full_lookups,
            memo_lookups: self.entry.memo_lookups,
            prefill_lb_rounds: lb.rounds(),
            prefill_tier_engines: if lb.pulls_by_tier() {
                lb.tier_engines()
            } else {
                Vec::new()
            },
            engine_tiers: self.prefill.engine_tiers(),
        };
        let mut report = self.metrics.into_report(f);
        report.faults = self.faults.report;
        report.autoscale = self.scaling.map(|s| s.report);
        Ok(report)
    }
}
