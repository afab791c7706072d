//! Hit rules (SPEC §4) and the alternatives servelab compares them against (PEERS.md).
//!
//! A rule sees the prompt length, the cached prefix of full blocks found in the store, the
//! perfect-cache prefix (every previously seen token), and a question it may ask: "is SWA state
//! for this prefix stored at position p?". It returns how many tokens hit and how many go
//! through the encoder and decoder. Invariant for every rule: `hit + encoder_tokens == prompt`.

use crate::consts::ServingConstants;
use serde::{Deserialize, Serialize};
use std::fmt;

/// Which rule decides a hit. Chosen in configs as e.g. `hit_policy = "deepinfer"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HitPolicy {
    /// SPEC §4 as written: cap at L − 134, back off one block without SWA state, 140-token
    /// decoder replay.
    #[serde(alias = "deepinfer-rules")]
    Deepinfer,
    /// Every previously seen prefix token hits, token granularity, no cap; bounded decoder replay.
    PerfectCache,
    /// A 40-layer decoder-only model with a perfect prefix cache (the suffix runs all layers).
    OrdinaryModel,
    /// This model with a perfect cache and the exact 2,560-token decoder rebuild.
    ExactRebuild,
    /// V4's choice: SWA state stored in the block store (no 3-minute host cache), same rules.
    SwaOnSsd,
    /// vLLM PR #56227: after a block-aligned hit H ≤ L − 1, recompute [H − W, H); hits ≤ W unused.
    VllmEncoderReplay,
    /// vLLM v1 prefix caching on an ordinary decoder-only model: block-aligned, at most L − 1.
    VllmPrefix,
    /// SGLang's exact SWA recompute: rebuild the window exactly from the last R prefix tokens,
    /// R = align_up(align_up(W, B) + (N − 1)·W, B); used only when the match is at least 2R.
    SglangExactSwa,
}

impl HitPolicy {
    pub const ALL: [HitPolicy; 8] = [
        HitPolicy::Deepinfer,
        HitPolicy::PerfectCache,
        HitPolicy::OrdinaryModel,
        HitPolicy::ExactRebuild,
        HitPolicy::SwaOnSsd,
        HitPolicy::VllmEncoderReplay,
        HitPolicy::VllmPrefix,
        HitPolicy::SglangExactSwa,
    ];

    pub fn name(self) -> &'static str {
        match self {
            HitPolicy::Deepinfer => "deepinfer",
            HitPolicy::PerfectCache => "perfect-cache",
            HitPolicy::OrdinaryModel => "ordinary-model",
            HitPolicy::ExactRebuild => "exact-rebuild",
            HitPolicy::SwaOnSsd => "swa-on-ssd",
            HitPolicy::VllmEncoderReplay => "vllm-encoder-replay",
            HitPolicy::VllmPrefix => "vllm-prefix",
            HitPolicy::SglangExactSwa => "sglang-exact-swa",
        }
    }

    pub fn parse(s: &str) -> Option<HitPolicy> {
        let s = s.trim().to_ascii_lowercase().replace('_', "-");
        let s = if s == "deepinfer-rules" {
            "deepinfer".to_string()
        } else {
            s
        };
        HitPolicy::ALL.into_iter().find(|p| p.name() == s)
    }

    /// Rules that read the perfect cache instead of the capacity- and TTL-bound store.
    pub fn uses_perfect_cache(self) -> bool {
        matches!(
            self,
            HitPolicy::PerfectCache | HitPolicy::OrdinaryModel | HitPolicy::ExactRebuild
        )
    }

    /// Where this rule looks for SWA state.
    pub fn swa_source(self) -> SwaSource {
        match self {
            HitPolicy::Deepinfer => SwaSource::HostCache,
            HitPolicy::SwaOnSsd => SwaSource::BlockStore,
            _ => SwaSource::NotNeeded,
        }
    }

    /// Decides one prompt. `swa_at(p)` answers whether SWA state for the prompt's prefix
    /// `[0, p)` is stored; rules that do not need SWA state never call it.
    pub fn decide(
        self,
        c: &ServingConstants,
        input: HitInputs,
        swa_at: impl FnMut(u32) -> bool,
    ) -> HitDecision {
        let p = PromptView::new(c, &input);
        let (l, perfect, replay) = (p.prompt, p.perfect, p.replay);
        match self {
            HitPolicy::Deepinfer | HitPolicy::SwaOnSsd => deepinfer_rule(c, &p, swa_at),
            HitPolicy::PerfectCache => {
                HitDecision::computed(l, perfect, 0, replay, HitReason::PerfectCache)
            }
            HitPolicy::OrdinaryModel => {
                let mut d =
                    HitDecision::computed(l, perfect, 0, l - perfect, HitReason::PerfectCache);
                d.decoder_only = true;
                d
            }
            HitPolicy::ExactRebuild => HitDecision::computed(
                l,
                perfect,
                0,
                l.min(c.exact_rebuild_tokens),
                HitReason::PerfectCache,
            ),
            HitPolicy::VllmEncoderReplay => vllm_encoder_replay_rule(c, &p),
            HitPolicy::VllmPrefix => vllm_prefix_rule(&p),
            HitPolicy::SglangExactSwa => sglang_exact_swa_rule(c, &p),
        }
    }
}

/// What the rules read of one prompt.
struct PromptView {
    /// Prompt length L.
    prompt: u32,
    block: u32,
    /// The cached prefix, in whole blocks.
    cached: u32,
    /// The perfect-cache prefix, at most L.
    perfect: u32,
    /// The bounded decoder replay, at most L.
    replay: u32,
    /// vLLM caps a hit at L − 1, block-aligned, so at least one token is computed.
    vllm_cap: u32,
}

impl PromptView {
    fn new(c: &ServingConstants, input: &HitInputs) -> Self {
        let l = input.prompt_tokens;
        let bs = c.block_tokens;
        Self {
            prompt: l,
            block: bs,
            cached: (input.cached_block_tokens / bs) * bs,
            perfect: input.perfect_hit_tokens.min(l),
            replay: l.min(c.decoder_replay_tokens),
            vllm_cap: (l.saturating_sub(1) / bs) * bs,
        }
    }
}

/// SPEC §4: the cached prefix capped at L − margin; without SWA state at the cap, back off
/// one block (or hit nothing when only one block is left).
fn deepinfer_rule(
    c: &ServingConstants,
    p: &PromptView,
    mut swa_at: impl FnMut(u32) -> bool,
) -> HitDecision {
    let (l, bs, b, replay) = (p.prompt, p.block, p.cached, p.replay);
    let margin = c.hit_margin_tokens();
    let cap = (l.saturating_sub(margin) / bs) * bs;
    let h0 = b.min(cap);
    if h0 == 0 {
        let reason = if b == 0 {
            HitReason::NoCachedBlocks
        } else {
            HitReason::CappedToNothing
        };
        return HitDecision::computed(l, 0, 0, replay, reason);
    }
    let capped = h0 < b;
    if swa_at(h0) {
        let reason = if capped {
            HitReason::CappedWithSwaState
        } else {
            HitReason::SwaStateAtPrefixEnd
        };
        let mut d = HitDecision::computed(l, h0, 0, replay, reason);
        d.swa_state_at = Some(h0);
        d
    } else if h0 <= bs {
        HitDecision::computed(l, 0, 0, replay, HitReason::NoSwaStateSingleBlock)
    } else {
        // Back off one block: its KV is reused, its tokens recomputed with attention
        // truncated at h0 − B (encoder-side bounded replay).
        HitDecision::computed(l, h0 - bs, bs, replay, HitReason::NoSwaStateBackedOff)
    }
}

/// vLLM PR #56227: a block-aligned hit H ≤ L − 1 recomputes its last window [H − W, H).
fn vllm_encoder_replay_rule(c: &ServingConstants, p: &PromptView) -> HitDecision {
    let (l, replay) = (p.prompt, p.replay);
    let h = p.cached.min(p.vllm_cap);
    let w = c.window_tokens;
    if h == 0 {
        HitDecision::computed(l, 0, 0, replay, HitReason::NoCachedBlocks)
    } else if h <= w {
        HitDecision::computed(l, 0, 0, replay, HitReason::TooShortForReplay)
    } else {
        HitDecision::computed(l, h - w, w, replay, HitReason::ReplayedWindow)
    }
}

/// vLLM v1 prefix caching on a decoder-only model: the block-aligned hit, the rest through
/// every layer.
fn vllm_prefix_rule(p: &PromptView) -> HitDecision {
    let l = p.prompt;
    let h = p.cached.min(p.vllm_cap);
    let reason = if h == 0 {
        HitReason::NoCachedBlocks
    } else {
        HitReason::BlockAlignedPrefix
    };
    let mut d = HitDecision::computed(l, h, 0, l - h, reason);
    d.decoder_only = true;
    d
}

/// SGLang's exact SWA recompute: the last R tokens of a match of at least 2R rebuilt exactly.
fn sglang_exact_swa_rule(c: &ServingConstants, p: &PromptView) -> HitDecision {
    let l = p.prompt;
    let r = sglang_exact_swa_tokens(c);
    let h = p.cached.min(p.vllm_cap);
    let rebuild = l.min(c.exact_rebuild_tokens);
    if h == 0 {
        HitDecision::computed(l, 0, 0, rebuild, HitReason::NoCachedBlocks)
    } else if h < 2 * r {
        HitDecision::computed(l, 0, 0, rebuild, HitReason::BelowExactSwaThreshold)
    } else {
        HitDecision::computed(l, h - r, r, rebuild, HitReason::ExactSwaRecompute)
    }
}

/// SGLang's exact SWA recompute length for the decoder stack: align_up(align_up(W, B) + (N − 1)·W, B).
pub fn sglang_exact_swa_tokens(c: &ServingConstants) -> u32 {
    let align_up = |x: u32, a: u32| x.div_ceil(a) * a;
    align_up(
        align_up(c.window_tokens, c.block_tokens)
            + c.decoder_layers.saturating_sub(1) * c.window_tokens,
        c.block_tokens,
    )
}

/// Where a rule looks for SWA state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SwaSource {
    /// The per-machine host-memory SWA cache with its directory (SPEC §5).
    HostCache,
    /// SWA state stored as objects in the KV store, with the store's TTL.
    BlockStore,
    NotNeeded,
}

/// What a rule sees about one prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HitInputs {
    /// L.
    pub prompt_tokens: u32,
    /// b: tokens of the longest prefix of full blocks present in the store.
    pub cached_block_tokens: u32,
    /// The longest previously seen prefix, at token granularity (perfect cache).
    pub perfect_hit_tokens: u32,
}

/// Why a rule decided what it did; `describe` gives the sentence `servelab hit` prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HitReason {
    NoCachedBlocks,
    CappedToNothing,
    SwaStateAtPrefixEnd,
    CappedWithSwaState,
    NoSwaStateSingleBlock,
    NoSwaStateBackedOff,
    PerfectCache,
    TooShortForReplay,
    ReplayedWindow,
    BlockAlignedPrefix,
    BelowExactSwaThreshold,
    ExactSwaRecompute,
}

impl HitReason {
    pub fn describe(self) -> &'static str {
        match self {
            HitReason::NoCachedBlocks => "no full block of the prompt is cached",
            HitReason::CappedToNothing => {
                "the cached prefix is cut to nothing by the cap floor((L - 134) / 128) * 128"
            }
            HitReason::SwaStateAtPrefixEnd => {
                "SWA state is stored at the end of the cached prefix: the whole prefix hits"
            }
            HitReason::CappedWithSwaState => {
                "the cached prefix was capped at L - 134 (block-aligned) and SWA state is stored there"
            }
            HitReason::NoSwaStateSingleBlock => {
                "no SWA state at the hit position and the hit is one block or less: no hit"
            }
            HitReason::NoSwaStateBackedOff => {
                "no SWA state at the hit position: backed off one block and replay it in the encoder"
            }
            HitReason::PerfectCache => "perfect cache: every previously seen prefix token hits",
            HitReason::TooShortForReplay => "vLLM replay: hits of one window or less are not used",
            HitReason::ReplayedWindow => "vLLM replay: the last window of the hit is recomputed",
            HitReason::BlockAlignedPrefix => "block-aligned cached prefix, at most L - 1",
            HitReason::BelowExactSwaThreshold => {
                "SGLang exact SWA: the match is shorter than twice the rebuild length: not used"
            }
            HitReason::ExactSwaRecompute => {
                "SGLang exact SWA: the last R prefix tokens are recomputed to rebuild the window exactly"
            }
        }
    }
}

impl fmt::Display for HitReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.describe())
    }
}

/// The outcome of a rule for one prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HitDecision {
    pub prompt_tokens: u32,
    /// Tokens whose KV is reused and not recomputed.
    pub hit_tokens: u32,
    /// Tokens through the encoder: `prompt − hit` (includes the replay).
    pub encoder_tokens: u32,
    /// Of `encoder_tokens`, those whose KV was cached but are recomputed to rebuild state.
    pub encoder_replay_tokens: u32,
    /// Tokens through the decoder layers (or, for decoder-only models, the suffix).
    pub decoder_tokens: u32,
    /// Position whose SWA state the hit uses (pulled from its machine).
    pub swa_state_at: Option<u32>,
    /// True for the ordinary decoder-only baselines: the suffix runs through every layer.
    pub decoder_only: bool,
    pub reason: HitReason,
}

impl HitDecision {
    fn computed(prompt: u32, hit: u32, replay: u32, decoder: u32, reason: HitReason) -> Self {
        debug_assert!(hit <= prompt && replay <= prompt - hit);
        HitDecision {
            prompt_tokens: prompt,
            hit_tokens: hit,
            encoder_tokens: prompt - hit,
            encoder_replay_tokens: replay,
            decoder_tokens: decoder,
            swa_state_at: None,
            decoder_only: false,
            reason,
        }
    }

    /// KV read from the store: the hit plus the replayed block(s).
    pub fn reused_kv_tokens(&self) -> u32 {
        self.hit_tokens + self.encoder_replay_tokens
    }

    /// Tokens pushed through one transformer layer, summed over layers (SPEC §4 accounting).
    pub fn layer_tokens(&self, c: &ServingConstants) -> u64 {
        if self.decoder_only {
            u64::from(c.total_layers()) * u64::from(self.encoder_tokens)
        } else {
            u64::from(c.encoder_layers) * u64::from(self.encoder_tokens)
                + u64::from(c.decoder_layers) * u64::from(self.decoder_tokens)
        }
    }
}

/// The compute baseline of SPEC §4: the ordinary 40-layer model with no cache.
pub fn baseline_layer_tokens(c: &ServingConstants, prompt_tokens: u32) -> u64 {
    u64::from(c.total_layers()) * u64::from(prompt_tokens)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn c() -> ServingConstants {
        ServingConstants::default()
    }
    fn inp(l: u32, b: u32) -> HitInputs {
        HitInputs {
            prompt_tokens: l,
            cached_block_tokens: b,
            perfect_hit_tokens: b,
        }
    }

    // Golden scenarios, computed by hand from SPEC §4.
    #[test]
    fn golden_swa_state_at_prefix_end() {
        // L = 10,000, b = 9,728 (76 blocks). cap = floor(9,866/128)*128 = 9,856. h0 = 9,728.
        let d = HitPolicy::Deepinfer.decide(&c(), inp(10_000, 9_728), |p| p == 9_728);
        assert_eq!(d.hit_tokens, 9_728);
        assert_eq!(d.encoder_tokens, 272);
        assert_eq!(d.encoder_replay_tokens, 0);
        assert_eq!(d.decoder_tokens, 140);
        assert_eq!(d.reason, HitReason::SwaStateAtPrefixEnd);
        // 20 × 272 + 20 × 140 = 8,240 layer-tokens against 400,000.
        assert_eq!(d.layer_tokens(&c()), 8_240);
    }

    #[test]
    fn golden_cap_and_back_off() {
        // Chat turn: L = 1,000, whole prompt but the tail cached: b = 896.
        // cap = floor(866/128)*128 = 768; h0 = 768; SWA stored at 896 only → back off to 640.
        let d = HitPolicy::Deepinfer.decide(&c(), inp(1_000, 896), |p| p == 896);
        assert_eq!(d.hit_tokens, 640);
        assert_eq!(d.encoder_tokens, 360);
        assert_eq!(d.encoder_replay_tokens, 128);
        assert_eq!(d.reason, HitReason::NoSwaStateBackedOff);
    }

    #[test]
    fn golden_short_prompts() {
        // L = 262: cap = floor(128/128)*128 = 128, h0 = 128, no SWA → no hit.
        let d = HitPolicy::Deepinfer.decide(&c(), inp(262, 256), |_| false);
        assert_eq!(
            (d.hit_tokens, d.reason),
            (0, HitReason::NoSwaStateSingleBlock)
        );
        // Same with SWA state at 128: one block hits.
        let d = HitPolicy::Deepinfer.decide(&c(), inp(262, 256), |p| p == 128);
        assert_eq!(
            (d.hit_tokens, d.reason),
            (128, HitReason::CappedWithSwaState)
        );
        // L = 261: cap = 0.
        let d = HitPolicy::Deepinfer.decide(&c(), inp(261, 256), |_| true);
        assert_eq!((d.hit_tokens, d.reason), (0, HitReason::CappedToNothing));
        // L = 100: decoder replays the whole prompt.
        let d = HitPolicy::Deepinfer.decide(&c(), inp(100, 0), |_| true);
        assert_eq!((d.hit_tokens, d.decoder_tokens), (0, 100));
    }

    #[test]
    fn golden_baselines() {
        let i = HitInputs {
            prompt_tokens: 5_000,
            cached_block_tokens: 4_864,
            perfect_hit_tokens: 4_950,
        };
        let o = HitPolicy::OrdinaryModel.decide(&c(), i, |_| unreachable!());
        assert_eq!(o.layer_tokens(&c()), 40 * 50);
        let e = HitPolicy::ExactRebuild.decide(&c(), i, |_| unreachable!());
        assert_eq!(e.layer_tokens(&c()), 20 * 50 + 20 * 2_560);
        let v = HitPolicy::VllmEncoderReplay.decide(&c(), i, |_| unreachable!());
        assert_eq!((v.hit_tokens, v.encoder_replay_tokens), (4_864 - 128, 128));
        let p = HitPolicy::VllmPrefix.decide(&c(), inp(4_864, 4_864), |_| unreachable!());
        assert_eq!(p.hit_tokens, 4_736); // at most L − 1, block-aligned
        assert_eq!(sglang_exact_swa_tokens(&c()), 2_560);
        let s = HitPolicy::SglangExactSwa.decide(&c(), i, |_| unreachable!());
        assert_eq!(s.reason, HitReason::BelowExactSwaThreshold);
        assert_eq!(baseline_layer_tokens(&c(), 5_000), 200_000);
    }

    #[test]
    fn policy_names_round_trip() {
        for p in HitPolicy::ALL {
            assert_eq!(HitPolicy::parse(p.name()), Some(p));
        }
        assert_eq!(
            HitPolicy::parse("deepinfer-rules"),
            Some(HitPolicy::Deepinfer)
        );
        assert_eq!(HitPolicy::parse("nope"), None);
    }

    proptest! {
        #[test]
        fn invariants(l in 0u32..300_000, b_blocks in 0u32..3000, extra in 0u32..128,
                      swa_mask in any::<u64>(), bs in prop_oneof![Just(64u32), Just(128), Just(256)]) {
            let c = ServingConstants { block_tokens: bs, ..ServingConstants::default() };
            let b = (b_blocks * bs).min(l);
            let b = (b / bs) * bs;
            let perfect = (b + extra).min(l);
            let i = HitInputs { prompt_tokens: l, cached_block_tokens: b, perfect_hit_tokens: perfect };
            let swa = |p: u32| (swa_mask >> ((p / bs) % 64)) & 1 == 1;
            for pol in HitPolicy::ALL {
                let d = pol.decide(&c, i, swa);
                prop_assert_eq!(d.hit_tokens + d.encoder_tokens, l);
                prop_assert!(d.encoder_replay_tokens <= d.encoder_tokens);
                prop_assert!(d.hit_tokens <= perfect.max(b));
                if pol == HitPolicy::Deepinfer {
                    prop_assert_eq!(d.hit_tokens % bs, 0);
                    prop_assert!(d.hit_tokens == 0 || d.hit_tokens <= l - 134);
                    prop_assert!(d.hit_tokens <= b);
                    // Never more than the perfect cache would give.
                    let pc = HitPolicy::PerfectCache.decide(&c, i, swa);
                    prop_assert!(d.hit_tokens <= pc.hit_tokens);
                }
                prop_assert!(d.layer_tokens(&c) <= baseline_layer_tokens(&c, l) + 20 * 2560);
            }
        }
    }
}
