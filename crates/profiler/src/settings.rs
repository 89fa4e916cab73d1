//! Validated profiler settings and the profile selection.

use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use ferroprof_recorder::Compression;

use crate::error::ProfilerError;

/// Which profiles to collect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Profiles {
    /// CPU time per stack (`cpu-time`, `cpu-samples`), all threads.
    pub cpu: bool,
    /// Wall time per stack, idle threads included (`wall-time`).
    pub wall: bool,
    /// Sampled allocations (`alloc-samples`, `alloc-samples-unscaled`, `alloc-space`); needs
    /// [`crate::SamplingAllocator`] as the global allocator.
    pub alloc: bool,
    /// Live heap (`heap-live-samples`, `heap-live-size`); needs the sampling allocator.
    pub heap: bool,
}

impl Default for Profiles {
    fn default() -> Self {
        Profiles::all()
    }
}

impl Profiles {
    /// Every profile (the default).
    pub const fn all() -> Self {
        Profiles {
            cpu: true,
            wall: true,
            alloc: true,
            heap: true,
        }
    }

    /// No profile (a start to fill in: at least one is needed).
    pub const fn none() -> Self {
        Profiles {
            cpu: false,
            wall: false,
            alloc: false,
            heap: false,
        }
    }

    /// Whether the CPU/wall sampler thread is needed.
    pub fn needs_sampler(&self) -> bool {
        self.cpu || self.wall
    }

    /// Whether the allocator samples.
    pub fn needs_allocator(&self) -> bool {
        self.alloc || self.heap
    }
}

impl FromStr for Profiles {
    type Err = ProfilerError;

    /// Parses a comma-separated list of `cpu`, `wall`, `alloc`, `heap` (or `all`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut p = Profiles::none();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            match item.to_ascii_lowercase().as_str() {
                "cpu" => p.cpu = true,
                "wall" => p.wall = true,
                "alloc" | "allocs" | "allocations" => p.alloc = true,
                "heap" => p.heap = true,
                "all" => p = Profiles::all(),
                _ => {
                    return Err(ProfilerError::UnknownProfile {
                        name: item.to_owned(),
                    })
                }
            }
        }
        if p == Profiles::none() {
            return Err(ProfilerError::NoProfiles {
                given: s.to_owned(),
            });
        }
        Ok(p)
    }
}

/// What raises the CPU sampling signal on each thread
/// ([`ProfilerBuilder::cpu_engine`](crate::ProfilerBuilder::cpu_engine),
/// `FERROPROF_CPU_ENGINE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum CpuEngine {
    /// Perf events when this process may open them, else timers (logged once, with the
    /// reason).
    #[default]
    Auto,
    /// Perf task-clock events: each sample at the CPU instant its period ends. Start fails
    /// when the kernel refuses them (`perf_event_paranoid` above 2, a seccomp filter).
    Perf,
    /// POSIX CPU-time timers: work everywhere; the kernel checks them at its scheduler tick,
    /// so samples land at ticks.
    Timer,
}

impl FromStr for CpuEngine {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(CpuEngine::Auto),
            "perf" => Ok(CpuEngine::Perf),
            "timer" => Ok(CpuEngine::Timer),
            other => Err(format!(
                "unknown CPU engine {other:?}: expected auto, perf or timer"
            )),
        }
    }
}

/// Settings after validation, as the running profiler uses them.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub service: String,
    pub tags: Vec<(String, String)>,
    pub cpu_hz: u32,
    pub alloc_interval: u64,
    pub period: Duration,
    /// How long `stop()` (and a flush) waits for exporters to deliver.
    pub stop_timeout: Duration,
    pub profiles: Profiles,
    pub output_dir: Option<PathBuf>,
    pub compression: Compression,
    pub signal: i32,
    /// The CPU engine is perf events (else timers), as decided at start.
    pub cpu_engine_perf: bool,
    pub restart_after_fork: bool,
    /// Threads' CPU from before the start is in the first profile (see
    /// `ProfilerBuilder::cpu_before_start`).
    pub cpu_before_start: bool,
    /// The profiler's own threads' CPU is booked under `[ferroprof]` (see
    /// `ProfilerBuilder::book_own_cpu`).
    pub book_own_cpu: bool,
    /// The output directory's retention (0: no limit of that kind).
    pub keep_files: usize,
    pub keep_bytes: u64,
    /// Cap on each in-flight profile's tables; `None`: no cap.
    pub max_profile_bytes: Option<u64>,
    /// Where symbolization keeps inflated debug sections (see `symbolize::disk_cache`).
    pub debug_cache: Option<std::sync::Arc<std::path::Path>>,
}
