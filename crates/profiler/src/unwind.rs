//! Stack unwinding with DWARF CFI (`.eh_frame`), safe to run in a signal handler.
//!
//! Rust's std ships with frame pointers but user code is usually built without them, so a
//! frame-pointer walk loses the callers of every user function. This module unwinds with the
//! call frame information every Linux object carries in `.eh_frame` (indexed by
//! `.eh_frame_hdr`), using `framehop` under its "must not allocate during unwind" policy.
//!
//! What runs where:
//! * The sampler thread (never a handler) builds a [`Snapshot`]: the module list read from the
//!   dynamic loader (each module's `.eh_frame_hdr`/`.eh_frame` used in place, in memory) plus
//!   the readable-writable mappings of `/proc/self/maps` (to bound stack reads). It publishes
//!   the snapshot through an atomic pointer. An old snapshot is freed only once no reader is
//!   inside any snapshot (a global reader count observed at zero after the swap).
//! * [`unwind`] (signal handler or allocator) loads the snapshot, borrows a preallocated
//!   unwinder cache from a fixed pool with a compare-and-swap (no waiting: when all are busy
//!   the stack is cut to its leaf frame), and walks at most `out.len()` frames.
//! * Stack reads are bounded to `[sp, top of the stack mapping)`: the thread's own stack bounds
//!   when known (learned outside the handler), else the snapshot mapping that contains `sp`.
//!   Nothing outside that range is ever dereferenced, so a corrupt frame cannot fault.
//!
//! Supported: Linux x86_64 and aarch64 with glibc, code in objects listed by the dynamic loader.
//! Not supported: JIT code without registered unwind info (the frame-pointer fallback applies),
//! objects unloaded while a sample is being taken (`dlclose` races), stacks of threads
//! switched by user-space coroutines beyond the current stack.

use std::cell::UnsafeCell;
use std::ops::Deref;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use framehop::{
    CacheNative, ExplicitModuleSectionInfo, FrameAddress, Module, MustNotAllocateDuringUnwind,
    Unwinder, UnwinderNative,
};
use parking_lot::Mutex;

use crate::modules::{loaded_objects, objects_generation, LoadedObject};

/// Most frames one stack keeps.
pub const MAX_FRAMES: usize = 128;

/// Bytes of process memory, used in place (a module's unwind sections).
#[derive(Clone, Copy)]
pub(crate) struct MemSlice {
    ptr: *const u8,
    len: usize,
}

impl Default for MemSlice {
    fn default() -> Self {
        MemSlice {
            ptr: std::ptr::NonNull::<u8>::dangling().as_ptr(),
            len: 0,
        }
    }
}

// SAFETY: MemSlice points into read-only segments of loaded objects, which are immutable and
// shared by every thread; it is only read.
unsafe impl Send for MemSlice {}
// SAFETY: as above.
unsafe impl Sync for MemSlice {}

impl Deref for MemSlice {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: built from a mapped, readable range of a loaded object that stays mapped while
        // the object is loaded (see the module docs for the dlclose caveat).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

type NativeUnwinder = UnwinderNative<MemSlice, MustNotAllocateDuringUnwind>;
type NativeCache = CacheNative<MustNotAllocateDuringUnwind>;

/// Registers an unwind starts from.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct StartRegs {
    pub pc: u64,
    pub sp: u64,
    /// Frame pointer (rbp / x29).
    pub fp: u64,
    /// Link register (aarch64 only).
    #[allow(dead_code)]
    pub lr: u64,
}

/// An immutable view of the process for handlers to unwind with.
pub(crate) struct Snapshot {
    unwinder: NativeUnwinder,
    /// Sorted, non-overlapping readable+writable mappings: candidate stacks.
    rw_maps: Vec<(u64, u64)>,
    /// The main thread's `[stack]` mapping, which grows down past its recorded start.
    main_stack: Option<(u64, u64)>,
    objects_gen: (u64, u64),
    #[cfg(target_arch = "aarch64")]
    ptr_auth_mask: framehop::aarch64::PtrAuthMask,
}

impl Snapshot {
    fn build() -> Snapshot {
        let objects_gen = objects_generation();
        let objects = loaded_objects();
        let mut unwinder = NativeUnwinder::new();
        for obj in &objects {
            if let Some(m) = module_for(obj) {
                unwinder.add_module(m);
            }
        }
        let (rw_maps, main_stack) = read_rw_maps();
        #[cfg(target_arch = "aarch64")]
        let ptr_auth_mask = framehop::aarch64::PtrAuthMask::from_max_known_address(
            unwinder.max_known_code_address(),
        );
        Snapshot {
            unwinder,
            rw_maps,
            main_stack,
            objects_gen,
            #[cfg(target_arch = "aarch64")]
            ptr_auth_mask,
        }
    }

    /// Bounds of the stack mapping that contains `sp` (async-signal-safe).
    fn stack_of(&self, sp: u64) -> Option<(u64, u64)> {
        if let Some((lo, hi)) = self.main_stack {
            // The main stack grows down on demand below the start we read.
            if sp < hi && sp >= lo.saturating_sub(MAIN_STACK_GROWTH) {
                return Some((sp, hi));
            }
        }
        let i = self.rw_maps.partition_point(|&(start, _)| start <= sp);
        if i == 0 {
            return None;
        }
        let (start, end) = self.rw_maps[i - 1];
        (start <= sp && sp < end).then_some((sp, end))
    }
}

/// How far below the recorded start the main stack may have grown (default stack rlimit).
const MAIN_STACK_GROWTH: u64 = 8 << 20;

fn module_for(obj: &LoadedObject) -> Option<Module<MemSlice>> {
    let (start, end) = obj.range()?;
    let (hdr_start, hdr_end) = obj.eh_frame_hdr?;
    let hdr_seg = obj.segment_of(hdr_start)?;
    if hdr_end > hdr_seg.end || hdr_end <= hdr_start {
        return None;
    }
    let hdr = MemSlice {
        ptr: hdr_start as *const u8,
        len: (hdr_end - hdr_start) as usize,
    };
    let eh_frame_start = eh_frame_address(&hdr, hdr_start)?;
    // The section's size is not recorded anywhere in memory; lookups go through the index in
    // `.eh_frame_hdr`, so the slice may extend to the end of the containing segment.
    let eh_seg = obj.segment_of(eh_frame_start)?;
    let eh_frame = MemSlice {
        ptr: eh_frame_start as *const u8,
        len: (eh_seg.end - eh_frame_start) as usize,
    };
    let text = obj
        .segments
        .iter()
        .find(|s| s.flags & libc::PF_X != 0)
        .map(|s| (s.start - obj.base)..(s.end - obj.base));
    let info = ExplicitModuleSectionInfo {
        base_svma: 0,
        text_svma: text,
        eh_frame_svma: Some((eh_frame_start - obj.base)..(eh_seg.end - obj.base)),
        eh_frame: Some(eh_frame),
        eh_frame_hdr_svma: Some((hdr_start - obj.base)..(hdr_end - obj.base)),
        eh_frame_hdr: Some(hdr),
        ..Default::default()
    };
    Some(Module::new(obj.name.clone(), start..end, obj.base, info))
}

/// Decodes `eh_frame_ptr` from an `.eh_frame_hdr` mapped at `hdr_addr`.
fn eh_frame_address(hdr: &[u8], hdr_addr: u64) -> Option<u64> {
    if hdr.len() < 8 || hdr[0] != 1 {
        return None;
    }
    let enc = hdr[1];
    let field = &hdr[4..];
    let field_addr = hdr_addr + 4;
    let value: i128 = match enc & 0x0f {
        0x00 => u64::from_le_bytes(field.get(..8)?.try_into().ok()?) as i128,
        0x02 => u16::from_le_bytes(field.get(..2)?.try_into().ok()?) as i128,
        0x03 => u32::from_le_bytes(field.get(..4)?.try_into().ok()?) as i128,
        0x04 => u64::from_le_bytes(field.get(..8)?.try_into().ok()?) as i128,
        0x0a => i16::from_le_bytes(field.get(..2)?.try_into().ok()?) as i128,
        0x0b => i32::from_le_bytes(field.get(..4)?.try_into().ok()?) as i128,
        0x0c => i64::from_le_bytes(field.get(..8)?.try_into().ok()?) as i128,
        _ => return None,
    };
    let base: i128 = match enc & 0x70 {
        0x00 => 0,
        0x10 => field_addr as i128,
        0x30 => hdr_addr as i128,
        _ => return None,
    };
    u64::try_from(base + value).ok()
}

/// Readable+writable mappings from /proc/self/maps, and the main `[stack]`.
type Range64 = (u64, u64);

fn read_rw_maps() -> (Vec<Range64>, Option<Range64>) {
    let mut out = Vec::new();
    let mut main = None;
    let Ok(text) = std::fs::read_to_string("/proc/self/maps") else {
        return (out, main);
    };
    for line in text.lines() {
        let mut parts = line.split_ascii_whitespace();
        let (Some(range), Some(perms)) = (parts.next(), parts.next()) else {
            continue;
        };
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else {
            continue;
        };
        let p = perms.as_bytes();
        if p.len() < 2 || p[0] != b'r' || p[1] != b'w' {
            continue;
        }
        if line.ends_with("[stack]") {
            main = Some((start, end));
        }
        out.push((start, end));
    }
    out.sort_unstable();
    (out, main)
}

static SNAPSHOT: AtomicPtr<Snapshot> = AtomicPtr::new(ptr::null_mut());
/// Number of readers currently inside some snapshot.
static READERS: AtomicUsize = AtomicUsize::new(0);
/// Snapshots replaced but possibly still read by a handler.
static RETIRED: Mutex<Vec<usize>> = Mutex::new(Vec::new());
/// Set by readers that found no stack mapping for their `sp`: the maps need a refresh.
static MAPS_STALE: AtomicBool = AtomicBool::new(false);
/// Snapshots built so far (for stats).
static BUILDS: AtomicUsize = AtomicUsize::new(0);

/// Number of snapshots built in this process.
pub(crate) fn snapshot_builds() -> usize {
    BUILDS.load(Ordering::Relaxed)
}

/// Rebuilds and publishes the snapshot when the loaded objects changed, when `maps_changed`
/// (new threads, hence new stacks) or when a reader asked for it. Returns whether it rebuilt.
/// Never call from a signal handler.
pub(crate) fn refresh(maps_changed: bool) -> bool {
    // Writers are serialized by this lock; only they free snapshots, so `current` stays valid.
    let mut retired = RETIRED.lock();
    let current = SNAPSHOT.load(Ordering::SeqCst);
    let stale = MAPS_STALE.swap(false, Ordering::SeqCst);
    // SAFETY: see above: a published snapshot is freed only by a writer holding the lock.
    let gen_changed =
        current.is_null() || unsafe { (*current).objects_gen } != objects_generation();
    if !(gen_changed || maps_changed || stale) {
        reclaim(&mut retired, Duration::ZERO);
        return false;
    }
    let new = Box::into_raw(Box::new(Snapshot::build()));
    BUILDS.fetch_add(1, Ordering::Relaxed);
    let old = SNAPSHOT.swap(new, Ordering::SeqCst);
    if !old.is_null() {
        retired.push(old as usize);
    }
    reclaim(&mut retired, Duration::from_millis(2));
    true
}

/// Frees retired snapshots once no reader is inside any snapshot, waiting at most `wait`.
fn reclaim(retired: &mut Vec<usize>, wait: Duration) {
    if retired.is_empty() {
        return;
    }
    let deadline = Instant::now() + wait;
    loop {
        if READERS.load(Ordering::SeqCst) == 0 {
            for p in retired.drain(..) {
                // SAFETY: `p` came from Box::into_raw, was swapped out of SNAPSHOT before the
                // reader count was seen at zero, so no reader holds it and none can load it.
                drop(unsafe { Box::from_raw(p as *mut Snapshot) });
            }
            return;
        }
        if Instant::now() >= deadline {
            return;
        }
        std::thread::yield_now();
    }
}

/// In a forked child only the forking thread survives: readers that were inside a snapshot
/// are gone, and so are cache borrowers.
pub(crate) fn after_fork_in_child() {
    READERS.store(0, Ordering::SeqCst);
    let pool = POOL.load(Ordering::SeqCst);
    if !pool.is_null() {
        // SAFETY: the pool is never freed once published.
        for e in unsafe { (*pool).iter() } {
            e.busy.store(false, Ordering::SeqCst);
        }
    }
}

struct PoolEntry {
    busy: AtomicBool,
    cache: UnsafeCell<NativeCache>,
}

// SAFETY: `cache` is only accessed by the holder of `busy`, acquired with a compare-and-swap.
unsafe impl Sync for PoolEntry {}

static POOL: AtomicPtr<Box<[PoolEntry]>> = AtomicPtr::new(ptr::null_mut());

/// Allocates the unwinder cache pool once (never freed: handlers may hold an entry at any time).
pub(crate) fn init_pool() {
    if !POOL.load(Ordering::SeqCst).is_null() {
        return;
    }
    let n = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .clamp(1, 16)
        * 2
        + 2;
    let entries: Box<[PoolEntry]> = (0..n)
        .map(|_| PoolEntry {
            busy: AtomicBool::new(false),
            cache: UnsafeCell::new(NativeCache::new_in()),
        })
        .collect();
    let raw = Box::into_raw(Box::new(entries));
    if POOL
        .compare_exchange(ptr::null_mut(), raw, Ordering::SeqCst, Ordering::SeqCst)
        .is_err()
    {
        // SAFETY: we lost the race; `raw` was never published.
        drop(unsafe { Box::from_raw(raw) });
    }
}

/// Unwinds from `regs` into `out` (innermost first), returning the number of frames written.
/// Entries are the instruction pointer, then return addresses minus one (the call instruction),
/// ready for symbolization. `bounds` are the caller's stack bounds when known. Frames whose
/// stack pointer is below `skip_to_sp` are left out (the profiler's own frames on an allocation
/// stack, deeper than the function the allocator entry is inlined into; 0 keeps everything).
///
/// Async-signal-safe: no allocation, no lock, no waiting; memory reads stay within the stack
/// mapping containing `regs.sp`.
pub(crate) fn unwind(
    regs: StartRegs,
    bounds: Option<(usize, usize)>,
    skip_to_sp: u64,
    out: &mut [u64],
) -> usize {
    if out.is_empty() {
        return 0;
    }
    out[0] = regs.pc;
    let _reader = ReaderGuard::enter();
    let snap = SNAPSHOT.load(Ordering::SeqCst);
    let pool = POOL.load(Ordering::SeqCst);
    if snap.is_null() || pool.is_null() {
        return 1;
    }
    // SAFETY: a published snapshot stays alive while READERS counts us (see `reclaim`); the
    // pool is never freed.
    let (snap, pool) = unsafe { (&*snap, &*pool) };
    let sp = regs.sp;
    let range = match bounds {
        Some((lo, hi)) if (lo as u64) <= sp && sp < hi as u64 => Some((sp, hi as u64)),
        _ => snap.stack_of(sp).or_else(|| {
            // A stack newer than the snapshot: ask for a refresh, use the fallback meanwhile.
            MAPS_STALE.store(true, Ordering::Relaxed);
            thread_pointer_bound(sp)
        }),
    };
    let Some((lo, hi)) = range else {
        MAPS_STALE.store(true, Ordering::Relaxed);
        return 1;
    };
    let Some(entry) = pool.iter().find(|e| {
        e.busy
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }) else {
        return 1;
    };
    // SAFETY: we own `entry` until `busy` is released below.
    let cache = unsafe { &mut *entry.cache.get() };
    let mut read_stack = |addr: u64| -> Result<u64, ()> {
        if addr >= lo && addr.checked_add(8).is_some_and(|e| e <= hi) {
            // SAFETY: [addr, addr+8) lies within the live stack mapping containing sp.
            Ok(unsafe { ptr::read_volatile(addr as *const u64) })
        } else {
            Err(())
        }
    };
    #[cfg(target_arch = "x86_64")]
    let uregs = framehop::x86_64::UnwindRegsX86_64::new(regs.pc, regs.sp, regs.fp);
    #[cfg(target_arch = "aarch64")]
    let uregs = framehop::aarch64::UnwindRegsAarch64::new_with_ptr_auth_mask(
        snap.ptr_auth_mask,
        regs.lr,
        regs.sp,
        regs.fp,
    );
    let mut uregs = uregs;
    let mut n = 0;
    let mut frame = FrameAddress::from_instruction_pointer(regs.pc);
    // Bounded by frames written and by steps taken (skipped frames count too).
    for _ in 0..out.len() + 64 {
        if n >= out.len() {
            break;
        }
        if uregs.sp() >= skip_to_sp {
            out[n] = frame.address_for_lookup();
            n += 1;
        }
        match snap
            .unwinder
            .unwind_frame(frame, &mut uregs, cache, &mut read_stack)
        {
            Ok(Some(ret)) => match FrameAddress::from_return_address(ret) {
                Some(f) => frame = f,
                None => break,
            },
            _ => break,
        }
    }
    entry.busy.store(false, Ordering::Release);
    if n == 0 {
        out[0] = regs.pc;
        n = 1;
    }
    n
}

/// Whether a reader found no stack mapping since the last refresh.
pub(crate) fn maps_stale() -> bool {
    MAPS_STALE.load(Ordering::Relaxed)
}

/// Stack bound for a thread created after the last maps snapshot: glibc places a thread's
/// control block (what `%fs:0` points to, per the x86_64 TLS ABI) at the top of the same
/// mapping as its stack, so `[sp, tp)` is mapped. Not when `sp` is on an alternate signal stack
/// (a different mapping), nor for the main thread (its control block is elsewhere, below).
#[cfg(target_arch = "x86_64")]
fn thread_pointer_bound(sp: u64) -> Option<(u64, u64)> {
    let tp: u64;
    // SAFETY: %fs:0 holds the thread pointer itself on x86_64 Linux (TLS ABI); a plain load.
    unsafe {
        std::arch::asm!(
            "mov {}, fs:0",
            out(reg) tp,
            options(nostack, readonly, preserves_flags)
        );
    }
    if tp <= sp || tp - sp > 64 << 20 {
        return None;
    }
    // SAFETY: sigaltstack only writes the out-struct; async-signal-safe.
    let mut ss: libc::stack_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::sigaltstack(std::ptr::null(), &mut ss) } != 0 {
        return None;
    }
    if ss.ss_flags & libc::SS_DISABLE == 0 {
        let lo = ss.ss_sp as u64;
        if sp >= lo && sp < lo + ss.ss_size as u64 {
            return None;
        }
    }
    Some((sp, tp))
}

#[cfg(not(target_arch = "x86_64"))]
fn thread_pointer_bound(_sp: u64) -> Option<(u64, u64)> {
    None
}

struct ReaderGuard;

impl ReaderGuard {
    fn enter() -> ReaderGuard {
        READERS.fetch_add(1, Ordering::SeqCst);
        ReaderGuard
    }
}

impl Drop for ReaderGuard {
    fn drop(&mut self) {
        READERS.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The current stack pointer.
#[inline(always)]
pub(crate) fn current_sp() -> u64 {
    let sp: u64;
    #[cfg(target_arch = "x86_64")]
    // SAFETY: reads rsp; touches no memory.
    unsafe {
        std::arch::asm!("mov {}, rsp", out(reg) sp, options(nomem, nostack, preserves_flags));
    }
    #[cfg(target_arch = "aarch64")]
    // SAFETY: reads sp; touches no memory.
    unsafe {
        std::arch::asm!("mov {}, sp", out(reg) sp, options(nomem, nostack, preserves_flags));
    }
    sp
}

/// Registers of the calling function's frame, for unwinding from normal (non-signal) code.
#[inline(always)]
pub(crate) fn current_regs() -> StartRegs {
    let pc: u64;
    let sp: u64;
    let fp: u64;
    #[cfg(target_arch = "x86_64")]
    // SAFETY: reads rip, rsp and rbp into registers; touches no memory.
    unsafe {
        std::arch::asm!(
            "lea {pc}, [rip]",
            "mov {sp}, rsp",
            "mov {fp}, rbp",
            pc = out(reg) pc,
            sp = out(reg) sp,
            fp = out(reg) fp,
            options(nomem, nostack, preserves_flags)
        );
        StartRegs { pc, sp, fp, lr: 0 }
    }
    #[cfg(target_arch = "aarch64")]
    // SAFETY: reads pc, sp, x29 and x30 into registers; touches no memory.
    unsafe {
        let lr: u64;
        std::arch::asm!(
            "adr {pc}, .",
            "mov {sp}, sp",
            "mov {fp}, x29",
            "mov {lr}, x30",
            pc = out(reg) pc,
            sp = out(reg) sp,
            fp = out(reg) fp,
            lr = out(reg) lr,
            options(nomem, nostack, preserves_flags)
        );
        StartRegs { pc, sp, fp, lr }
    }
}

/// Registers of the interrupted context of a signal handler.
///
/// # Safety
/// `ucontext` must be the third argument of an `SA_SIGINFO` handler.
pub(crate) unsafe fn regs_from_ucontext(ucontext: *const libc::c_void) -> StartRegs {
    // SAFETY: the kernel passes a valid ucontext_t to SA_SIGINFO handlers.
    let uc = unsafe { &*(ucontext as *const libc::ucontext_t) };
    #[cfg(target_arch = "x86_64")]
    {
        let g = &uc.uc_mcontext.gregs;
        StartRegs {
            pc: g[libc::REG_RIP as usize] as u64,
            sp: g[libc::REG_RSP as usize] as u64,
            fp: g[libc::REG_RBP as usize] as u64,
            lr: 0,
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        let m = &uc.uc_mcontext;
        StartRegs {
            pc: m.pc,
            sp: m.sp,
            fp: m.regs[29],
            lr: m.regs[30],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[inline(never)]
    fn capture(out: &mut [u64]) -> usize {
        let regs = current_regs();
        unwind(regs, crate::tls::current_stack_bounds(), 0, out)
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
    fn decodes_pcrel_eh_frame_pointer() {
        // version 1, pcrel|sdata4, udata4, datarel|sdata4, then -0x20.
        let mut hdr = vec![1u8, 0x1b, 0x03, 0x3b];
        hdr.extend_from_slice(&(-0x20i32).to_le_bytes());
        assert_eq!(eh_frame_address(&hdr, 0x1000), Some(0x1000 + 4 - 0x20));
        assert_eq!(eh_frame_address(&[2, 0, 0, 0, 0, 0, 0, 0], 0), None);
    }
}
