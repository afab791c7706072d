#!/usr/bin/env bash
# Profile-guided build of `servelab` for long simulator runs (issue 3's speed target is measured
# on this build; `cargo build --release` gives the same outputs, a little slower).
#
# 1. builds an instrumented binary into target/pgo-gen,
# 2. trains it on workloads other than the one the speed figure is measured on (service.toml under
#    another seed, dspark.toml, cache-policy.toml),
# 3. merges the profile and builds the optimised binary into target/pgo/release/servelab.
#
# Needs the rustup component llvm-tools (installed if missing). Outputs of a PGO build are
# byte-identical to a plain release build's: PGO changes code layout and inlining, not arithmetic.
# Extra flags for both builds go in EXTRA_RUSTFLAGS (say "-Ctarget-cpu=native" for a binary that
# runs on this machine only; Rust never contracts a*b+c into an FMA, so outputs stay the same).
# The merged profile is kept in target/pgo/merged.profdata.
set -euo pipefail
cd "$(dirname "$0")/../.."

sysroot=$(rustc --print sysroot)
host=$(rustc -vV | sed -n 's/^host: //p')
profdata="$sysroot/lib/rustlib/$host/bin/llvm-profdata"
if [[ ! -x "$profdata" ]]; then
  rustup component add llvm-tools
fi

# A fixed profile path: RUSTFLAGS are part of cargo's fingerprint, so a new path each time would
# rebuild the instrumented binary from scratch.
raw=$PWD/target/pgo-gen/profraw
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

echo "== instrumented build (target/pgo-gen)"
RUSTFLAGS="-Cprofile-generate=$raw ${EXTRA_RUSTFLAGS:-}" \
  cargo build --release --target-dir target/pgo-gen -p servelab-experiments

echo "== training runs"
rm -rf "$raw"
gen=target/pgo-gen/release/servelab
# (grep, not head: the runs print more after the line, and a closed pipe would stop them.)
"$gen" run experiments/configs/service.toml --seed 1 --quiet --out "$out/service" | grep '^simulated'
"$gen" run experiments/configs/dspark.toml --quiet --out "$out/dspark" >/dev/null
"$gen" run experiments/configs/cache-policy.toml --quiet --out "$out/cache-policy" >/dev/null

mkdir -p target/pgo
"$profdata" merge -o target/pgo/merged.profdata "$raw"

echo "== optimised build (target/pgo)"
RUSTFLAGS="-Cprofile-use=$PWD/target/pgo/merged.profdata ${EXTRA_RUSTFLAGS:-}" \
  cargo build --release --target-dir target/pgo -p servelab-experiments
echo "built target/pgo/release/servelab"
