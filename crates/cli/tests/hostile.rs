//! The `ferroprof` binary on hostile files: a gzip bomb, a profile with 100k locations, and
//! megabyte function names. Each run is a child whose wall time and peak RSS (from `wait4`) are
//! bounded; a run past its time bound is killed and fails the test.
//!
//! Sizes can be raised for the heavy versions (scripts/reliability.sh):
//! `FERROPROF_BOMB_MIB` (inflated size of the bomb, default 2048) and
//! `FERROPROF_HOSTILE_LOCATIONS` / `FERROPROF_HOSTILE_SAMPLES` (defaults 100000 / 20000).

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use prost::Message;

use ferroprof_pprof::{Function, Line, Location, Profile, Sample, ValueType};

const MIB: u64 = 1 << 20;

fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ferroprof-hostile-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// One run of the binary: exit code (None if killed), output, wall time, peak RSS.
struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    elapsed: Duration,
    peak_rss: u64,
    timed_out: bool,
}

impl std::fmt::Debug for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Outputs can be megabytes (that is what some of these tests are about): show heads.
        let head = |s: &str| s.chars().take(600).collect::<String>();
        write!(
            f,
            "exit {:?}, {:.2} s, peak RSS {} MB{}\nstderr: {}\nstdout: {}",
            self.code,
            self.elapsed.as_secs_f64(),
            self.peak_rss / 1_000_000,
            if self.timed_out {
                ", KILLED at the time bound"
            } else {
                ""
            },
            head(&self.stderr),
            head(&self.stdout)
        )
    }
}

/// Runs `ferroprof args` with stdout and stderr in files under `dir`; kills it after `limit`.
fn run(dir: &Path, args: &[&str], limit: Duration) -> Run {
    run_capped(dir, args, limit, None)
}

/// [`run`], with the child's address space capped at `max_vm` bytes if given: for inputs
/// that would take the whole machine if the bug came back.
fn run_capped(dir: &Path, args: &[&str], limit: Duration, max_vm: Option<u64>) -> Run {
    let out_path = dir.join("stdout.txt");
    let err_path = dir.join("stderr.txt");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferroprof"));
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(File::create(&out_path).unwrap())
        .stderr(File::create(&err_path).unwrap());
    if let Some(max) = max_vm {
        let lim = libc::rlimit {
            rlim_cur: max,
            rlim_max: max,
        };
        // SAFETY: runs in the forked child before exec, and only calls setrlimit, which is
        // async-signal-safe; `lim` is a copy owned by the closure.
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let child = cmd.spawn().expect("spawn ferroprof");
    let pid = child.id() as libc::pid_t;
    let start = Instant::now();
    let mut timed_out = false;
    let (status, usage) = loop {
        let mut status = 0;
        // SAFETY: an all-zero rusage is a valid value of this plain C struct.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `pid` is our child, reaped only here (std's `Child` is never waited on, so
        // the pid cannot be reused before this call); both pointers are to live locals.
        let r = unsafe { libc::wait4(pid, &mut status, libc::WNOHANG, &mut usage) };
        assert!(r >= 0, "wait4: {}", std::io::Error::last_os_error());
        if r == pid {
            break (status, usage);
        }
        if !timed_out && start.elapsed() > limit {
            timed_out = true;
            // SAFETY: signalling our own unreaped child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let elapsed = start.elapsed();
    drop(child);
    let code = libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
    Run {
        code,
        stdout: String::from_utf8_lossy(&std::fs::read(&out_path).unwrap()).into_owned(),
        stderr: String::from_utf8_lossy(&std::fs::read(&err_path).unwrap()).into_owned(),
        elapsed,
        // Linux reports ru_maxrss in KiB.
        peak_rss: usage.ru_maxrss as u64 * 1024,
        timed_out,
    }
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(bytes).unwrap();
    gz.finish().unwrap()
}

/// Interns strings into a profile's string table.
struct Strings(Vec<String>);

impl Strings {
    fn new() -> Self {
        Strings(vec![String::new()])
    }
    fn add(&mut self, s: String) -> i64 {
        self.0.push(s);
        self.0.len() as i64 - 1
    }
}

/// A CPU profile with one function and one location per name, and the given stacks
/// (indexes into `names`, innermost first) with their values.
fn profile(names: Vec<String>, stacks: &[(Vec<usize>, i64)]) -> Profile {
    let mut s = Strings::new();
    let sample_type = vec![ValueType {
        r#type: s.add("cpu-time".into()),
        unit: s.add("nanoseconds".into()),
    }];
    let file = s.add("src/lib.rs".into());
    let mut function = Vec::with_capacity(names.len());
    let mut location = Vec::with_capacity(names.len());
    for (i, n) in names.into_iter().enumerate() {
        let id = i as u64 + 1;
        let name = s.add(n);
        function.push(Function {
            id,
            name,
            system_name: name,
            filename: file,
            start_line: 0,
        });
        location.push(Location {
            id,
            address: 0x1000 + id,
            line: vec![Line {
                function_id: id,
                line: 1,
                column: 0,
            }],
            ..Default::default()
        });
    }
    let sample = stacks
        .iter()
        .map(|(stack, v)| Sample {
            location_id: stack.iter().map(|&i| i as u64 + 1).collect(),
            value: vec![*v],
            label: vec![],
        })
        .collect();
    Profile {
        sample_type,
        sample,
        location,
        function,
        string_table: s.0,
        ..Default::default()
    }
}

/// xorshift: deterministic stacks without a dependency.
fn rng(mut x: u64) -> impl FnMut() -> u64 {
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

#[test]
fn gzip_bomb_is_refused_with_bounded_memory() {
    let d = tempdir("bomb");
    let inflated = env_or("FERROPROF_BOMB_MIB", 2048) * MIB;
    // Zeros through the encoder, 16 MiB to a gzip member; the member written again and again
    // (a reader must take concatenated members: `gzip a b > c`). A few MB on disk, `inflated`
    // bytes inside, without deflating gigabytes in the test.
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    let chunk = vec![0u8; MIB as usize];
    for _ in 0..16 {
        gz.write_all(&chunk).unwrap();
    }
    let member = gz.finish().unwrap();
    let bomb = d.join("bomb.pb.gz");
    let mut f = std::io::BufWriter::new(File::create(&bomb).unwrap());
    for _ in 0..inflated.div_ceil(16 * MIB) {
        f.write_all(&member).unwrap();
    }
    f.into_inner().unwrap().sync_all().unwrap();
    let on_disk = std::fs::metadata(&bomb).unwrap().len();
    assert!(on_disk < inflated / 100, "{on_disk} bytes on disk");
    let bomb = bomb.to_str().unwrap();

    let svg = d.join("b.svg");
    for args in [
        vec!["top", bomb],
        vec!["diff", bomb, bomb],
        vec!["flamegraph", bomb, "-o", svg.to_str().unwrap()],
    ] {
        let r = run(&d, &args, Duration::from_secs(60));
        eprintln!("{args:?}: {r:?}");
        assert!(!r.timed_out, "{args:?}: {r:?}");
        assert_eq!(r.code, Some(2), "{args:?}: {r:?}");
        assert!(
            r.stderr.contains("bomb.pb.gz")
                && r.stderr.contains("256 MiB")
                && r.stderr.contains("--max-decompressed-size"),
            "the error names the file, the cap and the flag: {r:?}"
        );
        assert!(
            r.peak_rss < 400_000_000,
            "{args:?}: peak RSS {} MB for a {on_disk}-byte file: {r:?}",
            r.peak_rss / 1_000_000
        );
    }
}

#[test]
fn dense_empty_messages_are_refused_before_decoding() {
    let d = tempdir("dense");
    // Empty samples (field 2, length 0): 64 MiB inflated, within the cap, from a 65 KB file,
    // but 72 bytes each once decoded: 2.3 GB. Members repeated, as for the bomb.
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&[0x12u8, 0x00].repeat(8 << 20)).unwrap();
    let member = gz.finish().unwrap();
    let f = d.join("dense.pb.gz");
    std::fs::write(&f, member.repeat(4)).unwrap();
    let on_disk = std::fs::metadata(&f).unwrap().len();
    let f = f.to_str().unwrap();
    let r = run_capped(&d, &["top", f], Duration::from_secs(60), Some(4 << 30));
    eprintln!("top: {r:?}");
    assert!(!r.timed_out && r.code == Some(2), "{r:?}");
    assert!(
        r.stderr.contains("dense.pb.gz")
            && r.stderr.contains("of memory")
            && r.stderr.contains("--max-decompressed-size"),
        "{r:?}"
    );
    assert!(
        r.peak_rss < 200_000_000,
        "peak RSS {} MB for a {on_disk}-byte file: {r:?}",
        r.peak_rss / 1_000_000
    );
}

#[test]
fn top_and_diff_are_linear_in_locations() {
    let d = tempdir("wide");
    let n = env_or("FERROPROF_HOSTILE_LOCATIONS", 100_000) as usize;
    let samples = env_or("FERROPROF_HOSTILE_SAMPLES", 20_000) as usize;
    let names: Vec<String> = (0..n)
        .map(|i| format!("app::module_{}::function_{i}", i % 97))
        .collect();
    let write = |name: &str, seed: u64| {
        let mut next = rng(seed);
        let stacks: Vec<(Vec<usize>, i64)> = (0..samples)
            .map(|_| {
                let depth = 4 + next() as usize % 12;
                let stack = (0..depth).map(|_| next() as usize % n).collect();
                (stack, 1 + (next() % 1_000_000) as i64)
            })
            .collect();
        let path = d.join(name);
        std::fs::write(&path, profile(names.clone(), &stacks).encode_gzip()).unwrap();
        path
    };
    let a = write("a.pb.gz", 0x9e37_79b9_7f4a_7c15);
    let b = write("b.pb.gz", 0x2545_f491_4f6c_dd1d);
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    eprintln!(
        "{n} locations, {samples} samples: {} bytes",
        std::fs::metadata(a).unwrap().len()
    );

    // Generous for a loaded 2-core machine: the quadratic code took ~100 s on 100k. Linear
    // code stays within a bound that grows linearly with larger (heavy) inputs.
    let scale = (n as u64)
        .div_ceil(100_000)
        .max((samples as u64).div_ceil(20_000));
    let limit = Duration::from_secs(20 * scale);
    let r = run(&d, &["top", a], limit);
    eprintln!("top: {r:?}");
    assert!(!r.timed_out && r.code == Some(0), "top: {r:?}");
    assert!(
        r.stdout.contains(&format!("in {samples} samples")),
        "top: {r:?}"
    );
    let r = run(&d, &["top", "--cum", "-n", "5", b], limit);
    eprintln!("top --cum: {r:?}");
    assert!(!r.timed_out && r.code == Some(0), "top --cum: {r:?}");

    let r = run(&d, &["diff", a, b], limit);
    eprintln!("diff: {r:?}");
    assert!(!r.timed_out && r.code == Some(0), "diff: {r:?}");
    assert!(r.stdout.contains("changed functions"), "diff: {r:?}");
}

/// `count` names of `len` bytes each, distinct in their first character.
fn huge_names(count: usize, len: usize) -> Vec<String> {
    (0..count)
        .map(|i| {
            let mut s = format!("{}::", (b'a' + i as u8) as char);
            s.extend(std::iter::repeat_n('x', len - s.len()));
            s
        })
        .collect()
}

#[test]
fn megabyte_names_are_shared_and_truncated() {
    let d = tempdir("names");
    let names = huge_names(4, MIB as usize);
    // Distinct stacks, each 32 frames deep over the four functions: a few KB compressed.
    let write = |name: &str, seed: u64| {
        let mut next = rng(seed);
        let stacks: Vec<(Vec<usize>, i64)> = (0..8)
            .map(|_| ((0..32).map(|_| next() as usize % 4).collect(), 1_000_000))
            .collect();
        let bytes = gzip(&profile(names.clone(), &stacks).encode_to_vec());
        let path = d.join(name);
        std::fs::write(&path, &bytes).unwrap();
        path
    };
    let a = write("a.pb.gz", 7);
    let b = write("b.pb.gz", 11);
    let on_disk = std::fs::metadata(&a).unwrap().len();
    assert!(on_disk < 64 * 1024, "{on_disk} bytes");
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    let limit = Duration::from_secs(60);

    let svg = d.join("out.svg");
    let r = run(&d, &["flamegraph", a, "-o", svg.to_str().unwrap()], limit);
    eprintln!("flamegraph: {r:?}");
    assert!(!r.timed_out && r.code == Some(0), "flamegraph: {r:?}");
    assert!(
        r.peak_rss < 200_000_000,
        "flamegraph: peak RSS {} MB for a {on_disk}-byte file",
        r.peak_rss / 1_000_000
    );
    let svg_len = std::fs::metadata(&svg).unwrap().len();
    assert!(svg_len < 16 * MIB, "SVG of {svg_len} bytes");
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(
        text.contains("a::xxx") && text.contains('…'),
        "names shown, truncated"
    );

    // top and diff show the names truncated too.
    for args in [vec!["top", a], vec!["diff", a, b]] {
        let r = run(&d, &args, limit);
        eprintln!("{args:?}: {r:?}");
        assert!(!r.timed_out && r.code == Some(0), "{args:?}: {r:?}");
        assert!(r.stdout.contains('…'), "{args:?}: {r:?}");
        let longest = r.stdout.lines().map(str::len).max().unwrap_or(0);
        assert!(longest < 4096, "{args:?}: a line of {longest} bytes");
        assert!(r.peak_rss < 200_000_000, "{args:?}: {r:?}");
    }
}

#[test]
fn deep_stacks_of_long_names_are_refused_not_rendered() {
    let d = tempdir("deep");
    // One sample 100k frames deep over four 64 KiB names: under 1 KB on disk, and 100k frames of
    // a name cut to 1 KiB is still 100 MB of folded text (6.5 GB with the names whole).
    let names = huge_names(4, 64 * 1024);
    let stack: Vec<usize> = (0..100_000).map(|i| i % 4).collect();
    let bytes = gzip(&profile(names, &[(stack, 1)]).encode_to_vec());
    let f = d.join("deep.pb.gz");
    std::fs::write(&f, &bytes).unwrap();
    let f = f.to_str().unwrap();
    let svg = d.join("out.svg");
    let r = run_capped(
        &d,
        &["flamegraph", f, "-o", svg.to_str().unwrap()],
        Duration::from_secs(60),
        Some(4 << 30),
    );
    eprintln!("flamegraph: {r:?}");
    assert!(!r.timed_out && r.code == Some(2), "{r:?}");
    assert!(
        r.stderr.contains("deep.pb.gz")
            && r.stderr.contains("folded stacks")
            && r.stderr.contains("64 MiB")
            && r.stderr.contains("--max-decompressed-size"),
        "{r:?}"
    );
    assert!(r.peak_rss < 200_000_000, "{r:?}");
    // top and diff need no text per stack: they work.
    for args in [vec!["top", f], vec!["diff", f, f]] {
        let r = run_capped(&d, &args, Duration::from_secs(60), Some(4 << 30));
        eprintln!("{args:?}: {r:?}");
        assert!(!r.timed_out && r.code == Some(0), "{args:?}: {r:?}");
        assert!(r.peak_rss < 200_000_000, "{args:?}: {r:?}");
    }
}

#[test]
fn max_decompressed_size_flag_raises_the_cap() {
    let d = tempdir("cap");
    // About 200 KiB inflated, a few KiB compressed.
    let names: Vec<String> = (0..2000)
        .map(|i| format!("app::some_rather_long_module_path::function_number_{i:06}_{i:0>40}"))
        .collect();
    let stacks: Vec<(Vec<usize>, i64)> = (0..2000).map(|i| (vec![i, 0], 10)).collect();
    let p = profile(names, &stacks);
    let raw = p.encode_to_vec();
    assert!(raw.len() > 128 * 1024, "{} bytes", raw.len());
    let gz = d.join("big.pb.gz");
    std::fs::write(&gz, gzip(&raw)).unwrap();
    let plain = d.join("big.pb");
    std::fs::write(&plain, &raw).unwrap();
    let limit = Duration::from_secs(60);

    for f in [&gz, &plain] {
        let f = f.to_str().unwrap();
        let r = run(&d, &["top", "--max-decompressed-size", "64K", f], limit);
        assert_eq!(r.code, Some(2), "{r:?}");
        assert!(
            r.stderr.contains(f)
                && r.stderr.contains("64 KiB")
                && r.stderr.contains("--max-decompressed-size"),
            "{r:?}"
        );
        // Raised: the same file is read (the flag works before or after the subcommand).
        let r = run(&d, &["top", f, "--max-decompressed-size", "1M"], limit);
        assert_eq!(r.code, Some(0), "{r:?}");
        assert!(r.stdout.contains("in 2000 samples"), "{r:?}");
        let r = run(
            &d,
            &["--max-decompressed-size", "1048576", "diff", f, f],
            limit,
        );
        assert_eq!(r.code, Some(0), "{r:?}");
    }
    let r = run(
        &d,
        &[
            "top",
            "--max-decompressed-size",
            "lots",
            gz.to_str().unwrap(),
        ],
        limit,
    );
    assert_eq!(r.code, Some(2), "{r:?}");
    assert!(r.stderr.contains("lots"), "{r:?}");
}
