//! `servelab eplb` (owned by the eplb work; replaced when it lands).

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("servelab eplb: not available in this build")
}
