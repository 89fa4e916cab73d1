//! A forked child's CPU timer from the fork to the restart of the profiler's threads.
//!
//! A forked child starts no thread in the fork (see `crate::fork`): most children exec at once,
//! and some (sandboxes) must stay single-threaded for `unshare(CLONE_NEWUSER)`. The threads
//! start at the child's first sampled allocation or profiler call, which a child that computes
//! without allocating through the hooks (a Python worker whose objects come from pymalloc's
//! arenas) never makes. So the fork's child handler arms one POSIX timer on the forking thread's
//! own CPU clock, with the sampling period. Each expiry is a normal capture (its token names
//! the child's thread by [`CHILD_IDX`], which the restarted sampler maps to the thread whose
//! tid is the process's pid) and asks the thread's next allocation of any size to take the
//! slow path, where the restart runs (`crate::forkgate::resume_if_pending`).
//!
//! A child that never allocates then (a `multiprocessing` worker computing in pymalloc's arenas,
//! ended by `SIGTERM`, which only running profiler threads turn into a last profile) restarts
//! from the expiry's handler itself, where that is safe: the interrupted thread is in no
//! profiler code, holds no profiler lock, has room on its stack, and its stack, walked to the
//! executable's `_start`, has no frame in the C library or the dynamic loader but those that
//! call `main` (the only code that could hold a lock starting a thread takes: the allocator's,
//! the loader's, the thread stack cache). The stack is the one the expiry just captured; a
//! walk that did not reach `_start` proves nothing, and the thread tries again at the next
//! expiry (and restarts at its next allocation meanwhile).
//!
//! A child that execs within a period of CPU time sees no expiry, and `execve` deletes the
//! timer; the restarted sampler deletes it before arming threads its own way.
//!
//! Raw system calls: this runs in the child's fork handler, where glibc's wrappers (some
//! versions allocate in `timer_create`) are not to be called.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use super::capture::MAGIC;
use super::clock::timespec;
use crate::unwind::FrameBuf;

/// The thread index of captures taken by the child's timer (no sampler table exists yet).
pub(super) const CHILD_IDX: u64 = 0xff_ffff;

/// The kernel's id of the child's timer; -1 when none is armed.
static TIMER: AtomicI64 = AtomicI64::new(-1);

/// The address ranges of the C library and the dynamic loader (0, 0: unknown), learnt once
/// (see [`learn_system_objects`]); a forked child inherits them.
static SYSTEM: [(AtomicU64, AtomicU64); 2] = [
    (AtomicU64::new(0), AtomicU64::new(0)),
    (AtomicU64::new(0), AtomicU64::new(0)),
];

/// Finds the C library (the object with `getpid`) and the dynamic loader (at `AT_BASE`) among
/// the loaded objects. Not in a signal handler; once per process.
pub(crate) fn learn_system_objects() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let getpid = libc::getpid as *const () as usize as u64;
        // SAFETY: getauxval has no preconditions.
        let loader = unsafe { libc::getauxval(libc::AT_BASE) };
        // SAFETY: as above.
        ENTRY.store(
            unsafe { libc::getauxval(libc::AT_ENTRY) },
            Ordering::Relaxed,
        );
        for o in crate::modules::loaded_objects() {
            let which = if o.executes(getpid + 1) {
                0
            } else if loader != 0 && o.base == loader {
                1
            } else {
                continue;
            };
            if let Some((lo, hi)) = o.range() {
                SYSTEM[which].0.store(lo, Ordering::Relaxed);
                SYSTEM[which].1.store(hi, Ordering::Relaxed);
            }
        }
    });
}

fn in_system_object(addr: u64) -> bool {
    SYSTEM.iter().any(|(lo, hi)| {
        let (lo, hi) = (lo.load(Ordering::Relaxed), hi.load(Ordering::Relaxed));
        lo < hi && lo <= addr && addr < hi
    })
}

/// Stack room a restart from the handler needs (starting two threads, with their channels).
const RESTART_ROOM: u64 = 128 << 10;

/// In the handler of the child's timer, with the stack it just captured (`n` frames) and the
/// room left on the thread's stack: whether the profiler's threads can start right here (see
/// the module's notes). Async-signal-safe.
pub(super) fn can_restart_here(frames: &FrameBuf<'_>, n: usize, room: Option<u64>) -> bool {
    if room.is_none_or(|r| r < RESTART_ROOM) || n < 3 {
        return false;
    }
    let in_profiler = crate::tls::STATE
        .with(|s| s.guard.get() > 0 || s.gate_depth.get() > 0 || s.fork_locks.get() > 0);
    if in_profiler || crate::forkgate::forking_thread() {
        return false;
    }
    let frame = |i: usize| frames.at(i);
    if (0..n).any(|i| crate::unwind::is_marker(frame(i))) {
        return false;
    }
    // The walk must have reached the process's root, the executable's `_start` (a walk that
    // stopped early proves nothing: the frames it did not reach may hold a lock), through the
    // C library's frames that call `main` (`__libc_start_call_main`, `__libc_start_main`) and
    // none other of the C library or the loader. A child forked from another thread than the
    // main one (its root is `start_thread`, which no address tells apart from a walk cut short
    // in the C library) restarts at its next allocation instead.
    let entry = ENTRY.load(Ordering::Relaxed);
    let last = frame(n - 1);
    if entry == 0 || !(entry..entry + ENTRY_LEN).contains(&last) {
        return false;
    }
    let Some(first) = (0..n).find(|&i| in_system_object(frame(i))) else {
        return false;
    };
    first > 0 && n - 1 - first <= 2 && (first..n - 1).all(|i| in_system_object(frame(i)))
}

/// Starts the profiler's threads from the timer's handler, once [`can_restart_here`] said so.
/// Every signal is blocked meanwhile: the restart allocates and takes the profiler's locks, and
/// an application handler that interrupted it and allocated would wait for a lock this thread
/// holds. The threads it starts inherit that mask, which suits them: the application's threads
/// take the process's signals.
pub(super) fn restart_here() {
    // SAFETY: sigset operations on local sets; pthread_sigmask of the calling thread.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old);
        crate::forkgate::resume_if_pending();
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
    }
}

/// The executable's entry point (`_start`, from `AT_ENTRY`; 0: unknown), and how many bytes of
/// it a return address into it may lie past (`_start` calls `__libc_start_main` within its
/// first few dozen bytes).
static ENTRY: AtomicU64 = AtomicU64::new(0);
const ENTRY_LEN: u64 = 256;

/// In the forked child's only thread, when CPU is profiled: arms its CPU timer (best effort;
/// without it the child restarts as before, at its first sampled allocation).
pub(crate) fn arm_in_child(settings: &crate::settings::Settings) {
    // Timers are not inherited; the id stored may be the parent's.
    TIMER.store(-1, Ordering::Relaxed);
    if !settings.profiles.cpu {
        return;
    }
    let (sig, period_ns) = (settings.signal, super::clock::period_ns(settings));
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) } as i32;
    // SAFETY: sigevent is plain data; every field the kernel reads is set below.
    let mut ev: libc::sigevent = unsafe { std::mem::zeroed() };
    ev.sigev_notify = libc::SIGEV_THREAD_ID;
    ev.sigev_signo = sig;
    ev.sigev_notify_thread_id = tid;
    ev.sigev_value = libc::sigval {
        sival_ptr: ((MAGIC << 48) | CHILD_IDX) as usize as *mut libc::c_void,
    };
    // The thread's CPU clock, as `thread_cpu_ns` names it.
    let clock = ((!(tid as libc::clockid_t)) << 3) | 6;
    let mut id: libc::c_int = -1;
    // SAFETY: valid sigevent and out-pointer (the kernel's timer id is an int).
    let r = unsafe {
        libc::syscall(
            libc::SYS_timer_create,
            clock,
            &mut ev as *mut libc::sigevent,
            &mut id as *mut libc::c_int,
        )
    };
    if r != 0 {
        return;
    }
    let ts = timespec(period_ns);
    let spec = libc::itimerspec {
        it_interval: ts,
        it_value: ts,
    };
    // SAFETY: a timer just created; valid itimerspec.
    let r = unsafe {
        libc::syscall(
            libc::SYS_timer_settime,
            id,
            0,
            &spec as *const libc::itimerspec,
            std::ptr::null_mut::<libc::itimerspec>(),
        )
    };
    if r != 0 {
        // SAFETY: as above.
        unsafe { libc::syscall(libc::SYS_timer_delete, id) };
        return;
    }
    TIMER.store(id as i64, Ordering::Release);
}

/// Deletes the child's timer, if one is armed: the restarted sampler arms the thread its way.
pub(crate) fn disarm() {
    let id = TIMER.swap(-1, Ordering::AcqRel);
    if id >= 0 {
        // SAFETY: a timer `arm_in_child` created in this process, deleted once (swapped out).
        unsafe { libc::syscall(libc::SYS_timer_delete, id as libc::c_int) };
    }
}
