//! Headline metrics of each experiment kind for `summary.json`: a flat map of metric name →
//! number, what a sweep tabulates, averages over seeds and plots. Names are dotted paths,
//! `<row keys>.<column>` (`agent_sessions.deepinfer.hit_rate`, `all.ttft_ms.p99`).

use crate::exp::plan::Candidate;
use anyhow::Result;
use polars::prelude::*;
use servelab_sim::service::{Latencies, ServiceReport};
use std::collections::BTreeMap;

pub type Metrics = BTreeMap<String, f64>;

/// A metric-name component: lower case, runs of anything but letters and digits as one `_`.
pub fn slug(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
            out.push(c.to_ascii_lowercase());
        } else if !out.ends_with('_') {
            out.push('_');
        }
    }
    out.trim_matches('_').to_string()
}

fn cell_text(c: &Column, row: usize) -> Option<String> {
    let v = c.get(row).ok()?;
    Some(match v {
        AnyValue::Null => return None,
        AnyValue::String(s) => slug(s),
        AnyValue::StringOwned(s) => slug(s.as_str()),
        AnyValue::Float64(x) => format!("{x}"),
        AnyValue::Float32(x) => format!("{x}"),
        other => slug(&other.to_string()),
    })
}

/// Every numeric and boolean cell of `df` whose row is named by the `keys` columns:
/// `<key values>.<column>` → value (booleans as 0/1; nulls and NaN left out).
pub fn from_frame(df: &DataFrame, keys: &[&str]) -> Result<Metrics> {
    let mut m = Metrics::new();
    let key_cols: Vec<&Column> = keys
        .iter()
        .map(|k| df.column(k))
        .collect::<PolarsResult<_>>()?;
    for row in 0..df.height() {
        let prefix: Vec<String> = key_cols.iter().filter_map(|c| cell_text(c, row)).collect();
        for c in df.columns() {
            if keys.contains(&c.name().as_str()) {
                continue;
            }
            let v = match c.get(row)? {
                AnyValue::Boolean(b) => f64::from(u8::from(b)),
                AnyValue::Null => continue,
                v => match v.extract::<f64>() {
                    Some(x) if c.dtype().is_primitive_numeric() => x,
                    _ => continue,
                },
            };
            if v.is_nan() {
                continue;
            }
            let mut name = prefix.join(".");
            if !name.is_empty() {
                name.push('.');
            }
            name.push_str(c.name().as_str());
            m.insert(name, v);
        }
    }
    Ok(m)
}

fn latencies(m: &mut Metrics, prefix: &str, l: &Latencies) {
    for (name, h) in [
        ("ttft_ms", &l.ttft_ns),
        ("tpot_ms", &l.tpot_ns),
        ("e2e_ms", &l.e2e_ns),
        ("queue_ms", &l.queue_ns),
    ] {
        if h.count() == 0 {
            continue;
        }
        m.insert(format!("{prefix}{name}.mean"), h.mean() / 1e6);
        m.insert(format!("{prefix}{name}.p50"), h.quantile(0.5) / 1e6);
        m.insert(format!("{prefix}{name}.p99"), h.quantile(0.99) / 1e6);
    }
}

/// One simulated serving unit.
pub fn service(rep: &ServiceReport) -> Metrics {
    let mut m = Metrics::new();
    let rejected = rep.rejected_total();
    let st = &rep.steady;
    for (k, v) in [
        ("arrivals", rep.arrivals as f64),
        ("completed", rep.completed as f64),
        ("rejected", rejected as f64),
        (
            "rejected_share",
            rejected as f64 / rep.arrivals.max(1) as f64,
        ),
        ("measured_requests", rep.measured_requests as f64),
        ("hit_rate", rep.hit_rate()),
        ("swa_hit_rate", rep.swa_hit_rate),
        ("simulated_s", rep.simulated_s),
        (
            "steady.decode_tokens_per_s_per_gpu",
            st.decode_tokens_per_s_per_gpu,
        ),
        ("steady.decode_seqs_per_rank", st.decode_seqs_per_rank),
        ("steady.decode_busy_fraction", st.decode_busy_fraction),
        ("steady.decode_slot_occupancy", st.decode_slot_occupancy),
        ("measured_rejection_rate", rep.measured_rejection_rate()),
        ("steady.accepted_length", st.accepted_length),
        (
            "steady.prefill_tokens_per_s_per_gpu",
            st.prefill_tokens_per_s_per_gpu,
        ),
        ("steady.prefill_busy_fraction", st.prefill_busy_fraction),
    ] {
        if v.is_finite() {
            m.insert(k.to_string(), v);
        }
    }
    for r in &rep.rejected {
        m.insert(format!("rejected.{}", r.reason), r.requests as f64);
    }
    latencies(&mut m, "all.", &rep.all);
    for (class, l) in &rep.by_class {
        latencies(&mut m, &format!("{class}."), l);
    }
    m.retain(|_, v| v.is_finite());
    m
}

/// The capacity plan: the answer, and every candidate's latencies and verdict (so a sweep over
/// seeds shows how often each candidate meets the SLOs).
pub fn plan(cands: &[Candidate], best: Option<&Candidate>) -> Metrics {
    let mut m = Metrics::new();
    m.insert("candidates".into(), cands.len() as f64);
    m.insert(
        "feasible_candidates".into(),
        cands.iter().filter(|c| c.feasible).count() as f64,
    );
    if let Some(b) = best {
        m.insert("best.gpus".into(), f64::from(b.gpus()));
        m.insert("best.prefill_gpus".into(), f64::from(b.prefill_gpus));
        m.insert("best.decode_gpus".into(), f64::from(b.decode_gpus));
    }
    for c in cands {
        let p = format!("p{}_d{}.", c.prefill_gpus, c.decode_gpus);
        let l = &c.report.all;
        m.insert(format!("{p}feasible"), f64::from(u8::from(c.feasible)));
        m.insert(format!("{p}rejected_share"), c.rejected_share);
        m.insert(format!("{p}hit_rate"), c.report.hit_rate());
        if l.ttft_ns.count() > 0 {
            m.insert(format!("{p}ttft_mean_ms"), l.ttft_ns.mean() / 1e6);
            m.insert(format!("{p}ttft_p99_ms"), l.ttft_ns.quantile(0.99) / 1e6);
            m.insert(format!("{p}tpot_mean_ms"), l.tpot_ns.mean() / 1e6);
        }
    }
    m.retain(|_, v| v.is_finite());
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_flatten_to_named_metrics() {
        let df = df!(
            "workload" => ["agent sessions", "chat"],
            "policy" => ["deepinfer", "perfect-cache"],
            "hit_rate" => [0.9, f64::NAN],
            "n" => [3u64, 4],
            "ok" => [true, false],
        )
        .unwrap();
        let m = from_frame(&df, &["workload", "policy"]).unwrap();
        assert_eq!(m["agent_sessions.deepinfer.hit_rate"], 0.9);
        assert!(
            !m.contains_key("chat.perfect-cache.hit_rate"),
            "NaN is left out"
        );
        assert_eq!(m["chat.perfect-cache.n"], 4.0);
        assert_eq!(m["chat.perfect-cache.ok"], 0.0);
        assert_eq!(m.len(), 5);
    }
}
