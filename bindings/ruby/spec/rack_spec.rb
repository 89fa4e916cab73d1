# frozen_string_literal: true

require "spec_helper"
require "tmpdir"
require "json"
require "net/http"
require "socket"

# A Sinatra app and a minimal Rails app on Puma (3 threads) started with
# RUBYOPT=-rferroprof/auto and Ferroprof::Rack, under load from 4 keep-alive clients: CPU and
# allocations per route against truth taken in the app (spec/fixtures/{sinatra,rails},
# spec/fixtures/route_work.rb). FERROPROF_RACK_SECS sets the load's length (6),
# FERROPROF_RACK_VERBOSE=1 prints every route's figures.
RSpec.describe "Ferroprof::Rack" do
  let(:dir) { Dir.mktmpdir("ferroprof-rack") }
  let(:lib) { File.expand_path("../lib", __dir__) }

  after { FileUtils.rm_rf(dir) }

  def wait_for(port)
    deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + 30
    loop do
      return Net::HTTP.get_response(URI("http://127.0.0.1:#{port}/truth"))
    rescue SystemCallError, EOFError
      raise "puma did not start" if Process.clock_gettime(Process::CLOCK_MONOTONIC) > deadline

      sleep 0.1
    end
  end

  {
    "sinatra" => ->(path) { "GET #{path}" },
    "rails" => ->(path) { "RoutesController##{path.delete_prefix('/')}" },
  }.each do |framework, endpoint_of|
    it "splits CPU and allocations by route as the #{framework} app measured them, with no sample under a wrong endpoint" do
      app_dir = File.expand_path("fixtures/#{framework}", __dir__)
      secs = Float(ENV.fetch("FERROPROF_RACK_SECS", "6"))
      port = free_port
      env = { "RUBYOPT" => "-I#{lib} -rferroprof/auto", "FERROPROF_SERVICE" => framework,
              "FERROPROF_OUTPUT_DIR" => File.join(dir, "out"), "FERROPROF_ALLOC_EVERY" => "20",
              "FERROPROF_ALLOC_DUTY" => "1", "FERROPROF_PROFILES" => "cpu,alloc" }
      log = File.join(dir, "puma.log")
      pid = Process.spawn(env, "puma", "-q", "-t", "3:3", "-b", "tcp://127.0.0.1:#{port}", "config.ru",
                          chdir: app_dir, out: log, err: log)
      begin
        wait_for(port)
        paths = %w[/light /medium /heavy /allocs]
        until_t = Process.clock_gettime(Process::CLOCK_MONOTONIC) + secs
        clients = 4.times.map do |k|
          Thread.new do
            rng = Random.new(k)
            Net::HTTP.start("127.0.0.1", port) do |http|
              http.get(paths[rng.rand(paths.size)]) while Process.clock_gettime(Process::CLOCK_MONOTONIC) < until_t
            end
          end
        end
        clients.each(&:join)
        truth = JSON.parse(Net::HTTP.get(URI("http://127.0.0.1:#{port}/truth")))
      ensure
        Process.kill("TERM", pid)
        Process.wait(pid)
      end
      files = Dir[File.join(dir, "out", "#{framework}.*.pprof")]
      expect(files).not_to be_empty, File.read(log)
      samples = files.flat_map { |f| samples_from_pprof(File.binread(f)) }
      routes = paths.to_h { |p| [endpoint_of.call(p), p] }
      # No sample of a route's code under another route's endpoint (or none).
      work = { "/light" => "route_light", "/medium" => "route_medium", "/heavy" => "route_heavy", "/allocs" => "route_allocs" }
      samples.each do |s|
        ran = work.select { |_, m| s.locations.any? { |l| l.label.end_with?(m) } }.keys
        next if ran.empty?

        expect(s.labels[:"trace endpoint"]).to eq(endpoint_of.call(ran.first)), "#{ran} under #{s.labels.inspect}"
      end
      by_endpoint = Hash.new { |h, k| h[k] = Hash.new(0) }
      samples.each do |s|
        ep = s.labels[:"trace endpoint"]
        next unless routes.key?(ep)

        by_endpoint[ep][:cpu] += s.values[:"cpu-time"] || 0
        by_endpoint[ep][:allocs] += s.values[:"alloc-samples"] || 0 if s.locations.any? { |l| l.label.end_with?("allocate") }
      end
      total = by_endpoint.values.sum { |v| v[:cpu] }
      true_total = truth["cpu"].values_at(*routes.keys).sum
      report = routes.keys.map do |ep|
        share = by_endpoint[ep][:cpu].fdiv(total)
        want = truth["cpu"][ep].fdiv(true_total)
        allocs = by_endpoint[ep][:allocs]
        served = truth["served"][ep]
        [ep, share, want, allocs, served]
      end
      summary = report.map { |ep, s, w, a, n| "#{ep}: CPU #{(s * 100).round(1)}% (truth #{(w * 100).round(1)}%), #{a} allocs of #{n} requests" }.join("; ")
      warn summary if ENV["FERROPROF_RACK_VERBOSE"]
      report.each do |ep, share, want, allocs, served|
        expect((share - want).abs).to be <= 0.05, summary
        per_request = { "/light" => 100, "/medium" => 300, "/heavy" => 600, "/allocs" => 2000 }.fetch(routes[ep])
        expect(allocs.fdiv(per_request * served)).to be_within(0.15).of(1.0), summary
      end
    end
  end
end
