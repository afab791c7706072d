//! Where an experiment's requests come from: the seeded generators (`[workload]`) or a real
//! trace file (`[trace]`: Mooncake, Azure or servelab's native format), keyed at the
//! experiment's block size.

use anyhow::{Context, Result, anyhow, bail};
use serde::Deserialize;
use servelab_core::TrafficClass;
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

/// Reads a trace file keyed at `block_tokens` (None: Mooncake keeps its own 512-token blocks,
/// the other formats use 128), every request of class `class` where the file does not say.
pub fn read(
    path: &Path,
    format: TraceFormat,
    block_tokens: Option<u32>,
    class: TrafficClass,
) -> Result<Trace> {
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
