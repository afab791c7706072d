//! DeepSeek EPLB (SPEC §9): rebalance_experts and the expert-load model.
