//! `servelab run` on the `cluster-day` config, shrunk with `--set` to an hour of a few
//! thousand sampled requests: the day's table has a row per sample, the figures are scaled to
//! the whole cluster, the summary states the sampling error, and bad input names its field.

use std::path::{Path, PathBuf};
use std::process::Output;

mod common;
use common::{servelab, stderr};

fn scratch(name: &str) -> PathBuf {
    common::scratch("cluster-day", name)
}

/// An hour-long "day" with few sessions; `extra` overrides more.
fn run(out: &Path, extra: &[&str]) -> Output {
    let cfg = format!("{}/configs/cluster-day.toml", env!("CARGO_MANIFEST_DIR"));
    let mut args = vec![
        "run",
        cfg.as_str(),
        "--out",
        out.to_str().unwrap(),
        "--quiet",
    ];
    let sets = [
        "workload.diurnal.period=\"1h\"",
        "workload.diurnal.peak_at=\"30min\"",
        "workload.agent.sessions=20000",
        "workload.agent.session_rate_per_s=20.0",
        "workload.chat.sessions=10000",
        "workload.chat.session_rate_per_s=10.0",
        "workload.documents.requests=2000",
        "workload.documents.rate_per_s=2.0",
    ];
    for s in sets.iter().chain(extra) {
        args.push("--set");
        args.push(s);
    }
    servelab(&args)
}

fn column(csv: &str, name: &str) -> Vec<f64> {
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let k = header.iter().position(|h| *h == name).unwrap();
    lines
        .map(|l| l.split(',').nth(k).unwrap().parse().unwrap())
        .collect()
}

#[test]
fn an_hour_of_the_cluster_is_scaled_to_the_cluster_and_states_its_sampling_error() {
    let d = scratch("hour");
    let o = run(&d, &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    let day = std::fs::read_to_string(d.join("day.csv")).unwrap();
    assert_eq!(column(&day, "sample"), [0.0, 1.0]);
    // 16 units of 128 GPUs, whatever the sample simulated.
    assert_eq!(column(&day, "gpus"), [2048.0, 2048.0]);
    assert_eq!(column(&day, "simulated_gpus"), [8.0, 8.0]);
    let hits = column(&day, "hit_rate");
    assert!(hits.iter().all(|h| (0.5..1.0).contains(h)), "{hits:?}");
    // About 9,000 sampled requests an hour scaled by 256 and to a day: tens of trillions.
    let tokens = column(&day, "tokens_per_day");
    assert!(
        tokens.iter().all(|t| (1e12..1e15).contains(t)),
        "{tokens:?}"
    );
    let hours = std::fs::read_to_string(d.join("hours.csv")).unwrap();
    assert!(column(&hours, "prefill_busy_gpus").iter().any(|g| *g > 0.0));
    assert!(d.join("gpus.svg").exists() && d.join("day.parquet").exists());
    let s = std::fs::read_to_string(d.join("summary.md")).unwrap();
    assert!(s.contains("Sampling error: 2 independent samples"), "{s}");
    assert!(s.contains("economics instrument"), "{s}");
}

#[test]
fn bad_day_keys_name_their_field() {
    let d = scratch("bad");
    let o = run(&d, &["day.samples=0"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("day.samples"), "{}", stderr(&o));
    let o = run(&d, &["day.one_in=3"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("does not divide"), "{}", stderr(&o));
    let o = run(&d, &["day.published.gpus=[2400, 1700]"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("day.published.gpus"), "{}", stderr(&o));
}
