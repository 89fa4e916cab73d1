//! `Ferroprof::StackRecorder`: the seed's Ruby-facing stack recorder, and the testing helpers
//! its spec drives (`Ferroprof::StackRecorder::Testing`).

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use ferroprof_recorder::heap::{HeapStats, LivenessSource};
use ferroprof_recorder::{
    Frame, HeapConfig, HeapError, Label, ProfileError, ProfileMetadata, RecorderConfig,
    RecorderError, RecorderExtras, SampleType, SampleTypeConfig, SampleValues, SerializedProfile,
    StackRecorder,
};
use magnus::r_hash::ForEach;
use magnus::rb_sys::AsRawValue;
use magnus::typed_data::DataTypeFunctions;
use magnus::{
    function, gc, method, prelude::*, Error, IntoValue, RArray, RHash, RModule, RString, Ruby,
    Symbol, TryConvert, Value,
};

use crate::heap::{handle_of, RubyHeap};
use crate::{arg_error, error, guard};

/// The Ruby object: the recorder is shared with the profiler's sampling paths.
#[derive(magnus::TypedData)]
#[magnus(class = "Ferroprof::StackRecorder", free_immediately, mark)]
pub struct RbRecorder {
    pub inner: Arc<StackRecorder>,
}

impl DataTypeFunctions for RbRecorder {
    fn mark(&self, _marker: &gc::Marker) {
        // Objects whose recording waits for its id must stay alive (and in place) until it is
        // committed: their VALUE is the handle the id is resolved from.
        self.inner.for_each_pending_heap_handle(|handle| {
            // SAFETY: called by the GC's mark phase (the only time this function runs) with a
            // handle that is the VALUE of an object given to track_object and not yet
            // committed, so it is a valid object reference.
            unsafe { rb_sys::rb_gc_mark(handle as rb_sys::VALUE) };
        });
    }
}

/// A Ruby exception for a recorder error: the caller's mistakes are `ArgumentError`s, the rest
/// `Ferroprof::Error`s.
pub fn recorder_error(ruby: &Ruby, e: RecorderError) -> Error {
    let caller_mistake = match &e {
        RecorderError::Profile(p) => {
            !matches!(p, ProfileError::String(_) | ProfileError::Encode(_))
        }
        RecorderError::Heap(HeapError::InvalidSampleEvery(_) | HeapError::TooManyFrames { .. }) => {
            true
        }
        RecorderError::Config(_) => true,
        _ => false,
    };
    if caller_mistake {
        arg_error(ruby, e.to_string())
    } else {
        error(ruby, e.to_string())
    }
}

/// Where a serialized profile goes besides the caller (the exporters): the number of
/// destinations that refused it.
pub(crate) type ExportTo<'a> = dyn Fn(&SerializedProfile, &StackRecorder) -> usize + 'a;

/// The seed's configuration, from `StackRecorder.new`'s keywords (checked in lib/ferroprof.rb).
#[allow(clippy::too_many_arguments)]
pub fn build_recorder(
    ruby: &Ruby,
    cpu_time_enabled: bool,
    alloc_samples_enabled: bool,
    heap_samples_enabled: bool,
    heap_size_enabled: bool,
    heap_sample_every: i64,
    timeline_enabled: bool,
    heap_clean_after_gc_enabled: bool,
    cpu_period_ns: u64,
) -> Result<StackRecorder, Error> {
    let sample_every = u32::try_from(heap_sample_every)
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| {
            recorder_error(
                ruby,
                RecorderError::Heap(HeapError::InvalidSampleEvery(heap_sample_every)),
            )
        })?;
    let source: Arc<dyn LivenessSource> = Arc::new(RubyHeap);
    let mut heap = HeapConfig::managed(source);
    heap.sample_every = sample_every;
    heap.clean_after_gc = heap_clean_after_gc_enabled;
    let config = RecorderConfig {
        sample_types: SampleTypeConfig {
            cpu_time: cpu_time_enabled,
            alloc_samples: alloc_samples_enabled,
            heap_samples: heap_samples_enabled,
            heap_size: heap_size_enabled,
            timeline: timeline_enabled,
        },
        heap,
        ..RecorderConfig::default()
    };
    // What one CPU sample stands for, when a sampler says (pprof's period type and period).
    let extras = RecorderExtras {
        metadata: ProfileMetadata {
            period: (cpu_period_ns > 0).then_some((SampleType::CpuTime, cpu_period_ns as i64)),
            ..ProfileMetadata::default()
        },
        ..RecorderExtras::default()
    };
    StackRecorder::with_extras(config, extras).map_err(|e| recorder_error(ruby, e))
}

impl RbRecorder {
    #[allow(clippy::too_many_arguments)]
    fn new(
        ruby: &Ruby,
        cpu_time_enabled: bool,
        alloc_samples_enabled: bool,
        heap_samples_enabled: bool,
        heap_size_enabled: bool,
        heap_sample_every: i64,
        timeline_enabled: bool,
        heap_clean_after_gc_enabled: bool,
        cpu_period_ns: u64,
    ) -> Result<Self, Error> {
        guard(ruby, || {
            let inner = build_recorder(
                ruby,
                cpu_time_enabled,
                alloc_samples_enabled,
                heap_samples_enabled,
                heap_size_enabled,
                heap_sample_every,
                timeline_enabled,
                heap_clean_after_gc_enabled,
                cpu_period_ns,
            )?;
            Ok(RbRecorder {
                inner: Arc::new(inner),
            })
        })
    }

    /// `[:ok, [start_ns, finish_ns, pprof_bytes, stats]]` or `[:error, message]`, as the seed's
    /// `_native_serialize` (the Ruby side turns it into Times or an exception).
    fn native_serialize(ruby: &Ruby, rb: &RbRecorder) -> Result<RArray, Error> {
        Self::serialize_to(ruby, rb, None)
    }

    /// `_native_serialize`'s answer; `export`, when given, also gets the serialized profile and
    /// says how many of its destinations refused it (the stats' `export_refused`).
    pub(crate) fn serialize_to(
        ruby: &Ruby,
        rb: &RbRecorder,
        export: Option<&ExportTo<'_>>,
    ) -> Result<RArray, Error> {
        guard(ruby, || {
            let out = ruby.ary_new_capa(2);
            match rb.inner.serialize(None) {
                Ok(p) => {
                    let refused = export.map_or(0, |f| f(&p, &rb.inner));
                    let stats = hash_of(
                        ruby,
                        &[
                            ("recorded_samples", p.stats.recorded_samples),
                            ("serialization_time_ns", p.stats.serialization_time_ns),
                            (
                                "heap_iteration_prep_time_ns",
                                p.stats.heap_iteration_prep_time_ns,
                            ),
                            (
                                "heap_profile_build_time_ns",
                                p.stats.heap_profile_build_time_ns,
                            ),
                            ("dropped_stacks", p.stats.dropped_stacks),
                            ("profile_bytes", p.stats.profile_bytes),
                            ("export_refused", refused as u64),
                        ],
                    )?;
                    let result = ruby.ary_new_capa(4);
                    result.push(epoch_ns(p.start))?;
                    result.push(epoch_ns(p.finish))?;
                    result.push(ruby.str_from_slice(&p.encoded.bytes))?;
                    result.push(stats)?;
                    out.push(ruby.to_symbol("ok"))?;
                    out.push(result)?;
                }
                Err(e) => {
                    out.push(ruby.to_symbol("error"))?;
                    out.push(e.to_string())?;
                }
            }
            Ok(out)
        })
    }

    fn stats(ruby: &Ruby, rb: &RbRecorder) -> Result<RHash, Error> {
        guard(ruby, || {
            let st = rb.inner.stats();
            let h = hash_of(
                ruby,
                &[
                    (
                        "serialization_successes",
                        st.lifetime.serialization_successes,
                    ),
                    ("serialization_failures", st.lifetime.serialization_failures),
                    ("dropped_stacks", st.dropped_stacks),
                ],
            )?;
            let opt = |v: Option<u64>| v.map(|v| v.into_value_with(ruby));
            h.aset(
                ruby.to_symbol("serialization_time_ns_min"),
                opt(st.lifetime.serialization_time_ns_min),
            )?;
            h.aset(
                ruby.to_symbol("serialization_time_ns_max"),
                opt(st.lifetime.serialization_time_ns_max),
            )?;
            h.aset(
                ruby.to_symbol("serialization_time_ns_total"),
                opt(st.lifetime.serialization_time_ns_total),
            )?;
            h.aset(
                ruby.to_symbol("serialization_time_ns_avg"),
                st.lifetime.serialization_time_ns_avg,
            )?;
            let heap = match &st.heap {
                Some(hs) => Some(heap_stats_hash(ruby, hs)?),
                None => None,
            };
            h.aset(ruby.to_symbol("heap_recorder_snapshot"), heap)?;
            Ok(h)
        })
    }

    fn reset_after_fork(ruby: &Ruby, rb: &RbRecorder) -> Result<(), Error> {
        guard(ruby, || {
            rb.inner.reset_after_fork();
            Ok(())
        })
    }
}

fn epoch_ns(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_nanos()).unwrap_or(i64::MAX),
        Err(e) => -i64::try_from(e.duration().as_nanos()).unwrap_or(i64::MAX),
    }
}

fn hash_of(ruby: &Ruby, pairs: &[(&str, u64)]) -> Result<RHash, Error> {
    let h = ruby.hash_new();
    for (k, v) in pairs {
        h.aset(ruby.to_symbol(k), *v)?;
    }
    Ok(h)
}

fn heap_stats_hash(ruby: &Ruby, s: &HeapStats) -> Result<RHash, Error> {
    let h = hash_of(
        ruby,
        &[
            ("num_object_records", s.num_object_records),
            ("num_heap_records", s.num_heap_records),
            ("pending_recordings_count", s.pending_recordings_count),
            ("last_update_objects_alive", s.last_update_objects_alive),
            ("last_update_objects_dead", s.last_update_objects_dead),
            ("last_update_objects_skipped", s.last_update_objects_skipped),
            ("last_update_objects_frozen", s.last_update_objects_frozen),
            ("lifetime_updates_successful", s.lifetime_updates_successful),
            (
                "lifetime_updates_skipped_concurrent",
                s.lifetime_updates_skipped_concurrent,
            ),
            (
                "lifetime_updates_skipped_gcgen",
                s.lifetime_updates_skipped_gcgen,
            ),
            (
                "lifetime_updates_skipped_time",
                s.lifetime_updates_skipped_time,
            ),
            (
                "lifetime_deferred_recordings_skipped_buffer_full",
                s.lifetime_deferred_recordings_skipped_buffer_full,
            ),
            (
                "lifetime_deferred_recordings_finalized",
                s.lifetime_deferred_recordings_finalized,
            ),
        ],
    )?;
    for (k, v) in [
        (
            "lifetime_ewma_young_objects_alive",
            s.lifetime_ewma_young_objects_alive,
        ),
        (
            "lifetime_ewma_young_objects_dead",
            s.lifetime_ewma_young_objects_dead,
        ),
        (
            "lifetime_ewma_young_objects_skipped",
            s.lifetime_ewma_young_objects_skipped,
        ),
        ("lifetime_ewma_objects_alive", s.lifetime_ewma_objects_alive),
        ("lifetime_ewma_objects_dead", s.lifetime_ewma_objects_dead),
        (
            "lifetime_ewma_objects_skipped",
            s.lifetime_ewma_objects_skipped,
        ),
    ] {
        h.aset(ruby.to_symbol(k), v)?;
    }
    Ok(h)
}

// --- testing helpers (the seed's StackRecorder::Testing) ---------------------------------------

fn active_slot(ruby: &Ruby, rb: &RbRecorder) -> Result<u8, Error> {
    guard(ruby, || Ok(rb.inner.active_slot()))
}

fn slot_one_locked(ruby: &Ruby, rb: &RbRecorder) -> Result<bool, Error> {
    guard(ruby, || Ok(rb.inner.is_slot_locked(1)))
}

fn slot_two_locked(ruby: &Ruby, rb: &RbRecorder) -> Result<bool, Error> {
    guard(ruby, || Ok(rb.inner.is_slot_locked(2)))
}

fn is_object_recorded(ruby: &Ruby, rb: &RbRecorder, id: u64) -> Result<bool, Error> {
    guard(ruby, || Ok(rb.inner.is_heap_object_recorded(id)))
}

fn after_gc_step(ruby: &Ruby, rb: &RbRecorder) -> Result<(), Error> {
    guard(ruby, || {
        rb.inner.after_gc_step();
        Ok(())
    })
}

fn record_endpoint(
    ruby: &Ruby,
    rb: &RbRecorder,
    local_root_span_id: u64,
    endpoint: String,
) -> Result<(), Error> {
    guard(ruby, || {
        rb.inner
            .record_endpoint(local_root_span_id, &endpoint)
            .map_err(|e| recorder_error(ruby, e))
    })
}

/// Starts the heap recording of `obj` (the first half of an allocation sample).
fn track_object(
    ruby: &Ruby,
    rb: &RbRecorder,
    obj: Value,
    weight: u32,
    class_name: Option<String>,
) -> Result<bool, Error> {
    guard(ruby, || {
        rb.inner
            .track_object(handle_of(obj), weight, class_name.as_deref())
            .map_err(|e| recorder_error(ruby, e))
    })
}

fn commit_pending(ruby: &Ruby, rb: &RbRecorder) -> Result<(), Error> {
    guard(ruby, || {
        rb.inner
            .finalize_pending_heap_recordings()
            .map_err(|e| recorder_error(ruby, e))
    })
}

/// The id the heap recorder tracks `obj` by, `nil` when it does not track it.
fn record_id_for(ruby: &Ruby, rb: &RbRecorder, obj: Value) -> Result<Option<u64>, Error> {
    guard(ruby, || {
        // SAFETY: obj is a live VALUE handed in by Ruby (on this call's stack).
        let id = unsafe { magnus::rb_sys::FromRawValue::from_raw(rb_sys::rb_obj_id(obj.as_raw())) };
        let id = u64::try_convert(id)?;
        Ok(rb.inner.is_heap_object_recorded(id).then_some(id))
    })
}

fn debug_heap_recorder(ruby: &Ruby, rb: &RbRecorder) -> Result<RHash, Error> {
    guard(ruby, || {
        let h = ruby.hash_new();
        let state = match rb.inner.stats().heap {
            Some(s) => Some(heap_stats_hash(ruby, &s)?),
            None => None,
        };
        h.aset(ruby.to_symbol("state"), state)?;
        Ok(h)
    })
}

fn heap_or_error(ruby: &Ruby, rb: &RbRecorder) -> Result<(), Error> {
    match rb.inner.heap() {
        Some(_) => Ok(()),
        None => Err(recorder_error(ruby, RecorderError::HeapDisabled)),
    }
}

/// Holds a heap iteration open, as a serialization does while it builds heap samples.
fn start_fake_slow_heap_serialization(ruby: &Ruby, rb: &RbRecorder) -> Result<(), Error> {
    guard(ruby, || {
        heap_or_error(ruby, rb)?;
        let heap = rb.inner.heap().expect("checked above");
        heap.prepare_iteration()
            .map_err(|e| recorder_error(ruby, e.into()))
    })
}

fn end_fake_slow_heap_serialization(ruby: &Ruby, rb: &RbRecorder) -> Result<(), Error> {
    guard(ruby, || {
        heap_or_error(ruby, rb)?;
        let heap = rb.inner.heap().expect("checked above");
        heap.finish_iteration()
            .map_err(|e| recorder_error(ruby, e.into()))
    })
}

fn heap_reset_last_update(ruby: &Ruby, rb: &RbRecorder) -> Result<(), Error> {
    guard(ruby, || {
        if let Some(heap) = rb.inner.heap() {
            heap.reset_last_update();
        }
        Ok(())
    })
}

/// A string key (String or Symbol).
fn key_string(v: Value) -> Result<String, Error> {
    match Symbol::from_value(v) {
        Some(sym) => Ok(sym.name()?.into_owned()),
        None => String::try_convert(v),
    }
}

/// Parses a `{"cpu-time" => n, ..., "heap_sample" => bool}` hash into sample values.
pub fn sample_values(ruby: &Ruby, values: RHash) -> Result<SampleValues, Error> {
    let mut out = SampleValues::default();
    let mut bad: Option<String> = None;
    values.foreach(|k: Value, v: Value| {
        let key = key_string(k)?;
        if key == "heap_sample" {
            out.heap_sample = v.to_bool();
            return Ok(ForEach::Continue);
        }
        let n = i64::try_convert(v)?;
        match key.as_str() {
            "cpu-time" => out.cpu_time_ns = n,
            "cpu-samples" => out.cpu_or_wall_samples = n,
            "wall-time" => out.wall_time_ns = n,
            "alloc-samples" => out.alloc_samples = n,
            "alloc-samples-unscaled" => out.alloc_samples_unscaled = n,
            "timeline" => out.timeline_wall_time_ns = n,
            _ => {
                bad = Some(key);
                return Ok(ForEach::Stop);
            }
        }
        Ok(ForEach::Continue)
    })?;
    match bad {
        Some(key) => Err(arg_error(
            ruby,
            format!("unknown sample value type {key:?} (expected a sample type name or \"heap_sample\")"),
        )),
        None => Ok(out),
    }
}

/// `[[name, path, line], ...]`, innermost first.
fn frames_of(frames: RArray) -> Result<Vec<(String, String, i64)>, Error> {
    frames
        .into_iter()
        .map(|f| {
            let (name, path, line): (String, String, i64) = TryConvert::try_convert(f)?;
            Ok((name, path, line))
        })
        .collect()
}

fn pairs<V: TryConvert>(list: RArray) -> Result<Vec<(String, V)>, Error> {
    list.into_iter()
        .map(|p| {
            let (k, v): (Value, V) = TryConvert::try_convert(p)?;
            Ok((key_string(k)?, v))
        })
        .collect()
}

/// Records one sample with the given stack, values and labels (string and numeric).
pub fn sample(
    ruby: &Ruby,
    rb: &RbRecorder,
    frames: RArray,
    values: RHash,
    labels: RArray,
    numeric_labels: RArray,
) -> Result<(), Error> {
    sample_at(ruby, rb, frames, values, labels, numeric_labels, 0)
}

/// [`sample`] with a timestamp (nanoseconds since the epoch; 0: none): a timeline event.
pub fn sample_at(
    ruby: &Ruby,
    rb: &RbRecorder,
    frames: RArray,
    values: RHash,
    labels: RArray,
    numeric_labels: RArray,
    at_ns: i64,
) -> Result<(), Error> {
    guard(ruby, || {
        let frames = frames_of(frames)?;
        let values = sample_values(ruby, values)?;
        let string_labels: Vec<(String, Value)> = pairs(labels)?;
        let numeric: Vec<(String, i64)> = pairs(numeric_labels)?;
        // A string label must hold a String; a number where a string is expected is kept as its
        // text so the recorder's own checks (e.g. "local root span id" must be numeric) apply.
        let string_labels: Vec<(String, String)> = string_labels
            .into_iter()
            .map(|(k, v)| Ok((k, RString::try_convert(v)?.to_string()?)))
            .collect::<Result<_, Error>>()?;
        let frame_refs: Vec<Frame<'_>> = frames
            .iter()
            .map(|(n, p, l)| Frame::sym(n, p, *l))
            .collect();
        let mut label_refs: Vec<Label<'_>> = string_labels
            .iter()
            .map(|(k, v)| Label::str(k, v))
            .collect();
        label_refs.extend(numeric.iter().map(|(k, v)| Label::num(k, *v)));
        rb.inner
            .record_sample(&frame_refs, &values, &label_refs, at_ns)
            .map_err(|e| recorder_error(ruby, e))
    })
}

pub fn init(ruby: &Ruby, module: RModule) -> Result<(), Error> {
    let class = module.define_class("StackRecorder", ruby.class_object())?;
    class.define_singleton_method("_native_new", function!(RbRecorder::new, 8))?;
    class.define_singleton_method(
        "_native_serialize",
        function!(RbRecorder::native_serialize, 1),
    )?;
    class.define_method("stats", method!(RbRecorder::stats, 0))?;
    class.define_method("reset_after_fork", method!(RbRecorder::reset_after_fork, 0))?;

    let testing = class.define_module("Testing")?;
    testing.define_module_function("_native_active_slot", function!(active_slot, 1))?;
    testing.define_module_function(
        "_native_slot_one_mutex_locked?",
        function!(slot_one_locked, 1),
    )?;
    testing.define_module_function(
        "_native_slot_two_mutex_locked?",
        function!(slot_two_locked, 1),
    )?;
    testing.define_module_function(
        "_native_is_object_recorded?",
        function!(is_object_recorded, 2),
    )?;
    testing.define_module_function(
        "_native_recorder_after_gc_step",
        function!(after_gc_step, 1),
    )?;
    testing.define_module_function("_native_record_endpoint", function!(record_endpoint, 3))?;
    testing.define_module_function("_native_track_object", function!(track_object, 4))?;
    testing.define_module_function(
        "_native_commit_pending_heap_recordings",
        function!(commit_pending, 1),
    )?;
    testing.define_module_function("_native_record_id_for", function!(record_id_for, 2))?;
    testing.define_module_function(
        "_native_debug_heap_recorder",
        function!(debug_heap_recorder, 1),
    )?;
    testing.define_module_function(
        "_native_start_fake_slow_heap_serialization",
        function!(start_fake_slow_heap_serialization, 1),
    )?;
    testing.define_module_function(
        "_native_end_fake_slow_heap_serialization",
        function!(end_fake_slow_heap_serialization, 1),
    )?;
    testing.define_module_function(
        "_native_heap_recorder_reset_last_update",
        function!(heap_reset_last_update, 1),
    )?;
    testing.define_module_function("_native_sample", function!(sample, 5))?;
    Ok(())
}
