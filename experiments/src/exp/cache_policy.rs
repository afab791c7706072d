//! The cache-policy experiment (SPEC §13): the three workloads through the hit rules, with the
//! hit rates and compute shares of the published table side by side.

use super::{RunContext, progress};
use crate::config::ExperimentHeader;
use crate::output::{Manifest, RunOutput, markdown_table};
use crate::plot;
use crate::speed::Speed;
use anyhow::{Result, anyhow, bail};
use polars::prelude::*;
use rayon::prelude::*;
use serde::Deserialize;
use servelab_core::{HitPolicy, ServingConstants, StoreConfig, SwaConfig};
use servelab_sim::replay::{ReplayConfig, ReplayReport, replay};
use servelab_workloads::generate::{WorkloadConfig, generate};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CachePolicyConfig {
    pub experiment: ExperimentHeader,
    #[serde(default)]
    pub constants: ServingConstants,
    #[serde(default)]
    pub store: StoreConfig,
    #[serde(default)]
    pub swa: SwaConfig,
    #[serde(default)]
    pub timing: Timing,
    /// Rules to evaluate; the table's five columns need deepinfer, perfect-cache,
    /// ordinary-model and exact-rebuild.
    pub policies: Vec<HitPolicy>,
    #[serde(default)]
    pub tolerance: Tolerance,
    pub workload: Vec<WorkloadEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Timing {
    pub cache_outputs: bool,
    pub ttft_s: f64,
    pub decode_tokens_per_s: f64,
}

impl Default for Timing {
    fn default() -> Self {
        let r = ReplayConfig::default();
        Timing {
            cache_outputs: r.cache_outputs,
            ttft_s: r.ttft_s,
            decode_tokens_per_s: r.decode_tokens_per_s,
        }
    }
}

/// How close a measured cell must be to the published one.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Tolerance {
    /// Hit rates: absolute, percentage points.
    pub hit_pp: f64,
    /// Compute shares: relative.
    pub compute_rel: f64,
}

impl Default for Tolerance {
    fn default() -> Self {
        Tolerance {
            hit_pp: 1.0,
            compute_rel: 0.15,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkloadEntry {
    pub name: String,
    /// Published cells to compare against, as shares (0.958 = 95.8%).
    #[serde(default)]
    pub published: Option<Cells>,
    pub mix: WorkloadConfig,
}

/// The five cells of a SPEC §13 row.
#[derive(Clone, Copy, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cells {
    pub hit_perfect: f64,
    pub hit_deepinfer: f64,
    pub compute_ordinary: f64,
    pub compute_exact_rebuild: f64,
    pub compute_deepinfer: f64,
}

impl Cells {
    fn values(&self) -> [f64; 5] {
        [
            self.hit_perfect,
            self.hit_deepinfer,
            self.compute_ordinary,
            self.compute_exact_rebuild,
            self.compute_deepinfer,
        ]
    }
}

const CELL_NAMES: [&str; 5] = [
    "hit_perfect",
    "hit_deepinfer",
    "compute_ordinary",
    "compute_exact_rebuild",
    "compute_deepinfer",
];

fn measured_cells(r: &ReplayReport) -> Result<Cells> {
    let need = |p: HitPolicy, v: Option<f64>| {
        v.ok_or_else(|| {
            anyhow!(
                "policies must include `{}` for the SPEC §13 table",
                p.name()
            )
        })
    };
    Ok(Cells {
        hit_perfect: need(HitPolicy::PerfectCache, r.hit_rate(HitPolicy::PerfectCache))?,
        hit_deepinfer: need(HitPolicy::Deepinfer, r.hit_rate(HitPolicy::Deepinfer))?,
        compute_ordinary: need(
            HitPolicy::OrdinaryModel,
            r.compute_share(HitPolicy::OrdinaryModel),
        )?,
        compute_exact_rebuild: need(
            HitPolicy::ExactRebuild,
            r.compute_share(HitPolicy::ExactRebuild),
        )?,
        compute_deepinfer: need(HitPolicy::Deepinfer, r.compute_share(HitPolicy::Deepinfer))?,
    })
}

pub fn run(ctx: &RunContext) -> Result<()> {
    let cfg: CachePolicyConfig = ctx.config.parse()?;
    let path = ctx.config.path.display().to_string();
    let replay_cfg = replay_config(&cfg, &path)?;
    let seed = ctx.seed();
    let (reports, speeds) = replay_workloads(ctx, &cfg, &replay_cfg, &path, seed)?;

    let mut out = RunOutput::create(&ctx.out)?;
    let names: Vec<String> = cfg.workload.iter().map(|w| w.name.clone()).collect();
    let policies_df = write_policies_table(&mut out, &names, &reports)?;
    let spec = write_spec_table(&mut out, &cfg, &reports)?;
    let store_df = write_store_table(&mut out, &names, &reports)?;
    plot_spec_cells(&mut out, &names, &spec)?;

    let summary = summary_md(&cfg, &path, seed, &spec, &names, &reports);
    out.write_text("summary.md", &summary)?;
    let cols = ["workload", "policy", "hit_rate", "compute_share"];
    let mut headline = crate::sweep::headline::from_frame(&policies_df.select(cols)?, &cols[..2])?;
    let cols = [
        "workload",
        "block_hit_rate",
        "evictions",
        "expirations",
        "peak_bytes",
    ];
    headline.extend(crate::sweep::headline::from_frame(
        &store_df.select(cols)?,
        &cols[..1],
    )?);
    out.write_summary_json(&headline)?;
    out.write_manifest(
        &Manifest::new("cache-policy", &ctx.config.path, &ctx.config.text, seed),
        &speeds,
    )?;
    println!("{summary}");
    crate::speed::print(&speeds);
    println!("wrote {}", ctx.out.display());
    Ok(())
}

/// Checks the config and builds the replay's from it.
fn replay_config(cfg: &CachePolicyConfig, path: &str) -> Result<ReplayConfig> {
    if cfg.workload.is_empty() {
        bail!("{path}: at least one [[workload]] is needed");
    }
    if cfg.policies.is_empty() {
        bail!("{path}: `policies` is empty");
    }
    let replay_cfg = ReplayConfig {
        constants: cfg.constants.clone(),
        store: cfg.store.clone(),
        swa: cfg.swa.clone(),
        cache_outputs: cfg.timing.cache_outputs,
        ttft_s: cfg.timing.ttft_s,
        decode_tokens_per_s: cfg.timing.decode_tokens_per_s,
    };
    replay_cfg.validate().map_err(|e| anyhow!("{path}: {e}"))?;
    Ok(replay_cfg)
}

/// Each workload's report (by its index in the config) and the replays' speeds.
type Replayed = (Vec<(usize, ReplayReport)>, Vec<Speed>);

/// Generates and replays every workload in parallel; the reports come back in config order,
/// each with its workload's index.
fn replay_workloads(
    ctx: &RunContext,
    cfg: &CachePolicyConfig,
    replay_cfg: &ReplayConfig,
    path: &str,
    seed: u64,
) -> Result<Replayed> {
    let pb = progress(ctx, cfg.workload.len() as u64, "workloads");
    let results: Vec<Result<(usize, ReplayReport, Speed)>> = cfg
        .workload
        .par_iter()
        .enumerate()
        .map(|(i, w)| {
            let trace = generate(&w.mix, seed, cfg.constants.block_tokens)
                .map_err(|e| anyhow!("{path}: workload `{}`: {e}", w.name))?;
            let started = std::time::Instant::now();
            let rep =
                replay(&trace, replay_cfg, &cfg.policies).map_err(|e| anyhow!("{path}: {e}"))?;
            let span = trace
                .requests
                .last()
                .map_or(0.0, |r| r.arrival.as_secs_f64());
            let wall = started.elapsed().as_secs_f64();
            let speed = Speed::new(&w.name, wall, span, rep.requests);
            pb.inc(1);
            Ok((i, rep, speed))
        })
        .collect();
    pb.finish_and_clear();
    let mut reports: Vec<(usize, ReplayReport, Speed)> =
        results.into_iter().collect::<Result<_>>()?;
    reports.sort_by_key(|(i, ..)| *i);
    let speeds = reports.iter().map(|r| r.2.clone()).collect();
    Ok((
        reports.into_iter().map(|(i, r, _)| (i, r)).collect(),
        speeds,
    ))
}

/// Writes the tidy long table, one row per workload × policy, and returns it.
fn write_policies_table(
    out: &mut RunOutput,
    names: &[String],
    reports: &[(usize, ReplayReport)],
) -> Result<DataFrame> {
    let (mut w_col, mut p_col) = (Vec::new(), Vec::new());
    let (mut hit, mut comp, mut enc, mut rep_t, mut dec, mut pulls) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    for (i, r) in reports {
        for t in &r.per_policy {
            w_col.push(names[*i].clone());
            p_col.push(t.policy.clone());
            hit.push(t.hit_tokens as f64 / r.input_tokens.max(1) as f64);
            comp.push(t.layer_tokens as f64 / r.baseline_layer_tokens.max(1) as f64);
            enc.push(t.encoder_tokens);
            rep_t.push(t.encoder_replay_tokens);
            dec.push(t.decoder_tokens);
            pulls.push(t.swa_cross_machine_pulls);
        }
    }
    let mut policies_df = df!(
        "workload" => w_col,
        "policy" => p_col,
        "hit_rate" => hit,
        "compute_share" => comp,
        "encoder_tokens" => enc,
        "encoder_replay_tokens" => rep_t,
        "decoder_tokens" => dec,
        "swa_cross_machine_pulls" => pulls,
    )?;
    out.write_table("policies", &mut policies_df)?;
    Ok(policies_df)
}

/// The SPEC §13 table, measured vs published: its markdown rows, whether every published cell
/// is met, and each cell's percentages per workload for the plots.
struct SpecTable {
    rows_md: Vec<Vec<String>>,
    all_within: bool,
    measured: Vec<Vec<f64>>,
    published: Vec<Vec<f64>>,
}

fn write_spec_table(
    out: &mut RunOutput,
    cfg: &CachePolicyConfig,
    reports: &[(usize, ReplayReport)],
) -> Result<SpecTable> {
    let mut spec = SpecTable {
        rows_md: Vec::new(),
        all_within: true,
        measured: vec![Vec::new(); 5],
        published: vec![Vec::new(); 5],
    };
    let (mut tw, mut tc, mut tm, mut tp, mut td, mut tok) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    for (i, r) in reports {
        let m = measured_cells(r)?;
        let w = &cfg.workload[*i];
        let mut md = vec![w.name.clone()];
        for (k, name) in CELL_NAMES.iter().enumerate() {
            let mv = m.values()[k];
            spec.measured[k].push(100.0 * mv);
            let pv = w.published.map(|p| p.values()[k]);
            spec.published[k].push(100.0 * pv.unwrap_or(f64::NAN));
            let within = pv.map(|p| within_tolerance(&cfg.tolerance, k, mv, p));
            spec.all_within &= within.unwrap_or(true);
            md.push(match pv {
                Some(p) => format!(
                    "{:.1}% ({:.1}%){}",
                    100.0 * mv,
                    100.0 * p,
                    if within == Some(true) { "" } else { " ✗" }
                ),
                None => format!("{:.1}%", 100.0 * mv),
            });
            tw.push(w.name.clone());
            tc.push(name.to_string());
            tm.push(mv);
            tp.push(pv);
            td.push(pv.map(|p| mv - p));
            tok.push(within);
        }
        spec.rows_md.push(md);
    }
    let mut table_df = df!(
        "workload" => tw,
        "cell" => tc,
        "measured" => tm,
        "published" => tp,
        "difference" => td,
        "within_tolerance" => tok,
    )?;
    out.write_table("table", &mut table_df)?;
    Ok(spec)
}

/// Whether measured cell `k` is close enough to the published one: hit rates (the first two
/// cells) in percentage points, compute shares relative.
fn within_tolerance(tolerance: &Tolerance, k: usize, measured: f64, published: f64) -> bool {
    if k < 2 {
        (measured - published).abs() * 100.0 <= tolerance.hit_pp
    } else {
        ((measured - published) / published).abs() <= tolerance.compute_rel
    }
}

/// Writes the store statistics per workload (first pass) and returns them.
fn write_store_table(
    out: &mut RunOutput,
    names: &[String],
    reports: &[(usize, ReplayReport)],
) -> Result<DataFrame> {
    let mut store_df = df!(
        "workload" => names.to_vec(),
        "requests" => reports.iter().map(|(_, r)| r.requests).collect::<Vec<_>>(),
        "input_tokens" => reports.iter().map(|(_, r)| r.input_tokens).collect::<Vec<_>>(),
        "output_tokens" => reports.iter().map(|(_, r)| r.output_tokens).collect::<Vec<_>>(),
        "block_hit_rate" => reports.iter().map(|(_, r)| r.prompt_blocks_hit as f64 / r.prompt_blocks.max(1) as f64).collect::<Vec<_>>(),
        "evictions" => reports.iter().map(|(_, r)| r.store.evictions).collect::<Vec<_>>(),
        "expirations" => reports.iter().map(|(_, r)| r.store.expirations).collect::<Vec<_>>(),
        "bytes_written" => reports.iter().map(|(_, r)| r.store.bytes_written).collect::<Vec<_>>(),
        "peak_bytes" => reports.iter().map(|(_, r)| r.store.peak_bytes).collect::<Vec<_>>(),
        "swa_lookups" => reports.iter().map(|(_, r)| r.swa.lookups).collect::<Vec<_>>(),
        "swa_hits" => reports.iter().map(|(_, r)| r.swa.hits).collect::<Vec<_>>(),
        "swa_expirations" => reports.iter().map(|(_, r)| r.swa.expirations).collect::<Vec<_>>(),
    )?;
    out.write_table("store", &mut store_df)?;
    Ok(store_df)
}

/// The hit-rate and compute-share bars, measured next to published.
fn plot_spec_cells(out: &mut RunOutput, names: &[String], spec: &SpecTable) -> Result<()> {
    let (measured, published) = (&spec.measured, &spec.published);
    let hit_series = vec![
        ("perfect cache".to_string(), measured[0].clone()),
        ("DeepInfer rules".to_string(), measured[1].clone()),
        ("published perfect".to_string(), published[0].clone()),
        ("published DeepInfer".to_string(), published[1].clone()),
    ];
    let p = out.path("hit_rates.svg");
    plot::grouped_bars(
        &p,
        "Input-token hit rate (SPEC §13)",
        "% of input tokens",
        names,
        &hit_series,
    )?;
    let compute_series = vec![
        ("ordinary model".to_string(), measured[2].clone()),
        ("exact rebuild".to_string(), measured[3].clone()),
        ("DeepInfer rules".to_string(), measured[4].clone()),
        ("published ordinary".to_string(), published[2].clone()),
        ("published exact".to_string(), published[3].clone()),
        ("published DeepInfer".to_string(), published[4].clone()),
    ];
    let p = out.path("compute_shares.svg");
    plot::grouped_bars(
        &p,
        "Prefill compute, share of the no-cache baseline",
        "% of 40 x L layer-tokens",
        names,
        &compute_series,
    )
}

fn summary_md(
    cfg: &CachePolicyConfig,
    path: &str,
    seed: u64,
    spec: &SpecTable,
    names: &[String],
    reports: &[(usize, ReplayReport)],
) -> String {
    let header = [
        "workload",
        "hit, perfect cache",
        "hit, DeepInfer rules",
        "ordinary model",
        "exact rebuild",
        "DeepInfer rules",
    ];
    let table = markdown_table(&header, &spec.rows_md);
    let verdict = if spec.all_within {
        format!(
            "Every published cell is reproduced within ±{} pp (hit rates) and ±{:.0}% relative (compute).",
            cfg.tolerance.hit_pp,
            100.0 * cfg.tolerance.compute_rel
        )
    } else {
        "Cells marked ✗ fall outside the tolerance.".to_string()
    };
    let mut summary = format!(
        "# Cache policy (SPEC §13)\n\nConfig `{path}`, seed {seed}. Measured (published in parentheses):\n\n{table}\n{verdict}\n\n"
    );
    if let Some(d) = &cfg.experiment.description {
        summary.push_str(&format!("## Why these parameters\n\n{}\n\n", d.trim()));
    }
    summary.push_str("## All policies\n\n");
    summary.push_str(&all_policies_table(names, reports));
    summary
}

/// Every policy of every workload: hit rate, compute share, cross-machine SWA pulls.
fn all_policies_table(names: &[String], reports: &[(usize, ReplayReport)]) -> String {
    let prow: Vec<Vec<String>> = reports
        .iter()
        .flat_map(|(i, r)| {
            r.per_policy.iter().map(move |t| {
                vec![
                    names[*i].clone(),
                    t.policy.clone(),
                    format!(
                        "{:.2}%",
                        100.0 * t.hit_tokens as f64 / r.input_tokens.max(1) as f64
                    ),
                    format!(
                        "{:.2}%",
                        100.0 * t.layer_tokens as f64 / r.baseline_layer_tokens.max(1) as f64
                    ),
                    t.swa_cross_machine_pulls.to_string(),
                ]
            })
        })
        .collect();
    markdown_table(
        &[
            "workload",
            "policy",
            "hit rate",
            "compute share",
            "cross-machine SWA pulls",
        ],
        &prow,
    )
}
