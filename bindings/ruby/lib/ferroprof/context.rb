# frozen_string_literal: true

module Ferroprof
  # Each thread's request context: the local root span id of the request it serves (set by
  # Ferroprof::Rack) and its user labels (Ferroprof.with_labels). Kept on the Ruby thread (read
  # by the wall sampler) and given to the extension for the thread's CPU and allocation samples.
  module Context
    # Labels the profiler writes itself: user labels may not take these keys.
    RESERVED = ["thread id", "thread name", "local root span id", "trace endpoint", "allocation class",
                "gc gen age", "gc type", "gc cause", "span id", "trace resource"].freeze

    State = Struct.new(:span, :labels, :labels_id)
    NONE = State.new(0, {}.freeze, 0).freeze

    @ids = {}
    @mutex = Mutex.new
    @next_span = (Random.new_seed & 0x3fff_ffff_ffff) | 1

    class << self
      def current
        Thread.current.thread_variable_get(:ferroprof_context) || NONE
      end

      def of(thread)
        thread.thread_variable_get(:ferroprof_context) || NONE
      end

      # Runs the block with `state` as this thread's context, then restores the previous one.
      def with(state)
        previous = current
        apply(state)
        yield
      ensure
        apply(previous)
      end

      # A new local root span id, unique in this process.
      def next_span
        @mutex.synchronize { @next_span += 1 }
      end

      # The id of a label set (registered once with the extension); 0 for none.
      def labels_id(labels)
        return 0 if labels.empty?

        key = labels.sort.freeze
        @mutex.synchronize do
          @ids.fetch(key) do
            id = @ids.size + 1
            raise Error, "too many distinct label sets (#{@ids.size})" unless Native._native_register_labels(id, key)

            @ids[key] = id
          end
        end
      end

      # After a fork: the parent's ids were for its recorder.
      def reset_after_fork
        @mutex = Mutex.new
        @ids.each { |key, id| Native._native_register_labels(id, key) }
        apply(current)
      end

      private

      def apply(state)
        Thread.current.thread_variable_set(:ferroprof_context, state.equal?(NONE) ? nil : state)
        Native._native_set_context(state.span, state.labels_id)
      end
    end
  end

  class << self
    # Runs the block with these labels on every sample of this thread (CPU, wall, allocations),
    # added to the labels already set around it:
    #   Ferroprof.with_labels(tenant: "a") { handle(request) }
    # Keys and values are turned into Strings; the profiler's own keys are refused.
    def with_labels(**labels)
      raise ArgumentError, "with_labels needs a block" unless block_given?

      added = labels.to_h { |k, v| [k.to_s, v.to_s] }
      taken = added.keys & Context::RESERVED
      raise ArgumentError, "label keys #{taken.inspect} are the profiler's own" unless taken.empty?

      now = Context.current
      merged = now.labels.merge(added).freeze
      Context.with(Context::State.new(now.span, merged, Context.labels_id(merged))) { yield }
    end
  end
end
