//! Thread churn: short threads created and joined while profiling must not grow the process.
//! What the profiler keeps per thread is freed (or reused) when the thread exits, so RSS after
//! thousands of threads stays within 5 MB of the same churn without a profiler.
//!
//! One process, measured before and after: first the unprofiled control churn, then the same
//! churn profiled, exporting every few thousand threads as a periodic export would (each churn
//! after a warm-up churn that fills the C library's caches and the profiler's one-time
//! structures). The default run creates 20,000 threads per churn; `FERROPROF_CHURN_THREADS`
//! sets another count (`scripts/reliability.sh` runs 20,000 and 80,000, in release).

mod profiler_support;

use std::alloc::System;
use std::time::{Duration, Instant};

use ferroprof::{Profiler, ProfilerGuard, Profiles, SamplingAllocator};
use profiler_support::thread_cpu;

#[global_allocator]
static GLOBAL: SamplingAllocator<System> = SamplingAllocator::new(System);

/// Threads of the churn before the measured one: what the profiler allocates once (its
/// symbolizer, the pages of its free filter that tracked addresses touch) is not per thread.
const WARM_UP: usize = 2_000;

/// Threads between two exports of the profiled churn.
const EXPORT_EVERY: usize = 4_000;

fn rss_bytes() -> i64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: i64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    // SAFETY: sysconf has no preconditions.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as i64
}

fn threads() -> usize {
    std::env::var("FERROPROF_CHURN_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20_000)
}

/// What a short thread does: a little work (200 us of its own CPU, so the churn gets CPU
/// samples on a loaded machine too) and a few allocations.
#[inline(never)]
fn short_life(i: usize) -> u64 {
    let mut v: Vec<u64> = Vec::with_capacity(64);
    let end = thread_cpu() + Duration::from_micros(200);
    let mut x = i as u64 | 1;
    while thread_cpu() < end {
        for _ in 0..256 {
            x = x.rotate_left(5).wrapping_mul(0x9e37_79b9);
            v.push(x);
            if v.len() == 64 {
                v.clear();
            }
        }
    }
    let s = format!("{x:x}-{i}");
    x ^ s.len() as u64
}

/// Creates and joins `n` threads with names of their own, four at a time; exports through
/// `guard` every EXPORT_EVERY threads.
fn churn(n: usize, guard: Option<&ProfilerGuard>) -> u64 {
    let mut sum = 0u64;
    let mut i = 0;
    while i < n {
        let batch: Vec<_> = (i..(i + 4).min(n))
            .map(|k| {
                std::thread::Builder::new()
                    .name(format!("churn-{k}"))
                    .spawn(move || short_life(k))
                    .expect("spawn")
            })
            .collect();
        let before = i;
        i += batch.len();
        for h in batch {
            sum = sum.wrapping_add(h.join().unwrap());
        }
        if let Some(g) = guard.filter(|_| before / EXPORT_EVERY != i / EXPORT_EVERY) {
            g.flush().expect("flush");
        }
    }
    sum
}

/// RSS growth over a churn of `n` threads, after a warm-up churn.
fn growth(n: usize, guard: Option<&ProfilerGuard>) -> i64 {
    let settle = |g: Option<&ProfilerGuard>| {
        if let Some(g) = g {
            g.flush().expect("flush");
        }
        // Let the sampler see the last exits and finish what follows an export.
        std::thread::sleep(Duration::from_millis(300));
    };
    std::hint::black_box(churn(WARM_UP, None));
    settle(guard);
    let before = rss_bytes();
    std::hint::black_box(churn(n, guard));
    settle(guard);
    rss_bytes() - before
}

#[test]
fn thread_churn_does_not_grow_the_process() {
    let n = threads();
    let t = Instant::now();
    let control = growth(n, None);
    let control_secs = t.elapsed().as_secs_f64();
    let dir = std::env::temp_dir().join(format!("ferroprof-churn-{}", std::process::id()));
    let guard = Profiler::builder()
        .cpu_hz(1000)
        .alloc_interval_bytes(4096)
        .period(Duration::from_secs(600))
        .profiles(Profiles::all())
        .output_dir(&dir)
        .start()
        .expect("profiler starts");
    let t = Instant::now();
    let profiled = growth(n, Some(&guard));
    let profiled_secs = t.elapsed().as_secs_f64();
    let stats = guard.stats();
    guard.stop().expect("stops");
    let _ = std::fs::remove_dir_all(&dir);
    let mb = |b: i64| b as f64 / 1e6;
    println!(
        "thread churn, {n} threads: control {:+.2} MB ({control_secs:.1} s), profiled {:+.2} MB ({profiled_secs:.1} s, {} cpu samples, {} alloc samples, {} exports)",
        mb(control),
        mb(profiled),
        stats.cpu_samples,
        stats.alloc_samples,
        stats.exports
    );
    assert!(
        stats.alloc_samples > 0 && stats.cpu_samples > 0,
        "the churn was profiled"
    );
    assert!(
        profiled - control < 5_000_000,
        "profiled churn grew RSS by {:.2} MB, the unprofiled one by {:.2} MB",
        mb(profiled),
        mb(control)
    );
}
