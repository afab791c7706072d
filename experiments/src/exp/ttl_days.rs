//! The `ttl-days` experiment (SPEC §7): days of sessions that come back after hours or days,
//! streamed through the store and the hit rule under each TTL scenario (the published agent
//! 3 d / chat 7 d against chat 3 d), at each sampling rate. Per scenario: the hit rate over the
//! measured days (after a warm-up that fills the store), per class; the store each needs (its
//! peak logical bytes, scaled back by the sampling rate) and the SSD the shorter TTL saves.
//! Per sampling rate: the error against the unsampled run of the same scenario.
//!
//! The requests are drawn as they are replayed ([`Stream`]), so memory holds the store and
//! what is still to come, not the days of requests. The runs are independent: they run in
//! parallel and the outputs do not depend on how many threads there are.

use super::RunContext;
use crate::config::ExperimentHeader;
use crate::output::{Manifest, RunOutput, markdown_table};
use crate::speed::Speed;
use anyhow::{Result, anyhow, bail};
use polars::prelude::*;
use rayon::prelude::*;
use serde::Deserialize;
use servelab_core::seed::sub_seed;
use servelab_core::{ClassTtl, HitPolicy, Nanos, TrafficClass};
use servelab_sim::replay::{ReplayConfig, ReplayPass};
use servelab_workloads::generate::WorkloadConfig;
use servelab_workloads::stream::{SessionSample, Stream, StreamStats};
use std::collections::BTreeMap;
use std::time::Instant;

const DAY_S: u64 = 86_400;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Config {
    #[allow(dead_code)]
    experiment: ExperimentHeader,
    /// The store (its TTLs are each scenario's), the SWA cache, the constants and the timing.
    #[serde(default)]
    replay: ReplayConfig,
    days: Days,
    workload: WorkloadConfig,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Days {
    /// Simulated days.
    days: u32,
    /// Days the store fills before hit rates and store sizes are measured.
    warmup_days: u32,
    /// Sampling rates: 1 keeps every session (the reference the others are measured against).
    one_in: Vec<u32>,
    /// The hit rule whose hit rate is reported.
    policy: HitPolicy,
    /// SSD bytes per logical byte (10 + 2 erasure coding: 1.2).
    ec_overhead: f64,
    /// The cluster's tokens a day (SPEC §12: 155 trillion) the store sizes are scaled to, in
    /// proportion to the simulated input tokens a day.
    cluster_tokens_per_day: f64,
    /// The published cost of the shorter chat TTL, hit-rate points (SPEC §7: 0.5–1).
    published_cost_pp: [f64; 2],
    /// The published SSD of the cluster's store, PiB (SPEC §7: about 100).
    published_ssd_pib: f64,
    scenario: Vec<Scenario>,
}

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct Scenario {
    name: String,
    ttl: ClassTtl,
}

#[derive(Clone, Copy, Default)]
struct ClassDay {
    requests: u64,
    input_tokens: u64,
    cached_tokens: u64,
    hit_tokens: u64,
}

impl ClassDay {
    fn add(&mut self, o: &ClassDay) {
        self.requests += o.requests;
        self.input_tokens += o.input_tokens;
        self.cached_tokens += o.cached_tokens;
        self.hit_tokens += o.hit_tokens;
    }
    fn hit_rate(&self) -> f64 {
        self.hit_tokens as f64 / self.input_tokens.max(1) as f64
    }
}

#[derive(Clone, Copy, Default)]
struct DayRow {
    class: [ClassDay; 3],
    /// Logical bytes in the store at the day's end, and at most during the day.
    store_bytes_end: u64,
    store_bytes_peak: u64,
}

struct Run {
    scenario: usize,
    one_in: u32,
    days: Vec<DayRow>,
    stream: StreamStats,
    wall_s: f64,
}

impl Run {
    /// The measured days' totals: all classes (index 3) and per class.
    fn measured(&self, warmup: u32) -> [ClassDay; 4] {
        let mut t = [ClassDay::default(); 4];
        for d in &self.days[warmup as usize..] {
            for (i, c) in d.class.iter().enumerate() {
                t[i].add(c);
                t[3].add(c);
            }
        }
        t
    }
    /// The most logical bytes the store held over the measured days, scaled to the whole
    /// population (× the sampling rate).
    fn store_bytes(&self, warmup: u32) -> f64 {
        let peak = self.days[warmup as usize..]
            .iter()
            .map(|d| d.store_bytes_peak)
            .max()
            .unwrap_or(0);
        peak as f64 * f64::from(self.one_in)
    }
    /// Input tokens a day over the measured days, scaled to the whole population.
    fn tokens_per_day(&self, warmup: u32) -> f64 {
        let n = (self.days.len() - warmup as usize).max(1) as f64;
        self.measured(warmup)[3].input_tokens as f64 * f64::from(self.one_in) / n
    }
}

fn validate(cfg: &Config, path: &str) -> Result<()> {
    let d = &cfg.days;
    if d.days == 0 || d.warmup_days >= d.days {
        bail!(
            "{path}: days.warmup_days ({}) must leave some of days.days ({}) to measure",
            d.warmup_days,
            d.days
        );
    }
    if d.one_in.is_empty() || d.one_in.contains(&0) {
        bail!("{path}: days.one_in: at least one sampling rate, each at least 1");
    }
    if d.scenario.len() < 2 {
        bail!("{path}: days.scenario: a baseline and at least one alternative TTL");
    }
    if !(d.ec_overhead.is_finite() && d.ec_overhead >= 1.0) {
        bail!("{path}: days.ec_overhead: must be at least 1 (SSD bytes per logical byte)");
    }
    if !(d.cluster_tokens_per_day.is_finite() && d.cluster_tokens_per_day > 0.0) {
        bail!("{path}: days.cluster_tokens_per_day: must be positive");
    }
    if !(d.published_ssd_pib.is_finite() && d.published_ssd_pib > 0.0) {
        bail!("{path}: days.published_ssd_pib: must be positive");
    }
    cfg.replay
        .validate()
        .map_err(|e| anyhow!("{path}: replay.{e}"))?;
    Ok(())
}

/// Checks that the sessions configured span the days simulated, so a run does not go quiet
/// after the last session starts (returns still arrive then, new sessions do not).
fn check_span(w: &WorkloadConfig, days: u32, path: &str) -> Result<()> {
    let spans = [
        w.agent
            .as_ref()
            .map(|a| ("agent", a.sessions, a.session_rate_per_s)),
        w.chat
            .as_ref()
            .map(|c| ("chat", c.sessions, c.session_rate_per_s)),
        w.documents
            .as_ref()
            .map(|d| ("documents", d.requests, d.rate_per_s)),
    ];
    let need = f64::from(days) * DAY_S as f64;
    for (name, n, rate) in spans.into_iter().flatten() {
        // A margin of 2%: the last of n Poisson starts comes a few hours early or late.
        if f64::from(n) / rate < 1.02 * need {
            bail!(
                "{path}: workload.{name}: {n} at {rate}/s start over {:.2} days, not all of the \
                 {days} simulated: set it to at least {:.0} (the rate × 105% of the days)",
                f64::from(n) / rate / DAY_S as f64,
                (1.05 * need * rate).ceil()
            );
        }
    }
    Ok(())
}

/// One scenario at one sampling rate, streamed through a replay pass.
fn run_one(cfg: &Config, seed: u64, scenario: usize, one_in: u32) -> Result<Run> {
    let started = Instant::now();
    let mut rc = cfg.replay.clone();
    rc.store.ttl = cfg.days.scenario[scenario].ttl;
    // A sample of 1 in R sessions sees 1/R of the capacity (SHARDS' scaling).
    rc.store.capacity_bytes = rc.store.capacity_bytes.map(|c| c / u64::from(one_in));
    let sample = (one_in > 1).then(|| SessionSample {
        one_in,
        seed: sub_seed(seed, "days.sample"),
    });
    let horizon = Nanos::from_secs(u64::from(cfg.days.days) * DAY_S);
    let bs = rc.constants.block_tokens;
    let mut stream = Stream::new(&cfg.workload, seed, bs, sample)?.until(horizon);
    let mut pass = ReplayPass::new(&rc, &[cfg.days.policy])?;
    let mut days = vec![DayRow::default(); cfg.days.days as usize];
    let mut today = 0;
    while let Some(r) = stream.next_request()? {
        let day = ((r.arrival.0 / 1_000_000_000 / DAY_S) as usize).min(days.len() - 1);
        while today < day {
            today += 1;
            pass.advance(Nanos::from_secs(today as u64 * DAY_S));
            days[today - 1].store_bytes_end = pass.store().used_bytes();
        }
        let found = pass.push(&r);
        let row = &mut days[day];
        let c = &mut row.class[r.class.index()];
        c.requests += 1;
        c.input_tokens += u64::from(r.prompt_tokens);
        c.cached_tokens += u64::from(found.cached_block_tokens);
        c.hit_tokens += u64::from(pass.policy_hits()[0]);
        row.store_bytes_peak = row.store_bytes_peak.max(pass.store().used_bytes());
    }
    // The days after the last request (a quiet end) still expire what they held.
    while today < days.len() {
        today += 1;
        pass.advance(Nanos::from_secs(today as u64 * DAY_S));
        days[today - 1].store_bytes_end = pass.store().used_bytes();
    }
    Ok(Run {
        scenario,
        one_in,
        days,
        stream: stream.stats(),
        wall_s: started.elapsed().as_secs_f64(),
    })
}

pub fn run(ctx: &RunContext) -> Result<()> {
    let cfg: Config = ctx.config.parse()?;
    let path = ctx.config.path.display().to_string();
    validate(&cfg, &path)?;
    check_span(&cfg.workload, cfg.days.days, &path)?;
    let seed = ctx.seed();
    let jobs: Vec<(usize, u32)> = (0..cfg.days.scenario.len())
        .flat_map(|s| cfg.days.one_in.iter().map(move |&r| (s, r)))
        .collect();
    let runs: Vec<Run> = jobs
        .par_iter()
        .map(|&(s, r)| run_one(&cfg, seed, s, r))
        .collect::<Result<_>>()
        .map_err(|e| anyhow!("{path}: {e}"))?;
    let mut out = RunOutput::create(&ctx.out)?;
    out.write_table("days", &mut days_table(&cfg.days, &runs)?)?;
    out.write_table("runs", &mut runs_table(&cfg.days, &runs)?)?;
    plots(&mut out, &cfg.days, &runs)?;
    let text = summary(&cfg.days, &runs);
    out.write_text("summary.md", &text)?;
    out.write_summary_json(&headline(&cfg.days, &runs))?;
    let manifest = Manifest::new("ttl-days", &ctx.config.path, &ctx.config.text, seed);
    let speeds = speeds(&cfg.days, &runs);
    out.write_manifest(&manifest, &speeds)?;
    println!("{text}");
    crate::speed::print(&speeds);
    Ok(())
}

/// The run of `scenario` at the smallest sampling rate configured (the most exact).
fn reference<'a>(d: &Days, runs: &'a [Run], scenario: usize) -> &'a Run {
    let r = *d.one_in.iter().min().expect("validated: one rate at least");
    runs.iter()
        .find(|x| x.scenario == scenario && x.one_in == r)
        .expect("every scenario runs at every rate")
}

fn days_table(d: &Days, runs: &[Run]) -> Result<DataFrame> {
    let mut cols: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    let (mut scenario, mut class) = (Vec::new(), Vec::new());
    let (mut one_in, mut day) = (Vec::new(), Vec::new());
    for r in runs {
        for (i, row) in r.days.iter().enumerate() {
            for (ci, c) in row.class.iter().enumerate() {
                scenario.push(d.scenario[r.scenario].name.clone());
                one_in.push(r.one_in);
                day.push(i as u32);
                class.push(TrafficClass::ALL[ci].name().to_string());
                let scale = f64::from(r.one_in);
                cols.entry("requests")
                    .or_default()
                    .push(c.requests as f64 * scale);
                cols.entry("input_tokens")
                    .or_default()
                    .push(c.input_tokens as f64 * scale);
                cols.entry("hit_rate").or_default().push(c.hit_rate());
                cols.entry("store_block_hit_rate")
                    .or_default()
                    .push(c.cached_tokens as f64 / c.input_tokens.max(1) as f64);
                cols.entry("store_bytes_end")
                    .or_default()
                    .push(row.store_bytes_end as f64 * scale);
                cols.entry("store_bytes_peak")
                    .or_default()
                    .push(row.store_bytes_peak as f64 * scale);
            }
        }
    }
    let height = scenario.len();
    let mut columns = vec![
        Column::new("scenario".into(), scenario),
        Column::new("one_in".into(), one_in),
        Column::new("day".into(), day),
        Column::new("class".into(), class),
    ];
    for (k, v) in cols {
        columns.push(Column::new(k.into(), v));
    }
    Ok(DataFrame::new(height, columns)?)
}

fn runs_table(d: &Days, runs: &[Run]) -> Result<DataFrame> {
    let w = d.warmup_days;
    let hit = |r: &Run, c: usize| r.measured(w)[c].hit_rate();
    let err_pp = |r: &Run| 100.0 * (hit(r, 3) - hit(reference(d, runs, r.scenario), 3));
    let store_err =
        |r: &Run| r.store_bytes(w) / reference(d, runs, r.scenario).store_bytes(w).max(1.0) - 1.0;
    Ok(df!(
        "scenario" => runs.iter().map(|r| d.scenario[r.scenario].name.clone()).collect::<Vec<_>>(),
        "one_in" => runs.iter().map(|r| r.one_in).collect::<Vec<_>>(),
        "hit_rate" => runs.iter().map(|r| hit(r, 3)).collect::<Vec<_>>(),
        "agent_hit_rate" => runs.iter().map(|r| hit(r, 0)).collect::<Vec<_>>(),
        "chat_hit_rate" => runs.iter().map(|r| hit(r, 1)).collect::<Vec<_>>(),
        "other_hit_rate" => runs.iter().map(|r| hit(r, 2)).collect::<Vec<_>>(),
        "store_bytes" => runs.iter().map(|r| r.store_bytes(w)).collect::<Vec<_>>(),
        "ssd_bytes" => runs.iter().map(|r| r.store_bytes(w) * d.ec_overhead).collect::<Vec<_>>(),
        "input_tokens_per_day" => runs.iter().map(|r| r.tokens_per_day(w)).collect::<Vec<_>>(),
        "hit_error_pp" => runs.iter().map(err_pp).collect::<Vec<_>>(),
        "store_error_rel" => runs.iter().map(store_err).collect::<Vec<_>>(),
        "requests_simulated" => runs.iter().map(|r| r.stream.released).collect::<Vec<_>>(),
        "sessions_returning_peak" => runs.iter().map(|r| r.stream.returning_peak).collect::<Vec<_>>(),
    )?)
}

fn plots(out: &mut RunOutput, d: &Days, runs: &[Run]) -> Result<()> {
    let series = |f: &dyn Fn(&DayRow) -> f64| -> Vec<(String, Vec<(f64, f64)>)> {
        (0..d.scenario.len())
            .map(|s| {
                let r = reference(d, runs, s);
                let pts = r
                    .days
                    .iter()
                    .enumerate()
                    .map(|(i, row)| (i as f64 + 0.5, f(row)));
                (d.scenario[s].name.clone(), pts.collect())
            })
            .collect()
    };
    let one_in = reference(d, runs, 0).one_in;
    let who = if one_in == 1 {
        "every session".to_string()
    } else {
        format!("1 in {one_in} sessions, scaled back")
    };
    let hit = |row: &DayRow| {
        let mut t = ClassDay::default();
        row.class.iter().for_each(|c| t.add(c));
        100.0 * t.hit_rate()
    };
    let p = out.path("hit_rate.svg");
    crate::plot::lines(
        &p,
        &format!("Hit rate by day ({who})"),
        "day",
        "hit rate (% of input tokens)",
        &series(&hit),
    )?;
    let tib = |row: &DayRow| row.store_bytes_peak as f64 * f64::from(one_in) / 2f64.powi(40);
    let p = out.path("store.svg");
    crate::plot::lines(
        &p,
        &format!("Store size, peak of each day ({who})"),
        "day",
        "logical TiB",
        &series(&tib),
    )
}

/// The cost of each alternative against the first scenario, at the reference rate: hit-rate
/// points overall and for chat, and the store it saves.
struct Cost {
    name: String,
    cost_pp: f64,
    chat_cost_pp: f64,
    store_saved: f64,
}

fn costs(d: &Days, runs: &[Run]) -> Vec<Cost> {
    let w = d.warmup_days;
    let base = reference(d, runs, 0);
    let b = base.measured(w);
    (1..d.scenario.len())
        .map(|s| {
            let r = reference(d, runs, s);
            let m = r.measured(w);
            Cost {
                name: d.scenario[s].name.clone(),
                cost_pp: 100.0 * (b[3].hit_rate() - m[3].hit_rate()),
                chat_cost_pp: 100.0 * (b[1].hit_rate() - m[1].hit_rate()),
                store_saved: 1.0 - r.store_bytes(w) / base.store_bytes(w).max(1.0),
            }
        })
        .collect()
}

fn pib(bytes: f64) -> f64 {
    bytes / 2f64.powi(50)
}

fn summary(d: &Days, runs: &[Run]) -> String {
    let w = d.warmup_days;
    let fill = if w == 1 {
        "day 0 fills".to_string()
    } else {
        format!("days 0–{} fill", w - 1)
    };
    let mut s = format!(
        "# TTLs over {} days\n\nHit rates of rule `{}` over days {}–{} ({fill} the store); store \
         sizes are the most the store held over those days, scaled back by the sampling rate.\n\n",
        d.days,
        d.policy.name(),
        w,
        d.days - 1,
    );
    s += &scenario_table(d, runs);
    let base = reference(d, runs, 0);
    let scale = d.cluster_tokens_per_day / base.tokens_per_day(w).max(1.0);
    let inside = |x: f64| {
        if (d.published_cost_pp[0]..=d.published_cost_pp[1]).contains(&x) {
            "inside"
        } else {
            "outside"
        }
    };
    let ssd = pib(base.store_bytes(w) * scale * d.ec_overhead);
    s += &format!(
        "\nAt the cluster's {:.0}T tokens a day ({:.0}× the simulated input, the same mix), {} \
         needs {:.1} PiB of SSD, {:.2}× the published {:.0} PiB.\n",
        d.cluster_tokens_per_day / 1e12,
        scale,
        d.scenario[0].name,
        ssd,
        ssd / d.published_ssd_pib,
        d.published_ssd_pib
    );
    for c in costs(d, runs) {
        s += &format!(
            "\n- **{}** costs {:.2} points of hit rate against {} ({} the published {}–{} \
             points) and {:.2} points on chat traffic alone ({}). It needs {:.1}% less store: \
             {:.1} PiB of SSD at the cluster's volume.\n",
            c.name,
            c.cost_pp,
            d.scenario[0].name,
            inside(c.cost_pp),
            d.published_cost_pp[0],
            d.published_cost_pp[1],
            c.chat_cost_pp,
            inside(c.chat_cost_pp),
            100.0 * c.store_saved,
            ssd * c.store_saved
        );
    }
    s += &sampling_text(d, runs);
    s
}

fn scenario_table(d: &Days, runs: &[Run]) -> String {
    let w = d.warmup_days;
    let header = [
        "scenario",
        "1 in",
        "hit rate",
        "agent",
        "chat",
        "other",
        "store (TiB, logical)",
        "requests",
    ];
    let pct = |x: f64| format!("{:.2}%", 100.0 * x);
    let rows: Vec<Vec<String>> = runs
        .iter()
        .map(|r| {
            let m = r.measured(w);
            vec![
                d.scenario[r.scenario].name.clone(),
                r.one_in.to_string(),
                pct(m[3].hit_rate()),
                pct(m[0].hit_rate()),
                pct(m[1].hit_rate()),
                pct(m[2].hit_rate()),
                format!("{:.2}", r.store_bytes(w) / 2f64.powi(40)),
                r.stream.released.to_string(),
            ]
        })
        .collect();
    markdown_table(&header, &rows)
}

/// Each sampled run against the most exact run of its scenario.
fn sampling_text(d: &Days, runs: &[Run]) -> String {
    let w = d.warmup_days;
    let mut s = String::new();
    for r in runs {
        let base = reference(d, runs, r.scenario);
        if r.one_in == base.one_in {
            continue;
        }
        let (m, b) = (r.measured(w), base.measured(w));
        let err = |c: usize| 100.0 * (m[c].hit_rate() - b[c].hit_rate());
        let share = |x: &[ClassDay; 4], c: usize| {
            100.0 * x[c].input_tokens as f64 / x[3].input_tokens.max(1) as f64
        };
        let store = 100.0 * (r.store_bytes(w) / base.store_bytes(w).max(1.0) - 1.0);
        let within = if err(3).abs() <= 1.0 {
            "within"
        } else {
            "outside"
        };
        s += &format!(
            "- Sampling 1 in {} ({}): hit rate {:+.2} points and store {:+.1}% against 1 in {}: \
             {within} the 1-point target. Per class {:+.2} (agent), {:+.2} (chat), {:+.2} \
             (other) points; documents are {:.1}% of the input tokens against {:.1}%.\n",
            r.one_in,
            d.scenario[r.scenario].name,
            err(3),
            store,
            base.one_in,
            err(0),
            err(1),
            err(2),
            share(&m, 2),
            share(&b, 2),
        );
    }
    if s.is_empty() {
        return String::new();
    }
    format!("\n## Sampling error\n\n{s}")
}

fn headline(d: &Days, runs: &[Run]) -> BTreeMap<String, f64> {
    let w = d.warmup_days;
    let mut h = BTreeMap::new();
    for s in 0..d.scenario.len() {
        let r = reference(d, runs, s);
        let name = &d.scenario[s].name;
        h.insert(format!("{name}.hit_rate"), r.measured(w)[3].hit_rate());
        h.insert(format!("{name}.store_bytes"), r.store_bytes(w));
    }
    for c in costs(d, runs) {
        h.insert(format!("{}.cost_pp", c.name), c.cost_pp);
        h.insert(format!("{}.store_saved", c.name), c.store_saved);
    }
    h
}

/// Simulated time ÷ wall time and requests per wall-second, per run.
fn speeds(d: &Days, runs: &[Run]) -> Vec<Speed> {
    runs.iter()
        .map(|r| {
            let label = format!("{} at 1 in {}", d.scenario[r.scenario].name, r.one_in);
            let simulated = f64::from(d.days) * DAY_S as f64;
            Speed::new(label, r.wall_s, simulated, r.stream.released)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One chat session of two turns that comes back once, exactly five days later, for one
    /// turn. Fixed lengths: system prompt 1,280, messages 100, replies 100 tokens.
    const ONE_RETURN: &str = r#"
[experiment]
kind = "ttl-days"
seed = 1

[replay.swa]
machines = 1

[days]
days = 7
warmup_days = 0
one_in = [1]
policy = "deepinfer"
ec_overhead = 1.2
cluster_tokens_per_day = 1e12
published_cost_pp = [0.5, 1.0]
published_ssd_pib = 100.0

[[days.scenario]]
name = "chat-7d"
ttl = { chat = "7d" }

[[days.scenario]]
name = "chat-3d"
ttl = { chat = "3d" }

[workload.chat]
sessions = 1
session_rate_per_s = 1.0
turns = { kind = "fixed", value = 2 }
system_prompts = 1
system_prompt_tokens = { kind = "fixed", value = 1280 }
user_tokens = { kind = "fixed", value = 100 }
reply_tokens = { kind = "fixed", value = 100 }
think_time_s = { kind = "fixed", value = 10.0 }
revisits = { probability = 1.0, gap_s = { kind = "fixed", value = 432000 }, turns = { kind = "fixed", value = 1 }, max_visits = 2 }
"#;

    fn cached(r: &Run) -> u64 {
        r.days.iter().map(|d| d.class[1].cached_tokens).sum()
    }

    #[test]
    fn a_return_after_five_days_hits_under_seven_days_and_misses_under_three() {
        let cfg: Config = toml::from_str(ONE_RETURN).unwrap();
        let long = run_one(&cfg, 1, 0, 1).unwrap();
        let short = run_one(&cfg, 1, 1, 1).unwrap();
        // Turn 2 (1,580 tokens) finds turn 1's prompt and reply, 1,480 tokens: 11 full blocks.
        // The return (1,780 tokens) finds the 13 full blocks of the 1,680 tokens of visit one,
        // but only while their 7-day TTL holds; at 3 days they expired two days before.
        assert_eq!(cached(&short), 11 * 128);
        assert_eq!(cached(&long), (11 + 13) * 128);
        assert_eq!(long.days[5].class[1].requests, 1);
        assert_eq!(long.stream.released, 3);
        // The 3-day store is empty from day 3 on; the 7-day one still holds visit one then.
        assert_eq!(short.days[4].store_bytes_end, 0);
        assert!(long.days[4].store_bytes_end > 0);
    }

    #[test]
    fn sessions_that_stop_before_the_last_day_are_refused() {
        let mut cfg: Config = toml::from_str(ONE_RETURN).unwrap();
        cfg.workload.chat.as_mut().unwrap().sessions = 1;
        let e = check_span(&cfg.workload, 7, "f.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("workload.chat") && e.contains("635040"), "{e}");
        cfg.days.warmup_days = 7;
        let e = validate(&cfg, "f.toml").unwrap_err().to_string();
        assert!(e.contains("days.warmup_days"), "{e}");
    }
}
