#!/usr/bin/env bash
# Builds the GPU test executables and the servelab-gpu binary on this machine (no GPU or CUDA
# toolkit needed) and stages them, with a device-side runner, in the git-ignored gpu-bundle/.
# The device machine (x86-64, CUDA 13 driver, no Rust toolchain) then runs
#     bash gpu-bundle/run.sh            # tests + test-report + speed, results under $OUT
# e.g. through the device tool: run(command="bash gpu-bundle/run.sh", carry=["gpu-bundle"]).
# Usage: hw/scripts/gpu-run.sh [--debug] [--bin-only]
#   BUNDLE=gpu-bundle-hw hw/scripts/gpu-run.sh --bin-only   (another staging folder, each
#   worktree its own; --bin-only: servelab-gpu alone, no test executables)
# servelab-gpu writes conformance records; the comparison with the simulator runs here
# (`servelab hw conformance CONFIG --record R`), as servelab-hw does not link the simulator.
set -euo pipefail
cd "$(dirname "$0")/../.."
profile=(--release)
bin_only=0
for a in "$@"; do
  case "$a" in
    --debug) profile=() ;;
    --bin-only) bin_only=1 ;;
  esac
done

bundle=${BUNDLE:-gpu-bundle}
rm -rf "$bundle"
mkdir -p "$bundle/tests"

[[ $bin_only -eq 1 ]] || { echo "building test executables..." >&2; cargo test "${profile[@]}" -p servelab-kernels -p servelab-hw --no-run --message-format=json 2>/dev/null \
  | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m.get("profile", {}).get("test"):
        print(m["target"]["name"] + "\t" + m["executable"])
' | while IFS=$'\t' read -r name exe; do
    cp "$exe" "$bundle/tests/$name"
  done; }
echo "building servelab-gpu..." >&2
cargo build "${profile[@]}" -p servelab-hw --bin servelab-gpu
target=${CARGO_TARGET_DIR:-target}
dir=$target/release; [[ ${#profile[@]} -eq 0 ]] && dir=$target/debug
cp "$dir/servelab-gpu" "$bundle/"
# Debug info is not needed on the device and would eat the 64 MiB transfer limit.
# (A --bin-only bundle has no test executables, and the glob then names no file.)
if command -v strip >/dev/null; then
  strip --strip-debug "$bundle"/servelab-gpu
  for t in "$bundle"/tests/*; do [[ -f $t ]] && strip --strip-debug "$t"; done
fi
cp hw/scripts/device-run.sh "$bundle/run.sh"
cp hw/scripts/decode-bench.sh "$bundle/decode-bench.sh"
cp hw/scripts/mgpu-run.sh "$bundle/mgpu.sh"
# The commit the binaries were built from ("-dirty" when the tree had changes), for profiles.
c=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD -- 2>/dev/null || c="$c-dirty"
echo "$c" > "$bundle/commit"
# The checkout the tests were compiled in: they read committed files (records, profiles) at
# that path (CARGO_MANIFEST_DIR), which run.sh links to the device's copy of the tree.
pwd > "$bundle/source-dir"
ls -la "$bundle" "$bundle/tests" >&2
du -sh "$bundle" >&2
