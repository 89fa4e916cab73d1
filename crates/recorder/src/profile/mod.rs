//! Aggregation of samples into one profile, ready for pprof encoding.
//!
//! Samples without a timestamp aggregate by (stack, label set): values add up. Timestamped
//! samples are kept one by one and carry an `end_timestamp_ns` numeric label when encoded.
//! `set_endpoint` attaches a `trace endpoint` label at encoding time to every sample whose numeric
//! `local root span id` label matches, including samples recorded before the call.
//!
//! ## How `add` stays cheap for a stack seen before
//! Strings, functions, locations, stacks and label sets are deduplicated into tables local to the
//! profile (what pprof needs anyway). In front of them sits a *sample-key index*: one hash over
//! the raw sample (every frame and label as given) leads to the (stack, label set) it resolved to
//! last time. A hit is verified against the stored tables, field by field, so a hash collision
//! can never merge two different samples; a verified hit costs no table lookup, no allocation and
//! no [`StringStorage`] lock. Interned ids are mapped to the profile's own string ids through a
//! per-profile cache that is dropped whenever the storage's generation moves (ids may be reused
//! after a generation advance).
//!
//! ## The memory cap
//! [`Profile::set_max_bytes`] bounds the tables. Only paths that add entries check it (the slow
//! path of a new key, a new row or timestamped sample that needs a table to grow, the bulk
//! path's new stacks and rows), by an upper bound of the tables' size after the addition
//! computed from their lengths and capacities; a known sample pays nothing. Past it, samples
//! fold into one `[stacks dropped: over memory cap]` stack.

use std::sync::Arc;
use std::time::SystemTime;

use crate::error::ProfileError;
use crate::sample_types::SampleType;
use crate::strings::{StringId, StringStorage};

mod aggregate;
mod bulk;
mod cap;
mod encode;
mod endpoints;
mod sample_key;
mod tables;

pub(crate) use bulk::{prefetch, BulkBuffers, LabelSetId, PrefetchedStack, RowId, StackId};
pub use cap::DROPPED_STACKS_FRAME;
pub use endpoints::{
    LATE_ENDPOINTS, LOCAL_ROOT_SPAN_ID_LABEL, MAX_ENDPOINT_NAMES, OTHER_ENDPOINTS,
    TRACE_ENDPOINT_LABEL,
};
use tables::Tables;

/// Most frames one sample may carry.
pub const MAX_FRAMES: usize = 3000;

/// Numeric label carried by timestamped samples.
pub const END_TIMESTAMP_LABEL: &str = "end_timestamp_ns";

/// A string given either literally or as an id of the profile's [`StringStorage`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Str<'a> {
    /// The text itself.
    Lit(&'a str),
    /// An id of the profile's string storage.
    Id(StringId),
}

impl<'a> From<&'a str> for Str<'a> {
    fn from(s: &'a str) -> Self {
        Str::Lit(s)
    }
}

impl From<StringId> for Str<'_> {
    fn from(id: StringId) -> Self {
        Str::Id(id)
    }
}

/// One stack frame, innermost first in a sample's frame slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Frame<'a> {
    /// Already symbolized.
    Symbol {
        /// The function's name.
        name: Str<'a>,
        /// The source file (empty when unknown).
        filename: Str<'a>,
        /// The line (0: unknown).
        line: i64,
    },
    /// A return/instruction address, symbolized at encoding by the
    /// [`Symbolizer`](crate::pprof::Symbolizer) passed to [`Profile::encode`] (one address may
    /// expand to several inlined frames). Without a symbolizer, or when it knows nothing, the
    /// location carries the address alone.
    Address(u64),
}

impl<'a> Frame<'a> {
    /// A symbolized frame from text.
    pub fn sym(name: &'a str, filename: &'a str, line: i64) -> Self {
        Frame::Symbol {
            name: Str::Lit(name),
            filename: Str::Lit(filename),
            line,
        }
    }

    /// A frame whose strings are ids of the profile's [`StringStorage`].
    pub fn ids(name: StringId, filename: StringId, line: i64) -> Self {
        Frame::Symbol {
            name: Str::Id(name),
            filename: Str::Id(filename),
            line,
        }
    }
}

/// A label value: a string or a number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LabelValue<'a> {
    /// A string.
    Str(Str<'a>),
    /// A number.
    Num(i64),
}

/// A (key, value) label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Label<'a> {
    /// The label's key.
    pub key: Str<'a>,
    /// Its value.
    pub value: LabelValue<'a>,
}

impl<'a> Label<'a> {
    /// A string label.
    pub fn str(key: &'a str, value: &'a str) -> Self {
        Label {
            key: Str::Lit(key),
            value: LabelValue::Str(Str::Lit(value)),
        }
    }

    /// A numeric label.
    pub fn num(key: &'a str, value: i64) -> Self {
        Label {
            key: Str::Lit(key),
            value: LabelValue::Num(value),
        }
    }
}

/// One sample as handed to [`Profile::add`].
#[derive(Debug, Clone, Copy)]
pub struct Sample<'a> {
    /// Innermost frame first.
    pub frames: &'a [Frame<'a>],
    /// Exactly one value per sample type of the profile.
    pub values: &'a [i64],
    /// The sample's labels (distinct keys).
    pub labels: &'a [Label<'a>],
    /// Nanoseconds since the Unix epoch; 0 means "not timestamped" (aggregated).
    pub end_timestamp_ns: i64,
}

/// What a profile says about itself besides its samples: pprof's `default_sample_type`,
/// `period_type` and `period`. Nothing is written for what is `None` (the default).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProfileMetadata {
    /// The type a viewer shows unless told otherwise; one of the profile's sample types.
    pub default_sample_type: Option<SampleType>,
    /// What one sampling event stands for: a type (written as its name and unit, need not be
    /// one of the profile's) and how much of it (nanoseconds of CPU, bytes allocated, ...).
    pub period: Option<(SampleType, i64)>,
}

/// A profile being recorded.
pub struct Profile {
    types: Box<[SampleType]>,
    storage: Option<Arc<StringStorage>>,
    start: SystemTime,
    metadata: ProfileMetadata,
    t: Tables,
    /// Most bytes the tables may hold ([`Profile::set_max_bytes`]); `usize::MAX`: no cap.
    cap: usize,
}

impl Profile {
    /// `strings` resolves [`Str::Id`] values; without it, ids are an error.
    pub fn new(
        types: &[SampleType],
        strings: Option<Arc<StringStorage>>,
        start: SystemTime,
    ) -> Self {
        let generation = strings.as_ref().map_or(0, |s| s.generation());
        Profile {
            types: types.into(),
            storage: strings,
            start,
            metadata: ProfileMetadata::default(),
            t: Tables::new(types, generation),
            cap: usize::MAX,
        }
    }

    /// Sets what the encoded profile says about itself; kept across resets. A default type that
    /// is not one of the profile's types, or a negative period, is an error and changes nothing.
    pub fn set_metadata(&mut self, metadata: ProfileMetadata) -> Result<(), ProfileError> {
        if let Some(t) = metadata.default_sample_type {
            if !self.types.contains(&t) {
                return Err(ProfileError::DefaultTypeNotInProfile(t.name()));
            }
        }
        if let Some((_, period)) = metadata.period {
            if period < 0 {
                return Err(ProfileError::NegativePeriod(period));
            }
        }
        self.metadata = metadata;
        Ok(())
    }

    /// The metadata set by [`Profile::set_metadata`].
    pub fn metadata(&self) -> ProfileMetadata {
        self.metadata
    }

    /// The profile's sample types, in the order of every sample's values.
    pub fn sample_types(&self) -> &[SampleType] {
        &self.types
    }

    /// When the profile's recording began.
    pub fn start(&self) -> SystemTime {
        self.start
    }

    /// Distinct aggregated samples plus timestamped samples held.
    pub fn sample_count(&self) -> usize {
        self.t.agg.len() + self.t.timed.len() + self.t.dropped.labels.len()
    }

    /// Bytes held by the profile's tables, for memory reporting.
    pub fn memory_bytes(&self) -> usize {
        self.t.memory_bytes()
    }

    /// Drops all samples, endpoints and interned data; the profile restarts at `start`.
    pub fn reset(&mut self, start: SystemTime) {
        let generation = self.storage.as_ref().map_or(0, |s| s.generation());
        self.t = Tables::new(&self.types, generation);
        self.start = start;
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::sample_key::sample_key_hash;
    use super::*;
    use crate::error::StringError;
    use crate::pprof::{Compression, EncodeOptions, MappingInfo, ResolvedFrame, Symbolizer};

    const TYPES: [SampleType; 2] = [SampleType::CpuSamples, SampleType::WallTime];

    fn t0() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000)
    }

    fn profile() -> Profile {
        Profile::new(&TYPES, None, t0())
    }

    fn decode(p: &Profile) -> ferroprof_pprof::Profile {
        let opts = EncodeOptions {
            compression: Compression::None,
        };
        let enc = p
            .encode(t0() + Duration::from_secs(60), &opts, None)
            .unwrap();
        ferroprof_pprof::decode(&enc.bytes).unwrap()
    }

    fn add(p: &mut Profile, frames: &[Frame<'_>], values: &[i64], labels: &[Label<'_>], ts: i64) {
        p.add(&Sample {
            frames,
            values,
            labels,
            end_timestamp_ns: ts,
        })
        .unwrap();
    }

    #[test]
    fn aggregates_by_stack_and_labels() {
        let mut p = profile();
        let a = [Frame::sym("leaf", "a.rs", 1), Frame::sym("main", "m.rs", 9)];
        let b = [
            Frame::sym("other", "a.rs", 2),
            Frame::sym("main", "m.rs", 9),
        ];
        let l1 = [Label::num("thread id", 1)];
        let l2 = [Label::num("thread id", 2)];
        add(&mut p, &a, &[1, 10], &l1, 0);
        add(&mut p, &a, &[2, 20], &l1, 0);
        add(&mut p, &a, &[4, 40], &l2, 0);
        add(&mut p, &b, &[8, 80], &l1, 0);
        assert_eq!(p.sample_count(), 3);
        let d = decode(&p);
        assert_eq!(d.sample.len(), 3);
        assert_eq!(d.total("cpu-samples"), Some(15));
        assert_eq!(d.total("wall-time"), Some(150));
        let s0 = &d.sample[0];
        assert_eq!(d.stack_names(s0), vec!["leaf", "main"]);
        assert_eq!(s0.value, vec![3, 30]);
        assert_eq!(d.label_num(s0, "thread id"), Some(1));
        // "main" is one function and one location shared by both stacks.
        assert_eq!(d.function.len(), 3);
        assert_eq!(d.location.len(), 3);
        assert!(d.mapping.is_empty());
    }

    #[test]
    fn timestamped_samples_stay_separate() {
        let mut p = profile();
        let f = [Frame::sym("f", "f.rs", 1)];
        add(&mut p, &f, &[1, 1], &[], 100);
        add(&mut p, &f, &[1, 1], &[], 200);
        add(&mut p, &f, &[1, 1], &[], 0);
        assert_eq!(p.sample_count(), 3);
        let d = decode(&p);
        let ts: Vec<Option<i64>> = d
            .sample
            .iter()
            .map(|s| d.label_num(s, END_TIMESTAMP_LABEL))
            .collect();
        assert_eq!(ts, vec![None, Some(100), Some(200)]);
    }

    #[test]
    fn validation_errors_leave_profile_unchanged() {
        let mut p = profile();
        let f = [Frame::sym("f", "f.rs", 1)];
        add(&mut p, &f, &[1, 1], &[Label::str("k", "v")], 0);
        let before = decode(&p);
        let try_add = |p: &mut Profile, values: &[i64], labels: &[Label<'_>], ts: i64| {
            p.add(&Sample {
                frames: &f,
                values,
                labels,
                end_timestamp_ns: ts,
            })
        };
        assert_eq!(
            try_add(&mut p, &[1], &[], 0),
            Err(ProfileError::WrongValueCount {
                expected: 2,
                got: 1
            })
        );
        assert_eq!(
            try_add(
                &mut p,
                &[1, 1],
                &[Label::str("k", "a"), Label::num("k", 2)],
                0
            ),
            Err(ProfileError::DuplicateLabelKey("k".into()))
        );
        assert_eq!(
            try_add(
                &mut p,
                &[1, 1],
                &[Label::str(LOCAL_ROOT_SPAN_ID_LABEL, "12")],
                0
            ),
            Err(ProfileError::StringLocalRootSpanId("12".into()))
        );
        assert_eq!(
            try_add(&mut p, &[1, 1], &[Label::num("", 1)], 0),
            Err(ProfileError::EmptyLabelKey)
        );
        assert_eq!(
            try_add(&mut p, &[1, 1], &[], -5),
            Err(ProfileError::NegativeTimestamp(-5))
        );
        assert_eq!(
            try_add(&mut p, &[1, 1], &[Label::num(END_TIMESTAMP_LABEL, 1)], 7),
            Err(ProfileError::ReservedLabelKey(END_TIMESTAMP_LABEL.into()))
        );
        let many = vec![Frame::Address(1); MAX_FRAMES + 1];
        assert_eq!(
            p.add(&Sample {
                frames: &many,
                values: &[1, 1],
                labels: &[],
                end_timestamp_ns: 0
            }),
            Err(ProfileError::TooManyFrames {
                got: MAX_FRAMES + 1,
                limit: MAX_FRAMES
            })
        );
        assert_eq!(
            p.add(&Sample {
                frames: &[Frame::ids(StringId::from_raw(3), StringId::EMPTY, 1)],
                values: &[1, 1],
                labels: &[],
                end_timestamp_ns: 0
            }),
            Err(ProfileError::NoStringStorage(3))
        );
        assert_eq!(p.sample_count(), 1);
        assert_eq!(decode(&p), before);
    }

    #[test]
    fn reserved_timestamp_label_is_checked_on_known_keys_too() {
        let mut p = profile();
        let f = [Frame::sym("f", "f.rs", 1)];
        let l = [Label::num(END_TIMESTAMP_LABEL, 3)];
        // Untimestamped, the label is the caller's own business.
        add(&mut p, &f, &[1, 1], &l, 0);
        let timed = Sample {
            frames: &f,
            values: &[1, 1],
            labels: &l,
            end_timestamp_ns: 9,
        };
        assert_eq!(
            p.add(&timed),
            Err(ProfileError::ReservedLabelKey(END_TIMESTAMP_LABEL.into()))
        );
        assert_eq!(p.sample_count(), 1);
    }

    #[test]
    fn duplicate_keys_among_many_labels() {
        let keys: Vec<String> = (0..40).map(|i| format!("k{i}")).collect();
        let mut labels: Vec<Label<'_>> = keys.iter().map(|k| Label::num(k, 1)).collect();
        let mut p = profile();
        add(&mut p, &[], &[1, 1], &labels, 0);
        labels.push(Label::str("k7", "again"));
        assert_eq!(
            p.add(&Sample {
                frames: &[],
                values: &[1, 1],
                labels: &labels,
                end_timestamp_ns: 0
            }),
            Err(ProfileError::DuplicateLabelKey("k7".into()))
        );
    }

    #[test]
    fn ids_resolve_through_storage_and_aggregate_with_literals() {
        let st = Arc::new(StringStorage::new());
        let mut p = Profile::new(&TYPES, Some(st.clone()), t0());
        let name = st.intern("alloc_here").unwrap();
        let file = st.intern("alloc.rs").unwrap();
        let key = st.intern("thread name").unwrap();
        let val = st.intern("worker").unwrap();
        let id_frames = [Frame::ids(name, file, 3)];
        let id_labels = [Label {
            key: Str::Id(key),
            value: LabelValue::Str(Str::Id(val)),
        }];
        add(&mut p, &id_frames, &[1, 1], &id_labels, 0);
        add(&mut p, &id_frames, &[1, 1], &id_labels, 0);
        add(
            &mut p,
            &[Frame::sym("alloc_here", "alloc.rs", 3)],
            &[1, 1],
            &[Label::str("thread name", "worker")],
            0,
        );
        assert_eq!(p.sample_count(), 1);
        let d = decode(&p);
        assert_eq!(d.sample[0].value, vec![3, 3]);
        assert_eq!(d.stack(&d.sample[0])[0].filename, "alloc.rs");
        assert_eq!(d.label_str(&d.sample[0], "thread name"), Some("worker"));
        // Unknown id: a typed error naming it.
        // Unknown id after a good literal frame: nothing of the sample is kept.
        let before = decode(&p);
        let bad = [
            Frame::sym("fresh_literal", "fresh.rs", 1),
            Frame::ids(StringId::from_raw(999), file, 1),
        ];
        assert_eq!(
            p.add(&Sample {
                frames: &bad,
                values: &[1, 1],
                labels: &[],
                end_timestamp_ns: 0
            }),
            Err(ProfileError::String(StringError::UnknownId(999)))
        );
        assert_eq!(decode(&p), before);
    }

    #[test]
    fn reused_ids_after_generation_advance_resolve_to_the_new_string() {
        let st = Arc::new(StringStorage::new());
        let mut p = Profile::new(&TYPES, Some(st.clone()), t0());
        let old = st.intern("old_fn").unwrap();
        add(
            &mut p,
            &[Frame::ids(old, StringId::EMPTY, 1)],
            &[1, 0],
            &[],
            0,
        );
        st.unintern(old).unwrap();
        st.advance_generation();
        let new = st.intern("new_fn").unwrap();
        assert_eq!(new, old, "the test relies on id reuse");
        add(
            &mut p,
            &[Frame::ids(new, StringId::EMPTY, 1)],
            &[2, 0],
            &[],
            0,
        );
        let d = decode(&p);
        let mut got: Vec<(String, i64)> = d
            .sample
            .iter()
            .map(|s| (d.stack_names(s)[0].clone(), s.value[0]))
            .collect();
        got.sort();
        assert_eq!(got, vec![("new_fn".into(), 2), ("old_fn".into(), 1)]);
    }

    #[test]
    fn hash_collisions_never_merge_samples() {
        // 44 bytes differing only at byte 16, which the sample-key hash does not read.
        let a = format!("{}A{}", "p".repeat(16), "s".repeat(27));
        let b = format!("{}B{}", "p".repeat(16), "s".repeat(27));
        assert_eq!(
            sample_key_hash(&[Frame::sym(&a, "x.rs", 1)], &[]),
            sample_key_hash(&[Frame::sym(&b, "x.rs", 1)], &[]),
            "the test needs a real collision"
        );
        let mut p = profile();
        for _ in 0..3 {
            add(&mut p, &[Frame::sym(&a, "x.rs", 1)], &[1, 0], &[], 0);
            add(&mut p, &[Frame::sym(&b, "x.rs", 1)], &[10, 0], &[], 0);
        }
        let d = decode(&p);
        assert_eq!(d.sample.len(), 2);
        for s in &d.sample {
            let name = &d.stack_names(s)[0];
            assert_eq!(s.value[0], if *name == a { 3 } else { 30 });
        }
    }

    #[test]
    fn endpoints_of_unsampled_requests_are_bounded_and_late_samples_named() {
        let mut p = profile();
        let f = [Frame::sym("handler", "h.rs", 1)];
        // Named before any of its samples (recorded a little after the request ended).
        p.set_endpoint(1, "GET /late").unwrap();
        // Many requests nothing sampled: counted, their mappings not all kept.
        for root in 100..100 + 3 * LATE_ENDPOINTS as u64 {
            p.set_endpoint(root, "GET /busy").unwrap();
        }
        assert!(p.t.endpoints.is_empty());
        assert_eq!(p.t.late_endpoints.len(), LATE_ENDPOINTS);
        assert_eq!(p.t.late_order.len(), LATE_ENDPOINTS);
        // The most recent unsampled request's samples still get its endpoint; root 1 went.
        let last = 100 + 3 * LATE_ENDPOINTS as i64 - 1;
        for root in [1, last] {
            add(
                &mut p,
                &f,
                &[1, 0],
                &[Label::num(LOCAL_ROOT_SPAN_ID_LABEL, root)],
                0,
            );
        }
        let enc = p
            .encode(
                t0(),
                &EncodeOptions {
                    compression: Compression::None,
                },
                None,
            )
            .unwrap();
        assert_eq!(
            enc.endpoint_counts,
            vec![
                ("GET /busy".into(), 3 * LATE_ENDPOINTS as i64),
                ("GET /late".into(), 1)
            ]
        );
        let d = ferroprof_pprof::decode(&enc.bytes).unwrap();
        let eps: Vec<(i64, Option<&str>)> = d
            .sample
            .iter()
            .map(|s| {
                (
                    d.label_num(s, LOCAL_ROOT_SPAN_ID_LABEL).unwrap(),
                    d.label_str(s, TRACE_ENDPOINT_LABEL),
                )
            })
            .collect();
        assert_eq!(eps, vec![(1, None), (last, Some("GET /busy"))]);
        // A sampled root keeps its mapping in the profile's own table.
        p.set_endpoint(1, "GET /late").unwrap();
        assert_eq!(p.t.endpoints.len(), 1);
    }

    #[test]
    fn endpoint_names_are_bounded() {
        let mut p = profile();
        let n = MAX_ENDPOINT_NAMES + 10;
        for i in 0..n {
            p.set_endpoint(i as u64 + 1, &format!("GET /raw/{i}"))
                .unwrap();
        }
        // A name already kept still counts as itself.
        p.add_endpoint_count("GET /raw/0", 1).unwrap();
        let enc = p
            .encode(
                t0(),
                &EncodeOptions {
                    compression: Compression::None,
                },
                None,
            )
            .unwrap();
        assert_eq!(enc.endpoint_counts.len(), MAX_ENDPOINT_NAMES + 1);
        let count = |name: &str| {
            enc.endpoint_counts
                .iter()
                .find(|(e, _)| e == name)
                .map(|(_, c)| *c)
        };
        assert_eq!(count(OTHER_ENDPOINTS), Some(10));
        assert_eq!(count("GET /raw/0"), Some(2));
        let total: i64 = enc.endpoint_counts.iter().map(|(_, c)| c).sum();
        assert_eq!(total, n as i64 + 1);
    }

    #[test]
    fn endpoints_apply_to_earlier_and_later_samples() {
        let mut p = profile();
        let f = [Frame::sym("handler", "h.rs", 1)];
        add(
            &mut p,
            &f,
            &[1, 0],
            &[Label::num(LOCAL_ROOT_SPAN_ID_LABEL, 42)],
            0,
        );
        add(
            &mut p,
            &f,
            &[1, 0],
            &[Label::num(LOCAL_ROOT_SPAN_ID_LABEL, 7)],
            0,
        );
        p.set_endpoint(42, "GET /old").unwrap();
        p.set_endpoint(42, "GET /users").unwrap();
        add(
            &mut p,
            &f,
            &[1, 0],
            &[Label::num(LOCAL_ROOT_SPAN_ID_LABEL, 42)],
            5,
        );
        // A sample that already names its endpoint keeps its own.
        add(
            &mut p,
            &f,
            &[1, 0],
            &[
                Label::num(LOCAL_ROOT_SPAN_ID_LABEL, 42),
                Label::str(TRACE_ENDPOINT_LABEL, "mine"),
            ],
            0,
        );
        p.add_endpoint_count("GET /users", 10).unwrap();
        let enc = p
            .encode(
                t0(),
                &EncodeOptions {
                    compression: Compression::Gzip,
                },
                None,
            )
            .unwrap();
        assert_eq!(
            enc.endpoint_counts,
            vec![("GET /old".into(), 1), ("GET /users".into(), 11)]
        );
        let d = ferroprof_pprof::decode(&enc.bytes).unwrap();
        let eps: Vec<(i64, Option<&str>)> = d
            .sample
            .iter()
            .map(|s| {
                (
                    d.label_num(s, LOCAL_ROOT_SPAN_ID_LABEL).unwrap(),
                    d.label_str(s, TRACE_ENDPOINT_LABEL),
                )
            })
            .collect();
        assert_eq!(
            eps,
            vec![
                (42, Some("GET /users")),
                (7, None),
                (42, Some("mine")),
                (42, Some("GET /users")),
            ]
        );
        for s in &d.sample {
            let n = s
                .label
                .iter()
                .filter(|l| d.str(l.key) == TRACE_ENDPOINT_LABEL)
                .count();
            assert!(n <= 1);
        }
    }

    struct FakeSymbols;
    impl Symbolizer for FakeSymbols {
        fn symbolize(&mut self, address: u64, out: &mut Vec<ResolvedFrame>) {
            match address {
                0x1000 => {
                    out.push(ResolvedFrame {
                        name: "inlined".into(),
                        filename: "i.rs".into(),
                        line: 5,
                        ..Default::default()
                    });
                    out.push(ResolvedFrame {
                        name: "outer".into(),
                        filename: "o.rs".into(),
                        line: 50,
                        ..Default::default()
                    });
                }
                0x2000 => out.push(ResolvedFrame {
                    name: "main".into(),
                    filename: "m.rs".into(),
                    line: 1,
                    ..Default::default()
                }),
                _ => {}
            }
        }
    }

    #[test]
    fn address_frames_are_symbolized_at_encoding() {
        let mut p = profile();
        let frames = [
            Frame::Address(0x1000),
            Frame::Address(0x2000),
            Frame::Address(0x3000),
        ];
        add(&mut p, &frames, &[1, 0], &[], 0);
        add(&mut p, &[Frame::sym("main", "m.rs", 1)], &[1, 0], &[], 0);
        let opts = EncodeOptions {
            compression: Compression::Gzip,
        };
        let mut sym = FakeSymbols;
        let enc = p.encode(t0(), &opts, Some(&mut sym)).unwrap();
        let d = ferroprof_pprof::decode(&enc.bytes).unwrap();
        let stack = d.stack(&d.sample[0]);
        let names: Vec<&str> = stack.iter().map(|l| l.function.as_str()).collect();
        assert_eq!(names, vec!["inlined", "outer", "main", "0x3000"]);
        assert_eq!(stack[0].address, 0x1000);
        assert_eq!(stack[1].line, 50);
        // The inlined pair is one location with two lines.
        let loc = d.location.iter().find(|l| l.address == 0x1000).unwrap();
        assert_eq!(loc.line.len(), 2);
        // "main" from symbolization reuses the function of the literal frame.
        assert_eq!(
            d.function
                .iter()
                .filter(|f| d.str(f.name) == "main")
                .count(),
            1
        );

        // Without a symbolizer the addresses stand alone.
        let d = decode(&p);
        let names = d.stack_names(&d.sample[0]);
        assert_eq!(names, vec!["0x1000", "0x2000", "0x3000"]);
    }

    /// Frames with linkage names and start lines, and two objects' mappings.
    struct MappedSymbols {
        objects: [MappingInfo; 2],
    }

    impl Symbolizer for MappedSymbols {
        fn symbolize(&mut self, address: u64, out: &mut Vec<ResolvedFrame>) {
            let (name, system_name, start_line) = match address {
                0x7f00_0000_1010 => ("lib::f", "_ZN3lib1f17h0123456789abcdefE", 3),
                0x5500_0000_2010 => ("app::main", "_ZN3app4main17h0123456789abcdefE", 10),
                0x5500_0000_2020 => ("app::main", "_ZN3app4main17h0123456789abcdefE", 10),
                _ => return,
            };
            out.push(ResolvedFrame {
                name: name.into(),
                system_name: system_name.into(),
                filename: "src/x.rs".into(),
                line: 12,
                start_line,
            });
        }

        fn mapping(&mut self, address: u64) -> Option<&MappingInfo> {
            self.objects
                .iter()
                .find(|m| m.memory_start <= address && address < m.memory_limit)
        }
    }

    #[test]
    fn mappings_and_function_details_are_written() {
        let mut p = profile();
        let frames = [
            Frame::Address(0x7f00_0000_1010),
            Frame::Address(0x5500_0000_2010),
            Frame::Address(0x5500_0000_2020),
            Frame::Address(0x1234),
        ];
        add(&mut p, &frames, &[1, 0], &[], 0);
        add(
            &mut p,
            &[Frame::sym("app::main", "src/x.rs", 12)],
            &[1, 0],
            &[],
            0,
        );
        let lib = MappingInfo {
            memory_start: 0x7f00_0000_1000,
            memory_limit: 0x7f00_0000_2000,
            file_offset: 0x1000,
            filename: "/lib/libx.so".into(),
            build_id: "abcd".into(),
            has_functions: true,
            ..Default::default()
        };
        let app = MappingInfo {
            memory_start: 0x5500_0000_2000,
            memory_limit: 0x5500_0000_3000,
            file_offset: 0x2000,
            filename: "/bin/app".into(),
            build_id: "0123".into(),
            has_functions: true,
            has_filenames: true,
            has_line_numbers: true,
            has_inline_frames: true,
        };
        let mut sym = MappedSymbols {
            objects: [lib, app],
        };
        let opts = EncodeOptions {
            compression: Compression::None,
        };
        let enc = p.encode(t0(), &opts, Some(&mut sym)).unwrap();
        let d = ferroprof_pprof::decode(&enc.bytes).unwrap();
        // One mapping per object used, lowest first: the program before the library.
        let files: Vec<&str> = d.mapping.iter().map(|m| d.str(m.filename)).collect();
        assert_eq!(files, ["/bin/app", "/lib/libx.so"]);
        let m = &d.mapping[0];
        assert_eq!(m.id, 1);
        assert_eq!(
            (m.memory_start, m.memory_limit, m.file_offset),
            (0x5500_0000_2000, 0x5500_0000_3000, 0x2000)
        );
        assert_eq!(d.str(m.build_id), "0123");
        assert!(m.has_functions && m.has_filenames && m.has_line_numbers && m.has_inline_frames);
        let m = &d.mapping[1];
        assert_eq!(d.str(m.build_id), "abcd");
        assert!(m.has_functions && !m.has_filenames && !m.has_inline_frames);
        for l in &d.location {
            let want = match l.address {
                0x7f00_0000_1010 => 2,
                0x5500_0000_2010 | 0x5500_0000_2020 => 1,
                _ => 0,
            };
            assert_eq!(l.mapping_id, want, "location at {:#x}", l.address);
        }
        // Two addresses of one function: one function, with its linkage name and start line;
        // the literal frame without them stays a function of its own.
        let mains: Vec<_> = d
            .function
            .iter()
            .filter(|f| d.str(f.name) == "app::main")
            .collect();
        assert_eq!(mains.len(), 2, "{mains:?}");
        let full = mains.iter().find(|f| f.system_name != 0).unwrap();
        assert_eq!(d.str(full.system_name), "_ZN3app4main17h0123456789abcdefE");
        assert_eq!(full.start_line, 10);
        assert_eq!(d.str(full.filename), "src/x.rs");
    }

    #[test]
    fn times_and_reset() {
        let mut p = profile();
        add(&mut p, &[Frame::sym("f", "f.rs", 1)], &[1, 1], &[], 0);
        p.set_endpoint(1, "e").unwrap();
        let d = decode(&p);
        assert_eq!(d.time_nanos, 1_700_000_000 * 1_000_000_000);
        assert_eq!(d.duration_nanos, 60 * 1_000_000_000);
        assert_eq!(
            d.sample_types(),
            vec![
                ("cpu-samples".to_string(), "count".to_string()),
                ("wall-time".to_string(), "nanoseconds".to_string())
            ]
        );
        let later = t0() + Duration::from_secs(5);
        p.reset(later);
        assert_eq!(p.start(), later);
        assert_eq!(p.sample_count(), 0);
        let enc = p.encode(later, &EncodeOptions::default(), None).unwrap();
        assert!(enc.endpoint_counts.is_empty());
        let d = ferroprof_pprof::decode(&enc.bytes).unwrap();
        assert!(d.sample.is_empty());
        assert!(d.function.is_empty());
        assert_eq!(d.duration_nanos, 0);
        // A clock that went backwards: zero duration, not an error.
        let enc = p.encode(t0(), &EncodeOptions::default(), None).unwrap();
        assert_eq!(
            ferroprof_pprof::decode(&enc.bytes).unwrap().duration_nanos,
            0
        );
    }

    #[test]
    fn negative_values_and_big_numbers_round_trip() {
        let mut p = profile();
        add(
            &mut p,
            &[Frame::sym("f", "f.rs", -1), Frame::Address(u64::MAX)],
            &[-5, i64::MAX],
            &[Label::num("n", i64::MIN)],
            i64::MAX,
        );
        let d = decode(&p);
        let s = &d.sample[0];
        assert_eq!(s.value, vec![-5, i64::MAX]);
        assert_eq!(d.label_num(s, "n"), Some(i64::MIN));
        assert_eq!(d.label_num(s, END_TIMESTAMP_LABEL), Some(i64::MAX));
        assert_eq!(d.stack(s)[0].line, -1);
        assert_eq!(d.stack(s)[1].address, u64::MAX);
    }

    #[test]
    fn unindexed_stacks_and_rows_encode_like_added_ones() {
        let frames = [Frame::Address(0x10), Frame::sym("main", "m.rs", 1)];
        let other = [Frame::Address(0x20), Frame::sym("main", "m.rs", 1)];
        let heap = [Label::num("gc gen age", 1)];
        let mut p = profile();
        add(&mut p, &frames, &[1, 0], &[], 0);
        let mut spare = BulkBuffers::default();
        p.reserve_unindexed(2, 2, &mut spare);
        // An equal stack appended again, and a new one.
        let labels = p.intern_label_set(&heap).unwrap();
        let s1 = p.push_stack_unindexed(&frames, &[]).unwrap();
        let r1 = p.push_unindexed_row(s1, labels, &[0, 5]).unwrap();
        p.add_to_row(r1, &[0, 2]).unwrap();
        let mut hints = Vec::new();
        p.prefetch_stack(&other, &mut hints);
        let s2 = p.push_stack_unindexed(&other, &hints).unwrap();
        p.push_unindexed_row(s2, labels, &[0, 3]).unwrap();
        let mut q = profile();
        add(&mut q, &frames, &[1, 0], &[], 0);
        add(&mut q, &frames, &[0, 5], &heap, 0);
        add(&mut q, &frames, &[0, 2], &heap, 0);
        add(&mut q, &other, &[0, 3], &heap, 0);
        assert_eq!(decode(&p), decode(&q));
        // Lookups catch up with the appended entries.
        add(&mut p, &other, &[0, 1], &heap, 0);
        add(&mut q, &other, &[0, 1], &heap, 0);
        add(&mut p, &frames, &[4, 0], &[], 0);
        add(&mut q, &frames, &[4, 0], &[], 0);
        assert_eq!(decode(&p), decode(&q));

        // Another profile built in the first one's buffers, over samples (and locations) of its
        // own, then address stacks pushed as bare addresses.
        p.reset_into(t0(), &mut spare);
        assert!(spare.location_slots.len() >= 4 && spare.stack_items.capacity() >= 4);
        let mut r = profile();
        let addrs = [
            Frame::Address(0x30),
            Frame::Address(0x20),
            Frame::Address(0x30),
        ];
        add(&mut r, &other, &[1, 0], &[], 0);
        r.reserve_unindexed(1, 1, &mut spare);
        let labels = r.intern_label_set(&heap).unwrap();
        let mut ahead = PrefetchedStack::default();
        r.prefetch_addresses(&[0x30, 0x20, 0x30], &mut ahead);
        let s3 = r.push_address_stack_unindexed(&mut ahead).unwrap();
        r.push_unindexed_row(s3, labels, &[0, 7]).unwrap();
        add(&mut r, &addrs, &[2, 0], &[], 0);
        let mut q = profile();
        add(&mut q, &other, &[1, 0], &[], 0);
        add(&mut q, &addrs, &[0, 7], &heap, 0);
        add(&mut q, &addrs, &[2, 0], &[], 0);
        assert_eq!(decode(&r), decode(&q));
    }

    #[test]
    fn many_distinct_stacks_round_trip() {
        let mut p = profile();
        let names: Vec<String> = (0..2000).map(|i| format!("fn_{i}")).collect();
        for (i, n) in names.iter().enumerate() {
            let frames = [
                Frame::sym(n, "f.rs", i as i64),
                Frame::sym("root", "r.rs", 1),
            ];
            add(&mut p, &frames, &[i as i64, 1], &[], 0);
        }
        for (i, n) in names.iter().enumerate() {
            let frames = [
                Frame::sym(n, "f.rs", i as i64),
                Frame::sym("root", "r.rs", 1),
            ];
            add(&mut p, &frames, &[i as i64, 1], &[], 0);
        }
        assert_eq!(p.sample_count(), 2000);
        let d = decode(&p);
        for s in &d.sample {
            let names = d.stack_names(s);
            let i: i64 = names[0].trim_start_matches("fn_").parse().unwrap();
            assert_eq!(s.value, vec![2 * i, 2]);
            assert_eq!(names[1], "root");
        }
        assert!(p.memory_bytes() > 0);
    }
}
