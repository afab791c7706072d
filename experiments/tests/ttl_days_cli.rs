//! `servelab run` of a `ttl-days` config: the outputs a user reads, the same files whatever
//! the number of threads, and bad input named by file and field.

mod common;
use std::path::{Path, PathBuf};

fn servelab(args: &[&str], threads: &str) -> std::process::Output {
    common::servelab_with(args, &[("RAYON_NUM_THREADS", threads)])
}

fn scratch(name: &str) -> PathBuf {
    common::scratch("ttl", name)
}

/// Three days of a small mix: chat that returns within days, agents within hours, documents.
const SMALL: &str = r#"
[experiment]
kind = "ttl-days"
seed = 3

[days]
days = 3
warmup_days = 1
one_in = [1, 2]
policy = "deepinfer"
ec_overhead = 1.2
cluster_tokens_per_day = 155e12
published_cost_pp = [0.5, 1.0]
published_ssd_pib = 100.0

[[days.scenario]]
name = "published"
ttl = { agent = "3d", chat = "7d", other = "3d" }

[[days.scenario]]
name = "chat-1d"
ttl = { agent = "3d", chat = "1d", other = "3d" }

[workload.agent]
sessions = 28
session_rate_per_s = 0.0001
turns = { kind = "fixed", value = 8 }
system_prompts = 2
system_prompt_tokens = { kind = "fixed", value = 1500 }
task_tokens = { kind = "fixed", value = 300 }
reply_tokens = { kind = "fixed", value = 200 }
tool_result_tokens = { kind = "uniform", min = 200, max = 2000 }
think_time_s = { kind = "fixed", value = 5.0 }
revisits = { probability = 0.5, gap_s = { kind = "fixed", value = 3600 }, turns = { kind = "fixed", value = 3 }, max_visits = 2 }

[workload.chat]
sessions = 630
session_rate_per_s = 0.0023
turns = { kind = "fixed", value = 4 }
system_prompts = 5
system_prompt_tokens = { kind = "fixed", value = 1000 }
user_tokens = { kind = "uniform", min = 20, max = 200 }
reply_tokens = { kind = "uniform", min = 50, max = 300 }
think_time_s = { kind = "fixed", value = 20.0 }
revisits = { probability = 0.8, gap_s = { kind = "lognormal", median = 86400, sigma = 0.7 }, turns = { kind = "fixed", value = 2 }, max_visits = 3 }

[workload.documents]
requests = 28
rate_per_s = 0.0001
system_prompts = 1
system_prompt_tokens = { kind = "fixed", value = 500 }
document_tokens = { kind = "uniform", min = 20000, max = 40000 }
question_tokens = { kind = "fixed", value = 50 }
answer_tokens = { kind = "fixed", value = 100 }
repeat_probability = 0.3
"#;

fn files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap() != "manifest.json")
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect();
    v.sort();
    v
}

#[test]
fn ttl_days_writes_its_tables_and_does_not_depend_on_the_thread_count() {
    let d = scratch("run");
    let cfg = d.join("small.toml");
    std::fs::write(&cfg, SMALL).unwrap();
    let (a, b) = (d.join("a"), d.join("b"));
    for (out, threads) in [(&a, "1"), (&b, "2")] {
        let o = servelab(
            &["run", cfg.to_str().unwrap(), "--out", out.to_str().unwrap()],
            threads,
        );
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let (fa, fb) = (files(&a), files(&b));
    let names: Vec<&str> = fa.iter().map(|f| f.0.as_str()).collect();
    for want in [
        "days.csv",
        "runs.csv",
        "summary.md",
        "hit_rate.svg",
        "store.svg",
    ] {
        assert!(names.contains(&want), "{names:?}");
    }
    assert!(names.contains(&"runs.parquet"), "{names:?}");
    assert_eq!(fa, fb, "1 and 2 threads give the same files");
    let summary = std::fs::read_to_string(a.join("summary.md")).unwrap();
    // A day-long chat TTL against returns a day later costs hits; the text says how many.
    assert!(summary.contains("**chat-1d** costs"), "{summary}");
    assert!(summary.contains("Sampling 1 in 2"), "{summary}");
    let manifest = std::fs::read_to_string(a.join("manifest.json")).unwrap();
    assert!(manifest.contains("simulated_per_wall"), "{manifest}");
}

#[test]
fn ttl_days_names_the_field_of_bad_input() {
    let d = scratch("bad");
    let cfg = d.join("bad.toml");
    let bad = SMALL.replace("probability = 0.8", "probability = 1.8");
    std::fs::write(&cfg, bad).unwrap();
    let o = servelab(
        &[
            "run",
            cfg.to_str().unwrap(),
            "--out",
            d.join("out").to_str().unwrap(),
        ],
        "1",
    );
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("workload.chat.revisits.probability") && e.contains("bad.toml"),
        "{e}"
    );
}
