//! A seeded swarm test in the manner of TigerBeetle's VOPR: from one seed, draw a small random
//! serving unit, workload, store and fault schedule ([`Generator`]), run it in the simulator
//! and check the system's invariants after every event ([`Checker`], an
//! [`Observer`] of the driver loop). Any seed reproduces its run exactly.
//!
//! The generator is a list of [`Part`]s, each drawing its keys from its own sub-seed (so adding
//! a part changes no other part's draws). [`ComputeFaults`] adds decode drains, decode-rank,
//! prefill-engine and SWA-host failures and random GPU failures; extra invariants are
//! closures pushed onto [`Checker::extra`].

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use servelab_core::store::{GcPolicy, RandomFailures, ScheduledFailure};
use servelab_core::unit::drive::Observer;
use servelab_core::unit::{Input, Output, ServingUnit, SharedCache};
use servelab_core::{ClassTtl, HitPolicy, Nanos, TtlFrom};
use servelab_sim::profile::HardwareProfile;
use servelab_sim::service::{ServiceConfig, ServiceReport, run_observed};
use servelab_workloads::generate::{WorkloadConfig, generate};

/// One drawn case: the service config, its workload and the run's seed.
#[derive(Clone, Debug)]
pub struct Scenario {
    pub seed: u64,
    pub service: ServiceConfig,
    pub workload: WorkloadConfig,
    /// Simulated seconds within which faults are scheduled (about the workload's span).
    pub horizon_s: f64,
}

/// A part of the generator: draws some keys of the scenario.
pub trait Part {
    /// Names the part's sub-seed.
    fn name(&self) -> &'static str;
    fn draw(&self, rng: &mut ChaCha8Rng, s: &mut Scenario);
}

/// Draws scenarios, part by part.
pub struct Generator {
    parts: Vec<Box<dyn Part>>,
}

impl Generator {
    /// A small unit, a short workload, a random store shape and storage-node failures.
    pub fn standard() -> Self {
        Generator { parts: Vec::new() }
            .with(SmallUnit)
            .with(SmallWorkload)
            .with(StoreShape)
            .with(StorageFaults)
            .with(ComputeFaults)
    }

    pub fn with(mut self, part: impl Part + 'static) -> Self {
        self.parts.push(Box::new(part));
        self
    }

    pub fn draw(&self, seed: u64) -> Scenario {
        let mut s = Scenario {
            seed,
            service: ServiceConfig::default(),
            workload: WorkloadConfig::default(),
            horizon_s: 20.0,
        };
        for p in &self.parts {
            let sub = servelab_core::seed::sub_seed(seed, &format!("swarm.{}", p.name()));
            p.draw(&mut ChaCha8Rng::seed_from_u64(sub), &mut s);
        }
        s
    }
}

/// `lo..=hi` on a log scale.
fn log_uniform(rng: &mut ChaCha8Rng, lo: f64, hi: f64) -> f64 {
    (lo.ln() + rng.random::<f64>() * (hi.ln() - lo.ln())).exp()
}

fn secs(s: f64) -> Nanos {
    Nanos::from_secs_f64(s)
}

/// Pools of a few GPUs with small queues, SWA caches of a few slots, every request measured.
pub struct SmallUnit;

impl Part for SmallUnit {
    fn name(&self) -> &'static str {
        "unit"
    }
    fn draw(&self, rng: &mut ChaCha8Rng, s: &mut Scenario) {
        let c = &mut s.service;
        c.prefill.gpus = rng.random_range(1..=4);
        c.prefill.gpus_per_machine = rng.random_range(1..=2);
        c.prefill.max_jobs_per_engine = rng.random_range(1..=8);
        c.prefill.max_queued_requests = rng.random_range(2..=50);
        c.prefill.lb = match rng.random_range(0..3) {
            0 => servelab_core::engine::PrefillLbPolicy::RoundRobin,
            1 => servelab_core::engine::PrefillLbPolicy::LeastLoaded,
            _ => c.prefill.lb.clone(),
        };
        let d = &mut c.decode;
        d.groups = rng.random_range(1..=2);
        d.ranks = rng.random_range(1..=4);
        d.gpus_per_machine = rng.random_range(1..=4);
        d.max_seqs_per_rank = rng.random_range(2..=16);
        d.kv_capacity_tokens_per_rank = rng.random_range(8_000..=200_000);
        d.max_waiting_per_rank = rng.random_range(1..=32);
        if rng.random_bool(0.3) {
            d.scheduling = servelab_core::engine::Scheduling::Sync;
        }
        let machines = c.prefill.gpus.div_ceil(c.prefill.gpus_per_machine)
            + (d.groups * d.ranks).div_ceil(d.gpus_per_machine);
        c.swa.machines = machines + rng.random_range(0..=2);
        c.swa.slots_per_machine = rng.random_range(4..=64);
        c.swa.lifetime = secs(rng.random_range(1.0..120.0));
        c.hit_policy = match rng.random_range(0..10) {
            0 => HitPolicy::SwaOnSsd,
            1 => HitPolicy::PerfectCache,
            _ => HitPolicy::Deepinfer,
        };
        c.warmup = Nanos::ZERO;
        c.series_interval = Nanos::from_secs(1);
        c.sample_every = 1;
        c.touch_coalesce = secs(rng.random_range(0.0..5.0));
    }
}

/// A few agent and chat sessions and documents, arriving over seconds.
pub struct SmallWorkload;

impl Part for SmallWorkload {
    fn name(&self) -> &'static str {
        "workload"
    }
    fn draw(&self, rng: &mut ChaCha8Rng, s: &mut Scenario) {
        let mut toml = String::new();
        let (agents, chats, docs) = (
            rng.random_range(0..=4u32),
            rng.random_range(0..=4u32),
            rng.random_range(0..=3u32),
        );
        let agents = if agents + chats + docs == 0 {
            1
        } else {
            agents
        };
        if agents > 0 {
            toml += &format!(
                "[agent]\nsessions = {agents}\nsession_rate_per_s = {:.2}\n\
                 turns = {{ kind = \"uniform\", min = 1, max = {} }}\nsystem_prompts = {}\n\
                 system_prompt_tokens = {{ kind = \"fixed\", value = {} }}\n\
                 task_tokens = {{ kind = \"uniform\", min = 50, max = 500 }}\n\
                 reply_tokens = {{ kind = \"uniform\", min = 10, max = {} }}\n\
                 tool_result_tokens = {{ kind = \"uniform\", min = 50, max = 800 }}\n\
                 think_time_s = {{ kind = \"exponential\", mean = {:.2} }}\n",
                rng.random_range(0.5..4.0),
                rng.random_range(2..=6),
                rng.random_range(1..=2),
                rng.random_range(300..=3000),
                rng.random_range(20..=120),
                rng.random_range(0.5..3.0),
            );
        }
        if chats > 0 {
            toml += &format!(
                "[chat]\nsessions = {chats}\nsession_rate_per_s = {:.2}\n\
                 turns = {{ kind = \"fixed\", value = {} }}\nsystem_prompts = 2\n\
                 system_prompt_tokens = {{ kind = \"uniform\", min = 100, max = 1000 }}\n\
                 user_tokens = {{ kind = \"uniform\", min = 5, max = 200 }}\n\
                 reply_tokens = {{ kind = \"uniform\", min = 10, max = 100 }}\n\
                 think_time_s = {{ kind = \"exponential\", mean = {:.2} }}\n",
                rng.random_range(0.5..4.0),
                rng.random_range(1..=4),
                rng.random_range(0.5..3.0),
            );
        }
        if docs > 0 {
            toml += &format!(
                "[documents]\nrequests = {docs}\nrate_per_s = {:.2}\nsystem_prompts = 1\n\
                 system_prompt_tokens = {{ kind = \"fixed\", value = 200 }}\n\
                 document_tokens = {{ kind = \"uniform\", min = 2000, max = 12000 }}\n\
                 question_tokens = {{ kind = \"uniform\", min = 10, max = 50 }}\n\
                 answer_tokens = {{ kind = \"uniform\", min = 10, max = 80 }}\n\
                 repeat_probability = 0.3\n",
                rng.random_range(0.5..2.0),
            );
        }
        s.workload =
            toml::from_str(&toml).unwrap_or_else(|e| panic!("swarm workload: {e}\n{toml}"));
    }
}

/// The store: nodes and erasure coding, the GC (global with or without a capacity, or per
/// node with tiny nodes), TTLs of seconds, the nodes' bandwidths and the fetch's shape.
pub struct StoreShape;

impl Part for StoreShape {
    fn name(&self) -> &'static str {
        "store"
    }
    fn draw(&self, rng: &mut ChaCha8Rng, s: &mut Scenario) {
        let block = s.service.constants.block_bytes();
        let st = &mut s.service.store;
        let (data, parity) = if rng.random_bool(0.6) {
            (10, 2)
        } else {
            (rng.random_range(2..=10), rng.random_range(1..=3))
        };
        st.ec_data_shards = data;
        st.ec_parity_shards = parity;
        st.storage_nodes = rng.random_range((data + parity)..=30);
        st.high_watermark = rng.random_range(0.8..=1.0);
        st.low_watermark = rng.random_range(0.5..=st.high_watermark);
        match rng.random_range(0..3) {
            0 => st.capacity_bytes = None,
            1 => st.capacity_bytes = Some(block * rng.random_range(20..=2000)),
            _ => {
                st.gc = GcPolicy::PerNodeLru;
                st.node.ssds = 1;
                st.node.ssd_bytes = block.div_ceil(u64::from(data)) * rng.random_range(5..=200);
            }
        }
        let ttl = |rng: &mut ChaCha8Rng| {
            rng.random_bool(0.7)
                .then(|| secs(rng.random_range(1.0..60.0)))
        };
        st.ttl = if rng.random_bool(0.3) {
            ClassTtl::none()
        } else {
            ClassTtl {
                agent: ttl(rng),
                chat: ttl(rng),
                other: ttl(rng),
            }
        };
        st.ttl_from = if rng.random_bool(0.3) {
            TtlFrom::Write
        } else {
            TtlFrom::LastAccess
        };
        st.node.write_bytes_per_s = log_uniform(rng, 1e6, 5e9);
        st.node.charge_writes = rng.random_bool(0.9);
        st.rebuild.chunk_bytes = rng.random_range(4096..=(1 << 20));
        let f = &mut s.service.fetch;
        f.node_read_bytes_per_s = log_uniform(rng, 1e7, 4e10);
        f.latency = secs(rng.random_range(50e-6..500e-6));
        f.tail_mean = secs(rng.random_range(0.0..500e-6));
        f.stripes = rng.random_range(1..=8);
    }
}

/// Scheduled failures of storage nodes (some of them a whole group's `parity + 1` nodes at
/// once, so the group loses its objects), repaired or not, and sometimes random failures.
pub struct StorageFaults;

impl Part for StorageFaults {
    fn name(&self) -> &'static str {
        "storage-faults"
    }
    fn draw(&self, rng: &mut ChaCha8Rng, s: &mut Scenario) {
        let horizon = s.horizon_s;
        let st = &mut s.service.store;
        let n = st.storage_nodes;
        // Per node, the end of its latest failure (a node's failures may not overlap).
        let mut down_until = vec![Nanos::ZERO; n as usize];
        for _ in 0..rng.random_range(0..=4) {
            let at = secs(rng.random_range(0.0..horizon));
            let repair_at = rng
                .random_bool(0.7)
                .then(|| at + secs(rng.random_range(0.5..15.0)));
            let nodes: Vec<u32> = if rng.random_bool(0.3) {
                let first = rng.random_range(0..n);
                (0..=st.ec_parity_shards).map(|k| (first + k) % n).collect()
            } else {
                let mut v: Vec<u32> = (0..rng.random_range(1..=st.ec_parity_shards))
                    .map(|_| rng.random_range(0..n))
                    .collect();
                v.sort_unstable();
                v.dedup();
                v
            };
            let nodes: Vec<u32> = nodes
                .into_iter()
                .filter(|&m| down_until[m as usize] <= at && down_until[m as usize] != Nanos::NEVER)
                .collect();
            if nodes.is_empty() {
                continue;
            }
            for &m in &nodes {
                down_until[m as usize] = repair_at.unwrap_or(Nanos::NEVER);
            }
            st.failures.push(ScheduledFailure {
                node: None,
                nodes,
                at,
                repair_at,
            });
        }
        if rng.random_bool(0.2) {
            st.random_failures = Some(RandomFailures {
                mtbf: secs(rng.random_range(5.0..60.0)),
                mttr: secs(rng.random_range(0.5..10.0)),
            });
        }
    }
}

/// Compute faults: decode drains (short grace), decode-rank failures (recovered or not, the
/// survivors migrated or prefilled again), prefill-engine failures (always repaired, so work
/// can drain), SWA-host losses, and sometimes random GPU failures. No device fails twice while
/// down, as the config requires.
pub struct ComputeFaults;

impl Part for ComputeFaults {
    fn name(&self) -> &'static str {
        "compute-faults"
    }
    fn draw(&self, rng: &mut ChaCha8Rng, s: &mut Scenario) {
        use servelab_sim::env::faults::{FaultEvent, FaultKind, FaultsConfig, RandomGpuFaults};
        let horizon = s.horizon_s;
        let (p, d) = (&s.service.prefill, &s.service.decode);
        let shape = s.service.unit_shape();
        let mut f = FaultsConfig {
            drain_grace: Some(secs(rng.random_range(0.0..0.2))),
            decode_recovery: Some(secs(rng.random_range(0.1..5.0))),
            survivors: Some(if rng.random_bool(0.5) {
                servelab_core::unit::SurvivorPolicy::Migrate
            } else {
                servelab_core::unit::SurvivorPolicy::Reprefill
            }),
            ..Default::default()
        };
        let blank = |kind, at| FaultEvent {
            kind,
            group: None,
            rank: None,
            engine: None,
            machine: None,
            at,
            recover_at: None,
        };
        for _ in 0..rng.random_range(0..=4) {
            // The first third of the horizon, where the small workloads' requests run.
            let at = secs(rng.random_range(0.0..horizon / 3.0));
            let back = at + secs(rng.random_range(0.2..10.0));
            let e = match rng.random_range(0..4) {
                0 => {
                    let mut e = blank(FaultKind::Drain, at);
                    e.group = Some(rng.random_range(0..d.groups));
                    e
                }
                1 => {
                    let mut e = blank(FaultKind::DecodeRank, at);
                    e.group = Some(rng.random_range(0..d.groups));
                    e.rank = Some(rng.random_range(0..d.ranks));
                    e.recover_at = rng.random_bool(0.7).then_some(back);
                    e
                }
                2 => {
                    let mut e = blank(FaultKind::PrefillEngine, at);
                    e.engine = Some(rng.random_range(0..p.gpus));
                    e.recover_at = Some(back);
                    e
                }
                _ => {
                    let mut e = blank(FaultKind::SwaHost, at);
                    e.machine = Some(rng.random_range(0..shape.machines));
                    e
                }
            };
            f.events.push(e);
            // Drawn events that the config would refuse (a device failing while down, a
            // second drain of a group) are dropped: the swarm draws valid configs only.
            if f.validate(shape).is_err() {
                f.events.pop();
            }
        }
        if rng.random_bool(0.15) {
            f.random = Some(RandomGpuFaults {
                gpu_mtbf: secs(rng.random_range(5.0..60.0)),
                gpu_mttr: secs(rng.random_range(0.5..5.0)),
                until: secs(horizon),
            });
        }
        s.service.faults = f;
    }
}

/// An invariant of another part of the system, checked between events.
pub type ExtraCheck = Box<dyn FnMut(&ServingUnit, &SharedCache) -> Result<(), String>>;

/// Checks the invariants after every event; the first violation is kept.
pub struct Checker {
    /// Per request: 0 not arrived, 1 pending, 2 ended.
    state: Vec<u8>,
    /// The input at which each request arrived (1-based).
    arrived_at: Vec<u64>,
    inputs: u64,
    arrived: u64,
    pending: u64,
    /// Group losses seen so far, and the input before which the latest was applied.
    group_losses: u64,
    last_loss_input: u64,
    /// Fetches the current input asked for: (request, reused tokens).
    fetches: Vec<(u32, u32)>,
    /// The full store check (linear in the objects) runs every this many inputs.
    pub full_every: u64,
    /// More invariants, checked after every input.
    pub extra: Vec<ExtraCheck>,
    pub violation: Option<String>,
}

impl Checker {
    pub fn new(requests: usize) -> Self {
        Checker {
            state: vec![0; requests],
            arrived_at: vec![0; requests],
            inputs: 0,
            arrived: 0,
            pending: 0,
            group_losses: 0,
            last_loss_input: 0,
            fetches: Vec::new(),
            full_every: 16,
            extra: Vec::new(),
            violation: None,
        }
    }

    pub fn inputs(&self) -> u64 {
        self.inputs
    }

    fn violate(&mut self, now: Nanos, what: String) {
        if self.violation.is_none() {
            self.violation = Some(format!("input {} at {now}: {what}", self.inputs));
        }
    }

    /// Request `i` arrives.
    pub fn arrival(&mut self, now: Nanos, i: u32) {
        match self.state.get(i as usize) {
            Some(0) => {}
            Some(_) => return self.violate(now, format!("request {i} arrived twice")),
            None => return self.violate(now, format!("request {i} is not in the trace")),
        }
        self.state[i as usize] = 1;
        self.arrived_at[i as usize] = self.inputs;
        self.arrived += 1;
        self.pending += 1;
    }

    /// Request `i` ended (completed, or rejected: a rejection always carries its reason).
    pub fn ended(&mut self, now: Nanos, i: u32) {
        if self.state.get(i as usize) != Some(&1) {
            return self.violate(now, format!("request {i} ended without being pending"));
        }
        self.state[i as usize] = 2;
        self.pending -= 1;
    }

    /// A fetch of `blocks` for request `i`: a block of a group that has lost its objects may
    /// only be read if the hit was decided before the loss (the environment then skips it).
    pub fn fetch(
        &mut self,
        now: Nanos,
        i: u32,
        blocks: &[servelab_core::BlockKey],
        sh: &SharedCache,
    ) {
        let admitted = self.arrived_at[i as usize];
        if admitted >= self.last_loss_input
            && let Some(k) = blocks.iter().find(|&&k| !sh.store.is_readable(k))
        {
            let g = sh.store.start_of(*k);
            self.violate(
                now,
                format!(
                    "request {i}'s hit, decided at input {admitted} (latest group loss before \
                     input {}), reads block {k:?} of group {g}, which lost its objects",
                    self.last_loss_input
                ),
            );
        }
    }

    /// The state between two events.
    pub fn between_events(&mut self, now: Nanos, unit: &ServingUnit, sh: &SharedCache) {
        if unit.pending() != self.pending || unit.arrived() != self.arrived {
            let what = format!(
                "the unit counts {} arrived / {} pending, the outputs {} / {}",
                unit.arrived(),
                unit.pending(),
                self.arrived,
                self.pending
            );
            self.violate(now, what);
        }
        let losses = sh.store.cluster_stats().group_losses;
        if losses != self.group_losses {
            self.group_losses = losses;
            self.last_loss_input = self.inputs;
        }
        // The perfect-cache baselines hit on every prefix seen, whatever the store holds: only
        // a hit from the store must avoid lost groups.
        let from_store = !unit.config().hit_policy.uses_perfect_cache();
        for (i, tokens) in std::mem::take(&mut self.fetches) {
            if from_store {
                self.fetch(now, i, unit.blocks_within(i as usize, tokens), sh);
            }
        }
        let full = self.inputs.is_multiple_of(self.full_every)
            || losses != 0 && self.last_loss_input == self.inputs;
        let store = if full {
            sh.store.check_invariants()
        } else {
            sh.store.check_light()
        };
        let checks = [
            store.map_err(|e| format!("store: {e}")),
            sh.swa
                .check_invariants()
                .map_err(|e| format!("SWA slots: {e}")),
        ];
        for r in checks {
            if let Err(e) = r {
                self.violate(now, e);
            }
        }
        for g in unit.decode_pool().groups() {
            if let Err(e) = g.check_invariants() {
                self.violate(now, format!("decode group {}: {e}", g.id().0));
            }
        }
        let mut extra = std::mem::take(&mut self.extra);
        for check in &mut extra {
            if let Err(e) = check(unit, sh) {
                self.violate(now, e);
            }
        }
        self.extra = extra;
    }

    /// At the end: every arrival ended, the report agrees, and its storage rows add up.
    pub fn finish(&mut self, report: &ServiceReport) -> Result<(), String> {
        if let Some(v) = self.violation.take() {
            return Err(v);
        }
        if let Some(i) = self.state.iter().position(|&s| s == 1) {
            return Err(format!("request {i} neither completed nor rejected"));
        }
        let ended = report.completed + report.rejected_total();
        if report.arrivals != self.arrived || ended != self.arrived {
            return Err(format!(
                "{} arrivals seen, the report has {} arrivals and {ended} ended",
                self.arrived, report.arrivals
            ));
        }
        let st = &report.storage;
        let lost: u64 = st.failures.iter().map(|f| f.lost_bytes).sum();
        if lost != st.lost_bytes || st.lost_stripe_reads > st.stripe_reads {
            return Err(format!(
                "storage report: {lost} bytes lost in the rows, {} in total",
                st.lost_bytes
            ));
        }
        if let Some(r) = st.rebuilds.iter().find(|r| {
            r.outcome == "done"
                && r.finished_s
                    .partial_cmp(&r.started_s)
                    .is_none_or(|o| o.is_lt())
        }) {
            return Err(format!(
                "rebuild of node {} finished before it started",
                r.node
            ));
        }
        Ok(())
    }
}

impl Observer for Checker {
    fn on_input(&mut self, now: Nanos, input: &Input) {
        self.inputs += 1;
        if let Input::Arrival(i) = *input {
            self.arrival(now, i);
        }
    }
    fn on_output(&mut self, now: Nanos, output: &Output, _unit: &ServingUnit) {
        match *output {
            Output::Finished { request, .. } => self.ended(now, request),
            Output::Fetch {
                request,
                reused_tokens,
                ..
            } if reused_tokens > 0 => self.fetches.push((request, reused_tokens)),
            _ => {}
        }
    }
    fn after_input(&mut self, now: Nanos, unit: &ServingUnit, sh: &SharedCache) {
        self.between_events(now, unit, sh);
    }
}

/// What one seed's run went through.
#[derive(Clone, Debug, Default)]
pub struct RunSummary {
    pub requests: u64,
    pub inputs: u64,
    pub node_failures: u64,
    pub group_losses: u64,
    pub lost_objects: u64,
    pub degraded_stripe_reads: u64,
    pub rebuilds_completed: u64,
    pub rejected: u64,
    /// Compute faults: drains, GPU failures, requests forwarded and prefilled again.
    pub drains: u64,
    pub gpu_failures: u64,
    pub forwarded: u64,
    pub reprefilled: u64,
}

/// Runs `s` with every check; an error says what broke, at which input.
pub fn run_scenario(s: &Scenario, profile: &HardwareProfile) -> Result<RunSummary, String> {
    s.service
        .validate()
        .map_err(|e| format!("the generator drew a bad config: {e}"))?;
    let trace = generate(&s.workload, s.seed, s.service.constants.block_tokens)
        .map_err(|e| format!("the generator drew a bad workload: {e}"))?;
    let mut checker = Checker::new(trace.requests.len());
    let report = run_observed(
        &s.service,
        profile.clone(),
        &trace.requests,
        s.seed,
        &mut checker,
    );
    let report = match report {
        Ok(r) => r,
        Err(e) => {
            let first = checker
                .violation
                .take()
                .map(|v| format!(" (first violation: {v})"));
            return Err(format!("the run failed: {e}{}", first.unwrap_or_default()));
        }
    };
    checker.finish(&report)?;
    let st = &report.storage;
    Ok(RunSummary {
        requests: report.arrivals,
        inputs: checker.inputs(),
        node_failures: st.node_failures,
        group_losses: st.group_losses,
        lost_objects: st.lost_objects,
        degraded_stripe_reads: st.degraded_stripe_reads,
        rebuilds_completed: st.rebuilds_completed,
        rejected: report.rejected_total(),
        drains: report.faults.drains,
        gpu_failures: report.faults.decode_rank_failures + report.faults.prefill_engine_failures,
        forwarded: report.faults.forwarded_requests,
        reprefilled: report.faults.reprefilled_requests,
    })
}
