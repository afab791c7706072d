//! The event loop: raw queue throughput, and a small serving unit end to end (events/s).

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use servelab_core::{
    ChainBuilder, Nanos, Request, RequestId, SegmentId, SessionId, SwaConfig, TrafficClass,
};
use servelab_sim::events::EventQueue;
use servelab_sim::service::{ServiceConfig, run};
use std::hint::black_box;
use std::sync::Arc;

fn queue(c: &mut Criterion) {
    let n = 100_000u64;
    let mut g = c.benchmark_group("event_queue");
    g.throughput(Throughput::Elements(n));
    g.bench_function("push_pop_steady_1k_pending", |b| {
        b.iter_batched(
            || {
                let mut q = EventQueue::new();
                for i in 0..1000u64 {
                    q.push(Nanos(i * 7919 % 1000), i);
                }
                q
            },
            |mut q| {
                // Each popped event schedules one later one, as a simulation does.
                for i in 0..n {
                    let (t, e) = q.pop().expect("pending");
                    q.push(t + Nanos(1 + (e * 2_654_435_761 + i) % 10_000), e);
                }
                black_box(q.len())
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

/// 40 agent-like sessions of 10 turns each on an 8 + 8 unit.
fn unit(c: &mut Criterion) {
    let mut reqs = Vec::new();
    for s in 0..40u64 {
        let mut b = ChainBuilder::new(128);
        let mut lens = Vec::new();
        b.push(SegmentId(1), 8000);
        for t in 0..10u64 {
            b.push(SegmentId(1000 + s * 100 + 2 * t), 1500);
            lens.push(b.total_tokens());
            b.push(SegmentId(1000 + s * 100 + 2 * t + 1), 300);
        }
        let chain = Arc::new(b.finish());
        for (t, &p) in lens.iter().enumerate() {
            reqs.push(Request {
                id: RequestId(s * 100 + t as u64),
                session: Some(SessionId(s)),
                class: TrafficClass::Agent,
                arrival: Nanos::from_millis(s * 250 + t as u64 * 5000),
                prompt_tokens: p,
                output_tokens: 300,
                content: chain.clone(),
            });
        }
    }
    reqs.sort_by_key(|r| (r.arrival, r.id));
    let mut cfg = ServiceConfig::default();
    cfg.prefill.gpus = 8;
    cfg.decode.ranks = 8;
    cfg.swa = SwaConfig {
        machines: 2,
        ..SwaConfig::default()
    };
    cfg.warmup = Nanos::ZERO;
    let events = run(&cfg, &reqs, 1).expect("runs").events;
    let mut g = c.benchmark_group("service");
    g.throughput(Throughput::Elements(events));
    g.sample_size(20);
    g.bench_function("unit_8p8d_400_requests", |b| {
        b.iter(|| black_box(run(&cfg, &reqs, 1).expect("runs").completed))
    });
    g.finish();
}

criterion_group!(benches, queue, unit);
criterion_main!(benches);
