//! Many threads fork at once while the profiler is busy, and no child ever hangs.
//!
//! The way a service meets forks: several threads shell out at the same time
//! (`std::process::Command` with a `pre_exec` hook, so std takes the `fork` + `exec` path and the
//! `pthread_atfork` handlers run), others `fork` and `_exit` at once, while threads allocate at a
//! 4 KiB sampling interval (every sampled allocation and tracked free goes through the recorder),
//! burn CPU, start and end threads, and the profiler exports every 100 ms. glibc runs the
//! prepare handlers of two concurrent forks side by side, so this is where one fork's handlers
//! can reopen what another fork still needs closed.
//!
//! Every child is waited for with a deadline: a watchdog looks at this process's children, and
//! one that is still a copy of this program (it has not reached `exec` nor `_exit`) after
//! [`HUNG_AFTER`] is killed and counted as hung; killing it also frees the spawning thread, which
//! would otherwise wait for it for ever in `Command::spawn`. The default run makes about 1,000
//! forks; `FERROPROF_SPAWN_FORKS` sets another total (`scripts/reliability.sh forks` runs 6,000).

mod profiler_support;

use std::alloc::System;
use std::collections::HashMap;
use std::os::unix::process::CommandExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferroprof::{Profiler, Profiles, SamplingAllocator};
use profiler_support::*;

#[global_allocator]
static GLOBAL: SamplingAllocator<System> = SamplingAllocator::new(System);

/// A child still unexec'd after this long is hung (one needs about a millisecond).
const HUNG_AFTER: Duration = Duration::from_secs(10);
const SPAWNERS: u64 = 4;

fn total_forks() -> u64 {
    std::env::var("FERROPROF_SPAWN_FORKS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000)
}

/// Allocation churn with a rolling live set, and a little CPU between rounds.
#[inline(never)]
fn churn(stop: &AtomicBool, seed: u64) -> u64 {
    let mut live: Vec<Vec<u64>> = Vec::new();
    let mut x = seed | 1;
    while !stop.load(Ordering::Relaxed) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let v: Vec<u64> = (0..1 + (x % 512)).collect();
        live.push(v);
        if live.len() > 256 {
            live.swap_remove((x % 256) as usize);
        }
        let until = thread_cpu() + Duration::from_micros(20);
        while thread_cpu() < until {
            x = std::hint::black_box(x.wrapping_mul(0x2545_f491_4f6c_dd1d));
        }
    }
    x
}

/// Starts short threads that allocate, one after another.
#[inline(never)]
fn thread_churn(stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        let t = std::thread::spawn(|| {
            let v: Vec<String> = (0..200).map(|i| format!("{i:08}")).collect();
            std::hint::black_box(v);
        });
        let _ = t.join();
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Children of this process that are still copies of it (forked, not yet exec'd), by pid.
fn unexeced_children(me: &std::path::Path) -> Vec<i32> {
    let ppid = std::process::id().to_string();
    let mut out = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // Fields after the parenthesized command: state, ppid, ...
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) else {
            continue;
        };
        let mut f = rest.split(' ');
        let state = f.next().unwrap_or("");
        if f.next() != Some(ppid.as_str()) || state == "Z" {
            continue;
        }
        if std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|exe| exe == me) {
            out.push(pid);
        }
    }
    out
}

/// Kills children that stay unexec'd for [`HUNG_AFTER`]; returns how many it killed, with
/// where each was (its kernel stack and wait channel), once `stop` is set.
fn watchdog(stop: &AtomicBool) -> Vec<String> {
    let me = std::env::current_exe().expect("own exe");
    let me = std::fs::canonicalize(&me).unwrap_or(me);
    let mut first_seen: HashMap<i32, Instant> = HashMap::new();
    let mut hung = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        let kids = unexeced_children(&me);
        first_seen.retain(|pid, _| kids.contains(pid));
        for pid in kids {
            let seen = *first_seen.entry(pid).or_insert(now);
            if now.duration_since(seen) >= HUNG_AFTER {
                let wchan =
                    std::fs::read_to_string(format!("/proc/{pid}/wchan")).unwrap_or_default();
                let syscall =
                    std::fs::read_to_string(format!("/proc/{pid}/syscall")).unwrap_or_default();
                hung.push(format!(
                    "child {pid}: unexec'd for {HUNG_AFTER:?} (wchan {wchan}, syscall {})",
                    syscall.trim()
                ));
                if std::env::var_os("FERROPROF_SPAWN_GDB").is_some() {
                    // Where it hangs, for whoever debugs a failure.
                    let bt = std::process::Command::new("gdb")
                        .args([
                            "-p",
                            &pid.to_string(),
                            "-batch",
                            "-ex",
                            "thread apply all bt 25",
                        ])
                        .output();
                    if let Ok(o) = bt {
                        eprintln!("child {pid}:\n{}", String::from_utf8_lossy(&o.stdout));
                    }
                }
                // SAFETY: kills our own hung child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
                first_seen.remove(&pid);
            }
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    hung
}

/// Spawns `n` children (`true`, through the fork path); returns how many ran to a status.
#[inline(never)]
fn spawner(n: u64, done: &AtomicU64) -> Result<u64, String> {
    let mut ok = 0;
    for _ in 0..n {
        let mut cmd = std::process::Command::new("true");
        // SAFETY: the hook does nothing; its presence makes std fork and exec.
        unsafe { cmd.pre_exec(|| Ok(())) };
        match cmd.status() {
            Ok(s) if s.success() => ok += 1,
            Ok(s) => return Err(format!("a child of the spawner ended with {s}")),
            Err(e) => return Err(format!("spawn failed: {e}")),
        }
        done.fetch_add(1, Ordering::Relaxed);
    }
    Ok(ok)
}

/// Forks `n` children that allocate (every other one) and `_exit`; each waited for with a
/// deadline.
#[inline(never)]
fn raw_forker(n: u64, done: &AtomicU64) -> Result<u64, String> {
    let mut ok = 0;
    for i in 0..n {
        // SAFETY: the child allocates through the sampling allocator and leaves with _exit; it
        // runs no code of the test harness.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(format!("fork failed: {}", std::io::Error::last_os_error()));
        }
        if pid == 0 {
            if i % 2 == 0 {
                let v: Vec<Vec<u8>> = (0..64).map(|k| vec![k as u8; 1024]).collect();
                std::hint::black_box(v);
            }
            // SAFETY: leaves the child at once, without the harness's exit path.
            unsafe { libc::_exit(0) };
        }
        let start = Instant::now();
        let mut status = 0;
        loop {
            // SAFETY: polls our own child.
            let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if r == pid {
                break;
            }
            if start.elapsed() > HUNG_AFTER + Duration::from_secs(5) {
                // The watchdog kills it first; this is the backstop.
                // SAFETY: kills our own child.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        if libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 {
            ok += 1;
        }
        done.fetch_add(1, Ordering::Relaxed);
    }
    Ok(ok)
}

#[test]
fn concurrent_forks_under_load_never_leave_a_child_hung() {
    let dir = temp_dir("spawn-storm");
    let guard = Profiler::builder()
        .cpu_hz(250)
        .alloc_interval_bytes(4096)
        .period(Duration::from_millis(100))
        .profiles(Profiles::all())
        .output_dir(&dir)
        .start()
        .expect("profiler starts");
    let stop = Arc::new(AtomicBool::new(false));
    let mut busy = Vec::new();
    for i in 0..2u64 {
        let stop = stop.clone();
        busy.push(std::thread::spawn(move || {
            std::hint::black_box(churn(&stop, 0x9e37_79b9 + i));
        }));
    }
    {
        let stop = stop.clone();
        busy.push(std::thread::spawn(move || thread_churn(&stop)));
    }
    let watch_stop = Arc::new(AtomicBool::new(false));
    let dog = {
        let s = watch_stop.clone();
        std::thread::spawn(move || watchdog(&s))
    };

    let total = total_forks();
    let per_spawner = total * 2 / 3 / SPAWNERS;
    let raw = total - per_spawner * SPAWNERS;
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut forkers = Vec::new();
    for _ in 0..SPAWNERS {
        let done = done.clone();
        forkers.push(std::thread::spawn(move || spawner(per_spawner, &done)));
    }
    {
        let done = done.clone();
        forkers.push(std::thread::spawn(move || raw_forker(raw, &done)));
    }
    let results: Vec<Result<u64, String>> = forkers
        .into_iter()
        .map(|h| h.join().expect("forking thread"))
        .collect();
    let elapsed = started.elapsed();
    watch_stop.store(true, Ordering::Relaxed);
    let hung = dog.join().expect("watchdog");
    stop.store(true, Ordering::Relaxed);
    for b in busy {
        b.join().expect("busy thread");
    }
    let stats = guard.stats();
    guard.stop().expect("profiler stops");
    let _ = std::fs::remove_dir_all(&dir);

    let ok: u64 = results.iter().filter_map(|r| r.as_ref().ok()).sum();
    let errors: Vec<&String> = results.iter().filter_map(|r| r.as_ref().err()).collect();
    println!(
        "spawn storm: {} forks in {elapsed:.1?}, {ok} clean exits, {} hung, {} alloc samples, {} cpu samples",
        done.load(Ordering::Relaxed),
        hung.len(),
        stats.alloc_samples,
        stats.cpu_samples
    );
    assert!(hung.is_empty(), "hung children: {hung:#?}");
    assert!(errors.is_empty(), "{errors:#?}");
    assert_eq!(ok, total, "every child exited cleanly");
    assert!(
        stats.alloc_samples > 0,
        "allocations were sampled meanwhile"
    );
}
