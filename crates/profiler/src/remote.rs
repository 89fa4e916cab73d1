//! Stacks of other threads of this process, read without a signal: a thread blocked in the
//! kernel has its user stack pointer and program counter in `/proc/self/task/<tid>/syscall`,
//! and its stack above that pointer does not change while it stays there. The sampler copies
//! the stack with `process_vm_readv` (a thread that exits meanwhile makes the copy fail; the
//! sampler never touches the other thread's memory directly) and unwinds over the copy.

use crate::unwind::{self, OwnCache};

/// Bytes of stack copied from the stack pointer up (a partial copy at the top of the mapping is
/// fine). Deep stacks of unoptimized code need tens of KiB.
const COPY_BYTES: usize = 64 * 1024;

/// Where a thread stands, from `/proc/self/task/<tid>/syscall`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TaskSyscall {
    /// Runnable or running: no registers to read.
    Running,
    /// Blocked (or preempted) in system call `nr`.
    InSyscall { nr: i64, sp: u64, pc: u64 },
    /// Stopped outside a system call (a page fault, a stop signal).
    Stopped { sp: u64, pc: u64 },
    /// The thread no longer exists (or the file cannot be read).
    Gone,
}

/// Reads `/proc/self/task/<tid>/syscall`, relative to the open `/proc/self/task` directory
/// when given. Allocates nothing.
pub(crate) fn task_syscall(task_dir: Option<libc::c_int>, tid: i32) -> TaskSyscall {
    let mut buf = [0u8; 256];
    match crate::sampler::read_task_file(task_dir, tid, "syscall", &mut buf) {
        Some(n) => parse(&buf[..n]),
        None => TaskSyscall::Gone,
    }
}

/// Parses the file's one line: `running`, `<nr> <sp> <pc>` for nr = -1, or `<nr> <6 args> <sp>
/// <pc>`; numbers after the first in hex with `0x`.
fn parse(line: &[u8]) -> TaskSyscall {
    let Ok(text) = std::str::from_utf8(line) else {
        return TaskSyscall::Gone;
    };
    let text = text.trim();
    if text == "running" {
        return TaskSyscall::Running;
    }
    let mut fields = [0u64; 9];
    let mut count = 0;
    let mut words = text.split_ascii_whitespace();
    let Some(nr) = words.next().and_then(|w| w.parse::<i64>().ok()) else {
        return TaskSyscall::Gone;
    };
    for w in words {
        let Some(v) = w
            .strip_prefix("0x")
            .and_then(|h| u64::from_str_radix(h, 16).ok())
        else {
            return TaskSyscall::Gone;
        };
        if count == fields.len() {
            return TaskSyscall::Gone;
        }
        fields[count] = v;
        count += 1;
    }
    match (nr, count) {
        (-1, 2) => TaskSyscall::Stopped {
            sp: fields[0],
            pc: fields[1],
        },
        (nr, 8) if nr >= 0 => TaskSyscall::InSyscall {
            nr,
            sp: fields[6],
            pc: fields[7],
        },
        _ => TaskSyscall::Gone,
    }
}

/// Walks other threads' stacks from the sampler thread: a reusable copy buffer and an unwinder
/// cache of its own.
pub(crate) struct RemoteUnwinder {
    copy: Vec<u8>,
    cache: OwnCache,
}

impl RemoteUnwinder {
    pub(crate) fn new() -> Self {
        RemoteUnwinder {
            copy: vec![0; COPY_BYTES],
            cache: OwnCache::new(),
        }
    }

    /// Copies the stack of a thread stopped at (`sp`, `pc`) and unwinds it into `out`; the
    /// number of frames, 0 when the stack cannot be read.
    pub(crate) fn unwind(&mut self, sp: u64, pc: u64, out: &mut [u64]) -> usize {
        if sp == 0 || pc == 0 {
            return 0;
        }
        let n = unwind::read_own_memory(sp, &mut self.copy);
        if n < 8 {
            return 0;
        }
        // A full copy may have more stack above it: a walk that runs off it is cut, and marked.
        let more_above = n == self.copy.len();
        unwind::unwind_copied(pc, sp, &self.copy[..n], more_above, &mut self.cache, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn parses_the_three_forms() {
        assert_eq!(parse(b"running\n"), TaskSyscall::Running);
        assert_eq!(
            parse(b"-1 0x7ffd1000 0x401000\n"),
            TaskSyscall::Stopped {
                sp: 0x7ffd_1000,
                pc: 0x40_1000
            }
        );
        assert_eq!(
            parse(b"7 0x1 0x2 0x3 0x4 0x5 0x6 0x7ffd2000 0x402000\n"),
            TaskSyscall::InSyscall {
                nr: 7,
                sp: 0x7ffd_2000,
                pc: 0x40_2000
            }
        );
        assert_eq!(parse(b""), TaskSyscall::Gone);
        assert_eq!(parse(b"7 0x1 zz"), TaskSyscall::Gone);
        assert_eq!(parse(b"7 0x1 0x2"), TaskSyscall::Gone);
    }

    #[inline(never)]
    fn remote_probe_leaf(fd: libc::c_int) {
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        unsafe { libc::poll(&mut pfd, 1, -1) };
        std::hint::black_box(&pfd);
    }

    #[inline(never)]
    fn remote_probe_middle(fd: libc::c_int) {
        remote_probe_leaf(fd);
        std::hint::black_box(fd);
    }

    #[test]
    fn reads_a_blocked_threads_stack_and_sees_it_gone() {
        crate::unwind::init_pool();
        crate::unwind::refresh(true);
        let mut fds = [0; 2];
        // SAFETY: a valid out array for two descriptors.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let (tx, rx) = mpsc::channel();
        let reader = fds[0];
        let h = std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            tx.send(unsafe { libc::gettid() }).unwrap();
            remote_probe_middle(reader);
        });
        let tid = rx.recv().unwrap();
        // Wait until it blocks in poll (nr 7 on x86_64).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let (sp, pc) = loop {
            match task_syscall(None, tid) {
                TaskSyscall::InSyscall { sp, pc, .. } => break (sp, pc),
                _ if std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(5))
                }
                other => panic!("never blocked: {other:?}"),
            }
        };
        let mut out = [0u64; 64];
        let mut u = RemoteUnwinder::new();
        let n = u.unwind(sp, pc, &mut out);
        let leaf = remote_probe_leaf as *const () as u64;
        let middle = remote_probe_middle as *const () as u64;
        // Return addresses land inside the callers: the leaf's call is within the middle
        // function's first few hundred bytes.
        let within = |a: u64, f: u64| a >= f && a < f + 512;
        let pos_leaf = out[..n].iter().position(|&a| within(a, leaf));
        let pos_middle = out[..n].iter().position(|&a| within(a, middle));
        // SAFETY: closing our own pipe's write end wakes the reader (POLLHUP).
        unsafe { libc::close(fds[1]) };
        h.join().unwrap();
        assert!(
            matches!((pos_leaf, pos_middle), (Some(l), Some(m)) if l < m),
            "{n} frames {:x?}: leaf {leaf:#x} middle {middle:#x}",
            &out[..n]
        );
        // SAFETY: our own descriptor.
        unsafe { libc::close(fds[0]) };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while task_syscall(None, tid) != TaskSyscall::Gone {
            assert!(
                std::time::Instant::now() < deadline,
                "exited thread still there"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        // A garbage position reads nothing and never faults.
        assert_eq!(u.unwind(8, 0x1000, &mut out), 0);
    }

    #[inline(never)]
    fn std_sleep_inner(stop: &std::sync::atomic::AtomicBool) {
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }

    #[inline(never)]
    fn std_sleep_outer(tx: mpsc::Sender<i32>, stop: &std::sync::atomic::AtomicBool) {
        // SAFETY: gettid has no preconditions.
        tx.send(unsafe { libc::gettid() }).unwrap();
        std_sleep_inner(stop);
        std::hint::black_box(stop);
    }

    #[inline(never)]
    fn std_lock_inner(m: &std::sync::Mutex<()>) {
        drop(std::hint::black_box(m.lock()));
    }

    #[inline(never)]
    fn std_lock_outer(tx: mpsc::Sender<i32>, m: &std::sync::Mutex<()>) {
        // SAFETY: gettid has no preconditions.
        tx.send(unsafe { libc::gettid() }).unwrap();
        std_lock_inner(m);
        std::hint::black_box(m);
    }

    /// std keeps frame pointers (its frames are found through rbp), glibc's wrappers leave rbp
    /// alone, and a blocked thread's rbp is not in /proc: without the frame-pointer guess these
    /// walks ended inside std, before the application's functions.
    #[test]
    fn walks_out_of_std_sleep_and_a_contended_mutex() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::sync::Arc;
        crate::unwind::init_pool();
        let stop = Arc::new(AtomicBool::new(false));
        let m = Arc::new(std::sync::Mutex::new(()));
        let held = m.lock().unwrap();
        let (tx1, rx1) = mpsc::channel();
        let (tx2, rx2) = mpsc::channel();
        let (s1, m2) = (stop.clone(), m.clone());
        let h1 = std::thread::spawn(move || std_sleep_outer(tx1, &s1));
        let h2 = std::thread::spawn(move || std_lock_outer(tx2, &m2));
        let tids = [rx1.recv().unwrap(), rx2.recv().unwrap()];
        std::thread::sleep(std::time::Duration::from_millis(100));
        crate::unwind::refresh(true);
        let mut u = RemoteUnwinder::new();
        let mut sym = crate::symbolize::ProcessSymbolizer::new();
        for (tid, want) in tids.into_iter().zip([
            [
                "thread::functions::sleep",
                "std_sleep_inner",
                "std_sleep_outer",
            ],
            ["lock_contended", "std_lock_inner", "std_lock_outer"],
        ]) {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            let (sp, pc) = loop {
                if let TaskSyscall::InSyscall { sp, pc, .. } = task_syscall(None, tid) {
                    break (sp, pc);
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "thread {tid} never blocked"
                );
                std::thread::sleep(std::time::Duration::from_millis(2));
            };
            let mut out = [0u64; 128];
            let n = u.unwind(sp, pc, &mut out);
            let names: Vec<String> = sym.pass(|s| {
                out[..n]
                    .iter()
                    .flat_map(|&a| s.resolve(a))
                    .map(|f| f.name)
                    .collect()
            });
            let at = want.map(|f| names.iter().position(|n| n.contains(f)));
            assert!(
                at[0].is_some() && at[0] < at[1] && at[1] < at[2],
                "{want:?} at {at:?} in {names:#?}"
            );
            assert!(
                names.last().is_some_and(|n| n == "clone3"),
                "the walk reaches the thread's start: {names:#?}"
            );
        }
        stop.store(true, Ordering::Relaxed);
        drop(held);
        h1.join().unwrap();
        h2.join().unwrap();
    }
}
