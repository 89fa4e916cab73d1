//! aarch64 register and instruction access for the unwinder: the registers a walk starts from
//! and call instructions. No thread-pointer stack bound, no signal trampoline lookup and no
//! prefetching here (they return "unknown" or do nothing).

use super::frames::{read_own_memory, StartRegs};

/// Registers of the calling function's frame, for unwinding from normal (non-signal) code.
#[inline(always)]
pub(crate) fn current_regs() -> StartRegs {
    let pc: u64;
    let sp: u64;
    let fp: u64;
    let lr: u64;
    // SAFETY: reads pc, sp, x29 and x30 into registers; touches no memory.
    unsafe {
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
    }
    StartRegs { pc, sp, fp, lr }
}

/// The current stack pointer.
#[inline(always)]
pub(crate) fn current_sp() -> u64 {
    let sp: u64;
    // SAFETY: reads sp; touches no memory.
    unsafe {
        std::arch::asm!("mov {}, sp", out(reg) sp, options(nomem, nostack, preserves_flags));
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
    let m = &uc.uc_mcontext;
    StartRegs {
        pc: m.pc,
        sp: m.sp,
        fp: m.regs[29],
        lr: m.regs[30],
    }
}

/// No stack bound from the thread pointer: callers fall back to the snapshot's mappings.
pub(super) fn thread_pointer_bound(_sp: u64) -> Option<(u64, u64)> {
    None
}

/// Not looked up here: "cannot tell" for `__in_signal_handler`.
pub(super) fn signal_restorer() -> Option<u64> {
    None
}

/// Whether the instruction before `ret` is a call: `bl`, `blr`, or a pointer-authenticating
/// `blraa`/`blrab`/`blraaz`/`blrabz`. Read with `process_vm_readv`: the code may be unmapped
/// meanwhile.
pub(super) fn follows_a_call(ret: u64) -> bool {
    let mut b = [0u8; 4];
    let Some(from) = ret.checked_sub(4) else {
        return false;
    };
    if read_own_memory(from, &mut b) != b.len() {
        return false;
    }
    let insn = u32::from_le_bytes(b);
    insn & 0xfc00_0000 == 0x9400_0000
        || insn & 0xffff_fc1f == 0xd63f_0000
        || insn & 0xfeff_f800 == 0xd63f_0800
}

/// No prefetching on this architecture.
#[inline]
pub(super) fn prefetch_stack(_lo: u64, _hi: u64) {}
