//! `ferroprof record`: `exit()` from a signal handler, and children started through
//! `posix_spawn`, `system()` and `popen()` (and what uses them: Rust's `Command`, Python's
//! `subprocess`) with an environment lacking the preload library. The C program is
//! tests/fixtures/spawn_fixture.c, compiled with gcc here.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_ferroprof");

/// The preload library next to the binary, built (once per test run) when missing or stale:
/// `cargo test -p ferroprof-cli` alone does not build it. (As in record.rs.)
fn preload() -> &'static Path {
    static LIB: OnceLock<PathBuf> = OnceLock::new();
    LIB.get_or_init(|| {
        let bin_dir = Path::new(BIN).parent().expect("the binary's directory");
        let lib = bin_dir.join("libferroprof_preload.so");
        let release = bin_dir.file_name().is_some_and(|n| n == "release");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
        let mut build = Command::new(cargo);
        build.args(["build", "-q", "-p", "ferroprof-preload"]);
        if release {
            build.arg("--release");
        }
        let status = build
            .status()
            .expect("run cargo build -p ferroprof-preload");
        assert!(status.success(), "cargo build -p ferroprof-preload failed");
        assert!(lib.is_file(), "{} was not built", lib.display());
        lib
    })
}

fn work_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ferroprof-spawn-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// The C fixture, compiled once, with frame pointers and debug info.
fn fixture() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/spawn_fixture.c");
        let out = work_dir("cc").join("spawn_fixture");
        let o = Command::new("gcc")
            .args(["-O1", "-g", "-fno-omit-frame-pointer", "-pthread", "-o"])
            .arg(&out)
            .arg(&src)
            .output()
            .expect("gcc runs (install gcc)");
        assert!(o.status.success(), "gcc failed: {}", text(&o.stderr));
        out
    })
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
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
