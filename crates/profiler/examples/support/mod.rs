//! What the service examples and the service tests share: the calling thread's CPU clock (the
//! truth a route's CPU share is checked against) and a keep-alive HTTP/1.1 client.
//! Not an example of its own (no `main.rs`); `tests/service_spans.rs` includes it by path.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};

/// The calling thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`) in nanoseconds.
pub fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out pointer.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(r, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// One keep-alive connection sending GET requests one at a time, as a browser tab would.
pub struct KeepAlive {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    line: String,
}

impl KeepAlive {
    pub fn connect(addr: SocketAddr) -> Self {
        let stream = TcpStream::connect(addr).expect("connect");
        stream.set_nodelay(true).expect("nodelay");
        KeepAlive {
            reader: BufReader::new(stream.try_clone().expect("clone")),
            writer: stream,
            line: String::new(),
        }
    }

    /// GETs `path`; the status line and the body (its length from `content-length`).
    pub fn get(&mut self, path: &str) -> (String, Vec<u8>) {
        write!(self.writer, "GET {path} HTTP/1.1\r\nHost: t\r\n\r\n").expect("send");
        let mut status = String::new();
        self.reader.read_line(&mut status).expect("status line");
        let mut len = 0usize;
        loop {
            self.line.clear();
            self.reader.read_line(&mut self.line).expect("header");
            if self.line == "\r\n" || self.line.is_empty() {
                break;
            }
            if let Some((k, v)) = self.line.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    len = v.trim().parse().expect("content-length");
                }
            }
        }
        let mut body = vec![0; len];
        self.reader.read_exact(&mut body).expect("body");
        (status, body)
    }
}
