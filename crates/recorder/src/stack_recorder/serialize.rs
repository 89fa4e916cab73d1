//! Serialization: flip the slots, add the heap samples to the old one, encode it and advance
//! the string generation, in steps a fork can wait for ([`SharedStateGate`]).

use std::sync::atomic::Ordering;
use std::time::{Instant, SystemTime};

use crate::error::RecorderError;
use crate::pprof::{EncodeOptions, EncodedProfile, Symbolizer};
use crate::profile::{BulkBuffers, Frame, Label, Profile, Sample};
use crate::sample_types::{ExtraValues, SampleLayout, SampleValues};

use super::heap::StackRows;
use super::{ProfileStats, StackRecorder};

/// Brackets the steps of a serialization that touch state shared with recording threads: the
/// slot flip, the heap recorder's locks and snapshot, the string storage. Between steps the
/// serializer works only on data it took out of the shared structures (the old slot's profile,
/// the heap snapshot): symbolizing and encoding run outside any step.
///
/// A process that forks closes its own gate in a `pthread_atfork` prepare handler and waits for
/// the threads inside: through this trait, it waits for one short step at most, never for a
/// whole serialization. A fork between two steps is safe for the child: what the serializer
/// held then is forced open and leaked by [`StackRecorder::reset_after_fork`] and
/// [`HeapRecorder::after_fork`](crate::heap::HeapRecorder::after_fork), and no step leaves a
/// structure shared with other threads half-updated.
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
pub(super) struct Step<'g>(&'g dyn SharedStateGate);

impl<'g> Step<'g> {
    fn enter(gate: &'g dyn SharedStateGate) -> Self {
        gate.enter();
        Step(gate)
    }

    /// Leaves and enters again: lets a waiting fork through between two parts of a long step.
    pub(super) fn pause(&self) {
        self.0.leave();
        self.0.enter();
    }
}

impl Drop for Step<'_> {
    fn drop(&mut self) {
        self.0.leave();
    }
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

/// Where [`StackRecorder::serialize_with_late`] lets its caller add samples to the profile being
/// serialized, once its addresses are symbolized and before it is encoded: what serializing
/// costs (symbolizing most of it) can then be booked in the profile it is spent on, the last
/// one of a process included.
pub struct LateSamples<'a> {
    profile: &'a mut Profile,
    layout: &'a SampleLayout,
    added: u64,
}

impl LateSamples<'_> {
    /// Adds one aggregated sample (no heap part: `values.heap_sample` is ignored).
    pub fn add(
        &mut self,
        frames: &[Frame<'_>],
        values: &SampleValues,
        labels: &[Label<'_>],
    ) -> Result<(), RecorderError> {
        let placed = self.layout.place_with(values, &ExtraValues::default());
        let sample = Sample {
            frames,
            values: &placed[..self.layout.len()],
            labels,
            end_timestamp_ns: 0,
        };
        self.profile.add(&sample)?;
        self.added += 1;
        Ok(())
    }
}

/// The serializer's bookkeeping; its mutex also makes serializations run one at a time.
pub(super) struct SerializerState {
    /// 1 or 2. Samplers never read this: they find the active slot by its open gate.
    pub(super) active_slot: u8,
    /// What adding heap samples allocates, kept from one serialization to the next (see
    /// [`BulkBuffers`]): the profile tables and the snapshot stack index -> rows table.
    pub(super) bulk: BulkBuffers,
    pub(super) heap_stacks: Vec<Option<StackRows>>,
}

impl StackRecorder {
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
        self.serialize_with_late(symbolizer, gate, None)
    }

    /// [`Self::serialize_gated`], calling `late` once the profile's addresses are symbolized
    /// (through [`Symbolizer::prepare`]) and before it is encoded, to add samples to it (see
    /// [`LateSamples`]). Without a symbolizer `late` runs just before encoding.
    pub fn serialize_with_late(
        &self,
        mut symbolizer: Option<&mut dyn Symbolizer>,
        gate: &dyn SharedStateGate,
        late: Option<&mut dyn FnMut(&mut LateSamples<'_>)>,
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

        if let (Ok(()), Some(late)) = (&heap_result, late) {
            if let Some(sym) = symbolizer.as_deref_mut() {
                // The encoder asks again for the same addresses: answered from what this did.
                sym.prepare(&data.profile.address_locations());
            }
            let mut samples = LateSamples {
                profile: &mut data.profile,
                layout: &self.layout,
                added: 0,
            };
            late(&mut samples);
            data.recorded_samples += samples.added;
        }
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
}

fn elapsed_ns(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX)
}
