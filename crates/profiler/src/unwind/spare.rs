//! The pool of unwinder caches and spare stacks a walk borrows, and the stack headroom checks.

use super::frames::read_own_memory_paged;
use super::*;
use std::mem::MaybeUninit;

pub(super) struct PoolEntry {
    pub(super) busy: AtomicBool,
    pub(super) cache: UnsafeCell<NativeCache>,
    /// Top (16-byte aligned) of this entry's spare stack; 0 when it could not be mapped.
    pub(super) stack_top: usize,
    /// A frame buffer for the holder's walk: cleared once, not at every sampled allocation
    /// (8 KiB of `memset` each time when it lived on the walk's stack).
    pub(super) frames: UnsafeCell<[u64; MAX_FRAMES]>,
}

// SAFETY: `cache` and the spare stack are only used by the holder of `busy`, acquired with a
// compare-and-swap.
unsafe impl Sync for PoolEntry {}

/// Size of each spare stack. Only the pages a walk touches are ever backed (a release walk and
/// recording use a few KiB; debug builds several times more), so the reserve is generous.
pub(super) const SPARE_STACK_BYTES: usize = 256 << 10;

/// Stack words read through the kernel (`process_vm_readv`) for a stack whose bounds are not
/// the thread's own: a window of up to [`CheckedWindow::SIZE`] bytes at a time, page by page,
/// so that a missing page ends the window there and keeps the pages before it. A walk reads
/// upward through the frames, which most stacks hold in one window: one system call per walk
/// (a window per 256 bytes cost a dozen calls, most of a handler's time). The bytes are only
/// read where the kernel wrote them. Async-signal-safe.
pub(super) struct CheckedWindow {
    pub(super) start: u64,
    pub(super) len: usize,
    pub(super) bytes: [MaybeUninit<u8>; CheckedWindow::SIZE],
}

impl CheckedWindow {
    /// Sized for a whole stack of a few dozen frames; walks run on a spare stack or with at
    /// least [`IN_PLACE_STACK_NEED`] of room, where this fits.
    const SIZE: usize = 16 << 10;

    pub(super) fn new() -> Self {
        CheckedWindow {
            start: 0,
            len: 0,
            bytes: [MaybeUninit::uninit(); CheckedWindow::SIZE],
        }
    }

    /// The word at `addr` (readable up to `hi`), or Err when the kernel cannot read it.
    pub(super) fn read(&mut self, addr: u64, hi: u64) -> Result<u64, ()> {
        let inside = |w: &Self| addr >= w.start && addr + 8 <= w.start + w.len as u64;
        if !inside(self) {
            let start = addr & !7;
            let len = Self::SIZE.min(hi.saturating_sub(start) as usize);
            self.len = read_own_memory_paged(start, &mut self.bytes[..len]);
            self.start = start;
            if !inside(self) {
                return Err(());
            }
        }
        let at = (addr - self.start) as usize;
        // SAFETY: `at + 8 <= len`, and the kernel wrote the first `len` bytes.
        let w = unsafe { ptr::read_unaligned(self.bytes.as_ptr().add(at).cast::<u64>()) };
        Ok(w)
    }
}

/// The spare stack of `pool` holding `sp`, as the range (sp, top). Async-signal-safe.
pub(super) fn spare_stack_of(pool: &[PoolEntry], sp: u64) -> Option<(u64, u64)> {
    pool.iter().find_map(|e| {
        let top = e.stack_top as u64;
        (top != 0 && sp < top && sp >= top - SPARE_STACK_BYTES as u64).then_some((sp, top))
    })
}

/// Maps one spare stack with a guard page below it; its top, or 0 on failure.
pub(super) fn map_spare_stack() -> usize {
    // SAFETY: sysconf has no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
        .ok()
        .filter(|&p| p > 0)
        .unwrap_or(4096);
    let len = SPARE_STACK_BYTES + page;
    // SAFETY: a fresh anonymous private mapping; nothing else refers to it.
    let p = unsafe {
        libc::mmap(
            ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_STACK,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return 0;
    }
    // SAFETY: the first page of the mapping we own: an overflow faults there instead of
    // writing into whatever lies below.
    if unsafe { libc::mprotect(p, page, libc::PROT_NONE) } != 0 {
        // SAFETY: our own mapping, unused.
        unsafe { libc::munmap(p, len) };
        return 0;
    }
    (p as usize + len) & !15
}

/// Allocates the unwinder cache pool once (never freed: handlers may hold an entry at any time).
pub(crate) fn init_pool() {
    if !HOT.pool.load(Ordering::SeqCst).is_null() {
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
            stack_top: map_spare_stack(),
            frames: UnsafeCell::new([0; MAX_FRAMES]),
        })
        .collect();
    let raw = Box::into_raw(Box::new(entries));
    if HOT
        .pool
        .compare_exchange(ptr::null_mut(), raw, Ordering::SeqCst, Ordering::SeqCst)
        .is_err()
    {
        // SAFETY: we lost the race; `raw` was never published.
        // Its spare stacks stay mapped (a few hundred KiB of address space, never touched):
        // this race happens at most once per process.
        drop(unsafe { Box::from_raw(raw) });
    }
}

/// Whether [`Spare::run`] switches stacks here (elsewhere it runs in place, and the paths need
/// the in-place room).
pub(super) const SWITCHES_STACKS: bool = cfg!(target_arch = "x86_64");

/// Stack a path that switches to a spare stack may still use on the thread's own stack after
/// its headroom check (measured by `tests/small_stack.rs` for both paths, with room to spare).
pub(super) const SWITCHED_STACK_NEED: u64 = if !SWITCHES_STACKS {
    IN_PLACE_STACK_NEED
} else if cfg!(debug_assertions) {
    2048
} else {
    512
};
/// Stack a signal handler may still use on the thread's stack after its headroom check, when
/// its walk runs on a spare stack (the rest of `handle`, `Spare::run`).
pub(crate) const HANDLER_STACK_NEED: u64 = SWITCHED_STACK_NEED;
/// Stack a sampled allocation may still use on the thread's stack after its headroom check,
/// when it walks and records on a spare stack.
pub(crate) const ALLOC_STACK_NEED: u64 = SWITCHED_STACK_NEED;
/// Stack a walk (framehop's CFI evaluation) and recording use when they run on the thread's
/// own stack: no spare stack free, or no stack switch on this architecture.
pub(crate) const IN_PLACE_STACK_NEED: u64 = 96 << 10;

/// Samples skipped because the thread's stack had less headroom than the path needs.
pub(super) static SKIPPED_LOW_STACK: AtomicU64 = AtomicU64::new(0);
/// Signal samples skipped because the thread's stack bounds were not known yet (a thread
/// newer than the snapshot that never made a sampled allocation).
pub(super) static SKIPPED_UNKNOWN_STACK: AtomicU64 = AtomicU64::new(0);

/// Counts a sample skipped for lack of stack. Async-signal-safe.
pub(crate) fn count_skipped_low_stack() {
    SKIPPED_LOW_STACK.fetch_add(1, Ordering::Relaxed);
}

/// Counts a sample skipped for unknown stack bounds. Async-signal-safe.
pub(crate) fn count_skipped_unknown_stack() {
    SKIPPED_UNKNOWN_STACK.fetch_add(1, Ordering::Relaxed);
}

/// Samples skipped for lack of stack in this process so far.
pub(crate) fn skipped_low_stack() -> u64 {
    SKIPPED_LOW_STACK.load(Ordering::Relaxed)
}

/// Samples skipped for unknown stack bounds in this process so far.
pub(crate) fn skipped_unknown_stack() -> u64 {
    SKIPPED_UNKNOWN_STACK.load(Ordering::Relaxed)
}

/// Bytes of stack left below `sp` (the caller's stack pointer), from `bounds` (the thread's
/// stack, when known and containing `sp`) or else the snapshot's mapping containing `sp`;
/// None when neither knows (a stack newer than the snapshot: a refresh is requested).
/// Async-signal-safe.
pub(crate) fn headroom(sp: u64, bounds: Option<(usize, usize)>) -> Option<u64> {
    if let Some((lo, hi)) = bounds {
        if lo as u64 <= sp && sp < hi as u64 {
            return Some(sp - lo as u64);
        }
    }
    let _reader = ReaderGuard::enter();
    let snap = HOT.snapshot.load(Ordering::SeqCst);
    if snap.is_null() {
        return None;
    }
    // SAFETY: a published snapshot stays alive while READERS counts us.
    let floor = unsafe { &*snap }.stack_floor_of(sp);
    if floor.is_none() {
        MAPS_STALE.store(true, Ordering::Relaxed);
    }
    floor.map(|f| sp.saturating_sub(f))
}

/// For a stack whose bounds nobody knows yet (a thread newer than the snapshot): `need` when
/// the `need` bytes below `sp` are readable, 0 when they are not, None when the kernel would
/// not say. Asks the kernel to read the lowest word of the range (`process_vm_readv` on our
/// own process fails with EFAULT instead of faulting); a guard page, at least a page below any
/// stack, cannot hide between it and `sp` when `need` is under a page. Async-signal-safe.
pub(crate) fn probe_room(sp: u64, need: u64) -> Option<u64> {
    if need >= 4096 {
        return None;
    }
    let Some(addr) = sp.checked_sub(need) else {
        return Some(0);
    };
    if read_own_memory(addr, &mut [0u8; 8]) == 8 {
        return Some(need);
    }
    // SAFETY: errno is thread-local (the handler restores it).
    match unsafe { *libc::__errno_location() } {
        libc::EFAULT => Some(0),
        _ => None,
    }
}

/// A pool entry held by the caller: an unwinder cache and a spare stack to run on.
pub(crate) struct Spare {
    pub(super) entry: &'static PoolEntry,
}

impl Spare {
    /// Takes a free entry that has a spare stack, without waiting. Async-signal-safe.
    pub(crate) fn borrow() -> Option<Spare> {
        let pool = HOT.pool.load(Ordering::SeqCst);
        if pool.is_null() {
            return None;
        }
        // SAFETY: the pool is never freed once published.
        let pool: &'static [PoolEntry] = unsafe { &*pool };
        pool.iter()
            .find(|e| {
                e.stack_top != 0
                    && e.busy
                        .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                        .is_ok()
            })
            .map(|entry| Spare { entry })
    }

    pub(super) fn cache(&mut self) -> &mut NativeCache {
        // SAFETY: we hold the entry's `busy` flag until drop; `&mut self` makes the borrow
        // exclusive within this holder.
        unsafe { &mut *self.entry.cache.get() }
    }

    /// The unwinder cache and the frame buffer, both the holder's until drop.
    pub(super) fn cache_and_frames(&mut self) -> (&mut NativeCache, &mut [u64; MAX_FRAMES]) {
        // SAFETY: as in `cache`; the two cells are distinct fields, so the borrows do not
        // overlap.
        unsafe { (&mut *self.entry.cache.get(), &mut *self.entry.frames.get()) }
    }

    /// Runs `f` on this entry's spare stack (x86_64; in place elsewhere), so that what `f`
    /// needs never comes out of the calling thread's stack. Async-signal-safe (a stack switch
    /// and a call). `f` must not unwind (a panic in it aborts).
    #[inline(never)]
    pub(crate) fn run<R, F: FnOnce(&mut Spare) -> R>(&mut self, f: F) -> Option<R> {
        #[cfg(target_arch = "x86_64")]
        {
            struct Job<'a, F, R> {
                f: Option<F>,
                out: Option<R>,
                spare: &'a mut Spare,
            }
            unsafe extern "C" fn trampoline<F: FnOnce(&mut Spare) -> R, R>(job: *mut u8) {
                // SAFETY: `job` is the live `Job` that `run` passed, used by nothing else
                // until this returns.
                let job = unsafe { &mut *(job as *mut Job<'_, F, R>) };
                if let Some(f) = job.f.take() {
                    job.out = Some(f(job.spare));
                }
            }
            let top = self.entry.stack_top;
            let mut job = Job {
                f: Some(f),
                out: None,
                spare: self,
            };
            // SAFETY: `top` is the 16-byte aligned top of a mapped stack that only the holder
            // of this entry uses (we do, through `&mut self`). The call pushes its return
            // address there (so the callee starts 8 below a 16-byte boundary, as the ABI
            // wants); r12 is callee-saved, so it still holds our stack pointer on return;
            // `clobber_abi("C")` covers everything the callee may change.
            unsafe {
                std::arch::asm!(
                    "mov r12, rsp",
                    "mov rsp, {top}",
                    "call {f}",
                    "mov rsp, r12",
                    top = in(reg) top,
                    f = in(reg) trampoline::<F, R> as unsafe extern "C" fn(*mut u8),
                    in("rdi") &mut job as *mut Job<'_, F, R> as *mut u8,
                    out("r12") _,
                    clobber_abi("C"),
                );
            }
            job.out
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            Some(f(self))
        }
    }
}

impl Drop for Spare {
    fn drop(&mut self) {
        self.entry.busy.store(false, Ordering::Release);
    }
}
