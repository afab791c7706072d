//! The decode pool of a serving unit (SPEC §8, §10): the decode balancer and its EP groups,
//! each with the double buffer of asynchronous scheduling (step N+1 planned while N runs).

use crate::engine::{
    DecodeBalancer, DecodeGroup, DecodePlan, Evicted, Scheduling, SeqEmission, StepPlan, StepReport,
};
use crate::error::ConfigError;
use crate::ids::{EngineId, RequestId};
use crate::request::Request;
use crate::time::Nanos;
use crate::unit::config::UnitConfig;
use crate::unit::histogram::Histogram;
use crate::unit::state::RequestState;
use crate::unit::table::Window;

/// A running decode sequence's emission state, kept beside its slot (a dense array walked in
/// plan order) rather than in the request table (a cache miss per sequence-step); written back
/// to the request when it finishes.
#[derive(Clone, Copy, Debug)]
struct SeqTrack {
    request: u32,
    measured: bool,
    last_token: Nanos,
    max_gap: Nanos,
    emitted: u32,
}

impl SeqTrack {
    const NONE: SeqTrack = SeqTrack {
        request: u32::MAX,
        measured: false,
        last_token: Nanos::ZERO,
        max_gap: Nanos::ZERO,
        emitted: 0,
    };
}

/// What a decode step's emissions update, handed each emission in turn by the group. A method
/// forced inline rather than one large closure: the group calls it from more than one place,
/// and a closure called from several is compiled out of line (a call per sequence-step).
struct Emissions<'s> {
    now: Nanos,
    warmup: Nanos,
    until: Option<Nanos>,
    state: &'s mut Window<RequestState>,
    side: &'s mut [SeqTrack],
    gaps: &'s mut Histogram,
    finished: &'s mut Vec<u32>,
    emissions: u64,
    tokens: u64,
    measured_tokens: u64,
    /// (gap, how many) not yet in `gaps`: [`Self::finish`] records it.
    gap_run: (u64, u64),
}

impl Emissions<'_> {
    /// Records the pending run of gaps; returns (emissions, tokens, measured tokens).
    fn finish(self) -> (u64, u64, u64) {
        self.gaps.record_n(self.gap_run.0, self.gap_run.1);
        (self.emissions, self.tokens, self.measured_tokens)
    }

    #[inline(always)]
    fn emit(&mut self, k: u32, e: SeqEmission) {
        let i = e.request.0 as usize;
        let t = &mut self.side[k as usize];
        if t.request != i as u32 {
            // The sequence's first step: its running state moves next to its slot.
            let st = &self.state[i];
            let a = st.arrival;
            *t = SeqTrack {
                request: i as u32,
                measured: a >= self.warmup && self.until.is_none_or(|m| a < m),
                last_token: st.last_token,
                max_gap: st.max_gap,
                emitted: st.emitted,
            };
        }
        let gap = self.now - t.last_token;
        t.max_gap = t.max_gap.max(gap);
        t.last_token = self.now;
        t.emitted += e.tokens;
        self.emissions += 1;
        self.tokens += u64::from(e.tokens);
        if t.measured {
            // The sequences of a step mostly share one gap (the step time): a run of equal
            // gaps is recorded at once.
            if gap.0 == self.gap_run.0 {
                self.gap_run.1 += 1;
            } else {
                self.gaps.record_n(self.gap_run.0, self.gap_run.1);
                self.gap_run = (gap.0, 1);
            }
            self.measured_tokens += u64::from(e.tokens);
        }
        if e.finished {
            let st = &mut self.state[i];
            st.last_token = t.last_token;
            st.max_gap = t.max_gap;
            st.emitted = t.emitted;
            self.finished.push(i as u32);
        }
    }
}

/// One group's scheduling state.
struct GroupDriver {
    /// Per slot key of the group ([`DecodeGroup::apply_report_with`]).
    side: Vec<SeqTrack>,
    /// `plans[0]` is the step in flight (or the last one); under async scheduling `plans[1]`
    /// is the next step, built while `plans[0]` ran.
    plans: [StepPlan; 2],
    report: StepReport,
    in_flight: bool,
    /// Async: plans[1] was built for the next step.
    next_built: bool,
    first_rank_gpu: u32,
    started: Nanos,
    /// Fraction of the group's KV capacity held when the step in flight started.
    kv_fraction: f64,
}

/// What one finished decode step gave.
pub struct StepEmissions {
    pub emissions: u64,
    pub tokens: u64,
    pub measured_tokens: u64,
    /// The step started in the steady-state window.
    pub started: Nanos,
}

/// Where a decode group is in its life (drain, failure, restart).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupStatus {
    /// Serving and admitting.
    Up,
    /// Told to shut down: decoding what it holds, admitting nothing, until its grace ends.
    Draining,
    /// Its sequences leave at the end of the step in flight: the grace ended (`discard`
    /// false: the step's tokens count) or a rank failed (`discard`: the step is lost).
    Evicting { discard: bool },
    /// Stopped by a failed rank, waiting to restart on the ranks left.
    Stopped,
    /// Added by the autoscaler: paid for, serving after the provisioning delay.
    Provisioning,
    /// Drained, or without a live rank: holds nothing and admits nothing.
    Retired,
}

/// Why a handed-off request found no place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdmitError {
    /// The rank the balancer picked has a full waiting queue.
    Full,
    /// No group is up.
    NoGroup,
}

pub struct DecodePool {
    balancer: DecodeBalancer,
    groups: Vec<DecodeGroup>,
    status: Vec<GroupStatus>,
    /// `status == Up` per group, the balancer's mask (None while every group is up).
    up: Option<Vec<bool>>,
    drivers: Vec<GroupDriver>,
    scheduling: Scheduling,
    sync_gap: Nanos,
    kv_capacity_per_rank: u64,
    /// Requests whose last token the last step emitted.
    pub(crate) finished: Vec<u32>,
}

fn empty_plan(g: u32) -> StepPlan {
    StepPlan::Decode(DecodePlan {
        engine: EngineId(g),
        ranks: Vec::new(),
        seqs: Vec::new(),
        dynamic: false,
        expert_imbalance: 1.0,
    })
}

impl DecodePool {
    pub fn new(cfg: &UnitConfig) -> Result<Self, ConfigError> {
        let d = &cfg.decode;
        let mut groups = Vec::new();
        let mut drivers = Vec::new();
        for g in 0..d.groups {
            let group = DecodeGroup::new(EngineId(g), cfg.group_config(), cfg.decode_time.clone())?;
            drivers.push(GroupDriver {
                side: vec![SeqTrack::NONE; group.slot_keys() as usize],
                plans: [empty_plan(g), empty_plan(g)],
                report: StepReport::default(),
                in_flight: false,
                next_built: false,
                first_rank_gpu: g * d.ranks,
                started: Nanos::ZERO,
                kv_fraction: 0.0,
            });
            groups.push(group);
        }
        Ok(DecodePool {
            balancer: DecodeBalancer::new(d.lb),
            status: vec![GroupStatus::Up; groups.len()],
            up: None,
            groups,
            drivers,
            scheduling: d.scheduling,
            sync_gap: cfg.sync_gap,
            kv_capacity_per_rank: d.kv_capacity_tokens_per_rank,
            finished: Vec::new(),
        })
    }

    pub fn groups(&self) -> &[DecodeGroup] {
        &self.groups
    }
    pub fn plan(&self, g: usize) -> &DecodePlan {
        self.drivers[g].plans[0].as_decode().expect("decode plan")
    }
    /// The step to launch on group `g` and the report to fill in.
    pub fn launch_mut(&mut self, g: usize) -> (&mut StepPlan, &mut StepReport) {
        let d = &mut self.drivers[g];
        (&mut d.plans[0], &mut d.report)
    }
    pub fn report(&self, g: usize) -> &StepReport {
        &self.drivers[g].report
    }
    pub fn started(&self, g: usize) -> Nanos {
        self.drivers[g].started
    }
    pub fn kv_fraction(&self, g: usize) -> f64 {
        self.drivers[g].kv_fraction
    }
    /// The GPU (numbered across the decode pool) of group `g`'s first rank.
    pub fn first_rank_gpu(&self, g: usize) -> u32 {
        self.drivers[g].first_rank_gpu
    }

    /// Places a handed-off request that has emitted `emitted` tokens (1 after prefill, more
    /// when it was forwarded from another group): the group it joined.
    pub fn admit(&mut self, i: usize, r: &Request, emitted: u32) -> Result<usize, AdmitError> {
        let (g, rank) = self
            .balancer
            .pick_up(
                &self.groups,
                self.up.as_deref(),
                u64::from(r.context_tokens()),
            )
            .ok_or(AdmitError::NoGroup)?;
        // The first token came from prefill; decode holds prompt + emitted and emits the rest.
        self.groups[g]
            .admit(
                rank,
                RequestId(i as u64),
                r.prompt_tokens + emitted,
                r.output_tokens - emitted,
            )
            .map_err(|_| AdmitError::Full)
            .map(|()| g)
    }

    pub fn status(&self, g: usize) -> GroupStatus {
        self.status[g]
    }
    /// Whether any group is up (admitting).
    pub fn any_up(&self) -> bool {
        self.up.is_none() || self.status.contains(&GroupStatus::Up)
    }

    pub fn set_status(&mut self, g: usize, s: GroupStatus) {
        self.status[g] = s;
        let up: Vec<bool> = self.status.iter().map(|s| *s == GroupStatus::Up).collect();
        self.up = if up.iter().all(|&u| u) {
            None
        } else {
            Some(up)
        };
    }

    /// Takes every unfinished sequence out of group `g` (no step in flight), writing each
    /// one's emission state back to `state`, and drops any step planned ahead.
    pub fn evict(&mut self, g: usize, state: &mut Window<RequestState>, out: &mut Vec<Evicted>) {
        let d = &mut self.drivers[g];
        let from = out.len();
        self.groups[g].evict_all(out);
        for e in &out[from..] {
            let Some(k) = e.slot_key else { continue };
            let t = &mut d.side[k as usize];
            if t.request == e.request.0 as u32 {
                let st = &mut state[t.request as usize];
                st.last_token = t.last_token;
                st.max_gap = t.max_gap;
                st.emitted = t.emitted;
            }
        }
        // A request that comes back to this slot later must not find its old track.
        d.side.fill(SeqTrack::NONE);
        d.next_built = false;
        d.in_flight = false;
    }

    /// Group `g`'s step in flight ended but its results are lost (the group failed).
    pub fn step_lost(&mut self, g: usize) {
        self.drivers[g].in_flight = false;
    }

    /// Replaces group `g` (empty) by `group` (a restart on fewer ranks, or more).
    pub fn replace_group(&mut self, g: usize, group: DecodeGroup) {
        let d = &mut self.drivers[g];
        d.side = vec![SeqTrack::NONE; group.slot_keys() as usize];
        d.next_built = false;
        self.groups[g] = group;
    }

    /// Adds an empty rank to group `g` between steps (a repaired GPU rejoining).
    pub fn push_rank(&mut self, g: usize, expert_imbalance: f64) {
        let group = &mut self.groups[g];
        group.push_rank();
        group.set_expert_imbalance(expert_imbalance);
        let keys = group.slot_keys() as usize;
        self.drivers[g].side.resize(keys, SeqTrack::NONE);
    }

    pub fn in_flight(&self, g: usize) -> bool {
        self.drivers[g].in_flight
    }

    /// Group `g`'s next step, to start at `start`: true when there is one to launch (the plan
    /// is built now unless async scheduling built it during the previous step).
    pub fn plan_step(&mut self, start: Nanos, g: usize) -> bool {
        let d = &mut self.drivers[g];
        let group = &mut self.groups[g];
        if d.next_built {
            d.plans.swap(0, 1);
            d.next_built = false;
        } else {
            group.plan_step(d.plans[0].as_decode_mut().expect("decode plan"));
        }
        if d.plans[0].as_decode().expect("decode plan").seqs.is_empty() {
            d.in_flight = false;
            return false;
        }
        d.in_flight = true;
        d.started = start;
        let cap = self.kv_capacity_per_rank as f64 * f64::from(group.ranks());
        let kv: u64 = (0..group.ranks()).map(|r| group.rank_occupancy(r).1).sum();
        d.kv_fraction = kv as f64 / cap;
        // Cleared so that an environment adding engine time (an EPLB weight shuffle) to the
        // duration starts from zero.
        d.report.duration = Nanos::ZERO;
        true
    }

    /// Group `g`'s step ended at `now`: applies its report (under async scheduling, planning
    /// the next step in the same pass), updating `state` and the gap histogram; the requests
    /// that finished are in [`Self::finished`]. Returns when the next step may start.
    pub fn step_done(
        &mut self,
        now: Nanos,
        g: usize,
        state: &mut Window<RequestState>,
        window: (Nanos, Option<Nanos>),
        gaps: &mut Histogram,
    ) -> (StepEmissions, Nanos) {
        let asynchronous = self.scheduling == Scheduling::Async;
        let d = &mut self.drivers[g];
        let group = &mut self.groups[g];
        self.finished.clear();
        let mut em = Emissions {
            now,
            warmup: window.0,
            until: window.1,
            state,
            side: &mut d.side,
            gaps,
            finished: &mut self.finished,
            emissions: 0,
            tokens: 0,
            measured_tokens: 0,
            gap_run: (0, 0),
        };
        let [StepPlan::Decode(cur), StepPlan::Decode(next)] = &mut d.plans else {
            unreachable!("decode plans")
        };
        if asynchronous {
            // The CPU built step N+1 while step N ran, before knowing N's acceptances: planned
            // in the same pass over the slots that applies N's report.
            d.next_built =
                group.plan_and_apply_taking(next, cur, &mut d.report, |k, e| em.emit(k, e));
        } else {
            group.apply_report_taking(cur, &mut d.report, |k, e| em.emit(k, e));
        }
        let (emissions, tokens, measured_tokens) = em.finish();
        d.in_flight = false;
        let next_start = if asynchronous {
            now
        } else {
            now + self.sync_gap
        };
        let step = StepEmissions {
            emissions,
            tokens,
            measured_tokens,
            started: d.started,
        };
        (step, next_start)
    }

    pub fn check_invariants(&self) -> Result<(), String> {
        for g in &self.groups {
            g.check_invariants()?;
            if !g.is_idle() {
                return Err(format!("decode group {} still holds sequences", g.id().0));
            }
        }
        Ok(())
    }
}
