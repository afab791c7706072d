//! `servelab plan <config.toml>`: capacity planning with the simulator.

use anyhow::{Result, bail};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Planning config (TOML, `[experiment] kind = "plan"`).
    pub config: PathBuf,
    #[arg(long)]
    pub out: Option<PathBuf>,
    #[arg(long)]
    pub seed: Option<u64>,
    #[arg(long)]
    pub quiet: bool,
}

pub fn run(a: Args) -> Result<()> {
    let cfg = crate::config::LoadedConfig::load(&a.config)?;
    if cfg.header.kind != "plan" {
        bail!(
            "{}: `servelab plan` needs `[experiment] kind = \"plan\"`, found `{}` (use `servelab run`)",
            a.config.display(),
            cfg.header.kind
        );
    }
    super::run::run(super::run::Args {
        config: a.config,
        out: a.out,
        seed: a.seed,
        quiet: a.quiet,
    })
}
