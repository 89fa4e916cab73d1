//! An axum service profiled by ferroprof, with each request's CPU, wall time, allocations and
//! live heap labelled by its route (see docs/services.md).
//!
//! ```text
//! cargo run -p ferroprof --example axum_service --features tracing
//! curl localhost:3000/users/42; curl localhost:3000/report
//! go tool pprof -tags http://127.0.0.1:6060/debug/pprof/profile?seconds=10
//! go tool pprof -tagfocus='trace endpoint=/report' -top http://127.0.0.1:6060/debug/pprof/profile?seconds=10
//! go tool pprof -tagfocus='trace endpoint=/cache' -sample_index=heap-live-size http://127.0.0.1:6060/debug/pprof/heap
//! ```
//!
//! Set `FERROPROF_EXAMPLE_SECONDS=N` to stop after N seconds (the last profile is written to
//! `./profiles` then).

use std::sync::Mutex;
use std::time::Duration;

use axum::extract::{MatchedPath, Path, Request};
use axum::routing::get;
use axum::Router;
use ferroprof::labels::{self, WithLabelsExt};
use ferroprof::tracing::FerroprofLayer;
use ferroprof::{Profiler, SamplingAllocator};
use tower_http::trace::TraceLayer;
use tracing::Instrument;
use tracing_subscriber::layer::SubscriberExt;

// Allocation and live-heap profiles: every allocation goes through the sampling allocator.
#[global_allocator]
static GLOBAL: SamplingAllocator<std::alloc::System> = SamplingAllocator::new(std::alloc::System);

/// What `/cache` keeps: its memory shows in the live heap under `trace endpoint=/cache`.
static CACHE: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

async fn user(Path(id): Path<u64>) -> String {
    // A user label for the tenant, on top of the span's labels.
    let tenant = if id % 2 == 0 { "even" } else { "odd" };
    async move { format!("user {id}: {}\n", checksum(id, 200_000)) }
        .with_labels(&[("tenant", tenant)])
        .await
}

async fn report() -> String {
    // A child span: its samples carry its own `span id` and the request's `local root span id`.
    async { format!("report: {}\n", checksum(7, 3_000_000)) }
        .instrument(tracing::info_span!("build_report"))
        .await
}

async fn cache() -> String {
    let mut c = CACHE.lock().unwrap();
    c.push(vec![1u8; 64 * 1024]);
    format!("cached {} blocks\n", c.len())
}

fn checksum(seed: u64, rounds: u64) -> u64 {
    let mut x = seed | 1;
    for i in 0..rounds {
        x = std::hint::black_box(x.rotate_left(5).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ i);
    }
    x
}

fn app() -> Router {
    Router::new()
        .route("/users/{id}", get(user))
        .route("/report", get(report))
        .route("/cache", get(cache))
        // One span per request, named after its route template: `FerroprofLayer` reads the
        // endpoint from the root span's `http.route` field.
        .layer(TraceLayer::new_for_http().make_span_with(|req: &Request| {
            let route = req
                .extensions()
                .get::<MatchedPath>()
                .map_or("unmatched", |m| m.as_str());
            tracing::info_span!("request", method = %req.method(), http.route = route)
        }))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The layer next to whatever else the service uses (fmt, OpenTelemetry, ...).
    let subscriber = tracing_subscriber::registry().with(FerroprofLayer::new());
    tracing::subscriber::set_global_default(subscriber)?;

    let profiler = Profiler::builder()
        .service("axum-example")
        .tag("env", "dev")
        .output_dir("./profiles")
        .period(Duration::from_secs(60))
        .start()?;
    // /debug/pprof on loopback, for `go tool pprof`.
    let pprof = ferroprof::http::serve("127.0.0.1:6060", profiler.profile_source())?;

    // A runtime built by hand (not #[tokio::main]) for the park hooks: parked workers' samples
    // carry `thread state=idle`, so wall time by endpoint is time spent polling requests.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .on_thread_park(labels::on_thread_park)
        .on_thread_unpark(labels::on_thread_unpark)
        .build()?;
    let seconds = std::env::var("FERROPROF_EXAMPLE_SECONDS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok());
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
        eprintln!(
            "serving on http://{}, /debug/pprof on {}",
            listener.local_addr()?,
            pprof.url()
        );
        let server = axum::serve(listener, app());
        match seconds {
            Some(s) => {
                let _ = tokio::time::timeout(Duration::from_secs(s), server).await;
            }
            None => server.await?,
        }
        pprof.stop();
        Ok::<_, std::io::Error>(())
    })?;
    drop(rt);
    // Writes the last profile.
    profiler.stop()?;
    Ok(())
}
