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

use parking_lot::Mutex;

use crate::error::HeapError;
use crate::spin::SpinLock;
use crate::strings::{StringId, StringStorage};

mod contexts;
mod iteration;
mod liveness;
mod objects;
mod pending;
mod stacks;
mod stats;
mod update;

pub use contexts::MAX_CONTEXTS;
pub use iteration::{LiveObject, SnapshotSizes, SnapshotStack};
pub use liveness::{Liveness, LivenessSource, ObjectInfo};
pub use pending::MAX_PENDING_RECORDINGS;
pub use stats::HeapStats;
pub use update::{EWMA_ALPHA, MIN_TIME_BETWEEN_YOUNG_UPDATES_NS, OLD_AGE};

use contexts::Contexts;
use iteration::IterState;
use objects::{ObjRecord, ObjShard, OBJ_SHARDS};
use pending::Active;
use stacks::{push_string_ids, StackShard, STACK_HINTS, STACK_SHARDS};
use update::UpdateStats;

/// Objects younger than this many generations are left out of iterations (managed default).
pub const DEFAULT_MIN_ITERATION_AGE: u32 = 1;

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

/// splitmix64 finalizer: object ids (often aligned addresses) need their bits spread before they
/// pick a shard and an index slot.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Shard choice uses bits 32.. of a hash; in-shard positions use the low bits, so they stay
/// independent.
fn shard_of(hash: u64, shards: usize) -> usize {
    (hash >> 32) as usize & (shards - 1)
}

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
    /// Per caller frames buffer (address and length) and stack shape (`stacks::shape_of`),
    /// hashed, the symbol stack last found or stored from it: its reference plus one in the low
    /// half (0 = none), the shape in the high half. Only a hint: it is always confirmed by
    /// comparing content under the shard's lock.
    stack_hints: Box<[AtomicU64]>,

    active: Mutex<Active>,
    /// Deferred recordings, each with its request context (see `contexts`; 0: none).
    pending: Mutex<Vec<(ObjRecord, u32)>>,
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

    /// Whether no lock of the heap recorder is held (for a forked child, which must not wait
    /// on one that a vanished thread held: it asks before [`Self::after_fork`]).
    pub fn locks_free(&self) -> bool {
        self.objs.iter().all(|s| !s.0.is_locked())
            && self.stacks.iter().all(|s| !s.0.is_locked())
            && !self.contexts.is_locked()
            && !self.active.is_locked()
            && !self.pending.is_locked()
            && !self.update_stats.is_locked()
            && !self.iter.is_locked()
            && !self.deferred_classes.is_locked()
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
        for (rec, _) in self.pending.get_mut().iter() {
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
    #[cfg(target_arch = "x86_64")]
    use super::stacks::frames_match_avx2;
    use super::stacks::{frames_match_sse, symbol_stack_hash};
    use super::*;
    use crate::profile::{Frame, Str, MAX_FRAMES};
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
    fn track_and_untrack_give_the_same_bytes() {
        let (rec, _strings) = native();
        rec.set_sample_every(2).unwrap();
        // Skipped starts stand for nothing; kept ones for weight x every x size.
        let tracked: Vec<u64> = (1..=4)
            .map(|id| rec.track_in(id, 3, 8, None, &stack("a.rs"), 0).unwrap())
            .collect();
        assert_eq!(tracked, vec![0, 48, 0, 48]);
        assert_eq!(rec.untrack_bytes(1), None);
        assert_eq!(rec.untrack_bytes(2), Some(48));
        assert_eq!(rec.untrack_bytes(2), None, "already untracked");
        assert!(rec.untrack(4));
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

    /// A managed recorder on `src` tracking one object of `heap` (kept alive by the third
    /// value), after a collection, with a young update started on another thread.
    fn young_update_running(
        src: Arc<dyn LivenessSource>,
        heap: &ArcHeap,
    ) -> (Arc<HeapRecorder>, std::thread::JoinHandle<()>, impl Sized) {
        let rec = Arc::new(HeapRecorder::new(HeapConfig::managed(src), storage()).unwrap());
        let (id, obj) = heap.alloc(1);
        rec.start_recording(id, 1, None).unwrap();
        rec.end_recording(&[]).unwrap();
        heap.gc();
        let young = {
            let rec = Arc::clone(&rec);
            std::thread::spawn(move || rec.update_young_objects())
        };
        (rec, young, obj)
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
        let (rec, updater, _obj) = young_update_running(src.clone(), &src.inner);
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
    fn a_full_update_lets_the_runtime_run_the_update_it_waits_for() {
        /// A runtime with one lock its threads take turns under (like Ruby's GVL): a young
        /// update's lookup needs the turn, which the full update holds while it waits.
        struct Turns {
            inner: ArcHeap,
            in_lookup: std::sync::Barrier,
            entered: AtomicBool,
            turn_given: AtomicBool,
        }
        impl LivenessSource for Turns {
            fn gc_generation(&self) -> u64 {
                self.inner.gc_generation()
            }
            fn lookup(&self, id: u64) -> Option<ObjectInfo> {
                if !self.entered.swap(true, Ordering::AcqRel) {
                    self.in_lookup.wait();
                    // Waits for the turn (bounded, so the test fails rather than hangs).
                    let t0 = std::time::Instant::now();
                    while !self.turn_given.load(Ordering::Acquire)
                        && t0.elapsed() < std::time::Duration::from_secs(5)
                    {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                }
                self.inner.lookup(id)
            }
            fn wait_for_other_update(&self) {
                self.turn_given.store(true, Ordering::Release);
                std::thread::yield_now();
            }
        }
        let src = Arc::new(Turns {
            inner: ArcHeap::default(),
            in_lookup: std::sync::Barrier::new(2),
            entered: AtomicBool::new(false),
            turn_given: AtomicBool::new(false),
        });
        let (rec, young, _obj) = young_update_running(src.clone(), &src.inner);
        src.in_lookup.wait();
        rec.prepare_iteration().unwrap();
        rec.finish_iteration().unwrap();
        young.join().unwrap();
        assert!(src.turn_given.load(Ordering::Acquire));
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
        // The index shrinks at the next insert (a remove never allocates).
        let rec = ObjRecord {
            id: 16,
            ..ObjRecord::EMPTY
        };
        shard.insert(rec, mix64(16)).unwrap();
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
