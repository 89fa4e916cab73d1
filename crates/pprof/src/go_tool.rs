//! Running `go tool pprof` on our output: the reference reader the profiles must satisfy. Used by
//! the test suites of several crates, so the policy for a missing `go` lives in one place.

use std::path::{Path, PathBuf};
use std::process::Command;

/// `go` on `PATH`, if any.
pub fn find_go() -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("go"))
            .find(|p| p.is_file())
    })
}

/// For test harnesses: `go` when installed. Under `CI` a missing `go` panics (CI installs it via
/// `scripts/test-deps.sh`, so its absence is a setup bug); elsewhere the caller skips, loudly.
pub fn go_for_tests() -> Option<PathBuf> {
    let found = find_go();
    if found.is_none() {
        if std::env::var_os("CI").is_some() {
            panic!("go is not installed (CI must run scripts/test-deps.sh)");
        }
        eprintln!(
            "\n*** SKIPPING go tool pprof test: go not installed; run `. scripts/test-deps.sh` ***\n"
        );
    }
    found
}

/// Runs `go tool pprof ARGS` with a private HOME, temp and build-cache directory (so it neither
/// reads nor writes the user's). Returns stdout, or a message with the status and stderr.
pub fn go_tool_pprof(go: &Path, args: &[&str]) -> Result<String, String> {
    let tmp = std::env::temp_dir().join(format!("ferroprof-gopprof-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).map_err(|e| format!("cannot create {}: {e}", tmp.display()))?;
    let out = Command::new(go)
        .arg("tool")
        .arg("pprof")
        .args(args)
        .env("PPROF_TMPDIR", &tmp)
        .env("HOME", &tmp)
        .env("GOCACHE", tmp.join("gocache"))
        .env("GOFLAGS", "")
        .output()
        .map_err(|e| format!("cannot run {}: {e}", go.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if out.status.success() {
        Ok(stdout)
    } else {
        Err(format!(
            "go tool pprof {args:?} failed ({}): {}\n{stdout}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

/// For test harnesses: [`go_tool_pprof`], panicking with its message on failure.
pub fn pprof_for_tests(go: &Path, args: &[&str]) -> String {
    go_tool_pprof(go, args).unwrap_or_else(|e| panic!("{e}"))
}
