//! The memory cap: upper bounds of what an addition may make the tables hold, and the one
//! dropped-stacks stack that samples over the cap fold into.

use crate::error::ProfileError;

use super::aggregate::{text, Resolver, TimedRec};
use super::bulk::ADDR_CACHE_BITS;
use super::sample_key::KeyRec;
use super::tables::{
    check_table_len, hash_function, hash_label, hash_location, Function, LabelRec, Location,
    Tables, NONE, NO_SOURCE,
};
use super::{Frame, Label, LabelValue, Profile, Sample, Str};

/// Name of the one frame that samples over a profile's memory cap are folded into.
pub const DROPPED_STACKS_FRAME: &str = "[stacks dropped: over memory cap]";

/// Marks a [`RowId`](super::RowId) that is an index of the dropped-stacks rows, not of the
/// aggregated rows.
/// (A profile never comes near 2^31 dropped-stacks rows: there is one per label set at most.)
pub(super) const DROPPED_ROW: u32 = 1 << 31;

/// Part of the cap (1/32) that only rows of the dropped-stacks frame may use, so that samples
/// folded in over the cap keep their label sets (a thread's, say) for a while.
const DROPPED_ROWS_SHARE: usize = 32;

/// Most bytes a vector of `len` items with room for `cap` holds after `add` more items pushed,
/// extended or resized in: nothing moves when they fit; otherwise each growth step at most
/// doubles the room or sets it to the length needed, so the room ends below twice the final
/// length (and a first allocation reserves at most 8 items).
pub(super) fn vec_bytes_after(len: usize, cap: usize, add: usize, size: usize) -> usize {
    let need = len.saturating_add(add);
    if need <= cap {
        cap * size
    } else {
        need.saturating_mul(2).max(8).saturating_mul(size)
    }
}

pub(super) fn bytes_after<T>(v: &Vec<T>, add: usize) -> usize {
    vec_bytes_after(v.len(), v.capacity(), add, std::mem::size_of::<T>())
}

/// Upper bounds of what one operation may add to each table, for the memory cap's check.
#[derive(Clone, Copy, Default)]
pub(super) struct Adds {
    pub(super) strings: usize,
    pub(super) string_bytes: usize,
    pub(super) functions: usize,
    pub(super) locations: usize,
    pub(super) stacks: usize,
    pub(super) stack_items: usize,
    pub(super) labels: usize,
    pub(super) label_sets: usize,
    pub(super) label_items: usize,
    pub(super) keys: usize,
    pub(super) rows: usize,
    pub(super) timed: usize,
    /// Length `id_cache` may be resized to (0: unchanged).
    pub(super) id_cache_len: usize,
    /// New dropped-stacks rows.
    pub(super) dropped_rows: usize,
    /// Length the label set -> dropped-stacks row map may be resized to (0: unchanged).
    pub(super) dropped_map_len: usize,
    /// The address cache may be allocated.
    pub(super) addr_cache: bool,
    /// Lookups follow, so the stack and row indexes catch up with unindexed entries (the bulk
    /// path appends without indexing; its entries are never looked up).
    pub(super) indexed: bool,
}

/// Where samples over the memory cap go: one stack of the [`DROPPED_STACKS_FRAME`] frame, with a
/// row per label set that already existed (or none). Its rows are kept apart from the
/// aggregated ones: they grow from nothing in a share of the cap of their own, where a row in
/// the aggregated table could need that (large) table to double.
pub(super) struct Dropped {
    /// The dropped-stacks stack, `NONE` until the first sample over the cap.
    pub(super) stack: u32,
    /// The empty label set (valid once `stack` is set).
    empty_labels: u32,
    /// Label set id -> its dropped-stacks row, `NONE` where there is none.
    map: Vec<u32>,
    /// Label set per row.
    pub(super) labels: Vec<u32>,
    /// Values per row (one per sample type).
    pub(super) values: Vec<i64>,
    /// Samples folded in.
    pub(super) samples: u64,
}

impl Dropped {
    pub(super) fn new() -> Self {
        Dropped {
            stack: NONE,
            empty_labels: NONE,
            map: Vec::new(),
            labels: Vec::new(),
            values: Vec::new(),
            samples: 0,
        }
    }

    fn row(&self, labels: u32) -> u32 {
        self.map.get(labels as usize).copied().unwrap_or(NONE)
    }

    fn memory_bytes(&self) -> usize {
        (self.map.capacity() + self.labels.capacity()) * 4 + self.values.capacity() * 8
    }
}

impl Tables {
    pub(super) fn memory_bytes(&self) -> usize {
        self.strings.bytes.capacity()
            + self.strings.spans.capacity() * 8
            + self.strings.index.memory_bytes()
            + self.functions.items.capacity() * std::mem::size_of::<Function>()
            + self.functions.index.memory_bytes()
            + self.locations.items.capacity() * std::mem::size_of::<Location>()
            + self.locations.index.memory_bytes()
            + (self.stacks.items.capacity() + self.stacks.spans.capacity() * 2) * 4
            + self.stacks.index.memory_bytes()
            + self.labels.items.capacity() * std::mem::size_of::<LabelRec>()
            + self.labels.index.memory_bytes()
            + (self.label_sets.items.capacity() + self.label_sets.spans.capacity() * 2) * 4
            + self.label_sets.index.memory_bytes()
            + self.keys.capacity() * std::mem::size_of::<KeyRec>()
            + self.key_index.memory_bytes()
            + self.agg.capacity() * 8
            + self.agg_index.memory_bytes()
            + self.agg_values.capacity() * 8
            + self.timed.capacity() * std::mem::size_of::<TimedRec>()
            + self.timed_values.capacity() * 8
            + self.id_cache.capacity() * 4
            + self.function_src.capacity() * 8
            + self.addr_cache.capacity() * std::mem::size_of::<(u64, u32)>()
            + self.dropped.memory_bytes()
    }

    /// An upper bound of [`Tables::memory_bytes`] after the additions `a` (values of `n` sample
    /// types per row), plus what the first sample over the cap adds (the dropped-stacks stack
    /// and its unlabeled row) while that is not there yet: whatever is let in under the cap,
    /// room for those remains. Mirrors `memory_bytes` term by term; reads lengths and
    /// capacities only.
    pub(super) fn projected_bytes(&self, a: &Adds, n: usize) -> usize {
        let mut a = *a;
        let d = &self.dropped;
        if d.stack == NONE {
            a.strings += 1;
            a.string_bytes += DROPPED_STACKS_FRAME.len();
            a.functions += 1;
            a.locations += 1;
            a.stacks += 1;
            a.stack_items += 1;
            a.label_sets += 1;
        }
        if d.row(d.empty_labels) == NONE {
            a.dropped_rows += 1;
            a.dropped_map_len = a
                .dropped_map_len
                .max(self.label_sets.spans.len() + a.label_sets);
        }
        let (pending_stacks, pending_rows) = if a.indexed {
            (
                self.stacks.unindexed(),
                self.agg.len() - self.agg_index.len(),
            )
        } else {
            (0, 0)
        };
        let resized = |len: usize, cap: usize, to: usize, size: usize| {
            vec_bytes_after(len, cap, to.saturating_sub(len), size)
        };
        let s = &self.strings;
        vec_bytes_after(s.bytes.len(), s.bytes.capacity(), a.string_bytes, 1)
            + bytes_after(&s.spans, a.strings)
            + s.index.bytes_after(a.strings)
            + bytes_after(&self.functions.items, a.functions)
            + self.functions.index.bytes_after(a.functions)
            + bytes_after(&self.locations.items, a.locations)
            + self.locations.index.bytes_after(a.locations)
            + vec_bytes_after(
                self.stacks.items.len(),
                self.stacks.items.capacity(),
                a.stack_items,
                4,
            )
            + bytes_after(&self.stacks.spans, a.stacks)
            + self.stacks.index.bytes_after(if a.indexed {
                a.stacks + pending_stacks
            } else {
                0
            })
            + bytes_after(&self.labels.items, a.labels)
            + self.labels.index.bytes_after(a.labels)
            + bytes_after(&self.label_sets.items, a.label_items)
            + bytes_after(&self.label_sets.spans, a.label_sets)
            + self.label_sets.index.bytes_after(a.label_sets)
            + bytes_after(&self.keys, a.keys)
            + self.key_index.bytes_after(a.keys)
            + bytes_after(&self.agg, a.rows)
            + self
                .agg_index
                .bytes_after(if a.indexed { a.rows + pending_rows } else { 0 })
            + bytes_after(&self.agg_values, a.rows * n)
            + bytes_after(&self.timed, a.timed)
            + bytes_after(&self.timed_values, a.timed * n)
            + resized(
                self.id_cache.len(),
                self.id_cache.capacity(),
                a.id_cache_len,
                4,
            )
            + resized(
                self.function_src.len(),
                self.function_src.capacity(),
                self.functions.items.len() + a.functions,
                8,
            )
            + if a.addr_cache && self.addr_cache.is_empty() {
                (1 << ADDR_CACHE_BITS) * std::mem::size_of::<(u64, u32)>()
            } else {
                self.addr_cache.capacity() * std::mem::size_of::<(u64, u32)>()
            }
            + resized(d.map.len(), d.map.capacity(), a.dropped_map_len, 4)
            + bytes_after(&d.labels, a.dropped_rows)
            + bytes_after(&d.values, a.dropped_rows * n)
    }

    /// What adding `sample` under a new key may add at most: every frame a new location (and
    /// function, and strings), every label new. Cached ids are in the string table already.
    pub(super) fn new_key_adds(
        &self,
        r: &Resolver<'_>,
        sample: &Sample<'_>,
    ) -> Result<Adds, ProfileError> {
        let mut a = Adds {
            locations: sample.frames.len(),
            stacks: 1,
            stack_items: sample.frames.len(),
            labels: sample.labels.len(),
            label_sets: 1,
            label_items: sample.labels.len(),
            keys: 1,
            indexed: true,
            ..Adds::default()
        };
        if sample.end_timestamp_ns == 0 {
            a.rows = 1;
        } else {
            a.timed = 1;
        }
        let mut count = |s: Str<'_>| -> Result<(), ProfileError> {
            match s {
                Str::Id(id) if self.cached(id).is_some() => return Ok(()),
                Str::Id(id) => a.id_cache_len = a.id_cache_len.max(id.0 as usize + 1),
                Str::Lit(_) => {}
            }
            a.strings += 1;
            a.string_bytes += text(self, r, s)?.len();
            Ok(())
        };
        let mut functions = 0;
        for f in sample.frames {
            if let Frame::Symbol { name, filename, .. } = *f {
                functions += 1;
                count(name)?;
                count(filename)?;
            }
        }
        for l in sample.labels {
            count(l.key)?;
            if let LabelValue::Str(v) = l.value {
                count(v)?;
            }
        }
        a.functions = functions;
        Ok(a)
    }

    /// Local id of `s` if the string table holds it.
    fn find_str(&self, r: &Resolver<'_>, s: Str<'_>) -> Result<Option<u32>, ProfileError> {
        Ok(match s {
            Str::Lit(s) => self.strings.find(s),
            Str::Id(id) => match self.cached(id) {
                Some(local) => Some(local),
                None => self.strings.find(r.storage_text(id)?),
            },
        })
    }

    /// The stack and label set `sample` resolves to, where they exist, without adding anything.
    fn find_existing(
        &mut self,
        r: &Resolver<'_>,
        sample: &Sample<'_>,
    ) -> Result<(Option<u32>, Option<u32>), ProfileError> {
        let mut ids = std::mem::take(&mut self.scratch);
        let result = self
            .find_stack(r, sample.frames, &mut ids)
            .and_then(|stack| {
                let labels = self.find_label_set(r, sample.labels, &mut ids)?;
                Ok((stack, labels))
            });
        self.scratch = ids;
        result
    }

    /// The stack of `frames`, if the tables hold it (`ids`: scratch).
    fn find_stack(
        &self,
        r: &Resolver<'_>,
        frames: &[Frame<'_>],
        ids: &mut Vec<u32>,
    ) -> Result<Option<u32>, ProfileError> {
        ids.clear();
        for f in frames {
            let loc = match *f {
                Frame::Address(a) => Some(Location::Address(a)),
                Frame::Symbol {
                    name,
                    filename,
                    line,
                } => match (self.find_str(r, name)?, self.find_str(r, filename)?) {
                    (Some(name), Some(filename)) => {
                        let func = Function { name, filename };
                        self.functions
                            .find(func, hash_function(func))
                            .map(|function| Location::Symbol { function, line })
                    }
                    _ => None,
                },
            };
            match loc.and_then(|l| self.locations.find(l, hash_location(l))) {
                Some(id) => ids.push(id),
                None => return Ok(None),
            }
        }
        Ok(self.stacks.find(ids))
    }

    /// The label set of `labels`, if the tables hold it (`ids`: scratch).
    pub(super) fn find_label_set(
        &self,
        r: &Resolver<'_>,
        labels: &[Label<'_>],
        ids: &mut Vec<u32>,
    ) -> Result<Option<u32>, ProfileError> {
        ids.clear();
        for l in labels {
            let Some(key) = self.find_str(r, l.key)? else {
                return Ok(None);
            };
            let rec = match l.value {
                LabelValue::Num(num) => LabelRec {
                    key,
                    str: NONE,
                    num,
                },
                LabelValue::Str(v) => match self.find_str(r, v)? {
                    Some(str) => LabelRec { key, str, num: 0 },
                    None => return Ok(None),
                },
            };
            match self.labels.find(rec, hash_label(rec)) {
                Some(id) => ids.push(id),
                None => return Ok(None),
            }
        }
        Ok(self.label_sets.find(ids))
    }
}

impl Profile {
    /// Caps the memory of the profile's tables at `max_bytes` (`None`: no cap, the default).
    ///
    /// Under the cap the profile works as without one. A sample that would need new table
    /// entries (a new stack, location, function, string, label set or row) that could take the
    /// tables past the cap is folded instead into one stack of a single
    /// [`DROPPED_STACKS_FRAME`] frame (with the sample's labels when that label set already
    /// exists, else none) and counted ([`Profile::dropped_samples`]); samples of stacks already
    /// there keep aggregating into their own rows. Values are never lost.
    ///
    /// The check takes the tables' growth by doubling into account, so
    /// [`Profile::memory_bytes`] stays at or under the cap (a profile emptier than its cap may
    /// thus start folding when a large table would have to double: it typically holds half to
    /// three quarters of the cap then); the only exceptions are a cap smaller than an empty
    /// profile plus the dropped-stacks entries, the 64 KiB address cache of the bulk heap path,
    /// and endpoint names ([`Profile::set_endpoint`]), which are not capped. 1/32 of the cap is
    /// kept for the dropped-stacks rows (one per label set). The cap holds until the next
    /// reset, which keeps it.
    pub fn set_max_bytes(&mut self, max_bytes: Option<u64>) {
        self.cap = max_bytes.map_or(usize::MAX, |b| usize::try_from(b).unwrap_or(usize::MAX));
    }

    /// [`Profile::set_max_bytes`], builder style.
    pub fn with_max_bytes(mut self, max_bytes: Option<u64>) -> Self {
        self.set_max_bytes(max_bytes);
        self
    }

    /// The cap set by [`Profile::set_max_bytes`].
    pub fn max_bytes(&self) -> Option<u64> {
        (self.cap != usize::MAX).then_some(self.cap as u64)
    }

    /// Samples folded into the dropped-stacks frame since the last reset (a heap object added
    /// by the bulk path counts as one sample).
    pub fn dropped_samples(&self) -> u64 {
        self.t.dropped.samples
    }

    /// Whether the additions `a` keep the tables under the cap, less the share kept for
    /// dropped-stacks rows (which [`Profile::add_dropped`] alone may use).
    #[inline]
    pub(super) fn fits(&self, a: &Adds) -> bool {
        self.cap == usize::MAX
            || self.t.projected_bytes(a, self.types.len())
                <= self.cap - self.cap / DROPPED_ROWS_SHARE
    }

    /// Adds a sample's values to the dropped-stacks row of label set `labels` (`NONE`: no label
    /// set) and counts it; returns the index of the row. A label set gets a row of its own while
    /// the cap allows; otherwise (and for `NONE`) the unlabeled row takes the values, and the cap
    /// always keeps room for that one (see [`Tables::projected_bytes`]).
    #[cold]
    pub(super) fn add_dropped(&mut self, labels: u32, values: &[i64]) -> Result<u32, ProfileError> {
        self.ensure_dropped_stack()?;
        let n = self.types.len();
        let empty = self.t.dropped.empty_labels;
        let want = if labels == NONE { empty } else { labels };
        let mut row = self.t.dropped.row(want);
        if row == NONE {
            let own_row = Adds {
                dropped_rows: 1,
                dropped_map_len: want as usize + 1,
                ..Adds::default()
            };
            let target = if want == empty || self.t.projected_bytes(&own_row, n) <= self.cap {
                want
            } else {
                empty
            };
            row = self.t.dropped.row(target);
            if row == NONE {
                let d = &mut self.t.dropped;
                row = d.labels.len() as u32;
                d.labels.push(target);
                d.values.resize(d.values.len() + n, 0);
                if d.map.len() <= target as usize {
                    d.map.resize(target as usize + 1, NONE);
                }
                d.map[target as usize] = row;
            }
        }
        let d = &mut self.t.dropped;
        let start = row as usize * n;
        for (acc, v) in d.values[start..start + n].iter_mut().zip(values) {
            *acc = acc.saturating_add(*v);
        }
        d.samples += 1;
        Ok(row)
    }

    /// Creates the dropped-stacks stack and the empty label set, once per profile.
    pub(super) fn ensure_dropped_stack(&mut self) -> Result<(), ProfileError> {
        let t = &mut self.t;
        if t.dropped.stack != NONE {
            return Ok(());
        }
        check_table_len(t.strings.len(), "string")?;
        let name = t.strings.intern(DROPPED_STACKS_FRAME);
        let func = Function { name, filename: 0 };
        let function = t.functions.intern(func, hash_function(func), "function")?;
        if t.function_src.len() < t.functions.items.len() {
            t.function_src.resize(t.functions.items.len(), NO_SOURCE);
        }
        let loc = Location::Symbol { function, line: 0 };
        let loc = t.locations.intern(loc, hash_location(loc), "location")?;
        // Appended without indexing: indexing now would index the bulk path's pending stacks.
        let stack = t.stacks.push_unindexed(&[loc], false)?;
        let empty = t.label_sets.intern(&[])?;
        t.dropped.stack = stack;
        t.dropped.empty_labels = empty;
        Ok(())
    }

    /// Over the cap, a sample that needs a new key: adds it to its own row if its stack, label
    /// set and row all exist already (a key missed only because the sample spells them
    /// differently: literals vs ids, ids after a generation change), to the dropped-stacks
    /// row otherwise. Changes no table but rows.
    #[cold]
    pub(super) fn add_over_cap(
        &mut self,
        r: &Resolver<'_>,
        sample: &Sample<'_>,
    ) -> Result<(), ProfileError> {
        let (stack, labels) = self.t.find_existing(r, sample)?;
        if let (Some(stack), Some(labels)) = (stack, labels) {
            let n = self.types.len();
            let t = &mut self.t;
            if sample.end_timestamp_ns == 0 {
                if let Some(row) = t.find_agg_row(stack, labels) {
                    let start = row as usize * n;
                    for (acc, v) in t.agg_values[start..start + n].iter_mut().zip(sample.values) {
                        *acc = acc.saturating_add(*v);
                    }
                    return Ok(());
                }
            } else if t.timed.len() < t.timed.capacity()
                && t.timed_values.capacity() - t.timed_values.len() >= n
            {
                t.timed.push(TimedRec {
                    stack,
                    labels,
                    ts: sample.end_timestamp_ns,
                });
                t.timed_values.extend_from_slice(sample.values);
                return Ok(());
            }
        }
        self.add_dropped(labels.unwrap_or(NONE), sample.values)?;
        Ok(())
    }
}

#[cfg(test)]
mod cap_tests {
    use std::sync::Arc;
    use std::time::{Duration, SystemTime};

    use super::*;
    use crate::pprof::{Compression, EncodeOptions};
    use crate::profile::{BulkBuffers, PrefetchedStack};
    use crate::sample_types::SampleType;
    use crate::strings::StringStorage;

    const TYPES: [SampleType; 2] = [SampleType::CpuSamples, SampleType::WallTime];

    fn t0() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000)
    }

    fn decode(p: &Profile) -> ferroprof_pprof::Profile {
        let opts = EncodeOptions {
            compression: Compression::None,
        };
        let enc = p.encode(t0(), &opts, None).unwrap();
        ferroprof_pprof::decode(&enc.bytes).unwrap()
    }

    /// A stack distinct for every `i`: a recursion whose depth and entry frames follow `i`'s
    /// digits, as recursive code gives (few addresses, many stacks).
    fn distinct_stack(i: u64, out: &mut Vec<Frame<'static>>) {
        out.clear();
        out.push(Frame::Address(0x1000 + (i % 7) * 16));
        let mut x = i;
        loop {
            out.push(Frame::Address(0x2000 + (x % 10) * 16));
            x /= 10;
            if x == 0 {
                break;
            }
        }
        out.push(Frame::Address(0x9000));
    }

    /// (dropped-frame samples' values, all samples' values) of an encoded profile.
    fn totals(d: &ferroprof_pprof::Profile) -> ([i64; 2], [i64; 2]) {
        let (mut dropped, mut all) = ([0; 2], [0; 2]);
        for s in &d.sample {
            let names = d.stack_names(s);
            for k in 0..2 {
                all[k] += s.value[k];
                if names == [DROPPED_STACKS_FRAME] {
                    dropped[k] += s.value[k];
                }
            }
        }
        (dropped, all)
    }

    #[test]
    fn cap_holds_over_a_million_distinct_stacks_and_values_are_conserved() {
        const CAP: u64 = 2 << 20;
        let mut p = Profile::new(&TYPES, None, t0()).with_max_bytes(Some(CAP));
        assert_eq!(p.max_bytes(), Some(CAP));
        let mut frames = Vec::new();
        let (mut max_mem, mut sum) = (0, [0i64; 2]);
        for i in 0..1_000_000u64 {
            distinct_stack(i, &mut frames);
            let values = [1, i as i64 % 1000];
            p.add(&Sample {
                frames: &frames,
                values: &values,
                labels: &[],
                end_timestamp_ns: 0,
            })
            .unwrap();
            sum[0] += values[0];
            sum[1] += values[1];
            max_mem = max_mem.max(p.memory_bytes());
        }
        assert!(max_mem <= CAP as usize, "{max_mem} bytes over a {CAP} cap");
        // The cap is used, not merely respected (tables grow by doubling).
        assert!(max_mem >= CAP as usize / 4, "only {max_mem} bytes used");
        let dropped = p.dropped_samples();
        assert!(dropped > 500_000, "{dropped} dropped");
        let d = decode(&p);
        let (dropped_values, all) = totals(&d);
        assert_eq!(all, sum, "every value is in the profile");
        assert_eq!(dropped_values[0], dropped as i64);
        assert_eq!(
            d.sample
                .iter()
                .filter(|s| d.stack_names(s) == [DROPPED_STACKS_FRAME])
                .count(),
            1
        );
        // Kept stacks are whole, not truncated.
        assert_eq!(d.sample.len() as u64, 1_000_000 - dropped + 1);

        // A reset keeps the cap and forgets the drops.
        p.reset(t0());
        assert_eq!((p.dropped_samples(), p.max_bytes()), (0, Some(CAP)));
    }

    #[test]
    fn existing_stacks_keep_aggregating_over_the_cap() {
        let st = Arc::new(StringStorage::new());
        let mut p = Profile::new(&TYPES, Some(st.clone()), t0()).with_max_bytes(Some(256 << 10));
        let (name, file) = (st.intern("by_id").unwrap(), st.intern("id.rs").unwrap());
        let id_frames = [Frame::ids(name, file, 7), Frame::sym("main", "m.rs", 1)];
        let lit_frames = [Frame::sym("lit", "l.rs", 2), Frame::sym("main", "m.rs", 1)];
        let thread = [Label::num("thread id", 1)];
        let add = |p: &mut Profile, frames: &[Frame<'_>], labels: &[Label<'_>], v: i64| {
            p.add(&Sample {
                frames,
                values: &[v, 0],
                labels,
                end_timestamp_ns: 0,
            })
            .unwrap()
        };
        add(&mut p, &id_frames, &thread, 1);
        add(&mut p, &lit_frames, &[], 1);
        let mut frames = Vec::new();
        let mut i = 0;
        while p.dropped_samples() == 0 {
            assert!(
                i < 100_000,
                "{} bytes and no sample folded",
                p.memory_bytes()
            );
            distinct_stack(i, &mut frames);
            add(&mut p, &frames, &[], 1);
            i += 1;
        }
        let over = p.memory_bytes();
        // Known stacks keep their rows: through the key index, and when their key is missed
        // (the id cache is dropped by a generation change, or the literal spelling of an id
        // frame).
        add(&mut p, &lit_frames, &[], 10);
        st.advance_generation();
        add(&mut p, &id_frames, &thread, 100);
        let spelled = [
            Frame::sym("by_id", "id.rs", 7),
            Frame::sym("main", "m.rs", 1),
        ];
        add(&mut p, &spelled, &thread, 1000);
        // New stacks fold in: with their label set when it exists, without labels otherwise.
        distinct_stack(i + 1, &mut frames);
        add(&mut p, &frames, &thread, 10_000);
        distinct_stack(i + 2, &mut frames);
        add(&mut p, &frames, &[Label::num("thread id", 99)], 100_000);
        assert_eq!(p.dropped_samples(), 3);
        assert!(p.memory_bytes() <= 256 << 10, "{} > cap", p.memory_bytes());
        assert!(p.memory_bytes() >= over);

        let d = decode(&p);
        let value_of = |names: &[&str], thread: Option<i64>| -> i64 {
            d.sample
                .iter()
                .filter(|s| d.stack_names(s) == names && d.label_num(s, "thread id") == thread)
                .map(|s| s.value[0])
                .sum()
        };
        assert_eq!(value_of(&["by_id", "main"], Some(1)), 1101);
        assert_eq!(value_of(&["lit", "main"], None), 11);
        assert_eq!(value_of(&[DROPPED_STACKS_FRAME], Some(1)), 10_000);
        assert_eq!(value_of(&[DROPPED_STACKS_FRAME], None), 100_000 + 1);
    }

    #[test]
    fn timestamped_samples_fold_over_the_cap() {
        const CAP: u64 = 512 << 10;
        let mut p = Profile::new(&TYPES, None, t0()).with_max_bytes(Some(CAP));
        let frames = [Frame::sym("tick", "t.rs", 1)];
        let labels = [Label::str("thread name", "worker")];
        for ts in 1..=100_000 {
            p.add(&Sample {
                frames: &frames,
                values: &[1, 2],
                labels: &labels,
                end_timestamp_ns: ts,
            })
            .unwrap();
            assert!(p.memory_bytes() <= CAP as usize);
        }
        assert!(p.dropped_samples() > 0);
        let d = decode(&p);
        let (dropped, all) = totals(&d);
        assert_eq!(all, [100_000, 200_000]);
        assert_eq!(dropped[0], p.dropped_samples() as i64);
        // The folded samples keep their (existing) labels.
        let folded = d
            .sample
            .iter()
            .find(|s| d.stack_names(s) == [DROPPED_STACKS_FRAME])
            .unwrap();
        assert_eq!(d.label_str(folded, "thread name"), Some("worker"));
    }

    #[test]
    fn a_cap_below_an_empty_profile_keeps_only_the_dropped_row() {
        let mut p = Profile::new(&TYPES, None, t0()).with_max_bytes(Some(1));
        for i in 0..100 {
            let frames = [Frame::Address(i)];
            p.add(&Sample {
                frames: &frames,
                values: &[1, 1],
                labels: &[],
                end_timestamp_ns: 0,
            })
            .unwrap();
        }
        assert_eq!(p.dropped_samples(), 100);
        let d = decode(&p);
        assert_eq!(d.sample.len(), 1);
        assert_eq!(d.sample[0].value, vec![100, 100]);
        assert_eq!(d.stack_names(&d.sample[0]), vec![DROPPED_STACKS_FRAME]);
    }

    #[test]
    fn bulk_rows_respect_the_cap() {
        const CAP: u64 = 1 << 20;
        let types = [SampleType::HeapLiveSamples, SampleType::HeapLiveSize];
        let mut p = Profile::new(&types, None, t0()).with_max_bytes(Some(CAP));
        // Samplers filled part of the profile first.
        let mut frames = Vec::new();
        for i in 0..2000 {
            distinct_stack(i, &mut frames);
            p.add(&Sample {
                frames: &frames,
                values: &[1, 8],
                labels: &[],
                end_timestamp_ns: 0,
            })
            .unwrap();
        }
        // A spare buffer far larger than the cap is not adopted.
        let mut spare = BulkBuffers {
            agg: Vec::with_capacity(1 << 20),
            ..BulkBuffers::default()
        };
        p.reserve_unindexed(200_000, 200_000, &mut spare);
        assert_eq!(spare.agg.capacity(), 0);
        assert!(p.memory_bytes() <= CAP as usize);
        let (mut sum, mut ahead, mut hints) = ([0i64; 2], PrefetchedStack::default(), Vec::new());
        let mut addresses = Vec::new();
        for i in 0..200_000u64 {
            let labels = p
                .intern_label_set(&[Label::num("gc gen age", (i % 3) as i64)])
                .unwrap();
            distinct_stack(1_000_000 + i, &mut frames);
            let stack = if i % 2 == 0 {
                addresses.clear();
                addresses.extend(frames.iter().map(|f| match *f {
                    Frame::Address(a) => a,
                    Frame::Symbol { .. } => unreachable!(),
                }));
                p.prefetch_addresses(&addresses, &mut ahead);
                p.push_address_stack_unindexed(&mut ahead).unwrap()
            } else {
                p.prefetch_stack(&frames, &mut hints);
                p.push_stack_unindexed(&frames, &hints).unwrap()
            };
            let row = p.push_unindexed_row(stack, labels, &[1, 64]).unwrap();
            p.add_to_row(row, &[2, 128]).unwrap();
            sum[0] += 3;
            sum[1] += 192;
            assert!(p.memory_bytes() <= CAP as usize, "{}", p.memory_bytes());
        }
        let dropped = p.dropped_samples();
        assert!(dropped > 100_000, "{dropped}");
        let d = decode(&p);
        let (dropped_values, all) = totals(&d);
        assert_eq!(all, [sum[0] + 2000, sum[1] + 2000 * 8]);
        // Two samples per folded stack (row push, then add), of values 1 and 2.
        assert_eq!(dropped_values[0] * 2, dropped as i64 * 3);
        // Folded rows keep an existing label set when there is room for its row, else none.
        for s in d.sample.iter() {
            if d.stack_names(s) == [DROPPED_STACKS_FRAME] {
                assert!(matches!(d.label_num(s, "gc gen age"), None | Some(0..=2)));
            }
        }
    }
}
