//! The managed model's recording protocol (`start_recording`/`end_recording`) and deferred
//! (pending) recordings, committed once the runtime has given the object its id.

use std::sync::atomic::Ordering;

use crate::error::HeapError;
use crate::profile::Frame;

use super::objects::ObjRecord;
use super::HeapRecorder;

/// Capacity of the deferred (pending) recordings buffer.
pub const MAX_PENDING_RECORDINGS: usize = 256;

/// The managed model's in-flight recording (between `start_recording` and `end_recording`).
#[derive(Debug, Clone, Copy)]
pub(super) enum Active {
    Idle,
    /// Not sampled (or skipped): `end_recording` just clears it.
    Skipped,
    /// `rec.id` is a handle when `deferred`; `rec.stack_and_frozen` is filled in at the end.
    /// `root`: the local root span id of the request that allocated it (0: none).
    Started {
        rec: ObjRecord,
        deferred: bool,
        root: u64,
    },
}

impl HeapRecorder {
    /// Managed model: begins recording a new object. Returns whether the caller should schedule
    /// an after-allocation callback ([`Self::finalize_pending_recordings`]) in deferred mode.
    ///
    /// One recording may be in flight at a time (as under a runtime's global lock); `obj_id` is
    /// a handle for [`LivenessSource::resolve_handle`](super::LivenessSource::resolve_handle)
    /// when the source defers ids.
    pub fn start_recording(
        &self,
        obj_id: u64,
        weight: u32,
        class: Option<&str>,
    ) -> Result<bool, HeapError> {
        self.start_recording_in(obj_id, weight, class, 0)
    }

    /// [`Self::start_recording`] for an object allocated inside the trace whose local root span
    /// id is `local_root_span_id` (0: none): its heap sample carries that id and, once
    /// [`Self::name_context`] named it, the trace's endpoint, as [`Self::track_in`] does for
    /// the native model.
    pub fn start_recording_in(
        &self,
        obj_id: u64,
        weight: u32,
        class: Option<&str>,
        local_root_span_id: u64,
    ) -> Result<bool, HeapError> {
        let mut active = self.active.lock();
        if !matches!(*active, Active::Idle) {
            return Err(HeapError::StartWithoutEnd);
        }
        // An allocation made by an update (e.g. inside `lookup`) must not touch the records the
        // update is walking.
        let every = match self.sample_tick() {
            Some(every) if !self.updating.load(Ordering::Acquire) => every,
            _ => {
                *active = Active::Skipped;
                return Ok(false);
            }
        };
        let mut needs_callback = false;
        if self.deferred_ids {
            let count = self.pending.lock().len();
            if count >= MAX_PENDING_RECORDINGS {
                self.deferred_skipped_full.fetch_add(1, Ordering::Relaxed);
                *active = Active::Skipped;
                // Keep asking: the buffer only drains through the callback.
                return Ok(true);
            }
            // Ask once when the buffer starts filling, and again on every start once it is half
            // full, in case the first callback was lost.
            needs_callback = count == 0 || count >= MAX_PENDING_RECORDINGS / 2;
        }
        let class = self.intern_class(class)?;
        *active = Active::Started {
            rec: ObjRecord {
                id: obj_id,
                size: 0,
                weight: weight.saturating_mul(every),
                stack_and_frozen: 0,
                class: class.0,
                alloc_gen: self.current_gen() as u32,
            },
            deferred: self.deferred_ids,
            root: local_root_span_id,
        };
        Ok(needs_callback)
    }

    /// Commits the started recording with its allocation stack.
    pub fn end_recording(&self, frames: &[Frame<'_>]) -> Result<(), HeapError> {
        // Cleared up front: whatever fails below, the next start finds the recorder idle.
        let state = std::mem::replace(&mut *self.active.lock(), Active::Idle);
        let (mut rec, deferred, root) = match state {
            Active::Idle => return Err(HeapError::EndWithoutStart),
            Active::Skipped => return Ok(()),
            Active::Started {
                rec,
                deferred,
                root,
            } => (rec, deferred, root),
        };
        match self.acquire_stack(frames) {
            Ok(stack) => rec.stack_and_frozen = stack,
            Err(e) => {
                self.release_class(rec.class());
                return Err(e);
            }
        }
        let ctx = if root == 0 {
            0
        } else {
            self.contexts.lock().acquire(root)
        };
        if !deferred {
            return self.commit_ctx(rec, ctx);
        }
        let mut pending = self.pending.lock();
        if pending.len() < MAX_PENDING_RECORDINGS {
            pending.push((rec, ctx));
            return Ok(());
        }
        drop(pending);
        // Only reachable if the buffer filled between start and end (concurrent misuse).
        self.deferred_skipped_full.fetch_add(1, Ordering::Relaxed);
        self.release_record_ctx(&rec, ctx);
        Ok(())
    }

    /// Deferred mode: commits every pending recording, mapping handles to ids. Recordings whose
    /// handle no longer resolves are dropped. Returns the first commit error, after processing
    /// all of them.
    pub fn finalize_pending_recordings(&self) -> Result<(), HeapError> {
        let mut batch = [(ObjRecord::EMPTY, 0u32); MAX_PENDING_RECORDINGS];
        let n = {
            let mut pending = self.pending.lock();
            let n = pending.len().min(MAX_PENDING_RECORDINGS);
            batch[..n].copy_from_slice(&pending[..n]);
            pending.clear();
            n
        };
        if n == 0 {
            return Ok(());
        }
        self.deferred_finalized
            .fetch_add(n as u64, Ordering::Relaxed);
        let mut first_err = None;
        for (rec, ctx) in &mut batch[..n] {
            let id = match &self.source {
                Some(s) => s.resolve_handle(rec.id),
                None => Some(rec.id),
            };
            match id {
                Some(id) => {
                    rec.id = id;
                    if let Err(e) = self.commit_ctx(*rec, *ctx) {
                        first_err.get_or_insert(e);
                    }
                }
                None => self.release_record_ctx(rec, *ctx),
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Deferred mode: calls `f` with the handle of every recording awaiting finalization, e.g. so
    /// a runtime keeps those objects alive.
    pub fn for_each_pending_handle(&self, mut f: impl FnMut(u64)) {
        let mut active_handle = None;
        if let Active::Started {
            rec,
            deferred: true,
            ..
        } = *self.active.lock()
        {
            active_handle = Some(rec.id);
        }
        for (rec, _) in self.pending.lock().iter() {
            f(rec.id);
        }
        if let Some(h) = active_handle {
            f(h);
        }
    }
}
