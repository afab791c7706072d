//! The GPU environment's clocks (issue 6 item 2; SPEC §6 async scheduling, SPEC §16 replay).
//!
//! The serving unit never reads a clock: it takes `now`. The GPU environment
//! ([`crate::env::GpuEnv`]) runs on one of two clocks:
//!
//! * virtual: time moves by the durations the device reports (CUDA events), steps queue on the
//!   one device and start when it is free;
//! * wall: `Instant` since the run's start. The device runs on its own thread
//!   ([`WallDevice`]); while a step is in flight the loop thread keeps handling inputs
//!   (arrivals as their time comes: prefix match, hit rule, balancer), so admission overlaps
//!   the device (SPEC §6: the CPU works while the GPU runs step N). A step ends when the loop
//!   sees its completion.
//!
//! Either way the record holds every input the unit handled and every step's start and end,
//! so a replay ([`crate::env::ReplayEnv`]) feeds the unit the same inputs at the same times.
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use servelab_core::Nanos;
use servelab_core::engine::{StepPlan, StepReport};
use servelab_core::unit::DeviceId;

use crate::backend::HandoffCopy;

/// Which clock a run used (stored in the record: the replay needs to know how a step's end was
/// set).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum ClockKind {
    /// Step end = device start + the device's duration; records from before the wall clock are
    /// these.
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

/// How many arrivals the loop has handled while one of the device's steps was in flight; the
/// device thread may read it (a paced test device holds its first step until the loop has
/// shown that it admits during a step).
#[derive(Clone, Debug, Default)]
pub struct InFlight(Arc<AtomicU64>);

impl InFlight {
    pub fn admitted(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }
    pub(crate) fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::AcqRel);
    }
}

/// A handoff for the device: request `request` (its index in the unit's table) moves from
/// prefill engine `from_engine`'s KV pool into decode group `to_group`'s; `bytes` is what the
/// unit says it moves (prompt KV and SWA state).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HandoffJob {
    pub request: u32,
    pub from_engine: u32,
    pub to_group: u32,
    pub bytes: u64,
}

/// What the GPU environment asks of its device (the CUDA backend, or a stand-in): run a plan,
/// move a handed-off request's state between the unit devices' pools, forget a finished
/// request. Every `FnMut(&StepPlan, &mut StepReport)` is a device whose handoffs move nothing
/// (one shared pool: answered at once) and that keeps nothing to forget.
pub trait UnitDevice<E = String> {
    /// Runs one plan, filling the report (its `duration` the device's own measurement).
    fn step(&mut self, plan: &StepPlan, report: &mut StepReport) -> Result<(), E>;
    /// Carries out a handoff; a zero duration means nothing had to move.
    fn handoff(&mut self, _job: &HandoffJob) -> Result<HandoffCopy, E> {
        Ok(HandoffCopy::default())
    }
    /// The request finished: its state on the device may go.
    fn release(&mut self, _request: u32) {}
}

impl<E, F> UnitDevice<E> for F
where
    F: FnMut(&StepPlan, &mut StepReport) -> Result<(), E> + ?Sized,
{
    fn step(&mut self, plan: &StepPlan, report: &mut StepReport) -> Result<(), E> {
        self(plan, report)
    }
}

/// The work of one job.
pub enum Work {
    /// A step: its plan and the report to fill.
    Step { plan: StepPlan, report: StepReport },
    /// A handoff and the copy's answer.
    Handoff { job: HandoffJob, copy: HandoffCopy },
    /// Forget a finished request (not answered).
    Release(u32),
}

/// One job for the device thread: the unit device it belongs to, its work, and the earliest
/// instant it may start (a synchronous decode step's host gap).
pub struct Job {
    pub device: DeviceId,
    pub work: Work,
    pub not_before: Instant,
}

enum Msg<E> {
    Ready,
    Done(Job),
    Failed(E),
}

/// The device on a worker thread. It is built there by the factory given to
/// [`WallDevice::spawn`] (the CUDA backend need not be `Send`), then runs the jobs it is sent
/// one at a time, in order (one GPU shared by every device of the unit: steps and handoff
/// copies queue FIFO). A device error ends the thread; it comes back from the next receive.
pub struct WallDevice<E> {
    t0: Instant,
    jobs: Option<mpsc::Sender<Job>>,
    done: mpsc::Receiver<Msg<E>>,
    worker: Option<JoinHandle<()>>,
    in_flight: InFlight,
    queued: usize,
}

impl<E: Send + 'static> WallDevice<E> {
    /// Starts the device thread: `make` builds the device there (it gets the in-flight counter)
    /// and returns the function that runs one plan (filling the report, its `duration` the
    /// device's own measurement). Returns once the device is built, or with `make`'s error.
    /// The clock starts when this returns.
    pub fn spawn<F, X>(make: F) -> Result<Self, E>
    where
        F: FnOnce(InFlight) -> Result<X, E> + Send + 'static,
        X: UnitDevice<E> + 'static,
    {
        let (jobs_tx, jobs_rx) = mpsc::channel::<Job>();
        let (done_tx, done_rx) = mpsc::channel::<Msg<E>>();
        let in_flight = InFlight::default();
        let probe = in_flight.clone();
        let worker = std::thread::Builder::new()
            .name("servelab-device".into())
            .spawn(move || device_thread(make, probe, jobs_rx, done_tx))
            .expect("spawning the device thread");
        let mut dev = Self {
            t0: Instant::now(),
            jobs: Some(jobs_tx),
            done: done_rx,
            worker: Some(worker),
            in_flight,
            queued: 0,
        };
        match dev.done.recv() {
            Ok(Msg::Ready) => {
                dev.t0 = Instant::now();
                Ok(dev)
            }
            Ok(Msg::Failed(e)) => {
                dev.join();
                Err(e)
            }
            Ok(Msg::Done(_)) | Err(_) => dev.worker_gone(),
        }
    }
}

fn device_thread<E, F, X>(
    make: F,
    probe: InFlight,
    jobs: mpsc::Receiver<Job>,
    done: mpsc::Sender<Msg<E>>,
) where
    F: FnOnce(InFlight) -> Result<X, E>,
    X: UnitDevice<E>,
{
    let mut run = match make(probe) {
        Ok(run) => run,
        Err(e) => {
            let _ = done.send(Msg::Failed(e));
            return;
        }
    };
    if done.send(Msg::Ready).is_err() {
        return;
    }
    // Ends when the loop drops its sender (the run is over).
    while let Ok(mut job) = jobs.recv() {
        let wait = job.not_before.saturating_duration_since(Instant::now());
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
        let ran = match &mut job.work {
            Work::Step { plan, report } => run.step(plan, report),
            Work::Handoff { job: h, copy } => run.handoff(h).map(|c| *copy = c),
            Work::Release(r) => {
                run.release(*r);
                continue;
            }
        };
        let msg = match ran {
            Ok(()) => Msg::Done(job),
            Err(e) => Msg::Failed(e),
        };
        let failed = matches!(msg, Msg::Failed(_));
        if done.send(msg).is_err() || failed {
            return;
        }
    }
}

impl<E> WallDevice<E> {
    /// Wall time since the device was ready.
    pub fn now(&self) -> Nanos {
        Nanos(self.t0.elapsed().as_nanos() as u64)
    }
    pub fn instant(&self, t: Nanos) -> Instant {
        self.t0 + Duration::from_nanos(t.0)
    }
    /// Counts arrivals handled while a step was in flight.
    pub fn in_flight(&self) -> InFlight {
        self.in_flight.clone()
    }
    /// Steps and handoffs sent and not yet received back.
    pub fn queued(&self) -> usize {
        self.queued
    }

    pub fn submit(&mut self, job: Job) {
        let answered = !matches!(job.work, Work::Release(_));
        let sent = self.jobs.as_ref().is_some_and(|tx| tx.send(job).is_ok());
        if !sent {
            self.worker_gone();
        }
        if answered {
            self.queued += 1;
        }
    }

    /// The next finished step, waiting until `deadline` at most (None: wait as long as it
    /// takes). Ok(None): the deadline passed first.
    pub fn receive(&mut self, deadline: Option<Nanos>) -> Result<Option<Job>, E> {
        let msg = match deadline {
            Some(t) => {
                let left = self.instant(t).saturating_duration_since(Instant::now());
                match self.done.recv_timeout(left) {
                    Ok(m) => m,
                    Err(RecvTimeoutError::Timeout) => return Ok(None),
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
                self.queued -= 1;
                Ok(Some(job))
            }
            Msg::Failed(e) => {
                self.join();
                Err(e)
            }
            Msg::Ready => Ok(None),
        }
    }

    /// Stops the device thread.
    pub fn finish(mut self) {
        self.join();
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
}

impl<E> Drop for WallDevice<E> {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(h) = self.worker.take() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use servelab_core::EngineId;
    use servelab_core::engine::PrefillPlan;

    fn job(dev: &WallDevice<String>) -> Job {
        Job {
            device: DeviceId::Prefill(0),
            work: Work::Step {
                plan: StepPlan::Prefill(PrefillPlan {
                    engine: EngineId(0),
                    chunks: Vec::new(),
                    expert_imbalance: 1.0,
                }),
                report: StepReport::default(),
            },
            not_before: dev.instant(Nanos::ZERO),
        }
    }

    /// Jobs run in order on the device thread; a receive with a deadline that passes first
    /// says so; a step error comes back from the receive and a factory error from `spawn`.
    #[test]
    fn device_runs_jobs_in_order_and_reports_errors() {
        let mut n = 0u64;
        let mut d = WallDevice::<String>::spawn(move |_| {
            Ok(move |_: &StepPlan, r: &mut StepReport| {
                n += 1;
                r.duration = Nanos(n);
                if n == 3 {
                    return Err("kernel failed".to_string());
                }
                Ok(())
            })
        })
        .unwrap();
        let j = job(&d);
        d.submit(j);
        let j = job(&d);
        d.submit(j);
        assert_eq!(d.queued(), 2);
        let duration = |j: Job| match j.work {
            Work::Step { report, .. } => report.duration,
            _ => panic!("a step was sent"),
        };
        let a = duration(d.receive(None).unwrap().unwrap());
        let b = duration(d.receive(None).unwrap().unwrap());
        assert_eq!((a, b), (Nanos(1), Nanos(2)));
        let soon = d.now() + Nanos::from_millis(2);
        assert!(d.receive(Some(soon)).unwrap().is_none());
        let j = job(&d);
        d.submit(j);
        assert_eq!(d.receive(None).err().unwrap(), "kernel failed");
        let e = WallDevice::<String>::spawn(|_| {
            Err::<fn(&StepPlan, &mut StepReport) -> Result<(), String>, _>("no device".into())
        })
        .err()
        .unwrap();
        assert_eq!(e, "no device");
    }
}
