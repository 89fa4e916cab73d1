//! The CPU-time engines' signal side: the signal they use and its handler, and the pool of
//! capture slots the handler fills (async-signal-safe: no allocation, no lock). What raises the
//! signal is the engine's (`engine.rs`).

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering};

use super::clock::{monotonic_ns, stamp, stamps_are_wall_clock};
use crate::labels;
use crate::tls;
use crate::unwind::{self, MAX_FRAMES};

/// Marks our timers' payload: MAGIC (16 bits) | epoch (8) | generation (16) | thread index (24).
pub(super) const MAGIC: u64 = 0xf3f2;
pub(super) const FREE: u32 = 0;
/// A handler is writing the slot.
pub(super) const CAPTURING: u32 = 1;
/// Published by a handler, waiting for the sampler.
pub(super) const DONE: u32 = 2;
/// Capture slots per chunk of the shared pool, and most chunks: a handler finds a free slot
/// among the published ones; the sampler adds a chunk when more than a quarter were waiting.
pub(super) const CHUNK: usize = 256;
pub(super) const CHUNKS: usize = 16;
/// Slots a handler tries before it gives up (the pool is full: the capture is lost, counted).
pub(super) const CLAIM_TRIES: usize = 64;
pub(super) struct Slot {
    pub(super) state: AtomicU32,
    /// The timer's payload (which thread, which profiler).
    pub(super) payload: AtomicU64,
    /// Timer periods this capture stands for: 1 + the timer's overruns.
    pub(super) weight: AtomicU32,
    pub(super) len: AtomicU32,
    /// The whole handler's run time, in [`stamp`] units.
    pub(super) handler_stamps: AtomicU64,
    /// When the handler finished (orders a thread's captures): a [`stamp`] when `stamp_wall`,
    /// else the monotonic clock.
    pub(super) wall_at: AtomicU64,
    /// Whether stamps are good wall-clock readings here ([`stamps_are_wall_clock`]), copied into
    /// the slot the handler touches anyway.
    pub(super) stamp_wall: bool,
    /// The thread's label context when it was caught (see `crate::labels`).
    pub(super) labels: [AtomicU64; labels::WORDS],
    /// The first frames of the capture.
    pub(super) frames: Box<UnsafeCell<[u64; SLOT_HEAD]>>,
    /// The rest of a deep one: `MAX_FRAMES - SLOT_HEAD` words of its chunk's tail mapping (null
    /// when that could not be mapped: stacks are then cut at `SLOT_HEAD`).
    pub(super) tail: *mut u64,
}

/// Frames a slot keeps in its own dense buffer (as many as a slot held before stacks could
/// go deeper): most stacks fit, and slots stay a quarter of a page apart. A deeper capture goes
/// on in the slot's share of its chunk's tail mapping, whose pages are backed only once
/// written: the 8 KiB of a full-depth slot cost memory only where deep stacks were captured.
pub(super) const SLOT_HEAD: usize = 128;
pub(super) const SLOT_TAIL: usize = MAX_FRAMES - SLOT_HEAD;

impl Slot {
    pub(super) fn new(tail: *mut u64) -> Slot {
        Slot {
            state: AtomicU32::new(FREE),
            payload: AtomicU64::new(0),
            weight: AtomicU32::new(0),
            len: AtomicU32::new(0),
            handler_stamps: AtomicU64::new(0),
            wall_at: AtomicU64::new(0),
            stamp_wall: stamps_are_wall_clock(),
            labels: Default::default(),
            frames: Box::new(UnsafeCell::new([0; SLOT_HEAD])),
            tail,
        }
    }

    /// The slot's frame buffer.
    ///
    /// # Safety
    /// The caller owns the frames: the handler that claimed the slot (FREE -> CAPTURING) until
    /// it publishes DONE, or the sampler after it observed DONE, until it frees the slot.
    #[allow(clippy::mut_from_ref)]
    pub(super) unsafe fn buf(&self) -> unwind::FrameBuf<'_> {
        // SAFETY: per the contract, nobody else uses the head or the tail meanwhile; the tail
        // is this slot's own `SLOT_TAIL` words of a mapping never unmapped.
        unsafe {
            let tail: &mut [u64] = if self.tail.is_null() {
                &mut []
            } else {
                std::slice::from_raw_parts_mut(self.tail, SLOT_TAIL)
            };
            unwind::FrameBuf::new(&mut *self.frames.get(), tail)
        }
    }
}

// SAFETY: `frames` and `tail` are written only by the handler that moved the slot FREE ->
// CAPTURING and read only by the sampler after it observed DONE (release/acquire on `state`).
unsafe impl Sync for Slot {}

pub(super) struct Chunk {
    pub(super) slots: [Slot; CHUNK],
}

/// The capture pool, shared by every thread's timer; chunks are published once and never freed
/// (a late signal may still write into one after its profiler stopped).
pub(super) static POOL: [AtomicPtr<Chunk>; CHUNKS] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; CHUNKS];
/// Slots published (a multiple of CHUNK).
pub(super) static POOL_LEN: AtomicUsize = AtomicUsize::new(0);
/// Where the next handler starts looking for a free slot.
pub(super) static POOL_CURSOR: AtomicUsize = AtomicUsize::new(0);
/// Captures lost because the pool was full.
pub(super) static LOST: AtomicU64 = AtomicU64::new(0);
/// Tells one profiler's timers from the next one's (a signal may arrive after its timer died).
pub(super) static EPOCH: AtomicU32 = AtomicU32::new(0);

/// Previous dispositions of the signals we took over: (handler, flags), for chaining.
pub(super) static PREV_HANDLER: [AtomicUsize; 65] = [const { AtomicUsize::new(0) }; 65];
pub(super) static PREV_FLAGS: [AtomicUsize; 65] = [const { AtomicUsize::new(0) }; 65];

/// `si_code` of a signal a file descriptor's owner gets for input (`F_SETSIG`): perf events.
const POLL_IN: i32 = 1;

/// The kernel's siginfo layout for `SI_TIMER` signals (64-bit Linux); for `POLL_IN` ones,
/// `si_band` overlays `timer_id` and `overrun`, and `si_fd` the low half of `value`.
#[repr(C)]
pub(super) struct KSigInfo {
    pub(super) signo: i32,
    pub(super) errno: i32,
    pub(super) code: i32,
    pub(super) _pad0: i32,
    pub(super) timer_id: i32,
    pub(super) overrun: i32,
    pub(super) value: u64,
    pub(super) _rest: [u8; 128 - 32],
}

/// Captures lost because every slot of the pool was taken (the sampler was late).
pub(crate) fn lost_captures() -> u64 {
    LOST.load(Ordering::Relaxed)
}

/// Whether `sig` may be used for sampling.
pub(crate) fn valid_signal(sig: i32) -> bool {
    sig == libc::SIGPROF || (libc::SIGRTMIN()..=libc::SIGRTMAX()).contains(&sig)
}

/// A real-time signal nobody handles (default disposition), from the top of the range down:
/// libraries that take one usually count up from `SIGRTMIN`. None when all are taken.
pub(crate) fn pick_signal() -> Option<i32> {
    (libc::SIGRTMIN()..=libc::SIGRTMAX()).rev().find(|&sig| {
        // SAFETY: sigaction only reads the disposition into a zeroed struct we own.
        unsafe {
            let mut old: libc::sigaction = std::mem::zeroed();
            libc::sigaction(sig, std::ptr::null(), &mut old) == 0
                && (old.sa_sigaction == libc::SIG_DFL
                    || old.sa_sigaction == on_signal as *const () as usize)
        }
    })
}

/// Whether our handler is still the one installed for `sig`.
pub(super) fn handler_in_place(sig: i32) -> bool {
    // SAFETY: as in `pick_signal`.
    unsafe {
        let mut cur: libc::sigaction = std::mem::zeroed();
        libc::sigaction(sig, std::ptr::null(), &mut cur) == 0
            && cur.sa_sigaction == on_signal as *const () as usize
    }
}

/// Installs the handler for `sig` (idempotent). Never uninstalled: a late signal finds it.
pub(crate) fn install_handler(sig: i32) -> std::io::Result<()> {
    // SAFETY: plain sigaction calls on zero-initialized structs we own.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(sig, std::ptr::null(), &mut old) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if old.sa_sigaction == on_signal as *const () as usize {
            return Ok(());
        }
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_signal as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
        libc::sigemptyset(&mut sa.sa_mask);
        if libc::sigaction(sig, &sa, &mut old) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if let Some(i) = usize::try_from(sig).ok().filter(|&i| i < 65) {
            PREV_HANDLER[i].store(old.sa_sigaction, Ordering::SeqCst);
            PREV_FLAGS[i].store(old.sa_flags as usize, Ordering::SeqCst);
        }
    }
    Ok(())
}

/// In a forked child: timers are not inherited, and no handler of the parent's threads can
/// still be writing a slot: the whole pool is free again.
pub(crate) fn after_fork_in_child() {
    super::perf::after_fork_in_child();
    for c in POOL.iter() {
        let p = c.load(Ordering::Acquire);
        if !p.is_null() {
            // SAFETY: published chunks are never freed.
            for s in unsafe { &(*p).slots } {
                s.state.store(FREE, Ordering::Release);
            }
        }
    }
}

pub(super) extern "C" fn on_signal(
    sig: libc::c_int,
    info: *mut libc::siginfo_t,
    ctx: *mut libc::c_void,
) {
    // SAFETY: errno is thread-local; the handler must leave it as it found it.
    let errno = unsafe { *libc::__errno_location() };
    // SAFETY: the kernel passes valid info and context to an SA_SIGINFO handler.
    let ours = unsafe { handle(info, ctx) };
    if !ours {
        // SAFETY: same arguments as we received.
        unsafe { chain(sig, info, ctx) };
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

/// Captures the stack into a free slot of the pool. Returns false when the signal is not one
/// of our timers'.
///
/// The walk runs on a spare stack of the unwinder's pool ([`unwind::Spare`]): the thread's own
/// stack holds the kernel's signal frame, this function's frame and the switch, a few hundred
/// bytes. A thread with less room than that left loses the sample, counted, and so does one
/// whose walk would run in place (every spare stack taken) without room for it; the empty
/// stack it publishes records nothing. A thread newer than the unwinder's snapshot has no
/// known bounds: the kernel is asked whether the room below `sp` is readable.
///
/// # Safety
/// Called from `on_signal` with the kernel's arguments.
pub(super) unsafe fn handle(info: *mut libc::siginfo_t, ctx: *mut libc::c_void) -> bool {
    if info.is_null() || ctx.is_null() {
        return false;
    }
    // SAFETY: siginfo_t is 128 bytes on 64-bit Linux, matching KSigInfo.
    let ki = unsafe { &*(info as *const KSigInfo) };
    // A timer's signal carries the token and its overrun count; a perf event's (`POLL_IN`)
    // its descriptor (`si_fd`, the low half of the same word), whose token the engine keeps.
    let (token, weight) = match ki.code {
        libc::SI_TIMER => (ki.value, 1 + ki.overrun.max(0) as u32),
        POLL_IN => match super::perf::token_of(ki.value as u32 as i32) {
            Some(t) => (t, 1),
            None => return false,
        },
        _ => return false,
    };
    if token >> 48 != MAGIC {
        return false;
    }
    let t0 = stamp();
    // The room left is checked before anything else runs on the thread's stack.
    let bounds = tls::known_stack_bounds();
    let sp = unwind::current_sp();
    let room =
        unwind::headroom(sp, bounds).or_else(|| unwind::probe_room(sp, unwind::HANDLER_STACK_NEED));
    // Each thread starts looking at a home slot of its own: its previous capture is likely
    // still there, warm in the cache and a hint for the walk (see `capture`).
    let home = ((token & 0xff_ffff) as usize).wrapping_mul(2);
    let Some(slot) = claim_slot(home) else {
        return true;
    };
    // SAFETY: ctx is this handler's ucontext.
    let regs = unsafe { unwind::regs_from_ucontext(ctx) };
    let n = match room {
        None => {
            unwind::count_skipped_unknown_stack();
            0
        }
        Some(room) => {
            let spare = if room >= unwind::HANDLER_STACK_NEED {
                unwind::Spare::borrow()
            } else {
                None
            };
            match spare {
                // SAFETY (both): the slot is ours (claimed FREE -> CAPTURING).
                Some(mut spare) => spare
                    .run(|s| unsafe { capture(slot, regs, bounds, Some(s)) })
                    .unwrap_or(0),
                None if room >= unwind::IN_PLACE_STACK_NEED => unsafe {
                    capture(slot, regs, bounds, None)
                },
                None => {
                    unwind::count_skipped_low_stack();
                    0
                }
            }
        }
    };
    slot.len.store(n as u32, Ordering::Relaxed);
    // A forked child's timer: its profiler threads start here when that is safe, else at its
    // next allocation (see `child_trigger`).
    let child = token & 0xff_ffff == super::child_trigger::CHILD_IDX;
    // SAFETY: the slot is still ours (not yet published).
    let restart = child && super::child_trigger::can_restart_here(unsafe { &slot.buf() }, n, room);
    // The thread's own slot: the code it interrupted writes only the copy not in use.
    let ctx = labels::own_ctx();
    for (w, &v) in slot.labels.iter().zip(&ctx.words) {
        w.store(v, Ordering::Relaxed);
    }
    slot.payload.store(token, Ordering::Relaxed);
    slot.weight.store(weight, Ordering::Relaxed);
    let end = stamp();
    slot.handler_stamps
        .store(end.wrapping_sub(t0), Ordering::Relaxed);
    let wall = if slot.stamp_wall { end } else { monotonic_ns() };
    slot.wall_at.store(wall, Ordering::Relaxed);
    slot.state.store(DONE, Ordering::Release);
    if restart {
        super::child_trigger::restart_here();
    } else if child {
        tls::take_slow_path_next();
    }
    true
}

/// Unwinds the interrupted context into the slot's frames; the number written.
///
/// # Safety
/// The slot must have been claimed (FREE -> CAPTURING) by this handler: only it writes the
/// frames until it publishes DONE.
#[inline(never)]
pub(super) unsafe fn capture(
    slot: &Slot,
    regs: unwind::StartRegs,
    bounds: Option<(usize, usize)>,
    spare: Option<&mut unwind::Spare>,
) -> usize {
    // SAFETY: see the contract above.
    let mut frames = unsafe { slot.buf() };
    // The slot still holds the stack it captured last time, most often this thread's (its home
    // slot): the walk prefetches those frames' rules.
    let stale = slot.len.load(Ordering::Relaxed) as usize;
    unwind::unwind_into(spare, regs, bounds, 0, &mut frames, stale)
}

/// Claims a free slot of the pool, trying from `home` on, then from a moving cursor
/// (async-signal-safe: atomics only); None when the tries find none (counted).
pub(super) fn claim_slot(home: usize) -> Option<&'static Slot> {
    let len = POOL_LEN.load(Ordering::Acquire);
    if len == 0 {
        LOST.fetch_add(1, Ordering::Relaxed);
        return None;
    }
    for i in 0..2 {
        let k = home.wrapping_add(i) % len;
        if let Some(s) = pool_slot(k) {
            if s.state
                .compare_exchange(FREE, CAPTURING, Ordering::Acquire, Ordering::Relaxed)
                .is_ok()
            {
                return Some(s);
            }
        }
    }
    let start = POOL_CURSOR.fetch_add(1, Ordering::Relaxed);
    for i in 0..len.min(CLAIM_TRIES) {
        let k = (start + i) % len;
        let chunk = POOL[k / CHUNK].load(Ordering::Acquire);
        if chunk.is_null() {
            continue;
        }
        // SAFETY: published chunks are never freed.
        let s = unsafe { &(*chunk).slots[k % CHUNK] };
        if s.state
            .compare_exchange(FREE, CAPTURING, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            return Some(s);
        }
    }
    LOST.fetch_add(1, Ordering::Relaxed);
    None
}

/// Publishes one more chunk of the pool (up to CHUNKS). Sampler only.
pub(super) fn add_chunk() {
    let len = POOL_LEN.load(Ordering::Acquire);
    let i = len / CHUNK;
    if i >= CHUNKS {
        return;
    }
    if POOL[i].load(Ordering::Acquire).is_null() {
        let tails = map_tails();
        let chunk = Box::new(Chunk {
            slots: std::array::from_fn(|k| {
                Slot::new(match tails.is_null() {
                    true => tails,
                    // SAFETY: within the mapping of CHUNK * SLOT_TAIL words.
                    false => unsafe { tails.add(k * SLOT_TAIL) },
                })
            }),
        });
        POOL[i].store(Box::into_raw(chunk), Ordering::Release);
    }
    POOL_LEN.store(len + CHUNK, Ordering::Release);
}

/// The tails of a chunk's slots: an anonymous mapping, backed page by page as deep captures
/// write it, never unmapped (a late signal may still write into its chunk). Null on failure.
pub(super) fn map_tails() -> *mut u64 {
    // SAFETY: a fresh anonymous private mapping; nothing else refers to it.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            CHUNK * SLOT_TAIL * 8,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        std::ptr::null_mut()
    } else {
        p as *mut u64
    }
}

pub(super) fn pool_slot(k: usize) -> Option<&'static Slot> {
    let chunk = POOL.get(k / CHUNK)?.load(Ordering::Acquire);
    // SAFETY: published chunks are never freed.
    (!chunk.is_null()).then(|| unsafe { &(*chunk).slots[k % CHUNK] })
}

/// Passes a foreign signal to the handler that was installed before ours.
///
/// # Safety
/// Called from `on_signal` with its arguments.
pub(super) unsafe fn chain(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let Some(i) = usize::try_from(sig).ok().filter(|&i| i < 65) else {
        return;
    };
    let h = PREV_HANDLER[i].load(Ordering::Relaxed);
    if h == libc::SIG_DFL || h == libc::SIG_IGN || h == on_signal as *const () as usize {
        // The sampling signal's default action would kill the process: a stray one is dropped.
        return;
    }
    let flags = PREV_FLAGS[i].load(Ordering::Relaxed) as libc::c_int;
    // SAFETY: `h` is the handler the program installed, called with the signature its flags say.
    unsafe {
        if flags & libc::SA_SIGINFO != 0 {
            let f: extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) =
                std::mem::transmute(h);
            f(sig, info, ctx);
        } else {
            let f: extern "C" fn(libc::c_int) = std::mem::transmute(h);
            f(sig);
        }
    }
}
