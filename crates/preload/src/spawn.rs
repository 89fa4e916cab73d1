//! `posix_spawn`, `posix_spawnp`, `system`, `popen` and `pclose`, interposed: glibc starts
//! their child with its internal `execve`, which no library can interpose, so a child given an
//! environment without `LD_PRELOAD` (Rust's `Command::env_clear`, Python's `subprocess` with
//! `env=`, a program that cleared its own) would run unprofiled.
//!
//! * `posix_spawn` and `posix_spawnp` call glibc's with the environment fixed up as the exec
//!   hooks do it ([`crate::exec::with_env`]). They run in the parent: nothing to write first,
//!   the parent's profile goes on.
//! * `system` and `popen` use the process's `environ`. When it carries the library and the
//!   settings, glibc's own run. When not, they are done here as glibc 2.36 does them
//!   (sysdeps/posix/system.c, libio/iopopen.c), through glibc's `posix_spawn` with the fixed
//!   environment: `/bin/sh -c -- COMMAND` (the `--` of later glibc versions: a command may start
//!   with `-`); `system` ignores `SIGINT` and `SIGQUIT` and blocks `SIGCHLD` while it waits, and
//!   the child starts with the caller's mask and those signals at their default (unless they
//!   were ignored); `popen`'s child closes the streams of earlier `popen` calls made here, and
//!   `pclose` waits for the child of a stream made here (other streams go to glibc's `pclose`).
//!
//! glibc's functions are found with `dlsym(RTLD_NEXT, ...)` at load, as the exec hooks' are.

use std::ffi::{c_char, c_int, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};

use libc::{pid_t, posix_spawn_file_actions_t, posix_spawnattr_t, FILE};

use crate::exec::{needs_fixup, with_env, Argv, Envp};
use crate::forksafe::ForkSafeLock;

extern "C" {
    static environ: Envp;
}

const SPAWN: usize = 0;
const SPAWNP: usize = 1;
const SYSTEM: usize = 2;
const POPEN: usize = 3;
const PCLOSE: usize = 4;
const NAMES: [&CStr; 5] = [
    c"posix_spawn",
    c"posix_spawnp",
    c"system",
    c"popen",
    c"pclose",
];
/// glibc's functions, by the indices above (0: not found).
static REAL: [AtomicUsize; 5] = [const { AtomicUsize::new(0) }; 5];

/// At load (`dlsym` may allocate and take the loader's lock).
pub(crate) fn init() {
    for (slot, name) in REAL.iter().zip(NAMES) {
        crate::hooks::next_symbol(slot, name);
    }
    // SAFETY: registers plain extern "C" functions, valid for ever.
    unsafe { libc::pthread_atfork(Some(before_fork), Some(after_fork), Some(after_fork)) };
}

/// No thread holds the locks below when the child is made (see `forksafe`): a child's
/// `pclose` or `system` never waits on one.
extern "C" fn before_fork() {
    IGNORING.hold_for_fork();
    POPENED.hold_for_fork();
}

extern "C" fn after_fork() {
    POPENED.release_after_fork();
    IGNORING.release_after_fork();
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

/// Whether `system` and `popen` must start the shell here: the process's environment lacks
/// the library or a setting.
fn environ_needs_fixup() -> bool {
    // SAFETY: `environ` is the process's environment, a null-terminated array of C strings.
    unsafe { needs_fixup(environ) }
}

/// Spawns `/bin/sh -c -- command` with the process's environment fixed up; an error number.
///
/// # Safety
/// `command` is a C string; `actions` and `attr` null or initialized.
unsafe fn spawn_shell(
    pid: &mut pid_t,
    command: *const c_char,
    actions: *const posix_spawn_file_actions_t,
    attr: *const posix_spawnattr_t,
) -> c_int {
    let argv: [*const c_char; 5] = [
        c"sh".as_ptr(),
        c"-c".as_ptr(),
        c"--".as_ptr(),
        command,
        std::ptr::null(),
    ];
    // SAFETY: a null-terminated argv of C strings; the rest per the caller's contract.
    unsafe {
        spawn(
            SPAWN,
            pid,
            c"/bin/sh".as_ptr(),
            actions,
            attr,
            argv.as_ptr(),
            environ,
        )
    }
}

/// Waits for `pid`, through interruptions; its status, or -1.
fn wait_for(pid: pid_t) -> c_int {
    let mut status = 0;
    loop {
        // SAFETY: waitpid writes the status into a local.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        // SAFETY: errno is this thread's.
        if r == -1 && unsafe { *libc::__errno_location() } == libc::EINTR {
            continue;
        }
        return if r == pid { status } else { -1 };
    }
}

/// `system`'s saved dispositions of `SIGINT` and `SIGQUIT`, and how many `system` calls are
/// under way: the first ignores the signals, the last puts them back (as glibc counts).
struct Ignoring {
    calls: usize,
    intr: libc::sigaction,
    quit: libc::sigaction,
}

// SAFETY: plain data (handler addresses and masks), touched only under the lock.
unsafe impl Send for Ignoring {}

static IGNORING: ForkSafeLock<Option<Ignoring>> = ForkSafeLock::new(None);

/// The saved dispositions, after ignoring the signals if no other call has.
fn ignore_interrupts() -> (libc::sigaction, libc::sigaction) {
    let mut g = IGNORING.lock();
    if let Some(i) = g.as_mut() {
        i.calls += 1;
        return (i.intr, i.quit);
    }
    // SAFETY: sigaction structs are plain C data (all-zero is valid); sigaction writes the
    // old dispositions into locals.
    let (intr, quit) = unsafe {
        let mut ign: libc::sigaction = std::mem::zeroed();
        ign.sa_sigaction = libc::SIG_IGN;
        libc::sigemptyset(&mut ign.sa_mask);
        let mut intr: libc::sigaction = std::mem::zeroed();
        let mut quit: libc::sigaction = std::mem::zeroed();
        libc::sigaction(libc::SIGINT, &ign, &mut intr);
        libc::sigaction(libc::SIGQUIT, &ign, &mut quit);
        (intr, quit)
    };
    *g = Some(Ignoring {
        calls: 1,
        intr,
        quit,
    });
    (intr, quit)
}

/// One `system` call done: the last puts the dispositions back.
fn restore_interrupts() {
    let mut g = IGNORING.lock();
    let last = g.as_mut().is_some_and(|i| {
        i.calls -= 1;
        i.calls == 0
    });
    if last {
        if let Some(i) = g.take() {
            // SAFETY: restores dispositions sigaction returned earlier.
            unsafe {
                libc::sigaction(libc::SIGINT, &i.intr, std::ptr::null_mut());
                libc::sigaction(libc::SIGQUIT, &i.quit, std::ptr::null_mut());
            }
        }
    }
}

/// glibc's `system`, with the environment fixed up (see the module's comment).
///
/// # Safety
/// `line` is a C string.
unsafe fn system_here(line: *const c_char) -> c_int {
    let (intr, quit) = ignore_interrupts();
    // SAFETY: signal sets and spawn attributes are C data initialized by their functions
    // before use and destroyed after; the mask calls change this thread's mask only.
    unsafe {
        let mut chld: libc::sigset_t = std::mem::zeroed();
        let mut omask: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut chld);
        libc::sigaddset(&mut chld, libc::SIGCHLD);
        if libc::pthread_sigmask(libc::SIG_BLOCK, &chld, &mut omask) != 0 {
            restore_interrupts();
            return -1;
        }
        // The child gets the caller's own mask and the signals ignored here at their default,
        // unless the caller ignored them itself.
        let mut reset: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut reset);
        if intr.sa_sigaction != libc::SIG_IGN {
            libc::sigaddset(&mut reset, libc::SIGINT);
        }
        if quit.sa_sigaction != libc::SIG_IGN {
            libc::sigaddset(&mut reset, libc::SIGQUIT);
        }
        let mut attr: posix_spawnattr_t = std::mem::zeroed();
        libc::posix_spawnattr_init(&mut attr);
        libc::posix_spawnattr_setsigmask(&mut attr, &omask);
        libc::posix_spawnattr_setsigdefault(&mut attr, &reset);
        libc::posix_spawnattr_setflags(
            &mut attr,
            (libc::POSIX_SPAWN_SETSIGDEF | libc::POSIX_SPAWN_SETSIGMASK) as libc::c_short,
        );
        let mut pid = 0;
        let ret = spawn_shell(&mut pid, line, std::ptr::null(), &attr);
        libc::posix_spawnattr_destroy(&mut attr);
        // POSIX: a shell that cannot run reads as one that ended with _exit(127).
        let status = if ret == 0 { wait_for(pid) } else { 127 << 8 };
        restore_interrupts();
        libc::pthread_sigmask(libc::SIG_SETMASK, &omask, std::ptr::null_mut());
        if ret != 0 {
            *libc::__errno_location() = ret;
        }
        status
    }
}

/// # Safety
/// The C `system` contract.
#[no_mangle]
pub unsafe extern "C" fn system(line: *const c_char) -> c_int {
    let real = REAL[SYSTEM].load(Ordering::Acquire);
    // A null line only asks whether there is a shell: glibc's answer.
    if real != 0 && (line.is_null() || !environ_needs_fixup()) {
        // SAFETY: `real` is glibc's system, of this signature; forwarded contract.
        return unsafe {
            std::mem::transmute::<usize, unsafe extern "C" fn(*const c_char) -> c_int>(real)(line)
        };
    }
    if line.is_null() {
        return 1;
    }
    // SAFETY: forwarded contract.
    unsafe { system_here(line) }
}

/// A stream `popen` made here: its `FILE`, descriptor and child.
struct Popened {
    file: usize,
    fd: c_int,
    pid: pid_t,
}

/// The streams `popen` made here and `pclose` has not closed yet (POSIX: a `popen` child
/// closes those of the earlier calls; `pclose` waits for its stream's child).
static POPENED: ForkSafeLock<Vec<Popened>> = ForkSafeLock::new(Vec::new());

/// glibc's `popen`, with the environment fixed up (see the module's comment).
///
/// # Safety
/// `command` and `mode` are C strings.
unsafe fn popen_here(command: *const c_char, mode: *const c_char) -> *mut FILE {
    let set_errno = |e| {
        // SAFETY: errno is this thread's.
        unsafe { *libc::__errno_location() = e };
    };
    let (mut read, mut write, mut cloexec) = (false, false, false);
    // SAFETY: `mode` is a C string (the caller's contract).
    for &c in unsafe { CStr::from_ptr(mode) }.to_bytes() {
        match c {
            b'r' => read = true,
            b'w' => write = true,
            b'e' => cloexec = true,
            _ => {
                set_errno(libc::EINVAL);
                return std::ptr::null_mut();
            }
        }
    }
    if read == write {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    let mut fds = [0; 2];
    // SAFETY: pipe2 writes two descriptors into `fds`; both ends close-on-exec, so no other
    // child started meanwhile inherits them.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return std::ptr::null_mut();
    }
    let (parent_end, mut child_end) = if read {
        (fds[0], fds[1])
    } else {
        (fds[1], fds[0])
    };
    let child_fd = if read { 1 } else { 0 };
    let mut streams = POPENED.lock();
    // SAFETY: descriptor and file-action calls on descriptors and actions of our own; the
    // actions are initialized before use and destroyed after.
    unsafe {
        if child_end == child_fd {
            // dup2 onto itself would keep close-on-exec: moved to another number first.
            let moved = libc::fcntl(child_end, libc::F_DUPFD_CLOEXEC, 0);
            libc::close(child_end);
            if moved < 0 {
                let e = *libc::__errno_location();
                libc::close(parent_end);
                set_errno(e);
                return std::ptr::null_mut();
            }
            child_end = moved;
        }
        let mut actions: posix_spawn_file_actions_t = std::mem::zeroed();
        libc::posix_spawn_file_actions_init(&mut actions);
        let mut ret = libc::posix_spawn_file_actions_adddup2(&mut actions, child_end, child_fd);
        for s in streams.iter().filter(|s| s.fd != child_fd) {
            if ret == 0 {
                ret = libc::posix_spawn_file_actions_addclose(&mut actions, s.fd);
            }
        }
        let mut pid = 0;
        if ret == 0 {
            ret = spawn_shell(&mut pid, command, &actions, std::ptr::null());
        }
        libc::posix_spawn_file_actions_destroy(&mut actions);
        libc::close(child_end);
        if ret != 0 {
            libc::close(parent_end);
            set_errno(ret);
            return std::ptr::null_mut();
        }
        if !cloexec {
            libc::fcntl(parent_end, libc::F_SETFD, 0);
        }
        let file = libc::fdopen(parent_end, if read { c"r" } else { c"w" }.as_ptr());
        if file.is_null() {
            let e = *libc::__errno_location();
            libc::close(parent_end);
            wait_for(pid);
            set_errno(e);
            return std::ptr::null_mut();
        }
        streams.push(Popened {
            file: file as usize,
            fd: parent_end,
            pid,
        });
        file
    }
}

/// # Safety
/// The C `popen` contract.
#[no_mangle]
pub unsafe extern "C" fn popen(command: *const c_char, mode: *const c_char) -> *mut FILE {
    type F = unsafe extern "C" fn(*const c_char, *const c_char) -> *mut FILE;
    let real = REAL[POPEN].load(Ordering::Acquire);
    if real != 0 && !environ_needs_fixup() {
        // SAFETY: `real` is glibc's popen, of this signature; forwarded contract.
        return unsafe { std::mem::transmute::<usize, F>(real)(command, mode) };
    }
    // SAFETY: forwarded contract.
    unsafe { popen_here(command, mode) }
}

/// # Safety
/// The C `pclose` contract.
#[no_mangle]
pub unsafe extern "C" fn pclose(file: *mut FILE) -> c_int {
    let mine = {
        let mut streams = POPENED.lock();
        let at = streams.iter().position(|s| s.file == file as usize);
        at.map(|i| streams.swap_remove(i))
    };
    let Some(stream) = mine else {
        let real = REAL[PCLOSE].load(Ordering::Acquire);
        if real == 0 {
            // SAFETY: errno is this thread's.
            unsafe { *libc::__errno_location() = libc::ENOSYS };
            return -1;
        }
        // SAFETY: `real` is glibc's pclose, of this signature; forwarded contract.
        return unsafe {
            std::mem::transmute::<usize, unsafe extern "C" fn(*mut FILE) -> c_int>(real)(file)
        };
    };
    // The stream first (flushed, its descriptor closed: a reading child sees the end), then
    // the child.
    // SAFETY: a stream popen_here made, closed once (it left the list above).
    unsafe { libc::fclose(file) };
    wait_for(stream.pid)
}
