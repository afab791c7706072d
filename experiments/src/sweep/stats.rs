//! Mean and Student-t confidence interval of a metric over seeds.

/// Mean, sample standard deviation and the 95 % interval's half-width over `xs`; the last two
/// are None for fewer than two values (no spread to estimate).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Interval {
    pub n: usize,
    pub mean: f64,
    pub std: Option<f64>,
    pub half_width: Option<f64>,
}

impl Interval {
    pub fn of(xs: &[f64]) -> Option<Interval> {
        let n = xs.len();
        if n == 0 {
            return None;
        }
        let mean = xs.iter().sum::<f64>() / n as f64;
        if n < 2 {
            return Some(Interval {
                n,
                mean,
                std: None,
                half_width: None,
            });
        }
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
        let std = var.sqrt();
        let t = t_quantile(0.975, (n - 1) as f64);
        Some(Interval {
            n,
            mean,
            std: Some(std),
            half_width: Some(t * std / (n as f64).sqrt()),
        })
    }

    pub fn low(&self) -> Option<f64> {
        self.half_width.map(|h| self.mean - h)
    }

    pub fn high(&self) -> Option<f64> {
        self.half_width.map(|h| self.mean + h)
    }
}

/// ln Γ(x) for x > 0 (Lanczos, g = 7, n = 9: ~15 digits).
fn ln_gamma(x: f64) -> f64 {
    const G: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    if x < 0.5 {
        // Reflection: Γ(x) Γ(1 − x) = π / sin(πx).
        return (std::f64::consts::PI / (std::f64::consts::PI * x).sin()).ln() - ln_gamma(1.0 - x);
    }
    let x = x - 1.0;
    let mut a = G[0];
    let t = x + 7.5;
    for (i, g) in G.iter().enumerate().skip(1) {
        a += g / (x + i as f64);
    }
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + a.ln()
}

/// Continued fraction of the incomplete beta function (modified Lentz).
fn beta_cf(a: f64, b: f64, x: f64) -> f64 {
    const TINY: f64 = 1e-300;
    let (qab, qap, qam) = (a + b, a + 1.0, a - 1.0);
    let mut c = 1.0;
    let mut d = 1.0 - qab * x / qap;
    if d.abs() < TINY {
        d = TINY;
    }
    d = 1.0 / d;
    let mut h = d;
    for m in 1..300 {
        let m = f64::from(m);
        let m2 = 2.0 * m;
        let aa = m * (b - m) * x / ((qam + m2) * (a + m2));
        d = 1.0 + aa * d;
        if d.abs() < TINY {
            d = TINY;
        }
        c = 1.0 + aa / c;
        if c.abs() < TINY {
            c = TINY;
        }
        d = 1.0 / d;
        h *= d * c;
        let aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2));
        d = 1.0 + aa * d;
        if d.abs() < TINY {
            d = TINY;
        }
        c = 1.0 + aa / c;
        if c.abs() < TINY {
            c = TINY;
        }
        d = 1.0 / d;
        let del = d * c;
        h *= del;
        if (del - 1.0).abs() < 1e-15 {
            break;
        }
    }
    h
}

/// The regularised incomplete beta function I_x(a, b).
fn beta_inc(a: f64, b: f64, x: f64) -> f64 {
    if x <= 0.0 {
        return 0.0;
    }
    if x >= 1.0 {
        return 1.0;
    }
    let front =
        (ln_gamma(a + b) - ln_gamma(a) - ln_gamma(b) + a * x.ln() + b * (1.0 - x).ln()).exp();
    if x < (a + 1.0) / (a + b + 2.0) {
        front * beta_cf(a, b, x) / a
    } else {
        1.0 - front * beta_cf(b, a, 1.0 - x) / b
    }
}

/// P(T ≤ t) for Student's t with `df` degrees of freedom.
pub fn t_cdf(t: f64, df: f64) -> f64 {
    let tail = 0.5 * beta_inc(df / 2.0, 0.5, df / (df + t * t));
    if t >= 0.0 { 1.0 - tail } else { tail }
}

/// The p-quantile of Student's t (bisection on the CDF; p in (0, 1)).
pub fn t_quantile(p: f64, df: f64) -> f64 {
    let (mut lo, mut hi) = (-1e4, 1e4);
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if t_cdf(mid, df) < p {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn t_quantiles_match_the_tables() {
        // Two-sided 95 % critical values (any statistics table).
        for (df, want) in [
            (1.0, 12.706),
            (2.0, 4.303),
            (3.0, 3.182),
            (4.0, 2.776),
            (9.0, 2.262),
            (29.0, 2.045),
            (1000.0, 1.962),
        ] {
            let got = t_quantile(0.975, df);
            assert!((got - want).abs() < 1e-3, "df {df}: {got} vs {want}");
        }
        assert!((t_cdf(0.0, 5.0) - 0.5).abs() < 1e-12);
    }

    #[test]
    fn interval_of_three_values() {
        let i = Interval::of(&[1.0, 2.0, 3.0]).unwrap();
        assert_eq!(i.mean, 2.0);
        assert!((i.std.unwrap() - 1.0).abs() < 1e-12);
        // t(0.975, 2) · 1 / √3 = 4.303 / 1.732 = 2.484.
        assert!((i.half_width.unwrap() - 2.484).abs() < 1e-3);
        let one = Interval::of(&[5.0]).unwrap();
        assert_eq!((one.mean, one.half_width), (5.0, None));
        assert!(Interval::of(&[]).is_none());
    }
}
