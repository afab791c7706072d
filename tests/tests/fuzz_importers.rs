//! Fuzzing the trace importers (issue 16 item 3) with proptest generators: lines built from the
//! formats' own fields, each value drawn from ordinary, extreme and wrong-typed ones, keys
//! repeated or misspelt, and raw garbage between them. Whatever the input, an importer either
//! returns a trace that holds the invariants every consumer relies on, or an error naming the
//! file (and, for bad content, the line); it never panics, hangs or takes unbounded memory.
//!
//! Every input a run of these generators found to break that contract is kept below as a named
//! regression test. Cases are few and lengths small so the file runs in seconds in the debug
//! profile on a 2-core machine; `PROPTEST_CASES` raises the count for a longer hunt.

use proptest::prelude::*;
use servelab_core::Nanos;
use servelab_workloads::{Trace, TraceError, azure, mooncake, native};
use std::io::Cursor;
use std::path::Path;

const PATH: &str = "fuzz/trace.input";

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(96),
        max_shrink_iters: 200,
        // Failures are kept as named regression tests below, not in a persistence file.
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// The contract of a successful import.
fn check_trace(t: &Trace) -> Result<(), TestCaseError> {
    prop_assert!(t.block_tokens > 0);
    for w in t.requests.windows(2) {
        prop_assert!(
            (w[0].arrival, w[0].id) < (w[1].arrival, w[1].id),
            "not sorted"
        );
    }
    for r in &t.requests {
        prop_assert!(r.arrival <= Nanos::HORIZON, "arrival past the horizon");
        let total = u64::from(r.prompt_tokens) + u64::from(r.output_tokens);
        prop_assert_eq!(
            u64::from(r.content.total_tokens()),
            total,
            "lengths wrapped"
        );
        prop_assert_eq!(
            r.prompt_blocks().len() as u32,
            r.prompt_tokens / t.block_tokens
        );
    }
    Ok(())
}

/// The contract of a failed import: the file is named, and a line number is one of the input's.
fn check_error(e: &TraceError, lines: usize) -> Result<(), TestCaseError> {
    let msg = e.to_string();
    prop_assert!(
        msg.starts_with(PATH),
        "error does not name the file: {}",
        msg
    );
    match e {
        TraceError::Field { line, field, .. } => {
            prop_assert!(
                *line >= 1 && *line <= lines.max(1),
                "line {} of {}",
                line,
                lines
            );
            prop_assert!(!field.is_empty());
        }
        TraceError::Line { line, .. } => {
            prop_assert!(
                *line >= 1 && *line <= lines.max(1),
                "line {} of {}",
                line,
                lines
            );
        }
        TraceError::File { .. } | TraceError::Io { .. } => {}
    }
    prop_assert!(!msg.contains("panicked"));
    Ok(())
}

fn check(result: Result<Trace, TraceError>, text: &str) -> Result<(), TestCaseError> {
    match result {
        Ok(t) => check_trace(&t),
        Err(e) => check_error(&e, text.lines().count()),
    }
}

/// JSON numbers: ordinary, at the edges of u32/u64/i64, negative, fractional, huge.
fn number() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => (0u32..5_000).prop_map(|x| x.to_string()),
        1 => Just("0".to_string()),
        1 => prop::sample::select(vec![
            "4294967295", "4294967296", "2147483648", "18446744073709551615",
            "18446744073709551616", "9223372036854775808", "-1", "-9223372036854775808",
            "1.5", "-0.0", "1e300", "1e-300", "4611686018427387904", "123456789012345",
        ])
        .prop_map(str::to_string),
    ]
}

/// Any JSON value, biased towards numbers.
fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => number(),
        1 => Just("null".to_string()),
        1 => Just("true".to_string()),
        1 => "[a-z]{0,6}".prop_map(|s| format!("\"{s}\"")),
        1 => Just("{}".to_string()),
        1 => Just("[]".to_string()),
    ]
}

/// `[id, tokens]` pairs, sometimes malformed.
fn segment() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => ((0u64..6), number()).prop_map(|(id, n)| format!("[{id}, {n}]")),
        1 => value(),
        1 => (value(), value(), value()).prop_map(|(a, b, c)| format!("[{a}, {b}, {c}]")),
    ]
}

fn object(fields: Vec<(String, String)>) -> String {
    let body: Vec<String> = fields
        .iter()
        .map(|(k, v)| format!("\"{k}\": {v}"))
        .collect();
    format!("{{{}}}", body.join(", "))
}

/// A line of text that is not a record.
fn garbage() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just("   ".to_string()),
        "\\PC{0,40}",
        Just("{\"a\": 1".to_string()),
        Just("[1, 2, 3]".to_string()),
        Just("\u{feff}{}".to_string()),
    ]
}

fn native_line() -> impl Strategy<Value = String> {
    let key = prop::sample::select(vec![
        "arrival_ns",
        "arrival_ms",
        "session",
        "class",
        "prompt",
        "output",
        "output_tokens",
        "arival_ms",
    ]);
    let field = (key, 0u8..4).prop_flat_map(|(k, kind)| {
        let v: BoxedStrategy<String> = match (k, kind) {
            ("prompt", 0..=2) => prop::collection::vec(segment(), 0..5)
                .prop_map(|s| format!("[{}]", s.join(", ")))
                .boxed(),
            ("output", 0..=2) => segment().boxed(),
            ("class", 0..=2) => {
                prop::sample::select(vec!["\"agent\"", "\"chat\"", "\"other\"", "\"x\""])
                    .prop_map(str::to_string)
                    .boxed()
            }
            _ => value().boxed(),
        };
        v.prop_map(move |v| (k.to_string(), v))
    });
    let record = prop::collection::vec(field, 0..8).prop_map(object);
    let valid = (
        (0u64..10_000),
        prop::collection::vec((0u64..6, 1u32..3_000), 1..4),
        0u32..500,
    )
        .prop_map(|(t, p, o)| {
            let p: Vec<String> = p
                .iter()
                .map(|(id, n)| format!("[{id}, {}]", 100 + id * 10 + u64::from(*n % 7)))
                .collect();
            format!(
                "{{\"arrival_ms\": {t}, \"prompt\": [{}], \"output_tokens\": {o}}}",
                p.join(", ")
            )
        });
    prop_oneof![4 => record, 4 => valid, 1 => garbage()]
}

fn mooncake_line() -> impl Strategy<Value = String> {
    let valid = ((0u64..100_000), 1u32..3_000, number(), 0i32..3).prop_map(|(t, input, out, off)| {
        let n = (input.div_ceil(512) as i32 + off - 1).max(0);
        let ids: Vec<String> = (0..n).map(|i| (i * 3).to_string()).collect();
        format!(
            "{{\"timestamp\": {t}, \"input_length\": {input}, \"output_length\": {out}, \"hash_ids\": [{}]}}",
            ids.join(", ")
        )
    });
    let key = prop::sample::select(vec![
        "timestamp",
        "input_length",
        "output_length",
        "hash_ids",
    ]);
    let field = (key, 0u8..3).prop_flat_map(|(k, kind)| {
        let v: BoxedStrategy<String> = if k == "hash_ids" && kind < 2 {
            prop::collection::vec(number(), 0..6)
                .prop_map(|v| format!("[{}]", v.join(", ")))
                .boxed()
        } else {
            value().boxed()
        };
        v.prop_map(move |v| (k.to_string(), v))
    });
    let record = prop::collection::vec(field, 0..6).prop_map(object);
    prop_oneof![4 => valid, 4 => record, 1 => garbage()]
}

fn azure_header() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => Just("TIMESTAMP,ContextTokens,GeneratedTokens".to_string()),
        1 => Just("GeneratedTokens,\"TIMESTAMP\",ContextTokens,Extra".to_string()),
        1 => Just("TIMESTAMP,ContextTokens,GeneratedTokens,ContextTokens".to_string()),
        1 => Just("TIMESTAMP,ContextTokens".to_string()),
        1 => Just("timestamp,contexttokens,generatedtokens,".to_string()),
        1 => garbage(),
    ]
}

fn azure_cell_time() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => (2023u32..2025, 1u32..13, 1u32..29, 0u32..24, 0u32..60, 0u32..60, 0u32..10_000_000)
            .prop_map(|(y, mo, d, h, mi, s, f)| format!("{y}-{mo:02}-{d:02} {h:02}:{mi:02}:{s:02}.{f:07}")),
        1 => prop::sample::select(vec![
            "0000-01-01 00:00:00", "9999-12-31 23:59:59.999999999", "2024-02-29T12:00:00",
            "2023-02-29 00:00:00", "2023-13-01 00:00:00", "2023-11-16 24:00:00",
            "2023-11-16 18:17:03.1234567890", "2023-11-16", "", "-2023-11-16 00:00:00",
            "1023-11-16 18:17:03",
        ])
        .prop_map(str::to_string),
    ]
}

fn azure_cell_tokens() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => (0u32..10_000).prop_map(|x| x.to_string()),
        1 => prop::sample::select(vec![
            "4294967295", "4294967296", "-1", "1.5", "", "\"12\"", "1e3", " 7 ",
        ])
        .prop_map(str::to_string),
    ]
}

fn azure_row() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => (azure_cell_time(), azure_cell_tokens(), azure_cell_tokens())
            .prop_map(|(t, c, g)| format!("{t},{c},{g}")),
        1 => (azure_cell_time(), azure_cell_tokens()).prop_map(|(t, c)| format!("{t},{c}")),
        1 => garbage(),
    ]
}

fn block_size() -> impl Strategy<Value = u32> {
    prop::sample::select(vec![0u32, 1, 16, 128, 512, 1 << 20])
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn native_never_panics(lines in prop::collection::vec(native_line(), 0..12), bs in block_size()) {
        let text = lines.join("\n");
        let r = native::read(Cursor::new(text.as_bytes()), Path::new(PATH),
                             &native::NativeOptions { block_tokens: bs });
        check(r, &text)?;
    }

    #[test]
    fn mooncake_never_panics(lines in prop::collection::vec(mooncake_line(), 0..12),
                             bs in prop::option::of(block_size()), hash in prop::sample::select(vec![0u32, 1, 512])) {
        let text = lines.join("\n");
        let opts = mooncake::MooncakeOptions { block_tokens: bs, hash_block_tokens: hash, ..Default::default() };
        let r = mooncake::read(Cursor::new(text.as_bytes()), Path::new(PATH), &opts);
        check(r, &text)?;
    }

    #[test]
    fn azure_never_panics(header in azure_header(), rows in prop::collection::vec(azure_row(), 0..12),
                          bs in block_size()) {
        let text = std::iter::once(header).chain(rows).collect::<Vec<_>>().join("\n");
        let opts = azure::AzureOptions { block_tokens: bs, ..Default::default() };
        let r = azure::read(Cursor::new(text.as_bytes()), Path::new(PATH), &opts);
        check(r, &text)?;
    }
}

// ---- Regression tests: inputs found by hand (issue 16) or by the generators above. ----

fn native_err(text: &str, bs: u32) -> String {
    native::read(
        Cursor::new(text.as_bytes()),
        Path::new(PATH),
        &native::NativeOptions { block_tokens: bs },
    )
    .unwrap_err()
    .to_string()
}

/// Found by `azure_never_panics`: a header with a trailing comma has a column with no name, and a
/// short row's error named that empty column (``field ``: ``).
#[test]
fn short_row_under_an_unnamed_column_names_its_position() {
    let text = "timestamp,contexttokens,generatedtokens,\n2023-11-16 18:17:03,10,2\n";
    let e = azure::read(
        Cursor::new(text.as_bytes()),
        Path::new(PATH),
        &azure::AzureOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains(":2: field `column 4`: missing"), "{e}");
}

/// A line with no end (`/dev/zero`) stops at the line limit instead of taking all memory.
#[test]
fn endless_line_is_refused_at_the_limit() {
    let zeros = std::io::repeat(0).take_limit(servelab_workloads::MAX_LINE_BYTES as u64 * 4);
    let e = native::read(
        std::io::BufReader::new(zeros),
        Path::new(PATH),
        &native::NativeOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains(":1:") && e.contains("longer than 16 MiB"), "{e}");
    let zeros = std::io::repeat(b'7').take_limit(servelab_workloads::MAX_LINE_BYTES as u64 + 10);
    let e = mooncake::read(
        std::io::BufReader::new(zeros),
        Path::new(PATH),
        &mooncake::MooncakeOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("longer than 16 MiB"), "{e}");
}

trait TakeLimit: std::io::Read + Sized {
    fn take_limit(self, n: u64) -> std::io::Take<Self> {
        self.take(n)
    }
}
impl<R: std::io::Read> TakeLimit for R {}

/// Duplicate keys in a JSON record were silently resolved (the last one won).
#[test]
fn duplicate_json_keys_are_refused() {
    let e = native_err(
        "{\"arrival_ms\": 0, \"prompt\": [[1, 10]], \"prompt\": [[2, 10]], \"output_tokens\": 1}",
        128,
    );
    assert!(
        e.contains(":1: field `prompt`") && e.contains("twice"),
        "{e}"
    );
    let e = mooncake::read(
        Cursor::new(&b"{\"timestamp\": 1, \"timestamp\": 2, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": [1]}"[..]),
        Path::new(PATH),
        &mooncake::MooncakeOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("field `timestamp`") && e.contains("twice"),
        "{e}"
    );
}

/// Duplicate CSV header columns were accepted (the first one won).
#[test]
fn duplicate_csv_columns_are_refused() {
    let text =
        "TIMESTAMP,ContextTokens,GeneratedTokens,contexttokens\n2023-11-16 18:17:03,10,2,20\n";
    let e = azure::read(
        Cursor::new(text.as_bytes()),
        Path::new(PATH),
        &azure::AzureOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains(":1: field `contexttokens`") && e.contains("twice"),
        "{e}"
    );
}

/// Arrival times past the 146-year horizon are refused, not saturated.
#[test]
fn arrivals_past_the_horizon_are_refused() {
    let e = native_err(
        "{\"arrival_ns\": 18446744073709551615, \"prompt\": [[1, 10]], \"output_tokens\": 1}",
        128,
    );
    assert!(
        e.contains("field `arrival_ns`") && e.contains("horizon"),
        "{e}"
    );
    let e = native_err(
        "{\"arrival_ms\": 1e300, \"prompt\": [[1, 10]], \"output_tokens\": 1}",
        128,
    );
    assert!(
        e.contains("field `arrival_ms`") && e.contains("horizon"),
        "{e}"
    );
    let e = mooncake::read(
        Cursor::new(&b"{\"timestamp\": 9223372036854, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": [1]}"[..]),
        Path::new(PATH),
        &mooncake::MooncakeOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("field `timestamp`") && e.contains("horizon"),
        "{e}"
    );
    let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n1800-01-01 00:00:00,1,1\n2023-11-16 18:17:03,10,2\n";
    let e = azure::read(
        Cursor::new(text.as_bytes()),
        Path::new(PATH),
        &azure::AzureOptions::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains(":3: field `TIMESTAMP`") && e.contains("horizon"),
        "{e}"
    );
}

/// A context of billions of tokens at a small block size would take gigabytes of keys: refused
/// with the line and field, before the keys are made.
#[test]
fn contexts_past_the_chain_limit_are_refused() {
    let e = native_err(
        "{\"arrival_ms\": 0, \"prompt\": [[1, 4000000000]], \"output_tokens\": 1}",
        1,
    );
    assert!(
        e.contains(":1: field `prompt[0]`") && e.contains("longer than a chain holds"),
        "{e}"
    );
    let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03,4000000000,2\n";
    let e = azure::read(
        Cursor::new(text.as_bytes()),
        Path::new(PATH),
        &azure::AzureOptions {
            block_tokens: 16,
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains(":2: field `ContextTokens`"), "{e}");
}
