#!/usr/bin/env bash
# The project's test command (README "Run the tests"); .ci/run calls exactly this.
# Installs what the tests need when missing, then runs format, lint and every test.
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/test-deps.sh

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
echo "== cargo test"
cargo test --workspace
echo "== cargo test: the tracing layer (feature tracing)"
cargo clippy -p ferroprof --all-targets --features tracing -- -D warnings
cargo test -p ferroprof --features tracing --lib --test tracing_layer
echo "== the Ruby extension (bindings/ruby, its own workspace): fmt, clippy, build, rspec"
./scripts/ruby-binding.sh
echo "== soak (short): memory after exports, with and without the profiler"
./scripts/soak.sh ci

# >>> reliability (issue 6): loom model of the slot protocol and a short run of each fuzz target
# (cargo-fuzz is installed when missing). Conservation, soak, signal and corpus-replay short
# runs are ordinary tests above. Long runs: scripts/reliability.sh all.
echo "== reliability (short)"
./scripts/reliability.sh ci
# <<< reliability
