//! The recorder's statistics: per serialized profile, over its lifetime, and the heap
//! recorder's.

use std::sync::atomic::Ordering;

use crate::heap::{HeapRecorder, HeapStats};

use super::StackRecorder;

/// Stats of one serialized profile.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProfileStats {
    /// Individual (unweighted) samples recorded into the slot, heap samples included.
    pub recorded_samples: u64,
    /// Time the whole serialization took.
    pub serialization_time_ns: u64,
    /// Time preparing the heap iteration took (the update and snapshot).
    pub heap_iteration_prep_time_ns: u64,
    /// Time adding the live heap's samples took.
    pub heap_profile_build_time_ns: u64,
    /// Samples (heap objects included) folded into the dropped-stacks frame because the
    /// profile was at its memory cap.
    pub dropped_stacks: u64,
    /// Bytes the profile's tables held when it was serialized (freed right after).
    pub profile_bytes: u64,
}

/// Stats over the recorder's lifetime.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LifetimeStats {
    /// Serializations that succeeded.
    pub serialization_successes: u64,
    /// Serializations that failed.
    pub serialization_failures: u64,
    /// Shortest successful serialization (`None` before the first).
    pub serialization_time_ns_min: Option<u64>,
    /// Longest successful serialization.
    pub serialization_time_ns_max: Option<u64>,
    /// Time all successful serializations took.
    pub serialization_time_ns_total: Option<u64>,
    /// Mean time of a successful serialization.
    pub serialization_time_ns_avg: Option<f64>,
}

/// What [`StackRecorder::stats`] returns.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RecorderStats {
    /// Serializations so far.
    pub lifetime: LifetimeStats,
    /// `None` when heap profiling is disabled.
    pub heap: Option<HeapStats>,
    /// Samples folded into the dropped-stacks frame over the memory cap, in all profiles so far
    /// (see [`RecorderConfig::max_profile_bytes`](super::RecorderConfig::max_profile_bytes)).
    pub dropped_stacks: u64,
}

impl LifetimeStats {
    pub(super) fn record_time(&mut self, ns: u64) {
        self.serialization_time_ns_min =
            Some(self.serialization_time_ns_min.map_or(ns, |m| m.min(ns)));
        self.serialization_time_ns_max =
            Some(self.serialization_time_ns_max.map_or(ns, |m| m.max(ns)));
        let total = self
            .serialization_time_ns_total
            .unwrap_or(0)
            .saturating_add(ns);
        self.serialization_time_ns_total = Some(total);
        let count = self.serialization_successes + self.serialization_failures + 1;
        self.serialization_time_ns_avg = Some(total as f64 / count as f64);
    }
}

impl StackRecorder {
    /// Serialization and heap statistics.
    pub fn stats(&self) -> RecorderStats {
        RecorderStats {
            lifetime: *self.lifetime.lock(),
            heap: self.heap.as_ref().map(HeapRecorder::stats),
            dropped_stacks: self.dropped_stacks(),
        }
    }

    /// [`RecorderStats::dropped_stacks`] alone, without locking anything.
    pub fn dropped_stacks(&self) -> u64 {
        self.dropped_stacks.load(Ordering::Relaxed)
    }
}
