//! Freeing a tracked (sampled) allocation allocates nothing, through the whole profiler: the
//! filter, the fork gate, the heap recorder's tables and their stacks.
//!
//! The global allocator here wraps ferroprof's: it marks the thread while a free runs, and the
//! allocator under ferroprof's counts every allocation made while the mark is set. At a 64-byte
//! sampling interval nearly every block is tracked, so every free below goes through the
//! recorder.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::Duration;

use ferroprof::{Profiler, Profiles, SamplingAllocator};

thread_local! {
    static IN_FREE: Cell<bool> = const { Cell::new(false) };
    static ALLOCS_IN_FREE: Cell<u64> = const { Cell::new(0) };
}

/// Under ferroprof's allocator: counts allocations made during a free.
struct Counting;

fn count() {
    let _ = IN_FREE.try_with(|f| {
        if f.get() {
            let _ = ALLOCS_IN_FREE.try_with(|c| c.set(c.get() + 1));
        }
    });
}

// SAFETY: forwards to the system allocator unchanged; the counters are const thread-local
// `Cell`s (no allocation, no destructor).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: forwarded contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: forwarded contract.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: forwarded contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded contract.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Over ferroprof's allocator: marks the thread while a free runs.
struct MarkFrees(SamplingAllocator<Counting>);

// SAFETY: forwards every call unchanged.
unsafe impl GlobalAlloc for MarkFrees {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded contract.
        unsafe { self.0.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded contract.
        unsafe { self.0.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded contract.
        unsafe { self.0.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let was = IN_FREE.try_with(|f| f.replace(true)).unwrap_or(true);
        // SAFETY: forwarded contract.
        unsafe { self.0.dealloc(ptr, layout) };
        let _ = IN_FREE.try_with(|f| f.set(was));
    }
}

#[global_allocator]
static GLOBAL: MarkFrees = MarkFrees(SamplingAllocator::new(Counting));

/// Boxed: each block is an allocation of its own, sampled and freed one by one.
#[allow(clippy::vec_box)]
#[inline(never)]
fn allocate_many(n: usize) -> Vec<Box<[u8; 48]>> {
    (0..n).map(|i| Box::new([i as u8; 48])).collect()
}

#[test]
fn freeing_tracked_allocations_allocates_nothing() {
    let dir = std::env::temp_dir().join(format!("ferroprof-free-no-alloc-{}", std::process::id()));
    let guard = Profiler::builder()
        .alloc_interval_bytes(64)
        .period(Duration::from_secs(600))
        .profiles(Profiles::all())
        .output_dir(&dir)
        .start()
        .expect("profiler starts");
    let mut freed = 0usize;
    for round in 0..5 {
        let blocks = allocate_many(20_000);
        let before = ALLOCS_IN_FREE.with(Cell::get);
        // Freed in an order unlike their allocation's, so stacks and shards empty unevenly.
        let (even, odd): (Vec<_>, Vec<_>) = blocks
            .into_iter()
            .enumerate()
            .partition(|(i, _)| i % 2 == 0);
        drop(odd);
        drop(even);
        freed += 20_000;
        let made = ALLOCS_IN_FREE.with(Cell::get) - before;
        assert_eq!(made, 0, "round {round}: {made} allocations inside frees");
    }
    let stats = guard.stats();
    guard.stop().expect("profiler stops");
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "{freed} blocks freed, {} allocation samples",
        stats.alloc_samples
    );
    assert!(
        stats.alloc_samples as usize > freed / 2,
        "most blocks were sampled, so their frees reached the recorder ({} samples)",
        stats.alloc_samples
    );
}
