#!/usr/bin/env bash
# Runs on the GPU machine from the repository root: bash gpu-bundle/run.sh [speed args...]
# Writes (at most 8 files, the device tool's limit) to $OUT (or ./gpu-out when unset):
# env.txt, tests.log, test-report.md, speed.md, backend-check.md, h200-measured.toml and
# json.tgz (test-report.json, speed.json, backend-check.json, h200-measured.sweep.json).
# SKIP_SPEED=1 / SKIP_CALIBRATE=1 / SKIP_CHECK=1 skip those parts.
set -uo pipefail
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

status=0
: > "$out/tests.log"
for t in "$b"/tests/*; do
  echo "=== $(basename "$t")" | tee -a "$out/tests.log"
  if ! timeout 180 "$t" --test-threads=1 --nocapture >> "$out/tests.log" 2>&1; then
    echo "FAILED: $(basename "$t")" | tee -a "$out/tests.log"; status=1
  fi
  grep -E "^test result|skipped|FAILED" "$out/tests.log" | tail -3
done

timeout 180 "$b/servelab-gpu" test-report --out "$out" --date "$date_utc" > /dev/null 2>&1 || status=1
tail -n 40 "$out/test-report.md" 2>/dev/null
if [[ "${SKIP_SPEED:-0}" != 1 ]]; then
  timeout 300 "$b/servelab-gpu" speed --out "$out" --date "$date_utc" "$@" > /dev/null || status=1
  cat "$out/speed.md" 2>/dev/null
fi
commit=$(cat "$b/commit" 2>/dev/null || echo unknown)
if [[ "${SKIP_CHECK:-0}" != 1 ]]; then
  timeout 300 "$b/servelab-gpu" backend-check --out "$out" || status=1
fi
if [[ "${SKIP_CALIBRATE:-0}" != 1 ]]; then
  timeout 400 "$b/servelab-gpu" calibrate --out "$out/h200-measured.toml" \
    --date "$date_utc" --commit "$commit" \
    --driver "$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)" \
    > /dev/null || status=1
fi
(cd "$out" && tar czf json.tgz --remove-files $(ls *.json 2>/dev/null) 2>/dev/null)
exit $status
