//! `servelab replay`: block-level replay of a trace through the store (no timing).

use anyhow::{Context, Result, bail};
use servelab_core::{ClassTtl, Nanos, StoreConfig, TrafficClass, parse_duration};
use servelab_sim::replay::{BlockReplayReport, block_replay};
use servelab_workloads::Trace;
use std::path::PathBuf;

pub use crate::exp::trace_source::TraceFormat as Format;

#[derive(Clone, Copy, Debug, PartialEq, clap::ValueEnum)]
pub enum StorePolicy {
    /// Capacity-bound LRU, no TTL.
    Lru,
    /// TTL only, unbounded capacity.
    Ttl,
    /// Both.
    LruTtl,
}

#[derive(clap::Args)]
pub struct Args {
    /// Trace file.
    #[arg(long)]
    pub trace: PathBuf,
    #[arg(long, value_enum)]
    pub format: Format,
    /// Block size in tokens (Mooncake default: the trace's own 512-token blocks; else 128).
    #[arg(long)]
    pub block_size: Option<u32>,
    /// Store capacity in blocks.
    #[arg(long, conflicts_with = "capacity_bytes")]
    pub capacity_blocks: Option<u64>,
    /// Store capacity in logical KV bytes (before erasure coding).
    #[arg(long)]
    pub capacity_bytes: Option<u64>,
    /// TTL of every block, with a unit: 3d, 7d, 10min, 180s, 250ms (counted from the last
    /// access). A bare number is an error, as in configs.
    #[arg(long)]
    pub ttl: Option<String>,
    /// lru, ttl or lru-ttl (default: whatever the capacity and TTL flags imply).
    #[arg(long, value_enum)]
    pub policy: Option<StorePolicy>,
    /// Also write each request's output blocks to the store.
    #[arg(long)]
    pub cache_outputs: bool,
    /// KV bytes per token (890 for V4.1-Flash).
    #[arg(long, default_value_t = 890)]
    pub bytes_per_token: u32,
    /// Traffic class given to the trace's requests (agent, chat, other): picks nothing but the
    /// label here, since `--ttl` applies to every class.
    #[arg(long, default_value = "other")]
    pub class: String,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

impl StorePolicy {
    fn name(self) -> &'static str {
        match self {
            StorePolicy::Lru => "lru",
            StorePolicy::Ttl => "ttl",
            StorePolicy::LruTtl => "lru-ttl",
        }
    }
}

/// A replay's report and the settings it ran with: what [`crate::api::replay`] returns and the
/// command prints.
pub struct Outcome {
    pub report: BlockReplayReport,
    pub trace: PathBuf,
    pub block_tokens: u32,
    pub policy: StorePolicy,
    pub capacity_bytes: Option<u64>,
    pub ttl: Option<Nanos>,
    pub cache_outputs: bool,
}

impl Outcome {
    /// The `--json` object: the report and the settings.
    pub fn to_json(&self) -> Result<serde_json::Value> {
        let mut v = serde_json::to_value(&self.report)?;
        let o = v.as_object_mut().expect("report is an object");
        o.insert("trace".into(), self.trace.display().to_string().into());
        o.insert("block_tokens".into(), self.block_tokens.into());
        o.insert("policy".into(), self.policy.name().into());
        o.insert("capacity_bytes".into(), self.capacity_bytes.into());
        o.insert("ttl".into(), self.ttl.map(|t| t.to_string()).into());
        o.insert("cache_outputs".into(), self.cache_outputs.into());
        Ok(v)
    }
}

/// Checks the flags, reads the trace and replays it.
pub fn replay(a: &Args) -> Result<Outcome> {
    let class = TrafficClass::parse(&a.class)
        .with_context(|| format!("--class: unknown class `{}` (agent, chat, other)", a.class))?;
    if a.block_size == Some(0) {
        bail!("--block-size must be positive");
    }
    if a.bytes_per_token == 0 {
        bail!("--bytes-per-token must be positive");
    }
    let ttl: Option<Nanos> = a
        .ttl
        .as_deref()
        .map(parse_duration)
        .transpose()
        .map_err(|e| anyhow::anyhow!("--ttl: {e}"))?;
    if ttl == Some(Nanos::ZERO) {
        bail!("--ttl must be positive");
    }
    let policy = store_policy(a, ttl)?;
    let trace: Trace = crate::exp::trace_source::read(&a.trace, a.format, a.block_size, class)?;
    if let Some(t) = ttl {
        crate::exp::trace_source::print_warnings(crate::exp::trace_source::ttl_warnings(
            &trace,
            &[("--ttl".to_string(), t)],
        ));
    }
    let block_bytes = u64::from(trace.block_tokens) * u64::from(a.bytes_per_token);
    let capacity = capacity_bytes(a, block_bytes)?;
    let store = StoreConfig {
        capacity_bytes: capacity,
        ttl: ClassTtl::uniform(ttl),
        // The replay semantics: capacity bounds what stays, evicting exactly what does not fit.
        high_watermark: 1.0,
        low_watermark: 1.0,
        ..StoreConfig::default()
    };
    let rep = block_replay(&trace, &store, block_bytes, a.cache_outputs)
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(Outcome {
        report: rep,
        trace: a.trace.clone(),
        block_tokens: trace.block_tokens,
        policy,
        capacity_bytes: capacity,
        ttl,
        cache_outputs: a.cache_outputs,
    })
}

/// `--policy`, or the one the capacity and TTL flags imply, checked against those flags.
fn store_policy(a: &Args, ttl: Option<Nanos>) -> Result<StorePolicy> {
    let has_capacity = a.capacity_blocks.is_some() || a.capacity_bytes.is_some();
    let policy = a.policy.unwrap_or(match (has_capacity, ttl.is_some()) {
        (_, false) => StorePolicy::Lru,
        (false, true) => StorePolicy::Ttl,
        (true, true) => StorePolicy::LruTtl,
    });
    match policy {
        StorePolicy::Lru if ttl.is_some() => bail!("--policy lru takes no --ttl (use lru-ttl)"),
        StorePolicy::Ttl if has_capacity => {
            bail!("--policy ttl has unbounded capacity: drop --capacity-* or use lru-ttl")
        }
        StorePolicy::Ttl | StorePolicy::LruTtl if ttl.is_none() => {
            bail!("--policy {} needs --ttl", policy.name())
        }
        StorePolicy::LruTtl if !has_capacity => {
            bail!("--policy lru-ttl needs --capacity-blocks or --capacity-bytes")
        }
        _ => {}
    }
    Ok(policy)
}

/// The store capacity in bytes, from `--capacity-blocks` or `--capacity-bytes`; None when
/// unbounded.
fn capacity_bytes(a: &Args, block_bytes: u64) -> Result<Option<u64>> {
    let capacity = match (a.capacity_blocks, a.capacity_bytes) {
        (Some(b), _) => Some(
            b.checked_mul(block_bytes)
                .context("--capacity-blocks is too large")?,
        ),
        (None, c) => c,
    };
    if capacity == Some(0) {
        bail!("the store capacity must be positive");
    }
    Ok(capacity)
}

pub fn run(a: Args) -> Result<()> {
    let out = replay(&a)?;
    let rep = &out.report;
    if a.json {
        println!("{}", out.to_json()?);
    } else {
        println!(
            "trace           {} ({} requests, block {} tokens)",
            a.trace.display(),
            rep.requests,
            out.block_tokens
        );
        println!("input tokens    {}", rep.input_tokens);
        println!(
            "hit tokens      {} ({:.2}%)",
            rep.hit_tokens,
            100.0 * rep.token_hit_rate
        );
        println!(
            "block hit rate  {:.2}% of {} blocks",
            100.0 * rep.block_hit_rate,
            rep.blocks
        );
        println!(
            "store           {} evictions, {} expirations, peak {:.3} GB",
            rep.store.evictions,
            rep.store.expirations,
            rep.store.peak_bytes as f64 / 1e9
        );
    }
    Ok(())
}
