//! Iteration over live objects: a point-in-time snapshot taken outside every lock, walked
//! object by object or stack by stack, and released at `finish_iteration`.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::error::HeapError;
use crate::profile::Frame;
use crate::spin::SpinLock;
use crate::strings::StringId;

use super::objects::{gen_delta, ObjRecord};
use super::stacks::{address_frames, decode_frame, push_string_ids, split_stack_ref, StackShard};
use super::HeapRecorder;

/// One live object as seen during iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveObject {
    /// The object's id (its address, in the native model).
    pub id: u64,
    /// How many objects this sampled one stands for.
    pub weight: u32,
    /// Its size in bytes.
    pub size: u64,
    /// `StringId::EMPTY` when unknown.
    pub class: StringId,
    /// The generation (collections, or serializations in the native model) it was allocated in.
    pub alloc_gen: u64,
    /// Generations it survived.
    pub gen_age: u64,
    /// Whether it can no longer change size.
    pub frozen: bool,
    /// The local root span id of the trace that allocated the object
    /// ([`HeapRecorder::track_in`]); 0 when none.
    pub local_root_span_id: u64,
    /// That trace's endpoint ([`HeapRecorder::name_context`]); `StringId::EMPTY` when not named.
    pub endpoint: StringId,
}

/// Sizes of a prepared snapshot (see [`HeapRecorder::snapshot_sizes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SnapshotSizes {
    /// Object records copied (objects younger than the minimum age included).
    pub objects: usize,
    /// Stack slots: every stack index of the snapshot is below this (see [`SnapshotStack`]).
    pub stacks: usize,
}

/// One object's stack during [`HeapRecorder::for_each_live_object_by_stack`].
#[derive(Debug, Clone, Copy)]
pub struct SnapshotStack<'a> {
    index: usize,
    words: &'a [u64],
}

impl SnapshotStack<'_> {
    /// Names the stack within the snapshot: equal for objects of the same stack, below
    /// [`SnapshotSizes::stacks`] (or equal to it for a stack the snapshot lacks, which has no
    /// frames).
    pub fn index(&self) -> usize {
        self.index
    }

    /// The addresses of a stack made of address frames only, innermost first, straight from the
    /// stored words (nothing decoded or copied); `None` when the stack has a symbol frame.
    pub fn addresses(&self) -> Option<&[u64]> {
        address_frames(self.words)
    }

    /// Decodes the frames, innermost first, into `out` (cleared first).
    pub fn frames(&self, out: &mut Vec<Frame<'static>>) {
        out.clear();
        match address_frames(self.words) {
            Some(addrs) => out.extend(addrs.iter().map(|&a| Frame::Address(a))),
            None => out.extend(
                self.words[1..]
                    .chunks_exact(2)
                    .map(|w| decode_frame(w[0], w[1])),
            ),
        }
    }
}

struct Snapshot {
    /// Generation ages are computed against (the full update's for managed heaps).
    gen: u64,
    records: Vec<ObjRecord>,
    /// The records' contexts, position for position; empty when none has one.
    ctxs: Vec<u32>,
    /// Context id - 1 -> (root, endpoint), as the contexts table held them after `records` were
    /// copied (entries are pinned first, so those the records refer to are still theirs).
    contexts: Vec<(u64, StringId)>,
    /// Per stack shard, slot -> words (every stack a snapshot record refers to is present: stacks
    /// are pinned before records are copied).
    stacks: Vec<Vec<Option<Arc<[u64]>>>>,
}

impl Snapshot {
    fn words(&self, stack: u32) -> Option<&[u64]> {
        let (shard, slot) = split_stack_ref(stack);
        self.stacks.get(shard)?.get(slot)?.as_deref()
    }
}

/// Clones a shard's stack table for a snapshot, a chunk per lock hold: cloning touches every
/// stack, and trackers of that shard should not wait for all of them. Chunks are consistent with
/// each other because pinned slots are neither freed nor reused.
fn copy_stack_slots(shard: &SpinLock<StackShard>) -> Vec<Option<Arc<[u64]>>> {
    const CHUNK: usize = 1024;
    let mut out = Vec::new();
    loop {
        let g = shard.lock();
        // All at once rather than by doubling (each doubling copies what is there).
        out.reserve(g.slots.len().saturating_sub(out.len()));
        let end = g.slots.len().min(out.len() + CHUNK);
        out.extend(g.slots[out.len()..end].iter().map(|s| s.words.clone()));
        if end == g.slots.len() {
            return out;
        }
    }
}

/// How many records ahead `for_each_live_object` touches stacks.
const PREFETCH_DISTANCE: usize = 8;

#[derive(Default)]
pub(super) struct IterState {
    pub(super) active: bool,
    snapshot: Option<Arc<Snapshot>>,
}

impl HeapRecorder {
    /// Full update plus a point-in-time snapshot for [`Self::for_each_live_object`].
    pub fn prepare_iteration(&self) -> Result<(), HeapError> {
        {
            let mut it = self.iter.lock();
            if it.active {
                return Err(HeapError::PrepareTwice);
            }
            it.active = true;
            // From here on young updates stand down (a running one is waited for below).
            self.iterating.store(true, Ordering::Release);
        }
        let gen = match self.update(true) {
            Some(gen) => gen,
            None => self.current_gen(),
        };

        // Pin before copying records, so every stack a copied record refers to outlives the
        // snapshot even if its objects go away meanwhile.
        for shard in self.stacks.iter() {
            shard.lock().pinned = true;
        }
        self.contexts.lock().pinned = true;
        *self.deferred_classes.lock() = Some(Vec::new());

        let total: usize = self.objs.iter().map(|s| s.lock().recs.len()).sum();
        let mut records: Vec<ObjRecord> = Vec::with_capacity(total + total / 8 + 16);
        let mut ctxs: Vec<u32> = Vec::new();
        for shard in self.objs.iter() {
            loop {
                let g = shard.lock();
                let n = g.recs.len();
                let ctx_room = g.ctxs.is_empty() || ctxs.capacity() >= records.len() + n;
                if records.capacity() - records.len() >= n && ctx_room {
                    if !g.ctxs.is_empty() {
                        ctxs.resize(records.len(), 0);
                        ctxs.extend_from_slice(&g.ctxs);
                    }
                    records.extend_from_slice(&g.recs);
                    break;
                }
                // Grow outside the lock: allocating threads only ever wait for a memcpy.
                drop(g);
                records.reserve(n + n / 8 + 16);
                if !ctx_room {
                    ctxs.reserve_exact(records.capacity() - ctxs.len());
                }
            }
        }
        if !ctxs.is_empty() {
            ctxs.resize(records.len(), 0);
        }
        // After the records: every context they refer to is pinned, so still theirs.
        let contexts = if ctxs.is_empty() {
            Vec::new()
        } else {
            let c = self.contexts.lock();
            c.entries.iter().map(|e| (e.root, e.endpoint)).collect()
        };
        let stacks = self.stacks.iter().map(|s| copy_stack_slots(s)).collect();
        if self.source.is_none() {
            // Native ages count serializations survived: later ones see these objects older.
            self.native_gen.fetch_add(1, Ordering::AcqRel);
        }
        self.iter.lock().snapshot = Some(Arc::new(Snapshot {
            gen,
            records,
            ctxs,
            contexts,
            stacks,
        }));
        Ok(())
    }

    /// Visits every snapshotted object of age >= min age with its stack; `f` returns false to
    /// stop. Returns Ok(false) when stopped early.
    ///
    /// Runs without holding any recorder lock: tracking, untracking and even `f` calling back
    /// into the recorder proceed normally.
    pub fn for_each_live_object(
        &self,
        f: &mut dyn FnMut(&LiveObject, &[Frame<'_>]) -> bool,
    ) -> Result<bool, HeapError> {
        // Flyweight: one frame buffer for the whole iteration, rebuilt only when the stack
        // changes.
        let mut frames: Vec<Frame<'static>> = Vec::new();
        let mut current_stack = None;
        self.for_each_live_object_by_stack(&mut |live, stack| {
            if current_stack != Some(stack.index) {
                stack.frames(&mut frames);
                current_stack = Some(stack.index);
            }
            f(live, &frames)
        })
    }

    /// Sizes of the prepared snapshot, for pre-sizing what iterating it will build.
    pub fn snapshot_sizes(&self) -> Result<SnapshotSizes, HeapError> {
        let it = self.iter.lock();
        let snapshot = it.snapshot.as_ref().ok_or(HeapError::NotPrepared)?;
        Ok(SnapshotSizes {
            objects: snapshot.records.len(),
            stacks: snapshot.stacks.iter().map(Vec::len).sum(),
        })
    }

    /// Like [`Self::for_each_live_object`], but hands over each object's stack undecoded, with
    /// an index that names it within this snapshot: objects sharing a stack share the index, so
    /// a caller can work a stack out once and reuse the result for every object of it.
    pub fn for_each_live_object_by_stack(
        &self,
        f: &mut dyn FnMut(&LiveObject, SnapshotStack<'_>) -> bool,
    ) -> Result<bool, HeapError> {
        let snapshot = self
            .iter
            .lock()
            .snapshot
            .clone()
            .ok_or(HeapError::NotPrepared)?;
        let min_age = u64::from(self.min_iteration_age);
        // Dense stack indexes: each shard's slots follow the previous shards'.
        let mut shard_base = Vec::with_capacity(snapshot.stacks.len());
        let mut base = 0usize;
        for shard in &snapshot.stacks {
            shard_base.push(base);
            base += shard.len();
        }
        for (i, rec) in snapshot.records.iter().enumerate() {
            let delta = gen_delta(snapshot.gen, rec.alloc_gen);
            let age = delta.max(0) as u64;
            if age < min_age {
                continue;
            }
            // Stacks are scattered allocations, reached through a slot table too big for the
            // cache: prefetching the slot two distances ahead and the stack words it points to
            // one distance ahead lets both cache misses overlap with the work on this record.
            if let Some(far) = snapshot.records.get(i + 2 * PREFETCH_DISTANCE) {
                let (shard, slot) = split_stack_ref(far.stack());
                if let Some(s) = snapshot.stacks.get(shard).and_then(|s| s.get(slot)) {
                    crate::profile::prefetch(s);
                }
            }
            if let Some(ahead) = snapshot.records.get(i + PREFETCH_DISTANCE) {
                if let Some(words) = snapshot.words(ahead.stack()) {
                    // Every cache line of the stack (8 words a line).
                    for line in words.chunks(8) {
                        crate::profile::prefetch(&line[0]);
                    }
                }
            }
            let (shard, slot) = split_stack_ref(rec.stack());
            let words = snapshot.words(rec.stack()).unwrap_or(&[]);
            let stack = SnapshotStack {
                // A reference outside the snapshot (never made) gets an index past every real
                // one, with no frames.
                index: shard_base.get(shard).map_or(base, |b| b + slot),
                words,
            };
            let (local_root_span_id, endpoint) = snapshot
                .ctxs
                .get(i)
                .and_then(|&c| (c as usize).checked_sub(1))
                .and_then(|c| snapshot.contexts.get(c).copied())
                .unwrap_or((0, StringId::EMPTY));
            let live = LiveObject {
                id: rec.id,
                weight: rec.weight,
                size: rec.size,
                class: rec.class(),
                alloc_gen: snapshot.gen.wrapping_sub(delta as u64),
                gen_age: age,
                frozen: rec.frozen(),
                local_root_span_id,
                endpoint,
            };
            if !f(&live, stack) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Ends the iteration [`Self::prepare_iteration`] began: drops its snapshot and releases what
    /// only the snapshot still held.
    pub fn finish_iteration(&self) -> Result<(), HeapError> {
        let mut to_release = Vec::new();
        let snapshot = {
            let mut it = self.iter.lock();
            if !it.active {
                return Err(HeapError::FinishWithoutPrepare);
            }
            // Unpinning happens under the iteration lock so a next prepare cannot interleave.
            for shard in self.stacks.iter() {
                let mut g = shard.lock();
                g.pinned = false;
                // Its capacity is kept: a release while pinned must not grow it.
                let mut quarantined = std::mem::take(&mut g.quarantine);
                for &slot in &quarantined {
                    let slot = slot as usize;
                    if g.slots[slot].refs == 0 {
                        if let Some(words) = g.slots[slot].words.take() {
                            push_string_ids(&words, &mut to_release);
                        }
                        g.slots[slot].texts = Box::default();
                        g.free.push(slot as u32);
                    }
                }
                quarantined.clear();
                g.quarantine = quarantined;
            }
            self.contexts.lock().unpin(&mut to_release);
            // Tables emptied by frees give their memory back here (a free never allocates, so
            // it never shrinks them) or at the shard's next insert.
            for shard in self.objs.iter() {
                shard.lock().maybe_shrink();
            }
            if let Some(classes) = self.deferred_classes.lock().take() {
                to_release.extend(classes);
            }
            it.active = false;
            self.iterating.store(false, Ordering::Release);
            it.snapshot.take()
        };
        drop(snapshot);
        self.strings.unintern_all(&to_release)?;
        Ok(())
    }
}
