//! The profiler's front door: the builder, the guard, the export loop and the on-demand source.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime};

use ferroprof_recorder::heap::HeapConfig;
use ferroprof_recorder::profile::Sample;
use ferroprof_recorder::{
    Compression, ExtraValues, Frame, Liveness, Profile, ProfileMetadata, RecorderConfig,
    RecorderExtras, SampleLayout, SampleType, SampleTypeConfig, SampleTypeExtras, SampleValues,
    StackRecorder, DROPPED_STACKS_FRAME,
};

use crate::alloc;
use crate::alloc::filter::FILTER;
use crate::error::ProfilerError;
use crate::export::dir::{check_writable, DirExporter};
use crate::export::handoff::{Deliveries, Outbox};
use crate::export::{ExportError, ExportedProfile, Exporter, ProfileSource};
use crate::fork;
use crate::sampler::{self, Sampler};
use crate::settings::{Profiles, Settings};
use crate::state::{self, Shared, Tap, TapKind};
use crate::tls;
use crate::unwind;

/// Default CPU/wall sampling rate.
pub const DEFAULT_CPU_HZ: u32 = 100;
/// Highest accepted CPU/wall sampling rate.
pub const MAX_CPU_HZ: u32 = 1000;
/// Default time between two exported profiles.
pub const DEFAULT_PERIOD: Duration = Duration::from_secs(60);
/// Shortest accepted export period.
pub const MIN_PERIOD: Duration = Duration::from_millis(50);
/// Default time `stop()` gives the exporters to deliver what they hold (see
/// [`ProfilerBuilder::stop_timeout`]).
pub const DEFAULT_STOP_TIMEOUT: Duration = Duration::from_secs(5);
/// Default output directory of the directory exporter.
pub const DEFAULT_OUTPUT_DIR: &str = "./profiles";
/// Default cap on the memory of the profile being recorded (see
/// [`ProfilerBuilder::max_profile_bytes`]).
pub const DEFAULT_MAX_PROFILE_BYTES: u64 = 32 << 20;

/// Entry point: `Profiler::builder()...start()`.
pub struct Profiler;

impl Profiler {
    /// The builder, with every setting at its default.
    pub fn builder() -> ProfilerBuilder {
        ProfilerBuilder::default()
    }
}

/// Configures and starts the profiler. Every setting is validated by [`Self::start`].
pub struct ProfilerBuilder {
    service: Option<String>,
    tags: Vec<(String, String)>,
    cpu_hz: i64,
    alloc_interval: i64,
    period: Duration,
    stop_timeout: Duration,
    profiles: Profiles,
    output_dir: Option<PathBuf>,
    exporters: Vec<Box<dyn Exporter>>,
    compression: Compression,
    signal: Option<i32>,
    restart_after_fork: bool,
    max_profile_bytes: u64,
    keep_files: usize,
    keep_bytes: u64,
    flush_on_termination: bool,
    debug_cache: Option<PathBuf>,
    deferred: Option<ProfilerError>,
}

impl Default for ProfilerBuilder {
    fn default() -> Self {
        ProfilerBuilder {
            service: None,
            tags: Vec::new(),
            cpu_hz: DEFAULT_CPU_HZ as i64,
            alloc_interval: alloc::DEFAULT_SAMPLING_INTERVAL as i64,
            period: DEFAULT_PERIOD,
            stop_timeout: DEFAULT_STOP_TIMEOUT,
            profiles: Profiles::all(),
            output_dir: None,
            exporters: Vec::new(),
            compression: Compression::Gzip,
            signal: None,
            restart_after_fork: true,
            max_profile_bytes: DEFAULT_MAX_PROFILE_BYTES,
            keep_files: crate::export::dir::DEFAULT_KEEP_FILES,
            keep_bytes: crate::export::dir::DEFAULT_KEEP_BYTES,
            flush_on_termination: false,
            debug_cache: None,
            deferred: None,
        }
    }
}

impl ProfilerBuilder {
    /// Service name (the `service` tag and the file name prefix). Default: the executable name.
    pub fn service(mut self, name: impl Into<String>) -> Self {
        self.service = Some(name.into());
        self
    }

    /// Adds a tag, in order (`env`, `version` and any other).
    pub fn tag(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.tags.push((key.into(), value.into()));
        self
    }

    /// Shorthand for `tag("env", env)`.
    pub fn env(self, env: impl Into<String>) -> Self {
        self.tag("env", env)
    }

    /// Shorthand for `tag("version", version)`.
    pub fn version(self, version: impl Into<String>) -> Self {
        self.tag("version", version)
    }

    /// CPU/wall samples per second and thread (1..=1000; default 100).
    pub fn cpu_hz(mut self, hz: u32) -> Self {
        self.cpu_hz = hz as i64;
        self
    }

    /// Mean bytes between allocation samples (default 512 KiB); 0 turns allocation and heap
    /// profiling off.
    pub fn alloc_interval_bytes(mut self, bytes: u64) -> Self {
        self.alloc_interval = bytes.min(i64::MAX as u64) as i64;
        self
    }

    /// Time between two exported profiles (default 60 s).
    pub fn period(mut self, period: Duration) -> Self {
        self.period = period;
        self
    }

    /// How long `stop()` waits for the exporters to deliver the profiles they hold, the last one
    /// included, and [`ProfilerGuard::flush`] for its profile's delivery (default 5 s). An
    /// exporter still busy then is left behind on its own thread and named in `stop()`'s error.
    pub fn stop_timeout(mut self, timeout: Duration) -> Self {
        self.stop_timeout = timeout;
        self
    }

    /// Which profiles to collect (default all).
    pub fn profiles(mut self, profiles: Profiles) -> Self {
        self.profiles = profiles;
        self
    }

    /// Writes profiles to this directory (the default exporter, `./profiles` when no other
    /// exporter is configured).
    pub fn output_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.output_dir = Some(dir.into());
        self
    }

    /// Keeps the compressed debug sections symbolization inflates (a distribution's separate
    /// debug files, libc's among them), and a digest of each debug-info unit it walks, in
    /// `dir`, by build id, for the next pass or process to map instead of inflating and
    /// walking again; `None` (the default) keeps nothing. The directory is
    /// created private to the user, and not used if others may write to it; its files are kept
    /// under 256 MiB, the oldest removed first. `ferroprof record` uses
    /// `~/.cache/ferroprof/debug`. A relative path is an error at `start()`.
    pub fn debug_cache(mut self, dir: Option<PathBuf>) -> Self {
        self.debug_cache = dir;
        self
    }

    /// How many of the service's profiles the output directory keeps: at most `files` and
    /// `bytes` in all, the oldest deleted after each write (0: no limit of that kind). Default
    /// 1,440 files (a day at the default period) and 1 GiB. Only files named as ferroprof names
    /// this service's profiles are deleted.
    pub fn keep_profiles(mut self, files: usize, bytes: u64) -> Self {
        self.keep_files = files;
        self.keep_bytes = bytes;
        self
    }

    /// Writes the last profile when the process gets `SIGTERM`, `SIGINT`, `SIGHUP` or `SIGQUIT`
    /// (default off): ferroprof handles them, flushes (within the stop timeout), puts back the handler that was
    /// there before `start()` (the application's, or the default) and raises the signal again.
    /// A handler the application installs after `start()` replaces ferroprof's: call
    /// [`ProfilerGuard::stop`] from it instead.
    pub fn flush_on_termination(mut self, yes: bool) -> Self {
        self.flush_on_termination = yes;
        self
    }

    /// Adds an exporter (a [`DatadogExporter`](crate::export::datadog::DatadogExporter), a
    /// [`PyroscopeExporter`](crate::export::pyroscope::PyroscopeExporter), your own
    /// [`Exporter`], or a `Box<dyn Exporter>` from
    /// [`network_exporters_from_env`](crate::export::queue::network_exporters_from_env)).
    ///
    /// Once any exporter is added, the profiler writes no `./profiles` directory unless
    /// [`Self::output_dir`] asks for one too.
    pub fn exporter(mut self, exporter: impl Exporter) -> Self {
        self.exporters.push(Box::new(exporter));
        self
    }

    /// Compression of exported profiles (default gzip).
    pub fn compression(mut self, c: Compression) -> Self {
        self.compression = c;
        self
    }

    /// Signal the threads' CPU-time timers raise to capture stacks. By default a real-time
    /// signal that no handler uses at start, picked from `SIGRTMAX` down; `SIGPROF` or another
    /// real-time signal may be given (then it is used whoever else handles it).
    pub fn signal(mut self, sig: i32) -> Self {
        self.signal = Some(sig);
        self
    }

    /// Whether a forked child restarts the sampler and export threads (default true). They
    /// start at the child's first sampled allocation or profiler call, never in the fork
    /// itself: a child that execs right away runs no profiler thread (see [`crate::after_fork`]).
    pub fn restart_after_fork(mut self, yes: bool) -> Self {
        self.restart_after_fork = yes;
        self
    }

    /// Cap on the memory of the profile being recorded (default 32 MiB; 0: no cap). Distinct
    /// stacks grow a profile until its export; past the cap, samples of new stacks are
    /// folded into a `[stacks dropped: over memory cap]` frame and counted
    /// ([`ProfilerStats::dropped_stacks`]), while stacks already in the profile keep
    /// aggregating. Two profiles may be held at a time (the one recorded and the one exported).
    /// The allocation totals since the start that the heap profile carries have the same cap
    /// (past it, new stacks fold into the same frame there).
    pub fn max_profile_bytes(mut self, bytes: u64) -> Self {
        self.max_profile_bytes = bytes;
        self
    }

    /// Reads `FERROPROF_SERVICE`, `FERROPROF_ENV`, `FERROPROF_VERSION`, `FERROPROF_TAGS`
    /// (`k:v,k:v`), `FERROPROF_PERIOD_SECS`, `FERROPROF_CPU_HZ`, `FERROPROF_ALLOC_INTERVAL`
    /// (bytes), `FERROPROF_OUTPUT_DIR`, `FERROPROF_KEEP_FILES` and `FERROPROF_KEEP_MB` (the
    /// directory's retention, see [`Self::keep_profiles`]), `FERROPROF_PROFILES` (`cpu,wall,alloc,heap`),
    /// `FERROPROF_MAX_PROFILE_MB` (MiB, 0: no cap), `FERROPROF_DEBUG_CACHE` (an absolute
    /// directory, or `off`: see [`Self::debug_cache`]), `FERROPROF_FLUSH_ON_SIGTERM` (`1`: see
    /// [`Self::flush_on_termination`]) and `FERROPROF_SIGNAL` (signal number). Set variables
    /// override what the builder was given before (`FERROPROF_ENV`, `FERROPROF_VERSION` and
    /// `FERROPROF_TAGS` add tags); unset ones keep it. A bad value is reported by `start()`
    /// ([`Self::start_or_log`] logs it and runs on unprofiled).
    pub fn from_env(self) -> Self {
        self.from_vars(|k| std::env::var(k).ok())
    }

    /// [`Self::from_env`] over any variable source (for tests and embedding).
    pub fn from_vars(mut self, get: impl Fn(&str) -> Option<String>) -> Self {
        fn bad(var: &'static str, value: &str, reason: impl Into<String>) -> ProfilerError {
            ProfilerError::Env {
                var,
                value: value.to_owned(),
                reason: reason.into(),
            }
        }
        let mut err = None;
        if let Some(v) = get("FERROPROF_SERVICE") {
            self.service = Some(v);
        }
        if let Some(v) = get("FERROPROF_ENV") {
            self = self.env(v);
        }
        if let Some(v) = get("FERROPROF_VERSION") {
            self = self.version(v);
        }
        if let Some(v) = get("FERROPROF_TAGS") {
            for item in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                match item.split_once(':') {
                    Some((k, val)) if !k.trim().is_empty() => {
                        self.tags.push((k.trim().to_owned(), val.trim().to_owned()))
                    }
                    _ => {
                        err.get_or_insert(bad(
                            "FERROPROF_TAGS",
                            &v,
                            format!("entry {item:?} is not key:value"),
                        ));
                    }
                }
            }
        }
        if let Some(v) = get("FERROPROF_PERIOD_SECS") {
            match v.trim().parse::<f64>() {
                Ok(s) if s.is_finite() && s > 0.0 => self.period = Duration::from_secs_f64(s),
                _ => {
                    err.get_or_insert(bad(
                        "FERROPROF_PERIOD_SECS",
                        &v,
                        "expected a positive number of seconds",
                    ));
                }
            }
        }
        if let Some(v) = get("FERROPROF_CPU_HZ") {
            match v.trim().parse::<i64>() {
                Ok(hz) => self.cpu_hz = hz,
                Err(_) => {
                    err.get_or_insert(bad("FERROPROF_CPU_HZ", &v, "expected an integer (Hz)"));
                }
            }
        }
        if let Some(v) = get("FERROPROF_SIGNAL") {
            match v.trim().parse::<i32>() {
                Ok(sig) => self.signal = Some(sig),
                Err(_) => {
                    err.get_or_insert(bad(
                        "FERROPROF_SIGNAL",
                        &v,
                        "expected a signal number (SIGPROF or SIGRTMIN..SIGRTMAX)",
                    ));
                }
            }
        }
        if let Some(v) = get("FERROPROF_ALLOC_INTERVAL") {
            match v.trim().parse::<i64>() {
                Ok(b) if b >= 0 => self.alloc_interval = b,
                _ => {
                    err.get_or_insert(bad(
                        "FERROPROF_ALLOC_INTERVAL",
                        &v,
                        "expected a non-negative number of bytes (0 = off)",
                    ));
                }
            }
        }
        if let Some(v) = get("FERROPROF_MAX_PROFILE_MB") {
            match v.trim().parse::<u64>() {
                Ok(mb) if mb <= u64::MAX >> 20 => self.max_profile_bytes = mb << 20,
                _ => {
                    err.get_or_insert(bad(
                        "FERROPROF_MAX_PROFILE_MB",
                        &v,
                        "expected a non-negative number of MiB (0 = no cap)",
                    ));
                }
            }
        }
        if let Some(v) = get("FERROPROF_FLUSH_ON_SIGTERM") {
            match v.trim() {
                "1" | "true" | "yes" | "on" => self.flush_on_termination = true,
                "0" | "false" | "no" | "off" | "" => self.flush_on_termination = false,
                _ => {
                    err.get_or_insert(bad(
                        "FERROPROF_FLUSH_ON_SIGTERM",
                        &v,
                        "expected 1 or 0 (true/false, yes/no, on/off)",
                    ));
                }
            }
        }
        if let Some(v) = get("FERROPROF_DEBUG_CACHE") {
            match v.trim() {
                "" | "off" => self.debug_cache = None,
                d if Path::new(d).is_absolute() => self.debug_cache = Some(PathBuf::from(d)),
                _ => {
                    err.get_or_insert(bad(
                        "FERROPROF_DEBUG_CACHE",
                        &v,
                        "expected an absolute directory, or off",
                    ));
                }
            }
        }
        if let Some(v) = get("FERROPROF_KEEP_FILES") {
            match v.trim().parse::<usize>() {
                Ok(n) => self.keep_files = n,
                Err(_) => {
                    err.get_or_insert(bad(
                        "FERROPROF_KEEP_FILES",
                        &v,
                        "expected a non-negative number of files (0 = no limit)",
                    ));
                }
            }
        }
        if let Some(v) = get("FERROPROF_KEEP_MB") {
            match v.trim().parse::<u64>() {
                Ok(mb) if mb <= u64::MAX >> 20 => self.keep_bytes = mb << 20,
                _ => {
                    err.get_or_insert(bad(
                        "FERROPROF_KEEP_MB",
                        &v,
                        "expected a non-negative number of MiB (0 = no limit)",
                    ));
                }
            }
        }
        if let Some(v) = get("FERROPROF_OUTPUT_DIR") {
            self.output_dir = Some(PathBuf::from(v));
        }
        if let Some(v) = get("FERROPROF_PROFILES") {
            match v.parse::<Profiles>() {
                Ok(p) => self.profiles = p,
                Err(e) => {
                    err.get_or_insert(bad("FERROPROF_PROFILES", &v, e.to_string()));
                }
            }
        }
        if self.deferred.is_none() {
            self.deferred = err;
        }
        self
    }

    fn validate(&mut self) -> Result<Settings, ProfilerError> {
        if let Some(e) = self.deferred.take() {
            return Err(e);
        }
        let service = match self.service.take() {
            Some(s) => s,
            None => default_service(),
        };
        if service.trim().is_empty() {
            return Err(ProfilerError::EmptyService);
        }
        for (k, v) in &self.tags {
            if k.trim().is_empty() {
                return Err(ProfilerError::InvalidTag {
                    key: k.clone(),
                    value: v.clone(),
                    reason: "the key is empty",
                });
            }
        }
        let mut profiles = self.profiles;
        if profiles.needs_sampler() && !(1..=MAX_CPU_HZ as i64).contains(&self.cpu_hz) {
            return Err(ProfilerError::InvalidCpuHz {
                value: self.cpu_hz,
                max: MAX_CPU_HZ,
            });
        }
        if self.period < MIN_PERIOD {
            return Err(ProfilerError::InvalidPeriod {
                value: self.period,
                min: MIN_PERIOD,
            });
        }
        if self.alloc_interval <= 0 {
            profiles.alloc = false;
            profiles.heap = false;
        }
        if profiles == Profiles::none() {
            return Err(ProfilerError::NoProfiles {
                given: format!("{:?} with allocation interval 0", self.profiles),
            });
        }
        let signal = match self.signal {
            Some(sig) if profiles.needs_sampler() && !sampler::valid_signal(sig) => {
                return Err(ProfilerError::InvalidSignal { value: sig });
            }
            Some(sig) => sig,
            None if profiles.needs_sampler() => {
                sampler::pick_signal().ok_or(ProfilerError::NoFreeSignal)?
            }
            None => 0,
        };
        let output_dir = match (&self.output_dir, self.exporters.is_empty()) {
            (Some(d), _) => Some(d.clone()),
            (None, true) => Some(PathBuf::from(DEFAULT_OUTPUT_DIR)),
            (None, false) => None,
        };
        if let Some(d) = &output_dir {
            check_writable(d).map_err(|source| ProfilerError::OutputDir {
                path: d.clone(),
                source,
            })?;
        }
        if let Some(d) = self.debug_cache.as_ref().filter(|d| !d.is_absolute()) {
            return Err(ProfilerError::DebugCacheDir { path: d.clone() });
        }
        Ok(Settings {
            service,
            tags: self.tags.clone(),
            cpu_hz: self.cpu_hz.clamp(1, MAX_CPU_HZ as i64) as u32,
            alloc_interval: self.alloc_interval.max(0) as u64,
            period: self.period,
            stop_timeout: self.stop_timeout,
            profiles,
            output_dir,
            compression: self.compression,
            signal,
            restart_after_fork: self.restart_after_fork,
            keep_files: self.keep_files,
            keep_bytes: self.keep_bytes,
            max_profile_bytes: (self.max_profile_bytes > 0).then_some(self.max_profile_bytes),
            debug_cache: self.debug_cache.as_deref().map(Arc::from),
        })
    }

    /// Starts profiling, or logs why it cannot and returns `None`, so that the program runs
    /// on without profiling: for programs where profiling is optional, and a bad optional
    /// setting (say `FERROPROF_CPU_HZ=abc`) must not stop them.
    ///
    /// The line is `ferroprof: profiling is off: <the error>`, logged at warn level through
    /// the `log` crate, or written to stderr when no logger is installed.
    ///
    /// ```no_run
    /// let _profiler = ferroprof::Profiler::builder().from_env().start_or_log();
    /// // ... the program, profiled or not ...
    /// ```
    pub fn start_or_log(self) -> Option<ProfilerGuard> {
        match self.start() {
            Ok(guard) => Some(guard),
            Err(e) => {
                crate::notice::notice(
                    log::Level::Warn,
                    format_args!("ferroprof: profiling is off: {e}"),
                );
                None
            }
        }
    }

    /// Validates the settings and starts profiling. Every bad setting is an error naming the
    /// value; [`Self::start_or_log`] logs it and lets the program run without profiling.
    pub fn start(mut self) -> Result<ProfilerGuard, ProfilerError> {
        tls::with_guard(|| {
            // Before validating: a start while a profiler runs says so, whatever validating the
            // settings (which probes the output directory) would find. Two starts racing both
            // get past this; `state::activate` below picks one.
            if state::with_active(|_| ()).is_some() {
                return Err(ProfilerError::AlreadyRunning);
            }
            let settings = self.validate()?;
            let p = settings.profiles;
            let (sample_types, extras) = shape(Kind::Periodic, &settings);
            let recorder = StackRecorder::with_extras(
                RecorderConfig {
                    sample_types,
                    heap: heap_config(),
                    compression: settings.compression,
                    max_profile_bytes: settings.max_profile_bytes,
                },
                extras,
            )?;
            let mut exporters = std::mem::take(&mut self.exporters);
            if let Some(d) = &settings.output_dir {
                let dir =
                    DirExporter::new(d.clone())?.keep(settings.keep_files, settings.keep_bytes);
                exporters.insert(0, Box::new(dir));
            }
            let (outbox, deliveries) =
                Outbox::new(exporters).map_err(|source| ProfilerError::Spawn {
                    what: "export delivery",
                    source,
                })?;
            let shared = Arc::new(Shared::new(Arc::new(recorder), settings, outbox));
            unwind::init_pool();
            unwind::refresh(true);
            if p.needs_sampler() {
                sampler::install_handler(shared.settings.signal).map_err(|source| {
                    ProfilerError::SignalHandler {
                        signal: shared.settings.signal,
                        source,
                    }
                })?;
            }
            fork::register();
            crate::forkgate::set_restart_hook(restart_threads);
            // The heap recorder starts empty: so does the estimate of the live heap.
            alloc::peak::HEAP_ESTIMATE.reset();
            crate::threads::PROCESS_ENDING.store(false, Ordering::SeqCst);
            if !state::activate(&shared) {
                return Err(ProfilerError::AlreadyRunning);
            }
            if let Err(e) = spawn_threads(&shared) {
                shared.stopping.store(true, Ordering::SeqCst);
                shared.sampler_stopped.store(true, Ordering::SeqCst);
                shared.wake_all();
                join_threads(&shared);
                state::deactivate(&shared);
                return Err(e);
            }
            if p.needs_allocator() {
                alloc::set_interval(shared.settings.alloc_interval);
                probe_allocator();
                if !alloc::seen() {
                    crate::notice::notice(
                        log::Level::Warn,
                        format_args!("ferroprof: {}", crate::notice::allocator_missing(p)),
                    );
                }
            }
            if self.flush_on_termination {
                // Holds the shared state weakly: kept in it, a strong one would be a cycle.
                let (sh, dl) = (Arc::downgrade(&shared), deliveries.clone());
                let flush: state::TerminationFlush = Arc::new(move || {
                    let Some(sh) = sh.upgrade() else { return };
                    if let Err(e) = flush_with(&sh, &dl) {
                        log::warn!("ferroprof: the last profile before exiting: {e}");
                    }
                });
                let _ = shared.termination_flush.set(flush.clone());
                match crate::termination::arm(&shared, move || flush()) {
                    Ok(t) => shared.threads.lock().termination = Some(t),
                    Err(e) => log::warn!(
                        "ferroprof: cannot flush on SIGTERM/SIGINT ({e}); profiling goes on"
                    ),
                }
            }
            Ok(ProfilerGuard {
                shared,
                deliveries,
                stopped: false,
            })
        })
    }
}

/// The profiles the profiler writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// The periodic export: every enabled profile in one.
    Periodic,
    /// `/debug/pprof/profile`: CPU and wall time.
    Cpu,
    /// `/debug/pprof/allocs`: allocations only.
    Allocs,
    /// `/debug/pprof/heap`: the live heap, and allocations since the start.
    Heap,
}

/// A profile's sample types, and what it says about itself: the type viewers show first and
/// what one sampling event stands for (a CPU period at the sampling rate; the sampling
/// interval's bytes of allocation).
fn shape(kind: Kind, settings: &Settings) -> (SampleTypeConfig, RecorderExtras) {
    let p = settings.profiles;
    let cpu_or_wall = if p.cpu {
        SampleType::CpuTime
    } else {
        SampleType::WallTime
    };
    let cpu_period = (
        cpu_or_wall,
        1_000_000_000 / i64::from(settings.cpu_hz.max(1)),
    );
    let alloc_period = (
        SampleType::AllocSpace,
        i64::try_from(settings.alloc_interval).unwrap_or(i64::MAX),
    );
    let none = SampleTypeConfig::minimal();
    let (types, alloc_space, cpu_and_wall, default, period) = match kind {
        Kind::Periodic => {
            let types = SampleTypeConfig {
                cpu_time: p.cpu,
                alloc_samples: p.alloc,
                heap_samples: p.heap,
                heap_size: p.heap,
                timeline: false,
            };
            let default = if p.needs_sampler() {
                cpu_or_wall
            } else if p.alloc {
                SampleType::AllocSpace
            } else {
                SampleType::HeapLiveSize
            };
            let period = if p.needs_sampler() {
                cpu_period
            } else {
                alloc_period
            };
            // The seed's always-on pair stays in the periodic profile.
            (types, p.alloc, true, default, period)
        }
        Kind::Cpu => {
            let types = SampleTypeConfig {
                cpu_time: p.cpu,
                ..none
            };
            (types, false, true, cpu_or_wall, cpu_period)
        }
        Kind::Allocs => {
            let types = SampleTypeConfig {
                alloc_samples: true,
                ..none
            };
            (types, true, false, SampleType::AllocSpace, alloc_period)
        }
        Kind::Heap => {
            let types = SampleTypeConfig {
                alloc_samples: p.alloc,
                heap_samples: true,
                heap_size: true,
                ..none
            };
            (
                types,
                p.alloc,
                false,
                SampleType::HeapLiveSize,
                alloc_period,
            )
        }
    };
    let extras = RecorderExtras {
        sample_types: SampleTypeExtras {
            alloc_space,
            cpu_and_wall,
        },
        metadata: ProfileMetadata {
            default_sample_type: Some(default),
            period: Some(period),
        },
    };
    (types, extras)
}

fn heap_config() -> HeapConfig {
    HeapConfig {
        sample_every: 1,
        size_enabled: true,
        clean_after_gc: false,
        // Native liveness: records leave on free, so every live record is reported.
        min_iteration_age: 0,
        liveness: Liveness::Native,
    }
}

fn default_service() -> String {
    std::env::current_exe()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "rust-app".to_owned())
}

/// Sends one allocation through the slow path (not sampled: the guard is set) so
/// [`ProfilerGuard::allocator_installed`] can tell whether the global allocator samples.
fn probe_allocator() {
    tls::STATE.with(|s| s.countdown.set(-1));
    let b = std::hint::black_box(Box::new(0u64));
    drop(b);
}

fn start_threads_if_stopped(sh: &Arc<Shared>) {
    let running = {
        let t = sh.threads.lock();
        t.sampler.is_some() || t.export.is_some()
    };
    if !running && !sh.stopping.load(Ordering::SeqCst) && spawn_threads(sh).is_ok() {
        // A child that lives on ends as its parent would: a SIGTERM writes its last profile.
        crate::termination::rearm_in_child(sh);
    }
}

/// Restarts profiling in a forked child now: when the profiler was built with
/// `restart_after_fork(false)`, or to have a child that neither allocates nor calls the
/// profiler profiled from this point on (by default a child resumes at its first sampled
/// allocation or profiler call). Does nothing when no profiler runs or its threads are alive.
pub fn after_fork() {
    // Takes over a pending restart, or waits for the thread doing one.
    crate::forkgate::begin_restart();
    crate::tls::with_guard(restart_threads);
    crate::forkgate::end_restart();
}

/// Starts the running profiler's threads unless they run (the restart hook of `forkgate`).
fn restart_threads() {
    if let Some(sh) = state::active_arc() {
        start_threads_if_stopped(&sh);
    }
}

/// Starts the export thread, then the sampler (so the export thread is known not to sample).
pub(crate) fn spawn_threads(shared: &Arc<Shared>) -> Result<(), ProfilerError> {
    let (tx, rx) = std::sync::mpsc::channel();
    let sh = shared.clone();
    let export = crate::ownthread::spawn("ferroprof-export", 2 << 20, move || {
        crate::threads::enter_profiler_thread();
        sh.own_tids[1].store(crate::threads::current_tid(), Ordering::SeqCst);
        let _ = tx.send(());
        export_loop(&sh);
    })
    .map_err(|source| ProfilerError::Spawn {
        what: "export",
        source,
    })?;
    shared.threads.lock().export = Some(export);
    let _ = rx.recv();
    if shared.settings.profiles.needs_sampler() {
        let (tx, rx) = std::sync::mpsc::channel();
        let sh = shared.clone();
        let sampler = crate::ownthread::spawn("ferroprof-sampler", 512 << 10, move || {
            crate::threads::enter_profiler_thread();
            sh.own_tids[0].store(crate::threads::current_tid(), Ordering::SeqCst);
            let _ = tx.send(());
            Sampler::new(sh).run();
        })
        .map_err(|source| ProfilerError::Spawn {
            what: "sampler",
            source,
        })?;
        shared.threads.lock().sampler = Some(sampler);
        let _ = rx.recv();
    }
    Ok(())
}

fn join_threads(shared: &Shared) {
    let (sampler, export) = {
        let mut t = shared.threads.lock();
        (t.sampler.take(), t.export.take())
    };
    if let Some(h) = sampler {
        let _ = h.join();
    }
    if let Some(h) = export {
        let _ = h.join();
    }
}

fn export_loop(sh: &Arc<Shared>) {
    let period = sh.settings.period;
    let mut next = std::time::Instant::now() + period;
    loop {
        let now = std::time::Instant::now();
        let wait = next.saturating_duration_since(now);
        let stopping = sh.wait(wait);
        if stopping {
            break;
        }
        let requested = sh.flush_requested.load(Ordering::SeqCst);
        let flush = requested > sh.flush_done.load(Ordering::SeqCst);
        if flush || std::time::Instant::now() >= next {
            let round = export_once(sh);
            if flush {
                // The round to wait for (0: nothing was handed over), before the flush is done.
                sh.exporters
                    .lock()
                    .deliveries()
                    .flush_round
                    .store(round.unwrap_or(0), Ordering::SeqCst);
                sh.flush_done.store(requested, Ordering::SeqCst);
            }
            if std::time::Instant::now() >= next {
                next += period;
            }
        }
    }
    // The last profile once the sampler recorded what it still held (bounded: a sampler that
    // does not finish in time loses its last samples, never the export).
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while !sh.sampler_stopped.load(Ordering::SeqCst) && std::time::Instant::now() < deadline {
        std::thread::park_timeout(Duration::from_millis(5));
    }
    // Then give the exporters until the deadline to deliver what they hold.
    let _ = export_once(sh);
    sh.flush_done
        .store(sh.flush_requested.load(Ordering::SeqCst), Ordering::SeqCst);
    let mut outbox = sh.exporters.lock();
    let stuck = outbox.shutdown(sh.settings.stop_timeout);
    if !stuck.is_empty() {
        let mut names = outbox.deliveries().abandoned_names.lock();
        names.extend(stuck);
    }
}

/// Serializes the main recorder and hands the profile to every exporter, never waiting for one
/// (see `export::handoff`). Returns the export round of the profile, `None` when serializing
/// failed (counted and logged).
fn export_once(sh: &Shared) -> Option<u64> {
    let exported = {
        let _s = sh.serialize_lock.lock();
        let mut sym = sh.symbolizer.lock();
        // Through the fork gate, step by step: a fork never catches a step that touches state
        // shared with application threads half-way, and waits for one such step at most, never
        // for symbolizing and encoding (see `crate::forkgate::SerializeSteps`).
        let steps = crate::forkgate::SerializeSteps::new();
        let (t0, c0) = (std::time::Instant::now(), crate::threads::own_cpu_ns());
        let serialized =
            tls::in_recorder(|| sym.pass(|sym| sh.recorder.serialize_gated(Some(sym), &steps)));
        let st = &sh.stats;
        st.last_export_ns
            .store(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        st.last_export_cpu_ns.store(
            crate::threads::own_cpu_ns().saturating_sub(c0),
            Ordering::Relaxed,
        );
        st.symbolized_addresses
            .store(sym.resolved_from_debug_info(), Ordering::Relaxed);
        st.symbolizer_cached
            .store(sym.cached_addresses() as u64, Ordering::Relaxed);
        st.symbolizer_arena_bytes
            .store(crate::alloc::arena::last_pass_bytes(), Ordering::Relaxed);
        st.symbolizer_bytes
            .store(sym.kept_bytes() as u64, Ordering::Relaxed);
        if let Ok(p) = &serialized {
            st.last_profile_bytes
                .store(p.stats.profile_bytes, Ordering::Relaxed);
        }
        match serialized {
            Ok(p) => ExportedProfile {
                encoded: p.encoded,
                stats: p.stats,
                service: sh.settings.service.clone(),
                tags: sh.settings.tags.clone(),
                sample_types: sh
                    .recorder
                    .layout()
                    .types()
                    .iter()
                    .map(|t| t.name().to_owned())
                    .collect(),
                process_start: sh.process_start,
            },
            Err(e) => {
                sh.stats.serialize_errors.fetch_add(1, Ordering::Relaxed);
                // Counted and logged; the export loop carries on with the next period.
                log::warn!("ferroprof: serializing the profile failed: {e}");
                return None;
            }
        }
    };
    let (round, direct) = sh.exporters.lock().send(exported);
    for (name, result) in direct {
        if let Err(err) = result {
            sh.stats.export_errors.fetch_add(1, Ordering::Relaxed);
            log::warn!("ferroprof: {name} exporter: {err}");
        } else {
            sh.stats.exports.fetch_add(1, Ordering::Relaxed);
        }
    }
    sampler::trim_after_export();
    Some(round)
}

/// What the running profiler did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProfilerStats {
    /// CPU samples recorded: sampling periods of CPU time covered by the recorded captures.
    pub cpu_samples: u64,
    /// Thread visits by the sampler (for wall time and to collect captures).
    pub cpu_ticks: u64,
    /// Sampler wake-ups.
    pub sampler_ticks: u64,
    /// Ticks whose time passed while the sampler waited for a CPU (covered by the next one).
    pub sampler_late_ticks: u64,
    /// Stacks captured by the threads' CPU-time timers (where they spent CPU).
    pub cpu_timer_samples: u64,
    /// Timer captures lost because every capture slot was waiting for a late sampler (their
    /// CPU time goes to the thread's other captures). Counted for the whole process.
    pub cpu_captures_lost: u64,
    /// Stacks of blocked threads read without a signal (from their stack pointer and program
    /// counter in `/proc/self/task/<tid>/syscall`), for wall time.
    pub wall_remote_stacks: u64,
    /// Such reads (or reads of a woken thread's recent calls) taken again because the thread
    /// ran while its stack was copied; after three, its previous stack is kept.
    pub wall_remote_retries: u64,
    /// Bytes of the profiler's own large blocks (128 KiB and up: grown tables, encoded
    /// profiles) mapped now. They are mapped and unmapped directly, never through the
    /// application's allocator (glibc would raise its mmap threshold for the whole process).
    pub large_block_bytes: u64,
    /// Stacks of runnable threads waiting for a CPU, found from the calls they made since
    /// their stack was last read (the return addresses those calls left on the stack).
    pub wall_recent_calls: u64,
    /// Threads the kernel gave no CPU-time timer (out of `RLIMIT_SIGPENDING`): they get wall
    /// samples only. Logged once.
    pub threads_without_timer: u64,
    /// Times another handler was found installed for the sampling signal (CPU sampling then
    /// stops; logged).
    pub signal_handler_replaced: u64,
    /// The signal the CPU-time timers raise (picked at start unless set).
    pub signal: i32,
    /// Samples (signal or allocation) skipped because the thread's stack had less room left
    /// than the sampling path needs on it. Counted for the whole process.
    pub skipped_low_stack: u64,
    /// Signal samples skipped because the thread's stack bounds were not known yet (a thread
    /// newer than the unwinder's last look at the mappings) and the kernel would not tell
    /// whether the room below its stack pointer is readable. Counted for the whole process.
    pub skipped_unknown_stack: u64,
    /// Average time a signal handler spent capturing its stack, in nanoseconds.
    pub handler_avg_ns: u64,
    /// Median time a signal handler spent capturing its stack (100 ns resolution): the mean
    /// also carries the first captures, which fill the unwinder's caches.
    pub handler_median_ns: u64,
    /// Average frames per captured stack.
    pub handler_avg_frames: u64,
    /// Unwinding snapshots (module list + stack mappings) built in this process so far.
    pub snapshot_builds: u64,
    /// CPU time the sampler thread used so far (listing threads, reading their clocks and
    /// stacks, recording), in nanoseconds; 0 when it does not run.
    pub sampler_cpu_ns: u64,
    /// Allocation samples taken.
    pub alloc_samples: u64,
    /// Samples the recorder refused (counted, never fatal).
    pub record_errors: u64,
    /// Profiles delivered (to exporters with a delivery thread) or queued (network exporters,
    /// which count their own uploads in their `ExportStats`).
    pub exports: u64,
    /// Exports an exporter failed (each is logged).
    pub export_errors: u64,
    /// Serializations that failed (each is logged).
    pub serialize_errors: u64,
    /// Profiles dropped because an exporter still held [`crate::export::HANDOFF_CAPACITY`]
    /// others (it is slower than the export period, or stuck).
    pub export_dropped: u64,
    /// Profiles left undelivered when `stop()`'s deadline passed.
    pub export_abandoned: u64,
    /// Samples folded into the `[stacks dropped: over memory cap]` frame because the profile
    /// being recorded was at its memory cap (see [`ProfilerBuilder::max_profile_bytes`]).
    pub dropped_stacks: u64,
    /// The last periodic export's serialization (symbolizing and encoding), wall and CPU time
    /// of the export thread.
    pub last_export_ns: u64,
    /// CPU time the export thread spent on the last periodic export's serialization.
    pub last_export_cpu_ns: u64,
    /// Addresses symbolized from debug info so far (the others came from the symbolizer's
    /// cache of resolved addresses), and the cache's size.
    pub symbolized_addresses: u64,
    /// Addresses in the symbolizer's cache of resolved addresses.
    pub symbolizer_cached_addresses: u64,
    /// Memory the profiler keeps between exports, in bytes (estimates from capacities): the
    /// symbolizer's cache of resolved addresses and its unit indexes; the tables of the last
    /// exported profile when it was serialized (the profile being recorded grows to about as
    /// much, and there are two: the one recorded and the one exported); the live-heap records
    /// the heap profile tracks (`heap_tracked_objects`, each a few dozen bytes plus its stack);
    /// the allocations since the start per stack that the heap profile carries (capped like a
    /// profile, see [`ProfilerBuilder::max_profile_bytes`]).
    pub symbolizer_bytes: u64,
    /// Bytes the tables of the last exported profile held when it was serialized.
    pub last_profile_bytes: u64,
    /// Live objects the heap profile tracks.
    pub heap_tracked_objects: u64,
    /// Estimated live heap bytes now: the heap profile's `heap-live-size` total, kept as a
    /// running sum of its tracked samples (0 without heap profiling).
    pub heap_live_estimate_bytes: u64,
    /// The largest `heap_live_estimate_bytes` since the start: an estimate of the peak of the
    /// live heap, from the sampled allocations only (its error is that of the heap profile at
    /// its peak, a standard deviation of at most `sqrt(peak x alloc interval)`; see
    /// `ferroprof::SamplingAllocator`).
    pub heap_peak_estimate_bytes: u64,
    /// Bytes the heap profile's allocation totals since the start take.
    pub alloc_totals_bytes: u64,
    /// Bytes of the profiler's private blocks in use: what recording allocation samples on
    /// application threads allocated (table growth of the recorder, the live-heap records and
    /// the totals), kept out of the application's allocator; 0 when the sampling allocator is
    /// not the global allocator.
    pub private_heap_bytes: u64,
    /// Encoded profiles waiting in the exporters' queues, in bytes (a profile waiting for two
    /// exporters counts twice); more than a few profiles' worth means an exporter falls behind.
    pub export_queue_bytes: u64,
    /// Address space the last symbolization's private memory spanned while it ran (its debug
    /// info; only pages written were resident), handed back to the system at its end; 0 when
    /// the sampling allocator is not the global allocator or allocation profiling is off (the
    /// debug info is then parsed on the heap).
    pub symbolizer_arena_bytes: u64,
    /// What the bounds of request labels cost so far (process-wide; see [`crate::labels`]).
    pub labels: crate::labels::LabelStats,
    /// Request contexts (traces with live objects) the heap profile holds, each shared by its
    /// objects: never more than `heap_tracked_objects`.
    pub heap_contexts: u64,
}

/// The running profiler. Dropping it (or [`Self::stop`]) stops profiling and exports a last
/// profile.
pub struct ProfilerGuard {
    shared: Arc<Shared>,
    deliveries: Arc<Deliveries>,
    stopped: bool,
}

impl ProfilerGuard {
    /// Stops profiling, exports the last profile and shuts the exporters down, waiting at most
    /// the stop timeout (see [`ProfilerBuilder::stop_timeout`]) for them. An exporter still busy
    /// then is left behind on its own thread: the error names it.
    pub fn stop(mut self) -> Result<(), ProfilerError> {
        self.stop_inner()
    }

    /// [`Self::stop`] for a process that exits or execs right after: the last export does not
    /// hand the memory it used back to the kernel (the pages of the debug files it read, its
    /// arena), which the exit does anyway (about 2 ms of `ferroprof record`'s exit on
    /// ripgrep).
    pub fn stop_at_exit(mut self) -> Result<(), ProfilerError> {
        crate::threads::PROCESS_ENDING.store(true, Ordering::SeqCst);
        self.stop_inner()
    }

    fn stop_inner(&mut self) -> Result<(), ProfilerError> {
        if self.stopped || state::abandoned() {
            // An abandoned profiler (a child forked from inside it) has nothing to stop that
            // this process could wait for.
            return Ok(());
        }
        self.stopped = true;
        // The sampler's last visits leave this thread alone: its time in here is the
        // profiler's.
        tls::with_guard(|| {
            crate::threads::as_own_thread(|| {
                let sh = &self.shared;
                let term = sh.threads.lock().termination.take();
                if let Some(t) = term {
                    crate::termination::disarm(t);
                }
                sh.stopping.store(true, Ordering::SeqCst);
                // A forked child's pending restart is dropped (or one under way finishes first).
                crate::forkgate::settle_restart();
                sh.wake_all();
                // Sampler first (it records its pending samples), then no new allocation samples,
                // then the export thread writes the last profile.
                let sampler = sh.threads.lock().sampler.take();
                if let Some(h) = sampler {
                    let _ = h.join();
                }
                sh.sampler_stopped.store(true, Ordering::SeqCst);
                sh.wake_all();
                alloc::set_interval(0);
                let export = sh.threads.lock().export.take();
                if let Some(h) = export {
                    let _ = h.join();
                }
                state::deactivate(sh);
                if sh.settings.profiles.heap {
                    // No recorder holds tracked addresses any more.
                    FILTER.clear();
                }
                let stuck = std::mem::take(&mut *self.deliveries.abandoned_names.lock());
                if stuck.is_empty() {
                    Ok(())
                } else {
                    Err(ProfilerError::Export(ExportError::Timeout {
                        backend: stuck.join(", "),
                        after: sh.settings.stop_timeout,
                    }))
                }
            })
        })
    }

    /// Serializes and exports a profile now (on the export thread), waiting for the
    /// serialization and, up to the stop timeout, for the exporters' delivery.
    pub fn flush(&self) -> Result<(), ProfilerError> {
        crate::forkgate::resume_if_pending();
        if self.stopped {
            return Err(ProfilerError::Stopped);
        }
        flush_with(&self.shared, &self.deliveries)
    }

    /// On-demand profiles for `/debug/pprof` (see [`ProfileSource`]).
    pub fn profile_source(&self) -> Arc<dyn ProfileSource> {
        crate::forkgate::resume_if_pending();
        // The profiler's own allocation, though made on the caller's thread: never sampled.
        tls::with_guard(|| {
            Arc::new(Source {
                shared: Arc::downgrade(&self.shared),
            }) as Arc<dyn ProfileSource>
        })
    }

    /// Counters of the running profiler.
    pub fn stats(&self) -> ProfilerStats {
        crate::forkgate::resume_if_pending();
        let s = &self.shared.stats;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let done = l(&s.handler_count).max(1);
        // The heap recorder's shard locks, briefly: inside the fork gate, as every lock a fork
        // must not catch.
        let heap =
            tls::with_guard(|| crate::forkgate::outside_fork(|| self.shared.recorder.stats().heap));
        ProfilerStats {
            cpu_samples: l(&s.cpu_samples),
            cpu_ticks: l(&s.cpu_ticks),
            sampler_ticks: l(&s.sampler_ticks),
            sampler_late_ticks: l(&s.sampler_late_ticks),
            cpu_timer_samples: l(&s.cpu_timer_samples),
            cpu_captures_lost: sampler::lost_captures(),
            wall_remote_stacks: l(&s.wall_remote_stacks),
            wall_remote_retries: l(&s.wall_remote_retries),
            wall_recent_calls: l(&s.wall_recent_calls),
            large_block_bytes: crate::alloc::bigblock::mapped_bytes() as u64,
            threads_without_timer: l(&s.threads_without_timer),
            signal_handler_replaced: l(&s.signal_handler_replaced),
            signal: self.shared.settings.signal,
            skipped_low_stack: unwind::skipped_low_stack(),
            skipped_unknown_stack: unwind::skipped_unknown_stack(),
            handler_avg_ns: l(&s.handler_ns_total) / done,
            handler_median_ns: s.handler_median_ns(),
            handler_avg_frames: l(&s.handler_frames_total) / done,
            snapshot_builds: unwind::snapshot_builds() as u64,
            sampler_cpu_ns: match self.shared.own_tids[0].load(Ordering::Relaxed) {
                0 => 0,
                tid => crate::threads::thread_cpu_ns(tid).unwrap_or(0),
            },
            alloc_samples: s.alloc_samples.total() as u64,
            record_errors: l(&s.record_errors),
            exports: l(&s.exports) + l(&self.deliveries.delivered),
            export_errors: l(&s.export_errors) + l(&self.deliveries.failed),
            serialize_errors: l(&s.serialize_errors),
            export_dropped: l(&self.deliveries.dropped),
            export_abandoned: l(&self.deliveries.abandoned),
            dropped_stacks: self.shared.recorder.dropped_stacks(),
            last_export_ns: l(&s.last_export_ns),
            last_export_cpu_ns: l(&s.last_export_cpu_ns),
            symbolized_addresses: l(&s.symbolized_addresses),
            symbolizer_cached_addresses: l(&s.symbolizer_cached),
            symbolizer_arena_bytes: l(&s.symbolizer_arena_bytes),
            symbolizer_bytes: l(&s.symbolizer_bytes),
            last_profile_bytes: l(&s.last_profile_bytes),
            export_queue_bytes: crate::export::queued_bytes(),
            // The heap recorder's shard locks, briefly: inside the fork gate, as every lock a
            // fork must not catch.
            heap_tracked_objects: heap.as_ref().map_or(0, |h| h.num_object_records),
            heap_contexts: heap.as_ref().map_or(0, |h| h.num_contexts),
            heap_live_estimate_bytes: alloc::peak::HEAP_ESTIMATE.live(),
            heap_peak_estimate_bytes: alloc::peak::HEAP_ESTIMATE.peak(),
            labels: crate::labels::stats(),
            private_heap_bytes: crate::alloc::keep::bytes_in_use(),
            alloc_totals_bytes: tls::with_guard(|| {
                crate::forkgate::outside_fork(|| self.shared.alloc_totals.bytes() as u64)
            }),
        }
    }

    /// Whether allocations go through a [`crate::SamplingAllocator`] (allocation and heap
    /// profiles are empty otherwise).
    pub fn allocator_installed(&self) -> bool {
        alloc::seen()
    }

    /// The shared recorder (for advanced use and tests).
    pub fn recorder(&self) -> &Arc<StackRecorder> {
        crate::forkgate::resume_if_pending();
        &self.shared.recorder
    }
}

impl Drop for ProfilerGuard {
    fn drop(&mut self) {
        let _ = self.stop_inner();
    }
}

/// The running profiler as a [`ProfileSource`].
struct Source {
    shared: Weak<Shared>,
}

impl Source {
    fn shared(&self) -> Result<Arc<Shared>, String> {
        crate::forkgate::resume_if_pending();
        self.shared
            .upgrade()
            .filter(|s| !s.stopping.load(Ordering::SeqCst))
            .ok_or_else(|| "the profiler is stopped".to_owned())
    }

    fn capture(&self, kind: TapKind, duration: Duration) -> Result<Vec<u8>, String> {
        let sh = self.shared()?;
        let p = sh.settings.profiles;
        let (types, extras) = match kind {
            TapKind::Cpu if p.needs_sampler() => shape(Kind::Cpu, &sh.settings),
            TapKind::Alloc if p.alloc => shape(Kind::Allocs, &sh.settings),
            TapKind::Cpu => return Err("CPU and wall profiling are not enabled".into()),
            TapKind::Alloc => return Err("allocation profiling is not enabled".into()),
        };
        if kind == TapKind::Alloc && !alloc::seen() {
            return Err(crate::notice::allocator_missing(p));
        }
        tls::with_guard(|| {
            let recorder = StackRecorder::with_extras(
                RecorderConfig {
                    sample_types: types,
                    heap: HeapConfig::default(),
                    compression: Compression::Gzip,
                    max_profile_bytes: sh.settings.max_profile_bytes,
                },
                extras,
            )
            .map_err(|e| e.to_string())?;
            let tap = Arc::new(Tap { kind, recorder });
            sh.add_tap(tap.clone());
            // Sleep in steps so a stop ends the capture early.
            let end = std::time::Instant::now() + duration;
            while !sh.stopping.load(Ordering::SeqCst) {
                let left = end.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    break;
                }
                std::thread::sleep(left.min(Duration::from_millis(100)));
            }
            sh.remove_tap(&tap);
            let mut sym = sh.symbolizer.lock();
            let out = tls::in_recorder(|| sym.pass(|sym| tap.recorder.serialize(Some(sym))))
                .map_err(|e| e.to_string())?;
            Ok(out.encoded.bytes)
        })
    }
}

/// The request labels of a live object's heap sample (as the periodic heap profile writes
/// them): its trace's local root span id and, once named, endpoint.
fn request_labels(
    obj: &ferroprof_recorder::heap::LiveObject,
) -> Vec<ferroprof_recorder::Label<'static>> {
    use ferroprof_recorder::profile::{LOCAL_ROOT_SPAN_ID_LABEL, TRACE_ENDPOINT_LABEL};
    use ferroprof_recorder::{Label, LabelValue, Str, StringId};
    let mut out = Vec::new();
    if obj.local_root_span_id != 0 {
        out.push(Label::num(
            LOCAL_ROOT_SPAN_ID_LABEL,
            obj.local_root_span_id as i64,
        ));
        if obj.endpoint != StringId::EMPTY {
            out.push(Label {
                key: Str::Lit(TRACE_ENDPOINT_LABEL),
                value: LabelValue::Str(Str::Id(obj.endpoint)),
            });
        }
    }
    out
}

impl ProfileSource for Source {
    fn cpu_profile(&self, duration: Duration) -> Result<Vec<u8>, String> {
        self.capture(TapKind::Cpu, duration)
    }

    fn heap_profile(&self) -> Result<Vec<u8>, String> {
        let sh = self.shared()?;
        let heap = sh
            .recorder
            .heap()
            .ok_or_else(|| "heap profiling is not enabled".to_owned())?;
        if !alloc::seen() {
            return Err(crate::notice::allocator_missing(sh.settings.profiles));
        }
        tls::with_guard(|| {
            let _s = sh.serialize_lock.lock();
            let mut sym = sh.symbolizer.lock();
            let start = SystemTime::now();
            let (types, extras) = shape(Kind::Heap, &sh.settings);
            let layout = SampleLayout::with_extras(&types, &extras.sample_types);
            let n = layout.len();
            let mut profile =
                Profile::new(layout.types(), Some(sh.recorder.strings().clone()), start);
            profile
                .set_metadata(extras.metadata)
                .map_err(|e| e.to_string())?;
            tls::in_recorder(|| {
                // Building the profile reads the heap recorder, the allocation totals and the
                // string storage (shared with application threads): through the fork gate.
                // Adding the totals' copy (address frames) and encoding work on the profile's
                // own tables only, so a fork need not wait for them.
                let totals = crate::forkgate::outside_fork(|| {
                    heap.prepare_iteration().map_err(|e| e.to_string())?;
                    let mut add_err = None;
                    let iterated = heap.for_each_live_object(&mut |obj, frames| {
                        let w = obj.weight as i64;
                        let values = layout.place(&SampleValues {
                            heap_live_samples: w,
                            heap_live_size: w.saturating_mul(obj.size as i64),
                            ..SampleValues::default()
                        });
                        let labels = request_labels(obj);
                        let sample = Sample {
                            frames,
                            values: &values[..n],
                            labels: labels.as_slice(),
                            end_timestamp_ns: 0,
                        };
                        if let Err(e) = profile.add(&sample) {
                            add_err.get_or_insert(e);
                        }
                        true
                    });
                    let finished = heap.finish_iteration();
                    iterated.map_err(|e| e.to_string())?;
                    finished.map_err(|e| e.to_string())?;
                    if let Some(e) = add_err {
                        return Err(e.to_string());
                    }
                    Ok(sh.alloc_enabled().then(|| sh.alloc_totals.snapshot()))
                })?;
                if let Some(totals) = totals {
                    add_alloc_totals(&mut profile, &layout, &totals).map_err(|e| e.to_string())?;
                }
                let opts = ferroprof_recorder::pprof::EncodeOptions {
                    compression: Compression::Gzip,
                };
                let encoded = sym
                    .pass(|sym| profile.encode(SystemTime::now(), &opts, Some(sym)))
                    .map_err(|e| e.to_string())?;
                Ok(encoded.bytes)
            })
        })
    }

    fn allocs_profile(&self, duration: Duration) -> Result<Vec<u8>, String> {
        self.capture(TapKind::Alloc, duration)
    }
}

/// Adds the allocations since the start, one sample per stack, to a heap profile of `layout`
/// (a stack that also has live objects shares their row).
fn add_alloc_totals(
    profile: &mut Profile,
    layout: &SampleLayout,
    totals: &crate::alloc::totals::TotalsSnapshot,
) -> Result<(), ferroprof_recorder::ProfileError> {
    let n = layout.len();
    let place = |v: [i64; 3]| {
        layout.place_with(
            &SampleValues {
                alloc_samples: v[0],
                alloc_samples_unscaled: v[1],
                ..SampleValues::default()
            },
            &ExtraValues { alloc_space: v[2] },
        )
    };
    let mut frames: Vec<Frame<'static>> = Vec::new();
    let mut result = Ok(());
    totals.for_each(|stack, v| {
        if result.is_err() {
            return;
        }
        frames.clear();
        frames.extend(stack.iter().map(|&a| Frame::Address(a)));
        let values = place(v);
        result = profile.add(&Sample {
            frames: &frames,
            values: &values[..n],
            labels: &[],
            end_timestamp_ns: 0,
        });
    });
    result?;
    let folded = totals.folded();
    if folded != [0; 3] {
        let values = place(folded);
        profile.add(&Sample {
            frames: &[Frame::sym(DROPPED_STACKS_FRAME, "", 0)],
            values: &values[..n],
            labels: &[],
            end_timestamp_ns: 0,
        })?;
    }
    Ok(())
}

/// Asks the export thread for a profile now and waits for its delivery (bounded by the stop
/// timeout): [`ProfilerGuard::flush`], and the flush on termination.
fn flush_with(shared: &Shared, deliveries: &Deliveries) -> Result<(), ProfilerError> {
    if shared.stopping.load(Ordering::SeqCst) {
        return Err(ProfilerError::Stopped);
    }
    let errors_before = shared.stats.export_errors.load(Ordering::SeqCst)
        + shared.stats.serialize_errors.load(Ordering::SeqCst);
    let ticket = shared.flush_requested.fetch_add(1, Ordering::SeqCst) + 1;
    shared.wake_all();
    while shared.flush_done.load(Ordering::SeqCst) < ticket {
        if shared.stopping.load(Ordering::SeqCst) {
            return Err(ProfilerError::Stopped);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let round = deliveries.flush_round.load(Ordering::SeqCst);
    let timeout = shared.settings.stop_timeout;
    match deliveries.wait_round(round, std::time::Instant::now() + timeout) {
        // Round 0: serializing failed, nothing was handed over (counted below).
        _ if round == 0 => {}
        Ok(true) => {}
        Ok(false) => {
            return Err(ProfilerError::Export(ExportError::Config(
                "the flushed profile was dropped or refused by an exporter; see ProfilerStats"
                    .into(),
            )))
        }
        Err(()) => {
            return Err(ProfilerError::Export(ExportError::Timeout {
                backend: "flush".into(),
                after: timeout,
            }))
        }
    }
    let errors_after = shared.stats.export_errors.load(Ordering::SeqCst)
        + shared.stats.serialize_errors.load(Ordering::SeqCst);
    if errors_after > errors_before {
        return Err(ProfilerError::Export(crate::export::ExportError::Config(
            "the flushed profile could not be serialized or exported; see ProfilerStats".into(),
        )));
    }
    Ok(())
}
