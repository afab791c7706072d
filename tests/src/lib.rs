//! Helpers of the cross-crate integration tests.

pub mod swarm;

/// Agent sessions that re-read long contexts for about a minute: 30 sessions of 8–16 turns over
/// two 6,000-token system prompts (the fault tests' workload, small enough for debug builds).
pub fn agent_workload() -> servelab_workloads::generate::WorkloadConfig {
    toml::from_str(
        r#"
        [agent]
        sessions = 30
        session_rate_per_s = 1.0
        turns = { kind = "uniform", min = 8, max = 16 }
        system_prompts = 2
        system_prompt_tokens = { kind = "fixed", value = 6000 }
        task_tokens = { kind = "uniform", min = 200, max = 2000 }
        reply_tokens = { kind = "uniform", min = 50, max = 300 }
        tool_result_tokens = { kind = "uniform", min = 200, max = 2000 }
        think_time_s = { kind = "exponential", mean = 2.0 }
        "#,
    )
    .expect("the fixture parses")
}
