//! Profiling across `fork`.
//!
//! A `pthread_atfork` triple, registered once:
//! * *prepare* (parent, before fork): closes the fork gate (below) and takes a reference to the
//!   running profiler. It takes no lock of the profiler but the label table's (reset in the
//!   child like the others);
//! * *parent*: drops the reference and opens the gate;
//! * *child* (the only thread left): forgets everything that belonged to threads that do not
//!   exist in the child (reader counts, borrowed unwinder caches, pending signal requests, the
//!   parent's thread handles, locks they held, with the data those locks guarded replaced),
//!   resets the recorder (`reset_after_fork`: both profiles emptied, so the parent's samples are
//!   not reported twice) and, unless disabled with `restart_after_fork(false)`, marks a restart
//!   as pending. It starts no thread: most children exec at once, and a sampler started there
//!   would queue signals to a thread about to exec; a signal pending across `execve` kills the
//!   new program (its disposition is back to the default action). The sampler and export
//!   threads start once the child shows it lives on: at its first sampled allocation or its
//!   first call into the profiler ([`resume_if_pending`]).
//!
//! A child that should not profile can stop its copy of the guard (cheap when nothing
//! restarted yet), or the program builds with `restart_after_fork(false)` and calls
//! [`after_fork`] in the children that should profile. A child that only computes (never
//! allocates through the sampling allocator nor calls the profiler) calls [`after_fork`] to be
//! profiled.
//! The locks a thread may hold at the fork are `forklock` mutexes: `parking_lot`'s unlock hands
//! a contended lock to a waiter, which in the child is a thread that is not there, so its
//! `force_unlock` left such a lock held for ever.
//!
//! The recorder's own locks (its slots, the heap recorder's shards, the string table) are taken
//! by application threads too, on the allocation and free paths, where the child cannot replace
//! what they guard. So every call into the running profiler's recorder goes through a *fork
//! gate* ([`outside_fork`]): *prepare* closes it and waits until no thread is inside; threads
//! arriving meanwhile wait for the fork to finish (as they would for malloc's own locks); *parent*
//! and *child* open it again. No application thread is ever inside the recorder at the moment
//! of the fork. A serialization enters the gate only for its short steps that touch what
//! application threads share ([`SerializeSteps`]); its symbolization and encoding run outside,
//! so a fork waits microseconds, never for an export, and a fork between two steps leaves the
//! child's `reset_after_fork` to release what the vanished serializer held. Code inside the
//! gate takes only recorder locks (taps are recorded outside it), and no thread holds one of
//! those while waiting at the gate, so draining it always finishes.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Once};
use std::time::Duration;

use crate::sharded::ShardedCount;
use crate::state::{self, Shared};

static REGISTER: Once = Once::new();
/// The running profiler at the time of the fork, from prepare to parent/child.
static IN_FORK: AtomicPtr<Shared> = AtomicPtr::new(std::ptr::null_mut());

/// The fork gate: the threads inside the recorder through [`outside_fork`] (counted per shard,
/// see `crate::sharded`), and whether a fork is being prepared.
static GATE: ShardedCount = ShardedCount::new();
static FORKING: AtomicBool = AtomicBool::new(false);

thread_local! {
    /// Set on the thread running the prepare handler until the fork is done: whatever it does
    /// meanwhile (other libraries' fork handlers may allocate) must not wait for its own fork.
    static FORKING_THREAD: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f`, a call into the running profiler's recorder, never while a fork is under way: waits
/// for a fork being prepared to finish first. `f` must take no lock but the recorder's own.
pub(crate) fn outside_fork<R>(f: impl FnOnce() -> R) -> R {
    struct Leave(Option<usize>);
    impl Drop for Leave {
        fn drop(&mut self) {
            if let Some(shard) = self.0 {
                leave_gate(shard);
            }
        }
    }
    let _leave = Leave(enter_gate());
    f()
}

fn leave_gate(shard: usize) {
    GATE.leave(shard);
    crate::tls::STATE.with(|s| s.gate_depth.set(s.gate_depth.get().saturating_sub(1)));
}

/// Enters the fork gate, waiting while a fork is being prepared. Returns the shard counted in,
/// to be left with `GATE.leave`; `None` on the forking thread itself (from another library's
/// prepare handler: it cannot be inside the recorder when the fork happens, since it is the
/// one forking).
fn enter_gate() -> Option<usize> {
    let depth = crate::tls::STATE.with(|s| s.gate_depth.get());
    if depth > 0 {
        // Inside already (a signal handler that interrupted this thread in the recorder): no
        // fork can be past its prepare handler while this thread is counted in, and waiting
        // here for one being prepared would wait for ourselves.
        let shard = GATE.enter();
        crate::tls::STATE.with(|s| s.gate_depth.set(depth + 1));
        return Some(shard);
    }
    let mut round = 0u32;
    loop {
        // Count in, then look (and `close_gate` the other way round), all SeqCst: either the
        // prepare handler sees this thread counted, or this thread sees FORKING.
        let shard = GATE.enter();
        if !FORKING.load(Ordering::SeqCst) {
            crate::tls::STATE.with(|s| s.gate_depth.set(1));
            return Some(shard);
        }
        GATE.leave(shard);
        if FORKING_THREAD.with(Cell::get) {
            return None;
        }
        while FORKING.load(Ordering::SeqCst) {
            if round < 64 {
                std::thread::yield_now();
            } else {
                // Do not burn a CPU while the prepare handler waits for threads to leave.
                std::thread::sleep(Duration::from_micros(100));
            }
            round = round.saturating_add(1);
        }
    }
}

/// Closes the gate and waits until no thread is inside.
fn close_gate() {
    FORKING_THREAD.with(|f| f.set(true));
    FORKING.store(true, Ordering::SeqCst);
    let mut round = 0u32;
    while !GATE.is_empty() {
        if round < 64 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
        round = round.saturating_add(1);
    }
}

/// The profiler's threads inside `dl_iterate_phdr`, and whether a fork is being prepared (see
/// [`outside_fork_walk_loader`]).
static LOADER_WALKS: AtomicUsize = AtomicUsize::new(0);
static LOADER_CLOSED: AtomicBool = AtomicBool::new(false);
/// How long a fork waits for the profiler's threads to finish a walk of the loader's list (one
/// takes well under a millisecond; copying the unwind sections of many objects a few).
const LOADER_DRAIN_LIMIT: Duration = Duration::from_secs(1);

/// Runs `f`, a call of `dl_iterate_phdr`, never across a fork. glibc's `fork` does not reset the
/// lock `dl_iterate_phdr` holds while it runs (it resets the loader's other locks): a fork while
/// a profiler thread is inside leaves the lock held forever in the child, whose next
/// `dl_iterate_phdr` (its profiler's, or its own unwinder's on a panic or C++ exception) hangs.
/// The prepare handler waits for walks under way to end and holds new ones back until the fork
/// is done. `f` may allocate (prepare handlers run before glibc takes malloc's locks), and never
/// enters the fork gate.
pub(crate) fn outside_fork_walk_loader<R>(f: impl FnOnce() -> R) -> R {
    struct Leave(bool);
    impl Drop for Leave {
        fn drop(&mut self) {
            if self.0 {
                LOADER_WALKS.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }
    let mut counted = true;
    loop {
        // Count in, then look; prepare sets the flag, then looks at the count (all SeqCst).
        LOADER_WALKS.fetch_add(1, Ordering::SeqCst);
        if !LOADER_CLOSED.load(Ordering::SeqCst) {
            break;
        }
        LOADER_WALKS.fetch_sub(1, Ordering::SeqCst);
        if FORKING_THREAD.with(Cell::get) {
            counted = false;
            break;
        }
        while LOADER_CLOSED.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
    let _leave = Leave(counted);
    f()
}

/// Holds new loader walks back and waits, at most [`LOADER_DRAIN_LIMIT`], for those under way.
fn close_loader_walks() {
    LOADER_CLOSED.store(true, Ordering::SeqCst);
    let start = std::time::Instant::now();
    let mut round = 0u32;
    while LOADER_WALKS.load(Ordering::SeqCst) != 0 && start.elapsed() < LOADER_DRAIN_LIMIT {
        if round < 64 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
        round = round.saturating_add(1);
    }
}

fn open_loader_walks(child: bool) {
    if child {
        LOADER_WALKS.store(0, Ordering::SeqCst);
    }
    LOADER_CLOSED.store(false, Ordering::SeqCst);
}

/// Opens the gate again (in the child nobody can be counted: the prepare handler waited for
/// that, and the counts are reset to be sure).
fn open_gate(child: bool) {
    if child {
        // Threads that were passing by (counted in, about to see FORKING and leave) are gone.
        GATE.reset();
    }
    FORKING.store(false, Ordering::SeqCst);
    FORKING_THREAD.with(|f| f.set(false));
}

pub(crate) fn register() {
    REGISTER.call_once(|| {
        // SAFETY: registering plain extern "C" functions; they stay valid forever.
        unsafe {
            libc::pthread_atfork(Some(prepare), Some(parent), Some(child));
        }
    });
}

/// Held from the prepare handler of one fork to its parent or child handler: one fork at a time
/// goes through the handlers below. glibc runs prepare handlers without a lock of its own, so
/// two threads forking at once would otherwise run them side by side, and the first fork's
/// parent handler would reopen the gate while the second fork still counted on it closed (the
/// second child then inherited a recorder lock held by a thread it does not have).
static FORK_LOCK: crate::forklock::Mutex<()> = crate::forklock::Mutex::new(());
/// The forking thread's count of `forklock` holds before `prepare` took its own (the child
/// resets those locks, so it puts the count back too).
static HELD_BEFORE: AtomicU32 = AtomicU32::new(0);

/// Whether the calling thread can prepare a fork: a fork from a thread that is inside the fork
/// gate or holds one of the profiler's locks (a signal handler that interrupted the profiler, a
/// crash handler that forks) would wait for itself. Such a fork is let through untouched.
fn can_prepare() -> bool {
    let (depth, skips) = crate::tls::STATE.with(|s| (s.gate_depth.get(), s.fork_skips.get()));
    depth == 0
        && skips == 0
        && crate::forklock::held_by_this_thread() == 0
        && !FORKING_THREAD.with(Cell::get)
}

/// Whether the fork that just happened was one [`prepare`] let through untouched.
fn take_skip() -> bool {
    crate::tls::STATE.with(|s| {
        let n = s.fork_skips.get();
        if n > 0 {
            s.fork_skips.set(n - 1);
        }
        n > 0
    })
}

extern "C" fn prepare() {
    if !can_prepare() {
        crate::tls::STATE.with(|s| s.fork_skips.set(s.fork_skips.get() + 1));
        return;
    }
    HELD_BEFORE.store(crate::forklock::held_by_this_thread(), Ordering::Relaxed);
    // SAFETY (released in `parent`, reset in `child`): the guard is forgotten, not dropped.
    std::mem::forget(FORK_LOCK.lock());
    crate::labels::before_fork();
    close_gate();
    // After the gate: a thread inside the gate may walk the loader's list and must get out.
    close_loader_walks();
    crate::tls::with_guard(|| {
        if let Some(sh) = state::active_arc() {
            IN_FORK.store(Arc::into_raw(sh) as *mut Shared, Ordering::SeqCst);
        }
    });
}

extern "C" fn parent() {
    if take_skip() {
        return;
    }
    crate::labels::after_fork(false);
    let p = IN_FORK.swap(std::ptr::null_mut(), Ordering::SeqCst);
    if !p.is_null() {
        // SAFETY: `p` came from Arc::into_raw in `prepare`.
        drop(unsafe { Arc::from_raw(p) });
    }
    open_loader_walks(false);
    open_gate(false);
    // Last: the next fork's prepare handler finds everything above open again.
    // SAFETY: `prepare`, on this thread, locked it and forgot the guard.
    unsafe { FORK_LOCK.force_unlock() };
}

extern "C" fn child() {
    if take_skip() {
        // Forked from inside the profiler: what this thread holds stays held in the child. The
        // child leaves the profiler behind (its allocations and frees no longer reach it)
        // rather than wait on it.
        RESTART.store(IDLE, Ordering::SeqCst);
        state::abandon_in_child();
        return;
    }
    // SAFETY: this is the forked child's only thread, which took the lock in `prepare`.
    unsafe { crate::forklock::reset_in_child(&FORK_LOCK) };
    let p = IN_FORK.swap(std::ptr::null_mut(), Ordering::SeqCst);
    // A restart under way in the parent (another thread inside `resume_slow`) is not this
    // child's: its thread did not survive the fork.
    RESTART.store(IDLE, Ordering::SeqCst);
    open_loader_walks(true);
    crate::threads::reset_current_tid();
    crate::labels::after_fork(true);
    // The locks reset above were this thread's holds.
    crate::tls::STATE.with(|s| s.fork_locks.set(HELD_BEFORE.load(Ordering::Relaxed)));
    if p.is_null() {
        open_gate(true);
        return;
    }
    // SAFETY: as in `parent`; in the child this thread is the only one.
    let sh = unsafe { Arc::from_raw(p) };
    crate::tls::with_guard(|| {
        state::after_fork_in_child();
        crate::threads::reset_current_tid();
        crate::threads::forget_own_threads_after_fork();
        crate::threads::reset_current_thread_name();
        crate::unwind::after_fork_in_child();
        crate::sampler::after_fork_in_child();
        crate::alloc::arena::after_fork_in_child();
        // SAFETY: this is the forked child's only thread.
        unsafe { sh.after_fork_in_child() };
        if !sh.recorder.locks_free_after_fork() {
            // Cannot happen while the gate holds (every recorder lock is taken inside it), but
            // a child must never wait on a lock: it leaves the profiler behind instead.
            state::abandon_in_child();
            open_gate(true);
            return;
        }
        sh.recorder.reset_after_fork();
        // SAFETY: this is the forked child's only thread.
        unsafe { sh.alloc_totals.clear_after_fork() };
        open_gate(true);
        if sh.settings.restart_after_fork && !sh.stopping.load(Ordering::SeqCst) {
            // Not now: a child that execs right away must neither pay for a start nor have a
            // sampler queue a signal that would outlive the exec and kill the new program.
            RESTART.store(PENDING, Ordering::SeqCst);
        }
    });
}

/// Whether the profiler's threads are to be started again in this forked child (see
/// [`resume_if_pending`]): IDLE, PENDING, or STARTING while one thread does it.
static RESTART: AtomicU8 = AtomicU8::new(IDLE);
const IDLE: u8 = 0;
const PENDING: u8 = 1;
const STARTING: u8 = 2;

/// Starts the profiler's threads in a forked child that has shown it lives on as a process of
/// its own: at its first sampled allocation or its first call into the profiler's API. One
/// atomic load when nothing is pending.
#[inline]
pub(crate) fn resume_if_pending() {
    if RESTART.load(Ordering::Acquire) == PENDING {
        resume_slow();
    }
}

#[cold]
fn resume_slow() {
    if RESTART
        .compare_exchange(PENDING, STARTING, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        return;
    }
    crate::tls::with_guard(|| {
        if let Some(sh) = state::active_arc() {
            start_threads_if_stopped(&sh);
        }
    });
    RESTART.store(IDLE, Ordering::Release);
}

fn start_threads_if_stopped(sh: &Arc<Shared>) {
    let running = {
        let t = sh.threads.lock();
        t.sampler.is_some() || t.export.is_some()
    };
    if !running && !sh.stopping.load(Ordering::SeqCst) && crate::profiler::spawn_threads(sh).is_ok()
    {
        // A child that lives on ends as its parent would: a SIGTERM writes its last profile.
        crate::termination::rearm_in_child(sh);
    }
}

/// For `stop()`: waits until no thread is starting the profiler's threads (it would hand
/// their handles over after `stop()` looked for them), and cancels a pending restart. Cheap in a
/// child that never restarted.
pub(crate) fn settle_restart() {
    loop {
        match RESTART.compare_exchange(PENDING, IDLE, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) | Err(IDLE) => return,
            // STARTING: a thread spawn, bounded.
            Err(_) => std::thread::sleep(Duration::from_micros(100)),
        }
    }
}

/// Restarts profiling in a forked child now: when the profiler was built with
/// `restart_after_fork(false)`, or to have a child that neither allocates nor calls the
/// profiler profiled from this point on (by default a child resumes at its first sampled
/// allocation or profiler call). Does nothing when no profiler runs or its threads are alive.
pub fn after_fork() {
    // Takes over a pending restart, or waits for the thread doing one.
    loop {
        match RESTART.compare_exchange(IDLE, STARTING, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => break,
            Err(PENDING) => {
                if RESTART
                    .compare_exchange(PENDING, STARTING, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    break;
                }
            }
            Err(_) => std::thread::sleep(Duration::from_micros(100)),
        }
    }
    crate::tls::with_guard(|| {
        if let Some(sh) = state::active_arc() {
            start_threads_if_stopped(&sh);
        }
    });
    RESTART.store(IDLE, Ordering::Release);
}

/// Preload support, not API: whether this is a forked child whose profiler threads have not
/// started yet (see [`resume_if_pending`]): its profile is empty, it has nothing of its own to
/// write. One atomic load: async-signal-safe, usable right after `fork`.
#[doc(hidden)]
pub fn __restart_pending() -> bool {
    RESTART.load(Ordering::Acquire) == PENDING
}

/// The locks of the running profiler that [`__hold_lock`] can hold (tests).
#[doc(hidden)]
pub const __LOCKS: &[&str] = &[
    "threads",
    "taps",
    "symbolizer",
    "exporters",
    "serialize",
    "retired",
];

/// Test support, not API: holds lock `name` (one of [`__LOCKS`]) of the running profiler
/// while `while_held` runs, so a test can fork with it held. False when no profiler runs or the
/// name is unknown.
#[doc(hidden)]
pub fn __hold_lock(name: &str, while_held: impl FnOnce()) -> bool {
    let Some(sh) = state::active_arc() else {
        return false;
    };
    let mut once = Some(while_held);
    let mut f = || {
        if let Some(f) = once.take() {
            f();
        }
    };
    // Guarded: an allocation sampled meanwhile would take some of these locks again.
    crate::tls::with_guard(|| match name {
        "threads" => {
            let _held = sh.threads.lock();
            f();
        }
        "taps" => sh.hold_taps_lock(&mut f),
        "symbolizer" => {
            let _held = sh.symbolizer.lock();
            f();
        }
        "exporters" => {
            let _held = sh.exporters.lock();
            f();
        }
        "serialize" => {
            let _held = sh.serialize_lock.lock();
            f();
        }
        "retired" => crate::unwind::hold_retired_lock(&mut f),
        _ => {}
    });
    once.is_none()
}

/// Test support, not API: runs `while_inside` inside a walk of the loader's list by the
/// profiler (as its sampler and symbolizer do), so a test can fork meanwhile.
#[doc(hidden)]
pub fn __walk_loader(while_inside: impl FnOnce()) {
    crate::tls::with_guard(|| crate::modules::walk_with(while_inside));
}

/// The fork gate for a serialization of the running profiler's recorder, step by step (see
/// [`ferroprof_recorder::SharedStateGate`]): the recorder enters the gate only around its steps
/// that touch state shared with application threads, so a fork waits for one short step at most,
/// never for symbolizing and encoding a whole profile. Same protocol as [`outside_fork`]; one
/// per serialization, on the serializing thread.
pub(crate) struct SerializeSteps {
    /// The shard counted in while inside a step; `None` outside (or on the forking thread).
    shard: Cell<Option<usize>>,
}

impl SerializeSteps {
    pub(crate) fn new() -> Self {
        SerializeSteps {
            shard: Cell::new(None),
        }
    }
}

impl ferroprof_recorder::SharedStateGate for SerializeSteps {
    fn enter(&self) {
        self.shard.set(enter_gate());
    }

    fn leave(&self) {
        if let Some(shard) = self.shard.take() {
            leave_gate(shard);
        }
    }
}
