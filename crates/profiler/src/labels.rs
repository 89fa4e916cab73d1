//! Request labels: which span and which caller-chosen labels were active on a thread when a
//! sample was taken.
//!
//! Every sample (CPU, wall, allocation) carries the context of its thread at that moment as
//! labels: `span id` and `local root span id` (numeric, as the Ruby profiler writes them; the
//! recorder's endpoints key on the latter) and up to [`MAX_LABELS`] user labels (strings). A
//! live-heap sample carries the `local root span id` of the request that allocated the object,
//! and that request's `trace endpoint` once [`record_endpoint`] named it, for as long as the
//! object lives. See `docs/services.md` for a service's view of them.
//!
//! ```
//! use ferroprof::labels::{self, WithLabelsExt};
//!
//! labels::with(&[("tenant", "acme")], || {
//!     // ... CPU, wall time and allocations here are labelled tenant=acme ...
//! });
//! let _span = labels::set_span(7, 3); // span 7 of the trace rooted at span 3, until dropped
//! let fut = async { /* ... */ }.with_labels(&[("route", "/users")]);
//! # drop(fut);
//! ```
//!
//! # Bounds
//! * At most [`MAX_LABELS`] user labels at a time on a thread; one more (not replacing a key
//!   already set) is dropped and counted ([`LabelStats::labels_dropped`]).
//! * A key the profiler writes itself ([`RESERVED_KEYS`]: `thread id`, `span id`,
//!   `trace endpoint`, ...) is refused, counted ([`LabelStats::labels_reserved`]): a sample
//!   never carries two labels of one key, or a user's value where a backend expects the
//!   profiler's.
//! * Keys and values are interned for the life of the process: at most [`MAX_STRINGS`] distinct
//!   strings of at most [`MAX_STR_LEN`] bytes (longer ones are cut at a character boundary,
//!   counted). A label whose string does not fit in a full table is dropped, counted: memory
//!   stays below `MAX_STRINGS * MAX_STR_LEN`.
//! * At most [`MAX_THREADS`] threads hold a context at once (a thread's entry is freed when it
//!   exits); a thread beyond that runs unlabelled, counted.
//!
//! # Cost
//! Setting a context publishes six words into the thread's slot (no allocation, no lock).
//! [`with`] and [`WithLabelsExt::with_labels`] also look their strings up in the interner (a
//! short lock); a [`LabelSet`] built once skips that ([`with_set`]). See
//! `docs/architecture.md`, "Label slots", for the protocol readers follow.

use std::collections::HashMap;
use std::future::Future;
use std::marker::PhantomData;
use std::pin::Pin;
use std::sync::atomic::{fence, AtomicBool, AtomicI32, AtomicPtr, AtomicU64, Ordering};
use std::task::{Context, Poll};

use ferroprof_recorder::Label;

use crate::tls::{self, STATE};

/// User labels a thread carries at once.
pub const MAX_LABELS: usize = 4;
/// Distinct label strings (keys and values) kept for the life of the process.
pub const MAX_STRINGS: usize = 8192;
/// Longest label key or value, in bytes.
pub const MAX_STR_LEN: usize = 128;
/// Threads holding a label context at the same time.
pub const MAX_THREADS: usize = SLOT_CHUNK * SLOT_CHUNKS;

/// Numeric label of the active span.
pub const SPAN_ID_LABEL: &str = "span id";
/// Numeric label of the active trace's local root span (see `record_endpoint`).
pub const LOCAL_ROOT_SPAN_ID_LABEL: &str = ferroprof_recorder::profile::LOCAL_ROOT_SPAN_ID_LABEL;
/// String label of the endpoint of the sample's trace (see `record_endpoint`).
pub const TRACE_ENDPOINT_LABEL: &str = ferroprof_recorder::profile::TRACE_ENDPOINT_LABEL;
/// String label marking the samples of a thread parked waiting for work ([`on_thread_park`]):
/// value [`IDLE`].
pub const THREAD_STATE_LABEL: &str = "thread state";
/// The value of [`THREAD_STATE_LABEL`] while a thread is parked.
pub const IDLE: &str = "idle";

/// Label keys the profiler writes itself; user labels with these keys are refused.
pub const RESERVED_KEYS: &[&str] = &[
    "thread id",
    "thread name",
    SPAN_ID_LABEL,
    LOCAL_ROOT_SPAN_ID_LABEL,
    TRACE_ENDPOINT_LABEL,
    THREAD_STATE_LABEL,
    // The heap profile's.
    "gc gen age",
    "allocation class",
    // What the Pyroscope exporter adds for Grafana's span profiles.
    "span_id",
    "span_name",
];

const SLOT_CHUNK: usize = 256;
const SLOT_CHUNKS: usize = 64;
/// Reads of another thread's slot that may be torn by its updates before the sample goes
/// unlabelled.
const READ_TRIES: usize = 4;
/// Words of a context: span, root span, then one `key << 32 | value` word per label.
pub(crate) const WORDS: usize = 2 + MAX_LABELS;

/// A thread's label context as copied into samples. Label words are `key id << 32 | value id`
/// (ids of the interner, 0 = no label).
#[derive(Clone, Copy, PartialEq, Eq, Default, Debug)]
pub(crate) struct Ctx {
    pub(crate) words: [u64; WORDS],
}

impl Ctx {
    pub(crate) const EMPTY: Ctx = Ctx { words: [0; WORDS] };

    pub(crate) fn local_root_span_id(&self) -> u64 {
        self.words[1]
    }

    fn labels(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.words[2..]
            .iter()
            .filter(|&&w| w != 0)
            .map(|&w| ((w >> 32) as u32, w as u32))
    }

    /// Sets `key` to `value`, replacing that key's label; false when all are taken.
    fn set_label(&mut self, key: u32, value: u32) -> bool {
        let word = (key as u64) << 32 | value as u64;
        let labels = &mut self.words[2..];
        if let Some(w) = labels.iter_mut().find(|w| (**w >> 32) as u32 == key) {
            *w = word;
            return true;
        }
        match labels.iter_mut().find(|w| **w == 0) {
            Some(w) => {
                *w = word;
                true
            }
            None => false,
        }
    }

    /// Appends this context's labels to `out` (spans as numbers, user labels as strings).
    pub(crate) fn push_labels<'a>(&self, out: &mut Vec<Label<'a>>) {
        if self.words[0] != 0 {
            out.push(Label::num(SPAN_ID_LABEL, self.words[0] as i64));
        }
        if self.words[1] != 0 {
            out.push(Label::num(LOCAL_ROOT_SPAN_ID_LABEL, self.words[1] as i64));
        }
        for (k, v) in self.labels() {
            if let (Some(k), Some(v)) = (string(k), string(v)) {
                out.push(Label::str(k, v));
            }
        }
    }

    /// The labels of `push_labels` into a fixed array (no allocation); the count written.
    pub(crate) fn fill<'a>(&self, out: &mut [Label<'a>; WORDS]) -> usize {
        let mut n = 0;
        if self.words[0] != 0 {
            out[n] = Label::num(SPAN_ID_LABEL, self.words[0] as i64);
            n += 1;
        }
        if self.words[1] != 0 {
            out[n] = Label::num(LOCAL_ROOT_SPAN_ID_LABEL, self.words[1] as i64);
            n += 1;
        }
        for (k, v) in self.labels() {
            if let (Some(k), Some(v)) = (string(k), string(v)) {
                out[n] = Label::str(k, v);
                n += 1;
            }
        }
        n
    }
}

// ---------------------------------------------------------------------------------------------
// Counters.

static LABELS_DROPPED: AtomicU64 = AtomicU64::new(0);
static LABELS_RESERVED: AtomicU64 = AtomicU64::new(0);
static STRINGS_TRUNCATED: AtomicU64 = AtomicU64::new(0);
static STRINGS_FULL: AtomicU64 = AtomicU64::new(0);
static THREADS_FULL: AtomicU64 = AtomicU64::new(0);
static TORN_READS: AtomicU64 = AtomicU64::new(0);

/// What the bounds of this module cost so far (process-wide, since start).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LabelStats {
    /// Labels not set: [`MAX_LABELS`] were set already, or a string did not fit in the
    /// interner ([`MAX_STRINGS`]).
    pub labels_dropped: u64,
    /// Labels refused because their key is one the profiler writes ([`RESERVED_KEYS`]).
    pub labels_reserved: u64,
    /// Keys or values cut to [`MAX_STR_LEN`] bytes.
    pub strings_truncated: u64,
    /// Distinct strings refused because [`MAX_STRINGS`] were interned already.
    pub strings_refused: u64,
    /// Times a thread could not get a slot ([`MAX_THREADS`] in use) and ran unlabelled.
    pub threads_refused: u64,
    /// Wall samples left unlabelled because the thread kept updating its slot during the read.
    pub torn_reads: u64,
}

/// The counters of this module.
pub fn stats() -> LabelStats {
    LabelStats {
        labels_dropped: LABELS_DROPPED.load(Ordering::Relaxed),
        labels_reserved: LABELS_RESERVED.load(Ordering::Relaxed),
        strings_truncated: STRINGS_TRUNCATED.load(Ordering::Relaxed),
        strings_refused: STRINGS_FULL.load(Ordering::Relaxed),
        threads_refused: THREADS_FULL.load(Ordering::Relaxed),
        torn_reads: TORN_READS.load(Ordering::Relaxed),
    }
}

// ---------------------------------------------------------------------------------------------
// Interner: strings live for the process, readable by id without a lock (from the sampler, the
// allocation path and the export thread).

#[allow(clippy::declare_interior_mutable_const)]
const NO_STR: AtomicPtr<&'static str> = AtomicPtr::new(std::ptr::null_mut());
/// Id `i` (1-based) -> leaked `&'static str`, published before the id is handed out.
static STRINGS: [AtomicPtr<&'static str>; MAX_STRINGS] = [NO_STR; MAX_STRINGS];
static INTERNER: crate::forklock::Mutex<
    Option<HashMap<&'static str, u32, foldhash::fast::RandomState>>,
> = crate::forklock::Mutex::new(None);

fn string(id: u32) -> Option<&'static str> {
    let i = (id as usize).checked_sub(1)?;
    let p = STRINGS.get(i)?.load(Ordering::Acquire);
    // SAFETY: non-null entries point at leaked boxes, never freed nor changed.
    (!p.is_null()).then(|| unsafe { *p })
}

/// The id of `s` (cut to MAX_STR_LEN), 0 when the table is full.
fn intern(s: &str) -> u32 {
    let s = if s.len() > MAX_STR_LEN {
        STRINGS_TRUNCATED.fetch_add(1, Ordering::Relaxed);
        let mut end = MAX_STR_LEN;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        &s[..end]
    } else {
        s
    };
    // The table is the profiler's memory, not the application's.
    tls::with_guard(|| {
        let mut map = INTERNER.lock();
        let map = map.get_or_insert_with(HashMap::default);
        if let Some(&id) = map.get(s) {
            return id;
        }
        let n = map.len();
        if n >= MAX_STRINGS {
            STRINGS_FULL.fetch_add(1, Ordering::Relaxed);
            return 0;
        }
        let leaked: &'static str = Box::leak(s.to_owned().into_boxed_str());
        let cell: &'static mut &'static str = Box::leak(Box::new(leaked));
        STRINGS[n].store(cell, Ordering::Release);
        let id = n as u32 + 1;
        map.insert(leaked, id);
        id
    })
}

// ---------------------------------------------------------------------------------------------
// Slots.

/// One thread's context, double-buffered: the owner writes the copy not in use, then bumps
/// `gen`, whose parity names the copy in use. A reader on the owner's own thread (the signal
/// handler, the allocation path) always finds the copy in use complete; another thread re-reads
/// `gen` after the copy and retries when it moved.
struct Slot {
    /// Owner's kernel thread id; 0 = free.
    tid: AtomicI32,
    gen: AtomicU64,
    copies: [[AtomicU64; WORDS]; 2],
    /// Owner only: both copies hold the same label words, so a change of the span words alone
    /// writes those two words ([`Slot::publish_span`]).
    synced: AtomicBool,
}

struct SlotChunk {
    slots: [Slot; SLOT_CHUNK],
}

#[allow(clippy::declare_interior_mutable_const)]
const NO_CHUNK: AtomicPtr<SlotChunk> = AtomicPtr::new(std::ptr::null_mut());
/// Published chunks are never freed: a reader holding a slot index can always dereference it.
static CHUNKS: [AtomicPtr<SlotChunk>; SLOT_CHUNKS] = [NO_CHUNK; SLOT_CHUNKS];
/// Bumped when a slot changes owner: the sampler's tid -> slot map is rebuilt then.
static OWNERS_GEN: AtomicU64 = AtomicU64::new(0);
/// Slots handed out so far, and freed ones.
static FREE: crate::forklock::Mutex<(u32, Vec<u32>)> = crate::forklock::Mutex::new((0, Vec::new()));

#[inline]
fn slot(idx: u32) -> Option<&'static Slot> {
    let idx = idx as usize;
    let chunk = CHUNKS.get(idx / SLOT_CHUNK)?.load(Ordering::Acquire);
    // SAFETY: published chunks are never freed nor moved.
    (!chunk.is_null()).then(|| unsafe { &(*chunk).slots[idx % SLOT_CHUNK] })
}

impl Slot {
    /// Owner only: makes `ctx` the context in use.
    fn publish(&self, ctx: &Ctx) {
        let next = self.gen.load(Ordering::Relaxed).wrapping_add(1);
        let synced = self.copies[(next & 1) as usize ^ 1][2..]
            .iter()
            .zip(&ctx.words[2..])
            .all(|(w, &v)| w.load(Ordering::Relaxed) == v);
        // Orders the previous `gen` store before these writes: a reader that sees one of them
        // then sees `gen` moved (it reads `gen` again after an acquire fence).
        fence(Ordering::Release);
        for (w, &v) in self.copies[(next & 1) as usize].iter().zip(&ctx.words) {
            w.store(v, Ordering::Relaxed);
        }
        self.gen.store(next, Ordering::Release);
        self.synced.store(synced, Ordering::Relaxed);
    }

    /// Owner only: makes (`span`, `root`) the span words in use, the labels kept; the previous
    /// span words. The layer's enter and exit come here: with the labels in both copies alike,
    /// two words are written, not the whole context.
    #[cfg(feature = "tracing")]
    #[inline]
    fn publish_span(&self, span: u64, root: u64) -> (u64, u64) {
        let g = self.gen.load(Ordering::Relaxed);
        let cur = &self.copies[(g & 1) as usize];
        let prev = (
            cur[0].load(Ordering::Relaxed),
            cur[1].load(Ordering::Relaxed),
        );
        if prev == (span, root) {
            return prev;
        }
        if !self.synced.load(Ordering::Relaxed) {
            let mut ctx = self.own();
            ctx.words[0] = span;
            ctx.words[1] = root;
            self.publish(&ctx);
            return prev;
        }
        let next = g.wrapping_add(1);
        // As in `publish`.
        fence(Ordering::Release);
        let copy = &self.copies[(next & 1) as usize];
        copy[0].store(span, Ordering::Relaxed);
        copy[1].store(root, Ordering::Relaxed);
        self.gen.store(next, Ordering::Release);
        prev
    }

    /// Owner (or its signal handler) only: the context in use.
    fn own(&self) -> Ctx {
        let g = self.gen.load(Ordering::Acquire);
        let mut ctx = Ctx::EMPTY;
        for (v, w) in ctx.words.iter_mut().zip(&self.copies[(g & 1) as usize]) {
            *v = w.load(Ordering::Relaxed);
        }
        ctx
    }

    /// Any thread: the context of thread `tid`, if this slot is its and the read was not torn.
    fn read(&self, tid: i32) -> Option<Ctx> {
        for _ in 0..READ_TRIES {
            let g = self.gen.load(Ordering::Acquire);
            let mut ctx = Ctx::EMPTY;
            for (v, w) in ctx.words.iter_mut().zip(&self.copies[(g & 1) as usize]) {
                *v = w.load(Ordering::Relaxed);
            }
            fence(Ordering::Acquire);
            let owner = self.tid.load(Ordering::Relaxed);
            if owner != tid {
                return None;
            }
            if self.gen.load(Ordering::Relaxed) == g {
                return Some(ctx);
            }
        }
        TORN_READS.fetch_add(1, Ordering::Relaxed);
        None
    }
}

/// Frees the thread's slot when the thread exits.
struct Release;

impl Drop for Release {
    fn drop(&mut self) {
        let idx = STATE.with(|s| s.label_slot.replace(0));
        let Some(s) = idx.checked_sub(1).and_then(slot) else {
            return;
        };
        // Destructors that run later on this thread see no slot (`label_slot` is 0) and
        // readers see no owner.
        s.publish(&Ctx::EMPTY);
        s.tid.store(0, Ordering::Release);
        OWNERS_GEN.fetch_add(1, Ordering::Release);
        tls::with_guard(|| FREE.lock().1.push(idx - 1));
    }
}

thread_local! {
    static RELEASE: Release = const { Release };
}

/// The calling thread's slot, claimed on first use (not async-signal-safe); None when every
/// slot is taken or the thread is exiting.
#[inline]
fn own_slot_or_claim() -> Option<&'static Slot> {
    let idx = STATE.with(|s| s.label_slot.get());
    if idx != 0 {
        return slot(idx - 1);
    }
    claim_slot()
}

/// [`own_slot_or_claim`]'s first use on a thread.
#[cold]
#[inline(never)]
fn claim_slot() -> Option<&'static Slot> {
    // Registers the release first: a thread already tearing down its TLS gets no slot.
    RELEASE.try_with(|_| ()).ok()?;
    let idx = tls::with_guard(|| {
        let mut free = FREE.lock();
        if let Some(i) = free.1.pop() {
            return Some(i);
        }
        let i = free.0 as usize;
        if i >= MAX_THREADS {
            return None;
        }
        if CHUNKS[i / SLOT_CHUNK].load(Ordering::Acquire).is_null() {
            let chunk = Box::new(SlotChunk {
                slots: std::array::from_fn(|_| Slot {
                    tid: AtomicI32::new(0),
                    gen: AtomicU64::new(0),
                    copies: Default::default(),
                    synced: AtomicBool::new(true),
                }),
            });
            CHUNKS[i / SLOT_CHUNK].store(Box::into_raw(chunk), Ordering::Release);
        }
        free.0 += 1;
        Some(i as u32)
    });
    let Some(idx) = idx else {
        THREADS_FULL.fetch_add(1, Ordering::Relaxed);
        return None;
    };
    let s = slot(idx)?;
    // A freed slot holds an empty context already; its owner changes before any publish of
    // ours (the release fence of `publish` orders this store first).
    s.tid
        .store(crate::threads::current_tid(), Ordering::Relaxed);
    s.publish(&Ctx::EMPTY);
    OWNERS_GEN.fetch_add(1, Ordering::Release);
    STATE.with(|st| st.label_slot.set(idx + 1));
    Some(s)
}

/// Fork support (`pthread_atfork` prepare): holds this module's locks across `fork`, so the
/// child never inherits one held by a thread it does not have.
pub(crate) fn before_fork() {
    use lock_api::RawMutex as _;
    // Never held together elsewhere: no order to respect.
    // SAFETY (unlocks in `after_fork`): paired with the force_unlock calls there.
    unsafe {
        INTERNER.raw().lock();
        FREE.raw().lock();
    }
}

/// Fork support (parent and child): releases what `before_fork` held. In the child, the
/// forking thread's slot takes its new tid so the sampler finds it.
pub(crate) fn after_fork(child: bool) {
    // SAFETY: `before_fork` locked both on this thread; nobody else can have them. In the
    // child, the threads waiting for them are gone: the locks are reset, not unlocked.
    unsafe {
        if child {
            crate::forklock::reset_in_child(&FREE);
            crate::forklock::reset_in_child(&INTERNER);
        } else {
            FREE.force_unlock();
            INTERNER.force_unlock();
        }
    }
    if child {
        let idx = STATE.with(|s| s.label_slot.get());
        if let Some(s) = idx.checked_sub(1).and_then(slot) {
            s.tid
                .store(crate::threads::current_tid(), Ordering::Release);
            OWNERS_GEN.fetch_add(1, Ordering::Release);
        }
    }
}

/// The calling thread's context (async-signal-safe: TLS and atomic loads only).
pub(crate) fn own_ctx() -> Ctx {
    let idx = STATE.with(|s| s.label_slot.get());
    match idx.checked_sub(1).and_then(slot) {
        Some(s) => s.own(),
        None => Ctx::EMPTY,
    }
}

/// The sampler's view of other threads' slots.
pub(crate) struct Finder {
    gen: u64,
    by_tid: HashMap<i32, u32, foldhash::fast::RandomState>,
}

impl Finder {
    pub(crate) fn new() -> Finder {
        Finder {
            gen: 0,
            by_tid: HashMap::default(),
        }
    }

    /// Thread `tid`'s context; empty when it has none, or the read kept being torn.
    pub(crate) fn read(&mut self, tid: i32) -> Ctx {
        let gen = OWNERS_GEN.load(Ordering::Acquire);
        if gen == 0 {
            return Ctx::EMPTY; // no thread ever set labels
        }
        if gen != self.gen {
            self.gen = gen;
            self.by_tid.clear();
            let n = FREE.lock().0;
            for i in 0..n {
                if let Some(owner) = slot(i).map(|s| s.tid.load(Ordering::Acquire)) {
                    if owner != 0 {
                        self.by_tid.insert(owner, i);
                    }
                }
            }
        }
        self.by_tid
            .get(&tid)
            .and_then(|&i| slot(i))
            .and_then(|s| s.read(tid))
            .unwrap_or(Ctx::EMPTY)
    }
}

// ---------------------------------------------------------------------------------------------
// Public API.

/// Labels interned once, to be set cheaply many times ([`with_set`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LabelSet {
    ids: [(u32, u32); MAX_LABELS],
    len: u8,
}

impl LabelSet {
    /// Interns `labels` (at most [`MAX_LABELS`]; more, or strings the interner refuses, are
    /// dropped and counted; keys in [`RESERVED_KEYS`] are refused, counted).
    pub fn new(labels: &[(&str, &str)]) -> LabelSet {
        let mut set = LabelSet::default();
        for &(k, v) in labels {
            if RESERVED_KEYS.contains(&k) {
                LABELS_RESERVED.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            let (k, v) = (intern(k), intern(v));
            let slot = set.ids[..set.len as usize]
                .iter()
                .position(|&(key, _)| key == k);
            match slot {
                _ if k == 0 || v == 0 => {
                    LABELS_DROPPED.fetch_add(1, Ordering::Relaxed);
                }
                Some(i) => set.ids[i].1 = v,
                None if (set.len as usize) < MAX_LABELS => {
                    set.ids[set.len as usize] = (k, v);
                    set.len += 1;
                }
                None => {
                    LABELS_DROPPED.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        set
    }

    fn apply(&self, ctx: &mut Ctx) {
        for &(k, v) in &self.ids[..self.len as usize] {
            if !ctx.set_label(k, v) {
                LABELS_DROPPED.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// Restores the thread's previous context when dropped (also on unwinding). Not `Send`: it
/// belongs to the thread whose context it changed.
#[must_use = "the context is restored when the guard is dropped"]
pub struct ContextGuard {
    prev: Option<Ctx>,
    _not_send: PhantomData<*const ()>,
}

impl Drop for ContextGuard {
    fn drop(&mut self) {
        if let Some(prev) = self.prev {
            let idx = STATE.with(|s| s.label_slot.get());
            if let Some(s) = idx.checked_sub(1).and_then(slot) {
                s.publish(&prev);
            }
        }
    }
}

/// Changes the calling thread's context with `f` until the guard drops.
fn enter(f: impl FnOnce(&mut Ctx)) -> ContextGuard {
    let prev = own_slot_or_claim().map(|s| {
        let prev = s.own();
        let mut next = prev;
        f(&mut next);
        if next != prev {
            s.publish(&next);
        }
        prev
    });
    ContextGuard {
        prev,
        _not_send: PhantomData,
    }
}

/// Adds `set`'s labels to the calling thread's context (a key already set takes the new value)
/// until the guard drops.
pub fn enter_set(set: &LabelSet) -> ContextGuard {
    enter(|c| set.apply(c))
}

/// Sets the active span (`span_id`) and its trace's local root span until the guard drops;
/// user labels are kept. 0 means none.
pub fn set_span(span_id: u64, local_root_span_id: u64) -> ContextGuard {
    enter(|c| {
        c.words[0] = span_id;
        c.words[1] = local_root_span_id;
    })
}

/// Sets the calling thread's span words to (`span_id`, `local_root_span_id`), user labels kept,
/// and returns the previous ones; None when the thread has no slot (all taken). For callers that
/// keep their own stack of contexts (the `tracing` layer): no guard, no allocation, no lock once
/// the thread has its slot.
#[cfg(feature = "tracing")]
#[inline]
pub(crate) fn replace_span(span_id: u64, local_root_span_id: u64) -> Option<(u64, u64)> {
    Some(own_slot_or_claim()?.publish_span(span_id, local_root_span_id))
}

/// Names the endpoint of the trace rooted at `local_root_span_id`: in the profile being
/// collected, every sample carrying that `local root span id` (taken before or after this call)
/// also carries `trace endpoint` = `endpoint`, and the endpoint's request count (the Datadog
/// event's `endpoint_counts`) goes up by one; the live objects the trace allocated carry it in
/// every later heap profile. Call it once per request, typically when its root span ends (the
/// `tracing` layer does). Any thread; a no-op when no profiler runs or the id is
/// 0. Not for signal handlers: it takes the recorder's lock and may allocate.
///
/// A request whose samples straddle two exported profiles has the endpoint only in the profile
/// collecting when this is called.
pub fn record_endpoint(local_root_span_id: u64, endpoint: &str) {
    if local_root_span_id == 0 {
        return;
    }
    // The recorder's tables are the profiler's memory, not the application's.
    tls::in_recorder(|| {
        crate::state::with_active(|sh| {
            // Never inside the recorder while a fork is under way (see `fork`).
            crate::forkgate::outside_fork(|| {
                if sh
                    .recorder
                    .record_endpoint(local_root_span_id, endpoint)
                    .is_err()
                {
                    sh.stats.record_errors.fetch_add(1, Ordering::Relaxed);
                }
            });
            // On-demand captures (`/debug/pprof/profile`) running now see it too. Outside the
            // fork gate, as for samples.
            for kind in [crate::state::TapKind::Cpu, crate::state::TapKind::Alloc] {
                sh.for_each_tap(kind, |r| {
                    let _ = r.record_endpoint(local_root_span_id, endpoint);
                });
            }
        })
    });
}

/// Marks the calling thread parked waiting for work until [`on_thread_unpark`]: its samples
/// carry `thread state` = `idle` meanwhile. Made for tokio's runtime hooks, so the wall time
/// of idle workers is told apart from the time they spend polling requests:
///
/// ```no_run
/// let rt = tokio::runtime::Builder::new_multi_thread()
///     .enable_all()
///     .on_thread_park(ferroprof::labels::on_thread_park)
///     .on_thread_unpark(ferroprof::labels::on_thread_unpark)
///     .build()
///     .unwrap();
/// # drop(rt);
/// ```
///
/// A few nanoseconds (the thread's slot, taken on the first call, is published once); the
/// thread's other labels and span are kept. A no-op when the thread has no slot
/// ([`MAX_THREADS`]) or holds [`MAX_LABELS`] user labels already (counted in
/// [`LabelStats::labels_dropped`]).
pub fn on_thread_park() {
    let (key, idle) = idle_ids();
    if key == 0 {
        return;
    }
    let Some(s) = own_slot_or_claim() else {
        return;
    };
    let mut ctx = s.own();
    if !ctx.set_label(key, idle) {
        LABELS_DROPPED.fetch_add(1, Ordering::Relaxed);
        return;
    }
    s.publish(&ctx);
}

/// Ends [`on_thread_park`]'s marking: the thread polls tasks again.
pub fn on_thread_unpark() {
    let (key, _) = idle_ids();
    let idx = STATE.with(|s| s.label_slot.get());
    let Some(s) = idx.checked_sub(1).and_then(slot) else {
        return;
    };
    let mut ctx = s.own();
    let mut changed = false;
    for w in &mut ctx.words[2..] {
        if *w != 0 && (*w >> 32) as u32 == key {
            *w = 0;
            changed = true;
        }
    }
    if changed {
        s.publish(&ctx);
    }
}

/// The interner ids of `thread state` and `idle` (0s when the interner was full).
fn idle_ids() -> (u32, u32) {
    static IDS: AtomicU64 = AtomicU64::new(0);
    let ids = IDS.load(Ordering::Relaxed);
    if ids != 0 {
        return ((ids >> 32) as u32, ids as u32);
    }
    let (k, v) = (intern(THREAD_STATE_LABEL), intern(IDLE));
    if k == 0 || v == 0 {
        return (0, 0);
    }
    IDS.store((k as u64) << 32 | v as u64, Ordering::Relaxed);
    (k, v)
}

/// Runs `f` with `labels` added to the calling thread's context; the previous context comes
/// back when `f` returns or panics.
pub fn with<R>(labels: &[(&str, &str)], f: impl FnOnce() -> R) -> R {
    with_set(&LabelSet::new(labels), f)
}

/// [`with`] for labels interned beforehand.
pub fn with_set<R>(set: &LabelSet, f: impl FnOnce() -> R) -> R {
    let _guard = enter_set(set);
    f()
}

/// A future whose polls run with labels (see [`WithLabelsExt::with_labels`]).
#[derive(Debug)]
#[must_use = "futures do nothing unless polled"]
pub struct WithLabels<F> {
    inner: F,
    set: LabelSet,
    span: Option<(u64, u64)>,
}

impl<F> WithLabels<F> {
    /// Also sets the span while polled.
    pub fn with_span(mut self, span_id: u64, local_root_span_id: u64) -> Self {
        self.span = Some((span_id, local_root_span_id));
        self
    }
}

impl<F: Future> Future for WithLabels<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        // SAFETY: `inner` is structurally pinned: it is never moved out of `self` nor
        // exposed unpinned; `set` and `span` are plain data read by copy.
        let this = unsafe { self.get_unchecked_mut() };
        let (set, span) = (this.set, this.span);
        let _guard = enter(|c| {
            set.apply(c);
            if let Some((s, r)) = span {
                c.words[0] = s;
                c.words[1] = r;
            }
        });
        // SAFETY: see above; `inner` stays where it is.
        unsafe { Pin::new_unchecked(&mut this.inner) }.poll(cx)
    }
}

/// Labels for futures: every poll of the wrapped future runs with them, whichever thread polls
/// it, and the poller's own context comes back after each poll.
pub trait WithLabelsExt: Future + Sized {
    /// Polls `self` with `labels` added to the polling thread's context.
    fn with_labels(self, labels: &[(&str, &str)]) -> WithLabels<Self> {
        self.with_label_set(LabelSet::new(labels))
    }

    /// [`with_labels`](WithLabelsExt::with_labels) for labels interned beforehand.
    fn with_label_set(self, set: LabelSet) -> WithLabels<Self> {
        WithLabels {
            inner: self,
            set,
            span: None,
        }
    }
}

impl<F: Future> WithLabelsExt for F {}

/// Test support, not API: the calling thread's context as labels.
#[doc(hidden)]
pub fn __current() -> Vec<(String, String)> {
    let mut out = Vec::new();
    own_ctx().push_labels(&mut out);
    out.iter()
        .map(|l| {
            let key = match l.key {
                ferroprof_recorder::Str::Lit(k) => k.to_owned(),
                _ => String::new(),
            };
            let value = match l.value {
                ferroprof_recorder::LabelValue::Num(n) => n.to_string(),
                ferroprof_recorder::LabelValue::Str(ferroprof_recorder::Str::Lit(s)) => {
                    s.to_owned()
                }
                _ => String::new(),
            };
            (key, value)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_scopes_merge_and_restore() {
        assert!(__current().is_empty());
        with(&[("a", "1"), ("b", "2")], || {
            with(&[("b", "3")], || {
                let c = __current();
                assert!(c.contains(&("a".into(), "1".into())));
                assert!(c.contains(&("b".into(), "3".into())));
            });
            assert!(__current().contains(&("b".into(), "2".into())));
            let _g = set_span(5, 4);
            assert!(__current().contains(&("span id".into(), "5".into())));
        });
        assert!(__current().is_empty());
    }

    #[test]
    fn parked_threads_are_idle_until_unparked_and_keep_their_labels() {
        let state = |c: &[(String, String)]| {
            c.iter()
                .find(|(k, _)| k == THREAD_STATE_LABEL)
                .map(|(_, v)| v.clone())
        };
        std::thread::spawn(move || {
            // A thread that never had a slot: parking claims one.
            on_thread_park();
            assert_eq!(state(&__current()), Some(IDLE.into()));
            on_thread_unpark();
            assert!(__current().is_empty());
            with(&[("worker", "1")], || {
                on_thread_park();
                let c = __current();
                assert_eq!(state(&c), Some(IDLE.into()));
                assert!(c.contains(&("worker".into(), "1".into())));
                on_thread_unpark();
                assert_eq!(__current(), vec![("worker".into(), "1".into())]);
            });
            // Unparking a thread that is not parked changes nothing.
            on_thread_unpark();
            assert!(__current().is_empty());
        })
        .join()
        .unwrap();
    }

    #[test]
    fn reserved_keys_are_refused_and_counted() {
        let before = stats().labels_reserved;
        with(
            &[("span id", "1"), ("tenant", "a"), ("trace endpoint", "/x")],
            || assert_eq!(__current(), vec![("tenant".into(), "a".into())]),
        );
        assert!(stats().labels_reserved >= before + 2);
        for key in RESERVED_KEYS {
            assert!(LabelSet::new(&[(key, "v")]) == LabelSet::default(), "{key}");
        }
    }

    #[test]
    fn restored_on_panic() {
        let r = std::panic::catch_unwind(|| with(&[("p", "x")], || panic!("boom")));
        assert!(r.is_err());
        assert!(__current().is_empty());
    }

    #[test]
    fn another_thread_reads_a_consistent_context() {
        use std::sync::atomic::AtomicBool;
        use std::sync::Arc;
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::channel();
        let st = stop.clone();
        let h = std::thread::spawn(move || {
            let mut i = 1u64;
            // Its slot exists once it first set a span: only then is it worth reading.
            let first = set_span(i, i);
            tx.send(crate::threads::current_tid()).unwrap();
            while !st.load(Ordering::Relaxed) {
                i += 1;
                // span == root always: a torn read would show them different.
                let _g = set_span(i, i);
            }
            drop(first);
        });
        let tid = rx.recv().unwrap();
        let mut f = Finder::new();
        let mut seen = 0;
        let mut reads = 0u32;
        // Enough reads, some of them while the writer ran (on a loaded machine it may wait for
        // a CPU a long while).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while (reads < 200_000 || seen < 1_000) && std::time::Instant::now() < deadline {
            let c = f.read(tid);
            assert_eq!(c.words[0], c.words[1], "torn read");
            seen += (c.words[0] != 0) as u32;
            reads += 1;
        }
        stop.store(true, Ordering::Relaxed);
        h.join().unwrap();
        assert!(seen > 0);
        // The exited thread's slot is free again: nothing read for it.
        assert_eq!(f.read(tid), Ctx::EMPTY);
    }

    /// The layer's span changes write two words when both copies carry the same labels: after
    /// a label change they must still carry them, in whichever copy a reader finds.
    #[cfg(feature = "tracing")]
    #[test]
    fn span_changes_keep_the_labels_in_both_copies() {
        let span_of = |c: &[(String, String)]| {
            c.iter()
                .find(|(k, _)| k == "span id")
                .map(|(_, v)| v.clone())
        };
        assert_eq!(replace_span(1, 1), Some((0, 0)));
        with(&[("tenant", "a")], || {
            for i in 2..6u64 {
                assert_eq!(replace_span(i, 1).map(|p| p.0), Some(i - 1));
                let c = __current();
                assert!(c.contains(&("tenant".into(), "a".into())), "{i}: {c:?}");
                assert_eq!(span_of(&c), Some(i.to_string()));
            }
        });
        for i in 6..9u64 {
            replace_span(i, 1);
            let c = __current();
            assert!(!c.iter().any(|(k, _)| k == "tenant"), "{i}: {c:?}");
            assert_eq!(span_of(&c), Some(i.to_string()));
        }
        replace_span(0, 0);
        assert!(__current().is_empty());
    }
}
