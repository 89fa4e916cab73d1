//! `ferroprof record -p PID`: a running process profiled from outside. Truth is taken inside
//! the target (its threads' CPU clocks); stacks are checked whole, from the thread's root to
//! the leaf. Refusals are one line and a non-zero exit.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

mod common;
use common::*;

fn fixture(name: &str, flags: &[&str]) -> PathBuf {
    let out = kept_dir(&format!("cc-{name}")).join(name);
    gcc(&format!("{name}.c"), &out, flags);
    out
}

/// tests/fixtures/attach_target.c, built as users build (optimized, line tables).
fn target() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| fixture("attach_target", &["-O2", "-g1", "-pthread"]))
}

/// The target started and waiting for its go line.
fn start_target(spin_ms: &str) -> Child {
    Command::new(target())
        .arg(spin_ms)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the target")
}

fn attach(args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.arg("record").args(args);
    c
}

/// Starts `program ARGS` (waiting for its go line), calls `started`, attaches `record -p PID
/// -o out` with `env` until it ends, lets it go once the events are open, and returns both
/// outputs (each checked for success).
fn attach_run(
    program: &Path,
    args: &[&str],
    out: &Path,
    env: &[(&str, String)],
    started: impl FnOnce(),
) -> (Output, Output) {
    let mut t = Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the target");
    started();
    let run = attach(&["-p", &t.id().to_string(), "-o", out.to_str().unwrap()])
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run ferroprof record -p");
    // Let the events open (the target is blocked on its stdin meanwhile, using no CPU).
    std::thread::sleep(Duration::from_millis(700));
    t.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let target_out = t.wait_with_output().unwrap();
    assert!(target_out.status.success());
    let run_out = run.wait_with_output().unwrap();
    assert!(
        run_out.status.success(),
        "{}\n{}",
        text(&run_out.stdout),
        text(&run_out.stderr)
    );
    (target_out, run_out)
}

/// Attaches to a process whose three threads (more than this machine's cores) spin in
/// outer_N -> middle -> spin_leaf: each thread's CPU in the profile within 2% of its clock,
/// every sample of a worker on the whole stack from the thread's start to the leaf, labels
/// naming the thread; a fourth thread's wall time in nanosleep, reached through real callers,
/// within 5% of what its clock measured around those calls, on the whole stack. The run ends
/// with the process.
#[test]
fn a_running_process_threads_cpu_on_whole_stacks() {
    threads_and_sleeper(target(), "threads", "attach_target", "nanosleep");
}

/// The same of a Rust program built as users build (optimized, line tables only): its
/// threads named by Rust, the sleeper in `std::thread::sleep`.
#[test]
fn a_running_rust_program_threads_cpu_on_whole_stacks() {
    threads_and_sleeper(rust_target(), "rust", "worker", "nanosleep");
}

/// tests/fixtures/attach_target_rs.rs, compiled once with rustc.
fn rust_target() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/attach_target_rs.rs");
        let out = kept_dir("rustc").join("attach_target_rs");
        let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".to_owned());
        let o = Command::new(rustc)
            .args([
                "-C",
                "opt-level=3",
                "-C",
                "debuginfo=line-tables-only",
                "-o",
            ])
            .arg(&out)
            .arg(&src)
            .output()
            .expect("rustc runs");
        assert!(o.status.success(), "rustc failed: {}", text(&o.stderr));
        out
    })
}

/// `f` is function `name` (C) or a Rust path ending in it.
fn is(f: &str, name: &str) -> bool {
    f == name || f.ends_with(&format!("::{name}"))
}

fn threads_and_sleeper(bin: &Path, dir_name: &str, worker_name: &str, sleep_leaf: &str) {
    let dir = work_dir(dir_name);
    let (target_out, out) = attach_run(bin, &["1500"], &dir, &[], || {});
    let stdout = text(&out.stdout);
    let target_stdout = text(&target_out.stdout);
    let truth: Vec<(i64, i64)> = target_stdout
        .lines()
        .filter(|l| l.starts_with("tid="))
        .map(|l| (field(l, "tid"), field(l, "cpu_ns")))
        .collect();
    let sleeper: i64 = field(&target_stdout, "sleeper");
    let blocked: i64 = field(&target_stdout, "blocked_ns");
    assert_eq!(truth.len(), 3, "{truth:?}");
    let files = profiles(&dir);
    assert_eq!(files.len(), 1, "{files:?}\n{stdout}");
    let p = ferroprof_pprof::decode(&std::fs::read(&files[0].1).unwrap()).unwrap();
    let cpu = p.value_index("cpu-time").unwrap();
    for (n, &(tid, ns)) in truth.iter().enumerate() {
        let mine: Vec<_> = p
            .sample
            .iter()
            .filter(|s| p.label_num(s, "thread id") == Some(tid) && s.value[cpu] > 0)
            .collect();
        let got: i64 = mine.iter().map(|s| s.value[cpu]).sum();
        assert!(
            (got - ns).abs() as f64 <= ns as f64 * 0.02,
            "thread {tid}: profile {got} ns against its clock's {ns} ns"
        );
        let outer = mine
            .iter()
            .map(|s| p.stack_names(s))
            .find(|st| st.iter().any(|f| f.contains("outer_")))
            .unwrap_or_else(|| {
                let some: Vec<_> = mine.iter().take(3).map(|s| p.stack_names(s)).collect();
                panic!("thread {tid}: no stack through an outer_N, among {some:?}")
            });
        let which = outer.iter().find(|f| f.contains("outer_")).unwrap().clone();
        // A thread's last instants run libc's exit path after its function returned (thread
        // destructors, `__libc_thread_freeres`): CPU truly spent there, on a stack with none of
        // the program's functions, and a sliver of the thread's.
        let mut exiting_ns = 0;
        for s in &mine {
            let st = p.stack_names(s);
            let program = st
                .iter()
                .any(|f| f.contains("outer_") || is(f, "middle") || is(f, "spin_leaf"));
            if !program && st.iter().any(|f| f.contains("start_thread")) {
                exiting_ns += s.value[cpu];
                continue;
            }
            let leaf_pos = st.iter().position(|f| is(f, "spin_leaf"));
            // Leaf first: spin_leaf (or what it calls: the vDSO's clock), middle, this
            // thread's outer_N, then the thread's start in libc.
            let Some(leaf) = leaf_pos else {
                panic!("thread {tid} ({n}): a sample outside spin_leaf: {st:?}");
            };
            assert!(st.get(leaf + 1).is_some_and(|f| is(f, "middle")), "{st:?}");
            assert_eq!(st.get(leaf + 2), Some(&which), "{st:?}");
            assert!(
                st[leaf + 3..].iter().any(|f| f.contains("start_thread")),
                "thread {tid}: no root under {which}: {st:?}"
            );
        }
        assert!(
            exiting_ns <= ns / 100,
            "thread {tid}: {exiting_ns} ns on its exit path in libc"
        );
        let name = mine
            .iter()
            .filter_map(|s| p.label_str(s, "thread name"))
            .next()
            .unwrap_or_default();
        assert!(name.starts_with(worker_name), "thread {tid} named {name:?}");
    }
    // The sleeper's wall time, all of it on the whole stack of its blocking call.
    let wall = p.value_index("wall-time").unwrap();
    let slept: Vec<_> = p
        .sample
        .iter()
        .filter(|s| p.label_num(s, "thread id") == Some(sleeper) && s.value[wall] > 0)
        .collect();
    let total: i64 = slept.iter().map(|s| s.value[wall]).sum();
    let on_site: i64 = slept
        .iter()
        .filter(|s| {
            let st = p.stack_names(s);
            let m = st.iter().position(|f| is(f, "wait_middle"));
            m.is_some_and(|m| {
                st.get(m + 1).is_some_and(|f| is(f, "wait_outer"))
                    && st[m + 2..].iter().any(|f| f.contains("start_thread"))
                    && st[..m].iter().any(|f| f.contains(sleep_leaf))
            })
        })
        .map(|s| s.value[wall])
        .sum();
    assert!(
        (on_site - blocked).abs() as f64 <= blocked as f64 * 0.05,
        "sleeper: {on_site} ns of wall time on nanosleep <- wait_middle <- wait_outer <- \
         start_thread ({total} ns in all) against {blocked} ns inside its calls"
    );
    assert!(
        stdout.contains("no allocation or heap profile"),
        "the summary says what attaching cannot give: {stdout}"
    );
}

/// A statically linked program whose file was deleted after it started: its functions are
/// still named (the file is read through /proc/PID/map_files), its stacks whole.
#[test]
fn a_static_program_whose_file_was_deleted_is_named() {
    let dir = work_dir("static-deleted");
    let bin = dir.join("static_target");
    gcc(
        "attach_target.c",
        &bin,
        &["-O2", "-g1", "-pthread", "-static"],
    );
    // Deleted once started, before the attach.
    let out_dir = dir.join("out");
    attach_run(&bin, &["600"], &out_dir, &[], || {
        std::fs::remove_file(&bin).unwrap()
    });
    let files = profiles(&out_dir);
    assert_eq!(files.len(), 1, "{files:?}");
    let p = ferroprof_pprof::decode(&std::fs::read(&files[0].1).unwrap()).unwrap();
    let total = p.total("cpu-time").unwrap();
    let named = through(&p, "cpu-time", "spin_leaf");
    assert!(
        named as f64 >= total as f64 * 0.9 && total > 1_000_000_000,
        "{named} of {total} ns through spin_leaf"
    );
    let cpu = p.value_index("cpu-time").unwrap();
    for s in p.sample.iter().filter(|s| s.value[cpu] > 0) {
        let st = p.stack_names(s);
        if let Some(l) = st.iter().position(|f| f == "spin_leaf") {
            assert_eq!(st.get(l + 1).map(String::as_str), Some("middle"), "{st:?}");
            assert!(st[l + 2].starts_with("outer_"), "{st:?}");
        }
    }
}

/// One HTTP request read from `stream` (Content-Length body), answered 200: (request line,
/// body).
fn serve_one(stream: &mut std::net::TcpStream) -> (String, Vec<u8>) {
    use std::io::{BufRead, BufReader, Read};
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut r = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let mut len = 0;
    loop {
        let mut h = String::new();
        r.read_line(&mut h).unwrap();
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                len = v.trim().parse().unwrap();
            }
        }
    }
    let mut body = vec![0; len];
    r.read_exact(&mut body).unwrap();
    stream
        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        .unwrap();
    (line.trim_end().to_owned(), body)
}

/// The network exporters the environment names get the profiles, as from a linked-in
/// profiler: here Pyroscope, on a server of the test's on 127.0.0.1.
#[test]
fn profiles_go_to_the_exporters_the_environment_names() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        serve_one(&mut s)
    });
    let dir = work_dir("exporters");
    attach_run(
        target(),
        &["300"],
        &dir,
        &[
            (
                "FERROPROF_PYROSCOPE_URL",
                format!("http://127.0.0.1:{port}"),
            ),
            ("FERROPROF_PYROSCOPE_APP", "attached-app".to_owned()),
        ],
        || {},
    );
    let (line, body) = server.join().unwrap();
    assert!(
        line.starts_with("POST /ingest?name=attached-app") && line.contains("format=pprof"),
        "{line}"
    );
    // The multipart body carries the gzip pprof the file holds.
    let file = std::fs::read(&profiles(&dir)[0].1).unwrap();
    assert!(
        body.windows(file.len()).any(|w| w == file.as_slice()),
        "the uploaded body holds the profile written to {}",
        dir.display()
    );
}

/// With --period, one profile per period and the last at the end: consecutive profiles tile
/// the run, each holding its own period's CPU.
#[test]
fn a_periodic_run_writes_one_profile_per_period() {
    let mut t = start_target("3000");
    let dir = work_dir("periods");
    let run = attach(&[
        "-p",
        &t.id().to_string(),
        "--period",
        "1",
        "--duration",
        "2.5",
        "-o",
        dir.to_str().unwrap(),
    ])
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    std::thread::sleep(Duration::from_millis(300));
    t.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let out = run.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let _ = t.kill();
    let _ = t.wait();
    let files = profiles(&dir);
    assert_eq!(files.len(), 3, "{files:?}\n{}", text(&out.stderr));
    let decoded: Vec<_> = files
        .iter()
        .map(|(_, f)| ferroprof_pprof::decode(&std::fs::read(f).unwrap()).unwrap())
        .collect();
    for w in decoded.windows(2) {
        assert_eq!(
            w[0].time_nanos + w[0].duration_nanos,
            w[1].time_nanos,
            "consecutive profiles tile the run"
        );
    }
    for p in &decoded[..2] {
        // Three busy threads throughout: CPU in every full period (about 2 s on a quiet
        // 2-core machine; much less on a loaded one).
        let cpu = p.total("cpu-time").unwrap();
        assert!(cpu > 100_000_000, "{cpu} ns in a 1 s period");
    }
}

/// A program that starts and ends threads all along: the events of ended threads are closed, so
/// a run of hours holds descriptors (and locked ring memory) for the live threads only. (Before,
/// each ended thread kept its event: 150 descriptors here.)
#[test]
fn ended_threads_release_their_events() {
    let mut t = Command::new(target())
        .args(["25", "churn"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let dir = work_dir("churn");
    let run = attach(&["-p", &t.id().to_string(), "-o", dir.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let fds = |pid: u32| {
        std::fs::read_dir(format!("/proc/{pid}/fd"))
            .map(|d| d.count())
            .unwrap_or(0)
    };
    std::thread::sleep(Duration::from_millis(500));
    let at_start = fds(run.id());
    t.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let mut most = at_start;
    while t.try_wait().unwrap().is_none() {
        most = most.max(fds(run.id()));
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = run.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        most <= at_start + 10,
        "descriptors grew from {at_start} to {most} over 150 threads started one by one"
    );
    let p = ferroprof_pprof::decode(&std::fs::read(&profiles(&dir)[0].1).unwrap()).unwrap();
    assert!(
        through(&p, "cpu-time", "spin_leaf") > 1_000_000_000,
        "the threads' CPU is there"
    );
}

/// A user who is not root (user-space samples only at perf_event_paranoid 2): each thread's
/// CPU is still whole, within 2% of its clock (its time in the kernel, here its clock reads, is
/// booked from the event's count). Before, it read 89-94% of the clocks.
#[test]
fn an_unprivileged_user_gets_each_threads_whole_cpu() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to run both processes as another user");
        return;
    }
    let dir = work_dir("unprivileged");
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
    let (bin, tgt) = (dir.join("ferroprof"), dir.join("target"));
    std::fs::copy(BIN, &bin).unwrap();
    std::fs::copy(target(), &tgt).unwrap();
    let as_nobody = |program: &Path| {
        let mut c = Command::new("setpriv");
        c.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .arg(program);
        c
    };
    let mut t = as_nobody(&tgt)
        .arg("800")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // setpriv keeps the pid and is root until it execs the target as nobody.
    let comm = format!("/proc/{}/comm", t.id());
    while std::fs::read_to_string(&comm).is_ok_and(|c| c.trim() != "target") {
        std::thread::sleep(Duration::from_millis(5));
    }
    let out_dir = dir.join("out");
    let run = as_nobody(&bin)
        .args(["record", "-p", &t.id().to_string(), "-o"])
        .arg(&out_dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(700));
    t.stdin.take().unwrap().write_all(b"go\n").unwrap();
    let target_out = t.wait_with_output().unwrap();
    let out = run.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let p = ferroprof_pprof::decode(&std::fs::read(&profiles(&out_dir)[0].1).unwrap()).unwrap();
    let cpu = p.value_index("cpu-time").unwrap();
    for line in text(&target_out.stdout)
        .lines()
        .filter(|l| l.starts_with("tid="))
    {
        let (tid, ns): (i64, i64) = (field(line, "tid"), field(line, "cpu_ns"));
        let got: i64 = p
            .sample
            .iter()
            .filter(|s| p.label_num(s, "thread id") == Some(tid))
            .map(|s| s.value[cpu])
            .sum();
        assert!(
            (got - ns).abs() as f64 <= ns as f64 * 0.02,
            "thread {tid}: profile {got} ns against its clock's {ns} ns\n{}",
            text(&out.stderr)
        );
    }
}

fn refused(cmd: &mut Command) -> (String, Output) {
    let out = cmd.output().expect("run ferroprof");
    assert!(!out.status.success(), "refusal exits non-zero");
    let err = text(&out.stderr);
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "one line of refusal: {err:?}"
    );
    (err, out)
}

#[test]
fn no_such_process_is_refused_in_one_line() {
    let (err, _) = refused(&mut attach(&["-p", "999999999", "--duration", "1"]));
    assert!(err.contains("no process with pid 999999999"), "{err}");
}

/// A seccomp filter that denies perf_event_open (container runtimes' default): the refusal
/// names the call and the paranoid setting.
#[test]
fn perf_event_open_denied_by_seccomp_is_refused_in_one_line() {
    let deny = fixture("deny_perf", &["-O1"]);
    let mut t = start_target("10");
    let pid = t.id().to_string();
    let dir = work_dir("seccomp");
    let mut cmd = Command::new(&deny);
    cmd.args([BIN, "record", "-p", &pid, "--duration", "1", "-o"])
        .arg(&dir);
    let (err, _) = refused(&mut cmd);
    assert!(
        err.contains("perf_event_open refused") && err.contains("perf_event_paranoid"),
        "{err}"
    );
    drop(t.stdin.take());
    let _ = t.wait();
}

/// Another user's process, as a user who is not root: refused, naming the permission.
#[test]
fn another_users_process_is_refused_in_one_line() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to run the check as another user");
        return;
    }
    let mut t = start_target("10");
    let pid = t.id().to_string();
    // The binary and a directory the other user can reach.
    let dir = work_dir("other-user");
    let bin = dir.join("ferroprof");
    std::fs::copy(BIN, &bin).unwrap();
    let out_dir = dir.join("out");
    std::fs::create_dir_all(&out_dir).unwrap();
    use std::os::unix::fs::PermissionsExt;
    for p in [&*dir, out_dir.as_path()] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o777)).unwrap();
    }
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(&bin)
        .args(["record", "-p", &pid, "--duration", "1", "-o"])
        .arg(&out_dir);
    let (err, _) = refused(&mut cmd);
    assert!(err.contains("permission denied for pid"), "{err}");
    drop(t.stdin.take());
    let _ = t.wait();
}
