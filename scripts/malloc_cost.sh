#!/usr/bin/env bash
# Instructions per malloc+free pair, bare and through ferroprof's preload library, counted by
# valgrind --tool=callgrind (instruction counts do not depend on the machine's load, unlike
# wall time).
#
#   scripts/malloc_cost.sh [--pairs N]
#
# A small C program frees the oldest of 64 live blocks and mallocs a new one (sizes 16 to 512
# bytes, mixed) N times (default 2,000,000) in `run_pairs`; callgrind counts only inside that
# function (--toggle-collect), so start-up and exit are left out. Runs:
#   bare                 glibc's malloc and free;
#   preload, no samples  LD_PRELOAD of libferroprof_preload.so as `ferroprof record` sets it, with
#                        an allocation interval of 1 PB: every pair takes the unsampled path (the
#                        countdown, the free filter), never a sample;
#   preload, default     the default 512 KiB interval: the sampled allocations' cost (stack walk,
#                        recording, live tracking and its untracking at free) amortized in.
# CPU and wall sampling are off in the preloaded runs (FERROPROF_PROFILES=alloc,heap): with the
# profiling timers' signals, callgrind 3.19 stops on an assertion in its signal handling
# (vgCallgrind_post_signal), and the handler's instructions would be counted anyway.
# Needs: valgrind, gcc, a release build of the preload library (cargo build --release -p
# ferroprof-preload; PRELOAD=path overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PRELOAD=${PRELOAD:-$ROOT/target/release/libferroprof_preload.so}
PAIRS=2000000
while [ $# -gt 0 ]; do
    case "$1" in
        --pairs) PAIRS=$2; shift ;;
        *) sed -n '2,21p' "$0"; exit 2 ;;
    esac
    shift
done
[ -f "$PRELOAD" ] || { echo "build first: cargo build --release -p ferroprof-preload ($PRELOAD missing)" >&2; exit 2; }
command -v valgrind >/dev/null || { echo "valgrind not found" >&2; exit 2; }

WORK=$(mktemp -d "${TMPDIR:-/tmp}/malloc-cost.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
cat > "$WORK/pairs.c" <<'EOF'
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define LIVE 64

static void *slots[LIVE];

/* One malloc and one free per iteration; returns a checksum so nothing is optimized out. */
__attribute__((noinline)) static uint64_t run_pairs(uint64_t n) {
    uint64_t x = 0x9e3779b97f4a7c15ull, sum = 0;
    for (uint64_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        size_t size = 16 + (x % 497);
        unsigned k = i % LIVE;
        free(slots[k]);
        char *p = malloc(size);
        if (!p) abort();
        p[0] = (char)i;
        sum += (uintptr_t)p & 0xff;
        slots[k] = p;
    }
    return sum;
}

int main(int argc, char **argv) {
    uint64_t n = argc > 1 ? strtoull(argv[1], NULL, 10) : 1000000;
    /* The first LIVE frees are of NULL: fill the slots outside the counted function. */
    for (unsigned k = 0; k < LIVE; k++) slots[k] = malloc(16);
    printf("%llu\n", (unsigned long long)run_pairs(n));
    for (unsigned k = 0; k < LIVE; k++) free(slots[k]);
    return 0;
}
EOF
gcc -O2 -g -o "$WORK/pairs" "$WORK/pairs.c"

# Instructions counted inside run_pairs.
count() {
    local out=$WORK/cg.out
    rm -f "$out"
    env "$@" valgrind --tool=callgrind --toggle-collect=run_pairs --callgrind-out-file="$out" \
        "$WORK/pairs" "$PAIRS" >/dev/null 2>"$WORK/valgrind.err" || {
        cat "$WORK/valgrind.err" >&2
        exit 1
    }
    awk '/^summary:/ {print $2}' "$out"
}

common=(LD_PRELOAD="$PRELOAD" FERROPROF_OUTPUT_DIR="$WORK/profiles" FERROPROF_PROFILES=alloc,heap)
bare=$(count)
unsampled=$(count "${common[@]}" FERROPROF_ALLOC_INTERVAL=1000000000000000)
sampled=$(count "${common[@]}")
per() { echo "scale=1; ($1) / $PAIRS" | bc; }
echo "instructions per malloc+free pair ($PAIRS pairs, sizes 16-512 bytes, callgrind):"
printf '  %-46s %8s\n' "bare (glibc)" "$(per "$bare")"
printf '  %-46s %8s  %+7s\n' "preload, unsampled path only (interval 1 PB)" "$(per "$unsampled")" \
    "$(per "$unsampled - $bare")"
printf '  %-46s %8s  %+7s\n' "preload, default interval (512 KiB)" "$(per "$sampled")" \
    "$(per "$sampled - $bare")"
echo "  (last column: the difference from bare)"
