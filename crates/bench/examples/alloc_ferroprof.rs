//! Allocation workload on `SamplingAllocator(System)` with allocation and heap profiling on.
use ferroprof::SamplingAllocator;
use std::alloc::System;

#[global_allocator]
static GLOBAL: SamplingAllocator<System> = SamplingAllocator::new(System);

fn main() {
    ferroprof_bench::run_sampled_alloc_benchmark();
}
