//! Golden scenarios for the trace-level replay, computed by hand from SPEC §4–§5.

use servelab_core::{
    ChainBuilder, HitPolicy, Nanos, Request, RequestId, SegmentId, SessionId, TrafficClass,
};
use servelab_sim::replay::{ReplayConfig, replay};
use servelab_workloads::Trace;
use std::sync::Arc;

/// A two-turn chat session: system 1,000 + user 100 → reply 300; then user 200.
/// Turn 1: L = 1,100, output 300 (context 1,400). Turn 2: L = 1,600.
fn session(gap_s: u64) -> Trace {
    let mut b = ChainBuilder::new(128);
    b.push(SegmentId(1), 1000)
        .push(SegmentId(2), 100)
        .push(SegmentId(3), 300)
        .push(SegmentId(4), 200)
        .push(SegmentId(5), 50);
    let chain = Arc::new(b.finish());
    let req = |id, at: Nanos, p, o| Request {
        id: RequestId(id),
        session: Some(SessionId(0)),
        class: TrafficClass::Chat,
        arrival: at,
        prompt_tokens: p,
        output_tokens: o,
        content: chain.clone(),
    };
    Trace::new(
        128,
        vec![
            req(0, Nanos::ZERO, 1100, 300),
            req(1, Nanos::from_secs(gap_s), 1600, 50),
        ],
    )
}

const ALL: [HitPolicy; 4] = [
    HitPolicy::Deepinfer,
    HitPolicy::PerfectCache,
    HitPolicy::OrdinaryModel,
    HitPolicy::ExactRebuild,
];

#[test]
fn second_turn_hits_on_end_of_decode_swa_state() {
    // Turn 2 arrives 10 s later. Store: turn 1's prompt blocks (8 = 1,024 tokens) and, at the
    // end of decode, its output blocks up to 1,400 → 10 full blocks (1,280). b = 1,280.
    // cap = floor((1,600 − 134) / 128) × 128 = 1,408, h0 = 1,280; SWA state stored at the end of
    // decode at floor(1,400 / 128) × 128 = 1,280 → hit 1,280.
    let r = replay(&session(10), &ReplayConfig::default(), &ALL).unwrap();
    assert_eq!(r.input_tokens, 2_700);
    assert_eq!(r.cached_block_tokens, 1_280);
    let di = r.policy(HitPolicy::Deepinfer).unwrap();
    assert_eq!(di.hit_tokens, 1_280);
    // Layer-tokens: turn 1 20×1,100 + 20×140; turn 2 20×320 + 20×140.
    assert_eq!(di.layer_tokens, 24_800 + 9_200);
    // Perfect cache: turn 2 hits the whole previous context, 1,400 tokens.
    assert_eq!(r.perfect_hit_tokens, 1_400);
    let ord = r.policy(HitPolicy::OrdinaryModel).unwrap();
    assert_eq!(ord.layer_tokens, 40 * 1_100 + 40 * 200);
    let ex = r.policy(HitPolicy::ExactRebuild).unwrap();
    assert_eq!(
        ex.layer_tokens,
        20 * 1_100 + 20 * 1_100 + 20 * 200 + 20 * 1_600
    );
    assert_eq!(r.baseline_layer_tokens, 40 * 2_700);
    // Store: 8 prompt blocks written, 2 output blocks, then turn 2 adds 2 more
    // (floor(1,600/128) = 12) and its output (1,650 → 12 blocks, nothing new).
    assert_eq!(r.store.inserts, 12);
}

#[test]
fn expired_swa_state_backs_off_one_block() {
    // Same session, but turn 2 comes 10 minutes later: the 3-minute SWA state is gone.
    // h0 = 1,280 without state → hit 1,152, the backed-off block replayed by the encoder.
    let r = replay(&session(600), &ReplayConfig::default(), &ALL).unwrap();
    let di = r.policy(HitPolicy::Deepinfer).unwrap();
    assert_eq!(di.hit_tokens, 1_152);
    assert_eq!(di.encoder_replay_tokens, 128);
    assert_eq!(di.layer_tokens, 24_800 + 20 * 448 + 20 * 140);
    assert_eq!(r.swa.expirations, 2);
}

#[test]
fn without_output_write_back_only_the_prompt_hits() {
    // Outputs not written: b = 1,024 (turn 1's prompt blocks); SWA after prefill at 1,024.
    let cfg = ReplayConfig {
        cache_outputs: false,
        ..ReplayConfig::default()
    };
    let r = replay(&session(10), &cfg, &ALL).unwrap();
    assert_eq!(r.cached_block_tokens, 1_024);
    assert_eq!(r.policy(HitPolicy::Deepinfer).unwrap().hit_tokens, 1_024);
}

#[test]
fn swa_on_ssd_survives_the_host_lifetime_and_costs_store_bytes() {
    let r = replay(
        &session(600),
        &ReplayConfig::default(),
        &[HitPolicy::SwaOnSsd],
    )
    .unwrap();
    assert_eq!(r.policy(HitPolicy::SwaOnSsd).unwrap().hit_tokens, 1_280);
    // SWA objects of 1,415,040 bytes at 1,024 and 1,280 (turn 1) and 1,536 (turn 2, after
    // prefill; its end of decode at 1,650 rounds to the same 1,536), besides 12 blocks.
    assert_eq!(r.store.bytes_written, 12 * 113_920 + 3 * 1_415_040);
}

#[test]
fn capacity_bounds_and_block_size_mismatch_is_an_error() {
    let cfg = ReplayConfig {
        constants: servelab_core::ServingConstants {
            block_tokens: 64,
            ..Default::default()
        },
        ..ReplayConfig::default()
    };
    let e = replay(&session(10), &cfg, &ALL).unwrap_err();
    assert!(e.to_string().contains("block_tokens"), "{e}");
}
