//! The smallest program ferroprof profiles: CPU time, wall time, allocations and the live heap,
//! written every minute (and at the end) to `./profiles`. The README's "Add it to your program".
//!
//! `cargo run --release -p ferroprof --example minimal`, then
//! `ferroprof top profiles/minimal-*.pprof`.

use ferroprof::{Profiler, SamplingAllocator};
use std::alloc::System;

// Allocations go through ferroprof's sampling allocator: the allocation and heap profiles.
#[global_allocator]
static GLOBAL: SamplingAllocator<System> = SamplingAllocator::new(System);

fn main() -> Result<(), ferroprof::ProfilerError> {
    let profiler = Profiler::builder()
        .service("minimal")
        .tag("env", "dev")
        .start()?; // a bad setting is an error naming the value

    run_the_program();

    profiler.stop() // writes the last profile (dropping the guard does too)
}

/// Stands for the program: two seconds of hashing and allocating.
fn run_the_program() {
    let end = std::time::Instant::now() + std::time::Duration::from_secs(2);
    let mut kept = Vec::new();
    let mut x = 1u64;
    while std::time::Instant::now() < end {
        for _ in 0..100_000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
        }
        kept.push(vec![x as u8; 4096]);
    }
    println!("{} buffers, last {x:#x}", kept.len());
}
