//! Model check of the two-slot protocol with loom (`RUSTFLAGS="--cfg loom"`, see
//! `scripts/reliability.sh loom`).
//!
//! The slot gates are the real [`Gate`] (its atomics and its `wait_empty` backoff switch to loom's
//! under `cfg(loom)`). Around them the model mirrors what [`crate::stack_recorder::StackRecorder`]
//! does with them: a sampler enters the first open gate in two rounds over both slots and then
//! takes the slot's data lock, which only samplers contend for; the serializer resets the inactive
//! slot, opens it, closes the active one, waits for it to drain and takes its data. The profile is
//! a `Vec` of recorded values in a loom `UnsafeCell`, so loom reports any access of the serializer
//! that the gate's orderings do not separate from a sampler's write.
//!
//! Checked in every interleaving loom explores (bounded preemptions):
//! - no deadlock and no livelock (loom fails a model whose threads all block or spin forever);
//! - a sampler never waits for the serializer: its only loop is the bounded gate scan, and with at
//!   most three flips during its attempt it always finds an open slot (four can make it fail,
//!   which is the designed `NoActiveSlot` error, never a wait);
//! - every recorded value shows up in exactly one serialized profile (or in the slot still
//!   active at the end), never in two, never lost.

use loom::cell::UnsafeCell;
use loom::sync::{Arc, Mutex};
use loom::thread;

use crate::gate::Gate;

/// One profile slot: the real gate plus the model's profile.
struct Slot {
    gate: Gate,
    /// Serializes samplers among themselves; the serializer never takes it (the gate keeps
    /// samplers out while it touches `profile`).
    sampler_lock: Mutex<()>,
    profile: UnsafeCell<Vec<u64>>,
}

// SAFETY: `profile` is only reached by a sampler inside the slot's gate holding `sampler_lock`, or
// by the serializer while the gate is closed and drained (or before it opens); loom's `UnsafeCell`
// checks exactly that claim in every explored interleaving.
unsafe impl Sync for Slot {}

struct Recorder {
    slots: [Slot; 2],
    /// Index of the active slot; only the serializer reads or writes it (as in the real recorder,
    /// samplers find the active slot by its open gate).
    active: UnsafeCell<usize>,
}

// SAFETY: `active` is only used by the single serializer thread (the model has one).
unsafe impl Sync for Recorder {}

#[derive(Debug, PartialEq, Eq)]
struct NoActiveSlot;

impl Recorder {
    fn new() -> Recorder {
        let slot = |open| Slot {
            gate: Gate::new(open),
            sampler_lock: Mutex::new(()),
            profile: UnsafeCell::new(Vec::new()),
        };
        Recorder {
            slots: [slot(true), slot(false)],
            active: UnsafeCell::new(0),
        }
    }

    /// The sampler path of `StackRecorder::record_sample`: two rounds over both gates, no waiting
    /// on anything the serializer holds.
    fn record(&self, value: u64) -> Result<(), NoActiveSlot> {
        for _ in 0..2 {
            for slot in &self.slots {
                if slot.gate.try_enter() {
                    {
                        let _guard = slot.sampler_lock.lock().unwrap();
                        // SAFETY: inside the gate and holding the sampler lock (see `Slot`).
                        slot.profile.with_mut(|p| unsafe { (*p).push(value) });
                    }
                    slot.gate.leave();
                    return Ok(());
                }
            }
        }
        Err(NoActiveSlot)
    }

    /// The flip of `StackRecorder::serialize`; returns the serialized profile's values.
    fn serialize(&self) -> Vec<u64> {
        // SAFETY: only the serializer thread touches `active`.
        let active = self.active.with(|a| unsafe { *a });
        let (old, next) = (&self.slots[active], &self.slots[1 - active]);
        // SAFETY: `next`'s gate is closed and drained since the previous flip (or was never
        // opened), so no sampler is inside.
        next.profile.with_mut(|p| unsafe { (*p).clear() });
        next.gate.open();
        old.gate.close();
        old.gate.wait_empty();
        // SAFETY: as above, single serializer.
        self.active.with_mut(|a| unsafe { *a = 1 - active });
        // SAFETY: `old` is closed and drained: no sampler can be inside until it opens again.
        old.profile.with_mut(|p| unsafe { std::mem::take(&mut *p) })
    }

    /// What the slots hold after every thread is done: (active slot's values, inactive slot's).
    fn leftovers(&self) -> (Vec<u64>, Vec<u64>) {
        // SAFETY: called after every other thread was joined.
        let active = self.active.with(|a| unsafe { *a });
        let take = |i: usize| {
            // SAFETY: as above.
            self.slots[i]
                .profile
                .with_mut(|p| unsafe { std::mem::take(&mut *p) })
        };
        (take(active), take(1 - active))
    }
}

fn builder(preemptions: usize) -> loom::model::Builder {
    let mut b = loom::model::Builder::new();
    // The environment (LOOM_MAX_PREEMPTIONS) wins, so a long run can explore further.
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(preemptions);
    }
    b
}

/// Runs `samplers` sampler threads recording `per_sampler` values each while the main thread
/// serializes `flips` times, then checks conservation. Returns the number of failed records.
fn run_model(samplers: u64, per_sampler: u64, flips: usize) -> usize {
    let rec = Arc::new(Recorder::new());
    let handles: Vec<_> = (0..samplers)
        .map(|s| {
            let rec = rec.clone();
            thread::spawn(move || {
                let mut recorded = Vec::new();
                let mut failed = 0;
                for i in 0..per_sampler {
                    let value = s * 100 + i;
                    match rec.record(value) {
                        Ok(()) => recorded.push(value),
                        Err(NoActiveSlot) => failed += 1,
                    }
                }
                (recorded, failed)
            })
        })
        .collect();

    let mut serialized: Vec<u64> = Vec::new();
    for _ in 0..flips {
        serialized.extend(rec.serialize());
    }

    let mut recorded = Vec::new();
    let mut failed = 0;
    for h in handles {
        let (r, f) = h.join().unwrap();
        recorded.extend(r);
        failed += f;
    }
    let (active, inactive) = rec.leftovers();
    // A value in the inactive slot was written after the serializer took that slot: lost.
    assert!(
        inactive.is_empty(),
        "values {inactive:?} landed in a closed slot"
    );
    for slot in &rec.slots {
        assert!(!slot.gate.is_closed() || slot.gate.inside() == 0);
    }
    serialized.extend(active);
    serialized.sort_unstable();
    recorded.sort_unstable();
    assert_eq!(
        serialized, recorded,
        "every recorded value in exactly one profile"
    );
    failed
}

/// Two samplers, one value each, against two flips: never an error, exactly-once delivery.
#[test]
fn two_samplers_two_flips() {
    builder(2).check(|| {
        assert_eq!(run_model(2, 1, 2), 0, "a sampler failed with <= 2 flips");
    });
}

/// One sampler recording twice against two flips (a sampler re-entering after a flip).
#[test]
fn one_sampler_twice_two_flips() {
    builder(3).check(|| {
        assert_eq!(run_model(1, 2, 2), 0, "a sampler failed with <= 2 flips");
    });
}

/// Three flips still cannot outlast two rounds: every look that finds a gate closed has seen
/// (acquire) the close, hence the opening of the other gate that came before it, so each failed
/// look needs one more flip.
#[test]
fn sampler_against_three_flips() {
    builder(2).check(|| {
        assert_eq!(run_model(1, 1, 3), 0, "a sampler failed with 3 flips");
    });
}

/// Two samplers recording twice each against three flips: exactly-once delivery with more
/// sampler/sampler contention on the slot data.
#[test]
fn two_samplers_twice_three_flips() {
    builder(2).check(|| {
        assert_eq!(run_model(2, 2, 3), 0, "a sampler failed with 3 flips");
    });
}

/// Four flips can outlast a sampler's two rounds, so here a sampler may get `NoActiveSlot`; a
/// failed record leaves nothing behind and successful ones are still delivered exactly once.
#[test]
fn sampler_against_four_flips() {
    builder(2).check(|| {
        let failed = run_model(1, 1, 4);
        assert!(failed <= 1);
    });
}
