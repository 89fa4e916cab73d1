//! The recorder's counters and sizes ([`HeapStats`]), the seed's heap recorder state snapshot.

use super::HeapRecorder;
use std::sync::atomic::Ordering;

/// Snapshot of the heap recorder's stats (the seed's `heap_recorder_state_snapshot`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HeapStats {
    /// Live objects tracked.
    pub num_object_records: u64,
    /// Distinct stacks held.
    pub num_heap_records: u64,
    /// Deferred recordings waiting for [`HeapRecorder::finalize_pending_recordings`].
    pub pending_recordings_count: u64,
    /// Objects the last update (managed model) found alive.
    pub last_update_objects_alive: u64,
    /// Objects the last update found dead, and dropped.
    pub last_update_objects_dead: u64,
    /// Objects the last update skipped (too young, or too old for a young update).
    pub last_update_objects_skipped: u64,
    /// Objects the last update found frozen.
    pub last_update_objects_frozen: u64,
    /// Updates that ran.
    pub lifetime_updates_successful: u64,
    /// Young updates skipped because another update was running.
    pub lifetime_updates_skipped_concurrent: u64,
    /// Young updates skipped because no collection happened since the last update.
    pub lifetime_updates_skipped_gcgen: u64,
    /// Young updates skipped because the last one was too recent.
    pub lifetime_updates_skipped_time: u64,
    /// Moving average ([`EWMA_ALPHA`](super::EWMA_ALPHA)) of the objects young updates found alive.
    pub lifetime_ewma_young_objects_alive: f64,
    /// Moving average of the objects young updates found dead.
    pub lifetime_ewma_young_objects_dead: f64,
    /// Moving average of the objects young updates skipped.
    pub lifetime_ewma_young_objects_skipped: f64,
    /// Moving average of the objects full updates found alive.
    pub lifetime_ewma_objects_alive: f64,
    /// Moving average of the objects full updates found dead.
    pub lifetime_ewma_objects_dead: f64,
    /// Moving average of the objects full updates skipped.
    pub lifetime_ewma_objects_skipped: f64,
    /// Deferred recordings dropped because the buffer
    /// ([`MAX_PENDING_RECORDINGS`](super::MAX_PENDING_RECORDINGS)) was full.
    pub lifetime_deferred_recordings_skipped_buffer_full: u64,
    /// Deferred recordings committed.
    pub lifetime_deferred_recordings_finalized: u64,
    /// Request contexts (traces with tracked objects) held now.
    pub num_contexts: u64,
    /// Objects tracked without their context because [`MAX_CONTEXTS`](super::MAX_CONTEXTS) were
    /// held.
    pub lifetime_contexts_refused: u64,
}

impl HeapRecorder {
    /// Counters and sizes of the recorder.
    pub fn stats(&self) -> HeapStats {
        let num_object_records = self.objs.iter().map(|s| s.lock().recs.len() as u64).sum();
        let num_heap_records = self.stacks.iter().map(|s| s.lock().indexed as u64).sum();
        let pending_recordings_count = self.pending.lock().len() as u64;
        let (num_contexts, contexts_refused) = {
            let c = self.contexts.lock();
            (c.by_root.len() as u64, c.refused)
        };
        let st = self.update_stats.lock();
        HeapStats {
            num_object_records,
            num_heap_records,
            pending_recordings_count,
            last_update_objects_alive: st.last.alive,
            last_update_objects_dead: st.last.dead,
            last_update_objects_skipped: st.last.skipped,
            last_update_objects_frozen: st.last.frozen,
            lifetime_updates_successful: st.successful,
            lifetime_updates_skipped_concurrent: st.skipped_concurrent,
            lifetime_updates_skipped_gcgen: st.skipped_gcgen,
            lifetime_updates_skipped_time: st.skipped_time,
            lifetime_ewma_young_objects_alive: st.ewma_young[0],
            lifetime_ewma_young_objects_dead: st.ewma_young[1],
            lifetime_ewma_young_objects_skipped: st.ewma_young[2],
            lifetime_ewma_objects_alive: st.ewma_full[0],
            lifetime_ewma_objects_dead: st.ewma_full[1],
            lifetime_ewma_objects_skipped: st.ewma_full[2],
            lifetime_deferred_recordings_skipped_buffer_full: self
                .deferred_skipped_full
                .load(Ordering::Relaxed),
            lifetime_deferred_recordings_finalized: self.deferred_finalized.load(Ordering::Relaxed),
            num_contexts,
            lifetime_contexts_refused: contexts_refused,
        }
    }
}
