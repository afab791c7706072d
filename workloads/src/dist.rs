//! Length and time distributions for the generators, chosen in configs as tagged enums:
//! `{ kind = "uniform", min = 200, max = 4000 }`, `{ kind = "lognormal", median = 100, sigma = 0.8 }`,
//! `{ kind = "fixed", value = 40 }`, `{ kind = "exponential", mean = 30.0 }`.

use rand::Rng;
use rand_distr::{Distribution, Exp, LogNormal};
use serde::{Deserialize, Serialize};
use servelab_core::ConfigError;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Dist {
    Fixed {
        value: f64,
    },
    /// Uniform on [min, max].
    Uniform {
        min: f64,
        max: f64,
    },
    /// exp(N(ln median, sigma²)), clamped to [min, max].
    Lognormal {
        median: f64,
        sigma: f64,
        #[serde(default)]
        min: Option<f64>,
        #[serde(default)]
        max: Option<f64>,
    },
    Exponential {
        mean: f64,
    },
}

impl Dist {
    pub fn validate(&self, field: &str) -> Result<(), ConfigError> {
        let bad = |why: &str| Err(ConfigError::invalid(field, why));
        let finite_nonneg = |x: f64| x.is_finite() && x >= 0.0;
        match *self {
            Dist::Fixed { value } if !finite_nonneg(value) => bad("value must be finite and >= 0"),
            Dist::Uniform { min, max }
                if !(finite_nonneg(min) && finite_nonneg(max) && min <= max) =>
            {
                bad("need 0 <= min <= max")
            }
            Dist::Lognormal {
                median,
                sigma,
                min,
                max,
            } => {
                if !(median.is_finite() && median > 0.0) {
                    return bad("median must be positive");
                }
                if !(sigma.is_finite() && sigma >= 0.0) {
                    return bad("sigma must be >= 0");
                }
                if let (Some(a), Some(b)) = (min, max)
                    && a > b
                {
                    return bad("min must not exceed max");
                }
                Ok(())
            }
            Dist::Exponential { mean } if !(mean.is_finite() && mean > 0.0) => {
                bad("mean must be positive")
            }
            _ => Ok(()),
        }
    }

    pub fn sample(&self, rng: &mut impl Rng) -> f64 {
        match *self {
            Dist::Fixed { value } => value,
            Dist::Uniform { min, max } => {
                if max > min {
                    rng.random_range(min..=max)
                } else {
                    min
                }
            }
            Dist::Lognormal {
                median,
                sigma,
                min,
                max,
            } => {
                let x = LogNormal::new(median.ln(), sigma)
                    .map(|d| d.sample(rng))
                    .unwrap_or(median);
                x.clamp(min.unwrap_or(0.0), max.unwrap_or(f64::MAX))
            }
            Dist::Exponential { mean } => {
                Exp::new(1.0 / mean).map(|d| d.sample(rng)).unwrap_or(mean)
            }
        }
    }

    /// A token count: rounded, at least `floor`.
    pub fn tokens(&self, rng: &mut impl Rng, floor: u32) -> u32 {
        let v = self.sample(rng).round();
        (v.min(u32::MAX as f64) as u32).max(floor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn sample_ranges() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let u = Dist::Uniform {
            min: 200.0,
            max: 4000.0,
        };
        for _ in 0..1000 {
            let x = u.tokens(&mut rng, 1);
            assert!((200..=4000).contains(&x));
        }
        let l = Dist::Lognormal {
            median: 100.0,
            sigma: 1.0,
            min: Some(10.0),
            max: Some(500.0),
        };
        let mut v: Vec<f64> = (0..2001).map(|_| l.sample(&mut rng)).collect();
        v.sort_by(f64::total_cmp);
        assert!((80.0..125.0).contains(&v[1000]), "median {}", v[1000]);
        assert!(v[0] >= 10.0 && v[2000] <= 500.0);
    }

    #[test]
    fn rejects_bad_parameters() {
        assert!(Dist::Uniform { min: 5.0, max: 1.0 }.validate("x").is_err());
        assert!(Dist::Exponential { mean: 0.0 }.validate("x").is_err());
        let e =
            toml::from_str::<Dist>("kind = \"uniform\"\nmin = 1\nmax = 2\nmean = 3\n").unwrap_err();
        assert!(e.to_string().contains("mean"), "{e}");
    }
}
