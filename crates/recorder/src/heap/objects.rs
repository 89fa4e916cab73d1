//! Object records: 32 bytes per tracked object, kept densely in shards with an open-addressed
//! index, and the native model's track/untrack.

use crate::error::HeapError;
use crate::profile::{Frame, Str, MAX_FRAMES};
use crate::strings::StringId;

use super::stacks::{first_frame, FROZEN_BIT, STACK_REF_MASK};
use super::{mix64, probe_delete, probe_place, shard_of, HeapRecorder, MIN_INDEX_SLOTS};

pub(super) const OBJ_SHARDS: usize = 16;

/// One tracked object: 32 bytes, the whole per-object cost apart from a few index bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ObjRecord {
    pub(super) id: u64,
    pub(super) size: u64,
    pub(super) weight: u32,
    /// Stack reference in the low 31 bits, frozen flag in the top bit.
    pub(super) stack_and_frozen: u32,
    pub(super) class: u32,
    /// Low 32 bits of the allocation generation. Ages are computed with wrapping arithmetic,
    /// exact as long as an object is younger than 2^31 generations.
    pub(super) alloc_gen: u32,
}

impl ObjRecord {
    pub(super) const EMPTY: ObjRecord = ObjRecord {
        id: 0,
        size: 0,
        weight: 0,
        stack_and_frozen: 0,
        class: 0,
        alloc_gen: 0,
    };

    pub(super) fn stack(&self) -> u32 {
        self.stack_and_frozen & STACK_REF_MASK
    }

    pub(super) fn frozen(&self) -> bool {
        self.stack_and_frozen & FROZEN_BIT != 0
    }

    pub(super) fn set_frozen(&mut self, frozen: bool) {
        if frozen {
            self.stack_and_frozen |= FROZEN_BIT;
        } else {
            self.stack_and_frozen &= STACK_REF_MASK;
        }
    }

    pub(super) fn class(&self) -> StringId {
        StringId(self.class)
    }

    /// The bytes the record stands for: its weight times its size (its `heap-live-size`).
    pub(super) fn bytes(&self) -> u64 {
        self.size.saturating_mul(u64::from(self.weight))
    }
}

/// Generations between `alloc_gen` (low 32 bits) and `current`, negative when the object was
/// recorded after `current` was read.
pub(super) fn gen_delta(current: u64, alloc_gen: u32) -> i64 {
    i64::from((current as u32).wrapping_sub(alloc_gen) as i32)
}

pub(super) fn gen_age(current: u64, alloc_gen: u32) -> u64 {
    gen_delta(current, alloc_gen).max(0) as u64
}

#[derive(Default)]
pub(super) struct ObjShard {
    /// Dense, unordered; removal swaps the last record into the hole.
    pub(super) recs: Vec<ObjRecord>,
    /// The context of each record (0 = none), position for position with `recs`; empty until a
    /// record of this shard has one, so objects without contexts never pay for it.
    pub(super) ctxs: Vec<u32>,
    /// Linear-probing index, a power of two long, at most half full: 0 is empty, otherwise the
    /// position in `recs` plus one.
    pub(super) slots: Vec<u32>,
}

impl ObjShard {
    fn mask(&self) -> usize {
        self.slots.len() - 1
    }

    /// Index slot holding `id`.
    fn find(&self, id: u64, hash: u64) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.mask();
        let mut i = hash as usize & mask;
        loop {
            let s = self.slots[i];
            if s == 0 {
                return None;
            }
            if self.recs[s as usize - 1].id == id {
                return Some(i);
            }
            i = (i + 1) & mask;
        }
    }

    pub(super) fn get(&self, id: u64, hash: u64) -> Option<&ObjRecord> {
        self.find(id, hash)
            .map(|i| &self.recs[self.slots[i] as usize - 1])
    }

    pub(super) fn get_mut(&mut self, id: u64, hash: u64) -> Option<&mut ObjRecord> {
        let i = self.find(id, hash)?;
        let pos = self.slots[i] as usize - 1;
        Some(&mut self.recs[pos])
    }

    fn place(&mut self, hash: u64, value: u32) {
        probe_place(&mut self.slots, hash as usize, value);
    }

    fn rebuild_index(&mut self, len: usize) {
        self.slots.clear();
        self.slots.resize(len, 0);
        self.slots.shrink_to(len);
        for pos in 0..self.recs.len() {
            let hash = mix64(self.recs[pos].id);
            self.place(hash, pos as u32 + 1);
        }
    }

    /// Inserts `rec`, or returns the record already holding its id.
    #[cfg(test)]
    pub(super) fn insert(&mut self, rec: ObjRecord, hash: u64) -> Result<(), ObjRecord> {
        self.insert_ctx(rec, hash, 0)
    }

    /// Inserts `rec` with context `ctx`, or returns the record already holding its id.
    fn insert_ctx(&mut self, rec: ObjRecord, hash: u64, ctx: u32) -> Result<(), ObjRecord> {
        if let Some(i) = self.find(rec.id, hash) {
            return Err(self.recs[self.slots[i] as usize - 1]);
        }
        // Memory goes back here rather than on remove: a free must not allocate (it runs in
        // the application's `free`, maybe in a signal handler), and shrinking does.
        self.maybe_shrink();
        if (self.recs.len() + 1) * 2 > self.slots.len() {
            self.rebuild_index((self.slots.len() * 2).max(MIN_INDEX_SLOTS));
        }
        if self.recs.len() == self.recs.capacity() {
            // Grow by a quarter rather than doubling: the records are the per-object budget.
            self.recs.reserve_exact((self.recs.capacity() / 4).max(16));
        }
        if ctx != 0 && self.ctxs.is_empty() {
            // The shard's first context: every record so far has none.
            self.ctxs.reserve_exact(self.recs.capacity());
            self.ctxs.resize(self.recs.len(), 0);
        }
        let pos = self.recs.len();
        self.recs.push(rec);
        if !self.ctxs.is_empty() || ctx != 0 {
            if self.ctxs.len() == self.ctxs.capacity() {
                self.ctxs
                    .reserve_exact(self.recs.capacity() - self.ctxs.len());
            }
            self.ctxs.push(ctx);
        }
        self.place(hash, pos as u32 + 1);
        Ok(())
    }

    #[cfg(test)]
    pub(super) fn remove(&mut self, id: u64, hash: u64) -> Option<ObjRecord> {
        self.remove_ctx(id, hash).map(|(rec, _)| rec)
    }

    /// Removes the record of `id`; returns it with its context.
    pub(super) fn remove_ctx(&mut self, id: u64, hash: u64) -> Option<(ObjRecord, u32)> {
        let i = self.find(id, hash)?;
        let pos = self.slots[i] as usize - 1;
        let recs = &self.recs;
        probe_delete(&mut self.slots, i, |s| {
            mix64(recs[s as usize - 1].id) as usize
        });
        let last = self.recs.len() - 1;
        if pos != last {
            // The last record moves into `pos`: repoint its index slot (found by value, since
            // `recs[last]` is about to go away).
            let mask = self.mask();
            let mut j = mix64(self.recs[last].id) as usize & mask;
            loop {
                let s = self.slots[j];
                if s as usize == last + 1 {
                    self.slots[j] = pos as u32 + 1;
                    break;
                }
                if s == 0 {
                    debug_assert!(false, "heap index lost a record");
                    break;
                }
                j = (j + 1) & mask;
            }
        }
        let rec = self.recs.swap_remove(pos);
        let ctx = if self.ctxs.is_empty() {
            0
        } else {
            self.ctxs.swap_remove(pos)
        };
        if self.recs.is_empty() && !self.ctxs.is_empty() {
            // Freeing needs no allocation.
            self.ctxs = Vec::new();
        }
        Some((rec, ctx))
    }

    /// Gives memory back once most objects died (with hysteresis so churn does not thrash).
    pub(super) fn maybe_shrink(&mut self) {
        let mut len = self.slots.len();
        while len > MIN_INDEX_SLOTS && self.recs.len() * 8 < len {
            len /= 2;
        }
        if len < self.slots.len() {
            self.rebuild_index(len.max(MIN_INDEX_SLOTS));
        }
        let cap = self.recs.capacity();
        if cap > 64 && self.recs.len() < cap / 2 {
            let len = self.recs.len();
            self.recs.shrink_to(len + len / 4 + 16);
            self.ctxs.shrink_to(len + len / 4 + 16);
        }
        if self.recs.is_empty() && !self.ctxs.is_empty() {
            self.ctxs = Vec::new();
        }
    }
}

impl HeapRecorder {
    /// Native model: records a sampled live allocation in one step.
    pub fn track(
        &self,
        id: u64,
        weight: u32,
        size: u64,
        class: Option<&str>,
        frames: &[Frame<'_>],
    ) -> Result<(), HeapError> {
        self.track_in(id, weight, size, class, frames, 0)
            .map(|_| ())
    }

    /// [`Self::track`] for an allocation made inside the trace whose local root span id is
    /// `local_root_span_id` (0: none): its heap sample carries that id and, once
    /// [`Self::name_context`] named it, the trace's endpoint, for as long as the object lives.
    ///
    /// Returns the bytes the record stands for (its weight times its size, what its heap
    /// sample's `heap-live-size` will be; 0 when `sample_every` skipped it), which
    /// [`Self::untrack_bytes`] gives back when the object is freed.
    pub fn track_in(
        &self,
        id: u64,
        weight: u32,
        size: u64,
        class: Option<&str>,
        frames: &[Frame<'_>],
        local_root_span_id: u64,
    ) -> Result<u64, HeapError> {
        let Some(every) = self.sample_tick() else {
            return Ok(0);
        };
        if frames.len() > MAX_FRAMES {
            return Err(HeapError::TooManyFrames {
                got: frames.len(),
                limit: MAX_FRAMES,
            });
        }
        let class = self.intern_class(class)?;
        let stack = match self.acquire_stack(frames) {
            Ok(s) => s,
            Err(e) => {
                self.release_class(class);
                return Err(e);
            }
        };
        let ctx = if local_root_span_id == 0 {
            0
        } else {
            self.contexts.lock().acquire(local_root_span_id)
        };
        let rec = ObjRecord {
            id,
            size,
            weight: weight.saturating_mul(every),
            stack_and_frozen: stack,
            class: class.0,
            alloc_gen: self.current_gen() as u32,
        };
        self.commit_ctx(rec, ctx).map(|()| rec.bytes())
    }

    /// Native model: the allocation `id` was freed. Returns whether it was tracked.
    pub fn untrack(&self, id: u64) -> bool {
        self.untrack_bytes(id).is_some()
    }

    /// [`Self::untrack`], returning the bytes the record stood for (what [`Self::track_in`]
    /// returned for it); `None` when `id` was not tracked.
    pub fn untrack_bytes(&self, id: u64) -> Option<u64> {
        let hash = mix64(id);
        let removed = self.objs[shard_of(hash, OBJ_SHARDS)]
            .lock()
            .remove_ctx(id, hash);
        removed.map(|(rec, ctx)| {
            self.release_record_ctx(&rec, ctx);
            rec.bytes()
        })
    }

    /// Whether object `id` is tracked.
    pub fn is_object_recorded(&self, id: u64) -> bool {
        let hash = mix64(id);
        self.objs[shard_of(hash, OBJ_SHARDS)]
            .lock()
            .get(id, hash)
            .is_some()
    }

    pub(super) fn release_class(&self, class: StringId) {
        if class == StringId::EMPTY {
            return;
        }
        {
            let mut deferred = self.deferred_classes.lock();
            if let Some(list) = deferred.as_mut() {
                list.push(class);
                return;
            }
        }
        // A failure means the id was already released elsewhere: nothing left to free.
        let _ = self.strings.unintern(class);
    }

    /// Drops what one record references (its stack, class and context).
    pub(super) fn release_record_ctx(&self, rec: &ObjRecord, ctx: u32) {
        // Errors can only come from an internal refcount mistake; the record is gone either way.
        let _ = self.release_stack(rec.stack());
        self.release_class(rec.class());
        if ctx != 0 {
            let endpoint = self.contexts.lock().release(ctx);
            if let Some(e) = endpoint {
                self.release_class(e);
            }
        }
    }

    /// Inserts a fully built record with its context (one reference of it held, handed to the
    /// record; 0: none); a duplicate id is an error describing both records (the new one is
    /// dropped, the existing one kept).
    pub(super) fn commit_ctx(&self, rec: ObjRecord, ctx: u32) -> Result<(), HeapError> {
        let hash = mix64(rec.id);
        let existing = self.objs[shard_of(hash, OBJ_SHARDS)]
            .lock()
            .insert_ctx(rec, hash, ctx)
            .err();
        let Some(previous) = existing else {
            return Ok(());
        };
        let err = HeapError::DuplicateId {
            previous: self.describe(&previous),
            new: self.describe(&rec),
        };
        self.release_record_ctx(&rec, ctx);
        Err(err)
    }

    fn describe(&self, rec: &ObjRecord) -> String {
        let first = self.stack_words(rec.stack()).and_then(|w| first_frame(&w));
        let location = match first {
            Some(Frame::Address(a)) => format!("{a:#x}"),
            Some(Frame::Symbol { filename, line, .. }) => {
                let file = match filename {
                    Str::Id(id) => self.strings.get(id).unwrap_or_default(),
                    Str::Lit(s) => s.to_owned(),
                };
                format!("{file}:{line}")
            }
            None => "(empty stack)".to_owned(),
        };
        let gen = self.current_gen();
        let mut s = format!(
            "id={} weight={} size={} location={} alloc_gen={} gen_age={} frozen={}",
            rec.id,
            rec.weight,
            rec.size,
            location,
            gen.wrapping_sub(gen_delta(gen, rec.alloc_gen) as u64),
            gen_age(gen, rec.alloc_gen),
            rec.frozen(),
        );
        if rec.class != 0 {
            if let Ok(class) = self.strings.get(rec.class()) {
                s.push_str(" class=");
                s.push_str(&class);
            }
        }
        s
    }
}
