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
