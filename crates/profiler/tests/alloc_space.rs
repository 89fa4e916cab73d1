//! `alloc-space` estimates bytes allocated without bias: a program whose allocations are known
//! to the byte, sampled every 64 KiB on average, must find its totals within 5%.
//!
//! One test in its own binary: the profiler is process-wide.

mod profiler_support;

use std::alloc::System;
use std::hint::black_box;
use std::time::Duration;

use ferroprof::{Profiler, Profiles, SamplingAllocator};
use profiler_support::*;

#[global_allocator]
static GLOBAL: SamplingAllocator<System> = SamplingAllocator::new(System);

const INTERVAL: u64 = 64 * 1024;
const MIB: usize = 1 << 20;

/// Small allocations (16 B to 4 KiB, freed at once) until `total` bytes. Each sample of a
/// small allocation stands for about one interval, so the estimate's relative error is about
/// 1/sqrt(total / interval): 1.1% for 512 MiB, a 5% bound is 4.5 sigma.
#[inline(never)]
fn allocate_small_known(total: usize) -> usize {
    let mut done = 0;
    let mut r = 0x9e37_79b9_7f4a_7c15u64;
    while done < total {
        r ^= r << 13;
        r ^= r >> 7;
        r ^= r << 17;
        let size = 16 + (r % 4081) as usize;
        // `with_capacity` of bytes asks the allocator for exactly `size` bytes.
        black_box(Vec::<u8>::with_capacity(size));
        done += size;
    }
    done
}

/// Allocations at and above the interval, where the weight is close to 1: 64 of 1 MiB and 256
/// of 96 KiB (96 MiB in all).
#[inline(never)]
fn allocate_large_known() -> usize {
    let mut done = 0;
    for i in 0..320 {
        let size = if i % 5 == 0 { MIB } else { 96 * 1024 };
        black_box(Vec::<u8>::with_capacity(size));
        done += size;
    }
    done
}

#[test]
fn alloc_space_totals_match_the_bytes_allocated() {
    let c = Collect::default();
    let guard = Profiler::builder()
        .service("alloc-space-test")
        .profiles(Profiles {
            cpu: false,
            wall: false,
            alloc: true,
            heap: false,
        })
        .alloc_interval_bytes(INTERVAL)
        .period(Duration::from_secs(3600))
        .exporter(Box::new(c.clone()))
        .start()
        .expect("profiler starts");
    assert!(guard.allocator_installed());

    let small = allocate_small_known(512 * MIB);
    let large = allocate_large_known();
    guard.stop().expect("stop");

    let ps = c.decoded();
    assert_eq!(ps.len(), 1, "one profile, at stop");
    let p = &ps[0];
    assert_eq!(
        p.sample_types()
            .into_iter()
            .find(|(t, _)| t == "alloc-space"),
        Some(("alloc-space".to_owned(), "bytes".to_owned()))
    );
    let est = |f: &str| sum_where(p, "alloc-space", |p, s| has_fn(p, s, f));
    let samples = |f: &str| sum_where(p, "alloc-samples-unscaled", |p, s| has_fn(p, s, f));
    let (est_small, est_large) = (est("allocate_small_known"), est("allocate_large_known"));
    eprintln!(
        "alloc-space: small {est_small} vs {small} ({} samples), large {est_large} vs {large} \
         ({} samples)",
        samples("allocate_small_known"),
        samples("allocate_large_known"),
    );
    // Enough samples for the bound to mean something (expected: small / interval = 8192).
    assert!(
        samples("allocate_small_known") > 4000,
        "too few samples: {}",
        samples("allocate_small_known")
    );
    for (what, got, truth) in [
        ("small", est_small, small),
        ("large", est_large, large),
        ("all", est_small + est_large, small + large),
    ] {
        let ratio = got as f64 / truth as f64;
        assert!(
            (ratio - 1.0).abs() < 0.05,
            "{what}: alloc-space {got} vs {truth} bytes allocated ({ratio:.4})"
        );
    }
    // Bytes per allocation read back as the allocation sizes: the mean small size is ~2 KiB.
    let count = sum_where(p, "alloc-samples", |p, s| {
        has_fn(p, s, "allocate_small_known")
    });
    let mean = est_small as f64 / count as f64;
    assert!((1800.0..2300.0).contains(&mean), "mean size {mean}");
}
