//! The autoscaler's policy (SPEC §8), sans-IO: at every metrics interval it takes `now` and
//! what a production controller sees of the last interval ([`Observation`]: the pools' sizes,
//! busy fraction, queue, slot occupancy, recent TTFT and TPOT) and returns the sizes it wants
//! ([`Decision`]). It never sees the future load. The unit carries the decision out
//! ([`crate::unit::scaling`]): a scale-up takes the provisioning delay, a scale-down of decode
//! goes through the drain.
//!
//! Policies: `fixed` (the baseline: pools as configured), `utilisation` (size each pool so its
//! busy fraction / slot occupancy sits at a target, plus one engine when the prefill queue is
//! long) and `slo` (grow a pool while its recent p90 latency is over the SLO, shrink it while
//! well under). Hysteresis: a pool grows at once but shrinks only after `down_after`
//! consecutive intervals that call for it, and not within `cooldown` of its last change.

use crate::error::ConfigError;
use crate::time::Nanos;
use serde::{Deserialize, Serialize};

/// Bounds of one pool (prefill engines, or decode groups).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Bounds {
    pub min: u32,
    pub max: u32,
    /// Size at the start (default: `max`, the pools sized for the peak).
    #[serde(default)]
    pub initial: Option<u32>,
}

impl Bounds {
    pub fn initial(&self) -> u32 {
        self.initial.unwrap_or(self.max)
    }
    fn clamp(&self, n: u32) -> u32 {
        n.clamp(self.min, self.max)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum ScalePolicy {
    /// Never changes the pools.
    Fixed,
    /// Prefill sized for `prefill_busy` busy fraction, decode for `decode_occupancy` of its
    /// slots; shrink only below target − `band`; a prefill queue above `queue_per_engine` per
    /// engine adds an engine.
    Utilisation {
        prefill_busy: f64,
        decode_occupancy: f64,
        band: f64,
        queue_per_engine: f64,
    },
    /// Grow prefill while the recent p90 TTFT exceeds `ttft`, decode while the p90 TPOT
    /// exceeds `tpot`; shrink while under `low` × the SLO.
    Slo { ttft: Nanos, tpot: Nanos, low: f64 },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AutoscaleConfig {
    pub policy: ScalePolicy,
    pub prefill: Bounds,
    pub decode: Bounds,
    /// From a scale-up decision to the new GPUs serving.
    pub provision_delay: Nanos,
    /// Intervals in a row that must call for a smaller pool before it shrinks.
    pub down_after: u32,
    /// No shrink within this long of the pool's last change.
    pub cooldown: Nanos,
}

impl AutoscaleConfig {
    /// Checks the keys against the pools' sizes (`prefill_gpus` engines and `decode_groups`
    /// groups are the GPUs there are); errors name `autoscale.<field>`.
    pub fn validate(&self, prefill_gpus: u32, decode_groups: u32) -> Result<(), ConfigError> {
        for (name, b, have, what) in [
            ("prefill", self.prefill, prefill_gpus, "prefill.gpus"),
            ("decode", self.decode, decode_groups, "decode.groups"),
        ] {
            let f = |k: &str| format!("autoscale.{name}.{k}");
            if b.min > b.max {
                return Err(ConfigError::invalid(
                    f("min"),
                    format!("min {} is above max {}", b.min, b.max),
                ));
            }
            if b.min == 0 {
                return Err(ConfigError::invalid(f("min"), "a pool keeps at least one"));
            }
            if b.max > have {
                return Err(ConfigError::invalid(
                    f("max"),
                    format!("{} is more than the {have} of `{what}`", b.max),
                ));
            }
            if !(b.min..=b.max).contains(&b.initial()) {
                return Err(ConfigError::invalid(
                    f("initial"),
                    format!("{} is outside [{}, {}]", b.initial(), b.min, b.max),
                ));
            }
        }
        self.policy.validate()?;
        if self.down_after == 0 {
            return Err(ConfigError::invalid(
                "autoscale.down_after",
                "must be at least 1",
            ));
        }
        Ok(())
    }
}

impl ScalePolicy {
    fn validate(&self) -> Result<(), ConfigError> {
        let frac = |name: &str, v: f64| {
            if v.is_finite() && v > 0.0 && v <= 1.0 {
                Ok(())
            } else {
                Err(ConfigError::invalid(
                    format!("autoscale.policy.{name}"),
                    format!("{v} must be in (0, 1]"),
                ))
            }
        };
        match self {
            ScalePolicy::Fixed => Ok(()),
            ScalePolicy::Utilisation {
                prefill_busy,
                decode_occupancy,
                band,
                queue_per_engine,
            } => {
                frac("prefill_busy", *prefill_busy)?;
                frac("decode_occupancy", *decode_occupancy)?;
                if !(band.is_finite()
                    && *band >= 0.0
                    && *band < prefill_busy.min(*decode_occupancy))
                {
                    return Err(ConfigError::invalid(
                        "autoscale.policy.band",
                        format!("{band} must be at least 0 and below both targets"),
                    ));
                }
                if !(queue_per_engine.is_finite() && *queue_per_engine > 0.0) {
                    return Err(ConfigError::invalid(
                        "autoscale.policy.queue_per_engine",
                        "must be positive",
                    ));
                }
                Ok(())
            }
            ScalePolicy::Slo { ttft, tpot, low } => {
                frac("low", *low)?;
                if *ttft == Nanos::ZERO || *tpot == Nanos::ZERO {
                    return Err(ConfigError::invalid(
                        "autoscale.policy.ttft",
                        "SLOs must be positive",
                    ));
                }
                Ok(())
            }
        }
    }
}

/// What the controller sees at the end of an interval.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Observation {
    /// Prefill engines serving or being provisioned, and decode groups likewise.
    pub prefill_engines: u32,
    pub decode_groups: u32,
    /// Busy fraction of the serving prefill engines over the interval.
    pub prefill_busy: f64,
    /// Requests queued for prefill (balancer and engines).
    pub prefill_queued: u64,
    /// Decode sequences held ÷ slots of the serving groups.
    pub decode_occupancy: f64,
    /// p90 of the TTFTs / TPOTs of requests that got their first token / finished in the
    /// interval (None: none did).
    pub ttft_p90: Option<Nanos>,
    pub tpot_p90: Option<Nanos>,
}

/// Pool sizes the controller wants (None: leave it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Decision {
    pub prefill: Option<u32>,
    pub decode: Option<u32>,
}

/// `x` rounded up, ignoring the last bits of rounding error (4 × 0.9 ÷ 0.6 is 6, not 7).
fn ceil(x: f64) -> u32 {
    (x - 1e-9).ceil().max(0.0) as u32
}

/// One pool's hysteresis.
#[derive(Clone, Copy, Debug, Default)]
struct PoolState {
    low_intervals: u32,
    last_change: Option<Nanos>,
}

pub struct Autoscaler {
    cfg: AutoscaleConfig,
    prefill: PoolState,
    decode: PoolState,
}

impl Autoscaler {
    pub fn new(cfg: AutoscaleConfig) -> Self {
        Autoscaler {
            cfg,
            prefill: PoolState::default(),
            decode: PoolState::default(),
        }
    }
    pub fn config(&self) -> &AutoscaleConfig {
        &self.cfg
    }

    /// The sizes wanted after the interval ending at `now`.
    pub fn decide(&mut self, now: Nanos, o: &Observation) -> Decision {
        let (p, d) = match self.cfg.policy.clone() {
            ScalePolicy::Fixed => return Decision::default(),
            ScalePolicy::Utilisation {
                prefill_busy,
                decode_occupancy,
                band,
                queue_per_engine,
            } => {
                let n = f64::from(o.prefill_engines);
                let mut p = ceil(n * o.prefill_busy / prefill_busy);
                if o.prefill_queued as f64 > queue_per_engine * n {
                    p = p.max(o.prefill_engines + 1);
                }
                let p_low = o.prefill_busy < prefill_busy - band;
                let g = f64::from(o.decode_groups);
                let d = ceil(g * o.decode_occupancy / decode_occupancy);
                let d_low = o.decode_occupancy < decode_occupancy - band;
                ((p, p_low), (d, d_low))
            }
            ScalePolicy::Slo { ttft, tpot, low } => {
                let step = |n: u32, lat: Option<Nanos>, slo: Nanos| match lat {
                    Some(l) if l > slo => (n + (n / 4).max(1), false),
                    Some(l) if l.0 as f64 >= low * slo.0 as f64 => (n, false),
                    // Under the low mark, or no request at all in the interval.
                    _ => (n.saturating_sub(1), true),
                };
                let p = step(o.prefill_engines, o.ttft_p90, ttft);
                let d = step(o.decode_groups, o.tpot_p90, tpot);
                (p, d)
            }
        };
        Decision {
            prefill: Self::pool(
                &mut self.prefill,
                &self.cfg,
                self.cfg.prefill,
                now,
                o.prefill_engines,
                p,
            ),
            decode: Self::pool(
                &mut self.decode,
                &self.cfg,
                self.cfg.decode,
                now,
                o.decode_groups,
                d,
            ),
        }
    }

    /// Applies bounds and hysteresis to one pool's wish (`want`, and whether the interval
    /// counts as low).
    fn pool(
        st: &mut PoolState,
        cfg: &AutoscaleConfig,
        b: Bounds,
        now: Nanos,
        have: u32,
        (want, low): (u32, bool),
    ) -> Option<u32> {
        let want = b.clamp(want);
        if want > have {
            st.low_intervals = 0;
            st.last_change = Some(now);
            return Some(want);
        }
        if want == have || !low {
            st.low_intervals = 0;
            return None;
        }
        st.low_intervals += 1;
        let cooled = st
            .last_change
            .is_none_or(|t| now >= t.saturating_add(cfg.cooldown));
        if st.low_intervals < cfg.down_after || !cooled {
            return None;
        }
        st.low_intervals = 0;
        st.last_change = Some(now);
        // At most half the pool at once, so one quiet interval cannot empty it.
        Some(want.max(have - have / 2).max(b.min))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(policy: ScalePolicy) -> AutoscaleConfig {
        AutoscaleConfig {
            policy,
            prefill: Bounds {
                min: 2,
                max: 16,
                initial: Some(4),
            },
            decode: Bounds {
                min: 1,
                max: 4,
                initial: Some(1),
            },
            provision_delay: Nanos::from_secs(60),
            down_after: 3,
            cooldown: Nanos::from_secs(120),
        }
    }

    fn util() -> ScalePolicy {
        ScalePolicy::Utilisation {
            prefill_busy: 0.6,
            decode_occupancy: 0.7,
            band: 0.2,
            queue_per_engine: 4.0,
        }
    }

    fn obs(engines: u32, busy: f64, groups: u32, occ: f64) -> Observation {
        Observation {
            prefill_engines: engines,
            decode_groups: groups,
            prefill_busy: busy,
            decode_occupancy: occ,
            ..Default::default()
        }
    }

    #[test]
    fn utilisation_grows_at_once_and_shrinks_after_hysteresis() {
        let mut a = Autoscaler::new(cfg(util()));
        // 4 engines 90 % busy → 4 × 0.9 / 0.6 = 6; 1 group at 0.95 → 2.
        let d = a.decide(Nanos::from_secs(10), &obs(4, 0.9, 1, 0.95));
        assert_eq!(
            d,
            Decision {
                prefill: Some(6),
                decode: Some(2)
            }
        );
        // 6 engines at 10 %: wants 1 → min 2, but only after 3 low intervals and the cooldown
        // (120 s after the change at 10 s), and then at most half: 3.
        let quiet = obs(6, 0.1, 2, 0.7);
        for t in [20, 30, 40, 120] {
            assert_eq!(
                a.decide(Nanos::from_secs(t), &quiet).prefill,
                None,
                "t = {t}"
            );
        }
        assert_eq!(a.decide(Nanos::from_secs(130), &quiet).prefill, Some(3));
        // A busy interval resets the count.
        assert_eq!(
            a.decide(Nanos::from_secs(160), &obs(3, 0.5, 2, 0.7))
                .prefill,
            None
        );
    }

    #[test]
    fn a_long_queue_adds_an_engine_and_bounds_hold() {
        let mut a = Autoscaler::new(cfg(util()));
        let mut o = obs(16, 0.5, 4, 0.99);
        o.prefill_queued = 100;
        // Already at max: nothing to add.
        assert_eq!(a.decide(Nanos::from_secs(10), &o), Decision::default());
        o.prefill_engines = 4;
        assert_eq!(a.decide(Nanos::from_secs(20), &o).prefill, Some(5));
    }

    #[test]
    fn slo_policy_follows_recent_latency() {
        let slo = ScalePolicy::Slo {
            ttft: Nanos::from_secs(2),
            tpot: Nanos::from_millis(50),
            low: 0.5,
        };
        let mut a = Autoscaler::new(cfg(slo));
        let mut o = obs(8, 0.5, 2, 0.5);
        o.ttft_p90 = Some(Nanos::from_secs(3));
        o.tpot_p90 = Some(Nanos::from_millis(40));
        assert_eq!(
            a.decide(Nanos::from_secs(10), &o),
            Decision {
                prefill: Some(10),
                decode: None
            }
        );
        o.ttft_p90 = Some(Nanos::from_millis(500));
        o.tpot_p90 = Some(Nanos::from_millis(10));
        let mut got = Vec::new();
        for t in (140..200).step_by(10) {
            got.push(a.decide(Nanos::from_secs(t), &o));
        }
        assert_eq!(
            got[2],
            Decision {
                prefill: Some(7),
                decode: Some(1)
            }
        );
    }

    #[test]
    fn bad_bounds_name_the_field() {
        let mut c = cfg(ScalePolicy::Fixed);
        c.decode.min = 5;
        let e = c.validate(16, 4).unwrap_err().to_string();
        assert!(
            e.contains("autoscale.decode.min") && e.contains("above max"),
            "{e}"
        );
        let mut c = cfg(ScalePolicy::Fixed);
        c.prefill.max = 17;
        assert!(
            c.validate(16, 4)
                .unwrap_err()
                .to_string()
                .contains("autoscale.prefill.max")
        );
        let mut c = cfg(ScalePolicy::Fixed);
        c.prefill.initial = Some(1);
        assert!(
            c.validate(16, 4)
                .unwrap_err()
                .to_string()
                .contains("autoscale.prefill.initial")
        );
    }
}
