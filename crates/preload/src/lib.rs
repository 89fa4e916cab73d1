//! `libferroprof_preload.so`: ferroprof injected into a program with `LD_PRELOAD`, as
//! `ferroprof record -- CMD` runs it (see docs/record.md).
//!
//! * `hooks`: `malloc`, `free` and the rest of the C allocation API, over glibc's allocator,
//!   with ferroprof's allocation sampling and live-heap tracking. C++ `new`/`delete` and Rust's
//!   `System` allocator reach them through `malloc`.
//! * A constructor starts the profiler with the settings of the environment (`FERROPROF_*`, as
//!   `ProfilerBuilder::from_env` reads them), after checking that this library's thread-locals
//!   are in the static TLS block (what makes them safe to read in the malloc hook and the
//!   sampling signal handler; see `tls_check`).
//! * Profiles go to `FERROPROF_OUTPUT_DIR` (default `./profiles`) as
//!   `<command>.<pid>.<n>.pprof`: every process (forked or exec'd children too) writes its own.
//! * The last profile is written at exit (`exit()` from any thread, or a return from `main`:
//!   an `atexit` handler; not from a signal handler, see `exit_handler`) and on `SIGTERM`,
//!   `SIGINT`, `SIGHUP` and `SIGQUIT` (the profiler's flush on termination), after which the
//!   signal takes its course, at `_exit` (outside signal handlers: [`_exit`], interposed), and
//!   before an `exec`
//!   (`exec`: the exec family, interposed; the new image gets the library and the settings
//!   even when the program passes an environment without them). `posix_spawn`, `posix_spawnp`,
//!   `system` and `popen` give their child the same (`spawn`).

mod exec;
mod exporter;
mod forksafe;
mod hooks;
mod progress;
mod spawn;
mod tls_check;

use std::sync::Mutex;

use ferroprof::{Profiler, ProfilerGuard};

/// The running profiler, stopped by [`at_exit`].
static GUARD: Mutex<Option<ProfilerGuard>> = Mutex::new(None);
/// The process that started the profiler (a forked child differs).
static STARTED_PID: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);
/// Whether GUARD holds a profiler: read before locking GUARD on the exec path, which a forked
/// child may take (a lock held by another thread at the fork would never be released there).
static RUNNING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// Whether the exit handler is registered (once, though a failed exec starts the profiler again).
static AT_EXIT_SET: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Run by the dynamic loader when the library is loaded, before the program's `main`.
#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;

extern "C" fn init() {
    hooks::init();
    // A panic must not unwind into the loader (nor abort the program): profiling just stays off.
    if std::panic::catch_unwind(|| {
        exec::init();
        spawn::init();
    })
    .is_err()
    {
        eprintln!("ferroprof: internal error while starting; exec'd programs may run unprofiled");
    }
    if std::panic::catch_unwind(start).is_err() {
        eprintln!("ferroprof: internal error while starting; the program runs unprofiled");
    }
}

fn start() {
    if let Err(why) = tls_check::check() {
        eprintln!("ferroprof: not profiling: {why} (see docs/record.md)");
        return;
    }
    // `free` has no size to give an arena block back with: symbolization uses the heap.
    ferroprof::internals::__disable_arena();
    let dir = std::env::var_os("FERROPROF_OUTPUT_DIR")
        .filter(|d| !d.is_empty())
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| "./profiles".into());
    // Made absolute now: the program may change its working directory before it writes.
    let dir = std::path::absolute(&dir).unwrap_or(dir);
    let exporter = match exporter::PerProcessFiles::new(dir) {
        Ok(e) => e,
        Err(e) => {
            eprintln!("ferroprof: not profiling: {e}");
            return;
        }
    };
    let service = exporter::command_name();
    // Under `record`, profiles are written plain and `record` gzips them once the program
    // ended: a gzip stream costs a short process more than encoding its profile does.
    let compression = if std::env::var_os(exporter::SUMMARY_ENV).is_some() {
        ferroprof::recorder::Compression::None
    } else {
        ferroprof::recorder::Compression::Gzip
    };
    let started = Profiler::builder()
        .compression(compression)
        .service(service)
        .flush_on_termination(true)
        // Started with the process: the loader's and the constructors' CPU is the program's.
        .cpu_before_start(true)
        // Every CPU nanosecond of the process in its profiles, the profiler's own included.
        .book_own_cpu(true)
        .exporter(Box::new(exporter))
        // The exporter writes the directory: no second, `DirExporter`-named copy.
        .from_vars(|k| {
            (k != "FERROPROF_OUTPUT_DIR")
                .then(|| std::env::var(k).ok())
                .flatten()
        })
        .start();
    match started {
        Ok(guard) => {
            *GUARD.lock().unwrap_or_else(|e| e.into_inner()) = Some(guard);
            RUNNING.store(true, std::sync::atomic::Ordering::SeqCst);
            // SAFETY: getpid has no preconditions.
            STARTED_PID.store(
                unsafe { libc::getpid() },
                std::sync::atomic::Ordering::SeqCst,
            );
            // SAFETY: registers a function of the right type; runs at `exit()` from any thread.
            if !AT_EXIT_SET.swap(true, std::sync::atomic::Ordering::SeqCst)
                && unsafe { libc::atexit(exit_handler) } != 0
            {
                eprintln!("ferroprof: cannot register the exit handler: no profile at exit");
            }
            if let Some(dir) = std::env::var_os(progress::ENV).filter(|d| !d.is_empty()) {
                progress::start(dir.into(), || {
                    GUARD
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .as_ref()
                        .map(|g| g.stats())
                });
            }
        }
        Err(e) => eprintln!("ferroprof: not profiling: {e}"),
    }
}

/// Takes the running profiler out of GUARD. In a forked child the lock may have been held at
/// the fork by a thread that does not exist there (the progress writer reads the counters under
/// it) and would never be released: a forked child gives up on a lock it cannot take.
fn take_guard() -> Option<ProfilerGuard> {
    // SAFETY: getpid has no preconditions.
    let forked = unsafe { libc::getpid() } != STARTED_PID.load(std::sync::atomic::Ordering::SeqCst);
    let mut held = if forked {
        match GUARD.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                eprintln!(
                    "ferroprof: the profiler is held by a thread lost in the fork: no profile"
                );
                return None;
            }
        }
    } else {
        GUARD.lock().unwrap_or_else(|e| e.into_inner())
    };
    RUNNING.store(false, std::sync::atomic::Ordering::SeqCst);
    held.take()
}

/// The `atexit` handler. `exit()` is not async-signal-safe, but programs call it from signal
/// handlers anyway (a timeout's `SIGALRM`, a `SIGINT` handler): one that interrupted `malloc`
/// or the profiler's own recording holds a lock that writing the profile needs, and `exit`
/// would wait for it for ever. There, as at `_exit`, the process ends without a profile.
extern "C" fn exit_handler() {
    if RUNNING.load(std::sync::atomic::Ordering::SeqCst) && in_signal_handler_or_unknown() {
        const NOTE: &[u8] =
            b"ferroprof: exit() in a signal handler: no last profile (see docs/record.md)\n";
        // SAFETY: write(2) of a static buffer; async-signal-safe, unlike eprintln's lock.
        unsafe { libc::write(2, NOTE.as_ptr().cast(), NOTE.len()) };
        return;
    }
    at_exit();
}

/// Whether this thread runs a signal handler, true when that cannot be told: writing there
/// may hang, skipping costs one profile. The check answers None when every unwinder spare
/// is busy (other threads' samples, for microseconds): asked again a few times first, so a
/// plain `exit()` among busy threads still writes. Async-signal-safe.
fn in_signal_handler_or_unknown() -> bool {
    for _ in 0..20 {
        if let Some(answer) = ferroprof::internals::__in_signal_handler() {
            return answer;
        }
        let pause = libc::timespec {
            tv_sec: 0,
            tv_nsec: 1_000_000,
        };
        // SAFETY: nanosleep with a valid duration and no remainder pointer.
        unsafe { libc::nanosleep(&pause, std::ptr::null_mut()) };
    }
    true
}

fn at_exit() {
    progress::stop();
    let stop = || {
        let Some(guard) = take_guard() else { return };
        // SAFETY: getpid has no preconditions.
        let pid = unsafe { libc::getpid() };
        if pid != STARTED_PID.load(std::sync::atomic::Ordering::SeqCst) {
            // A forked child whose profiler threads never resumed (it never had an allocation
            // sampled): started now so the last profile has a thread to write it.
            ferroprof::after_fork();
        }
        if let Err(e) = guard.stop_at_exit() {
            eprintln!("ferroprof: the last profile: {e}");
        }
    };
    if std::panic::catch_unwind(stop).is_err() {
        eprintln!("ferroprof: internal error while writing the last profile");
    }
}

/// `_exit` and `_Exit`: they end the process without exit handlers, so the last profile is
/// written here (dash ends so, and every worker Python's `multiprocessing` forks), then the
/// process ends as the program asked. Nothing is written in a `vfork` child (the profiler is
/// its parent's), in a forked child that used under a millisecond of CPU
/// and never restarted its profiler, or in a signal handler: one that
/// interrupted `malloc` holds the allocator's lock, which writing a profile would wait for
/// for ever. There the process just ends, as without ferroprof.
fn before_quick_exit() {
    if !RUNNING.load(std::sync::atomic::Ordering::SeqCst)
        || exec::in_vfork_child()
        || (ferroprof::internals::__restart_pending() && !child_computed())
        || ferroprof::internals::__in_signal_handler() != Some(false)
    {
        return;
    }
    at_exit();
}

/// Whether a forked child whose profiler threads never started used enough CPU to be worth a
/// profile (its CPU timer caught it: a `multiprocessing` worker ends with `_exit`), as opposed
/// to one that ends at once (a failed exec's `_exit(127)`).
fn child_computed() -> bool {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer.
    let ok = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) } == 0;
    ok && (ts.tv_sec > 0 || ts.tv_nsec >= 1_000_000)
}

fn quick_exit(status: libc::c_int) -> ! {
    before_quick_exit();
    loop {
        // SAFETY: exit_group ends every thread of the process; it does not return.
        unsafe { libc::syscall(libc::SYS_exit_group, status) };
    }
}

/// # Safety
/// The C `_exit` contract.
#[no_mangle]
pub unsafe extern "C" fn _exit(status: libc::c_int) -> ! {
    quick_exit(status)
}

/// # Safety
/// The C `_Exit` contract.
#[no_mangle]
pub unsafe extern "C" fn _Exit(status: libc::c_int) -> ! {
    quick_exit(status)
}

/// Before an exec, in a process with a profile of its own: stops the profiler, which writes
/// its last profile. True when it was running (see [`restart_after_failed_exec`]).
pub(crate) fn stop_for_exec() -> bool {
    if !RUNNING.load(std::sync::atomic::Ordering::SeqCst) {
        return false;
    }
    let stop = || {
        let Some(guard) = take_guard() else {
            return false;
        };
        progress::stop();
        let signal = guard.stats().signal;
        if let Err(e) = guard.stop_at_exit() {
            eprintln!("ferroprof: the profile before exec: {e}");
        }
        exec::drain_signal(signal);
        true
    };
    std::panic::catch_unwind(stop).unwrap_or_else(|_| {
        eprintln!("ferroprof: internal error while writing the profile before exec");
        false
    })
}

/// After an exec that failed (returned): the process goes on, profiled again from here.
pub(crate) fn restart_after_failed_exec() {
    if std::panic::catch_unwind(start).is_err() {
        eprintln!("ferroprof: internal error while restarting after a failed exec");
    }
}
