//! The `exec` family, interposed: `exec` replaces the image without running exit handlers, so
//! the profile of what the process did before it would be lost, and a program that passes its
//! own environment would start the new image unprofiled.
//!
//! Before calling glibc's function (found with `dlsym(RTLD_NEXT, ...)` at load: `dlsym` may
//! allocate and take the loader's lock, neither allowed after `fork`), each hook:
//! * writes the profile, when this process has one of its own: it started the profiler, or it
//!   is a forked child whose profiler threads started. Skipped in a forked child that has not
//!   (nothing recorded; most such children exec at once) and in a `vfork` child (it shares
//!   the parent's memory: stopping the parent's profiler there would stop the parent's);
//! * gives the new image an environment carrying `LD_PRELOAD` with this library and the
//!   `FERROPROF_*` settings this process was started with, when the one passed lacks them. That
//!   runs in forked children, maybe of a multithreaded parent: no heap, no lock; a stack
//!   buffer, or `mmap` for a large environment.
//!
//! An exec that returns failed: a profiler stopped for it starts again.
//! `execl`, `execlp` and `execle` (variadic, which stable Rust cannot define) are in
//! `exec_variadic.c`: they collect their arguments and call `execv`, `execvp` and `execve` here.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::sync::OnceLock;

pub(crate) type Argv = *const *const c_char;
pub(crate) type Envp = *const *const c_char;

extern "C" {
    static environ: Envp;
    // exec_variadic.c
    fn execl(path: *const c_char, arg0: *const c_char, ...) -> c_int;
    fn execlp(file: *const c_char, arg0: *const c_char, ...) -> c_int;
    fn execle(path: *const c_char, arg0: *const c_char, ...) -> c_int;
}

/// Keeps exec_variadic.c's object in the library: nothing else refers to it.
#[used]
static VARIADIC: [unsafe extern "C" fn(*const c_char, *const c_char, ...) -> c_int; 3] =
    [execl, execlp, execle];

const EXECVE: usize = 0;
const EXECVPE: usize = 1;
const FEXECVE: usize = 2;
const EXECVEAT: usize = 3;
const NAMES: [&CStr; 4] = [c"execve", c"execvpe", c"fexecve", c"execveat"];
/// glibc's functions, by the indices above (0: not found).
static REAL: [AtomicUsize; 4] = [const { AtomicUsize::new(0) }; 4];

/// The process this library's profiler state belongs to: set at load and in every forked
/// child (an atfork handler). A `vfork` child runs no atfork handler, so its pid differs.
static OWNER_PID: AtomicI32 = AtomicI32::new(0);

/// What a new image's environment must carry (built at load; read-only afterwards).
struct Carry {
    /// This library, as `LD_PRELOAD` named it.
    lib: &'static [u8],
    /// `FERROPROF_*=value` entries of the environment at load.
    vars: Vec<CString>,
}

static CARRY: OnceLock<Carry> = OnceLock::new();

const LD_PRELOAD: &[u8] = b"LD_PRELOAD=";

/// At load, before the profiler starts (may allocate).
pub(crate) fn init() {
    for (slot, name) in REAL.iter().zip(NAMES) {
        crate::hooks::next_symbol(slot, name);
    }
    // SAFETY: getpid has no preconditions; the handler is a plain extern "C" fn.
    unsafe {
        OWNER_PID.store(libc::getpid(), Ordering::SeqCst);
        libc::pthread_atfork(None, None, Some(forked));
    }
    if let Some(lib) = preloaded_as() {
        let vars = std::env::vars_os()
            .filter_map(|(k, v)| {
                use std::os::unix::ffi::OsStrExt;
                let k = k.as_bytes();
                if !k.starts_with(b"FERROPROF_") {
                    return None;
                }
                CString::new([k, b"=", v.as_bytes()].concat()).ok()
            })
            .collect();
        let _ = CARRY.set(Carry {
            lib: Box::leak(lib.into_boxed_slice()),
            vars,
        });
    }
}

extern "C" fn forked() {
    // SAFETY: getpid has no preconditions (async-signal-safe).
    OWNER_PID.store(unsafe { libc::getpid() }, Ordering::SeqCst);
}

/// The `LD_PRELOAD` entry that loaded this library; None when it was loaded otherwise
/// (`dlopen`, a dependency): then the environment is none of its business.
fn preloaded_as() -> Option<Vec<u8>> {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: Dl_info is a plain C struct (pointers): all-zero is a valid value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: `init` is code of this library; `info` is valid for a write.
    let found = unsafe { libc::dladdr(init as *const c_void, &mut info) } != 0;
    if !found || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr filled in a NUL-terminated name that lives as long as the library.
    let me = unsafe { CStr::from_ptr(info.dli_fname) }.to_bytes();
    let file = |p: &[u8]| p.rsplit(|&b| b == b'/').next().map(<[u8]>::to_vec);
    let list = std::env::var_os("LD_PRELOAD")?;
    list.as_bytes()
        .split(|&b| b == b':' || b == b' ')
        .find(|e| !e.is_empty() && (*e == me || file(e) == file(me)))
        .map(<[u8]>::to_vec)
}

/// A `vfork` child: it shares its parent's memory, profiler included. Async-signal-safe.
pub(crate) fn in_vfork_child() -> bool {
    // SAFETY: getpid has no preconditions.
    unsafe { libc::getpid() != OWNER_PID.load(Ordering::SeqCst) }
}

/// Writes this process's profile before an exec, when it has one of its own; true when the
/// profiler was stopped (to be started again if the exec fails).
fn before_exec() -> bool {
    if in_vfork_child() {
        return false; // the profiler is the parent's
    }
    if ferroprof::internals::__restart_pending() {
        return false; // a forked child with nothing recorded
    }
    crate::stop_for_exec()
}

/// The bytes of the NUL-terminated string `p`, without the NUL. Async-signal-safe.
///
/// # Safety
/// `p` is a valid C string that outlives the result.
unsafe fn bytes<'a>(p: *const c_char) -> &'a [u8] {
    // SAFETY: per the contract.
    unsafe { CStr::from_ptr(p) }.to_bytes()
}

/// The entries of a null-terminated `envp` (null: none).
///
/// # Safety
/// `envp` is null or a null-terminated array of C strings.
unsafe fn entries(envp: Envp) -> impl Iterator<Item = *const c_char> {
    (0..).map_while(move |i| {
        if envp.is_null() {
            return None;
        }
        // SAFETY: within the null-terminated array (the caller's contract).
        let e = unsafe { *envp.add(i) };
        (!e.is_null()).then_some(e)
    })
}

/// Whether `envp` has a variable of the name of `var` (`NAME=value`).
///
/// # Safety
/// As [`entries`].
unsafe fn has_name(envp: Envp, var: &CStr) -> bool {
    let v = var.to_bytes();
    let name = &v[..=v.iter().position(|&b| b == b'=').unwrap_or(v.len() - 1)];
    // SAFETY: the entries are C strings (forwarded contract).
    unsafe { entries(envp) }.any(|e| unsafe { bytes(e) }.starts_with(name))
}

/// The changes a new image's environment needs.
struct Plan {
    carry: &'static Carry,
    /// Entries of the original.
    n: usize,
    /// Its `LD_PRELOAD` entry, if any.
    ld_old: Option<*const c_char>,
    /// Whether that entry already names this library.
    ld_ok: bool,
    /// Carried variables it lacks.
    missing: usize,
}

impl Plan {
    /// Pointers in the new array, its null included.
    fn pointers(&self) -> usize {
        self.n + 1 + self.missing + 1
    }

    /// Bytes of the new `LD_PRELOAD` entry, NUL included.
    fn text(&self) -> usize {
        // SAFETY: `ld_old` is an entry of the environment being fixed up, a C string.
        let old = self.ld_old.map_or(0, |e| unsafe { bytes(e) }.len());
        LD_PRELOAD.len() + self.carry.lib.len() + 1 + old + 1
    }

    /// Fills `array` and `text` (of at least `pointers()` and `text()` elements).
    ///
    /// # Safety
    /// `envp` is the environment this plan was made for; `array` and `text` are valid for
    /// those many writes.
    unsafe fn fill(&self, envp: Envp, array: *mut *const c_char, text: *mut u8) {
        // SAFETY: within the sizes the caller guarantees (`pointers()`, `text()`); the strings
        // read are C strings of `envp`, whose own bytes `text()` counted.
        unsafe {
            let old = self
                .ld_old
                .map_or(&[][..], |e| &bytes(e)[LD_PRELOAD.len()..]);
            let mut t = text;
            for part in [LD_PRELOAD, self.carry.lib] {
                std::ptr::copy_nonoverlapping(part.as_ptr(), t, part.len());
                t = t.add(part.len());
            }
            if !old.is_empty() {
                *t = b':';
                std::ptr::copy_nonoverlapping(old.as_ptr(), t.add(1), old.len());
                t = t.add(1 + old.len());
            }
            *t = 0;
            let ld_entry = text as *const c_char;
            let mut i = 0;
            let mut push = |p: *const c_char| {
                *array.add(i) = p;
                i += 1;
            };
            for e in entries(envp) {
                let replaced = Some(e) == self.ld_old && !self.ld_ok;
                push(if replaced { ld_entry } else { e });
            }
            if self.ld_old.is_none() {
                push(ld_entry);
            }
            for v in self.carry.vars.iter().filter(|v| !has_name(envp, v)) {
                push(v.as_ptr());
            }
            push(std::ptr::null());
        }
    }
}

/// What `envp` needs: None when it carries the library and the settings already, or when
/// this library was not preloaded.
///
/// # Safety
/// As [`entries`].
unsafe fn plan(envp: Envp) -> Option<Plan> {
    let carry = CARRY.get()?;
    // SAFETY: the entries are C strings (forwarded contract), here and below.
    let n = unsafe { entries(envp) }.count();
    let ld_old = unsafe { entries(envp) }.find(|&e| unsafe { bytes(e) }.starts_with(LD_PRELOAD));
    let ld_ok = ld_old.is_some_and(|e| {
        // SAFETY: as above.
        let entry = unsafe { bytes(e) };
        entry[LD_PRELOAD.len()..]
            .split(|&b| b == b':' || b == b' ')
            .any(|x| x == carry.lib)
    });
    // SAFETY: as above.
    let missing = carry
        .vars
        .iter()
        .filter(|v| !unsafe { has_name(envp, v) })
        .count();
    (!ld_ok || missing > 0).then_some(Plan {
        carry,
        n,
        ld_old,
        ld_ok,
        missing,
    })
}

/// Whether `envp` lacks the library or a carried setting (what [`with_env`] would add).
///
/// # Safety
/// As [`entries`].
pub(crate) unsafe fn needs_fixup(envp: Envp) -> bool {
    // SAFETY: forwarded contract.
    unsafe { plan(envp) }.is_some()
}

/// Room for the fixed-up environment on the stack; a larger one goes to an anonymous mapping.
const STACK_POINTERS: usize = 512;
const STACK_TEXT: usize = 4096;

/// Calls `f` with `envp`, or with a copy of it that has `LD_PRELOAD` naming this library and
/// every carried `FERROPROF_*` variable it lacks (the program's own value of a variable wins).
/// No heap: the copy lives on the stack, or in an anonymous mapping when it is large (not on
/// the stack of a `vfork` child, which is its parent's: a mapping left there by the exec would
/// stay in the parent). Async-signal-safe. Returns what `f` returns, with its errno.
///
/// # Safety
/// As [`entries`].
pub(crate) unsafe fn with_env(envp: Envp, f: impl FnOnce(Envp) -> c_int) -> c_int {
    // SAFETY: forwarded contract.
    let Some(plan) = (unsafe { self::plan(envp) }) else {
        return f(envp);
    };
    let (pointers, text) = (plan.pointers(), plan.text());
    if pointers <= STACK_POINTERS && text <= STACK_TEXT {
        let mut array = [std::ptr::null::<c_char>(); STACK_POINTERS];
        let mut buf = [0u8; STACK_TEXT];
        // SAFETY: both buffers are large enough (checked above).
        unsafe { plan.fill(envp, array.as_mut_ptr(), buf.as_mut_ptr()) };
        return f(array.as_ptr());
    }
    let ptr_bytes = pointers * std::mem::size_of::<*const c_char>();
    let len = ptr_bytes + text;
    // SAFETY: a fresh private anonymous mapping.
    let at = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if at == libc::MAP_FAILED {
        return f(envp); // the exec goes ahead; the new image is not profiled
    }
    let array = at.cast::<*const c_char>();
    // SAFETY: the mapping holds the pointers, then the text (sizes from the plan).
    unsafe { plan.fill(envp, array, at.cast::<u8>().add(ptr_bytes)) };
    let r = f(array);
    // Returned: the exec failed. errno is this thread's, kept across the unmapping.
    // SAFETY: our own mapping, unmapped once; errno as said.
    unsafe {
        let errno = *libc::__errno_location();
        libc::munmap(at, len);
        *libc::__errno_location() = errno;
    }
    r
}

/// Runs glibc's exec function `which` through `call`, with the profile written and the
/// environment fixed up first; restores the profiler if it returns (a failed exec).
///
/// # Safety
/// `envp` as in [`entries`]; `call` calls the function of index `which` with its arguments.
unsafe fn exec_with(which: usize, envp: Envp, call: impl FnOnce(usize, Envp) -> c_int) -> c_int {
    let real = REAL[which].load(Ordering::Acquire);
    if real == 0 && which != EXECVE {
        // SAFETY: errno is this thread's.
        unsafe { *libc::__errno_location() = libc::ENOSYS };
        return -1;
    }
    let stopped = before_exec();
    // SAFETY: forwarded contract.
    let r = unsafe { with_env(envp, |env| call(real, env)) };
    // SAFETY: errno is this thread's; kept for the caller across what follows.
    let errno = unsafe { *libc::__errno_location() };
    if stopped {
        crate::restart_after_failed_exec();
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
    r
}

type ExecveFn = unsafe extern "C" fn(*const c_char, Argv, Envp) -> c_int;

/// # Safety
/// `f` is 0 or glibc's `execve`; the C `execve` contract.
unsafe fn call_execve(f: usize, path: *const c_char, argv: Argv, envp: Envp) -> c_int {
    if f == 0 {
        // SAFETY: the raw system call, same contract.
        return unsafe { libc::syscall(libc::SYS_execve, path, argv, envp) } as c_int;
    }
    // SAFETY: `f` is glibc's execve, of this signature.
    unsafe { std::mem::transmute::<usize, ExecveFn>(f)(path, argv, envp) }
}

/// # Safety
/// The C `execve` contract.
#[no_mangle]
pub unsafe extern "C" fn execve(path: *const c_char, argv: Argv, envp: Envp) -> c_int {
    // SAFETY: forwarded contract.
    unsafe { exec_with(EXECVE, envp, |f, env| call_execve(f, path, argv, env)) }
}

/// # Safety
/// The C `execv` contract.
#[no_mangle]
pub unsafe extern "C" fn execv(path: *const c_char, argv: Argv) -> c_int {
    // `execv` is `execve` with the process's environment.
    // SAFETY: forwarded contract; `environ` is the process's environment.
    unsafe { exec_with(EXECVE, environ, |f, env| call_execve(f, path, argv, env)) }
}

/// # Safety
/// `f` is glibc's `execvpe`; its contract.
unsafe fn call_execvpe(f: usize, file: *const c_char, argv: Argv, envp: Envp) -> c_int {
    // SAFETY: `f` is glibc's execvpe, of the same signature as execve.
    unsafe { std::mem::transmute::<usize, ExecveFn>(f)(file, argv, envp) }
}

/// # Safety
/// The C `execvp` contract.
#[no_mangle]
pub unsafe extern "C" fn execvp(file: *const c_char, argv: Argv) -> c_int {
    // `execvp` is `execvpe` with the process's environment.
    // SAFETY: forwarded contract; `environ` is the process's environment.
    unsafe { exec_with(EXECVPE, environ, |f, env| call_execvpe(f, file, argv, env)) }
}

/// # Safety
/// The GNU `execvpe` contract.
#[no_mangle]
pub unsafe extern "C" fn execvpe(file: *const c_char, argv: Argv, envp: Envp) -> c_int {
    // SAFETY: forwarded contract.
    unsafe { exec_with(EXECVPE, envp, |f, env| call_execvpe(f, file, argv, env)) }
}

/// # Safety
/// The C `fexecve` contract.
#[no_mangle]
pub unsafe extern "C" fn fexecve(fd: c_int, argv: Argv, envp: Envp) -> c_int {
    type F = unsafe extern "C" fn(c_int, Argv, Envp) -> c_int;
    // SAFETY: forwarded contract; `f` is glibc's fexecve, of this signature.
    unsafe {
        exec_with(FEXECVE, envp, |f, env| {
            std::mem::transmute::<usize, F>(f)(fd, argv, env)
        })
    }
}

/// # Safety
/// The Linux `execveat` contract.
#[no_mangle]
pub unsafe extern "C" fn execveat(
    dirfd: c_int,
    path: *const c_char,
    argv: Argv,
    envp: Envp,
    flags: c_int,
) -> c_int {
    type F = unsafe extern "C" fn(c_int, *const c_char, Argv, Envp, c_int) -> c_int;
    // SAFETY: forwarded contract; `f` is glibc's execveat, of this signature.
    unsafe {
        exec_with(EXECVEAT, envp, |f, env| {
            std::mem::transmute::<usize, F>(f)(dirfd, path, argv, env, flags)
        })
    }
}

/// Takes any CPU sampling signal `sig` still pending for this thread (the sampler has
/// stopped): a pending signal survives `exec`, and the new image, with its disposition back
/// to the default, would die of it.
pub(crate) fn drain_signal(sig: c_int) {
    if sig <= 0 {
        return;
    }
    // SAFETY: signal-set and mask calls on sets we own; a zero timeout never blocks.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, sig);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old);
        let zero = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        while libc::sigtimedwait(&set, std::ptr::null_mut(), &zero) == sig {}
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
    }
}
