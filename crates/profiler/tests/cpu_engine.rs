//! The CPU engines: perf task-clock events against the threads' own CPU clocks, the periodic
//! work a fixed period would alias with, the choice from the environment, and the fall-back to
//! timers when a seccomp filter refuses `perf_event_open`.

mod child_support;
mod profiler_support;

use std::hint::black_box;
use std::sync::Mutex;
use std::time::Duration;

use child_support::{is_child, run_child};
use ferroprof::{CpuEngine, Profiler, ProfilerError};
use profiler_support::*;

/// One profiler per process: the tests of this file take turns.
static LOCK: Mutex<()> = Mutex::new(());

#[inline(never)]
fn engine_a(units: u64) -> u64 {
    (0..units).fold(1u64, |x, i| {
        black_box(x.rotate_left(5) ^ i).wrapping_mul(31)
    })
}

#[inline(never)]
fn engine_b(units: u64) -> u64 {
    (0..units).fold(7u64, |x, i| {
        black_box(x.rotate_left(3) ^ i).wrapping_mul(17)
    })
}

/// Runs `f` until the thread has used `cpu` more CPU time; the CPU it took.
fn burn_for(cpu: Duration, f: impl Fn()) -> Duration {
    let t0 = thread_cpu();
    while thread_cpu() - t0 < cpu {
        f();
    }
    thread_cpu() - t0
}

/// Runs `work` on two threads named `{prefix}-0` and `{prefix}-1`; their results in order.
fn on_two_threads<R: Send + 'static>(prefix: &str, work: fn() -> R) -> Vec<R> {
    let workers: Vec<_> = (0..2)
        .map(|i| {
            std::thread::Builder::new()
                .name(format!("{prefix}-{i}"))
                .spawn(work)
                .unwrap()
        })
        .collect();
    workers.into_iter().map(|w| w.join().unwrap()).collect()
}

fn start(
    engine: CpuEngine,
    hz: u32,
    c: &Collect,
) -> Result<ferroprof::ProfilerGuard, ProfilerError> {
    Profiler::builder()
        .service("cpu-engine")
        .cpu_hz(hz)
        .profiles(cpu_wall())
        .cpu_engine(engine)
        .period(Duration::from_secs(3600))
        .exporter(Box::new(c.clone()))
        .start()
}

/// Whether this process may use perf events; prints why not.
fn perf_allowed() -> bool {
    let c = Collect::default();
    match start(CpuEngine::Perf, 100, &c) {
        Ok(g) => {
            g.stop().expect("stops");
            true
        }
        Err(e) => {
            println!("perf events refused here ({e}): the perf checks are left out");
            false
        }
    }
}

/// Two threads, each alternating `engine_a` (3 parts of its CPU) and `engine_b` (1 part) in
/// rounds of a few milliseconds: with perf events, each function's CPU share and each thread's
/// CPU total agree with the threads' own CPU clocks.
#[test]
fn perf_events_book_cpu_where_the_clock_says() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if !perf_allowed() {
        return;
    }
    let c = Collect::default();
    let guard = start(CpuEngine::Perf, 1000, &c).expect("perf engine starts");
    let truths = on_two_threads("engine", || {
        let (mut a, mut b) = (Duration::ZERO, Duration::ZERO);
        let t0 = thread_cpu();
        while a + b < Duration::from_millis(1500) {
            a += burn_for(Duration::from_micros(3000), || {
                black_box(engine_a(2000));
            });
            b += burn_for(Duration::from_micros(1000), || {
                black_box(engine_b(2000));
            });
        }
        (a, b, thread_cpu() - t0)
    });
    let stats = guard.stats();
    guard.stop().expect("stops");
    assert_eq!(stats.cpu_engine, "perf");
    assert!(stats.cpu_timer_samples > 0, "no capture: {stats:?}");
    let ps = c.decoded();
    for (i, (a, b, total)) in truths.into_iter().enumerate() {
        let name = format!("engine-{i}");
        let of = |f: &str| {
            sum_all(&ps, "cpu-time", |p, s| {
                p.label_str(s, "thread name") == Some(name.as_str()) && has_fn(p, s, f)
            }) as f64
        };
        let all = sum_all(&ps, "cpu-time", |p, s| {
            p.label_str(s, "thread name") == Some(name.as_str())
        }) as f64;
        let (fa, fb) = (of("engine_a"), of("engine_b"));
        let share = fa / (fa + fb).max(1.0) * 100.0;
        let truth = a.as_secs_f64() / (a + b).as_secs_f64() * 100.0;
        let cover = all / total.as_nanos() as f64 * 100.0;
        println!("{name}: engine_a {share:.1}% (truth {truth:.1}%), CPU covered {cover:.1}%");
        assert!(
            (share - truth).abs() <= 4.0,
            "{name}: engine_a {share:.1}%, truth {truth:.1}%"
        );
        assert!(
            (98.0..=102.0).contains(&cover),
            "{name}: {cover:.1}% of its CPU"
        );
    }
}

/// Perf events never interrupt a system call: two threads alternate user work with short
/// `nanosleep`s and `poll`s (never restarted after a handler, whatever `SA_RESTART` says) at
/// 1000 Hz, and none returns `EINTR`. An event that also counted kernel time would signal a
/// thread whose period ended inside such a call before it went to sleep: 34 `EINTR`s in 4 s
/// of this workload, where user-space events drop those overflows.
#[test]
fn perf_events_never_interrupt_a_system_call() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if !perf_allowed() {
        return;
    }
    let c = Collect::default();
    let guard = start(CpuEngine::Perf, 1000, &c).expect("perf engine starts");
    let results = on_two_threads("engine-calls", || {
        let (mut calls, mut eintr) = (0u64, 0u64);
        let t0 = std::time::Instant::now();
        while t0.elapsed() < Duration::from_secs(4) {
            black_box(engine_a(2000));
            if nanosleep_failed(1_000) {
                eintr += 1;
            }
            let mut pfd = libc::pollfd {
                fd: -1,
                events: 0,
                revents: 0,
            };
            // SAFETY: one valid pollfd (a negative fd is ignored).
            if unsafe { libc::poll(&mut pfd, 1, 0) } < 0 {
                eintr += 1;
            }
            calls += 2;
        }
        (calls, eintr)
    });
    let stats = guard.stats();
    guard.stop().expect("stops");
    println!("calls and EINTRs per thread: {results:?}");
    assert!(stats.cpu_timer_samples > 0, "no capture: {stats:?}");
    for (calls, eintr) in results {
        assert_eq!(eintr, 0, "{eintr} EINTRs in {calls} calls");
    }
}

/// A thread whose rounds each use about one sampling period of CPU, half in `engine_a` and half
/// in `engine_b`. The events' period is fixed: were the rounds exactly one period long, every
/// sample would fall at the same point of a round. Real rounds vary by more than the handler's
/// few microseconds, the phase drifts, and each function gets about half.
#[test]
fn perf_periods_do_not_alias_with_periodic_work() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if !perf_allowed() {
        return;
    }
    let c = Collect::default();
    let guard = start(CpuEngine::Perf, 1000, &c).expect("perf engine starts");
    let worker = std::thread::Builder::new()
        .name("engine-periodic".into())
        .spawn(|| {
            let t0 = thread_cpu();
            // Rounds of 1 ms of CPU (the period at 1000 Hz): 500 µs in each function, in steps
            // long against the clock read between them (a system call: the user-space events
            // do not sample it, and its periods' CPU goes to other samples in whole periods).
            while thread_cpu() - t0 < Duration::from_millis(2000) {
                burn_for(Duration::from_micros(500), || {
                    black_box(engine_a(5000));
                });
                burn_for(Duration::from_micros(500), || {
                    black_box(engine_b(5000));
                });
            }
        })
        .unwrap();
    worker.join().unwrap();
    guard.stop().expect("stops");
    let ps = c.decoded();
    let of = |f: &str| {
        sum_all(&ps, "cpu-time", |p, s| {
            p.label_str(s, "thread name") == Some("engine-periodic") && has_fn(p, s, f)
        }) as f64
    };
    let (fa, fb) = (of("engine_a"), of("engine_b"));
    let share = fa / (fa + fb).max(1.0) * 100.0;
    println!("periodic rounds: engine_a {share:.1}% (truth 50%)");
    assert!(fa + fb > 1e9, "too little CPU sampled: {fa} + {fb} ns");
    assert!(
        (share - 50.0).abs() <= 10.0,
        "engine_a {share:.1}% of the CPU, truth 50%"
    );
}

/// `FERROPROF_CPU_ENGINE` picks the engine; a bad value is an error naming it.
#[test]
fn the_engine_comes_from_the_environment() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let c = Collect::default();
    let err = Profiler::builder()
        .profiles(cpu_wall())
        .exporter(Box::new(c.clone()))
        .from_vars(|k| (k == "FERROPROF_CPU_ENGINE").then(|| "fastest".to_owned()))
        .start()
        .err()
        .expect("a bad engine is refused");
    let text = err.to_string();
    assert!(
        text.contains("FERROPROF_CPU_ENGINE") && text.contains("fastest"),
        "{text}"
    );
    let guard = Profiler::builder()
        .profiles(cpu_wall())
        .exporter(Box::new(c.clone()))
        .from_vars(|k| (k == "FERROPROF_CPU_ENGINE").then(|| "timer".to_owned()))
        .start()
        .expect("starts");
    assert_eq!(guard.stats().cpu_engine, "timer");
    guard.stop().expect("stops");
}

/// Installs a seccomp filter on this thread (inherited by threads it starts) that fails
/// `perf_event_open` with `EACCES`, as container runtimes' default profiles do.
fn refuse_perf_events() {
    const SECCOMP_RET_ALLOW: u32 = 0x7fff_0000;
    const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
    const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
    const AUDIT_ARCH_AARCH64: u32 = 0xc000_00b7;
    let arch = if cfg!(target_arch = "x86_64") {
        AUDIT_ARCH_X86_64
    } else {
        AUDIT_ARCH_AARCH64
    };
    let stmt = |code: u16, k: u32| libc::sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    };
    let jeq = |k: u32, jt: u8, jf: u8| libc::sock_filter {
        code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
        jt,
        jf,
        k,
    };
    let load = (libc::BPF_LD | libc::BPF_W | libc::BPF_ABS) as u16;
    let ret = (libc::BPF_RET | libc::BPF_K) as u16;
    // seccomp_data: nr at 0, arch at 4.
    let mut prog = [
        stmt(load, 4),
        jeq(arch, 1, 0),
        stmt(ret, SECCOMP_RET_ALLOW),
        stmt(load, 0),
        jeq(libc::SYS_perf_event_open as u32, 0, 1),
        stmt(ret, SECCOMP_RET_ERRNO | libc::EACCES as u32),
        stmt(ret, SECCOMP_RET_ALLOW),
    ];
    let fprog = libc::sock_fprog {
        len: prog.len() as u16,
        filter: prog.as_mut_ptr(),
    };
    // SAFETY: no_new_privs, then a filter program that lives through the call (the kernel
    // copies it); the flag applies the filter to every thread of the process.
    unsafe {
        assert_eq!(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0);
        assert_eq!(
            libc::syscall(
                libc::SYS_seccomp,
                libc::SECCOMP_SET_MODE_FILTER,
                libc::SECCOMP_FILTER_FLAG_TSYNC,
                &fprog as *const libc::sock_fprog,
            ),
            0,
            "seccomp: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// Under a seccomp filter that refuses perf events: `Perf` is an error naming the kernel's
/// answer, `Auto` runs on timers and says so in its stats, and CPU samples still come.
#[test]
fn a_refused_perf_engine_falls_back_to_timers() {
    const TEST: &str = "a_refused_perf_engine_falls_back_to_timers";
    if !is_child(TEST) {
        let out = run_child(TEST, &[], Duration::from_secs(120));
        assert!(out.status.success(), "{}", out.describe());
        assert_eq!(out.value("fallback_ok"), Some(1), "{}", out.describe());
        return;
    }
    refuse_perf_events();
    let c = Collect::default();
    match start(CpuEngine::Perf, 100, &c) {
        Err(ProfilerError::CpuEngine { source }) => {
            assert_eq!(source.raw_os_error(), Some(libc::EACCES), "{source}")
        }
        Err(e) => panic!("perf under the filter: {e}"),
        Ok(_) => panic!("perf started under a filter that refuses it"),
    }
    let guard = start(CpuEngine::Auto, 100, &c).expect("auto starts on timers");
    assert_eq!(guard.stats().cpu_engine, "timer");
    burn_for(Duration::from_millis(300), || {
        black_box(engine_a(1000));
    });
    let stats = guard.stats();
    guard.stop().expect("stops");
    assert!(
        stats.cpu_timer_samples > 0,
        "no CPU sample on timers: {stats:?}"
    );
    println!("fallback_ok=1");
}

/// With few descriptors allowed (`RLIMIT_NOFILE` 64), perf events take at most a quarter of
/// them: the other threads get timers, every thread keeps its CPU samples, and the
/// application can still open its own files.
#[test]
fn perf_events_leave_the_applications_descriptors_alone() {
    const TEST: &str = "perf_events_leave_the_applications_descriptors_alone";
    if !is_child(TEST) {
        let out = run_child(TEST, &[], Duration::from_secs(120));
        assert!(out.status.success(), "{}", out.describe());
        assert_eq!(out.value("descriptors_ok"), Some(1), "{}", out.describe());
        return;
    }
    if !perf_allowed() {
        println!("descriptors_ok=1");
        return;
    }
    let lim = libc::rlimit {
        rlim_cur: 64,
        rlim_max: 64,
    };
    // SAFETY: lowers this (child) process's own descriptor limit.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
    let c = Collect::default();
    let guard = start(CpuEngine::Perf, 200, &c).expect("perf engine starts");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let threads: Vec<_> = (0..24)
        .map(|i| {
            let stop = stop.clone();
            std::thread::Builder::new()
                .name(format!("fd-{i}"))
                .spawn(move || {
                    burn_for(Duration::from_millis(150), || {
                        black_box(engine_a(500));
                    });
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                })
                .unwrap()
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let stats = guard.stats();
    // The application's own descriptors: 64 less the profiler's events and what was open.
    let files: Vec<_> = (0..20)
        .map(|_| std::fs::File::open("/dev/null").expect("the application opens a file"))
        .collect();
    drop(files);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    guard.stop().expect("stops");
    println!(
        "perf events {}, without a CPU engine {}",
        stats.perf_events, stats.threads_without_timer
    );
    assert!((1..=16).contains(&stats.perf_events), "{stats:?}");
    assert_eq!(stats.threads_without_timer, 0, "{stats:?}");
    let ps = c.decoded();
    for i in 0..24 {
        let name = format!("fd-{i}");
        let cpu = sum_all(&ps, "cpu-time", |p, s| {
            p.label_str(s, "thread name") == Some(name.as_str()) && has_fn(p, s, "engine_a")
        });
        assert!(cpu > 50_000_000, "{name}: {cpu} ns of CPU sampled");
    }
    println!("descriptors_ok=1");
}
