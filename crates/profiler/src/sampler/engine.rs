//! CPU-time engines: what makes a thread's CPU time raise the sampling signal on that thread.
//!
//! The signal, its handler and the capture slots are shared (`capture.rs`): an engine only arms a
//! thread, so that every period of its CPU time it gets the signal carrying the thread entry's
//! token, and disarms it. The sampler holds one [`Engine`], chosen at start: POSIX CPU timers
//! ([`TimerEngine`], everywhere) or perf task-clock events (`perf.rs`, where the kernel lets
//! the process open them), called through [`CpuEngine`] with static dispatch (an enum).

use super::clock::timespec;

use super::perf::{PerfEngine, PerfEvent};

/// A source of CPU-time signals, armed per thread.
pub(super) trait CpuEngine {
    /// What an armed thread holds until it is disarmed (a timer id, a file descriptor).
    type Armed;

    /// The engine's name, as statistics and logs show it.
    fn name(&self) -> &'static str;

    /// Arms thread `tid` of this process: every `period_ns` of its CPU time it gets signal `sig`
    /// carrying `token`. An error when the kernel refuses (the thread then gets wall samples
    /// only).
    fn arm(
        &mut self,
        tid: i32,
        sig: i32,
        token: u64,
        period_ns: u64,
    ) -> std::io::Result<Self::Armed>;

    /// Stops what `arm` started. No signal of it is raised afterwards; one already pending
    /// may still arrive (the handler checks the token's generation).
    fn disarm(&mut self, armed: Self::Armed);
}

/// POSIX CPU-time timers (`timer_create` on the thread's CPU clock, `SIGEV_THREAD_ID`): work
/// everywhere, checked by the kernel at its scheduler tick.
#[derive(Default)]
pub(super) struct TimerEngine;

/// A timer `TimerEngine` created and has not deleted.
pub(super) struct Timer(libc::timer_t);

impl CpuEngine for TimerEngine {
    type Armed = Timer;

    fn name(&self) -> &'static str {
        "timer"
    }

    fn arm(&mut self, tid: i32, sig: i32, token: u64, period_ns: u64) -> std::io::Result<Timer> {
        // SAFETY: sigevent is plain data; every field the kernel reads is set below.
        let mut ev: libc::sigevent = unsafe { std::mem::zeroed() };
        ev.sigev_notify = libc::SIGEV_THREAD_ID;
        ev.sigev_signo = sig;
        ev.sigev_notify_thread_id = tid;
        ev.sigev_value = libc::sigval {
            sival_ptr: token as usize as *mut libc::c_void,
        };
        let mut id: libc::timer_t = std::ptr::null_mut();
        // The thread's CPU clock, as in `thread_cpu_ns`.
        let clock = ((!(tid as libc::clockid_t)) << 3) | 6;
        // SAFETY: valid sigevent and out-pointer; the kernel checks that `tid` is one of ours.
        if unsafe { libc::timer_create(clock, &mut ev, &mut id) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let ts = timespec(period_ns);
        let spec = libc::itimerspec {
            it_interval: ts,
            it_value: ts,
        };
        // SAFETY: `id` was just created; valid itimerspec.
        if unsafe { libc::timer_settime(id, 0, &spec, std::ptr::null_mut()) } != 0 {
            let err = std::io::Error::last_os_error();
            // SAFETY: as above.
            unsafe { libc::timer_delete(id) };
            return Err(err);
        }
        Ok(Timer(id))
    }

    fn disarm(&mut self, armed: Timer) {
        // SAFETY: a timer this engine created, deleted once (`Timer` is moved in).
        unsafe { libc::timer_delete(armed.0) };
    }
}

/// The engine a sampler uses, chosen at start.
pub(super) enum Engine {
    Timer(TimerEngine),
    Perf(PerfEngine),
}

/// What an [`Engine`] armed.
pub(super) enum Armed {
    Timer(Timer),
    Perf(PerfEvent),
}

impl Engine {
    pub(super) fn new(perf: bool) -> Engine {
        if perf {
            Engine::Perf(PerfEngine)
        } else {
            Engine::Timer(TimerEngine)
        }
    }
}

impl CpuEngine for Engine {
    type Armed = Armed;

    fn name(&self) -> &'static str {
        match self {
            Engine::Timer(e) => e.name(),
            Engine::Perf(e) => e.name(),
        }
    }

    /// A thread the perf engine cannot arm (past `RLIMIT_NOFILE`, or the table's descriptors)
    /// gets a timer instead: its samples land at ticks, but it keeps its CPU samples.
    fn arm(&mut self, tid: i32, sig: i32, token: u64, period_ns: u64) -> std::io::Result<Armed> {
        match self {
            Engine::Timer(e) => e.arm(tid, sig, token, period_ns).map(Armed::Timer),
            Engine::Perf(e) => e
                .arm(tid, sig, token, period_ns)
                .map(Armed::Perf)
                .or_else(|_| {
                    TimerEngine
                        .arm(tid, sig, token, period_ns)
                        .map(Armed::Timer)
                }),
        }
    }

    fn disarm(&mut self, armed: Armed) {
        match (self, armed) {
            (Engine::Timer(e), Armed::Timer(a)) => e.disarm(a),
            (Engine::Perf(e), Armed::Perf(a)) => e.disarm(a),
            // A thread the perf engine could not arm holds a timer.
            (_, Armed::Timer(a)) => TimerEngine.disarm(a),
            (_, Armed::Perf(a)) => PerfEngine.disarm(a),
        }
    }
}
