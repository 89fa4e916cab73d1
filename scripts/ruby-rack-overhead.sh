#!/usr/bin/env bash
# Overhead of ferroprof on a Rack app under load, beside stackprof, in one run: the Sinatra app
# of bindings/ruby/spec/fixtures/sinatra on Puma (3 threads), loaded by 4 keep-alive clients
# for SECS seconds, bare, under ferroprof (RUBYOPT=-rferroprof/auto and Ferroprof::Rack, the
# defaults: CPU, allocations, live heap) and under stackprof (CPU mode, 100 Hz); ROUNDS
# interleaved rounds. The figure: Puma's process CPU per request served (its
# /proc/PID/stat utime+stime over the load), the median per profiler, and its ratio to bare.
#   scripts/ruby-rack-overhead.sh [ROUNDS] [SECS]     (default 5 rounds of 10 s)
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-5}"
secs="${2:-10}"
scripts/ruby-binding.sh build >/dev/null
ruby -e 'require "stackprof"' 2>/dev/null || { echo "stackprof missing: apt-get install ruby-stackprof" >&2; exit 1; }
command -v puma >/dev/null || { echo "puma missing: apt-get install puma ruby-sinatra" >&2; exit 1; }
LIB=$PWD/bindings/ruby/lib
APP=$PWD/bindings/ruby/spec/fixtures/sinatra
OUT=$(mktemp -d "${TMPDIR:-/tmp}/ferroprof-rack-overhead.XXXXXX")
trap 'rm -rf "$OUT"' EXIT

# One run: prints the CPU nanoseconds per request.
run() {
    local mode=$1 port
    port=$(ruby -rsocket -e 's = TCPServer.new("127.0.0.1", 0); print s.addr[1]; s.close')
    local rubyopt="-I$LIB"
    [ "$mode" = ferroprof ] && rubyopt="$rubyopt -rferroprof/auto"
    (cd "$APP" && FIXTURE_PROFILER=$mode RUBYOPT="$rubyopt" FERROPROF_OUTPUT_DIR="$OUT/profiles" \
        exec puma -q -t 3:3 -b "tcp://127.0.0.1:$port" config.ru >"$OUT/puma.log" 2>&1) &
    local pid=$!
    ruby -I"$LIB" -rnet/http -rjson -e '
        port, secs, pid = ARGV[0].to_i, ARGV[1].to_f, ARGV[2]
        deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + 30
        begin
          Net::HTTP.get(URI("http://127.0.0.1:#{port}/truth"))
        rescue SystemCallError, EOFError
          abort "puma did not start" if Process.clock_gettime(Process::CLOCK_MONOTONIC) > deadline
          sleep 0.1
          retry
        end
        # Warm-up, then the measured load.
        cpu = -> { File.read("/proc/#{pid}/stat").split(")").last.split.values_at(11, 12).sum(&:to_i) }
        paths = %w[/light /medium /heavy /allocs]
        load = lambda do |dur|
          stop_at = Process.clock_gettime(Process::CLOCK_MONOTONIC) + dur
          count = 0
          m = Mutex.new
          4.times.map do |k|
            Thread.new do
              rng = Random.new(k)
              n = 0
              Net::HTTP.start("127.0.0.1", port) do |h|
                (h.get(paths[rng.rand(4)]); n += 1) while Process.clock_gettime(Process::CLOCK_MONOTONIC) < stop_at
              end
              m.synchronize { count += n }
            end
          end.each(&:join)
          count
        end
        load.call(2)
        c0 = cpu.call
        served = load.call(secs)
        ticks = cpu.call - c0
        printf("%.0f\n", ticks * 1e9 / 100 / served) # clock ticks of 10 ms
    ' "$port" "$secs" "$pid"
    kill -TERM "$pid"
    wait "$pid" 2>/dev/null || true
}

declare -A per
modes=(none ferroprof stackprof)
for ((r = 0; r < rounds; r++)); do
    for m in "${modes[@]}"; do
        per[$m]+="$(run "$m") "
    done
    printf '.' >&2
done
echo >&2
median() { tr ' ' '\n' | grep . | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
base=$(echo ${per[none]} | median)
printf '%-10s %22s %8s\n' profiler "CPU per request (us)" ratio
for m in "${modes[@]}"; do
    v=$(echo ${per[$m]} | median)
    printf '%-10s %22.1f %+7.1f%%\n' "$m" "$(awk -v v="$v" 'BEGIN {print v / 1000}')" "$(awk -v v="$v" -v b="$base" 'BEGIN {print (v / b - 1) * 100}')"
done
