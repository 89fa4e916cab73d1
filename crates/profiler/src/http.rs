//! `/debug/pprof` over HTTP, like Go's `net/http/pprof`: opt-in, loopback by default.
//!
//! | path | serves |
//! |---|---|
//! | `/debug/pprof/` | a plain index page |
//! | `/debug/pprof/profile?seconds=N` | CPU and wall samples over the next N seconds (default 30) |
//! | `/debug/pprof/heap` | the live heap now |
//! | `/debug/pprof/allocs?seconds=N` | allocation samples over the next N seconds (default 30) |
//!
//! A small blocking server on `std::net`: one accept thread and one short-lived thread per
//! request, at most [`HttpConfig::max_concurrent`] at once (a profile request holds its thread for
//! N seconds); requests beyond that get `503`. Only `GET` (and `HEAD` for the index) is served.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::export::ProfileSource;

/// Default address: loopback only, Go's conventional port.
pub const DEFAULT_ADDR: &str = "127.0.0.1:6060";
/// Environment variable that turns the server on (see [`serve_from_env`]).
pub const ADDR_ENV: &str = "FERROPROF_HTTP_ADDR";

/// Longest request head read; a longer one is answered with 431.
const MAX_HEAD: usize = 16 * 1024;

/// Errors starting the server.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("invalid /debug/pprof address {addr:?}: {reason}")]
    BadAddress { addr: String, reason: String },
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
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
    /// Requests handled at once; more get 503.
    pub max_concurrent: usize,
    /// How long a client may take to send its request head.
    pub read_timeout: Duration,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            default_seconds: 30,
            max_seconds: 600,
            max_concurrent: 4,
            read_timeout: Duration::from_secs(10),
        }
    }
}

/// A running server; stops when [`PprofServer::stop`] is called or when dropped.
pub struct PprofServer {
    addr: SocketAddr,
    stopping: Arc<AtomicBool>,
    accept_thread: Option<JoinHandle<()>>,
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

    /// Stops accepting and joins the accept thread. Requests in progress finish on their own
    /// threads.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        let Some(t) = self.accept_thread.take() else {
            return;
        };
        self.stopping.store(true, Ordering::SeqCst);
        // `accept` has no timeout: wake it with a connection of our own.
        let wake = match self.addr {
            SocketAddr::V4(a) if a.ip().is_unspecified() => {
                SocketAddr::from(([127, 0, 0, 1], a.port()))
            }
            SocketAddr::V6(a) if a.ip().is_unspecified() => {
                SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, a.port()))
            }
            a => a,
        };
        if TcpStream::connect_timeout(&wake, Duration::from_secs(1)).is_ok() {
            let _ = t.join();
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
    let shown = format!("{addr:?}");
    let listener = TcpListener::bind(&addr).map_err(|source| HttpError::Bind {
        addr: shown.clone(),
        source,
    })?;
    let local = listener.local_addr().map_err(|source| HttpError::Bind {
        addr: shown,
        source,
    })?;
    if !local.ip().is_loopback() {
        log::warn!(
            "ferroprof: /debug/pprof is listening on {local}, which is not a loopback address: \
             anyone who can reach it can profile this process"
        );
    }
    let stopping = Arc::new(AtomicBool::new(false));
    let server = Server {
        source,
        config,
        active: Arc::new(AtomicUsize::new(0)),
    };
    let stop = stopping.clone();
    let accept_thread = std::thread::Builder::new()
        .name("ferroprof-http".into())
        .spawn(move || server.accept_loop(listener, stop))
        .map_err(HttpError::Thread)?;
    log::info!("ferroprof: serving /debug/pprof on http://{local}/debug/pprof/");
    Ok(PprofServer {
        addr: local,
        stopping,
        accept_thread: Some(accept_thread),
    })
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

struct Server {
    source: Arc<dyn ProfileSource>,
    config: HttpConfig,
    active: Arc<AtomicUsize>,
}

/// One response.
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

impl Server {
    fn accept_loop(self, listener: TcpListener, stopping: Arc<AtomicBool>) {
        let this = Arc::new(self);
        for conn in listener.incoming() {
            if stopping.load(Ordering::SeqCst) {
                break;
            }
            let stream = match conn {
                Ok(s) => s,
                Err(e) => {
                    log::warn!("ferroprof: /debug/pprof: accept failed: {e}");
                    // Out of descriptors and similar: do not spin.
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
            };
            if this.active.fetch_add(1, Ordering::SeqCst) >= this.config.max_concurrent {
                this.active.fetch_sub(1, Ordering::SeqCst);
                let mut stream = stream;
                // Read the request first: closing with unread data makes the kernel send a
                // reset, which can destroy the 503 before the client reads it. The short
                // timeout bounds how long a slow client holds up accepting.
                let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
                let _ = read_request_head(&mut stream);
                let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
                let _ = write_reply(
                    &mut stream,
                    &Reply::text(
                        503,
                        "too many /debug/pprof requests in progress; try again later",
                    ),
                    false,
                );
                continue;
            }
            let server = this.clone();
            let spawned = std::thread::Builder::new()
                .name("ferroprof-http-req".into())
                .spawn(move || {
                    server.handle(stream);
                    server.active.fetch_sub(1, Ordering::SeqCst);
                });
            if let Err(e) = spawned {
                this.active.fetch_sub(1, Ordering::SeqCst);
                log::warn!("ferroprof: /debug/pprof: cannot start a request thread: {e}");
            }
        }
    }

    fn handle(&self, mut stream: TcpStream) {
        let _ = stream.set_read_timeout(Some(self.config.read_timeout));
        let (method, target) = match read_request_head(&mut stream) {
            Ok(Some(x)) => x,
            Ok(None) => return,
            Err(reply) => {
                let _ = write_reply(&mut stream, &reply, false);
                return;
            }
        };
        let head_only = method == "HEAD";
        let path = target.split('?').next().unwrap_or("");
        let is_index = path == "/debug/pprof" || path == "/debug/pprof/";
        // HEAD is for the index only: on a profile it would take the profile and throw it away.
        let reply = if method == "GET" || (head_only && is_index) {
            self.route(&target)
        } else {
            Reply::text(405, format!("method {method} not allowed here; use GET"))
        };
        // Bounded, so a client that stops reading cannot hold the thread forever.
        let _ = stream.set_write_timeout(Some(Duration::from_secs(30)));
        if let Err(e) = write_reply(&mut stream, &reply, head_only) {
            log::debug!("ferroprof: /debug/pprof: writing the response failed: {e}");
        }
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
                Ok(d) => match self.source.cpu_profile(d) {
                    Ok(b) => Reply::profile(b, "profile"),
                    Err(e) => Reply::text(500, format!("could not take a CPU profile: {e}")),
                },
                Err(r) => r,
            },
            "/debug/pprof/heap" => match self.source.heap_profile() {
                Ok(b) => Reply::profile(b, "heap"),
                Err(e) => Reply::text(500, format!("could not take a heap profile: {e}")),
            },
            "/debug/pprof/allocs" => match self.seconds(query) {
                Ok(d) => match self.source.allocs_profile(d) {
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

/// Reads the request line and headers; returns (method, target). `Ok(None)` when the client sent
/// nothing (e.g. the wake-up connection of `stop`).
fn read_request_head(stream: &mut TcpStream) -> Result<Option<(String, String)>, Reply> {
    let mut reader = BufReader::new(stream.take(MAX_HEAD as u64));
    let mut line = String::new();
    match reader.read_line(&mut line) {
        Ok(0) => return Ok(None),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
            return Err(Reply::text(400, "request line is not UTF-8"))
        }
        Err(_) => return Ok(None),
    }
    let mut parts = line.split_whitespace();
    let (Some(method), Some(target), Some(version)) = (parts.next(), parts.next(), parts.next())
    else {
        return Err(Reply::text(
            400,
            format!("malformed request line {:?}", line.trim_end()),
        ));
    };
    if !version.starts_with("HTTP/1.") {
        return Err(Reply::text(
            505,
            format!("unsupported protocol {version:?}"),
        ));
    }
    let (method, target) = (method.to_owned(), target.to_owned());
    // Skip headers up to the blank line; a GET has no body worth reading.
    loop {
        let mut h = String::new();
        match reader.read_line(&mut h) {
            Ok(0) => return Err(Reply::text(431, "request head too large or cut short")),
            Ok(_) if h == "\r\n" || h == "\n" => break,
            Ok(_) => {}
            Err(_) => return Err(Reply::text(400, "could not read the request headers")),
        }
    }
    Ok(Some((method, target)))
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        505 => "HTTP Version Not Supported",
        _ => "",
    }
}

fn write_reply(stream: &mut TcpStream, reply: &Reply, head_only: bool) -> std::io::Result<()> {
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
    stream.write_all(head.as_bytes())?;
    if !head_only {
        stream.write_all(&reply.body)?;
    }
    stream.flush()
}

const INDEX: &str = "<!DOCTYPE html>
<html><head><title>/debug/pprof/</title></head>
<body>
<h1>/debug/pprof/</h1>
<p>Profiles of this process, in pprof format (read them with <code>go tool pprof</code> or <code>ferroprof top</code>):</p>
<table>
<tr><td><a href=\"profile?seconds=30\">profile</a></td><td>CPU and wall time sampled over the next <code>seconds</code> (default 30)</td></tr>
<tr><td><a href=\"heap\">heap</a></td><td>sampled live heap allocations, right now</td></tr>
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
}
