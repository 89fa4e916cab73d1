//! The sampling allocator.
//!
//! [`SamplingAllocator`] wraps any [`GlobalAlloc`] and samples allocations by *bytes*: sampling
//! points fall on the stream of allocated bytes as a Poisson process with a mean distance of the
//! sampling interval (512 KiB by default). Each thread keeps a countdown of the bytes left to its
//! next point, drawn from an exponential distribution; an allocation that crosses the point is
//! sampled and the countdown is redrawn from the end of that allocation. The unsampled path is a
//! thread-local subtraction and a branch; everything else (sampling off, profiler code, arena
//! and keep modes) holds the countdown negative or looks again after a few KiB, in the slow
//! path.
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
//! and its address is counted in a [`crate::alloc::filter`], as are the pages of the profiler's own
//! memory. Every free checks that filter first: a zero word (the overwhelmingly common case)
//! ends the check after one load. Otherwise the cold path tells the profiler's blocks from the
//! rest, and the recorder removes a tracked block's record *before* the memory goes back to the
//! inner allocator, so an address reused by a new allocation can never meet a stale record. `realloc`
//! is a free of the old block followed by an allocation of the new size, whether or not the
//! block moved. If the inner `realloc` fails the old block stays allocated but untracked.
//!
//! ## Stacks start at the allocating code
//! No frame of the allocator path is written into an allocation or heap stack: neither ours
//! (`SamplingAllocator`'s methods, the sampling path) nor the global-allocator shims
//! (`__rust_alloc`, `__rdl_alloc`, `__rg_alloc`) nor `alloc::alloc`'s plumbing to them
//! (`alloc::alloc::alloc`, `Global::alloc_impl`, `<Global as Allocator>::allocate`); see
//! [`crate::frame_names::is_allocator_path`]. What the compiler inlined decides where those frames are, so three
//! cuts together cover every outcome:
//! - the walk leaves out the frames below the stack pointer read in the allocator entry (the
//!   sampling path's own frames, deeper than the function the entry is inlined into);
//! - of what remains, leading frames whose address lies in an allocator-path function are left
//!   out ([`allocator_frames`]: the entry or a shim that is a real function, as in a debug
//!   build, or `__rust_alloc` with the entry inlined into it; in the preload library, its C
//!   entry points `malloc`, `calloc`, ...). The functions' address ranges
//!   come from the symbol table, read once when sampling is first enabled: the
//!   `SamplingAllocator` methods are generic, monomorphized in the user's crate, so their
//!   addresses are known only there;
//! - the first kept frame may still have the allocator inlined into it (`__rust_alloc`
//!   inlined into the caller, with LTO; `alloc::alloc::alloc` inlined into `alloc::raw_vec`):
//!   the symbolizer drops a location's innermost inlined frames of the allocator path
//!   ([`crate::frame_names::strip_inlined_allocator`]), keeping its outermost frame, the function the address is
//!   in. A location is shared by every stack through it, so CPU stacks that pass through the
//!   allocator's call site lose those shims' inlined frames too (they have no code of their own
//!   beyond the call).
//!
//! ## Reentrancy
//! The profiler's own allocations (the recorder, the sampler and export threads, the sample
//! path itself) run with a thread-local guard set and are never sampled. Frees made while the
//! thread is inside the recorder skip the recorder (its locks may be held, and its memory is
//! never tracked).

pub(crate) mod arena;
pub(crate) mod bigblock;
pub(crate) mod filter;
pub(crate) mod keep;
pub(crate) mod peak;
pub(crate) mod totals;
pub(crate) mod tracked;

use std::alloc::{GlobalAlloc, Layout};
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;

use ferroprof_recorder::{ExtraValues, Frame, Label, SampleValues};

use crate::alloc::filter::FILTER;
use crate::alloc::tracked::TRACKED;
use crate::frame_names::is_allocator_path;
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
    if bytes != 0 {
        // Before the first sample: the ranges are read, never waited for, on the sample path.
        ALLOCATOR_RANGES.get_or_init(allocator_ranges);
    }
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
/// Until a profiler with allocation profiling is started it costs a thread-local subtraction
/// per allocation, one load per free, and a visit to the slow path per 32 KiB a thread
/// allocates.
pub struct SamplingAllocator<A> {
    inner: A,
}

impl<A> SamplingAllocator<A> {
    /// Wraps `inner` (usually [`std::alloc::System`], or another global allocator such as jemalloc's).
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
    // The fast paths are one test each, then a tail call to the inner allocator: an allocation
    // subtracts its size from the thread's countdown, a free reads its granule's word of the
    // filter. Nothing stays live across a call, so they save no registers. Everything else
    // (sampling, the profiler's own memory, tracked objects, sampling off) is behind those two
    // tests, in cold out-of-line functions: a thread in profiler code holds its countdown
    // negative, and the profiler's own blocks are counted in the filter. `current_sp()` is
    // taken in the allocator entry itself: frames deeper than it are the sampling path's own
    // and are left off the sampled stack.
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if crosses_sampling_point(layout.size()) {
            // SAFETY: forwarded contract.
            return unsafe {
                self.alloc_cold(layout.size(), layout.align(), false, unwind::current_sp())
            };
        }
        // SAFETY: forwarded contract.
        unsafe { self.inner.alloc(layout) }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if crosses_sampling_point(layout.size()) {
            // SAFETY: forwarded contract.
            return unsafe {
                self.alloc_cold(layout.size(), layout.align(), true, unwind::current_sp())
            };
        }
        // SAFETY: forwarded contract.
        unsafe { self.inner.alloc_zeroed(layout) }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if FILTER.maybe(ptr as usize) {
            // SAFETY: forwarded contract.
            return unsafe { self.dealloc_cold(ptr, layout.size(), layout.align()) };
        }
        // SAFETY: forwarded contract.
        unsafe { self.inner.dealloc(ptr, layout) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if FILTER.maybe(ptr as usize) {
            // SAFETY: forwarded contract.
            return unsafe { self.realloc_cold(ptr, layout, new_size) };
        }
        // SAFETY: forwarded contract.
        unsafe { self.realloc_heap(ptr, layout, new_size) }
    }
}

impl<A: GlobalAlloc> SamplingAllocator<A> {
    /// An allocation that crossed this thread's sampling point, or made while the countdown is
    /// held negative (profiler code, arena or keep mode) or with sampling off. The layout comes
    /// as size and alignment, in the registers the entry received them in, so that the fast
    /// path moves nothing before its tail call either way.
    ///
    /// # Safety
    /// As `GlobalAlloc::alloc`, for the layout of `size` and `align`.
    #[cold]
    #[inline(never)]
    unsafe fn alloc_cold(&self, size: usize, align: usize, zeroed: bool, entry_sp: u64) -> *mut u8 {
        // SAFETY: the parts of a valid layout (the caller's contract).
        let layout = unsafe { Layout::from_size_align_unchecked(size, align) };
        if layout.size() >= bigblock::BIG {
            // Fresh mappings are zeroed.
            if let Some(p) = profiler_big_block(layout) {
                return p;
            }
        }
        // Arena mode (symbolizing) or keep mode (recording a sample): the profiler's own block,
        // never sampled; out of it, the heap, the countdown staying as the mode set it.
        let private = if arena::in_mode() {
            Some(arena::alloc(layout, zeroed))
        } else if keep::in_mode() {
            Some(keep::alloc(layout, zeroed))
        } else {
            None
        };
        match private {
            Some(Some(p)) => return p,
            // SAFETY: forwarded contract.
            Some(None) => return unsafe { self.inner_alloc(layout, zeroed) },
            None => {}
        }
        // SAFETY: forwarded contract.
        let p = unsafe { self.inner_alloc(layout, zeroed) };
        if !p.is_null() {
            on_alloc_slow(p, layout.size(), entry_sp, unwind::current_regs());
        }
        p
    }

    /// The free of a block the filter says may be the profiler's own or tracked (the layout
    /// as size and alignment, as in [`Self::alloc_cold`]).
    ///
    /// # Safety
    /// As `GlobalAlloc::dealloc`, for the layout of `size` and `align`.
    #[cold]
    #[inline(never)]
    unsafe fn dealloc_cold(&self, ptr: *mut u8, size: usize, align: usize) {
        // SAFETY: the parts of the block's valid layout (the caller's contract).
        let layout = unsafe { Layout::from_size_align_unchecked(size, align) };
        if arena::owns(ptr) {
            return arena::free(ptr, layout);
        }
        if layout.size() >= bigblock::BIG && bigblock::free(ptr) {
            return;
        }
        if FILTER.maybe_tracked(ptr as usize) {
            on_free_slow(ptr);
        }
        // SAFETY: forwarded contract.
        unsafe { self.inner.dealloc(ptr, layout) }
    }

    /// The realloc of a block the filter says may be the profiler's own or tracked.
    ///
    /// # Safety
    /// As `GlobalAlloc::realloc`.
    #[cold]
    #[inline(never)]
    unsafe fn realloc_cold(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if arena::owns(ptr) {
            // SAFETY: forwarded contract (a block of ours, moved by hand).
            return unsafe { self.realloc_arena(ptr, layout, new_size) };
        }
        if layout.size() >= bigblock::BIG && bigblock::owns(ptr) {
            // SAFETY: forwarded contract (a block of ours).
            return unsafe { self.realloc_big_block(ptr, layout, new_size) };
        }
        // The old block may be freed by the inner realloc: untrack it first.
        if FILTER.maybe_tracked(ptr as usize) {
            on_free_slow(ptr);
        }
        // SAFETY: forwarded contract.
        unsafe { self.realloc_heap(ptr, layout, new_size) }
    }

    /// The realloc of a heap block (the inner allocator's, not tracked).
    ///
    /// # Safety
    /// As `GlobalAlloc::realloc`.
    #[inline(always)]
    unsafe fn realloc_heap(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size >= bigblock::BIG && layout.size() < bigblock::BIG {
            // SAFETY: forwarded contract.
            if let Some(p) = unsafe { self.realloc_to_big_block(ptr, layout, new_size) } {
                return p;
            }
        }
        if keep::active_anywhere() && keep::in_mode() {
            // A heap block grown while a sample is recorded: moved to a kept block (the inner
            // realloc would move it into this application thread's arena).
            // SAFETY: forwarded contract.
            return unsafe { self.realloc_arena(ptr, layout, new_size) };
        }
        // SAFETY: forwarded contract.
        let p = unsafe { self.inner.realloc(ptr, layout, new_size) };
        if !p.is_null() && crosses_sampling_point(new_size) {
            on_alloc_slow(p, new_size, unwind::current_sp(), unwind::current_regs());
        }
        p
    }

    /// The inner allocator's `alloc_zeroed` or `alloc`.
    ///
    /// # Safety
    /// As `GlobalAlloc::alloc`.
    #[inline(always)]
    unsafe fn inner_alloc(&self, layout: Layout, zeroed: bool) -> *mut u8 {
        // SAFETY: forwarded contract.
        unsafe {
            if zeroed {
                self.inner.alloc_zeroed(layout)
            } else {
                self.inner.alloc(layout)
            }
        }
    }

    /// A realloc by moving: a new block from wherever this thread's allocations go now (the
    /// arena in arena mode, a kept block in keep mode, else the heap), the contents copied, the
    /// old block freed. For arena and kept blocks, and for heap blocks grown in keep mode.
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
            // SAFETY: forwarded contract: the old block, freed once, by whichever path owns it.
            unsafe { self.dealloc(ptr, layout) };
        }
        p
    }

    /// A realloc of one of the profiler's large blocks ([`crate::alloc::bigblock`]): resized in place
    /// of its mapping, or, when it shrinks below [`bigblock::BIG`], moved to the inner
    /// allocator (its free then comes with a small size, which the large-block check skips).
    ///
    /// # Safety
    /// As `GlobalAlloc::realloc`.
    #[cold]
    #[inline(never)]
    unsafe fn realloc_big_block(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size >= bigblock::BIG {
            return bigblock::resize(ptr, new_size);
        }
        // SAFETY: the caller guarantees a valid layout for new_size with the old alignment.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        // SAFETY: a non-zero size (realloc's contract).
        let p = unsafe { self.inner.alloc(new_layout) };
        if !p.is_null() {
            // SAFETY: both blocks are valid for the new (smaller) size and do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(ptr, p, new_size) };
            bigblock::free(ptr);
        }
        p
    }

    /// A realloc in profiler code that outgrows [`bigblock::BIG`]: the rest of the block's life
    /// in a mapping of its own (see [`crate::alloc::bigblock`]). None: not in profiler code (or no
    /// mapping), the inner allocator goes on with it.
    ///
    /// # Safety
    /// As `GlobalAlloc::realloc`.
    #[cold]
    #[inline(never)]
    unsafe fn realloc_to_big_block(
        &self,
        ptr: *mut u8,
        layout: Layout,
        new_size: usize,
    ) -> Option<*mut u8> {
        // SAFETY: the caller guarantees a valid layout for new_size with the old alignment.
        let new_layout = unsafe { Layout::from_size_align_unchecked(new_size, layout.align()) };
        let p = profiler_big_block(new_layout)?;
        // SAFETY: both blocks are valid for the old size (smaller) and do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(ptr, p, layout.size()) };
        // SAFETY: forwarded contract: the old block, freed once (its own path: tracked or not).
        unsafe { self.dealloc(ptr, layout) };
        Some(p)
    }
}

/// For an interposed C allocator (the preload library): `p`, a block of `size` bytes the C
/// allocator just handed out, goes through the same sampling and live tracking as an allocation
/// of [`SamplingAllocator`]. Called in the allocator entry itself (`malloc`), after the inner
/// allocator: the entry's stack pointer is read here, and frames deeper than it are the
/// sampling path's own. Not API.
#[doc(hidden)]
#[inline(always)]
pub fn __raw_allocated(p: *mut u8, size: usize) {
    if p.is_null() {
        return;
    }
    if crosses_sampling_point(size) {
        on_alloc_slow(p, size, unwind::current_sp(), unwind::current_regs());
    }
}

/// For an interposed C allocator: `p` is about to be freed (or moved by `realloc`). C `free`
/// has no size; the tracked-address filter needs none. Call before the memory goes back to the
/// inner allocator. Not API.
#[doc(hidden)]
#[inline(always)]
pub fn __raw_freeing(p: *mut u8) {
    if FILTER.maybe(p as usize) && FILTER.maybe_tracked(p as usize) {
        on_free_slow(p);
    }
}

/// The running profiler's estimated peak of live heap bytes (see [`crate::alloc::peak`]):
/// what [`crate::ProfilerStats::heap_peak_estimate_bytes`] reads, for an exporter that has no
/// handle on the profiler (the preload library's). 0 without heap profiling. Not API.
#[doc(hidden)]
pub fn __heap_peak_estimate_bytes() -> u64 {
    peak::HEAP_ESTIMATE.peak()
}

/// For an interposed C allocator, before the profiler starts: never serve allocations from the
/// symbolizer's arena (C `free` could not give an arena block back, having no size). Not API.
#[doc(hidden)]
pub fn __disable_arena() {
    arena::disable();
}

/// A block of at least [`bigblock::BIG`] bytes for profiler code (not in arena mode, which has
/// its own): a mapping of its own, so the inner allocator never frees a large block of ours
/// (see [`crate::alloc::bigblock`]). None for the application's blocks.
#[cold]
#[inline(never)]
fn profiler_big_block(layout: Layout) -> Option<*mut u8> {
    let ours = STATE.with(|s| s.guard.get() > 0 && !s.arena.get());
    if !ours {
        return None;
    }
    bigblock::alloc(layout)
}

/// Counts `size` bytes against this thread's countdown; true when the allocation is to take
/// the slow path: it crosses the sampling point, or the countdown is held negative (profiler
/// code, arena and keep modes), or sampling is off and the thread is due to look again.
#[inline(always)]
fn crosses_sampling_point(size: usize) -> bool {
    STATE.with(|s| {
        let c = s.countdown.get().wrapping_sub(size as i64);
        s.countdown.set(c);
        c < 0
    })
}

/// With allocation sampling off, a thread looks at the interval again after this many bytes:
/// the price of a fast path that reads no global state (a profiler started later begins
/// sampling a thread within this many of its bytes).
const OFF_RECHECK_BYTES: i64 = 32 * 1024;

/// An allocation past the countdown's test. `regs` are taken in the allocator's own frame (the
/// slow path's entry or the interposed `malloc`), where a sample's walk starts: it unwinds
/// none of the sampling path's frames below (four fewer per sample, a quarter of the walk).
#[cold]
#[inline(never)]
fn on_alloc_slow(p: *mut u8, size: usize, entry_sp: u64, regs: unwind::StartRegs) {
    let interval = INTERVAL.load(Ordering::Relaxed);
    STATE.with(|s| alloc_slow(s, p, size, interval, entry_sp, regs));
}

fn alloc_slow(
    s: &ThreadState,
    p: *mut u8,
    size: usize,
    interval: u64,
    entry_sp: u64,
    regs: unwind::StartRegs,
) {
    // Looked at first: a store on every sample would pull the line from other cores each time.
    if !SEEN.load(Ordering::Relaxed) {
        SEEN.store(true, Ordering::Relaxed);
    }
    if s.arena.get() || s.keep.get() || s.guard.get() > 0 {
        // The profiler's own allocation (or one in arena or keep mode that stayed on the heap):
        // never sampled, and the countdown stays as the mode or the guard holds it (negative).
        return;
    }
    // A forked child that allocates lives on: its profiler threads start now (see `fork`; its
    // CPU timer sends an allocation of any size here, `sampler::child_trigger`).
    crate::forkgate::resume_if_pending();
    if interval == 0 {
        s.countdown.set(OFF_RECHECK_BYTES);
        return;
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
    // The headroom check comes here, not in `sample`: the guard, keep mode and `sample`'s own
    // frames in between take about a KiB of the thread's stack in a debug build, and a thread
    // short of stack overflowed on the way to a later check (`tests/small_stack.rs`). The
    // bounds are known once the thread's first sample learned them (on a spare stack).
    let room = s
        .known_stack_bounds()
        .and_then(|b| unwind::headroom(unwind::current_sp(), Some(b)))
        .map(|r| r.saturating_sub(SAMPLE_FRAMES));
    if room.is_some_and(|r| r < unwind::ALLOC_STACK_NEED) {
        unwind::count_skipped_low_stack();
        return;
    }
    let w = sample_weight(size as u64, interval);
    let weight = stochastic_round(s, w);
    // `as` saturates: an absurd size cannot wrap to a negative estimate.
    let space = (size as f64 * w).round() as i64;
    let job = Job {
        p,
        size,
        weight,
        space,
        entry_sp,
        regs,
    };
    tls::with_guard(|| keep::with(|| sample(job, room)));
}

/// Stack the frames from [`alloc_slow`]'s headroom check down to [`sample`]'s body may take
/// (the guard, keep mode, their closures and `sample`'s frame): 912 bytes measured in a debug
/// build (`tests/small_stack.rs`), a few dozen in a release one, where they are inlined.
const SAMPLE_FRAMES: u64 = if cfg!(debug_assertions) { 1280 } else { 256 };

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
fn sample(job: Job, room: Option<u64>) {
    // `room`: the thread's headroom here, checked by `alloc_slow` (`None`: bounds not known).
    match (room, unwind::Spare::borrow()) {
        (_, Some(mut spare)) => {
            spare.run(|s| job.run(Some(s)));
        }
        // Every spare stack is taken: in place, for threads with room for it.
        (Some(r), None) if r >= unwind::IN_PLACE_STACK_NEED => job.run(None),
        (None, None) if in_place_room(job.entry_sp) => job.run(None),
        _ => unwind::count_skipped_low_stack(),
    }
}

/// A sampled allocation, as [`sample`] hands it to the spare stack.
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
    /// Walks (which learns new frames) and records. Never inlined: its frame (the frame
    /// buffer, the recorder's locals) belongs on the spare stack, not in `sample`'s frame on
    /// the thread's stack.
    #[inline(never)]
    fn run(self, spare: Option<&mut unwind::Spare>) {
        let bounds = tls::current_stack_bounds();
        let mut local;
        let addrs: &[u64] = match spare {
            // The spare's own buffer: no 8 KiB to clear per sample.
            Some(s) => unwind::unwind_into_spare_buffer(s, self.regs, bounds, self.entry_sp),
            None => {
                local = [0u64; MAX_FRAMES];
                let n = unwind::unwind(self.regs, bounds, self.entry_sp, &mut local, 0);
                &local[..n]
            }
        };
        let addrs = &addrs[allocator_frames(addrs)..];
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
    let tid = crate::threads::current_tid();
    let mut name_buf = [0u8; 16];
    let name = crate::threads::current_thread_name(&mut name_buf);
    let mut labels = [Label::num("", 0); 2 + crate::labels::WORDS];
    labels[0] = Label::num(crate::threads::THREAD_ID_LABEL, tid as i64);
    labels[1] = Label::str(crate::threads::THREAD_NAME_LABEL, name);
    // The allocating thread's request labels (its own slot: see `crate::labels`).
    let ctx = crate::labels::own_ctx();
    let n = 2 + labels[2..]
        .first_chunk_mut::<{ crate::labels::WORDS }>()
        .map_or(0, |w| ctx.fill(w));
    let labels = &labels[..n];
    with_address_frames(addrs, |frames| {
        tls::in_recorder(|| record_frames(sh, job, addrs, frames, labels, &ctx))
    });
}

/// [`record`] with the stack as the recorders take it.
fn record_frames(
    sh: &Shared,
    job: &Job,
    addrs: &[u64],
    frames: &[Frame<'static>],
    labels: &[Label<'_>],
    ctx: &crate::labels::Ctx,
) {
    let (p, size, weight) = (job.p, job.size, job.weight);
    // The allocation profile and the live heap are separate choices: `heap` alone samples too.
    let (alloc_on, heap_on) = (sh.alloc_enabled(), sh.heap_enabled());
    let values = SampleValues {
        alloc_samples: weight,
        alloc_samples_unscaled: 1,
        ..Default::default()
    };
    let extra = ExtraValues {
        alloc_space: job.space,
    };
    // Never inside the recorder while a fork is under way (see `fork`).
    crate::forkgate::outside_fork(|| {
        if alloc_on
            && sh
                .recorder
                .record_sample_with(frames, &values, &extra, labels, 0)
                .is_err()
        {
            sh.stats.record_errors.fetch_add(1, Ordering::Relaxed);
        }
        sh.stats.alloc_samples.add(1);
        if heap_on {
            // The heap profile's allocation columns (since the start).
            sh.alloc_totals.add(addrs, [weight, 1, job.space]);
            let w = weight.clamp(1, u32::MAX as i64) as u32;
            // The live object keeps its request's local root span id: its heap sample
            // carries it, and the request's endpoint once the request names it.
            let root = ctx.local_root_span_id();
            match sh
                .recorder
                .track_allocation_in(p as u64, w, size as u64, None, frames, root)
            {
                Ok(bytes) => {
                    FILTER.insert(p as usize);
                    TRACKED.insert(p as usize);
                    peak::HEAP_ESTIMATE.tracked(bytes);
                }
                Err(_) => {
                    sh.stats.record_errors.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    });
    // Outside the fork gate: taking the taps lock in there could wait for a thread that
    // holds it and waits at the gate.
    sh.for_each_tap(TapKind::Alloc, |r| {
        let _ = r.record_sample_with(frames, &values, &extra, labels, 0);
    });
}

/// Calls `f` with `addrs` as address frames, on the stack at the usual depths: a sample
/// allocates nothing for them (a block in keep mode and its free cost about as much as the
/// heap recorder's lookup).
fn with_address_frames<R>(addrs: &[u64], f: impl FnOnce(&[Frame<'static>]) -> R) -> R {
    const ON_STACK: usize = 64;
    if addrs.len() > ON_STACK {
        let frames: Vec<Frame<'static>> = addrs.iter().map(|&a| Frame::Address(a)).collect();
        return f(&frames);
    }
    let mut buf = [const { MaybeUninit::<Frame<'static>>::uninit() }; ON_STACK];
    for (b, &a) in buf.iter_mut().zip(addrs) {
        b.write(Frame::Address(a));
    }
    // SAFETY: the first `addrs.len()` elements (at most ON_STACK) were written just above, and
    // `MaybeUninit<Frame>` has the layout of `Frame`.
    let frames =
        unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<Frame<'static>>(), addrs.len()) };
    f(frames)
}

/// Address ranges `[start, end)` of the allocator-path functions (see [`crate::frame_names::is_allocator_path`]),
/// sorted and disjoint; set once, when sampling is first enabled.
static ALLOCATOR_RANGES: OnceLock<Box<[(u64, u64)]>> = OnceLock::new();

/// How many leading frames of a sampled allocation's stack (innermost first) lie in
/// allocator-path functions; never all of them (an unknown stack keeps what it has).
/// Allocation-free and bounded: a binary search per leading frame.
fn allocator_frames(addrs: &[u64]) -> usize {
    let Some(ranges) = ALLOCATOR_RANGES.get() else {
        return 0;
    };
    let n = addrs.iter().take_while(|&&a| in_ranges(ranges, a)).count();
    if n == addrs.len() {
        0
    } else {
        n
    }
}

fn in_ranges(ranges: &[(u64, u64)], a: u64) -> bool {
    let i = ranges.partition_point(|&(start, _)| start <= a);
    i > 0 && a < ranges[i - 1].1
}

/// The cheap test on symbol names ([`Prefilter::may_be_allocator_path`]), its searchers built
/// once per scan.
struct Prefilter {
    alloc: memchr::memmem::Finder<'static>,
    rust_shim: memchr::memmem::Finder<'static>,
    current_sp: memchr::memmem::Finder<'static>,
}

impl Prefilter {
    fn new() -> Prefilter {
        Prefilter {
            alloc: memchr::memmem::Finder::new("alloc"),
            rust_shim: memchr::memmem::Finder::new("__r"),
            current_sp: memchr::memmem::Finder::new("current_sp"),
        }
    }

    /// Whether the mangled (legacy or v0) or plain symbol name `raw` may demangle to a name of
    /// the allocator path ([`crate::frame_names::is_allocator_path`]) or be a C allocation entry, so that only
    /// those few are demangled. Most names hold none of `alloc`, `__r` and `current_sp`, found
    /// with SIMD searchers; the finer test runs on the others. ferroprof's paths are matched
    /// down to `ferroprof::alloc`: matching the crate alone demangled every symbol of the
    /// preload library, 2 ms of each start.
    fn may_be_allocator_path(&self, raw: &[u8]) -> bool {
        let has = |pat: &str| memchr::memmem::find(raw, pat.as_bytes()).is_some();
        if self.alloc.find(raw).is_some() {
            // `ferroprof::alloc::...`: `9ferroprof5alloc` in both manglings
            // (`_ZN9ferroprof5alloc`, `...Cs<hash>_9ferroprof5alloc`), `ferroprof..alloc..`
            // inside a legacy `<...>` path; `alloc::alloc::...`; the shims (`__rust_alloc`).
            has("9ferroprof5alloc")
                || has("ferroprof..alloc..")
                || has("5alloc5alloc")
                || has("alloc..alloc")
                || has("__r")
                || std::str::from_utf8(raw).is_ok_and(is_c_allocation_entry)
        } else {
            // `__rdl_*`, `__rg_*`; `ferroprof::unwind::arch::current_sp`; `memalign`.
            self.rust_shim
                .find(raw)
                .is_some_and(|_| has("__rdl_") || has("__rg_"))
                || self
                    .current_sp
                    .find(raw)
                    .is_some_and(|_| has("10current_sp"))
                || (raw.len() <= 14 && std::str::from_utf8(raw).is_ok_and(is_c_allocation_entry))
        }
    }
}

/// Whether rustc built (some of) the object: its `.comment` section names the compilers.
fn built_by_rustc(elf: &object::File<'_>) -> bool {
    use object::{Object, ObjectSection};
    elf.section_by_name(".comment")
        .and_then(|c| c.data().ok())
        .is_some_and(|d| memchr::memmem::find(d, b"rustc").is_some())
}

/// The C allocation API's entry points (see [`allocator_ranges`]).
fn is_c_allocation_entry(name: &str) -> bool {
    matches!(
        name,
        "malloc"
            | "calloc"
            | "realloc"
            | "reallocarray"
            | "posix_memalign"
            | "aligned_alloc"
            | "memalign"
            | "valloc"
            | "pvalloc"
    )
}

/// The allocator-path functions' ranges in the objects that hold ferroprof and the program
/// (where `#[global_allocator]` monomorphizes `SamplingAllocator` and defines the shims),
/// from their ELF symbol tables. Empty for a stripped binary (the symbolizer's cut remains).
fn allocator_ranges() -> Box<[(u64, u64)]> {
    use object::{Object, ObjectSymbol};
    let ours = on_alloc_slow as fn(*mut u8, usize, u64, unwind::StartRegs) as usize as u64;
    let mut out = Vec::new();
    let filter = Prefilter::new();
    let objects = crate::modules::loaded_objects();
    for (i, obj) in objects.iter().enumerate() {
        // The main program is listed first.
        if i != 0 && !obj.contains(ours) {
            continue;
        }
        let Some(path) = obj.path.as_deref() else {
            continue;
        };
        let Ok(file) = std::fs::File::open(path) else {
            continue;
        };
        // SAFETY: mapped read-only and private for the duration of this scan; a concurrent
        // truncation of a loaded object's file is outside what we support (as in `symbolize`).
        let Ok(map) = (unsafe { memmap2::Mmap::map(&file) }) else {
            continue;
        };
        let Ok(elf) = object::File::parse(&*map) else {
            continue;
        };
        if !obj.contains(ours) && !built_by_rustc(&elf) {
            // A main program in C or C++ (ferroprof preloaded): no Rust allocator path to find,
            // and its symbol table can be large (a compiler's: 2 ms of each start).
            continue;
        }
        for sym in elf.symbols().chain(elf.dynamic_symbols()) {
            if sym.kind() != object::SymbolKind::Text || sym.size() == 0 {
                continue;
            }
            let Ok(bytes) = sym.name_bytes() else {
                continue;
            };
            if !filter.may_be_allocator_path(bytes) {
                continue;
            }
            let Ok(raw) = std::str::from_utf8(bytes) else {
                continue;
            };
            let name = match rustc_demangle::try_demangle(raw) {
                Ok(d) => format!("{d:#}"),
                Err(_) => raw.to_owned(),
            };
            // The C allocation API, where ferroprof itself defines it (the preload library):
            // its entries are the allocator path of a C program.
            let c_entry = obj.contains(ours) && is_c_allocation_entry(raw);
            if c_entry || is_allocator_path(&name) {
                let start = sym.address().wrapping_add(obj.base);
                out.push((start, start.saturating_add(sym.size())));
            }
        }
    }
    out.sort_unstable();
    // Disjoint, merged where they touch or overlap (aliases of one function).
    let mut merged: Vec<(u64, u64)> = Vec::with_capacity(out.len());
    for (s, e) in out {
        match merged.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => merged.push((s, e)),
        }
    }
    merged.into_boxed_slice()
}

#[cold]
#[inline(never)]
fn on_free_slow(p: *mut u8) {
    // Callers asked the filter's mark for the free's 256 bytes. A free past it may still only
    // share those 256 bytes with a tracked object: the set answers, not the recorder.
    if !TRACKED.may_hold(p as usize) {
        return;
    }
    if STATE.with(|s| s.in_recorder.get()) {
        // Recorder-internal memory (never tracked) freed under the recorder's locks.
        return;
    }
    tls::with_guard(|| {
        state::with_active(|sh| {
            // The filter update stays inside the fork gate too (see `filter`), and inside
            // `in_recorder`: a signal handler's free on this thread while a filter counter is
            // held busy here must skip, not spin on it.
            crate::forkgate::outside_fork(|| {
                tls::in_recorder(|| {
                    if let Some(bytes) = sh.recorder.untrack_allocation_bytes(p as u64) {
                        FILTER.remove(p as usize);
                        TRACKED.remove(p as usize);
                        peak::HEAP_ESTIMATE.untracked(bytes);
                    }
                })
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
    fn leading_frames_in_allocator_functions_are_counted() {
        let ranges = [(0x100, 0x200), (0x300, 0x310)];
        assert!(in_ranges(&ranges, 0x100) && in_ranges(&ranges, 0x1ff));
        assert!(!in_ranges(&ranges, 0x200) && !in_ranges(&ranges, 0xff));
        assert!(in_ranges(&ranges, 0x30f) && !in_ranges(&ranges, 0x310));
        assert!(!in_ranges(&[], 0x100));
        // This test binary's own allocator shim is found (a `SamplingAllocator` is not the
        // unit tests' global allocator, but `__rust_alloc`/`__rdl_alloc` are always there).
        let found = allocator_ranges();
        assert!(!found.is_empty());
        assert!(found.windows(2).all(|w| w[0].1 < w[1].0 && w[0].0 < w[0].1));
    }

    /// The cheap test on mangled names lets through every symbol of this binary (which holds
    /// ferroprof's allocator, in legacy mangling) that the full test on its demangled name
    /// takes, and in v0 mangling too; and it keeps most symbols away from demangling.
    #[test]
    fn the_mangled_name_test_misses_no_allocator_path_symbol() {
        use object::{Object, ObjectSymbol};
        let exe = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        let elf = object::File::parse(&*exe).unwrap();
        let filter = Prefilter::new();
        let (mut all, mut passed, mut taken) = (0, 0, 0);
        for sym in elf.symbols() {
            let Ok(raw) = sym.name() else { continue };
            let Ok(d) = rustc_demangle::try_demangle(raw) else {
                continue;
            };
            all += 1;
            let name = format!("{d:#}");
            passed += usize::from(filter.may_be_allocator_path(raw.as_bytes()));
            if is_allocator_path(&name) {
                taken += 1;
                assert!(
                    filter.may_be_allocator_path(raw.as_bytes()),
                    "{raw} ({name})"
                );
            }
        }
        assert!(taken > 0, "no allocator-path symbol in {all}");
        assert!(passed * 10 < all, "{passed} of {all} symbols passed");
        for v0 in [
            "_RNvNtCs1234_9ferroprof5alloc13on_alloc_slow",
            "_RNvXs_NtCs1234_9ferroprof5allocINtB4_17SamplingAllocatorpENtNtNtCs5678_4core5alloc6global11GlobalAlloc5alloc",
            "_RNvNtNtCs1234_9ferroprof6unwind4arch10current_sp",
            "_RNvCs1234_7___rustc12___rust_alloc",
        ] {
            let name = format!("{:#}", rustc_demangle::demangle(v0));
            assert!(is_allocator_path(&name), "{name}");
            assert!(filter.may_be_allocator_path(v0.as_bytes()), "{v0}");
        }
    }

    /// The free fast path reads the filter alone: every block of the profiler's own memory
    /// (kept blocks, arena blocks, large blocks) must make it say "maybe", and go back through
    /// the cold path to where it came from (not to the inner allocator).
    #[test]
    fn the_profilers_own_blocks_are_seen_by_the_free_filter() {
        use std::alloc::System;
        static A: SamplingAllocator<System> = SamplingAllocator::new(System);
        let small = Layout::from_size_align(48, 8).unwrap();
        let big = Layout::from_size_align(bigblock::BIG + 100, 16).unwrap();
        // SAFETY (all three blocks): allocated and freed through `A` with their layouts.
        let kept = keep::with(|| unsafe { A.alloc(small) });
        assert!(arena::owns(kept), "a kept block");
        assert!(
            FILTER.maybe(kept as usize),
            "a kept block's page is counted"
        );
        unsafe { A.dealloc(kept, small) };
        let large = tls::with_guard(|| unsafe { A.alloc(big) });
        assert!(
            bigblock::owns(large),
            "a large block of profiler code is a mapping"
        );
        assert!(FILTER.maybe(large as usize));
        unsafe { A.dealloc(large, big) };
        assert!(!bigblock::owns(large), "unmapped through the cold path");
        let owner = arena::new_owner();
        let mut in_arena = None;
        arena::with(owner, || {
            // SAFETY: as above; freed before the pass ends.
            let p = unsafe { A.alloc(small) };
            in_arena = arena::owns(p).then(|| FILTER.maybe(p as usize));
            unsafe { A.dealloc(p, small) };
        });
        arena::release(owner);
        // Another test's symbolizer may hold the arena: then the block came from the heap.
        assert_ne!(in_arena, Some(false), "an arena block's page is counted");
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

    #[test]
    fn address_frames_match_the_addresses_on_and_off_the_stack() {
        for n in [0usize, 1, 63, 64, 65, MAX_FRAMES] {
            let addrs: Vec<u64> = (0..n as u64).map(|i| 0x1000 + i * 8).collect();
            let got = with_address_frames(&addrs, |frames| frames.to_vec());
            let want: Vec<Frame<'static>> = addrs.iter().map(|&a| Frame::Address(a)).collect();
            assert_eq!(got, want, "{n} frames");
        }
    }
}
