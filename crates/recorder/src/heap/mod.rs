//! The heap recorder: sampled live objects and where they were allocated.
//!
//! Object records (id -> weight, size, class, allocation generation, frozen) point at
//! deduplicated, refcounted heap records (stacks). Two liveness models: managed (a
//! [`LivenessSource`] answers "is object N alive") and native (the allocator calls
//! [`HeapRecorder::untrack`] on free).
//!
//! Layout, chosen for many allocating threads and a small per-object footprint:
//! - Object records are 32 bytes, kept densely in 16 shards selected by a mix of the id. Each shard
//!   has its own open-addressed index of `u32` positions, so a tracked object costs its record plus
//!   a few index bytes, and a serialization snapshot is one `memcpy` per shard.
//! - Stacks live in 16 shards selected by the stack hash. A stack is stored once as words:
//!   `[hash, addr0, addr1, ...]` when every frame is an address, `[hash, frame0.a, frame0.b, ...]`
//!   otherwise; objects refer to it by a `u32` (shard + slot). The hash is one of the frames'
//!   *content* (text for symbol frames), so a stack seen before is found without interning
//!   anything: strings are interned only when a new stack is stored.
//! - Iteration works on a point-in-time snapshot taken by [`HeapRecorder::prepare_iteration`],
//!   outside every lock. While a snapshot exists, stacks whose last object goes away keep their slot
//!   and strings ("pinned"), and class strings are released only at
//!   [`HeapRecorder::finish_iteration`], so everything the snapshot refers to stays valid.
//! - Request contexts ([`HeapRecorder::track_in`]): an object may carry the local root span id
//!   of the trace that allocated it, kept in a table shared by the objects of one trace
//!   (refcounted: an entry lives exactly as long as one of its objects) together with the
//!   trace's endpoint once it is named ([`HeapRecorder::name_context`]). The context travels in
//!   a `u32` array beside the records, which a shard only has once one of its objects got a
//!   context: an object without one costs what it did before.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::error::{HeapError, StringError};
use crate::profile::{Frame, Str, MAX_FRAMES};
use crate::spin::SpinLock;
#[cfg(target_arch = "x86_64")]
use crate::strings::bytes_eq_avx2;
use crate::strings::{bytes_eq, StringId, StringStorage, Table};

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
    /// The object's size in bytes now.
    pub size: u64,
    /// Whether the object can no longer change size (its size is then not asked again).
    pub frozen: bool,
}

/// A managed runtime's view of its heap.
///
/// `lookup` is called without any recorder lock held, so it may allocate or take the runtime's
/// own locks. Allocations reported while an update runs are skipped (see
/// [`HeapRecorder::start_recording`]).
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

    /// Deferred mode: `true` when ids cannot be computed while an allocation is being reported.
    /// [`HeapRecorder::start_recording`] then receives a *handle* instead of an id, and the
    /// recording is committed by [`HeapRecorder::finalize_pending_recordings`], which maps each
    /// handle to its id with [`Self::resolve_handle`].
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

/// Heap recorder configuration.
#[derive(Debug, Clone)]
pub struct HeapConfig {
    /// Track every Nth started recording, with weight x N. Must be positive.
    pub sample_every: u32,
    /// Managed model: updates re-measure live objects' sizes (frozen objects keep theirs).
    pub size_enabled: bool,
    /// Run young updates from `after_gc_step` (managed model).
    pub clean_after_gc: bool,
    /// Objects younger than this many generations are left out of iterations (0: every object).
    pub min_iteration_age: u32,
    /// How records leave the recorder: pulled from a runtime, or untracked on free.
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

impl HeapConfig {
    /// Native model (frees observed via `untrack`): every tracked allocation shows up, from the
    /// first serialization on.
    pub fn native() -> Self {
        HeapConfig {
            min_iteration_age: 0,
            liveness: Liveness::Native,
            ..HeapConfig::default()
        }
    }

    /// Managed model: liveness pulled from `source`; objects show up once they survived a
    /// collection.
    pub fn managed(source: Arc<dyn LivenessSource>) -> Self {
        HeapConfig {
            min_iteration_age: DEFAULT_MIN_ITERATION_AGE,
            liveness: Liveness::Managed(source),
            ..HeapConfig::default()
        }
    }
}

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
    /// Moving average ([`EWMA_ALPHA`]) of the objects young updates found alive.
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
    /// Deferred recordings dropped because the buffer ([`MAX_PENDING_RECORDINGS`]) was full.
    pub lifetime_deferred_recordings_skipped_buffer_full: u64,
    /// Deferred recordings committed.
    pub lifetime_deferred_recordings_finalized: u64,
    /// Request contexts (traces with tracked objects) held now.
    pub num_contexts: u64,
    /// Objects tracked without their context because [`MAX_CONTEXTS`] were held.
    pub lifetime_contexts_refused: u64,
}

// ---------------------------------------------------------------------------------------------
// Compact records
// ---------------------------------------------------------------------------------------------

const OBJ_SHARDS: usize = 16;
const STACK_SHARDS: usize = 16;
/// Stack references: slot in the low 27 bits, shard in the next 4, bit 31 free for `FROZEN_BIT`.
const STACK_SLOT_BITS: u32 = 27;
const STACK_SLOT_LIMIT: usize = 1 << STACK_SLOT_BITS;
const STACK_REF_MASK: u32 = !FROZEN_BIT;
const FROZEN_BIT: u32 = 1 << 31;
/// Second word of an address frame in a stack with symbols; symbol frames keep the top half of
/// that word zero.
const ADDRESS_TAG: u64 = 1 << 32;
/// Set in the hash word of a stack whose frames are all addresses: it stores one word per frame.
/// (Bit 63: neither shard choice nor index positions use it.)
const ADDRESS_STACK: u64 = 1 << 63;
/// Stacks up to this many frames are encoded in a stack buffer (no allocation on the hot path).
const INLINE_FRAMES: usize = 64;
/// Entries of the symbol-stack hint table (see [`HeapRecorder::hinted_stack`]).
const STACK_HINTS: usize = 64;
/// Request contexts held at once (each has at least one tracked object); objects tracked past
/// that have none (counted in [`HeapStats::lifetime_contexts_refused`]).
pub const MAX_CONTEXTS: usize = 1 << 24;

/// One tracked object: 32 bytes, the whole per-object cost apart from a few index bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ObjRecord {
    id: u64,
    size: u64,
    weight: u32,
    /// Stack reference in the low 31 bits, frozen flag in the top bit.
    stack_and_frozen: u32,
    class: u32,
    /// Low 32 bits of the allocation generation. Ages are computed with wrapping arithmetic,
    /// exact as long as an object is younger than 2^31 generations.
    alloc_gen: u32,
}

impl ObjRecord {
    const EMPTY: ObjRecord = ObjRecord {
        id: 0,
        size: 0,
        weight: 0,
        stack_and_frozen: 0,
        class: 0,
        alloc_gen: 0,
    };

    fn stack(&self) -> u32 {
        self.stack_and_frozen & STACK_REF_MASK
    }

    fn frozen(&self) -> bool {
        self.stack_and_frozen & FROZEN_BIT != 0
    }

    fn set_frozen(&mut self, frozen: bool) {
        if frozen {
            self.stack_and_frozen |= FROZEN_BIT;
        } else {
            self.stack_and_frozen &= STACK_REF_MASK;
        }
    }

    fn class(&self) -> StringId {
        StringId(self.class)
    }
}

/// Generations between `alloc_gen` (low 32 bits) and `current`, negative when the object was
/// recorded after `current` was read.
fn gen_delta(current: u64, alloc_gen: u32) -> i64 {
    i64::from((current as u32).wrapping_sub(alloc_gen) as i32)
}

fn gen_age(current: u64, alloc_gen: u32) -> u64 {
    gen_delta(current, alloc_gen).max(0) as u64
}

/// splitmix64 finalizer: object ids (often aligned addresses) need their bits spread before they
/// pick a shard and an index slot.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The hint-table entry for a caller's frames buffer (its address and length) holding a stack
/// of `shape`.
#[inline]
fn hint_slot(frames: &[Frame<'_>], shape: u32) -> usize {
    let key = frames.as_ptr() as u64 ^ (frames.len() as u64).rotate_left(48) ^ u64::from(shape);
    (mix64(key) as usize) & (STACK_HINTS - 1)
}

/// A stack's shape: its frames' lines and addresses folded as the stack hashes fold frames (no
/// text is read). Equal stacks have equal shapes; stacks from different call sites mostly do
/// not.
#[inline]
fn shape_of(frames: &[Frame<'_>]) -> u32 {
    let line_or_address = |f: &Frame<'_>| {
        Ok::<u64, std::convert::Infallible>(match f {
            Frame::Address(a) => *a,
            Frame::Symbol { line, .. } => *line as u64,
        })
    };
    let Ok(h) = fold_frames(frames, HK[0], line_or_address);
    (h >> 32) as u32
}

/// Shard choice uses bits 32.. of a hash; in-shard positions use the low bits, so they stay
/// independent.
fn shard_of(hash: u64, shards: usize) -> usize {
    (hash >> 32) as usize & (shards - 1)
}

// ---------------------------------------------------------------------------------------------
// Object shards: dense records + open-addressed index
// ---------------------------------------------------------------------------------------------

const MIN_INDEX_SLOTS: usize = 16;

// Both shard kinds index with linear probing over a power-of-two table whose 0 entries are
// free; `home` gives an entry's home position (before masking).

/// Puts `entry` in the first free slot from `home` on.
fn probe_place<T: Copy + PartialEq + Default>(table: &mut [T], home: usize, entry: T) {
    let mask = table.len() - 1;
    let mut i = home & mask;
    while table[i] != T::default() {
        i = (i + 1) & mask;
    }
    table[i] = entry;
}

/// Backward-shift deletion of the entry at `hole`: later entries of its probe run move up, so
/// every chain stays gap-free without tombstones.
fn probe_delete<T: Copy + PartialEq + Default>(
    table: &mut [T],
    mut hole: usize,
    home: impl Fn(T) -> usize,
) {
    let mask = table.len() - 1;
    let mut j = hole;
    loop {
        j = (j + 1) & mask;
        let e = table[j];
        if e == T::default() {
            break;
        }
        // The entry may fill the hole when the hole lies on its probe path [home, j).
        if (j.wrapping_sub(home(e)) & mask) >= (j.wrapping_sub(hole) & mask) {
            table[hole] = e;
            hole = j;
        }
    }
    table[hole] = T::default();
}

#[derive(Default)]
struct ObjShard {
    /// Dense, unordered; removal swaps the last record into the hole.
    recs: Vec<ObjRecord>,
    /// The context of each record (0 = none), position for position with `recs`; empty until a
    /// record of this shard has one, so objects without contexts never pay for it.
    ctxs: Vec<u32>,
    /// Linear-probing index, a power of two long, at most half full: 0 is empty, otherwise the
    /// position in `recs` plus one.
    slots: Vec<u32>,
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

    fn get(&self, id: u64, hash: u64) -> Option<&ObjRecord> {
        self.find(id, hash)
            .map(|i| &self.recs[self.slots[i] as usize - 1])
    }

    fn get_mut(&mut self, id: u64, hash: u64) -> Option<&mut ObjRecord> {
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
    fn insert(&mut self, rec: ObjRecord, hash: u64) -> Result<(), ObjRecord> {
        self.insert_ctx(rec, hash, 0)
    }

    /// Inserts `rec` with context `ctx`, or returns the record already holding its id.
    fn insert_ctx(&mut self, rec: ObjRecord, hash: u64, ctx: u32) -> Result<(), ObjRecord> {
        if let Some(i) = self.find(rec.id, hash) {
            return Err(self.recs[self.slots[i] as usize - 1]);
        }
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
    fn remove(&mut self, id: u64, hash: u64) -> Option<ObjRecord> {
        self.remove_ctx(id, hash).map(|(rec, _)| rec)
    }

    /// Removes the record of `id`; returns it with its context.
    fn remove_ctx(&mut self, id: u64, hash: u64) -> Option<(ObjRecord, u32)> {
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
        self.maybe_shrink();
        Some((rec, ctx))
    }

    /// Gives memory back once most objects died (with hysteresis so churn does not thrash).
    fn maybe_shrink(&mut self) {
        if self.slots.len() > MIN_INDEX_SLOTS && self.recs.len() * 8 < self.slots.len() {
            let len = (self.slots.len() / 2).max(MIN_INDEX_SLOTS);
            self.rebuild_index(len);
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

// ---------------------------------------------------------------------------------------------
// Request contexts
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, Default)]
struct ContextEntry {
    /// Local root span id of the trace.
    root: u64,
    /// The trace's endpoint (one reference held), `StringId::EMPTY` until named.
    endpoint: StringId,
    /// Objects (committed or being committed) with this context.
    refs: u32,
}

/// The contexts of tracked objects (see the module docs). Context ids are positions in
/// `entries` plus one; 0 is none.
#[derive(Default)]
struct Contexts {
    /// Live entries by root: a root whose entry went (even one quarantined) gets a new entry.
    by_root: std::collections::HashMap<u64, u32, foldhash::fast::FixedState>,
    entries: Vec<ContextEntry>,
    free: Vec<u32>,
    /// Set while a snapshot exists: released entries keep their root and endpoint until
    /// `finish_iteration`, as the snapshot may refer to them.
    pinned: bool,
    quarantine: Vec<u32>,
    refused: u64,
}

impl Contexts {
    /// Takes one reference on the context of `root`, made if new; 0 when none can be made.
    fn acquire(&mut self, root: u64) -> u32 {
        if let Some(&id) = self.by_root.get(&root) {
            self.entries[id as usize - 1].refs += 1;
            return id;
        }
        let pos = match self.free.pop() {
            Some(pos) => pos as usize,
            None if self.entries.len() < MAX_CONTEXTS => {
                self.entries.push(ContextEntry::default());
                self.entries.len() - 1
            }
            None => {
                self.refused += 1;
                return 0;
            }
        };
        self.entries[pos] = ContextEntry {
            root,
            endpoint: StringId::EMPTY,
            refs: 1,
        };
        let id = pos as u32 + 1;
        self.by_root.insert(root, id);
        id
    }

    /// Drops one reference on `id`; returns the endpoint string to release when the entry went.
    fn release(&mut self, id: u32) -> Option<StringId> {
        let pos = (id as usize).checked_sub(1)?;
        let e = self.entries.get_mut(pos)?;
        if e.refs == 0 {
            debug_assert!(false, "context released more often than acquired");
            return None;
        }
        e.refs -= 1;
        if e.refs > 0 {
            return None;
        }
        let (root, endpoint) = (e.root, e.endpoint);
        if self.by_root.get(&root) == Some(&id) {
            self.by_root.remove(&root);
        }
        if self.pinned {
            self.quarantine.push(pos as u32);
            return None;
        }
        self.entries[pos] = ContextEntry::default();
        self.free.push(pos as u32);
        self.maybe_shrink();
        Some(endpoint)
    }

    /// Gives memory back once most contexts went.
    fn maybe_shrink(&mut self) {
        if self.by_root.is_empty() && self.quarantine.is_empty() && self.entries.len() > 64 {
            self.entries = Vec::new();
            self.free = Vec::new();
            self.by_root = Default::default();
        }
    }

    /// Ends a snapshot: quarantined entries are freed; returns their endpoints to release.
    fn unpin(&mut self, out: &mut Vec<StringId>) {
        self.pinned = false;
        for pos in std::mem::take(&mut self.quarantine) {
            let pos = pos as usize;
            if self.entries[pos].refs == 0 {
                if self.entries[pos].endpoint != StringId::EMPTY {
                    out.push(self.entries[pos].endpoint);
                }
                self.entries[pos] = ContextEntry::default();
                self.free.push(pos as u32);
            }
        }
        self.maybe_shrink();
    }
}

// ---------------------------------------------------------------------------------------------
// Stack shards
// ---------------------------------------------------------------------------------------------

struct StackSlot {
    /// The stack's words (see the module docs), `None` while the slot is free.
    words: Option<Arc<[u64]>>,
    /// A symbol stack's interned strings (name then filename per frame, empty for address
    /// frames), shared with the string table: a stack seen again is compared against them
    /// without locking the table.
    texts: Box<[Arc<str>]>,
    /// Objects (committed, pending or being committed) using this stack.
    refs: u32,
}

#[derive(Default)]
struct StackShard {
    /// Linear-probing index of the live stacks, a power of two long, at most half full. An entry
    /// is the low 32 bits of the stack's hash (its home slot, and a filter before the words are
    /// touched) over the slot number plus one; 0 is empty.
    index: Vec<u64>,
    /// Stacks in `index`.
    indexed: usize,
    slots: Vec<StackSlot>,
    free: Vec<u32>,
    /// Set while a snapshot exists: released stacks keep their slot and strings until
    /// `finish_iteration`, as the snapshot may refer to them.
    pinned: bool,
    quarantine: Vec<u32>,
}

impl StackShard {
    /// The slot of the live stack with hash word `hash` for which `eq` holds.
    fn find(&self, hash: u64, mut eq: impl FnMut(&[u64], &[Arc<str>]) -> bool) -> Option<usize> {
        if self.index.is_empty() {
            return None;
        }
        let mask = self.index.len() - 1;
        let mut i = hash as usize & mask;
        loop {
            let e = self.index[i];
            if e == 0 {
                return None;
            }
            if (e >> 32) as u32 == hash as u32 {
                let slot = (e as u32 - 1) as usize;
                let s = &self.slots[slot];
                if let Some(words) = s.words.as_deref() {
                    if words[0] == hash && eq(words, &s.texts) {
                        return Some(slot);
                    }
                }
            }
            i = (i + 1) & mask;
        }
    }

    fn place(&mut self, entry: u64) {
        probe_place(&mut self.index, (entry >> 32) as usize, entry);
    }

    fn rebuild_index(&mut self, len: usize) {
        let old = std::mem::replace(&mut self.index, vec![0; len]);
        for e in old.into_iter().filter(|&e| e != 0) {
            self.place(e);
        }
    }

    fn index_insert(&mut self, hash: u64, slot: usize) {
        if (self.indexed + 1) * 2 > self.index.len() {
            self.rebuild_index((self.index.len() * 2).max(MIN_INDEX_SLOTS));
        }
        self.place((hash << 32) | (slot as u64 + 1));
        self.indexed += 1;
    }

    /// Removes `slot` (whose hash word is `hash`) from the index.
    fn index_remove(&mut self, hash: u64, slot: usize) {
        let mask = self.index.len() - 1;
        let target = (hash << 32) | (slot as u64 + 1);
        let mut hole = hash as usize & mask;
        while self.index[hole] != target {
            if self.index[hole] == 0 {
                debug_assert!(false, "stack index lost a stack");
                return;
            }
            hole = (hole + 1) & mask;
        }
        probe_delete(&mut self.index, hole, |e| (e >> 32) as usize);
        self.indexed -= 1;
        if self.index.len() > MIN_INDEX_SLOTS && self.indexed * 8 < self.index.len() {
            self.rebuild_index((self.index.len() / 2).max(MIN_INDEX_SLOTS));
        }
    }

    /// Drops one reference; returns the words whose strings must now be released.
    fn release(&mut self, slot: usize) -> Option<Arc<[u64]>> {
        let s = self.slots.get_mut(slot)?;
        if s.refs == 0 {
            debug_assert!(false, "heap record released more often than acquired");
            return None;
        }
        s.refs -= 1;
        if s.refs > 0 {
            return None;
        }
        let words = s.words.clone()?;
        self.index_remove(words[0], slot);
        if self.pinned {
            self.quarantine.push(slot as u32);
            return None;
        }
        self.slots[slot].words = None;
        self.slots[slot].texts = Box::default();
        self.free.push(slot as u32);
        Some(words)
    }
}

fn stack_ref(shard: usize, slot: usize) -> u32 {
    ((shard as u32) << STACK_SLOT_BITS) | slot as u32
}

fn split_stack_ref(r: u32) -> (usize, usize) {
    let r = r & STACK_REF_MASK;
    (
        (r >> STACK_SLOT_BITS) as usize,
        (r as usize) & (STACK_SLOT_LIMIT - 1),
    )
}

/// The frames of an address-only stack (empty for no words), `None` for a stack with symbols.
fn address_frames(words: &[u64]) -> Option<&[u64]> {
    match words.split_first() {
        None => Some(&[]),
        Some((&hash, frames)) => (hash & ADDRESS_STACK != 0).then_some(frames),
    }
}

fn first_frame(words: &[u64]) -> Option<Frame<'static>> {
    match address_frames(words) {
        Some(addrs) => addrs.first().map(|&a| Frame::Address(a)),
        None => words.get(1..3).map(|w| decode_frame(w[0], w[1])),
    }
}

fn decode_frame(a: u64, b: u64) -> Frame<'static> {
    if b & ADDRESS_TAG != 0 {
        Frame::Address(a)
    } else {
        Frame::Symbol {
            name: Str::Id(StringId(a as u32)),
            filename: Str::Id(StringId((a >> 32) as u32)),
            line: i64::from(b as u32 as i32),
        }
    }
}

/// Lines are kept as i32 (saturated): no source file gets near 2^31 lines.
#[inline]
fn line_word(line: i64) -> u64 {
    // Branch-free: this runs once per frame on every comparison.
    u64::from(line.clamp(i64::from(i32::MIN), i64::from(i32::MAX)) as i32 as u32)
}

/// Appends the interned ids a stack holds (empty strings are not counted, so not listed).
fn push_string_ids(words: &[u64], out: &mut Vec<StringId>) {
    if address_frames(words).is_some() {
        return;
    }
    for f in words[1..].chunks_exact(2) {
        if f[1] & ADDRESS_TAG == 0 {
            for id in [f[0] as u32, (f[0] >> 32) as u32] {
                if id != 0 {
                    out.push(StringId(id));
                }
            }
        }
    }
}

// Stack hashing. The hash is a function of the frames' content (addresses, text, lines), so a
// stack given as text and the same stack stored as interned ids hash alike, and a stack seen
// before is found without interning. Equal hashes are always confirmed by comparing content.

const HK: [u64; 4] = [
    0x243f_6a88_85a3_08d3,
    0x1319_8a2e_0370_7344,
    0xa409_3822_299f_31d0,
    0x082e_fa98_ec4e_6c89,
];

/// 64x64 -> 128 multiply, halves xored (foldhash's and wyhash's mixing step).
#[inline]
fn fold(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ ((p >> 64) as u64)
}

/// A string's contribution to a stack hash: its length and its first and last 8 bytes rather
/// than every byte. Symbol names are long (hashing 64 of them in full costs more than the rest
/// of a track), and names that agree there are still told apart by the content comparison that
/// confirms every hash match. Mixed by the stack hash's multiply, not here.
#[inline]
fn str_key(s: &str) -> u64 {
    let b = s.as_bytes();
    let n = b.len();
    let (first, last) = match (b.first_chunk::<8>(), b.last_chunk::<8>()) {
        (Some(f), Some(l)) => (u64::from_le_bytes(*f), u64::from_le_bytes(*l)),
        _ => {
            let mut w = [0u8; 8];
            w[..n].copy_from_slice(b);
            (u64::from_le_bytes(w), 0)
        }
    };
    first ^ last.rotate_left(29) ^ ((n as u64) << 48)
}

/// Folds per-frame keys into a stack hash, two frames per multiply; stops at the first error.
#[inline]
fn fold_frames<E>(
    frames: &[Frame<'_>],
    seed: u64,
    key: impl Fn(&Frame<'_>) -> Result<u64, E>,
) -> Result<u64, E> {
    let mut h = seed ^ frames.len() as u64;
    let mut pairs = frames.chunks_exact(2);
    for p in &mut pairs {
        h = fold(h ^ key(&p[0])?, key(&p[1])? ^ HK[1]);
    }
    if let [last] = pairs.remainder() {
        h = fold(h ^ key(last)?, HK[0]);
    }
    Ok(fold(h, HK[3]))
}

/// Hash word of an address-only stack (`ADDRESS_STACK` set); `None` when a frame is a symbol.
#[inline]
fn address_stack_hash(frames: &[Frame<'_>]) -> Option<u64> {
    let addr = |f: &Frame<'_>| match f {
        Frame::Address(a) => Ok(*a),
        Frame::Symbol { .. } => Err(()),
    };
    fold_frames(frames, HK[2], addr)
        .ok()
        .map(|h| h | ADDRESS_STACK)
}

/// The text of a frame string; ids are read from `table` (locked by the caller when needed).
fn text<'s>(s: &'s Str<'_>, table: Option<&'s Table>) -> Result<&'s str, StringError> {
    match (s, table) {
        (Str::Lit(t), _) => Ok(t),
        (Str::Id(id), Some(t)) => t.get(*id),
        (Str::Id(id), None) => Err(StringError::UnknownId(id.0)),
    }
}

/// Hash word of a stack with at least one symbol frame (`ADDRESS_STACK` clear). It covers
/// addresses, names and lines: filenames seldom tell apart stacks that agree on those, and the
/// comparison confirming every match includes them.
fn symbol_stack_hash(frames: &[Frame<'_>], table: Option<&Table>) -> Result<u64, StringError> {
    let key = |f: &Frame<'_>| -> Result<u64, StringError> {
        Ok(match f {
            Frame::Address(a) => *a ^ HK[2],
            Frame::Symbol { name, line, .. } => {
                str_key(text(name, table)?) ^ (*line as u64).wrapping_mul(HK[3])
            }
        })
    };
    Ok(fold_frames(frames, HK[3], key)? & !ADDRESS_STACK)
}

/// Whether a frame string equals the stored string `id` whose text is `text` (ids compare as
/// ids: a live string has one id).
#[inline(always)]
fn same_str(s: &Str<'_>, id: u32, text: &str, eq: impl Fn(&[u8], &[u8]) -> bool) -> bool {
    match s {
        Str::Id(i) => i.0 == id,
        Str::Lit(t) => eq(text.as_bytes(), t.as_bytes()),
    }
}

/// Whether a stored stack (`words`, and `texts` for its symbol frames) holds exactly `frames`,
/// comparing text with the widest vectors the CPU has.
#[inline]
fn frames_match(words: &[u64], texts: &[Arc<str>], frames: &[Frame<'_>]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { frames_match_avx2(words, texts, frames) };
    }
    frames_match_sse(words, texts, frames)
}

/// Out of line: inlined into its caller the comparison runs short of registers and spills.
#[inline(never)]
fn frames_match_sse(words: &[u64], texts: &[Arc<str>], frames: &[Frame<'_>]) -> bool {
    frames_match_with(words, texts, frames, bytes_eq)
}

/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline(never)]
unsafe fn frames_match_avx2(words: &[u64], texts: &[Arc<str>], frames: &[Frame<'_>]) -> bool {
    // SAFETY: AVX2 is supported, by this function's contract.
    frames_match_with(words, texts, frames, |a, b| unsafe { bytes_eq_avx2(a, b) })
}

#[inline(always)]
fn frames_match_with(
    words: &[u64],
    texts: &[Arc<str>],
    frames: &[Frame<'_>],
    eq: impl Fn(&[u8], &[u8]) -> bool + Copy,
) -> bool {
    if let Some(addrs) = address_frames(words) {
        return addrs.len() == frames.len()
            && frames
                .iter()
                .zip(addrs)
                .all(|(f, &w)| matches!(f, Frame::Address(a) if *a == w));
    }
    let pairs = words[1..].chunks_exact(2);
    let text_pairs = texts.chunks_exact(2);
    if pairs.len() != frames.len() || text_pairs.len() != frames.len() {
        return false;
    }
    for ((f, w), t) in frames.iter().zip(pairs).zip(text_pairs) {
        let (a, b, name_text, file_text) = (w[0], w[1], &t[0], &t[1]);
        let same = match f {
            Frame::Address(x) => a == *x && b == ADDRESS_TAG,
            Frame::Symbol {
                name,
                filename,
                line,
            } => {
                // The stored line is `line_word(line)`; a line outside i32 never matches here
                // and is found by the exact word comparison of the insert path instead.
                i64::from(b as u32 as i32) == *line
                    && b & ADDRESS_TAG == 0
                    && same_str(name, a as u32, name_text, eq)
                    && same_str(filename, (a >> 32) as u32, file_text, eq)
            }
        };
        if !same {
            return false;
        }
    }
    true
}

// ---------------------------------------------------------------------------------------------
// Recorder state
// ---------------------------------------------------------------------------------------------

/// The managed model's in-flight recording (between `start_recording` and `end_recording`).
#[derive(Debug, Clone, Copy)]
enum Active {
    Idle,
    /// Not sampled (or skipped): `end_recording` just clears it.
    Skipped,
    /// `rec.id` is a handle when `deferred`; `rec.stack_and_frozen` is filled in at the end.
    Started {
        rec: ObjRecord,
        deferred: bool,
    },
}

#[derive(Debug, Clone, Copy, Default)]
struct UpdateCounts {
    alive: u64,
    dead: u64,
    skipped: u64,
    frozen: u64,
}

#[derive(Debug, Default)]
struct UpdateStats {
    last_gen: Option<u64>,
    last_time: Option<Instant>,
    last: UpdateCounts,
    successful: u64,
    skipped_concurrent: u64,
    skipped_gcgen: u64,
    skipped_time: u64,
    ewma_young: [f64; 3],
    ewma_full: [f64; 3],
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
struct IterState {
    active: bool,
    snapshot: Option<Arc<Snapshot>>,
}

/// Keeps each shard's lock on its own cache lines, so threads working on different shards do not
/// contend through false sharing.
#[derive(Default)]
#[repr(align(128))]
struct Padded<T>(T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T> std::ops::DerefMut for Padded<T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.0
    }
}

/// Holds the update "lock" (an atomic flag, which `after_fork` can clear) until dropped.
struct UpdateGuard<'a>(&'a AtomicBool);

impl Drop for UpdateGuard<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Tracks sampled live objects. `Send + Sync`; all methods take `&self`.
pub struct HeapRecorder {
    strings: Arc<StringStorage>,
    source: Option<Arc<dyn LivenessSource>>,
    deferred_ids: bool,
    size_enabled: bool,
    clean_after_gc: bool,
    min_iteration_age: u32,

    sample_every: AtomicU32,
    /// Starts since the last sampled one (every Nth is kept).
    skip_counter: AtomicU32,
    /// Serializations so far: the native model's generation.
    native_gen: AtomicU64,

    // Spin locks: held for one lookup or a bounded chunk of work, and released with a plain
    // store, which halves the atomic read-modify-writes of a track + untrack against a parking
    // mutex.
    objs: Box<[Padded<SpinLock<ObjShard>>]>,
    stacks: Box<[Padded<SpinLock<StackShard>>]>,
    /// Per caller frames buffer (address and length) and stack shape ([`shape_of`]), hashed,
    /// the symbol stack last found or stored from it: its reference plus one in the low half
    /// (0 = none), the shape in the high half. Only a hint: it is always confirmed by comparing
    /// content under the shard's lock.
    stack_hints: Box<[AtomicU64]>,

    active: Mutex<Active>,
    pending: Mutex<Vec<ObjRecord>>,
    deferred_skipped_full: AtomicU64,
    deferred_finalized: AtomicU64,

    /// Set while an update runs; allocations reported meanwhile are skipped.
    updating: AtomicBool,
    /// Set from `prepare_iteration` to `finish_iteration`: no young update may run.
    iterating: AtomicBool,
    update_stats: Mutex<UpdateStats>,

    iter: Mutex<IterState>,
    /// `Some` while iterating: class strings of objects dropped meanwhile, released at finish.
    deferred_classes: Mutex<Option<Vec<StringId>>>,
    /// Request contexts of tracked objects (see [`Self::track_in`]).
    contexts: SpinLock<Contexts>,
}

impl std::fmt::Debug for HeapRecorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeapRecorder")
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl HeapRecorder {
    /// A heap recorder interning into `strings`; fails on a bad `sample_every`.
    pub fn new(config: HeapConfig, strings: Arc<StringStorage>) -> Result<Self, HeapError> {
        if config.sample_every == 0 {
            return Err(HeapError::InvalidSampleEvery(0));
        }
        let source = match &config.liveness {
            Liveness::Managed(s) => Some(Arc::clone(s)),
            Liveness::Native => None,
        };
        let deferred_ids = source.as_ref().is_some_and(|s| s.defers_ids());
        Ok(HeapRecorder {
            strings,
            source,
            deferred_ids,
            size_enabled: config.size_enabled,
            clean_after_gc: config.clean_after_gc,
            min_iteration_age: config.min_iteration_age,
            sample_every: AtomicU32::new(config.sample_every),
            skip_counter: AtomicU32::new(0),
            native_gen: AtomicU64::new(0),
            objs: (0..OBJ_SHARDS).map(|_| Padded::default()).collect(),
            stacks: (0..STACK_SHARDS).map(|_| Padded::default()).collect(),
            stack_hints: (0..STACK_HINTS).map(|_| AtomicU64::new(0)).collect(),
            active: Mutex::new(Active::Idle),
            pending: Mutex::new(Vec::with_capacity(if deferred_ids {
                MAX_PENDING_RECORDINGS
            } else {
                0
            })),
            deferred_skipped_full: AtomicU64::new(0),
            deferred_finalized: AtomicU64::new(0),
            updating: AtomicBool::new(false),
            iterating: AtomicBool::new(false),
            update_stats: Mutex::new(UpdateStats::default()),
            iter: Mutex::new(IterState::default()),
            deferred_classes: Mutex::new(None),
            contexts: SpinLock::new(Contexts::default()),
        })
    }

    /// Tracks every `n`th started recording from now on, with weight `n` (positive).
    pub fn set_sample_every(&self, n: i64) -> Result<(), HeapError> {
        let every = u32::try_from(n)
            .ok()
            .filter(|&v| v > 0)
            .ok_or(HeapError::InvalidSampleEvery(n))?;
        self.sample_every.store(every, Ordering::Relaxed);
        self.skip_counter.store(0, Ordering::Relaxed);
        Ok(())
    }

    /// Whether `after_gc_step` should run young updates (`HeapConfig::clean_after_gc`).
    pub fn clean_after_gc(&self) -> bool {
        self.clean_after_gc
    }

    /// Minimum age of the objects [`Self::for_each_live_object`] visits.
    pub fn min_iteration_age(&self) -> u32 {
        self.min_iteration_age
    }

    /// The string storage the recorder interns into.
    pub fn strings(&self) -> &Arc<StringStorage> {
        &self.strings
    }

    /// Returns the multiplier to apply when this start is sampled, `None` when it is skipped.
    /// Keeps exactly every Nth start, also under concurrent callers.
    fn sample_tick(&self) -> Option<u32> {
        let every = self.sample_every.load(Ordering::Relaxed);
        if every <= 1 {
            return Some(1);
        }
        let mut cur = self.skip_counter.load(Ordering::Relaxed);
        loop {
            let next = cur.saturating_add(1);
            let (store, keep) = if next >= every {
                (0, true)
            } else {
                (next, false)
            };
            match self.skip_counter.compare_exchange_weak(
                cur,
                store,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return keep.then_some(every),
                Err(actual) => cur = actual,
            }
        }
    }

    fn current_gen(&self) -> u64 {
        match &self.source {
            Some(s) => s.gc_generation(),
            None => self.native_gen.load(Ordering::Acquire),
        }
    }

    fn intern_class(&self, class: Option<&str>) -> Result<StringId, HeapError> {
        match class {
            Some(c) if !c.is_empty() => Ok(self.strings.intern(c)?),
            _ => Ok(StringId::EMPTY),
        }
    }

    /// Managed model: begins recording a new object. Returns whether the caller should schedule
    /// an after-allocation callback ([`Self::finalize_pending_recordings`]) in deferred mode.
    ///
    /// One recording may be in flight at a time (as under a runtime's global lock); `obj_id` is
    /// a handle for [`LivenessSource::resolve_handle`] when the source defers ids.
    pub fn start_recording(
        &self,
        obj_id: u64,
        weight: u32,
        class: Option<&str>,
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
        };
        Ok(needs_callback)
    }

    /// Commits the started recording with its allocation stack.
    pub fn end_recording(&self, frames: &[Frame<'_>]) -> Result<(), HeapError> {
        // Cleared up front: whatever fails below, the next start finds the recorder idle.
        let state = std::mem::replace(&mut *self.active.lock(), Active::Idle);
        let (mut rec, deferred) = match state {
            Active::Idle => return Err(HeapError::EndWithoutStart),
            Active::Skipped => return Ok(()),
            Active::Started { rec, deferred } => (rec, deferred),
        };
        match self.acquire_stack(frames) {
            Ok(stack) => rec.stack_and_frozen = stack,
            Err(e) => {
                self.release_class(rec.class());
                return Err(e);
            }
        }
        if !deferred {
            return self.commit(rec);
        }
        let mut pending = self.pending.lock();
        if pending.len() < MAX_PENDING_RECORDINGS {
            pending.push(rec);
            return Ok(());
        }
        drop(pending);
        // Only reachable if the buffer filled between start and end (concurrent misuse).
        self.deferred_skipped_full.fetch_add(1, Ordering::Relaxed);
        self.release_record(&rec);
        Ok(())
    }

    /// Deferred mode: commits every pending recording, mapping handles to ids. Recordings whose
    /// handle no longer resolves are dropped. Returns the first commit error, after processing
    /// all of them.
    pub fn finalize_pending_recordings(&self) -> Result<(), HeapError> {
        let mut batch = [ObjRecord::EMPTY; MAX_PENDING_RECORDINGS];
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
        for rec in &mut batch[..n] {
            let id = match &self.source {
                Some(s) => s.resolve_handle(rec.id),
                None => Some(rec.id),
            };
            match id {
                Some(id) => {
                    rec.id = id;
                    if let Err(e) = self.commit(*rec) {
                        first_err.get_or_insert(e);
                    }
                }
                None => self.release_record(rec),
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
        } = *self.active.lock()
        {
            active_handle = Some(rec.id);
        }
        for rec in self.pending.lock().iter() {
            f(rec.id);
        }
        if let Some(h) = active_handle {
            f(h);
        }
    }

    /// Young update (after a collection), subject to the update policy.
    pub fn update_young_objects(&self) {
        self.update(false);
    }

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
    }

    /// [`Self::track`] for an allocation made inside the trace whose local root span id is
    /// `local_root_span_id` (0: none): its heap sample carries that id and, once
    /// [`Self::name_context`] named it, the trace's endpoint, for as long as the object lives.
    pub fn track_in(
        &self,
        id: u64,
        weight: u32,
        size: u64,
        class: Option<&str>,
        frames: &[Frame<'_>],
        local_root_span_id: u64,
    ) -> Result<(), HeapError> {
        let Some(every) = self.sample_tick() else {
            return Ok(());
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
        self.commit_ctx(
            ObjRecord {
                id,
                size,
                weight: weight.saturating_mul(every),
                stack_and_frozen: stack,
                class: class.0,
                alloc_gen: self.current_gen() as u32,
            },
            ctx,
        )
    }

    /// Names the endpoint of the trace rooted at `local_root_span_id`: the heap samples of its
    /// objects still tracked carry it (last call wins). Nothing is kept for a trace without
    /// tracked objects.
    pub fn name_context(&self, local_root_span_id: u64, endpoint: &str) -> Result<(), HeapError> {
        if local_root_span_id == 0 || endpoint.is_empty() {
            return Ok(());
        }
        let current = {
            let c = self.contexts.lock();
            let Some(&id) = c.by_root.get(&local_root_span_id) else {
                return Ok(());
            };
            c.entries[id as usize - 1].endpoint
        };
        // The usual case, a trace named once: nothing to intern.
        if current != StringId::EMPTY
            && self.strings.with_str(current, |t| t == endpoint) == Ok(true)
        {
            return Ok(());
        }
        // Interned outside the contexts' lock (the string table has its own).
        let name = self.strings.intern(endpoint)?;
        let old = {
            let mut c = self.contexts.lock();
            match c.by_root.get(&local_root_span_id).copied() {
                Some(id) => {
                    let e = &mut c.entries[id as usize - 1];
                    std::mem::replace(&mut e.endpoint, name)
                }
                // Its objects went meanwhile.
                None => name,
            }
        };
        self.release_class(old);
        Ok(())
    }

    /// Native model: the allocation `id` was freed. Returns whether it was tracked.
    pub fn untrack(&self, id: u64) -> bool {
        let hash = mix64(id);
        let removed = self.objs[shard_of(hash, OBJ_SHARDS)]
            .lock()
            .remove_ctx(id, hash);
        match removed {
            Some((rec, ctx)) => {
                self.release_record_ctx(&rec, ctx);
                true
            }
            None => false,
        }
    }

    /// Whether object `id` is tracked.
    pub fn is_object_recorded(&self, id: u64) -> bool {
        let hash = mix64(id);
        self.objs[shard_of(hash, OBJ_SHARDS)]
            .lock()
            .get(id, hash)
            .is_some()
    }

    // --- stacks --------------------------------------------------------------------------------

    /// Finds or creates the heap record for `frames` and takes one reference on it.
    ///
    /// A stack seen before is found by its content hash and a content comparison (a symbol stack
    /// first tries the hint for its caller's buffer), without interning anything (the record
    /// already holds its strings); only a new stack interns.
    fn acquire_stack(&self, frames: &[Frame<'_>]) -> Result<u32, HeapError> {
        if frames.len() > MAX_FRAMES {
            return Err(HeapError::TooManyFrames {
                got: frames.len(),
                limit: MAX_FRAMES,
            });
        }
        if let Some(hash) = address_stack_hash(frames) {
            return self.find_or_insert_stack(frames, hash);
        }
        // Symbol stacks are costly to hash (their text): a caller that fills one buffer per
        // thread and allocates repeatedly from one site presents the same stack again and
        // again, so first try the stack last seen from this buffer with this shape (lines, no
        // text). The shape keeps a hint per stack for a buffer alternating between stacks, and
        // turns most wrong hints away before the comparison.
        let shape = shape_of(frames);
        let hint = &self.stack_hints[hint_slot(frames, shape)];
        let hinted = hint.load(Ordering::Relaxed);
        if (hinted >> 32) as u32 == shape {
            if let Some(r) = self.hinted_stack(hinted as u32, frames) {
                return Ok(r);
            }
        }
        // Ids handed in by the caller are hashed through their text: without the table an id
        // fails the first try, which then runs again with the table locked.
        let hash = match symbol_stack_hash(frames, None) {
            Ok(h) => h,
            Err(_) => symbol_stack_hash(frames, Some(&self.strings.lock()))?,
        };
        let r = self.find_or_insert_stack(frames, hash)?;
        hint.store(u64::from(shape) << 32 | u64::from(r + 1), Ordering::Relaxed);
        Ok(r)
    }

    /// Takes a reference on stack `hint - 1` when it is live and holds exactly `frames`.
    fn hinted_stack(&self, hint: u32, frames: &[Frame<'_>]) -> Option<u32> {
        let r = hint.checked_sub(1)?;
        let (shard_idx, slot) = split_stack_ref(r);
        let mut shard = self.stacks.get(shard_idx)?.lock();
        let s = shard.slots.get_mut(slot)?;
        // No reference: free, or released and kept only for a snapshot (no longer indexed):
        // never revive it.
        if s.refs == 0 || s.refs == u32::MAX {
            return None;
        }
        if !frames_match(s.words.as_deref()?, &s.texts, frames) {
            return None;
        }
        s.refs += 1;
        Some(r)
    }

    /// Finds the heap record for `frames` by its hash word, or creates it; takes one reference.
    fn find_or_insert_stack(&self, frames: &[Frame<'_>], hash: u64) -> Result<u32, HeapError> {
        let shard_idx = shard_of(hash, STACK_SHARDS);
        {
            let mut shard = self.stacks[shard_idx].lock();
            if let Some(slot) = shard.find(hash, |words, texts| frames_match(words, texts, frames))
            {
                let s = &mut shard.slots[slot];
                if s.refs == u32::MAX {
                    return Err(HeapError::TooManyObjects(u32::MAX));
                }
                s.refs += 1;
                return Ok(stack_ref(shard_idx, slot));
            }
        }
        self.insert_stack(frames, hash)
    }

    /// The miss path of [`Self::acquire_stack`]: interns the strings, stores the stack (unless
    /// another thread stored it meanwhile) and takes one reference on it.
    fn insert_stack(&self, frames: &[Frame<'_>], hash: u64) -> Result<u32, HeapError> {
        let len = if hash & ADDRESS_STACK != 0 {
            1 + frames.len()
        } else {
            1 + 2 * frames.len()
        };
        let mut inline = [0u64; 1 + 2 * INLINE_FRAMES];
        let mut spilled = Vec::new();
        let words: &mut [u64] = if frames.len() <= INLINE_FRAMES {
            &mut inline[..len]
        } else {
            spilled.resize(len, 0);
            &mut spilled
        };
        let texts = self.encode_stack(frames, hash, words)?;
        let interned = texts.is_some();
        let result = self.acquire_words(words, texts.unwrap_or_default());
        let extra_refs = match result {
            // The record already holds references to these strings: drop the ones just taken.
            Ok((_, existed)) => interned && existed,
            Err(_) => interned,
        };
        if extra_refs {
            let mut ids = Vec::with_capacity(2 * frames.len());
            push_string_ids(words, &mut ids);
            if let Err(e) = self.strings.unintern_all(&ids) {
                // Fail as a whole: give back the reference just taken on the record too.
                if let Ok((r, _)) = result {
                    let _ = self.release_stack(r);
                }
                return Err(e.into());
            }
        }
        result.map(|(r, _)| r)
    }

    /// Fills `words` with the compact stack (see the module docs) under the hash word `hash`.
    /// When strings were interned (one reference each, owned by the caller now), returns their
    /// shared texts in frame order.
    fn encode_stack(
        &self,
        frames: &[Frame<'_>],
        hash: u64,
        words: &mut [u64],
    ) -> Result<Option<Box<[Arc<str>]>>, HeapError> {
        words[0] = hash;
        if hash & ADDRESS_STACK != 0 {
            for (w, f) in words[1..].iter_mut().zip(frames) {
                if let Frame::Address(a) = f {
                    *w = *a;
                }
            }
            return Ok(None);
        }
        let mut ids = Vec::new();
        // Ids handed in by the caller are turned back into text: the record needs references
        // of its own, and interning is the only way to take one.
        let mut owned = Vec::new();
        for f in frames {
            if let Frame::Symbol { name, filename, .. } = f {
                for s in [name, filename] {
                    if let Str::Id(id) = s {
                        owned.push(self.strings.get(*id)?);
                    }
                }
            }
        }
        let mut owned_iter = owned.iter();
        let mut strs: Vec<&str> = Vec::with_capacity(2 * frames.len());
        for f in frames {
            if let Frame::Symbol { name, filename, .. } = f {
                for s in [name, filename] {
                    strs.push(match s {
                        Str::Lit(t) => t,
                        Str::Id(_) => owned_iter.next().map_or("", String::as_str),
                    });
                }
            }
        }
        self.strings.intern_all(&strs, &mut ids)?;
        // Two texts per frame (empty ones for address frames), so a comparison walks frames,
        // words and texts in step.
        let mut text_ids = Vec::with_capacity(2 * frames.len());
        let mut symbol_ids = ids.iter();
        for f in frames {
            match f {
                Frame::Symbol { .. } => text_ids.extend(symbol_ids.by_ref().take(2)),
                Frame::Address(_) => text_ids.extend([StringId::EMPTY; 2]),
            }
        }
        let texts = self.strings.shared_texts(&text_ids);
        let mut ids = ids.into_iter();
        for (i, f) in frames.iter().enumerate() {
            let (a, b) = match f {
                Frame::Symbol { line, .. } => {
                    let name = ids.next().unwrap_or_default();
                    let file = ids.next().unwrap_or_default();
                    (
                        u64::from(name.0) | (u64::from(file.0) << 32),
                        line_word(*line),
                    )
                }
                Frame::Address(addr) => (*addr, ADDRESS_TAG),
            };
            words[1 + 2 * i] = a;
            words[2 + 2 * i] = b;
        }
        Ok(Some(texts))
    }

    /// Returns the stack reference and whether the stack was already known. Stored words compare
    /// exactly: the strings of both are live interned ids, equal exactly when the text is.
    fn acquire_words(
        &self,
        words: &[u64],
        texts: Box<[Arc<str>]>,
    ) -> Result<(u32, bool), HeapError> {
        let shard_idx = shard_of(words[0], STACK_SHARDS);
        let mut shard = self.stacks[shard_idx].lock();
        if let Some(slot) = shard.find(words[0], |w, _| w == words) {
            let s = &mut shard.slots[slot];
            if s.refs == u32::MAX {
                return Err(HeapError::TooManyObjects(u32::MAX));
            }
            s.refs += 1;
            return Ok((stack_ref(shard_idx, slot), true));
        }
        let slot = match shard.free.pop() {
            Some(slot) => slot as usize,
            None if shard.slots.len() < STACK_SLOT_LIMIT => {
                shard.slots.push(StackSlot {
                    words: None,
                    texts: Box::default(),
                    refs: 0,
                });
                shard.slots.len() - 1
            }
            None => {
                return Err(HeapError::TooManyStacks {
                    limit: STACK_SLOT_LIMIT * STACK_SHARDS,
                })
            }
        };
        shard.slots[slot] = StackSlot {
            words: Some(Arc::from(words)),
            texts,
            refs: 1,
        };
        shard.index_insert(words[0], slot);
        Ok((stack_ref(shard_idx, slot), false))
    }

    fn stack_words(&self, stack: u32) -> Option<Arc<[u64]>> {
        let (shard, slot) = split_stack_ref(stack);
        self.stacks[shard].lock().slots.get(slot)?.words.clone()
    }

    fn release_stack(&self, stack: u32) -> Result<(), StringError> {
        let (shard, slot) = split_stack_ref(stack);
        let freed = self.stacks[shard].lock().release(slot);
        if let Some(words) = freed {
            let mut ids = Vec::with_capacity(words.len());
            push_string_ids(&words, &mut ids);
            self.strings.unintern_all(&ids)?;
        }
        Ok(())
    }

    fn release_class(&self, class: StringId) {
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

    /// Drops what one record references (its stack and class).
    fn release_record(&self, rec: &ObjRecord) {
        self.release_record_ctx(rec, 0);
    }

    /// Drops what one record references (its stack, class and context).
    fn release_record_ctx(&self, rec: &ObjRecord, ctx: u32) {
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

    /// Inserts a fully built record; a duplicate id is an error describing both records (the
    /// new one is dropped, the existing one kept).
    fn commit(&self, rec: ObjRecord) -> Result<(), HeapError> {
        self.commit_ctx(rec, 0)
    }

    /// [`Self::commit`] with a context (one reference of it held, handed to the record).
    fn commit_ctx(&self, rec: ObjRecord, ctx: u32) -> Result<(), HeapError> {
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

    // --- updates -------------------------------------------------------------------------------

    /// Runs an update (managed model only). Returns the generation it used, or `None` when it
    /// was skipped.
    fn update(&self, full: bool) -> Option<u64> {
        let source = self.source.as_ref()?;
        if full {
            // A young update may be running: wait for it, full updates are not optional.
            while self
                .updating
                .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
            {
                std::thread::yield_now();
            }
        } else if self
            .updating
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.update_stats.lock().skipped_concurrent += 1;
            return None;
        }
        let _guard = UpdateGuard(&self.updating);

        // Updates would invalidate what a snapshot refers to and break its point-in-time view.
        if !full && self.iterating.load(Ordering::Acquire) {
            return None;
        }
        let gen = source.gc_generation();
        let now = Instant::now();
        if !full {
            let mut st = self.update_stats.lock();
            if st.last_gen == Some(gen) {
                // Nothing was collected since the last update: liveness cannot have changed much.
                st.skipped_gcgen += 1;
                return None;
            }
            if st.last_time.is_some_and(|t| {
                now.saturating_duration_since(t)
                    < Duration::from_nanos(MIN_TIME_BETWEEN_YOUNG_UPDATES_NS)
            }) {
                st.skipped_time += 1;
                return None;
            }
        }

        let mut counts = UpdateCounts::default();
        let mut todo: Vec<(u64, bool)> = Vec::new();
        let mut results: Vec<Option<ObjectInfo>> = Vec::new();
        let mut dead: Vec<(ObjRecord, u32)> = Vec::new();
        for shard in self.objs.iter() {
            // Collect under the lock, ask the runtime without it, apply under it again: lookups
            // may be slow or re-enter the runtime, and allocating threads must not wait on them.
            todo.clear();
            {
                let g = shard.lock();
                for rec in &g.recs {
                    let age = gen_age(gen, rec.alloc_gen);
                    // Age 0: not collected even once, would not be iterated anyway.
                    if age == 0 || (!full && age >= u64::from(OLD_AGE)) {
                        counts.skipped += 1;
                        continue;
                    }
                    todo.push((rec.id, rec.frozen()));
                }
            }
            if todo.is_empty() {
                continue;
            }
            results.clear();
            if full {
                results.extend(todo.iter().map(|&(id, _)| source.lookup(id)));
            } else {
                // Young updates only drop the dead: no sizes asked for, none changed.
                results.extend(todo.iter().map(|&(id, _)| {
                    source.is_alive(id).then_some(ObjectInfo {
                        size: 0,
                        frozen: false,
                    })
                }));
            }
            {
                let mut g = shard.lock();
                for (&(id, _), info) in todo.iter().zip(&results) {
                    let hash = mix64(id);
                    match info {
                        None => {
                            if let Some(dead_rec) = g.remove_ctx(id, hash) {
                                counts.dead += 1;
                                dead.push(dead_rec);
                            }
                        }
                        Some(info) => {
                            if let Some(rec) = g.get_mut(id, hash) {
                                // Frozen objects cannot change size: skip re-measuring them.
                                if full && self.size_enabled && !rec.frozen() {
                                    rec.size = info.size;
                                    rec.set_frozen(info.frozen);
                                }
                                counts.alive += 1;
                                if rec.frozen() {
                                    counts.frozen += 1;
                                }
                            }
                        }
                    }
                }
            }
            for (rec, ctx) in dead.drain(..) {
                self.release_record_ctx(&rec, ctx);
            }
        }

        let mut st = self.update_stats.lock();
        st.last = counts;
        st.last_gen = Some(gen);
        st.last_time = Some(now);
        st.successful += 1;
        let ewma = if full {
            &mut st.ewma_full
        } else {
            &mut st.ewma_young
        };
        for (avg, value) in ewma
            .iter_mut()
            .zip([counts.alive, counts.dead, counts.skipped])
        {
            *avg = (1.0 - EWMA_ALPHA) * *avg + EWMA_ALPHA * value as f64;
        }
        Some(gen)
    }

    // --- iteration -----------------------------------------------------------------------------

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
                let quarantined = std::mem::take(&mut g.quarantine);
                for slot in quarantined {
                    let slot = slot as usize;
                    if g.slots[slot].refs == 0 {
                        if let Some(words) = g.slots[slot].words.take() {
                            push_string_ids(&words, &mut to_release);
                        }
                        g.slots[slot].texts = Box::default();
                        g.free.push(slot as u32);
                    }
                }
            }
            self.contexts.lock().unpin(&mut to_release);
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

    /// Called in a forked child: finishes any iteration left behind and resets the lifetime stats.
    ///
    /// Records are kept (the child's heap is a copy of the parent's). An update that was running
    /// in another parent thread never finishes in the child, so its flag is cleared.
    pub fn after_fork(&self) {
        if self.iter.lock().active {
            let _ = self.finish_iteration();
        }
        self.updating.store(false, Ordering::Release);
        let mut st = self.update_stats.lock();
        let (last_gen, last_time, last) = (st.last_gen, st.last_time, st.last);
        *st = UpdateStats {
            last_gen,
            last_time,
            last,
            ..UpdateStats::default()
        };
        drop(st);
        self.deferred_skipped_full.store(0, Ordering::Relaxed);
        self.deferred_finalized.store(0, Ordering::Relaxed);
    }

    /// Testing aid: forget when the last update ran so the 2 s rule lets the next one through.
    pub fn reset_last_update(&self) {
        self.update_stats.lock().last_time = None;
    }
}

impl Drop for HeapRecorder {
    /// Gives back every string reference the recorder still holds: the storage is shared and may
    /// outlive the recorder.
    fn drop(&mut self) {
        let mut ids = Vec::new();
        for shard in self.objs.iter_mut() {
            ids.extend(
                shard
                    .get_mut()
                    .recs
                    .iter()
                    .filter(|r| r.class != 0)
                    .map(|r| r.class()),
            );
        }
        for rec in self.pending.get_mut().iter() {
            if rec.class != 0 {
                ids.push(rec.class());
            }
        }
        if let Active::Started { rec, .. } = *self.active.get_mut() {
            if rec.class != 0 {
                ids.push(rec.class());
            }
        }
        if let Some(classes) = self.deferred_classes.get_mut().take() {
            ids.extend(classes);
        }
        for shard in self.stacks.iter_mut() {
            for slot in shard.get_mut().slots.iter() {
                if let Some(words) = &slot.words {
                    push_string_ids(words, &mut ids);
                }
            }
        }
        let _ = self.strings.unintern_all(&ids);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap as StdHashMap;
    use std::sync::Weak;

    /// A managed heap made of real Rust objects: an id is alive while some `Arc` to its object
    /// exists; a "collection" just advances the generation.
    #[derive(Default)]
    struct ArcHeap {
        gen: AtomicU64,
        next_id: AtomicU64,
        objects: Mutex<StdHashMap<u64, Weak<Obj>>>,
        lookups: AtomicU64,
        deferred: bool,
        /// Deferred mode: handle -> id, filled when an object is "given" an id.
        handles: Mutex<StdHashMap<u64, u64>>,
    }

    struct Obj {
        size: AtomicU64,
        frozen: AtomicBool,
    }

    impl ArcHeap {
        fn alloc(&self, size: u64) -> (u64, Arc<Obj>) {
            let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
            let obj = Arc::new(Obj {
                size: AtomicU64::new(size),
                frozen: AtomicBool::new(false),
            });
            self.objects.lock().insert(id, Arc::downgrade(&obj));
            (id, obj)
        }

        fn gc(&self) {
            self.gen.fetch_add(1, Ordering::Relaxed);
        }
    }

    impl LivenessSource for ArcHeap {
        fn gc_generation(&self) -> u64 {
            self.gen.load(Ordering::Relaxed)
        }

        fn lookup(&self, id: u64) -> Option<ObjectInfo> {
            self.lookups.fetch_add(1, Ordering::Relaxed);
            let obj = self.objects.lock().get(&id)?.upgrade()?;
            Some(ObjectInfo {
                size: obj.size.load(Ordering::Relaxed),
                frozen: obj.frozen.load(Ordering::Relaxed),
            })
        }

        fn defers_ids(&self) -> bool {
            self.deferred
        }

        fn resolve_handle(&self, handle: u64) -> Option<u64> {
            self.handles.lock().get(&handle).copied()
        }
    }

    fn storage() -> Arc<StringStorage> {
        Arc::new(StringStorage::new())
    }

    fn managed(heap: &Arc<ArcHeap>) -> (HeapRecorder, Arc<StringStorage>) {
        let strings = storage();
        let src: Arc<dyn LivenessSource> = heap.clone();
        let rec = HeapRecorder::new(HeapConfig::managed(src), Arc::clone(&strings)).unwrap();
        (rec, strings)
    }

    fn native() -> (HeapRecorder, Arc<StringStorage>) {
        let strings = storage();
        let rec = HeapRecorder::new(HeapConfig::native(), Arc::clone(&strings)).unwrap();
        (rec, strings)
    }

    fn stack(tag: &str) -> Vec<Frame<'_>> {
        vec![
            Frame::sym("alloc_here", tag, 10),
            Frame::sym("caller", "main.rs", 20),
        ]
    }

    /// Collects what an iteration shows, with frames resolved to text.
    fn collect(rec: &HeapRecorder, strings: &StringStorage) -> Vec<(LiveObject, Vec<String>)> {
        let mut out = Vec::new();
        let done = rec
            .for_each_live_object(&mut |o, frames| {
                let names = frames
                    .iter()
                    .map(|f| match f {
                        Frame::Symbol {
                            name: Str::Id(n),
                            filename: Str::Id(file),
                            line,
                        } => format!(
                            "{}@{}:{}",
                            strings.get(*n).unwrap(),
                            strings.get(*file).unwrap(),
                            line
                        ),
                        Frame::Address(a) => format!("{a:#x}"),
                        other => panic!("unexpected frame {other:?}"),
                    })
                    .collect();
                out.push((*o, names));
                true
            })
            .unwrap();
        assert!(done);
        out.sort_by_key(|(o, _)| o.id);
        out
    }

    fn serialize(rec: &HeapRecorder, strings: &StringStorage) -> Vec<(LiveObject, Vec<String>)> {
        rec.prepare_iteration().unwrap();
        let out = collect(rec, strings);
        rec.finish_iteration().unwrap();
        out
    }

    #[test]
    fn contexts_name_live_objects_and_go_with_them() {
        let (rec, strings) = native();
        // Two objects of trace 7, one of trace 9, one without a trace.
        rec.track_in(1, 1, 10, None, &stack("a.rs"), 7).unwrap();
        rec.track_in(2, 1, 20, None, &stack("a.rs"), 7).unwrap();
        rec.track_in(3, 1, 30, None, &stack("b.rs"), 9).unwrap();
        rec.track(4, 1, 40, None, &stack("b.rs")).unwrap();
        assert_eq!(rec.stats().num_contexts, 2);
        // Named after the allocations (as when a request's root span closes); a trace without
        // tracked objects keeps nothing.
        rec.name_context(7, "GET /users").unwrap();
        rec.name_context(7, "GET /users").unwrap();
        rec.name_context(8, "GET /none").unwrap();
        let out = serialize(&rec, &strings);
        let ctx: Vec<(u64, u64, String)> = out
            .iter()
            .map(|(o, _)| {
                let e = if o.endpoint == StringId::EMPTY {
                    String::new()
                } else {
                    strings.get(o.endpoint).unwrap()
                };
                (o.id, o.local_root_span_id, e)
            })
            .collect();
        assert_eq!(
            ctx,
            vec![
                (1, 7, "GET /users".into()),
                (2, 7, "GET /users".into()),
                (3, 9, String::new()),
                (4, 0, String::new()),
            ]
        );
        // Renamed: last call wins, the old name's reference goes.
        rec.name_context(9, "POST /orders").unwrap();
        rec.name_context(9, "PUT /orders").unwrap();
        let out = serialize(&rec, &strings);
        assert_eq!(strings.get(out[2].0.endpoint).unwrap(), "PUT /orders");
        // The last object of a trace takes its context and endpoint along.
        assert!(rec.untrack(1));
        assert_eq!(rec.stats().num_contexts, 2);
        assert!(rec.untrack(2));
        assert!(rec.untrack(3));
        assert_eq!(rec.stats().num_contexts, 0);
        assert!(rec.untrack(4));
        assert_eq!(strings.len(), 0, "every string given back");
    }

    #[test]
    fn a_snapshot_keeps_the_contexts_of_objects_freed_meanwhile() {
        let (rec, strings) = native();
        rec.track_in(1, 1, 10, None, &stack("a.rs"), 7).unwrap();
        rec.name_context(7, "GET /a").unwrap();
        rec.prepare_iteration().unwrap();
        // Freed after the snapshot: its context may not be reused by another trace until the
        // iteration finishes, nor its endpoint released.
        assert!(rec.untrack(1));
        rec.track_in(2, 1, 20, None, &stack("a.rs"), 8).unwrap();
        rec.name_context(8, "GET /b").unwrap();
        let out = collect(&rec, &strings);
        rec.finish_iteration().unwrap();
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0.local_root_span_id, 7);
        assert_eq!(strings.get(out[0].0.endpoint).unwrap(), "GET /a");
        let out = serialize(&rec, &strings);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0.local_root_span_id, 8);
        assert_eq!(strings.get(out[0].0.endpoint).unwrap(), "GET /b");
        assert!(rec.untrack(2));
        assert_eq!(rec.stats().num_contexts, 0);
        assert_eq!(strings.len(), 0);
    }

    #[test]
    fn contexts_follow_records_through_shard_churn() {
        // Records move within a shard on removal (swap_remove): their contexts move with them.
        let (rec, strings) = native();
        let n = 2_000u64;
        for i in 0..n {
            // Odd objects without a context, even ones in trace i % 7 + 1.
            let root = if i % 2 == 0 { i % 7 + 1 } else { 0 };
            rec.track_in(0x1000 + i * 16, 1, i, None, &stack("a.rs"), root)
                .unwrap();
        }
        for i in (0..n).filter(|i| i % 3 == 0) {
            assert!(rec.untrack(0x1000 + i * 16));
        }
        for (o, _) in serialize(&rec, &strings) {
            let i = o.size;
            assert_eq!(o.id, 0x1000 + i * 16);
            let root = if i % 2 == 0 { i % 7 + 1 } else { 0 };
            assert_eq!(o.local_root_span_id, root, "object {i}");
        }
        for i in (0..n).filter(|i| i % 3 != 0) {
            assert!(rec.untrack(0x1000 + i * 16));
        }
        assert_eq!(rec.stats().num_contexts, 0);
        assert_eq!(strings.len(), 0);
    }

    #[test]
    fn object_record_is_32_bytes() {
        assert_eq!(std::mem::size_of::<ObjRecord>(), 32);
    }

    #[test]
    fn sample_every_must_be_positive() {
        let cfg = HeapConfig {
            sample_every: 0,
            ..HeapConfig::native()
        };
        let err = HeapRecorder::new(cfg, storage()).unwrap_err();
        assert_eq!(err, HeapError::InvalidSampleEvery(0));
        let (rec, _) = native();
        for bad in [0, -3, i64::from(u32::MAX) + 1] {
            let err = rec.set_sample_every(bad).unwrap_err();
            assert!(err.to_string().contains(&bad.to_string()), "{err}");
        }
        rec.set_sample_every(5).unwrap();
    }

    #[test]
    fn start_end_protocol() {
        let heap = Arc::new(ArcHeap::default());
        let (rec, _) = managed(&heap);
        let err = rec.end_recording(&stack("a.rs")).unwrap_err();
        assert_eq!(
            err.to_string(),
            "Ended a heap recording that was not started"
        );

        let (id, _obj) = heap.alloc(8);
        assert!(!rec.start_recording(id, 1, Some("Foo")).unwrap());
        assert_eq!(
            rec.start_recording(id + 1, 1, None).unwrap_err(),
            HeapError::StartWithoutEnd
        );
        rec.end_recording(&stack("a.rs")).unwrap();
        assert!(rec.is_object_recorded(id));
        assert!(!rec.is_object_recorded(id + 1));
        assert_eq!(
            rec.end_recording(&[]).unwrap_err(),
            HeapError::EndWithoutStart
        );
    }

    #[test]
    fn error_at_end_leaves_recorder_usable_and_balanced() {
        let heap = Arc::new(ArcHeap::default());
        let (rec, strings) = managed(&heap);
        rec.start_recording(1, 1, Some("Foo")).unwrap();
        let too_many = vec![Frame::Address(1); MAX_FRAMES + 1];
        let err = rec.end_recording(&too_many).unwrap_err();
        assert!(matches!(err, HeapError::TooManyFrames { got, .. } if got == MAX_FRAMES + 1));
        strings.advance_generation();
        assert_eq!(strings.len(), 0, "class reference released on error");
        rec.start_recording(1, 1, Some("Foo")).unwrap();
        rec.end_recording(&stack("a.rs")).unwrap();
        assert!(rec.is_object_recorded(1));
    }

    #[test]
    fn duplicate_id_describes_both_records() {
        let (rec, strings) = native();
        rec.track(7, 1, 100, Some("First"), &stack("first.rs"))
            .unwrap();
        let before = strings.len();
        let err = rec
            .track(7, 2, 200, Some("Second"), &stack("second.rs"))
            .unwrap_err();
        let HeapError::DuplicateId { previous, new } = &err else {
            panic!("unexpected {err:?}");
        };
        assert!(
            previous.contains("id=7") && previous.contains("size=100"),
            "{previous}"
        );
        assert!(previous.contains("first.rs:10") && previous.contains("class=First"));
        assert!(
            new.contains("weight=2") && new.contains("second.rs:10"),
            "{new}"
        );
        assert!(new.contains("class=Second"), "{new}");
        // The rejected record's strings were given back.
        strings.advance_generation();
        assert_eq!(strings.len(), before);
        assert_eq!(rec.stats().num_object_records, 1);
        assert_eq!(rec.stats().num_heap_records, 1);
    }

    #[test]
    fn stacks_are_deduplicated_and_freed_with_their_last_object() {
        let (rec, strings) = native();
        for id in 1..=1000 {
            rec.track(id, 1, 16, None, &stack("shared.rs")).unwrap();
        }
        rec.track(5000, 1, 16, None, &stack("other.rs")).unwrap();
        let addr = [Frame::Address(0x1000), Frame::Address(0x2000)];
        rec.track(6000, 1, 16, None, &addr).unwrap();
        rec.track(6001, 1, 16, None, &addr).unwrap();
        let st = rec.stats();
        assert_eq!(st.num_object_records, 1003);
        assert_eq!(st.num_heap_records, 3);
        // alloc_here, caller, main.rs, shared.rs, other.rs
        assert_eq!(strings.len(), 5);
        let shared = strings.intern("shared.rs").unwrap();
        assert_eq!(
            strings.refcount(shared),
            Some(2),
            "one for the record, one for us"
        );
        strings.unintern(shared).unwrap();

        for id in 1..=999 {
            assert!(rec.untrack(id));
        }
        assert!(!rec.untrack(1), "already untracked");
        assert_eq!(rec.stats().num_heap_records, 3);
        assert!(rec.untrack(1000));
        assert_eq!(rec.stats().num_heap_records, 2);
        assert!(rec.untrack(5000) && rec.untrack(6000) && rec.untrack(6001));
        assert_eq!(rec.stats().num_heap_records, 0);
        assert_eq!(rec.stats().num_object_records, 0);
        strings.advance_generation();
        assert_eq!(strings.len(), 0);
    }

    /// The stack hint is keyed by the caller's buffer, whose content can change between calls,
    /// and names a slot that can be freed and reused: whatever it says, the records are exactly
    /// those a lookup by content gives.
    #[test]
    fn stack_hints_never_change_which_record_a_stack_gets() {
        let (rec, strings) = native();
        let names: Vec<String> = (0..6).map(|i| format!("crate::f{i}")).collect();
        let mut buf: Vec<Frame<'_>> = names[..3]
            .iter()
            .map(|n| Frame::sym(n, "a.rs", 1))
            .collect();
        rec.track(1, 1, 8, None, &buf).unwrap();
        rec.track(2, 1, 8, None, &buf).unwrap();
        assert_eq!(rec.stats().num_heap_records, 1, "same content, same record");
        // Same buffer (address and length), other content: a record of its own.
        buf[2] = Frame::sym(&names[5], "a.rs", 1);
        rec.track(3, 1, 8, None, &buf).unwrap();
        assert_eq!(rec.stats().num_heap_records, 2);
        // Only the line differs.
        buf[2] = Frame::sym(&names[5], "a.rs", 2);
        rec.track(4, 1, 8, None, &buf).unwrap();
        assert_eq!(rec.stats().num_heap_records, 3);
        // Back to the first content through the buffer whose hint names another stack.
        buf[2] = Frame::sym(&names[2], "a.rs", 1);
        rec.track(5, 1, 8, None, &buf).unwrap();
        assert_eq!(
            rec.stats().num_heap_records,
            3,
            "found by content, not duplicated"
        );
        // Free the hinted stack; another stack takes its slot; the buffer comes back with the
        // freed content: the hint now names the newcomer and must not be taken.
        assert!(rec.untrack(4));
        assert_eq!(rec.stats().num_heap_records, 2);
        let other: Vec<Frame<'_>> = names[3..6]
            .iter()
            .map(|n| Frame::sym(n, "b.rs", 9))
            .collect();
        rec.track(6, 1, 8, None, &other).unwrap();
        buf[2] = Frame::sym(&names[5], "a.rs", 2);
        rec.track(7, 1, 8, None, &buf).unwrap();
        assert_eq!(rec.stats().num_heap_records, 4);
        for id in 1..=7 {
            rec.untrack(id);
        }
        assert_eq!(rec.stats().num_heap_records, 0);
        assert_eq!(rec.stats().num_object_records, 0);
        strings.advance_generation();
        assert_eq!(strings.len(), 0, "every record gave its strings back");
    }

    /// A stack released while a snapshot pins it keeps its slot (for the snapshot) but has no
    /// reference: a hint to it must not revive it.
    #[test]
    fn stack_hints_do_not_revive_a_stack_kept_for_a_snapshot() {
        let (rec, strings) = native();
        let frames = stack("pinned.rs");
        rec.track(1, 1, 8, None, &frames).unwrap();
        rec.prepare_iteration().unwrap();
        assert!(rec.untrack(1));
        rec.track(2, 1, 8, None, &frames).unwrap();
        rec.finish_iteration().unwrap();
        assert_eq!(rec.stats().num_heap_records, 1);
        assert!(rec.is_object_recorded(2));
        assert!(rec.untrack(2));
        assert_eq!(rec.stats().num_heap_records, 0);
        strings.advance_generation();
        assert_eq!(strings.len(), 0);
    }

    /// Both text comparisons (SSE2 baseline, AVX2 when the CPU has it) against a stored stack:
    /// equal only for the same frames, whatever the string lengths or where they differ.
    #[test]
    fn stored_stack_comparison_sees_every_difference() {
        let (rec, _strings) = native();
        let texts: Vec<String> = [0usize, 5, 9, 16, 17, 31, 32, 33, 48, 64, 65, 100]
            .iter()
            .map(|&n| {
                (0..n)
                    .map(|i| char::from(b'a' + (i * 7 % 26) as u8))
                    .collect()
            })
            .collect();
        let mut frames: Vec<Frame<'_>> = texts
            .iter()
            .zip(texts.iter().rev())
            .enumerate()
            .map(|(i, (n, f))| Frame::sym(n, f, i as i64 * 3))
            .collect();
        frames.insert(3, Frame::Address(0xdead_beef));
        rec.track(1, 1, 16, None, &frames).unwrap();
        let hash = symbol_stack_hash(&frames, None).unwrap();
        let shard = rec.stacks[shard_of(hash, STACK_SHARDS)].lock();
        let slot = shard
            .slots
            .iter()
            .find(|s| s.words.as_deref().is_some_and(|w| w[0] == hash))
            .expect("the stack is stored");
        let (words, stored) = (slot.words.as_deref().unwrap(), &slot.texts[..]);
        let check = |candidate: &[Frame<'_>], expect: bool, what: &str| {
            assert_eq!(
                frames_match_sse(words, stored, candidate),
                expect,
                "sse: {what}"
            );
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2 (checked just above).
                let avx2 = unsafe { frames_match_avx2(words, stored, candidate) };
                assert_eq!(avx2, expect, "avx2: {what}");
            }
        };
        check(&frames, true, "same frames");
        let copies: Vec<(String, String)> = texts
            .iter()
            .zip(texts.iter().rev())
            .map(|(n, f)| (n.clone(), f.clone()))
            .collect();
        for (i, (n, f)) in copies.iter().enumerate() {
            let at = if i >= 3 { i + 1 } else { i };
            for which in 0..2 {
                let base = if which == 0 { n } else { f };
                for pos in 0..base.len() {
                    let mut bytes = base.clone().into_bytes();
                    bytes[pos] = if bytes[pos] == b'Z' { b'Y' } else { b'Z' };
                    let changed = String::from_utf8(bytes).unwrap();
                    let mut v = frames.clone();
                    v[at] = if which == 0 {
                        Frame::sym(&changed, f, i as i64 * 3)
                    } else {
                        Frame::sym(n, &changed, i as i64 * 3)
                    };
                    check(&v, false, &format!("frame {at} string {which} byte {pos}"));
                }
                let longer = format!("{base}x");
                let mut v = frames.clone();
                v[at] = if which == 0 {
                    Frame::sym(&longer, f, i as i64 * 3)
                } else {
                    Frame::sym(n, &longer, i as i64 * 3)
                };
                check(&v, false, &format!("frame {at} string {which} longer"));
            }
            let mut v = frames.clone();
            v[at] = Frame::sym(n, f, i as i64 * 3 + 1);
            check(&v, false, &format!("frame {at} line"));
        }
        let mut v = frames.clone();
        v[3] = Frame::Address(0xdead_bee0);
        check(&v, false, "address frame");
        check(&frames[..frames.len() - 1], false, "one frame fewer");
    }

    #[test]
    fn lines_beyond_i32_share_one_record_and_free_their_strings() {
        let (rec, strings) = native();
        // Stored saturated, these miss the hashed lookup and are found by the exact comparison
        // of the insert path, which must neither duplicate the record nor leak string refs.
        for line in [i64::MAX, i64::MIN, i64::from(i32::MAX) + 1] {
            let frames = [
                Frame::sym("far", "far.rs", line),
                Frame::sym("near", "n.rs", 7),
            ];
            for id in 1..=3 {
                rec.track(id, 1, 8, None, &frames).unwrap();
            }
            assert_eq!(rec.stats().num_heap_records, 1, "line {line}");
            let far = strings.intern("far").unwrap();
            assert_eq!(strings.refcount(far), Some(2), "line {line}");
            strings.unintern(far).unwrap();
            for id in 1..=3 {
                assert!(rec.untrack(id));
            }
            assert_eq!(rec.stats().num_heap_records, 0);
            strings.advance_generation();
            assert_eq!(strings.len(), 0, "line {line}");
        }
    }

    #[test]
    fn frames_given_as_ids_are_referenced_by_the_record() {
        let (rec, strings) = native();
        let name = strings.intern("by_id").unwrap();
        let frames = [Frame::Symbol {
            name: Str::Id(name),
            filename: Str::Lit("f.rs"),
            line: 3,
        }];
        rec.track(1, 1, 1, None, &frames).unwrap();
        strings.unintern(name).unwrap();
        strings.advance_generation();
        let out = serialize(&rec, &strings);
        assert_eq!(out[0].1, vec!["by_id@f.rs:3".to_owned()]);
    }

    #[test]
    fn sample_every_keeps_every_nth_with_scaled_weight() {
        let (rec, strings) = native();
        rec.set_sample_every(2).unwrap();
        for id in 1..=10 {
            rec.track(id, 3, 8, None, &stack("a.rs")).unwrap();
        }
        let out = serialize(&rec, &strings);
        let ids: Vec<u64> = out.iter().map(|(o, _)| o.id).collect();
        assert_eq!(ids, vec![2, 4, 6, 8, 10]);
        assert!(out.iter().all(|(o, _)| o.weight == 6));
    }

    #[test]
    fn native_ages_count_serializations_survived() {
        let (rec, strings) = native();
        rec.track(1, 1, 10, Some("Old"), &stack("a.rs")).unwrap();
        let out = serialize(&rec, &strings);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0.gen_age, 0);
        assert_eq!(strings.get(out[0].0.class).unwrap(), "Old");
        rec.track(2, 1, 20, None, &[Frame::Address(0xabc)]).unwrap();
        let out = serialize(&rec, &strings);
        assert_eq!(
            out.iter()
                .map(|(o, _)| (o.id, o.gen_age, o.alloc_gen))
                .collect::<Vec<_>>(),
            vec![(1, 1, 0), (2, 0, 1)]
        );
        assert_eq!(out[1].1, vec!["0xabc".to_owned()]);
        assert_eq!(out[1].0.class, StringId::EMPTY);

        // With a minimum age of 1, fresh allocations are left out.
        let cfg = HeapConfig {
            min_iteration_age: 1,
            ..HeapConfig::native()
        };
        let rec = HeapRecorder::new(cfg, Arc::clone(&strings)).unwrap();
        rec.track(1, 1, 10, None, &stack("a.rs")).unwrap();
        assert!(serialize(&rec, &strings).is_empty());
        assert_eq!(serialize(&rec, &strings).len(), 1);
    }

    #[test]
    fn iteration_misuse_is_an_error() {
        let (rec, _) = native();
        assert_eq!(
            rec.finish_iteration().unwrap_err(),
            HeapError::FinishWithoutPrepare
        );
        assert_eq!(
            rec.for_each_live_object(&mut |_, _| true).unwrap_err(),
            HeapError::NotPrepared
        );
        rec.prepare_iteration().unwrap();
        assert_eq!(
            rec.prepare_iteration().unwrap_err(),
            HeapError::PrepareTwice
        );
        rec.finish_iteration().unwrap();
        rec.prepare_iteration().unwrap();
        rec.finish_iteration().unwrap();
    }

    #[test]
    fn iteration_can_stop_early() {
        let (rec, _) = native();
        for id in 1..=5 {
            rec.track(id, 1, 1, None, &[]).unwrap();
        }
        rec.prepare_iteration().unwrap();
        let mut seen = 0;
        let done = rec
            .for_each_live_object(&mut |_, frames| {
                assert!(frames.is_empty());
                seen += 1;
                seen < 2
            })
            .unwrap();
        assert!(!done);
        assert_eq!(seen, 2);
        rec.finish_iteration().unwrap();
    }

    #[test]
    fn snapshot_stays_valid_while_objects_go_away() {
        let (rec, strings) = native();
        rec.track(1, 1, 10, Some("Gone"), &stack("gone.rs"))
            .unwrap();
        rec.prepare_iteration().unwrap();
        // Untracked and a new, different stack tracked while the snapshot exists: the snapshot
        // must still show the old stack and class, and the strings stay interned.
        assert!(rec.untrack(1));
        rec.track(2, 1, 10, None, &stack("new.rs")).unwrap();
        strings.advance_generation();
        let out = collect(&rec, &strings);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0.id, 1);
        assert_eq!(strings.get(out[0].0.class).unwrap(), "Gone");
        assert_eq!(out[0].1[0], "alloc_here@gone.rs:10");
        rec.finish_iteration().unwrap();
        strings.advance_generation();
        assert!(
            strings.get(out[0].0.class).is_err(),
            "released after finish"
        );
        let out = serialize(&rec, &strings);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].1[0], "alloc_here@new.rs:10");
    }

    #[test]
    fn strings_return_to_initial_size() {
        let (rec, strings) = native();
        let initial = strings.len();
        for id in 0..200u64 {
            let file = format!("file_{}.rs", id % 7);
            let class = format!("Class{}", id % 3);
            let frames = [
                Frame::sym("a", &file, id as i64 % 5),
                Frame::Address(id % 11),
            ];
            rec.track(id, 1, 1, Some(&class), &frames).unwrap();
        }
        serialize(&rec, &strings);
        rec.prepare_iteration().unwrap();
        for id in 0..200u64 {
            assert!(rec.untrack(id));
        }
        rec.finish_iteration().unwrap();
        strings.advance_generation();
        assert_eq!(strings.len(), initial);
    }

    #[test]
    fn dropping_the_recorder_gives_strings_back() {
        let strings = storage();
        {
            let rec = HeapRecorder::new(HeapConfig::native(), Arc::clone(&strings)).unwrap();
            rec.track(1, 1, 1, Some("K"), &stack("x.rs")).unwrap();
            rec.prepare_iteration().unwrap();
            rec.untrack(1);
        }
        strings.advance_generation();
        assert_eq!(strings.len(), 0);
    }

    #[test]
    fn managed_full_update_removes_dead_and_measures_sizes() {
        let heap = Arc::new(ArcHeap::default());
        let (rec, strings) = managed(&heap);
        let mut keep = Vec::new();
        let mut ids = Vec::new();
        for i in 0..6u64 {
            let (id, obj) = heap.alloc(100 + i);
            rec.start_recording(id, 1, Some("Thing")).unwrap();
            rec.end_recording(&stack("m.rs")).unwrap();
            ids.push(id);
            keep.push(Some(obj));
        }
        // Age 0 objects are left out: nothing was collected yet.
        assert!(serialize(&rec, &strings).is_empty());
        heap.gc();
        keep[1] = None;
        keep[4] = None;
        keep[2]
            .as_ref()
            .unwrap()
            .frozen
            .store(true, Ordering::Relaxed);
        let out = serialize(&rec, &strings);
        let seen: Vec<(u64, u64, bool)> =
            out.iter().map(|(o, _)| (o.id, o.size, o.frozen)).collect();
        assert_eq!(
            seen,
            vec![
                (ids[0], 100, false),
                (ids[2], 102, true),
                (ids[3], 103, false),
                (ids[5], 105, false)
            ]
        );
        assert!(out.iter().all(|(o, _)| o.gen_age == 1));
        let st = rec.stats();
        assert_eq!(st.num_object_records, 4);
        assert_eq!(
            (st.last_update_objects_alive, st.last_update_objects_dead),
            (4, 2)
        );
        assert_eq!(st.last_update_objects_frozen, 1);

        // Frozen objects keep their size; others are re-measured.
        keep[2].as_ref().unwrap().size.store(999, Ordering::Relaxed);
        keep[3].as_ref().unwrap().size.store(555, Ordering::Relaxed);
        heap.gc();
        let out = serialize(&rec, &strings);
        let sizes: Vec<u64> = out.iter().map(|(o, _)| o.size).collect();
        assert_eq!(sizes, vec![100, 102, 555, 105]);
        assert!(out.iter().all(|(o, _)| o.gen_age == 2 && o.alloc_gen == 0));
        assert_eq!(strings.get(out[0].0.class).unwrap(), "Thing");
    }

    #[test]
    fn size_disabled_keeps_sizes_at_zero() {
        let heap = Arc::new(ArcHeap::default());
        let strings = storage();
        let src: Arc<dyn LivenessSource> = heap.clone();
        let cfg = HeapConfig {
            size_enabled: false,
            ..HeapConfig::managed(src)
        };
        let rec = HeapRecorder::new(cfg, Arc::clone(&strings)).unwrap();
        let (id, _obj) = heap.alloc(64);
        rec.start_recording(id, 1, None).unwrap();
        rec.end_recording(&[]).unwrap();
        heap.gc();
        let out = serialize(&rec, &strings);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0.size, 0);
    }

    #[test]
    fn young_update_policy() {
        let heap = Arc::new(ArcHeap::default());
        let (rec, strings) = managed(&heap);
        let track = |size| {
            let (id, obj) = heap.alloc(size);
            rec.start_recording(id, 1, None).unwrap();
            rec.end_recording(&stack("y.rs")).unwrap();
            (id, obj)
        };
        // Three old objects (age 3 at the update below) and a young and a brand-new one.
        let old: Vec<_> = (0..3).map(|_| track(1)).collect();
        heap.gc();
        heap.gc();
        let (young_id, young) = track(2);
        heap.gc();
        let (new_id, new) = track(3);
        drop(old);
        drop(young);
        drop(new);

        rec.update_young_objects();
        let st = rec.stats();
        assert_eq!(st.lifetime_updates_successful, 1);
        // Only the young object (age 1) was looked at; age 0 and age >= 3 were skipped.
        assert_eq!(st.last_update_objects_dead, 1);
        assert_eq!(st.last_update_objects_skipped, 4);
        assert!(!rec.is_object_recorded(young_id));
        assert!(rec.is_object_recorded(new_id));
        assert_eq!(st.num_object_records, 4);
        assert!((st.lifetime_ewma_young_objects_dead - EWMA_ALPHA).abs() < 1e-9);
        assert!((st.lifetime_ewma_young_objects_skipped - 4.0 * EWMA_ALPHA).abs() < 1e-9);

        // Same generation: skipped.
        rec.update_young_objects();
        assert_eq!(rec.stats().lifetime_updates_skipped_gcgen, 1);
        // New generation but under 2 s since the last update: skipped.
        heap.gc();
        rec.update_young_objects();
        assert_eq!(rec.stats().lifetime_updates_skipped_time, 1);
        // No young update while an iteration snapshot exists.
        rec.reset_last_update();
        rec.prepare_iteration().unwrap();
        let successful = rec.stats().lifetime_updates_successful;
        rec.update_young_objects();
        assert_eq!(rec.stats().lifetime_updates_successful, successful);
        rec.finish_iteration().unwrap();
        // The full update at prepare already removed every dead object.
        assert_eq!(rec.stats().num_object_records, 0);
        let _ = strings;
    }

    #[test]
    fn allocations_during_an_update_are_skipped() {
        /// Reports an allocation from inside `lookup`, as a runtime whose lookups allocate would.
        struct Reentrant {
            rec: Mutex<Option<Weak<HeapRecorder>>>,
            inner: ArcHeap,
            skipped_ok: AtomicBool,
        }
        impl LivenessSource for Reentrant {
            fn gc_generation(&self) -> u64 {
                self.inner.gc_generation()
            }
            fn lookup(&self, id: u64) -> Option<ObjectInfo> {
                let rec = self.rec.lock().as_ref().and_then(Weak::upgrade);
                if let Some(rec) = rec {
                    let ok = rec.start_recording(9999, 1, None) == Ok(false)
                        && rec.end_recording(&[]).is_ok();
                    self.skipped_ok.store(ok, Ordering::Relaxed);
                }
                self.inner.lookup(id)
            }
        }
        let src = Arc::new(Reentrant {
            rec: Mutex::new(None),
            inner: ArcHeap::default(),
            skipped_ok: AtomicBool::new(false),
        });
        let dyn_src: Arc<dyn LivenessSource> = src.clone();
        let rec = Arc::new(HeapRecorder::new(HeapConfig::managed(dyn_src), storage()).unwrap());
        *src.rec.lock() = Some(Arc::downgrade(&rec));
        let (id, _obj) = src.inner.alloc(1);
        rec.start_recording(id, 1, None).unwrap();
        rec.end_recording(&[]).unwrap();
        src.inner.gc();
        rec.prepare_iteration().unwrap();
        rec.finish_iteration().unwrap();
        assert!(src.skipped_ok.load(Ordering::Relaxed));
        assert!(!rec.is_object_recorded(9999));
        assert!(rec.is_object_recorded(id));
    }

    #[test]
    fn concurrent_young_updates_are_skipped_and_block_nobody() {
        /// Liveness source whose lookups wait until released, to hold an update open.
        struct Gated {
            inner: ArcHeap,
            entered: std::sync::Barrier,
            release: std::sync::Barrier,
        }
        impl LivenessSource for Gated {
            fn gc_generation(&self) -> u64 {
                self.inner.gc_generation()
            }
            fn lookup(&self, id: u64) -> Option<ObjectInfo> {
                self.entered.wait();
                self.release.wait();
                self.inner.lookup(id)
            }
        }
        let src = Arc::new(Gated {
            inner: ArcHeap::default(),
            entered: std::sync::Barrier::new(2),
            release: std::sync::Barrier::new(2),
        });
        let dyn_src: Arc<dyn LivenessSource> = src.clone();
        let rec = Arc::new(HeapRecorder::new(HeapConfig::managed(dyn_src), storage()).unwrap());
        let (id, _obj) = src.inner.alloc(1);
        rec.start_recording(id, 1, None).unwrap();
        rec.end_recording(&[]).unwrap();
        src.inner.gc();
        let updater = {
            let rec = Arc::clone(&rec);
            std::thread::spawn(move || rec.update_young_objects())
        };
        src.entered.wait();
        // An update is running (inside a lookup): another one is skipped, allocations are
        // skipped, and tracking elsewhere does not wait.
        rec.update_young_objects();
        assert_eq!(rec.stats().lifetime_updates_skipped_concurrent, 1);
        assert!(!rec.start_recording(77, 1, None).unwrap());
        rec.end_recording(&[]).unwrap();
        rec.track(78, 1, 1, None, &[]).unwrap();
        assert!(rec.untrack(78));
        src.release.wait();
        updater.join().unwrap();
        let st = rec.stats();
        assert_eq!(st.lifetime_updates_successful, 1);
        assert_eq!(st.last_update_objects_alive, 1);
        assert!(!rec.is_object_recorded(77));
    }

    #[test]
    fn deferred_recordings() {
        let heap = Arc::new(ArcHeap {
            deferred: true,
            ..ArcHeap::default()
        });
        let (rec, strings) = managed(&heap);
        let mut objs = Vec::new();
        let mut signals = Vec::new();
        for handle in 0..(MAX_PENDING_RECORDINGS as u64 + 3) {
            signals.push(rec.start_recording(handle, 1, Some("D")).unwrap());
            rec.end_recording(&stack("d.rs")).unwrap();
        }
        // Asked when the buffer goes from empty to non-empty, then from half full on, and
        // always once it is full.
        assert!(signals[0]);
        assert!(!signals[1] && !signals[MAX_PENDING_RECORDINGS / 2 - 1]);
        assert!(signals[MAX_PENDING_RECORDINGS / 2..].iter().all(|&s| s));
        let st = rec.stats();
        assert_eq!(st.pending_recordings_count, MAX_PENDING_RECORDINGS as u64);
        assert_eq!(st.lifetime_deferred_recordings_skipped_buffer_full, 3);
        assert_eq!(st.num_object_records, 0);
        let mut handles = Vec::new();
        rec.for_each_pending_handle(|h| handles.push(h));
        assert_eq!(handles.len(), MAX_PENDING_RECORDINGS);

        // Handle h becomes an id; odd handles died before they got one.
        for h in (0..MAX_PENDING_RECORDINGS as u64).step_by(2) {
            let (id, obj) = heap.alloc(1);
            heap.handles.lock().insert(h, id);
            objs.push(obj);
        }
        rec.finalize_pending_recordings().unwrap();
        let st = rec.stats();
        assert_eq!(st.pending_recordings_count, 0);
        assert_eq!(
            st.lifetime_deferred_recordings_finalized,
            MAX_PENDING_RECORDINGS as u64
        );
        assert_eq!(st.num_object_records, MAX_PENDING_RECORDINGS as u64 / 2);
        heap.gc();
        let out = serialize(&rec, &strings);
        assert_eq!(out.len(), MAX_PENDING_RECORDINGS / 2);
        assert!(
            rec.start_recording(1000, 1, None).unwrap(),
            "empty again: ask"
        );
        rec.end_recording(&[]).unwrap();
        rec.finalize_pending_recordings().unwrap();
        // Nothing resolves handle 1000: dropped, nothing leaked.
        assert_eq!(
            rec.stats().num_object_records,
            MAX_PENDING_RECORDINGS as u64 / 2
        );
        rec.after_fork();
        let st = rec.stats();
        assert_eq!(st.lifetime_deferred_recordings_finalized, 0);
        assert_eq!(st.lifetime_updates_successful, 0);
        assert_eq!(st.num_object_records, MAX_PENDING_RECORDINGS as u64 / 2);
    }

    #[test]
    fn symbol_stacks_with_equal_hashes_stay_apart() {
        let (rec, strings) = native();
        // Same length, same first and last 8 bytes, same line: equal stack hashes, so only the
        // content comparison tells them apart.
        let (a, b) = ("prefix__A__suffix", "prefix__B__suffix");
        let fa = [Frame::sym(a, "same_file.rs", 7)];
        let fb = [Frame::sym(b, "same_file.rs", 7)];
        assert_eq!(
            symbol_stack_hash(&fa, None).unwrap(),
            symbol_stack_hash(&fb, None).unwrap()
        );
        rec.track(1, 1, 1, None, &fa).unwrap();
        rec.track(2, 1, 2, None, &fb).unwrap();
        // Seen again: each finds its own record.
        rec.track(3, 1, 3, None, &fb).unwrap();
        rec.track(4, 1, 4, None, &fa).unwrap();
        assert_eq!(rec.stats().num_heap_records, 2);
        let out = serialize(&rec, &strings);
        let names: Vec<&str> = out.iter().map(|(_, f)| f[0].as_str()).collect();
        let (fa, fb) = (format!("{a}@same_file.rs:7"), format!("{b}@same_file.rs:7"));
        assert_eq!(names, [&fa, &fb, &fb, &fa]);
        // One reference per stack record, none per object.
        let id = |s| strings.intern(s).unwrap();
        let (ia, ib, ifile) = (id(a), id(b), id("same_file.rs"));
        assert_eq!(strings.refcount(ia), Some(2));
        assert_eq!(strings.refcount(ib), Some(2));
        assert_eq!(strings.refcount(ifile), Some(3));
        strings.unintern_all(&[ia, ib, ifile]).unwrap();
        for obj in 1..=4 {
            assert!(rec.untrack(obj));
        }
        assert_eq!(rec.stats().num_heap_records, 0);
        assert!(strings.is_empty());
    }

    #[test]
    fn a_seen_stack_is_found_without_interning_whether_given_as_text_or_ids() {
        let (rec, strings) = native();
        let lit = [
            Frame::sym("inner", "a.rs", 1),
            Frame::Address(0x1234),
            Frame::sym("outer", "b.rs", -5),
        ];
        rec.track(1, 1, 1, None, &lit).unwrap();
        let name = strings.intern("inner").unwrap();
        let file = strings.intern("a.rs").unwrap();
        assert_eq!(strings.refcount(name), Some(2));
        let by_id = [
            Frame::ids(name, file, 1),
            Frame::Address(0x1234),
            Frame::Symbol {
                name: Str::Lit("outer"),
                filename: Str::Lit("b.rs"),
                line: -5,
            },
        ];
        rec.track(2, 1, 2, None, &by_id).unwrap();
        rec.track(3, 1, 3, None, &lit).unwrap();
        // Same record, and the hits took no string references.
        assert_eq!(rec.stats().num_heap_records, 1);
        assert_eq!(strings.refcount(name), Some(2));
        assert_eq!(strings.refcount(file), Some(2));
        // Differing only in the address, or in a line, or one frame short: other records.
        rec.track(4, 1, 4, None, &[lit[0], Frame::Address(0x1235), lit[2]])
            .unwrap();
        rec.track(
            5,
            1,
            5,
            None,
            &[Frame::sym("inner", "a.rs", 2), lit[1], lit[2]],
        )
        .unwrap();
        rec.track(6, 1, 6, None, &lit[..2]).unwrap();
        assert_eq!(rec.stats().num_heap_records, 4);
        let out = serialize(&rec, &strings);
        assert_eq!(out[1].1, ["inner@a.rs:1", "0x1234", "outer@b.rs:-5"]);
        assert_eq!(out[0].1, out[2].1);
        assert_eq!(out[3].1[1], "0x1235");
        assert_eq!(out[4].1[0], "inner@a.rs:2");
        assert_eq!(out[5].1, ["inner@a.rs:1", "0x1234"]);
        // A stale id is an error, as when it had to be interned.
        let stale = Frame::ids(StringId::from_raw(9999), file, 1);
        assert!(rec.track(7, 1, 7, None, &[stale]).is_err());
        strings.unintern_all(&[name, file]).unwrap();
        for obj in 1..=6 {
            assert!(rec.untrack(obj));
        }
        assert!(strings.is_empty());
    }

    #[test]
    fn address_stacks_are_stored_one_word_per_frame() {
        let (rec, _) = native();
        let frames: Vec<Frame<'_>> = (0..5u64).map(|i| Frame::Address(0x4000 + i)).collect();
        rec.track(1, 1, 1, None, &frames).unwrap();
        rec.track(2, 1, 1, None, &frames[..4]).unwrap();
        rec.track(3, 1, 1, None, &[]).unwrap();
        let r = rec
            .objs
            .iter()
            .find_map(|s| s.lock().get(1, mix64(1)).copied());
        let words = rec.stack_words(r.unwrap().stack()).unwrap();
        assert_eq!(words.len(), 1 + 5);
        rec.prepare_iteration().unwrap();
        let mut seen = Vec::new();
        rec.for_each_live_object_by_stack(&mut |o, st| {
            let mut decoded = Vec::new();
            st.frames(&mut decoded);
            assert_eq!(st.addresses().map(<[u64]>::len), Some(decoded.len()));
            seen.push((o.id, decoded));
            true
        })
        .unwrap();
        rec.finish_iteration().unwrap();
        seen.sort_by_key(|(id, _)| *id);
        assert_eq!(seen[0].1, frames);
        assert_eq!(seen[1].1, frames[..4]);
        assert!(seen[2].1.is_empty());
    }

    #[test]
    fn stack_index_survives_churn() {
        let (rec, strings) = native();
        // Many stacks per shard, released in an order unrelated to insertion, so index growth,
        // shrinking and backward-shift deletion all run; every lookup must keep finding its own.
        let names: Vec<String> = (0..400).map(|i| format!("fn_{i}")).collect();
        let frames = |i: usize| [Frame::sym(&names[i], "f.rs", 1), Frame::Address(i as u64)];
        for round in 0..3u64 {
            for i in 0..400 {
                rec.track(round * 1000 + i as u64, 1, i as u64, None, &frames(i))
                    .unwrap();
            }
            assert_eq!(rec.stats().num_heap_records, 400);
            for i in (0..400).rev().step_by(3) {
                assert!(rec.untrack(round * 1000 + i as u64));
            }
            for i in 0..400 {
                rec.track(round * 1000 + 500 + i as u64, 1, i as u64, None, &frames(i))
                    .unwrap();
            }
            assert_eq!(rec.stats().num_heap_records, 400);
            for (o, f) in serialize(&rec, &strings) {
                assert_eq!(f[0], format!("fn_{}@f.rs:1", o.size));
            }
            for i in 0..400 {
                rec.untrack(round * 1000 + i as u64);
                assert!(rec.untrack(round * 1000 + 500 + i as u64));
            }
            assert_eq!(rec.stats().num_heap_records, 0);
        }
        assert!(strings.is_empty());
    }

    #[test]
    fn after_fork_finishes_a_left_over_iteration() {
        let (rec, _) = native();
        rec.track(1, 1, 1, None, &[]).unwrap();
        rec.prepare_iteration().unwrap();
        rec.after_fork();
        rec.prepare_iteration().unwrap();
        rec.finish_iteration().unwrap();
    }

    #[test]
    fn object_index_matches_a_model() {
        // Deterministic pseudo-random churn against std's HashMap.
        let mut shard = ObjShard::default();
        let mut model: StdHashMap<u64, ObjRecord> = StdHashMap::new();
        let mut x = 0x1234_5678_9abc_def0u64;
        for step in 0..200_000u32 {
            x = mix64(x.wrapping_add(step as u64));
            // Aligned "addresses" from a small range so ids repeat often.
            let id = (x % 4096) * 16;
            let hash = mix64(id);
            if x & (1 << 40) != 0 || model.len() < 50 {
                let rec = ObjRecord {
                    id,
                    size: step as u64,
                    ..ObjRecord::EMPTY
                };
                match (shard.insert(rec, hash), model.get(&id)) {
                    (Ok(()), None) => {
                        model.insert(id, rec);
                    }
                    (Err(existing), Some(m)) => assert_eq!(existing, *m),
                    other => panic!("mismatch {other:?}"),
                }
            } else {
                assert_eq!(shard.remove(id, hash), model.remove(&id));
            }
            if step % 10_000 == 0 {
                for (id, m) in &model {
                    assert_eq!(shard.get(*id, mix64(*id)), Some(m));
                }
                assert_eq!(shard.recs.len(), model.len());
            }
        }
        for id in model.keys().copied().collect::<Vec<_>>() {
            assert!(shard.remove(id, mix64(id)).is_some());
        }
        assert!(shard.recs.is_empty());
        assert!(shard.slots.len() <= 4 * MIN_INDEX_SLOTS);
    }

    #[test]
    fn concurrent_tracking_while_serializing() {
        let rec = Arc::new(HeapRecorder::new(HeapConfig::native(), storage()).unwrap());
        let stop = Arc::new(AtomicBool::new(false));
        let serializer = {
            let rec = Arc::clone(&rec);
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut rounds = 0;
                while !stop.load(Ordering::Relaxed) || rounds < 3 {
                    rec.prepare_iteration().unwrap();
                    rec.for_each_live_object(&mut |o, frames| {
                        assert_eq!(frames.len(), 2);
                        assert_eq!(frames[0], Frame::Address(o.size));
                        true
                    })
                    .unwrap();
                    rec.finish_iteration().unwrap();
                    rounds += 1;
                }
                rounds
            })
        };
        let workers: Vec<_> = (0..4u64)
            .map(|t| {
                let rec = Arc::clone(&rec);
                std::thread::spawn(move || {
                    for i in 0..20_000u64 {
                        let id = (t << 32) | i;
                        let site = i % 50;
                        // The size names the stack so the iteration can check the pairing.
                        let frames = [Frame::Address(site), Frame::Address(t)];
                        rec.track(id, 1, site, None, &frames).unwrap();
                        if i >= 100 {
                            assert!(rec.untrack(id - 100));
                        }
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        assert!(serializer.join().unwrap() >= 3);
        let st = rec.stats();
        assert_eq!(st.num_object_records, 400);
        assert_eq!(st.num_heap_records, 200);
    }
}
