//! The profiler's own threads, started with `pthread_create` rather than `std::thread`.
//!
//! std's thread start and exit take a process-wide lock (the table its stack-overflow handler
//! reads). A forked child inherits that lock held when some thread of the parent was starting
//! or ending at the moment of the fork, and every `std::thread` the child starts then waits for
//! it for ever. A forked child restarts the profiler's threads on its own (at its first sampled
//! allocation), so those threads must not go through that lock: seen as a child hung in the
//! profiler's restart while its parent created and ended threads. Threads started here get no
//! stack-overflow message from std (an overflow is still stopped by the guard page).

use std::any::Any;
use std::ffi::CString;
use std::sync::{mpsc, Arc, Mutex};
use std::thread::Thread;

type Outcome<T> = Mutex<Option<std::thread::Result<T>>>;

/// A running thread of ours: joined with [`OwnThread::join`], detached when dropped unjoined.
pub(crate) struct OwnThread<T> {
    id: libc::pthread_t,
    thread: Thread,
    outcome: Arc<Outcome<T>>,
    joined: bool,
}

struct Start<T> {
    name: CString,
    f: Box<dyn FnOnce() -> T + Send>,
    outcome: Arc<Outcome<T>>,
    started: mpsc::SyncSender<Thread>,
}

/// Starts `f` on a thread named `name` (the kernel's name, at most 15 bytes kept) with a stack
/// of at least `stack_size` bytes.
pub(crate) fn spawn<T: Send + 'static>(
    name: &str,
    stack_size: usize,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::io::Result<OwnThread<T>> {
    // SAFETY: the closure is 'static, so nothing it borrows can end before the thread.
    unsafe { spawn_unchecked(name, stack_size, Box::new(f)) }
}

/// [`spawn`] for a closure that borrows: see [`Scoped`].
///
/// # Safety
/// The thread must be joined before anything `f` borrows ends.
unsafe fn spawn_unchecked<'a, T: Send + 'a>(
    name: &str,
    stack_size: usize,
    f: Box<dyn FnOnce() -> T + Send + 'a>,
) -> std::io::Result<OwnThread<T>> {
    // SAFETY: forwarded to the caller: the thread ends before the borrowed data does.
    let f: Box<dyn FnOnce() -> T + Send + 'static> = unsafe { std::mem::transmute(f) };
    let name = CString::new(name.replace('\0', "")).unwrap_or_default();
    let outcome = Arc::new(Mutex::new(None));
    let (started, started_rx) = mpsc::sync_channel(1);
    let start = Box::new(Start {
        name,
        f,
        outcome: outcome.clone(),
        started,
    });
    let arg = Box::into_raw(start);
    let mut id: libc::pthread_t = 0;
    // SAFETY: attr is initialized before use and destroyed after; `trampoline::<T>` takes back
    // the box behind `arg` exactly once, and only when the thread was created.
    let rc = unsafe {
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        libc::pthread_attr_init(&mut attr);
        let min = libc::PTHREAD_STACK_MIN;
        libc::pthread_attr_setstacksize(&mut attr, stack_size.max(min));
        let rc = libc::pthread_create(&mut id, &attr, trampoline::<T>, arg as *mut libc::c_void);
        libc::pthread_attr_destroy(&mut attr);
        rc
    };
    if rc != 0 {
        // SAFETY: the thread was not created; the box is still ours.
        drop(unsafe { Box::from_raw(arg) });
        return Err(std::io::Error::from_raw_os_error(rc));
    }
    let thread = match started_rx.recv() {
        Ok(t) => t,
        // The thread sends before it runs anything that could fail.
        Err(_) => std::thread::current(),
    };
    Ok(OwnThread {
        id,
        thread,
        outcome,
        joined: false,
    })
}

extern "C" fn trampoline<T>(arg: *mut libc::c_void) -> *mut libc::c_void {
    // SAFETY: `arg` is the box `spawn_unchecked` leaked for this thread.
    let start = unsafe { Box::from_raw(arg as *mut Start<T>) };
    let Start {
        name,
        f,
        outcome,
        started,
    } = *start;
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of which it keeps 15 bytes.
    unsafe { libc::prctl(libc::PR_SET_NAME, name.as_ptr() as libc::c_ulong, 0, 0, 0) };
    let _ = started.send(std::thread::current());
    // A panic must not unwind into the C caller; it is handed to `join`.
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    *outcome.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
    std::ptr::null_mut()
}

impl<T> OwnThread<T> {
    /// The thread, to unpark it.
    pub(crate) fn thread(&self) -> &Thread {
        &self.thread
    }

    /// Waits for the thread to end; its result, or the payload of its panic.
    pub(crate) fn join(mut self) -> Result<T, Box<dyn Any + Send + 'static>> {
        self.joined = true;
        // SAFETY: a thread we created and neither joined nor detached yet.
        unsafe { libc::pthread_join(self.id, std::ptr::null_mut()) };
        let r = self
            .outcome
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        r.unwrap_or_else(|| Err(Box::new("thread ended without a result")))
    }

    /// Forgets the thread without joining or detaching it: for a forked child, where it is a
    /// thread of the parent that does not exist.
    pub(crate) fn forget(mut self) {
        self.joined = true;
    }
}

impl<T> Drop for OwnThread<T> {
    fn drop(&mut self) {
        if !self.joined {
            // SAFETY: a thread we created and neither joined nor detached yet.
            unsafe { libc::pthread_detach(self.id) };
        }
    }
}

/// Threads that borrow from the caller's frame, all joined before [`Scoped::run`] returns
/// (as `std::thread::scope`).
pub(crate) struct Scoped;

impl Scoped {
    /// Runs `work` on this thread and on up to `helpers` threads named `<name>N`, and returns
    /// what each returned; a helper that cannot start leaves its share to the others. A panic
    /// of a helper is resumed here once every helper ended.
    pub(crate) fn run<T: Send>(
        helpers: usize,
        name: &str,
        work: &(dyn Fn() -> T + Sync),
    ) -> Vec<T> {
        let started: Vec<OwnThread<T>> = (1..=helpers)
            .filter_map(|n| {
                let job: Box<dyn FnOnce() -> T + Send + '_> = Box::new(move || {
                    crate::threads::enter_profiler_thread();
                    work()
                });
                // SAFETY: every thread started here is joined below, before `work` (borrowed)
                // can end, even when one of them panicked.
                crate::tls::with_guard(|| unsafe {
                    spawn_unchecked(&format!("{name}{n}"), 2 << 20, job)
                })
                .ok()
            })
            .collect();
        let mine = std::panic::catch_unwind(std::panic::AssertUnwindSafe(work));
        let mut all = Vec::with_capacity(started.len() + 1);
        let mut panic = None;
        for h in started {
            match h.join() {
                Ok(v) => all.push(v),
                Err(p) => panic = Some(p),
            }
        }
        match mine {
            Ok(v) => all.push(v),
            Err(p) => panic = Some(p),
        }
        if let Some(p) = panic {
            std::panic::resume_unwind(p);
        }
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_runs_is_named_and_hands_back_its_result_or_panic() {
        let h = spawn("ferroprof-t1", 64 << 10, || {
            let mut buf = [0u8; 16];
            // SAFETY: PR_GET_NAME writes at most 16 bytes into the buffer.
            unsafe {
                libc::prctl(
                    libc::PR_GET_NAME,
                    buf.as_mut_ptr() as libc::c_ulong,
                    0,
                    0,
                    0,
                )
            };
            String::from_utf8_lossy(&buf[..buf.iter().position(|&b| b == 0).unwrap_or(16)])
                .into_owned()
        })
        .unwrap();
        assert_eq!(h.join().unwrap(), "ferroprof-t1");
        let h = spawn("ferroprof-t2", 64 << 10, || -> u32 { panic!("boom") }).unwrap();
        assert!(h.join().is_err());
    }

    #[test]
    fn scoped_threads_borrow_and_all_return() {
        let data = [1u64, 2, 3];
        let work = || data.iter().sum::<u64>();
        let got = Scoped::run(3, "ferroprof-s", &work);
        assert_eq!(got, vec![6; 4]);
    }

    #[test]
    fn unpark_reaches_the_thread() {
        let (tx, rx) = mpsc::channel();
        let h = spawn("ferroprof-t3", 64 << 10, move || {
            tx.send(()).unwrap();
            std::thread::park();
        })
        .unwrap();
        rx.recv().unwrap();
        h.thread().unpark();
        h.join().unwrap();
    }
}
