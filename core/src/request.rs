//! A request: one prompt and its output, pointing into a shared [`ContentChain`].

use crate::content::{BlockKey, ContentChain};
use crate::ids::{RequestId, SessionId};
use crate::time::Nanos;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// Traffic class; the store's TTL is chosen per class (SPEC §7).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TrafficClass {
    Agent,
    Chat,
    Other,
}

impl TrafficClass {
    pub const ALL: [TrafficClass; 3] =
        [TrafficClass::Agent, TrafficClass::Chat, TrafficClass::Other];
    pub fn index(self) -> usize {
        self as usize
    }
    pub fn name(self) -> &'static str {
        match self {
            TrafficClass::Agent => "agent",
            TrafficClass::Chat => "chat",
            TrafficClass::Other => "other",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "agent" => Some(TrafficClass::Agent),
            "chat" => Some(TrafficClass::Chat),
            "other" | "document" | "doc" => Some(TrafficClass::Other),
            _ => None,
        }
    }
}

/// One request of a trace. The content chain covers at least `prompt_tokens + output_tokens`
/// tokens (for sessions it is the whole epoch, shared with the other turns).
#[derive(Clone, Debug)]
pub struct Request {
    pub id: RequestId,
    pub session: Option<SessionId>,
    pub class: TrafficClass,
    pub arrival: Nanos,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    pub content: Arc<ContentChain>,
}

impl Request {
    pub fn block_tokens(&self) -> u32 {
        self.content.block_tokens()
    }
    /// Keys of the prompt's full blocks: what prefix matching looks up.
    pub fn prompt_blocks(&self) -> &[BlockKey] {
        self.content.full_blocks(self.prompt_tokens)
    }
    /// Tokens after the last full block of the prompt.
    pub fn tail_tokens(&self) -> u32 {
        self.prompt_tokens % self.block_tokens()
    }
    /// Key of the partial last block of the prompt (None when the prompt is block-aligned).
    pub fn tail_key(&self) -> Option<BlockKey> {
        if self.tail_tokens() == 0 {
            None
        } else {
            self.content.key_at(self.prompt_tokens)
        }
    }
    pub fn context_tokens(&self) -> u32 {
        self.prompt_tokens + self.output_tokens
    }
    /// Full blocks of prompt + output that the prompt alone does not fill: what decode writes
    /// back to the store (SPEC §3.7).
    pub fn output_blocks(&self) -> &[BlockKey] {
        let all = self.content.full_blocks(self.context_tokens());
        &all[self.prompt_blocks().len().min(all.len())..]
    }
    /// The key of the prefix ending at `pos_tokens` (a block boundary or a segment end).
    pub fn key_at(&self, pos_tokens: u32) -> Option<BlockKey> {
        self.content.key_at(pos_tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::content::{ChainBuilder, SegmentId};

    #[test]
    fn prompt_and_output_views() {
        let mut b = ChainBuilder::new(128);
        b.push(SegmentId(1), 300).push(SegmentId(2), 100);
        let r = Request {
            id: RequestId(0),
            session: None,
            class: TrafficClass::Chat,
            arrival: Nanos::ZERO,
            prompt_tokens: 300,
            output_tokens: 100,
            content: Arc::new(b.finish()),
        };
        assert_eq!(r.prompt_blocks().len(), 2);
        assert_eq!(r.tail_tokens(), 44);
        assert!(r.tail_key().is_some());
        assert_eq!(r.output_blocks().len(), 1); // 400 tokens → 3 full blocks, 2 in the prompt
    }
}
