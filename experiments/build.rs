//! Embeds the commit the binary is built from (`SERVELAB_GIT_COMMIT`, with `-dirty` when tracked
//! files differ from it) so that a manifest names the build, not whatever repository the run
//! happens to start in. Outside a git checkout (a source tarball) it is `unknown`.

use std::path::{Path, PathBuf};
use std::process::Command;

fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let o = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .ok()?;
    if !o.status.success() {
        return None;
    }
    Some(String::from_utf8_lossy(&o.stdout).trim().to_string())
}

fn rerun_if_exists(p: &Path) {
    if p.exists() {
        println!("cargo:rerun-if-changed={}", p.display());
    }
}

fn main() {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
    println!("cargo:rerun-if-changed=build.rs");
    let commit = match git(&dir, &["rev-parse", "HEAD"]) {
        Some(c) if !c.is_empty() => {
            let dirty = git(&dir, &["status", "--porcelain", "--untracked-files=no"])
                .is_some_and(|s| !s.is_empty());
            if dirty { format!("{c}-dirty") } else { c }
        }
        _ => "unknown".to_string(),
    };
    println!("cargo:rustc-env=SERVELAB_GIT_COMMIT={commit}");
    // Rebuild when the commit moves (HEAD, the branch's ref, packed refs) or when tracked files
    // change (the index, and the workspace's sources, for the -dirty mark).
    let abs = |p: String| {
        let p = PathBuf::from(p);
        if p.is_absolute() { p } else { dir.join(p) }
    };
    if let Some(gd) = git(&dir, &["rev-parse", "--git-dir"]).map(abs) {
        rerun_if_exists(&gd.join("HEAD"));
        rerun_if_exists(&gd.join("index"));
    }
    if let Some(cd) = git(&dir, &["rev-parse", "--git-common-dir"]).map(abs) {
        rerun_if_exists(&cd.join("packed-refs"));
        if let Some(r) = git(&dir, &["symbolic-ref", "-q", "HEAD"]) {
            rerun_if_exists(&cd.join(r));
        }
    }
    if let Some(root) = dir.parent() {
        for member in [
            "core",
            "sim",
            "hw",
            "kernels",
            "workloads",
            "experiments",
            "tests",
        ] {
            rerun_if_exists(&root.join(member).join("src"));
            rerun_if_exists(&root.join(member).join("Cargo.toml"));
        }
        rerun_if_exists(&root.join("Cargo.toml"));
    }
}
