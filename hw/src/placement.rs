//! Which GPUs each device of the serving unit runs on (`[placement]`), and the per-GPU
//! timelines the GPU environment keeps on the virtual clock.
//!
//! A deployment has `gpus` logical GPUs. Each prefill engine sits on one or more of them and
//! each decode group on as many as it has EP ranks (one rank per GPU). A logical GPU maps to a
//! physical CUDA ordinal (`ordinals`, identity by default), so a placement written for eight
//! H200s runs on a one-GPU machine with every ordinal 0: the unit's timeline is the eight GPUs'
//! (steps on different logical GPUs overlap), the work itself runs on the one device.
//!
//! A logical GPU may be shared by several devices (the one-GPU unit of the conformance runs
//! shares GPU 0 between all of them): steps of the devices that share it queue FIFO on it.
//! A handoff between devices with no GPU in common is a peer copy on the copy engines (it does
//! not wait for compute); one between devices that share a GPU is a device copy queued with
//! that GPU's steps.

use serde::{Deserialize, Serialize};
use servelab_core::ConfigError;
use servelab_core::Nanos;
use servelab_core::unit::DeviceId;

/// `[placement]`: the GPUs of every device of the unit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlacementConfig {
    /// Logical GPUs of the deployment, numbered from 0.
    pub gpus: u32,
    /// The physical CUDA ordinal of each logical GPU (empty: logical GPU i is ordinal i).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ordinals: Vec<u32>,
    /// The logical GPUs of each prefill engine, one list per engine.
    pub prefill: Vec<Vec<u32>>,
    /// The logical GPUs of each decode group, one per EP rank, one list per group.
    pub decode: Vec<Vec<u32>>,
}

/// The unit's shape a placement must match.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnitShape {
    pub prefill_engines: u32,
    pub decode_groups: u32,
    /// EP ranks of every decode group (None: any, the same for every group).
    pub decode_ranks: Option<u32>,
}

impl PlacementConfig {
    /// Every device of the unit on logical GPU 0 (the one-GPU unit).
    pub fn shared(prefill_engines: u32, decode_groups: u32) -> Self {
        PlacementConfig {
            gpus: 1,
            ordinals: Vec::new(),
            prefill: vec![vec![0]; prefill_engines as usize],
            decode: vec![vec![0]; decode_groups as usize],
        }
    }

    /// Each prefill engine on one GPU of its own, then each decode group on `ranks` GPUs of
    /// its own, every logical GPU on physical ordinal `ordinal(i)`.
    pub fn disaggregated(
        prefill_engines: u32,
        decode_groups: u32,
        ranks: u32,
        ordinal: impl Fn(u32) -> u32,
    ) -> Self {
        let prefill: Vec<Vec<u32>> = (0..prefill_engines).map(|e| vec![e]).collect();
        let decode: Vec<Vec<u32>> = (0..decode_groups)
            .map(|g| {
                (0..ranks)
                    .map(|r| prefill_engines + g * ranks + r)
                    .collect()
            })
            .collect();
        let gpus = prefill_engines + decode_groups * ranks;
        PlacementConfig {
            gpus,
            ordinals: (0..gpus).map(ordinal).collect(),
            prefill,
            decode,
        }
    }

    /// Checks the placement against the unit (`shape`) and, when known, the machine's device
    /// count; errors name the field under `section` (e.g. "placement").
    pub fn validate(
        &self,
        section: &str,
        shape: UnitShape,
        devices: Option<usize>,
    ) -> Result<(), ConfigError> {
        let field = |f: &str| format!("{section}.{f}");
        if self.gpus == 0 {
            return Err(ConfigError::invalid(field("gpus"), "must be at least 1"));
        }
        if !self.ordinals.is_empty() && self.ordinals.len() != self.gpus as usize {
            return Err(ConfigError::invalid(
                field("ordinals"),
                format!(
                    "{} ordinals for {} logical GPUs (give one per GPU, or none)",
                    self.ordinals.len(),
                    self.gpus
                ),
            ));
        }
        if let Some(n) = devices
            && let Some(g) = (0..self.gpus).find(|&g| self.ordinal(g) as usize >= n)
        {
            let (at, hint) = if self.ordinals.is_empty() {
                (
                    "ordinals".to_string(),
                    " (map them with `ordinals`, e.g. all 0 on one GPU)",
                )
            } else {
                (format!("ordinals[{g}]"), "")
            };
            return Err(ConfigError::invalid(
                field(&at),
                format!(
                    "logical GPU {g} on ordinal {} but the machine has {n} GPU(s){hint}",
                    self.ordinal(g)
                ),
            ));
        }
        self.check_devices(section, "prefill", &self.prefill, shape.prefill_engines)?;
        self.check_devices(section, "decode", &self.decode, shape.decode_groups)?;
        let ranks = shape
            .decode_ranks
            .or_else(|| self.decode.first().map(|g| g.len() as u32));
        if let Some((g, gpus)) = self
            .decode
            .iter()
            .enumerate()
            .find(|(_, gpus)| Some(gpus.len() as u32) != ranks)
        {
            return Err(ConfigError::invalid(
                field(&format!("decode[{g}]")),
                format!(
                    "{} GPUs but a decode group has {} EP ranks (one GPU each)",
                    gpus.len(),
                    ranks.unwrap_or(0)
                ),
            ));
        }
        Ok(())
    }

    fn check_devices(
        &self,
        section: &str,
        kind: &str,
        lists: &[Vec<u32>],
        want: u32,
    ) -> Result<(), ConfigError> {
        let what = if kind == "prefill" {
            "prefill engines"
        } else {
            "decode groups"
        };
        if lists.len() != want as usize {
            return Err(ConfigError::invalid(
                format!("{section}.{kind}"),
                format!("{} lists for the unit's {want} {what}", lists.len()),
            ));
        }
        for (d, gpus) in lists.iter().enumerate() {
            let at = format!("{section}.{kind}[{d}]");
            if gpus.is_empty() {
                return Err(ConfigError::invalid(at, "lists no GPU"));
            }
            if let Some(&g) = gpus.iter().find(|&&g| g >= self.gpus) {
                return Err(ConfigError::invalid(
                    at,
                    format!("GPU {g} is not one of the {} logical GPUs", self.gpus),
                ));
            }
            if let Some(&g) = gpus
                .iter()
                .enumerate()
                .find_map(|(i, g)| gpus[..i].contains(g).then_some(g))
            {
                return Err(ConfigError::invalid(
                    at,
                    format!("GPU {g} listed twice (one rank per GPU)"),
                ));
            }
        }
        Ok(())
    }

    /// The logical GPUs of a device of the unit (empty for a device the placement lacks).
    pub fn gpus_of(&self, device: DeviceId) -> &[u32] {
        let lists = match device {
            DeviceId::Prefill(e) => self.prefill.get(e as usize),
            DeviceId::Decode(g) => self.decode.get(g as usize),
        };
        lists.map_or(&[], Vec::as_slice)
    }

    /// The physical ordinal of logical GPU `gpu`.
    pub fn ordinal(&self, gpu: u32) -> u32 {
        self.ordinals.get(gpu as usize).copied().unwrap_or(gpu)
    }

    /// The distinct physical ordinals the placement uses, ascending.
    pub fn physical_ordinals(&self) -> Vec<u32> {
        let mut v: Vec<u32> = (0..self.gpus).map(|g| self.ordinal(g)).collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// Whether two devices share a logical GPU (their handoff is a copy inside one GPU).
    pub fn share_a_gpu(&self, a: DeviceId, b: DeviceId) -> bool {
        let gb = self.gpus_of(b);
        self.gpus_of(a).iter().any(|g| gb.contains(g))
    }

    /// No logical GPU holds two devices: every device on GPUs of its own (the simulator's
    /// `own-gpus` placement is then the matching model).
    pub fn own_gpus(&self) -> bool {
        let mut seen = vec![false; self.gpus as usize];
        for g in self.prefill.iter().chain(&self.decode).flatten() {
            let slot = &mut seen[*g as usize];
            if *slot {
                return false;
            }
            *slot = true;
        }
        true
    }
}

/// Where a handoff's copy ran and for how long it waited.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    pub begin: Nanos,
    pub end: Nanos,
}

/// The virtual clock's per-GPU timelines: when each logical GPU's compute is free, and when
/// each GPU's outgoing copy engine is.
#[derive(Clone, Debug)]
pub struct Timelines {
    placement: PlacementConfig,
    compute_free: Vec<Nanos>,
    copy_free: Vec<Nanos>,
}

impl Timelines {
    pub fn new(placement: PlacementConfig) -> Self {
        let n = placement.gpus as usize;
        Timelines {
            placement,
            compute_free: vec![Nanos::ZERO; n],
            copy_free: vec![Nanos::ZERO; n],
        }
    }

    pub fn placement(&self) -> &PlacementConfig {
        &self.placement
    }

    /// A step of `device` planned for `start` taking `duration`: it starts when all of the
    /// device's GPUs are free (a decode step runs its ranks in lockstep) and holds them all.
    pub fn step(&mut self, device: DeviceId, start: Nanos, duration: Nanos) -> Slot {
        let gpus = self.placement.gpus_of(device);
        let free = gpus
            .iter()
            .map(|&g| self.compute_free[g as usize])
            .max()
            .unwrap_or(Nanos::ZERO);
        let begin = start.max(free);
        let end = begin + duration.max(Nanos(1));
        for &g in gpus {
            self.compute_free[g as usize] = end;
        }
        Slot { begin, end }
    }

    /// A handoff from `from` to `to` asked for at `now`, its copy taking `duration`. Devices
    /// that share a GPU copy inside it, queued with its steps; otherwise the copy runs on the
    /// source's first GPU's copy engine, one copy at a time, beside the compute.
    pub fn handoff(&mut self, from: DeviceId, to: DeviceId, now: Nanos, duration: Nanos) -> Slot {
        let shared = self
            .placement
            .gpus_of(from)
            .iter()
            .copied()
            .find(|g| self.placement.gpus_of(to).contains(g));
        let line = match shared {
            Some(g) => &mut self.compute_free[g as usize],
            None => match self.placement.gpus_of(from).first() {
                Some(&g) => &mut self.copy_free[g as usize],
                None => {
                    return Slot {
                        begin: now,
                        end: now + duration,
                    };
                }
            },
        };
        let begin = now.max(*line);
        let end = begin + duration;
        *line = end;
        Slot { begin, end }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(p: u32, g: u32, r: Option<u32>) -> UnitShape {
        UnitShape {
            prefill_engines: p,
            decode_groups: g,
            decode_ranks: r,
        }
    }

    #[test]
    fn toml_round_trip_and_errors_name_the_field() {
        let text = "gpus = 6\nordinals = [0, 0, 0, 0, 0, 0]\nprefill = [[0], [1]]\n\
                    decode = [[2, 3], [4, 5]]\n";
        let p: PlacementConfig = toml::from_str(text).unwrap();
        p.validate("placement", shape(2, 2, Some(2)), Some(1))
            .unwrap();
        assert!(p.own_gpus());
        assert_eq!(p.physical_ordinals(), vec![0]);
        assert_eq!(p.gpus_of(DeviceId::Decode(1)), &[4, 5]);
        let back: PlacementConfig = toml::from_str(&toml::to_string(&p).unwrap()).unwrap();
        assert_eq!(back, p);
        assert!(toml::from_str::<PlacementConfig>(&format!("{text}gpu = 1\n")).is_err());
        let err = |p: &PlacementConfig, s: UnitShape, d: Option<usize>| {
            p.validate("placement", s, d).unwrap_err().to_string()
        };
        // Eight ordinals 0..6 on a one-GPU machine: the identity map does not fit.
        let mut q = p.clone();
        q.ordinals.clear();
        assert!(err(&q, shape(2, 2, Some(2)), Some(1)).contains("placement.ordinals"));
        q.ordinals = vec![0, 0, 0, 0, 0, 1];
        assert!(err(&q, shape(2, 2, Some(2)), Some(1)).contains("placement.ordinals[5]"));
        assert!(err(&p, shape(3, 2, Some(2)), Some(1)).contains("placement.prefill"));
        assert!(err(&p, shape(2, 2, Some(4)), Some(1)).contains("placement.decode[0]"));
        let mut q = p.clone();
        q.decode[1] = vec![4, 6];
        assert!(err(&q, shape(2, 2, Some(2)), None).contains("placement.decode[1]"));
        q.decode[1] = vec![4, 4];
        assert!(err(&q, shape(2, 2, Some(2)), None).contains("listed twice"));
        q.decode[1] = vec![4];
        assert!(err(&q, shape(2, 2, None), None).contains("placement.decode[1]"));
        q.prefill[0] = vec![];
        assert!(err(&q, shape(2, 2, None), None).contains("placement.prefill[0]"));
        let mut q = p.clone();
        q.gpus = 0;
        assert!(err(&q, shape(2, 2, None), None).contains("placement.gpus"));
    }

    #[test]
    fn disaggregated_and_shared_placements() {
        let p = PlacementConfig::disaggregated(2, 3, 2, |_| 0);
        assert_eq!(p.gpus, 8);
        assert_eq!(p.decode, vec![vec![2, 3], vec![4, 5], vec![6, 7]]);
        p.validate("placement", shape(2, 3, Some(2)), Some(1))
            .unwrap();
        assert!(p.own_gpus());
        assert!(!p.share_a_gpu(DeviceId::Prefill(0), DeviceId::Decode(0)));
        let s = PlacementConfig::shared(2, 2);
        s.validate("placement", shape(2, 2, Some(1)), Some(1))
            .unwrap();
        assert!(!s.own_gpus());
        assert!(s.share_a_gpu(DeviceId::Prefill(1), DeviceId::Decode(0)));
        let ident = PlacementConfig::disaggregated(1, 1, 4, |g| g);
        assert_eq!(ident.physical_ordinals(), vec![0, 1, 2, 3, 4]);
    }

    /// Steps on different GPUs overlap, steps on one GPU queue; a decode group waits for all of
    /// its GPUs; a peer handoff does not wait for compute, a copy inside a shared GPU does.
    #[test]
    fn timelines_queue_per_gpu() {
        let ms = Nanos::from_millis;
        let mut t = Timelines::new(PlacementConfig::disaggregated(2, 1, 2, |_| 0));
        let a = t.step(DeviceId::Prefill(0), ms(0), ms(10));
        let b = t.step(DeviceId::Prefill(1), ms(1), ms(10));
        assert_eq!(
            (a.begin, a.end, b.begin, b.end),
            (ms(0), ms(10), ms(1), ms(11))
        );
        let c = t.step(DeviceId::Prefill(0), ms(2), ms(5));
        assert_eq!((c.begin, c.end), (ms(10), ms(15)));
        let h = t.handoff(DeviceId::Prefill(0), DeviceId::Decode(0), ms(3), ms(1));
        assert_eq!((h.begin, h.end), (ms(3), ms(4)));
        let h2 = t.handoff(DeviceId::Prefill(0), DeviceId::Decode(0), ms(3), ms(1));
        assert_eq!(h2.begin, ms(4), "one copy at a time per source GPU");
        let d = t.step(DeviceId::Decode(0), ms(4), ms(2));
        assert_eq!((d.begin, d.end), (ms(4), ms(6)));
        // One shared GPU: everything FIFO, the handoff included.
        let mut s = Timelines::new(PlacementConfig::shared(2, 1));
        s.step(DeviceId::Prefill(0), ms(0), ms(10));
        let b = s.step(DeviceId::Prefill(1), ms(1), ms(10));
        assert_eq!(b.begin, ms(10));
        let h = s.handoff(DeviceId::Prefill(0), DeviceId::Decode(0), ms(3), ms(1));
        assert_eq!((h.begin, h.end), (ms(20), ms(21)));
        let d = s.step(DeviceId::Decode(0), ms(5), ms(1));
        assert_eq!(d.begin, ms(21));
    }
    proptest::proptest! {
        /// Any sequence of steps and handoffs on any disaggregated placement: a step never
        /// starts before its planned start nor before the previous step on any of its GPUs
        /// ended; a handoff never starts before it was asked for.
        #[test]
        fn timelines_keep_every_gpu_fifo(
            p in 1u32..3,
            g in 1u32..3,
            ranks in 1u32..3,
            ops in proptest::collection::vec((0u32..8, 0u64..50, 1u64..20, proptest::bool::ANY), 1..40),
        ) {
            let placement = PlacementConfig::disaggregated(p, g, ranks, |_| 0);
            let mut t = Timelines::new(placement.clone());
            let mut free = vec![Nanos::ZERO; placement.gpus as usize];
            for (d, at, len, handoff) in ops {
                let (at, len) = (Nanos::from_micros(at), Nanos::from_micros(len));
                let device = if d % 2 == 0 {
                    DeviceId::Prefill(d / 2 % p)
                } else {
                    DeviceId::Decode(d / 2 % g)
                };
                if handoff {
                    let s = t.handoff(DeviceId::Prefill(d % p), DeviceId::Decode(d % g), at, len);
                    proptest::prop_assert!(s.begin >= at && s.end == s.begin + len);
                    continue;
                }
                let s = t.step(device, at, len);
                proptest::prop_assert!(s.begin >= at && s.end == s.begin + len);
                for &gpu in placement.gpus_of(device) {
                    proptest::prop_assert!(s.begin >= free[gpu as usize]);
                    free[gpu as usize] = s.end;
                }
            }
        }
    }
}
