//! Allocation workload on the plain system allocator (the baseline).
#[global_allocator]
static GLOBAL: std::alloc::System = std::alloc::System;

fn main() {
    let ops = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5_000_000u64);
    let d = ferroprof_bench::alloc_workload(ops);
    println!("RESULT ns_per_op={:.3}", d.as_nanos() as f64 / ops as f64);
}
