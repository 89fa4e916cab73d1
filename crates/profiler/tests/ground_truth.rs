//! Ground truth for the CPU/wall sampler on a busy machine: a workload that measures itself, a
//! profile of it, and a comparison through the independent decoder.
//!
//! The workload, all at once:
//! * CPU-bound threads, 3 per core, alternating a pure computation (no system call at all), a
//!   loop of cheap system calls (`clock_gettime` through the vDSO, `getppid`) and a computation
//!   40 frames deep, calls of about 10 ms; each function's truth is the thread's own CPU clock
//!   around each call;
//! * blocking threads (12): 30 µs of work, then a wait on a mutex its own holder keeps for a
//!   while, a channel its own feeder answers after 5 ms and a sleep; each site's truth is the
//!   wall clock around the wait;
//! * short threads, started and ending during the run (3 s each, computing and sleeping), their
//!   CPU and lifetime measured inside;
//! * a thread that blocks in `poll`, `epoll_wait`, `nanosleep`, a futex wait and a socket read
//!   with timeouts, counting `EINTR`s and early returns.
//!
//! Checked per run: no thread lost (CPU and wall samples cover 99–101% of each thread's truth),
//! every function with ≥ 5% of the CPU threads' CPU at its true share ±3 points, no more than 2
//! points of the pure computation's CPU in system-call or vDSO frames, each blocking site's wall
//! time within ±5% of truth counting only whole stacks (the site, its caller `blocking_thread`
//! and the thread's root), no `EINTR`, no sample of a ferroprof thread.
//!
//! `ground_truth_short` (default run): one run of `FERROPROF_GT_SECS` (6) seconds.
//! `ground_truth_full` (ignored; `scripts/ground_truth.sh` runs it in release): `FERROPROF_GT_RUNS`
//! (20) runs of 20 s, then the worst error per target and each site's error over the runs next
//! to what point sampling alone would give (each site's waits are shorter than a sampling
//! period, so a run's wall time per site is a count of ticks that found a thread there, with a
//! binomial spread). `FERROPROF_GT_HZ` sets the rate (100, the
//! default setting). `foreign_sigprof_user_neither_starves_us_nor_gets_our_signals`: a
//! gperftools-style `SIGPROF` handler with `setitimer` next to the profiler.

mod profiler_support;

use std::collections::HashMap;
use std::io::Read;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use ferroprof_pprof::{Profile, Sample};
use profiler_support::*;

/// One profiler per process: the tests of this file take turns.
static LOCK: Mutex<()> = Mutex::new(());

fn env_or<T: std::str::FromStr>(k: &str, default: T) -> T {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

// ---- the workload's functions (markers: every sample is charged to the innermost one) ----

#[inline(always)]
fn mix(x: u64, i: u64) -> u64 {
    x.rotate_left(7).wrapping_mul(0x2545_F491_4F6C_DD1D) ^ i
}

/// Pure computation: no system call.
#[inline(never)]
fn gt_pure(units: u64) -> u64 {
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ units;
    for i in 0..units * 4_000 {
        x = std::hint::black_box(mix(x, i));
    }
    x
}

/// Cheap system calls in a loop: the vDSO's clock and a real system call now and then.
#[inline(never)]
fn gt_syscalls(units: u64) -> u64 {
    let mut x = 0u64;
    for i in 0..units * 200 {
        x = x.wrapping_add(Instant::now().elapsed().as_nanos() as u64);
        if i % 16 == 0 {
            // SAFETY: no preconditions.
            x = x.wrapping_add(unsafe { libc::getppid() } as u64);
        }
    }
    x
}

/// Computation at the bottom of a 40-frame recursion.
#[inline(never)]
fn gt_deep(depth: u32, units: u64) -> u64 {
    if depth == 0 {
        let mut x = units;
        for i in 0..units * 4_000 {
            x = std::hint::black_box(mix(x, i));
        }
        return x;
    }
    std::hint::black_box(gt_deep(depth - 1, units)).wrapping_add(1)
}

#[inline(never)]
fn gt_block_mutex(m: &Mutex<()>) {
    drop(std::hint::black_box(m.lock()));
    std::hint::black_box(m);
}

/// Asks the feeder for an item and waits for it (the feeder answers after 5 ms).
#[inline(never)]
fn gt_block_channel(req: &mpsc::Sender<()>, rx: &mpsc::Receiver<()>) {
    let _ = req.send(());
    let _ = std::hint::black_box(rx.recv_timeout(Duration::from_millis(200)));
    std::hint::black_box(rx);
}

#[inline(never)]
fn gt_block_sleep() {
    let d = std::hint::black_box(Duration::from_millis(3));
    // A clock read right before the sleep and after: its calls leave return addresses in the
    // stack the sleep's frames then use (a stale caller for a walk that guesses).
    let t0 = Instant::now();
    std::thread::sleep(d);
    // Not a tail call: the frame stays on the stack while it sleeps.
    std::hint::black_box(t0.elapsed());
}

#[inline(never)]
fn gt_short_work(units: u64) -> u64 {
    gt_pure(units)
}

const CPU_FUNCS: [&str; 3] = ["gt_pure", "gt_syscalls", "gt_deep"];
const SITES: [&str; 3] = ["gt_block_mutex", "gt_block_channel", "gt_block_sleep"];

/// What a thread measured of itself.
#[derive(Debug, Clone, Default)]
struct Truth {
    name: String,
    cpu_ns: u64,
    wall_ns: u64,
    /// CPU per function, or wall per blocking site.
    per: HashMap<&'static str, u64>,
}

/// Calibrates work units to about `ms` of CPU per call of `gt_pure` on this build.
fn units_for(ms: f64) -> u64 {
    let t = thread_cpu_ns();
    std::hint::black_box(gt_pure(20));
    let per_unit = (thread_cpu_ns() - t).max(1) as f64 / 20.0;
    ((ms * 1e6 / per_unit) as u64).max(1)
}

fn cpu_thread(name: String, stop: Arc<AtomicBool>, units: u64) -> Truth {
    let start = Instant::now();
    let cpu0 = thread_cpu_ns();
    let mut t = Truth {
        name,
        ..Default::default()
    };
    let mut acc = 0u64;
    // The order and length of the calls are random: a strictly periodic workload (each call
    // the same length, in a fixed cycle) beats against the kernel's tick, at which CPU timers
    // fire (threads are also preempted at ticks, so a thread's CPU advances in tick-sized
    // steps): its samples would all land at the same phases of the cycle.
    let mut rng = 0x2545_F491_4F6C_DD1Du64 ^ (t.name.len() as u64) ^ cpu0;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    while !stop.load(Ordering::Relaxed) {
        let r = next();
        // 2 : 1 : 1 by calls, each 0.5 to 1.5 times its base length.
        let n = units / 2 + r % units.max(1);
        let c0 = thread_cpu_ns();
        let name = match (r >> 32) % 4 {
            0 | 2 => {
                acc ^= gt_pure(n);
                "gt_pure"
            }
            1 => {
                acc ^= gt_syscalls(n);
                "gt_syscalls"
            }
            _ => {
                acc ^= gt_deep(40, n);
                "gt_deep"
            }
        };
        *t.per.entry(name).or_default() += thread_cpu_ns() - c0;
    }
    std::hint::black_box(acc);
    t.cpu_ns = thread_cpu_ns() - cpu0;
    t.wall_ns = start.elapsed().as_nanos() as u64;
    t
}

fn blocking_thread(
    name: String,
    stop: Arc<AtomicBool>,
    m: Arc<Mutex<()>>,
    (req, rx): (mpsc::Sender<()>, mpsc::Receiver<()>),
    work_units: u64,
) -> Truth {
    let start = Instant::now();
    let cpu0 = thread_cpu_ns();
    let mut t = Truth {
        name,
        ..Default::default()
    };
    let mut timed = |site: &'static str, f: &mut dyn FnMut()| {
        let w = Instant::now();
        f();
        *t.per.entry(site).or_default() += w.elapsed().as_nanos() as u64;
    };
    while !stop.load(Ordering::Relaxed) {
        std::hint::black_box(gt_pure(work_units));
        timed("gt_block_mutex", &mut || gt_block_mutex(&m));
        std::hint::black_box(gt_pure(work_units));
        timed("gt_block_channel", &mut || gt_block_channel(&req, &rx));
        std::hint::black_box(gt_pure(work_units));
        timed("gt_block_sleep", &mut || gt_block_sleep());
    }
    t.cpu_ns = thread_cpu_ns() - cpu0;
    t.wall_ns = start.elapsed().as_nanos() as u64;
    t
}

fn short_thread(name: String, units: u64) -> Truth {
    let start = Instant::now();
    let cpu0 = thread_cpu_ns();
    // 3 s: twelve rounds of ~100 ms of work and 150 ms of sleep (it ends asleep, as threads
    // that finish a task and exit do, after their last report).
    for _ in 0..12 {
        let end = thread_cpu_ns() + 100_000_000;
        while thread_cpu_ns() < end {
            std::hint::black_box(gt_short_work(units));
        }
        std::thread::sleep(Duration::from_millis(150));
    }
    Truth {
        name,
        cpu_ns: thread_cpu_ns() - cpu0,
        wall_ns: start.elapsed().as_nanos() as u64,
        per: HashMap::new(),
    }
}

/// Counts of interrupted or early-returning blocking calls, by kind.
#[derive(Debug, Default, Clone)]
struct Eintr {
    calls: u64,
    poll: u64,
    epoll: u64,
    nanosleep: u64,
    futex: u64,
    read: u64,
}

impl Eintr {
    fn total(&self) -> u64 {
        self.poll + self.epoll + self.nanosleep + self.futex + self.read
    }
}

fn eintr_thread(stop: Arc<AtomicBool>, work_units: u64) -> Eintr {
    let mut e = Eintr::default();
    let mut fds = [0; 2];
    // SAFETY: valid out array.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: plain epoll setup on our own pipe.
    let ep = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    let mut ev = libc::epoll_event {
        events: libc::EPOLLIN as u32,
        u64: 0,
    };
    // SAFETY: as above.
    unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fds[0], &mut ev) };
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let _server_side = listener.accept().unwrap();
    client
        .set_read_timeout(Some(Duration::from_millis(2)))
        .unwrap();
    let futex_word = AtomicU64::new(0);
    while !stop.load(Ordering::Relaxed) {
        std::hint::black_box(gt_pure(work_units));
        let mut pfd = libc::pollfd {
            fd: fds[0],
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        if unsafe { libc::poll(&mut pfd, 1, 2) } < 0 {
            e.poll += 1;
        }
        let mut out = [libc::epoll_event { events: 0, u64: 0 }];
        // SAFETY: a valid output array of one event.
        if unsafe { libc::epoll_wait(ep, out.as_mut_ptr(), 1, 2) } < 0 {
            e.epoll += 1;
        }
        if nanosleep_failed(2_000_000) {
            e.nanosleep += 1;
        }
        let timeout = libc::timespec {
            tv_sec: 0,
            tv_nsec: 2_000_000,
        };
        // SAFETY: FUTEX_WAIT on a live word whose value (0) never changes, with a timeout.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_futex,
                futex_word.as_ptr(),
                libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
                0u32,
                &timeout as *const libc::timespec,
            )
        };
        // SAFETY: errno is thread-local.
        if rc != 0 && unsafe { *libc::__errno_location() } == libc::EINTR {
            e.futex += 1;
        }
        let mut b = [0u8; 16];
        if let Err(err) = client.read(&mut b) {
            if err.kind() == std::io::ErrorKind::Interrupted {
                e.read += 1;
            }
        }
        e.calls += 5;
    }
    // SAFETY: our own descriptors.
    unsafe {
        libc::close(ep);
        libc::close(fds[0]);
        libc::close(fds[1]);
    }
    e
}

/// One run's truth and profile.
struct Report {
    truths: Vec<Truth>,
    /// Names of the CPU-bound threads and of the blocking ones.
    cpu_threads: Vec<String>,
    blocking_threads: Vec<String>,
    eintr: Eintr,
    profile: Vec<Profile>,
    hz: u32,
}

fn run_once(secs: f64, hz: u32) -> Report {
    let c = Collect::default();
    let guard = start_cpu_wall("ground-truth", hz, &c);
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    // Calls of about 10 ms: the truth is read from the thread's CPU clock at each call's ends,
    // and that read is a system call that updates the scheduler's accounting, so a thread whose
    // time slice ran out is preempted right there, at a call boundary. With 2 ms calls those
    // preemptions, correlated with the functions, moved CPU-timer samples toward the longer
    // calls by 3 to 8 points (a harness artefact: with the truth counted in work units instead,
    // or with calls of 10 ms or more, the same timers were within 1 point; the kernel checks
    // CPU timers at its tick, and a thread's runs now start and end at those reads).
    let units = units_for(10.0);
    let work_units = units_for(0.03);
    let stop = Arc::new(AtomicBool::new(false));
    let mut handles: Vec<std::thread::JoinHandle<Truth>> = Vec::new();
    let mut cpu_threads = Vec::new();
    for i in 0..env_or("FERROPROF_GT_CPU_THREADS", 3 * cores) {
        let name = format!("gt-cpu-{i}");
        cpu_threads.push(name.clone());
        let s = stop.clone();
        handles.push(
            std::thread::Builder::new()
                .name(name.clone())
                .spawn(move || cpu_thread(name, s, units))
                .unwrap(),
        );
    }
    // Per blocking thread, a mutex holder and a channel feeder (not checked themselves). Each
    // blocking thread has its own: threads sharing one holder wait and wake together, and
    // their samples count for little more than one thread's.
    let mut holders = Vec::new();
    let mut feeders = Vec::new();
    let mut blocking_threads = Vec::new();
    // Twelve: with six, one 20 s run has about 24,000 wall samples of them, and point sampling
    // alone spreads the mutex site's (a fifth of them) by ±2.3% (one sd), too close to the ±5%
    // bound for 20 runs.
    for i in 0..env_or("FERROPROF_GT_BLOCKING_THREADS", 12) {
        let (tx, rx) = mpsc::channel();
        let (req_tx, req_rx) = mpsc::channel::<()>();
        feeders.push(
            std::thread::Builder::new()
                .name(format!("gt-feeder-{i}"))
                .spawn(move || {
                    // Ends when the blocking thread drops its request sender.
                    while req_rx.recv().is_ok() {
                        std::thread::sleep(Duration::from_millis(5));
                        if tx.send(()).is_err() {
                            return;
                        }
                    }
                })
                .unwrap(),
        );
        let rx = (req_tx, rx);
        let m = Arc::new(Mutex::new(()));
        holders.push({
            let (m, s) = (m.clone(), stop.clone());
            std::thread::Builder::new()
                .name(format!("gt-holder-{i}"))
                .spawn(move || {
                    while !s.load(Ordering::Relaxed) {
                        let g = m.lock().unwrap();
                        std::thread::sleep(Duration::from_millis(4));
                        drop(g);
                        std::thread::sleep(Duration::from_millis(1));
                    }
                })
                .unwrap()
        });
        let name = format!("gt-block-{i}");
        blocking_threads.push(name.clone());
        let s = stop.clone();
        handles.push(
            std::thread::Builder::new()
                .name(name.clone())
                .spawn(move || blocking_thread(name, s, m, rx, work_units))
                .unwrap(),
        );
    }
    let eintr = {
        let s = stop.clone();
        std::thread::Builder::new()
            .name("gt-eintr".into())
            .spawn(move || eintr_thread(s, work_units))
            .unwrap()
    };
    // Short threads: one starts every 700 ms while at least 3.5 s of the run remain.
    let t0 = Instant::now();
    let run = Duration::from_secs_f64(secs);
    let mut shorts = Vec::new();
    let mut next_short = t0 + Duration::from_millis(300);
    while t0.elapsed() < run {
        if Instant::now() >= next_short && t0.elapsed() + Duration::from_millis(3500) < run {
            let name = format!("gt-short-{}", shorts.len());
            shorts.push(
                std::thread::Builder::new()
                    .name(name.clone())
                    .spawn(move || short_thread(name, units / 4))
                    .unwrap(),
            );
            next_short += Duration::from_millis(700);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    let mut truths: Vec<Truth> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    truths.extend(shorts.into_iter().map(|h| h.join().unwrap()));
    let eintr = eintr.join().unwrap();
    for h in holders {
        h.join().unwrap();
    }
    for f in feeders {
        f.join().unwrap();
    }
    let st = guard.stats();
    eprintln!(
        "  cpu engine {}; wall stacks: {} read blocked, {} reads retried, {} from recent calls",
        st.cpu_engine, st.wall_remote_stacks, st.wall_remote_retries, st.wall_recent_calls
    );
    guard.stop().expect("profiler stops");
    Report {
        truths,
        cpu_threads,
        blocking_threads,
        eintr,
        profile: c.decoded(),
        hz,
    }
}

/// The innermost frame of `s` named in `markers`.
fn innermost<'a>(p: &Profile, s: &Sample, markers: &[&'a str]) -> Option<&'a str> {
    p.stack_names(s)
        .iter()
        .find_map(|f| markers.iter().find(|m| f.ends_with(*m)).copied())
}

/// Whether the stack of `s` is whole from `site` to the thread's root: `site`, then its caller
/// `caller` further out, and the thread's start (`clone3`) as the outermost frame. A stack that
/// names the right leaf site but a wrong caller, or ends early, fails.
fn whole_from(p: &Profile, s: &Sample, site: &str, caller: &str) -> bool {
    let names = p.stack_names(s);
    let Some(at) = names.iter().position(|f| f.ends_with(site)) else {
        return false;
    };
    names[at + 1..].iter().any(|f| f.ends_with(caller))
        && names.last().is_some_and(|f| f == "clone3")
}

/// A frame where the CPU went to the kernel or the vDSO.
fn is_syscall_frame(name: &str) -> bool {
    name.contains("vdso")
        || name.contains("clock_gettime")
        || name.contains("syscall")
        || name.starts_with("0x")
        || name.starts_with("__GI_")
        || name.starts_with("__libc_")
        || name == "getppid"
        || name == "__getppid"
}

#[derive(Debug)]
struct Check {
    what: String,
    truth: f64,
    found: f64,
    /// The error, in the unit the bound is in.
    error: f64,
    bound: f64,
    ok: bool,
}

/// Bounds: `share_bound` for CPU shares in points, `site_bounds` for per-site wall in percent
/// (the issue's ±3 and ±5 in the full runs; the short run in the default test suite has a few
/// hundred samples per function and site, and allows ±6 and ±15 per site, ±35 for the mutex
/// site, which has the fewest samples; the sampler before the redesign was off by -63% to
/// +34%), per site in the order of SITES; `cover_bound` for a thread's
/// CPU and wall coverage in percent (the 1 in the full runs; 2 in the short one, whose
/// threads have about 150 captures, and which runs unoptimized on a loaded CI machine: there
/// a busy thread's wall coverage has read -1.1%; the sampler before the redesign lost 26-89%).
/// Over the truth, CPU may go one period further (CPU samples count whole timer periods;
/// 20 full runs have read up to +1.10% for a thread of 1.2 s of CPU, where a period is 0.82%).
fn check(r: &Report, share_bound: f64, site_bounds: [f64; 3], cover_bound: f64) -> Vec<Check> {
    let mut out = Vec::new();
    let by_thread = |value: &str| -> HashMap<String, f64> {
        let mut m = HashMap::new();
        for p in &r.profile {
            let Some(i) = p.value_index(value) else {
                continue;
            };
            for s in &p.sample {
                if let Some(n) = p.label_str(s, "thread name") {
                    *m.entry(n.to_owned()).or_default() += s.value[i] as f64;
                }
            }
        }
        m
    };
    let cpu = by_thread("cpu-time");
    let wall = by_thread("wall-time");
    // 1. No thread lost: CPU and wall cover 99-101% of each thread's truth (CPU: and a period).
    for t in &r.truths {
        for (kind, got, truth) in [
            (
                "cpu",
                cpu.get(&t.name).copied().unwrap_or(0.0),
                t.cpu_ns as f64,
            ),
            (
                "wall",
                wall.get(&t.name).copied().unwrap_or(0.0),
                t.wall_ns as f64,
            ),
        ] {
            if kind == "cpu" && truth < 1e9 {
                // Blocking threads use a few ms of CPU a second: a dozen captures, each one
                // period; coverage there is the quantization of a dozen samples.
                continue;
            }
            let ratio = got / truth.max(1.0);
            let error = (ratio - 1.0) * 100.0;
            let bound = cover_bound;
            let period = if kind == "cpu" {
                100.0 * 1e9 / f64::from(r.hz.max(1)) / truth.max(1.0)
            } else {
                0.0
            };
            out.push(Check {
                what: format!("{} {kind} coverage", t.name),
                truth: truth / 1e9,
                found: got / 1e9,
                error,
                bound,
                ok: error >= -bound && error <= bound + period,
            });
        }
    }
    // 2. CPU shares of the CPU threads' functions, all CPU threads together.
    let is_cpu_thread = |p: &Profile, s: &Sample| {
        p.label_str(s, "thread name")
            .is_some_and(|n| r.cpu_threads.iter().any(|c| c == n))
    };
    let mut prof_fn: HashMap<&str, f64> = HashMap::new();
    let mut prof_total = 0.0;
    let mut pure_syscall = 0.0;
    for p in &r.profile {
        let Some(i) = p.value_index("cpu-time") else {
            continue;
        };
        for s in p.sample.iter().filter(|s| is_cpu_thread(p, s)) {
            let v = s.value[i] as f64;
            prof_total += v;
            let f = innermost(p, s, &CPU_FUNCS).unwrap_or("other");
            *prof_fn.entry(f).or_default() += v;
            if f == "gt_pure"
                && p.stack_names(s)
                    .first()
                    .is_some_and(|leaf| is_syscall_frame(leaf))
            {
                pure_syscall += v;
            }
        }
    }
    let mut truth_fn: HashMap<&str, f64> = HashMap::new();
    let mut truth_total = 0.0;
    for t in r.truths.iter().filter(|t| r.cpu_threads.contains(&t.name)) {
        for (f, v) in &t.per {
            *truth_fn.entry(f).or_default() += *v as f64;
            truth_total += *v as f64;
        }
    }
    for f in CPU_FUNCS {
        let truth = truth_fn.get(f).copied().unwrap_or(0.0) / truth_total.max(1.0) * 100.0;
        let found = prof_fn.get(f).copied().unwrap_or(0.0) / prof_total.max(1.0) * 100.0;
        if truth >= 5.0 {
            out.push(Check {
                what: format!("{f} share of CPU (points)"),
                truth,
                found,
                error: found - truth,
                bound: share_bound,
                ok: (found - truth).abs() <= share_bound,
            });
        }
    }
    let pure = prof_fn.get("gt_pure").copied().unwrap_or(0.0);
    let share = pure_syscall / pure.max(1.0) * 100.0;
    out.push(Check {
        what: "gt_pure CPU in syscall/vDSO frames (points)".into(),
        truth: 0.0,
        found: share,
        error: share,
        bound: 2.0,
        ok: share <= 2.0,
    });
    // 3. Wall time per blocking site, the blocking threads together.
    let is_blocking = |p: &Profile, s: &Sample| {
        p.label_str(s, "thread name")
            .is_some_and(|n| r.blocking_threads.iter().any(|c| c == n))
    };
    for (site, site_bound) in SITES.into_iter().zip(site_bounds) {
        let truth: f64 = r
            .truths
            .iter()
            .filter(|t| r.blocking_threads.contains(&t.name))
            .map(|t| t.per.get(site).copied().unwrap_or(0) as f64)
            .sum();
        // Whole stacks only: the site, its caller, the thread's root.
        let found = sum_all(&r.profile, "wall-time", |p, s| {
            is_blocking(p, s)
                && innermost(p, s, &SITES) == Some(site)
                && whole_from(p, s, site, "blocking_thread")
        }) as f64;
        let err = (found / truth.max(1.0) - 1.0) * 100.0;
        out.push(Check {
            what: format!("{site} wall (%)"),
            truth: truth / 1e9,
            found: found / 1e9,
            error: err,
            bound: site_bound,
            ok: err.abs() <= site_bound,
        });
    }
    // No wrong caller: a blocking thread's wall sample at a site is whole (the site, its
    // caller, the root) or says it is not (`[stack unknown]`); anything else shows a caller
    // the thread was not in, or no path to its root.
    let at_site = |p: &Profile, s: &Sample| is_blocking(p, s) && innermost(p, s, &SITES).is_some();
    let at_sites = sum_all(&r.profile, "wall-time", at_site) as f64;
    let wrong = sum_all(&r.profile, "wall-time", |p, s| {
        at_site(p, s)
            && !innermost(p, s, &SITES)
                .is_some_and(|site| whole_from(p, s, site, "blocking_thread"))
            && !p.stack_names(s).iter().any(|f| f == "[stack unknown]")
    }) as f64;
    let wrong_pct = wrong / at_sites.max(1.0) * 100.0;
    out.push(Check {
        what: "blocked wall samples with a wrong caller or no root (%)".into(),
        truth: 0.0,
        found: wrong_pct,
        error: wrong_pct,
        bound: 0.0,
        ok: wrong == 0.0,
    });
    // Not a check: where the blocking threads' other wall time went (work, or no site).
    if std::env::var_os("FERROPROF_GT_DEBUG").is_some() {
        let mut other: HashMap<String, i64> = HashMap::new();
        for p in &r.profile {
            let Some(i) = p.value_index("wall-time") else {
                continue;
            };
            for s in p.sample.iter().filter(|s| is_blocking(p, s)) {
                {
                    let names = p.stack_names(s);
                    let key = names
                        .iter()
                        .take(9)
                        .map(|n| n.rsplit("::").next().unwrap_or(n).to_owned())
                        .collect::<Vec<_>>()
                        .join(" < ");
                    *other.entry(key).or_default() += s.value[i];
                }
            }
        }
        let mut v: Vec<_> = other.into_iter().collect();
        v.sort_by_key(|(_, n)| -n);
        for (k, n) in v.iter().take(14) {
            println!("  other wall {:>8.3} s  {k}", *n as f64 / 1e9);
        }
    }
    // 4. No EINTR, no early return.
    let e = r.eintr.total() as f64;
    out.push(Check {
        what: format!(
            "EINTR/early returns in {} calls ({:?})",
            r.eintr.calls, r.eintr
        ),
        truth: 0.0,
        found: e,
        error: e,
        bound: 0.0,
        ok: e == 0.0 && r.eintr.calls > 0,
    });
    // 5. No sample of a ferroprof thread.
    let ours = sum_all(&r.profile, "wall-time", |p, s| {
        p.label_str(s, "thread name")
            .is_some_and(|n| n.starts_with("ferroprof-"))
    }) as f64;
    out.push(Check {
        what: "wall time of ferroprof threads (s)".into(),
        truth: 0.0,
        found: ours / 1e9,
        error: ours / 1e9,
        bound: 0.0,
        ok: ours == 0.0,
    });
    out
}

fn print_table(run: usize, checks: &[Check]) {
    println!("run {run}:");
    println!(
        "  {:<58} {:>9} {:>9} {:>8} {:>6}",
        "target", "truth", "profile", "error", "bound"
    );
    for c in checks {
        println!(
            "  {:<58} {:>9.3} {:>9.3} {:>8.2} {:>6.1} {}",
            c.what,
            c.truth,
            c.found,
            c.error,
            c.bound,
            if c.ok { "ok" } else { "FAIL" }
        );
    }
}

#[test]
fn ground_truth_short() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let secs = env_or("FERROPROF_GT_SECS", 6.0);
    let hz = env_or("FERROPROF_GT_HZ", 100);
    let checks = check(&run_once(secs, hz), 6.0, [35.0, 15.0, 15.0], 2.0);
    print_table(0, &checks);
    let failed: Vec<&Check> = checks.iter().filter(|c| !c.ok).collect();
    assert!(failed.is_empty(), "{failed:#?}");
}

#[test]
#[ignore = "20 runs: scripts/ground_truth.sh (release)"]
fn ground_truth_full() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let runs = env_or("FERROPROF_GT_RUNS", 20usize);
    let secs = env_or("FERROPROF_GT_SECS", 20.0);
    let hz = env_or("FERROPROF_GT_HZ", 100);
    // Worst absolute error per target kind (thread names folded), and failures.
    let mut worst: HashMap<String, (f64, f64)> = HashMap::new();
    let mut failures = 0;
    // Signed errors per site over the runs: their mean is the sampler's bias, their spread the
    // sampling noise of one run.
    let mut site_errors: HashMap<&str, Vec<f64>> = HashMap::new();
    // Per site, the spread point sampling alone gives a run (averaged over the runs): with n
    // ticks' samples of the blocking threads and a share p of them at the site, a relative sd
    // of sqrt((1 - p) / (p n)).
    let mut binomial_sd: HashMap<&str, f64> = HashMap::new();
    for run in 0..runs {
        let report = run_once(secs, hz);
        let blocking = report
            .truths
            .iter()
            .filter(|t| report.blocking_threads.contains(&t.name));
        let wall: f64 = blocking.clone().map(|t| t.wall_ns as f64).sum();
        let ticks = wall * f64::from(hz) / 1e9;
        for site in SITES {
            let at: f64 = blocking
                .clone()
                .map(|t| t.per.get(site).copied().unwrap_or(0) as f64)
                .sum();
            let p = (at / wall.max(1.0)).clamp(1e-9, 1.0);
            *binomial_sd.entry(site).or_default() +=
                100.0 * ((1.0 - p) / (p * ticks.max(1.0))).sqrt() / runs as f64;
        }
        let checks = check(&report, 3.0, [5.0; 3], 1.0);
        print_table(run, &checks);
        for c in &checks {
            if let Some(site) = SITES
                .iter()
                .find(|s| c.what.starts_with(&format!("{s} wall")))
            {
                site_errors.entry(site).or_default().push(c.error);
            }
            let kind = c
                .what
                .split_whitespace()
                .filter(|w| !w.starts_with("gt-") && !w.starts_with('('))
                .collect::<Vec<_>>()
                .join(" ");
            let kind = kind.split(" in ").next().unwrap_or(&kind).to_owned();
            let e = worst.entry(kind).or_insert((0.0, c.bound));
            e.0 = e.0.max(c.error.abs());
            failures += usize::from(!c.ok);
        }
    }
    let mut kinds: Vec<_> = worst.into_iter().collect();
    kinds.sort_by(|a, b| a.0.cmp(&b.0));
    println!("summary over {runs} runs of {secs} s at {hz} Hz (worst |error| / bound):");
    for (k, (e, b)) in &kinds {
        println!("  {k:<50} {e:>8.2} / {b}");
    }
    for site in SITES {
        let e = site_errors.get(site).map_or(&[][..], |v| &v[..]);
        let n = e.len().max(1) as f64;
        let mean = e.iter().sum::<f64>() / n;
        let sd = (e.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0)).sqrt();
        let expected = binomial_sd.get(site).copied().unwrap_or(0.0);
        println!(
            "  {site} wall error over runs: mean {mean:+.2}%, sd {sd:.2}% (point sampling alone: sd {expected:.2}%)"
        );
    }
    println!("  failed checks: {failures}");
    assert_eq!(failures, 0, "{failures} checks failed");
}

static FOREIGN_SIGPROFS: AtomicU64 = AtomicU64::new(0);

extern "C" fn count_sigprof(_sig: libc::c_int) {
    FOREIGN_SIGPROFS.fetch_add(1, Ordering::Relaxed);
}

/// A gperftools-style `SIGPROF` user (its own handler, `setitimer(ITIMER_PROF)` at 100 Hz)
/// installed after `start()`: ferroprof's CPU samples still cover the threads' CPU, and the
/// other handler gets its own signals only (about 100 per CPU-second of the process).
#[test]
fn foreign_sigprof_user_neither_starves_us_nor_gets_our_signals() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let c = Collect::default();
    let guard = start_cpu_wall("foreign-sigprof", 100, &c);
    // SAFETY: installs a handler that only bumps an atomic, and a process CPU timer.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = count_sigprof as *const () as usize;
        sa.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut sa.sa_mask);
        assert_eq!(libc::sigaction(libc::SIGPROF, &sa, std::ptr::null_mut()), 0);
        let tv = libc::timeval {
            tv_sec: 0,
            tv_usec: 10_000,
        };
        let it = libc::itimerval {
            it_interval: tv,
            it_value: tv,
        };
        assert_eq!(
            libc::setitimer(libc::ITIMER_PROF, &it, std::ptr::null_mut()),
            0
        );
    }
    let user_cpu_secs = || {
        // SAFETY: rusage is plain data; getrusage fills it through a valid out-pointer.
        let ru = unsafe {
            let mut ru: libc::rusage = std::mem::zeroed();
            libc::getrusage(libc::RUSAGE_SELF, &mut ru);
            ru
        };
        ru.ru_utime.tv_sec as f64 + ru.ru_utime.tv_usec as f64 / 1e6
    };
    let p0 = user_cpu_secs();
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..2)
        .map(|i| {
            let s = stop.clone();
            std::thread::Builder::new()
                .name(format!("gt-fg-{i}"))
                .spawn(move || {
                    let c0 = thread_cpu_ns();
                    // Calls of about 10 ms: the truth is read from the thread's CPU clock at each call's ends,
                    // and that read is a system call that updates the scheduler's accounting, so a thread whose
                    // time slice ran out is preempted right there, at a call boundary. With 2 ms calls those
                    // preemptions, correlated with the functions, moved CPU-timer samples toward the longer
                    // calls by 3 to 8 points (a harness artefact: with the truth counted in work units instead,
                    // or with calls of 10 ms or more, the same timers were within 1 point; the kernel checks
                    // CPU timers at its tick, and a thread's runs now start and end at those reads).
                    let units = units_for(10.0);
                    while !s.load(Ordering::Relaxed) {
                        std::hint::black_box(gt_pure(units));
                    }
                    thread_cpu_ns() - c0
                })
                .unwrap()
        })
        .collect();
    std::thread::sleep(Duration::from_secs(3));
    stop.store(true, Ordering::Relaxed);
    let truth: u64 = workers.into_iter().map(|w| w.join().unwrap()).sum();
    // SAFETY: stops the process CPU timer; the handler stays (a late signal finds it).
    unsafe {
        let zero = std::mem::zeroed::<libc::itimerval>();
        libc::setitimer(libc::ITIMER_PROF, &zero, std::ptr::null_mut());
    }
    let p1 = user_cpu_secs();
    let stats = guard.stats();
    guard.stop().unwrap();
    let ours = sum_all(&c.decoded(), "cpu-time", |p, s| {
        p.label_str(s, "thread name")
            .is_some_and(|n| n.starts_with("gt-fg-"))
    }) as f64;
    let foreign = FOREIGN_SIGPROFS.load(Ordering::Relaxed) as f64;
    let expected = (p1 - p0) * 100.0;
    println!(
        "foreign SIGPROF handler: {foreign} calls (~{expected:.0} expected from its timer); ferroprof: {:.3} s of {:.3} s CPU covered, {} timer captures, signal {}",
        ours / 1e9,
        truth as f64 / 1e9,
        stats.cpu_timer_samples,
        stats.signal
    );
    assert_ne!(stats.signal, libc::SIGPROF, "a signal of its own");
    assert!(ours >= 0.9 * truth as f64, "starved: {ours} of {truth} ns");
    assert!(
        foreign <= 1.5 * expected + 20.0,
        "{foreign} SIGPROFs for ~{expected:.0} of its own"
    );
}

/// Sleeps until the next multiple of `step_ns` on the monotonic clock.
fn sleep_to_boundary(step_ns: u64) {
    let now = Instant::now();
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    let t = ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64;
    let next = (t / step_ns + 1) * step_ns;
    let until = libc::timespec {
        tv_sec: (next / 1_000_000_000) as libc::time_t,
        tv_nsec: (next % 1_000_000_000) as libc::c_long,
    };
    // SAFETY: valid timespec; an absolute sleep on the monotonic clock.
    unsafe {
        libc::clock_nanosleep(
            libc::CLOCK_MONOTONIC,
            libc::TIMER_ABSTIME,
            &until,
            std::ptr::null_mut(),
        )
    };
    std::hint::black_box(now);
}

#[inline(never)]
fn gt_phase_a() {
    sleep_to_boundary(5_000_000);
    // A body of its own: release builds fold identical functions into one symbol, which would
    // name both sites `gt_phase_a`.
    std::hint::black_box(b'a');
}

#[inline(never)]
fn gt_phase_b() {
    sleep_to_boundary(5_000_000);
    std::hint::black_box(b'b');
}

/// A thread that wakes on the clock's 5 ms boundaries, alternating two sites, half the time
/// each: a sampler whose ticks fall on a fixed 10 ms grid saw it at the same site at every tick
/// (all of its wall time on one site; this failed before the ticks were jittered).
#[test]
fn a_thread_in_step_with_the_sampling_period_gets_its_wall_time_split_right() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let c = Collect::default();
    let guard = start_cpu_wall("in-step", 100, &c);
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let h = std::thread::Builder::new()
        .name("in-step".into())
        .spawn(move || {
            while !s.load(Ordering::Relaxed) {
                gt_phase_a();
                gt_phase_b();
            }
        })
        .unwrap();
    std::thread::sleep(Duration::from_secs(4));
    stop.store(true, Ordering::Relaxed);
    h.join().unwrap();
    guard.stop().expect("profiler stops");
    let profile = c.decoded();
    let site = |name: &'static str| {
        sum_all(&profile, "wall-time", |p, s| {
            p.label_str(s, "thread name") == Some("in-step")
                && innermost(p, s, &["gt_phase_a", "gt_phase_b"]) == Some(name)
        }) as f64
    };
    let (a, b) = (site("gt_phase_a"), site("gt_phase_b"));
    let share = a / (a + b).max(1.0) * 100.0;
    println!(
        "in-step thread: {:.3} s at a, {:.3} s at b, a = {share:.1}%",
        a / 1e9,
        b / 1e9
    );
    assert!(
        a + b > 3e9,
        "the thread's wall time is missing: {a} + {b} ns"
    );
    assert!(
        (share - 50.0).abs() <= 12.0,
        "site a has {share:.1}% of the wall time, truth 50%"
    );
}

/// A thread that starts as another ends, with hundreds of idle threads around (listings are
/// then rare): the thread count does not change, so only a later listing finds the new thread,
/// and its wall time still starts at its start. Before, its time up to that listing was lost
/// (the short threads of the full harness lost up to 23% of their wall time on a busy machine;
/// here 6-45%, three of four under 85%). Now 99-104% on a quiet machine; under load (two
/// busy loops next to it, unoptimized) the first such thread has read 92.6-97.7%, a loss whose
/// cause is not found, hence the 85% floor. Over is allowed by a few periods: a thread's last
/// captures book the CPU they stand for as wall time ahead, paid back from later off-CPU time,
/// which an ending thread does not have (+0.1% to +4% here).
#[test]
fn a_thread_started_as_another_ends_keeps_its_whole_wall_time() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let stop = Arc::new(AtomicBool::new(false));
    let idle: Vec<_> = (0..300)
        .map(|_| {
            let s = stop.clone();
            std::thread::spawn(move || {
                while !s.load(Ordering::Relaxed) {
                    std::thread::park_timeout(Duration::from_millis(200));
                }
            })
        })
        .collect();
    let c = Collect::default();
    let guard = start_cpu_wall("swap", 100, &c);
    std::thread::sleep(Duration::from_millis(300));
    let mut lives = Vec::new();
    for i in 0..4 {
        let name = format!("gt-swap-{i}");
        // The ender spawns the starter and ends right away: in one tick, one thread comes
        // and one goes.
        let ender = std::thread::Builder::new()
            .name(format!("gt-ender-{i}"))
            .spawn(move || {
                std::thread::Builder::new()
                    .name(name.clone())
                    .spawn(move || {
                        let born = Instant::now();
                        std::thread::sleep(Duration::from_millis(700));
                        // Ends running: its end is seen within a tick.
                        let spin = Instant::now();
                        while spin.elapsed() < Duration::from_millis(60) {
                            std::hint::black_box(mix(1, 2));
                        }
                        (name, born.elapsed())
                    })
                    .unwrap()
            })
            .unwrap();
        let starter = ender.join().unwrap();
        lives.push(starter.join().unwrap());
    }
    std::thread::sleep(Duration::from_millis(100));
    guard.stop().expect("profiler stops");
    stop.store(true, Ordering::Relaxed);
    for t in idle {
        t.thread().unpark();
        t.join().unwrap();
    }
    let profile = c.decoded();
    for (name, life) in lives {
        let wall = sum_all(&profile, "wall-time", |p, s| {
            p.label_str(s, "thread name") == Some(name.as_str())
        }) as f64;
        let cover = wall / life.as_nanos() as f64 * 100.0;
        assert!(
            (85.0..=106.0).contains(&cover),
            "{name}: {cover:.1}% of its {life:?} of wall time"
        );
    }
}

/// A thread that is found before it names itself, and does not run for a while (a loaded
/// machine may leave a new thread unscheduled for longer than the sampler's first visits of it):
/// its wall time after it names itself carries its new name, and only that. Before, each visit
/// used up one of the name re-reads whether or not the thread had run, and a thread unscheduled
/// through them kept its creator's name for its whole life (0.0% here; the CI run where
/// `gt-swap-0` read 0.0%); and the wall time from before the rename that was still to be booked
/// went under the new name (163% with a shorter wait). The thread names itself twice: the
/// sampler stopped looking after the first change it saw (15% under the late name on a
/// loaded machine, where the listing saw the creator's name before std's).
#[test]
fn a_thread_that_names_itself_late_gets_its_wall_time_under_its_name() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let c = Collect::default();
    let guard = start_cpu_wall("late-name", 100, &c);
    std::thread::sleep(Duration::from_millis(100));
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let late = std::thread::Builder::new()
        .name("gt-creator".into())
        .spawn(move || {
            // Named once already, as std names a thread at its start and the application
            // again later: a first name of its own, seen by the sampler while it runs.
            std::thread::sleep(Duration::from_millis(100));
            let first = std::ffi::CString::new("gt-first-name").unwrap();
            // SAFETY: names this thread with a NUL-terminated string under 16 bytes.
            unsafe { libc::pthread_setname_np(libc::pthread_self(), first.as_ptr()) };
            let spin = thread_cpu();
            while thread_cpu() - spin < Duration::from_millis(30) {
                std::hint::black_box(mix(1, 2));
            }
            // Not running until told: the sampler lists it and visits it meanwhile.
            go_rx.recv().unwrap();
            let name = std::ffi::CString::new("gt-late-name").unwrap();
            // SAFETY: names this thread with a NUL-terminated string under 16 bytes.
            unsafe { libc::pthread_setname_np(libc::pthread_self(), name.as_ptr()) };
            let named = Instant::now();
            std::thread::sleep(Duration::from_millis(600));
            let spin = thread_cpu();
            while thread_cpu() - spin < Duration::from_millis(40) {
                std::hint::black_box(mix(1, 2));
            }
            named.elapsed()
        })
        .unwrap();
    // Past the sampler's first 100 visits (about one a tick: the process has few threads).
    std::thread::sleep(Duration::from_millis(1300));
    go_tx.send(()).unwrap();
    let truth = late.join().unwrap();
    std::thread::sleep(Duration::from_millis(100));
    guard.stop().expect("profiler stops");
    let profile = c.decoded();
    let wall = sum_all(&profile, "wall-time", |p, s| {
        p.label_str(s, "thread name") == Some("gt-late-name")
    }) as f64;
    let cover = wall / truth.as_nanos() as f64 * 100.0;
    println!("named late: {cover:.1}% of {truth:?} under its new name");
    // Under: the wall time since its last visit before it ran is booked at the first visit
    // after, under the new name, so only the tick around the rename is uncertain.
    assert!(
        (80.0..=120.0).contains(&cover),
        "gt-late-name: {cover:.1}% of its {truth:?} of wall time since it named itself"
    );
}
