//! `ferroprof demo`: profiles a built-in workload whose answer is known, then shows what the
//! profiler found next to what it should have found.
//!
//! The workload, for `--seconds` seconds:
//! - a `burner` thread spends CPU in `burn_hot` and `burn_cold` in a 3:1 ratio (the same loop, 3
//!   units of work against 1);
//! - `keep_live_set` allocates 64 MiB at the start (64 buffers of 1 MiB) and keeps it alive to the
//!   end, so the live heap has one known call site of known size;
//! - a `churner` thread allocates and frees 64 KiB buffers in `churn`: many allocations, nothing
//!   live; it counts the bytes, to hold `alloc-space` (estimated bytes allocated) against;
//! - an `idler` thread sleeps in `wait_idle`: wall time without CPU time.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use ferroprof::{Profiler, Profiles};

use crate::report::{self, CliError, FunctionTable};

/// Size of the live set kept by `keep_live_set`.
const LIVE_SET_BYTES: usize = 64 << 20;
const LIVE_BUFFER: usize = 1 << 20;
const CHURN_BUFFER: usize = 64 << 10;

/// Options of `ferroprof demo`.
#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// How long to run the workload, in seconds (1-3600).
    #[arg(long, default_value_t = 5)]
    pub seconds: u64,
    /// Directory for the profiles (default: ./profiles).
    #[arg(long = "out", short = 'o')]
    pub out: Option<PathBuf>,
    /// Functions shown per profile type.
    #[arg(short = 'n', default_value_t = 8)]
    pub n: usize,
}

pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    if !(1..=3600).contains(&args.seconds) {
        return Err(CliError(format!(
            "--seconds {} is out of range (1-3600)",
            args.seconds
        ))
        .into());
    }
    let dir = args
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from("./profiles"));
    std::fs::create_dir_all(&dir)
        .map_err(|e| CliError(format!("cannot create {}: {e}", dir.display())))?;
    let before = list_profiles(&dir)?;
    let run_for = Duration::from_secs(args.seconds);

    eprintln!(
        "ferroprof demo: profiling a known workload for {}s; profiles go to {}",
        args.seconds,
        dir.display()
    );
    let guard = Profiler::builder()
        .service("ferroprof-demo")
        .profiles(Profiles::all())
        // One profile for the whole run, written when the profiler stops.
        .period(run_for + Duration::from_secs(3600))
        .output_dir(&dir)
        .start()
        .context("cannot start the profiler")?;
    if !guard.allocator_installed() {
        eprintln!("ferroprof demo: warning: the sampling allocator is not installed; no heap data");
    }

    // The live set is allocated under the profiler and kept until the last profile is written.
    let live = keep_live_set();
    let stop = Arc::new(AtomicBool::new(false));
    let work_units = Arc::new(AtomicU64::new(0));
    let churned = Arc::new(AtomicU64::new(0));
    let threads = [
        spawn("burner", {
            let (stop, units) = (stop.clone(), work_units.clone());
            move || burner(&stop, &units)
        })?,
        spawn("churner", {
            let (stop, churned) = (stop.clone(), churned.clone());
            move || churner(&stop, &churned)
        })?,
        spawn("idler", {
            let stop = stop.clone();
            move || wait_idle(&stop)
        })?,
    ];

    let started = Instant::now();
    let tty = std::io::stderr().is_terminal();
    let mut last_line = Instant::now();
    loop {
        let elapsed = started.elapsed();
        if elapsed >= run_for {
            break;
        }
        // An updating line on a terminal; otherwise one line a second.
        if tty || last_line.elapsed() >= Duration::from_secs(1) {
            progress(elapsed, run_for, &guard.stats(), tty);
            last_line = Instant::now();
        }
        std::thread::sleep((run_for - elapsed).min(Duration::from_millis(100)));
    }
    progress(run_for, run_for, &guard.stats(), tty);
    eprintln!();
    stop.store(true, Ordering::SeqCst);
    for t in threads {
        let _ = t.join();
    }
    let stats = guard.stats();
    guard.stop().context("stopping the profiler")?;
    drop(live);

    let mut written: Vec<PathBuf> = list_profiles(&dir)?
        .into_iter()
        .filter(|p| !before.contains(p))
        .collect();
    written.sort();
    let Some(file) = written.last().cloned() else {
        return Err(CliError(format!(
            "the profiler wrote no profile into {}",
            dir.display()
        ))
        .into());
    };
    for f in &written {
        println!("wrote {}", f.display());
    }
    println!(
        "{} CPU/wall samples, {} allocation samples",
        stats.cpu_samples, stats.alloc_samples
    );
    let profile = report::load(&file)?;
    let churned = churned.load(Ordering::SeqCst);
    report_profile(&profile, &file, args.n, churned)
}

fn spawn(
    name: &str,
    f: impl FnOnce() + Send + 'static,
) -> anyhow::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(f)
        .with_context(|| format!("cannot start the {name} thread"))
}

fn progress(elapsed: Duration, total: Duration, s: &ferroprof::ProfilerStats, tty: bool) {
    const WIDTH: usize = 24;
    let done = ((elapsed.as_secs_f64() / total.as_secs_f64()) * WIDTH as f64) as usize;
    let bar: String = (0..WIDTH)
        .map(|i| if i < done { '#' } else { '.' })
        .collect();
    let line = format!(
        "[{bar}] {:>5.1}s/{}s  cpu/wall samples {:>6}  alloc samples {:>6}",
        elapsed.as_secs_f64(),
        total.as_secs(),
        s.cpu_samples,
        s.alloc_samples
    );
    let mut err = std::io::stderr().lock();
    let _ = if tty {
        write!(err, "\r{line}")
    } else {
        writeln!(err, "{line}")
    };
    let _ = err.flush();
}

fn list_profiles(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let rd = std::fs::read_dir(dir)
        .map_err(|e| CliError(format!("cannot list {}: {e}", dir.display())))?;
    Ok(rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect())
}

/// The expected answer, checked against the profile; one line per check. `churned`: the bytes
/// `churn` allocated, as counted by the workload.
fn report_profile(
    p: &ferroprof_pprof::Profile,
    file: &Path,
    n: usize,
    churned: u64,
) -> anyhow::Result<()> {
    let label = file.display().to_string();
    let table = |name: &str| {
        p.value_index(name)
            .map(|i| FunctionTable::build_sites(p, i))
    };
    for name in [
        "cpu-time",
        "wall-time",
        "alloc-samples",
        "alloc-space",
        "heap-live-size",
    ] {
        match table(name) {
            Some(t) => println!("\n{}", report::top_text(&t, n, false, &label).trim_end()),
            None => println!("\n{label}: no {name} in this profile"),
        }
    }

    println!("\nverdict (expected vs found; shares are of the type's total, by cumulative value):");
    let mut ok = true;
    let mut check = |pass: bool, text: String| {
        ok &= pass;
        println!("  [{}] {text}", if pass { " ok " } else { "MISS" });
    };
    // Shares by cumulative value: allocation frames sit above the demo's functions in a stack.
    let share = |t: &FunctionTable, name: &str| -> (i64, f64) {
        let v = t
            .rows
            .iter()
            .filter(|r| is_function(&r.0, name))
            .map(|r| r.2)
            .max()
            .unwrap_or(0);
        let pct = if t.total > 0 {
            v as f64 * 100.0 / t.total as f64
        } else {
            0.0
        };
        (v, pct)
    };

    if let Some(cpu) = table("cpu-time") {
        let (hot, hot_pct) = share(&cpu, "burn_hot");
        let (cold, cold_pct) = share(&cpu, "burn_cold");
        let ratio = if cold > 0 {
            hot as f64 / cold as f64
        } else {
            f64::INFINITY
        };
        // The bound is the sampling error, not a fixed band: a burner starved of CPU by a busy
        // machine yields few samples, and the hot share of n samples wanders by sqrt(p(1-p)/n).
        let n = table("cpu-samples")
            .map(|s| (share(&s, "burn_hot").0 + share(&s, "burn_cold").0).max(0) as f64)
            .unwrap_or(0.0);
        let (lo, hi) = split_bounds(0.75, n);
        let hot_share = hot as f64 / (hot + cold).max(1) as f64;
        check(
            (lo..=hi).contains(&hot_share),
            format!(
                "cpu-time: burn_hot / burn_cold = 3.0 expected, {ratio:.2} found ({hot_pct:.1}% vs {cold_pct:.1}%; {n:.0} samples, bounds {:.2}..{:.2})",
                lo / (1.0 - lo),
                hi / (1.0 - hi).max(f64::EPSILON)
            ),
        );
        let (_, idle_cpu) = share(&cpu, "wait_idle");
        check(
            idle_cpu < 2.0,
            format!("cpu-time: wait_idle (sleeping) ~0% expected, {idle_cpu:.1}% found"),
        );
    }
    if let Some(wall) = table("wall-time") {
        let (_, idle) = share(&wall, "wait_idle");
        check(
            idle >= 10.0,
            format!("wall-time: wait_idle sleeps all run long, a large share expected, {idle:.1}% found"),
        );
    }
    if let Some(alloc) = table("alloc-samples") {
        let (_, churn) = share(&alloc, "churn");
        let (_, live) = share(&alloc, "keep_live_set");
        check(
            churn > live && churn >= 50.0,
            format!("alloc-samples: most allocations in churn expected, {churn:.1}% found (keep_live_set {live:.1}%)"),
        );
    }
    if let Some(space) = table("alloc-space") {
        // Thousands of samples of one size: the estimate's error is a few percent.
        let (est, pct) = share(&space, "churn");
        let truth = i64::try_from(churned).unwrap_or(i64::MAX);
        let off = if truth > 0 {
            (est as f64 / truth as f64 - 1.0) * 100.0
        } else {
            f64::INFINITY
        };
        check(
            off.abs() <= 10.0,
            format!(
                "alloc-space: churn allocated {} (counted), {} estimated ({off:+.1}%, {pct:.1}% of all)",
                report::format_value(truth, "bytes"),
                report::format_value(est, "bytes"),
            ),
        );
        let (live, _) = share(&space, "keep_live_set");
        let want = LIVE_SET_BYTES as f64;
        check(
            (live as f64 - want).abs() <= want * 0.3,
            format!(
                "alloc-space: keep_live_set allocated 64.00MiB once, {} estimated",
                report::format_value(live, "bytes")
            ),
        );
    }
    if let Some(heap) = table("heap-live-size") {
        let (live, pct) = share(&heap, "keep_live_set");
        let (_, churn) = share(&heap, "churn");
        let want = LIVE_SET_BYTES as f64;
        check(
            (live as f64 - want).abs() <= want * 0.3,
            format!(
                "heap-live-size: keep_live_set 64.00MiB expected, {} found ({pct:.1}% of live)",
                report::format_value(live, "bytes")
            ),
        );
        check(
            churn < 10.0,
            format!("heap-live-size: churn frees everything, ~0% expected, {churn:.1}% found"),
        );
    }
    println!(
        "\n{}",
        if ok {
            "The profiler found the known CPU split, allocated bytes and live set."
        } else {
            "Some expectations were missed (sampling noise grows on short runs; try --seconds 20)."
        }
    );
    println!("Explore:\n  ferroprof top {label} --type wall-time\n  ferroprof flamegraph {label} --type cpu-time -o cpu.svg");
    Ok(())
}

/// Whether the symbol `full` is the demo function `name` or a closure inside it.
fn is_function(full: &str, name: &str) -> bool {
    full == name || full.ends_with(&format!("::{name}")) || full.contains(&format!("::{name}::"))
}

// ---------------------------------------------------------------------------------------------
// The workload. `#[inline(never)]` keeps each function a frame of its own; the loops are written
// out in each function (not shared through a helper) so the burning function is the leaf.

/// Spins `units` rounds of integer mixing. Both burners run this same loop (equal cost per unit)
/// but from different seeds, so the linker cannot fold them into one function. A plain `while`
/// keeps iterator methods from showing up as inlined leaf frames.
macro_rules! burn_body {
    ($units:expr, $seed:expr) => {{
        let mut x = std::hint::black_box($seed);
        let rounds = $units * 20_000;
        let mut i = 0u64;
        while i < rounds {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            i += 1;
        }
        std::hint::black_box(x)
    }};
}

/// Bounds on the share `p` of `n` samples that may be seen when the true share is `p`: four
/// standard errors of a binomial share (a false alarm about once in 15,000 runs), and never
/// tighter than 5 points, which covers the timer's own granularity.
fn split_bounds(p: f64, n: f64) -> (f64, f64) {
    let se = if n > 0.0 {
        (p * (1.0 - p) / n).sqrt()
    } else {
        1.0
    };
    let d = (4.0 * se).max(0.05);
    ((p - d).max(0.0), (p + d).min(1.0))
}

#[inline(never)]
fn burn_hot(units: u64) -> u64 {
    burn_body!(units, 0x9e37_79b9_7f4a_7c15u64)
}

#[inline(never)]
fn burn_cold(units: u64) -> u64 {
    burn_body!(units, 0x2545_f491_4f6c_dd1du64)
}

#[inline(never)]
fn burner(stop: &AtomicBool, units: &AtomicU64) {
    while !stop.load(Ordering::Relaxed) {
        let x = burn_hot(std::hint::black_box(3)) ^ burn_cold(std::hint::black_box(1));
        std::hint::black_box(x);
        units.fetch_add(4, Ordering::Relaxed);
    }
}

#[inline(never)]
fn keep_live_set() -> Vec<Vec<u8>> {
    let set: Vec<Vec<u8>> = (0..LIVE_SET_BYTES / LIVE_BUFFER)
        .map(|i| {
            let mut b = vec![0u8; LIVE_BUFFER];
            // Touch every page so the memory is really in use.
            for j in (0..b.len()).step_by(4096) {
                b[j] = i as u8;
            }
            std::hint::black_box(b)
        })
        .collect();
    // Not a tail call, so this function keeps its own frame in the allocation stacks.
    std::hint::black_box(set)
}

#[inline(never)]
fn churn(rounds: usize) -> usize {
    let mut sum = 0;
    for i in 0..rounds {
        let mut b = vec![0u8; CHURN_BUFFER];
        b[i % CHURN_BUFFER] = 1;
        sum += std::hint::black_box(b).len();
    }
    sum
}

#[inline(never)]
fn churner(stop: &AtomicBool, churned: &AtomicU64) {
    while !stop.load(Ordering::Relaxed) {
        let bytes = std::hint::black_box(churn(64));
        churned.fetch_add(bytes as u64, Ordering::Relaxed);
        // Leave most of this core to the burner's measurement.
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[inline(never)]
fn wait_idle(stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::split_bounds;

    #[test]
    fn the_split_bounds_widen_as_samples_get_few() {
        let (lo_many, hi_many) = split_bounds(0.75, 10_000.0);
        assert!((lo_many - 0.70).abs() < 1e-9 && (hi_many - 0.80).abs() < 1e-9);
        let (lo, hi) = split_bounds(0.75, 100.0);
        // 4 * sqrt(0.1875 / 100) = 0.173
        assert!(
            (lo - 0.577).abs() < 1e-3 && (hi - 0.923).abs() < 1e-3,
            "{lo} {hi}"
        );
        // A 4.76 split (share 0.826) of 100 samples is sampling error, not a wrong profile.
        assert!((lo..=hi).contains(&0.826));
        assert_eq!(split_bounds(0.75, 0.0), (0.0, 1.0));
    }
}
