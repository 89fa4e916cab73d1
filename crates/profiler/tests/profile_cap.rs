//! The in-flight profile's memory cap (`ProfilerBuilder::max_profile_bytes`): a program
//! allocating from ever new stacks (recursion depth patterns) keeps the profiler's memory
//! bounded, and the stacks past the cap show up in the exported pprof under the marked frame.
//!
//! `FERROPROF_CAP_TEST_STACKS` sets the number of distinct stacks (default 150,000); the
//! `#[ignore]`d test reports the profile's memory with and without a cap for the issue's
//! scenario (4 KiB allocation interval, distinct stacks, 10 s).

mod profiler_support;

use std::alloc::System;
use std::hint::black_box;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use ferroprof::recorder::DROPPED_STACKS_FRAME;
use ferroprof::{Profiler, Profiles, SamplingAllocator};
use profiler_support::*;

#[global_allocator]
static GLOBAL: SamplingAllocator<System> = SamplingAllocator::new(System);

static LOCK: Mutex<()> = Mutex::new(());

const INTERVAL: u64 = 4096;

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    // SAFETY: sysconf has no preconditions.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64
}

/// Four call sites, one per base-4 digit: the stack below `leaf` spells `path` in them.
#[inline(never)]
fn step_a(path: u64, depth: u32) -> usize {
    black_box(next(path, depth)) + 1
}

#[inline(never)]
fn step_b(path: u64, depth: u32) -> usize {
    black_box(next(path, depth)) + 2
}

#[inline(never)]
fn step_c(path: u64, depth: u32) -> usize {
    black_box(next(path, depth)) + 3
}

#[inline(never)]
fn step_d(path: u64, depth: u32) -> usize {
    black_box(next(path, depth)) + 4
}

#[inline(never)]
fn next(path: u64, depth: u32) -> usize {
    if depth == 0 {
        return leaf();
    }
    let rest = path / 4;
    match path % 4 {
        0 => step_a(rest, depth - 1),
        1 => step_b(rest, depth - 1),
        2 => step_c(rest, depth - 1),
        _ => step_d(rest, depth - 1),
    }
}

/// One allocation of twice the sampling interval (almost always sampled).
#[inline(never)]
fn leaf() -> usize {
    let v: Vec<u8> = Vec::with_capacity(2 * INTERVAL as usize);
    black_box(&v).capacity()
}

/// Allocates from `n` distinct stacks (depth 10 covers 4^10 of them), `Some(deadline)` cycling
/// until then.
fn distinct_allocations(n: u64, until: Option<Instant>) -> u64 {
    let mut done = 0;
    loop {
        for i in 0..n {
            black_box(next(i, 10));
            done += 1;
            if until.is_some_and(|t| i % 1024 == 0 && Instant::now() >= t) {
                return done;
            }
        }
        if until.is_none_or(|t| Instant::now() >= t) {
            return done;
        }
    }
}

fn alloc_only() -> Profiles {
    Profiles {
        alloc: true,
        ..Profiles::none()
    }
}

#[test]
fn distinct_stacks_stay_under_the_cap_and_show_as_the_marked_frame() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let n: u64 = std::env::var("FERROPROF_CAP_TEST_STACKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(150_000);
    let cap = 2 << 20;
    let collect = Collect::default();
    let guard = Profiler::builder()
        .profiles(alloc_only())
        .alloc_interval_bytes(INTERVAL)
        .period(Duration::from_secs(3600))
        .exporter(Box::new(collect.clone()))
        .max_profile_bytes(cap)
        .start()
        .unwrap();
    assert!(guard.allocator_installed());
    // Warm up (unwinder caches, first tables), then measure the distinct stacks alone.
    distinct_allocations(1000, None);
    let before = rss_bytes();
    distinct_allocations(n, None);
    let grown = rss_bytes().saturating_sub(before);
    let stats = guard.stats();
    guard.stop().unwrap();
    eprintln!(
        "{n} distinct stacks, cap {cap}: RSS +{:.1} MB, {} of {} samples folded",
        grown as f64 / 1e6,
        stats.dropped_stacks,
        stats.alloc_samples
    );
    // Without the cap the profile takes ~300 bytes per stack (45 MB here).
    assert!(
        grown < 12 << 20,
        "RSS grew by {grown} bytes over {n} distinct stacks with a {cap}-byte cap"
    );
    assert!(
        stats.dropped_stacks > n / 2,
        "{} samples folded",
        stats.dropped_stacks
    );

    let profiles = collect.decoded();
    let marked = |p: &ferroprof_pprof::Profile, s: &ferroprof_pprof::Sample| {
        p.stack_names(s) == [DROPPED_STACKS_FRAME]
    };
    let folded = sum_all(&profiles, "alloc-samples-unscaled", marked);
    // Samples recorded after the stats were read may fold too.
    assert!(
        folded >= stats.dropped_stacks as i64,
        "{folded} samples under the marked frame, {} counted",
        stats.dropped_stacks
    );
    let all = sum_all(&profiles, "alloc-samples-unscaled", |_, _| true);
    assert!(all >= stats.alloc_samples as i64, "{all} samples exported");
    // Stacks let in before the cap are whole: the recursion shows in them.
    let kept = sum_all(&profiles, "alloc-samples-unscaled", |p, s| {
        has_fn(p, s, "step_a") && has_fn(p, s, "leaf")
    });
    assert!(kept > 0);
}

/// The scenario: allocations at a 4 KiB interval from distinct stacks for 10 s, one
/// profile (a 10 s period), with the default cap and without one. Prints the RSS growth.
#[test]
#[ignore = "measurement (20 s): cargo test -p ferroprof --test profile_cap -- --ignored --nocapture"]
fn report_profile_memory_with_and_without_cap() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let secs: u64 = std::env::var("FERROPROF_CAP_TEST_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10);
    // The default cap (`DEFAULT_MAX_PROFILE_BYTES`), then none.
    for cap in [32 << 20, 0] {
        let guard = Profiler::builder()
            .profiles(alloc_only())
            .alloc_interval_bytes(INTERVAL)
            .period(Duration::from_secs(3600))
            .exporter(Box::new(Collect::default()))
            .max_profile_bytes(cap)
            .start()
            .unwrap();
        distinct_allocations(1000, None);
        let before = rss_bytes();
        let until = Instant::now() + Duration::from_secs(secs);
        let done = distinct_allocations(4u64.pow(10), Some(until));
        let grown = rss_bytes().saturating_sub(before);
        let stats = guard.stats();
        drop(guard);
        println!(
            "cap {:>9}: {done} allocations from distinct stacks in {secs} s, {} samples, \
             {} folded, RSS +{:.1} MB",
            if cap == 0 {
                "none".to_owned()
            } else {
                format!("{} MiB", cap >> 20)
            },
            stats.alloc_samples,
            stats.dropped_stacks,
            grown as f64 / 1e6
        );
    }
}

#[test]
fn the_cap_comes_from_the_builder_or_the_environment() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let cap_of = |b: ferroprof::ProfilerBuilder| {
        let guard = b
            .profiles(alloc_only())
            .exporter(Box::new(Collect::default()))
            .start()
            .unwrap();
        let cap = guard.recorder().config().max_profile_bytes;
        guard.stop().unwrap();
        cap
    };
    let env = |value: &'static str| {
        Profiler::builder()
            .from_vars(move |k| (k == "FERROPROF_MAX_PROFILE_MB").then(|| value.into()))
    };
    assert_eq!(cap_of(Profiler::builder()), Some(32 << 20));
    assert_eq!(
        cap_of(Profiler::builder().max_profile_bytes(5000)),
        Some(5000)
    );
    assert_eq!(cap_of(Profiler::builder().max_profile_bytes(0)), None);
    assert_eq!(cap_of(env("3")), Some(3 << 20));
    assert_eq!(cap_of(env(" 0 ")), None);
    for bad in [
        "-1",
        "lots",
        "1.5",
        "99999999999999999999",
        "17592186044416",
    ] {
        let err = env(bad)
            .profiles(alloc_only())
            .exporter(Box::new(Collect::default()))
            .start()
            .err()
            .unwrap_or_else(|| panic!("FERROPROF_MAX_PROFILE_MB={bad} accepted"));
        let msg = err.to_string();
        assert!(
            msg.contains("FERROPROF_MAX_PROFILE_MB") && msg.contains(bad),
            "{msg}"
        );
    }
}
