//! CPU and wall-time sampling of every thread of the process.
//!
//! A sampler thread wakes `cpu_hz` times a second (absolute deadlines on the monotonic clock, so
//! ticks do not drift) and visits every thread listed in `/proc/self/task`:
//!
//! * It reads the thread's CPU clock (`clock_gettime` on the thread's clock id). If the thread
//!   has not run since its last sample and its stack is already known, the stack cannot have
//!   changed: the tick becomes a wall-time sample on that stack without disturbing the thread.
//!   This is how idle threads get wall samples without being interrupted again and again.
//! * Otherwise it queues a signal to that one thread (`rt_tgsigqueueinfo`) carrying the index
//!   and sequence number of a preallocated *slot*. The thread's handler (async-signal-safe: no
//!   allocation, no lock, no lazy TLS) unwinds its own stack into the slot and publishes it with
//!   a release store. The sampler collects finished slots at its next tick and records them
//!   (cpu-time = thread CPU clock delta, wall-time = wall delta, cpu-samples = ticks covered,
//!   labels `thread id` and `thread name`).
//! * A request still unanswered at the next tick means the thread has not returned to user mode
//!   since (it was not scheduled, or sat in one system call): its user stack is still the one it
//!   will report, so the tick is merged into the pending request instead of being lost. Ticks are
//!   therefore never dropped by scheduling delays, unlike `setitimer(ITIMER_PROF)`, whose signals
//!   coalesce per process and are capped by the kernel tick rate.
//! * A thread seen busy (it used at least 3/4 of a CPU since the previous visit) also gets a
//!   POSIX CPU-time timer on its own clock (`timer_create`, `SIGEV_THREAD_ID`): every period of
//!   its CPU time the kernel queues the signal to the thread at its own scheduler tick, and the
//!   handler captures the stack into that thread's *ring* of slots. The sampler need not
//!   signal busy threads (a signal to a thread running on another CPU costs an
//!   inter-processor interrupt, the most expensive part of a sample in a VM): at each visit it
//!   records the ring's captures in order, each with the CPU time up to it; for a busy thread
//!   also the wall time and the ticks since its last sample, spread over them. A thread that
//!   was only partly busy also spent time waiting, which belongs to where it waited: its
//!   captures carry CPU time only and its ticks go the ways above.
//! * When a tick signalled nobody and left no request pending (all threads idle or covered by
//!   their timers), the sampler sleeps over the next `SLOW_TICKS - 1` ticks; the next visit
//!   covers them (idle threads add them up, busy ones spread them over their captures). Each
//!   ring holds more captures than a thread can make meanwhile.
//!
//! CPU timers are checked at the kernel's scheduler tick (`CONFIG_HZ`, often 250 Hz): above that
//! rate a busy thread's stack is captured at the kernel's rate and each capture covers more than
//! one tick (no tick is lost).
//!
//! The handler is installed with `SA_RESTART`: interrupted system calls that the kernel can
//! restart are restarted. Calls that always fail with `EINTR` when a handler runs (`epoll_wait`,
//! `poll`, `nanosleep`...) can see it, as with every signal-based profiler; idle threads are
//! signalled only when they ran since their last sample, which keeps this rare. Signals not sent
//! by this sampler (other `SIGPROF` users) are passed on to the handler installed before ours.

use std::cell::UnsafeCell;
use std::collections::HashMap;
use std::sync::atomic::{
    AtomicBool, AtomicI32, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering,
};
use std::sync::Arc;
use std::time::Duration;

use ferroprof_recorder::{Frame, Label, SampleValues};

use crate::state::{Shared, TapKind, THREAD_ID_LABEL, THREAD_NAME_LABEL};
use crate::tls;
use crate::unwind::{self, MAX_FRAMES};

/// Most requests in flight at once (one per thread being sampled).
const MAX_SLOTS: usize = 4096;
/// Marks our signals' payload: (MAGIC << 48) | (seq << 16) | slot index.
const MAGIC: u64 = 0xf3f0;
/// A request unanswered for this long is abandoned (the thread blocks the signal).
const ABANDON_AFTER: Duration = Duration::from_secs(1);
/// CPU time a thread may use after its handler read its clock (the rest of the handler and the
/// return from the signal) and still count as "has not run since": its stack is unchanged.
const IDLE_SLACK_NS: u64 = 50_000;

const IDLE: u32 = 0;
const REQUESTED: u32 = 1;
const DONE: u32 = 2;
/// A thread's CPU-timer slot, waiting for the timer's next signal.
const ARMED: u32 = 3;
/// A timer signal's handler is writing the slot (claimed from ARMED, so that the sampler can
/// retire an ARMED slot with a compare-and-swap and know no handler is inside).
const CAPTURING: u32 = 4;
/// Marks the payload of the threads' CPU-timer signals: (TIMER_MAGIC << 48) | (seq << 16) | idx.
const TIMER_MAGIC: u64 = 0xf3f1;
/// How many ticks the sampler sleeps over when every thread is either idle or busy under its
/// CPU timer (nothing to signal): their ticks are accounted at the next wake-up, and the timers'
/// captures wait in their rings meanwhile.
const SLOW_TICKS: u64 = 5;
/// Captures a CPU timer's ring holds between two visits of the sampler: a thread runs at most
/// one timer period per tick, so this covers SLOW_TICKS and a late wake-up.
const RING: usize = 8;
/// Most CPU timers at once (threads that were seen busy); the rest are signalled.
const MAX_RINGS: usize = 512;
/// Ticks a busy thread may wait for its CPU timer's next capture before it is signalled.
const MAX_TIMER_WAIT: i64 = SLOW_TICKS as i64 + 3;
/// Share of the wall time since its last visit (in 1/4) a thread must have run to count as busy
/// (its timer then fires at least every 4/3 ticks).
const BUSY_QUARTERS: u64 = 3;

struct Slot {
    state: AtomicU32,
    seq: AtomicU32,
    len: AtomicU32,
    /// The whole handler's run time, from the payload check to the last store, in [`stamp`]
    /// units.
    handler_stamps: AtomicU64,
    /// When the handler finished (orders a ring's captures, and gives their wall time): a
    /// [`stamp`] when `stamp_wall`, else the monotonic clock. The thread's CPU clock is not
    /// read here: on Linux that is a system call, the most expensive thing a handler would do;
    /// the sampler reads it instead.
    wall_at: AtomicU64,
    /// Whether stamps are good wall-clock readings here (the kernel's clock source is the
    /// TSC, so it is constant-rate and synchronized across CPUs): [`stamps_are_wall_clock`],
    /// copied into the slot the handler touches anyway rather than read from a static, which
    /// would be one more cold cache line.
    stamp_wall: bool,
    /// Out of line, so a ring's slot headers (whose states a handler tries in turn) share a
    /// few cache lines instead of lying a kilobyte apart.
    frames: Box<UnsafeCell<[u64; MAX_FRAMES]>>,
}

impl Slot {
    fn new() -> Slot {
        Slot {
            state: AtomicU32::new(IDLE),
            seq: AtomicU32::new(0),
            len: AtomicU32::new(0),
            handler_stamps: AtomicU64::new(0),
            wall_at: AtomicU64::new(0),
            stamp_wall: stamps_are_wall_clock(),
            frames: Box::new(UnsafeCell::new([0; MAX_FRAMES])),
        }
    }
}

// SAFETY: `frames` is written only by the handler that owns a REQUESTED slot (or claimed an
// ARMED one) and read only by the sampler after observing DONE (release/acquire on `state`).
unsafe impl Sync for Slot {}

static SLOTS: [AtomicPtr<Slot>; MAX_SLOTS] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; MAX_SLOTS];

/// The capture slots of one thread's CPU timer. The handler takes the first ARMED one; the
/// sampler collects the DONE ones at its next visit, in capture order, and arms them again.
struct Ring {
    /// Must match the timer signal's payload (bumped when the ring is retired).
    seq: AtomicU32,
    slots: [Slot; RING],
}

static RINGS: [AtomicPtr<Ring>; MAX_RINGS] =
    [const { AtomicPtr::new(std::ptr::null_mut()) }; MAX_RINGS];
/// Timer signals that found their ring full (the sampler was late): their CPU time is
/// attributed to the ring's other captures.
static RING_FULL: AtomicU64 = AtomicU64::new(0);
static PID: AtomicI32 = AtomicI32::new(0);
/// Our user id, for the siginfo we queue; read once (a getuid per signal was a syscall per
/// request; the handler never looks at it).
static UID: AtomicU32 = AtomicU32::new(0);

/// Previous dispositions of the signals we took over: (handler, flags), for chaining.
static PREV_HANDLER: [AtomicUsize; 65] = [const { AtomicUsize::new(0) }; 65];
static PREV_FLAGS: [AtomicUsize; 65] = [const { AtomicUsize::new(0) }; 65];

/// The kernel's siginfo layout for `SI_QUEUE` signals (64-bit Linux).
#[repr(C)]
struct KSigInfo {
    signo: i32,
    errno: i32,
    code: i32,
    _pad0: i32,
    pid: i32,
    uid: u32,
    value: u64,
    _rest: [u8; 128 - 32],
}

/// Timer captures dropped for a full ring, in this process so far.
/// Set by the sampler when threads exited since the last export.
static THREADS_EXITED: AtomicBool = AtomicBool::new(false);
/// Whether threads exited in the interval before the last export.
static EXITED_BEFORE: AtomicBool = AtomicBool::new(false);

/// Under thread churn, gives the memory the C allocator keeps free back to the system, once per
/// export, right after it (on the export thread). An export allocates and frees tens of
/// megabytes (symbolization, encoding); with steady threads the next export reuses that memory,
/// but short threads, each with its own allocations, arena and rows in the profile (its id and
/// name are labels), scatter what stays in use among it, so it stays resident and grows
/// (measured with 20,000 threads: +8 to +20 MB of RSS over the unprofiled run, the memory in
/// use flat; with `malloc_trim` after each export, +0.1 to +2 MB whatever the count). A process
/// whose threads live on is never trimmed. The export after the last exits trims too: its own
/// garbage lands among what the exited threads left (two exports in a row, e.g. a flush right
/// after a periodic one, left 8 MB behind otherwise).
pub(crate) fn trim_after_export() {
    let recent = THREADS_EXITED.swap(false, Ordering::Relaxed);
    let before = EXITED_BEFORE.swap(recent, Ordering::Relaxed);
    if recent || before {
        #[cfg(target_env = "gnu")]
        // SAFETY: malloc_trim has no preconditions; it takes the allocator's own locks.
        unsafe {
            libc::malloc_trim(0);
        }
    }
}

pub(crate) fn ring_full_count() -> u64 {
    RING_FULL.load(Ordering::Relaxed)
}

/// Whether `sig` may be used for sampling.
pub(crate) fn valid_signal(sig: i32) -> bool {
    sig == libc::SIGPROF || (libc::SIGRTMIN()..=libc::SIGRTMAX()).contains(&sig)
}

/// Installs the handler for `sig` (idempotent). Never uninstalled: a late signal finds it.
pub(crate) fn install_handler(sig: i32) -> std::io::Result<()> {
    // SAFETY: getpid and getuid have no preconditions.
    PID.store(unsafe { libc::getpid() }, Ordering::SeqCst);
    // SAFETY: as above.
    UID.store(unsafe { libc::getuid() }, Ordering::SeqCst);
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

/// In a forked child: the process id changed, and requests in flight were addressed to threads
/// of the parent; the slots are free again (no other thread exists to answer them).
pub(crate) fn after_fork_in_child() {
    // SAFETY: getpid has no preconditions.
    PID.store(unsafe { libc::getpid() }, Ordering::SeqCst);
    for s in SLOTS.iter() {
        let p = s.load(Ordering::Acquire);
        if !p.is_null() {
            // SAFETY: published slots are never freed.
            let slot = unsafe { &*p };
            slot.seq.fetch_add(1, Ordering::AcqRel);
            slot.state.store(IDLE, Ordering::Release);
        }
    }
    // Timers are not inherited by a child: its threads' rings are free.
    for r in RINGS.iter() {
        let p = r.load(Ordering::Acquire);
        if !p.is_null() {
            // SAFETY: published rings are never freed.
            let ring = unsafe { &*p };
            ring.seq.fetch_add(1, Ordering::AcqRel);
            for slot in &ring.slots {
                slot.state.store(IDLE, Ordering::Release);
            }
        }
    }
}

extern "C" fn on_signal(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
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

/// Captures the stack into the slot named by the signal's payload. Returns false when the
/// signal is not one of ours.
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
unsafe fn handle(info: *mut libc::siginfo_t, ctx: *mut libc::c_void) -> bool {
    if info.is_null() || ctx.is_null() {
        return false;
    }
    // SAFETY: siginfo_t is 128 bytes on 64-bit Linux, matching KSigInfo.
    let ki = unsafe { &*(info as *const KSigInfo) };
    // A request queued by the sampler names our process as sender; a CPU-timer signal carries
    // the timer id there instead (both keep the payload at the same offset).
    let timer = match (ki.code, ki.value >> 48) {
        (libc::SI_QUEUE, MAGIC) if ki.pid == PID.load(Ordering::Relaxed) => false,
        (libc::SI_TIMER, TIMER_MAGIC) => true,
        _ => return false,
    };
    let t0 = stamp();
    let idx = (ki.value & 0xffff) as usize;
    let seq = (ki.value >> 16) as u32;
    let slot = if timer {
        // SAFETY: as below, for rings.
        match unsafe { claim_ring_slot(idx, seq) } {
            Some(slot) => slot,
            None => return true,
        }
    } else {
        let Some(slot) = SLOTS.get(idx).map(|s| s.load(Ordering::Acquire)) else {
            return true;
        };
        if slot.is_null() {
            return true;
        }
        // SAFETY: slots are never freed once published.
        let slot = unsafe { &*slot };
        if slot.seq.load(Ordering::Acquire) != seq
            || slot.state.load(Ordering::Acquire) != REQUESTED
        {
            return true; // a stale request
        }
        slot
    };
    // SAFETY: ctx is this handler's ucontext.
    let regs = unsafe { unwind::regs_from_ucontext(ctx) };
    let bounds = tls::known_stack_bounds();
    let sp = unwind::current_sp();
    let room =
        unwind::headroom(sp, bounds).or_else(|| unwind::probe_room(sp, unwind::HANDLER_STACK_NEED));
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
                // SAFETY (both): the slot is ours (see `capture`).
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
    let end = stamp();
    slot.handler_stamps
        .store(end.wrapping_sub(t0), Ordering::Relaxed);
    let wall = if slot.stamp_wall { end } else { monotonic_ns() };
    slot.wall_at.store(wall, Ordering::Relaxed);
    slot.state.store(DONE, Ordering::Release);
    true
}

/// Unwinds the interrupted context into the slot's frames; the number written.
///
/// # Safety
/// The slot must be REQUESTED for the request being handled, or claimed from ARMED by this
/// handler: only this handler writes its frames until it publishes DONE.
#[inline(never)]
unsafe fn capture(
    slot: &Slot,
    regs: unwind::StartRegs,
    bounds: Option<(usize, usize)>,
    spare: Option<&mut unwind::Spare>,
) -> usize {
    // SAFETY: see the contract above.
    let frames = unsafe { &mut *slot.frames.get() };
    // The slot still holds the stack it captured last time (a ring's slots are reused).
    let stale = slot.len.load(Ordering::Relaxed) as usize;
    match spare {
        Some(s) => unwind::unwind_with(s, regs, bounds, 0, frames, stale),
        None => unwind::unwind(regs, bounds, 0, frames, stale),
    }
}

/// Claims the first ARMED slot of ring `idx` for a timer signal with payload sequence `seq`;
/// None for a retired timer or a full ring.
///
/// # Safety
/// Async-signal-safe; called from the handler.
unsafe fn claim_ring_slot(idx: usize, seq: u32) -> Option<&'static Slot> {
    let ring = RINGS.get(idx)?.load(Ordering::Acquire);
    if ring.is_null() {
        return None;
    }
    // SAFETY: rings are never freed once published.
    let ring = unsafe { &*ring };
    if ring.seq.load(Ordering::Acquire) != seq {
        return None;
    }
    // The CAS leaves CAPTURING: the sampler retires only ARMED slots, so it knows no handler is
    // inside the ones it takes back.
    let slot = ring.slots.iter().find(|s| {
        s.state
            .compare_exchange(ARMED, CAPTURING, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    });
    if slot.is_none() {
        RING_FULL.fetch_add(1, Ordering::Relaxed);
    }
    slot
}

/// Passes a foreign signal to the handler that was installed before ours.
///
/// # Safety
/// Called from `on_signal` with its arguments.
unsafe fn chain(sig: libc::c_int, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    let Some(i) = usize::try_from(sig).ok().filter(|&i| i < 65) else {
        return;
    };
    let h = PREV_HANDLER[i].load(Ordering::Relaxed);
    if h == libc::SIG_DFL || h == libc::SIG_IGN || h == on_signal as *const () as usize {
        // The default action of SIGPROF would kill the process: a stray signal is dropped.
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

/// The sampling period: one tick of the sampler, one period of a thread's CPU timer.
fn period_ns(settings: &crate::settings::Settings) -> u64 {
    1_000_000_000 / settings.cpu_hz.max(1) as u64
}

fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC).unwrap_or(0)
}

/// A handler's time stamp. On x86_64 the TSC: one instruction and no memory access, where the
/// vDSO's clock read cost a handler ~0.8 µs of cold page-table and cache misses on the first
/// call. The sampler converts stamps with a scale it measures against the monotonic clock
/// ([`StampClock`]). Elsewhere the monotonic clock itself.
#[inline(always)]
fn stamp() -> u64 {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: rdtsc only reads the time-stamp counter, present on every x86_64 CPU.
    let t = unsafe { std::arch::x86_64::_rdtsc() };
    #[cfg(not(target_arch = "x86_64"))]
    let t = monotonic_ns();
    t
}

/// Whether [`stamp`]s can stand for wall-clock time: the kernel's clock source is the TSC (it
/// found it constant-rate and synchronized across CPUs), or stamps are the monotonic clock.
/// Read once, outside handlers.
fn stamps_are_wall_clock() -> bool {
    // An atomic, not a `OnceLock`: a fork while the sampler is inside `get_or_init` would leave
    // the child's copy "being initialized" forever, and its sampler waiting for it. Two threads
    // reading the file at once get the same answer.
    static ANSWER: AtomicU32 = AtomicU32::new(0);
    const NO: u32 = 1;
    const YES: u32 = 2;
    match ANSWER.load(Ordering::Relaxed) {
        NO => return false,
        YES => return true,
        _ => {}
    }
    let yes = cfg!(not(target_arch = "x86_64"))
        || std::fs::read_to_string(
            "/sys/devices/system/clocksource/clocksource0/current_clocksource",
        )
        .is_ok_and(|s| s.trim() == "tsc");
    ANSWER.store(if yes { YES } else { NO }, Ordering::Relaxed);
    yes
}

/// Converts [`stamp`]s to nanoseconds: the scale is measured between a reading at the
/// sampler's start and the latest one (taken every tick), so it converges to the counter's
/// exact rate.
struct StampClock {
    base: (u64, u64),
    last: (u64, u64),
}

impl StampClock {
    fn new() -> StampClock {
        let now = (stamp(), monotonic_ns());
        StampClock {
            base: now,
            last: now,
        }
    }

    fn update(&mut self) {
        self.last = (stamp(), monotonic_ns());
    }

    /// Nanoseconds per stamp; until 100 µs have passed, a typical 2.5 GHz counter's.
    fn scale(&self) -> f64 {
        if cfg!(not(target_arch = "x86_64")) {
            return 1.0;
        }
        let stamps = self.last.0.wrapping_sub(self.base.0);
        let ns = self.last.1.saturating_sub(self.base.1);
        if ns < 100_000 || stamps == 0 {
            return 0.4;
        }
        ns as f64 / stamps as f64
    }

    fn duration_ns(&self, stamps: u64) -> u64 {
        (stamps as f64 * self.scale()) as u64
    }

    /// The monotonic time of a handler's `wall_at` (which is one already unless stamps are).
    fn wall_ns(&self, slot: &Slot, wall_at: u64) -> u64 {
        if cfg!(not(target_arch = "x86_64")) || !slot.stamp_wall {
            return wall_at;
        }
        let back = self.last.0 as i128 - wall_at as i128;
        let ns = self.last.1 as i128 - (back as f64 * self.scale()) as i128;
        ns.clamp(0, i128::from(u64::MAX)) as u64
    }
}

fn clock_ns(clock: libc::clockid_t) -> Option<u64> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid out-pointer; clock_gettime is async-signal-safe.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return None;
    }
    Some(ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64)
}

/// CPU time consumed by thread `tid` of this process.
pub(crate) fn thread_cpu_ns(tid: i32) -> Option<u64> {
    // The kernel's clock id for another thread's CPU clock: CPUCLOCK_SCHED | PERTHREAD, tid
    // stored inverted above the low three bits.
    let clock = ((!(tid as libc::clockid_t)) << 3) | 6;
    clock_ns(clock)
}

fn send(tid: i32, sig: i32, value: u64) -> bool {
    let pid = PID.load(Ordering::Relaxed);
    let info = KSigInfo {
        signo: sig,
        errno: 0,
        code: libc::SI_QUEUE,
        _pad0: 0,
        pid,
        uid: UID.load(Ordering::Relaxed),
        value,
        _rest: [0; 128 - 32],
    };
    // SAFETY: rt_tgsigqueueinfo reads a 128-byte siginfo from a valid pointer.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_rt_tgsigqueueinfo,
            pid as libc::c_long,
            tid as libc::c_long,
            sig as libc::c_long,
            &info as *const KSigInfo,
        )
    };
    rc == 0
}

/// A thread's CPU-time timer. The kernel checks it at the thread's own scheduler ticks and, each
/// time the thread has used another sampling period of CPU, queues the signal to that thread:
/// the thread captures its stack on its way back to user mode, with no signal sent by the
/// sampler and no interrupt of another CPU to deliver it (what setitimer profilers get, but per
/// thread, so nothing coalesces). The stack goes to the thread's own slot.
struct CpuTimer {
    id: libc::timer_t,
    /// Index of its ring in RINGS.
    ring: usize,
    /// Ticks of the busy thread waiting for the timer's next captures.
    ticks: i64,
}

/// Arms a CPU-time timer on thread `tid` that signals it with `value` every `period_ns` of its
/// CPU time; None when the kernel refuses (no timers left: the sampler signals it instead).
fn create_cpu_timer(tid: i32, sig: i32, value: u64, period_ns: u64) -> Option<libc::timer_t> {
    // SAFETY: sigevent is plain data; every field the kernel reads is set below.
    let mut ev: libc::sigevent = unsafe { std::mem::zeroed() };
    ev.sigev_notify = libc::SIGEV_THREAD_ID;
    ev.sigev_signo = sig;
    ev.sigev_notify_thread_id = tid;
    ev.sigev_value = libc::sigval {
        sival_ptr: value as usize as *mut libc::c_void,
    };
    let mut id: libc::timer_t = std::ptr::null_mut();
    // The thread's CPU clock, as in `thread_cpu_ns`.
    let clock = ((!(tid as libc::clockid_t)) << 3) | 6;
    // SAFETY: valid sigevent and out-pointer; the kernel checks that `tid` is one of ours.
    if unsafe { libc::timer_create(clock, &mut ev, &mut id) } != 0 {
        return None;
    }
    let ts = libc::timespec {
        tv_sec: (period_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (period_ns % 1_000_000_000) as libc::c_long,
    };
    let spec = libc::itimerspec {
        it_interval: ts,
        it_value: ts,
    };
    // SAFETY: `id` was just created; valid itimerspec.
    if unsafe { libc::timer_settime(id, 0, &spec, std::ptr::null_mut()) } != 0 {
        // SAFETY: as above.
        unsafe { libc::timer_delete(id) };
        return None;
    }
    Some(id)
}

/// Lists this process's thread ids with `getdents64` on an open `/proc/self/task`.
struct TaskLister {
    fd: libc::c_int,
    buf: Vec<u8>,
}

impl TaskLister {
    fn open() -> Option<TaskLister> {
        // SAFETY: NUL-terminated path literal.
        let fd = unsafe {
            libc::open(
                c"/proc/self/task".as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        (fd >= 0).then(|| TaskLister {
            fd,
            buf: vec![0u8; 16 * 1024],
        })
    }

    fn list(&mut self, out: &mut Vec<i32>) -> bool {
        out.clear();
        // SAFETY: fd is our open directory.
        if unsafe { libc::lseek(self.fd, 0, libc::SEEK_SET) } < 0 {
            return false;
        }
        loop {
            // SAFETY: the buffer is valid for its length.
            let n = unsafe {
                libc::syscall(
                    libc::SYS_getdents64,
                    self.fd,
                    self.buf.as_mut_ptr(),
                    self.buf.len(),
                )
            };
            if n < 0 {
                return false;
            }
            if n == 0 {
                return true;
            }
            let mut off = 0usize;
            while off + 19 < n as usize {
                // linux_dirent64: u64 ino, i64 off, u16 reclen, u8 type, name...
                let reclen = u16::from_ne_bytes([self.buf[off + 16], self.buf[off + 17]]) as usize;
                if reclen == 0 {
                    break;
                }
                let name = &self.buf[off + 19..(off + reclen).min(n as usize)];
                let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
                if let Some(tid) = std::str::from_utf8(&name[..end])
                    .ok()
                    .and_then(|s| s.parse::<i32>().ok())
                {
                    out.push(tid);
                }
                off += reclen;
            }
        }
    }
}

impl Drop for TaskLister {
    fn drop(&mut self) {
        // SAFETY: we own the fd.
        unsafe { libc::close(self.fd) };
    }
}

/// Thread `tid`'s name (kernel `comm`, at most 15 bytes) into `buf`; empty when unreadable.
/// Opened relative to the sampler's open `/proc/self/task` when there is one: a path walk from
/// the root and a `String` per read were most of the cost of name checks.
fn read_comm(dirfd: Option<libc::c_int>, tid: i32, buf: &mut [u8; 64]) -> &str {
    use std::io::Write;
    let mut path = [0u8; 48];
    let mut w = &mut path[..];
    // Leaves at least one zero byte: the longest, "/proc/self/task/<tid>/comm", is 31 bytes.
    let (base, written) = match dirfd {
        Some(fd) => (fd, write!(w, "{tid}/comm")),
        None => (libc::AT_FDCWD, write!(w, "/proc/self/task/{tid}/comm")),
    };
    if written.is_err() {
        return "";
    }
    // SAFETY: `path` is NUL-terminated (zero-filled beyond what was written); `base` is the
    // open task directory or AT_FDCWD (the path is absolute then).
    let fd = unsafe {
        libc::openat(
            base,
            path.as_ptr() as *const libc::c_char,
            libc::O_RDONLY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return "";
    }
    // SAFETY: the buffer is valid for its length; we own fd and close it once.
    let n = unsafe {
        let n = libc::read(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len());
        libc::close(fd);
        n
    };
    let n = usize::try_from(n).unwrap_or(0);
    let name = buf[..n].strip_suffix(b"\n").unwrap_or(&buf[..n]);
    std::str::from_utf8(name).unwrap_or("")
}

/// Replaces `name` with thread `tid`'s current name; whether it changed.
fn refresh_name(dirfd: Option<libc::c_int>, tid: i32, name: &mut String) -> bool {
    let mut buf = [0u8; 64];
    let fresh = read_comm(dirfd, tid, &mut buf);
    if fresh == name.as_str() {
        return false;
    }
    fresh.clone_into(name);
    true
}

struct Pending {
    idx: usize,
    seq: u32,
    ticks: i64,
    cpu: u64,
    wall: u64,
    sent_at: u64,
}

struct ThreadInfo {
    name: String,
    last_cpu: u64,
    last_wall: u64,
    stack: Vec<u64>,
    has_stack: bool,
    /// CPU clock of the thread right after its last stack capture.
    idle_ref: u64,
    /// Idle ticks not recorded yet, and the thread's CPU and wall clocks at the last of them.
    idle_ticks: i64,
    idle_cpu: u64,
    idle_wall: u64,
    /// A new thread names itself shortly after it starts (Rust does it in the new thread):
    /// its name is re-read on its first visits until it changes.
    name_checks_left: u8,
    pending: Option<Pending>,
    /// A request the thread never answered (it blocks the signal): not signalled again unless
    /// it answers after all.
    abandoned: Option<Pending>,
    /// The thread's CPU timer, when the kernel gave us one.
    timer: Option<CpuTimer>,
    /// Its CPU and wall clocks at the previous visit (to tell a busy thread).
    prev_cpu: u64,
    prev_wall: u64,
    seen: u64,
}

/// State of the sampler thread.
pub(crate) struct Sampler {
    shared: Arc<Shared>,
    signal: i32,
    threads: HashMap<i32, ThreadInfo, foldhash::fast::RandomState>,
    tids: Vec<i32>,
    lister: Option<TaskLister>,
    free_slots: Vec<usize>,
    next_slot: usize,
    tick: u64,
    frames: Vec<Frame<'static>>,
    last_refresh: u64,
    maps_wanted: bool,
    last_names: u64,
    last_list: u64,
    wall_enabled: bool,
    /// The kernel refused a CPU timer once (RLIMIT_SIGPENDING, or no timer support): threads
    /// are then signalled by the sampler only.
    timers_failed: bool,
    free_rings: Vec<usize>,
    next_ring: usize,
    /// This tick signalled a thread or left a request pending: the next one comes on time
    /// rather than SLOW_TICKS later.
    fast: bool,
    stamps: StampClock,
    /// Threads seen exiting since the last [`Sampler::give_back_memory`], and the exports done
    /// by then.
    exited: u64,
}

impl Sampler {
    pub(crate) fn new(shared: Arc<Shared>) -> Sampler {
        let signal = shared.settings.signal;
        let wall_enabled = shared.settings.profiles.wall;
        Sampler {
            shared,
            signal,
            threads: HashMap::default(),
            tids: Vec::new(),
            lister: TaskLister::open(),
            free_slots: Vec::new(),
            next_slot: 0,
            tick: 0,
            frames: Vec::with_capacity(MAX_FRAMES),
            last_refresh: 0,
            maps_wanted: false,
            last_names: 0,
            last_list: 0,
            wall_enabled,
            timers_failed: false,
            free_rings: Vec::new(),
            next_ring: 0,
            fast: true,
            stamps: StampClock::new(),
            exited: 0,
        }
    }

    /// The sampler thread's body.
    pub(crate) fn run(mut self) {
        tls::enter_profiler_thread();
        let period = period_ns(&self.shared.settings);
        // The snapshot was built by `start`; only changes are picked up from here on.
        unwind::refresh(false);
        let mut next = monotonic_ns() + period;
        let mut skip = 0;
        loop {
            sleep_until(next + skip * period);
            if self.shared.stopping.load(Ordering::SeqCst) {
                break;
            }
            let now = monotonic_ns();
            self.stamps.update();
            // Ticks whose time passed while this thread slept over them or waited for a CPU are
            // not skipped: the next observation of each thread covers them.
            let mut ticks = 0;
            while now >= next {
                next += period;
                ticks += 1;
                if ticks > 1000 {
                    // Suspended machine or a stopped process: start afresh.
                    next = now + period;
                    break;
                }
            }
            let ticks = ticks.max(1);
            let stats = &self.shared.stats;
            stats.sampler_ticks.fetch_add(1, Ordering::Relaxed);
            stats
                .sampler_late_ticks
                .fetch_add((ticks as u64).saturating_sub(1 + skip), Ordering::Relaxed);
            self.fast = false;
            self.run_tick(now, ticks.min(1000));
            skip = if self.fast { 0 } else { SLOW_TICKS - 1 };
        }
        self.finish();
    }

    fn alloc_slot(&mut self) -> Option<usize> {
        if let Some(i) = self.free_slots.pop() {
            return Some(i);
        }
        while self.next_slot < MAX_SLOTS {
            let i = self.next_slot;
            self.next_slot += 1;
            if SLOTS[i].load(Ordering::Acquire).is_null() {
                SLOTS[i].store(Box::into_raw(Box::new(Slot::new())), Ordering::Release);
                return Some(i);
            }
            // Left by an earlier profiler in this process: reuse if no handler can write it.
            // SAFETY: published slots are never freed.
            let s = unsafe { &*SLOTS[i].load(Ordering::Acquire) };
            if matches!(s.state.load(Ordering::Acquire), IDLE | DONE) {
                s.state.store(IDLE, Ordering::Release);
                return Some(i);
            }
        }
        None
    }

    fn slot(idx: usize) -> &'static Slot {
        // SAFETY: only indices of published slots are handed around; never freed.
        unsafe { &*SLOTS[idx].load(Ordering::Acquire) }
    }

    pub(crate) fn run_tick(&mut self, now: u64, ticks: i64) {
        // Counts ticks, not wake-ups (a wake-up may cover several): the rates below are in time.
        self.tick += ticks.max(1) as u64;
        let hz = self.shared.settings.cpu_hz.max(1) as u64;
        let mut tids = std::mem::take(&mut self.tids);
        // Threads are listed every ~50 ms (new threads are found within that); in between the
        // known ones are visited, and one whose CPU clock cannot be read any more has exited.
        let list_every = (hz / 20).max(1);
        if self.tick - self.last_list >= list_every || tids.is_empty() {
            self.last_list = self.tick;
            let listed = match self.lister.as_mut() {
                Some(l) => l.list(&mut tids),
                None => false,
            };
            if !listed {
                self.tids = tids;
                return;
            }
        }
        let mut new_threads = false;
        tids.retain(|&tid| {
            if self.shared.is_own_thread(tid) {
                return false;
            }
            if !self.threads.contains_key(&tid) {
                new_threads = true;
            }
            self.visit(tid, now, ticks)
        });
        let tick = self.tick;
        let gone: Vec<i32> = self
            .threads
            .iter()
            .filter(|(_, t)| t.seen != tick && t.idle_ticks > 0)
            .map(|(&tid, _)| tid)
            .collect();
        for tid in gone {
            self.flush_idle(tid);
        }
        let timed_out: Vec<i32> = self
            .threads
            .iter()
            .filter(|(_, t)| t.seen != tick && t.timer.is_some())
            .map(|(&tid, _)| tid)
            .collect();
        for tid in timed_out {
            self.settle_timer(tid, true);
        }
        let mut vanished = Vec::new();
        let mut exited = 0;
        self.threads.retain(|_, t| {
            if t.seen == tick {
                return true;
            }
            exited += 1;
            // The thread exited: it can no longer run a handler, so its slot is reusable.
            if let Some(p) = t.pending.take().or(t.abandoned.take()) {
                vanished.push(p.idx);
            }
            false
        });
        self.exited += exited;
        for idx in vanished {
            let s = Self::slot(idx);
            s.seq.fetch_add(1, Ordering::AcqRel);
            s.state.store(IDLE, Ordering::Release);
            self.free_slots.push(idx);
        }
        self.tids = tids;
        // New threads bring new stacks: refresh the maps, at most every 50 ms; check for newly
        // loaded objects every second.
        let since = self.tick - self.last_refresh;
        // New threads bring stacks the snapshot does not know yet; the request is kept until the
        // rate limit lets it through.
        self.maps_wanted |= new_threads || unwind::maps_stale();
        if (self.maps_wanted && since * 1000 >= 20 * hz) || since >= hz {
            unwind::refresh(self.maps_wanted);
            self.maps_wanted = false;
            self.last_refresh = self.tick;
        }
        if self.tick - self.last_names >= hz {
            self.last_names = self.tick;
            let dirfd = self.lister.as_ref().map(|l| l.fd);
            for (tid, t) in self.threads.iter_mut() {
                refresh_name(dirfd, *tid, &mut t.name);
            }
        }
        self.give_back_memory();
    }

    /// Tells the export thread that threads exited since its last export (see
    /// [`trim_after_export`]).
    fn give_back_memory(&mut self) {
        if self.exited != 0 {
            self.exited = 0;
            THREADS_EXITED.store(true, Ordering::Relaxed);
        }
    }

    /// Samples thread `tid` for this tick; false when the thread no longer exists.
    fn visit(&mut self, tid: i32, now: u64, ticks: i64) -> bool {
        let Some(cpu) = thread_cpu_ns(tid) else {
            return false;
        };
        let tick = self.tick;
        let dirfd = self.lister.as_ref().map(|l| l.fd);
        let info = self.threads.entry(tid).or_insert_with(|| ThreadInfo {
            name: {
                let mut name = String::new();
                refresh_name(dirfd, tid, &mut name);
                name
            },
            last_cpu: cpu,
            last_wall: now,
            stack: Vec::new(),
            has_stack: false,
            idle_ref: 0,
            idle_ticks: 0,
            idle_cpu: 0,
            idle_wall: 0,
            name_checks_left: 100,
            pending: None,
            abandoned: None,
            timer: None,
            prev_cpu: cpu,
            prev_wall: now,
            seen: tick,
        });
        info.seen = tick;
        // Used at least BUSY_QUARTERS/4 of a CPU since the previous visit.
        let busy = cpu.saturating_sub(info.prev_cpu) * 4
            >= now.saturating_sub(info.prev_wall) * BUSY_QUARTERS;
        info.prev_cpu = cpu;
        info.prev_wall = now;
        if info.name_checks_left > 0 {
            // Re-read until the thread renamed itself (it starts with its creator's name), for
            // its first visits only: a thread not scheduled for a while names itself late.
            // Every visit at first, then every tenth.
            info.name_checks_left -= 1;
            if (info.name_checks_left > 90 || info.name_checks_left % 10 == 0)
                && refresh_name(dirfd, tid, &mut info.name)
            {
                info.name_checks_left = 0;
            }
        }
        self.shared.stats.cpu_ticks.fetch_add(1, Ordering::Relaxed);

        if let Some(a) = info.abandoned.as_ref() {
            let s = Self::slot(a.idx);
            if s.state.load(Ordering::Acquire) == DONE && s.seq.load(Ordering::Acquire) == a.seq {
                // It answered after all: take the slot back and sample it again.
                let a = info.abandoned.take().unwrap_or_else(|| unreachable!());
                s.state.store(IDLE, Ordering::Release);
                self.free_slots.push(a.idx);
                let info = self.threads.get_mut(&tid).unwrap_or_else(|| unreachable!());
                info.last_cpu = cpu;
                info.last_wall = now;
            } else {
                return true;
            }
        }

        let info = self.threads.get_mut(&tid).unwrap_or_else(|| unreachable!());
        if let Some(p) = info.pending.as_mut() {
            let s = Self::slot(p.idx);
            if s.state.load(Ordering::Acquire) == DONE {
                self.complete(tid);
            } else if now.saturating_sub(p.sent_at) > ABANDON_AFTER.as_nanos() as u64 {
                info.abandoned = info.pending.take();
                return true;
            } else {
                // Not answered yet: the thread's user stack has not changed since the request,
                // so this tick is covered by the same stack.
                p.ticks += ticks;
                p.cpu = cpu;
                p.wall = now;
                self.shared
                    .stats
                    .cpu_merged_ticks
                    .fetch_add(ticks as u64, Ordering::Relaxed);
                self.fast = true;
                return true;
            }
        }

        // Stacks the thread's CPU timer captured since the last visit (they cover this tick if
        // it was busy).
        if self.take_timer_captures(tid, ticks, busy, Some(cpu)) {
            return true;
        }
        let info = self.threads.get_mut(&tid).unwrap_or_else(|| unreachable!());
        if info.has_stack && cpu.saturating_sub(info.idle_ref) < IDLE_SLACK_NS {
            // Has not run since its stack was captured: same stack, no need to interrupt it.
            // Consecutive idle ticks are added up and recorded as one sample (same stack, same
            // labels: the aggregated profile is identical), at most every ~100 ms.
            if self.wall_enabled {
                info.idle_ticks += ticks;
                info.idle_cpu = cpu;
                info.idle_wall = now;
                let flush_every = (self.shared.settings.cpu_hz as i64 / 10).max(1);
                if info.idle_ticks >= flush_every {
                    self.flush_idle(tid);
                }
            } else {
                info.last_wall = now;
                info.last_cpu = cpu;
            }
            return true;
        }
        // About to look at the thread again: what it accumulated idle goes out first.
        self.flush_idle(tid);
        let info = self.threads.get_mut(&tid).unwrap_or_else(|| unreachable!());
        let mut ticks = ticks;
        match info.timer.as_mut() {
            Some(t) if busy && t.ticks + ticks <= MAX_TIMER_WAIT => {
                // Busy: its timer fires within about a period of its CPU time and captures the
                // stack then; the tick waits for that instead of a signal from here.
                t.ticks += ticks;
                self.shared
                    .stats
                    .cpu_timer_ticks
                    .fetch_add(ticks as u64, Ordering::Relaxed);
                return true;
            }
            // Not busy enough for its timer to come soon: the request covers the ticks left to
            // the timer too.
            Some(t) => ticks += std::mem::take(&mut t.ticks),
            // Signalled this once; its timer captures from now on.
            None if busy && !self.timers_failed => self.arm_timer(tid),
            None => {}
        }
        // A request is answered within a tick or two: the next wake-up comes on time.
        self.fast = true;
        let Some(idx) = self.alloc_slot() else {
            return true;
        };
        let s = Self::slot(idx);
        let seq = s.seq.fetch_add(1, Ordering::AcqRel).wrapping_add(1);
        s.state.store(REQUESTED, Ordering::Release);
        let value = (MAGIC << 48) | ((seq as u64) << 16) | idx as u64;
        if send(tid, self.signal, value) {
            self.shared
                .stats
                .cpu_requests
                .fetch_add(1, Ordering::Relaxed);
            let info = self.threads.get_mut(&tid).unwrap_or_else(|| unreachable!());
            info.pending = Some(Pending {
                idx,
                seq,
                ticks,
                cpu,
                wall: now,
                sent_at: now,
            });
        } else {
            self.shared
                .stats
                .cpu_signal_failures
                .fetch_add(1, Ordering::Relaxed);
            s.state.store(IDLE, Ordering::Release);
            self.free_slots.push(idx);
        }
        true
    }

    fn ring(idx: usize) -> &'static Ring {
        // SAFETY: only indices of published rings are handed around; never freed.
        unsafe { &*RINGS[idx].load(Ordering::Acquire) }
    }

    fn alloc_ring(&mut self) -> Option<usize> {
        if let Some(i) = self.free_rings.pop() {
            return Some(i);
        }
        while self.next_ring < MAX_RINGS {
            let i = self.next_ring;
            self.next_ring += 1;
            let p = RINGS[i].load(Ordering::Acquire);
            if p.is_null() {
                let ring = Box::new(Ring {
                    seq: AtomicU32::new(0),
                    slots: std::array::from_fn(|_| Slot::new()),
                });
                RINGS[i].store(Box::into_raw(ring), Ordering::Release);
                return Some(i);
            }
            // Left by an earlier profiler in this process: reuse if no handler can write it.
            // SAFETY: published rings are never freed.
            let ring = unsafe { &*p };
            if ring
                .slots
                .iter()
                .all(|s| matches!(s.state.load(Ordering::Acquire), IDLE | DONE))
            {
                return Some(i);
            }
        }
        None
    }

    /// Gives thread `tid` a CPU timer signalling it into a ring of its own.
    fn arm_timer(&mut self, tid: i32) {
        let Some(r) = self.alloc_ring() else {
            return;
        };
        let ring = Self::ring(r);
        let seq = ring.seq.fetch_add(1, Ordering::AcqRel).wrapping_add(1);
        for s in &ring.slots {
            s.state.store(ARMED, Ordering::Release);
        }
        let value = (TIMER_MAGIC << 48) | ((seq as u64) << 16) | r as u64;
        let period = period_ns(&self.shared.settings);
        match create_cpu_timer(tid, self.signal, value, period) {
            Some(id) => {
                if let Some(info) = self.threads.get_mut(&tid) {
                    info.timer = Some(CpuTimer {
                        id,
                        ring: r,
                        ticks: 0,
                    });
                }
            }
            None => {
                self.timers_failed = true;
                ring.seq.fetch_add(1, Ordering::AcqRel);
                for s in &ring.slots {
                    s.state.store(IDLE, Ordering::Release);
                }
                self.free_rings.push(r);
            }
        }
    }

    /// Deletes a thread's CPU timer and frees its ring unless a handler is still writing into
    /// it (then the ring stays out of use; a later profiler may take it once the handler is
    /// done). `thread_gone`: no handler of it can run any more.
    fn release_timer(&mut self, t: CpuTimer, thread_gone: bool) {
        // SAFETY: `t.id` is a timer this sampler created and has not deleted.
        unsafe { libc::timer_delete(t.id) };
        let ring = Self::ring(t.ring);
        // A signal already queued finds the new sequence number and leaves the ring alone.
        ring.seq.fetch_add(1, Ordering::AcqRel);
        let mut free = true;
        for s in &ring.slots {
            let idle = thread_gone
                || s.state
                    .compare_exchange(ARMED, IDLE, Ordering::AcqRel, Ordering::Acquire)
                    .is_ok()
                || s.state.load(Ordering::Acquire) == DONE;
            if idle {
                s.state.store(IDLE, Ordering::Release);
            } else {
                free = false;
            }
        }
        if free {
            self.free_rings.push(t.ring);
        }
    }

    /// Records the stacks the CPU timer of `tid` captured since the last visit, in capture
    /// order. For a `busy` thread each gets the CPU and wall time up to its capture, and the
    /// ticks that waited for the timer and this visit's `ticks` are spread over them (exact in
    /// sum); true then: they cover this tick. A thread that was not busy also spent time off
    /// CPU, which belongs to where it waited, not to where it ran: its captures get their CPU
    /// time only, and its wall time and ticks are left to the visit (false).
    ///
    /// `cpu_now` is the thread's CPU clock read just now by the sampler (`None` when it could
    /// not be read, e.g. the thread is gone): the CPU time since the last sample is split evenly
    /// over the captures, each of which the timer took after one period of CPU time. Without a
    /// reading each capture is credited one period.
    fn take_timer_captures(
        &mut self,
        tid: i32,
        ticks: i64,
        busy: bool,
        cpu_now: Option<u64>,
    ) -> bool {
        let Some(r) = self
            .threads
            .get(&tid)
            .and_then(|i| i.timer.as_ref())
            .map(|t| t.ring)
        else {
            return false;
        };
        let ring = Self::ring(r);
        let mut done = [0usize; RING];
        let mut k = 0;
        for (i, s) in ring.slots.iter().enumerate() {
            if s.state.load(Ordering::Acquire) == DONE {
                done[k] = i;
                k += 1;
            }
        }
        if k == 0 {
            return false;
        }
        done[..k].sort_unstable_by_key(|&i| ring.slots[i].wall_at.load(Ordering::Relaxed));
        // Idle ticks belong to the stack being replaced.
        self.flush_idle(tid);
        let total = match self.threads.get_mut(&tid).and_then(|i| i.timer.as_mut()) {
            Some(t) if busy => std::mem::take(&mut t.ticks) + ticks,
            Some(_) => 0,
            None => return false,
        };
        self.shared
            .stats
            .cpu_timer_samples
            .fetch_add(k as u64, Ordering::Relaxed);
        let period = period_ns(&self.shared.settings);
        let (cpu_total, cpu_ref) = match (cpu_now, self.threads.get(&tid)) {
            (Some(now), Some(info)) => (now.saturating_sub(info.last_cpu), now),
            (_, info) => {
                let total = period * k as u64;
                (total, info.map_or(0, |i| i.last_cpu) + total)
            }
        };
        for (j, &i) in done[..k].iter().enumerate() {
            let s = &ring.slots[i];
            let Some(info) = self.threads.get_mut(&tid) else {
                return true;
            };
            take_stack(s, &mut info.stack, &self.shared.stats, &self.stamps);
            info.has_stack = !info.stack.is_empty();
            let wall_at = self.stamps.wall_ns(s, s.wall_at.load(Ordering::Relaxed));
            s.state.store(ARMED, Ordering::Release);
            let (j64, k64) = (j as u64, k as u64);
            let cpu_ns = (cpu_total * (j64 + 1) / k64 - cpu_total * j64 / k64) as i64;
            if j + 1 == k {
                info.last_cpu = info.last_cpu.max(cpu_ref);
                info.idle_ref = cpu_ref;
            }
            let mut wall_ns = 0;
            if busy {
                wall_ns = wall_at.saturating_sub(info.last_wall) as i64;
                info.last_wall = info.last_wall.max(wall_at);
            }
            let (j, k) = (j as i64, k as i64);
            let count = total * (j + 1) / k - total * j / k;
            self.record(tid, cpu_ns, wall_ns, count);
        }
        busy
    }

    /// Ends the CPU timer of `tid`: records what it captured, and the ticks still waiting for
    /// it on the thread's last known stack (it was busy there a moment ago).
    fn settle_timer(&mut self, tid: i32, thread_gone: bool) {
        let cpu_now = if thread_gone {
            None
        } else {
            thread_cpu_ns(tid)
        };
        self.take_timer_captures(tid, 0, true, cpu_now);
        let now = monotonic_ns();
        let Some(info) = self.threads.get_mut(&tid) else {
            return;
        };
        let Some(t) = info.timer.take() else {
            return;
        };
        if t.ticks > 0 {
            let cpu = thread_cpu_ns(tid).unwrap_or(info.last_cpu);
            let cpu_ns = cpu.saturating_sub(info.last_cpu) as i64;
            let wall_ns = now.saturating_sub(info.last_wall) as i64;
            info.last_cpu = cpu.max(info.last_cpu);
            info.last_wall = now;
            self.record(tid, cpu_ns, wall_ns, t.ticks);
        }
        self.release_timer(t, thread_gone);
    }

    /// Records the idle ticks `tid` accumulated, on its current stack.
    fn flush_idle(&mut self, tid: i32) {
        let Some(info) = self.threads.get_mut(&tid) else {
            return;
        };
        if info.idle_ticks == 0 {
            return;
        }
        let ticks = std::mem::take(&mut info.idle_ticks);
        let wall = info.idle_wall.saturating_sub(info.last_wall) as i64;
        let cpu = info.idle_cpu.saturating_sub(info.last_cpu) as i64;
        info.last_wall = info.idle_wall;
        info.last_cpu = info.idle_cpu;
        self.record(tid, cpu, wall, ticks);
    }

    /// Records the finished request of `tid` and frees its slot.
    fn complete(&mut self, tid: i32) {
        let Some(info) = self.threads.get_mut(&tid) else {
            return;
        };
        let Some(p) = info.pending.take() else {
            return;
        };
        let s = Self::slot(p.idx);
        take_stack(s, &mut info.stack, &self.shared.stats, &self.stamps);
        info.has_stack = !info.stack.is_empty();
        // The CPU clock when the request was sent: the handler ran after it, so a thread whose
        // clock has not moved past it (give or take the handler) has not run since.
        info.idle_ref = p.cpu;
        s.state.store(IDLE, Ordering::Release);
        self.free_slots.push(p.idx);
        let cpu = p.cpu.saturating_sub(info.last_cpu) as i64;
        let wall = p.wall.saturating_sub(info.last_wall) as i64;
        info.last_cpu = p.cpu;
        info.last_wall = p.wall;
        self.record(tid, cpu, wall, p.ticks);
    }

    fn record(&mut self, tid: i32, cpu_ns: i64, wall_ns: i64, count: i64) {
        let Some(info) = self.threads.get(&tid) else {
            return;
        };
        if !info.has_stack {
            return;
        }
        self.frames.clear();
        self.frames
            .extend(info.stack.iter().map(|&a| Frame::Address(a)));
        let labels = [
            Label::num(THREAD_ID_LABEL, tid as i64),
            Label::str(THREAD_NAME_LABEL, &info.name),
        ];
        let values = SampleValues {
            cpu_time_ns: cpu_ns,
            cpu_or_wall_samples: count,
            wall_time_ns: wall_ns,
            ..Default::default()
        };
        let sh = &self.shared;
        let frames = &self.frames;
        tls::in_recorder(|| {
            // Never inside the recorder while a fork is under way (see `fork`); taps outside.
            crate::fork::outside_fork(|| {
                if sh
                    .recorder
                    .record_sample(frames, &values, &labels, 0)
                    .is_err()
                {
                    sh.stats.record_errors.fetch_add(1, Ordering::Relaxed);
                } else {
                    sh.stats
                        .cpu_samples
                        .fetch_add(count as u64, Ordering::Relaxed);
                }
            });
            sh.for_each_tap(TapKind::Cpu, |r| {
                let _ = r.record_sample(frames, &values, &labels, 0);
            });
        });
    }

    /// On stop: ends the CPU timers, gives pending requests a moment to finish, records them,
    /// abandons the rest.
    fn finish(&mut self) {
        self.stamps.update();
        let all: Vec<i32> = self.threads.keys().copied().collect();
        for &tid in &all {
            self.flush_idle(tid);
            self.settle_timer(tid, false);
        }
        let deadline = monotonic_ns() + 100_000_000;
        loop {
            let pending: Vec<i32> = self
                .threads
                .iter()
                .filter(|(_, t)| t.pending.is_some())
                .map(|(&tid, _)| tid)
                .collect();
            if pending.is_empty() {
                return;
            }
            for tid in pending {
                let done = self.threads[&tid]
                    .pending
                    .as_ref()
                    .is_some_and(|p| Self::slot(p.idx).state.load(Ordering::Acquire) == DONE);
                if done {
                    self.complete(tid);
                }
            }
            if monotonic_ns() > deadline {
                // Left REQUESTED: never reused while a handler might still write it.
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// Copies the stack of a slot observed DONE into `stack`, counting the handler's cost.
fn take_stack(s: &Slot, stack: &mut Vec<u64>, stats: &crate::state::Stats, stamps: &StampClock) {
    let n = (s.len.load(Ordering::Relaxed) as usize).min(MAX_FRAMES);
    // SAFETY: DONE was observed with acquire ordering: the handler finished writing.
    let frames = unsafe { &(&*s.frames.get())[..n] };
    stack.clear();
    stack.extend_from_slice(frames);
    // The next capture through these frames takes the fast path.
    crate::unwind::learn(frames);
    stats.count_handler(stamps.duration_ns(s.handler_stamps.load(Ordering::Relaxed)));
    stats
        .handler_frames_total
        .fetch_add(n as u64, Ordering::Relaxed);
    stats.handler_count.fetch_add(1, Ordering::Relaxed);
}

fn sleep_until(deadline_ns: u64) {
    let ts = libc::timespec {
        tv_sec: (deadline_ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (deadline_ns % 1_000_000_000) as libc::c_long,
    };
    loop {
        // SAFETY: valid timespec; absolute monotonic sleep.
        let rc = unsafe {
            libc::clock_nanosleep(
                libc::CLOCK_MONOTONIC,
                libc::TIMER_ABSTIME,
                &ts,
                std::ptr::null_mut(),
            )
        };
        if rc != libc::EINTR {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_convert_to_monotonic_time() {
        let mut clock = StampClock::new();
        let (s0, m0) = (stamp(), monotonic_ns());
        std::thread::sleep(Duration::from_millis(30));
        let (s1, m1) = (stamp(), monotonic_ns());
        clock.update();
        // A 30 ms interval measured in stamps converts to within 2% of the monotonic clock's.
        let d = clock.duration_ns(s1.wrapping_sub(s0)) as f64;
        let truth = (m1 - m0) as f64;
        assert!((d / truth - 1.0).abs() < 0.02, "{d} ns vs {truth} ns");
        // A stamp taken as wall time lands within 1 ms of the monotonic reading beside it.
        let slot = Slot::new();
        let at = clock.wall_ns(&slot, if slot.stamp_wall { s0 } else { m0 });
        assert!(at.abs_diff(m0) < 1_000_000, "{at} vs {m0}");
    }

    #[test]
    fn lists_own_threads() {
        let mut l = TaskLister::open().expect("open /proc/self/task");
        let mut out = Vec::new();
        assert!(l.list(&mut out));
        // SAFETY: no preconditions.
        let me = unsafe { libc::gettid() };
        assert!(out.contains(&me), "{out:?} lacks {me}");
    }

    #[test]
    fn reads_thread_names_with_and_without_the_task_directory() {
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let h = std::thread::Builder::new()
            .name("name-probe-123".into())
            .spawn(move || {
                // SAFETY: no preconditions.
                tx.send(unsafe { libc::gettid() }).unwrap();
                let _ = stop_rx.recv();
            })
            .unwrap();
        let tid = rx.recv().unwrap();
        let l = TaskLister::open().expect("open /proc/self/task");
        let mut buf = [0u8; 64];
        assert_eq!(read_comm(Some(l.fd), tid, &mut buf), "name-probe-123");
        assert_eq!(read_comm(None, tid, &mut buf), "name-probe-123");
        let mut name = String::from("old");
        assert!(refresh_name(Some(l.fd), tid, &mut name));
        assert_eq!(name, "name-probe-123");
        assert!(!refresh_name(Some(l.fd), tid, &mut name), "unchanged");
        stop_tx.send(()).unwrap();
        h.join().unwrap();
        assert!(
            eventually(|| read_comm(Some(l.fd), tid, &mut [0u8; 64]).is_empty()),
            "name of exited thread {tid} still readable"
        );
    }

    #[test]
    fn reads_another_threads_cpu_clock() {
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let h = std::thread::spawn(move || {
            // SAFETY: no preconditions.
            tx.send(unsafe { libc::gettid() }).unwrap();
            let mut x = 0u64;
            while stop_rx.try_recv().is_err() {
                x = std::hint::black_box(x.wrapping_add(1));
            }
        });
        let tid = rx.recv().unwrap();
        let a = thread_cpu_ns(tid).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let b = thread_cpu_ns(tid).unwrap();
        stop_tx.send(()).unwrap();
        h.join().unwrap();
        assert!(b > a, "{a} -> {b}");
        // `join` returns when the thread cleared its tid word, which the kernel does before
        // the task is gone: its clock stays readable for a moment.
        assert!(
            eventually(|| thread_cpu_ns(tid).is_none()),
            "clock of exited thread {tid} still readable"
        );
    }

    #[test]
    fn timer_signals_fill_their_ring_in_order_and_stale_ones_are_ignored() {
        // The last ring: samplers take rings from the first one up.
        let idx = MAX_RINGS - 1;
        let ring = Box::into_raw(Box::new(Ring {
            seq: AtomicU32::new(7),
            slots: std::array::from_fn(|_| Slot::new()),
        }));
        RINGS[idx]
            .compare_exchange(
                std::ptr::null_mut(),
                ring,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .expect("ring unused");
        let ring = Sampler::ring(idx);
        for s in &ring.slots {
            s.state.store(ARMED, Ordering::Release);
        }
        // SAFETY (all calls below): claim_ring_slot only touches atomics; any thread may call it.
        assert!(
            unsafe { claim_ring_slot(idx, 6) }.is_none(),
            "a retired timer"
        );
        assert!(
            unsafe { claim_ring_slot(idx - 1, 7) }.is_none(),
            "no ring there"
        );
        let full = RING_FULL.load(Ordering::Relaxed);
        for want in &ring.slots {
            let got = unsafe { claim_ring_slot(idx, 7) }.expect("an armed slot");
            assert!(std::ptr::eq(got, want), "slots are taken in order");
            assert_eq!(got.state.load(Ordering::Acquire), CAPTURING);
            got.state.store(DONE, Ordering::Release);
        }
        assert!(
            unsafe { claim_ring_slot(idx, 7) }.is_none(),
            "the ring is full"
        );
        assert!(
            RING_FULL.load(Ordering::Relaxed) > full,
            "a full ring is counted"
        );
        // A collected slot is armed again and the next signal takes it.
        ring.slots[3].state.store(ARMED, Ordering::Release);
        let got = unsafe { claim_ring_slot(idx, 7) }.expect("the re-armed slot");
        assert!(std::ptr::eq(got, &ring.slots[3]));
    }

    /// Whether `cond` holds within a second (for what the kernel finishes after `join`).
    fn eventually(mut cond: impl FnMut() -> bool) -> bool {
        let deadline = std::time::Instant::now() + Duration::from_secs(1);
        while !cond() {
            if std::time::Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }
}
