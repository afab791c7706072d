use servelab_sim::acceptance::AcceptanceModel;
use servelab_sim::dspark::*;
use servelab_sim::profile::HardwareProfile;
use servelab_core::engine::*;
#[test]
fn calib() {
    let prof = match std::env::var("PROFILE") { Ok(p) => HardwareProfile::resolve(&p).unwrap(), Err(_) => HardwareProfile::resolve("sm100-published").unwrap() };
    let acc: AcceptanceModel = std::env::var("ACC").map(|s| toml::from_str(&s).unwrap()).unwrap_or_default();
    for b in [16u32, 60, 96] {
        let p = DsparkPoint { ranks: 64, seqs_per_rank: b, steps: 400, warmup_steps: 50, kv_tokens_min: 1024, kv_tokens_max: 131_072, output_tokens_min: 256, output_tokens_max: 2048, draft_tokens: 5, expert_imbalance: 1.09, scheduling: Scheduling::Async };
        let f = run_point(&p, &VerificationPolicy::Fixed { drafts: 5 }, &prof, &acc, 1).unwrap();
        let d = run_point(&p, &VerificationPolicy::Dynamic { min_seqs_per_rank: 0, vote: Default::default(), confirmation_rounds: 1 }, &prof, &acc, 1).unwrap();
        println!("B {b}: fixed {:.0} acc {:.3} v {:.2} | dyn {:.0} acc {:.3} v {:.2} | {:+.2}%", f.tokens_per_s_per_rank, f.accepted_length, f.verified_per_step, d.tokens_per_s_per_rank, d.accepted_length, d.verified_per_step, 100.0*(d.tokens_per_s_per_rank/f.tokens_per_s_per_rank-1.0));
    }
}
