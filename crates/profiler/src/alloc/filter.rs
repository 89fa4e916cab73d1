//! The filter every free goes through: one load says "certainly none of ours" or "maybe".
//!
//! The address space is cut into 4 KiB granules, taken modulo 4 GiB (2^20 of them). Each has a
//! 32-bit word:
//! - bits 24–31 count the *profiler's own* memory there (pages of the arena and kept blocks,
//!   the first page of each large block of [`super::bigblock`]);
//! - bits 16–23 count the *tracked* addresses in it (sampled live objects of the heap profile);
//! - bits 0–15 mark which of its sixteen 256-byte parts hold a tracked address. A mark is only
//!   cleared when the page's tracked count returns to zero, so the marks are a superset.
//!
//! A free whose word is zero goes straight to the inner allocator; any other free takes the
//! allocator's cold path, which asks the word's mark for its own 256 bytes before anything
//! else: a free that merely shares a page with a live sample (about one free in a hundred in
//! an allocation-heavy program, each of which used to ask the heap recorder) ends there, on a
//! word already in cache. So the free fast path is one load of shared state and a branch.
//!
//! Why a word per page rather than a bit per 256 bytes (the filter before): the test is a load
//! and a compare, with no bit to pick out of the word; the filter stays small against the heap
//! it covers (4 KiB of filter for 4 MiB of heap); and the counts need no busy protocol between a
//! bit and its counter. Every update is one compare-and-swap loop on the word, never a wait on
//! another thread: a signal handler that allocates on a thread interrupted half-way through an
//! update simply does its own, and a fork never finds anything half done.
//!
//! A non-zero word only means "maybe" (a neighbour in the page is tracked, or an address a
//! multiple of 4 GiB away aliases): the cold path then asks exactly. A count that reaches 255
//! sticks there with its marks (forever "maybe"), still correct. The 4 MiB of words are
//! `.bss`: a page of them is touched only where something was counted; reads of the rest map
//! the kernel's zero page.

use std::sync::atomic::{AtomicU32, Ordering};

/// The low 32 bits of an address pick its word: 2^20 granules of 4 KiB, a span of 4 GiB.
const GRANULES: usize = 1 << (32 - GRANULE_SHIFT);
/// 4 KiB granules: a page, the unit the profiler's private memory is marked in.
const GRANULE_SHIFT: u32 = 12;
const GRANULE: usize = 1 << GRANULE_SHIFT;
const SATURATED: u32 = 0xff;
/// The tracked count's and the own count's places in a word.
const TRACKED_SHIFT: u32 = 16;
const OWN_SHIFT: u32 = 24;
const MARKS: u32 = 0xffff;

#[repr(C, align(4096))]
pub(crate) struct FreeFilter {
    words: [AtomicU32; GRANULES],
}

pub(crate) static FILTER: FreeFilter = FreeFilter {
    words: [const { AtomicU32::new(0) }; GRANULES],
};

/// Truncated to 32 bits before the shift: the compiler's copy of the address into a 32-bit
/// register is the mask (one instruction fewer on every free than a shift and an `and`).
#[inline(always)]
fn index(addr: usize) -> usize {
    ((addr as u32) >> GRANULE_SHIFT) as usize
}

/// The mark of `addr`'s 256-byte part within its granule's word.
#[inline(always)]
fn mark(addr: usize) -> u32 {
    1 << ((addr >> 8) & 15)
}

impl FreeFilter {
    /// False means `addr` is certainly neither tracked nor the profiler's own memory.
    ///
    /// Relaxed suffices: an address is counted before its block is handed out, so any free of
    /// it happens after the count (coherence order).
    #[inline(always)]
    pub fn maybe(&self, addr: usize) -> bool {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: reads one aligned word of `self.words` (the index is below `GRANULES`), as
        // a relaxed atomic load does on x86-64; writes nothing. A compare with memory: the
        // compiler does not fold an atomic load into one, and this is every free's path.
        unsafe {
            std::arch::asm!(
                "cmp dword ptr [{words} + {i} * 4], 0",
                "jne {maybe}",
                words = in(reg) self.words.as_ptr(),
                i = in(reg) index(addr),
                maybe = label { return true; },
                options(nostack, readonly),
            );
            false
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self.words[index(addr)].load(Ordering::Relaxed) != 0
        }
    }

    /// Whether `addr`'s 256 bytes may hold a tracked address (the cold path's second
    /// question).
    #[inline]
    pub fn maybe_tracked(&self, addr: usize) -> bool {
        self.words[index(addr)].load(Ordering::Relaxed) & mark(addr) != 0
    }

    /// Counts one more tracked address at `addr`'s granule and marks its 256 bytes.
    pub fn insert(&self, addr: usize) {
        let m = mark(addr);
        update(&self.words[index(addr)], |w| {
            let n = (w >> TRACKED_SHIFT) & SATURATED;
            let n = if n == SATURATED { n } else { n + 1 };
            Some(with_count(w, TRACKED_SHIFT, n) | m)
        });
    }

    /// Counts one tracked address fewer (after the recorder confirmed it was tracked); the
    /// granule's marks go with its last one.
    pub fn remove(&self, addr: usize) {
        update(&self.words[index(addr)], |w| {
            let n = (w >> TRACKED_SHIFT) & SATURATED;
            match n {
                0 | SATURATED => None,
                1 => Some(with_count(w, TRACKED_SHIFT, 0) & !MARKS),
                _ => Some(with_count(w, TRACKED_SHIFT, n - 1)),
            }
        });
    }

    /// Counts the profiler's own memory at `addr`'s granule.
    pub fn insert_own(&self, addr: usize) {
        update(&self.words[index(addr)], |w| {
            let n = w >> OWN_SHIFT;
            (n != SATURATED).then(|| with_count(w, OWN_SHIFT, n + 1))
        });
    }

    /// Counts the profiler's own memory at `addr`'s granule one fewer.
    pub fn remove_own(&self, addr: usize) {
        update(&self.words[index(addr)], |w| {
            let n = w >> OWN_SHIFT;
            (n != 0 && n != SATURATED).then(|| with_count(w, OWN_SHIFT, n - 1))
        });
    }

    /// [`Self::insert_own`] for every granule of `[start, end)`.
    pub fn insert_own_range(&self, start: usize, end: usize) {
        let mut g = start & !(GRANULE - 1);
        while g < end {
            self.insert_own(g);
            g += GRANULE;
        }
    }

    /// Forgets every tracked address (when no recorder holds any); the profiler's own memory
    /// stays counted. Reads the whole table once (4 MiB; untouched pages read as zeros).
    pub fn clear_tracked(&self) {
        for w in &self.words {
            if w.load(Ordering::Relaxed) & !(SATURATED << OWN_SHIFT) != 0 {
                w.fetch_and(SATURATED << OWN_SHIFT, Ordering::Relaxed);
            }
        }
    }
}

/// `w` with its 8-bit count at `shift` replaced by `n`.
fn with_count(w: u32, shift: u32, n: u32) -> u32 {
    (w & !(SATURATED << shift)) | (n << shift)
}

/// Replaces word `w` by `next(w)` (compare-and-swap; never waits on another thread); leaves it
/// when `next` declines.
#[inline]
fn update(w: &AtomicU32, next: impl Fn(u32) -> Option<u32>) {
    let mut cur = w.load(Ordering::Relaxed);
    loop {
        let Some(new) = next(cur) else {
            return;
        };
        match w.compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => return,
            Err(v) => cur = v,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A filter of its own (the static one is shared with the allocator under test).
    fn fresh() -> Box<FreeFilter> {
        // SAFETY: all-zero bytes are valid atomics holding 0; the box owns the allocation.
        unsafe {
            let layout = std::alloc::Layout::new::<FreeFilter>();
            let p = std::alloc::alloc_zeroed(layout) as *mut FreeFilter;
            assert!(!p.is_null());
            Box::from_raw(p)
        }
    }

    #[test]
    fn counts_and_never_loses_a_colliding_address() {
        let f = fresh();
        let a = 0x7000_0000_1000usize;
        let b = a + (GRANULES << GRANULE_SHIFT); // same granule modulo the span
        let neighbour = a + GRANULE; // next granule
        assert!(!f.maybe(a));
        f.insert(a);
        f.insert(b);
        assert!(f.maybe(a) && f.maybe(b) && f.maybe_tracked(a));
        assert!(!f.maybe(neighbour));
        f.remove(a);
        assert!(f.maybe(b), "b is still tracked");
        f.remove(b);
        assert!(!f.maybe(a) && !f.maybe(b));
        // Removing what is not counted changes nothing.
        f.remove(a);
        assert!(!f.maybe(a));
    }

    #[test]
    fn own_memory_and_tracked_addresses_count_apart() {
        let f = fresh();
        let a = 0x7000_0010_0000usize;
        f.insert_own_range(a + 100, a + 3 * GRANULE);
        for g in 0..3 {
            assert!(f.maybe(a + g * GRANULE), "own granule {g}");
        }
        assert!(!f.maybe(a + 3 * GRANULE));
        assert!(!f.maybe_tracked(a), "own memory is not tracked");
        f.insert(a + 8);
        f.clear_tracked();
        assert!(f.maybe(a) && !f.maybe_tracked(a), "clear keeps own memory");
        for g in 0..3 {
            f.remove_own(a + g * GRANULE);
        }
        assert!(!f.maybe(a) && !f.maybe(a + 2 * GRANULE));
        // Removing the own count of a granule that has none leaves tracked counts alone.
        f.insert(a);
        f.remove_own(a);
        assert!(f.maybe_tracked(a));
    }

    /// A free elsewhere in a page that holds a tracked address is told apart by its 256-byte
    /// mark; marks stay while any tracked address of the page does, and go with the last.
    #[test]
    fn marks_tell_a_tracked_address_from_its_page_neighbours() {
        let f = fresh();
        let page = 0x7000_0040_0000usize;
        let (a, b) = (page + 0x110, page + 0xa30);
        f.insert(a);
        assert!(f.maybe(page + 0x800), "the page is a maybe");
        assert!(
            f.maybe_tracked(a) && f.maybe_tracked(page + 0x1f0),
            "a's 256 bytes"
        );
        assert!(!f.maybe_tracked(page + 0x800) && !f.maybe_tracked(page + 0x210));
        f.insert(b);
        f.remove(a);
        assert!(f.maybe_tracked(b), "b stays");
        assert!(
            f.maybe_tracked(a),
            "marks are only cleared with the page's last address"
        );
        f.remove(b);
        assert!(!f.maybe(a) && !f.maybe_tracked(a) && !f.maybe_tracked(b));
    }

    #[test]
    fn saturated_count_stays_maybe() {
        let f = fresh();
        let a = 0x7000_0000_2000usize;
        for _ in 0..SATURATED as usize + 10 {
            f.insert(a);
        }
        for _ in 0..SATURATED as usize + 10 {
            f.remove(a);
        }
        assert!(f.maybe(a));
        f.clear_tracked();
        assert!(!f.maybe(a));
        f.insert(a);
        assert!(f.maybe(a), "count reset by clear");
    }

    /// Threads insert and remove addresses that share granules; whatever the interleaving, an
    /// address a thread holds inserted is always seen as maybe tracked, and own counts
    /// updated meanwhile on the same words are kept.
    #[test]
    fn concurrent_updates_never_hide_a_tracked_address() {
        let f: &'static FreeFilter = Box::leak(fresh());
        let base = 0x7100_0000_0000usize;
        let threads: Vec<_> = (0..4usize)
            .map(|t| {
                std::thread::spawn(move || {
                    for round in 0..20_000usize {
                        let a = base + (((round + t) % 4) << GRANULE_SHIFT) + t * 8;
                        if t == 3 {
                            f.insert_own(a);
                            assert!(f.maybe(a));
                            f.remove_own(a);
                            continue;
                        }
                        f.insert(a);
                        assert!(f.maybe_tracked(a), "thread {t} round {round}");
                        f.remove(a);
                    }
                })
            })
            .collect();
        for h in threads {
            h.join().unwrap();
        }
        for g in 0..4 {
            assert!(!f.maybe(base + (g << GRANULE_SHIFT)), "granule {g}");
        }
    }
}
