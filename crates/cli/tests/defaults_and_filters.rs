//! `ferroprof top`/`flamegraph`/`diff` defaults and filters: the file's default sample type,
//! `diff --per-second`, `--focus`/`--ignore`/`--tag`, and a flame graph that fits its window.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use ferroprof_pprof::{Label, Profile, ProfileBuilder};

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

/// Samples on three threads; `thread id` is a numeric label.
fn threads() -> Profile {
    let mut p = ProfileBuilder::new(&[("cpu-time", "nanoseconds")])
        .sample(
            &["app::hot", "app::work", "main"],
            &[30],
            &[("thread name", "worker")],
        )
        .sample(
            &["app::cold", "app::work", "main"],
            &[10],
            &[("thread name", "worker")],
        )
        .sample(
            &["rt::poll", "rt::run", "main"],
            &[5],
            &[("thread name", "tokio-rt-worker")],
        )
        .sample(
            &["app::hot", "app::helper"],
            &[2],
            &[("thread name", "main")],
        )
        .build();
    let key = string_index(&mut p, "thread id");
    for (s, id) in p.sample.iter_mut().zip([7, 8, 9, 1]) {
        s.label.push(Label {
            key,
            str: 0,
            num: id,
            num_unit: 0,
        });
    }
    p
}

/// The functions a `top` report lists with a non-zero flat value.
fn flat_functions(text: &str) -> Vec<String> {
    let mut fs: Vec<String> = rows(text)
        .into_iter()
        .filter(|(_, flat)| flat != "0ns")
        .map(|(f, _)| f)
        .collect();
    fs.sort();
    fs
}

#[test]
fn focus_ignore_and_tag_select_samples() {
    let d = tempdir("filters");
    let f = write(&d, "threads.pprof", &threads());
    let top = |extra: &[&str]| {
        let mut args = vec!["top", f.as_str()];
        args.extend_from_slice(extra);
        ok(&args)
    };

    let text = top(&["--focus", "^app::work$"]);
    assert_eq!(flat_functions(&text), ["app::cold", "app::hot"], "{text}");
    assert!(text.contains("total 40ns in 2 samples"), "{text}");
    assert!(
        text.lines().next().unwrap().contains("kept 2 of 4 samples"),
        "{text}"
    );
    // Unanchored: matches anywhere in the name.
    let text = top(&["--focus", "hot"]);
    assert_eq!(flat_functions(&text), ["app::hot"], "{text}");
    assert!(text.contains("total 32ns"), "{text}");

    let text = top(&["--ignore", "cold|poll"]);
    assert_eq!(flat_functions(&text), ["app::hot"], "{text}");
    let text = top(&["--focus", "work", "--ignore", "cold"]);
    assert_eq!(flat_functions(&text), ["app::hot"], "{text}");
    assert!(text.contains("total 30ns"), "{text}");

    let text = top(&["--tag", "thread name=tokio-rt-worker"]);
    assert_eq!(flat_functions(&text), ["rt::poll"], "{text}");
    // Numeric labels compare as numbers.
    let text = top(&["--tag", "thread id=8"]);
    assert_eq!(flat_functions(&text), ["app::cold"], "{text}");
    // Repeated tags must all match.
    let text = top(&["--tag", "thread name=worker", "--tag", "thread id=7"]);
    assert_eq!(flat_functions(&text), ["app::hot"], "{text}");
    assert!(text.contains("total 30ns"), "{text}");
    // A value no sample has: nothing kept, and the values the key does have.
    let text = top(&["--tag", "thread name=tokio"]);
    assert!(text.contains("kept 0 of 4 samples"), "{text}");
    assert!(text.contains("\"tokio-rt-worker\""), "{text}");

    let svg = d.join("focus.svg");
    let out = ok(&[
        "flamegraph",
        &f,
        "-o",
        svg.to_str().unwrap(),
        "--tag",
        "thread name=worker",
        "--ignore",
        "cold",
    ]);
    assert!(out.contains("kept 1 of 4 samples"), "{out}");
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(
        svg.contains("app::hot") && svg.contains("app::work"),
        "focus lost"
    );
    for gone in ["app::cold", "rt::poll", "app::helper"] {
        assert!(!svg.contains(gone), "{gone} drawn");
    }
    let e = fails(&[
        "flamegraph",
        &f,
        "-o",
        "/dev/null",
        "--focus",
        "nothing-matches",
    ]);
    assert!(
        e.contains("kept 0 of 4 samples") && e.contains("nothing to draw"),
        "{e}"
    );

    // diff applies the filters to both sides.
    let mut b = threads();
    b.sample[2].value[0] = 50; // rt::poll
    b.sample[1].value[0] = 20; // app::cold
    let b = write(&d, "threads-b.pprof", &b);
    let text = ok(&["diff", &f, &b, "--tag", "thread name=tokio-rt-worker"]);
    assert!(
        text.contains("rt::poll") && !text.contains("app::cold"),
        "{text}"
    );
}

#[test]
fn bad_filters_fail_with_a_message() {
    let d = tempdir("bad-filters");
    let f = write(&d, "threads.pprof", &threads());
    for (flag, value) in [("--focus", "app::(hot"), ("--ignore", "[z-a]")] {
        let e = fails(&["top", &f, flag, value]);
        assert!(
            e.contains(flag) && e.contains(value) && e.contains("not a valid regular expression"),
            "{e}"
        );
    }
    for tag in ["thread name", "=worker", "thread name="] {
        let e = fails(&["top", &f, "--tag", tag]);
        assert!(e.contains("--tag") && e.contains("KEY=VALUE"), "{tag}: {e}");
    }
    // A label no sample has: most likely a typo; the error lists the file's labels.
    let e = fails(&["top", &f, "--tag", "thread nam=worker"]);
    assert!(
        e.contains("threads.pprof")
            && e.contains("no sample has a label \"thread nam\"")
            && e.contains("thread id, thread name"),
        "{e}"
    );
}

#[test]
fn flame_graph_fits_the_window() {
    let d = tempdir("fit");
    let f = write(&d, "threads.pprof", &threads());
    let svg = d.join("fit.svg");
    ok(&["flamegraph", &f, "-o", svg.to_str().unwrap()]);
    let text = std::fs::read_to_string(&svg).unwrap();
    let start = text.find("<svg ").expect("an svg element");
    let root = &text[start..start + text[start..].find('>').unwrap()];
    assert!(root.contains(" width=\"100%\""), "{root}");
    assert!(root.contains(" viewBox=\"0 0 "), "{root}");
    assert!(root.contains("preserveAspectRatio="), "{root}");
    // The width is given once, as 100 %: no fixed pixel width left on the root.
    assert_eq!(root.matches(" width=").count(), 1, "{root}");
}

#[test]
fn help_describes_the_new_options() {
    for cmd in ["top", "flamegraph"] {
        let text = ok(&[cmd, "--help"]);
        for opt in [
            "--focus <REGEX>",
            "--ignore <REGEX>",
            "--tag <KEY=VALUE>",
            "default_sample_type",
        ] {
            assert!(text.contains(opt), "{cmd} --help lacks {opt}: {text}");
        }
    }
    let text = ok(&["diff", "--help"]);
    assert!(
        text.contains("--per-second") && text.contains("duration"),
        "{text}"
    );
}
