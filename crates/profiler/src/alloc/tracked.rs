//! The exact answer to "is this address tracked?" for frees the filter lets through.
//!
//! The filter ([`super::filter`]) counts tracked addresses per 4 KiB page, so every free in a
//! page that holds a tracked object is a "maybe": with a few live samples among thousands of
//! small blocks, about one free in a hundred, each of which asked the heap recorder (a lock
//! and a hash lookup, some 250 instructions) only to hear "no". This set answers most of them
//! with one cache line of atomics.
//!
//! A bucket (one cache line) holds up to seven tracked addresses and a count of those that
//! found it full. An address is inserted before its block is handed back to the application
//! and removed after the recorder confirmed it was tracked; a free whose address is not in its
//! bucket, while the bucket counts no overflow, is certainly not tracked. Every update is a
//! compare-and-swap that never waits, so a signal handler's allocation on a thread interrupted
//! half-way through one does its own, and a forked child finds nothing half done. An entry the
//! recorder no longer tracks (a profiler stopped in between) only costs the recorder's lookup,
//! as before this set; it is never a missed untrack.

use std::sync::atomic::{AtomicUsize, Ordering};

/// 2,048 buckets of 7: 14,336 addresses before buckets overflow on average, 128 KiB of `.bss`
/// (pages touched only where addresses landed).
const BUCKETS: usize = 1 << 11;
const SLOTS: usize = 7;

#[repr(C, align(64))]
struct Bucket {
    slots: [AtomicUsize; SLOTS],
    /// Tracked addresses of this bucket that found every slot taken.
    overflow: AtomicUsize,
}

pub(crate) struct TrackedSet {
    buckets: [Bucket; BUCKETS],
}

pub(crate) static TRACKED: TrackedSet = TrackedSet {
    buckets: [const {
        Bucket {
            slots: [const { AtomicUsize::new(0) }; SLOTS],
            overflow: AtomicUsize::new(0),
        }
    }; BUCKETS],
};

impl TrackedSet {
    fn bucket(&self, addr: usize) -> &Bucket {
        // Blocks are 16-byte aligned: the low bits carry nothing. Fibonacci hashing spreads
        // neighbouring blocks over buckets.
        let h = ((addr >> 4) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            >> (64 - BUCKETS.trailing_zeros());
        &self.buckets[h as usize]
    }

    /// Adds tracked address `addr` (not 0). Relaxed suffices: the block is handed out after
    /// this, so its free comes after it (coherence order, as for the filter).
    pub fn insert(&self, addr: usize) {
        let b = self.bucket(addr);
        for s in &b.slots {
            if s.load(Ordering::Relaxed) == 0
                && s.compare_exchange(0, addr, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
            {
                return;
            }
        }
        b.overflow.fetch_add(1, Ordering::Relaxed);
    }

    /// False means `addr` is certainly not tracked.
    #[inline]
    pub fn may_hold(&self, addr: usize) -> bool {
        let b = self.bucket(addr);
        b.slots.iter().any(|s| s.load(Ordering::Relaxed) == addr)
            || b.overflow.load(Ordering::Relaxed) != 0
    }

    /// Forgets `addr`, which the recorder just confirmed was tracked: its slot, else one of
    /// its bucket's overflow count.
    pub fn remove(&self, addr: usize) {
        let b = self.bucket(addr);
        for s in &b.slots {
            if s.load(Ordering::Relaxed) == addr
                && s.compare_exchange(addr, 0, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
            {
                return;
            }
        }
        let _ = b
            .overflow
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
    }

    /// Forgets every address (when no recorder tracks any). Touches only buckets in use.
    pub fn clear(&self) {
        for b in &self.buckets {
            for s in &b.slots {
                if s.load(Ordering::Relaxed) != 0 {
                    s.store(0, Ordering::Relaxed);
                }
            }
            if b.overflow.load(Ordering::Relaxed) != 0 {
                b.overflow.store(0, Ordering::Relaxed);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A set of its own (the static one is shared with the allocator under test).
    fn fresh() -> Box<TrackedSet> {
        // SAFETY: all-zero bytes are valid atomics holding 0; the box owns the allocation.
        unsafe {
            let layout = std::alloc::Layout::new::<TrackedSet>();
            let p = std::alloc::alloc_zeroed(layout) as *mut TrackedSet;
            assert!(!p.is_null());
            Box::from_raw(p)
        }
    }

    #[test]
    fn holds_what_was_inserted_and_not_its_neighbours() {
        let s = fresh();
        let a = 0x7f00_1234_5670usize;
        assert!(!s.may_hold(a));
        s.insert(a);
        assert!(s.may_hold(a));
        assert!(!s.may_hold(a + 16));
        s.remove(a);
        assert!(!s.may_hold(a));
    }

    /// More addresses in one bucket than it has slots: every one stays "maybe" until it is
    /// removed, and once all are removed the bucket says "no" again.
    #[test]
    fn a_full_bucket_never_loses_an_address() {
        let s = fresh();
        let base = 0x5500_0000_0000usize;
        let target = s.bucket(base) as *const Bucket;
        let same: Vec<usize> = (0..200_000usize)
            .map(|i| base + i * 16)
            .filter(|&a| std::ptr::eq(s.bucket(a), target))
            .take(SLOTS + 5)
            .collect();
        assert_eq!(same.len(), SLOTS + 5);
        for &a in &same {
            s.insert(a);
        }
        for &a in &same {
            assert!(s.may_hold(a));
        }
        // Removed in an order that frees slots while overflowed addresses remain.
        for (i, &a) in same.iter().enumerate() {
            s.remove(a);
            for &b in &same[i + 1..] {
                assert!(s.may_hold(b), "{b:#x} lost after removing {a:#x}");
            }
        }
        for &a in &same {
            assert!(!s.may_hold(a));
        }
    }

    #[test]
    fn clear_forgets_everything() {
        let s = fresh();
        let addrs: Vec<usize> = (1..5000usize).map(|i| 0x6000_0000 + i * 48).collect();
        for &a in &addrs {
            s.insert(a);
        }
        assert!(addrs.iter().all(|&a| s.may_hold(a)));
        s.clear();
        assert!(addrs.iter().all(|&a| !s.may_hold(a)));
    }
}
