//! The C allocation API, interposed over glibc's allocator.
//!
//! Each entry calls glibc's allocator through its `__libc_*` names (exported for exactly this
//! purpose; `dlsym` is not needed, so there is no bootstrap recursion through `dlsym`'s own
//! `calloc`), then hands the block to ferroprof's sampling (`__raw_allocated`) or untracks it
//! before it goes back (`__raw_freeing`). Until the profiler starts, and on every allocation
//! that does not cross its thread's sampling point, that is a relaxed load, a thread-local
//! subtraction and a branch. Sampled allocations take the same path as `SamplingAllocator`'s;
//! ferroprof's own allocations (made with its thread-local guard set) are never sampled, which is
//! what keeps the hook from recursing into itself.
//!
//! Sizes are the requested sizes (`calloc`: the product), as `SamplingAllocator` counts a
//! `Layout`'s size. `realloc` is a free of the old block and an allocation of the new size.

use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};

use libc::{c_int, size_t};

extern "C" {
    fn __libc_malloc(size: size_t) -> *mut c_void;
    fn __libc_free(p: *mut c_void);
    fn __libc_calloc(n: size_t, size: size_t) -> *mut c_void;
    fn __libc_realloc(p: *mut c_void, size: size_t) -> *mut c_void;
    fn __libc_memalign(align: size_t, size: size_t) -> *mut c_void;
    fn __libc_valloc(size: size_t) -> *mut c_void;
    fn __libc_pvalloc(size: size_t) -> *mut c_void;
}

/// # Safety
/// The C `malloc` contract.
#[no_mangle]
pub unsafe extern "C" fn malloc(size: size_t) -> *mut c_void {
    // SAFETY: forwarded contract.
    let p = unsafe { __libc_malloc(size) };
    ferroprof::internals::__raw_allocated(p.cast(), size);
    p
}

/// # Safety
/// The C `free` contract.
#[no_mangle]
pub unsafe extern "C" fn free(p: *mut c_void) {
    if p.is_null() {
        return;
    }
    ferroprof::internals::__raw_freeing(p.cast());
    // SAFETY: forwarded contract.
    unsafe { __libc_free(p) }
}

/// # Safety
/// The C `calloc` contract.
#[no_mangle]
pub unsafe extern "C" fn calloc(n: size_t, size: size_t) -> *mut c_void {
    // SAFETY: forwarded contract (glibc checks the product for overflow).
    let p = unsafe { __libc_calloc(n, size) };
    ferroprof::internals::__raw_allocated(p.cast(), n.saturating_mul(size));
    p
}

/// # Safety
/// The C `realloc` contract.
#[no_mangle]
pub unsafe extern "C" fn realloc(p: *mut c_void, size: size_t) -> *mut c_void {
    // The old block may be freed (or reused at the same address): untracked first, so a new
    // allocation at its address never meets its stale record.
    if !p.is_null() {
        ferroprof::internals::__raw_freeing(p.cast());
    }
    // SAFETY: forwarded contract.
    let q = unsafe { __libc_realloc(p, size) };
    ferroprof::internals::__raw_allocated(q.cast(), size);
    q
}

/// # Safety
/// The C `reallocarray` contract.
#[no_mangle]
pub unsafe extern "C" fn reallocarray(p: *mut c_void, n: size_t, size: size_t) -> *mut c_void {
    let Some(total) = n.checked_mul(size) else {
        // SAFETY: errno is this thread's.
        unsafe { *libc::__errno_location() = libc::ENOMEM };
        return std::ptr::null_mut();
    };
    // SAFETY: forwarded contract.
    unsafe { realloc(p, total) }
}

/// # Safety
/// The C `memalign` contract.
#[no_mangle]
pub unsafe extern "C" fn memalign(align: size_t, size: size_t) -> *mut c_void {
    // SAFETY: forwarded contract.
    let p = unsafe { __libc_memalign(align, size) };
    ferroprof::internals::__raw_allocated(p.cast(), size);
    p
}

/// # Safety
/// The C `aligned_alloc` contract.
#[no_mangle]
pub unsafe extern "C" fn aligned_alloc(align: size_t, size: size_t) -> *mut c_void {
    // glibc's own aligned_alloc is memalign (it accepts any alignment memalign accepts).
    // SAFETY: forwarded contract.
    let p = unsafe { __libc_memalign(align, size) };
    ferroprof::internals::__raw_allocated(p.cast(), size);
    p
}

/// # Safety
/// The C `posix_memalign` contract: `out` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn posix_memalign(
    out: *mut *mut c_void,
    align: size_t,
    size: size_t,
) -> c_int {
    if !align.is_power_of_two() || align % std::mem::size_of::<*mut c_void>() != 0 {
        return libc::EINVAL;
    }
    // SAFETY: forwarded contract (a valid alignment).
    let p = unsafe { __libc_memalign(align, size) };
    if p.is_null() {
        return libc::ENOMEM;
    }
    ferroprof::internals::__raw_allocated(p.cast(), size);
    // SAFETY: the caller passes a valid out-pointer.
    unsafe { *out = p };
    0
}

/// # Safety
/// The C `valloc` contract.
#[no_mangle]
pub unsafe extern "C" fn valloc(size: size_t) -> *mut c_void {
    // SAFETY: forwarded contract.
    let p = unsafe { __libc_valloc(size) };
    ferroprof::internals::__raw_allocated(p.cast(), size);
    p
}

/// # Safety
/// The C `pvalloc` contract.
#[no_mangle]
pub unsafe extern "C" fn pvalloc(size: size_t) -> *mut c_void {
    // SAFETY: forwarded contract.
    let p = unsafe { __libc_pvalloc(size) };
    ferroprof::internals::__raw_allocated(p.cast(), size);
    p
}

/// glibc's `pthread_getattr_np`, found once (0: not yet).
static GETATTR: AtomicUsize = AtomicUsize::new(0);

/// glibc's `pthread_getattr_np` allocates (its CPU-affinity buffer, and for the main thread
/// stdio's) while it holds the thread's own lock. The first allocation sample of a thread
/// asks for the thread's stack bounds, through `pthread_getattr_np`: taken in there, it waited
/// for that lock for ever (ripgrep hung so: Rust's thread start calls it). Its allocations are
/// therefore never sampled.
///
/// # Safety
/// The C `pthread_getattr_np` contract.
#[no_mangle]
pub unsafe extern "C" fn pthread_getattr_np(
    thread: libc::pthread_t,
    attr: *mut libc::pthread_attr_t,
) -> c_int {
    let mut f = GETATTR.load(Ordering::Acquire);
    if f == 0 {
        // Called before the constructor (from another library's): looked up now.
        f = next_symbol(&GETATTR, c"pthread_getattr_np");
        if f == 0 {
            return libc::ENOSYS;
        }
    }
    // SAFETY: `f` is glibc's pthread_getattr_np, of this signature.
    let real: unsafe extern "C" fn(libc::pthread_t, *mut libc::pthread_attr_t) -> c_int =
        unsafe { std::mem::transmute(f) };
    // SAFETY: forwarded contract.
    ferroprof::internals::__unsampled(|| unsafe { real(thread, attr) })
}

/// Looks up the interposed functions glibc defines (`dlsym` may allocate and takes the
/// loader's lock, which a forked child must not: done from the constructor).
pub(crate) fn init() {
    next_symbol(&GETATTR, c"pthread_getattr_np");
}

/// Looks up the next definition of `name` (glibc's, under the one here) and keeps it in
/// `slot`; 0 when there is none.
pub(crate) fn next_symbol(slot: &AtomicUsize, name: &std::ffi::CStr) -> usize {
    // SAFETY: a symbol lookup with a NUL-terminated name.
    let f = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
    slot.store(f, Ordering::Release);
    f
}

/// glibc's `malloc_usable_size`, found once (0: not yet).
static USABLE_SIZE: AtomicUsize = AtomicUsize::new(0);

/// # Safety
/// The C `malloc_usable_size` contract.
#[no_mangle]
pub unsafe extern "C" fn malloc_usable_size(p: *mut c_void) -> size_t {
    // Blocks are glibc's own, unchanged: its answer is the answer. glibc exports no
    // `__libc_` name for it, hence the lookup (dlsym may allocate: through the hooks above,
    // never through this function).
    let mut f = USABLE_SIZE.load(Ordering::Acquire);
    if f == 0 {
        f = next_symbol(&USABLE_SIZE, c"malloc_usable_size");
        if f == 0 {
            return 0;
        }
    }
    // SAFETY: `f` is glibc's malloc_usable_size, of this signature.
    let real: unsafe extern "C" fn(*mut c_void) -> size_t = unsafe { std::mem::transmute(f) };
    // SAFETY: forwarded contract.
    unsafe { real(p) }
}
