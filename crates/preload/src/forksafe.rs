//! A lock a forked child can always take: the library's `pthread_atfork` handlers hold every
//! such lock across a `fork` (so no other thread holds one when the child is made, and the data
//! it guards is whole), then release it in the parent and in the child. A `std` mutex held by
//! another thread at the fork would stay locked in the child for ever, and a child calling
//! `pclose` or `system` would hang on it.
//!
//! Contention is rare (`popen`, `pclose` and `system` calls), so waiting is a yield loop.
//!
//! A fork from a signal handler that interrupted the holder on its own thread (`fork` is
//! async-signal-safe) does not wait for itself: the prepare handler leaves that lock to its
//! holder, which goes on (and releases it) in the parent and in the child alike.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

pub(crate) struct ForkSafeLock<T> {
    /// The holder's thread id; 0 when free.
    owner: AtomicI32,
    /// Whether the prepare handler holds it (to release in the parent and child handlers).
    held_for_fork: AtomicBool,
    data: UnsafeCell<T>,
}

fn current_tid() -> i32 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::gettid() }
}

// SAFETY: the data is reached only through a guard, which the lock hands to one thread at a time.
unsafe impl<T: Send> Sync for ForkSafeLock<T> {}

pub(crate) struct Guard<'a, T>(&'a ForkSafeLock<T>);

impl<T> ForkSafeLock<T> {
    pub(crate) const fn new(data: T) -> Self {
        ForkSafeLock {
            owner: AtomicI32::new(0),
            held_for_fork: AtomicBool::new(false),
            data: UnsafeCell::new(data),
        }
    }

    pub(crate) fn lock(&self) -> Guard<'_, T> {
        self.acquire(current_tid());
        Guard(self)
    }

    fn acquire(&self, tid: i32) {
        while self
            .owner
            .compare_exchange_weak(0, tid, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::thread::yield_now();
        }
    }

    fn release(&self) {
        self.owner.store(0, Ordering::Release);
    }

    /// The prepare handler: holds the lock across the fork, unless this very thread holds it
    /// (a handler forking while it interrupted the holder).
    pub(crate) fn hold_for_fork(&self) {
        let tid = current_tid();
        if self.owner.load(Ordering::Relaxed) != tid {
            self.acquire(tid);
            self.held_for_fork.store(true, Ordering::Relaxed);
        }
    }

    /// The parent and child handlers: gives back what [`Self::hold_for_fork`] took.
    pub(crate) fn release_after_fork(&self) {
        if self.held_for_fork.swap(false, Ordering::Relaxed) {
            self.release();
        }
    }
}

impl<T> std::ops::Deref for Guard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard holds the lock: no other reference to the data exists.
        unsafe { &*self.0.data.get() }
    }
}

impl<T> std::ops::DerefMut for Guard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as above, and the guard is borrowed mutably.
        unsafe { &mut *self.0.data.get() }
    }
}

impl<T> Drop for Guard<'_, T> {
    fn drop(&mut self) {
        self.0.release();
    }
}
