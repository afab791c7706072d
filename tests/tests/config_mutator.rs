//! The config mutator of issue 16 item 3: every shipped experiment config (the GPU conformance
//! ones aside), every numeric field in turn set to 0, 1, −1, the largest TOML integer and 1e300.
//!
//! - `library_validation_never_panics`: each mutated config is loaded into the typed configs of
//!   the libraries (constants, store, SWA, workloads, EPLB, DSpark, economics, service) and
//!   validated; the cheap ones are also built and stepped. Every mutation must end in an error
//!   or a valid value, never a panic, and what is built must give finite numbers.
//! - `shrunk_configs_run_under_caps`: for a shrunk set that runs in a fraction of a second (the
//!   econ sweep as shipped, the EPLB and DSpark experiments with few steps), every mutation is run
//!   through the `servelab` binary under a memory cap (`ulimit -v`) and a time cap: it must exit
//!   with a clean error (status 1, `error: ...`, no panic) or succeed with finite outputs.
//!
//! The binary is the debug `servelab` that `cargo test --workspace` builds beside this test (or
//! `$SERVELAB_BIN`); run alone, `cargo test -p servelab-tests` needs `cargo build -p
//! servelab-experiments` first, and the test says so.

use servelab_core::econ::{self, EconConfig, EconParams};
use servelab_core::eplb::{
    EpGroup, ExpertLoadConfig, ExpertLoadModel, MoeBatch, MoeModel, Phase, PlacementPolicy,
    SkewConfig,
};
use servelab_core::{Nanos, ServingConstants, StoreConfig, SwaConfig};
use servelab_sim::acceptance::{AcceptanceModel, validate_drafts};
use servelab_sim::dspark::DsparkPoint;
use servelab_sim::service::ServiceConfig;
use servelab_workloads::generate::WorkloadConfig;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;
use toml::Value;

const CONFIGS: [&str; 6] = [
    "cache-policy",
    "dspark",
    "econ-sweep",
    "eplb",
    "plan",
    "service",
];

fn configs_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../experiments/configs")
}

fn load(name: &str) -> Value {
    let path = configs_dir().join(format!("{name}.toml"));
    let text = std::fs::read_to_string(&path).unwrap();
    toml::from_str(&text).unwrap()
}

#[derive(Clone, Debug)]
enum Key {
    Name(String),
    Index(usize),
}

fn path_name(path: &[Key]) -> String {
    let mut s = String::new();
    for k in path {
        match k {
            Key::Name(n) if s.is_empty() => s.push_str(n),
            Key::Name(n) => {
                s.push('.');
                s.push_str(n);
            }
            Key::Index(i) => s.push_str(&format!("[{i}]")),
        }
    }
    s
}

/// Every integer or float leaf, by path (the seed in `[experiment]` included).
fn numeric_paths(v: &Value, path: &mut Vec<Key>, out: &mut Vec<Vec<Key>>) {
    match v {
        Value::Integer(_) | Value::Float(_) => out.push(path.clone()),
        Value::Table(t) => {
            for (k, v) in t {
                path.push(Key::Name(k.clone()));
                numeric_paths(v, path, out);
                path.pop();
            }
        }
        Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                path.push(Key::Index(i));
                numeric_paths(v, path, out);
                path.pop();
            }
        }
        _ => {}
    }
}

/// Sets the value at `path`, adding keys a table lacks (an empty `[acceptance]` table takes
/// the defaults, and a shrunk config sets one of them).
fn set(v: &mut Value, path: &[Key], new: Value) {
    let mut cur = v;
    for k in path {
        cur = match k {
            Key::Name(n) => cur
                .as_table_mut()
                .unwrap_or_else(|| panic!("`{n}`'s parent is not a table"))
                .entry(n.as_str())
                .or_insert(Value::Boolean(false)),
            Key::Index(i) => cur.get_mut(*i).unwrap(),
        };
    }
    *cur = new;
}

/// 0, 1, −1, the type's max (TOML integers are i64; a u32 field refuses it as out of range, so
/// u32::MAX is tried too) and a huge float.
fn mutations() -> Vec<(&'static str, Value)> {
    vec![
        ("0", Value::Integer(0)),
        ("1", Value::Integer(1)),
        ("-1", Value::Integer(-1)),
        ("i64::MAX", Value::Integer(i64::MAX)),
        ("u32::MAX", Value::Integer(i64::from(u32::MAX))),
        ("1e300", Value::Float(1e300)),
    ]
}

/// Every mutation of `base`: (description, mutated config).
fn mutated(name: &str, base: &Value) -> Vec<(String, Value)> {
    let mut paths = Vec::new();
    numeric_paths(base, &mut Vec::new(), &mut paths);
    let mut out = Vec::new();
    for p in &paths {
        for (label, v) in mutations() {
            let mut c = base.clone();
            set(&mut c, p, v);
            out.push((format!("{name}: {} = {label}", path_name(p)), c));
        }
    }
    out
}

/// The value at `v` as a typed config, if it deserializes.
macro_rules! typed {
    ($t:ty, $v:expr) => {
        $v.and_then(|v: &Value| v.clone().try_into::<$t>().ok())
    };
}

fn finite(what: &str, x: f64) -> Result<(), String> {
    if x.is_finite() {
        Ok(())
    } else {
        Err(format!("{what} is {x}"))
    }
}

/// Loads and validates what the libraries own; `Err` is a broken promise (a non-finite output).
fn check_library(kind: &str, c: &Value) -> Result<(), String> {
    let constants = typed!(ServingConstants, c.get("constants")).unwrap_or_default();
    let constants_ok = constants.validate().is_ok();
    if let (Some(store), true) = (typed!(StoreConfig, c.get("store")), constants_ok) {
        let _ = store.validate(constants.block_bytes());
    }
    if let Some(swa) = typed!(SwaConfig, c.get("swa")) {
        let _ = swa.validate();
    }
    let mut workloads: Vec<WorkloadConfig> = Vec::new();
    match c.get("workload") {
        Some(Value::Array(ws)) => {
            workloads.extend(
                ws.iter()
                    .filter_map(|w| typed!(WorkloadConfig, w.get("mix"))),
            );
        }
        w => workloads.extend(typed!(WorkloadConfig, w)),
    }
    for w in &workloads {
        let _ = w.validate();
    }
    match kind {
        "service" | "plan" => {
            if let Some(s) = typed!(ServiceConfig, c.get("service")) {
                let _ = s.validate();
            }
        }
        "eplb" => check_eplb(c)?,
        "dspark" => {
            if let Some(p) = typed!(DsparkPoint, c.get("point")) {
                let _ = p.validate();
                let _ = validate_drafts(p.draft_tokens, "point.draft_tokens");
            }
            if let Some(a) = typed!(AcceptanceModel, c.get("acceptance")) {
                let _ = a.validate();
            }
        }
        "econ-sweep" => check_econ(c)?,
        _ => {}
    }
    Ok(())
}

fn check_eplb(c: &Value) -> Result<(), String> {
    let model = typed!(MoeModel, c.get("model")).unwrap_or_default();
    let Some(scenarios) = c.get("scenario").and_then(Value::as_array) else {
        return Ok(());
    };
    for s in scenarios {
        let (Some(phase), Some(ep)) = (typed!(Phase, s.get("phase")), typed!(EpGroup, s.get("ep")))
        else {
            continue;
        };
        let Some(skew) = typed!(SkewConfig, c.get("skew").and_then(|k| k.get(phase.name()))) else {
            continue;
        };
        let tokens = s
            .get("tokens_per_step")
            .and_then(Value::as_integer)
            .unwrap_or(0);
        let sequences = s
            .get("sequences_per_step")
            .and_then(Value::as_integer)
            .unwrap_or(1);
        for p in s
            .get("policy")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let Some(placement) = typed!(PlacementPolicy, p.get("placement")) else {
                continue;
            };
            let cfg = ExpertLoadConfig {
                model: model.clone(),
                phase,
                ep: ep.clone(),
                skew: skew.clone(),
                placement,
            };
            if cfg.validate().is_err() {
                continue;
            }
            // Layers are independent: two of them run the same arithmetic as forty, at a
            // twentieth of the cost.
            let small = ExpertLoadConfig {
                model: MoeModel {
                    layers: model.layers.min(2),
                    ..model.clone()
                },
                ..cfg
            };
            let Ok(mut m) = ExpertLoadModel::new(&small, 1, "mutator") else {
                continue;
            };
            for step in 0..3u64 {
                let out = m.step(
                    Nanos::from_millis(step * 200),
                    MoeBatch {
                        tokens: tokens.clamp(0, 1 << 20) as u64,
                        sequences: sequences.max(1) as u64,
                    },
                );
                finite("EPLB imbalance", out.imbalance)?;
                if out.imbalance < 1.0 - 1e-9 {
                    return Err(format!("EPLB imbalance {} below 1", out.imbalance));
                }
            }
        }
    }
    Ok(())
}

fn check_econ(c: &Value) -> Result<(), String> {
    let Some(e) = typed!(EconConfig, c.get("econ")) else {
        return Ok(());
    };
    let sweep = c.get("sweep");
    let r = sweep.and_then(|s| s.get("output_share"));
    let num = |v: Option<&Value>| v.and_then(|v| v.as_float().or(v.as_integer().map(|i| i as f64)));
    let (start, stop, step) = (
        num(r.and_then(|r| r.get("start"))).unwrap_or(0.0),
        num(r.and_then(|r| r.get("stop"))).unwrap_or(0.25),
        num(r.and_then(|r| r.get("step"))).unwrap_or(0.01),
    );
    let grid = econ::share_grid("output_share", start, stop, step).unwrap_or_default();
    let decode: Vec<f64> = sweep
        .and_then(|s| s.get("decode_tps"))
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(|v| num(Some(v))).collect())
        .unwrap_or_default();
    for d in decode {
        let base = EconParams {
            decode_tps: d,
            ..e.params(0.0)
        };
        if let Ok(x) = econ::crossings(&base) {
            finite("max output share", x.max_output_share)?;
            finite("storage-limited output share", x.storage_limit_output_share)?;
        }
        for &o in grid.iter().step_by(7) {
            if let Ok(est) = econ::evaluate(&EconParams {
                output_share: o,
                ..base
            }) {
                est.check().map_err(|e| e.to_string())?;
                finite("GPUs needed", est.gpus_needed)?;
                finite("revenue", est.revenue_per_day)?;
            }
        }
    }
    Ok(())
}

/// Mutations that break the contract in code other engineers own (the serving unit's
/// validation is being rewritten): reported by the test, not failed on, until they are fixed.
const KNOWN_ELSEWHERE: &[&str] = &[];

#[test]
fn library_validation_never_panics() {
    let mut failures = Vec::new();
    let mut count = 0;
    for name in CONFIGS {
        let base = load(name);
        check_library(name, &base).unwrap_or_else(|e| panic!("{name} as shipped: {e}"));
        for (what, c) in mutated(name, &base) {
            count += 1;
            match std::panic::catch_unwind(|| check_library(name, &c)) {
                Ok(Ok(())) => {}
                _ if KNOWN_ELSEWHERE.contains(&what.as_str()) => {
                    println!("known, owned elsewhere: {what}");
                }
                Ok(Err(e)) => failures.push(format!("{what}: {e}")),
                Err(p) => failures.push(format!(
                    "{what}: panicked: {}",
                    p.downcast_ref::<String>()
                        .map(String::as_str)
                        .or(p.downcast_ref::<&str>().copied())
                        .unwrap_or("?")
                )),
            }
        }
    }
    assert!(count > 500, "only {count} mutations");
    assert!(
        failures.is_empty(),
        "{} of {count} mutations broke the contract:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// A random number for a numeric field: any sign and size, integer or float.
fn any_number() -> impl proptest::strategy::Strategy<Value = Value> {
    use proptest::prelude::*;
    prop_oneof![
        (-4i64..70_000).prop_map(Value::Integer),
        any::<i64>().prop_map(Value::Integer),
        (0u32..64).prop_map(|b| Value::Integer(1i64 << b)),
        prop::num::f64::ANY.prop_map(Value::Float),
        (-1.0f64..2.0).prop_map(Value::Float),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(64),
        failure_persistence: None,
        ..proptest::prelude::ProptestConfig::default()
    })]

    /// Several fields of one shipped config changed at once to random numbers (NaN and
    /// infinities included): the libraries still only ever refuse or accept, never panic.
    #[test]
    fn random_multi_field_mutations_never_panic(kind in proptest::sample::select(CONFIGS.to_vec()),
                                               picks in proptest::collection::vec((proptest::prelude::any::<proptest::sample::Index>(), any_number()), 1..4)) {
        let mut c = load(kind);
        let mut paths = Vec::new();
        numeric_paths(&c, &mut Vec::new(), &mut paths);
        let mut what = Vec::new();
        for (i, v) in picks {
            let p = &paths[i.index(paths.len())];
            what.push(format!("{} = {v}", path_name(p)));
            set(&mut c, p, v);
        }
        let what = format!("{kind}: {}", what.join(", "));
        let known = KNOWN_ELSEWHERE.iter().any(|k| {
            k.strip_prefix(&format!("{kind}: ")).is_some_and(|m| what.contains(m.split(" = ").next().unwrap_or(m)))
        });
        let r = std::panic::catch_unwind(|| check_library(kind, &c));
        proptest::prop_assert!(known || matches!(r, Ok(Ok(()))), "{what}: {:?}", r.map_err(|_| "panicked"));
    }
}

// ---- The binary under caps. ----

/// `$SERVELAB_BIN`, else the debug `servelab` beside this test binary (`target/debug/servelab`).
fn servelab() -> PathBuf {
    if let Some(bin) = std::env::var_os("SERVELAB_BIN") {
        return PathBuf::from(bin);
    }
    let exe = std::env::current_exe().unwrap();
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("servelab"))
        .unwrap();
    assert!(
        bin.is_file(),
        "{} is missing: build it first (`cargo build -p servelab-experiments`; `cargo test \
         --workspace` does)",
        bin.display()
    );
    bin
}

/// A shrunk config that runs in well under a second in the debug build.
fn shrunk(name: &str) -> Value {
    let mut c = load(name);
    let edit = |c: &mut Value, path: &[&str], v: Value| {
        let keys: Vec<Key> = path
            .iter()
            .map(|k| match k.parse::<usize>() {
                Ok(i) => Key::Index(i),
                Err(_) => Key::Name(k.to_string()),
            })
            .collect();
        set(c, &keys, v);
    };
    match name {
        "eplb" => {
            edit(&mut c, &["model", "layers"], Value::Integer(2));
            edit(&mut c, &["model", "experts"], Value::Integer(32));
            edit(&mut c, &["model", "groups"], Value::Integer(4));
            edit(&mut c, &["bin_steps"], Value::Integer(10));
            let scenarios = c["scenario"].as_array().unwrap().len();
            // Keep the first scenario only (prefill EP2: two policies).
            c["scenario"]
                .as_array_mut()
                .unwrap()
                .truncate(1.min(scenarios));
            for (k, v) in [
                ("steps", 60),
                ("warmup_steps", 5),
                ("tokens_per_step", 512),
                ("sequences_per_step", 2),
            ] {
                edit(&mut c, &["scenario", "0", k], Value::Integer(v));
            }
            edit(
                &mut c,
                &["scenario", "0", "policy", "1", "placement", "window_steps"],
                Value::Integer(10),
            );
            edit(
                &mut c,
                &[
                    "scenario",
                    "0",
                    "policy",
                    "1",
                    "placement",
                    "reassign_every_steps",
                ],
                Value::Integer(20),
            );
        }
        "dspark" => {
            edit(
                &mut c,
                &["seqs_per_rank"],
                Value::Array(vec![Value::Integer(2), Value::Integer(4)]),
            );
            edit(
                &mut c,
                &["published", "throughput_change_pct"],
                Value::Array(vec![Value::Float(0.0), Value::Float(0.0)]),
            );
            edit(&mut c, &["point", "ranks"], Value::Integer(2));
            edit(&mut c, &["point", "steps"], Value::Integer(20));
            edit(&mut c, &["point", "warmup_steps"], Value::Integer(2));
            edit(&mut c, &["point", "kv_tokens_max"], Value::Integer(4096));
            edit(&mut c, &["acceptance", "profiles"], Value::Integer(64));
        }
        _ => {}
    }
    c
}

enum Outcome {
    Ok,
    CleanError,
    Broken(String),
}

/// Runs `servelab run` on `config` under the caps and judges the outcome.
fn run_capped(bin: &Path, dir: &Path, config: &Value) -> Outcome {
    std::fs::create_dir_all(dir).unwrap();
    let cfg = dir.join("config.toml");
    std::fs::write(&cfg, toml::to_string(config).unwrap()).unwrap();
    let out = dir.join("out");
    let script = format!(
        "ulimit -v 3000000; exec timeout 60 '{}' run '{}' --out '{}' --quiet",
        bin.display(),
        cfg.display(),
        out.display()
    );
    let r = Command::new("sh").arg("-c").arg(&script).output().unwrap();
    let stderr = String::from_utf8_lossy(&r.stderr).to_string();
    let verdict = match r.status.code() {
        Some(0) => match non_finite_output(&out) {
            None => Outcome::Ok,
            Some(e) => Outcome::Broken(e),
        },
        Some(1) if stderr.starts_with("error: ") && !stderr.contains("panicked") => {
            Outcome::CleanError
        }
        Some(124) => Outcome::Broken("ran past the 60 s cap".into()),
        code => Outcome::Broken(format!(
            "exit {code:?}: {}",
            stderr.lines().take(3).collect::<Vec<_>>().join(" | ")
        )),
    };
    let _ = std::fs::remove_dir_all(dir);
    verdict
}

/// A CSV cell that is not a finite number where a number is written.
fn non_finite_output(out: &Path) -> Option<String> {
    for entry in std::fs::read_dir(out).ok()?.flatten() {
        let p = entry.path();
        if p.extension().is_some_and(|e| e == "csv") {
            let text = std::fs::read_to_string(&p).ok()?;
            for (i, line) in text.lines().enumerate() {
                for cell in line.split(',') {
                    let c = cell.trim().trim_matches('"').to_ascii_lowercase();
                    if ["inf", "-inf", "nan", "infinity", "-infinity"].contains(&c.as_str()) {
                        return Some(format!(
                            "{}:{}: non-finite value `{cell}`",
                            p.file_name()?.to_string_lossy(),
                            i + 1
                        ));
                    }
                }
            }
        }
    }
    None
}

#[test]
fn shrunk_configs_run_under_caps() {
    let bin = servelab();
    let root = std::env::temp_dir().join(format!("servelab-mutator-{}", std::process::id()));
    let mut jobs: Vec<(String, Value)> = Vec::new();
    for name in ["econ-sweep", "eplb", "dspark"] {
        let base = shrunk(name);
        jobs.push((format!("{name} (shrunk, unmutated)"), base.clone()));
        jobs.extend(mutated(name, &base));
    }
    let started = Instant::now();
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get().min(4));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<(usize, Outcome)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|w| {
                let (jobs, next, bin, root) = (&jobs, &next, &bin, &root);
                s.spawn(move || {
                    let mut mine = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some((_, c)) = jobs.get(i) else { break };
                        mine.push((i, run_capped(bin, &root.join(format!("{w}-{i}")), c)));
                    }
                    mine
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
    let _ = std::fs::remove_dir_all(&root);
    let (mut ok, mut clean, mut broken) = (0, 0, Vec::new());
    for (i, o) in results {
        match o {
            Outcome::Ok => ok += 1,
            Outcome::CleanError => clean += 1,
            Outcome::Broken(e) => broken.push(format!("{}: {e}", jobs[i].0)),
        }
    }
    broken.sort();
    println!(
        "{} runs in {:.1} s: {ok} succeeded with finite outputs, {clean} clean errors",
        jobs.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(ok > 0 && clean > 0);
    assert!(
        broken.is_empty(),
        "{} of {} runs broke the contract:\n{}",
        broken.len(),
        jobs.len(),
        broken.join("\n")
    );
}
