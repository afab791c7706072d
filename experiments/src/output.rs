//! A run's output folder: tidy tables (CSV and Parquet), plots, a markdown summary and a
//! manifest. Everything written here is a pure function of the config and seed (no wall-clock
//! times), so two runs with the same inputs are byte-identical; timings go to stdout only.

use anyhow::{Context, Result};
use polars::prelude::*;
use serde::Serialize;
use std::fs::{self, File};
use std::path::{Path, PathBuf};

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

    /// Writes `name.csv` and `name.parquet`.
    pub fn write_table(&mut self, name: &str, df: &mut DataFrame) -> Result<()> {
        let csv = self.path(&format!("{name}.csv"));
        let mut f = File::create(&csv).with_context(|| format!("creating {}", csv.display()))?;
        CsvWriter::new(&mut f)
            .include_header(true)
            .finish(df)
            .map_err(|e| anyhow::anyhow!("writing {}: {e}", csv.display()))?;
        let pq = self.path(&format!("{name}.parquet"));
        let f = File::create(&pq).with_context(|| format!("creating {}", pq.display()))?;
        ParquetWriter::new(f)
            .finish(df)
            .map_err(|e| anyhow::anyhow!("writing {}: {e}", pq.display()))?;
        Ok(())
    }

    pub fn write_text(&mut self, name: &str, text: &str) -> Result<()> {
        let p = self.path(name);
        fs::write(&p, text).with_context(|| format!("writing {}", p.display()))
    }

    /// Writes `manifest.json` listing every file written so far.
    pub fn write_manifest(&mut self, m: &Manifest) -> Result<()> {
        #[derive(Serialize)]
        struct Full<'a> {
            #[serde(flatten)]
            m: &'a Manifest,
            files: &'a [String],
        }
        let text = serde_json::to_string_pretty(&Full {
            m,
            files: &self.files,
        })?;
        let p = self.dir.join("manifest.json");
        fs::write(&p, text + "\n").with_context(|| format!("writing {}", p.display()))
    }
}

/// What reproduces a run.
#[derive(Clone, Debug, Serialize)]
pub struct Manifest {
    pub experiment: String,
    pub config_path: String,
    /// The config exactly as read.
    pub config: String,
    pub seed: u64,
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
            seed,
            git_commit: git_commit(),
            servelab_version: env!("CARGO_PKG_VERSION").to_string(),
            polars_version: polars::VERSION.to_string(),
        }
    }
}

/// The commit of the working tree, with `-dirty` when it has uncommitted changes; `unknown`
/// outside a git checkout.
pub fn git_commit() -> String {
    let run = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    match run(&["rev-parse", "HEAD"]) {
        Some(c) if !c.is_empty() => {
            let dirty = run(&["status", "--porcelain", "--untracked-files=no"])
                .map(|s| !s.is_empty())
                .unwrap_or(false);
            if dirty { format!("{c}-dirty") } else { c }
        }
        _ => "unknown".to_string(),
    }
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
