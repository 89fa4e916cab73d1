# frozen_string_literal: true

# Two Ruby benchmarks run under a profiler chosen on the command line, for
# scripts/ruby-overhead.sh:  ruby bench/workload.rb cpu|alloc none|ferroprof|stackprof-cpu|stackprof-object
# Prints the workload's own wall time in seconds (profiler start and stop excluded).

kind, profiler = ARGV
abort "usage: workload.rb cpu|alloc none|ferroprof|stackprof-cpu|stackprof-object" unless %w[cpu alloc].include?(kind)

# CPU-heavy: method calls, integer and float arithmetic, no allocation in the loop.
def fib(n) = n < 2 ? n : fib(n - 1) + fib(n - 2)

def cpu_work
  total = 0
  8.times { total += fib(25) }
  2_000_000.times { |i| total += (i * 0.5).floor }
  total
end

# Allocation-heavy: short-lived strings, arrays and hashes, and a retained share.
def alloc_work
  kept = []
  300_000.times do |i|
    s = "item-#{i}"
    h = { name: s, tags: [s, s.upcase], n: i }
    kept << h if (i % 50).zero?
  end
  kept.size
end

case profiler
when "none"
when "ferroprof"
  $LOAD_PATH.unshift(File.expand_path("../lib", __dir__))
  require "ferroprof"
  require "tmpdir"
  opts = {}
  opts[:alloc_every] = Integer(ENV["FERROPROF_ALLOC_EVERY"]) if ENV["FERROPROF_ALLOC_EVERY"]
  opts[:alloc_duty] = Float(ENV["FERROPROF_ALLOC_DUTY"]) if ENV["FERROPROF_ALLOC_DUTY"]
  opts[:heap] = false if ENV["FERROPROF_NO_HEAP"]
  Ferroprof.start(dir: Dir.mktmpdir("ferroprof-bench"), **opts)
when "stackprof-cpu"
  require "stackprof"
  StackProf.start(mode: :cpu, interval: 10_000) # 100 Hz, as ferroprof's default
when "stackprof-object"
  require "stackprof"
  StackProf.start(mode: :object, interval: 1000) # every 1000th allocation, as ferroprof's default
else
  abort "unknown profiler #{profiler.inspect}"
end

t0 = Process.clock_gettime(Process::CLOCK_MONOTONIC)
kind == "cpu" ? 3.times { cpu_work } : 6.times { alloc_work }
elapsed = Process.clock_gettime(Process::CLOCK_MONOTONIC) - t0

case profiler
when "ferroprof" then Ferroprof.stop
when /stackprof/ then StackProf.stop && StackProf.results
end
puts elapsed
