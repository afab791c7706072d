//! The one-pass curves' speed next to point replays, and the sampling error, on the whole
//! Mooncake conversation trace. Timing-dependent, so ignored by default; run with
//! `cargo test --release -p servelab-tests --test mrc_speed -- --ignored --nocapture`.
//! The point replays must still equal the curve exactly.

use servelab_core::{ClassTtl, Nanos, StoreConfig};
use servelab_sim::mrc::{MrcOptions, curves, log_grid};
use servelab_sim::replay::block_replay;
use servelab_workloads::mooncake;
use std::path::PathBuf;
use std::time::Instant;

fn trace_path() -> Option<PathBuf> {
    let rel = "mooncake/conversation_trace.jsonl";
    let beside_repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces");
    [beside_repo, PathBuf::from("/work/shared/traces")]
        .into_iter()
        .map(|d| d.join(rel))
        .find(|p| p.is_file())
}

#[test]
#[ignore = "timing: run on request"]
fn one_pass_vs_point_replays_on_mooncake() {
    let Some(path) = trace_path() else {
        println!("skipped: trace not found");
        return;
    };
    for block in [512u32, 128] {
        let t = mooncake::load(
            &path,
            &mooncake::MooncakeOptions {
                block_tokens: Some(block),
                ..Default::default()
            },
        )
        .unwrap();
        let n = t.len() as f64;
        let bb = u64::from(block) * 890;
        let start = Instant::now();
        let exact = curves(&t, MrcOptions::default()).unwrap();
        let one = start.elapsed().as_secs_f64();
        println!(
            "block {block}: {} requests, {} distinct blocks; one pass {:.3} s = {:.0} requests/s",
            t.len(),
            exact.distinct_blocks,
            one,
            n / one
        );
        let sat = exact.saturating_capacity();
        let grid = log_grid(sat, 20);
        let caps = [sat / 100, sat / 10, sat / 2, sat];
        let mut replay_s = 0.0;
        for &cap in &caps {
            let cfg = StoreConfig {
                capacity_bytes: Some(cap.max(1) * bb),
                high_watermark: 1.0,
                low_watermark: 1.0,
                ttl: ClassTtl::none(),
                ..StoreConfig::default()
            };
            let s = Instant::now();
            let rep = block_replay(&t, &cfg, bb, false).unwrap();
            replay_s += s.elapsed().as_secs_f64();
            let p = exact.at_capacity(&exact.all, cap.max(1));
            assert_eq!(
                (p.hit_tokens, p.hit_blocks),
                (rep.hit_tokens, rep.block_hits)
            );
        }
        for secs in [10u64, 60, 600] {
            let ttl = Nanos::from_secs(secs);
            let cfg = StoreConfig {
                capacity_bytes: None,
                ttl: ClassTtl::uniform(Some(ttl)),
                ..StoreConfig::default()
            };
            let s = Instant::now();
            let rep = block_replay(&t, &cfg, bb, false).unwrap();
            replay_s += s.elapsed().as_secs_f64();
            let p = exact.all.at_ttl(ttl);
            assert_eq!(
                (p.hit_tokens, p.hit_blocks),
                (rep.hit_tokens, rep.block_hits)
            );
        }
        let k = (caps.len() + 3) as f64;
        println!(
            "  point replay (LRU and TTL, 7, all equal): {:.3} s each = {:.0} requests/s; the \
             curve's {} capacities alone would take {:.1} s of replays",
            replay_s / k,
            n * k / replay_s,
            grid.len(),
            replay_s / k * grid.len() as f64
        );
        for rate in [0.5, 0.25, 0.1, 0.01] {
            let s = Instant::now();
            let c = curves(
                &t,
                MrcOptions {
                    sample_rate: rate,
                    cache_outputs: false,
                },
            )
            .unwrap();
            let took = s.elapsed().as_secs_f64();
            let (mut worst, mut sum) = (0f64, 0f64);
            for &cap in &grid {
                let d = (exact.at_capacity(&exact.all, cap).token_hit_rate
                    - c.at_capacity(&c.all, cap).token_hit_rate)
                    .abs();
                worst = worst.max(d);
                sum += d;
            }
            let ttls = log_grid(exact.all.max_reuse().0 / 1_000_000 + 2, 20);
            let (mut tworst, mut tsum) = (0f64, 0f64);
            for &ms in &ttls {
                let ttl = Nanos::from_millis(ms);
                let d =
                    (exact.all.at_ttl(ttl).token_hit_rate - c.all.at_ttl(ttl).token_hit_rate).abs();
                tworst = tworst.max(d);
                tsum += d;
            }
            println!(
                "  sampled {rate}: {:.3} s = {:.0} requests/s, {} kept blocks; token error \
                 capacity max {:.2} pp mean {:.2} pp, TTL max {:.2} pp mean {:.2} pp",
                took,
                n / took,
                c.distinct_blocks,
                100.0 * worst,
                100.0 * sum / grid.len() as f64,
                100.0 * tworst,
                100.0 * tsum / ttls.len() as f64
            );
        }
    }
}
