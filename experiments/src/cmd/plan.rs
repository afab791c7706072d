//! `servelab plan <config.toml>`: capacity planning with the simulator.

use anyhow::{Result, bail};

/// The same flags as `servelab run`.
pub type Args = super::run::Args;

pub fn run(a: Args) -> Result<()> {
    let cfg = crate::config::LoadedConfig::load(&a.config)?;
    if cfg.header.kind != "plan" {
        bail!(
            "{}: `servelab plan` needs `[experiment] kind = \"plan\"`, found `{}` (use `servelab run`)",
            a.config.display(),
            cfg.header.kind
        );
    }
    super::run::run(a)
}
