//! `servelab replay` (in progress).

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("servelab replay: not available in this build")
}
