//! The unit's devices on several backends, one per physical GPU of a placement: the GPU
//! environment's device ([`UnitDevice`]) for a deployment over N GPUs.
//!
//! Each device of the unit (prefill engine, decode group) runs on the backend of its first
//! logical GPU; the devices that share a backend split its pool into regions as on one GPU
//! (`BackendConfig::unit_devices`, numbered locally), and a plan's engine id is renumbered to
//! the backend's own before it runs. A handoff between devices of one backend is its region
//! copy; between backends it is [`CudaBackend::transfer_to`] over a [`PeerLink`] (a peer copy
//! between GPUs). A decode plan that names a request held by another backend (the group picked
//! on arrival differed from the handoff's) moves it first.
//!
//! A decode group spanning several GPUs runs its step, all ranks, on its first GPU's backend:
//! splitting the forward pass over the group's GPUs with the NCCL dispatch of [`crate::ep`]
//! inside every MoE layer is not written yet.

use std::collections::BTreeMap;

use servelab_core::EngineId;
use servelab_core::engine::{StepPlan, StepReport};
use servelab_core::unit::DeviceId;

use crate::backend::{BackendError, CudaBackend, HandoffCopy};
use crate::clock::{HandoffJob, UnitDevice};
use crate::peer::PeerLink;
use crate::placement::PlacementConfig;

/// Which backend runs each device, and its number there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceMap {
    /// (backend, local engine) of each prefill engine.
    pub prefill: Vec<(usize, u32)>,
    /// (backend, local group) of each decode group.
    pub decode: Vec<(usize, u32)>,
    /// (prefill engines, decode groups) on each backend: its `unit_devices`.
    pub local: Vec<(u32, u32)>,
}

impl DeviceMap {
    /// The map of `placement` when logical GPU g runs on backend `backend_of_gpu[g]`.
    pub fn new(placement: &PlacementConfig, backend_of_gpu: &[usize]) -> Result<Self, String> {
        let backends = backend_of_gpu.iter().max().map_or(0, |&b| b + 1);
        let mut local = vec![(0u32, 0u32); backends];
        let mut at = |gpus: &[u32], decode: bool| -> Result<(usize, u32), String> {
            let g = *gpus.first().ok_or("a device with no GPU")?;
            let b = *backend_of_gpu
                .get(g as usize)
                .ok_or_else(|| format!("logical GPU {g} has no backend"))?;
            let slot = if decode {
                &mut local[b].1
            } else {
                &mut local[b].0
            };
            *slot += 1;
            Ok((b, *slot - 1))
        };
        let prefill = placement
            .prefill
            .iter()
            .map(|g| at(g, false))
            .collect::<Result<_, _>>()?;
        let decode = placement
            .decode
            .iter()
            .map(|g| at(g, true))
            .collect::<Result<_, _>>()?;
        Ok(DeviceMap {
            prefill,
            decode,
            local,
        })
    }

    /// One backend per physical ordinal the placement uses, in ascending ordinal order:
    /// (the map, the ordinal of each backend).
    pub fn by_ordinal(placement: &PlacementConfig) -> Result<(Self, Vec<u32>), String> {
        let ordinals = placement.physical_ordinals();
        let backend_of_gpu: Vec<usize> = (0..placement.gpus)
            .map(|g| {
                let o = placement.ordinal(g);
                ordinals.iter().position(|&x| x == o).unwrap_or(0)
            })
            .collect();
        Ok((Self::new(placement, &backend_of_gpu)?, ordinals))
    }

    /// (backend, local id) of a device.
    pub fn of(&self, device: DeviceId) -> Option<(usize, u32)> {
        match device {
            DeviceId::Prefill(e) => self.prefill.get(e as usize).copied(),
            DeviceId::Decode(g) => self.decode.get(g as usize).copied(),
        }
    }
}

/// The unit's devices over several backends. See the module docs.
pub struct MultiGpuDevice {
    map: DeviceMap,
    backends: Vec<CudaBackend>,
    links: BTreeMap<(usize, usize), PeerLink>,
    /// The backend holding each request's KV.
    holder: BTreeMap<u32, usize>,
    /// Cross-backend moves a decode plan needed before it ran (not part of any step's time).
    pub moves_before_steps: Vec<HandoffCopy>,
}

impl MultiGpuDevice {
    /// `backends[b]` must have been built with `unit_devices = Some(map.local[b])`.
    pub fn new(map: DeviceMap, backends: Vec<CudaBackend>) -> Result<Self, String> {
        if backends.len() != map.local.len() {
            return Err(format!(
                "{} backends for a map of {}",
                backends.len(),
                map.local.len()
            ));
        }
        if let Some(b) =
            (0..backends.len()).find(|&b| backends[b].config().unit_devices != Some(map.local[b]))
        {
            return Err(format!(
                "backend {b} has unit devices {:?}, the map gives it {:?}",
                backends[b].config().unit_devices,
                map.local[b]
            ));
        }
        Ok(MultiGpuDevice {
            map,
            backends,
            links: BTreeMap::new(),
            holder: BTreeMap::new(),
            moves_before_steps: Vec::new(),
        })
    }

    pub fn backends(&self) -> &[CudaBackend] {
        &self.backends
    }

    /// Forgets every request on every backend (after a throwaway run).
    pub fn reset(&mut self) {
        self.backends.iter_mut().for_each(CudaBackend::reset);
        self.holder.clear();
        self.moves_before_steps.clear();
    }

    /// Moves `request` from backend `from` into local decode group `group` of backend `to`.
    fn transfer(
        &mut self,
        from: usize,
        to: usize,
        request: u32,
        group: u32,
    ) -> Result<HandoffCopy, BackendError> {
        if !self.links.contains_key(&(from, to)) {
            let (a, b) = (&self.backends[from].gpu().ctx, &self.backends[to].gpu().ctx);
            self.links.insert((from, to), PeerLink::new(a, b)?);
        }
        let link = &self.links[&(from, to)];
        let region = self.map.local[to].0 + group;
        let (src, dst) = pair_mut(&mut self.backends, from, to);
        let copy = src.transfer_to(dst, link, u64::from(request), region)?;
        self.holder.insert(request, to);
        Ok(copy)
    }

    /// Brings every request of a decode plan for backend `k`'s local group to `k`.
    fn gather_plan(&mut self, plan: &StepPlan, k: usize, group: u32) -> Result<(), BackendError> {
        let StepPlan::Decode(d) = plan else {
            return Ok(());
        };
        for s in &d.seqs {
            let r = s.request.0 as u32;
            if let Some(&h) = self.holder.get(&r)
                && h != k
            {
                let copy = self.transfer(h, k, r, group)?;
                self.moves_before_steps.push(copy);
            }
        }
        Ok(())
    }
}

/// Two distinct elements of a slice, both mutable.
fn pair_mut<T>(v: &mut [T], a: usize, b: usize) -> (&mut T, &mut T) {
    assert_ne!(a, b, "a transfer needs two backends");
    if a < b {
        let (x, y) = v.split_at_mut(b);
        (&mut x[a], &mut y[0])
    } else {
        let (x, y) = v.split_at_mut(a);
        (&mut y[0], &mut x[b])
    }
}

/// A copy of `plan` numbered for its backend (engine or group `local`).
fn renumbered(plan: &StepPlan, local: u32) -> StepPlan {
    let mut p = plan.clone();
    match &mut p {
        StepPlan::Prefill(x) => x.engine = EngineId(local),
        StepPlan::Decode(x) => x.engine = EngineId(local),
    }
    p
}

fn device_of(plan: &StepPlan) -> DeviceId {
    match plan {
        StepPlan::Prefill(p) => DeviceId::Prefill(p.engine.0),
        StepPlan::Decode(d) => DeviceId::Decode(d.engine.0),
    }
}

impl UnitDevice for MultiGpuDevice {
    fn step(&mut self, plan: &StepPlan, report: &mut StepReport) -> Result<(), String> {
        let device = device_of(plan);
        let (k, local) = self
            .map
            .of(device)
            .ok_or_else(|| format!("{device:?} is not in the placement"))?;
        self.gather_plan(plan, k, local)
            .map_err(|e| e.to_string())?;
        let b = &mut self.backends[k];
        b.gpu().ctx.bind_to_thread().map_err(|e| e.to_string())?;
        b.try_execute(&renumbered(plan, local), report)
            .map_err(|e| e.to_string())?;
        if let StepPlan::Prefill(p) = plan {
            for c in &p.chunks {
                self.holder.insert(c.request.0 as u32, k);
            }
        }
        Ok(())
    }

    fn handoff(&mut self, job: &HandoffJob) -> Result<HandoffCopy, String> {
        let at = |d| {
            self.map
                .of(d)
                .ok_or_else(|| format!("{d:?} is not in the placement"))
        };
        let (to, group) = at(DeviceId::Decode(job.to_group))?;
        let from = match self.holder.get(&job.request) {
            Some(&h) => h,
            None => at(DeviceId::Prefill(job.from_engine))?.0,
        };
        let copy = if from == to {
            let b = &mut self.backends[to];
            b.gpu().ctx.bind_to_thread().map_err(|e| e.to_string())?;
            b.handoff(u64::from(job.request), group)
        } else {
            self.transfer(from, to, job.request, group)
        };
        copy.map_err(|e| e.to_string())
    }

    fn release(&mut self, request: u32) {
        match self.holder.remove(&request) {
            Some(k) => self.backends[k].release(u64::from(request)),
            None => self
                .backends
                .iter_mut()
                .for_each(|b| b.release(u64::from(request))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn device_maps_number_devices_per_backend() {
        // Two prefill engines on GPUs 0 and 1, two 2-rank groups on 2-3 and 4-5.
        let p = PlacementConfig::disaggregated(2, 2, 2, |g| g / 2);
        let (m, ordinals) = DeviceMap::by_ordinal(&p).unwrap();
        assert_eq!(ordinals, vec![0, 1, 2]);
        assert_eq!(m.prefill, vec![(0, 0), (0, 1)]);
        assert_eq!(m.decode, vec![(1, 0), (2, 0)]);
        assert_eq!(m.local, vec![(2, 0), (0, 1), (0, 1)]);
        assert_eq!(m.of(DeviceId::Decode(1)), Some((2, 0)));
        assert_eq!(m.of(DeviceId::Decode(2)), None);
        // Everything on ordinal 0: one backend holding every device, as on one GPU.
        let one = PlacementConfig::disaggregated(2, 2, 1, |_| 0);
        let (m, ordinals) = DeviceMap::by_ordinal(&one).unwrap();
        assert_eq!((ordinals, m.local), (vec![0], vec![(2, 2)]));
        assert!(DeviceMap::new(&one, &[0, 0]).is_err());
        let mut v = [1, 2, 3];
        let (a, b) = pair_mut(&mut v, 2, 0);
        std::mem::swap(a, b);
        assert_eq!(v, [3, 2, 1]);
    }

    /// Two backends on GPU 0 stand for two GPUs: a request prefilled on the first and handed
    /// off to a decode group on the second decodes to the same logits as on one shared pool,
    /// and the transfer moves every block and the ring.
    #[test]
    fn gpu_handoff_between_backends_keeps_the_decode_exact() {
        use crate::backend::tests::{handoff_decode, handoff_prefill, max_abs_diff};
        let Some(gpu) = servelab_kernels::gpu::gpu_or_skip() else {
            return;
        };
        let gpu = Arc::new(gpu);
        let base = crate::backend::BackendConfig {
            hbm_blocks: 24,
            ring_slots: 2,
            ..crate::backend::tests::tiny()
        };
        let m = base.model.clone();
        let prefill = handoff_prefill(&m);
        let decode = handoff_decode(0);
        let mut shared = CudaBackend::new(gpu.clone(), base.clone()).unwrap();
        shared.keep_logits = true;
        let mut rep = StepReport::default();
        shared.try_execute(&prefill, &mut rep).unwrap();
        shared.try_execute(&decode, &mut rep).unwrap();
        let placement = PlacementConfig::disaggregated(1, 1, 1, |_| 0);
        let map = DeviceMap::new(&placement, &[0, 1]).unwrap();
        let backends = map
            .local
            .iter()
            .map(|&l| {
                let cfg = crate::backend::BackendConfig {
                    unit_devices: Some(l),
                    ..base.clone()
                };
                CudaBackend::new(gpu.clone(), cfg).unwrap()
            })
            .collect();
        let mut dev = MultiGpuDevice::new(map, backends).unwrap();
        dev.backends[1].keep_logits = true;
        dev.step(&prefill, &mut rep).unwrap();
        let job = HandoffJob {
            request: 5,
            from_engine: 0,
            to_group: 0,
            bytes: 0,
        };
        let copy = dev.handoff(&job).unwrap();
        let ring = base.ring_slot_elems() * 2;
        assert_eq!(copy.bytes as usize, 3 * m.block_bytes() + ring);
        assert!(copy.duration_ns > 0);
        assert!(!dev.backends[0].tiers.seqs.contains_key(&5));
        println!(
            "transfer between backends: {} B in {:.1} us ({:.1} GB/s)",
            copy.bytes,
            copy.duration_ns as f64 / 1e3,
            copy.bytes as f64 / copy.duration_ns as f64
        );
        dev.step(&decode, &mut rep).unwrap();
        assert!(dev.moves_before_steps.is_empty());
        let max = max_abs_diff(&shared.last_logits, &dev.backends[1].last_logits);
        assert!(max <= 1e-3, "max diff {max}");
        dev.release(5);
        assert!(!dev.backends[1].tiers.seqs.contains_key(&5));
    }
}
