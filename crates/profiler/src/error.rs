//! Errors of the profiler. Every message names the offending value.

use std::path::PathBuf;
use std::time::Duration;

use ferroprof_recorder::RecorderError;
use thiserror::Error;

use crate::export::ExportError;

#[derive(Debug, Error)]
pub enum ProfilerError {
    #[error("CPU sampling rate must be between 1 and {max} Hz, got {value} Hz")]
    InvalidCpuHz { value: i64, max: u32 },
    #[error("export period must be at least {min:?}, got {value:?}")]
    InvalidPeriod { value: Duration, min: Duration },
    #[error("service name must not be empty")]
    EmptyService,
    #[error("tag {key:?}={value:?} is invalid: {reason}")]
    InvalidTag {
        key: String,
        value: String,
        reason: &'static str,
    },
    #[error("unknown profile {name:?} (expected cpu, wall, alloc, heap or all)")]
    UnknownProfile { name: String },
    #[error("no profile selected in {given:?} (expected a list of cpu, wall, alloc, heap)")]
    NoProfiles { given: String },
    #[error("environment variable {var}={value:?} is invalid: {reason}")]
    Env {
        var: &'static str,
        value: String,
        reason: String,
    },
    #[error("signal {value} cannot be used for sampling (use SIGPROF or a real-time signal)")]
    InvalidSignal { value: i32 },
    #[error("no real-time signal is free for sampling (every one has a handler); pick one with FERROPROF_SIGNAL or ProfilerBuilder::signal")]
    NoFreeSignal,
    #[error("output directory {path} is not usable: {source}")]
    OutputDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("a profiler is already running in this process; stop it before starting another")]
    AlreadyRunning,
    #[error("cannot install the sampling signal handler for signal {signal}: {source}")]
    SignalHandler {
        signal: i32,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start the {what} thread: {source}")]
    Spawn {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("the profiler is stopped")]
    Stopped,
    #[error("recorder: {0}")]
    Recorder(#[from] RecorderError),
    #[error("export: {0}")]
    Export(#[from] ExportError),
}
