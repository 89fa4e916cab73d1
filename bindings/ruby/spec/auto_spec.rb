# frozen_string_literal: true

require "spec_helper"
require "tmpdir"
require "open3"

# `ruby -rferroprof/auto` (or RUBYOPT): started from FERROPROF_* variables, no code changed.
RSpec.describe "ferroprof/auto" do
  let(:dir) { Dir.mktmpdir("ferroprof-auto") }
  let(:lib) { File.expand_path("../lib", __dir__) }
  let(:program) do
    <<~RUBY
      def auto_spin
        t0 = Process.clock_gettime(Process::CLOCK_THREAD_CPUTIME_ID)
        nil while Process.clock_gettime(Process::CLOCK_THREAD_CPUTIME_ID) - t0 < 0.3
      end
      pid = fork { auto_spin; 20_000.times { Object.new } }
      auto_spin
      20_000.times { Object.new }
      Process.wait(pid)
      puts "done \#{Ferroprof.running?} \#{Ferroprof.tags.sort.inspect}"
    RUBY
  end

  after { FileUtils.rm_rf(dir) }

  def run(env, rubyopt: false)
    base = { "FERROPROF_OUTPUT_DIR" => File.join(dir, "out") }
    if rubyopt
      Open3.capture3(base.merge("RUBYOPT" => "-I#{lib} -rferroprof/auto").merge(env), "ruby", "-e", program)
    else
      Open3.capture3(base.merge(env), "ruby", "-I", lib, "-rferroprof/auto", "-e", program)
    end
  end

  def profiles(service)
    Dir[File.join(dir, "out", "#{service}.*.pprof")]
  end

  it "starts from the environment and profiles forked workers into files of their own" do
    out, err, status = run({ "FERROPROF_SERVICE" => "svc", "FERROPROF_TAGS" => "team:a", "DD_ENV" => "prod",
                             "FERROPROF_ALLOC_EVERY" => "50", "FERROPROF_ALLOC_DUTY" => "1" }, rubyopt: true)
    expect(status.success?).to be(true), err
    expect(err).to eq("")
    expect(out).to include('done true [["env", "prod"], ["team", "a"]]')
    files = profiles("svc")
    expect(files.map { |f| File.basename(f).split(".")[1] }.uniq.size).to eq(2)
    samples = files.flat_map { |f| samples_from_pprof(File.binread(f)) }
    cpu = samples.select { |s| s.locations.any? { |l| l.label.end_with?("auto_spin") } }.sum { |s| s.values[:"cpu-time"] || 0 }
    expect(cpu).to be_within(0.25e9).of(0.6e9)
    expect(samples.sum { |s| s.values[:"alloc-samples"] || 0 }).to be > 0
  end

  it "records only the profiles FERROPROF_PROFILES names" do
    _, err, status = run({ "FERROPROF_SERVICE" => "cpuonly", "FERROPROF_PROFILES" => "cpu" })
    expect(status.success?).to be(true), err
    samples = profiles("cpuonly").flat_map { |f| samples_from_pprof(File.binread(f)) }
    expect(samples.sum { |s| s.values[:"cpu-time"] || 0 }).to be > 0
    expect(samples.sum { |s| s.values[:"alloc-samples"] || 0 }).to eq(0)
  end

  it "says what is wrong with a bad value in one line, and runs the program unprofiled" do
    %w[FERROPROF_CPU_HZ=abc FERROPROF_CPU_HZ=5000 FERROPROF_PROFILES=cpu,disk FERROPROF_PERIOD_SECS=-1
       FERROPROF_TAGS=novalue FERROPROF_SERVICE=a/b].each do |setting|
      name, value = setting.split("=", 2)
      out, err, status = run({ name => value })
      expect(status.success?).to be(true), err
      expect(out).to include("done false")
      expect(err.lines.size).to eq(1), err
      expect(err).to start_with("ferroprof: ").and include(name)
      expect(err).to end_with("not profiling\n")
    end
    expect(Dir[File.join(dir, "out", "*")]).to be_empty
  end

  it "does not start when FERROPROF_ENABLED is false" do
    out, _, status = run({ "FERROPROF_ENABLED" => "false" })
    expect(status.success?).to be(true)
    expect(out).to include("done false")
    expect(Dir[File.join(dir, "out", "*")]).to be_empty
  end
end
