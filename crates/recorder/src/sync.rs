//! Atomics used by the slot gates, behind one path so a `loom` model check can swap them in
//! (`RUSTFLAGS="--cfg loom"` with loom added as a dependency) without touching the protocol code.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicUsize, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicUsize, Ordering};

/// Yields while a waiter polls (a spin-loop hint under std, a scheduling point under loom).
#[inline]
pub(crate) fn backoff(round: u32) {
    #[cfg(loom)]
    {
        let _ = round;
        loom::thread::yield_now();
    }
    #[cfg(not(loom))]
    {
        if round < 64 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}
