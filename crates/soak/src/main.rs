//! `ferroprof-soak`: a small axum service that loads itself, for measuring what ferroprof costs
//! over many export periods (memory and export CPU). It prints one line per period and a summary;
//! `scripts/soak.sh` runs it with and without the profiler and compares.
//!
//! ```text
//! ferroprof-soak [--profiler on|off] [--periods N] [--period-ms MS] [--heap-mb MB] [--out DIR]
//! ```
//! Build with `--features jemalloc` for jemalloc as the inner allocator.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Query, State};
use axum::routing::get;
use axum::{Json, Router};
use serde::{Deserialize, Serialize};

#[cfg(feature = "jemalloc")]
#[global_allocator]
static ALLOC: ferroprof::SamplingAllocator<tikv_jemallocator::Jemalloc> =
    ferroprof::SamplingAllocator::new(tikv_jemallocator::Jemalloc);

#[cfg(not(feature = "jemalloc"))]
#[global_allocator]
static ALLOC: ferroprof::SamplingAllocator<std::alloc::System> =
    ferroprof::SamplingAllocator::new(std::alloc::System);

struct Args {
    profiler: bool,
    periods: u32,
    period: Duration,
    heap_mb: usize,
    out: Option<String>,
}

fn usage(msg: &str) -> ! {
    eprintln!("ferroprof-soak: {msg}");
    eprintln!(
        "usage: ferroprof-soak [--profiler on|off] [--periods N] [--period-ms MS] [--heap-mb MB] [--out DIR]"
    );
    std::process::exit(2);
}

fn parse_args() -> Args {
    let mut a = Args {
        profiler: true,
        periods: 20,
        period: Duration::from_secs(1),
        heap_mb: 60,
        out: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .unwrap_or_else(|| usage(&format!("{flag} needs a value")))
        };
        match flag.as_str() {
            "--profiler" => {
                a.profiler = match value().as_str() {
                    "on" => true,
                    "off" => false,
                    v => usage(&format!("--profiler takes on or off, not {v:?}")),
                }
            }
            "--periods" => {
                let v = value();
                a.periods = v
                    .parse()
                    .unwrap_or_else(|_| usage(&format!("bad --periods {v:?}")));
            }
            "--period-ms" => {
                let v = value();
                let ms: u64 = v
                    .parse()
                    .unwrap_or_else(|_| usage(&format!("bad --period-ms {v:?}")));
                a.period = Duration::from_millis(ms);
            }
            "--heap-mb" => {
                let v = value();
                a.heap_mb = v
                    .parse()
                    .unwrap_or_else(|_| usage(&format!("bad --heap-mb {v:?}")));
            }
            "--out" => a.out = Some(value()),
            other => usage(&format!("unknown argument {other:?}")),
        }
    }
    a
}

/// The service's state: a cache of buffers that stays at about `heap_mb` (the live heap of a
/// service), entries replaced as requests come.
struct App {
    cache: Mutex<Vec<Vec<u8>>>,
    requests: AtomicU64,
}

#[derive(Deserialize)]
struct Params {
    n: Option<u64>,
}

#[derive(Serialize)]
struct Item {
    id: u64,
    name: String,
    tags: Vec<String>,
    score: f64,
}

#[inline(never)]
fn build_items(n: u64) -> Vec<Item> {
    (0..n)
        .map(|i| Item {
            id: i,
            name: format!("item-{i}"),
            tags: (0..(i % 5)).map(|t| format!("tag{t}")).collect(),
            score: (i as f64).sqrt(),
        })
        .collect()
}

async fn items(State(app): State<Arc<App>>, Query(p): Query<Params>) -> Json<Vec<Item>> {
    app.requests.fetch_add(1, Ordering::Relaxed);
    Json(build_items(p.n.unwrap_or(50).min(10_000)))
}

#[inline(never)]
fn checksum(rounds: u64) -> u64 {
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for i in 0..rounds * 10_000 {
        x = std::hint::black_box(x.rotate_left(5) ^ i).wrapping_mul(0x2545_F491_4F6C_DD1D);
    }
    x
}

async fn compute(State(app): State<Arc<App>>, Query(p): Query<Params>) -> String {
    app.requests.fetch_add(1, Ordering::Relaxed);
    format!("{}\n", checksum(p.n.unwrap_or(20).min(1000)))
}

async fn cache(State(app): State<Arc<App>>, Query(p): Query<Params>) -> String {
    let n = app.requests.fetch_add(1, Ordering::Relaxed);
    // Fixed-size buffers: varying sizes across glibc's mmap threshold made the baseline's RSS
    // wander by tens of MB from run to run.
    let size = 64 * 1024 + (p.n.unwrap_or(0) % 8) as usize * 1024;
    let buf = vec![(n & 0xff) as u8; size];
    let mut c = app.cache.lock().unwrap();
    let len = c.len();
    let slot = (n as usize).wrapping_mul(2654435761) % len.max(1);
    if len > 0 {
        c[slot] = buf;
    }
    format!("{}\n", c.len())
}

/// One keep-alive HTTP/1.1 client: GETs `paths` in turn until `stop`.
fn client(addr: SocketAddr, paths: Vec<String>, stop: Arc<AtomicBool>) {
    let mut buf = vec![0u8; 1 << 16];
    let mut k = 0usize;
    'connect: while !stop.load(Ordering::Relaxed) {
        let Ok(mut s) = std::net::TcpStream::connect(addr) else {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
        while !stop.load(Ordering::Relaxed) {
            let path = &paths[k % paths.len()];
            k += 1;
            let req = format!("GET {path} HTTP/1.1\r\nHost: soak\r\n\r\n");
            if s.write_all(req.as_bytes()).is_err() {
                continue 'connect;
            }
            // Read the head, then the body by Content-Length.
            let mut have = 0usize;
            let body_len;
            let head_end;
            loop {
                match s.read(&mut buf[have..]) {
                    Ok(0) | Err(_) => continue 'connect,
                    Ok(n) => have += n,
                }
                if let Some(i) = buf[..have].windows(4).position(|w| w == b"\r\n\r\n") {
                    head_end = i + 4;
                    let head = String::from_utf8_lossy(&buf[..i]).to_ascii_lowercase();
                    body_len = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse::<usize>().ok())
                        .unwrap_or(0);
                    break;
                }
                if have == buf.len() {
                    continue 'connect;
                }
            }
            let mut rest = (head_end + body_len).saturating_sub(have);
            while rest > 0 {
                let n = buf.len().min(rest);
                match s.read(&mut buf[..n]) {
                    Ok(0) | Err(_) => continue 'connect,
                    Ok(m) => rest -= m,
                }
            }
        }
    }
}

/// Resident anonymous and file-backed bytes (`RssAnon`, `RssFile` of /proc/self/status): mapped
/// debug info counts as file, the profiler's and the allocator's memory as anonymous.
fn rss_split() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        s.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    (field("RssAnon:"), field("RssFile:"))
}

/// Bytes the C allocator has handed out and not got back (glibc's `mallinfo2`; 0 elsewhere):
/// against RSS, it tells live memory from memory the allocator keeps.
#[cfg(all(target_os = "linux", target_env = "gnu", not(feature = "jemalloc")))]
fn malloc_in_use() -> u64 {
    // SAFETY: mallinfo2 only reads the allocator's counters.
    let mi = unsafe { libc::mallinfo2() };
    (mi.uordblks + mi.hblkhd) as u64
}

#[cfg(not(all(target_os = "linux", target_env = "gnu", not(feature = "jemalloc"))))]
fn malloc_in_use() -> u64 {
    0
}

fn rss_bytes() -> u64 {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = s
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64
}

/// CPU time of the thread named `name` (ns), through its CPU clock.
fn thread_cpu_ns_by_name(name: &str) -> Option<u64> {
    for e in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let comm = std::fs::read_to_string(e.path().join("comm")).unwrap_or_default();
        // The kernel keeps 15 bytes of a thread's name.
        if comm.trim_end() != &name[..name.len().min(15)] {
            continue;
        }
        let tid: i32 = e.file_name().to_str()?.parse().ok()?;
        let clock = ((!(tid as libc::clockid_t)) << 3) | 6;
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: valid out-pointer; a thread CPU clock id of this process.
        if unsafe { libc::clock_gettime(clock, &mut ts) } == 0 {
            return Some(ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64);
        }
    }
    None
}

fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let args = parse_args();
    let before_start = rss_split();
    let guard = if args.profiler {
        // FERROPROF_* variables (e.g. FERROPROF_PROFILES) apply on top.
        let mut b = ferroprof::Profiler::builder()
            .service("ferroprof-soak")
            .period(args.period)
            .from_env();
        if let Some(dir) = &args.out {
            b = b.output_dir(dir);
        }
        match b.start() {
            Ok(g) => Some(g),
            Err(e) => {
                eprintln!("ferroprof-soak: the profiler did not start: {e}");
                std::process::exit(1);
            }
        }
    } else {
        None
    };
    if guard.is_some() {
        let (anon, file) = rss_split();
        println!(
            "start: anon +{:.1} MB, file +{:.1} MB",
            (anon as f64 - before_start.0 as f64) / 1048576.0,
            (file as f64 - before_start.1 as f64) / 1048576.0
        );
    }
    let app = Arc::new(App {
        cache: Mutex::new(
            (0..args.heap_mb * 16)
                .map(|_| vec![1u8; 64 * 1024])
                .collect(),
        ),
        requests: AtomicU64::new(0),
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .expect("bind 127.0.0.1");
    let addr = listener.local_addr().expect("local address");
    let router = Router::new()
        .route("/items", get(items))
        .route("/compute", get(compute))
        .route("/cache", get(cache))
        .with_state(app.clone());
    rt.spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..3)
        .map(|i| {
            let stop = stop.clone();
            let paths = match i {
                0 => vec!["/items?n=200".into(), "/items?n=20".into()],
                1 => vec!["/compute?n=30".into(), "/items?n=1000".into()],
                _ => (0..8).map(|k| format!("/cache?n={k}")).collect(),
            };
            std::thread::spawn(move || client(addr, paths, stop))
        })
        .collect();
    // RSS every 5 ms: the peak of each period (an export's transient memory) and its end.
    let peak = Arc::new(AtomicU64::new(0));
    let peak_anon = Arc::new(AtomicU64::new(0));
    let peak_file = Arc::new(AtomicU64::new(0));
    let monitor = {
        let (peak, peak_anon, peak_file, stop) = (
            peak.clone(),
            peak_anon.clone(),
            peak_file.clone(),
            stop.clone(),
        );
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(rss_bytes(), Ordering::Relaxed);
                let (anon, file) = rss_split();
                peak_anon.fetch_max(anon, Ordering::Relaxed);
                peak_file.fetch_max(file, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    println!(
        "period  rss_mb  peak_mb  anon_pk  file_pk  export_cpu_ms  requests  symbolized  arena_mb  cached  in_use_mb"
    );
    let mut last_symbolized = 0u64;
    let start = Instant::now();
    let mut rss = Vec::new();
    let mut in_use = Vec::new();
    let mut peaks = Vec::new();
    let mut export_ms = Vec::new();
    let mut last_cpu = 0u64;
    for p in 1..=args.periods {
        let due = start + args.period * p;
        std::thread::sleep(due.saturating_duration_since(Instant::now()));
        // Half a period later than the export (which runs at each period's end): its effects
        // on RSS are in, and the next has not begun.
        std::thread::sleep(args.period / 2);
        let r = rss_bytes() as f64 / 1048576.0;
        let pk = peak.swap(0, Ordering::Relaxed) as f64 / 1048576.0;
        let anon_pk = peak_anon.swap(0, Ordering::Relaxed) as f64 / 1048576.0;
        let file_pk = peak_file.swap(0, Ordering::Relaxed) as f64 / 1048576.0;
        let cpu = thread_cpu_ns_by_name("ferroprof-export").unwrap_or(0);
        let ms = cpu.saturating_sub(last_cpu) as f64 / 1e6;
        last_cpu = cpu;
        let (symbolized, arena_mb, cached) = match &guard {
            Some(g) => {
                let st = g.stats();
                let new = st.symbolized_addresses - last_symbolized;
                last_symbolized = st.symbolized_addresses;
                (
                    new,
                    st.symbolizer_arena_bytes as f64 / 1048576.0,
                    st.symbolizer_cached_addresses,
                )
            }
            None => (0, 0.0, 0),
        };
        let used = malloc_in_use() as f64 / 1048576.0;
        println!(
            "{p:>6}  {r:>6.1}  {pk:>7.1}  {anon_pk:>7.1}  {file_pk:>7.1}  {ms:>13.1}  {:>8}  {symbolized:>10}  {arena_mb:>8.1}  {cached:>6}  {used:>9.1}",
            app.requests.load(Ordering::Relaxed)
        );
        rss.push(r);
        in_use.push(used);
        peaks.push(pk);
        export_ms.push(ms);
    }
    if std::env::var_os("FERROPROF_SOAK_MALLOC_INFO").is_some() {
        // glibc's per-arena XML (free and system bytes per arena) on stderr, while running.
        #[cfg(all(target_env = "gnu", not(feature = "jemalloc")))]
        {
            extern "C" {
                fn malloc_info(options: libc::c_int, stream: *mut libc::FILE) -> libc::c_int;
            }
            // SAFETY: fdopen on a duplicate of stderr gives a valid stream for malloc_info.
            unsafe {
                let f = libc::fdopen(libc::dup(2), c"w".as_ptr());
                if !f.is_null() {
                    malloc_info(0, f);
                    libc::fclose(f);
                }
            }
        }
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        let _ = c.join();
    }
    let _ = monitor.join();
    if let Some(g) = &guard {
        let st = g.stats();
        println!(
            "kept: symbolizer {:.1} MB ({} addresses), last profile's tables {:.1} MB, {} live-heap records, private blocks {:.1} MB",
            st.symbolizer_bytes as f64 / 1048576.0,
            st.symbolizer_cached_addresses,
            st.last_profile_bytes as f64 / 1048576.0,
            st.heap_tracked_objects,
            st.private_heap_bytes as f64 / 1048576.0
        );
    }
    let t = Instant::now();
    if let Some(g) = guard {
        if let Err(e) = g.stop() {
            eprintln!("ferroprof-soak: stop: {e}");
        }
    }
    let stop_ms = t.elapsed().as_secs_f64() * 1e3;
    if std::env::var_os("FERROPROF_SOAK_MALLOC_STATS").is_some() {
        // glibc's per-arena totals (system bytes vs in use) on stderr: where kept memory is.
        extern "C" {
            fn malloc_stats();
        }
        // SAFETY: glibc's malloc_stats only reads the allocator's state and writes to stderr.
        unsafe { malloc_stats() };
    }
    let half = rss.len() / 2;
    let first_export = export_ms.first().copied().unwrap_or(0.0);
    let steady_rss = median(&mut rss[half..].to_vec());
    let steady_in_use = median(&mut in_use[half..].to_vec());
    let max_rss = rss.iter().copied().fold(0.0, f64::max);
    let max_peak = peaks.iter().copied().fold(0.0, f64::max);
    let steady_export = median(&mut export_ms[1..].to_vec());
    println!(
        "summary: profiler={} periods={} rss_median_second_half_mb={steady_rss:.1} malloc_in_use_median_second_half_mb={steady_in_use:.1} rss_max_mb={max_rss:.1} peak_max_mb={max_peak:.1} export_cpu_first_ms={first_export:.1} export_cpu_median_ms={steady_export:.1} stop_ms={stop_ms:.0}",
        if args.profiler { "on" } else { "off" },
        args.periods,
    );
}
