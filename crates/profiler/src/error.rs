//! Errors of the profiler. Every message names the offending value.

use std::path::PathBuf;
use std::time::Duration;

use ferroprof_recorder::RecorderError;
use thiserror::Error;

use crate::http::HttpError;
use ferroprof_export::ExportError;

/// Everything that can go wrong starting, flushing or stopping the profiler, and (through
/// `From`) configuring its exporters and its `/debug/pprof` server, so `?` works on all of them
/// in a function that returns `Result<_, ProfilerError>`.
#[derive(Debug, Error)]
pub enum ProfilerError {
    /// The CPU/wall sampling rate is outside `1..=max` Hz.
    #[error("CPU sampling rate must be between 1 and {max} Hz, got {value} Hz")]
    InvalidCpuHz {
        /// The rate given.
        value: i64,
        /// The highest rate accepted ([`crate::MAX_CPU_HZ`]).
        max: u32,
    },
    /// The export period is shorter than `min`.
    #[error("export period must be at least {min:?}, got {value:?}")]
    InvalidPeriod {
        /// The period given.
        value: Duration,
        /// The shortest period accepted ([`crate::MIN_PERIOD`]).
        min: Duration,
    },
    /// The service name is empty or blank.
    #[error("service name must not be empty")]
    EmptyService,
    /// A tag cannot be used (its key is empty).
    #[error("tag {key:?}={value:?} is invalid: {reason}")]
    InvalidTag {
        /// The tag's key.
        key: String,
        /// The tag's value.
        value: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A profile name in a [`crate::Profiles`] list is not one of `cpu`, `wall`, `alloc`,
    /// `heap`, `all`.
    #[error("unknown profile {name:?} (expected cpu, wall, alloc, heap or all)")]
    UnknownProfile {
        /// The name given.
        name: String,
    },
    /// No profile is left to collect (an empty selection, or only allocation profiles with an
    /// allocation interval of 0).
    #[error("no profile selected in {given:?} (expected a list of cpu, wall, alloc, heap)")]
    NoProfiles {
        /// The selection given.
        given: String,
    },
    /// An environment variable read by [`crate::ProfilerBuilder::from_env`] has a bad value.
    #[error("environment variable {var}={value:?} is invalid: {reason}")]
    Env {
        /// The variable's name.
        var: &'static str,
        /// Its value.
        value: String,
        /// What was expected.
        reason: String,
    },
    /// `CpuEngine::Perf` was asked for and the kernel refuses perf events to this process.
    #[error("the perf CPU engine cannot run here: {source} (perf_event_paranoid, a seccomp filter or no perf support; CpuEngine::Auto or FERROPROF_CPU_ENGINE=auto falls back to timers)")]
    CpuEngine {
        /// The kernel's answer to `perf_event_open`.
        source: std::io::Error,
    },
    /// The sampling signal is neither `SIGPROF` nor a real-time signal.
    #[error("signal {value} cannot be used for sampling (use SIGPROF or a real-time signal)")]
    InvalidSignal {
        /// The signal number given.
        value: i32,
    },
    /// Every real-time signal has a handler, so none is free for the CPU timers.
    #[error("no real-time signal is free for sampling (every one has a handler); pick one with FERROPROF_SIGNAL or ProfilerBuilder::signal")]
    NoFreeSignal,
    /// The output directory cannot be created or written.
    #[error("output directory {path} is not usable: {source}")]
    OutputDir {
        /// The directory.
        path: PathBuf,
        /// Why it is not usable.
        #[source]
        source: std::io::Error,
    },
    /// The debug cache directory is a relative path (the program may change its directory).
    #[error("debug cache directory {path} is not an absolute path")]
    DebugCacheDir {
        /// The directory given.
        path: PathBuf,
    },
    /// A profiler already runs in this process (one at a time).
    #[error("a profiler is already running in this process; stop it before starting another")]
    AlreadyRunning,
    /// The signal handler for the CPU timers' signal could not be installed.
    #[error("cannot install the sampling signal handler for signal {signal}: {source}")]
    SignalHandler {
        /// The signal number.
        signal: i32,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// One of the profiler's threads could not be started.
    #[error("cannot start the {what} thread: {source}")]
    Spawn {
        /// Which thread.
        what: &'static str,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// The profiler was stopped (or is stopping).
    #[error("the profiler is stopped")]
    Stopped,
    /// The recording core failed.
    #[error("recorder: {0}")]
    Recorder(#[from] RecorderError),
    /// An exporter failed, or could not be configured (the exporters' `from_env` and `build`
    /// errors convert with `?`).
    #[error("export: {0}")]
    Export(#[from] ExportError),
    /// The `/debug/pprof` server could not start ([`crate::http::serve`] and its siblings;
    /// converts with `?`).
    #[error("/debug/pprof: {0}")]
    Http(#[from] HttpError),
}
