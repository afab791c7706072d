//! `servelab eplb`: DeepSeek's EPLB on a load matrix from a JSON file.
//!
//! Reads `{"weight": [[...], ...]}` (layers × logical experts) and prints one JSON object
//! `{"phy2log": ..., "log2phy": ..., "logcnt": ...}` on stdout.

use anyhow::{Context, Result, anyhow};
use serde::Deserialize;
use servelab_core::eplb::rebalance_experts;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// JSON file `{"weight": [[...], ...]}`: load per layer and logical expert.
    #[arg(long)]
    pub input: PathBuf,
    /// Physical expert slots per layer (a multiple of --gpus, at least the number of experts).
    #[arg(long)]
    pub replicas: usize,
    /// Expert groups. When --nodes divide them the placement is hierarchical and the groups must
    /// divide the experts; otherwise it is global (one group), as in DeepSeek's eplb.py.
    #[arg(long)]
    pub groups: usize,
    /// Server nodes; with a hierarchical placement they must divide --gpus.
    #[arg(long)]
    pub nodes: usize,
    /// GPUs.
    #[arg(long)]
    pub gpus: usize,
    /// Indent the JSON output.
    #[arg(long)]
    pub pretty: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Input {
    weight: Vec<Vec<f64>>,
}

/// Parses the input text; errors say what is wrong (the caller names the file).
fn parse_weight(text: &str) -> Result<Vec<Vec<f32>>> {
    let input: Input = serde_json::from_str(text).map_err(|e| anyhow!("{e}"))?;
    // EPLB's loads are float32; a value beyond its range would silently become infinite.
    for (l, row) in input.weight.iter().enumerate() {
        if let Some((e, v)) = row
            .iter()
            .enumerate()
            .find(|(_, v)| v.abs() > f64::from(f32::MAX))
        {
            return Err(anyhow!("weight[{l}][{e}] = {v} does not fit in float32"));
        }
    }
    Ok(input
        .weight
        .into_iter()
        .map(|row| row.into_iter().map(|v| v as f32).collect())
        .collect())
}

/// The largest load file read (256 MiB): a load matrix of tens of millions of entries, and
/// `/dev/zero` is refused instead of read into memory without end.
const MAX_INPUT_BYTES: u64 = 256 << 20;

fn read_bounded(path: &std::path::Path) -> Result<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(MAX_INPUT_BYTES + 1)
        .read_to_string(&mut text)?;
    if text.len() as u64 > MAX_INPUT_BYTES {
        return Err(anyhow!(
            "the file is larger than {} MiB",
            MAX_INPUT_BYTES >> 20
        ));
    }
    Ok(text)
}

pub fn run(a: Args) -> Result<()> {
    let file = a.input.display();
    let text = read_bounded(&a.input).with_context(|| format!("reading {file}"))?;
    let weight = parse_weight(&text)
        .with_context(|| format!("{file}: expected {{\"weight\": [[...], ...]}}"))?;
    let placement =
        rebalance_experts(&weight, a.replicas, a.groups, a.nodes, a.gpus).map_err(|e| {
            anyhow!(
                "{file} with --replicas {} --groups {} --nodes {} --gpus {}: {e}",
                a.replicas,
                a.groups,
                a.nodes,
                a.gpus
            )
        })?;
    let out = if a.pretty {
        serde_json::to_string_pretty(&placement)?
    } else {
        serde_json::to_string(&placement)?
    };
    println!("{out}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects() {
        assert_eq!(
            parse_weight(r#"{"weight": [[1, 2.5], [0, 3]]}"#).unwrap(),
            vec![vec![1.0, 2.5], vec![0.0, 3.0]]
        );
        let err = |t: &str| parse_weight(t).unwrap_err().to_string();
        assert!(err(r#"{"weights": [[1]]}"#).contains("unknown field"));
        assert!(err(r#"{"weight": [[1, "x"]]}"#).contains("invalid type"));
        assert!(err(r#"{"weight": [[1e300]]}"#).contains("float32"));
        assert!(err("not json").contains("expected"));
    }
}
