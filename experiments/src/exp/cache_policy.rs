//! The cache-policy experiment (in progress).

use super::RunContext;

pub fn run(_ctx: &RunContext) -> anyhow::Result<()> {
    anyhow::bail!("experiment kind `cache-policy`: not available in this build")
}
