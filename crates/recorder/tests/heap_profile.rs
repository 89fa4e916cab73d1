//! Heap profiling through the stack recorder, checked on the decoded pprof (independent reader).
//!
//! The managed heap here is made of real Rust objects: an id is alive while an `Arc` to its
//! object exists (the liveness source holds `Weak`s), and a "collection" advances the generation.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use ferroprof_recorder::heap::{LivenessSource, ObjectInfo, MAX_PENDING_RECORDINGS};
use ferroprof_recorder::stack_recorder::{ALLOCATION_CLASS_LABEL, GC_GEN_AGE_LABEL};
use ferroprof_recorder::{
    Frame, HeapConfig, HeapError, RecorderConfig, RecorderError, SampleTypeConfig, SampleValues,
    StackRecorder,
};

#[derive(Default)]
struct ArcHeap {
    gen: AtomicU64,
    next_id: AtomicU64,
    objects: Mutex<HashMap<u64, Weak<Obj>>>,
    deferred: bool,
    handles: Mutex<HashMap<u64, u64>>,
}

struct Obj {
    size: AtomicU64,
    frozen: AtomicBool,
}

impl ArcHeap {
    fn new_object(&self, size: u64) -> (u64, Arc<Obj>) {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let obj = Arc::new(Obj {
            size: AtomicU64::new(size),
            frozen: AtomicBool::new(false),
        });
        self.objects
            .lock()
            .unwrap()
            .insert(id, Arc::downgrade(&obj));
        (id, obj)
    }

    fn gc(&self) {
        self.gen.fetch_add(1, Ordering::Relaxed);
    }
}

impl LivenessSource for ArcHeap {
    fn gc_generation(&self) -> u64 {
        self.gen.load(Ordering::Relaxed)
    }

    fn lookup(&self, id: u64) -> Option<ObjectInfo> {
        let obj = self.objects.lock().unwrap().get(&id)?.upgrade()?;
        Some(ObjectInfo {
            size: obj.size.load(Ordering::Relaxed),
            frozen: obj.frozen.load(Ordering::Relaxed),
        })
    }

    fn defers_ids(&self) -> bool {
        self.deferred
    }

    fn resolve_handle(&self, handle: u64) -> Option<u64> {
        self.handles.lock().unwrap().get(&handle).copied()
    }
}

fn managed_recorder(heap: &Arc<ArcHeap>, tweak: impl FnOnce(&mut HeapConfig)) -> StackRecorder {
    let src: Arc<dyn LivenessSource> = heap.clone();
    let mut cfg = HeapConfig::managed(src);
    tweak(&mut cfg);
    StackRecorder::new(RecorderConfig {
        sample_types: SampleTypeConfig::all(),
        heap: cfg,
        ..RecorderConfig::default()
    })
    .unwrap()
}

fn site(name: &str) -> [Frame<'_>; 2] {
    [
        Frame::sym(name, "app.rb", 10),
        Frame::sym("main", "app.rb", 1),
    ]
}

/// Reports one allocation the managed way: start the heap recording, then the allocation
/// sample that ends it.
fn allocate(
    r: &StackRecorder,
    heap: &ArcHeap,
    size: u64,
    weight: u32,
    class: &str,
    at: &str,
) -> Arc<Obj> {
    let (id, obj) = heap.new_object(size);
    r.track_object(id, weight, Some(class)).unwrap();
    let values = SampleValues {
        alloc_samples: i64::from(weight),
        alloc_samples_unscaled: 1,
        heap_sample: true,
        ..SampleValues::default()
    };
    r.record_sample(&site(at), &values, &[], 0).unwrap();
    obj
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct HeapSample {
    stack: Vec<String>,
    class: Option<String>,
    age: i64,
    count: i64,
    size: i64,
}

fn heap_samples(r: &StackRecorder) -> (Vec<HeapSample>, u64) {
    let ser = r.serialize(None).unwrap();
    let p = ferroprof_pprof::decode(&ser.encoded.bytes).unwrap();
    let count_i = p.value_index("heap-live-samples").unwrap();
    let size_i = p.value_index("heap-live-size").unwrap();
    let mut out: Vec<HeapSample> = p
        .sample
        .iter()
        .filter(|s| s.value[count_i] != 0)
        .map(|s| HeapSample {
            stack: p.stack_names(s),
            class: p.label_str(s, ALLOCATION_CLASS_LABEL).map(str::to_owned),
            age: p.label_num(s, GC_GEN_AGE_LABEL).unwrap(),
            count: s.value[count_i],
            size: s.value[size_i],
        })
        .collect();
    out.sort();
    (out, ser.stats.recorded_samples)
}

fn hs(at: &str, class: &str, age: i64, count: i64, size: i64) -> HeapSample {
    HeapSample {
        stack: vec![at.to_owned(), "main".to_owned()],
        class: Some(class.to_owned()),
        age,
        count,
        size,
    }
}

#[test]
fn live_objects_show_with_class_weight_and_size() {
    let heap = Arc::new(ArcHeap::default());
    let r = managed_recorder(&heap, |_| {});
    let strings: Vec<_> = (0..3)
        .map(|_| allocate(&r, &heap, 40, 5, "String", "make_strings"))
        .collect();
    let arrays: Vec<_> = (0..2)
        .map(|_| allocate(&r, &heap, 100, 7, "Array", "make_arrays"))
        .collect();
    let dead = allocate(&r, &heap, 64, 3, "Dead", "make_garbage");
    drop(dead);
    heap.gc();

    let (samples, recorded) = heap_samples(&r);
    assert_eq!(
        samples,
        vec![
            hs("make_arrays", "Array", 1, 14, 1400),
            hs("make_strings", "String", 1, 15, 600),
        ]
    );
    // 6 allocation samples + 5 heap samples (one per live object, before aggregation).
    assert_eq!(recorded, 11);
    let st = r.stats().heap.unwrap();
    assert_eq!(st.num_object_records, 5);
    assert_eq!(st.last_update_objects_dead, 1);

    // The heap profile is a fresh snapshot every time: still live, shown again (one generation
    // older); the strings die and vanish after the next serialization.
    heap.gc();
    drop(strings);
    let (samples, recorded) = heap_samples(&r);
    assert_eq!(samples, vec![hs("make_arrays", "Array", 2, 14, 1400)]);
    assert_eq!(recorded, 2);
    drop(arrays);
}

#[test]
fn sizes_are_remeasured_unless_frozen() {
    let heap = Arc::new(ArcHeap::default());
    let r = managed_recorder(&heap, |_| {});
    let growing = allocate(&r, &heap, 10, 1, "Buffer", "grow");
    let frozen = allocate(&r, &heap, 10, 1, "Frozen", "freeze");
    frozen.frozen.store(true, Ordering::Relaxed);
    heap.gc();
    heap_samples(&r);
    growing.size.store(500, Ordering::Relaxed);
    frozen.size.store(500, Ordering::Relaxed);
    heap.gc();
    let (samples, _) = heap_samples(&r);
    assert_eq!(
        samples,
        vec![
            hs("freeze", "Frozen", 2, 1, 10),
            hs("grow", "Buffer", 2, 1, 500),
        ]
    );
    assert_eq!(r.stats().heap.unwrap().last_update_objects_frozen, 1);
}

#[test]
fn objects_of_age_zero_are_left_out() {
    let heap = Arc::new(ArcHeap::default());
    let r = managed_recorder(&heap, |_| {});
    let _obj = allocate(&r, &heap, 8, 1, "Young", "young");
    let (samples, recorded) = heap_samples(&r);
    assert!(samples.is_empty(), "{samples:?}");
    assert_eq!(recorded, 1, "only the allocation sample");
    heap.gc();
    let (samples, _) = heap_samples(&r);
    assert_eq!(samples, vec![hs("young", "Young", 1, 1, 8)]);
}

#[test]
fn objects_allocated_during_a_slow_serialization_appear_in_the_next_profile() {
    let heap = Arc::new(ArcHeap::default());
    let r = managed_recorder(&heap, |_| {});
    let before = allocate(&r, &heap, 8, 1, "Before", "before");
    heap.gc();
    // A serialization holding its snapshot for a long time.
    r.heap().unwrap().prepare_iteration().unwrap();
    let during: Vec<_> = (0..20)
        .map(|_| allocate(&r, &heap, 16, 1, "During", "during"))
        .collect();
    heap.gc();
    r.heap().unwrap().finish_iteration().unwrap();
    let (samples, _) = heap_samples(&r);
    assert_eq!(
        samples,
        vec![
            hs("before", "Before", 2, 1, 8),
            hs("during", "During", 1, 20, 320),
        ]
    );
    drop((before, during));
}

#[test]
fn sample_every_two_keeps_every_second_object_with_doubled_weight() {
    let heap = Arc::new(ArcHeap::default());
    let r = managed_recorder(&heap, |c| c.sample_every = 2);
    let objs: Vec<_> = (0..10)
        .map(|_| allocate(&r, &heap, 24, 1, "Item", "items"))
        .collect();
    assert_eq!(r.stats().heap.unwrap().num_object_records, 5);
    heap.gc();
    let (samples, _) = heap_samples(&r);
    assert_eq!(samples, vec![hs("items", "Item", 1, 10, 240)]);
    drop(objs);
}

#[test]
fn sample_every_zero_is_a_clear_error() {
    let heap = Arc::new(ArcHeap::default());
    let src: Arc<dyn LivenessSource> = heap.clone();
    let err = StackRecorder::new(RecorderConfig {
        heap: HeapConfig {
            sample_every: 0,
            ..HeapConfig::managed(src)
        },
        ..RecorderConfig::default()
    })
    .err()
    .unwrap();
    assert_eq!(err, RecorderError::Heap(HeapError::InvalidSampleEvery(0)));
    assert!(err.to_string().contains("positive"), "{err}");
}

#[test]
fn young_cleanup_removes_only_young_dead_objects() {
    let heap = Arc::new(ArcHeap::default());
    let r = managed_recorder(&heap, |c| c.clean_after_gc = true);
    let hr = r.heap().unwrap();
    let mut old: Vec<Option<Arc<Obj>>> = (0..4)
        .map(|_| Some(allocate(&r, &heap, 8, 1, "Old", "old")))
        .collect();
    heap.gc();
    heap.gc();
    heap.gc();
    let mut young: Vec<Option<Arc<Obj>>> = (0..4)
        .map(|_| Some(allocate(&r, &heap, 8, 1, "Young", "young")))
        .collect();
    heap.gc();
    // Old objects are 4 generations old, young ones 1.
    old[0] = None;
    old[1] = None;
    young[0] = None;
    young[1] = None;
    r.after_gc_step();
    let st = r.stats().heap.unwrap();
    assert_eq!(st.lifetime_updates_successful, 1);
    assert_eq!(st.last_update_objects_dead, 2, "only the young dead ones");
    assert_eq!(st.last_update_objects_alive, 2);
    assert_eq!(st.last_update_objects_skipped, 4, "old objects are skipped");
    assert_eq!(st.num_object_records, 6);

    // Another collection within 2 s: skipped.
    young[2] = None;
    heap.gc();
    r.after_gc_step();
    let st = r.stats().heap.unwrap();
    assert_eq!(st.lifetime_updates_skipped_time, 1);
    assert_eq!(st.num_object_records, 6);
    // Once the 2 s are over (forgotten here), the next collection's update runs.
    hr.reset_last_update();
    r.after_gc_step();
    let st = r.stats().heap.unwrap();
    assert_eq!(st.lifetime_updates_successful, 2);
    assert_eq!(st.num_object_records, 5);
    // No collection since the last update: skipped.
    hr.reset_last_update();
    r.after_gc_step();
    assert_eq!(r.stats().heap.unwrap().lifetime_updates_skipped_gcgen, 1);

    // Not while an iteration snapshot exists.
    young[3] = None;
    hr.reset_last_update();
    hr.prepare_iteration().unwrap();
    heap.gc();
    let successful = r.stats().heap.unwrap().lifetime_updates_successful;
    r.after_gc_step();
    assert_eq!(
        r.stats().heap.unwrap().lifetime_updates_successful,
        successful
    );
    hr.finish_iteration().unwrap();

    // Serialization cleans everything, old objects included.
    let (samples, _) = heap_samples(&r);
    assert_eq!(samples, vec![hs("old", "Old", 6, 2, 16)]);
    assert_eq!(r.stats().heap.unwrap().num_object_records, 2);
}

#[test]
fn without_clean_after_gc_only_serialization_cleans() {
    let heap = Arc::new(ArcHeap::default());
    let r = managed_recorder(&heap, |_| {});
    let objs: Vec<_> = (0..3)
        .map(|_| allocate(&r, &heap, 8, 1, "T", "t"))
        .collect();
    heap.gc();
    drop(objs);
    r.after_gc_step();
    let st = r.stats().heap.unwrap();
    assert_eq!(st.lifetime_updates_successful, 0);
    assert_eq!(st.num_object_records, 3);
    let (samples, _) = heap_samples(&r);
    assert!(samples.is_empty());
    assert_eq!(r.stats().heap.unwrap().num_object_records, 0);
}

#[test]
fn many_objects_share_one_heap_record() {
    let heap = Arc::new(ArcHeap::default());
    let r = managed_recorder(&heap, |_| {});
    let objs: Vec<_> = (0..1000)
        .map(|_| allocate(&r, &heap, 8, 1, "Same", "same"))
        .collect();
    let st = r.stats().heap.unwrap();
    assert_eq!(st.num_object_records, 1000);
    assert_eq!(st.num_heap_records, 1);
    drop(objs);
}

#[test]
fn string_storage_returns_to_its_initial_size() {
    let heap = Arc::new(ArcHeap::default());
    let r = managed_recorder(&heap, |_| {});
    r.serialize(None).unwrap();
    let initial = r.strings().len();
    let objs: Vec<_> = (0..50)
        .map(|i| {
            let class = format!("Class{}", i % 5);
            let at = format!("site_{}", i % 7);
            allocate(&r, &heap, 8, 1, &class, &at)
        })
        .collect();
    heap.gc();
    let (samples, _) = heap_samples(&r);
    assert_eq!(samples.iter().map(|s| s.count).sum::<i64>(), 50);
    assert!(r.strings().len() > initial);
    drop(objs);
    heap.gc();
    // Removes the dead records; the generation advance at its end frees their strings.
    let (samples, _) = heap_samples(&r);
    assert!(samples.is_empty());
    assert_eq!(r.strings().len(), initial);
}

#[test]
fn heap_recording_errors_leave_the_recorder_usable() {
    let heap = Arc::new(ArcHeap::default());
    let r = managed_recorder(&heap, |_| {});
    let values = SampleValues {
        alloc_samples: 1,
        heap_sample: true,
        ..SampleValues::default()
    };
    // End without start, while the sampler holds its slot.
    let err = r.record_sample(&site("x"), &values, &[], 0).unwrap_err();
    assert_eq!(
        err.to_string(),
        "heap recorder: Ended a heap recording that was not started"
    );
    // Start twice.
    r.track_object(1, 1, None).unwrap();
    assert_eq!(
        r.track_object(2, 1, None).unwrap_err(),
        RecorderError::Heap(HeapError::StartWithoutEnd)
    );
    // A failing end (too many frames) clears the recording.
    let deep = vec![Frame::sym("f", "f.rb", 1); 5000];
    assert!(r.record_sample(&deep, &values, &[], 0).is_err());
    // The slot was left (serialize would wait forever otherwise) and recording still works.
    assert!(!r.is_slot_locked(1));
    let obj = allocate(&r, &heap, 8, 1, "Ok", "ok");
    heap.gc();
    let (samples, _) = heap_samples(&r);
    assert_eq!(samples, vec![hs("ok", "Ok", 1, 1, 8)]);
    drop(obj);
}

#[test]
fn deferred_recordings_are_committed_when_finalized() {
    let heap = Arc::new(ArcHeap {
        deferred: true,
        ..ArcHeap::default()
    });
    let r = managed_recorder(&heap, |_| {});
    let values = SampleValues {
        alloc_samples: 1,
        heap_sample: true,
        ..SampleValues::default()
    };
    let mut objs = Vec::new();
    let mut asked = Vec::new();
    for handle in 0..(MAX_PENDING_RECORDINGS as u64 + 2) {
        asked.push(r.track_object(handle, 1, Some("Deferred")).unwrap());
        r.record_sample(&site("deferred"), &values, &[], 0).unwrap();
        let (id, obj) = heap.new_object(8);
        heap.handles.lock().unwrap().insert(handle, id);
        objs.push(obj);
    }
    assert!(asked[0] && !asked[1]);
    let st = r.stats().heap.unwrap();
    assert_eq!(st.pending_recordings_count, MAX_PENDING_RECORDINGS as u64);
    assert_eq!(st.lifetime_deferred_recordings_skipped_buffer_full, 2);
    r.heap().unwrap().finalize_pending_recordings().unwrap();
    let st = r.stats().heap.unwrap();
    assert_eq!(st.num_object_records, MAX_PENDING_RECORDINGS as u64);
    assert_eq!(
        st.lifetime_deferred_recordings_finalized,
        MAX_PENDING_RECORDINGS as u64
    );
    heap.gc();
    let (samples, _) = heap_samples(&r);
    assert_eq!(
        samples,
        vec![hs(
            "deferred",
            "Deferred",
            1,
            MAX_PENDING_RECORDINGS as i64,
            8 * MAX_PENDING_RECORDINGS as i64
        )]
    );
}

#[test]
fn heap_stats_are_exposed_only_when_enabled() {
    let r = StackRecorder::new(RecorderConfig {
        sample_types: SampleTypeConfig {
            heap_samples: false,
            heap_size: false,
            ..SampleTypeConfig::all()
        },
        ..RecorderConfig::default()
    })
    .unwrap();
    assert_eq!(r.stats().heap, None);
    let heap = Arc::new(ArcHeap::default());
    let r = managed_recorder(&heap, |_| {});
    assert_eq!(r.stats().heap.unwrap().num_object_records, 0);
}

#[test]
fn native_allocations_show_until_freed_with_serializations_survived_as_age() {
    let r = StackRecorder::new(RecorderConfig {
        heap: HeapConfig::native(),
        ..RecorderConfig::default()
    })
    .unwrap();
    let frames = [
        Frame::sym("alloc::vec::Vec::push", "vec.rs", 12),
        Frame::sym("app::load", "app.rs", 40),
    ];
    for id in 0..4u64 {
        r.track_allocation(0x1000 + id * 16, 3, 256, None, &frames)
            .unwrap();
    }
    let (samples, _) = heap_samples_native(&r);
    assert_eq!(samples, vec![(names(&frames), 0, 12, 3072)]);
    assert!(r.untrack_allocation(0x1000));
    assert!(!r.untrack_allocation(0x1000));
    let (samples, recorded) = heap_samples_native(&r);
    assert_eq!(samples, vec![(names(&frames), 1, 9, 2304)]);
    assert_eq!(recorded, 3);
    for id in 1..4u64 {
        assert!(r.untrack_allocation(0x1000 + id * 16));
    }
    let (samples, _) = heap_samples_native(&r);
    assert!(samples.is_empty());
    assert_eq!(r.stats().heap.unwrap().num_heap_records, 0);
}

fn names(frames: &[Frame<'_>]) -> Vec<String> {
    frames
        .iter()
        .map(|f| match f {
            Frame::Symbol {
                name: ferroprof_recorder::Str::Lit(n),
                ..
            } => (*n).to_owned(),
            other => panic!("{other:?}"),
        })
        .collect()
}

type NativeSample = (Vec<String>, i64, i64, i64);

fn heap_samples_native(r: &StackRecorder) -> (Vec<NativeSample>, u64) {
    let ser = r.serialize(None).unwrap();
    let p = ferroprof_pprof::decode(&ser.encoded.bytes).unwrap();
    let count_i = p.value_index("heap-live-samples").unwrap();
    let size_i = p.value_index("heap-live-size").unwrap();
    let out = p
        .sample
        .iter()
        .filter(|s| s.value[count_i] != 0)
        .map(|s| {
            assert_eq!(p.label_str(s, ALLOCATION_CLASS_LABEL), None);
            (
                p.stack_names(s),
                p.label_num(s, GC_GEN_AGE_LABEL).unwrap(),
                s.value[count_i],
                s.value[size_i],
            )
        })
        .collect();
    (out, ser.stats.recorded_samples)
}

/// The managed model's live-heap samples carry the request that allocated the object (its
/// local root span id, and its endpoint once named), immediate and deferred alike, for as long
/// as the object lives; the request's context goes with its last object.
#[test]
fn managed_live_heap_samples_keep_their_request() {
    use ferroprof_recorder::profile::{LOCAL_ROOT_SPAN_ID_LABEL, TRACE_ENDPOINT_LABEL};
    for deferred in [false, true] {
        let heap = Arc::new(ArcHeap {
            deferred,
            ..ArcHeap::default()
        });
        let r = managed_recorder(&heap, |_| {});
        let values = SampleValues {
            alloc_samples: 1,
            alloc_samples_unscaled: 1,
            heap_sample: true,
            ..SampleValues::default()
        };
        let mut objs = Vec::new();
        for (n, (size, root)) in [(100u64, 7u64), (200, 7), (400, 8), (800, 0)]
            .into_iter()
            .enumerate()
        {
            let (id, obj) = heap.new_object(size);
            let given = if deferred { 1000 + n as u64 } else { id };
            r.track_object_in(given, 1, Some("Obj"), root).unwrap();
            r.record_sample(&site("alloc"), &values, &[], 0).unwrap();
            heap.handles.lock().unwrap().insert(given, id);
            objs.push(obj);
        }
        r.heap().unwrap().finalize_pending_recordings().unwrap();
        r.record_endpoint(7, "GET /cache").unwrap();
        r.record_endpoint(8, "POST /other").unwrap();
        assert_eq!(
            r.stats().heap.unwrap().num_contexts,
            2,
            "deferred {deferred}"
        );
        heap.gc();
        let ser = r.serialize(None).unwrap();
        let p = ferroprof_pprof::decode(&ser.encoded.bytes).unwrap();
        let size = p.value_index("heap-live-size").unwrap();
        let mut live: Vec<(i64, Option<i64>, Option<&str>)> = p
            .sample
            .iter()
            .filter(|s| s.value[size] > 0)
            .map(|s| {
                (
                    s.value[size],
                    p.label_num(s, LOCAL_ROOT_SPAN_ID_LABEL),
                    p.label_str(s, TRACE_ENDPOINT_LABEL),
                )
            })
            .collect();
        live.sort();
        assert_eq!(
            live,
            vec![
                // Request 7's two objects share a stack and labels: one sample.
                (300, Some(7), Some("GET /cache")),
                (400, Some(8), Some("POST /other")),
                (800, None, None),
            ],
            "deferred {deferred}"
        );
        // The objects go: so do their requests' contexts (at the next update).
        objs.clear();
        heap.gc();
        let _ = r.serialize(None).unwrap();
        assert_eq!(
            r.stats().heap.unwrap().num_contexts,
            0,
            "deferred {deferred}"
        );
    }
}
