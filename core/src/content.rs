//! Prompt content as a hash chain of block keys (SPEC §3.1).
//!
//! Content is described as a sequence of *segments* (a system prompt, a tool result, a reply, a
//! document, or one 512-token block of a Mooncake trace), each with an id and a length. Two
//! contexts that start with the same segments produce the same block keys, at any block size:
//! each full block's key hashes the pieces of segments it covers and the previous block's key.
//! A segment end that falls inside a block also gets a key (a [`Mark`]), which is what lets the
//! perfect cache hit at token granularity and lets the block-level replay key a partial tail.

use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

/// Key of a block of content, chained over every block before it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct BlockKey(pub u64);

/// Identity of a piece of content (same id ⇒ same tokens).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct SegmentId(pub u64);

/// A keyed position inside a chain: the whole prefix `[0, pos)` hashes to `key`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mark {
    pub pos_tokens: u32,
    pub key: BlockKey,
}

/// The finaliser of SplitMix64: a cheap bijective mixer with full avalanche.
#[inline]
pub const fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Combines two words into one hash (order matters).
#[inline]
pub const fn hash2(a: u64, b: u64) -> u64 {
    mix64(a ^ mix64(b.wrapping_add(0x9e37_79b9_7f4a_7c15)))
}

const ROOT: u64 = 0x5e17_e1ab_0000_0001;
const FP_INIT: u64 = 0x243f_6a88_85a3_08d3;

/// Keys are already uniformly mixed, so the map hashes them with one multiply instead of SipHash:
/// this is most of the replay's speed.
#[derive(Default, Clone, Copy)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    #[inline]
    fn write_u64(&mut self, v: u64) {
        self.0 = v.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

pub type KeyBuildHasher = BuildHasherDefault<KeyHasher>;
/// A map keyed by [`BlockKey`] with the fast hasher.
pub type KeyMap<V> = HashMap<BlockKey, V, KeyBuildHasher>;
/// A set of [`BlockKey`]s with the fast hasher.
pub type KeySet = HashSet<BlockKey, KeyBuildHasher>;

/// The content of one context (a session epoch, a document request), keyed at one block size.
///
/// Requests point into a shared chain with their prompt and output lengths, so the turns of a
/// 40-turn session share one key vector instead of copying a growing prefix 40 times.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContentChain {
    block_tokens: u32,
    /// Key of every full block, in order (shared, so that a serving unit holding a request
    /// reaches its keys in one load, without keeping the chain's other parts alive).
    blocks: Arc<[BlockKey]>,
    /// Every segment end, in increasing position (block-aligned ends repeat the block key).
    marks: Vec<Mark>,
    total_tokens: u32,
}

impl ContentChain {
    pub fn block_tokens(&self) -> u32 {
        self.block_tokens
    }
    pub fn total_tokens(&self) -> u32 {
        self.total_tokens
    }
    /// Keys of the full blocks inside the first `tokens` tokens.
    pub fn full_blocks(&self, tokens: u32) -> &[BlockKey] {
        let n = (tokens / self.block_tokens) as usize;
        &self.blocks[..n.min(self.blocks.len())]
    }
    /// Every full-block key, shared with the chain.
    pub fn shared_blocks(&self) -> Arc<[BlockKey]> {
        Arc::clone(&self.blocks)
    }
    pub fn marks(&self) -> &[Mark] {
        &self.marks
    }
    /// The key of the prefix `[0, pos)`, if `pos` is a block boundary or a segment end.
    pub fn key_at(&self, pos_tokens: u32) -> Option<BlockKey> {
        if pos_tokens == 0 {
            return None;
        }
        if pos_tokens.is_multiple_of(self.block_tokens) {
            return self
                .blocks
                .get((pos_tokens / self.block_tokens) as usize - 1)
                .copied();
        }
        self.marks
            .binary_search_by_key(&pos_tokens, |m| m.pos_tokens)
            .ok()
            .map(|i| self.marks[i].key)
    }
    /// Marks with `lo < pos <= hi`.
    pub fn marks_between(&self, lo: u32, hi: u32) -> &[Mark] {
        let start = self.marks.partition_point(|m| m.pos_tokens <= lo);
        let end = self.marks.partition_point(|m| m.pos_tokens <= hi);
        &self.marks[start..end.max(start)]
    }
}

/// The most full blocks one chain holds: 2^24 keys, 128 MiB (a 2-billion-token context at
/// 128-token blocks). Beyond it [`ChainBuilder::try_push`] refuses, so no length read from a
/// trace or drawn by a generator can take the machine's memory through one chain.
pub const MAX_CHAIN_BLOCKS: u64 = 1 << 24;

/// A segment that would make its chain too long (see [`ChainBuilder::try_push`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "a context of {have} + {add} tokens is longer than a chain holds (2^32 - 1 tokens, and \
     2^24 blocks of {block_tokens} tokens)"
)]
pub struct ChainOverflow {
    /// Tokens already in the chain.
    pub have: u32,
    /// Tokens of the refused segment.
    pub add: u32,
    pub block_tokens: u32,
}

/// Builds a [`ContentChain`] segment by segment; cost is O(tokens / block) per segment.
#[derive(Clone, Debug)]
pub struct ChainBuilder {
    /// The chain so far, its keys aside (they move into the chain at [`Self::finish`]).
    chain: ContentChain,
    blocks: Vec<BlockKey>,
    prev: u64,
    fp: u64,
    fill: u32,
}

impl ChainBuilder {
    /// `block_tokens` must be positive (configs are validated before any chain is built).
    pub fn new(block_tokens: u32) -> Self {
        assert!(block_tokens > 0, "block_tokens must be positive");
        Self {
            blocks: Vec::new(),
            chain: ContentChain {
                block_tokens,
                blocks: Arc::from([]),
                marks: Vec::new(),
                total_tokens: 0,
            },
            prev: ROOT,
            fp: FP_INIT,
            fill: 0,
        }
    }

    pub fn total_tokens(&self) -> u32 {
        self.chain.total_tokens
    }

    /// Appends `tokens` tokens of segment `id` (a zero-length segment is ignored).
    ///
    /// # Panics
    /// If the chain would pass 2^32 − 1 tokens or [`MAX_CHAIN_BLOCKS`] blocks. Lengths that come
    /// from input go through [`Self::try_push`], which returns the error instead.
    pub fn push(&mut self, id: SegmentId, tokens: u32) -> &mut Self {
        if let Err(e) = self.try_push(id, tokens) {
            panic!("{e}");
        }
        self
    }

    /// Appends `tokens` tokens of segment `id`, or refuses (changing nothing) when the chain
    /// would pass 2^32 − 1 tokens (the lengths would wrap) or [`MAX_CHAIN_BLOCKS`] blocks (its
    /// keys would take more than 128 MiB).
    pub fn try_push(&mut self, id: SegmentId, tokens: u32) -> Result<&mut Self, ChainOverflow> {
        let overflow = ChainOverflow {
            have: self.chain.total_tokens,
            add: tokens,
            block_tokens: self.chain.block_tokens,
        };
        let total = self
            .chain
            .total_tokens
            .checked_add(tokens)
            .ok_or(overflow)?;
        if u64::from(total / self.chain.block_tokens) > MAX_CHAIN_BLOCKS {
            return Err(overflow);
        }
        self.push_unchecked(id, tokens);
        Ok(self)
    }

    fn push_unchecked(&mut self, id: SegmentId, tokens: u32) {
        let b = self.chain.block_tokens;
        let mut offset = 0u32;
        while offset < tokens {
            let n = (tokens - offset).min(b - self.fill);
            // A piece is (segment, offset inside it, length): canonical for identical content.
            self.fp = hash2(
                self.fp,
                hash2(id.0, (u64::from(offset) << 32) | u64::from(n)),
            );
            self.fill += n;
            offset += n;
            if self.fill == b {
                let key = BlockKey(hash2(self.prev, hash2(self.fp, u64::from(b))));
                self.blocks.push(key);
                self.prev = key.0;
                self.fp = FP_INIT;
                self.fill = 0;
            }
        }
        if tokens > 0 {
            self.chain.total_tokens += tokens;
            let key = if self.fill == 0 {
                BlockKey(self.prev)
            } else {
                BlockKey(hash2(self.prev, hash2(self.fp, u64::from(self.fill))))
            };
            self.chain.marks.push(Mark {
                pos_tokens: self.chain.total_tokens,
                key,
            });
        }
    }

    pub fn finish(self) -> ContentChain {
        ContentChain {
            blocks: Arc::from(self.blocks),
            ..self.chain
        }
    }
}

/// Asks the CPU to start loading the cache line at `p` (a hint: it never faults and changes
/// nothing but timing).
#[inline]
pub fn prefetch_read<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE is part of the x86_64 baseline, and a prefetch never dereferences its
    // address architecturally: it cannot fault and only warms the cache.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn chain(bs: u32, segs: &[(u64, u32)]) -> ContentChain {
        let mut b = ChainBuilder::new(bs);
        for &(id, n) in segs {
            b.push(SegmentId(id), n);
        }
        b.finish()
    }

    #[test]
    fn shared_prefix_shares_keys() {
        let a = chain(128, &[(1, 300), (2, 100)]);
        let b = chain(128, &[(1, 300), (3, 500)]);
        assert_eq!(a.full_blocks(400).len(), 3);
        // Blocks 0 and 1 lie inside segment 1: equal. Block 2 mixes segment 1 with 2 or 3.
        assert_eq!(a.full_blocks(400)[..2], b.full_blocks(800)[..2]);
        assert_ne!(a.full_blocks(400)[2], b.full_blocks(800)[2]);
        // The segment end at 300 is a mark in both.
        assert_eq!(a.key_at(300), b.key_at(300));
        assert!(a.key_at(300).is_some());
        assert_eq!(a.key_at(299), None);
    }

    #[test]
    fn block_aligned_mark_is_the_block_key() {
        let a = chain(128, &[(1, 256), (2, 10)]);
        assert_eq!(a.key_at(256), Some(a.full_blocks(256)[1]));
        assert_eq!(a.marks()[0].key, a.full_blocks(256)[1]);
    }

    #[test]
    fn splitting_a_segment_changes_nothing_but_marks() {
        // Segment identity includes offsets, so (7, 0..100)+(7,100..) is not the same as one
        // segment: ids must denote immutable content. Different ids always differ.
        let a = chain(128, &[(7, 256)]);
        let b = chain(128, &[(8, 256)]);
        assert_ne!(a.full_blocks(256), b.full_blocks(256));
    }

    /// A context past 2^32 tokens used to wrap to a short prompt; now it is refused and the
    /// chain is left as it was.
    #[test]
    fn overflow_is_refused_not_wrapped() {
        let mut b = ChainBuilder::new(1 << 20);
        b.try_push(SegmentId(1), u32::MAX - 10).unwrap();
        let e = b.try_push(SegmentId(2), 300).unwrap_err();
        assert_eq!((e.have, e.add), (u32::MAX - 10, 300));
        assert_eq!(b.total_tokens(), u32::MAX - 10);
        assert!(e.to_string().contains("longer than a chain holds"), "{e}");
        // One block past the cap is refused before any key is made.
        let mut b = ChainBuilder::new(16);
        assert!(b.try_push(SegmentId(1), (16 << 24) + 16).is_err());
        assert_eq!(b.total_tokens(), 0);
    }

    #[test]
    #[should_panic(expected = "longer than a chain holds")]
    fn push_panics_with_the_reason_on_overflow() {
        let mut b = ChainBuilder::new(1 << 20);
        b.push(SegmentId(1), u32::MAX).push(SegmentId(2), 1);
    }

    proptest! {
        #[test]
        fn prefix_property(segs in proptest::collection::vec((0u64..5, 1u32..400), 1..12),
                           cut in 0usize..12, bs in prop_oneof![Just(16u32), Just(128), Just(512)]) {
            let cut = cut.min(segs.len());
            let full = chain(bs, &segs);
            let pre = chain(bs, &segs[..cut]);
            let n = pre.full_blocks(pre.total_tokens()).len();
            prop_assert_eq!(pre.full_blocks(pre.total_tokens()), &full.full_blocks(full.total_tokens())[..n]);
            prop_assert_eq!(pre.marks(), &full.marks()[..pre.marks().len()]);
            prop_assert_eq!(full.full_blocks(full.total_tokens()).len() as u32, full.total_tokens() / bs);
        }
    }
}
