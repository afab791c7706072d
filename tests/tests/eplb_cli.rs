//! The JSON contract of `servelab eplb` (SPEC §9), checked through the core types the command
//! serializes: the SPEC's public example in, `{"phy2log", "log2phy", "logcnt"}` out; and the
//! expert-load model driven from a TOML config the way the simulator embeds it.

use servelab_core::Nanos;
use servelab_core::eplb::{ExpertLoadConfig, ExpertLoadModel, MoeBatch, rebalance_experts};

const SPEC_INPUT: &str = r#"{"weight": [[90,132,40,61,104,165,39,4,73,56,183,86],
                                        [20,107,104,64,19,197,187,157,172,86,16,27]]}"#;

fn spec_weight() -> Vec<Vec<f32>> {
    let v: serde_json::Value = serde_json::from_str(SPEC_INPUT).unwrap();
    v["weight"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        })
        .collect()
}

#[test]
fn spec_example_serializes_to_the_published_shape() {
    let p = rebalance_experts(&spec_weight(), 16, 4, 2, 8).unwrap();
    let out = serde_json::to_value(&p).unwrap();
    let mut keys: Vec<&String> = out.as_object().unwrap().keys().collect();
    keys.sort();
    assert_eq!(keys, ["log2phy", "logcnt", "phy2log"]);
    assert_eq!(
        out["phy2log"],
        serde_json::json!([
            [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
            [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]
        ])
    );
    assert_eq!(
        out["logcnt"],
        serde_json::json!([
            [1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1],
            [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]
        ])
    );
    // log2phy: [layers][experts][max replicas], padded with -1.
    let l2p = out["log2phy"].as_array().unwrap();
    assert_eq!(l2p.len(), 2);
    for (l, layer) in l2p.iter().enumerate() {
        for (e, slots) in layer.as_array().unwrap().iter().enumerate() {
            let slots = slots.as_array().unwrap();
            assert_eq!(slots.len(), 2);
            let used: Vec<i64> = slots
                .iter()
                .map(|s| s.as_i64().unwrap())
                .filter(|&s| s >= 0)
                .collect();
            assert_eq!(used.len(), p.logcnt[l][e]);
            for s in used {
                assert_eq!(p.phy2log[l][s as usize], e);
            }
        }
    }
}

#[test]
fn expert_load_model_from_toml_is_reproducible() {
    let cfg: ExpertLoadConfig = toml::from_str(
        r#"
        phase = "prefill"
        ep = { gpus = 4, nodes = 1, link_bytes_per_s = 900e9 }
        skew = { zipf_exponent = 0.7, phase_sigma = 0.2, drift_sigma = 0.25, drift_timescale = "30min", drift_tick = "1s", sequence_sigma = 0.85 }
        placement = { policy = "eplb", redundant_per_gpu = 4, window_steps = 10, reassign_every_steps = 100 }
        [model]
        layers = 4
        "#,
    )
    .unwrap();
    let run = || {
        let mut m = ExpertLoadModel::new(&cfg, 7, "prefill.0").unwrap();
        (0..150u64)
            .map(|i| {
                m.step(
                    Nanos::from_millis(200 * i),
                    MoeBatch {
                        tokens: 65_536,
                        sequences: 4,
                    },
                )
            })
            .collect::<Vec<_>>()
    };
    let a = run();
    assert_eq!(a, run());
    let reassigned: Vec<usize> = a
        .iter()
        .enumerate()
        .filter(|(_, s)| s.reassigned)
        .map(|(i, _)| i)
        .collect();
    assert_eq!(reassigned, vec![9, 109]);
    assert!(a.iter().all(|s| s.imbalance >= 1.0));
}
