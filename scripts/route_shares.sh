#!/usr/bin/env bash
# The CPU split by route of an axum service (examples/route_shares.rs: six routes, one doing
# 0.2 ms of work after a 5 ms timer wait) against the handlers' own thread CPU clocks, RUNS
# runs of SECS seconds per CPU engine, interleaved; a release build at
# `debug = "line-tables-only"`, as services are built. Prints each run's worst route error in
# points and, per engine, the median, the worst, and the runs within 3 points.
#
#   scripts/route_shares.sh [RUNS] [SECS] [HZ]   default 20 runs of 20 s per engine, 100 Hz
#   ENGINES="perf" to run one engine only; VERBOSE=1 to print every route of every run;
#   FERROPROF_ROUTE_SPIN=N for N work steps between the handlers' CPU clock reads (default
#   20000, about 25 us; 200 puts a fifth of their CPU in those system calls)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-20}
SECS=${2:-20}
HZ=${3:-100}
ENGINES=${ENGINES:-perf timer}
CARGO_PROFILE_RELEASE_DEBUG=line-tables-only \
    cargo build -q --release -p ferroprof --features tracing --example route_shares
OUT=$(mktemp -d "${TMPDIR:-/tmp}/route-shares.XXXXXX")
trap 'rm -rf "$OUT"' EXIT
for i in $(seq 1 "$RUNS"); do
    for engine in $ENGINES; do
        log="$OUT/$engine.$i"
        FERROPROF_CPU_ENGINE=$engine target/release/examples/route_shares "$SECS" "$HZ" > "$log"
        worst=$(sed -n 's/^RESULT .*worst_points=//p' "$log")
        echo "run $i $engine: worst route error $worst points ($(head -1 "$log"))"
        [ -n "${VERBOSE:-}" ] && sed '1d;$d' "$log"
        echo "$worst" >> "$OUT/$engine.worst"
    done
done
for engine in $ENGINES; do
    sort -n "$OUT/$engine.worst" | awk -v e="$engine" '{ v[NR] = $1; if ($1 <= 3) ok++ } END {
        printf "%s: worst route error per run, median %.2f points, worst %.2f; %d of %d runs within 3 points\n",
               e, v[int((NR + 1) / 2)], v[NR], ok, NR }'
done
