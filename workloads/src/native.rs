//! Importer and writer for servelab's native trace format (JSONL).
//!
//! One request per line: a JSON object. Blank lines are skipped; anything else that is not a
//! valid record is an error naming the file, the line (1-based) and the field.
//!
//! ```text
//! {"arrival_ms": 0, "session": 7, "class": "chat", "prompt": [[1, 2000], [2, 40]], "output": [3, 120]}
//! {"arrival_ms": 4200.5, "session": 7, "class": "chat", "prompt": [[1, 2000], [2, 40], [3, 120], [4, 35]], "output": [5, 80]}
//! {"arrival_ns": 5000000000, "prompt": [[9, 30000]], "output_tokens": 300}
//! ```
//!
//! | field | type | required | meaning |
//! |---|---|---|---|
//! | `arrival_ns` | integer ≥ 0 | exactly one of `arrival_ns`, `arrival_ms` | arrival time, nanoseconds since the trace start |
//! | `arrival_ms` | number ≥ 0 | | arrival time in milliseconds, may be fractional (rounded to the nearest ns) |
//! | `session` | integer ≥ 0 | no | session id: the turns of one conversation or agent run |
//! | `class` | `"agent"`, `"chat"` or `"other"` | no (default `"other"`) | traffic class; picks the store TTL |
//! | `prompt` | array of `[segment_id, tokens]` | yes, non-empty | the prompt's content, in order |
//! | `output` | `[segment_id, tokens]` | exactly one of `output`, `output_tokens` | the reply, as a segment that later prompts may contain |
//! | `output_tokens` | integer ≥ 0 | | the reply's length only; it gets a segment of its own |
//!
//! A *segment* is a piece of content (a system prompt, a user message, a tool result, a reply, a
//! document) named by an integer id below 2^63: **the same id means the same tokens**, so two
//! prompts that start with the same segments share their cached prefix, at any block size. Every
//! occurrence of an id must have the same length (checked; the error names both lines), and
//! segment lengths are ≥ 1. A multi-turn session lists the earlier turn's reply (its `output` id)
//! inside the next turn's prompt, as in the second line above. Ids with the top bit set are
//! reserved for the segments made for `output_tokens`. Unknown fields are errors, so a typo such as
//! `"arival_ms"` is caught. Lines need not be in arrival order; request ids are the record's
//! position in the file (0-based, blank lines not counted). Prompt plus output must stay below
//! 2^32 tokens.

use crate::{Trace, TraceError};
use serde::{Deserialize, Serialize};
use servelab_core::{ChainBuilder, Nanos, Request, RequestId, SegmentId, SessionId, TrafficClass};
use std::collections::HashMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::sync::Arc;

use lines::{Ctx, for_each_line, non_neg_number, u32_value, u64_value};

/// Segment ids at or above this are made by the importers (output segments that have no id in
/// the file); ids read from a file must stay below it.
pub const GENERATED_SEGMENT_TAG: u64 = 1 << 63;

/// Options of the native importer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct NativeOptions {
    /// Block size the chains are keyed at.
    pub block_tokens: u32,
}

impl Default for NativeOptions {
    fn default() -> Self {
        // SPEC §2: the KV cache block is 128 tokens.
        NativeOptions { block_tokens: 128 }
    }
}

/// The reply of a record: a reusable segment or just a length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NativeOutput {
    Segment(SegmentId, u32),
    Tokens(u32),
}

impl NativeOutput {
    pub fn tokens(self) -> u32 {
        match self {
            NativeOutput::Segment(_, n) | NativeOutput::Tokens(n) => n,
        }
    }
}

/// One line of a native trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NativeRecord {
    pub arrival: Nanos,
    pub session: Option<SessionId>,
    pub class: TrafficClass,
    pub prompt: Vec<(SegmentId, u32)>,
    pub output: NativeOutput,
}

impl NativeRecord {
    pub fn prompt_tokens(&self) -> u32 {
        // Saturating: records from code are validated by `to_trace`, which reports overflow.
        self.prompt
            .iter()
            .fold(0u32, |acc, &(_, n)| acc.saturating_add(n))
    }
}

/// Reads a native trace file.
pub fn load(path: &Path, opts: &NativeOptions) -> Result<Trace, TraceError> {
    let file = File::open(path).map_err(|cause| TraceError::Io {
        path: path.to_path_buf(),
        cause,
    })?;
    read(BufReader::new(file), path, opts)
}

/// Reads a native trace from `reader`; `path_for_errors` names it in errors.
pub fn read(
    reader: impl BufRead,
    path_for_errors: &Path,
    opts: &NativeOptions,
) -> Result<Trace, TraceError> {
    check_block_tokens(opts.block_tokens, path_for_errors)?;
    let (records, lines) = read_numbered(reader, path_for_errors)?;
    build(opts.block_tokens, &records, &lines, path_for_errors)
}

/// Parses and validates every record (segment lengths consistent, totals in range).
pub fn read_records(
    reader: impl BufRead,
    path_for_errors: &Path,
) -> Result<Vec<NativeRecord>, TraceError> {
    Ok(read_numbered(reader, path_for_errors)?.0)
}

/// The records and the line each came from.
fn read_numbered(
    reader: impl BufRead,
    path_for_errors: &Path,
) -> Result<(Vec<NativeRecord>, Vec<usize>), TraceError> {
    let mut records = Vec::new();
    let mut lines = Vec::new();
    let mut checker = SegmentChecker::default();
    for_each_line(reader, path_for_errors, |ctx, text| {
        let record = parse_record(&ctx, text)?;
        checker.check(&ctx, &record)?;
        records.push(record);
        lines.push(ctx.line);
        Ok(())
    })?;
    Ok((records, lines))
}

/// Builds a trace from records made in code, with the same checks as the reader (a record's
/// "line" in errors is its 1-based position in `records`).
pub fn to_trace(
    records: &[NativeRecord],
    block_tokens: u32,
    name_for_errors: &Path,
) -> Result<Trace, TraceError> {
    check_block_tokens(block_tokens, name_for_errors)?;
    let mut checker = SegmentChecker::default();
    for (i, r) in records.iter().enumerate() {
        let ctx = Ctx {
            path: name_for_errors,
            line: i + 1,
        };
        if r.prompt.is_empty() {
            return Err(ctx.field("prompt", "must hold at least one segment"));
        }
        for (j, &(id, n)) in r.prompt.iter().enumerate() {
            check_segment(&ctx, &format!("prompt[{j}]"), id.0, n)?;
        }
        if let NativeOutput::Segment(id, n) = r.output {
            check_segment(&ctx, "output", id.0, n)?;
        }
        r.arrival
            .within_horizon()
            .map_err(|e| ctx.field("arrival_ns", e))?;
        checker.check(&ctx, r)?;
    }
    let lines: Vec<usize> = (1..=records.len()).collect();
    build(block_tokens, records, &lines, name_for_errors)
}

/// Writes records as native JSONL, one per line (always `arrival_ns`, so times are exact).
pub fn write(mut out: impl Write, records: &[NativeRecord]) -> std::io::Result<()> {
    let mut line = String::new();
    for r in records {
        use std::fmt::Write as _;
        line.clear();
        // Writing into a String cannot fail.
        let _ = write!(line, "{{\"arrival_ns\":{}", r.arrival.0);
        if let Some(s) = r.session {
            let _ = write!(line, ",\"session\":{}", s.0);
        }
        let _ = write!(line, ",\"class\":\"{}\",\"prompt\":[", r.class.name());
        for (j, &(id, n)) in r.prompt.iter().enumerate() {
            let sep = if j == 0 { "" } else { "," };
            let _ = write!(line, "{sep}[{},{n}]", id.0);
        }
        line.push(']');
        match r.output {
            NativeOutput::Segment(id, n) => {
                let _ = write!(line, ",\"output\":[{},{n}]}}", id.0);
            }
            NativeOutput::Tokens(n) => {
                let _ = write!(line, ",\"output_tokens\":{n}}}");
            }
        }
        line.push('\n');
        out.write_all(line.as_bytes())?;
    }
    Ok(())
}

fn check_block_tokens(block_tokens: u32, path: &Path) -> Result<(), TraceError> {
    if block_tokens == 0 {
        return Err(TraceError::File {
            path: path.to_path_buf(),
            reason: "block_tokens must be positive".into(),
        });
    }
    Ok(())
}

/// Records are validated (every total fits in u32); a chain past its block limit, or a trace
/// past [`crate::MAX_TRACE_BLOCKS`], is an error naming the record's line.
fn build(
    block_tokens: u32,
    records: &[NativeRecord],
    lines: &[usize],
    path: &Path,
) -> Result<Trace, TraceError> {
    let mut budget = crate::BlockBudget::default();
    let mut requests = Vec::with_capacity(records.len());
    for (i, (r, &line)) in records.iter().zip(lines).enumerate() {
        let ctx = Ctx { path, line };
        let mut b = ChainBuilder::new(block_tokens);
        for (j, &(id, n)) in r.prompt.iter().enumerate() {
            b.try_push(id, n)
                .map_err(|e| ctx.field(format!("prompt[{j}]"), e.to_string()))?;
        }
        let prompt_tokens = b.total_tokens();
        let output = match r.output {
            NativeOutput::Segment(id, n) => (id, n),
            NativeOutput::Tokens(n) => (SegmentId(GENERATED_SEGMENT_TAG | i as u64), n),
        };
        b.try_push(output.0, output.1)
            .map_err(|e| ctx.field("output", e.to_string()))?;
        let content = b.finish();
        budget.charge(&content).map_err(|e| ctx.line_error(e))?;
        requests.push(Request {
            id: RequestId(i as u64),
            session: r.session,
            class: r.class,
            arrival: r.arrival,
            prompt_tokens,
            output_tokens: output.1,
            content: Arc::new(content),
        });
    }
    Ok(Trace::new(block_tokens, requests))
}

fn check_segment(ctx: &Ctx<'_>, field: &str, id: u64, tokens: u32) -> Result<(), TraceError> {
    if id >= GENERATED_SEGMENT_TAG {
        return Err(ctx.field(
            field,
            format!("segment id {id} is reserved (ids must be below 2^63)"),
        ));
    }
    if tokens == 0 {
        return Err(ctx.field(field, "segment length must be at least 1 token"));
    }
    Ok(())
}

/// Same id ⇒ same length, across the whole file; totals fit in u32.
#[derive(Default)]
struct SegmentChecker {
    /// Segment id → (tokens, first line seen).
    seen: HashMap<u64, (u32, usize)>,
}

impl SegmentChecker {
    fn check(&mut self, ctx: &Ctx<'_>, r: &NativeRecord) -> Result<(), TraceError> {
        let mut total = 0u32;
        let output = match r.output {
            NativeOutput::Segment(id, n) => Some(("output".to_string(), id, n)),
            NativeOutput::Tokens(_) => None,
        };
        let prompt = r
            .prompt
            .iter()
            .enumerate()
            .map(|(j, &(id, n))| (format!("prompt[{j}]"), id, n));
        for (field, id, n) in prompt.chain(output) {
            match self.seen.get(&id.0) {
                Some(&(len, line)) if len != n => {
                    let reason = if line == ctx.line {
                        format!(
                            "segment {} has {n} tokens here but {len} earlier on this line",
                            id.0
                        )
                    } else {
                        format!(
                            "segment {} has {n} tokens here but {len} on line {line}",
                            id.0
                        )
                    };
                    return Err(ctx.field(field, reason));
                }
                Some(_) => {}
                None => {
                    self.seen.insert(id.0, (n, ctx.line));
                }
            }
        }
        for &(_, n) in &r.prompt {
            total = total
                .checked_add(n)
                .ok_or_else(|| ctx.field("prompt", "prompt is longer than 2^32 - 1 tokens"))?;
        }
        total.checked_add(r.output.tokens()).ok_or_else(|| {
            ctx.field(
                "output",
                "prompt plus output is longer than 2^32 - 1 tokens",
            )
        })?;
        Ok(())
    }
}

const FIELDS: [&str; 7] = [
    "arrival_ns",
    "arrival_ms",
    "session",
    "class",
    "prompt",
    "output",
    "output_tokens",
];

/// One record's JSON object.
type Object = serde_json::Map<String, serde_json::Value>;

fn parse_record(ctx: &Ctx<'_>, text: &str) -> Result<NativeRecord, TraceError> {
    let obj = &ctx.parse_object(text)?;
    if let Some(k) = obj.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(ctx.field(
            k.as_str(),
            format!("unknown field (expected one of {})", FIELDS.join(", ")),
        ));
    }
    let arrival = parse_arrival(ctx, obj)?;
    let session = obj
        .get("session")
        .map(|v| u64_value(ctx, "session", v).map(SessionId))
        .transpose()?;
    let class = parse_class(ctx, obj)?;
    let prompt = parse_prompt(ctx, obj)?;
    let output = parse_output(ctx, obj)?;
    Ok(NativeRecord {
        arrival,
        session,
        class,
        prompt,
        output,
    })
}

/// `arrival_ns` or `arrival_ms` (exactly one), within the horizon.
fn parse_arrival(ctx: &Ctx<'_>, obj: &Object) -> Result<Nanos, TraceError> {
    Ok(match (obj.get("arrival_ns"), obj.get("arrival_ms")) {
        (Some(v), None) => Nanos(u64_value(ctx, "arrival_ns", v)?)
            .within_horizon()
            .map_err(|e| ctx.field("arrival_ns", e))?,
        (None, Some(v)) => {
            let ms = non_neg_number(ctx, "arrival_ms", v)?;
            Nanos::try_from_millis_f64(ms).map_err(|e| ctx.field("arrival_ms", e))?
        }
        (Some(_), Some(_)) => {
            return Err(ctx.field(
                "arrival_ms",
                "give either arrival_ns or arrival_ms, not both",
            ));
        }
        (None, None) => return Err(ctx.field("arrival_ms", "missing (or give arrival_ns)")),
    })
}

/// `class`: agent, chat or other (other when absent).
fn parse_class(ctx: &Ctx<'_>, obj: &Object) -> Result<TrafficClass, TraceError> {
    let Some(v) = obj.get("class") else {
        return Ok(TrafficClass::Other);
    };
    let s = v.as_str().ok_or_else(|| {
        ctx.field(
            "class",
            format!("expected a string, got {}", lines::kind(v)),
        )
    })?;
    TrafficClass::parse(s).ok_or_else(|| {
        ctx.field(
            "class",
            format!("unknown class {s:?} (expected agent, chat or other)"),
        )
    })
}

/// `prompt`: a non-empty array of `[segment_id, tokens]`.
fn parse_prompt(ctx: &Ctx<'_>, obj: &Object) -> Result<Vec<(SegmentId, u32)>, TraceError> {
    let prompt_value = obj
        .get("prompt")
        .ok_or_else(|| ctx.field("prompt", "missing"))?;
    let items = prompt_value.as_array().ok_or_else(|| {
        ctx.field(
            "prompt",
            format!(
                "expected an array of [segment_id, tokens], got {}",
                lines::kind(prompt_value)
            ),
        )
    })?;
    if items.is_empty() {
        return Err(ctx.field("prompt", "must hold at least one segment"));
    }
    items
        .iter()
        .enumerate()
        .map(|(j, item)| segment_pair(ctx, &format!("prompt[{j}]"), item))
        .collect()
}

/// `output` (a segment) or `output_tokens` (a count), exactly one.
fn parse_output(ctx: &Ctx<'_>, obj: &Object) -> Result<NativeOutput, TraceError> {
    Ok(match (obj.get("output"), obj.get("output_tokens")) {
        (Some(v), None) => {
            let (id, n) = segment_pair(ctx, "output", v)?;
            NativeOutput::Segment(id, n)
        }
        (None, Some(v)) => NativeOutput::Tokens(u32_value(ctx, "output_tokens", v)?),
        (Some(_), Some(_)) => {
            return Err(ctx.field("output", "give either output or output_tokens, not both"));
        }
        (None, None) => return Err(ctx.field("output", "missing (or give output_tokens)")),
    })
}

fn segment_pair(
    ctx: &Ctx<'_>,
    field: &str,
    v: &serde_json::Value,
) -> Result<(SegmentId, u32), TraceError> {
    let pair = v.as_array().filter(|a| a.len() == 2).ok_or_else(|| {
        ctx.field(
            field,
            format!("expected [segment_id, tokens], got {}", lines::kind(v)),
        )
    })?;
    let id = u64_value(ctx, &format!("{field}[0]"), &pair[0])?;
    let tokens = u32_value(ctx, &format!("{field}[1]"), &pair[1])?;
    check_segment(ctx, field, id, tokens)?;
    Ok((SegmentId(id), tokens))
}

/// Line reading and JSON field helpers shared by the importers.
pub(crate) mod lines {
    use crate::TraceError;
    use serde_json::{Map, Value};
    use std::io::BufRead;
    use std::path::Path;

    /// Where a record came from, for errors.
    #[derive(Clone, Copy)]
    pub(crate) struct Ctx<'a> {
        pub path: &'a Path,
        /// 1-based.
        pub line: usize,
    }

    impl Ctx<'_> {
        pub fn field(&self, field: impl Into<String>, reason: impl Into<String>) -> TraceError {
            TraceError::Field {
                path: self.path.to_path_buf(),
                line: self.line,
                field: field.into(),
                reason: reason.into(),
            }
        }
        pub fn line_error(&self, reason: impl Into<String>) -> TraceError {
            TraceError::Line {
                path: self.path.to_path_buf(),
                line: self.line,
                reason: reason.into(),
            }
        }
        /// Parses a line that must hold one JSON object whose keys are all distinct (a
        /// repeated key is an error naming it: JSON parsers disagree on which copy wins).
        pub fn parse_object(&self, text: &str) -> Result<Map<String, Value>, TraceError> {
            match serde_json::from_str::<Record>(text) {
                Ok(Record::Object(m)) => Ok(m),
                Ok(Record::Duplicate(k)) => {
                    Err(self.field(k, "appears twice in the record (keys must be unique)"))
                }
                Ok(Record::Other(v)) => {
                    Err(self.line_error(format!("expected a JSON object, got {}", kind(&v))))
                }
                Err(e) => Err(self.line_error(format!("invalid JSON: {e}"))),
            }
        }
    }

    /// One line's JSON: an object with distinct keys, the first key seen twice, or another
    /// value.
    enum Record {
        Object(Map<String, Value>),
        Duplicate(String),
        Other(Value),
    }

    impl<'de> serde::Deserialize<'de> for Record {
        fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl<'de> serde::de::Visitor<'de> for V {
                type Value = Record;
                fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                    f.write_str("a JSON object")
                }
                fn visit_map<A: serde::de::MapAccess<'de>>(
                    self,
                    mut map: A,
                ) -> Result<Record, A::Error> {
                    let mut out = Map::new();
                    let mut duplicate = None;
                    while let Some(k) = map.next_key::<String>()? {
                        if duplicate.is_none() && out.contains_key(&k) {
                            duplicate = Some(k);
                            map.next_value::<serde::de::IgnoredAny>()?;
                        } else {
                            let v: Value = map.next_value()?;
                            out.insert(k, v);
                        }
                    }
                    Ok(match duplicate {
                        Some(k) => Record::Duplicate(k),
                        None => Record::Object(out),
                    })
                }
                fn visit_bool<E>(self, v: bool) -> Result<Record, E> {
                    Ok(Record::Other(Value::Bool(v)))
                }
                fn visit_i64<E>(self, v: i64) -> Result<Record, E> {
                    Ok(Record::Other(Value::from(v)))
                }
                fn visit_u64<E>(self, v: u64) -> Result<Record, E> {
                    Ok(Record::Other(Value::from(v)))
                }
                fn visit_f64<E>(self, v: f64) -> Result<Record, E> {
                    Ok(Record::Other(Value::from(v)))
                }
                fn visit_str<E>(self, v: &str) -> Result<Record, E> {
                    Ok(Record::Other(Value::from(v)))
                }
                fn visit_unit<E>(self) -> Result<Record, E> {
                    Ok(Record::Other(Value::Null))
                }
                fn visit_seq<A: serde::de::SeqAccess<'de>>(
                    self,
                    mut seq: A,
                ) -> Result<Record, A::Error> {
                    while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                    Ok(Record::Other(Value::Array(Vec::new())))
                }
            }
            d.deserialize_any(V)
        }
    }

    /// Calls `f` on every non-blank line (without its line ending), numbering lines from 1.
    /// Stops at the first error. A line longer than [`crate::MAX_LINE_BYTES`] is an error
    /// (reading `/dev/zero` as a trace stops there instead of taking all memory).
    pub(crate) fn for_each_line(
        mut reader: impl BufRead,
        path: &Path,
        mut f: impl FnMut(Ctx<'_>, &str) -> Result<(), TraceError>,
    ) -> Result<(), TraceError> {
        use std::io::Read;
        let mut buf = Vec::new();
        let mut line = 0usize;
        loop {
            buf.clear();
            let n = (&mut reader)
                .take(crate::MAX_LINE_BYTES as u64 + 1)
                .read_until(b'\n', &mut buf)
                .map_err(|cause| TraceError::Io {
                    path: path.to_path_buf(),
                    cause,
                })?;
            if n == 0 {
                return Ok(());
            }
            line += 1;
            let ctx = Ctx { path, line };
            if buf.len() > crate::MAX_LINE_BYTES {
                return Err(ctx.line_error(format!(
                    "the line is longer than {} MiB (is this a trace file?)",
                    crate::MAX_LINE_BYTES >> 20
                )));
            }
            let text = std::str::from_utf8(&buf)
                .map_err(|e| ctx.line_error(format!("not valid UTF-8: {e}")))?;
            let text = text.trim_end_matches(['\n', '\r']);
            // A byte-order mark may open the first line.
            let text = if line == 1 {
                text.trim_start_matches('\u{feff}')
            } else {
                text
            };
            if text.trim().is_empty() {
                continue;
            }
            f(ctx, text)?;
        }
    }

    /// A word for the JSON type of `v`, for errors.
    pub(crate) fn kind(v: &Value) -> String {
        match v {
            Value::Null => "null".into(),
            Value::Bool(b) => format!("boolean {b}"),
            Value::Number(n) => format!("number {n}"),
            Value::String(s) if s.len() <= 40 => format!("string {s:?}"),
            Value::String(_) => "a string".into(),
            Value::Array(_) => "an array".into(),
            Value::Object(_) => "an object".into(),
        }
    }

    pub(crate) fn u64_value(ctx: &Ctx<'_>, field: &str, v: &Value) -> Result<u64, TraceError> {
        if let Some(x) = v.as_u64() {
            return Ok(x);
        }
        let reason = match v {
            Value::Number(n) if n.as_i64().is_some() => {
                format!("must not be negative, got {n}")
            }
            Value::Number(n) => format!("expected a non-negative integer, got {n}"),
            other => format!("expected a non-negative integer, got {}", kind(other)),
        };
        Err(ctx.field(field, reason))
    }

    pub(crate) fn u32_value(ctx: &Ctx<'_>, field: &str, v: &Value) -> Result<u32, TraceError> {
        let x = u64_value(ctx, field, v)?;
        u32::try_from(x).map_err(|_| ctx.field(field, format!("{x} is larger than 2^32 - 1")))
    }

    /// A finite, non-negative number (integer or not).
    pub(crate) fn non_neg_number(ctx: &Ctx<'_>, field: &str, v: &Value) -> Result<f64, TraceError> {
        match v.as_f64() {
            Some(x) if x.is_finite() && x >= 0.0 => Ok(x),
            Some(x) => Err(ctx.field(field, format!("must be a non-negative number, got {x}"))),
            None => Err(ctx.field(
                field,
                format!("expected a non-negative number, got {}", kind(v)),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(text: &str, bs: u32) -> Result<Trace, TraceError> {
        read(
            text.as_bytes(),
            Path::new("t.jsonl"),
            &NativeOptions { block_tokens: bs },
        )
    }

    fn err(text: &str) -> String {
        parse(text, 128).unwrap_err().to_string()
    }

    #[test]
    fn session_turns_share_prefix_keys() {
        let text = concat!(
            r#"{"arrival_ms": 0, "session": 7, "class": "chat", "prompt": [[1, 300], [2, 40]], "output": [3, 120]}"#,
            "\n\n",
            r#"{"arrival_ms": 1.5, "session": 7, "class": "chat", "prompt": [[1, 300], [2, 40], [3, 120], [4, 35]], "output": [5, 80]}"#,
            "\n",
            r#"{"arrival_ns": 500, "prompt": [[9, 256]], "output_tokens": 10}"#,
            "\n",
        );
        let t = parse(text, 128).unwrap();
        assert_eq!(t.len(), 3);
        // Sorted by arrival: ids 0 (0 ns), 2 (500 ns), 1 (1.5 ms).
        let ids: Vec<u64> = t.requests.iter().map(|r| r.id.0).collect();
        assert_eq!(ids, vec![0, 2, 1]);
        let (a, doc, b) = (&t.requests[0], &t.requests[1], &t.requests[2]);
        assert_eq!(b.arrival, Nanos(1_500_000));
        assert_eq!(a.class, TrafficClass::Chat);
        assert_eq!(doc.class, TrafficClass::Other);
        assert_eq!(doc.session, None);
        assert_eq!(a.session, Some(SessionId(7)));
        // Turn 1: 340 prompt tokens = 2 blocks + 84; output 120.
        assert_eq!((a.prompt_tokens, a.output_tokens), (340, 120));
        assert_eq!((a.prompt_blocks().len(), a.tail_tokens()), (2, 84));
        assert!(a.tail_key().is_some());
        // Turn 2 contains turn 1's prompt and output: 495 tokens = 3 blocks + 111.
        assert_eq!((b.prompt_tokens, b.prompt_blocks().len()), (495, 3));
        // Turn 1's full context (460 tokens) covers 3 blocks, the same three as turn 2's prompt.
        assert_eq!(a.content.full_blocks(460), b.prompt_blocks());
        assert_eq!(a.output_blocks().len(), 1);
        // The end of turn 1's output is a segment end in both chains.
        assert_eq!(a.key_at(460), b.key_at(460));
        // A block-aligned prompt has no tail.
        assert_eq!((doc.prompt_blocks().len(), doc.tail_key()), (2, None));
        assert_eq!(doc.output_tokens, 10);
    }

    #[test]
    fn bad_inputs_name_file_line_and_field() {
        let ok = r#"{"arrival_ms": 0, "prompt": [[1, 10]], "output_tokens": 1}"#;
        let cases: [(&str, &str); 16] = [
            (r#"{"arrival_ms": 0, "prompt": [[1, 10]], "#, "invalid JSON"),
            (r#"[1, 2]"#, "expected a JSON object"),
            (
                r#"{"prompt": [[1, 10]], "output_tokens": 1}"#,
                "`arrival_ms`",
            ),
            (
                r#"{"arrival_ms": -1, "prompt": [[1, 10]], "output_tokens": 1}"#,
                "`arrival_ms`",
            ),
            (
                r#"{"arrival_ns": 1.5, "prompt": [[1, 10]], "output_tokens": 1}"#,
                "`arrival_ns`",
            ),
            (
                r#"{"arrival_ms": 0, "output_tokens": 1}"#,
                "`prompt`: missing",
            ),
            (
                r#"{"arrival_ms": 0, "prompt": [], "output_tokens": 1}"#,
                "`prompt`",
            ),
            (
                r#"{"arrival_ms": 0, "prompt": [[1, -10]], "output_tokens": 1}"#,
                "`prompt[0][1]`: must not be negative",
            ),
            (
                r#"{"arrival_ms": 0, "prompt": [[1, 0]], "output_tokens": 1}"#,
                "`prompt[0]`",
            ),
            (
                r#"{"arrival_ms": 0, "prompt": [[1, "x"]], "output_tokens": 1}"#,
                "`prompt[0][1]`",
            ),
            (
                r#"{"arrival_ms": 0, "prompt": [[1, 10, 3]], "output_tokens": 1}"#,
                "`prompt[0]`",
            ),
            (
                r#"{"arrival_ms": 0, "prompt": [[9223372036854775808, 10]], "output_tokens": 1}"#,
                "reserved",
            ),
            (
                r#"{"arrival_ms": 0, "prompt": [[1, 10]]}"#,
                "`output`: missing",
            ),
            (
                r#"{"arrival_ms": 0, "class": "batch", "prompt": [[1, 10]], "output_tokens": 1}"#,
                "`class`",
            ),
            (
                r#"{"arival_ms": 0, "prompt": [[1, 10]], "output_tokens": 1}"#,
                "`arival_ms`: unknown field",
            ),
            (
                r#"{"arrival_ms": 0, "prompt": [[5, 4294967295], [6, 1]], "output_tokens": 1}"#,
                "`prompt`",
            ),
        ];
        for (line, want) in cases {
            let msg = err(&format!("{ok}\n\n{line}\n"));
            assert!(msg.starts_with("t.jsonl:3:"), "{msg}");
            assert!(msg.contains(want), "{line} → {msg}");
        }
    }

    #[test]
    fn inconsistent_segment_length_names_both_lines() {
        let text = concat!(
            r#"{"arrival_ms": 0, "prompt": [[1, 10]], "output": [2, 5]}"#,
            "\n",
            r#"{"arrival_ms": 1, "prompt": [[1, 10], [2, 6]], "output_tokens": 5}"#,
            "\n"
        );
        let msg = err(text);
        assert!(msg.starts_with("t.jsonl:2: field `prompt[1]`"), "{msg}");
        assert!(
            msg.contains("segment 2 has 6 tokens here but 5 on line 1"),
            "{msg}"
        );
    }

    #[test]
    fn zero_block_tokens_is_an_error() {
        let msg = parse("", 0).unwrap_err().to_string();
        assert!(msg.contains("block_tokens"), "{msg}");
    }

    #[test]
    fn io_error_names_the_file() {
        let e = load(Path::new("/nonexistent/x.jsonl"), &NativeOptions::default()).unwrap_err();
        assert!(e.to_string().starts_with("/nonexistent/x.jsonl:"), "{e}");
    }

    fn record_strategy() -> impl Strategy<Value = NativeRecord> {
        (
            0u64..1_000_000_000,
            proptest::option::of(0u64..5),
            0usize..3,
            // Lengths are a function of the id, so segment lengths stay consistent.
            proptest::collection::vec(0u64..12, 1..6),
            prop_oneof![
                (100u64..110).prop_map(|id| NativeOutput::Segment(SegmentId(id), seg_len(id))),
                (0u32..300).prop_map(NativeOutput::Tokens),
            ],
        )
            .prop_map(|(arrival, session, class, ids, output)| NativeRecord {
                arrival: Nanos(arrival),
                session: session.map(SessionId),
                class: TrafficClass::ALL[class],
                prompt: ids
                    .into_iter()
                    .map(|id| (SegmentId(id), seg_len(id)))
                    .collect(),
                output,
            })
    }

    fn seg_len(id: u64) -> u32 {
        (id as u32 * 97) % 600 + 1
    }

    proptest! {
        #[test]
        fn round_trip(records in proptest::collection::vec(record_strategy(), 0..20),
                      bs in prop_oneof![Just(16u32), Just(128), Just(512)]) {
            let mut text = Vec::new();
            write(&mut text, &records).unwrap();
            let back = read_records(&text[..], Path::new("rt.jsonl")).unwrap();
            prop_assert_eq!(&back, &records);
            let direct = to_trace(&records, bs, Path::new("<records>")).unwrap();
            let loaded = parse(std::str::from_utf8(&text).unwrap(), bs).unwrap();
            prop_assert_eq!(loaded.len(), records.len());
            for (x, y) in direct.requests.iter().zip(&loaded.requests) {
                prop_assert_eq!(x.id, y.id);
                prop_assert_eq!(x.prompt_tokens, y.prompt_tokens);
                prop_assert_eq!(x.output_tokens, y.output_tokens);
                prop_assert_eq!(x.prompt_blocks(), y.prompt_blocks());
                prop_assert_eq!(x.tail_key(), y.tail_key());
                let r = &records[x.id.0 as usize];
                prop_assert_eq!(x.prompt_tokens, r.prompt_tokens());
                prop_assert_eq!(x.prompt_blocks().len() as u32, r.prompt_tokens() / bs);
                prop_assert_eq!(x.tail_key().is_some(), r.prompt_tokens() % bs != 0);
                prop_assert_eq!(x.content.total_tokens(), x.context_tokens());
            }
        }

        #[test]
        fn arbitrary_text_never_panics(text in "\\PC{0,200}") {
            let _ = parse(&text, 128);
        }
    }
}
