//! Helpers of the `record` tests (record.rs, record_spawn.rs, record_cpu.rs): the binary, the
//! preload library built next to it, scratch directories and the profiles a run wrote.

// Each test file uses its own subset.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

pub const BIN: &str = env!("CARGO_BIN_EXE_ferroprof");

/// The preload library next to the binary, built (once per test run) when missing or stale:
/// `cargo test -p ferroprof-cli` alone does not build it.
pub fn preload() -> &'static Path {
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

/// An empty scratch directory of this test binary's, named `name`: removed when the test
/// passes, left in place (for its files) when it fails. Some hold a copy of the CLI (100 MB in
/// a debug build), so leaving every one behind fills the disk run after run.
pub fn work_dir(name: &str) -> WorkDir {
    WorkDir(fresh_dir(name))
}

/// A scratch directory like [`work_dir`]'s that stays after the test: for what a test binary
/// builds once and its tests share (fixtures), and for helpers that return paths into it.
pub fn kept_dir(name: &str) -> PathBuf {
    fresh_dir(name)
}

/// `name` under the temporary directory, this test binary's and process's, emptied.
fn fresh_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "ferroprof-{}-{}-{name}",
        env!("CARGO_CRATE_NAME"),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// See [`work_dir`].
pub struct WorkDir(PathBuf);

impl std::ops::Deref for WorkDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for WorkDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<std::ffi::OsStr> for WorkDir {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_os_str()
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `<command>.<pid>.<n>.pprof` files in `dir`: (pid, path).
pub fn profiles(dir: &Path) -> Vec<(i32, PathBuf)> {
    let mut v: Vec<(i32, PathBuf)> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter_map(|p| {
            let name = p.file_name()?.to_str()?.to_owned();
            let stem = name.strip_suffix(".pprof")?;
            let mut parts = stem.rsplitn(3, '.');
            let _n: u32 = parts.next()?.parse().ok()?;
            let pid: i32 = parts.next()?.parse().ok()?;
            Some((pid, p))
        })
        .collect();
    v.sort();
    v
}

/// Compiles tests/fixtures/`src` into `out` with gcc and `flags`.
pub fn gcc(src: &str, out: &Path, flags: &[&str]) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(src);
    let o = Command::new("gcc")
        .arg("-o")
        .arg(out)
        .arg(&src)
        .args(flags)
        .output()
        .expect("gcc runs (install gcc)");
    assert!(o.status.success(), "gcc failed: {}", text(&o.stderr));
}

/// Compiles tests/fixtures/`src` into `out` with rustc (`$RUSTC`, else `rustc`) and `flags`.
pub fn rustc(src: &str, out: &Path, flags: &[&str]) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(src);
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned());
    let o = Command::new(rustc)
        .args(flags)
        .arg("-o")
        .arg(out)
        .arg(&src)
        .output()
        .expect("rustc runs");
    assert!(o.status.success(), "rustc failed: {}", text(&o.stderr));
}

/// Sum of `type_name` over the samples whose stack passes through `function`.
pub fn through(p: &ferroprof_pprof::Profile, type_name: &str, function: &str) -> i64 {
    let i = p
        .value_index(type_name)
        .unwrap_or_else(|| panic!("no {type_name} in the profile"));
    p.sample
        .iter()
        .filter(|s| p.stack_names(s).iter().any(|n| n == function))
        .map(|s| s.value[i])
        .sum()
}

/// The number the program printed as `key=N`.
pub fn field<T: std::str::FromStr>(stdout: &str, key: &str) -> T {
    stdout
        .split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key}= in {stdout:?}"))
}
