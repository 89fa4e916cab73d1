//! Allocation totals per stack since the profiler started: the allocation columns of the
//! `/debug/pprof/heap` profile, which, like Go's, carries what was allocated since the start
//! next to what is live now.
//!
//! The periodic profiles hand their samples over at each export and start afresh, so the totals
//! are kept apart: one row per distinct allocation stack (its addresses back to back in one
//! vector), found through a hash of the stack. A `/heap` request copies the vectors under the
//! lock (a memory copy, no per-row work) and builds its profile from the copy. Past the byte
//! cap (the profile cap, [`crate::ProfilerBuilder::max_profile_bytes`]) samples of new stacks
//! add to one folded row, so no value is lost.
//!
//! Every use of the lock is inside the fork gate (`crate::forkgate::outside_fork`) and takes no other
//! lock, so a fork never catches it held and the gate never waits on it for long.

use std::collections::HashMap;
use std::hash::BuildHasher;

use crate::forklock::{reset_in_child, Mutex};

/// alloc-samples, alloc-samples-unscaled, alloc-space.
pub(crate) type AllocValues = [i64; 3];

/// Bytes a row's index entry takes (hash, row, control byte), for the cap.
const INDEX_ENTRY_BYTES: usize = 8 + 4 + 1;

pub(crate) struct AllocTotals {
    inner: Mutex<Rows>,
    /// Most bytes the rows may hold; `usize::MAX`: no cap.
    cap: usize,
}

#[derive(Default)]
struct Rows {
    /// Every row's stack, back to back.
    frames: Vec<u64>,
    /// Per row: (start, length) in `frames`.
    spans: Vec<(u32, u32)>,
    values: Vec<AllocValues>,
    /// Stack hash -> row. A second stack with a taken hash goes to the next free hash.
    index: HashMap<u64, u32, foldhash::fast::FixedState>,
    /// Samples of stacks that found no room under the cap.
    folded: AllocValues,
}

impl Rows {
    fn stack(&self, row: u32) -> &[u64] {
        let (start, len) = self.spans[row as usize];
        &self.frames[start as usize..(start + len) as usize]
    }

    fn bytes(&self) -> usize {
        self.frames.capacity() * 8
            + self.spans.capacity() * 8
            + self.values.capacity() * std::mem::size_of::<AllocValues>()
            + self.index.capacity() * INDEX_ENTRY_BYTES
    }

    /// Upper bound of [`Self::bytes`] once a row of `frames` addresses is added (vectors
    /// double when full).
    fn bytes_with(&self, frames: usize) -> usize {
        fn grown(len: usize, cap: usize, add: usize, size: usize) -> usize {
            let need = len + add;
            if need <= cap {
                cap * size
            } else {
                need.max(cap * 2) * size
            }
        }
        grown(self.frames.len(), self.frames.capacity(), frames, 8)
            + grown(self.spans.len(), self.spans.capacity(), 1, 8)
            + grown(
                self.values.len(),
                self.values.capacity(),
                1,
                std::mem::size_of::<AllocValues>(),
            )
            + grown(
                self.index.len(),
                self.index.capacity(),
                1,
                INDEX_ENTRY_BYTES,
            )
    }
}

impl AllocTotals {
    /// `cap`: most bytes the rows may hold (`None`: no cap).
    pub fn new(cap: Option<u64>) -> Self {
        AllocTotals {
            inner: Mutex::new(Rows::default()),
            cap: cap.map_or(usize::MAX, |c| usize::try_from(c).unwrap_or(usize::MAX)),
        }
    }

    /// In a forked child: the parent's allocations are not the child's, whose totals start at
    /// the fork (as its other profiles do). Every use of the lock is inside the fork gate, so
    /// no thread should have held it at the fork; the child does not rely on that: it resets
    /// the lock without waiting and leaks the rows (a holder may have left them half-updated).
    ///
    /// # Safety
    /// Only in a forked child, before it starts any thread.
    pub unsafe fn clear_after_fork(&self) {
        // SAFETY: forwarded: no other thread exists, so a holder is a thread that vanished.
        unsafe {
            reset_in_child(&self.inner);
            std::ptr::write(self.inner.data_ptr(), Rows::default());
        }
    }

    /// Adds one sampled allocation's values to its stack's row.
    pub fn add(&self, stack: &[u64], values: AllocValues) {
        let mut hash = foldhash::fast::FixedState::default().hash_one(stack);
        let mut r = self.inner.lock();
        let row = loop {
            match r.index.get(&hash) {
                Some(&row) if r.stack(row) == stack => break Some(row),
                Some(_) => hash = hash.wrapping_add(1),
                None => break self.push(&mut r, hash, stack),
            }
        };
        let target = match row {
            Some(row) => &mut r.values[row as usize],
            None => &mut r.folded,
        };
        for (t, v) in target.iter_mut().zip(values) {
            *t = t.saturating_add(v);
        }
    }

    /// A new row for `stack` under `hash`, or `None` when it would take the rows past the cap
    /// (or past what a row index holds).
    fn push(&self, r: &mut Rows, hash: u64, stack: &[u64]) -> Option<u32> {
        let start = u32::try_from(r.frames.len()).ok()?;
        let len = u32::try_from(stack.len()).ok()?;
        let row = u32::try_from(r.spans.len()).ok()?;
        start.checked_add(len)?;
        if self.cap != usize::MAX && r.bytes_with(stack.len()) > self.cap {
            return None;
        }
        r.frames.extend_from_slice(stack);
        r.spans.push((start, len));
        r.values.push([0; 3]);
        r.index.insert(hash, row);
        Some(row)
    }

    /// A copy of the rows, to build a profile from without holding the lock.
    pub fn snapshot(&self) -> TotalsSnapshot {
        let r = self.inner.lock();
        TotalsSnapshot {
            frames: r.frames.clone(),
            spans: r.spans.clone(),
            values: r.values.clone(),
            folded: r.folded,
        }
    }

    /// Bytes the rows hold (capacities), for the profiler's memory stats.
    pub fn bytes(&self) -> usize {
        self.inner.lock().bytes()
    }
}

/// The rows at one moment.
pub(crate) struct TotalsSnapshot {
    frames: Vec<u64>,
    spans: Vec<(u32, u32)>,
    values: Vec<AllocValues>,
    folded: AllocValues,
}

impl TotalsSnapshot {
    /// Calls `f` with each row's stack and values.
    pub fn for_each(&self, mut f: impl FnMut(&[u64], AllocValues)) {
        for (&(start, len), &v) in self.spans.iter().zip(&self.values) {
            f(&self.frames[start as usize..(start + len) as usize], v);
        }
    }

    /// The values of samples folded over the cap (all zero when none were).
    pub fn folded(&self) -> AllocValues {
        self.folded
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(s: &TotalsSnapshot) -> Vec<(Vec<u64>, AllocValues)> {
        let mut out = Vec::new();
        s.for_each(|st, v| out.push((st.to_vec(), v)));
        out
    }

    #[test]
    fn equal_stacks_add_up_and_others_get_rows() {
        let t = AllocTotals::new(None);
        t.add(&[1, 2, 3], [10, 1, 640]);
        t.add(&[1, 2, 3], [5, 1, 320]);
        t.add(&[1, 2], [1, 1, 8]);
        t.add(&[], [2, 1, 16]);
        let s = t.snapshot();
        assert_eq!(
            rows(&s),
            vec![
                (vec![1, 2, 3], [15, 2, 960]),
                (vec![1, 2], [1, 1, 8]),
                (vec![], [2, 1, 16]),
            ]
        );
        assert_eq!(s.folded(), [0; 3]);
        assert!(t.bytes() > 0);
    }

    #[test]
    fn a_hash_collision_never_merges_two_stacks() {
        let t = AllocTotals::new(None);
        let a = [7u64, 8];
        let hash = foldhash::fast::FixedState::default().hash_one(&a[..]);
        // Another stack sits at `a`'s hash already.
        {
            let mut r = t.inner.lock();
            assert_eq!(t.push(&mut r, hash, &[9]), Some(0));
        }
        t.add(&a, [1, 1, 1]);
        t.add(&a, [1, 1, 1]);
        let got = rows(&t.snapshot());
        assert_eq!(got, vec![(vec![9], [0, 0, 0]), (a.to_vec(), [2, 2, 2])]);
    }

    #[test]
    fn past_the_cap_new_stacks_fold_and_known_ones_keep_adding() {
        let t = AllocTotals::new(Some(4096));
        let mut added = 0;
        for i in 0..1000u64 {
            t.add(&[i, i + 1, i + 2, i + 3], [1, 1, 100]);
            added += 100;
        }
        t.add(&[0, 1, 2, 3], [1, 1, 100]);
        added += 100;
        let s = t.snapshot();
        let got = rows(&s);
        assert!(got.len() < 1000 && !got.is_empty(), "{} rows", got.len());
        assert_eq!(got[0].1, [2, 2, 200]);
        assert!(s.folded()[2] > 0);
        let total: i64 = got.iter().map(|r| r.1[2]).sum::<i64>() + s.folded()[2];
        assert_eq!(total, added, "no value lost");
        assert!(t.bytes() <= 4096, "{}", t.bytes());
    }
}
