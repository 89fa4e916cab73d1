//! The sampling allocator.
//!
//! [`SamplingAllocator`] wraps any [`GlobalAlloc`] and samples allocations by *bytes*: sampling
//! points fall on the stream of allocated bytes as a Poisson process with a mean distance of the
//! sampling interval (512 KiB by default). Each thread keeps a countdown of the bytes left to its
//! next point, drawn from an exponential distribution; an allocation that crosses the point is
//! sampled and the countdown is redrawn from the end of that allocation. The unsampled path is a
//! relaxed load of the global interval, a thread-local subtraction and a branch.
//!
//! ## The estimator
//! Because the exponential distribution is memoryless, an allocation of `size` bytes is sampled
//! independently of everything before it with probability `p = 1 - exp(-size / interval)`. A
//! sample therefore stands for `1 / p` allocations of its size: `alloc-samples` carries that
//! weight (so it estimates the *number* of allocations without bias) and the live-heap record
//! carries it too (heap-live-size = weight x size estimates live bytes without bias). We chose
//! this over the "sampling points" estimator (number of points in the allocation x interval,
//! which needs the point count and is noisier) because the weight depends on the size only:
//! large allocations (`size >> interval`) get weight ~1, i.e. they are reported exactly, and
//! every sample of one size class has the same weight, so totals per call site converge fast.
//! The weight is rounded to an integer stochastically (up with probability equal to its fraction)
//! so rounding adds no bias either. `alloc-samples-unscaled` is 1 per sample. `alloc-space`
//! estimates bytes allocated: the sample's size times the same weight, unrounded (as Go's
//! `alloc_space`); rounding the product to a byte adds nothing measurable, where the rounded
//! weight would add noise for sizes near the interval (a weight of 1.58 read as 1 or 2).
//!
//! ## Heap tracking and frees
//! With heap profiling on, a sampled allocation is tracked by the recorder under its address,
//! and its address is counted in a [`crate::filter`]. Every free checks that filter first: a
//! clear bit (the overwhelmingly common case) ends the check after one load. Otherwise the
//! recorder removes the record, and this happens *before* the memory goes back to the inner
//! allocator, so an address reused by a new allocation can never meet a stale record. `realloc`
//! is a free of the old block followed by an allocation of the new size, whether or not the
//! block moved. If the inner `realloc` fails the old block stays allocated but untracked.
//!
//! ## Reentrancy
//! The profiler's own allocations (the recorder, the sampler and export threads, the sample
//! path itself) run with a thread-local guard set and are never sampled. Frees made while the
//! thread is inside the recorder skip the recorder (its locks may be held, and its memory is
//! never tracked).

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use ferroprof_recorder::{ExtraValues, Frame, Label, SampleValues};

use crate::arena;
use crate::filter::FILTER;
use crate::fork;
use crate::state::{self, Shared, TapKind};
use crate::tls::{self, ThreadState, STATE};
use crate::unwind::{self, MAX_FRAMES};

/// Mean bytes between samples; 0 = allocation sampling off. Set by the running profiler.
static INTERVAL: AtomicU64 = AtomicU64::new(0);
/// Whether some allocation went through a [`SamplingAllocator`] slow path since start.
static SEEN: AtomicBool = AtomicBool::new(false);

/// Default mean distance between two sampled bytes.
pub const DEFAULT_SAMPLING_INTERVAL: u64 = 512 * 1024;

pub(crate) fn set_interval(bytes: u64) {
    INTERVAL.store(bytes, Ordering::SeqCst);
}

pub(crate) fn seen() -> bool {
    SEEN.load(Ordering::Relaxed)
}

/// A [`GlobalAlloc`] that samples allocations for the allocation and live-heap profiles.
///
/// ```no_run
/// use ferroprof::SamplingAllocator;
/// use std::alloc::System;
///
/// #[global_allocator]
/// static GLOBAL: SamplingAllocator<System> = SamplingAllocator::new(System);
/// ```
///
/// Until a profiler with allocation profiling is started it costs one relaxed load per
/// allocation.
pub struct SamplingAllocator<A> {
    inner: A,
}

impl<A> SamplingAllocator<A> {
    pub const fn new(inner: A) -> Self {
        SamplingAllocator { inner }
    }

    /// The wrapped allocator.
    pub fn inner(&self) -> &A {
        &self.inner
    }
}

// SAFETY: every method forwards to the inner allocator with the caller's arguments unchanged
// and returns its result; the bookkeeping around it never touches the memory handed out.
unsafe impl<A: GlobalAlloc> GlobalAlloc for SamplingAllocator<A> {
    // The fast paths decide before calling the inner allocator and end in a tail call to it:
    // nothing stays live across a call, so they save no registers. Sampled and maybe-tracked
    // cases leave through cold out-of-line functions. `current_sp()` is taken in the allocator
    // entry itself: frames deeper than it are the sampling path's own and are left off the
    // sampled stack.
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if let Some(interval) = crosses_sampling_point(layout.size()) {
            // SAFETY: forwarded contract.
            return unsafe { self.alloc_sampled(layout, false, interval, unwind::current_sp()) };
        }
        // SAFETY: forwarded contract.
        unsafe { self.inner.alloc(layout) }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if let Some(interval) = crosses_sampling_point(layout.size()) {
            // SAFETY: forwarded contract.
            return unsafe { self.alloc_sampled(layout, true, interval, unwind::current_sp()) };
        }
        // SAFETY: forwarded contract.
        unsafe { self.inner.alloc_zeroed(layout) }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if arena::owns(ptr) {
            return arena::free(ptr, layout);
        }
        if FILTER.maybe_tracked(ptr as usize) {
            // SAFETY: forwarded contract.
            return unsafe { self.dealloc_tracked(ptr, layout) };
        }
        // SAFETY: forwarded contract.
        unsafe { self.inner.dealloc(ptr, layout) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if arena::owns(ptr) {
            // SAFETY: forwarded contract (a block of ours, moved by hand).
            return unsafe { self.realloc_arena(ptr, layout, new_size) };
        }
        // The old block may be freed by the inner realloc: untrack it first.
        if FILTER.maybe_tracked(ptr as usize) {
            on_free_slow(ptr);
        }
        // SAFETY: forwarded contract.
        let p = unsafe { self.inner.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if let Some(interval) = crosses_sampling_point(new_size) {
                on_alloc_slow(p, new_size, interval, unwind::current_sp());
            }
        }
        p
    }
}

impl<A: GlobalAlloc> SamplingAllocator<A> {
    /// An allocation that crossed this thread's sampling point.
    ///
    /// # Safety
    /// As `GlobalAlloc::alloc`.
    #[cold]
    #[inline(never)]
    unsafe fn alloc_sampled(
        &self,
        layout: Layout,
        zeroed: bool,
        interval: u64,
        entry_sp: u64,
    ) -> *mut u8 {
        if arena::in_mode() {
            if let Some(p) = arena::alloc(layout, zeroed) {
                return p;
            }
            // Out of arena: the heap, and the countdown stays as arena mode set it.
            // SAFETY: forwarded contract.
            return unsafe {
                if zeroed {
                    self.inner.alloc_zeroed(layout)
                } else {
                    self.inner.alloc(layout)
                }
            };
        }
        // SAFETY: forwarded contract.
        let p = unsafe {
            if zeroed {
                self.inner.alloc_zeroed(layout)
            } else {
                self.inner.alloc(layout)
            }
        };
        if !p.is_null() {
            on_alloc_slow(p, layout.size(), interval, entry_sp);
        }
        p
    }

    /// A realloc of an arena block: a new block (from the arena in arena mode, else from the
    /// heap), the contents copied, the old block freed.
    ///
    /// # Safety
    /// As `GlobalAlloc::realloc`.
    #[cold]
    #[inline(never)]
    unsafe fn realloc_arena(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller guarantees a valid layout for new_size with the old alignment.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        // SAFETY: forwarded contract (non-zero size: realloc's new_size is non-zero).
        let p = unsafe { self.alloc(new_layout) };
        if !p.is_null() {
            // SAFETY: both blocks are valid for the smaller size and do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(ptr, p, layout.size().min(new_size)) };
            arena::free(ptr, layout);
        }
        p
    }

    /// The free of a block the filter says may be tracked.
    ///
    /// # Safety
    /// As `GlobalAlloc::dealloc`.
    #[cold]
    #[inline(never)]
    unsafe fn dealloc_tracked(&self, ptr: *mut u8, layout: Layout) {
        on_free_slow(ptr);
        // SAFETY: forwarded contract.
        unsafe { self.inner.dealloc(ptr, layout) }
    }
}

/// Counts `size` bytes against this thread's countdown; the sampling interval when the
/// allocation crosses the sampling point (it is to be sampled, or the countdown drawn).
#[inline(always)]
fn crosses_sampling_point(size: usize) -> Option<u64> {
    let interval = INTERVAL.load(Ordering::Relaxed);
    if interval == 0 {
        return None;
    }
    let crossed = STATE.with(|s| {
        let c = s.countdown.get().wrapping_sub(size as i64);
        s.countdown.set(c);
        c < 0
    });
    crossed.then_some(interval)
}

#[cold]
#[inline(never)]
fn on_alloc_slow(p: *mut u8, size: usize, interval: u64, entry_sp: u64) {
    STATE.with(|s| alloc_slow(s, p, size, interval, entry_sp));
}

fn alloc_slow(s: &ThreadState, p: *mut u8, size: usize, interval: u64, entry_sp: u64) {
    if s.arena.get() {
        // A realloc in arena mode that stayed on the heap: the countdown stays as arena mode
        // holds it (negative), and nothing of a profiler thread is sampled.
        return;
    }
    // Looked at first: a store on every sample would pull the line from other cores each time.
    if !SEEN.load(Ordering::Relaxed) {
        SEEN.store(true, Ordering::Relaxed);
    }
    if s.rng.get() == 0 {
        // First allocation on this thread since sampling started: draw the first countdown and
        // decide this allocation against it.
        seed(s);
        let first = draw_countdown(s, interval);
        let c = first.saturating_sub(size as i64);
        if c >= 0 {
            s.countdown.set(c);
            return;
        }
    }
    s.countdown.set(draw_countdown(s, interval));
    if s.guard.get() > 0 {
        return;
    }
    // A forked child that allocates lives on: its profiler threads start now (see `fork`).
    crate::fork::resume_if_pending();
    let w = sample_weight(size as u64, interval);
    let weight = stochastic_round(s, w);
    // `as` saturates: an absurd size cannot wrap to a negative estimate.
    let space = (size as f64 * w).round() as i64;
    tls::with_guard(|| sample(p, size, weight, space, entry_sp));
}

/// `1 / (1 - exp(-size / interval))`: the inverse of the probability that an allocation of
/// `size` bytes contains a sampling point.
pub fn sample_weight(size: u64, interval: u64) -> f64 {
    if interval == 0 {
        return 1.0;
    }
    let p = -(-(size as f64) / interval as f64).exp_m1();
    if p <= 0.0 {
        interval as f64
    } else {
        1.0 / p
    }
}

fn stochastic_round(s: &ThreadState, w: f64) -> i64 {
    let floor = w.floor();
    let frac = w - floor;
    let up = frac > 0.0 && uniform(s) < frac;
    (floor as i64 + up as i64).max(1)
}

fn seed(s: &ThreadState) {
    static COUNTER: AtomicU64 = AtomicU64::new(0x9E37_79B9_7F4A_7C15);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let local = s as *const ThreadState as u64;
    let mut x =
        t ^ local.rotate_left(32) ^ COUNTER.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
    // splitmix64 finalizer so nearby seeds diverge.
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    s.rng.set(if x == 0 { 1 } else { x });
}

/// xorshift64*: fast, no state beyond one word, plenty for sampling decisions.
fn next_u64(s: &ThreadState) -> u64 {
    let mut x = s.rng.get();
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    s.rng.set(x);
    x.wrapping_mul(0x2545_F491_4F6C_DD1D)
}

/// Uniform in (0, 1].
fn uniform(s: &ThreadState) -> f64 {
    ((next_u64(s) >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
}

fn draw_countdown(s: &ThreadState, interval: u64) -> i64 {
    let d = -uniform(s).ln() * interval as f64;
    d.min((i64::MAX / 2) as f64) as i64
}

/// Records one sampled allocation. Runs with the guard set.
///
/// The walk, the rule learning and the recording run on a spare stack of the unwinder's pool:
/// together they need several KiB (framehop's CFI evaluation, the frame buffer, the recorder),
/// which a thread with a small stack may not have. This thread's stack only holds the frames
/// down to here and the switch; a thread short of that skips the sample (counted).
#[inline(never)]
fn sample(p: *mut u8, size: usize, weight: i64, space: i64, entry_sp: u64) {
    let regs = unwind::current_regs();
    // Known once the thread's first sample learned them (on the spare stack, below).
    let room =
        tls::known_stack_bounds().and_then(|b| unwind::headroom(unwind::current_sp(), Some(b)));
    let job = Job {
        p,
        size,
        weight,
        space,
        entry_sp,
        regs,
    };
    match (room, unwind::Spare::borrow()) {
        (Some(r), _) if r < unwind::ALLOC_STACK_NEED => unwind::count_skipped_low_stack(),
        (_, Some(mut spare)) => {
            spare.run(|s| job.run(Some(s)));
        }
        // Every spare stack is taken: in place, for threads with room for it.
        (Some(r), None) if r >= unwind::IN_PLACE_STACK_NEED => job.run(None),
        (None, None) if in_place_room(entry_sp) => job.run(None),
        _ => unwind::count_skipped_low_stack(),
    }
}

/// What [`sample`] hands to the spare stack.
struct Job {
    p: *mut u8,
    size: usize,
    weight: i64,
    /// Estimated bytes allocated (`alloc-space`).
    space: i64,
    entry_sp: u64,
    regs: unwind::StartRegs,
}

impl Job {
    /// Walks, learns and records. Never inlined: its frame (the frame buffer, the recorder's
    /// locals) belongs on the spare stack, not in `sample`'s frame on the thread's stack.
    #[inline(never)]
    fn run(self, spare: Option<&mut unwind::Spare>) {
        let bounds = tls::current_stack_bounds();
        let mut addrs = [0u64; MAX_FRAMES];
        let n = match spare {
            Some(s) => unwind::unwind_with(s, self.regs, bounds, self.entry_sp, &mut addrs, 0),
            None => unwind::unwind(self.regs, bounds, self.entry_sp, &mut addrs, 0),
        };
        let addrs = &addrs[..n];
        // Teaches the unwinder's fast path these frames (a few probes once they are known).
        unwind::learn(addrs);
        state::with_active(|sh| record(sh, &self, addrs));
    }
}

/// Whether the walk and recording fit on this thread's stack below `sp` (learns the bounds).
#[cold]
fn in_place_room(sp: u64) -> bool {
    tls::current_stack_bounds()
        .and_then(|b| unwind::headroom(sp, Some(b)))
        .is_some_and(|r| r >= unwind::IN_PLACE_STACK_NEED)
}

fn record(sh: &Shared, job: &Job, addrs: &[u64]) {
    let (p, size, weight) = (job.p, job.size, job.weight);
    if !sh.alloc_enabled() {
        return;
    }
    let frames: Vec<Frame<'static>> = addrs.iter().map(|&a| Frame::Address(a)).collect();
    let tid = state::current_tid();
    let mut name_buf = [0u8; 16];
    let name = state::current_thread_name(&mut name_buf);
    let mut labels = [Label::num("", 0); 2 + crate::labels::WORDS];
    labels[0] = Label::num(state::THREAD_ID_LABEL, tid as i64);
    labels[1] = Label::str(state::THREAD_NAME_LABEL, name);
    // The allocating thread's request labels (its own slot: see `crate::labels`).
    let n = 2 + crate::labels::own_ctx().fill((&mut labels[2..]).try_into().expect("WORDS"));
    let labels = &labels[..n];
    let values = SampleValues {
        alloc_samples: weight,
        alloc_samples_unscaled: 1,
        ..Default::default()
    };
    let extra = ExtraValues {
        alloc_space: job.space,
    };
    tls::in_recorder(|| {
        // Never inside the recorder while a fork is under way (see `fork`).
        fork::outside_fork(|| {
            if sh
                .recorder
                .record_sample_with(&frames, &values, &extra, labels, 0)
                .is_err()
            {
                sh.stats.record_errors.fetch_add(1, Ordering::Relaxed);
            }
            sh.stats.alloc_samples.add(1);
            if sh.heap_enabled() {
                // The heap profile's allocation columns (since the start).
                sh.alloc_totals.add(addrs, [weight, 1, job.space]);
                let w = weight.clamp(1, u32::MAX as i64) as u32;
                match sh
                    .recorder
                    .track_allocation(p as u64, w, size as u64, None, &frames)
                {
                    Ok(()) => FILTER.insert(p as usize),
                    Err(_) => {
                        sh.stats.record_errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        });
        // Outside the fork gate: taking the taps lock in there could wait for a thread that
        // holds it and waits at the gate.
        sh.for_each_tap(TapKind::Alloc, |r| {
            let _ = r.record_sample_with(&frames, &values, &extra, labels, 0);
        });
    });
}

#[cold]
#[inline(never)]
fn on_free_slow(p: *mut u8) {
    if STATE.with(|s| s.in_recorder.get()) {
        // Recorder-internal memory (never tracked) freed under the recorder's locks.
        return;
    }
    tls::with_guard(|| {
        state::with_active(|sh| {
            // The filter update stays inside the fork gate too (see `filter`).
            fork::outside_fork(|| {
                if tls::in_recorder(|| sh.recorder.untrack_allocation(p as u64)) {
                    FILTER.remove(p as usize);
                }
            });
        })
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weight_is_inverse_inclusion_probability() {
        let i = 512 * 1024;
        let w = sample_weight(16, i);
        assert!((w - (i as f64 / 16.0 + 0.5)).abs() < 1.0, "{w}");
        assert!((sample_weight(100 * i, i) - 1.0).abs() < 1e-9);
        let w1 = sample_weight(i, i);
        assert!((w1 - 1.0 / (1.0 - (-1.0f64).exp())).abs() < 1e-9);
    }

    #[test]
    fn stochastic_rounding_is_unbiased() {
        STATE.with(|s| {
            seed(s);
            let n = 200_000;
            let sum: i64 = (0..n).map(|_| stochastic_round(s, 1.25)).sum();
            let mean = sum as f64 / n as f64;
            assert!((mean - 1.25).abs() < 0.01, "{mean}");
        });
    }

    #[test]
    fn countdown_mean_is_the_interval() {
        STATE.with(|s| {
            seed(s);
            let n = 100_000;
            let sum: f64 = (0..n).map(|_| draw_countdown(s, 1000) as f64).sum();
            let mean = sum / n as f64;
            assert!((mean - 1000.0).abs() < 20.0, "{mean}");
        });
    }
}
