//! Forked workers never hang on a lock of the profiler that a parent thread held at the moment
//! of the fork.
//!
//! * For every lock the profiler's threads or API take, a thread of the parent holds it, and
//!   another waits for it, while the main thread forks; the child then runs every path that
//!   takes it (restart, a CPU capture, a flush, stop).
//! * A pre-fork server: the parent has thousands of mappings, creates threads and loads and
//!   unloads a library all the time (so its sampler rebuilds its unwinding snapshot, under a
//!   lock, again and again) and forks workers that allocate, then stop their profiler.
//!
//! A child that hangs is ended by its alarm and counted as hung. The default run forks 20
//! workers; `FERROPROF_PREFORK_WORKERS` sets another count (`scripts/reliability.sh` runs 60).

use std::alloc::System;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use ferroprof::{Profiler, ProfilerGuard, Profiles, SamplingAllocator};

/// Only one profiler runs per process: the tests of this file take turns.
fn one_profiler_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

#[global_allocator]
static GLOBAL: SamplingAllocator<System> = SamplingAllocator::new(System);

/// Seconds a child may take before its alarm ends it (it needs about a second; more
/// when it must build its symbolizer afresh in a debug build).
const CHILD_ALARM_SECS: u32 = 60;

fn start(dir: &std::path::Path) -> ProfilerGuard {
    Profiler::builder()
        .cpu_hz(1000)
        .alloc_interval_bytes(16 * 1024)
        .period(Duration::from_secs(600))
        .profiles(Profiles::all())
        .output_dir(dir)
        .start()
        .expect("profiler starts")
}

#[inline(never)]
fn allocate_for(d: Duration) -> u64 {
    let end = Instant::now() + d;
    let mut kept: Vec<Vec<u64>> = Vec::new();
    let mut n = 0u64;
    while Instant::now() < end {
        let v = vec![n; 1024];
        n = n.wrapping_add(v[7]).wrapping_add(1);
        kept.push(v);
        if kept.len() > 64 {
            kept.swap_remove((n % 64) as usize);
        }
    }
    n
}

/// Forks; the child runs `body` under its alarm and leaves with its result as exit code.
fn fork_child(guard: &ProfilerGuard, body: impl FnOnce(ProfilerGuard) -> i32) -> libc::pid_t {
    // SAFETY: the child runs only the profiler, the allocator and the code below (no lock of
    // the test harness), then leaves with _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: alarm only arms a timer; its default action ends a child that hangs.
        unsafe { libc::alarm(CHILD_ALARM_SECS) };
        // SAFETY: moves the child's copy of the guard into its code path; the parent keeps its
        // own copy in its own memory.
        let guard = unsafe { std::ptr::read(guard) };
        let code =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(guard))).unwrap_or(100);
        // SAFETY: leave without the harness's exit path (its threads are not here).
        unsafe { libc::_exit(code) };
    }
    pid
}

/// How a child ended: None when fine, else a description.
fn reap(pid: libc::pid_t) -> Option<String> {
    let mut status = 0;
    // SAFETY: waiting for our own child (its alarm bounds the wait).
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    if libc::WIFSIGNALED(status) {
        let sig = libc::WTERMSIG(status);
        Some(if sig == libc::SIGALRM {
            format!("hung (ended by its {CHILD_ALARM_SECS} s alarm)")
        } else {
            format!("died from signal {sig}")
        })
    } else if libc::WEXITSTATUS(status) != 0 {
        Some(format!("exited with {}", libc::WEXITSTATUS(status)))
    } else {
        None
    }
}

/// Everything a child does that takes the profiler's locks.
fn use_every_lock(guard: ProfilerGuard) -> i32 {
    // Threads lock; the new sampler refreshes its snapshot (retired snapshots' lock).
    ferroprof::after_fork();
    std::hint::black_box(allocate_for(Duration::from_millis(50)));
    // Taps (a capture adds and removes one; samples read them), the symbolizer.
    if guard
        .profile_source()
        .cpu_profile(Duration::from_millis(50))
        .is_err()
    {
        return 2;
    }
    // Serialization, symbolizer, exporters.
    if guard.flush().is_err() {
        return 3;
    }
    if guard.profile_source().heap_profile().is_err() {
        return 4;
    }
    if guard.stop().is_err() {
        return 5;
    }
    0
}

#[test]
fn a_child_forked_while_each_profiler_lock_is_held_never_hangs() {
    let _one = one_profiler_at_a_time();
    let dir = std::env::temp_dir().join(format!("ferroprof-prefork-locks-{}", std::process::id()));
    let guard = start(&dir);
    std::thread::sleep(Duration::from_millis(100));
    // Warms the symbolizer the children inherit (unless forked with its lock held).
    guard.flush().expect("parent flushes");
    let mut failures = Vec::new();
    for &name in ferroprof::internals::__LOCKS {
        let (held_tx, held_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            ferroprof::internals::__hold_lock(name, move || {
                let _ = held_tx.send(());
                let _ = release_rx.recv();
            })
        });
        held_rx.recv().expect("the lock is held");
        // A thread asleep on the lock at the fork: the child must not hand the lock to it.
        let waiter = std::thread::spawn(move || ferroprof::internals::__hold_lock(name, || {}));
        std::thread::sleep(Duration::from_millis(50));
        let pid = fork_child(&guard, use_every_lock);
        release_tx.send(()).unwrap();
        assert!(holder.join().unwrap(), "lock {name} held");
        assert!(waiter.join().unwrap(), "lock {name} taken after the fork");
        if let Some(what) = reap(pid) {
            failures.push(format!("forked with {name} held: child {what}"));
        }
    }
    guard.stop().expect("parent stops");
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "{} locks forked over, failures: {failures:?}",
        ferroprof::internals::__LOCKS.len()
    );
    assert!(failures.is_empty(), "{failures:#?}");
}

/// glibc's `fork` does not reset the lock `dl_iterate_phdr` holds; the profiler's threads walk
/// the loader's list often (the sampler checks it for new objects at every tick). A child forked
/// while one of them is inside must still be able to walk it: its profiler's threads and its
/// own unwinder do.
#[test]
fn a_child_forked_while_the_profiler_walks_the_loaders_list_never_hangs() {
    let _one = one_profiler_at_a_time();
    let dir = std::env::temp_dir().join(format!("ferroprof-prefork-walk-{}", std::process::id()));
    let guard = start(&dir);
    guard.flush().expect("parent flushes");
    let (inside_tx, inside_rx) = mpsc::channel();
    let walker = std::thread::spawn(move || {
        ferroprof::internals::__walk_loader(move || {
            let _ = inside_tx.send(());
            // Long enough that the fork below starts while this walk is under way.
            std::thread::sleep(Duration::from_millis(300));
        })
    });
    inside_rx.recv().expect("the walk started");
    let pid = fork_child(&guard, use_every_lock);
    walker.join().unwrap();
    let what = reap(pid);
    guard.stop().expect("parent stops");
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(what, None, "forked during a walk of the loader's list");
}

fn workers() -> usize {
    std::env::var("FERROPROF_PREFORK_WORKERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20)
}

/// Maps `n` small regions that do not merge (alternating protections): the sampler's snapshot
/// reads every mapping, so each rebuild holds its lock longer.
fn many_mappings(n: usize) -> Vec<(usize, usize)> {
    let page = 4096;
    (0..n)
        .filter_map(|i| {
            let prot = if i % 2 == 0 {
                libc::PROT_READ
            } else {
                libc::PROT_READ | libc::PROT_WRITE
            };
            // SAFETY: a fresh anonymous mapping; unmapped at the end of the test.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    page,
                    prot,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            (p != libc::MAP_FAILED).then_some((p as usize, page))
        })
        .collect()
}

#[test]
fn prefork_workers_stop_while_the_parent_creates_threads_and_loads_libraries() {
    let _one = one_profiler_at_a_time();
    let dir = std::env::temp_dir().join(format!("ferroprof-prefork-{}", std::process::id()));
    let maps = many_mappings(4000);
    let guard = start(&dir);
    let stop = Arc::new(AtomicBool::new(false));
    // Threads come and go: each new one makes the sampler refresh its snapshot.
    let spawner = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                let t = std::thread::spawn(|| allocate_for(Duration::from_millis(2)));
                let _ = t.join();
            }
        })
    };
    // Libraries loaded (each changes the loaded objects: the snapshot is rebuilt) and mappings
    // made and unmapped all the time. Libraries stay loaded: unloading one while sampling is a
    // different hazard, tested on its own.
    let loader = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let libs = [
                c"libresolv.so.2",
                c"libanl.so.1",
                c"libutil.so.1",
                c"libnss_files.so.2",
            ];
            let mut loaded = 0;
            while !stop.load(Ordering::Relaxed) {
                if let Some(lib) = libs.get(loaded) {
                    // SAFETY: glibc libraries with no constructors of note, never unloaded.
                    unsafe { libc::dlopen(lib.as_ptr(), libc::RTLD_NOW) };
                    loaded += 1;
                }
                let more = many_mappings(200);
                std::thread::sleep(Duration::from_millis(10));
                for (p, len) in more {
                    // SAFETY: mapped just above, unused.
                    unsafe { libc::munmap(p as *mut libc::c_void, len) };
                }
            }
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    // A first export warms the symbolizer, which the workers inherit (a cold one costs each
    // worker seconds in a debug build).
    let t = Instant::now();
    guard.flush().expect("parent flushes");
    println!("parent's first flush: {:.2} s", t.elapsed().as_secs_f64());
    let n = workers();
    let mut pids = Vec::new();
    for _ in 0..n {
        pids.push(fork_child(&guard, |guard| {
            // A worker: serves (allocates) for a moment, then stops its profiler.
            std::hint::black_box(allocate_for(Duration::from_millis(100)));
            if guard.stop().is_err() {
                return 5;
            }
            0
        }));
        std::thread::sleep(Duration::from_millis(15));
    }
    let failures: Vec<String> = pids
        .into_iter()
        .enumerate()
        .filter_map(|(i, pid)| reap(pid).map(|w| format!("worker {i}: {w}")))
        .collect();
    stop.store(true, Ordering::Relaxed);
    spawner.join().unwrap();
    loader.join().unwrap();
    let stats = guard.stats();
    guard.stop().expect("parent stops");
    for (p, len) in maps {
        // SAFETY: mapped above, unused since.
        unsafe { libc::munmap(p as *mut libc::c_void, len) };
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "pre-fork: {n} workers, {} failed: {failures:?}; parent {} snapshot builds",
        failures.len(),
        stats.snapshot_builds
    );
    assert!(
        failures.is_empty(),
        "{} of {n} workers: {failures:#?}",
        failures.len()
    );
}
