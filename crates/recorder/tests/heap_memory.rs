//! Memory per tracked object, measured with a counting global allocator that counts the test
//! thread's allocations only (the harness's own threads may allocate meanwhile).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;

use ferroprof_recorder::{Frame, HeapConfig, HeapRecorder, StringStorage};

struct Counting;

static LIVE_BYTES: AtomicIsize = AtomicIsize::new(0);

thread_local! {
    /// Set on the measuring thread only.
    static COUNTED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn count(delta: isize) {
    if COUNTED.try_with(|c| c.get()).unwrap_or(false) {
        LIVE_BYTES.fetch_add(delta, Ordering::Relaxed);
    }
}

// SAFETY: every call forwards to `System` with the caller's arguments unchanged; the counter is
// bookkeeping only.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count(layout.size() as isize);
        // SAFETY: same contract as our caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        count(-(layout.size() as isize));
        // SAFETY: `ptr` came from `System` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count(new_size as isize - layout.size() as isize);
        // SAFETY: same contract as our caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn at_most_64_bytes_per_tracked_object_and_all_of_it_given_back() {
    COUNTED.with(|c| c.set(true));
    let frames: Vec<Frame<'static>> = (0..32u64).map(|i| Frame::Address(0x4000 + i)).collect();
    let strings = Arc::new(StringStorage::new());
    let mut worst = 0f64;
    for n in (10_000..=190_000usize).step_by(20_000) {
        let start = LIVE_BYTES.load(Ordering::Relaxed);
        let rec = HeapRecorder::new(HeapConfig::native(), Arc::clone(&strings)).unwrap();
        // The first object pays for the shared stack.
        rec.track(1, 1, 8, None, &frames).unwrap();
        let before = LIVE_BYTES.load(Ordering::Relaxed);
        for i in 0..n as u64 {
            rec.track(0x10_0000 + i * 32, 1, 8, None, &frames).unwrap();
        }
        let per = (LIVE_BYTES.load(Ordering::Relaxed) - before) as f64 / n as f64;
        worst = worst.max(per);
        assert!(per <= 64.0, "{per:.1} bytes per object with {n} objects");

        // Untracking everything gives the memory back (up to the empty shards' minimum) at the
        // next serialization: a free itself never allocates, so it does not shrink tables.
        for i in 0..n as u64 {
            assert!(rec.untrack(0x10_0000 + i * 32));
        }
        rec.prepare_iteration().unwrap();
        rec.finish_iteration().unwrap();
        let left = LIVE_BYTES.load(Ordering::Relaxed) - before;
        assert!(
            left < 64 * 1024,
            "{left} bytes left after untracking {n} objects"
        );
        drop(rec);
        assert_eq!(LIVE_BYTES.load(Ordering::Relaxed), start, "recorder leaked");
    }
    println!("worst case: {worst:.1} bytes per tracked object");
}
