//! ferroprof's recording core side by side with libdd-profiling 1.x, in the same run.
//!
//! - `add/*`: one sample of an 18-frame stack seen before, 2 labels, 8 values. Ours goes through
//!   `StackRecorder::record_sample` (gate + slot lock + profile add); libdd's through
//!   `Profile::try_add_sample` (string frames) or `add_string_id_sample` (interned ids), building
//!   the `api::Sample` it needs each time as a caller would.
//! - `serialize/*`: encoding + compression of 1,000 timestamped samples and of 100,000 aggregated
//!   distinct stacks. libdd compresses with zstd level 1; ours is measured with gzip (the
//!   default) and, with the `zstd` feature, with zstd level 1. Output sizes are printed.
//!
//! Kept short on purpose (small sample counts) so the whole run takes a few minutes.

use std::hint::black_box;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use ferroprof_recorder::heap::HeapConfig;
use ferroprof_recorder::pprof::EncodeOptions;
use ferroprof_recorder::{
    Compression, Frame, Label, LabelValue, Profile, RecorderConfig, Sample, SampleType,
    SampleTypeConfig, SampleValues, StackRecorder, Str, StringId,
};
use libdd_profiling::api;
use libdd_profiling::collections::string_storage::ManagedStringStorage;
use libdd_profiling::internal::Profile as DdProfile;

const FRAMES: usize = 18;
/// Adds timed per batch before the (untimed) clean-up of timestamped benches.
const TIMED_BATCH: u64 = 20_000;

/// Symbol names and file names shaped like a Rust program's.
fn symbols(n: usize, tag: &str) -> Vec<(String, String, i64)> {
    (0..n)
        .map(|i| {
            (
                format!("my_service::{tag}::handlers::module_{i}::Handler<T>::handle_request_{i}"),
                format!("/home/build/my_service/src/{tag}/handlers/module_{i}.rs"),
                100 + i as i64,
            )
        })
        .collect()
}

fn dd_types() -> Vec<api::ValueType<'static>> {
    SampleType::ALL
        .iter()
        .map(|t| api::ValueType::new(t.name(), t.unit()))
        .collect()
}

fn all_values() -> SampleValues {
    SampleValues {
        cpu_time_ns: 1_000_000,
        cpu_or_wall_samples: 1,
        wall_time_ns: 1_000_000,
        alloc_samples: 1,
        alloc_samples_unscaled: 1,
        heap_live_samples: 0,
        heap_live_size: 0,
        timeline_wall_time_ns: 1_000_000,
        heap_sample: false,
    }
}

const DD_VALUES: [i64; 8] = [1_000_000, 1, 1_000_000, 1, 1, 0, 0, 1_000_000];

fn recorder() -> StackRecorder {
    StackRecorder::new(RecorderConfig {
        sample_types: SampleTypeConfig::all(),
        heap: HeapConfig::native(),
        compression: Compression::Gzip,
        max_profile_bytes: None,
    })
    .expect("recorder")
}

fn dd_sample<'a>(syms: &'a [(String, String, i64)], values: &'a [i64]) -> api::Sample<'a> {
    api::Sample {
        locations: syms
            .iter()
            .map(|(n, f, l)| api::Location {
                function: api::Function {
                    name: n,
                    system_name: "",
                    filename: f,
                },
                line: *l,
                ..Default::default()
            })
            .collect(),
        values,
        labels: vec![
            api::Label {
                key: "thread id",
                num: 7,
                ..Default::default()
            },
            api::Label {
                key: "thread name",
                str: "worker-7",
                ..Default::default()
            },
        ],
    }
}

/// Times `add` over `iters` calls, cleaning up (untimed) every `TIMED_BATCH` calls.
fn timed_batches(iters: u64, mut add: impl FnMut(u64), mut cleanup: impl FnMut()) -> Duration {
    let mut total = Duration::ZERO;
    let mut done = 0;
    while done < iters {
        let n = (iters - done).min(TIMED_BATCH);
        let t = Instant::now();
        for i in 0..n {
            add(done + i);
        }
        total += t.elapsed();
        done += n;
        cleanup();
    }
    total
}

fn bench_add(c: &mut Criterion) {
    let syms = symbols(FRAMES, "svc");
    let mut g = c.benchmark_group("add");
    g.sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));

    // --- string frames, aggregated -----------------------------------------------------------
    let frames: Vec<Frame<'_>> = syms.iter().map(|(n, f, l)| Frame::sym(n, f, *l)).collect();
    let labels = [
        Label::num("thread id", 7),
        Label::str("thread name", "worker-7"),
    ];
    let values = all_values();
    let r = recorder();
    g.bench_function("ferroprof/strings/aggregated", |b| {
        b.iter(|| r.record_sample(black_box(&frames), &values, black_box(&labels), 0))
    });
    let mut dd = DdProfile::try_new(&dd_types(), None).expect("libdd profile");
    g.bench_function("libdd/strings/aggregated", |b| {
        b.iter(|| {
            dd.try_add_sample(black_box(dd_sample(&syms, &DD_VALUES)), None)
                .expect("libdd add")
        })
    });

    // --- raw addresses (what the Rust profiler records; no libdd equivalent) ---------------
    let addrs: Vec<Frame<'_>> = (0..FRAMES as u64)
        .map(|i| Frame::Address(0x5555_0000_0000 + i * 0x1234))
        .collect();
    let r = recorder();
    g.bench_function("ferroprof/addresses/aggregated", |b| {
        b.iter(|| r.record_sample(black_box(&addrs), &values, black_box(&labels), 0))
    });

    // --- string frames, timestamped ----------------------------------------------------------
    let r = recorder();
    g.bench_function("ferroprof/strings/timestamped", |b| {
        b.iter_custom(|iters| {
            timed_batches(
                iters,
                |i| {
                    r.record_sample(&frames, &values, &labels, 1 + i as i64)
                        .expect("add")
                },
                || {
                    r.serialize(None).expect("serialize");
                },
            )
        })
    });
    let mut dd = DdProfile::try_new(&dd_types(), None).expect("libdd profile");
    g.bench_function("libdd/strings/timestamped", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut done = 0;
            while done < iters {
                let n = (iters - done).min(TIMED_BATCH);
                let t = Instant::now();
                for i in 0..n {
                    let ts = libdd_profiling::internal::Timestamp::new(1 + (done + i) as i64);
                    dd.try_add_sample(dd_sample(&syms, &DD_VALUES), ts)
                        .expect("libdd add");
                }
                total += t.elapsed();
                done += n;
                drop(dd.reset_and_return_previous().expect("reset"));
            }
            total
        })
    });

    // --- interned ids, aggregated ------------------------------------------------------------
    let r = recorder();
    let ids: Vec<(StringId, StringId, i64)> = syms
        .iter()
        .map(|(n, f, l)| {
            let s = r.strings();
            (
                s.intern(n).expect("intern"),
                s.intern(f).expect("intern"),
                *l,
            )
        })
        .collect();
    let id_frames: Vec<Frame<'_>> = ids.iter().map(|&(n, f, l)| Frame::ids(n, f, l)).collect();
    let k_tid = r.strings().intern("thread id").expect("intern");
    let k_tname = r.strings().intern("thread name").expect("intern");
    let v_tname = r.strings().intern("worker-7").expect("intern");
    let id_labels = [
        Label {
            key: Str::Id(k_tid),
            value: LabelValue::Num(7),
        },
        Label {
            key: Str::Id(k_tname),
            value: LabelValue::Str(Str::Id(v_tname)),
        },
    ];
    g.bench_function("ferroprof/ids/aggregated", |b| {
        b.iter(|| r.record_sample(black_box(&id_frames), &values, black_box(&id_labels), 0))
    });

    let storage = Arc::new(Mutex::new(ManagedStringStorage::new()));
    let dd_ids: Vec<(u32, u32, i64)> = {
        let mut st = storage.lock().expect("storage");
        syms.iter()
            .map(|(n, f, l)| {
                (
                    st.intern(n).expect("intern"),
                    st.intern(f).expect("intern"),
                    *l,
                )
            })
            .collect()
    };
    let (dk_tid, dk_tname, dv_tname) = {
        let mut st = storage.lock().expect("storage");
        (
            st.intern("thread id").expect("intern"),
            st.intern("thread name").expect("intern"),
            st.intern("worker-7").expect("intern"),
        )
    };
    let mut dd = DdProfile::try_with_string_storage(&dd_types(), None, storage.clone())
        .expect("libdd profile");
    let dd_id_sample = || api::StringIdSample {
        locations: dd_ids
            .iter()
            .map(|&(n, f, l)| api::StringIdLocation {
                function: api::StringIdFunction {
                    name: api::ManagedStringId::new(n),
                    system_name: api::ManagedStringId::empty(),
                    filename: api::ManagedStringId::new(f),
                },
                line: l,
                ..Default::default()
            })
            .collect(),
        values: &DD_VALUES,
        labels: vec![
            api::StringIdLabel {
                key: api::ManagedStringId::new(dk_tid),
                num: 7,
                ..Default::default()
            },
            api::StringIdLabel {
                key: api::ManagedStringId::new(dk_tname),
                str: api::ManagedStringId::new(dv_tname),
                ..Default::default()
            },
        ],
    };
    g.bench_function("libdd/ids/aggregated", |b| {
        b.iter(|| {
            dd.add_string_id_sample(black_box(dd_id_sample()), None)
                .expect("libdd add")
        })
    });
    g.finish();
}

// ----------------------------------------------------------------------------------------------
// Serialization

/// A stack of 18 frames: the first two make it distinct, the rest come from a shared pool.
fn distinct_stack(i: usize, pool: &[(String, String, i64)]) -> Vec<(String, String, i64)> {
    let mut out = Vec::with_capacity(FRAMES);
    out.push((
        format!("my_service::leaf::compute_{}", i % 1000),
        "/home/build/my_service/src/leaf.rs".to_owned(),
        (i % 97) as i64,
    ));
    out.push((
        format!("my_service::mid::dispatch_{}", i / 1000),
        "/home/build/my_service/src/mid.rs".to_owned(),
        (i % 13) as i64,
    ));
    for k in 2..FRAMES {
        let j = (i.wrapping_mul(2_654_435_761).rotate_left(k as u32 * 3) ^ k) % pool.len();
        out.push(pool[j].clone());
    }
    out
}

struct Workload {
    stacks: Vec<Vec<(String, String, i64)>>,
    /// (stack index, thread, timestamp) per sample; timestamp 0 = aggregated.
    samples: Vec<(usize, i64, i64)>,
}

fn timestamped_workload() -> Workload {
    let pool = symbols(60, "pool");
    let stacks: Vec<_> = (0..200).map(|i| distinct_stack(i, &pool)).collect();
    let t0 = 1_700_000_000_000_000_000i64;
    let samples = (0..1000)
        .map(|i| {
            (
                i * 7 % stacks.len(),
                (i % 8) as i64,
                t0 + i as i64 * 10_000_000,
            )
        })
        .collect();
    Workload { stacks, samples }
}

fn aggregated_workload() -> Workload {
    let pool = symbols(300, "pool");
    let stacks: Vec<_> = (0..100_000).map(|i| distinct_stack(i, &pool)).collect();
    let samples = (0..stacks.len()).map(|i| (i, (i % 8) as i64, 0)).collect();
    Workload { stacks, samples }
}

const THREAD_NAMES: [&str; 8] = ["w-0", "w-1", "w-2", "w-3", "w-4", "w-5", "w-6", "w-7"];

fn ours(w: &Workload, start: SystemTime) -> Profile {
    let mut p = Profile::new(&SampleType::ALL, None, start);
    // All 8 types enabled: the layout is the declared order, the same as libdd's.
    let values = DD_VALUES;
    for &(s, t, ts) in &w.samples {
        let frames: Vec<Frame<'_>> = w.stacks[s]
            .iter()
            .map(|(n, f, l)| Frame::sym(n, f, *l))
            .collect();
        let labels = [
            Label::num("thread id", t),
            Label::str("thread name", THREAD_NAMES[t as usize]),
        ];
        p.add(&Sample {
            frames: &frames,
            values: &values,
            labels: &labels,
            end_timestamp_ns: ts,
        })
        .expect("add");
    }
    p
}

fn libdd(w: &Workload, start: SystemTime) -> DdProfile {
    let mut p = DdProfile::try_new(&dd_types(), None)
        .expect("libdd profile")
        .with_start_time(start)
        .expect("start");
    for &(s, t, ts) in &w.samples {
        let mut sample = dd_sample(&w.stacks[s], &DD_VALUES);
        sample.labels[0].num = t;
        sample.labels[1].str = THREAD_NAMES[t as usize];
        p.try_add_sample(sample, libdd_profiling::internal::Timestamp::new(ts))
            .expect("libdd add");
    }
    p
}

fn bench_serialize_case(c: &mut Criterion, name: &str, w: &Workload, samples: usize) {
    let start = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    let end = start + Duration::from_secs(60);
    let ours_profile = ours(w, start);
    let mut codecs = vec![Compression::Gzip];
    if Compression::Zstd.is_available() {
        codecs.push(Compression::Zstd);
    }

    // Sizes, once.
    let dd_bytes = libdd(w, start)
        .serialize_into_compressed_pprof(Some(end), None)
        .expect("libdd serialize")
        .buffer;
    let mut sizes = format!("{name}: libdd(zstd-1) {} bytes", dd_bytes.len());
    for &codec in &codecs {
        let opts = EncodeOptions { compression: codec };
        let enc = ours_profile.encode(end, &opts, None).expect("encode");
        let decoded = ferroprof_pprof::decode(&enc.bytes).expect("decodes");
        assert_eq!(decoded.sample.len(), ours_profile.sample_count());
        sizes += &format!(
            ", ferroprof({codec:?}) {} bytes ({:.3}x libdd)",
            enc.bytes.len(),
            enc.bytes.len() as f64 / dd_bytes.len() as f64
        );
    }
    let raw = ours_profile
        .encode(
            end,
            &EncodeOptions {
                compression: Compression::None,
            },
            None,
        )
        .expect("encode");
    sizes += &format!(", ferroprof uncompressed {} bytes", raw.bytes.len());
    println!("SIZE {sizes}");

    let mut g = c.benchmark_group(format!("serialize/{name}"));
    g.sample_size(samples)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    for &codec in &codecs {
        let opts = EncodeOptions { compression: codec };
        g.bench_function(format!("ferroprof/{codec:?}"), |b| {
            b.iter(|| ours_profile.encode(end, &opts, None).expect("encode"))
        });
    }
    g.bench_function("libdd/zstd", |b| {
        b.iter_batched(
            || libdd(w, start),
            |p| {
                p.serialize_into_compressed_pprof(Some(end), None)
                    .expect("libdd serialize")
            },
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

fn bench_serialize(c: &mut Criterion) {
    bench_serialize_case(c, "1k_timestamped", &timestamped_workload(), 20);
    bench_serialize_case(c, "100k_aggregated", &aggregated_workload(), 10);
}

criterion_group!(benches, bench_add, bench_serialize);
criterion_main!(benches);
