//! Profiling across `fork`.
//!
//! A `pthread_atfork` triple, registered once:
//! * *prepare* (parent, before fork): takes a reference to the running profiler. It takes no
//!   lock: a lock taken there makes other threads block on it, and a thread blocked in
//!   `parking_lot` at fork time leaves a stale entry in its global wait table;
//! * *parent*: drops the reference;
//! * *child* (the only thread left): forgets everything that belonged to threads that do not
//!   exist in the child (reader counts, borrowed unwinder caches, pending signal requests, the
//!   parent's thread handles, locks they held, with the data those locks guarded replaced),
//!   resets the recorder (`reset_after_fork`: both profiles emptied, so the parent's samples are
//!   not reported twice) and, unless disabled with `restart_after_fork(false)`, starts fresh
//!   sampler and export threads.
//!
//! A child that should not profile can stop its copy of the guard, or the program builds with
//! `restart_after_fork(false)` and calls [`after_fork`] in the children that should profile.
//! Limit: a fork while another thread is blocked on a *contended* lock of the profiler or the
//! recorder leaves that lock's `parking_lot` wait entry behind in the child.

use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Once};

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

extern "C" fn prepare() {
    crate::tls::with_guard(|| {
        if let Some(sh) = state::active_arc() {
            IN_FORK.store(Arc::into_raw(sh) as *mut Shared, Ordering::SeqCst);
        }
    });
}

extern "C" fn parent() {
    let p = IN_FORK.swap(std::ptr::null_mut(), Ordering::SeqCst);
    if !p.is_null() {
        // SAFETY: `p` came from Arc::into_raw in `prepare`.
        drop(unsafe { Arc::from_raw(p) });
    }
}

extern "C" fn child() {
    let p = IN_FORK.swap(std::ptr::null_mut(), Ordering::SeqCst);
    if p.is_null() {
        return;
    }
    // SAFETY: as in `parent`; in the child this thread is the only one.
    let sh = unsafe { Arc::from_raw(p) };
    crate::tls::with_guard(|| {
        state::after_fork_in_child();
        state::reset_current_tid();
        crate::unwind::after_fork_in_child();
        crate::sampler::after_fork_in_child();
        // SAFETY: this is the forked child's only thread.
        unsafe { sh.after_fork_in_child() };
        sh.recorder.reset_after_fork();
        if sh.settings.restart_after_fork && !sh.stopping.load(Ordering::SeqCst) {
            let _ = crate::profiler::spawn_threads(&sh);
        }
    });
}

/// Restarts profiling in a forked child when the profiler was built with
/// `restart_after_fork(false)`. Does nothing when no profiler runs or its threads are alive.
pub fn after_fork() {
    crate::tls::with_guard(|| {
        let Some(sh) = state::active_arc() else {
            return;
        };
        let running = {
            let t = sh.threads.lock();
            t.sampler.is_some() || t.export.is_some()
        };
        if !running && !sh.stopping.load(Ordering::SeqCst) {
            let _ = crate::profiler::spawn_threads(&sh);
        }
    });
}
