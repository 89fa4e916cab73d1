//! HTTP POST for the network exporters: over TCP (plain HTTP, or HTTPS with the `tls` feature)
//! through `ureq`, and over a unix socket (the Datadog agent's `apm.socket`) with a minimal
//! HTTP/1.1 client, plus a multipart/form-data body builder.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use super::queue::Rng;
use super::ExportError;

/// Longest response body kept for error messages.
const MAX_ERROR_BODY: usize = 512;
/// Longest response read from a unix socket (headers included); the rest is ignored.
const MAX_UNIX_RESPONSE: usize = 64 * 1024;

/// Where requests go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// A full `http://` or `https://` URL.
    Url(String),
    /// A unix socket and the request path to use on it.
    Unix {
        /// The socket's path.
        socket: PathBuf,
        /// The request path.
        path: String,
    },
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Url(u) => f.write_str(u),
            Endpoint::Unix { socket, path } => write!(f, "unix://{}{}", socket.display(), path),
        }
    }
}

/// One request body with its content type.
pub struct Body {
    /// The `Content-Type` header.
    pub content_type: String,
    /// The body.
    pub bytes: Vec<u8>,
}

/// A non-error (2xx) response.
#[derive(Debug)]
pub struct Response {
    /// The HTTP status.
    pub status: u16,
}

/// POSTs `body` and maps everything that is not 2xx to an [`ExportError`].
pub fn post(
    backend: &str,
    endpoint: &Endpoint,
    headers: &[(String, String)],
    body: &Body,
    timeout: Duration,
) -> Result<Response, ExportError> {
    match endpoint {
        Endpoint::Url(url) => post_url(backend, url, headers, body, timeout),
        Endpoint::Unix { socket, path } => {
            post_unix(backend, endpoint, socket, path, headers, body, timeout)
        }
    }
}

/// Fails for an `https` URL when this build has no TLS (the `tls` feature), so the problem shows
/// when the exporter is built rather than as an obscure error at every upload.
pub fn check_tls_available(url: &str) -> Result<(), ExportError> {
    if cfg!(feature = "tls")
        || !url
            .trim_start()
            .to_ascii_lowercase()
            .starts_with("https://")
    {
        return Ok(());
    }
    Err(ExportError::Config(format!(
        "{url} needs HTTPS, but ferroprof was built without its `tls` feature"
    )))
}

fn post_url(
    backend: &str,
    url: &str,
    headers: &[(String, String)],
    body: &Body,
    timeout: Duration,
) -> Result<Response, ExportError> {
    check_tls_available(url)?;
    let config = ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .http_status_as_error(false)
        // A redirected POST would turn into a GET and lose the profile: treat 3xx as an answer.
        .max_redirects(0)
        .user_agent(concat!("ferroprof/", env!("CARGO_PKG_VERSION")))
        .build();
    let agent = ureq::Agent::new_with_config(config);
    let mut req = agent.post(url).header("Content-Type", &body.content_type);
    for (k, v) in headers {
        req = req.header(k.as_str(), v.as_str());
    }
    match req.send(&body.bytes[..]) {
        Ok(mut resp) => {
            let status = resp.status().as_u16();
            if (200..300).contains(&status) {
                return Ok(Response { status });
            }
            let text = resp
                .body_mut()
                .with_config()
                .limit(MAX_ERROR_BODY as u64 * 4)
                .read_to_vec()
                .map(|b| error_body(&b))
                .unwrap_or_default();
            Err(ExportError::Rejected {
                backend: backend.to_owned(),
                status,
                body: text,
            })
        }
        Err(ureq::Error::Timeout(_)) => Err(ExportError::Timeout {
            backend: backend.to_owned(),
            after: timeout,
        }),
        Err(ureq::Error::Io(e)) if is_timeout(&e) => Err(ExportError::Timeout {
            backend: backend.to_owned(),
            after: timeout,
        }),
        Err(e) => Err(ExportError::Unreachable {
            backend: backend.to_owned(),
            target: url.to_owned(),
            reason: e.to_string(),
        }),
    }
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
    )
}

fn error_body(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let text = text.trim();
    match text.char_indices().nth(MAX_ERROR_BODY) {
        Some((i, _)) => format!("{}...", &text[..i]),
        None => text.to_owned(),
    }
}

#[cfg(unix)]
fn post_unix(
    backend: &str,
    endpoint: &Endpoint,
    socket: &std::path::Path,
    path: &str,
    headers: &[(String, String)],
    body: &Body,
    timeout: Duration,
) -> Result<Response, ExportError> {
    let deadline = Instant::now() + timeout;
    let unreachable = |reason: String| ExportError::Unreachable {
        backend: backend.to_owned(),
        target: endpoint.to_string(),
        reason,
    };
    let timed_out = || ExportError::Timeout {
        backend: backend.to_owned(),
        after: timeout,
    };
    // Connecting to a unix socket does not wait on the network: a missing or refusing socket
    // fails at once, so only reads and writes need the deadline.
    let mut stream = std::os::unix::net::UnixStream::connect(socket)
        .map_err(|e| unreachable(format!("connect: {e}")))?;

    let mut head = format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nUser-Agent: ferroprof/{}\r\n\
         Content-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n",
        env!("CARGO_PKG_VERSION"),
        body.content_type,
        body.bytes.len()
    );
    for (k, v) in headers {
        head.push_str(k);
        head.push_str(": ");
        head.push_str(v);
        head.push_str("\r\n");
    }
    head.push_str("\r\n");

    let io_err = |e: std::io::Error| {
        if is_timeout(&e) {
            timed_out()
        } else {
            unreachable(e.to_string())
        }
    };
    for chunk in [head.as_bytes(), &body.bytes[..]] {
        // Write in slices so the deadline is checked between them.
        for part in chunk.chunks(64 * 1024) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(timed_out());
            }
            stream.set_write_timeout(Some(left)).map_err(io_err)?;
            stream.write_all(part).map_err(io_err)?;
        }
    }

    let mut resp = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(timed_out());
        }
        stream.set_read_timeout(Some(left)).map_err(io_err)?;
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                resp.extend_from_slice(&buf[..n]);
                if resp.len() >= MAX_UNIX_RESPONSE {
                    break;
                }
                // With the whole head and a Content-Length body read, do not wait for the peer
                // to close.
                if response_complete(&resp) {
                    break;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(io_err(e)),
        }
    }
    let (status, body_start) =
        parse_status(&resp).ok_or_else(|| unreachable("malformed HTTP response".to_owned()))?;
    if (200..300).contains(&status) {
        Ok(Response { status })
    } else {
        Err(ExportError::Rejected {
            backend: backend.to_owned(),
            status,
            body: error_body(&resp[body_start.min(resp.len())..]),
        })
    }
}

#[cfg(not(unix))]
fn post_unix(
    backend: &str,
    endpoint: &Endpoint,
    _socket: &std::path::Path,
    _path: &str,
    _headers: &[(String, String)],
    _body: &Body,
    _timeout: Duration,
) -> Result<Response, ExportError> {
    Err(ExportError::Config(format!(
        "{backend}: unix sockets are not supported on this platform ({endpoint})"
    )))
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// Status code and where the body starts, once the head is complete.
fn parse_status(resp: &[u8]) -> Option<(u16, usize)> {
    let end = find(resp, b"\r\n\r\n")?;
    let head = std::str::from_utf8(&resp[..end]).ok()?;
    let status_line = head.lines().next()?;
    let mut parts = status_line.split_whitespace();
    if !parts.next()?.starts_with("HTTP/1.") {
        return None;
    }
    let status = parts.next()?.parse().ok()?;
    Some((status, end + 4))
}

fn response_complete(resp: &[u8]) -> bool {
    let Some(end) = find(resp, b"\r\n\r\n") else {
        return false;
    };
    let Ok(head) = std::str::from_utf8(&resp[..end]) else {
        return false;
    };
    let len = head.lines().skip(1).find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim()
            .eq_ignore_ascii_case("content-length")
            .then(|| v.trim().parse::<usize>().ok())
            .flatten()
    });
    matches!(len, Some(n) if resp.len() >= end + 4 + n)
}

/// Builds a multipart/form-data body.
pub struct Multipart {
    parts: Vec<(String, String, String, Vec<u8>)>,
}

impl Multipart {
    /// An empty body.
    pub fn new() -> Self {
        Multipart { parts: Vec::new() }
    }

    /// Adds a file part: form field `name`, `filename`, its content type and content.
    pub fn file(mut self, name: &str, filename: &str, content_type: &str, bytes: Vec<u8>) -> Self {
        self.parts.push((
            name.to_owned(),
            filename.to_owned(),
            content_type.to_owned(),
            bytes,
        ));
        self
    }

    /// The body with a boundary that occurs in no part, and its content type.
    pub fn finish(self) -> Body {
        let mut rng = Rng::new();
        // A random boundary essentially never occurs in the content; check anyway, since a
        // collision would silently truncate a part.
        let boundary = loop {
            let b = format!("ferroprof-{:016x}{:016x}", rng.next_u64(), rng.next_u64());
            if !self
                .parts
                .iter()
                .any(|p| find(&p.3, b.as_bytes()).is_some())
            {
                break b;
            }
        };
        let size: usize = self.parts.iter().map(|p| p.3.len() + 200).sum();
        let mut out = Vec::with_capacity(size + 64);
        for (name, filename, content_type, bytes) in &self.parts {
            out.extend_from_slice(
                format!(
                    "--{boundary}\r\nContent-Disposition: form-data; name=\"{}\"; filename=\"{}\"\r\n\
                     Content-Type: {content_type}\r\n\r\n",
                    quote_escape(name),
                    quote_escape(filename)
                )
                .as_bytes(),
            );
            out.extend_from_slice(bytes);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
        Body {
            content_type: format!("multipart/form-data; boundary={boundary}"),
            bytes: out,
        }
    }
}

impl Default for Multipart {
    fn default() -> Self {
        Self::new()
    }
}

fn quote_escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace(['\r', '\n'], " ")
}

/// A JSON string literal.
pub fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Standard base64 with padding (for HTTP basic auth).
pub fn base64(data: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(data.len().div_ceil(3) * 4);
    for chunk in data.chunks(3) {
        let b = [
            chunk[0],
            chunk.get(1).copied().unwrap_or(0),
            chunk.get(2).copied().unwrap_or(0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Percent-encodes everything but RFC 3986 unreserved characters.
pub fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc4648_vectors() {
        let cases = [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ];
        for (i, o) in cases {
            assert_eq!(base64(i.as_bytes()), o);
        }
    }

    #[test]
    fn json_strings_are_escaped() {
        assert_eq!(json_string("a\"b\\c\n\u{1}é"), "\"a\\\"b\\\\c\\n\\u0001é\"");
    }

    #[test]
    fn percent_encoding() {
        assert_eq!(
            percent_encode("app{env=prod,x=a b}"),
            "app%7Benv%3Dprod%2Cx%3Da%20b%7D"
        );
    }

    #[test]
    fn status_parsing() {
        assert_eq!(
            parse_status(b"HTTP/1.1 202 Accepted\r\nA: b\r\n\r\nhi"),
            Some((202, 31))
        );
        assert_eq!(parse_status(b"HTTP/1.1 202 Acc"), None);
        assert_eq!(parse_status(b"garbage\r\n\r\n"), None);
        assert!(response_complete(
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        ));
        assert!(!response_complete(
            b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nok"
        ));
    }

    #[test]
    fn multipart_layout() {
        let body = Multipart::new()
            .file("event", "event.json", "application/json", b"{}".to_vec())
            .file("p", "p.bin", "application/octet-stream", vec![0, 1, 2])
            .finish();
        let boundary = body
            .content_type
            .strip_prefix("multipart/form-data; boundary=")
            .unwrap();
        let text = String::from_utf8_lossy(&body.bytes);
        assert!(text.starts_with(&format!("--{boundary}\r\n")));
        assert!(text.ends_with(&format!("--{boundary}--\r\n")));
        assert!(text.contains("name=\"event\"; filename=\"event.json\"\r\nContent-Type: application/json\r\n\r\n{}\r\n"));
    }
}

/// A credential (API key, password, token). Its `Debug` never shows the value, so it cannot
/// leak through a log line or an error message by accident.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps a credential.
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }

    /// The value, for building a request header.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// Whether the credential is empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// Parses a boolean environment value: 1/true/yes/on and 0/false/no/off (any case).
pub fn parse_bool(key: &str, value: &str) -> Result<bool, ExportError> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "" | "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(ExportError::Config(format!(
            "{key}={value:?} is not a boolean (use true or false)"
        ))),
    }
}

/// Splits `k:v,k2:v2` (Datadog) or `k=v,k2=v2` (Pyroscope) tag lists; commas or spaces separate.
pub fn parse_tags(list: &str, sep: char) -> Vec<(String, String)> {
    list.split([',', ' '])
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| match t.split_once(sep) {
            Some((k, v)) => (k.trim().to_owned(), v.trim().to_owned()),
            None => (t.to_owned(), String::new()),
        })
        .filter(|(k, _)| !k.is_empty())
        .collect()
}
