#!/usr/bin/env bash
# `ferroprof record -p` against `perf record -p` on running programs nobody here wrote.
#
#   scripts/attach_compare.sh [--size MB] [--rounds N] [--seconds S]
#
# Workloads: `xz -9 -T1` compressing SIZE MB (default 48) of text gathered from /usr/share, and
# ripgrep (`cargo install ripgrep`; one thread printing every match of `\b\w+ing\b` over 200
# hard-linked copies of that text split into 64 KiB files), or without `rg` on PATH a
# recursive GNU `grep -E` with a back-reference over one copy.
# Shares: each workload started, then ferroprof (at 1000 Hz) and perf (-F 1000 -g) attached to
# the same process at the same time for S seconds (default 10): the same window of its run
# (a program's mix of functions moves along its run, xz's with its input); top-10
# functions of perf's profile with its kernel samples booked to their first user frame, both
# brought to common function identities (scripts/record_compare_shares.py).
# Overhead: N rounds (default 5) of the xz run bare, with ferroprof attached at 100 Hz for its
# whole run, and with perf record -p (-F 100 -g) attached likewise; each round's wall times
# against its bare run, medians over the rounds. Needs a release build, linux-perf, xz-utils,
# python3. Timings are only meaningful on a quiet machine.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
FERROPROF=${FERROPROF:-$ROOT/target/release/ferroprof}
SHARES="python3 $ROOT/scripts/record_compare_shares.py"
SIZE_MB=48
ROUNDS=5
SECONDS_ATTACHED=10
while [ $# -gt 0 ]; do
    case $1 in
        --size) SIZE_MB=$2; shift ;;
        --rounds) ROUNDS=$2; shift ;;
        --seconds) SECONDS_ATTACHED=$2; shift ;;
        *) echo "unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
[ -x "$FERROPROF" ] || { echo "build first: cargo build --release" >&2; exit 1; }
WORK=$(mktemp -d)
trap 'pkill -P $$ 2>/dev/null || true; rm -rf "$WORK"' EXIT
cd "$WORK"
find /usr/share -name '*.txt' -o -name '*.html' -o -name 'README*' 2>/dev/null | head -4000 |
    xargs cat 2>/dev/null | head -c $((SIZE_MB << 20)) > input.txt || true
while [ "$(stat -c %s input.txt)" -lt $((SIZE_MB << 20)) ]; do cat input.txt input.txt | head -c $((SIZE_MB << 20)) > more && mv more input.txt; done
mkdir -p tree/c0
(cd tree/c0 && split -b 64k ../../input.txt part.)
if command -v rg > /dev/null; then
    # ripgrep is fast: one thread, every match printed, over 200 hard-linked copies of the
    # tree (the page cache holds one) makes a search that outlasts the attach.
    for i in $(seq 1 199); do cp -al tree/c0 "tree/c$i"; done
    SEARCH=(rg -j1 -o '\b\w+ing\b' tree)
else
    SEARCH=(grep -rcE '([a-z]{3}).*\1[0-9]' tree/c0)
fi

shares() { # NAME CMD...: runs CMD in a loop, attaches both tools to one run for S seconds
    local name=$1; shift
    ( while :; do "$@" > /dev/null 2>&1 || true; done ) &
    local loop=$!
    sleep 1
    local pid
    pid=$(pgrep -n -P $loop || true)
    perf record -q -F 1000 -g -p "$pid" -o "perf-$name.data" -- sleep "$SECONDS_ATTACHED" > /dev/null 2>&1 &
    local perf_pid=$!
    "$FERROPROF" record -p "$pid" --hz 1000 --duration "$SECONDS_ATTACHED" -o "fp-$name" > /dev/null 2>&1 || true
    wait $perf_pid || true
    kill $loop 2>/dev/null || true
    pkill -P $loop 2>/dev/null || true
    wait $loop 2>/dev/null || true
    perf script -i "perf-$name.data" -F ip,dso > "perf-$name.txt" 2>/dev/null
    $SHARES ferroprof "$(ls -S fp-$name/*.pprof | head -1)" > "fp-$name.shares"
    $SHARES perf-callers "perf-$name.txt" > "perf-$name.shares"
    echo "== $name: top-10 of perf record -p (kernel samples to their first user frame) against ferroprof record -p"
    $SHARES compare "perf-$name.shares" "fp-$name.shares" 10
}

echo "input: $SIZE_MB MB; attached $SECONDS_ATTACHED s per tool"
# One xz run over the input outlasts the attach (the loop restarts it when it ends).
shares xz xz -9 -T1 -c input.txt
shares search "${SEARCH[@]}"

run_attached() { # TOOL: the xz run's wall seconds with TOOL attached for its whole run
    local start end pid
    start=$(date +%s.%N)
    xz -9 -T1 -c input.txt > /dev/null &
    pid=$!
    case $1 in
        bare) ;;
        ferroprof) "$FERROPROF" record -p $pid -o fp-overhead > /dev/null 2>&1 & ;;
        perf) perf record -q -F 100 -g -p $pid -o overhead.data > /dev/null 2>&1 & ;;
    esac
    wait $pid
    end=$(date +%s.%N)
    wait 2>/dev/null || true
    python3 -c "print($end - $start)"
}
: > rounds.txt
for r in $(seq 1 "$ROUNDS"); do
    b=$(run_attached bare); f=$(run_attached ferroprof); p=$(run_attached perf)
    echo "$b $f $p" >> rounds.txt
    echo "round $r: bare ${b}s, ferroprof attached ${f}s, perf attached ${p}s"
done
python3 - rounds.txt <<'PY'
import statistics, sys
rows = [list(map(float, l.split())) for l in open(sys.argv[1]) if l.strip()]
med = lambda xs: statistics.median(xs)
b = med([r[0] for r in rows])
f = med([r[1] / r[0] - 1 for r in rows])
p = med([r[2] / r[0] - 1 for r in rows])
print(f"xz slowdown while attached at 100 Hz (median of {len(rows)} rounds, bare {b:.2f} s): "
      f"ferroprof {f:+.1%}, perf record {p:+.1%}")
PY
