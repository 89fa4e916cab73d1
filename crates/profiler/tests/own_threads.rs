//! What the sampler leaves alone: ferroprof's own threads (sampler, exporters, the
//! /debug/pprof server and the thread that waits out an on-demand capture) never appear in a
//! profile, and when another library takes over the sampling signal, the profiler stops sending
//! it (warned and counted) instead of feeding a handler that does not expect it.

mod profiler_support;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferroprof::Profiler;
use profiler_support::*;

/// One profiler per process: the tests of this file take turns.
static LOCK: Mutex<()> = Mutex::new(());

#[inline(never)]
fn spin_until(stop: &AtomicBool) -> u64 {
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    while !stop.load(Ordering::Relaxed) {
        for i in 0..10_000u64 {
            x = std::hint::black_box(x.rotate_left(7).wrapping_mul(0x2545_F491_4F6C_DD1D) ^ i);
        }
    }
    x
}

fn http_get(addr: std::net::SocketAddr, target: &str) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(s, "GET {target} HTTP/1.1\r\nHost: t\r\n\r\n").unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("head end");
    assert!(raw.starts_with(b"HTTP/1.1 200"), "{:?}", &raw[..split]);
    raw[split + 4..].to_vec()
}

/// Thread names of the samples with some wall or CPU time.
fn thread_names(p: &ferroprof_pprof::Profile) -> Vec<String> {
    let mut names: Vec<String> = p
        .sample
        .iter()
        .filter(|s| s.value.iter().any(|&v| v != 0))
        .filter_map(|s| p.label_str(s, "thread name").map(str::to_owned))
        .collect();
    names.sort();
    names.dedup();
    names
}

#[test]
fn own_threads_are_never_sampled() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let c = Collect::default();
    let guard = start_cpu_wall("own-threads-test", 250, &c);
    let server = ferroprof::http::serve("127.0.0.1:0", guard.profile_source()).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let burner = {
        let stop = stop.clone();
        std::thread::Builder::new()
            .name("app-burner".into())
            .spawn(move || spin_until(&stop))
            .unwrap()
    };
    // A capture served over HTTP: the server's threads wait and read meanwhile.
    let body = http_get(server.addr(), "/debug/pprof/profile?seconds=2");
    let captured = ferroprof_pprof::decode(&body).expect("served profile decodes");
    // A flush while the capture ran: the export and delivery threads worked too.
    guard.flush().expect("flush");
    stop.store(true, Ordering::Relaxed);
    burner.join().unwrap();
    server.stop();
    guard.stop().unwrap();
    let mut names = thread_names(&captured);
    for p in c.decoded() {
        names.extend(thread_names(&p));
    }
    names.sort();
    names.dedup();
    println!("threads in the profiles: {names:?}");
    assert!(
        names.iter().any(|n| n == "app-burner"),
        "the application's thread is sampled: {names:?}"
    );
    let ours: Vec<&String> = names
        .iter()
        .filter(|n| n.starts_with("ferroprof-"))
        .collect();
    assert!(ours.is_empty(), "ferroprof threads sampled: {ours:?}");
}

static FOREIGN_CALLS: AtomicU64 = AtomicU64::new(0);

extern "C" fn foreign_handler(_sig: libc::c_int) {
    FOREIGN_CALLS.fetch_add(1, Ordering::Relaxed);
}

#[test]
fn a_replaced_signal_handler_stops_our_signals_and_is_counted() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let guard = Profiler::builder()
        .service("replaced-handler-test")
        .cpu_hz(1000)
        .profiles(cpu_wall())
        .period(Duration::from_secs(600))
        .output_dir(temp_dir("replaced-handler"))
        .start()
        .expect("profiler starts");
    let sig = guard.stats().signal;
    assert!(
        (libc::SIGRTMIN()..=libc::SIGRTMAX()).contains(&sig),
        "a real-time signal by default, got {sig}"
    );
    let stop = Arc::new(AtomicBool::new(false));
    let burner = {
        let stop = stop.clone();
        std::thread::spawn(move || spin_until(&stop))
    };
    std::thread::sleep(Duration::from_millis(300));
    assert!(guard.stats().cpu_timer_samples > 0, "sampling before");
    // Another library takes the signal over.
    // SAFETY: installs a plain handler that only bumps an atomic.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = foreign_handler as *const () as usize;
        libc::sigemptyset(&mut sa.sa_mask);
        assert_eq!(libc::sigaction(sig, &sa, std::ptr::null_mut()), 0);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while guard.stats().signal_handler_replaced == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(guard.stats().signal_handler_replaced, 1, "noticed");
    // Signals raised before the sampler noticed may still arrive; then none.
    std::thread::sleep(Duration::from_millis(50));
    let before = FOREIGN_CALLS.load(Ordering::Relaxed);
    std::thread::sleep(Duration::from_millis(500));
    let after = FOREIGN_CALLS.load(Ordering::Relaxed);
    stop.store(true, Ordering::Relaxed);
    burner.join().unwrap();
    let stats = guard.stats();
    guard.stop().unwrap();
    println!("foreign handler calls: {before} until noticed, {after} in all; {stats:?}");
    assert_eq!(
        after, before,
        "our signals kept coming to the foreign handler"
    );
    // SAFETY: back to the default disposition (nothing raises the signal any more).
    unsafe { libc::signal(sig, libc::SIG_DFL) };
}

/// A thread of ours that the listing finds before it ran its first lines (where it registers):
/// here it waits 400 ms before registering, as if the scheduler had not run it. Its wall time
/// was recorded before the registration was seen (the visits book an idle thread's wall every
/// 100 ms); nothing of it may be in the profile.
#[test]
fn a_thread_of_ours_found_before_it_registered_leaves_nothing() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let c = Collect::default();
    let guard = start_cpu_wall("late-own-thread", 100, &c);
    std::thread::sleep(Duration::from_millis(50));
    // It starts slowly (2 ms of CPU before its first line of its own, ten times the CPU
    // probation), then waits before it registers.
    let late = ferroprof::internals::__late_own_thread(
        "ferroprof-late",
        Duration::from_millis(2),
        Duration::from_millis(400),
        Duration::from_millis(200),
    );
    late.join().unwrap();
    guard.stop().unwrap();
    let mut names: Vec<String> = c.decoded().iter().flat_map(thread_names).collect();
    names.sort();
    names.dedup();
    println!("threads in the profiles: {names:?}");
    assert!(
        !names.iter().any(|n| n == "ferroprof-late"),
        "a ferroprof thread was sampled before it registered: {names:?}"
    );
}

#[inline(never)]
fn app_sleeps(d: Duration) {
    std::thread::sleep(d);
    std::hint::black_box(d);
}

/// `stop` returns without waiting out the sampler's sleep between ticks, and the thread that
/// stops the profiler is left alone while it does: its time there (joining the profiler's
/// threads, writing the last profile) is the profiler's, not the application's.
#[test]
fn stopping_is_quick_and_never_in_the_profile() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let c = Collect::default();
    // 1 Hz: the sampler sleeps up to a second between ticks.
    let guard = start_cpu_wall("stop-test", 1, &c);
    app_sleeps(Duration::from_millis(4000));
    // Symbolizes what there is to name now: `stop` then times its own work, not a first
    // symbolization (hundreds of milliseconds in a debug build).
    guard.flush().expect("flush");
    let t = Instant::now();
    guard.stop().unwrap();
    let took = t.elapsed();
    let ps = c.decoded();
    let wall = |pred: &dyn Fn(&ferroprof_pprof::Profile, &ferroprof_pprof::Sample) -> bool| {
        sum_all(&ps, "wall-time", |p, s| pred(p, s))
    };
    let app = wall(&|p, s| has_fn(p, s, "app_sleeps"));
    let in_stop = wall(&|p, s| has_fn(p, s, "ProfilerGuard::stop"));
    println!("stop took {took:?}; wall in app_sleeps {app} ns, in stop {in_stop} ns");
    assert!(app > 0, "the application's sleep is sampled");
    assert_eq!(in_stop, 0, "the stopping thread was sampled inside stop");
    assert!(took < Duration::from_millis(250), "stop took {took:?}");
}
