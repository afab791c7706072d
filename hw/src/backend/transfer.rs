//! The handoff between two backends, one per GPU (or two pools of one GPU): a request's KV
//! blocks and SWA ring leave the source backend's pool for a region of the destination's,
//! through a [`PeerLink`] from the source's context to the destination's.

use cudarc::driver::DevicePtr;

use super::{BackendError, CudaBackend, HandoffCopy, Moves};
use crate::peer::{CopyRange, PeerLink, block_ranges, coalesce};

impl CudaBackend {
    /// Moves `request` from this backend into region `region` of `dst` over `link` (this
    /// backend's context to `dst`'s): blocks that later steps swapped out come back to this
    /// device first, `dst` makes room and gives the request a ring, then one timed batch of
    /// copies moves every block and the ring, and this backend forgets the request. Nothing
    /// moves for a request this backend does not hold (duration 0).
    pub fn transfer_to(
        &mut self,
        dst: &mut CudaBackend,
        link: &PeerLink,
        request: u64,
        region: u32,
    ) -> Result<HandoffCopy, BackendError> {
        let Some(st) = self.tiers.seqs.get(&request) else {
            return Ok(HandoffCopy::default());
        };
        let (src_region, valid_to) = (st.region, st.ring_valid_to);
        let tokens = st.blocks.len() * self.cfg.model.block_size;
        self.gpu.ctx.bind_to_thread()?;
        let (src_ids, _) = self.resident_ids(request, tokens, src_region)?;
        let src_ring = self.ring_of(request)?;
        dst.gpu.ctx.bind_to_thread()?;
        let (dst_ids, evicted_blocks) = dst.resident_ids(request, tokens, region)?;
        let dst_ring = dst.ring_of(request)?;
        if let Some(st) = dst.tiers.seqs.get_mut(&request) {
            st.ring_valid_to = valid_to;
        }
        let pairs: Vec<(u32, u32)> = src_ids.iter().copied().zip(dst_ids).collect();
        let bb = self.cfg.model.block_bytes();
        let ring_bytes = self.cfg.ring_slot_elems() * 2;
        let timing = {
            let (sp, _g) = self.pool.device_ptr(&self.gpu.stream);
            let (dp, _h) = dst.pool.device_ptr(&dst.gpu.stream);
            let (sr, _i) = self.rings.device_ptr(&self.gpu.stream);
            let (dr, _j) = dst.rings.device_ptr(&dst.gpu.stream);
            let mut ranges = block_ranges(&coalesce(&pairs), sp, dp, bb);
            ranges.push(CopyRange {
                src: sr + (src_ring as usize * ring_bytes) as u64,
                dst: dr + (dst_ring as usize * ring_bytes) as u64,
                bytes: ring_bytes,
            });
            // SAFETY: every id comes from the two backends' tiers, inside their pools; both
            // streams were synchronized above, and nothing else runs on either pool until the
            // copy has ended (`copy` waits for it).
            unsafe { link.copy(&ranges) }?
        };
        self.release(request);
        Ok(HandoffCopy {
            bytes: timing.bytes,
            evicted_blocks,
            duration_ns: timing.duration_ns.max(1),
        })
    }

    /// Every block of `request` in HBM of `region` (swapped back in where a later step moved
    /// it out, or placed there for the first time), with the device idle afterwards; returns
    /// the block ids and how many other blocks were swapped out to make room.
    fn resident_ids(
        &mut self,
        request: u64,
        tokens: usize,
        region: u32,
    ) -> Result<(Vec<u32>, u32), BackendError> {
        let mut moves = Moves::default();
        let ids = self
            .place(&[(request, tokens)], region, &mut moves)?
            .remove(0);
        self.issue_moves(&moves)?;
        self.gpu.stream.join(&self.copy)?;
        self.gpu.stream.synchronize()?;
        Ok((ids, moves.swap_out.len() as u32))
    }

    fn ring_of(&self, request: u64) -> Result<u32, BackendError> {
        self.tiers
            .seqs
            .get(&request)
            .and_then(|st| st.ring)
            .ok_or_else(|| BackendError::Plan(format!("request {request} has no SWA ring")))
    }
}
