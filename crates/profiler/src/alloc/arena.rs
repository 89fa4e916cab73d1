//! Private memory for what symbolization needs only while it runs.
//!
//! Parsing an object's DWARF allocates tens of megabytes of short-lived tables. Through the
//! application's allocator that memory stays resident after it is freed (glibc keeps it in the
//! export thread's arena, jemalloc until its decay runs), so every export left the process larger.
//! While a thread is in arena mode ([`with`]), the [`crate::SamplingAllocator`] serves its
//! allocations from a region of address space reserved once (`MAP_NORESERVE`: pages exist only
//! once touched), and [`release`] hands every touched page back to the kernel at the end of the
//! pass. Frees of arena blocks (recognized by address) go to per-size free lists, large ones
//! return their pages at once.
//!
//! Invariants: the arena belongs to one owner at a time (a symbolizer, from its first lookup
//! of a pass to the end of the pass); others run on the heap meanwhile. Arena memory is
//! allocated, freed and released only through the owner, which is used by one thread at a time,
//! so the arena's state needs no lock. Nothing allocated in arena mode outlives the pass
//! (results are copied out with arena mode off).
//! Arena mode needs the sampling allocator as the global allocator (its slow path is where arena
//! mode is checked; with allocation sampling off, the fast path takes the slow one while some
//! thread is in arena mode); otherwise allocations simply go to the heap.

use std::alloc::Layout;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use super::filter::FILTER;
use crate::tls::{COUNTDOWN_HELD, STATE};

/// Address space reserved once (only touched pages cost memory): the arena's below
/// [`ARENA_LEN`], the kept blocks' ([`super::keep`]) above it, so that one range compare finds
/// both (on the free path's cold side: their pages are counted in the free filter).
const RESERVE: usize = 2 << 30;
/// The arena's part of the reservation.
const ARENA_LEN: usize = 1 << 30;
/// Size classes: powers of two from 16 bytes.
pub(crate) const MIN_SHIFT: u32 = 4;
pub(crate) const CLASSES: usize = 31 - MIN_SHIFT as usize;
/// Freed blocks at least this large give their pages back right away.
const RETURN_PAGES_AT: usize = 256 * 1024;
pub(crate) const PAGE: usize = 4096;

static BASE: AtomicUsize = AtomicUsize::new(0);
static LEN: AtomicUsize = AtomicUsize::new(0);
/// Bump offset from BASE: everything below was handed out at some point of this pass.
static USED: AtomicUsize = AtomicUsize::new(0);
/// Bytes from BASE whose pages are counted in the free filter (page-aligned, only grows).
static MARKED: AtomicUsize = AtomicUsize::new(0);
/// Highest USED of the last pass (for stats).
static LAST_PASS_BYTES: AtomicUsize = AtomicUsize::new(0);
/// Heads of the free lists (addresses; 0 = empty). The first word of a free block is the next.
static FREE: [AtomicUsize; CLASSES] = [const { AtomicUsize::new(0) }; CLASSES];
/// Set for the whole process by an allocator that cannot serve arena blocks (see [`disable`]).
static DISABLED: AtomicBool = AtomicBool::new(false);

/// Never use the arena in this process: symbolization then allocates from the heap. For an
/// allocator front end that cannot tell an arena block's size on free (the C `free` of the
/// preload library), which therefore never serves from the arena.
pub(crate) fn disable() {
    DISABLED.store(true, Ordering::SeqCst);
}

/// Whether `ptr` is arena memory or a kept block.
#[inline(always)]
pub(crate) fn owns(ptr: *mut u8) -> bool {
    (ptr as usize).wrapping_sub(BASE.load(Ordering::Relaxed)) < LEN.load(Ordering::Relaxed)
}

/// Whether the calling thread is in arena mode.
#[inline]
pub(crate) fn in_mode() -> bool {
    STATE.with(|s| s.arena.get())
}

/// The arena's owner (see the module docs); 0 = none.
static OWNER: AtomicU64 = AtomicU64::new(0);
static NEXT_OWNER: AtomicU64 = AtomicU64::new(1);

/// A new owner id.
pub(crate) fn new_owner() -> u64 {
    NEXT_OWNER.fetch_add(1, Ordering::Relaxed)
}

/// Runs `f` in arena mode when `owner` has the arena or can take it, else on the heap.
/// Whatever `f` allocates must be dropped before `owner` calls [`release`].
pub(crate) fn with<R>(owner: u64, f: impl FnOnce() -> R) -> R {
    let taken = OWNER.load(Ordering::Acquire) == owner
        || OWNER
            .compare_exchange(0, owner, Ordering::Acquire, Ordering::Relaxed)
            .is_ok();
    if !taken || DISABLED.load(Ordering::Relaxed) || !reserve() {
        return f();
    }
    // Every allocation of this thread then takes the sampling allocator's slow path, where
    // arena mode is looked at (the fast path stays one countdown check for everyone).
    let _mode = Mode::set(true, COUNTDOWN_HELD);
    f()
}

/// Runs `f` on the heap when called in arena mode (for what must outlive the pass).
pub(crate) fn outside<R>(f: impl FnOnce() -> R) -> R {
    if !in_mode() {
        return f();
    }
    // The heap for what `f` allocates, through the slow path still (profiler code: its large
    // blocks are mappings of their own, see `super::bigblock`).
    let _mode = Mode::set(false, COUNTDOWN_HELD);
    f()
}

/// The calling thread's arena mode and allocation countdown, put back as they were on drop.
struct Mode {
    arena: bool,
    countdown: i64,
}

impl Mode {
    fn set(arena: bool, countdown: i64) -> Mode {
        STATE.with(|s| Mode {
            arena: s.arena.replace(arena),
            countdown: s.countdown.replace(countdown),
        })
    }
}

impl Drop for Mode {
    fn drop(&mut self) {
        STATE.with(|s| {
            s.arena.set(self.arena);
            s.countdown.set(self.countdown);
        });
    }
}

/// Reserves the address space once. False when the kernel refuses.
pub(crate) fn reserve() -> bool {
    if BASE.load(Ordering::Acquire) != 0 {
        return true;
    }
    // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            RESERVE,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return false;
    }
    // Threads of a sampled path and a symbolization pass may race here. BASE first: until LEN
    // is set nothing is owned (a LEN without its BASE would claim the lowest addresses).
    if BASE
        .compare_exchange(0, p as usize, Ordering::AcqRel, Ordering::Acquire)
        .is_err()
    {
        // SAFETY: our own mapping, never handed out.
        unsafe { libc::munmap(p, RESERVE) };
        return true;
    }
    LEN.store(RESERVE, Ordering::Release);
    true
}

/// Where the kept blocks' part of the reservation starts (0 before [`reserve`]).
pub(crate) fn keep_base() -> usize {
    match BASE.load(Ordering::Acquire) {
        0 => 0,
        b => b + ARENA_LEN,
    }
}

/// Bytes of the kept blocks' part of the reservation.
pub(crate) const KEEP_LEN: usize = RESERVE - ARENA_LEN;

/// Whether the profiler may use its private memory in this process (see [`disable`]).
pub(crate) fn enabled() -> bool {
    !DISABLED.load(Ordering::Relaxed)
}

pub(crate) fn class_of(layout: Layout) -> Option<usize> {
    let size = layout.size().max(layout.align()).max(1 << MIN_SHIFT);
    let shift = size.next_power_of_two().trailing_zeros();
    let c = (shift - MIN_SHIFT) as usize;
    (c < CLASSES).then_some(c)
}

/// A block for `layout`, or None (the caller uses the heap).
pub(crate) fn alloc(layout: Layout, zeroed: bool) -> Option<*mut u8> {
    if layout.align() > PAGE {
        return None;
    }
    let c = class_of(layout)?;
    let size = 1usize << (c + MIN_SHIFT as usize);
    let base = BASE.load(Ordering::Relaxed);
    let head = FREE[c].load(Ordering::Relaxed);
    if head != 0 {
        // SAFETY: `head` is a free block of this class in the arena; its first word is the
        // next free block.
        let next = unsafe { *(head as *const usize) };
        FREE[c].store(next, Ordering::Relaxed);
        if zeroed {
            // Blocks this large had their pages handed back when freed and read as zeros,
            // but for the free list's link in their first word.
            let dirty = if size >= RETURN_PAGES_AT {
                std::mem::size_of::<usize>()
            } else {
                size
            };
            // SAFETY: the block is `size` bytes of arena memory, now ours.
            unsafe { std::ptr::write_bytes(head as *mut u8, 0, dirty) };
        }
        return Some(head as *mut u8);
    }
    // Fresh blocks are aligned to their size up to a page (every class's alignment need).
    let align = size.min(PAGE);
    let used = USED.load(Ordering::Relaxed);
    let start = (used + align - 1) & !(align - 1);
    let end = start.checked_add(size)?;
    if end > ARENA_LEN.min(LEN.load(Ordering::Relaxed)) {
        return None;
    }
    USED.store(end, Ordering::Relaxed);
    // Pages no pass reached before are counted as the profiler's own in the free filter, before
    // a block on them is handed out (every free of one must take the allocator's slow path).
    // They stay counted after the pass: a block freed late still finds its way here, as it did
    // by address alone, and the counts never saturate from pass after pass. One owner at a
    // time: no other thread moves USED or MARKED meanwhile.
    let marked = MARKED.load(Ordering::Relaxed);
    if end > marked {
        FILTER.insert_own_range(base + marked, base + end);
        MARKED.store(end.next_multiple_of(PAGE), Ordering::Relaxed);
    }
    // Never handed out since the last release: the kernel's zero pages.
    Some((base + start) as *mut u8)
}

/// Frees an arena block or a kept block (any block [`owns`] says is ours).
pub(crate) fn free(ptr: *mut u8, layout: Layout) {
    if (ptr as usize).wrapping_sub(BASE.load(Ordering::Relaxed)) >= ARENA_LEN {
        return super::keep::free(ptr, layout);
    }
    let Some(c) = class_of(layout) else {
        return;
    };
    let size = 1usize << (c + MIN_SHIFT as usize);
    if size >= RETURN_PAGES_AT {
        // SAFETY: whole pages inside this free arena block (sizes this large are page-aligned
        // multiples of a page).
        unsafe { libc::madvise(ptr as *mut libc::c_void, size, libc::MADV_DONTNEED) };
    }
    // SAFETY: the block is at least 16 bytes and no longer used by anyone.
    unsafe { *(ptr as *mut usize) = FREE[c].load(Ordering::Relaxed) };
    FREE[c].store(ptr as usize, Ordering::Relaxed);
}

/// When `owner` has the arena: returns every page the pass touched to the kernel, starts
/// afresh and frees the arena for the next owner. Nothing `owner` allocated in arena mode may be
/// used afterwards.
pub(crate) fn release(owner: u64) {
    release_as(
        owner,
        crate::threads::PROCESS_ENDING.load(Ordering::Relaxed),
    );
}

/// [`release`]; `ending`: the process ends now, so its blocks are kept as they are (what the
/// owner did not drop included): the next owner, should the process go on after all, carries
/// on from them as within a pass, fresh blocks still reading as zeros.
fn release_as(owner: u64, ending: bool) {
    if OWNER.load(Ordering::Acquire) != owner {
        return;
    }
    if !ending {
        forget_blocks();
    }
    OWNER.store(0, Ordering::Release);
}

fn forget_blocks() {
    let used = USED.swap(0, Ordering::Relaxed);
    LAST_PASS_BYTES.store(used, Ordering::Relaxed);
    for f in &FREE {
        f.store(0, Ordering::Relaxed);
    }
    let base = BASE.load(Ordering::Relaxed);
    if used != 0 && base != 0 {
        let len = (used + PAGE - 1) & !(PAGE - 1);
        // SAFETY: the arena's own pages, no longer in use (see the module's invariants).
        unsafe { libc::madvise(base as *mut libc::c_void, len, libc::MADV_DONTNEED) };
    }
}

/// Bytes of arena the last pass used (its address-space high-water mark).
pub(crate) fn last_pass_bytes() -> u64 {
    LAST_PASS_BYTES.load(Ordering::Relaxed) as u64
}

/// In a forked child: a pass the parent had under way is gone with its thread; its blocks are
/// never freed (the child's symbolizer starts afresh), so the arena starts afresh too, its pages
/// zeroed again (fresh blocks are handed out as zeroed). Async-signal-safe.
pub(crate) fn after_fork_in_child() {
    forget_blocks();
    OWNER.store(0, Ordering::Release);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_come_back_zeroed_and_pages_go_back() {
        let owner = new_owner();
        // Other tests' symbolizers may hold the arena for a pass: wait for it.
        let mut owned = false;
        for _ in 0..5000 {
            if OWNER
                .compare_exchange(0, owner, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                owned = true;
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert!(owned, "the arena stayed taken");
        with(owner, || {
            for size in [24usize, 4096, 1 << 20] {
                let layout = Layout::from_size_align(size, 8).unwrap();
                let a = alloc(layout, true).expect("an arena block");
                assert!(owns(a));
                // SAFETY: `a` is `size` bytes of arena memory we own.
                let block = unsafe { std::slice::from_raw_parts_mut(a, size) };
                assert!(block.iter().all(|&b| b == 0), "fresh {size}");
                block.fill(0xa5);
                free(a, layout);
                let b = alloc(layout, true).expect("the freed block again");
                assert_eq!(a, b, "{size}: reused from its free list");
                // SAFETY: as above.
                let block = unsafe { std::slice::from_raw_parts(b, size) };
                assert!(block.iter().all(|&b| b == 0), "reused {size}");
                free(b, layout);
            }
        });
        release(owner);
        assert!(last_pass_bytes() >= 1 << 20);
    }

    /// Waits for the arena to be free, then takes it for a new owner.
    fn take() -> u64 {
        let owner = new_owner();
        for _ in 0..5000 {
            if OWNER
                .compare_exchange(0, owner, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                return owner;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        panic!("the arena stayed taken");
    }

    #[test]
    fn a_release_as_the_process_ends_leaves_later_zeroed_blocks_zero() {
        let owner = take();
        let layouts = [24usize, 4096].map(|s| Layout::from_size_align(s, 8).unwrap());
        with(owner, || {
            for l in layouts {
                // One block left allocated (a symbolizer's tables left to the exit), one
                // freed, both written.
                for keep in [true, false] {
                    let a = alloc(l, false).expect("an arena block");
                    // SAFETY: `a` is `l.size()` bytes of arena memory we own.
                    unsafe { std::ptr::write_bytes(a, 0xa5, l.size()) };
                    if !keep {
                        free(a, l);
                    }
                }
            }
        });
        release_as(owner, true);
        // The process went on (an exec that failed): the next pass's zeroed blocks, reused
        // or fresh, read as zeros.
        let owner = take();
        with(owner, || {
            for l in layouts {
                let blocks: Vec<*mut u8> =
                    (0..3).map(|_| alloc(l, true).expect("a block")).collect();
                for &b in &blocks {
                    // SAFETY: as above.
                    let bytes = unsafe { std::slice::from_raw_parts(b, l.size()) };
                    assert!(bytes.iter().all(|&x| x == 0), "{} bytes", l.size());
                }
                for b in blocks {
                    free(b, l);
                }
            }
        });
        release(owner);
    }

    #[test]
    fn size_classes_cover_size_and_alignment() {
        let l = |s, a| Layout::from_size_align(s, a).unwrap();
        assert_eq!(class_of(l(1, 1)), Some(0));
        assert_eq!(class_of(l(16, 8)), Some(0));
        assert_eq!(class_of(l(17, 8)), Some(1));
        assert_eq!(class_of(l(8, 64)), Some(2));
        assert_eq!(class_of(l(1 << 30, 8)), Some(26));
        assert_eq!(class_of(l(1 << 31, 8)), None);
    }
}
