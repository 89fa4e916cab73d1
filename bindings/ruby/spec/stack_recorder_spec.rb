# frozen_string_literal: true

require_relative "spec_helper"

# The behaviours of the seed's StackRecorder spec, against Ferroprof::StackRecorder. Profiles are
# read back with the protobuf reader of pprof_reader.rb. Behaviours that do not apply are listed in
# bindings/ruby/README.md.
RSpec.describe Ferroprof::StackRecorder do
  let(:cpu_time_enabled) { true }
  let(:alloc_samples_enabled) { true }
  let(:heap_samples_enabled) { false }
  let(:heap_size_enabled) { false }
  let(:heap_sample_every) { 1 }
  let(:timeline_enabled) { true }
  let(:heap_clean_after_gc_enabled) { true }

  subject(:recorder) do
    described_class.new(
      cpu_time_enabled: cpu_time_enabled,
      alloc_samples_enabled: alloc_samples_enabled,
      heap_samples_enabled: heap_samples_enabled,
      heap_size_enabled: heap_size_enabled,
      heap_sample_every: heap_sample_every,
      timeline_enabled: timeline_enabled,
      heap_clean_after_gc_enabled: heap_clean_after_gc_enabled,
    )
  end

  def active_slot = testing._native_active_slot(recorder)
  def slot_one_locked? = testing._native_slot_one_mutex_locked?(recorder)
  def slot_two_locked? = testing._native_slot_two_mutex_locked?(recorder)
  def recorded?(id) = testing._native_is_object_recorded?(recorder, id)
  def after_gc_step = testing._native_recorder_after_gc_step(recorder)

  def sample(values, labels: [], numeric_labels: [], stack: ruby_stack)
    testing._native_sample(recorder, stack, values, labels, numeric_labels)
  end

  def epoch_ns(time) = time.to_i * 1_000_000_000 + time.nsec

  describe ".new" do
    it "starts with slot one active and open, slot two locked" do
      expect([active_slot, slot_one_locked?, slot_two_locked?]).to eq [1, false, true]
    end

    it "rejects a heap_sample_every that is not a positive integer, naming it" do
      expect { described_class.new(heap_samples_enabled: true, heap_sample_every: 0) }
        .to raise_error(ArgumentError, /\b0\b/)
      expect { described_class.new(heap_samples_enabled: true, heap_sample_every: -3) }
        .to raise_error(ArgumentError, /-3/)
      expect { described_class.new(heap_sample_every: "2") }.to raise_error(ArgumentError, /"2"/)
    end

    it "rejects unknown keywords" do
      expect { described_class.new(cpu_enabled: true) }.to raise_error(ArgumentError, /cpu_enabled/)
    end
  end

  describe "#serialize" do
    subject(:serialize) { recorder.serialize }

    let(:start) { serialize[0] }
    let(:finish) { serialize[1] }
    let(:encoded_pprof) { serialize[2] }
    let(:profile_stats) { serialize[3] }
    let(:decoded_profile) { decode_profile(encoded_pprof) }
    let(:samples) { samples_from_pprof(encoded_pprof) }

    it "returns two Times, a binary String and a Hash" do
      expect(serialize.map(&:class)).to eq [Time, Time, String, Hash]
      expect(encoded_pprof.encoding).to eq Encoding::BINARY
    end

    describe "slot flipping" do
      it "from slot one to slot two" do
        expect { serialize }.to change { [active_slot, slot_one_locked?, slot_two_locked?] }
          .from([1, false, true]).to([2, true, false])
      end

      it "from slot two back to slot one" do
        recorder.serialize
        expect { serialize }.to change { [active_slot, slot_one_locked?, slot_two_locked?] }
          .from([2, true, false]).to([1, false, true])
      end
    end

    context "with an empty profile" do
      it "starts and finishes within the call" do
        before_call = Time.now
        serialize
        after_call = Time.now
        expect(start).to be_between(before_call, after_call)
        expect(finish).to be_between(before_call, after_call)
        expect(start).to be <= finish
      end

      describe "sample types" do
        let(:heap_samples_enabled) { true }
        let(:heap_size_enabled) { true }
        let(:every_type) do
          {
            "cpu-time" => "nanoseconds", "cpu-samples" => "count", "wall-time" => "nanoseconds",
            "alloc-samples" => "count", "alloc-samples-unscaled" => "count",
            "heap-live-samples" => "count", "heap-live-size" => "bytes", "timeline" => "nanoseconds",
          }
        end

        def types_of(profile)
          s = profile.string_table
          profile.sample_type.to_h { |t| [s[t.type], s[t.unit]] }
        end

        def every_type_but(*names)
          names.each { |n| raise "no type #{n}" unless every_type.key?(n) }
          every_type.reject { |k, _| names.include?(k) }
        end

        it("all enabled: all eight") { expect(types_of(decoded_profile)).to eq every_type }

        context "without cpu-time" do
          let(:cpu_time_enabled) { false }
          it { expect(types_of(decoded_profile)).to eq every_type_but("cpu-time") }
        end

        context "without alloc samples" do
          let(:alloc_samples_enabled) { false }
          it { expect(types_of(decoded_profile)).to eq every_type_but("alloc-samples", "alloc-samples-unscaled") }
        end

        context "without heap-live-samples" do
          let(:heap_samples_enabled) { false }
          it { expect(types_of(decoded_profile)).to eq every_type_but("heap-live-samples") }
        end

        context "without heap-live-size" do
          let(:heap_size_enabled) { false }
          it { expect(types_of(decoded_profile)).to eq every_type_but("heap-live-size") }
        end

        context "without timeline" do
          let(:timeline_enabled) { false }
          it { expect(types_of(decoded_profile)).to eq every_type_but("timeline") }
        end

        context "with every optional type off" do
          let(:cpu_time_enabled) { false }
          let(:alloc_samples_enabled) { false }
          let(:heap_samples_enabled) { false }
          let(:heap_size_enabled) { false }
          let(:timeline_enabled) { false }

          it "keeps the always-on pair, cpu-samples first" do
            expect(types_of(decoded_profile).to_a).to eq [%w[cpu-samples count], %w[wall-time nanoseconds]]
          end
        end
      end

      it "is an empty pprof whose time is the start" do
        expect(decoded_profile).to have_attributes(
          sample: [], mapping: [], location: [], function: [],
          drop_frames: 0, keep_frames: 0, period_type: nil, period: 0, comment: [],
          time_nanos: epoch_ns(start),
        )
        expect(decoded_profile.duration_nanos).to eq(epoch_ns(finish) - epoch_ns(start))
      end

      it "carries each profile's own start, in order, over several serializations" do
        starts = Array.new(4) do
          s, _, bytes = recorder.serialize
          expect(decode_profile(bytes).time_nanos).to eq epoch_ns(s)
          s
        end
        expect(starts.sort).to eq starts
        expect(starts.uniq.size).to eq 4
      end

      it "reports no recorded samples" do
        expect(profile_stats).to include(
          recorded_samples: 0,
          serialization_time_ns: be > 0,
          heap_iteration_prep_time_ns: be >= 0,
          heap_profile_build_time_ns: be >= 0,
        )
      end
    end

    context "with one sample" do
      let(:values) do
        { "cpu-time" => 123, "cpu-samples" => 456, "wall-time" => 789, "alloc-samples" => 4242,
          "alloc-samples-unscaled" => 2222, "timeline" => 1111 }
      end
      let(:sample_line) { __LINE__ + 3 }

      before do
        sample(values, labels: [%w[label_a value_a], %w[label_b value_b], %w[state unknown]])
        expect(samples.size).to eq 1
      end

      it "carries the values given" do
        expect(samples.first.values).to eq(
          "cpu-time": 123, "cpu-samples": 456, "wall-time": 789, "alloc-samples": 4242,
          "alloc-samples-unscaled": 2222, timeline: 1111,
        )
      end

      context "with an optional type disabled" do
        let(:alloc_samples_enabled) { false }

        it "drops that type's values" do
          expect(samples.first.values).to eq("cpu-time": 123, "cpu-samples": 456, "wall-time": 789, timeline: 1111)
        end
      end

      it "carries the labels given" do
        expect(samples.first.labels).to eq(label_a: "value_a", label_b: "value_b", state: "unknown")
      end

      it "carries the stack given, innermost first" do
        # Innermost: the `sample` helper, which took the stack; then its caller in `before`.
        helper, caller = samples.first.locations
        expect(helper.label).to eq "sample"
        expect([caller.path, caller.lineno]).to eq [__FILE__, sample_line]
        expect(samples.first.locations.last.label).to eq ruby_stack.last[0]
      end

      it "emits no mappings" do
        expect(decoded_profile.mapping).to be_empty
      end

      it "reports one recorded sample" do
        expect(profile_stats).to include(recorded_samples: 1, serialization_time_ns: be > 0)
      end
    end

    context "with an invalid sample" do
      it "raises ArgumentError for a string local root span id" do
        expect { sample({ "cpu-samples" => 1 }, labels: [["local root span id", "incorrect"]]) }
          .to raise_error(ArgumentError, /local root span id.*"incorrect"/)
      end

      it "raises ArgumentError for an unknown value type, naming it" do
        expect { sample({ "cpu-tim" => 1 }) }.to raise_error(ArgumentError, /"cpu-tim"/)
      end

      it "raises ArgumentError for a label key given twice" do
        expect { sample({ "cpu-samples" => 1 }, labels: [%w[k a]], numeric_labels: [["k", 1]]) }
          .to raise_error(ArgumentError, /"k"/)
      end

      it "leaves the slots as they were" do
        begin
          sample({ "cpu-samples" => 1 }, labels: [["local root span id", "x"]])
        rescue ArgumentError
          nil
        end
        expect([active_slot, slot_one_locked?, slot_two_locked?]).to eq [1, false, true]
        sample({ "cpu-samples" => 1 })
        expect(samples.size).to eq 1
      end
    end

    describe "trace endpoints" do
      it "label the matching samples taken before and after the endpoint is recorded" do
        values = { "cpu-time" => 101, "cpu-samples" => 1, "wall-time" => 789 }
        take = proc { |span| sample(values, labels: [%w[state unknown]], numeric_labels: span ? [["local root span id", span]] : []) }

        take.call(nil)
        take.call(456)
        take.call(123)
        testing._native_record_endpoint(recorder, 123, "recorded-endpoint")
        take.call(nil)
        take.call(456)
        take.call(123)

        # Each call is its own line, so six distinct samples.
        expect(samples.size).to eq 6
        without_state = samples.map { |s| s.labels.reject { |k, _| k == :state } }
        expect(without_state.count(&:empty?)).to eq 2
        expect(without_state.count({ "local root span id": 456 })).to eq 2
        expect(without_state.count({ "local root span id": 123, "trace endpoint": "recorded-endpoint" })).to eq 2
      end
    end

    describe "heap samples and sizes" do
      let(:sample_rate) { 50 }
      let(:values) do
        { "cpu-time" => 101, "cpu-samples" => 1, "wall-time" => 789, "alloc-samples" => sample_rate,
          "timeline" => 42, "heap_sample" => true }
      end
      let(:labels) { [%w[label_a value_a], %w[state unknown]] }

      let(:a_string) { "a beautiful string" }
      let(:an_array) { (1..100).to_a.compact }
      let(:a_hash) { { "a" => 1, "b" => "2", "c" => true, "d" => Object.new } }

      # The seed's two-step allocation report (track, then the allocation sample that ends the
      # recording), then the commit of the deferred recording. Returns the tracked id or nil.
      def sample_allocation(obj, stack: ruby_stack)
        testing._native_track_object(recorder, obj, sample_rate, obj.class.name)
        testing._native_sample(recorder, stack, values, labels, [])
        testing._native_commit_pending_heap_recordings(recorder)
        testing._native_record_id_for(recorder, obj)
      end

      # Two call sites, so two distinct stacks.
      def two_sites(index, obj)
        if index.even?
          sample_allocation(obj, stack: ruby_stack)
        else
          sample_allocation(obj, stack: ruby_stack)
        end
      end

      let(:heap_samples) { samples.select { |s| s.value?(:"heap-live-samples") } }
      let(:other_samples) { samples.reject { |s| s.value?(:"heap-live-samples") } }

      before do
        objects = [a_string, an_array, "interpolated #{sample_rate}", (-10..-1).to_a, a_hash,
          { "z" => -1, "y" => "-2" }, Object.new]
        @num_allocations = 0
        objects.each_with_index do |obj, i|
          two_sites(i, obj)
          @num_allocations += 1
          GC.start # one GC epoch per allocation: distinct ages
        end
        objects.clear
        GC.start
        # Churn and collect again, so no stale reference to the dropped objects stays around
        # for the conservative stack scan.
        objects = ["more #{sample_rate}", (-20..-10).to_a, Object.new]
        objects.clear
        GC.start
      end

      after do |example|
        puts("heap recorder: #{testing._native_debug_heap_recorder(recorder).inspect}") if example.exception
      end

      context "when heap profiling is off" do
        it "leaves them out, and tracking is a no-op" do
          expect(samples.size).to eq 2
          expect(samples.map { |s| s.values.keys }.flatten).not_to include(:"heap-live-samples", :"heap-live-size")
          expect(testing._native_record_id_for(recorder, a_string)).to be_nil
        end
      end

      context "when heap profiling is on" do
        let(:heap_samples_enabled) { true }
        let(:heap_size_enabled) { true }

        it "has one sample per class of the objects still alive, with a gc gen age" do
          expect(heap_samples.size).to eq 3
          expect(heap_samples.map { |s| s.labels[:"allocation class"] }).to contain_exactly("String", "Array", "Hash")
          expect(heap_samples.map { |s| s.labels[:"gc gen age"] }).to all(be_a(Integer).and(be > 0))
        end

        it "weighs sizes from ObjectSpace.memsize_of by the sample rate" do
          by_class = heap_samples.to_h { |s| [s.labels[:"allocation class"], s.values[:"heap-live-size"]] }
          expect(by_class).to eq(
            "String" => ObjectSpace.memsize_of(a_string) * sample_rate,
            "Array" => ObjectSpace.memsize_of(an_array) * sample_rate,
            "Hash" => ObjectSpace.memsize_of(a_hash) * sample_rate,
          )
          expect(heap_samples.map { |s| s.values[:"heap-live-samples"] }).to all(eq sample_rate)
        end

        context "for a class object" do
          let(:a_class) { Class.new }

          before do
            sample_allocation(a_class)
            GC.start
          end

          it "tracks it and reports its size" do
            class_sample = heap_samples.find { |s| s.labels[:"allocation class"] == "Class" }
            expect(class_sample&.values&.fetch(:"heap-live-size")).to eq ObjectSpace.memsize_of(a_class) * sample_rate
          end
        end

        it "ages objects in GC generations, newest youngest" do
          age = heap_samples.to_h { |s| [s.labels[:"allocation class"], s.labels[:"gc gen age"]] }
          expect(age.values_at("Hash", "Array", "String")).to eq age.values_at("Hash", "Array", "String").sort
          expect(age.values.uniq.size).to eq 3
          # The hash was tracked 5th of 7, a GC after each, then two more: 5 GCs since, maybe
          # one more of the VM's own.
          expect(age["Hash"]).to be_between(5, 6)
          expect(age["String"] - age["Hash"]).to eq 4
        end

        it "keeps the other sample types exact" do
          expect(other_samples.size).to eq 2
          sums = Hash.new(0)
          other_samples.each { |s| s.values.each { |k, v| sums[k] += v } }
          expected = { "heap-live-samples": 0, "heap-live-size": 0, "alloc-samples-unscaled": 0 }
          values.each { |k, v| expected[k.to_sym] = v * @num_allocations unless k == "heap_sample" }
          expect(sums).to eq expected
        end

        it "leaves out objects that have not survived a GC (age 0)" do
          kept = []
          site_line = __LINE__ + 1
          allocate = proc { |i| kept << "string number #{i}"; sample_allocation(kept.last) }
          57.times(&allocate)
          GC.start
          begin
            GC.disable
            (57...123).each(&allocate)
            at_site = heap_samples.select { |s| s.has_location?(path: __FILE__, line: site_line) }
            expect(at_site.sum { |s| s.values[:"heap-live-samples"] }).to eq 57 * sample_rate
          ensure
            GC.enable
          end
        end

        it "tracks allocations made while a long serialization holds the heap" do
          testing._native_start_fake_slow_heap_serialization(recorder)
          kept = []
          site_line = __LINE__ + 1
          123.times { |i| kept << "string number #{i}"; sample_allocation(kept.last) }
          testing._native_end_fake_slow_heap_serialization(recorder)
          GC.start
          at_site = heap_samples.find { |s| s.has_location?(path: __FILE__, line: site_line) }
          expect(at_site&.values&.fetch(:"heap-live-samples")).to eq 123 * sample_rate
        end

        it "fails a serialization while another holds the heap, keeping the samples" do
          testing._native_start_fake_slow_heap_serialization(recorder)
          expect { recorder.serialize }
            .to raise_error(Ferroprof::SerializationError, /prepared without the previous one having been finished/)
          expect([active_slot, slot_one_locked?, slot_two_locked?]).to eq [1, false, true]
          testing._native_end_fake_slow_heap_serialization(recorder)
          expect(other_samples.size).to eq 2
          expect(heap_samples.size).to eq 3
          expect(recorder.stats).to include(serialization_failures: 1, serialization_successes: 1)
        end

        it "counts heap samples in the recorded samples" do
          kept = Array.new(123) { |i| "string number #{i}" }
          kept.each { |s| sample_allocation(s) }
          GC.start
          expect(profile_stats).to include(
            recorded_samples: (@num_allocations + 123) + (3 + 123),
            heap_iteration_prep_time_ns: be > 0,
            heap_profile_build_time_ns: be > 0,
          )
        end

        it "records the allocation stacks" do
          stacks = heap_samples.map(&:locations).uniq
          expect(stacks.size).to eq 2
          expect(samples.map(&:locations).uniq.size).to eq 2
          site = ->(stack) { stack.find { |f| f.label.end_with?("two_sites") } }
          one, two = stacks
          expect(one.reject { |f| f == site[one] }).to eq(two.reject { |f| f == site[two] })
          expect(site[one].lineno).to be_within(2).of(site[two].lineno)
        end

        context "with heap_sample_every: 2" do
          let(:heap_sample_every) { 2 }

          it "tracks every second allocation, weighed by both rates" do
            expect(heap_samples.size).to eq 1
            expect(heap_samples.first.labels[:"allocation class"]).to eq "Array"
            expect(heap_samples.first.values[:"heap-live-samples"]).to eq sample_rate * 2
          end
        end

        context "when an allocation sample ends a recording that was never started" do
          it "raises a RuntimeError and leaves the slots open" do
            expect { sample(values) }.to raise_error(RuntimeError, /Ended a heap recording/)
            expect([active_slot, slot_one_locked?, slot_two_locked?]).to eq [1, false, true]
          end
        end

        context "when a recording is started twice" do
          it "raises, naming the misuse" do
            testing._native_track_object(recorder, Object.new, 1, "Object")
            expect { testing._native_track_object(recorder, Object.new, 1, "Object") }
              .to raise_error(RuntimeError, /consecutive heap allocation recording starts/)
          end
        end

        describe "pending recordings" do
          def pending_count = testing._native_debug_heap_recorder(recorder).dig(:state, :pending_recordings_count)

          def track_uncommitted(obj)
            testing._native_track_object(recorder, obj, sample_rate, obj.class.name)
            sample(values)
          end

          it "wait for the commit, which clears them" do
            3.times { track_uncommitted(Object.new) }
            expect(pending_count).to eq 3
            testing._native_commit_pending_heap_recordings(recorder)
            expect(pending_count).to eq 0
          end

          it "keep their objects alive until committed" do
            ids = Thread.new do
              objs = Array.new(3) { Object.new }
              objs.each { |o| track_uncommitted(o) }
              objs.map(&:object_id)
            end.value
            GC.start
            testing._native_commit_pending_heap_recordings(recorder)
            expect(ids.map { |id| recorded?(id) }).to eq [true, true, true]
          end
        end

        describe "the after-GC step" do
          # Allocates and samples in a thread that ends at once, so no stale reference to the
          # object survives on a machine stack; returns the record id.
          def sample_and_collect
            id = Thread.new { sample_allocation(Object.new) }.value
            GC.start
            id
          end

          before do
            GC.disable
            @ids = Array.new(4) { sample_and_collect }
          end

          after { GC.enable }

          context "with heap_clean_after_gc_enabled" do
            it "drops dead objects of age 1 and 2, leaving older ones to the serialization" do
              expect(@ids.map { |id| recorded?(id) }).to eq [true, true, true, true]
              after_gc_step
              expect(@ids.map { |id| recorded?(id) }).to eq [true, true, false, false]
              recorder.serialize
              expect(@ids.map { |id| recorded?(id) }).to eq [false, false, false, false]
            end

            it "does nothing while a heap serialization is under way" do
              testing._native_start_fake_slow_heap_serialization(recorder)
              id = sample_and_collect
              expect do
                testing._native_heap_recorder_reset_last_update(recorder)
                after_gc_step
              end.not_to change { recorded?(id) }.from(true)
              testing._native_end_fake_slow_heap_serialization(recorder)
              expect do
                testing._native_heap_recorder_reset_last_update(recorder)
                after_gc_step
              end.to change { recorded?(id) }.from(true).to(false)
            end

            it "waits the minimum time between two young updates" do
              first = sample_and_collect
              expect { after_gc_step }.to change { recorded?(first) }.from(true).to(false)
              second = sample_and_collect
              expect { after_gc_step }.not_to change { recorded?(second) }.from(true)
              expect(recorder.stats[:heap_recorder_snapshot][:lifetime_updates_skipped_time]).to eq 1
            end

            it "does not wait for it when serializing" do
              first = sample_and_collect
              expect { after_gc_step }.to change { recorded?(first) }.from(true).to(false)
              second = sample_and_collect
              expect { after_gc_step }.not_to change { recorded?(second) }.from(true)
              expect { serialize }.to change { recorded?(second) }.from(true).to(false)
            end

            it "skips an update when no GC ran since the last one" do
              testing._native_heap_recorder_reset_last_update(recorder)
              after_gc_step
              testing._native_heap_recorder_reset_last_update(recorder)
              expect { after_gc_step }
                .to change { recorder.stats[:heap_recorder_snapshot][:lifetime_updates_skipped_gcgen] }.by(1)
            end
          end

          context "without heap_clean_after_gc_enabled" do
            let(:heap_clean_after_gc_enabled) { false }

            it "does nothing; the serialization drops them all" do
              after_gc_step
              expect(@ids.map { |id| recorded?(id) }).to eq [true, true, true, true]
              recorder.serialize
              expect(@ids.map { |id| recorded?(id) }).to eq [false, false, false, false]
            end
          end
        end
      end
    end

    context "when serialization fails" do
      it "raises Ferroprof::SerializationError (a RuntimeError) with the reason" do
        allow(described_class).to receive(:_native_serialize).and_return([:error, "test error message"])
        expect { serialize }.to raise_error(Ferroprof::SerializationError, /test error message/)
        expect(Ferroprof::SerializationError.ancestors).to include(RuntimeError)
      end
    end

    context "when serializing several times in a row" do
      it "tiles time: each start is the previous finish" do
        results = Array.new(4) { recorder.serialize }
        results.each { |s, f, _| expect(s).to be <= f }
        results.each_cons(2) { |(_, f1, _), (s2, _, _)| expect(s2).to eq f1 }
      end

      it "starts the next profile no earlier than the previous call" do
        recorder
        before_call = Time.now
        recorder.serialize
        expect(recorder.serialize.first).to be >= before_call
      end
    end
  end

  describe "#serialize!" do
    it "returns the pprof bytes" do
      sample({ "cpu-samples" => 3 })
      expect(samples_from_pprof(recorder.serialize!).sum { |s| s.values[:"cpu-samples"] }).to eq 3
    end

    it "raises a RuntimeError with the reason on failure" do
      allow(described_class).to receive(:_native_serialize).and_return([:error, "test error message"])
      expect { recorder.serialize! }.to raise_error(RuntimeError, /test error message/)
    end
  end

  describe "#reset_after_fork" do
    it "keeps slot one active when it was" do
      recorder.reset_after_fork
      expect([active_slot, slot_one_locked?, slot_two_locked?]).to eq [1, false, true]
    end

    it "makes slot one active again when slot two was" do
      recorder.serialize
      expect { recorder.reset_after_fork }.to change { [active_slot, slot_one_locked?, slot_two_locked?] }
        .from([2, true, false]).to([1, false, true])
    end

    it "empties both profiles" do
      values = { "cpu-time" => 123, "cpu-samples" => 456, "wall-time" => 789 }
      sample(values)
      expect(samples_from_pprof(recorder.serialize[2]).size).to eq 1
      sample(values)
      recorder.reset_after_fork
      expect(samples_from_pprof(recorder.serialize[2])).to be_empty
      expect(samples_from_pprof(recorder.serialize[2])).to be_empty
    end

    it "starts the active profile at the reset" do
      recorder
      now = Time.now
      recorder.reset_after_fork
      expect(recorder.serialize.first).to be >= now
    end

    it "works in a forked child" do
      sample({ "cpu-samples" => 5 })
      reader, writer = IO.pipe
      pid = fork do
        reader.close
        recorder.reset_after_fork
        sample({ "cpu-samples" => 2 })
        writer.write(Marshal.dump(samples_from_pprof(recorder.serialize[2]).sum { |s| s.values[:"cpu-samples"] }))
        writer.close
        exit!(0)
      end
      writer.close
      child_total = Marshal.load(reader.read)
      Process.wait(pid)
      expect(child_total).to eq 2
      expect(samples_from_pprof(recorder.serialize[2]).sum { |s| s.values[:"cpu-samples"] }).to eq 5
    end
  end

  describe "#stats" do
    it "has the lifetime serialization stats" do
      5.times { recorder.serialize }
      stats = recorder.stats
      expect(stats).to include(
        serialization_successes: 5, serialization_failures: 0,
        serialization_time_ns_min: be > 0, serialization_time_ns_max: be > 0,
        serialization_time_ns_avg: be > 0, serialization_time_ns_total: be > 0,
        heap_recorder_snapshot: nil,
      )
      min, max, avg, total = stats.values_at(:serialization_time_ns_min, :serialization_time_ns_max,
        :serialization_time_ns_avg, :serialization_time_ns_total)
      expect(min).to be <= avg
      expect(avg).to be <= max
      expect(total).to be_within(1e-4).of(avg * 5)
    end

    it "has no times before the first serialization" do
      expect(recorder.stats).to include(serialization_time_ns_min: nil, serialization_time_ns_avg: nil)
    end

    context "with heap profiling" do
      let(:heap_samples_enabled) { true }
      let(:heap_size_enabled) { true }

      def track(obj, stack)
        testing._native_track_object(recorder, obj, 1, obj.class.name)
        testing._native_sample(recorder, stack, { "alloc-samples" => 1, "heap_sample" => true }, [], [])
        testing._native_commit_pending_heap_recordings(recorder)
      end

      it "has the heap recorder's state after the serialization's update" do
        dead_stack = [["dead", "stats.rb", 1]]
        live_stack = [["live", "stats.rb", 2]]
        young_stack = [["young", "stats.rb", 3]]
        # The dead are tracked from a thread that ends, so no stack keeps them.
        Thread.new { 10.times { |i| track([i], dead_stack) } }.join
        live = Array.new(6) { |i| Object.new.tap { |o| o.freeze if i.odd? } }
        live.each { |o| track(o, live_stack) }
        GC.start
        begin
          GC.disable
          young = Array.new(3) { Object.new }
          young.each { |o| track(o, young_stack) }
          recorder.serialize
        ensure
          GC.enable
        end
        expect(recorder.stats.fetch(:heap_recorder_snapshot)).to include(
          num_object_records: 9,
          num_heap_records: 2,
          last_update_objects_alive: 6,
          last_update_objects_dead: 10,
          last_update_objects_skipped: 3,
          last_update_objects_frozen: 3,
        )
        expect(live.size + young.size).to eq 9
      end
    end
  end

  describe "strings shared by consecutive profiles" do
    it "appear in each profile's string table" do
      2.times do
        sample({ "cpu-samples" => 1 }, labels: [%w[key hello]], stack: [["world", "strings.rb", 1]])
        profile = decode_profile(recorder.serialize[2])
        expect(profile.string_table).to include("key", "hello", "world", "strings.rb")
        expect(samples_from_pprof(recorder.serialize[2])).to be_empty
      end
    end
  end
end
