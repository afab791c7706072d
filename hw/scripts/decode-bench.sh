#!/usr/bin/env bash
# Runs on the GPU machine from the repository root: bash gpu-bundle/decode-bench.sh (gpu-run.sh
# stages it). Writes to $OUT (or ./gpu-out): env.txt; tests.log when TESTS lists test
# executables of the bundle as EXE:FILTER (FILTER ALL: every test), e.g.
# TESTS="servelab_kernels:ALL servelab_hw:gpu_device_bound"; then the decode-step sweep of
# `servelab_hw --ignored decode_step_bench` (bench.log, decode-steps.json, decode-steps.md;
# BENCH=0 skips it) and with DRAFTS2=1 the same with two verified drafts per sequence under
# d2/. The sweep's DECODE_BENCH_* variables pass through (see hw/src/speed/decode_step.rs).
set -uo pipefail
out=${OUT:-gpu-out}; mkdir -p "$out"
b=$(cd "$(dirname "$0")" && pwd)
libdirs=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do [[ -d $d ]] && libdirs="$libdirs:$d"; done
for f in $(find / -xdev \( -name 'libnvrtc.so.13*' -o -name 'libcublas.so.13*' -o -name 'libcublasLt.so.13*' \) 2>/dev/null | head -20); do libdirs="$libdirs:$(dirname "$f")"; done
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}${libdirs}"
src=$(cat "$b/source-dir" 2>/dev/null || true)
if [[ -n $src && ! -e $src ]]; then mkdir -p "$(dirname "$src")" && ln -s "$PWD" "$src"; fi
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv; nproc; uname -a; cat "$b/commit"; } > "$out/env.txt" 2>&1
cat "$out/env.txt"
for spec in ${TESTS:-}; do
  exe=${spec%%:*}; filt=${spec#*:}; [[ $filt == ALL ]] && filt=""
  echo "=== $exe $filt" | tee -a "$out/tests.log"
  timeout ${TEST_TIMEOUT:-240} "$b/tests/$exe" $filt --test-threads=1 --nocapture >> "$out/tests.log" 2>&1 || echo "FAILED: $exe" | tee -a "$out/tests.log"
  grep -E "^test result|FAILED|panicked" "$out/tests.log" | tail -4
done
if [[ "${BENCH:-1}" == 1 ]]; then
  OUT="$out" timeout ${BENCH_TIMEOUT:-400} "$b/tests/servelab_hw" --ignored decode_step_bench --nocapture --test-threads=1 > "$out/bench.log" 2>&1
  grep -E "^\|" "$out/bench.log"; tail -2 "$out/bench.log"
fi
if [[ "${DRAFTS2:-0}" == 1 ]]; then
  mkdir -p "$out/d2"
  DECODE_BENCH_DRAFTS=2 OUT="$out/d2" timeout ${BENCH_TIMEOUT:-400} "$b/tests/servelab_hw" --ignored decode_step_bench --nocapture --test-threads=1 > "$out/d2/bench.log" 2>&1
  grep -E "^\|" "$out/d2/bench.log"; tail -2 "$out/d2/bench.log"
fi
