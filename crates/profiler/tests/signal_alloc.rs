//! A thread whose own signal handler allocates while the thread is inside the profiler never
//! stalls.
//!
//! Programs allocate in signal handlers (not async-signal-safe, but common). To see the
//! profiler's part alone, the allocator under ferroprof's here *is* async-signal-safe: lock-free
//! free lists over one `mmap`ed region, so only the profiler can block. A worker allocates and
//! frees in a loop (keeping a live set, so tracked blocks are freed too), another thread sends
//! it `SIGUSR1` ~20 µs after the previous one was handled, and the handler allocates and frees.
//! At a 64-byte and a 4 KiB sampling interval the handler lands, again and again, inside the
//! recording of a sample (the recorder's tables, kept blocks, the unwinder) on the same thread.
//! The worker must keep making progress; a stall of [`STALL`] fails the test.

use std::alloc::{GlobalAlloc, Layout};
use std::os::unix::thread::JoinHandleExt;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferroprof::{Profiler, Profiles, SamplingAllocator};

/// Size classes: powers of two from 16 bytes to 64 KiB; larger blocks are mappings of their own.
const CLASSES: usize = 13;
const MIN_SHIFT: usize = 4;
const PAGE: usize = 4096;
const REGION: usize = 8 << 30;
const PTR_MASK: u64 = (1 << 48) - 1;

/// An async-signal-safe allocator: every path is atomics and `mmap`/`munmap`.
struct SignalSafe;

static BASE: AtomicUsize = AtomicUsize::new(0);
static USED: AtomicUsize = AtomicUsize::new(0);
/// Free list heads: a block address in the low 48 bits, a change count above (against ABA).
static HEADS: [AtomicU64; CLASSES] = [const { AtomicU64::new(0) }; CLASSES];

fn base() -> usize {
    let b = BASE.load(Ordering::Acquire);
    if b != 0 {
        return b;
    }
    // SAFETY: a fresh private anonymous reservation; pages exist once touched.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            REGION,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    assert!(p != libc::MAP_FAILED, "reserve the test allocator's region");
    match BASE.compare_exchange(0, p as usize, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => p as usize,
        Err(won) => {
            // SAFETY: our own mapping, never handed out.
            unsafe { libc::munmap(p, REGION) };
            won
        }
    }
}

fn class(layout: Layout) -> Option<usize> {
    let size = layout.size().max(layout.align()).max(1 << MIN_SHIFT);
    let c = size.next_power_of_two().trailing_zeros() as usize - MIN_SHIFT;
    (c < CLASSES && layout.align() <= PAGE).then_some(c)
}

fn big_len(layout: Layout) -> usize {
    (layout.size() + PAGE - 1) & !(PAGE - 1)
}

// SAFETY: blocks are handed out once until freed (free lists with ABA tags, a bump pointer
// under CAS), aligned to their class size up to a page, and never overlap.
unsafe impl GlobalAlloc for SignalSafe {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some(c) = class(layout) else {
            if layout.align() > PAGE {
                return std::ptr::null_mut();
            }
            // SAFETY: a fresh anonymous mapping.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    big_len(layout),
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                    -1,
                    0,
                )
            };
            return if p == libc::MAP_FAILED {
                std::ptr::null_mut()
            } else {
                p as *mut u8
            };
        };
        let head = &HEADS[c];
        let mut h = head.load(Ordering::Acquire);
        while h & PTR_MASK != 0 {
            let p = (h & PTR_MASK) as usize;
            // SAFETY: `p` is in our region, always mapped; if another thread took the block
            // meanwhile the word may be anything, and the tag makes the CAS below fail.
            let next = unsafe { std::ptr::read_volatile(p as *const u64) };
            let new = ((h >> 48).wrapping_add(1) << 48) | (next & PTR_MASK);
            match head.compare_exchange_weak(h, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return p as *mut u8,
                Err(now) => h = now,
            }
        }
        let size = 1usize << (c + MIN_SHIFT);
        let align = size.min(PAGE);
        let b = base();
        let mut used = USED.load(Ordering::Relaxed);
        loop {
            let start = (used + align - 1) & !(align - 1);
            if start + size > REGION {
                return std::ptr::null_mut();
            }
            match USED.compare_exchange_weak(
                used,
                start + size,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return (b + start) as *mut u8,
                Err(now) => used = now,
            }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let Some(c) = class(layout) else {
            // SAFETY: a mapping of its own, made in `alloc`.
            unsafe { libc::munmap(ptr as *mut libc::c_void, big_len(layout)) };
            return;
        };
        let head = &HEADS[c];
        let mut h = head.load(Ordering::Acquire);
        loop {
            // SAFETY: the block is ours again and at least 16 bytes.
            unsafe { std::ptr::write_volatile(ptr as *mut u64, h & PTR_MASK) };
            let new = ((h >> 48).wrapping_add(1) << 48) | ptr as u64;
            match head.compare_exchange_weak(h, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return,
                Err(now) => h = now,
            }
        }
    }
}

#[global_allocator]
static GLOBAL: SamplingAllocator<SignalSafe> = SamplingAllocator::new(SignalSafe);

/// A stall this long fails the test (the worker makes thousands of rounds a second).
const STALL: Duration = Duration::from_secs(5);

fn run_secs() -> u64 {
    std::env::var("FERROPROF_SIGNAL_ALLOC_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10)
}

static HANDLED: AtomicU64 = AtomicU64::new(0);

extern "C" fn on_usr1(_: libc::c_int) {
    let b = Box::new([7u8; 100]);
    let v: Vec<u64> = std::hint::black_box(vec![3; 40]);
    std::hint::black_box((b, v));
    HANDLED.fetch_add(1, Ordering::Relaxed);
}

#[inline(never)]
fn worker(stop: &AtomicBool, rounds: &AtomicU64) {
    let mut live: Vec<Vec<u8>> = Vec::with_capacity(128);
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    while !stop.load(Ordering::Relaxed) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let v = vec![x as u8; 16 + (x % 2000) as usize];
        if live.len() < 128 {
            live.push(v);
        } else {
            live[(x % 128) as usize] = v;
        }
        rounds.fetch_add(1, Ordering::Relaxed);
    }
}

fn one_profiler_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

fn run(interval: u64) {
    let _turn = one_profiler_at_a_time();
    // SAFETY: installs a handler for SIGUSR1, which nothing else in this test binary uses.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_usr1 as extern "C" fn(libc::c_int) as usize;
        sa.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut sa.sa_mask);
        assert_eq!(libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut()), 0);
    }
    let dir = std::env::temp_dir().join(format!(
        "ferroprof-signal-alloc-{}-{interval}",
        std::process::id()
    ));
    let guard = Profiler::builder()
        .cpu_hz(250)
        .alloc_interval_bytes(interval)
        .period(Duration::from_millis(200))
        .profiles(Profiles::all())
        .output_dir(&dir)
        .start()
        .expect("profiler starts");
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicU64::new(0));
    let w = {
        let (stop, rounds) = (stop.clone(), rounds.clone());
        std::thread::spawn(move || worker(&stop, &rounds))
    };
    let target = w.as_pthread_t();
    // A shorter gap (even 0) makes a harsher run by hand.
    let gap_us = std::env::var("FERROPROF_SIGNAL_ALLOC_GAP_US")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(20);
    let kill_stop = Arc::new(AtomicBool::new(false));
    let killer = {
        let s = kill_stop.clone();
        std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                let before = HANDLED.load(Ordering::Relaxed);
                // SAFETY: the worker runs until `stop` is set and joined after this thread.
                unsafe { libc::pthread_kill(target, libc::SIGUSR1) };
                // The next signal only once this one was handled (or a while passed): on a
                // machine slow enough that a handler outlasts the gap, signals sent blindly
                // keep the worker in its handler for good, a stall of the test's own making.
                let sent = Instant::now();
                while HANDLED.load(Ordering::Relaxed) == before
                    && sent.elapsed() < Duration::from_millis(100)
                    && !s.load(Ordering::Relaxed)
                {
                    std::thread::yield_now();
                }
                std::thread::sleep(Duration::from_micros(gap_us));
            }
        })
    };
    let handled_before = HANDLED.load(Ordering::Relaxed);
    let end = Instant::now() + Duration::from_secs(run_secs());
    let (mut last, mut last_change) = (0, Instant::now());
    let mut handled_at_change = handled_before;
    let mut stalled = None;
    while Instant::now() < end {
        std::thread::sleep(Duration::from_millis(50));
        let now = rounds.load(Ordering::Relaxed);
        if now != last {
            (last, last_change) = (now, Instant::now());
            handled_at_change = HANDLED.load(Ordering::Relaxed);
        } else if last_change.elapsed() > STALL {
            stalled = Some((now, HANDLED.load(Ordering::Relaxed) - handled_at_change));
            break;
        }
    }
    kill_stop.store(true, Ordering::Relaxed);
    killer.join().expect("signalling thread");
    if let Some((at, handlers)) = stalled {
        // The worker (and maybe the profiler) is stuck for good, and so would be any allocation
        // of the panic machinery: say so and leave at once. Handlers that kept completing mean
        // the worker ran only its handler; none, that it is stuck in one.
        eprintln!(
            "interval {interval}: the worker stalled for {STALL:?} after {at} rounds; \
             {handlers} handlers completed meanwhile"
        );
        if std::env::var_os("FERROPROF_SIGNAL_ALLOC_GDB").is_some() {
            // Where it hangs, for whoever debugs a failure (this allocates: debugging only).
            let pid = std::process::id().to_string();
            let bt = std::process::Command::new("gdb")
                .args(["-p", &pid, "-batch", "-ex", "thread apply all bt 40"])
                .output();
            if let Ok(o) = bt {
                eprintln!("{}", String::from_utf8_lossy(&o.stdout));
            }
        }
        // SAFETY: ends the process without running anything that could wait on the stuck thread.
        unsafe { libc::_exit(101) };
    }
    stop.store(true, Ordering::Relaxed);
    w.join().expect("worker");
    let stats = guard.stats();
    let stopped = Instant::now();
    guard.stop().expect("profiler stops");
    let _ = std::fs::remove_dir_all(&dir);
    let handled = HANDLED.load(Ordering::Relaxed) - handled_before;
    println!(
        "interval {interval}: {} rounds, {handled} handlers ran, {} alloc samples, stop took {:?}",
        rounds.load(Ordering::Relaxed),
        stats.alloc_samples,
        stopped.elapsed()
    );
    assert!(handled > 1000, "the handler ran ({handled} times)");
    assert!(stats.alloc_samples > 100, "allocations were sampled");
}

#[test]
fn a_handler_allocating_inside_a_sample_at_64_bytes_never_stalls() {
    run(64);
}

#[test]
fn a_handler_allocating_inside_a_sample_at_4_kib_never_stalls() {
    run(4096);
}
