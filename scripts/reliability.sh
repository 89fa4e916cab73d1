#!/usr/bin/env bash
# Reliability runs (issue 6): the profiler lives inside other people's processes and must never
# crash, hang or corrupt them. Long versions by default; `ci` runs the short ones that
# `cargo test` does not already cover (scripts/test.sh calls it).
#
#   scripts/reliability.sh loom                 loom model of the two-slot protocol
#   scripts/reliability.sh conservation [secs]  4 samplers vs a serializer flipping every ms (30)
#   scripts/reliability.sh fuzz [secs]          each cargo-fuzz target for secs seconds (300)
#   scripts/reliability.sh soak [cycles]        serialize cycles with churning content (10000)
#   scripts/reliability.sh signals [secs] [forks]  1 kHz CPU + allocation on 8 threads (60 s),
#                                               stray SIGPROF, forks under load (50)
#   scripts/reliability.sh forks [forks] [runs]  concurrent forks under load (spawn storm: 6000
#                                               forks, 3 runs; 0 hung children) and an allocating
#                                               signal handler inside samples (10 s per interval)
#   scripts/reliability.sh host                 "never harm the host": heavy versions of the
#                                               fork+exec, pre-fork, dlclose, small-stack, thread
#                                               churn, slowloris, stalled-exporter and CLI-bomb tests
#   scripts/reliability.sh all                  all of the above, long
#   scripts/reliability.sh ci                   loom (bounded) + a short fuzz run when available
#
# Environment: LOOM_MAX_PREEMPTIONS (loom depth, default 3; 2 in ci), FUZZ_SANITIZER (none by
# default, which works on stable; `address` builds with ASan through RUSTC_BOOTSTRAP=1).
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '== reliability: %s\n' "$*"; }

run_loom() {
    local preemptions="${1:-${LOOM_MAX_PREEMPTIONS:-3}}"
    log "loom model (LOOM_MAX_PREEMPTIONS=$preemptions)"
    # Own target dir: `--cfg loom` changes every crate's flags, and would otherwise evict the
    # shared build cache.
    LOOM_MAX_PREEMPTIONS="$preemptions" RUSTFLAGS="--cfg loom" CARGO_TARGET_DIR=target/loom \
        cargo test -p ferroprof-recorder --lib --release loom_model
}

run_conservation() {
    local secs="${1:-30}"
    log "conservation for ${secs}s"
    FERROPROF_CONSERVATION_SECS="$secs" cargo test --release -p ferroprof-recorder \
        --test conservation -- --ignored --nocapture conservation_long
}

run_soak() {
    local cycles="${1:-10000}"
    log "soak for $cycles cycles"
    FERROPROF_SOAK_CYCLES="$cycles" cargo test --release -p ferroprof-recorder \
        --test soak -- --ignored --nocapture soak_long
}

run_signals() {
    local secs="${1:-60}" forks="${2:-50}"
    log "signals: 1 kHz + allocation on 8 threads for ${secs}s, stray SIGPROF"
    FERROPROF_SIGNALS_SECS="$secs" cargo test --release -p ferroprof --test signals \
        -- --include-ignored --nocapture --test-threads=1
    log "fork under load: $forks forks"
    FERROPROF_FORKS="$forks" cargo test --release -p ferroprof --test fork_stress -- --nocapture
}

# No hang, ever: many threads forking at once while the profiler is busy, each run counting
# hung children; then a signal handler that allocates on a thread recording a sample.
run_forks() {
    local forks="${1:-6000}" runs="${2:-3}" i
    for i in $(seq 1 "$runs"); do
        log "forks: spawn storm run $i of $runs, $forks forks"
        FERROPROF_SPAWN_FORKS="$forks" cargo test --release -p ferroprof --test spawn_storm \
            -- --nocapture
    done
    log "forks: allocating signal handler, 10 s at 64 B and at 4 KiB"
    FERROPROF_SIGNAL_ALLOC_SECS=10 cargo test --release -p ferroprof --test signal_alloc \
        -- --nocapture --test-threads 1
}

# Heavy versions of the "never harm the host" tests (issue 15); each prints its figures.
run_host() {
    log "host: slowloris flood on /debug/pprof"
    cargo test --release -p ferroprof --test http_hostile -- --ignored --nocapture slowloris_flood_heavy
    log "host: CLI bombs (8 GiB gzip bomb, 1M locations)"
    FERROPROF_BOMB_MIB=8192 FERROPROF_HOSTILE_LOCATIONS=1000000 FERROPROF_HOSTILE_SAMPLES=200000 \
        cargo test --release -p ferroprof-cli --test hostile -- --test-threads=1 --nocapture
    log "host: dlclose/dlopen into the same range, 50 runs"
    FERROPROF_DLCLOSE_RUNS=50 cargo test --release -p ferroprof --test dlclose -- --nocapture
    log "host: 16 KiB stacks, 20 runs"
    FERROPROF_SMALL_STACK_RUNS=20 cargo test --release -p ferroprof --test small_stack -- --nocapture
    log "host: stalled exporter for 30 s"
    FERROPROF_STALL_SECS=30 cargo test --release -p ferroprof --test export_stall -- --nocapture
    log "host: fork latency during big serializations (100k stacks, 20k addresses)"
    FERROPROF_FORK_LATENCY_STACKS=100000 FERROPROF_FORK_LATENCY_ADDRESSES=20000 \
        FERROPROF_FORK_LATENCY_ROUNDS=10 cargo test --release -p ferroprof --test fork_latency -- --nocapture
    log "host: 5000 rounds of racing start() calls"
    FERROPROF_START_RACE_ROUNDS=5000 cargo test --release -p ferroprof --test start_race
    log "host: 2000 fork+exec children at 1 kHz (fresh and resumed profilers)"
    FERROPROF_FORK_EXEC_CHILDREN=2000 cargo test --release -p ferroprof --test fork_exec \
        -- --nocapture --test-threads 1
    log "host: 60 pre-fork workers stopping while the parent is busy"
    FERROPROF_PREFORK_WORKERS=60 cargo test --release -p ferroprof --test prefork -- --nocapture --test-threads 1
    log "host: 80,000 short threads"
    FERROPROF_CHURN_THREADS=80000 cargo test --release -p ferroprof --test thread_churn -- --nocapture
}

have_cargo_fuzz() { cargo fuzz --version >/dev/null 2>&1; }

# fuzz SECS [required]: every target for SECS seconds; prints executions per target.
run_fuzz() {
    local secs="${1:-300}" required="${2:-yes}"
    if ! have_cargo_fuzz; then
        if [ "$required" = no ]; then
            log "fuzz: cargo-fuzz not installed, skipped (the corpus replay runs in cargo test)"
            return 0
        fi
        log "fuzz: installing cargo-fuzz"
        cargo install cargo-fuzz --locked
    fi
    local sanitizer="${FUZZ_SANITIZER:-none}"
    local -a env_prefix=()
    # Sanitizers need nightly-only -Z flags; stable accepts them with RUSTC_BOOTSTRAP=1.
    [ "$sanitizer" != none ] && env_prefix=(env RUSTC_BOOTSTRAP=1)
    local summary="" target max_len runs root="$PWD"
    for target in recorder_ops pprof_roundtrip cli_top; do
        case "$target" in
            recorder_ops) max_len=512 ;;
            pprof_roundtrip) max_len=1024 ;;
            *) max_len=4096 ;;
        esac
        # New finds go to a scratch corpus under fuzz/target (ignored by git); the committed
        # seeds in fuzz/corpus/<target> are only read.
        local scratch="fuzz/target/corpus/$target"
        mkdir -p "$scratch"
        log "fuzz $target for ${secs}s (sanitizer $sanitizer)"
        local out
        out="$(mktemp)"
        if ! (cd fuzz && "${env_prefix[@]}" cargo fuzz run --sanitizer "$sanitizer" "$target" \
            "$root/$scratch" "$root/fuzz/corpus/$target" -- -max_total_time="$secs" -max_len="$max_len" \
            -print_final_stats=1) >"$out" 2>&1; then
            tail -n 60 "$out"
            rm -f "$out"
            log "fuzz $target FAILED (a crash leaves its input under fuzz/artifacts/$target/)"
            return 1
        fi
        runs="$(sed -n 's/^Done \([0-9]*\) runs in \([0-9]*\) second.*/\1 runs in \2 s/p' "$out" | tail -n 1)"
        rm -f "$out"
        summary+="  $target: ${runs:-unknown}"$'\n'
    done
    log "fuzz executions"
    printf '%s' "$summary"
}

cmd="${1:-all}"
shift || true
case "$cmd" in
    loom) run_loom "$@" ;;
    conservation) run_conservation "$@" ;;
    fuzz) run_fuzz "${1:-300}" yes ;;
    soak) run_soak "$@" ;;
    signals) run_signals "$@" ;;
    forks) run_forks "$@" ;;
    host) run_host ;;
    all)
        run_loom
        run_conservation
        run_soak
        run_signals
        run_forks
        run_host
        run_fuzz 300 yes
        ;;
    ci)
        # Short versions of the conservation, soak, signal and corpus-replay runs are ordinary
        # tests in `cargo test`; this adds what needs its own build.
        run_loom 2
        run_fuzz 15 yes
        ;;
    *)
        sed -n '2,22p' "$0" >&2
        exit 2
        ;;
esac
