//! The CPU engine: what sends `SIGPROF` to a thread each time it used another interval of CPU.
//! A task-clock perf event per thread (`crate::perf`) where this process may open them, else a
//! process CPU-time timer; `auto`, `perf` or `timer` as the profiler is asked. The handler and
//! what it records are `crate::profiler`'s.

use std::ffi::c_void;
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::lock;

/// The perf-event engine when it runs (else the CPU timer does, or nothing).
static ENGINE: Mutex<Option<crate::perf::Engine>> = Mutex::new(None);
/// The engine asked for (`auto`, `perf`, `timer`) and the one running.
static ENGINE_WANTED: Mutex<String> = Mutex::new(String::new());
static ENGINE_IN_USE: AtomicU64 = AtomicU64::new(0);
const ENGINE_NONE: u64 = 0;
const ENGINE_TIMER: u64 = 1;
const ENGINE_PERF: u64 = 2;

/// Starts CPU sampling every `interval_ns` of CPU with the engine `wanted`: `perf` (an error
/// when this process may not open perf events), `timer`, or `auto` (perf when possible, else
/// the timer, said once on stderr with the reason).
pub fn start(wanted: &str, interval_ns: u64) -> Result<(), String> {
    *lock(&ENGINE_WANTED) = wanted.to_owned();
    if wanted != "timer" {
        match crate::perf::available(interval_ns) {
            Ok(()) => {
                *lock(&ENGINE) = Some(crate::perf::Engine::start(interval_ns));
                ENGINE_IN_USE.store(ENGINE_PERF, Ordering::Relaxed);
                return Ok(());
            }
            Err(errno) => {
                let why = std::io::Error::from_raw_os_error(errno);
                if wanted == "perf" {
                    return Err(format!("perf events are not available here: {why}"));
                }
                eprintln!(
                    "ferroprof: perf events are not available ({why}): CPU samples come from the process CPU timer"
                );
            }
        }
    }
    set_timer(interval_ns).map_err(|e| format!("cannot start the CPU timer: {e}"))?;
    ENGINE_IN_USE.store(ENGINE_TIMER, Ordering::Relaxed);
    Ok(())
}

/// Stops whichever CPU engine runs.
pub fn stop() {
    let _ = set_timer(0);
    if let Some(e) = lock(&ENGINE).take() {
        e.stop(Duration::from_secs(1));
    }
    ENGINE_IN_USE.store(ENGINE_NONE, Ordering::Relaxed);
}

/// The CPU timer (`timer_t`; null: none). Read by the handler for its overrun count.
static TIMER: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());

/// Arms a process CPU-time timer raising `SIGPROF` every `interval_ns` of CPU (0: deletes it).
/// A POSIX timer rather than `setitimer`: its overrun count tells how many intervals one signal
/// stands for (the kernel checks CPU timers at its tick, so at high rates one signal often
/// stands for several).
fn set_timer(interval_ns: u64) -> std::io::Result<()> {
    let old = TIMER.swap(std::ptr::null_mut(), Ordering::SeqCst);
    if !old.is_null() {
        // SAFETY: a timer this module created and has not deleted (swapped out above).
        unsafe { libc::timer_delete(old) };
    }
    if interval_ns == 0 {
        return Ok(());
    }
    // SAFETY: a zeroed sigevent is valid; SIGEV_SIGNAL with SIGPROF; timer_create writes the
    // new id into `timer`; timer_settime reads an initialized itimerspec.
    unsafe {
        let mut sev: libc::sigevent = std::mem::zeroed();
        sev.sigev_notify = libc::SIGEV_SIGNAL;
        sev.sigev_signo = libc::SIGPROF;
        let mut timer: libc::timer_t = std::ptr::null_mut();
        if libc::timer_create(libc::CLOCK_PROCESS_CPUTIME_ID, &mut sev, &mut timer) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let ts = libc::timespec {
            tv_sec: (interval_ns / 1_000_000_000) as libc::time_t,
            tv_nsec: (interval_ns % 1_000_000_000) as libc::c_long,
        };
        let spec = libc::itimerspec {
            it_interval: ts,
            it_value: ts,
        };
        TIMER.store(timer, Ordering::SeqCst);
        if libc::timer_settime(timer, 0, &spec, std::ptr::null_mut()) != 0 {
            let e = std::io::Error::last_os_error();
            TIMER.store(std::ptr::null_mut(), Ordering::SeqCst);
            libc::timer_delete(timer);
            return Err(e);
        }
    }
    Ok(())
}

/// In a forked child: POSIX timers are not inherited, and the perf engine's watcher and events
/// are the parent's. Forgets both without waiting for anything.
pub fn forget_after_fork() {
    TIMER.store(std::ptr::null_mut(), Ordering::SeqCst);
    if let Some(e) = lock(&ENGINE).take() {
        e.forget_after_fork();
    }
    ENGINE_IN_USE.store(ENGINE_NONE, Ordering::Relaxed);
}

/// Starts the engine asked for at the last [`start`] again (a forked child).
pub fn restart(interval_ns: u64) -> Result<(), String> {
    let wanted = lock(&ENGINE_WANTED).clone();
    start(&wanted, interval_ns)
}

/// The engine in use: `perf`, `timer` or `none`.
pub fn in_use() -> &'static str {
    match ENGINE_IN_USE.load(Ordering::Relaxed) {
        ENGINE_PERF => "perf",
        ENGINE_TIMER => "timer",
        _ => "none",
    }
}

/// In the handler: the intervals past the one this signal stands for (the timer's overrun;
/// 0 with perf events, one signal per period). Async-signal-safe: an atomic load and
/// `timer_getoverrun`.
pub fn timer_overrun() -> u64 {
    let timer = TIMER.load(Ordering::Relaxed);
    if timer.is_null() {
        return 0;
    }
    // SAFETY: a timer this module created; timer_getoverrun is async-signal-safe (a timer
    // deleted meanwhile gives -1, read as 0).
    unsafe { libc::timer_getoverrun(timer).max(0) as u64 }
}
