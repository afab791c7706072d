//! The `[sweep]` table: a grid over config keys (every combination), a zip (keys that move
//! together, value i of each) and a list of seeds.
//!
//! ```toml
//! [sweep]
//! seeds = [1, 2, 3]
//! [sweep.grid]
//! "store.ttl.agent" = ["1min", "10min", "1h"]
//! "constants.block_tokens" = [64, 128, 256]
//! [sweep.zip]
//! "service.prefill.gpus" = [8, 16]
//! "service.swa.machines" = [4, 6]
//! ```
//!
//! Keys are dotted paths into the config (as with `--set`; `workload[0].mix.agent.sessions`
//! picks one table of an array of tables); an unquoted dotted key (`store.ttl.agent = [...]`)
//! means the same. Each value is a TOML value, written as it would be in the file.

use crate::config::{LoadedConfig, Override, canonical_key};
use anyhow::{Result, anyhow, bail};
use toml::Spanned;
use toml::de::{DeTable, DeValue};

/// A value of an axis, typed for its table column.
#[derive(Clone, Debug, PartialEq)]
pub enum Val {
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    /// Arrays and tables: their TOML text.
    Other(String),
}

#[derive(Clone, Debug)]
pub struct AxisValue {
    /// The value as written (TOML), passed to the point as `--set KEY=<toml>`.
    pub toml: String,
    /// Short label for tables and plots.
    pub label: String,
    pub val: Val,
}

#[derive(Clone, Debug)]
pub struct Axis {
    /// Canonical dotted path (`workload[0].mix.agent.sessions`).
    pub key: String,
    pub values: Vec<AxisValue>,
}

impl Axis {
    /// Every value a number (or a duration with a unit): the axis can be an x axis.
    pub fn numeric(&self) -> Option<Vec<f64>> {
        self.values
            .iter()
            .map(|v| match &v.val {
                Val::Int(i) => Some(*i as f64),
                Val::Float(f) => Some(*f),
                Val::Str(s) => duration_s(s),
                _ => None,
            })
            .collect()
    }
}

/// A duration written with a unit, in seconds (`"10min"` → 600).
fn duration_s(s: &str) -> Option<f64> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
    let (num, unit) = t.split_at(split);
    let x: f64 = num.parse().ok()?;
    let f = match unit.trim() {
        "ns" => 1e-9,
        "us" | "µs" => 1e-6,
        "ms" => 1e-3,
        "s" | "sec" | "secs" => 1.0,
        "min" | "mins" => 60.0,
        "h" | "hours" => 3600.0,
        "d" | "days" => 86_400.0,
        _ => return None,
    };
    Some(x * f)
}

/// One dimension of the grid: one axis, or the zip group (its axes move together).
#[derive(Clone, Debug)]
pub struct Dim {
    pub axes: Vec<Axis>,
}

impl Dim {
    pub fn n_values(&self) -> usize {
        self.axes[0].values.len()
    }

    pub fn name(&self) -> String {
        self.axes
            .iter()
            .map(|a| a.key.as_str())
            .collect::<Vec<_>>()
            .join(" + ")
    }

    pub fn label(&self, i: usize) -> String {
        self.axes
            .iter()
            .map(|a| a.values[i].label.as_str())
            .collect::<Vec<_>>()
            .join(" + ")
    }
}

#[derive(Clone, Debug)]
pub struct Spec {
    /// Grid axes in file order, then the zip group as one dimension.
    pub dims: Vec<Dim>,
    pub seeds: Vec<u64>,
    /// Metrics to plot (default: every metric that varies, up to a dozen).
    pub metrics: Option<Vec<String>>,
}

/// One point of the grid: the index of its value in every dimension.
#[derive(Clone, Debug)]
pub struct Point {
    pub coords: Vec<usize>,
    pub overrides: Vec<Override>,
}

impl Spec {
    #[allow(dead_code)]
    pub fn axes(&self) -> impl Iterator<Item = &Axis> {
        self.dims.iter().flat_map(|d| d.axes.iter())
    }

    /// Every combination, the last dimension fastest.
    pub fn points(&self) -> Vec<Point> {
        let sizes: Vec<usize> = self.dims.iter().map(Dim::n_values).collect();
        let total: usize = sizes.iter().product();
        (0..total)
            .map(|mut i| {
                let mut coords = vec![0; sizes.len()];
                for d in (0..sizes.len()).rev() {
                    coords[d] = i % sizes[d];
                    i /= sizes[d];
                }
                let overrides = self
                    .dims
                    .iter()
                    .zip(&coords)
                    .flat_map(|(dim, &c)| {
                        dim.axes.iter().map(move |a| Override {
                            key: a.key.clone(),
                            value: a.values[c].toml.clone(),
                        })
                    })
                    .collect();
                Point { coords, overrides }
            })
            .collect()
    }

    /// `key=label, key=label`: names a point in messages.
    pub fn point_label(&self, p: &Point) -> String {
        self.dims
            .iter()
            .zip(&p.coords)
            .flat_map(|(d, &c)| {
                d.axes
                    .iter()
                    .map(move |a| format!("{}={}", a.key, a.values[c].label))
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The sweep of a config, or None when it has none.
pub fn parse(cfg: &LoadedConfig) -> Result<Option<Spec>> {
    let path = cfg.path.display().to_string();
    cfg.with_sweep_table(|t, src| {
        let mut r = SweepReader {
            cfg,
            path: path.clone(),
            src,
            seen: Vec::new(),
        };
        let mut dims = Vec::new();
        for a in r.axes(t, "grid")? {
            dims.push(Dim { axes: vec![a] });
        }
        let zip = r.axes(t, "zip")?;
        if let Some(first) = zip.first() {
            if let Some(bad) = zip.iter().find(|a| a.values.len() != first.values.len()) {
                bail!(
                    "{path}: sweep.zip: `{}` has {} values but `{}` has {}: zipped keys move \
                     together and need the same number",
                    first.key,
                    first.values.len(),
                    bad.key,
                    bad.values.len()
                );
            }
            dims.push(Dim { axes: zip });
        }
        let seeds = r.seeds(t)?;
        let metrics = r.metrics(t)?;
        if let (true, Some(v)) = (dims.is_empty(), t.get("grid").or(t.get("zip"))) {
            bail!(
                "{path}: the sweep's grid{} has no axis: list key = [values]",
                r.at(&v.span())
            );
        }
        if dims.is_empty() && !t.contains_key("seeds") {
            bail!("{path}: [sweep] has neither `grid`, `zip` nor `seeds`: nothing to sweep");
        }
        Ok(Spec {
            dims,
            seeds,
            metrics,
        })
    })
}

/// Reads the parts of one `[sweep]` table, remembering the keys already swept so that a key
/// swept twice (in `grid` and `zip`, or twice in one) is refused.
struct SweepReader<'a> {
    cfg: &'a LoadedConfig,
    path: String,
    /// The config's source text, for values as written.
    src: &'a str,
    seen: Vec<String>,
}

impl SweepReader<'_> {
    /// ` (line N)` or ` (--set …)` for a span of the document.
    fn at(&self, s: &std::ops::Range<usize>) -> String {
        self.cfg.describe_span(s)
    }

    /// The axes of `sweep.<name>` (`grid` or `zip`), in file order; none when it is absent.
    fn axes(&mut self, t: &DeTable<'_>, name: &str) -> Result<Vec<Axis>> {
        let path = &self.path;
        let Some(v) = t.get(name) else {
            return Ok(Vec::new());
        };
        let DeValue::Table(tab) = v.get_ref() else {
            bail!(
                "{path}: `sweep.{name}`{} must be a table of key = [values]",
                self.at(&v.span())
            );
        };
        let mut found = Vec::new();
        flatten("", tab, &mut found);
        let mut axes = Vec::new();
        for (written, kspan, val) in found {
            axes.push(self.axis(name, &written, &kspan, val)?);
        }
        Ok(axes)
    }

    /// One axis, `written` as the key is in the file: its key checked and not swept before,
    /// its values a non-empty list without repeats.
    fn axis(
        &mut self,
        name: &str,
        written: &str,
        kspan: &std::ops::Range<usize>,
        val: &Spanned<DeValue<'_>>,
    ) -> Result<Axis> {
        let path = &self.path;
        let where_ = self.at(kspan);
        let key = canonical_key(written)
            .map_err(|e| anyhow!("{path}: sweep.{name}.\"{written}\"{where_}: {e}"))?;
        check_key(&key, &self.cfg.header.kind)
            .map_err(|e| anyhow!("{path}: sweep.{name}.\"{written}\"{where_}: {e}"))?;
        if self.seen.contains(&key) {
            bail!("{path}: `{key}`{where_} is swept twice");
        }
        self.seen.push(key.clone());
        let DeValue::Array(items) = val.get_ref() else {
            bail!(
                "{path}: sweep.{name}.\"{written}\"{where_}: expected a list of values, \
                 found a single value (write [value, ...])"
            );
        };
        if items.is_empty() {
            bail!(
                "{path}: sweep.{name}.\"{written}\"{where_} is an empty axis: list at \
                 least one value"
            );
        }
        let mut values: Vec<AxisValue> = Vec::new();
        for it in items.iter() {
            let av = axis_value(it, self.src);
            if values.iter().any(|v| same_value(v, &av)) {
                bail!(
                    "{path}: sweep.{name}.\"{written}\"{where_} lists {} twice",
                    av.toml
                );
            }
            values.push(av);
        }
        relabel(&mut values);
        Ok(Axis { key, values })
    }

    /// `sweep.seeds`: distinct non-negative integers; the config's seed when absent.
    fn seeds(&self, t: &DeTable<'_>) -> Result<Vec<u64>> {
        let (path, src) = (&self.path, self.src);
        let Some(v) = t.get("seeds") else {
            return Ok(vec![self.cfg.header.seed]);
        };
        let where_ = self.at(&v.span());
        let DeValue::Array(items) = v.get_ref() else {
            bail!("{path}: `sweep.seeds`{where_} must be a list of seeds, e.g. [1, 2, 3]");
        };
        if items.is_empty() {
            bail!(
                "{path}: `sweep.seeds`{where_} lists zero seeds: give at least one \
                 (or leave it out to use the config's seed)"
            );
        }
        let mut seeds: Vec<u64> = Vec::new();
        for it in items.iter() {
            let s = match it.get_ref() {
                DeValue::Integer(i) => u64::from_str_radix(i.as_str(), i.radix()).ok(),
                _ => None,
            }
            .ok_or_else(|| {
                anyhow!(
                    "{path}: `sweep.seeds`{}: `{}` is not a seed (a non-negative integer)",
                    self.at(&it.span()),
                    &src[it.span()]
                )
            })?;
            if seeds.contains(&s) {
                bail!("{path}: `sweep.seeds`{where_} lists seed {s} twice");
            }
            seeds.push(s);
        }
        Ok(seeds)
    }

    /// `sweep.metrics`: the metric names to plot, when given.
    fn metrics(&self, t: &DeTable<'_>) -> Result<Option<Vec<String>>> {
        let path = &self.path;
        let Some(v) = t.get("metrics") else {
            return Ok(None);
        };
        let where_ = self.at(&v.span());
        let DeValue::Array(items) = v.get_ref() else {
            bail!("{path}: `sweep.metrics`{where_} must be a list of metric names");
        };
        let names: Option<Vec<String>> = items
            .iter()
            .map(|i| match i.get_ref() {
                DeValue::String(s) => Some(s.to_string()),
                _ => None,
            })
            .collect();
        Ok(Some(names.ok_or_else(|| {
            anyhow!("{path}: `sweep.metrics`{where_} must be a list of metric names")
        })?))
    }
}

/// Refuses keys that are not parameters of the experiment.
fn check_key(key: &str, kind: &str) -> Result<()> {
    let first = key.split(['.', '[']).next().unwrap_or("");
    if first == "experiment" {
        if key == "experiment" || key == "experiment.kind" {
            bail!(
                "sweeping `{key}` would change the experiment kind (`{kind}`): a sweep runs one \
                 kind; write one config per kind"
            );
        }
        if key == "experiment.seed" {
            bail!("seeds are swept with `sweep.seeds = [...]`, not as a key");
        }
        bail!("`{key}` names the run, it is not a parameter of the experiment");
    }
    if first == "sweep"
        && (kind != "econ-sweep"
            || crate::config::SWEEP_KEYS
                .iter()
                .any(|k| key.starts_with(&format!("sweep.{k}"))))
    {
        bail!("a sweep cannot sweep its own keys (`{key}`)");
    }
    Ok(())
}

/// Leaves of the grid table, in file order: tables are walked (an unquoted dotted key is a
/// nested table), and an array is an axis.
fn flatten<'a>(
    prefix: &str,
    t: &'a DeTable<'a>,
    out: &mut Vec<(String, std::ops::Range<usize>, &'a Spanned<DeValue<'a>>)>,
) {
    let mut entries: Vec<_> = t.iter().collect();
    entries.sort_by_key(|(k, _)| k.span().start);
    for (k, v) in entries {
        let name = if prefix.is_empty() {
            k.get_ref().to_string()
        } else {
            format!("{prefix}.{}", k.get_ref())
        };
        match v.get_ref() {
            DeValue::Table(sub) => flatten(&name, sub, out),
            _ => out.push((name, k.span(), v)),
        }
    }
}

fn axis_value(v: &Spanned<DeValue<'_>>, src: &str) -> AxisValue {
    let raw = src[v.span()].trim().to_string();
    let compact = raw.split_whitespace().collect::<Vec<_>>().join(" ");
    let (val, label) = match v.get_ref() {
        DeValue::Integer(i) => match i64::from_str_radix(i.as_str(), i.radix()) {
            Ok(x) => (Val::Int(x), raw.clone()),
            Err(_) => (Val::Other(raw.clone()), raw.clone()),
        },
        DeValue::Float(_) => match raw.replace('_', "").parse::<f64>() {
            Ok(x) => (Val::Float(x), raw.clone()),
            Err(_) => (Val::Other(raw.clone()), raw.clone()),
        },
        DeValue::Boolean(b) => (Val::Bool(*b), raw.clone()),
        DeValue::String(s) => (Val::Str(s.to_string()), s.to_string()),
        DeValue::Table(t) => {
            let tag = ["kind", "policy", "name"]
                .iter()
                .find_map(|k| match t.get(*k) {
                    Some(v) => match v.get_ref() {
                        DeValue::String(s) => Some(s.to_string()),
                        _ => None,
                    },
                    None => None,
                });
            (Val::Other(compact.clone()), tag.unwrap_or(compact.clone()))
        }
        _ => (Val::Other(compact.clone()), compact.clone()),
    };
    AxisValue {
        toml: raw,
        label,
        val,
    }
}

fn same_value(a: &AxisValue, b: &AxisValue) -> bool {
    match (&a.val, &b.val) {
        (Val::Other(x), Val::Other(y)) => {
            x.split_whitespace().collect::<String>() == y.split_whitespace().collect::<String>()
        }
        (x, y) => x == y,
    }
}

/// Short labels (a table's `kind`) only when they tell the values apart.
fn relabel(values: &mut [AxisValue]) {
    let labels: Vec<&String> = values.iter().map(|v| &v.label).collect();
    let unique = labels
        .iter()
        .enumerate()
        .all(|(i, l)| !labels[..i].contains(l));
    if !unique {
        for v in values.iter_mut() {
            v.label = v.toml.split_whitespace().collect::<Vec<_>>().join(" ");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn spec(sweep: &str) -> Result<Option<Spec>> {
        let text = format!("[experiment]\nkind = \"cache-policy\"\nseed = 9\n\n{sweep}");
        let cfg = LoadedConfig::from_text(Path::new("s.toml"), text, Vec::new())?;
        parse(&cfg)
    }

    #[test]
    fn grid_zip_and_seeds_give_every_point() {
        let s = spec(
            r#"[sweep]
seeds = [1, 2]
[sweep.grid]
"store.ttl.agent" = ["1min", "1h"]
constants.block_tokens = [64, 128, 256]
[sweep.zip]
"swa.machines" = [4, 8]
"swa.lifetime" = ["1min", "3min"]
"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!(s.seeds, vec![1, 2]);
        assert_eq!(s.dims.len(), 3);
        assert_eq!(s.dims[0].axes[0].key, "store.ttl.agent");
        assert_eq!(s.dims[1].axes[0].key, "constants.block_tokens");
        assert_eq!(s.dims[2].name(), "swa.machines + swa.lifetime");
        let pts = s.points();
        assert_eq!(pts.len(), 2 * 3 * 2);
        assert_eq!(
            s.point_label(&pts[1]),
            "store.ttl.agent=1min, constants.block_tokens=64, swa.machines=8, swa.lifetime=3min"
        );
        assert_eq!(pts[1].overrides[0].value, "\"1min\"");
        assert_eq!(
            s.dims[0].axes[0].numeric(),
            Some(vec![60.0, 3600.0]),
            "durations are numeric axes"
        );
    }

    #[test]
    fn seeds_alone_default_and_labels() {
        let s = spec("[sweep]\nseeds = [3, 4, 5]\n").unwrap().unwrap();
        assert!(s.dims.is_empty());
        assert_eq!(s.points().len(), 1, "one point, three seeds");
        let s = spec("[sweep.grid]\n\"service.prefill.lb\" = [{ kind = \"tiered\" }, { kind = \"round-robin\" }]\n")
            .unwrap()
            .unwrap();
        assert_eq!(s.seeds, vec![9], "the config's seed");
        let labels: Vec<&str> = s.dims[0].axes[0]
            .values
            .iter()
            .map(|v| v.label.as_str())
            .collect();
        assert_eq!(labels, ["tiered", "round-robin"]);
        assert!(spec("").unwrap().is_none());
    }

    #[test]
    fn bad_sweeps_are_clear_errors() {
        let err = |s: &str| spec(s).unwrap_err().to_string();
        let e = err("[sweep.grid]\n\"store.ttl.agent\" = []\n");
        assert!(e.contains("empty axis") && e.contains("line 6"), "{e}");
        let e = err("[sweep]\nseeds = []\n");
        assert!(e.contains("zero seeds") && e.contains("line 6"), "{e}");
        let e = err("[sweep.grid]\n\"experiment.kind\" = [\"dspark\"]\n");
        assert!(e.contains("change the experiment kind"), "{e}");
        let e = err("[sweep.grid]\n\"experiment.seed\" = [1]\n");
        assert!(e.contains("sweep.seeds"), "{e}");
        let e = err("[sweep.zip]\na = [1, 2]\nb = [1]\n");
        assert!(e.contains("same number"), "{e}");
        let e = err("[sweep.grid]\na = [1, 1]\n");
        assert!(e.contains("twice"), "{e}");
        let e = err("[sweep.grid]\na = 1\n");
        assert!(e.contains("list of values"), "{e}");
        let e = err("[sweep]\nseeds = [-1]\n");
        assert!(e.contains("not a seed"), "{e}");
        assert!(
            spec("[sweep]\ngird = 1\n").unwrap().is_none(),
            "not the runner's key: the experiment's parse refuses it"
        );
    }
}
