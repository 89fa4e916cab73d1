//! `ferroprof top`/`flamegraph`/`diff` defaults: the file's default sample type, and
//! `diff --per-second`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ferroprof_pprof::{Profile, ProfileBuilder};

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferroprof"))
        .args(args)
        .output()
        .expect("run ferroprof")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn ok(args: &[&str]) -> String {
    let o = run(args);
    assert!(o.status.success(), "{args:?}: {}", stderr(&o));
    stdout(&o)
}

/// Runs a command that must fail with status 2; returns its stderr.
fn fails(args: &[&str]) -> String {
    let o = run(args);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{args:?}: {}{e}", stdout(&o));
    assert!(!e.contains("panicked"), "{args:?}: {e}");
    e
}

fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ferroprof-cli-df-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn write(dir: &Path, name: &str, p: &Profile) -> String {
    let path = dir.join(name);
    std::fs::write(&path, p.encode_gzip()).unwrap();
    path.to_str().unwrap().to_owned()
}

fn string_index(p: &mut Profile, s: &str) -> i64 {
    if let Some(i) = p.string_table.iter().position(|t| t == s) {
        return i as i64;
    }
    p.string_table.push(s.to_owned());
    p.string_table.len() as i64 - 1
}

/// The rows of a `top` report: (function, flat text), in order.
fn rows(top: &str) -> Vec<(String, String)> {
    top.lines()
        .skip_while(|l| !l.contains("flat%"))
        .skip(1)
        .filter_map(|l| {
            let at = l.rfind("  ")?;
            let flat = l[..at].split_whitespace().next()?;
            Some((l[at + 2..].to_owned(), flat.to_owned()))
        })
        .collect()
}

/// An idle thread with many cpu-samples and no CPU time, and a busy one: ranked by
/// `cpu-samples` the idle one is on top, by `cpu-time` the busy one.
fn idle_and_busy() -> Profile {
    ProfileBuilder::new(&[
        ("cpu-samples", "count"),
        ("cpu-time", "nanoseconds"),
        ("alloc-samples", "count"),
    ])
    .sample(&["app::idle_wait", "main"], &[100, 0, 1], &[])
    .sample(&["app::busy_work", "main"], &[10, 5_000_000_000, 3], &[])
    .sample(&["app::allocate", "main"], &[1, 1_000, 50], &[])
    .build()
}

#[test]
fn top_and_flamegraph_use_the_files_default_sample_type() {
    let d = tempdir("default");
    let mut p = idle_and_busy();
    // Named default: alloc-samples, though cpu-time is there too.
    p.default_sample_type = string_index(&mut p, "alloc-samples");
    let with_alloc_default = write(&d, "alloc-default.pprof", &p);
    p.default_sample_type = string_index(&mut p, "cpu-time");
    let with_cpu_default = write(&d, "cpu-default.pprof", &p);
    // No default: cpu-time rather than the first type (cpu-samples).
    p.default_sample_type = 0;
    let without = write(&d, "no-default.pprof", &p);

    for f in [&with_cpu_default, &without] {
        let text = ok(&["top", f]);
        assert!(
            text.lines()
                .next()
                .unwrap()
                .contains(": cpu-time (nanoseconds)"),
            "{text}"
        );
        assert_eq!(rows(&text)[0].0, "app::busy_work", "{text}");
        let svg = d.join("default.svg");
        let out = ok(&["flamegraph", f, "-o", svg.to_str().unwrap()]);
        assert!(out.contains("stacks of cpu-time"), "{out}");
        let svg = std::fs::read_to_string(&svg).unwrap();
        assert!(svg.contains("app::busy_work") && !svg.contains("app::idle_wait"));
    }
    let text = ok(&["top", &with_alloc_default]);
    assert!(text.contains(": alloc-samples (count)"), "{text}");
    assert_eq!(rows(&text)[0].0, "app::allocate", "{text}");

    // An explicit type still wins over the default.
    let text = ok(&["top", &with_cpu_default, "--type", "cpu-samples"]);
    assert_eq!(rows(&text)[0].0, "app::idle_wait", "{text}");
    // And an unknown one lists what the file has.
    let e = fails(&[
        "flamegraph",
        &with_cpu_default,
        "--type",
        "cpu",
        "-o",
        "/dev/null",
    ]);
    assert!(
        e.contains("no sample type \"cpu\"") && e.contains("cpu-samples, cpu-time, alloc-samples"),
        "{e}"
    );
}

#[test]
fn without_a_default_all_zero_columns_are_passed_over() {
    // An allocation profile that still carries all-zero CPU columns.
    let p = ProfileBuilder::new(&[
        ("cpu-samples", "count"),
        ("cpu-time", "nanoseconds"),
        ("wall-time", "nanoseconds"),
        ("alloc-samples", "count"),
    ])
    .sample(&["app::small", "main"], &[0, 0, 0, 2], &[])
    .sample(&["app::big", "main"], &[0, 0, 0, 9], &[])
    .build();
    let d = tempdir("zero");
    let f = write(&d, "allocs.pprof", &p);
    let text = ok(&["top", &f]);
    assert!(text.contains(": alloc-samples (count), total 11"), "{text}");
    assert_eq!(rows(&text)[0].0, "app::big", "{text}");
}

/// A profile of `secs` seconds in which `f` and `g` used the given CPU.
fn timed(secs: i64, f: i64, g: i64) -> Profile {
    ProfileBuilder::new(&[("cpu-time", "nanoseconds"), ("heap-live-size", "bytes")])
        .time(1_700_000_000_000_000_000, secs * 1_000_000_000)
        .sample(&["app::f", "main"], &[f, 1 << 20], &[])
        .sample(&["app::g", "main"], &[g, 0], &[])
        .build()
}

#[test]
fn diff_per_second_compares_profiles_of_different_durations() {
    const S: i64 = 1_000_000_000;
    let d = tempdir("rates");
    let a = write(&d, "a-10s.pprof", &timed(10, S, 2 * S));
    // Same rates over 60 s.
    let same = write(&d, "same-60s.pprof", &timed(60, 6 * S, 12 * S));
    // f at the same rate, g 50 % faster.
    let more = write(&d, "more-60s.pprof", &timed(60, 6 * S, 18 * S));

    // Totals: everything reads +500 %, and a note says why.
    let o = run(&["diff", &a, &same]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("delta +15.00s (+500.0%)"),
        "{}",
        stdout(&o)
    );
    assert!(stderr(&o).contains("--per-second"), "{}", stderr(&o));

    let text = ok(&["diff", &a, &same, "--per-second"]);
    assert!(
        text.starts_with(
            "cpu-time (nanoseconds) per second (A covers 10.00s, B 60.00s): \
             total A 300.00ms/s -> B 300.00ms/s, delta 0ns/s (+0.0%)"
        ),
        "{text}"
    );
    assert!(text.contains("No per-function differences"), "{text}");

    let text = ok(&["diff", &a, &more, "--per-second"]);
    assert!(text.contains("(+33.3%)"), "{text}");
    let changed: Vec<&str> = text.lines().filter(|l| l.contains("app::")).collect();
    assert_eq!(changed.len(), 1, "{text}");
    assert!(
        changed[0].ends_with("app::g")
            && changed[0].contains("200.00ms/s")
            && changed[0].contains("300.00ms/s")
            && changed[0].contains("+100.00ms/s")
            && changed[0].contains("+50.0%"),
        "{text}"
    );

    // A profile that does not say how long it covers.
    let mut p = timed(10, S, S);
    p.duration_nanos = 0;
    let undated = write(&d, "undated.pprof", &p);
    let e = fails(&["diff", &undated, &same, "--per-second"]);
    assert!(e.contains("undated.pprof") && e.contains("duration"), "{e}");
    // Live heap is a snapshot: per second means nothing.
    let e = fails(&[
        "diff",
        &a,
        &same,
        "--per-second",
        "--type",
        "heap-live-size",
    ]);
    assert!(e.contains("snapshot"), "{e}");
}
