# frozen_string_literal: true

# Self time by function under ferroprof and under stackprof (CPU mode, same rate), on workloads
# nobody here tuned for: RDoc documenting a library, a Psych YAML round trip, ERB templates
# compiled and rendered. Each run is a process of its own; runs alternate between profilers.
#
#   ruby bench/selftime.rb [RUNS] [SECS]      (default 3 runs of about 4 s per workload)
#   ruby bench/selftime.rb --child WORKLOAD PROFILER SECS   (one run; prints JSON)
#
# Prints, per workload and run, both profilers' top five functions by self time, how many
# they share, and the largest difference in self-time share over those functions. Time in
# the garbage collector is one function for both (stackprof's (marking), (sweeping) and
# (garbage collection) are ferroprof's `Garbage Collection`).
require "json"
require "open3"
require "tmpdir"

LIB = File.expand_path("../lib", __dir__)
HZ = 1000

module Workloads
  module_function

  def rdoc(secs)
    require "rdoc"
    src = File.dirname($LOADED_FEATURES.grep(%r{/rdoc\.rb\z}).first)
    until_done(secs) do
      Dir.mktmpdir do |out|
        RDoc::RDoc.new.document(["--quiet", "--op", File.join(out, "doc"), File.join(src, "rdoc", "markup")])
      end
    end
  end

  def yaml(secs)
    require "psych"
    data = Array.new(2000) do |i|
      { "id" => i, "name" => "item #{i}", "tags" => %w[a b c].map { |t| "#{t}#{i % 7}" },
        "price" => i * 1.25, "nested" => { "when" => "2024-01-#{(i % 28) + 1}", "ok" => i.even? } }
    end
    until_done(secs) { Psych.load(Psych.dump(data)) }
  end

  def erb(secs)
    require "erb"
    row = "<tr><td><%= item[:id] %></td><td><%= item[:name].upcase %></td>" \
          "<% if item[:id].even? %><td>even</td><% else %><td>odd</td><% end %></tr>\n"
    template = "<table>\n<% items.each do |item| %>\n#{row * 40}<% end %>\n</table>\n"
    items = Array.new(20) { |i| { id: i, name: "n#{i}" } }
    until_done(secs) { ERB.new(template).result_with_hash(items: items) }
  end

  def until_done(secs)
    t0 = Process.clock_gettime(Process::CLOCK_MONOTONIC)
    yield while Process.clock_gettime(Process::CLOCK_MONOTONIC) - t0 < secs
  end
end

# Self CPU share by function label, from one profiled run.
def child(workload, profiler, secs)
  shares = Hash.new(0.0)
  case profiler
  when "ferroprof"
    $LOAD_PATH.unshift(LIB)
    require "ferroprof"
    require_relative "../spec/pprof_reader"
    dir = Dir.mktmpdir
    Ferroprof.start(dir: dir, period: 3600, cpu_hz: HZ, alloc_every: 0)
    Workloads.send(workload, secs)
    Ferroprof.stop.each do |f|
      PprofSpec.samples(File.binread(f)).each do |s|
        leaf = s.locations.first
        shares[leaf.label] += s.values[:"cpu-time"] || 0 if leaf
      end
    end
  when "stackprof"
    require "stackprof"
    result = StackProf.run(mode: :cpu, interval: 1_000_000 / HZ) { Workloads.send(workload, secs) }
    # stackprof's pseudo-frames for collections are ferroprof's one `Garbage Collection`.
    gc = ["(garbage collection)", "(marking)", "(sweeping)"]
    result[:frames].each_value do |f|
      shares[gc.include?(f[:name]) ? "Garbage Collection" : f[:name]] += f[:samples]
    end
  end
  total = shares.values.sum
  shares.transform_values { |v| v / total }
end

def top(shares, n = 5)
  shares.sort_by { |_, v| -v }.first(n).map(&:first)
end

if ARGV[0] == "--child"
  puts JSON.dump(child(ARGV[1], ARGV[2], Float(ARGV[3])))
  exit
end

runs = Integer(ARGV[0] || 3)
secs = Float(ARGV[1] || 4)
summary = Hash.new { |h, k| h[k] = [] }
%w[rdoc yaml erb].each do |w|
  runs.times do |r|
    got = %w[ferroprof stackprof].to_h do |prof|
      out, status = Open3.capture2e("ruby", __FILE__, "--child", w, prof, secs.to_s)
      abort "#{w} #{prof}: #{out}" unless status.success?
      [prof, JSON.parse(out.lines.last)]
    end
    f, s = got["ferroprof"], got["stackprof"]
    shared = (top(f) & top(s)).size
    diff = (top(f) | top(s)).map { |k| ((f[k] || 0) - (s[k] || 0)).abs }.max
    summary[w] << [shared, diff]
    puts "#{w} run #{r + 1}: top 5 shared #{shared} of 5, largest self-share difference #{(diff * 100).round(1)} points"
    puts "  ferroprof: #{top(f).map { |k| "#{k} #{(f[k] * 100).round(1)}%" }.join(', ')}"
    puts "  stackprof: #{top(s).map { |k| "#{k} #{(s[k] * 100).round(1)}%" }.join(', ')}"
  end
end
summary.each do |w, rs|
  puts "#{w}: top-5 shared min #{rs.map(&:first).min} of 5 over #{rs.size} runs; " \
       "largest self-share difference #{(rs.map(&:last).max * 100).round(1)} points"
end
