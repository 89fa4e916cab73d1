//! Lines meant for the person running the program: a profiler that cannot start, profiles that
//! will stay empty. They go through the `log` crate like every other line of ferroprof; with no
//! logger installed they would be lost, so they go to stderr then.

use crate::settings::Profiles;

/// Logs `message` at `level`, or writes it to stderr when logging is off (no logger installed:
/// `log`'s maximum level stays `Off` until one sets it).
pub(crate) fn notice(level: log::Level, message: std::fmt::Arguments<'_>) {
    if log::max_level() == log::LevelFilter::Off {
        eprintln!("{message}");
    } else {
        log::log!(level, "{message}");
    }
}

/// Why the allocation profiles are empty when no allocation reaches the sampling allocator:
/// logged at start, and the answer of `/debug/pprof/heap` and `/debug/pprof/allocs`.
pub(crate) fn allocator_missing(profiles: Profiles) -> String {
    let which = match (profiles.alloc, profiles.heap) {
        (true, true) => "allocation and heap profiles",
        (true, false) => "allocation profile",
        _ => "heap profile",
    };
    format!(
        "no allocation went through ferroprof::SamplingAllocator, so the {which} stay empty: \
         declare it in the executable with `#[global_allocator] static GLOBAL: \
         ferroprof::SamplingAllocator<std::alloc::System> = \
         ferroprof::SamplingAllocator::new(std::alloc::System);`, or profile CPU and wall time \
         only (FERROPROF_PROFILES=cpu,wall)"
    )
}
