//! State shared by the running profiler's threads, the allocator and the profile source.
//!
//! The allocator reaches the running profiler through a global pointer guarded by a user count:
//! a user increments the count, then loads the pointer; stopping swaps the pointer out, then
//! waits for the count to be seen at zero before dropping its reference. So a slow path that got
//! the pointer can use it to the end, and no slow path can see a freed profiler.

use std::sync::atomic::{
    AtomicBool, AtomicI32, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering,
};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::forklock::{reset_in_child, Mutex};
use crate::ownthread::OwnThread;
use ferroprof_recorder::StackRecorder;

use crate::alloc::totals::AllocTotals;
use crate::handoff::Outbox;
use crate::settings::Settings;
use crate::sharded::ShardedCount;
use crate::symbolize::ProcessSymbolizer;

/// Width and number of the buckets of the handler-time histogram (0 to 25.6 us).
pub(crate) const HANDLER_BUCKET_NS: u64 = 100;
pub(crate) const HANDLER_BUCKETS: usize = 256;

/// Counters of what the profiler did, for [`crate::ProfilerStats`]. Cache-line aligned (its
/// size rounds up too): written often, it shares no line with the settings and pointers that
/// every sample reads.
#[derive(Default)]
#[repr(align(128))]
pub(crate) struct Stats {
    pub cpu_samples: AtomicU64,
    pub sampler_ticks: AtomicU64,
    pub sampler_late_ticks: AtomicU64,
    pub cpu_ticks: AtomicU64,
    pub cpu_timer_samples: AtomicU64,
    pub wall_remote_stacks: AtomicU64,
    pub wall_remote_retries: AtomicU64,
    pub wall_recent_calls: AtomicU64,
    pub threads_without_timer: AtomicU64,
    pub signal_handler_replaced: AtomicU64,
    /// Bumped by every allocating thread: sharded (see `crate::sharded`).
    pub alloc_samples: ShardedCount,
    pub record_errors: AtomicU64,
    pub exports: AtomicU64,
    pub export_errors: AtomicU64,
    pub serialize_errors: AtomicU64,
    pub handler_ns_total: AtomicU64,
    /// Handler times in HANDLER_BUCKET_NS buckets (the last one open-ended), for the median.
    pub handler_hist: HandlerHist,
    pub handler_frames_total: AtomicU64,
    pub handler_count: AtomicU64,
    /// The last export's serialization (symbolizing and encoding): wall and CPU time.
    pub last_export_ns: AtomicU64,
    pub last_export_cpu_ns: AtomicU64,
    /// Addresses the symbolizer resolved from debug info (not from its cache), and the cache's
    /// size and the arena's high-water mark after the last pass.
    pub symbolized_addresses: AtomicU64,
    pub symbolizer_cached: AtomicU64,
    pub symbolizer_arena_bytes: AtomicU64,
    /// The symbolizer's cache and indexes, and the last exported profile's tables (bytes).
    pub symbolizer_bytes: AtomicU64,
    pub last_profile_bytes: AtomicU64,
}

/// (std implements `Default` for arrays of up to 32 elements only.)
pub(crate) struct HandlerHist([AtomicU64; HANDLER_BUCKETS]);

impl Default for HandlerHist {
    fn default() -> Self {
        HandlerHist([const { AtomicU64::new(0) }; HANDLER_BUCKETS])
    }
}

impl Stats {
    pub(crate) fn count_handler(&self, ns: u64) {
        let b = ((ns / HANDLER_BUCKET_NS) as usize).min(HANDLER_BUCKETS - 1);
        self.handler_hist.0[b].fetch_add(1, Ordering::Relaxed);
        self.handler_ns_total.fetch_add(ns, Ordering::Relaxed);
    }

    /// Median handler time (the middle of its bucket); 0 before the first.
    pub(crate) fn handler_median_ns(&self) -> u64 {
        let counts: Vec<u64> = self
            .handler_hist
            .0
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect();
        let total: u64 = counts.iter().sum();
        let mut seen = 0;
        for (i, c) in counts.iter().enumerate() {
            seen += c;
            if total > 0 && seen * 2 >= total {
                return i as u64 * HANDLER_BUCKET_NS + HANDLER_BUCKET_NS / 2;
            }
        }
        0
    }
}

/// Which on-demand capture a tap serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TapKind {
    Cpu,
    Alloc,
}

/// A temporary recorder the samplers also write to while an on-demand capture runs.
pub(crate) struct Tap {
    pub kind: TapKind,
    pub recorder: StackRecorder,
}

/// Threads of a running profiler.
#[derive(Default)]
pub(crate) struct Threads {
    pub sampler: Option<OwnThread<()>>,
    pub export: Option<OwnThread<()>>,
    /// The thread that flushes on SIGTERM/SIGINT (opt-in, see `crate::termination`).
    pub termination: Option<OwnThread<()>>,
}

pub(crate) struct Shared {
    pub recorder: Arc<StackRecorder>,
    pub settings: Settings,
    pub stats: Stats,
    pub process_start: SystemTime,
    taps: Mutex<Vec<Arc<Tap>>>,
    tap_count: AtomicUsize,
    pub symbolizer: Mutex<ProcessSymbolizer>,
    /// Allocations since the start per stack, for the heap profile (kept with heap profiling).
    pub alloc_totals: AllocTotals,
    pub exporters: Mutex<Outbox>,
    /// Held while serializing the main recorder or iterating its heap.
    pub serialize_lock: Mutex<()>,
    pub threads: Mutex<Threads>,
    /// Set when stopping; the sampler and export threads exit.
    pub stopping: AtomicBool,
    /// Moved (with a futex wake) when stopping: the sampler sleeps on it between ticks, so
    /// that `stop` does not wait out its sleep.
    pub sampler_wake: AtomicU32,
    /// Settle requests (`settle_sampler`) and the last one the sampler answered: it then booked
    /// every thread's CPU up to now, the part of a period no signal caught yet included.
    pub settle_requested: AtomicU64,
    pub settled: AtomicU64,
    /// Set by `stop()` once the sampler thread finished (it records what it still held): the
    /// export thread writes the last profile only after that.
    pub sampler_stopped: AtomicBool,
    /// Kernel ids of the profiler's own threads (not sampled).
    pub own_tids: [AtomicI32; 2],
    /// Flush tickets asked for / served by the export thread.
    pub flush_requested: AtomicU64,
    pub flush_done: AtomicU64,
    /// What the flush on termination runs, when on: kept so that a forked child whose threads
    /// start again arms its own (see `crate::termination::rearm_in_child`).
    pub termination_flush: std::sync::OnceLock<TerminationFlush>,
}

pub(crate) type TerminationFlush = Arc<dyn Fn() + Send + Sync>;

impl Shared {
    pub fn new(recorder: Arc<StackRecorder>, settings: Settings, exporters: Outbox) -> Shared {
        let alloc_totals = AllocTotals::new(settings.max_profile_bytes);
        let symbolizer = ProcessSymbolizer::new().with_debug_cache(settings.debug_cache.clone());
        Shared {
            recorder,
            settings,
            stats: Stats::default(),
            process_start: process_start_time(),
            taps: Mutex::new(Vec::new()),
            tap_count: AtomicUsize::new(0),
            symbolizer: Mutex::new(symbolizer),
            alloc_totals,
            exporters: Mutex::new(exporters),
            serialize_lock: Mutex::new(()),
            threads: Mutex::new(Threads::default()),
            stopping: AtomicBool::new(false),
            sampler_wake: AtomicU32::new(0),
            settle_requested: AtomicU64::new(0),
            settled: AtomicU64::new(0),
            sampler_stopped: AtomicBool::new(false),
            own_tids: [AtomicI32::new(0), AtomicI32::new(0)],
            flush_requested: AtomicU64::new(0),
            flush_done: AtomicU64::new(0),
            termination_flush: std::sync::OnceLock::new(),
        }
    }

    pub fn alloc_enabled(&self) -> bool {
        self.settings.profiles.alloc
    }

    pub fn heap_enabled(&self) -> bool {
        self.settings.profiles.heap
    }

    /// Calls `f` with the recorder of every active tap of `kind`.
    pub fn for_each_tap(&self, kind: TapKind, mut f: impl FnMut(&StackRecorder)) {
        if self.tap_count.load(Ordering::Acquire) == 0 {
            return;
        }
        let taps = self.taps.lock();
        for t in taps.iter().filter(|t| t.kind == kind) {
            f(&t.recorder);
        }
    }

    pub fn add_tap(&self, tap: Arc<Tap>) {
        let mut taps = self.taps.lock();
        taps.push(tap);
        self.tap_count.store(taps.len(), Ordering::Release);
    }

    pub fn remove_tap(&self, tap: &Arc<Tap>) {
        let mut taps = self.taps.lock();
        taps.retain(|t| !Arc::ptr_eq(t, tap));
        self.tap_count.store(taps.len(), Ordering::Release);
    }

    /// Whether a flush was asked for and not done yet.
    pub fn flush_pending(&self) -> bool {
        self.flush_requested.load(Ordering::SeqCst) > self.flush_done.load(Ordering::SeqCst)
    }

    /// Sleeps (the export thread) up to `d` unless woken by a stop or a flush. Returns true
    /// when stopping. Thread parking is per thread (no lock, no shared wait queue), so a fork
    /// while the export thread sleeps leaves nothing behind for the child to trip on; an
    /// `unpark` before the sleep makes it return at once, so no wake-up is lost.
    pub fn wait(&self, d: Duration) -> bool {
        if !(self.stopping.load(Ordering::SeqCst) || self.flush_pending()) {
            std::thread::park_timeout(d);
        }
        self.stopping.load(Ordering::SeqCst)
    }

    /// Test support: holds the taps' lock (for writing) while `f` runs.
    pub fn hold_taps_lock(&self, f: &mut dyn FnMut()) {
        let _held = self.taps.lock();
        f();
    }

    /// Wakes the export thread, and the sampler when stopping.
    /// Before a last profile the process will not outlive (a termination signal): has the
    /// sampler book every thread's CPU up to now, and waits for it (at most `within`).
    pub fn settle_sampler(&self, within: std::time::Duration) {
        let want = self.settle_requested.fetch_add(1, Ordering::SeqCst) + 1;
        self.sampler_wake.fetch_add(1, Ordering::SeqCst);
        crate::forklock::wake(&self.sampler_wake, 1);
        let deadline = std::time::Instant::now() + within;
        while self.settled.load(Ordering::SeqCst) < want
            && !self.stopping.load(Ordering::SeqCst)
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    pub fn wake_all(&self) {
        if self.stopping.load(Ordering::SeqCst) {
            self.sampler_wake.fetch_add(1, Ordering::SeqCst);
            // The sampler is its only waiter.
            crate::forklock::wake(&self.sampler_wake, 1);
        }
        let t = self
            .threads
            .lock()
            .export
            .as_ref()
            .map(|h| h.thread().clone());
        if let Some(t) = t {
            t.unpark();
        }
    }

    /// In a forked child (the only thread): the locks of threads that no longer exist are
    /// released, and what they might have left half-updated is replaced (the old values are
    /// leaked, never walked).
    ///
    /// # Safety
    /// Only in a forked child, before any other thread exists.
    pub unsafe fn after_fork_in_child(&self) {
        // SAFETY: no other thread exists; a held lock belongs to a thread that died in the fork.
        unsafe {
            reset_in_child(&self.threads);
            let threads = &mut *self.threads.data_ptr();
            // Handles of the parent's threads: joining them in the child would wait forever.
            if let Some(t) = threads.sampler.take() {
                t.forget();
            }
            if let Some(t) = threads.export.take() {
                t.forget();
            }
            // The parent's flush-on-termination thread too (its handler, still installed, knows
            // it is not this process's: see `crate::termination`).
            if let Some(t) = threads.termination.take() {
                t.forget();
            }
            if self.taps.is_locked() {
                reset_in_child(&self.taps);
                std::mem::forget(std::ptr::read(self.taps.data_ptr()));
                std::ptr::write(self.taps.data_ptr(), Vec::new());
            } else {
                (*self.taps.data_ptr()).clear();
            }
            self.tap_count.store(0, Ordering::Release);
            if self.symbolizer.is_locked() {
                reset_in_child(&self.symbolizer);
                std::mem::forget(std::ptr::read(self.symbolizer.data_ptr()));
                let fresh =
                    ProcessSymbolizer::new().with_debug_cache(self.settings.debug_cache.clone());
                std::ptr::write(self.symbolizer.data_ptr(), fresh);
            }
            reset_in_child(&self.serialize_lock);
            // Mid-export in the parent: the exporters' own state is theirs to keep sane.
            reset_in_child(&self.exporters);
            let names = &(*self.exporters.data_ptr()).deliveries().abandoned_names;
            if names.is_locked() {
                reset_in_child(names);
                std::mem::forget(std::ptr::read(names.data_ptr()));
                std::ptr::write(names.data_ptr(), Vec::new());
            }
        }
        for t in &self.own_tids {
            t.store(0, Ordering::SeqCst);
        }
    }
}

static ACTIVE: AtomicPtr<Shared> = AtomicPtr::new(std::ptr::null_mut());
static ACTIVE_USERS: ShardedCount = ShardedCount::new();

/// Runs `f` with the running profiler, if any (see the module docs for the protocol).
pub(crate) fn with_active<R>(f: impl FnOnce(&Shared) -> R) -> Option<R> {
    struct Leave(usize);
    impl Drop for Leave {
        fn drop(&mut self) {
            ACTIVE_USERS.leave(self.0);
        }
    }
    let _leave = Leave(ACTIVE_USERS.enter());
    let p = ACTIVE.load(Ordering::SeqCst);
    if p.is_null() {
        return None;
    }
    // SAFETY: `p` holds a strong count (Arc::into_raw in `activate`) that `deactivate` gives back
    // only after observing no user, and we are counted as a user.
    Some(f(unsafe { &*p }))
}

/// The running profiler as an `Arc`, for code that outlives one call.
pub(crate) fn active_arc() -> Option<Arc<Shared>> {
    with_active(|sh| {
        let p = sh as *const Shared;
        // SAFETY: `p` came from Arc::into_raw and is kept alive by the global reference while we
        // are a user; incrementing gives us our own reference.
        unsafe {
            Arc::increment_strong_count(p);
            Arc::from_raw(p)
        }
    })
}

/// Publishes `shared` as the running profiler. Fails when one is already running.
pub(crate) fn activate(shared: &Arc<Shared>) -> bool {
    let raw = Arc::into_raw(shared.clone()) as *mut Shared;
    match ACTIVE.compare_exchange(
        std::ptr::null_mut(),
        raw,
        Ordering::SeqCst,
        Ordering::SeqCst,
    ) {
        Ok(_) => true,
        Err(_) => {
            // SAFETY: `raw` was not published; take the reference back.
            drop(unsafe { Arc::from_raw(raw) });
            false
        }
    }
}

/// Unpublishes `shared` and waits until no slow path uses it.
pub(crate) fn deactivate(shared: &Arc<Shared>) {
    let me = Arc::as_ptr(shared) as *mut Shared;
    if ACTIVE
        .compare_exchange(me, std::ptr::null_mut(), Ordering::SeqCst, Ordering::SeqCst)
        .is_err()
    {
        return;
    }
    while !ACTIVE_USERS.is_empty() {
        std::thread::yield_now();
    }
    // SAFETY: the reference taken by `activate`; nobody can reach it through ACTIVE any more.
    drop(unsafe { Arc::from_raw(me) });
}

/// Set in a forked child that left the profiler behind (see [`abandon_in_child`]).
static ABANDONED: AtomicBool = AtomicBool::new(false);

/// In a forked child that cannot trust the profiler's state (forked from inside it): the
/// running profiler is unpublished without waiting for anything and leaked, so the child's
/// allocations and frees no longer reach it, and its guard's `stop` does nothing.
/// Async-signal-safe.
pub(crate) fn abandon_in_child() {
    ABANDONED.store(true, Ordering::SeqCst);
    ACTIVE.store(std::ptr::null_mut(), Ordering::SeqCst);
}

/// Whether this process is a forked child that left the profiler behind.
pub(crate) fn abandoned() -> bool {
    ABANDONED.load(Ordering::Relaxed)
}

/// In a forked child: users that were inside are gone.
pub(crate) fn after_fork_in_child() {
    ACTIVE_USERS.reset();
}

/// When the process started, from /proc/self/stat (falls back to now).
fn process_start_time() -> SystemTime {
    fn read() -> Option<SystemTime> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        // Fields after the parenthesized command; starttime is field 22 (index 19 after it).
        let rest = &stat[stat.rfind(')')? + 2..];
        let start_ticks: u64 = rest.split(' ').nth(19)?.parse().ok()?;
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        if hz <= 0 {
            return None;
        }
        let uptime = std::fs::read_to_string("/proc/uptime").ok()?;
        let up: f64 = uptime.split_whitespace().next()?.parse().ok()?;
        let since_start = up - start_ticks as f64 / hz as f64;
        SystemTime::now().checked_sub(Duration::from_secs_f64(since_start.max(0.0)))
    }
    read().unwrap_or_else(SystemTime::now)
}

#[cfg(test)]
mod stats_tests {
    use super::*;

    #[test]
    fn handler_median_is_the_middle_bucket_and_ignores_the_slow_tail() {
        let s = Stats::default();
        assert_eq!(s.handler_median_ns(), 0, "no handler yet");
        for ns in [900, 1_000, 1_050, 1_099, 250_000] {
            s.count_handler(ns);
        }
        // 1000..1100 ns holds the middle value; the 250 us outlier lands in the last bucket.
        assert_eq!(s.handler_median_ns(), 1_050);
        assert_eq!(
            s.handler_hist.0[HANDLER_BUCKETS - 1].load(Ordering::Relaxed),
            1
        );
        assert_eq!(s.handler_ns_total.load(Ordering::Relaxed), 254_049);
    }
}
