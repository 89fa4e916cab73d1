//! End-to-end checks of the stack recorder: everything is read back with the independent prost
//! decoder of `ferroprof-pprof`, never with the encoder's own code.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::SystemTime;

use ferroprof_recorder::heap::HeapConfig;
use ferroprof_recorder::profile::{
    END_TIMESTAMP_LABEL, LOCAL_ROOT_SPAN_ID_LABEL, TRACE_ENDPOINT_LABEL,
};
use ferroprof_recorder::stack_recorder::{ALLOCATION_CLASS_LABEL, GC_GEN_AGE_LABEL};
use ferroprof_recorder::{
    Compression, Frame, Label, RecorderConfig, RecorderError, ResolvedFrame, SampleTypeConfig,
    SampleValues, SerializedProfile, StackRecorder, Symbolizer,
};

fn config(sample_types: SampleTypeConfig) -> RecorderConfig {
    RecorderConfig {
        sample_types,
        heap: HeapConfig::native(),
        ..RecorderConfig::default()
    }
}

/// Everything but the heap types.
fn no_heap() -> RecorderConfig {
    config(SampleTypeConfig {
        heap_samples: false,
        heap_size: false,
        ..SampleTypeConfig::all()
    })
}

fn decode(p: &SerializedProfile) -> ferroprof_pprof::Profile {
    ferroprof_pprof::decode(&p.encoded.bytes).expect("valid pprof")
}

fn cpu(n: i64) -> SampleValues {
    SampleValues {
        cpu_or_wall_samples: n,
        ..Default::default()
    }
}

fn stack() -> [Frame<'static>; 2] {
    [
        Frame::sym("work", "work.rs", 10),
        Frame::sym("main", "main.rs", 1),
    ]
}

fn nanos(t: SystemTime) -> i64 {
    t.duration_since(SystemTime::UNIX_EPOCH).unwrap().as_nanos() as i64
}

#[test]
fn sample_types_and_units_follow_the_configuration() {
    let partial = SampleTypeConfig {
        cpu_time: true,
        alloc_samples: false,
        heap_samples: false,
        heap_size: false,
        timeline: true,
    };
    let cases = [
        (
            SampleTypeConfig::minimal(),
            vec![("cpu-samples", "count"), ("wall-time", "nanoseconds")],
        ),
        (
            partial,
            vec![
                ("cpu-samples", "count"),
                ("wall-time", "nanoseconds"),
                ("cpu-time", "nanoseconds"),
                ("timeline", "nanoseconds"),
            ],
        ),
        (
            no_heap().sample_types,
            vec![
                ("cpu-samples", "count"),
                ("wall-time", "nanoseconds"),
                ("cpu-time", "nanoseconds"),
                ("alloc-samples", "count"),
                ("alloc-samples-unscaled", "count"),
                ("timeline", "nanoseconds"),
            ],
        ),
        (
            SampleTypeConfig::all(),
            vec![
                ("cpu-time", "nanoseconds"),
                ("cpu-samples", "count"),
                ("wall-time", "nanoseconds"),
                ("alloc-samples", "count"),
                ("alloc-samples-unscaled", "count"),
                ("heap-live-samples", "count"),
                ("heap-live-size", "bytes"),
                ("timeline", "nanoseconds"),
            ],
        ),
    ];
    for (types, want) in cases {
        let r = StackRecorder::new(config(types)).unwrap();
        r.record_sample(&stack(), &cpu(1), &[], 0).unwrap();
        let d = decode(&r.serialize(None).unwrap());
        let got = d.sample_types();
        let got: Vec<(&str, &str)> = got.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
        assert_eq!(got, want, "{types:?}");
        assert_eq!(d.sample[0].value.len(), want.len());
    }
}

#[test]
fn values_land_in_their_types_and_disabled_ones_are_dropped() {
    let values = SampleValues {
        cpu_time_ns: 11,
        cpu_or_wall_samples: 22,
        wall_time_ns: 33,
        alloc_samples: 44,
        alloc_samples_unscaled: 55,
        heap_live_samples: 66,
        heap_live_size: 77,
        timeline_wall_time_ns: 88,
        heap_sample: false,
    };
    let r = StackRecorder::new(no_heap()).unwrap();
    r.record_sample(&stack(), &values, &[], 0).unwrap();
    r.record_sample(&stack(), &values, &[], 0).unwrap();
    let d = decode(&r.serialize(None).unwrap());
    assert_eq!(d.sample.len(), 1);
    let by_name = |n: &str| d.sample[0].value[d.value_index(n).unwrap()];
    assert_eq!(by_name("cpu-time"), 22);
    assert_eq!(by_name("cpu-samples"), 44);
    assert_eq!(by_name("wall-time"), 66);
    assert_eq!(by_name("alloc-samples"), 88);
    assert_eq!(by_name("alloc-samples-unscaled"), 110);
    assert_eq!(by_name("timeline"), 176);
    assert_eq!(d.value_index("heap-live-samples"), None);
    assert_eq!(d.value_index("heap-live-size"), None);

    let r = StackRecorder::new(config(SampleTypeConfig::minimal())).unwrap();
    r.record_sample(&stack(), &values, &[], 0).unwrap();
    let d = decode(&r.serialize(None).unwrap());
    assert_eq!(d.sample[0].value, vec![22, 33]);
    assert_eq!(d.stack_names(&d.sample[0]), vec!["work", "main"]);
}

#[test]
fn labels_round_trip_and_split_aggregation() {
    let r = StackRecorder::new(no_heap()).unwrap();
    let main = [
        Label::num("thread id", 1),
        Label::str("thread name", "main"),
    ];
    let worker = [
        Label::num("thread id", 2),
        Label::str("thread name", "worker"),
    ];
    r.record_sample(&stack(), &cpu(1), &main, 0).unwrap();
    r.record_sample(&stack(), &cpu(2), &worker, 0).unwrap();
    r.record_sample(&stack(), &cpu(4), &main, 0).unwrap();
    let d = decode(&r.serialize(None).unwrap());
    assert_eq!(d.sample.len(), 2);
    let mut got: Vec<(i64, String, i64)> = d
        .sample
        .iter()
        .map(|s| {
            (
                d.label_num(s, "thread id").unwrap(),
                d.label_str(s, "thread name").unwrap().to_owned(),
                s.value[d.value_index("cpu-samples").unwrap()],
            )
        })
        .collect();
    got.sort();
    assert_eq!(got, vec![(1, "main".into(), 5), (2, "worker".into(), 2)]);
}

#[test]
fn endpoints_apply_to_samples_recorded_before_them() {
    let r = StackRecorder::new(no_heap()).unwrap();
    let span = |id| [Label::num(LOCAL_ROOT_SPAN_ID_LABEL, id)];
    r.record_sample(&stack(), &cpu(1), &span(100), 0).unwrap();
    r.record_sample(&stack(), &cpu(1), &span(200), 0).unwrap();
    r.record_endpoint(100, "GET /orders").unwrap();
    r.record_sample(&stack(), &cpu(1), &span(100), 12345)
        .unwrap();
    let err = r
        .record_sample(
            &stack(),
            &cpu(1),
            &[Label::str(LOCAL_ROOT_SPAN_ID_LABEL, "100")],
            0,
        )
        .unwrap_err();
    assert!(err.to_string().contains("\"100\""), "{err}");
    let p = r.serialize(None).unwrap();
    assert_eq!(p.encoded.endpoint_counts, vec![("GET /orders".into(), 1)]);
    let d = decode(&p);
    let mut got: Vec<(i64, Option<&str>)> = d
        .sample
        .iter()
        .map(|s| {
            (
                d.label_num(s, LOCAL_ROOT_SPAN_ID_LABEL).unwrap(),
                d.label_str(s, TRACE_ENDPOINT_LABEL),
            )
        })
        .collect();
    got.sort();
    assert_eq!(
        got,
        vec![
            (100, Some("GET /orders")),
            (100, Some("GET /orders")),
            (200, None)
        ]
    );
    // The endpoint belonged to that profile only.
    r.record_sample(&stack(), &cpu(1), &span(100), 0).unwrap();
    let d = decode(&r.serialize(None).unwrap());
    assert_eq!(d.label_str(&d.sample[0], TRACE_ENDPOINT_LABEL), None);
}

#[test]
fn timeline_samples_are_kept_separate() {
    let r = StackRecorder::new(no_heap()).unwrap();
    let v = SampleValues {
        timeline_wall_time_ns: 10,
        ..cpu(1)
    };
    let t = nanos(SystemTime::now());
    for i in 0..3 {
        r.record_sample(&stack(), &v, &[], t + i).unwrap();
    }
    r.record_sample(&stack(), &v, &[], 0).unwrap();
    r.record_sample(&stack(), &v, &[], 0).unwrap();
    let d = decode(&r.serialize(None).unwrap());
    assert_eq!(d.sample.len(), 4);
    let mut ts: Vec<Option<i64>> = d
        .sample
        .iter()
        .map(|s| d.label_num(s, END_TIMESTAMP_LABEL))
        .collect();
    ts.sort();
    assert_eq!(ts, vec![None, Some(t), Some(t + 1), Some(t + 2)]);
    let aggregated = d
        .sample
        .iter()
        .find(|s| d.label_num(s, END_TIMESTAMP_LABEL).is_none())
        .unwrap();
    assert_eq!(aggregated.value[d.value_index("timeline").unwrap()], 20);
    assert_eq!(d.total("timeline"), Some(50));
}

#[test]
fn time_nanos_and_duration_cover_the_profile() {
    let before = SystemTime::now();
    let r = StackRecorder::new(no_heap()).unwrap();
    r.record_sample(&stack(), &cpu(1), &[], 0).unwrap();
    let p = r.serialize(None).unwrap();
    let after = SystemTime::now();
    assert!(before <= p.start && p.start <= p.finish && p.finish <= after);
    let d = decode(&p);
    assert_eq!(d.time_nanos, nanos(p.start));
    assert_eq!(d.duration_nanos, nanos(p.finish) - nanos(p.start));
    assert_eq!(p.encoded.start, p.start);
    assert_eq!(p.encoded.end, p.finish);
}

#[test]
fn four_consecutive_serializations_tile_time() {
    let r = StackRecorder::new(no_heap()).unwrap();
    let mut profiles = Vec::new();
    for i in 0..4 {
        r.record_sample(&stack(), &cpu(i + 1), &[], 0).unwrap();
        profiles.push(r.serialize(None).unwrap());
    }
    for w in profiles.windows(2) {
        assert_eq!(w[1].start, w[0].finish);
        let (a, b) = (decode(&w[0]), decode(&w[1]));
        assert_eq!(b.time_nanos, a.time_nanos + a.duration_nanos);
    }
    let totals: Vec<i64> = profiles
        .iter()
        .map(|p| decode(p).total("cpu-samples").unwrap())
        .collect();
    assert_eq!(totals, vec![1, 2, 3, 4]);
    let life = r.stats().lifetime;
    assert_eq!(life.serialization_successes, 4);
    assert_eq!(life.serialization_failures, 0);
    let (min, max, total) = (
        life.serialization_time_ns_min.unwrap(),
        life.serialization_time_ns_max.unwrap(),
        life.serialization_time_ns_total.unwrap(),
    );
    assert!(min <= max && max <= total);
    assert!((life.serialization_time_ns_avg.unwrap() - total as f64 / 4.0).abs() < 1.0);
    assert_eq!(
        profiles
            .iter()
            .map(|p| p.stats.recorded_samples)
            .collect::<Vec<_>>(),
        vec![1, 1, 1, 1]
    );
}

#[test]
fn slots_flip_on_serialize_and_reset_after_fork() {
    let r = StackRecorder::new(no_heap()).unwrap();
    assert_eq!(r.active_slot(), 1);
    assert!(!r.is_slot_locked(1) && r.is_slot_locked(2));
    r.serialize(None).unwrap();
    assert_eq!(r.active_slot(), 2);
    assert!(r.is_slot_locked(1) && !r.is_slot_locked(2));
    r.record_sample(&stack(), &cpu(7), &[], 0).unwrap();
    r.serialize(None).unwrap();
    assert_eq!(r.active_slot(), 1);
    r.serialize(None).unwrap();
    assert_eq!(r.active_slot(), 2);
    r.record_sample(&stack(), &cpu(5), &[], 0).unwrap();

    let before_reset = SystemTime::now();
    r.reset_after_fork();
    assert_eq!(r.active_slot(), 1);
    assert!(!r.is_slot_locked(1) && r.is_slot_locked(2));
    // Both profiles are empty: the sample of the parent is gone.
    let p = r.serialize(None).unwrap();
    assert!(p.start >= before_reset);
    assert!(decode(&p).sample.is_empty());
    assert_eq!(p.stats.recorded_samples, 0);
    assert!(decode(&r.serialize(None).unwrap()).sample.is_empty());
}

#[test]
fn fork_reset_releases_a_slot_held_by_a_vanished_sampler() {
    let r = StackRecorder::new(no_heap()).unwrap();
    let held = r.hold_slot_for_testing(1).unwrap();
    // As in a forked child: the holder will never release it.
    std::mem::forget(held);
    r.reset_after_fork();
    r.record_sample(&stack(), &cpu(1), &[], 0).unwrap();
    assert_eq!(
        decode(&r.serialize(None).unwrap()).total("cpu-samples"),
        Some(1)
    );
}

/// Blocks the serializer inside encoding (while it owns the old slot) until told to go on.
struct BlockingSymbolizer {
    entered: mpsc::Sender<()>,
    release: mpsc::Receiver<()>,
}

impl Symbolizer for BlockingSymbolizer {
    fn symbolize(&mut self, _address: u64, out: &mut Vec<ResolvedFrame>) {
        let _ = self.entered.send(());
        let _ = self.release.recv();
        out.push(ResolvedFrame {
            name: "symbolized".into(),
            filename: "s.rs".into(),
            line: 1,
            ..Default::default()
        });
    }
}

/// Answers every address with one frame, and counts the addresses `prepare` was asked for.
struct CountingSymbolizer {
    prepared: std::rc::Rc<std::cell::Cell<usize>>,
}

impl Symbolizer for CountingSymbolizer {
    fn prepare(&mut self, addresses: &[u64]) {
        self.prepared.set(self.prepared.get() + addresses.len());
    }
    fn symbolize(&mut self, address: u64, out: &mut Vec<ResolvedFrame>) {
        out.push(ResolvedFrame {
            name: format!("fn_{address:x}"),
            filename: "s.rs".into(),
            line: 1,
            ..Default::default()
        });
    }
}

struct Ungated;

impl ferroprof_recorder::SharedStateGate for Ungated {
    fn enter(&self) {}
    fn leave(&self) {}
}

#[test]
fn late_samples_are_added_after_symbolizing_and_before_encoding() {
    let r = StackRecorder::new(no_heap()).unwrap();
    let values = SampleValues {
        cpu_time_ns: 5_000,
        cpu_or_wall_samples: 1,
        ..Default::default()
    };
    r.record_sample(&[Frame::Address(0x1234)], &values, &[], 0)
        .unwrap();
    let prepared = std::rc::Rc::new(std::cell::Cell::new(0));
    let mut sym = CountingSymbolizer {
        prepared: prepared.clone(),
    };
    let mut seen_prepared = None;
    let mut late = |s: &mut ferroprof_recorder::LateSamples<'_>| {
        seen_prepared = Some(prepared.get());
        let own = SampleValues {
            cpu_time_ns: 7_000,
            ..Default::default()
        };
        s.add(
            &[Frame::sym("[late]", "", 0)],
            &own,
            &[Label::str("thread name", "late")],
        )
        .unwrap();
    };
    let p = r
        .serialize_with_late(Some(&mut sym), &Ungated, Some(&mut late))
        .unwrap();
    assert_eq!(
        seen_prepared,
        Some(1),
        "the address was prepared before `late`"
    );
    assert_eq!(p.stats.recorded_samples, 2);
    let d = decode(&p);
    let cpu = d.value_index("cpu-time").unwrap();
    let mut got: Vec<(Vec<String>, i64, Option<String>)> = d
        .sample
        .iter()
        .map(|s| {
            (
                d.stack_names(s),
                s.value[cpu],
                d.label_str(s, "thread name").map(str::to_owned),
            )
        })
        .collect();
    got.sort();
    assert_eq!(
        got,
        vec![
            (vec!["[late]".to_owned()], 7_000, Some("late".to_owned())),
            (vec!["fn_1234".to_owned()], 5_000, None),
        ]
    );
    // The next profile starts empty: the late sample was this one's only.
    let next = decode(&r.serialize(None).unwrap());
    assert!(next.sample.is_empty());
}

#[test]
fn sampler_completes_while_a_serialization_holds_a_slot() {
    let r = Arc::new(StackRecorder::new(no_heap()).unwrap());
    r.record_sample(&[Frame::Address(0x1234)], &cpu(1), &[], 0)
        .unwrap();
    let (entered_tx, entered_rx) = mpsc::channel();
    let (release_tx, release_rx) = mpsc::channel();
    let r2 = r.clone();
    let serializer = std::thread::spawn(move || {
        let mut sym = BlockingSymbolizer {
            entered: entered_tx,
            release: release_rx,
        };
        r2.serialize(Some(&mut sym))
    });
    entered_rx.recv().unwrap();
    // The serializer is mid-encoding with slot 1; the sampler goes to slot 2 without waiting
    // (this call returning at all, before the release below, is the check).
    assert!(r.is_slot_locked(1));
    assert_eq!(r.active_slot(), 2);
    r.record_sample(&stack(), &cpu(10), &[], 0).unwrap();
    r.record_endpoint(1, "/x").unwrap();
    release_tx.send(()).unwrap();
    let first = serializer.join().unwrap().unwrap();
    let d = decode(&first);
    assert_eq!(d.total("cpu-samples"), Some(1));
    assert_eq!(d.stack_names(&d.sample[0]), vec!["symbolized"]);
    let second = decode(&r.serialize(None).unwrap());
    assert_eq!(second.total("cpu-samples"), Some(10));
}

#[test]
fn serializer_waits_for_a_sampler_inside_the_slot_it_closes() {
    let r = Arc::new(StackRecorder::new(no_heap()).unwrap());
    r.record_sample(&stack(), &cpu(3), &[], 0).unwrap();
    let held = r.hold_slot_for_testing(1).unwrap();
    let r2 = r.clone();
    let serializer = std::thread::spawn(move || r2.serialize(None));
    while !r.is_slot_locked(1) {
        std::thread::yield_now();
    }
    // Slot 1 is closed to newcomers but its sampler is still inside: the serializer waits,
    // and meanwhile other samplers use slot 2.
    assert!(!serializer.is_finished());
    r.record_sample(&stack(), &cpu(100), &[], 0).unwrap();
    assert!(!serializer.is_finished());
    drop(held);
    let first = serializer.join().unwrap().unwrap();
    assert_eq!(decode(&first).total("cpu-samples"), Some(3));
    assert_eq!(
        decode(&r.serialize(None).unwrap()).total("cpu-samples"),
        Some(100)
    );
}

#[test]
fn two_samplers_and_a_serializer_lose_no_sample() {
    const SERIALIZATIONS: usize = 1000;
    let r = Arc::new(
        StackRecorder::new(RecorderConfig {
            compression: Compression::None,
            ..no_heap()
        })
        .unwrap(),
    );
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let started = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let samplers: Vec<_> = (0..2)
        .map(|t| {
            let r = r.clone();
            let stop = stop.clone();
            let started = started.clone();
            std::thread::spawn(move || {
                let names = ["a", "b", "c"];
                let (mut recorded, mut dropped, mut i) = (0i64, 0u64, 0i64);
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    i += 1;
                    let frames = [
                        Frame::sym(names[(i % 3) as usize], "f.rs", t),
                        Frame::sym("main", "m.rs", 1),
                    ];
                    let labels = [Label::num("thread id", t)];
                    // Some timestamped samples, not so many that encoding them dominates.
                    let ts = if i % 101 == 0 { i } else { 0 };
                    let v = SampleValues {
                        cpu_or_wall_samples: 1,
                        wall_time_ns: i % 1000,
                        ..Default::default()
                    };
                    match r.record_sample(&frames, &v, &labels, ts) {
                        Ok(()) => {
                            recorded += i % 1000;
                            if i == 1 {
                                started.fetch_add(1, std::sync::atomic::Ordering::Release);
                            }
                        }
                        Err(RecorderError::NoActiveSlot { .. }) => dropped += 1,
                        Err(e) => panic!("{e}"),
                    }
                }
                (recorded, dropped)
            })
        })
        .collect();
    // Both samplers are recording before the serializations start.
    while started.load(std::sync::atomic::Ordering::Acquire) < 2 {
        std::thread::yield_now();
    }
    let mut seen = 0i64;
    let mut samples = 0u64;
    let mut nonempty = 0;
    for _ in 0..SERIALIZATIONS {
        let p = r.serialize(None).unwrap();
        samples += p.stats.recorded_samples;
        nonempty += usize::from(p.stats.recorded_samples > 0);
        seen += decode(&p).total("wall-time").unwrap_or(0);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut recorded = 0;
    let mut dropped = 0;
    for s in samplers {
        let (r, d) = s.join().unwrap();
        recorded += r;
        dropped += d;
    }
    let last = r.serialize(None).unwrap();
    samples += last.stats.recorded_samples;
    seen += decode(&last).total("wall-time").unwrap_or(0);
    assert_eq!(seen, recorded, "dropped (with an error) {dropped}");
    assert!(
        nonempty >= 1,
        "the first profile holds the samples recorded before it"
    );
    eprintln!("{samples} samples in {nonempty} non-empty profiles, {dropped} dropped");
    assert_eq!(
        r.stats().lifetime.serialization_successes,
        SERIALIZATIONS as u64 + 1
    );
}

#[test]
fn native_heap_samples_are_added_at_serialization() {
    let r = StackRecorder::new(config(SampleTypeConfig::all())).unwrap();
    assert!(r.heap().is_some());
    let frames = [
        Frame::sym("alloc_site", "alloc.rs", 3),
        Frame::sym("main", "main.rs", 1),
    ];
    r.track_allocation(1, 4, 100, Some("Vec<u8>"), &frames)
        .unwrap();
    r.track_allocation(2, 1, 10, None, &frames).unwrap();
    r.track_allocation(3, 1, 50, Some("String"), &frames)
        .unwrap();
    assert!(r.untrack_allocation(3));
    assert!(!r.untrack_allocation(3));
    r.record_sample(&stack(), &cpu(1), &[], 0).unwrap();
    let p = r.serialize(None).unwrap();
    assert_eq!(
        p.stats.recorded_samples, 3,
        "one cpu sample + two live objects"
    );
    let d = decode(&p);
    assert_eq!(d.total("heap-live-samples"), Some(5));
    assert_eq!(d.total("heap-live-size"), Some(410));
    let heap: Vec<_> = d
        .sample
        .iter()
        .filter(|s| s.value[d.value_index("heap-live-samples").unwrap()] > 0)
        .collect();
    assert_eq!(heap.len(), 2);
    for s in heap {
        assert_eq!(d.stack_names(s), vec!["alloc_site", "main"]);
        assert!(d.label_num(s, GC_GEN_AGE_LABEL).is_some());
        let class = d.label_str(s, ALLOCATION_CLASS_LABEL);
        let weight = s.value[d.value_index("heap-live-samples").unwrap()];
        assert_eq!(class, if weight == 4 { Some("Vec<u8>") } else { None });
    }
    // Still alive: reported again, one serialization older.
    let d = decode(&r.serialize(None).unwrap());
    assert_eq!(d.total("heap-live-samples"), Some(5));
    assert!(r.stats().heap.is_some());
    assert!(r.untrack_allocation(1) && r.untrack_allocation(2));
    let d = decode(&r.serialize(None).unwrap());
    assert_eq!(d.total("heap-live-samples"), Some(0));
}

#[test]
fn heap_size_only_configuration() {
    let r = StackRecorder::new(config(SampleTypeConfig {
        heap_samples: false,
        ..SampleTypeConfig::all()
    }))
    .unwrap();
    r.track_allocation(1, 2, 64, None, &stack()).unwrap();
    let d = decode(&r.serialize(None).unwrap());
    assert_eq!(d.value_index("heap-live-samples"), None);
    assert_eq!(d.total("heap-live-size"), Some(128));
}

#[test]
fn managed_heap_recording_ends_with_the_allocation_sample() {
    let r = StackRecorder::new(config(SampleTypeConfig::all())).unwrap();
    r.track_object(42, 1, Some("Foo")).unwrap();
    let v = SampleValues {
        alloc_samples: 1,
        heap_sample: true,
        ..Default::default()
    };
    r.record_sample(&stack(), &v, &[], 0).unwrap();
    assert!(r.heap().unwrap().is_object_recorded(42));
    // Ending a recording that never started: the error comes back and the slot is released.
    let err = r.record_sample(&stack(), &v, &[], 0).unwrap_err();
    assert!(matches!(err, RecorderError::Heap(_)), "{err}");
    r.record_sample(&stack(), &cpu(1), &[], 0).unwrap();
    let p = r.serialize(None).unwrap();
    assert_eq!(decode(&p).total("alloc-samples"), Some(1));
}

#[test]
fn serialization_failure_is_counted_and_the_recorder_keeps_working() {
    let r = StackRecorder::new(config(SampleTypeConfig::all())).unwrap();
    // A leftover iteration makes the next prepare fail.
    r.heap().unwrap().prepare_iteration().unwrap();
    r.record_sample(&stack(), &cpu(1), &[], 0).unwrap();
    assert!(r.serialize(None).is_err());
    let life = r.stats().lifetime;
    assert_eq!(life.serialization_failures, 1);
    assert_eq!(life.serialization_successes, 0);
    // The failed serialization failed before the slots flipped: the active profile keeps its
    // sample, and the iteration its holder prepared stays the holder's to finish.
    r.record_sample(&stack(), &cpu(2), &[], 0).unwrap();
    assert!(
        r.serialize(None).is_err(),
        "the holder's iteration is still open"
    );
    r.heap().unwrap().finish_iteration().unwrap();
    let p = r.serialize(None).unwrap();
    assert_eq!(decode(&p).total("cpu-samples"), Some(3));
    assert_eq!(r.stats().lifetime.serialization_successes, 1);
}

#[test]
fn memory_of_strings_stays_flat_over_many_profiles() {
    let r = StackRecorder::new(config(SampleTypeConfig::all())).unwrap();
    for round in 0..200u64 {
        let name = format!("fn_{round}");
        let frames = [Frame::sym(&name, "f.rs", 1)];
        r.track_allocation(round, 1, 8, Some(&name), &frames)
            .unwrap();
        r.record_sample(&frames, &cpu(1), &[], 0).unwrap();
        r.serialize(None).unwrap();
        assert!(r.untrack_allocation(round));
    }
    r.serialize(None).unwrap();
    assert_eq!(r.strings().len(), 0);
}

#[test]
fn zstd_output_decodes_like_gzip() {
    // Tests build with the `zstd` feature (the crate dev-depends on itself with it).
    let make = |compression| {
        let r = StackRecorder::new(RecorderConfig {
            compression,
            ..no_heap()
        })
        .unwrap();
        r.record_sample(&stack(), &cpu(3), &[Label::str("k", "v")], 0)
            .unwrap();
        r.record_sample(&stack(), &cpu(1), &[Label::str("k", "v")], 42)
            .unwrap();
        r.serialize(None).unwrap().encoded
    };
    let z = make(Compression::Zstd);
    let g = make(Compression::Gzip);
    assert_eq!(z.compression, Compression::Zstd);
    assert_eq!(&z.bytes[..4], &[0x28, 0xb5, 0x2f, 0xfd]);
    assert_eq!(&g.bytes[..2], &[0x1f, 0x8b]);
    let (dz, dg) = (
        ferroprof_pprof::decode(&z.bytes).unwrap(),
        ferroprof_pprof::decode(&g.bytes).unwrap(),
    );
    assert_eq!(dz.sample, dg.sample);
    assert_eq!(dz.string_table, dg.string_table);
    assert_eq!(dz.total("cpu-samples"), Some(4));
}

/// A decoded profile as a sorted list of (frames as (address, function, line), values, labels
/// as (key, string, number)), independent of row and location order.
type Canonical = Vec<(
    Vec<(u64, String, i64)>,
    Vec<i64>,
    Vec<(String, String, i64)>,
)>;

fn canonical(d: &ferroprof_pprof::Profile) -> Canonical {
    use std::collections::HashMap;
    let funcs: HashMap<u64, String> = d
        .function
        .iter()
        .map(|f| (f.id, d.str(f.name).to_owned()))
        .collect();
    let locs: HashMap<u64, Vec<(u64, String, i64)>> = d
        .location
        .iter()
        .map(|l| {
            let lines = l.line.iter().map(|line| {
                let name = funcs.get(&line.function_id).cloned().unwrap_or_default();
                (l.address, name, line.line)
            });
            let mut lines: Vec<_> = lines.collect();
            if lines.is_empty() {
                lines.push((l.address, String::new(), 0));
            }
            (l.id, lines)
        })
        .collect();
    let mut out: Canonical = d
        .sample
        .iter()
        .map(|s| {
            let frames = s
                .location_id
                .iter()
                .flat_map(|id| locs.get(id).cloned().expect("sample names a location"))
                .collect();
            let mut labels: Vec<_> = s
                .label
                .iter()
                .map(|l| (d.str(l.key).to_owned(), d.str(l.str).to_owned(), l.num))
                .collect();
            labels.sort();
            (frames, s.value.clone(), labels)
        })
        .collect();
    out.sort();
    out
}

#[test]
fn heap_samples_equal_one_add_per_live_object() {
    use ferroprof_recorder::{Profile, Sample};
    let r = StackRecorder::new(config(SampleTypeConfig::all())).unwrap();
    // Address-only stacks: distinct innermost frames over shared callers, some shared by several
    // objects, some recursive (an address twice), many more addresses than the address cache
    // holds; plus stacks mixing symbol and address frames.
    let stack_of = |i: u64| -> Vec<Frame<'static>> {
        let mut f = vec![Frame::Address(0x7000 + (i % 3000) * 16)];
        if i % 7 == 0 {
            f.push(Frame::Address(0x7000 + (i % 3000) * 16));
        }
        if i % 5 == 0 {
            f.push(Frame::sym("alloc_site", "alloc.rs", (i % 4) as i64));
        }
        f.extend((0..(i % 20)).map(|d| Frame::Address(0x10_0000 + d * 0x40)));
        f
    };
    let class = |i: u64| match i % 4 {
        0 => None,
        1 => Some("Vec<u8>"),
        _ => Some("String"),
    };
    let objects: Vec<u64> = (0..6000).collect();
    for &i in &objects {
        let (weight, size) = (1 + (i % 3) as u32, 8 + i % 100);
        r.track_allocation(0x1_0000 + i * 64, weight, size, class(i), &stack_of(i))
            .unwrap();
    }
    for round in 0..3i64 {
        // CPU samples over some of the same addresses.
        for i in 0..50 {
            r.record_sample(&stack_of(i), &cpu(1 + i as i64), &[], 0)
                .unwrap();
        }
        let start = SystemTime::now();
        let d = decode(&r.serialize(None).unwrap());
        let got = canonical(&d);
        // Each address is one location, however many stacks share it.
        let mut addresses: Vec<u64> = d
            .location
            .iter()
            .filter(|l| l.line.is_empty())
            .map(|l| l.address)
            .collect();
        let n = addresses.len();
        addresses.sort();
        addresses.dedup();
        assert_eq!(
            addresses.len(),
            n,
            "round {round}: an address is two locations"
        );

        let layout = r.layout();
        let mut want = Profile::new(layout.types(), None, start);
        for i in 0..50 {
            let placed = layout.place(&cpu(1 + i as i64));
            want.add(&Sample {
                frames: &stack_of(i),
                values: &placed[..layout.len()],
                labels: &[],
                end_timestamp_ns: 0,
            })
            .unwrap();
        }
        for &i in objects.iter().filter(|&&i| round == 0 || i % 2 == 0) {
            let (weight, size) = (1 + (i % 3) as i64, 8 + (i % 100) as i64);
            let placed = layout.place(&SampleValues {
                heap_live_samples: weight,
                heap_live_size: size * weight,
                ..Default::default()
            });
            let mut labels = vec![Label::num(GC_GEN_AGE_LABEL, round)];
            if let Some(c) = class(i) {
                labels.push(Label::str(ALLOCATION_CLASS_LABEL, c));
            }
            want.add(&Sample {
                frames: &stack_of(i),
                values: &placed[..layout.len()],
                labels: &labels,
                end_timestamp_ns: 0,
            })
            .unwrap();
        }
        let encoded = want
            .encode(SystemTime::now(), &Default::default(), None)
            .unwrap();
        let want = canonical(&ferroprof_pprof::decode(&encoded.bytes).unwrap());
        assert_eq!(got.len(), want.len(), "round {round}");
        assert!(got == want, "round {round}: profiles differ");
        if round == 0 {
            // Fewer objects next time, so the next profile is built in reused buffers.
            for &i in objects.iter().filter(|&&i| i % 2 == 1) {
                assert!(r.untrack_allocation(0x1_0000 + i * 64));
            }
        }
    }
}
