# Sourced by scripts/test.sh: installs what the tests need, when it is missing.
# Each step is idempotent and quiet when there is nothing to do.
if ! rustup component list --installed 2>/dev/null | grep -q '^clippy'; then rustup component add clippy rustfmt; fi

# `go tool pprof` reads what /debug/pprof serves (crates/profiler/tests/http_*.rs).
if ! command -v go >/dev/null 2>&1; then
    echo "test-deps: installing golang-go (for go tool pprof)"
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq golang-go >/dev/null
    else
        echo "test-deps: not root, cannot apt-get install golang-go" >&2
    fi
fi

# gcc and the static glibc (libc6-dev's libc.a) build the C program `ferroprof record` is tested
# on (crates/cli/tests/record.rs), dynamically and statically linked.
if ! command -v gcc >/dev/null 2>&1 || ! ls /usr/lib/*-linux-gnu/libc.a >/dev/null 2>&1; then
    echo "test-deps: installing gcc and libc6-dev (for the record tests)"
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc libc6-dev >/dev/null
    else
        echo "test-deps: not root, cannot apt-get install gcc libc6-dev" >&2
    fi
fi

# The Ruby extension (bindings/ruby, scripts/ruby-binding.sh, scripts/ruby-gem.sh): Ruby's
# headers, RSpec, the protobuf runtime its specs decode profiles with, libclang for rb-sys's
# bindgen, Bundler (the gem is installed through it too), and Puma, Sinatra and Rails (the Rack
# middleware's spec serves a Sinatra app and a Rails app on Puma).
ferroprof_ruby_debs=""
command -v ruby >/dev/null 2>&1 && [ -d "$(ruby -e 'print RbConfig::CONFIG["rubyhdrdir"]' 2>/dev/null)" ] \
    || ferroprof_ruby_debs="$ferroprof_ruby_debs ruby-dev"
command -v rspec >/dev/null 2>&1 || ferroprof_ruby_debs="$ferroprof_ruby_debs ruby-rspec"
ruby -e 'require "google/protobuf"' >/dev/null 2>&1 || ferroprof_ruby_debs="$ferroprof_ruby_debs ruby-google-protobuf"
ls /usr/lib/llvm-*/lib/libclang.so* >/dev/null 2>&1 || ferroprof_ruby_debs="$ferroprof_ruby_debs libclang-dev"
command -v bundle >/dev/null 2>&1 || ferroprof_ruby_debs="$ferroprof_ruby_debs ruby-bundler"
command -v puma >/dev/null 2>&1 || ferroprof_ruby_debs="$ferroprof_ruby_debs puma"
ruby -e 'require "sinatra/base"' >/dev/null 2>&1 || ferroprof_ruby_debs="$ferroprof_ruby_debs ruby-sinatra"
ruby -e 'require "action_controller/railtie"' >/dev/null 2>&1 || ferroprof_ruby_debs="$ferroprof_ruby_debs ruby-rails"
if [ -n "$ferroprof_ruby_debs" ]; then
    echo "test-deps: installing$ferroprof_ruby_debs (for the Ruby extension)"
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $ferroprof_ruby_debs >/dev/null
    else
        echo "test-deps: not root, cannot apt-get install$ferroprof_ruby_debs" >&2
    fi
fi

# The Datadog test agent (PyPI ddapm-test-agent) receives uploads in crates/profiler/tests/export_datadog.rs.
# It lives in its own venv so it never touches the system Python; the test finds it through
# FERROPROF_DDAPM_TEST_AGENT.
FERROPROF_TOOLS_DIR="${FERROPROF_TOOLS_DIR:-$HOME/.cache/ferroprof-test-tools}"
FERROPROF_DDAPM_VERSION="1.69.1"
ferroprof_ddapm_installed=""
if [ -x "$FERROPROF_TOOLS_DIR/venv/bin/ddapm-test-agent" ]; then
    ferroprof_ddapm_installed="$("$FERROPROF_TOOLS_DIR/venv/bin/pip" show ddapm-test-agent 2>/dev/null | sed -n 's/^Version: //p' || true)"
fi
if [ "$ferroprof_ddapm_installed" != "$FERROPROF_DDAPM_VERSION" ]; then
    echo "test-deps: installing ddapm-test-agent $FERROPROF_DDAPM_VERSION into $FERROPROF_TOOLS_DIR/venv"
    mkdir -p "$FERROPROF_TOOLS_DIR"
    python3 -m venv "$FERROPROF_TOOLS_DIR/venv"
    "$FERROPROF_TOOLS_DIR/venv/bin/pip" install -q --disable-pip-version-check \
        "ddapm-test-agent==$FERROPROF_DDAPM_VERSION"
fi
export FERROPROF_DDAPM_TEST_AGENT="$FERROPROF_TOOLS_DIR/venv/bin/ddapm-test-agent"
