//! Fuzz harness `recorder_ops`: a random program of calls against a [`StackRecorder`] (with or
//! without a heap recorder, native or managed liveness), its [`HeapRecorder`], a standalone
//! [`StringStorage`] checked against a model, and a bare [`Profile`] — malformed input and misuse
//! included (wrong value counts, empty/huge strings, too many frames, bad string ids, duplicate
//! object ids, start/end and prepare/finish out of order, fork resets).
//!
//! Asserted: nothing panics; every error has a message; string storage counts follow the model;
//! every serialized profile decodes and validates with the independent reader and carries exactly
//! the cpu-samples recorded into it; and after the whole program the recorder still records and
//! serializes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime};

use ferroprof_recorder::heap::ObjectInfo;
use ferroprof_recorder::pprof::EncodeOptions;
use ferroprof_recorder::profile::MAX_FRAMES;
use ferroprof_recorder::strings::MAX_STRING_LEN;
use ferroprof_recorder::{
    Compression, Frame, HeapConfig, Label, LabelValue, Liveness, LivenessSource, Profile,
    RecorderConfig, ResolvedFrame, Sample, SampleType, SampleTypeConfig, SampleValues,
    StackRecorder, Str, StringId, StringStorage, Symbolizer,
};

use crate::input::Input;

/// Most operations per input: long programs add little and slow the fuzzer down.
const MAX_OPS: usize = 96;

/// Checks that an error can be shown to a person and turns the result into an `Option`.
pub fn clear<T, E: std::fmt::Display + std::fmt::Debug>(r: Result<T, E>) -> Option<T> {
    match r {
        Ok(v) => Some(v),
        Err(e) => {
            let msg = e.to_string();
            assert!(!msg.trim().is_empty(), "error without a message: {e:?}");
            None
        }
    }
}

/// A string longer than the storage accepts.
fn huge() -> &'static str {
    static HUGE: OnceLock<String> = OnceLock::new();
    HUGE.get_or_init(|| "h".repeat(MAX_STRING_LEN + 1))
}

const WORDS: [&str; 8] = [
    "",
    "main",
    "alloc::vec::Vec<T>::push",
    "src/lib.rs",
    "thread name",
    "ünïcødé ☃",
    "local root span id",
    "end_timestamp_ns",
];

/// Managed-heap liveness answered from the ids themselves, with a collection counter the program
/// can bump.
struct FuzzHeap {
    gen: AtomicU64,
    defers: bool,
}

impl LivenessSource for FuzzHeap {
    fn gc_generation(&self) -> u64 {
        self.gen.load(Ordering::Relaxed)
    }

    fn lookup(&self, id: u64) -> Option<ObjectInfo> {
        (id % 5 != 0).then_some(ObjectInfo {
            size: id % 1000,
            frozen: id % 7 == 0,
        })
    }

    fn defers_ids(&self) -> bool {
        self.defers
    }

    fn resolve_handle(&self, handle: u64) -> Option<u64> {
        (handle % 11 != 0).then_some(handle ^ 0x55)
    }
}

/// Expands some addresses into zero to three (inlined) frames.
struct FuzzSymbolizer;

impl Symbolizer for FuzzSymbolizer {
    fn symbolize(&mut self, address: u64, out: &mut Vec<ResolvedFrame>) {
        for k in 0..address % 4 {
            out.push(ResolvedFrame {
                name: format!("sym{}_{k}", address % 16),
                filename: "inlined.rs".into(),
                line: k as i64,
                ..Default::default()
            });
        }
    }
}

/// Strings the program can use in frames and labels (borrowed from here).
#[derive(Default)]
struct Pool {
    /// Ids the program interned into the recorder's storage and owns one reference of each.
    owned: Vec<StringId>,
    /// Texts the program made up.
    texts: Vec<String>,
}

impl Pool {
    fn text(&mut self, input: &mut Input<'_>) -> usize {
        let t = input.text(24);
        self.texts.push(t);
        self.texts.len() - 1
    }

    /// A string choice: a word, made-up text, the huge string, or an id (owned or bogus).
    fn str<'a>(&'a self, input: &mut Input<'_>) -> Str<'a> {
        match input.u8() % 16 {
            0..=7 => Str::Lit(WORDS[input.below(WORDS.len())]),
            8..=10 if !self.texts.is_empty() => {
                Str::Lit(&self.texts[input.below(self.texts.len())])
            }
            11 if input.u8() == 0 => Str::Lit(huge()),
            12 | 13 if !self.owned.is_empty() => Str::Id(self.owned[input.below(self.owned.len())]),
            14 => Str::Id(StringId::from_raw(input.u32() % 64)),
            _ => Str::Lit("f"),
        }
    }

    fn frames<'a>(&'a self, input: &mut Input<'_>) -> Vec<Frame<'a>> {
        let n = match input.u8() {
            0 => MAX_FRAMES + 1,
            1 => MAX_FRAMES,
            b => usize::from(b % 8),
        };
        (0..n)
            .map(|_| {
                if input.u8() % 4 == 0 {
                    Frame::Address(u64::from(input.u16()))
                } else {
                    Frame::Symbol {
                        name: self.str(input),
                        filename: self.str(input),
                        line: input.int(),
                    }
                }
            })
            .collect()
    }

    fn labels<'a>(&'a self, input: &mut Input<'_>) -> Vec<Label<'a>> {
        (0..input.below(4))
            .map(|_| Label {
                key: self.str(input),
                value: if input.bool() {
                    LabelValue::Num(input.int())
                } else {
                    LabelValue::Str(self.str(input))
                },
            })
            .collect()
    }
}

struct World {
    rec: StackRecorder,
    source: Option<Arc<FuzzHeap>>,
    pool: Pool,
    /// Object ids handed to the heap (duplicates are fair game).
    objects: Vec<u64>,
    /// cpu-samples recorded into the active profile since the last flip; `None` once a value
    /// was extreme enough that the saturating sum is not worth modelling.
    expected_cpu_samples: Option<i128>,
    /// A standalone storage and its model: text -> (id, count).
    strings: StringStorage,
    model: HashMap<String, (StringId, u32)>,
    profile: Profile,
    serialized: usize,
}

impl World {
    fn new(input: &mut Input<'_>) -> World {
        let b = input.u8();
        let sample_types = SampleTypeConfig {
            cpu_time: b & 1 != 0,
            alloc_samples: b & 2 != 0,
            heap_samples: b & 4 != 0,
            heap_size: b & 8 != 0,
            timeline: b & 16 != 0,
        };
        let compression = match (b >> 5) % 3 {
            0 => Compression::Gzip,
            1 => Compression::None,
            _ => Compression::Zstd,
        };
        let c = input.u8();
        let source = (c & 1 != 0).then(|| {
            Arc::new(FuzzHeap {
                gen: AtomicU64::new(0),
                defers: c & 2 != 0,
            })
        });
        let heap = HeapConfig {
            sample_every: u32::from(c >> 5),
            clean_after_gc: c & 4 != 0,
            min_iteration_age: u32::from((c >> 3) & 3),
            liveness: match &source {
                Some(s) => Liveness::Managed(s.clone()),
                None => Liveness::Native,
            },
            ..HeapConfig::default()
        };
        let mut config = RecorderConfig {
            sample_types,
            heap,
            compression,
            // The ops' model has no cap (the cap has tests of its own).
            max_profile_bytes: None,
        };
        // Bad configurations (zstd unavailable, sample_every 0) are errors, then fixed.
        let rec = loop {
            match StackRecorder::new(config.clone()) {
                Ok(r) => break r,
                Err(e) => {
                    clear::<(), _>(Err(e));
                    if !config.compression.is_available() {
                        config.compression = Compression::Gzip;
                    } else if config.heap.sample_every == 0 {
                        config.heap.sample_every = 1;
                    } else {
                        panic!("valid configuration rejected: {config:?}");
                    }
                }
            }
        };
        let types: Vec<SampleType> = SampleType::ALL
            .into_iter()
            .filter(|_| input.bool())
            .collect();
        World {
            rec,
            source,
            pool: Pool::default(),
            objects: Vec::new(),
            expected_cpu_samples: Some(0),
            strings: StringStorage::new(),
            model: HashMap::new(),
            profile: Profile::new(&types, None, SystemTime::UNIX_EPOCH),
            serialized: 0,
        }
    }

    fn values(&mut self, input: &mut Input<'_>) -> SampleValues {
        let mut v = [0i64; 8];
        let mask = input.u8();
        for (i, x) in v.iter_mut().enumerate() {
            if mask & (1 << i) != 0 {
                *x = input.int();
            }
        }
        SampleValues {
            cpu_time_ns: v[0],
            cpu_or_wall_samples: v[1],
            wall_time_ns: v[2],
            alloc_samples: v[3],
            alloc_samples_unscaled: v[4],
            heap_live_samples: v[5],
            heap_live_size: v[6],
            timeline_wall_time_ns: v[7],
            heap_sample: input.u8() % 4 == 0,
        }
    }

    fn step(&mut self, input: &mut Input<'_>) {
        match input.u8() % 24 {
            0..=5 => self.record(input),
            6 => {
                let span = u64::from(input.u8() % 8);
                let t = self.pool.text(input);
                clear(self.rec.record_endpoint(span, &self.pool.texts[t]));
            }
            7 => self.serialize(input),
            8 => {
                let id = self.object_id(input);
                let class = self.str_text(input);
                clear(
                    self.rec
                        .track_object(id, u32::from(input.u8()), class.as_deref()),
                );
            }
            9 => {
                let id = self.object_id(input);
                let class = self.str_text(input);
                let frames = self.pool.frames(input);
                clear(self.rec.track_allocation(
                    id,
                    u32::from(input.u8()),
                    u64::from(input.u32()),
                    class.as_deref(),
                    &frames,
                ));
            }
            10 => {
                let id = self.object_id(input);
                self.rec.untrack_allocation(id);
            }
            11 => {
                if let Some(s) = &self.source {
                    s.gen.fetch_add(1, Ordering::Relaxed);
                }
                self.rec.after_gc_step();
            }
            12 => self.heap_misuse(input),
            13 => {
                // A fork child: no other thread uses the recorder here.
                self.rec.reset_after_fork();
                self.expected_cpu_samples = Some(0);
            }
            14 => {
                let t = self.pool.text(input);
                if let Some(id) = clear(self.rec.strings().intern(&self.pool.texts[t])) {
                    if id != StringId::EMPTY {
                        self.pool.owned.push(id);
                    }
                }
            }
            15 => {
                if !self.pool.owned.is_empty() {
                    let id = self
                        .pool
                        .owned
                        .swap_remove(input.below(self.pool.owned.len()));
                    clear(self.rec.strings().unintern(id)).expect("owned reference");
                }
            }
            16..=19 => self.strings_op(input),
            20 | 21 => self.profile_op(input),
            22 => {
                let _ = self.rec.stats();
            }
            _ => {
                let t = self.pool.text(input);
                let _ = t;
            }
        }
    }

    fn object_id(&mut self, input: &mut Input<'_>) -> u64 {
        if !self.objects.is_empty() && input.bool() {
            self.objects[input.below(self.objects.len())]
        } else {
            let id = u64::from(input.u16());
            self.objects.push(id);
            id
        }
    }

    fn str_text(&mut self, input: &mut Input<'_>) -> Option<String> {
        match input.u8() % 4 {
            0 => None,
            1 => Some(String::new()),
            2 if input.u8() == 0 => Some(huge().to_owned()),
            _ => {
                let t = self.pool.text(input);
                Some(self.pool.texts[t].clone())
            }
        }
    }

    fn record(&mut self, input: &mut Input<'_>) {
        let values = self.values(input);
        let ts = match input.u8() % 4 {
            0 => input.int(),
            1 => 1_700_000_000_000_000_000,
            _ => 0,
        };
        let frames = self.pool.frames(input);
        let labels = self.pool.labels(input);
        let ok = clear(self.rec.record_sample(&frames, &values, &labels, ts)).is_some();
        if ok {
            let n = values.cpu_or_wall_samples;
            self.expected_cpu_samples = self
                .expected_cpu_samples
                .and_then(|e| (n.unsigned_abs() < 1 << 40).then_some(e + i128::from(n)));
        }
    }

    fn serialize(&mut self, input: &mut Input<'_>) {
        let mut sym = FuzzSymbolizer;
        let sym: Option<&mut dyn Symbolizer> = if input.bool() { Some(&mut sym) } else { None };
        let expected = self.expected_cpu_samples.replace(0);
        let Some(p) = clear(self.rec.serialize(sym)) else {
            return;
        };
        let decoded =
            ferroprof_pprof::decode(&p.encoded.bytes).expect("serialized profile decodes");
        self.serialized += 1;
        assert_eq!(decoded.sample_type.len(), self.rec.layout().len());
        if let (Some(expected), Some(i)) = (expected, decoded.value_index("cpu-samples")) {
            // Heap samples carry no cpu-samples, so this is exactly what the samplers recorded.
            let got: i128 = decoded.sample.iter().map(|s| i128::from(s.value[i])).sum();
            assert_eq!(got, expected, "cpu-samples of the profile");
        }
    }

    /// Heap calls in the wrong order, bypassing the stack recorder.
    fn heap_misuse(&mut self, input: &mut Input<'_>) {
        let op = input.u8() % 8;
        let frames = self.pool.frames(input);
        let Some(heap) = self.rec.heap() else {
            return;
        };
        match op {
            0 => {
                clear(heap.prepare_iteration());
            }
            1 => {
                clear(heap.finish_iteration());
            }
            2 => {
                let mut visited = 0u32;
                clear(heap.for_each_live_object(&mut |_, _| {
                    visited += 1;
                    visited < 1000
                }));
            }
            3 => {
                clear(heap.start_recording(u64::from(input.u16()), 1, Some("C")));
            }
            4 => {
                clear(heap.end_recording(&frames));
            }
            5 => {
                clear(heap.finalize_pending_recordings());
                heap.for_each_pending_handle(|_| {});
            }
            6 => {
                clear(heap.set_sample_every(input.int()));
            }
            _ => {
                heap.update_young_objects();
                let _ = heap.stats();
            }
        }
    }

    /// The standalone storage against its model.
    fn strings_op(&mut self, input: &mut Input<'_>) {
        match input.u8() % 6 {
            0 | 1 => {
                let s = if input.u8() == 0 {
                    huge().to_owned()
                } else {
                    input.text(12)
                };
                match self.strings.intern(&s) {
                    Ok(id) if s.is_empty() => assert_eq!(id, StringId::EMPTY),
                    Ok(id) => {
                        let e = self.model.entry(s).or_insert((id, 0));
                        assert_eq!(e.0, id, "a live string keeps its id");
                        e.1 += 1;
                    }
                    Err(e) => {
                        assert!(s.len() > MAX_STRING_LEN, "intern failed: {e}");
                        clear::<(), _>(Err(e));
                    }
                }
            }
            2 => {
                let (text, id) = self.pick_model_id(input);
                let r = self.strings.unintern(id);
                match text.and_then(|t| self.model.get_mut(&t)) {
                    Some(e) if e.1 > 0 => {
                        r.expect("unintern of a referenced string");
                        e.1 -= 1;
                    }
                    _ if id == StringId::EMPTY => r.expect("unintern of the empty string"),
                    _ => assert!(
                        clear(r).is_none(),
                        "unintern of an unreferenced id succeeded"
                    ),
                }
            }
            3 => {
                let n = input.below(4);
                let strs: Vec<String> = (0..n).map(|_| input.text(6)).collect();
                let refs: Vec<&str> = strs.iter().map(String::as_str).collect();
                let mut ids = Vec::new();
                clear(self.strings.intern_all(&refs, &mut ids)).expect("short strings intern");
                for (s, id) in strs.into_iter().zip(ids) {
                    if !s.is_empty() {
                        self.model.entry(s).or_insert((id, 0)).1 += 1;
                    }
                }
            }
            4 => {
                let picks: Vec<(Option<String>, StringId)> = (0..input.below(4))
                    .map(|_| self.pick_model_id(input))
                    .collect();
                let ids: Vec<StringId> = picks.iter().map(|p| p.1).collect();
                let mut need: HashMap<StringId, u32> = HashMap::new();
                for &id in &ids {
                    if id != StringId::EMPTY {
                        *need.entry(id).or_default() += 1;
                    }
                }
                let enough = need.iter().all(|(id, n)| {
                    self.model
                        .values()
                        .any(|&(mid, count)| mid == *id && count >= *n)
                });
                let r = self.strings.unintern_all(&ids);
                if enough {
                    r.expect("unintern_all within the counts");
                    for e in self.model.values_mut() {
                        e.1 -= need.get(&e.0).copied().unwrap_or(0);
                    }
                } else {
                    assert!(clear(r).is_none(), "unintern_all past the counts succeeded");
                }
            }
            _ => {
                self.strings.advance_generation();
                self.model.retain(|_, e| e.1 > 0);
            }
        }
        // The model and the storage agree on what is referenced.
        let referenced = self.model.values().filter(|e| e.1 > 0).count();
        assert_eq!(self.strings.len(), referenced);
        for (s, &(id, count)) in &self.model {
            assert_eq!(self.strings.refcount(id), Some(count), "count of {s:?}");
            assert_eq!(self.strings.get(id).as_deref(), Ok(s.as_str()));
        }
    }

    /// A model string (with its text) or a made-up id.
    fn pick_model_id(&self, input: &mut Input<'_>) -> (Option<String>, StringId) {
        if !self.model.is_empty() && input.u8() % 4 != 0 {
            let mut keys: Vec<&String> = self.model.keys().collect();
            keys.sort();
            let k = keys[input.below(keys.len())];
            (Some(k.clone()), self.model[k].0)
        } else {
            let id = StringId::from_raw(input.u32() % 32);
            let text = self
                .model
                .iter()
                .find(|(_, e)| e.0 == id)
                .map(|(k, _)| k.clone());
            (text, id)
        }
    }

    /// The bare profile: any number of values, encode and read back.
    fn profile_op(&mut self, input: &mut Input<'_>) {
        if input.u8() % 4 == 0 {
            let compression = if input.bool() {
                Compression::None
            } else {
                Compression::Gzip
            };
            let end = SystemTime::UNIX_EPOCH + Duration::from_secs(u64::from(input.u8()));
            let opts = EncodeOptions { compression };
            if let Some(e) = clear(self.profile.encode(end, &opts, Some(&mut FuzzSymbolizer))) {
                ferroprof_pprof::decode(&e.bytes).expect("bare profile decodes");
            }
            if input.bool() {
                self.profile.reset(end);
            }
            return;
        }
        let n = match input.u8() % 4 {
            0 => input.below(12),
            _ => self.profile.sample_types().len(),
        };
        let values: Vec<i64> = (0..n).map(|_| input.int()).collect();
        let frames = self.pool.frames(input);
        let labels = self.pool.labels(input);
        let sample = Sample {
            frames: &frames,
            values: &values,
            labels: &labels,
            end_timestamp_ns: if input.bool() { input.int() } else { 0 },
        };
        let r = self.profile.add(&sample);
        if n != self.profile.sample_types().len() {
            assert!(r.is_err(), "wrong value count accepted");
        }
        clear(r);
    }

    /// After any program: a plain sample records, and a profile holding exactly it comes out.
    fn still_usable(&mut self) {
        // A managed recording left open by the program is ended normally first.
        if let Some(heap) = self.rec.heap() {
            clear(heap.end_recording(&[]));
            clear(heap.finalize_pending_recordings());
            // An iteration the program prepared is its own to finish: a serialization fails
            // on it without closing it.
            clear(heap.finish_iteration());
        }
        // One serialization may fail for what the program left behind; the next must succeed.
        if clear(self.rec.serialize(None)).is_none() {
            self.rec
                .serialize(None)
                .expect("second serialization after misuse");
        }
        let values = SampleValues {
            cpu_or_wall_samples: 7,
            ..SampleValues::default()
        };
        self.rec
            .record_sample(&[Frame::sym("marker", "marker.rs", 1)], &values, &[], 0)
            .expect("recorder still records");
        let p = self.rec.serialize(None).expect("recorder still serializes");
        let d = ferroprof_pprof::decode(&p.encoded.bytes).expect("valid profile");
        let i = d
            .value_index("cpu-samples")
            .expect("cpu-samples is always on");
        let total: i64 = d.sample.iter().map(|s| s.value[i]).sum();
        assert_eq!(total, 7);
        assert!(d
            .sample
            .iter()
            .any(|s| s.value[i] == 7 && d.stack_names(s) == ["marker"]));
    }
}

/// Runs one fuzz input; returns how many serializations of the program succeeded (the final
/// usability check not counted).
pub fn run(data: &[u8]) -> usize {
    let mut input = Input::new(data);
    let mut world = World::new(&mut input);
    for _ in 0..MAX_OPS {
        if input.is_empty() {
            break;
        }
        world.step(&mut input);
    }
    world.still_usable();
    // Give back the program's references; the storage must agree they were all owned.
    for id in std::mem::take(&mut world.pool.owned) {
        world.rec.strings().unintern(id).expect("owned reference");
    }
    world.serialized
}
