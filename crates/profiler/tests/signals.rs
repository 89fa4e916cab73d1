//! Signals under load: CPU profiling at 1 kHz while 8 threads allocate heavily (every block's
//! contents verified before it is freed), with frequent exports; no deadlock, no crash, no
//! corrupted data, every exported profile valid. And the sampling signal arriving when it is not ours to
//! handle (after stop, or sent by someone else while running) never kills the process.
//!
//! The default test runs a short load; `scripts/reliability.sh signals [secs]` runs the ignored
//! long version in release mode (`FERROPROF_SIGNALS_SECS`, default 60) and prints the rates.
//! A watchdog aborts the process if a run does not finish long after its duration (a hang).

mod profiler_support;

use std::alloc::System;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferroprof::{Profiler, Profiles, SamplingAllocator};
use profiler_support::*;

#[global_allocator]
static GLOBAL: SamplingAllocator<System> = SamplingAllocator::new(System);

/// One profiler per process: the tests of this file take turns.
static LOCK: Mutex<()> = Mutex::new(());

/// Aborts the process unless dropped within `limit`: a hang must fail the run, not stall it.
struct Watchdog(Arc<AtomicBool>);

impl Watchdog {
    fn new(what: &'static str, limit: Duration) -> Watchdog {
        let done = Arc::new(AtomicBool::new(false));
        let d = done.clone();
        std::thread::spawn(move || {
            let end = Instant::now() + limit;
            while Instant::now() < end {
                if d.load(Ordering::SeqCst) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            eprintln!("watchdog: {what} did not finish within {limit:?}: hang");
            std::process::abort();
        });
        Watchdog(done)
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Heavy allocation: vectors, strings and maps of many sizes, a rolling live set, contents
/// checked before every free. Returns the number of blocks checked.
#[inline(never)]
fn allocate_hard(stop: &AtomicBool, seed: u64) -> u64 {
    let mut x = seed | 1;
    let mut rand = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut live: Vec<(u64, Vec<u64>)> = Vec::new();
    let mut names: HashMap<String, usize> = HashMap::new();
    let mut checked = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let r = rand();
        let len = match r % 16 {
            0 => 1 + (r >> 8) as usize % (64 * 1024),
            1..=4 => 1 + (r >> 8) as usize % 4096,
            _ => 1 + (r >> 8) as usize % 64,
        };
        live.push((r, (0..len as u64).map(|i| i.wrapping_mul(r)).collect()));
        let s = format!("key-{}", r % 1000);
        *names.entry(s).or_default() += 1;
        if names.len() > 500 {
            names.clear();
        }
        if live.len() > 256 {
            let (tag, v) = live.swap_remove(rand() as usize % live.len());
            assert!(
                v.iter()
                    .enumerate()
                    .all(|(i, &e)| e == (i as u64).wrapping_mul(tag)),
                "a block's contents changed under the profiler"
            );
            checked += 1;
        }
    }
    checked
}

/// Pure CPU work, so the 1 kHz sampler has busy threads to interrupt mid-computation. Goes on
/// after `stop` until the thread has used `MIN_SPIN_CPU` (the tests expect its samples, on
/// however loaded a machine).
#[inline(never)]
fn spin_hard(stop: &AtomicBool) -> u64 {
    let end = thread_cpu() + MIN_SPIN_CPU;
    let mut x = 1u64;
    while !stop.load(Ordering::Relaxed) || thread_cpu() < end {
        for _ in 0..10_000 {
            x = std::hint::black_box(x.rotate_left(7) ^ 0x9e37_79b9_7f4a_7c15).wrapping_mul(3);
        }
    }
    x
}

const MIN_SPIN_CPU: Duration = Duration::from_millis(100);

fn load(duration: Duration) {
    let c = Collect::default();
    let _watchdog = Watchdog::new(
        "the 1 kHz + allocation run",
        duration * 4 + Duration::from_secs(120),
    );
    let guard = Profiler::builder()
        .cpu_hz(1000)
        .alloc_interval_bytes(64 * 1024)
        .period(Duration::from_millis(250))
        .profiles(Profiles::all())
        .exporter(Box::new(c.clone()))
        .start()
        .expect("profiler starts");
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let workers: Vec<_> = (0..8u64)
        .map(|i| {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name(format!("load-{i}"))
                .spawn(move || {
                    if i % 4 == 3 {
                        spin_hard(&stop);
                        0
                    } else {
                        allocate_hard(&stop, 0x2545_f491 * (i + 1))
                    }
                })
                .expect("spawn")
        })
        .collect();
    while started.elapsed() < duration {
        std::thread::sleep(Duration::from_millis(50));
    }
    stop.store(true, Ordering::Relaxed);
    let checked: u64 = workers.into_iter().map(|w| w.join().expect("worker")).sum();
    let elapsed = started.elapsed().as_secs_f64();
    let stats = guard.stats();
    guard.stop().expect("stops");

    let ps = c.decoded();
    let cpu = sum_all(&ps, "cpu-samples", |_, _| true);
    let alloc = sum_all(&ps, "alloc-samples-unscaled", |_, _| true);
    let spin = sum_all(&ps, "cpu-time", |p, s| has_fn(p, s, "spin_hard"));
    println!(
        "signals: 8 threads, {elapsed:.1} s: {} timer captures ({:.0}/s), {} cpu samples, {} alloc samples ({:.0}/s), handler avg {} ns, {} profiles, {} record errors, {} lost captures, {} serialize errors, {checked} blocks verified",
        stats.cpu_timer_samples,
        stats.cpu_timer_samples as f64 / elapsed,
        stats.cpu_samples,
        stats.alloc_samples,
        stats.alloc_samples as f64 / elapsed,
        stats.handler_avg_ns,
        ps.len(),
        stats.record_errors,
        stats.cpu_captures_lost,
        stats.serialize_errors,
    );
    assert!(checked > 0);
    assert!(
        stats.cpu_timer_samples > 0 && cpu > 0,
        "CPU samples were taken"
    );
    assert!(alloc > 0, "allocation samples were taken");
    assert!(spin > 0, "the spinning threads show up");
    assert_eq!(stats.serialize_errors, 0);
    assert_eq!(stats.export_errors, 0);
}

#[test]
fn one_khz_with_heavy_allocation_on_8_threads() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    load(Duration::from_secs(2));
}

#[test]
#[ignore = "long run: scripts/reliability.sh signals [secs]"]
fn one_khz_with_heavy_allocation_on_8_threads_long() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let secs: f64 = std::env::var("FERROPROF_SIGNALS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60.0);
    load(Duration::from_secs_f64(secs));
}

/// Sends the sampling signal `sig` to the whole process, to one other thread, and queued ones
/// that carry the timers' marker (but come from `sigqueue`, not from a timer).
fn send_stray_signals(sig: i32) {
    let other = std::thread::spawn(|| std::thread::sleep(Duration::from_millis(200)));
    // SAFETY: plain signal-sending calls on this process and its own threads.
    unsafe {
        assert_eq!(libc::kill(libc::getpid(), sig), 0);
        assert_eq!(libc::raise(sig), 0);
        use std::os::unix::thread::JoinHandleExt;
        assert_eq!(libc::pthread_kill(other.as_pthread_t(), sig), 0);
        for payload in [usize::MAX, 0xf3f2 << 48 | 0xffff, 0xf3f2 << 48] {
            let value = libc::sigval {
                sival_ptr: payload as *mut libc::c_void,
            };
            assert_eq!(libc::sigqueue(libc::getpid(), sig, value), 0);
        }
    }
    other.join().expect("thread survived");
    std::thread::sleep(Duration::from_millis(50));
}

#[test]
fn the_sampling_signal_after_stop_does_not_kill_the_process() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let c = Collect::default();
    let guard = Profiler::builder()
        .cpu_hz(1000)
        .exporter(Box::new(c.clone()))
        .start()
        .expect("profiler starts");
    std::hint::black_box(spin_for(Duration::from_millis(100)));
    let sig = guard.stats().signal;
    guard.stop().expect("stops");
    // Reaching the end of this test is the assertion: the signal's default action would kill us.
    for _ in 0..5 {
        send_stray_signals(sig);
    }
    // And profiling can start again afterwards.
    let again = Profiler::builder()
        .cpu_hz(1000)
        .exporter(Box::new(c.clone()))
        .start()
        .expect("profiler restarts");
    std::hint::black_box(spin_for(Duration::from_millis(100)));
    again.stop().expect("stops again");
}

#[test]
fn stray_sampling_signals_while_profiling_are_ignored() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let c = Collect::default();
    let guard = Profiler::builder()
        .cpu_hz(1000)
        .exporter(Box::new(c.clone()))
        .start()
        .expect("profiler starts");
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let spinner = std::thread::spawn(move || spin_hard(&s));
    let sig = guard.stats().signal;
    for _ in 0..5 {
        send_stray_signals(sig);
    }
    stop.store(true, Ordering::Relaxed);
    spinner.join().expect("spinner");
    guard.stop().expect("stops");
    let ps = c.decoded();
    assert!(sum_all(&ps, "cpu-time", |p, s| has_fn(p, s, "spin_hard")) > 0);
}

#[inline(never)]
fn spin_for(d: Duration) -> u64 {
    let end = Instant::now() + d;
    let mut x = 1u64;
    while Instant::now() < end {
        x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
    }
    x
}
