//! Profiling across `fork`.
//!
//! A `pthread_atfork` triple, registered once:
//! * *prepare* (parent, before fork): takes the profiler's own locks, so the child gets them in
//!   a consistent state (a fork therefore waits for a serialization in progress);
//! * *parent*: releases them;
//! * *child* (the only thread left): forgets everything that belonged to threads that do not
//!   exist in the child (reader counts, borrowed unwinder caches, pending signal requests, the
//!   parent's thread handles), resets the recorder (`reset_after_fork`: both profiles emptied, so
//!   the parent's samples are not reported twice), releases the locks and, unless disabled with
//!   `restart_after_fork(false)`, starts fresh sampler and export threads.
//!
//! A child that should not profile at all can call [`crate::ProfilerGuard::stop`] on its copy of
//! the guard, or the program can build with `restart_after_fork(false)` and call
//! [`after_fork`] only in the children that should profile.

use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Once};

use crate::state::{self, Shared};

static REGISTER: Once = Once::new();
/// The profiler whose locks the prepare handler took, until parent/child release them.
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
            sh.fork_lock_all();
            IN_FORK.store(Arc::into_raw(sh) as *mut Shared, Ordering::SeqCst);
        }
    });
}

extern "C" fn parent() {
    let p = IN_FORK.swap(std::ptr::null_mut(), Ordering::SeqCst);
    if p.is_null() {
        return;
    }
    // SAFETY: `p` came from Arc::into_raw in `prepare` on this thread, which also took the locks.
    unsafe {
        let sh = Arc::from_raw(p);
        sh.fork_unlock_all();
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
        reset_shared(&sh);
        // SAFETY: the prepare handler took these locks in the parent; this is the only thread.
        unsafe { sh.fork_unlock_all() };
        if sh.settings.restart_after_fork && !sh.stopping.load(Ordering::SeqCst) {
            let _ = crate::profiler::spawn_threads(&sh);
        }
    });
}

/// Resets what the child inherited while the locks are held (by the child's only thread).
fn reset_shared(sh: &Shared) {
    sh.recorder.reset_after_fork();
    // SAFETY: the locks are held by this thread since prepare; reach the data without relocking.
    unsafe {
        let threads = &mut *sh.threads.data_ptr();
        // Handles of the parent's threads: joining them in the child would wait forever.
        std::mem::forget(threads.sampler.take());
        std::mem::forget(threads.export.take());
        (*sh.taps_ptr()).clear();
    }
    sh.reset_tap_count();
    for t in &sh.own_tids {
        t.store(0, Ordering::SeqCst);
    }
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
