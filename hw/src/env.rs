//! The GPU engine as an environment of the serving unit ([`servelab_core::unit`]): the unit
//! decides, [`GpuEnv`] carries its outputs out on one GPU, and the one driver loop
//! ([`servelab_core::unit::run`]) joins them. No serving logic lives here.
//!
//! - Arrivals are released from the workload by arrival time.
//! - `Launch`: every device of the unit (prefill engines, decode groups) shares the one GPU, so
//!   launched steps queue FIFO and run one at a time; a step starts at the later of its planned
//!   start and the end of the step before it.
//! - `Fetch`: the hit prefix is in the pinned host tier and the backend swaps it in inside the
//!   prefill step (its cost is in the step), and the SWA state sits in the same host's tier,
//!   so the prefix is ready at once.
//! - `Handoff`: prefill and decode share the backend's one HBM pool on this GPU, so the KV is
//!   already where decode reads it: answered at once (no device-side copy is made; a unit
//!   spread over several GPUs would need one).
//! - `WakeAt` is honoured; `Tick`s come every series interval while the run is live.
//!
//! Two clocks ([`ClockKind`]): virtual (time moves by the CUDA-event durations, the device on
//! the caller's thread) and wall (the device on its own thread, [`WallDevice`]; inputs keep
//! being handled while a step is in flight). Either way the env records every input it fed and
//! every step (planned start, device start, end, duration, plan, report) in a [`RunOutcome`];
//! [`ReplayEnv`] feeds a record back and counts the plans that differ.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};
use servelab_core::Nanos;
use servelab_core::engine::{RankOutcome, SeqOutcome, StepPlan, StepReport};
use servelab_core::unit::{
    DeviceId, Environment, Input, Output, RunError, ServingUnit, SharedCache,
};

use crate::clock::{ClockKind, Job, WallDevice};

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
    /// serving unit, 2026-11-29: those replay no more, their steps still analyse).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inputs: Vec<LoggedInput>,
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

/// A device run on the caller's thread (virtual clock).
pub type StepFn<'d> = dyn FnMut(&StepPlan, &mut StepReport) -> Result<(), String> + 'd;

enum Gpu<'d> {
    Virtual {
        run: &'d mut StepFn<'d>,
        free_at: Nanos,
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
    pub run: RunOutcome,
}

impl<'d> GpuEnv<'d> {
    /// On the virtual clock, with `run` executing one plan on the GPU (or a stand-in).
    pub fn virtual_clock(run: &'d mut StepFn<'d>, unit: &ServingUnit<'_>) -> Self {
        Self::new(
            Gpu::Virtual {
                run,
                free_at: Nanos::ZERO,
            },
            unit,
            ClockKind::Virtual,
        )
    }

    /// On the wall clock, with the device on its thread (times from when it was ready).
    pub fn wall_clock(device: WallDevice<String>, unit: &ServingUnit<'_>) -> Self {
        Self::new(Gpu::Wall(device), unit, ClockKind::Wall)
    }

    fn new(gpu: Gpu<'d>, unit: &ServingUnit<'_>, clock: ClockKind) -> Self {
        let mut env = GpuEnv {
            gpu,
            schedule: BTreeMap::new(),
            seq: 0,
            last: Nanos::ZERO,
            requests: unit.requests().len(),
            arrivals_done: unit.requests().is_empty(),
            series_interval: unit.config().series_interval,
            open: VecDeque::new(),
            run: RunOutcome {
                steps: Vec::new(),
                requests: Vec::new(),
                end_ns: 0,
                clock,
                admitted_in_flight: 0,
                pinned_cpu: None,
                inputs: Vec::new(),
            },
        };
        if let Some(r) = unit.requests().first() {
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
        self.arrivals_done && self.open.is_empty()
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
        unit: &ServingUnit<'_>,
    ) -> Result<Option<Input>, RunError> {
        match input {
            Input::Arrival(i) => {
                let next = i as usize + 1;
                if next < self.requests {
                    self.push(unit.requests()[next].arrival, Input::Arrival(next as u32));
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
            _ => {}
        }
        Ok(Some(input))
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

    fn next_virtual(
        &mut self,
        unit: &mut ServingUnit<'_>,
    ) -> Result<Option<(Nanos, Input)>, RunError> {
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

    fn next_wall(
        &mut self,
        unit: &mut ServingUnit<'_>,
    ) -> Result<Option<(Nanos, Input)>, RunError> {
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
            let k = self.step_done(job.device, seen.max(self.last))?;
            let (_, report) = unit.launch_mut(job.device);
            *report = job.report;
            self.fill_step(k, report_of(unit, job.device));
            return Ok(Some(self.feed(seen, Input::StepDone(job.device), Some(k))));
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
        unit: &mut ServingUnit<'_>,
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
            Gpu::Virtual { run, free_at } => {
                let begin = start.max(*free_at);
                run(plan, report).map_err(RunError::Environment)?;
                // A step always moves time forward, whatever the device says.
                let end = begin + report.duration.max(Nanos(1));
                *free_at = end;
                Some((begin, end))
            }
            Gpu::Wall(dev) => {
                let job = Job {
                    device,
                    plan: plan.clone(),
                    report: std::mem::take(report),
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
        }
        Ok(())
    }
}

fn report_of<'u>(unit: &'u mut ServingUnit<'_>, device: DeviceId) -> &'u StepReport {
    unit.launch_mut(device).1
}

impl Environment for GpuEnv<'_> {
    fn next(&mut self, unit: &mut ServingUnit<'_>) -> Result<Option<(Nanos, Input)>, RunError> {
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
        unit: &mut ServingUnit<'_>,
        _shared: &SharedCache,
    ) -> Result<(), RunError> {
        match output {
            Output::Launch { device, start } => self.launch(device, start, unit)?,
            // The host tier holds the prefix; the swap-in is part of the prefill step.
            Output::Fetch { request, .. } => self.push(now, Input::PrefixReady(request)),
            // One HBM pool on one GPU: the KV is already where decode reads it.
            Output::Handoff { request, .. } => self.push(now, Input::HandoffDone(request)),
            Output::WakeAt(at) => self.push(at, Input::WakeUp),
            Output::Finished { .. } => {}
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
    last: Nanos,
    pub mismatches: Vec<String>,
}

impl<'r> ReplayEnv<'r> {
    pub fn new(record: &'r RunOutcome) -> Self {
        ReplayEnv {
            record,
            next_input: 0,
            launches: 0,
            last: Nanos::ZERO,
            mismatches: Vec::new(),
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
    fn next(&mut self, unit: &mut ServingUnit<'_>) -> Result<Option<(Nanos, Input)>, RunError> {
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
        _now: Nanos,
        output: Output,
        unit: &mut ServingUnit<'_>,
        _shared: &SharedCache,
    ) -> Result<(), RunError> {
        let Output::Launch { device, start } = output else {
            return Ok(());
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
