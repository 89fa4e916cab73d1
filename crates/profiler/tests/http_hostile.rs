//! The /debug/pprof server against clients that never finish: slowloris clients must not starve
//! real requests, a trickling client is dropped by the whole-request deadline, and `stop()`
//! returns within a second whatever clients and captures are doing.
//!
//! Every client here is bounded in time (its own give-up deadline and a quit flag), so a server
//! that misbehaves makes a test fail, not hang.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferroprof::export::ProfileSource;
use ferroprof::http::{serve_with, HttpConfig, PprofServer};

/// Profiles whose capture sleeps the whole duration without looking at any stop flag: a capture
/// the server cannot interrupt.
#[derive(Default)]
struct SleepySource {
    entered: Mutex<Option<mpsc::Sender<()>>>,
}

impl SleepySource {
    fn sleep(&self, d: Duration) -> Result<Vec<u8>, String> {
        if let Some(tx) = &*self.entered.lock().unwrap() {
            let _ = tx.send(());
        }
        std::thread::sleep(d);
        Ok(b"profile".to_vec())
    }
}

impl ProfileSource for SleepySource {
    fn cpu_profile(&self, d: Duration) -> Result<Vec<u8>, String> {
        self.sleep(d)
    }
    fn heap_profile(&self) -> Result<Vec<u8>, String> {
        Ok(b"heap".to_vec())
    }
    fn allocs_profile(&self, d: Duration) -> Result<Vec<u8>, String> {
        self.sleep(d)
    }
}

/// How a never-finishing client ended.
#[derive(Debug)]
struct Trickled {
    /// From connect to the server closing or answering; `None` when the client gave up first.
    ended_after: Option<Duration>,
    /// What the server sent, if anything.
    reply: Vec<u8>,
    /// Bytes of the request head sent.
    sent: usize,
    /// The connection was refused (the server is gone).
    refused: bool,
}

/// Sends a request head one byte every `every` and never finishes it, until the server answers
/// or closes, `give_up` passes or `quit` is set.
fn trickle(addr: SocketAddr, every: Duration, give_up: Duration, quit: &AtomicBool) -> Trickled {
    const HEAD: &[u8] = b"GET /debug/pprof/ HTTP/1.1\r\n";
    const FILLER: &[u8] = b"X-Slow: 0123456789\r\n";
    let start = Instant::now();
    let Ok(mut s) = TcpStream::connect(addr) else {
        // The server is gone (stopped): nothing to trickle to.
        return Trickled {
            ended_after: Some(Duration::ZERO),
            reply: Vec::new(),
            sent: 0,
            refused: true,
        };
    };
    let mut sent = 0;
    let mut reply = Vec::new();
    let ended = |reply: Vec<u8>, sent| Trickled {
        ended_after: Some(start.elapsed()),
        reply,
        sent,
        refused: false,
    };
    while start.elapsed() < give_up && !quit.load(Ordering::SeqCst) {
        let byte = match HEAD.get(sent) {
            Some(&b) => b,
            None => FILLER[(sent - HEAD.len()) % FILLER.len()],
        };
        if s.write_all(&[byte]).is_err() {
            return ended(reply, sent);
        }
        sent += 1;
        // Waiting for an answer is also the pause between two bytes.
        let next = Instant::now() + every;
        let mut buf = [0u8; 4096];
        loop {
            let left = next.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            s.set_read_timeout(Some(left)).unwrap();
            match s.read(&mut buf) {
                Ok(0) => return ended(reply, sent),
                Ok(n) => {
                    reply.extend_from_slice(&buf[..n]);
                    // An answer: read the rest of it, then stop.
                    s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                    while let Ok(n @ 1..) = s.read(&mut buf) {
                        reply.extend_from_slice(&buf[..n]);
                    }
                    return ended(reply, sent);
                }
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return ended(reply, sent),
            }
        }
    }
    Trickled {
        ended_after: None,
        reply,
        sent,
        refused: false,
    }
}

/// `n` slowloris clients: each trickles a head one byte every `every` and connects again 20 ms
/// after the server drops it, until `quit`. Returns how many connections they made in all.
fn slowloris(
    addr: SocketAddr,
    n: usize,
    every: Duration,
    quit: &Arc<AtomicBool>,
) -> (Arc<AtomicUsize>, Vec<JoinHandle<()>>) {
    let connects = Arc::new(AtomicUsize::new(0));
    let threads = (0..n)
        .map(|_| {
            let (quit, connects) = (quit.clone(), connects.clone());
            std::thread::spawn(move || {
                let give_up = Instant::now() + Duration::from_secs(60);
                while !quit.load(Ordering::SeqCst) && Instant::now() < give_up {
                    connects.fetch_add(1, Ordering::SeqCst);
                    if trickle(addr, every, Duration::from_secs(60), &quit).refused {
                        break;
                    }
                    // Back soon, but not in a tight loop that would load the test machine.
                    std::thread::sleep(Duration::from_millis(20));
                }
            })
        })
        .collect();
    (connects, threads)
}

/// A whole GET; returns the status (0 when the connection ended without an answer) and how long
/// it took. Reads for at most `limit`.
fn timed_get(addr: SocketAddr, target: &str, limit: Duration) -> (u16, Duration) {
    let start = Instant::now();
    let mut s = TcpStream::connect(addr).unwrap();
    // One segment, sent at once, as real clients send a head. `write!` would make three
    // writes, and with Nagle the later ones can wait for an ACK: under load, long enough for
    // the slowloris crowd to displace a half-sent head, and the next write then meets EPIPE.
    s.set_nodelay(true).unwrap();
    let head = format!("GET {target} HTTP/1.1\r\nHost: test\r\n\r\n");
    s.write_all(head.as_bytes()).unwrap();
    let raw = read_until_close(&mut s, limit);
    let status = std::str::from_utf8(&raw)
        .ok()
        .and_then(|t| t.split_whitespace().nth(1))
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, start.elapsed())
}

/// Everything the peer sends until it closes, or until `limit`.
fn read_until_close(s: &mut TcpStream, limit: Duration) -> Vec<u8> {
    let end = Instant::now() + limit;
    let mut raw = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return raw;
        }
        s.set_read_timeout(Some(left)).unwrap();
        match s.read(&mut buf) {
            Ok(0) => return raw,
            Ok(n) => raw.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return raw,
        }
    }
}

/// Runs `server.stop()` on a thread and returns how long it took, or `None` if it has not
/// returned after 10 s (the thread is then left behind).
fn timed_stop(server: PprofServer) -> Option<Duration> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let start = Instant::now();
        server.stop();
        let _ = tx.send(start.elapsed());
    });
    rx.recv_timeout(Duration::from_secs(10)).ok()
}

fn quit_all(quit: &AtomicBool, threads: Vec<JoinHandle<()>>) {
    quit.store(true, Ordering::SeqCst);
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn slowloris_clients_do_not_starve_real_requests() {
    let config = HttpConfig {
        max_concurrent: 2,
        ..HttpConfig::default()
    };
    let server = serve_with("127.0.0.1:0", Arc::new(SleepySource::default()), config).unwrap();
    let addr = server.addr();
    let quit = Arc::new(AtomicBool::new(false));
    // Four times as many as may be served, one byte a second each.
    let (connects, threads) = slowloris(addr, 8, Duration::from_secs(1), &quit);
    std::thread::sleep(Duration::from_millis(1500));

    // Real requests keep being answered, also after the slow heads' deadline has passed.
    let start = Instant::now();
    let mut answers = Vec::new();
    while start.elapsed() < Duration::from_secs(7) {
        answers.push(timed_get(addr, "/debug/pprof/", Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(500));
    }
    quit_all(&quit, threads);
    eprintln!("with 8 slowloris clients: {answers:?}");
    let slow: Vec<_> = answers
        .iter()
        .filter(|(status, took)| *status != 200 || *took > Duration::from_secs(2))
        .collect();
    assert!(
        slow.is_empty(),
        "{} of {} requests were not answered with 200 within 2 s while slowloris clients \
         were connected: {slow:?}",
        slow.len(),
        answers.len()
    );
    assert!(connects.load(Ordering::SeqCst) >= 8);
    assert!(timed_stop(server).is_some_and(|d| d < Duration::from_secs(1)));
}

#[test]
fn a_trickling_client_is_dropped_by_the_whole_request_deadline() {
    let config = HttpConfig {
        read_timeout: Duration::from_secs(1),
        ..HttpConfig::default()
    };
    let server = serve_with("127.0.0.1:0", Arc::new(SleepySource::default()), config).unwrap();
    let quit = AtomicBool::new(false);
    // Each byte arrives well within any per-read timeout; only a deadline for the whole head
    // ends this.
    let t = trickle(
        server.addr(),
        Duration::from_millis(200),
        Duration::from_secs(10),
        &quit,
    );
    let after = t
        .ended_after
        .unwrap_or_else(|| panic!("still connected after 10 s of trickling: {t:?}"));
    eprintln!(
        "trickling client dropped after {after:?} ({} bytes sent)",
        t.sent
    );
    assert!(
        after >= Duration::from_millis(900) && after < Duration::from_secs(3),
        "dropped after {after:?}, expected about 1 s: {t:?}"
    );
    assert!(
        t.reply.starts_with(b"HTTP/1.1 408 "),
        "expected 408: {:?}",
        String::from_utf8_lossy(&t.reply)
    );
    assert!(timed_stop(server).is_some_and(|d| d < Duration::from_secs(1)));
}

#[test]
fn stop_returns_within_a_second_while_clients_trickle() {
    let server = serve_with(
        "127.0.0.1:0",
        Arc::new(SleepySource::default()),
        HttpConfig::default(),
    )
    .unwrap();
    let addr = server.addr();
    let quit = Arc::new(AtomicBool::new(false));
    // More than max_concurrent, each byte sooner than any per-read timeout.
    let ends: Vec<_> = (0..6)
        .map(|_| {
            let quit = quit.clone();
            std::thread::spawn(move || {
                trickle(
                    addr,
                    Duration::from_millis(150),
                    Duration::from_secs(15),
                    &quit,
                )
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(1000));
    let stopped_at = Instant::now();
    let took = timed_stop(server);
    let dropped_within: Vec<_> = ends
        .into_iter()
        .map(|t| {
            let t = t.join().unwrap();
            (t.ended_after, t.sent)
        })
        .collect();
    quit.store(true, Ordering::SeqCst);
    eprintln!("stop with 6 trickling clients took {took:?}");
    assert!(
        took.is_some_and(|d| d < Duration::from_secs(1)),
        "stop took {took:?} (None: over 10 s)"
    );
    // The clients were disconnected by the stop (they had been connected for about 1 s).
    let since_stop = stopped_at.elapsed();
    for (ended, sent) in &dropped_within {
        assert!(
            ended.is_some(),
            "a client was still connected {since_stop:?} after stop ({sent} bytes sent)"
        );
    }
    assert!(
        TcpStream::connect(addr).is_err(),
        "still listening after stop"
    );
}

#[test]
fn stop_returns_within_a_second_during_a_capture() {
    let (entered_tx, entered_rx) = mpsc::channel();
    let src = Arc::new(SleepySource {
        entered: Mutex::new(Some(entered_tx)),
    });
    let server = serve_with("127.0.0.1:0", src, HttpConfig::default()).unwrap();
    let addr = server.addr();
    let capture = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"GET /debug/pprof/profile?seconds=30 HTTP/1.1\r\nHost: t\r\n\r\n")
            .unwrap();
        let raw = read_until_close(&mut s, Duration::from_secs(15));
        (Instant::now(), raw)
    });
    entered_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the capture did not start");
    let quit = Arc::new(AtomicBool::new(false));
    let (_, tricklers) = slowloris(addr, 3, Duration::from_millis(150), &quit);
    std::thread::sleep(Duration::from_millis(500));

    let stop_start = Instant::now();
    let took = timed_stop(server);
    let (closed_at, raw) = capture.join().unwrap();
    quit_all(&quit, tricklers);
    eprintln!(
        "stop during a capture took {took:?}; its client closed after {:?}",
        closed_at.duration_since(stop_start)
    );
    assert!(
        took.is_some_and(|d| d < Duration::from_secs(1)),
        "stop took {took:?} (None: over 10 s)"
    );
    // The capture's client is not left waiting for a profile that will never be sent.
    assert!(
        raw.is_empty(),
        "answered before the stop, so no capture was in progress: {:?}",
        String::from_utf8_lossy(&raw)
    );
    let closed_after = closed_at.duration_since(stop_start);
    assert!(
        closed_after < Duration::from_secs(2),
        "the capture's connection was closed {closed_after:?} after stop: {:?}",
        String::from_utf8_lossy(&raw)
    );
}

#[test]
fn slowloris_beyond_the_reading_slots_is_displaced() {
    let config = HttpConfig {
        max_concurrent: 1,
        max_reading: 4,
        ..HttpConfig::default()
    };
    let server = serve_with("127.0.0.1:0", Arc::new(SleepySource::default()), config).unwrap();
    let addr = server.addr();
    let quit = Arc::new(AtomicBool::new(false));
    // Three times the reading slots; each reconnects as soon as it is displaced.
    let (connects, threads) = slowloris(addr, 12, Duration::from_millis(300), &quit);
    std::thread::sleep(Duration::from_millis(1000));
    let answers: Vec<_> = (0..6)
        .map(|_| {
            let a = timed_get(addr, "/debug/pprof/", Duration::from_secs(10));
            std::thread::sleep(Duration::from_millis(300));
            a
        })
        .collect();
    quit_all(&quit, threads);
    eprintln!(
        "with 12 slowloris clients over 4 reading slots ({} connects): {answers:?}",
        connects.load(Ordering::SeqCst)
    );
    assert!(
        answers
            .iter()
            .all(|&(status, took)| status == 200 && took < Duration::from_secs(2)),
        "{answers:?}"
    );
    // The slow clients were displaced (and came back) rather than left waiting.
    assert!(connects.load(Ordering::SeqCst) > 12);
    assert!(timed_stop(server).is_some_and(|d| d < Duration::from_secs(1)));
}

#[test]
fn bad_settings_are_rejected_by_name() {
    let src = Arc::new(SleepySource::default());
    for (config, field) in [
        (
            HttpConfig {
                max_reading: 0,
                ..HttpConfig::default()
            },
            "max_reading",
        ),
        (
            HttpConfig {
                read_timeout: Duration::ZERO,
                ..HttpConfig::default()
            },
            "read_timeout",
        ),
        (
            HttpConfig {
                default_seconds: 700,
                ..HttpConfig::default()
            },
            "default_seconds = 700",
        ),
    ] {
        let e = serve_with("127.0.0.1:0", src.clone(), config)
            .unwrap_err()
            .to_string();
        assert!(e.contains(field), "{e}");
    }
}

/// The same through the real profiler: its capture runs on, but neither `stop()` nor the
/// client waits for it.
#[test]
fn stop_returns_within_a_second_during_a_real_capture() {
    let dir = std::env::temp_dir().join(format!("ferroprof-http-hostile-{}", std::process::id()));
    let guard = ferroprof::Profiler::builder()
        .service("http-hostile-test")
        .period(Duration::from_secs(3600))
        .output_dir(&dir)
        .start()
        .expect("start the profiler");
    let server = serve_with("127.0.0.1:0", guard.profile_source(), HttpConfig::default()).unwrap();
    let addr = server.addr();
    let capture = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"GET /debug/pprof/profile?seconds=30 HTTP/1.1\r\nHost: t\r\n\r\n")
            .unwrap();
        let raw = read_until_close(&mut s, Duration::from_secs(15));
        (Instant::now(), raw)
    });
    // The capture cannot be seen from outside; this is ample for the request to reach it.
    std::thread::sleep(Duration::from_millis(500));
    let stop_start = Instant::now();
    let took = timed_stop(server);
    let (closed_at, raw) = capture.join().unwrap();
    let guard_start = Instant::now();
    guard.stop().unwrap();
    let guard_took = guard_start.elapsed();
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!(
        "stop during a real capture took {took:?}; its client closed after {:?}; the \
         profiler's stop took {guard_took:?}",
        closed_at.duration_since(stop_start)
    );
    assert!(
        took.is_some_and(|d| d < Duration::from_secs(1)),
        "stop took {took:?} (None: over 10 s)"
    );
    assert!(
        raw.is_empty(),
        "answered before the stop, so no capture was in progress: {:?}",
        String::from_utf8_lossy(&raw)
    );
    let closed_after = closed_at.duration_since(stop_start);
    assert!(
        closed_after < Duration::from_secs(2),
        "the capture's connection was closed {closed_after:?} after stop: {:?}",
        String::from_utf8_lossy(&raw)
    );
    // The capture still running does not hold up the profiler's own stop either.
    assert!(guard_took < Duration::from_secs(5), "{guard_took:?}");
}

/// The heavy version, for `scripts/reliability.sh`: `FERROPROF_HTTP_HOSTILE_CLIENTS` slowloris
/// clients (default 200, far beyond the default reading slots) for
/// `FERROPROF_HTTP_HOSTILE_SECS` seconds (default 20), while real requests keep coming.
#[test]
#[ignore = "heavy: run from scripts/reliability.sh"]
fn slowloris_flood_heavy() {
    let env = |name, default| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let (clients, secs) = (
        env("FERROPROF_HTTP_HOSTILE_CLIENTS", 200),
        env("FERROPROF_HTTP_HOSTILE_SECS", 20),
    );
    let server = serve_with(
        "127.0.0.1:0",
        Arc::new(SleepySource::default()),
        HttpConfig::default(),
    )
    .unwrap();
    let addr = server.addr();
    let quit = Arc::new(AtomicBool::new(false));
    let (connects, threads) = slowloris(addr, clients, Duration::from_millis(500), &quit);
    std::thread::sleep(Duration::from_secs(1));
    let start = Instant::now();
    let mut answers = Vec::new();
    while start.elapsed() < Duration::from_secs(secs as u64) {
        answers.push(timed_get(addr, "/debug/pprof/", Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(200));
    }
    let took = timed_stop(server);
    quit_all(&quit, threads);
    let worst = answers.iter().map(|a| a.1).max();
    let bad: Vec<_> = answers
        .iter()
        .filter(|(status, took)| *status != 200 || *took > Duration::from_secs(2))
        .collect();
    eprintln!(
        "{clients} slowloris clients, {} connects, {} requests, worst {worst:?}, stop {took:?}",
        connects.load(Ordering::SeqCst),
        answers.len()
    );
    assert!(bad.is_empty(), "{} bad answers: {bad:?}", bad.len());
    assert!(took.is_some_and(|d| d < Duration::from_secs(1)), "{took:?}");
}
