//! Memory the profiler adds right after start (budget: 10 MB of RSS).

mod profiler_support;

use std::time::Duration;

use ferroprof::{Profiler, Profiles, SamplingAllocator};
use profiler_support::thread_cpu;

#[global_allocator]
static GLOBAL: SamplingAllocator<std::alloc::System> = SamplingAllocator::new(std::alloc::System);

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    // SAFETY: sysconf has no preconditions.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64
}

/// The tests of this file measure the whole process: one at a time.
static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn starting_the_profiler_adds_less_than_10_mb_of_rss() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let before = rss_bytes();
    let dir = std::env::temp_dir().join(format!("ferroprof-rss-{}", std::process::id()));
    let guard = Profiler::builder()
        .profiles(Profiles::all())
        .output_dir(&dir)
        .start()
        .unwrap();
    // Let the sampler run a few ticks (first stack captures, maps snapshot).
    std::thread::sleep(Duration::from_millis(300));
    let after = rss_bytes();
    let added = after.saturating_sub(before);
    eprintln!(
        "RSS before {before} after {after}: +{:.2} MB",
        added as f64 / 1e6
    );
    guard.stop().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(added < 10_000_000, "profiler added {added} bytes of RSS");
}

#[inline(never)]
fn spread_work(round: u64) -> u64 {
    // Many call sites, so that each export has addresses to symbolize.
    let mut v: Vec<String> = (0..2000).map(|i| format!("{round}-{i}")).collect();
    v.sort();
    let m: std::collections::BTreeMap<String, usize> = v.iter().cloned().zip(0..).collect();
    let s: u64 = m.keys().map(|k| k.len() as u64).sum();
    std::hint::black_box(s)
}

/// An export parses the debug info of this binary (tens of MB of tables) and frees it. That
/// memory used to stay resident in the C allocator after every export; it now lives in the
/// profiler's private arena and goes back to the system at the end of the export.
#[test]
fn exports_leave_their_symbolization_memory_behind_no_more() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("ferroprof-rss-export-{}", std::process::id()));
    let guard = Profiler::builder()
        .profiles(Profiles::all())
        .alloc_interval_bytes(4096)
        .output_dir(&dir)
        .start()
        .unwrap();
    // CPU time of this thread, so that every export has samples to symbolize on a loaded
    // machine too.
    let work = |round| {
        let end = thread_cpu() + Duration::from_millis(300);
        while thread_cpu() < end {
            spread_work(round);
        }
    };
    work(0);
    let before = rss_bytes();
    for round in 1..4 {
        guard.flush().unwrap();
        work(round);
    }
    guard.flush().unwrap();
    let after = rss_bytes();
    let st = guard.stats();
    guard.stop().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!(
        "RSS before the first export {:.1} MB, after four {:.1} MB; arena {:.1} MB, \
         {} addresses symbolized",
        before as f64 / 1e6,
        after as f64 / 1e6,
        st.symbolizer_arena_bytes as f64 / 1e6,
        st.symbolized_addresses
    );
    assert!(st.symbolized_addresses > 0, "{st:?}");
    // The memory the profiler keeps is reported, and plausible.
    assert!(
        st.symbolizer_bytes > 10_000 && st.symbolizer_bytes < 50_000_000,
        "{st:?}"
    );
    assert!(
        st.last_profile_bytes > 1_000 && st.last_profile_bytes < 100_000_000,
        "{st:?}"
    );
    assert!(
        st.symbolizer_arena_bytes > 0,
        "the arena was not used: {st:?}"
    );
    let grown = after.saturating_sub(before);
    assert!(
        grown < 8_000_000,
        "four exports left {:.1} MB more resident",
        grown as f64 / 1e6
    );
}

/// A profiler without allocation sampling symbolizes in the private arena too. Before, arena
/// mode was looked at only on the sampling slow path, which a CPU-only profiler never takes:
/// the pass allocated on the heap (the arena stayed unused) and, in the soak service, left
/// about 27 MB more resident than the same service unprofiled.
#[test]
fn a_cpu_only_profiler_symbolizes_in_the_arena_too() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("ferroprof-rss-cpu-only-{}", std::process::id()));
    let guard = Profiler::builder()
        .profiles(Profiles {
            cpu: true,
            wall: true,
            ..Profiles::none()
        })
        .output_dir(&dir)
        .start()
        .unwrap();
    let end = thread_cpu() + Duration::from_millis(400);
    while thread_cpu() < end {
        spread_work(1);
    }
    guard.flush().unwrap();
    let st = guard.stats();
    guard.stop().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(st.symbolized_addresses > 0, "{st:?}");
    assert!(
        st.symbolizer_arena_bytes > 0,
        "the arena was not used: {st:?}"
    );
}

/// While an export symbolizes new addresses, the process grows by little: the DWARF of the
/// units they fall in is walked, not turned into tables, and the mapped file's pages go back
/// after each unit. The first export of this (debug) test binary peaked 71 MB higher with
/// per-unit addr2line contexts, 26 MB with the walk, a third of it libc's compressed debug
/// file inflated.
#[test]
fn an_export_peaks_small() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("ferroprof-rss-peak-{}", std::process::id()));
    let guard = Profiler::builder()
        .profiles(Profiles::all())
        .alloc_interval_bytes(4096)
        .output_dir(&dir)
        .start()
        .unwrap();
    let end = thread_cpu() + Duration::from_millis(500);
    while thread_cpu() < end {
        spread_work(7);
    }
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let before = rss_bytes();
    let monitor = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut peak = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(rss_bytes());
                std::thread::sleep(Duration::from_millis(2));
            }
            peak.max(rss_bytes())
        })
    };
    guard.flush().unwrap();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let peak = monitor.join().unwrap();
    let st = guard.stats();
    guard.stop().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let rise = peak.saturating_sub(before);
    eprintln!(
        "first export: {} addresses symbolized, RSS peak +{:.1} MB, arena {:.1} MB",
        st.symbolized_addresses,
        rise as f64 / 1e6,
        st.symbolizer_arena_bytes as f64 / 1e6
    );
    assert!(st.symbolized_addresses > 50, "{st:?}");
    assert!(
        rise < 40_000_000,
        "the export took {:.1} MB more at its peak",
        rise as f64 / 1e6
    );
}

/// Distinct allocation stacks: `depth` nested calls, then a block allocated and freed.
#[inline(never)]
fn nested_alloc(depth: u32, size: usize) -> usize {
    if depth == 0 {
        let v = std::hint::black_box(vec![1u8; size]);
        return v.len();
    }
    std::hint::black_box(nested_alloc(depth - 1, size)) + 1
}

/// Bytes in use in the C allocator (every arena).
fn c_heap_in_use() -> usize {
    // SAFETY: mallinfo2 has no preconditions.
    unsafe { libc::mallinfo2() }.uordblks
}

/// What recording a sampled allocation allocates (the recorder's tables, the live-heap records,
/// the totals) is the profiler's, not the application's: it used to come from the allocating
/// thread's arena, where a long-lived block of ours keeps the application's free memory from
/// being trimmed. A thread that frees all it allocates now leaves the C heap as it found it.
#[test]
fn recording_samples_leaves_the_application_heap_alone() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("ferroprof-rss-keep-{}", std::process::id()));
    let guard = Profiler::builder()
        .profiles(Profiles {
            cpu: false,
            wall: false,
            alloc: true,
            heap: true,
        })
        .alloc_interval_bytes(1024)
        .output_dir(&dir)
        .start()
        .unwrap();
    // Warm up this thread and the profiler's threads.
    nested_alloc(1, 4096);
    std::thread::sleep(Duration::from_millis(100));
    let kept_before = guard.stats().private_heap_bytes;
    let before = c_heap_in_use();
    let total: usize = std::thread::spawn(|| {
        (0..20_000)
            .map(|i| nested_alloc(i % 300, 512 + (i as usize % 7) * 700))
            .sum()
    })
    .join()
    .unwrap();
    let after = c_heap_in_use();
    let st = guard.stats();
    guard.stop().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let grew = after as i64 - before as i64;
    eprintln!(
        "C heap in use {grew:+} bytes; private blocks {} -> {} bytes; {} samples",
        kept_before, st.private_heap_bytes, st.alloc_samples
    );
    assert!(total > 0);
    assert!(st.alloc_samples > 1000, "{st:?}");
    // 300 distinct stacks of up to 300 frames: the recorder's tables alone take far more.
    assert!(
        st.private_heap_bytes > kept_before + 100_000,
        "recording did not use private blocks: {st:?}"
    );
    assert!(
        grew < 32 * 1024,
        "the C heap grew by {grew} bytes while samples were recorded"
    );
}
