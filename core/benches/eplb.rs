//! `cargo bench -p servelab-core --bench eplb`: rebalancing 40 layers × 256 experts onto 288
//! slots over 32 GPUs (8 groups, 4 nodes), the SPEC §9 target being ≤ 10 ms on one core; and one
//! simulated decode step of the expert-load model.

use criterion::{Criterion, criterion_group, criterion_main};
use servelab_core::Nanos;
use servelab_core::content::hash2;
use servelab_core::eplb::{
    EpGroup, EplbSettings, ExpertLoadConfig, ExpertLoadModel, MoeBatch, MoeModel, Phase,
    PlacementPolicy, SkewConfig, rebalance_experts,
};
use std::hint::black_box;

/// Skewed token counts: a deterministic hash per (layer, expert) shaped into a heavy tail.
fn weights(layers: usize, experts: usize) -> Vec<Vec<f32>> {
    (0..layers)
        .map(|l| {
            (0..experts)
                .map(|e| {
                    let u = (hash2(l as u64, e as u64) >> 11) as f64 / (1u64 << 53) as f64;
                    (1_000.0 / (u + 0.01)).round() as f32
                })
                .collect()
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let w = weights(40, 256);
    c.bench_function(
        "rebalance_experts 40x256 -> 288 slots, 32 GPUs, 8 groups, 4 nodes",
        |b| b.iter(|| rebalance_experts(black_box(&w), 288, 8, 4, 32).unwrap()),
    );
    // 8 groups do not divide over 16 nodes: the global policy (one 288-slot packing per layer).
    c.bench_function(
        "rebalance_experts 40x256 -> 288 slots, 32 GPUs, global policy",
        |b| b.iter(|| rebalance_experts(black_box(&w), 288, 8, 16, 32).unwrap()),
    );
    let cfg = ExpertLoadConfig {
        model: MoeModel::default(),
        phase: Phase::Decode,
        ep: EpGroup {
            gpus: 64,
            nodes: 8,
            link_bytes_per_s: 50e9,
        },
        skew: SkewConfig {
            zipf_exponent: 0.5,
            phase_sigma: 0.2,
            drift_sigma: 0.3,
            drift_timescale: Nanos::from_secs(1_200),
            drift_tick: Nanos::from_secs(1),
            sequence_sigma: 0.6,
        },
        placement: PlacementPolicy::Eplb(EplbSettings::decode()),
    };
    let mut model = ExpertLoadModel::new(&cfg, 1, "bench").unwrap();
    let mut now = Nanos::ZERO;
    c.bench_function(
        "ExpertLoadModel::step decode EP64, 40 layers x 256 experts",
        |b| {
            b.iter(|| {
                now += Nanos::from_millis(13);
                model.step(
                    now,
                    MoeBatch {
                        tokens: 16_000,
                        sequences: 3_840,
                    },
                )
            })
        },
    );
}

criterion_group!(benches, bench);
criterion_main!(benches);
