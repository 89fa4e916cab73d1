//! Forks: the atfork handlers and what a forked child does to the slots, the serializer and
//! the heap recorder before it records again.

use std::sync::atomic::Ordering;
use std::time::SystemTime;

use crate::spin::{SpinGuard, SpinLock};

use super::{slot_profile, SlotData, StackRecorder};

impl StackRecorder {
    /// In a forked child, before profiling restarts: slot 1 active, both profiles empty.
    ///
    /// Best when the fork was bracketed by [`Self::before_fork`] (then nothing was caught
    /// half-way). Otherwise the fork may have caught another thread inside a slot or a
    /// serialization; that thread does not exist in the child, so what it held is released by
    /// force and a profile it was changing is leaked, never read. Call this only when no other
    /// thread uses the recorder (as in a freshly forked child).
    pub fn reset_after_fork(&self) {
        let start = SystemTime::now();
        for slot in &self.slots {
            let (mut data, abandoned) = lock_abandoned(&slot.data);
            if abandoned {
                // The profile may be half-way through an add: never walk or drop it, leak it.
                let fresh = SlotData {
                    profile: slot_profile(
                        &self.layout,
                        &self.strings,
                        &self.config,
                        &self.extras,
                        start,
                    ),
                    recorded_samples: 0,
                };
                std::mem::forget(std::mem::replace(&mut *data, fresh));
            } else {
                data.reset(start);
            }
        }
        self.slots[0].gate.reset(true);
        self.slots[1].gate.reset(false);
        let (mut ser, _) = lock_abandoned(&self.serializer);
        ser.active_slot = 1;
        self.active_slot.store(1, Ordering::Relaxed);
        drop(ser);
        let (lifetime, _) = lock_abandoned(&self.lifetime);
        drop(lifetime);
        if let Some(heap) = &self.heap {
            heap.after_fork();
        }
    }

    /// In a forked child, before [`Self::reset_after_fork`]: whether the locks that reset does
    /// not force open (the string table's, the heap recorder's) are free. When one is held, its
    /// holder vanished in the fork and what it guards may be half-updated: the child should
    /// leave this recorder alone rather than take it.
    pub fn locks_free_after_fork(&self) -> bool {
        !self.strings.is_locked() && self.heap.as_ref().is_none_or(|h| h.locks_free())
    }

    /// Fork preparation (a `pthread_atfork` prepare handler): waits for a running
    /// serialization, closes both slots to samplers and waits for those inside to leave, and
    /// holds the string storage, so the fork cannot catch any of them half-way through an
    /// update. Samplers calling meanwhile get
    /// [`RecorderError::NoActiveSlot`](crate::error::RecorderError::NoActiveSlot); they never
    /// wait.
    /// Must be followed, in the same thread, by [`Self::after_fork_in_parent`] in the parent and
    /// [`Self::after_fork_in_child`] in the child. (The heap recorder's own locks are not
    /// covered.)
    pub fn before_fork(&self) {
        // Kept (guard forgotten) until after the fork; released with a plain store then.
        std::mem::forget(self.serializer.lock_long());
        for slot in &self.slots {
            slot.gate.close();
        }
        for slot in &self.slots {
            slot.gate.wait_empty();
        }
        self.strings.lock_for_fork();
    }

    /// In the parent after a fork prepared by [`Self::before_fork`]: reopens the active slot.
    pub fn after_fork_in_parent(&self) {
        self.strings.unlock_after_fork();
        let active = self.active_slot.load(Ordering::Relaxed);
        self.slots[usize::from(active == 2)].gate.open();
        // SAFETY: `before_fork`, in this thread, took the serializer lock and forgot its guard;
        // no guard of it exists until this release.
        unsafe { self.serializer.force_unlock() };
    }

    /// In the child after a fork prepared by [`Self::before_fork`]: [`Self::reset_after_fork`]
    /// plus releasing what the preparation held.
    pub fn after_fork_in_child(&self) {
        self.strings.unlock_after_fork();
        // SAFETY: `before_fork`, in this thread, took the serializer lock and forgot its guard;
        // `reset_after_fork` below takes and releases it normally afterwards.
        unsafe { self.serializer.force_unlock() };
        self.reset_after_fork();
    }
}

/// Locks a lock whose holder may have vanished in a fork; `true` when it had to be forced.
fn lock_abandoned<T>(l: &SpinLock<T>) -> (SpinGuard<'_, T>, bool) {
    if let Some(g) = l.try_lock() {
        return (g, false);
    }
    // SAFETY: only reached from `reset_after_fork`, whose contract is that no other thread uses
    // the recorder: the lock is held by a thread of the parent process that does not exist in
    // this child, so no guard of it will ever be used here; the caller never reads the data a
    // vanished holder may have been changing.
    unsafe { l.force_unlock() };
    (l.lock(), true)
}
