//! The bounded export queue: drops when the backend is down, timeouts against a stalled backend,
//! retries on 5xx but not 4xx, flushing at shutdown; `export` never blocks the caller.

mod export_support;

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use export_support::*;
use ferroprof::export::pyroscope::PyroscopeConfig;
use ferroprof::export::queue::{
    network_exporters_from_lookup, Backend, ExportStats, QueueConfig, QueuedExporter,
};
use ferroprof::export::{ExportError, ExportedProfile, Exporter};

fn fast_queue() -> QueueConfig {
    QueueConfig {
        capacity: 2,
        timeout: Duration::from_millis(500),
        max_attempts: 3,
        backoff_initial: Duration::from_millis(20),
        backoff_max: Duration::from_millis(100),
    }
}

/// Waits until `pred(stats)` holds; panics with the stats after 30 s.
fn wait_stats(
    get: impl Fn() -> ExportStats,
    what: &str,
    pred: impl Fn(&ExportStats) -> bool,
) -> ExportStats {
    wait_for(Duration::from_secs(30), || {
        let s = get();
        pred(&s).then_some(s)
    })
    .unwrap_or_else(|| panic!("timed out waiting for {what}; stats: {:?}", get()))
}

/// A backend whose `send` blocks until the test lets it go, so queue states are exact.
struct GatedBackend {
    entered: mpsc::Sender<()>,
    go: Arc<Mutex<mpsc::Receiver<Result<(), ExportError>>>>,
}

impl Backend for GatedBackend {
    fn name(&self) -> &str {
        "gated"
    }
    fn target(&self) -> String {
        "test gate".into()
    }
    fn send(&mut self, _p: &ExportedProfile, _t: Duration) -> Result<(), ExportError> {
        let _ = self.entered.send(());
        self.go
            .lock()
            .unwrap()
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or(Ok(()))
    }
}

#[test]
fn full_queue_drops_the_oldest_and_counts_it() {
    let _ = captured_logs();
    let (entered_tx, entered_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel();
    let backend = GatedBackend {
        entered: entered_tx,
        go: Arc::new(Mutex::new(go_rx)),
    };
    let mut exp = QueuedExporter::new(backend, fast_queue()).unwrap();
    let p = exported_profile();

    exp.export(&p).unwrap();
    // The worker holds profile 1 in flight; the queue (capacity 2) then takes 2 and 3.
    entered_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("worker picked up the first profile");
    for _ in 0..10 {
        exp.export(&p).unwrap();
    }
    let s = exp.stats();
    assert_eq!(s.queued, 2, "{s:?}");
    assert_eq!(s.dropped, 8, "{s:?}");
    assert!(captured_logs()
        .iter()
        .any(|l| l.contains("dropped the oldest profile")));

    for _ in 0..3 {
        go_tx.send(Ok(())).unwrap();
    }
    let s = wait_stats(|| exp.stats(), "3 sent", |s| s.sent == 3);
    assert_eq!((s.failed, s.dropped, s.queued), (0, 8, 0));
    exp.shutdown(Duration::from_secs(5));
}

#[test]
fn backend_down_counts_drops_and_never_blocks_the_caller() {
    let logs_before = captured_logs().len();
    // A port nobody listens on: connections are refused.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let cfg = PyroscopeConfig::new(&format!("http://127.0.0.1:{port}"), "down").queue(fast_queue());
    let mut exp = cfg.build().unwrap();
    let stats = exp.stats_handle();
    let p = exported_profile();

    let began = Instant::now();
    for _ in 0..20 {
        exp.export(&p).unwrap();
    }
    let took = began.elapsed();
    // Enqueueing copies the profile and returns; 20 of them take microseconds. The bound is
    // generous: it only fails if export waited on the network.
    assert!(took < Duration::from_secs(2), "20 exports took {took:?}");

    // Profiles that got a try fail after retries; all others are dropped.
    let s = wait_stats(
        || stats.get(),
        "everything failed or dropped",
        |s| s.failed + s.dropped == 20,
    );
    assert_eq!(s.sent, 0);
    assert!(
        s.dropped >= 20 - 3,
        "at most the in-flight one and 2 queued get a try: {s:?}"
    );
    assert!(s.retries >= 2, "connection errors are retried: {s:?}");
    let logs = captured_logs()[logs_before..].join("\n");
    assert!(logs.contains("cannot reach backend pyroscope"), "{logs}");
    assert!(logs.contains("retrying in"), "{logs}");
    exp.shutdown(Duration::from_secs(1));
}

#[test]
fn stalled_backend_times_out_without_stalling_the_app() {
    let _ = captured_logs();
    let rx = Receiver::start(Behavior::Stall);
    let mut q = fast_queue();
    q.timeout = Duration::from_millis(300);
    q.max_attempts = 2;
    let mut exp = PyroscopeConfig::new(&rx.url(), "slow")
        .queue(q)
        .build()
        .unwrap();
    let p = exported_profile();

    let began = Instant::now();
    for _ in 0..5 {
        exp.export(&p).unwrap();
    }
    // The receiver stalls for up to 60 s: returning well before means export did not wait.
    assert!(
        began.elapsed() < Duration::from_secs(2),
        "exports took {:?}",
        began.elapsed()
    );

    let s = wait_stats(|| exp.stats(), "a timed-out profile", |s| s.failed >= 1);
    assert!(s.retries >= 1, "{s:?}");
    assert!(
        captured_logs()
            .iter()
            .any(|l| l.contains("pyroscope timed out after 300ms")),
        "no timeout log line: {:#?}",
        captured_logs()
    );
    rx.release();
    exp.shutdown(Duration::from_millis(200));
}

#[test]
fn retries_5xx_then_succeeds() {
    let rx = Receiver::start(Behavior::Sequence(vec![503, 502, 200]));
    let mut exp = PyroscopeConfig::new(&rx.url(), "flaky")
        .queue(fast_queue())
        .build()
        .unwrap();
    exp.export(&exported_profile()).unwrap();
    let s = wait_stats(|| exp.stats(), "sent", |s| s.sent == 1);
    assert_eq!((s.retries, s.failed, s.dropped), (2, 0, 0));
    assert_eq!(rx.requests().len(), 3);
    exp.shutdown(Duration::from_secs(1));
}

#[test]
fn does_not_retry_4xx() {
    let _ = captured_logs();
    let rx = Receiver::start(Behavior::Status(400));
    let mut exp = PyroscopeConfig::new(&rx.url(), "bad")
        .queue(fast_queue())
        .build()
        .unwrap();
    exp.export(&exported_profile()).unwrap();
    let s = wait_stats(|| exp.stats(), "failed", |s| s.failed == 1);
    assert_eq!(s.retries, 0);
    // `failed` is final: no further request can follow.
    assert_eq!(rx.requests().len(), 1);
    assert!(captured_logs()
        .iter()
        .any(|l| l.contains("HTTP 400") && l.contains("not retryable")));
    exp.shutdown(Duration::from_secs(1));
}

#[test]
fn shutdown_flushes_the_queue() {
    let rx = Receiver::start(Behavior::Status(200));
    let mut q = fast_queue();
    q.capacity = 8;
    let mut exp = PyroscopeConfig::new(&rx.url(), "flush")
        .queue(q)
        .build()
        .unwrap();
    let p = exported_profile();
    for _ in 0..5 {
        exp.export(&p).unwrap();
    }
    exp.shutdown(Duration::from_secs(20));
    let s = exp.stats();
    assert_eq!((s.sent, s.dropped, s.queued), (5, 0, 0), "{s:?}");
    // After shutdown nothing is accepted, but export still returns at once.
    exp.export(&p).unwrap();
    assert_eq!(exp.stats().dropped, 1);
}

#[test]
fn environment_picks_the_network_exporters() {
    let none = network_exporters_from_lookup(&|_| None).unwrap();
    assert!(none.is_empty());
    let env = |k: &str| match k {
        "DD_PROFILING_ENABLED" => Some("true".to_owned()),
        "DD_TRACE_AGENT_URL" => Some("http://127.0.0.1:9".to_owned()),
        "FERROPROF_PYROSCOPE_URL" => Some("http://127.0.0.1:9".to_owned()),
        _ => None,
    };
    let mut both = network_exporters_from_lookup(&env).unwrap();
    let names: Vec<&str> = both.iter().map(|e| e.name()).collect();
    assert_eq!(names, ["datadog", "pyroscope"]);
    for e in &mut both {
        e.shutdown(Duration::from_millis(100));
    }
    let bad = |k: &str| (k == "FERROPROF_DATADOG").then(|| "sometimes".to_owned());
    let e = network_exporters_from_lookup(&bad)
        .err()
        .expect("bad boolean");
    assert!(
        e.to_string().contains("FERROPROF_DATADOG=\"sometimes\""),
        "{e}"
    );
}
