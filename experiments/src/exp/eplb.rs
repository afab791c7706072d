//! The EPLB experiment (SPEC §9): MoE imbalance (slowest rank ÷ mean) over time for each
//! scenario (prefill EP2/DP2 and EP4/DP4, decode EP64) under several placement policies.
//!
//! Per scenario one seeded load generator draws each step's expert token counts, and every
//! policy observes the same counts, so policies are compared on identical traffic.

use super::{RunContext, progress};
use crate::config::ExperimentHeader;
use crate::output::{Manifest, RunOutput, markdown_table};
use crate::plot;
use crate::speed::Speed;
use anyhow::{Result, anyhow, bail};
use polars::prelude::*;
use rayon::prelude::*;
use serde::Deserialize;
use servelab_core::Nanos;
use servelab_core::eplb::{
    EpGroup, ExpertLoadGenerator, ExpertPlacer, MoeBatch, MoeModel, Phase, PlacementPolicy,
    SkewConfig,
};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EplbConfig {
    pub experiment: ExperimentHeader,
    #[serde(default)]
    pub model: MoeModel,
    pub skew: PhaseSkew,
    /// Steps averaged into one point of the time series (table and plot).
    pub bin_steps: u64,
    pub scenario: Vec<Scenario>,
}

/// Prefill and decode traffic route differently.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PhaseSkew {
    pub prefill: SkewConfig,
    pub decode: SkewConfig,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scenario {
    pub name: String,
    pub phase: Phase,
    pub ep: EpGroup,
    pub steps: u64,
    /// Simulated duration of one step (drives the popularity drift).
    pub step_time: Nanos,
    /// Tokens per step over all DP ranks of the EP group.
    pub tokens_per_step: u64,
    /// Requests those tokens come from.
    pub sequences_per_step: u64,
    /// Steps left out of the summary statistics (before the first reassignment).
    pub warmup_steps: u64,
    pub policy: Vec<PolicyRun>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyRun {
    pub label: String,
    pub placement: PlacementPolicy,
    /// The published imbalance this row should land near, if any.
    #[serde(default)]
    pub spec_imbalance: Option<f64>,
}

/// The most (step, policy) imbalance records one scenario keeps (2^26, 512 MiB).
const MAX_STEP_CELLS: u64 = 1 << 26;

/// One policy's trace through one scenario.
struct Trace {
    imbalance: Vec<f64>,
    reassign_steps: Vec<u64>,
    bytes_moved: u64,
    cost_total: Nanos,
    cost_max: Nanos,
    slots_per_gpu: usize,
}

fn run_scenario(
    model: &MoeModel,
    skew: &SkewConfig,
    s: &Scenario,
    seed: u64,
    pb: &indicatif::ProgressBar,
) -> Result<Vec<Trace>> {
    let mut generator = ExpertLoadGenerator::new(model, s.phase, skew, seed, &s.name)
        .map_err(|e| anyhow!("{e}"))?;
    let mut placers = s
        .policy
        .iter()
        .map(|p| {
            ExpertPlacer::new(model, &s.ep, &p.placement)
                .map_err(|e| anyhow!("policy `{}`: {e}", p.label))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut traces: Vec<Trace> = s
        .policy
        .iter()
        .map(|p| Trace {
            imbalance: Vec::with_capacity(s.steps as usize),
            reassign_steps: Vec::new(),
            bytes_moved: 0,
            cost_total: Nanos::ZERO,
            cost_max: Nanos::ZERO,
            slots_per_gpu: s.ep.slots(model, &p.placement) / s.ep.gpus,
        })
        .collect();
    let batch = MoeBatch {
        tokens: s.tokens_per_step,
        sequences: s.sequences_per_step,
    };
    for step in 0..s.steps {
        let now = Nanos(step.saturating_mul(s.step_time.0));
        let counts = generator.sample(now, batch);
        for (placer, t) in placers.iter_mut().zip(&mut traces) {
            let m = placer.observe(counts);
            t.imbalance.push(m.imbalance);
            if m.reassigned {
                t.reassign_steps.push(step);
                t.bytes_moved = t.bytes_moved.saturating_add(m.bytes_moved);
                t.cost_total += m.reassignment_cost_ns;
                t.cost_max = t.cost_max.max(m.reassignment_cost_ns);
            }
        }
        if step % 1_000 == 999 {
            pb.inc(1_000);
        }
    }
    pb.inc(s.steps % 1_000);
    Ok(traces)
}

/// One scenario × policy of the summary table.
struct SummaryRow {
    scenario: String,
    phase: &'static str,
    policy: String,
    gpus: u64,
    slots_per_gpu: u64,
    placement: &'static str,
    mean: f64,
    p50: f64,
    p99: f64,
    max: f64,
    spec: Option<f64>,
    reassignments: u64,
    bytes_moved_gb: f64,
    mean_cost_ms: f64,
    max_cost_ms: f64,
}

/// A file-name-safe form of a scenario name.
fn slug(name: &str) -> String {
    let mut out = String::new();
    for c in name.chars() {
        if c.is_ascii_alphanumeric() {
            out.push(c.to_ascii_lowercase());
        } else if !out.ends_with('-') {
            out.push('-');
        }
    }
    out.trim_matches('-').to_string()
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    sorted[i]
}

pub fn run(ctx: &RunContext) -> Result<()> {
    let cfg: EplbConfig = ctx.config.parse()?;
    let path = ctx.config.path.display().to_string();
    validate(&cfg, &path)?;
    let seed = ctx.seed();
    let (traces, speeds): (Vec<Vec<Trace>>, Vec<Speed>) =
        simulate(ctx, &cfg, &path, seed)?.into_iter().unzip();

    let mut out = RunOutput::create(&ctx.out)?;
    let series = write_time_series(&mut out, &cfg, &traces)?;
    let (rows_md, rows) = summary_rows(&cfg, &traces);
    let summary_df = write_summary_table(&mut out, &rows)?;
    plot_scenarios(&mut out, &cfg, &series)?;
    plot_against_spec(&mut out, &cfg, &series)?;

    let header = [
        "scenario",
        "policy",
        "slots/GPU",
        "mean imbalance",
        "SPEC §9",
        "p99",
        "reassignments",
        "per reassignment",
    ];
    let table = markdown_table(&header, &rows_md);
    out.write_text("summary.md", &summary_md(&cfg, &path, seed, &table))?;
    let keys = ["scenario", "policy"];
    out.write_summary_json(&crate::sweep::headline::from_frame(&summary_df, &keys)?)?;
    out.write_manifest(
        &Manifest::new("eplb", &ctx.config.path, &ctx.config.text, seed),
        &speeds,
    )?;
    println!("{table}");
    crate::speed::print(&speeds);
    println!("wrote {}", ctx.out.display());
    Ok(())
}

/// Checks the model, the skews and every scenario before anything runs.
fn validate(cfg: &EplbConfig, path: &str) -> Result<()> {
    cfg.model.validate().map_err(|e| anyhow!("{path}: {e}"))?;
    cfg.skew
        .prefill
        .validate("skew.prefill")
        .map_err(|e| anyhow!("{path}: {e}"))?;
    cfg.skew
        .decode
        .validate("skew.decode")
        .map_err(|e| anyhow!("{path}: {e}"))?;
    if cfg.scenario.is_empty() {
        bail!("{path}: at least one [[scenario]] is needed");
    }
    if cfg.bin_steps == 0 {
        bail!("{path}: invalid `bin_steps`: must be at least 1");
    }
    for s in &cfg.scenario {
        validate_scenario(cfg, s, path)?;
    }
    Ok(())
}

fn validate_scenario(cfg: &EplbConfig, s: &Scenario, path: &str) -> Result<()> {
    if s.policy.is_empty() {
        bail!("{path}: scenario `{}` has no [[scenario.policy]]", s.name);
    }
    if s.warmup_steps >= s.steps {
        bail!(
            "{path}: scenario `{}`: invalid `warmup_steps`: {} leaves none of its {} steps",
            s.name,
            s.warmup_steps,
            s.steps
        );
    }
    if s.step_time == Nanos::ZERO {
        bail!(
            "{path}: scenario `{}`: invalid `step_time`: must be positive",
            s.name
        );
    }
    // One imbalance per step and policy is kept for the series and the quantiles.
    let cells = u128::from(s.steps) * s.policy.len() as u128;
    if cells > u128::from(MAX_STEP_CELLS) {
        bail!(
            "{path}: scenario `{}`: invalid `steps`: {} steps × {} policies is more than the \
             {MAX_STEP_CELLS} step records a run keeps",
            s.name,
            s.steps,
            s.policy.len()
        );
    }
    if u128::from(s.steps) * u128::from(s.step_time.0) > u128::from(Nanos::HORIZON.0) {
        bail!(
            "{path}: scenario `{}`: invalid `steps`: {} steps of {} run past the horizon of \
             146 years",
            s.name,
            s.steps,
            s.step_time
        );
    }
    for p in &s.policy {
        s.ep.validate(&cfg.model, &p.placement)
            .map_err(|e| anyhow!("{path}: scenario `{}`, policy `{}`: {e}", s.name, p.label))?;
    }
    Ok(())
}

/// Runs the scenarios in parallel: one trace per scenario and policy, in config order.
fn simulate(
    ctx: &RunContext,
    cfg: &EplbConfig,
    path: &str,
    seed: u64,
) -> Result<Vec<(Vec<Trace>, Speed)>> {
    let pb = progress(ctx, cfg.scenario.iter().map(|s| s.steps).sum(), "steps");
    let results: Vec<Result<(Vec<Trace>, Speed)>> = cfg
        .scenario
        .par_iter()
        .map(|s| {
            let skew = match s.phase {
                Phase::Prefill => &cfg.skew.prefill,
                Phase::Decode => &cfg.skew.decode,
            };
            let started = std::time::Instant::now();
            let traces = run_scenario(&cfg.model, skew, s, seed, &pb)
                .map_err(|e| anyhow!("{path}: scenario `{}`: {e}", s.name))?;
            let wall = started.elapsed().as_secs_f64();
            // Every policy of the scenario steps through the same steps.
            let steps = s.steps * s.policy.len() as u64;
            let simulated = Nanos(s.steps.saturating_mul(s.step_time.0)).as_secs_f64();
            let speed = Speed::counting(&s.name, wall, simulated, "steps", steps);
            Ok((traces, speed))
        })
        .collect();
    pb.finish_and_clear();
    results.into_iter().collect::<Result<_>>()
}

/// Binned points, `[scenario][policy]` in config order.
type Series = Vec<Vec<Vec<(f64, f64)>>>;

/// Writes the time series, one row per scenario × policy × bin, and returns its points.
fn write_time_series(
    out: &mut RunOutput,
    cfg: &EplbConfig,
    traces: &[Vec<Trace>],
) -> Result<Series> {
    let (mut c_scn, mut c_pol, mut c_step, mut c_time, mut c_imb, mut c_re) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    let mut series: Series = Vec::new();
    for (s, ts) in cfg.scenario.iter().zip(traces) {
        let mut per_policy = Vec::new();
        for (p, t) in s.policy.iter().zip(ts) {
            let mut pts = Vec::new();
            for (b, chunk) in t.imbalance.chunks(cfg.bin_steps as usize).enumerate() {
                let start = b as u64 * cfg.bin_steps;
                let end = start + chunk.len() as u64;
                let mean = chunk.iter().sum::<f64>() / chunk.len() as f64;
                let time_s = Nanos(start.saturating_mul(s.step_time.0)).as_secs_f64();
                c_scn.push(s.name.clone());
                c_pol.push(p.label.clone());
                c_step.push(start);
                c_time.push(time_s);
                c_imb.push(mean);
                c_re.push(
                    t.reassign_steps
                        .iter()
                        .filter(|&&r| r >= start && r < end)
                        .count() as u64,
                );
                pts.push((time_s, mean));
            }
            per_policy.push(pts);
        }
        series.push(per_policy);
    }
    let mut ts_df = df!(
        "scenario" => c_scn,
        "policy" => c_pol,
        "step" => c_step,
        "time_s" => c_time,
        "imbalance" => c_imb,
        "reassignments" => c_re,
    )?;
    out.write_table("imbalance_over_time", &mut ts_df)?;
    Ok(series)
}

/// The summary, one row per scenario × policy with statistics after the warm-up: the markdown
/// rows and the table rows.
fn summary_rows(cfg: &EplbConfig, traces: &[Vec<Trace>]) -> (Vec<Vec<String>>, Vec<SummaryRow>) {
    let mut rows_md = Vec::new();
    let mut rows: Vec<SummaryRow> = Vec::new();
    for (s, ts) in cfg.scenario.iter().zip(traces) {
        for (p, t) in s.policy.iter().zip(ts) {
            let row = summary_row(s, p, t);
            let n_re = row.reassignments;
            rows_md.push(vec![
                s.name.clone(),
                p.label.clone(),
                t.slots_per_gpu.to_string(),
                format!("{:.3}", row.mean),
                p.spec_imbalance.map_or("–".into(), |x| format!("{x:.3}")),
                format!("{:.3}", row.p99),
                n_re.to_string(),
                if n_re > 0 {
                    format!(
                        "{:.1} GB / {:.0} ms",
                        row.bytes_moved_gb / n_re as f64,
                        row.mean_cost_ms
                    )
                } else {
                    "–".into()
                },
            ]);
            rows.push(row);
        }
    }
    (rows_md, rows)
}

fn summary_row(s: &Scenario, p: &PolicyRun, t: &Trace) -> SummaryRow {
    let kept = &t.imbalance[s.warmup_steps as usize..];
    let mean = kept.iter().sum::<f64>() / kept.len() as f64;
    let mut sorted = kept.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n_re = t.reassign_steps.len() as u64;
    let mean_cost_ms = if n_re > 0 {
        t.cost_total.as_millis_f64() / n_re as f64
    } else {
        0.0
    };
    SummaryRow {
        scenario: s.name.clone(),
        phase: s.phase.name(),
        policy: p.label.clone(),
        gpus: s.ep.gpus as u64,
        slots_per_gpu: t.slots_per_gpu as u64,
        placement: p.placement.name(),
        mean,
        p50: quantile(&sorted, 0.5),
        p99: quantile(&sorted, 0.99),
        max: quantile(&sorted, 1.0),
        spec: p.spec_imbalance,
        reassignments: n_re,
        bytes_moved_gb: t.bytes_moved as f64 / 1e9,
        mean_cost_ms,
        max_cost_ms: t.cost_max.as_millis_f64(),
    }
}

/// Writes the summary table and returns it (the headline JSON is read from it).
fn write_summary_table(out: &mut RunOutput, rows: &[SummaryRow]) -> Result<DataFrame> {
    fn col<T>(rows: &[SummaryRow], f: impl Fn(&SummaryRow) -> T) -> Vec<T> {
        rows.iter().map(f).collect()
    }
    let mut summary_df = df!(
        "scenario" => col(rows, |r| r.scenario.clone()),
        "phase" => col(rows, |r| r.phase),
        "policy" => col(rows, |r| r.policy.clone()),
        "gpus" => col(rows, |r| r.gpus),
        "slots_per_gpu" => col(rows, |r| r.slots_per_gpu),
        "placement" => col(rows, |r| r.placement),
        "mean_imbalance" => col(rows, |r| r.mean),
        "p50_imbalance" => col(rows, |r| r.p50),
        "p99_imbalance" => col(rows, |r| r.p99),
        "max_imbalance" => col(rows, |r| r.max),
        "spec_imbalance" => col(rows, |r| r.spec),
        "reassignments" => col(rows, |r| r.reassignments),
        "bytes_moved_gb" => col(rows, |r| r.bytes_moved_gb),
        "mean_reassignment_ms" => col(rows, |r| r.mean_cost_ms),
        "max_reassignment_ms" => col(rows, |r| r.max_cost_ms),
    )?;
    out.write_table("summary", &mut summary_df)?;
    Ok(summary_df)
}

/// One plot per scenario: policies differ by up to several ×, so each gets its own axes.
fn plot_scenarios(out: &mut RunOutput, cfg: &EplbConfig, series: &Series) -> Result<()> {
    for (s, per_policy) in cfg.scenario.iter().zip(series) {
        let lines: Vec<(String, Vec<(f64, f64)>)> = s
            .policy
            .iter()
            .zip(per_policy)
            .map(|(p, pts)| (p.label.clone(), pts.clone()))
            .collect();
        let p = out.path(&format!("imbalance_{}.svg", slug(&s.name)));
        plot::lines(
            &p,
            &format!(
                "{}: MoE imbalance (slowest rank / mean), {}-step means",
                s.name, cfg.bin_steps
            ),
            "time (s)",
            "imbalance",
            &lines,
        )?;
    }
    Ok(())
}

/// The rows compared with SPEC §9 together, after each scenario's warm-up (the uniform initial
/// placement would dwarf the rest), with the published figure as a flat line beside each row.
fn plot_against_spec(out: &mut RunOutput, cfg: &EplbConfig, series: &Series) -> Result<()> {
    let mut compared: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for (s, per_policy) in cfg.scenario.iter().zip(series) {
        let warm_s = Nanos(s.warmup_steps.saturating_mul(s.step_time.0)).as_secs_f64();
        for (p, pts) in s.policy.iter().zip(per_policy) {
            let Some(spec) = p.spec_imbalance else {
                continue;
            };
            let kept: Vec<(f64, f64)> = pts.iter().copied().filter(|(t, _)| *t >= warm_s).collect();
            let (Some(first), Some(last)) = (kept.first(), kept.last()) else {
                continue;
            };
            let flat = vec![(first.0, spec), (last.0, spec)];
            compared.push((format!("{} · {}", s.name, p.label), kept));
            compared.push((format!("{} · SPEC §9 {spec}", s.name), flat));
        }
    }
    if !compared.is_empty() {
        let p = out.path("imbalance_vs_spec.svg");
        plot::lines(
            &p,
            &format!("Rows with a SPEC §9 figure, {}-step means", cfg.bin_steps),
            "time (s)",
            "imbalance",
            &compared,
        )?;
    }
    Ok(())
}

fn summary_md(cfg: &EplbConfig, path: &str, seed: u64, table: &str) -> String {
    let m = &cfg.model;
    let mut summary = format!(
        "# Expert-parallel load balancing (SPEC §9)\n\nConfig `{path}`, seed {seed}. Model: {} MoE layers × {} routed \
         experts in {} groups, top-{}, {:.0} MB per expert. Imbalance is Σ over layers of the slowest rank's \
         token-expert assignments ÷ Σ of the mean rank's, averaged over the steps after each scenario's warm-up; \
         \"per reassignment\" is the expert weight moved and the time the busiest GPU spends receiving it.\n\n{table}\n",
        m.layers,
        m.experts,
        m.groups,
        m.top_k,
        m.expert_bytes as f64 / 1e6
    );
    if let Some(d) = &cfg.experiment.description {
        summary.push_str(&format!("\n## Why these parameters\n\n{}\n", d.trim()));
    }
    summary.push_str("\n## Files\n\n- `summary.csv`/`.parquet`: the table above with p50/max.\n- `imbalance_over_time.csv`/`.parquet`: binned imbalance per scenario and policy.\n- `imbalance_<scenario>.svg`: the same per scenario; `imbalance_vs_spec.svg`: the rows with a SPEC §9 figure.\n");
    summary
}
