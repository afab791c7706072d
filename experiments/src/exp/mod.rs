//! Experiments: each reads its typed config and writes tables, plots, a summary and a manifest.

use crate::config::LoadedConfig;
use std::path::PathBuf;

pub mod autoscale_day;
pub mod cache_policy;
pub mod cluster;
pub mod cluster_day;
pub mod conformance;
pub mod dspark;
pub mod econ;
pub mod eplb;
pub mod faults;
pub mod plan;
pub mod sampling;
pub mod service;
pub mod trace_source;
pub mod ttl_days;

pub const KINDS: &[&str] = &[
    "autoscale-day",
    "cache-policy",
    "cluster",
    "cluster-day",
    "dspark",
    "econ-sweep",
    "eplb",
    "faults",
    "plan",
    "sampling",
    "service",
    "ttl-days",
];

pub struct RunContext {
    pub config: LoadedConfig,
    pub out: PathBuf,
    pub quiet: bool,
}

impl RunContext {
    pub fn seed(&self) -> u64 {
        self.config.header.seed
    }
}

/// A progress bar that is hidden with `--quiet` or when stderr is not a terminal.
pub fn progress(ctx: &RunContext, len: u64, what: &str) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if ctx.quiet || !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let pb = indicatif::ProgressBar::new(len);
    pb.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg:>14} [{bar:40}] {pos}/{len} {elapsed_precise} eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    pb.set_message(what.to_string());
    pb
}
