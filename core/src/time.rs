//! Integer simulated time. Every policy takes `now` as a [`Nanos`]; nothing reads a wall clock.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::ops::{Add, AddAssign, Sub};

/// A point in time or a duration, in nanoseconds since the start of a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Nanos(pub u64);

impl Nanos {
    pub const ZERO: Nanos = Nanos(0);
    /// Used for "never" (no TTL, no deadline).
    pub const MAX: Nanos = Nanos(u64::MAX);

    pub const fn from_secs(s: u64) -> Self {
        Nanos(s * 1_000_000_000)
    }
    pub const fn from_millis(ms: u64) -> Self {
        Nanos(ms * 1_000_000)
    }
    pub const fn from_micros(us: u64) -> Self {
        Nanos(us * 1_000)
    }
    /// Rounds to the nearest nanosecond; negative and NaN inputs become zero.
    pub fn from_secs_f64(s: f64) -> Self {
        if s.is_nan() || s <= 0.0 {
            Nanos(0)
        } else if s >= u64::MAX as f64 / 1e9 {
            Nanos::MAX
        } else {
            Nanos((s * 1e9).round() as u64)
        }
    }
    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / 1e9
    }
    pub fn as_millis_f64(self) -> f64 {
        self.0 as f64 / 1e6
    }
    pub const fn saturating_add(self, d: Nanos) -> Nanos {
        Nanos(self.0.saturating_add(d.0))
    }
    pub const fn saturating_sub(self, d: Nanos) -> Nanos {
        Nanos(self.0.saturating_sub(d.0))
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
        if *self == Nanos::MAX {
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

/// Parses a duration such as `3d`, `7d`, `180s`, `3min`, `250ms`, `1.5h`, `42ns` or a bare
/// number of seconds. Errors name what was wrong; callers add the file and field.
pub fn parse_duration(text: &str) -> Result<Nanos, String> {
    let t = text.trim();
    if t.is_empty() {
        return Err("empty duration".into());
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let num = num.replace('_', "");
    let value: f64 = num
        .parse()
        .map_err(|_| format!("`{text}` is not a duration (expected e.g. 3d, 180s, 250ms)"))?;
    let scale = match unit.trim() {
        "" | "s" | "sec" | "secs" => 1e9,
        "ns" => 1.0,
        "us" | "µs" => 1e3,
        "ms" => 1e6,
        "m" | "min" | "mins" => 60e9,
        "h" | "hr" | "hours" => 3600e9,
        "d" | "day" | "days" => 86_400e9,
        other => {
            return Err(format!(
                "`{text}`: unknown duration unit `{other}` (use ns, us, ms, s, min, h or d)"
            ));
        }
    };
    let ns = value * scale;
    if !ns.is_finite() || ns < 0.0 || ns >= u64::MAX as f64 {
        return Err(format!("`{text}` is out of range"));
    }
    Ok(Nanos(ns.round() as u64))
}

/// Durations in configs are written as strings with a unit (`"3d"`), or as integer nanoseconds.
impl<'de> Deserialize<'de> for Nanos {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Repr {
            Int(u64),
            Text(String),
        }
        match Repr::deserialize(d)? {
            Repr::Int(ns) => Ok(Nanos(ns)),
            Repr::Text(s) => parse_duration(&s).map_err(serde::de::Error::custom),
        }
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

    #[test]
    fn parses_units() {
        assert_eq!(parse_duration("3d").unwrap(), Nanos::from_secs(3 * 86_400));
        assert_eq!(parse_duration("180s").unwrap(), Nanos::from_secs(180));
        assert_eq!(parse_duration("3min").unwrap(), Nanos::from_secs(180));
        assert_eq!(parse_duration("250ms").unwrap(), Nanos::from_millis(250));
        assert_eq!(parse_duration("1.5h").unwrap(), Nanos::from_secs(5400));
        assert_eq!(parse_duration("42").unwrap(), Nanos::from_secs(42));
        assert!(parse_duration("3 fortnights").is_err());
        assert!(parse_duration("-3s").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn display_round_trips() {
        for t in ["3d", "7d", "180s", "250ms", "3min", "42ns", "17us", "5h"] {
            let n = parse_duration(t).unwrap();
            assert_eq!(parse_duration(&n.to_string()).unwrap(), n, "{t}");
        }
    }

    #[test]
    fn arithmetic_saturates() {
        assert_eq!(Nanos::MAX + Nanos(1), Nanos::MAX);
        assert_eq!(Nanos(1) - Nanos(5), Nanos::ZERO);
    }
}
