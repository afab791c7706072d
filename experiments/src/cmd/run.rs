//! `servelab run <config.toml>`: dispatch on `[experiment] kind`.

use crate::config::LoadedConfig;
use crate::exp;
use anyhow::{Result, bail};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Experiment config (TOML).
    pub config: PathBuf,
    /// Output folder (default: `[experiment] out_dir`, else `results/<name>`).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Override the config's seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// No progress bars.
    #[arg(long)]
    pub quiet: bool,
}

pub fn run(args: Args) -> Result<()> {
    let mut cfg = LoadedConfig::load(&args.config)?;
    if let Some(s) = args.seed {
        cfg.header.seed = s;
    }
    let out = cfg.header.out_dir(args.out.as_deref());
    println!(
        "servelab run: {} (kind {}), seed {}, output {}",
        cfg.path.display(),
        cfg.header.kind,
        cfg.header.seed,
        out.display()
    );
    let ctx = exp::RunContext {
        config: cfg,
        out,
        quiet: args.quiet,
    };
    match ctx.config.header.kind.as_str() {
        "cache-policy" => exp::cache_policy::run(&ctx),
        "dspark" => exp::dspark::run(&ctx),
        "econ-sweep" => exp::econ::run(&ctx),
        "eplb" => exp::eplb::run(&ctx),
        "plan" => exp::plan::run(&ctx),
        "service" => exp::service::run(&ctx),
        other => bail!(
            "{}: unknown experiment kind `{other}` (known: {})",
            ctx.config.path.display(),
            exp::KINDS.join(", ")
        ),
    }
}
