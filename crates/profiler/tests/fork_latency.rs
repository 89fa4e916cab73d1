//! `fork()` while the export thread serializes a large profile (distinct stacks over thousands
//! of addresses of this binary, symbolized): the fork handler must wait for a short critical
//! section at most, never for a whole symbolization and encoding. Counts: env
//! `FERROPROF_FORK_LATENCY_{ROUNDS,STACKS,ADDRESSES}` (defaults 3, 30k, 5k).
//!
//! One test in its own binary: the profiler is process-wide.

mod profiler_support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ferroprof::recorder::{Frame, SampleValues};
use ferroprof::{Profiler, Profiles};
use profiler_support::Collect;

fn env_or(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Executable ranges of this binary, from /proc/self/maps.
fn own_text() -> (u64, u64) {
    let exe = std::fs::read_link("/proc/self/exe").unwrap();
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .filter(|l| l.split_whitespace().nth(1).is_some_and(|p| p.contains('x')))
        .filter(|l| l.ends_with(exe.to_str().unwrap()))
        .map(|l| {
            let range = l.split_whitespace().next().unwrap();
            let (a, b) = range.split_once('-').unwrap();
            (
                u64::from_str_radix(a, 16).unwrap(),
                u64::from_str_radix(b, 16).unwrap(),
            )
        })
        .max_by_key(|(a, b)| b - a)
        .expect("an executable mapping of the test binary")
}

/// When our prepare handler ran last (CLOCK_MONOTONIC, ns). Registered before the profiler's,
/// it runs after the profiler's prepare handler (prepare handlers run in reverse order of
/// registration), so the time from calling `fork()` to it is the time the profiler held the
/// fork back.
static PREPARED_AT: AtomicU64 = AtomicU64::new(0);

fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec; async-signal-safe, usable in a fork handler.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

extern "C" fn mark_prepared() {
    PREPARED_AT.store(now_ns(), Ordering::SeqCst);
}

/// Forks once; the child leaves at once. Returns how long the profiler's prepare handler held
/// the fork back and how long the whole `fork()` took, in the parent.
fn timed_fork() -> (Duration, Duration) {
    let t = now_ns();
    // SAFETY: the child calls only _exit.
    let pid = unsafe { libc::fork() };
    let end = now_ns();
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: leave the child without running anything of the parent's.
        unsafe { libc::_exit(0) };
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    let prepared = PREPARED_AT.load(Ordering::SeqCst);
    (
        Duration::from_nanos(prepared.saturating_sub(t)),
        Duration::from_nanos(end - t),
    )
}

#[test]
fn fork_does_not_wait_for_a_serialization() {
    let rounds = env_or("FERROPROF_FORK_LATENCY_ROUNDS", 3);
    let stacks = env_or("FERROPROF_FORK_LATENCY_STACKS", 30_000);
    let pool_len = env_or("FERROPROF_FORK_LATENCY_ADDRESSES", 5_000);
    // SAFETY: registering a plain extern "C" function that only stores a timestamp.
    assert_eq!(
        unsafe { libc::pthread_atfork(Some(mark_prepared), None, None) },
        0
    );
    let sink = Collect::default();
    let guard = Profiler::builder()
        .service("fork-latency")
        // No sampler, no sampling allocator: the export thread is the only one in the recorder.
        .profiles(Profiles {
            cpu: false,
            wall: false,
            alloc: true,
            heap: false,
        })
        .period(Duration::from_secs(3600))
        .restart_after_fork(false)
        .exporter(Box::new(sink.clone()))
        .start()
        .unwrap();

    let (lo, hi) = own_text();
    let pool: Vec<u64> = (0..pool_len as u64)
        .map(|i| lo + (i * 7919 * 16) % (hi - lo))
        .collect();
    let values = SampleValues {
        alloc_samples: 1,
        alloc_samples_unscaled: 1,
        ..SampleValues::default()
    };

    let idle: Vec<(Duration, Duration)> = (0..20).map(|_| timed_fork()).collect();
    let mut during: Vec<(Duration, Duration)> = Vec::new();
    let mut serialize_times = Vec::new();
    for _ in 0..rounds {
        for i in 0..stacks {
            let p = |k: usize| Frame::Address(pool[k % pool_len]);
            let frames = [
                p(i),
                p((i / pool_len) * 31 + 5),
                p(i * 7),
                p(i * 13 + 1),
                p(i * 17 + 3),
                p(i / 3),
            ];
            guard
                .recorder()
                .record_sample(&frames, &values, &[], 0)
                .unwrap();
        }
        let began = Instant::now();
        let g = &guard;
        std::thread::scope(|s| {
            let flush = s.spawn(move || g.flush());
            // Fork until the flush is done (at least once).
            loop {
                during.push(timed_fork());
                if flush.is_finished() {
                    break;
                }
            }
            flush.join().unwrap().unwrap();
        });
        serialize_times.push(began.elapsed());
    }
    let summary = |v: &[(Duration, Duration)], held: bool| {
        let mut d: Vec<Duration> = v.iter().map(|x| if held { x.0 } else { x.1 }).collect();
        d.sort();
        format!(
            "median {:?}, p99 {:?}, max {:?}",
            d[d.len() / 2],
            d[d.len() * 99 / 100],
            d[d.len() - 1]
        )
    };
    eprintln!(
        "fork latency: idle: held back {}; fork() {}",
        summary(&idle, true),
        summary(&idle, false)
    );
    eprintln!(
        "fork latency: during {rounds} serializations ({serialize_times:?}), {} forks: held back \
         {}; fork() {}",
        during.len(),
        summary(&during, true),
        summary(&during, false)
    );
    let held_max = during.iter().map(|x| x.0).max().unwrap_or_default();
    guard.stop().unwrap();
    assert!(
        held_max < Duration::from_millis(50),
        "a fork was held back {held_max:?} by the serialization"
    );
}
