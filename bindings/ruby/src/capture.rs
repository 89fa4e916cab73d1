//! CPU samples read in the `SIGPROF` handler and recorded later by the CPU job.
//!
//! The handler runs on whichever thread the kernel chose, with or without the GVL, at any
//! instruction; it may not allocate or lock. It takes a free slot (an atomic state moves it
//! from empty to writing), fills it with the thread's Ruby frames (`rb_profile_frames`), the
//! thread and the intervals the signal stands for, and publishes it (full). The job, under the
//! GVL, takes full slots one at a time (full to reading), copies them to its own stack (which
//! the GC scans) and empties them. The GC's mark function marks what full slots hold, which
//! also pins it against compaction until the job has copied it.
//!
//! A sample's CPU time is its thread's own CPU clock since that thread's last captured sample
//! (the signal goes to a thread that was running at the kernel's tick, with every interval
//! the process used since: counting intervals would book one thread's time to another). A
//! thread's first sample in a run, and one whose clock went back (a new thread reusing the
//! id), weigh the intervals the signal stands for.
//!
//! When every slot is taken (a thread without the GVL whose slot waits for a job, or a burst
//! of signals), the intervals are added to a full slot of the same thread (its stack is most
//! likely still the one captured), else held over and given to the next sample the job
//! records: CPU time is never dropped, at worst booked one sample late.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicU64, Ordering};

use rb_sys::VALUE;

/// Frames read per CPU sample; deeper stacks keep their innermost frames.
pub const MAX_FRAMES: usize = 400;
/// Slots: the samples that may wait for the job at once.
const SLOTS: usize = 8;

/// A slot's word: its state in the low two bits and, while full, the intervals (22 bits) and
/// the thread's CPU microseconds (40 bits) it stands for: one word, so a handler adding to a
/// waiting sample and the job taking it cannot cross.
const EMPTY: u64 = 0;
const WRITING: u64 = 1;
const FULL: u64 = 2;
const READING: u64 = 3;
const STATE: u64 = 3;
const INTERVALS_SHIFT: u32 = 2;
const INTERVALS_MAX: u64 = (1 << 22) - 1;
const CPU_SHIFT: u32 = 24;
const CPU_US_MAX: u64 = (1 << 40) - 1;

/// The full word of a sample of `intervals` and `cpu_us`, when both fit.
fn full_word(intervals: u64, cpu_us: u64) -> Option<u64> {
    (intervals <= INTERVALS_MAX && cpu_us <= CPU_US_MAX)
        .then_some(cpu_us << CPU_SHIFT | intervals << INTERVALS_SHIFT | FULL)
}

/// A full word's (intervals, CPU microseconds).
fn parts(w: u64) -> (u64, u64) {
    ((w >> INTERVALS_SHIFT) & INTERVALS_MAX, w >> CPU_SHIFT)
}

/// What the handler read: plain data.
#[derive(Clone, Copy)]
pub struct Captured {
    pub len: usize,
    pub frames: [VALUE; MAX_FRAMES],
    pub lines: [i32; MAX_FRAMES],
    /// The Ruby thread (its `Thread` object) and its native id.
    pub thread: VALUE,
    pub tid: i64,
    /// The thread's CPU time this sample stands for (set by [`take`]).
    pub cpu_ns: u64,
    /// Read while this thread ran the garbage collector: its `major_by` and `gc_by` (static
    /// Symbols or nil, from `GC.latest_gc_info`).
    pub gc: Option<(VALUE, VALUE)>,
    /// The thread's request context then: local root span id and label set id (0: none).
    pub span: u64,
    pub labels: u64,
    /// When it was read (nanoseconds since the epoch), for the timeline.
    pub at_ns: i64,
}

impl Captured {
    pub const fn empty() -> Self {
        Captured {
            len: 0,
            frames: [0; MAX_FRAMES],
            lines: [0; MAX_FRAMES],
            thread: 0,
            tid: 0,
            cpu_ns: 0,
            gc: None,
            span: 0,
            labels: 0,
            at_ns: 0,
        }
    }
}

struct Slot {
    /// State and intervals (see [`FULL`]).
    word: AtomicU64,
    /// The thread's native id while full (read by handlers looking for their own slot).
    tid: AtomicU64,
    data: UnsafeCell<Captured>,
}

// SAFETY: `data` is written only by the holder of the WRITING state and read only by the
// holder of READING (or by the mark function while FULL, when nobody writes it); the state's
// acquire/release orderings publish it.
unsafe impl Sync for Slot {}

static SLOTS_: [Slot; SLOTS] = [const {
    Slot {
        word: AtomicU64::new(EMPTY),
        tid: AtomicU64::new(0),
        data: UnsafeCell::new(Captured::empty()),
    }
}; SLOTS];

/// Intervals of signals that found no slot, for the next recorded sample, and CPU read for a
/// sample that was taken before it could be added.
static HELD_OVER: AtomicU64 = AtomicU64::new(0);
static HELD_OVER_CPU_US: AtomicU64 = AtomicU64::new(0);

/// Threads' CPU clocks at their last captured sample, by native id (open addressing; only a
/// thread's own handler writes its entry once it holds it). No thread-local storage: in a
/// library loaded by `dlopen`, a thread's first access to it may allocate.
const THREADS: usize = 1024;
/// Entries probed per lookup; a thread that finds none free weighs its intervals.
const PROBES: usize = 32;

struct ThreadClock {
    tid: AtomicU64,
    /// Whole microseconds of the thread's CPU clock: deltas of them lose nothing over a run.
    last_us: AtomicU64,
}

static CLOCKS: [ThreadClock; THREADS] = [const {
    ThreadClock {
        tid: AtomicU64::new(0),
        last_us: AtomicU64::new(0),
    }
}; THREADS];

/// This thread's CPU microseconds since its last captured sample (`estimate` for its first,
/// or when its clock cannot be read or went back); remembers now for the next one.
fn cpu_since_last(tid: u64, estimate: u64) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime is async-signal-safe and writes into `ts`.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return estimate;
    }
    let now = ts.tv_sec as u64 * 1_000_000 + ts.tv_nsec as u64 / 1_000;
    let home = (tid.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) as usize % THREADS;
    for i in 0..PROBES {
        let e = &CLOCKS[(home + i) % THREADS];
        let held = e.tid.load(Ordering::Relaxed);
        if held == tid {
            let last = e.last_us.swap(now, Ordering::Relaxed);
            return if now >= last { now - last } else { estimate };
        }
        if held == 0
            && e.tid
                .compare_exchange(0, tid, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            e.last_us.store(now, Ordering::Relaxed);
            return estimate;
        }
    }
    estimate
}

/// In the signal handler, on a thread Ruby knows: reads its frames into a free slot, standing
/// for `intervals` of `interval_ns`. Async-signal-safe: atomics, `gettid`, `clock_gettime`,
/// `rb_thread_current` (a thread-local read of the VM's) and `rb_profile_frames` (reads the
/// thread's control frames, allocates nothing).
pub fn capture_in_handler(intervals: u64, interval_ns: u64, gc: Option<(VALUE, VALUE)>) {
    // SAFETY: gettid has no preconditions and is async-signal-safe.
    let tid = unsafe { libc::gettid() } as u64;
    for slot in &SLOTS_ {
        if slot
            .word
            .compare_exchange(EMPTY, WRITING, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            continue;
        }
        // SAFETY: this handler holds WRITING, so nothing else reads or writes `data`.
        let d = unsafe { &mut *slot.data.get() };
        // SAFETY: the buffers hold MAX_FRAMES entries; this thread has an execution context
        // (the caller checked ruby_native_thread_p).
        let n = unsafe {
            rb_sys::rb_profile_frames(
                0,
                MAX_FRAMES as i32,
                d.frames.as_mut_ptr(),
                d.lines.as_mut_ptr(),
            )
        };
        d.len = n.clamp(0, MAX_FRAMES as i32) as usize;
        // SAFETY: reads this thread's own Thread object through its execution context.
        d.thread = unsafe { rb_sys::rb_thread_current() };
        d.tid = tid as i64;
        d.gc = gc;
        (d.span, d.labels) = crate::context::get(tid);
        d.at_ns = realtime_ns();
        let cpu_us = cpu_since_last(tid, intervals * interval_ns / 1_000);
        slot.tid.store(tid, Ordering::Relaxed);
        let w = full_word(intervals, cpu_us).unwrap_or(FULL | 1 << INTERVALS_SHIFT);
        slot.word.store(w, Ordering::Release);
        return;
    }
    // No free slot: this thread's waiting sample (the same stack, most likely: a long call
    // without the GVL), which then stands for this thread's CPU since it was read too.
    for slot in &SLOTS_ {
        let mut w = slot.word.load(Ordering::Acquire);
        if w & STATE != FULL || slot.tid.load(Ordering::Relaxed) != tid {
            continue;
        }
        // Read once: only this thread adds to its own slot, and its handler is not nested.
        let cpu_us = cpu_since_last(tid, intervals * interval_ns / 1_000);
        loop {
            let (n, us) = parts(w);
            let Some(next) = full_word(n + intervals, us + cpu_us) else {
                break;
            };
            match slot
                .word
                .compare_exchange_weak(w, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return,
                Err(now) if now & STATE == FULL => w = now,
                // Taken by the job meanwhile: this thread's clock has moved on, so its CPU
                // since then would be lost; held over as intervals' worth instead.
                Err(_) => break,
            }
        }
        HELD_OVER_CPU_US.fetch_add(cpu_us, Ordering::Relaxed);
        HELD_OVER.fetch_add(intervals, Ordering::Relaxed);
        return;
    }
    HELD_OVER.fetch_add(intervals, Ordering::Relaxed);
}

/// Under the GVL: the next full slot, copied into `out` (its `cpu_ns` set), with the
/// intervals it stands for; the slot is free again on return.
pub fn take(out: &mut Captured) -> Option<u64> {
    for slot in &SLOTS_ {
        let mut w = slot.word.load(Ordering::Acquire);
        while w & STATE == FULL {
            match slot
                .word
                .compare_exchange_weak(w, READING, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    // SAFETY: READING is held: nothing writes `data` until the slot is emptied.
                    *out = unsafe { *slot.data.get() };
                    slot.word.store(EMPTY, Ordering::Release);
                    let (n, us) = parts(w);
                    out.cpu_ns = us * 1_000;
                    return Some(n);
                }
                Err(now) => w = now,
            }
        }
    }
    None
}

/// The intervals and CPU nanoseconds held over since the last call.
pub fn take_held_over() -> (u64, u64) {
    (
        HELD_OVER.swap(0, Ordering::Relaxed),
        HELD_OVER_CPU_US.swap(0, Ordering::Relaxed) * 1_000,
    )
}

/// The wall clock in nanoseconds since the epoch (0 if unreadable). Async-signal-safe.
pub fn realtime_ns() -> i64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime is async-signal-safe and writes into `ts`.
    if unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) } != 0 {
        return 0;
    }
    ts.tv_sec * 1_000_000_000 + ts.tv_nsec
}

/// Gives intervals and CPU nanoseconds back to be held over (for the next sample recorded).
pub fn hold_over(intervals: u64, cpu_ns: u64) {
    HELD_OVER.fetch_add(intervals, Ordering::Relaxed);
    HELD_OVER_CPU_US.fetch_add(cpu_ns / 1_000, Ordering::Relaxed);
}

/// Waits (briefly) for handlers still writing, once no new signal can come.
pub fn settle() {
    for _ in 0..10_000 {
        if SLOTS_
            .iter()
            .all(|s| s.word.load(Ordering::Acquire) & STATE != WRITING)
        {
            return;
        }
        std::thread::yield_now();
    }
}

/// Forgets every slot and thread clock (a new start, or a forked child: the parent's samples
/// are not its own).
pub fn clear() {
    for e in &CLOCKS {
        e.tid.store(0, Ordering::Relaxed);
    }
    for slot in &SLOTS_ {
        slot.word.store(EMPTY, Ordering::Release);
    }
    HELD_OVER.store(0, Ordering::Relaxed);
    HELD_OVER_CPU_US.store(0, Ordering::Relaxed);
}

/// For the GC's mark function: calls `mark` on each object a full slot holds (the GC
/// Symbols are static: nothing to mark).
pub fn each_held(mut mark: impl FnMut(VALUE)) {
    for slot in &SLOTS_ {
        if slot.word.load(Ordering::Acquire) & STATE != FULL {
            continue;
        }
        // SAFETY: FULL: no handler writes it, and the job (which empties it) holds the GVL, as
        // does the GC calling this.
        let d = unsafe { &*slot.data.get() };
        d.frames[..d.len].iter().copied().for_each(&mut mark);
        if d.thread != 0 {
            mark(d.thread);
        }
    }
}
