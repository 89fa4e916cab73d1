# Sourced by scripts/test.sh: installs what the tests need, when it is missing.
# Each step is idempotent and quiet when there is nothing to do.
if ! rustup component list --installed 2>/dev/null | grep -q '^clippy'; then rustup component add clippy rustfmt; fi
