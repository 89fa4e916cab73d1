//! The sampling profiler behind `Ferroprof.start` (`Ferroprof::Native`).
//!
//! Only public C API, the approach of stackprof:
//!
//! * **CPU.** A process CPU-time timer (`timer_create`) raises `SIGPROF` each time the process
//!   used another interval of CPU; the kernel delivers it to a thread that is running. The
//!   handler reads that thread's stack there and then (`rb_profile_frames`, safe at any point
//!   since Ruby 3.0, as stackprof relies on) into one of a few capture slots, with the thread's
//!   id and the intervals the signal stands for, and registers a postponed job
//!   (`rb_postponed_job_register_one`, made to be called from a signal handler). The job, at
//!   the VM's next safe point on whichever thread runs it, names and records every filled slot
//!   as `cpu-time` and `cpu-samples` of the thread that spent the CPU. Reading the stack where
//!   the signal lands books time inside a C function to that function (a job runs only after
//!   it returns) and time of a thread running without the GVL to that thread.
//! * **Allocations.** A `NEWOBJ` internal event hook counts allocations; about every
//!   `alloc_every`-th (a random gap, so no allocation pattern lines up with it) it reads the
//!   stack and queues the object and its frames. The hook allocates no Ruby object: names,
//!   the class and the heap recording are made by a postponed job, which records
//!   `alloc-samples` (weighed by the allocations the sample stands for) and starts the live-heap
//!   recording of the object ([`ferroprof_recorder::StackRecorder::track_object`]).
//! * **GC.** A `GC_EXIT` hook registers a job that runs the heap recorder's after-GC step (young
//!   objects' liveness), out of the GC. Any GC event hook slows every allocation (Ruby 3.1 then
//!   allocates through its locked slow path), so it is enabled with the `NEWOBJ` hook only
//!   during watched intervals; the CPU job runs the step after collections it did not see.
//!
//! Objects and frames waiting in the queue are marked (so neither is freed nor moved) by the
//! mark function of `Ferroprof::Native::ROOTS`, as are the frames whose names are cached.
//! Everything but the signal handler runs with the GVL held.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use ferroprof_recorder::{Frame, Label, SampleValues, StackRecorder};
use magnus::rb_sys::{AsRawValue, FromRawValue};
use magnus::typed_data::DataTypeFunctions;
use magnus::value::ReprValue;
use magnus::{function, gc, prelude::*, Error, RHash, RModule, RString, Ruby, Value};
use rb_sys::VALUE;

use crate::capture;
use crate::cpu_engine;
use crate::recorder::RbRecorder;
use crate::{arg_error, guard, lock};

/// Frames kept per queued allocation sample.
const ALLOC_FRAMES: usize = 128;
/// Allocation samples waiting for the job; more are dropped (counted).
const MAX_PENDING: usize = 64;
/// Cached frame names; the cache starts over beyond this.
const MAX_CACHED_FRAMES: usize = 20_000;

/// Set while the profiler runs: the handler, hooks and jobs do nothing otherwise.
static RUNNING: AtomicBool = AtomicBool::new(false);
/// The timer's interval.
static INTERVAL_NS: AtomicU64 = AtomicU64::new(10_000_000);
/// CPU samples are timestamped (`timeline: true`): each is kept as an event of its own.
static TIMELINE: AtomicBool = AtomicBool::new(false);
/// Inside one of our jobs: the allocations they make are not sampled.
static IN_JOB: AtomicBool = AtomicBool::new(false);
/// The profiler's own Ruby threads (writer, wall sampler): their samples are the profiler's
/// cost, not the program's, and are not kept.
static OWN_THREADS: [AtomicUsize; 2] = [AtomicUsize::new(0), AtomicUsize::new(0)];

/// Counters reported by `Ferroprof::Native._native_stats`.
struct Counters {
    signals: AtomicU64,
    signals_outside_ruby: AtomicU64,
    /// Signals on the profiler's own threads (not counted as intervals).
    signals_own: AtomicU64,
    /// CPU intervals the handler counted on the program's threads: all of them are recorded
    /// but those still unattributed when the profiler stops (`cpu_intervals_at_stop`).
    cpu_intervals: AtomicU64,
    cpu_intervals_at_stop: AtomicU64,
    cpu_samples: AtomicU64,
    alloc_events: AtomicU64,
    alloc_samples: AtomicU64,
    alloc_dropped: AtomicU64,
    alloc_windows: AtomicU64,
    gc_steps: AtomicU64,
    record_errors: AtomicU64,
}

static COUNTERS: Counters = Counters {
    signals: AtomicU64::new(0),
    signals_outside_ruby: AtomicU64::new(0),
    signals_own: AtomicU64::new(0),
    cpu_intervals: AtomicU64::new(0),
    cpu_intervals_at_stop: AtomicU64::new(0),
    cpu_samples: AtomicU64::new(0),
    alloc_events: AtomicU64::new(0),
    alloc_samples: AtomicU64::new(0),
    alloc_dropped: AtomicU64::new(0),
    alloc_windows: AtomicU64::new(0),
    gc_steps: AtomicU64::new(0),
    record_errors: AtomicU64::new(0),
};

impl Counters {
    fn all(&self) -> [(&'static str, &AtomicU64); 12] {
        [
            ("signals", &self.signals),
            ("signals_outside_ruby", &self.signals_outside_ruby),
            ("signals_own", &self.signals_own),
            ("cpu_intervals", &self.cpu_intervals),
            ("cpu_intervals_at_stop", &self.cpu_intervals_at_stop),
            ("cpu_samples", &self.cpu_samples),
            ("alloc_events", &self.alloc_events),
            ("alloc_samples", &self.alloc_samples),
            ("alloc_dropped", &self.alloc_dropped),
            ("alloc_windows", &self.alloc_windows),
            ("gc_steps", &self.gc_steps),
            ("record_errors", &self.record_errors),
        ]
    }

    /// Counts start over at each start (`Ferroprof.stats` reads one run).
    fn reset(&self) {
        for (_, c) in self.all() {
            c.store(0, Ordering::Relaxed);
        }
    }
}

/// The allocation sampler's state. The hook runs with the GVL held, one at a time; atomics only
/// make the statics `Sync`.
struct AllocSampling {
    /// Mean watched allocations per sample; 0: allocation sampling off.
    every: AtomicU64,
    /// Allocations until the next sample.
    countdown: AtomicU64,
    /// Watched allocations since the last sample (the next one stands for these, scaled by
    /// [`watched_scale`]).
    seen: AtomicU64,
    /// xorshift state for the gaps.
    rng: AtomicU64,
}

/// The share of CPU intervals whose allocations are watched, in millionths (1_000_000: all).
/// An enabled `NEWOBJ` hook slows every allocation of Ruby 3.1 by more than half (the VM takes
/// its slow allocation path and dispatches the hook), so the hook is on only during randomly
/// chosen CPU intervals: each allocation is watched with the same probability whatever its
/// site, and samples are weighed by its inverse.
static DUTY_PPM: AtomicU64 = AtomicU64::new(1_000_000);
/// All allocations the hook saw (hidden and our own included), and the VM's allocation counter
/// at start: with a duty under 1, samples are scaled by the VM's count over these, which keeps
/// totals right although watched intervals allocate slower (the hook's cost) than others.
static WATCHED_ALL: AtomicU64 = AtomicU64::new(0);
static VM_ALLOCATED_AT_START: AtomicU64 = AtomicU64::new(0);

/// The VM's count of objects allocated since it started (`GC.stat(:total_allocated_objects)`).
fn vm_allocated() -> u64 {
    // SAFETY: rb_intern/rb_id2sym/rb_gc_stat read VM tables under the GVL; a Symbol key makes
    // rb_gc_stat return that one value.
    unsafe {
        let key = rb_sys::rb_id2sym(rb_sys::rb_intern(c"total_allocated_objects".as_ptr()));
        rb_sys::rb_gc_stat(key) as u64
    }
}

/// Whether the `NEWOBJ` hook is enabled now.
static HOOK_ON: AtomicBool = AtomicBool::new(false);

static ALLOC: AllocSampling = AllocSampling {
    every: AtomicU64::new(0),
    countdown: AtomicU64::new(1),
    seen: AtomicU64::new(0),
    rng: AtomicU64::new(0x9e37_79b9_7f4a_7c15),
};

/// One allocation sample waiting for the job: plain data, marked while queued.
#[derive(Clone, Copy)]
struct AllocSample {
    obj: VALUE,
    /// The allocating thread, its request context, and the object's class then.
    thread: ThreadOf,
    span: u64,
    labels: u64,
    class: VALUE,
    weight: u64,
    len: usize,
    frames: [VALUE; ALLOC_FRAMES],
    lines: [i32; ALLOC_FRAMES],
}

/// The queue of allocation samples. Nothing allocates a Ruby object while holding it, so the
/// GC (whose mark function takes it) never waits for it.
static PENDING: Mutex<Vec<AllocSample>> = Mutex::new(Vec::new());

/// A frame's names, as recorded.
#[derive(Clone)]
struct FrameNames {
    name: Arc<str>,
    path: Arc<str>,
}

/// Names by frame (`rb_profile_frames`' iseq or method entry). Its frames are marked, so a
/// cached one is never freed and its address never reused for another.
static NAMES: Mutex<Option<HashMap<VALUE, FrameNames>>> = Mutex::new(None);

/// The recorder samples go to, and the hooks' tracepoints (0: none).
struct Active {
    recorder: Arc<StackRecorder>,
    newobj_tp: VALUE,
    gc_tp: VALUE,
}

static ACTIVE: Mutex<Option<Active>> = Mutex::new(None);

fn recorder() -> Option<Arc<StackRecorder>> {
    lock(&ACTIVE).as_ref().map(|a| a.recorder.clone())
}

/// Marks what the queue and the name cache hold.
#[derive(magnus::TypedData)]
#[magnus(class = "Ferroprof::Native::Roots", free_immediately, mark)]
struct Roots;

impl DataTypeFunctions for Roots {
    fn mark(&self, _marker: &gc::Marker) {
        // SAFETY (all rb_gc_mark calls below): called by the GC's mark phase with VALUEs of live
        // objects: queued ones were handed to the NEWOBJ hook or read from a live stack and have
        // been marked by every GC since; cached frames likewise. rb_gc_mark also pins them.
        for s in lock(&PENDING).iter() {
            unsafe { rb_sys::rb_gc_mark(s.obj) };
            unsafe { rb_sys::rb_gc_mark(s.thread.thread) };
            unsafe { rb_sys::rb_gc_mark(s.class) };
            for &f in &s.frames[..s.len] {
                unsafe { rb_sys::rb_gc_mark(f) };
            }
        }
        // SAFETY: as above: full capture slots hold frames read from live stacks.
        capture::each_held(|v| unsafe { rb_sys::rb_gc_mark(v) });
        if let Some(names) = lock(&NAMES).as_ref() {
            for &f in names.keys() {
                unsafe { rb_sys::rb_gc_mark(f) };
            }
        }
        if let Some(a) = lock(&ACTIVE).as_ref() {
            for tp in [a.newobj_tp, a.gc_tp] {
                if tp != 0 {
                    unsafe { rb_sys::rb_gc_mark(tp) };
                }
            }
        }
    }
}

// --- the signal handler ---------------------------------------------------------------------

/// `SIGPROF`: reads the running thread's stack into a capture slot and asks the VM for a CPU
/// job. Async-signal-safe: atomics, `ruby_native_thread_p` and `rb_thread_current`
/// (thread-local reads), `timer_getoverrun`, [`capture::capture_in_handler`] and
/// `rb_postponed_job_register_one`, which Ruby documents as callable from a signal handler.
extern "C" fn on_sigprof(_sig: libc::c_int, _info: *mut libc::siginfo_t, _ctx: *mut c_void) {
    // SAFETY: __errno_location returns this thread's errno; restored before returning so the
    // interrupted code sees its own.
    let errno = unsafe { *libc::__errno_location() };
    if RUNNING.load(Ordering::Relaxed) {
        COUNTERS.signals.fetch_add(1, Ordering::Relaxed);
        // SAFETY: all async-signal-safe (see above). A thread Ruby does not know has no
        // execution context, which reading frames or registering a job would dereference.
        unsafe {
            if rb_sys::ruby_native_thread_p() == 0 {
                COUNTERS
                    .signals_outside_ruby
                    .fetch_add(1, Ordering::Relaxed);
            } else if is_own_thread(rb_sys::rb_thread_current()) {
                COUNTERS.signals_own.fetch_add(1, Ordering::Relaxed);
            } else {
                // The intervals this signal stands for (the kernel checks CPU timers at its
                // tick, so at high rates one signal often stands for several).
                let over = cpu_engine::timer_overrun();
                COUNTERS
                    .cpu_intervals
                    .fetch_add(1 + over, Ordering::Relaxed);
                capture::capture_in_handler(
                    1 + over,
                    INTERVAL_NS.load(Ordering::Relaxed),
                    gc_in_progress(),
                );
                rb_sys::rb_postponed_job_register_one(0, Some(cpu_job), std::ptr::null_mut());
            }
        }
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

extern "C" {
    /// Ruby's (`ruby/thread.h`): whether the calling thread holds the GVL; reads the thread's
    /// own state.
    fn ruby_thread_has_gvl_p() -> libc::c_int;
}

/// The keys `major_by` and `gc_by` of `GC.latest_gc_info` (Symbols; 0: not made yet).
static GC_KEYS: [AtomicUsize; 2] = [AtomicUsize::new(0), AtomicUsize::new(0)];

/// Under the GVL, before the handler may need them: the GC info keys, and one call that makes
/// the VM build its own table of GC info symbols (it interns them on the first call, which
/// must not happen inside the handler).
fn prepare_gc_info() {
    for (slot, name) in GC_KEYS.iter().zip([c"major_by", c"gc_by"]) {
        // SAFETY: rb_intern and rb_id2sym under the GVL; the Symbols are static (never freed).
        let key = unsafe { rb_sys::rb_id2sym(rb_sys::rb_intern(name.as_ptr())) };
        // SAFETY: with a Symbol key, rb_gc_latest_gc_info returns one value.
        unsafe { rb_sys::rb_gc_latest_gc_info(key) };
        slot.store(key as usize, Ordering::Relaxed);
    }
}

/// In the handler: when this thread is the one running the garbage collector, the current
/// collection's `major_by` and `gc_by`. Async-signal-safe as stackprof relies on: flag reads,
/// and `rb_gc_latest_gc_info` with a Symbol key (reads the collector's state; its symbols
/// were made by [`prepare_gc_info`]).
fn gc_in_progress() -> Option<(VALUE, VALUE)> {
    // SAFETY: both read flags (the VM's GC state, this thread's own GVL state). Another
    // thread may be collecting while this one runs without the GVL: its time is its own.
    let collecting = unsafe { rb_sys::rb_during_gc() != 0 && ruby_thread_has_gvl_p() != 0 };
    if !collecting {
        return None;
    }
    let [major, by] = [&GC_KEYS[0], &GC_KEYS[1]].map(|k| k.load(Ordering::Relaxed) as VALUE);
    if major == 0 || by == 0 {
        return Some((rb_sys::Qnil as VALUE, rb_sys::Qnil as VALUE));
    }
    // SAFETY: Symbol keys, prepared; see above.
    unsafe {
        Some((
            rb_sys::rb_gc_latest_gc_info(major),
            rb_sys::rb_gc_latest_gc_info(by),
        ))
    }
}

fn install_handler() -> std::io::Result<()> {
    // SAFETY: a zeroed sigaction is valid; the handler is an extern "C" fn of the SA_SIGINFO
    // signature; sigemptyset initializes the mask in place.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigprof as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
        libc::sigemptyset(&mut sa.sa_mask);
        if libc::sigaction(libc::SIGPROF, &sa, std::ptr::null_mut()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

// --- stacks ---------------------------------------------------------------------------------

/// `v` as a Rust string, when it is a Ruby String.
fn string_of(v: VALUE) -> Option<String> {
    // SAFETY: v is a VALUE returned by the VM (a String or nil), alive on this call's stack.
    let v = unsafe { Value::from_raw(v) };
    RString::from_value(v).and_then(|s| s.to_string().ok())
}

/// The names of `frame` (an entry of `rb_profile_frames`), from the cache or the VM.
fn names_of(frame: VALUE) -> FrameNames {
    if let Some(n) = lock(&NAMES).as_ref().and_then(|m| m.get(&frame)) {
        return n.clone();
    }
    // Computed without holding the cache: these allocate Ruby strings, and a GC they start
    // takes the cache's lock to mark it.
    // SAFETY: frame came from rb_profile_frames on a live stack and is kept alive by the
    // caller (on its stack, scanned by the GC, or marked in the queue).
    let (label, abs, path) = unsafe {
        (
            rb_sys::rb_profile_frame_full_label(frame),
            rb_sys::rb_profile_frame_absolute_path(frame),
            rb_sys::rb_profile_frame_path(frame),
        )
    };
    let names = FrameNames {
        name: string_of(label)
            .unwrap_or_else(|| "(unknown)".to_owned())
            .into(),
        path: string_of(abs)
            .or_else(|| string_of(path))
            .unwrap_or_default()
            .into(),
    };
    let mut cache = lock(&NAMES);
    let map = cache.get_or_insert_with(HashMap::new);
    if map.len() >= MAX_CACHED_FRAMES {
        map.clear();
    }
    map.insert(frame, names.clone());
    names
}

/// The thread a sample belongs to: its native id and its `Thread` object.
#[derive(Clone, Copy)]
struct ThreadOf {
    tid: i64,
    thread: VALUE,
}

impl ThreadOf {
    /// The running thread (under the GVL, or in the handler).
    fn current() -> Self {
        // SAFETY: gettid has no preconditions; rb_thread_current reads the running thread.
        unsafe {
            ThreadOf {
                tid: libc::gettid() as i64,
                thread: rb_sys::rb_thread_current(),
            }
        }
    }
}

/// Where a CPU interval with no Ruby frame on its thread (a thread starting or ending) goes.
const NO_RUBY_FRAMES: &str = "[no Ruby frames]";
/// The leaf of a sample taken while its thread ran the garbage collector.
const GC_FRAME: &str = "Garbage Collection";

/// A collection's labels: `gc type` (major or minor) and `gc cause` (`GC.latest_gc_info`'s
/// `gc_by`: newobj, malloc, method, capi, stress).
struct GcLabels {
    kind: &'static str,
    cause: Option<String>,
}

impl GcLabels {
    fn of(major_by: VALUE, gc_by: VALUE) -> Self {
        GcLabels {
            kind: if major_by == rb_sys::Qnil as VALUE {
                "minor"
            } else {
                "major"
            },
            cause: symbol_name(gc_by),
        }
    }
}

/// The name of Symbol `v` (`None` for anything else).
fn symbol_name(v: VALUE) -> Option<String> {
    // SAFETY: v came from the VM (a static Symbol or nil); from_raw only wraps it.
    let v = unsafe { Value::from_raw(v) };
    magnus::Symbol::from_value(v).and_then(|s| s.name().ok().map(|n| n.into_owned()))
}

/// What a sample says besides its stack and thread.
struct Extra<'a> {
    /// An allocation's class.
    class: Option<&'a str>,
    /// Taken inside the garbage collector: a `Garbage Collection` leaf and its labels.
    gc: Option<GcLabels>,
    /// The request's local root span id and the user label set's id (0: none).
    span: u64,
    labels: u64,
    /// The sample's timestamp (nanoseconds since the epoch; 0: aggregated, no timestamp).
    at_ns: i64,
}

/// Records one sample of the frames `frames`/`lines` (innermost first) with `values`, labelled
/// with `thread` and what `extra` says.
fn record(
    rec: &StackRecorder,
    frames: &[VALUE],
    lines: &[i32],
    values: &SampleValues,
    thread: ThreadOf,
    extra: &Extra<'_>,
) {
    let names: Vec<FrameNames> = frames.iter().map(|&f| names_of(f)).collect();
    let mut refs: Vec<Frame<'_>> = Vec::with_capacity(names.len() + 1);
    if extra.gc.is_some() {
        refs.push(Frame::sym(GC_FRAME, "", 0));
    }
    refs.extend(
        names
            .iter()
            .zip(lines)
            .map(|(n, &l)| Frame::sym(&n.name, &n.path, l as i64)),
    );
    if refs.is_empty() {
        refs.push(Frame::sym(NO_RUBY_FRAMES, "", 0));
    }
    let thread_name = thread_name(thread.thread);
    let mut labels = vec![Label::num("thread id", thread.tid)];
    if let Some(n) = &thread_name {
        labels.push(Label::str("thread name", n));
    }
    if let Some(c) = extra.class {
        labels.push(Label::str("allocation class", c));
    }
    if let Some(gc) = &extra.gc {
        labels.push(Label::str("gc type", gc.kind));
        if let Some(cause) = &gc.cause {
            labels.push(Label::str("gc cause", cause));
        }
    }
    if extra.span != 0 {
        // The recorder names the request's endpoint by this label (`trace endpoint`).
        labels.push(Label::num("local root span id", extra.span as i64));
    }
    let user = label_set(extra.labels);
    labels.extend(user.iter().map(|(k, v)| Label::str(k, v)));
    if rec
        .record_sample(&refs, values, &labels, extra.at_ns)
        .is_err()
    {
        COUNTERS.record_errors.fetch_add(1, Ordering::Relaxed);
    }
}

/// User label sets by id (`Ferroprof.with_labels`), registered once each from Ruby.
static LABEL_SETS: Mutex<Option<HashMap<u64, LabelSet>>> = Mutex::new(None);
/// A label set: (key, value) pairs.
type LabelSet = Arc<[(String, String)]>;
/// Label sets kept at most; `with_labels` is refused past it (the ids live in samples).
const MAX_LABEL_SETS: usize = 100_000;

fn label_set(id: u64) -> LabelSet {
    if id == 0 {
        return Arc::new([]);
    }
    lock(&LABEL_SETS)
        .as_ref()
        .and_then(|m| m.get(&id).cloned())
        .unwrap_or_else(|| Arc::new([]))
}

/// `_native_register_labels(id, [[key, value], ...])`: false when the registry is full.
fn register_labels(ruby: &Ruby, id: u64, pairs: Vec<(String, String)>) -> Result<bool, Error> {
    guard(ruby, || {
        let mut sets = lock(&LABEL_SETS);
        let map = sets.get_or_insert_with(HashMap::new);
        if map.len() >= MAX_LABEL_SETS && !map.contains_key(&id) {
            return Ok(false);
        }
        map.insert(id, pairs.into());
        Ok(true)
    })
}

/// `_native_set_context(span_id, labels_id)`: the calling thread's request context.
fn set_context(ruby: &Ruby, span: u64, labels: u64) -> Result<bool, Error> {
    guard(ruby, || {
        Ok(crate::context::set(
            crate::context::current_tid(),
            span,
            labels,
        ))
    })
}

/// `_native_record_endpoint(span_id, endpoint)`: names the request's endpoint (its samples,
/// earlier ones included, get `trace endpoint`). False when not running.
fn record_endpoint(ruby: &Ruby, span: u64, endpoint: String) -> Result<bool, Error> {
    guard(ruby, || {
        let Some(rec) = recorder() else {
            return Ok(false);
        };
        if rec.record_endpoint(span, &endpoint).is_err() {
            COUNTERS.record_errors.fetch_add(1, Ordering::Relaxed);
        }
        Ok(true)
    })
}

/// `Thread#name` of `thread` (`main` for the unnamed main thread).
fn thread_name(thread: VALUE) -> Option<String> {
    if thread == 0 {
        return None;
    }
    // SAFETY: reads the VM's main thread under the GVL, allocating nothing.
    let main = unsafe { rb_sys::rb_thread_main() };
    // SAFETY: a live Thread object (marked in its slot or queue until now, on the caller's
    // stack since).
    let t = unsafe { Value::from_raw(thread) };
    let name: Option<String> = t.funcall("name", ()).ok()?;
    name.or_else(|| (thread == main).then(|| "main".to_owned()))
}

fn on_own_thread() -> bool {
    // SAFETY: rb_thread_current reads the running thread's object; allocates nothing.
    is_own_thread(unsafe { rb_sys::rb_thread_current() })
}

/// Whether `thread` is one of the profiler's own (atomics only: called in the handler too).
fn is_own_thread(thread: VALUE) -> bool {
    OWN_THREADS
        .iter()
        .any(|t| t.load(Ordering::Relaxed) == thread as usize)
}

/// Runs `f` as one of our jobs: allocations it makes are not sampled; a panic is contained
/// (a job has no Ruby caller to raise to).
fn as_job(f: impl FnOnce()) {
    if IN_JOB.swap(true, Ordering::Relaxed) {
        return;
    }
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
        COUNTERS.record_errors.fetch_add(1, Ordering::Relaxed);
    }
    IN_JOB.store(false, Ordering::Relaxed);
}

// --- jobs -----------------------------------------------------------------------------------

/// The CPU job: records every captured sample, each as the thread that spent the CPU.
extern "C" fn cpu_job(_data: *mut c_void) {
    if !RUNNING.load(Ordering::Relaxed) {
        return;
    }
    // Another job mid-flight (it may have handed the GVL over): the slots stay full for the
    // next job.
    as_job(|| {
        let Some(rec) = recorder() else { return };
        record_captured(&rec);
        choose_alloc_window();
        // Collections that ended while the GC hook was off: the young update from here.
        // SAFETY: rb_gc_count reads a counter under the GVL.
        let gcs = unsafe { rb_sys::rb_gc_count() } as u64;
        if LAST_GC.swap(gcs, Ordering::Relaxed) != gcs && !HOOK_ON.load(Ordering::Relaxed) {
            rec.after_gc_step();
            COUNTERS.gc_steps.fetch_add(1, Ordering::Relaxed);
        }
    });
}

/// Records the full capture slots; the intervals held over go to the first of them.
fn record_captured(rec: &StackRecorder) {
    // On this thread's machine stack, which the GC scans: the frames and the thread stay alive
    // once out of the slot.
    let mut c = capture::Captured::empty();
    let (mut held, mut held_ns) = capture::take_held_over();
    let interval = INTERVAL_NS.load(Ordering::Relaxed);
    while let Some(n) = capture::take(&mut c) {
        let n = n + std::mem::take(&mut held);
        let cpu_ns = c.cpu_ns + std::mem::take(&mut held_ns);
        let cpu_time_ns = thread_weight(c.tid, n, interval, cpu_ns) as i64;
        let timeline = TIMELINE.load(Ordering::Relaxed);
        let values = SampleValues {
            cpu_time_ns,
            cpu_or_wall_samples: n as i64,
            // On the timeline, a CPU sample spans the CPU it stands for.
            timeline_wall_time_ns: if timeline { cpu_time_ns } else { 0 },
            ..SampleValues::default()
        };
        let thread = ThreadOf {
            tid: c.tid,
            thread: c.thread,
        };
        let extra = Extra {
            class: None,
            gc: c.gc.map(|(major_by, gc_by)| GcLabels::of(major_by, gc_by)),
            span: c.span,
            labels: c.labels,
            at_ns: if timeline { c.at_ns } else { 0 },
        };
        record(
            rec,
            &c.frames[..c.len],
            &c.lines[..c.len],
            &values,
            thread,
            &extra,
        );
        COUNTERS.cpu_samples.fetch_add(1, Ordering::Relaxed);
        std::hint::black_box(&c);
    }
    if held > 0 || held_ns > 0 {
        // None recorded this time: kept for the next sample.
        capture::hold_over(held, held_ns);
    }
}

/// Per thread: the CPU its clock counted in its samples and the CPU booked to them since start
/// (nanoseconds).
static THREAD_CPU: Mutex<Option<HashMap<i64, (u64, u64)>>> = Mutex::new(None);
/// Threads remembered at most; past it the table starts over.
const MAX_THREADS_WEIGHED: usize = 10_000;
/// Share of a thread's outstanding difference (clock minus booked) added to its next sample.
const CATCH_UP: f64 = 0.5;

/// A CPU sample's weight: its intervals, plus half of what its thread's clock counted and its
/// earlier samples did not book. The intervals alone are where time went within a thread (each
/// is booked to what ran when it ended), but the kernel gives each signal to whichever running
/// thread's tick saw the expiry, so across threads they book one thread's CPU to another. The
/// thread's clock since its previous sample alone sets each total right but books a thread's
/// earlier short requests to the long one it is in (length bias). The difference carried
/// forward is known before this sample, so it does not depend on what runs now, and the
/// thread's total stays within about a sample of its clock.
fn thread_weight(tid: i64, intervals: u64, interval_ns: u64, cpu_ns: u64) -> u64 {
    let by_intervals = intervals.saturating_mul(interval_ns) as f64;
    let mut table = lock(&THREAD_CPU);
    let map = table.get_or_insert_with(HashMap::new);
    if map.len() >= MAX_THREADS_WEIGHED && !map.contains_key(&tid) {
        map.clear();
    }
    let (clock, booked) = map.entry(tid).or_insert((0, 0));
    let owed = *clock as f64 - *booked as f64;
    let w = (by_intervals + CATCH_UP * owed).max(0.0).round() as u64;
    *clock = clock.saturating_add(cpu_ns);
    *booked = booked.saturating_add(w);
    w
}

/// The GC count the CPU job saw last.
static LAST_GC: AtomicU64 = AtomicU64::new(0);

/// At each CPU job: whether the allocations of the next CPU interval are watched (a coin of
/// probability `DUTY_PPM`, independent of the program).
fn choose_alloc_window() {
    let duty = DUTY_PPM.load(Ordering::Relaxed);
    if duty >= 1_000_000 {
        return;
    }
    let on = random() % 1_000_000 < duty;
    if on == HOOK_ON.load(Ordering::Relaxed) {
        return;
    }
    // The GC hook goes with it: any GC event hook sends every allocation of Ruby 3.1 down its
    // slow path (the VM lock), so it is on only while allocations are watched anyway.
    let tps = lock(&ACTIVE)
        .as_ref()
        .map_or([0, 0], |a| [a.newobj_tp, a.gc_tp]);
    for tp in tps.into_iter().filter(|&tp| tp != 0) {
        // SAFETY: a tracepoint created by start and kept alive by Roots; toggled with the GVL
        // held. Both events are internal: no instruction sequence is rewritten.
        unsafe {
            if on {
                rb_sys::rb_tracepoint_enable(tp);
            } else {
                rb_sys::rb_tracepoint_disable(tp);
            }
        }
    }
    HOOK_ON.store(on, Ordering::Relaxed);
    if !on {
        update_scale();
    }
    COUNTERS
        .alloc_windows
        .fetch_add(on as u64, Ordering::Relaxed);
}

/// The allocation job: names, class and heap recording of the queued samples.
extern "C" fn alloc_job(_data: *mut c_void) {
    as_job(|| {
        let rec = recorder();
        let scale = watched_scale();
        while let Some(mut s) = next_pending() {
            let Some(rec) = &rec else { continue };
            s.weight = ((s.weight as f64 * scale).round() as u64).max(1);
            // SAFETY: s.obj is alive: marked in the queue until now, on this stack since.
            let obj = unsafe { Value::from_raw(s.obj) };
            let weight = u32::try_from(s.weight).unwrap_or(u32::MAX);
            // The VM may have hidden it since (e.g. a buffer it keeps for itself): still an
            // allocation, named by its class when allocated, but not tracked.
            // SAFETY: alive, as above.
            let visible = unsafe { visible(s.obj) };
            let class = class_name(s.class);
            let tracked = visible.then(|| {
                rec.track_object_in(
                    crate::heap::handle_of(obj),
                    weight,
                    class.as_deref(),
                    s.span,
                )
            });
            let values = SampleValues {
                alloc_samples: s.weight as i64,
                alloc_samples_unscaled: 1,
                // Ends the recording track_object started (or skipped): always, once started.
                heap_sample: matches!(tracked, Some(Ok(_))),
                ..SampleValues::default()
            };
            if matches!(tracked, Some(Err(_))) {
                COUNTERS.record_errors.fetch_add(1, Ordering::Relaxed);
            }
            record(
                rec,
                &s.frames[..s.len],
                &s.lines[..s.len],
                &values,
                s.thread,
                &Extra {
                    class: class.as_deref(),
                    gc: None,
                    span: s.span,
                    labels: s.labels,
                    at_ns: 0,
                },
            );
            COUNTERS.alloc_samples.fetch_add(1, Ordering::Relaxed);
            std::hint::black_box(&s);
        }
        if let Some(rec) = rec {
            if rec.finalize_pending_heap_recordings().is_err() {
                COUNTERS.record_errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
}

/// What one watched allocation stands for: 1 when every interval is watched, else all the
/// VM's allocations over those the hook saw, as of the end of the last watched interval (a
/// ratio taken mid-interval would credit the whole run's allocations to a partly counted
/// interval), or 1/duty before the first one ends.
fn watched_scale() -> f64 {
    let duty = DUTY_PPM.load(Ordering::Relaxed);
    if duty >= 1_000_000 {
        return 1.0;
    }
    match f64::from_bits(SCALE_BITS.load(Ordering::Relaxed)) {
        x if x >= 1.0 => x,
        _ => 1e6 / duty as f64,
    }
}

/// At the end of a watched interval: the VM's allocations since start over the hook's count.
fn update_scale() {
    let seen = WATCHED_ALL.load(Ordering::Relaxed);
    if seen == 0 {
        return;
    }
    let all = vm_allocated().saturating_sub(VM_ALLOCATED_AT_START.load(Ordering::Relaxed));
    let scale = (all as f64 / seen as f64).max(1.0);
    SCALE_BITS.store(scale.to_bits(), Ordering::Relaxed);
}

/// [`watched_scale`]'s ratio (f64 bits; 0: none yet).
static SCALE_BITS: AtomicU64 = AtomicU64::new(0);

/// The oldest queued allocation sample. One at a time: it leaves the (marked) queue for the
/// caller's stack, which the GC scans; the queue's lock is not held while the caller allocates.
fn next_pending() -> Option<AllocSample> {
    let mut q = lock(&PENDING);
    (!q.is_empty()).then(|| q.remove(0))
}

/// The name of `class`; an anonymous class is named after its nearest named ancestor
/// (`(anonymous subclass of Struct)`), so labels stay few.
fn class_name(class: VALUE) -> Option<String> {
    // SAFETY: a live class (marked in the queue until now, on the caller's stack since).
    let mut c = unsafe { Value::from_raw(class) };
    for depth in 0..64 {
        if let Ok(Some(name)) = c.funcall::<_, _, Option<String>>("name", ()) {
            return Some(if depth == 0 {
                name
            } else {
                format!("(anonymous subclass of {name})")
            });
        }
        c = c.funcall::<_, _, Option<Value>>("superclass", ()).ok()??;
    }
    None
}

/// After a GC: the heap recorder's young update, out of the GC.
extern "C" fn gc_job(_data: *mut c_void) {
    if !RUNNING.load(Ordering::Relaxed) {
        return;
    }
    as_job(|| {
        if let Some(rec) = recorder() {
            rec.after_gc_step();
            COUNTERS.gc_steps.fetch_add(1, Ordering::Relaxed);
        }
    });
}

// --- hooks ----------------------------------------------------------------------------------

/// xorshift64: the sampler's gaps and windows (called with the GVL held).
fn random() -> u64 {
    let mut x = ALLOC.rng.load(Ordering::Relaxed);
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    ALLOC.rng.store(x, Ordering::Relaxed);
    x
}

/// A new seed for [`random`]: at each start and in each forked child, so no two processes (and
/// no parent and child) draw the same samples.
fn seed_random() {
    let mut seed = 0u64;
    // SAFETY: getrandom writes at most 8 bytes into `seed`.
    let got = unsafe { libc::getrandom((&mut seed as *mut u64).cast(), 8, libc::GRND_NONBLOCK) };
    if got != 8 {
        // No entropy yet (early boot): the clock and the process id differ enough.
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes into `ts`; getpid has no preconditions.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        let pid = unsafe { libc::getpid() } as u64;
        seed = (ts.tv_sec as u64) << 32 ^ ts.tv_nsec as u64 ^ pid.rotate_left(17);
    }
    // xorshift never leaves 0.
    ALLOC.rng.store(seed | 1, Ordering::Relaxed);
}

fn next_gap(every: u64) -> u64 {
    // Uniform in 1..=2*every-1: mean `every`.
    1 + random() % (2 * every - 1).max(1)
}

/// Whether heap object `obj` is one Ruby code can see: it has a class, and is not one of the
/// VM's internal types (instruction sequences, method entries, include classes...).
///
/// # Safety
/// `obj` must be a live heap object (its `RBasic` readable).
unsafe fn visible(obj: VALUE) -> bool {
    // SAFETY: the caller's contract.
    let basic = unsafe { &*(obj as *const rb_sys::RBasic) };
    let ty = (basic.flags & rb_sys::ruby_value_type::RUBY_T_MASK as VALUE) as u32;
    basic.klass != 0
        && ((rb_sys::ruby_value_type::RUBY_T_OBJECT as u32
            ..=rb_sys::ruby_value_type::RUBY_T_RATIONAL as u32)
            .contains(&ty)
            || ty == rb_sys::ruby_value_type::RUBY_T_SYMBOL as u32)
}

/// `NEWOBJ`: counts, and every gap queues a sample. Runs inside the allocation: allocates no
/// Ruby object and calls no Ruby method.
unsafe extern "C" fn on_newobj(tpval: VALUE, _data: *mut c_void) {
    let every = ALLOC.every.load(Ordering::Relaxed);
    if every == 0 || !RUNNING.load(Ordering::Relaxed) {
        return;
    }
    WATCHED_ALL.fetch_add(1, Ordering::Relaxed);
    if IN_JOB.load(Ordering::Relaxed) {
        return;
    }
    // SAFETY: called by the VM for this tracepoint's event; the object has its flags and class
    // set (newobj_init runs before the hook).
    let obj = unsafe { rb_sys::rb_tracearg_object(rb_sys::rb_tracearg_from_tracepoint(tpval)) };
    // SAFETY: obj is a heap object (NEWOBJ is never raised for immediates).
    if !unsafe { visible(obj) } || on_own_thread() {
        // Hidden objects (no class, invisible to Ruby code) and the profiler's own are not
        // counted: a sample's weight is the visible allocations it stands for.
        return;
    }
    COUNTERS.alloc_events.fetch_add(1, Ordering::Relaxed);
    let seen = ALLOC.seen.fetch_add(1, Ordering::Relaxed) + 1;
    let left = ALLOC.countdown.load(Ordering::Relaxed);
    if left > 1 {
        ALLOC.countdown.store(left - 1, Ordering::Relaxed);
        return;
    }
    ALLOC.seen.store(0, Ordering::Relaxed);
    ALLOC.countdown.store(next_gap(every), Ordering::Relaxed);
    let mut q = lock(&PENDING);
    if q.len() >= MAX_PENDING {
        COUNTERS.alloc_dropped.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let mut s = AllocSample {
        obj,
        thread: ThreadOf::current(),
        span: 0,
        labels: 0,
        // SAFETY: a visible object has a class; rb_obj_class reads it (skipping singleton and
        // include classes) and allocates nothing.
        class: unsafe { rb_sys::rb_obj_class(obj) },
        weight: seen,
        len: 0,
        frames: [0; ALLOC_FRAMES],
        lines: [0; ALLOC_FRAMES],
    };
    // SAFETY: buffers of ALLOC_FRAMES entries; rb_profile_frames reads the VM's frames and
    // allocates nothing.
    let n = unsafe {
        rb_sys::rb_profile_frames(
            0,
            ALLOC_FRAMES as i32,
            s.frames.as_mut_ptr(),
            s.lines.as_mut_ptr(),
        )
    };
    s.len = n.max(0) as usize;
    (s.span, s.labels) = crate::context::get(s.thread.tid as u64);
    q.push(s);
    drop(q);
    // SAFETY: called with the GVL held; the job runs at the next safe point.
    unsafe { rb_sys::rb_postponed_job_register_one(0, Some(alloc_job), std::ptr::null_mut()) };
}

/// `GC_EXIT`: asks for the after-GC job (nothing else is allowed inside the GC).
unsafe extern "C" fn on_gc_exit(_tpval: VALUE, _data: *mut c_void) {
    if RUNNING.load(Ordering::Relaxed) {
        // SAFETY: registering a postponed job is allowed during GC.
        unsafe { rb_sys::rb_postponed_job_register_one(0, Some(gc_job), std::ptr::null_mut()) };
    }
}

fn new_tracepoint(event: u32, hook: unsafe extern "C" fn(VALUE, *mut c_void), on: bool) -> VALUE {
    // SAFETY: a process-wide tracepoint (target thread 0 = Qfalse) on an internal event with an
    // extern "C" hook; called with the GVL.
    let tp = unsafe { rb_sys::rb_tracepoint_new(0, event, Some(hook), std::ptr::null_mut()) };
    if on {
        // SAFETY: rb_tracepoint_new returns a TracePoint object.
        unsafe { rb_sys::rb_tracepoint_enable(tp) };
    }
    tp
}

// --- Ruby entry points ----------------------------------------------------------------------

/// `_native_start(recorder, cpu_interval_ns, alloc_every, alloc_duty, gc_hook, timeline,
/// cpu_engine)` (`cpu_engine`: `auto`, `perf` or `timer`):
/// `cpu_interval_ns` 0 turns CPU sampling off, `alloc_every` (mean allocations per sample) 0
/// allocation sampling off; `alloc_duty` is the share of CPU intervals whose allocations are
/// watched (1 without CPU sampling, which delimits the intervals).
// The arguments of `_native_start`, one per option; the Ruby side checks and passes them.
#[allow(clippy::too_many_arguments)]
fn start(
    ruby: &Ruby,
    rb: &RbRecorder,
    cpu_interval_ns: u64,
    alloc_every: u64,
    alloc_duty: f64,
    gc_hook: bool,
    timeline: bool,
    cpu_engine: String,
) -> Result<bool, Error> {
    guard(ruby, || {
        if RUNNING.load(Ordering::Relaxed) {
            return Ok(false);
        }
        if cpu_interval_ns != 0 && cpu_interval_ns < 1_000_000 {
            return Err(arg_error(
                ruby,
                format!("cpu interval {cpu_interval_ns} ns is under 1 ms (at most 1000 Hz)"),
            ));
        }
        if !["auto", "perf", "timer"].contains(&cpu_engine.as_str()) {
            return Err(arg_error(
                ruby,
                format!("cpu_engine must be auto, perf or timer, got {cpu_engine:?}"),
            ));
        }
        if !(alloc_duty > 0.0 && alloc_duty <= 1.0) {
            return Err(arg_error(
                ruby,
                format!("alloc_duty must be in (0, 1], got {alloc_duty}"),
            ));
        }
        let duty_ppm = if cpu_interval_ns == 0 {
            1_000_000
        } else {
            ((alloc_duty * 1e6).round() as u64).clamp(1, 1_000_000)
        };
        // Watched allocations per sample: the mean over all allocations stays `alloc_every`.
        let every = if alloc_every == 0 {
            0
        } else {
            ((alloc_every as f64 * duty_ppm as f64 / 1e6).round() as u64).max(1)
        };
        // The hook pushes without growing the queue (no malloc inside an allocation).
        lock(&PENDING).reserve_exact(MAX_PENDING);
        COUNTERS.reset();
        capture::clear();
        *lock(&THREAD_CPU) = None;
        seed_random();
        prepare_gc_info();
        INTERVAL_NS.store(cpu_interval_ns.max(1), Ordering::Relaxed);
        TIMELINE.store(timeline, Ordering::Relaxed);
        DUTY_PPM.store(duty_ppm, Ordering::Relaxed);
        WATCHED_ALL.store(0, Ordering::Relaxed);
        SCALE_BITS.store(0, Ordering::Relaxed);
        VM_ALLOCATED_AT_START.store(vm_allocated(), Ordering::Relaxed);
        ALLOC.every.store(every, Ordering::Relaxed);
        ALLOC.seen.store(0, Ordering::Relaxed);
        ALLOC
            .countdown
            .store(next_gap(every.max(1)), Ordering::Relaxed);
        let newobj_tp = if every > 0 {
            let on = duty_ppm >= 1_000_000 || random() % 1_000_000 < duty_ppm;
            HOOK_ON.store(on, Ordering::Relaxed);
            new_tracepoint(rb_sys::RUBY_INTERNAL_EVENT_NEWOBJ, on_newobj, on)
        } else {
            0
        };
        let gc_tp = if gc_hook {
            let on = every == 0 || HOOK_ON.load(Ordering::Relaxed);
            new_tracepoint(rb_sys::RUBY_INTERNAL_EVENT_GC_EXIT, on_gc_exit, on)
        } else {
            0
        };
        *lock(&ACTIVE) = Some(Active {
            recorder: rb.inner.clone(),
            newobj_tp,
            gc_tp,
        });
        RUNNING.store(true, Ordering::Relaxed);
        if cpu_interval_ns > 0 {
            let armed = install_handler()
                .map_err(|e| format!("cannot install the SIGPROF handler: {e}"))
                .and_then(|()| cpu_engine::start(&cpu_engine, cpu_interval_ns));
            if let Err(e) = armed {
                stop_inner();
                return Err(crate::error(ruby, e));
            }
        }
        Ok(true)
    })
}

/// Stops sampling. The handler stays installed (a `SIGPROF` already on its way must not meet
/// the default action, which ends the process); it does nothing once stopped.
fn stop_inner() -> bool {
    let was = RUNNING.swap(false, Ordering::Relaxed);
    cpu_engine::stop();
    HOOK_ON.store(false, Ordering::Relaxed);
    // The samples captured since the last CPU job go into this run's last profile.
    capture::settle();
    if let Some(rec) = recorder() {
        as_job(|| record_captured(&rec));
    }
    COUNTERS
        .cpu_intervals_at_stop
        .fetch_add(capture::take_held_over().0, Ordering::Relaxed);
    let active = lock(&ACTIVE).take();
    if let Some(a) = active {
        for tp in [a.newobj_tp, a.gc_tp] {
            if tp != 0 {
                // SAFETY: a tracepoint created by start, kept alive until now by Roots.
                unsafe { rb_sys::rb_tracepoint_disable(tp) };
            }
        }
    }
    lock(&PENDING).clear();
    *lock(&NAMES) = None;
    was
}

fn stop(ruby: &Ruby) -> Result<bool, Error> {
    guard(ruby, || Ok(stop_inner()))
}

/// In a forked child: the CPU timer is not inherited; arm a new one.
fn after_fork(ruby: &Ruby) -> Result<(), Error> {
    guard(ruby, || {
        capture::clear();
        crate::context::clear();
        *lock(&THREAD_CPU) = None;
        seed_random();
        cpu_engine::forget_after_fork();
        if RUNNING.load(Ordering::Relaxed) {
            let interval = INTERVAL_NS.load(Ordering::Relaxed);
            if interval > 1 {
                cpu_engine::restart(interval).map_err(|e| crate::error(ruby, e))?;
            }
        }
        Ok(())
    })
}

/// The profiler's own threads, whose samples are not kept (`nil`: none).
fn set_own_threads(ruby: &Ruby, writer: Option<Value>, wall: Option<Value>) -> Result<(), Error> {
    guard(ruby, || {
        for (slot, t) in OWN_THREADS.iter().zip([writer, wall]) {
            slot.store(t.map_or(0, |t| t.as_raw() as usize), Ordering::Relaxed);
        }
        Ok(())
    })
}

fn stats(ruby: &Ruby) -> Result<RHash, Error> {
    guard(ruby, || {
        let h = ruby.hash_new();
        let c = &COUNTERS;
        for (k, v) in c.all() {
            h.aset(ruby.to_symbol(k), v.load(Ordering::Relaxed))?;
        }
        h.aset(ruby.to_symbol("running"), RUNNING.load(Ordering::Relaxed))?;
        h.aset(ruby.to_symbol("cpu_engine"), cpu_engine::in_use())?;
        h.aset(
            ruby.to_symbol("perf_events_open"),
            crate::perf::OPEN.load(Ordering::Relaxed),
        )?;
        h.aset(
            ruby.to_symbol("perf_events_failed"),
            crate::perf::FAILED.load(Ordering::Relaxed),
        )?;
        Ok(h)
    })
}

pub fn init(ruby: &Ruby, module: RModule) -> Result<(), Error> {
    let native = module.define_module("Native")?;
    native.define_class("Roots", ruby.class_object())?;
    native.const_set("ROOTS", Roots)?;
    native.define_module_function("_native_start", function!(start, 7))?;
    native.define_module_function("_native_stop", function!(stop, 0))?;
    native.define_module_function("_native_after_fork", function!(after_fork, 0))?;
    native.define_module_function("_native_set_own_threads", function!(set_own_threads, 2))?;
    native.define_module_function("_native_stats", function!(stats, 0))?;
    native.define_module_function("_native_set_context", function!(set_context, 2))?;
    native.define_module_function("_native_register_labels", function!(register_labels, 2))?;
    native.define_module_function("_native_record_endpoint", function!(record_endpoint, 2))?;
    // The wall sampler records through the recorder's own sample entry point.
    native.define_module_function("_native_sample", function!(crate::recorder::sample, 5))?;
    native.define_module_function(
        "_native_sample_at",
        function!(crate::recorder::sample_at, 6),
    )?;
    Ok(())
}
