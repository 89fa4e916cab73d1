//! A small spin lock (spin, then yield, then sleep) for the stack recorder's slot data, its
//! serializer bookkeeping and its stats.
//!
//! Why not `parking_lot::Mutex`: a forked child inherits the parent's lock words but none of its
//! threads. A parking lock that a vanished thread held, or that threads were parked on, can only
//! be released through the parking machinery, whose queues name threads that no longer exist
//! (releasing it can hang). This lock is one flag: [`SpinLock::force_unlock`] is a plain store.
//! Samplers hold a slot's lock for one add, so spinning briefly is the right wait anyway.

use std::cell::UnsafeCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

pub(crate) struct SpinLock<T> {
    locked: AtomicBool,
    value: UnsafeCell<T>,
}

// SAFETY: the lock gives one thread at a time access to `value` (acquire on lock, release on
// unlock), so sharing the lock between threads is as safe as sending the value between them.
unsafe impl<T: Send> Sync for SpinLock<T> {}

impl<T> SpinLock<T> {
    pub(crate) fn new(value: T) -> Self {
        SpinLock {
            locked: AtomicBool::new(false),
            value: UnsafeCell::new(value),
        }
    }

    #[inline]
    pub(crate) fn try_lock(&self) -> Option<SpinGuard<'_, T>> {
        self.locked
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .ok()
            .map(|_| SpinGuard { lock: self })
    }

    /// Spins, then yields until the lock is free: for locks held for short stretches (one add).
    #[inline]
    pub(crate) fn lock(&self) -> SpinGuard<'_, T> {
        if let Some(g) = self.try_lock() {
            return g;
        }
        self.lock_slow(false)
    }

    /// Like [`Self::lock`], but sleeps between polls once yielding did not help: for locks that
    /// may be held for milliseconds (a serialization waiting for another one).
    pub(crate) fn lock_long(&self) -> SpinGuard<'_, T> {
        if let Some(g) = self.try_lock() {
            return g;
        }
        self.lock_slow(true)
    }

    #[cold]
    fn lock_slow(&self, may_sleep: bool) -> SpinGuard<'_, T> {
        let mut round = 0u32;
        loop {
            // Wait on a plain load so waiters do not bounce the cache line while it is held.
            while self.locked.load(Ordering::Relaxed) {
                if round < 64 {
                    std::hint::spin_loop();
                } else if !may_sleep || round < 256 {
                    // A preempted holder gets the CPU back soonest when waiters yield.
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(Duration::from_micros(100));
                }
                round = round.saturating_add(1);
            }
            if let Some(g) = self.try_lock() {
                return g;
            }
        }
    }

    /// The value, through exclusive access to the lock (no locking needed).
    pub(crate) fn get_mut(&mut self) -> &mut T {
        self.value.get_mut()
    }

    /// Whether the lock is held right now.
    pub(crate) fn is_locked(&self) -> bool {
        self.locked.load(Ordering::Acquire)
    }

    /// Releases the lock on behalf of a holder that no longer exists.
    ///
    /// # Safety
    /// No [`SpinGuard`] of this lock may be alive or used afterwards in this process, e.g. the
    /// holder was a thread of the parent of a forked child.
    pub(crate) unsafe fn force_unlock(&self) {
        self.locked.store(false, Ordering::Release);
    }
}

impl<T: Default> Default for SpinLock<T> {
    fn default() -> Self {
        SpinLock::new(T::default())
    }
}

pub(crate) struct SpinGuard<'a, T> {
    lock: &'a SpinLock<T>,
}

impl<T> Deref for SpinGuard<'_, T> {
    type Target = T;

    #[inline]
    fn deref(&self) -> &T {
        // SAFETY: this guard exists only while this thread holds the lock, so no other
        // reference to the value is live.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> DerefMut for SpinGuard<'_, T> {
    #[inline]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: as in `deref`; `&mut self` makes this the only reference through the guard.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    #[inline]
    fn drop(&mut self) {
        self.lock.locked.store(false, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn excludes_and_releases() {
        let l = SpinLock::new(1);
        {
            let mut g = l.lock();
            *g += 1;
            assert!(l.is_locked());
            assert!(l.try_lock().is_none());
        }
        assert!(!l.is_locked());
        assert_eq!(*l.lock(), 2);
    }

    #[test]
    fn counts_exactly_under_contention() {
        let l = Arc::new(SpinLock::new(0u64));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let l = l.clone();
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        *l.lock() += 1;
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*l.lock(), 80_000);
    }

    #[test]
    fn force_unlock_frees_an_abandoned_lock() {
        let l = SpinLock::new(5);
        std::mem::forget(l.lock());
        assert!(l.try_lock().is_none());
        // SAFETY: the only guard was forgotten and is never used.
        unsafe { l.force_unlock() };
        assert_eq!(*l.lock(), 5);
    }
}
