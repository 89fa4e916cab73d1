//! What a runtime binding (the Ruby extension in bindings/ruby) needs of the recorder: heap
//! calls that are no-ops with heap profiling off, young updates that only ask for liveness, a
//! failed heap preparation that leaves the profiles and another holder's iteration alone, and
//! the deferred-recording calls on the stack recorder itself.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ferroprof_recorder::heap::{LivenessSource, ObjectInfo};
use ferroprof_recorder::{
    Frame, HeapConfig, HeapError, RecorderConfig, RecorderError, SampleTypeConfig, SampleValues,
    StackRecorder,
};

/// A heap whose objects are entries of a map (id -> size); counts how it is asked.
#[derive(Default)]
struct MapHeap {
    gen: AtomicU64,
    objects: Mutex<HashMap<u64, u64>>,
    lookups: AtomicU64,
    liveness_checks: AtomicU64,
    deferred: bool,
    /// Deferred mode: handle -> id.
    handles: Mutex<HashMap<u64, u64>>,
}

impl LivenessSource for MapHeap {
    fn gc_generation(&self) -> u64 {
        self.gen.load(Ordering::Relaxed)
    }

    fn lookup(&self, id: u64) -> Option<ObjectInfo> {
        self.lookups.fetch_add(1, Ordering::Relaxed);
        let size = *self.objects.lock().unwrap().get(&id)?;
        Some(ObjectInfo {
            size,
            frozen: false,
        })
    }

    fn is_alive(&self, id: u64) -> bool {
        self.liveness_checks.fetch_add(1, Ordering::Relaxed);
        self.objects.lock().unwrap().contains_key(&id)
    }

    fn defers_ids(&self) -> bool {
        self.deferred
    }

    fn resolve_handle(&self, handle: u64) -> Option<u64> {
        self.handles.lock().unwrap().get(&handle).copied()
    }
}

fn recorder(heap: &Arc<MapHeap>) -> StackRecorder {
    let src: Arc<dyn LivenessSource> = heap.clone();
    let mut cfg = HeapConfig::managed(src);
    cfg.clean_after_gc = true;
    StackRecorder::new(RecorderConfig {
        sample_types: SampleTypeConfig::all(),
        heap: cfg,
        ..RecorderConfig::default()
    })
    .unwrap()
}

fn allocation_sample(r: &StackRecorder, heap_sample: bool) -> Result<(), RecorderError> {
    let values = SampleValues {
        alloc_samples: 1,
        heap_sample,
        ..SampleValues::default()
    };
    r.record_sample(&[Frame::sym("alloc", "app.rb", 3)], &values, &[], 0)
}

fn decode(bytes: &[u8]) -> ferroprof_pprof::Profile {
    ferroprof_pprof::decode(bytes).unwrap()
}

#[test]
fn track_object_without_heap_profiling_is_a_noop() {
    let r = StackRecorder::new(RecorderConfig {
        sample_types: SampleTypeConfig {
            heap_samples: false,
            heap_size: false,
            ..SampleTypeConfig::all()
        },
        ..RecorderConfig::default()
    })
    .unwrap();
    // An allocation sampler runs the same two calls whatever the configuration.
    assert_eq!(r.track_object(7, 1, Some("String")), Ok(false));
    allocation_sample(&r, true).unwrap();
    assert!(!r.is_heap_object_recorded(7));
    r.finalize_pending_heap_recordings().unwrap();
    let p = r.serialize(None).unwrap();
    assert_eq!(decode(&p.encoded.bytes).total("alloc-samples"), Some(1));
}

#[test]
fn young_updates_check_liveness_without_measuring() {
    let heap = Arc::new(MapHeap::default());
    let r = recorder(&heap);
    heap.objects.lock().unwrap().insert(1, 100);
    heap.objects.lock().unwrap().insert(2, 40);
    for id in [1, 2] {
        r.track_object(id, 1, Some("String")).unwrap();
        allocation_sample(&r, true).unwrap();
    }
    heap.gen.fetch_add(1, Ordering::Relaxed);
    // The full update of a serialization measures.
    let p = r.serialize(None).unwrap();
    assert_eq!(decode(&p.encoded.bytes).total("heap-live-size"), Some(140));
    assert_eq!(heap.lookups.load(Ordering::Relaxed), 2);

    // Object 1 grows, object 2 dies; a young update follows the next collection.
    heap.objects.lock().unwrap().insert(1, 1000);
    heap.objects.lock().unwrap().remove(&2);
    heap.gen.fetch_add(1, Ordering::Relaxed);
    r.heap().unwrap().reset_last_update();
    let checks_before = heap.liveness_checks.load(Ordering::Relaxed);
    r.after_gc_step();
    assert_eq!(
        heap.lookups.load(Ordering::Relaxed),
        2,
        "young update measured"
    );
    assert_eq!(
        heap.liveness_checks.load(Ordering::Relaxed),
        checks_before + 2
    );
    assert!(r.is_heap_object_recorded(1));
    assert!(
        !r.is_heap_object_recorded(2),
        "the dead object stays recorded"
    );
    let st = r.stats().heap.unwrap();
    assert_eq!(
        (st.last_update_objects_alive, st.last_update_objects_dead),
        (1, 1)
    );

    // The next full update measures the new size.
    let p = r.serialize(None).unwrap();
    assert_eq!(decode(&p.encoded.bytes).total("heap-live-size"), Some(1000));
}

#[test]
fn failed_heap_preparation_fails_before_the_flip() {
    let heap = Arc::new(MapHeap::default());
    let r = recorder(&heap);
    allocation_sample(&r, false).unwrap();
    // Someone else holds an iteration (as the seed's fake slow heap serialization does).
    r.heap().unwrap().prepare_iteration().unwrap();
    let err = r.serialize(None).unwrap_err();
    assert_eq!(err, RecorderError::Heap(HeapError::PrepareTwice));
    assert_eq!(
        r.active_slot(),
        1,
        "slots flipped on a failed serialization"
    );
    assert!(!r.is_slot_locked(1));
    assert_eq!(r.stats().lifetime.serialization_failures, 1);
    // The holder's iteration was left open for it to finish.
    r.heap().unwrap().finish_iteration().unwrap();
    // And the sample recorded before the failure is in the next profile.
    allocation_sample(&r, false).unwrap();
    let p = r.serialize(None).unwrap();
    assert_eq!(p.stats.recorded_samples, 2);
    assert_eq!(decode(&p.encoded.bytes).total("alloc-samples"), Some(2));
    assert_eq!(r.stats().lifetime.serialization_successes, 1);
}

#[test]
fn deferred_recordings_through_the_stack_recorder() {
    let heap = Arc::new(MapHeap {
        deferred: true,
        ..MapHeap::default()
    });
    let r = recorder(&heap);
    // Handles 0xa0 and 0xb0 stand for objects whose ids are not known at allocation.
    for handle in [0xa0, 0xb0] {
        r.track_object(handle, 1, Some("Object")).unwrap();
        allocation_sample(&r, true).unwrap();
    }
    let mut pending = Vec::new();
    r.for_each_pending_heap_handle(|h| pending.push(h));
    assert_eq!(pending, [0xa0, 0xb0]);
    // Only 0xa0 still resolves to an id (the other object died first).
    heap.handles.lock().unwrap().insert(0xa0, 11);
    heap.objects.lock().unwrap().insert(11, 24);
    r.finalize_pending_heap_recordings().unwrap();
    pending.clear();
    r.for_each_pending_heap_handle(|h| pending.push(h));
    assert!(pending.is_empty());
    assert!(r.is_heap_object_recorded(11));
    assert!(!r.is_heap_object_recorded(0xb0));
    heap.gen.fetch_add(1, Ordering::Relaxed);
    let p = r.serialize(None).unwrap();
    let d = decode(&p.encoded.bytes);
    assert_eq!(d.total("heap-live-samples"), Some(1));
    assert_eq!(d.total("heap-live-size"), Some(24));
}
