//! A bounded background queue in front of a network backend.
//!
//! [`QueuedExporter::export`] copies the profile into a small queue and returns at once; one worker
//! thread per exporter sends queued profiles with a per-request timeout, retrying transient
//! failures (5xx, connection errors, timeouts) with exponential backoff and jitter. When the
//! queue is full the *oldest* profile is dropped (the newest data is the most useful) and the drop
//! is counted, so a backend that is down costs at most `capacity` profiles of memory.

use std::collections::VecDeque;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::{ExportError, ExportedProfile, Exporter};

/// Something that can deliver one profile, synchronously. Runs on the queue's worker thread.
pub trait Backend: Send + 'static {
    /// Short name for logs ("datadog", "pyroscope").
    fn name(&self) -> &str;
    /// Where profiles go, for logs (never contains credentials).
    fn target(&self) -> String;
    /// Sends one profile; must give up after `timeout`.
    fn send(&mut self, profile: &ExportedProfile, timeout: Duration) -> Result<(), ExportError>;
}

/// Queue, timeout and retry settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueConfig {
    /// Profiles waiting to be sent, at most (the one in flight not counted). At least 1.
    pub capacity: usize,
    /// Per-request timeout.
    pub timeout: Duration,
    /// Attempts per profile, the first one included. At least 1.
    pub max_attempts: u32,
    /// Delay before the first retry; doubles with every further retry.
    pub backoff_initial: Duration,
    /// Upper bound of one backoff delay.
    pub backoff_max: Duration,
}

impl Default for QueueConfig {
    fn default() -> Self {
        QueueConfig {
            capacity: 4,
            timeout: Duration::from_secs(10),
            max_attempts: 3,
            backoff_initial: Duration::from_secs(1),
            backoff_max: Duration::from_secs(30),
        }
    }
}

impl QueueConfig {
    /// Defaults overridden by `FERROPROF_EXPORT_TIMEOUT_MS`, `FERROPROF_EXPORT_QUEUE_CAPACITY`
    /// and `FERROPROF_EXPORT_MAX_ATTEMPTS`.
    pub fn from_env() -> Result<Self, ExportError> {
        Self::from_lookup(&|k| std::env::var(k).ok())
    }

    /// [`Self::from_env`] with a custom variable lookup (for tests).
    pub fn from_lookup(env: &dyn Fn(&str) -> Option<String>) -> Result<Self, ExportError> {
        let mut c = QueueConfig::default();
        if let Some(ms) = parse_env_u64(env, "FERROPROF_EXPORT_TIMEOUT_MS")? {
            c.timeout = Duration::from_millis(ms);
        }
        if let Some(n) = parse_env_u64(env, "FERROPROF_EXPORT_QUEUE_CAPACITY")? {
            c.capacity = n as usize;
        }
        if let Some(n) = parse_env_u64(env, "FERROPROF_EXPORT_MAX_ATTEMPTS")? {
            c.max_attempts = u32::try_from(n).unwrap_or(u32::MAX);
        }
        c.validate()?;
        Ok(c)
    }

    fn validate(&self) -> Result<(), ExportError> {
        if self.capacity == 0 {
            return Err(ExportError::Config(
                "export queue capacity must be at least 1, got 0".into(),
            ));
        }
        if self.max_attempts == 0 {
            return Err(ExportError::Config(
                "export max attempts must be at least 1, got 0".into(),
            ));
        }
        if self.timeout.is_zero() {
            return Err(ExportError::Config(
                "export timeout must be positive, got 0".into(),
            ));
        }
        Ok(())
    }

    /// Backoff before retry number `retry` (1 = first retry): exponential, capped, then jittered
    /// to between half and all of it so that many processes do not retry in lockstep.
    fn backoff(&self, retry: u32, rng: &mut Rng) -> Duration {
        let factor = 1u32
            .checked_shl(retry.saturating_sub(1))
            .unwrap_or(u32::MAX);
        let full = self
            .backoff_initial
            .saturating_mul(factor)
            .min(self.backoff_max);
        let half = full / 2;
        half + Duration::from_nanos(rng.below(half.as_nanos() as u64 + 1))
    }
}

pub(crate) fn parse_env_u64(
    env: &dyn Fn(&str) -> Option<String>,
    key: &str,
) -> Result<Option<u64>, ExportError> {
    match env(key) {
        None => Ok(None),
        Some(v) if v.trim().is_empty() => Ok(None),
        Some(v) => {
            v.trim().parse::<u64>().map(Some).map_err(|_| {
                ExportError::Config(format!("{key}={v:?} is not a non-negative integer"))
            })
        }
    }
}

/// Counters of one queued exporter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExportStats {
    /// Profiles the backend accepted.
    pub sent: u64,
    /// Profiles given up on after an error (not retried any more).
    pub failed: u64,
    /// Profiles dropped without a try: pushed out of a full queue, or left over at shutdown.
    pub dropped: u64,
    /// Retries made (attempts beyond the first).
    pub retries: u64,
    /// Profiles waiting right now.
    pub queued: u64,
}

/// A cheap handle to read an exporter's [`ExportStats`] after the exporter was handed away.
#[derive(Clone)]
pub struct ExportStatsHandle(Arc<Shared>);

impl ExportStatsHandle {
    /// The exporter's counters now.
    pub fn get(&self) -> ExportStats {
        self.0.stats()
    }
}

impl std::fmt::Debug for ExportStatsHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.get().fmt(f)
    }
}

struct State {
    queue: VecDeque<ExportedProfile>,
    /// What `queue` holds, in the process's total.
    share: super::QueuedShare,
    /// Set by shutdown: the worker flushes until then, then stops.
    shutdown_deadline: Option<Instant>,
}

impl State {
    fn recount(&mut self) {
        let bytes = self
            .queue
            .iter()
            .map(|p| p.encoded.bytes.len() as u64)
            .sum();
        self.share.set(bytes);
    }
}

/// The queues whose worker started before the worker-thread hook was set, woken when it is
/// so that an idle worker marks its thread at once, not at its first delivery.
static UNHOOKED: Mutex<Vec<std::sync::Weak<Shared>>> = Mutex::new(Vec::new());

/// Wakes the workers that started before the worker-thread hook was set (see `UNHOOKED`).
pub(crate) fn wake_unhooked() {
    for shared in UNHOOKED.lock().drain(..).filter_map(|w| w.upgrade()) {
        if !shared.forked() {
            // Taken so that a worker between its queue check and its wait sees the wake.
            drop(shared.state.lock());
            shared.wake.notify_all();
        }
    }
}

struct Shared {
    /// The process the worker runs in: a forked child's copy has no worker, and its `state`
    /// lock may have been held by a thread that did not survive the fork.
    pid: u32,
    state: Mutex<State>,
    wake: Condvar,
    sent: AtomicU64,
    failed: AtomicU64,
    dropped: AtomicU64,
    retries: AtomicU64,
}

impl Shared {
    /// Whether this is a forked child's copy of the queue (see `pid`).
    fn forked(&self) -> bool {
        std::process::id() != self.pid
    }

    fn stats(&self) -> ExportStats {
        ExportStats {
            sent: self.sent.load(Ordering::Relaxed),
            failed: self.failed.load(Ordering::Relaxed),
            dropped: self.dropped.load(Ordering::Relaxed),
            retries: self.retries.load(Ordering::Relaxed),
            queued: if self.forked() {
                0
            } else {
                self.state.lock().queue.len() as u64
            },
        }
    }
}

/// An [`Exporter`] that hands profiles to a [`Backend`] on its own worker thread.
pub struct QueuedExporter<B: Backend> {
    name: String,
    capacity: usize,
    shared: Arc<Shared>,
    done: Option<mpsc::Receiver<()>>,
    _backend: std::marker::PhantomData<fn() -> B>,
}

impl<B: Backend> QueuedExporter<B> {
    /// Starts the worker thread.
    pub fn new(backend: B, config: QueueConfig) -> Result<Self, ExportError> {
        config.validate()?;
        let name = backend.name().to_owned();
        let shared = Arc::new(Shared {
            pid: std::process::id(),
            state: Mutex::new(State {
                share: super::QueuedShare::default(),
                queue: VecDeque::with_capacity(config.capacity),
                shutdown_deadline: None,
            }),
            wake: Condvar::new(),
            sent: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            retries: AtomicU64::new(0),
        });
        let (done_tx, done_rx) = mpsc::channel();
        let capacity = config.capacity;
        let worker = Worker {
            backend,
            config,
            shared: shared.clone(),
            rng: Rng::new(),
        };
        if !crate::worker_thread_hook_set() {
            UNHOOKED.lock().push(Arc::downgrade(&shared));
        }
        std::thread::Builder::new()
            .name(format!("ferroprof-{name}-export"))
            .spawn(move || {
                crate::enter_worker_thread();
                worker.run();
                let _ = done_tx.send(());
            })
            .map_err(|e| {
                ExportError::Config(format!("cannot start the {name} export thread: {e}"))
            })?;
        log::info!("ferroprof: {name} exporter started");
        Ok(QueuedExporter {
            name,
            capacity,
            shared,
            done: Some(done_rx),
            _backend: std::marker::PhantomData,
        })
    }

    /// The exporter's counters now.
    pub fn stats(&self) -> ExportStats {
        self.shared.stats()
    }

    /// A handle that keeps reading the stats after this exporter was moved into the profiler.
    pub fn stats_handle(&self) -> ExportStatsHandle {
        ExportStatsHandle(self.shared.clone())
    }

    fn enqueue(&self, profile: ExportedProfile) {
        if self.shared.forked() {
            // No worker here to send it.
            self.shared.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let dropped_now = {
            let mut st = self.shared.state.lock();
            if st.shutdown_deadline.is_some() {
                drop(st);
                self.shared.dropped.fetch_add(1, Ordering::Relaxed);
                log::warn!(
                    "ferroprof: {} exporter: profile dropped, the exporter is shut down",
                    self.name
                );
                return;
            }
            let dropped = if st.queue.len() >= self.capacity {
                st.queue.pop_front()
            } else {
                None
            };
            st.queue.push_back(profile);
            st.recount();
            dropped
        };
        self.shared.wake.notify_all();
        if let Some(old) = dropped_now {
            let total = self.shared.dropped.fetch_add(1, Ordering::Relaxed) + 1;
            log::warn!(
                "ferroprof: {} exporter: queue full ({} profiles), dropped the oldest profile \
                 (started {}); {total} dropped so far",
                self.name,
                self.capacity,
                humantime_utc(old.start()),
            );
        }
        // `old` (possibly megabytes) is freed here, outside the lock.
    }

    fn stop(&mut self, deadline: Duration) {
        let Some(done) = self.done.take() else { return };
        if self.shared.forked() {
            return;
        }
        let until = Instant::now() + deadline;
        self.shared.state.lock().shutdown_deadline = Some(until);
        self.shared.wake.notify_all();
        // The worker caps every request at the deadline; the slack covers a request that was
        // already in flight when shutdown began and is waiting for its own timeout.
        if done
            .recv_timeout(deadline + Duration::from_millis(100))
            .is_err()
        {
            log::warn!(
                "ferroprof: {} exporter: still busy after the {:?} shutdown deadline; leaving it behind",
                self.name,
                deadline
            );
        }
    }
}

impl<B: Backend> Exporter for QueuedExporter<B> {
    fn name(&self) -> &str {
        &self.name
    }

    fn export(&mut self, profile: &ExportedProfile) -> Result<(), ExportError> {
        self.enqueue(profile.clone());
        Ok(())
    }

    fn shutdown(&mut self, deadline: Duration) {
        self.stop(deadline);
    }

    fn queues_profiles(&self) -> bool {
        true
    }
}

impl<B: Backend> Drop for QueuedExporter<B> {
    fn drop(&mut self) {
        // Not shut down explicitly: stop without flushing and without waiting.
        if self.done.take().is_some() && !self.shared.forked() {
            self.shared.state.lock().shutdown_deadline = Some(Instant::now());
            self.shared.wake.notify_all();
        }
    }
}

struct Worker<B: Backend> {
    backend: B,
    config: QueueConfig,
    shared: Arc<Shared>,
    rng: Rng,
}

impl<B: Backend> Worker<B> {
    fn run(mut self) {
        loop {
            let profile = {
                let mut st = self.shared.state.lock();
                loop {
                    // A queue built before the profiler set the hook marks its thread here:
                    // checked under the lock `wake_unhooked` takes before it wakes the worker,
                    // so a hook set while the worker was busy is seen before it waits again.
                    crate::enter_worker_thread();
                    if let Some(deadline) = st.shutdown_deadline {
                        if Instant::now() >= deadline || st.queue.is_empty() {
                            let left = st.queue.len() as u64;
                            st.queue.clear();
                            st.recount();
                            drop(st);
                            if left > 0 {
                                self.shared.dropped.fetch_add(left, Ordering::Relaxed);
                                log::warn!(
                                    "ferroprof: {} exporter: shutdown deadline reached, {left} queued profile(s) not sent",
                                    self.backend.name()
                                );
                            }
                            log::info!("ferroprof: {} exporter stopped", self.backend.name());
                            return;
                        }
                    }
                    if let Some(p) = st.queue.pop_front() {
                        st.recount();
                        break p;
                    }
                    self.shared.wake.wait(&mut st);
                }
            };
            self.deliver(&profile);
        }
    }

    /// Time left before the shutdown deadline, if shutting down.
    fn shutdown_left(&self) -> Option<Duration> {
        self.shared
            .state
            .lock()
            .shutdown_deadline
            .map(|d| d.saturating_duration_since(Instant::now()))
    }

    fn deliver(&mut self, profile: &ExportedProfile) {
        let name = self.backend.name().to_owned();
        let mut attempt = 1;
        loop {
            let mut timeout = self.config.timeout;
            if let Some(left) = self.shutdown_left() {
                if left.is_zero() {
                    self.shared.dropped.fetch_add(1, Ordering::Relaxed);
                    log::warn!(
                        "ferroprof: {name} exporter: shutdown deadline reached, profile not sent"
                    );
                    return;
                }
                timeout = timeout.min(left);
            }
            let began = Instant::now();
            let result = self.backend.send(profile, timeout);
            let err = match result {
                Ok(()) => {
                    self.shared.sent.fetch_add(1, Ordering::Relaxed);
                    log::debug!(
                        "ferroprof: {name} exporter: uploaded a {} byte profile to {} in {:?}",
                        profile.encoded.bytes.len(),
                        self.backend.target(),
                        began.elapsed()
                    );
                    if attempt > 1 {
                        log::info!(
                            "ferroprof: {name} exporter: upload succeeded on attempt {attempt}"
                        );
                    }
                    return;
                }
                Err(e) => e,
            };
            if !is_retryable(&err) || attempt >= self.config.max_attempts {
                self.shared.failed.fetch_add(1, Ordering::Relaxed);
                let why = if is_retryable(&err) {
                    format!("after {attempt} attempt(s)")
                } else {
                    "(not retryable)".to_owned()
                };
                log::error!("ferroprof: {name} exporter: giving up on a profile {why}: {err}");
                return;
            }
            let delay = self.config.backoff(attempt, &mut self.rng);
            log::warn!(
                "ferroprof: {name} exporter: attempt {attempt}/{} failed: {err}; retrying in {delay:?}",
                self.config.max_attempts
            );
            if !self.sleep_unless_shutdown(delay) {
                self.shared.dropped.fetch_add(1, Ordering::Relaxed);
                log::warn!(
                    "ferroprof: {name} exporter: shutting down during backoff, profile not sent"
                );
                return;
            }
            self.shared.retries.fetch_add(1, Ordering::Relaxed);
            attempt += 1;
        }
    }

    /// Waits `delay`, unless shutdown's deadline comes first; returns whether to go on.
    fn sleep_unless_shutdown(&self, delay: Duration) -> bool {
        let until = Instant::now() + delay;
        let mut st = self.shared.state.lock();
        loop {
            if let Some(deadline) = st.shutdown_deadline {
                if deadline < until {
                    return false;
                }
            }
            if Instant::now() >= until {
                return true;
            }
            self.shared.wake.wait_until(&mut st, until);
        }
    }
}

/// The network exporters the environment asks for: Datadog when `FERROPROF_DATADOG` or
/// `DD_PROFILING_ENABLED` is true, Pyroscope when `FERROPROF_PYROSCOPE_URL` is set (see the README's
/// "Configuration"). Started and ready to hand to the profiler builder.
pub fn network_exporters_from_env() -> Result<Vec<Box<dyn Exporter>>, ExportError> {
    network_exporters_from_lookup(&|k| std::env::var(k).ok())
}

/// [`network_exporters_from_env`] with a custom variable lookup (for tests).
pub fn network_exporters_from_lookup(
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Vec<Box<dyn Exporter>>, ExportError> {
    let mut out: Vec<Box<dyn Exporter>> = Vec::new();
    if super::datadog::DatadogConfig::enabled_in(env)? {
        let dd = super::datadog::DatadogConfig::from_lookup(env)?;
        out.push(Box::new(dd.build()?));
    }
    if let Some(py) = super::pyroscope::PyroscopeConfig::from_lookup(env)? {
        out.push(Box::new(py.build()?));
    }
    Ok(out)
}

/// Transient failures are retried; a 4xx means the request itself is wrong and would fail again.
pub fn is_retryable(e: &ExportError) -> bool {
    match e {
        ExportError::Rejected { status, .. } => *status >= 500,
        ExportError::Unreachable { .. } | ExportError::Timeout { .. } => true,
        ExportError::Io { .. } | ExportError::Config(_) => false,
    }
}

/// Small xorshift generator for jitter; quality does not matter, independence between processes
/// does, hence the seed from std's per-process random hasher keys.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new() -> Self {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0),
        );
        h.write_u32(std::process::id());
        Rng(h.finish() | 1)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }
}

/// RFC 3339 UTC with nanoseconds, e.g. `2024-05-01T12:00:00.123456789Z`.
pub fn rfc3339_nanos(t: std::time::SystemTime) -> String {
    let d = t
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or(Duration::ZERO);
    let secs = d.as_secs() as i64;
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let (y, m, day) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{day:02}T{:02}:{:02}:{:02}.{:09}Z",
        sod / 3600,
        (sod / 60) % 60,
        sod % 60,
        d.subsec_nanos()
    )
}

fn humantime_utc(t: std::time::SystemTime) -> String {
    rfc3339_nanos(t)
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian calendar: count in
/// 400-year eras (146097 days) whose years start in March, so the leap day ends a year.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{SystemTime, UNIX_EPOCH};

    #[test]
    fn rfc3339_formats_known_instants() {
        assert_eq!(rfc3339_nanos(UNIX_EPOCH), "1970-01-01T00:00:00.000000000Z");
        let t = UNIX_EPOCH + Duration::new(951_782_400, 5); // leap day 2000
        assert_eq!(rfc3339_nanos(t), "2000-02-29T00:00:00.000000005Z");
        let t = UNIX_EPOCH + Duration::new(1_735_689_599, 999_999_999);
        assert_eq!(rfc3339_nanos(t), "2024-12-31T23:59:59.999999999Z");
        let _ = rfc3339_nanos(SystemTime::now());
    }

    #[test]
    fn backoff_grows_is_capped_and_jittered() {
        let c = QueueConfig {
            backoff_initial: Duration::from_millis(100),
            backoff_max: Duration::from_millis(1000),
            ..QueueConfig::default()
        };
        let mut rng = Rng::new();
        for retry in 1..40 {
            let full = Duration::from_millis(100)
                .saturating_mul(1u32.checked_shl(retry - 1).unwrap_or(u32::MAX))
                .min(Duration::from_millis(1000));
            let d = c.backoff(retry, &mut rng);
            assert!(
                d >= full / 2 && d <= full,
                "retry {retry}: {d:?} vs {full:?}"
            );
        }
    }

    #[test]
    fn retry_policy() {
        let rej = |status| ExportError::Rejected {
            backend: "x".into(),
            status,
            body: String::new(),
        };
        assert!(is_retryable(&rej(500)));
        assert!(is_retryable(&rej(503)));
        assert!(!is_retryable(&rej(400)));
        assert!(!is_retryable(&rej(403)));
        assert!(is_retryable(&ExportError::Timeout {
            backend: "x".into(),
            after: Duration::ZERO
        }));
        assert!(!is_retryable(&ExportError::Config("x".into())));
    }

    #[test]
    fn env_config_is_validated() {
        let env = |k: &str| match k {
            "FERROPROF_EXPORT_TIMEOUT_MS" => Some("250".to_owned()),
            "FERROPROF_EXPORT_QUEUE_CAPACITY" => Some("7".to_owned()),
            _ => None,
        };
        let c = QueueConfig::from_lookup(&env).unwrap();
        assert_eq!(c.timeout, Duration::from_millis(250));
        assert_eq!(c.capacity, 7);
        let bad = |k: &str| (k == "FERROPROF_EXPORT_QUEUE_CAPACITY").then(|| "lots".to_owned());
        let e = QueueConfig::from_lookup(&bad).unwrap_err().to_string();
        assert!(
            e.contains("FERROPROF_EXPORT_QUEUE_CAPACITY") && e.contains("lots"),
            "{e}"
        );
        let zero = |k: &str| (k == "FERROPROF_EXPORT_QUEUE_CAPACITY").then(|| "0".to_owned());
        assert!(QueueConfig::from_lookup(&zero).is_err());
    }

    /// Threads that ran the worker-thread hook, by name (the only test that sets the hook).
    static HOOKED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

    fn hook() {
        let name = std::thread::current().name().unwrap_or("").to_owned();
        HOOKED.lock().unwrap().push(name);
    }

    /// Sends report, on the worker, the threads that ran the hook so far.
    struct HookProbe(mpsc::Sender<Vec<String>>);

    impl Backend for HookProbe {
        fn name(&self) -> &str {
            "probe"
        }
        fn target(&self) -> String {
            "test".into()
        }
        fn send(&mut self, _p: &ExportedProfile, _t: Duration) -> Result<(), ExportError> {
            let _ = self.0.send(HOOKED.lock().unwrap().clone());
            // Still delivering when the test sets the hook right after the report: a wake
            // sent then finds no waiting worker, which must see the hook before it waits.
            std::thread::sleep(Duration::from_millis(50));
            Ok(())
        }
    }

    fn profile() -> ExportedProfile {
        use ferroprof_recorder::{Compression, EncodedProfile, ProfileStats};
        ExportedProfile {
            encoded: EncodedProfile {
                start: UNIX_EPOCH,
                end: UNIX_EPOCH + Duration::from_secs(1),
                bytes: vec![7; 10],
                compression: Compression::default(),
                endpoint_counts: Vec::new(),
            },
            stats: ProfileStats::default(),
            service: "svc".into(),
            tags: Vec::new(),
            sample_types: Vec::new(),
            process_start: UNIX_EPOCH,
        }
    }

    /// The hook runs on the worker thread, once: at the thread's start when set by then, else
    /// as soon as it is set, with no delivery needed (an idle worker is woken for it).
    #[test]
    fn worker_thread_hook_runs_once_on_the_worker() {
        let (tx, rx) = mpsc::channel();
        let wait = Duration::from_secs(10);
        // A worker running, and delivering, before the hook is set.
        let mut early = QueuedExporter::new(HookProbe(tx.clone()), QueueConfig::default()).unwrap();
        early.export(&profile()).unwrap();
        assert!(rx.recv_timeout(wait).unwrap().is_empty());
        crate::set_worker_thread_hook(hook);
        // The idle early worker runs it without a profile to deliver.
        let deadline = Instant::now() + wait;
        while HOOKED.lock().unwrap().is_empty() {
            assert!(
                Instant::now() < deadline,
                "the idle worker never ran the hook"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut late = QueuedExporter::new(HookProbe(tx), QueueConfig::default()).unwrap();
        late.export(&profile()).unwrap();
        assert_eq!(
            rx.recv_timeout(wait).unwrap(),
            ["ferroprof-probe-export"; 2]
        );
        early.export(&profile()).unwrap();
        assert_eq!(
            rx.recv_timeout(wait).unwrap(),
            ["ferroprof-probe-export"; 2]
        );
        late.export(&profile()).unwrap();
        early.export(&profile()).unwrap();
        assert_eq!(rx.recv_timeout(wait).unwrap().len(), 2);
        assert_eq!(rx.recv_timeout(wait).unwrap().len(), 2);
        early.shutdown(wait);
        late.shutdown(wait);
    }
}
