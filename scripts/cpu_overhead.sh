#!/usr/bin/env bash
# CPU profiling at 100 Hz next to pprof-rs, in the same run: `scripts/cpu_overhead.sh [ROUNDS]
# [BUSY]`. Each round runs cpu_workload (2 CPU-bound threads, ~44-frame stacks) unprofiled,
# under ferroprof (CPU and wall) and under pprof-rs, in a shuffled order; BUSY background
# spinners load the machine meanwhile (default 0). Prints, per profiler, the median process CPU
# against the unprofiled run of the same round and the median signal handler time per sample.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-7}
busy=${2:-0}
cargo build --release -q -p ferroprof-bench --example cpu_workload
bin=target/release/examples/cpu_workload
work=${FERROPROF_CPU_OVERHEAD_WORK:-40000}
out=$(mktemp)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -f "$out"; }
trap cleanup EXIT
for _ in $(seq 1 "$busy"); do
    (while :; do :; done) &
    pids+=($!)
done
for r in $(seq 1 "$rounds"); do
    for mode in $(printf 'none\nferroprof\npprof\n' | shuf); do
        echo "round $r $mode $("$bin" "$mode" "$work" | grep '^RESULT')" | tee -a "$out" >&2
    done
done
python3 - "$out" "$busy" <<'EOF'
import re, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    m = re.match(r"round (\d+) (\w+) RESULT (.*)", line)
    if m:
        kv = dict(p.split("=", 1) for p in m.group(3).split())
        rows.setdefault(int(m.group(1)), {})[m.group(2)] = {k: float(v) for k, v in kv.items()}
def med(xs):
    return statistics.median(xs) if xs else float("nan")
print(f"\n{len(rows)} rounds, {sys.argv[2]} busy loops beside")
print("| | ferroprof | pprof-rs |")
print("|---|---|---|")
over = {m: [100 * (r[m]["cpu_ns"] / r["none"]["cpu_ns"] - 1) for r in rows.values()] for m in ("ferroprof", "pprof")}
print(f"| process CPU against unprofiled, median | {med(over['ferroprof']):+.2f}% | {med(over['pprof']):+.2f}% |")
fm = [r["ferroprof"]["handler_median_ns"] / 1e3 for r in rows.values()]
fa = [r["ferroprof"]["handler_ns"] / 1e3 for r in rows.values()]
pa = [r["pprof"]["handler_ns"] / 1e3 for r in rows.values()]
print(f"| signal handler per sample, median of runs' medians (means) | {med(fm):.2f} µs ({med(fa):.2f} µs) | ({med(pa):.2f} µs, mean) |")
fr = [r["ferroprof"]["frames"] for r in rows.values()]
print(f"| frames per CPU sample | {med(fr):.0f} | |")
EOF
