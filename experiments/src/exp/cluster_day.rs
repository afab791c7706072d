//! The `cluster-day` experiment: one day of a whole cluster (SPEC §12: 155 trillion tokens a
//! day), simulated on a spatial sample of its sessions, beside the economics instrument's
//! reading of the same day.
//!
//! The cluster is `day.units` copies of the `[service]` unit behind an entrypoint that routes
//! whole sessions by a hash, sharing one store. One session in `one_in` is kept (by a hash of
//! the session, before it is drawn) and served by a unit holding 1/`one_in` of the cluster's
//! engines, decode groups, SWA machines, storage nodes and store capacity
//! ([`super::sampling`]); every count the run reports is scaled back by `one_in`. What this
//! leaves out: sharing the store between units (the `cluster` experiment measures what it
//! adds) and anything that does not scale with the sample (balancer effects of a small pool;
//! the `sampling` experiment measures the latency error they cause, which is why latencies are
//! not reported here). Further samples at the same rate keep other sessions; the summary
//! states their spread as the sampling error.
//!
//! Per hour: the cluster's arrivals, tokens, hit rate (of the sampled request rows), and the
//! GPUs each pool kept busy (prefill: busy fraction × engines; decode: sequences held ÷ the
//! slots per rank × ranks, what the pool would need with every slot full).

use super::RunContext;
use super::sampling::scaled;
use crate::config::ExperimentHeader;
use crate::output::{Manifest, RunOutput, markdown_table};
use crate::speed::Speed;
use anyhow::{Result, anyhow, bail};
use polars::prelude::*;
use serde::Deserialize;
use servelab_core::Nanos;
use servelab_core::econ::{self, EconEstimate, EconParams, MeasuredDay, MeasuredRevenue, Prices};
use servelab_core::seed::sub_seed;
use servelab_core::unit::drive::NoObserver;
use servelab_sim::env::RequestFeed;
use servelab_sim::profile::{HardwareProfile, ProfileFiles};
use servelab_sim::service::{ServiceConfig, ServiceReport, run_streamed};
use servelab_workloads::generate::WorkloadConfig;
use servelab_workloads::stream::{SessionSample, Stream};
use std::collections::BTreeMap;
use std::time::Instant;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    #[allow(dead_code)]
    experiment: ExperimentHeader,
    /// One unit of the cluster.
    service: ServiceConfig,
    /// The whole cluster's traffic.
    workload: WorkloadConfig,
    day: Day,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Day {
    /// Units in the cluster.
    units: u32,
    /// Sampling rate: 1 in `one_in` sessions.
    one_in: u32,
    /// Independent samples at that rate (different sessions kept): the first is the one
    /// reported, the others measure its error. Run one after the other, so memory holds one.
    samples: u32,
    /// Off-peak prices, USD per million tokens (SPEC §12).
    hit_price: f64,
    miss_price: f64,
    output_price: f64,
    /// The published day the run is set beside (SPEC §12).
    published: Published,
    /// How long the KV written in a day is kept, for the store the TTLs need (days).
    ttl_days: f64,
}

/// SPEC §12's figures for the whole cluster, as published or as read from it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Published {
    tokens_per_day: f64,
    /// The band of hit rates, output shares below `output_share_below`, and the band of GPU
    /// counts that the published figures allow.
    hit_rate: [f64; 2],
    output_share_below: f64,
    gpus: [f64; 2],
    revenue_per_gpu_hour: f64,
    store_pib: f64,
}

impl Published {
    fn validate(&self) -> Result<()> {
        let bands = [("hit_rate", self.hit_rate), ("gpus", self.gpus)];
        for (name, [lo, hi]) in bands {
            if !(lo.is_finite() && hi.is_finite() && 0.0 <= lo && lo <= hi) {
                bail!("day.published.{name}: a band [low, high] with 0 <= low <= high");
            }
        }
        let positive = [
            ("tokens_per_day", self.tokens_per_day),
            ("output_share_below", self.output_share_below),
            ("revenue_per_gpu_hour", self.revenue_per_gpu_hour),
            ("store_pib", self.store_pib),
        ];
        for (name, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                bail!("day.published.{name}: must be a positive number, got {v}");
            }
        }
        Ok(())
    }
}

/// Where `x` falls against the band `[lo, hi]`.
fn against(x: f64, [lo, hi]: [f64; 2]) -> &'static str {
    if x < lo {
        "below"
    } else if x > hi {
        "above"
    } else {
        "inside"
    }
}

impl Day {
    fn prices(&self) -> Prices {
        Prices {
            hit_usd_per_mtok: self.hit_price,
            miss_usd_per_mtok: self.miss_price,
            output_usd_per_mtok: self.output_price,
        }
    }
}

/// One sample's run and what it says about the whole cluster.
struct Point {
    one_in: u32,
    sample: u32,
    /// The simulated unit's prefill engines and decode GPUs.
    prefill_gpus: u32,
    decode_gpus: u32,
    max_seqs_per_rank: u32,
    rep: ServiceReport,
    wall_s: f64,
    hours: Vec<Hour>,
}

#[derive(Default)]
struct Hour {
    arrivals: f64,
    /// Cluster GPUs kept busy, mean over the hour.
    prefill_busy_gpus: f64,
    decode_held_gpus: f64,
    sampled_prompt: u64,
    sampled_hit: u64,
    series_rows: u32,
}

/// The day's figures of one point, for the whole cluster.
struct Figures {
    arrivals: u64,
    rejected: u64,
    tokens_per_day: f64,
    hit_rate: f64,
    output_share: f64,
    store_pib: f64,
    written_pib_per_day: f64,
    gpus: f64,
    prefill_busy_gpus: f64,
    decode_held_gpus: f64,
    revenue: MeasuredRevenue,
}

impl Point {
    fn scale(&self) -> f64 {
        f64::from(self.one_in)
    }

    fn figures(&self, cfg: &Config) -> Result<Figures> {
        let r = &self.rep;
        let k = self.scale();
        // Per day of arrivals: the drain after the last one serves requests already counted.
        let days = r.measured_span_s / econ::SECONDS_PER_DAY;
        let input = r.input_tokens as f64;
        let out = r.output_tokens as f64;
        let tokens_per_day = (input + out) * k / days.max(1e-9);
        let store = &cfg.service.store;
        let ec = f64::from(store.ec_data_shards + store.ec_parity_shards)
            / f64::from(store.ec_data_shards);
        let miss = (r.input_tokens - r.hit_tokens) as f64;
        let kv = f64::from(cfg.service.constants.kv_bytes_per_token);
        let gpus = f64::from(cfg.day.units) * f64::from(cfg.service.gpus());
        let day = MeasuredDay {
            hit_tokens: r.hit_tokens as f64 * k / days.max(1e-9),
            miss_tokens: miss * k / days.max(1e-9),
            output_tokens: out * k / days.max(1e-9),
            gpus,
        };
        let revenue = econ::measured_day(&day, &cfg.day.prices())
            .map_err(|e| anyhow!("day: the simulated day's revenue: {e}"))?;
        let mean = |f: fn(&Hour) -> f64| {
            let rows: u32 = self.hours.iter().map(|h| h.series_rows).sum();
            let sum: f64 = self
                .hours
                .iter()
                .map(|h| f(h) * f64::from(h.series_rows))
                .sum();
            sum / f64::from(rows.max(1))
        };
        Ok(Figures {
            arrivals: r.arrivals,
            rejected: r.rejected_total(),
            tokens_per_day,
            hit_rate: r.hit_tokens as f64 / input.max(1.0),
            output_share: out / (input + out).max(1.0),
            store_pib: r.store_used_bytes as f64 * ec * k / econ::BYTES_PER_PIB,
            written_pib_per_day: (miss + out) * kv * ec * k / days.max(1e-9) / econ::BYTES_PER_PIB,
            gpus,
            prefill_busy_gpus: mean(|h| h.prefill_busy_gpus),
            decode_held_gpus: mean(|h| h.decode_held_gpus),
            revenue,
        })
    }
}

/// The cluster's service: `units` copies of `unit`, sharing one store of `units` times the
/// unit's nodes and capacity.
fn cluster_service(unit: &ServiceConfig, units: u32) -> Result<ServiceConfig> {
    if units == 0 {
        bail!("day.units: at least 1");
    }
    let mut c = unit.clone();
    let times = |n: u32, field: &str| {
        n.checked_mul(units)
            .ok_or_else(|| anyhow!("day.units: {units} × service.{field} ({n}) overflows"))
    };
    c.prefill.gpus = times(unit.prefill.gpus, "prefill.gpus")?;
    c.decode.groups = times(unit.decode.groups, "decode.groups")?;
    c.swa.machines = times(unit.swa.machines, "swa.machines")?;
    c.store.storage_nodes = times(unit.store.storage_nodes, "store.storage_nodes")?;
    c.store.capacity_bytes = unit.store.capacity_bytes.map(|b| b * u64::from(units));
    c.prefill.max_queued_requests = times(unit.prefill.max_queued_requests, "max_queued")?;
    Ok(c)
}

fn run_point(cfg: &Config, cluster: &ServiceConfig, seed: u64, sample: u32) -> Result<Point> {
    let started = Instant::now();
    let one_in = cfg.day.one_in;
    let s = scaled(cluster, one_in)?;
    let keep = SessionSample {
        one_in,
        seed: sub_seed(seed, &format!("cluster-day.sample.{sample}")),
    };
    let bs = s.constants.block_tokens;
    let stream = || Stream::new(&cfg.workload, seed, bs, Some(keep));
    // The steady-state window ends at the last arrival, as for a trace given whole; a first
    // pass over the stream finds it (drawing the sample again costs a fraction of serving it,
    // and holds none of it).
    let last = last_arrival(stream()?)?;
    let mut requests = stream()?;
    let feed: RequestFeed = Box::new(std::iter::from_fn(move || {
        requests.next_request().transpose()
    }));
    let profile = HardwareProfile::resolve(&s.profile)?;
    let rep = run_streamed(&s, profile, feed, last, seed, &mut NoObserver)?;
    let mut p = Point {
        one_in,
        sample,
        prefill_gpus: s.prefill.gpus,
        decode_gpus: s.decode.groups * s.decode.ranks,
        max_seqs_per_rank: s.decode.max_seqs_per_rank,
        rep,
        wall_s: started.elapsed().as_secs_f64(),
        hours: Vec::new(),
    };
    p.hours = hours(&p);
    Ok(p)
}

/// The time of the stream's last request.
fn last_arrival(mut stream: Stream) -> Result<Nanos> {
    let mut last = Nanos::ZERO;
    while let Some(r) = stream.next_request()? {
        last = last.max(r.arrival);
    }
    Ok(last)
}

/// Per whole hour of arrivals, for the whole cluster (the last part-hour of arrivals and the
/// drain after it are left out: a part-hour's mean reads as a change of load).
fn hours(p: &Point) -> Vec<Hour> {
    let r = &p.rep;
    let n = (r.measured_span_s / 3600.0).floor().max(1.0) as usize;
    let mut h: Vec<Hour> = (0..n).map(|_| Hour::default()).collect();
    let k = p.scale();
    let hour_of = |t_s: f64| (t_s / 3600.0) as usize;
    for row in &r.series {
        // A row covers the interval that ends at its time.
        let Some(x) = h.get_mut(hour_of((row.t_s - 1e-9).max(0.0))) else {
            continue;
        };
        x.series_rows += 1;
        x.arrivals += row.arrivals as f64 * k;
        x.prefill_busy_gpus += row.prefill_busy * f64::from(p.prefill_gpus) * k;
        x.decode_held_gpus += row.decode_seqs_per_rank / f64::from(p.max_seqs_per_rank)
            * f64::from(p.decode_gpus)
            * k;
    }
    for x in &mut h {
        let rows = f64::from(x.series_rows.max(1));
        x.prefill_busy_gpus /= rows;
        x.decode_held_gpus /= rows;
    }
    for row in &r.requests {
        let Some(x) = h.get_mut(hour_of(row.arrival_s)) else {
            continue;
        };
        x.sampled_prompt += u64::from(row.prompt_tokens);
        x.sampled_hit += u64::from(row.hit_tokens);
    }
    h
}

pub fn run(ctx: &RunContext) -> Result<()> {
    let cfg: Config = ctx.config.parse()?;
    let path = ctx.config.path.display().to_string();
    let d = &cfg.day;
    if d.one_in == 0 || d.samples == 0 {
        bail!("{path}: day.one_in and day.samples: at least 1");
    }
    if !(d.ttl_days.is_finite() && d.ttl_days > 0.0) {
        bail!("{path}: day.ttl_days must be positive");
    }
    d.published.validate().map_err(|e| anyhow!("{path}: {e}"))?;
    cfg.day
        .prices()
        .validate()
        .map_err(|e| anyhow!("{path}: day: {e}"))?;
    let seed = ctx.seed();
    let cluster = cluster_service(&cfg.service, d.units).map_err(|e| anyhow!("{path}: {e}"))?;
    let points: Vec<Point> = (0..d.samples)
        .map(|k| run_point(&cfg, &cluster, seed, k))
        .collect::<Result<_>>()
        .map_err(|e| anyhow!("{path}: {e}"))?;
    let figures: Vec<Figures> = points
        .iter()
        .map(|p| p.figures(&cfg))
        .collect::<Result<_>>()
        .map_err(|e| anyhow!("{path}: {e}"))?;
    let reading = econ_reading(&figures[0], d).map_err(|e| anyhow!("{path}: {e}"))?;
    let mut out = RunOutput::create(&ctx.out)?;
    out.write_table("hours", &mut hours_table(&points)?)?;
    out.write_table("day", &mut day_table(&points, &figures)?)?;
    plots(&mut out, &points[0])?;
    let text = summary(&cfg, &points, &figures, &reading);
    out.write_text("summary.md", &text)?;
    out.write_summary_json(&headline(&figures[0], &reading))?;
    let speeds: Vec<Speed> = points
        .iter()
        .map(|p| {
            let label = format!("1 in {}, sample {}", p.one_in, p.sample);
            Speed::new(label, p.wall_s, p.rep.simulated_s, p.rep.arrivals)
        })
        .collect();
    let m = Manifest::new("cluster-day", &ctx.config.path, &ctx.config.text, seed);
    out.write_manifest(&m, &speeds)?;
    println!("{text}");
    crate::speed::print(&speeds);
    Ok(())
}

/// The economics instrument (SPEC §12) on the simulated day's traffic: its tokens per day and
/// output share, the published benchmark rates, prices and retention.
fn econ_reading(f: &Figures, d: &Day) -> Result<EconEstimate> {
    let mut p = EconParams::published(f.output_share);
    p.tokens_per_day = f.tokens_per_day;
    p.prices = d.prices();
    p.ttl_days = d.ttl_days;
    Ok(econ::evaluate(&p)?)
}

fn hours_table(points: &[Point]) -> Result<DataFrame> {
    let rows: Vec<(u32, usize, &Hour)> = points
        .iter()
        .flat_map(|p| {
            p.hours
                .iter()
                .enumerate()
                .map(move |(i, h)| (p.sample, i, h))
        })
        .collect();
    let hit = |h: &Hour| h.sampled_hit as f64 / h.sampled_prompt.max(1) as f64;
    Ok(df!(
        "sample" => rows.iter().map(|r| r.0).collect::<Vec<_>>(),
        "hour" => rows.iter().map(|r| r.1 as u32).collect::<Vec<_>>(),
        "arrivals_per_s" => rows.iter().map(|r| r.2.arrivals / 3600.0).collect::<Vec<_>>(),
        "hit_rate_sampled" => rows.iter().map(|r| hit(r.2)).collect::<Vec<_>>(),
        "prefill_busy_gpus" => rows.iter().map(|r| r.2.prefill_busy_gpus).collect::<Vec<_>>(),
        "decode_held_gpus" => rows.iter().map(|r| r.2.decode_held_gpus).collect::<Vec<_>>(),
    )?)
}

fn day_table(points: &[Point], figures: &[Figures]) -> Result<DataFrame> {
    let col = |g: fn(&Figures) -> f64| figures.iter().map(g).collect::<Vec<_>>();
    Ok(df!(
        "sample" => points.iter().map(|p| p.sample).collect::<Vec<_>>(),
        "one_in" => points.iter().map(|p| p.one_in).collect::<Vec<_>>(),
        "simulated_gpus" => points.iter().map(|p| p.prefill_gpus + p.decode_gpus).collect::<Vec<_>>(),
        "sampled_requests" => points.iter().map(|p| p.rep.arrivals).collect::<Vec<_>>(),
        "rejected" => points.iter().map(|p| p.rep.rejected_total()).collect::<Vec<_>>(),
        "tokens_per_day" => col(|f| f.tokens_per_day),
        "hit_rate" => col(|f| f.hit_rate),
        "output_share" => col(|f| f.output_share),
        "store_pib" => col(|f| f.store_pib),
        "written_pib_per_day" => col(|f| f.written_pib_per_day),
        "gpus" => col(|f| f.gpus),
        "prefill_busy_gpus" => col(|f| f.prefill_busy_gpus),
        "decode_held_gpus" => col(|f| f.decode_held_gpus),
        "revenue_per_day" => col(|f| f.revenue.revenue_per_day),
        "revenue_per_gpu_hour" => col(|f| f.revenue.revenue_per_gpu_hour),
    )?)
}

fn plots(out: &mut RunOutput, p: &Point) -> Result<()> {
    let series = |name: &str, f: fn(&Hour) -> f64| {
        let pts = p
            .hours
            .iter()
            .enumerate()
            .filter(|(_, h)| h.series_rows > 0)
            .map(|(i, h)| (i as f64 + 0.5, f(h)))
            .collect();
        (name.to_string(), pts)
    };
    let path = out.path("gpus.svg");
    let k = p.scale();
    let provisioned = |label: &str, series: usize, gpus: u32| crate::plot::Reference {
        label: format!("{label} provisioned"),
        series,
        low: f64::from(gpus) * k,
        high: f64::from(gpus) * k,
    };
    crate::plot::lines_marked(
        &path,
        &format!(
            "GPUs kept busy per pool, whole cluster (1 in {} sessions)",
            p.one_in
        ),
        "hour of the day",
        "GPUs",
        &[
            series("prefill (busy)", |h| h.prefill_busy_gpus),
            series("decode (slots held)", |h| h.decode_held_gpus),
        ],
        &crate::plot::Marks {
            window: None,
            references: vec![
                provisioned("prefill", 0, p.prefill_gpus),
                provisioned("decode", 1, p.decode_gpus),
            ],
        },
    )?;
    let path = out.path("hit_rate.svg");
    crate::plot::lines(
        &path,
        "Input hit rate per hour (sampled request rows)",
        "hour of the day",
        "hit rate",
        &[series("hit rate", |h| {
            h.sampled_hit as f64 / h.sampled_prompt.max(1) as f64
        })],
    )
}

fn headline(f: &Figures, e: &EconEstimate) -> BTreeMap<String, f64> {
    BTreeMap::from([
        ("tokens_per_day".into(), f.tokens_per_day),
        ("hit_rate".into(), f.hit_rate),
        ("output_share".into(), f.output_share),
        ("store_pib".into(), f.store_pib),
        ("gpus".into(), f.gpus),
        ("prefill_busy_gpus".into(), f.prefill_busy_gpus),
        ("decode_held_gpus".into(), f.decode_held_gpus),
        (
            "revenue_per_gpu_hour".into(),
            f.revenue.revenue_per_gpu_hour,
        ),
        ("econ.hit_rate_implied".into(), e.hit_rate_implied),
        ("econ.gpus_needed".into(), e.gpus_needed),
        ("econ.gpus_from_revenue".into(), e.gpus_from_revenue),
        ("econ.storage_pib".into(), e.storage_pib),
    ])
}

fn summary(cfg: &Config, points: &[Point], figures: &[Figures], e: &EconEstimate) -> String {
    let (p, f) = (&points[0], &figures[0]);
    let d = &cfg.day;
    let mut s = format!(
        "# A day of the cluster\n\n{} units of {} GPUs ({} GPUs), simulated on 1 in {} sessions \
         by a unit of {} prefill and {} decode GPUs; {:.1} hours of arrivals, {} sampled \
         requests, {} rejected.\n\n",
        d.units,
        cfg.service.gpus(),
        f.gpus,
        p.one_in,
        p.prefill_gpus,
        p.decode_gpus,
        p.rep.measured_span_s / 3600.0,
        p.rep.arrivals,
        p.rep.rejected_total(),
    );
    let header = ["figure", "simulated", "economics instrument", "published"];
    let pb = &d.published;
    let pct = |x: f64| format!("{:.2}%", 100.0 * x);
    let band = |[lo, hi]: [f64; 2], f: &dyn Fn(f64) -> String| format!("{}–{}", f(lo), f(hi));
    let rows = vec![
        vec![
            "tokens per day".into(),
            format!("{:.1}T", f.tokens_per_day / 1e12),
            format!("{:.1}T (the run's)", e.tokens_per_day.total() / 1e12),
            format!("{:.0}T", pb.tokens_per_day / 1e12),
        ],
        vec![
            "input hit rate".into(),
            pct(f.hit_rate),
            format!("{} (from the 1:1 pool ratio)", pct(e.hit_rate_implied)),
            band(pb.hit_rate, &|x| pct(x)),
        ],
        vec![
            "output share".into(),
            pct(f.output_share),
            format!("{} (the run's)", pct(e.output_share)),
            format!("under {}", pct(pb.output_share_below)),
        ],
        vec![
            "GPUs".into(),
            format!(
                "{:.0} provisioned; {:.0} prefill busy + {:.0} decode slots held (day means)",
                f.gpus, f.prefill_busy_gpus, f.decode_held_gpus
            ),
            format!(
                "{:.0} needed ({:.0} prefill + {:.0} decode); {:.0} implied by revenue",
                e.gpus_needed, e.prefill_gpus, e.decode_gpus, e.gpus_from_revenue
            ),
            band(pb.gpus, &|x| format!("{x:.0}")),
        ],
        vec![
            "revenue per GPU-hour (off-peak prices)".into(),
            format!(
                "${:.2} on the provisioned GPUs",
                f.revenue.revenue_per_gpu_hour
            ),
            format!(
                "${:.2} on the GPUs needed",
                e.revenue_per_day / (e.gpus_needed.max(1e-9) * econ::HOURS_PER_DAY)
            ),
            format!("${:.0}", pb.revenue_per_gpu_hour),
        ],
        vec![
            "store".into(),
            format!(
                "{:.2} PiB held after the day; {:.2} PiB written per day",
                f.store_pib, f.written_pib_per_day
            ),
            format!(
                "{:.2} PiB for {} days of retention",
                e.storage_pib, d.ttl_days
            ),
            format!("{:.0} PiB", pb.store_pib),
        ],
    ];
    s += &markdown_table(&header, &rows);
    s += &comparison(f, e, pb);
    s += &format!(
        " Store sizes are physical ({}+{} erasure coding).\n",
        cfg.service.store.ec_data_shards, cfg.service.store.ec_parity_shards
    );
    s += &sampling_error(points, figures);
    s
}

/// The run against the instrument and the published figures, in numbers.
fn comparison(f: &Figures, e: &EconEstimate, pb: &Published) -> String {
    let rejected = if f.rejected == 0 {
        String::new()
    } else {
        format!(
            " {:.1}% of the sampled requests were rejected; their tokens are not counted.",
            100.0 * f.rejected as f64 / f.arrivals.max(1) as f64
        )
    };
    format!(
        "\nThe simulated day serves {:.0}% of the published tokens per day. Its hit rate is \
         {:+.2} points from the rate the instrument needs for 1:1 pools and {} the published \
         band; its {:.0} provisioned GPUs are {} the published band and {:+.0}% against the \
         {:.0} the instrument needs at the published benchmark rates (the instrument is given \
         the run's tokens and output share).{rejected}",
        100.0 * f.tokens_per_day / pb.tokens_per_day,
        100.0 * (f.hit_rate - e.hit_rate_implied),
        against(f.hit_rate, pb.hit_rate),
        f.gpus,
        against(f.gpus, pb.gpus),
        100.0 * (f.gpus / e.gpus_needed.max(1e-9) - 1.0),
        e.gpus_needed,
    )
}

/// The other samples against the first: their spread is the sampling error stated.
fn sampling_error(points: &[Point], figures: &[Figures]) -> String {
    if points.len() < 2 {
        return "\nOnly one sample was run, so no sampling error is stated.\n".into();
    }
    let f0 = &figures[0];
    let mut s = format!(
        "\nSampling error: {} independent samples of 1 in {} sessions (different sessions \
         kept). This is the error of which sessions are kept; what a small pool changes \
         (balancer effects, measured by the `sampling` experiment) is not in it.",
        points.len(),
        points[0].one_in
    );
    for (p, f) in points.iter().zip(figures).skip(1) {
        let rel = |a: f64, b: f64| 100.0 * (a / b.max(1e-12) - 1.0);
        s += &format!(
            " Sample {} against sample 0: hit rate {:+.2} points, tokens per day {:+.1}%, \
             store {:+.1}%, prefill GPUs busy {:+.1}%, decode slots held {:+.1}%, revenue per \
             GPU-hour {:+.1}%.",
            p.sample,
            100.0 * (f.hit_rate - f0.hit_rate),
            rel(f.tokens_per_day, f0.tokens_per_day),
            rel(f.store_pib, f0.store_pib),
            rel(f.prefill_busy_gpus, f0.prefill_busy_gpus),
            rel(f.decode_held_gpus, f0.decode_held_gpus),
            rel(
                f.revenue.revenue_per_gpu_hour,
                f0.revenue.revenue_per_gpu_hour
            ),
        );
    }
    s + "\n"
}
