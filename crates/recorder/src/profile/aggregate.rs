//! Aggregation: a sample's values add up in the row of its (stack, label set), a timestamped
//! sample is kept on its own; and the slow path that resolves and interns a sample seen first.

use crate::error::{ProfileError, StringError};
use crate::strings::{StringId, StringStorage, Table as StorageTable};

use super::cap::Adds;
use super::sample_key::{sample_key_hash, KeyRec};
use super::tables::{
    check_table_len, hash_function, hash_label, hash_location, hash_pair, id_pair, Function,
    LabelRec, Location, Tables, NONE, NO_SOURCE,
};
use super::{
    Frame, Label, LabelValue, Profile, Sample, Str, END_TIMESTAMP_LABEL, LOCAL_ROOT_SPAN_ID_LABEL,
    MAX_FRAMES,
};

#[derive(Clone, Copy)]
pub(super) struct TimedRec {
    pub(super) stack: u32,
    pub(super) labels: u32,
    pub(super) ts: i64,
}

/// Resolves storage ids for the slow path. The storage is locked once, up front, and only when
/// the sample names an id the profile has not cached.
pub(super) struct Resolver<'s> {
    has_storage: bool,
    guard: Option<crate::spin::SpinGuard<'s, StorageTable>>,
}

impl<'s> Resolver<'s> {
    pub(super) fn new(storage: Option<&'s StringStorage>, t: &Tables, sample: &Sample<'_>) -> Self {
        let uncached = |s: Str<'_>| matches!(s, Str::Id(id) if t.cached(id).is_none());
        let needs_lock = sample.frames.iter().any(|f| match *f {
            Frame::Symbol { name, filename, .. } => uncached(name) || uncached(filename),
            Frame::Address(_) => false,
        }) || sample
            .labels
            .iter()
            .any(|l| uncached(l.key) || matches!(l.value, LabelValue::Str(s) if uncached(s)));
        Resolver {
            has_storage: storage.is_some(),
            guard: storage.filter(|_| needs_lock).map(|s| s.lock()),
        }
    }

    /// Text of a storage id that is not in the profile's cache.
    pub(super) fn storage_text(&self, id: StringId) -> Result<&str, ProfileError> {
        match &self.guard {
            Some(g) => Ok(g.get(id)?),
            None if self.has_storage => Err(StringError::UnknownId(id.0).into()),
            None => Err(ProfileError::NoStringStorage(id.0)),
        }
    }
}

/// Text of `s`, from the literal, the profile's table (cached ids) or the storage.
pub(super) fn text<'a>(
    t: &'a Tables,
    r: &'a Resolver<'_>,
    s: Str<'a>,
) -> Result<&'a str, ProfileError> {
    match s {
        Str::Lit(s) => Ok(s),
        Str::Id(id) => match t.cached(id) {
            Some(local) => Ok(t.strings.get(local)),
            None => r.storage_text(id),
        },
    }
}

/// Interns `s` into the profile's table, caching the id mapping.
fn intern_str(t: &mut Tables, r: &Resolver<'_>, s: Str<'_>) -> Result<u32, ProfileError> {
    match s {
        Str::Lit(s) => {
            check_table_len(t.strings.len(), "string")?;
            Ok(t.strings.intern(s))
        }
        Str::Id(id) => {
            if let Some(local) = t.cached(id) {
                return Ok(local);
            }
            check_table_len(t.strings.len(), "string")?;
            let local = t.strings.intern(r.storage_text(id)?);
            let i = id.0 as usize;
            if t.id_cache.len() <= i {
                t.id_cache.resize(i + 1, 0);
            }
            t.id_cache[i] = local + 1;
            Ok(local)
        }
    }
}

/// Appends the location id of every frame to `locs`, interning what is new.
pub(super) fn intern_frames(
    t: &mut Tables,
    r: &Resolver<'_>,
    frames: &[Frame<'_>],
    locs: &mut Vec<u32>,
) -> Result<(), ProfileError> {
    for f in frames {
        let loc = match *f {
            Frame::Address(a) => Location::Address(a),
            Frame::Symbol {
                name,
                filename,
                line,
            } => {
                let src = id_pair(name, filename);
                let name = intern_str(t, r, name)?;
                let filename = intern_str(t, r, filename)?;
                let func = Function { name, filename };
                let function = t.functions.intern(func, hash_function(func), "function")?;
                if t.function_src.len() < t.functions.items.len() {
                    t.function_src.resize(t.functions.items.len(), NO_SOURCE);
                }
                if let Some(src) = src {
                    t.function_src[function as usize] = src;
                }
                Location::Symbol { function, line }
            }
        };
        locs.push(t.locations.intern(loc, hash_location(loc), "location")?);
    }
    Ok(())
}

/// Appends the label id of every label to `ids`, interning what is new.
pub(super) fn intern_labels(
    t: &mut Tables,
    r: &Resolver<'_>,
    labels: &[Label<'_>],
    ids: &mut Vec<u32>,
) -> Result<(), ProfileError> {
    for l in labels {
        let key = intern_str(t, r, l.key)?;
        let rec = match l.value {
            LabelValue::Num(num) => LabelRec {
                key,
                str: NONE,
                num,
            },
            LabelValue::Str(s) => LabelRec {
                key,
                str: intern_str(t, r, s)?,
                num: 0,
            },
        };
        ids.push(t.labels.intern(rec, hash_label(rec), "label")?);
    }
    Ok(())
}

impl Tables {
    /// Row of (stack, labels) if there is one, without changing anything.
    pub(super) fn find_agg_row(&self, stack: u32, labels: u32) -> Option<u32> {
        let agg = &self.agg;
        self.agg_index
            .find(hash_pair(stack, labels), |r| {
                agg[r as usize] == (stack, labels)
            })
            .or_else(|| {
                (self.agg_index.len()..agg.len())
                    .find(|&r| agg[r] == (stack, labels))
                    .map(|r| r as u32)
            })
    }

    /// Row of the aggregated sample (stack, labels), added with zero values when new.
    #[inline]
    fn agg_row(&mut self, stack: u32, labels: u32, n: usize) -> Result<u32, ProfileError> {
        self.catch_up_agg_index();
        let hash = hash_pair(stack, labels);
        let agg = &self.agg;
        if let Some(r) = self
            .agg_index
            .find(hash, |r| agg[r as usize] == (stack, labels))
        {
            return Ok(r);
        }
        check_table_len(self.agg.len(), "aggregated sample")?;
        self.agg.push((stack, labels));
        self.agg_values.resize(self.agg_values.len() + n, 0);
        Ok(self.agg_index.insert(hash))
    }

    /// Indexes the rows appended by [`Profile::push_unindexed_row`] since the last lookup.
    #[inline]
    fn catch_up_agg_index(&mut self) {
        let indexed = self.agg_index.len();
        if indexed < self.agg.len() {
            self.agg_index.reserve(self.agg.len() - indexed);
            for &(stack, labels) in &self.agg[indexed..] {
                self.agg_index.insert(hash_pair(stack, labels));
            }
        }
    }
}

impl Profile {
    /// Adds one sample; validation errors leave the profile unchanged.
    pub fn add(&mut self, sample: &Sample<'_>) -> Result<(), ProfileError> {
        if sample.values.len() != self.types.len() {
            return Err(ProfileError::WrongValueCount {
                expected: self.types.len(),
                got: sample.values.len(),
            });
        }
        if sample.frames.len() > MAX_FRAMES {
            return Err(ProfileError::TooManyFrames {
                got: sample.frames.len(),
                limit: MAX_FRAMES,
            });
        }
        if sample.end_timestamp_ns < 0 {
            return Err(ProfileError::NegativeTimestamp(sample.end_timestamp_ns));
        }
        self.sync_generation();

        let hash = sample_key_hash(sample.frames, sample.labels);
        let t = &self.t;
        let key = match t.key_index.find(hash, |k| {
            t.key_matches(&t.keys[k as usize], sample.frames, sample.labels)
        }) {
            Some(k) => k,
            None => match self.add_key(hash, sample)? {
                Some(k) => k,
                // Over the memory cap: already added where it belongs.
                None => return Ok(()),
            },
        };
        self.record(key, sample)
    }

    /// Drops the storage id mappings when the storage's generation moved.
    #[inline]
    pub(super) fn sync_generation(&mut self) {
        if let Some(storage) = &self.storage {
            let g = storage.generation();
            if g != self.t.cache_generation {
                // Ids freed by the advance may now name other strings.
                self.t.id_cache.clear();
                self.t.function_src.fill(NO_SOURCE);
                self.t.cache_generation = g;
            }
        }
    }

    /// Applies the values of a sample whose key is known.
    #[inline]
    fn record(&mut self, key: u32, sample: &Sample<'_>) -> Result<(), ProfileError> {
        let n = self.types.len();
        let k = self.t.keys[key as usize];
        if sample.end_timestamp_ns != 0 {
            if k.has_ts_label {
                return Err(ProfileError::ReservedLabelKey(
                    END_TIMESTAMP_LABEL.to_owned(),
                ));
            }
            let t = &self.t;
            // Only a push that grows the tables needs the cap's check.
            if (t.timed.len() == t.timed.capacity()
                || t.timed_values.capacity() - t.timed_values.len() < n)
                && !self.fits(&Adds {
                    timed: 1,
                    ..Adds::default()
                })
            {
                self.add_dropped(k.labels, sample.values)?;
                return Ok(());
            }
            let t = &mut self.t;
            t.timed.push(TimedRec {
                stack: k.stack,
                labels: k.labels,
                ts: sample.end_timestamp_ns,
            });
            t.timed_values.extend_from_slice(sample.values);
            return Ok(());
        }
        let row = if k.agg != NONE {
            k.agg
        } else {
            let new_row = Adds {
                rows: 1,
                indexed: true,
                ..Adds::default()
            };
            let row = if self.fits(&new_row) {
                self.t.agg_row(k.stack, k.labels, n)?
            } else if let Some(row) = self.t.find_agg_row(k.stack, k.labels) {
                row
            } else {
                self.add_dropped(k.labels, sample.values)?;
                return Ok(());
            };
            self.t.keys[key as usize].agg = row;
            row
        };
        let t = &mut self.t;
        let start = row as usize * n;
        for (acc, v) in t.agg_values[start..start + n].iter_mut().zip(sample.values) {
            *acc = acc.saturating_add(*v);
        }
        Ok(())
    }

    /// Slow path: validates the sample, resolves it into the tables and indexes its key.
    /// `None` when the memory cap sent the sample elsewhere (already added).
    #[cold]
    fn add_key(&mut self, hash: u64, sample: &Sample<'_>) -> Result<Option<u32>, ProfileError> {
        let storage = self.storage.clone();
        let r = Resolver::new(storage.as_deref(), &self.t, sample);
        self.validate(&r, sample)?;
        if self.cap != usize::MAX {
            let adds = self.t.new_key_adds(&r, sample)?;
            if !self.fits(&adds) {
                self.add_over_cap(&r, sample)?;
                return Ok(None);
            }
        }

        let t = &mut self.t;
        let mut locs = std::mem::take(&mut t.scratch);
        locs.clear();
        let result = (|| {
            intern_frames(t, &r, sample.frames, &mut locs)?;
            let stack = t.stacks.intern(&locs)?;
            locs.clear();
            intern_labels(t, &r, sample.labels, &mut locs)?;
            let labels = t.label_sets.intern(&locs)?;
            // The key may already be indexed under this hash, missed only because its ids were
            // not cached yet; reuse it rather than indexing a twin.
            let keys = &t.keys;
            if let Some(k) = t.key_index.find(hash, |k| {
                let k = keys[k as usize];
                k.stack == stack && k.labels == labels
            }) {
                return Ok(k);
            }
            check_table_len(t.keys.len(), "sample key")?;
            let end_ts = t.preset.end_timestamp;
            let has_ts_label = locs
                .iter()
                .any(|&l| t.labels.items[l as usize].key == end_ts);
            t.keys.push(KeyRec {
                stack,
                labels,
                agg: NONE,
                has_ts_label,
            });
            Ok(t.key_index.insert(hash))
        })();
        t.scratch = locs;
        result.map(Some)
    }

    /// Checks done before anything is added, so a bad sample leaves no trace: every storage id
    /// resolves, and the labels are well formed.
    pub(super) fn validate(
        &self,
        r: &Resolver<'_>,
        sample: &Sample<'_>,
    ) -> Result<(), ProfileError> {
        let t = &self.t;
        for f in sample.frames {
            if let Frame::Symbol { name, filename, .. } = *f {
                text(t, r, name)?;
                text(t, r, filename)?;
            }
        }
        let labels = sample.labels;
        for (i, l) in labels.iter().enumerate() {
            let key = text(t, r, l.key)?;
            if key.is_empty() {
                return Err(ProfileError::EmptyLabelKey);
            }
            if key == LOCAL_ROOT_SPAN_ID_LABEL {
                if let LabelValue::Str(v) = l.value {
                    let v = text(t, r, v)?.to_owned();
                    return Err(ProfileError::StringLocalRootSpanId(v));
                }
            }
            if key == END_TIMESTAMP_LABEL && sample.end_timestamp_ns != 0 {
                return Err(ProfileError::ReservedLabelKey(key.to_owned()));
            }
            if labels.len() <= 16 {
                for other in &labels[..i] {
                    if text(t, r, other.key)? == key {
                        return Err(ProfileError::DuplicateLabelKey(key.to_owned()));
                    }
                }
            }
        }
        if labels.len() > 16 {
            // Many labels: a set instead of comparing every pair.
            let mut seen = std::collections::HashSet::with_capacity(labels.len());
            for l in labels {
                let key = text(t, r, l.key)?;
                if !seen.insert(key) {
                    return Err(ProfileError::DuplicateLabelKey(key.to_owned()));
                }
            }
        }
        Ok(())
    }
}
