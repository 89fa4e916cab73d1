//! RSS added by starting a profiler (and letting it sample 4 threads for a second):
//! `rss_start ferroprof|pprof`.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ferroprof::{Profiler, Profiles, SamplingAllocator};

// All four profiles for real: allocations go through the sampling allocator (which costs one
// relaxed load per allocation while no profiler runs, as in the pprof-rs mode).
#[global_allocator]
static GLOBAL: SamplingAllocator<std::alloc::System> = SamplingAllocator::new(std::alloc::System);

fn main() {
    let mode = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "ferroprof".into());
    let stop = Arc::new(AtomicBool::new(false));
    let hs: Vec<_> = (0..4)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::hint::black_box(ferroprof_bench::deep(20, 10_000));
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let before = ferroprof_bench::rss_bytes();
    let dir = std::env::temp_dir().join(format!("ferroprof-bench-rss-{}", std::process::id()));
    let (start, after) = match mode.as_str() {
        "ferroprof" => {
            let g = Profiler::builder()
                .service("bench")
                .profiles(Profiles::all())
                .output_dir(&dir)
                .start()
                .expect("starts");
            let start = ferroprof_bench::rss_bytes();
            std::thread::sleep(Duration::from_secs(1));
            let after = ferroprof_bench::rss_bytes();
            drop(g);
            (start, after)
        }
        "pprof" => {
            let g = pprof::ProfilerGuardBuilder::default()
                .frequency(100)
                .build()
                .expect("starts");
            let start = ferroprof_bench::rss_bytes();
            std::thread::sleep(Duration::from_secs(1));
            let after = ferroprof_bench::rss_bytes();
            drop(g);
            (start, after)
        }
        other => panic!("unknown mode {other}"),
    };
    stop.store(true, Ordering::Relaxed);
    for h in hs {
        h.join().unwrap();
    }
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "RESULT start_bytes={} after_1s_bytes={}",
        start.saturating_sub(before),
        after.saturating_sub(before)
    );
}
