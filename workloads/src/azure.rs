//! Importer for the Azure LLM inference traces of 2023 (CSV, SPEC §15).
//!
//! Header `TIMESTAMP,ContextTokens,GeneratedTokens` (columns found by name, in any order), then
//! one row per request, e.g. `2023-11-16 18:17:03.9799600,4808,10`. The trace has lengths and
//! times only, no prefix information, so every request gets a prompt segment and an output
//! segment of its own: nothing is shared, and any cache hit in a replay of it is a bug.
//!
//! Timestamps are `YYYY-MM-DD HH:MM:SS` with an optional fraction of up to 9 digits (a `T` may
//! replace the space), read as UTC without a time-zone library; a request arrives at the
//! nanoseconds since the earliest row (the first row in the published files, which are sorted).
//! `ContextTokens` must be ≥ 1, `GeneratedTokens` ≥ 0, and their sum below 2^32. Errors name the
//! file, the line (1-based, the header is line 1) and the column.

use crate::native::lines::{Ctx, for_each_line};
use crate::{Trace, TraceError};
use serde::{Deserialize, Serialize};
use servelab_core::{ChainBuilder, Nanos, Request, RequestId, SegmentId, TrafficClass};
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::sync::Arc;

const TIMESTAMP: &str = "TIMESTAMP";
const CONTEXT: &str = "ContextTokens";
const GENERATED: &str = "GeneratedTokens";

/// Options of the Azure importer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AzureOptions {
    /// Block size the chains are keyed at.
    pub block_tokens: u32,
    /// Traffic class given to every request (the file does not say; it picks the store TTL).
    pub class: TrafficClass,
}

impl Default for AzureOptions {
    fn default() -> Self {
        AzureOptions {
            // SPEC §2: the KV cache block is 128 tokens.
            block_tokens: 128,
            class: TrafficClass::Other,
        }
    }
}

/// Reads an Azure 2023 trace file.
pub fn load(path: &Path, opts: &AzureOptions) -> Result<Trace, TraceError> {
    check_block_tokens(opts, path)?;
    let file = File::open(path).map_err(|cause| TraceError::Io {
        path: path.to_path_buf(),
        cause,
    })?;
    read(BufReader::new(file), path, opts)
}

/// Reads an Azure 2023 trace from `reader`; `path_for_errors` names it in errors.
pub fn read(
    reader: impl BufRead,
    path_for_errors: &Path,
    opts: &AzureOptions,
) -> Result<Trace, TraceError> {
    check_block_tokens(opts, path_for_errors)?;
    let mut columns: Option<Columns> = None;
    let mut rows: Vec<Row> = Vec::new();
    for_each_line(reader, path_for_errors, |ctx, text| match &columns {
        None => {
            columns = Some(Columns::from_header(&ctx, text)?);
            Ok(())
        }
        Some(cols) => {
            rows.push(cols.row(&ctx, text)?);
            Ok(())
        }
    })?;
    if columns.is_none() {
        return Err(TraceError::File {
            path: path_for_errors.to_path_buf(),
            reason: format!("empty file: expected the header {TIMESTAMP},{CONTEXT},{GENERATED}"),
        });
    }

    let origin = rows.iter().map(|r| r.time_ns).min().unwrap_or(0);
    let mut requests = Vec::with_capacity(rows.len());
    let mut budget = crate::BlockBudget::default();
    for (i, row) in rows.iter().enumerate() {
        let ctx = Ctx {
            path: path_for_errors,
            line: row.line,
        };
        let arrival = u64::try_from(row.time_ns - origin)
            .map_err(|_| "more than 584 years".to_string())
            .and_then(|ns| Nanos(ns).within_horizon())
            .map_err(|e| ctx.field(TIMESTAMP, format!("{e} after the earliest row")))?;
        let i = i as u64;
        let mut b = ChainBuilder::new(opts.block_tokens);
        b.try_push(SegmentId(2 * i), row.context_tokens)
            .map_err(|e| ctx.field(CONTEXT, e.to_string()))?
            .try_push(SegmentId(2 * i + 1), row.generated_tokens)
            .map_err(|e| ctx.field(GENERATED, e.to_string()))?;
        let b = b.finish();
        budget.charge(&b).map_err(|e| ctx.line_error(e))?;
        requests.push(Request {
            id: RequestId(i),
            session: None,
            class: opts.class,
            arrival,
            prompt_tokens: row.context_tokens,
            output_tokens: row.generated_tokens,
            content: Arc::new(b),
        });
    }
    Ok(Trace::new(opts.block_tokens, requests))
}

fn check_block_tokens(opts: &AzureOptions, path: &Path) -> Result<(), TraceError> {
    if opts.block_tokens == 0 {
        return Err(TraceError::File {
            path: path.to_path_buf(),
            reason: "block_tokens must be positive".into(),
        });
    }
    Ok(())
}

struct Row {
    line: usize,
    /// Nanoseconds since 1970-01-01 00:00 (UTC assumed).
    time_ns: i128,
    context_tokens: u32,
    generated_tokens: u32,
}

/// Column positions, from the header.
struct Columns {
    count: usize,
    timestamp: usize,
    context: usize,
    generated: usize,
    names: Vec<String>,
}

fn cell(s: &str) -> &str {
    let s = s.trim();
    s.strip_prefix('"')
        .and_then(|t| t.strip_suffix('"'))
        .unwrap_or(s)
}

impl Columns {
    fn from_header(ctx: &Ctx<'_>, text: &str) -> Result<Self, TraceError> {
        let names: Vec<String> = text.split(',').map(|s| cell(s).to_string()).collect();
        for (i, n) in names.iter().enumerate().filter(|(_, n)| !n.is_empty()) {
            if let Some(j) = names[..i].iter().position(|m| m.eq_ignore_ascii_case(n)) {
                return Err(ctx.field(
                    n.as_str(),
                    format!(
                        "the header names this column twice (columns {} and {}): which one \
                         holds the values is ambiguous",
                        j + 1,
                        i + 1
                    ),
                ));
            }
        }
        let find = |want: &str| {
            names
                .iter()
                .position(|n| n.eq_ignore_ascii_case(want))
                .ok_or_else(|| {
                    ctx.field(
                        want,
                        format!(
                            "column missing from the header (expected {TIMESTAMP},{CONTEXT},\
                             {GENERATED}; got {text:?})"
                        ),
                    )
                })
        };
        Ok(Columns {
            count: names.len(),
            timestamp: find(TIMESTAMP)?,
            context: find(CONTEXT)?,
            generated: find(GENERATED)?,
            names,
        })
    }

    fn row(&self, ctx: &Ctx<'_>, text: &str) -> Result<Row, TraceError> {
        let cells: Vec<&str> = text.split(',').map(cell).collect();
        if cells.len() < self.count {
            let missing = match self.names[cells.len()].as_str() {
                // A header cell with no name (a trailing comma): name it by position.
                "" => format!("column {}", cells.len() + 1),
                name => name.to_string(),
            };
            return Err(ctx.field(
                missing,
                format!(
                    "missing: the row has {} columns, the header {}",
                    cells.len(),
                    self.count
                ),
            ));
        }
        if cells.len() > self.count {
            return Err(ctx.line_error(format!(
                "the row has {} columns, the header {}",
                cells.len(),
                self.count
            )));
        }
        let time_ns = parse_timestamp(cells[self.timestamp])
            .map_err(|reason| ctx.field(TIMESTAMP, reason))?;
        let context_tokens =
            parse_tokens(cells[self.context]).map_err(|r| ctx.field(CONTEXT, r))?;
        if context_tokens == 0 {
            return Err(ctx.field(CONTEXT, "must be at least 1"));
        }
        let generated_tokens =
            parse_tokens(cells[self.generated]).map_err(|r| ctx.field(GENERATED, r))?;
        if context_tokens.checked_add(generated_tokens).is_none() {
            return Err(ctx.field(
                GENERATED,
                format!("{CONTEXT} + {GENERATED} is larger than 2^32 - 1"),
            ));
        }
        Ok(Row {
            line: ctx.line,
            time_ns,
            context_tokens,
            generated_tokens,
        })
    }
}

fn parse_tokens(s: &str) -> Result<u32, String> {
    if s.is_empty() {
        return Err("empty".into());
    }
    if s.starts_with('-') && s[1..].bytes().all(|b| b.is_ascii_digit()) && s.len() > 1 {
        return Err(format!("must not be negative, got {s}"));
    }
    if !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("expected a non-negative integer, got {s:?}"));
    }
    s.parse::<u32>()
        .map_err(|_| format!("{s} is larger than 2^32 - 1"))
}

/// Parses `YYYY-MM-DD HH:MM:SS[.fraction]` (fraction of 1 to 9 digits) into nanoseconds since
/// 1970-01-01 00:00:00.
pub(crate) fn parse_timestamp(s: &str) -> Result<i128, String> {
    let bad = || format!("expected YYYY-MM-DD HH:MM:SS[.fraction], got {s:?}");
    let (date, time) = s
        .split_once(' ')
        .or_else(|| s.split_once('T'))
        .ok_or_else(bad)?;
    let mut d = date.split('-');
    let (Some(y), Some(mo), Some(da), None) = (d.next(), d.next(), d.next(), d.next()) else {
        return Err(bad());
    };
    let (hms, frac) = match time.split_once('.') {
        Some((hms, frac)) => (hms, Some(frac)),
        None => (time, None),
    };
    let mut t = hms.split(':');
    let (Some(h), Some(mi), Some(se), None) = (t.next(), t.next(), t.next(), t.next()) else {
        return Err(bad());
    };
    let num = |part: &str, digits: std::ops::RangeInclusive<usize>| -> Result<u32, String> {
        if !digits.contains(&part.len()) || !part.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        part.parse::<u32>().map_err(|_| bad())
    };
    let year = num(y, 4..=4)?;
    let month = num(mo, 1..=2)?;
    let day = num(da, 1..=2)?;
    let hour = num(h, 1..=2)?;
    let minute = num(mi, 2..=2)?;
    let second = num(se, 2..=2)?;
    if !(1..=12).contains(&month) {
        return Err(format!("month {month} is not 1..12 in {s:?}"));
    }
    if day < 1 || day > days_in_month(year, month) {
        return Err(format!(
            "day {day} does not exist in {year}-{month:02} ({s:?})"
        ));
    }
    if hour > 23 || minute > 59 || second > 59 {
        return Err(format!("time of day out of range in {s:?}"));
    }
    let frac_ns = match frac {
        None => 0,
        Some(f) => {
            if f.is_empty() || f.len() > 9 || !f.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!(
                    "fraction of a second must be 1 to 9 digits in {s:?}"
                ));
            }
            // Pad to nanoseconds: ".98" is 980 ms.
            f.parse::<u32>().map_err(|_| bad())? * 10u32.pow(9 - f.len() as u32)
        }
    };
    let days = days_from_civil(i64::from(year), month, day);
    let secs = days * 86_400 + i64::from(hour * 3600 + minute * 60 + second);
    Ok(i128::from(secs) * 1_000_000_000 + i128::from(frac_ns))
}

fn is_leap(year: u32) -> bool {
    (year.is_multiple_of(4) && !year.is_multiple_of(100)) || year.is_multiple_of(400)
}

fn days_in_month(year: u32, month: u32) -> u32 {
    match month {
        2 if is_leap(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = i64::from(month);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(text: &str) -> Result<Trace, TraceError> {
        read(
            text.as_bytes(),
            Path::new("az.csv"),
            &AzureOptions::default(),
        )
    }

    #[test]
    fn civil_days_golden() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(days_from_civil(2023, 11, 16), 19_677);
        assert_eq!(days_from_civil(1969, 12, 31), -1);
        // 2023-11-16 18:17:03.97996 UTC = 1700158623.97996 s (checked with `date -u -d`).
        assert_eq!(
            parse_timestamp("2023-11-16 18:17:03.9799600").unwrap(),
            1_700_158_623_979_960_000
        );
        assert_eq!(
            parse_timestamp("2024-02-29T00:00:00.5").unwrap(),
            i128::from(days_from_civil(2024, 2, 29)) * 86_400_000_000_000 + 500_000_000
        );
    }

    #[test]
    fn lengths_and_arrivals_golden() {
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n\
                    2023-11-16 23:59:59.9,300,5\n\
                    2023-11-17 00:00:00.000000001,256,130\r\n\
                    2023-11-17 00:00:01,1,0\n";
        let t = parse(text).unwrap();
        assert_eq!(t.len(), 3);
        let r: Vec<_> = t.requests.iter().collect();
        // Day rollover: 0.1 s + 1 ns after the first row.
        assert_eq!(r[1].arrival, Nanos(100_000_001));
        assert_eq!(r[2].arrival, Nanos(1_100_000_000));
        assert_eq!((r[0].prompt_tokens, r[0].output_tokens), (300, 5));
        assert_eq!((r[0].prompt_blocks().len(), r[0].tail_tokens()), (2, 44));
        assert!(r[0].tail_key().is_some());
        assert_eq!((r[1].prompt_blocks().len(), r[1].tail_key()), (2, None));
        assert_eq!(r[1].output_blocks().len(), 1);
        assert_eq!(r[2].tail_tokens(), 1);
        // Nothing is shared, not even the first block of two long prompts.
        assert_ne!(r[0].prompt_blocks()[0], r[1].prompt_blocks()[0]);
    }

    #[test]
    fn columns_by_name_and_earliest_row_is_origin() {
        let text = "GeneratedTokens, ContextTokens ,timestamp\n\
                    7,100,2023-11-16 18:00:02\n\
                    8,200,2023-11-16 18:00:01\n";
        let t = parse(text).unwrap();
        assert_eq!(t.requests[0].id, RequestId(1));
        assert_eq!(t.requests[0].arrival, Nanos::ZERO);
        assert_eq!(
            (t.requests[0].prompt_tokens, t.requests[0].output_tokens),
            (200, 8)
        );
        assert_eq!(t.requests[1].arrival, Nanos::from_secs(1));
    }

    #[test]
    fn bad_inputs_name_file_line_and_column() {
        let head = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,10,1\n";
        let cases: [(&str, &str); 14] = [
            ("2023-11-16 18:17:03.97,10", "`GeneratedTokens`: missing"),
            ("2023-11-16 18:17:03.97,10,1,4", "4 columns"),
            ("2023-11-16,10,1", "`TIMESTAMP`"),
            ("2023-13-16 18:17:03,10,1", "`TIMESTAMP`: month 13"),
            ("2023-02-29 18:17:03,10,1", "`TIMESTAMP`: day 29"),
            ("2023-11-16 24:17:03,10,1", "`TIMESTAMP`"),
            (
                "2023-11-16 18:17:03.1234567890,10,1",
                "`TIMESTAMP`: fraction",
            ),
            ("2023-11-16 18:17:03.,10,1", "`TIMESTAMP`: fraction"),
            ("2023/11/16 18:17:03,10,1", "`TIMESTAMP`"),
            (
                "2023-11-16 18:17:03,-10,1",
                "`ContextTokens`: must not be negative",
            ),
            (
                "2023-11-16 18:17:03,0,1",
                "`ContextTokens`: must be at least 1",
            ),
            ("2023-11-16 18:17:03,10,x", "`GeneratedTokens`"),
            ("2023-11-16 18:17:03,10,99999999999", "`GeneratedTokens`"),
            ("2023-11-16 18:17:03,4294967295,1", "`GeneratedTokens`"),
        ];
        for (row, want) in cases {
            let msg = parse(&format!("{head}\n{row}\n")).unwrap_err().to_string();
            assert!(msg.starts_with("az.csv:4:"), "{msg}");
            assert!(msg.contains(want), "{row} → {msg}");
        }
        let msg = parse("TIMESTAMP,Context,GeneratedTokens\n")
            .unwrap_err()
            .to_string();
        assert!(msg.starts_with("az.csv:1: field `ContextTokens`"), "{msg}");
        let msg = parse("\n\n").unwrap_err().to_string();
        assert!(msg.starts_with("az.csv: empty file"), "{msg}");
        let far = "TIMESTAMP,ContextTokens,GeneratedTokens\n0001-01-01 00:00:00,1,1\n\
                   9999-01-01 00:00:00,1,1\n";
        let msg = parse(far).unwrap_err().to_string();
        assert!(msg.starts_with("az.csv:3: field `TIMESTAMP`"), "{msg}");
    }

    #[test]
    fn header_only_is_an_empty_trace() {
        assert!(
            parse("TIMESTAMP,ContextTokens,GeneratedTokens\n")
                .unwrap()
                .is_empty()
        );
    }

    proptest! {
        #[test]
        fn arbitrary_rows_never_panic(row in "\\PC{0,60}") {
            let _ = parse(&format!("TIMESTAMP,ContextTokens,GeneratedTokens\n{row}\n"));
        }

        #[test]
        fn timestamps_are_monotone_in_seconds(a in 0i64..200_000_000_000, b in 0i64..200_000_000_000) {
            // Build both stamps from seconds since 0000-03-01 through the inverse date math and
            // check order is preserved (days_from_civil is strictly increasing).
            let fmt = |s: i64| {
                let days = s / 86_400;
                let (y, m, d) = civil_from_days(days - 719_468);
                format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}", s % 86_400 / 3600, s % 3600 / 60, s % 60)
            };
            let (ta, tb) = (fmt(a), fmt(b));
            if (1..=9999).contains(&ta[..4].parse::<i64>().unwrap()) && (1..=9999).contains(&tb[..4].parse::<i64>().unwrap()) {
                let (pa, pb) = (parse_timestamp(&ta).unwrap(), parse_timestamp(&tb).unwrap());
                prop_assert_eq!(pa - pb, i128::from(a - b) * 1_000_000_000);
            }
        }
    }

    /// Inverse of `days_from_civil` (Hinnant), for the property test only.
    fn civil_from_days(z: i64) -> (i64, u32, u32) {
        let z = z + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z - era * 146_097;
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
        let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
        (yoe + era * 400 + i64::from(m <= 2), m, d)
    }
}
