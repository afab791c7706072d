//! The part every experiment config shares, and config loading with errors that name the file.

use anyhow::{Context, Result, anyhow};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use std::path::{Path, PathBuf};

/// `[experiment]`: which experiment, its seed and where its outputs go.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExperimentHeader {
    /// `cache-policy`, `eplb`, ...
    pub kind: String,
    /// Names the output folder (`results/<name>`); defaults to the kind.
    #[serde(default)]
    pub name: Option<String>,
    /// The one seed of the run; every subsystem derives its own sub-seed from it.
    #[serde(default = "default_seed")]
    pub seed: u64,
    #[serde(default)]
    pub out_dir: Option<PathBuf>,
    /// Free text: why this experiment and its parameters look the way they do.
    #[serde(default)]
    pub description: Option<String>,
}

fn default_seed() -> u64 {
    42
}

impl ExperimentHeader {
    pub fn out_dir(&self, override_dir: Option<&Path>) -> PathBuf {
        match (override_dir, &self.out_dir) {
            (Some(d), _) => d.to_path_buf(),
            (None, Some(d)) => d.clone(),
            (None, None) => {
                PathBuf::from("results").join(self.name.as_deref().unwrap_or(&self.kind))
            }
        }
    }
}

/// A config file as read, and its parsed header.
pub struct LoadedConfig {
    pub path: PathBuf,
    pub text: String,
    pub header: ExperimentHeader,
}

impl LoadedConfig {
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config {}", path.display()))?;
        #[derive(Deserialize)]
        struct HeaderOnly {
            experiment: ExperimentHeader,
        }
        let value: toml::Table = toml::from_str(&text)
            .map_err(|e| anyhow!("{}: {}", path.display(), e.to_string().trim_end()))?;
        let header = value
            .get("experiment")
            .ok_or_else(|| {
                anyhow!(
                    "{}: missing [experiment] section with `kind`",
                    path.display()
                )
            })?
            .clone();
        let HeaderOnly { experiment } =
            toml::Value::Table([("experiment".to_string(), header)].into_iter().collect())
                .try_into()
                .map_err(|e: toml::de::Error| {
                    anyhow!("{}: {}", path.display(), e.to_string().trim_end())
                })?;
        Ok(LoadedConfig {
            path: path.to_path_buf(),
            text,
            header: experiment,
        })
    }

    /// Parses the whole file into an experiment's typed config (unknown keys are errors).
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T> {
        parse_toml(&self.path, &self.text)
    }
}

/// Parses TOML text into `T`, prefixing errors (which carry line, column and key) with the file.
pub fn parse_toml<T: DeserializeOwned>(path: &Path, text: &str) -> Result<T> {
    toml::from_str(text).map_err(|e| anyhow!("{}: {}", path.display(), e.to_string().trim_end()))
}
