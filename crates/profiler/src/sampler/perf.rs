//! The perf-event CPU engine: per thread a software task-clock event of the sampling period,
//! user space only, whose every overflow sends our signal to that thread (`F_SETSIG`,
//! `F_SETOWN_EX` with `F_OWNER_TID`). The task clock runs on a high-resolution timer, so a
//! sample lands at the CPU instant its period ends, where POSIX CPU timers wait for the
//! scheduler tick. The event stays armed: nothing to re-arm in the handler.
//!
//! The signal carries the event's file descriptor, not a token: a table indexed by descriptor
//! gives the handler the thread entry's token (atomics only).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::engine::CpuEngine;

/// Descriptors above this get no event (the thread gets wall samples only, counted): the
/// table is 512 KiB of zero pages, touched only where descriptors are used.
const MAX_FDS: usize = 1 << 16;

/// The token of each descriptor's event; 0 for a descriptor that is not one of ours.
static TOKENS: [AtomicU64; MAX_FDS] = [const { AtomicU64::new(0) }; MAX_FDS];
/// One past the highest descriptor ever given a token (bounds the scan after a fork).
static HIGH: AtomicUsize = AtomicUsize::new(0);

use crate::perf_abi::{
    PerfEventAttr, COUNT_SW_TASK_CLOCK, FLAG_DISABLED, FLAG_EXCLUDE_HV, FLAG_EXCLUDE_KERNEL,
    IOC_DISABLE as PERF_EVENT_IOC_DISABLE, IOC_ENABLE as PERF_EVENT_IOC_ENABLE, TYPE_SOFTWARE,
};

/// `struct f_owner_ex`.
#[repr(C)]
struct OwnerEx {
    kind: libc::c_int,
    pid: libc::pid_t,
}
const F_OWNER_TID: libc::c_int = 0;
/// fcntl commands, the same on every Linux architecture (asm-generic/fcntl.h).
const F_SETOWN_EX: libc::c_int = 15;
const F_SETSIG: libc::c_int = 10;

/// Events open now (each holds a descriptor of the application's `RLIMIT_NOFILE`).
static OPEN: AtomicUsize = AtomicUsize::new(0);

/// Perf events open now: one per thread the perf engine armed.
pub(crate) fn open_events() -> u64 {
    OPEN.load(Ordering::Relaxed) as u64
}

/// Most events open at once: a quarter of the soft `RLIMIT_NOFILE` (the application's
/// descriptors come first; past this, threads get timers), at most the table's size.
fn budget() -> usize {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return 0;
    }
    usize::try_from(lim.rlim_cur / 4)
        .unwrap_or(MAX_FDS)
        .min(MAX_FDS)
}

/// Perf events, one per armed thread.
#[derive(Default)]
pub(super) struct PerfEngine;

/// An event `PerfEngine` opened: its descriptor, and the process that opened it (a forked
/// child's copy of the descriptor shares the parent's event: it is closed, never disabled).
pub(super) struct PerfEvent {
    fd: libc::c_int,
    pid: u32,
}

/// Opens a task-clock event on thread `tid` with period `period_ns`, disabled; the descriptor
/// or the kernel's error.
fn open(tid: i32, period_ns: u64) -> std::io::Result<libc::c_int> {
    let attr = PerfEventAttr {
        kind: TYPE_SOFTWARE,
        config: COUNT_SW_TASK_CLOCK,
        sample_period: period_ns.max(1),
        flags: FLAG_DISABLED | FLAG_EXCLUDE_KERNEL | FLAG_EXCLUDE_HV,
        wakeup_events: 1,
        ..PerfEventAttr::default()
    };
    // A thread of ours, any CPU.
    crate::perf_abi::open(&attr, tid, -1)
}

/// Whether this process may open a perf task-clock event on its own threads: an error names
/// why not (`perf_event_paranoid`, a seccomp filter, no perf support).
pub(crate) fn probe() -> std::io::Result<()> {
    let fd = open(crate::threads::current_tid(), 10_000_000)?;
    // SAFETY: our own descriptor, just opened.
    unsafe { libc::close(fd) };
    Ok(())
}

impl CpuEngine for PerfEngine {
    type Armed = PerfEvent;

    fn name(&self) -> &'static str {
        "perf"
    }

    fn arm(
        &mut self,
        tid: i32,
        sig: i32,
        token: u64,
        period_ns: u64,
    ) -> std::io::Result<PerfEvent> {
        // Counted before the open: two samplers never run at once, but a child's may start
        // while the parent's events are being closed.
        if OPEN.fetch_add(1, Ordering::AcqRel) >= budget() {
            OPEN.fetch_sub(1, Ordering::AcqRel);
            return Err(std::io::Error::from_raw_os_error(libc::EMFILE));
        }
        let fd = match open(tid, period_ns) {
            Ok(fd) => fd,
            Err(e) => {
                OPEN.fetch_sub(1, Ordering::AcqRel);
                return Err(e);
            }
        };
        let event = PerfEvent {
            fd,
            pid: std::process::id(),
        };
        let fail = |event: PerfEvent, err: std::io::Error| {
            // SAFETY: our own descriptor, never enabled.
            unsafe { libc::close(event.fd) };
            OPEN.fetch_sub(1, Ordering::AcqRel);
            Err(err)
        };
        let Some(slot) = usize::try_from(fd).ok().and_then(|i| TOKENS.get(i)) else {
            return fail(event, std::io::Error::from_raw_os_error(libc::EMFILE));
        };
        slot.store(token, Ordering::Release);
        HIGH.fetch_max(fd as usize + 1, Ordering::AcqRel);
        let owner = OwnerEx {
            kind: F_OWNER_TID,
            pid: tid,
        };
        // SAFETY: fcntl and ioctl on our own descriptor with valid arguments.
        let ok = unsafe {
            libc::fcntl(fd, F_SETOWN_EX, &owner as *const OwnerEx) == 0
                && libc::fcntl(fd, F_SETSIG, sig) == 0
                && libc::fcntl(fd, libc::F_SETFL, libc::O_ASYNC) == 0
                && libc::ioctl(fd, PERF_EVENT_IOC_ENABLE, 0) == 0
        };
        if !ok {
            let err = std::io::Error::last_os_error();
            slot.store(0, Ordering::Release);
            return fail(event, err);
        }
        Ok(event)
    }

    fn disarm(&mut self, event: PerfEvent) {
        if event.pid == std::process::id() {
            // SAFETY: our own descriptor and event.
            unsafe { libc::ioctl(event.fd, PERF_EVENT_IOC_DISABLE, 0) };
        }
        if let Some(slot) = usize::try_from(event.fd).ok().and_then(|i| TOKENS.get(i)) {
            slot.store(0, Ordering::Release);
        }
        // SAFETY: the descriptor this event owns, closed once (`PerfEvent` is moved in).
        unsafe { libc::close(event.fd) };
        OPEN.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The token of the event whose overflow signal carries descriptor `fd`; None when it is not
/// one of ours. Async-signal-safe: one atomic load.
pub(super) fn token_of(fd: i32) -> Option<u64> {
    let t = TOKENS
        .get(usize::try_from(fd).ok()?)?
        .load(Ordering::Acquire);
    (t != 0).then_some(t)
}

/// In a forked child: the descriptors of the parent's events are copies that would keep
/// them open (and the child's thread entries are gone): closed. Async-signal-safe.
pub(crate) fn after_fork_in_child() {
    let high = HIGH.load(Ordering::Acquire).min(MAX_FDS);
    for (fd, slot) in TOKENS[..high].iter().enumerate() {
        if slot.swap(0, Ordering::AcqRel) != 0 {
            // SAFETY: a descriptor the parent's engine opened, inherited by this child.
            unsafe { libc::close(fd as libc::c_int) };
        }
    }
    OPEN.store(0, Ordering::Release);
}
