//! A run's output folder: tidy tables (CSV and Parquet), plots, a markdown summary, the headline
//! metrics (`summary.json`) and a manifest. Every file but the manifest's `run` section is a pure
//! function of the config, the overrides and the seed (no wall-clock values), so two runs with
//! the same inputs are byte-identical apart from that section; timings go to stdout and there.

use anyhow::{Context, Result, anyhow, bail};
use polars::prelude::*;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

pub struct RunOutput {
    dir: PathBuf,
    files: Vec<String>,
}

impl RunOutput {
    pub fn create(dir: &Path) -> Result<Self> {
        fs::create_dir_all(dir)
            .with_context(|| format!("creating output folder {}", dir.display()))?;
        Ok(RunOutput {
            dir: dir.to_path_buf(),
            files: Vec::new(),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Path for a new file in the run folder, recorded in the manifest.
    pub fn path(&mut self, name: &str) -> PathBuf {
        self.files.push(name.to_string());
        self.dir.join(name)
    }

    /// Writes `name.csv` and `name.parquet`, once every float column is checked (see
    /// [`check_finite`]).
    pub fn write_table(&mut self, name: &str, df: &mut DataFrame) -> Result<()> {
        check_finite(name, df)?;
        let csv = self.path(&format!("{name}.csv"));
        let mut f = File::create(&csv).with_context(|| format!("creating {}", csv.display()))?;
        CsvWriter::new(&mut f)
            .include_header(true)
            .finish(df)
            .map_err(|e| anyhow!("writing {}: {e}", csv.display()))?;
        let pq = self.path(&format!("{name}.parquet"));
        let f = File::create(&pq).with_context(|| format!("creating {}", pq.display()))?;
        ParquetWriter::new(f)
            .finish(df)
            .map_err(|e| anyhow!("writing {}: {e}", pq.display()))?;
        Ok(())
    }

    pub fn write_text(&mut self, name: &str, text: &str) -> Result<()> {
        let p = self.path(name);
        fs::write(&p, text).with_context(|| format!("writing {}", p.display()))
    }

    /// Writes `summary.json`: the run's headline metrics, a flat map of name → finite number.
    pub fn write_summary_json(&mut self, metrics: &BTreeMap<String, f64>) -> Result<()> {
        let text = summary_json(metrics)?;
        self.write_text("summary.json", &text)
    }

    /// Writes `manifest.json` listing every file written so far, with the run's speed figures
    /// (one per simulation it ran; empty for a run that simulates nothing) in its `run`
    /// section, beside the other facts that differ between two runs of the same inputs.
    pub fn write_manifest(&mut self, m: &Manifest, speeds: &[crate::speed::Speed]) -> Result<()> {
        #[derive(Serialize)]
        struct Full<'a> {
            #[serde(flatten)]
            m: &'a Manifest,
            files: &'a [String],
            /// Everything here differs between two runs of the same inputs.
            run: RunRecord,
        }
        let mut run = RunRecord::now();
        run.speed = crate::speed::json(speeds);
        let text = serde_json::to_string_pretty(&Full {
            m,
            files: &self.files,
            run,
        })?;
        let p = self.dir.join("manifest.json");
        fs::write(&p, text + "\n").with_context(|| format!("writing {}", p.display()))
    }
}

/// `summary.json`'s text; every value must be finite.
pub fn summary_json(metrics: &BTreeMap<String, f64>) -> Result<String> {
    if let Some((k, v)) = metrics.iter().find(|(_, v)| !v.is_finite()) {
        bail!("summary.json: metric `{k}` is {v}, not a finite number");
    }
    Ok(serde_json::to_string_pretty(metrics)? + "\n")
}

/// Refuses ±inf in every float column (an error naming the table, column and row), and writes
/// NaN — the simulator's "not applicable", e.g. the TTFT of a rejected request — as a missing
/// value (null in Parquet, an empty CSV cell), so no output file holds a non-finite number.
pub fn check_finite(table: &str, df: &mut DataFrame) -> Result<()> {
    let mut replace = Vec::new();
    for col in df.columns() {
        let s = col.as_materialized_series();
        let values: Vec<Option<f64>> = match s.dtype() {
            DataType::Float64 => s.f64()?.iter().collect(),
            DataType::Float32 => s.f32()?.iter().map(|v| v.map(f64::from)).collect(),
            _ => continue,
        };
        if let Some(row) = values.iter().position(|v| v.is_some_and(f64::is_infinite)) {
            bail!(
                "table `{table}`: column `{}` holds {} at row {row}{}; refusing to write it",
                s.name(),
                values[row].unwrap_or(f64::NAN),
                row_context(df, row)
            );
        }
        if values.iter().any(|v| v.is_some_and(f64::is_nan)) {
            let cleaned: Vec<Option<f64>> = values
                .into_iter()
                .map(|v| v.filter(|x| !x.is_nan()))
                .collect();
            replace.push(Series::new(s.name().clone(), cleaned));
        }
    }
    for s in replace {
        let name = s.name().to_string();
        df.replace(&name, s.into_column())?;
    }
    Ok(())
}

/// ` (class = agent, metric = ttft_ms)`: the row's string columns, to find it.
fn row_context(df: &DataFrame, row: usize) -> String {
    let parts: Vec<String> = df
        .columns()
        .iter()
        .filter(|c| matches!(c.dtype(), DataType::String))
        .take(3)
        .filter_map(|c| {
            let v = c.as_materialized_series().str().ok()?.get(row)?.to_string();
            Some(format!("{} = {v}", c.name()))
        })
        .collect();
    if parts.is_empty() {
        String::new()
    } else {
        format!(" ({})", parts.join(", "))
    }
}

/// What reproduces a run.
#[derive(Clone, Debug, Serialize)]
pub struct Manifest {
    pub experiment: String,
    pub config_path: String,
    /// The config exactly as read.
    pub config: String,
    /// `--set KEY=VALUE` overrides applied on top of it, in order.
    pub overrides: Vec<String>,
    pub seed: u64,
    /// The commit the binary was built from (`-dirty`: with uncommitted changes to tracked
    /// files), embedded at build time; `unknown` for a build outside a git checkout.
    pub git_commit: String,
    pub servelab_version: String,
    pub polars_version: String,
}

impl Manifest {
    pub fn new(experiment: &str, config_path: &Path, config: &str, seed: u64) -> Self {
        Manifest {
            experiment: experiment.to_string(),
            config_path: config_path.display().to_string(),
            config: config.to_string(),
            overrides: run_info().overrides,
            seed,
            git_commit: git_commit().to_string(),
            servelab_version: env!("CARGO_PKG_VERSION").to_string(),
            polars_version: polars::VERSION.to_string(),
        }
    }
}

/// The commit embedded by `build.rs`.
pub fn git_commit() -> &'static str {
    option_env!("SERVELAB_GIT_COMMIT").unwrap_or("unknown")
}

/// The facts of this invocation, recorded in every manifest it writes.
#[derive(Clone)]
pub struct RunInfo {
    pub command_line: Vec<String>,
    pub overrides: Vec<String>,
    pub started: SystemTime,
    pub started_instant: Instant,
}

impl RunInfo {
    fn now(command_line: Vec<String>, overrides: Vec<String>) -> Self {
        RunInfo {
            command_line,
            overrides,
            started: SystemTime::now(),
            started_instant: Instant::now(),
        }
    }
}

static RUN_INFO: OnceLock<RunInfo> = OnceLock::new();

thread_local! {
    /// A run inside a longer-lived process (the Python package, a sweep point run in process)
    /// has facts of its own: set for the duration of that run on its thread.
    static SCOPED_RUN_INFO: std::cell::RefCell<Option<RunInfo>> =
        const { std::cell::RefCell::new(None) };
}

/// Records the overrides of this invocation (once, before any manifest is written).
pub fn set_run_info(overrides: Vec<String>) {
    let _ = RUN_INFO.set(RunInfo::now(std::env::args().collect(), overrides));
}

/// Runs `f` with its own run facts (the command line that reproduces it, its overrides and its
/// start), so that its manifests do not carry those of the process that hosts it.
pub fn with_run_info<R>(
    command_line: Vec<String>,
    overrides: Vec<String>,
    f: impl FnOnce() -> R,
) -> R {
    let previous = SCOPED_RUN_INFO.with(|s| {
        s.borrow_mut()
            .replace(RunInfo::now(command_line, overrides))
    });
    let r = f();
    SCOPED_RUN_INFO.with(|s| *s.borrow_mut() = previous);
    r
}

pub fn run_info() -> RunInfo {
    if let Some(i) = SCOPED_RUN_INFO.with(|s| s.borrow().clone()) {
        return i;
    }
    RUN_INFO
        .get_or_init(|| RunInfo::now(std::env::args().collect(), Vec::new()))
        .clone()
}

/// The manifest's `run` section.
#[derive(Serialize)]
struct RunRecord {
    command_line: String,
    started_at: String,
    wall_s: f64,
    host: Host,
    #[serde(skip_serializing_if = "serde_json::Value::is_null")]
    speed: serde_json::Value,
}

#[derive(Serialize)]
struct Host {
    name: String,
    os: String,
    arch: String,
    cpu: String,
    cpus: usize,
}

impl RunRecord {
    fn now() -> Self {
        let info = run_info();
        RunRecord {
            command_line: shell_line(&info.command_line),
            started_at: utc_timestamp(info.started),
            wall_s: (info.started_instant.elapsed().as_secs_f64() * 1000.0).round() / 1000.0,
            host: Host {
                name: hostname(),
                os: std::env::consts::OS.to_string(),
                arch: std::env::consts::ARCH.to_string(),
                cpu: cpu_model(),
                cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            },
            speed: serde_json::Value::Null,
        }
    }
}

/// Arguments joined for a shell, quoting those that need it.
pub fn shell_line(args: &[String]) -> String {
    args.iter()
        .map(|a| {
            if !a.is_empty()
                && a.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./=:,@+%".contains(c))
            {
                a.clone()
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn hostname() -> String {
    ["/proc/sys/kernel/hostname", "/etc/hostname"]
        .iter()
        .find_map(|p| fs::read_to_string(p).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown".into())
}

fn cpu_model() -> String {
    fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// `2026-12-01T22:16:00Z`.
pub fn utc_timestamp(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Names a run folder's outputs: what a manifest there lists, plus the manifest itself.
fn previous_outputs(dir: &Path) -> Vec<PathBuf> {
    let mut v = Vec::new();
    let m = dir.join("manifest.json");
    if let Ok(text) = fs::read_to_string(&m)
        && let Ok(json) = serde_json::from_str::<serde_json::Value>(&text)
        && let Some(files) = json.get("files").and_then(|f| f.as_array())
    {
        for f in files.iter().filter_map(|f| f.as_str()) {
            // Only plain names inside the folder (or its sub-folders), never `..`.
            let p = Path::new(f);
            if p.components()
                .all(|c| matches!(c, std::path::Component::Normal(_)))
            {
                v.push(dir.join(p));
            }
        }
    }
    for extra in ["manifest.json", "summary.json"] {
        v.push(dir.join(extra));
    }
    v
}

/// Removes what a previous run wrote into `dir` (the files its manifest lists).
pub fn remove_previous_outputs(dir: &Path) -> Result<()> {
    for p in previous_outputs(dir) {
        if p.is_file() {
            fs::remove_file(&p).with_context(|| format!("removing {}", p.display()))?;
        }
    }
    Ok(())
}

/// Creates the output folder and proves it writable before any work starts. A folder that
/// already holds files is refused unless `force`: then the previous run's outputs (the files its
/// manifest lists, and `extra_dirs` such as a sweep's `points/`) are removed first, so no stale
/// file survives; files servelab did not write are left alone.
pub fn prepare_out_dir(dir: &Path, force: bool, extra_dirs: &[&str]) -> Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("creating output folder {}", dir.display()))?;
    let entries: Vec<_> = fs::read_dir(dir)
        .with_context(|| format!("reading output folder {}", dir.display()))?
        .filter_map(|e| e.ok())
        .collect();
    if !entries.is_empty() {
        if !force {
            let holds_results = dir.join("manifest.json").exists();
            bail!(
                "output folder {} already holds {} ({} entries); pass --force to replace them, \
                 or choose another --out",
                dir.display(),
                if holds_results {
                    "the results of an earlier run"
                } else {
                    "files"
                },
                entries.len()
            );
        }
        remove_previous_outputs(dir)?;
        for d in extra_dirs {
            let p = dir.join(d);
            if p.is_dir() {
                fs::remove_dir_all(&p).with_context(|| format!("removing {}", p.display()))?;
            }
        }
    }
    probe_writable(dir)
}

/// Writes and removes a probe file: an unwritable folder fails now, not after the simulation.
pub fn probe_writable(dir: &Path) -> Result<()> {
    let probe = dir.join(format!(".servelab-write-test-{}", std::process::id()));
    fs::write(&probe, b"servelab")
        .with_context(|| format!("output folder {} is not writable", dir.display()))?;
    fs::remove_file(&probe).with_context(|| format!("removing {}", probe.display()))?;
    Ok(())
}

/// Renders rows as a GitHub markdown table.
pub fn markdown_table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut s = String::new();
    s.push_str(&format!("| {} |\n", header.join(" | ")));
    s.push_str(&format!(
        "|{}|\n",
        header.iter().map(|_| "---").collect::<Vec<_>>().join("|")
    ));
    for r in rows {
        s.push_str(&format!("| {} |\n", r.join(" | ")));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_utc_civil_dates() {
        let t = |s: u64| utc_timestamp(UNIX_EPOCH + std::time::Duration::from_secs(s));
        assert_eq!(t(0), "1970-01-01T00:00:00Z");
        assert_eq!(t(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(t(1_796_083_200 + 3_661), "2026-12-01T01:01:01Z");
    }

    #[test]
    fn infinite_values_are_refused_and_nan_is_missing() {
        let mut df = df!("class" => ["a", "b"], "x" => [1.0, f64::INFINITY]).unwrap();
        let e = check_finite("t", &mut df).unwrap_err().to_string();
        assert!(
            e.contains("column `x`") && e.contains("row 1") && e.contains("class = b"),
            "{e}"
        );
        let mut df = df!("x" => [1.0, f64::NAN]).unwrap();
        check_finite("t", &mut df).unwrap();
        assert_eq!(df.column("x").unwrap().null_count(), 1);
        let mut m = BTreeMap::new();
        m.insert("a".to_string(), f64::NAN);
        assert!(summary_json(&m).unwrap_err().to_string().contains("`a`"));
    }

    #[test]
    fn shell_lines_quote_what_needs_it() {
        let a = ["servelab", "run", "a b.toml", "--set", "x=\"y\""].map(String::from);
        assert_eq!(shell_line(&a), "servelab run 'a b.toml' --set 'x=\"y\"'");
    }

    #[test]
    fn a_folder_with_results_is_refused_unless_forced() {
        let d = std::env::temp_dir().join(format!("servelab-out-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        prepare_out_dir(&d, false, &[]).unwrap();
        fs::write(d.join("a.csv"), "x").unwrap();
        fs::write(d.join("mine.txt"), "x").unwrap();
        fs::write(d.join("manifest.json"), r#"{"files": ["a.csv", "../etc"]}"#).unwrap();
        let e = prepare_out_dir(&d, false, &[]).unwrap_err().to_string();
        assert!(e.contains("--force") && e.contains("earlier run"), "{e}");
        prepare_out_dir(&d, true, &[]).unwrap();
        assert!(!d.join("a.csv").exists() && !d.join("manifest.json").exists());
        assert!(
            d.join("mine.txt").exists(),
            "files servelab did not write stay"
        );
        fs::remove_dir_all(&d).unwrap();
    }
}
