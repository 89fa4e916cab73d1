//! CPU-bound workload (2 threads, stacks ~47 frames deep) without a profiler, under ferroprof at
//! 100 Hz, or under pprof-rs at 100 Hz: `cpu_workload none|ferroprof|pprof [rounds]`.
//!
//! Wall and process CPU time are measured around the workload only; ferroprof's start and its
//! final serialization (with symbolization) are reported apart (`stop_ms`).
use std::time::{Duration, Instant};

use ferroprof::{Profiler, Profiles};

const DEPTH: u32 = 38;

/// Runs the workload, returning (wall, process CPU ns).
fn measured(rounds: u64) -> (Duration, u64) {
    let c0 = ferroprof_bench::process_cpu_ns();
    let d = ferroprof_bench::cpu_workload(2, rounds, DEPTH);
    (d, ferroprof_bench::process_cpu_ns() - c0)
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
                    " handler_ns={} frames={} samples={} signals={} sampler_cpu_ns={} builds={} stop_ms={stop_ms:.1}",
                    s.handler_avg_ns, s.handler_avg_frames, s.cpu_samples, s.cpu_signals, s.sampler_cpu_ns,
                    s.snapshot_builds
                ),
            )
        }
        "pprof" => {
            let guard = pprof::ProfilerGuardBuilder::default()
                .frequency(100)
                .blocklist(&["libc", "libgcc", "pthread", "vdso"])
                .build()
                .expect("pprof-rs starts");
            let m = measured(rounds);
            drop(guard);
            (m, String::new())
        }
        other => panic!("unknown mode {other}"),
    };
    println!("RESULT wall_ns={} cpu_ns={cpu}{extra}", wall.as_nanos());
}
