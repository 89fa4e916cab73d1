//! Allocation workload under dhat's heap profiler (records every allocation).
#[global_allocator]
static GLOBAL: dhat::Alloc = dhat::Alloc;

fn main() {
    let ops = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(200_000u64);
    let out =
        std::env::temp_dir().join(format!("ferroprof-bench-dhat-{}.json", std::process::id()));
    let profiler = dhat::Profiler::builder().file_name(&out).build();
    let cpu0 = ferroprof_bench::process_cpu_ns();
    let d = ferroprof_bench::alloc_workload(ops);
    let cpu = ferroprof_bench::process_cpu_ns() - cpu0;
    println!(
        "RESULT ns_per_op={:.3} cpu_ns_per_op={:.3}",
        d.as_nanos() as f64 / ops as f64,
        cpu as f64 / (ops * ferroprof_bench::ALLOC_THREADS as u64) as f64
    );
    drop(profiler);
    let _ = std::fs::remove_file(&out);
}
