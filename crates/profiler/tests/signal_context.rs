//! `__in_signal_handler`, which the preload library's `_exit` asks before it writes a profile:
//! no in ordinary code, yes inside a handler (on the thread's stack or an alternate one).

mod profiler_support;

use std::sync::atomic::{AtomicU8, Ordering};

use profiler_support::*;

/// What the handler saw: 0 none yet, 1 `None`, 2 `Some(false)`, 3 `Some(true)`.
static SEEN: AtomicU8 = AtomicU8::new(0);

fn code(v: Option<bool>) -> u8 {
    match v {
        None => 1,
        Some(false) => 2,
        Some(true) => 3,
    }
}

extern "C" fn handler(_: libc::c_int) {
    SEEN.store(
        code(ferroprof::internals::__in_signal_handler()),
        Ordering::SeqCst,
    );
}

fn seen_in_handler(on_alt_stack: bool) -> u8 {
    SEEN.store(0, Ordering::SeqCst);
    // SAFETY: installs a handler of the right type for SIGUSR1 (nothing else in this test
    // binary uses it) and raises it on this thread.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = handler as *const () as usize;
        sa.sa_flags = if on_alt_stack { libc::SA_ONSTACK } else { 0 };
        libc::sigemptyset(&mut sa.sa_mask);
        assert_eq!(libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut()), 0);
        libc::raise(libc::SIGUSR1);
    }
    SEEN.load(Ordering::SeqCst)
}

#[test]
fn a_handler_is_told_apart_from_ordinary_code() {
    let c = Collect::default();
    let guard = start_cpu_wall("signal-context", 100, &c);
    assert_eq!(
        code(ferroprof::internals::__in_signal_handler()),
        2,
        "ordinary code"
    );
    assert_eq!(seen_in_handler(false), 3, "a handler on the thread's stack");

    // A small alternate signal stack, as crash handlers use.
    let mut alt = vec![0u8; 64 << 10];
    // SAFETY: `alt` outlives its use as this thread's alternate stack, removed below.
    unsafe {
        let ss = libc::stack_t {
            ss_sp: alt.as_mut_ptr().cast(),
            ss_flags: 0,
            ss_size: alt.len(),
        };
        assert_eq!(libc::sigaltstack(&ss, std::ptr::null_mut()), 0);
    }
    let on_alt = seen_in_handler(true);
    // SAFETY: disables the alternate stack before `alt` is dropped.
    unsafe {
        let off = libc::stack_t {
            ss_sp: std::ptr::null_mut(),
            ss_flags: libc::SS_DISABLE,
            ss_size: 0,
        };
        libc::sigaltstack(&off, std::ptr::null_mut());
    }
    drop(alt);
    println!("on an alternate stack: {on_alt} (1 unknown, 3 a handler)");
    // On an alternate stack the walk may not get past the handler: never "not a handler".
    assert_ne!(
        on_alt, 2,
        "a handler on an alternate stack taken for ordinary code"
    );
    assert_ne!(on_alt, 0, "the handler did not run");
    guard.stop().expect("stops");
}
