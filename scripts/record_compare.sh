#!/usr/bin/env bash
# `ferroprof record` against `perf record -e cpu-clock` on programs nobody here wrote, and the
# wall-time overhead of each tool against a bare run.
#
#   scripts/record_compare.sh [--memory-tools] [--size MB] [--runs N] [--rounds N] [--no-shares]
#                             [--only xz|search]
#   scripts/record_compare.sh --heap [--runs N]
#
# Workloads: `xz -9 -T1` compressing SIZE MB of text gathered from /usr/share, and ripgrep
# (`cargo install ripgrep`) with a Unicode-class regex over 20 hard-linked copies of the same
# text split into a tree of 64 KiB files; without `rg` on PATH, a recursive GNU `grep -E` with
# a back-reference over one copy.
# CPU shares: ferroprof at --hz 1000 and perf at -F 1000 -g, --runs runs each, interleaved,
# shares averaged over them (a program's shares move between runs: ripgrep's top function by
# about 5 points under perf alone); top-10 functions of perf's profile with its kernel samples
# booked to their first user frame (as ferroprof books them), each program's stripped objects
# brought to common function identities through their .eh_frame
# (scripts/record_compare_shares.py).
# Overhead: median wall time of --runs runs: bare, ferroprof record (default rates), perf
# record (default rate); with --memory-tools, heaptrack and valgrind --tool=massif too (slow).
# With --rounds N instead: N rounds of bare, ferroprof record and perf record (and the memory
# tools) one after the other, and the median of each round's difference against its bare run (a drifting host moves
# all three of a round alike). --no-shares skips the CPU shares; --only runs one workload.
# Needs: a release build (cargo build --release), linux-perf, xz-utils, python3, binutils;
# heaptrack and valgrind for --memory-tools. Timings are only meaningful on a quiet machine.
# --heap: the heap's peak and what is live at exit instead, ferroprof record (its estimated peak,
# and heap-live-size at exit; --runs runs at the default 512 KiB interval, one at 64 KiB)
# against heaptrack ("peak heap memory consumption", "total memory leaked"), on the C test
# program in its `peak` mode (64 MiB held at the peak, then 32 MiB kept to the end: it prints
# its own figures) and on Debian's python3 building a dict of a million entries, dropping it,
# then keeping 20 MB of bytes objects (PYTHONMALLOC=malloc: every object through malloc, as
# both tools see only malloc; python frees its objects before exit). Needs heaptrack and gcc.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
FERROPROF=${FERROPROF:-$ROOT/target/release/ferroprof}
SHARES="python3 $ROOT/scripts/record_compare_shares.py"
SIZE_MB=32
RUNS=3
MEMORY_TOOLS=0
HEAP=0
ROUNDS=0
SHARES_TOO=1
ONLY=
while [ $# -gt 0 ]; do
    case "$1" in
        --memory-tools) MEMORY_TOOLS=1 ;;
        --heap) HEAP=1 ;;
        --size) SIZE_MB=$2; shift ;;
        --runs) RUNS=$2; shift ;;
        --rounds) ROUNDS=$2; shift ;;
        --no-shares) SHARES_TOO=0 ;;
        --only) ONLY=$2; shift ;;
        *) sed -n '2,32p' "$0"; exit 2 ;;
    esac
    shift
done
[ -x "$FERROPROF" ] || { echo "build first: cargo build --release ($FERROPROF missing)" >&2; exit 2; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/record-compare.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"

# The heap's peak and live bytes at exit of "$@": ferroprof record's, then heaptrack's.
heap_compare() {
    local name=$1; shift
    echo
    echo "== $name: peak heap and live at exit"
    local i out peak live
    for iv in 512K 64K; do
        local n=$RUNS
        [ "$iv" = 512K ] || n=1
        for ((i = 0; i < n; i++)); do
            rm -rf fph
            out=$("$FERROPROF" record --profiles heap --alloc-interval "$iv" -o fph -- "$@" 2>/dev/null)
            peak=$(sed -n 's/^peak live heap ≈ \([^ ]*\) (\([0-9]*\) bytes.*/\2/p' <<<"$out")
            live=$(sed -n 's/.*heap-live-size (bytes), total \([^ ]*\) in.*/\1/p' <<<"$out" | head -1)
            printf '  %-34s peak %7.2f MiB (%6.2f MB)   live at exit %s\n' \
                "ferroprof record, interval $iv" "$(echo "$peak / 1048576" | bc -l)" \
                "$(echo "$peak / 1000000" | bc -l)" "${live:-0}"
            # The program's own figures (the C test program prints them).
            grep -o 'peak_bytes=[0-9]* live_bytes=[0-9]*' <<<"$out" >program.txt || true
        done
    done
    if [ -s program.txt ]; then
        read -r p l < <(sed 's/peak_bytes=\([0-9]*\) live_bytes=\([0-9]*\)/\1 \2/' program.txt)
        printf '  %-34s peak %7.2f MiB (%6.2f MB)   live at exit %.2f MiB\n' "truth (the program's count)" \
            "$(echo "$p / 1048576" | bc -l)" "$(echo "$p / 1000000" | bc -l)" "$(echo "$l / 1048576" | bc -l)"
    fi
    if command -v heaptrack >/dev/null; then
        rm -f ht.*
        heaptrack -o ht "$@" >/dev/null 2>&1 || true
        heaptrack_print ht.* 2>/dev/null | grep -E '^(peak heap memory consumption|total memory leaked):' |
            sed 's/^/  heaptrack: /'
    fi
}

if [ "$HEAP" = 1 ]; then
    gcc -O1 -g -fno-omit-frame-pointer -pthread -o fixture "$ROOT/crates/cli/tests/fixtures/record_fixture.c" -ldl
    heap_compare "C test program, peak mode" ./fixture peak 64 32
    PYTHONMALLOC=malloc heap_compare "python3: a 1M-entry dict, dropped, then 20 MB kept" \
        /usr/bin/python3 -c 'd = {i: str(i) * 8 for i in range(1_000_000)}; del d; keep = [bytes(1000) for _ in range(20_000)]'
    exit 0
fi

command -v perf >/dev/null || { echo "perf not found (Debian: apt-get install linux-perf)" >&2; exit 2; }
echo "work directory $WORK; $SIZE_MB MB of text, $RUNS runs per timing"
find /usr/share -type f \( -name '*.txt' -o -name '*.html' -o -name '*.py' -o -name '*.pm' \
    -o -name '*.h' \) 2>/dev/null | sort | xargs cat 2>/dev/null | head -c "${SIZE_MB}M" > data.txt || true
mkdir tree
split -b 64k -a 4 data.txt tree/part-

XZ=(xz -9 -T1 -k -f data.txt)
if command -v rg >/dev/null; then
    # ripgrep reads a tree at gigabytes a second: 20 hard-linked copies of the tree (no more
    # disk) and a Unicode-class pattern its literal prefilters cannot skip give it a second or
    # two of CPU on 2 cores.
    mkdir big
    for i in $(seq 1 20); do cp -al tree "big/t$i"; done
    SEARCH=(rg -c -e '\p{L}+\s+\p{L}+(ly|ing|ed)\b' big)
else
    # A back-reference: GNU grep's backtracking matcher, the CPU-heavy path of a search.
    SEARCH=(grep -r -c -E '\b([a-z]{4})[a-z]* \1' tree)
fi

now() { date +%s.%N; }
# Median wall seconds of RUNS runs of "$@" (stdout and stderr discarded).
median_time() {
    local ts=() i s e
    for ((i = 0; i < RUNS; i++)); do
        s=$(now); "$@" >/dev/null 2>&1 || true; e=$(now)
        ts+=("$(echo "$e - $s" | bc -l)")
    done
    printf '%s\n' "${ts[@]}" | sort -g | awk '{a[NR]=$1} END {printf "%.3f", a[int((NR+1)/2)]}'
}

compare_cpu() {
    local name=$1; shift
    echo
    echo "== $name: CPU shares, perf record -e cpu-clock -F 1000 vs ferroprof record --hz 1000," \
        "mean of $RUNS runs each, interleaved"
    local i
    for ((i = 1; i <= RUNS; i++)); do
        rm -rf fp && "$FERROPROF" record --hz 1000 --profiles cpu -o fp -- "$@" >/dev/null 2>&1 || true
        # The command's profile: the largest file (a shell wrapper would write a small one).
        $SHARES ferroprof "$(ls -S fp/*.pprof | head -1)" > "fp.$i.shares"
        # With call chains: a sample perf took in the kernel goes to the user code that entered
        # it (the first user frame of its chain), where ferroprof's CPU-time timer books it.
        perf record -q -g -e cpu-clock -F 1000 -o perf.data -- "$@" >/dev/null 2>&1 || true
        perf script -i perf.data -F ip,dso > perf.txt 2>/dev/null
        $SHARES perf-callers perf.txt > "perf.$i.shares"
        $SHARES perf-kernel perf.txt > "perf-kernel.$i.shares"
    done
    $SHARES mean fp.[0-9]*.shares > fp.shares
    $SHARES mean perf.[0-9]*.shares > perf.shares
    $SHARES mean perf-kernel.[0-9]*.shares > perf-kernel.shares
    $SHARES compare perf.shares fp.shares 10
    echo "  (perf's samples in the kernel, booked above to their user callers: $(awk -F'\t' '$2 == "[kernel]" {print $1}' perf-kernel.shares)%)"
    if [ "$RUNS" -gt 1 ]; then
        echo "  (perf against itself, runs 1 and 2: $($SHARES compare perf.1.shares perf.2.shares 10 | tail -1 | sed 's/.*: //'))"
    fi
}

overhead() {
    local name=$1; shift
    echo
    echo "== $name: wall time, median of $RUNS (seconds)"
    local bare fp pf
    bare=$(median_time "$@")
    fp=$(median_time "$FERROPROF" record -o fpo -- "$@")
    pf=$(median_time perf record -q -e cpu-clock -o perf-o.data -- "$@")
    printf '  %-28s %8s\n' "bare" "$bare"
    printf '  %-28s %8s  %+6.1f%%\n' "ferroprof record (defaults)" "$fp" "$(echo "($fp / $bare - 1) * 100" | bc -l)"
    printf '  %-28s %8s  %+6.1f%%\n' "perf record -e cpu-clock" "$pf" "$(echo "($pf / $bare - 1) * 100" | bc -l)"
    if [ "$MEMORY_TOOLS" = 1 ]; then
        local ht ms
        if command -v heaptrack >/dev/null; then
            ht=$(median_time heaptrack -o heaptrack.out "$@")
            printf '  %-28s %8s  %+6.1f%%\n' "heaptrack" "$ht" "$(echo "($ht / $bare - 1) * 100" | bc -l)"
        fi
        if command -v valgrind >/dev/null; then
            ms=$(median_time valgrind --tool=massif --massif-out-file=massif.out "$@")
            printf '  %-28s %8s  %+6.1f%%\n' "valgrind --tool=massif" "$ms" "$(echo "($ms / $bare - 1) * 100" | bc -l)"
        fi
    fi
}

# Wall seconds of one run of "$@" (stdout and stderr discarded).
one_time() {
    local s e
    s=$(now); "$@" >/dev/null 2>&1 || true; e=$(now)
    echo "$e - $s" | bc -l
}

# ROUNDS rounds of bare, ferroprof record and perf record (with --memory-tools, heaptrack and
# massif too), one after the other; the medians of the rounds' differences against their bare
# runs.
rounds_overhead() {
    local name=$1; shift
    local tools="ferroprof record (defaults)|perf record -e cpu-clock"
    if [ "$MEMORY_TOOLS" = 1 ]; then
        tools="$tools|heaptrack|valgrind --tool=massif"
    fi
    echo
    echo "== $name: wall time, $ROUNDS interleaved rounds (bare, ${tools//|/, })"
    local i row
    : > rounds.txt
    for ((i = 1; i <= ROUNDS; i++)); do
        row="$(one_time "$@")"
        rm -rf fpo
        row="$row $(one_time "$FERROPROF" record -o fpo -- "$@")"
        row="$row $(one_time perf record -q -e cpu-clock -o perf-o.data -- "$@")"
        if [ "$MEMORY_TOOLS" = 1 ]; then
            row="$row $(one_time heaptrack -o heaptrack.out "$@")"
            row="$row $(one_time valgrind --tool=massif --massif-out-file=massif.out "$@")"
        fi
        echo "$row" >> rounds.txt
        if [ -t 2 ]; then printf '\r  round %d of %d' "$i" "$ROUNDS" >&2; fi
    done
    if [ -t 2 ]; then printf '\r\033[K' >&2; fi
    python3 - rounds.txt "$tools" <<'PY'
import statistics as st, sys
rows = [tuple(map(float, l.split())) for l in open(sys.argv[1]) if l.strip()]
bare = st.median(r[0] for r in rows)
print(f"  {'bare, median':46} {bare:8.3f} s")
for k, tool in enumerate(sys.argv[2].split("|"), start=1):
    d = st.median(r[k] - r[0] for r in rows)
    print(f"  {tool + ', median difference':46} {d * 1000:+8.1f} ms  {100 * d / bare:+6.1f}%")
PY
}

run_xz() { [ -z "$ONLY" ] || [ "$ONLY" = xz ]; }
run_search() { [ -z "$ONLY" ] || [ "$ONLY" = search ]; }
if [ "$SHARES_TOO" = 1 ]; then
    if run_xz; then compare_cpu "xz -9" "${XZ[@]}"; fi
    if run_search; then compare_cpu "${SEARCH[0]} (recursive search)" "${SEARCH[@]}"; fi
fi
if [ "$ROUNDS" -gt 0 ]; then
    if run_xz; then rounds_overhead "xz -9" "${XZ[@]}"; fi
    if run_search; then rounds_overhead "${SEARCH[0]} (recursive search)" "${SEARCH[@]}"; fi
else
    if run_xz; then overhead "xz -9" "${XZ[@]}"; fi
    if run_search; then overhead "${SEARCH[0]} (recursive search)" "${SEARCH[@]}"; fi
fi
