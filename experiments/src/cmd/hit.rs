//! `servelab hit`: explains one hit decision.

use anyhow::{Result, bail};
use servelab_core::{HitDecision, HitInputs, HitPolicy, ServingConstants};

#[derive(clap::Args)]
pub struct Args {
    /// Prompt length L, tokens.
    #[arg(long)]
    pub prompt_len: u32,
    /// Length of the cached prefix of full blocks, tokens (B).
    #[arg(long)]
    pub cached_tokens: u32,
    /// Positions where SWA state for this prefix is stored (comma-separated).
    #[arg(long, value_delimiter = ',')]
    pub swa_at: Vec<u32>,
    /// deepinfer (default), perfect-cache, ordinary-model, exact-rebuild, swa-on-ssd,
    /// vllm-encoder-replay, vllm-prefix, sglang-exact-swa.
    #[arg(long, default_value = "deepinfer")]
    pub policy: String,
    /// Block size, tokens.
    #[arg(long, default_value_t = 128)]
    pub block_size: u32,
    /// Decoder replay, tokens.
    #[arg(long, default_value_t = 140)]
    pub decoder_replay: u32,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// One explained decision: what [`crate::api::hit`] returns and the command prints.
pub struct Explanation {
    pub policy: HitPolicy,
    pub constants: ServingConstants,
    pub cached_tokens: u32,
    pub decision: HitDecision,
    pub baseline_layer_tokens: u64,
}

impl Explanation {
    /// The `--json` object (one flat map, also the Python row).
    pub fn to_json(&self) -> serde_json::Value {
        let d = &self.decision;
        serde_json::json!({
            "policy": self.policy.name(),
            "prompt_tokens": d.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "hit_tokens": d.hit_tokens,
            "encoder_tokens": d.encoder_tokens,
            "encoder_replay_tokens": d.encoder_replay_tokens,
            "decoder_tokens": d.decoder_tokens,
            "swa_state_at": d.swa_state_at,
            "layer_tokens": d.layer_tokens(&self.constants),
            "baseline_layer_tokens": self.baseline_layer_tokens,
            "reason": d.reason,
            "explanation": d.reason.describe(),
        })
    }
}

/// Checks the flags and decides.
pub fn explain(a: &Args) -> Result<Explanation> {
    let Some(policy) = HitPolicy::parse(&a.policy) else {
        bail!(
            "--policy: unknown policy `{}` (known: {})",
            a.policy,
            HitPolicy::ALL.map(|p| p.name()).join(", ")
        );
    };
    let c = ServingConstants {
        block_tokens: a.block_size,
        decoder_replay_tokens: a.decoder_replay,
        ..ServingConstants::default()
    };
    c.validate()?;
    if a.cached_tokens > a.prompt_len {
        bail!(
            "--cached-tokens ({}) exceeds --prompt-len ({})",
            a.cached_tokens,
            a.prompt_len
        );
    }
    if !a.cached_tokens.is_multiple_of(c.block_tokens) {
        bail!(
            "--cached-tokens ({}) must be a whole number of {}-token blocks",
            a.cached_tokens,
            c.block_tokens
        );
    }
    if let Some(p) = a
        .swa_at
        .iter()
        .find(|&&p| !p.is_multiple_of(c.block_tokens) || p == 0)
    {
        bail!(
            "--swa-at: {p} is not a positive multiple of the {}-token block",
            c.block_tokens
        );
    }
    let input = HitInputs {
        prompt_tokens: a.prompt_len,
        cached_block_tokens: a.cached_tokens,
        perfect_hit_tokens: a.cached_tokens,
    };
    // SWA state can only exist for a prefix that is cached.
    let decision = policy.decide(&c, input, |p| p <= a.cached_tokens && a.swa_at.contains(&p));
    Ok(Explanation {
        policy,
        baseline_layer_tokens: servelab_core::hit::baseline_layer_tokens(&c, a.prompt_len),
        constants: c,
        cached_tokens: a.cached_tokens,
        decision,
    })
}

pub fn run(a: Args) -> Result<()> {
    let e = explain(&a)?;
    if a.json {
        println!("{}", e.to_json());
        return Ok(());
    }
    let (d, c) = (&e.decision, &e.constants);
    println!("policy          {}", e.policy.name());
    println!(
        "prompt          {} tokens, cached prefix {} tokens",
        d.prompt_tokens, e.cached_tokens
    );
    println!("hit             {} tokens", d.hit_tokens);
    println!(
        "encoder         {} tokens ({} replayed)",
        d.encoder_tokens, d.encoder_replay_tokens
    );
    println!("decoder         {} tokens", d.decoder_tokens);
    println!(
        "compute         {} layer-tokens = {:.1}% of the no-cache 40-layer baseline",
        d.layer_tokens(c),
        100.0 * d.layer_tokens(c) as f64 / e.baseline_layer_tokens.max(1) as f64
    );
    println!("why             {}", d.reason.describe());
    Ok(())
}
