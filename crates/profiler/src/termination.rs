//! Opt-in ([`crate::ProfilerBuilder::flush_on_termination`]): the last profile is written when
//! the process is asked to terminate by `SIGTERM`, `SIGINT`, `SIGHUP` or `SIGQUIT` (the signals
//! `ferroprof record` forwards to the program it runs).
//!
//! The handler only writes the signal's number to a pipe (async-signal-safe). A profiler thread
//! reading the pipe flushes the profile (bounded by the stop timeout), puts back the disposition
//! the signal had before `start()` (the application's handler, or the default) and raises the
//! signal again: the process then ends, or the application's handler runs, as without
//! ferroprof. A handler the application installs after `start()` replaces ours; such an
//! application calls `flush()` or `stop()` from its own shutdown path.
//!
//! A forked child inherits the handlers but not the thread: until its own profiler threads
//! start, its signals pass through as if ferroprof were not there; when they start, it arms
//! a pipe and a thread of its own ([`rearm_in_child`]).

use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::Arc;

use crate::state::Shared;

const SIGNALS: [libc::c_int; 4] = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP, libc::SIGQUIT];

/// The pipe's write end (-1: not armed) and the pid that armed it; and its read end, which a
/// forked child that arms its own closes (its thread was the parent's).
static PIPE_W: AtomicI32 = AtomicI32::new(-1);
static PIPE_R: AtomicI32 = AtomicI32::new(-1);
static ARMED_PID: AtomicI32 = AtomicI32::new(0);
/// The dispositions before ours, per entry of SIGNALS: (handler, flags).
static PREV_HANDLER: [AtomicUsize; SIGNALS.len()] = [const { AtomicUsize::new(0) }; SIGNALS.len()];
static PREV_FLAGS: [AtomicUsize; SIGNALS.len()] = [const { AtomicUsize::new(0) }; SIGNALS.len()];

extern "C" fn on_termination(sig: libc::c_int) {
    // SAFETY: errno is thread-local; the handler leaves it as it found it.
    let errno = unsafe { *libc::__errno_location() };
    let fd = PIPE_W.load(Ordering::Acquire);
    // SAFETY: getpid has no preconditions.
    let ours = fd >= 0 && unsafe { libc::getpid() } == ARMED_PID.load(Ordering::Acquire);
    if ours {
        let b = sig as u8;
        // SAFETY: a one-byte write from a valid buffer; a full pipe just drops it.
        unsafe { libc::write(fd, &b as *const u8 as *const libc::c_void, 1) };
    } else {
        // A forked child (the pipe is the parent's) or a late signal: as if we were not here.
        restore(sig);
        // SAFETY: raising a signal is async-signal-safe.
        unsafe { libc::raise(sig) };
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

/// Puts back the disposition `sig` had before ours. Async-signal-safe.
fn restore(sig: libc::c_int) {
    let Some(i) = SIGNALS.iter().position(|&s| s == sig) else {
        return;
    };
    // SAFETY: a zeroed sigaction filled with the saved handler and flags.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = PREV_HANDLER[i].load(Ordering::Acquire);
        sa.sa_flags = PREV_FLAGS[i].load(Ordering::Acquire) as libc::c_int;
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(sig, &sa, std::ptr::null_mut());
    }
}

/// Installs the handlers and starts the thread that flushes on a signal; `flush` is what it
/// runs. Returns the thread's handle; [`disarm`] ends it.
pub(crate) fn arm(
    shared: &Arc<Shared>,
    flush: impl Fn() + Send + 'static,
) -> std::io::Result<crate::ownthread::OwnThread<()>> {
    let mut fds = [0 as libc::c_int; 2];
    // SAFETY: a valid two-int array for pipe2's out-parameters.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let (r, w) = (fds[0], fds[1]);
    let stopping = shared.clone();
    let thread = crate::ownthread::spawn("ferroprof-term", 256 << 10, move || {
        crate::threads::enter_profiler_thread();
        let mut b = 0u8;
        loop {
            // SAFETY: a one-byte read into a valid buffer.
            let n = unsafe { libc::read(r, &mut b as *mut u8 as *mut libc::c_void, 1) };
            if n == 1 {
                let sig = libc::c_int::from(b);
                if stopping.stopping.load(Ordering::SeqCst) {
                    restore(sig);
                    // SAFETY: raising a signal has no preconditions.
                    unsafe { libc::raise(sig) };
                    continue;
                }
                log::info!("ferroprof: signal {sig}: writing the last profile before exiting");
                flush();
                restore(sig);
                // SAFETY: as above.
                unsafe { libc::kill(libc::getpid(), sig) };
            } else if n == 0
                || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted
            {
                break;
            }
        }
        // SAFETY: our own descriptor, closed once.
        unsafe { libc::close(r) };
    });
    let thread = match thread {
        Ok(t) => t,
        Err(e) => {
            // SAFETY: our own descriptors, closed once.
            unsafe {
                libc::close(r);
                libc::close(w);
            }
            return Err(e);
        }
    };
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    let inherited = ARMED_PID.swap(pid, Ordering::AcqRel) != pid;
    let (old_w, old_r) = (
        PIPE_W.swap(w, Ordering::AcqRel),
        PIPE_R.swap(r, Ordering::AcqRel),
    );
    if inherited {
        // A forked child arming its own: the parent's pipe is not this process's to use.
        for fd in [old_w, old_r].into_iter().filter(|&fd| fd >= 0) {
            // SAFETY: this process's copies of the parent's descriptors, closed once.
            unsafe { libc::close(fd) };
        }
    }
    for (i, &sig) in SIGNALS.iter().enumerate() {
        // SAFETY: plain sigaction calls on zeroed structs we own.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(sig, std::ptr::null(), &mut old) != 0 {
                continue;
            }
            if old.sa_sigaction == libc::SIG_IGN {
                // Ignored on purpose (e.g. a background job's SIGINT): left so.
                continue;
            }
            if old.sa_sigaction == on_termination as *const () as usize {
                // Already ours (inherited in a forked child): what it replaced stays saved.
                continue;
            }
            PREV_HANDLER[i].store(old.sa_sigaction, Ordering::Release);
            PREV_FLAGS[i].store(old.sa_flags as usize, Ordering::Release);
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_termination as *const () as usize;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(sig, &sa, std::ptr::null_mut());
        }
    }
    Ok(thread)
}

/// In a forked child whose profiler threads start again: arms its own flush on termination
/// when the parent had one (the handlers, inherited, pass the parent's signals through).
pub(crate) fn rearm_in_child(shared: &Arc<Shared>) {
    let Some(flush) = shared.termination_flush.get().cloned() else {
        return;
    };
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    if PIPE_W.load(Ordering::Acquire) < 0 || ARMED_PID.load(Ordering::Acquire) == pid {
        return;
    }
    match arm(shared, move || flush()) {
        Ok(t) => shared.threads.lock().termination = Some(t),
        Err(e) => log::warn!("ferroprof: cannot flush on SIGTERM/SIGINT in this child ({e})"),
    }
}

/// A termination signal that came while the profiler stopped (0: none), raised again by
/// [`release_deferred`].
static DEFERRED: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_termination_deferred(sig: libc::c_int) {
    DEFERRED.store(sig, Ordering::SeqCst);
}

fn current_handler(sig: libc::c_int) -> usize {
    // SAFETY: reads the current disposition into a zeroed struct we own.
    unsafe {
        let mut cur: libc::sigaction = std::mem::zeroed();
        libc::sigaction(sig, std::ptr::null(), &mut cur);
        cur.sa_sigaction
    }
}

/// Ends the thread. Until [`release_deferred`], a termination signal waits: the stop writes
/// the last profile, which a signal taking its course meanwhile would lose (a parent that
/// terminates its workers while they exit: `multiprocessing.Pool`'s `terminate`).
pub(crate) fn disarm(thread: crate::ownthread::OwnThread<()>) {
    for &sig in &SIGNALS {
        if current_handler(sig) == on_termination as *const () as usize {
            // SAFETY: a zeroed sigaction with a handler that only stores to an atomic.
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_termination_deferred as *const () as usize;
                sa.sa_flags = libc::SA_RESTART;
                libc::sigemptyset(&mut sa.sa_mask);
                libc::sigaction(sig, &sa, std::ptr::null_mut());
            }
        }
    }
    PIPE_R.store(-1, Ordering::Release);
    let w = PIPE_W.swap(-1, Ordering::AcqRel);
    if w >= 0 {
        // SAFETY: our own descriptor: closing it ends the thread's read with 0.
        unsafe { libc::close(w) };
    }
    let _ = thread.join();
}

/// After the stop: the dispositions from before the start come back, and a termination signal
/// that came during the stop takes its course now.
pub(crate) fn release_deferred() {
    for &sig in &SIGNALS {
        if current_handler(sig) == on_termination_deferred as *const () as usize {
            restore(sig);
        }
    }
    let sig = DEFERRED.swap(0, Ordering::SeqCst);
    if sig != 0 {
        // SAFETY: sending a signal to this process has no preconditions.
        unsafe { libc::kill(libc::getpid(), sig) };
    }
}
