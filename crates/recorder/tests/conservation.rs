//! Conservation under load: sampler threads record CPU-style and heap-style samples while a
//! serializer flips the slots about every millisecond. Every profile is read back with the
//! independent decoder; the sums over all profiles must equal the sums the samplers recorded, and
//! no sampler may get an error.
//!
//! The default test runs for a short while; `scripts/reliability.sh conservation [secs]` runs the
//! ignored long version in release mode (`FERROPROF_CONSERVATION_SECS`, default 30) and prints the
//! throughput. Nothing here asserts on time.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use ferroprof_recorder::heap::HeapConfig;
use ferroprof_recorder::{
    Frame, Label, RecorderConfig, SampleTypeConfig, SampleValues, StackRecorder,
};

/// Sample types whose values add up across profiles (the heap-live ones are snapshots).
const SUMMED: [&str; 6] = [
    "cpu-time",
    "cpu-samples",
    "wall-time",
    "alloc-samples",
    "alloc-samples-unscaled",
    "timeline",
];

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Sums([i64; 6]);

impl Sums {
    fn add(&mut self, v: &SampleValues) {
        let add = [
            v.cpu_time_ns,
            v.cpu_or_wall_samples,
            v.wall_time_ns,
            v.alloc_samples,
            v.alloc_samples_unscaled,
            v.timeline_wall_time_ns,
        ];
        for (acc, x) in self.0.iter_mut().zip(add) {
            *acc += x;
        }
    }

    fn merge(&mut self, o: &Sums) {
        for (acc, x) in self.0.iter_mut().zip(o.0) {
            *acc += x;
        }
    }
}

/// xorshift64*: deterministic per thread, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

const NAMES: [&str; 8] = [
    "main",
    "serve",
    "handle_request",
    "parse",
    "render",
    "alloc_buffer",
    "hash_map_insert",
    "compress",
];

/// One of 64 stacks of 1..=6 frames (a real program has a bounded set of hot stacks), so samples
/// both aggregate and vary.
fn stack<'a>(rng: &mut Rng, buf: &'a mut Vec<Frame<'static>>) -> &'a [Frame<'static>] {
    buf.clear();
    let mut shape = Rng(1 + rng.below(64));
    let depth = 1 + shape.below(6) as usize;
    for _ in 0..depth {
        let i = shape.below(NAMES.len() as u64) as usize;
        buf.push(Frame::sym(NAMES[i], "src/app.rs", 10 + i as i64));
    }
    buf
}

/// Samplers record in bursts and then sleep briefly: four threads spinning on two cores would
/// starve the serializer, and the point is many flips racing with samplers.
fn pace(done: u64) {
    if done % 64 == 63 {
        thread::sleep(Duration::from_micros(50));
    }
}

#[derive(Debug, Default)]
struct SamplerResult {
    recorded: u64,
    errors: u64,
    sums: Sums,
    /// Heap-style threads: (weight, size) of the objects still tracked at the end.
    live: Vec<(u32, u64)>,
}

fn cpu_sampler(rec: &StackRecorder, stop: &AtomicBool, seed: u64) -> SamplerResult {
    let mut rng = Rng(seed);
    let mut res = SamplerResult::default();
    let mut frames = Vec::new();
    let thread_name = format!("cpu-{seed}");
    while !stop.load(Ordering::Relaxed) {
        pace(res.recorded + res.errors);
        let cpu = 1 + rng.below(10_000_000) as i64;
        let values = SampleValues {
            cpu_time_ns: cpu,
            cpu_or_wall_samples: 1 + rng.below(3) as i64,
            wall_time_ns: cpu + rng.below(1_000_000) as i64,
            timeline_wall_time_ns: cpu,
            ..SampleValues::default()
        };
        // One in 64 samples is timestamped (kept one by one, not aggregated).
        let ts = if rng.below(64) == 0 {
            1_700_000_000_000_000_000 + rng.below(1 << 40) as i64
        } else {
            0
        };
        let labels = [
            Label::num("thread id", seed as i64),
            Label::str("thread name", &thread_name),
        ];
        match rec.record_sample(stack(&mut rng, &mut frames), &values, &labels, ts) {
            Ok(()) => {
                res.recorded += 1;
                res.sums.add(&values);
            }
            Err(e) => {
                eprintln!("cpu sampler error: {e}");
                res.errors += 1;
            }
        }
    }
    res
}

fn heap_sampler(rec: &StackRecorder, stop: &AtomicBool, seed: u64) -> SamplerResult {
    const MAX_LIVE: usize = 512;
    let mut rng = Rng(seed);
    let mut res = SamplerResult::default();
    let mut frames = Vec::new();
    // Ids are unique per thread (high bits) and never reused while tracked.
    let mut next_id = seed << 40;
    let mut live: std::collections::VecDeque<(u64, u32, u64)> = Default::default();
    let classes = ["Vec<u8>", "String", "HashMap", ""];
    while !stop.load(Ordering::Relaxed) {
        pace(res.recorded + res.errors);
        if live.len() >= MAX_LIVE || (rng.below(3) == 0 && !live.is_empty()) {
            let idx = rng.below(live.len() as u64) as usize;
            if let Some((id, _, _)) = live.swap_remove_back(idx) {
                assert!(rec.untrack_allocation(id), "tracked id {id} not found");
            }
        }
        let id = next_id;
        next_id += 1;
        let weight = 1 + rng.below(4) as u32;
        let size = 16 + rng.below(4096);
        let class = classes[rng.below(classes.len() as u64) as usize];
        let frames = stack(&mut rng, &mut frames);
        match rec.track_allocation(id, weight, size, Some(class), frames) {
            Ok(()) => live.push_back((id, weight, size)),
            Err(e) => {
                eprintln!("heap sampler track error: {e}");
                res.errors += 1;
                continue;
            }
        }
        let values = SampleValues {
            alloc_samples: i64::from(weight),
            alloc_samples_unscaled: 1,
            ..SampleValues::default()
        };
        let labels = [Label::num("thread id", seed as i64)];
        match rec.record_sample(frames, &values, &labels, 0) {
            Ok(()) => {
                res.recorded += 1;
                res.sums.add(&values);
            }
            Err(e) => {
                eprintln!("heap sampler error: {e}");
                res.errors += 1;
            }
        }
    }
    res.live = live.into_iter().map(|(_, w, s)| (w, s)).collect();
    res
}

#[derive(Debug)]
struct Report {
    elapsed: Duration,
    samples: u64,
    errors: u64,
    profiles: u64,
    recorded: Sums,
    serialized: Sums,
}

fn totals(p: &ferroprof_pprof::Profile) -> Sums {
    let mut s = Sums::default();
    for (i, name) in SUMMED.iter().enumerate() {
        s.0[i] = p.total(name).expect("sample type present");
    }
    s
}

fn run(duration: Duration) -> Report {
    let config = RecorderConfig {
        sample_types: SampleTypeConfig::all(),
        heap: HeapConfig::native(),
        ..RecorderConfig::default()
    };
    let rec = Arc::new(StackRecorder::new(config).expect("recorder"));
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let handles: Vec<_> = (1..=4u64)
        .map(|seed| {
            let (rec, stop) = (rec.clone(), stop.clone());
            thread::Builder::new()
                .name(format!("sampler-{seed}"))
                .spawn(move || {
                    if seed % 2 == 1 {
                        cpu_sampler(&rec, &stop, seed)
                    } else {
                        heap_sampler(&rec, &stop, seed)
                    }
                })
                .expect("spawn")
        })
        .collect();

    let mut serialized = Sums::default();
    let mut profiles = 0u64;
    let mut serialize = |rec: &StackRecorder| {
        let p = rec.serialize(None).expect("serialize");
        let decoded = ferroprof_pprof::decode(&p.encoded.bytes).expect("decodes");
        serialized.merge(&totals(&decoded));
        profiles += 1;
        decoded
    };
    // One flip per millisecond, or back to back when a serialization takes longer than that.
    let mut next = started;
    while started.elapsed() < duration {
        next += Duration::from_millis(1);
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            thread::sleep(wait);
        } else {
            next = Instant::now();
        }
        serialize(&rec);
    }
    stop.store(true, Ordering::Relaxed);
    let results: Vec<SamplerResult> = handles
        .into_iter()
        .map(|h| h.join().expect("sampler thread"))
        .collect();
    let elapsed = started.elapsed();
    let life = rec.stats().lifetime;
    println!(
        "serialization: avg {:.0} us, max {:.0} us",
        life.serialization_time_ns_avg.unwrap_or(0.0) / 1e3,
        life.serialization_time_ns_max.unwrap_or(0) as f64 / 1e3
    );
    // Whatever landed after the last flip is in the active slot: one more serialization.
    let last = serialize(&rec);

    // The last profile's live heap is exactly what the heap samplers still track.
    let live: Vec<(u32, u64)> = results.iter().flat_map(|r| r.live.clone()).collect();
    let live_samples: i64 = live.iter().map(|&(w, _)| i64::from(w)).sum();
    let live_size: i64 = live.iter().map(|&(w, s)| i64::from(w) * s as i64).sum();
    assert_eq!(last.total("heap-live-samples"), Some(live_samples));
    assert_eq!(last.total("heap-live-size"), Some(live_size));

    let mut recorded = Sums::default();
    for r in &results {
        recorded.merge(&r.sums);
    }
    Report {
        elapsed,
        samples: results.iter().map(|r| r.recorded).sum(),
        errors: results.iter().map(|r| r.errors).sum(),
        profiles,
        recorded,
        serialized,
    }
}

fn check(report: &Report) {
    println!(
        "conservation: 4 samplers, {:.1} s, {} samples ({:.0} samples/s), {} profiles ({:.0}/s), {} errors",
        report.elapsed.as_secs_f64(),
        report.samples,
        report.samples as f64 / report.elapsed.as_secs_f64(),
        report.profiles,
        report.profiles as f64 / report.elapsed.as_secs_f64(),
        report.errors
    );
    assert_eq!(report.errors, 0, "sampler errors");
    assert!(report.samples > 0 && report.profiles > 1);
    for (i, name) in SUMMED.iter().enumerate() {
        assert_eq!(
            report.serialized.0[i], report.recorded.0[i],
            "{name}: serialized total differs from recorded total"
        );
    }
}

#[test]
fn conservation_short() {
    check(&run(Duration::from_millis(1500)));
}

#[test]
#[ignore = "long run: scripts/reliability.sh conservation [secs]"]
fn conservation_long() {
    let secs: f64 = std::env::var("FERROPROF_CONSERVATION_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30.0);
    check(&run(Duration::from_secs_f64(secs)));
}
