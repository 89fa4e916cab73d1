//! The CPU split by route of an axum service against the routes' own thread CPU clocks: six
//! routes, among them short work after a timer wake-up (the case a CPU timer checked at the
//! kernel's tick mis-weighs), loaded by keep-alive clients for a number of seconds (default 20)
//! at a CPU sampling rate (default 100 Hz).
//! Prints each route's share of the profile's `cpu-time` (by `trace endpoint`) next to its
//! share of the CPU its handlers measured, and a `RESULT` line with the worst error in points.
//!
//! ```text
//! cargo run --release -p ferroprof --features tracing --example route_shares -- [SECONDS [HZ]]
//! ```
//!
//! `FERROPROF_CPU_ENGINE` picks the CPU engine; `scripts/route_shares.sh` runs it many times per
//! engine.

mod support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{MatchedPath, Request};
use axum::routing::get;
use axum::Router;
use ferroprof::export::{ExportError, ExportedProfile, Exporter};
use ferroprof::labels;
use ferroprof::tracing::FerroprofLayer;
use ferroprof::{Profiler, Profiles};
use tower_http::trace::TraceLayer;
use tracing_subscriber::layer::SubscriberExt;

use support::{thread_cpu_ns, KeepAlive};

/// A route: its path, the timer waits and CPU bursts of one request (in order, microseconds;
/// a wait of 0 means none), and how often clients ask for it (relative weight).
struct Route {
    path: &'static str,
    steps: &'static [(u64, u64)],
    weight: u64,
}

const ROUTES: [Route; 6] = [
    // Short work right after a timer wake-up: starts at a fixed phase after a tick.
    Route {
        path: "/after-sleep",
        steps: &[(5_000, 200)],
        weight: 4,
    },
    Route {
        path: "/light",
        steps: &[(0, 400)],
        weight: 3,
    },
    Route {
        path: "/medium",
        steps: &[(0, 1_600)],
        weight: 2,
    },
    Route {
        path: "/heavy",
        steps: &[(0, 4_000)],
        weight: 1,
    },
    Route {
        path: "/two-waits",
        steps: &[(2_000, 1_000), (1_000, 500)],
        weight: 2,
    },
    Route {
        path: "/burst",
        steps: &[(0, 800)],
        weight: 2,
    },
];

/// Thread CPU time each route's handlers spent in their bursts.
static CPU_NS: [AtomicU64; 6] = [const { AtomicU64::new(0) }; 6];
static SERVED: [AtomicU64; 6] = [const { AtomicU64::new(0) }; 6];

/// Multiply-rotate steps between two reads of the thread's CPU clock in [`burn`]: about 25 µs
/// of user-space work per read (`FERROPROF_ROUTE_SPIN` changes it). Each read is a system call;
/// at 200 steps a fifth of a handler's CPU was in the kernel, which the perf engine's
/// user-space events do not sample (see docs/architecture.md).
fn spin_per_check() -> u32 {
    static SPIN: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *SPIN.get_or_init(|| {
        std::env::var("FERROPROF_ROUTE_SPIN")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(20_000)
    })
}

/// Spins until this thread has spent `us` more microseconds of CPU; the CPU spent.
#[inline(never)]
fn burn(us: u64) -> u64 {
    let t0 = thread_cpu_ns();
    let mut x = t0 | 1;
    let spin = spin_per_check();
    while thread_cpu_ns() - t0 < us * 1_000 {
        for _ in 0..spin {
            x = std::hint::black_box(x.rotate_left(5).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        }
    }
    std::hint::black_box(x);
    thread_cpu_ns() - t0
}

async fn handle(r: usize) -> &'static str {
    for &(wait_us, work_us) in ROUTES[r].steps {
        if wait_us > 0 {
            tokio::time::sleep(Duration::from_micros(wait_us)).await;
        }
        CPU_NS[r].fetch_add(burn(work_us), Ordering::Relaxed);
    }
    SERVED[r].fetch_add(1, Ordering::Relaxed);
    "ok"
}

fn app() -> Router {
    let mut router = Router::new();
    for (i, r) in ROUTES.iter().enumerate() {
        router = router.route(r.path, get(move || handle(i)));
    }
    router.layer(TraceLayer::new_for_http().make_span_with(|req: &Request| {
        let route = req
            .extensions()
            .get::<MatchedPath>()
            .map_or("unmatched", |m| m.as_str());
        tracing::info_span!("request", http.route = route)
    }))
}

/// A keep-alive client asking for routes at random (by weight) until `until`.
fn client(addr: SocketAddr, until: Instant, seed: u64) {
    let mut conn = KeepAlive::connect(addr);
    let total: u64 = ROUTES.iter().map(|r| r.weight).sum();
    let mut x = seed | 1;
    while Instant::now() < until {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let mut pick = x % total;
        let route = ROUTES
            .iter()
            .find(|r| {
                let hit = pick < r.weight;
                pick = pick.saturating_sub(r.weight);
                hit
            })
            .expect("a route");
        conn.get(route.path);
    }
}

/// Keeps every exported profile.
#[derive(Clone, Default)]
struct Keep(Arc<Mutex<Vec<Vec<u8>>>>);

impl Exporter for Keep {
    fn name(&self) -> &str {
        "keep"
    }

    fn export(&mut self, p: &ExportedProfile) -> Result<(), ExportError> {
        self.0.lock().expect("keep").push(p.encoded.bytes.to_vec());
        Ok(())
    }
}

fn main() {
    let secs: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(20);
    let hz: u32 = std::env::args()
        .nth(2)
        .and_then(|a| a.parse().ok())
        .unwrap_or(100);
    let subscriber = tracing_subscriber::registry().with(FerroprofLayer::new());
    tracing::subscriber::set_global_default(subscriber).expect("subscriber");
    let keep = Keep::default();
    let guard = Profiler::builder()
        .service("route-shares")
        .cpu_hz(hz)
        .profiles(Profiles {
            cpu: true,
            wall: true,
            alloc: false,
            heap: false,
        })
        .period(Duration::from_secs(3600))
        .exporter(Box::new(keep.clone()))
        .from_vars(|k| {
            (k == "FERROPROF_CPU_ENGINE")
                .then(|| std::env::var(k).ok())
                .flatten()
        })
        .start()
        .expect("profiler starts");
    let engine = guard.stats().cpu_engine;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .on_thread_park(labels::on_thread_park)
        .on_thread_unpark(labels::on_thread_unpark)
        .build()
        .expect("runtime");
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    rt.spawn(async move { axum::serve(listener, app()).await });
    let until = Instant::now() + Duration::from_secs(secs);
    let clients: Vec<_> = (0..4u64)
        .map(|i| std::thread::spawn(move || client(addr, until, 0x5eed ^ (i * 7919) ^ secs)))
        .collect();
    for c in clients {
        c.join().expect("client");
    }
    rt.shutdown_timeout(Duration::from_secs(5));
    let stats = guard.stats();
    guard.stop().expect("profiler stops");

    let profiles: Vec<_> = keep
        .0
        .lock()
        .expect("keep")
        .iter()
        .map(|b| ferroprof_pprof::decode(b).expect("profile decodes"))
        .collect();
    let mut by_route = [0i64; 6];
    let mut in_requests = 0i64;
    for p in &profiles {
        let Some(cpu) = p.value_index("cpu-time") else {
            continue;
        };
        for s in &p.sample {
            let Some(ep) = p.label_str(s, "trace endpoint") else {
                continue;
            };
            in_requests += s.value[cpu];
            if let Some(i) = ROUTES.iter().position(|r| r.path == ep) {
                by_route[i] += s.value[cpu];
            }
        }
    }
    let truth: u64 = CPU_NS.iter().map(|c| c.load(Ordering::Relaxed)).sum();
    println!(
        "cpu engine {engine}, {hz} Hz, {secs} s, {} CPU samples, profile {:.2} s in requests, handlers {:.2} s",
        stats.cpu_samples,
        in_requests as f64 / 1e9,
        truth as f64 / 1e9
    );
    let mut worst = 0f64;
    for (i, r) in ROUTES.iter().enumerate() {
        let share = 100.0 * by_route[i] as f64 / in_requests.max(1) as f64;
        let want = 100.0 * CPU_NS[i].load(Ordering::Relaxed) as f64 / truth.max(1) as f64;
        worst = worst.max((share - want).abs());
        println!(
            "{:<14} {:>6} requests  profile {share:5.2}%  handlers {want:5.2}%  error {:+.2} points",
            r.path,
            SERVED[i].load(Ordering::Relaxed),
            share - want
        );
    }
    println!("RESULT engine={engine} worst_points={worst:.2}");
}
