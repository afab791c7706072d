//! Speed figures of a run: simulated time ÷ wall time and requests (or, for the step-level
//! benches, sequences or steps) per wall-second, one row per simulation an experiment ran.
//! They go to stdout and to the manifest's `run` section, beside the other facts that differ
//! between two runs of the same inputs, and not into the summary, so that the summary and the
//! result tables stay a pure function of config and seed.

use serde::Serialize;
use servelab_sim::service::ServiceReport;
use std::time::Instant;

/// One simulation's speed.
#[derive(Clone, Debug, Serialize)]
pub struct Speed {
    /// Which simulation of the run (a policy, a case, a candidate).
    pub label: String,
    pub wall_s: f64,
    pub simulated_s: f64,
    /// What it counted: requests (arrivals, served or rejected) for every run of a serving
    /// unit; sequences or steps for the step-level benches.
    pub counted: &'static str,
    pub count: u64,
    pub simulated_per_wall: f64,
    pub count_per_wall_s: f64,
}

impl Speed {
    /// A run that served `requests`.
    pub fn new(label: impl Into<String>, wall_s: f64, simulated_s: f64, requests: u64) -> Self {
        Speed::counting(label, wall_s, simulated_s, "requests", requests)
    }

    /// A run that counts `count` of `counted` (say "steps").
    pub fn counting(
        label: impl Into<String>,
        wall_s: f64,
        simulated_s: f64,
        counted: &'static str,
        count: u64,
    ) -> Self {
        // A run too short to time still gets finite figures.
        let w = wall_s.max(1e-9);
        Speed {
            label: label.into(),
            wall_s,
            simulated_s,
            counted,
            count,
            simulated_per_wall: simulated_s / w,
            count_per_wall_s: count as f64 / w,
        }
    }

    /// The speed of one serving-unit simulation, timed from `started`.
    pub fn of_service(label: impl Into<String>, started: Instant, rep: &ServiceReport) -> Self {
        let wall = started.elapsed().as_secs_f64();
        Speed::new(label, wall, rep.simulated_s, rep.arrivals)
    }

    /// One line for stdout.
    pub fn line(&self) -> String {
        format!(
            "speed ({}): simulated {:.0} s in {:.2} s wall: {:.0}x real time, {} {c}, {:.0} {c} \
             per wall-second",
            self.label,
            self.simulated_s,
            self.wall_s,
            self.simulated_per_wall,
            self.count,
            self.count_per_wall_s,
            c = self.counted
        )
    }
}

/// The manifest's `run.speed` value for `speeds`.
pub fn json(speeds: &[Speed]) -> serde_json::Value {
    serde_json::to_value(speeds).unwrap_or(serde_json::Value::Null)
}

/// Prints every speed line.
pub fn print(speeds: &[Speed]) {
    for s in speeds {
        println!("{}", s.line());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_are_the_ratios_of_their_inputs() {
        let s = Speed::new("a", 2.0, 100.0, 50);
        assert_eq!(s.simulated_per_wall, 50.0);
        assert_eq!(s.count_per_wall_s, 25.0);
        assert!(s.line().contains("50x real time"), "{}", s.line());
        assert!(
            s.line().contains("25 requests per wall-second"),
            "{}",
            s.line()
        );
        let j = json(&[s]);
        assert_eq!(j[0]["label"], "a");
        assert_eq!(j[0]["counted"], "requests");
        assert_eq!(j[0]["count"], 50);
    }

    #[test]
    fn an_untimed_run_stays_finite() {
        let s = Speed::new("b", 0.0, 10.0, 3);
        assert!(s.simulated_per_wall.is_finite() && s.count_per_wall_s.is_finite());
    }
}
