//! `servelab run` of a `sampling` config: a small unit on every session and on half of them,
//! the errors computed against the full run, and a rate that does not divide the unit refused.

mod common;
use common::servelab;

fn scratch(name: &str) -> std::path::PathBuf {
    common::scratch("sampling", name)
}

/// 4 prefill engines (2 machines) and 4 decode groups of 2 ranks (4 machines).
const SMALL: &str = r#"
[experiment]
kind = "sampling"
seed = 5

[sampling]
one_in = [1, 2]
hit_pp = 1.0
latency_rel = 0.05

[service]
warmup = "20s"
series_interval = "10s"

[service.swa]
machines = 6

[service.prefill]
gpus = 4
gpus_per_machine = 2

[service.decode]
groups = 4
ranks = 2
gpus_per_machine = 2

[workload.agent]
sessions = 60
session_rate_per_s = 1.0
turns = { kind = "fixed", value = 6 }
system_prompts = 2
system_prompt_tokens = { kind = "fixed", value = 4000 }
task_tokens = { kind = "fixed", value = 500 }
reply_tokens = { kind = "fixed", value = 200 }
tool_result_tokens = { kind = "uniform", min = 200, max = 1500 }
think_time_s = { kind = "fixed", value = 2.0 }

[workload.chat]
sessions = 200
session_rate_per_s = 3.0
turns = { kind = "fixed", value = 4 }
system_prompts = 3
system_prompt_tokens = { kind = "fixed", value = 900 }
user_tokens = { kind = "uniform", min = 10, max = 300 }
reply_tokens = { kind = "uniform", min = 50, max = 300 }
think_time_s = { kind = "fixed", value = 10.0 }
"#;

#[test]
fn sampling_runs_both_rates_and_states_the_errors() {
    let d = scratch("run");
    let cfg = d.join("small.toml");
    std::fs::write(&cfg, SMALL).unwrap();
    let out = d.join("out");
    let o = servelab(&["run", cfg.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let points = std::fs::read_to_string(out.join("points.csv")).unwrap();
    let mut lines = points.lines();
    assert!(
        lines
            .next()
            .unwrap()
            .starts_with("one_in,gpus,arrivals,hit_rate")
    );
    // The full unit has 4 + 8 GPUs, the half unit 2 + 4.
    assert!(lines.next().unwrap().starts_with("1,12,"), "{points}");
    assert!(lines.next().unwrap().starts_with("2,6,"), "{points}");
    let summary = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(summary.contains("- 1 in 2 (6 GPUs): hit rate"), "{summary}");
    assert!(out.join("errors.svg").exists());
}

#[test]
fn a_rate_that_does_not_divide_the_unit_is_refused() {
    let d = scratch("bad");
    let cfg = d.join("bad.toml");
    std::fs::write(&cfg, SMALL.replace("one_in = [1, 2]", "one_in = [1, 3]")).unwrap();
    let o = servelab(&[
        "run",
        cfg.to_str().unwrap(),
        "--out",
        d.join("o").to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("1 in 3 does not divide service.prefill.gpus (4)"),
        "{e}"
    );
}
