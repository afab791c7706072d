//! The `econ-sweep` experiment: SPEC §12 over output share and decode operating points, drawn
//! as the crossing chart (GPUs implied by revenue, GPUs needed, and the store band against
//! output share). Formulas live in `servelab_core::econ`; this file only sweeps and writes.

use super::RunContext;
use crate::config::ExperimentHeader;
use crate::output::{Manifest, RunOutput, markdown_table};
use crate::plot;
use anyhow::{Result, anyhow, bail};
use polars::prelude::*;
use serde::Deserialize;
use servelab_core::ConfigError;
use servelab_core::econ::{self, Crossings, EconConfig, EconEstimate, EconParams};

/// `[experiment] kind = "econ-sweep"`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EconSweepConfig {
    pub experiment: ExperimentHeader,
    /// The model's inputs (the keys of `servelab econ`'s flags); missing keys take the published
    /// defaults. `decode_tps` belongs in `[sweep]`.
    #[serde(default)]
    pub econ: EconConfig,
    pub sweep: SweepConfig,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SweepConfig {
    pub output_share: ShareRange,
    /// Decode operating points, output tokens/s per GPU (SPEC §11: 2,600–26,200; 14,500 in
    /// production).
    pub decode_tps: Vec<f64>,
    /// Also draw `crossing_zoom.svg` over [output_share.start, zoom_stop]: the crossings of the
    /// slow decode points sit at output shares of a few percent.
    #[serde(default)]
    pub zoom_stop: Option<f64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShareRange {
    pub start: f64,
    pub stop: f64,
    pub step: f64,
}

/// One decode operating point: its crossings and its rows over the output-share grid.
struct Curve {
    decode_tps: f64,
    crossings: Crossings,
    /// The model at the largest feasible output share.
    at_limit: EconEstimate,
    rows: Vec<EconEstimate>,
}

/// Names core's fields by their place in the config file.
fn config_error(path: &std::path::Path, e: ConfigError) -> anyhow::Error {
    let ConfigError::Invalid { field, reason } = e;
    let key = match field.as_str() {
        "output_share" => "sweep.output_share".to_string(),
        "decode_tps" => "sweep.decode_tps".to_string(),
        econ::INPUTS_FIELD => return anyhow!("{}: invalid inputs: {reason}", path.display()),
        other => format!("econ.{other}"),
    };
    anyhow!("{}: invalid `{key}`: {reason}", path.display())
}

fn sweep(cfg: &EconSweepConfig, path: &std::path::Path) -> Result<Vec<Curve>> {
    if cfg.econ.decode_tps.is_some() {
        bail!(
            "{}: `econ.decode_tps` is set, but the decode operating points of a sweep belong in \
             `sweep.decode_tps`",
            path.display()
        );
    }
    if let Some(z) = cfg.sweep.zoom_stop {
        let r = &cfg.sweep.output_share;
        if !(z > r.start && z <= r.stop) {
            bail!(
                "{}: invalid `sweep.zoom_stop`: must lie in (output_share.start, output_share.stop] \
                 = ({}, {}], got {z}",
                path.display(),
                r.start,
                r.stop
            );
        }
    }
    if cfg.sweep.decode_tps.is_empty() {
        bail!("{}: `sweep.decode_tps` is empty", path.display());
    }
    let r = &cfg.sweep.output_share;
    let grid = econ::share_grid("output_share", r.start, r.stop, r.step)
        .map_err(|e| config_error(path, e))?;
    cfg.sweep
        .decode_tps
        .iter()
        .map(|&decode_tps| {
            let base = EconParams {
                decode_tps,
                ..cfg.econ.params(0.0)
            };
            let err = |e| config_error(path, e);
            let crossings = econ::crossings(&base).map_err(err)?;
            let at_limit = econ::evaluate(&EconParams {
                output_share: crossings.feasible_up_to_output_share,
                ..base
            })
            .map_err(err)?;
            let rows = grid
                .iter()
                .map(|&o| {
                    econ::evaluate(&EconParams {
                        output_share: o,
                        ..base
                    })
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(err)?;
            Ok(Curve {
                decode_tps,
                crossings,
                at_limit,
                rows,
            })
        })
        .collect()
}

fn sweep_table(curves: &[Curve]) -> Result<DataFrame> {
    let rows: Vec<(f64, &EconEstimate)> = curves
        .iter()
        .flat_map(|c| c.rows.iter().map(move |e| (c.decode_tps, e)))
        .collect();
    let col = |f: &dyn Fn(&EconEstimate) -> f64| rows.iter().map(|(_, e)| f(e)).collect::<Vec<_>>();
    let opt = |f: &dyn Fn(&EconEstimate) -> Option<f64>| {
        rows.iter().map(|(_, e)| f(e)).collect::<Vec<_>>()
    };
    let flag =
        |f: &dyn Fn(&EconEstimate) -> bool| rows.iter().map(|(_, e)| f(e)).collect::<Vec<_>>();
    let df = df!(
        "decode_tps" => rows.iter().map(|(d, _)| *d).collect::<Vec<_>>(),
        "output_share" => col(&|e| e.output_share),
        "hit_rate_implied" => col(&|e| e.hit_rate_implied),
        "hit_rate" => col(&|e| e.hit_rate),
        "pool_ratio_holds" => flag(&|e| e.pool_ratio_holds),
        "hit_tokens_per_day" => col(&|e| e.tokens_per_day.hit),
        "miss_tokens_per_day" => col(&|e| e.tokens_per_day.miss),
        "output_tokens_per_day" => col(&|e| e.tokens_per_day.output),
        "token_share_hit" => col(&|e| e.token_share.hit),
        "token_share_miss" => col(&|e| e.token_share.miss),
        "token_share_output" => col(&|e| e.token_share.output),
        "revenue_per_day" => col(&|e| e.revenue_per_day),
        "revenue_share_hit" => opt(&|e| e.revenue_share.map(|s| s.hit)),
        "revenue_share_miss" => opt(&|e| e.revenue_share.map(|s| s.miss)),
        "revenue_share_output" => opt(&|e| e.revenue_share.map(|s| s.output)),
        "gpus_from_revenue" => col(&|e| e.gpus_from_revenue),
        "prefill_gpus" => col(&|e| e.prefill_gpus),
        "decode_gpus" => col(&|e| e.decode_gpus),
        "gpus_needed" => col(&|e| e.gpus_needed),
        "utilisation_needed" => opt(&|e| e.utilisation_needed),
        "written_bytes_per_day" => col(&|e| e.written_bytes_per_day),
        "storage_pib" => col(&|e| e.storage_pib),
        "storage_fits" => flag(&|e| e.storage_fits),
        "store_band_gpus_physical" => col(&|e| e.store_band_gpus_physical),
        "store_band_gpus_logical" => col(&|e| e.store_band_gpus_logical),
        "cache_days_per_gpu" => opt(&|e| e.cache_days_per_gpu),
        "cache_days_at_gpus_needed" => opt(&|e| e.cache_days_at_gpus_needed),
        "feasible" => flag(&|e| e.feasible),
        "infeasible_reasons" => rows
            .iter()
            .map(|(_, e)| {
                e.infeasible_reasons
                    .iter()
                    .map(|r| r.to_string())
                    .collect::<Vec<_>>()
                    .join("; ")
            })
            .collect::<Vec<_>>(),
    )
    .map_err(|e| anyhow!("building the econ_sweep table: {e}"))?;
    Ok(df)
}

fn crossings_table(curves: &[Curve]) -> Result<DataFrame> {
    let c = |f: &dyn Fn(&Curve) -> f64| curves.iter().map(f).collect::<Vec<_>>();
    let df = df!(
        "decode_tps" => c(&|c| c.decode_tps),
        "max_output_share" => c(&|c| c.crossings.max_output_share),
        "break_even_output_share" => curves
            .iter()
            .map(|c| c.crossings.break_even_output_share)
            .collect::<Vec<_>>(),
        "feasible_up_to_output_share" => c(&|c| c.crossings.feasible_up_to_output_share),
        "hit_rate_at_limit" => c(&|c| c.at_limit.hit_rate),
        "gpus_needed_at_limit" => c(&|c| c.at_limit.gpus_needed),
        "gpus_from_revenue_at_limit" => c(&|c| c.at_limit.gpus_from_revenue),
        "revenue_per_day_at_limit" => c(&|c| c.at_limit.revenue_per_day),
        "storage_pib_at_limit" => c(&|c| c.at_limit.storage_pib),
        "storage_limit_output_share" => c(&|c| c.crossings.storage_limit_output_share),
    )
    .map_err(|e| anyhow!("building the crossings table: {e}"))?;
    Ok(df)
}

fn label(decode_tps: f64) -> String {
    format!("decode {} tok/s", crate::cmd::econ::int(decode_tps))
}

/// The crossing chart: per decode point, GPUs implied by revenue and GPUs needed (only where
/// 1:1 pools are possible), and the store band as two horizontal lines.
fn crossing_plot(
    path: &std::path::Path,
    title: &str,
    curves: &[Curve],
    x_range: (f64, f64),
) -> Result<()> {
    let mut series = Vec::new();
    for c in curves {
        let valid: Vec<&EconEstimate> = c
            .rows
            .iter()
            .filter(|e| e.pool_ratio_holds && e.output_share <= x_range.1)
            .collect();
        series.push((
            format!("revenue GPUs, {}", label(c.decode_tps)),
            valid
                .iter()
                .map(|e| (e.output_share, e.gpus_from_revenue))
                .collect(),
        ));
        series.push((
            format!("GPUs needed, {}", label(c.decode_tps)),
            valid
                .iter()
                .map(|e| (e.output_share, e.gpus_needed))
                .collect(),
        ));
    }
    let band = &curves[0].rows[0];
    for (name, gpus) in [
        ("store band, physical", band.store_band_gpus_physical),
        ("store band, logical", band.store_band_gpus_logical),
    ] {
        series.push((name.to_string(), vec![(x_range.0, gpus), (x_range.1, gpus)]));
    }
    plot::lines(path, title, "output share", "GPUs", &series)
}

fn utilisation_plot(path: &std::path::Path, curves: &[Curve]) -> Result<()> {
    let series: Vec<(String, Vec<(f64, f64)>)> = curves
        .iter()
        .map(|c| {
            (
                label(c.decode_tps),
                c.rows
                    .iter()
                    .filter(|e| e.pool_ratio_holds)
                    .filter_map(|e| e.utilisation_needed.map(|u| (e.output_share, u)))
                    .collect(),
            )
        })
        .collect();
    plot::lines(
        path,
        "Utilisation the fleet would need (GPUs needed / GPUs implied by revenue)",
        "output share",
        "utilisation needed",
        &series,
    )
}

fn summary(ctx: &RunContext, cfg: &EconSweepConfig, curves: &[Curve]) -> String {
    use crate::cmd::econ::{int, pct, tokens};
    let p = cfg.econ.params(0.0);
    let name = cfg
        .experiment
        .name
        .as_deref()
        .unwrap_or(&cfg.experiment.kind);
    let mut s = format!("# {name}\n\n");
    if let Some(d) = &cfg.experiment.description {
        s += &format!("{}\n\n", d.trim());
    }
    s += &format!(
        "SPEC §12 model along the 1:1 prefill:decode pool line (the hit rate follows from the \
         output share). Inputs: {} tokens/day; prefill {} tok/s/GPU; efficiency {}; prices per M \
         tokens ${} hit / ${} miss / ${} output; ${} per GPU-hour; {} B/token KV held {} days \
         × {} EC; {} TB cache per GPU; {} PiB store. Config: `{}`.\n\n",
        tokens(p.tokens_per_day),
        int(p.prefill_tps),
        pct(p.efficiency),
        p.prices.hit_usd_per_mtok,
        p.prices.miss_usd_per_mtok,
        p.prices.output_usd_per_mtok,
        p.revenue_per_gpu_hour,
        p.bytes_per_token,
        p.ttl_days,
        p.ec_overhead,
        p.cache_per_gpu_tb,
        p.store_pib,
        ctx.config.path.display(),
    );
    s += "## Crossings per decode operating point\n\n";
    s += &crossings_md(curves);
    let band = &curves[0].rows[0];
    s += &format!(
        "\nStore band: {} GPUs (physical: store ÷ {} EC ÷ {} TB) to {} GPUs (logical: store ÷ {} TB).\n\n",
        int(band.store_band_gpus_physical),
        p.ec_overhead,
        p.cache_per_gpu_tb,
        int(band.store_band_gpus_logical),
        p.cache_per_gpu_tb,
    );
    s += "Break-even: where GPUs needed equal GPUs implied by revenue; below it revenue pays for \
          the capacity. \"never\": revenue grows faster than capacity along the whole line. Above \
          \"1:1 pools up to\" the pool ratio would need a negative hit rate: those rows are \
          infeasible and computed with hit rate 0.\n\n";
    s += "Files: `econ_sweep.csv`/`.parquet` (one row per decode point × output share), \
          `crossings.csv`/`.parquet`, `crossing.svg` (the crossing chart; `crossing_zoom.svg` over low \
          output shares when `sweep.zoom_stop` is set), `utilisation.svg`.\n";
    s
}

/// One row per decode operating point: where its 1:1 pool line crosses each limit, and the
/// fleet at the feasibility limit.
fn crossings_md(curves: &[Curve]) -> String {
    use crate::cmd::econ::{int, pct, usd};
    let rows: Vec<Vec<String>> = curves
        .iter()
        .map(|c| {
            let x = &c.crossings;
            vec![
                int(c.decode_tps),
                pct(x.max_output_share),
                x.break_even_output_share.map_or("never".to_string(), pct),
                pct(x.feasible_up_to_output_share),
                pct(c.at_limit.hit_rate),
                int(c.at_limit.gpus_needed),
                usd(c.at_limit.revenue_per_day),
                format!("{:.1}", c.at_limit.storage_pib),
                pct(x.storage_limit_output_share),
            ]
        })
        .collect();
    markdown_table(
        &[
            "decode tok/s/GPU",
            "1:1 pools up to",
            "break-even output share",
            "feasible up to",
            "hit rate there",
            "GPUs needed there",
            "revenue/day there",
            "storage PiB there",
            "storage = store at",
        ],
        &rows,
    )
}

pub fn run(ctx: &RunContext) -> Result<()> {
    let cfg: EconSweepConfig = ctx.config.parse()?;
    let curves = sweep(&cfg, &ctx.config.path)?;
    let mut out = RunOutput::create(&ctx.out)?;
    out.write_table("econ_sweep", &mut sweep_table(&curves)?)?;
    out.write_table("crossings", &mut crossings_table(&curves)?)?;
    let r = &cfg.sweep.output_share;
    let title = "SPEC §12: GPUs implied by revenue vs GPUs needed (1:1 pools)";
    let svg = out.path("crossing.svg");
    crossing_plot(&svg, title, &curves, (r.start, r.stop))?;
    if let Some(z) = cfg.sweep.zoom_stop {
        let svg = out.path("crossing_zoom.svg");
        crossing_plot(
            &svg,
            &format!("{title}, output share ≤ {z}"),
            &curves,
            (r.start, z),
        )?;
    }
    let svg = out.path("utilisation.svg");
    utilisation_plot(&svg, &curves)?;
    let text = summary(ctx, &cfg, &curves);
    out.write_text("summary.md", &text)?;
    let crossings = crossings_table(&curves)?;
    out.write_summary_json(&crate::sweep::headline::from_frame(
        &crossings,
        &["decode_tps"],
    )?)?;
    out.write_manifest(
        &Manifest::new(
            &ctx.config.header.kind,
            &ctx.config.path,
            &ctx.config.text,
            ctx.seed(),
        ),
        // Closed-form curves: nothing is simulated, so no speed figures.
        &[],
    )?;
    print!("{text}");
    println!("\nwrote {}", out.dir().display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::LoadedConfig;

    fn load(text: &str) -> (EconSweepConfig, std::path::PathBuf) {
        let path = std::path::PathBuf::from("test-econ.toml");
        let cfg = crate::config::parse_toml(&path, text).unwrap();
        (cfg, path)
    }

    const OK: &str = r#"
        [experiment]
        kind = "econ-sweep"
        [sweep]
        output_share = { start = 0.0, stop = 0.2, step = 0.05 }
        decode_tps = [2600, 14500, 26200]
    "#;

    #[test]
    fn sweep_has_one_curve_per_decode_point() {
        let (cfg, path) = load(OK);
        let curves = sweep(&cfg, &path).unwrap();
        assert_eq!(curves.len(), 3);
        assert!(curves.iter().all(|c| c.rows.len() == 5));
        // Faster decode → 1:1 pools stay possible to a higher output share.
        assert!(curves[0].crossings.max_output_share < curves[1].crossings.max_output_share);
        assert!(curves[1].crossings.max_output_share < curves[2].crossings.max_output_share);
        let df = sweep_table(&curves).unwrap();
        assert_eq!(df.height(), 15);
        assert_eq!(crossings_table(&curves).unwrap().height(), 3);
    }

    #[test]
    fn bad_configs_name_the_key() {
        let err = |text: &str| {
            let path = std::path::PathBuf::from("bad.toml");
            match crate::config::parse_toml::<EconSweepConfig>(&path, text) {
                Err(e) => format!("{e:#}"),
                Ok(cfg) => match sweep(&cfg, &path) {
                    Err(e) => format!("{e:#}"),
                    Ok(_) => panic!("accepted:\n{text}"),
                },
            }
        };
        let with = |extra: &str| format!("{OK}\n[econ]\n{extra}\n");
        assert!(err(&with("efficiency = 0")).contains("`econ.efficiency`"));
        assert!(err(&with("decode_tps = 1000")).contains("`econ.decode_tps`"));
        assert!(err(&with("tokens_per_dya = 1")).contains("tokens_per_dya"));
        assert!(err(&OK.replace("stop = 0.2", "stop = 1.0")).contains("`sweep.output_share`"));
        assert!(err(&OK.replace("[2600, 14500, 26200]", "[0]")).contains("`sweep.decode_tps`"));
        assert!(err(&OK.replace("[2600, 14500, 26200]", "[]")).contains("`sweep.decode_tps`"));
        let zoom = OK.replace("decode_tps = [", "zoom_stop = 0.3\n        decode_tps = [");
        assert!(err(&zoom).contains("`sweep.zoom_stop`"));
    }

    #[test]
    fn shipped_config_parses() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/econ-sweep.toml");
        let loaded = LoadedConfig::load(&path).unwrap();
        assert_eq!(loaded.header.kind, "econ-sweep");
        let cfg: EconSweepConfig = loaded.parse().unwrap();
        assert!(sweep(&cfg, &path).is_ok());
    }
}
