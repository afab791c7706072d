//! What the command-line tests share: running the `servelab` binary and a fresh scratch folder.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

/// Runs the `servelab` binary of this build with `args`.
pub fn servelab(args: &[&str]) -> Output {
    servelab_with(args, &[])
}

/// [`servelab`] with environment variables set (a thread count, for instance).
pub fn servelab_with(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_servelab"))
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("servelab runs")
}

/// An empty folder for one test: `<temp>/servelab-<suite>-<pid>-<name>`.
pub fn scratch(suite: &str, name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("servelab-{suite}-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}
