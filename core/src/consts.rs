//! The serving constants of SPEC §1–§2. Every one is a config value, so researchers can sweep
//! them; [`ServingConstants::validate`] rejects combinations that make the hit rules meaningless.

use crate::error::ConfigError;
use serde::{Deserialize, Serialize};

/// Model shape and cache constants that the hit rules, the store and the accounting read.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServingConstants {
    /// Sliding-window attention window, tokens (SPEC §1).
    pub window_tokens: u32,
    /// KV cache block: unit of the store and of prefix matching (SPEC §2).
    pub block_tokens: u32,
    /// Tokens DSpark drafts per step.
    pub draft_tokens: u32,
    /// Speculative backtrack = draft block + 1.
    pub backtrack_tokens: u32,
    /// Decoder-side bounded replay length (shipped default 140; 128 in the Q&A).
    pub decoder_replay_tokens: u32,
    /// Tokens the exact decoder rebuild runs through the decoder (20 layers × 128).
    pub exact_rebuild_tokens: u32,
    pub encoder_layers: u32,
    pub decoder_layers: u32,
    /// Global (compressed) KV bytes per token in HBM and in the store before erasure coding.
    pub kv_bytes_per_token: u32,
    /// Stored SWA state, bytes per token per layer (MXFP8).
    pub swa_bytes_per_token_layer: u32,
    /// Tokens of window kept per stored SWA state (window + backtrack).
    pub swa_state_tokens: u32,
    /// Layers whose window state is stored (the encoder's).
    pub swa_state_layers: u32,
}

impl Default for ServingConstants {
    fn default() -> Self {
        Self {
            window_tokens: 128,
            block_tokens: 128,
            draft_tokens: 5,
            backtrack_tokens: 6,
            decoder_replay_tokens: 140,
            exact_rebuild_tokens: 2560,
            encoder_layers: 20,
            decoder_layers: 20,
            kv_bytes_per_token: 890,
            swa_bytes_per_token_layer: 528,
            swa_state_tokens: 134,
            swa_state_layers: 20,
        }
    }
}

impl ServingConstants {
    /// Never hit closer than this to the end of the prompt: window + backtrack (134).
    pub fn hit_margin_tokens(&self) -> u32 {
        self.window_tokens.saturating_add(self.backtrack_tokens)
    }

    /// Bytes of one full KV block in the store (before erasure coding).
    pub fn block_bytes(&self) -> u64 {
        u64::from(self.block_tokens) * u64::from(self.kv_bytes_per_token)
    }

    /// Bytes of one stored SWA state (1,415,040 with the defaults).
    pub fn swa_state_bytes(&self) -> u64 {
        u64::from(self.swa_state_layers)
            .saturating_mul(u64::from(self.swa_state_tokens))
            .saturating_mul(u64::from(self.swa_bytes_per_token_layer))
    }

    /// Layers of the ordinary decoder-only model used as the compute baseline.
    pub fn total_layers(&self) -> u32 {
        self.encoder_layers.saturating_add(self.decoder_layers)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check_positive()?;
        self.check_bounds()?;
        self.check_relations()
    }

    /// The constants that divide, or size a block or a stack, are positive.
    fn check_positive(&self) -> Result<(), ConfigError> {
        for (name, v) in [
            ("window_tokens", self.window_tokens),
            ("block_tokens", self.block_tokens),
            ("draft_tokens", self.draft_tokens),
            ("encoder_layers", self.encoder_layers),
            ("decoder_layers", self.decoder_layers),
            ("kv_bytes_per_token", self.kv_bytes_per_token),
        ] {
            if v == 0 {
                return invalid_constant(name, "must be positive".into());
            }
        }
        Ok(())
    }

    /// Bounds far above any model, low enough that every sum and product of constants (and
    /// of a prompt length with them) fits its integer type.
    fn check_bounds(&self) -> Result<(), ConfigError> {
        for (name, v, max) in [
            ("window_tokens", self.window_tokens, MAX_TOKENS),
            ("block_tokens", self.block_tokens, MAX_TOKENS),
            ("draft_tokens", self.draft_tokens, MAX_DRAFT_TOKENS),
            ("backtrack_tokens", self.backtrack_tokens, MAX_TOKENS),
            (
                "decoder_replay_tokens",
                self.decoder_replay_tokens,
                MAX_TOKENS,
            ),
            (
                "exact_rebuild_tokens",
                self.exact_rebuild_tokens,
                MAX_TOKENS,
            ),
            ("swa_state_tokens", self.swa_state_tokens, MAX_TOKENS),
            ("encoder_layers", self.encoder_layers, MAX_LAYERS),
            ("decoder_layers", self.decoder_layers, MAX_LAYERS),
            ("swa_state_layers", self.swa_state_layers, MAX_LAYERS),
            (
                "kv_bytes_per_token",
                self.kv_bytes_per_token,
                MAX_BYTES_PER_TOKEN,
            ),
            (
                "swa_bytes_per_token_layer",
                self.swa_bytes_per_token_layer,
                MAX_BYTES_PER_TOKEN,
            ),
        ] {
            if v > max {
                return invalid_constant(
                    name,
                    format!("{v} is more than the largest accepted, {max}"),
                );
            }
        }
        Ok(())
    }

    /// The constants that SPEC §2 ties together: the backtrack covers a draft block, the
    /// decoder replay rebuilds the window, the exact rebuild spans one.
    fn check_relations(&self) -> Result<(), ConfigError> {
        if u64::from(self.backtrack_tokens) < u64::from(self.draft_tokens) + 1 {
            return invalid_constant(
                "backtrack_tokens",
                format!(
                    "{} is less than draft_tokens + 1 = {}",
                    self.backtrack_tokens,
                    u64::from(self.draft_tokens) + 1
                ),
            );
        }
        if self.decoder_replay_tokens < self.hit_margin_tokens() {
            return invalid_constant(
                "decoder_replay_tokens",
                format!(
                    "{} is shorter than window + backtrack = {}: the replay could not rebuild the window (SPEC §2)",
                    self.decoder_replay_tokens,
                    self.hit_margin_tokens()
                ),
            );
        }
        if self.exact_rebuild_tokens < self.window_tokens {
            return invalid_constant(
                "exact_rebuild_tokens",
                "must be at least one window".to_string(),
            );
        }
        Ok(())
    }
}

/// The error of an invalid `constants.{f}`.
fn invalid_constant(f: &str, why: String) -> Result<(), ConfigError> {
    Err(ConfigError::invalid(format!("constants.{f}"), why))
}

/// The largest token constant accepted (2^24 = 16.8M tokens).
pub const MAX_TOKENS: u32 = 1 << 24;
/// The largest DSpark draft block accepted.
pub const MAX_DRAFT_TOKENS: u32 = 64;
/// The largest layer count accepted.
pub const MAX_LAYERS: u32 = 4096;
/// The largest per-token byte size accepted (16 MiB).
pub const MAX_BYTES_PER_TOKEN: u32 = 1 << 24;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn published_sizes() {
        let c = ServingConstants::default();
        assert_eq!(c.hit_margin_tokens(), 134);
        assert_eq!(c.swa_state_bytes(), 1_415_040);
        assert_eq!(c.block_bytes(), 113_920);
        assert_eq!(c.exact_rebuild_tokens, c.decoder_layers * c.window_tokens);
        c.validate().unwrap();
    }

    #[test]
    fn rejects_short_replay() {
        let c = ServingConstants {
            decoder_replay_tokens: 128,
            ..Default::default()
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("decoder_replay_tokens"), "{e}");
    }

    /// Sums that used to wrap (`draft_tokens + 1` at `u32::MAX`) are refused, and so is a
    /// zero draft block (the acceptance model divides by it).
    #[test]
    fn extreme_values_are_refused_not_wrapped() {
        for c in [
            ServingConstants {
                draft_tokens: u32::MAX,
                backtrack_tokens: 0,
                ..Default::default()
            },
            ServingConstants {
                window_tokens: u32::MAX,
                ..Default::default()
            },
            ServingConstants {
                swa_state_layers: u32::MAX,
                swa_state_tokens: u32::MAX,
                swa_bytes_per_token_layer: u32::MAX,
                ..Default::default()
            },
        ] {
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains("largest accepted"), "{e}");
        }
        let e = ServingConstants {
            draft_tokens: 0,
            ..Default::default()
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.contains("constants.draft_tokens"), "{e}");
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let e = toml::from_str::<ServingConstants>("window_tokens = 64\nwindow = 3\n").unwrap_err();
        assert!(e.to_string().contains("window"), "{e}");
    }
}
