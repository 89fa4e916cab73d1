//! The `ferroprof` binary on real files: top, flamegraph, diff, and clean errors on bad input.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, SystemTime};

use ferroprof::recorder::pprof::EncodeOptions;
use ferroprof::recorder::{Frame, Label, Profile, Sample, SampleType};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_ferroprof"))
}

fn run(args: &[&str]) -> Output {
    bin().args(args).output().expect("run ferroprof")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ferroprof-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A profile written by the recorder's own encoder: `hot` has 3x the CPU of `cold`.
fn recorder_profile(dir: &Path, name: &str, hot: i64, cold: i64) -> PathBuf {
    let types = [
        SampleType::CpuTime,
        SampleType::CpuSamples,
        SampleType::WallTime,
        SampleType::HeapLiveSize,
    ];
    let start = SystemTime::now();
    let mut p = Profile::new(&types, None, start);
    let stack = |leaf: &'static str| {
        [
            Frame::sym(leaf, "src/work.rs", 10),
            Frame::sym("demo::work", "src/work.rs", 20),
            Frame::sym("main", "src/main.rs", 3),
        ]
    };
    let labels = [Label::str("thread name", "main")];
    for (leaf, ns, heap) in [
        ("demo::burn_hot", hot, 0),
        ("demo::burn_cold", cold, 0),
        ("demo::keep_live", 0, 64 << 20),
    ] {
        let frames = stack(leaf);
        p.add(&Sample {
            frames: &frames,
            values: &[ns, ns / 10_000_000, ns, heap],
            labels: &labels,
            end_timestamp_ns: 0,
        })
        .unwrap();
    }
    let enc = p
        .encode(
            start + Duration::from_secs(5),
            &EncodeOptions::default(),
            None,
        )
        .unwrap();
    let path = dir.join(name);
    std::fs::write(&path, &enc.bytes).unwrap();
    path
}

#[test]
fn top_shows_functions_by_flat_value_with_units() {
    let d = tempdir("top");
    let f = recorder_profile(&d, "cpu.pprof", 3_000_000_000, 1_000_000_000);
    let o = run(&["top", f.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[0].contains("cpu-time (nanoseconds), total 4.00s"),
        "{text}"
    );
    let hot = lines
        .iter()
        .position(|l| l.ends_with("demo::burn_hot"))
        .expect(&text);
    let cold = lines
        .iter()
        .position(|l| l.ends_with("demo::burn_cold"))
        .expect(&text);
    assert!(hot < cold, "{text}");
    assert!(
        lines[hot].contains("3.00s") && lines[hot].contains("75.00%"),
        "{text}"
    );
    // main is in every stack: flat 0, cum 100 %.
    assert!(
        text.lines()
            .any(|l| l.ends_with("  main") && l.contains("100.00%")),
        "{text}"
    );

    let o = run(&[
        "top",
        f.to_str().unwrap(),
        "--type",
        "heap-live-size",
        "-n",
        "1",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(
        text.contains("64.00MiB") && text.contains("demo::keep_live"),
        "{text}"
    );
    assert!(text.contains("Showing top 1 of"), "{text}");
    assert!(!text.contains("demo::burn_hot"), "{text}");

    let o = run(&[
        "top",
        f.to_str().unwrap(),
        "--type",
        "wall-time",
        "--cum",
        "-n",
        "2",
    ]);
    assert!(o.status.success());
    // demo::work and main both have all of it (ties sort by name).
    let text = stdout(&o);
    let rows: Vec<&str> = text.lines().skip(3).collect();
    assert!(
        rows[0].ends_with("demo::work") && rows[1].ends_with("  main"),
        "{text}"
    );
    assert!(rows.iter().all(|r| r.contains("100.00%")), "{text}");
}

#[test]
fn unknown_type_lists_the_available_ones() {
    let d = tempdir("types");
    let f = recorder_profile(&d, "p.pprof", 1, 1);
    let o = run(&["top", f.to_str().unwrap(), "--type", "alloc-samples"]);
    assert_eq!(o.status.code(), Some(2));
    let e = stderr(&o);
    assert!(
        e.contains("no sample type \"alloc-samples\"") && e.contains("cpu-time, cpu-samples"),
        "{e}"
    );
}

#[test]
fn flamegraph_writes_an_svg() {
    let d = tempdir("flame");
    let f = recorder_profile(&d, "p.pprof", 3_000_000_000, 1_000_000_000);
    let svg = d.join("out.svg");
    let o = run(&[
        "flamegraph",
        f.to_str().unwrap(),
        "-o",
        svg.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(&svg).unwrap();
    assert!(
        text.starts_with("<?xml") && text.contains("<svg"),
        "not an SVG"
    );
    for f in ["demo::burn_hot", "demo::burn_cold", "demo::work", "main"] {
        assert!(text.contains(f), "flame graph lacks {f}");
    }
    assert!(!text.contains("demo::keep_live"), "zero-CPU function drawn");

    let o = run(&[
        "flamegraph",
        f.to_str().unwrap(),
        "-o",
        "/nonexistent-dir/x.svg",
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("cannot write /nonexistent-dir/x.svg"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn diff_shows_per_function_deltas() {
    let d = tempdir("diff");
    let a = recorder_profile(&d, "a.pprof", 3_000_000_000, 1_000_000_000);
    let b = recorder_profile(&d, "b.pprof", 1_000_000_000, 2_000_000_000);
    let o = run(&[
        "diff",
        a.to_str().unwrap(),
        b.to_str().unwrap(),
        "--type",
        "cpu-time",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(
        text.contains("total A 4.00s -> B 3.00s, delta -1.00s (-25.0%)"),
        "{text}"
    );
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[2].ends_with("demo::burn_hot") && lines[2].contains("-2.00s"),
        "{text}"
    );
    assert!(
        lines[3].ends_with("demo::burn_cold")
            && lines[3].contains("+1.00s")
            && lines[3].contains("+100.0%"),
        "{text}"
    );
    assert!(
        !text.contains("demo::keep_live"),
        "unchanged functions are left out: {text}"
    );
}

#[test]
fn bad_files_fail_cleanly_with_the_file_named() {
    let d = tempdir("bad");
    let missing = d.join("missing.pprof");
    let o = run(&["top", missing.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains(&format!("cannot read {}", missing.display())),
        "{}",
        stderr(&o)
    );

    let empty = d.join("empty.pprof");
    std::fs::write(&empty, b"").unwrap();
    let o = run(&["top", empty.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2));
    assert!(
        stderr(&o).contains("empty.pprof is empty"),
        "{}",
        stderr(&o)
    );

    // Random bytes, gzip-looking bytes, text: errors, never a panic.
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let good = std::fs::read(recorder_profile(&d, "good.pprof", 5, 5)).unwrap();
    for i in 0..40 {
        let bytes: Vec<u8> = match i % 4 {
            0 => (0..1 + next() % 4096).map(|_| next() as u8).collect(),
            1 => {
                let mut b = vec![0x1f, 0x8b];
                b.extend((0..next() % 512).map(|_| next() as u8));
                b
            }
            2 => b"this is a text file, not a profile\n".repeat(1 + (next() % 10) as usize),
            // A real profile with a few bytes flipped.
            _ => {
                let mut b = good.clone();
                for _ in 0..3 {
                    let at = (next() as usize) % b.len();
                    b[at] ^= 1 + (next() as u8 % 255);
                }
                b
            }
        };
        let f = d.join(format!("junk{i}.pprof"));
        std::fs::write(&f, &bytes).unwrap();
        for args in [
            vec!["top", f.to_str().unwrap()],
            vec!["diff", f.to_str().unwrap(), f.to_str().unwrap()],
            vec![
                "flamegraph",
                f.to_str().unwrap(),
                "-o",
                d.join("j.svg").to_str().unwrap(),
            ],
        ] {
            let o = run(&args);
            let e = stderr(&o);
            assert!(!e.contains("panicked"), "{args:?} panicked: {e}");
            // A flipped byte can leave a decodable profile; otherwise the error names the file.
            if !o.status.success() {
                assert_eq!(o.status.code(), Some(2), "{args:?}: {e}");
                assert!(e.contains(&format!("junk{i}.pprof")), "{args:?}: {e}");
            }
        }
    }
    let o = run(&["top", empty.to_str().unwrap()]);
    assert!(!stderr(&o).contains("panicked"));
}

#[test]
fn usage_errors_exit_2() {
    let o = run(&["top"]);
    assert_eq!(o.status.code(), Some(2));
    let o = run(&["frobnicate"]);
    assert_eq!(o.status.code(), Some(2));
    let o = run(&["--help"]);
    assert!(o.status.success());
    for cmd in ["demo", "record", "top", "flamegraph", "diff"] {
        assert!(stdout(&o).contains(cmd), "{}", stdout(&o));
    }
    // The one-line description says what the command is: a profiler of any program first.
    assert!(
        stdout(&o).starts_with("Profile any program (record"),
        "{}",
        stdout(&o)
    );
}
