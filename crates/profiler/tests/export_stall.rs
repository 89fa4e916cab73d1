//! An exporter whose `export()` never returns (a hung NFS mount under the directory exporter)
//! must not stop the profiler: serialization goes on on schedule (a healthy exporter keeps
//! receiving profiles), memory stays bounded (profiles for the stuck exporter are dropped and
//! counted) and `stop()` returns within its deadline.
//!
//! One test in its own binary: the profiler is process-wide.

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferroprof::export::{ExportError, ExportedProfile, Exporter};
use ferroprof::{Profiler, Profiles, SamplingAllocator};

#[global_allocator]
static GLOBAL: SamplingAllocator<std::alloc::System> = SamplingAllocator::new(std::alloc::System);

/// Blocks forever in its first `export()`, like a write to a hung mount.
struct Stuck {
    entered: Arc<AtomicBool>,
}

impl Exporter for Stuck {
    fn name(&self) -> &str {
        "stuck"
    }

    fn export(&mut self, _: &ExportedProfile) -> Result<(), ExportError> {
        self.entered.store(true, Ordering::SeqCst);
        loop {
            std::thread::park();
        }
    }
}

/// Allocates from one of 2^depth distinct stacks, chosen by `bits`.
#[inline(never)]
fn left(depth: u32, bits: u64) -> usize {
    if depth == 0 {
        return black_box(vec![0u8; 512]).len();
    }
    black_box(if bits & 1 == 0 {
        left(depth - 1, bits >> 1)
    } else {
        right(depth - 1, bits >> 1)
    }) + 1
}

#[inline(never)]
fn right(depth: u32, bits: u64) -> usize {
    if depth == 0 {
        return black_box(vec![0u8; 768]).len();
    }
    black_box(if bits & 1 == 0 {
        right(depth - 1, bits >> 1)
    } else {
        left(depth - 1, bits >> 1)
    }) + 2
}

/// Counts the profiles it gets (keeping none: the test watches the profiler's memory).
#[derive(Clone, Default)]
struct Count(Arc<AtomicU64>);

impl Exporter for Count {
    fn name(&self) -> &str {
        "count"
    }

    fn export(&mut self, profile: &ExportedProfile) -> Result<(), ExportError> {
        assert!(!profile.encoded.bytes.is_empty());
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

fn rss_kib() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    pages * 4
}

#[test]
fn a_stuck_exporter_stops_neither_serialization_nor_stop() {
    let churn_secs: u64 = std::env::var("FERROPROF_STALL_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let entered = Arc::new(AtomicBool::new(false));
    let healthy = Count::default();
    let stop_timeout = Duration::from_secs(1);
    let guard = Profiler::builder()
        .service("export-stall")
        .profiles(Profiles {
            cpu: false,
            wall: false,
            alloc: true,
            heap: false,
        })
        .alloc_interval_bytes(4096)
        .period(Duration::from_millis(100))
        .stop_timeout(stop_timeout)
        .exporter(Box::new(Stuck {
            entered: entered.clone(),
        }))
        .exporter(Box::new(healthy.clone()))
        .start()
        .unwrap();
    assert!(guard.allocator_installed());

    let mut rng = 0x2545_F491_4F6C_DD1Du64;
    let counted = AtomicU64::new(0);
    let mut churn = |rounds: usize| {
        for _ in 0..rounds {
            // xorshift: nearly every call takes a stack not seen before (2^22 of them).
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            counted.fetch_add(left(22, rng) as u64, Ordering::Relaxed);
        }
    };
    // Warm-up, until the healthy exporter got a profile (the first serialization loads the
    // symbolizer's debug info, seconds in a debug build): then RSS, and the profiles delivered
    // during the churn. With serialization stuck no profile ever arrives.
    let warm = Instant::now();
    while healthy.0.load(Ordering::SeqCst) == 0 {
        if warm.elapsed() > Duration::from_secs(60) {
            // Dropping the guard would wait for the stuck export forever: leave it running.
            std::mem::forget(guard);
            panic!("serialization stopped behind the stuck exporter: no profile in 60 s");
        }
        churn(100);
    }
    let delivered_before = healthy.0.load(Ordering::SeqCst) as usize;
    let rss_before = rss_kib();
    let mut rss_peak = rss_before;
    // With serialization stuck, the active profile would grow with every new stack.
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(churn_secs) {
        churn(1000);
        rss_peak = rss_peak.max(rss_kib());
    }
    let delivered = healthy.0.load(Ordering::SeqCst) as usize - delivered_before;
    let stats = guard.stats();
    eprintln!(
        "export stall: {delivered} profiles delivered to the healthy exporter in {churn_secs} s \
         (period 100 ms), {} dropped for the stuck one, RSS {} -> peak {} KiB, {} alloc samples",
        stats.export_dropped, rss_before, rss_peak, stats.alloc_samples,
    );
    assert!(
        entered.load(Ordering::SeqCst),
        "the stuck exporter was called"
    );
    // At a 100 ms period; serializing 16k deep stacks in a debug build on a loaded machine may
    // take most of a period, so ask for one profile a second (a stuck export thread gives 0).
    let expected = churn_secs as usize + 1;
    if delivered < expected {
        // Dropping the guard would wait for the stuck export forever: leave it running.
        std::mem::forget(guard);
        panic!(
            "serialization stopped behind the stuck exporter: {delivered} profiles in \
             {churn_secs} s, expected at least {expected}"
        );
    }
    assert!(
        stats.export_dropped > 0,
        "drops for the stuck exporter are counted"
    );
    // The stuck exporter's full queue is what the profiler holds for it: a few profiles.
    assert!(
        stats.export_queue_bytes > 0 && stats.export_queue_bytes < 64 << 20,
        "export_queue_bytes {}",
        stats.export_queue_bytes
    );
    assert!(
        rss_peak.saturating_sub(rss_before) < 64 * 1024,
        "RSS grew by {} KiB",
        rss_peak - rss_before
    );

    // A flush cannot be delivered to the stuck exporter: it says so within the deadline.
    let flushing = Instant::now();
    let flushed = guard.flush();
    let took = flushing.elapsed();
    eprintln!("export stall: flush() returned after {took:?}: {flushed:?}");
    assert!(
        flushed.is_err(),
        "the flushed profile did not reach every exporter"
    );
    assert!(
        took < stop_timeout + Duration::from_secs(10),
        "flush() took {took:?}"
    );

    let (tx, rx) = std::sync::mpsc::channel();
    let stopping = Instant::now();
    std::thread::spawn(move || {
        let r = guard.stop();
        let _ = tx.send(r.map_err(|e| e.to_string()));
    });
    let result = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("stop() returned (hang detection)");
    let took = stopping.elapsed();
    eprintln!("export stall: stop() returned after {took:?}: {result:?}");
    assert!(
        took < stop_timeout + Duration::from_secs(4),
        "stop() took {took:?}, deadline {stop_timeout:?}"
    );
    let err = result.expect_err("stop() says what it abandoned");
    assert!(err.contains("stuck"), "{err}");
    // The last profile still reached the healthy exporter.
    assert!(healthy.0.load(Ordering::SeqCst) as usize > delivered + delivered_before);
}
