//! The /debug/pprof server under a burst of simultaneous clients: past the concurrency cap and
//! the reading slots each client is answered (`503`), never disconnected without a status line.
//!
//! Every client is bounded in time (a 30 s read deadline), so a server that misbehaves makes a
//! test fail, not hang.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{mpsc, Arc, Barrier};
use std::time::{Duration, Instant};

use ferroprof::export::ProfileSource;
use ferroprof::http::{serve_with, HttpConfig, PprofServer};

const CLIENTS: usize = 50;
/// Generous: the test must hold on a loaded two-core machine.
const CLIENT_LIMIT: Duration = Duration::from_secs(30);

/// Profiles whose capture sleeps the whole duration, so the requests hold their slots.
struct SleepySource;

impl ProfileSource for SleepySource {
    fn cpu_profile(&self, d: Duration) -> Result<Vec<u8>, String> {
        std::thread::sleep(d);
        Ok(b"profile".to_vec())
    }
    fn heap_profile(&self) -> Result<Vec<u8>, String> {
        Ok(b"heap".to_vec())
    }
    fn allocs_profile(&self, d: Duration) -> Result<Vec<u8>, String> {
        std::thread::sleep(d);
        Ok(b"allocs".to_vec())
    }
}

/// What one client saw.
#[derive(Debug)]
struct Outcome {
    target: &'static str,
    /// The status line, if any arrived.
    status_line: Option<String>,
    /// The first I/O error, if any (a reset instead of an answer, say).
    error: Option<ErrorKind>,
    bytes: usize,
}

impl Outcome {
    fn status(&self) -> Option<u16> {
        self.status_line
            .as_deref()?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    }
}

/// Sends a whole GET in one segment and reads until the server closes (or `CLIENT_LIMIT`).
fn exchange(mut s: TcpStream, target: &'static str) -> Outcome {
    let mut out = Outcome {
        target,
        status_line: None,
        error: None,
        bytes: 0,
    };
    let _ = s.set_nodelay(true);
    let head = format!("GET {target} HTTP/1.1\r\nHost: test\r\n\r\n");
    if let Err(e) = s.write_all(head.as_bytes()) {
        // The answer may still be there to read: a server that answers before reading.
        out.error = Some(e.kind());
    }
    let end = Instant::now() + CLIENT_LIMIT;
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            out.error.get_or_insert(ErrorKind::TimedOut);
            break;
        }
        s.set_read_timeout(Some(left)).unwrap();
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => {
                out.error.get_or_insert(e.kind());
                break;
            }
        }
    }
    out.bytes = raw.len();
    out.status_line = raw
        .split(|&b| b == b'\n')
        .next()
        .filter(|l| l.starts_with(b"HTTP/"))
        .map(|l| String::from_utf8_lossy(l).trim_end().to_owned());
    out
}

/// `CLIENTS` threads released together by a barrier; `connect_first` connects them all before
/// the barrier (so the server has every connection before any request head), otherwise each
/// connects and sends right after it.
fn burst(addr: SocketAddr, connect_first: bool, target: fn(usize) -> &'static str) -> Vec<Outcome> {
    let barrier = Arc::new(Barrier::new(CLIENTS));
    let threads: Vec<_> = (0..CLIENTS)
        .map(|i| {
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let early = connect_first.then(|| TcpStream::connect(addr));
                barrier.wait();
                let stream = match early.unwrap_or_else(|| TcpStream::connect(addr)) {
                    Ok(s) => s,
                    Err(e) => {
                        return Outcome {
                            target: target(i),
                            status_line: None,
                            error: Some(e.kind()),
                            bytes: 0,
                        }
                    }
                };
                exchange(stream, target(i))
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// Every client got `200` or `503`; at least one was served.
fn check(what: &str, outcomes: &[Outcome], config: &HttpConfig) {
    let count = |code| outcomes.iter().filter(|o| o.status() == Some(code)).count();
    let (ok, busy) = (count(200), count(503));
    let bad: Vec<_> = outcomes
        .iter()
        .filter(|o| !matches!(o.status(), Some(200 | 503)))
        .collect();
    let mut served: Vec<_> = outcomes
        .iter()
        .filter(|o| o.status() == Some(200))
        .map(|o| o.target)
        .collect();
    served.sort_unstable();
    eprintln!(
        "{what}: {ok} x 200, {busy} x 503, {} without one (max_concurrent {}); served {served:?}",
        bad.len(),
        config.max_concurrent
    );
    assert!(
        bad.is_empty(),
        "{what}: {} of {CLIENTS} clients got no 200 or 503 ({ok} x 200, {busy} x 503): {bad:#?}",
        bad.len()
    );
    assert!(ok >= 1, "{what}: nobody was served: {outcomes:#?}");
}

/// Runs `server.stop()` on a thread; `None` if it has not returned after 10 s.
fn timed_stop(server: PprofServer) -> Option<Duration> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let start = Instant::now();
        server.stop();
        let _ = tx.send(start.elapsed());
    });
    rx.recv_timeout(Duration::from_secs(10)).ok()
}

fn start(config: &HttpConfig) -> PprofServer {
    serve_with("127.0.0.1:0", Arc::new(SleepySource), config.clone()).unwrap()
}

#[test]
fn fifty_simultaneous_profile_requests_each_get_200_or_503() {
    let config = HttpConfig::default();
    let server = start(&config);
    let outcomes = burst(server.addr(), false, |_| "/debug/pprof/profile?seconds=1");
    check("50 profile requests at once", &outcomes, &config);
    let took = timed_stop(server);
    assert!(took.is_some_and(|d| d < Duration::from_secs(1)), "{took:?}");
}

/// All connected before any sends its head: more connections than reading slots, so some are
/// displaced before their request arrives. They too get an answer.
#[test]
fn fifty_connections_before_any_request_each_get_200_or_503() {
    let config = HttpConfig::default();
    let server = start(&config);
    let outcomes = burst(server.addr(), true, |i| match i % 3 {
        0 => "/debug/pprof/",
        1 => "/debug/pprof/heap",
        _ => "/debug/pprof/profile?seconds=1",
    });
    check("50 connections, then their requests", &outcomes, &config);
    let took = timed_stop(server);
    assert!(took.is_some_and(|d| d < Duration::from_secs(1)), "{took:?}");
}

/// Fewer slots than the defaults, so both limits are far exceeded.
#[test]
fn a_burst_far_beyond_small_limits_is_answered() {
    let config = HttpConfig {
        max_concurrent: 1,
        max_reading: 2,
        ..HttpConfig::default()
    };
    let server = start(&config);
    let outcomes = burst(server.addr(), false, |i| {
        if i % 2 == 0 {
            "/debug/pprof/allocs?seconds=1"
        } else {
            "/debug/pprof/"
        }
    });
    check("50 requests over 1 slot, 2 reading", &outcomes, &config);
    let took = timed_stop(server);
    assert!(took.is_some_and(|d| d < Duration::from_secs(1)), "{took:?}");
}
