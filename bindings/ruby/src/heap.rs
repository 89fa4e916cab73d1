//! The Ruby VM as the heap recorder's [`LivenessSource`].
//!
//! Objects are recorded by object id. Liveness is asked of a weak map from id to object
//! (`ObjectSpace::WeakMap`, filled when a recording is committed), which answers only for
//! objects the collector has not found dead, so it never resurrects one; sizes come from `ObjectSpace.memsize_of`; the generation is
//! `GC.count` (`rb_gc_count`). All of it is public API.
//!
//! Ids are taken outside the allocation: the recorder is in deferred mode, a recording's handle
//! is the object's `VALUE` (kept alive by the recorder's mark function until committed), and
//! [`LivenessSource::resolve_handle`] turns it into the object id from a safe point.

use ferroprof_recorder::heap::{LivenessSource, ObjectInfo};
use magnus::rb_sys::{AsRawValue, FromRawValue};
use magnus::value::{Lazy, ReprValue};
use magnus::{Integer, Module, RModule, Ruby, TryConvert, Value};

static OBJECT_SPACE: Lazy<RModule> = Lazy::new(|ruby| {
    ruby.class_object()
        .const_get("ObjectSpace")
        .expect("ObjectSpace is part of the core")
});

/// `Ferroprof::LIVE_OBJECTS`, an `ObjectSpace::WeakMap` from the id of each tracked object to
/// the object: asking it costs no exception for a dead object (`_id2ref` raises one, and most
/// sampled objects die young), and it never resurrects one.
static LIVE_OBJECTS: Lazy<Value> = Lazy::new(|ruby| {
    let module: RModule = ruby
        .class_object()
        .const_get("Ferroprof")
        .expect("Ferroprof is defined before any recorder");
    module
        .const_get("LIVE_OBJECTS")
        .expect("lib/ferroprof.rb defines Ferroprof::LIVE_OBJECTS")
});

/// The VM's view of its heap. Every method is called with the GVL held: from Ruby calls into
/// the recorder (serialize, the testing helpers) and from postponed jobs.
pub struct RubyHeap;

impl RubyHeap {
    /// The live object of `id`, `None` when the collector found it dead.
    fn object(ruby: &Ruby, id: u64) -> Option<Value> {
        let live = ruby.get_inner(&LIVE_OBJECTS);
        let obj: Value = live.funcall("[]", (ruby.integer_from_u64(id),)).ok()?;
        (!obj.is_nil()).then_some(obj)
    }
}

impl LivenessSource for RubyHeap {
    fn gc_generation(&self) -> u64 {
        // SAFETY: rb_gc_count only reads a counter of the VM; callers hold the GVL.
        unsafe { rb_sys::rb_gc_count() as u64 }
    }

    fn lookup(&self, id: u64) -> Option<ObjectInfo> {
        let Ok(ruby) = Ruby::get() else {
            // Not a Ruby thread: nothing can be asked, so nothing is dropped or re-measured.
            return Some(ObjectInfo {
                size: 0,
                frozen: false,
            });
        };
        let obj = Self::object(&ruby, id)?;
        let size = ruby
            .get_inner(&OBJECT_SPACE)
            .funcall::<_, _, u64>("memsize_of", (obj,))
            .unwrap_or(0);
        Some(ObjectInfo {
            size,
            frozen: obj.is_frozen(),
        })
    }

    fn is_alive(&self, id: u64) -> bool {
        match Ruby::get() {
            Ok(ruby) => Self::object(&ruby, id).is_some(),
            Err(_) => true,
        }
    }

    fn wait_for_other_update(&self) {
        if Ruby::get().is_ok() {
            // The other update runs on a Ruby thread and may be waiting for the GVL inside a
            // lookup (a method call can switch threads): hand the GVL over.
            // SAFETY: called on a Ruby thread holding the GVL (Ruby::get succeeded).
            unsafe { rb_sys::rb_thread_schedule() };
        } else {
            std::thread::yield_now();
        }
    }

    fn defers_ids(&self) -> bool {
        true
    }

    fn resolve_handle(&self, handle: u64) -> Option<u64> {
        // SAFETY: a handle is the VALUE of an object given to `track_object`; the recorder's
        // mark function marks every pending handle, so the object is alive (and, marked with
        // rb_gc_mark, not moved by compaction) until its recording is committed here.
        let obj = unsafe { Value::from_raw(handle as rb_sys::VALUE) };
        // SAFETY: as above.
        let id = unsafe { Value::from_raw(rb_sys::rb_obj_id(handle as rb_sys::VALUE)) };
        let live = Ruby::get().ok()?.get_inner(&LIVE_OBJECTS);
        live.funcall::<_, _, Value>("[]=", (id, obj)).ok()?;
        Integer::try_convert(id).ok()?.to_u64().ok()
    }
}

/// The handle of `obj` for [`LivenessSource::resolve_handle`].
#[allow(clippy::unnecessary_cast)] // VALUE is u64 on 64-bit targets only.
pub fn handle_of(obj: Value) -> u64 {
    obj.as_raw() as u64
}
