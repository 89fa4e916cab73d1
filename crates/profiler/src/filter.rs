//! The filter every free goes through before any heap-tracking lookup.
//!
//! A counting filter: one byte counter per 256-byte address granule, modulo 2^20 granules (1 MiB
//! of counters in `.bss`; untouched pages cost no memory, and all read as the one shared zero
//! page). Tracking an address increments its counter, untracking decrements it. A zero counter
//! proves the address is not tracked, so a free of untracked memory costs one byte load. The
//! index keeps address locality and is coarse on purpose: a heap of H bytes reads at most H/256
//! filter bytes (8 KiB for a 2 MiB live set), which stay in cache next to the program's own data;
//! a finer granule made every free a likely cache miss. A non-zero counter only means "maybe"
//! (another block in the same granule is tracked, or an address 256 MiB away aliases): the
//! recorder is then asked, and answers exactly. Collisions therefore never lose a free; they only
//! cost a lookup. A counter that reaches 255 sticks there (forever "maybe"), still correct.

use std::sync::atomic::{AtomicU8, Ordering};

const BITS: u32 = 20;
const SIZE: usize = 1 << BITS;
/// 256-byte granules (see the module docs for why this coarse).
const GRANULE_SHIFT: u32 = 8;

#[repr(C, align(4096))]
pub(crate) struct FreeFilter {
    counters: [AtomicU8; SIZE],
}

pub(crate) static FILTER: FreeFilter = FreeFilter {
    counters: [const { AtomicU8::new(0) }; SIZE],
};

#[inline(always)]
fn index(addr: usize) -> usize {
    (addr >> GRANULE_SHIFT) & (SIZE - 1)
}

impl FreeFilter {
    /// False means `addr` is certainly not tracked.
    #[inline(always)]
    pub fn maybe_tracked(&self, addr: usize) -> bool {
        // Relaxed suffices: an address is tracked before the allocation is handed to the
        // program, so any free of it happens after the increment (coherence order).
        self.counters[index(addr)].load(Ordering::Relaxed) != 0
    }

    /// Counts one more tracked address at `addr`'s counter.
    pub fn insert(&self, addr: usize) {
        let c = &self.counters[index(addr)];
        let _ = c.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
            (v != u8::MAX).then_some(v + 1)
        });
    }

    /// Counts one tracked address fewer (after the recorder confirmed it was tracked).
    pub fn remove(&self, addr: usize) {
        let c = &self.counters[index(addr)];
        let _ = c.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
            // A saturated counter no longer knows how many addresses it stands for.
            (v != 0 && v != u8::MAX).then(|| v - 1)
        });
    }

    /// Forgets everything (when no recorder holds tracked addresses any more).
    pub fn clear(&self) {
        for c in self.counters.iter() {
            if c.load(Ordering::Relaxed) != 0 {
                c.store(0, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_never_loses_a_colliding_address() {
        let f: &FreeFilter = &FILTER;
        let a = 0x7000_0000_1000usize;
        let b = a + (SIZE << GRANULE_SHIFT); // same counter
        assert!(!f.maybe_tracked(a));
        f.insert(a);
        f.insert(b);
        assert!(f.maybe_tracked(a) && f.maybe_tracked(b));
        f.remove(a);
        assert!(f.maybe_tracked(b), "b is still tracked");
        f.remove(b);
        assert!(!f.maybe_tracked(a) && !f.maybe_tracked(b));
    }
}
