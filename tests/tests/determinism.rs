//! Same config and seed ⇒ identical replay reports; another seed ⇒ different ones.

use servelab_core::HitPolicy;
use servelab_sim::replay::{ReplayConfig, replay};
use servelab_workloads::generate::{WorkloadConfig, generate};

const MIX: &str = r#"
[agent]
sessions = 5
session_rate_per_s = 0.2
turns = { kind = "uniform", min = 3, max = 12 }
system_prompts = 2
system_prompt_tokens = { kind = "lognormal", median = 1500, sigma = 0.5 }
task_tokens = { kind = "fixed", value = 300 }
reply_tokens = { kind = "lognormal", median = 200, sigma = 0.8 }
tool_result_tokens = { kind = "uniform", min = 200, max = 4000 }
think_time_s = { kind = "exponential", mean = 60.0 }
compaction = { above_tokens = 20000, probability = 0.05, summary_tokens = { kind = "fixed", value = 3000 } }

[chat]
sessions = 20
session_rate_per_s = 1.0
turns = { kind = "fixed", value = 8 }
system_prompts = 4
system_prompt_tokens = { kind = "uniform", min = 200, max = 3000 }
user_tokens = { kind = "lognormal", median = 80, sigma = 0.8 }
reply_tokens = { kind = "lognormal", median = 200, sigma = 0.6 }
think_time_s = { kind = "lognormal", median = 60.0, sigma = 1.0 }

[documents]
requests = 30
rate_per_s = 0.1
system_prompts = 1
system_prompt_tokens = { kind = "fixed", value = 500 }
document_tokens = { kind = "uniform", min = 20000, max = 200000 }
question_tokens = { kind = "fixed", value = 50 }
answer_tokens = { kind = "fixed", value = 300 }
repeat_probability = 0.3
"#;

fn run(seed: u64) -> String {
    let mix: WorkloadConfig = toml::from_str(MIX).unwrap();
    let trace = generate(&mix, seed, 128).unwrap();
    let rep = replay(&trace, &ReplayConfig::default(), &HitPolicy::ALL).unwrap();
    serde_json::to_string(&rep).unwrap()
}

#[test]
fn same_seed_same_bytes() {
    let a = run(5);
    assert_eq!(a, run(5));
    assert_ne!(a, run(6));
}
