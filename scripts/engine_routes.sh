#!/usr/bin/env bash
# The CPU split by route of a real service (tests/service_spans.rs: an axum service, routes with
# known CPU per request measured by the handlers' thread CPU clocks), run N times with each CPU
# engine (a debug build: its route functions are told apart by name, which inlining in release
# merges). Prints each run's worst route error in points and, per engine, the
# median and the worst over the runs.
#
#   scripts/engine_routes.sh [RUNS]      default 5 runs per engine, interleaved
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-5}
cargo test -q -p ferroprof --features tracing --test service_spans --no-run
OUT=$(mktemp -d "${TMPDIR:-/tmp}/engine-routes.XXXXXX")
trap 'rm -rf "$OUT"' EXIT
for i in $(seq 1 "$RUNS"); do
    for engine in perf timer; do
        log="$OUT/$engine.$i"
        if ! FERROPROF_CPU_ENGINE=$engine cargo test -q -p ferroprof --features tracing \
            --test service_spans -- --nocapture > "$log" 2>&1; then
            echo "run $i ($engine): the test failed (its bounds), errors below all the same" >&2
        fi
        worst=$(awk '/cpu share/ { s = $(NF - 2); sub(",", "", s); m = $NF;
                     e = (s - m) * 100; if (e < 0) e = -e; if (e > w) w = e } END { printf "%.2f", w }' "$log")
        used=$(awk -F': ' '/^cpu engine/ { print $2 }' "$log")
        echo "run $i: ${used:-?} worst route error ${worst} points"
        echo "$worst" >> "$OUT/$engine.worst"
    done
done
for engine in perf timer; do
    sort -n "$OUT/$engine.worst" | awk -v e="$engine" '{ v[NR] = $1 } END {
        printf "%s: median of worst route errors %.2f points, worst %.2f (%d runs)\n",
               e, v[int((NR + 1) / 2)], v[NR], NR }'
done
