#!/usr/bin/env bash
# Simulator speed (issue 3's target: >= 100x real time on one core for service.toml).
#
# Runs experiments/configs/service.toml REPS times with each BINARY, alternating binaries so host
# drift hits them alike, pinned to one core when taskset exists, and prints one tab-separated row
# per run: binary, rep, the ratio servelab prints (simulation only), process wall/user/sys
# seconds. Then checks that every run of one binary gives byte-identical output folders
# (manifest.json aside: it names the commit and binary), and says whether the binaries agree
# with each other (they differ when a change moved results on purpose).
#
#   experiments/scripts/sim-speed.sh [-n REPS] [-c CORE] [-w] [-f CONFIG] BINARY...
#
# -w first runs the first binary once untimed (on VMs whose memory grows on first touch).
# Binaries need no toolchain: build here, copy (stripped) to another host, run this there.
set -euo pipefail
reps=3 core=0 warm=0 config=experiments/configs/service.toml
while getopts "n:c:wf:" opt; do
  case $opt in
    n) reps=$OPTARG ;;
    c) core=$OPTARG ;;
    w) warm=1 ;;
    f) config=$OPTARG ;;
    *) echo "usage: $0 [-n REPS] [-c CORE] [-w] [-f CONFIG] BINARY..." >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
if [[ $# -eq 0 ]]; then
  echo "usage: $0 [-n REPS] [-c CORE] [-w] [-f CONFIG] BINARY..." >&2
  exit 2
fi
config=$(realpath "$config")
bins=()
for b in "$@"; do
  if [[ ! -x $b ]]; then
    echo "$0: not an executable: $b" >&2
    exit 2
  fi
  bins+=("$(realpath "$b")")
done
set -- "${bins[@]}"
cd "$(dirname "$0")/../.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
pin=()
if command -v taskset >/dev/null; then pin=(taskset -c "$core"); fi

# One run: prints "ratio<TAB>wall<TAB>user<TAB>sys".
run_one() {
  local bin=$1 dir=$2 line t
  TIMEFORMAT='%R	%U	%S'
  t=$( { time "${pin[@]}" "$bin" run "$config" --quiet --out "$dir" >"$dir.stdout"; } 2>&1 )
  if ! line=$(grep -m1 '^simulated' "$dir.stdout"); then
    echo "$0: $bin printed no 'simulated' line; its output:" >&2
    tail -5 "$dir.stdout" >&2
    return 1
  fi
  # "simulated 1640 s in 33.4 s wall: 49x real time (...)"
  local ratio=${line#*wall: }
  printf '%s\t%s\n' "${ratio%%x real*}x" "$t"
}

echo "# $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), core ${core}, $(date -u +%FT%TZ)"
if [[ $warm -eq 1 ]]; then
  "${pin[@]}" "$1" run "$config" --quiet --out "$out/warm" >/dev/null
fi
printf 'binary\trep\tratio\twall_s\tuser_s\tsys_s\n'
for rep in $(seq 1 "$reps"); do
  k=0
  for bin in "$@"; do
    # Numbered, not named: two builds are often both called `servelab`.
    k=$((k + 1))
    dir="$out/binary$k-rep$rep"
    row=$(run_one "$bin" "$dir") || exit 1
    printf '%s\t%s\t%s\n' "$bin" "$rep" "$row"
  done
done
same() { diff -rq --exclude manifest.json --exclude summary.json "$1" "$2" >/dev/null; }
for k in $(seq 1 $#); do
  for rep in $(seq 2 "$reps"); do
    if ! same "$out/binary$k-rep1" "$out/binary$k-rep$rep"; then
      echo "outputs differ between runs of binary $k: not deterministic" >&2
      exit 1
    fi
  done
done
echo "# each binary's outputs byte-identical across its runs (manifest.json aside)"
for k in $(seq 2 $#); do
  if same "$out/binary1-rep1" "$out/binary$k-rep1"; then
    echo "# binary $k: outputs byte-identical to binary 1's"
  else
    echo "# binary $k: outputs differ from binary 1's (files: $(diff -rq --exclude manifest.json "$out/binary1-rep1" "$out/binary$k-rep1" | wc -l))"
  fi
done
