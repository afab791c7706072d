//! `servelab run` of a `cluster` config: two units of different sizes on one store, beside the
//! same units on stores of their own.

mod common;

const SMALL: &str = r#"
[experiment]
kind = "cluster"
seed = 9

[service]
warmup = "0s"
series_interval = "10s"

[service.prefill]
gpus_per_machine = 2

[service.decode]
ranks = 2
gpus_per_machine = 2

[[cluster.units]]
name = "big"
prefill_gpus = 4
decode_groups = 2

[[cluster.units]]
name = "small"
prefill_gpus = 2
decode_groups = 1

[workload.chat]
sessions = 150
session_rate_per_s = 3.0
turns = { kind = "fixed", value = 4 }
system_prompts = 3
system_prompt_tokens = { kind = "fixed", value = 2000 }
user_tokens = { kind = "uniform", min = 20, max = 300 }
reply_tokens = { kind = "fixed", value = 150 }
think_time_s = { kind = "fixed", value = 5.0 }
"#;

#[test]
fn cluster_writes_each_unit_in_both_arrangements() {
    let d = common::scratch("cluster", "run");
    let cfg = d.join("small.toml");
    std::fs::write(&cfg, SMALL).unwrap();
    let out = d.join("out");
    let o = common::servelab(&["run", cfg.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let units = std::fs::read_to_string(out.join("units.csv")).unwrap();
    let rows: Vec<&str> = units.lines().collect();
    assert_eq!(rows.len(), 5, "{units}");
    assert!(rows[1].starts_with("shared store,big,8,"), "{units}");
    assert!(rows[4].starts_with("own stores,small,4,"), "{units}");
    let summary = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(summary.contains("# A cluster of 2 units"), "{summary}");
    assert!(summary.contains("with a store per unit"), "{summary}");
}
