#!/usr/bin/env bash
# What a user does (README, "Viewing profiles" and "Profile any program"): install the command
# with `cargo install --path crates/cli`, then `ferroprof record -- PROGRAM`. The installed
# binary has no preload library beside it: it must use the one it carries (issue 41). Also the
# README's demo build: `target/release/ferroprof record` works after a build of the CLI alone.
# Called by scripts/test.sh. The release build goes to the workspace's target/ (or
# $CARGO_TARGET_DIR), so it is shared with other release builds.
set -euo pipefail
cd "$(dirname "$0")/.."
target_dir=${CARGO_TARGET_DIR:-target}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

echo "install_check: cargo install --path crates/cli --root $tmp/root"
cargo install --path crates/cli --root "$tmp/root" --target-dir "$target_dir" \
    --offline --locked --quiet
ferroprof=$tmp/root/bin/ferroprof
test ! -e "$tmp/root/lib/libferroprof_preload.so"

# A C program of known allocations (the record tests' fixture), compiled as a user would.
cc -O1 -g -fno-omit-frame-pointer -pthread -o "$tmp/fixture" \
    crates/cli/tests/fixtures/record_fixture.c -ldl

# A clean environment: no library named, an empty cache directory.
export XDG_CACHE_HOME=$tmp/cache
unset FERROPROF_PRELOAD LD_PRELOAD

fail() {
    echo "install_check: FAILED: $*" >&2
    exit 1
}

record_fixture() {
    rm -rf "$tmp/prof"
    if ! "$ferroprof" record -o "$tmp/prof" -- "$tmp/fixture" alloc >"$tmp/out" 2>&1; then
        cat "$tmp/out" >&2
        fail "ferroprof record -- fixture alloc (installed binary)"
    fi
    local profile
    profile=$(find "$tmp/prof" -name 'fixture.*.pprof' | head -n 1)
    [ -n "$profile" ] || { cat "$tmp/out" >&2; fail "no profile in $tmp/prof"; }
    # Samples, attributed to the fixture's own functions.
    "$ferroprof" top "$profile" --type alloc-space >"$tmp/top" 2>&1 || fail "ferroprof top $profile"
    grep -q 'fixture_' "$tmp/top" || { cat "$tmp/out" "$tmp/top" >&2; fail "no fixture_ samples in $profile"; }
}

record_fixture
lib=$(find "$XDG_CACHE_HOME/ferroprof" -name libferroprof_preload.so)
[ -n "$lib" ] || fail "the carried library was not written under $XDG_CACHE_HOME/ferroprof"
[ "$(stat -c %a "$(dirname "$lib")")" = 700 ] || fail "$(dirname "$lib") is not mode 700"

# A damaged cached copy (cut short, or one byte changed) is replaced before it is used.
good=$(sha256sum <"$lib")
case "$(dirname "$lib")" in */preload-"$(echo "$good" | cut -c1-16)") ;;
    *) fail "$lib is not in a directory named by its SHA-256 ($good)" ;;
esac
truncate -s 4096 "$lib"
record_fixture
[ "$(sha256sum <"$lib")" = "$good" ] || fail "the truncated $lib was not rewritten"
printf 'X' | dd of="$lib" bs=1 seek=100000 conv=notrunc status=none
[ "$(sha256sum <"$lib")" != "$good" ] || fail "the byte of $lib was not changed"
record_fixture
[ "$(sha256sum <"$lib")" = "$good" ] || fail "the edited $lib was not rewritten"

# The README's demo command builds the CLI alone (`cargo run --release -p ferroprof-cli`):
# the same build as the install above, so nothing is rebuilt here.
cargo build --release -p ferroprof-cli --target-dir "$target_dir" --offline --locked --quiet
"$target_dir/release/ferroprof" record -o "$tmp/prof-true" -- true >/dev/null 2>"$tmp/err" ||
    { cat "$tmp/err" >&2; fail "$target_dir/release/ferroprof record -- true"; }

echo "install_check: ok (installed ferroprof records with the library it carries)"
