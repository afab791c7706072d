//! The researcher's workflow end to end: `--set` overrides, sweeps (tables, intervals, resume,
//! warnings, bad sweeps), summary.json and `--json`, output folders that refuse to be
//! overwritten, and a manifest that names the build.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn servelab_in(dir: Option<&Path>, args: &[&str]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_servelab"));
    c.args(args).env("RAYON_NUM_THREADS", "1");
    if let Some(d) = dir {
        c.current_dir(d);
    }
    c.output().expect("servelab runs")
}

fn servelab(args: &[&str]) -> Output {
    servelab_in(None, args)
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("servelab-flow-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A cache-policy run of well under a second in a debug build.
const TINY: &str = r#"policies = ["deepinfer", "perfect-cache", "ordinary-model", "exact-rebuild"]

[experiment]
kind = "cache-policy"
seed = 5

[store]
ttl = { agent = "3d", chat = "7d", other = "3d" }

[[workload]]
name = "agent"
[workload.mix.agent]
sessions = 6
session_rate_per_s = 0.5
turns = { kind = "fixed", value = 4 }
system_prompts = 2
system_prompt_tokens = { kind = "uniform", min = 500, max = 2000 }
task_tokens = { kind = "fixed", value = 300 }
reply_tokens = { kind = "lognormal", median = 200, sigma = 0.5 }
tool_result_tokens = { kind = "uniform", min = 200, max = 3000 }
think_time_s = { kind = "lognormal", median = 600.0, sigma = 1.5 }
"#;

fn config(d: &Path, name: &str, body: &str) -> String {
    let p = d.join(name);
    std::fs::write(&p, body).unwrap();
    p.to_str().unwrap().to_string()
}

fn summary(dir: &Path) -> serde_json::Map<String, serde_json::Value> {
    let t = std::fs::read_to_string(dir.join("summary.json")).expect("summary.json written");
    serde_json::from_str(&t).expect("summary.json is a JSON object")
}

#[test]
fn overrides_change_the_run_and_are_checked_like_the_file() {
    let d = scratch("set");
    let cfg = config(&d, "tiny.toml", TINY);
    let (a, b) = (d.join("a"), d.join("b"));
    let o = servelab(&["run", &cfg, "--out", a.to_str().unwrap(), "--quiet"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let o = servelab(&[
        "run",
        &cfg,
        "--out",
        b.to_str().unwrap(),
        "--quiet",
        "--set",
        "store.ttl.agent=\"1s\"",
        "--set",
        "workload[0].mix.agent.sessions=8",
    ]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let (sa, sb) = (summary(&a), summary(&b));
    let k = "agent.deepinfer.hit_rate";
    assert!(
        sb[k].as_f64().unwrap() < sa[k].as_f64().unwrap(),
        "a 1 s TTL must lower the hit rate: {} vs {}",
        sb[k],
        sa[k]
    );
    let m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(b.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(
        m["overrides"],
        serde_json::json!(["store.ttl.agent=\"1s\"", "workload[0].mix.agent.sessions=8"])
    );
    // An unknown key names itself, the flag and the valid keys, before any work.
    let c = d.join("c");
    let o = servelab(&[
        "run",
        &cfg,
        "--out",
        c.to_str().unwrap(),
        "--set",
        "store.tll.agent=\"1h\"",
    ]);
    assert!(!o.status.success());
    let e = text(&o.stderr);
    assert!(
        e.contains("--set store.tll.agent")
            && e.contains("unknown field `tll`")
            && e.contains("`ttl`"),
        "{e}"
    );
    // A semantic check names the overridden key.
    let o = servelab(&[
        "run",
        &cfg,
        "--out",
        c.to_str().unwrap(),
        "--set",
        "workload.0.mix.agent.session_rate_per_s=-1.0",
    ]);
    let e = text(&o.stderr);
    assert!(
        !o.status.success()
            && e.contains("workload[0].mix.agent.session_rate_per_s")
            && e.contains("--set workload.0.mix.agent.session_rate_per_s=-1.0"),
        "{e}"
    );
}

#[test]
fn output_folders_are_checked_before_the_work() {
    let d = scratch("out");
    let cfg = config(&d, "tiny.toml", TINY);
    let out = d.join("o");
    let run = |extra: &[&str]| {
        let mut a = vec![
            "run",
            cfg.as_str(),
            "--out",
            out.to_str().unwrap(),
            "--quiet",
        ];
        a.extend_from_slice(extra);
        servelab(&a)
    };
    assert!(run(&[]).status.success());
    std::fs::write(out.join("stale.csv"), "old").unwrap();
    let o = run(&[]);
    assert!(!o.status.success());
    assert!(text(&o.stderr).contains("--force"), "{}", text(&o.stderr));
    let o = run(&["--force"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(
        out.join("stale.csv").exists(),
        "a file servelab did not write is kept"
    );
    // An output folder that cannot be created fails at once, before the simulation.
    let file = d.join("a-file");
    std::fs::write(&file, "x").unwrap();
    let bad = file.join("sub");
    let o = servelab(&["run", &cfg, "--out", bad.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(
        text(&o.stderr).contains("output folder") && !text(&o.stdout).contains("hit rate"),
        "{}",
        text(&o.stderr)
    );
}

#[test]
fn json_prints_summary_json_and_the_manifest_names_the_build() {
    let d = scratch("json");
    let cfg = config(&d, "tiny.toml", TINY);
    // Run from a folder inside another git repository: the manifest must still name the
    // commit servelab was built from.
    let other = d.join("other-repo");
    std::fs::create_dir_all(&other).unwrap();
    let git_ok = Command::new("git")
        .args(["init", "-q"])
        .current_dir(&other)
        .status()
        .is_ok_and(|s| s.success());
    let out = d.join("o");
    let o = servelab_in(
        Some(&other),
        &[
            "run",
            &cfg,
            "--out",
            out.to_str().unwrap(),
            "--json",
            "--quiet",
        ],
    );
    assert!(o.status.success(), "{}", text(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("stdout is JSON only");
    let m = v.as_object().unwrap();
    assert!(m.values().all(|x| x.as_f64().is_some_and(f64::is_finite)));
    assert_eq!(v, serde_json::Value::Object(summary(&out)));
    assert!(
        text(&o.stderr).contains("servelab run"),
        "the report goes to stderr"
    );
    let man: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    let run = &man["run"];
    assert!(run["command_line"].as_str().unwrap().contains("--out"));
    assert!(run["started_at"].as_str().unwrap().ends_with('Z'));
    assert!(run["wall_s"].as_f64().unwrap() >= 0.0);
    assert!(!run["host"]["name"].as_str().unwrap().is_empty());
    let head = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| text(&o.stdout).trim().to_string());
    let commit = man["git_commit"].as_str().unwrap();
    if let (true, Some(head)) = (git_ok, head) {
        // Built from this checkout (a commit made since the build differs: compare shapes).
        assert_eq!(
            commit.split('-').next().unwrap().len(),
            head.len(),
            "{commit}"
        );
        assert_ne!(commit, "unknown");
    }
}

const SWEEP: &str = r#"
[sweep]
seeds = [1, 2]
[sweep.grid]
"store.ttl.agent" = ["1s", "1h", "3d"]
"#;

#[test]
fn a_sweep_tabulates_points_and_seeds_and_resumes() {
    let d = scratch("sweep");
    let cfg = config(&d, "sweep.toml", &format!("{TINY}{SWEEP}"));
    let out = d.join("o");
    let run = || {
        servelab(&[
            "run",
            &cfg,
            "--out",
            out.to_str().unwrap(),
            "--quiet",
            "-j",
            "2",
        ])
    };
    let o = run();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let tidy = std::fs::read_to_string(out.join("sweep.csv")).unwrap();
    let mut lines = tidy.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    assert_eq!(
        &header[..4],
        ["point", "point_id", "store.ttl.agent", "seed"]
    );
    assert!(header.contains(&"agent.deepinfer.hit_rate"));
    assert_eq!(lines.count(), 3 * 2, "one row per point × seed");
    let st = std::fs::read_to_string(out.join("sweep_summary.csv")).unwrap();
    assert!(
        st.lines()
            .next()
            .unwrap()
            .ends_with("metric,n,mean,std,ci95_low,ci95_high")
    );
    let row = st
        .lines()
        .find(|l| l.starts_with("0,1s,agent.deepinfer.hit_rate,"))
        .expect("a row per point and metric");
    let f: Vec<&str> = row.split(',').collect();
    let (mean, lo, hi): (f64, f64, f64) = (
        f[4].parse().unwrap(),
        f[6].parse().unwrap(),
        f[7].parse().unwrap(),
    );
    assert!(f[3] == "2" && lo <= mean && mean <= hi, "{row}");
    for p in [
        "sweep.parquet",
        "sweep_summary.parquet",
        "summary.md",
        "manifest.json",
    ] {
        assert!(out.join(p).exists(), "{p}");
    }
    let plot = out.join("plots").join("agent.deepinfer.hit_rate.svg");
    assert!(
        plot.exists(),
        "the hit rate varies with the TTL, so it is plotted"
    );
    // Again: every point is done, nothing reruns, the table is the same.
    let o = run();
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(
        text(&o.stdout).contains("6 already done"),
        "{}",
        text(&o.stdout)
    );
    assert_eq!(
        std::fs::read_to_string(out.join("sweep.csv")).unwrap(),
        tidy
    );
    // An interrupted point (no point.json) is redone, the others are not.
    let points: Vec<PathBuf> = std::fs::read_dir(out.join("points"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(points.len(), 6);
    std::fs::remove_file(points[0].join("point.json")).unwrap();
    let o = run();
    assert!(
        text(&o.stdout).contains("5 already done"),
        "{}",
        text(&o.stdout)
    );
    assert_eq!(
        std::fs::read_to_string(out.join("sweep.csv")).unwrap(),
        tidy
    );
    // `--json` on a sweep prints its summary.json.
    let o = servelab(&[
        "run",
        &cfg,
        "--out",
        out.to_str().unwrap(),
        "--quiet",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("JSON");
    assert!(
        v.get("agent.deepinfer.hit_rate @ store.ttl.agent=1s")
            .is_some(),
        "{v}"
    );
}

#[test]
fn identical_points_are_flagged() {
    let d = scratch("same");
    // The TINY workload lasts minutes: 1 d and 3 d give the same store.
    let cfg = config(
        &d,
        "s.toml",
        &format!("{TINY}\n[sweep.grid]\n\"store.ttl.agent\" = [\"1s\", \"1d\", \"3d\"]\n"),
    );
    let out = d.join("o");
    let o = servelab(&["run", &cfg, "--out", out.to_str().unwrap(), "--quiet"]);
    assert!(o.status.success(), "{}", text(&o.stderr));
    let e = text(&o.stderr);
    assert!(
        e.contains("`store.ttl.agent` = 1d, 3d give identical results"),
        "{e}"
    );
    let md = std::fs::read_to_string(out.join("summary.md")).unwrap();
    assert!(md.contains("## Warnings"), "{md}");
}

#[test]
fn bad_sweeps_fail_before_any_run() {
    let d = scratch("badsweep");
    let cases = [
        ("[sweep.grid]\n\"store.ttl.agent\" = []\n", "empty axis"),
        ("[sweep]\nseeds = []\n", "zero seeds"),
        (
            "[sweep.grid]\n\"experiment.kind\" = [\"dspark\"]\n",
            "change the experiment kind",
        ),
        (
            "[sweep.grid]\n\"store.ttl.agnt\" = [\"1h\"]\n",
            "unknown field `agnt`",
        ),
        ("[sweep]\nseed = [1]\n", "unknown key `sweep.seed`"),
    ];
    for (i, (sweep, want)) in cases.iter().enumerate() {
        let cfg = config(&d, &format!("b{i}.toml"), &format!("{TINY}{sweep}"));
        let out = d.join(format!("o{i}"));
        let o = servelab(&["run", &cfg, "--out", out.to_str().unwrap(), "--quiet"]);
        let e = text(&o.stderr);
        assert!(!o.status.success() && e.contains(want), "case {i}: {e}");
        assert!(!out.join("points").exists(), "case {i}: nothing ran");
    }
}
