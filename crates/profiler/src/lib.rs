//! ferroprof: continuous profiling of a running Rust process.
//!
//! * **CPU and wall time** of every thread, sampled at `cpu_hz` (100 Hz by default) by a sampler
//!   thread that asks each thread for its stack with a signal ([`sampler`](crate#cpu-and-wall)).
//! * **Allocations and live heap** through [`SamplingAllocator`], a [`std::alloc::GlobalAlloc`]
//!   wrapper that samples allocated bytes as a Poisson process (512 KiB mean by default).
//! * Stacks are unwound with DWARF CFI (`.eh_frame`), so user code built without frame pointers
//!   unwinds correctly; symbolization (inlined frames, demangled names, file and line) happens
//!   in the export thread, never on the sampled threads.
//! * Every `period` (60 s by default) a profile is serialized as pprof and handed to the
//!   exporters; the default writes timestamped `.pprof` files into a directory.
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
//!         .output_dir("./profiles")
//!         .start()?;
//!     // ... the program ...
//!     guard.stop() // writes the last profile
//! }
//! ```
//!
//! # CPU and wall
//! See the `sampler` module: a signal per thread per tick (threads that did not run since their
//! last sample are not interrupted; their unchanged stack gets the wall time), the handler only
//! unwinds into a preallocated slot. Samples carry `cpu-time` (thread CPU clock delta),
//! `wall-time` (wall clock delta), `cpu-samples` (ticks covered) and the labels `thread id` and
//! `thread name`.
//!
//! # Supported platforms
//! Linux on x86_64 and aarch64 with glibc. The profiler must be linked into the executable, or
//! into a library loaded at startup (the `ferroprof record` preload library), not into a
//! `dlopen`ed library: its signal handler reads thread-locals, which are only async-signal-safe
//! in the static TLS block. Only one profiler runs per process.

pub mod export;
pub mod http;
pub mod labels;
#[cfg(feature = "tracing")]
pub mod tracing;

mod alloc;
mod alloc_totals;
mod arena;
mod dwarf_walk;
mod error;
mod filter;
mod fork;
mod modules;
mod profiler;
mod remote;
mod sampler;
mod settings;
mod sharded;
mod state;
mod symbolize;
mod termination;
mod tls;
mod unwind;
#[cfg(target_arch = "x86_64")]
mod unwind_rules;

#[doc(hidden)]
pub use alloc::{__disable_arena, __raw_allocated, __raw_freeing};
pub use alloc::{sample_weight, SamplingAllocator, DEFAULT_SAMPLING_INTERVAL};
pub use error::ProfilerError;
pub use ferroprof_recorder as recorder;
pub use fork::after_fork;
#[doc(hidden)]
pub use fork::{__hold_lock, __walk_loader, __LOCKS};
pub use profiler::{
    Profiler, ProfilerBuilder, ProfilerGuard, ProfilerStats, DEFAULT_CPU_HZ,
    DEFAULT_MAX_PROFILE_BYTES, DEFAULT_OUTPUT_DIR, DEFAULT_PERIOD, MAX_CPU_HZ, MIN_PERIOD,
};
pub use settings::Profiles;
pub use symbolize::ProcessSymbolizer;
#[doc(hidden)]
pub use tls::{__late_own_thread, __spawn_own_thread};
pub use unwind::MAX_FRAMES;
