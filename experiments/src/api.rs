//! The commands as plain functions, for programs that embed servelab (the Python package in
//! `experiments/python`): each takes the same arguments as its command, runs the same code and
//! returns what the command prints, so a number from here equals the command's.
//!
//! The arguments are the commands' clap structs; [`parse`] builds one from a command line, which
//! is how the Python package turns keyword arguments into them, so that a bad value is refused
//! with the same message as on the command line.

use crate::cli::{Cli, Command};
use crate::cmd;
use crate::config::Override;
use crate::output;
use crate::sweep::{self, ExternalJob};
use anyhow::{Result, bail};
use clap::Parser;
use serde::Serialize;
use std::path::{Path, PathBuf};

pub use crate::sweep::Runner;

/// Parses `servelab ARGS...` (without the program name) into its command.
pub fn parse(args: &[String]) -> Result<Command> {
    let argv = std::iter::once("servelab".to_string()).chain(args.iter().cloned());
    match Cli::try_parse_from(argv) {
        Ok(c) => Ok(c.command),
        // clap's message names the flag and the accepted values; its trailing usage lines are
        // for a terminal.
        Err(e) => bail!("{}", e.to_string().trim_end()),
    }
}

/// `servelab run`: the experiment (or the sweep) of `args`, its points run by `runner`; returns
/// the output folder. Its manifest records `servelab` and `args` as the command line.
pub fn run(args: &cmd::run::Args, argv: &[String], runner: Runner) -> Result<PathBuf> {
    if args.json {
        bail!("--json prints to stdout: read summary.json in the output folder instead");
    }
    let command_line = std::iter::once("servelab".to_string())
        .chain(argv.iter().cloned())
        .collect();
    output::with_run_info(command_line, args.set.clone(), || {
        cmd::run::execute(args, runner)
    })
}

/// `servelab hit`: one explained hit decision.
pub fn hit(args: &cmd::hit::Args) -> Result<cmd::hit::Explanation> {
    cmd::hit::explain(args)
}

/// `servelab replay`: the block-level replay of a trace.
pub fn replay(args: &cmd::replay::Args) -> Result<cmd::replay::Outcome> {
    cmd::replay::replay(args)
}

/// `servelab mrc`: the hit-rate curves, written to `args.out`; an error if a point replay
/// differs from them (as the command exits with).
pub fn mrc(args: &cmd::mrc::Args) -> Result<cmd::mrc::Outcome> {
    let o = cmd::mrc::compute(args)?;
    o.check()?;
    Ok(o)
}

/// A sweep laid out for a runner outside this process (Ray): the config as read, and the
/// distinct points × seeds.
#[derive(Serialize)]
pub struct SweepPlan {
    pub config_path: PathBuf,
    pub config_text: String,
    pub out: PathBuf,
    pub jobs: Vec<ExternalJob>,
}

fn sweep_of(
    args: &cmd::run::Args,
) -> Result<(crate::config::LoadedConfig, sweep::spec::Spec, PathBuf)> {
    let (cfg, out) = cmd::run::load(args)?;
    let Some(spec) = sweep::spec::parse(&cfg)? else {
        bail!(
            "{}: no [sweep] table: run it with `servelab.run` instead",
            cfg.path.display()
        );
    };
    Ok((cfg, spec, out))
}

/// Checks the sweep of `args` and prepares its folder (finished points are kept, as the local
/// runner resumes); the caller runs every job not `done` with [`run_point`], writes the job's
/// files into its `dir` and then its `record` as `point.json`, and calls [`sweep_finish`].
pub fn sweep_plan(args: &cmd::run::Args) -> Result<SweepPlan> {
    let (cfg, spec, out) = sweep_of(args)?;
    let jobs = sweep::plan_external(&cfg, &spec, &out, args.force)?;
    Ok(SweepPlan {
        config_path: cfg.path.clone(),
        config_text: cfg.text.clone(),
        out,
        jobs,
    })
}

/// Runs one point × seed of a sweep into `dir` (see [`sweep::run_point_in_process`]).
pub fn run_point(
    path: &Path,
    text: String,
    overrides: &[String],
    seed: u64,
    dir: &Path,
) -> Result<()> {
    let overrides: Vec<Override> = overrides
        .iter()
        .map(|s| Override::parse(s))
        .collect::<Result<_>>()?;
    sweep::run_point_in_process(path, text, overrides, seed, dir)
}

/// Tabulates the sweep of `args` once every point is finished: the same tables, plots and
/// summaries as the local runner; returns the output folder.
pub fn sweep_finish(args: &cmd::run::Args, argv: &[String]) -> Result<PathBuf> {
    let (cfg, spec, out) = sweep_of(args)?;
    let base_overrides = cfg.overrides.clone();
    let command_line = std::iter::once("servelab".to_string())
        .chain(argv.iter().cloned())
        .collect();
    output::with_run_info(command_line, args.set.clone(), || {
        sweep::finish_external(
            cfg,
            spec,
            &sweep::Options {
                out: out.clone(),
                quiet: true,
                force: false,
                json: false,
                jobs: None,
                base_overrides: &base_overrides,
                runner: Runner::InProcess,
            },
        )
    })?;
    Ok(out)
}
