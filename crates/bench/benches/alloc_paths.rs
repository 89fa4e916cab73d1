//! Per-call costs of the sampling allocator, next to the plain system allocator:
//! * `system`: `System` alloc + free of 64 bytes;
//! * `ferroprof_512KiB_heap`: the same through `SamplingAllocator(System)` with allocation and
//!   heap profiling running at the default 512 KiB interval: the unsampled fast path plus the
//!   free filter (a sample every ~8000 calls);
//! * `ferroprof_every_alloc`: interval 1 byte, so every allocation is sampled (stack unwound,
//!   recorded, tracked) and every free untracks it: the per-sample cost.
use std::alloc::{GlobalAlloc, Layout, System};
use std::time::Duration;

use criterion::{criterion_group, criterion_main, Criterion};
use ferroprof::export::{ExportError, ExportedProfile, Exporter};
use ferroprof::{Profiler, Profiles, SamplingAllocator};

static SAMPLING: SamplingAllocator<System> = SamplingAllocator::new(System);

struct Discard;

impl Exporter for Discard {
    fn name(&self) -> &str {
        "discard"
    }
    fn export(&mut self, _: &ExportedProfile) -> Result<(), ExportError> {
        Ok(())
    }
}

fn profiler(interval: u64) -> ferroprof::ProfilerGuard {
    Profiler::builder()
        .profiles(Profiles {
            cpu: false,
            wall: false,
            alloc: true,
            heap: true,
        })
        .alloc_interval_bytes(interval)
        .period(Duration::from_secs(3600))
        .exporter(Box::new(Discard))
        .start()
        .expect("profiler starts")
}

#[inline(never)]
fn alloc_free<A: GlobalAlloc>(a: &A, layout: Layout) {
    // SAFETY: a valid non-zero layout; the block is freed with the same allocator and layout.
    unsafe {
        let p = a.alloc(layout);
        std::hint::black_box(p);
        a.dealloc(p, layout);
    }
}

fn alloc_paths(c: &mut Criterion) {
    let layout = Layout::from_size_align(64, 8).unwrap();
    let mut g = c.benchmark_group("alloc_free_64B");
    g.bench_function("system", |b| b.iter(|| alloc_free(&System, layout)));

    let guard = profiler(512 * 1024);
    g.bench_function("ferroprof_512KiB_heap", |b| {
        b.iter(|| alloc_free(&SAMPLING, layout))
    });
    drop(guard);

    let guard = profiler(1);
    g.bench_function("ferroprof_every_alloc", |b| {
        b.iter(|| alloc_free(&SAMPLING, layout))
    });
    let stats = guard.stats();
    drop(guard);
    eprintln!(
        "samples recorded in the every-alloc run: {}",
        stats.alloc_samples
    );
    // The baseline again: the spread between the two system runs shows the noise level.
    g.bench_function("system_again", |b| b.iter(|| alloc_free(&System, layout)));
    g.finish();
}

criterion_group!(benches, alloc_paths);
criterion_main!(benches);
