//! A lock a forked child can always take: the library's `pthread_atfork` handlers hold every
//! such lock across a `fork` (so no other thread holds one when the child is made, and the data
//! it guards is whole), then release it in the parent and in the child. A `std` mutex held by
//! another thread at the fork would stay locked in the child for ever, and a child calling
//! `pclose` or `system` would hang on it.
//!
//! Contention is rare (`popen`, `pclose` and `system` calls), so waiting is a yield loop.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, Ordering};

pub(crate) struct ForkSafeLock<T> {
    locked: AtomicBool,
    data: UnsafeCell<T>,
}

// SAFETY: the data is reached only through a guard, which the lock hands to one thread at a time.
unsafe impl<T: Send> Sync for ForkSafeLock<T> {}

pub(crate) struct Guard<'a, T>(&'a ForkSafeLock<T>);

impl<T> ForkSafeLock<T> {
    pub(crate) const fn new(data: T) -> Self {
        ForkSafeLock {
            locked: AtomicBool::new(false),
            data: UnsafeCell::new(data),
        }
    }

    pub(crate) fn lock(&self) -> Guard<'_, T> {
        self.acquire();
        Guard(self)
    }

    /// Takes the lock without a guard (the prepare handler); [`Self::release`] gives it back.
    pub(crate) fn acquire(&self) {
        while self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::thread::yield_now();
        }
    }

    /// Gives back what [`Self::acquire`] took (the parent and child handlers).
    pub(crate) fn release(&self) {
        self.locked.store(false, Ordering::Release);
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
