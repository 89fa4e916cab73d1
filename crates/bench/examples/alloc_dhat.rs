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
    let d = ferroprof_bench::alloc_workload(ops);
    println!("RESULT ns_per_op={:.3}", d.as_nanos() as f64 / ops as f64);
    drop(profiler);
    let _ = std::fs::remove_file(&out);
}
