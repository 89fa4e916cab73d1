//! The heap recorder: sampled live objects and where they were allocated.
//!
//! CONTRACT (implementation pending, see issue 3). Object records (id -> weight, size, class,
//! allocation generation, age, frozen) point at deduplicated, refcounted heap records (stacks).
//! Two liveness models: managed (a [`LivenessSource`] answers "is object N alive") and native
//! (the allocator calls [`HeapRecorder::untrack`] on free).

use std::sync::Arc;

use crate::error::HeapError;
use crate::profile::Frame;
use crate::strings::{StringId, StringStorage};

/// Objects younger than this many generations are left out of iterations (managed default).
pub const DEFAULT_MIN_ITERATION_AGE: u32 = 1;
/// Young updates skip objects at least this old.
pub const OLD_AGE: u32 = 3;
/// Minimum time between two young updates.
pub const MIN_TIME_BETWEEN_YOUNG_UPDATES_NS: u64 = 2_000_000_000;
/// Capacity of the deferred (pending) recordings buffer.
pub const MAX_PENDING_RECORDINGS: usize = 256;
/// Smoothing factor of the EWMA stats.
pub const EWMA_ALPHA: f64 = 0.3;

/// What a runtime with a collector tells the recorder about one object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectInfo {
    pub size: u64,
    pub frozen: bool,
}

/// A managed runtime's view of its heap.
pub trait LivenessSource: Send + Sync {
    /// Monotonic collection counter.
    fn gc_generation(&self) -> u64;
    /// `None` when object `id` is dead.
    fn lookup(&self, id: u64) -> Option<ObjectInfo>;
}

/// How records leave the recorder.
#[derive(Clone, Default)]
pub enum Liveness {
    /// Pulled from a runtime during updates.
    Managed(Arc<dyn LivenessSource>),
    /// Frees are observed directly via `untrack`; age counts serializations survived.
    #[default]
    Native,
}

impl std::fmt::Debug for Liveness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Liveness::Managed(_) => f.write_str("Managed"),
            Liveness::Native => f.write_str("Native"),
        }
    }
}

/// Heap recorder configuration.
#[derive(Debug, Clone)]
pub struct HeapConfig {
    /// Track every Nth started recording, with weight x N. Must be positive.
    pub sample_every: u32,
    pub size_enabled: bool,
    /// Run young updates from `after_gc_step` (managed model).
    pub clean_after_gc: bool,
    pub min_iteration_age: u32,
    pub liveness: Liveness,
}

impl Default for HeapConfig {
    fn default() -> Self {
        HeapConfig {
            sample_every: 1,
            size_enabled: true,
            clean_after_gc: false,
            min_iteration_age: DEFAULT_MIN_ITERATION_AGE,
            liveness: Liveness::Native,
        }
    }
}

/// One live object as seen during iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveObject {
    pub id: u64,
    pub weight: u32,
    pub size: u64,
    /// `StringId::EMPTY` when unknown.
    pub class: StringId,
    pub alloc_gen: u64,
    pub gen_age: u64,
    pub frozen: bool,
}

/// Snapshot of the heap recorder's stats (the seed's `heap_recorder_state_snapshot`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HeapStats {
    pub num_object_records: u64,
    pub num_heap_records: u64,
    pub pending_recordings_count: u64,
    pub last_update_objects_alive: u64,
    pub last_update_objects_dead: u64,
    pub last_update_objects_skipped: u64,
    pub last_update_objects_frozen: u64,
    pub lifetime_updates_successful: u64,
    pub lifetime_updates_skipped_concurrent: u64,
    pub lifetime_updates_skipped_gcgen: u64,
    pub lifetime_updates_skipped_time: u64,
    pub lifetime_ewma_young_objects_alive: f64,
    pub lifetime_ewma_young_objects_dead: f64,
    pub lifetime_ewma_young_objects_skipped: f64,
    pub lifetime_ewma_objects_alive: f64,
    pub lifetime_ewma_objects_dead: f64,
    pub lifetime_ewma_objects_skipped: f64,
    pub lifetime_deferred_recordings_skipped_buffer_full: u64,
    pub lifetime_deferred_recordings_finalized: u64,
}

/// Tracks sampled live objects. `Send + Sync`; all methods take `&self`.
pub struct HeapRecorder {
    _todo: (),
}

impl HeapRecorder {
    pub fn new(_config: HeapConfig, _strings: Arc<StringStorage>) -> Result<Self, HeapError> {
        todo!("issue 3")
    }

    pub fn set_sample_every(&self, _n: i64) -> Result<(), HeapError> {
        todo!("issue 3")
    }

    /// Managed model: begins recording a new object. Returns whether the caller should schedule
    /// an after-allocation callback ([`Self::finalize_pending_recordings`]) in deferred mode.
    pub fn start_recording(&self, _obj_id: u64, _weight: u32, _class: Option<&str>) -> Result<bool, HeapError> {
        todo!("issue 3")
    }

    /// Commits the started recording with its allocation stack.
    pub fn end_recording(&self, _frames: &[Frame<'_>]) -> Result<(), HeapError> {
        todo!("issue 3")
    }

    pub fn finalize_pending_recordings(&self) -> Result<(), HeapError> {
        todo!("issue 3")
    }

    /// Young update (after a collection), subject to the update policy.
    pub fn update_young_objects(&self) {
        todo!("issue 3")
    }

    /// Native model: records a sampled live allocation in one step.
    pub fn track(&self, _id: u64, _weight: u32, _size: u64, _class: Option<&str>, _frames: &[Frame<'_>]) -> Result<(), HeapError> {
        todo!("issue 3")
    }

    /// Native model: the allocation `id` was freed. Returns whether it was tracked.
    pub fn untrack(&self, _id: u64) -> bool {
        todo!("issue 3")
    }

    /// Full update plus a point-in-time snapshot for [`Self::for_each_live_object`].
    pub fn prepare_iteration(&self) -> Result<(), HeapError> {
        todo!("issue 3")
    }

    /// Visits every snapshotted object of age >= min age with its stack; `f` returns false to
    /// stop. Returns Ok(false) when stopped early.
    pub fn for_each_live_object(&self, _f: &mut dyn FnMut(&LiveObject, &[Frame<'_>]) -> bool) -> Result<bool, HeapError> {
        todo!("issue 3")
    }

    pub fn finish_iteration(&self) -> Result<(), HeapError> {
        todo!("issue 3")
    }

    pub fn stats(&self) -> HeapStats {
        todo!("issue 3")
    }

    /// Called in a forked child: finishes any iteration left behind and resets the lifetime stats.
    pub fn after_fork(&self) {
        todo!("issue 3")
    }

    pub fn is_object_recorded(&self, _id: u64) -> bool {
        todo!("issue 3")
    }

    /// Testing aid: forget when the last update ran so the 2 s rule lets the next one through.
    pub fn reset_last_update(&self) {
        todo!("issue 3")
    }
}
