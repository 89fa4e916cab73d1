//! CPU-bound workload (2 threads, stacks ~47 frames deep) without a profiler, under ferroprof at
//! 100 Hz, or under pprof-rs at 100 Hz: `cpu_workload none|ferroprof|pprof [rounds]`.
use std::time::Duration;

use ferroprof::{Profiler, Profiles};

const DEPTH: u32 = 38;

fn main() {
    let mode = std::env::args().nth(1).unwrap_or_else(|| "none".into());
    let rounds = std::env::args()
        .nth(2)
        .and_then(|a| a.parse().ok())
        .unwrap_or(6000u64);
    let dir = std::env::temp_dir().join(format!("ferroprof-bench-cpu-{}", std::process::id()));
    let cpu0 = ferroprof_bench::process_cpu_ns();
    let (wall, extra) = match mode.as_str() {
        "none" => (
            ferroprof_bench::cpu_workload(2, rounds, DEPTH),
            String::new(),
        ),
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
            let d = ferroprof_bench::cpu_workload(2, rounds, DEPTH);
            let s = guard.stats();
            guard.stop().expect("stop");
            let _ = std::fs::remove_dir_all(&dir);
            (
                d,
                format!(
                    " handler_ns={} frames={} samples={} signals={}",
                    s.handler_avg_ns, s.handler_avg_frames, s.cpu_samples, s.cpu_signals
                ),
            )
        }
        "pprof" => {
            let guard = pprof::ProfilerGuardBuilder::default()
                .frequency(100)
                .blocklist(&["libc", "libgcc", "pthread", "vdso"])
                .build()
                .expect("pprof-rs starts");
            let d = ferroprof_bench::cpu_workload(2, rounds, DEPTH);
            drop(guard);
            (d, String::new())
        }
        other => panic!("unknown mode {other}"),
    };
    let cpu = ferroprof_bench::process_cpu_ns() - cpu0;
    println!("RESULT wall_ns={} cpu_ns={}{extra}", wall.as_nanos(), cpu);
}
