//! Failures of the unit's prefill engines and SWA hosts (SPEC §7–§8). A prefill engine that
//! fails gives its queued and running jobs back to the balancer, each to start over: its
//! prefix is fetched again onto whichever engine takes it, and the step in flight is lost (its
//! end is ignored). An SWA host that fails loses the states it holds; later lookups miss and
//! the hit rule backs off (SPEC §5). A pull already under way from it completes (the state was
//! being copied out when the host went down: *servelab's choice*, it keeps no request waiting).

use crate::time::Nanos;
use crate::unit::ServingUnit;
use crate::unit::io::{Output, Rejection};
use crate::unit::prefill_pool::Placed;
use crate::unit::shared::SharedCache;

impl ServingUnit {
    pub(crate) fn prefill_failed(
        &mut self,
        now: Nanos,
        e: usize,
        _sh: &mut SharedCache,
        out: &mut Vec<Output>,
    ) {
        let mut jobs = Vec::new();
        if e >= self.prefill.engines() || !self.prefill.fail(e, &mut jobs) {
            self.faults.report.failures_ignored += 1;
            return;
        }
        self.faults.report.prefill_engine_failures += 1;
        self.faults.report.requeued_prefill_jobs += jobs.len() as u64;
        for mut job in jobs {
            let i = job.request.0 as usize;
            // A job not yet ready has a fetch in flight whose answer names the request: it is
            // counted here and ignored when it comes.
            if !job.ready {
                self.state[i].stale_ready += 1;
            }
            job.ready = false;
            let context = job.prompt_tokens;
            match self.prefill.submit(now, job, context) {
                Placed::Engine(to) => self.assign(now, i, to as usize, out),
                Placed::Queued => {}
                Placed::Rejected => self.reject(i, Rejection::PrefillQueueFull, out),
            }
        }
        self.pull_all(now, out);
    }

    pub(crate) fn prefill_repaired(&mut self, now: Nanos, e: usize, out: &mut Vec<Output>) {
        if e >= self.prefill.engines() || !self.prefill.repair(e) {
            self.faults.report.failures_ignored += 1;
            return;
        }
        self.faults.report.repairs += 1;
        self.pull_all(now, out);
    }

    /// The end of a prefill step on an engine that failed during it: ignored. True when so.
    pub(crate) fn prefill_step_aborted(
        &mut self,
        now: Nanos,
        e: usize,
        out: &mut Vec<Output>,
    ) -> bool {
        if !self.prefill.take_aborted(e) {
            return false;
        }
        // Repaired meanwhile: it serves again from now.
        if !self.prefill.is_down(e) {
            self.pull_all(now, out);
        }
        true
    }

    pub(crate) fn swa_host_failed(
        &mut self,
        now: Nanos,
        m: crate::ids::MachineId,
        sh: &mut SharedCache,
    ) {
        if m.0 >= sh.swa.config().machines {
            self.faults.report.failures_ignored += 1;
            return;
        }
        self.faults.report.swa_host_failures += 1;
        self.faults.report.swa_states_lost += sh.swa.lose_machine(now, m);
    }
}
