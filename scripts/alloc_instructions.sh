#!/usr/bin/env bash
# Instructions per allocation+free pair of the Rust allocation workload, on the System allocator
# and on jemalloc, bare and under ferroprof's SamplingAllocator, counted by valgrind
# --tool=callgrind (instruction counts do not depend on the machine's load, unlike wall time).
#
#   scripts/alloc_instructions.sh [--ops N]
#
# The workload is ferroprof_bench::alloc_workload: 2 threads, each running alloc_thread, which
# keeps 4,096 live blocks and replaces a random one per operation with a new zeroed block of
# 16..=1040 bytes (vec![0u8; n]: alloc_zeroed, i.e. calloc on System, then the old block's free).
# N operations per thread (default 300,000), so N x 2 pairs; callgrind counts only inside
# alloc_thread (--toggle-collect), so start-up, the profiler's start and stop and exit are left
# out (the workload's own loop, ~30 instructions a pair, is in every row and cancels out in the
# difference column). Runs, in one go:
#   System                       examples/alloc_system: std::alloc::System (glibc);
#   ferroprof(System), 512 KiB   examples/alloc_ferroprof, the default interval, allocation and
#                                heap profiling on: the sampled allocations' cost (stack walk,
#                                recording, live tracking and its untracking at free) amortized;
#   ferroprof(System), 1 PB      the same with FERROPROF_BENCH_INTERVAL=2^50: the unsampled path
#                                only (the countdown, the free filter);
#   jemalloc                     examples/alloc_jemalloc, jemalloc's own profiler off;
#   ferroprof(jemalloc), 512 KiB examples/alloc_jemalloc_ferroprof: SamplingAllocator<Jemalloc>;
#   libdd heap allocator         only if libdd-profiling-heap-allocator is in Cargo.lock (it is
#                                not today: the row says why it was not built).
# The difference column is against the row's base allocator (System or jemalloc). Then the
# instructions inside memset (callgrind_annotate --inclusive=no, self cost) for System and
# ferroprof(System) at 512 KiB, split by caller (calloc or elsewhere), so a calloc that zeroes
# twice, or a buffer zeroed per sample, shows. Last, the cache lines one sample misses in the
# profiler's code (scripts/cache_lines.py over the System rows, run with callgrind's cache
# simulation): the instruction count leaves out what makes a sample dear, the cold lines it
# touches, and unlike a timed run this count does not move with the load.
# CPU and wall profiling are off in these programs (start_alloc_profiler): with the profiling
# timers' signals callgrind 3.19 stops on an assertion (see scripts/malloc_cost.sh).
# Needs: valgrind (callgrind, callgrind_annotate), cargo, python3; builds the examples in release.
# Takes some 40 seconds once built at the default 300,000 ops (callgrind runs ~50x slower).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OPS=300000
while [ $# -gt 0 ]; do
    case "$1" in
        --ops) OPS=$2; shift ;;
        *) sed -n '2,35p' "$0"; exit 2 ;;
    esac
    shift
done
command -v valgrind >/dev/null || { echo "valgrind not found (install valgrind: this script counts instructions with callgrind)" >&2; exit 2; }
command -v callgrind_annotate >/dev/null || { echo "callgrind_annotate not found (it comes with valgrind)" >&2; exit 2; }

cargo build --release -p ferroprof-bench --examples >&2
EXAMPLES=${CARGO_TARGET_DIR:-$ROOT/target}/release/examples
PAIRS=$((OPS * 2))
SEMI_INFINITE=1125899906842624 # 1 PB: never reached, so never a sample

WORK=$(mktemp -d "${TMPDIR:-/tmp}/alloc-instructions.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# count NAME EXAMPLE [VAR=value...]: callgrind over EXAMPLE (environment VAR=value...), the
# output kept as $WORK/NAME.out, the program's RESULT line as $WORK/NAME.result; prints Ir.
count() {
    local name=$1 example=$2
    shift 2
    echo "callgrind: $name" >&2
    env "$@" valgrind --tool=callgrind --toggle-collect='ferroprof_bench::alloc_thread*' $CACHE_SIM \
        --callgrind-out-file="$WORK/$name.out" "$EXAMPLES/$example" "$OPS" \
        >"$WORK/$name.result" 2>"$WORK/$name.err" || {
        cat "$WORK/$name.err" >&2
        exit 1
    }
    local ir
    ir=$(awk '/^summary:/ {print $2}' "$WORK/$name.out")
    [ -n "$ir" ] && [ "$ir" -gt 0 ] || {
        echo "no instructions counted in alloc_thread for $name (toggle-collect pattern missed?)" >&2
        exit 1
    }
    echo "$ir"
}

# Self instructions in memset-named functions, by caller: lines "IR<TAB>caller (Nx)" from
# callgrind_annotate's caller tree (each caller's share of memset's self cost).
memset_callers() {
    callgrind_annotate --inclusive=no --threshold=100 --auto=no --tree=caller "$WORK/$1.out" \
        2>/dev/null | awk '
        /^ *$/ {n = 0; next}
        / < / {c[n++] = $0; next}
        / \* / && /memset/ {
            for (i = 0; i < n; i++) {
                v = c[i]; sub(/^ */, "", v); sub(/ .*/, "", v); gsub(",", "", v)
                who = c[i]; sub(/.*< /, "", who); sub(/ \[.*/, "", who); sub(/^[^:]*:/, "", who)
                print v "\t" who
            }
        }
        {n = 0}'
}

samples() { sed -n 's/.*samples=\([0-9]*\).*/\1/p' "$WORK/$1.result"; }

# The System rows also simulate the caches (instruction counts are the same with it): a
# first level of 32 KiB and a last level of 512 KiB, 8-way, 64-byte lines (an AMD EPYC core's
# L1d and L2), for the cache lines a sample misses (see cache_lines.py).
CACHE_SIM="--cache-sim=yes --D1=32768,8,64 --LL=524288,8,64"
system=$(count system alloc_system)
fp_system=$(count fp_system alloc_ferroprof)
fp_system_pb=$(count fp_system_pb alloc_ferroprof FERROPROF_BENCH_INTERVAL=$SEMI_INFINITE)
CACHE_SIM=""
jemalloc=$(count jemalloc alloc_jemalloc)
fp_jemalloc=$(count fp_jemalloc alloc_jemalloc_ferroprof)

libdd_reason=""
if ! grep -q '^name = "libdd-profiling-heap-allocator"' Cargo.lock; then
    libdd_reason="libdd-profiling-heap-allocator is not in Cargo.lock (and is not fetched offline)"
fi

millions() { awk -v x="$1" 'BEGIN {printf "%.1f", x / 1e6}'; }
per() { awk -v x="$1" -v n="$PAIRS" 'BEGIN {printf "%.1f", x / n}'; }
diff_per() { awk -v x="$1" -v b="$2" -v n="$PAIRS" 'BEGIN {printf "%+.1f", (x - b) / n}'; }
row() { # row LABEL IR BASE_IR (BASE_IR empty: the base itself)
    local d="(base)"
    [ -n "$3" ] && d=$(diff_per "$2" "$3")
    printf '| %s | %s | %s | %s |\n' "$1" "$(millions "$2")" "$(per "$2")" "$d"
}

echo
echo "Instructions in ferroprof_bench::alloc_thread, $OPS ops x 2 threads = $PAIRS alloc+free pairs"
echo "(zeroed blocks of 16..=1040 bytes, 4,096 live per thread; callgrind, valgrind $(valgrind --version | sed 's/valgrind-//')):"
echo
echo "| variant | instructions (M) | per alloc+free pair | difference per pair vs base |"
echo "|---|---:|---:|---:|"
row "System" "$system" ""
row "ferroprof(System), 512 KiB, alloc+heap" "$fp_system" "$system"
row "ferroprof(System), 1 PB (unsampled path only)" "$fp_system_pb" "$system"
row "jemalloc (its profiler off)" "$jemalloc" ""
row "ferroprof(jemalloc), 512 KiB, alloc+heap" "$fp_jemalloc" "$jemalloc"
if [ -n "$libdd_reason" ]; then
    echo "| libdd heap allocator | not built: $libdd_reason | | |"
fi
echo
echo "Allocation samples taken (whole run, both threads): ferroprof(System) 512 KiB $(samples fp_system)," \
    "1 PB $(samples fp_system_pb), ferroprof(jemalloc) 512 KiB $(samples fp_jemalloc)."
echo
echo "Self instructions in memset (callgrind_annotate --inclusive=no), by caller:"
echo
echo "| variant | memset (M) | per pair | from calloc, per pair | from elsewhere, per pair | elsewhere: largest caller |"
echo "|---|---:|---:|---:|---:|---|"
for v in system fp_system; do
    memset_callers "$v" >"$WORK/$v.memset"
    total=$(awk -F'\t' '{s += $1} END {print s + 0}' "$WORK/$v.memset")
    calloc=$(awk -F'\t' '$2 ~ /^calloc / {s += $1} END {print s + 0}' "$WORK/$v.memset")
    other=$(awk -F'\t' '$2 !~ /^calloc / && $1 > m {m = $1; w = $2} END {print w}' "$WORK/$v.memset")
    label="System"
    [ "$v" = fp_system ] && label="ferroprof(System), 512 KiB"
    printf '| %s | %s | %s | %s | %s | %s |\n' "$label" "$(millions "$total")" "$(per "$total")" \
        "$(per "$calloc")" "$(per "$((total - calloc))")" "${other:-none}"
done
echo
echo "Cache lines one sample misses in the profiler's code (callgrind's cache simulation;"
echo "ferroprof(System) 512 KiB against 1 PB, divided by its samples):"
echo
python3 "$ROOT/scripts/cache_lines.py" "$WORK/system.out" "$WORK/fp_system_pb.out" \
    "$WORK/fp_system.out" "$(samples fp_system)"
