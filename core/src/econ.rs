//! Economics of SPEC §12: revenue per day, the prefill and decode pool sizes that a token mix
//! needs, the GPU count that revenue implies, and the storage the written KV needs.
//!
//! Pure functions over `f64`; nothing here reads a clock or prints. The model, exactly as SPEC
//! §12 states it:
//!
//! - T tokens per day, output share o, input hit rate h: outputs O = oT, hits H = h(1 − o)T,
//!   misses M = (1 − h)(1 − o)T.
//! - Revenue per day = (price_hit·H + price_miss·M + price_output·O) / 10⁶ (prices in USD per
//!   million tokens). GPUs implied by revenue = revenue / (revenue per GPU-hour × 24).
//! - Prefill GPUs = M / (prefill tok/s × 86,400 × efficiency); decode GPUs = O / (decode tok/s ×
//!   86,400 × efficiency). Prefill : decode = 1 : 1 fixes h for each o:
//!   1 − h = o · prefill / (decode · (1 − o)) (efficiency cancels).
//! - Capacity count = prefill + decode GPUs; feasible when it fits inside the revenue count;
//!   utilisation needed = capacity count / revenue count.
//! - Storage: tokens written per day = M + O, held for the TTL at the bytes per token, × the
//!   erasure-coding overhead → PiB needed. Store band: store size ÷ cache per GPU, physical
//!   (store ÷ EC overhead) or logical (the store taken as logical bytes).
//!
//! Interpretations where SPEC §12 is silent (each one a documented choice):
//! - PiB = 2⁵⁰ bytes, TB = 10¹² bytes (SSDs are sold in decimal TB; 3FS capacity is quoted in PiB).
//! - GPU counts are fractional (no rounding up): the model is a steady-state average.
//! - When the pool ratio implies h < 0 (the output share is above decode / (prefill + decode)),
//!   the mix is reported infeasible with that reason, and the numbers are computed with h clamped
//!   to [0, 1]; the pools are then *not* 1 : 1 (decode needs more GPUs than prefill).
//! - `cache_days_per_gpu` = cache per GPU (TB) ÷ KV bytes written per GPU per day, with the fleet
//!   taken as the GPUs implied by revenue (SPEC's way of sizing the live fleet) and the bytes
//!   logical (before erasure coding, like the 14.4 TB of *logical* cache per GPU in SPEC §7).
//!   `cache_days_at_gpus_needed` is the same with the fleet taken as the capacity count.
//! - `feasible` is SPEC's test (pool ratio holds and capacity fits inside the revenue count);
//!   whether the written KV fits in the store is reported separately as `storage_fits`.

use crate::error::ConfigError;
use serde::{Deserialize, Serialize};
use std::fmt;

pub const SECONDS_PER_DAY: f64 = 86_400.0;
pub const HOURS_PER_DAY: f64 = 24.0;
/// Prices are quoted per million tokens.
pub const TOKENS_PER_PRICE_UNIT: f64 = 1e6;
/// 2⁵⁰ bytes.
pub const BYTES_PER_PIB: f64 = 1_125_899_906_842_624.0;
/// 10¹² bytes.
pub const BYTES_PER_TB: f64 = 1e12;
/// Sweeps larger than this are refused (a typo in the step would otherwise allocate forever).
pub const MAX_SWEEP_POINTS: usize = 100_000;

/// Published defaults (SPEC §1, §7, §11, §12); every one is overridable by flag or config.
pub mod defaults {
    /// SPEC §12: one cluster serves 155 trillion tokens per day.
    pub const TOKENS_PER_DAY: f64 = 155e12;
    /// SPEC §11 gives 60,000–89,500 non-cached input tok/s per GPU, rising with step size.
    /// Production prompts average 77K tokens, so prefill steps are large: the top of the range.
    pub const PREFILL_TPS: f64 = 89_500.0;
    /// SPEC §11: production runs near 60 sequences per rank ≈ 14,500 output tok/s per GPU.
    pub const DECODE_TPS: f64 = 14_500.0;
    /// SPEC §8: live service reaches about 80% of the offline benchmark.
    pub const EFFICIENCY: f64 = 0.8;
    /// SPEC §1: global KV is 890 bytes per token, the same on SSD before EC overhead.
    pub const BYTES_PER_TOKEN: f64 = 890.0;
    /// SPEC §7: 3 days for agent traffic (7 for chat); the shorter TTL is the default.
    pub const TTL_DAYS: f64 = 3.0;
    /// SPEC §7: 10+2 erasure coding.
    pub const EC_OVERHEAD: f64 = 1.2;
    /// SPEC §7: 14.4 TB of logical cache per online GPU.
    pub const CACHE_PER_GPU_TB: f64 = 14.4;
    /// SPEC §7: about 100 PiB of SSD.
    pub const STORE_PIB: f64 = 100.0;
    /// SPEC §12: $38 per GPU-hour at off-peak pricing.
    pub const REVENUE_PER_GPU_HOUR: f64 = 38.0;
    /// SPEC §12: peak prices are double the off-peak ones.
    pub const PEAK_MULTIPLIER: f64 = 2.0;
}

/// Prices in USD per million tokens.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Prices {
    pub hit_usd_per_mtok: f64,
    pub miss_usd_per_mtok: f64,
    pub output_usd_per_mtok: f64,
}

impl Prices {
    /// SPEC §12 off-peak ("valley") prices: $0.003 hit, $0.15 miss, $0.60 output.
    pub fn off_peak() -> Self {
        Prices {
            hit_usd_per_mtok: 0.003,
            miss_usd_per_mtok: 0.15,
            output_usd_per_mtok: 0.60,
        }
    }

    /// SPEC §12: peak prices are double.
    pub fn peak() -> Self {
        Self::off_peak().scaled(defaults::PEAK_MULTIPLIER)
    }

    pub fn scaled(self, factor: f64) -> Self {
        Prices {
            hit_usd_per_mtok: self.hit_usd_per_mtok * factor,
            miss_usd_per_mtok: self.miss_usd_per_mtok * factor,
            output_usd_per_mtok: self.output_usd_per_mtok * factor,
        }
    }

    /// Prices may be zero (a free tier) but not negative. Fields are named as the flags and
    /// config keys that set them: `price_hit`, `price_miss`, `price_output`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        non_negative("price_hit", self.hit_usd_per_mtok)?;
        non_negative("price_miss", self.miss_usd_per_mtok)?;
        non_negative("price_output", self.output_usd_per_mtok)
    }

    /// Revenue in USD of each kind of token.
    pub fn revenue_usd(&self, tokens: &Split) -> Split {
        Split {
            hit: tokens.hit * self.hit_usd_per_mtok / TOKENS_PER_PRICE_UNIT,
            miss: tokens.miss * self.miss_usd_per_mtok / TOKENS_PER_PRICE_UNIT,
            output: tokens.output * self.output_usd_per_mtok / TOKENS_PER_PRICE_UNIT,
        }
    }
}

/// One quantity split by kind of token: cache-hit input, cache-miss input, output.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Split {
    pub hit: f64,
    pub miss: f64,
    pub output: f64,
}

impl Split {
    pub fn total(&self) -> f64 {
        self.hit + self.miss + self.output
    }

    /// Each part as a fraction of the total; `None` when the total is zero.
    pub fn shares(&self) -> Option<Split> {
        let t = self.total();
        (t > 0.0).then(|| Split {
            hit: self.hit / t,
            miss: self.miss / t,
            output: self.output / t,
        })
    }
}

/// Inputs of the SPEC §12 fleet model. Field names are the config keys (and, with `-` for `_`,
/// the `servelab econ` flags) that set them.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct EconParams {
    /// T: tokens per day, input and output together.
    pub tokens_per_day: f64,
    /// o: output tokens / all tokens, in [0, 1).
    pub output_share: f64,
    /// Non-cached input tokens per second per prefill GPU (offline benchmark).
    pub prefill_tps: f64,
    /// Output tokens per second per decode GPU (offline benchmark).
    pub decode_tps: f64,
    /// Fraction of the offline benchmark that live service reaches, in (0, 1].
    pub efficiency: f64,
    pub prices: Prices,
    /// KV bytes per token as persisted, before erasure coding.
    pub bytes_per_token: f64,
    /// How long written KV is held.
    pub ttl_days: f64,
    /// Physical bytes per logical byte (1.2 for 10+2 erasure coding); at least 1.
    pub ec_overhead: f64,
    /// Logical cache per online GPU, TB (10¹² bytes).
    pub cache_per_gpu_tb: f64,
    /// Physical store size, PiB (2⁵⁰ bytes).
    pub store_pib: f64,
    /// USD of revenue per GPU-hour that converts revenue into a GPU count.
    pub revenue_per_gpu_hour: f64,
}

impl EconParams {
    /// SPEC defaults at off-peak prices, for a given output share.
    pub fn published(output_share: f64) -> Self {
        EconParams {
            tokens_per_day: defaults::TOKENS_PER_DAY,
            output_share,
            prefill_tps: defaults::PREFILL_TPS,
            decode_tps: defaults::DECODE_TPS,
            efficiency: defaults::EFFICIENCY,
            prices: Prices::off_peak(),
            bytes_per_token: defaults::BYTES_PER_TOKEN,
            ttl_days: defaults::TTL_DAYS,
            ec_overhead: defaults::EC_OVERHEAD,
            cache_per_gpu_tb: defaults::CACHE_PER_GPU_TB,
            store_pib: defaults::STORE_PIB,
            revenue_per_gpu_hour: defaults::REVENUE_PER_GPU_HOUR,
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        positive("tokens_per_day", self.tokens_per_day)?;
        share("output_share", self.output_share)?;
        positive("prefill_tps", self.prefill_tps)?;
        positive("decode_tps", self.decode_tps)?;
        if !(self.efficiency > 0.0 && self.efficiency <= 1.0) {
            return Err(ConfigError::invalid(
                "efficiency",
                format!(
                    "the fraction of the offline benchmark reached live must be in (0, 1], got {}",
                    self.efficiency
                ),
            ));
        }
        self.prices.validate()?;
        positive("bytes_per_token", self.bytes_per_token)?;
        positive("ttl_days", self.ttl_days)?;
        if !(self.ec_overhead.is_finite() && self.ec_overhead >= 1.0) {
            return Err(ConfigError::invalid(
                "ec_overhead",
                format!(
                    "physical bytes per logical byte must be at least 1, got {}",
                    self.ec_overhead
                ),
            ));
        }
        positive("cache_per_gpu_tb", self.cache_per_gpu_tb)?;
        positive("store_pib", self.store_pib)?;
        positive("revenue_per_gpu_hour", self.revenue_per_gpu_hour)
    }

    /// Tokens per second one GPU-day delivers live, as tokens per day.
    fn prefill_tokens_per_gpu_day(&self) -> f64 {
        self.prefill_tps * SECONDS_PER_DAY * self.efficiency
    }

    fn decode_tokens_per_gpu_day(&self) -> f64 {
        self.decode_tps * SECONDS_PER_DAY * self.efficiency
    }
}

/// The model's inputs as a config file or the command line gives them: every field optional,
/// defaulting to the published figure (`defaults`). Keys match the `servelab econ` flags.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EconConfig {
    pub tokens_per_day: Option<f64>,
    pub prefill_tps: Option<f64>,
    pub decode_tps: Option<f64>,
    pub efficiency: Option<f64>,
    /// Peak pricing: doubles the *default* prices and the default revenue per GPU-hour (SPEC's
    /// $38 is quoted at off-peak prices; doubling it too keeps the GPU count implied by revenue
    /// the same fleet). Explicit prices and revenue per GPU-hour are taken as given.
    #[serde(default)]
    pub peak: bool,
    pub price_hit: Option<f64>,
    pub price_miss: Option<f64>,
    pub price_output: Option<f64>,
    pub bytes_per_token: Option<f64>,
    pub ttl_days: Option<f64>,
    pub ec_overhead: Option<f64>,
    pub cache_per_gpu_tb: Option<f64>,
    pub store_pib: Option<f64>,
    pub revenue_per_gpu_hour: Option<f64>,
}

impl EconConfig {
    fn period_factor(&self) -> f64 {
        if self.peak {
            defaults::PEAK_MULTIPLIER
        } else {
            1.0
        }
    }

    pub fn prices(&self) -> Prices {
        let base = Prices::off_peak().scaled(self.period_factor());
        Prices {
            hit_usd_per_mtok: self.price_hit.unwrap_or(base.hit_usd_per_mtok),
            miss_usd_per_mtok: self.price_miss.unwrap_or(base.miss_usd_per_mtok),
            output_usd_per_mtok: self.price_output.unwrap_or(base.output_usd_per_mtok),
        }
    }

    pub fn revenue_per_gpu_hour(&self) -> f64 {
        self.revenue_per_gpu_hour
            .unwrap_or(defaults::REVENUE_PER_GPU_HOUR * self.period_factor())
    }

    /// The full parameter set at one output share (not yet validated: `evaluate` does that).
    pub fn params(&self, output_share: f64) -> EconParams {
        EconParams {
            tokens_per_day: self.tokens_per_day.unwrap_or(defaults::TOKENS_PER_DAY),
            output_share,
            prefill_tps: self.prefill_tps.unwrap_or(defaults::PREFILL_TPS),
            decode_tps: self.decode_tps.unwrap_or(defaults::DECODE_TPS),
            efficiency: self.efficiency.unwrap_or(defaults::EFFICIENCY),
            prices: self.prices(),
            bytes_per_token: self.bytes_per_token.unwrap_or(defaults::BYTES_PER_TOKEN),
            ttl_days: self.ttl_days.unwrap_or(defaults::TTL_DAYS),
            ec_overhead: self.ec_overhead.unwrap_or(defaults::EC_OVERHEAD),
            cache_per_gpu_tb: self.cache_per_gpu_tb.unwrap_or(defaults::CACHE_PER_GPU_TB),
            store_pib: self.store_pib.unwrap_or(defaults::STORE_PIB),
            revenue_per_gpu_hour: self.revenue_per_gpu_hour(),
        }
    }
}

/// The hit rate that makes prefill and decode pools equal: h = 1 − o·prefill / (decode·(1 − o)).
/// Unclamped: below 0 when the output share is too high for 1 : 1 pools.
pub fn implied_hit_rate(output_share: f64, prefill_tps: f64, decode_tps: f64) -> f64 {
    1.0 - output_share * prefill_tps / (decode_tps * (1.0 - output_share))
}

/// The largest output share for which 1 : 1 pools are possible (h = 0): decode / (prefill + decode).
pub fn max_output_share(prefill_tps: f64, decode_tps: f64) -> f64 {
    decode_tps / (prefill_tps + decode_tps)
}

/// GPUs a store backs: store bytes ÷ cache bytes per GPU.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct StoreBand {
    /// The store is physical SSD: ÷ EC overhead gives logical bytes, then ÷ cache per GPU.
    pub gpus_physical: f64,
    /// The store size taken as logical bytes, ÷ cache per GPU.
    pub gpus_logical: f64,
}

pub fn store_band(store_pib: f64, ec_overhead: f64, cache_per_gpu_tb: f64) -> StoreBand {
    let logical = store_pib * BYTES_PER_PIB / (cache_per_gpu_tb * BYTES_PER_TB);
    StoreBand {
        gpus_physical: logical / ec_overhead,
        gpus_logical: logical,
    }
}

/// Why a mix is infeasible. Serialised as its message.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(into = "String")]
pub enum Infeasibility {
    /// The pool ratio needs a hit rate below zero.
    PoolRatio {
        implied_hit_rate: f64,
        max_output_share: f64,
    },
    /// The hit rate is in range but a pool would hold less than one GPU (at output share 0
    /// there is no decode pool at all): there are no 1 : 1 pools to speak of.
    NoPools { prefill_gpus: f64, decode_gpus: f64 },
    /// The capacity count exceeds what revenue pays for.
    OverRevenue {
        gpus_needed: f64,
        gpus_from_revenue: f64,
    },
}

impl fmt::Display for Infeasibility {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Infeasibility::PoolRatio {
                implied_hit_rate,
                max_output_share,
            } => write!(
                f,
                "1:1 prefill:decode pools imply hit rate {implied_hit_rate:.4} < 0: output share above \
                 {max_output_share:.4} (decode / (prefill + decode)) cannot balance the pools"
            ),
            Infeasibility::NoPools {
                prefill_gpus,
                decode_gpus,
            } => write!(
                f,
                "no 1:1 pools: they would hold {prefill_gpus:.2} prefill and {decode_gpus:.2} \
                 decode GPUs, less than one each (output share or load too small)"
            ),
            Infeasibility::OverRevenue {
                gpus_needed,
                gpus_from_revenue,
            } => write!(
                f,
                "capacity needs {gpus_needed:.0} GPUs but revenue pays for {gpus_from_revenue:.0}"
            ),
        }
    }
}

impl From<Infeasibility> for String {
    fn from(i: Infeasibility) -> String {
        i.to_string()
    }
}

/// The SPEC §12 model evaluated at one output share.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EconEstimate {
    pub output_share: f64,
    /// h from the pool ratio, unclamped.
    pub hit_rate_implied: f64,
    /// h clamped to [0, 1]; what every other number uses.
    pub hit_rate: f64,
    /// The implied h lies in [0, 1], so the pools are 1 : 1.
    pub pool_ratio_holds: bool,
    /// H, M, O in tokens per day.
    pub tokens_per_day: Split,
    pub token_share: Split,
    pub revenue_usd_per_day: Split,
    /// `None` when every price is zero.
    pub revenue_share: Option<Split>,
    pub revenue_per_day: f64,
    pub gpus_from_revenue: f64,
    pub prefill_gpus: f64,
    pub decode_gpus: f64,
    /// Capacity count: prefill + decode GPUs.
    pub gpus_needed: f64,
    /// Capacity count ÷ revenue count; `None` when revenue is zero and capacity is not.
    pub utilisation_needed: Option<f64>,
    /// M + O.
    pub written_tokens_per_day: f64,
    /// (M + O) × bytes per token, logical.
    pub written_bytes_per_day: f64,
    /// Written bytes × TTL × EC overhead, in PiB.
    pub storage_pib: f64,
    pub storage_fits: bool,
    pub store_band_gpus_physical: f64,
    pub store_band_gpus_logical: f64,
    /// Cache per GPU ÷ written bytes per GPU per day, fleet = GPUs implied by revenue; `None` when
    /// nothing is written.
    pub cache_days_per_gpu: Option<f64>,
    /// The same with fleet = capacity count; `None` when nothing is written.
    pub cache_days_at_gpus_needed: Option<f64>,
    pub feasible: bool,
    pub infeasible_reasons: Vec<Infeasibility>,
}

/// The GPU counts of one mix: implied by revenue, and needed by capacity.
struct Fleet {
    revenue: Split,
    revenue_per_day: f64,
    gpus_from_revenue: f64,
    prefill_gpus: f64,
    decode_gpus: f64,
    gpus_needed: f64,
}

impl Fleet {
    fn of(p: &EconParams, tokens: &Split) -> Self {
        let revenue = p.prices.revenue_usd(tokens);
        let revenue_per_day = revenue.total();
        let gpus_from_revenue = revenue_per_day / (p.revenue_per_gpu_hour * HOURS_PER_DAY);
        let prefill_gpus = tokens.miss / p.prefill_tokens_per_gpu_day();
        let decode_gpus = tokens.output / p.decode_tokens_per_gpu_day();
        Self {
            revenue,
            revenue_per_day,
            gpus_from_revenue,
            prefill_gpus,
            decode_gpus,
            gpus_needed: prefill_gpus + decode_gpus,
        }
    }

    /// 1:1 pools need a hit rate in [0, 1] *and* pools to be 1:1: at output share 0 (or a
    /// load so small that a pool holds less than one GPU) there are none.
    fn pools_exist(&self) -> bool {
        self.prefill_gpus >= 1.0 && self.decode_gpus >= 1.0
    }

    /// Capacity count ÷ revenue count (0 when neither needs a GPU, `None` when only revenue
    /// is zero).
    fn utilisation_needed(&self) -> Option<f64> {
        if self.gpus_from_revenue > 0.0 {
            Some(self.gpus_needed / self.gpus_from_revenue)
        } else if self.gpus_needed == 0.0 {
            Some(0.0)
        } else {
            None
        }
    }
}

/// Why the mix at implied hit rate `h_raw` is infeasible (empty when it is feasible).
fn infeasibilities(p: &EconParams, h_raw: f64, fleet: &Fleet) -> Vec<Infeasibility> {
    let mut reasons = Vec::new();
    if !(0.0..=1.0).contains(&h_raw) {
        reasons.push(Infeasibility::PoolRatio {
            implied_hit_rate: h_raw,
            max_output_share: max_output_share(p.prefill_tps, p.decode_tps),
        });
    } else if !fleet.pools_exist() {
        reasons.push(Infeasibility::NoPools {
            prefill_gpus: fleet.prefill_gpus,
            decode_gpus: fleet.decode_gpus,
        });
    }
    if fleet.gpus_needed > fleet.gpus_from_revenue {
        reasons.push(Infeasibility::OverRevenue {
            gpus_needed: fleet.gpus_needed,
            gpus_from_revenue: fleet.gpus_from_revenue,
        });
    }
    reasons
}

/// Days of cache a fleet of `fleet_gpus` holds at `written_bytes_per_day`; `None` when
/// nothing is written.
fn cache_days(p: &EconParams, written_bytes_per_day: f64, fleet_gpus: f64) -> Option<f64> {
    (written_bytes_per_day > 0.0)
        .then(|| p.cache_per_gpu_tb * BYTES_PER_TB * fleet_gpus / written_bytes_per_day)
}

/// Evaluates SPEC §12 at `p.output_share`.
pub fn evaluate(p: &EconParams) -> Result<EconEstimate, ConfigError> {
    p.validate()?;
    let o = p.output_share;
    let t = p.tokens_per_day;
    let h_raw = implied_hit_rate(o, p.prefill_tps, p.decode_tps);
    let h = h_raw.clamp(0.0, 1.0);
    let tokens = Split {
        hit: h * (1.0 - o) * t,
        miss: (1.0 - h) * (1.0 - o) * t,
        output: o * t,
    };
    let fleet = Fleet::of(p, &tokens);
    let written_tokens_per_day = tokens.miss + tokens.output;
    let written_bytes_per_day = written_tokens_per_day * p.bytes_per_token;
    let storage_pib = written_bytes_per_day * p.ttl_days * p.ec_overhead / BYTES_PER_PIB;
    let band = store_band(p.store_pib, p.ec_overhead, p.cache_per_gpu_tb);
    let infeasible_reasons = infeasibilities(p, h_raw, &fleet);
    let estimate = EconEstimate {
        output_share: o,
        hit_rate_implied: h_raw,
        hit_rate: h,
        pool_ratio_holds: (0.0..=1.0).contains(&h_raw) && fleet.pools_exist(),
        tokens_per_day: tokens,
        // From the mix itself, not from the token counts (which underflow for a tiny T): the
        // shares always sum to 1.
        token_share: Split {
            hit: h * (1.0 - o),
            miss: (1.0 - h) * (1.0 - o),
            output: o,
        },
        revenue_usd_per_day: fleet.revenue,
        revenue_share: fleet.revenue.shares(),
        revenue_per_day: fleet.revenue_per_day,
        gpus_from_revenue: fleet.gpus_from_revenue,
        prefill_gpus: fleet.prefill_gpus,
        decode_gpus: fleet.decode_gpus,
        gpus_needed: fleet.gpus_needed,
        utilisation_needed: fleet.utilisation_needed(),
        written_tokens_per_day,
        written_bytes_per_day,
        storage_pib,
        storage_fits: storage_pib <= p.store_pib,
        store_band_gpus_physical: band.gpus_physical,
        store_band_gpus_logical: band.gpus_logical,
        cache_days_per_gpu: cache_days(p, written_bytes_per_day, fleet.gpus_from_revenue),
        cache_days_at_gpus_needed: cache_days(p, written_bytes_per_day, fleet.gpus_needed),
        feasible: infeasible_reasons.is_empty(),
        infeasible_reasons,
    };
    estimate.check()?;
    Ok(estimate)
}

impl EconEstimate {
    /// Every figure is finite, shares lie in [0, 1] and sum to 1: inputs so extreme that a
    /// product overflows (or a quotient divides by an underflowed value) are refused here, so no
    /// `inf` or `NaN` is ever printed.
    pub fn check(&self) -> Result<(), ConfigError> {
        let mut figures = vec![
            ("hit rate", self.hit_rate_implied),
            ("revenue per day", self.revenue_per_day),
            ("GPUs implied by revenue", self.gpus_from_revenue),
            ("prefill GPUs", self.prefill_gpus),
            ("decode GPUs", self.decode_gpus),
            ("GPUs needed", self.gpus_needed),
            ("written bytes per day", self.written_bytes_per_day),
            ("storage needed", self.storage_pib),
            ("store band (physical)", self.store_band_gpus_physical),
            ("store band (logical)", self.store_band_gpus_logical),
        ];
        for (name, s) in [
            ("tokens per day", &self.tokens_per_day),
            ("revenue", &self.revenue_usd_per_day),
        ] {
            figures.extend([(name, s.hit), (name, s.miss), (name, s.output)]);
        }
        figures.extend(self.utilisation_needed.map(|u| ("utilisation needed", u)));
        figures.extend(self.cache_days_per_gpu.map(|d| ("cache days per GPU", d)));
        figures.extend(
            self.cache_days_at_gpus_needed
                .map(|d| ("cache days per GPU", d)),
        );
        finite_figures(&figures)?;
        shares_check("token share", &self.token_share)?;
        if let Some(r) = &self.revenue_share {
            shares_check("revenue share", r)?;
        }
        Ok(())
    }
}

/// The field errors of out-of-range results name: the inputs as a whole.
pub const INPUTS_FIELD: &str = "inputs";

fn finite_figures(figures: &[(&str, f64)]) -> Result<(), ConfigError> {
    match figures.iter().find(|(_, v)| !v.is_finite()) {
        Some((name, v)) => Err(ConfigError::invalid(
            INPUTS_FIELD,
            format!(
                "{name} comes out as {v}: the inputs are too large or too small for the \
                 arithmetic (every figure must be a finite number)"
            ),
        )),
        None => Ok(()),
    }
}

fn shares_check(name: &str, s: &Split) -> Result<(), ConfigError> {
    let parts = [s.hit, s.miss, s.output];
    let in_range = parts.iter().all(|x| (0.0..=1.0).contains(x));
    if !in_range || (s.total() - 1.0).abs() > 1e-9 {
        return Err(ConfigError::invalid(
            INPUTS_FIELD,
            format!(
                "the {name}s ({}, {}, {}) are not fractions summing to 1: the inputs are too \
                 extreme for the arithmetic",
                s.hit, s.miss, s.output
            ),
        ));
    }
    Ok(())
}

/// Where the lines of the crossing chart cross, as output shares. Along the pool-ratio line
/// every quantity is linear in o (with k = prefill / decode: M = k·O, H = T(1 − o(1 + k))), so
/// each crossing has a closed form.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Crossings {
    /// decode / (prefill + decode): above it the pools cannot be 1 : 1.
    pub max_output_share: f64,
    /// Where capacity count = revenue count; `None` when revenue grows at least as fast as
    /// capacity, so they never cross at a positive share.
    pub break_even_output_share: Option<f64>,
    /// The largest output share that is feasible: min(break-even, max output share).
    pub feasible_up_to_output_share: f64,
    /// Where storage needed = store size (may lie above `max_output_share`).
    pub storage_limit_output_share: f64,
}

pub fn crossings(p: &EconParams) -> Result<Crossings, ConfigError> {
    p.validate()?;
    let t = p.tokens_per_day;
    let k = p.prefill_tps / p.decode_tps;
    let pr = &p.prices;
    let usd_per_gpu_day = p.revenue_per_gpu_hour * HOURS_PER_DAY;
    // GPUs from revenue = a + b·o.
    let a = t * pr.hit_usd_per_mtok / TOKENS_PER_PRICE_UNIT / usd_per_gpu_day;
    let b = t
        * (pr.miss_usd_per_mtok * k + pr.output_usd_per_mtok - pr.hit_usd_per_mtok * (1.0 + k))
        / TOKENS_PER_PRICE_UNIT
        / usd_per_gpu_day;
    // GPUs needed = c·o (prefill and decode pools are equal).
    let c = 2.0 * t / p.decode_tokens_per_gpu_day();
    let max_share = max_output_share(p.prefill_tps, p.decode_tps);
    let break_even = (c > b).then(|| a / (c - b));
    let feasible_up_to = break_even.map_or(max_share, |x| x.min(max_share));
    let storage_limit = p.store_pib * BYTES_PER_PIB
        / ((1.0 + k) * t * p.bytes_per_token * p.ttl_days * p.ec_overhead);
    let mut figures = vec![
        ("max output share", max_share),
        ("feasible output share", feasible_up_to),
        ("storage-limited output share", storage_limit),
    ];
    figures.extend(break_even.map(|b| ("break-even output share", b)));
    finite_figures(&figures)?;
    Ok(Crossings {
        max_output_share: max_share,
        break_even_output_share: break_even,
        feasible_up_to_output_share: feasible_up_to,
        storage_limit_output_share: storage_limit,
    })
}

/// Output shares start, start + step, ... up to stop (inclusive within rounding); `field` names
/// the flag or key in errors.
pub fn share_grid(field: &str, start: f64, stop: f64, step: f64) -> Result<Vec<f64>, ConfigError> {
    share(field, start)?;
    share(field, stop)?;
    if stop < start {
        return Err(ConfigError::invalid(
            field,
            format!("stop {stop} is below start {start}"),
        ));
    }
    if !(step.is_finite() && step > 0.0) {
        return Err(ConfigError::invalid(
            field,
            format!("step must be positive, got {step}"),
        ));
    }
    // The small slack keeps `stop` in the grid when (stop − start) / step is an integer up to
    // rounding (0.3 / 0.1 = 2.9999999999999996).
    let intervals = ((stop - start) / step + 1e-9).floor();
    if intervals >= MAX_SWEEP_POINTS as f64 {
        return Err(ConfigError::invalid(
            field,
            format!("step {step} gives more than {MAX_SWEEP_POINTS} points"),
        ));
    }
    let n = intervals as usize + 1;
    Ok((0..n)
        .map(|i| (start + i as f64 * step).min(stop))
        .collect())
}

/// One measured day of a deployment.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MeasuredDay {
    pub hit_tokens: f64,
    pub miss_tokens: f64,
    pub output_tokens: f64,
    /// Average GPUs online over the day (may be fractional).
    pub gpus: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MeasuredRevenue {
    pub revenue_per_day: f64,
    pub revenue_per_gpu_hour: f64,
    /// Hits ÷ input tokens; `None` without input tokens.
    pub hit_rate: Option<f64>,
    pub output_share: f64,
    pub token_share: Split,
    pub revenue_usd_per_day: Split,
    /// `None` when every price is zero.
    pub revenue_share: Option<Split>,
}

/// Revenue of a measured day at the given prices.
pub fn measured_day(day: &MeasuredDay, prices: &Prices) -> Result<MeasuredRevenue, ConfigError> {
    non_negative("hit_tokens", day.hit_tokens)?;
    non_negative("miss_tokens", day.miss_tokens)?;
    non_negative("output_tokens", day.output_tokens)?;
    positive("gpus", day.gpus)?;
    prices.validate()?;
    let tokens = Split {
        hit: day.hit_tokens,
        miss: day.miss_tokens,
        output: day.output_tokens,
    };
    let Some(token_share) = tokens.shares() else {
        return Err(ConfigError::invalid(
            "hit_tokens",
            "hit, miss and output tokens are all zero: nothing was served",
        ));
    };
    let revenue = prices.revenue_usd(&tokens);
    let revenue_per_day = revenue.total();
    let input = tokens.hit + tokens.miss;
    finite_figures(&[
        ("total tokens", tokens.total()),
        ("revenue per day", revenue_per_day),
        (
            "revenue per GPU-hour",
            revenue_per_day / (day.gpus * HOURS_PER_DAY),
        ),
        ("input tokens", input),
    ])?;
    shares_check("token share", &token_share)?;
    if let Some(r) = revenue.shares() {
        shares_check("revenue share", &r)?;
    }
    Ok(MeasuredRevenue {
        revenue_per_day,
        revenue_per_gpu_hour: revenue_per_day / (day.gpus * HOURS_PER_DAY),
        hit_rate: (input > 0.0).then(|| tokens.hit / input),
        output_share: token_share.output,
        token_share,
        revenue_usd_per_day: revenue,
        revenue_share: revenue.shares(),
    })
}

fn positive(field: &str, v: f64) -> Result<(), ConfigError> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(ConfigError::invalid(
            field,
            format!("must be a positive finite number, got {v}"),
        ))
    }
}

fn non_negative(field: &str, v: f64) -> Result<(), ConfigError> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(ConfigError::invalid(
            field,
            format!("must be a finite number ≥ 0, got {v}"),
        ))
    }
}

fn share(field: &str, v: f64) -> Result<(), ConfigError> {
    if (0.0..1.0).contains(&v) {
        Ok(())
    } else {
        Err(ConfigError::invalid(
            field,
            format!("a share must be in [0, 1), got {v}"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
    }

    macro_rules! assert_close {
        ($a:expr, $b:expr) => {{
            let (a, b) = ($a, $b);
            assert!(close(a, b), "{} = {a}, expected {b}", stringify!($a));
        }};
    }

    /// Round numbers so every figure below can be checked by hand: T = 10¹², prefill 20,000,
    /// decode 10,000 tok/s (k = 2), efficiency 0.8, off-peak prices, 890 B/token, 3 days, EC 1.2.
    fn hand_params(output_share: f64) -> EconParams {
        EconParams {
            tokens_per_day: 1e12,
            output_share,
            prefill_tps: 20_000.0,
            decode_tps: 10_000.0,
            ..EconParams::published(output_share)
        }
    }

    #[test]
    fn hand_case_at_output_share_one_fifth() {
        // 1 − h = 0.2·2 / 0.8 = 0.5 → h = 0.5; H = M = 0.5·0.8·10¹² = 4·10¹¹; O = 2·10¹¹.
        let e = evaluate(&hand_params(0.2)).unwrap();
        assert_close!(e.hit_rate, 0.5);
        assert!(e.pool_ratio_holds);
        assert_close!(e.tokens_per_day.hit, 4e11);
        assert_close!(e.tokens_per_day.miss, 4e11);
        assert_close!(e.tokens_per_day.output, 2e11);
        // Revenue: 0.003·4e5 + 0.15·4e5 + 0.60·2e5 = 1,200 + 60,000 + 120,000 = $181,200.
        assert_close!(e.revenue_usd_per_day.hit, 1_200.0);
        assert_close!(e.revenue_usd_per_day.miss, 60_000.0);
        assert_close!(e.revenue_usd_per_day.output, 120_000.0);
        assert_close!(e.revenue_per_day, 181_200.0);
        // $38 × 24 = $912 per GPU-day.
        assert_close!(e.gpus_from_revenue, 181_200.0 / 912.0);
        // Prefill: 4e11 / (20,000·86,400·0.8 = 1.3824e9); decode: 2e11 / 6.912e8; equal.
        assert_close!(e.prefill_gpus, 4e11 / 1.3824e9);
        assert_close!(e.decode_gpus, 2e11 / 6.912e8);
        assert_close!(e.prefill_gpus, e.decode_gpus);
        assert_close!(e.gpus_needed, 2.0 * 4e11 / 1.3824e9);
        assert_close!(
            e.utilisation_needed.unwrap(),
            (2.0 * 4e11 / 1.3824e9) / (181_200.0 / 912.0)
        );
        assert!(!e.feasible);
        assert_eq!(e.infeasible_reasons.len(), 1);
        assert!(matches!(
            e.infeasible_reasons[0],
            Infeasibility::OverRevenue { .. }
        ));
        // Written 6e11 tokens · 890 B = 5.34e14 B/day; × 3 days × 1.2 = 1.9224e15 B.
        assert_close!(e.written_bytes_per_day, 5.34e14);
        assert_close!(e.storage_pib, 1.9224e15 / 1_125_899_906_842_624.0);
        assert!(e.storage_fits);
        // 100 PiB / 14.4 TB = 7,818.75 GPUs logical; / 1.2 physical.
        assert!((e.store_band_gpus_logical - 7_818.749).abs() < 1e-3);
        assert!((e.store_band_gpus_physical - 6_515.624).abs() < 1e-3);
        assert_close!(
            e.store_band_gpus_logical,
            100.0 * 1_125_899_906_842_624.0 / 14.4e12
        );
        assert_close!(e.store_band_gpus_physical, e.store_band_gpus_logical / 1.2);
        // 14.4e12 B per GPU ÷ (5.34e14 / (181,200 / 912)) B per GPU per day.
        assert_close!(
            e.cache_days_per_gpu.unwrap(),
            14.4e12 / (5.34e14 / (181_200.0 / 912.0))
        );
        assert_close!(
            e.cache_days_at_gpus_needed.unwrap(),
            14.4e12 / (5.34e14 / (2.0 * 4e11 / 1.3824e9))
        );
        assert_close!(e.token_share.hit, 0.4);
        assert_close!(e.token_share.miss, 0.4);
        assert_close!(e.token_share.output, 0.2);
        let rs = e.revenue_share.unwrap();
        assert_close!(rs.hit, 1_200.0 / 181_200.0);
        assert_close!(rs.miss, 60_000.0 / 181_200.0);
        assert_close!(rs.output, 120_000.0 / 181_200.0);
    }

    #[test]
    fn hand_case_feasible_at_low_output_share() {
        // o = 0.01: M = k·O = 2e10, O = 1e10, H = 10¹²·(1 − 0.03) = 9.7e11.
        // Revenue 2,910 + 3,000 + 6,000 = $11,910; at $10/GPU-hour → 11,910 / 240 GPUs.
        let p = EconParams {
            revenue_per_gpu_hour: 10.0,
            ..hand_params(0.01)
        };
        let e = evaluate(&p).unwrap();
        assert_close!(e.hit_rate, 1.0 - 0.01 * 2.0 / 0.99);
        assert_close!(e.tokens_per_day.miss, 2e10);
        assert_close!(e.tokens_per_day.hit, 9.7e11);
        assert_close!(e.revenue_per_day, 11_910.0);
        assert_close!(e.gpus_from_revenue, 11_910.0 / 240.0);
        assert_close!(e.gpus_needed, 2.0 * 2e10 / 1.3824e9);
        assert_close!(
            e.utilisation_needed.unwrap(),
            (2.0 * 2e10 / 1.3824e9) / (11_910.0 / 240.0)
        );
        assert!(e.feasible, "{:?}", e.infeasible_reasons);
    }

    #[test]
    fn pool_ratio_below_zero_hit_rate_is_infeasible_with_reason() {
        // o = 0.5: 1 − h = 0.5·2 / 0.5 = 2 → h = −1; the limit is 10,000 / 30,000 = 1/3.
        let e = evaluate(&hand_params(0.5)).unwrap();
        assert_close!(e.hit_rate_implied, -1.0);
        assert_eq!(e.hit_rate, 0.0);
        assert!(!e.pool_ratio_holds);
        assert!(!e.feasible);
        match &e.infeasible_reasons[0] {
            Infeasibility::PoolRatio {
                implied_hit_rate,
                max_output_share,
            } => {
                assert_close!(*implied_hit_rate, -1.0);
                assert_close!(*max_output_share, 1.0 / 3.0);
            }
            other => panic!("expected the pool-ratio reason, got {other}"),
        }
        assert!(
            e.infeasible_reasons[0]
                .to_string()
                .contains("hit rate -1.0000 < 0")
        );
        // With h clamped to 0 every input token misses: pools are no longer equal.
        assert_close!(e.tokens_per_day.miss, 5e11);
        assert_close!(e.prefill_gpus, 5e11 / 1.3824e9);
        assert_close!(e.decode_gpus, 5e11 / 6.912e8);
    }

    /// Output share 0 needs no GPUs, so there are no 1:1 pools to report (issue 16: "1:1 pools"
    /// of 0 prefill GPUs were printed as feasible).
    #[test]
    fn zero_output_share_needs_no_gpus_and_has_no_pools() {
        let e = evaluate(&hand_params(0.0)).unwrap();
        assert_eq!(e.hit_rate, 1.0);
        assert_eq!(e.gpus_needed, 0.0);
        assert_close!(e.revenue_per_day, 3_000.0);
        assert_eq!(e.utilisation_needed, Some(0.0));
        assert_eq!(e.cache_days_per_gpu, None);
        assert!(!e.pool_ratio_holds && !e.feasible);
        assert!(e.infeasible_reasons[0].to_string().contains("no 1:1 pools"));
    }

    #[test]
    fn zero_prices_leave_no_revenue_share_and_no_utilisation() {
        let p = EconParams {
            prices: Prices::off_peak().scaled(0.0),
            ..hand_params(0.1)
        };
        let e = evaluate(&p).unwrap();
        assert_eq!(e.revenue_share, None);
        assert_eq!(e.gpus_from_revenue, 0.0);
        assert_eq!(e.utilisation_needed, None);
        assert!(!e.feasible);
    }

    #[test]
    fn spec_defaults_at_ten_percent_output() {
        // SPEC numbers, o = 0.1: 1 − h = 0.1·89,500 / (14,500·0.9) = 8,950 / 13,050.
        let e = evaluate(&EconParams::published(0.1)).unwrap();
        assert_close!(e.hit_rate, 1.0 - 8_950.0 / 13_050.0);
        let miss = 8_950.0 / 13_050.0 * 0.9 * 155e12;
        assert_close!(e.tokens_per_day.miss, miss);
        assert_close!(e.prefill_gpus, miss / (89_500.0 * 86_400.0 * 0.8));
        assert_close!(e.decode_gpus, 15.5e12 / (14_500.0 * 86_400.0 * 0.8));
    }

    #[test]
    fn peak_prices_double_off_peak() {
        let p = Prices::peak();
        assert_close!(p.hit_usd_per_mtok, 0.006);
        assert_close!(p.miss_usd_per_mtok, 0.30);
        assert_close!(p.output_usd_per_mtok, 1.20);
    }

    #[test]
    fn config_defaults_peak_and_overrides() {
        let off = EconConfig::default().params(0.1);
        assert_eq!(off, EconParams::published(0.1));
        let peak = EconConfig {
            peak: true,
            ..EconConfig::default()
        };
        assert_eq!(peak.prices(), Prices::peak());
        assert_close!(peak.revenue_per_gpu_hour(), 76.0);
        // Doubling prices and the revenue per GPU-hour leaves the fleet implied by revenue alone.
        let a = evaluate(&off).unwrap();
        let b = evaluate(&peak.params(0.1)).unwrap();
        assert_close!(b.revenue_per_day, 2.0 * a.revenue_per_day);
        assert_close!(b.gpus_from_revenue, a.gpus_from_revenue);
        // Explicit values are taken as given, not doubled.
        let over = EconConfig {
            peak: true,
            price_output: Some(0.5),
            revenue_per_gpu_hour: Some(40.0),
            ..EconConfig::default()
        };
        assert_close!(over.prices().output_usd_per_mtok, 0.5);
        assert_close!(over.prices().miss_usd_per_mtok, 0.30);
        assert_close!(over.revenue_per_gpu_hour(), 40.0);
        let parsed: EconConfig = toml::from_str("decode_tps = 26200\nttl_days = 7").unwrap();
        assert_close!(parsed.params(0.0).decode_tps, 26_200.0);
        assert_close!(parsed.params(0.0).ttl_days, 7.0);
        assert!(toml::from_str::<EconConfig>("decode_tsp = 1").is_err());
    }

    #[test]
    fn crossings_by_hand() {
        // k = 2, revenue GPUs at $912/GPU-day: a = 10¹²·0.003e-6 / 912 = 3,000 / 912;
        // b = 10¹²·(0.15·2 + 0.6 − 0.003·3)e-6 / 912 = 891,000 / 912;
        // c = 2·10¹² / 6.912e8. Break-even o* = a / (c − b).
        let c = crossings(&hand_params(0.0)).unwrap();
        let (a, b, cc) = (3_000.0 / 912.0, 891_000.0 / 912.0, 2e12 / 6.912e8);
        assert_close!(c.break_even_output_share.unwrap(), a / (cc - b));
        assert_close!(c.max_output_share, 1.0 / 3.0);
        assert_close!(c.feasible_up_to_output_share, a / (cc - b));
        // Storage: o·3·10¹²·890·3·1.2 = 100·2⁵⁰.
        assert_close!(
            c.storage_limit_output_share,
            100.0 * 1_125_899_906_842_624.0 / (3e12 * 890.0 * 3.0 * 1.2)
        );
    }

    #[test]
    fn crossings_none_when_revenue_outgrows_capacity() {
        // Very fast decode: capacity grows slower than revenue, so the lines never cross.
        let p = EconParams {
            decode_tps: 1e9,
            prefill_tps: 1e9,
            ..hand_params(0.0)
        };
        let c = crossings(&p).unwrap();
        assert_eq!(c.break_even_output_share, None);
        assert_close!(c.feasible_up_to_output_share, 0.5);
    }

    #[test]
    fn february_2025_disclosure() {
        // SPEC §12: 608B input tokens, 56.3% hits, 168B output, 1,814 GPUs, R1 list prices
        // $0.14 / $0.55 / $2.19. Hits 342.304B, misses 265.696B:
        // 342.304e3·0.14 + 265.696e3·0.55 + 168e3·2.19
        //   = 47,922.56 + 146,132.80 + 367,920.00 = $561,975.36 per day;
        // per GPU-hour: 561,975.36 / (1,814·24 = 43,536) = $12.908...
        let day = MeasuredDay {
            hit_tokens: 608e9 * 0.563,
            miss_tokens: 608e9 * (1.0 - 0.563),
            output_tokens: 168e9,
            gpus: 1_814.0,
        };
        let r1 = Prices {
            hit_usd_per_mtok: 0.14,
            miss_usd_per_mtok: 0.55,
            output_usd_per_mtok: 2.19,
        };
        let r = measured_day(&day, &r1).unwrap();
        assert_close!(r.revenue_usd_per_day.hit, 47_922.56);
        assert_close!(r.revenue_usd_per_day.miss, 146_132.80);
        assert_close!(r.revenue_usd_per_day.output, 367_920.0);
        assert_close!(r.revenue_per_day, 561_975.36);
        assert_close!(r.revenue_per_gpu_hour, 561_975.36 / 43_536.0);
        assert!((r.revenue_per_gpu_hour - 12.908).abs() < 1e-3);
        assert_close!(r.hit_rate.unwrap(), 0.563);
        assert_close!(r.output_share, 168.0 / 776.0);
    }

    #[test]
    fn bad_inputs_name_the_field() {
        let field = |r: Result<EconEstimate, ConfigError>| match r {
            Err(ConfigError::Invalid { field, .. }) => field,
            Ok(_) => panic!("accepted"),
        };
        let base = hand_params(0.1);
        let cases: Vec<(&str, EconParams)> = vec![
            (
                "output_share",
                EconParams {
                    output_share: 1.0,
                    ..base
                },
            ),
            (
                "output_share",
                EconParams {
                    output_share: -0.1,
                    ..base
                },
            ),
            (
                "output_share",
                EconParams {
                    output_share: f64::NAN,
                    ..base
                },
            ),
            (
                "tokens_per_day",
                EconParams {
                    tokens_per_day: 0.0,
                    ..base
                },
            ),
            (
                "prefill_tps",
                EconParams {
                    prefill_tps: 0.0,
                    ..base
                },
            ),
            (
                "decode_tps",
                EconParams {
                    decode_tps: -5.0,
                    ..base
                },
            ),
            (
                "decode_tps",
                EconParams {
                    decode_tps: f64::INFINITY,
                    ..base
                },
            ),
            (
                "efficiency",
                EconParams {
                    efficiency: 0.0,
                    ..base
                },
            ),
            (
                "efficiency",
                EconParams {
                    efficiency: 1.5,
                    ..base
                },
            ),
            (
                "bytes_per_token",
                EconParams {
                    bytes_per_token: 0.0,
                    ..base
                },
            ),
            (
                "ttl_days",
                EconParams {
                    ttl_days: -1.0,
                    ..base
                },
            ),
            (
                "ec_overhead",
                EconParams {
                    ec_overhead: 0.9,
                    ..base
                },
            ),
            (
                "cache_per_gpu_tb",
                EconParams {
                    cache_per_gpu_tb: 0.0,
                    ..base
                },
            ),
            (
                "store_pib",
                EconParams {
                    store_pib: 0.0,
                    ..base
                },
            ),
            (
                "revenue_per_gpu_hour",
                EconParams {
                    revenue_per_gpu_hour: 0.0,
                    ..base
                },
            ),
            (
                "price_miss",
                EconParams {
                    prices: Prices {
                        miss_usd_per_mtok: -0.15,
                        ..Prices::off_peak()
                    },
                    ..base
                },
            ),
        ];
        for (want, p) in cases {
            assert_eq!(field(evaluate(&p)), want);
            assert!(crossings(&p).is_err());
        }
    }

    #[test]
    fn measured_day_rejects_bad_counts() {
        let ok = MeasuredDay {
            hit_tokens: 1.0,
            miss_tokens: 1.0,
            output_tokens: 1.0,
            gpus: 1.0,
        };
        let field = |d: MeasuredDay| match measured_day(&d, &Prices::off_peak()) {
            Err(ConfigError::Invalid { field, .. }) => field,
            Ok(_) => panic!("accepted {d:?}"),
        };
        assert_eq!(field(MeasuredDay { gpus: 0.0, ..ok }), "gpus");
        assert_eq!(
            field(MeasuredDay {
                hit_tokens: -1.0,
                ..ok
            }),
            "hit_tokens"
        );
        assert_eq!(
            field(MeasuredDay {
                output_tokens: f64::NAN,
                ..ok
            }),
            "output_tokens"
        );
        let none = MeasuredDay {
            hit_tokens: 0.0,
            miss_tokens: 0.0,
            output_tokens: 0.0,
            gpus: 1.0,
        };
        assert_eq!(field(none), "hit_tokens");
        // Output only: no hit rate, but revenue is defined.
        let r = measured_day(
            &MeasuredDay {
                hit_tokens: 0.0,
                miss_tokens: 0.0,
                ..ok
            },
            &Prices::off_peak(),
        )
        .unwrap();
        assert_eq!(r.hit_rate, None);
        assert_close!(r.revenue_per_gpu_hour, 0.6e-6 / 24.0);
    }

    #[test]
    fn grid_includes_both_ends() {
        let g = share_grid("s", 0.0, 0.3, 0.1).unwrap();
        assert_eq!(g.len(), 4);
        assert_close!(g[3], 0.3);
        assert_eq!(share_grid("s", 0.1, 0.1, 0.05).unwrap(), vec![0.1]);
        // A step that does not divide the range stops below `stop`.
        assert_eq!(share_grid("s", 0.0, 0.25, 0.1).unwrap().len(), 3);
    }

    #[test]
    fn grid_rejects_bad_ranges() {
        for (a, b, s) in [
            (0.0, 1.0, 0.1),
            (-0.1, 0.5, 0.1),
            (0.5, 0.1, 0.1),
            (0.0, 0.5, 0.0),
            (0.0, 0.5, -0.1),
            (0.0, 0.5, 1e-9),
        ] {
            match share_grid("sweep", a, b, s) {
                Err(ConfigError::Invalid { field, .. }) => assert_eq!(field, "sweep"),
                Ok(g) => panic!("accepted {a}:{b}:{s} ({} points)", g.len()),
            }
        }
    }

    /// Extreme but individually valid inputs either give finite figures with shares in [0, 1]
    /// or are refused: no inf or NaN reaches a table (issue 16).
    #[test]
    fn extreme_inputs_are_refused_not_printed() {
        let base = EconParams::published(0.1);
        for p in [
            EconParams {
                tokens_per_day: 1e308,
                ..base
            },
            EconParams {
                tokens_per_day: 1e300,
                revenue_per_gpu_hour: 1e-300,
                ..base
            },
            EconParams {
                cache_per_gpu_tb: 1e-310,
                ..base
            },
        ] {
            match evaluate(&p) {
                Ok(e) => panic!("accepted {p:?}: {e:?}"),
                Err(ConfigError::Invalid { field, reason }) => {
                    assert_eq!(field, INPUTS_FIELD);
                    assert!(reason.contains("finite"), "{reason}");
                }
            }
        }
        // A tiny load: shares still sum to 1, and there are no pools to call 1:1.
        let e = evaluate(&EconParams {
            tokens_per_day: 5e-324,
            ..base
        })
        .unwrap();
        assert!(close(e.token_share.total(), 1.0));
        assert!(!e.pool_ratio_holds && !e.feasible);
        assert!(matches!(
            e.infeasible_reasons[0],
            Infeasibility::NoPools { .. }
        ));
        // Output share 0: no decode pool.
        let e = evaluate(&EconParams::published(0.0)).unwrap();
        assert!(!e.pool_ratio_holds);
        let day = MeasuredDay {
            hit_tokens: 1e308,
            miss_tokens: 1e308,
            output_tokens: 0.0,
            gpus: 1.0,
        };
        assert!(measured_day(&day, &Prices::off_peak()).is_err());
        let day = MeasuredDay {
            hit_tokens: 1.0,
            miss_tokens: 1.0,
            output_tokens: 1.0,
            gpus: 1e-320,
        };
        assert!(measured_day(&day, &Prices::off_peak()).is_err());
    }

    proptest! {
        #[test]
        fn pools_are_equal_wherever_the_ratio_holds(
            o in 0.0f64..0.99,
            prefill in 1e3f64..1e6,
            decode in 1e2f64..1e5,
            eff in 0.05f64..=1.0,
        ) {
            let p = EconParams { output_share: o, prefill_tps: prefill, decode_tps: decode,
                                 efficiency: eff, ..EconParams::published(o) };
            let e = evaluate(&p).unwrap();
            let limit = max_output_share(prefill, decode);
            let pools = e.prefill_gpus >= 1.0 && e.decode_gpus >= 1.0;
            prop_assert_eq!(e.pool_ratio_holds, e.hit_rate_implied >= 0.0 && pools);
            if o < limit * (1.0 - 1e-9) && pools {
                prop_assert!(e.pool_ratio_holds);
                prop_assert!(close(e.prefill_gpus, e.decode_gpus));
            }
            if o > limit * (1.0 + 1e-9) {
                prop_assert!(!e.pool_ratio_holds);
                prop_assert!(!e.feasible);
            }
            prop_assert!(close(e.token_share.total(), 1.0));
            prop_assert!(close(e.revenue_share.unwrap().total(), 1.0));
            prop_assert!(close(e.tokens_per_day.total(), p.tokens_per_day));
            prop_assert_eq!(e.feasible, e.infeasible_reasons.is_empty());
            if e.feasible {
                prop_assert!(e.utilisation_needed.unwrap() <= 1.0);
            }
        }

        #[test]
        fn break_even_is_where_utilisation_is_one(
            prefill in 1e3f64..1e6,
            decode in 1e2f64..1e5,
            tokens in 1e9f64..1e15,
        ) {
            let base = EconParams { tokens_per_day: tokens, prefill_tps: prefill,
                                    decode_tps: decode, ..EconParams::published(0.0) };
            let c = crossings(&base).unwrap();
            if let Some(o) = c.break_even_output_share.filter(|&o| o < c.max_output_share) {
                let e = evaluate(&EconParams { output_share: o, ..base }).unwrap();
                prop_assert!((e.utilisation_needed.unwrap() - 1.0).abs() < 1e-6);
            }
            let o = c.storage_limit_output_share;
            if o < c.max_output_share {
                let e = evaluate(&EconParams { output_share: o, ..base }).unwrap();
                prop_assert!((e.storage_pib / base.store_pib - 1.0).abs() < 1e-6);
            }
        }
    }
}
