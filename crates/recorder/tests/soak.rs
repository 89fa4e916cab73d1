//! Soak: thousands of serialize cycles with churning content. Every cycle records samples whose
//! function names, files, label values, endpoints and heap classes are new (and drops the previous
//! cycle's), and live heap objects die and are born, with a steady live set. Resident memory, the
//! string storage and the heap recorder must stay flat.
//!
//! The default test runs 1,000 cycles; `scripts/reliability.sh soak [cycles]` runs the ignored long
//! version in release mode (`FERROPROF_SOAK_CYCLES`, default 10,000) and prints first vs last.

use std::collections::VecDeque;

use ferroprof_recorder::heap::HeapConfig;
use ferroprof_recorder::{
    Frame, Label, RecorderConfig, SampleTypeConfig, SampleValues, StackRecorder,
};

/// Samples recorded per cycle.
const SAMPLES: usize = 40;
/// Objects born per cycle; each lives `LIFETIME` cycles, so about `BORN * LIFETIME` are live.
const BORN: u64 = 16;
const LIFETIME: u64 = 8;

/// Resident set size in bytes, from /proc/self/status (0 where that file does not exist).
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

#[derive(Debug, Clone, Copy)]
struct Snapshot {
    cycle: u64,
    rss: u64,
    strings: usize,
    string_bytes: usize,
    heap_objects: u64,
    heap_stacks: u64,
    profile_bytes: usize,
}

fn snapshot(cycle: u64, rec: &StackRecorder, profile_bytes: usize) -> Snapshot {
    let heap = rec.stats().heap.expect("heap enabled");
    Snapshot {
        cycle,
        rss: rss_bytes(),
        strings: rec.strings().len(),
        string_bytes: rec.strings().memory_bytes(),
        heap_objects: heap.num_object_records,
        heap_stacks: heap.num_heap_records,
        profile_bytes,
    }
}

fn print(label: &str, s: &Snapshot) {
    println!(
        "soak {label:>6} (cycle {:>6}): rss {:>8.1} MiB, strings {:>5} ({:>7} B), heap objects {:>4}, heap stacks {:>4}, profile {:>6} B",
        s.cycle,
        s.rss as f64 / (1 << 20) as f64,
        s.strings,
        s.string_bytes,
        s.heap_objects,
        s.heap_stacks,
        s.profile_bytes
    );
}

/// Runs `cycles` cycles; returns (after warm-up, last) snapshots.
fn run(cycles: u64) -> (Snapshot, Snapshot) {
    let config = RecorderConfig {
        sample_types: SampleTypeConfig::all(),
        heap: HeapConfig::native(),
        ..RecorderConfig::default()
    };
    let rec = StackRecorder::new(config).expect("recorder");
    let warm_up = (cycles / 10).max(1);
    let mut live: VecDeque<(u64, u64)> = VecDeque::new(); // (born cycle, id)
    let mut next_id = 1u64;
    let mut first = None;
    let mut last = None;
    for cycle in 0..cycles {
        // Names unique to this cycle: yesterday's strings must all go away.
        let funcs: Vec<String> = (0..4)
            .map(|i| format!("app::handler_{cycle}_{i}"))
            .collect();
        let file = format!("src/gen/module_{cycle}.rs");
        let span = format!("span-{cycle}");
        // A frame given by id of the shared storage; the id is released after recording, as a
        // caller that interns its own strings would do.
        let by_id = rec
            .strings()
            .intern(&format!("interned_{cycle}"))
            .expect("intern");
        for i in 0..SAMPLES {
            let frames = [
                Frame::sym(&funcs[i % 4], &file, i as i64),
                Frame::ids(by_id, by_id, 1),
                Frame::sym("main", "src/main.rs", 1),
            ];
            let labels = [
                Label::str("span name", &span),
                Label::num("local root span id", (i % 3) as i64),
            ];
            let values = SampleValues {
                cpu_time_ns: 1_000,
                cpu_or_wall_samples: 1,
                wall_time_ns: 2_000,
                alloc_samples: 1,
                timeline_wall_time_ns: 5,
                ..SampleValues::default()
            };
            let ts = if i % 8 == 0 {
                1_700_000_000_000_000_000
            } else {
                0
            };
            rec.record_sample(&frames, &values, &labels, ts)
                .expect("record");
        }
        rec.record_endpoint(1, &format!("GET /items/{cycle}"))
            .expect("endpoint");
        rec.strings().unintern(by_id).expect("own reference");

        // Objects born this cycle (new stacks and classes), the oldest die.
        for k in 0..BORN {
            let frames = [
                Frame::sym(&funcs[(k % 4) as usize], &file, k as i64),
                Frame::sym("alloc_site", "src/alloc.rs", 7),
            ];
            let class = format!("Class{cycle}");
            rec.track_allocation(next_id, 1, 64 + k, Some(&class), &frames)
                .expect("track");
            live.push_back((cycle, next_id));
            next_id += 1;
        }
        while live
            .front()
            .is_some_and(|&(born, _)| born + LIFETIME <= cycle)
        {
            let (_, id) = live.pop_front().expect("front exists");
            assert!(rec.untrack_allocation(id));
        }

        let p = rec.serialize(None).expect("serialize");
        if cycle % 500 == 0 || cycle + 1 == cycles {
            let d = ferroprof_pprof::decode(&p.encoded.bytes).expect("valid profile");
            assert_eq!(d.total("cpu-samples"), Some(SAMPLES as i64));
            assert_eq!(
                d.total("heap-live-samples"),
                Some(live.len() as i64),
                "every live object, once"
            );
        }
        let s = snapshot(cycle, &rec, p.encoded.bytes.len());
        if cycle == 0 {
            print("first", &s);
        }
        if cycle + 1 == warm_up {
            print("warm", &s);
            first = Some(s);
        }
        last = Some(s);
    }
    let (first, last) = (first.expect("warm-up ran"), last.expect("cycles ran"));
    print("last", &last);
    (first, last)
}

fn check(first: &Snapshot, last: &Snapshot) {
    // Steady state: the live set and what it references is the same size every cycle.
    let live = (BORN * LIFETIME) as usize;
    assert!(
        last.strings <= first.strings + 16 && last.strings <= 4 * live,
        "strings grew: {} -> {}",
        first.strings,
        last.strings
    );
    assert!(
        last.string_bytes <= 2 * first.string_bytes + 64 * 1024,
        "string storage grew: {} -> {} bytes",
        first.string_bytes,
        last.string_bytes
    );
    assert_eq!(last.heap_objects, first.heap_objects, "live set is steady");
    assert!(
        last.heap_stacks <= first.heap_stacks + 4,
        "heap stacks grew: {} -> {}",
        first.heap_stacks,
        last.heap_stacks
    );
    // Generous: allocator caching and fragmentation move RSS a little, a leak of even a few
    // hundred bytes per cycle does not stay under this over thousands of cycles.
    assert!(
        last.rss <= first.rss + 32 * 1024 * 1024,
        "RSS grew: {} -> {} bytes",
        first.rss,
        last.rss
    );
}

#[test]
fn soak_short() {
    let (first, last) = run(1_000);
    check(&first, &last);
}

#[test]
#[ignore = "long run: scripts/reliability.sh soak [cycles]"]
fn soak_long() {
    let cycles: u64 = std::env::var("FERROPROF_SOAK_CYCLES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000);
    let (first, last) = run(cycles);
    check(&first, &last);
}
