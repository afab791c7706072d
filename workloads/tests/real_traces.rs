//! Loads the published traces in `shared/traces` (SPEC §15) when they are present.
//!
//! The expected figures were computed independently from the files with a short Python script
//! (sums of the length columns, distinct hash ids, last timestamps), not by this crate.

use servelab_core::{BlockKey, TrafficClass};
use servelab_workloads::{Trace, azure, mooncake};
use std::collections::HashSet;
use std::path::PathBuf;

/// `<repo>/../shared/traces` (CI's copy of shared/), else `/work/shared/traces`.
fn traces_dir() -> Option<PathBuf> {
    let beside_repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces");
    [beside_repo, PathBuf::from("/work/shared/traces")]
        .into_iter()
        .find(|p| p.is_dir())
}

fn trace_file(rel: &str) -> Option<PathBuf> {
    let path = traces_dir().map(|d| d.join(rel));
    if let Some(path) = path.filter(|p| p.is_file()) {
        Some(path)
    } else {
        println!("skipped: {rel} not found under shared/traces");
        None
    }
}

fn distinct_blocks(t: &Trace) -> usize {
    t.requests
        .iter()
        .flat_map(|r| r.prompt_blocks().iter().copied())
        .collect::<HashSet<BlockKey>>()
        .len()
}

fn check_mooncake(rel: &str, records: usize, input: u64, output: u64, distinct: [usize; 2]) {
    let Some(path) = trace_file(rel) else { return };
    let t = mooncake::load(&path, &mooncake::MooncakeOptions::default()).unwrap();
    assert_eq!(t.len(), records);
    assert_eq!(t.block_tokens, 512);
    assert_eq!((t.input_tokens(), t.output_tokens()), (input, output));
    // Hash ids are prefix-chained, so each distinct full hash block is one distinct key.
    assert_eq!(distinct_blocks(&t), distinct[0]);
    assert!(t.requests.windows(2).all(|w| w[0].arrival <= w[1].arrival));
    assert!(
        t.requests
            .iter()
            .all(|r| r.tail_tokens() == 0 || r.tail_key().is_some())
    );

    let opts = mooncake::MooncakeOptions {
        block_tokens: Some(128),
        class: TrafficClass::Chat,
        ..Default::default()
    };
    let t128 = mooncake::load(&path, &opts).unwrap();
    assert_eq!(t128.len(), records);
    // Each distinct hash block of L tokens yields floor(L / 128) distinct sub-blocks.
    assert_eq!(distinct_blocks(&t128), distinct[1]);
    assert!(t128.requests.iter().all(|r| r.class == TrafficClass::Chat));
}

#[test]
fn mooncake_conversation() {
    check_mooncake(
        "mooncake/conversation_trace.jsonl",
        12_031,
        144_793_823,
        4_122_048,
        [170_899, 702_900],
    );
}

#[test]
fn mooncake_synthetic() {
    check_mooncake(
        "mooncake/synthetic_trace.jsonl",
        3_993,
        61_194_628,
        595_432,
        [40_148, 165_035],
    );
}

fn check_azure(rel: &str, records: usize, input: u64, output: u64, last_arrival_ns: u64) {
    let Some(path) = trace_file(rel) else { return };
    let t = azure::load(&path, &azure::AzureOptions::default()).unwrap();
    assert_eq!(t.len(), records);
    assert_eq!((t.input_tokens(), t.output_tokens()), (input, output));
    assert_eq!(t.requests[0].arrival.0, 0);
    assert_eq!(t.requests.last().unwrap().arrival.0, last_arrival_ns);
    // Lengths only: no two requests share a block.
    let blocks: usize = t.requests.iter().map(|r| r.prompt_blocks().len()).sum();
    assert_eq!(distinct_blocks(&t), blocks);
}

#[test]
fn azure_code() {
    check_azure(
        "azure_llm_2023/AzureLLMInferenceTrace_code.csv",
        8_819,
        18_059_974,
        245_896,
        3_435_948_056_000,
    );
}

#[test]
fn azure_conversation() {
    check_azure(
        "azure_llm_2023/AzureLLMInferenceTrace_conv.csv",
        19_366,
        22_361_870,
        4_088_665,
        3_501_721_937_000,
    );
}
