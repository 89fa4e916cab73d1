# frozen_string_literal: true

require "spec_helper"
require "tmpdir"
require "json"
require "net/http"
require "socket"
require "base64"
require "zlib"
require "open3"

# The Rust profiler's exporters from Ruby, configured by the environment as for Rust programs:
# the Datadog test agent (PyPI ddapm-test-agent, installed by scripts/test-deps.sh) receives the
# profile with its endpoint counts, a Pyroscope receiver (a socket here) gets it with its tags.
RSpec.describe "Ferroprof exporters" do
  let(:dir) { Dir.mktmpdir("ferroprof-export") }
  let(:lib) { File.expand_path("../lib", __dir__) }
  # Twelve GET /users and three POST /orders through the middleware, then exit (which stops the
  # profiler: the last profile is written and the exporters flushed).
  let(:program) do
    <<~RUBY
      require "ferroprof/rack"
      def export_work = (x = 0; 300_000.times { |i| x += i }; x)
      app = ->(env) { export_work; [200, {}, []] }
      mw = Ferroprof::Rack.new(app)
      12.times { mw.call("REQUEST_METHOD" => "GET", "ferroprof.route" => "/users") }
      3.times { mw.call("REQUEST_METHOD" => "POST", "ferroprof.route" => "/orders") }
    RUBY
  end

  after { FileUtils.rm_rf(dir) }

  def agent_binary
    [ENV["FERROPROF_DDAPM_TEST_AGENT"], File.expand_path("~/.cache/ferroprof-test-tools/venv/bin/ddapm-test-agent")]
      .compact.find { |p| File.executable?(p) }
  end

  def run_program(env)
    out, err, status = Open3.capture3(env, "ruby", "-I", lib, "-rferroprof/auto", "-e", program)
    expect(status.success?).to be(true), out + err
    err
  end

  # name => [headers, data] of a multipart/form-data body.
  def multipart(content_type, body)
    boundary = content_type[/boundary=(.+)\z/, 1]
    body.split("--#{boundary}").each_with_object({}) do |part, out|
      head, data = part.split("\r\n\r\n", 2)
      next unless data && head =~ /name="([^"]+)"/

      out[Regexp.last_match(1)] = [head, data.chomp("\r\n")]
    end
  end

  it "uploads to the Datadog agent with the requests' endpoint counts" do
    bin = agent_binary
    if bin.nil?
      raise "ddapm-test-agent is not installed (CI must run scripts/test-deps.sh)" if ENV["CI"]

      skip "ddapm-test-agent not installed: run `. scripts/test-deps.sh`"
    end
    port = free_port
    agent_dir = File.join(dir, "agent")
    FileUtils.mkdir_p(agent_dir)
    agent = Process.spawn(bin, "--host", "127.0.0.1", "--port", port.to_s, "--otlp-http-port", free_port.to_s,
                          "--otlp-grpc-port", free_port.to_s, "--trace-uds-socket", File.join(agent_dir, "apm.sock"),
                          chdir: agent_dir, out: File.join(agent_dir, "log"), err: File.join(agent_dir, "log"))
    begin
      deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + 90
      begin
        Net::HTTP.get(URI("http://127.0.0.1:#{port}/info"))
      rescue SystemCallError, EOFError
        raise "test agent did not start: #{File.read(File.join(agent_dir, 'log'))}" if Process.clock_gettime(Process::CLOCK_MONOTONIC) > deadline

        sleep 0.2
        retry
      end
      err = run_program({ "DD_PROFILING_ENABLED" => "true", "DD_TRACE_AGENT_URL" => "http://127.0.0.1:#{port}",
                          "DD_SERVICE" => "rubyshop", "DD_ENV" => "test", "FERROPROF_TAGS" => "team:ruby" })
      expect(err).to eq("")
      requests = JSON.parse(Net::HTTP.get(URI("http://127.0.0.1:#{port}/test/session/requests")))
                     .select { |r| r["url"].end_with?("/profiling/v1/input") }
    ensure
      Process.kill("KILL", agent)
      Process.wait(agent)
    end
    expect(requests.size).to eq(1)
    parts = multipart(requests[0]["headers"]["Content-Type"], Base64.decode64(requests[0]["body"]))
    event = JSON.parse(parts.fetch("event")[1])
    expect(event["endpoint_counts"]["count"]).to eq("GET /users" => 12, "POST /orders" => 3)
    tags = event["tags_profiler"].split(",")
    expect(tags).to include("service:rubyshop", "env:test", "team:ruby", "language:ruby")
    expect(event["family"]).to eq("ruby")
    samples = PprofSpec.samples(parts.fetch("profile.pprof")[1])
    users = samples.select { |s| s.labels[:"trace endpoint"] == "GET /users" }
    expect(users.sum { |s| s.values[:"cpu-time"] || 0 }).to be > 0
    # No file unless FERROPROF_OUTPUT_DIR asks for one.
    expect(Dir[File.join(dir, "**", "*.pprof")]).to be_empty
  end

  it "uploads to Pyroscope with the profile's tags" do
    server = TCPServer.new("127.0.0.1", 0)
    got = Queue.new
    receiver = Thread.new do
      loop do
        c = server.accept
        request = c.gets
        headers = {}
        while (line = c.gets) && line != "\r\n"
          k, v = line.split(":", 2)
          headers[k.downcase] = v.strip
        end
        body = c.read(headers["content-length"].to_i)
        c.write("HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        c.close
        got << [request, headers, body]
      end
    end
    err = run_program({ "FERROPROF_PYROSCOPE_URL" => "http://127.0.0.1:#{server.addr[1]}", "FERROPROF_SERVICE" => "rubyshop",
                        "FERROPROF_ENV" => "test", "FERROPROF_TAGS" => "team:ruby" })
    expect(err).to eq("")
    request, headers, body = got.pop(timeout: 10)
    expect(request).to start_with("POST /ingest?")
    name = URI.decode_www_form_component(request[/name=([^&]+)/, 1])
    expect(name).to eq("rubyshop{env=test,team=ruby}")
    parts = multipart(headers["content-type"], body)
    samples = PprofSpec.samples(parts.fetch("profile")[1])
    expect(samples.map { |s| s.labels[:"trace endpoint"] }.compact.uniq).to contain_exactly("GET /users", "POST /orders")
  ensure
    receiver&.kill
    server&.close
  end
end
