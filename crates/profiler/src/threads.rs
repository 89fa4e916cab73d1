//! Threads and process facts the lowest layers need: the calling thread's kernel id and name
//! (cached in its thread-local block), the table of the profiler's own threads (never sampled),
//! and whether the process is ending. Nothing here knows of profiles or of the running
//! profiler; everything is async-signal-safe but [`register_own_thread`].

use std::sync::atomic::{compiler_fence, AtomicBool, AtomicI32, AtomicU64, Ordering};

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
/// CPU time of ferroprof's threads that left the table (each adds its own as it leaves).
static ENDED_OWN_CPU: AtomicU64 = AtomicU64::new(0);
/// What of ferroprof's threads' CPU time [`take_unbooked_own_cpu`] handed out.
static BOOKED_OWN_CPU: AtomicU64 = AtomicU64::new(0);

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

/// Runs `f` (`stop`) with the calling thread known as the one stopping the profiler: the
/// sampler books its CPU up to the stop as the application's (also when it lists the thread
/// only then: a process that ended within a period, a forked child restarted at its exit), and
/// leaves its wall time in there alone (joining the profiler's threads, writing the last
/// profile: the profiler's time).
pub(crate) fn while_stopping<R>(f: impl FnOnce() -> R) -> R {
    struct Clear;
    impl Drop for Clear {
        fn drop(&mut self) {
            STOPPER.store(0, Ordering::SeqCst);
        }
    }
    STOPPER.store(current_tid(), Ordering::SeqCst);
    let _clear = Clear;
    f()
}

/// The thread inside [`while_stopping`] (0: none).
static STOPPER: AtomicI32 = AtomicI32::new(0);

/// The thread stopping the profiler (0: none).
pub(crate) fn stopper_tid() -> i32 {
    STOPPER.load(Ordering::SeqCst)
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
        // After leaving the table: a reader counts this thread's CPU once at most (see
        // `own_threads_cpu_ns`).
        ENDED_OWN_CPU.fetch_add(own_cpu_ns(), Ordering::SeqCst);
    }
}

/// CPU time of ferroprof's threads so far, ended ones included. Never more than the truth:
/// the ended threads' sum is read before the table, and a thread adds itself to that sum only
/// after leaving the table, so a thread ending meanwhile is counted once or, until the next
/// call, not at all.
pub(crate) fn own_threads_cpu_ns() -> u64 {
    let ended = ENDED_OWN_CPU.load(Ordering::SeqCst);
    let live: u64 = OWN_TIDS
        .iter()
        .map(|t| t.load(Ordering::SeqCst))
        .filter(|&tid| tid != 0)
        .filter_map(thread_cpu_ns)
        .sum();
    ended + live
}

/// ferroprof's threads' CPU time that no earlier call returned. Calls return disjoint parts of
/// [`own_threads_cpu_ns`], never the same nanosecond twice.
pub(crate) fn take_unbooked_own_cpu() -> u64 {
    let total = own_threads_cpu_ns();
    total.saturating_sub(BOOKED_OWN_CPU.fetch_max(total, Ordering::SeqCst))
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
    // Nor is their CPU time the child's.
    ENDED_OWN_CPU.store(0, Ordering::SeqCst);
    BOOKED_OWN_CPU.store(0, Ordering::SeqCst);
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
            // Checked once here rather than at every read: a name that is not UTF-8 reads as
            // empty.
            let len = if std::str::from_utf8(&fresh[..len]).is_ok() {
                len
            } else {
                0
            };
            // Length 0 while the name changes: a signal handler on this thread reading it in
            // between sees a prefix that was checked, never new bytes under an old length.
            s.name_len.set(0);
            compiler_fence(Ordering::SeqCst);
            s.name.set(fresh);
            compiler_fence(Ordering::SeqCst);
            s.name_len.set(len as u8);
            s.name_age.set(0);
        } else {
            s.name_age.set(age + 1);
        }
        *buf = s.name.get();
        s.name_len.get() as usize
    });
    let name = &buf[..len.min(15)];
    // SAFETY: `name` is the prefix, of the length stored with it, of a cached name that its
    // refresh found to be UTF-8 (a length of 0 otherwise, and while it changes), copied
    // unchanged.
    unsafe { std::str::from_utf8_unchecked(name) }
}

/// Forgets the cached name (a forked child's thread may be renamed).
pub(crate) fn reset_current_thread_name() {
    STATE.with(|s| s.name_len.set(0xff));
}

pub(crate) fn clock_ns(clock: libc::clockid_t) -> Option<u64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid out-pointer; clock_gettime is async-signal-safe.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return None;
    }
    Some(ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
}

/// The calling thread's CPU time.
pub(crate) fn own_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_THREAD_CPUTIME_ID).unwrap_or(0)
}

/// CPU time consumed by thread `tid` of this process.
pub(crate) fn thread_cpu_ns(tid: i32) -> Option<u64> {
    // The kernel's clock id for another thread's CPU clock: CPUCLOCK_SCHED | PERTHREAD, tid
    // stored inverted above the low three bits.
    let clock = ((!(tid as libc::clockid_t)) << 3) | 6;
    clock_ns(clock)
}

/// Marks the calling thread as a profiler thread for the rest of its life.
/// (Also keeps the sampler away from it.)
pub(crate) fn enter_profiler_thread() {
    crate::tls::STATE.with(|s| {
        s.guard.set(s.guard.get() + 1);
        s.countdown.set(crate::tls::COUNTDOWN_HELD);
    });
    register_own_thread();
}

/// For the preload library, not API: a thread of ferroprof's own (its allocations are never
/// sampled, the sampler leaves it alone), running `f`.
#[doc(hidden)]
pub fn __spawn_own_thread(
    name: &str,
    f: impl FnOnce() + Send + 'static,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    crate::tls::with_guard(|| {
        std::thread::Builder::new()
            .name(name.to_owned())
            .stack_size(256 << 10)
            .spawn(move || {
                enter_profiler_thread();
                f()
            })
    })
}

/// Test support, not API: a thread named `name` that, like one of ferroprof's threads the
/// scheduler did not run right after its creation, first uses `start_cpu` of CPU (as starting
/// a thread can on a slow host: page faults on a fresh stack count), waits `delay` before it
/// registers as a profiler thread, then uses CPU for `busy`.
#[doc(hidden)]
#[allow(clippy::expect_used)] // test support: a test whose thread cannot start fails here
pub fn __late_own_thread(
    name: &str,
    start_cpu: std::time::Duration,
    delay: std::time::Duration,
    busy: std::time::Duration,
) -> std::thread::JoinHandle<()> {
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(move || {
            let start = own_cpu_ns();
            while own_cpu_ns().saturating_sub(start) < start_cpu.as_nanos() as u64 {
                std::hint::black_box(0u64);
            }
            std::thread::sleep(delay);
            enter_profiler_thread();
            let end = std::time::Instant::now() + busy;
            while std::time::Instant::now() < end {
                std::hint::black_box(0u64);
            }
        })
        .expect("spawn a thread")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spin_cpu(ns: u64) {
        let end = own_cpu_ns() + ns;
        while own_cpu_ns() < end {
            std::hint::spin_loop();
        }
    }

    /// The CPU of a profiler thread that ended is handed out once: after its end, and never
    /// again by a later call.
    #[test]
    fn an_ended_own_threads_cpu_is_booked_once() {
        take_unbooked_own_cpu();
        std::thread::spawn(|| {
            register_own_thread();
            spin_cpu(30_000_000);
        })
        .join()
        .unwrap();
        let first = take_unbooked_own_cpu();
        let second = take_unbooked_own_cpu();
        assert!(first >= 30_000_000, "the thread's 30 ms: {first} ns");
        // Other tests' profiler threads may run meanwhile, never for as long.
        assert!(
            second < first / 2,
            "booked again: {second} ns after {first}"
        );
    }
}
