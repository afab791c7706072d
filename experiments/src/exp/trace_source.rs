//! Where an experiment's requests come from: the seeded generators (`[workload]`) or a real
//! trace file (`[trace]`: Mooncake, Azure or servelab's native format), keyed at the
//! experiment's block size.

use anyhow::{Context, Result, anyhow, bail};
use serde::Deserialize;
use servelab_core::{Nanos, TrafficClass};
use servelab_workloads::generate::{WorkloadConfig, generate};
use servelab_workloads::{Trace, azure, mooncake, native};
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum TraceFormat {
    Mooncake,
    Azure,
    Native,
}

/// A trace file to replay.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TraceFile {
    /// Relative paths are relative to the config file's folder.
    pub path: PathBuf,
    pub format: TraceFormat,
    /// Traffic class of every request (Mooncake and Azure files do not say; it picks the
    /// store TTL): agent, chat, document or other.
    #[serde(default)]
    pub class: Option<String>,
}

/// `workload` or `trace`, exactly one.
pub fn load(
    workload: Option<&WorkloadConfig>,
    trace: Option<&TraceFile>,
    config_path: &Path,
    seed: u64,
    block_tokens: u32,
) -> Result<Trace> {
    let origin = config_path.display();
    match (workload, trace) {
        (Some(w), None) => generate(w, seed, block_tokens).map_err(|e| anyhow!("{origin}: {e}")),
        (None, Some(t)) => load_file(t, config_path, block_tokens),
        (Some(_), Some(_)) => bail!("{origin}: give either [workload] or [trace], not both"),
        (None, None) => bail!("{origin}: needs a [workload] (generated) or a [trace] (a file)"),
    }
}

fn load_file(t: &TraceFile, config_path: &Path, block_tokens: u32) -> Result<Trace> {
    let path = if t.path.is_relative() {
        config_path.parent().unwrap_or(Path::new(".")).join(&t.path)
    } else {
        t.path.clone()
    };
    let class = match &t.class {
        None => TrafficClass::Other,
        Some(c) => TrafficClass::parse(c).ok_or_else(|| {
            anyhow!(
                "{}: trace.class `{c}` is not one of agent, chat, document, other",
                config_path.display()
            )
        })?,
    };
    let trace = read(&path, t.format, Some(block_tokens), class)
        .with_context(|| format!("{}: trace.path", config_path.display()))?;
    Ok(trace)
}

/// The hash granularity of the published Mooncake traces (tokens per `hash_ids` entry).
const MOONCAKE_HASH_TOKENS: u32 = 512;

/// A warning when `block_tokens` is finer than what `format` can tell apart: a Mooncake file
/// names 512-token blocks, so sub-blocks of one hash id always hit or miss together and hit
/// rates move in 512-token steps whatever the block size.
pub fn keying_warning(format: TraceFormat, block_tokens: Option<u32>) -> Option<String> {
    match (format, block_tokens) {
        (TraceFormat::Mooncake, Some(b)) if b < MOONCAKE_HASH_TOKENS => Some(format!(
            "block size {b} tokens is finer than the Mooncake trace's own {MOONCAKE_HASH_TOKENS}-token \
             hashes: the {} sub-blocks of a hash always hit or miss together, so hits are exact \
             only to {MOONCAKE_HASH_TOKENS} tokens",
            MOONCAKE_HASH_TOKENS / b.max(1)
        )),
        _ => None,
    }
}

/// Warnings for TTLs (`label`, TTL) longer than `trace` lasts (first to last arrival):
/// nothing stored expires before the trace ends, so such a TTL changes no result of it.
pub fn ttl_warnings(trace: &Trace, ttls: &[(String, Nanos)]) -> Vec<String> {
    let (Some(first), Some(last)) = (trace.requests.first(), trace.requests.last()) else {
        return Vec::new();
    };
    let lasts = last.arrival.saturating_sub(first.arrival);
    ttls.iter()
        .filter(|(_, ttl)| *ttl > lasts)
        .map(|(label, ttl)| {
            format!(
                "{label} = {ttl} is longer than the trace ({lasts} from first to last arrival): nothing expires before the trace ends, so this TTL changes nothing"
            )
        })
        .collect()
}

/// Prints `warnings` on stderr, one `warning:` line each.
pub fn print_warnings(warnings: impl IntoIterator<Item = String>) {
    for w in warnings {
        eprintln!("warning: {w}");
    }
}

/// Reads a trace file keyed at `block_tokens` (None: Mooncake keeps its own 512-token blocks,
/// the other formats use 128), every request of class `class` where the file does not say.
/// Warns when the block size is finer than the file can resolve.
pub fn read(
    path: &Path,
    format: TraceFormat,
    block_tokens: Option<u32>,
    class: TrafficClass,
) -> Result<Trace> {
    print_warnings(keying_warning(format, block_tokens));
    Ok(match format {
        TraceFormat::Mooncake => mooncake::load(
            path,
            &mooncake::MooncakeOptions {
                block_tokens,
                class,
                ..Default::default()
            },
        )?,
        TraceFormat::Azure => azure::load(
            path,
            &azure::AzureOptions {
                block_tokens: block_tokens.unwrap_or(128),
                class,
            },
        )?,
        TraceFormat::Native => native::load(
            path,
            &native::NativeOptions {
                block_tokens: block_tokens.unwrap_or(128),
            },
        )?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use servelab_core::content::ChainBuilder;
    use servelab_core::{Request, RequestId};
    use std::sync::Arc;

    #[test]
    fn mooncake_keyed_finer_than_its_hashes_warns() {
        let w = keying_warning(TraceFormat::Mooncake, Some(128)).unwrap();
        assert!(w.contains("512") && w.contains("4 sub-blocks"), "{w}");
        assert!(keying_warning(TraceFormat::Mooncake, Some(512)).is_none());
        assert!(keying_warning(TraceFormat::Mooncake, None).is_none());
        assert!(keying_warning(TraceFormat::Azure, Some(16)).is_none());
    }

    #[test]
    fn a_ttl_longer_than_the_trace_warns() {
        let content = Arc::new(ChainBuilder::new(128).finish());
        let at = |s: u64| Request {
            id: RequestId(s),
            session: None,
            class: TrafficClass::Chat,
            arrival: Nanos::from_secs(s),
            prompt_tokens: 0,
            output_tokens: 1,
            content: content.clone(),
        };
        let trace = Trace::new(128, vec![at(10), at(70)]);
        let ttls = [
            ("ttl.chat".to_string(), Nanos::from_secs(60)),
            ("ttl.agent".to_string(), Nanos::from_secs(120)),
        ];
        let w = ttl_warnings(&trace, &ttls);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].starts_with("ttl.agent = 2min"), "{w:?}");
        assert!(ttl_warnings(&Trace::new(128, Vec::new()), &ttls).is_empty());
    }
}
