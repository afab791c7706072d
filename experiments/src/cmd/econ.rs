//! `servelab econ`: the economics model of SPEC §12 (formulas in `servelab_core::econ`).
//!
//! Three modes:
//! - one output share (`--output-share O`): the fleet the model implies at that mix;
//! - a sweep (`--sweep-output-share START:STOP:STEP`): one row per output share;
//! - a measured day (`--hit-tokens --miss-tokens --output-tokens --gpus`): revenue per day and
//!   per GPU-hour of a day that was actually served.
//!
//! Every number is a flag defaulting to the published figure; `--json` prints one JSON object.

use anyhow::{Result, anyhow, bail};
use serde::Serialize;
use servelab_core::ConfigError;
use servelab_core::econ::{
    self, Crossings, EconConfig, EconEstimate, EconParams, MeasuredDay, MeasuredRevenue, Prices,
    Split,
};

/// Flags of the fleet model, which a measured day does not take.
const FLEET_FLAGS: [&str; 12] = [
    "tokens_per_day",
    "output_share",
    "sweep_output_share",
    "prefill_tps",
    "decode_tps",
    "efficiency",
    "bytes_per_token",
    "ttl_days",
    "ec_overhead",
    "cache_per_gpu_tb",
    "store_pib",
    "revenue_per_gpu_hour",
];

/// `servelab econ`'s flags, boxed so that the subcommand enum stays small.
#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    pub flags: Box<Flags>,
}

#[derive(clap::Args, Debug)]
pub struct Flags {
    /// Tokens served per day, input and output together [default: 155e12, SPEC §12].
    #[arg(long, value_name = "TOKENS", value_parser = number, allow_negative_numbers = true)]
    pub tokens_per_day: Option<f64>,
    /// Output tokens / all tokens, in [0, 1). The 1:1 pool ratio then fixes the hit rate.
    #[arg(long, value_name = "O", value_parser = number, allow_negative_numbers = true,
          conflicts_with = "sweep_output_share")]
    pub output_share: Option<f64>,
    /// Sweep the output share from START to STOP (inclusive) in steps of STEP.
    #[arg(long, value_name = "START:STOP:STEP", allow_hyphen_values = true)]
    pub sweep_output_share: Option<String>,
    /// Non-cached input tokens/s per prefill GPU, offline benchmark [default: 89500, the top of
    /// SPEC §11's 60,000–89,500: production prompts average 77K tokens, so steps are large].
    #[arg(long, value_name = "TOK_PER_S", value_parser = number, allow_negative_numbers = true)]
    pub prefill_tps: Option<f64>,
    /// Output tokens/s per decode GPU, offline benchmark [default: 14500, SPEC §11 at 60
    /// sequences per rank].
    #[arg(long, value_name = "TOK_PER_S", value_parser = number, allow_negative_numbers = true)]
    pub decode_tps: Option<f64>,
    /// Fraction of the offline benchmark reached live, in (0, 1] [default: 0.8, SPEC §8].
    #[arg(long, value_name = "FRACTION", value_parser = number, allow_negative_numbers = true)]
    pub efficiency: Option<f64>,
    /// Peak prices: double the default prices and the default revenue per GPU-hour (explicit
    /// --price-* and --revenue-per-gpu-hour are taken as given).
    #[arg(long)]
    pub peak: bool,
    /// Cache-hit input price, USD per million tokens [default: 0.003 off-peak].
    #[arg(long, value_name = "USD", value_parser = number, allow_negative_numbers = true)]
    pub price_hit: Option<f64>,
    /// Cache-miss input price, USD per million tokens [default: 0.15 off-peak].
    #[arg(long, value_name = "USD", value_parser = number, allow_negative_numbers = true)]
    pub price_miss: Option<f64>,
    /// Output price, USD per million tokens [default: 0.60 off-peak].
    #[arg(long, value_name = "USD", value_parser = number, allow_negative_numbers = true)]
    pub price_output: Option<f64>,
    /// KV bytes per token as persisted, before erasure coding [default: 890, SPEC §1].
    #[arg(long, value_name = "BYTES", value_parser = number, allow_negative_numbers = true)]
    pub bytes_per_token: Option<f64>,
    /// Days written KV is held [default: 3, the agent TTL of SPEC §7; chat is 7].
    #[arg(long, value_name = "DAYS", value_parser = number, allow_negative_numbers = true)]
    pub ttl_days: Option<f64>,
    /// Physical bytes per logical byte [default: 1.2 for 10+2 erasure coding].
    #[arg(long, value_name = "FACTOR", value_parser = number, allow_negative_numbers = true)]
    pub ec_overhead: Option<f64>,
    /// Logical cache per online GPU, TB = 10^12 bytes [default: 14.4, SPEC §7].
    #[arg(long, value_name = "TB", value_parser = number, allow_negative_numbers = true)]
    pub cache_per_gpu_tb: Option<f64>,
    /// Physical store size, PiB = 2^50 bytes [default: 100, SPEC §7].
    #[arg(long, value_name = "PIB", value_parser = number, allow_negative_numbers = true)]
    pub store_pib: Option<f64>,
    /// Revenue per GPU-hour that converts revenue into a GPU count [default: 38, SPEC §12;
    /// 76 with --peak].
    #[arg(long, value_name = "USD", value_parser = number, allow_negative_numbers = true)]
    pub revenue_per_gpu_hour: Option<f64>,
    /// Measured day: cache-hit input tokens.
    #[arg(long, value_name = "TOKENS", value_parser = number, allow_negative_numbers = true,
          requires_all = ["miss_tokens", "output_tokens", "gpus"],
          conflicts_with_all = FLEET_FLAGS)]
    pub hit_tokens: Option<f64>,
    /// Measured day: cache-miss input tokens.
    #[arg(long, value_name = "TOKENS", value_parser = number, allow_negative_numbers = true,
          requires_all = ["hit_tokens", "output_tokens", "gpus"],
          conflicts_with_all = FLEET_FLAGS)]
    pub miss_tokens: Option<f64>,
    /// Measured day: output tokens.
    #[arg(long, value_name = "TOKENS", value_parser = number, allow_negative_numbers = true,
          requires_all = ["hit_tokens", "miss_tokens", "gpus"],
          conflicts_with_all = FLEET_FLAGS)]
    pub output_tokens: Option<f64>,
    /// Measured day: average GPUs online (may be fractional).
    #[arg(long, value_name = "GPUS", value_parser = number, allow_negative_numbers = true,
          requires_all = ["hit_tokens", "miss_tokens", "output_tokens"],
          conflicts_with_all = FLEET_FLAGS)]
    pub gpus: Option<f64>,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
}

/// A number with optional `_` or `,` digit separators (`89_500`, `155e12`).
fn number(s: &str) -> Result<f64, String> {
    let cleaned: String = s.chars().filter(|c| *c != '_' && *c != ',').collect();
    cleaned
        .parse::<f64>()
        .map_err(|_| format!("`{s}` is not a number"))
}

/// Core errors name config keys (`output_share`); on the command line the flag is `--output-share`.
fn flag_error(e: ConfigError) -> anyhow::Error {
    let ConfigError::Invalid { field, reason } = e;
    if field == econ::INPUTS_FIELD {
        return anyhow!("invalid inputs: {reason}");
    }
    anyhow!("invalid `--{}`: {reason}", field.replace('_', "-"))
}

impl Flags {
    fn econ_config(&self) -> EconConfig {
        EconConfig {
            tokens_per_day: self.tokens_per_day,
            prefill_tps: self.prefill_tps,
            decode_tps: self.decode_tps,
            efficiency: self.efficiency,
            peak: self.peak,
            price_hit: self.price_hit,
            price_miss: self.price_miss,
            price_output: self.price_output,
            bytes_per_token: self.bytes_per_token,
            ttl_days: self.ttl_days,
            ec_overhead: self.ec_overhead,
            cache_per_gpu_tb: self.cache_per_gpu_tb,
            store_pib: self.store_pib,
            revenue_per_gpu_hour: self.revenue_per_gpu_hour,
        }
    }

    fn measured(&self) -> Option<MeasuredDay> {
        Some(MeasuredDay {
            hit_tokens: self.hit_tokens?,
            miss_tokens: self.miss_tokens?,
            output_tokens: self.output_tokens?,
            gpus: self.gpus?,
        })
    }
}

/// What one invocation computed.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum Report {
    Single(Box<SingleReport>),
    Sweep(SweepReport),
    Measured(MeasuredReport),
}

#[derive(Debug, Serialize)]
pub struct SingleReport {
    pub inputs: EconParams,
    #[serde(flatten)]
    pub estimate: EconEstimate,
    pub crossings: Crossings,
}

#[derive(Debug, Serialize)]
pub struct SweepReport {
    /// Inputs at output share 0; each row carries its own output share.
    pub inputs: EconParams,
    pub crossings: Crossings,
    pub rows: Vec<EconEstimate>,
}

#[derive(Debug, Serialize)]
pub struct MeasuredReport {
    pub inputs: MeasuredInputs,
    #[serde(flatten)]
    pub revenue: MeasuredRevenue,
}

#[derive(Debug, Serialize)]
pub struct MeasuredInputs {
    #[serde(flatten)]
    pub day: MeasuredDay,
    pub prices: Prices,
}

/// Parses `START:STOP:STEP`.
fn parse_sweep(spec: &str) -> Result<(f64, f64, f64)> {
    let parts: Vec<&str> = spec.split(':').collect();
    let [a, b, s] = parts.as_slice() else {
        bail!("invalid `--sweep-output-share`: expected START:STOP:STEP, got `{spec}`");
    };
    let num = |x: &str| {
        number(x).map_err(|e| anyhow!("invalid `--sweep-output-share`: {e} (in `{spec}`)"))
    };
    Ok((num(a)?, num(b)?, num(s)?))
}

/// Computes the report; errors name the flag that was wrong.
pub fn compute(args: &Args) -> Result<Report> {
    let args = &*args.flags;
    let cfg = args.econ_config();
    if let Some(day) = args.measured() {
        let prices = cfg.prices();
        let revenue = econ::measured_day(&day, &prices).map_err(flag_error)?;
        return Ok(Report::Measured(MeasuredReport {
            inputs: MeasuredInputs { day, prices },
            revenue,
        }));
    }
    if let Some(o) = args.output_share {
        let params = cfg.params(o);
        let estimate = econ::evaluate(&params).map_err(flag_error)?;
        let crossings = econ::crossings(&params).map_err(flag_error)?;
        return Ok(Report::Single(Box::new(SingleReport {
            inputs: params,
            estimate,
            crossings,
        })));
    }
    if let Some(spec) = &args.sweep_output_share {
        let (start, stop, step) = parse_sweep(spec)?;
        let grid = econ::share_grid("sweep_output_share", start, stop, step).map_err(flag_error)?;
        let params = cfg.params(0.0);
        let crossings = econ::crossings(&params).map_err(flag_error)?;
        let rows = grid
            .iter()
            .map(|&o| {
                econ::evaluate(&EconParams {
                    output_share: o,
                    ..params
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(flag_error)?;
        return Ok(Report::Sweep(SweepReport {
            inputs: params,
            crossings,
            rows,
        }));
    }
    bail!(
        "nothing to compute: give `--output-share O`, `--sweep-output-share START:STOP:STEP`, or a \
         measured day (`--hit-tokens`, `--miss-tokens`, `--output-tokens`, `--gpus`)"
    )
}

pub fn run(args: Args) -> Result<()> {
    let report = compute(&args)?;
    if args.flags.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", render(&report));
    }
    Ok(())
}

/// The human-readable tables.
pub fn render(report: &Report) -> String {
    match report {
        Report::Single(r) => render_single(r),
        Report::Sweep(r) => render_sweep(r),
        Report::Measured(r) => render_measured(r),
    }
}

fn render_inputs(p: &EconParams) -> String {
    let pr = &p.prices;
    format!(
        "  {} tokens/day · prefill {} tok/s/GPU · decode {} tok/s/GPU · efficiency {}\n  \
         prices per M tokens: hit ${} · miss ${} · output ${} · revenue ${} per GPU-hour\n  \
         KV {} B/token · TTL {} d · EC ×{} · cache {} TB/GPU · store {} PiB\n",
        tokens(p.tokens_per_day),
        int(p.prefill_tps),
        int(p.decode_tps),
        pct(p.efficiency),
        pr.hit_usd_per_mtok,
        pr.miss_usd_per_mtok,
        pr.output_usd_per_mtok,
        p.revenue_per_gpu_hour,
        p.bytes_per_token,
        p.ttl_days,
        p.ec_overhead,
        p.cache_per_gpu_tb,
        p.store_pib,
    )
}

fn render_crossings(c: &Crossings) -> String {
    let rows = vec![
        vec![
            "1:1 pools possible up to".to_string(),
            pct(c.max_output_share),
        ],
        vec![
            "GPUs needed = GPUs from revenue at".to_string(),
            c.break_even_output_share.map_or(
                "never (revenue grows faster than capacity)".to_string(),
                pct,
            ),
        ],
        vec![
            "feasible up to".to_string(),
            pct(c.feasible_up_to_output_share),
        ],
        vec![
            "storage needed = store at".to_string(),
            pct(c.storage_limit_output_share),
        ],
    ];
    text_table(&["crossing", "output share"], &rows, false)
}

fn split_row(name: &str, s: &Split, f: impl Fn(f64) -> String) -> Vec<String> {
    vec![
        name.to_string(),
        f(s.hit),
        f(s.miss),
        f(s.output),
        f(s.total()),
    ]
}

fn render_single(r: &SingleReport) -> String {
    let e = &r.estimate;
    let mut s = format!(
        "SPEC §12 economics at output share {}\n",
        pct(e.output_share)
    );
    s += &render_inputs(&r.inputs);
    s += "\n";
    let mut rows = vec![
        split_row("tokens/day", &e.tokens_per_day, tokens),
        split_row("token share", &e.token_share, pct),
        split_row("revenue/day", &e.revenue_usd_per_day, usd),
    ];
    if let Some(rs) = &e.revenue_share {
        rows.push(split_row("revenue share", rs, pct));
    }
    s += &text_table(&["", "hit", "miss", "output", "total"], &rows, true);
    s += "\n";
    s += &text_table(&["quantity", "value"], &quantities(e), false);
    s += "\ncrossings along the 1:1 pool line\n\n";
    s += &render_crossings(&r.crossings);
    s
}

/// The hit rate the 1:1 pools give, saying why when they cannot hold.
fn hit_rate_text(e: &EconEstimate) -> String {
    if e.pool_ratio_holds {
        pct(e.hit_rate)
    } else if (0.0..=1.0).contains(&e.hit_rate_implied) {
        format!(
            "{} (but no 1:1 pools: fewer than one GPU in a pool)",
            pct(e.hit_rate)
        )
    } else {
        format!(
            "{} (implied {}, clamped)",
            pct(e.hit_rate),
            pct(e.hit_rate_implied)
        )
    }
}

/// The single estimate's quantities, one (name, value) row each.
fn quantities(e: &EconEstimate) -> Vec<Vec<String>> {
    let opt = |v: Option<f64>, f: fn(f64) -> String| v.map_or("n/a".to_string(), f);
    [
        ("hit rate from 1:1 pools", hit_rate_text(e)),
        ("revenue/day", usd(e.revenue_per_day)),
        ("GPUs implied by revenue", int(e.gpus_from_revenue)),
        ("prefill GPUs", int(e.prefill_gpus)),
        ("decode GPUs", int(e.decode_gpus)),
        ("GPUs needed", int(e.gpus_needed)),
        ("utilisation needed", opt(e.utilisation_needed, pct)),
        (
            "KV written/day",
            format!("{} tokens", tokens(e.written_tokens_per_day)),
        ),
        (
            "storage needed",
            format!(
                "{:.1} PiB ({})",
                e.storage_pib,
                if e.storage_fits {
                    "fits the store"
                } else {
                    "exceeds the store"
                }
            ),
        ),
        (
            "store band",
            format!(
                "{} GPUs physical .. {} logical",
                int(e.store_band_gpus_physical),
                int(e.store_band_gpus_logical)
            ),
        ),
        ("cache days per GPU", opt(e.cache_days_per_gpu, days)),
        ("  at GPUs needed", opt(e.cache_days_at_gpus_needed, days)),
        (
            "feasible",
            if e.feasible {
                "yes".to_string()
            } else {
                format!(
                    "no: {}",
                    e.infeasible_reasons
                        .iter()
                        .map(|r| r.to_string())
                        .collect::<Vec<_>>()
                        .join("; ")
                )
            },
        ),
    ]
    .into_iter()
    .map(|(k, v)| vec![k.to_string(), v])
    .collect()
}

fn render_sweep(r: &SweepReport) -> String {
    let mut s = "SPEC §12 economics, output share sweep\n".to_string();
    s += &render_inputs(&r.inputs);
    s += "\n";
    let rows: Vec<Vec<String>> = r
        .rows
        .iter()
        .map(|e| {
            vec![
                pct(e.output_share),
                if e.pool_ratio_holds {
                    pct(e.hit_rate)
                } else {
                    format!("{}*", pct(e.hit_rate))
                },
                usd(e.revenue_per_day),
                int(e.gpus_from_revenue),
                int(e.prefill_gpus),
                int(e.decode_gpus),
                int(e.gpus_needed),
                e.utilisation_needed.map_or("n/a".to_string(), pct),
                format!("{:.1}", e.storage_pib),
                e.cache_days_per_gpu.map_or("n/a".to_string(), days),
                if e.feasible { "yes" } else { "no" }.to_string(),
            ]
        })
        .collect();
    s += &text_table(
        &[
            "output",
            "hit",
            "revenue/day",
            "GPUs rev",
            "prefill",
            "decode",
            "GPUs need",
            "util",
            "store PiB",
            "cache days",
            "feasible",
        ],
        &rows,
        true,
    );
    if r.rows
        .iter()
        .any(|e| !e.pool_ratio_holds && e.hit_rate_implied < 0.0)
    {
        s += "  * the 1:1 pool ratio implies a hit rate below 0 here: computed with hit rate 0, \
              pools unequal, infeasible\n";
    }
    if r.rows
        .iter()
        .any(|e| !e.pool_ratio_holds && e.hit_rate_implied >= 0.0)
    {
        s += "  * no 1:1 pools here: a pool would hold less than one GPU (infeasible)\n";
    }
    let first = &r.rows[0];
    s += &format!(
        "  store band: {} GPUs physical .. {} logical\n\ncrossings along the 1:1 pool line\n\n",
        int(first.store_band_gpus_physical),
        int(first.store_band_gpus_logical)
    );
    s += &render_crossings(&r.crossings);
    s
}

fn render_measured(r: &MeasuredReport) -> String {
    let d = &r.inputs.day;
    let p = &r.inputs.prices;
    let m = &r.revenue;
    let mut s = format!(
        "measured day: {} hit + {} miss input, {} output tokens on {} GPUs\n  \
         prices per M tokens: hit ${} · miss ${} · output ${}\n\n",
        tokens(d.hit_tokens),
        tokens(d.miss_tokens),
        tokens(d.output_tokens),
        int(d.gpus),
        p.hit_usd_per_mtok,
        p.miss_usd_per_mtok,
        p.output_usd_per_mtok,
    );
    let mut rows = vec![
        split_row("token share", &m.token_share, pct),
        split_row("revenue/day", &m.revenue_usd_per_day, usd),
    ];
    if let Some(rs) = &m.revenue_share {
        rows.push(split_row("revenue share", rs, pct));
    }
    s += &text_table(&["", "hit", "miss", "output", "total"], &rows, true);
    s += "\n";
    let kv = vec![
        vec!["revenue/day".to_string(), usd(m.revenue_per_day)],
        vec![
            "revenue per GPU-hour".to_string(),
            format!("${:.2}", m.revenue_per_gpu_hour),
        ],
        vec![
            "input hit rate".to_string(),
            m.hit_rate.map_or("n/a".to_string(), pct),
        ],
        vec!["output share".to_string(), pct(m.output_share)],
    ];
    s += &text_table(&["quantity", "value"], &kv, false);
    s
}

/// Columns padded to their widest cell: first column left-aligned, the rest right-aligned
/// (numbers) or left-aligned (text).
fn text_table(header: &[&str], rows: &[Vec<String>], numeric: bool) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (w, c) in widths.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::from(" ");
        for (i, (c, w)) in cells.iter().zip(&widths).enumerate() {
            let pad = w - c.chars().count();
            if i == 0 {
                s += &format!(" {c}{}", " ".repeat(pad));
            } else if !numeric {
                s += &format!("  {c}{}", " ".repeat(pad));
            } else {
                s += &format!("  {}{c}", " ".repeat(pad));
            }
        }
        s.trim_end().to_string() + "\n"
    };
    let mut s = line(header.to_vec());
    for r in rows {
        s += &line(r.iter().map(String::as_str).collect());
    }
    s
}

/// 155e12 → "155.00T".
pub fn tokens(x: f64) -> String {
    let (d, unit) = match x.abs() {
        a if a >= 1e12 => (1e12, "T"),
        a if a >= 1e9 => (1e9, "B"),
        a if a >= 1e6 => (1e6, "M"),
        a if a >= 1e3 => (1e3, "K"),
        _ => (1.0, ""),
    };
    format!("{:.2}{unit}", x / d)
}

/// 26084.6 → "26,085".
pub fn int(x: f64) -> String {
    if !x.is_finite() {
        return x.to_string();
    }
    let digits = format!("{:.0}", x.abs());
    let mut out = String::new();
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(ch);
    }
    if x < 0.0 && digits != "0" {
        format!("-{out}")
    } else {
        out
    }
}

pub fn usd(x: f64) -> String {
    format!("${}", int(x))
}

pub fn pct(x: f64) -> String {
    format!("{:.2}%", x * 100.0)
}

fn days(x: f64) -> String {
    format!("{x:.2} d")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn parse(argv: &[&str]) -> Result<Args, clap::Error> {
        Cli::try_parse_from(std::iter::once("econ").chain(argv.iter().copied())).map(|c| c.args)
    }

    fn compute_err(argv: &[&str]) -> String {
        match compute(&parse(argv).expect("parses")) {
            Err(e) => format!("{e:#}"),
            Ok(r) => panic!("accepted {argv:?}: {r:?}"),
        }
    }

    fn json(argv: &[&str]) -> serde_json::Value {
        serde_json::to_value(compute(&parse(argv).unwrap()).unwrap()).unwrap()
    }

    #[test]
    fn single_json_has_the_promised_fields() {
        let v = json(&["--output-share", "0.1"]);
        for k in [
            "hit_rate",
            "revenue_per_day",
            "gpus_from_revenue",
            "gpus_needed",
            "prefill_gpus",
            "decode_gpus",
            "utilisation_needed",
            "storage_pib",
            "store_band_gpus_physical",
            "store_band_gpus_logical",
            "cache_days_per_gpu",
            "feasible",
        ] {
            assert!(v.get(k).is_some(), "missing {k} in {v}");
        }
        for k in ["token_share", "revenue_share"] {
            for part in ["hit", "miss", "output"] {
                assert!(v[k][part].is_f64(), "missing {k}.{part}");
            }
        }
        // SPEC defaults at o = 0.1: 1 − h = 0.1·89,500 / (14,500·0.9).
        let h = v["hit_rate"].as_f64().unwrap();
        assert!((h - (1.0 - 8_950.0 / 13_050.0)).abs() < 1e-12);
        assert_eq!(v["feasible"], false);
        assert!(
            v["infeasible_reasons"][0]
                .as_str()
                .unwrap()
                .contains("revenue pays for")
        );
    }

    #[test]
    fn flags_reach_the_model() {
        // Hand case: T = 10¹², o = 0.2, prefill 20,000, decode 10,000 → h = 0.5, revenue
        // $181,200/day at off-peak prices, $362,400 with --peak.
        let base = [
            "--tokens-per-day",
            "1e12",
            "--output-share",
            "0.2",
            "--prefill-tps",
            "20_000",
            "--decode-tps",
            "10000",
        ];
        let v = json(&base);
        assert!((v["hit_rate"].as_f64().unwrap() - 0.5).abs() < 1e-12);
        assert!((v["revenue_per_day"].as_f64().unwrap() - 181_200.0).abs() < 1e-6);
        let mut peak = base.to_vec();
        peak.push("--peak");
        let v2 = json(&peak);
        assert!((v2["revenue_per_day"].as_f64().unwrap() - 362_400.0).abs() < 1e-6);
        assert_eq!(v2["gpus_from_revenue"], v["gpus_from_revenue"]);
        let mut over = base.to_vec();
        over.extend([
            "--price-output",
            "1.0",
            "--price-hit",
            "0",
            "--price-miss",
            "0",
        ]);
        let v3 = json(&over);
        assert!((v3["revenue_per_day"].as_f64().unwrap() - 200_000.0).abs() < 1e-6);
    }

    #[test]
    fn measured_day_february_2025() {
        // 342.304B hits, 265.696B misses, 168B output at R1 prices on 1,814 GPUs:
        // 47,922.56 + 146,132.80 + 367,920.00 = $561,975.36/day; ÷ 43,536 GPU-hours.
        let v = json(&[
            "--hit-tokens",
            "342.304e9",
            "--miss-tokens",
            "265.696e9",
            "--output-tokens",
            "168e9",
            "--gpus",
            "1814",
            "--price-hit",
            "0.14",
            "--price-miss",
            "0.55",
            "--price-output",
            "2.19",
        ]);
        assert!((v["revenue_per_day"].as_f64().unwrap() - 561_975.36).abs() < 1e-6);
        assert!((v["revenue_per_gpu_hour"].as_f64().unwrap() - 561_975.36 / 43_536.0).abs() < 1e-9);
    }

    #[test]
    fn sweep_rows_cover_the_range_and_render() {
        let r = compute(&parse(&["--sweep-output-share", "0:0.2:0.05"]).unwrap()).unwrap();
        let Report::Sweep(s) = &r else {
            panic!("expected a sweep")
        };
        assert_eq!(s.rows.len(), 5);
        // 0.15 and 0.2 lie above 14,500 / 104,000: the pool ratio fails there.
        assert!(s.rows[2].pool_ratio_holds);
        assert!(!s.rows[3].pool_ratio_holds && !s.rows[4].pool_ratio_holds);
        let text = render(&r);
        assert!(text.contains("hit rate below 0"), "{text}");
        assert!(
            render(&compute(&parse(&["--output-share", "0.05"]).unwrap()).unwrap())
                .contains("GPUs implied by revenue")
        );
    }

    #[test]
    fn bad_values_name_the_flag() {
        for (argv, flag) in [
            (vec!["--output-share", "1"], "--output-share"),
            (vec!["--output-share", "-0.1"], "--output-share"),
            (
                vec!["--output-share", "0.1", "--decode-tps", "0"],
                "--decode-tps",
            ),
            (
                vec!["--output-share", "0.1", "--prefill-tps", "-3"],
                "--prefill-tps",
            ),
            (
                vec!["--output-share", "0.1", "--tokens-per-day", "0"],
                "--tokens-per-day",
            ),
            (
                vec!["--output-share", "0.1", "--efficiency", "1.2"],
                "--efficiency",
            ),
            (
                vec!["--output-share", "0.1", "--price-miss", "-1"],
                "--price-miss",
            ),
            (
                vec!["--output-share", "0.1", "--ec-overhead", "0.5"],
                "--ec-overhead",
            ),
            (
                vec!["--output-share", "0.1", "--revenue-per-gpu-hour", "0"],
                "--revenue-per-gpu-hour",
            ),
            (
                vec!["--sweep-output-share", "0:1:0.1"],
                "--sweep-output-share",
            ),
            (
                vec!["--sweep-output-share", "0.2:0.1:0.1"],
                "--sweep-output-share",
            ),
            (
                vec!["--sweep-output-share", "0:0.1"],
                "--sweep-output-share",
            ),
            (
                vec!["--sweep-output-share", "0:x:0.1"],
                "--sweep-output-share",
            ),
            (
                vec![
                    "--hit-tokens",
                    "1",
                    "--miss-tokens",
                    "1",
                    "--output-tokens",
                    "1",
                    "--gpus",
                    "0",
                ],
                "--gpus",
            ),
            (
                vec![
                    "--hit-tokens",
                    "-1",
                    "--miss-tokens",
                    "1",
                    "--output-tokens",
                    "1",
                    "--gpus",
                    "1",
                ],
                "--hit-tokens",
            ),
        ] {
            let msg = compute_err(&argv);
            assert!(msg.contains(&format!("`{flag}`")), "{argv:?}: {msg}");
        }
        assert!(compute_err(&[]).contains("nothing to compute"));
    }

    #[test]
    fn parse_errors_come_from_clap() {
        use clap::error::ErrorKind;
        let kind = |argv: &[&str]| parse(argv).err().map(|e| e.kind());
        assert_eq!(
            kind(&["--output-shares", "0.1"]),
            Some(ErrorKind::UnknownArgument)
        );
        assert_eq!(
            kind(&["--output-share", "abc"]),
            Some(ErrorKind::ValueValidation)
        );
        assert_eq!(
            kind(&["--output-share", "0.1", "--sweep-output-share", "0:0.1:0.1"]),
            Some(ErrorKind::ArgumentConflict)
        );
        assert_eq!(
            kind(&["--hit-tokens", "1", "--miss-tokens", "1"]),
            Some(ErrorKind::MissingRequiredArgument)
        );
        assert_eq!(
            kind(&[
                "--hit-tokens",
                "1",
                "--miss-tokens",
                "1",
                "--output-tokens",
                "1",
                "--gpus",
                "1",
                "--output-share",
                "0.1"
            ]),
            Some(ErrorKind::ArgumentConflict)
        );
        // Prices and --peak belong to both modes.
        assert!(
            parse(&[
                "--hit-tokens",
                "1",
                "--miss-tokens",
                "1",
                "--output-tokens",
                "1",
                "--gpus",
                "1",
                "--peak",
                "--price-hit",
                "0.1"
            ])
            .is_ok()
        );
        let msg = parse(&["--output-share", "abc"]).err().unwrap().to_string();
        assert!(msg.contains("--output-share"), "{msg}");
    }

    #[test]
    fn number_formats() {
        assert_eq!(int(26_084.6), "26,085");
        assert_eq!(int(999.4), "999");
        assert_eq!(int(-1_234_567.0), "-1,234,567");
        assert_eq!(tokens(155e12), "155.00T");
        assert_eq!(tokens(608e9), "608.00B");
        assert_eq!(pct(0.5), "50.00%");
        assert_eq!(number("89_500").unwrap(), 89_500.0);
        assert_eq!(number("155e12").unwrap(), 155e12);
        assert!(number("1x").is_err());
    }
}
