//! What the profiler tells the person running the program when something is off at start: a
//! forgotten `#[global_allocator]` (a log line at start, and the answer of `/debug/pprof/heap`
//! and `/debug/pprof/allocs`), and a bad setting under `start_or_log` (logged, the program runs
//! on unprofiled). With no logger installed, both lines go to stderr.
//!
//! This test binary deliberately has no `#[global_allocator]`.

mod child_support;
mod profiler_support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use child_support::{is_child, run_child};
use ferroprof::{Profiler, Profiles};
use profiler_support::Collect;

/// One profiler per process: the tests of this file take turns.
static LOCK: Mutex<()> = Mutex::new(());

/// What the start-up line says (and the heap answer).
const MISSING: &str = "no allocation went through ferroprof::SamplingAllocator";

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

fn logged(needle: &str) -> Vec<String> {
    LINES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .filter(|l| l.contains(needle))
        .cloned()
        .collect()
}

fn get(addr: SocketAddr, target: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        s,
        "GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .to_owned();
    (status, body)
}

#[test]
fn a_forgotten_global_allocator_is_logged_at_start_and_explained_by_pprof_heap() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    capture_logs();
    let before = logged(MISSING).len();
    let guard = Profiler::builder()
        .exporter(Collect::default())
        .period(Duration::from_secs(3600))
        .start()
        .expect("starts");
    assert!(!guard.allocator_installed());
    let lines = logged(MISSING);
    assert_eq!(lines.len(), before + 1, "{lines:?}");
    let line = lines.last().unwrap();
    assert!(line.starts_with("WARN ferroprof: "), "{line}");
    assert!(line.contains("#[global_allocator]"), "{line}");

    let server = ferroprof::http::serve("127.0.0.1:0", guard.profile_source()).unwrap();
    for target in ["/debug/pprof/heap", "/debug/pprof/allocs?seconds=1"] {
        let (status, body) = get(server.addr(), target);
        assert_eq!(status, 500, "{target}: {body}");
        assert!(body.contains(MISSING), "{target}: {body}");
        assert!(body.contains("#[global_allocator]"), "{target}: {body}");
    }
    // CPU profiles are not concerned.
    let (status, body) = get(server.addr(), "/debug/pprof/profile?seconds=1");
    assert_eq!(status, 200, "{body}");
    server.stop();
    guard.stop().expect("stops");

    // Without allocation profiles there is nothing to say.
    let guard = Profiler::builder()
        .exporter(Collect::default())
        .profiles(Profiles {
            cpu: true,
            wall: true,
            alloc: false,
            heap: false,
        })
        .start()
        .expect("starts");
    guard.stop().expect("stops");
    assert_eq!(logged(MISSING).len(), before + 1);
}

/// With no logger installed, the line goes to stderr (it would be lost otherwise).
#[test]
fn without_a_logger_the_forgotten_allocator_line_goes_to_stderr() {
    const NAME: &str = "without_a_logger_the_forgotten_allocator_line_goes_to_stderr";
    if is_child(NAME) {
        let guard = Profiler::builder()
            .exporter(Collect::default())
            .start()
            .expect("starts");
        guard.stop().expect("stops");
        return;
    }
    let out = run_child(NAME, &[], Duration::from_secs(60));
    assert!(out.status.success(), "{}", out.describe());
    let lines: Vec<&str> = out.stderr.lines().filter(|l| l.contains(MISSING)).collect();
    assert_eq!(lines.len(), 1, "{}", out.describe());
    assert!(lines[0].starts_with("ferroprof: "), "{}", lines[0]);
}

#[test]
fn start_or_log_logs_a_bad_setting_and_the_program_runs_on() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    capture_logs();
    let guard = Profiler::builder()
        .exporter(Collect::default())
        .from_vars(|k| (k == "FERROPROF_CPU_HZ").then(|| "abc".to_owned()))
        .start_or_log();
    assert!(guard.is_none());
    let lines = logged("FERROPROF_CPU_HZ");
    assert_eq!(
        lines,
        [
            "WARN ferroprof: profiling is off: environment variable FERROPROF_CPU_HZ=\"abc\" \
             is invalid: expected an integer (Hz)"
        ]
    );

    // A good configuration starts as `start()` does.
    let guard = Profiler::builder()
        .exporter(Collect::default())
        .profiles(profiler_support::cpu_wall())
        .start_or_log()
        .expect("starts");
    guard.stop().expect("stops");
}

#[test]
fn start_or_log_without_a_logger_writes_to_stderr() {
    const NAME: &str = "start_or_log_without_a_logger_writes_to_stderr";
    if is_child(NAME) {
        let guard = Profiler::builder().from_env().start_or_log();
        assert!(guard.is_none());
        println!("ran-on=1");
        return;
    }
    let out = run_child(
        NAME,
        &[("FERROPROF_CPU_HZ", "abc")],
        Duration::from_secs(60),
    );
    assert!(out.status.success(), "{}", out.describe());
    assert_eq!(out.value("ran-on"), Some(1), "{}", out.describe());
    assert!(
        out.stderr.contains(
            "ferroprof: profiling is off: environment variable FERROPROF_CPU_HZ=\"abc\" is \
             invalid: expected an integer (Hz)\n"
        ),
        "{}",
        out.describe()
    );
}
