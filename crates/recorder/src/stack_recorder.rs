//! The two-slot stack recorder.
//!
//! Two profiles, each behind its own gate. Samplers only *try* gates (two rounds over both slots)
//! and get an error value instead of waiting; the serializer flips slots, adds the heap samples to
//! the now-inactive slot, encodes it and advances the string generation. Unlike the seed, several
//! sampler threads may record at once (see DESIGN in the README).
//!
//! CONTRACT (implementation pending, see issues 2 and 3).

use std::sync::Arc;
use std::time::SystemTime;

use crate::error::RecorderError;
use crate::heap::{HeapConfig, HeapRecorder, HeapStats};
use crate::pprof::{Compression, EncodedProfile, Symbolizer};
use crate::profile::{Frame, Label};
use crate::sample_types::{SampleLayout, SampleTypeConfig, SampleValues};
use crate::strings::StringStorage;

/// Label key of the class of a live heap object.
pub const ALLOCATION_CLASS_LABEL: &str = "allocation class";
/// Numeric label: generations (managed) or serializations (native) a live object survived.
pub const GC_GEN_AGE_LABEL: &str = "gc gen age";

/// Stack recorder configuration.
#[derive(Debug, Clone, Default)]
pub struct RecorderConfig {
    pub sample_types: SampleTypeConfig,
    /// Used only when heap samples or heap size are enabled.
    pub heap: HeapConfig,
    pub compression: Compression,
}

/// Stats of one serialized profile.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProfileStats {
    /// Individual (unweighted) samples recorded into the slot, heap samples included.
    pub recorded_samples: u64,
    pub serialization_time_ns: u64,
    pub heap_iteration_prep_time_ns: u64,
    pub heap_profile_build_time_ns: u64,
}

/// Stats over the recorder's lifetime.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LifetimeStats {
    pub serialization_successes: u64,
    pub serialization_failures: u64,
    pub serialization_time_ns_min: Option<u64>,
    pub serialization_time_ns_max: Option<u64>,
    pub serialization_time_ns_total: Option<u64>,
    pub serialization_time_ns_avg: Option<f64>,
}

/// What [`StackRecorder::stats`] returns.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RecorderStats {
    pub lifetime: LifetimeStats,
    /// `None` when heap profiling is disabled.
    pub heap: Option<HeapStats>,
}

/// One serialization's result.
#[derive(Debug, Clone)]
pub struct SerializedProfile {
    pub start: SystemTime,
    pub finish: SystemTime,
    pub encoded: EncodedProfile,
    pub stats: ProfileStats,
}

/// The recorder. `Send + Sync`: share it in an `Arc`.
pub struct StackRecorder {
    _todo: (),
}

impl StackRecorder {
    pub fn new(_config: RecorderConfig) -> Result<Self, RecorderError> {
        todo!("issue 2")
    }

    pub fn layout(&self) -> &SampleLayout {
        todo!("issue 2")
    }

    pub fn strings(&self) -> &Arc<StringStorage> {
        todo!("issue 2")
    }

    /// `None` when heap profiling is disabled.
    pub fn heap(&self) -> Option<&HeapRecorder> {
        todo!("issue 3")
    }

    /// Sampler path: never blocks on a serialization. `end_timestamp_ns` 0 = aggregated.
    pub fn record_sample(
        &self,
        _frames: &[Frame<'_>],
        _values: &SampleValues,
        _labels: &[Label<'_>],
        _end_timestamp_ns: i64,
    ) -> Result<(), RecorderError> {
        todo!("issue 2")
    }

    /// Sampler path: never blocks on a serialization.
    pub fn record_endpoint(&self, _local_root_span_id: u64, _endpoint: &str) -> Result<(), RecorderError> {
        todo!("issue 2")
    }

    /// Managed model: starts a heap recording ended by the next `record_sample` with
    /// `values.heap_sample`. Returns the deferred-mode "needs after-allocation callback" signal.
    pub fn track_object(&self, _obj_id: u64, _weight: u32, _class: Option<&str>) -> Result<bool, RecorderError> {
        todo!("issue 3")
    }

    /// Native model: one sampled live allocation.
    pub fn track_allocation(
        &self,
        _id: u64,
        _weight: u32,
        _size: u64,
        _class: Option<&str>,
        _frames: &[Frame<'_>],
    ) -> Result<(), RecorderError> {
        todo!("issue 3")
    }

    /// Native model: allocation `id` was freed. Returns whether it was tracked.
    pub fn untrack_allocation(&self, _id: u64) -> bool {
        todo!("issue 3")
    }

    /// Managed model: called after each collection; runs a young update when enabled.
    pub fn after_gc_step(&self) {
        todo!("issue 3")
    }

    /// Serializes the active profile (blocking other serializers, never samplers).
    pub fn serialize(&self, _symbolizer: Option<&mut dyn Symbolizer>) -> Result<SerializedProfile, RecorderError> {
        todo!("issue 2")
    }

    pub fn stats(&self) -> RecorderStats {
        todo!("issue 2")
    }

    /// In a forked child, before profiling restarts: slot 1 active, both profiles empty.
    pub fn reset_after_fork(&self) {
        todo!("issue 2")
    }

    /// Testing aid: 1 or 2.
    pub fn active_slot(&self) -> u8 {
        todo!("issue 2")
    }

    /// Testing aid: whether slot 1 or 2 is locked (closed to samplers).
    pub fn is_slot_locked(&self, _slot: u8) -> bool {
        todo!("issue 2")
    }
}
