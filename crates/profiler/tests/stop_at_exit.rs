//! `ProfilerGuard::stop_at_exit` (what the preload library calls at exit and before an exec):
//! the last profile is the one `stop` writes, and should the process go on after all (an exec
//! that failed), a profiler started again records and names frames as before, from the memory
//! the last export left in place.

mod profiler_support;

use std::time::Duration;

use profiler_support::*;

/// Runs until the thread has used `d` of CPU (the assertions below expect that much).
#[inline(never)]
fn burn_first(d: Duration) -> u64 {
    let end = thread_cpu() + d;
    let mut x = 1u64;
    while thread_cpu() < end {
        for _ in 0..100_000 {
            x = std::hint::black_box(x.rotate_left(5).wrapping_mul(0x2545_F491_4F6C_DD1D));
        }
    }
    x
}

#[inline(never)]
fn burn_second(d: Duration) -> u64 {
    let end = thread_cpu() + d;
    let mut x = 3u64;
    while thread_cpu() < end {
        for _ in 0..100_000 {
            x = std::hint::black_box(x.rotate_right(3).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        }
    }
    x
}

fn cpu_in(ps: &[ferroprof_pprof::Profile], name: &str) -> i64 {
    sum_all(ps, "cpu-time", |p, s| has_fn(p, s, name))
}

#[test]
fn the_last_profile_is_written_and_a_profiler_started_again_names_frames() {
    let first = Collect::default();
    let guard = start_cpu_wall("stop-at-exit", 250, &first);
    burn_first(Duration::from_millis(400));
    guard.stop_at_exit().expect("stops");
    let ps = first.decoded();
    let burned = cpu_in(&ps, "burn_first");
    assert!(
        burned > 200_000_000,
        "the last profile holds burn_first's CPU: {burned} ns"
    );

    // The process goes on: the symbolizer's arena and the debug files are where the last
    // export left them.
    let second = Collect::default();
    let guard = start_cpu_wall("stop-at-exit-again", 250, &second);
    burn_second(Duration::from_millis(400));
    guard.flush().expect("flush");
    guard.stop().expect("stops");
    let ps = second.decoded();
    let burned = cpu_in(&ps, "burn_second");
    assert!(
        burned > 200_000_000,
        "the second profiler names burn_second: {burned} ns"
    );
    assert_eq!(cpu_in(&ps, "burn_first"), 0, "nothing of the first run");
}
