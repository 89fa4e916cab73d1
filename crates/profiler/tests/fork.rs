//! Profiling across fork: the child starts from empty profiles (the parent's samples are not
//! reported twice), keeps profiling with fresh threads, and the parent is unaffected.

mod profiler_support;

use std::time::Duration;

use ferroprof::{CpuEngine, Profiler, Profiles};
use profiler_support::*;

/// One profiler per process: the tests of this file take turns.
static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Descriptors of this process that are perf events.
fn perf_event_fds() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    std::fs::read_link(e.path())
                        .is_ok_and(|l| l.to_string_lossy().contains("perf_event"))
                })
                .count()
        })
        .unwrap_or(0)
}

/// `d` of the thread's own CPU: the assertions below expect that much of each.
#[inline(never)]
fn parent_work(d: Duration) -> u64 {
    let end = thread_cpu() + d;
    let mut x = 3u64;
    while thread_cpu() < end {
        for _ in 0..100_000 {
            x = std::hint::black_box(x.rotate_left(3).wrapping_mul(7));
        }
    }
    x
}

#[inline(never)]
fn child_work(d: Duration) -> u64 {
    let end = thread_cpu() + d;
    let mut x = 5u64;
    while thread_cpu() < end {
        for _ in 0..100_000 {
            x = std::hint::black_box(x.rotate_left(5).wrapping_mul(11));
        }
    }
    x
}

#[test]
fn a_forked_child_profiles_itself_from_empty_profiles() {
    forked_child_profiles_itself(CpuEngine::Timer);
}

/// The same with perf events: the child closes the parent's events (their descriptors are
/// copies) and opens its own.
#[test]
fn a_forked_child_profiles_itself_with_perf_events() {
    forked_child_profiles_itself(CpuEngine::Perf);
}

fn forked_child_profiles_itself(engine: CpuEngine) {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let c = Collect::default();
    let started = Profiler::builder()
        .profiles(Profiles {
            cpu: true,
            wall: false,
            alloc: false,
            heap: false,
        })
        .cpu_engine(engine)
        .period(Duration::from_secs(600))
        .exporter(Box::new(c.clone()))
        .start();
    let guard = match started {
        Err(ferroprof::ProfilerError::CpuEngine { source }) => {
            println!("perf events refused here ({source}): nothing to check");
            return;
        }
        other => other.unwrap(),
    };
    parent_work(Duration::from_millis(500));
    let parent_events = perf_event_fds();
    if engine == CpuEngine::Perf {
        assert!(parent_events > 0, "the perf engine opened no event");
    }

    // SAFETY: the child only runs the profiler's code and ours, then leaves with _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // The parent's events are closed by the fork handler, before anything restarts.
        let inherited = perf_event_fds();
        // This child neither allocates through a sampling allocator nor calls the profiler
        // before its work: it restarts profiling itself.
        ferroprof::after_fork();
        child_work(Duration::from_millis(500));
        let ok = guard.stop().is_ok() && {
            let ps = c.decoded();
            let child = sum_all(&ps, "cpu-time", |p, s| has_fn(p, s, "child_work"));
            let parent = sum_all(&ps, "cpu-time", |p, s| has_fn(p, s, "parent_work"));
            // The child's only profile: its own work, none of the parent's.
            eprintln!(
                "child: {} profiles, child_work {child} ns, parent_work {parent} ns",
                ps.len()
            );
            eprintln!("child: {inherited} perf event descriptors inherited");
            ps.len() == 1 && child > 100_000_000 && parent == 0 && inherited == 0
        };
        // SAFETY: leave the child without running the test harness's exit path.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "child crashed: status {status}");
    assert_eq!(libc::WEXITSTATUS(status), 0, "child's profile is wrong");

    parent_work(Duration::from_millis(200));
    guard.stop().unwrap();
    let ps = c.decoded();
    let parent = sum_all(&ps, "cpu-time", |p, s| has_fn(p, s, "parent_work"));
    let child = sum_all(&ps, "cpu-time", |p, s| has_fn(p, s, "child_work"));
    assert!(parent > 400_000_000, "parent cpu {parent}");
    assert_eq!(child, 0, "the child's samples stay in the child");
}
