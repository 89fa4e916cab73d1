# frozen_string_literal: true

$LOAD_PATH.unshift(File.expand_path("../lib", __dir__))
require "ferroprof"
require_relative "pprof_reader"

module SpecHelpers
  def decode_profile(encoded)
    PprofSpec.decode(encoded)
  end

  def samples_from_pprof(encoded)
    PprofSpec.samples(encoded)
  end

  # Every sample of the profile files `files`.
  def samples_of(files)
    files.flat_map { |f| samples_from_pprof(File.binread(f)) }
  end

  # A TCP port free on 127.0.0.1 now.
  def free_port
    require "socket"
    s = TCPServer.new("127.0.0.1", 0)
    s.addr[1]
  ensure
    s&.close
  end

  # The caller's Ruby stack as [label, path, line] frames, innermost first: what a sampler
  # would record at this point.
  def ruby_stack
    caller_locations(1).map { |l| [l.label, l.absolute_path || l.path, l.lineno] }
  end

  def testing
    Ferroprof::StackRecorder::Testing
  end
end

RSpec.configure do |config|
  config.include SpecHelpers
  config.expect_with(:rspec) { |c| c.syntax = :expect }
  config.order = :defined
end
