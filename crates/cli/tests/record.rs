//! `ferroprof record -- CMD`: a C program of known allocations (tests/fixtures/record_fixture.c,
//! compiled with gcc here) profiled through the preload library, its children, its ways of
//! ending, and the programs `record` must refuse.
//!
//! Accuracy bounds come from the sampling statistics: with a mean interval `I` between sampled
//! bytes, the estimate of `T` bytes has a standard deviation of at most `sqrt(T * I)` (each
//! allocation of `s` bytes contributes `s^2 (1-p)/p <= s * I` to the variance). The workloads are
//! sized so that the required 5% (allocated) and 10% (live) are beyond 5 standard deviations.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

mod common;
use common::*;

/// The fixture, compiled once: with frame pointers and debug info, as a C program built for
/// profiling would be. `static_link`: a statically linked build (the refused case).
fn fixture(static_link: bool) -> &'static Path {
    static DYNAMIC: OnceLock<PathBuf> = OnceLock::new();
    static STATIC: OnceLock<PathBuf> = OnceLock::new();
    let cell = if static_link { &STATIC } else { &DYNAMIC };
    cell.get_or_init(|| {
        let dir = kept_dir(if static_link { "cc-static" } else { "cc" });
        let out = dir.join("record_fixture");
        let mut flags = vec!["-O1", "-g", "-fno-omit-frame-pointer", "-pthread", "-ldl"];
        if static_link {
            flags.push("-static");
        }
        gcc("record_fixture.c", &out, &flags);
        out
    })
}

fn record(opts: &[&str], program: &Path, args: &[&str]) -> Output {
    Command::new(BIN)
        .env("FERROPROF_PRELOAD", preload())
        .arg("record")
        .args(opts)
        .arg("--")
        .arg(program)
        .args(args)
        .output()
        .expect("run ferroprof record")
}

fn load(path: &Path) -> ferroprof_pprof::Profile {
    ferroprof_pprof::decode(&std::fs::read(path).unwrap()).expect("a pprof profile")
}

#[test]
fn allocated_and_live_bytes_match_the_programs_own_count() {
    const INTERVAL: u64 = 16 << 10;
    let dir = work_dir("alloc");
    let out = record(
        &[
            "--alloc-interval",
            "16K",
            "--profiles",
            "alloc,heap",
            "-o",
            dir.to_str().unwrap(),
        ],
        fixture(false),
        &["alloc", "256", "64"],
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    let churned: u64 = field(&stdout, "churn_bytes");
    let live: u64 = field(&stdout, "live_bytes");
    let files = profiles(&dir);
    assert_eq!(
        files.len(),
        1,
        "one process, one profile: {files:?}\n{stdout}"
    );
    assert!(stdout.contains(files[0].1.to_str().unwrap()), "{stdout}");
    let p = load(&files[0].1);

    let check = |what: &str, truth: u64, found: i64, max_rel: f64| {
        let sigma = (truth as f64 * INTERVAL as f64).sqrt();
        // The bound required holds beyond 5 standard deviations of the sampling error.
        assert!(
            truth as f64 * max_rel >= 5.0 * sigma,
            "{what}: workload too small"
        );
        let rel = found as f64 / truth as f64 - 1.0;
        assert!(
            rel.abs() <= max_rel,
            "{what}: {found} estimated, {truth} true ({:+.2}%, sigma {:.2}%)",
            rel * 100.0,
            sigma / truth as f64 * 100.0
        );
    };
    // Every C entry point is used by the churn (malloc, calloc, posix_memalign, aligned_alloc,
    // memalign, realloc); the live set through malloc and calloc.
    check(
        "alloc-space in fixture_churn",
        churned,
        through(&p, "alloc-space", "fixture_churn"),
        0.05,
    );
    check(
        "alloc-space in fixture_churn and fixture_keep_live",
        churned + live,
        through(&p, "alloc-space", "fixture_churn")
            + through(&p, "alloc-space", "fixture_keep_live"),
        0.05,
    );
    check(
        "heap-live-size in fixture_keep_live",
        live,
        through(&p, "heap-live-size", "fixture_keep_live"),
        0.10,
    );
    // Freed blocks leave the live heap.
    let churn_live = through(&p, "heap-live-size", "fixture_churn");
    assert_eq!(churn_live, 0, "fixture_churn frees all it allocates");
    // Stacks start at the allocating code: the interposed malloc is not the leaf.
    let i = p.value_index("alloc-space").unwrap();
    let leaf_malloc = p
        .sample
        .iter()
        .filter(|s| s.value[i] > 0)
        .filter(|s| p.stack_names(s).first().is_some_and(|n| n == "malloc"))
        .count();
    assert_eq!(leaf_malloc, 0, "malloc frames left on allocation stacks");
}

/// The estimated peak of the live heap `record` prints: a program holds 64 MiB at its peak,
/// frees it, then ends holding 32 MiB.
#[test]
fn peak_live_heap_is_estimated_within_the_sampling_error() {
    const INTERVAL: u64 = 16 << 10;
    let dir = work_dir("peak");
    let out = record(
        &[
            "--alloc-interval",
            "16K",
            "--profiles",
            "heap",
            "-o",
            dir.to_str().unwrap(),
        ],
        fixture(false),
        &["peak", "64", "32"],
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    let truth: u64 = field(&stdout, "peak_bytes");
    let line = stdout
        .lines()
        .find(|l| l.starts_with("peak live heap ≈ "))
        .unwrap_or_else(|| panic!("no peak line in {stdout}"));
    let found: u64 = line
        .split_once('(')
        .and_then(|(_, rest)| rest.split_once(" bytes"))
        .and_then(|(n, _)| n.parse().ok())
        .unwrap_or_else(|| panic!("no byte count in {line:?}"));
    // While the program allocates its peak set and frees nothing, the estimate only grows: its
    // largest value is the estimate of the whole set (the frees then take back exactly what
    // each tracked block added, and the 32 MiB after stay far below). So the peak carries the
    // sampling error of an estimate of `truth` bytes: a standard deviation of at most
    // sqrt(truth x interval), 1 MiB (1.6%) here. 10% is beyond 6 of them: never a flake. A
    // peak that never took frees back reads 96 MiB (+51%); one summing the sampled sizes
    // without their weights reads 17% low (the large blocks, weight ~1, are most of the bytes).
    let sigma = (truth as f64 * INTERVAL as f64).sqrt();
    let rel = found as f64 / truth as f64 - 1.0;
    assert!(truth as f64 * 0.10 >= 6.0 * sigma, "workload too small");
    assert!(
        rel.abs() <= 0.10,
        "peak: {found} estimated, {truth} true ({:+.2}%, sigma {:.2}%)\n{stdout}",
        rel * 100.0,
        sigma / truth as f64 * 100.0
    );
}

#[test]
fn forked_and_execd_children_write_their_own_profiles() {
    let dir = work_dir("fork");
    let out = record(
        &[
            "--profiles",
            "alloc,heap",
            "--alloc-interval",
            "64K",
            "-o",
            dir.to_str().unwrap(),
        ],
        fixture(false),
        &["fork"],
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    let files = profiles(&dir);
    let pids: std::collections::BTreeSet<i32> = files.iter().map(|f| f.0).collect();
    // The command, its forked child (no exec) and its exec'd child.
    assert_eq!(pids.len(), 3, "{files:?}\n{stdout}");
    assert!(stdout.contains("from 3 process(es)"), "{stdout}");
    for (pid, f) in &files {
        assert!(
            stdout.contains(f.to_str().unwrap()),
            "{} not listed",
            f.display()
        );
        // Each keeps 8 MiB live in fixture_keep_live (the exec'd one as mode "leaf").
        let live = through(&load(f), "heap-live-size", "fixture_keep_live");
        assert!(
            (4 << 20..16 << 20).contains(&live),
            "pid {pid}: {live} bytes live in fixture_keep_live, about 8 MiB expected"
        );
    }
}

/// Runs the fixture in an exec `mode` at 64 KiB (cpu and heap); returns `record`'s stdout and
/// the profiles, which must all be the command's (an exec keeps the pid), in the order written.
fn record_exec(mode: &str) -> (String, Vec<PathBuf>) {
    let (stdout, files) = record_cpu_heap(mode);
    // `<command>.<pid>.<n>.pprof`, one pid: by n.
    let mut files: Vec<PathBuf> = files.into_iter().map(|f| f.1).collect();
    let n = |p: &PathBuf| -> u32 {
        let name = p.file_stem().unwrap().to_str().unwrap();
        name.rsplit('.').next().unwrap().parse().unwrap()
    };
    files.sort_by_key(n);
    (stdout, files)
}

/// Runs the fixture in `mode` at 64 KiB (cpu and heap); returns `record`'s stdout and the
/// profiles (pid, path), each listed in that output.
fn record_cpu_heap(mode: &str) -> (String, Vec<(i32, PathBuf)>) {
    let dir = kept_dir(mode);
    let out = record(
        &[
            "--profiles",
            "cpu,heap",
            "--alloc-interval",
            "64K",
            "-o",
            dir.to_str().unwrap(),
        ],
        fixture(false),
        &[mode],
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    let files = profiles(&dir);
    for (_, f) in &files {
        assert!(
            stdout.contains(f.to_str().unwrap()),
            "{} not listed: {stdout}",
            f.display()
        );
    }
    (stdout, files)
}

/// `profile` has CPU time and about 8 MiB live through `own` (the fixture function of one
/// image or phase), and nothing through any of `others`.
fn only_through(profile: &Path, own: &str, others: &[&str]) {
    let p = load(profile);
    let shown = profile.display();
    assert!(
        through(&p, "cpu-time", own) > 0,
        "{shown}: no CPU time in {own}"
    );
    let live = through(&p, "heap-live-size", own);
    assert!(
        (4 << 20..16 << 20).contains(&live),
        "{shown}: {live} bytes live through {own}, about 8 MiB expected"
    );
    for other in others {
        assert_eq!(
            through(&p, "cpu-time", other),
            0,
            "{shown}: CPU time in {other}"
        );
        assert_eq!(
            through(&p, "heap-live-size", other),
            0,
            "{shown}: live in {other}"
        );
    }
}

/// A program that execs (here: itself, so the same pid and command name) writes the profile of
/// what it did before, and the new image writes its own, under a name not yet taken.
#[test]
fn a_program_that_execs_writes_its_profile_and_the_new_image_its_own() {
    let (stdout, files) = record_exec("exec-l");
    assert_eq!(files.len(), 2, "{files:?}\n{stdout}");
    only_through(&files[0], "fixture_before_exec", &["fixture_after_exec"]);
    only_through(&files[1], "fixture_after_exec", &["fixture_before_exec"]);
}

/// An exec into a program of another name (here a copy of the fixture, `zz_fixture`, whose
/// name sorts after the first one's): `record` counts one process, and the command's last
/// profile (moved to `-o FILE`, shown in the tables) is the last image's.
#[test]
fn the_commands_last_profile_is_its_last_images() {
    let dir = work_dir("exec-renamed");
    let copy = dir.join("zz_fixture");
    std::fs::copy(fixture(false), &copy).unwrap();
    let file = dir.join("out.pprof");
    let out = record(
        &[
            "--profiles",
            "cpu,heap",
            "--alloc-interval",
            "64K",
            "-o",
            file.to_str().unwrap(),
        ],
        fixture(false),
        &["exec-l", copy.to_str().unwrap()],
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(
        stdout.contains("profiles: 2 from 1 process(es)"),
        "{stdout}"
    );
    only_through(&file, "fixture_after_exec", &["fixture_before_exec"]);
    let before = profiles(&dir);
    assert_eq!(before.len(), 1, "{before:?}\n{stdout}");
    assert!(
        before[0]
            .1
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("record_fixture."),
        "{before:?}"
    );
    only_through(&before[0].1, "fixture_before_exec", &["fixture_after_exec"]);
}

/// A shell script that runs a program, then `exec`s another: the shell writes its own profile
/// before the exec, and the program it becomes writes its own under the same pid.
#[test]
fn a_shell_script_that_execs_keeps_both_profiles() {
    let dir = work_dir("sh-exec");
    let fx = fixture(false).to_str().unwrap();
    let script = format!("'{fx}' leaf; exec '{fx}' after-exec");
    let out = record(
        &[
            "--profiles",
            "cpu,heap",
            "--alloc-interval",
            "64K",
            "-o",
            dir.to_str().unwrap(),
        ],
        Path::new("/bin/sh"),
        &["-c", &script],
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    let files = profiles(&dir);
    // The shell's pid: its own profile and the exec'd fixture's; the `leaf` child: one.
    let mut by_pid: std::collections::BTreeMap<i32, Vec<PathBuf>> = Default::default();
    for (pid, f) in &files {
        by_pid.entry(*pid).or_default().push(f.clone());
    }
    assert_eq!(by_pid.len(), 2, "{files:?}\n{stdout}");
    assert!(stdout.contains("from 2 process(es)"), "{stdout}");
    let shell = by_pid
        .values()
        .find(|v| v.len() == 2)
        .unwrap_or_else(|| panic!("no pid with two profiles: {files:?}"));
    let name = |p: &PathBuf| p.file_name().unwrap().to_str().unwrap().to_owned();
    let (sh, after): (Vec<_>, Vec<_>) = shell.iter().partition(|p| name(p).starts_with("sh."));
    assert_eq!((sh.len(), after.len()), (1, 1), "{shell:?}");
    load(sh[0]); // a profile, though a shell that waited does little
    only_through(after[0], "fixture_after_exec", &["fixture_before_exec"]);
}

/// An exec with an environment without LD_PRELOAD and the settings: the new image is profiled
/// all the same.
#[test]
fn an_exec_with_an_environment_lacking_ld_preload_is_still_profiled() {
    // A small environment (fixed up on the stack) and a large one (in a mapping), through
    // execve, fexecve, execvpe and execveat (a directory descriptor and a base name); and the
    // process's own, stripped with unsetenv, through execvp.
    for mode in [
        "exec-env",
        "exec-env-big",
        "exec-fd",
        "exec-vpe",
        "exec-at",
        "exec-unset",
    ] {
        let (stdout, files) = record_exec(mode);
        assert_eq!(files.len(), 2, "{mode}: {files:?}\n{stdout}");
        only_through(&files[0], "fixture_before_exec", &["fixture_after_exec"]);
        only_through(&files[1], "fixture_after_exec", &["fixture_before_exec"]);
        // The settings came along: `--profiles cpu,heap`, no allocation profile.
        let new_image = load(&files[1]);
        assert!(new_image.value_index("heap-live-size").is_some());
        assert!(
            new_image.value_index("alloc-space").is_none(),
            "{mode}: the new image ran with the default profiles"
        );
    }
}

/// A child forked while three threads of its parent burn CPU (the profiler's signals and
/// recording under way in them at the fork) execs: the new image writes its own profile under
/// the child's pid, the forked child writes none of its own, and the parent's profile has all
/// it did, threads and after, and nothing of the child's.
#[test]
fn a_child_forked_among_busy_threads_that_execs_is_profiled_apart() {
    let (stdout, files) = record_cpu_heap("exec-threads");
    let pids: std::collections::BTreeSet<i32> = files.iter().map(|f| f.0).collect();
    assert_eq!(pids.len(), 2, "{files:?}\n{stdout}");
    assert_eq!(
        files.len(),
        2,
        "one profile per process: {files:?}\n{stdout}"
    );
    let (parent, child): (Vec<_>, Vec<_>) = files
        .iter()
        .partition(|(_, f)| through(&load(f), "cpu-time", "fixture_thread_burn") > 0);
    assert_eq!((parent.len(), child.len()), (1, 1), "{files:?}");
    only_through(
        &child[0].1,
        "fixture_after_exec",
        &[
            "fixture_before_exec",
            "fixture_thread_burn",
            "fixture_after_fork_exec",
        ],
    );
    let p = load(&parent[0].1);
    for f in ["fixture_before_exec", "fixture_after_fork_exec"] {
        assert!(through(&p, "cpu-time", f) > 0, "parent: no CPU time in {f}");
        let live = through(&p, "heap-live-size", f);
        assert!(
            (4 << 20..16 << 20).contains(&live),
            "parent: {live} bytes live through {f}, about 8 MiB expected"
        );
    }
    assert_eq!(through(&p, "cpu-time", "fixture_after_exec"), 0);
}

/// An exec that fails has written the profile so far; profiling goes on in the process, which
/// writes what it does afterwards at exit.
#[test]
fn a_failed_exec_leaves_the_profiler_working() {
    let (stdout, files) = record_exec("exec-fail");
    assert_eq!(files.len(), 2, "{files:?}\n{stdout}");
    only_through(
        &files[0],
        "fixture_before_exec",
        &["fixture_after_failed_exec"],
    );
    // The blocks kept live before the exec are not in the restarted profiler's heap (see
    // docs/record.md): only the CPU time is checked for them.
    let after = load(&files[1]);
    assert_eq!(through(&after, "cpu-time", "fixture_before_exec"), 0);
    assert!(through(&after, "cpu-time", "fixture_after_failed_exec") > 0);
    let live = through(&after, "heap-live-size", "fixture_after_failed_exec");
    assert!(
        (4 << 20..16 << 20).contains(&live),
        "{live} bytes live through fixture_after_failed_exec, about 8 MiB expected"
    );
}

/// A vfork child shares its parent's memory: its exec must not stop (nor write) the parent's
/// profiler. The parent's one profile covers before and after; the child's image writes its own.
#[test]
fn an_exec_from_a_vfork_child_leaves_the_parents_profiler_alone() {
    let dir = work_dir("vfork");
    let out = record(
        &[
            "--profiles",
            "cpu,heap",
            "--alloc-interval",
            "64K",
            "-o",
            dir.to_str().unwrap(),
        ],
        fixture(false),
        &["vfork"],
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    let files = profiles(&dir);
    assert_eq!(files.len(), 2, "{files:?}\n{stdout}");
    assert_ne!(files[0].0, files[1].0, "{files:?}");
    let (parent, child): (Vec<_>, Vec<_>) = files
        .iter()
        .partition(|(_, f)| through(&load(f), "cpu-time", "fixture_after_vfork") > 0);
    assert_eq!((parent.len(), child.len()), (1, 1), "{files:?}");
    let parent = load(&parent[0].1);
    for f in ["fixture_before_exec", "fixture_after_vfork"] {
        assert!(
            through(&parent, "cpu-time", f) > 0,
            "parent: no CPU time in {f}"
        );
        let live = through(&parent, "heap-live-size", f);
        assert!(
            (4 << 20..16 << 20).contains(&live),
            "parent: {live} live in {f}"
        );
    }
    only_through(&child[0].1, "fixture_after_exec", &["fixture_before_exec"]);
}

#[test]
fn exit_from_another_thread_writes_the_last_profile_to_the_named_file() {
    let dir = work_dir("exit-thread");
    let file = dir.join("out.pprof");
    let out = record(
        &["--alloc-interval", "64K", "-o", file.to_str().unwrap()],
        fixture(false),
        &["exit-thread"],
    );
    let stdout = text(&out.stdout);
    assert_eq!(out.status.code(), Some(3), "the program's status: {stdout}");
    assert!(stdout.contains(file.to_str().unwrap()), "{stdout}");
    let live = through(&load(&file), "heap-live-size", "fixture_keep_live");
    assert!((4 << 20..16 << 20).contains(&live), "{live}");
}

/// `_exit` runs no exit handlers (dash ends so, and so do the workers Python's
/// `multiprocessing` forks): the interposed `_exit` writes the last profile first.
#[test]
fn a_program_ending_with_underscore_exit_writes_its_profile() {
    let dir = work_dir("quick-exit");
    let out = record(
        &["--alloc-interval", "64K", "-o", dir.to_str().unwrap()],
        fixture(false),
        &["quick-exit"],
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    let files = profiles(&dir);
    assert_eq!(files.len(), 1, "{stdout}");
    let p = load(&files[0].1);
    assert!(through(&p, "cpu-time", "fixture_burn") > 0, "{stdout}");
    let live = through(&p, "heap-live-size", "fixture_keep_live");
    assert!((4 << 20..16 << 20).contains(&live), "{live}");
}

/// Runs the fixture in `mode` (a parent and one forked child); the child's profile must hold
/// its CPU time in fixture_child_burn.
fn forked_child_writes_its_profile(mode: &str) {
    let dir = work_dir(mode);
    let out = record(
        &["--alloc-interval", "64K", "-o", dir.to_str().unwrap()],
        fixture(false),
        &[mode],
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    let files = profiles(&dir);
    assert_eq!(files.len(), 2, "{stdout}");
    assert!(
        files
            .iter()
            .any(|(_, f)| through(&load(f), "cpu-time", "fixture_child_burn") > 0),
        "no profile with the child's CPU time: {stdout}"
    );
}

/// A forked worker that ends with `_exit` writes its own profile, with its CPU time.
#[test]
fn a_forked_child_ending_with_underscore_exit_writes_its_profile() {
    forked_child_writes_its_profile("fork-quick-exit");
}

/// A forked worker ended by SIGTERM (a process pool's `terminate`, a server's shutdown): its
/// profiler threads started again, so it flushes on the signal as its parent would, and the
/// signal then takes its course (the fixture's parent returns 1 otherwise).
#[test]
fn a_forked_child_ended_by_sigterm_writes_its_profile() {
    forked_child_writes_its_profile("fork-sigterm");
}

/// `_exit` from a signal handler that interrupted `malloc` (which then holds the allocator's
/// lock): writing a profile there would wait for that lock for ever. The program must end as
/// it asked, every time. (With the profile written regardless, 3 runs of 8 hung.)
#[test]
fn underscore_exit_from_a_signal_handler_ends_the_program_at_once() {
    let dir = work_dir("handler-exit");
    for run in 0..6 {
        let mut child = Command::new(BIN)
            .env("FERROPROF_PRELOAD", preload())
            .args(["record", "-o", dir.to_str().unwrap(), "--"])
            .arg(fixture(false))
            .arg("handler-exit")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("run ferroprof record");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let status = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break Some(st);
            }
            if std::time::Instant::now() > deadline {
                break None;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let Some(status) = status else {
            let _ = Command::new("pkill")
                .args(["-KILL", "-f", "record_fixture handler-exit"])
                .status();
            let _ = child.kill();
            let _ = child.wait();
            panic!("run {run}: the program did not end within 30 s of its _exit");
        };
        assert!(status.success(), "run {run}: {status}");
    }
}

#[test]
fn sigterm_is_forwarded_and_the_program_flushes_before_it_ends() {
    signal_is_forwarded_and_flushed(libc::SIGTERM, "sigterm");
}

/// A closed terminal sends SIGHUP to `record` (and its foreground group): the program still
/// writes its profile, then ends by the signal.
#[test]
fn sighup_is_forwarded_and_the_program_flushes_before_it_ends() {
    signal_is_forwarded_and_flushed(libc::SIGHUP, "sighup");
}

fn signal_is_forwarded_and_flushed(sig: libc::c_int, tag: &str) {
    use std::os::unix::process::CommandExt;
    let dir = work_dir(tag);
    let mut cmd = Command::new(BIN);
    cmd.env("FERROPROF_PRELOAD", preload())
        .args(["record", "-o", dir.to_str().unwrap(), "--"])
        .arg(fixture(false))
        .arg("sigterm")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // The signal's default action, as a terminal gives it: a run started under `nohup` (SIGHUP
    // ignored) or as a background job (SIGINT, SIGQUIT ignored) passes its ignored signals on,
    // and the program would never end.
    // SAFETY: signal() is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            libc::signal(sig, libc::SIG_DFL);
            Ok(())
        })
    };
    let mut child = cmd.spawn().unwrap();
    let pid = child.id() as i32;
    // A deadline: a program that never ends fails the test instead of hanging the suite.
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if done_rx
            .recv_timeout(std::time::Duration::from_secs(120))
            .is_err()
        {
            // SAFETY: our own child, still running after the deadline.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    });
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().expect("a line").unwrap();
    assert_eq!(first, "ready");
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(pid, sig) };
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let status = child.wait().unwrap();
    let _ = done_tx.send(());
    let _ = watchdog.join();
    let stdout = rest.join("\n");
    // 128 + the signal: the program ended by it, as it would have without ferroprof.
    assert_eq!(status.code(), Some(128 + sig), "{stdout}");
    let files = profiles(&dir);
    assert_eq!(files.len(), 1, "{stdout}");
    let p = load(&files[0].1);
    assert!(through(&p, "cpu-time", "fixture_burn") > 0, "{stdout}");
    assert!(through(&p, "heap-live-size", "fixture_keep_live") > 0);
}

#[test]
fn a_program_without_malloc_gets_cpu_and_a_no_allocations_note() {
    let dir = work_dir("noalloc");
    let out = record(&["-o", dir.to_str().unwrap()], fixture(false), &["noalloc"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("no allocations seen"), "{stdout}");
    let files = profiles(&dir);
    assert_eq!(files.len(), 1);
    assert!(through(&load(&files[0].1), "cpu-time", "fixture_burn") > 0);
    // One process: no table of processes.
    assert!(!stdout.contains("CPU time by process"), "{stdout}");
    // Not CPython: no word of pymalloc.
    assert!(!stdout.contains("PYTHONMALLOC"), "{stdout}");
}

/// CPython's small objects come from its own arenas: the summary says so and how to see them
/// (PYTHONMALLOC=malloc), unless that is already set.
#[test]
fn a_python_program_gets_the_pymalloc_note_unless_pythonmalloc_is_malloc() {
    let script = "x = [str(i) * 3 for i in range(200000)]";
    for (pythonmalloc, noted) in [(None, true), (Some("malloc"), false)] {
        let dir = work_dir(&format!("python-{noted}"));
        let mut cmd = Command::new(BIN);
        cmd.env("FERROPROF_PRELOAD", preload())
            .env_remove("PYTHONMALLOC")
            .args([
                "record",
                "-o",
                dir.to_str().unwrap(),
                "--",
                "python3",
                "-c",
                script,
            ]);
        if let Some(v) = pythonmalloc {
            cmd.env("PYTHONMALLOC", v);
        }
        let out = cmd.output().expect("run ferroprof record -- python3");
        let stdout = text(&out.stdout);
        assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
        assert!(!profiles(&dir).is_empty(), "{stdout}");
        assert_eq!(
            stdout.contains("pymalloc") && stdout.contains("PYTHONMALLOC=malloc ferroprof record"),
            noted,
            "PYTHONMALLOC={pythonmalloc:?}: {stdout}"
        );
    }
}

/// A command that hands its work to a child (a shell script, make, git): the top tables are
/// the child's, the one that used the CPU, and the command's own profile is still named (as
/// FILE with `-o FILE`).
#[test]
fn the_tables_are_for_the_process_that_used_the_most_cpu() {
    let dir = work_dir("busiest");
    let fx = fixture(false).to_str().unwrap();
    let file = dir.join("main.pprof");
    // The burner is a child; bash execs the last command, which leaves a profile as the
    // command's. (dash would end with _exit and leave none.)
    let script = format!("'{fx}' noalloc; '{fx}' leaf");
    let out = record(
        &["--profiles", "cpu", "-o", file.to_str().unwrap()],
        Path::new("/bin/bash"),
        &["-c", &script],
    );
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(file.is_file(), "{stdout}");
    let burner = profiles(&dir)
        .into_iter()
        .find(|(_, f)| through(&load(f), "cpu-time", "fixture_burn") > 0)
        .unwrap_or_else(|| panic!("no profile holds fixture_burn: {stdout}"));
    assert!(stdout.contains("CPU time by process:"), "{stdout}");
    let said = format!(
        "the tables below are for record_fixture pid {}, which used the most CPU; the \
         command's own profile: {}",
        burner.0,
        file.display()
    );
    assert!(stdout.contains(&said), "{said}\n{stdout}");
    // The cpu-time table that follows is the burner's.
    let table = &stdout[stdout.find(&said).unwrap()..];
    let burner_shown = format!("{}: cpu-time", burner.1.display());
    assert!(table.contains(&burner_shown), "{burner_shown}\n{stdout}");
    assert!(table.contains("fixture_burn"), "{stdout}");
}

/// glibc's `pthread_getattr_np` allocates while it holds the calling thread's lock; with every
/// allocation sampled, a new thread's first sample lands in there, and the sample's query of
/// the thread's stack bounds (through `pthread_getattr_np`) waited for that lock for ever. The
/// program must finish, its threads' allocations outside that call still sampled.
#[test]
fn a_sample_inside_pthread_getattr_np_does_not_deadlock_the_thread() {
    let dir = work_dir("getattr");
    let mut child = Command::new(BIN)
        .env("FERROPROF_PRELOAD", preload())
        .args([
            "record",
            "--alloc-interval",
            "1",
            "--profiles",
            "alloc",
            "-o",
        ])
        .arg(&dir)
        .arg("--")
        .arg(fixture(false))
        .arg("getattr")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run ferroprof record");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while child.try_wait().expect("wait for record").is_none() {
        if std::time::Instant::now() > deadline {
            // The program is record's child: a kill of the group would take the test with it.
            let _ = Command::new("pkill")
                .args(["-KILL", "-f", "record_fixture getattr"])
                .status();
            let _ = child.kill();
            let _ = child.wait();
            panic!("the program hung in pthread_getattr_np (60 s)");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("record's output");
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    assert!(stdout.contains("getattr ok"), "{stdout}");
    assert_eq!(profiles(&dir).len(), 1, "{stdout}");
}

fn refused(out: &Output) -> String {
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stdout));
    text(&out.stderr)
}

#[test]
fn programs_preload_cannot_reach_are_refused_with_the_reason() {
    let dir = work_dir("limits");
    let o = dir.to_str().unwrap();
    let err = refused(&record(
        &["-o", o],
        Path::new("no-such-command-ferroprof"),
        &[],
    ));
    assert!(err.contains("command not found"), "{err}");

    let out = Command::new(BIN)
        .args(["record", "-o", o, "--"])
        .output()
        .unwrap();
    assert!(refused(&out).contains("no command to run"));

    let err = refused(&record(&["-o", o], fixture(true), &["noalloc"]));
    assert!(err.contains("statically linked"), "{err}");
    assert!(err.contains("CPU and wall"), "{err}");

    // Secure mode needs a set-user-ID file owned by someone else: only root can make one.
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        let suid = dir.join("suid-fixture");
        std::fs::copy(fixture(false), &suid).unwrap();
        let c = std::ffi::CString::new(suid.to_str().unwrap()).unwrap();
        // SAFETY: a valid path; nobody's uid/gid (65534).
        assert_eq!(unsafe { libc::chown(c.as_ptr(), 65534, 65534) }, 0);
        // SAFETY: as above.
        assert_eq!(unsafe { libc::chmod(c.as_ptr(), 0o4755) }, 0);
        // AT_SECURE is set whenever exec changes the effective uid, for root too.
        let err = refused(&record(&["-o", o], &suid, &["noalloc"]));
        assert!(
            err.contains("setuid") && err.contains("LD_PRELOAD"),
            "{err}"
        );
    } else {
        eprintln!("not root: the setuid case is not exercised");
    }
    assert!(profiles(&dir).is_empty(), "nothing was run");
}

/// The load-time check: loaded with `dlopen` (its TLS then outside the static TLS block), the
/// library says why it does not profile and leaves the program alone.
#[test]
fn a_library_loaded_too_late_for_static_tls_does_not_start() {
    let dir = work_dir("dlopen");
    let mut child = Command::new(fixture(false))
        .args(["dlopen"])
        .arg(preload())
        .env("FERROPROF_OUTPUT_DIR", &dir)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A profiler started from a dlopen'd copy hangs the program (seen without the check):
    // bounded, so a regression fails instead of stalling the test run.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the program did not finish within 60 s after dlopen of the library");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("not profiling") && err.contains("static TLS"),
        "{err}"
    );
    assert!(profiles(&dir).is_empty(), "no profiler ran");
}

/// A program whose own debug info is zlib-compressed (as a distribution's debug files are) and
/// large enough to be cached: the first `record` inflates its units and leaves the prefix, and
/// the unit's digest, in the debug cache; the second maps them (neither file is written again)
/// and names the same frames with their files and lines.
#[test]
fn compressed_debug_info_is_inflated_once_then_read_from_the_debug_cache() {
    let dir = work_dir("debug-cache");
    // 3,000 functions with a struct each: about 360 kB of `.debug_info`.
    let mut src = String::from("#include <time.h>\n");
    let n = 3000;
    for i in 0..n {
        src.push_str(&format!(
            "__attribute__((noinline)) long f{i}(long x) {{ struct s{i} {{ long a, b, c, d; }} \
             s = {{ x, x + {i}, x ^ {i}, x * 3 }}; return s.a + s.b * s.c - s.d; }}\n"
        ));
    }
    src.push_str("static long (*const table[])(long) = {\n");
    for i in 0..n {
        src.push_str(&format!("f{i},\n"));
    }
    src.push_str(&format!(
        "}};\n__attribute__((noinline)) long spin(void) {{ long s = 0; struct timespec a, b;\n\
         clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);\n\
         do {{ for (int i = 0; i < {n}; i++) s += table[i](s);\n\
         clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b); }}\n\
         while ((b.tv_sec - a.tv_sec) * 1000000000L + (b.tv_nsec - a.tv_nsec) < 400000000L);\n\
         return s; }}\nint main(void) {{ return spin() == 42; }}\n",
    ));
    let c = dir.join("many.c");
    std::fs::write(&c, src).unwrap();
    let exe = dir.join("many");
    let o = Command::new("gcc")
        .args(["-O1", "-g", "-gz=zlib", "-fno-omit-frame-pointer", "-o"])
        .arg(&exe)
        .arg(&c)
        .output()
        .expect("gcc runs");
    assert!(o.status.success(), "gcc: {}", text(&o.stderr));
    let cache = dir.join("cache");
    let run = |out: &str| {
        let out = dir.join(out);
        let o = record(
            &[
                "--profiles",
                "cpu",
                "--debug-cache",
                cache.to_str().unwrap(),
                "-o",
                out.to_str().unwrap(),
            ],
            &exe,
            &[],
        );
        assert!(o.status.success(), "{}", text(&o.stderr));
        let (_, file) = profiles(&out).pop().expect("a profile");
        load(&file)
    };
    // `spin`'s frame with its file, as only DWARF gives it.
    let spin_from_dwarf = |p: &ferroprof_pprof::Profile| {
        p.function.iter().any(|f| {
            p.string_table[f.name as usize] == "spin"
                && p.string_table[f.filename as usize].ends_with("many.c")
        })
    };
    // (name, inode, size): a file replaced or appended to reads differently.
    let cached = || -> Vec<(String, u64, u64)> {
        use std::os::unix::fs::MetadataExt;
        let mut v: Vec<(String, u64, u64)> = std::fs::read_dir(&cache)
            .map(|d| {
                d.flatten()
                    .map(|e| {
                        let name = e.file_name().to_string_lossy().into_owned();
                        let m = e.metadata().unwrap();
                        (name, m.ino(), m.len())
                    })
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    };
    // The program's own cache files (libc's may be cached too where its debug file is
    // installed, and a run sampling other libc code extends them).
    let notes = Command::new("readelf")
        .arg("-n")
        .arg(&exe)
        .output()
        .expect("readelf (binutils) runs");
    let build_id = text(&notes.stdout)
        .lines()
        .find_map(|l| l.trim().strip_prefix("Build ID: ").map(str::to_owned))
        .expect("the program has a build id");
    let own = |v: Vec<(String, u64, u64)>| -> Vec<(String, u64, u64)> {
        v.into_iter()
            .filter(|(n, _, _)| n.starts_with(&build_id))
            .collect()
    };
    assert!(cached().is_empty());
    let first = run("p1");
    assert!(
        spin_from_dwarf(&first),
        "the first run names spin from DWARF"
    );
    let files = own(cached());
    assert!(
        files
            .iter()
            .any(|(name, _, _)| name.ends_with(".debug_info")),
        "the inflated prefix is cached: {files:?}"
    );
    // The program is one unit: its digest, made by the first run, serves the second.
    assert!(
        files
            .iter()
            .any(|(name, _, len)| name.ends_with(".units") && *len > 0),
        "the unit's digest is cached: {files:?}"
    );
    let second = run("p2");
    assert!(
        spin_from_dwarf(&second),
        "the second run names spin from DWARF"
    );
    assert_eq!(
        own(cached()),
        files,
        "the second run wrote nothing: it read the cache"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
