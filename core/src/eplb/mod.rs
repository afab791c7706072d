//! Expert-parallel load balancing (SPEC §9): DeepSeek's EPLB algorithm and an expert-load model
//! that makes MoE imbalance part of a simulated step.
//!
//! # The algorithm
//!
//! [`rebalance_experts`]`(weight[layers][experts], num_replicas, num_groups, num_nodes, num_gpus)`
//! returns an [`EplbPlacement`] `{ phy2log, log2phy, logcnt }` with the exact semantics of
//! DeepSeek's open EPLB (stable sorts, `f32` loads, lowest-index ties; see [`rebalance`]).
//!
//! # The expert-load model
//!
//! An [`ExpertLoadModel`] stands for one EP instance (its GPUs, one phase's traffic, one
//! [`PlacementPolicy`]). It is sans-IO and seeded: the engine calls, once per step,
//!
//! ```
//! # use servelab_core::eplb::*;
//! # use servelab_core::Nanos;
//! # let cfg: ExpertLoadConfig = toml::from_str(r#"
//! # phase = "decode"
//! # ep = { gpus = 64, nodes = 8, link_bytes_per_s = 50e9 }
//! # skew = { zipf_exponent = 0.5, phase_sigma = 0.2, drift_sigma = 0.3, drift_timescale = "20min", drift_tick = "1s", sequence_sigma = 0.6 }
//! # placement = { policy = "eplb", redundant_per_gpu = 1, window_steps = 1000, reassign_every_steps = 10000, scope = "global" }
//! # "#).unwrap();
//! let mut moe = ExpertLoadModel::new(&cfg, 42, "decode.0")?;
//! let s: StepMoe = moe.step(Nanos::from_millis(13), MoeBatch { tokens: 16_000, sequences: 3_840 });
//! // MoE time of the step = (time of the mean rank's work) × s.imbalance;
//! // if s.reassigned, charge s.reassignment_cost_ns before the next step.
//! assert!(s.imbalance >= 1.0);
//! # Ok::<(), servelab_core::ConfigError>(())
//! ```
//!
//! [`StepMoe`] carries the step's `imbalance` (Σ over layers of the slowest rank's token-expert
//! assignments ÷ Σ of the mean rank's: every layer waits for its slowest rank), the two sums
//! themselves, and, on a step that completed a statistics window under EPLB, `reassigned`,
//! `bytes_moved` and `reassignment_cost_ns` (the busiest receiving GPU's new expert weights over
//! its link). The new placement serves from the next step.
//!
//! Inside, an [`ExpertLoadGenerator`] draws each step's per-layer token counts per expert
//! (Zipf-like popularity over a seeded per-layer permutation, a per-phase offset, an
//! Ornstein–Uhlenbeck drift in `now`, per-batch topic noise that shrinks with the number of
//! sequences, and binomial top-k routing), and an [`ExpertPlacer`] applies the policy: static
//! placements never move; EPLB collects the last `window_steps` steps of every
//! `reassign_every_steps` period and recomputes the placement with [`rebalance_experts`]. The two
//! halves are public so an experiment can feed one generated load stream to several policies.
//!
//! Randomness is counter-based (see [`random`]): a draw depends only on the seed, the subsystem,
//! the step and the layer, never on call order elsewhere.

pub mod config;
pub mod model;
pub mod placer;
pub mod popularity;
pub mod random;
pub mod rebalance;

pub use config::{
    EpGroup, EplbScope, EplbSettings, ExpertLoadConfig, MoeModel, Phase, PlacementPolicy,
    SkewConfig,
};
pub use model::ExpertLoadModel;
pub use placer::{ExpertPlacer, StepMoe, incoming_slots};
pub use popularity::{ExpertLoadGenerator, MoeBatch};
pub use rebalance::{
    EplbError, EplbPlacement, PackScratch, balanced_packing, rebalance_experts, replicate_experts,
};
