//! The bulk path: a caller holding whole stacks and rows (the heap serializer) appends them
//! without the sample-key index, with prefetching, reusing the last profile's buffers.

use std::time::SystemTime;

use crate::error::ProfileError;

use super::aggregate::{intern_frames, intern_labels, Resolver};
use super::cap::{Adds, DROPPED_ROW};
use super::sample_key::K0;
use super::tables::{adopt, check_table_len, hash_location, recycle, Location, NONE};
use super::{Frame, Label, Profile, Sample, MAX_FRAMES};

/// Entries of the address cache: 4096 (64 KiB), enough for the frames many stacks share.
pub(super) const ADDR_CACHE_BITS: u32 = 12;

#[inline(always)]
pub(super) fn addr_cache_slot(a: u64) -> usize {
    (a.wrapping_mul(K0) >> (64 - ADDR_CACHE_BITS)) as usize
}

/// Starts fetching, for writing, the memory 256 bytes past the end of `v`. A bulk add appends
/// to tables it has not touched lately, front to back: without this each new line is a store
/// miss met when the store comes, and they queue up.
#[inline(always)]
pub(super) fn prefetch_past_end<T>(v: &[T]) {
    prefetch_line(v.as_ptr_range().end.cast::<u8>().wrapping_add(256), true);
}

/// Asks the CPU to start loading the cache line of `r`, without waiting for it: bulk loops call
/// this some iterations ahead of a random access so its cache miss overlaps with other work.
#[inline(always)]
pub(crate) fn prefetch<T>(r: &T) {
    prefetch_line((r as *const T).cast(), false);
}

/// One prefetch instruction for the line holding `p` (any address: a prefetch never faults),
/// `for_write` asking for it in a state ready to be written.
#[inline(always)]
fn prefetch_line(p: *const u8, for_write: bool) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is only a hint: it never faults nor changes memory, whatever the
    // address. SSE, the intrinsic's target feature, is part of the x86_64 baseline.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_ET0, _MM_HINT_T0};
        if for_write {
            _mm_prefetch::<_MM_HINT_ET0>(p.cast());
        } else {
            _mm_prefetch::<_MM_HINT_T0>(p.cast());
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, for_write);
}

/// A stack interned in a profile, valid until its next reset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StackId(u32);

/// A label set interned in a profile, valid until its next reset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct LabelSetId(u32);

/// An aggregated row of a profile, valid until its next reset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RowId(u32);

/// An address stack looked up by [`Profile::prefetch_addresses`], for
/// [`Profile::push_address_stack_unindexed`].
#[derive(Default)]
pub(crate) struct PrefetchedStack {
    /// Location id per frame, `NONE` where the address cache did not know it.
    locs: Vec<u32>,
    /// (frame position, address, location hash) of each frame the cache did not know.
    misses: Vec<(u32, u64, u64)>,
}

/// The allocations a bulk add fills (rows, stacks, locations and the location index), handed
/// from one profile to the next: a heap profile's tables are many MB, and allocating them afresh
/// for every serialization means page-faulting all of it in again (and unmapping it after).
#[derive(Default)]
pub(crate) struct BulkBuffers {
    pub(super) agg: Vec<(u32, u32)>,
    pub(super) agg_values: Vec<i64>,
    pub(super) stack_items: Vec<u32>,
    pub(super) stack_spans: Vec<(u32, u32)>,
    pub(super) locations: Vec<Location>,
    pub(super) location_slots: Vec<u64>,
    pub(super) location_hashes: Vec<u64>,
}

impl BulkBuffers {
    fn memory_bytes(&self) -> usize {
        self.agg.capacity() * 8
            + self.agg_values.capacity() * 8
            + self.stack_items.capacity() * 4
            + self.stack_spans.capacity() * 8
            + self.locations.capacity() * std::mem::size_of::<Location>()
            + (self.location_slots.capacity() + self.location_hashes.capacity()) * 8
    }
}

impl Profile {
    /// Pre-sizes the tables for `rows` more aggregated rows over at most `stacks` new stacks
    /// added through [`Profile::push_stack_unindexed`] and [`Profile::push_unindexed_row`], so a
    /// bulk add does not reallocate on the way. (Their indexes are left alone: those entries are
    /// only indexed if a later lookup needs them.)
    ///
    /// The tables move into the allocations in `spare` (left by [`Profile::reset_into`]) where
    /// those are larger; `spare` is emptied. Buffers far larger than this add needs are freed
    /// instead, so memory kept for a heap that shrank is given back.
    pub(crate) fn reserve_unindexed(
        &mut self,
        rows: usize,
        stacks: usize,
        spare: &mut BulkBuffers,
    ) {
        if self.cap != usize::MAX {
            let a = Adds {
                rows,
                stacks,
                locations: stacks,
                ..Adds::default()
            };
            // Adopting keeps the larger of two allocations: at most both.
            if self.t.projected_bytes(&a, self.types.len()) + spare.memory_bytes() > self.cap {
                // Too much for the cap: give the kept buffers back and let each push check
                // its own growth.
                *spare = BulkBuffers::default();
                return;
            }
        }
        let t = &mut self.t;
        if spare.agg.capacity() > 4 * (t.agg.len() + rows).max(1024) {
            *spare = BulkBuffers::default();
        }
        adopt(&mut t.agg, &mut spare.agg);
        adopt(&mut t.agg_values, &mut spare.agg_values);
        adopt(&mut t.stacks.items, &mut spare.stack_items);
        adopt(&mut t.stacks.spans, &mut spare.stack_spans);
        adopt(&mut t.locations.items, &mut spare.locations);
        t.locations
            .index
            .adopt(&mut spare.location_slots, &mut spare.location_hashes);
        t.agg.reserve(rows);
        t.agg_values.reserve(rows * self.types.len());
        t.stacks.spans.reserve(stacks);
        // Most new stacks bring at least one new location (their own call site).
        t.locations.items.reserve(stacks);
        t.locations.index.reserve(stacks);
    }

    /// Bulk path, part 1: appends a stack (innermost frame first) with the validation of
    /// [`Profile::add`]; a failed stack leaves the profile unchanged. The id is valid until the
    /// next [`Profile::reset`].
    ///
    /// Unlike `add`, this always appends a new stack entry, without looking it up or indexing it
    /// (the index catches up on the next lookup, so later lookups still see it; a later `add` of
    /// an equal stack may aggregate into a row of its own). It is for a caller
    /// whose stacks are distinct from each other and that only needs rows of its own on them: an
    /// equal stack already in the profile is merely stored twice, which the encoding does not
    /// show (samples list location ids, not stack ids). Locations are still deduplicated.
    ///
    /// `hints` is empty, or what [`Profile::prefetch_stack`] of `frames` gave since the last
    /// reset.
    pub(crate) fn push_stack_unindexed(
        &mut self,
        frames: &[Frame<'_>],
        hints: &[u32],
    ) -> Result<StackId, ProfileError> {
        if frames.len() > MAX_FRAMES {
            return Err(ProfileError::TooManyFrames {
                got: frames.len(),
                limit: MAX_FRAMES,
            });
        }
        self.sync_generation();
        let hint = |i: usize| hints.get(i).copied().unwrap_or(NONE);
        let mut locs = std::mem::take(&mut self.t.scratch);
        locs.clear();
        let result = if frames.iter().all(|f| matches!(f, Frame::Address(_))) {
            // Nothing to validate; locations come through the address cache.
            let adds = if self.cap == usize::MAX {
                Adds::default()
            } else {
                Adds {
                    locations: (0..frames.len()).filter(|&i| hint(i) == NONE).count(),
                    addr_cache: true,
                    ..Adds::default()
                }
            };
            let Some(eager) = self.bulk_stack_room(frames.len(), adds) else {
                self.t.scratch = locs;
                return self.dropped_stack_id();
            };
            let t = &mut self.t;
            frames
                .iter()
                .enumerate()
                .try_for_each(|(i, f)| {
                    if let Frame::Address(a) = *f {
                        locs.push(match hint(i) {
                            NONE => t.address_location(a)?,
                            id => id,
                        });
                    }
                    Ok(())
                })
                .and_then(|()| t.stacks.push_unindexed(&locs, eager))
        } else {
            let storage = self.storage.clone();
            let sample = Sample {
                frames,
                values: &[],
                labels: &[],
                end_timestamp_ns: 0,
            };
            let r = Resolver::new(storage.as_deref(), &self.t, &sample);
            let room = self.validate(&r, &sample).and_then(|()| {
                if self.cap == usize::MAX {
                    return Ok(Some(true));
                }
                let mut adds = self.t.new_key_adds(&r, &sample)?;
                (adds.stacks, adds.stack_items, adds.rows) = (0, 0, 0);
                (adds.label_sets, adds.keys, adds.indexed) = (0, 0, false);
                Ok(self.bulk_stack_room(frames.len(), adds))
            });
            match room {
                Ok(Some(eager)) => {
                    let t = &mut self.t;
                    intern_frames(t, &r, frames, &mut locs)
                        .and_then(|()| t.stacks.push_unindexed(&locs, eager))
                }
                Ok(None) => {
                    drop(r);
                    self.t.scratch = locs;
                    return self.dropped_stack_id();
                }
                Err(e) => Err(e),
            }
        };
        self.t.scratch = locs;
        result.map(StackId)
    }

    /// Whether the bulk path may append a stack of `items` frames whose other additions are `a`
    /// (and the row that follows it): `None` over the memory cap, else whether the stack table
    /// may reserve ahead
    /// ([`SliceSet::push_unindexed`](super::tables::SliceSet::push_unindexed)'s `eager`).
    fn bulk_stack_room(&self, items: usize, mut a: Adds) -> Option<bool> {
        if self.cap == usize::MAX {
            return Some(true);
        }
        (a.stacks, a.stack_items, a.rows) = (1, items, 1);
        let projected = self.t.projected_bytes(&a, self.types.len());
        if projected > self.cap {
            return None;
        }
        let s = &self.t.stacks;
        let eager_extra = s
            .items_bytes_after_push(items, true)
            .saturating_sub(s.items_bytes_after_push(items, false));
        Some(projected + eager_extra <= self.cap)
    }

    /// The dropped-stacks stack, for a bulk stack over the memory cap; rows on it go to the
    /// dropped-stacks rows (see [`Profile::push_unindexed_row`]).
    #[cold]
    fn dropped_stack_id(&mut self) -> Result<StackId, ProfileError> {
        self.ensure_dropped_stack()?;
        Ok(StackId(self.t.dropped.stack))
    }

    /// Looks `frames` up in the address cache ahead of [`Profile::push_stack_unindexed`]: sets
    /// `hints` to the location id of every cached address frame (`NONE` for the others) and
    /// prefetches the location-index slot of each uncached one, so a caller working one stack
    /// behind overlaps those cache misses with its work on the previous stack, and does not look
    /// the cached frames up twice. (Location ids never change until the next reset, so a hint
    /// stays right even if its cache entry is evicted in between.)
    pub(crate) fn prefetch_stack(&self, frames: &[Frame<'_>], hints: &mut Vec<u32>) {
        hints.clear();
        let t = &self.t;
        if t.addr_cache.is_empty() {
            return;
        }
        let slots = &t.locations.index.slots;
        hints.extend(frames.iter().map(|f| match *f {
            Frame::Address(a) => {
                let (cached, id) = t.addr_cache[addr_cache_slot(a)];
                if cached == a && id != NONE {
                    return id;
                }
                if !slots.is_empty() {
                    let hash = hash_location(Location::Address(a));
                    prefetch(&slots[hash as usize & (slots.len() - 1)]);
                }
                NONE
            }
            Frame::Symbol { .. } => NONE,
        }));
    }

    /// Like [`Profile::prefetch_stack`], for a stack of address frames given as bare addresses
    /// (innermost first): fills `out` with the location id of every address the cache knows and
    /// notes the others, prefetching their location-index slots, for
    /// [`Profile::push_address_stack_unindexed`] one stack later.
    pub(crate) fn prefetch_addresses(&mut self, addresses: &[u64], out: &mut PrefetchedStack) {
        let PrefetchedStack { locs, misses } = out;
        locs.clear();
        misses.clear();
        let t = &mut self.t;
        if t.addr_cache.is_empty() {
            t.addr_cache = vec![(0, NONE); 1 << ADDR_CACHE_BITS];
        }
        let (cache, slots) = (&t.addr_cache, &t.locations.index.slots);
        // One `extend` of known length: no capacity check per frame.
        locs.extend(addresses.iter().enumerate().map(|(i, &a)| {
            let (cached, id) = cache[addr_cache_slot(a)];
            if cached == a && id != NONE {
                return id;
            }
            let hash = hash_location(Location::Address(a));
            if !slots.is_empty() {
                prefetch(&slots[hash as usize & (slots.len() - 1)]);
            }
            misses.push((i as u32, a, hash));
            NONE
        }));
    }

    /// [`Profile::push_stack_unindexed`] of the address stack `prefetched` was filled from by
    /// [`Profile::prefetch_addresses`] since the last reset (same result, without going through
    /// [`Frame`]s: only the addresses the cache did not know are looked up).
    pub(crate) fn push_address_stack_unindexed(
        &mut self,
        prefetched: &mut PrefetchedStack,
    ) -> Result<StackId, ProfileError> {
        if prefetched.locs.len() > MAX_FRAMES {
            return Err(ProfileError::TooManyFrames {
                got: prefetched.locs.len(),
                limit: MAX_FRAMES,
            });
        }
        self.sync_generation();
        let adds = Adds {
            locations: prefetched.misses.len(),
            ..Adds::default()
        };
        let Some(eager) = self.bulk_stack_room(prefetched.locs.len(), adds) else {
            return self.dropped_stack_id();
        };
        let t = &mut self.t;
        for &(pos, a, hash) in &prefetched.misses {
            let id = t.locations.intern(Location::Address(a), hash, "location")?;
            t.addr_cache[addr_cache_slot(a)] = (a, id);
            prefetched.locs[pos as usize] = id;
        }
        t.stacks
            .push_unindexed(&prefetched.locs, eager)
            .map(StackId)
    }

    /// Bulk path, part 2: interns a label set as [`Profile::add`] would (same validation, for
    /// an untimestamped sample). The id is valid until the next [`Profile::reset`].
    pub(crate) fn intern_label_set(
        &mut self,
        labels: &[Label<'_>],
    ) -> Result<LabelSetId, ProfileError> {
        self.sync_generation();
        let storage = self.storage.clone();
        let sample = Sample {
            frames: &[],
            values: &[],
            labels,
            end_timestamp_ns: 0,
        };
        let r = Resolver::new(storage.as_deref(), &self.t, &sample);
        self.validate(&r, &sample)?;
        if self.cap != usize::MAX {
            let mut adds = self.t.new_key_adds(&r, &sample)?;
            (adds.stacks, adds.keys, adds.rows, adds.indexed) = (0, 0, 0, false);
            if !self.fits(&adds) {
                // Rows on an unknown set go to the unlabeled dropped-stacks row.
                let mut ids = std::mem::take(&mut self.t.scratch);
                let found = self.t.find_label_set(&r, labels, &mut ids);
                self.t.scratch = ids;
                return Ok(LabelSetId(found?.unwrap_or(NONE)));
            }
        }
        let t = &mut self.t;
        let mut ids = std::mem::take(&mut t.scratch);
        ids.clear();
        let result =
            intern_labels(t, &r, labels, &mut ids).and_then(|()| t.label_sets.intern(&ids));
        t.scratch = ids;
        result.map(LabelSetId)
    }

    /// Bulk path, part 3: appends the untimestamped row (stack, labels) holding `values`, as the
    /// first [`Profile::add`] of a sample resolving to them would, but without looking it up or
    /// indexing it (the index catches up on the next lookup). The caller guarantees no row for
    /// (stack, labels) exists yet: `stack` came from [`Profile::push_stack_unindexed`] and each
    /// (stack, labels) gets one call; further values go through [`Profile::add_to_row`].
    pub(crate) fn push_unindexed_row(
        &mut self,
        stack: StackId,
        labels: LabelSetId,
        values: &[i64],
    ) -> Result<RowId, ProfileError> {
        let n = self.types.len();
        if values.len() != n {
            return Err(ProfileError::WrongValueCount {
                expected: n,
                got: values.len(),
            });
        }
        if stack.0 == self.t.dropped.stack
            || labels.0 == NONE
            || !self.fits(&Adds {
                rows: 1,
                ..Adds::default()
            })
        {
            let row = self.add_dropped(labels.0, values)?;
            return Ok(RowId(row | DROPPED_ROW));
        }
        let t = &mut self.t;
        debug_assert!((stack.0 as usize) < t.stacks.spans.len());
        debug_assert!((labels.0 as usize) < t.label_sets.spans.len());
        check_table_len(t.agg.len(), "aggregated sample")?;
        let row = t.agg.len() as u32;
        t.agg.push((stack.0, labels.0));
        t.agg_values.extend_from_slice(values);
        prefetch_past_end(&t.agg);
        prefetch_past_end(&t.agg_values);
        Ok(RowId(row))
    }

    /// Adds `values` to a row made by [`Profile::push_unindexed_row`], as another
    /// [`Profile::add`] of a sample resolving to it would.
    pub(crate) fn add_to_row(&mut self, row: RowId, values: &[i64]) -> Result<(), ProfileError> {
        let n = self.types.len();
        if values.len() != n {
            return Err(ProfileError::WrongValueCount {
                expected: n,
                got: values.len(),
            });
        }
        let (table, row) = if row.0 & DROPPED_ROW != 0 {
            let d = &mut self.t.dropped;
            d.samples += 1;
            (&mut d.values, row.0 & !DROPPED_ROW)
        } else {
            (&mut self.t.agg_values, row.0)
        };
        let start = row as usize * n;
        for (acc, v) in table[start..start + n].iter_mut().zip(values) {
            *acc = acc.saturating_add(*v);
        }
        Ok(())
    }

    /// [`Profile::reset`], keeping the allocations a bulk add fills in `spare`, for the next
    /// [`Profile::reserve_unindexed`] (of this profile or another one).
    pub(crate) fn reset_into(&mut self, start: SystemTime, spare: &mut BulkBuffers) {
        let t = &mut self.t;
        *spare = BulkBuffers {
            agg: recycle(&mut t.agg),
            agg_values: recycle(&mut t.agg_values),
            stack_items: recycle(&mut t.stacks.items),
            stack_spans: recycle(&mut t.stacks.spans),
            locations: recycle(&mut t.locations.items),
            // Emptied (filled) when adopted.
            location_slots: std::mem::take(&mut t.locations.index.slots),
            location_hashes: recycle(&mut t.locations.index.hashes),
        };
        self.reset(start);
    }
}
