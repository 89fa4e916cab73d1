//! On-demand profiles (`ProfileSource`, behind /debug/pprof): a capture sees the samples of its
//! window without taking them from the periodic export.

mod profiler_support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ferroprof::{Profiler, Profiles};
use profiler_support::*;

fn thread_cpu_ns() -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec * 1_000_000_000 + ts.tv_nsec
}

#[inline(never)]
fn busy_for_source(stop: &AtomicBool) -> i64 {
    let t0 = thread_cpu_ns();
    let mut x = 1u64;
    while !stop.load(Ordering::Relaxed) {
        for _ in 0..10_000 {
            x = std::hint::black_box(x.rotate_left(5).wrapping_mul(31));
        }
    }
    thread_cpu_ns() - t0
}

/// One profiler per process: the tests of this file take turns.
static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn cpu_capture_does_not_steal_from_the_periodic_profile() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let c = Collect::default();
    let guard = Profiler::builder()
        .profiles(Profiles {
            cpu: true,
            wall: true,
            alloc: false,
            heap: false,
        })
        .period(Duration::from_secs(600))
        .exporter(Box::new(c.clone()))
        .start()
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let s2 = stop.clone();
    let h = std::thread::Builder::new()
        .name("busy-src".into())
        .spawn(move || busy_for_source(&s2))
        .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let src = guard.profile_source();
    let bytes = src
        .cpu_profile(Duration::from_secs(1))
        .expect("cpu capture");
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Relaxed);
    let used = h.join().unwrap();
    guard.stop().unwrap();

    let tap = ferroprof_pprof::decode(&bytes).expect("capture decodes");
    let tap_cpu = sum_where(&tap, "cpu-time", |p, s| has_fn(p, s, "busy_for_source"));
    let ps = c.decoded();
    let exported = sum_all(&ps, "cpu-time", |p, s| has_fn(p, s, "busy_for_source"));
    eprintln!("thread used {used} ns; export {exported} ns; 1 s capture {tap_cpu} ns");
    assert!(tap_cpu > 0, "the capture saw the busy thread");
    assert!(tap_cpu < exported, "the capture is a window of the run");
    assert!(
        (exported as f64 / used as f64 - 1.0).abs() < 0.1,
        "the periodic profile still has all the CPU time: {exported} of {used}"
    );
    assert!(tap.value_index("wall-time").is_some());
    // Heap and allocation captures need those profiles.
    assert!(src.heap_profile().is_err());
}

#[test]
fn captures_fail_cleanly_after_stop() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let g = Profiler::builder()
        .profiles(Profiles {
            cpu: true,
            wall: false,
            alloc: false,
            heap: false,
        })
        .exporter(Box::new(Collect::default()))
        .start()
        .unwrap();
    let src = g.profile_source();
    assert!(src.allocs_profile(Duration::from_millis(10)).is_err());
    g.stop().unwrap();
    let err = src.cpu_profile(Duration::from_millis(10)).unwrap_err();
    assert!(err.contains("stopped"), "{err}");
}
