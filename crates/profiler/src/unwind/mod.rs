//! Stack unwinding with DWARF CFI (`.eh_frame`), safe to run in a signal handler.
//!
//! Rust's std ships with frame pointers but user code is usually built without them, so a
//! frame-pointer walk loses the callers of every user function. This module unwinds with the
//! call frame information every Linux object carries in `.eh_frame` (indexed by
//! `.eh_frame_hdr`), using `framehop` under its "must not allocate during unwind" policy.
//!
//! What runs where:
//! * The sampler thread (never a handler) builds a [`Snapshot`]: the module list read from the
//!   dynamic loader plus the readable-writable mappings of `/proc/self/maps` (to bound stack
//!   reads). Unwind sections are used in place for the main program and the vDSO, which are
//!   never unloaded, and from private copies for every other object (made while the loader
//!   guarantees the object is mapped, see [`crate::modules`]): a snapshot that lags behind a
//!   `dlclose` never reads the unloaded object's memory, and an object later loaded into its
//!   range costs wrong or lost frames until the next snapshot, never a fault. It publishes the
//!   snapshot through an atomic pointer. An old snapshot is freed only once no reader is inside
//!   any snapshot (a global reader count observed at zero after the swap).
//! * [`unwind`] (signal handler or allocator) loads the snapshot, borrows a preallocated
//!   unwinder cache from a fixed pool with a compare-and-swap (no waiting: when all are busy
//!   the stack is cut to its leaf frame), and walks at most `out.len()` frames.
//! * Each pool entry also owns a spare stack: the handler and the allocation sampling path run
//!   their walk (and the allocation path its recording) on it ([`Spare::run`], x86_64), so a
//!   thread's own stack only carries a few hundred bytes of profiler frames. Before that they
//!   check the thread's headroom against what the path needs on the thread's stack, and skip
//!   the sample (counted) when it is short ([`headroom`], [`skipped_low_stack`]).
//! * Stack reads are bounded to `[sp, top of the stack mapping)`: the thread's own stack bounds
//!   when known (learned outside the handler), else the snapshot mapping that contains `sp`.
//!   Nothing outside that range is ever dereferenced, so a corrupt frame cannot fault.
//!
//! Supported: Linux x86_64 and aarch64 with glibc, code in objects listed by the dynamic loader.
//! Not supported: JIT code without registered unwind info (the frame-pointer fallback applies),
//! stacks of threads switched by user-space coroutines beyond the current stack.

#[cfg(target_arch = "x86_64")]
pub(crate) mod rules;

use std::cell::UnsafeCell;
use std::ops::Deref;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use framehop::{
    CacheNative, ExplicitModuleSectionInfo, FrameAddress, Module, MustNotAllocateDuringUnwind,
    Unwinder, UnwinderNative,
};

use crate::modules::{loaded_objects_for_unwind, objects_generation, LoadedObject};
#[cfg(target_arch = "x86_64")]
use rules::{RuleModule, RuleTable, Step};

#[cfg_attr(target_arch = "x86_64", path = "x86_64.rs")]
#[cfg_attr(target_arch = "aarch64", path = "aarch64.rs")]
mod arch;
mod frames;
mod snapshot;
mod spare;

pub(crate) use arch::*;
pub use frames::MAX_FRAMES;
pub(crate) use frames::*;
pub(crate) use snapshot::*;
pub(crate) use spare::*;

/// Unwinds from `regs` into `out` (innermost first), returning the number of frames written.
/// Entries are the instruction pointer, then return addresses minus one (the call instruction),
/// ready for symbolization; a stack deeper than `out` is cut in the middle, at a truncation
/// marker (see [`Sink`]). `bounds` are the caller's stack bounds when known. Frames whose
/// stack pointer is below `skip_to_sp` are left out (the profiler's own frames on an allocation
/// stack, deeper than the function the allocator entry is inlined into; 0 keeps everything).
///
/// Async-signal-safe with `skip_to_sp` 0: no allocation, no lock, no waiting; memory reads stay
/// within the stack mapping containing `regs.sp`. A walk that skips (the allocation path, never
/// a signal handler) also learns the rules of the frames it found unknown to the fast path, kept
/// or skipped, which parses unwind tables.
///
/// `stale`: how many entries of `out` still hold an earlier stack of the same thread (a
/// reused capture slot). Their rules are prefetched before the walk: a thread's stacks repeat
/// from one sample to the next, and a handler would otherwise meet each rule's cache miss
/// only when its frame comes up, one after the other.
pub(crate) fn unwind(
    regs: StartRegs,
    bounds: Option<(usize, usize)>,
    skip_to_sp: u64,
    out: &mut [u64],
    stale: usize,
) -> usize {
    unwind_counted(regs, bounds, skip_to_sp, &mut out.into(), true, stale, None).0
}

/// [`unwind`] into a [`FrameBuf`], with the unwinder cache of `spare` when given (normally
/// called on its stack, inside [`Spare::run`]).
pub(crate) fn unwind_into(
    spare: Option<&mut Spare>,
    regs: StartRegs,
    bounds: Option<(usize, usize)>,
    skip_to_sp: u64,
    out: &mut FrameBuf<'_>,
    stale: usize,
) -> usize {
    let cache = spare.map(|s| s.cache());
    unwind_counted(regs, bounds, skip_to_sp, out, true, stale, cache).0
}

/// [`unwind`] with the unwinder cache of `spare` (normally called on its stack, inside
/// [`Spare::run`]).
pub(crate) fn unwind_with(
    spare: &mut Spare,
    regs: StartRegs,
    bounds: Option<(usize, usize)>,
    skip_to_sp: u64,
    out: &mut [u64],
    stale: usize,
) -> usize {
    unwind_into(
        Some(spare),
        regs,
        bounds,
        skip_to_sp,
        &mut out.into(),
        stale,
    )
}

/// [`unwind_with`] into the frame buffer of `spare` itself: the frames, innermost first, valid
/// while the spare is held (a caller saves clearing a buffer of its own at every walk).
pub(crate) fn unwind_into_spare_buffer(
    spare: &mut Spare,
    regs: StartRegs,
    bounds: Option<(usize, usize)>,
    skip_to_sp: u64,
) -> &[u64] {
    let (cache, frames) = spare.cache_and_frames();
    let n = unwind_counted(
        regs,
        bounds,
        skip_to_sp,
        &mut FrameBuf::from(&mut frames[..]),
        true,
        0,
        Some(cache),
    )
    .0;
    &frames[..n]
}

/// [`unwind`], also returning how many frames the compact rules handled; `fast` off
/// leaves every frame to framehop (tests compare the two). `own_cache`: a cache the caller
/// holds; without one, a pool entry is borrowed the first time a frame needs framehop.
fn unwind_counted(
    regs: StartRegs,
    bounds: Option<(usize, usize)>,
    skip_to_sp: u64,
    out: &mut FrameBuf<'_>,
    fast: bool,
    stale: usize,
    own_cache: Option<&mut NativeCache>,
) -> (usize, usize) {
    if out.len() == 0 {
        return (0, 0);
    }
    out.set(0, regs.pc);
    let sp = regs.sp;
    // Everything below is cold in a handler: start the stack's misses now, in parallel.
    let known = bounds.filter(|&(lo, hi)| (lo as u64) <= sp && sp < hi as u64);
    if let Some((_, hi)) = known {
        prefetch_stack(sp, hi as u64);
    }
    let _reader = ReaderGuard::enter();
    let snap = HOT.snapshot.load(Ordering::SeqCst);
    let pool = HOT.pool.load(Ordering::SeqCst);
    if snap.is_null() || pool.is_null() {
        return (1, 0);
    }
    // SAFETY: a published snapshot stays alive while READERS counts us (see `reclaim`); the
    // pool is never freed.
    let (snap, pool) = unsafe { (&*snap, &*pool) };
    #[cfg(target_arch = "x86_64")]
    if fast {
        rules::prefetch(&snap.rule_entries, regs.pc);
        // The first 128 at most: more would evict each other.
        for i in 1..stale.min(out.len()).min(128) {
            rules::prefetch(&snap.rule_entries, out.get(i));
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = stale;
    let range = match known {
        Some((_, hi)) => Some((sp, hi as u64)),
        // Interrupted while on one of our spare stacks (a sampled allocation's recording):
        // that stack alone, whatever the snapshot says of the memory around it (the fallback
        // below would read from the spare stack up to the thread's TLS, across other
        // mappings and their guard pages).
        None => spare_stack_of(pool, sp).or_else(|| {
            snap.stack_of(sp).or_else(|| {
                // A stack newer than the snapshot: ask for a refresh, use the fallback
                // meanwhile.
                MAPS_STALE.store(true, Ordering::Relaxed);
                thread_pointer_bound(sp)
            })
        }),
    };
    let Some((lo, hi)) = range else {
        MAPS_STALE.store(true, Ordering::Relaxed);
        return (1, 0);
    };
    // Bounds that are not the thread's own (a snapshot's mapping, which may have changed
    // since; the span up to the thread pointer) may hold a hole or a guard page: those reads
    // go through the kernel, which fails them instead of faulting.
    let mut window = CheckedWindow::new();
    let read_stack = |addr: u64| -> Result<u64, ()> {
        if addr < lo || addr.checked_add(8).is_none_or(|e| e > hi) {
            return Err(());
        }
        if known.is_none() {
            return window.read(addr, hi);
        }
        // SAFETY: [addr, addr+8) lies within this thread's own stack, below sp's frame.
        Ok(unsafe { ptr::read_volatile(addr as *const u64) })
    };
    let mut sink = Sink::new(out);
    let walked = walk(
        snap,
        pool,
        regs,
        FrameAddress::from_instruction_pointer(regs.pc),
        skip_to_sp,
        &mut sink,
        fast,
        own_cache,
        read_stack,
    );
    // A walk that skips frames is a sampled allocation's, outside any signal handler: it
    // learns what it did not know, the frames of its own path that it leaves off included
    // (else each sample would walk those through framehop again). Once all are known, a
    // sample skips the learning's probes too.
    #[cfg(target_arch = "x86_64")]
    let learn = skip_to_sp != 0 && sink.unknown > 0;
    #[cfg(target_arch = "x86_64")]
    if learn {
        snap.rules.learn(sink.unknown_skipped());
    }
    let n = sink.finish(!walked.out_of_steps);
    #[cfg(target_arch = "x86_64")]
    if learn {
        snap.rules.learn(&out.head[..n.min(out.head.len())]);
    }
    (n, walked.fast_frames)
}

/// Where a walk stopped on a frame it could not unwind: the frame, and the stack and frame
/// pointers it had for it.
#[derive(Clone, Copy)]
struct Stuck {
    frame: FrameAddress,
    sp: u64,
    fp: u64,
    /// framehop said "end of stack" (a frame-pointer frame with a zero frame pointer says so
    /// too), rather than failing.
    ended: bool,
}

/// How a [`walk`] went.
struct Walked {
    /// Frames the compact rules handled.
    fast_frames: usize,
    /// Where it got stuck, if a frame could not be unwound.
    stuck: Option<Stuck>,
    /// It stopped for its step budget, with more stack to go.
    out_of_steps: bool,
}

/// Walks the stack from `regs` (its first frame `start`) with the snapshot's rules and framehop,
/// reading stack words through `read_stack`, into `sink`.
#[allow(clippy::too_many_arguments)]
fn walk(
    snap: &Snapshot,
    pool: &[PoolEntry],
    regs: StartRegs,
    start: FrameAddress,
    skip_to_sp: u64,
    sink: &mut Sink<'_, '_>,
    fast: bool,
    mut own_cache: Option<&mut NativeCache>,
    mut read_stack: impl FnMut(u64) -> Result<u64, ()>,
) -> Walked {
    #[cfg(target_arch = "x86_64")]
    let uregs = framehop::x86_64::UnwindRegsX86_64::new(regs.pc, regs.sp, regs.fp);
    #[cfg(target_arch = "aarch64")]
    let uregs = framehop::aarch64::UnwindRegsAarch64::new_with_ptr_auth_mask(
        snap.ptr_auth_mask,
        regs.lr,
        regs.sp,
        regs.fp,
    );
    #[cfg(not(target_arch = "x86_64"))]
    let _ = fast;
    let mut uregs = uregs;
    let mut fast_frames = 0;
    // A framehop cache, borrowed from the pool the first time a frame needs framehop.
    let mut entry: Option<&PoolEntry> = None;
    let mut frame = start;
    let mut stuck = None;
    let mut out_of_steps = false;
    let first = sink.seen;
    // Bounded by the sink's step budget (skipped frames count too).
    while sink.wants_more() {
        if !sink.step() {
            out_of_steps = true;
            break;
        }
        let lookup = frame.address_for_lookup();
        let kept = uregs.sp() >= skip_to_sp;
        if kept {
            sink.push_at(lookup, uregs.sp());
        }
        #[cfg(target_arch = "x86_64")]
        if fast {
            let known = rules::rule(&snap.rule_entries, lookup);
            if known.is_none() {
                sink.note_unknown(lookup, !kept);
            }
            if let Some(rule) = known {
                match rules::step(rule, &mut uregs, &mut read_stack) {
                    Step::Next(ret) => {
                        fast_frames += 1;
                        match FrameAddress::from_return_address(ret) {
                            Some(f) => frame = f,
                            None => break,
                        }
                        continue;
                    }
                    Step::End => {
                        fast_frames += 1;
                        break;
                    }
                    Step::Fallback => {}
                }
            }
        }
        let cache: &mut NativeCache = match own_cache.as_deref_mut() {
            Some(c) => c,
            None => {
                let e = match entry {
                    Some(e) => e,
                    None => {
                        let Some(e) = pool.iter().find(|e| {
                            e.busy
                                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                                .is_ok()
                        }) else {
                            // Every cache is busy: the stack ends here.
                            break;
                        };
                        entry = Some(e);
                        e
                    }
                };
                // SAFETY: we own `e` (its `busy` flag) until it is released below.
                unsafe { &mut *e.cache.get() }
            }
        };
        match snap
            .unwinder
            .unwind_frame(frame, &mut uregs, cache, &mut read_stack)
        {
            Ok(Some(ret)) => match FrameAddress::from_return_address(ret) {
                Some(f) => frame = f,
                None => break,
            },
            result => {
                stuck = Some(Stuck {
                    frame,
                    sp: uregs.sp(),
                    #[cfg(target_arch = "x86_64")]
                    fp: uregs.bp(),
                    #[cfg(not(target_arch = "x86_64"))]
                    fp: uregs.fp(),
                    ended: result.is_ok(),
                });
                break;
            }
        }
    }
    if let Some(e) = entry {
        e.busy.store(false, Ordering::Release);
    }
    if sink.seen == first {
        sink.push_at(regs.pc, regs.sp);
    }
    Walked {
        fast_frames,
        stuck,
        out_of_steps,
    }
}

/// A framehop cache owned by a walker that is not a signal handler (see [`unwind_copied`]).
pub(crate) struct OwnCache(Box<NativeCache>);

impl OwnCache {
    pub(crate) fn new() -> OwnCache {
        OwnCache(Box::new(NativeCache::new_in()))
    }
}

/// Unwinds another thread of this process from its program counter and stack pointer, over
/// `stack`: a copy of its stack from `sp` up (the sampler thread, for a thread blocked in the
/// kernel). Its frame pointer is unknown: a frame whose rule needs it ends the walk. Reads
/// nothing of the other thread's memory; frames into `out`, their number returned.
/// `more_above`: the copy stops short of the stack's top, so a walk that runs off it was cut
/// (it ends in a truncation marker, as one deeper than `out` does). `sps` receives where the
/// stack pointer stood in each frame, for as many frames as it holds.
pub(crate) fn unwind_copied(
    pc: u64,
    sp: u64,
    stack: &[u8],
    more_above: bool,
    cache: &mut OwnCache,
    out: &mut [u64],
    sps: &mut [u64],
) -> usize {
    if out.is_empty() {
        return 0;
    }
    let _reader = ReaderGuard::enter();
    let snap = HOT.snapshot.load(Ordering::SeqCst);
    let pool = HOT.pool.load(Ordering::SeqCst);
    if snap.is_null() || pool.is_null() {
        out[0] = pc;
        return 1;
    }
    // SAFETY: as in `unwind_counted`.
    let (snap, pool) = unsafe { (&*snap, &*pool) };
    let end = sp.saturating_add(stack.len() as u64);
    let read = |addr: u64| -> Result<u64, ()> {
        if addr < sp || addr.checked_add(8).is_none_or(|e| e > end) {
            return Err(());
        }
        let off = (addr - sp) as usize;
        let word: [u8; 8] = stack[off..off + 8].try_into().map_err(|_| ())?;
        Ok(u64::from_ne_bytes(word))
    };
    // A walk that wanted a word past the copy, of a stack that goes on above it, stopped for
    // want of stack rather than at the stack's end.
    let past_end = std::cell::Cell::new(false);
    let walk_read = |addr: u64| {
        let r = read(addr);
        if r.is_err() && addr >= sp && addr.saturating_add(8) > end {
            past_end.set(true);
        }
        r
    };
    let mut buf = FrameBuf::from(out);
    let mut sink = Sink::new(&mut buf).with_sps(sps);
    // The frame pointer is unknown. Code built with frame pointers (Rust's std, between a
    // blocking libc call and the application) finds its frame through it: when the walk gets
    // stuck there, the frame pointer is guessed from the copy and the walk goes on. Only a
    // proven guess is taken (see `guess_frame_pointer`); a walk that cannot go on ends in
    // `[stack unknown]` rather than at a wrong caller or without its root.
    let mut frame = FrameAddress::from_instruction_pointer(pc);
    let (mut at_sp, mut fp) = (sp, 0u64);
    // The depth where the first guess whose caller is not proven (an indirect call) began.
    let mut unproven_from: Option<usize> = None;
    let mut outcome = Outcome::Unknown;
    for _ in 0..8 {
        let regs = StartRegs {
            pc: frame.address(),
            sp: at_sp,
            fp,
            lr: 0,
        };
        past_end.set(false);
        let walked = walk(
            snap,
            pool,
            regs,
            frame,
            0,
            &mut sink,
            true,
            Some(&mut cache.0),
            walk_read,
        );
        let Some(stuck) = walked.stuck else {
            outcome = if walked.out_of_steps {
                Outcome::Cut
            } else {
                Outcome::Root
            };
            break;
        };
        if more_above && past_end.get() && !stuck.ended {
            outcome = Outcome::Cut;
            break;
        }
        // A frame pointer the walk restored that fails is the stack's end when framehop says
        // so (a zero frame pointer at the root), else a frame it could not unwind.
        if stuck.fp != 0 {
            if stuck.ended {
                outcome = Outcome::Root;
            }
            break;
        }
        if stuck.ended && ends_whatever_the_frame_pointer(snap, &stuck, cache, read) {
            outcome = Outcome::Root;
            break;
        }
        let Some((guess, proven)) = guess_frame_pointer(snap, &stuck, &read) else {
            break;
        };
        // The stuck frame is the first of the next walk: written again in place.
        sink.pop();
        if !proven && unproven_from.is_none() {
            unproven_from = Some(sink.depth() + 1);
        }
        frame = stuck.frame;
        at_sp = stuck.sp;
        fp = guess;
    }
    // An unproven caller stands when the walk from it reached the thread's root and the next
    // caller's direct call, if it is one, goes into it; else the stack keeps what came
    // before it and is marked.
    if let Some(k) = unproven_from {
        let checks_out = outcome == Outcome::Root
            && match (sink.frame(k), sink.frame(k + 1)) {
                (Some(caller), Some(next)) => {
                    check_call(snap, next.wrapping_add(1), caller) != CallCheck::Refuted
                }
                _ => true,
            };
        if !checks_out && sink.keep_first(k) {
            outcome = Outcome::Unknown;
        }
    }
    match outcome {
        Outcome::Root => sink.finish(true),
        Outcome::Cut => sink.finish(false),
        Outcome::Unknown => sink.finish_unknown(),
    }
}

/// Whether the frame a walk got stuck in with an unknown frame pointer, where framehop said
/// "end of stack", is the stack's real end: framehop says so too for a frame-pointer frame whose
/// frame pointer is zero, as it is here for want of a known one. The frame is unwound again with
/// a made-up frame pointer whose frame record reads as a caller: only a frame whose rules mark no
/// caller whatever the frame pointer (the thread's root) still ends the stack.
fn ends_whatever_the_frame_pointer(
    snap: &Snapshot,
    stuck: &Stuck,
    cache: &mut OwnCache,
    read: impl Fn(u64) -> Result<u64, ()>,
) -> bool {
    // Canonical, aligned, and in no stack: its frame record exists only in this probe.
    const RECORD: u64 = 0x7ff0_0000_0000;
    let mut probe_read = |addr: u64| match addr {
        RECORD => Ok(RECORD + 0x1000),
        a if a == RECORD + 8 => Ok(stuck.frame.address()),
        a => read(a),
    };
    #[cfg(target_arch = "x86_64")]
    let mut probe =
        framehop::x86_64::UnwindRegsX86_64::new(stuck.frame.address(), stuck.sp, RECORD);
    #[cfg(target_arch = "aarch64")]
    let mut probe = framehop::aarch64::UnwindRegsAarch64::new_with_ptr_auth_mask(
        snap.ptr_auth_mask,
        0,
        stuck.sp,
        RECORD,
    );
    matches!(
        snap.unwinder
            .unwind_frame(stuck.frame, &mut probe, &mut cache.0, &mut probe_read),
        Ok(None)
    )
}

/// How a walk over a copied stack ended.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Outcome {
    /// At the thread's root.
    Root,
    /// For want of stack or of steps, with more stack above.
    Cut,
    /// At a caller it could not find or prove.
    Unknown,
}

/// What the code before return address `ret` says of a call into the function holding
/// `callee` (a lookup address).
#[derive(Clone, Copy, PartialEq, Eq)]
enum CallCheck {
    /// A call whose target is fixed (direct, a bound PLT stub, the GOT) goes into it.
    Proven,
    /// An indirect call: nothing to check.
    Unknown,
    /// A fixed call goes elsewhere (or into code no unwind table knows).
    Refuted,
}

fn check_call(snap: &Snapshot, ret: u64, callee: u64) -> CallCheck {
    #[cfg(target_arch = "x86_64")]
    let target = direct_call_target(snap, ret);
    #[cfg(not(target_arch = "x86_64"))]
    let target: Option<u64> = {
        let _ = ret;
        None
    };
    match target {
        None => CallCheck::Unknown,
        Some(t) if function_start(snap, callee) == Some(t) => CallCheck::Proven,
        Some(_) => CallCheck::Refuted,
    }
}

/// Whether `ret`, a word found in a thread's stack at `slot`, is the return address of a call
/// still in progress from a frame whose own stack pointer is `caller_sp`: it points into loaded
/// code right after a call instruction, and the frame it returns to (its stack pointer then
/// `slot + 8`) unwinds to `caller_sp`; when the caller's call (returning to `caller_ret`) is a
/// direct one, it points into the function called. Words left over from calls that returned
/// rarely pass: each must fit the unwind rules of the code it points into at exactly that
/// depth, and be in the function its caller calls. `read`
/// reads the thread's stack (a copy of it). x86_64 only (elsewhere return addresses are not
/// always on the stack): false.
pub(crate) fn returns_into(
    ret: u64,
    slot: u64,
    caller_sp: u64,
    caller_ret: u64,
    cache: &mut OwnCache,
    read: impl FnMut(u64) -> Result<u64, ()>,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let _reader = ReaderGuard::enter();
        let snap = HOT.snapshot.load(Ordering::SeqCst);
        if snap.is_null() {
            return false;
        }
        // SAFETY: as in `unwind_counted`: the reader guard keeps the snapshot alive.
        let snap = unsafe { &*snap };
        if !snap.objects.iter().any(|o| o.executes(ret)) || !follows_a_call(ret) {
            return false;
        }
        // A direct call from the caller says which function this frame must be in (a tail
        // call from it would fail this: the walk then stops one frame short, never wrong).
        if check_call(snap, caller_ret, ret - 1) == CallCheck::Refuted {
            return false;
        }
        let Some(frame) = FrameAddress::from_return_address(ret) else {
            return false;
        };
        // A frame-pointer function's frame pointer sits 16 bytes below its caller's stack
        // pointer (return address, saved frame pointer); other code ignores it.
        let mut regs = framehop::x86_64::UnwindRegsX86_64::new(
            frame.address(),
            slot + 8,
            caller_sp.wrapping_sub(16),
        );
        let mut read = read;
        matches!(
            snap.unwinder.unwind_frame(frame, &mut regs, &mut cache.0, &mut read),
            Ok(Some(_)) if regs.sp() == caller_sp
        )
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ret, slot, caller_sp, caller_ret, cache, read);
        false
    }
}

/// The frame pointer of the frame-pointer function a walk is stuck in (its stack pointer
/// `stuck.sp`): the lowest 8-aligned address at or above it (within 4 KiB) whose next word is
/// a return address (in an executable segment of a loaded object, right after a call
/// instruction) of a call that may go into the stuck function. With whether that was proven:
/// a direct call into the stuck function proves it; an indirect one cannot, and the caller
/// checks the walk that follows. Words left over from calls that returned (a clock read just
/// before a sleep leaves its return addresses in the stack the sleep then uses) are return
/// addresses too, but of calls into other functions: a direct one is skipped, an indirect one
/// left to the caller's check.
fn guess_frame_pointer(
    snap: &Snapshot,
    stuck: &Stuck,
    read: &impl Fn(u64) -> Result<u64, ()>,
) -> Option<(u64, bool)> {
    let base = stuck.sp.checked_add(7)? & !7;
    let callee = stuck.frame.address_for_lookup();
    (0..512u64).map(|i| base + i * 8).find_map(|at| {
        let ret = read(at + 8).ok()?;
        if read(at).is_err()
            || !snap.objects.iter().any(|o| o.executes(ret))
            || !follows_a_call(ret)
        {
            return None;
        }
        match check_call(snap, ret, callee) {
            CallCheck::Proven => Some((at, true)),
            CallCheck::Unknown => Some((at, false)),
            CallCheck::Refuted => None,
        }
    })
}

/// Whether the calling thread is running a signal handler: its stack holds a return address
/// into the signal-return trampoline (`__restore_rt`, which glibc's `sigaction` gives the
/// kernel as every handler's restorer). `None` when that cannot be told: no handler installed
/// through glibc to learn the trampoline from, no unwinder snapshot yet, a walk that stopped
/// at once, or not x86_64. Async-signal-safe and allocation-free: for `_exit`, which a handler
/// may call while it interrupted a lock holder, so that nothing there takes a lock. The walk
/// runs on a spare stack: a handler's own stack may be a small alternate one.
#[doc(hidden)]
#[inline(never)]
pub fn __in_signal_handler() -> Option<bool> {
    let restorer = signal_restorer()?;
    let regs = current_regs();
    let bounds = crate::tls::known_stack_bounds();
    let mut spare = Spare::borrow()?;
    spare
        .run(|s| {
            let mut frames = [0u64; 128];
            let n = unwind_with(s, regs, bounds, 0, &mut frames, 0);
            // A return address is the trampoline's first byte; one taken as address - 1 too.
            (n > 2).then(|| {
                frames[..n]
                    .iter()
                    .any(|&a| a.wrapping_sub(restorer).wrapping_add(1) <= 2)
            })
        })
        .flatten()
}

#[cfg(test)]
mod tests {
    /// A stack found through the snapshot (not the thread's own bounds) whose top page became
    /// inaccessible after the snapshot was taken: the walk follows a frame pointer into it and
    /// must stop there, not fault. (Before reads outside the thread's own bounds went through
    /// the kernel, this test died of SIGSEGV.)
    #[test]
    fn a_walk_on_a_stack_the_snapshot_knows_wrong_stops_instead_of_faulting() {
        init_pool();
        let page = 4096usize;
        // SAFETY: a fresh anonymous mapping of our own.
        let r = unsafe {
            libc::mmap(
                ptr::null_mut(),
                3 * page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(r, libc::MAP_FAILED);
        let base = r as u64;
        refresh(true);
        // SAFETY: the top page of our mapping; nothing uses it.
        let rc = unsafe {
            libc::mprotect(
                (base + 2 * page as u64) as *mut libc::c_void,
                page,
                libc::PROT_NONE,
            )
        };
        assert_eq!(rc, 0);
        let regs = StartRegs {
            // In no object: framehop walks by frame pointer.
            pc: 0x1000,
            sp: base + 64,
            fp: base + 2 * page as u64 + 64,
            lr: 0,
        };
        let mut out = [0u64; 16];
        let (n, _) = unwind_counted(
            regs,
            None,
            0,
            &mut FrameBuf::from(&mut out[..]),
            true,
            0,
            None,
        );
        assert!(n >= 1);
        let mut w = CheckedWindow::new();
        assert!(w
            .read(base + 2 * page as u64 - 8, base + 3 * page as u64)
            .is_ok());
        assert!(w
            .read(base + 2 * page as u64, base + 3 * page as u64)
            .is_err());
        // SAFETY: our own mapping, no longer used.
        unsafe { libc::munmap(r, 3 * page) };
    }

    /// One checked window spans pages: a stack read through the kernel costs one call for
    /// several pages, and a page it cannot read ends the window there, keeping the pages
    /// before it; the page after the hole is read by a window of its own.
    #[test]
    fn a_checked_window_reads_across_pages_and_stops_at_a_hole() {
        let page = 4096u64;
        // SAFETY: a fresh anonymous mapping of our own.
        let r = unsafe {
            libc::mmap(
                ptr::null_mut(),
                4 * page as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(r, libc::MAP_FAILED);
        let base = r as u64;
        for i in 0..4 {
            // SAFETY: the first word of each of our four pages.
            unsafe { *((base + i * page) as *mut u64) = 100 + i };
        }
        // SAFETY: the third page of our mapping; nothing uses it.
        let rc = unsafe {
            libc::mprotect(
                (base + 2 * page) as *mut libc::c_void,
                page as usize,
                libc::PROT_NONE,
            )
        };
        assert_eq!(rc, 0);
        let hi = base + 4 * page;
        let mut w = CheckedWindow::new();
        assert_eq!(w.read(base, hi), Ok(100));
        let (start, len) = (w.start, w.len);
        assert_eq!(
            (start, len),
            (base, 2 * page as usize),
            "two pages, up to the hole"
        );
        assert_eq!(w.read(base + page, hi), Ok(101));
        assert_eq!(
            (w.start, w.len),
            (start, len),
            "served from the same window"
        );
        assert_eq!(w.read(base + 2 * page, hi), Err(()));
        assert_eq!(w.read(base + 3 * page, hi), Ok(103));
        // SAFETY: our own mapping, no longer used.
        unsafe { libc::munmap(r, 4 * page as usize) };
    }

    use super::*;

    #[inline(never)]
    fn capture(out: &mut [u64]) -> usize {
        let regs = current_regs();
        unwind(regs, crate::tls::current_stack_bounds(), 0, out, 0)
    }

    #[inline(never)]
    fn level2(out: &mut [u64]) -> usize {
        let n = capture(out);
        std::hint::black_box(n)
    }

    #[inline(never)]
    fn level1(out: &mut [u64]) -> usize {
        let n = level2(out);
        std::hint::black_box(n)
    }

    #[test]
    fn unwinds_through_functions_without_frame_pointers() {
        init_pool();
        refresh(true);
        let mut out = [0u64; MAX_FRAMES];
        let n = level1(&mut out);
        assert!(n >= 4, "only {n} frames");
        // Frame 1 returns into level2, frame 2 into level1: both inside those functions.
        let l2 = level2 as *const () as usize as u64;
        let l1 = level1 as *const () as usize as u64;
        assert!(
            out[1] > l2 && out[1] < l2 + 4096,
            "{:#x} vs level2 {l2:#x}",
            out[1]
        );
        assert!(
            out[2] > l1 && out[2] < l1 + 4096,
            "{:#x} vs level1 {l1:#x}",
            out[2]
        );
        // The walk reaches the test harness and thread start, far beyond our frames.
        assert!(n > 6, "stack cut short at {n} frames");
    }

    #[test]
    fn spare_stack_runs_the_walk_off_the_thread_stack_with_the_same_result() {
        init_pool();
        refresh(true);
        let mut spare = Spare::borrow().expect("a free spare stack");
        let top = spare.entry.stack_top as u64;
        let bounds = crate::tls::current_stack_bounds();
        let regs = current_regs();
        let mut here = [0u64; MAX_FRAMES];
        let n_here = unwind(regs, bounds, 0, &mut here, 0);
        let mut there = [0u64; MAX_FRAMES];
        let (n_there, sp_there) = spare
            .run(|s| {
                let n = unwind_with(s, regs, bounds, 0, &mut there, 0);
                (n, current_sp())
            })
            .expect("the job ran");
        #[cfg(target_arch = "x86_64")]
        assert!(
            sp_there < top && sp_there > top - SPARE_STACK_BYTES as u64,
            "{sp_there:#x} not on the spare stack below {top:#x}"
        );
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (sp_there, top);
        assert!(n_here > 3, "only {n_here} frames");
        assert_eq!(&here[..n_here], &there[..n_there]);
        drop(spare);
    }

    #[test]
    fn a_pc_in_no_known_module_cuts_the_stack() {
        init_pool();
        refresh(true);
        let here = current_regs();
        let bounds = crate::tls::current_stack_bounds();
        let mut out = [0u64; MAX_FRAMES];
        // Unmapped code addresses (what a stale snapshot may meet): the leaf is kept, and the
        // walk goes no further than the frame pointer chain allows, reading only the stack.
        for pc in [0x1000, u64::MAX - 4096] {
            let regs = StartRegs { pc, ..here };
            let n = unwind(regs, bounds, 0, &mut out, 0);
            assert!(n >= 1);
            assert_eq!(out[0], pc);
        }
    }

    #[test]
    fn probing_tells_readable_stack_from_unmapped_memory() {
        assert_eq!(probe_room(current_sp(), 512), Some(512));
        // The first pages of the address space are never mapped.
        assert_eq!(probe_room(0x2000, 512), Some(0));
        assert_eq!(probe_room(100, 512), Some(0));
        assert_eq!(probe_room(current_sp(), 1 << 20), None, "past a guard page");
    }

    #[test]
    fn headroom_comes_from_the_bounds_or_the_mappings() {
        init_pool();
        refresh(true);
        let sp = current_sp();
        assert_eq!(
            headroom(sp, Some((0x1000, sp as usize + 8))),
            Some(sp - 0x1000)
        );
        // Bounds that do not contain sp: the mapping (a thread's stack) answers.
        let bounds = crate::tls::current_stack_bounds().expect("this thread's stack");
        let room = headroom(sp, Some((1, 2))).expect("the stack is in the snapshot's mappings");
        assert!(
            room <= sp - bounds.0 as u64 + 4096,
            "{room} vs {}",
            sp - bounds.0 as u64
        );
        assert!(room > 0);
    }

    #[test]
    fn decodes_pcrel_eh_frame_pointer() {
        // version 1, pcrel|sdata4, udata4, datarel|sdata4, then -0x20.
        let mut hdr = vec![1u8, 0x1b, 0x03, 0x3b];
        hdr.extend_from_slice(&(-0x20i32).to_le_bytes());
        assert_eq!(
            crate::modules::eh_frame_address(&hdr, 0x1000),
            Some(0x1000 + 4 - 0x20)
        );
        assert_eq!(
            crate::modules::eh_frame_address(&[2, 0, 0, 0, 0, 0, 0, 0], 0),
            None
        );
    }

    /// Recursion through a function compiled without frame pointers and through `level1`/
    /// `level2`, so the stack has many frames and several distinct rules.
    #[inline(never)]
    fn recurse(depth: u32, out: &mut [u64], fast: bool) -> (usize, usize) {
        if depth == 0 {
            let regs = current_regs();
            unwind_counted(
                regs,
                crate::tls::current_stack_bounds(),
                0,
                &mut out.into(),
                fast,
                0,
                None,
            )
        } else {
            let r = std::hint::black_box(recurse(depth - 1, out, fast));
            (r.0, std::hint::black_box(r.1))
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn compact_rules_unwind_exactly_like_framehop() {
        init_pool();
        refresh(true);
        // One call site for every walk, so all stacks are the same down to the thread's start:
        // framehop alone, fast path before learning (falls back everywhere), after learning.
        let mut stacks = Vec::new();
        for (round, fast) in [false, true, true].into_iter().enumerate() {
            let mut out = [0u64; MAX_FRAMES];
            let (n, used) = recurse(20, &mut out, fast);
            if round == 1 {
                learn(&out[..n]);
            }
            stacks.push((out[..n].to_vec(), used));
        }
        let (slow, fast_before, fast_after) = (&stacks[0], &stacks[1], &stacks[2]);
        assert!(
            slow.0.len() > 22,
            "framehop walked only {} frames",
            slow.0.len()
        );
        assert_eq!(slow.1, 0);
        assert_eq!(fast_before.0, slow.0);
        assert_eq!(
            fast_after.0, slow.0,
            "the compact rules must give framehop's stack"
        );
        // Every frame, down to the thread's entry (whose rule says the stack ends there), has a
        // compact rule: the walk never borrows a framehop cache.
        assert_eq!(
            fast_after.1,
            fast_after.0.len(),
            "only {} of {} frames took the fast path",
            fast_after.1,
            fast_after.0.len()
        );
    }

    /// [`recurse`]'s shape with a stack pointer taken `keep_from` levels above the walk: the
    /// levels below it are what a sampled allocation skips (its own path). `skip` off walks
    /// them all (and learns nothing).
    #[inline(never)]
    fn recurse_skipping(
        depth: u32,
        keep_from: u32,
        sp: u64,
        skip: bool,
        fast: bool,
        out: &mut [u64],
    ) -> (usize, usize) {
        let sp = if depth == keep_from { current_sp() } else { sp };
        if depth == 0 {
            unwind_counted(
                current_regs(),
                crate::tls::current_stack_bounds(),
                if skip { sp } else { 0 },
                &mut out.into(),
                fast,
                0,
                None,
            )
        } else {
            let r = recurse_skipping(depth - 1, keep_from, sp, skip, fast, out);
            let r = std::hint::black_box(r);
            (r.0, std::hint::black_box(r.1))
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn a_skipping_walk_learns_every_frame_it_did_not_know() {
        init_pool();
        refresh(true);
        // One call site for every walk (see `compact_rules_unwind_exactly_like_framehop`):
        // framehop alone without skipping, then twice skipping, as sampled allocations do.
        let mut out = [0u64; MAX_FRAMES];
        let mut walks = Vec::new();
        for round in 0..3 {
            let walked = round > 0;
            walks.push(recurse_skipping(12, 6, 0, walked, walked, &mut out));
        }
        let (all, kept, (again, fast)) = (walks[0].0, walks[1].0, walks[2]);
        assert!(
            kept + 4 <= all,
            "kept {kept} of {all}: the walk skipped too little"
        );
        // The second skipping walk knows every frame it passes, kept or skipped: none goes
        // through framehop (each sampled allocation used to, for its own path's frames).
        assert_eq!(again, kept);
        assert_eq!(
            fast, all,
            "{fast} of {all} frames took the fast path ({kept} kept)"
        );
        // A walk that skips nothing (a signal handler's) learns nothing: this call site's
        // frame stays unknown walk after walk.
        for _ in 0..2 {
            let (n, fast) = recurse_skipping(12, 6, 0, false, true, &mut out);
            assert_eq!(n, all);
            assert!(fast < n, "a walk without skipping learned its frames");
        }
    }

    /// Pushes `depth` frames 1..=depth into a buffer of `len` (split after `head`) and
    /// finishes it.
    fn sink_of(len: usize, head: usize, depth: usize, ended: bool) -> Vec<u64> {
        let mut store = vec![0u64; len];
        let (h, t) = store.split_at_mut(head);
        let mut buf = FrameBuf::new(h, t);
        let mut sink = Sink::new(&mut buf);
        for f in 1..=depth as u64 {
            sink.push(f);
        }
        let n = sink.finish(ended);
        store.truncate(n);
        store
    }

    #[test]
    fn a_stack_deeper_than_the_buffer_keeps_both_ends_around_a_marker() {
        // Fits: as walked.
        assert_eq!(sink_of(16, 16, 16, true), (1..=16).collect::<Vec<_>>());
        for head in [16, 5, 0, 13] {
            // 16 slots: 11 leaf frames, the marker, the 4 outermost of 100.
            let got = sink_of(16, head, 100, true);
            let mut want: Vec<u64> = (1..=11).collect();
            want.push(truncation_marker(100 - 15));
            want.extend(97..=100);
            assert_eq!(got, want, "head {head}");
            // One frame too many: it and the frame whose slot the marker takes give way.
            let got = sink_of(16, head, 17, true);
            assert_eq!(&got[..11], &(1..=11).collect::<Vec<_>>()[..]);
            assert_eq!(got[11], truncation_marker(2));
            assert_eq!(&got[12..], &[14, 15, 16, 17]);
        }
        // Stopped before the end (out of steps): no root end to show, the marker is outermost.
        let got = sink_of(16, 4, 100, false);
        assert_eq!(got.len(), 12);
        assert_eq!(&got[..11], &(1..=11).collect::<Vec<_>>()[..]);
        assert_eq!(got[11], truncation_marker(89));
        // Too small for a marker: the leaf end only.
        assert_eq!(sink_of(1, 1, 5, true), vec![1]);
    }

    #[test]
    fn markers_name_a_power_of_two_of_the_frames_left_out() {
        assert_eq!(
            truncation_name(truncation_marker(1)).as_deref(),
            Some("[truncated: 1+ frames]")
        );
        assert_eq!(
            truncation_name(truncation_marker(200)).as_deref(),
            Some("[truncated: 128+ frames]")
        );
        assert_eq!(
            truncation_name(truncation_marker(256)).as_deref(),
            Some("[truncated: 256+ frames]")
        );
        assert_eq!(truncation_name(0x5555_0000_1000), None);
        assert!(
            !is_truncation_marker(0xffff_ffff_ff60_0000),
            "the vsyscall page"
        );
    }

    /// Recursion `depth` deep, then a walk into `out`.
    #[inline(never)]
    fn deep(depth: u32, out: &mut FrameBuf<'_>) -> usize {
        if depth == 0 {
            let regs = current_regs();
            unwind_counted(
                regs,
                crate::tls::current_stack_bounds(),
                0,
                out,
                true,
                0,
                None,
            )
            .0
        } else {
            std::hint::black_box(deep(depth - 1, out))
        }
    }

    #[test]
    fn a_deep_recursion_keeps_its_leaf_and_its_thread_start() {
        init_pool();
        refresh(true);
        let depth = MAX_FRAMES as u32 + 200;
        // Run on a thread of known stack so that debug builds' frames fit. One call site for
        // every walk: the stacks are the same down to the thread's start. Buffers: room for the
        // whole stack; the limit; the limit split in two parts; 16 slots (128 steps: the walk
        // stops far from the end).
        let mut stacks = std::thread::Builder::new()
            .stack_size(64 << 20)
            .spawn(move || {
                let mut stacks = Vec::new();
                for (len, head) in [
                    (4 * MAX_FRAMES, 0),
                    (MAX_FRAMES, 0),
                    (MAX_FRAMES, 100),
                    (16, 0),
                ] {
                    let mut s = vec![0u64; len];
                    let (h, t) = s.split_at_mut(head);
                    let n = deep(depth, &mut FrameBuf::new(h, t));
                    s.truncate(n);
                    stacks.push(s);
                }
                stacks
            })
            .unwrap()
            .join()
            .unwrap();
        let short = stacks.pop().unwrap();
        let split = stacks.pop().unwrap();
        let cut = stacks.pop().unwrap();
        let whole = stacks.pop().unwrap();
        assert!(
            whole.len() > depth as usize,
            "walked {} frames",
            whole.len()
        );
        assert!(!whole.iter().any(|&a| is_truncation_marker(a)));
        let root = MAX_FRAMES / ROOT_SHARE;
        let leaf = MAX_FRAMES - root - 1;
        assert_eq!(cut.len(), MAX_FRAMES);
        assert_eq!(&cut[..leaf], &whole[..leaf], "the leaf end");
        assert_eq!(cut[leaf], truncation_marker(whole.len() - (MAX_FRAMES - 1)));
        assert_eq!(
            &cut[leaf + 1..],
            &whole[whole.len() - root..],
            "the root end"
        );
        assert_eq!(split, cut, "a split buffer holds the same stack");
        assert_eq!(short.len(), 12);
        assert_eq!(&short[..11], &whole[..11]);
        assert!(is_truncation_marker(short[11]));
    }
}
