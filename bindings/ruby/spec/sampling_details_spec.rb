# frozen_string_literal: true

require "spec_helper"
require "tmpdir"
require "fileutils"
require "open3"
require "zlib"
require "json"

# Details of what a sample says, each against truth taken inside the workload: where CPU was
# spent (the C function running when the interval ended, the thread that ran), that no interval
# is lost, that each process draws its own allocation samples, and what a profile says of itself.
module SamplingDetailsWorkload
  module_function

  def thread_cpu_ns
    Process.clock_gettime(Process::CLOCK_THREAD_CPUTIME_ID, :nanosecond)
  end

  # Kernel#eval compiling a long source that runs one short call (String#+@) at its end: the
  # intervals that end while eval compiles must be booked to eval, not to that next call.
  SOURCE = "if false\n#{"x = [1, 2, 3].map { |v| v * 2 }\n" * 4000}end\n+''\n"

  def details_eval
    eval(SOURCE) # rubocop:disable Security/Eval
  end

  def details_ruby_spin(n)
    x = 0
    n.times { |i| x += i * i }
    x
  end
end

RSpec.describe "Ferroprof samples" do
  let(:dir) { Dir.mktmpdir("ferroprof-details") }
  let(:lib) { File.expand_path("../lib", __dir__) }

  after do
    Ferroprof.stop
    FileUtils.rm_rf(dir)
  end

  def self_time(samples, label)
    samples.select { |s| s.locations.first&.label == label }.sum { |s| s.values[:"cpu-time"] || 0 }
  end

  it "books CPU spent inside a C function to that function (self time within 5 points of truth)" do
    w = SamplingDetailsWorkload
    Ferroprof.start(dir: dir, period: 60, cpu_hz: 1000, alloc_every: 0)
    in_eval = 0
    t0 = w.thread_cpu_ns
    while w.thread_cpu_ns - t0 < 3e9
      a = w.thread_cpu_ns
      w.details_eval
      in_eval += w.thread_cpu_ns - a
    end
    total = w.thread_cpu_ns - t0
    samples = samples_of(Ferroprof.stop)
    all = samples.sum { |s| s.values[:"cpu-time"] || 0 }
    # Collections that eval's compiling starts are its time too (their own leaf is GC's).
    eval_samples = samples.select do |s|
      labels = s.locations.map(&:label)
      labels.first == "Kernel#eval" || labels.first(2) == ["Garbage Collection", "Kernel#eval"]
    end
    got = eval_samples.sum { |s| s.values[:"cpu-time"] || 0 }.fdiv(all)
    truth = in_eval.fdiv(total)
    expect((got - truth).abs).to be <= 0.05,
                                 "Kernel#eval self #{got.round(3)} of CPU, truth #{truth.round(3)}; " \
                                 "String#+@ #{self_time(samples, 'String#+@').fdiv(all).round(3)}"
  end

  it "records every interval the timer counted, among busy threads (none dropped)" do
    w = SamplingDetailsWorkload
    Ferroprof.start(dir: dir, period: 60, cpu_hz: 1000, alloc_every: 100)
    threads = 4.times.map do
      Thread.new do
        t0 = w.thread_cpu_ns
        w.details_ruby_spin(20_000) while w.thread_cpu_ns - t0 < 1e9
        # Allocations make the allocation job run beside the CPU job.
        2000.times { Object.new }
      end
    end
    threads.each(&:join)
    files = Ferroprof.stop
    stats = Ferroprof.stats
    recorded = samples_of(files).sum { |s| s.values[:"cpu-samples"] || 0 }
    expect(stats[:cpu_intervals]).to be_a(Integer)
    expect(stats[:cpu_intervals]).to be >= stats[:signals] - stats[:signals_outside_ruby]
    expect(recorded).to eq(stats[:cpu_intervals] - stats[:cpu_intervals_at_stop]),
                        "recorded #{recorded}, counted #{stats}"
    expect(stats[:cpu_intervals_at_stop]).to be <= 2
  end

  it "charges CPU spent in a GVL-releasing C call to the thread that spent it (within 10%)" do
    w = SamplingDetailsWorkload
    payload = Random.new(7).bytes(4 << 20) * 4
    Ferroprof.start(dir: dir, period: 60, cpu_hz: 200, alloc_every: 0)
    truth = {}
    zipper = Thread.new do
      t0 = w.thread_cpu_ns
      Zlib::Deflate.deflate(payload, Zlib::BEST_COMPRESSION) while w.thread_cpu_ns - t0 < 1.5e9
      truth[Thread.current.native_thread_id] = w.thread_cpu_ns - t0
    end
    spinner = Thread.new do
      t0 = w.thread_cpu_ns
      w.details_ruby_spin(20_000) while w.thread_cpu_ns - t0 < 1.5e9
      truth[Thread.current.native_thread_id] = w.thread_cpu_ns - t0
    end
    [zipper, spinner].each(&:join)
    samples = samples_of(Ferroprof.stop)
    truth.each do |tid, ns|
      got = samples.select { |s| s.labels[:"thread id"] == tid }.sum { |s| s.values[:"cpu-time"] || 0 }
      expect(got.fdiv(ns)).to be_within(0.1).of(1.0), "thread #{tid}: profile #{got}, clock #{ns}"
    end
  end

  it "books garbage collection to a Garbage Collection frame (within 20% of GC.stat(:time))" do
    # A GC-heavy loop in a process of its own: in this one, earlier examples' objects and
    # hooks change what a collection costs between GC.stat's clock reads and the samples.
    script = <<~RUBY
      require "ferroprof"
      require "json"
      def details_churn(keep) = 2000.times { |i| keep[i % 5000] = Array.new(20) { "x" * 30 } }
      keep = []
      Ferroprof.start(dir: ARGV[0], period: 60, cpu_hz: 1000, alloc_every: 0)
      gc0 = GC.stat(:time)
      t0 = Process.clock_gettime(Process::CLOCK_MONOTONIC)
      details_churn(keep) while Process.clock_gettime(Process::CLOCK_MONOTONIC) - t0 < 2.5
      gc_ms = GC.stat(:time) - gc0
      puts JSON.dump(gc_ms: gc_ms, files: Ferroprof.stop)
    RUBY
    out, err, status = Open3.capture3("ruby", "-I", lib, "-e", script, dir)
    expect(status.success?).to be(true), err
    result = JSON.parse(out.lines.last)
    gc_ms = result["gc_ms"]
    samples = samples_of(result["files"])
    gc = samples.select { |s| s.locations.first&.label == "Garbage Collection" }
    got_ms = gc.sum { |s| s.values[:"cpu-time"] || 0 } / 1e6
    warn "GC: profile #{got_ms.round} ms, GC.stat(:time) #{gc_ms} ms" if ENV["FERROPROF_GC_VERBOSE"]
    expect(got_ms.fdiv(gc_ms)).to be_within(0.2).of(1.0), "profile #{got_ms} ms, GC.stat(:time) #{gc_ms} ms"
    expect(gc.map { |s| s.labels[:"gc type"] }.uniq - %w[minor major]).to be_empty
    expect(gc.map { |s| s.labels[:"gc cause"] }).to all(be_a(String))
    # What allocated when the collection started is below it.
    expect(gc.map { |s| s.locations.map(&:label) }).to all(include(/details_churn/))
  end

  # Per-site allocation sample counts of one deterministic program.
  SITES_PROGRAM = <<~RUBY
    require "ferroprof"
    require "json"
    dir = ARGV.fetch(0)
    8.times { |k| eval("def site_\#{k}(n) = n.times { Object.new }") }
    Ferroprof.start(dir: dir, period: 60, cpu_hz: 0, alloc_every: 50, heap: false)
    child = nil
    if ARGV[1] == "fork"
      child = fork { 8.times { |k| send("site_\#{k}", 2000) }; puts JSON.dump(Ferroprof.stop); exit!(0) }
    end
    8.times { |k| send("site_\#{k}", 2000) }
    files = Ferroprof.stop
    Process.wait(child) if child
    puts JSON.dump(files)
  RUBY

  def site_counts(files)
    samples = samples_of(files)
    8.times.map do |k|
      samples.select { |s| s.locations.any? { |f| f.label.include?("site_#{k}") } }
             .sum { |s| s.values[:"alloc-samples-unscaled"] || 0 }
    end
  end

  it "draws different allocation samples in each process and in a forked child" do
    runs = 2.times.map do |i|
      d = File.join(dir, "run#{i}")
      out, status = Open3.capture2e("ruby", "-I", lib, "-e", SITES_PROGRAM, d)
      expect(status.success?).to be(true), out
      site_counts(JSON.parse(out.lines.last))
    end
    expect(runs[0]).not_to eq(runs[1])
    d = File.join(dir, "forked")
    out, status = Open3.capture2e("ruby", "-I", lib, "-e", SITES_PROGRAM, d, "fork")
    expect(status.success?).to be(true), out
    child, parent = out.lines.last(2).map { |l| site_counts(JSON.parse(l)) }
    expect(child).not_to eq(parent)
  end

  it "names the class of every allocation sample, with the heap profile off" do
    Ferroprof.start(dir: dir, period: 60, cpu_hz: 0, alloc_every: 10, heap: false)
    3000.times { "s" * 10 }
    samples = samples_of(Ferroprof.stop).select { |s| s.value?(:"alloc-samples") }
    expect(samples).not_to be_empty
    expect(samples.map { |s| s.labels[:"allocation class"] }).to all(be_a(String))
    expect(samples.map { |s| s.labels[:"allocation class"] }).to include("String")
  end

  it "says what one CPU sample stands for, and counts each run on its own" do
    Ferroprof.start(dir: dir, period: 60, cpu_hz: 250, alloc_every: 0)
    SamplingDetailsWorkload.details_ruby_spin(300_000)
    files = Ferroprof.stop
    first = Ferroprof.stats[:cpu_samples]
    expect(first).to be > 0
    profile = decode_profile(File.binread(files.first))
    strings = profile.string_table
    expect(strings[profile.period_type.type]).to eq("cpu-time")
    expect(strings[profile.period_type.unit]).to eq("nanoseconds")
    expect(profile.period).to eq(4_000_000)
    Ferroprof.start(dir: dir, period: 60, cpu_hz: 250, alloc_every: 0)
    expect(Ferroprof.stats[:cpu_samples]).to eq(0)
  end
end
