//! The compute fault schedule of a service run (SPEC §7–§8): decode drains, decode-rank,
//! prefill-engine and SWA-host failures at given times (`[[service.faults.events]]`), and
//! optional random GPU failures with exponential MTBF / MTTR per GPU (`[service.faults.random]`,
//! drawn from the sub-seed "faults.gpu"). The environment turns each into an [`Input`] at its
//! time; the unit does the rest.
//!
//! ```toml
//! [service.faults]
//! drain_grace = "60s"        # a drained decode group decodes this long, then forwards
//! decode_recovery = "30s"    # a failed rank's group restarts on the ranks left after this
//! survivors = "migrate"      # or "reprefill": the surviving ranks' sequences of that group
//! [[service.faults.events]]
//! kind = "decode-rank"       # or "drain" (group), "prefill-engine" (engine), "swa-host" (machine)
//! group = 0
//! rank = 3
//! at = "120s"
//! recover_at = "600s"        # optional: the GPU (engine, host) is back
//! [service.faults.random]
//! gpu_mtbf = "2000h"         # per GPU, prefill engines and decode ranks alike
//! gpu_mttr = "2h"
//! until = "1h"               # no random failure after this
//! ```

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use servelab_core::seed::sub_seed;
use servelab_core::unit::{ElasticConfig, Fault, Input, SurvivorPolicy};
use servelab_core::{ConfigError, MachineId, Nanos};

/// What a scheduled event does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    Drain,
    DecodeRank,
    PrefillEngine,
    SwaHost,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultEvent {
    pub kind: FaultKind,
    #[serde(default)]
    pub group: Option<u32>,
    #[serde(default)]
    pub rank: Option<u32>,
    #[serde(default)]
    pub engine: Option<u32>,
    #[serde(default)]
    pub machine: Option<u32>,
    pub at: Nanos,
    #[serde(default)]
    pub recover_at: Option<Nanos>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RandomGpuFaults {
    pub gpu_mtbf: Nanos,
    pub gpu_mttr: Nanos,
    /// No random failure starts after this.
    pub until: Nanos,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FaultsConfig {
    /// Defaults of [`ElasticConfig`] when absent.
    pub drain_grace: Option<Nanos>,
    pub decode_recovery: Option<Nanos>,
    /// "migrate" (default) or "reprefill": the surviving ranks' sequences of a failed group.
    pub survivors: Option<SurvivorPolicy>,
    pub events: Vec<FaultEvent>,
    pub random: Option<RandomGpuFaults>,
}

/// The unit's shape, as the fault checks need it.
#[derive(Clone, Copy, Debug)]
pub struct UnitShape {
    pub prefill_gpus: u32,
    pub decode_groups: u32,
    pub decode_ranks: u32,
    pub machines: u32,
}

impl FaultsConfig {
    pub fn is_default(&self) -> bool {
        *self == FaultsConfig::default()
    }

    pub fn elastic(&self) -> ElasticConfig {
        let d = ElasticConfig::default();
        ElasticConfig {
            drain_grace: self.drain_grace.unwrap_or(d.drain_grace),
            decode_recovery: self.decode_recovery.unwrap_or(d.decode_recovery),
            survivors: self.survivors.unwrap_or(d.survivors),
        }
    }

    /// Checks every event against the unit's shape; errors name `faults.events[i].field`.
    pub fn validate(&self, shape: UnitShape) -> Result<(), ConfigError> {
        for (i, e) in self.events.iter().enumerate() {
            let f = |name: &str| format!("faults.events[{i}].{name}");
            let fault = e
                .fault(shape)
                .map_err(|(field, why)| ConfigError::invalid(f(field), why))?;
            if let Some(r) = e.recover_at {
                if e.kind == FaultKind::Drain {
                    return Err(ConfigError::invalid(
                        f("recover_at"),
                        "a drained group does not come back (drain has no recover_at)",
                    ));
                }
                if r <= e.at {
                    return Err(ConfigError::invalid(
                        f("recover_at"),
                        format!("{r} is not after the failure at {}", e.at),
                    ));
                }
            }
            if let Some(j) = self.events[..i].iter().position(|o| o.overlaps(e, shape)) {
                return Err(ConfigError::invalid(
                    f("at"),
                    format!("{fault:?} is already down then (faults.events[{j}])"),
                ));
            }
        }
        self.validate_counts(shape)?;
        if let Some(r) = &self.random {
            for (name, v) in [("gpu_mtbf", r.gpu_mtbf), ("gpu_mttr", r.gpu_mttr)] {
                if v == Nanos::ZERO {
                    return Err(ConfigError::invalid(
                        format!("faults.random.{name}"),
                        "must be positive",
                    ));
                }
            }
        }
        Ok(())
    }

    /// More failures of one kind than devices of that kind can never be served.
    fn validate_counts(&self, shape: UnitShape) -> Result<(), ConfigError> {
        let count = |k: FaultKind| self.events.iter().filter(|e| e.kind == k).count() as u64;
        let ranks = u64::from(shape.decode_groups) * u64::from(shape.decode_ranks);
        for (kind, n, name) in [
            (FaultKind::DecodeRank, ranks, "decode GPUs"),
            (
                FaultKind::PrefillEngine,
                u64::from(shape.prefill_gpus),
                "prefill GPUs",
            ),
            (
                FaultKind::Drain,
                u64::from(shape.decode_groups),
                "decode groups",
            ),
        ] {
            let c = count(kind);
            let unrepaired = self
                .events
                .iter()
                .filter(|e| e.kind == kind && e.recover_at.is_none())
                .count() as u64;
            if unrepaired > n || c > n && kind == FaultKind::Drain {
                return Err(ConfigError::invalid(
                    "faults.events",
                    format!("{c} {kind:?} events for {n} {name}"),
                ));
            }
        }
        Ok(())
    }

    /// Every event as (time, input), in schedule order: scheduled ones, then random ones up
    /// to `random.until`. The environment pushes them before the run starts.
    pub fn inputs(&self, shape: UnitShape, seed: u64) -> Vec<(Nanos, Input)> {
        let mut v = Vec::new();
        for e in &self.events {
            let Ok(f) = e.fault(shape) else { continue };
            match f {
                None => v.push((e.at, Input::Drain(e.group.unwrap_or(0)))),
                Some(f) => {
                    v.push((e.at, Input::Fault(f)));
                    if let Some(r) = e.recover_at {
                        v.push((r, Input::Repair(f)));
                    }
                }
            }
        }
        if let Some(r) = &self.random {
            random_inputs(r, shape, seed, &mut v);
        }
        v
    }
}

impl FaultEvent {
    /// The fault it names (None for a drain), or (field, why) when it names nothing.
    fn fault(&self, s: UnitShape) -> Result<Option<Fault>, (&'static str, String)> {
        let need = |v: Option<u32>, name: &'static str, below: u32, what: &str| match v {
            None => Err((name, format!("{:?} needs `{name}`", self.kind))),
            Some(x) if x >= below => Err((name, format!("{x}: the unit has {below} {what}"))),
            Some(x) => Ok(x),
        };
        Ok(match self.kind {
            FaultKind::Drain => {
                need(self.group, "group", s.decode_groups, "decode groups")?;
                None
            }
            FaultKind::DecodeRank => Some(Fault::DecodeRank {
                group: need(self.group, "group", s.decode_groups, "decode groups")?,
                rank: need(self.rank, "rank", s.decode_ranks, "ranks per decode group")?,
            }),
            FaultKind::PrefillEngine => Some(Fault::PrefillEngine(need(
                self.engine,
                "engine",
                s.prefill_gpus,
                "prefill engines",
            )?)),
            FaultKind::SwaHost => Some(Fault::SwaHost(MachineId(need(
                self.machine,
                "machine",
                s.machines,
                "machines",
            )?))),
        })
    }

    /// Both name the same device and `self`'s down time covers `o`'s failure.
    fn overlaps(&self, o: &FaultEvent, s: UnitShape) -> bool {
        let same = match (self.fault(s), o.fault(s)) {
            // Two drains name the same group, or not.
            (Ok(None), Ok(None)) => self.group == o.group,
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        };
        same && o.at >= self.at && self.recover_at.is_none_or(|r| o.at < r)
    }
}

/// Random failures of every GPU (prefill engines, then decode ranks group by group): an
/// exponential up time with mean `gpu_mtbf`, then down for an exponential time with mean
/// `gpu_mttr`, repeated while failures start before `until`. One stream per GPU from the
/// sub-seed, so one GPU's draws do not depend on the others'.
fn random_inputs(r: &RandomGpuFaults, s: UnitShape, seed: u64, v: &mut Vec<(Nanos, Input)>) {
    let base = sub_seed(seed, "faults.gpu");
    let decode = (0..s.decode_groups)
        .flat_map(|group| (0..s.decode_ranks).map(move |rank| Fault::DecodeRank { group, rank }));
    let gpus = (0..s.prefill_gpus).map(Fault::PrefillEngine).chain(decode);
    for (n, f) in gpus.enumerate() {
        let mut rng =
            ChaCha8Rng::seed_from_u64(base ^ (n as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let mut exp = |mean: Nanos| {
            let u: f64 = rng.random();
            Nanos::from_secs_f64(-(1.0 - u).ln() * mean.as_secs_f64()).max(Nanos(1))
        };
        let mut t = exp(r.gpu_mtbf);
        while t < r.until {
            let back = t.saturating_add(exp(r.gpu_mttr));
            v.push((t, Input::Fault(f)));
            v.push((back, Input::Repair(f)));
            t = back.saturating_add(exp(r.gpu_mtbf));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: UnitShape = UnitShape {
        prefill_gpus: 4,
        decode_groups: 2,
        decode_ranks: 4,
        machines: 3,
    };

    fn ev(kind: FaultKind, at: u64, recover: Option<u64>) -> FaultEvent {
        FaultEvent {
            kind,
            group: Some(0),
            rank: Some(1),
            engine: Some(2),
            machine: Some(1),
            at: Nanos::from_secs(at),
            recover_at: recover.map(Nanos::from_secs),
        }
    }

    fn err(events: Vec<FaultEvent>) -> String {
        let c = FaultsConfig {
            events,
            ..Default::default()
        };
        c.validate(SHAPE).unwrap_err().to_string()
    }

    #[test]
    fn bad_events_name_their_field() {
        let mut e = ev(FaultKind::DecodeRank, 10, None);
        e.rank = Some(4);
        assert!(err(vec![e]).contains("faults.events[0].rank"));
        let mut e = ev(FaultKind::PrefillEngine, 10, None);
        e.engine = None;
        assert!(err(vec![e]).contains("faults.events[0].engine"));
        let e = ev(FaultKind::SwaHost, 10, Some(5));
        assert!(err(vec![e]).contains("faults.events[0].recover_at"));
        let e = ev(FaultKind::Drain, 10, Some(50));
        assert!(err(vec![e]).contains("faults.events[0].recover_at"));
        let dup = vec![
            ev(FaultKind::DecodeRank, 10, Some(100)),
            ev(FaultKind::DecodeRank, 50, None),
        ];
        assert!(err(dup).contains("faults.events[1].at"));
        let mut other = ev(FaultKind::Drain, 20, None);
        other.group = Some(1);
        let drains = FaultsConfig {
            events: vec![ev(FaultKind::Drain, 10, None), other],
            ..Default::default()
        };
        assert!(
            drains.validate(SHAPE).is_ok(),
            "two groups may both be drained"
        );
        let twice = vec![
            ev(FaultKind::Drain, 10, None),
            ev(FaultKind::Drain, 20, None),
        ];
        assert!(err(twice).contains("faults.events[1].at"));
        let many: Vec<FaultEvent> = (0..5)
            .map(|k| {
                let mut e = ev(FaultKind::PrefillEngine, 10, None);
                e.engine = Some(k % 4);
                e.at = Nanos::from_secs(10 + k as u64);
                e
            })
            .collect();
        assert!(err(many).contains("faults.events"));
    }

    #[test]
    fn events_become_inputs_and_random_ones_repeat_per_seed() {
        let c = FaultsConfig {
            events: vec![ev(FaultKind::DecodeRank, 10, Some(20))],
            random: Some(RandomGpuFaults {
                gpu_mtbf: Nanos::from_secs(100),
                gpu_mttr: Nanos::from_secs(10),
                until: Nanos::from_secs(1000),
            }),
            ..Default::default()
        };
        c.validate(SHAPE).unwrap();
        let a = c.inputs(SHAPE, 1);
        let f = Fault::DecodeRank { group: 0, rank: 1 };
        assert_eq!(
            a[..2],
            [
                (Nanos::from_secs(10), Input::Fault(f)),
                (Nanos::from_secs(20), Input::Repair(f))
            ]
        );
        // 12 GPUs × about 1000 s / 110 s cycles: around a hundred failures.
        let fails = a
            .iter()
            .filter(|(_, i)| matches!(i, Input::Fault(_)))
            .count();
        assert!((40..200).contains(&fails), "{fails}");
        assert_eq!(c.inputs(SHAPE, 1), a);
        assert_ne!(c.inputs(SHAPE, 2), a);
    }
}
