//! Per-thread state of the allocator and the unwinder.
//!
//! Every field is a `Cell` of a `Copy` type in a `const`-initialized `thread_local!`: such a
//! variable needs no lazy initialization and registers no destructor, so reading it never
//! allocates, works while the thread's other TLS is being destroyed, and is a plain
//! `fs`-relative load in the signal handler (for code linked into the executable).

use std::cell::Cell;

pub(crate) struct ThreadState {
    /// Bytes left before the next allocation sampling point. Negative after an allocation
    /// crossed it.
    pub countdown: Cell<i64>,
    /// xorshift64* state; 0 = not seeded yet (also means "countdown not drawn yet").
    pub rng: Cell<u64>,
    /// Nesting depth of profiler code on this thread: allocations made while > 0 are never
    /// sampled. Profiler threads keep it at 1 for their whole life.
    pub guard: Cell<u32>,
    /// Set while this thread is inside a call into the recorder: frees made then belong to
    /// the recorder's own (never sampled) memory, and the recorder's locks may be held, so
    /// the free path must not call back into it.
    pub in_recorder: Cell<bool>,
    /// This thread's stack `[lo, hi)`, learned once outside any signal handler; 0 = unknown.
    pub stack_lo: Cell<usize>,
    pub stack_hi: Cell<usize>,
    /// This thread's kernel id, cached; 0 = not known yet.
    pub tid: Cell<i32>,
    /// This thread's name (kernel `comm`, at most 15 bytes), cached for allocation samples and
    /// re-read every [`crate::threads::NAME_REFRESH`] samples; `name_len` 0xff = not read yet.
    pub name: Cell<[u8; 16]>,
    pub name_len: Cell<u8>,
    pub name_age: Cell<u8>,
    /// This thread's shard of the sharded counters plus one (see `crate::sharded`); 0 = none yet.
    pub reader_shard: Cell<u8>,
    /// In arena mode: allocations come from the symbolizer's private arena (see `crate::alloc::arena`).
    pub arena: Cell<bool>,
    /// In keep mode: allocations come from the profiler's kept blocks (see `crate::alloc::keep`).
    pub keep: Cell<bool>,
    /// This thread's label slot plus one (see `crate::labels`); 0 = none.
    pub label_slot: Cell<u32>,
    /// How deep this thread is inside the fork gate (see `crate::fork`).
    pub gate_depth: Cell<u32>,
    /// `forklock` mutexes this thread holds now: a fork from a thread holding one of the
    /// profiler's locks (a signal handler that interrupted the profiler) cannot be prepared.
    pub fork_locks: Cell<u32>,
    /// Forks this thread began that the profiler's handlers left alone (see `crate::fork`).
    pub fork_skips: Cell<u32>,
}

thread_local! {
    pub(crate) static STATE: ThreadState = const {
        ThreadState {
            countdown: Cell::new(0),
            rng: Cell::new(0),
            guard: Cell::new(0),
            in_recorder: Cell::new(false),
            stack_lo: Cell::new(0),
            stack_hi: Cell::new(0),
            tid: Cell::new(0),
            name: Cell::new([0; 16]),
            name_len: Cell::new(0xff),
            name_age: Cell::new(0),
            reader_shard: Cell::new(0),
            arena: Cell::new(false),
            keep: Cell::new(false),
            label_slot: Cell::new(0),
            gate_depth: Cell::new(0),
            fork_locks: Cell::new(0),
            fork_skips: Cell::new(0),
        }
    };
}

/// A countdown held this far below zero sends every allocation of the thread to the sampling
/// allocator's slow path (profiler code, arena and keep modes), where the thread's state is
/// looked at; the fast path itself reads nothing else. Far enough from `i64::MIN` that no
/// thread allocates its way back up.
pub(crate) const COUNTDOWN_HELD: i64 = i64::MIN / 4;

/// Sends this thread's next allocation, whatever its size, to the sampling allocator's slow
/// path (once: the slow path draws a fresh countdown). A store to the thread's own state:
/// async-signal-safe. A countdown held negative (profiler code, arena and keep modes) already
/// does, and is left as it is.
pub(crate) fn take_slow_path_next() {
    STATE.with(|s| {
        if s.countdown.get() > 0 {
            s.countdown.set(0);
        }
    });
}

/// Runs `f` with allocation sampling suppressed on this thread (its allocations take the slow
/// path, where the profiler's large blocks are served: see `crate::alloc::bigblock`).
pub(crate) fn with_guard<R>(f: impl FnOnce() -> R) -> R {
    struct Reset(i64);
    impl Drop for Reset {
        fn drop(&mut self) {
            STATE.with(|s| {
                s.guard.set(s.guard.get().saturating_sub(1));
                s.countdown.set(self.0);
            });
        }
    }
    let countdown = STATE.with(|s| {
        s.guard.set(s.guard.get() + 1);
        s.countdown.replace(COUNTDOWN_HELD)
    });
    let _reset = Reset(countdown);
    f()
}

/// For an interposed C allocator, not API: runs `f` with this thread's allocations unsampled.
#[doc(hidden)]
pub fn __unsampled<R>(f: impl FnOnce() -> R) -> R {
    with_guard(f)
}

/// Runs `f` (a call into the recorder) with the free path told not to re-enter the recorder.
pub(crate) fn in_recorder<R>(f: impl FnOnce() -> R) -> R {
    struct Reset(bool);
    impl Drop for Reset {
        fn drop(&mut self) {
            let prev = self.0;
            STATE.with(|s| s.in_recorder.set(prev));
        }
    }
    let prev = STATE.with(|s| s.in_recorder.replace(true));
    let _reset = Reset(prev);
    with_guard(f)
}

/// The calling thread's stack bounds, computed once per thread (not async-signal-safe: may
/// allocate through libc and read /proc for the main thread).
pub(crate) fn current_stack_bounds() -> Option<(usize, usize)> {
    let (lo, hi) = STATE.with(|s| (s.stack_lo.get(), s.stack_hi.get()));
    if hi != 0 {
        return Some((lo, hi));
    }
    let (lo, hi) = query_stack_bounds()?;
    STATE.with(|s| {
        s.stack_lo.set(lo);
        s.stack_hi.set(hi);
    });
    Some((lo, hi))
}

/// Stack bounds known for this thread, without computing them (async-signal-safe).
pub(crate) fn known_stack_bounds() -> Option<(usize, usize)> {
    STATE.with(ThreadState::known_stack_bounds)
}

impl ThreadState {
    /// [`known_stack_bounds`] for a caller that holds the state already (one frame fewer in
    /// a debug build, where every frame counts on a short stack).
    pub(crate) fn known_stack_bounds(&self) -> Option<(usize, usize)> {
        let (lo, hi) = (self.stack_lo.get(), self.stack_hi.get());
        (hi != 0).then_some((lo, hi))
    }
}

fn query_stack_bounds() -> Option<(usize, usize)> {
    // SAFETY: pthread_attr_t is plain data initialized by pthread_getattr_np before use and
    // destroyed once; the out-pointers are valid locals.
    unsafe {
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        if libc::pthread_getattr_np(libc::pthread_self(), &mut attr) != 0 {
            return None;
        }
        let mut addr: *mut libc::c_void = std::ptr::null_mut();
        let mut size: libc::size_t = 0;
        let rc = libc::pthread_attr_getstack(&attr, &mut addr, &mut size);
        libc::pthread_attr_destroy(&mut attr);
        if rc != 0 || addr.is_null() || size == 0 {
            return None;
        }
        let lo = addr as usize;
        Some((lo, lo + size))
    }
}
