#!/usr/bin/env bash
# The sampler against ground truth (crates/profiler/tests/ground_truth.rs), in release at
# `debug = "line-tables-only"` (as services are built; whole stacks are checked by name):
#   scripts/ground_truth.sh [RUNS] [SECS] [HZ]   full harness: RUNS runs (20) of SECS s (20)
#   scripts/ground_truth.sh idle                 sampler cost with 2,000 idle threads
# FERROPROF_CPU_ENGINE=timer (or perf) picks the CPU engine; by default perf where allowed.
# Prints a table per run and the worst error per target; fails when any target is missed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "idle" ]; then
    exec cargo test --release -p ferroprof --test idle_threads -- --include-ignored --nocapture --test-threads 1
fi
CARGO_PROFILE_RELEASE_DEBUG=line-tables-only FERROPROF_GT_RUNS="${1:-20}" FERROPROF_GT_SECS="${2:-20}" FERROPROF_GT_HZ="${3:-100}" \
    cargo test --release -p ferroprof --test ground_truth -- --ignored --nocapture ground_truth_full
