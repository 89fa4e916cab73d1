//! x86_64 register and instruction access for the unwinder: the registers a walk starts from,
//! the thread pointer's stack bound, the signal trampoline, call instructions and prefetching.

use super::frames::{read_own_memory, StartRegs};

/// Registers of the calling function's frame, for unwinding from normal (non-signal) code.
#[inline(always)]
pub(crate) fn current_regs() -> StartRegs {
    let pc: u64;
    let sp: u64;
    let fp: u64;
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
    }
    StartRegs { pc, sp, fp, lr: 0 }
}

/// The current stack pointer.
#[inline(always)]
pub(crate) fn current_sp() -> u64 {
    let sp: u64;
    // SAFETY: reads rsp; touches no memory.
    unsafe {
        std::arch::asm!("mov {}, rsp", out(reg) sp, options(nomem, nostack, preserves_flags));
    }
    sp
}

/// Registers of the interrupted context of a signal handler.
///
/// # Safety
/// `ucontext` must be the third argument of an `SA_SIGINFO` handler.
pub(crate) unsafe fn regs_from_ucontext(ucontext: *const libc::c_void) -> StartRegs {
    // SAFETY: the kernel passes a valid ucontext_t to SA_SIGINFO handlers.
    let uc = unsafe { &*(ucontext as *const libc::ucontext_t) };
    let g = &uc.uc_mcontext.gregs;
    StartRegs {
        pc: g[libc::REG_RIP as usize] as u64,
        sp: g[libc::REG_RSP as usize] as u64,
        fp: g[libc::REG_RBP as usize] as u64,
        lr: 0,
    }
}

/// Stack bound for a thread created after the last maps snapshot: glibc places a thread's
/// control block (what `%fs:0` points to, per the x86_64 TLS ABI) at the top of the same
/// mapping as its stack, so `[sp, tp)` is mapped. Not when `sp` is on an alternate signal stack
/// (a different mapping), nor for the main thread (its control block is elsewhere, below).
pub(super) fn thread_pointer_bound(sp: u64) -> Option<(u64, u64)> {
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

/// The restorer glibc gives the kernel with a handler (`SA_RESTORER`), read back from the
/// kernel for the first signal that has one.
pub(super) fn signal_restorer() -> Option<u64> {
    /// The kernel's `struct sigaction` on x86_64.
    #[repr(C)]
    struct KernelSigaction {
        handler: u64,
        flags: u64,
        restorer: u64,
        mask: u64,
    }
    const SA_RESTORER: u64 = 0x0400_0000;
    (1..=64).find_map(|sig: libc::c_long| {
        let mut k = KernelSigaction {
            handler: 0,
            flags: 0,
            restorer: 0,
            mask: 0,
        };
        // SAFETY: rt_sigaction with no new action only writes the current one into `k`, a
        // struct of the kernel's layout; the size argument is the kernel's sigset size.
        let r = unsafe {
            libc::syscall(
                libc::SYS_rt_sigaction,
                sig,
                std::ptr::null::<KernelSigaction>(),
                &mut k as *mut KernelSigaction,
                8usize,
            )
        };
        (r == 0 && k.flags & SA_RESTORER != 0 && k.restorer != 0).then_some(k.restorer)
    })
}

/// Whether the bytes before `ret` end with a call: `call rel32`, or `call r/m64` (opcode FF /2)
/// with its register, displacement and SIB forms. Read with `process_vm_readv`: the code may be
/// unmapped meanwhile.
pub(super) fn follows_a_call(ret: u64) -> bool {
    let mut b = [0u8; 7];
    let Some(from) = ret.checked_sub(7) else {
        return false;
    };
    if read_own_memory(from, &mut b) != b.len() {
        return false;
    }
    // b[7 - k] is the byte k before `ret`.
    let at = |k: usize| b[7 - k];
    let ff2 = |k: usize| at(k) == 0xff && at(k - 1) & 0x38 == 0x10;
    at(5) == 0xe8 || (ff2(2) && at(1) & 0xc0 == 0xc0) || ff2(3) || ff2(4) || ff2(6) || ff2(7)
}

/// How much of the stack above `sp` a walk prefetches: a handler finds the stack cold, and a walk
/// reads it as a chain of dependent loads (each frame's position comes from the previous one),
/// so without prefetching every cache miss is paid one after the other. 4 KiB covers a typical
/// walk; 8 KiB measured slower (its extra misses compete with the walk's own), 2 KiB no better.
const PREFETCH_BYTES: u64 = 4096;

/// Asks the CPU to fetch `[lo, min(hi, lo + PREFETCH_BYTES))` into the cache, all at once.
#[inline]
pub(super) fn prefetch_stack(lo: u64, hi: u64) {
    let end = hi.min(lo.saturating_add(PREFETCH_BYTES));
    let mut line = lo & !63;
    while line < end {
        // SAFETY: a prefetch is a hint: it never faults nor changes memory, whatever the
        // address (this one lies in the stack mapping anyway).
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(line as *const i8)
        };
        line += 64;
    }
}
