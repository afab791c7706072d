//! The perfect prefix cache: unlimited, never expires, token granularity (SPEC §4 variants).
//! It remembers every block key and every segment-end key it has seen.

use crate::content::{KeySet, Mark};
use crate::request::Request;

#[derive(Clone, Debug, Default)]
pub struct PerfectCache {
    seen: KeySet,
}

impl PerfectCache {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn len(&self) -> usize {
        self.seen.len()
    }
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }

    /// The longest prefix of `req`'s prompt seen before, in tokens.
    pub fn hit_tokens(&self, req: &Request) -> u32 {
        let bs = req.block_tokens();
        let blocks = req.prompt_blocks();
        let run = blocks.iter().take_while(|k| self.seen.contains(k)).count() as u32;
        let b = run * bs;
        // A seen segment end inside the next block extends the hit below block granularity.
        // (`b` is at most the prompt's length, which may sit just below 2^32.)
        let hi = b.saturating_add(bs - 1).min(req.prompt_tokens);
        let best = req
            .content
            .marks_between(b, hi)
            .iter()
            .rev()
            .find(|m: &&Mark| self.seen.contains(&m.key))
            .map(|m| m.pos_tokens);
        best.unwrap_or(b)
    }

    /// Records the prompt (every block and segment end inside it).
    pub fn record_prompt(&mut self, req: &Request) {
        self.record_upto(req, 0, req.prompt_tokens);
    }

    /// Records the output written back at the end of decode.
    pub fn record_output(&mut self, req: &Request) {
        self.record_upto(req, req.prompt_tokens, req.context_tokens());
    }

    fn record_upto(&mut self, req: &Request, from: u32, to: u32) {
        let bs = req.block_tokens();
        let first = (from / bs) as usize;
        let all = req.content.full_blocks(to);
        self.seen
            .extend(all[first.min(all.len())..].iter().copied());
        self.seen
            .extend(req.content.marks_between(from, to).iter().map(|m| m.key));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::content::{ChainBuilder, SegmentId};
    use crate::ids::RequestId;
    use crate::request::TrafficClass;
    use crate::time::Nanos;
    use std::sync::Arc;

    #[test]
    fn token_granular_session_hit() {
        // Turn 1: system 1000 + user 60, output 250. Turn 2 adds user 70.
        let mut b = ChainBuilder::new(128);
        b.push(SegmentId(1), 1000)
            .push(SegmentId(2), 60)
            .push(SegmentId(3), 250)
            .push(SegmentId(4), 70);
        let chain = Arc::new(b.finish());
        let mk = |p, o| Request {
            id: RequestId(0),
            session: None,
            class: TrafficClass::Chat,
            arrival: Nanos::ZERO,
            prompt_tokens: p,
            output_tokens: o,
            content: chain.clone(),
        };
        let t1 = mk(1060, 250);
        let t2 = mk(1380, 0);
        let mut pc = PerfectCache::new();
        assert_eq!(pc.hit_tokens(&t1), 0);
        pc.record_prompt(&t1);
        assert_eq!(pc.hit_tokens(&t2), 1060);
        pc.record_output(&t1);
        assert_eq!(pc.hit_tokens(&t2), 1310);
    }
}
