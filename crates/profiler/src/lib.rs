//! ferroprof: a continuous profiler for Rust programs. Linked into a program, it records the
//! CPU time, wall time, allocations and live heap of every thread, with little overhead, and
//! writes them as pprof profiles, readable by `go tool pprof`, Pyroscope, Datadog and the
//! `ferroprof` command (`top`, `flamegraph`, `diff`).
//!
//! # Where to start
//! * [`Profiler::builder`] configures the profiler ([`ProfilerBuilder`]: service, tags, rates,
//!   the environment with [`ProfilerBuilder::from_env`]) and starts it; the [`ProfilerGuard`] it
//!   returns stops it, writing the last profile, when dropped or [stopped](ProfilerGuard::stop).
//!   [`ProfilerBuilder::start_or_log`] logs a bad setting and lets the program run unprofiled.
//! * [`SamplingAllocator`] as the `#[global_allocator]` feeds the allocation and heap profiles
//!   (without it they stay empty, and the profiler says so at start).
//! * [`export`]: where profiles go. By default a file per period in `./profiles`; the Datadog
//!   and Pyroscope exporters, or your own [`export::Exporter`], instead.
//! * [`http`]: `/debug/pprof` endpoints, as Go's `net/http/pprof` serves them.
//! * [`labels`] (and, with the `tracing` feature, `tracing::FerroprofLayer`): which request,
//!   span or tenant spent the time.
//!
//! ```no_run
//! use ferroprof::{Profiler, SamplingAllocator};
//! use std::alloc::System;
//!
//! #[global_allocator]
//! static GLOBAL: SamplingAllocator<System> = SamplingAllocator::new(System);
//!
//! fn main() -> Result<(), ferroprof::ProfilerError> {
//!     let guard = Profiler::builder()
//!         .service("my-service")
//!         .tag("env", "prod")
//!         .start()?; // a profile every 60 s in ./profiles
//!     // ... the program ...
//!     guard.stop() // writes the last profile
//! }
//! ```
//!
//! More in the repository's `README.md` (a user's guide) and `crates/profiler/examples/`; the
//! design and its reasons are in `docs/architecture.md`.
//!
//! # What a profile holds
//! * **CPU time** (`cpu-time`, `cpu-samples`): each thread's own CPU-time timer raises a signal
//!   on the thread every sampling period of CPU it uses (100 Hz by default), and the handler
//!   unwinds the thread's stack into a preallocated slot: stacks are where the CPU was spent,
//!   and no blocked system call is ever interrupted.
//! * **Wall time** (`wall-time`): a sampler thread visits the threads without signalling them;
//!   a blocked thread's stack is read from outside it.
//! * **Allocations** (`alloc-samples`, `alloc-space`) and **live heap** (`heap-live-samples`,
//!   `heap-live-size`), through [`SamplingAllocator`]: allocated bytes are sampled as a Poisson
//!   process (512 KiB mean by default), each sample weighted to estimate the whole.
//! * Samples carry the labels `thread id`, `thread name` and the request labels set with
//!   [`labels`]. Stacks are unwound with DWARF CFI (`.eh_frame`), so code built without frame
//!   pointers unwinds correctly; symbolization (inlined frames, demangled names, file and
//!   line) happens in the export thread, never on the profiled threads.
//!
//! # Supported platforms
//! Linux on x86_64 with glibc, built and tested (from Linux 5.11 on, the CPU timers' signal
//! arrives on the way back to user mode and never interrupts a system call). The aarch64 code
//! paths exist but have never been built or run: not supported yet. The profiler must be linked
//! into the executable, or into a library loaded at startup (the `ferroprof record` preload
//! library), not into a `dlopen`ed library: its signal handler reads thread-locals, which are
//! only async-signal-safe in the static TLS block. One profiler runs per process.

#![warn(missing_docs)]
// Library code returns errors or degrades; only tests may unwrap.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

/// Where finished profiles go: the exporters of the crate [`ferroprof_export`], re-exported, and
/// the capacity of the profiler's hand-off to each exporter that does not queue on its own.
pub mod export {
    #[doc(inline)]
    pub use ferroprof_export::*;

    /// Profiles that may wait for one exporter at most; see [`Exporter::queues_profiles`].
    pub use crate::handoff::CAPACITY as HANDOFF_CAPACITY;
}
pub mod http;
#[doc(hidden)]
pub mod internals;
pub mod labels;
pub mod perf_abi;
#[cfg(feature = "tracing")]
pub mod tracing;

mod alloc;
mod error;
mod fork;
mod forkgate;
mod forklock;
mod frame_names;
mod handoff;
mod modules;
mod notice;
mod ownthread;
mod profiler;
mod sampler;
mod settings;
mod sharded;
mod state;
mod symbolize;
mod termination;
mod threads;
mod tls;
mod unwind;

pub use alloc::{sample_weight, SamplingAllocator, DEFAULT_SAMPLING_INTERVAL};
pub use error::ProfilerError;
pub use ferroprof_recorder as recorder;
pub use profiler::{
    after_fork, Profiler, ProfilerBuilder, ProfilerGuard, ProfilerStats, DEFAULT_CPU_HZ,
    DEFAULT_MAX_PROFILE_BYTES, DEFAULT_OUTPUT_DIR, DEFAULT_PERIOD, MAX_CPU_HZ, MIN_PERIOD,
};
pub use settings::{CpuEngine, Profiles};
/// Another process's mapped objects, for symbolizing and unwinding it from outside (`record -p`).
pub use symbolize::foreign;
pub use symbolize::ProcessSymbolizer;
pub use unwind::MAX_FRAMES;
