//! The two-slot stack recorder.
//!
//! Two profiles, each behind its own gate. Samplers only *try* gates (two rounds over both slots)
//! and get an error value instead of waiting; the serializer flips slots, adds the heap samples to
//! the now-inactive slot, encodes it and advances the string generation. Unlike the seed, several
//! sampler threads may record at once (see `docs/architecture.md`, "The two-slot protocol").
//!
//! ## Protocol
//! Each slot is a gate (`gate.rs`: closed bit + samplers inside) in front of a data mutex holding the
//! profile. A sampler enters the first open gate in two rounds over both slots, then takes the
//! data mutex, which only other samplers contend for and only for one add. The serializer (one at
//! a time, behind its own mutex) resets the inactive slot, opens its gate, closes the active gate
//! and waits for the samplers inside to leave; from then on it owns the old slot alone.

use std::time::SystemTime;

use crate::error::RecorderError;
use crate::gate::Gate;
use crate::heap::{HeapConfig, HeapRecorder};
use crate::pprof::Compression;
use crate::profile::{BulkBuffers, Frame, Label, Profile, ProfileMetadata, Sample};
use crate::sample_types::{
    ExtraValues, SampleLayout, SampleTypeConfig, SampleTypeExtras, SampleValues,
};
use crate::spin::SpinLock;
use crate::strings::StringStorage;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

mod fork;
mod heap;
mod serialize;
mod stats;

pub use heap::{ALLOCATION_CLASS_LABEL, GC_GEN_AGE_LABEL};
use serialize::SerializerState;
pub use serialize::{LateSamples, SerializedProfile, SharedStateGate};
pub use stats::{LifetimeStats, ProfileStats, RecorderStats};

/// Stack recorder configuration.
#[derive(Debug, Clone, Default)]
pub struct RecorderConfig {
    /// Which of the seed's sample types are recorded.
    pub sample_types: SampleTypeConfig,
    /// Used only when heap samples or heap size are enabled.
    pub heap: HeapConfig,
    /// How serialized profiles are compressed.
    pub compression: Compression,
    /// Cap on the memory of each in-flight profile's tables (see [`Profile::set_max_bytes`]):
    /// past it, samples of new stacks fold into a `[stacks dropped: over memory cap]` frame
    /// and are counted ([`ProfileStats::dropped_stacks`]). `None` (the default): no cap.
    pub max_profile_bytes: Option<u64>,
}

/// What [`StackRecorder::with_extras`] adds to a seed [`RecorderConfig`]. The default adds
/// nothing: [`StackRecorder::new`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecorderExtras {
    /// Changes to the seed's layout (added types, the always-on pair).
    pub sample_types: SampleTypeExtras,
    /// What every serialized profile says about itself (default type, period). A default
    /// type the layout lacks is a configuration error.
    pub metadata: ProfileMetadata,
}

/// What a slot's data mutex protects.
struct SlotData {
    profile: Profile,
    /// Samples added since the last reset (heap samples included).
    recorded_samples: u64,
}

impl SlotData {
    fn reset(&mut self, start: SystemTime) {
        self.profile.reset(start);
        self.recorded_samples = 0;
    }
}

struct Slot {
    gate: Gate,
    data: SpinLock<SlotData>,
}

/// Leaves the gate when dropped, so no error path (or panic) leaves a sampler counted inside.
struct Entered<'a> {
    slot: &'a Slot,
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        self.slot.gate.leave();
    }
}

/// The recorder. `Send + Sync`: share it in an `Arc`.
pub struct StackRecorder {
    config: RecorderConfig,
    extras: RecorderExtras,
    layout: SampleLayout,
    strings: Arc<StringStorage>,
    heap: Option<HeapRecorder>,
    slots: [Slot; 2],
    serializer: SpinLock<SerializerState>,
    /// Mirror of `SerializerState::active_slot` readable while a serialization runs.
    active_slot: AtomicU8,
    lifetime: SpinLock<LifetimeStats>,
    /// Samples folded into the dropped-stacks frame so far (all profiles).
    dropped_stacks: AtomicU64,
}

impl StackRecorder {
    /// A recorder of the seed's configuration (see [`Self::with_extras`] for more).
    pub fn new(config: RecorderConfig) -> Result<Self, RecorderError> {
        Self::with_extras(config, RecorderExtras::default())
    }

    /// A recorder of `config` changed by `extras`.
    pub fn with_extras(
        config: RecorderConfig,
        extras: RecorderExtras,
    ) -> Result<Self, RecorderError> {
        if !config.compression.is_available() {
            return Err(RecorderError::Config(format!(
                "compression {:?} is not available in this build (enable the `zstd` feature)",
                config.compression
            )));
        }
        let layout = SampleLayout::with_extras(&config.sample_types, &extras.sample_types);
        let strings = Arc::new(StringStorage::new());
        // Checked once here: every slot's profile gets the same metadata.
        Profile::new(layout.types(), None, SystemTime::UNIX_EPOCH)
            .set_metadata(extras.metadata)
            .map_err(|e| RecorderError::Config(e.to_string()))?;
        let heap = if config.sample_types.heap_enabled() {
            let mut heap_config = config.heap.clone();
            heap_config.size_enabled = config.sample_types.heap_size;
            Some(HeapRecorder::new(heap_config, strings.clone())?)
        } else {
            None
        };
        let start = SystemTime::now();
        let slot = |open: bool| Slot {
            gate: Gate::new(open),
            data: SpinLock::new(SlotData {
                profile: slot_profile(&layout, &strings, &config, &extras, start),
                recorded_samples: 0,
            }),
        };
        // A new recorder starts with slot 1 active.
        let slots = [slot(true), slot(false)];
        Ok(StackRecorder {
            config,
            extras,
            layout,
            strings,
            heap,
            slots,
            serializer: SpinLock::new(SerializerState {
                active_slot: 1,
                bulk: BulkBuffers::default(),
                heap_stacks: Vec::new(),
            }),
            active_slot: AtomicU8::new(1),
            lifetime: SpinLock::new(LifetimeStats::default()),
            dropped_stacks: AtomicU64::new(0),
        })
    }

    /// The sample types recorded and their positions in a sample's values.
    pub fn layout(&self) -> &SampleLayout {
        &self.layout
    }

    /// The string storage the recorder's profiles and heap recorder share.
    pub fn strings(&self) -> &Arc<StringStorage> {
        &self.strings
    }

    /// `None` when heap profiling is disabled.
    pub fn heap(&self) -> Option<&HeapRecorder> {
        self.heap.as_ref()
    }

    /// The configuration this recorder was built with.
    pub fn config(&self) -> &RecorderConfig {
        &self.config
    }

    /// The extras this recorder was built with (none for [`Self::new`]).
    pub fn extras(&self) -> &RecorderExtras {
        &self.extras
    }

    /// Enters the active slot's gate: two rounds over both slots, never waiting.
    #[inline]
    fn enter(&self) -> Result<Entered<'_>, RecorderError> {
        for _ in 0..2 {
            for slot in &self.slots {
                if slot.gate.try_enter() {
                    return Ok(Entered { slot });
                }
            }
        }
        Err(RecorderError::NoActiveSlot {
            active_slot: self.active_slot.load(Ordering::Relaxed),
        })
    }

    /// Sampler path: never blocks on a serialization. `end_timestamp_ns` 0 = aggregated.
    pub fn record_sample(
        &self,
        frames: &[Frame<'_>],
        values: &SampleValues,
        labels: &[Label<'_>],
        end_timestamp_ns: i64,
    ) -> Result<(), RecorderError> {
        self.record_sample_with(
            frames,
            values,
            &ExtraValues::default(),
            labels,
            end_timestamp_ns,
        )
    }

    /// [`Self::record_sample`] with the values of the added types (`alloc-space`).
    pub fn record_sample_with(
        &self,
        frames: &[Frame<'_>],
        values: &SampleValues,
        extra: &ExtraValues,
        labels: &[Label<'_>],
        end_timestamp_ns: i64,
    ) -> Result<(), RecorderError> {
        let placed = self.layout.place_with(values, extra);
        let sample = Sample {
            frames,
            values: &placed[..self.layout.len()],
            labels,
            end_timestamp_ns,
        };
        let entered = self.enter()?;
        if values.heap_sample {
            if let Some(heap) = &self.heap {
                // On error `entered` drops here and the sampler leaves the slot.
                heap.end_recording(frames)?;
            }
        }
        let mut data = entered.slot.data.lock();
        let dropped = data.profile.dropped_samples();
        data.profile.add(&sample)?;
        data.recorded_samples += 1;
        if data.profile.dropped_samples() != dropped {
            self.dropped_stacks.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Sampler path: never blocks on a serialization. Also names the heap objects still
    /// tracked for that trace ([`Self::track_allocation_in`]).
    pub fn record_endpoint(
        &self,
        local_root_span_id: u64,
        endpoint: &str,
    ) -> Result<(), RecorderError> {
        let named = match &self.heap {
            Some(heap) => heap.name_context(local_root_span_id, endpoint),
            None => Ok(()),
        };
        let entered = self.enter()?;
        let mut data = entered.slot.data.lock();
        data.profile.set_endpoint(local_root_span_id, endpoint)?;
        Ok(named?)
    }

    /// Testing aid: 1 or 2.
    pub fn active_slot(&self) -> u8 {
        self.active_slot.load(Ordering::Relaxed)
    }

    /// Testing aid: whether slot 1 or 2 is locked (closed to samplers).
    pub fn is_slot_locked(&self, slot: u8) -> bool {
        match slot {
            1 => self.slots[0].gate.is_closed(),
            2 => self.slots[1].gate.is_closed(),
            _ => false,
        }
    }

    /// Testing aid: holds slot `slot` (1 or 2) the way a sampler does, until the guard drops.
    /// Returns `None` when the slot's gate is closed.
    #[doc(hidden)]
    pub fn hold_slot_for_testing(&self, slot: u8) -> Option<impl Drop + '_> {
        let s = self.slots.get(usize::from(slot).checked_sub(1)?)?;
        s.gate.try_enter().then_some(Entered { slot: s })
    }
}

/// An empty slot profile of the configuration (whose metadata `with_extras` checked).
fn slot_profile(
    layout: &SampleLayout,
    strings: &Arc<StringStorage>,
    config: &RecorderConfig,
    extras: &RecorderExtras,
    start: SystemTime,
) -> Profile {
    let mut p = Profile::new(layout.types(), Some(strings.clone()), start)
        .with_max_bytes(config.max_profile_bytes);
    // Cannot fail: the same metadata was accepted for the same types at construction.
    let _ = p.set_metadata(extras.metadata);
    p
}

#[cfg(test)]
mod tests {
    use super::heap::HEAP_OBJECTS_PER_STEP;
    use super::*;
    use crate::error::ProfileError;
    use crate::pprof::Symbolizer;
    use crate::profile::{LOCAL_ROOT_SPAN_ID_LABEL, TRACE_ENDPOINT_LABEL};

    fn no_heap() -> RecorderConfig {
        RecorderConfig {
            sample_types: SampleTypeConfig {
                heap_samples: false,
                heap_size: false,
                ..SampleTypeConfig::all()
            },
            ..RecorderConfig::default()
        }
    }

    fn one(r: &StackRecorder, n: i64) {
        let v = SampleValues {
            cpu_or_wall_samples: n,
            ..Default::default()
        };
        r.record_sample(&[Frame::sym("f", "f.rs", 1)], &v, &[], 0)
            .unwrap();
    }

    #[test]
    fn live_heap_samples_keep_their_request_across_profiles() {
        let r = StackRecorder::new(RecorderConfig {
            heap: HeapConfig::native(),
            ..RecorderConfig::default()
        })
        .unwrap();
        let frames = [Frame::sym("cache_insert", "c.rs", 3)];
        // Request 7 allocates two objects (one freed), request 8 one, then both end; 9 never
        // allocated anything.
        r.track_allocation_in(0x10, 1, 100, None, &frames, 7)
            .unwrap();
        // The bytes the object stands for (weight x size) come back when it is freed.
        assert_eq!(
            r.track_allocation_in(0x20, 3, 200, None, &frames, 7)
                .unwrap(),
            600
        );
        r.track_allocation_in(0x30, 1, 400, None, &frames, 8)
            .unwrap();
        r.track_allocation(0x40, 1, 800, None, &frames).unwrap();
        assert_eq!(r.untrack_allocation_bytes(0x20), Some(600));
        assert_eq!(r.untrack_allocation_bytes(0x20), None, "already untracked");
        r.record_endpoint(7, "GET /cache").unwrap();
        r.record_endpoint(8, "GET /other").unwrap();
        r.record_endpoint(9, "GET /none").unwrap();
        assert_eq!(r.stats().heap.unwrap().num_contexts, 2);
        // Later profiles too: the objects live on, their requests are long gone.
        for round in 0..2 {
            let p = r.serialize(None).unwrap();
            let d = ferroprof_pprof::decode(&p.encoded.bytes).unwrap();
            let size = d.value_index("heap-live-size").unwrap();
            let mut live: Vec<(i64, Option<i64>, Option<&str>)> = d
                .sample
                .iter()
                .filter(|s| s.value[size] > 0)
                .map(|s| {
                    (
                        s.value[size],
                        d.label_num(s, LOCAL_ROOT_SPAN_ID_LABEL),
                        d.label_str(s, TRACE_ENDPOINT_LABEL),
                    )
                })
                .collect();
            live.sort();
            assert_eq!(
                live,
                vec![
                    (100, Some(7), Some("GET /cache")),
                    (400, Some(8), Some("GET /other")),
                    (800, None, None),
                ],
                "round {round}"
            );
        }
        for id in [0x10, 0x30, 0x40] {
            assert!(r.untrack_allocation(id));
        }
        assert_eq!(r.stats().heap.unwrap().num_contexts, 0);
    }

    #[test]
    fn new_recorder_has_slot_one_active() {
        let r = StackRecorder::new(no_heap()).unwrap();
        assert_eq!(r.active_slot(), 1);
        assert!(!r.is_slot_locked(1));
        assert!(r.is_slot_locked(2));
        assert!(!r.is_slot_locked(3));
        assert!(r.heap().is_none());
        assert_eq!(r.stats().heap, None);
        assert_eq!(r.stats().lifetime, LifetimeStats::default());
    }

    #[test]
    fn serialize_flips_and_counts() {
        let r = StackRecorder::new(no_heap()).unwrap();
        one(&r, 1);
        one(&r, 2);
        let p = r.serialize(None).unwrap();
        assert_eq!(p.stats.recorded_samples, 2);
        assert_eq!(r.active_slot(), 2);
        assert!(r.is_slot_locked(1));
        assert!(!r.is_slot_locked(2));
        let d = ferroprof_pprof::decode(&p.encoded.bytes).unwrap();
        assert_eq!(d.total("cpu-samples"), Some(3));
        let q = r.serialize(None).unwrap();
        assert_eq!(q.start, p.finish);
        assert_eq!(q.stats.recorded_samples, 0);
        assert_eq!(r.active_slot(), 1);
        let life = r.stats().lifetime;
        assert_eq!(life.serialization_successes, 2);
        assert_eq!(life.serialization_failures, 0);
        assert!(life.serialization_time_ns_min <= life.serialization_time_ns_max);
        assert!(life.serialization_time_ns_avg.is_some());
    }

    #[test]
    fn sampler_errors_when_both_gates_closed() {
        let r = StackRecorder::new(no_heap()).unwrap();
        r.slots[0].gate.close();
        let err = r
            .record_sample(&[], &SampleValues::default(), &[], 0)
            .unwrap_err();
        assert_eq!(err, RecorderError::NoActiveSlot { active_slot: 1 });
        assert!(r.record_endpoint(1, "x").is_err());
        r.reset_after_fork();
        one(&r, 1);
    }

    #[test]
    fn profile_errors_release_the_slot() {
        let r = StackRecorder::new(no_heap()).unwrap();
        let err = r
            .record_sample(
                &[],
                &SampleValues::default(),
                &[Label::num("k", 1), Label::num("k", 2)],
                0,
            )
            .unwrap_err();
        assert!(matches!(
            err,
            RecorderError::Profile(ProfileError::DuplicateLabelKey(_))
        ));
        assert_eq!(r.slots[0].gate.inside(), 0);
        assert_eq!(r.slots[1].gate.inside(), 0);
        one(&r, 1);
        assert_eq!(r.serialize(None).unwrap().stats.recorded_samples, 1);
    }

    #[test]
    fn heap_calls_without_heap_are_errors_or_noops() {
        let r = StackRecorder::new(no_heap()).unwrap();
        // The seed's track_object is a no-op without heap profiling; so is this one.
        assert_eq!(r.track_object(1, 1, None), Ok(false));
        assert!(!r.is_heap_object_recorded(1));
        r.finalize_pending_heap_recordings().unwrap();
        assert_eq!(
            r.track_allocation(1, 1, 8, None, &[]),
            Err(RecorderError::HeapDisabled)
        );
        assert!(!r.untrack_allocation(1));
        r.after_gc_step();
        // A heap_sample flag without a heap recorder records the sample normally.
        let v = SampleValues {
            cpu_or_wall_samples: 1,
            heap_sample: true,
            ..Default::default()
        };
        r.record_sample(&[], &v, &[], 0).unwrap();
    }

    #[test]
    fn unavailable_compression_is_a_config_error() {
        let cfg = RecorderConfig {
            compression: Compression::Zstd,
            ..no_heap()
        };
        let built = StackRecorder::new(cfg);
        assert_eq!(built.is_ok(), Compression::Zstd.is_available());
        if let Err(e) = built {
            assert!(matches!(e, RecorderError::Config(m) if m.contains("Zstd")));
        }
    }

    #[test]
    fn fork_hooks_in_the_parent() {
        let r = StackRecorder::new(no_heap()).unwrap();
        r.serialize(None).unwrap();
        one(&r, 1);
        r.before_fork();
        assert!(r.is_slot_locked(1) && r.is_slot_locked(2));
        assert!(r.serializer.try_lock().is_none());
        // Samplers are turned away, not kept waiting.
        let err = r
            .record_sample(&[], &SampleValues::default(), &[], 0)
            .unwrap_err();
        assert_eq!(err, RecorderError::NoActiveSlot { active_slot: 2 });
        r.after_fork_in_parent();
        assert_eq!(r.active_slot(), 2);
        assert!(r.is_slot_locked(1) && !r.is_slot_locked(2));
        one(&r, 2);
        let p = r.serialize(None).unwrap();
        let d = ferroprof_pprof::decode(&p.encoded.bytes).unwrap();
        assert_eq!(d.total("cpu-samples"), Some(3));
    }

    #[test]
    fn fork_hooks_in_the_child() {
        let r = StackRecorder::new(no_heap()).unwrap();
        r.serialize(None).unwrap();
        one(&r, 1);
        r.strings().intern("kept").unwrap();
        r.before_fork();
        r.after_fork_in_child();
        assert_eq!(r.active_slot(), 1);
        assert!(!r.is_slot_locked(1) && r.is_slot_locked(2));
        assert_eq!(r.strings().len(), 1);
        let p = r.serialize(None).unwrap();
        assert_eq!(p.stats.recorded_samples, 0);
        one(&r, 4);
        let p = r.serialize(None).unwrap();
        let d = ferroprof_pprof::decode(&p.encoded.bytes).unwrap();
        assert_eq!(d.total("cpu-samples"), Some(4));
    }

    #[test]
    fn fork_reset_leaks_a_profile_caught_mid_update() {
        let r = StackRecorder::new(no_heap()).unwrap();
        one(&r, 1);
        // As if a sampler of the parent held slot 1's data lock when the fork happened.
        std::mem::forget(r.slots[0].data.lock());
        std::mem::forget(r.lifetime.lock());
        r.reset_after_fork();
        one(&r, 2);
        let p = r.serialize(None).unwrap();
        let d = ferroprof_pprof::decode(&p.encoded.bytes).unwrap();
        assert_eq!(d.total("cpu-samples"), Some(2));
        assert_eq!(r.stats().lifetime.serialization_successes, 1);
    }

    /// Counts steps and says whether one is open.
    #[derive(Default)]
    struct Steps {
        inside: std::cell::Cell<bool>,
        entered: std::cell::Cell<u32>,
    }

    impl SharedStateGate for Steps {
        fn enter(&self) {
            assert!(!self.inside.replace(true), "steps do not nest");
            self.entered.set(self.entered.get() + 1);
        }
        fn leave(&self) {
            assert!(self.inside.replace(false), "left a step never entered");
        }
    }

    /// Checks that symbolization runs outside every step.
    struct OutsideSteps<'a>(&'a Steps, u32);

    impl Symbolizer for OutsideSteps<'_> {
        fn symbolize(&mut self, address: u64, out: &mut Vec<crate::pprof::ResolvedFrame>) {
            assert!(!self.0.inside.get(), "symbolized inside a step");
            self.1 += 1;
            out.push(crate::pprof::ResolvedFrame {
                name: format!("f{address}"),
                filename: "f.rs".into(),
                line: 1,
                ..Default::default()
            });
        }
    }

    #[test]
    fn gated_serialization_symbolizes_and_encodes_between_steps() {
        let r = StackRecorder::new(RecorderConfig {
            sample_types: SampleTypeConfig::all(),
            heap: HeapConfig::native(),
            ..RecorderConfig::default()
        })
        .unwrap();
        let objects = 3 * HEAP_OBJECTS_PER_STEP;
        for i in 0..objects {
            r.track_allocation(i + 1, 1, 16, None, &[Frame::Address(0x1000 + i)])
                .unwrap();
        }
        one(&r, 2);
        let steps = Steps::default();
        let mut sym = OutsideSteps(&steps, 0);
        let p = r.serialize_gated(Some(&mut sym), &steps).unwrap();
        assert!(!steps.inside.get(), "every step was left");
        assert!(sym.1 as u64 >= objects, "the heap stacks were symbolized");
        // Flip, heap samples (paused every HEAP_OBJECTS_PER_STEP objects), string generation.
        assert!(
            u64::from(steps.entered.get()) >= 2 + objects / HEAP_OBJECTS_PER_STEP,
            "{} steps",
            steps.entered.get()
        );
        let d = ferroprof_pprof::decode(&p.encoded.bytes).unwrap();
        assert_eq!(d.total("heap-live-samples"), Some(objects as i64));
        assert_eq!(d.total("cpu-samples"), Some(2));
    }

    #[test]
    fn recorder_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<StackRecorder>();
    }
}
