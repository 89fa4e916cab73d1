//! Where finished profiles go.
//!
//! The export loop hands every serialized profile to each configured [`Exporter`], never waiting
//! for one: exporters that talk to a network wrap themselves in a bounded background queue so
//! `export` returns at once, and every other exporter gets a delivery thread and a bounded queue
//! of its own from the profiler (see [`Exporter::queues_profiles`]). A backend being down or a
//! write that never returns blocks neither the application nor the next serialization, and
//! costs a bounded number of profiles of memory.
//!
//! This crate does not need the profiler: `ferroprof` re-exports it as `ferroprof::export`, and
//! other hosts (a language binding, a preload library) use the same exporters through it.

#![warn(missing_docs)]
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod datadog;
pub mod dir;
pub mod pyroscope;
pub mod queue;
mod span_labels;
pub mod transport;

use std::time::{Duration, SystemTime};

use ferroprof_recorder::{EncodedProfile, ProfileStats};

/// One profile on its way out, with the metadata backends want.
#[derive(Debug, Clone)]
pub struct ExportedProfile {
    /// The profile: its bytes (gzip pprof by default), start and end.
    pub encoded: EncodedProfile,
    /// What recording and serializing it took.
    pub stats: ProfileStats,
    /// Service name (`service` tag).
    pub service: String,
    /// Extra tags (`env`, `version`, user tags...), in the order given.
    pub tags: Vec<(String, String)>,
    /// Names of the sample types present, in profile order (e.g. "cpu-time").
    pub sample_types: Vec<String>,
    /// Process start, for backends that want it.
    pub process_start: SystemTime,
}

impl ExportedProfile {
    /// When the profile's recording began.
    pub fn start(&self) -> SystemTime {
        self.encoded.start
    }

    /// When it ended.
    pub fn end(&self) -> SystemTime {
        self.encoded.end
    }
}

/// Errors of an exporter.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// Writing a file failed.
    #[error("cannot write profile to {path}: {source}")]
    Io {
        /// The file or directory.
        path: String,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// The backend answered with an error status.
    #[error("backend {backend} rejected the profile: HTTP {status}: {body}")]
    Rejected {
        /// The exporter's name.
        backend: String,
        /// The HTTP status.
        status: u16,
        /// The answer's body (shortened).
        body: String,
    },
    /// The backend could not be reached.
    #[error("cannot reach backend {backend} at {target}: {reason}")]
    Unreachable {
        /// The exporter's name.
        backend: String,
        /// Where it tried to connect.
        target: String,
        /// Why it could not.
        reason: String,
    },
    /// The backend, or an exporter at stop, did not finish in time.
    #[error("backend {backend} timed out after {after:?}")]
    Timeout {
        /// The exporter's name (or names).
        backend: String,
        /// The time it was given.
        after: Duration,
    },
    /// A setting is invalid (the message names the variable or field).
    #[error("invalid exporter configuration: {0}")]
    Config(String),
}

/// A destination for profiles. Called from a profiler thread, never from application threads.
pub trait Exporter: Send + 'static {
    /// Short name for logs ("dir", "datadog", "pyroscope").
    fn name(&self) -> &str;
    /// Hands one profile over. Network exporters enqueue and return at once; others run on a
    /// delivery thread of their own, so a slow or stuck `export` delays only this exporter.
    fn export(&mut self, profile: &ExportedProfile) -> Result<(), ExportError>;
    /// Called once when profiling stops, after the last profile: flush what can be flushed
    /// within `deadline`.
    fn shutdown(&mut self, _deadline: Duration) {}
    /// Whether `export` always returns at once because the exporter queues profiles on its own
    /// thread, in a bounded queue (the network exporters). Such an exporter is called from the
    /// export thread directly; any other gets a delivery thread and a bounded queue from the
    /// profiler. Default false.
    fn queues_profiles(&self) -> bool {
        false
    }
}

/// A boxed exporter is an exporter: `Box<dyn Exporter>` (what
/// [`queue::network_exporters_from_env`] returns) goes to
/// `ferroprof::ProfilerBuilder::exporter` as it is.
impl<E: Exporter + ?Sized> Exporter for Box<E> {
    fn name(&self) -> &str {
        (**self).name()
    }
    fn export(&mut self, profile: &ExportedProfile) -> Result<(), ExportError> {
        (**self).export(profile)
    }
    fn shutdown(&mut self, deadline: Duration) {
        (**self).shutdown(deadline)
    }
    fn queues_profiles(&self) -> bool {
        (**self).queues_profiles()
    }
}

/// On-demand profiles, as served by `/debug/pprof/*`. Implemented by the running profiler.
pub trait ProfileSource: Send + Sync + 'static {
    /// CPU and wall samples taken during the next `duration` (blocks that long); gzip pprof.
    /// Does not take samples away from the periodic export.
    fn cpu_profile(&self, duration: Duration) -> Result<Vec<u8>, String>;
    /// Live heap right now (with allocation profiling, also the allocations since the start,
    /// like Go's heap profile); gzip pprof.
    fn heap_profile(&self) -> Result<Vec<u8>, String>;
    /// Allocation samples taken during the next `duration`; gzip pprof.
    fn allocs_profile(&self, duration: Duration) -> Result<Vec<u8>, String>;
}

/// Environment stand-in for the exporters' `from_lookup` tests.
#[cfg(test)]
pub(crate) fn test_lookup(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: std::collections::HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k| map.get(k).cloned()
}

/// Bytes of encoded profiles waiting in export queues, all queues together (a profile waiting
/// for two exporters counts twice): `ProfilerStats::export_queue_bytes`.
static QUEUED_BYTES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// For the profiler, not API: bytes of encoded profiles waiting in export queues, all queues
/// together (the profiler's delivery queues count theirs through [`QueuedShare`]).
#[doc(hidden)]
pub fn queued_bytes() -> u64 {
    QUEUED_BYTES.load(std::sync::atomic::Ordering::Relaxed)
}

/// One queue's share of [`queued_bytes`]: set to what the queue holds after each change (under
/// the queue's lock), and back to 0 when the queue goes. For the profiler's delivery queues too,
/// not API.
#[doc(hidden)]
#[derive(Default)]
pub struct QueuedShare(u64);

impl QueuedShare {
    /// Makes this queue's share `bytes`.
    pub fn set(&mut self, bytes: u64) {
        use std::sync::atomic::Ordering::Relaxed;
        if bytes >= self.0 {
            QUEUED_BYTES.fetch_add(bytes - self.0, Relaxed);
        } else {
            QUEUED_BYTES.fetch_sub(self.0 - bytes, Relaxed);
        }
        self.0 = bytes;
    }
}

impl Drop for QueuedShare {
    fn drop(&mut self) {
        self.set(0);
    }
}

/// Run at the start of every thread this crate starts; see [`set_worker_thread_hook`].
static WORKER_THREAD_HOOK: std::sync::OnceLock<fn()> = std::sync::OnceLock::new();

thread_local! {
    /// Whether this thread of ours ran the hook already.
    static HOOK_RAN: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// For the profiler, not API: sets what every background thread of this crate runs first (the
/// profiler marks the thread as its own, so it is neither sampled nor its allocations
/// profiled). Set once; later calls are ignored. A thread started before the hook was set is
/// woken to run it.
#[doc(hidden)]
pub fn set_worker_thread_hook(hook: fn()) {
    if WORKER_THREAD_HOOK.set(hook).is_ok() {
        queue::wake_unhooked();
    }
}

/// Whether [`set_worker_thread_hook`] was called.
pub(crate) fn worker_thread_hook_set() -> bool {
    WORKER_THREAD_HOOK.get().is_some()
}

/// Runs the worker-thread hook on this thread, once, if one is set. Called by this crate's
/// threads at their start and before each delivery.
pub(crate) fn enter_worker_thread() {
    if HOOK_RAN.with(|r| r.get()) {
        return;
    }
    if let Some(hook) = WORKER_THREAD_HOOK.get() {
        HOOK_RAN.with(|r| r.set(true));
        hook();
    }
}
