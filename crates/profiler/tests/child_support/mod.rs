//! Runs a test's body in a child process (the test binary itself, filtered to that one test), so
//! a crash fails the test instead of killing the test binary, and a hang is detected.
#![allow(dead_code)]

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Set in the child: run the body instead of spawning.
pub const CHILD_ENV: &str = "FERROPROF_TEST_CHILD";

/// Whether this process is the child running `test`'s body.
pub fn is_child(test: &str) -> bool {
    std::env::var(CHILD_ENV).is_ok_and(|v| v == test)
}

/// What the child did.
pub struct ChildOutcome {
    pub status: std::process::ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl ChildOutcome {
    /// A `key=value` the child printed on its own line, parsed.
    pub fn value(&self, key: &str) -> Option<u64> {
        // A value may share its line with the harness's "test NAME ... ".
        self.stdout
            .split_whitespace()
            .find_map(|w| w.strip_prefix(key)?.strip_prefix('=')?.parse().ok())
    }

    pub fn describe(&self) -> String {
        use std::os::unix::process::ExitStatusExt;
        format!(
            "status {:?} (signal {:?})\n--- stdout\n{}\n--- stderr\n{}",
            self.status.code(),
            self.status.signal(),
            self.stdout,
            self.stderr
        )
    }
}

/// Runs `test` (its full name as the harness knows it) in a child with `envs`; kills it and
/// panics after `limit` (a hang).
pub fn run_child(test: &str, envs: &[(&str, &str)], limit: Duration) -> ChildOutcome {
    let exe = std::env::current_exe().expect("test binary path");
    let mut cmd = Command::new(exe);
    cmd.args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, test)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("spawn the child test process");
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let t_out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let t_err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let end = Instant::now() + limit;
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait for the child") {
            break st;
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            panic!("child {test} did not finish within {limit:?}: hang");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    ChildOutcome {
        status,
        stdout: t_out.join().unwrap_or_default(),
        stderr: t_err.join().unwrap_or_default(),
    }
}

/// Compiles `tests/fixtures/<name>.c` into a shared library in `dir` with the system C
/// compiler; its path.
pub fn build_c_library(name: &str, dir: &std::path::Path) -> std::path::PathBuf {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(format!("{name}.c"));
    let out = dir.join(format!("lib{name}.so"));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let st = Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&out)
        .arg(&src)
        .status()
        .unwrap_or_else(|e| panic!("run {cc} to build {}: {e}", src.display()));
    assert!(st.success(), "{cc} failed on {}", src.display());
    out
}
