//! The filter every free goes through before any heap-tracking lookup.
//!
//! The address space is cut into 256-byte granules, taken modulo 2^22 (1 GiB). Each granule has
//! a *bit* (read by every free) and a *counter* of the tracked addresses in it (touched only when
//! an address is tracked or untracked). Invariant: a granule's bit is set whenever its counter is
//! non-zero. A clear bit therefore proves the address is not tracked, so a free of untracked
//! memory costs one load from the bit array.
//!
//! Why bits apart from counters: the bit array is what the program's frees keep in cache, and it
//! is 8x denser than byte counters: a heap of H bytes reads at most H/2048 filter bytes (1 KiB
//! for a 2 MiB live set, where byte counters took 8 KiB and missed the L1 cache on most frees in
//! the allocation benchmark). The granule is coarse for the same reason; finer granules spread
//! the reads further. The counters (4 MiB of `.bss`, of which only pages holding tracked
//! granules are ever touched) stay out of the free path.
//!
//! A set bit only means "maybe" (another block in the same granule is tracked, or an address
//! 1 GiB away aliases): the recorder is then asked, and answers exactly. Collisions never lose a
//! free; they only cost a lookup. A counter that reaches [`SATURATED`] sticks there (forever
//! "maybe"), still correct.
//!
//! Concurrency: a counter's 0 -> 1 and 1 -> 0 transitions and the matching bit update must
//! look atomic to other inserts and removes of the same granule (else an insert could return
//! before "its" bit is set, or a remove could clear the bit of a newer insert). The thread making
//! such a transition marks the counter [`BUSY`] until the bit is updated; others wait those few
//! instructions. Both run inside `crate::forkgate::outside_fork`, so no fork ever sees a
//! counter left busy.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

const BITS: u32 = 22;
const GRANULES: usize = 1 << BITS;
/// 256-byte granules (see the module docs for why this coarse).
const GRANULE_SHIFT: u32 = 8;
/// Set while a counter moves between 0 and 1 and its bit is updated.
const BUSY: u8 = 0x80;
/// A counter that went this high no longer knows how many addresses it stands for.
const SATURATED: u8 = 0x7f;

#[repr(C, align(4096))]
pub(crate) struct FreeFilter {
    bits: [AtomicU64; GRANULES / 64],
    counters: [AtomicU8; GRANULES],
}

pub(crate) static FILTER: FreeFilter = FreeFilter {
    bits: [const { AtomicU64::new(0) }; GRANULES / 64],
    counters: [const { AtomicU8::new(0) }; GRANULES],
};

#[inline(always)]
fn index(addr: usize) -> usize {
    (addr >> GRANULE_SHIFT) & (GRANULES - 1)
}

impl FreeFilter {
    /// False means `addr` is certainly not tracked.
    #[inline(always)]
    pub fn maybe_tracked(&self, addr: usize) -> bool {
        let i = index(addr);
        // Relaxed suffices: an address is inserted before the allocation is handed to the
        // program, so any free of it happens after the bit was set (coherence order).
        self.bits[i / 64].load(Ordering::Relaxed) & (1 << (i % 64)) != 0
    }

    /// Counts one more tracked address at `addr`'s granule.
    pub fn insert(&self, addr: usize) {
        let i = index(addr);
        let c = &self.counters[i];
        let prev = transition(c, |v| {
            (v != SATURATED).then(|| if v == 0 { BUSY } else { v + 1 })
        });
        if prev == Some(0) {
            // Busy until the bit is set: an insert that sees the count at 1 must find the bit
            // set too (its address may be freed as soon as it returns).
            self.bits[i / 64].fetch_or(1 << (i % 64), Ordering::Release);
            c.store(1, Ordering::Release);
        }
    }

    /// Counts one tracked address fewer (after the recorder confirmed it was tracked).
    pub fn remove(&self, addr: usize) {
        let i = index(addr);
        let c = &self.counters[i];
        let prev = transition(c, |v| {
            (v != 0 && v != SATURATED).then(|| if v == 1 { BUSY } else { v - 1 })
        });
        if prev == Some(1) {
            self.bits[i / 64].fetch_and(!(1 << (i % 64)), Ordering::Release);
            c.store(0, Ordering::Release);
        }
    }

    /// Forgets everything (when no recorder holds tracked addresses any more). Visits only the
    /// set bits, so the untouched counter pages stay untouched.
    pub fn clear(&self) {
        for (w, word) in self.bits.iter().enumerate() {
            let mut set = word.swap(0, Ordering::Relaxed);
            while set != 0 {
                let b = set.trailing_zeros() as usize;
                self.counters[w * 64 + b].store(0, Ordering::Relaxed);
                set &= set - 1;
            }
        }
    }
}

/// Replaces counter `c`'s value `v` by `next(v)` (compare-and-swap), waiting while another
/// thread holds it [`BUSY`]; returns the value replaced, or `None` when `next` declined.
#[inline]
fn transition(c: &AtomicU8, next: impl Fn(u8) -> Option<u8>) -> Option<u8> {
    let mut cur = c.load(Ordering::Relaxed);
    loop {
        if cur & BUSY != 0 {
            std::hint::spin_loop();
            cur = c.load(Ordering::Relaxed);
            continue;
        }
        match c.compare_exchange_weak(cur, next(cur)?, Ordering::AcqRel, Ordering::Relaxed) {
            Ok(_) => return Some(cur),
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
        let neighbour = a + (1 << GRANULE_SHIFT); // next granule, same bit word
        assert!(!f.maybe_tracked(a));
        f.insert(a);
        f.insert(b);
        assert!(f.maybe_tracked(a) && f.maybe_tracked(b));
        assert!(!f.maybe_tracked(neighbour));
        f.remove(a);
        assert!(f.maybe_tracked(b), "b is still tracked");
        f.remove(b);
        assert!(!f.maybe_tracked(a) && !f.maybe_tracked(b));
        // Removing what is not counted changes nothing.
        f.remove(a);
        assert!(!f.maybe_tracked(a));
    }

    #[test]
    fn saturated_counter_stays_maybe() {
        let f = fresh();
        let a = 0x7000_0000_2000usize;
        for _ in 0..SATURATED as usize + 10 {
            f.insert(a);
        }
        for _ in 0..SATURATED as usize + 10 {
            f.remove(a);
        }
        assert!(f.maybe_tracked(a));
        f.clear();
        assert!(!f.maybe_tracked(a));
        f.insert(a);
        assert!(f.maybe_tracked(a), "counter reset by clear");
    }

    /// Threads insert and remove addresses that share granules and bit words; whatever the
    /// interleaving, an address a thread holds inserted is always seen as maybe tracked.
    #[test]
    fn concurrent_inserts_and_removes_never_hide_a_tracked_address() {
        let f: &'static FreeFilter = Box::leak(fresh());
        let base = 0x7100_0000_0000usize;
        let threads: Vec<_> = (0..4usize)
            .map(|t| {
                std::thread::spawn(move || {
                    for round in 0..20_000usize {
                        // Four granules in one bit word, shared by all threads.
                        let a = base + (((round + t) % 4) << GRANULE_SHIFT) + t * 8;
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
            assert!(!f.maybe_tracked(base + (g << GRANULE_SHIFT)), "granule {g}");
        }
    }
}
