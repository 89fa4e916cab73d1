#!/usr/bin/env bash
# Builds the Ruby extension (bindings/ruby, its own cargo workspace) against the installed
# ruby-dev, lints it, and runs its RSpec suite. Called by scripts/test.sh.
#   scripts/ruby-binding.sh build   # build and link lib/ferroprof/ferroprof_ruby.so only
#   scripts/ruby-binding.sh         # fmt check, clippy, build, rspec
set -euo pipefail
cd "$(dirname "$0")/../bindings/ruby"
export CARGO_TARGET_DIR="$PWD/target"
mode="${1:-all}"

if [ "$mode" = all ]; then
    echo "== ruby binding: cargo fmt --check"
    cargo fmt -- --check
    echo "== ruby binding: cargo clippy"
    cargo clippy --release --all-targets -- -D warnings
fi
if [ "$mode" = all ]; then
    echo "== ruby binding: cargo test (the extension's own unit tests)"
    cargo test --release --lib
fi
echo "== ruby binding: cargo build --release"
cargo build --release
# Ruby loads extensions by their file name: lib/ferroprof/ferroprof_ruby.so, found by
# `require "ferroprof/ferroprof_ruby"` through the load path.
mkdir -p lib/ferroprof
ln -sf ../../target/release/libferroprof_ruby.so lib/ferroprof/ferroprof_ruby.so
ruby -I lib -e 'require "ferroprof"; Ferroprof::StackRecorder.new.serialize'
[ "$mode" = build ] && exit 0

echo "== ruby binding: rspec"
rspec --format progress spec
