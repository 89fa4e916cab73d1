//! A service's set-up: the profiler configured from the environment, the network exporters the
//! environment asks for (Datadog, Pyroscope), and `/debug/pprof` on 127.0.0.1:6060. Every
//! error converts into `ProfilerError`, so `?` works throughout `main`. The README's
//! "Exporters" and "Viewing profiles".
//!
//! `cargo run --release -p ferroprof --example service -- 30` serves for 30 s; meanwhile
//! `go tool pprof -top http://127.0.0.1:6060/debug/pprof/profile?seconds=10`. With
//! `FERROPROF_PYROSCOPE_URL=http://localhost:4040` it uploads to Pyroscope, with
//! `DD_PROFILING_ENABLED=true` to the Datadog agent.

use std::time::{Duration, Instant};

use ferroprof::export::datadog::DatadogConfig;
use ferroprof::export::pyroscope::PyroscopeConfig;
use ferroprof::export::queue::network_exporters_from_env;
use ferroprof::{Profiler, ProfilerError, SamplingAllocator};
use std::alloc::System;

#[global_allocator]
static GLOBAL: SamplingAllocator<System> = SamplingAllocator::new(System);

fn main() -> Result<(), ProfilerError> {
    let seconds = std::env::args()
        .nth(1)
        .map_or(10, |s| s.parse().unwrap_or(10));

    // FERROPROF_* variables (service, tags, rates, period...); a bad value fails `start()`.
    let mut builder = Profiler::builder().service("checkout").from_env();
    // Datadog when DD_PROFILING_ENABLED=true, Pyroscope when FERROPROF_PYROSCOPE_URL is set.
    // With any of them, no ./profiles directory is written (unless FERROPROF_OUTPUT_DIR is set).
    for exporter in network_exporters_from_env()? {
        builder = builder.exporter(exporter);
    }
    let profiler = builder.start()?;
    // /debug/pprof on 127.0.0.1:6060, as Go's net/http/pprof (stops when dropped).
    let pprof = ferroprof::http::serve("127.0.0.1:6060", profiler.profile_source())?;
    println!("serving {} for {seconds} s", pprof.url());

    serve_requests(Duration::from_secs(seconds));

    pprof.stop();
    profiler.stop() // exports the last profile, waiting at most 5 s for the exporters
}

/// The exporters built in code rather than from the environment.
#[allow(dead_code)]
fn exporters_in_code() -> Result<(), ProfilerError> {
    let datadog = DatadogConfig::agent("http://127.0.0.1:8126")
        .service("checkout")
        .env("prod")
        .build()?;
    let pyroscope = PyroscopeConfig::new("http://127.0.0.1:4040", "checkout")
        .tag("region", "eu")
        .build()?;
    let profiler = Profiler::builder()
        .service("checkout")
        .exporter(datadog)
        .exporter(pyroscope)
        .start()?;
    profiler.stop()
}

/// Stands for the service's work.
fn serve_requests(run_for: Duration) {
    let end = Instant::now() + run_for;
    let mut cache: Vec<Vec<u8>> = Vec::new();
    while Instant::now() < end {
        let request = cache.len() as u64;
        let body = (0..2_000u64)
            .map(|i| (i * request) as u8)
            .collect::<Vec<_>>();
        cache.push(body);
        if cache.len() > 10_000 {
            cache.clear();
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}
