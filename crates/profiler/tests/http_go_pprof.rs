//! `go tool pprof` against the real profiler's /debug/pprof: this test binary is the profiled
//! program. It burns CPU in a known function and keeps a known live set, serves /debug/pprof
//! from `guard.profile_source()`, and `go tool pprof -top` must show both functions.
//!
//! One test in its own binary: the profiler is process-wide.

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ferroprof::{Profiler, SamplingAllocator};

#[global_allocator]
static GLOBAL: SamplingAllocator<std::alloc::System> = SamplingAllocator::new(std::alloc::System);

/// The CPU the test expects to see, in a function of its own.
#[inline(never)]
fn burn_cpu_for_go_pprof(stop: &AtomicBool) -> u64 {
    let mut x = black_box(0x9e37_79b9_7f4a_7c15u64);
    while !stop.load(Ordering::Relaxed) {
        let mut i = 0;
        while i < 100_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            i += 1;
        }
    }
    black_box(x)
}

/// The live set the test expects to see: 32 buffers of 1 MiB.
#[inline(never)]
fn keep_heap_for_go_pprof() -> Vec<Vec<u8>> {
    let v: Vec<Vec<u8>> = (0..32).map(|i| black_box(vec![i as u8; 1 << 20])).collect();
    black_box(v)
}

#[test]
fn go_tool_pprof_reads_cpu_and_heap_from_the_running_profiler() {
    let Some(go) = ferroprof_pprof::go_tool::go_for_tests() else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("ferroprof-gopprof-out-{}", std::process::id()));
    let guard = Profiler::builder()
        .service("go-pprof-test")
        .period(Duration::from_secs(3600))
        .output_dir(&dir)
        .start()
        .expect("start the profiler");
    assert!(guard.allocator_installed(), "sampling allocator not in use");
    let server = ferroprof::http::serve("127.0.0.1:0", guard.profile_source()).unwrap();
    let base = format!("http://{}/debug/pprof", server.addr());

    let live = keep_heap_for_go_pprof();
    let stop = Arc::new(AtomicBool::new(false));
    let burner = {
        let stop = stop.clone();
        std::thread::Builder::new()
            .name("burner".into())
            .spawn(move || burn_cpu_for_go_pprof(&stop))
            .unwrap()
    };

    let cpu = ferroprof_pprof::go_tool::pprof_for_tests(
        &go,
        &[
            "-top",
            "-sample_index=cpu-time",
            &format!("{base}/profile?seconds=2"),
        ],
    );
    stop.store(true, Ordering::SeqCst);
    burner.join().unwrap();
    let line = cpu
        .lines()
        .find(|l| l.contains("burn_cpu_for_go_pprof"))
        .unwrap_or_else(|| panic!("burn_cpu_for_go_pprof not in go tool pprof -top:\n{cpu}"));
    // The burner ran for the whole capture: it must hold most of the CPU time on its own.
    let flat_pct: f64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.trim_end_matches('%').parse().ok())
        .unwrap_or_else(|| panic!("cannot parse flat% from {line:?}"));
    assert!(
        flat_pct > 50.0,
        "burner has only {flat_pct}% of the CPU:\n{cpu}"
    );

    let heap = ferroprof_pprof::go_tool::pprof_for_tests(
        &go,
        &[
            "-top",
            "-cum",
            "-sample_index=heap-live-size",
            &format!("{base}/heap"),
        ],
    );
    assert!(
        heap.lines().any(|l| l.contains("keep_heap_for_go_pprof")),
        "keep_heap_for_go_pprof not in go tool pprof -top:\n{heap}"
    );
    drop(live);
    server.stop();
    guard.stop().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
