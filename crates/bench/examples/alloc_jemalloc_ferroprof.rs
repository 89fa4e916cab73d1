//! Allocation workload on `SamplingAllocator(Jemalloc)` with allocation and heap profiling on:
//! ferroprof's sampling over jemalloc (jemalloc's own profiler stays off), to set against plain
//! jemalloc (`alloc_jemalloc`) as `alloc_ferroprof` is set against `alloc_system`.
use ferroprof::SamplingAllocator;
use tikv_jemallocator::Jemalloc;

#[global_allocator]
static GLOBAL: SamplingAllocator<Jemalloc> = SamplingAllocator::new(Jemalloc);

fn main() {
    ferroprof_bench::run_sampled_alloc_benchmark();
}
