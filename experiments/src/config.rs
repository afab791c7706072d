//! The part every experiment config shares, and config loading: `--set` overrides applied to the
//! parsed document before typed deserialisation, and errors that name the file, the key as
//! written and its line (for the deserialiser's errors and for the semantic checks of
//! `validate()` alike).
//!
//! The document is parsed once with spans (`toml::de::DeTable`). Overrides are parsed as TOML
//! values and grafted into it; their spans point past the end of the file into a synthetic
//! `--set KEY=VALUE` line per override, so an error in an overridden value names the flag
//! instead of a line of the file. Every key's location is indexed by its dotted path
//! (`workload[1].mix.chat.turns`), and a `validate()` error (`invalid `field`: reason`) is mapped
//! back to the key in the file whose path ends with the field's components.

use anyhow::{Context, Result, anyhow, bail};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use toml::Spanned;
use toml::de::{DeTable, DeValue};

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

/// Keys of `[sweep]` that belong to the sweep runner (`servelab run` on a config with a sweep);
/// they are removed from the document before an experiment parses it.
pub const SWEEP_KEYS: &[&str] = &["grid", "zip", "seeds", "metrics"];

/// Experiment kinds whose own config has a `[sweep]` table (its other keys stay theirs).
const KINDS_OWNING_SWEEP: &[&str] = &["econ-sweep"];

/// One `--set KEY=VALUE`: a dotted key path and a TOML value (as text).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Override {
    pub key: String,
    pub value: String,
}

impl Override {
    /// Parses `KEY=VALUE`.
    pub fn parse(s: &str) -> Result<Self> {
        let (k, v) = s.split_once('=').ok_or_else(|| {
            anyhow!("--set {s}: expected KEY=VALUE (a dotted key and a TOML value)")
        })?;
        let key = k.trim().to_string();
        let value = v.trim().to_string();
        key_segments(&key).map_err(|e| anyhow!("--set {s}: {e}"))?;
        if value.is_empty() {
            bail!("--set {s}: the value is empty");
        }
        Ok(Override { key, value })
    }
}

impl fmt::Display for Override {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.key, self.value)
    }
}

/// One component of a key path: a table key or an index into an array of tables.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Seg {
    Key(String),
    Index(usize),
}

/// `a.b[2].c`, `a.b.2.c` and `a."x.y".c` all split into their components.
pub fn key_segments(key: &str) -> Result<Vec<Seg>> {
    let mut segs = Vec::new();
    let mut chars = key.chars().peekable();
    let mut cur = String::new();
    let mut quoted = false;
    let mut after_index = false;
    while let Some(c) = chars.next() {
        match c {
            '"' if cur.is_empty() && !after_index => {
                quoted = take_quoted(&mut chars, &mut cur);
                if !quoted {
                    bail!("key `{key}` has an unterminated quote");
                }
            }
            '.' => {
                if after_index {
                    after_index = false;
                } else {
                    push_component(key, &mut cur, &mut segs, quoted)?;
                }
                quoted = false;
            }
            '[' => {
                if !after_index {
                    push_component(key, &mut cur, &mut segs, quoted)?;
                }
                quoted = false;
                segs.push(Seg::Index(take_index(key, &mut chars)?));
                after_index = true;
            }
            c if after_index => bail!("key `{key}`: expected `.` after `]`, found `{c}`"),
            c if c.is_whitespace() => bail!("key `{key}` contains a space (quote the component)"),
            c => cur.push(c),
        }
    }
    if !after_index {
        push_component(key, &mut cur, &mut segs, quoted)?;
    }
    if matches!(segs.first(), Some(Seg::Index(_))) {
        bail!("key `{key}` starts with an index");
    }
    Ok(segs)
}

/// Ends the component `cur` of `key`: an index when it is all digits and was not quoted, else
/// a key; only a quoted component may be empty.
fn push_component(
    key: &str,
    cur: &mut String,
    segs: &mut Vec<Seg>,
    was_quoted: bool,
) -> Result<()> {
    if cur.is_empty() && !was_quoted {
        bail!("key `{key}` has an empty component");
    }
    let s = std::mem::take(cur);
    if !was_quoted && s.bytes().all(|b| b.is_ascii_digit()) {
        segs.push(Seg::Index(
            s.parse().map_err(|_| anyhow!("index {s} too large"))?,
        ));
    } else {
        segs.push(Seg::Key(s));
    }
    Ok(())
}

/// Reads a quoted component after its opening quote into `cur`; whether the quote was closed.
fn take_quoted(chars: &mut impl Iterator<Item = char>, cur: &mut String) -> bool {
    for c in chars.by_ref() {
        if c == '"' {
            return true;
        }
        cur.push(c);
    }
    false
}

/// Reads `n]` after a `[` of `key`: the index.
fn take_index(key: &str, chars: &mut impl Iterator<Item = char>) -> Result<usize> {
    let mut n = String::new();
    for c in chars.by_ref() {
        if c == ']' {
            break;
        }
        n.push(c);
    }
    n.trim()
        .parse()
        .map_err(|_| anyhow!("key `{key}`: `[{n}]` is not an index"))
}

fn seg_path(prefix: &str, seg: &Seg) -> String {
    match seg {
        Seg::Key(k) if prefix.is_empty() => k.clone(),
        Seg::Key(k) => format!("{prefix}.{k}"),
        Seg::Index(i) => format!("{prefix}[{i}]"),
    }
}

/// The canonical spelling of a key path (`workload.1.mix` → `workload[1].mix`).
pub fn canonical_key(key: &str) -> Result<String> {
    Ok(key_segments(key)?
        .iter()
        .fold(String::new(), |p, s| seg_path(&p, s)))
}

/// Where a key of the effective document comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// The config file, 1-based line.
    Line(usize),
    /// The n-th `--set` override.
    Override(usize),
}

/// Returned by [`LoadedConfig::parse`] in check-only mode once the typed config parsed: the
/// caller stops there (no simulation) and treats it as success.
#[derive(Debug)]
pub struct ParsedOnly;

impl fmt::Display for ParsedOnly {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("config parsed (check only)")
    }
}

impl std::error::Error for ParsedOnly {}

/// A config file as read, the overrides applied to it, and its parsed header.
pub struct LoadedConfig {
    pub path: PathBuf,
    /// The file exactly as read.
    pub text: String,
    /// `--set` overrides, in order (a later one wins).
    pub overrides: Vec<Override>,
    pub header: ExperimentHeader,
    /// `parse` stops after the typed config parsed (see [`ParsedOnly`]).
    pub check_only: bool,
    /// The file, then one `--set KEY=VALUE` line per override: spans of the effective document
    /// index this text.
    source: String,
    /// Byte range of each override's value inside `source`.
    value_spans: Vec<Range<usize>>,
    /// Byte range of each override's `--set KEY=VALUE` line inside `source`.
    line_spans: Vec<Range<usize>>,
    /// Every key of the effective document by its dotted path.
    keys: BTreeMap<String, Origin>,
}

impl LoadedConfig {
    pub fn load(path: &Path) -> Result<Self> {
        Self::load_with(path, Vec::new())
    }

    /// Reads the file and applies the overrides; errors name the file, line and key.
    pub fn load_with(path: &Path, overrides: Vec<Override>) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("reading config {}", path.display()))?;
        Self::from_text(path, text, overrides)
    }

    pub fn from_text(path: &Path, text: String, overrides: Vec<Override>) -> Result<Self> {
        let mut source = text.clone();
        let mut value_spans = Vec::new();
        let mut line_spans = Vec::new();
        for o in &overrides {
            source.push('\n');
            let line_start = source.len();
            source.push_str("--set ");
            source.push_str(&o.key);
            source.push('=');
            let start = source.len();
            source.push_str(&o.value);
            value_spans.push(start..source.len());
            line_spans.push(line_start..source.len());
        }
        let mut cfg = LoadedConfig {
            path: path.to_path_buf(),
            text,
            overrides,
            header: ExperimentHeader {
                kind: String::new(),
                name: None,
                seed: default_seed(),
                out_dir: None,
                description: None,
            },
            check_only: false,
            source,
            value_spans,
            line_spans,
            keys: BTreeMap::new(),
        };
        let doc = cfg.document(false)?;
        let mut keys = BTreeMap::new();
        cfg.index_table(doc.get_ref(), "", &mut keys);
        if !doc.get_ref().contains_key("experiment") {
            bail!(
                "{}: missing [experiment] section with `kind`",
                path.display()
            );
        }
        #[derive(Deserialize)]
        struct HeaderOnly {
            experiment: ExperimentHeader,
        }
        let HeaderOnly { experiment } = cfg.deserialize_doc(doc)?;
        cfg.keys = keys;
        cfg.header = experiment;
        Ok(cfg)
    }

    /// The seed-independent identity of the effective config: the file and its overrides.
    #[allow(dead_code)]
    pub fn fingerprint_text(&self) -> String {
        let mut s = self.text.clone();
        for o in &self.overrides {
            s.push_str(&format!("\n--set {o}"));
        }
        s
    }

    /// The effective document: the file with the overrides grafted in. With `strip_sweep`, the
    /// sweep runner's keys of `[sweep]` are removed (and `[sweep]` itself when nothing is left).
    fn document(&self, strip_sweep: bool) -> Result<Spanned<DeTable<'_>>> {
        let file = &self.source[..self.text.len()];
        let mut doc = DeTable::parse(file).map_err(|mut e| {
            e.set_input(Some(file));
            anyhow!("{}: {}", self.path.display(), e.to_string().trim_end())
        })?;
        for (i, o) in self.overrides.iter().enumerate() {
            let span = self.value_spans[i].clone();
            let value = self.parse_value(i, span.clone())?;
            let key_span = self.line_spans[i].start + "--set ".len()..span.start - 1;
            let segs = key_segments(&o.key)?;
            set_path(doc.get_mut(), &segs, value, key_span)
                .map_err(|e| anyhow!("{}: --set {o}: {e}", self.path.display()))?;
        }
        if strip_sweep {
            let owns = KINDS_OWNING_SWEEP.contains(&self.header.kind.as_str());
            let root = doc.get_mut();
            let mut drop_sweep = false;
            if let Some(sweep) = root.get_mut("sweep")
                && let DeValue::Table(t) = sweep.get_mut()
            {
                for k in SWEEP_KEYS {
                    t.remove(*k);
                }
                if !owns && let Some((k, _)) = t.iter().next() {
                    bail!(
                        "{}: unknown key `sweep.{}`{} (the keys of [sweep] are {})",
                        self.path.display(),
                        k.get_ref(),
                        self.describe_span(&k.span()),
                        SWEEP_KEYS.join(", ")
                    );
                }
                drop_sweep = t.is_empty();
            }
            if drop_sweep {
                root.remove("sweep");
            }
        }
        Ok(doc)
    }

    /// The override's value as a TOML value; a bare word (`least-loaded`, `1h`) that is not
    /// valid TOML is taken as a string.
    fn parse_value(&self, i: usize, span: Range<usize>) -> Result<Spanned<DeValue<'_>>> {
        let raw = &self.source[span.clone()];
        match DeValue::parse(raw) {
            Ok(v) => Ok(shift(v, span.start)),
            Err(e) => {
                let bare = raw
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "_-.:+/".contains(c));
                if bare {
                    Ok(Spanned::new(span, DeValue::String(raw.into())))
                } else {
                    bail!(
                        "{}: --set {}: `{raw}` is not a TOML value: {}",
                        self.path.display(),
                        self.overrides[i],
                        e.message().trim_end()
                    )
                }
            }
        }
    }

    fn deserialize_doc<T: DeserializeOwned>(&self, doc: Spanned<DeTable<'_>>) -> Result<T> {
        T::deserialize(toml::de::Deserializer::from(doc)).map_err(|e| self.de_error(e))
    }

    /// Renders a deserialisation error: the file's line, or the `--set` flag it came from.
    fn de_error(&self, mut e: toml::de::Error) -> anyhow::Error {
        if let Some(span) = e.span()
            && let Some(i) = self.override_at(span.start)
        {
            return anyhow!(
                "{}: --set {}: {}",
                self.path.display(),
                self.overrides[i],
                e.message().trim_end()
            );
        }
        e.set_input(Some(&self.text));
        anyhow!("{}: {}", self.path.display(), e.to_string().trim_end())
    }

    /// The override whose `--set` line holds byte `pos` of `source`, if any.
    fn override_at(&self, pos: usize) -> Option<usize> {
        self.line_spans
            .iter()
            .position(|r| r.start <= pos && pos <= r.end)
    }

    fn origin_of(&self, span: &Range<usize>) -> Origin {
        if let Some(i) = self.override_at(span.start) {
            Origin::Override(i)
        } else {
            let at = span.start.min(self.text.len());
            Origin::Line(1 + self.text[..at].matches('\n').count())
        }
    }

    fn index_table(&self, t: &DeTable<'_>, prefix: &str, keys: &mut BTreeMap<String, Origin>) {
        for (k, v) in t.iter() {
            let path = seg_path(prefix, &Seg::Key(k.get_ref().to_string()));
            keys.insert(path.clone(), self.origin_of(&k.span()));
            self.index_value(v, &path, keys);
        }
    }

    fn index_value(
        &self,
        v: &Spanned<DeValue<'_>>,
        path: &str,
        keys: &mut BTreeMap<String, Origin>,
    ) {
        match v.get_ref() {
            DeValue::Table(t) => self.index_table(t, path, keys),
            DeValue::Array(a) => {
                for (i, e) in a.iter().enumerate() {
                    if matches!(e.get_ref(), DeValue::Table(_)) {
                        let p = seg_path(path, &Seg::Index(i));
                        keys.insert(p.clone(), self.origin_of(&e.span()));
                        self.index_value(e, &p, keys);
                    }
                }
            }
            _ => {}
        }
    }

    /// Parses the effective document into an experiment's typed config (unknown keys are
    /// errors). The sweep runner's keys of `[sweep]` are not the experiment's and are removed.
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T> {
        let doc = self.document(true)?;
        let t = self.deserialize_doc(doc)?;
        if self.check_only {
            return Err(anyhow::Error::new(ParsedOnly));
        }
        Ok(t)
    }

    /// The effective document (file, overrides, without the sweep runner's keys) as canonical
    /// TOML: comments and layout do not change it, any value does. Identifies a sweep point.
    pub fn canonical_text(&self) -> Result<String> {
        let v: toml::Table = self.deserialize_doc(self.document(true)?)?;
        Ok(toml::to_string(&v)?)
    }

    /// Calls `f` with the runner's keys of `[sweep]` (grid, zip, seeds, metrics) and the text
    /// their spans index; None when the config has no sweep.
    pub fn with_sweep_table<R>(
        &self,
        f: impl FnOnce(&DeTable<'_>, &str) -> Result<R>,
    ) -> Result<Option<R>> {
        let doc = self.document(false)?;
        let Some(sweep) = doc.get_ref().get("sweep") else {
            return Ok(None);
        };
        let DeValue::Table(t) = sweep.get_ref() else {
            bail!(
                "{}: `sweep`{} must be a table",
                self.path.display(),
                self.where_is("sweep")
            );
        };
        let mut runner = DeTable::new();
        for (k, v) in t.iter() {
            if SWEEP_KEYS.contains(&k.get_ref().as_ref()) {
                runner.insert(k.clone(), v.clone());
            }
        }
        if runner.is_empty() {
            return Ok(None);
        }
        f(&runner, &self.source).map(Some)
    }

    /// Where a span of the effective document comes from, for messages: ` (line N)` or
    /// ` (--set KEY=VALUE)`.
    pub fn describe_span(&self, span: &Range<usize>) -> String {
        self.describe(self.origin_of(span))
    }

    fn describe(&self, o: Origin) -> String {
        match o {
            Origin::Line(l) => format!(" (line {l})"),
            Origin::Override(i) => format!(" (--set {})", self.overrides[i]),
        }
    }

    /// ` (line N)` for a key of the effective document, or "" when it is not there.
    pub fn where_is(&self, path: &str) -> String {
        canonical_key(path)
            .ok()
            .and_then(|p| self.keys.get(&p).copied())
            .map_or(String::new(), |o| self.describe(o))
    }

    /// Whether the effective document sets this key (dotted path, indices allowed).
    #[allow(dead_code)]
    pub fn has_key(&self, path: &str) -> bool {
        canonical_key(path).is_ok_and(|p| self.keys.contains_key(&p))
    }

    /// Keys of the effective document whose path ends with the field's components (a
    /// `validate()` field is named relative to its own struct, so `prefill.gpus` is
    /// `service.prefill.gpus` in a service config); when none does, keys that contain the
    /// components in order and end with the last one (`workload.chat.turns` is
    /// `workload[1].mix.chat.turns`).
    pub fn locate(&self, field: &str) -> Vec<(String, Origin)> {
        let names = |p: &str| -> Vec<String> {
            key_segments(p)
                .unwrap_or_default()
                .into_iter()
                .filter_map(|s| match s {
                    Seg::Key(k) => Some(k),
                    Seg::Index(_) => None,
                })
                .collect()
        };
        let want = names(field);
        if want.is_empty() {
            return Vec::new();
        }
        let pick = |f: &dyn Fn(&[String]) -> bool| -> Vec<(String, Origin)> {
            self.keys
                .iter()
                .filter(|(p, _)| f(&names(p)))
                .map(|(p, o)| (p.clone(), *o))
                .collect()
        };
        let suffix = pick(&|c| c.ends_with(&want));
        if !suffix.is_empty() {
            return suffix;
        }
        pick(&|c| c.last() == want.last() && is_subsequence(&want, c))
    }

    /// Rewrites a semantic error (`invalid `field`: reason`, core's `ConfigError`) so that it
    /// names the key as written in the file and its line (or the `--set` flag it came from).
    pub fn explain_error(&self, e: anyhow::Error) -> anyhow::Error {
        if e.is::<ParsedOnly>() {
            return e;
        }
        let msg = format!("{e:#}");
        let Some(start) = msg.find("invalid `") else {
            return e;
        };
        let from = start + "invalid `".len();
        let Some(len) = msg[from..].find('`') else {
            return e;
        };
        let field = &msg[from..from + len];
        let named = match self.locate(field).as_slice() {
            [] => {
                // Not in the file: it took its default. Name the closest table that is there.
                let mut parts: Vec<&str> = field.split('.').collect();
                let mut hint = None;
                while parts.len() > 1 && hint.is_none() {
                    parts.pop();
                    if let [(p, o)] = self.locate(&parts.join(".")).as_slice() {
                        hint = Some(format!(
                            "invalid `{field}` (not in the file, so its default, under `{p}`{})",
                            self.describe(*o)
                        ));
                    }
                }
                match hint {
                    Some(h) => h,
                    None => return e,
                }
            }
            [(p, o)] => format!("invalid `{p}`{}", self.describe(*o)),
            many => format!(
                "invalid `{field}` ({})",
                many.iter()
                    .map(|(p, o)| format!("`{p}`{}", self.describe(*o)))
                    .collect::<Vec<_>>()
                    .join(" or ")
            ),
        };
        anyhow!("{}{}{}", &msg[..start], named, &msg[from + len + 1..])
    }
}

fn is_subsequence(want: &[String], have: &[String]) -> bool {
    let mut it = have.iter();
    want.iter().all(|w| it.any(|h| h == w))
}

/// Moves every span of a value parsed on its own by `by` bytes (to index `source`).
fn shift(v: Spanned<DeValue<'_>>, by: usize) -> Spanned<DeValue<'_>> {
    let span = v.span();
    let span = span.start + by..span.end + by;
    let inner = match v.into_inner() {
        DeValue::Array(a) => {
            let mut out = toml::de::DeArray::new();
            for e in a.iter() {
                out.push(shift(e.clone(), by));
            }
            DeValue::Array(out)
        }
        DeValue::Table(t) => {
            let mut out = DeTable::new();
            for (k, val) in t.iter() {
                let ks = k.span();
                out.insert(
                    Spanned::new(ks.start + by..ks.end + by, k.get_ref().clone()),
                    shift(val.clone(), by),
                );
            }
            DeValue::Table(out)
        }
        other => other,
    };
    Spanned::new(span, inner)
}

/// Sets `segs` in `table` to `value`, creating tables on the way. An index selects one table of
/// an array of tables.
fn set_path<'a>(
    table: &mut DeTable<'a>,
    segs: &[Seg],
    value: Spanned<DeValue<'a>>,
    key_span: Range<usize>,
) -> Result<()> {
    let (first, rest) = segs.split_first().expect("a key has a component");
    let Seg::Key(k) = first else {
        bail!("an index must follow a key");
    };
    if rest.is_empty() {
        let key = Spanned::new(key_span, std::borrow::Cow::Owned(k.clone()));
        table.remove(k.as_str());
        table.insert(key, value);
        return Ok(());
    }
    if !table.contains_key(k.as_str()) {
        let key = Spanned::new(key_span.clone(), std::borrow::Cow::Owned(k.clone()));
        table.insert(
            key,
            Spanned::new(key_span.clone(), DeValue::Table(DeTable::new())),
        );
    }
    let slot = table.get_mut(k.as_str()).expect("just inserted");
    descend(slot.get_mut(), k, rest, value, key_span)
}

fn descend<'a>(
    v: &mut DeValue<'a>,
    name: &str,
    rest: &[Seg],
    value: Spanned<DeValue<'a>>,
    key_span: Range<usize>,
) -> Result<()> {
    match (v, &rest[0]) {
        (DeValue::Table(t), Seg::Key(_)) => set_path(t, rest, value, key_span),
        (DeValue::Array(a), Seg::Index(i)) => {
            let n = a.len();
            let Some(e) = a.get_mut(*i) else {
                bail!(
                    "`{name}` has {n} entries (indices 0 to {})",
                    n.saturating_sub(1)
                );
            };
            if rest.len() == 1 {
                *e = value;
                return Ok(());
            }
            descend(e.get_mut(), name, &rest[1..], value, key_span)
        }
        (DeValue::Array(a), Seg::Key(k)) => bail!(
            "`{name}` is an array of {} entries: pick one, as in `{name}[0].{k}`",
            a.len()
        ),
        (DeValue::Table(_), Seg::Index(i)) => {
            bail!("`{name}` is a table, not an array: `[{i}]` selects nothing")
        }
        (other, _) => bail!("`{name}` is {}, not a table", kind_name(other)),
    }
}

fn kind_name(v: &DeValue<'_>) -> &'static str {
    match v {
        DeValue::String(_) => "a string",
        DeValue::Integer(_) => "an integer",
        DeValue::Float(_) => "a float",
        DeValue::Boolean(_) => "a boolean",
        DeValue::Datetime(_) => "a date",
        DeValue::Array(_) => "an array",
        DeValue::Table(_) => "a table",
    }
}

/// Parses TOML text into `T`, prefixing errors (which carry line, column and key) with the file.
#[allow(dead_code)]
pub fn parse_toml<T: DeserializeOwned>(path: &Path, text: &str) -> Result<T> {
    toml::from_str(text).map_err(|e| anyhow!("{}: {}", path.display(), e.to_string().trim_end()))
}

#[cfg(test)]
mod tests {
    use super::*;

    const CFG: &str = r#"[experiment]
kind = "service"
seed = 3

[service.prefill]
gpus = 8
lb = { kind = "round-robin" }

[[workload]]
name = "a"
[workload.mix.chat]
turns = 4

[[workload]]
name = "b"
[workload.mix.chat]
turns = 5
"#;

    fn load(sets: &[&str]) -> Result<LoadedConfig> {
        let o = sets
            .iter()
            .map(|s| Override::parse(s))
            .collect::<Result<_>>()?;
        LoadedConfig::from_text(Path::new("t.toml"), CFG.to_string(), o)
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Prefill {
        gpus: u32,
        #[serde(default)]
        gpus_per_machine: Option<u32>,
        lb: toml::Value,
    }
    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Svc {
        prefill: Prefill,
    }
    #[derive(Debug, Deserialize)]
    struct Wl {
        name: String,
        mix: toml::Value,
    }
    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Doc {
        #[allow(dead_code)]
        experiment: ExperimentHeader,
        service: Svc,
        workload: Vec<Wl>,
    }

    #[test]
    fn key_paths_split_into_keys_and_indices() {
        assert_eq!(
            key_segments("a.b[2].c").unwrap(),
            key_segments("a.b.2.c").unwrap()
        );
        assert_eq!(
            key_segments("a.\"x.y\".c").unwrap(),
            vec![
                Seg::Key("a".into()),
                Seg::Key("x.y".into()),
                Seg::Key("c".into())
            ]
        );
        assert!(key_segments("a..b").is_err());
        assert!(key_segments("0.a").is_err());
        assert_eq!(canonical_key("workload.1.mix").unwrap(), "workload[1].mix");
    }

    #[test]
    fn overrides_replace_add_and_index_arrays_of_tables() {
        let c = load(&[
            "service.prefill.gpus=16",
            "service.prefill.gpus_per_machine=4",
            "workload[1].mix.chat.turns=9",
            "workload.0.name=renamed",
            "experiment.seed=11",
        ])
        .unwrap();
        assert_eq!(c.header.seed, 11);
        let d: Doc = c.parse().unwrap();
        assert_eq!(d.service.prefill.gpus, 16);
        assert_eq!(d.service.prefill.gpus_per_machine, Some(4));
        assert_eq!(d.workload[0].name, "renamed");
        assert_eq!(d.workload[1].mix["chat"]["turns"].as_integer(), Some(9));
        assert_eq!(d.workload[0].mix["chat"]["turns"].as_integer(), Some(4));
        assert_eq!(d.service.prefill.lb["kind"].as_str(), Some("round-robin"));
        let c = load(&["service.prefill.lb={ kind = \"least-loaded\" }"]).unwrap();
        let d: Doc = c.parse().unwrap();
        assert_eq!(d.service.prefill.lb["kind"].as_str(), Some("least-loaded"));
    }

    #[test]
    fn bad_overrides_name_the_flag() {
        let e = load(&["service.prefil.gpus=16"])
            .unwrap()
            .parse::<Doc>()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--set service.prefil.gpus=16") && e.contains("unknown field `prefil`"),
            "{e}"
        );
        assert!(
            e.contains("expected `prefill`"),
            "lists the valid keys: {e}"
        );
        let e = load(&["service.prefill.gpus=\"many\""])
            .unwrap()
            .parse::<Doc>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("--set service.prefill.gpus=\"many\""), "{e}");
        let e = load(&["workload.mix.chat.turns=3"])
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("workload[0].mix"), "{e}");
        let e = load(&["workload[7].name=x"]).err().unwrap().to_string();
        assert!(e.contains("2 entries"), "{e}");
        let e = load(&["service.prefill.gpus.x=1"])
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("is an integer, not a table"), "{e}");
        assert!(Override::parse("novalue").is_err());
        let e = load(&["service.prefill.gpus=[1,"])
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("not a TOML value"), "{e}");
    }

    #[test]
    fn errors_in_the_file_keep_their_line() {
        let c = LoadedConfig::from_text(
            Path::new("t.toml"),
            CFG.replace("gpus = 8", "gpus = 8\ngpu = 1"),
            Vec::new(),
        )
        .unwrap();
        let e = c.parse::<Doc>().unwrap_err().to_string();
        assert!(e.contains("line 7") && e.contains("gpu"), "{e}");
        let e = LoadedConfig::from_text(
            Path::new("t.toml"),
            CFG.replace("seed = 3", "seed = 3\nsed = 4"),
            Vec::new(),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(e.contains("line 4") && e.contains("sed"), "{e}");
    }

    #[test]
    fn semantic_errors_name_the_key_and_line() {
        let c = load(&["workload[0].mix.chat.turns=0"]).unwrap();
        let ex = |m: &str| c.explain_error(anyhow!("t.toml: {m}")).to_string();
        assert_eq!(
            ex("invalid `prefill.gpus`: must be positive"),
            "t.toml: invalid `service.prefill.gpus` (line 6): must be positive"
        );
        let e = ex("invalid `workload.chat.turns`: must be positive");
        assert!(
            e.contains("`workload[0].mix.chat.turns` (--set workload[0].mix.chat.turns=0)")
                && e.contains("`workload[1].mix.chat.turns` (line 17)"),
            "{e}"
        );
        let e = ex("invalid `prefill.max_jobs_per_engine`: must be positive");
        assert!(
            e.contains("not in the file") && e.contains("`service.prefill` (line 5)"),
            "{e}"
        );
        assert_eq!(ex("no field here"), "t.toml: no field here");
    }
}
