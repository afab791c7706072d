#!/usr/bin/env bash
# Runs on the GPU machine from the repository root: bash gpu-bundle/run.sh [speed args...]
# Writes (at most 8 files, the device tool's limit) to $OUT (or ./gpu-out when unset):
# env.txt, tests.log, test-report.md, backend-check.md, h200-measured.toml, conformance-replay.md,
# speed.md and json.tgz (test-report.json, backend-check.json, h200-measured.sweep.json.gz,
# conformance-record.json.gz, speed.json, and the wall-clock conformance run:
# conformance-wall-replay.md, conformance-wall-record.json.gz).
# SKIP_TESTS=1 / SKIP_CHECK=1 / SKIP_CALIBRATE=1 / SKIP_CONFORMANCE=1 / SKIP_WALL=1 /
# SKIP_SPEED=1 skip those parts. CONFORMANCE_CONFIG=path picks the conformance config (and the
# calibration workload, whose model the calibration grid then runs on); default
# experiments/configs/conformance.toml.
set -uo pipefail
conf=${CONFORMANCE_CONFIG:-experiments/configs/conformance.toml}
out=${OUT:-gpu-out}
mkdir -p "$out"
b=$(cd "$(dirname "$0")" && pwd)
date_utc=$(date -u +%F)

# cudarc loads libcuda, libnvrtc and libcublas by name: put every CUDA 13 library folder we can
# find on the path (toolkit first, then pip-installed nvidia wheels).
libdirs=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [[ -d $d ]] && libdirs="$libdirs:$d"
done
for f in $(find / -xdev \( -name 'libnvrtc.so.13*' -o -name 'libcublas.so.13*' -o -name 'libcublasLt.so.13*' \) 2>/dev/null | head -20); do
  libdirs="$libdirs:$(dirname "$f")"
done
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}${libdirs}"

{
  echo "date: $date_utc"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,pcie.link.gen.current,pcie.link.width.current --format=csv 2>&1
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  uname -a
} > "$out/env.txt"
cat "$out/env.txt"

# Test executables read committed files under the checkout they were built in; a bundle built
# in another checkout (a worktree) finds them through a link from that path to this tree.
src=$(cat "$b/source-dir" 2>/dev/null || true)
if [[ -n $src && ! -e $src ]]; then
  mkdir -p "$(dirname "$src")" && ln -s "$PWD" "$src"
fi

status=0
: > "$out/tests.log"
for t in "$b"/tests/*; do
  [[ "${SKIP_TESTS:-0}" == 1 ]] && break
  echo "=== $(basename "$t")" | tee -a "$out/tests.log"
  if ! timeout 180 "$t" --test-threads=1 --nocapture >> "$out/tests.log" 2>&1; then
    echo "FAILED: $(basename "$t")" | tee -a "$out/tests.log"; status=1
  fi
  grep -E "^test result|skipped|FAILED" "$out/tests.log" | tail -3
done

commit=$(cat "$b/commit" 2>/dev/null || echo unknown)
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
if [[ "${SKIP_CHECK:-0}" != 1 ]]; then
  timeout 300 "$b/servelab-gpu" check --out "$out" --date "$date_utc" > /dev/null 2>&1 || status=1
  tail -n 8 "$out/test-report.md" 2>/dev/null; cat "$out/backend-check.md" 2>/dev/null
fi
# Calibrate first: conformance predicts with the profile measured here, on this build.
if [[ "${SKIP_CALIBRATE:-0}" != 1 ]]; then
  wl=(); [[ -f "$conf" ]] && wl=(--workload "$conf")
  timeout 400 "$b/servelab-gpu" calibrate --out "$out/h200-measured.toml" "${wl[@]}" \
    --date "$date_utc" --commit "$commit" --driver "$driver" > /dev/null || status=1
  grep -E "^# \|relative|^\[|^[a-z_]+ =" "$out/h200-measured.toml" 2>/dev/null
fi
if [[ "${SKIP_CONFORMANCE:-0}" != 1 && -f "$conf" ]]; then
  prof=(); [[ -f "$out/h200-measured.toml" ]] && prof=(--profile "$out/h200-measured.toml")
  # The step-time comparison on the virtual clock (time moves by the CUDA-event durations, as
  # in the calibration just before), then the same workload on the wall clock (the engine loop
  # with a device thread): its record replays exactly too, its timing carries the host's noise.
  timeout 300 "$b/servelab-gpu" conformance "$conf" "${prof[@]}" \
    --clock virtual --out "$out" --date "$date_utc" --commit "$commit" || status=1
  if [[ "${SKIP_WALL:-0}" != 1 ]]; then
    mkdir -p "$out/wall"
    timeout 300 "$b/servelab-gpu" conformance "$conf" "${prof[@]}" \
      --clock wall --out "$out/wall" --date "$date_utc" --commit "$commit" > /dev/null || status=1
    mv "$out/wall/conformance-replay.md" "$out/conformance-wall-replay.md" 2>/dev/null
    mv "$out/wall/conformance-record.json.gz" "$out/conformance-wall-record.json.gz" 2>/dev/null
    rmdir "$out/wall" 2>/dev/null
    cat "$out/conformance-wall-replay.md" 2>/dev/null
  fi
fi
if [[ "${SKIP_SPEED:-0}" != 1 ]]; then
  timeout 300 "$b/servelab-gpu" speed --out "$out" --date "$date_utc" "$@" > /dev/null || status=1
  cat "$out/speed.md" 2>/dev/null
fi
# ATTENTION_BENCH=1: the attention rows alone at full size (copy and read-only ceilings, the
# GQA tensor-core sweep, the MLA kernel at 1, 2, 4 and 6 query tokens): attention-bench.log
# and attention-bench.json.
if [[ "${ATTENTION_BENCH:-0}" == 1 ]]; then
  for t in "$b"/tests/servelab_hw*; do
    OUT="$out" timeout 400 "$t" --ignored attention_bench --nocapture --test-threads=1 2>&1 \
      | tee -a "$out/attention-bench.log" | grep -E "GB/s|panicked|test result" || status=1
  done
fi
# PREFILL_BENCH=1: the prefill rows alone at full size (GEMM ceiling, GEMMs only, the attention
# kernel's tile sweep, the whole steps, the whole fresh-prompt step per tiles; PREFILL_TILES=0
# leaves out the per-tiles steps): prefill-bench.log and prefill-bench.json.
if [[ "${PREFILL_BENCH:-0}" == 1 ]]; then
  for t in "$b"/tests/servelab_hw*; do
    OUT="$out" timeout 400 "$t" --ignored prefill_bench --nocapture --test-threads=1 2>&1 \
      | tee -a "$out/prefill-bench.log" | grep -E "TFLOP/s|panicked|test result" || status=1
  done
fi
(cd "$out" && tar czf json.tgz --remove-files $(ls *.json *.json.gz conformance-wall-replay.md 2>/dev/null) 2>/dev/null)
exit $status
