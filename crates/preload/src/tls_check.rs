//! The load-time check that this library's thread-locals live in the static TLS block.
//!
//! ferroprof reads its per-thread state in the malloc hook and in the sampling signal handler.
//! Stable Rust compiles a shared library's thread-locals with the general-dynamic TLS model
//! (every access goes through `__tls_get_addr`); that access allocates nothing and is
//! async-signal-safe only when the loader placed the library's TLS block in the static TLS
//! area, which glibc does for every library loaded at startup (`LD_PRELOAD`, `DT_NEEDED`) and
//! never guarantees for one loaded later with `dlopen` (its block is then allocated with
//! `malloc`, on first access, from whichever thread touches it). So: is the block of one of our
//! thread-locals where static TLS is, next to the thread pointer?

use std::cell::Cell;

thread_local! {
    static PROBE: Cell<u8> = const { Cell::new(0) };
}

/// Ok when this thread's block of our TLS is in the static TLS area.
pub(crate) fn check() -> Result<(), String> {
    let addr = PROBE.with(|p| p as *const Cell<u8> as usize);
    let tp = thread_pointer();
    let size = static_tls_size();
    // x86_64 (TLS variant II): the static blocks lie just below the thread pointer.
    #[cfg(target_arch = "x86_64")]
    let inside = addr < tp && tp - addr <= size;
    // aarch64 (variant I): just above it, after the 16-byte TCB.
    #[cfg(target_arch = "aarch64")]
    let inside = addr >= tp && addr - tp <= size;
    if inside {
        Ok(())
    } else {
        Err(format!(
            "the library's thread-local storage is not in the static TLS block (at {addr:#x}, \
             thread pointer {tp:#x}, static TLS {size} bytes): it must be loaded at startup \
             with LD_PRELOAD, not with dlopen"
        ))
    }
}

fn thread_pointer() -> usize {
    let tp: usize;
    #[cfg(target_arch = "x86_64")]
    // SAFETY: reads the TCB's self-pointer at %fs:0 (glibc's thread pointer); no side effect.
    unsafe {
        std::arch::asm!("mov {}, fs:0", out(reg) tp, options(nostack, readonly, preserves_flags));
    }
    #[cfg(target_arch = "aarch64")]
    // SAFETY: reads the thread pointer register; no side effect.
    unsafe {
        std::arch::asm!("mrs {}, tpidr_el0", out(reg) tp, options(nomem, nostack, preserves_flags));
    }
    tp
}

/// The static TLS area's size, from glibc (`_dl_get_tls_static_info`, the call sanitizers use
/// for the same purpose); 1 MiB when it cannot be asked.
fn static_tls_size() -> usize {
    type Info = unsafe extern "C" fn(*mut usize, *mut usize);
    // SAFETY: a symbol lookup with a NUL-terminated name.
    let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"_dl_get_tls_static_info".as_ptr()) };
    if f.is_null() {
        return 1 << 20;
    }
    // SAFETY: glibc's function of this signature (two out-parameters: size and alignment).
    let info: Info = unsafe { std::mem::transmute::<*mut libc::c_void, Info>(f) };
    let (mut size, mut align) = (0usize, 0usize);
    // SAFETY: both out-pointers are valid locals.
    unsafe { info(&mut size, &mut align) };
    if size == 0 {
        1 << 20
    } else {
        size
    }
}
