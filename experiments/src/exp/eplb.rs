//! The EPLB imbalance experiment (owned by the EPLB work; replaced when it lands).

use super::RunContext;

pub fn run(_ctx: &RunContext) -> anyhow::Result<()> {
    anyhow::bail!("experiment kind `eplb`: not available in this build")
}
