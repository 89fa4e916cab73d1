#!/usr/bin/env bash
# Installs the Ruby gem the way the README says and runs a program nobody changed under it:
#   gem build ferroprof.gemspec; gem install ./ferroprof-*.gem   (into a temporary GEM_HOME)
#   then, from another directory, RUBYOPT=-rferroprof/auto ruby app.rb (the app forks a worker)
#   and a Bundler app with a `gem "ferroprof"` line run by `bundle exec`.
# Checks each run wrote profiles (parent and worker) that decode, with the app's functions.
# Called by scripts/test.sh. CARGO_TARGET_DIR is pointed at bindings/ruby/target/gem so the
# crates.io dependencies compile once.
set -euo pipefail
cd "$(dirname "$0")/../bindings/ruby"
RUBY_DIR=$PWD
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ferroprof-gem.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
export CARGO_TARGET_DIR="$RUBY_DIR/target/gem"

echo "== ruby gem: gem build"
gem build ferroprof.gemspec --output "$WORK/ferroprof-0.1.0.gem" >/dev/null
echo "== ruby gem: gem install (compiles the extension with cargo)"
GEM_HOME="$WORK/gems" GEM_PATH="$WORK/gems" gem install --local --no-document "$WORK/ferroprof-0.1.0.gem"

# The app: CPU in one method, allocations in another, and a forked worker doing the same.
mkdir -p "$WORK/app"
cat >"$WORK/app/app.rb" <<'RUBY'
def app_spin(secs)
  t0 = Process.clock_gettime(Process::CLOCK_THREAD_CPUTIME_ID)
  x = 0
  x += 1 while Process.clock_gettime(Process::CLOCK_THREAD_CPUTIME_ID) - t0 < secs
  x
end

def app_allocate(n) = n.times.map { |i| "s#{i}" }

pid = fork do
  app_spin(0.5)
  app_allocate(200_000)
end
app_spin(0.5)
app_allocate(200_000)
Process.wait(pid)
puts "worker #{pid} done"
RUBY

check() { # check DIR SERVICE: profiles of two processes, with app_spin CPU and app_allocate allocations
    ruby -I "$RUBY_DIR/spec" -r pprof_reader -e '
        dir, service = ARGV
        files = Dir[File.join(dir, "#{service}.*.pprof")]
        pids = files.map { |f| File.basename(f).split(".")[1] }.uniq
        abort "expected profiles of 2 processes in #{dir}, got #{files}" unless pids.size == 2
        samples = files.flat_map { |f| PprofSpec.samples(File.binread(f)) }
        cpu = samples.select { |s| s.locations.any? { |l| l.label.end_with?("app_spin") } }.sum { |s| s.values[:"cpu-time"] || 0 }
        allocs = samples.select { |s| s.locations.any? { |l| l.label.include?("app_allocate") } }.sum { |s| s.values[:"alloc-samples"] || 0 }
        abort "app_spin CPU #{cpu} ns, expected about 1 s" unless cpu.between?(0.7e9, 1.3e9)
        abort "no allocation samples in app_allocate" unless allocs.positive?
        puts "ok: #{files.size} profiles of #{pids.size} processes; app_spin #{(cpu / 1e9).round(2)} s; app_allocate #{allocs} allocations"
    ' "$1" "$2"
}

echo "== ruby gem: RUBYOPT=-rferroprof/auto, from another directory"
(cd "$WORK/app" && GEM_HOME="$WORK/gems" GEM_PATH="$WORK/gems" RUBYOPT=-rferroprof/auto \
    FERROPROF_SERVICE=gemapp FERROPROF_OUTPUT_DIR="$WORK/out" FERROPROF_ALLOC_EVERY=100 FERROPROF_ALLOC_DUTY=1 ruby app.rb)
check "$WORK/out" gemapp

if command -v bundle >/dev/null 2>&1; then
    echo "== ruby gem: Bundler, gem \"ferroprof\" (the installed gem), bundle exec"
    mkdir -p "$WORK/bundled"
    cp "$WORK/app/app.rb" "$WORK/bundled/"
    printf 'source "https://rubygems.org"\ngem "ferroprof"\n' >"$WORK/bundled/Gemfile"
    # RUBYOPT would also apply to the `bundle` command, which runs before the bundle is set
    # up: the switches go on ruby's command line, bundler/setup first.
    (export GEM_HOME="$WORK/gems" GEM_PATH="$WORK/gems" BUNDLE_SILENCE_ROOT_WARNING=1
        cd "$WORK/bundled" && bundle install --local --quiet &&
        FERROPROF_SERVICE=bundled FERROPROF_OUTPUT_DIR="$WORK/out2" FERROPROF_ALLOC_EVERY=100 \
        FERROPROF_ALLOC_DUTY=1 bundle exec ruby -rbundler/setup -rferroprof/auto app.rb)
    check "$WORK/out2" bundled
else
    echo "bundle not found (Debian ruby-bundler): cannot check the Bundler install" >&2
    exit 1
fi
