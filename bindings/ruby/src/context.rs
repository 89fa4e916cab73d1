//! Each thread's request context: the local root span id of the request it serves and the id
//! of its user label set (0: none), set on its own thread by `Ferroprof::Rack` and
//! `Ferroprof.with_labels`, read by the `SIGPROF` handler and the `NEWOBJ` hook running on that
//! thread. A table by native thread id (open addressing, atomics only: the handler reads it at
//! any instruction, and thread-local storage in a `dlopen`ed library may allocate).

use std::sync::atomic::{AtomicU64, Ordering};

const THREADS: usize = 1024;
/// Entries probed per lookup; a thread that finds none free runs without a context (counted).
const PROBES: usize = 32;

struct Entry {
    tid: AtomicU64,
    span: AtomicU64,
    labels: AtomicU64,
}

static TABLE: [Entry; THREADS] = [const {
    Entry {
        tid: AtomicU64::new(0),
        span: AtomicU64::new(0),
        labels: AtomicU64::new(0),
    }
}; THREADS];

/// Sets that found no entry.
pub static FULL: AtomicU64 = AtomicU64::new(0);

fn home(tid: u64) -> usize {
    (tid.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as usize % THREADS
}

/// The calling thread's native id. Async-signal-safe.
pub fn current_tid() -> u64 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() as u64 }
}

/// Sets thread `tid`'s context (called on that thread). False when the table has no room.
pub fn set(tid: u64, span: u64, labels: u64) -> bool {
    let h = home(tid);
    for i in 0..PROBES {
        let e = &TABLE[(h + i) % THREADS];
        let held = e.tid.load(Ordering::Acquire);
        let mine = held == tid
            || (held == 0
                && e.tid
                    .compare_exchange(0, tid, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok());
        if mine {
            e.span.store(span, Ordering::Relaxed);
            e.labels.store(labels, Ordering::Relaxed);
            return true;
        }
    }
    if span != 0 || labels != 0 {
        FULL.fetch_add(1, Ordering::Relaxed);
    }
    false
}

/// Thread `tid`'s (span, labels). Async-signal-safe: atomic loads.
pub fn get(tid: u64) -> (u64, u64) {
    let h = home(tid);
    for i in 0..PROBES {
        let e = &TABLE[(h + i) % THREADS];
        match e.tid.load(Ordering::Acquire) {
            t if t == tid => {
                return (
                    e.span.load(Ordering::Relaxed),
                    e.labels.load(Ordering::Relaxed),
                )
            }
            0 => break,
            _ => {}
        }
    }
    (0, 0)
}

/// Forgets every thread (a forked child: the parent's threads are gone).
pub fn clear() {
    for e in &TABLE {
        e.span.store(0, Ordering::Relaxed);
        e.labels.store(0, Ordering::Relaxed);
        e.tid.store(0, Ordering::Release);
    }
}
