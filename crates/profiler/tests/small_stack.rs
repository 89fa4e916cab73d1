//! Threads with small stacks under profiling. The profiler must add little to a thread's stack
//! (the unwinder runs on a stack of its own) and skip, and count, a sample when the thread has
//! less headroom than the path needs: never overflow the thread's stack.
//!
//! * `sixteen_kib_thread_allocating_and_burning_survives`: a thread with a 16 KiB stack
//!   allocates (1-byte sampling interval) and burns CPU (1 kHz) at depths down to a few
//!   hundred bytes of headroom; the process must live and the skipped samples be counted.
//! * `stack_use_of_the_handler_and_a_sampled_allocation`: paints a thread's stack below its
//!   stack pointer and finds the deepest byte the signal handler and a sampled allocation wrote
//!   (printed, and bounded).
//!
//! Bodies run in child processes, so a crash fails the test instead of the test binary.
//! `FERROPROF_SMALL_STACK_RUNS` (default 1) repeats the small-stack child for
//! `scripts/reliability.sh`.

mod child_support;
mod profiler_support;

use std::alloc::System;
use std::hint::black_box;
use std::time::Duration;

use child_support::*;
use ferroprof::{Profiler, ProfilerGuard, Profiles, SamplingAllocator};
use profiler_support::{thread_cpu, Collect};

#[global_allocator]
static GLOBAL: SamplingAllocator<System> = SamplingAllocator::new(System);

/// The calling thread's lowest usable stack address.
fn stack_lo() -> usize {
    // SAFETY: plain-data attr initialized by pthread_getattr_np, destroyed once.
    unsafe {
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        assert_eq!(libc::pthread_getattr_np(libc::pthread_self(), &mut attr), 0);
        let mut addr: *mut libc::c_void = std::ptr::null_mut();
        let mut size = 0;
        assert_eq!(libc::pthread_attr_getstack(&attr, &mut addr, &mut size), 0);
        libc::pthread_attr_destroy(&mut attr);
        addr as usize
    }
}

/// About the stack pointer of the caller.
#[inline(always)]
fn sp() -> usize {
    let x = 0u8;
    black_box(&x) as *const u8 as usize
}

/// Calls `f` at a depth where about `headroom` bytes of stack are left below it.
#[inline(never)]
fn at_headroom(headroom: usize, lo: usize, f: &mut dyn FnMut()) {
    let pad = [0u8; 96];
    black_box(&pad);
    if sp() - lo > headroom + 128 {
        at_headroom(headroom, lo, f);
    } else {
        f();
    }
    black_box(&pad);
}

/// Allocates one byte and does a little arithmetic, `n` times.
#[inline(never)]
fn work(n: u64, allocate: bool) -> u64 {
    let mut x = n | 1;
    for i in 0..n {
        if allocate {
            let b = Box::new(i as u8);
            x = x.wrapping_add(u64::from(**black_box(&b)));
        }
        for _ in 0..200 {
            x = black_box(
                x.wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407),
            );
        }
    }
    x
}

fn start(profiles: Profiles) -> ProfilerGuard {
    Profiler::builder()
        .cpu_hz(1000)
        .alloc_interval_bytes(1)
        .profiles(profiles)
        .period(Duration::from_secs(3600))
        .exporter(Box::new(Collect::default()))
        .start()
        .expect("start the profiler")
}

/// Kernel's minimum signal stack (its signal frame for this CPU); 2 KiB when unknown.
fn signal_frame_size() -> usize {
    // SAFETY: getauxval has no preconditions; 51 is AT_MINSIGSTKSZ.
    let v = unsafe { libc::getauxval(51) } as usize;
    if v == 0 {
        2048
    } else {
        v
    }
}

#[test]
fn sixteen_kib_thread_allocating_and_burning_survives() {
    const NAME: &str = "sixteen_kib_thread_allocating_and_burning_survives";
    if is_child(NAME) {
        return small_stack_child();
    }
    // The same thread unprofiled must run: the test's own depths are sound.
    let control = run_child(
        NAME,
        &[("SMALL_STACK_PROFILE", "0")],
        Duration::from_secs(120),
    );
    assert!(
        control.status.success(),
        "unprofiled control failed:\n{}",
        control.describe()
    );
    let runs: usize = std::env::var("FERROPROF_SMALL_STACK_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    for run in 0..runs {
        let out = run_child(NAME, &[], Duration::from_secs(120));
        let d = out.describe();
        assert!(
            out.status.success(),
            "run {run}: the profiled process died:\n{d}"
        );
        let skipped = out.value("skipped_low_stack").unwrap_or(0);
        let alloc = out.value("alloc_samples").unwrap_or(0);
        assert!(
            skipped > 0,
            "run {run}: no sample skipped for lack of stack:\n{d}"
        );
        assert!(alloc > 0, "run {run}: no allocation sampled at all:\n{d}");
        if run == 0 {
            eprintln!("{}", out.stdout);
        }
    }
}

fn small_stack_child() {
    let profile = std::env::var("SMALL_STACK_PROFILE").map_or(true, |v| v != "0");
    let guard = profile.then(|| {
        start(Profiles {
            cpu: true,
            wall: true,
            alloc: true,
            heap: false,
        })
    });
    let sigframe = signal_frame_size();
    // The profiler's sampling signal (a real-time signal it picked).
    let sig = guard.as_ref().map_or(libc::SIGPROF, |g| g.stats().signal);
    let h = std::thread::Builder::new()
        .stack_size(16 * 1024)
        .spawn(move || {
            let lo = stack_lo();
            let top = sp() - lo;
            let mut acc = 0u64;
            // With signals: from the top down to a signal frame plus 2 KiB (a signal needs the
            // kernel's frame whoever handles it, and `work` and the allocator go deeper than
            // `at_headroom`'s frame: 1 KiB in a debug build). In a debug build the handler's
            // own unoptimized frames before its headroom check take up to ~1.8 KiB more (a
            // release handler: ~250 bytes), which no check can cover: 2 KiB more there.
            let floor = sigframe + if cfg!(debug_assertions) { 4096 } else { 2048 };
            let mut h = top.saturating_sub(512);
            while h >= floor {
                // CPU time at each depth: what its timer samples (and may have to skip).
                let end = thread_cpu() + Duration::from_millis(15);
                at_headroom(h, lo, &mut || {
                    while thread_cpu() < end {
                        acc ^= work(20, true);
                    }
                });
                h -= 256;
            }
            // Deeper, with the sampling signal blocked: allocations only.
            // SAFETY: plain sigset manipulation on locals.
            unsafe {
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut set);
                libc::sigaddset(&mut set, sig);
                libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
            }
            // Down to where the allocator's own frames above the profiler's check still fit:
            // a few hundred bytes in a release build, over a KiB in a debug one. In a release
            // build the check itself needs only 512 bytes, so the walk must go below ~1 KiB for
            // any sample to be skipped (the unprofiled control proves the depth is sound).
            let min: usize = std::env::var("SMALL_STACK_MIN")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(if cfg!(debug_assertions) { 3072 } else { 768 });
            // The last depth is `min` itself, whatever `floor` this machine's signal frame
            // gives (stepping by 128 from it used to stop anywhere up to 127 bytes above).
            let mut h = floor.max(min);
            loop {
                at_headroom(h, lo, &mut || {
                    for _ in 0..200 {
                        acc ^= work(1, true);
                    }
                });
                if h == min {
                    break;
                }
                h = h.saturating_sub(128).max(min);
            }
            println!("top_headroom={top}");
            acc
        })
        .expect("spawn the small-stack thread");
    black_box(h.join().expect("the small-stack thread"));
    println!("sigframe={sigframe}");
    if let Some(g) = guard {
        let stats = g.stats();
        g.stop().expect("stop");
        println!("skipped_low_stack={}", stats.skipped_low_stack);
        println!("skipped_unknown_stack={}", stats.skipped_unknown_stack);
        println!("alloc_samples={}", stats.alloc_samples);
        println!("cpu_samples={}", stats.cpu_samples);
    }
}

const PATTERN: u64 = 0xa5a5_5a5a_c3c3_3c3c;

/// Paints the stack from 256 bytes below the caller's frame down to `lo` + 256.
#[inline(never)]
fn paint(lo: usize) -> usize {
    let top = sp() - 512;
    let mut a = (lo + 256 + 7) & !7;
    while a < top {
        // SAFETY: unused stack of this thread below our own frame: nothing lives there.
        unsafe { std::ptr::write_volatile(a as *mut u64, PATTERN) };
        a += 8;
    }
    top
}

/// The lowest address written since `paint`.
#[inline(never)]
fn lowest_written(lo: usize, top: usize) -> usize {
    let mut a = (lo + 256 + 7) & !7;
    while a < top {
        // SAFETY: as in `paint`; reads only.
        if unsafe { std::ptr::read_volatile(a as *const u64) } != PATTERN {
            return a;
        }
        a += 8;
    }
    top
}

/// Deepest stack use below the caller of `f` while `f` runs for `d` of the thread's CPU (the
/// signals that land meanwhile come with its CPU time), in bytes.
#[inline(never)]
fn depth_used(lo: usize, d: Duration, f: &mut dyn FnMut()) -> usize {
    let here = sp();
    let top = paint(lo);
    let end = thread_cpu() + d;
    while thread_cpu() < end {
        f();
    }
    here - lowest_written(lo, top)
}

#[test]
fn stack_use_of_the_handler_and_a_sampled_allocation() {
    const NAME: &str = "stack_use_of_the_handler_and_a_sampled_allocation";
    if is_child(NAME) {
        return stack_use_child();
    }
    let out = run_child(NAME, &[], Duration::from_secs(120));
    assert!(
        out.status.success(),
        "the child failed:\n{}",
        out.describe()
    );
    let v = |k| {
        out.value(k)
            .unwrap_or_else(|| panic!("{k} missing:\n{}", out.describe()))
    };
    let (base_cpu, cpu) = (v("baseline_burn"), v("handler_burn"));
    let (base_alloc, alloc) = (v("baseline_alloc"), v("sampled_alloc"));
    eprintln!("{}", out.stdout);
    // What the profiler adds on the thread's own stack: beyond the kernel's signal frame (the
    // signal may come at the loop's deepest point), and beyond the allocator's own use. Before
    // the spare stacks, a release build added 11 KiB and 14 KiB.
    let sigframe = signal_frame_size() as u64;
    let budget = if cfg!(debug_assertions) { 2048 } else { 512 };
    assert!(
        cpu <= base_cpu + sigframe + budget,
        "the handler uses {cpu} bytes of the thread's stack\n{}",
        out.stdout
    );
    assert!(
        alloc <= base_alloc + budget,
        "a sampled allocation uses {alloc} bytes of the thread's stack\n{}",
        out.stdout
    );
}

fn stack_use_child() {
    let run = |allocate: bool| -> usize {
        std::thread::Builder::new()
            .stack_size(256 * 1024)
            .spawn(move || {
                let lo = stack_lo();
                depth_used(lo, Duration::from_millis(300), &mut || {
                    black_box(work(20, allocate));
                })
            })
            .unwrap()
            .join()
            .unwrap()
    };
    println!("baseline_burn={}", run(false));
    println!("baseline_alloc={}", run(true));
    let g = start(Profiles {
        cpu: true,
        wall: false,
        alloc: false,
        heap: false,
    });
    println!("handler_burn={}", run(false));
    g.stop().unwrap();
    let g = start(Profiles {
        cpu: false,
        wall: false,
        alloc: true,
        heap: false,
    });
    println!("sampled_alloc={}", run(true));
    let stats = g.stats();
    g.stop().unwrap();
    println!("alloc_samples={}", stats.alloc_samples);
}
