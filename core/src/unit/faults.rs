//! Drains and compute failures of the unit's decode groups (SPEC §8): a group told to shut
//! down stops admitting, decodes for the grace period, then forwards every unfinished request
//! with its KV to another group over the handoff link; a group whose rank fails stops, and
//! restarts on the ranks left after the recovery time, its experts re-placed by EPLB
//! ([`crate::unit::failover`]).
//!
//! Where a failed group's sequences go (*servelab's choice*): a sequence on a surviving rank
//! still has its KV in that GPU's memory and is migrated with it ([`Output::Forward`], as in a
//! drain); a sequence on the dead rank has lost its KV and is prefilled again: its prompt goes
//! through the hit rule against the store (which holds the prompt's blocks since its first
//! prefill, unless evicted), and the tokens it emitted so far are recomputed as new tokens of
//! the job. The report counts both (`forwarded_*`, `reprefill*`). `elastic.survivors =
//! "reprefill"` prefills the survivors' sequences again too, the baseline the migration is
//! measured against.
//!
//! A request that needs a decode group when none is up waits ("parked") if a stopped group
//! will restart, and is rejected with [`Rejection::NoDecodeGroup`] otherwise.

use crate::engine::Evicted;
use crate::time::Nanos;
use crate::unit::ServingUnit;
use crate::unit::config::SurvivorPolicy;
use crate::unit::decode_pool::{AdmitError, GroupStatus};
use crate::unit::failover::Failover;
use crate::unit::io::{Fault, Output, Rejection, Timer};
use crate::unit::prefill_pool::Placed;
use crate::unit::report::FaultReport;
use crate::unit::shared::SharedCache;

/// The unit's view of its decode groups' ranks and of the requests a fault displaced.
pub struct FaultState {
    pub report: FaultReport,
    failover: Failover,
    /// Per group, the configured rank number of each current rank (failover renumbers).
    alive: Vec<Vec<u32>>,
    /// Per group, the current ranks whose KV dies at the group's coming eviction.
    lost: Vec<Vec<u32>>,
    /// Per group: shut down for good after the coming eviction (drained, or no rank left).
    retire: Vec<bool>,
    /// Per group: told to shut down (a drained group never restarts).
    drained: Vec<bool>,
    /// Requests waiting for a decode group to restart.
    parked: Vec<u32>,
    scratch: Vec<Evicted>,
}

impl FaultState {
    pub fn new(groups: u32, ranks: u32, expert_imbalance: f64) -> Self {
        let n = groups as usize;
        FaultState {
            report: FaultReport::default(),
            failover: Failover::new(ranks, expert_imbalance),
            alive: vec![(0..ranks).collect(); n],
            lost: vec![Vec::new(); n],
            retire: vec![false; n],
            drained: vec![false; n],
            parked: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// Group `g` starts out of service (the autoscaler's pool starts smaller).
    pub fn mark_off(&mut self, g: usize) {
        self.drained[g] = true;
    }
    /// Group `g` gets fresh GPUs (all `ranks` of them) from the autoscaler.
    pub fn provision(&mut self, g: usize, ranks: u32) {
        self.alive[g] = (0..ranks).collect();
        self.lost[g].clear();
        self.retire[g] = false;
        self.drained[g] = false;
    }
    /// Whether group `g` was told to shut down (or never started).
    pub fn is_drained(&self, g: usize) -> bool {
        self.drained[g]
    }
    /// Whether group `g` retires after its coming eviction.
    pub fn is_retiring(&self, g: usize) -> bool {
        self.retire[g] || self.alive[g].is_empty()
    }

    /// Requests parked and not yet placed.
    pub fn parked(&self) -> usize {
        self.parked.len()
    }
}

impl ServingUnit {
    /// Decode group `g` is told to shut down.
    pub(crate) fn drain(&mut self, now: Nanos, g: usize, out: &mut Vec<Output>) {
        if g >= self.faults.alive.len() || self.decode.status(g) != GroupStatus::Up {
            self.faults.report.drains_ignored += 1;
            return;
        }
        self.faults.report.drains += 1;
        self.faults.drained[g] = true;
        self.decode.set_status(g, GroupStatus::Draining);
        out.push(Output::TimerAt {
            at: now + self.cfg.elastic.drain_grace,
            timer: Timer::DrainDeadline(g as u32),
        });
    }

    pub(crate) fn timer(
        &mut self,
        now: Nanos,
        t: Timer,
        sh: &mut SharedCache,
        o: &mut Vec<Output>,
    ) {
        match t {
            Timer::DrainDeadline(g) => {
                let g = g as usize;
                if self.decode.status(g) != GroupStatus::Draining {
                    return;
                }
                self.faults.retire[g] = true;
                self.stop_group(now, g, false, sh, o);
            }
            Timer::GroupRestart(g) => self.restart(now, g as usize, o),
            Timer::Provisioned(d) => self.provisioned(now, d, o),
        }
    }

    /// Evicts group `g` now when no step is in flight, or at the end of the step in flight
    /// (`discard`: that step's tokens are lost).
    fn stop_group(
        &mut self,
        now: Nanos,
        g: usize,
        discard: bool,
        sh: &mut SharedCache,
        out: &mut Vec<Output>,
    ) {
        if self.decode.in_flight(g) {
            let keep = matches!(
                self.decode.status(g),
                GroupStatus::Evicting { discard: true }
            );
            self.decode.set_status(
                g,
                GroupStatus::Evicting {
                    discard: discard || keep,
                },
            );
        } else {
            self.evict_group(now, g, sh, out);
        }
    }

    /// Takes every sequence out of group `g` (between steps) and sends each on: forwarded with
    /// its KV, or prefilled again when its rank died. Then the group stops or retires.
    pub(crate) fn evict_group(
        &mut self,
        now: Nanos,
        g: usize,
        sh: &mut SharedCache,
        out: &mut Vec<Output>,
    ) {
        let mut evicted = std::mem::take(&mut self.faults.scratch);
        evicted.clear();
        self.decode.evict(g, &mut self.state, &mut evicted);
        let lost = std::mem::take(&mut self.faults.lost[g]);
        let kv_bytes = u64::from(self.cfg.constants.kv_bytes_per_token);
        let swa_bytes = self.cfg.constants.swa_state_bytes();
        // A drain loses no rank; a failure loses one, and its survivors follow the policy.
        let all = !lost.is_empty() && self.cfg.elastic.survivors == SurvivorPolicy::Reprefill;
        for e in &evicted {
            let i = e.request.0 as usize;
            if all || lost.contains(&e.rank) {
                self.reprefill(now, i, sh, out);
            } else {
                self.faults.report.forwarded_requests += 1;
                let bytes = u64::from(e.kv_tokens) * kv_bytes + swa_bytes;
                self.faults.report.forwarded_bytes += bytes;
                out.push(Output::Forward {
                    request: i as u32,
                    group: g as u32,
                    bytes,
                });
            }
        }
        self.faults.scratch = evicted;
        if self.faults.retire[g] || self.faults.alive[g].is_empty() {
            self.decode.set_status(g, GroupStatus::Retired);
            // Nothing will restart once the last group is gone: parked requests end here.
            self.reject_parked_if_hopeless(out);
        } else {
            self.decode.set_status(g, GroupStatus::Stopped);
            out.push(Output::TimerAt {
                at: now + self.cfg.elastic.decode_recovery,
                timer: Timer::GroupRestart(g as u32),
            });
        }
    }

    /// Whether a group is stopped or being stopped with a restart to come.
    fn restart_coming(&self) -> bool {
        (0..self.faults.alive.len()).any(|g| match self.decode.status(g) {
            GroupStatus::Stopped | GroupStatus::Provisioning => true,
            GroupStatus::Evicting { .. } => {
                !self.faults.retire[g] && !self.faults.alive[g].is_empty()
            }
            _ => false,
        })
    }

    fn reject_parked_if_hopeless(&mut self, out: &mut Vec<Output>) {
        if self.decode.any_up() || self.restart_coming() {
            return;
        }
        for i in std::mem::take(&mut self.faults.parked) {
            self.reject(i as usize, Rejection::NoDecodeGroup, out);
        }
    }

    /// Request `i` (handed off or forwarded) joins a decode group that is up, waits for one to
    /// restart, or is rejected.
    pub(crate) fn place_in_decode(&mut self, now: Nanos, i: usize, out: &mut Vec<Output>) {
        let emitted = self.state[i].emitted.max(1);
        match self.decode.admit(i, &self.reqs[i], emitted) {
            Err(AdmitError::Full) => self.reject(i, Rejection::DecodeQueueFull, out),
            Err(AdmitError::NoGroup) if self.restart_coming() => {
                self.faults.report.parked_requests += 1;
                self.faults.parked.push(i as u32);
            }
            Err(AdmitError::NoGroup) => self.reject(i, Rejection::NoDecodeGroup, out),
            Ok(g) => {
                self.state[i].decode_group = g as u32;
                if !self.decode.in_flight(g) {
                    self.start_decode(now, g, out);
                }
            }
        }
    }
}

impl ServingUnit {
    /// A device failed at `now`.
    pub(crate) fn fault(
        &mut self,
        now: Nanos,
        f: Fault,
        sh: &mut SharedCache,
        o: &mut Vec<Output>,
    ) {
        match f {
            Fault::DecodeRank { group, rank } => self.rank_failed(now, group, rank, sh, o),
            Fault::PrefillEngine(e) => self.prefill_failed(now, e as usize, sh, o),
            Fault::SwaHost(m) => self.swa_host_failed(now, m, sh),
        }
    }

    /// A failed device is back at `now`.
    pub(crate) fn repair(&mut self, now: Nanos, f: Fault, o: &mut Vec<Output>) {
        match f {
            Fault::DecodeRank { group, rank } => self.rank_repaired(now, group, rank, o),
            Fault::PrefillEngine(e) => self.prefill_repaired(now, e as usize, o),
            // The host serves SWA state again as soon as it is back: nothing to do.
            Fault::SwaHost(_) => self.faults.report.repairs += 1,
        }
    }

    fn rank_failed(
        &mut self,
        now: Nanos,
        group: u32,
        rank: u32,
        sh: &mut SharedCache,
        out: &mut Vec<Output>,
    ) {
        let g = group as usize;
        let current = self
            .faults
            .alive
            .get(g)
            .and_then(|a| a.iter().position(|&r| r == rank));
        let Some(current) = current else {
            self.faults.report.failures_ignored += 1;
            return;
        };
        let status = self.decode.status(g);
        self.faults.report.decode_rank_failures += 1;
        self.faults.alive[g].remove(current);
        match status {
            // Stopped, or drained: no KV left on it; the restart uses the ranks left.
            GroupStatus::Stopped | GroupStatus::Retired | GroupStatus::Provisioning => {}
            _ => {
                if status == GroupStatus::Draining {
                    self.faults.retire[g] = true;
                }
                self.faults.lost[g].push(current as u32);
                self.stop_group(now, g, true, sh, out);
            }
        }
    }

    /// Group `g`'s recovery time is over: it restarts on the ranks it has left.
    fn restart(&mut self, now: Nanos, g: usize, out: &mut Vec<Output>) {
        if self.decode.status(g) != GroupStatus::Stopped {
            return;
        }
        let ranks = self.faults.alive[g].len() as u32;
        if ranks == 0 {
            self.decode.set_status(g, GroupStatus::Retired);
            self.reject_parked_if_hopeless(out);
            return;
        }
        self.faults.report.group_restarts += 1;
        self.faults.report.restart_ranks.push(ranks);
        self.bring_up(now, g, out);
    }

    /// Group `g` (holding nothing) serves on the ranks it has alive, its experts placed on
    /// them, and takes the requests that waited for a group.
    pub(crate) fn bring_up(&mut self, now: Nanos, g: usize, out: &mut Vec<Output>) {
        let ranks = self.faults.alive[g].len() as u32;
        let mut cfg = self.cfg.group_config();
        cfg.ranks = ranks;
        cfg.expert_imbalance = self.faults.failover.factor(ranks);
        let group = crate::engine::DecodeGroup::new(
            crate::ids::EngineId(g as u32),
            cfg,
            self.cfg.decode_time.clone(),
        )
        .expect("a valid group config with fewer ranks is valid");
        self.decode.replace_group(g, group);
        self.decode.set_status(g, GroupStatus::Up);
        self.place_parked(now, out);
    }

    fn place_parked(&mut self, now: Nanos, out: &mut Vec<Output>) {
        for i in std::mem::take(&mut self.faults.parked) {
            self.place_in_decode(now, i as usize, out);
        }
    }

    fn rank_repaired(&mut self, now: Nanos, group: u32, rank: u32, out: &mut Vec<Output>) {
        let g = group as usize;
        let known = g < self.faults.alive.len() && rank < self.cfg.decode.ranks;
        if !known || self.faults.alive[g].contains(&rank) {
            self.faults.report.failures_ignored += 1;
            return;
        }
        self.faults.report.repairs += 1;
        self.faults.alive[g].push(rank);
        let ranks = self.faults.alive[g].len() as u32;
        match self.decode.status(g) {
            // A running group takes the GPU in as an empty rank between steps, its experts
            // re-placed over the new count.
            GroupStatus::Up | GroupStatus::Draining => {
                let f = self.faults.failover.factor(ranks);
                self.decode.push_rank(g, f);
            }
            // A group left without ranks by failures (not by a drain) restarts now.
            GroupStatus::Retired if !self.faults.drained[g] => {
                self.decode.set_status(g, GroupStatus::Stopped);
                self.restart(now, g, out);
            }
            // A stopped group restarts on every rank it has when its recovery ends.
            _ => {}
        }
    }

    /// Request `i` lost its KV with a decode rank: it goes back to the prefill pool, its
    /// prompt matched against the store again and its emitted tokens recomputed.
    fn reprefill(&mut self, now: Nanos, i: usize, sh: &mut SharedCache, out: &mut Vec<Output>) {
        let r = &self.reqs[i];
        let emitted = self.state[i].emitted;
        let mut adm = self.entry.admit(now, i, r, sh);
        // The context so far is the prompt and the tokens emitted: the latter are new tokens.
        adm.job.prompt_tokens += emitted;
        adm.job.encoder_tokens += emitted;
        self.faults.report.reprefilled_requests += 1;
        self.faults.report.reprefill_tokens += u64::from(adm.job.encoder_tokens);
        self.state[i].reprefill = true;
        self.state[i].swa_machine = adm.swa_machine;
        match self.prefill.submit(now, adm.job, r.prompt_tokens + emitted) {
            Placed::Engine(e) => self.assign(now, i, e as usize, out),
            Placed::Queued => self.pull_all(now, out),
            Placed::Rejected => self.reject(i, Rejection::PrefillQueueFull, out),
        }
    }
}
