//! Profiling as an option: a bad setting (`FERROPROF_CPU_HZ=abc`) or any other reason the
//! profiler cannot start is logged, and the program runs on without profiling. The README's
//! "When profiling cannot start".
//!
//! `FERROPROF_CPU_HZ=abc cargo run -p ferroprof --example start_or_log` prints
//! `ferroprof: profiling is off: environment variable FERROPROF_CPU_HZ="abc" is invalid:
//! expected an integer (Hz)` and carries on.

use ferroprof::{Profiler, SamplingAllocator};
use std::alloc::System;

#[global_allocator]
static GLOBAL: SamplingAllocator<System> = SamplingAllocator::new(System);

fn main() {
    // `None` when profiling could not start; the reason went to the log (or to stderr when the
    // program installed no logger).
    let profiler = Profiler::builder().from_env().start_or_log();

    run_the_program();

    if let Some(profiler) = profiler {
        if let Err(e) = profiler.stop() {
            eprintln!("the last profile was not written: {e}");
        }
    }
}

fn run_the_program() {
    let total: u64 = (0..10_000_000u64).map(|i| i % 7).sum();
    println!("the program ran: {total}");
}
