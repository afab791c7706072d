//! `servelab run` on the `faults` and `autoscale-day` configs, shrunk with `--set` so that they
//! run in seconds: the tables and summaries are written, no request is lost, and the same seed
//! gives the same bytes.

use std::path::{Path, PathBuf};
use std::process::Output;

mod common;
use common::servelab;

fn scratch(name: &str) -> PathBuf {
    common::scratch("faults", name)
}

fn run(config: &str, out: &Path, sets: &[&str]) -> Output {
    let cfg = format!("{}/configs/{config}", env!("CARGO_MANIFEST_DIR"));
    let mut args = vec![
        "run",
        cfg.as_str(),
        "--out",
        out.to_str().unwrap(),
        "--quiet",
    ];
    for s in sets {
        args.push("--set");
        args.push(s);
    }
    servelab(&args)
}

fn read(d: &Path, f: &str) -> String {
    std::fs::read_to_string(d.join(f)).unwrap_or_else(|e| panic!("{f}: {e}"))
}

/// Column `name` of a CSV, as strings.
fn column(csv: &str, name: &str) -> Vec<String> {
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let k = header
        .iter()
        .position(|h| *h == name)
        .unwrap_or_else(|| panic!("no {name}"));
    lines
        .map(|l| l.split(',').nth(k).unwrap().to_string())
        .collect()
}

#[test]
fn the_fault_campaign_loses_no_request_and_repeats() {
    let d = scratch("faults");
    let sets = ["workload.agent.sessions=60"];
    let (a, b) = (d.join("a"), d.join("b"));
    for out in [&a, &b] {
        let o = run("faults.toml", out, &sets);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    }
    let cases = read(&a, "cases.csv");
    assert!(a.join("cases.parquet").exists());
    let lost = column(&cases, "lost_requests");
    assert_eq!(lost.len(), 12);
    assert!(lost.iter().all(|l| l == "0"), "{lost:?}");
    let lost_bytes = column(&cases, "lost_bytes");
    // Only the case with 3 of a group's nodes down loses objects.
    let names = column(&cases, "case");
    for (n, b) in names.iter().zip(&lost_bytes) {
        assert_eq!(n == "storage-3-of-group", b != "0", "{n}: {b}");
    }
    let summary = read(&a, "summary.md");
    assert!(
        summary.contains("0 requests were lost in total"),
        "{summary}"
    );
    assert_eq!(cases, read(&b, "cases.csv"));
    assert_eq!(summary, read(&b, "summary.md"));
}

#[test]
fn the_autoscaled_day_writes_its_tables() {
    let d = scratch("day");
    // Two hours of a 2-hour "day" keep the test short.
    let sets = [
        "workload.agent.sessions=2000",
        "workload.diurnal.period=\"2h\"",
        "workload.diurnal.peak_at=\"1h\"",
    ];
    let o = run("autoscale-day.toml", &d, &sets);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let p = read(&d, "policies.csv");
    assert_eq!(column(&p, "policy"), ["fixed-peak", "utilisation", "slo"]);
    assert!(column(&p, "lost").iter().all(|l| l == "0"));
    let gpu: Vec<f64> = column(&p, "gpu_hours")
        .iter()
        .map(|g| g.parse().unwrap())
        .collect();
    assert!(gpu[1] < gpu[0] && gpu[2] < gpu[0], "{gpu:?}");
    assert!(d.join("hours.parquet").exists() && d.join("gpus.svg").exists());
    let s = read(&d, "summary.md");
    assert!(s.contains("exact token totals"), "{s}");
}
