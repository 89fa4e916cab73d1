//! `ferroprof record`: every CPU nanosecond a process's threads used is in its profile, for
//! processes that live less than a sampling period and for forked children that never
//! allocate through malloc (the workers of Python's `multiprocessing`, whose objects come from
//! pymalloc's arenas). Truth is taken inside the programs: thread CPU clocks.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

mod common;
use common::*;

/// tests/fixtures/short_spin.c, compiled once.
fn short_spin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let out = kept_dir("cc").join("short_spin");
        gcc("short_spin.c", &out, &["-O1", "-g"]);
        out
    })
}

fn record(dir: &Path, program: &Path, args: &[&str]) -> Output {
    let out = Command::new(BIN)
        .env("FERROPROF_PRELOAD", preload())
        .arg("record")
        .arg("-o")
        .arg(dir)
        .arg("--")
        .arg(program)
        .args(args)
        .output()
        .expect("run ferroprof record");
    assert!(
        out.status.success(),
        "record failed: {}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    out
}

/// The total `cpu-time` of each process's profiles in `dir` (`<command>.<pid>.<n>.pprof`), by
/// pid: its threads' and, second, the profiler's own (`[ferroprof]`).
fn cpu_by_pid(dir: &Path) -> std::collections::BTreeMap<i32, (i64, i64)> {
    let mut by_pid = std::collections::BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(stem) = name.strip_suffix(".pprof") else {
            continue;
        };
        let mut parts = stem.rsplitn(3, '.');
        let (Some(_n), Some(pid)) = (parts.next(), parts.next()) else {
            continue;
        };
        let Ok(pid) = pid.parse::<i32>() else {
            continue;
        };
        let p = ferroprof_pprof::decode(&std::fs::read(e.path()).unwrap()).expect("a pprof");
        let i = p.value_index("cpu-time").expect("cpu-time in the profile");
        let entry: &mut (i64, i64) = by_pid.entry(pid).or_default();
        for s in &p.sample {
            if p.stack_names(s) == ["[ferroprof]"] {
                entry.1 += s.value[i];
            } else {
                entry.0 += s.value[i];
            }
        }
    }
    by_pid
}

/// The threads' CPU (the profiler's own left out) of each process, by pid.
fn app_cpu_by_pid(dir: &Path) -> std::collections::BTreeMap<i32, i64> {
    cpu_by_pid(dir)
        .into_iter()
        .map(|(p, (app, _))| (p, app))
        .collect()
}

/// A process that lives a few milliseconds (less than one 10 ms sampling period, as most of a
/// build's compiler and assembler runs do) has its main thread's whole CPU time in its profile:
/// the loader's and constructors' time before the profiler started, and what no signal caught.
/// (Before, such a process showed no CPU at all: no capture, and an empty stack was dropped.)
#[test]
fn a_process_shorter_than_a_period_has_all_its_cpu() {
    for ms in ["3", "30"] {
        let dir = work_dir(&format!("short-{ms}"));
        let out = record(&dir, short_spin(), &[ms]);
        let stdout = text(&out.stdout);
        let truth: i64 = field(&stdout, "cpu_ns");
        let got = app_cpu_by_pid(&dir);
        assert_eq!(got.len(), 1, "one profile: {got:?}\n{stdout}");
        let cpu = *got.values().next().unwrap();
        // The profile also holds the exit handlers' time after the truth was read: a little
        // more, never less.
        assert!(
            cpu as f64 >= truth as f64 * 0.97 && cpu as f64 <= truth as f64 * 1.15 + 1e6,
            "{ms} ms process: profile {cpu} ns against its clock's {truth} ns"
        );
    }
}

/// A 30 ms process execed as a build's compiler is: its profile's CPU, the profiler's own
/// threads' included (sampling, symbolizing, encoding its one profile), is within 5% of what
/// the kernel charged the whole process by its exit. (Before, the profiler's threads were left
/// out: such a process's profile held about 85% of its CPU, and a `make -j2` of small C files
/// 65%.)
#[test]
fn an_execed_process_profile_holds_its_whole_cpu() {
    let dir = work_dir("exec-whole");
    let out = record(&dir, short_spin(), &["30", "exec"]);
    let stdout = text(&out.stdout);
    let truth: i64 = field(&stdout, "child_rusage_ns");
    let got = cpu_by_pid(&dir);
    assert_eq!(
        got.len(),
        2,
        "the parent's and the child's profiles: {got:?}"
    );
    // The child: the one that spun.
    let (app, own) = *got.values().max().unwrap();
    assert!(own > 0, "the profiler's own CPU booked: {got:?}");
    let whole = app + own;
    assert!(
        whole as f64 >= truth as f64 * 0.95 && whole as f64 <= truth as f64 * 1.01,
        "profile {whole} ns ({app} the program's, {own} the profiler's) against the \
         kernel's {truth} ns for the whole process"
    );
}

/// Runs short_spin with `args` (a forked child's modes): the parent's and the child's profiles,
/// the child's CPU within 10% of what its clock said.
fn child_has_its_cpu(name: &str, args: &[&str]) {
    let dir = work_dir(name);
    let out = record(&dir, short_spin(), args);
    let stdout = text(&out.stdout);
    let truth: i64 = field(&stdout, "cpu_ns");
    let pid: i32 = field(&stdout, "pid");
    let got = app_cpu_by_pid(&dir);
    assert_eq!(
        got.len(),
        2,
        "the parent's and the child's profiles: {got:?}\n{stdout}"
    );
    // By its pid: the parent's own first sampled allocation (the profiler's start-up work on
    // its thread) may take more CPU than the child's spin in an unoptimized build.
    let child = *got
        .get(&pid)
        .unwrap_or_else(|| panic!("no profile of the child {pid}: {got:?}"));
    assert!(
        (child as f64 - truth as f64).abs() <= truth as f64 * 0.1,
        "child: profile {child} ns against its clock's {truth} ns ({got:?})"
    );
}

/// A forked child that computes without a sampled allocation and ends with `_exit`: its CPU
/// timer, armed at the fork, catches it, and its profile carries its CPU time.
#[test]
fn a_forked_child_that_never_allocates_has_its_cpu() {
    child_has_its_cpu("fork-spin", &["60", "fork"]);
}

/// A forked child that computes without calling malloc at all, then waits until its parent
/// ends it with SIGTERM: its profiler threads started from its CPU timer's signal (nothing else
/// would start them), so the signal writes its profile, with its CPU time. (Before, it wrote
/// nothing: its threads never started, and SIGTERM passed through.)
#[test]
fn a_forked_child_that_never_calls_malloc_writes_its_profile_on_sigterm() {
    child_has_its_cpu("fork-term", &["80", "fork-term"]);
}

fn python() -> Option<PathBuf> {
    // The interpreter itself: a version manager's shim would be a shell script run first.
    ["/usr/bin/python3", "/usr/local/bin/python3"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
}

/// `multiprocessing.Pool(4)` doing pure-Python work at the default allocation interval, ended
/// by the pool's `terminate` (SIGTERM) as `with Pool(...)` does: every worker has a profile with
/// its CPU time within 10% of what `time.process_time()` said at the end of its last task. (Before,
/// workers whose objects all came from pymalloc never started their profiler threads and wrote
/// nothing, and a worker stopping its profiler at exit was killed by the pool's SIGTERM before
/// writing.)
#[test]
fn every_multiprocessing_worker_has_its_cpu() {
    let Some(python) = python() else {
        panic!("python3 is needed (install python3)");
    };
    let dir = work_dir("pool");
    let script = dir.join("pool.py");
    let truth_file = dir.join("truth.txt");
    std::fs::write(
        &script,
        r#"
import multiprocessing as mp, os, sys, time
def work(n):
    s = 0
    for i in range(n):
        s += i * i % 7
    return os.getpid(), time.process_time()
if __name__ == "__main__":
    mp.set_start_method("fork")
    with mp.Pool(4) as p:
        res = p.map(work, [400_000] * 16, chunksize=1)
    last = {}
    for pid, t in res:
        last[pid] = max(last.get(pid, 0.0), t)
    with open(sys.argv[1], "w") as f:
        for pid, t in last.items():
            f.write(f"{pid} {int(t * 1e9)}\n")
"#,
    )
    .unwrap();
    let profiles = dir.join("profiles");
    record(
        &profiles,
        &python,
        &[script.to_str().unwrap(), truth_file.to_str().unwrap()],
    );
    let got = app_cpu_by_pid(&profiles);
    let truth = std::fs::read_to_string(&truth_file).unwrap();
    let mut workers = 0;
    for line in truth.lines() {
        let mut w = line.split_whitespace();
        let pid: i32 = w.next().unwrap().parse().unwrap();
        let ns: i64 = w.next().unwrap().parse().unwrap();
        workers += 1;
        let cpu = *got
            .get(&pid)
            .unwrap_or_else(|| panic!("no profile of worker {pid}: {got:?}"));
        // The worker's profile also holds what it did after its last task: not less.
        assert!(
            cpu as f64 >= ns as f64 * 0.9 && cpu as f64 <= ns as f64 * 1.25,
            "worker {pid}: profile {cpu} ns against process_time {ns} ns"
        );
    }
    assert!(
        workers >= 2,
        "the pool's work went to {workers} worker(s): {truth}"
    );
}
