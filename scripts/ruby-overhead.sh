#!/usr/bin/env bash
# Overhead of Ferroprof.start on two Ruby benchmarks (bindings/ruby/bench/workload.rb: a
# CPU-heavy and an allocation-heavy one), side by side with stackprof (Debian ruby-stackprof)
# in one run: the runs are interleaved, ROUNDS of each; prints each profiler's median and its
# ratio to the bare run.
#   scripts/ruby-overhead.sh [ROUNDS]     (default 7)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-7}"
scripts/ruby-binding.sh build >/dev/null
ruby -e 'require "stackprof"' 2>/dev/null || { echo "stackprof missing: apt-get install ruby-stackprof" >&2; exit 1; }
cd bindings/ruby
modes=(none ferroprof ferroprof-duty1 stackprof-cpu stackprof-object)
declare -A times
for kind in cpu alloc; do
    for ((r = 0; r < rounds; r++)); do
        for m in "${modes[@]}"; do
            case "$m" in
                ferroprof-duty1) t=$(FERROPROF_ALLOC_DUTY=1 ruby bench/workload.rb "$kind" ferroprof) ;;
                *) t=$(ruby bench/workload.rb "$kind" "$m") ;;
            esac
            times[$kind.$m]+="$t "
        done
        printf '.' >&2
    done
done
echo >&2
printf '%-6s %-18s %10s %8s\n' bench profiler "median s" ratio
for kind in cpu alloc; do
    base=$(echo ${times[$kind.none]} | tr ' ' '\n' | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
    for m in "${modes[@]}"; do
        med=$(echo ${times[$kind.$m]} | tr ' ' '\n' | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
        awk -v k="$kind" -v m="$m" -v t="$med" -v b="$base" 'BEGIN { printf "%-6s %-18s %10.3f %7.1f%%\n", k, m, t, (t / b - 1) * 100 }'
    done
done
