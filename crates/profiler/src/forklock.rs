//! A mutex that a forked child can reset.
//!
//! The profiler's locks that a thread may hold at a `fork` are released in the child (see
//! `crate::fork`). `parking_lot`'s unlock cannot do that safely: when another thread was parked
//! on the lock, it hands the lock straight to that waiter, which in the child is a thread that
//! did not survive the fork, so the lock stays held for ever and the child's next user hangs
//! (seen as a forked child whose sampler waited for ever on the unwinder's retired-snapshot
//! lock). This lock is one futex word (0 free, 1 held, 2 held with waiters): the child resets
//! it by storing 0, and no waiter can be left behind, since futex waiters are threads and the
//! child has only the forking one.

use std::sync::atomic::{AtomicU32, Ordering};

/// The raw lock behind [`Mutex`].
pub(crate) struct RawForkLock {
    state: AtomicU32,
}

const FREE: u32 = 0;
const HELD: u32 = 1;
const CONTENDED: u32 = 2;

// SAFETY: `lock` and `try_lock` succeed only on the FREE → HELD (or CONTENDED) transition made
// with Acquire, and `unlock` stores FREE with Release: one holder at a time, its writes visible
// to the next.
unsafe impl lock_api::RawMutex for RawForkLock {
    #[allow(clippy::declare_interior_mutable_const)]
    const INIT: RawForkLock = RawForkLock {
        state: AtomicU32::new(FREE),
    };
    type GuardMarker = lock_api::GuardNoSend;

    #[inline]
    fn lock(&self) {
        if self
            .state
            .compare_exchange(FREE, HELD, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            self.lock_contended();
        }
        count_held(1);
    }

    #[inline]
    fn try_lock(&self) -> bool {
        let got = self
            .state
            .compare_exchange(FREE, HELD, Ordering::Acquire, Ordering::Relaxed)
            .is_ok();
        if got {
            count_held(1);
        }
        got
    }

    #[inline]
    unsafe fn unlock(&self) {
        count_held(-1);
        if self.state.swap(FREE, Ordering::Release) == CONTENDED {
            wake(&self.state, 1);
        }
    }

    #[inline]
    fn is_locked(&self) -> bool {
        self.state.load(Ordering::Relaxed) != FREE
    }
}

/// Counts the calling thread's holds (a `Cell` in const TLS: no allocation, never torn down),
/// so that a fork from a signal handler that interrupted a holder can tell (see `crate::fork`).
#[inline]
fn count_held(d: i32) {
    crate::tls::STATE.with(|s| s.fork_locks.set(s.fork_locks.get().wrapping_add_signed(d)));
}

/// How many `forklock` mutexes the calling thread holds.
pub(crate) fn held_by_this_thread() -> u32 {
    crate::tls::STATE.with(|s| s.fork_locks.get())
}

impl RawForkLock {
    #[cold]
    fn lock_contended(&self) {
        // Most holds are short: spin a little before sleeping.
        for _ in 0..100 {
            if self.state.load(Ordering::Relaxed) == FREE
                && self
                    .state
                    .compare_exchange(FREE, HELD, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                return;
            }
            std::hint::spin_loop();
        }
        // Marked contended, so that the holder's unlock wakes a sleeper.
        while self.state.swap(CONTENDED, Ordering::Acquire) != FREE {
            futex(&self.state, libc::FUTEX_WAIT, CONTENDED);
        }
    }
}

/// Wakes up to `n` threads waiting on the futex `word`.
pub(crate) fn wake(word: &AtomicU32, n: u32) {
    futex(word, libc::FUTEX_WAKE, n);
}

fn futex(word: &AtomicU32, op: libc::c_int, val: u32) {
    // SAFETY: a process-private futex operation on a word we own; FUTEX_WAIT returns at a wake,
    // when the word no longer holds `val`, or on a signal (the caller looks again), FUTEX_WAKE
    // only wakes.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            op | libc::FUTEX_PRIVATE_FLAG,
            val,
            std::ptr::null::<libc::timespec>(),
        );
    }
}

/// A mutex a forked child can reset with [`reset_in_child`].
pub(crate) type Mutex<T> = lock_api::Mutex<RawForkLock, T>;

/// Releases `m` in a forked child, whoever held it in the parent.
///
/// # Safety
/// Only in a forked child before it starts any thread: a holder of `m` is then a thread that
/// did not survive the fork (or this one, which must not use its guard again). What `m` guards
/// may be half-updated; the caller replaces it or knows it consistent.
pub(crate) unsafe fn reset_in_child<T: ?Sized>(m: &Mutex<T>) {
    // SAFETY: forwarded to the caller; the state is only stored to.
    unsafe { m.raw() }.state.store(FREE, Ordering::SeqCst);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn excludes_and_wakes_waiters() {
        let m = Arc::new(Mutex::new(0u64));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let m = m.clone();
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        let mut g = m.lock();
                        // Not atomic: a lost update would show two holders at once.
                        let v = *g;
                        std::hint::black_box(&mut *g);
                        *g = v + 1;
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(*m.lock(), 80_000);
    }

    /// The hang this lock exists for: a thread holds the lock while others wait on it, and the
    /// process forks. The child resets the lock and takes it at once. (With `parking_lot`,
    /// `force_unlock` in the child could hand the lock to a waiter that is not there.)
    #[test]
    fn a_forked_child_resets_a_lock_held_and_waited_for_in_the_parent() {
        static M: Mutex<u32> = Mutex::new(0);
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let holder = std::thread::spawn(move || {
            let _g = M.lock();
            held_tx.send(()).unwrap();
            release_rx.recv().unwrap();
        });
        held_rx.recv().unwrap();
        let waiters: Vec<_> = (0..2)
            .map(|_| std::thread::spawn(|| *M.lock() += 1))
            .collect();
        // Let the waiters mark the lock contended and sleep on it.
        while raw_state(&M) != CONTENDED {
            std::thread::yield_now();
        }
        // SAFETY: the child only resets and takes the lock, then leaves with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // SAFETY: alarm only arms a timer that ends a child that hangs.
            unsafe { libc::alarm(10) };
            // SAFETY: this is the forked child's only thread.
            unsafe { reset_in_child(&M) };
            *M.lock() += 1;
            // SAFETY: leave without running the test harness's exit path.
            unsafe { libc::_exit(0) };
        }
        release_tx.send(()).unwrap();
        holder.join().unwrap();
        for w in waiters {
            w.join().unwrap();
        }
        let mut status = 0;
        // SAFETY: waiting for our own child, bounded by its alarm.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "child status {status:#x}"
        );
        assert_eq!(*M.lock(), 2);
    }

    fn raw_state(m: &Mutex<u32>) -> u32 {
        // SAFETY: reads the state only.
        unsafe { m.raw() }.state.load(Ordering::SeqCst)
    }
}
