//! The running profiler as the source of on-demand profiles (`/debug/pprof`).

use super::*;

/// The running profiler as a [`ProfileSource`].
pub(super) struct Source {
    pub(super) shared: Weak<Shared>,
}

impl Source {
    fn shared(&self) -> Result<Arc<Shared>, String> {
        crate::forkgate::resume_if_pending();
        self.shared
            .upgrade()
            .filter(|s| !s.stopping.load(Ordering::SeqCst))
            .ok_or_else(|| "the profiler is stopped".to_owned())
    }

    fn capture(&self, kind: TapKind, duration: Duration) -> Result<Vec<u8>, String> {
        let sh = self.shared()?;
        let p = sh.settings.profiles;
        let (types, extras) = match kind {
            TapKind::Cpu if p.needs_sampler() => shape(Kind::Cpu, &sh.settings),
            TapKind::Alloc if p.alloc => shape(Kind::Allocs, &sh.settings),
            TapKind::Cpu => return Err("CPU and wall profiling are not enabled".into()),
            TapKind::Alloc => return Err("allocation profiling is not enabled".into()),
        };
        if kind == TapKind::Alloc && !alloc::seen() {
            return Err(crate::notice::allocator_missing(p));
        }
        tls::with_guard(|| {
            let recorder = StackRecorder::with_extras(
                RecorderConfig {
                    sample_types: types,
                    heap: HeapConfig::default(),
                    compression: Compression::Gzip,
                    max_profile_bytes: sh.settings.max_profile_bytes,
                },
                extras,
            )
            .map_err(|e| e.to_string())?;
            let tap = Arc::new(Tap { kind, recorder });
            sh.add_tap(tap.clone());
            // Sleep in steps so a stop ends the capture early.
            let end = std::time::Instant::now() + duration;
            while !sh.stopping.load(Ordering::SeqCst) {
                let left = end.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    break;
                }
                std::thread::sleep(left.min(Duration::from_millis(100)));
            }
            sh.remove_tap(&tap);
            let mut sym = sh.symbolizer.lock();
            let out = tls::in_recorder(|| sym.pass(|sym| tap.recorder.serialize(Some(sym))))
                .map_err(|e| e.to_string())?;
            Ok(out.encoded.bytes)
        })
    }
}

/// The request labels of a live object's heap sample (as the periodic heap profile writes
/// them): its trace's local root span id and, once named, endpoint.
pub(super) fn request_labels(
    obj: &ferroprof_recorder::heap::LiveObject,
) -> Vec<ferroprof_recorder::Label<'static>> {
    use ferroprof_recorder::profile::{LOCAL_ROOT_SPAN_ID_LABEL, TRACE_ENDPOINT_LABEL};
    use ferroprof_recorder::{Label, LabelValue, Str, StringId};
    let mut out = Vec::new();
    if obj.local_root_span_id != 0 {
        out.push(Label::num(
            LOCAL_ROOT_SPAN_ID_LABEL,
            obj.local_root_span_id as i64,
        ));
        if obj.endpoint != StringId::EMPTY {
            out.push(Label {
                key: Str::Lit(TRACE_ENDPOINT_LABEL),
                value: LabelValue::Str(Str::Id(obj.endpoint)),
            });
        }
    }
    out
}

impl ProfileSource for Source {
    fn cpu_profile(&self, duration: Duration) -> Result<Vec<u8>, String> {
        self.capture(TapKind::Cpu, duration)
    }

    fn heap_profile(&self) -> Result<Vec<u8>, String> {
        let sh = self.shared()?;
        let heap = sh
            .recorder
            .heap()
            .ok_or_else(|| "heap profiling is not enabled".to_owned())?;
        if !alloc::seen() {
            return Err(crate::notice::allocator_missing(sh.settings.profiles));
        }
        tls::with_guard(|| {
            let _s = sh.serialize_lock.lock();
            let mut sym = sh.symbolizer.lock();
            let start = SystemTime::now();
            let (types, extras) = shape(Kind::Heap, &sh.settings);
            let layout = SampleLayout::with_extras(&types, &extras.sample_types);
            let n = layout.len();
            let mut profile =
                Profile::new(layout.types(), Some(sh.recorder.strings().clone()), start);
            profile
                .set_metadata(extras.metadata)
                .map_err(|e| e.to_string())?;
            tls::in_recorder(|| {
                // Building the profile reads the heap recorder, the allocation totals and the
                // string storage (shared with application threads): through the fork gate.
                // Adding the totals' copy (address frames) and encoding work on the profile's
                // own tables only, so a fork need not wait for them.
                let totals = crate::forkgate::outside_fork(|| {
                    heap.prepare_iteration().map_err(|e| e.to_string())?;
                    let mut add_err = None;
                    let iterated = heap.for_each_live_object(&mut |obj, frames| {
                        let w = obj.weight as i64;
                        let values = layout.place(&SampleValues {
                            heap_live_samples: w,
                            heap_live_size: w.saturating_mul(obj.size as i64),
                            ..SampleValues::default()
                        });
                        let labels = request_labels(obj);
                        let sample = Sample {
                            frames,
                            values: &values[..n],
                            labels: labels.as_slice(),
                            end_timestamp_ns: 0,
                        };
                        if let Err(e) = profile.add(&sample) {
                            add_err.get_or_insert(e);
                        }
                        true
                    });
                    let finished = heap.finish_iteration();
                    iterated.map_err(|e| e.to_string())?;
                    finished.map_err(|e| e.to_string())?;
                    if let Some(e) = add_err {
                        return Err(e.to_string());
                    }
                    Ok(sh.alloc_enabled().then(|| sh.alloc_totals.snapshot()))
                })?;
                if let Some(totals) = totals {
                    add_alloc_totals(&mut profile, &layout, &totals).map_err(|e| e.to_string())?;
                }
                let opts = ferroprof_recorder::pprof::EncodeOptions {
                    compression: Compression::Gzip,
                };
                let encoded = sym
                    .pass(|sym| profile.encode(SystemTime::now(), &opts, Some(sym)))
                    .map_err(|e| e.to_string())?;
                Ok(encoded.bytes)
            })
        })
    }

    fn allocs_profile(&self, duration: Duration) -> Result<Vec<u8>, String> {
        self.capture(TapKind::Alloc, duration)
    }
}

/// Adds the allocations since the start, one sample per stack, to a heap profile of `layout`
/// (a stack that also has live objects shares their row).
pub(super) fn add_alloc_totals(
    profile: &mut Profile,
    layout: &SampleLayout,
    totals: &crate::alloc::totals::TotalsSnapshot,
) -> Result<(), ferroprof_recorder::ProfileError> {
    let n = layout.len();
    let place = |v: [i64; 3]| {
        layout.place_with(
            &SampleValues {
                alloc_samples: v[0],
                alloc_samples_unscaled: v[1],
                ..SampleValues::default()
            },
            &ExtraValues { alloc_space: v[2] },
        )
    };
    let mut frames: Vec<Frame<'static>> = Vec::new();
    let mut result = Ok(());
    totals.for_each(|stack, v| {
        if result.is_err() {
            return;
        }
        frames.clear();
        frames.extend(stack.iter().map(|&a| Frame::Address(a)));
        let values = place(v);
        result = profile.add(&Sample {
            frames: &frames,
            values: &values[..n],
            labels: &[],
            end_timestamp_ns: 0,
        });
    });
    result?;
    let folded = totals.folded();
    if folded != [0; 3] {
        let values = place(folded);
        profile.add(&Sample {
            frames: &[Frame::sym(DROPPED_STACKS_FRAME, "", 0)],
            values: &values[..n],
            labels: &[],
            end_timestamp_ns: 0,
        })?;
    }
    Ok(())
}
