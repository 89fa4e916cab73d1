# frozen_string_literal: true

require "spec_helper"
require "tmpdir"
require "fileutils"
require "ferroprof/rack"

# Live-heap samples split by request: an object kept after its request ended is labelled with
# that request's `local root span id` and `trace endpoint` for as long as it lives.
module HeapByRequestWorkload
  module_function

  def spec_keep(n, into)
    n.times { into << ("k" * 120) }
  end
end

RSpec.describe "live heap by request" do
  let(:dir) { Dir.mktmpdir("ferroprof-heap-req") }

  after do
    Ferroprof.stop if Ferroprof.running?
    FileUtils.rm_rf(dir)
  end

  it "labels each live object with the endpoint of the request that allocated it" do
    Ferroprof.start(dir: dir, period: 60, cpu_hz: 0, alloc_every: 20)
    kept = Hash.new { |h, k| h[k] = [] }
    made = { "GET /keep" => 3_000, "POST /hold" => 1_000 }
    app = lambda do |env|
      route = env["ferroprof.endpoint"]
      HeapByRequestWorkload.spec_keep(made.fetch(route), kept[route])
      [200, {}, ["ok"]]
    end
    mw = Ferroprof::Rack.new(app)
    20.times do
      made.each_key { |route| mw.call("REQUEST_METHOD" => route.split.first, "ferroprof.endpoint" => route) }
    end
    # Outside any request: no request labels.
    HeapByRequestWorkload.spec_keep(2_000, kept[nil])
    GC.start
    samples = samples_of(Ferroprof.stop)
    live = samples.select { |s| (s.values[:"heap-live-size"] || 0).positive? }
    at_keep = live.select { |s| s.locations.any? { |f| f.label.end_with?("spec_keep") } }
    by = at_keep.group_by { |s| s.labels[:"trace endpoint"] }.transform_values { |v| v.sum { |s| s.values[:"heap-live-samples"] } }
    total = by.values.sum.to_f
    expect(by.keys).to contain_exactly("GET /keep", "POST /hold", nil)
    # 60,000, 20,000 and 2,000 objects kept: shares of 73%, 24% and 2%.
    expect(by["GET /keep"] / total).to be_within(0.05).of(60.0 / 82)
    expect(by["POST /hold"] / total).to be_within(0.05).of(20.0 / 82)
    # Every labelled sample has its request's span too, and no span outside one.
    at_keep.each do |s|
      expect(s.labels[:"local root span id"].nil?).to eq(s.labels[:"trace endpoint"].nil?), s.labels.inspect
    end
    kept.clear
  end
end
