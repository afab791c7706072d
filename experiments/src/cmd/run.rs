//! `servelab run <config.toml>`: dispatch on `[experiment] kind`, with `--set` overrides, or a
//! sweep when the config has a `[sweep]` table.

use crate::config::{LoadedConfig, Override};
use crate::exp;
use crate::output;
use crate::sweep::Runner;
use anyhow::{Context, Result, anyhow, bail};
use std::path::PathBuf;
use std::process::{Command, Stdio};

#[derive(clap::Args, Clone)]
pub struct Args {
    /// Experiment config (TOML).
    pub config: PathBuf,
    /// Output folder (default: `[experiment] out_dir`, else `results/<name>`). Created and
    /// test-written before any work starts.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Override the config's seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Set a config key, as in the file: `--set store.ttl.agent='"1h"'`,
    /// `--set service.decode.lb=least-loaded` (a bare word is a string),
    /// `--set 'workload[0].mix.agent.sessions=50'`. Repeatable; checked like the file (an
    /// unknown key is an error that lists the valid ones).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Replace the results already in the output folder (without it, such a folder is refused;
    /// a sweep's folder is resumed instead).
    #[arg(long)]
    pub force: bool,
    /// Print summary.json (the headline metrics) to stdout instead of the report (which goes
    /// to stderr).
    #[arg(long)]
    pub json: bool,
    /// Sweeps: points run at once (default: one per core).
    #[arg(long, short = 'j')]
    pub jobs: Option<usize>,
    /// No progress bars.
    #[arg(long)]
    pub quiet: bool,
    /// Run one point of a sweep: ignore the config's `[sweep]` grid (used by the sweep runner).
    #[arg(long, hide = true)]
    pub point: bool,
}

/// Runs the experiment of `ctx`'s kind; a semantic error names the key and its line.
pub fn dispatch(ctx: &exp::RunContext) -> Result<()> {
    let r = match ctx.config.header.kind.as_str() {
        "autoscale-day" => exp::autoscale_day::run(ctx),
        "cluster-day" => exp::cluster_day::run(ctx),
        "cache-policy" => exp::cache_policy::run(ctx),
        "cluster" => exp::cluster::run(ctx),
        "dspark" => exp::dspark::run(ctx),
        "econ-sweep" => exp::econ::run(ctx),
        "eplb" => exp::eplb::run(ctx),
        "faults" => exp::faults::run(ctx),
        "plan" => exp::plan::run(ctx),
        "sampling" => exp::sampling::run(ctx),
        "service" => exp::service::run(ctx),
        "ttl-days" => exp::ttl_days::run(ctx),
        other => bail!(
            "{}: unknown experiment kind `{other}`{} (known: {})",
            ctx.config.path.display(),
            ctx.config.where_is("experiment.kind"),
            exp::KINDS.join(", ")
        ),
    };
    r.map_err(|e| ctx.config.explain_error(e))
}

pub fn run(args: Args) -> Result<()> {
    output::set_run_info(args.set.clone());
    execute(&args, Runner::Process).map(|_| ())
}

/// The config of `args` with its overrides and seed applied, and the output folder it runs
/// into.
pub fn load(args: &Args) -> Result<(LoadedConfig, PathBuf)> {
    let overrides: Vec<Override> = args
        .set
        .iter()
        .map(|s| Override::parse(s))
        .collect::<Result<_>>()?;
    let mut cfg = LoadedConfig::load_with(&args.config, overrides)?;
    if let Some(s) = args.seed {
        cfg.header.seed = s;
    }
    let out = cfg.header.out_dir(args.out.as_deref());
    Ok((cfg, out))
}

/// Runs the experiment (or the sweep, its points run by `runner`) and returns the folder its
/// outputs are in.
pub fn execute(args: &Args, runner: Runner) -> Result<PathBuf> {
    let (cfg, out) = load(args)?;
    if !args.point
        && let Some(spec) = crate::sweep::spec::parse(&cfg)?
    {
        let base_overrides = cfg.overrides.clone();
        crate::sweep::run(
            cfg,
            spec,
            &crate::sweep::Options {
                out: out.clone(),
                quiet: args.quiet,
                force: args.force,
                json: args.json,
                jobs: args.jobs,
                base_overrides: &base_overrides,
                runner,
            },
        )?;
        return Ok(out);
    }
    if args.json {
        run_json(args, &out)?;
        return Ok(out);
    }
    output::prepare_out_dir(&out, args.force, &[])?;
    println!(
        "servelab run: {} (kind {}), seed {}{}, output {}",
        cfg.path.display(),
        cfg.header.kind,
        cfg.header.seed,
        if cfg.overrides.is_empty() {
            String::new()
        } else {
            format!(
                ", overrides {}",
                cfg.overrides
                    .iter()
                    .map(|o| o.to_string())
                    .collect::<Vec<_>>()
                    .join(" ")
            )
        },
        out.display()
    );
    let ctx = exp::RunContext {
        config: cfg,
        out: out.clone(),
        quiet: args.quiet,
    };
    dispatch(&ctx)?;
    Ok(out)
}

/// `--json`: the run itself in a child process whose report goes to stderr, then summary.json
/// on stdout, alone, for scripts.
fn run_json(args: &Args, out: &std::path::Path) -> Result<()> {
    let exe = std::env::current_exe().context("locating the servelab binary")?;
    let mut cmd = Command::new(exe);
    cmd.arg("run").arg(&args.config).arg("--out").arg(out);
    if let Some(s) = args.seed {
        cmd.arg("--seed").arg(s.to_string());
    }
    for s in &args.set {
        cmd.arg("--set").arg(s);
    }
    if args.force {
        cmd.arg("--force");
    }
    if args.quiet {
        cmd.arg("--quiet");
    }
    if args.point {
        cmd.arg("--point");
    }
    let status = cmd
        .stdout(Stdio::from(std::io::stderr()))
        .status()
        .context("running the experiment")?;
    if !status.success() {
        bail!("the run failed ({status}); its errors are above");
    }
    let p = out.join("summary.json");
    let text = std::fs::read_to_string(&p).map_err(|e| anyhow!("reading {}: {e}", p.display()))?;
    print!("{text}");
    Ok(())
}
