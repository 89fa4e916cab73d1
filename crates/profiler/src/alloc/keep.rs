//! Private memory for what a sampled allocation leaves in the profiler.
//!
//! Recording a sampled allocation runs on the application thread that allocated, and the
//! recorder, the live-heap table and the allocation totals grow their tables there. Through the
//! application's allocator those blocks land in that thread's arena (glibc), among the
//! application's own, where a long-lived block of ours high in an arena keeps the free memory
//! below it from going back to the kernel. While a thread runs the sampled path ([`with`]), its
//! allocations come from here instead: the upper part of the arena's reservation
//! ([`super::arena`]), power-of-two size classes with free lists. Blocks of two pages and more
//! give their pages back when freed. Any thread may free a kept block (the export thread frees
//! tables grown on application threads); the range compare of every free already finds them.
//! Large blocks go to [`super::bigblock`] as before.
//!
//! No lock: the free lists are lock-free stacks and fresh blocks come from a bump offset moved
//! by compare-and-swap. A signal handler that allocates on a thread caught half-way through
//! taking or giving a block (the application's handler, while the thread records a sample) gets
//! a block of its own, and a fork never finds anything held.

use std::alloc::Layout;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::arena::{self, CLASSES, MIN_SHIFT, PAGE};
use super::filter::FILTER;
use crate::tls::{COUNTDOWN_HELD, STATE};

/// Bump offset from the kept part's base; everything below was handed out once.
static USED: AtomicUsize = AtomicUsize::new(0);
/// Free list heads: the low half is the first free block (its offset from the kept part's base
/// in 16-byte units, plus one; 0 = empty), the high half counts changes, so that a pop that
/// read a head another thread popped and pushed back meanwhile fails its compare-and-swap. A
/// free block's first word holds the next block in the same form (low half only).
static FREE: [AtomicU64; CLASSES] = [const { AtomicU64::new(0) }; CLASSES];
const UNIT: usize = 1 << MIN_SHIFT;
/// Bytes of blocks handed out and not freed (their classes' sizes).
static IN_USE: AtomicUsize = AtomicUsize::new(0);
/// Threads in keep mode now.
static ACTIVE: AtomicUsize = AtomicUsize::new(0);
/// Freed blocks at least this large hand their pages back.
const RETURN_PAGES_AT: usize = 2 * PAGE;

/// Runs `f` (the recording of a sampled allocation) with this thread's allocations served from
/// kept blocks; on the heap when private memory is unavailable.
pub(crate) fn with<R>(f: impl FnOnce() -> R) -> R {
    if !arena::enabled() || !arena::reserve() {
        return f();
    }
    // As arena mode does: a countdown held negative sends every allocation of this thread to
    // the sampling allocator's slow path, where the mode is looked at.
    let _mode = Mode::set();
    f()
}

/// Whether the calling thread is in keep mode.
#[inline]
pub(crate) fn in_mode() -> bool {
    STATE.with(|s| s.keep.get())
}

/// Whether some thread is in keep mode (one load, for the realloc path).
#[inline(always)]
pub(crate) fn active_anywhere() -> bool {
    ACTIVE.load(Ordering::Relaxed) != 0
}

/// Bytes of kept blocks in use.
pub(crate) fn bytes_in_use() -> u64 {
    IN_USE.load(Ordering::Relaxed) as u64
}

struct Mode {
    keep: bool,
    countdown: i64,
}

impl Mode {
    fn set() -> Mode {
        ACTIVE.fetch_add(1, Ordering::Relaxed);
        STATE.with(|s| Mode {
            keep: s.keep.replace(true),
            countdown: s.countdown.replace(COUNTDOWN_HELD),
        })
    }
}

impl Drop for Mode {
    fn drop(&mut self) {
        STATE.with(|s| {
            s.keep.set(self.keep);
            s.countdown.set(self.countdown);
        });
        ACTIVE.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A kept block for `layout`, or None (the caller uses the heap).
pub(crate) fn alloc(layout: Layout, zeroed: bool) -> Option<*mut u8> {
    if layout.align() > PAGE {
        return None;
    }
    let c = arena::class_of(layout)?;
    let size = 1usize << (c + MIN_SHIFT as usize);
    let base = arena::keep_base();
    if base == 0 {
        return None;
    }
    let got = match pop(c, base) {
        Some(p) => p,
        None => {
            // Low bit set: a fresh block, never handed out, still the kernel's zero pages.
            (fresh_block(size)? + base) | 1
        }
    };
    IN_USE.fetch_add(size, Ordering::Relaxed);
    let (p, fresh) = (got & !1, got & 1 == 1);
    if zeroed && !fresh {
        // Blocks this large had their pages handed back when freed, but for the link.
        let dirty = if size >= RETURN_PAGES_AT {
            std::mem::size_of::<usize>()
        } else {
            size
        };
        // SAFETY: `size` bytes of kept memory, now ours.
        unsafe { std::ptr::write_bytes(p as *mut u8, 0, dirty) };
    }
    Some(p as *mut u8)
}

/// The first free block of class `c`, taken off its list.
fn pop(c: usize, base: usize) -> Option<usize> {
    let head = &FREE[c];
    let mut h = head.load(Ordering::Acquire);
    loop {
        let idx = h as u32;
        if idx == 0 {
            return None;
        }
        let p = base + (idx as usize - 1) * UNIT;
        // SAFETY: `p` lies in the kept part of the reservation, which stays mapped for the
        // process's life. If another thread took the block since `h` was read, the word read
        // may be anything: the change count in `h` then fails the swap below and nothing read
        // here is used.
        let next = unsafe { (*(p as *const AtomicU64)).load(Ordering::Relaxed) };
        let new = ((h >> 32).wrapping_add(1) << 32) | (next & 0xffff_ffff);
        match head.compare_exchange_weak(h, new, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => return Some(p),
            Err(now) => h = now,
        }
    }
}

/// A block of `size` bytes never handed out before: its offset from the kept part's base.
fn fresh_block(size: usize) -> Option<usize> {
    // Aligned to their size up to a page (every class's need).
    let align = size.min(PAGE);
    let mut used = USED.load(Ordering::Relaxed);
    loop {
        let start = (used + align - 1) & !(align - 1);
        let end = start.checked_add(size)?;
        if end > arena::KEEP_LEN {
            return None;
        }
        match USED.compare_exchange_weak(used, end, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => {
                // Every page the block touches is counted as the profiler's own in the free
                // filter before it is handed out, also a page a racing thread's block shares
                // (that thread may not have counted it yet). Kept pages stay counted for good:
                // counting one twice costs nothing.
                let base = arena::keep_base();
                FILTER.insert_own_range(base + start, base + end);
                return Some(start);
            }
            Err(now) => used = now,
        }
    }
}

/// Frees a kept block.
pub(crate) fn free(ptr: *mut u8, layout: Layout) {
    let Some(c) = arena::class_of(layout) else {
        return;
    };
    let size = 1usize << (c + MIN_SHIFT as usize);
    if size >= RETURN_PAGES_AT {
        // SAFETY: whole pages of a kept block nobody uses any more (blocks this large are
        // page-aligned multiples of a page).
        unsafe { libc::madvise(ptr as *mut libc::c_void, size, libc::MADV_DONTNEED) };
    }
    let idx = ((ptr as usize - arena::keep_base()) / UNIT + 1) as u64;
    // SAFETY: the block is at least 16 bytes, 8-aligned, and no longer used by anyone but this
    // list (a stale pop may read its first word: atomically, see `pop`).
    let link = unsafe { &*(ptr as *const AtomicU64) };
    let head = &FREE[c];
    let mut h = head.load(Ordering::Relaxed);
    loop {
        link.store(h & 0xffff_ffff, Ordering::Relaxed);
        let new = ((h >> 32).wrapping_add(1) << 32) | idx;
        match head.compare_exchange_weak(h, new, Ordering::Release, Ordering::Relaxed) {
            Ok(_) => break,
            Err(now) => h = now,
        }
    }
    IN_USE.fetch_sub(size, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_blocks_are_reused_zeroed_and_counted() {
        assert!(arena::reserve());
        for size in [24usize, 4096, 64 * 1024] {
            let layout = Layout::from_size_align(size, 8).unwrap();
            let a = alloc(layout, true).expect("a kept block");
            assert!(arena::owns(a), "{size}: in the reservation");
            // SAFETY: `a` is `size` bytes we own.
            let block = unsafe { std::slice::from_raw_parts_mut(a, size) };
            assert!(block.iter().all(|&b| b == 0), "fresh {size}");
            block.fill(0x5a);
            assert!(bytes_in_use() >= size as u64);
            // Through the arena's free, as the allocator's dealloc does.
            arena::free(a, layout);
            // Other tests may take blocks of this class meanwhile: look among a few.
            let again: Vec<*mut u8> = (0..8).map_while(|_| alloc(layout, true)).collect();
            for &b in &again {
                // SAFETY: as above.
                let block = unsafe { std::slice::from_raw_parts(b, size) };
                assert!(block.iter().all(|&x| x == 0), "reused {size}");
            }
            for b in again {
                arena::free(b, layout);
            }
        }
    }

    #[test]
    fn keep_mode_holds_the_countdown_and_puts_it_back() {
        STATE.with(|s| s.countdown.set(12345));
        with(|| {
            assert!(in_mode());
            assert!(active_anywhere());
            assert!(STATE.with(|s| s.countdown.get()) < 0);
        });
        assert!(!in_mode());
        assert_eq!(STATE.with(|s| s.countdown.get()), 12345);
    }
}
