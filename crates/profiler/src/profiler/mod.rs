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
use crate::fork;
use crate::handoff::{Deliveries, Outbox};
use crate::sampler::{self, Sampler};
use crate::settings::{CpuEngine, Profiles, Settings};
use crate::state::{self, Shared, Tap, TapKind};
use crate::tls;
use crate::unwind;
use ferroprof_export::dir::{check_writable, DirExporter};
use ferroprof_export::{ExportError, ExportedProfile, Exporter, ProfileSource};

mod guard;
mod run;
mod source;

use guard::*;
pub use guard::{ProfilerGuard, ProfilerStats};
pub use run::after_fork;
pub(crate) use run::spawn_threads;
use run::*;
use source::*;

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
    cpu_engine: CpuEngine,
    restart_after_fork: bool,
    cpu_before_start: bool,
    book_own_cpu: bool,
    max_profile_bytes: u64,
    keep_files: usize,
    keep_bytes: u64,
    flush_on_termination: bool,
    debug_cache: Option<PathBuf>,
    deferred: Option<ProfilerError>,
}

impl Default for ProfilerBuilder {
    fn default() -> Self {
        // The exporters' background threads are the profiler's own (not sampled, allocations
        // not profiled): set before the builder takes exporters built from the environment.
        ferroprof_export::set_worker_thread_hook(crate::threads::enter_profiler_thread);
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
            cpu_engine: CpuEngine::default(),
            restart_after_fork: true,
            cpu_before_start: false,
            book_own_cpu: false,
            max_profile_bytes: DEFAULT_MAX_PROFILE_BYTES,
            keep_files: ferroprof_export::dir::DEFAULT_KEEP_FILES,
            keep_bytes: ferroprof_export::dir::DEFAULT_KEEP_BYTES,
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

    /// What raises the CPU sampling signal on each thread (default [`CpuEngine::Auto`]: perf
    /// events where the kernel allows them, else timers).
    pub fn cpu_engine(mut self, engine: CpuEngine) -> Self {
        self.cpu_engine = engine;
        self
    }

    /// Whether a forked child restarts the sampler and export threads (default true). They
    /// start once the child used a period of CPU, or at its first sampled allocation or
    /// profiler call, never in the fork itself: a child that execs right away runs no profiler
    /// thread (see [`crate::after_fork`]).
    pub fn restart_after_fork(mut self, yes: bool) -> Self {
        self.restart_after_fork = yes;
        self
    }

    /// Whether the CPU time threads used before the start goes into the first profile (default
    /// false: a profiler started in a running program profiles from its start). For a profiler
    /// started with the process (a preload library's constructor), where that time is the
    /// dynamic loader's and the constructors' and belongs to the process's total. Time no
    /// sample caught is booked where the thread is next caught, else under `[cpu not sampled]`.
    pub fn cpu_before_start(mut self, yes: bool) -> Self {
        self.cpu_before_start = yes;
        self
    }

    /// Whether the CPU time of the profiler's own threads (sampling, symbolizing and encoding
    /// profiles) goes into the cpu-time profile, under a `[ferroprof]` frame and thread name
    /// (default false). With it, a profile's CPU adds up to the process's CPU clock; each
    /// profile holds what was spent up to its own symbolizing, that included. What `record`
    /// uses, so that a build's profiles add up to the build's CPU time.
    pub fn book_own_cpu(mut self, yes: bool) -> Self {
        self.book_own_cpu = yes;
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
    /// [`Self::flush_on_termination`]), `FERROPROF_SIGNAL` (signal number) and
    /// `FERROPROF_CPU_ENGINE` (`auto`, `perf`, `timer`: see [`Self::cpu_engine`]). Set variables
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
        if let Some(v) = get("FERROPROF_CPU_ENGINE") {
            match v.parse::<CpuEngine>() {
                Ok(e) => self.cpu_engine = e,
                Err(reason) => {
                    err.get_or_insert(bad("FERROPROF_CPU_ENGINE", &v, reason));
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
        let cpu_engine_perf = profiles.needs_sampler()
            && match self.cpu_engine {
                CpuEngine::Timer => false,
                CpuEngine::Perf => {
                    sampler::probe_perf().map_err(|source| ProfilerError::CpuEngine { source })?;
                    true
                }
                _ => match sampler::probe_perf() {
                    Ok(()) => true,
                    Err(e) => {
                        log::info!(
                            "ferroprof: perf events refused ({e}); CPU samples come from timers"
                        );
                        false
                    }
                },
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
            cpu_engine_perf,
            restart_after_fork: self.restart_after_fork,
            cpu_before_start: self.cpu_before_start,
            book_own_cpu: self.book_own_cpu,
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
            if settings.book_own_cpu {
                // What an earlier profiler's threads spent is not this one's to book.
                crate::threads::take_unbooked_own_cpu();
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
                    // The process ends after this profile: what each thread used since it was
                    // last caught goes in too.
                    sh.settle_sampler(Duration::from_millis(200));
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
