//! Helpers shared by the exporter and /debug/pprof tests: real pprof bytes, a loopback HTTP
//! receiver that records requests, an independent multipart parser, and a capturing logger.
#![allow(dead_code)] // each test binary uses a different subset

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use ferroprof::export::ExportedProfile;
use ferroprof::recorder::{Compression, EncodedProfile, ProfileStats};

/// The sample types of the test profiles.
pub const SAMPLE_TYPES: &[(&str, &str)] = &[
    ("cpu-time", "nanoseconds"),
    ("cpu-samples", "count"),
    ("wall-time", "nanoseconds"),
    ("alloc-samples", "count"),
    ("heap-live-size", "bytes"),
];

/// gzip pprof bytes with known stacks.
pub fn pprof_bytes() -> Vec<u8> {
    ferroprof_pprof::ProfileBuilder::new(SAMPLE_TYPES)
        .time(1_700_000_000_000_000_000, 60_000_000_000)
        .sample(
            &["hot_function", "work", "main"],
            &[30_000_000, 3, 30_000_000, 0, 0],
            &[("thread name", "main")],
        )
        .sample(
            &["cool_function", "work", "main"],
            &[10_000_000, 1, 10_000_000, 0, 0],
            &[("thread name", "main")],
        )
        .sample(&["make_buffers", "main"], &[0, 0, 0, 4, 64 << 20], &[])
        .gzip()
}

/// An exported profile covering the last minute, with endpoint counts.
pub fn exported_profile() -> ExportedProfile {
    let end = SystemTime::now();
    let start = end - Duration::from_secs(60);
    ExportedProfile {
        encoded: EncodedProfile {
            start,
            end,
            bytes: pprof_bytes(),
            compression: Compression::Gzip,
            endpoint_counts: vec![("GET /users".into(), 12), ("POST /orders".into(), 3)],
        },
        stats: ProfileStats {
            recorded_samples: 42,
            serialization_time_ns: 1234,
            heap_iteration_prep_time_ns: 5,
            heap_profile_build_time_ns: 6,
            dropped_stacks: 0,
            profile_bytes: 0,
        },
        service: "checkout".into(),
        tags: vec![
            ("env".into(), "staging".into()),
            ("version".into(), "1.2.3".into()),
            ("team".into(), "payments".into()),
        ],
        sample_types: SAMPLE_TYPES.iter().map(|(t, _)| t.to_string()).collect(),
        process_start: start - Duration::from_secs(3600),
    }
}

/// Polls `f` until it returns `Some` or `deadline` passes.
pub fn wait_for<T>(deadline: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let until = Instant::now() + deadline;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= until {
            return None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

// ---------------------------------------------------------------------------------------------
// Loopback HTTP receiver

/// One request the receiver got.
#[derive(Debug, Clone)]
pub struct Recorded {
    pub method: String,
    /// Path and query.
    pub target: String,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Recorded {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// Decoded query parameters.
    pub fn query(&self) -> Vec<(String, String)> {
        let q = self.target.split_once('?').map(|x| x.1).unwrap_or("");
        q.split('&')
            .filter(|s| !s.is_empty())
            .map(|kv| {
                let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                (percent_decode(k), percent_decode(v))
            })
            .collect()
    }

    pub fn param(&self, key: &str) -> Option<String> {
        self.query()
            .into_iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
    }

    pub fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or("")
    }
}

/// What the receiver answers.
#[derive(Debug, Clone)]
pub enum Behavior {
    /// Answer every request with this status.
    Status(u16),
    /// Answer with these statuses in turn, then with the last one.
    Sequence(Vec<u16>),
    /// Read the request, then send nothing until [`Receiver::release`] (or 60 s).
    Stall,
}

struct RecvShared {
    requests: Mutex<Vec<Recorded>>,
    changed: Condvar,
    behavior: Mutex<Behavior>,
    answered: Mutex<usize>,
    released: Mutex<bool>,
    release: Condvar,
    stopping: AtomicBool,
}

/// A minimal HTTP/1.1 server on 127.0.0.1 that records every request.
pub struct Receiver {
    addr: SocketAddr,
    shared: Arc<RecvShared>,
}

impl Receiver {
    pub fn start(behavior: Behavior) -> Receiver {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let addr = listener.local_addr().unwrap();
        let shared = Arc::new(RecvShared {
            requests: Mutex::new(Vec::new()),
            changed: Condvar::new(),
            behavior: Mutex::new(behavior),
            answered: Mutex::new(0),
            released: Mutex::new(false),
            release: Condvar::new(),
            stopping: AtomicBool::new(false),
        });
        let s = shared.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.stopping.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(stream) = conn else { continue };
                let s = s.clone();
                std::thread::spawn(move || serve_one(stream, &s));
            }
        });
        Receiver { addr, shared }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn set_behavior(&self, b: Behavior) {
        *self.shared.behavior.lock().unwrap() = b;
    }

    /// Lets stalled requests finish (the connection is closed without an answer).
    pub fn release(&self) {
        *self.shared.released.lock().unwrap() = true;
        self.shared.release.notify_all();
    }

    pub fn requests(&self) -> Vec<Recorded> {
        self.shared.requests.lock().unwrap().clone()
    }

    /// Waits until at least `n` requests arrived; panics after `deadline`.
    pub fn wait_requests(&self, n: usize, deadline: Duration) -> Vec<Recorded> {
        let until = Instant::now() + deadline;
        let mut reqs = self.shared.requests.lock().unwrap();
        while reqs.len() < n {
            let left = until.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "expected {n} requests within {deadline:?}, got {}",
                reqs.len()
            );
            reqs = self.shared.changed.wait_timeout(reqs, left).unwrap().0;
        }
        reqs.clone()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::SeqCst);
        self.release();
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
    }
}

fn serve_one(mut stream: TcpStream, s: &RecvShared) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(20)));
    let Some(req) = read_request(&mut stream) else {
        return;
    };
    let status = {
        let b = s.behavior.lock().unwrap().clone();
        let mut answered = s.answered.lock().unwrap();
        let st = match b {
            Behavior::Status(c) => Some(c),
            Behavior::Sequence(v) => v.get(*answered).or(v.last()).copied(),
            Behavior::Stall => None,
        };
        *answered += 1;
        st
    };
    {
        s.requests.lock().unwrap().push(req);
        s.changed.notify_all();
    }
    match status {
        Some(code) => {
            let body = format!("status {code} from the test receiver");
            let _ = write!(
                stream,
                "HTTP/1.1 {code} X\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
        }
        None => {
            let until = Instant::now() + Duration::from_secs(60);
            let mut released = s.released.lock().unwrap();
            while !*released && Instant::now() < until {
                released = s
                    .release
                    .wait_timeout(released, Duration::from_millis(200))
                    .unwrap()
                    .0;
            }
        }
    }
}

fn read_request(stream: &mut TcpStream) -> Option<Recorded> {
    let mut r = BufReader::new(stream.try_clone().ok()?);
    let mut line = String::new();
    if r.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_owned();
    let target = parts.next()?.to_owned();
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        r.read_line(&mut h).ok()?;
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        let (k, v) = h.split_once(':')?;
        headers.push((k.trim().to_owned(), v.trim().to_owned()));
    }
    let get = |name: &str| {
        headers
            .iter()
            .find(|(k, _): &&(String, String)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.clone())
    };
    if get("Expect").is_some_and(|v| v.eq_ignore_ascii_case("100-continue")) {
        let _ = stream.write_all(b"HTTP/1.1 100 Continue\r\n\r\n");
    }
    let mut body = Vec::new();
    if let Some(len) = get("Content-Length").and_then(|v| v.parse::<usize>().ok()) {
        body.resize(len, 0);
        r.read_exact(&mut body).ok()?;
    } else if get("Transfer-Encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        loop {
            let mut size = String::new();
            r.read_line(&mut size).ok()?;
            let n = usize::from_str_radix(size.trim().split(';').next()?, 16).ok()?;
            let mut chunk = vec![0; n + 2];
            r.read_exact(&mut chunk).ok()?;
            if n == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..n]);
        }
    }
    Some(Recorded {
        method,
        target,
        headers,
        body,
    })
}

pub fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

// ---------------------------------------------------------------------------------------------
// multipart/form-data, parsed independently of the exporter's builder

#[derive(Debug, Clone)]
pub struct Part {
    pub name: String,
    pub filename: Option<String>,
    pub content_type: Option<String>,
    pub data: Vec<u8>,
}

fn find(hay: &[u8], needle: &[u8], from: usize) -> Option<usize> {
    hay.get(from..)?
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|p| p + from)
}

/// Parses a multipart body given its Content-Type header; panics on malformed input.
pub fn parse_multipart(content_type: &str, body: &[u8]) -> Vec<Part> {
    let boundary = content_type
        .split(';')
        .map(str::trim)
        .find_map(|p| p.strip_prefix("boundary="))
        .unwrap_or_else(|| panic!("no boundary in {content_type:?}"))
        .trim_matches('"');
    let delim = format!("--{boundary}");
    let mut parts = Vec::new();
    let mut pos = find(body, delim.as_bytes(), 0).expect("first boundary");
    loop {
        pos += delim.len();
        if body[pos..].starts_with(b"--") {
            break; // closing delimiter
        }
        assert!(body[pos..].starts_with(b"\r\n"), "CRLF after boundary");
        pos += 2;
        let head_end = find(body, b"\r\n\r\n", pos).expect("part headers end");
        let head = std::str::from_utf8(&body[pos..head_end]).expect("utf-8 part headers");
        let next =
            find(body, format!("\r\n{delim}").as_bytes(), head_end + 4).expect("next boundary");
        let data = body[head_end + 4..next].to_vec();
        let mut part = Part {
            name: String::new(),
            filename: None,
            content_type: None,
            data,
        };
        for h in head.split("\r\n") {
            let (k, v) = h.split_once(':').expect("header colon");
            if k.eq_ignore_ascii_case("content-disposition") {
                for attr in v.split(';').map(str::trim) {
                    if let Some(n) = attr.strip_prefix("name=") {
                        part.name = n.trim_matches('"').to_owned();
                    } else if let Some(f) = attr.strip_prefix("filename=") {
                        part.filename = Some(f.trim_matches('"').to_owned());
                    }
                }
            } else if k.eq_ignore_ascii_case("content-type") {
                part.content_type = Some(v.trim().to_owned());
            }
        }
        parts.push(part);
        pos = next + 2;
    }
    parts
}

pub fn base64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| -> u32 {
        match c {
            b'A'..=b'Z' => (c - b'A') as u32,
            b'a'..=b'z' => (c - b'a') as u32 + 26,
            b'0'..=b'9' => (c - b'0') as u32 + 52,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("bad base64 byte {c}"),
        }
    };
    let clean: Vec<u8> = s.bytes().filter(|c| !c.is_ascii_whitespace()).collect();
    let mut out = Vec::with_capacity(clean.len() / 4 * 3);
    for chunk in clean.chunks(4) {
        let pad = chunk.iter().filter(|&&c| c == b'=').count();
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= if c == b'=' { 0 } else { val(c) } << (18 - 6 * i);
        }
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&bytes[..3 - pad]);
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Capturing logger

struct Capture(Mutex<Vec<String>>);

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata) -> bool {
        true
    }
    fn log(&self, record: &log::Record) {
        let line = format!("{} {}", record.level(), record.args());
        if std::env::var_os("FERROPROF_TEST_LOG").is_some() {
            eprintln!("{line}");
        }
        self.0.lock().unwrap().push(line);
    }
    fn flush(&self) {}
}

static LOGGER: OnceLock<&'static Capture> = OnceLock::new();

/// Installs (once per test binary) a logger that keeps every line; returns all lines so far.
pub fn captured_logs() -> Vec<String> {
    let l = LOGGER.get_or_init(|| {
        let c: &'static Capture = Box::leak(Box::new(Capture(Mutex::new(Vec::new()))));
        let _ = log::set_logger(c);
        log::set_max_level(log::LevelFilter::Trace);
        c
    });
    l.0.lock().unwrap().clone()
}

// ---------------------------------------------------------------------------------------------
// The Datadog test agent (PyPI ddapm-test-agent)

/// A running test agent; killed on drop.
pub struct TestAgent {
    child: Child,
    pub port: u16,
    pub socket: PathBuf,
    dir: PathBuf,
}

pub fn agent_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("FERROPROF_DDAPM_TEST_AGENT") {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Some(p);
        }
    }
    let home = std::env::var_os("HOME").map(PathBuf::from)?;
    let venv = home.join(".cache/ferroprof-test-tools/venv/bin/ddapm-test-agent");
    if venv.is_file() {
        return Some(venv);
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("ddapm-test-agent"))
            .find(|p| p.is_file())
    })
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl TestAgent {
    /// Starts the agent, or returns `None` (after a loud message) when it is not installed and
    /// this is not CI.
    pub fn start(tag: &str) -> Option<TestAgent> {
        let Some(bin) = agent_binary() else {
            if std::env::var_os("CI").is_some() {
                panic!("ddapm-test-agent is not installed (CI must run scripts/test-deps.sh)");
            }
            eprintln!(
                "\n*** SKIPPING Datadog agent test: ddapm-test-agent not installed; \
                 run `. scripts/test-deps.sh` to install it ***\n"
            );
            return None;
        };
        // The ports come from binding port 0 and letting go, so another process can take one
        // in between; the agent then exits at once, and a fresh set of ports is tried.
        let mut last_log = String::new();
        for attempt in 0..3 {
            match Self::spawn_once(&bin, &format!("{tag}-{attempt}")) {
                Ok(agent) => return Some(agent),
                Err(log) => last_log = log,
            }
        }
        panic!("test agent did not start in 3 attempts; last log:\n{last_log}");
    }

    fn spawn_once(bin: &std::path::Path, tag: &str) -> Result<TestAgent, String> {
        let dir =
            std::env::temp_dir().join(format!("ferroprof-ddagent-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let socket = dir.join("apm.sock");
        let port = free_port();
        let log = std::fs::File::create(dir.join("agent.log")).unwrap();
        let mut cmd = Command::new(bin);
        cmd.current_dir(&dir)
            .arg("--host")
            .arg("127.0.0.1")
            .arg("--port")
            .arg(port.to_string())
            .arg("--otlp-http-port")
            .arg(free_port().to_string())
            .arg("--otlp-grpc-port")
            .arg(free_port().to_string())
            .arg("--trace-uds-socket")
            .arg(&socket)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        // The agent reads these to forward data elsewhere; this test keeps everything local.
        for var in [
            "DD_TRACE_AGENT_URL",
            "DD_AGENT_URL",
            "DD_API_KEY",
            "DD_SITE",
            "PORT",
            "HOST",
        ] {
            cmd.env_remove(var);
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", bin.display()));
        let mut agent = TestAgent {
            child,
            port,
            socket,
            dir,
        };
        let mut exited = false;
        let ready = wait_for(Duration::from_secs(90), || {
            if let Ok(Some(_)) = agent.child.try_wait() {
                exited = true;
                return Some(false);
            }
            // Our own socket existing tells our agent from anything else on the port.
            let info = agent.get("/info").ok()?;
            (info.contains("endpoints") && agent.socket.exists()).then_some(true)
        });
        match ready {
            Some(true) => Ok(agent),
            _ if exited => Err(agent.log()),
            _ => panic!("test agent not ready within 90 s:\n{}", agent.log()),
        }
    }

    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    pub fn get(&self, path: &str) -> Result<String, ureq::Error> {
        ureq::get(format!("{}{path}", self.url()))
            .call()?
            .body_mut()
            .read_to_string()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("agent.log")).unwrap_or_default()
    }

    /// The profiling requests the agent recorded.
    pub fn profiling_requests(&self) -> Vec<serde_json::Value> {
        let body = self
            .get("/test/session/requests")
            .expect("GET /test/session/requests");
        let all: Vec<serde_json::Value> = serde_json::from_str(&body).expect("requests JSON");
        all.into_iter()
            .filter(|r| {
                r["url"]
                    .as_str()
                    .is_some_and(|u| u.ends_with("/profiling/v1/input"))
            })
            .collect()
    }
}

impl Drop for TestAgent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
