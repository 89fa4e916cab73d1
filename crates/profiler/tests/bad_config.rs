//! Bad configuration never panics: it is a typed error naming the value at `start()` / `build()`,
//! or, for what can only fail later (an output directory that goes away, a backend that does not
//! answer), a failure that is logged and counted while the application carries on.

mod profiler_support;

use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use ferroprof::export::datadog::DatadogConfig;
use ferroprof::export::pyroscope::PyroscopeConfig;
use ferroprof::export::queue::{ExportStatsHandle, QueueConfig};
use ferroprof::{Profiler, ProfilerError, Profiles};
use profiler_support::*;

/// One profiler per process: the tests of this file take turns.
static LOCK: Mutex<()> = Mutex::new(());

/// Keeps every log line, so tests can check that a failure was logged.
struct Capture;

static LINES: Mutex<Vec<String>> = Mutex::new(Vec::new());

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        let line = format!("{} {}", record.level(), record.args());
        LINES.lock().unwrap_or_else(|e| e.into_inner()).push(line);
    }

    fn flush(&self) {}
}

fn capture_logs() {
    static INIT: OnceLock<()> = OnceLock::new();
    INIT.get_or_init(|| {
        log::set_logger(&Capture).expect("no other logger in this test binary");
        log::set_max_level(log::LevelFilter::Trace);
    });
}

fn logged(needle: &str) -> bool {
    LINES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .any(|l| l.contains(needle))
}

fn cpu_only() -> Profiles {
    Profiles {
        cpu: true,
        wall: false,
        alloc: false,
        heap: false,
    }
}

/// `start()` must fail with an error whose message contains `needle`.
fn start_err(b: ferroprof::ProfilerBuilder, needle: &str) -> ProfilerError {
    match b.start() {
        Ok(g) => {
            let _ = g.stop();
            panic!("started with a bad setting (expected an error naming {needle:?})");
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains(needle), "{msg:?} does not name {needle:?}");
            e
        }
    }
}

fn vars(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
    move |k: &str| {
        pairs
            .iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| (*v).to_owned())
    }
}

#[test]
fn a_relative_debug_cache_directory_is_an_error_at_start() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let b = || Profiler::builder().exporter(Box::new(Collect::default()));
    let e = start_err(
        b().from_vars(vars(&[("FERROPROF_DEBUG_CACHE", "cache/debug")])),
        "FERROPROF_DEBUG_CACHE",
    );
    assert!(e.to_string().contains("cache/debug"), "{e}");
    assert!(matches!(e, ProfilerError::Env { .. }), "{e:?}");
    let e = start_err(b().debug_cache(Some(PathBuf::from("rel/dir"))), "rel/dir");
    assert!(matches!(e, ProfilerError::DebugCacheDir { .. }), "{e:?}");
    // `off` and an absolute directory start.
    for value in ["off", "/nonexistent/ferroprof-debug-cache"] {
        let get = move |k: &str| (k == "FERROPROF_DEBUG_CACHE").then(|| value.to_owned());
        b().from_vars(get)
            .start()
            .unwrap_or_else(|e| panic!("{value}: {e}"))
            .stop()
            .unwrap();
    }
}

#[test]
fn zero_and_negative_rates_are_errors_at_start() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let c = || Box::new(Collect::default());
    let b = || Profiler::builder().exporter(c());

    let e = start_err(b().cpu_hz(0), "0 Hz");
    assert!(matches!(e, ProfilerError::InvalidCpuHz { value: 0, .. }));
    let e = start_err(b().cpu_hz(u32::MAX), &u32::MAX.to_string());
    assert!(matches!(e, ProfilerError::InvalidCpuHz { .. }));
    let e = start_err(b().from_vars(vars(&[("FERROPROF_CPU_HZ", "-5")])), "-5");
    assert!(matches!(e, ProfilerError::InvalidCpuHz { value: -5, .. }));
    for (var, value) in [
        ("FERROPROF_CPU_HZ", "fast"),
        ("FERROPROF_ALLOC_INTERVAL", "-1"),
        ("FERROPROF_PERIOD_SECS", "0"),
        ("FERROPROF_PERIOD_SECS", "-1"),
        ("FERROPROF_PERIOD_SECS", "NaN"),
        ("FERROPROF_PERIOD_SECS", "inf"),
        ("FERROPROF_PROFILES", "gpu"),
        ("FERROPROF_SIGNAL", "usr1"),
    ] {
        let get = move |k: &str| (k == var).then(|| value.to_owned());
        let e = start_err(b().from_vars(get), var);
        assert!(e.to_string().contains(value), "{e} does not name {value:?}");
        assert!(matches!(e, ProfilerError::Env { .. }), "{e:?}");
    }
    let e = start_err(b().period(Duration::ZERO), "0ns");
    assert!(matches!(e, ProfilerError::InvalidPeriod { .. }));
    for sig in [0, -1, libc::SIGKILL, libc::SIGSEGV, 1000] {
        let e = start_err(b().signal(sig), &sig.to_string());
        assert!(matches!(e, ProfilerError::InvalidSignal { .. }), "{e:?}");
    }
    let e = start_err(b().from_vars(vars(&[("FERROPROF_SIGNAL", "11")])), "11");
    assert!(
        matches!(e, ProfilerError::InvalidSignal { value: 11 }),
        "{e:?}"
    );
    start_err(
        b().profiles(Profiles {
            cpu: false,
            wall: false,
            alloc: false,
            heap: false,
        }),
        "no profile",
    );
    // Allocation profiling with a zero interval is off, which leaves nothing to profile here.
    start_err(
        b().profiles(Profiles {
            cpu: false,
            wall: false,
            alloc: true,
            heap: true,
        })
        .alloc_interval_bytes(0),
        "no profile",
    );

    // None of the failed starts left anything behind: a good configuration starts.
    let g = b().profiles(cpu_only()).start().expect("a valid start");
    g.stop().expect("stops");
}

#[test]
fn unwritable_output_directory_is_an_error_at_start() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let base = temp_dir("bad-config-dir");
    let file = base.join("a-file");
    std::fs::write(&file, b"not a directory").unwrap();
    for dir in [
        file.clone(),
        file.join("below-a-file"),
        PathBuf::from("/proc/self/status/x"),
        PathBuf::from("/proc/no-such-dir"),
    ] {
        let e = start_err(
            Profiler::builder().profiles(cpu_only()).output_dir(&dir),
            &dir.display().to_string(),
        );
        assert!(matches!(e, ProfilerError::OutputDir { .. }), "{e:?}");
    }
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn output_directory_lost_while_running_is_logged_and_counted() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    capture_logs();
    let base = temp_dir("bad-config-lost");
    let dir = base.join("profiles");
    let g = Profiler::builder()
        .profiles(cpu_only())
        .period(Duration::from_secs(3600))
        .output_dir(&dir)
        .start()
        .expect("starts");
    g.flush().expect("first export works");

    // The directory becomes a file: every write into it fails.
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::write(&dir, b"in the way").unwrap();
    let err = g.flush().expect_err("export into a file fails");
    assert!(!err.to_string().is_empty());
    let stats = g.stats();
    assert!(stats.export_errors >= 1, "{stats:?}");
    assert!(
        logged(&dir.display().to_string()),
        "the failure was not logged with the path"
    );

    // Fixing the directory is enough: the next export works again.
    std::fs::remove_file(&dir).unwrap();
    std::fs::create_dir_all(&dir).unwrap();
    g.flush().expect("export works again");
    g.stop().expect("stops");
    let written = std::fs::read_dir(&dir).unwrap().count();
    assert!(written >= 2, "{written} profiles written after recovery");
    let _ = std::fs::remove_dir_all(&base);
}

/// A local port nobody listens on (connections are refused at once).
fn closed_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

fn fast_failing_queue() -> QueueConfig {
    QueueConfig {
        capacity: 2,
        timeout: Duration::from_millis(500),
        max_attempts: 2,
        backoff_initial: Duration::from_millis(10),
        backoff_max: Duration::from_millis(20),
    }
}

/// Waits (bounded) until the exporter gave up on at least one profile.
fn wait_failed(h: &ExportStatsHandle) -> u64 {
    let end = Instant::now() + Duration::from_secs(60);
    while Instant::now() < end {
        let s = h.get();
        if s.failed >= 1 {
            return s.failed;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    h.get().failed
}

#[test]
fn unreachable_backends_fail_later_logged_and_counted_never_blocking() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    capture_logs();
    let port = closed_port();
    let url = format!("http://127.0.0.1:{port}");
    let dd = DatadogConfig::agent(&url)
        .service("bad-config")
        .queue(fast_failing_queue())
        .build()
        .expect("an unreachable agent is only known when sending");
    let dd_unix = DatadogConfig::agent_unix("/nonexistent/ferroprof/apm.socket")
        .queue(fast_failing_queue())
        .build()
        .expect("a missing socket is only known when sending");
    let pyro = PyroscopeConfig::new(&url, "bad-config")
        .queue(fast_failing_queue())
        .build()
        .expect("an unreachable server is only known when sending");
    let handles = [
        dd.stats_handle(),
        dd_unix.stats_handle(),
        pyro.stats_handle(),
    ];
    let g = Profiler::builder()
        .profiles(cpu_only())
        .period(Duration::from_secs(3600))
        .exporter(Box::new(dd))
        .exporter(Box::new(dd_unix))
        .exporter(Box::new(pyro))
        .start()
        .expect("starts");
    // Handing profiles over never waits for the network.
    for _ in 0..3 {
        g.flush().expect("queued");
    }
    for h in &handles {
        assert!(wait_failed(h) >= 1, "no failure counted: {:?}", h.get());
    }
    let stats = g.stats();
    assert_eq!(
        stats.export_errors, 0,
        "queued exports are not errors of the loop"
    );
    g.stop().expect("stops even with every backend down");
    for h in &handles {
        let s = h.get();
        assert_eq!(s.sent, 0);
        // Every profile handed over is accounted for: failed, or dropped from the full queue or
        // at shutdown.
        assert!(s.failed + s.dropped >= 3, "{s:?}");
    }
    for name in ["datadog", "pyroscope"] {
        assert!(
            logged(&format!("ferroprof: {name} exporter")),
            "no log line for {name}"
        );
    }
}

#[test]
fn invalid_backend_configuration_is_an_error_at_build() {
    let clear = |e: ferroprof::export::ExportError, needle: &str| {
        let msg = e.to_string();
        assert!(msg.contains(needle), "{msg:?} does not name {needle:?}");
    };
    let no_queue = QueueConfig {
        capacity: 0,
        ..QueueConfig::default()
    };
    clear(
        DatadogConfig::agent("http://127.0.0.1:8126")
            .queue(no_queue.clone())
            .build()
            .err()
            .expect("capacity 0"),
        "capacity",
    );
    let no_attempts = QueueConfig {
        max_attempts: 0,
        ..QueueConfig::default()
    };
    clear(
        PyroscopeConfig::new("http://127.0.0.1:4040", "app")
            .queue(no_attempts)
            .build()
            .err()
            .expect("0 attempts"),
        "attempts",
    );
    let no_timeout = QueueConfig {
        timeout: Duration::ZERO,
        ..QueueConfig::default()
    };
    clear(
        PyroscopeConfig::new("http://127.0.0.1:4040", "app")
            .queue(no_timeout)
            .build()
            .err()
            .expect("zero timeout"),
        "timeout",
    );
    clear(
        PyroscopeConfig::new("ftp://example.invalid", "app")
            .build()
            .err()
            .expect("not http"),
        "ftp://example.invalid",
    );
    clear(
        PyroscopeConfig::new("http://127.0.0.1:4040", "  ")
            .build()
            .err()
            .expect("empty app"),
        "empty",
    );
    for url in ["localhost:8126", "ftp://agent", ""] {
        clear(
            DatadogConfig::agent(url)
                .build()
                .err()
                .expect("agent URL without http(s)"),
            &format!("{url:?}"),
        );
    }
    for url in [
        "ftp://agent",
        "agent:8126",
        "http://",
        "unix://relative/path",
    ] {
        clear(
            ferroprof::export::datadog::DatadogTarget::from_agent_url(url)
                .expect_err("bad agent URL"),
            url,
        );
    }
    for (var, value) in [
        ("DD_TRACE_AGENT_PORT", "99999"),
        ("DD_TRACE_AGENT_PORT", "0"),
        ("DD_TRACE_AGENT_PORT", "-1"),
        ("DD_TRACE_AGENT_URL", "localhost:8126"),
        ("FERROPROF_EXPORT_TIMEOUT_MS", "soon"),
        ("FERROPROF_EXPORT_QUEUE_CAPACITY", "-4"),
        ("FERROPROF_EXPORT_QUEUE_CAPACITY", "0"),
        ("FERROPROF_EXPORT_MAX_ATTEMPTS", "0"),
        ("DD_PROFILING_AGENTLESS", "maybe"),
    ] {
        let get = move |k: &str| (k == var).then(|| value.to_owned());
        let e = DatadogConfig::from_lookup(&get)
            .err()
            .unwrap_or_else(|| panic!("{var}={value} accepted"));
        let msg = e.to_string();
        assert!(
            msg.contains(var) || msg.contains(value),
            "{msg:?} names neither {var} nor {value:?}"
        );
    }
    // Agentless without a key: the error names the variable, never a key value.
    let get = |k: &str| (k == "DD_PROFILING_AGENTLESS").then(|| "true".to_owned());
    clear(
        DatadogConfig::from_lookup(&get).expect_err("no key"),
        "DD_API_KEY",
    );
}
