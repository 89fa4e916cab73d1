//! The /debug/pprof server with a fake profile source: routes, validation, errors, the
//! concurrency limit, and `go tool pprof` reading what it serves.

mod export_support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use export_support::*;
use ferroprof::export::ProfileSource;
use ferroprof::http::{serve, serve_with, HttpConfig};

/// Returns canned profiles and records the durations asked for. `gate`, when set, makes
/// `cpu_profile` wait until the test sends on it.
#[derive(Default)]
struct FakeSource {
    asked: Mutex<Vec<(&'static str, Duration)>>,
    gate: Mutex<Option<(mpsc::Sender<()>, mpsc::Receiver<()>)>>,
    fail_heap: bool,
}

fn cpu_bytes() -> Vec<u8> {
    ferroprof_pprof::ProfileBuilder::new(&[("cpu-samples", "count"), ("cpu-time", "nanoseconds")])
        .time(1_700_000_000_000_000_000, 2_000_000_000)
        .sample(&["busy_loop_alpha", "main"], &[150, 1_500_000_000], &[])
        .sample(&["busy_loop_beta", "main"], &[50, 500_000_000], &[])
        .gzip()
}

fn heap_bytes() -> Vec<u8> {
    ferroprof_pprof::ProfileBuilder::new(&[
        ("heap-live-samples", "count"),
        ("heap-live-size", "bytes"),
    ])
    .sample(&["keep_big_buffers", "main"], &[64, 64 << 20], &[])
    .sample(&["small_churn", "main"], &[1, 4096], &[])
    .gzip()
}

impl ProfileSource for FakeSource {
    fn cpu_profile(&self, d: Duration) -> Result<Vec<u8>, String> {
        self.asked.lock().unwrap().push(("cpu", d));
        if let Some((entered, go)) = &*self.gate.lock().unwrap() {
            entered.send(()).unwrap();
            go.recv_timeout(Duration::from_secs(60)).unwrap();
        }
        Ok(cpu_bytes())
    }
    fn heap_profile(&self) -> Result<Vec<u8>, String> {
        if self.fail_heap {
            return Err("heap profiling is disabled".into());
        }
        Ok(heap_bytes())
    }
    fn allocs_profile(&self, d: Duration) -> Result<Vec<u8>, String> {
        self.asked.lock().unwrap().push(("allocs", d));
        Ok(heap_bytes())
    }
}

struct Resp {
    status: u16,
    headers: String,
    body: Vec<u8>,
}

impl Resp {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// A raw HTTP/1.1 exchange, so the test sees exactly what the server sends.
fn request(addr: std::net::SocketAddr, method: &str, target: &str) -> Resp {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "{method} {target} HTTP/1.1\r\nHost: test\r\nUser-Agent: t\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("head end");
    let headers = String::from_utf8(raw[..split].to_vec()).unwrap();
    let status = headers.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = raw[split + 4..].to_vec();
    let len: usize = headers
        .lines()
        .find_map(|l| l.strip_prefix("Content-Length: "))
        .expect("Content-Length")
        .parse()
        .unwrap();
    if method != "HEAD" {
        assert_eq!(body.len(), len);
    }
    Resp {
        status,
        headers,
        body,
    }
}

fn get(addr: std::net::SocketAddr, target: &str) -> Resp {
    request(addr, "GET", target)
}

#[test]
fn routes_and_content_types() {
    let src = Arc::new(FakeSource::default());
    let server = serve("127.0.0.1:0", src.clone()).unwrap();
    let addr = server.addr();
    assert!(addr.ip().is_loopback());

    let index = get(addr, "/debug/pprof/");
    assert_eq!(index.status, 200);
    assert!(index.headers.contains("Content-Type: text/html"));
    for link in ["profile?seconds=30", "heap", "allocs"] {
        assert!(
            index.text().contains(&format!("href=\"{link}")),
            "{}",
            index.text()
        );
    }
    assert_eq!(get(addr, "/debug/pprof").status, 200);

    let cpu = get(addr, "/debug/pprof/profile?seconds=2");
    assert_eq!(cpu.status, 200, "{}", cpu.text());
    assert!(cpu
        .headers
        .contains("Content-Type: application/octet-stream"));
    assert!(cpu
        .headers
        .contains("Content-Disposition: attachment; filename=\"profile\""));
    let p = ferroprof_pprof::decode(&cpu.body).unwrap();
    assert_eq!(p.total("cpu-samples"), Some(200));

    let heap = get(addr, "/debug/pprof/heap?gc=1");
    assert_eq!(heap.status, 200);
    assert!(heap.headers.contains("filename=\"heap\""));
    assert_eq!(
        ferroprof_pprof::decode(&heap.body)
            .unwrap()
            .total("heap-live-size"),
        Some((64 << 20) + 4096)
    );

    assert_eq!(get(addr, "/debug/pprof/allocs?seconds=3").status, 200);
    assert_eq!(get(addr, "/debug/pprof/profile").status, 200);
    assert_eq!(
        *src.asked.lock().unwrap(),
        vec![
            ("cpu", Duration::from_secs(2)),
            ("allocs", Duration::from_secs(3)),
            ("cpu", Duration::from_secs(30)), // Go's default
        ]
    );
    server.stop();
    assert!(
        TcpStream::connect(addr).is_err(),
        "still listening after stop"
    );
}

#[test]
fn bad_requests_get_clear_errors() {
    let src = Arc::new(FakeSource {
        fail_heap: true,
        ..FakeSource::default()
    });
    let server = serve("127.0.0.1:0", src.clone()).unwrap();
    let addr = server.addr();
    for bad in ["0", "abc", "-1", "100000", "1.5", ""] {
        let r = get(addr, &format!("/debug/pprof/profile?seconds={bad}"));
        assert_eq!(r.status, 400, "seconds={bad}");
        assert!(
            r.text().contains(&format!("invalid seconds=\"{bad}\"")),
            "{}",
            r.text()
        );
        assert!(r.headers.contains("text/plain"));
    }
    assert_eq!(get(addr, "/debug/pprof/allocs?seconds=nope").status, 400);
    assert!(
        src.asked.lock().unwrap().is_empty(),
        "invalid requests must not profile"
    );

    let r = get(addr, "/debug/pprof/goroutine");
    assert_eq!(r.status, 404);
    assert!(r.text().contains("/debug/pprof/goroutine"));
    assert_eq!(get(addr, "/").status, 404);
    assert_eq!(request(addr, "POST", "/debug/pprof/heap").status, 405);
    assert_eq!(request(addr, "HEAD", "/debug/pprof/profile").status, 405);
    assert_eq!(request(addr, "HEAD", "/debug/pprof/").status, 200);
    let r = get(addr, "/debug/pprof/heap");
    assert_eq!(r.status, 500);
    assert!(
        r.text().contains("heap profiling is disabled"),
        "{}",
        r.text()
    );

    // Garbage instead of HTTP: an error answer, and the server keeps serving.
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"\x00\x01garbage\r\n\r\n").unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    assert!(
        out.starts_with(b"HTTP/1.1 4") || out.starts_with(b"HTTP/1.1 5"),
        "{out:?}"
    );
    assert_eq!(get(addr, "/debug/pprof/").status, 200);
}

#[test]
fn requests_beyond_the_limit_get_503() {
    let (entered_tx, entered_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel();
    let src = Arc::new(FakeSource {
        gate: Mutex::new(Some((entered_tx, go_rx))),
        ..FakeSource::default()
    });
    let config = HttpConfig {
        max_concurrent: 1,
        ..HttpConfig::default()
    };
    let server = serve_with("127.0.0.1:0", src, config).unwrap();
    let addr = server.addr();
    let slow = std::thread::spawn(move || get(addr, "/debug/pprof/profile?seconds=1"));
    entered_rx.recv_timeout(Duration::from_secs(30)).unwrap();
    let r = get(addr, "/debug/pprof/heap");
    assert_eq!(r.status, 503);
    assert!(r.text().contains("too many"));
    go_tx.send(()).unwrap();
    assert_eq!(slow.join().unwrap().status, 200);
    // The slot is free again once the slow request's thread is done.
    let ok = wait_for(Duration::from_secs(30), || {
        (get(addr, "/debug/pprof/heap").status == 200).then_some(())
    });
    assert!(ok.is_some());
}

#[test]
fn go_tool_pprof_reads_the_served_profiles() {
    let Some(go) = ferroprof_pprof::go_tool::go_for_tests() else {
        return;
    };
    let server = serve("127.0.0.1:0", Arc::new(FakeSource::default())).unwrap();
    let base = format!("http://{}/debug/pprof", server.addr());

    let top = ferroprof_pprof::go_tool::pprof_for_tests(
        &go,
        &[
            "-top",
            "-sample_index=cpu-time",
            &format!("{base}/profile?seconds=2"),
        ],
    );
    let alpha = top.lines().position(|l| l.contains("busy_loop_alpha"));
    let beta = top.lines().position(|l| l.contains("busy_loop_beta"));
    assert!(alpha.is_some() && beta.is_some() && alpha < beta, "{top}");
    assert!(
        top.contains("75.00%"),
        "alpha has 3/4 of the CPU time: {top}"
    );

    let top = ferroprof_pprof::go_tool::pprof_for_tests(
        &go,
        &[
            "-top",
            "-sample_index=heap-live-size",
            &format!("{base}/heap"),
        ],
    );
    assert!(
        top.lines()
            .any(|l| l.contains("keep_big_buffers") && l.contains("64MB")),
        "{top}"
    );
}

/// A bind error names the address once, in one pair of quotes, however it was given; its
/// `Debug` (what `main` prints when it returns the error) has no quotes inside the value.
#[test]
fn bind_error_quotes_the_address_once() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap();
    let text = addr.to_string();
    let src = || Arc::new(FakeSource::default()) as Arc<dyn ProfileSource>;
    let errors = [
        serve(text.as_str(), src()).unwrap_err(),
        serve(&text, src()).unwrap_err(),
        serve(text.clone(), src()).unwrap_err(),
        serve(addr, src()).unwrap_err(),
        serve(("127.0.0.1", addr.port()), src()).unwrap_err(),
    ];
    for err in errors {
        let shown = err.to_string();
        assert!(
            shown.starts_with(&format!("cannot listen on \"{text}\": ")),
            "{shown}"
        );
        assert_eq!(shown.matches(&text).count(), 1, "{shown}");
        let debug = format!("{err:?}");
        assert!(debug.contains(&format!("addr: \"{text}\"")), "{debug}");
        assert!(!debug.contains("\\\""), "quoted twice: {debug}");
    }
}

/// `?` turns the server's errors into `ProfilerError` (a `main` returning it needs no
/// `map_err`), and the message keeps the server's.
#[test]
fn http_errors_convert_into_profiler_errors() {
    fn start(addr: &str) -> Result<ferroprof::http::PprofServer, ferroprof::ProfilerError> {
        Ok(serve(addr, Arc::new(FakeSource::default()))?)
    }
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let text = taken.local_addr().unwrap().to_string();
    let err = start(&text).unwrap_err();
    assert!(
        matches!(
            err,
            ferroprof::ProfilerError::Http(ferroprof::http::HttpError::Bind { .. })
        ),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        format!(
            "/debug/pprof: {}",
            serve(text.as_str(), Arc::new(FakeSource::default())).unwrap_err()
        )
    );
}
