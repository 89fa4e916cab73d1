//! The two liveness models: what a runtime with a collector tells the recorder about its
//! objects ([`LivenessSource`]), or the allocator reporting frees (native).

use std::sync::Arc;

/// What a runtime with a collector tells the recorder about one object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectInfo {
    /// The object's size in bytes now.
    pub size: u64,
    /// Whether the object can no longer change size (its size is then not asked again).
    pub frozen: bool,
}

/// A managed runtime's view of its heap.
///
/// `lookup` is called without any recorder lock held, so it may allocate or take the runtime's
/// own locks. Allocations reported while an update runs are skipped (see
/// [`HeapRecorder::start_recording`](super::HeapRecorder::start_recording)).
pub trait LivenessSource: Send + Sync {
    /// Monotonic collection counter.
    fn gc_generation(&self) -> u64;
    /// `None` when object `id` is dead.
    fn lookup(&self, id: u64) -> Option<ObjectInfo>;

    /// Whether object `id` is alive, without measuring it: what young updates ask (sizes are
    /// re-measured only by full updates). Override when measuring costs more than the liveness
    /// check (a runtime call per object).
    fn is_alive(&self, id: u64) -> bool {
        self.lookup(id).is_some()
    }

    /// Called while a full update waits for another thread's update to finish. A runtime whose
    /// threads take turns under one lock (Ruby's GVL) must let the other thread run here: its
    /// update may be waiting for that lock inside a lookup, and would never finish.
    fn wait_for_other_update(&self) {
        std::thread::yield_now();
    }

    /// Deferred mode: `true` when ids cannot be computed while an allocation is being reported.
    /// [`HeapRecorder::start_recording`](super::HeapRecorder::start_recording) then receives a
    /// *handle* instead of an id, and the recording is committed by
    /// [`HeapRecorder::finalize_pending_recordings`](super::HeapRecorder::finalize_pending_recordings),
    /// which maps each handle to its id with [`Self::resolve_handle`].
    fn defers_ids(&self) -> bool {
        false
    }

    /// Deferred mode: the id of the object behind `handle`, or `None` when it can no longer be
    /// resolved (the recording is then dropped).
    fn resolve_handle(&self, handle: u64) -> Option<u64> {
        Some(handle)
    }
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
