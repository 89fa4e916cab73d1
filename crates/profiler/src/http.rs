//! `/debug/pprof` over HTTP, like Go's `net/http/pprof`: opt-in, loopback by default.
//!
//! | path | serves |
//! |---|---|
//! | `/debug/pprof/` | a plain index page |
//! | `/debug/pprof/profile?seconds=N` | CPU and wall samples over the next N seconds (default 30) |
//! | `/debug/pprof/heap` | the live heap now, and allocations since the profiler started |
//! | `/debug/pprof/allocs?seconds=N` | allocation samples over the next N seconds (default 30) |
//!
//! Each profile names the type a viewer shows first (`default_sample_type`: `cpu-time`,
//! `heap-live-size`, `alloc-space`) and its sampling period (CPU: nanoseconds per sampling
//! period; heap and allocations: the allocation sampling interval in bytes).
//!
//! A small server on `std::net` and `poll`, built so that clients cannot hurt the host:
//! - The accept thread only accepts (it waits in `poll` on the listener and a wake-up socket)
//!   and passes each connection to the reading thread; it never reads from a client. When the
//!   reading thread is behind, it pauses and leaves new connections in the listen backlog.
//! - The reading thread receives the request heads of all connections at once with
//!   non-blocking reads. Each head must arrive whole within [`HttpConfig::read_timeout`] of the
//!   accept, however slowly its bytes trickle in (then `408`). At most
//!   [`HttpConfig::max_reading`] connections are read; a new one beyond that displaces the one
//!   that has been reading longest, which gets `503`. A new connection is read before it can
//!   displace anyone, so a client that sends its request at once gets through a crowd of slow
//!   ones.
//! - A complete request gets a short-lived thread of its own. At most
//!   [`HttpConfig::max_concurrent`] requests are served at once (a profile request holds its
//!   slot for N seconds); requests beyond that get `503`. Writing a response has a deadline too.
//! - Error answers and `503`s are sent by the reading thread without blocking, and each
//!   connection is closed gracefully: no connection is closed without a status line, except by
//!   [`PprofServer::stop`] or when the client is gone.
//! - [`PprofServer::stop`] closes every client connection and returns within a second; a request
//!   thread still inside a capture is left to finish on its own and then sends nothing.
//!
//! Only `GET` (and `HEAD` for the index) is served.

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ferroprof_export::ProfileSource;

/// Default address: loopback only, Go's conventional port.
pub const DEFAULT_ADDR: &str = "127.0.0.1:6060";
/// Environment variable that turns the server on (see [`serve_from_env`]).
pub const ADDR_ENV: &str = "FERROPROF_HTTP_ADDR";

/// Longest request head read; a longer one is answered with 431.
const MAX_HEAD: usize = 16 * 1024;
/// How long writing one response may take in all, so a client that stops reading cannot hold a
/// thread and a slot for long.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a connection is drained after its response, so that bytes the client still sends
/// do not make the close a reset that destroys the response before the client reads it.
const LINGER: Duration = Duration::from_millis(250);
/// How long an answer sent without a thread of its own (an error, a `503`) may take to write.
/// It is small and goes out in one non-blocking write unless the client's window is closed.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);
/// How often the accept thread looks whether the inbox has room again.
const INBOX_RETRY: Duration = Duration::from_millis(10);
/// How long [`PprofServer::stop`] waits for connection threads to see their socket closed.
/// Threads inside a capture are not waited for: they cannot see it.
const STOP_GRACE: Duration = Duration::from_millis(500);

/// Errors starting the server. They convert into [`crate::ProfilerError`] with `?`.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// The address is not `HOST:PORT` (or, in [`ADDR_ENV`], a port or `true`/`false`).
    #[error("invalid /debug/pprof address {addr:?}: {reason}")]
    BadAddress {
        /// The address as given.
        addr: String,
        /// What is wrong with it.
        reason: String,
    },
    /// An [`HttpConfig`] field is out of range.
    #[error("invalid /debug/pprof setting {field} = {value}: {reason}")]
    BadConfig {
        /// The field's name.
        field: &'static str,
        /// Its value.
        value: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The address could not be bound (in use, not local, a host name that does not resolve).
    #[error("cannot listen on {addr:?}: {source}")]
    Bind {
        /// The address as given, as text (`127.0.0.1:6060`, without quotes of its own).
        addr: String,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// A server thread or its wake-up socket could not be created.
    #[error("cannot start the /debug/pprof server thread: {0}")]
    Thread(std::io::Error),
}

/// Server settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpConfig {
    /// Used when a request has no `seconds`.
    pub default_seconds: u64,
    /// Largest `seconds` accepted.
    pub max_seconds: u64,
    /// Requests served at once (a profile request is served for its whole duration); more get
    /// 503.
    pub max_concurrent: usize,
    /// Connections whose request head is still being received (they cost a descriptor and a
    /// buffer each, no thread). When all are taken, a new connection displaces the one that has
    /// been receiving longest, which is answered 503.
    pub max_reading: usize,
    /// Deadline for receiving the whole request head, counted from the connection's accept
    /// (not per read: a client trickling bytes is cut off too); then 408.
    pub read_timeout: Duration,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            default_seconds: 30,
            max_seconds: 600,
            max_concurrent: 4,
            max_reading: 32,
            read_timeout: Duration::from_secs(5),
        }
    }
}

impl HttpConfig {
    fn validate(&self) -> Result<(), HttpError> {
        let bad = |field, value: String, reason| {
            Err(HttpError::BadConfig {
                field,
                value,
                reason,
            })
        };
        if self.max_seconds == 0 {
            return bad("max_seconds", "0".into(), "must be at least 1");
        }
        if !(1..=self.max_seconds).contains(&self.default_seconds) {
            return bad(
                "default_seconds",
                self.default_seconds.to_string(),
                "must be from 1 to max_seconds",
            );
        }
        if self.max_reading == 0 {
            return bad("max_reading", "0".into(), "must be at least 1");
        }
        if self.read_timeout.is_zero() {
            return bad("read_timeout", "0s".into(), "must be longer than zero");
        }
        Ok(())
    }
}

/// A running server; stops when [`PprofServer::stop`] is called or when dropped.
pub struct PprofServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    /// Dropping this end wakes the accept thread's `poll`.
    wake: Option<UnixStream>,
    threads: Vec<JoinHandle<()>>,
    /// The process that started the server: in a forked child its threads do not exist.
    pid: u32,
}

impl PprofServer {
    /// The bound address (useful with port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR/debug/pprof/`.
    pub fn url(&self) -> String {
        format!("http://{}/debug/pprof/", self.addr)
    }

    /// Stops listening and closes every client connection; returns within a second whatever
    /// clients do. A request still inside a capture when this is called is not waited for: its
    /// thread ends when the capture does, without answering.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        let Some(wake) = self.wake.take() else {
            return;
        };
        if std::process::id() != self.pid {
            // A forked child's copy: the server's threads are the parent's, and its locks may
            // have been held by them at the fork. Nothing here to stop or wait for.
            drop(wake);
            std::mem::forget(std::mem::take(&mut self.threads));
            return;
        }
        let shared = &self.shared;
        shared.stopping.store(true, Ordering::SeqCst);
        // Closing our end makes the accept thread's `poll` see the other end readable.
        drop(wake);
        let _ = (&shared.notify).write(&[1]);
        let mut conns = shared.lock();
        for stream in conns.open.values() {
            // Ends every blocked read and write on the connection's own thread.
            let _ = stream.shutdown(Shutdown::Both);
        }
        let deadline = Instant::now() + STOP_GRACE;
        while conns.loops > 0 || conns.threads > conns.in_source {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            conns = shared
                .changed
                .wait_timeout(conns, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let (loops, left_running) = (conns.loops, conns.threads);
        drop(conns);
        // Connections accepted as the stop began and never taken up by the reading thread.
        shared
            .inbox
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        if loops == 0 {
            // Both have ended (the listener is closed): joining cannot block.
            for t in self.threads.drain(..) {
                let _ = t.join();
            }
        } else {
            // Cannot happen short of a stuck `poll`; never block the caller on it.
            log::warn!("ferroprof: /debug/pprof server threads did not stop in time; detached");
        }
        if left_running > 0 {
            log::debug!(
                "ferroprof: /debug/pprof: {left_running} request thread(s) still capturing; \
                 they end with their capture"
            );
        }
        log::info!("ferroprof: /debug/pprof server on {} stopped", self.addr);
    }
}

impl Drop for PprofServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl std::fmt::Debug for PprofServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PprofServer")
            .field("addr", &self.addr)
            .finish()
    }
}

/// Serves `/debug/pprof` on `addr` (e.g. `"127.0.0.1:6060"`, port 0 for any free port).
pub fn serve(
    addr: impl ToSocketAddrs + std::fmt::Debug,
    source: Arc<dyn ProfileSource>,
) -> Result<PprofServer, HttpError> {
    serve_with(addr, source, HttpConfig::default())
}

/// [`serve`] with explicit settings.
pub fn serve_with(
    addr: impl ToSocketAddrs + std::fmt::Debug,
    source: Arc<dyn ProfileSource>,
    config: HttpConfig,
) -> Result<PprofServer, HttpError> {
    config.validate()?;
    let shown = address_text(&addr);
    let bind_err = |source| HttpError::Bind {
        addr: shown.clone(),
        source,
    };
    let listener = TcpListener::bind(&addr).map_err(bind_err)?;
    let local = listener.local_addr().map_err(bind_err)?;
    // Accepting only when `poll` says so; non-blocking so a connection reset between the two
    // cannot leave the thread blocked in `accept`, deaf to `stop`.
    listener.set_nonblocking(true).map_err(bind_err)?;
    let (wake, woken) = UnixStream::pair().map_err(HttpError::Thread)?;
    let (notify, notified) = UnixStream::pair().map_err(HttpError::Thread)?;
    notify.set_nonblocking(true).map_err(HttpError::Thread)?;
    notified.set_nonblocking(true).map_err(HttpError::Thread)?;
    if !local.ip().is_loopback() {
        log::warn!(
            "ferroprof: /debug/pprof is listening on {local}, which is not a loopback address: \
             anyone who can reach it can profile this process"
        );
    }
    let shared = Arc::new(Shared {
        source,
        config,
        stopping: AtomicBool::new(false),
        inbox: Mutex::new(Vec::new()),
        notify,
        conns: Mutex::new(Conns::default()),
        changed: Condvar::new(),
    });
    let mut server = PprofServer {
        addr: local,
        shared: shared.clone(),
        wake: Some(wake),
        threads: Vec::new(),
        pid: std::process::id(),
    };
    // On an error below, dropping `server` stops the thread already started.
    for (name, run) in [
        (
            "ferroprof-http",
            Box::new(move |s: &Arc<Shared>| accept_loop(s, listener, woken))
                as Box<dyn FnOnce(&Arc<Shared>) + Send>,
        ),
        (
            "ferroprof-http-read",
            Box::new(move |s: &Arc<Shared>| read_loop(s, notified)),
        ),
    ] {
        shared.lock().loops += 1;
        let alive = LoopThread(shared.clone());
        let t = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                // Ours: never sampled (a capture's wait, reads and writes are not the
                // application's).
                crate::threads::enter_profiler_thread();
                run(&alive.0);
                drop(alive);
            })
            .map_err(HttpError::Thread)?;
        server.threads.push(t);
    }
    log::info!("ferroprof: serving /debug/pprof on http://{local}/debug/pprof/");
    Ok(server)
}

/// An address as plain text for errors, whose `Display` quotes it once: a string's own text
/// (its `Debug` form without the quotes), a `(host, port)` pair as `host:port`, anything else
/// (a `SocketAddr`...) as `Debug` shows it.
fn address_text(addr: &impl std::fmt::Debug) -> String {
    let debug = format!("{addr:?}");
    let unquote = |s: &str| {
        s.strip_prefix('"')
            .and_then(|d| d.strip_suffix('"'))
            .filter(|inner| !inner.contains(['"', '\\']))
            .map(str::to_owned)
    };
    if let Some(text) = unquote(&debug) {
        return text;
    }
    let pair = debug
        .strip_prefix('(')
        .and_then(|d| d.strip_suffix(')'))
        .and_then(|d| d.rsplit_once(", "))
        .and_then(|(host, port)| Some((unquote(host)?, port.parse::<u16>().ok()?)));
    match pair {
        Some((host, port)) => format!("{host}:{port}"),
        None => debug,
    }
}

/// Starts the server when `FERROPROF_HTTP_ADDR` is set (`1`/`true` mean [`DEFAULT_ADDR`]).
pub fn serve_from_env(source: Arc<dyn ProfileSource>) -> Result<Option<PprofServer>, HttpError> {
    match std::env::var(ADDR_ENV) {
        Err(_) => Ok(None),
        Ok(v) => match addr_from_env_value(&v)? {
            None => Ok(None),
            Some(addr) => serve(addr.as_str(), source).map(Some),
        },
    }
}

/// What an `FERROPROF_HTTP_ADDR` value means: `None` (off), or an address to bind.
pub fn addr_from_env_value(v: &str) -> Result<Option<String>, HttpError> {
    let v = v.trim();
    match v.to_ascii_lowercase().as_str() {
        "" | "0" | "false" | "off" | "no" => return Ok(None),
        "1" | "true" | "on" | "yes" => return Ok(Some(DEFAULT_ADDR.to_owned())),
        _ => {}
    }
    // A bare port means loopback, never all interfaces.
    if let Ok(port) = v.parse::<u16>() {
        return Ok(Some(format!("127.0.0.1:{port}")));
    }
    if v.rsplit_once(':')
        .is_none_or(|(host, port)| host.is_empty() || port.parse::<u16>().is_err())
    {
        return Err(HttpError::BadAddress {
            addr: v.to_owned(),
            reason: format!("{ADDR_ENV} must be HOST:PORT, a port, or true/false"),
        });
    }
    Ok(Some(v.to_owned()))
}

/// State shared by the server's threads and [`PprofServer`].
struct Shared {
    source: Arc<dyn ProfileSource>,
    config: HttpConfig,
    stopping: AtomicBool,
    /// Connections accepted (and when) and not yet taken by the reading thread.
    inbox: Mutex<Vec<(TcpStream, Instant)>>,
    /// Written to (non-blocking) to wake the reading thread's `poll`.
    notify: UnixStream,
    conns: Mutex<Conns>,
    /// Signalled when a thread ends or leaves the profile source.
    changed: Condvar,
}

#[derive(Default)]
struct Conns {
    /// Id of the next connection.
    next_id: u64,
    /// Requests being served, each by a thread of its own, with a clone of its socket so that
    /// `stop` can shut it down.
    open: BTreeMap<u64, TcpStream>,
    /// Connection threads alive, and how many of them are inside the profile source.
    threads: usize,
    in_source: usize,
    /// The accept and reading threads alive.
    loops: usize,
}

/// What a complete request head comes to.
enum Work {
    Request { method: String, target: String },
    Reply(Reply),
}

/// Ends a connection's bookkeeping when its thread ends.
struct ConnThread {
    shared: Arc<Shared>,
    id: u64,
}

impl Drop for ConnThread {
    fn drop(&mut self) {
        let mut c = self.shared.lock();
        c.open.remove(&self.id);
        c.threads -= 1;
        drop(c);
        self.shared.changed.notify_all();
    }
}

/// Counts a thread as inside the profile source while alive.
struct InSource<'a>(&'a Shared);

impl Drop for InSource<'_> {
    fn drop(&mut self) {
        self.0.lock().in_source -= 1;
        self.0.changed.notify_all();
    }
}

/// Counts the accept or the reading thread as alive.
struct LoopThread(Arc<Shared>);

impl Drop for LoopThread {
    fn drop(&mut self) {
        self.0.lock().loops -= 1;
        self.0.changed.notify_all();
    }
}

/// Accepts until the server stops and hands each connection to the reading thread. Never reads
/// from a client, so no client can hold up accepting or stopping.
fn accept_loop(shared: &Shared, listener: TcpListener, woken: UnixStream) {
    // With this many connections waiting for the reading thread, accepting pauses: further ones
    // wait in the listen backlog rather than being closed unanswered.
    let inbox_cap = shared.config.max_reading.saturating_mul(4);
    let mut full = false;
    while !shared.stopping.load(Ordering::SeqCst) {
        let (listener_fd, woken_fd) = (listener.as_raw_fd(), woken.as_raw_fd());
        if full {
            // The reading thread does not say when it takes from the inbox: look again soon.
            poll_ready(
                &[(woken_fd, libc::POLLIN)],
                Some(Instant::now() + INBOX_RETRY),
            );
        } else {
            poll_ready(
                &[(listener_fd, libc::POLLIN), (woken_fd, libc::POLLIN)],
                None,
            );
        }
        let mut accepted = false;
        loop {
            if shared.stopping.load(Ordering::SeqCst) {
                return;
            }
            full = shared.inbox.lock().unwrap_or_else(|e| e.into_inner()).len() >= inbox_cap;
            if full {
                break;
            }
            match listener.accept() {
                Ok((stream, _)) => match stream.set_nonblocking(true) {
                    Ok(()) => {
                        let mut inbox = shared.inbox.lock().unwrap_or_else(|e| e.into_inner());
                        inbox.push((stream, Instant::now()));
                        accepted = true;
                    }
                    // Cannot be read without blocking the reading thread; nor answered.
                    Err(e) => log::debug!("ferroprof: /debug/pprof: dropping a connection: {e}"),
                },
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    log::warn!("ferroprof: /debug/pprof: accept failed: {e}");
                    // Out of descriptors and similar: do not spin.
                    std::thread::sleep(Duration::from_millis(50));
                    break;
                }
            }
        }
        if accepted {
            // A full notification socket means a wake-up is already pending.
            let _ = (&shared.notify).write(&[1]);
        }
    }
}

/// A connection whose request head is being received.
struct Pending {
    stream: TcpStream,
    head: Vec<u8>,
    /// How much of `head` has been searched for its end.
    scanned: usize,
    /// When the whole head must have arrived, counted from the accept.
    deadline: Instant,
}

/// What reading a connection came to.
enum Step {
    /// Incomplete head, nothing more to read now.
    More,
    /// Closed by the client, or failed: drop it.
    Gone,
    Done(Work),
}

impl Pending {
    /// Reads what has arrived (the socket is non-blocking).
    fn read_some(&mut self) -> Step {
        let mut chunk = [0u8; 2048];
        loop {
            if let Some(end) = head_end(&self.head, self.scanned) {
                return Step::Done(match parse_head(&self.head[..end]) {
                    Ok((method, target)) => Work::Request { method, target },
                    Err(reply) => Work::Reply(reply),
                });
            }
            // The end marker is at most three bytes: it may start in what was already searched.
            self.scanned = self.head.len().saturating_sub(2);
            if self.head.len() >= MAX_HEAD {
                return Step::Done(Work::Reply(Reply::text(
                    431,
                    format!("request head larger than {MAX_HEAD} bytes"),
                )));
            }
            let want = (MAX_HEAD - self.head.len()).min(chunk.len());
            match self.stream.read(&mut chunk[..want]) {
                Ok(0) if self.head.is_empty() => return Step::Gone,
                Ok(0) => {
                    return Step::Done(Work::Reply(Reply::text(400, "request head cut short")))
                }
                Ok(n) => self.head.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Step::More,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return Step::Gone,
            }
        }
    }
}

/// An answer sent by the reading thread itself (an error, a `503`), without blocking: written,
/// then the write side shut, then what the client still sends drained until it closes or
/// [`LINGER`] passes, so the close is not a reset that destroys the answer before it is read.
struct Answer {
    stream: TcpStream,
    out: Vec<u8>,
    sent: usize,
    drained: usize,
    /// For the whole write; once written, for the drain.
    deadline: Instant,
}

impl Answer {
    fn new(stream: TcpStream, reply: &Reply) -> Self {
        // Already non-blocking unless it comes back from `Shared::start`.
        let _ = stream.set_nonblocking(true);
        let mut out = reply_head(reply).into_bytes();
        out.extend_from_slice(&reply.body);
        Answer {
            stream,
            out,
            sent: 0,
            drained: 0,
            deadline: Instant::now() + ANSWER_TIMEOUT,
        }
    }

    fn writing(&self) -> bool {
        self.sent < self.out.len()
    }

    /// Writes or drains what can be now; `false` when done with the connection.
    fn progress(&mut self) -> bool {
        let mut buf = [0u8; 2048];
        loop {
            let step = if self.writing() {
                self.stream.write(&self.out[self.sent..])
            } else {
                self.stream.read(&mut buf)
            };
            match step {
                Ok(0) => return false,
                Ok(n) if self.writing() => {
                    self.sent += n;
                    if !self.writing() {
                        self.out = Vec::new();
                        if self.stream.shutdown(Shutdown::Write).is_err() {
                            return false;
                        }
                        self.deadline = Instant::now() + LINGER;
                    }
                }
                Ok(n) => {
                    self.drained += n;
                    if self.drained >= 4 * MAX_HEAD {
                        return false;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return false,
            }
        }
    }
}

/// Receives request heads on all connections at once, each within its deadline, and hands
/// each complete one to a thread of its own. At most `max_reading` connections are read; a new
/// one beyond that displaces the one that has been reading longest, which is answered `503`. A
/// new connection is read before it can displace anyone, so a client that sends its request at
/// once is never displaced by a crowd of slow ones. Every connection this thread lets go of has
/// been answered, except one that closed or failed first.
fn read_loop(shared: &Arc<Shared>, notified: UnixStream) {
    let max = shared.config.max_reading;
    // Connections being read or answered here. At the cap, new ones are left in the inbox (and
    // the accept thread then leaves them in the listen backlog) until answers are done.
    let cap = max.saturating_mul(4);
    // Oldest first.
    let mut reading: Vec<Pending> = Vec::new();
    let mut answering: Vec<Answer> = Vec::new();
    let mut fds = Vec::new();
    while !shared.stopping.load(Ordering::SeqCst) {
        // Each arrival adds at most one answer (its own or a displaced one's), and a connection
        // being read becomes at most one: the two together stay within `cap`.
        let room = cap.saturating_sub(reading.len() + answering.len());
        let (arrived, waiting) = {
            let mut inbox = shared.inbox.lock().unwrap_or_else(|e| e.into_inner());
            let n = room.min(inbox.len());
            let arrived: Vec<_> = inbox.drain(..n).collect();
            (arrived, !inbox.is_empty())
        };
        for (stream, accepted) in arrived {
            let mut p = Pending {
                stream,
                head: Vec::new(),
                scanned: 0,
                deadline: accepted + shared.config.read_timeout,
            };
            match p.read_some() {
                Step::More => {
                    if reading.len() >= max {
                        let displaced = reading.remove(0);
                        let busy = Reply::text(
                            503,
                            "too many connections are sending their request; try again later",
                        );
                        answer(&mut answering, displaced.stream, &busy);
                    }
                    reading.push(p);
                }
                Step::Gone => {}
                Step::Done(work) => hand_off(shared, &mut answering, p.stream, work),
            }
        }
        fds.clear();
        fds.push((notified.as_raw_fd(), libc::POLLIN));
        fds.extend(reading.iter().map(|p| (p.stream.as_raw_fd(), libc::POLLIN)));
        fds.extend(answering.iter().map(|a| {
            let events = if a.writing() {
                libc::POLLOUT
            } else {
                libc::POLLIN
            };
            (a.stream.as_raw_fd(), events)
        }));
        let next_deadline = if waiting && reading.len() + answering.len() < cap {
            // Room again for connections left in the inbox: take them at once.
            Some(Instant::now())
        } else {
            let reads = reading.iter().map(|p| p.deadline);
            reads.chain(answering.iter().map(|a| a.deadline)).min()
        };
        let ready = poll_ready(&fds, next_deadline);
        if ready.first() == Some(&true) {
            let mut sink = [0u8; 64];
            while matches!((&notified).read(&mut sink), Ok(1..)) {}
        }
        let now = Instant::now();
        // `ready[0]` is the notification socket, then `reading`, then `answering` as polled.
        let answers_at = 1 + reading.len();
        for (i, mut a) in std::mem::take(&mut answering).into_iter().enumerate() {
            let more = match ready.get(answers_at + i) {
                Some(true) => a.progress(),
                _ => true,
            };
            // Past its deadline: closed (a drain) or given up on (a client that does not read).
            if more && now < a.deadline {
                answering.push(a);
            }
        }
        for (i, mut p) in std::mem::take(&mut reading).into_iter().enumerate() {
            let step = match ready.get(i + 1) {
                Some(true) => p.read_some(),
                _ => Step::More,
            };
            match step {
                Step::More if now < p.deadline => reading.push(p),
                Step::More => {
                    let late = Reply::text(408, "the request head did not arrive in time");
                    answer(&mut answering, p.stream, &late);
                }
                Step::Gone => {}
                Step::Done(work) => hand_off(shared, &mut answering, p.stream, work),
            }
        }
    }
    // Close everything not yet handed off.
    drop(reading);
    drop(answering);
    shared
        .inbox
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clear();
}

/// Starts sending `reply`; kept in `answering` until written and drained.
fn answer(answering: &mut Vec<Answer>, stream: TcpStream, reply: &Reply) {
    let mut a = Answer::new(stream, reply);
    if a.progress() {
        answering.push(a);
    }
}

/// A complete head: a request goes to a thread of its own, an error is answered here.
fn hand_off(shared: &Arc<Shared>, answering: &mut Vec<Answer>, stream: TcpStream, work: Work) {
    match work {
        Work::Request { method, target } => {
            if let Err((stream, busy)) = shared.start(stream, method, target) {
                answer(answering, stream, &busy);
            }
        }
        Work::Reply(reply) => answer(answering, stream, &reply),
    }
}

/// Waits until one of `fds` is ready for its events (or closed), `deadline` passes, or a signal
/// arrives; says which are ready.
fn poll_ready(fds: &[(RawFd, libc::c_short)], deadline: Option<Instant>) -> Vec<bool> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&(fd, events)| libc::pollfd {
            fd,
            events,
            revents: 0,
        })
        .collect();
    let timeout_ms = match deadline {
        None => -1,
        // Rounded up, so an early wake-up does not spin until the deadline.
        Some(d) => d
            .saturating_duration_since(Instant::now())
            .as_micros()
            .div_ceil(1000)
            .min(i32::MAX as u128) as i32,
    };
    // SAFETY: `pfds` is a valid, writable array of `pfds.len()` entries for the whole call; the
    // descriptors belong to sockets the caller keeps open until it returns.
    let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, timeout_ms) };
    if n < 0 {
        let e = std::io::Error::last_os_error();
        // A signal (the profiler's own, say): the caller looks at its state and comes back.
        if e.kind() != ErrorKind::Interrupted {
            log::warn!("ferroprof: /debug/pprof: poll failed: {e}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    pfds.iter().map(|p| p.revents != 0).collect()
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Conns> {
        // The bookkeeping stays consistent even if a thread panicked while holding the lock.
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Hands a request to a thread of its own. When `max_concurrent` requests are being served
    /// (or no thread can be had), gives the connection back with the `503` to send instead.
    fn start(
        self: &Arc<Self>,
        stream: TcpStream,
        method: String,
        target: String,
    ) -> Result<(), (TcpStream, Reply)> {
        let busy = || {
            Reply::text(
                503,
                "too many /debug/pprof requests in progress; try again later",
            )
        };
        let id = {
            let mut c = self.lock();
            if self.stopping.load(Ordering::SeqCst) {
                // `stop` closes every connection.
                return Ok(());
            }
            if c.open.len() >= self.config.max_concurrent {
                return Err((stream, busy()));
            }
            // Out of descriptors and the like.
            let (Ok(()), Ok(clone)) = (stream.set_nonblocking(false), stream.try_clone()) else {
                return Err((stream, busy()));
            };
            let id = c.next_id;
            c.next_id += 1;
            c.open.insert(id, clone);
            c.threads += 1;
            id
        };
        let shared = self.clone();
        let spawned = std::thread::Builder::new()
            .name("ferroprof-http-conn".into())
            .spawn(move || {
                crate::threads::enter_profiler_thread();
                let done = ConnThread { shared, id };
                done.shared.serve(stream, &method, &target);
            });
        let Err(e) = spawned else {
            return Ok(());
        };
        log::warn!("ferroprof: /debug/pprof: cannot start a connection thread: {e}");
        // The thread's end of the socket went with it; the registered clone is answered.
        let mut c = self.lock();
        let clone = c.open.remove(&id);
        c.threads -= 1;
        drop(c);
        self.changed.notify_all();
        clone.map_or(Ok(()), |s| Err((s, busy())))
    }

    fn serve(&self, mut stream: TcpStream, method: &str, target: &str) {
        let head_only = method == "HEAD";
        let path = target.split('?').next().unwrap_or("");
        let is_index = path == "/debug/pprof" || path == "/debug/pprof/";
        // HEAD is for the index only: on a profile it would take the profile and throw it away.
        let reply = if method == "GET" || (head_only && is_index) {
            self.route(target)
        } else {
            Reply::text(
                405,
                format!("method {} not allowed here; use GET", shown(method)),
            )
        };
        // After a stop the socket is shut down: nothing to answer.
        if !self.stopping.load(Ordering::SeqCst) {
            finish(&mut stream, &reply, head_only);
        }
    }

    /// Runs `f` (a call into the profile source) counted as such, so `stop` does not wait for
    /// it.
    fn in_source<T>(&self, f: impl FnOnce() -> T) -> T {
        self.lock().in_source += 1;
        let _counted = InSource(self);
        f()
    }

    fn route(&self, target: &str) -> Reply {
        let (path, query) = target.split_once('?').unwrap_or((target, ""));
        match path {
            "/debug/pprof" | "/debug/pprof/" => Reply {
                status: 200,
                content_type: "text/html; charset=utf-8",
                disposition: None,
                body: INDEX.as_bytes().to_vec(),
            },
            "/debug/pprof/profile" => match self.seconds(query) {
                Ok(d) => match self.in_source(|| self.source.cpu_profile(d)) {
                    Ok(b) => Reply::profile(b, "profile"),
                    Err(e) => Reply::text(500, format!("could not take a CPU profile: {e}")),
                },
                Err(r) => r,
            },
            "/debug/pprof/heap" => match self.in_source(|| self.source.heap_profile()) {
                Ok(b) => Reply::profile(b, "heap"),
                Err(e) => Reply::text(500, format!("could not take a heap profile: {e}")),
            },
            "/debug/pprof/allocs" => match self.seconds(query) {
                Ok(d) => match self.in_source(|| self.source.allocs_profile(d)) {
                    Ok(b) => Reply::profile(b, "allocs"),
                    Err(e) => {
                        Reply::text(500, format!("could not take an allocation profile: {e}"))
                    }
                },
                Err(r) => r,
            },
            _ => Reply::text(
                404,
                format!("unknown profile {path:?}; see /debug/pprof/ for the list"),
            ),
        }
    }

    /// The `seconds` query parameter, validated.
    fn seconds(&self, query: &str) -> Result<Duration, Reply> {
        let max = self.config.max_seconds;
        let raw = query
            .split('&')
            .filter_map(|kv| kv.split_once('=').or(Some((kv, ""))))
            .find(|(k, _)| *k == "seconds")
            .map(|(_, v)| v);
        let secs = match raw {
            None => self.config.default_seconds,
            Some(v) => match v.parse::<u64>() {
                Ok(n) if (1..=max).contains(&n) => n,
                _ => {
                    return Err(Reply::text(
                        400,
                        format!("invalid seconds={v:?}: expected a whole number from 1 to {max}"),
                    ))
                }
            },
        };
        Ok(Duration::from_secs(secs))
    }
}

/// One response.
#[derive(Debug)]
struct Reply {
    status: u16,
    content_type: &'static str,
    disposition: Option<&'static str>,
    body: Vec<u8>,
}

impl Reply {
    fn text(status: u16, body: impl Into<String>) -> Self {
        let mut body = body.into();
        if !body.ends_with('\n') {
            body.push('\n');
        }
        Reply {
            status,
            content_type: "text/plain; charset=utf-8",
            disposition: None,
            body: body.into_bytes(),
        }
    }

    fn profile(bytes: Vec<u8>, filename: &'static str) -> Self {
        Reply {
            status: 200,
            content_type: "application/octet-stream",
            disposition: Some(filename),
            body: bytes,
        }
    }
}

/// The method and target of a complete request head; an error answer if it is not HTTP/1.x.
fn parse_head(head: &[u8]) -> Result<(String, String), Reply> {
    let line = head.split(|&b| b == b'\n').next().unwrap_or(&[]);
    let Ok(line) = std::str::from_utf8(line) else {
        return Err(Reply::text(400, "request line is not UTF-8"));
    };
    let mut parts = line.split_whitespace();
    let (Some(method), Some(target), Some(version)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err(Reply::text(
            400,
            format!("malformed request line {:?}", shown(line.trim_end())),
        ));
    };
    if !version.starts_with("HTTP/1.") {
        return Err(Reply::text(
            505,
            format!("unsupported protocol {:?}", shown(version)),
        ));
    }
    // The headers are skipped: a GET has no body, and nothing here depends on them.
    Ok((method.to_owned(), target.to_owned()))
}

/// At most the first 100 characters of `text`: error answers stay small (they are sent without
/// a thread, in one non-blocking write).
fn shown(text: &str) -> &str {
    text.char_indices()
        .nth(100)
        .map_or(text, |(i, _)| &text[..i])
}

/// Where the head ends: after the first empty line (`\n\n` or `\n\r\n`), if it has arrived.
/// Looks at line ends from `from` on.
fn head_end(head: &[u8], from: usize) -> Option<usize> {
    head.iter().enumerate().skip(from).find_map(|(i, &b)| {
        if b != b'\n' {
            return None;
        }
        match &head[i + 1..] {
            [b'\n', ..] => Some(i + 2),
            [b'\r', b'\n', ..] => Some(i + 3),
            _ => None,
        }
    })
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        505 => "HTTP Version Not Supported",
        _ => "",
    }
}

/// Sends the reply within [`WRITE_TIMEOUT`], then closes the connection gracefully.
fn finish(stream: &mut TcpStream, reply: &Reply, head_only: bool) {
    let deadline = Instant::now() + WRITE_TIMEOUT;
    if let Err(e) = write_reply(stream, reply, head_only, deadline) {
        log::debug!("ferroprof: /debug/pprof: writing the response failed: {e}");
        return;
    }
    let _ = stream.shutdown(Shutdown::Write);
    // Drain what the client still sends (briefly, and not much), so the close is not a reset.
    let end = Instant::now() + LINGER;
    let mut buf = [0u8; 2048];
    let mut drained = 0;
    while drained < 4 * MAX_HEAD {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match stream.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => drained += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// The status line and headers of `reply`.
fn reply_head(reply: &Reply) -> String {
    let mut head = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\
         X-Content-Type-Options: nosniff\r\n",
        reply.status,
        reason(reply.status),
        reply.content_type,
        reply.body.len()
    );
    if let Some(name) = reply.disposition {
        head.push_str(&format!(
            "Content-Disposition: attachment; filename=\"{name}\"\r\n"
        ));
    }
    head.push_str("\r\n");
    head
}

fn write_reply(
    stream: &mut TcpStream,
    reply: &Reply,
    head_only: bool,
    deadline: Instant,
) -> std::io::Result<()> {
    write_all_by(stream, reply_head(reply).as_bytes(), deadline)?;
    if !head_only {
        write_all_by(stream, &reply.body, deadline)?;
    }
    Ok(())
}

/// `write_all` that gives up at `deadline` (a per-write timeout alone would let a client that
/// reads a little now and then keep the thread forever).
fn write_all_by(stream: &mut TcpStream, mut buf: &[u8], deadline: Instant) -> std::io::Result<()> {
    while !buf.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ErrorKind::TimedOut.into());
        }
        stream.set_write_timeout(Some(left))?;
        match stream.write(buf) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

const INDEX: &str = "<!DOCTYPE html>
<html><head><title>/debug/pprof/</title></head>
<body>
<h1>/debug/pprof/</h1>
<p>Profiles of this process, in pprof format (read them with <code>go tool pprof</code> or <code>ferroprof top</code>):</p>
<table>
<tr><td><a href=\"profile?seconds=30\">profile</a></td><td>CPU and wall time sampled over the next <code>seconds</code> (default 30)</td></tr>
<tr><td><a href=\"heap\">heap</a></td><td>sampled live heap allocations right now, and allocations since the profiler started</td></tr>
<tr><td><a href=\"allocs?seconds=30\">allocs</a></td><td>sampled allocations over the next <code>seconds</code> (default 30)</td></tr>
</table>
<p>Example: <code>go tool pprof -top http://HOST:PORT/debug/pprof/profile?seconds=10</code></p>
</body></html>
";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_values() {
        assert_eq!(addr_from_env_value("").unwrap(), None);
        assert_eq!(addr_from_env_value("false").unwrap(), None);
        assert_eq!(
            addr_from_env_value("true").unwrap().as_deref(),
            Some(DEFAULT_ADDR)
        );
        assert_eq!(
            addr_from_env_value("7070").unwrap().as_deref(),
            Some("127.0.0.1:7070")
        );
        assert_eq!(
            addr_from_env_value("0.0.0.0:80").unwrap().as_deref(),
            Some("0.0.0.0:80")
        );
        let e = addr_from_env_value("localhost").unwrap_err().to_string();
        assert!(e.contains("localhost"), "{e}");
    }

    #[test]
    fn head_end_is_found_however_the_head_is_split() {
        for head in [
            &b"GET / HTTP/1.1\r\nHost: x\r\n\r\nrest"[..],
            b"GET / HTTP/1.1\nHost: x\n\nrest",
            b"GET / HTTP/1.1\r\n\r\n",
        ] {
            let whole = head_end(head, 0).unwrap();
            assert_eq!(
                &head[whole..],
                if head.ends_with(b"rest") {
                    &b"rest"[..]
                } else {
                    b""
                }
            );
            // As the reading thread does: search the first part, then the rest from two bytes
            // before the old end.
            for split in 0..head.len() {
                let first = head_end(&head[..split], 0);
                let found = first.or_else(|| head_end(head, split.saturating_sub(2)));
                assert_eq!(found, Some(whole), "split at {split}");
            }
        }
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nHost: x\r\n", 0), None);
    }

    #[test]
    fn request_lines() {
        let (m, t) = parse_head(b"GET /debug/pprof/heap HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        assert_eq!((m.as_str(), t.as_str()), ("GET", "/debug/pprof/heap"));
        assert_eq!(parse_head(b"GET /\r\n\r\n").unwrap_err().status, 400);
        assert_eq!(parse_head(b"GET / SPDY/3\r\n\r\n").unwrap_err().status, 505);
        assert_eq!(
            parse_head(b"GET /\xff HTTP/1.1\r\n\r\n")
                .unwrap_err()
                .status,
            400
        );
    }
}
