//! Importer for the Mooncake FAST'25 traces (JSONL, SPEC §15).
//!
//! Each line is `{"timestamp": ms, "input_length": tokens, "output_length": tokens,
//! "hash_ids": [int, ...]}`, where `hash_ids` name the prompt's 512-token blocks (the last one
//! usually partial: `input_length − 512·(n − 1)` tokens), chained so that the same id means the
//! same block *and* the same prefix. Every hash id becomes one segment of the content chain, so at
//! the trace's own block size each full block's key follows its hash id, and at a smaller block
//! size (one that divides 512) each 512-token block splits into chained sub-blocks that two
//! requests share exactly when they share the hash id. A block size that is a multiple of 512
//! groups whole hash blocks. The reply is a segment of its own per request (ids with the top bit
//! set, so they never meet a hash id), placed after the prompt, so decode's write-back has keys.
//!
//! Validated per line: the four fields are present and non-negative integers (the timestamp may
//! be fractional), `input_length > 0`, `len(hash_ids) == ceil(input_length / 512)`, hash ids are
//! below 2^63, and prompt + output fit in 32 bits. Lines need not be in time order (the trace is
//! sorted); request ids are the record's position in the file (0-based, blank lines skipped).

use crate::native::GENERATED_SEGMENT_TAG;
use crate::native::lines::{Ctx, for_each_line, non_neg_number, u32_value, u64_value};
use crate::{Trace, TraceError};
use serde::{Deserialize, Serialize};
use servelab_core::{ChainBuilder, Nanos, Request, RequestId, SegmentId, TrafficClass};
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::sync::Arc;

/// Options of the Mooncake importer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MooncakeOptions {
    /// Block size to key the chains at; `None` keeps the trace's own hash blocks. Must divide
    /// `hash_block_tokens` or be a multiple of it.
    pub block_tokens: Option<u32>,
    /// Tokens per hash id in the file (512 in the published traces).
    pub hash_block_tokens: u32,
    /// Traffic class given to every request (the file does not say; it picks the store TTL).
    pub class: TrafficClass,
}

impl Default for MooncakeOptions {
    fn default() -> Self {
        MooncakeOptions {
            block_tokens: None,
            hash_block_tokens: 512,
            class: TrafficClass::Other,
        }
    }
}

impl MooncakeOptions {
    /// The block size chains are keyed at, after validation.
    pub fn effective_block_tokens(&self) -> Result<u32, String> {
        let h = self.hash_block_tokens;
        if h == 0 {
            return Err("hash_block_tokens must be positive".into());
        }
        let b = self.block_tokens.unwrap_or(h);
        if b == 0 {
            return Err("block_tokens must be positive".into());
        }
        // Any size would hash consistently, but only these keep a block inside whole hash
        // blocks or whole sub-blocks, which is what "re-blocking" a Mooncake trace means.
        if !h.is_multiple_of(b) && !b.is_multiple_of(h) {
            return Err(format!(
                "block_tokens = {b} must divide the trace's {h}-token hash blocks or be a \
                 multiple of them (e.g. 16, 32, 64, 128, 256, 512, 1024)"
            ));
        }
        Ok(b)
    }
}

/// Reads a Mooncake trace file.
pub fn load(path: &Path, opts: &MooncakeOptions) -> Result<Trace, TraceError> {
    // Validate the options before touching the file, so a bad block size is reported as such.
    let _ = block_tokens(opts, path)?;
    let file = File::open(path).map_err(|cause| TraceError::Io {
        path: path.to_path_buf(),
        cause,
    })?;
    read(BufReader::new(file), path, opts)
}

/// Reads a Mooncake trace from `reader`; `path_for_errors` names it in errors.
pub fn read(
    reader: impl BufRead,
    path_for_errors: &Path,
    opts: &MooncakeOptions,
) -> Result<Trace, TraceError> {
    let block = block_tokens(opts, path_for_errors)?;
    let hash_block = opts.hash_block_tokens;
    let mut requests = Vec::new();
    let mut budget = crate::BlockBudget::default();
    for_each_line(reader, path_for_errors, |ctx, text| {
        let index = requests.len() as u64;
        let rec = parse_record(&ctx, text, hash_block)?;
        let mut b = ChainBuilder::new(block);
        let n = rec.hash_ids.len();
        for (i, &h) in rec.hash_ids.iter().enumerate() {
            // Validated: 1 ≤ last ≤ hash_block.
            let tokens = if i + 1 < n {
                hash_block
            } else {
                rec.input_tokens - hash_block * (n as u32 - 1)
            };
            b.try_push(SegmentId(h), tokens)
                .map_err(|e| ctx.field("input_length", e.to_string()))?;
        }
        b.try_push(SegmentId(GENERATED_SEGMENT_TAG | index), rec.output_tokens)
            .map_err(|e| ctx.field("output_length", e.to_string()))?;
        let b = b.finish();
        budget.charge(&b).map_err(|e| ctx.line_error(e))?;
        requests.push(Request {
            id: RequestId(index),
            session: None,
            class: opts.class,
            arrival: rec.arrival,
            prompt_tokens: rec.input_tokens,
            output_tokens: rec.output_tokens,
            content: Arc::new(b),
        });
        Ok(())
    })?;
    Ok(Trace::new(block, requests))
}

fn block_tokens(opts: &MooncakeOptions, path: &Path) -> Result<u32, TraceError> {
    opts.effective_block_tokens()
        .map_err(|reason| TraceError::File {
            path: path.to_path_buf(),
            reason,
        })
}

struct Record {
    arrival: Nanos,
    input_tokens: u32,
    output_tokens: u32,
    hash_ids: Vec<u64>,
}

fn parse_record(ctx: &Ctx<'_>, text: &str, hash_block: u32) -> Result<Record, TraceError> {
    let obj = ctx.parse_object(text)?;
    let get = |name: &str| obj.get(name).ok_or_else(|| ctx.field(name, "missing"));

    let ms = non_neg_number(ctx, "timestamp", get("timestamp")?)?;
    let ns = match get("timestamp")?.as_u64() {
        // Integer milliseconds (the published traces) convert exactly.
        Some(ms) => ms
            .checked_mul(1_000_000)
            .ok_or_else(|| format!("{ms} ms is too large"))
            .and_then(|ns| Nanos(ns).within_horizon()),
        None => Nanos::try_from_millis_f64(ms),
    }
    .map_err(|e| ctx.field("timestamp", e))?
    .0;

    let input_tokens = u32_value(ctx, "input_length", get("input_length")?)?;
    if input_tokens == 0 {
        return Err(ctx.field("input_length", "must be at least 1"));
    }
    let output_tokens = u32_value(ctx, "output_length", get("output_length")?)?;
    if input_tokens.checked_add(output_tokens).is_none() {
        return Err(ctx.field(
            "output_length",
            "input_length + output_length is larger than 2^32 - 1",
        ));
    }

    let ids_value = get("hash_ids")?;
    let ids = ids_value.as_array().ok_or_else(|| {
        ctx.field(
            "hash_ids",
            format!(
                "expected an array of integers, got {}",
                crate::native::lines::kind(ids_value)
            ),
        )
    })?;
    let want = input_tokens.div_ceil(hash_block) as usize;
    if ids.len() != want {
        return Err(ctx.field(
            "hash_ids",
            format!(
                "has {} ids, but input_length {input_tokens} needs ceil({input_tokens} / \
                 {hash_block}) = {want}",
                ids.len()
            ),
        ));
    }
    let mut hash_ids = Vec::with_capacity(ids.len());
    for (i, v) in ids.iter().enumerate() {
        let h = u64_value(ctx, &format!("hash_ids[{i}]"), v)?;
        if h >= GENERATED_SEGMENT_TAG {
            return Err(ctx.field(format!("hash_ids[{i}]"), format!("{h} is not below 2^63")));
        }
        hash_ids.push(h);
    }
    Ok(Record {
        arrival: Nanos(ns),
        input_tokens,
        output_tokens,
        hash_ids,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn parse(text: &str, block_tokens: Option<u32>) -> Result<Trace, TraceError> {
        read(
            text.as_bytes(),
            Path::new("mc.jsonl"),
            &MooncakeOptions {
                block_tokens,
                ..MooncakeOptions::default()
            },
        )
    }

    // Two prompts sharing hash blocks 0 and 1; the second diverges at its third block.
    const TWO: &str = concat!(
        r#"{"timestamp": 0, "input_length": 1300, "output_length": 20, "hash_ids": [0, 1, 2]}"#,
        "\n",
        r#"{"timestamp": 40, "input_length": 1600, "output_length": 7, "hash_ids": [0, 1, 3, 4]}"#,
        "\n"
    );

    #[test]
    fn own_block_size_golden() {
        let t = parse(TWO, None).unwrap();
        assert_eq!(t.block_tokens, 512);
        let (a, b) = (&t.requests[0], &t.requests[1]);
        assert_eq!(b.arrival, Nanos::from_millis(40));
        // 1300 = 2·512 + 276; 1600 = 3·512 + 64.
        assert_eq!((a.prompt_blocks().len(), a.tail_tokens()), (2, 276));
        assert_eq!((b.prompt_blocks().len(), b.tail_tokens()), (3, 64));
        assert_eq!(a.prompt_blocks()[..2], b.prompt_blocks()[..2]);
        assert_ne!(a.tail_key(), b.key_at(1300));
        assert!(a.tail_key().is_some() && b.tail_key().is_some());
        // Output: 1320 tokens fill no further block; 1607 neither.
        assert_eq!(a.content.total_tokens(), 1320);
        assert_eq!(a.output_blocks().len(), 0);
        assert_eq!(a.class, TrafficClass::Other);
    }

    #[test]
    fn sub_blocks_at_128_golden() {
        let t = parse(TWO, Some(128)).unwrap();
        assert_eq!(t.block_tokens, 128);
        let (a, b) = (&t.requests[0], &t.requests[1]);
        // 1300 = 10·128 + 20; 1600 = 12·128 + 64.
        assert_eq!((a.prompt_blocks().len(), a.tail_tokens()), (10, 20));
        assert_eq!((b.prompt_blocks().len(), b.tail_tokens()), (12, 64));
        // Hash blocks 0 and 1 give 4 chained sub-blocks each: 8 shared keys, then divergence.
        assert_eq!(a.prompt_blocks()[..8], b.prompt_blocks()[..8]);
        assert_ne!(a.prompt_blocks()[8], b.prompt_blocks()[8]);
        // Sub-blocks of one hash block are distinct keys (chained, not repeated).
        let mut first4 = a.prompt_blocks()[..4].to_vec();
        first4.dedup();
        assert_eq!(first4.len(), 4);
        // The 512-token boundary keys agree between the two requests at this block size too.
        assert_eq!(a.key_at(1024), b.key_at(1024));
        // A request whose first hash block differs shares nothing.
        let c = parse(
            r#"{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [9, 1]}"#,
            Some(128),
        )
        .unwrap();
        assert_ne!(c.requests[0].prompt_blocks()[0], a.prompt_blocks()[0]);
    }

    #[test]
    fn sub_blocks_match_an_equivalent_native_chain() {
        // Re-blocking is exactly "each hash id is a 512-token segment".
        let t = parse(TWO, Some(64)).unwrap();
        let mut b = ChainBuilder::new(64);
        b.push(SegmentId(0), 512)
            .push(SegmentId(1), 512)
            .push(SegmentId(2), 276);
        let want = b.finish();
        assert_eq!(t.requests[0].prompt_blocks(), want.full_blocks(1300));
        assert_eq!(t.requests[0].tail_key(), want.key_at(1300));
    }

    #[test]
    fn coarser_blocks_group_hash_blocks() {
        let t = parse(TWO, Some(1024)).unwrap();
        let (a, b) = (&t.requests[0], &t.requests[1]);
        assert_eq!((a.prompt_blocks().len(), a.tail_tokens()), (1, 276));
        assert_eq!(a.prompt_blocks(), b.prompt_blocks());
    }

    #[test]
    fn outputs_never_share_keys() {
        let text = concat!(
            r#"{"timestamp": 0, "input_length": 512, "output_length": 512, "hash_ids": [5]}"#,
            "\n",
            r#"{"timestamp": 1, "input_length": 512, "output_length": 512, "hash_ids": [5]}"#,
        );
        let t = parse(text, None).unwrap();
        let (a, b) = (&t.requests[0], &t.requests[1]);
        assert_eq!(a.prompt_blocks(), b.prompt_blocks());
        assert_eq!(a.tail_key(), None);
        assert_eq!(a.output_blocks().len(), 1);
        assert_ne!(a.output_blocks(), b.output_blocks());
    }

    #[test]
    fn unsorted_lines_are_sorted_and_class_applies() {
        let text = concat!(
            r#"{"timestamp": 9, "input_length": 1, "output_length": 0, "hash_ids": [1]}"#,
            "\r\n",
            r#"{"timestamp": 2.5, "input_length": 1, "output_length": 0, "hash_ids": [2]}"#,
            "\r\n",
        );
        let opts = MooncakeOptions {
            class: TrafficClass::Chat,
            ..MooncakeOptions::default()
        };
        let t = read(text.as_bytes(), Path::new("x"), &opts).unwrap();
        assert_eq!(t.requests[0].id, RequestId(1));
        assert_eq!(t.requests[0].arrival, Nanos(2_500_000));
        assert_eq!(t.requests[1].class, TrafficClass::Chat);
        assert_eq!(t.requests[0].output_tokens, 0);
    }

    #[test]
    fn bad_block_sizes_are_rejected() {
        for bs in [0u32, 384, 700] {
            let msg = parse(TWO, Some(bs)).unwrap_err().to_string();
            assert!(msg.starts_with("mc.jsonl: block_tokens"), "{msg}");
        }
        for bs in [16u32, 256, 2048] {
            assert!(parse(TWO, Some(bs)).is_ok());
        }
    }

    #[test]
    fn bad_inputs_name_file_line_and_field() {
        let ok = r#"{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}"#;
        let cases: [(&str, &str); 13] = [
            (r#"{"timestamp": 0, "input_length": 10"#, "invalid JSON"),
            (r#""hello""#, "expected a JSON object"),
            (
                r#"{"input_length": 10, "output_length": 1, "hash_ids": [0]}"#,
                "`timestamp`: missing",
            ),
            (
                r#"{"timestamp": "now", "input_length": 10, "output_length": 1, "hash_ids": [0]}"#,
                "`timestamp`",
            ),
            (
                r#"{"timestamp": -3, "input_length": 10, "output_length": 1, "hash_ids": [0]}"#,
                "`timestamp`",
            ),
            (
                r#"{"timestamp": 0, "input_length": -10, "output_length": 1, "hash_ids": [0]}"#,
                "`input_length`: must not be negative",
            ),
            (
                r#"{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}"#,
                "`input_length`",
            ),
            (
                r#"{"timestamp": 0, "input_length": 10.5, "output_length": 1, "hash_ids": [0]}"#,
                "`input_length`",
            ),
            (
                r#"{"timestamp": 0, "input_length": 10, "hash_ids": [0]}"#,
                "`output_length`: missing",
            ),
            (
                r#"{"timestamp": 0, "input_length": 513, "output_length": 1, "hash_ids": [0]}"#,
                "`hash_ids`: has 1 ids",
            ),
            (
                r#"{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}"#,
                "`hash_ids[0]`",
            ),
            (
                r#"{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": 7}"#,
                "`hash_ids`",
            ),
            (
                r#"{"timestamp": 0, "input_length": 4294967295, "output_length": 0, "hash_ids": []}"#,
                "`hash_ids`",
            ),
        ];
        for (line, want) in cases {
            let msg = parse(&format!("{ok}\n\n{line}\n{ok}\n"), Some(128))
                .unwrap_err()
                .to_string();
            assert!(msg.starts_with("mc.jsonl:3:"), "{msg}");
            assert!(msg.contains(want), "{line} → {msg}");
        }
        // Output overflow: the lengths themselves are fine, their sum is not (checked before the
        // hash ids, so the 8 million ids this prompt would need are not written out here).
        let line =
            r#"{"timestamp": 0, "input_length": 4294967295, "output_length": 1, "hash_ids": []}"#;
        let msg = parse(line, None).unwrap_err().to_string();
        assert!(msg.contains("`output_length`"), "{msg}");
    }

    proptest! {
        #[test]
        fn arbitrary_text_never_panics(text in "\\PC{0,200}") {
            let _ = parse(&text, Some(128));
        }

        #[test]
        fn prompt_shape(len in 1u32..5000, out in 0u32..2000, bs in prop_oneof![Just(16u32), Just(128), Just(512), Just(1024)]) {
            let n = len.div_ceil(512);
            let ids: Vec<u32> = (0..n).collect();
            let line = format!(r#"{{"timestamp": 0, "input_length": {len}, "output_length": {out}, "hash_ids": {ids:?}}}"#);
            let t = parse(&line, Some(bs)).unwrap();
            let r = &t.requests[0];
            prop_assert_eq!(r.prompt_blocks().len() as u32, len / bs);
            prop_assert_eq!(r.tail_key().is_some(), len % bs != 0);
            prop_assert_eq!(r.content.total_tokens(), len + out);
            prop_assert_eq!(r.output_blocks().len() as u32, (len + out) / bs - len / bs);
        }
    }
}
