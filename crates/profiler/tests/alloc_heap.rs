//! Allocation and live-heap profiling with `SamplingAllocator` as the global allocator, checked
//! against a program whose allocations are known exactly.

mod profiler_support;

use std::alloc::System;
use std::sync::Mutex;
use std::time::Duration;

use ferroprof::{Profiler, Profiles, SamplingAllocator};
use ferroprof_pprof::{Profile, Sample};
use profiler_support::*;

#[global_allocator]
static GLOBAL: SamplingAllocator<System> = SamplingAllocator::new(System);

static LOCK: Mutex<()> = Mutex::new(());

const MIB: usize = 1 << 20;
/// Small enough that a 32 MiB live set gets ~2000 samples: a 10% bound is > 4 sigma.
const INTERVAL: u64 = 16 * 1024;

fn alloc_heap() -> Profiles {
    Profiles {
        cpu: false,
        wall: false,
        alloc: true,
        heap: true,
    }
}

/// The live set: `n` blocks of 1 KiB, kept by the caller.
#[inline(never)]
fn keep_live(out: &mut Vec<Vec<u8>>, n: usize) {
    for i in 0..n {
        out.push(vec![i as u8; 1024]);
    }
}

/// Allocations freed right away: `n` blocks of 16..=1040 bytes. Returns the bytes allocated.
#[inline(never)]
fn churn(n: usize) -> usize {
    let mut total = 0;
    let mut r = 0x2545_F491_4F6C_DD1Du64;
    let mut ring: Vec<Option<Vec<u8>>> = (0..64).map(|_| None).collect();
    for i in 0..n {
        r ^= r << 13;
        r ^= r >> 7;
        r ^= r << 17;
        let size = 16 + (r % 1025) as usize;
        total += size;
        // Kept briefly (64 allocations) so frees interleave with allocations.
        ring[i % 64] = Some(std::hint::black_box(vec![0u8; size]));
    }
    drop(ring);
    total
}

/// A buffer grown by reallocation to exactly 8 MiB.
#[inline(never)]
fn grow_by_realloc() -> Vec<u8> {
    let mut v: Vec<u8> = Vec::new();
    for i in 0..8 * MIB {
        v.push(i as u8);
    }
    v
}

/// A 4 MiB block shrunk in place or moved by realloc to 1 KiB.
#[inline(never)]
fn shrink_by_realloc() -> Vec<u8> {
    let mut v = vec![1u8; 4 * MIB];
    v.truncate(1024);
    v.shrink_to_fit();
    v
}

fn live(p: &Profile, f: &str) -> i64 {
    sum_where(p, "heap-live-size", |p, s| has_fn(p, s, f))
}

fn frames_mention(p: &Profile, s: &Sample, what: &str) -> bool {
    p.stack(s).iter().any(|l| l.function.contains(what))
}

fn heap_now(guard: &ferroprof::ProfilerGuard) -> Profile {
    let bytes = guard.profile_source().heap_profile().expect("heap profile");
    ferroprof_pprof::decode(&bytes).expect("heap profile decodes")
}

#[test]
fn live_heap_and_allocation_counts_match_the_truth() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("alloc-heap");
    let guard = Profiler::builder()
        .service("alloc-test")
        .profiles(alloc_heap())
        .alloc_interval_bytes(INTERVAL)
        .period(Duration::from_secs(600))
        .output_dir(&dir)
        .start()
        .expect("profiler starts");
    assert!(guard.allocator_installed());

    let n_live = 32 * 1024; // 32 MiB of 1 KiB blocks
    let mut kept = Vec::with_capacity(n_live);
    keep_live(&mut kept, n_live);
    let n_churn = 100_000;
    let churned = churn(n_churn);
    let grown = grow_by_realloc();
    let shrunk = shrink_by_realloc();

    // Live heap right now, through the profile source.
    let stats = guard.stats();
    let p = heap_now(&guard);
    // The running estimate of the live heap is the profile's heap-live-size total, up to what
    // was sampled between the two reads (a few samples of ~16 KiB at most, against 40 MiB);
    // a record untracked without its bytes (realloc's moves, the churn) would be megabytes.
    let total = sum_where(&p, "heap-live-size", |_, _| true) as f64;
    let running = stats.heap_live_estimate_bytes as f64;
    assert!(
        (running - total).abs() <= 0.01 * total,
        "running estimate {running} vs the profile's {total}"
    );
    assert!(stats.heap_peak_estimate_bytes >= stats.heap_live_estimate_bytes);
    let truth = (n_live * 1024) as f64;
    let kl = live(&p, "keep_live") as f64;
    eprintln!(
        "keep_live live estimate {:.1} MiB vs {:.1} MiB; churn live {}; grow live {}; shrink live {}",
        kl / MIB as f64,
        truth / MIB as f64,
        live(&p, "churn"),
        live(&p, "grow_by_realloc"),
        live(&p, "shrink_by_realloc")
    );
    assert!(
        (kl / truth - 1.0).abs() < 0.10,
        "keep_live live {kl} vs {truth}"
    );
    assert!(
        (live(&p, "churn") as f64) < 0.01 * truth,
        "freed churn shows as live"
    );
    // Grown by realloc: only the final 8 MiB block is live (a block far larger than the
    // interval is sampled with weight ~1), the moved-from blocks were untracked.
    let g = live(&p, "grow_by_realloc") as f64;
    assert!((g / (8 * MIB) as f64 - 1.0).abs() < 0.01, "grown live {g}");
    // Shrunk by realloc: the 4 MiB record left with the old block.
    assert!(
        live(&p, "shrink_by_realloc") < (64 * 1024) as i64,
        "shrunk block still counted at its old size"
    );

    // Stacks name the allocating function with file and line.
    let s = p
        .sample
        .iter()
        .find(|s| has_fn(&p, s, "keep_live"))
        .expect("keep_live sample");
    let frame = p
        .stack(s)
        .into_iter()
        .find(|l| l.function.ends_with("keep_live"))
        .unwrap();
    assert!(frame.filename.ends_with("alloc_heap.rs"), "{frame:?}");
    assert!(frame.line > 0);

    // Freeing the live set untracks every record: nothing is lost by the free filter.
    drop(kept);
    let p = heap_now(&guard);
    assert_eq!(live(&p, "keep_live"), 0, "freed blocks still tracked");
    // The frees took keep_live's bytes back from the running estimate; its peak stays.
    let after = guard.stats();
    assert!(
        (after.heap_live_estimate_bytes as f64) < running - 0.9 * kl,
        "running estimate {} after freeing {kl} of {running}",
        after.heap_live_estimate_bytes
    );
    assert!(after.heap_peak_estimate_bytes >= stats.heap_live_estimate_bytes);

    guard.stop().expect("stop");
    drop((grown, shrunk));

    // The exported file, read by the independent decoder.
    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "pprof"))
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let name = files[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("alloc-test-") && name.ends_with("Z.pprof"),
        "{name}"
    );
    let p = ferroprof_pprof::decode(&std::fs::read(&files[0]).unwrap()).unwrap();
    for t in [
        "alloc-samples",
        "alloc-samples-unscaled",
        "heap-live-samples",
        "heap-live-size",
    ] {
        assert!(p.value_index(t).is_some(), "{t} missing");
    }
    // alloc-samples estimates allocation counts without bias.
    let est_churn = sum_where(&p, "alloc-samples", |p, s| has_fn(p, s, "churn"));
    let est_live = sum_where(&p, "alloc-samples", |p, s| has_fn(p, s, "keep_live"));
    eprintln!(
        "alloc-samples: churn {est_churn} vs {n_churn} ({} bytes), keep_live {est_live} vs {n_live}",
        churned
    );
    assert!(
        (est_churn as f64 / n_churn as f64 - 1.0).abs() < 0.10,
        "churn count {est_churn} vs {n_churn}"
    );
    assert!(
        (est_live as f64 / n_live as f64 - 1.0).abs() < 0.10,
        "keep_live count {est_live} vs {n_live}"
    );
    let unscaled = sum_where(&p, "alloc-samples-unscaled", |p, s| has_fn(p, s, "churn"));
    assert!(unscaled > 0 && unscaled < est_churn, "unscaled {unscaled}");
    // The live set was freed before the export: no live heap left at keep_live.
    assert_eq!(live(&p, "keep_live"), 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_profilers_own_allocations_are_never_sampled() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let c = Collect::default();
    // Every profile on, a small interval and a fast sampler: the sampler and export threads
    // allocate constantly while recording and symbolizing.
    let guard = Profiler::builder()
        .service("reentrancy-test")
        .profiles(Profiles::all())
        .cpu_hz(500)
        .alloc_interval_bytes(1024)
        .period(Duration::from_millis(200))
        .exporter(Box::new(c.clone()))
        .start()
        .unwrap();
    let until = std::time::Instant::now() + Duration::from_secs(1);
    let mut n = 0;
    while std::time::Instant::now() < until {
        n += churn(1000);
    }
    let _ = guard.profile_source().heap_profile().unwrap();
    guard.stop().unwrap();
    assert!(n > 0);
    let ps = c.decoded();
    assert!(ps.len() >= 2, "{} profiles", ps.len());
    let mut app = 0;
    for p in &ps {
        for s in &p.sample {
            let Some(i) = p.value_index("alloc-samples-unscaled") else {
                continue;
            };
            if s.value[i] == 0 {
                continue;
            }
            // Allocation stacks start at the allocating code; a frame of the profiler on a
            // sampled stack would be the profiler sampling itself.
            let names = p.stack_names(s);
            let internal = [
                "ferroprof::sampler",
                "ferroprof::profiler",
                "ferroprof::symbolize",
                "ferroprof::state",
                "ferroprof::unwind",
                "ferroprof_recorder::",
                "addr2line::",
                "gimli::",
            ];
            assert!(
                !names
                    .iter()
                    .any(|n| internal.iter().any(|bad| n.starts_with(bad))),
                "profiler allocation sampled: {names:?}"
            );
            if frames_mention(p, s, "churn") {
                app += s.value[i];
            }
        }
    }
    assert!(
        app > 100,
        "the application's allocations are sampled ({app})"
    );
}

#[test]
fn allocation_capture_sees_its_window_without_stealing() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let c = Collect::default();
    let guard = Profiler::builder()
        .profiles(alloc_heap())
        .alloc_interval_bytes(INTERVAL)
        .period(Duration::from_secs(600))
        .exporter(Box::new(c.clone()))
        .start()
        .unwrap();
    let src = guard.profile_source();
    let capture = std::thread::spawn(move || src.allocs_profile(Duration::from_millis(400)));
    // Churn before, during and after the capture window.
    let t0 = std::time::Instant::now();
    let mut calls = 0usize;
    while t0.elapsed() < Duration::from_millis(800) {
        churn(1000);
        calls += 1000;
    }
    let bytes = capture.join().unwrap().expect("allocs capture");
    guard.stop().unwrap();
    let tap = ferroprof_pprof::decode(&bytes).unwrap();
    let in_window = sum_where(&tap, "alloc-samples", |p, s| has_fn(p, s, "churn"));
    let ps = c.decoded();
    let total = sum_all(&ps, "alloc-samples", |p, s| has_fn(p, s, "churn"));
    eprintln!("churn allocations {calls}: exported estimate {total}, 400 ms window {in_window}");
    assert!(in_window > 0 && in_window < total);
    assert!(
        (total as f64 / calls as f64 - 1.0).abs() < 0.1,
        "the periodic profile keeps every sample: {total} vs {calls}"
    );
    assert!(tap.value_index("heap-live-size").is_none());
}

/// `profiles = heap` alone: the live heap is profiled, the allocation types are not written.
#[test]
fn heap_profiling_alone_tracks_the_live_heap() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("heap-only");
    let guard = Profiler::builder()
        .service("heap-only")
        .profiles(Profiles {
            cpu: false,
            wall: false,
            alloc: false,
            heap: true,
        })
        .alloc_interval_bytes(INTERVAL)
        .period(Duration::from_secs(600))
        .output_dir(&dir)
        .start()
        .expect("profiler starts");

    let n_live = 16 * 1024; // 16 MiB of 1 KiB blocks: ~1000 samples at 16 KiB
    let mut kept = Vec::with_capacity(n_live);
    keep_live(&mut kept, n_live);

    let p = heap_now(&guard);
    let truth = (n_live * 1024) as f64;
    let kl = live(&p, "keep_live") as f64;
    assert!(
        (kl / truth - 1.0).abs() < 0.15,
        "heap-only: keep_live live {kl} vs {truth}"
    );
    guard.stop().expect("stop");
    drop(kept);

    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "pprof"))
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let p = ferroprof_pprof::decode(&std::fs::read(&files[0]).unwrap()).unwrap();
    assert!(
        p.value_index("alloc-samples").is_none(),
        "alloc off, yet alloc-samples written"
    );
    let written = sum_where(&p, "heap-live-size", |p, s| has_fn(p, s, "keep_live")) as f64;
    assert!(
        (written / truth - 1.0).abs() < 0.15,
        "heap-only file: keep_live live {written} vs {truth}"
    );
}

/// A forked child's `/heap` allocation columns start at the fork: what the parent allocated
/// before is not the child's. Its live heap is the memory it inherited.
#[test]
fn a_forked_childs_allocation_totals_start_at_the_fork() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("fork-totals");
    let guard = Profiler::builder()
        .service("fork-totals")
        .profiles(alloc_heap())
        .alloc_interval_bytes(INTERVAL)
        .period(Duration::from_secs(600))
        .output_dir(&dir)
        .start()
        .expect("profiler starts");
    let churned = churn(50_000);
    let mut kept = Vec::with_capacity(8 * 1024);
    keep_live(&mut kept, 8 * 1024);
    let space = |p: &Profile, f: &str| sum_where(p, "alloc-space", |p, s| has_fn(p, s, f));
    let before = heap_now(&guard);
    assert!(
        space(&before, "churn") as f64 > 0.8 * churned as f64,
        "parent: churn alloc-space {} of {churned}",
        space(&before, "churn")
    );

    // SAFETY: the child runs the profiler's code and ours, then leaves with _exit.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let p = heap_now(&guard);
        let (child_churn, child_live) = (space(&p, "churn"), live(&p, "keep_live"));
        eprintln!("child: churn alloc-space {child_churn}, keep_live live {child_live}");
        let ok = child_churn == 0 && child_live > 0;
        // SAFETY: leave the child without running the test harness's exit path.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "child crashed: status {status}");
    assert_eq!(
        libc::WEXITSTATUS(status),
        0,
        "the child's heap profile is wrong"
    );
    drop(kept);
    guard.stop().expect("stop");
}
