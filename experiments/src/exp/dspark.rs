//! DSpark: dynamic vs fixed-5 verification at several batch sizes, against SPEC §10.

use super::RunContext;
use crate::config::ExperimentHeader;
use crate::output::{Manifest, RunOutput, markdown_table};
use crate::speed::Speed;
use anyhow::{Result, anyhow, bail};
use polars::prelude::*;
use rayon::prelude::*;
use serde::Deserialize;
use servelab_core::engine::VerificationPolicy;
use servelab_sim::acceptance::AcceptanceModel;
use servelab_sim::dspark::{DsparkPoint, DsparkResult, run_point};
use servelab_sim::profile::{HardwareProfile, ProfileFiles};

/// The most sequence-steps (ranks × sequences per rank × steps) one point may run: 2^30, about a
/// minute of the release build.
const MAX_SEQUENCE_STEPS: u64 = 1 << 30;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Published {
    throughput_change_pct: Vec<f64>,
    throughput_tolerance_pp: f64,
    verified_min: f64,
    verified_max: f64,
    accepted_fixed: f64,
    accepted_dynamic: f64,
    accepted_tolerance: f64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DsparkConfig {
    #[allow(dead_code)]
    experiment: ExperimentHeader,
    profile: String,
    seqs_per_rank: Vec<u32>,
    point: DsparkPoint,
    fixed: VerificationPolicy,
    dynamic: VerificationPolicy,
    #[serde(default)]
    acceptance: AcceptanceModel,
    published: Published,
}

pub fn run(ctx: &RunContext) -> Result<()> {
    let cfg: DsparkConfig = ctx.config.parse()?;
    let path = ctx.config.path.display().to_string();
    validate(&cfg, &path)?;
    let profile = HardwareProfile::resolve(&cfg.profile).map_err(|e| anyhow!("{path}: {e}"))?;
    let seed = ctx.seed();
    let (results, speeds): (Vec<DsparkResult>, Vec<Speed>) =
        run_points(ctx, &cfg, &profile, &path, seed)?
            .into_iter()
            .unzip();
    let mut out = RunOutput::create(&ctx.out)?;
    let df = write_table(&mut out, &cfg, &results)?;
    let bars = |dynamic: bool| -> Vec<f64> {
        results
            .iter()
            .skip(usize::from(dynamic))
            .step_by(2)
            .map(|r| r.tokens_per_s_per_rank)
            .collect()
    };
    let cats: Vec<String> = cfg
        .seqs_per_rank
        .iter()
        .map(|b| format!("{b} seq/rank"))
        .collect();
    let svg = out.path("throughput.svg");
    crate::plot::grouped_bars(
        &svg,
        "DSpark: tokens/s per rank",
        "tokens/s per rank",
        &cats,
        &[
            ("fixed-5".to_string(), bars(false)),
            ("dynamic".to_string(), bars(true)),
        ],
    )?;
    let summary = summary_md(&cfg, &results, seed);
    out.write_text("summary.md", &summary)?;
    let keys = ["seqs_per_rank", "verification"];
    out.write_summary_json(&crate::sweep::headline::from_frame(&df, &keys)?)?;
    out.write_manifest(
        &Manifest::new("dspark", &ctx.config.path, &ctx.config.text, seed),
        &speeds,
    )?;
    println!("{summary}");
    crate::speed::print(&speeds);
    Ok(())
}

fn validate(cfg: &DsparkConfig, path: &str) -> Result<()> {
    if cfg.seqs_per_rank.is_empty() {
        bail!("{path}: `seqs_per_rank` is empty");
    }
    if cfg.published.throughput_change_pct.len() != cfg.seqs_per_rank.len() {
        bail!(
            "{path}: `published.throughput_change_pct` needs one value per `seqs_per_rank` entry"
        );
    }
    servelab_sim::acceptance::validate_drafts(cfg.point.draft_tokens, "point.draft_tokens")
        .map_err(|e| anyhow!("{path}: {e}"))?;
    cfg.acceptance
        .validate()
        .map_err(|e| anyhow!("{path}: {e}"))?;
    // Work and memory grow with sequences × steps (warm-up steps run before the measured
    // ones): bounded before anything is allocated.
    let all_steps = u128::from(cfg.point.warmup_steps) + u128::from(cfg.point.steps);
    for &seqs in &cfg.seqs_per_rank {
        let work = u128::from(cfg.point.ranks) * u128::from(seqs) * all_steps;
        if work > u128::from(MAX_SEQUENCE_STEPS) {
            bail!(
                "{path}: invalid `point.steps`: {} ranks × {seqs} sequences × ({} warm-up + {} \
                 steps) is more than the {MAX_SEQUENCE_STEPS} sequence-steps a point may run",
                cfg.point.ranks,
                cfg.point.warmup_steps,
                cfg.point.steps
            );
        }
    }
    Ok(())
}

/// Runs every batch size with the fixed and the dynamic policy in parallel; the results come
/// back in that order, fixed then dynamic for each batch size.
fn run_points(
    ctx: &RunContext,
    cfg: &DsparkConfig,
    profile: &HardwareProfile,
    path: &str,
    seed: u64,
) -> Result<Vec<(DsparkResult, Speed)>> {
    let jobs: Vec<(usize, bool)> = (0..cfg.seqs_per_rank.len())
        .flat_map(|i| [(i, false), (i, true)])
        .collect();
    let pb = super::progress(ctx, jobs.len() as u64, "dspark");
    let results: Vec<Result<(DsparkResult, Speed)>> = jobs
        .par_iter()
        .map(|&(i, dynamic)| {
            let point = DsparkPoint {
                seqs_per_rank: cfg.seqs_per_rank[i],
                ..cfg.point.clone()
            };
            let pol = if dynamic { &cfg.dynamic } else { &cfg.fixed };
            let started = std::time::Instant::now();
            let r = run_point(&point, pol, profile, &cfg.acceptance, seed)
                .map_err(|e| anyhow!("{path}: {e}"))?;
            let label = format!(
                "{} seq/rank, {}",
                point.seqs_per_rank,
                if dynamic { "dynamic" } else { "fixed" }
            );
            let wall = started.elapsed().as_secs_f64();
            pb.inc(1);
            let speed = Speed::counting(label, wall, r.simulated_s, "sequences", r.sequences);
            Ok((r, speed))
        })
        .collect();
    pb.finish_and_clear();
    results.into_iter().collect::<Result<_>>()
}

/// Writes one row per batch size and policy, and returns the table.
fn write_table(
    out: &mut RunOutput,
    cfg: &DsparkConfig,
    results: &[DsparkResult],
) -> Result<DataFrame> {
    let (mut b_col, mut mode, mut tput, mut acc, mut ver, mut step) =
        (vec![], vec![], vec![], vec![], vec![], vec![]);
    for (i, &b) in cfg.seqs_per_rank.iter().enumerate() {
        let (f, d) = (&results[2 * i], &results[2 * i + 1]);
        for (name, r) in [("fixed-5", f), ("dynamic", d)] {
            b_col.push(b);
            mode.push(name);
            tput.push(r.tokens_per_s_per_rank);
            acc.push(r.accepted_length);
            ver.push(r.verified_per_step);
            step.push(r.mean_step_ms);
        }
    }
    let mut df = df!(
        "seqs_per_rank" => b_col,
        "verification" => mode,
        "tokens_per_s_per_rank" => tput,
        "accepted_length" => acc,
        "verified_per_step" => ver,
        "mean_step_ms" => step,
    )?;
    out.write_table("dspark", &mut df)?;
    Ok(df)
}

/// The summary: each batch size against SPEC §10, targets out of tolerance marked.
fn summary_md(cfg: &DsparkConfig, results: &[DsparkResult], seed: u64) -> String {
    let mut md = Vec::new();
    let mut all_ok = true;
    for (i, &b) in cfg.seqs_per_rank.iter().enumerate() {
        let (row, ok) = compare_row(&cfg.published, i, b, &results[2 * i], &results[2 * i + 1]);
        all_ok &= ok;
        md.push(row);
    }
    let table = markdown_table(
        &[
            "seq/rank",
            "fixed-5 tok/s",
            "dynamic tok/s",
            "change (SPEC)",
            "verified/step (SPEC)",
            "accepted fixed (SPEC)",
            "accepted dynamic (SPEC)",
        ],
        &md,
    );
    let verdict = if all_ok {
        "every target within tolerance"
    } else {
        "targets marked ✗ are outside tolerance"
    };
    format!(
        "# DSpark: dynamic vs fixed-5 verification\n\nProfile `{}`, {} ranks, closed loop, seed {seed}. Published values in parentheses (SPEC §10). {verdict}.\n\n{table}",
        cfg.profile, cfg.point.ranks
    )
}

/// One batch size (`i`-th, `b` sequences per rank) with the fixed (`f`) and dynamic (`d`)
/// results against the published values: the markdown row and whether every target is met.
fn compare_row(
    p: &Published,
    i: usize,
    b: u32,
    f: &DsparkResult,
    d: &DsparkResult,
) -> (Vec<String>, bool) {
    let change = 100.0 * (d.tokens_per_s_per_rank / f.tokens_per_s_per_rank - 1.0);
    let want = p.throughput_change_pct[i];
    let ok_t = (change - want).abs() <= p.throughput_tolerance_pp;
    let ok_v = (p.verified_min..=p.verified_max).contains(&d.verified_per_step);
    let ok_af = (f.accepted_length - p.accepted_fixed).abs() <= p.accepted_tolerance;
    let ok_ad = (d.accepted_length - p.accepted_dynamic).abs() <= p.accepted_tolerance;
    let mark = |ok: bool| if ok { "" } else { " ✗" };
    let row = vec![
        b.to_string(),
        format!("{:.0}", f.tokens_per_s_per_rank),
        format!("{:.0}", d.tokens_per_s_per_rank),
        format!("{change:+.1}% ({want:+.1}%){}", mark(ok_t)),
        format!(
            "{:.2} ({:.1}–{:.1}){}",
            d.verified_per_step,
            p.verified_min,
            p.verified_max,
            mark(ok_v)
        ),
        format!(
            "{:.2} ({:.2}){}",
            f.accepted_length,
            p.accepted_fixed,
            mark(ok_af)
        ),
        format!(
            "{:.2} ({:.2}){}",
            d.accepted_length,
            p.accepted_dynamic,
            mark(ok_ad)
        ),
    ];
    (row, ok_t && ok_v && ok_af && ok_ad)
}
