//! The heap side of the stack recorder: the heap recorder's calls, forwarded, and the live
//! objects added to the profile being serialized, one sample each with their labels.

use std::collections::HashMap;
use std::sync::atomic::Ordering;

use crate::error::{HeapError, ProfileError, RecorderError};
use crate::heap::HeapRecorder;
use crate::profile::{Frame, Label, LabelValue, Profile, Str};
use crate::sample_types::SampleValues;
use crate::strings::StringId;

use crate::heap::LiveObject;
use crate::profile::{
    LabelSetId, PrefetchedStack, RowId, StackId, LOCAL_ROOT_SPAN_ID_LABEL, TRACE_ENDPOINT_LABEL,
};

use super::serialize::{SerializerState, Step};
use super::{SlotData, StackRecorder};

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

/// Heap objects added to a profile between two pauses of their step (a fork waits for that many
/// at most: tens of microseconds).
pub(super) const HEAP_OBJECTS_PER_STEP: u64 = 512;

/// A heap snapshot stack's profile stack and the row of its first label set.
#[derive(Clone, Copy)]
pub(super) struct StackRows {
    stack: StackId,
    labels: LabelSetId,
    row: RowId,
}

impl StackRecorder {
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

    /// [`Self::track_object`] for an object allocated inside the trace whose local root span id
    /// is `local_root_span_id` (0: none): its live-heap sample carries the trace's labels, as
    /// [`Self::track_allocation_in`]'s do.
    pub fn track_object_in(
        &self,
        obj_id: u64,
        weight: u32,
        class: Option<&str>,
        local_root_span_id: u64,
    ) -> Result<bool, RecorderError> {
        match &self.heap {
            Some(heap) => Ok(heap.start_recording_in(obj_id, weight, class, local_root_span_id)?),
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
    /// Returns the bytes the live object stands for (weight times size; 0 when the heap
    /// recorder's `sample_every` skipped it): what [`Self::untrack_allocation_bytes`] returns
    /// for it.
    pub fn track_allocation_in(
        &self,
        id: u64,
        weight: u32,
        size: u64,
        class: Option<&str>,
        frames: &[Frame<'_>],
        local_root_span_id: u64,
    ) -> Result<u64, RecorderError> {
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
        self.untrack_allocation_bytes(id).is_some()
    }

    /// [`Self::untrack_allocation`], returning the bytes the allocation stood for (weight
    /// times size, what [`Self::track_allocation_in`] returned for it) when it was tracked.
    pub fn untrack_allocation_bytes(&self, id: u64) -> Option<u64> {
        self.heap.as_ref().and_then(|h| h.untrack_bytes(id))
    }

    /// Managed model: called after each collection; runs a young update when enabled.
    pub fn after_gc_step(&self) {
        if let Some(heap) = &self.heap {
            if self.config.heap.clean_after_gc {
                heap.update_young_objects();
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
    pub(super) fn add_heap_samples(
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
}
