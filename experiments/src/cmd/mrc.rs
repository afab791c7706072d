//! `servelab mrc`: hit-rate curves of a trace in one pass, for every store capacity (LRU stack
//! distances) and every TTL (reuse times), per traffic class; optionally sampled (SHARDS) with
//! the error against an unsampled pass, and checked against point replays.
//!
//! The curves are exact for the store semantics of `servelab replay` (`sim::replay::block_replay`):
//! capacity = an LRU store with watermarks 1.0 / 1.0 and no TTL; TTL = an unbounded store whose
//! blocks live the TTL after their last access, the same TTL for every class (see
//! `servelab_sim::mrc`). Output files hold no timings; speeds go to stdout only.

use crate::exp::trace_source::TraceFormat as Format;
use crate::output::{Manifest, RunOutput, markdown_table};
use crate::plot;
use anyhow::{Context, Result, bail};
use plotters::prelude::*;
use polars::prelude::*;
use serde::Serialize;
use servelab_core::{ClassTtl, Nanos, StoreConfig, TrafficClass};
use servelab_sim::mrc::{ClassCurve, Curves, MrcOptions, curves, log_grid};
use servelab_sim::replay::{BlockReplayReport, block_replay};
use servelab_workloads::Trace;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Trace file.
    #[arg(long)]
    pub trace: PathBuf,
    #[arg(long, value_enum)]
    pub format: Format,
    /// Block size in tokens (Mooncake default: the trace's own 512-token blocks; else 128).
    #[arg(long)]
    pub block_size: Option<u32>,
    /// Share of blocks kept by spatial sampling, in (0, 1]; 1 computes the exact curves.
    #[arg(long, default_value_t = 1.0)]
    pub sample_rate: f64,
    /// With --sample-rate below 1, skip the unsampled pass that measures the sampling error
    /// (for traces whose every distinct block does not fit in memory).
    #[arg(long)]
    pub no_exact: bool,
    /// Replay the trace through the store at this many capacities and as many TTLs spread over
    /// the curves, check that the unsampled curves equal them, and time both.
    #[arg(long, default_value_t = 0)]
    pub check: usize,
    /// Also write each request's output blocks to the store (as `replay --cache-outputs`).
    #[arg(long)]
    pub cache_outputs: bool,
    /// KV bytes per token (890 for V4.1-Flash): converts capacities in blocks to bytes.
    #[arg(long, default_value_t = 890)]
    pub bytes_per_token: u32,
    /// Traffic class given to Mooncake and Azure requests (their files do not say).
    #[arg(long, default_value = "other")]
    pub class: String,
    /// Grid points per decade of capacity and of TTL in the tables and plots.
    #[arg(long, default_value_t = 20)]
    pub points_per_decade: u32,
    /// Output folder.
    #[arg(long, default_value = "results/mrc")]
    pub out: PathBuf,
    /// Print one JSON object instead of the text summary.
    #[arg(long)]
    pub json: bool,
}

fn load(a: &Args, class: TrafficClass) -> Result<Trace> {
    crate::exp::trace_source::read(&a.trace, a.format, a.block_size, class)
}

/// The store a point replay uses for one capacity: LRU only, evicting exactly what does not fit.
fn lru_store(blocks: u64, block_bytes: u64) -> StoreConfig {
    StoreConfig {
        capacity_bytes: Some(blocks * block_bytes),
        high_watermark: 1.0,
        low_watermark: 1.0,
        ttl: ClassTtl::none(),
        ..StoreConfig::default()
    }
}

/// The store a point replay uses for one TTL: unbounded, the TTL counted from the last access.
fn ttl_store(ttl: Nanos) -> StoreConfig {
    StoreConfig {
        capacity_bytes: None,
        ttl: ClassTtl::uniform(Some(ttl)),
        ..StoreConfig::default()
    }
}

/// One row of the capacity or TTL table.
struct Row {
    class: &'static str,
    x: f64,
    token: f64,
    block: f64,
    hit_tokens: u64,
    hit_blocks: u64,
    counted_tokens: u64,
    counted_blocks: u64,
}

fn capacity_rows(c: &Curves, grid: &[u64]) -> Vec<Row> {
    let mut rows = Vec::new();
    for curve in c.curves() {
        for &cap in grid {
            let p = c.at_capacity(curve, cap);
            rows.push(Row {
                class: curve.name(),
                x: cap as f64,
                token: p.token_hit_rate,
                block: p.block_hit_rate,
                hit_tokens: p.hit_tokens,
                hit_blocks: p.hit_blocks,
                counted_tokens: curve.counted_tokens,
                counted_blocks: curve.counted_blocks,
            });
        }
    }
    rows
}

fn ttl_rows(c: &Curves, grid: &[Nanos]) -> Vec<Row> {
    let mut rows = Vec::new();
    for curve in c.curves() {
        for &ttl in grid {
            let p = curve.at_ttl(ttl);
            rows.push(Row {
                class: curve.name(),
                x: ttl.as_secs_f64(),
                token: p.token_hit_rate,
                block: p.block_hit_rate,
                hit_tokens: p.hit_tokens,
                hit_blocks: p.hit_blocks,
                counted_tokens: curve.counted_tokens,
                counted_blocks: curve.counted_blocks,
            });
        }
    }
    rows
}

fn rows_frame(rows: &[Row], x_name: &str, extra: Option<(&str, u64)>) -> Result<DataFrame> {
    let mut cols = vec![
        Column::new(
            "class".into(),
            rows.iter().map(|r| r.class).collect::<Vec<_>>(),
        ),
        Column::new(x_name.into(), rows.iter().map(|r| r.x).collect::<Vec<_>>()),
    ];
    if let Some((name, bytes_per_block)) = extra {
        cols.push(Column::new(
            name.into(),
            rows.iter()
                .map(|r| r.x as u64 * bytes_per_block)
                .collect::<Vec<_>>(),
        ));
    }
    cols.extend([
        Column::new(
            "token_hit_rate".into(),
            rows.iter().map(|r| r.token).collect::<Vec<_>>(),
        ),
        Column::new(
            "block_hit_rate".into(),
            rows.iter().map(|r| r.block).collect::<Vec<_>>(),
        ),
        Column::new(
            "hit_tokens".into(),
            rows.iter().map(|r| r.hit_tokens).collect::<Vec<_>>(),
        ),
        Column::new(
            "hit_blocks".into(),
            rows.iter().map(|r| r.hit_blocks).collect::<Vec<_>>(),
        ),
        Column::new(
            "counted_tokens".into(),
            rows.iter().map(|r| r.counted_tokens).collect::<Vec<_>>(),
        ),
        Column::new(
            "counted_blocks".into(),
            rows.iter().map(|r| r.counted_blocks).collect::<Vec<_>>(),
        ),
    ]);
    Ok(DataFrame::new(rows.len(), cols)?)
}

/// Largest and mean absolute difference of token and block hit rates between two tables on the
/// same grid, per class.
#[derive(Clone, Debug, Serialize)]
struct ErrorSummary {
    curve: &'static str,
    class: &'static str,
    points: usize,
    max_abs_token_error: f64,
    mean_abs_token_error: f64,
    max_abs_block_error: f64,
    mean_abs_block_error: f64,
}

fn errors(curve: &'static str, exact: &[Row], sampled: &[Row]) -> Vec<ErrorSummary> {
    let mut out: Vec<ErrorSummary> = Vec::new();
    for (e, s) in exact.iter().zip(sampled) {
        debug_assert!(e.class == s.class && e.x == s.x);
        let (dt, db) = ((e.token - s.token).abs(), (e.block - s.block).abs());
        match out.last_mut() {
            Some(x) if x.class == e.class => {
                x.points += 1;
                x.max_abs_token_error = x.max_abs_token_error.max(dt);
                x.mean_abs_token_error += dt;
                x.max_abs_block_error = x.max_abs_block_error.max(db);
                x.mean_abs_block_error += db;
            }
            _ => out.push(ErrorSummary {
                curve,
                class: e.class,
                points: 1,
                max_abs_token_error: dt,
                mean_abs_token_error: dt,
                max_abs_block_error: db,
                mean_abs_block_error: db,
            }),
        }
    }
    for x in &mut out {
        x.mean_abs_token_error /= x.points as f64;
        x.mean_abs_block_error /= x.points as f64;
    }
    out
}

/// One point replay compared with the unsampled curve.
#[derive(Clone, Debug, Serialize)]
struct CheckRow {
    curve: &'static str,
    x: f64,
    class: &'static str,
    replay_hit_tokens: u64,
    curve_hit_tokens: u64,
    /// The replay counts blocks only over all requests: None on a class's row.
    replay_block_hits: Option<u64>,
    curve_block_hits: u64,
    equal: bool,
}

fn compare(
    curve: &'static str,
    x: f64,
    exact: &Curves,
    rep: &BlockReplayReport,
    at: impl Fn(&ClassCurve) -> servelab_sim::mrc::Point,
    out: &mut Vec<CheckRow>,
) {
    for c in exact.curves() {
        let p = at(c);
        let (tokens, blocks) = match c.class {
            None => (rep.hit_tokens, Some(rep.block_hits)),
            // The replay reports tokens per class but blocks only in total.
            Some(k) => (
                rep.per_class.get(k.name()).map_or(0, |h| h.hit_tokens),
                None,
            ),
        };
        out.push(CheckRow {
            curve,
            x,
            class: c.name(),
            replay_hit_tokens: tokens,
            curve_hit_tokens: p.hit_tokens,
            replay_block_hits: blocks,
            curve_block_hits: p.hit_blocks,
            equal: tokens == p.hit_tokens && blocks.is_none_or(|b| b == p.hit_blocks),
        });
    }
}

/// `k` points spread evenly (by index) over `grid`, ends included.
fn spread<T: Copy>(grid: &[T], k: usize) -> Vec<T> {
    if grid.is_empty() || k == 0 {
        return Vec::new();
    }
    if k == 1 {
        return vec![grid[grid.len() / 2]];
    }
    let mut idx: Vec<usize> = (0..k)
        .map(|i| i * (grid.len() - 1) / (k - 1).max(1))
        .collect();
    idx.dedup();
    idx.into_iter().map(|i| grid[i]).collect()
}

/// Two panels (token and block hit rate) with a log x axis and a line per class; `faint`
/// series (the sampled curves next to exact ones) are drawn thin with markers.
fn curve_plot(path: &Path, title: &str, x_label: &str, series: &[CurveSeries]) -> Result<()> {
    let root = SVGBackend::new(path, (1200, 560)).into_drawing_area();
    root.fill(&WHITE)
        .map_err(|x| anyhow::anyhow!("plot: {x:?}"))?;
    let root = root
        .titled(title, ("sans-serif", 22))
        .map_err(|x| anyhow::anyhow!("plot: {x:?}"))?;
    let (x0, x1) = series
        .iter()
        .flat_map(|s| s.3.iter().map(|p| p.0))
        .filter(|x| *x > 0.0)
        .fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
    let (x0, x1) = if x0 < x1 { (x0, x1) } else { (1.0, 10.0) };
    let panels = root.split_evenly((1, 2));
    for (pi, (panel, name)) in panels
        .iter()
        .zip(["token hit rate", "block hit rate"])
        .enumerate()
    {
        let mut chart = ChartBuilder::on(panel)
            .margin(14)
            .x_label_area_size(44)
            .y_label_area_size(60)
            .build_cartesian_2d((x0..x1).log_scale(), 0f64..1.0)
            .map_err(|x| anyhow::anyhow!("plot: {x:?}"))?;
        chart
            .configure_mesh()
            .x_desc(x_label)
            .y_desc(name)
            .y_label_formatter(&|y| format!("{:.0}%", y * 100.0))
            .draw()
            .map_err(|x| anyhow::anyhow!("plot: {x:?}"))?;
        for (label, ci, faint, pts) in series {
            let c = plot::color(*ci);
            let xy: Vec<(f64, f64)> = pts
                .iter()
                .filter(|p| p.0 > 0.0)
                .map(|p| (p.0, if pi == 0 { p.1 } else { p.2 }))
                .collect();
            let width = if *faint { 1 } else { 2 };
            chart
                .draw_series(LineSeries::new(xy.iter().copied(), c.stroke_width(width)))
                .map_err(|x| anyhow::anyhow!("plot: {x:?}"))?
                .label(label.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(width))
                });
            if *faint {
                chart
                    .draw_series(xy.iter().map(|&p| Circle::new(p, 2, c.filled())))
                    .map_err(|x| anyhow::anyhow!("plot: {x:?}"))?;
            }
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()
            .map_err(|x| anyhow::anyhow!("plot: {x:?}"))?;
    }
    root.present().map_err(|x| anyhow::anyhow!("plot: {x:?}"))?;
    Ok(())
}

fn series_of(rows: &[Row], curves: &Curves, suffix: &str, faint: bool) -> Vec<CurveSeries> {
    curves
        .curves()
        .enumerate()
        .map(|(i, c)| {
            let pts = rows
                .iter()
                .filter(|r| r.class == c.name())
                .map(|r| (r.x, r.token, r.block))
                .collect();
            (format!("{}{suffix}", c.name()), i, faint, pts)
        })
        .collect()
}

#[derive(Serialize)]
struct Speed {
    one_pass_s: f64,
    one_pass_requests_per_s: f64,
    sampled_pass_s: Option<f64>,
    sampled_requests_per_s: Option<f64>,
    point_replays: usize,
    point_replay_mean_s: Option<f64>,
    point_replay_requests_per_s: Option<f64>,
}

/// What a pass gave: the `--json` object, the text report, and whether every point replay
/// equals the curve (the files are in `out` either way).
pub struct Outcome {
    pub json: serde_json::Value,
    pub text: String,
    pub all_equal: bool,
}

impl Outcome {
    /// The error both the command and the Python function end with when a replay differs.
    pub fn check(&self) -> Result<()> {
        if !self.all_equal {
            bail!("point replays differ from the unsampled curve (see check.csv)");
        }
        Ok(())
    }
}

pub fn run(a: Args) -> Result<()> {
    let o = compute(&a)?;
    if a.json {
        println!("{}", o.json);
    } else {
        print!("{}", o.text);
    }
    o.check()
}

/// Computes the curves, writes the tables, plots, summary and manifest to `a.out`.
pub fn compute(a: &Args) -> Result<Outcome> {
    let class = check_args(a)?;
    let sampler = servelab_sim::mrc::Sampler::new(a.sample_rate)
        .map_err(|e| anyhow::anyhow!("--sample-rate: {e}"))?;
    let trace = load(a, class)?;
    if trace.is_empty() {
        bail!("{}: the trace has no requests", a.trace.display());
    }
    let block_bytes = u64::from(trace.block_tokens) * u64::from(a.bytes_per_token);
    let opts = MrcOptions {
        sample_rate: a.sample_rate,
        cache_outputs: a.cache_outputs,
    };
    let passes = Passes::run(&trace, opts, !sampler.is_exact(), a.no_exact)?;
    let grids = Grids::new(passes.reference(), a.points_per_decade);

    let mut out = RunOutput::create(&a.out)?;
    let (main_cap, main_ttl) = write_curve_tables(&mut out, passes.main(), &grids, block_bytes)?;
    // Sampling error against the unsampled pass on the same grids.
    let mut error_summary: Vec<ErrorSummary> = Vec::new();
    let mut exact_rows: Option<(Vec<Row>, Vec<Row>)> = None;
    if let (Some((e, _)), Some(_)) = (&passes.exact, &passes.sampled) {
        let (ec, et) = (capacity_rows(e, &grids.cap), ttl_rows(e, &grids.ttl));
        error_summary.extend(errors("capacity", &ec, &main_cap));
        error_summary.extend(errors("ttl", &et, &main_ttl));
        write_sampling_error(
            &mut out,
            [("capacity", &ec, &main_cap), ("ttl", &et, &main_ttl)],
        )?;
        exact_rows = Some((ec, et));
    }
    let mut checks: Vec<CheckRow> = Vec::new();
    let mut replay_times: Vec<f64> = Vec::new();
    if a.check > 0 {
        let Some((e, _)) = &passes.exact else {
            bail!("--check compares point replays with the unsampled curves: drop --no-exact");
        };
        (checks, replay_times) = point_replays(a, &trace, e, &grids, block_bytes)?;
        write_check_table(&mut out, &checks)?;
    }

    let f = Findings {
        a,
        trace: &trace,
        trace_name: a.trace.file_name().map_or_else(
            || a.trace.display().to_string(),
            |n| n.to_string_lossy().into(),
        ),
        passes: &passes,
        grids: &grids,
        block_bytes,
        sampler,
        error_summary,
        checks,
        replay_times,
    };
    write_plots(&mut out, &f, (&main_cap, &main_ttl), exact_rows.as_ref())?;
    out.write_text("summary.md", &f.summary_md())?;
    write_manifest(&mut out, &f, class)?;
    let speed = f.speed();
    Ok(Outcome {
        json: f.json(&speed),
        text: f.text(&speed, &out),
        all_equal: f.all_equal(),
    })
}

/// Parses `--class` and rejects the zero sizes no curve can be drawn with.
fn check_args(a: &Args) -> Result<TrafficClass> {
    let class = TrafficClass::parse(&a.class)
        .with_context(|| format!("--class: unknown class `{}` (agent, chat, other)", a.class))?;
    if a.block_size == Some(0) {
        bail!("--block-size must be positive");
    }
    if a.bytes_per_token == 0 {
        bail!("--bytes-per-token must be positive");
    }
    if a.points_per_decade == 0 {
        bail!("--points-per-decade must be positive");
    }
    Ok(class)
}

/// The unsampled and the sampled pass over the trace, each with its run time in seconds.
struct Passes {
    exact: Option<(Curves, f64)>,
    sampled: Option<(Curves, f64)>,
}

impl Passes {
    /// The unsampled pass (unless asked not to), then the sampled one.
    fn run(trace: &Trace, opts: MrcOptions, sampled_mode: bool, no_exact: bool) -> Result<Self> {
        let mut exact: Option<(Curves, f64)> = None;
        if !sampled_mode || !no_exact {
            let t = Instant::now();
            let c = curves(
                trace,
                MrcOptions {
                    sample_rate: 1.0,
                    ..opts
                },
            )
            .map_err(|e| anyhow::anyhow!("{e}"))?;
            exact = Some((c, t.elapsed().as_secs_f64()));
        }
        let sampled: Option<(Curves, f64)> = if sampled_mode {
            let t = Instant::now();
            let c = curves(trace, opts).map_err(|e| anyhow::anyhow!("{e}"))?;
            Some((c, t.elapsed().as_secs_f64()))
        } else {
            None
        };
        Ok(Self { exact, sampled })
    }

    /// The curves the tables show: the sampled ones when sampled, else the exact ones.
    fn main(&self) -> &Curves {
        self.sampled
            .as_ref()
            .or(self.exact.as_ref())
            .map(|x| &x.0)
            .expect("one pass ran")
    }

    /// The curves the grids and totals come from: the unsampled ones where that pass ran.
    fn reference(&self) -> &Curves {
        self.exact.as_ref().map_or(self.main(), |x| &x.0)
    }
}

/// The capacity and TTL grids of the tables and plots, and the points they are cut at.
struct Grids {
    cap: Vec<u64>,
    ttl: Vec<Nanos>,
    /// The capacity past which the curve stops rising.
    sat: u64,
    max_reuse: Nanos,
}

impl Grids {
    /// Capacities up to where the curve stops rising (a step past it shows the plateau), TTLs
    /// from 1 ms up to just past the longest reuse time.
    fn new(reference: &Curves, points_per_decade: u32) -> Self {
        let sat = reference.saturating_capacity();
        let cap = log_grid((sat + sat / 8).max(2), points_per_decade);
        let max_reuse = reference.all.max_reuse();
        let top_ms = (max_reuse.0 / 1_000_000 + 1) * 9 / 8 + 1;
        let ttl: Vec<Nanos> = log_grid(top_ms.max(2), points_per_decade)
            .into_iter()
            .map(Nanos::from_millis)
            .collect();
        Self {
            cap,
            ttl,
            sat,
            max_reuse,
        }
    }
}

/// Writes the main curves' capacity and TTL tables and returns their rows.
fn write_curve_tables(
    out: &mut RunOutput,
    main: &Curves,
    grids: &Grids,
    block_bytes: u64,
) -> Result<(Vec<Row>, Vec<Row>)> {
    let main_cap = capacity_rows(main, &grids.cap);
    let main_ttl = ttl_rows(main, &grids.ttl);
    out.write_table(
        "capacity",
        &mut rows_frame(
            &main_cap,
            "capacity_blocks",
            Some(("capacity_bytes", block_bytes)),
        )?,
    )?;
    out.write_table("ttl", &mut rows_frame(&main_ttl, "ttl_s", None)?)?;
    Ok((main_cap, main_ttl))
}

/// Writes the sampling error table: for each curve, (name, unsampled rows, sampled rows) on
/// the same grid.
fn write_sampling_error(out: &mut RunOutput, curves: [(&str, &[Row], &[Row]); 2]) -> Result<()> {
    let mut rows: Vec<(&str, &str, f64, f64, f64, f64, f64)> = Vec::new();
    for (curve, ex, sa) in curves {
        for (x, s) in ex.iter().zip(sa.iter()) {
            rows.push((curve, x.class, x.x, x.token, s.token, x.block, s.block));
        }
    }
    let mut df = df!(
        "curve" => rows.iter().map(|r| r.0).collect::<Vec<_>>(),
        "class" => rows.iter().map(|r| r.1).collect::<Vec<_>>(),
        "x" => rows.iter().map(|r| r.2).collect::<Vec<_>>(),
        "exact_token_hit_rate" => rows.iter().map(|r| r.3).collect::<Vec<_>>(),
        "sampled_token_hit_rate" => rows.iter().map(|r| r.4).collect::<Vec<_>>(),
        "token_error" => rows.iter().map(|r| r.4 - r.3).collect::<Vec<_>>(),
        "exact_block_hit_rate" => rows.iter().map(|r| r.5).collect::<Vec<_>>(),
        "sampled_block_hit_rate" => rows.iter().map(|r| r.6).collect::<Vec<_>>(),
        "block_error" => rows.iter().map(|r| r.6 - r.5).collect::<Vec<_>>(),
    )?;
    out.write_table("sampling_error", &mut df)
}

/// Point replays at a spread of the grid's capacities and TTLs, compared with the unsampled
/// curves; returns the comparison rows and each replay's time in seconds.
fn point_replays(
    a: &Args,
    trace: &Trace,
    e: &Curves,
    grids: &Grids,
    block_bytes: u64,
) -> Result<(Vec<CheckRow>, Vec<f64>)> {
    let mut checks: Vec<CheckRow> = Vec::new();
    let mut replay_times: Vec<f64> = Vec::new();
    for cap in spread(&grids.cap, a.check) {
        let t = Instant::now();
        let rep = block_replay(
            trace,
            &lru_store(cap, block_bytes),
            block_bytes,
            a.cache_outputs,
        )
        .map_err(|x| anyhow::anyhow!("{x}"))?;
        replay_times.push(t.elapsed().as_secs_f64());
        compare(
            "capacity",
            cap as f64,
            e,
            &rep,
            |c| e.at_capacity(c, cap),
            &mut checks,
        );
    }
    for ttl in spread(&grids.ttl, a.check) {
        let t = Instant::now();
        let rep = block_replay(trace, &ttl_store(ttl), block_bytes, a.cache_outputs)
            .map_err(|x| anyhow::anyhow!("{x}"))?;
        replay_times.push(t.elapsed().as_secs_f64());
        compare(
            "ttl",
            ttl.as_secs_f64(),
            e,
            &rep,
            |c| c.at_ttl(ttl),
            &mut checks,
        );
    }
    Ok((checks, replay_times))
}

/// Writes the point replays, one row per replay and class.
fn write_check_table(out: &mut RunOutput, checks: &[CheckRow]) -> Result<()> {
    let mut df = df!(
        "curve" => checks.iter().map(|r| r.curve).collect::<Vec<_>>(),
        "x" => checks.iter().map(|r| r.x).collect::<Vec<_>>(),
        "class" => checks.iter().map(|r| r.class).collect::<Vec<_>>(),
        "replay_hit_tokens" => checks.iter().map(|r| r.replay_hit_tokens).collect::<Vec<_>>(),
        "curve_hit_tokens" => checks.iter().map(|r| r.curve_hit_tokens).collect::<Vec<_>>(),
        "replay_block_hits" => checks.iter().map(|r| r.replay_block_hits).collect::<Vec<_>>(),
        "curve_block_hits" => checks.iter().map(|r| r.curve_block_hits).collect::<Vec<_>>(),
        "equal" => checks.iter().map(|r| r.equal).collect::<Vec<_>>(),
    )?;
    out.write_table("check", &mut df)
}

/// Everything the plots, the summary, the manifest and both reports are written from.
struct Findings<'a> {
    a: &'a Args,
    trace: &'a Trace,
    trace_name: String,
    passes: &'a Passes,
    grids: &'a Grids,
    block_bytes: u64,
    sampler: servelab_sim::mrc::Sampler,
    error_summary: Vec<ErrorSummary>,
    checks: Vec<CheckRow>,
    replay_times: Vec<f64>,
}

/// Plots the main curves (`main`: capacity and TTL rows); next to the exact ones when sampled.
fn write_plots(
    out: &mut RunOutput,
    f: &Findings,
    main: (&[Row], &[Row]),
    exact_rows: Option<&(Vec<Row>, Vec<Row>)>,
) -> Result<()> {
    let (main_cap, main_ttl) = main;
    let curves = f.passes.main();
    let what = if f.sampled_mode() {
        format!(", sampled at {:.4}", f.sampler.rate())
    } else {
        String::new()
    };
    let mut cap_series = Vec::new();
    let mut ttl_series = Vec::new();
    if let (Some((ec, et)), Some((e, _))) = (exact_rows, &f.passes.exact) {
        cap_series.extend(series_of(ec, e, " (exact)", false));
        ttl_series.extend(series_of(et, e, " (exact)", false));
        cap_series.extend(series_of(main_cap, curves, " (sampled)", true));
        ttl_series.extend(series_of(main_ttl, curves, " (sampled)", true));
    } else {
        cap_series.extend(series_of(main_cap, curves, "", false));
        ttl_series.extend(series_of(main_ttl, curves, "", false));
    }
    let trace_name = &f.trace_name;
    curve_plot(
        &out.path("capacity.svg"),
        &format!(
            "{trace_name}: hit rate vs LRU store capacity ({}-token blocks{what})",
            f.trace.block_tokens
        ),
        &format!(
            "capacity, blocks (1 block = {:.3} MB)",
            f.block_bytes as f64 / 1e6
        ),
        &cap_series,
    )?;
    curve_plot(
        &out.path("ttl.svg"),
        &format!("{trace_name}: hit rate vs TTL from last access, unbounded store{what}"),
        "TTL, seconds",
        &ttl_series,
    )
}

/// Writes the manifest with the run's settings. Sampling is a hash of the block key: nothing
/// random, so the seed is 0.
fn write_manifest(out: &mut RunOutput, f: &Findings, class: TrafficClass) -> Result<()> {
    let a = f.a;
    let config = serde_json::json!({
        "trace": a.trace.display().to_string(),
        "format": format!("{:?}", a.format).to_lowercase(),
        "block_tokens": f.trace.block_tokens,
        "sample_rate": a.sample_rate,
        "sample_rate_used": f.sampler.rate(),
        "exact_pass": f.passes.exact.is_some(),
        "check": a.check,
        "cache_outputs": a.cache_outputs,
        "bytes_per_token": a.bytes_per_token,
        "class": class.name(),
        "points_per_decade": a.points_per_decade,
    });
    out.write_manifest(
        &Manifest::new("mrc", &a.trace, &serde_json::to_string_pretty(&config)?, 0),
        // The passes' speed figures are in `summary.json` (`speed`), which the command prints.
        &[],
    )
}

impl Findings<'_> {
    fn sampled_mode(&self) -> bool {
        !self.sampler.is_exact()
    }

    fn requests(&self) -> f64 {
        self.trace.len() as f64
    }

    fn all_equal(&self) -> bool {
        self.checks.iter().all(|c| c.equal)
    }

    /// The summary: the headline table, the sampling error and point replays where they ran,
    /// and the list of files.
    fn summary_md(&self) -> String {
        let mut summary = self.summary_intro();
        if !self.error_summary.is_empty() {
            summary.push_str(&self.error_section());
        }
        if !self.checks.is_empty() {
            let bad = self.checks.iter().filter(|c| !c.equal).count();
            summary.push_str(&format!(
                "\n## Point replays\n\n{} replays ({} rows with classes): {}.\n",
                self.replay_times.len(),
                self.checks.len(),
                if bad == 0 {
                    "every one equals the curve exactly".to_string()
                } else {
                    format!("{bad} rows differ (see check.csv)")
                }
            ));
        }
        summary.push_str(
            "\n## Files\n\n- `capacity.csv`/`.parquet`: class × capacity (blocks, bytes) → token \
             and block hit rate, hit and counted tokens and blocks (counted = the sampled keys' \
             totals).\n\
             - `ttl.csv`/`.parquet`: the same against the TTL in seconds.\n\
             - `sampling_error.csv`/`.parquet` (sampled runs with an unsampled pass): both rates \
             on the same grid.\n- `check.csv`/`.parquet` (with --check): point replays vs the \
             curve.\n\
             - `capacity.svg`, `ttl.svg`: the curves, log x axis, a line per class.\n",
        );
        summary
    }

    /// The title, what the curves mean, and the unbounded hit rate per class.
    fn summary_intro(&self) -> String {
        let (a, g) = (self.a, self.grids);
        let headline: Vec<Vec<String>> = self
            .passes
            .main()
            .curves()
            .map(|c| {
                let u = c.unbounded();
                vec![
                    c.name().to_string(),
                    c.requests.to_string(),
                    c.input_tokens.to_string(),
                    format!("{:.2}%", 100.0 * u.token_hit_rate),
                    format!("{:.2}%", 100.0 * u.block_hit_rate),
                ]
            })
            .collect();
        let table = markdown_table(
            &[
                "class",
                "requests",
                "input tokens",
                "token hit rate, unbounded",
                "block hit rate, unbounded",
            ],
            &headline,
        );
        format!(
            "# Hit-rate curves: {}\n\nTrace `{}` ({} format), {} requests, {}-token blocks \
             ({} B each), {} distinct blocks{}; outputs {}written back. Sample rate {}.\n\n{table}\n\
             The capacity curve is exact for an LRU store with watermarks 1.0 / 1.0 and no TTL (what \
             `servelab replay --policy lru` runs); the TTL curve for an unbounded store whose blocks \
             live the TTL after their last access, the same TTL for every class. A hit is the leading \
             run of a prompt's blocks found in the store. Capacities past {} blocks ({:.3} GB) add no \
             hits; TTLs past {:.1} s add none.\n",
            self.trace_name,
            a.trace.display(),
            format!("{:?}", a.format).to_lowercase(),
            self.trace.len(),
            self.trace.block_tokens,
            self.block_bytes,
            self.passes.reference().distinct_blocks,
            if self.sampled_mode() && self.passes.exact.is_none() {
                " among the sampled keys"
            } else {
                ""
            },
            if a.cache_outputs { "" } else { "not " },
            self.sampler.rate(),
            g.sat,
            g.sat as f64 * self.block_bytes as f64 / 1e9,
            g.max_reuse.as_secs_f64(),
        )
    }

    fn error_section(&self) -> String {
        let rows: Vec<Vec<String>> = self
            .error_summary
            .iter()
            .map(|e| {
                vec![
                    e.curve.to_string(),
                    e.class.to_string(),
                    e.points.to_string(),
                    format!("{:.3}", 100.0 * e.max_abs_token_error),
                    format!("{:.3}", 100.0 * e.mean_abs_token_error),
                    format!("{:.3}", 100.0 * e.max_abs_block_error),
                    format!("{:.3}", 100.0 * e.mean_abs_block_error),
                ]
            })
            .collect();
        format!(
            "\n## Sampling error (percentage points, sampled minus unsampled, on the grid)\n\n{}",
            markdown_table(
                &[
                    "curve",
                    "class",
                    "points",
                    "max token",
                    "mean token",
                    "max block",
                    "mean block"
                ],
                &rows
            )
        )
    }

    fn speed(&self) -> Speed {
        let (exact, sampled) = (&self.passes.exact, &self.passes.sampled);
        let requests = self.requests();
        let replay_times = &self.replay_times;
        Speed {
            one_pass_s: exact.as_ref().map_or(f64::NAN, |x| x.1),
            one_pass_requests_per_s: exact.as_ref().map_or(f64::NAN, |x| requests / x.1),
            sampled_pass_s: sampled.as_ref().map(|x| x.1),
            sampled_requests_per_s: sampled.as_ref().map(|x| requests / x.1),
            point_replays: replay_times.len(),
            point_replay_mean_s: (!replay_times.is_empty())
                .then(|| replay_times.iter().sum::<f64>() / replay_times.len() as f64),
            point_replay_requests_per_s: (!replay_times.is_empty())
                .then(|| requests * replay_times.len() as f64 / replay_times.iter().sum::<f64>()),
        }
    }

    /// The `--json` object.
    fn json(&self, speed: &Speed) -> serde_json::Value {
        let classes: Vec<_> = self
            .passes
            .main()
            .curves()
            .map(|c| {
                let u = c.unbounded();
                serde_json::json!({
                    "class": c.name(),
                    "requests": c.requests,
                    "input_tokens": c.input_tokens,
                    "unbounded_token_hit_rate": u.token_hit_rate,
                    "unbounded_block_hit_rate": u.block_hit_rate,
                })
            })
            .collect();
        serde_json::json!({
            "trace": self.a.trace.display().to_string(),
            "requests": self.trace.len(),
            "block_tokens": self.trace.block_tokens,
            "sample_rate": self.sampler.rate(),
            "saturating_capacity_blocks": self.grids.sat,
            "max_reuse_s": self.grids.max_reuse.as_secs_f64(),
            "classes": classes,
            "sampling_error": self.error_summary,
            "checks": self.checks.len(),
            "checks_equal": self.all_equal(),
            "speed": speed,
            "out": self.a.out.display().to_string(),
        })
    }

    /// The text report, a line per fact.
    fn text(&self, speed: &Speed, out: &RunOutput) -> String {
        let mut text = String::new();
        let mut say = |line: String| {
            text.push_str(&line);
            text.push('\n');
        };
        let (g, requests) = (self.grids, self.requests());
        say(format!(
            "trace        {} ({} requests, block {} tokens, sample rate {})",
            self.a.trace.display(),
            self.trace.len(),
            self.trace.block_tokens,
            self.sampler.rate()
        ));
        for c in self.passes.main().curves() {
            let u = c.unbounded();
            say(format!(
                "{:<12} unbounded: token hit {:.2}%, block hit {:.2}% ({} requests)",
                c.name(),
                100.0 * u.token_hit_rate,
                100.0 * u.block_hit_rate,
                c.requests
            ));
        }
        say(format!(
            "saturates at {} blocks ({:.3} GB); longest reuse {:.1} s",
            g.sat,
            g.sat as f64 * self.block_bytes as f64 / 1e9,
            g.max_reuse.as_secs_f64()
        ));
        for e in self.error_summary.iter().filter(|e| e.class == "all") {
            say(format!(
                "sampling err {:<8} max {:.3} pp, mean {:.3} pp (token); max {:.3} pp (block)",
                e.curve,
                100.0 * e.max_abs_token_error,
                100.0 * e.mean_abs_token_error,
                100.0 * e.max_abs_block_error
            ));
        }
        if let Some((_, s)) = &self.passes.exact {
            say(format!(
                "one pass     {:.3} s, {:.0} requests/s",
                s,
                requests / s
            ));
        }
        if let Some((_, s)) = &self.passes.sampled {
            say(format!(
                "sampled pass {:.3} s, {:.0} requests/s",
                s,
                requests / s
            ));
        }
        if let (Some(m), Some(r)) = (speed.point_replay_mean_s, speed.point_replay_requests_per_s) {
            say(format!(
                "point replay {:.3} s each on average, {:.0} requests/s ({} replays: {})",
                m,
                r,
                self.replay_times.len(),
                if self.all_equal() {
                    "all equal to the curve"
                } else {
                    "SOME DIFFER"
                }
            ));
        }
        say(format!("wrote        {}", out.dir().display()));
        text
    }
}

/// One plotted curve: (label, panel, log axis, points (x, token hit rate, block hit rate)).
type CurveSeries = (String, usize, bool, Vec<(f64, f64, f64)>);
