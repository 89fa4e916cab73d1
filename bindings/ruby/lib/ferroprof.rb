# frozen_string_literal: true

# Ferroprof for Ruby: the stack and heap recorders of ferroprof-recorder (a Rust
# reimplementation of a Ruby profiler's recorders) and a sampling profiler on top of them.
#
#   require "ferroprof"
#   recorder = Ferroprof::StackRecorder.new(heap_samples_enabled: true, heap_size_enabled: true)
#   start, finish, pprof, stats = recorder.serialize

require "objspace" # ObjectSpace.memsize_of: heap-live-size
require "ferroprof/ferroprof_ruby"

module Ferroprof
  # Id => object for every object the heap recorders track (weak: it keeps none alive). The
  # extension asks it whether a tracked object is still alive.
  LIVE_OBJECTS = ObjectSpace::WeakMap.new
  private_constant :LIVE_OBJECTS

  class StackRecorder
    # Keywords of the seed's recorder. cpu-samples and wall-time are always recorded.
    # `cpu_period_ns` (ferroprof's): the CPU time one sample stands for, written as the
    # profile's period (nil: none).
    def self.new(
      cpu_time_enabled: true,
      alloc_samples_enabled: true,
      heap_samples_enabled: false,
      heap_size_enabled: false,
      heap_sample_every: 1,
      timeline_enabled: true,
      heap_clean_after_gc_enabled: true,
      cpu_period_ns: nil
    )
      unless heap_sample_every.is_a?(Integer)
        raise ArgumentError, "heap_sample_every must be an Integer, got #{heap_sample_every.inspect}"
      end
      unless cpu_period_ns.nil? || (cpu_period_ns.is_a?(Integer) && cpu_period_ns.positive?)
        raise ArgumentError, "cpu_period_ns must be a positive Integer or nil, got #{cpu_period_ns.inspect}"
      end

      _native_new(
        cpu_time_enabled ? true : false,
        alloc_samples_enabled ? true : false,
        heap_samples_enabled ? true : false,
        heap_size_enabled ? true : false,
        heap_sample_every,
        timeline_enabled ? true : false,
        heap_clean_after_gc_enabled ? true : false,
        cpu_period_ns || 0,
      )
    end

    # Serializes the profile recorded since the last call (or since creation) and starts the
    # next one. Returns [start, finish, encoded_pprof, stats]: two Times, the pprof bytes
    # (gzip-compressed protobuf) and a Hash of this profile's stats. Raises
    # Ferroprof::SerializationError when serialization fails.
    def serialize
      status, result = self.class._native_serialize(self)
      raise SerializationError, "Failed to serialize profiling data: #{result}" unless status == :ok

      start_ns, finish_ns, encoded, stats = result
      [Ferroprof.time_from_ns(start_ns), Ferroprof.time_from_ns(finish_ns), encoded, stats]
    end

    # The pprof bytes alone (raises like #serialize).
    def serialize!
      serialize[2]
    end
  end

  class SerializationError < Error; end

  def self.time_from_ns(ns)
    Time.at(ns / 1_000_000_000, ns % 1_000_000_000, :nsec)
  end
end

require "ferroprof/profiler"
require "ferroprof/context"
