//! End-to-end checks of the CUDA backend (issue 6, item 3) on the random model: a cache hit
//! followed by compute against the cold path.
//!
//! * `cold`: one chunk of the whole prompt, decoder replay of `replay` tokens.
//! * `warm`: the same prompt in two chunks, the encoder's window carried across the boundary
//!   in the SWA ring: must match `cold` up to rounding (split points of the attention kernels
//!   differ).
//! * `hit`: two chunks with the ring dropped in between, as after a prefix-cache hit without
//!   stored SWA state: the encoder's window is truncated at the hit boundary (bounded replay),
//!   the SWA approximation whose size is reported.
//! * `full replay`: the decoder replays the whole prompt (replay ≥ prompt); with the ring kept
//!   this is the exact path, and must match `cold` with the same replay up to rounding.

use servelab_core::engine::plan::{PrefillChunk, PrefillPlan, StepPlan, StepReport};
use servelab_core::ids::{EngineId, RequestId};

use crate::backend::{BackendError, CudaBackend};

/// Logit comparison of two runs of the same prompt.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LogitDiff {
    pub what: String,
    pub max_abs: f64,
    pub mean_abs: f64,
    /// Share of compared rows whose greedy token agrees.
    pub top_token_agreement: f64,
}

fn chunk(
    req: u64,
    new: usize,
    prefix: usize,
    replay: usize,
    m: &crate::backend::ModelShape,
) -> PrefillChunk {
    PrefillChunk {
        request: RequestId(req),
        new_tokens: new as u32,
        prefix_tokens: prefix as u32,
        new_token_layers: m.encoder_layers as u32,
        decoder_tokens: replay as u32,
        decoder_layers: m.decoder_layers as u32,
        swap_in_bytes: 0,
    }
}

/// Runs the prompt of `prompt` tokens as `splits` (chunk sizes), the last with `replay`
/// decoder tokens; `drop_ring` forgets the encoder window at each chunk boundary. Returns the
/// last token's logits. Token ids depend on (request, position), so every variant uses the
/// same request id after a reset.
fn run(
    b: &mut CudaBackend,
    splits: &[usize],
    replay: usize,
    drop_ring: bool,
) -> Result<(Vec<f32>, Vec<i32>), BackendError> {
    let m = b.config().model.clone();
    b.reset();
    b.keep_logits = true;
    let mut report = StepReport::default();
    let mut done = 0;
    for (i, &n) in splits.iter().enumerate() {
        if drop_ring && i > 0 {
            b.forget_window(7);
        }
        let last = i + 1 == splits.len();
        let plan = StepPlan::Prefill(PrefillPlan {
            engine: EngineId(0),
            chunks: vec![chunk(7, n, done, if last { replay } else { 0 }, &m)],
            expert_imbalance: 1.0,
        });
        b.try_execute(&plan, &mut report)?;
        done += n;
    }
    Ok((b.last_logits.clone(), b.last_tokens.clone()))
}

fn diff(what: &str, a: &(Vec<f32>, Vec<i32>), b: &(Vec<f32>, Vec<i32>)) -> LogitDiff {
    let n = a.0.len().min(b.0.len()).max(1);
    let (mut mx, mut sum) = (0f64, 0f64);
    for (x, y) in a.0.iter().zip(&b.0) {
        let d = (*x as f64 - *y as f64).abs();
        mx = if d.is_nan() { f64::NAN } else { mx.max(d) };
        sum += d;
    }
    let rows = a.1.len().min(b.1.len()).max(1);
    let agree = a.1.iter().zip(&b.1).filter(|(x, y)| x == y).count();
    LogitDiff {
        what: what.to_string(),
        max_abs: mx,
        mean_abs: sum / n as f64,
        top_token_agreement: agree as f64 / rows as f64,
    }
}

/// Every comparison for prompts of `prompts` tokens split at `hit` tokens.
pub fn replay_checks(
    b: &mut CudaBackend,
    prompts: &[(usize, usize)],
    replay: usize,
) -> Result<Vec<LogitDiff>, BackendError> {
    let mut out = Vec::new();
    for &(len, hit) in prompts {
        let cold = run(b, &[len], replay, false)?;
        let warm = run(b, &[hit, len - hit], replay, false)?;
        let hitp = run(b, &[hit, len - hit], replay, true)?;
        out.push(diff(
            &format!(
                "prompt {len}, chunks {hit}+{}: warm (window kept) vs cold",
                len - hit
            ),
            &warm,
            &cold,
        ));
        out.push(diff(
            &format!("prompt {len}, hit at {hit}: truncated window (SWA approximation) vs cold"),
            &hitp,
            &cold,
        ));
        let full_a = run(b, &[len], len, false)?;
        let full_b = run(b, &[hit, len - hit], len, false)?;
        out.push(diff(
            &format!("prompt {len}: replay {len} >= prompt, chunked vs one chunk (exact path)"),
            &full_b,
            &full_a,
        ));
        out.push(diff(
            &format!("prompt {len}: bounded replay {replay} vs full replay {len}"),
            &cold,
            &full_a,
        ));
    }
    Ok(out)
}
