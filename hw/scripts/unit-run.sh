#!/usr/bin/env bash
# Runs on the GPU machine from the repository root, from a bundle of hw/scripts/gpu-run.sh:
#   PART=unit bash hw/scripts/unit-run.sh BUNDLE   the handoff GPU tests, then
#        conformance-unit.toml on the virtual and the wall clock (profile h200-wide-measured),
#        then the calibration of conformance-kv.toml's model (its workload joins the fit);
#   PART=kv bash hw/scripts/unit-run.sh BUNDLE     conformance-kv.toml on both clocks with
#        the profile in $KV_PROFILE (default sim/profiles/h200-kv-measured.toml).
# Everything lands under $OUT, the records gzip-compressed, with a log per command. CFG_DIR and
# PROFILE_DIR say where the configs and profiles are (default: the repository's folders; a
# bundle staged into another checkout carries its own copies).
set -uo pipefail
b=${1:-gpu-bundle-gpu}
cfg=${CFG_DIR:-experiments/configs}
prof=${PROFILE_DIR:-sim/profiles}
out=${OUT:-gpu-out}
mkdir -p "$out"
libdirs=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [[ -d $d ]] && libdirs="$libdirs:$d"
done
for f in $(find / -xdev \( -name 'libnvrtc.so.13*' -o -name 'libcublas.so.13*' -o -name 'libcublasLt.so.13*' \) 2>/dev/null | head -20); do
  libdirs="$libdirs:$(dirname "$f")"
done
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}${libdirs}"
day=$(date -u +%F)
commit=$(cat "$b/commit" 2>/dev/null || echo unknown)
driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1)
{ echo "date: $day"; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; uname -a; } > "$out/env.txt"
status=0
timed() { # name, timeout, command...
  local name=$1 t=$2; shift 2
  local s=$(date +%s%N)
  timeout "$t" "$@" > "$out/$name.log" 2>&1 || { echo "FAILED ($?): $name" | tee -a "$out/$name.log"; status=1; }
  echo "$name: $(( ($(date +%s%N) - s) / 1000000 )) ms" | tee -a "$out/times.txt"
  tail -n 4 "$out/$name.log"
}
conf() { # name, config, profile, clock
  timed "$1" 200 "$b/servelab-gpu" conformance "$2" --profile "$3" --clock "$4" \
    --out "$out" --date "$day" --commit "$commit" --prefix "$day-nvidia-h200-$1-"
}
if [[ "${PART:-unit}" == unit ]]; then
  for t in "$b"/tests/servelab_hw*; do
    timed tests-hw 150 "$t" gpu_ --test-threads=1 --nocapture
  done
  conf unit-virtual "$cfg/conformance-unit.toml" "$prof/h200-wide-measured.toml" virtual
  conf unit-wall "$cfg/conformance-unit.toml" "$prof/h200-wide-measured.toml" wall
  timed kv-calibrate 200 "$b/servelab-gpu" calibrate --workload "$cfg/conformance-kv.toml" \
    --out "$out/h200-kv-measured.toml" --name h200-kv-measured --date "$day" --commit "$commit" --driver "$driver"
else
  p=${KV_PROFILE:-$prof/h200-kv-measured.toml}
  conf kv-virtual "$cfg/conformance-kv.toml" "$p" virtual
  conf kv-wall "$cfg/conformance-kv.toml" "$p" wall
fi
exit $status
