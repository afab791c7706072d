//! `servelab._native`: the Python side of `servelab_experiments::api`. Every function takes the
//! command line of its `servelab` command (the Python wrappers in `python/servelab/` build it
//! from keyword arguments) and returns what the command would print as JSON, or the folder its
//! files are in; the DataFrames are read from those files in Python. Errors become
//! `servelab.ServelabError` with the command's message (file, line, key).

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use servelab_experiments::api::{self, Runner};
use servelab_experiments::cli::Command;
use std::path::PathBuf;

create_exception!(
    _native,
    ServelabError,
    PyValueError,
    "A servelab error: a bad config, flag, trace or output folder; the message names the file, \
     line and key, as the command line's would."
);

fn err(e: anyhow::Error) -> PyErr {
    ServelabError::new_err(format!("{e:#}"))
}

/// The command that `argv` parses to, which must be `want`.
fn parse(argv: &[String], want: &str) -> PyResult<Command> {
    if argv.first().map(String::as_str) != Some(want) {
        return Err(ServelabError::new_err(format!(
            "expected a `{want}` command line"
        )));
    }
    api::parse(argv).map_err(err)
}

fn run_args(argv: &[String]) -> PyResult<servelab_experiments::cmd::run::Args> {
    match parse(argv, "run")? {
        Command::Run(a) => Ok(a),
        _ => unreachable!("checked by parse"),
    }
}

/// `servelab run ARGV...` in this process (a sweep's points too); returns the output folder.
#[pyfunction]
fn run(py: Python<'_>, argv: Vec<String>) -> PyResult<String> {
    let a = run_args(&argv)?;
    let out = py
        .detach(|| api::run(&a, &argv, Runner::InProcess))
        .map_err(err)?;
    Ok(out.display().to_string())
}

/// `servelab hit ARGV... --json`: the decision as a JSON object.
#[pyfunction]
fn hit(argv: Vec<String>) -> PyResult<String> {
    let Command::Hit(a) = parse(&argv, "hit")? else {
        unreachable!("checked by parse")
    };
    Ok(api::hit(&a).map_err(err)?.to_json().to_string())
}

/// `servelab replay ARGV... --json`: the report as a JSON object.
#[pyfunction]
fn replay(py: Python<'_>, argv: Vec<String>) -> PyResult<String> {
    let Command::Replay(a) = parse(&argv, "replay")? else {
        unreachable!("checked by parse")
    };
    let o = py.detach(|| api::replay(&a)).map_err(err)?;
    Ok(o.to_json().map_err(err)?.to_string())
}

/// `servelab mrc ARGV... --json`: the summary as a JSON object; the tables are in its `out`.
#[pyfunction]
fn mrc(py: Python<'_>, argv: Vec<String>) -> PyResult<String> {
    let Command::Mrc(a) = parse(&argv, "mrc")? else {
        unreachable!("checked by parse")
    };
    let o = py.detach(|| api::mrc(&a)).map_err(err)?;
    Ok(o.json.to_string())
}

/// The sweep of `servelab run ARGV...` laid out for Ray, as JSON (`api::SweepPlan`).
#[pyfunction]
fn sweep_plan(py: Python<'_>, argv: Vec<String>) -> PyResult<String> {
    let a = run_args(&argv)?;
    let plan = py.detach(|| api::sweep_plan(&a)).map_err(err)?;
    serde_json::to_string(&plan).map_err(|e| err(e.into()))
}

/// One point × seed of a sweep, run into `dir` (on a Ray worker).
#[pyfunction]
fn run_point(
    py: Python<'_>,
    config_path: String,
    config_text: String,
    overrides: Vec<String>,
    seed: u64,
    dir: String,
) -> PyResult<()> {
    py.detach(|| {
        api::run_point(
            &PathBuf::from(config_path),
            config_text,
            &overrides,
            seed,
            &PathBuf::from(dir),
        )
    })
    .map_err(err)
}

/// Tabulates the sweep of `servelab run ARGV...` once Ray finished its points; returns the
/// output folder.
#[pyfunction]
fn sweep_finish(py: Python<'_>, argv: Vec<String>) -> PyResult<String> {
    let a = run_args(&argv)?;
    let out = py.detach(|| api::sweep_finish(&a, &argv)).map_err(err)?;
    Ok(out.display().to_string())
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("ServelabError", m.py().get_type::<ServelabError>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add(
        "git_commit",
        servelab_experiments::output::git_commit().to_string(),
    )?;
    for f in [
        wrap_pyfunction!(run, m)?,
        wrap_pyfunction!(hit, m)?,
        wrap_pyfunction!(replay, m)?,
        wrap_pyfunction!(mrc, m)?,
        wrap_pyfunction!(sweep_plan, m)?,
        wrap_pyfunction!(run_point, m)?,
        wrap_pyfunction!(sweep_finish, m)?,
    ] {
        m.add_function(f)?;
    }
    Ok(())
}
