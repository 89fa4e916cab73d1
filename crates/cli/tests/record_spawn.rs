//! `ferroprof record`: `exit()` from a signal handler, and children started through
//! `posix_spawn`, `system()` and `popen()` (and what uses them: Rust's `Command`, Python's
//! `subprocess`) with an environment lacking the preload library. The C program is
//! tests/fixtures/spawn_fixture.c, compiled with gcc here.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

mod common;
use common::*;

/// The C fixture, compiled once, with frame pointers and debug info.
fn fixture() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        let out = kept_dir("cc").join("spawn_fixture");
        gcc(
            "spawn_fixture.c",
            &out,
            &["-O1", "-g", "-fno-omit-frame-pointer", "-pthread"],
        );
        out
    })
}

/// `ferroprof record -o DIR -- program args`, in a process group of its own, killed (the
/// whole group) when it has not ended within `limit`: then None.
fn record_within(dir: &Path, program: &Path, args: &[&str], limit: Duration) -> Option<Output> {
    let child = Command::new(BIN)
        .env("FERROPROF_PRELOAD", preload())
        .args(["record", "-o", dir.to_str().unwrap(), "--"])
        .arg(program)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .expect("run ferroprof record");
    let pid = child.id() as libc::pid_t;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => Some(out.expect("wait for ferroprof record")),
        Err(_) => {
            // SAFETY: kill(2) of the process group this test started (its leader's pid).
            unsafe { libc::kill(-pid, libc::SIGKILL) };
            let _ = rx.recv_timeout(Duration::from_secs(10));
            None
        }
    }
}

fn record(dir: &Path, program: &Path, args: &[&str]) -> Output {
    let out = record_within(dir, program, args, Duration::from_secs(120))
        .unwrap_or_else(|| panic!("record -- {} {args:?} did not end", program.display()));
    assert!(
        out.status.success(),
        "record -- {} {args:?}: {}\n{}\n{}",
        program.display(),
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    out
}

/// `exit()` from a `SIGALRM` handler that interrupts `malloc`, `free` or the profiler's own
/// recording (which then hold their locks): the exit handlers run from the handler, and
/// writing the profile there would wait for those locks for ever. Every run must end at once.
/// (With the profile written regardless, 8 runs of 16 hung.)
#[test]
fn exit_from_a_signal_handler_ends_the_program_at_once() {
    let dir = work_dir("signal-exit");
    let started = Instant::now();
    for run in 0..16 {
        let out = record_within(&dir, fixture(), &["signal-exit"], Duration::from_secs(10))
            .unwrap_or_else(|| {
                panic!(
                    "run {run}: the program hung in exit() called from its signal handler \
                 (killed after 10 s)"
                )
            });
        assert!(
            out.status.success(),
            "run {run}: {}\n{}",
            out.status,
            text(&out.stderr)
        );
    }
    eprintln!("16 runs in {:?}", started.elapsed());
}

/// The Rust fixture (tests/fixtures/spawn_env_clear.rs), compiled once with rustc.
fn rust_fixture() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        let out = kept_dir("rustc").join("spawn_env_clear");
        rustc("spawn_env_clear.rs", &out, &["--edition", "2021"]);
        out
    })
}

/// `record -- program args`, whose descendant ran the fixture's `spin` (it printed
/// `child_pid=PID`): that child wrote a profile of its own, with CPU time in its spin.
fn child_is_profiled(what: &str, program: &Path, args: &[&str]) -> String {
    let dir = work_dir(what);
    let out = record(&dir, program, args);
    let stdout = text(&out.stdout);
    let pid: i32 = stdout
        .split_whitespace()
        .find_map(|w| w.strip_prefix("child_pid="))
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("{what}: the child did not run: {stdout}"));
    let files = profiles(&dir);
    let mine: Vec<&PathBuf> = files.iter().filter(|f| f.0 == pid).map(|f| &f.1).collect();
    assert!(
        !mine.is_empty(),
        "{what}: no profile of the child (pid {pid}): {files:?}\n{stdout}\n{}",
        text(&out.stderr)
    );
    let cpu: i64 = mine
        .iter()
        .map(|f| {
            let p = ferroprof_pprof::decode(&std::fs::read(f).unwrap()).expect("a pprof profile");
            through(&p, "cpu-time", "spawn_child_spin")
        })
        .sum();
    assert!(
        cpu > 0,
        "{what}: no CPU time in the child's spawn_child_spin: {mine:?}"
    );
    stdout
}

/// `posix_spawn` and `posix_spawnp` with an environment of the program's own (only `PATH`).
#[test]
fn posix_spawn_with_an_environment_lacking_ld_preload_is_profiled() {
    child_is_profiled("posix-spawn", fixture(), &["posix-spawn"]);
    child_is_profiled("posix-spawnp", fixture(), &["posix-spawnp"]);
}

/// Rust's `Command::env_clear`: std spawns with `posix_spawnp` and an empty environment.
#[test]
fn rust_command_env_clear_child_is_profiled() {
    child_is_profiled(
        "rust-env-clear",
        rust_fixture(),
        &[fixture().to_str().unwrap()],
    );
}

/// Python's `subprocess.run(..., env={})`, the default way (fork and exec) and through
/// `posix_spawn` (which subprocess uses when `close_fds=False`).
#[test]
fn python_subprocess_with_an_empty_env_child_is_profiled() {
    for (what, close_fds) in [("python-env", "True"), ("python-env-spawn", "False")] {
        let script = format!(
            "import subprocess, sys; \
             subprocess.run([sys.argv[1], 'spin'], env={{}}, close_fds={close_fds}, check=True)"
        );
        child_is_profiled(
            what,
            Path::new("/usr/bin/python3"),
            &["-c", &script, fixture().to_str().unwrap()],
        );
    }
}

/// `system()` and `popen()` after the program removed `LD_PRELOAD` from its environment
/// (reading from and writing to the `popen` child), with their statuses.
#[test]
fn system_and_popen_after_unsetenv_are_profiled() {
    let out = child_is_profiled("system", fixture(), &["system"]);
    assert!(out.contains("system_status=0"), "{out}");
    for mode in ["popen", "popen-w"] {
        let out = child_is_profiled(mode, fixture(), &[mode]);
        assert!(out.contains("pclose_status=0"), "{mode}: {out}");
    }
}

/// What `system()` done by the library keeps of glibc's: the shell's exit status, and
/// `SIGINT` and `SIGQUIT` ignored by the caller while it waits.
#[test]
fn system_after_unsetenv_keeps_its_status_and_signals() {
    let dir = work_dir("system-status");
    for (mode, status) in [("system-status", 3), ("system-signals", 0)] {
        let out = text(&record(&dir, fixture(), &[mode]).stdout);
        assert!(
            out.contains(&format!("system_status={status}")),
            "{mode}: {out}"
        );
    }
}

/// A child forked while another thread is inside `popen` (whose streams the library keeps
/// under a lock when it runs `popen` itself) calls `popen` and `pclose`: it must never wait on
/// that lock, which no thread of the child would release. 200 forks, all ending at once.
/// (With a plain mutex, the run hung.) The limit only tells a hang from a slow run: the 400
/// profiled processes of this unoptimized build take about a minute of wall time on a slow
/// 2-core host (each spends some 0.3 s of CPU starting and exporting its profiler).
#[test]
fn a_child_forked_during_popen_can_popen() {
    let dir = work_dir("popen-fork");
    let out = record_within(&dir, fixture(), &["popen-fork"], Duration::from_secs(240))
        .expect("a forked child hung on popen's lock (killed after 240 s)");
    assert!(
        out.status.success() && text(&out.stdout).contains("forks=200"),
        "{}\n{}\n{}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
}
