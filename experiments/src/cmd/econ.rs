//! `servelab econ` (owned by the econ work; replaced when it lands).

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> anyhow::Result<()> {
    anyhow::bail!("servelab econ: not available in this build")
}
