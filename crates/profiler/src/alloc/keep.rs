//! Private memory for what a sampled allocation leaves in the profiler.
//!
//! Recording a sampled allocation runs on the application thread that allocated, and the
//! recorder, the live-heap table and the allocation totals grow their tables there. Through the
//! application's allocator those blocks land in that thread's arena (glibc), among the
//! application's own, where a long-lived block of ours high in an arena keeps the free memory
//! below it from going back to the kernel. While a thread runs the sampled path ([`with`]), its
//! allocations come from here instead: the upper part of the arena's reservation
//! ([`super::arena`]), power-of-two size classes with free lists, one spin lock. Blocks of
//! two pages and more give their pages back when freed. Any thread may free a kept block
//! (the export thread frees tables grown on application threads); the range compare of every
//! free already finds them. Large blocks go to [`super::bigblock`] as before.
//!
//! The lock guards a few loads and stores (never a call that could allocate or block); a fork
//! takes it first ([`before_fork`]), so no child inherits it held.

use std::alloc::Layout;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use super::arena::{self, CLASSES, MIN_SHIFT, PAGE};
use crate::tls::STATE;

/// Bump offset from the kept part's base; everything below was handed out once.
static USED: AtomicUsize = AtomicUsize::new(0);
/// Free list heads (addresses; 0 = empty); a free block's first word is the next.
static FREE: [AtomicUsize; CLASSES] = [const { AtomicUsize::new(0) }; CLASSES];
/// Bytes of blocks handed out and not freed (their classes' sizes).
static IN_USE: AtomicUsize = AtomicUsize::new(0);
static LOCK: AtomicBool = AtomicBool::new(false);
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
            countdown: s.countdown.replace(i64::MIN / 4),
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

struct Locked;

impl Locked {
    fn take() -> Locked {
        while LOCK
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::hint::spin_loop();
        }
        Locked
    }
}

impl Drop for Locked {
    fn drop(&mut self) {
        LOCK.store(false, Ordering::Release);
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
    let got = {
        let _l = Locked::take();
        let head = FREE[c].load(Ordering::Relaxed);
        let got = if head != 0 {
            // SAFETY: `head` is a free kept block of this class; its first word is the next.
            FREE[c].store(unsafe { *(head as *const usize) }, Ordering::Relaxed);
            Some(head)
        } else {
            // Fresh blocks are aligned to their size up to a page (every class's need).
            let align = size.min(PAGE);
            let used = USED.load(Ordering::Relaxed);
            let start = (used + align - 1) & !(align - 1);
            let end = start.checked_add(size)?;
            if end > arena::KEEP_LEN {
                return None;
            }
            USED.store(end, Ordering::Relaxed);
            // Low bit set: a fresh block, never handed out, still the kernel's zero pages.
            Some((base + start) | 1)
        };
        IN_USE.fetch_add(size, Ordering::Relaxed);
        got
    }?;
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
    let _l = Locked::take();
    // SAFETY: the block is at least 16 bytes and no longer used by anyone.
    unsafe { *(ptr as *mut usize) = FREE[c].load(Ordering::Relaxed) };
    FREE[c].store(ptr as usize, Ordering::Relaxed);
    IN_USE.fetch_sub(size, Ordering::Relaxed);
}

/// Called before a fork: takes the lock so that the child does not inherit it held by a
/// thread that does not exist there. Gives up after a while (a fork from a signal handler that
/// interrupted this thread's own critical section); the child then resets it.
pub(crate) fn before_fork() -> bool {
    for _ in 0..1_000_000 {
        if LOCK
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            return true;
        }
        std::hint::spin_loop();
    }
    false
}

/// After a fork, in the parent (`taken`: what [`before_fork`] returned) and in the child.
/// Async-signal-safe.
pub(crate) fn after_fork(in_child: bool, taken: bool) {
    if taken || in_child {
        LOCK.store(false, Ordering::Release);
    }
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
