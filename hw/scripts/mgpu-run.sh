#!/usr/bin/env bash
# Runs on a GPU machine from the repository root: bash BUNDLE/mgpu.sh (BUNDLE built by
# hw/scripts/gpu-run.sh --debug, which copies this script in). The multi-GPU parts of issue 21:
# the placement and EP tests, the peer-copy and NCCL tests (they print that they skipped where
# the machine has fewer GPUs than they need), the handoff and routing tests, then, when the
# bundle holds a release servelab-gpu (copied in by hand), a virtual-clock conformance run of
# conformance-unit.toml with its prefill engines and decode groups on GPUs of their own.
# Results under $OUT.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
b=$(cd "$(dirname "$0")" && pwd)
export NCCL_NVLS_ENABLE=0
libdirs=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [[ -d $d ]] && libdirs="$libdirs:$d"
done
# One scan for the CUDA 13 libraries and NCCL. cudarc asks for libnccl.so (or .so.<CUDA
# major>), a pip wheel ships libnccl.so.2: it gets a link of that name.
nccl=""
while read -r f; do
  case "$f" in
    *libnccl.so.2*) [[ -z $nccl ]] && nccl=$f ;;
    *) libdirs="$libdirs:$(dirname "$f")" ;;
  esac
done < <(find / -xdev \( -name 'libnvrtc.so.13*' -o -name 'libcublas.so.13*' -o -name 'libcublasLt.so.13*' -o -name 'libnccl.so.2*' \) 2>/dev/null | head -24)
if [[ -n $nccl ]]; then
  mkdir -p "$b/lib" && ln -sf "$nccl" "$b/lib/libnccl.so" && libdirs="$libdirs:$b/lib"
fi
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}${libdirs}"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  nvidia-smi topo -m 2>&1 | head -12
  echo "nccl: ${nccl:-none}"
  echo "NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"
} > "$out/env.txt"
cat "$out/env.txt"
src=$(cat "$b/source-dir" 2>/dev/null || true)
if [[ -n $src && ! -e $src ]]; then
  mkdir -p "$(dirname "$src")" && ln -s "$PWD" "$src"
fi
: > "$out/tests.log"
for filter in placement ep:: peer:: handoff routing decode_groups_span multi_gpu ladder; do
  echo "=== servelab_hw $filter" | tee -a "$out/tests.log"
  timeout 120 "$b/tests/servelab_hw" "$filter" --test-threads=1 --nocapture >> "$out/tests.log" 2>&1 \
    || echo "FAILED: $filter" | tee -a "$out/tests.log"
done
grep -E "^test |skipped|GB/s|imbalance|ranks:|rank:|FAILED|test result" "$out/tests.log"
if [[ -x $b/servelab-gpu && "${SKIP_CONFORMANCE:-0}" != 1 ]]; then
  # The whole unit of conformance-unit.toml (2 prefill engines, 2 decode groups) on four
  # logical GPUs of its own, all on this machine's ordinal 0.
  conf=experiments/configs/conformance-unit.toml
  placed=$out/conformance-placed.toml
  { cat "$conf"; printf '\n[placement]\ngpus = 4\nordinals = [0, 0, 0, 0]\nprefill = [[0], [1]]\ndecode = [[2], [3]]\n'; } > "$placed"
  timeout "${CONFORMANCE_TIMEOUT:-110}" "$b/servelab-gpu" conformance "$placed" --clock virtual \
    --out "$out" --prefix placed- --date "$(date -u +%F)" --commit "$(cat "$b/commit")" \
    > "$out/conformance.log" 2>&1 || echo "conformance: exit $?" | tee -a "$out/conformance.log"
  tail -n 30 "$out/conformance.log"
fi
