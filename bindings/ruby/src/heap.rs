//! The Ruby VM as the heap recorder's [`LivenessSource`].
//!
//! Objects are recorded by object id. Liveness is asked of the VM with `ObjectSpace._id2ref`,
//! which answers only for objects the collector has not found dead (also during a lazy sweep),
//! so it never resurrects one; sizes come from `ObjectSpace.memsize_of`; the generation is
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

/// The VM's view of its heap. Every method is called with the GVL held: from Ruby calls into
/// the recorder (serialize, the testing helpers) and from postponed jobs.
pub struct RubyHeap;

impl RubyHeap {
    /// The live object of `id`, `None` when the collector found it dead.
    fn object(ruby: &Ruby, id: u64) -> Option<Value> {
        let os = ruby.get_inner(&OBJECT_SPACE);
        // A dead id raises RangeError; funcall rescues it into an Err.
        os.funcall::<_, _, Value>("_id2ref", (ruby.integer_from_u64(id),))
            .ok()
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

    fn defers_ids(&self) -> bool {
        true
    }

    fn resolve_handle(&self, handle: u64) -> Option<u64> {
        // SAFETY: a handle is the VALUE of an object given to `track_object`; the recorder's
        // mark function marks every pending handle, so the object is alive (and, marked with
        // rb_gc_mark, not moved by compaction) until its recording is committed here.
        let id = unsafe { Value::from_raw(rb_sys::rb_obj_id(handle as rb_sys::VALUE)) };
        Integer::try_convert(id).ok()?.to_u64().ok()
    }
}

/// The handle of `obj` for [`LivenessSource::resolve_handle`].
#[allow(clippy::unnecessary_cast)] // VALUE is u64 on 64-bit targets only.
pub fn handle_of(obj: Value) -> u64 {
    obj.as_raw() as u64
}
