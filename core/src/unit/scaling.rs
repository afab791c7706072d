//! The autoscaler inside the unit: at every metrics interval the unit builds the controller's
//! [`Observation`] from what it saw in the interval, asks the policy
//! ([`crate::unit::autoscale`]) for pool sizes and carries the decision out. A prefill engine
//! or decode group added is paid for from the decision on and serves after the provisioning
//! delay ([`Timer::Provisioned`]); a prefill engine removed takes no new work and finishes what
//! it holds; a decode group removed is drained ([`crate::unit::faults`]). Pools are sized
//! within the configured `prefill.gpus` engines and `decode.groups` groups (the GPUs there
//! are): the ones out of service cost nothing.
//!
//! GPU time is counted at each interval's end from the GPUs in service then (provisioning,
//! serving or draining), so it is exact to one interval.

use crate::time::Nanos;
use crate::unit::ServingUnit;
use crate::unit::autoscale::{AutoscaleConfig, Autoscaler, Observation};
use crate::unit::decode_pool::GroupStatus;
use crate::unit::io::{DeviceId, Output, Timer};
use crate::unit::report::{AutoscaleReport, ScaleRow};

pub struct Scaling {
    policy: Autoscaler,
    /// TTFTs and TPOTs (ns) seen in the current interval.
    ttft: Vec<u64>,
    tpot: Vec<u64>,
    last_tick: Nanos,
    pub report: AutoscaleReport,
}

fn p90(v: &mut [u64]) -> Option<Nanos> {
    if v.is_empty() {
        return None;
    }
    let k = (v.len() * 9).div_ceil(10) - 1;
    Some(Nanos(*v.select_nth_unstable(k).1))
}

impl Scaling {
    pub fn new(cfg: AutoscaleConfig) -> Self {
        let name = match cfg.policy {
            crate::unit::autoscale::ScalePolicy::Fixed => "fixed",
            crate::unit::autoscale::ScalePolicy::Utilisation { .. } => "utilisation",
            crate::unit::autoscale::ScalePolicy::Slo { .. } => "slo",
        };
        Scaling {
            policy: Autoscaler::new(cfg),
            ttft: Vec::new(),
            tpot: Vec::new(),
            last_tick: Nanos::ZERO,
            report: AutoscaleReport {
                policy: name,
                ..Default::default()
            },
        }
    }
    pub fn on_first_token(&mut self, ttft: Nanos) {
        self.ttft.push(ttft.0);
    }
    pub fn on_complete(&mut self, tpot: Nanos) {
        self.tpot.push(tpot.0);
    }
}

impl ServingUnit {
    /// Takes the pools down to their initial sizes (at construction).
    pub(crate) fn scale_to_initial(&mut self) {
        let Some(s) = &self.scaling else { return };
        let cfg = s.policy.config().clone();
        for e in cfg.prefill.initial()..self.cfg.prefill.gpus {
            self.prefill.set_closed(e as usize, true);
        }
        for g in cfg.decode.initial()..self.cfg.decode.groups {
            self.faults.mark_off(g as usize);
            self.decode.set_status(g as usize, GroupStatus::Retired);
        }
    }

    fn engine_open(&self, e: usize) -> bool {
        !self.prefill.is_closed(e) || self.prefill.is_provisioning(e)
    }

    /// Prefill engines open (serving or provisioning) and decode groups serving or to serve
    /// (up, provisioning, or stopped by a failure and restarting); draining ones are leaving.
    fn pool_sizes(&self) -> (u32, u32) {
        let p = (0..self.prefill.engines())
            .filter(|&e| self.engine_open(e))
            .count() as u32;
        let d = (0..self.cfg.decode.groups as usize)
            .filter(|&g| match self.decode.status(g) {
                GroupStatus::Up | GroupStatus::Provisioning | GroupStatus::Stopped => true,
                GroupStatus::Evicting { .. } => !self.faults.is_retiring(g),
                GroupStatus::Draining | GroupStatus::Retired => false,
            })
            .count() as u32;
        (p, d)
    }

    /// GPUs paid for now: open prefill engines and closed ones still finishing their jobs,
    /// and every rank of a group not retired.
    fn gpus_paid(&self) -> (u64, u64) {
        let p = (0..self.prefill.engines())
            .filter(|&e| self.engine_open(e) || self.prefill.engine(e).jobs() > 0)
            .count() as u64;
        let d = (0..self.cfg.decode.groups as usize)
            .filter(|&g| self.decode.status(g) != GroupStatus::Retired)
            .map(|g| u64::from(self.decode.groups()[g].ranks()))
            .sum();
        (p, d)
    }

    /// The interval ending at `now` is over: observe, decide, act.
    pub(crate) fn autoscale_tick(&mut self, now: Nanos, out: &mut Vec<Output>) {
        let (p_gpus, d_gpus) = self.gpus_paid();
        let (engines, groups) = self.pool_sizes();
        let busy_ns = self.metrics.interval_prefill_busy_ns();
        let Some(s) = self.scaling.as_mut() else {
            return;
        };
        let dt = now.saturating_sub(s.last_tick);
        s.last_tick = now;
        s.report.prefill_gpu_s += p_gpus as f64 * dt.as_secs_f64();
        s.report.decode_gpu_s += d_gpus as f64 * dt.as_secs_f64();
        let serving = (0..self.prefill.engines())
            .filter(|&e| !self.prefill.is_down(e))
            .count()
            .max(1) as f64;
        let (mut seqs, mut slots) = (0u64, 0u64);
        for (g, grp) in self.decode.groups().iter().enumerate() {
            if self.decode.status(g) == GroupStatus::Up {
                seqs += grp.sequences();
                slots += u64::from(grp.ranks()) * u64::from(self.cfg.decode.max_seqs_per_rank);
            }
        }
        let o = Observation {
            prefill_engines: engines,
            decode_groups: groups,
            prefill_busy: busy_ns as f64 / (dt.0.max(1) as f64 * serving),
            prefill_queued: self.prefill.queued(),
            decode_occupancy: seqs as f64 / slots.max(1) as f64,
            ttft_p90: p90(&mut s.ttft),
            tpot_p90: p90(&mut s.tpot),
        };
        s.ttft.clear();
        s.tpot.clear();
        let d = s.policy.decide(now, &o);
        s.report.rows.push(ScaleRow {
            t_s: now.as_secs_f64(),
            prefill_engines: engines,
            decode_groups: groups,
            prefill_gpus: p_gpus as u32,
            decode_gpus: d_gpus as u32,
            prefill_busy: o.prefill_busy,
            decode_occupancy: o.decode_occupancy,
            ttft_p90_s: o.ttft_p90.map_or(f64::NAN, Nanos::as_secs_f64),
            tpot_p90_s: o.tpot_p90.map_or(f64::NAN, Nanos::as_secs_f64),
        });
        if let Some(n) = d.prefill {
            self.resize_prefill(now, engines, n, out);
        }
        if let Some(n) = d.decode {
            self.resize_decode(now, groups, n, out);
        }
    }

    fn resize_prefill(&mut self, now: Nanos, have: u32, want: u32, out: &mut Vec<Output>) {
        let delay = self.autoscale_cfg().provision_delay;
        let n = self.prefill.engines();
        if want > have {
            let add: Vec<usize> = (0..n)
                .filter(|&e| !self.engine_open(e))
                .take((want - have) as usize)
                .collect();
            for e in add {
                // Paid from now; it stays closed to new work until it is provisioned.
                self.scaling_report().prefill_ups += 1;
                self.prefill.set_provisioning(e, true);
                out.push(Output::TimerAt {
                    at: now + delay,
                    timer: Timer::Provisioned(DeviceId::Prefill(e as u32)),
                });
            }
        } else {
            let cut: Vec<usize> = (0..n)
                .rev()
                .filter(|&e| !self.prefill.is_closed(e) && !self.prefill.is_provisioning(e))
                .take((have - want) as usize)
                .collect();
            for e in cut {
                self.scaling_report().prefill_downs += 1;
                self.prefill.set_closed(e, true);
            }
        }
    }

    fn resize_decode(&mut self, now: Nanos, have: u32, want: u32, out: &mut Vec<Output>) {
        let delay = self.autoscale_cfg().provision_delay;
        let n = self.cfg.decode.groups as usize;
        if want > have {
            let add: Vec<usize> = (0..n)
                .filter(|&g| {
                    self.decode.status(g) == GroupStatus::Retired && self.faults.is_drained(g)
                })
                .take((want - have) as usize)
                .collect();
            for g in add {
                self.scaling_report().decode_ups += 1;
                self.faults.provision(g, self.cfg.decode.ranks);
                self.decode.set_status(g, GroupStatus::Provisioning);
                out.push(Output::TimerAt {
                    at: now + delay,
                    timer: Timer::Provisioned(DeviceId::Decode(g as u32)),
                });
            }
        } else {
            let cut: Vec<usize> = (0..n)
                .rev()
                .filter(|&g| self.decode.status(g) == GroupStatus::Up)
                .take((have - want) as usize)
                .collect();
            for g in cut {
                self.scaling_report().decode_downs += 1;
                self.drain(now, g, out);
            }
        }
    }

    /// A device added by the autoscaler is ready.
    pub(crate) fn provisioned(&mut self, now: Nanos, device: DeviceId, out: &mut Vec<Output>) {
        match device {
            DeviceId::Prefill(e) => {
                let e = e as usize;
                if self.prefill.is_provisioning(e) {
                    self.prefill.set_provisioning(e, false);
                    self.prefill.set_closed(e, false);
                    self.pull_all(now, out);
                }
            }
            DeviceId::Decode(g) => {
                let g = g as usize;
                if self.decode.status(g) == GroupStatus::Provisioning {
                    self.bring_up(now, g, out);
                }
            }
        }
    }

    fn autoscale_cfg(&self) -> &AutoscaleConfig {
        self.scaling
            .as_ref()
            .expect("autoscaler configured")
            .policy
            .config()
    }
    fn scaling_report(&mut self) -> &mut AutoscaleReport {
        &mut self.scaling.as_mut().expect("autoscaler configured").report
    }
}
