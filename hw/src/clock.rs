//! The engine loop's clocks (issue 6 item 2; SPEC §6 async scheduling, SPEC §16 replay).
//!
//! The policies in `core` never read a clock: they take `now`. The engine loop
//! ([`crate::conformance::drive_on`]) asks its [`Clock`] what `now` is, waits on it when there is
//! nothing to plan, and hands it each step plan; the clock runs the plan on its device and says
//! when the step ended. Three clocks:
//!
//! * [`VirtualClock`]: time moves by the durations the backend reports and jumps to the next
//!   arrival when idle (the free-running simulation, dry runs, calibration workloads).
//! * [`WallClock`]: `Instant` since the run's start. The device runs on its own thread; while a
//!   step is in flight the loop thread admits arrivals as their time comes (prefix match, hit
//!   rule, prefill backlog), so admission overlaps the device (SPEC §6: the CPU works while the
//!   GPU runs step N). A step ends when the loop sees its completion; idle waits sleep.
//! * [`RecordedClock`]: a recorded run's start and end times with its reports, for the replay:
//!   the same policies see the same times, so they must emit the same plans (SPEC §16).
//!
//! The loop admits, during step k, exactly the arrivals at or before its end (in arrival order,
//! before the completion is processed), and before planning step k + 1 those at or before its
//! start. The record holds both times, so a replay admits the same arrivals at the same points.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use servelab_core::Nanos;
use servelab_core::engine::{Backend, StepPlan, StepReport};

use crate::conformance::{RecordedBackend, RecordedStep};

/// Which clock a run used (stored in the record: the replay needs to know how a step's end was
/// set).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum ClockKind {
    /// Step end = start + the backend's duration; records from before the wall clock are these.
    #[default]
    Virtual,
    /// Step end = the wall time at which the loop saw the step complete.
    Wall,
}

impl ClockKind {
    pub fn name(self) -> &'static str {
        match self {
            ClockKind::Virtual => "virtual",
            ClockKind::Wall => "wall",
        }
    }
}

impl fmt::Display for ClockKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What the loop's admission callback did: how many arrivals it admitted and when the next
/// pending one arrives (None: none left).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Admitted {
    pub count: usize,
    pub next: Option<Nanos>,
}

/// The engine loop's time source and step runner.
pub trait Clock {
    fn kind(&self) -> ClockKind;
    /// The time the loop plans at (called after the previous completion was processed).
    fn now(&mut self) -> Nanos;
    /// Nothing to plan before the arrival at `t`: wait until `t` has passed.
    fn wait_until(&mut self, t: Nanos);
    /// Runs `plan`, planned at `start`, filling `report`; returns the step's end (> `start`).
    /// A clock whose step is in flight while time passes calls `admit(now)` whenever an
    /// arrival is due ("admit every arrival at or before `now`"). None: the device failed
    /// (the clock keeps the error for its owner); the loop stops.
    fn step(
        &mut self,
        start: Nanos,
        plan: &StepPlan,
        report: &mut StepReport,
        admit: &mut dyn FnMut(Nanos) -> Admitted,
    ) -> Option<Nanos>;
}

/// Time moves by the backend's reported durations (at least 1 ns per step) and jumps to the
/// next arrival when idle. The backend runs on the caller's thread; nothing overlaps it.
pub struct VirtualClock<'a> {
    backend: &'a mut dyn Backend,
    now: Nanos,
}

impl<'a> VirtualClock<'a> {
    pub fn new(backend: &'a mut dyn Backend) -> Self {
        Self {
            backend,
            now: Nanos::ZERO,
        }
    }
}

impl Clock for VirtualClock<'_> {
    fn kind(&self) -> ClockKind {
        ClockKind::Virtual
    }
    fn now(&mut self) -> Nanos {
        self.now
    }
    fn wait_until(&mut self, t: Nanos) {
        self.now = self.now.max(t);
    }
    fn step(
        &mut self,
        start: Nanos,
        plan: &StepPlan,
        report: &mut StepReport,
        _admit: &mut dyn FnMut(Nanos) -> Admitted,
    ) -> Option<Nanos> {
        self.backend.execute(start, plan, report);
        // A step always moves time forward, whatever the backend says.
        self.now = start + report.duration.max(Nanos(1));
        Some(self.now)
    }
}

/// A recorded run's times and reports. `now` is the next recorded step's start (or later, if
/// the replay has moved past it); a step ends at its recorded end (wall records) or start +
/// recorded duration (virtual records and records from before the wall clock, which reduces
/// to the virtual loop's replay). Plans that differ from the record are noted by the wrapped
/// [`RecordedBackend`].
pub struct RecordedClock<'a> {
    backend: RecordedBackend<'a>,
    steps: &'a [RecordedStep],
    kind: ClockKind,
    now: Nanos,
}

impl<'a> RecordedClock<'a> {
    pub fn new(steps: &'a [RecordedStep], kind: ClockKind) -> Self {
        Self {
            backend: RecordedBackend::new(steps),
            steps,
            kind,
            now: Nanos::ZERO,
        }
    }
    /// The reports' backend: plans asked for and mismatches so far.
    pub fn backend(&self) -> &RecordedBackend<'a> {
        &self.backend
    }
    pub fn into_backend(self) -> RecordedBackend<'a> {
        self.backend
    }
}

impl Clock for RecordedClock<'_> {
    fn kind(&self) -> ClockKind {
        self.kind
    }
    fn now(&mut self) -> Nanos {
        // Planning happens at the recorded start. Between the previous end and that start the
        // recorded loop only admitted arrivals (and, if idle, tried plans that came to
        // nothing, which change no policy state), so jumping there admits the same ones.
        if let Some(s) = self.steps.get(self.backend.steps_seen()) {
            self.now = self.now.max(Nanos(s.start_ns));
        }
        self.now
    }
    fn wait_until(&mut self, t: Nanos) {
        self.now = self.now.max(t);
    }
    fn step(
        &mut self,
        start: Nanos,
        plan: &StepPlan,
        report: &mut StepReport,
        _admit: &mut dyn FnMut(Nanos) -> Admitted,
    ) -> Option<Nanos> {
        let i = self.backend.steps_seen();
        self.backend.execute(start, plan, report);
        let span = match (self.kind, self.steps.get(i)) {
            (ClockKind::Wall, Some(s)) => s.end_ns.saturating_sub(s.start_ns),
            _ => report.duration.0,
        };
        self.now = start + Nanos(span.max(1));
        Some(self.now)
    }
}

/// How many arrivals the wall-clock loop has admitted while one of its steps was in flight;
/// the device thread may read it (a paced test device holds its first step until the loop has
/// shown that it admits during a step).
#[derive(Clone, Debug, Default)]
pub struct InFlight(Arc<AtomicU64>);

impl InFlight {
    pub fn admitted(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
}

struct Job {
    plan: StepPlan,
    report: StepReport,
}

enum Msg<E> {
    Ready,
    Done(Job),
    Failed(E),
}

/// `Instant` since the run's start (the first [`Clock::now`]), with the device on a worker
/// thread. The device is built on that thread by the factory given to [`WallClock::spawn`]
/// (the CUDA backend need not be `Send`), then runs one plan at a time: `step` sends the plan
/// and, until the completion arrives, sleeps until the next arrival and admits it. A device
/// error ends the run; [`WallClock::finish`] returns it.
pub struct WallClock<E> {
    t0: Option<Instant>,
    jobs: Option<mpsc::Sender<Job>>,
    done: mpsc::Receiver<Msg<E>>,
    worker: Option<JoinHandle<()>>,
    error: Option<E>,
    in_flight: InFlight,
}

impl<E: Send + 'static> WallClock<E> {
    /// Starts the device thread: `make` builds the device there (it gets the in-flight counter)
    /// and returns the function that runs one plan (filling the report, its `duration` the
    /// device's own measurement). Returns once the device is built, or with `make`'s error.
    pub fn spawn<F, X>(make: F) -> Result<Self, E>
    where
        F: FnOnce(InFlight) -> Result<X, E> + Send + 'static,
        X: FnMut(&StepPlan, &mut StepReport) -> Result<(), E> + 'static,
    {
        let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
        let (done_tx, done_rx) = mpsc::channel::<Msg<E>>();
        let in_flight = InFlight::default();
        let probe = in_flight.clone();
        let worker = std::thread::Builder::new()
            .name("servelab-device".into())
            .spawn(move || {
                let mut run = match make(probe) {
                    Ok(run) => run,
                    Err(e) => {
                        let _ = done_tx.send(Msg::Failed(e));
                        return;
                    }
                };
                if done_tx.send(Msg::Ready).is_err() {
                    return;
                }
                // Ends when the loop drops its sender (the run is over).
                while let Ok(mut job) = jobs_rx.recv() {
                    let msg = match run(&job.plan, &mut job.report) {
                        Ok(()) => Msg::Done(job),
                        Err(e) => Msg::Failed(e),
                    };
                    let failed = matches!(msg, Msg::Failed(_));
                    if done_tx.send(msg).is_err() || failed {
                        return;
                    }
                }
            })
            .expect("spawning the device thread");
        let mut clock = Self {
            t0: None,
            jobs: Some(jobs_tx),
            done: done_rx,
            worker: Some(worker),
            error: None,
            in_flight,
        };
        match clock.done.recv() {
            Ok(Msg::Ready) => Ok(clock),
            Ok(Msg::Failed(e)) => {
                clock.join();
                Err(e)
            }
            Ok(Msg::Done(_)) | Err(_) => clock.worker_gone(),
        }
    }

    /// Arrivals admitted while a step was in flight, so far.
    pub fn in_flight(&self) -> InFlight {
        self.in_flight.clone()
    }

    /// Stops the device thread; the device's error, if a step failed.
    pub fn finish(mut self) -> Result<(), E> {
        self.join();
        match self.error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl<E> WallClock<E> {
    fn t0(&mut self) -> Instant {
        *self.t0.get_or_insert_with(Instant::now)
    }

    fn instant(&mut self, t: Nanos) -> Instant {
        self.t0() + Duration::from_nanos(t.0)
    }

    /// Closes the job channel and waits for the device thread; re-raises its panic.
    fn join(&mut self) {
        self.jobs = None;
        if let Some(h) = self.worker.take()
            && let Err(panic) = h.join()
        {
            std::panic::resume_unwind(panic);
        }
    }

    /// The device thread ended without an answer: it panicked (it answers every job otherwise).
    fn worker_gone(&mut self) -> ! {
        self.join();
        panic!("the device thread ended without answering");
    }

    fn admit_in_flight(&mut self, admit: &mut dyn FnMut(Nanos) -> Admitted) -> Option<Nanos> {
        let now = self.now();
        let a = admit(now);
        self.in_flight.0.fetch_add(a.count as u64, Ordering::AcqRel);
        a.next
    }
}

impl<E> Drop for WallClock<E> {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(h) = self.worker.take() {
            let _ = h.join();
        }
    }
}

impl<E> Clock for WallClock<E> {
    fn kind(&self) -> ClockKind {
        ClockKind::Wall
    }

    fn now(&mut self) -> Nanos {
        Nanos(self.t0().elapsed().as_nanos() as u64)
    }

    fn wait_until(&mut self, t: Nanos) {
        let until = self.instant(t);
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            std::thread::sleep(left);
        }
    }

    fn step(
        &mut self,
        start: Nanos,
        plan: &StepPlan,
        report: &mut StepReport,
        admit: &mut dyn FnMut(Nanos) -> Admitted,
    ) -> Option<Nanos> {
        if self.error.is_some() {
            return None;
        }
        let job = Job {
            plan: plan.clone(),
            report: std::mem::take(report),
        };
        let sent = self.jobs.as_ref().is_some_and(|tx| tx.send(job).is_ok());
        if !sent {
            self.worker_gone();
        }
        // Arrivals that came while the plan was made are due now; then wait for the
        // completion or the next arrival, whichever comes first.
        let mut next = self.admit_in_flight(admit);
        loop {
            let msg = match next {
                Some(t) => {
                    let left = self.instant(t).saturating_duration_since(Instant::now());
                    match self.done.recv_timeout(left) {
                        Ok(m) => m,
                        Err(RecvTimeoutError::Timeout) => {
                            next = self.admit_in_flight(admit);
                            continue;
                        }
                        Err(RecvTimeoutError::Disconnected) => self.worker_gone(),
                    }
                }
                None => match self.done.recv() {
                    Ok(m) => m,
                    Err(_) => self.worker_gone(),
                },
            };
            match msg {
                Msg::Done(job) => {
                    *report = job.report;
                    // Seen now: every arrival admitted so far is at or before this time.
                    return Some(self.now().max(start + Nanos(1)));
                }
                Msg::Failed(e) => {
                    self.error = Some(e);
                    self.join();
                    return None;
                }
                Msg::Ready => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use servelab_core::EngineId;
    use servelab_core::engine::PrefillPlan;

    fn plan() -> StepPlan {
        StepPlan::Prefill(PrefillPlan {
            engine: EngineId(0),
            chunks: Vec::new(),
            expert_imbalance: 1.0,
        })
    }

    /// The wall clock sleeps until an idle deadline; during a step the loop is asked to admit
    /// an arrival due before the step completes (the device holds the step until it has been,
    /// so nothing depends on timing), and the step ends after that admission.
    #[test]
    fn wall_clock_admits_while_a_step_is_in_flight() {
        let mut c = WallClock::<String>::spawn(|probe: InFlight| {
            Ok(move |_: &StepPlan, r: &mut StepReport| {
                let give_up = Instant::now() + Duration::from_secs(10);
                while probe.admitted() == 0 && Instant::now() < give_up {
                    std::thread::sleep(Duration::from_millis(1));
                }
                r.duration = Nanos(7);
                Ok(())
            })
        })
        .unwrap();
        let t0 = c.now();
        c.wait_until(t0 + Nanos::from_millis(5));
        let start = c.now();
        assert!(start >= t0 + Nanos::from_millis(5));
        let arrival = start + Nanos::from_millis(2);
        let mut admitted_at = None;
        let mut report = StepReport::default();
        let end = c
            .step(start, &plan(), &mut report, &mut |t| {
                if admitted_at.is_none() && t >= arrival {
                    admitted_at = Some(t);
                    return Admitted {
                        count: 1,
                        next: None,
                    };
                }
                Admitted {
                    count: 0,
                    next: admitted_at.is_none().then_some(arrival),
                }
            })
            .unwrap();
        assert_eq!(report.duration, Nanos(7));
        assert_eq!(c.in_flight().admitted(), 1);
        let at = admitted_at.expect("admitted in flight");
        assert!(at >= arrival && end >= at, "{at} {end}");
        assert!(c.now() >= end);
        c.finish().unwrap();
    }

    /// A factory error comes back from `spawn`; a step error ends the run and comes back from
    /// `finish`.
    #[test]
    fn device_errors_come_back() {
        let e = WallClock::<String>::spawn(|_| {
            Err::<fn(&StepPlan, &mut StepReport) -> Result<(), String>, _>("no device".into())
        })
        .err()
        .unwrap();
        assert_eq!(e, "no device");
        let mut c = WallClock::<String>::spawn(|_| {
            Ok(|_: &StepPlan, _: &mut StepReport| Err("kernel failed".to_string()))
        })
        .unwrap();
        let start = c.now();
        let none = Admitted {
            count: 0,
            next: None,
        };
        assert!(
            c.step(start, &plan(), &mut StepReport::default(), &mut |_| none)
                .is_none()
        );
        assert!(
            c.step(start, &plan(), &mut StepReport::default(), &mut |_| none)
                .is_none()
        );
        assert_eq!(c.finish().unwrap_err(), "kernel failed");
    }

    /// The virtual clock: a step ends at start + duration (at least 1 ns), idle waits jump.
    #[test]
    fn virtual_clock_moves_by_durations() {
        struct Zero;
        impl Backend for Zero {
            fn execute(&mut self, _: Nanos, _: &StepPlan, r: &mut StepReport) {
                r.duration = Nanos::ZERO;
            }
        }
        let mut b = Zero;
        let mut c = VirtualClock::new(&mut b);
        c.wait_until(Nanos(100));
        c.wait_until(Nanos(50));
        assert_eq!(c.now(), Nanos(100));
        let mut none = |_| Admitted {
            count: 0,
            next: None,
        };
        let end = c.step(Nanos(100), &plan(), &mut StepReport::default(), &mut none);
        assert_eq!(end, Some(Nanos(101)));
        assert_eq!(c.now(), Nanos(101));
    }
}
