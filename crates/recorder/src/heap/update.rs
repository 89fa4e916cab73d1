//! The managed model's update policy: full and young updates ask the
//! [`LivenessSource`](super::LivenessSource) which objects are alive, when a young update may
//! run, and the moving averages of what updates found.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::objects::{gen_age, ObjRecord};
use super::{mix64, HeapRecorder, ObjectInfo};

/// Young updates skip objects at least this old.
pub const OLD_AGE: u32 = 3;
/// Minimum time between two young updates.
pub const MIN_TIME_BETWEEN_YOUNG_UPDATES_NS: u64 = 2_000_000_000;

/// Smoothing factor of the EWMA stats.
pub const EWMA_ALPHA: f64 = 0.3;

#[derive(Debug, Clone, Copy, Default)]
pub(super) struct UpdateCounts {
    pub(super) alive: u64,
    pub(super) dead: u64,
    pub(super) skipped: u64,
    pub(super) frozen: u64,
}

#[derive(Debug, Default)]
pub(super) struct UpdateStats {
    pub(super) last_gen: Option<u64>,
    pub(super) last_time: Option<Instant>,
    pub(super) last: UpdateCounts,
    pub(super) successful: u64,
    pub(super) skipped_concurrent: u64,
    pub(super) skipped_gcgen: u64,
    pub(super) skipped_time: u64,
    pub(super) ewma_young: [f64; 3],
    pub(super) ewma_full: [f64; 3],
}

/// Holds the update "lock" (an atomic flag, which `after_fork` can clear) until dropped.
struct UpdateGuard<'a>(&'a AtomicBool);

impl Drop for UpdateGuard<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl HeapRecorder {
    /// Young update (after a collection), subject to the update policy.
    pub fn update_young_objects(&self) {
        self.update(false);
    }

    /// Runs an update (managed model only). Returns the generation it used, or `None` when it
    /// was skipped.
    pub(super) fn update(&self, full: bool) -> Option<u64> {
        let source = self.source.as_ref()?;
        if full {
            // A young update may be running: wait for it, full updates are not optional.
            while self
                .updating
                .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_err()
            {
                source.wait_for_other_update();
            }
        } else if self
            .updating
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.update_stats.lock().skipped_concurrent += 1;
            return None;
        }
        let _guard = UpdateGuard(&self.updating);

        // Updates would invalidate what a snapshot refers to and break its point-in-time view.
        if !full && self.iterating.load(Ordering::Acquire) {
            return None;
        }
        let gen = source.gc_generation();
        let now = Instant::now();
        if !full {
            let mut st = self.update_stats.lock();
            if st.last_gen == Some(gen) {
                // Nothing was collected since the last update: liveness cannot have changed much.
                st.skipped_gcgen += 1;
                return None;
            }
            if st.last_time.is_some_and(|t| {
                now.saturating_duration_since(t)
                    < Duration::from_nanos(MIN_TIME_BETWEEN_YOUNG_UPDATES_NS)
            }) {
                st.skipped_time += 1;
                return None;
            }
        }

        let mut counts = UpdateCounts::default();
        let mut todo: Vec<(u64, bool)> = Vec::new();
        let mut results: Vec<Option<ObjectInfo>> = Vec::new();
        let mut dead: Vec<(ObjRecord, u32)> = Vec::new();
        for shard in self.objs.iter() {
            // Collect under the lock, ask the runtime without it, apply under it again: lookups
            // may be slow or re-enter the runtime, and allocating threads must not wait on them.
            todo.clear();
            {
                let g = shard.lock();
                for rec in &g.recs {
                    let age = gen_age(gen, rec.alloc_gen);
                    // Age 0: not collected even once, would not be iterated anyway.
                    if age == 0 || (!full && age >= u64::from(OLD_AGE)) {
                        counts.skipped += 1;
                        continue;
                    }
                    todo.push((rec.id, rec.frozen()));
                }
            }
            if todo.is_empty() {
                continue;
            }
            results.clear();
            if full {
                results.extend(todo.iter().map(|&(id, _)| source.lookup(id)));
            } else {
                // Young updates only drop the dead: no sizes asked for, none changed.
                results.extend(todo.iter().map(|&(id, _)| {
                    source.is_alive(id).then_some(ObjectInfo {
                        size: 0,
                        frozen: false,
                    })
                }));
            }
            {
                let mut g = shard.lock();
                for (&(id, _), info) in todo.iter().zip(&results) {
                    let hash = mix64(id);
                    match info {
                        None => {
                            if let Some(dead_rec) = g.remove_ctx(id, hash) {
                                counts.dead += 1;
                                dead.push(dead_rec);
                            }
                        }
                        Some(info) => {
                            if let Some(rec) = g.get_mut(id, hash) {
                                // Frozen objects cannot change size: skip re-measuring them.
                                if full && self.size_enabled && !rec.frozen() {
                                    rec.size = info.size;
                                    rec.set_frozen(info.frozen);
                                }
                                counts.alive += 1;
                                if rec.frozen() {
                                    counts.frozen += 1;
                                }
                            }
                        }
                    }
                }
            }
            for (rec, ctx) in dead.drain(..) {
                self.release_record_ctx(&rec, ctx);
            }
        }

        let mut st = self.update_stats.lock();
        st.last = counts;
        st.last_gen = Some(gen);
        st.last_time = Some(now);
        st.successful += 1;
        let ewma = if full {
            &mut st.ewma_full
        } else {
            &mut st.ewma_young
        };
        for (avg, value) in ewma
            .iter_mut()
            .zip([counts.alive, counts.dead, counts.skipped])
        {
            *avg = (1.0 - EWMA_ALPHA) * *avg + EWMA_ALPHA * value as f64;
        }
        Some(gen)
    }

    /// Testing aid: forget when the last update ran so the 2 s rule lets the next one through.
    pub fn reset_last_update(&self) {
        self.update_stats.lock().last_time = None;
    }
}
