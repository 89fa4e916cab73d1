//! Each profile says what it is: its `default_sample_type` and its `period_type`/`period`, for
//! the periodic file and every /debug/pprof endpoint; the allocations download carries
//! allocation types only, the heap download the heap types plus the allocation types. Read with
//! the independent decoder and with `go tool pprof` (`-raw` prints the period, `-top` the type
//! it shows by default).

mod profiler_support;

use std::alloc::System;
use std::hint::black_box;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferroprof::{Profiler, Profiles, SamplingAllocator};
use ferroprof_pprof::Profile;
use profiler_support::*;

#[global_allocator]
static GLOBAL: SamplingAllocator<System> = SamplingAllocator::new(System);

/// The profiler is process-wide: one test at a time.
static LOCK: Mutex<()> = Mutex::new(());

const HZ: u32 = 250;
const INTERVAL: u64 = 64 * 1024;
const LIVE_BYTES: usize = 16 << 20;

/// (default sample type, period type and unit, period) as written.
fn meta(p: &Profile) -> (String, Option<(String, String)>, i64) {
    let period_type = p
        .period_type
        .as_ref()
        .map(|v| (p.str(v.r#type).to_owned(), p.str(v.unit).to_owned()));
    (
        p.str(p.default_sample_type).to_owned(),
        period_type,
        p.period,
    )
}

fn type_names(p: &Profile) -> Vec<String> {
    p.sample_types().into_iter().map(|(t, _)| t).collect()
}

fn pair(t: &str, u: &str) -> Option<(String, String)> {
    Some((t.to_owned(), u.to_owned()))
}

/// GET `target`, the body of a 200 answer.
fn get(addr: SocketAddr, target: &str) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(s, "GET {target} HTTP/1.1\r\nHost: test\r\n\r\n").unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("head end");
    let head = String::from_utf8_lossy(&raw[..split]);
    assert!(head.starts_with("HTTP/1.1 200"), "{target}: {head}");
    raw[split + 4..].to_vec()
}

/// The pprof files of `dir`.
fn pprof_files(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "pprof"))
        .collect()
}

/// `go tool pprof` agrees on the period (`-raw`) and the type shown by default (`-top`).
fn go_agrees(go: &Path, file: &Path, default: &str, period_type: &str, period: i64) {
    let f = file.to_str().unwrap();
    let raw = ferroprof_pprof::go_tool::pprof_for_tests(go, &["-raw", f]);
    assert!(
        raw.lines()
            .any(|l| l.trim() == format!("PeriodType: {period_type}")),
        "{f}: no `PeriodType: {period_type}` in go tool pprof -raw:\n{raw}"
    );
    assert!(
        raw.lines().any(|l| l.trim() == format!("Period: {period}")),
        "{f}: no `Period: {period}` in go tool pprof -raw:\n{raw}"
    );
    let top = ferroprof_pprof::go_tool::pprof_for_tests(go, &["-top", f]);
    assert!(
        top.lines().any(|l| l.trim() == format!("Type: {default}")),
        "{f}: go tool pprof -top does not show {default} by default:\n{top}"
    );
}

#[inline(never)]
fn keep_live_for_metadata() -> Vec<Vec<u8>> {
    (0..LIVE_BYTES / 4096)
        .map(|i| black_box(vec![i as u8; 4096]))
        .collect()
}

/// Allocates and frees 8 KiB blocks until told to stop: allocated, never live.
#[inline(never)]
fn churn_for_metadata(stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        for _ in 0..64 {
            black_box(vec![1u8; 8192]);
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[inline(never)]
fn burn_for_metadata(stop: &AtomicBool) -> u64 {
    let mut x = black_box(0x2545_f491_4f6c_dd1du64);
    while !stop.load(Ordering::Relaxed) {
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
        }
    }
    black_box(x)
}

#[test]
fn every_endpoint_and_the_periodic_file_say_what_they_are() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let go = ferroprof_pprof::go_tool::go_for_tests();
    let dir = temp_dir("metadata-all");
    let guard = Profiler::builder()
        .service("metadata-test")
        .profiles(Profiles::all())
        .cpu_hz(HZ)
        .alloc_interval_bytes(INTERVAL)
        .period(Duration::from_secs(3600))
        .output_dir(&dir)
        .start()
        .expect("profiler starts");
    assert!(guard.allocator_installed());
    let server = ferroprof::http::serve("127.0.0.1:0", guard.profile_source()).unwrap();
    let addr = server.addr();

    let live = keep_live_for_metadata();
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = [churn_for_metadata as fn(&AtomicBool), |s: &AtomicBool| {
        burn_for_metadata(s);
    }]
    .into_iter()
    .map(|f| {
        let stop = stop.clone();
        std::thread::spawn(move || f(&stop))
    })
    .collect();

    let cpu_bytes = get(addr, "/debug/pprof/profile?seconds=1");
    let allocs_bytes = get(addr, "/debug/pprof/allocs?seconds=1");
    let heap_bytes = get(addr, "/debug/pprof/heap");
    stop.store(true, Ordering::SeqCst);
    for w in workers {
        w.join().unwrap();
    }
    server.stop();

    let cpu_period = 1_000_000_000 / i64::from(HZ);
    let interval = INTERVAL as i64;

    // /debug/pprof/profile: CPU time per CPU period.
    let cpu = ferroprof_pprof::decode(&cpu_bytes).unwrap();
    assert_eq!(
        meta(&cpu),
        (
            "cpu-time".to_owned(),
            pair("cpu-time", "nanoseconds"),
            cpu_period
        )
    );
    assert!(type_names(&cpu).iter().all(|t| !t.starts_with("alloc")));
    assert!(sum_where(&cpu, "cpu-time", |p, s| has_fn(p, s, "burn_for_metadata")) > 0);

    // /debug/pprof/allocs: allocation types only (no all-zero cpu/wall columns).
    let allocs = ferroprof_pprof::decode(&allocs_bytes).unwrap();
    assert_eq!(
        type_names(&allocs),
        ["alloc-samples", "alloc-samples-unscaled", "alloc-space"]
    );
    assert_eq!(
        meta(&allocs),
        (
            "alloc-space".to_owned(),
            pair("alloc-space", "bytes"),
            interval
        )
    );
    assert!(
        sum_where(&allocs, "alloc-space", |p, s| has_fn(
            p,
            s,
            "churn_for_metadata"
        )) > 0
    );

    // /debug/pprof/heap: the live heap, and what was allocated since the start.
    let heap = ferroprof_pprof::decode(&heap_bytes).unwrap();
    let mut got = type_names(&heap);
    got.sort();
    assert_eq!(
        got,
        [
            "alloc-samples",
            "alloc-samples-unscaled",
            "alloc-space",
            "heap-live-samples",
            "heap-live-size"
        ]
    );
    assert_eq!(
        meta(&heap),
        (
            "heap-live-size".to_owned(),
            pair("alloc-space", "bytes"),
            interval
        )
    );
    let at = |p: &Profile, ty: &str, f: &str| sum_where(p, ty, |p, s| has_fn(p, s, f)) as f64;
    let truth = LIVE_BYTES as f64;
    // 256 expected samples: 30% is over 4 sigma.
    for ty in ["heap-live-size", "alloc-space"] {
        let v = at(&heap, ty, "keep_live_for_metadata");
        assert!((v / truth - 1.0).abs() < 0.3, "{ty} of the live set: {v}");
    }
    // Churn allocated a lot and keeps nothing: in the allocation columns only.
    assert!(at(&heap, "alloc-space", "churn_for_metadata") > 0.0);
    assert!(at(&heap, "heap-live-size", "churn_for_metadata") < 0.05 * truth);

    drop(live);
    guard.stop().unwrap();

    // The periodic file: everything in one, CPU time first.
    let files = pprof_files(&dir);
    assert_eq!(files.len(), 1, "{files:?}");
    let periodic = ferroprof_pprof::decode(&std::fs::read(&files[0]).unwrap()).unwrap();
    assert_eq!(
        meta(&periodic),
        (
            "cpu-time".to_owned(),
            pair("cpu-time", "nanoseconds"),
            cpu_period
        )
    );
    let names = type_names(&periodic);
    for t in [
        "cpu-time",
        "cpu-samples",
        "wall-time",
        "alloc-samples",
        "heap-live-size",
        "alloc-space",
    ] {
        assert!(names.iter().any(|n| n == t), "{t} not in {names:?}");
    }
    assert!(
        sum_where(&periodic, "alloc-space", |p, s| has_fn(
            p,
            s,
            "churn_for_metadata"
        )) > 0
    );

    if let Some(go) = go {
        let write = |name: &str, bytes: &[u8]| {
            let f = dir.join(name);
            std::fs::write(&f, bytes).unwrap();
            f
        };
        let cpu_file = write("cpu.pb.gz", &cpu_bytes);
        let allocs_file = write("allocs.pb.gz", &allocs_bytes);
        let heap_file = write("heap.pb.gz", &heap_bytes);
        go_agrees(
            &go,
            &cpu_file,
            "cpu-time",
            "cpu-time nanoseconds",
            cpu_period,
        );
        go_agrees(
            &go,
            &allocs_file,
            "alloc-space",
            "alloc-space bytes",
            interval,
        );
        go_agrees(
            &go,
            &heap_file,
            "heap-live-size",
            "alloc-space bytes",
            interval,
        );
        go_agrees(
            &go,
            &files[0],
            "cpu-time",
            "cpu-time nanoseconds",
            cpu_period,
        );
        // go's view of the allocations download: allocation columns only.
        let raw = ferroprof_pprof::go_tool::pprof_for_tests(
            &go,
            &["-raw", allocs_file.to_str().unwrap()],
        );
        let header = raw
            .lines()
            .skip_while(|l| !l.starts_with("Samples:"))
            .nth(1)
            .unwrap_or_default()
            .to_owned();
        assert!(
            header.contains("alloc-space/bytes")
                && !header.contains("cpu-samples")
                && !header.contains("wall-time"),
            "{header}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The periodic profile's default type and period follow what is profiled.
#[test]
fn the_periodic_default_follows_the_profiles() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let cpu_period = 1_000_000_000 / i64::from(HZ);
    let interval = INTERVAL as i64;
    let only = |cpu, wall, alloc, heap| Profiles {
        cpu,
        wall,
        alloc,
        heap,
    };
    let cases = [
        (
            only(false, true, false, false),
            "wall-time",
            pair("wall-time", "nanoseconds"),
            cpu_period,
        ),
        (
            only(false, false, true, true),
            "alloc-space",
            pair("alloc-space", "bytes"),
            interval,
        ),
        (
            only(false, false, false, true),
            "heap-live-size",
            pair("alloc-space", "bytes"),
            interval,
        ),
    ];
    for (i, (profiles, default, period_type, period)) in cases.into_iter().enumerate() {
        let dir = temp_dir(&format!("metadata-periodic-{i}"));
        let guard = Profiler::builder()
            .service("metadata-test")
            .profiles(profiles)
            .cpu_hz(HZ)
            .alloc_interval_bytes(INTERVAL)
            .period(Duration::from_secs(3600))
            .output_dir(&dir)
            .start()
            .expect("profiler starts");
        black_box(keep_live_for_metadata());
        guard.stop().unwrap();
        let files = pprof_files(&dir);
        assert_eq!(files.len(), 1, "{files:?}");
        let p = ferroprof_pprof::decode(&std::fs::read(&files[0]).unwrap()).unwrap();
        assert_eq!(
            meta(&p),
            (default.to_owned(), period_type, period),
            "{profiles:?}"
        );
        let names = type_names(&p);
        assert_eq!(
            names.iter().any(|n| n == "alloc-space"),
            profiles.alloc,
            "{profiles:?}: {names:?}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
