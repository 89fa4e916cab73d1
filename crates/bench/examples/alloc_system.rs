//! Allocation workload on the plain system allocator (the baseline).
#[global_allocator]
static GLOBAL: std::alloc::System = std::alloc::System;

fn main() {
    let ops = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5_000_000u64);
    let cpu0 = ferroprof_bench::process_cpu_ns();
    let d = ferroprof_bench::alloc_workload(ops);
    let cpu = ferroprof_bench::process_cpu_ns() - cpu0;
    println!(
        "RESULT ns_per_op={:.3} cpu_ns_per_op={:.3}",
        d.as_nanos() as f64 / ops as f64,
        cpu as f64 / (ops * ferroprof_bench::ALLOC_THREADS as u64) as f64
    );
}
