//! Decode drains and compute failures of the serving unit, on a toy environment whose every
//! time is fixed (prefill step 100 ms, decode step 10 ms emitting one token per sequence,
//! handoff 1 ms, forward 4 ms, fetches instant), so the expected times are computed by hand.
//! Then the simulator: failures and drains under load lose no request.

use servelab_core::engine::{
    PrefillLbPolicy, RankOutcome, Scheduling, SeqOutcome, StepPlan, VerificationPolicy,
};
use servelab_core::unit::drive::NoObserver;
use servelab_core::unit::{
    Environment, Fault, Input, Outcome, Output, RunError, ServingUnit, SharedCache, UnitConfig,
};
use servelab_core::{
    ChainBuilder, Nanos, Request, RequestId, SegmentId, SessionId, SwaConfig, TrafficClass,
};
use servelab_sim::profile::{HardwareProfile, ProfileFiles};
use servelab_sim::service::ServiceConfig;
use servelab_tests::agent_workload;
use std::collections::BTreeMap;
use std::sync::Arc;

const MS: u64 = 1_000_000;

struct Toy {
    queue: BTreeMap<(Nanos, u64), Input>,
    seq: u64,
    finished: BTreeMap<u32, (Nanos, Outcome)>,
    forwards: Vec<(u32, u32, u64)>,
}

impl Toy {
    fn new(reqs: &[Request], script: &[(u64, Input)]) -> Self {
        let mut t = Toy {
            queue: BTreeMap::new(),
            seq: 0,
            finished: BTreeMap::new(),
            forwards: Vec::new(),
        };
        for (i, r) in reqs.iter().enumerate() {
            t.push(r.arrival, Input::Arrival(i as u32));
        }
        for &(at, input) in script {
            t.push(Nanos(at), input);
        }
        t
    }
    fn push(&mut self, at: Nanos, input: Input) {
        self.queue.insert((at, self.seq), input);
        self.seq += 1;
    }
}

impl Environment for Toy {
    fn next(&mut self, _: &mut ServingUnit) -> Result<Option<(Nanos, Input)>, RunError> {
        Ok(self.queue.pop_first().map(|((t, _), i)| (t, i)))
    }
    fn apply(
        &mut self,
        now: Nanos,
        output: Output,
        unit: &mut ServingUnit,
        _: &SharedCache,
    ) -> Result<(), RunError> {
        match output {
            Output::Launch { device, start } => {
                let (plan, report) = unit.launch_mut(device);
                let d = match plan {
                    StepPlan::Prefill(_) => 100 * MS,
                    StepPlan::Decode(p) => {
                        report.seqs = vec![SeqOutcome::default(); p.seqs.len()];
                        report.ranks = vec![RankOutcome::default(); p.ranks.len()];
                        10 * MS
                    }
                };
                report.duration = Nanos(d);
                self.push(start + Nanos(d), Input::StepDone(device));
            }
            Output::Fetch { request, .. } => self.push(now, Input::PrefixReady(request)),
            Output::Handoff { request, .. } => {
                self.push(now + Nanos(MS), Input::HandoffDone(request))
            }
            Output::Forward {
                request,
                group,
                bytes,
            } => {
                self.forwards.push((request, group, bytes));
                self.push(now + Nanos(4 * MS), Input::HandoffDone(request));
            }
            Output::WakeAt(at) => self.push(at, Input::WakeUp),
            Output::TimerAt { at, timer } => self.push(at, Input::Timer(timer)),
            Output::Finished { request, outcome } => {
                self.finished.insert(request, (now, outcome));
            }
        }
        Ok(())
    }
}

fn request(i: u64, at_ms: u64, prompt: u32, output: u32) -> Request {
    let mut b = ChainBuilder::new(128);
    b.push(SegmentId(100 + i), prompt + output);
    Request {
        id: RequestId(i),
        session: Some(SessionId(i)),
        class: TrafficClass::Chat,
        arrival: Nanos(at_ms * MS),
        prompt_tokens: prompt,
        output_tokens: output,
        content: Arc::new(b.finish()),
    }
}

/// One prefill engine, `groups` decode groups of `ranks`, one token per decode step, steps
/// back to back (synchronous scheduling without a gap), grace 50 ms, recovery 30 ms.
fn config(groups: u32, ranks: u32) -> UnitConfig {
    let mut c = ServiceConfig::default();
    c.prefill.gpus = 1;
    c.prefill.lb = PrefillLbPolicy::RoundRobin;
    c.decode.groups = groups;
    c.decode.ranks = ranks;
    c.decode.verification = VerificationPolicy::Fixed { drafts: 0 };
    c.decode.scheduling = Scheduling::Sync;
    c.warmup = Nanos::ZERO;
    c.sample_every = 1;
    let mut u = c.unit_config(&HardwareProfile::resolve("sm100-published").unwrap());
    u.sync_gap = Nanos::ZERO;
    u.elastic.drain_grace = Nanos(50 * MS);
    u.elastic.decode_recovery = Nanos(30 * MS);
    u
}

fn run(
    cfg: UnitConfig,
    reqs: &[Request],
    script: &[(u64, Input)],
) -> (Toy, servelab_core::unit::ServiceReport) {
    let mut unit = ServingUnit::new(cfg, reqs).unwrap();
    let swa = SwaConfig {
        machines: 8,
        slots_per_machine: 100,
        lifetime: Nanos::from_secs(180),
    };
    let mut sh = SharedCache::new(
        Default::default(),
        swa,
        unit.config().constants.block_bytes(),
    )
    .unwrap();
    let mut env = Toy::new(reqs, script);
    let end = servelab_core::unit::run(&mut unit, &mut sh, &mut env, &mut NoObserver).unwrap();
    let rep = unit.finish(&sh, end.end, end.inputs).unwrap();
    (env, rep)
}

/// Request A (prompt 1000, output 11): prefill 0–100 ms (first token), handoff to group 0 at
/// 101 ms, decode steps from 101 ms, one token each. Group 0 is told to drain at 120 ms: its
/// grace ends at 170 ms, during the step 161–171 ms, so A leaves at 171 ms after 7 decode steps
/// (111, 121, …, 171): 8 tokens out, 3 to go, KV of 1000 + 8 tokens forwarded. It reaches group
/// 1 at 175 ms and finishes after 3 steps, at 205 ms. Request B (prompt 500, output 3) arrives
/// at 130 ms, during the drain: prefill 130–230 ms, handoff at 231 ms to group 1 (group 0
/// admits nothing), 2 steps: done at 251 ms.
#[test]
fn a_drained_group_forwards_what_is_left_after_its_grace() {
    let reqs = [request(0, 0, 1000, 11), request(1, 130, 500, 3)];
    let cfg = config(2, 1);
    let kv = u64::from(cfg.constants.kv_bytes_per_token);
    let swa = cfg.constants.swa_state_bytes();
    let (env, rep) = run(cfg, &reqs, &[(120 * MS, Input::Drain(0))]);
    assert_eq!(env.finished[&0], (Nanos(205 * MS), Outcome::Completed));
    assert_eq!(env.finished[&1], (Nanos(251 * MS), Outcome::Completed));
    assert_eq!(env.forwards, vec![(0, 0, 1008 * kv + swa)]);
    assert_eq!(rep.faults.drains, 1);
    assert_eq!(rep.faults.forwarded_requests, 1);
    assert_eq!(rep.completed, 2);
    let steps: Vec<u64> = rep
        .engines
        .iter()
        .filter(|e| e.pool == "decode")
        .map(|e| e.steps)
        .collect();
    // Group 0: A's 7 steps; group 1: A's last 3 and B's 2.
    assert_eq!(steps, vec![7, 5]);
}

/// A drain whose group empties before its grace ends forwards nothing: A (output 3) finishes
/// on group 0 at 121 ms, well before the deadline at 170 ms.
#[test]
fn a_group_that_empties_during_its_grace_forwards_nothing() {
    let reqs = [request(0, 0, 1000, 3)];
    let (env, rep) = run(config(2, 1), &reqs, &[(105 * MS, Input::Drain(0))]);
    assert_eq!(env.finished[&0], (Nanos(121 * MS), Outcome::Completed));
    assert!(env.forwards.is_empty());
    assert_eq!(rep.faults.drains, 1);
}

/// Draining the only group: A is forwarded at 171 ms with no group up and none coming back,
/// so it is rejected with a reason instead of lost.
#[test]
fn draining_the_last_group_rejects_with_a_reason() {
    let reqs = [request(0, 0, 1000, 11)];
    let (env, rep) = run(config(1, 1), &reqs, &[(120 * MS, Input::Drain(0))]);
    assert!(matches!(env.finished[&0], (t, Outcome::Rejected(_)) if t == Nanos(175 * MS)));
    let r: Vec<_> = rep
        .rejected
        .iter()
        .filter(|r| r.requests > 0)
        .map(|r| r.reason)
        .collect();
    assert_eq!(r, vec!["no_decode_group"]);
}

/// Rank 0 of group 0 (A's rank) fails at 120 ms, during the step 111–121 ms: that step is
/// lost, so A has 2 tokens out (prefill's and the step ending at 111 ms). Its KV died with the
/// rank: it is prefilled again 121–221 ms (the fixed prefill time), handed off at 222 ms.
/// Group 0 restarts on its one rank left at 151 ms (recovery 30 ms), so the balancer's tie
/// goes to group 0 again; 9 tokens to go: done at 312 ms.
#[test]
fn a_failed_rank_loses_its_step_and_its_sequences_are_prefilled_again() {
    let reqs = [request(0, 0, 1000, 11)];
    let f = Fault::DecodeRank { group: 0, rank: 0 };
    let (env, rep) = run(config(2, 2), &reqs, &[(120 * MS, Input::Fault(f))]);
    assert_eq!(env.finished[&0], (Nanos(312 * MS), Outcome::Completed));
    assert!(env.forwards.is_empty());
    let fr = &rep.faults;
    assert_eq!((fr.decode_rank_failures, fr.lost_decode_steps), (1, 1));
    assert_eq!((fr.reprefilled_requests, fr.group_restarts), (1, 1));
    assert_eq!(fr.restart_ranks, vec![1]);
}

/// A sequence on a surviving rank keeps its KV and is migrated: A sits on rank 0 and rank 1
/// fails; A is forwarded at 121 ms with 2 tokens out (the lost step's token is decoded again)
/// and reaches group 1 at 125 ms: 9 steps, done at 215 ms.
#[test]
fn sequences_on_surviving_ranks_are_migrated_with_their_kv() {
    let reqs = [request(0, 0, 1000, 11)];
    let cfg = config(2, 2);
    let kv = u64::from(cfg.constants.kv_bytes_per_token);
    let swa = cfg.constants.swa_state_bytes();
    let f = Fault::DecodeRank { group: 0, rank: 1 };
    let (env, rep) = run(cfg, &reqs, &[(120 * MS, Input::Fault(f))]);
    assert_eq!(env.finished[&0], (Nanos(215 * MS), Outcome::Completed));
    assert_eq!(env.forwards, vec![(0, 0, 1002 * kv + swa)]);
    assert_eq!(rep.faults.reprefilled_requests, 0);
}

/// A prefill engine failing during A's prefill (at 50 ms) gives A back to the balancer; the
/// only engine is down, so A waits until the repair at 300 ms and is prefilled 300–400 ms.
/// Then 10 decode steps from 401 ms: done at 501 ms.
#[test]
fn a_failed_prefill_engine_gives_its_jobs_back() {
    let reqs = [request(0, 0, 1000, 11)];
    let f = Fault::PrefillEngine(0);
    let script = [(50 * MS, Input::Fault(f)), (300 * MS, Input::Repair(f))];
    let (env, rep) = run(config(2, 1), &reqs, &script);
    assert_eq!(env.finished[&0], (Nanos(501 * MS), Outcome::Completed));
    assert_eq!(rep.faults.requeued_prefill_jobs, 1);
    assert_eq!(rep.all.ttft_ns.count(), 1);
}

/// A small unit of the simulator: 8 prefill engines, 2 decode groups of 8 ranks.
fn small_service() -> ServiceConfig {
    let mut c = ServiceConfig::default();
    c.prefill.gpus = 8;
    c.decode.groups = 2;
    c.decode.ranks = 8;
    c.swa = SwaConfig {
        machines: 3,
        slots_per_machine: 1000,
        lifetime: Nanos::from_secs(180),
    };
    c.warmup = Nanos::ZERO;
    c.sample_every = 1;
    c
}

fn sim_with(faults: &str, seed: u64) -> servelab_sim::service::ServiceReport {
    let trace = servelab_workloads::generate::generate(&agent_workload(), 7, 128).unwrap();
    let mut c = small_service();
    c.faults = toml::from_str(faults).unwrap();
    let rep = servelab_sim::service::run(&c, &trace.requests, seed).unwrap();
    assert_eq!(
        rep.completed + rep.rejected_total(),
        rep.arrivals,
        "no lost request"
    );
    rep
}

/// Under load, each kind of fault moves requests and loses none (the run's end checks every
/// request ended, and KV and slot conservation).
#[test]
fn faults_under_load_lose_no_request() {
    let base = sim_with("", 1);
    assert!(base.faults.is_empty());
    let drain = sim_with(
        "drain_grace = \"200ms\"\n[[events]]\nkind = \"drain\"\ngroup = 0\nat = \"30s\"\n",
        1,
    );
    assert_eq!(drain.faults.drains, 1);
    assert!(drain.faults.forwarded_requests > 0, "{:?}", drain.faults);
    let rank = sim_with(
        "[[events]]\nkind = \"decode-rank\"\ngroup = 0\nrank = 0\nat = \"30s\"\nrecover_at = \"80s\"\n",
        1,
    );
    let f = &rank.faults;
    assert_eq!(
        (f.decode_rank_failures, f.group_restarts, f.repairs),
        (1, 1, 1)
    );
    assert_eq!(f.restart_ranks, vec![7]);
    // At this load rank 0 holds one sequence when it fails; the toy tests above time both
    // the re-prefill and the migration by hand.
    assert!(f.reprefilled_requests > 0, "{f:?}");
    let prefill = sim_with(
        "[[events]]\nkind = \"prefill-engine\"\nengine = 2\nat = \"20s\"\nrecover_at = \"40s\"\n",
        1,
    );
    assert_eq!(prefill.faults.prefill_engine_failures, 1);
    let swa = sim_with(
        "[[events]]\nkind = \"swa-host\"\nmachine = 1\nat = \"30s\"\n",
        1,
    );
    assert!(swa.faults.swa_states_lost > 0, "{:?}", swa.faults);
    // Machine 1 is decode group 0's: the states stored at the end of its replies, which the
    // sessions' next turns look up, are gone, so fewer lookups hit and fewer tokens are reused.
    assert!(swa.swa_hit_rate < base.swa_hit_rate);
    assert!(swa.hit_tokens < base.hit_tokens);
}

/// Random GPU failures from the sub-seed: the same seed gives the same run, another seed
/// another one, and no request is lost either way.
#[test]
fn random_gpu_failures_are_seeded() {
    let cfg = "decode_recovery = \"5s\"\n[random]\ngpu_mtbf = \"300s\"\ngpu_mttr = \"20s\"\nuntil = \"60s\"\n";
    let a = sim_with(cfg, 1);
    assert!(a.faults.decode_rank_failures + a.faults.prefill_engine_failures > 0);
    let b = sim_with(cfg, 1);
    assert_eq!(format!("{:?}", a.faults), format!("{:?}", b.faults));
    assert_eq!(a.all.e2e_ns, b.all.e2e_ns);
    let c = sim_with(cfg, 2);
    assert_ne!(format!("{:?}", a.faults), format!("{:?}", c.faults));
}

/// Bad fault keys are errors naming the field.
#[test]
fn bad_fault_keys_name_the_field() {
    let err = |faults: &str| {
        let mut c = small_service();
        c.faults = toml::from_str(faults).unwrap();
        servelab_sim::service::run(&c, &[], 1)
            .unwrap_err()
            .to_string()
    };
    let e = err("[[events]]\nkind = \"decode-rank\"\ngroup = 2\nrank = 0\nat = \"1s\"\n");
    assert!(
        e.contains("faults.events[0].group") && e.contains("2 decode groups"),
        "{e}"
    );
    let e = err(
        "[[events]]\nkind = \"prefill-engine\"\nengine = 1\nat = \"10s\"\nrecover_at = \"5s\"\n",
    );
    assert!(e.contains("faults.events[0].recover_at"), "{e}");
    let e = err("[[events]]\nkind = \"swa-host\"\nat = \"10s\"\n");
    assert!(e.contains("faults.events[0].machine"), "{e}");
    let many: String = (0..9)
        .map(|k| {
            format!(
                "[[events]]\nkind = \"prefill-engine\"\nengine = {}\nat = \"{}s\"\n",
                k % 8,
                k + 1
            )
        })
        .collect();
    let e = err(&many);
    assert!(e.contains("faults.events"), "{e}");
    let e = err("[random]\ngpu_mtbf = \"0s\"\ngpu_mttr = \"1s\"\nuntil = \"1s\"\n");
    assert!(e.contains("faults.random.gpu_mtbf"), "{e}");
    let e = toml::from_str::<servelab_sim::env::faults::FaultsConfig>(
        "[[events]]\nkind = \"gpu\"\nat = \"1s\"\n",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("gpu"), "{e}");
}

/// With `survivors = "reprefill"` the sequence on the surviving rank 0 is prefilled again
/// instead of migrated: 121–221 ms, handoff at 222 ms, 9 steps: done at 312 ms (97 ms later
/// than its migration, which took 4 ms).
#[test]
fn survivors_can_be_prefilled_again_instead() {
    let reqs = [request(0, 0, 1000, 11)];
    let mut cfg = config(2, 2);
    cfg.elastic.survivors = servelab_core::unit::SurvivorPolicy::Reprefill;
    let f = Fault::DecodeRank { group: 0, rank: 1 };
    let (env, rep) = run(cfg, &reqs, &[(120 * MS, Input::Fault(f))]);
    assert_eq!(env.finished[&0], (Nanos(312 * MS), Outcome::Completed));
    assert!(env.forwards.is_empty());
    assert_eq!(rep.faults.reprefilled_requests, 1);
}
