//! Freeing a tracked object allocates nothing.
//!
//! `untrack_allocation` runs inside the application's `free` (the profiler's sampling
//! allocator), maybe in a signal handler: it must not allocate through the application's
//! allocator. This binary counts the allocations each thread makes and checks that none happen
//! inside an untrack, whatever the untrack sets off: the last reference of a stack (symbolic
//! stacks release their strings, address stacks nothing), the last object of a request context,
//! a shard emptying after thousands of objects (its tables shrink on a later insert instead), and
//! releases while a heap snapshot is pinned (quarantine).

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use ferroprof_recorder::{Frame, HeapConfig, RecorderConfig, StackRecorder};

struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator unchanged; the count is a const thread-local `Cell`
// (no allocation, no destructor).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: forwarded contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: forwarded contract.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
        // SAFETY: forwarded contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded contract.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.with(Cell::get)
}

fn native() -> StackRecorder {
    StackRecorder::new(RecorderConfig {
        heap: HeapConfig::native(),
        ..RecorderConfig::default()
    })
    .unwrap()
}

/// Untracks `id`, failing when that allocated.
fn untrack_without_allocating(r: &StackRecorder, id: u64) {
    let before = allocs();
    let found = r.untrack_allocation_bytes(id).is_some();
    let made = allocs() - before;
    assert!(found, "{id:#x} was tracked");
    assert_eq!(made, 0, "untracking {id:#x} allocated {made} times");
}

/// Pseudo-random order of `0..n`.
fn shuffled(n: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..n).collect();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for i in (1..v.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

#[test]
fn untracking_address_stacks_with_contexts_allocates_nothing() {
    let r = native();
    let n = 20_000u64;
    for i in 0..n {
        // 500 distinct stacks, so stacks lose their last reference at different frees; one
        // request context per 100 objects.
        let frames = [
            Frame::Address(0x40_0000 + (i % 500) * 16),
            Frame::Address(0x50_0000 + (i % 7)),
        ];
        r.track_allocation_in(0x1000_0000 + i * 64, 1, 64, None, &frames, 1 + i / 100)
            .unwrap();
    }
    for i in shuffled(n) {
        untrack_without_allocating(&r, 0x1000_0000 + i * 64);
    }
    assert_eq!(r.stats().heap.unwrap().num_heap_records, 0);
    // The tables give their memory back on later inserts.
    for i in 0..10u64 {
        r.track_allocation_in(0x2000_0000 + i * 64, 1, 64, None, &[Frame::Address(7)], 0)
            .unwrap();
    }
}

#[test]
fn untracking_symbolic_stacks_allocates_nothing() {
    let r = native();
    let n = 3_000u64;
    let names: Vec<String> = (0..300).map(|i| format!("app::function_{i}")).collect();
    for i in 0..n {
        let frames = [
            Frame::sym(&names[(i % 300) as usize], "app.rs", (i % 40) as i64),
            Frame::sym("app::main", "main.rs", 3),
        ];
        r.track_allocation(0x3000_0000 + i * 32, 2, 32, Some("Vec"), &frames)
            .unwrap();
    }
    for i in shuffled(n) {
        untrack_without_allocating(&r, 0x3000_0000 + i * 32);
    }
    assert_eq!(r.stats().heap.unwrap().num_heap_records, 0);
}

#[test]
fn untracking_while_a_snapshot_is_pinned_allocates_nothing() {
    let r = native();
    let n = 5_000u64;
    for i in 0..n {
        let frames = [Frame::Address(0x60_0000 + i * 16)];
        r.track_allocation_in(0x4000_0000 + i * 64, 1, 64, None, &frames, 1 + i / 10)
            .unwrap();
    }
    let heap = r.heap().expect("heap recorder");
    heap.prepare_iteration().unwrap();
    for i in shuffled(n) {
        untrack_without_allocating(&r, 0x4000_0000 + i * 64);
    }
    heap.finish_iteration().unwrap();
    assert_eq!(r.stats().heap.unwrap().num_heap_records, 0);
}
