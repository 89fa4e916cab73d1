//! Workloads shared by the benchmark programs (`examples/`) and the criterion benches.
//!
//! * [`alloc_workload`]: 2 threads, each keeping a live set of 4096 objects and replacing a
//!   random one per operation with a new block of 16..=1040 bytes (free + allocation).
//! * [`cpu_workload`]: CPU-bound hashing at a fixed recursion depth, so stacks have a known
//!   number of frames.
//! * [`rss_bytes`], [`process_cpu_ns`]: measurements.

use std::time::{Duration, Instant};

/// Objects each allocating thread keeps alive.
pub const LIVE_PER_THREAD: usize = 4096;
/// Allocating threads.
pub const ALLOC_THREADS: usize = 2;

/// xorshift64: the workloads' deterministic randomness.
#[inline(always)]
pub fn next(r: &mut u64) -> u64 {
    *r ^= *r << 13;
    *r ^= *r >> 7;
    *r ^= *r << 17;
    *r
}

/// One allocating thread: `ops` replacements in a live set of [`LIVE_PER_THREAD`] blocks.
#[inline(never)]
pub fn alloc_thread(ops: u64, seed: u64) -> u64 {
    let mut r = seed | 1;
    let mut live: Vec<Option<Box<[u8]>>> = (0..LIVE_PER_THREAD).map(|_| None).collect();
    let mut check = 0u64;
    for _ in 0..ops {
        let x = next(&mut r);
        let slot = (x as usize) % LIVE_PER_THREAD;
        let size = 16 + ((x >> 32) % 1025) as usize;
        let mut b = vec![0u8; size].into_boxed_slice();
        b[0] = x as u8;
        if let Some(old) = live[slot].replace(b) {
            check = check.wrapping_add(old[0] as u64);
        }
    }
    check
}

/// Runs the allocation workload on [`ALLOC_THREADS`] threads, `ops` operations each; returns
/// the wall time.
pub fn alloc_workload(ops: u64) -> Duration {
    let t0 = Instant::now();
    let hs: Vec<_> = (0..ALLOC_THREADS as u64)
        .map(|i| std::thread::spawn(move || alloc_thread(ops, 0x9E37_79B9 + i)))
        .collect();
    for h in hs {
        std::hint::black_box(h.join().unwrap());
    }
    t0.elapsed()
}

/// Hashing work at the bottom of a recursion `depth` frames deep.
#[inline(never)]
pub fn deep(depth: u32, work: u64) -> u64 {
    if depth == 0 {
        let mut x = 0x2545_F491_4F6C_DD1Du64 ^ work;
        for i in 0..work {
            x = std::hint::black_box(x.rotate_left(7).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i);
        }
        x
    } else {
        std::hint::black_box(deep(depth - 1, work)).wrapping_add(depth as u64)
    }
}

/// Runs `threads` threads, each doing `rounds` rounds of [`deep`] work; returns the wall time.
pub fn cpu_workload(threads: usize, rounds: u64, depth: u32) -> Duration {
    let t0 = Instant::now();
    let hs: Vec<_> = (0..threads)
        .map(|_| {
            std::thread::spawn(move || {
                let mut acc = 0u64;
                for _ in 0..rounds {
                    acc = acc.wrapping_add(deep(depth, 20_000));
                }
                acc
            })
        })
        .collect();
    for h in hs {
        std::hint::black_box(h.join().unwrap());
    }
    t0.elapsed()
}

/// Resident set size of this process.
pub fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(0) as u64
}

/// CPU time consumed by this process so far (all threads).
pub fn process_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_PROCESS_CPUTIME_ID)
}

/// Reads `clock` in nanoseconds (async-signal-safe: one `clock_gettime`).
pub fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The `main` of the allocation benchmarks under `SamplingAllocator` (whatever allocator is
/// under it): `[ops]` from the command line, the interval from `FERROPROF_BENCH_INTERVAL`
/// (default 512 KiB), live-heap tracking unless `FERROPROF_BENCH_HEAP=0`; prints the `RESULT`
/// line.
pub fn run_sampled_alloc_benchmark() {
    let ops = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5_000_000u64);
    let interval = std::env::var("FERROPROF_BENCH_INTERVAL")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(512 * 1024u64);
    let dir = std::env::temp_dir().join(format!("ferroprof-bench-{}", std::process::id()));
    let heap = std::env::var("FERROPROF_BENCH_HEAP").map_or(true, |v| v != "0");
    let guard = start_alloc_profiler(&dir, interval, heap);
    let cpu0 = process_cpu_ns();
    let d = alloc_workload(ops);
    let cpu = process_cpu_ns() - cpu0;
    let stats = guard.stats();
    println!(
        "RESULT ns_per_op={:.3} cpu_ns_per_op={:.3} samples={}",
        d.as_nanos() as f64 / ops as f64,
        cpu as f64 / (ops * ALLOC_THREADS as u64) as f64,
        stats.alloc_samples
    );
    guard.stop().expect("stop");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Starts the profiler as the allocation benchmarks run it: allocation samples every
/// `interval` bytes on average, live-heap tracking when `heap`, CPU and wall off, no periodic
/// export during the run, the final profile written under `dir`.
pub fn start_alloc_profiler(
    dir: &std::path::Path,
    interval: u64,
    heap: bool,
) -> ferroprof::ProfilerGuard {
    ferroprof::Profiler::builder()
        .service("bench")
        .profiles(ferroprof::Profiles {
            cpu: false,
            wall: false,
            alloc: true,
            heap,
        })
        .alloc_interval_bytes(interval)
        .period(Duration::from_secs(3600))
        .output_dir(dir)
        .start()
        .expect("profiler starts")
}

/// Nanoseconds per dependent load at random places in 64 MiB: the host's memory latency (cache
/// and TLB misses) right now. A signal handler finds its memory cold, so its cost follows this
/// figure; the CPU benchmark reports it next to the handler's.
pub fn memory_latency_ns() -> f64 {
    let n = (64usize << 20) / 8;
    // One random cycle through every slot (Sattolo's shuffle), so each load depends on the last.
    let mut next_slot: Vec<usize> = (0..n).collect();
    let mut r = 0x2545_f491_4f6c_dd1d_u64;
    for i in (1..n).rev() {
        let j = (self::next(&mut r) % i as u64) as usize;
        next_slot.swap(i, j);
    }
    let steps = 1_000_000;
    let mut p = 0usize;
    let t = Instant::now();
    for _ in 0..steps {
        p = next_slot[p];
    }
    std::hint::black_box(p);
    t.elapsed().as_nanos() as f64 / steps as f64
}

/// Median of `v` (sorted in place).
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}
