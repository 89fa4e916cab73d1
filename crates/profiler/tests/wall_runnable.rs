//! Wall time of a thread that waits for a CPU, rather than in a system call: the kernel gives
//! no registers of a runnable thread, so its site is found from the calls it made since its
//! stack was last read. The thread here blocks in one function, then moves to another where it
//! stays runnable nearly all the time (lowest priority, on one CPU with a busy thread): that
//! time belongs to the second function, not to where the thread was last seen blocked.

mod profiler_support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use profiler_support::*;

fn pin_to_cpu0() -> bool {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes inside it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(0, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

fn poll_once(fd: libc::c_int, timeout_ms: libc::c_int) {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
    std::hint::black_box(&pfd);
}

/// Blocks until `fd` is readable.
#[inline(never)]
fn runnable_site_blocked(fd: libc::c_int) {
    poll_once(fd, -1);
    std::hint::black_box(fd);
}

/// Polls a descriptor that is always readable: never blocks, and at the lowest priority next to
/// a busy thread, waits for the CPU nearly all the time.
#[inline(never)]
fn runnable_site_waiting(fd: libc::c_int, until: Instant) {
    while Instant::now() < until {
        poll_once(fd, 0);
    }
    std::hint::black_box(fd);
}

fn cpu_now() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

#[test]
fn a_runnable_threads_wait_goes_to_the_call_it_waits_in() {
    let mut a = [0; 2];
    let mut b = [0; 2];
    // SAFETY: valid out arrays for two descriptors each.
    assert_eq!(unsafe { libc::pipe(a.as_mut_ptr()) }, 0);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::pipe(b.as_mut_ptr()) }, 0);
    // b stays readable.
    // SAFETY: writing one byte from a valid buffer to our own pipe.
    assert_eq!(unsafe { libc::write(b[1], [1u8].as_ptr().cast(), 1) }, 1);
    let c = Collect::default();
    // A low rate: the worker's few milliseconds of CPU while it waits get no CPU-time sample,
    // which would also tell where it is.
    let guard = start_cpu_wall("wall-runnable-test", 20, &c);
    let stop = Arc::new(AtomicBool::new(false));
    let hog_stop = stop.clone();
    let hog = std::thread::spawn(move || {
        let pinned = pin_to_cpu0();
        let mut x = 0u64;
        while !hog_stop.load(Ordering::Relaxed) {
            x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
        }
        pinned
    });
    let (ra, rb) = (a[0], b[0]);
    let waiting_secs = 1.5;
    let worker = std::thread::Builder::new()
        .name("runnable-worker".into())
        .spawn(move || {
            let t0 = Instant::now();
            runnable_site_blocked(ra);
            let t1 = Instant::now();
            let pinned = pin_to_cpu0();
            // SAFETY: lowers this thread's own priority (no privilege needed).
            unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, 19) };
            let c1 = cpu_now();
            runnable_site_waiting(rb, t1 + Duration::from_secs_f64(waiting_secs));
            let cpu = cpu_now() - c1;
            (
                pinned,
                (t1 - t0).as_secs_f64(),
                t1.elapsed().as_secs_f64(),
                cpu,
            )
        })
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    // SAFETY: as above, for a.
    assert_eq!(unsafe { libc::write(a[1], [1u8].as_ptr().cast(), 1) }, 1);
    let (pinned, blocked_truth, waiting_truth, waiting_cpu) = worker.join().unwrap();
    stop.store(true, Ordering::Relaxed);
    let hog_pinned = hog.join().unwrap();
    let st = guard.stats();
    guard.stop().unwrap();
    for fd in [a[0], a[1], b[0], b[1]] {
        // SAFETY: our own descriptors.
        unsafe { libc::close(fd) };
    }
    if !(pinned && hog_pinned) {
        eprintln!("skipped: no CPU affinity here");
        return;
    }
    let ps = c.decoded();
    let of = |site: &'static str| {
        sum_all(&ps, "wall-time", |p, s| {
            p.label_str(s, "thread name") == Some("runnable-worker") && has_fn(p, s, site)
        }) as f64
            / 1e9
    };
    let (blocked, waiting) = (of("runnable_site_blocked"), of("runnable_site_waiting"));
    eprintln!(
        "blocked {blocked:.3} s (truth {blocked_truth:.3}), waiting {waiting:.3} s (truth \
         {waiting_truth:.3}, {waiting_cpu:.3} s of CPU); {} stacks from recent calls",
        st.wall_recent_calls
    );
    // Before stacks were found from recent calls, the waiting time went to the blocked site
    // (it was where the thread was last read): waiting read ~0.
    assert!(
        waiting > 0.7 * waiting_truth && waiting < 1.2 * waiting_truth,
        "waiting site {waiting:.3} s of {waiting_truth:.3} s"
    );
    assert!(
        blocked > 0.6 * blocked_truth && blocked < 1.3 * blocked_truth,
        "blocked site {blocked:.3} s of {blocked_truth:.3} s"
    );
}
