//! Forking while the profiler is busy: threads allocate heavily (every sampled allocation takes
//! recorder locks, every free of a tracked block too), the CPU sampler runs at 1 kHz and the
//! export loop serializes every 50 ms, and the main thread forks again and again. Each child must
//! keep profiling with fresh profiles and never hang on a lock some parent thread held at the
//! moment of the fork; the parent must be unaffected.
//!
//! A child that hangs is killed by its own alarm (SIGALRM) and reported as such. The default test
//! forks 8 times; `FERROPROF_FORKS` sets another count (`scripts/reliability.sh signals` uses it
//! for the long run).

mod profiler_support;

use std::alloc::System;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use std::path::{Path, PathBuf};

use ferroprof::export::{ExportError, ExportedProfile, Exporter};
use ferroprof::{Profiler, Profiles, SamplingAllocator};
use ferroprof_pprof::Profile;
use profiler_support::*;

#[global_allocator]
static GLOBAL: SamplingAllocator<System> = SamplingAllocator::new(System);

/// Seconds a child may take before its alarm kills it (it needs well under one).
const CHILD_ALARM_SECS: u32 = 30;

/// Allocation churn: blocks of varied sizes, a rolling live set, contents checked before free.
#[inline(never)]
fn churn(stop: &AtomicBool, seed: u64) -> u64 {
    let mut live: Vec<Vec<u64>> = Vec::new();
    let mut x = seed | 1;
    let mut checked = 0u64;
    while !stop.load(Ordering::Relaxed) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let len = 1 + (x % 2048) as usize;
        let v: Vec<u64> = (0..len as u64).map(|i| i ^ x).collect();
        live.push(v);
        if live.len() > 64 {
            let v = live.swap_remove((x % 64) as usize);
            let first = v[0];
            assert!(
                v.iter().enumerate().all(|(i, &e)| e ^ i as u64 == first),
                "block contents changed"
            );
            checked += 1;
        }
    }
    checked
}

/// `d` of the child's own CPU (its CPU time must show up, while the parent's threads still
/// churn next to it).
#[inline(never)]
fn child_work(d: Duration) -> u64 {
    let end = thread_cpu() + d;
    let mut kept = Vec::new();
    let mut n = 0u64;
    while thread_cpu() < end {
        // Allocates (sampled, tracked) and frees (untracked) in the child.
        let v = vec![n; 4096];
        n = n.wrapping_add(v.iter().fold(1u64, |a, &b| a.wrapping_add(b)));
        kept.push(v);
        if kept.len() > 32 {
            kept.remove(0);
        }
    }
    n
}

/// Writes every profile to `<dir>/<pid>-<n>.pprof`: no state shared across the fork but files, so
/// parent and child can each read their own (an in-memory collector behind a mutex could be
/// caught locked by the fork, a test artifact rather than a profiler bug).
struct PidFiles {
    dir: PathBuf,
    n: u64,
}

impl Exporter for PidFiles {
    fn name(&self) -> &str {
        "pid-files"
    }

    fn export(&mut self, profile: &ExportedProfile) -> Result<(), ExportError> {
        let path = self
            .dir
            .join(format!("{}-{}.pprof", std::process::id(), self.n));
        self.n += 1;
        std::fs::write(&path, &profile.encoded.bytes).map_err(|source| ExportError::Io {
            path: path.display().to_string(),
            source,
        })
    }
}

/// The profiles this process exported, decoded.
fn own_profiles(dir: &Path) -> Vec<Profile> {
    let prefix = format!("{}-", std::process::id());
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).expect("profile dir") {
        let path = e.expect("entry").path();
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        if name.starts_with(&prefix) {
            let bytes = std::fs::read(&path).expect("profile file");
            out.push(ferroprof_pprof::decode(&bytes).expect("exported profile decodes"));
        }
    }
    out
}

/// Runs in the forked child; returns the exit code (0 = fine).
fn child(guard: ferroprof::ProfilerGuard, dir: &Path) -> i32 {
    // SAFETY: alarm only arms a timer; its default action ends a child that hangs.
    unsafe { libc::alarm(CHILD_ALARM_SECS) };
    std::hint::black_box(child_work(Duration::from_millis(300)));
    // A profile every 50 ms: on a loaded machine the export thread may find the exporter still
    // holding HANDOFF_CAPACITY profiles and drop the flushed one (counted). Flushed again then;
    // any other failure, or drops that go on, fail the child.
    let mut attempts = 0;
    loop {
        let dropped = guard.stats().export_dropped;
        let Err(e) = guard.flush() else { break };
        attempts += 1;
        if guard.stats().export_dropped == dropped || attempts == 10 {
            eprintln!(
                "child {}: flush {attempts}: {e}; {dropped} dropped before; {:?}",
                std::process::id(),
                guard.stats()
            );
            return 2;
        }
    }
    if guard.stop().is_err() {
        return 3;
    }
    let mine = own_profiles(dir);
    // Fresh profiles: the child's own work shows up; the parent's churn (which ran only in the
    // parent's threads, not copied into the child) does not.
    let child_cpu = sum_all(&mine, "cpu-time", |p, s| has_fn(p, s, "child_work"));
    let parent_churn = sum_all(&mine, "cpu-time", |p, s| has_fn(p, s, "churn"));
    if mine.is_empty() || child_cpu == 0 {
        return 5;
    }
    if parent_churn != 0 {
        return 6;
    }
    0
}

fn forks() -> usize {
    std::env::var("FERROPROF_FORKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8)
}

#[test]
fn children_forked_under_load_keep_profiling_without_inherited_locks() {
    let dir = temp_dir("fork-stress");
    let guard = Profiler::builder()
        .cpu_hz(1000)
        .alloc_interval_bytes(16 * 1024)
        .period(Duration::from_millis(50))
        .profiles(Profiles::all())
        .exporter(Box::new(PidFiles {
            dir: dir.clone(),
            n: 0,
        }))
        .start()
        .expect("profiler starts");
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..4u64)
        .map(|i| {
            let stop = stop.clone();
            std::thread::spawn(move || churn(&stop, 0x9e37_79b9 + i))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));

    let n = forks();
    let mut failures = Vec::new();
    for round in 0..n {
        // SAFETY: the child runs only the profiler, the allocator and this test's code (no locks
        // of the test harness), then leaves with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            // SAFETY: ptr::read moves the guard into the child's code path; the parent's copy of
            // the memory is a different process.
            let guard = unsafe { std::ptr::read(&guard) };
            // A panic must not unwind into the test harness's code in the child.
            let code =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| child(guard, &dir)))
                    .unwrap_or(7);
            // SAFETY: leave without the harness's exit path (its threads are not here).
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        if libc::WIFSIGNALED(status) {
            let sig = libc::WTERMSIG(status);
            failures.push(if sig == libc::SIGALRM {
                format!("fork {round}: child hung (killed by its {CHILD_ALARM_SECS}s alarm)")
            } else {
                format!("fork {round}: child died from signal {sig}")
            });
        } else if libc::WEXITSTATUS(status) != 0 {
            failures.push(format!(
                "fork {round}: child exited with {}",
                libc::WEXITSTATUS(status)
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }

    stop.store(true, Ordering::Relaxed);
    let checked: u64 = workers.into_iter().map(|w| w.join().unwrap()).sum();
    let stats = guard.stats();
    guard.stop().expect("parent stops");
    let ps = own_profiles(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    let churn_cpu = sum_all(&ps, "cpu-time", |p, s| has_fn(p, s, "churn"));
    let child_cpu = sum_all(&ps, "cpu-time", |p, s| has_fn(p, s, "child_work"));
    println!(
        "fork stress: {n} forks, {} failures, parent: {} profiles, {} cpu samples, {} alloc samples, {} record errors, {checked} blocks checked",
        failures.len(),
        ps.len(),
        stats.cpu_samples,
        stats.alloc_samples,
        stats.record_errors
    );
    assert!(failures.is_empty(), "{failures:#?}");
    assert!(churn_cpu > 0, "the parent kept profiling its threads");
    assert_eq!(child_cpu, 0, "children's samples stay in the children");
}
