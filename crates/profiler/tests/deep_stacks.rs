//! Stacks deeper than the unwinder's buffer: a flame graph of deep recursion must still grow
//! from the thread's start, and show where frames were left out.
//!
//! Two threads burn CPU and allocate at the bottom of a recursion through one
//! `#[inline(never)]` function: 400 deep (under the limit: every frame, down to the thread's
//! start), and `MAX_FRAMES + 200` deep (over it: the leaf end, a `[truncated: N+ frames]`
//! marker, then the root end with the thread's entry). The written file is read by the
//! independent decoder and by `go tool pprof -raw`. With the old 128-frame limit, and no
//! marker, both threads' stacks ended inside the recursion.

mod profiler_support;

use std::alloc::System;
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::Duration;

use ferroprof::{Profiler, Profiles, SamplingAllocator, MAX_FRAMES};
use ferroprof_pprof::Profile;
use profiler_support::{temp_dir, thread_cpu};

#[global_allocator]
static GLOBAL: SamplingAllocator<System> = SamplingAllocator::new(System);

const SHALLOW: u32 = 400;
const DEEP: u32 = MAX_FRAMES as u32 + 200;

/// Burns CPU and allocates until the thread used `cpu` of its own CPU (the checks below need
/// that many samples, however loaded the machine): the leaf of every sample of the test's
/// threads.
#[inline(never)]
fn deep_stacks_leaf(cpu: Duration) -> u64 {
    let end = thread_cpu() + cpu;
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    while thread_cpu() < end {
        for i in 0..20_000u64 {
            x = black_box(x.rotate_left(7).wrapping_mul(0x2545_F491_4F6C_DD1D) ^ i);
        }
        x ^= deep_stacks_allocate(x);
    }
    x
}

#[inline(never)]
fn deep_stacks_allocate(seed: u64) -> u64 {
    let v = black_box(vec![seed as u8; 4096]);
    u64::from(v[17])
}

/// One frame per level: never inlined, and the call is not in tail position (its result goes
/// through `black_box` and an addition), so no level is folded into another.
#[inline(never)]
fn deep_stacks_recurse(depth: u32, cpu: Duration) -> u64 {
    if depth == 0 {
        return deep_stacks_leaf(cpu);
    }
    let below = black_box(deep_stacks_recurse(depth - 1, cpu));
    below.wrapping_add(u64::from(depth))
}

/// The thread's entry: the outermost frame of the test's own code.
#[inline(never)]
fn deep_stacks_thread(depth: u32, cpu: Duration) -> u64 {
    black_box(deep_stacks_recurse(depth, cpu))
}

fn pprof_files(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "pprof"))
        .collect()
}

fn is_marker(name: &str) -> bool {
    name.starts_with("[truncated: ") && name.ends_with("+ frames]")
}

/// What one sample's stack (innermost first) shows.
struct Shape {
    leaf: bool,
    recursion: usize,
    markers: Vec<usize>,
    entry: Option<usize>,
    /// Frames outside the entry (the thread's start: std's thread main, libc's).
    outside_entry: usize,
}

fn shape(names: &[String]) -> Shape {
    let entry = names.iter().position(|n| n.ends_with("deep_stacks_thread"));
    Shape {
        leaf: names[..names.len().min(32)]
            .iter()
            .any(|n| n.ends_with("deep_stacks_leaf")),
        recursion: names
            .iter()
            .filter(|n| n.ends_with("deep_stacks_recurse"))
            .count(),
        markers: (0..names.len()).filter(|&i| is_marker(&names[i])).collect(),
        entry,
        outside_entry: entry.map_or(0, |e| names.len() - 1 - e),
    }
}

/// The stacks (names, innermost first) and `value`s of the samples of the thread named `name`.
/// Left out: CPU samples that interrupted a sampled allocation's walk, which runs on a spare
/// stack of the profiler's and is seen alone (a stack that ends at `Spare::run`).
fn samples_of(p: &Profile, name: &str, value: &str) -> Vec<(Vec<String>, i64)> {
    let i = p.value_index(value).expect("value type");
    p.sample
        .iter()
        .filter(|s| s.value[i] != 0 && p.label_str(s, "thread name") == Some(name))
        .map(|s| (p.stack_names(s), s.value[i]))
        .filter(|(names, _)| {
            !names
                .iter()
                .any(|n| n == "ferroprof::unwind::spare::Spare::run")
        })
        .collect()
}

/// Asserts that the samples of thread `name` holding at least 90% of `value` are `ok`.
fn mostly(p: &Profile, name: &str, value: &str, what: &str, ok: impl Fn(&Shape) -> bool) {
    let samples = samples_of(p, name, value);
    let total: i64 = samples.iter().map(|s| s.1).sum();
    let good: i64 = samples
        .iter()
        .filter(|s| ok(&shape(&s.0)))
        .map(|s| s.1)
        .sum();
    let bad = samples.iter().find(|s| !ok(&shape(&s.0)));
    assert!(total >= 10, "{name}: {value} only {total}");
    assert!(
        good * 10 >= total * 9,
        "{name}: {value}: {good} of {total} {what}; one that does not: {:?}",
        bad.map(|s| (shape(&s.0).recursion, s.0[..4].to_vec(), outer_names(&s.0)))
    );
}

#[test]
fn deep_recursion_keeps_its_thread_root_and_marks_the_cut() {
    let dir = temp_dir("deep-stacks");
    let guard = Profiler::builder()
        .service("deep-stacks-test")
        .cpu_hz(250)
        .alloc_interval_bytes(64 * 1024)
        .profiles(Profiles {
            cpu: true,
            wall: true,
            alloc: true,
            heap: false,
        })
        .period(Duration::from_secs(3600))
        .output_dir(&dir)
        .start()
        .expect("profiler starts");
    let cpu = Duration::from_millis(2500);
    let threads: Vec<_> = [("deep-shallow", SHALLOW), ("deep-over", DEEP)]
        .into_iter()
        .map(|(name, depth)| {
            std::thread::Builder::new()
                .name(name.into())
                // Room for the recursion's frames in unoptimized builds.
                .stack_size(32 << 20)
                .spawn(move || deep_stacks_thread(depth, cpu))
                .unwrap()
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    guard.stop().expect("stop writes the profile");

    let files = pprof_files(&dir);
    assert_eq!(files.len(), 1, "one profile written: {files:?}");
    let bytes = std::fs::read(&files[0]).unwrap();
    let p = ferroprof_pprof::decode(&bytes).expect("the written profile decodes");

    for value in ["cpu-samples", "alloc-samples-unscaled"] {
        // Under the limit: the whole stack, the thread's start included, and no marker.
        mostly(
            &p,
            "deep-shallow",
            value,
            "reach the thread's start",
            |sh| {
                sh.recursion >= SHALLOW as usize
                    && sh.markers.is_empty()
                    && sh.entry.is_some()
                    && sh.outside_entry > 0
            },
        );
        // Over the limit: leaf end, one marker, root end down to the thread's start.
        mostly(
            &p,
            "deep-over",
            value,
            "show leaf, marker and thread start",
            |sh| {
                let [m] = sh.markers[..] else { return false };
                sh.leaf
                    && sh.entry.is_some_and(|e| e > m)
                    && sh.outside_entry > 0
                    && sh.recursion > MAX_FRAMES / 2
                    && sh.recursion < DEEP as usize
            },
        );
    }
    // The marker is a function of its own, named for every reader.
    let markers: Vec<&str> = p
        .function
        .iter()
        .map(|f| p.str(f.name))
        .filter(|n| n.starts_with("[truncated"))
        .collect();
    assert!(
        !markers.is_empty() && markers.iter().all(|n| is_marker(n)),
        "{markers:?}"
    );

    if let Some(go) = ferroprof_pprof::go_tool::go_for_tests() {
        let f = files[0].to_str().unwrap();
        let raw = ferroprof_pprof::go_tool::pprof_for_tests(&go, &["-raw", f]);
        for want in [markers[0], "deep_stacks_thread", "deep_stacks_leaf"] {
            assert!(raw.contains(want), "go tool pprof -raw lacks {want}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The outermost frames of a stack, for failure messages.
fn outer_names(names: &[String]) -> Vec<String> {
    let from = names.len().saturating_sub(16);
    let mut out = vec![format!("{} frames, outermost:", names.len())];
    out.extend(names[from..].iter().cloned());
    out
}
