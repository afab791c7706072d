//! The unit's network links (SPEC §8): the prefill-to-decode handoff, one queue per prefill
//! machine, and the cross-machine SWA pull (no contention modelled).

use crate::service::LinkConfig;
use servelab_core::{MachineId, Nanos};

pub struct Links {
    cfg: LinkConfig,
    handoff_busy: Vec<Nanos>,
    /// Per decode group, when its outgoing link is free (forwards of a drain or failover).
    forward_busy: Vec<Nanos>,
    /// Machines of a decode group: its ranks send in parallel, each machine at the handoff
    /// bandwidth.
    group_machines: u32,
}

impl Links {
    pub fn new(cfg: &LinkConfig, prefill_machines: u32, groups: u32, group_machines: u32) -> Self {
        Links {
            cfg: cfg.clone(),
            handoff_busy: vec![Nanos::ZERO; prefill_machines as usize],
            forward_busy: vec![Nanos::ZERO; groups as usize],
            group_machines: group_machines.max(1),
        }
    }

    /// When a forward of `bytes` out of decode group `g`, queued at `now`, arrives: the
    /// group's link carries one forward at a time at its machines' combined handoff bandwidth,
    /// plus the handoff latency.
    pub fn forward(&mut self, now: Nanos, g: u32, bytes: u64) -> Nanos {
        let busy = &mut self.forward_busy[g as usize];
        let start = (*busy).max(now);
        let rate = self.cfg.handoff_bytes_per_s_per_machine * f64::from(self.group_machines);
        *busy = start + Nanos::from_secs_f64(bytes as f64 / rate);
        *busy + self.cfg.handoff_latency
    }

    /// When a handoff of `bytes` from prefill machine `m`, queued at `now`, arrives.
    pub fn handoff(&mut self, now: Nanos, m: MachineId, bytes: u64) -> Nanos {
        let busy = &mut self.handoff_busy[m.0 as usize];
        let start = (*busy).max(now);
        *busy =
            start + Nanos::from_secs_f64(bytes as f64 / self.cfg.handoff_bytes_per_s_per_machine);
        *busy + self.cfg.handoff_latency
    }

    /// How long pulling `bytes` of SWA state from another machine takes.
    pub fn swa_pull(&self, bytes: u64) -> Nanos {
        Nanos::from_secs_f64(bytes as f64 / self.cfg.swa_pull_bytes_per_s)
            + self.cfg.swa_pull_latency
    }
}
