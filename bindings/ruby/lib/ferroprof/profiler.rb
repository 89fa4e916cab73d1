# frozen_string_literal: true

module Ferroprof
  # The sampling profiler: CPU (SIGPROF timer + postponed job), allocations and live heap
  # (NEWOBJ hook), optional wall time (a Ruby thread reading every thread's backtrace), and a
  # writer thread that serializes the recorder every period into DIR/ferroprof.PID.N.pprof.
  class Profiler
    DEFAULTS = {
      dir: "ferroprof-profiles",
      period: 60,
      cpu_hz: 100,
      alloc_every: 10_000,
      alloc_duty: 0.05,
      heap: true,
      heap_sample_every: 1,
      wall_hz: 0,
      stop_timeout: 5,
      service: "ferroprof",
      tags: {},
      export_from_env: false,
      timeline: false,
      cpu_engine: "auto",
    }.freeze

    attr_reader :dir, :files, :recorder, :service, :tags

    def initialize(**opts)
      unknown = opts.keys - DEFAULTS.keys
      raise ArgumentError, "unknown option(s) #{unknown.map(&:inspect).join(', ')} (known: #{DEFAULTS.keys.join(', ')})" unless unknown.empty?

      o = DEFAULTS.merge(opts)
      check_number(:period, o[:period], min: 0.01)
      check_number(:cpu_hz, o[:cpu_hz], min: 0, max: 1000)
      check_number(:wall_hz, o[:wall_hz], min: 0, max: 1000)
      check_number(:stop_timeout, o[:stop_timeout], min: 0)
      check_number(:alloc_duty, o[:alloc_duty], min: 1e-6, max: 1)
      unless o[:alloc_every].is_a?(Integer) && o[:alloc_every] >= 0
        raise ArgumentError, "alloc_every must be an Integer >= 0 (0: no allocation profile), got #{o[:alloc_every].inspect}"
      end

      unless o[:service].is_a?(String) && o[:service].match?(/\A[\w.-]+\z/)
        raise ArgumentError, "service must be a name of letters, digits, '.', '-' or '_' (it prefixes the files), got #{o[:service].inspect}"
      end
      unless o[:tags].is_a?(Hash)
        raise ArgumentError, "tags must be a Hash of names to values, got #{o[:tags].inspect}"
      end

      @opts = o
      @service = o[:service]
      @tags = o[:tags].to_h { |k, v| [k.to_s, v.to_s] }.freeze
      @dir = o[:dir]&.to_s
      # The Rust profiler's exporters, as the environment configures them (Datadog, Pyroscope).
      @exporters = o[:export_from_env] ? Native::Exporters._native_exporters_from_env(@service, @tags.to_a) : nil
      @dropped_exporters = []
      raise ArgumentError, "dir is needed when no exporter is configured" if @dir.nil? && @exporters.nil?

      @files = []
      @count = 0
      @mutex = Mutex.new
      @wake = ConditionVariable.new
      @stopping = false
      heap = o[:heap] && o[:alloc_every] > 0
      @recorder = StackRecorder.new(
        cpu_time_enabled: o[:cpu_hz] > 0,
        alloc_samples_enabled: o[:alloc_every] > 0,
        heap_samples_enabled: heap,
        heap_size_enabled: heap,
        heap_sample_every: o[:heap_sample_every],
        timeline_enabled: o[:timeline] ? true : false,
        cpu_period_ns: o[:cpu_hz] > 0 ? (1e9 / o[:cpu_hz]).round : nil,
      )
    end

    def start
      require "fileutils"
      FileUtils.mkdir_p(@dir) if @dir
      interval_ns = @opts[:cpu_hz] > 0 ? (1e9 / @opts[:cpu_hz]).round : 0
      heap = @opts[:heap] && @opts[:alloc_every] > 0
      Native._native_start(@recorder, interval_ns, @opts[:alloc_every], @opts[:alloc_duty].to_f, heap,
                           @opts[:timeline] ? true : false, @opts[:cpu_engine].to_s)
      start_threads
      self
    end

    # Stops sampling, writes the last profile and returns the files written. The writer and
    # wall threads get `stop_timeout` seconds to finish; then they are killed.
    def stop
      @mutex.synchronize do
        @stopping = true
        @wake.broadcast
      end
      Native._native_stop
      deadline = @opts[:stop_timeout]
      [@writer, @wall].compact.each do |t|
        next if t == Thread.current
        t.kill unless t.join(deadline)
      end
      Native._native_set_own_threads(nil, nil)
      write_profile
      @exporters&.shutdown(@opts[:stop_timeout])
      @files
    end

    # Writes the profile recorded since the last one now; returns its path (nil on failure).
    def flush
      write_profile
    end

    # In a forked child (called from the Process._fork hook): the parent's samples are not this
    # process's, its threads are gone.
    def after_fork_in_child
      # The parent's threads are gone here; a lock one of them held must not be inherited.
      @mutex = Mutex.new
      @wake = ConditionVariable.new
      @recorder.reset_after_fork
      Context.reset_after_fork
      if @exporters
        # The parent's exporters' threads are not in this process: theirs are kept (never freed,
        # which would wait for those threads) and this process gets its own.
        @dropped_exporters << @exporters
        @exporters = Native::Exporters._native_exporters_from_env(@service, @tags.to_a)
      end
      @files = []
      @count = 0
      Native._native_after_fork
      start_threads
    end

    private

    def check_number(name, value, min:, max: nil)
      ok = value.is_a?(Numeric) && value >= min && (max.nil? || value <= max)
      return if ok

      range = max ? "#{min}..#{max}" : ">= #{min}"
      raise ArgumentError, "#{name} must be a number #{range}, got #{value.inspect}"
    end

    def start_threads
      @stopping = false
      @writer = Thread.new { writer_loop }
      @writer.name = "ferroprof writer"
      @wall = nil
      if @opts[:wall_hz] > 0
        @wall = Thread.new { wall_loop }
        @wall.name = "ferroprof wall"
      end
      Native._native_set_own_threads(@writer, @wall)
    end

    # The profile since the last one, handed to the exporters too when there are any.
    def serialize
      return @recorder.serialize unless @exporters

      status, result = StackRecorder._native_serialize_export(@recorder, @exporters)
      raise SerializationError, "Failed to serialize profiling data: #{result}" unless status == :ok

      start_ns, finish_ns, encoded, stats = result
      warn "ferroprof: #{stats[:export_refused]} exporter(s) refused a profile" if stats[:export_refused].to_i.positive?
      [Ferroprof.time_from_ns(start_ns), Ferroprof.time_from_ns(finish_ns), encoded, stats]
    end

    def writer_loop
      period = @opts[:period]
      loop do
        @mutex.synchronize do
          deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + period
          until @stopping
            left = deadline - Process.clock_gettime(Process::CLOCK_MONOTONIC)
            break if left <= 0

            @wake.wait(@mutex, left)
          end
        end
        break if @stopping

        write_profile
      end
    end

    def write_profile
      @mutex.synchronize do
        _start, _finish, pprof, _stats = serialize
        @count += 1
        return nil unless @dir

        path = File.join(@dir, "#{@service}.#{Process.pid}.#{@count}.pprof")
        File.binwrite(path, pprof)
        @files << path
        path
      end
    rescue StandardError => e
      warn "ferroprof: could not write a profile: #{e.class}: #{e.message}"
      nil
    end

    # Every thread's backtrace, every 1/wall_hz s, each weighed by the time since the last look.
    # Threads blocked without the GVL are seen where they block.
    def wall_loop
      step = 1.0 / @opts[:wall_hz]
      last = Process.clock_gettime(Process::CLOCK_MONOTONIC, :nanosecond)
      own = [Thread.current, @writer]
      until @stopping
        sleep(step)
        now = Process.clock_gettime(Process::CLOCK_MONOTONIC, :nanosecond)
        elapsed = now - last
        last = now
        Thread.list.each do |t|
          next if own.include?(t) || !t.alive?

          locs = t.backtrace_locations
          next if locs.nil? || locs.empty?

          frames = locs.first(400).map { |l| [l.label || "(unknown)", l.absolute_path || l.path || "", l.lineno] }
          name = t.name || (t == Thread.main ? "main" : nil)
          labels = name ? [["thread name", name]] : []
          numeric = [["thread id", t.native_thread_id || 0]]
          context = Context.of(t)
          numeric << ["local root span id", context.span] if context.span.positive?
          labels.concat(context.labels.to_a)
          if @opts[:timeline]
            at = Process.clock_gettime(Process::CLOCK_REALTIME, :nanosecond)
            Native._native_sample_at(@recorder, frames, { "wall-time" => elapsed, "timeline" => elapsed }, labels, numeric, at)
          else
            Native._native_sample(@recorder, frames, { "wall-time" => elapsed }, labels, numeric)
          end
        end
      end
    rescue StandardError => e
      warn "ferroprof: wall sampling stopped: #{e.class}: #{e.message}"
    end
  end

  # Re-arms the profiler in a forked child (Ruby 3.1+ routes every fork through Process._fork).
  module ForkHook
    def _fork
      pid = super
      Ferroprof.send(:after_fork_in_child) if pid.zero?
      pid
    end
  end

  @profiler = nil
  @at_exit_installed = false

  class << self
    # Starts profiling this process. Options (all optional):
    #   dir:               where profiles go (ferroprof-profiles), as ferroprof.PID.N.pprof
    #   period:            seconds between profiles (60)
    #   cpu_hz:            CPU samples per CPU-second (100; 0: off)
    #   alloc_every:       allocations per allocation sample, on average (10_000; 0: off)
    #   alloc_duty:        share of CPU intervals whose allocations are watched (0.05; 1 when
    #                      cpu_hz is 0): Ruby allocates much slower while watched
    #   heap:              live-heap profile of the sampled objects (true)
    #   heap_sample_every: track 1 in N allocation samples for the live heap (1)
    #   wall_hz:           wall-time looks at every thread per second (0: off)
    #   stop_timeout:      seconds stop waits for the profiler's threads (5)
    #   service:           the files' prefix (ferroprof): SERVICE.PID.N.pprof
    #   tags:              a Hash of tags (env, version, ...) for the exporters: Ferroprof.tags
    #   cpu_engine:        auto (perf events when this process may open them, else the
    #                      process CPU timer), perf or timer
    #   timeline:          timestamp CPU and wall samples (the `timeline` type: Datadog's
    #                      timeline view); each is kept as an event, so profiles grow (false)
    #   export_from_env:   also upload each profile as the environment says, as the Rust
    #                      profiler does (DD_PROFILING_ENABLED, DD_TRACE_AGENT_URL...,
    #                      FERROPROF_PYROSCOPE_URL...); dir: nil then writes no file
    # Returns the profiler; raises if one is already running.
    def start(**opts)
      raise Error, "ferroprof is already running (Ferroprof.stop first)" if @profiler

      profiler = Profiler.new(**opts)
      profiler.start
      @profiler = profiler
      unless @at_exit_installed
        @at_exit_installed = true
        at_exit { Ferroprof.stop if Ferroprof.running? }
        Process.singleton_class.prepend(ForkHook)
      end
      profiler
    end

    # Stops profiling; writes the last profile. Returns the files written since start.
    def stop
      profiler = @profiler
      return [] unless profiler

      @profiler = nil
      profiler.stop
    end

    def running?
      !@profiler.nil?
    end

    # The running profiler's tags (an empty Hash when not running).
    def tags
      @profiler ? @profiler.tags : {}
    end

    # Writes the profile recorded since the last one now; returns its path. Raises when
    # ferroprof is not running.
    def flush
      raise Error, "ferroprof is not running (Ferroprof.start first)" unless @profiler

      @profiler.flush
    end

    # Counters of the sampling paths (signals, samples, drops, errors).
    def stats
      Native._native_stats
    end

    private

    def after_fork_in_child
      @profiler&.after_fork_in_child
    end
  end
end
