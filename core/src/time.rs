//! Integer simulated time. Every policy takes `now` as a [`Nanos`]; nothing reads a wall clock.
//!
//! Three values are distinct by construction:
//! - finite times and durations up to [`Nanos::HORIZON`] (2^62 ns, about 146 years): the only
//!   ones accepted from input (configs, traces, the CLI); anything later is refused with an
//!   error, so no input can reach saturation;
//! - [`Nanos::MAX`], the largest finite time: saturating arithmetic stops there, and it is
//!   *not* "never" (an object whose expiry saturated expires at `MAX`);
//! - [`Nanos::NEVER`]: no deadline, no expiry. Nothing finite reaches it, and `NEVER` plus or
//!   minus a finite duration stays `NEVER`.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::ops::{Add, AddAssign, Sub};

/// A point in time or a duration, in nanoseconds since the start of a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Nanos(pub u64);

/// The duration forms accepted in configs and on the command line, for error messages.
pub const DURATION_FORMS: &str =
    "a number with a unit, e.g. \"3d\", \"180s\", \"250ms\" (units: ns, us, ms, s, min, h, d)";

impl Nanos {
    pub const ZERO: Nanos = Nanos(0);
    /// No deadline, no expiry: later than every finite time, and never the result of finite
    /// arithmetic.
    pub const NEVER: Nanos = Nanos(u64::MAX);
    /// The largest finite time, where saturating arithmetic stops (not [`Nanos::NEVER`]).
    pub const MAX: Nanos = Nanos(u64::MAX - 1);
    /// The latest time and the longest duration accepted from input: 2^62 ns ≈ 146 years. A
    /// time plus a duration, both within the horizon, is finite and below [`Nanos::MAX`].
    pub const HORIZON: Nanos = Nanos(1 << 62);

    pub const fn from_secs(s: u64) -> Self {
        Nanos(s * 1_000_000_000)
    }
    pub const fn from_millis(ms: u64) -> Self {
        Nanos(ms * 1_000_000)
    }
    pub const fn from_micros(us: u64) -> Self {
        Nanos(us * 1_000)
    }
    /// Rounds to the nearest nanosecond; negative and NaN inputs become zero, and times past
    /// the range saturate at [`Nanos::MAX`] (finite, not never). Input must go through
    /// [`Nanos::try_from_secs_f64`] instead, which refuses what is beyond the horizon.
    pub fn from_secs_f64(s: f64) -> Self {
        if s.is_nan() || s <= 0.0 {
            Nanos(0)
        } else if s >= u64::MAX as f64 / 1e9 {
            Nanos::MAX
        } else {
            Nanos((s * 1e9).round() as u64).min(Nanos::MAX)
        }
    }
    /// Seconds to nanoseconds, refusing NaN, negative values and anything past
    /// [`Nanos::HORIZON`]; the error says which.
    pub fn try_from_secs_f64(s: f64) -> Result<Self, String> {
        if !s.is_finite() || s < 0.0 {
            return Err(format!("{s} s is not a time (need a finite value >= 0)"));
        }
        let t = Nanos::from_secs_f64(s);
        if t > Nanos::HORIZON {
            return Err(format!(
                "{s} s is beyond the horizon of {} s (about 146 years)",
                Nanos::HORIZON.0 / 1_000_000_000
            ));
        }
        Ok(t)
    }
    /// Milliseconds to nanoseconds, with the rules of [`Nanos::try_from_secs_f64`].
    pub fn try_from_millis_f64(ms: f64) -> Result<Self, String> {
        if !ms.is_finite() || ms < 0.0 {
            return Err(format!("{ms} ms is not a time (need a finite value >= 0)"));
        }
        Nanos::try_from_secs_f64(ms / 1e3).map_err(|_| {
            format!(
                "{ms} ms is beyond the horizon of {} s (about 146 years)",
                Nanos::HORIZON.0 / 1_000_000_000
            )
        })
    }
    /// `self` if it is within [`Nanos::HORIZON`], else an error naming the horizon.
    pub fn within_horizon(self) -> Result<Self, String> {
        if self > Nanos::HORIZON {
            Err(format!(
                "{} ns is beyond the horizon of {} ns (about 146 years)",
                self.0,
                Nanos::HORIZON.0
            ))
        } else {
            Ok(self)
        }
    }
    pub const fn is_never(self) -> bool {
        self.0 == u64::MAX
    }
    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / 1e9
    }
    pub fn as_millis_f64(self) -> f64 {
        self.0 as f64 / 1e6
    }
    /// `NEVER` absorbs; finite sums stop at [`Nanos::MAX`].
    pub const fn saturating_add(self, d: Nanos) -> Nanos {
        if self.is_never() || d.is_never() {
            return Nanos::NEVER;
        }
        let s = self.0.saturating_add(d.0);
        if s > Nanos::MAX.0 {
            Nanos::MAX
        } else {
            Nanos(s)
        }
    }
    /// `NEVER` minus a finite duration stays `NEVER`; finite differences stop at zero.
    pub const fn saturating_sub(self, d: Nanos) -> Nanos {
        if self.is_never() && !d.is_never() {
            return Nanos::NEVER;
        }
        Nanos(self.0.saturating_sub(d.0))
    }
    /// The sum, if it stays within [`Nanos::HORIZON`].
    pub fn checked_add(self, d: Nanos) -> Option<Nanos> {
        self.0
            .checked_add(d.0)
            .map(Nanos)
            .filter(|t| *t <= Nanos::HORIZON)
    }
}

impl Add for Nanos {
    type Output = Nanos;
    fn add(self, rhs: Nanos) -> Nanos {
        self.saturating_add(rhs)
    }
}
impl AddAssign for Nanos {
    fn add_assign(&mut self, rhs: Nanos) {
        *self = *self + rhs;
    }
}
impl Sub for Nanos {
    type Output = Nanos;
    fn sub(self, rhs: Nanos) -> Nanos {
        self.saturating_sub(rhs)
    }
}

impl fmt::Display for Nanos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_never() {
            return write!(f, "never");
        }
        let ns = self.0;
        let (v, unit) = if ns.is_multiple_of(86_400_000_000_000) && ns > 0 {
            (ns / 86_400_000_000_000, "d")
        } else if ns.is_multiple_of(3_600_000_000_000) && ns > 0 {
            (ns / 3_600_000_000_000, "h")
        } else if ns.is_multiple_of(60_000_000_000) && ns > 0 {
            (ns / 60_000_000_000, "min")
        } else if ns.is_multiple_of(1_000_000_000) {
            (ns / 1_000_000_000, "s")
        } else if ns.is_multiple_of(1_000_000) {
            (ns / 1_000_000, "ms")
        } else if ns.is_multiple_of(1_000) {
            (ns / 1_000, "us")
        } else {
            (ns, "ns")
        };
        write!(f, "{v}{unit}")
    }
}

/// Parses a duration: a number and a unit, such as `3d`, `7d`, `180s`, `3min`, `250ms`,
/// `1.5h` or `42ns`. A bare number is refused (it would be seconds to some readers and
/// nanoseconds to others), as is anything past [`Nanos::HORIZON`]. Errors name what was wrong
/// and show the accepted forms; callers add the file and field.
pub fn parse_duration(text: &str) -> Result<Nanos, String> {
    let t = text.trim();
    if t.is_empty() {
        return Err(format!("empty duration: write {DURATION_FORMS}"));
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let num = num.replace('_', "");
    let value: f64 = num
        .parse()
        .map_err(|_| format!("`{text}` is not a duration: write {DURATION_FORMS}"))?;
    let scale = match unit.trim() {
        "" => {
            return Err(format!("`{text}` has no unit: write {DURATION_FORMS}"));
        }
        "ns" | "nsec" => 1.0,
        "us" | "µs" | "usec" => 1e3,
        "ms" | "msec" => 1e6,
        "s" | "sec" | "secs" | "second" | "seconds" => 1e9,
        "m" | "min" | "mins" | "minute" | "minutes" => 60e9,
        "h" | "hr" | "hrs" | "hour" | "hours" => 3600e9,
        "d" | "day" | "days" => 86_400e9,
        other => {
            return Err(format!(
                "`{text}`: unknown duration unit `{other}` (use ns, us, ms, s, min, h or d)"
            ));
        }
    };
    let ns = value * scale;
    if !ns.is_finite() || ns > Nanos::HORIZON.0 as f64 {
        return Err(format!(
            "`{text}` is beyond the horizon of 146 years ({} ns)",
            Nanos::HORIZON.0
        ));
    }
    Ok(Nanos(ns.round() as u64))
}

/// Durations in configs are strings with a unit (`"3d"`, `"250ms"`). A bare number, integer
/// or float, is an error that shows the accepted forms: `ttl = 259200` meant seconds to its
/// writer and would have been 259 µs.
impl<'de> Deserialize<'de> for Nanos {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Nanos;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "a duration: {DURATION_FORMS}")
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Nanos, E> {
                parse_duration(s).map_err(E::custom)
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Nanos, E> {
                Err(E::custom(format!(
                    "the bare number {v} is not a duration: write {DURATION_FORMS}"
                )))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Nanos, E> {
                Err(E::custom(format!(
                    "the bare number {v} is not a duration: write {DURATION_FORMS}"
                )))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Nanos, E> {
                Err(E::custom(format!(
                    "the bare number {v:?} is not a duration: write {DURATION_FORMS}"
                )))
            }
        }
        d.deserialize_any(V)
    }
}

impl Serialize for Nanos {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_units() {
        assert_eq!(parse_duration("3d").unwrap(), Nanos::from_secs(3 * 86_400));
        assert_eq!(parse_duration("180s").unwrap(), Nanos::from_secs(180));
        assert_eq!(parse_duration("3min").unwrap(), Nanos::from_secs(180));
        assert_eq!(parse_duration("250ms").unwrap(), Nanos::from_millis(250));
        assert_eq!(parse_duration("1.5h").unwrap(), Nanos::from_secs(5400));
        assert_eq!(parse_duration("1 hour").unwrap(), Nanos::from_secs(3600));
        assert!(parse_duration("3 fortnights").is_err());
        assert!(parse_duration("-3s").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn bare_numbers_are_refused_with_the_accepted_forms() {
        for t in ["42", "3.0", " 7 "] {
            let e = parse_duration(t).unwrap_err();
            assert!(e.contains("no unit") && e.contains("\"180s\""), "{t}: {e}");
        }
        #[derive(Debug, Deserialize)]
        struct C {
            #[allow(dead_code)]
            ttl: Nanos,
        }
        for text in ["ttl = 259200", "ttl = 3.0", "ttl = -1"] {
            let e = toml::from_str::<C>(text).unwrap_err().to_string();
            assert!(
                e.contains("bare number") && e.contains("\"250ms\""),
                "{text}: {e}"
            );
            assert!(e.contains("line 1"), "{text}: {e}");
        }
        assert!(toml::from_str::<C>("ttl = true").is_err());
        let c: C = toml::from_str("ttl = \"3d\"").unwrap();
        assert_eq!(c.ttl, Nanos::from_secs(3 * 86_400));
    }

    #[test]
    fn the_horizon_is_enforced() {
        assert!(parse_duration("146y").is_err());
        assert!(parse_duration("53000d").is_ok());
        let e = parse_duration("54000d").unwrap_err();
        assert!(e.contains("horizon"), "{e}");
        assert!(parse_duration("1e300s").is_err());
        assert!(Nanos::try_from_secs_f64(1e300).is_err());
        assert!(Nanos::try_from_secs_f64(f64::NAN).is_err());
        assert!(Nanos::try_from_secs_f64(-1.0).is_err());
        assert_eq!(Nanos::try_from_secs_f64(2.5), Ok(Nanos::from_millis(2500)));
        assert!(Nanos::try_from_millis_f64(1e30).is_err());
        assert!(Nanos(u64::MAX / 2).within_horizon().is_err());
        assert_eq!(Nanos::HORIZON.checked_add(Nanos(1)), None);
    }

    #[test]
    fn display_round_trips() {
        for t in ["3d", "7d", "180s", "250ms", "3min", "42ns", "17us", "5h"] {
            let n = parse_duration(t).unwrap();
            assert_eq!(parse_duration(&n.to_string()).unwrap(), n, "{t}");
        }
        assert_eq!(Nanos::NEVER.to_string(), "never");
        assert_ne!(Nanos::MAX.to_string(), "never");
    }

    #[test]
    fn arithmetic_saturates_below_never() {
        assert_eq!(Nanos::MAX + Nanos(1), Nanos::MAX);
        assert_eq!(Nanos(u64::MAX - 5) + Nanos(u64::MAX - 5), Nanos::MAX);
        assert_eq!(Nanos::NEVER + Nanos(1), Nanos::NEVER);
        assert_eq!(Nanos(1) + Nanos::NEVER, Nanos::NEVER);
        assert_eq!(Nanos::NEVER - Nanos(5), Nanos::NEVER);
        assert_eq!(Nanos(1) - Nanos(5), Nanos::ZERO);
        assert_eq!(Nanos::from_secs_f64(1e300), Nanos::MAX);
        assert!(Nanos::HORIZON + Nanos::HORIZON < Nanos::MAX);
    }

    proptest! {
        /// No finite sum or difference is ever "never", and within the horizon nothing
        /// saturates.
        #[test]
        fn finite_arithmetic_never_reaches_never(a in any::<u64>(), b in any::<u64>()) {
            let (a, b) = (Nanos(a.min(Nanos::MAX.0)), Nanos(b.min(Nanos::MAX.0)));
            prop_assert!(!(a + b).is_never());
            prop_assert!(!(a - b).is_never());
            if a <= Nanos::HORIZON && b <= Nanos::HORIZON {
                prop_assert_eq!((a + b).0, a.0 + b.0);
            }
        }
    }
}
