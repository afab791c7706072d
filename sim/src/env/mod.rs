//! The simulator's environment for a serving unit: a virtual clock (an event queue ordered by
//! (time, sequence)), the cost model as the devices, the store cluster's reads, the links and
//! the MoE skew model. It feeds the unit its inputs and carries out its outputs through the
//! one driver loop ([`servelab_core::unit::run`]).

pub mod arrivals;
pub mod faults;
pub mod links;
pub mod moe;
pub mod storage;

use crate::cost::CostModel;
use crate::events::EventQueue;
use crate::service::{Arrivals, Placement, ServiceConfig, ServiceError};
use arrivals::ArrivalSource;
pub use arrivals::RequestFeed;
use links::Links;
use moe::MoeSkew;
use servelab_core::engine::Backend;
use servelab_core::unit::{
    DeviceId, Environment, Input, Output, RunError, ServingUnit, SharedCache,
};
use servelab_core::{BlockKey, ConfigError, Nanos};
use storage::StorageCluster;

pub struct VirtualEnv {
    queue: EventQueue<Input>,
    backend: CostModel,
    storage: StorageCluster,
    links: Links,
    moe: MoeSkew,
    series_interval: Nanos,
    kv_bytes_per_token: u64,
    block_tokens: u32,
    swa_state_bytes: u64,
    arrivals: ArrivalSource,
    /// With [`Placement::OneGpu`], when the one GPU is free again (`None`: own GPUs).
    one_gpu_free_at: Option<Nanos>,
}

impl VirtualEnv {
    /// The environment of `cfg` for a unit given `requests` whole (sorted by arrival).
    pub fn new(
        cfg: &ServiceConfig,
        backend: CostModel,
        requests: &[servelab_core::Request],
        seed: u64,
    ) -> Result<Self, ServiceError> {
        Self::with_arrivals(
            cfg,
            backend,
            ArrivalSource::new(&cfg.arrivals, requests),
            seed,
        )
    }

    /// The environment of `cfg` for a unit given its requests as they are read from `feed`
    /// (in arrival order; open loop only).
    pub fn streamed(
        cfg: &ServiceConfig,
        backend: CostModel,
        feed: RequestFeed,
        seed: u64,
    ) -> Result<Self, ServiceError> {
        if !matches!(cfg.arrivals, Arrivals::OpenLoop) {
            return Err(ConfigError::invalid(
                "service.arrivals",
                "a streamed workload runs open loop only (a closed-loop turn's time needs the \
                 session's next turn, which the stream has not read yet)",
            )
            .into());
        }
        Self::with_arrivals(cfg, backend, ArrivalSource::streamed(feed), seed)
    }

    fn with_arrivals(
        cfg: &ServiceConfig,
        backend: CostModel,
        mut arrivals: ArrivalSource,
        seed: u64,
    ) -> Result<Self, ServiceError> {
        let c = &cfg.constants;
        let prefill_machines = cfg.prefill.gpus.div_ceil(cfg.prefill.gpus_per_machine);
        let mut queue = EventQueue::new();
        // Arrivals are fed one at a time so the queue holds only what is in flight.
        if let Some((t, i)) = arrivals.next_open(None).map_err(ServiceError::Run)? {
            queue.push(t, Input::Arrival(i));
            queue.push(cfg.series_interval, Input::Tick);
        }
        // The fault schedule is known in advance: all of it is queued now.
        for (at, input) in cfg.faults.inputs(cfg.unit_shape(), seed) {
            queue.push(at, input);
        }
        Ok(VirtualEnv {
            queue,
            backend,
            storage: StorageCluster::new(&cfg.fetch, &cfg.store, seed),
            links: Links::new(
                &cfg.links,
                prefill_machines,
                cfg.decode.groups,
                cfg.decode.ranks.div_ceil(cfg.decode.gpus_per_machine),
            ),
            moe: MoeSkew::new(&cfg.moe, cfg.prefill.gpus, cfg.decode.groups, seed)?,
            series_interval: cfg.series_interval,
            kv_bytes_per_token: u64::from(c.kv_bytes_per_token),
            block_tokens: c.block_tokens,
            swa_state_bytes: c.swa_state_bytes(),
            arrivals,
            one_gpu_free_at: (cfg.placement == Placement::OneGpu).then_some(Nanos::ZERO),
        })
    }

    /// Inputs handled so far.
    pub fn events(&self) -> u64 {
        self.queue.popped()
    }
    pub fn now(&self) -> Nanos {
        self.queue.now()
    }
    pub fn moe(&self) -> &MoeSkew {
        &self.moe
    }
    /// The storage cluster's nodes (their queues, failures and rebuilds).
    pub fn storage_mut(&mut self) -> &mut StorageCluster {
        &mut self.storage
    }

    fn launch(&mut self, device: DeviceId, start: Nanos, unit: &mut ServingUnit) {
        let (plan, report) = unit.launch_mut(device);
        let extra = self.moe.decorate(start, device, plan);
        let begin = self.one_gpu_free_at.map_or(start, |free| start.max(free));
        self.backend.execute(begin, plan, report);
        report.duration += extra;
        let end = match &mut self.one_gpu_free_at {
            None => start + report.duration,
            // As the GPU engine does: a step always moves the shared device's time forward.
            Some(free) => {
                *free = begin + report.duration.max(Nanos(1));
                *free
            }
        };
        self.queue.push(end, Input::StepDone(device));
    }

    fn fetch(
        &mut self,
        now: Nanos,
        i: u32,
        tokens: u32,
        unit: &ServingUnit,
        sh: &SharedCache,
    ) -> Result<Nanos, RunError> {
        let bs = self.block_tokens;
        let keys = unit.blocks_within(i as usize, tokens.div_ceil(bs) * bs);
        let r = unit
            .request(i)
            .ok_or_else(|| RunError::Invariant(format!("a fetch for request {i}, not held")))?;
        let fallback = BlockKey(r.id.0);
        let bytes = u64::from(tokens) * self.kv_bytes_per_token;
        Ok(self.storage.fetch(now, &sh.store, keys, fallback, bytes))
    }
}

impl servelab_core::unit::Lookahead for VirtualEnv {
    fn next_time(&self) -> Option<Nanos> {
        self.queue.peek_time()
    }
}

impl Environment for VirtualEnv {
    fn next(&mut self, unit: &mut ServingUnit) -> Result<Option<(Nanos, Input)>, RunError> {
        let Some((now, input)) = self.queue.pop() else {
            return Ok(None);
        };
        match input {
            Input::Arrival(i) => {
                self.arrivals.give(i, unit)?;
                if self.arrivals.is_open(i)
                    && let Some((at, next)) = self.arrivals.next_open(Some(unit))?
                {
                    self.queue.push(at, Input::Arrival(next));
                }
            }
            Input::Tick => {
                if !self.queue.is_empty() {
                    self.queue.push(now + self.series_interval, Input::Tick);
                } else if unit.pending() > 0 {
                    return Err(RunError::Stuck {
                        at: now,
                        pending: unit.pending(),
                        requests: unit.pending_requests(10),
                    });
                }
            }
            _ => {}
        }
        Ok(Some((now, input)))
    }

    fn apply(
        &mut self,
        now: Nanos,
        output: Output,
        unit: &mut ServingUnit,
        sh: &SharedCache,
    ) -> Result<(), RunError> {
        match output {
            Output::Launch { device, start } => self.launch(device, start, unit),
            Output::Fetch {
                request,
                reused_tokens,
                swa_pull,
                ..
            } => {
                let mut ready = now;
                if reused_tokens > 0 {
                    ready = ready.max(self.fetch(now, request, reused_tokens, unit, sh)?);
                }
                if swa_pull {
                    ready = ready.max(now + self.links.swa_pull(self.swa_state_bytes));
                }
                self.queue.push(ready, Input::PrefixReady(request));
            }
            Output::Handoff {
                request,
                machine,
                bytes,
            } => {
                let at = self.links.handoff(now, machine, bytes);
                self.queue.push(at, Input::HandoffDone(request));
            }
            Output::WakeAt(at) => self.queue.push(at, Input::WakeUp),
            Output::TimerAt { at, timer } => self.queue.push(at, Input::Timer(timer)),
            Output::Forward {
                request,
                group,
                bytes,
            } => {
                let at = self.links.forward(now, group, bytes);
                self.queue.push(at, Input::HandoffDone(request));
            }
            Output::Finished { request, .. } => {
                if let Some((at, next)) = self.arrivals.follow(now, request) {
                    self.queue.push(at, Input::Arrival(next));
                }
            }
        }
        Ok(())
    }

    fn update_shared(&mut self, now: Nanos, sh: &mut SharedCache) -> Result<(), RunError> {
        self.storage.update(now, &mut sh.store);
        Ok(())
    }
}
