//! The in-flight profile's memory cap (`RecorderConfig::max_profile_bytes`), through the stack
//! recorder and checked on the decoded pprof. Memory is measured with a counting global
//! allocator; the tests take a lock so only one allocates at a time.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Mutex;

use ferroprof_recorder::{
    Frame, HeapConfig, Label, RecorderConfig, SampleTypeConfig, SampleValues, StackRecorder,
    DROPPED_STACKS_FRAME,
};

struct Counting;

static LIVE_BYTES: AtomicIsize = AtomicIsize::new(0);
static PEAK_BYTES: AtomicIsize = AtomicIsize::new(0);

fn note(delta: isize) {
    let now = LIVE_BYTES.fetch_add(delta, Ordering::Relaxed) + delta;
    PEAK_BYTES.fetch_max(now, Ordering::Relaxed);
}

// SAFETY: every call forwards to `System` with the caller's arguments unchanged; the counters
// are bookkeeping only.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size() as isize);
        // SAFETY: same contract as our caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        note(-(layout.size() as isize));
        // SAFETY: `ptr` came from `System` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size as isize - layout.size() as isize);
        // SAFETY: same contract as our caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

const CAP: u64 = 4 << 20;

/// A stack distinct for every `i`: a recursion whose depth and frames follow `i`'s digits.
fn distinct_stack(i: u64, out: &mut Vec<Frame<'static>>) {
    out.clear();
    out.push(Frame::Address(0x10_0000 + (i % 13) * 16));
    let mut x = i;
    loop {
        out.push(Frame::Address(0x20_0000 + (x % 10) * 16));
        x /= 10;
        if x == 0 {
            break;
        }
    }
    out.extend((0..8).map(|d| Frame::Address(0x30_0000 + d * 64)));
}

fn dropped_and_total(d: &ferroprof_pprof::Profile, ty: &str) -> (i64, i64) {
    let k = d.value_index(ty).unwrap();
    let (mut dropped, mut total) = (0, 0);
    for s in &d.sample {
        total += s.value[k];
        if d.stack_names(s) == [DROPPED_STACKS_FRAME] {
            dropped += s.value[k];
        }
    }
    (dropped, total)
}

#[test]
fn distinct_stacks_stay_under_the_cap_and_fold_into_the_marked_frame() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let r = StackRecorder::new(RecorderConfig {
        sample_types: SampleTypeConfig {
            heap_samples: false,
            heap_size: false,
            ..SampleTypeConfig::all()
        },
        max_profile_bytes: Some(CAP),
        ..RecorderConfig::default()
    })
    .unwrap();
    let labels = [Label::num("thread id", 7)];
    let values = |i: u64| SampleValues {
        alloc_samples: 1 + (i % 5) as i64,
        alloc_samples_unscaled: 1,
        ..SampleValues::default()
    };
    let mut frames = Vec::new();
    let base = LIVE_BYTES.load(Ordering::Relaxed);
    PEAK_BYTES.store(base, Ordering::Relaxed);
    let n = 300_000u64;
    for i in 0..n {
        distinct_stack(i, &mut frames);
        r.record_sample(&frames, &values(i), &labels, 0).unwrap();
    }
    // Stacks recorded before the cap keep aggregating.
    for i in 0..10 {
        distinct_stack(i, &mut frames);
        r.record_sample(&frames, &values(i), &labels, 0).unwrap();
    }
    let grown = PEAK_BYTES.load(Ordering::Relaxed) - base;
    // The profile's tables, plus the caller's frames vector and small change.
    assert!(
        grown <= CAP as isize + (256 << 10),
        "recording grew memory by {grown} bytes with a {CAP}-byte cap"
    );
    let dropped = r.dropped_stacks();
    assert!(dropped > n / 2, "{dropped} samples folded");
    let p = r.serialize(None).unwrap();
    assert_eq!(p.stats.dropped_stacks, dropped);
    assert_eq!(r.stats().dropped_stacks, dropped);
    assert_eq!(p.stats.recorded_samples, n + 10);

    let d = ferroprof_pprof::decode(&p.encoded.bytes).unwrap();
    let (dropped_unscaled, total_unscaled) = dropped_and_total(&d, "alloc-samples-unscaled");
    assert_eq!(
        total_unscaled,
        (n + 10) as i64,
        "every sample is in the profile"
    );
    assert_eq!(dropped_unscaled, dropped as i64);
    let (_, total) = dropped_and_total(&d, "alloc-samples");
    let want: i64 = (0..n).chain(0..10).map(|i| values(i).alloc_samples).sum();
    assert_eq!(total, want);
    let marked: Vec<_> = d
        .sample
        .iter()
        .filter(|s| d.stack_names(s) == [DROPPED_STACKS_FRAME])
        .collect();
    assert_eq!(marked.len(), 1);
    // The label set existed, so the folded samples keep it.
    assert_eq!(d.label_num(marked[0], "thread id"), Some(7));
    // The first stacks were added twice.
    let k = d.value_index("alloc-samples-unscaled").unwrap();
    let twice = d.sample.iter().filter(|s| s.value[k] == 2).count();
    assert_eq!(twice, 10);

    // The next profile starts empty, with the cap.
    let q = r.serialize(None).unwrap();
    assert_eq!(q.stats.dropped_stacks, 0);
    assert_eq!(r.stats().dropped_stacks, dropped);
}

#[test]
fn heap_rows_added_at_serialization_respect_the_cap() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let r = StackRecorder::new(RecorderConfig {
        heap: HeapConfig::native(),
        max_profile_bytes: Some(CAP),
        ..RecorderConfig::default()
    })
    .unwrap();
    let mut frames = Vec::new();
    let n = 100_000u64;
    for i in 0..n {
        distinct_stack(i, &mut frames);
        r.track_allocation(0x1000 + i * 16, 3, 64, None, &frames)
            .unwrap();
    }
    let p = r.serialize(None).unwrap();
    let dropped = p.stats.dropped_stacks;
    assert!(dropped > 0 && dropped < n, "{dropped} of {n} folded");
    assert_eq!(r.stats().dropped_stacks, dropped);
    let d = ferroprof_pprof::decode(&p.encoded.bytes).unwrap();
    let (dropped_samples, total_samples) = dropped_and_total(&d, "heap-live-samples");
    assert_eq!(total_samples, 3 * n as i64);
    assert_eq!(dropped_samples, 3 * dropped as i64);
    let (_, total_size) = dropped_and_total(&d, "heap-live-size");
    assert_eq!(total_size, 3 * 64 * n as i64);
}
