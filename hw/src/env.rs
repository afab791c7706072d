//! The GPU engine as an environment of the serving unit ([`servelab_core::unit`]): the unit
//! decides, [`GpuEnv`] carries its outputs out on one GPU, and the one driver loop
//! ([`servelab_core::unit::run`]) joins them. No serving logic lives here.
//!
//! - Arrivals are released from the workload by arrival time.
//! - `Launch`: each device of the unit (prefill engines, decode groups) runs on the GPUs of a
//!   placement ([`crate::placement`]; by default all share the one GPU). Each logical GPU
//!   keeps a FIFO queue on the virtual clock: a step starts at the later of its planned start
//!   and the end of the step before it on every GPU of its device, so steps of devices on
//!   different GPUs overlap. The wall clock runs every device on one device thread (one
//!   physical GPU).
//! - `Fetch`: the hit prefix is in the pinned host tier and the backend swaps it in inside the
//!   prefill step (its cost is in the step), and the SWA state sits in the same host's tier,
//!   so the prefix is ready at once.
//! - `Handoff`: each prefill engine and each decode group has its own KV region on the GPU
//!   (`backend.unit_devices`), so the request's KV blocks and SWA ring are copied device to
//!   device from its prefill engine's region into a decode group's, queued FIFO with the steps
//!   of a GPU both devices share, or on the source GPU's copy engine when they share none.
//!   The copy's measured duration decides when `HandoffDone` comes (virtual clock: its
//!   CUDA-event time after the GPU's earlier work; wall clock: when the device thread has done
//!   it). The unit picks the group when `HandoffDone` arrives, so the copy goes to the group
//!   its decode balancer would pick at the handoff (the same balancer, run on the pool's state
//!   then); when the pick on arrival differs, the group's first step moves the KV again inside
//!   that step, and the record says so ([`RecordedHandoff::picked`]). A device whose handoff
//!   moves nothing (one shared pool) is answered at once.
//! - `Finished`: the device forgets the request's state.
//! - `WakeAt` is honoured; `Tick`s come every series interval while the run is live.
//!
//! Two clocks ([`ClockKind`]): virtual (time moves by the CUDA-event durations, the device on
//! the caller's thread) and wall (the device on its own thread, [`WallDevice`]; inputs keep
//! being handled while a step is in flight). Either way the env records every input it fed and
//! every step (planned start, device start, end, duration, plan, report) in a [`RunOutcome`];
//! [`ReplayEnv`] feeds a record back and counts the plans that differ.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};
use servelab_core::Nanos;
use servelab_core::engine::{DecodeBalancer, RankOutcome, SeqOutcome, StepPlan, StepReport};
use servelab_core::unit::{
    DeviceId, Environment, Input, Output, RunError, ServingUnit, SharedCache,
};

use crate::clock::{ClockKind, Job, WallDevice, Work};
pub use crate::clock::{HandoffJob, UnitDevice};
use crate::placement::{PlacementConfig, Timelines};

/// One executed plan and the device's answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RecordedStep {
    /// The `now` the policies planned it for (the launch's start).
    pub start_ns: u64,
    /// When the unit was told it ended (the `StepDone`'s time). 0 in records from before the
    /// wall clock, whose steps ended at start + duration ([`RecordedStep::end`]).
    #[serde(default)]
    pub end_ns: u64,
    /// The device's own measurement (CUDA events on the GPU): what step-time errors compare.
    pub duration_ns: u64,
    /// The unit device it ran for (absent in records of the one-device loop before the unit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<DeviceId>,
    /// Time it waited for the GPU behind other devices' steps (virtual clock; 0 on the wall
    /// clock, where that wait is part of end − start − duration).
    #[serde(default)]
    pub queued_ns: u64,
    pub plan: StepPlan,
    pub seqs: Vec<SeqOutcome>,
    pub ranks: Vec<RankOutcome>,
}

impl RecordedStep {
    /// The step's end: `end_ns`, or start + duration (at least 1 ns) where it was not recorded.
    pub fn end(&self) -> u64 {
        if self.end_ns > 0 {
            self.end_ns
        } else {
            self.start_ns + self.duration_ns.max(1)
        }
    }
    /// Time inside the step not covered by the device's duration (end − start − duration):
    /// host work and, with several devices on one GPU, waiting behind their steps.
    pub fn host_overhead_ns(&self) -> i64 {
        self.end() as i64 - self.start_ns as i64 - self.duration_ns as i64 - self.queued_ns as i64
    }
}

/// One handoff as the run carried it out.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RecordedHandoff {
    pub request: u32,
    /// The prefill engine whose KV region held the request.
    pub from: DeviceId,
    /// The decode group whose region the copy went to.
    pub to: DeviceId,
    /// The group the unit's decode balancer picked when the handoff arrived (None: not yet
    /// arrived when the run ended); differs from `to` when the pool changed in between.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub picked: Option<u32>,
    /// What the unit said moves (prompt KV and SWA state).
    pub unit_bytes: u64,
    /// What the device copied (whole KV blocks and the SWA ring; 0: nothing moved).
    pub bytes: u64,
    /// Destination blocks swapped out to make room.
    #[serde(default)]
    pub evicted_blocks: u32,
    /// When the unit asked for it.
    pub start_ns: u64,
    /// Virtual clock: time it waited for the GPU behind earlier work.
    #[serde(default)]
    pub queued_ns: u64,
    /// The device's own measurement (CUDA events).
    pub duration_ns: u64,
    /// When `HandoffDone` was fed (0: not fed).
    pub end_ns: u64,
    /// The placement put the two devices on different GPUs: a peer copy between GPUs in the
    /// deployment (on a machine with fewer GPUs than the placement, the copy that ran and was
    /// timed is the one between the devices' regions on the physical GPU).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub peer: bool,
}

impl RecordedHandoff {
    /// Bytes the device copied per second of its measured copy time (0: nothing timed).
    pub fn bytes_per_s(&self) -> f64 {
        if self.duration_ns == 0 {
            return 0.0;
        }
        self.bytes as f64 / (self.duration_ns as f64 * 1e-9)
    }
}

/// One input the unit handled. A step's end is not repeated here: `StepDone` entries name
/// the step (its index in [`RunOutcome::steps`]) and take their time from its `end_ns`, so a
/// record whose step end was moved replays differently.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoggedInput {
    #[serde(default)]
    pub at_ns: u64,
    pub input: Input,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<u32>,
}

/// One request as the run saw it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RequestOutcome {
    pub request: u64,
    pub arrival_ns: u64,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    pub hit_tokens: u32,
    pub encoder_tokens: u32,
    /// None when the request was rejected.
    pub first_token_ns: Option<u64>,
    pub last_token_ns: Option<u64>,
}

impl RequestOutcome {
    pub fn ttft_ns(&self) -> Option<u64> {
        self.first_token_ns.map(|f| f - self.arrival_ns)
    }
    /// Mean time per output token after the first.
    pub fn tpot_ns(&self) -> Option<f64> {
        match (self.first_token_ns, self.last_token_ns) {
            (Some(f), Some(l)) if self.output_tokens > 1 => {
                Some((l - f) as f64 / f64::from(self.output_tokens - 1))
            }
            _ => None,
        }
    }
}

/// What a run produced: every step, every input and every request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunOutcome {
    pub steps: Vec<RecordedStep>,
    pub requests: Vec<RequestOutcome>,
    pub end_ns: u64,
    /// The clock the run's times are on (records from before the wall clock: virtual).
    #[serde(default)]
    pub clock: ClockKind,
    /// Arrivals handled while a step was in flight (wall clock; 0 on the virtual clock).
    #[serde(default)]
    pub admitted_in_flight: u64,
    /// The CPU every thread of a wall-clock GPU run was pinned to (see [`crate::affinity`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pinned_cpu: Option<usize>,
    /// Every input the unit handled, in order (empty in records of the engine loop before the
    /// serving unit: those replay no more, their steps still analyse).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inputs: Vec<LoggedInput>,
    /// Every handoff, in the order the unit asked for them (empty in records of the one shared
    /// pool, whose handoffs were answered at once).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub handoffs: Vec<RecordedHandoff>,
    /// The GPUs the unit's devices ran on (virtual clock; absent in records from before
    /// placements, whose devices all shared the one GPU).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<PlacementConfig>,
}

impl RunOutcome {
    /// An empty outcome on `clock`.
    pub fn empty(clock: ClockKind) -> Self {
        RunOutcome {
            steps: Vec::new(),
            requests: Vec::new(),
            end_ns: 0,
            clock,
            admitted_in_flight: 0,
            pinned_cpu: None,
            inputs: Vec::new(),
            handoffs: Vec::new(),
            placement: None,
        }
    }
}

/// The request table of a finished unit's report (one row per request: the unit must have
/// been built with `sample_every = 1`).
pub fn request_outcomes(
    unit_reqs: &[servelab_core::Request],
    rows: &[servelab_core::unit::RequestRow],
) -> Vec<RequestOutcome> {
    rows.iter()
        .map(|row| {
            let r = &unit_reqs[row.request as usize];
            let done = row.outcome == "completed";
            let first = r.arrival.0 + (row.ttft_ms * 1e6).round() as u64;
            let last = first
                + (row.tpot_ms * 1e6 * f64::from(r.output_tokens.saturating_sub(1))).round() as u64;
            RequestOutcome {
                request: r.id.0,
                arrival_ns: r.arrival.0,
                prompt_tokens: r.prompt_tokens,
                output_tokens: r.output_tokens,
                hit_tokens: row.hit_tokens,
                encoder_tokens: r.prompt_tokens - row.hit_tokens,
                first_token_ns: done.then_some(first),
                last_token_ns: done.then_some(last),
            }
        })
        .collect()
}

enum Gpu<'d> {
    /// The device on the caller's thread.
    Virtual {
        run: &'d mut dyn UnitDevice,
        /// When each logical GPU of the placement is free.
        lines: Timelines,
    },
    Wall(WallDevice<String>),
}

/// The GPU environment: the schedule of arrivals, answers and wake-ups, the one GPU, and the
/// record of the run.
pub struct GpuEnv<'d> {
    gpu: Gpu<'d>,
    /// (time, sequence) → input: arrivals, immediate answers, wake-ups, ticks, and on the
    /// virtual clock the steps' ends.
    schedule: BTreeMap<(Nanos, u64), Input>,
    seq: u64,
    last: Nanos,
    requests: usize,
    arrivals_done: bool,
    series_interval: Nanos,
    /// Steps launched and not yet done: device → index in `run.steps`, in launch order.
    open: VecDeque<(DeviceId, usize)>,
    /// Handoffs asked for and not yet fed back: request → index in `run.handoffs`.
    handoffs_open: BTreeMap<u32, usize>,
    /// The prefill engine of each request's latest chunk (where its KV is).
    prefill_engine: BTreeMap<u32, u32>,
    /// The unit's decode balancer, run once per `HandoffDone` fed, as the unit runs it (so a
    /// round-robin counter stays in step); clones of it predict a handoff's group.
    mirror: DecodeBalancer,
    /// Requests that finished (released on the device; released again if a plan built before
    /// they finished touched them).
    finished: BTreeSet<u32>,
    pub run: RunOutcome,
}

impl<'d> GpuEnv<'d> {
    /// On the virtual clock, with `run` the GPU (or a stand-in) on this thread, every device of
    /// the unit sharing the one GPU.
    pub fn virtual_clock(run: &'d mut dyn UnitDevice, unit: &ServingUnit) -> Self {
        let c = unit.config();
        let shared = PlacementConfig::shared(c.prefill.gpus, c.decode.groups);
        let mut env = Self::virtual_placed(run, unit, shared);
        // Records of the one shared GPU stay as they were before placements.
        env.run.placement = None;
        env
    }

    /// On the virtual clock with the unit's devices on the GPUs of `placement`: each logical
    /// GPU keeps its own FIFO timeline, so steps of devices on different GPUs overlap, and a
    /// handoff between devices with no GPU in common runs on the source GPU's copy engine
    /// ([`Timelines`]). The placement must have been validated against the unit.
    pub fn virtual_placed(
        run: &'d mut dyn UnitDevice,
        unit: &ServingUnit,
        placement: PlacementConfig,
    ) -> Self {
        let mut env = Self::new(
            Gpu::Virtual {
                run,
                lines: Timelines::new(placement.clone()),
            },
            unit,
            ClockKind::Virtual,
        );
        env.run.placement = Some(placement);
        env
    }

    /// On the wall clock, with the device on its thread (times from when it was ready).
    pub fn wall_clock(device: WallDevice<String>, unit: &ServingUnit) -> Self {
        Self::new(Gpu::Wall(device), unit, ClockKind::Wall)
    }

    fn new(gpu: Gpu<'d>, unit: &ServingUnit, clock: ClockKind) -> Self {
        let mut env = GpuEnv {
            gpu,
            schedule: BTreeMap::new(),
            seq: 0,
            last: Nanos::ZERO,
            requests: unit.requests_given() as usize,
            arrivals_done: unit.requests_given() == 0,
            series_interval: unit.config().series_interval,
            open: VecDeque::new(),
            handoffs_open: BTreeMap::new(),
            prefill_engine: BTreeMap::new(),
            mirror: DecodeBalancer::new(unit.config().decode.lb),
            finished: BTreeSet::new(),
            run: RunOutcome::empty(clock),
        };
        if let Some(r) = unit.request(0) {
            env.push(r.arrival, Input::Arrival(0));
            env.push(env.series_interval, Input::Tick);
        }
        env
    }

    /// Stops the wall clock's device thread.
    pub fn finish(self) -> RunOutcome {
        if let Gpu::Wall(d) = self.gpu {
            d.finish();
        }
        self.run
    }

    fn push(&mut self, at: Nanos, input: Input) {
        self.seq += 1;
        self.schedule.insert((at, self.seq), input);
    }

    /// Nothing is left that could produce an input for a pending request.
    fn idle(&self) -> bool {
        self.arrivals_done && self.open.is_empty() && self.handoffs_open.is_empty()
    }

    /// The next scheduled input due at or before `now` (None: `now` = no limit).
    fn pop_due(&mut self, now: Option<Nanos>) -> Option<(Nanos, Input)> {
        let (&(t, s), _) = self.schedule.first_key_value()?;
        if now.is_some_and(|n| t > n) {
            return None;
        }
        let input = self.schedule.remove(&(t, s))?;
        Some((t, input))
    }

    /// Turns a scheduled input into the unit's next input (releasing the next arrival,
    /// re-arming ticks), or None for a tick or wake-up of a run that is over.
    fn scheduled(
        &mut self,
        t: Nanos,
        input: Input,
        unit: &ServingUnit,
    ) -> Result<Option<Input>, RunError> {
        match input {
            Input::Arrival(i) => {
                let next = i as usize + 1;
                if next < self.requests {
                    let r = unit.request(next as u32).ok_or_else(|| {
                        RunError::Invariant(format!("request {next} is not held before it arrives"))
                    })?;
                    self.push(r.arrival, Input::Arrival(next as u32));
                } else {
                    self.arrivals_done = true;
                }
                if !self.open.is_empty() && self.run.clock == ClockKind::Wall {
                    self.run.admitted_in_flight += 1;
                    if let Gpu::Wall(d) = &self.gpu {
                        d.in_flight().add(1);
                    }
                }
            }
            Input::Tick | Input::WakeUp if self.idle() && unit.pending() == 0 => return Ok(None),
            Input::Tick if self.idle() && self.schedule.is_empty() => {
                return Err(RunError::Stuck {
                    at: t,
                    pending: unit.pending(),
                    requests: unit.pending_requests(10),
                });
            }
            Input::Tick => self.push(t + self.series_interval, Input::Tick),
            Input::HandoffDone(i) => self.handoff_fed(t, i, unit),
            _ => {}
        }
        Ok(Some(input))
    }

    /// The group the unit's decode balancer picks for request `i` now (`advance`: as the unit
    /// does on `HandoffDone`; otherwise a prediction that leaves the balancer as it is).
    fn pick_group(&mut self, i: u32, unit: &ServingUnit, advance: bool) -> u32 {
        // The unit holds a request from before its arrival until after it ends.
        let ctx = unit.request(i).map_or(0, |r| u64::from(r.context_tokens()));
        let groups = unit.decode_pool().groups();
        let g = if advance {
            self.mirror.pick(groups, ctx).0
        } else {
            self.mirror.clone().pick(groups, ctx).0
        };
        g as u32
    }

    /// `HandoffDone(i)` is about to be fed at `t`: the handoff's end and the unit's pick.
    fn handoff_fed(&mut self, t: Nanos, i: u32, unit: &ServingUnit) {
        let picked = self.pick_group(i, unit, true);
        if let Some(k) = self.handoffs_open.remove(&i) {
            let h = &mut self.run.handoffs[k];
            h.end_ns = t.max(self.last).0;
            h.picked = Some(picked);
        }
    }

    /// The unit asked for request `i`'s handoff at `now`: the device copies it to the group
    /// the balancer would pick now (virtual: at once, answered when the copy ends on the GPU;
    /// wall: queued for the device thread).
    fn handoff(
        &mut self,
        now: Nanos,
        i: u32,
        bytes: u64,
        unit: &ServingUnit,
    ) -> Result<(), RunError> {
        let job = HandoffJob {
            request: i,
            from_engine: self.prefill_engine.get(&i).copied().unwrap_or(0),
            to_group: self.pick_group(i, unit, false),
            bytes,
        };
        let k = self.run.handoffs.len();
        self.run.handoffs.push(RecordedHandoff {
            request: i,
            from: DeviceId::Prefill(job.from_engine),
            to: DeviceId::Decode(job.to_group),
            picked: None,
            unit_bytes: bytes,
            bytes: 0,
            evicted_blocks: 0,
            start_ns: now.0,
            queued_ns: 0,
            duration_ns: 0,
            end_ns: 0,
            peer: false,
        });
        self.handoffs_open.insert(i, k);
        match &mut self.gpu {
            Gpu::Virtual { run, lines } => {
                let copy = run.handoff(&job).map_err(RunError::Environment)?;
                let mut at = now;
                if copy.duration_ns > 0 {
                    let (from, to) = (
                        DeviceId::Prefill(job.from_engine),
                        DeviceId::Decode(job.to_group),
                    );
                    let slot = lines.handoff(from, to, now, Nanos(copy.duration_ns));
                    self.run.handoffs[k].peer = !lines.placement().share_a_gpu(from, to);
                    at = slot.end;
                    self.run.handoffs[k].queued_ns = (slot.begin - now).0;
                }
                self.fill_handoff(k, &copy);
                self.push(at, Input::HandoffDone(i));
            }
            Gpu::Wall(dev) => {
                let not_before = dev.instant(now);
                dev.submit(Job {
                    device: DeviceId::Decode(job.to_group),
                    work: Work::Handoff {
                        job,
                        copy: Default::default(),
                    },
                    not_before,
                });
            }
        }
        Ok(())
    }

    fn fill_handoff(&mut self, k: usize, copy: &crate::backend::HandoffCopy) {
        let h = &mut self.run.handoffs[k];
        h.bytes = copy.bytes;
        h.evicted_blocks = copy.evicted_blocks;
        h.duration_ns = copy.duration_ns;
    }

    /// Tells the device to forget request `i`.
    fn release(&mut self, i: u32) {
        match &mut self.gpu {
            Gpu::Virtual { run, .. } => run.release(i),
            Gpu::Wall(dev) => {
                let not_before = dev.instant(Nanos::ZERO);
                dev.submit(Job {
                    device: DeviceId::Decode(0),
                    work: Work::Release(i),
                    not_before,
                });
            }
        }
    }

    /// After a step ran: releases again the finished requests its plan touched (a plan built
    /// before they finished), and notes where each prefill chunk's KV is.
    fn after_step(&mut self, plan: &StepPlan) {
        match plan {
            StepPlan::Prefill(p) => {
                for c in &p.chunks {
                    self.prefill_engine.insert(c.request.0 as u32, p.engine.0);
                }
            }
            StepPlan::Decode(d) => {
                let stale: Vec<u32> = d
                    .seqs
                    .iter()
                    .map(|s| s.request.0 as u32)
                    .filter(|r| self.finished.contains(r))
                    .collect();
                for r in stale {
                    self.release(r);
                }
            }
        }
    }

    /// The step on `device` ended (virtual: its scheduled end; wall: seen now).
    fn step_done(&mut self, device: DeviceId, end: Nanos) -> Result<usize, RunError> {
        let at = self
            .open
            .iter()
            .position(|&(d, _)| d == device)
            .ok_or_else(|| RunError::Environment(format!("{device:?} finished no step")))?;
        let (_, k) = self.open.remove(at).expect("position is in range");
        self.run.steps[k].end_ns = end.0;
        Ok(k)
    }

    fn feed(&mut self, t: Nanos, input: Input, step: Option<usize>) -> (Nanos, Input) {
        let t = t.max(self.last);
        self.last = t;
        self.run.end_ns = t.0;
        self.run.inputs.push(LoggedInput {
            at_ns: if step.is_some() { 0 } else { t.0 },
            input,
            step: step.map(|k| k as u32),
        });
        (t, input)
    }

    fn next_virtual(&mut self, unit: &mut ServingUnit) -> Result<Option<(Nanos, Input)>, RunError> {
        while let Some((t, input)) = self.pop_due(None) {
            if let Input::StepDone(d) = input {
                let k = self.step_done(d, t)?;
                return Ok(Some(self.feed(t, input, Some(k))));
            }
            if let Some(input) = self.scheduled(t, input, unit)? {
                return Ok(Some(self.feed(t, input, None)));
            }
        }
        Ok(None)
    }

    fn next_wall(&mut self, unit: &mut ServingUnit) -> Result<Option<(Nanos, Input)>, RunError> {
        loop {
            let Gpu::Wall(dev) = &mut self.gpu else {
                unreachable!("wall clock")
            };
            let now = dev.now();
            if let Some((t, input)) = self.pop_due(Some(now)) {
                if let Some(input) = self.scheduled(t, input, unit)? {
                    return Ok(Some(self.feed(t, input, None)));
                }
                continue;
            }
            if self.idle() && unit.pending() == 0 {
                return Ok(None);
            }
            let Gpu::Wall(dev) = &mut self.gpu else {
                unreachable!("wall clock")
            };
            if dev.queued() == 0 && self.schedule.is_empty() {
                return Ok(None);
            }
            let deadline = self.schedule.first_key_value().map(|(&(t, _), _)| t);
            let Some(job) = dev.receive(deadline).map_err(RunError::Environment)? else {
                continue;
            };
            let seen = dev.now();
            match job.work {
                Work::Step { plan, report } => {
                    let k = self.step_done(job.device, seen.max(self.last))?;
                    *unit.launch_mut(job.device).1 = report;
                    self.fill_step(k, report_of(unit, job.device));
                    self.after_step(&plan);
                    return Ok(Some(self.feed(seen, Input::StepDone(job.device), Some(k))));
                }
                Work::Handoff { job: h, copy } => {
                    if let Some(&k) = self.handoffs_open.get(&h.request) {
                        self.fill_handoff(k, &copy);
                    }
                    let input = Input::HandoffDone(h.request);
                    self.handoff_fed(seen, h.request, unit);
                    return Ok(Some(self.feed(seen, input, None)));
                }
                Work::Release(_) => continue,
            }
        }
    }

    fn fill_step(&mut self, k: usize, report: &StepReport) {
        let s = &mut self.run.steps[k];
        s.duration_ns = report.duration.0;
        s.seqs.clone_from(&report.seqs);
        s.ranks.clone_from(&report.ranks);
    }

    fn launch(
        &mut self,
        device: DeviceId,
        start: Nanos,
        unit: &mut ServingUnit,
    ) -> Result<(), RunError> {
        let k = self.run.steps.len();
        let (plan, report) = unit.launch_mut(device);
        self.run.steps.push(RecordedStep {
            start_ns: start.0,
            end_ns: 0,
            duration_ns: 0,
            device: Some(device),
            queued_ns: 0,
            plan: plan.clone(),
            seqs: Vec::new(),
            ranks: Vec::new(),
        });
        self.open.push_back((device, k));
        let ran = match &mut self.gpu {
            Gpu::Virtual { run, lines } => {
                run.step(plan, report).map_err(RunError::Environment)?;
                // A step always moves time forward, whatever the device says (the timeline
                // gives it at least 1 ns).
                let slot = lines.step(device, start, report.duration);
                Some((slot.begin, slot.end))
            }
            Gpu::Wall(dev) => {
                let job = Job {
                    device,
                    work: Work::Step {
                        plan: plan.clone(),
                        report: std::mem::take(report),
                    },
                    not_before: dev.instant(start),
                };
                dev.submit(job);
                None
            }
        };
        if let Some((begin, end)) = ran {
            self.run.steps[k].queued_ns = (begin - start).0;
            self.fill_step(k, report_of(unit, device));
            self.push(end, Input::StepDone(device));
            let plan = unit.launch_mut(device).0.clone();
            self.after_step(&plan);
        }
        Ok(())
    }
}

fn report_of(unit: &mut ServingUnit, device: DeviceId) -> &StepReport {
    unit.launch_mut(device).1
}

impl Environment for GpuEnv<'_> {
    fn next(&mut self, unit: &mut ServingUnit) -> Result<Option<(Nanos, Input)>, RunError> {
        let next = match self.gpu {
            Gpu::Virtual { .. } => self.next_virtual(unit)?,
            Gpu::Wall(_) => self.next_wall(unit)?,
        };
        if next.is_none() && unit.pending() > 0 {
            return Err(RunError::Stuck {
                at: self.last,
                pending: unit.pending(),
                requests: unit.pending_requests(10),
            });
        }
        Ok(next)
    }

    fn apply(
        &mut self,
        now: Nanos,
        output: Output,
        unit: &mut ServingUnit,
        _shared: &SharedCache,
    ) -> Result<(), RunError> {
        match output {
            Output::Launch { device, start } => self.launch(device, start, unit)?,
            // The host tier holds the prefix; the swap-in is part of the prefill step.
            Output::Fetch { request, .. } => self.push(now, Input::PrefixReady(request)),
            Output::Handoff { request, bytes, .. } => self.handoff(now, request, bytes, unit)?,
            Output::WakeAt(at) => self.push(at, Input::WakeUp),
            Output::TimerAt { at, timer } => self.push(at, Input::Timer(timer)),
            // Drains and failures are inputs the GPU environment never gives, so a forward
            // between decode groups cannot arise here.
            Output::Forward { request, .. } => {
                return Err(RunError::Environment(format!(
                    "request {request}: forwarding between decode groups is not modelled on the GPU"
                )));
            }
            Output::Finished { request, .. } => {
                self.finished.insert(request);
                self.release(request);
            }
        }
        Ok(())
    }
}

/// Feeds a record's inputs back to a unit at their recorded times, answering every step with
/// its recorded report, and notes every launch whose plan, device or start differs from the
/// record's.
pub struct ReplayEnv<'r> {
    record: &'r RunOutcome,
    next_input: usize,
    launches: usize,
    /// Handoffs the unit asked for so far.
    handoffs: usize,
    last: Nanos,
    pub mismatches: Vec<String>,
}

impl<'r> ReplayEnv<'r> {
    pub fn new(record: &'r RunOutcome) -> Self {
        ReplayEnv {
            record,
            next_input: 0,
            launches: 0,
            handoffs: 0,
            last: Nanos::ZERO,
            mismatches: Vec::new(),
        }
    }
    /// Handoffs the unit asked for so far.
    pub fn handoffs(&self) -> usize {
        self.handoffs
    }

    /// The unit asks for request `request`'s handoff at `now`: the record's handoff of the same
    /// index must be of the same request, size and time (records without handoffs, from the
    /// shared pool, are not checked).
    fn check_handoff(&mut self, now: Nanos, request: u32, bytes: u64) {
        let k = self.handoffs;
        self.handoffs += 1;
        if self.record.handoffs.is_empty() {
            return;
        }
        match self.record.handoffs.get(k) {
            None => self.mismatches.push(format!(
                "handoff {k} (request {request}): not in the record"
            )),
            Some(h) if (h.request, h.unit_bytes, h.start_ns) != (request, bytes, now.0) => {
                self.mismatches.push(format!(
                    "handoff {k}: request {request}, {bytes} B at {} ns; recorded request {}, \
                     {} B at {} ns",
                    now.0, h.request, h.unit_bytes, h.start_ns
                ))
            }
            Some(_) => {}
        }
    }
    /// Launches seen so far.
    pub fn launches(&self) -> usize {
        self.launches
    }
    /// Inputs fed so far.
    pub fn inputs_fed(&self) -> usize {
        self.next_input
    }
}

impl Environment for ReplayEnv<'_> {
    fn next(&mut self, unit: &mut ServingUnit) -> Result<Option<(Nanos, Input)>, RunError> {
        let Some(l) = self.record.inputs.get(self.next_input) else {
            return Ok(None);
        };
        self.next_input += 1;
        let mut t = Nanos(l.at_ns);
        if let (Input::StepDone(d), Some(k)) = (l.input, l.step) {
            let s = self.record.steps.get(k as usize).ok_or_else(|| {
                RunError::Environment(format!("input names step {k}, not in the record"))
            })?;
            t = Nanos(s.end());
            let report = unit.launch_mut(d).1;
            report.duration = Nanos(s.duration_ns);
            report.seqs.clone_from(&s.seqs);
            report.ranks.clone_from(&s.ranks);
        }
        if t < self.last {
            self.mismatches.push(format!(
                "input {}: {:?} at {} ns, before the previous input ({} ns)",
                self.next_input - 1,
                l.input,
                t.0,
                self.last.0
            ));
            t = self.last;
        }
        self.last = t;
        Ok(Some((t, l.input)))
    }

    fn apply(
        &mut self,
        now: Nanos,
        output: Output,
        unit: &mut ServingUnit,
        _shared: &SharedCache,
    ) -> Result<(), RunError> {
        let (device, start) = match output {
            Output::Launch { device, start } => (device, start),
            Output::Handoff { request, bytes, .. } => {
                self.check_handoff(now, request, bytes);
                return Ok(());
            }
            _ => return Ok(()),
        };
        let k = self.launches;
        self.launches += 1;
        let plan = &*unit.launch_mut(device).0;
        match self.record.steps.get(k) {
            None => self.mismatches.push(format!(
                "step {k}: not in the record (the replay ran longer)"
            )),
            Some(s) if s.device.is_some_and(|d| d != device) => self.mismatches.push(format!(
                "step {k}: launched on {device:?}, recorded on {:?}",
                s.device
            )),
            Some(s) if s.plan != *plan => self.mismatches.push(format!(
                "step {k}: plan differs: {}",
                describe_diff(&s.plan, plan)
            )),
            Some(s) if s.start_ns != start.0 => self.mismatches.push(format!(
                "step {k}: same plan at {} ns instead of {} ns",
                start.0, s.start_ns
            )),
            Some(_) => {}
        }
        Ok(())
    }
}

pub fn describe_diff(want: &StepPlan, got: &StepPlan) -> String {
    let brief = |p: &StepPlan| match p {
        StepPlan::Prefill(p) => format!(
            "prefill {:?}",
            p.chunks
                .iter()
                .map(|c| (c.request.0, c.new_tokens, c.prefix_tokens))
                .collect::<Vec<_>>()
        ),
        StepPlan::Decode(d) => format!(
            "decode dynamic={} seqs {:?} budgets {:?}",
            d.dynamic,
            d.seqs
                .iter()
                .map(|s| (s.request.0, s.kv_tokens, s.max_drafts))
                .collect::<Vec<_>>(),
            d.ranks.iter().map(|r| r.verify_budget).collect::<Vec<_>>()
        ),
    };
    format!("recorded {} / replayed {}", brief(want), brief(got))
}
