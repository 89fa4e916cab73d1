//! Whole-process benchmarks, each variant in its own process, rounds interleaved so machine
//! noise hits every variant alike. Reports medians and ratios (markdown, also written to
//! `target/ferroprof-bench-report.md`).
//!
//! `cargo bench -p ferroprof-bench --bench whole_process`
//! The programs are built with every function and loop 64-byte aligned, in `target/aligned`
//! (see [`ALIGN_FLAGS`]).
//! Knobs: FERROPROF_BENCH_ROUNDS (CPU rounds, default 7), FERROPROF_BENCH_ALLOC_ROUNDS (default
//! 30: two runs of one allocation program differ by up to +-10% here, so the allocation
//! comparison needs many short rounds), FERROPROF_BENCH_OPS (allocation operations per thread,
//! default 2 000 000; dhat runs 1/25 of it), FERROPROF_BENCH_CPU_ROUNDS (default 80 000).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use ferroprof_bench::median;

fn env_u64(k: &str, d: u64) -> u64 {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

/// Where the benchmark programs are built: a target directory of their own under this one,
/// since they are built with other flags ([`ALIGN_FLAGS`]).
fn aligned_target() -> PathBuf {
    // target/<profile>/deps/whole_process-<hash> -> target/aligned
    let exe = std::env::current_exe().expect("current exe");
    let target = exe
        .parent()
        .and_then(Path::parent)
        .and_then(Path::parent)
        .expect("target dir");
    target.join("aligned")
}

/// Every function and loop starts on a 64-byte boundary. Two builds of one program whose hot
/// loop and allocator entry points fall at other offsets in their cache lines run up to 1.6%
/// apart with the same instructions (callgrind: the same count to 30 instructions in 338 M).
/// The programs compared here differ in code, so their layouts differ: aligned, that accident
/// no longer moves a ratio.
const ALIGN_FLAGS: &str = "-C llvm-args=-align-all-functions=6 -C llvm-args=-align-loops=64";

fn build_examples() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let flags = match std::env::var("RUSTFLAGS") {
        Ok(f) if !f.trim().is_empty() => format!("{f} {ALIGN_FLAGS}"),
        _ => ALIGN_FLAGS.to_owned(),
    };
    eprintln!(
        "building the benchmark programs into {} (RUSTFLAGS={flags})",
        aligned_target().display()
    );
    let st = Command::new(cargo)
        .args(["build", "--release", "-p", "ferroprof-bench", "--examples"])
        .env("RUSTFLAGS", flags)
        .env("CARGO_TARGET_DIR", aligned_target())
        .status()
        .expect("run cargo");
    assert!(st.success(), "building the benchmark programs failed");
}

/// Runs one program and parses its `RESULT k=v ...` line.
fn run(dir: &Path, name: &str, args: &[&str], env: &[(&str, &str)]) -> BTreeMap<String, f64> {
    let mut cmd = Command::new(dir.join(name));
    cmd.args(args);
    cmd.env_remove("_RJEM_MALLOC_CONF");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap_or_else(|e| panic!("{name}: {e}"));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{name} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = text
        .lines()
        .find(|l| l.starts_with("RESULT"))
        .unwrap_or_else(|| panic!("{name}: no RESULT line in {text}"));
    line.split_whitespace()
        .skip(1)
        .filter_map(|kv| kv.split_once('='))
        .filter_map(|(k, v)| v.parse().ok().map(|v| (k.to_owned(), v)))
        .collect()
}

struct Series(BTreeMap<String, Vec<f64>>);

/// Mean of `v` and the half-width of its 95% confidence interval (normal approximation).
fn mean_ci95(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    if v.len() < 2 {
        return (v.first().copied().unwrap_or(f64::NAN), f64::NAN);
    }
    let mean = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1.0);
    (mean, 1.96 * (var / n).sqrt())
}

/// `0..n` in a random order (Fisher-Yates over the workloads' xorshift).
fn shuffled(n: usize, rng: &mut u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (ferroprof_bench::next(rng) % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

/// A benchmark variant: its name, the program, its argument and extra environment.
type Variant<'a> = (&'a str, &'a str, &'a str, &'a [(&'a str, &'a str)]);

impl Series {
    fn push(&mut self, variant: &str, v: f64) {
        self.0.entry(variant.to_owned()).or_default().push(v);
    }
    fn median(&self, variant: &str) -> f64 {
        let mut v = self.0.get(variant).cloned().unwrap_or_default();
        median(&mut v)
    }
}

fn main() {
    let rounds = env_u64("FERROPROF_BENCH_ROUNDS", 7);
    let alloc_rounds = env_u64("FERROPROF_BENCH_ALLOC_ROUNDS", 30);
    let ops = env_u64("FERROPROF_BENCH_OPS", 2_000_000);
    let cpu_rounds = env_u64("FERROPROF_BENCH_CPU_ROUNDS", 80_000);
    build_examples();
    let dir = aligned_target().join("release").join("examples");
    let mut report = String::new();
    let ops_s = ops.to_string();
    let dhat_ops = (ops / 25).max(1000).to_string();

    // Allocation-heavy workload. Each round runs every variant once, in an order shuffled per
    // round (a fixed order lets a variant inherit the machine state its predecessor leaves), and
    // System twice: the second run is a control whose paired difference shows the noise floor.
    let mut alloc = Series(BTreeMap::new());
    let mut samples = Vec::new();
    let mut paired: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    let big_interval = (1u64 << 30).to_string();
    let je_conf = "prof:true,prof_active:true,lg_prof_sample:19";
    let variants: [Variant<'_>; 7] = [
        ("system", "alloc_system", &ops_s, &[]),
        ("system_again", "alloc_system", &ops_s, &[]),
        ("ferroprof", "alloc_ferroprof", &ops_s, &[]),
        (
            "ferroprof_nosamples",
            "alloc_ferroprof",
            &ops_s,
            &[("FERROPROF_BENCH_INTERVAL", &big_interval)],
        ),
        ("jemalloc", "alloc_jemalloc", &ops_s, &[]),
        (
            "jemalloc_prof",
            "alloc_jemalloc",
            &ops_s,
            &[("_RJEM_MALLOC_CONF", je_conf)],
        ),
        ("dhat", "alloc_dhat", &dhat_ops, &[]),
    ];
    let mut rng = 0x5DEE_CE66_D1CE_4E5Bu64;
    for r in 0..alloc_rounds {
        eprintln!("alloc round {}/{alloc_rounds}", r + 1);
        let mut round = BTreeMap::new();
        for i in shuffled(variants.len(), &mut rng) {
            let (name, program, arg, env) = variants[i];
            let v = run(&dir, program, &[arg], env);
            alloc.push(name, v["cpu_ns_per_op"]);
            alloc.push(&format!("{name}_wall"), v["ns_per_op"]);
            round.insert(name, (v["cpu_ns_per_op"], v["ns_per_op"]));
            if name == "ferroprof" {
                samples.push(v["samples"]);
            }
        }
        // Both System runs of the round make its base; their difference is the noise floor.
        let (sys, sys_again) = (round["system"], round["system_again"]);
        let sys_mean = ((sys.0 + sys_again.0) / 2.0, (sys.1 + sys_again.1) / 2.0);
        let mut push = |name: &str, (cpu, wall): (f64, f64), (cpu_base, wall_base): (f64, f64)| {
            let pct = |v: f64, b: f64| (v / b - 1.0) * 100.0;
            paired
                .entry(name.to_owned())
                .or_default()
                .push(pct(cpu, cpu_base));
            paired
                .entry(format!("{name}_wall"))
                .or_default()
                .push(pct(wall, wall_base));
        };
        push("ferroprof", round["ferroprof"], sys_mean);
        push(
            "ferroprof_nosamples",
            round["ferroprof_nosamples"],
            sys_mean,
        );
        push("system_again", sys_again, sys);
        push("jemalloc_prof", round["jemalloc_prof"], round["jemalloc"]);
    }
    let sys = alloc.median("system");
    let je = alloc.median("jemalloc");
    report.push_str(&format!(
        "### Allocation workload (2 threads, 16-1040 B, live set 4096/thread, {ops} ops/thread, median of {alloc_rounds})\n\n\
         CPU time per operation (process CPU / operations; robust to other load on the machine), \
         and wall time per operation per thread. Variants run in a shuffled order each round.\n\n\
         | allocator | CPU ns/op | vs System | vs its own base | wall ns/op |\n|---|---|---|---|---|\n"
    ));
    for (name, label, base) in [
        ("system", "System", sys),
        ("system_again", "System again (control)", sys),
        (
            "ferroprof",
            "SamplingAllocator(System), 512 KiB, heap on",
            sys,
        ),
        (
            "ferroprof_nosamples",
            "SamplingAllocator(System), 1 GiB (fast path only), heap on",
            sys,
        ),
        ("jemalloc", "jemalloc (profiling compiled, off)", je),
        ("jemalloc_prof", "jemalloc prof:true lg_prof_sample:19", je),
        ("dhat", "dhat", sys),
    ] {
        let m = alloc.median(name);
        report.push_str(&format!(
            "| {label} | {m:.2} | {:+.1}% | {:+.1}% | {:.2} |\n",
            (m / sys - 1.0) * 100.0,
            (m / base - 1.0) * 100.0,
            alloc.median(&format!("{name}_wall"))
        ));
    }
    report.push_str(
        "\nPaired per round, CPU time: each variant against the same round's base (the mean of its \
         two System runs; System again against System alone shows the noise floor). Median and \
         mean +- 95% interval of the per-round differences, rounds where the variant was slower; \
         wall time medians last:\n\n",
    );
    for (name, label, base) in [
        ("system_again", "System again (noise floor)", "System"),
        (
            "ferroprof",
            "SamplingAllocator, 512 KiB, heap on",
            "System x2",
        ),
        (
            "ferroprof_nosamples",
            "SamplingAllocator, 1 GiB (fast path only)",
            "System x2",
        ),
        (
            "jemalloc_prof",
            "jemalloc prof lg_prof_sample:19",
            "jemalloc",
        ),
    ] {
        let cpu = paired.get(name).cloned().unwrap_or_default();
        let wall = paired
            .get(&format!("{name}_wall"))
            .cloned()
            .unwrap_or_default();
        let (mean, half) = mean_ci95(&cpu);
        let slower = cpu.iter().filter(|&&d| d > 0.0).count();
        report.push_str(&format!(
            "- {label} vs {base}: median {:+.2}%, mean {mean:+.2}% +- {half:.2} ({slower} of \
             {alloc_rounds}); wall median {:+.2}%\n",
            median(&mut cpu.clone()),
            median(&mut wall.clone()),
        ));
    }
    report.push_str(&format!(
        "\nferroprof samples per run (median): {:.0}\n\n",
        median(&mut samples)
    ));
    // The same shape A/B inside one process (adjacent chunks on System and on the sampling
    // allocator, timed by thread CPU clock): resolves what separate processes cannot on a host
    // whose speed drifts.
    let mut ab = Vec::new();
    let mut spread = Vec::new();
    for r in 0..3 {
        eprintln!("alloc A/B run {}/3", r + 1);
        let v = run(&dir, "alloc_ab", &["80", "200000"], &[]);
        ab.push(v["overhead_pct"]);
        spread.push(format!("{:+.1}..{:+.1}", v["q1_pct"], v["q3_pct"]));
    }
    report.push_str(&format!(
        "In-process A/B (each thread alternates 200k-operation chunks on System and on \
         SamplingAllocator(System), 512 KiB, heap on; 2 x 80 pairs per run): overhead medians \
         {} (median {:+.2}%); per-pair interquartile ranges {}.\n\n",
        ab.iter()
            .map(|v| format!("{v:+.2}%"))
            .collect::<Vec<_>>()
            .join(", "),
        median(&mut ab.clone()),
        spread.join(", ")
    ));

    // CPU profiling overhead.
    let mut cpu = Series(BTreeMap::new());
    let mut handler = Vec::new();
    let mut handler_median = Vec::new();
    let mut frames = Vec::new();
    let mut samples_cpu = Vec::new();
    let mut stop_ms = Vec::new();
    let mut sampler_cost = Vec::new();
    let mut own_share = Vec::new();
    let mut pprof_handler = Vec::new();
    let mut pprof_share = Vec::new();
    // Per round, each profiler's CPU overhead against that round's unprofiled run, and the
    // difference between the two: paired, so slow drifts in machine load cancel.
    let (mut d_ferro, mut d_pprof, mut d_diff) = (Vec::new(), Vec::new(), Vec::new());
    let cr = cpu_rounds.to_string();
    for r in 0..rounds {
        eprintln!("cpu round {}/{rounds}", r + 1);
        let mut round = BTreeMap::new();
        let modes = ["none", "ferroprof", "pprof"];
        for mode in shuffled(modes.len(), &mut rng)
            .into_iter()
            .map(|i| modes[i])
        {
            let v = run(&dir, "cpu_workload", &[mode, &cr], &[]);
            cpu.push(&format!("{mode}_wall"), v["wall_ns"]);
            cpu.push(&format!("{mode}_cpu"), v["cpu_ns"]);
            round.insert(mode, v["cpu_ns"]);
            if mode == "ferroprof" {
                handler.push(v["handler_ns"]);
                handler_median.push(v["handler_median_ns"]);
                frames.push(v["frames"]);
                samples_cpu.push(v["samples"]);
                // Handlers run for the threads' CPU timers only (the sampler sends no signal).
                let handlers = v["timer_samples"];
                sampler_cost.push(
                    (v["sampler_cpu_ns"] + v["handler_ns"] * handlers) / v["samples"].max(1.0),
                );
                own_share
                    .push((v["sampler_cpu_ns"] + v["handler_ns"] * handlers) / v["cpu_ns"] * 100.0);
                stop_ms.push(v["stop_ms"]);
            }
            if mode == "pprof" {
                pprof_handler.push(v["handler_ns"]);
                pprof_share.push(v["handler_ns"] * v["signals"] / v["cpu_ns"] * 100.0);
            }
        }
        let pct = |m: &str| (round[m] / round["none"] - 1.0) * 100.0;
        d_ferro.push(pct("ferroprof"));
        d_pprof.push(pct("pprof"));
        d_diff.push(pct("ferroprof") - pct("pprof"));
    }
    if rounds == 0 {
        report.push_str("### CPU profiling at 100 Hz\n\nNot run (FERROPROF_BENCH_ROUNDS=0).\n\n");
    } else {
        let base_w = cpu.median("none_wall");
        let base_c = cpu.median("none_cpu");
        report.push_str(&format!(
            "### CPU profiling at 100 Hz (2 busy threads, ~47-frame stacks, median of {rounds})\n\n\
             | profiler | wall ms | wall overhead | CPU ms | CPU overhead |\n|---|---|---|---|---|\n"
        ));
        for (mode, label) in [
            ("none", "none"),
            ("ferroprof", "ferroprof"),
            ("pprof", "pprof-rs"),
        ] {
            let w = cpu.median(&format!("{mode}_wall"));
            let c = cpu.median(&format!("{mode}_cpu"));
            report.push_str(&format!(
                "| {label} | {:.1} | {:+.2}% | {:.1} | {:+.2}% |\n",
                w / 1e6,
                (w / base_w - 1.0) * 100.0,
                c / 1e6,
                (c / base_c - 1.0) * 100.0
            ));
        }
        report.push_str(&format!(
            "\nPaired per round (each run against the same round's unprofiled run; the three run in a \
             shuffled order), medians: ferroprof {:+.2}% CPU, pprof-rs {:+.2}% CPU, ferroprof minus \
             pprof-rs {:+.2} points (mean {:+.2} +- {:.2}; ferroprof lower in {} of {rounds} \
             rounds).\n",
            median(&mut d_ferro),
            median(&mut d_pprof),
            median(&mut d_diff.clone()),
            mean_ci95(&d_diff).0,
            mean_ci95(&d_diff).1,
            d_diff.iter().filter(|&&d| d < 0.0).count()
        ));
        report.push_str(&format!(
            "In-process profiler CPU, measured alike for both (signal handlers timed with the \
         monotonic clock; ferroprof adds its sampler thread's CPU clock): ferroprof {:.3}% of the \
         workload's CPU, pprof-rs {:.3}%; pprof-rs handler median {:.1} us per signal.\n",
            median(&mut own_share.clone()),
            median(&mut pprof_share),
            median(&mut pprof_handler) / 1e3
        ));
        let samples_m = median(&mut samples_cpu);
        let latency = ferroprof_bench::memory_latency_ns();
        report.push_str(&format!(
            "\nHost memory latency right after the CPU rounds (dependent random loads over 64 MiB): \
             {latency:.0} ns. A handler interrupts a thread that ran other code for 10 ms, finds its \
             memory cold and walks the stack as a chain of dependent loads, so its cost follows this \
             figure.\n"
        ));
        report.push_str(&format!(
            "\nferroprof signal handler: {:.0} ns per sample (run medians of the per-run mean; of \
             the per-run median: {:.0} ns) at a median {:.0} frames; \
             {samples_m:.0} samples (ticks) per run; profiler CPU per sample ((sampler thread CPU + \
             handler time) / samples): {:.1} us; the profiler's own CPU (sampler thread + handlers, kernel signal \
             delivery excluded) = {:.2}% of the workload's CPU; whole-process CPU overhead / samples \
             (includes kernel signal delivery and noise): {:.1} us; final serialization with \
             symbolization at stop: {:.1} ms\n\n",
            median(&mut handler),
            median(&mut handler_median),
            median(&mut frames),
            median(&mut sampler_cost) / 1e3,
            median(&mut own_share),
            (cpu.median("ferroprof_cpu") - base_c) / samples_m.max(1.0) / 1e3,
            median(&mut stop_ms)
        ));
    }

    // RSS right after start, and after a second of sampling.
    let mut rss = Series(BTreeMap::new());
    for _ in 0..3 {
        for mode in ["ferroprof", "pprof"] {
            let v = run(&dir, "rss_start", &[mode], &[]);
            rss.push(&format!("{mode}_start"), v["start_bytes"]);
            rss.push(&format!("{mode}_after"), v["after_1s_bytes"]);
        }
    }
    report.push_str(
        "### RSS added by the profiler (median of 3)\n\n| profiler | right after start | after 1 s |\n|---|---|---|\n",
    );
    for (mode, label) in [("ferroprof", "ferroprof"), ("pprof", "pprof-rs")] {
        report.push_str(&format!(
            "| {label} | {:.2} MB | {:.2} MB |\n",
            rss.median(&format!("{mode}_start")) / 1e6,
            rss.median(&format!("{mode}_after")) / 1e6
        ));
    }
    println!("{report}");
    // target/aligned/release/examples -> target
    let out = dir
        .ancestors()
        .nth(3)
        .map(|t| t.join("ferroprof-bench-report.md"));
    if let Some(out) = out {
        let _ = std::fs::write(&out, &report);
        eprintln!("report written to {}", out.display());
    }
}
