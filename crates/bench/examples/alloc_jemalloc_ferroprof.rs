//! Allocation workload on `SamplingAllocator(Jemalloc)` with allocation and heap profiling on:
//! ferroprof's sampling over jemalloc (jemalloc's own profiler stays off), to set against plain
//! jemalloc (`alloc_jemalloc`) as `alloc_ferroprof` is set against `alloc_system`.
use ferroprof::SamplingAllocator;
use tikv_jemallocator::Jemalloc;

#[global_allocator]
static GLOBAL: SamplingAllocator<Jemalloc> = SamplingAllocator::new(Jemalloc);

fn main() {
    let ops = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5_000_000u64);
    let interval = std::env::var("FERROPROF_BENCH_INTERVAL")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(512 * 1024u64);
    let dir = std::env::temp_dir().join(format!("ferroprof-bench-jem-{}", std::process::id()));
    // FERROPROF_BENCH_HEAP=0: allocation samples only, no live-heap tracking.
    let heap = std::env::var("FERROPROF_BENCH_HEAP").map_or(true, |v| v != "0");
    let guard = ferroprof_bench::start_alloc_profiler(&dir, interval, heap);
    let cpu0 = ferroprof_bench::process_cpu_ns();
    let d = ferroprof_bench::alloc_workload(ops);
    let cpu = ferroprof_bench::process_cpu_ns() - cpu0;
    let stats = guard.stats();
    println!(
        "RESULT ns_per_op={:.3} cpu_ns_per_op={:.3} samples={}",
        d.as_nanos() as f64 / ops as f64,
        cpu as f64 / (ops * ferroprof_bench::ALLOC_THREADS as u64) as f64,
        stats.alloc_samples
    );
    guard.stop().expect("stop");
    let _ = std::fs::remove_dir_all(&dir);
}
