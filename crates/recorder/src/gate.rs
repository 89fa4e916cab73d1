//! The gate in front of each profile slot: one atomic word holding a CLOSED bit and the number of
//! samplers currently inside.
//!
//! Samplers never wait at a gate: entering is one load plus, if the gate looks open, one
//! `fetch_add`; a sampler that raced with the closing backs out at once. The serializer closes a
//! gate and then waits for the samplers inside to leave (it may wait for samplers, never the
//! reverse). After that nobody can be inside until the gate is opened again.

use crate::sync::{backoff, AtomicUsize, Ordering};

const CLOSED: usize = 1 << (usize::BITS - 1);

#[derive(Debug)]
pub(crate) struct Gate {
    word: AtomicUsize,
}

impl Gate {
    pub(crate) fn new(open: bool) -> Gate {
        Gate {
            word: AtomicUsize::new(if open { 0 } else { CLOSED }),
        }
    }

    /// Tries to enter; `true` means the caller is inside and must call [`Gate::leave`].
    #[inline]
    pub(crate) fn try_enter(&self) -> bool {
        // A closed gate is only read, so samplers bouncing off it never delay the serializer's
        // wait for the count to drain. Acquire, not Relaxed: seeing a gate closed must also show
        // the serializer's earlier opening of the other gate. With a relaxed load a sampler may
        // see both gates closed during a single flip and drop its sample (found by the loom
        // model, `loom_model.rs`); the acquire costs nothing on x86.
        if self.word.load(Ordering::Acquire) & CLOSED != 0 {
            return false;
        }
        // Acquire pairs with the serializer's release when it opened the gate (after resetting
        // the slot's profile).
        let prev = self.word.fetch_add(1, Ordering::Acquire);
        if prev & CLOSED != 0 {
            // Closed between the load and the add: back out without touching the slot.
            self.leave();
            return false;
        }
        true
    }

    /// Leaves a gate entered with [`Gate::try_enter`].
    #[inline]
    pub(crate) fn leave(&self) {
        // Release: everything done inside happens-before the serializer seeing the count drop.
        self.word.fetch_sub(1, Ordering::Release);
    }

    /// Lets samplers in.
    pub(crate) fn open(&self) {
        self.word.fetch_and(!CLOSED, Ordering::Release);
    }

    /// Stops new samplers from entering; those inside may still be finishing.
    pub(crate) fn close(&self) {
        self.word.fetch_or(CLOSED, Ordering::AcqRel);
    }

    /// Waits until no sampler is inside (call after [`Gate::close`]).
    pub(crate) fn wait_empty(&self) {
        let mut round = 0u32;
        while self.word.load(Ordering::Acquire) & !CLOSED != 0 {
            backoff(round);
            round = round.saturating_add(1);
        }
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.word.load(Ordering::Acquire) & CLOSED != 0
    }

    /// Samplers inside right now (for tests and debugging).
    #[cfg(test)]
    pub(crate) fn inside(&self) -> usize {
        self.word.load(Ordering::Acquire) & !CLOSED
    }

    /// Forces the gate to a known state with nobody inside. Only for a forked child, where the
    /// samplers counted inside were threads of the parent and no longer exist.
    pub(crate) fn reset(&self, open: bool) {
        self.word
            .store(if open { 0 } else { CLOSED }, Ordering::Release);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn open_gate_admits_and_counts() {
        let g = Gate::new(true);
        assert!(!g.is_closed());
        assert!(g.try_enter());
        assert!(g.try_enter());
        assert_eq!(g.inside(), 2);
        g.leave();
        g.leave();
        assert_eq!(g.inside(), 0);
    }

    #[test]
    fn closed_gate_refuses_and_keeps_count() {
        let g = Gate::new(false);
        assert!(g.is_closed());
        assert!(!g.try_enter());
        assert_eq!(g.inside(), 0);
        g.open();
        assert!(g.try_enter());
        g.close();
        assert!(g.is_closed());
        assert!(!g.try_enter());
        assert_eq!(g.inside(), 1);
        g.leave();
        g.wait_empty();
        assert_eq!(g.inside(), 0);
    }

    #[test]
    fn close_waits_for_samplers_inside() {
        let g = Arc::new(Gate::new(true));
        assert!(g.try_enter());
        let g2 = g.clone();
        let waiter = std::thread::spawn(move || {
            g2.close();
            g2.wait_empty();
            g2.inside()
        });
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(!waiter.is_finished());
        g.leave();
        assert_eq!(waiter.join().unwrap(), 0);
    }

    #[test]
    fn reset_forgets_samplers() {
        let g = Gate::new(true);
        assert!(g.try_enter());
        g.reset(false);
        assert!(g.is_closed());
        assert_eq!(g.inside(), 0);
        g.reset(true);
        assert!(g.try_enter());
    }
}
