#!/usr/bin/env bash
# The project's test command (README "Two commands"); .ci/run calls exactly this.
# Installs what the tests need when missing, then runs format, lint, API docs and every test.
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/test-deps.sh

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy (every target: lib, tests, benches, examples; missing docs are errors)"
cargo clippy --workspace --all-targets -- -D warnings
echo "== cargo doc (API docs; broken links and other rustdoc warnings are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --features ferroprof/opentelemetry
echo "== cargo package (publishable crates: metadata, versions on workspace dependencies)"
# --no-verify: building each package again takes minutes; `cargo package` without it passes too.
cargo package -p ferroprof-recorder -p ferroprof-pprof -p ferroprof-export -p ferroprof \
    -p ferroprof-attach \
    -p ferroprof-cli \
    --allow-dirty --no-verify --offline --quiet
echo "== cargo test (builds the examples too; tests/readme.rs checks the README against them)"
cargo test --workspace
echo "== install check: cargo install --path crates/cli, then record with the library it carries"
./scripts/install_check.sh
echo "== cargo test: fork and exec with the perf CPU engine (timers where perf is refused)"
FERROPROF_CPU_ENGINE=auto cargo test -p ferroprof --test fork_exec
echo "== cargo test: allocation stacks of a release build at debug = \"line-tables-only\" (short inlined names)"
CARGO_TARGET_DIR=target/line-tables CARGO_PROFILE_RELEASE_DEBUG=line-tables-only \
    cargo test --release -p ferroprof --test alloc_leaf
echo "== cargo test: the tracing layer (feature tracing)"
cargo clippy -p ferroprof --all-targets --features tracing -- -D warnings
cargo clippy -p ferroprof --all-targets --features opentelemetry -- -D warnings
cargo test -p ferroprof --features tracing --lib --test tracing_layer --test service_spans
cargo test -p ferroprof --features opentelemetry --test otel_ids
echo "== the Ruby extension (bindings/ruby, its own workspace): fmt, clippy, build, rspec"
./scripts/ruby-binding.sh
echo "== the Ruby gem: gem build, gem install, apps started from the environment and by Bundler"
./scripts/ruby-gem.sh
echo "== soak (short): memory after exports, with and without the profiler"
./scripts/soak.sh ci

# >>> reliability (issue 6): loom model of the slot protocol and a short run of each fuzz target
# (cargo-fuzz is installed when missing). Conservation, soak, signal and corpus-replay short
# runs are ordinary tests above. Long runs: scripts/reliability.sh all.
echo "== reliability (short)"
./scripts/reliability.sh ci
# <<< reliability
