//! The perf-event CPU engine: per thread a software task-clock event of the sampling period
//! (user space only) whose every overflow sends `SIGPROF` to that thread (`F_SETSIG`,
//! `F_SETOWN_EX` with `F_OWNER_TID`). The task clock runs on a high-resolution timer, so a
//! sample lands at the CPU instant its period ends and each signal stands for one period of
//! that thread's own CPU. The process CPU timer is checked at the kernel's tick instead, which
//! hands the signal to whichever thread's tick saw the expiry and, on a loaded machine, locks
//! onto work whose length is near the tick (a 4 ms request read 47-49% of the CPU where the app
//! measured 54%).
//!
//! Periods that end in the kernel are sampled too (the signal arrives as the thread returns to
//! user space, and the stack read then is the caller's): a user-space-only event skips them,
//! which made a route spinning on `clock_gettime` read 43% of the CPU where the app measured
//! 53%. Where only user-space events are allowed, the engine takes those.
//!
//! A watcher thread (not a Ruby thread) lists `/proc/self/task` every few milliseconds, opens
//! an event for each new thread and closes those of threads that ended. Threads Ruby does not
//! know get events too; the handler ignores their signals.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::lock;

/// `perf_event_attr` as of its first version (64 bytes), all this engine sets.
#[repr(C)]
#[derive(Default)]
struct PerfEventAttr {
    kind: u32,
    size: u32,
    config: u64,
    sample_period: u64,
    sample_type: u64,
    read_format: u64,
    flags: u64,
    wakeup_events: u32,
    bp_type: u32,
    config1: u64,
}

const PERF_TYPE_SOFTWARE: u32 = 1;
const PERF_COUNT_SW_TASK_CLOCK: u64 = 1;
const FLAG_DISABLED: u64 = 1 << 0;
const FLAG_EXCLUDE_KERNEL: u64 = 1 << 5;
const FLAG_EXCLUDE_HV: u64 = 1 << 6;
const PERF_FLAG_FD_CLOEXEC: libc::c_ulong = 1 << 3;
const PERF_EVENT_IOC_ENABLE: libc::c_ulong = 0x2400;
/// `struct f_owner_ex` and the fcntl commands (asm-generic/fcntl.h, the same everywhere).
#[repr(C)]
struct OwnerEx {
    kind: libc::c_int,
    pid: libc::pid_t,
}
const F_OWNER_TID: libc::c_int = 0;
const F_SETOWN_EX: libc::c_int = 15;
const F_SETSIG: libc::c_int = 10;

/// How often the watcher looks for new threads.
const SCAN_EVERY: Duration = Duration::from_millis(5);

/// Events open now, and threads that got none (the descriptor limit, or an error).
pub static OPEN: AtomicU64 = AtomicU64::new(0);
pub static FAILED: AtomicU64 = AtomicU64::new(0);

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// A disabled task-clock event of `period_ns` on thread `tid`, with `flags` added; the errno
/// on failure.
fn open_disabled(tid: libc::pid_t, period_ns: u64, flags: u64) -> Result<libc::c_int, i32> {
    let attr = PerfEventAttr {
        kind: PERF_TYPE_SOFTWARE,
        size: std::mem::size_of::<PerfEventAttr>() as u32,
        config: PERF_COUNT_SW_TASK_CLOCK,
        sample_period: period_ns,
        flags: FLAG_DISABLED | FLAG_EXCLUDE_HV | flags,
        wakeup_events: 1,
        ..PerfEventAttr::default()
    };
    // SAFETY: perf_event_open reads `attr` (a valid first-version attr); the other arguments
    // are plain integers (the thread id, any CPU, no group).
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            &attr as *const PerfEventAttr,
            tid,
            -1 as libc::c_int,
            -1 as libc::c_int,
            PERF_FLAG_FD_CLOEXEC,
        )
    } as libc::c_int;
    if fd < 0 {
        Err(errno())
    } else {
        Ok(fd)
    }
}

/// Opens, routes and enables a task-clock event of `period_ns` on thread `tid`. The errno on
/// failure.
fn open(tid: libc::pid_t, period_ns: u64) -> Result<libc::c_int, i32> {
    let fd = open_disabled(tid, period_ns, kernel_flag())?;
    let owner = OwnerEx {
        kind: F_OWNER_TID,
        pid: tid,
    };
    // SAFETY: fcntl/ioctl on the descriptor just opened, with the argument types each command
    // takes (flags, a signal number, a pointer to f_owner_ex, none).
    let ok = unsafe {
        libc::fcntl(fd, libc::F_SETFL, libc::O_ASYNC) == 0
            && libc::fcntl(fd, F_SETSIG, libc::SIGPROF) == 0
            && libc::fcntl(fd, F_SETOWN_EX, &owner as *const OwnerEx) == 0
            && libc::ioctl(fd, PERF_EVENT_IOC_ENABLE as _, 0) == 0
    };
    if !ok {
        let e = errno();
        // SAFETY: our own descriptor, closed once.
        unsafe { libc::close(fd) };
        return Err(e);
    }
    Ok(fd)
}

/// Whether this process may open task-clock events: tries one on the calling thread, counting
/// kernel time first, else user time only. The errno when neither (a seccomp filter,
/// `perf_event_paranoid` above 2, no perf support).
pub fn available(period_ns: u64) -> Result<(), i32> {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::gettid() };
    let probe = |flags| {
        let fd = open_disabled(tid, period_ns, flags)?;
        // SAFETY: our own descriptor, never enabled.
        unsafe { libc::close(fd) };
        Ok::<(), i32>(())
    };
    probe(0)
        .map(|()| EXCLUDE_KERNEL.store(false, Ordering::Relaxed))
        .or_else(|_| {
            probe(FLAG_EXCLUDE_KERNEL).map(|()| EXCLUDE_KERNEL.store(true, Ordering::Relaxed))
        })
}

/// Set when only user-space events may be opened (`perf_event_paranoid` forbids the rest):
/// then a period that ends in a system call is not sampled, and code that makes many of them
/// reads low (a loop reading its thread's CPU clock lost a fifth of its samples).
static EXCLUDE_KERNEL: AtomicBool = AtomicBool::new(false);

fn kernel_flag() -> u64 {
    if EXCLUDE_KERNEL.load(Ordering::Relaxed) {
        FLAG_EXCLUDE_KERNEL
    } else {
        0
    }
}

/// The running engine: its watcher thread and the events it opened.
pub struct Engine {
    stop: Arc<AtomicBool>,
    watcher: Option<JoinHandle<()>>,
    events: Arc<Mutex<HashMap<libc::pid_t, libc::c_int>>>,
}

/// The threads of this process now.
fn threads() -> Vec<libc::pid_t> {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect()
}

impl Engine {
    /// Starts the watcher; the first scan is done before returning, so threads running now are
    /// sampled from the start.
    pub fn start(period_ns: u64) -> Engine {
        let stop = Arc::new(AtomicBool::new(false));
        let events: Arc<Mutex<HashMap<libc::pid_t, libc::c_int>>> = Arc::default();
        scan(&events, period_ns, None);
        let watcher = {
            let (stop, events) = (stop.clone(), events.clone());
            std::thread::Builder::new()
                .name("ferroprof perf".to_owned())
                .spawn(move || {
                    // SAFETY: gettid has no preconditions.
                    let me = unsafe { libc::gettid() };
                    while !stop.load(Ordering::Relaxed) {
                        std::thread::sleep(SCAN_EVERY);
                        scan(&events, period_ns, Some(me));
                    }
                })
                .ok()
        };
        Engine {
            stop,
            watcher,
            events,
        }
    }

    /// Stops the watcher (waiting for it at most `deadline`) and closes every event.
    pub fn stop(mut self, deadline: Duration) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(w) = self.watcher.take() {
            let until = Instant::now() + deadline;
            while !w.is_finished() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(1));
            }
            if w.is_finished() {
                let _ = w.join();
            }
        }
        close_all(&self.events);
    }

    /// In a forked child: the watcher is not in this process and the events watch the parent's
    /// threads. Closes this process's copies of the descriptors; nothing waits for anything.
    /// The watcher may have held the table's lock at the fork: then it is never unlocked here,
    /// and the copies stay open (close-on-exec) rather than the child waiting for it.
    pub fn forget_after_fork(self) {
        if let Ok(mut map) = self.events.try_lock() {
            for (_, fd) in map.drain().filter(|&(_, fd)| fd >= 0) {
                // SAFETY: this process's copy of a descriptor the engine opened.
                unsafe { libc::close(fd) };
            }
        }
        OPEN.store(0, Ordering::Relaxed);
        std::mem::forget(self.watcher);
    }
}

fn close_all(events: &Mutex<HashMap<libc::pid_t, libc::c_int>>) {
    let mut map = lock(events);
    for (_, fd) in map.drain().filter(|&(_, fd)| fd >= 0) {
        // SAFETY: descriptors this engine opened and still holds.
        unsafe { libc::close(fd) };
        OPEN.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Opens events for new threads (all but `skip`) and closes those of ended ones.
fn scan(
    events: &Mutex<HashMap<libc::pid_t, libc::c_int>>,
    period_ns: u64,
    skip: Option<libc::pid_t>,
) {
    let now = threads();
    let mut map = lock(events);
    map.retain(|tid, fd| {
        let alive = now.contains(tid);
        if !alive && *fd >= 0 {
            // SAFETY: our own descriptor, of a thread that ended.
            unsafe { libc::close(*fd) };
            OPEN.fetch_sub(1, Ordering::Relaxed);
        }
        alive
    });
    for tid in now {
        if Some(tid) == skip || map.contains_key(&tid) {
            continue;
        }
        match open(tid, period_ns) {
            Ok(fd) => {
                map.insert(tid, fd);
                OPEN.fetch_add(1, Ordering::Relaxed);
            }
            // A thread that ended meanwhile: nothing to count.
            Err(libc::ESRCH) => {}
            Err(_) => {
                FAILED.fetch_add(1, Ordering::Relaxed);
                // Not tried again for this thread: a placeholder keeps it known.
                map.insert(tid, -1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_forgets_the_engine_while_the_watcher_held_its_table() {
        let events: Arc<Mutex<HashMap<libc::pid_t, libc::c_int>>> = Arc::default();
        let held = events.clone();
        let (locked, release) = (
            Arc::new(std::sync::Barrier::new(2)),
            Arc::new(std::sync::Barrier::new(2)),
        );
        let (l, r) = (locked.clone(), release.clone());
        // The watcher, holding the table as a fork would find it.
        let watcher = std::thread::spawn(move || {
            let _g = held.lock().unwrap();
            l.wait();
            r.wait();
        });
        locked.wait();
        let engine = Engine {
            stop: Arc::new(AtomicBool::new(false)),
            watcher: None,
            events,
        };
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            engine.forget_after_fork();
            done_tx.send(()).unwrap();
        });
        let finished = done_rx.recv_timeout(Duration::from_secs(5)).is_ok();
        release.wait();
        watcher.join().unwrap();
        assert!(finished, "forget_after_fork waited for the watcher's lock");
    }
}
