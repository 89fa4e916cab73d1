//! The fork gate: what the `pthread_atfork` handlers (`crate::fork`) close around a fork, so
//! that no thread is inside the running profiler's recorder, or inside the loader's list, at
//! the moment of the fork; and the pending restart of the profiler's threads in a forked child.
//!
//! The recorder's own locks (its slots, the heap recorder's shards, the string table) are taken
//! by application threads too, on the allocation and free paths, where the child cannot replace
//! what they guard. So every call into the running profiler's recorder goes through the gate
//! ([`outside_fork`]): the prepare handler closes it and waits until no thread is inside;
//! threads arriving meanwhile wait for the fork to finish (as they would for malloc's own
//! locks); the parent and child handlers open it again. A serialization enters the gate only
//! for its short steps that touch what application threads share ([`SerializeSteps`]); its
//! symbolization and encoding run outside, so a fork waits microseconds, never for an export,
//! and a fork between two steps leaves the child's `reset_after_fork` to release what the
//! vanished serializer held. Code inside the gate takes only recorder locks (taps are recorded
//! outside it), and no thread holds one of those while waiting at the gate, so draining it
//! always finishes. The gate is re-entrant on one thread (a signal handler that interrupted the
//! thread inside it passes).
//!
//! Nothing here knows the running profiler: the restart runs a hook the layer above sets.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::time::Duration;

use crate::sharded::ShardedCount;

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
pub(crate) fn close_gate() {
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
pub(crate) fn close_loader_walks() {
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

pub(crate) fn open_loader_walks(child: bool) {
    if child {
        LOADER_WALKS.store(0, Ordering::SeqCst);
    }
    LOADER_CLOSED.store(false, Ordering::SeqCst);
}

/// Opens the gate again (in the child nobody can be counted: the prepare handler waited for
/// that, and the counts are reset to be sure).
pub(crate) fn open_gate(child: bool) {
    if child {
        // Threads that were passing by (counted in, about to see FORKING and leave) are gone.
        GATE.reset();
    }
    FORKING.store(false, Ordering::SeqCst);
    FORKING_THREAD.with(|f| f.set(false));
}

/// Whether the calling thread is preparing a fork (between [`close_gate`] and [`open_gate`]).
pub(crate) fn forking_thread() -> bool {
    FORKING_THREAD.with(Cell::get)
}

/// Whether the profiler's threads are to be started again in this forked child (see
/// [`resume_if_pending`]): IDLE, PENDING, or STARTING while one thread does it.
static RESTART: AtomicU8 = AtomicU8::new(IDLE);
const IDLE: u8 = 0;
const PENDING: u8 = 1;
const STARTING: u8 = 2;

/// Starts the profiler's threads in a forked child that has shown it lives on as a process of
/// its own: from its CPU timer (`sampler::child_trigger`), at an allocation that timer asked
/// for, its first sampled allocation or its first call into the profiler's API. One atomic
/// load when nothing is pending.
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
    let hook = RESTART_HOOK.load(Ordering::Acquire);
    if hook != 0 {
        // SAFETY: only `set_restart_hook` stores here, and it stores a `fn()`.
        let hook: fn() = unsafe { std::mem::transmute::<usize, fn()>(hook) };
        crate::tls::with_guard(hook);
    }
    RESTART.store(IDLE, Ordering::Release);
}

/// What starts the profiler's threads again, set by the layer that owns them (`crate::fork`).
static RESTART_HOOK: AtomicUsize = AtomicUsize::new(0);

/// Sets what [`resume_if_pending`] runs (once the profiler's threads can be started).
pub(crate) fn set_restart_hook(hook: fn()) {
    RESTART_HOOK.store(hook as usize, Ordering::Release);
}

/// Takes the restart over for the caller: a pending one, or the next one once the thread doing
/// one finished. Give it back with [`end_restart`].
pub(crate) fn begin_restart() {
    loop {
        match RESTART.compare_exchange(IDLE, STARTING, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return,
            Err(PENDING) => {
                if RESTART
                    .compare_exchange(PENDING, STARTING, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                {
                    return;
                }
            }
            Err(_) => std::thread::sleep(Duration::from_micros(100)),
        }
    }
}

/// Ends what [`begin_restart`] began.
pub(crate) fn end_restart() {
    RESTART.store(IDLE, Ordering::Release);
}

/// In a forked child: a restart under way in the parent is not the child's (its thread did not
/// survive the fork); `pending` marks one to run at the child's first sign of life.
pub(crate) fn reset_restart(pending: bool) {
    FORKED_CHILD.store(true, Ordering::Relaxed);
    RESTART.store(if pending { PENDING } else { IDLE }, Ordering::SeqCst);
}

/// Set in a forked child (by [`reset_restart`], which every child runs).
static FORKED_CHILD: AtomicBool = AtomicBool::new(false);

/// Whether this process is a forked child of the process that started the profiler (its
/// threads' clocks started at the fork, with its profile).
pub(crate) fn is_forked_child() -> bool {
    FORKED_CHILD.load(Ordering::Relaxed)
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

/// Preload support, not API: whether this is a forked child whose profiler threads have not
/// started yet (see [`resume_if_pending`]): its profile is empty, it has nothing of its own to
/// write. One atomic load: async-signal-safe, usable right after `fork`.
#[doc(hidden)]
pub fn __restart_pending() -> bool {
    RESTART.load(Ordering::Acquire) == PENDING
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
