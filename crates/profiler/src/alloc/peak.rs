//! The estimated peak of the live heap.
//!
//! A process-wide running estimate of live heap bytes, moved only by the heap profile's own
//! events: a sampled allocation the heap recorder tracks adds the bytes its record stands for
//! (weight x size, its `heap-live-size`), and the free of a tracked allocation takes the same
//! bytes back (the recorder returns them with the record). Its maximum is the peak. Unsampled
//! allocations and frees never reach it: it costs nothing on the fast path.
//!
//! The estimate at any moment is the heap profile's total at that moment, with the same
//! sampling error (a standard deviation of at most `sqrt(live x interval)`). The peak is the
//! largest of those estimates, so it leans high by the noise of the estimate near the true peak
//! (a maximum of noisy values), never by more than a few standard deviations.
//!
//! Updated on application threads, inside the sampling path: atomics only (lock-free,
//! allocation-free, async-signal-safe).

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

/// The running estimate and its maximum.
pub(crate) struct HeapEstimate {
    /// Signed: a free racing with the add of its own allocation (a program freeing a block
    /// another thread is still returning from `malloc`) may take it below zero for a moment.
    live: AtomicI64,
    peak: AtomicU64,
}

/// The running profiler's estimate (reset when a profiler starts: its heap recorder starts
/// empty).
pub(crate) static HEAP_ESTIMATE: HeapEstimate = HeapEstimate::new();

impl HeapEstimate {
    pub(crate) const fn new() -> Self {
        HeapEstimate {
            live: AtomicI64::new(0),
            peak: AtomicU64::new(0),
        }
    }

    /// A tracked allocation standing for `bytes`.
    pub(crate) fn tracked(&self, bytes: u64) {
        let b = i64::try_from(bytes).unwrap_or(i64::MAX);
        let now = self.live.fetch_add(b, Ordering::Relaxed).saturating_add(b);
        self.peak.fetch_max(now.max(0) as u64, Ordering::Relaxed);
    }

    /// The free of a tracked allocation that stood for `bytes`.
    pub(crate) fn untracked(&self, bytes: u64) {
        let b = i64::try_from(bytes).unwrap_or(i64::MAX);
        self.live.fetch_sub(b, Ordering::Relaxed);
    }

    /// Estimated live bytes now.
    pub(crate) fn live(&self) -> u64 {
        self.live.load(Ordering::Relaxed).max(0) as u64
    }

    /// The largest estimate of live bytes so far.
    pub(crate) fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }

    /// Back to an empty heap (a profiler starting with an empty heap recorder).
    pub(crate) fn reset(&self) {
        self.live.store(0, Ordering::Relaxed);
        self.peak.store(0, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peak_is_the_largest_running_total() {
        let e = HeapEstimate::new();
        e.tracked(100);
        e.tracked(50);
        e.untracked(100);
        assert_eq!((e.live(), e.peak()), (50, 150));
        e.tracked(80);
        assert_eq!((e.live(), e.peak()), (130, 150));
        e.tracked(30);
        assert_eq!((e.live(), e.peak()), (160, 160));
        e.untracked(80);
        e.untracked(30);
        e.untracked(50);
        assert_eq!((e.live(), e.peak()), (0, 160));
        e.reset();
        assert_eq!((e.live(), e.peak()), (0, 0));
    }

    #[test]
    fn a_free_ahead_of_its_add_never_reads_negative() {
        let e = HeapEstimate::new();
        e.untracked(40);
        assert_eq!((e.live(), e.peak()), (0, 0));
        e.tracked(40);
        e.tracked(10);
        assert_eq!((e.live(), e.peak()), (10, 10));
    }

    #[test]
    fn concurrent_updates_balance() {
        let e = HeapEstimate::new();
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for i in 0..10_000u64 {
                        e.tracked(i % 7 + 1);
                        e.untracked(i % 7 + 1);
                    }
                });
            }
        });
        assert_eq!(e.live(), 0);
        // At most every thread's one block live at once.
        assert!((1..=4 * 7).contains(&e.peak()), "{}", e.peak());
    }
}
