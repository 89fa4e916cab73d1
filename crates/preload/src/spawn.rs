//! `posix_spawn` and `posix_spawnp`, interposed: glibc starts their child with its internal
//! `execve`, which no library can interpose, so a child given an environment without
//! `LD_PRELOAD` (Rust's `Command::env_clear`, Python's `subprocess` with `env=`) would run
//! unprofiled. They call glibc's with the environment fixed up as the exec hooks do it
//! ([`crate::exec::with_env`]). They run in the parent: nothing to write first, the parent's
//! profile goes on.
//!
//! glibc's functions are found with `dlsym(RTLD_NEXT, ...)` at load, as the exec hooks' are.

use std::ffi::{c_char, c_int, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};

use libc::{pid_t, posix_spawn_file_actions_t, posix_spawnattr_t};

use crate::exec::{with_env, Argv, Envp};

const SPAWN: usize = 0;
const SPAWNP: usize = 1;
const NAMES: [&CStr; 2] = [c"posix_spawn", c"posix_spawnp"];
/// glibc's functions, by the indices above (0: not found).
static REAL: [AtomicUsize; 2] = [const { AtomicUsize::new(0) }; 2];

/// At load (`dlsym` may allocate and take the loader's lock).
pub(crate) fn init() {
    for (slot, name) in REAL.iter().zip(NAMES) {
        crate::hooks::next_symbol(slot, name);
    }
}

type SpawnFn = unsafe extern "C" fn(
    *mut pid_t,
    *const c_char,
    *const posix_spawn_file_actions_t,
    *const posix_spawnattr_t,
    Argv,
    Envp,
) -> c_int;

/// Calls glibc's `posix_spawn` (`which` SPAWN) or `posix_spawnp` (SPAWNP) with `envp` fixed
/// up. An error number, as they return.
///
/// # Safety
/// The C `posix_spawn` contract.
unsafe fn spawn(
    which: usize,
    pid: *mut pid_t,
    path: *const c_char,
    actions: *const posix_spawn_file_actions_t,
    attr: *const posix_spawnattr_t,
    argv: Argv,
    envp: Envp,
) -> c_int {
    let f = REAL[which].load(Ordering::Acquire);
    if f == 0 {
        return libc::ENOSYS;
    }
    // SAFETY: `f` is glibc's posix_spawn or posix_spawnp, of this signature.
    let real = unsafe { std::mem::transmute::<usize, SpawnFn>(f) };
    // SAFETY: forwarded contract; the fixed-up copy lives until glibc's function returns,
    // by when the child has exec'd (glibc waits for that) or failed.
    unsafe { with_env(envp, |env| real(pid, path, actions, attr, argv, env)) }
}

/// # Safety
/// The C `posix_spawn` contract.
#[no_mangle]
pub unsafe extern "C" fn posix_spawn(
    pid: *mut pid_t,
    path: *const c_char,
    actions: *const posix_spawn_file_actions_t,
    attr: *const posix_spawnattr_t,
    argv: Argv,
    envp: Envp,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe { spawn(SPAWN, pid, path, actions, attr, argv, envp) }
}

/// # Safety
/// The C `posix_spawnp` contract.
#[no_mangle]
pub unsafe extern "C" fn posix_spawnp(
    pid: *mut pid_t,
    file: *const c_char,
    actions: *const posix_spawn_file_actions_t,
    attr: *const posix_spawnattr_t,
    argv: Argv,
    envp: Envp,
) -> c_int {
    // SAFETY: forwarded contract.
    unsafe { spawn(SPAWNP, pid, file, actions, attr, argv, envp) }
}
