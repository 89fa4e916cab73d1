//! Threads and process facts the lowest layers need: the calling thread's kernel id and name
//! (cached in its thread-local block), the table of the profiler's own threads (never sampled),
//! and whether the process is ending. Nothing here knows of profiles or of the running
//! profiler; everything is async-signal-safe but [`register_own_thread`].

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering};

use crate::tls::STATE;

pub(crate) const THREAD_ID_LABEL: &str = "thread id";
pub(crate) const THREAD_NAME_LABEL: &str = "thread name";

/// Set by [`crate::ProfilerGuard::stop_at_exit`]: the process ends after the last export,
/// which then leaves its memory to the exit.
pub(crate) static PROCESS_ENDING: AtomicBool = AtomicBool::new(false);

/// ferroprof's threads (sampler, exporters, delivery, HTTP server...), by thread id: the
/// sampler never samples them. A fixed table (threads register from their own start, and leave
/// when they exit); its generation tells the sampler to look again.
static OWN_TIDS: [AtomicI32; 64] = [const { AtomicI32::new(0) }; 64];
static OWN_GEN: AtomicU64 = AtomicU64::new(0);

/// Registers the calling thread as one of ferroprof's until it exits.
pub(crate) fn register_own_thread() {
    thread_local! {
        static REGISTERED: std::cell::RefCell<Option<OwnSlot>> = const { std::cell::RefCell::new(None) };
    }
    let _ = REGISTERED.try_with(|r| {
        let mut r = r.borrow_mut();
        if r.is_none() {
            *r = OwnSlot::claim();
        }
    });
}

/// Runs `f` with the calling thread counted as one of ferroprof's, so that the sampler leaves
/// it alone meanwhile: for `stop`, whose time (joining the profiler's threads, writing the last
/// profile) is the profiler's, not the application's.
pub(crate) fn as_own_thread<R>(f: impl FnOnce() -> R) -> R {
    let _slot = if is_own_tid(current_tid()) {
        None
    } else {
        OwnSlot::claim()
    };
    f()
}

/// The calling thread's entry in the table of ferroprof's threads, left when dropped.
struct OwnSlot(usize);

impl OwnSlot {
    fn claim() -> Option<OwnSlot> {
        let tid = current_tid();
        let i = OWN_TIDS.iter().position(|t| {
            t.compare_exchange(0, tid, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        })?;
        OWN_GEN.fetch_add(1, Ordering::SeqCst);
        Some(OwnSlot(i))
    }
}

impl Drop for OwnSlot {
    fn drop(&mut self) {
        OWN_TIDS[self.0].store(0, Ordering::SeqCst);
        OWN_GEN.fetch_add(1, Ordering::SeqCst);
    }
}

/// Whether `tid` is one of ferroprof's threads.
pub(crate) fn is_own_tid(tid: i32) -> bool {
    OWN_TIDS.iter().any(|t| t.load(Ordering::Relaxed) == tid)
}

/// Changes whenever a thread registers or leaves.
pub(crate) fn own_threads_generation() -> u64 {
    OWN_GEN.load(Ordering::SeqCst)
}

/// In a forked child: the parent's threads are gone, and so are their entries.
pub(crate) fn forget_own_threads_after_fork() {
    for t in OWN_TIDS.iter() {
        t.store(0, Ordering::Relaxed);
    }
    OWN_GEN.fetch_add(1, Ordering::SeqCst);
}

/// The calling thread's kernel id, cached per thread.
pub(crate) fn current_tid() -> i32 {
    STATE.with(|s| {
        let t = s.tid.get();
        if t != 0 {
            return t;
        }
        // SAFETY: gettid has no preconditions.
        let t = unsafe { libc::gettid() };
        s.tid.set(t);
        t
    })
}

/// Forgets the cached id (a forked child's thread has a new one).
pub(crate) fn reset_current_tid() {
    STATE.with(|s| s.tid.set(0));
}

/// Allocation samples between two reads of the calling thread's name (it rarely changes).
pub(crate) const NAME_REFRESH: u8 = 64;

/// The calling thread's name (at most 15 bytes), cached per thread and copied into `buf`.
pub(crate) fn current_thread_name(buf: &mut [u8; 16]) -> &str {
    let len = STATE.with(|s| {
        let age = s.name_age.get();
        if s.name_len.get() == 0xff || age >= NAME_REFRESH {
            let mut fresh = [0u8; 16];
            // SAFETY: PR_GET_NAME writes at most 16 bytes, NUL-terminated, into the buffer.
            let rc = unsafe {
                libc::prctl(
                    libc::PR_GET_NAME,
                    fresh.as_mut_ptr() as libc::c_ulong,
                    0,
                    0,
                    0,
                )
            };
            let len = if rc == 0 {
                fresh.iter().position(|&b| b == 0).unwrap_or(15)
            } else {
                0
            };
            s.name.set(fresh);
            s.name_len.set(len as u8);
            s.name_age.set(0);
        } else {
            s.name_age.set(age + 1);
        }
        *buf = s.name.get();
        s.name_len.get() as usize
    });
    std::str::from_utf8(&buf[..len.min(15)]).unwrap_or("")
}

/// Forgets the cached name (a forked child's thread may be renamed).
pub(crate) fn reset_current_thread_name() {
    STATE.with(|s| s.name_len.set(0xff));
}
