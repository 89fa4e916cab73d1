# frozen_string_literal: true

# Starts ferroprof from the environment, with no change to the program:
#
#   ruby -rferroprof/auto app.rb            RUBYOPT=-rferroprof/auto bundle exec puma
#
# Variables (the Rust profiler's names and meanings where they apply):
#   FERROPROF_ENABLED         false/0/no: do not start (default: start)
#   FERROPROF_SERVICE         service name, the files' prefix (DD_SERVICE; else the program's name)
#   FERROPROF_ENV, FERROPROF_VERSION, FERROPROF_TAGS (k:v,k2:v2)   checked, kept with the
#                             profiler (Ferroprof.tags); DD_ENV, DD_VERSION, DD_TAGS win
#   FERROPROF_PROFILES        which profiles: a list of cpu, wall, alloc, heap, or all (cpu,alloc,heap)
#   FERROPROF_CPU_HZ          CPU samples per CPU-second, and wall looks per second (100; 1..1000)
#   FERROPROF_ALLOC_EVERY     allocations per allocation sample, on average (10000; objects, not
#                             bytes: FERROPROF_ALLOC_INTERVAL=0 turns alloc and heap off too)
#   FERROPROF_ALLOC_DUTY      share of CPU intervals whose allocations are watched (0.05; 1: all,
#                             for short runs and tests; Ruby allocates slower while watched)
#   FERROPROF_PERIOD_SECS     seconds between two profiles (60)
#   FERROPROF_CPU_ENGINE      auto (perf events when allowed, else the CPU timer), perf, timer
#   FERROPROF_TIMELINE        true: timestamped CPU and wall samples (DD_PROFILING_TIMELINE_ENABLED)
#   FERROPROF_OUTPUT_DIR      where profiles go (./profiles; with an exporter, none unless set)
#   DD_PROFILING_ENABLED=true (DD_TRACE_AGENT_URL, DD_AGENT_HOST, DD_API_KEY...) and
#   FERROPROF_PYROSCOPE_URL   upload each profile, as the Rust profiler does
#
# A bad value is reported in one line on stderr and the program runs unprofiled. Forked
# children (Puma, Unicorn workers) profile themselves into files of their own.
require "ferroprof"

module Ferroprof
  # Reads FERROPROF_* (and DD_*) variables into Ferroprof.start options.
  module Auto
    class BadSetting < StandardError; end

    PROFILES = %w[cpu wall alloc heap].freeze

    module_function

    # Options for Ferroprof.start from `env`, or nil when disabled. Raises BadSetting.
    def options(env = ENV)
      return nil if %w[0 false no off].include?(env["FERROPROF_ENABLED"].to_s.strip.downcase)

      profiles = profiles(env)
      hz = integer(env, "FERROPROF_CPU_HZ", 100, 1..1000, "samples per second")
      alloc_every = integer(env, "FERROPROF_ALLOC_EVERY", 10_000, 1..(2**40), "allocations")
      alloc_off = env.key?("FERROPROF_ALLOC_INTERVAL") &&
                  integer(env, "FERROPROF_ALLOC_INTERVAL", 0, 0..(2**62), "bytes").zero?
      alloc = profiles.include?("alloc") || profiles.include?("heap")
      # With an exporter (Datadog, Pyroscope), files only when FERROPROF_OUTPUT_DIR asks.
      export = %w[1 true yes on].include?(env["DD_PROFILING_ENABLED"].to_s.strip.downcase) ||
               %w[1 true yes on].include?(env["FERROPROF_DATADOG"].to_s.strip.downcase) ||
               !env["FERROPROF_PYROSCOPE_URL"].to_s.strip.empty?
      {
        dir: env["FERROPROF_OUTPUT_DIR"] || (export ? nil : "profiles"),
        export_from_env: export,
        service: service(env),
        tags: tags(env),
        period: number(env, "FERROPROF_PERIOD_SECS", 60, 0.01..(86_400 * 7), "seconds"),
        cpu_hz: profiles.include?("cpu") ? hz : 0,
        wall_hz: profiles.include?("wall") ? hz : 0,
        alloc_every: alloc && !alloc_off ? alloc_every : 0,
        alloc_duty: number(env, "FERROPROF_ALLOC_DUTY", 0.05, 0.000001..1.0, "share of CPU intervals"),
        heap: profiles.include?("heap"),
        cpu_engine: cpu_engine(env),
        timeline: %w[DD_PROFILING_TIMELINE_ENABLED FERROPROF_TIMELINE].any? do |k|
          %w[1 true yes on].include?(env[k].to_s.strip.downcase)
        end,
      }
    end

    def profiles(env)
      raw = env.fetch("FERROPROF_PROFILES", "all").strip
      return %w[cpu alloc heap] if raw == "all"

      list = raw.split(",").map(&:strip).reject(&:empty?)
      bad = list - PROFILES
      unless bad.empty? && !list.empty?
        raise BadSetting, "FERROPROF_PROFILES=#{raw.inspect} is invalid: expected all or a list of #{PROFILES.join(', ')}"
      end

      list
    end

    def cpu_engine(env)
      raw = env.fetch("FERROPROF_CPU_ENGINE", "auto").strip
      return raw if %w[auto perf timer].include?(raw)

      raise BadSetting, "FERROPROF_CPU_ENGINE=#{raw.inspect} is invalid: expected auto, perf or timer"
    end

    def integer(env, name, default, range, unit)
      raw = env[name]
      return default if raw.nil? || raw.strip.empty?

      value = Integer(raw.strip, 10, exception: false)
      return value if value && range.cover?(value)

      raise BadSetting, "#{name}=#{raw.inspect} is invalid: expected an integer (#{unit}) in #{range}"
    end

    def number(env, name, default, range, unit)
      raw = env[name]
      return default if raw.nil? || raw.strip.empty?

      value = Float(raw.strip, exception: false)
      return value if value&.finite? && range.cover?(value)

      raise BadSetting, "#{name}=#{raw.inspect} is invalid: expected a number (#{unit}) in #{range}"
    end

    # DD_SERVICE, else FERROPROF_SERVICE, else the program's file name (made a valid prefix).
    def service(env)
      %w[DD_SERVICE FERROPROF_SERVICE].each do |name|
        v = env[name].to_s.strip
        next if v.empty?
        return v if v.match?(/\A[\w.-]+\z/)

        raise BadSetting, "#{name}=#{env[name].inspect} is invalid: expected letters, digits, '.', '-' or '_' (it prefixes the files)"
      end
      name = File.basename($PROGRAM_NAME).gsub(/[^\w.-]/, "_").sub(/\A[-.]+/, "")
      name.empty? ? "ruby" : name
    end

    def first(env, *names)
      names.map { |n| env[n].to_s.strip }.find { |v| !v.empty? }
    end

    # service/env/version/tags as the Rust profiler reads them; DD_* win.
    def tags(env)
      out = {}
      %w[env version].each do |k|
        v = first(env, "DD_#{k.upcase}", "FERROPROF_#{k.upcase}")
        out[k] = v if v
      end
      [["FERROPROF_TAGS", /,/], ["DD_TAGS", /[,\s]+/]].each do |name, sep|
        env[name].to_s.split(sep).map(&:strip).reject(&:empty?).each do |pair|
          key, value = pair.split(":", 2)
          if key.to_s.empty? || value.to_s.empty?
            raise BadSetting, "#{name}=#{env[name].inspect} is invalid: expected key:value pairs, got #{pair.inspect}"
          end

          out[key] = value
        end
      end
      out
    end

    def start(env = ENV)
      opts = options(env)
      Ferroprof.start(**opts) if opts
    rescue BadSetting, ArgumentError, Ferroprof::Error => e
      warn "ferroprof: #{e.message}; not profiling"
      nil
    end
  end
end

Ferroprof::Auto.start unless Ferroprof.running?
