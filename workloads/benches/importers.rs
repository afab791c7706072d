//! Load time of the published traces (skipped, with a note, when shared/traces is absent).
//!
//! `cargo bench -p servelab-workloads --bench importers`

use criterion::{Criterion, criterion_group, criterion_main};
use servelab_workloads::{azure, mooncake};
use std::path::PathBuf;

fn trace(rel: &str) -> Option<PathBuf> {
    let beside_repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces");
    let found = [beside_repo, PathBuf::from("/work/shared/traces")]
        .into_iter()
        .map(|d| d.join(rel))
        .find(|p| p.is_file());
    if found.is_none() {
        eprintln!("skipped: {rel} not found under shared/traces");
    }
    found
}

fn importers(c: &mut Criterion) {
    let mut g = c.benchmark_group("load");
    g.sample_size(20);
    if let Some(p) = trace("mooncake/conversation_trace.jsonl") {
        for bs in [None, Some(128)] {
            let opts = mooncake::MooncakeOptions {
                block_tokens: bs,
                ..Default::default()
            };
            let name = format!("mooncake_conversation_bs{}", bs.unwrap_or(512));
            g.bench_function(name, |b| {
                b.iter(|| mooncake::load(&p, &opts).expect("loads"))
            });
        }
    }
    if let Some(p) = trace("azure_llm_2023/AzureLLMInferenceTrace_conv.csv") {
        let opts = azure::AzureOptions::default();
        g.bench_function("azure_conv", |b| {
            b.iter(|| azure::load(&p, &opts).expect("loads"))
        });
    }
    g.finish();
}

criterion_group!(benches, importers);
criterion_main!(benches);
