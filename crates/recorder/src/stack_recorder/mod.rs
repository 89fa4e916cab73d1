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

use std::collections::HashMap;
use std::time::{Instant, SystemTime};

use crate::error::{HeapError, ProfileError, RecorderError};
use crate::gate::Gate;
use crate::heap::{HeapConfig, HeapRecorder, HeapStats, LiveObject};
use crate::pprof::{Compression, EncodeOptions, EncodedProfile, Symbolizer};
use crate::profile::{
    BulkBuffers, Frame, Label, LabelSetId, LabelValue, PrefetchedStack, Profile, ProfileMetadata,
    RowId, Sample, StackId, Str, LOCAL_ROOT_SPAN_ID_LABEL, TRACE_ENDPOINT_LABEL,
};
use crate::sample_types::{
    ExtraValues, SampleLayout, SampleTypeConfig, SampleTypeExtras, SampleValues,
};
use crate::spin::{SpinGuard, SpinLock};
use crate::strings::{StringId, StringStorage};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

/// The labels of a live object's heap sample: its class (when known), its age, and the
/// request context it was allocated in (when it has one: the local root span id, and the
/// trace's endpoint once named).
fn heap_labels(obj: &LiveObject) -> Vec<Label<'static>> {
    let age = Label {
        key: Str::Lit(GC_GEN_AGE_LABEL),
        value: LabelValue::Num(i64::try_from(obj.gen_age).unwrap_or(i64::MAX)),
    };
    let mut labels = if obj.class == StringId::EMPTY {
        vec![age]
    } else {
        let class = Label {
            key: Str::Lit(ALLOCATION_CLASS_LABEL),
            value: LabelValue::Str(Str::Id(obj.class)),
        };
        vec![class, age]
    };
    if obj.local_root_span_id != 0 {
        // As samplers write it: the id's 64 bits as an i64.
        labels.push(Label::num(
            LOCAL_ROOT_SPAN_ID_LABEL,
            obj.local_root_span_id as i64,
        ));
        if obj.endpoint != StringId::EMPTY {
            labels.push(Label {
                key: Str::Lit(TRACE_ENDPOINT_LABEL),
                value: LabelValue::Str(Str::Id(obj.endpoint)),
            });
        }
    }
    labels
}

/// Label key of the class of a live heap object.
pub const ALLOCATION_CLASS_LABEL: &str = "allocation class";
/// Numeric label: generations (managed) or serializations (native) a live object survived.
pub const GC_GEN_AGE_LABEL: &str = "gc gen age";

/// Brackets the steps of a serialization that touch state shared with recording threads: the
/// slot flip, the heap recorder's locks and snapshot, the string storage. Between steps the
/// serializer works only on data it took out of the shared structures (the old slot's profile,
/// the heap snapshot): symbolizing and encoding run outside any step.
///
/// A process that forks closes its own gate in a `pthread_atfork` prepare handler and waits for
/// the threads inside: through this trait, it waits for one short step at most, never for a
/// whole serialization. A fork between two steps is safe for the child: what the serializer
/// held then is forced open and leaked by [`StackRecorder::reset_after_fork`] and
/// [`HeapRecorder::after_fork`], and no step leaves a structure shared with other threads
/// half-updated.
pub trait SharedStateGate {
    /// Before a step; may wait (for a fork under way, say).
    fn enter(&self);
    /// After the step.
    fn leave(&self);
}

/// No gate: [`StackRecorder::serialize`].
struct NoGate;

impl SharedStateGate for NoGate {
    fn enter(&self) {}
    fn leave(&self) {}
}

/// One step (see [`SharedStateGate`]): left when dropped, on every path.
struct Step<'g>(&'g dyn SharedStateGate);

impl<'g> Step<'g> {
    fn enter(gate: &'g dyn SharedStateGate) -> Self {
        gate.enter();
        Step(gate)
    }

    /// Leaves and enters again: lets a waiting fork through between two parts of a long step.
    fn pause(&self) {
        self.0.leave();
        self.0.enter();
    }
}

impl Drop for Step<'_> {
    fn drop(&mut self) {
        self.0.leave();
    }
}

/// Heap objects added to a profile between two pauses of their step (a fork waits for that many
/// at most: tens of microseconds).
const HEAP_OBJECTS_PER_STEP: u64 = 512;

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

/// Stats of one serialized profile.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProfileStats {
    /// Individual (unweighted) samples recorded into the slot, heap samples included.
    pub recorded_samples: u64,
    /// Time the whole serialization took.
    pub serialization_time_ns: u64,
    /// Time preparing the heap iteration took (the update and snapshot).
    pub heap_iteration_prep_time_ns: u64,
    /// Time adding the live heap's samples took.
    pub heap_profile_build_time_ns: u64,
    /// Samples (heap objects included) folded into the dropped-stacks frame because the
    /// profile was at its memory cap.
    pub dropped_stacks: u64,
    /// Bytes the profile's tables held when it was serialized (freed right after).
    pub profile_bytes: u64,
}

/// Stats over the recorder's lifetime.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LifetimeStats {
    /// Serializations that succeeded.
    pub serialization_successes: u64,
    /// Serializations that failed.
    pub serialization_failures: u64,
    /// Shortest successful serialization (`None` before the first).
    pub serialization_time_ns_min: Option<u64>,
    /// Longest successful serialization.
    pub serialization_time_ns_max: Option<u64>,
    /// Time all successful serializations took.
    pub serialization_time_ns_total: Option<u64>,
    /// Mean time of a successful serialization.
    pub serialization_time_ns_avg: Option<f64>,
}

/// What [`StackRecorder::stats`] returns.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RecorderStats {
    /// Serializations so far.
    pub lifetime: LifetimeStats,
    /// `None` when heap profiling is disabled.
    pub heap: Option<HeapStats>,
    /// Samples folded into the dropped-stacks frame over the memory cap, in all profiles so far
    /// (see [`RecorderConfig::max_profile_bytes`]).
    pub dropped_stacks: u64,
}

/// One serialization's result.
#[derive(Debug, Clone)]
pub struct SerializedProfile {
    /// When the serialized profile's recording began.
    pub start: SystemTime,
    /// When it was serialized.
    pub finish: SystemTime,
    /// The encoded profile.
    pub encoded: EncodedProfile,
    /// What serializing it took.
    pub stats: ProfileStats,
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

/// The serializer's bookkeeping; its mutex also makes serializations run one at a time.
struct SerializerState {
    /// 1 or 2. Samplers never read this: they find the active slot by its open gate.
    active_slot: u8,
    /// What adding heap samples allocates, kept from one serialization to the next (see
    /// [`BulkBuffers`]): the profile tables and the snapshot stack index -> rows table.
    bulk: BulkBuffers,
    heap_stacks: Vec<Option<StackRows>>,
}

/// A heap snapshot stack's profile stack and the row of its first label set.
#[derive(Clone, Copy)]
struct StackRows {
    stack: StackId,
    labels: LabelSetId,
    row: RowId,
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

    fn heap_or_disabled(&self) -> Result<&HeapRecorder, RecorderError> {
        self.heap.as_ref().ok_or(RecorderError::HeapDisabled)
    }

    /// Managed model: starts a heap recording ended by the next `record_sample` with
    /// `values.heap_sample`. Returns the deferred-mode "needs after-allocation callback" signal.
    ///
    /// With heap profiling off this does nothing and returns `false`, as the seed's does: an
    /// allocation sampler calls it whatever the configuration.
    pub fn track_object(
        &self,
        obj_id: u64,
        weight: u32,
        class: Option<&str>,
    ) -> Result<bool, RecorderError> {
        match &self.heap {
            Some(heap) => Ok(heap.start_recording(obj_id, weight, class)?),
            None => Ok(false),
        }
    }

    /// Managed model, deferred ids: commits the recordings awaiting their ids (from a safe
    /// point of the runtime). Nothing to do with heap profiling off.
    pub fn finalize_pending_heap_recordings(&self) -> Result<(), RecorderError> {
        match &self.heap {
            Some(heap) => Ok(heap.finalize_pending_recordings()?),
            None => Ok(()),
        }
    }

    /// Managed model, deferred ids: calls `f` with each handle awaiting its id (a runtime keeps
    /// those objects alive, e.g. by marking them).
    pub fn for_each_pending_heap_handle(&self, f: impl FnMut(u64)) {
        if let Some(heap) = &self.heap {
            heap.for_each_pending_handle(f);
        }
    }

    /// Whether the heap recorder tracks object `id` (`false` with heap profiling off).
    pub fn is_heap_object_recorded(&self, id: u64) -> bool {
        self.heap.as_ref().is_some_and(|h| h.is_object_recorded(id))
    }

    /// Native model: one sampled live allocation.
    pub fn track_allocation(
        &self,
        id: u64,
        weight: u32,
        size: u64,
        class: Option<&str>,
        frames: &[Frame<'_>],
    ) -> Result<(), RecorderError> {
        Ok(self
            .heap_or_disabled()?
            .track(id, weight, size, class, frames)?)
    }

    /// [`Self::track_allocation`] for an allocation made inside the trace whose local root span
    /// id is `local_root_span_id` (0: none): the object's heap sample carries that id, and the
    /// `trace endpoint` [`Self::record_endpoint`] gives the trace, for as long as it lives.
    pub fn track_allocation_in(
        &self,
        id: u64,
        weight: u32,
        size: u64,
        class: Option<&str>,
        frames: &[Frame<'_>],
        local_root_span_id: u64,
    ) -> Result<(), RecorderError> {
        Ok(self.heap_or_disabled()?.track_in(
            id,
            weight,
            size,
            class,
            frames,
            local_root_span_id,
        )?)
    }

    /// Native model: allocation `id` was freed. Returns whether it was tracked.
    pub fn untrack_allocation(&self, id: u64) -> bool {
        self.heap.as_ref().is_some_and(|h| h.untrack(id))
    }

    /// Managed model: called after each collection; runs a young update when enabled.
    pub fn after_gc_step(&self) {
        if let Some(heap) = &self.heap {
            if self.config.heap.clean_after_gc {
                heap.update_young_objects();
            }
        }
    }

    /// Serializes the active profile (blocking other serializers, never samplers).
    pub fn serialize(
        &self,
        symbolizer: Option<&mut dyn Symbolizer>,
    ) -> Result<SerializedProfile, RecorderError> {
        self.serialize_gated(symbolizer, &NoGate)
    }

    /// [`Self::serialize`], calling `gate` around each step that touches state shared with
    /// recording threads (see [`SharedStateGate`]).
    pub fn serialize_gated(
        &self,
        symbolizer: Option<&mut dyn Symbolizer>,
        gate: &dyn SharedStateGate,
    ) -> Result<SerializedProfile, RecorderError> {
        // Taken by serializers only (and forced open in a forked child): held across steps.
        let mut ser = self.serializer.lock_long();
        let finish = SystemTime::now();
        let active = ser.active_slot;
        let (old, next) = if active == 1 {
            (&self.slots[0], &self.slots[1])
        } else {
            (&self.slots[1], &self.slots[0])
        };

        let step = Step::enter(gate);
        // The next profile starts where this one finishes, so consecutive profiles tile time.
        // Its gate is closed, so the data mutex is free of samplers.
        next.data.lock().reset(finish);

        let prep_start = Instant::now();
        if let Some(heap) = &self.heap {
            // Fails before the flip: the active profile keeps its samples for the next
            // serialization, and an iteration someone else prepared is left to its holder.
            if let Err(e) = heap.prepare_iteration() {
                drop(step);
                let mut lifetime = self.lifetime.lock();
                lifetime.record_time(elapsed_ns(prep_start));
                lifetime.serialization_failures += 1;
                return Err(e.into());
            }
        }
        let heap_iteration_prep_time_ns = elapsed_ns(prep_start);

        let started = Instant::now();
        // Flip: samplers may enter either slot for a moment; both are correct (the sample lands
        // in this profile or the next one, exactly once).
        next.gate.open();
        old.gate.close();
        old.gate.wait_empty();
        ser.active_slot = if active == 1 { 2 } else { 1 };
        self.active_slot.store(ser.active_slot, Ordering::Relaxed);
        drop(step);

        // The old slot is the serializer's alone from here (its gate is closed and empty).
        let mut data = old.data.lock();
        let build_start = Instant::now();
        let heap_result = match &self.heap {
            Some(heap) => {
                // The snapshot's strings and the heap's locks are shared: in a step, paused
                // every few hundred objects.
                let step = Step::enter(gate);
                let built = self.add_heap_samples(heap, &mut data, &mut ser, &step);
                // Always finish, so a failed iteration never blocks the next one.
                let finished = heap.finish_iteration();
                drop(step);
                match built {
                    Ok(r) => finished.map_err(RecorderError::from).and(r),
                    Err(e) => Err(e.into()),
                }
            }
            None => Ok(()),
        };
        let heap_profile_build_time_ns = elapsed_ns(build_start);

        let encoded = heap_result.and_then(|()| {
            let opts = EncodeOptions {
                compression: self.config.compression,
            };
            Ok(data.profile.encode(finish, &opts, symbolizer)?)
        });
        let stats = ProfileStats {
            recorded_samples: data.recorded_samples,
            serialization_time_ns: 0,
            heap_iteration_prep_time_ns,
            heap_profile_build_time_ns,
            dropped_stacks: data.profile.dropped_samples(),
            profile_bytes: data.profile.memory_bytes() as u64,
        };
        let start = data.profile.start();
        // Free the profile's memory now rather than when the slot becomes active again; what
        // heap samples fill is kept for the next serialization's.
        if self.heap.is_some() {
            data.profile.reset_into(finish, &mut ser.bulk);
            data.recorded_samples = 0;
        } else {
            data.reset(finish);
        }
        drop(data);
        // Profiles copy what they need at add time, so the strings nobody references any more
        // can go now.
        {
            let _step = Step::enter(gate);
            self.strings.advance_generation();
        }
        let serialization_time_ns = elapsed_ns(started);

        let mut lifetime = self.lifetime.lock();
        lifetime.record_time(serialization_time_ns);
        match encoded {
            Ok(encoded) => {
                lifetime.serialization_successes += 1;
                Ok(SerializedProfile {
                    start,
                    finish,
                    encoded,
                    stats: ProfileStats {
                        serialization_time_ns,
                        ..stats
                    },
                })
            }
            Err(e) => {
                lifetime.serialization_failures += 1;
                Err(e)
            }
        }
    }

    /// Adds one sample per live object into the slot being serialized.
    ///
    /// The result is what one [`Profile::add`] per object would give, built in bulk: each heap
    /// stack is added to the profile once (the heap recorder deduplicates stacks, so objects
    /// sharing one share its snapshot index), the label set once per (class, age), and an
    /// object then adds to the row of its (stack, label set), found through the snapshot's
    /// stack index rather than a hash lookup.
    ///
    /// Stacks and rows are appended without indexing them ([`Profile::push_stack_unindexed`]):
    /// the snapshot's stacks are distinct, each gets a stack entry of its own, so its rows are
    /// new rows (even when the samplers recorded an equal stack into this slot, the rows differ
    /// in stack id and the encoding lists locations, so the output is the same). Nothing looks
    /// them up afterwards: the slot is encoded and reset.
    fn add_heap_samples(
        &self,
        heap: &HeapRecorder,
        data: &mut SlotData,
        ser: &mut SerializerState,
        step: &Step<'_>,
    ) -> Result<Result<(), RecorderError>, HeapError> {
        /// An object's stack, worked out one object ahead of its sample: bare addresses (looked
        /// up in the address cache) when it has address frames only, decoded frames otherwise.
        #[derive(Default)]
        struct Ahead {
            addresses: bool,
            prefetched: PrefetchedStack,
            frames: Vec<Frame<'static>>,
            /// Location ids of the frames the address cache held at prefetch time.
            hints: Vec<u32>,
        }
        let sizes = heap.snapshot_sizes()?;
        let dropped_before = data.profile.dropped_samples();
        data.profile.reserve_unindexed(
            sizes.objects.min(sizes.stacks),
            sizes.stacks,
            &mut ser.bulk,
        );
        let mut failure: Option<ProfileError> = None;
        let n = self.layout.len();
        let mut visited = 0u64;
        let mut added = 0u64;
        // Snapshot stack index -> profile stack and first row (`None` until first seen); one
        // past the end for a stack the snapshot lacks.
        let stacks = &mut ser.heap_stacks;
        if stacks.capacity() > 4 * (sizes.stacks + 1).max(1024) {
            // Kept for a much larger heap than the one now: give the memory back.
            *stacks = Vec::new();
        }
        stacks.clear();
        stacks.resize(sizes.stacks + 1, None);
        // Rows of a stack's further label sets (objects of one stack with other classes/ages).
        let mut other_rows: HashMap<(usize, LabelSetId), RowId, foldhash::fast::RandomState> =
            HashMap::default();
        // (class, age, context) -> label set; ages are few, so the last one answers most
        // lookups.
        type LabelKey = (StringId, u64, u64, StringId);
        let mut label_sets: HashMap<LabelKey, LabelSetId, foldhash::fast::RandomState> =
            HashMap::default();
        let mut last_labels: Option<(LabelKey, LabelSetId)> = None;
        let profile = &mut data.profile;
        // One object's work, on its stack's frames (decoded one object ahead).
        let mut add_one = |profile: &mut Profile,
                           stacks: &mut [Option<StackRows>],
                           obj: &LiveObject,
                           index: usize,
                           ahead: &mut Ahead|
         -> Result<(), ProfileError> {
            let placed = self.layout.place(&SampleValues {
                heap_live_samples: obj.weight as i64,
                heap_live_size: (obj.size as i64).saturating_mul(obj.weight as i64),
                ..SampleValues::default()
            });
            let values = &placed[..n];
            let key = (obj.class, obj.gen_age, obj.local_root_span_id, obj.endpoint);
            let labels = match last_labels {
                Some((k, id)) if k == key => id,
                _ => {
                    let id = match label_sets.get(&key) {
                        Some(&id) => id,
                        None => {
                            let id = profile.intern_label_set(&heap_labels(obj))?;
                            label_sets.insert(key, id);
                            id
                        }
                    };
                    last_labels = Some((key, id));
                    id
                }
            };
            match stacks[index] {
                Some(e) if e.labels == labels => profile.add_to_row(e.row, values),
                Some(e) => match other_rows.get(&(index, labels)) {
                    Some(&row) => profile.add_to_row(row, values),
                    None => {
                        let row = profile.push_unindexed_row(e.stack, labels, values)?;
                        other_rows.insert((index, labels), row);
                        Ok(())
                    }
                },
                None => {
                    let stack = if ahead.addresses {
                        profile.push_address_stack_unindexed(&mut ahead.prefetched)?
                    } else {
                        profile.push_stack_unindexed(&ahead.frames, &ahead.hints)?
                    };
                    let row = profile.push_unindexed_row(stack, labels, values)?;
                    stacks[index] = Some(StackRows { stack, labels, row });
                    Ok(())
                }
            }
        };
        // Objects are handled one behind the iteration: the next object's stack entry and
        // location-index slots are prefetched while the previous one is worked on.
        let mut pending: Option<(LiveObject, usize)> = None;
        let (mut next, mut pending_ahead) = (Ahead::default(), Ahead::default());
        let completed = heap.for_each_live_object_by_stack(&mut |obj, stack| {
            visited += 1;
            if visited % HEAP_OBJECTS_PER_STEP == 0 {
                // Between two objects nothing shared is half-updated (no storage lock held).
                step.pause();
            }
            let index = stack.index().min(sizes.stacks);
            crate::profile::prefetch(&stacks[index]);
            next.addresses = match stack.addresses() {
                Some(addresses) => {
                    profile.prefetch_addresses(addresses, &mut next.prefetched);
                    true
                }
                None => false,
            };
            if !next.addresses {
                stack.frames(&mut next.frames);
                profile.prefetch_stack(&next.frames, &mut next.hints);
            }
            let result = match pending.take() {
                Some((prev, prev_index)) => add_one(
                    profile,
                    &mut stacks[..],
                    &prev,
                    prev_index,
                    &mut pending_ahead,
                )
                .map(|()| added += 1),
                None => Ok(()),
            };
            std::mem::swap(&mut next, &mut pending_ahead);
            pending = Some((*obj, index));
            match result {
                Ok(()) => true,
                Err(e) => {
                    failure = Some(e);
                    false
                }
            }
        })?;
        if failure.is_none() {
            if let Some((prev, prev_index)) = pending.take() {
                match add_one(
                    profile,
                    &mut stacks[..],
                    &prev,
                    prev_index,
                    &mut pending_ahead,
                ) {
                    Ok(()) => added += 1,
                    Err(e) => failure = Some(e),
                }
            }
        }
        data.recorded_samples += added;
        let heap_dropped = data.profile.dropped_samples() - dropped_before;
        self.dropped_stacks
            .fetch_add(heap_dropped, Ordering::Relaxed);
        Ok(match failure {
            Some(e) => Err(e.into()),
            None if !completed => Err(RecorderError::HeapIterationIncomplete { visited }),
            None => Ok(()),
        })
    }

    /// Serialization and heap statistics.
    pub fn stats(&self) -> RecorderStats {
        RecorderStats {
            lifetime: *self.lifetime.lock(),
            heap: self.heap.as_ref().map(HeapRecorder::stats),
            dropped_stacks: self.dropped_stacks(),
        }
    }

    /// [`RecorderStats::dropped_stacks`] alone, without locking anything.
    pub fn dropped_stacks(&self) -> u64 {
        self.dropped_stacks.load(Ordering::Relaxed)
    }

    /// In a forked child, before profiling restarts: slot 1 active, both profiles empty.
    ///
    /// Best when the fork was bracketed by [`Self::before_fork`] (then nothing was caught
    /// half-way). Otherwise the fork may have caught another thread inside a slot or a
    /// serialization; that thread does not exist in the child, so what it held is released by
    /// force and a profile it was changing is leaked, never read. Call this only when no other
    /// thread uses the recorder (as in a freshly forked child).
    pub fn reset_after_fork(&self) {
        let start = SystemTime::now();
        for slot in &self.slots {
            let (mut data, abandoned) = lock_abandoned(&slot.data);
            if abandoned {
                // The profile may be half-way through an add: never walk or drop it, leak it.
                let fresh = SlotData {
                    profile: slot_profile(
                        &self.layout,
                        &self.strings,
                        &self.config,
                        &self.extras,
                        start,
                    ),
                    recorded_samples: 0,
                };
                std::mem::forget(std::mem::replace(&mut *data, fresh));
            } else {
                data.reset(start);
            }
        }
        self.slots[0].gate.reset(true);
        self.slots[1].gate.reset(false);
        let (mut ser, _) = lock_abandoned(&self.serializer);
        ser.active_slot = 1;
        self.active_slot.store(1, Ordering::Relaxed);
        drop(ser);
        let (lifetime, _) = lock_abandoned(&self.lifetime);
        drop(lifetime);
        if let Some(heap) = &self.heap {
            heap.after_fork();
        }
    }

    /// Fork preparation (a `pthread_atfork` prepare handler): waits for a running
    /// serialization, closes both slots to samplers and waits for those inside to leave, and
    /// holds the string storage, so the fork cannot catch any of them half-way through an
    /// update. Samplers calling meanwhile get [`RecorderError::NoActiveSlot`]; they never wait.
    /// Must be followed, in the same thread, by [`Self::after_fork_in_parent`] in the parent and
    /// [`Self::after_fork_in_child`] in the child. (The heap recorder's own locks are not
    /// covered.)
    pub fn before_fork(&self) {
        // Kept (guard forgotten) until after the fork; released with a plain store then.
        std::mem::forget(self.serializer.lock_long());
        for slot in &self.slots {
            slot.gate.close();
        }
        for slot in &self.slots {
            slot.gate.wait_empty();
        }
        self.strings.lock_for_fork();
    }

    /// In the parent after a fork prepared by [`Self::before_fork`]: reopens the active slot.
    pub fn after_fork_in_parent(&self) {
        self.strings.unlock_after_fork();
        let active = self.active_slot.load(Ordering::Relaxed);
        self.slots[usize::from(active == 2)].gate.open();
        // SAFETY: `before_fork`, in this thread, took the serializer lock and forgot its guard;
        // no guard of it exists until this release.
        unsafe { self.serializer.force_unlock() };
    }

    /// In the child after a fork prepared by [`Self::before_fork`]: [`Self::reset_after_fork`]
    /// plus releasing what the preparation held.
    pub fn after_fork_in_child(&self) {
        self.strings.unlock_after_fork();
        // SAFETY: `before_fork`, in this thread, took the serializer lock and forgot its guard;
        // `reset_after_fork` below takes and releases it normally afterwards.
        unsafe { self.serializer.force_unlock() };
        self.reset_after_fork();
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

impl LifetimeStats {
    fn record_time(&mut self, ns: u64) {
        self.serialization_time_ns_min =
            Some(self.serialization_time_ns_min.map_or(ns, |m| m.min(ns)));
        self.serialization_time_ns_max =
            Some(self.serialization_time_ns_max.map_or(ns, |m| m.max(ns)));
        let total = self
            .serialization_time_ns_total
            .unwrap_or(0)
            .saturating_add(ns);
        self.serialization_time_ns_total = Some(total);
        let count = self.serialization_successes + self.serialization_failures + 1;
        self.serialization_time_ns_avg = Some(total as f64 / count as f64);
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

fn elapsed_ns(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// Locks a lock whose holder may have vanished in a fork; `true` when it had to be forced.
fn lock_abandoned<T>(l: &SpinLock<T>) -> (SpinGuard<'_, T>, bool) {
    if let Some(g) = l.try_lock() {
        return (g, false);
    }
    // SAFETY: only reached from `reset_after_fork`, whose contract is that no other thread uses
    // the recorder: the lock is held by a thread of the parent process that does not exist in
    // this child, so no guard of it will ever be used here; the caller never reads the data a
    // vanished holder may have been changing.
    unsafe { l.force_unlock() };
    (l.lock(), true)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        r.track_allocation_in(0x20, 1, 200, None, &frames, 7)
            .unwrap();
        r.track_allocation_in(0x30, 1, 400, None, &frames, 8)
            .unwrap();
        r.track_allocation(0x40, 1, 800, None, &frames).unwrap();
        assert!(r.untrack_allocation(0x20));
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
