//! The prefill pool of a serving unit (SPEC §6): the balancer and its engines, the jobs built
//! at arrival that wait for an engine, and each engine's current plan.
//!
//! Pull order: when queued work can go to several engines, an idle engine is served before a
//! busy one, then the engine with the most quota left (the least queued compute), ties by
//! index. Busy engines still pull while under their quota, so a step that starts on a busy
//! engine batches what it pulled; what they no longer hoard is work an idle engine could run now.

use crate::content::KeyBuildHasher;
use crate::engine::prefill_lb::Submitted;
use crate::engine::{
    PrefillBalancer, PrefillCostModel, PrefillEngine, PrefillJob, PrefillLbPolicy, PrefillPlan,
    QueuedPrefill, StepPlan, StepReport,
};
use crate::error::ConfigError;
use crate::ids::{EngineId, RequestId};
use crate::time::Nanos;
use crate::unit::config::PrefillPoolConfig;
use std::cmp::Ordering;
use std::collections::HashMap;

/// Where a submitted request went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placed {
    /// To this engine now.
    Engine(u32),
    /// Waiting in the balancer.
    Queued,
    /// The balancer's queue was full.
    Rejected,
}

pub struct PrefillPool {
    lb: PrefillBalancer,
    engines: Vec<PrefillEngine>,
    /// Each engine's current plan (always the prefill variant; stored as a [`StepPlan`]
    /// because that is what a backend executes).
    plans: Vec<StepPlan>,
    reports: Vec<StepReport>,
    /// When each engine's step in flight started.
    started: Vec<Nanos>,
    /// Jobs built at arrival, waiting for an engine.
    waiting: HashMap<u64, PrefillJob, KeyBuildHasher>,
    loads: Vec<f64>,
    cost: PrefillCostModel,
    imbalance: f64,
    least_loaded: bool,
    pub(crate) finished: Vec<PrefillJob>,
    /// The wake-up asked for and not yet delivered (None: none pending).
    wake_at: Option<Nanos>,
    /// Engines that failed and are not back; empty while none ever failed or closed.
    failed: Vec<bool>,
    /// Engines the autoscaler took out of service (they finish what they hold).
    closed: Vec<bool>,
    /// Closed engines the autoscaler is bringing back (paid for, not serving yet).
    provisioning: Vec<bool>,
    /// Engines whose step was in flight when they failed: its end is still to come, and the
    /// engine serves again only after it (so a late answer cannot be taken for a new step's).
    aborted: Vec<bool>,
    /// Repaired while their aborted step was still due.
    up_after_abort: Vec<bool>,
}

impl PrefillPool {
    pub fn new(cfg: &PrefillPoolConfig, cost: &PrefillCostModel) -> Result<Self, ConfigError> {
        let lb = PrefillBalancer::new(cfg.lb.clone(), cfg.gpus, cfg.max_queued_requests as usize)?;
        let n = cfg.gpus as usize;
        let engines = (0..cfg.gpus)
            .map(|i| {
                PrefillEngine::new(
                    EngineId(i),
                    cfg.chunking.clone(),
                    cost.clone(),
                    cfg.expert_imbalance,
                    cfg.max_jobs_per_engine as usize,
                )
            })
            .collect();
        Ok(PrefillPool {
            lb,
            engines,
            plans: (0..cfg.gpus)
                .map(|i| {
                    StepPlan::Prefill(PrefillPlan {
                        engine: EngineId(i),
                        chunks: Vec::new(),
                        expert_imbalance: 1.0,
                    })
                })
                .collect(),
            reports: vec![StepReport::default(); n],
            started: vec![Nanos::ZERO; n],
            waiting: HashMap::default(),
            loads: vec![0.0; n],
            cost: cost.clone(),
            imbalance: cfg.expert_imbalance,
            least_loaded: matches!(cfg.lb, PrefillLbPolicy::LeastLoaded),
            finished: Vec::new(),
            wake_at: None,
            failed: Vec::new(),
            closed: Vec::new(),
            provisioning: Vec::new(),
            aborted: Vec::new(),
            up_after_abort: Vec::new(),
        })
    }

    pub fn engines(&self) -> usize {
        self.engines.len()
    }
    pub fn engine(&self, e: usize) -> &PrefillEngine {
        &self.engines[e]
    }
    pub fn plan(&self, e: usize) -> &PrefillPlan {
        self.plans[e].as_prefill().expect("prefill plan")
    }
    pub fn report(&self, e: usize) -> &StepReport {
        &self.reports[e]
    }
    /// The step to launch on engine `e` and the report to fill in.
    pub fn launch_mut(&mut self, e: usize) -> (&mut StepPlan, &mut StepReport) {
        (&mut self.plans[e], &mut self.reports[e])
    }
    pub fn started(&self, e: usize) -> Nanos {
        self.started[e]
    }
    pub fn balancer(&self) -> &PrefillBalancer {
        &self.lb
    }
    /// Requests waiting in the balancer plus jobs held by engines.
    pub fn queued(&self) -> u64 {
        self.lb.queued() as u64 + self.engines.iter().map(|e| e.jobs() as u64).sum::<u64>()
    }
    pub fn is_idle(&self) -> bool {
        self.lb.queued() == 0
            && self.waiting.is_empty()
            && self.engines.iter().all(|e| e.jobs() == 0)
    }

    /// Hands request `job.request` (context `context_tokens`) to the balancer at `now`.
    pub fn submit(&mut self, now: Nanos, job: PrefillJob, context_tokens: u32) -> Placed {
        let compute_ns = PrefillEngine::job_ns(&self.cost, &job, self.imbalance);
        let q = QueuedPrefill {
            request: job.request,
            context_tokens,
            compute_ns,
            queued_at: now,
        };
        let id = job.request.0;
        self.waiting.insert(id, job);
        if self.least_loaded {
            for (l, e) in self.loads.iter_mut().zip(&self.engines) {
                *l = e.remaining_ns();
            }
        }
        match self.lb.submit(now, q, &self.loads) {
            // A push balancer's choice that cannot take the job yet: it waits in the
            // balancer's queue like any other, so the policy differs only in its choice.
            Submitted::Routed(e, q) if !self.can_take(e.0 as usize) => {
                if self.lb.hold(q) {
                    Placed::Queued
                } else {
                    self.waiting.remove(&id);
                    Placed::Rejected
                }
            }
            Submitted::Routed(e, _) => Placed::Engine(e.0),
            Submitted::Queued => Placed::Queued,
            Submitted::Rejected(_) => {
                self.waiting.remove(&id);
                Placed::Rejected
            }
        }
    }

    /// Moves request `i`'s job onto engine `e` (which has room); returns the bytes of cached
    /// KV the job swaps in (the hit and the encoder-replayed blocks, both read from the store).
    pub fn enqueue(&mut self, i: u64, e: usize) -> u64 {
        let job = self
            .waiting
            .remove(&i)
            .expect("a submitted request has its job");
        let bytes = job.swap_in_bytes;
        let taken = self.engines[e].enqueue(job);
        debug_assert!(
            taken.is_ok(),
            "engines are only given work when they have room"
        );
        bytes
    }

    pub fn set_ready(&mut self, e: usize, i: u64) {
        self.engines[e].set_ready(RequestId(i));
    }

    /// Starts a pull pass; false when no engine can pull (a push balancer holds nothing back,
    /// or nothing is queued).
    pub fn begin_pulls(&mut self) -> bool {
        self.lb.pulls() && self.lb.queued() > 0
    }

    /// The next engine to pull (idle first, then the most quota left, then index) and the
    /// request it gets; None when nothing more can be pulled in this pass.
    ///
    /// This is the first engine in that order whose pull succeeds: a failed pull takes
    /// nothing, and what decides it (the engine's tier and load, the queues) only changes for
    /// the engine that pulled, so asking the balancer only about engines that would be chosen
    /// gives the same answer without a pass over the engines per failed pull.
    pub fn next_pull(&mut self, now: Nanos) -> Option<(usize, QueuedPrefill)> {
        if self.lb.queued() == 0 {
            return None;
        }
        let mut best: Option<PullKey> = None;
        for (e, eng) in self.engines.iter().enumerate() {
            if !eng.has_room() || self.is_down(e) {
                continue;
            }
            let key = PullKey {
                busy: eng.busy(),
                // `+ 0.0` makes an empty engine's −0.0 sum equal to +0.0 under total order.
                load_ns: eng.remaining_ns() + 0.0,
                engine: e,
            };
            if best.is_some_and(|b| b <= key) {
                continue;
            }
            if self.lb.can_pull(now, EngineId(e as u32), key.load_ns) {
                best = Some(key);
            }
        }
        let k = best?;
        let q = self.lb.pull(now, EngineId(k.engine as u32), k.load_ns)?;
        Some((k.engine, q))
    }

    /// After a pull pass: the time to wake up at when queued work is left that an idle engine
    /// may take at the balancer's next round, if no wake-up is pending for it already.
    pub fn wake_needed(&mut self) -> Option<Nanos> {
        if self.lb.queued() == 0 {
            return None;
        }
        let idle = self
            .engines
            .iter()
            .enumerate()
            .any(|(i, e)| !e.busy() && e.jobs() == 0 && e.has_room() && !self.is_down(i));
        let at = self.lb.next_round()?;
        if !idle || self.wake_at.is_some_and(|w| w <= at) {
            return None;
        }
        self.wake_at = Some(at);
        Some(at)
    }

    pub fn woke(&mut self, now: Nanos) {
        if self.wake_at.is_some_and(|w| w <= now) {
            self.wake_at = None;
        }
    }

    /// Plans engine `e`'s next step at `now`; true when there is one to launch.
    pub fn plan_step(&mut self, now: Nanos, e: usize) -> bool {
        let plan = self.plans[e].as_prefill_mut().expect("prefill plan");
        let planned = self.engines[e].plan_step(now, plan);
        if planned {
            self.started[e] = now;
        }
        planned
    }

    /// Engine `e`'s step ended: its finished jobs are in [`Self::finished`].
    pub fn complete_step(&mut self, e: usize) {
        self.finished.clear();
        let plan = self.plans[e].as_prefill().expect("prefill plan");
        self.engines[e].complete_step(plan, &mut self.finished);
    }

    /// Engine `e` takes no new work (failed, or closed by the autoscaler).
    pub fn is_down(&self, e: usize) -> bool {
        self.failed.get(e).copied().unwrap_or(false) || self.closed.get(e).copied().unwrap_or(false)
    }
    fn can_take(&self, e: usize) -> bool {
        self.engines[e].has_room() && !self.is_down(e)
    }
    fn init_masks(&mut self) {
        let n = self.engines.len();
        if self.failed.is_empty() {
            self.failed = vec![false; n];
            self.closed = vec![false; n];
            self.provisioning = vec![false; n];
            self.aborted = vec![false; n];
            self.up_after_abort = vec![false; n];
        }
    }

    /// Engine `e` failed: it takes no more work and its jobs (reset) are put in `out`. False
    /// when it had failed already.
    pub fn fail(&mut self, e: usize, out: &mut Vec<PrefillJob>) -> bool {
        self.init_masks();
        if self.failed[e] {
            return false;
        }
        self.failed[e] = true;
        self.aborted[e] = self.engines[e].busy();
        self.engines[e].take_jobs(out);
        true
    }

    /// Engine `e` is back (now, or once its aborted step's end has come). False when it had
    /// not failed.
    pub fn repair(&mut self, e: usize) -> bool {
        if !self.failed.get(e).copied().unwrap_or(false) {
            return false;
        }
        if self.aborted[e] {
            self.up_after_abort[e] = true;
        } else {
            self.failed[e] = false;
        }
        true
    }

    /// The step that ended on engine `e` was aborted by its failure: true when it is to be
    /// ignored (the engine comes back now if it was repaired meanwhile).
    pub fn take_aborted(&mut self, e: usize) -> bool {
        if !self.aborted.get(e).copied().unwrap_or(false) {
            return false;
        }
        self.aborted[e] = false;
        if std::mem::take(&mut self.up_after_abort[e]) {
            self.failed[e] = false;
        }
        true
    }

    /// The autoscaler closes engine `e` (it runs what it holds, takes nothing new) or opens it.
    pub fn set_closed(&mut self, e: usize, closed: bool) {
        self.init_masks();
        self.closed[e] = closed;
    }
    pub fn is_closed(&self, e: usize) -> bool {
        self.closed.get(e).copied().unwrap_or(false)
    }
    pub fn set_provisioning(&mut self, e: usize, on: bool) {
        self.init_masks();
        self.provisioning[e] = on;
    }
    pub fn is_provisioning(&self, e: usize) -> bool {
        self.provisioning.get(e).copied().unwrap_or(false)
    }

    /// Each engine's tier (-1 without tiers).
    pub fn engine_tiers(&self) -> Vec<i32> {
        if !self.lb.pulls_by_tier() {
            return vec![-1; self.engines.len()];
        }
        (0..self.engines.len())
            .map(|e| self.lb.engine_tier(EngineId(e as u32)) as i32)
            .collect()
    }

    pub fn check_idle(&self) -> Result<(), String> {
        if self.is_idle() {
            Ok(())
        } else {
            Err(format!(
                "prefill work left over: {} queued in the balancer, {} jobs on engines",
                self.lb.queued(),
                self.engines.iter().map(|e| e.jobs()).sum::<usize>()
            ))
        }
    }
}

/// An engine's place in the pull order: idle before busy, then the least queued compute (the most
/// quota left), then the lower index.
#[derive(Clone, Copy, Debug)]
struct PullKey {
    busy: bool,
    load_ns: f64,
    engine: usize,
}

impl Ord for PullKey {
    fn cmp(&self, o: &Self) -> Ordering {
        self.busy
            .cmp(&o.busy)
            .then(self.load_ns.total_cmp(&o.load_ns))
            .then(self.engine.cmp(&o.engine))
    }
}
impl PartialOrd for PullKey {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl PartialEq for PullKey {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for PullKey {}
