//! CPU-bound workload (2 threads, stacks ~47 frames deep) without a profiler, under ferroprof at
//! 100 Hz, or under pprof-rs at 100 Hz: `cpu_workload none|ferroprof|pprof [rounds]`.
//!
//! Wall and process CPU time are measured around the workload only; ferroprof's start and its
//! final serialization (with symbolization) are reported apart (`stop_ms`). pprof-rs's signal
//! handler is timed through a wrapper, so both profilers' in-process costs are measured alike.
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use ferroprof::{Profiler, Profiles};

const DEPTH: u32 = 38;

/// Runs the workload, returning (wall, process CPU ns).
fn measured(rounds: u64) -> (Duration, u64) {
    let c0 = ferroprof_bench::process_cpu_ns();
    let d = ferroprof_bench::cpu_workload(2, rounds, DEPTH);
    (d, ferroprof_bench::process_cpu_ns() - c0)
}

/// pprof-rs's own SIGPROF handler, wrapped by [`timed_pprof_handler`] so its per-signal cost is
/// measured in the same run, the same way ferroprof measures its handler (monotonic clock around
/// the work).
static PPROF_HANDLER: AtomicUsize = AtomicUsize::new(0);
static PPROF_HANDLER_NS: AtomicU64 = AtomicU64::new(0);
static PPROF_SIGNALS: AtomicU64 = AtomicU64::new(0);

fn monotonic_ns() -> u64 {
    ferroprof_bench::clock_ns(libc::CLOCK_MONOTONIC)
}

extern "C" fn timed_pprof_handler(
    sig: libc::c_int,
    info: *mut libc::siginfo_t,
    ctx: *mut libc::c_void,
) {
    let h = PPROF_HANDLER.load(Ordering::Relaxed);
    if h == 0 {
        return;
    }
    let t0 = monotonic_ns();
    // SAFETY: `h` is the SA_SIGINFO handler pprof-rs installed (checked in `wrap_pprof_handler`),
    // called with the kernel's arguments.
    unsafe {
        let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
            std::mem::transmute(h);
        f(sig, info, ctx);
    }
    PPROF_HANDLER_NS.fetch_add(monotonic_ns() - t0, Ordering::Relaxed);
    PPROF_SIGNALS.fetch_add(1, Ordering::Relaxed);
}

/// Puts [`timed_pprof_handler`] in front of the SIGPROF handler pprof-rs just installed.
fn wrap_pprof_handler() {
    // SAFETY: plain sigaction calls on zero-initialized structs we own; the new handler has the
    // SA_SIGINFO signature.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        assert_eq!(
            libc::sigaction(libc::SIGPROF, std::ptr::null(), &mut old),
            0
        );
        assert!(
            old.sa_flags & libc::SA_SIGINFO != 0 && old.sa_sigaction > libc::SIG_IGN,
            "pprof-rs's SIGPROF handler is not an SA_SIGINFO handler"
        );
        PPROF_HANDLER.store(old.sa_sigaction, Ordering::SeqCst);
        let mut new = old;
        new.sa_sigaction = timed_pprof_handler as *const () as usize;
        assert_eq!(
            libc::sigaction(libc::SIGPROF, &new, std::ptr::null_mut()),
            0
        );
    }
}

fn main() {
    let mode = std::env::args().nth(1).unwrap_or_else(|| "none".into());
    let rounds = std::env::args()
        .nth(2)
        .and_then(|a| a.parse().ok())
        .unwrap_or(60_000u64);
    let dir = std::env::temp_dir().join(format!("ferroprof-bench-cpu-{}", std::process::id()));
    let ((wall, cpu), extra) = match mode.as_str() {
        "none" => (measured(rounds), String::new()),
        "ferroprof" => {
            let guard = Profiler::builder()
                .service("bench")
                .profiles(Profiles {
                    cpu: true,
                    wall: true,
                    alloc: false,
                    heap: false,
                })
                .cpu_hz(100)
                .period(Duration::from_secs(3600))
                .output_dir(&dir)
                .start()
                .expect("profiler starts");
            let m = measured(rounds);
            let s = guard.stats();
            let t = Instant::now();
            guard.stop().expect("stop");
            let stop_ms = t.elapsed().as_secs_f64() * 1e3;
            let _ = std::fs::remove_dir_all(&dir);
            (
                m,
                format!(
                    " handler_ns={} handler_median_ns={} frames={} samples={} remote_stacks={} timer_samples={} sampler_cpu_ns={} builds={} stop_ms={stop_ms:.1}",
                    s.handler_avg_ns, s.handler_median_ns, s.handler_avg_frames, s.cpu_samples, s.wall_remote_stacks, s.cpu_timer_samples,
                    s.sampler_cpu_ns, s.snapshot_builds
                ),
            )
        }
        "pprof" => {
            let guard = pprof::ProfilerGuardBuilder::default()
                .frequency(100)
                .blocklist(&["libc", "libgcc", "pthread", "vdso"])
                .build()
                .expect("pprof-rs starts");
            wrap_pprof_handler();
            let m = measured(rounds);
            drop(guard);
            let signals = PPROF_SIGNALS.load(Ordering::Relaxed);
            (
                m,
                format!(
                    " handler_ns={} signals={signals}",
                    PPROF_HANDLER_NS.load(Ordering::Relaxed) / signals.max(1)
                ),
            )
        }
        other => panic!("unknown mode {other}"),
    };
    println!("RESULT wall_ns={} cpu_ns={cpu}{extra}", wall.as_nanos());
}
