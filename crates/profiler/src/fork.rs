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
//!   new program (its disposition is back to the default action). It arms a timer on the
//!   child's CPU clock instead (`sampler::child_trigger`): the sampler and export threads start
//!   once the child shows it lives on: from that timer's first expiry (a period of CPU), its
//!   next allocation after it, its first sampled allocation or its first call into the profiler
//!   (`forkgate::resume_if_pending`).
//!
//! A child that should not profile can stop its copy of the guard (cheap when nothing
//! restarted yet), or the program builds with `restart_after_fork(false)` and calls
//! [`crate::after_fork`] in the children that should profile.
//! The locks a thread may hold at the fork are `forklock` mutexes: `parking_lot`'s unlock hands
//! a contended lock to a waiter, which in the child is a thread that is not there, so its
//! `force_unlock` left such a lock held for ever.
//!
//! The fork gate itself, and the pending restart, are `crate::forkgate` (a lower layer: the
//! allocator and the recorder's callers pass it).

use std::sync::atomic::{AtomicPtr, AtomicU32, Ordering};
use std::sync::{Arc, Once};

use crate::forkgate;
use crate::state::{self, Shared};

static REGISTER: Once = Once::new();
/// The running profiler at the time of the fork, from prepare to parent/child.
static IN_FORK: AtomicPtr<Shared> = AtomicPtr::new(std::ptr::null_mut());

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
        && !forkgate::forking_thread()
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
    forkgate::close_gate();
    // After the gate: a thread inside the gate may walk the loader's list and must get out.
    forkgate::close_loader_walks();
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
    forkgate::open_loader_walks(false);
    forkgate::open_gate(false);
    // Last: the next fork's prepare handler finds everything above open again.
    // SAFETY: `prepare`, on this thread, locked it and forgot the guard.
    unsafe { FORK_LOCK.force_unlock() };
}

extern "C" fn child() {
    if take_skip() {
        // Forked from inside the profiler: what this thread holds stays held in the child. The
        // child leaves the profiler behind (its allocations and frees no longer reach it)
        // rather than wait on it.
        forkgate::reset_restart(false);
        state::abandon_in_child();
        return;
    }
    // SAFETY: this is the forked child's only thread, which took the lock in `prepare`.
    unsafe { crate::forklock::reset_in_child(&FORK_LOCK) };
    let p = IN_FORK.swap(std::ptr::null_mut(), Ordering::SeqCst);
    // A restart under way in the parent (another thread inside `resume_slow`) is not this
    // child's: its thread did not survive the fork.
    forkgate::reset_restart(false);
    forkgate::open_loader_walks(true);
    crate::threads::reset_current_tid();
    crate::labels::after_fork(true);
    // The locks reset above were this thread's holds.
    crate::tls::STATE.with(|s| s.fork_locks.set(HELD_BEFORE.load(Ordering::Relaxed)));
    if p.is_null() {
        forkgate::open_gate(true);
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
            forkgate::open_gate(true);
            return;
        }
        sh.recorder.reset_after_fork();
        // SAFETY: this is the forked child's only thread.
        unsafe { sh.alloc_totals.clear_after_fork() };
        forkgate::open_gate(true);
        if sh.settings.restart_after_fork && !sh.stopping.load(Ordering::SeqCst) {
            // Not now: a child that execs right away must neither pay for a start nor have a
            // sampler queue a signal that would outlive the exec and kill the new program.
            forkgate::reset_restart(true);
            crate::sampler::child_trigger::arm_in_child(&sh.settings);
        }
    });
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
