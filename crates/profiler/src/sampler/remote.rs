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
    match super::tasks::read_task_file(task_dir, tid, "syscall", &mut buf) {
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

    /// Copies the stack of a thread stopped at (`sp`, `pc`) and unwinds it into `out`, and
    /// where the stack pointer stood in each frame into `sps` (as many as it holds); the
    /// number of frames, 0 when the stack cannot be read. `Err` when `stood_still`, asked
    /// right after the copy, says the thread ran meanwhile (the copy may be torn); the walk
    /// itself goes over the copy, so the thread may run during it.
    pub(crate) fn unwind(
        &mut self,
        sp: u64,
        pc: u64,
        out: &mut [u64],
        sps: &mut [u64],
        stood_still: &mut dyn FnMut() -> bool,
    ) -> Result<usize, ()> {
        if sp == 0 || pc == 0 {
            return Ok(0);
        }
        let n = unwind::read_own_memory(sp, &mut self.copy);
        if !stood_still() {
            return Err(());
        }
        if n < 8 {
            return Ok(0);
        }
        // A full copy may have more stack above it: a walk that runs off it is cut, and marked.
        let more_above = n == self.copy.len();
        Ok(unwind::unwind_copied(
            pc,
            sp,
            &self.copy[..n],
            more_above,
            &mut self.cache,
            out,
            sps,
        ))
    }

    /// Where a thread that cannot be stopped to read its registers (runnable, so the kernel
    /// does not give them) most recently called from, given an earlier stack of it: `frames`
    /// (innermost first, return addresses less one past the first) and where the stack pointer
    /// stood in each, `sps`. Every call leaves its return address in the slot just below the
    /// caller's stack pointer, and the slot keeps it after the call returns, until the next
    /// call from that frame. So the outermost frame whose slot changed is where the thread
    /// went since, the new return address says which call it made there, and the calls below
    /// it are found by their return addresses, each checked against the unwind rules at its
    /// depth ([`unwind::returns_into`]). For a thread just woken from a blocking call and
    /// waiting for a CPU, that is the call it waited in.
    ///
    /// Writes the stack into `out` and `out_sps` (same form) and returns its length; 0 when
    /// nothing changed, the stack is unknown or cut, or the change does not check out; `Err`
    /// when the thread ran during the copy (see [`Self::unwind`]).
    pub(crate) fn recent_calls(
        &mut self,
        frames: &[u64],
        sps: &[u64],
        out: &mut [u64],
        out_sps: &mut [u64],
        stood_still: &mut dyn FnMut() -> bool,
    ) -> Result<usize, ()> {
        let n = frames.len();
        if n < 3 || sps.len() != n || out.len() < n || out_sps.len() < out.len() {
            return Ok(0);
        }
        if frames.iter().any(|&f| unwind::is_marker(f)) {
            return Ok(0);
        }
        // The window read: from well below the old leaf (the thread may have gone deeper) up.
        let lo = sps[0].saturating_sub(SCAN_BYTES as u64) & !7;
        let got = unwind::read_own_memory(lo, &mut self.copy);
        if !stood_still() {
            return Err(());
        }
        Ok(calls_in_copy(
            lo,
            &self.copy[..got],
            &mut self.cache,
            frames,
            sps,
            out,
            out_sps,
        ))
    }
}

/// [`RemoteUnwinder::recent_calls`] over `copy`, the stack from `lo`.
fn calls_in_copy(
    lo: u64,
    copy: &[u8],
    cache: &mut OwnCache,
    frames: &[u64],
    sps: &[u64],
    out: &mut [u64],
    out_sps: &mut [u64],
) -> usize {
    let n = frames.len();
    let hi = lo + copy.len() as u64;
    let read = |addr: u64| -> Result<u64, ()> {
        if addr < lo || addr.checked_add(8).is_none_or(|e| e > hi) {
            return Err(());
        }
        let off = (addr - lo) as usize;
        Ok(u64::from_ne_bytes(
            copy[off..off + 8].try_into().map_err(|_| ())?,
        ))
    };
    // The outermost frame whose call changed (frames past the window count as unchanged).
    let Some(i) = (1..n)
        .rev()
        .find(|&k| read(sps[k].wrapping_sub(8)).is_ok_and(|w| w != frames[k].wrapping_add(1)))
    else {
        return 0;
    };
    if i + 1 >= n {
        return 0;
    }
    let mut slot = sps[i] - 8;
    let Ok(mut ret) = read(slot) else {
        return 0;
    };
    let outer_ret = frames[i + 1].wrapping_add(1);
    if !unwind::returns_into(ret, slot, sps[i + 1], outer_ret, cache, read) {
        return 0;
    }
    // Below it, deepest last; then frame i's new call and the unchanged frames above.
    let keep = n - i;
    let room = out.len() - keep;
    let mut found = 0;
    let mut below = [(0u64, 0u64); MAX_CALLS_BELOW];
    while found < room.min(MAX_CALLS_BELOW) {
        // Where the callee's call came from, when several words check out: the one whose
        // calls go on deepest. A call that returned leaves a chain that checks out too,
        // but a newer call at or below its frames overwrites part of it, where the newest
        // chain is whole down to the thread's leaf (a thread woken in a mutex wait, after
        // a sleep through another function of the same caller, leaves the sleep's frames
        // above the mutex's when the sleep's function has the smaller frame).
        let cands = callees(slot, ret, lo, MAX_CANDIDATES, cache, read);
        let pick = match cands.len() {
            0 => break,
            1 => cands[0],
            _ => {
                let mut best = (cands[0], 0usize);
                for &(v, a) in cands.iter() {
                    let depth = chain_depth(a, v, lo, cache, read);
                    if depth > best.1 {
                        best = ((v, a), depth);
                    }
                }
                best.0
            }
        };
        below[found] = pick;
        found += 1;
        (ret, slot) = pick;
    }
    let mut k = 0;
    for &(v, a) in below[..found].iter().rev() {
        out[k] = v - 1;
        out_sps[k] = a + 8;
        k += 1;
    }
    out[k] = read(sps[i] - 8).map_or(0, |w| w - 1);
    out_sps[k] = sps[i];
    k += 1;
    out[k..k + keep - 1].copy_from_slice(&frames[i + 1..]);
    out_sps[k..k + keep - 1].copy_from_slice(&sps[i + 1..]);
    k + keep - 1
}

/// Words below the slot `slot` (holding return address `ret`) that check out as the return
/// address of the callee's own call (see [`unwind::returns_into`]), nearest first, at most
/// `limit` (up to [`MAX_CANDIDATES`]).
fn callees(
    slot: u64,
    ret: u64,
    lo: u64,
    limit: usize,
    cache: &mut unwind::OwnCache,
    read: impl Fn(u64) -> Result<u64, ()> + Copy,
) -> arrayvec_like::Small {
    let mut out = arrayvec_like::Small::default();
    for a in (1..=FRAME_SCAN_WORDS)
        .map(|w| slot.wrapping_sub(8 * w))
        .take_while(|&a| a >= lo)
    {
        let Ok(v) = read(a) else { break };
        if v != 0 && unwind::returns_into(v, a, slot + 8, ret, cache, read) {
            out.push((v, a));
            if out.len() == limit.min(MAX_CANDIDATES) {
                break;
            }
        }
    }
    out
}

/// How many calls go on below slot `slot` (return address `ret`), each the nearest word that
/// checks out, up to [`MAX_CALLS_BELOW`].
fn chain_depth(
    mut slot: u64,
    mut ret: u64,
    lo: u64,
    cache: &mut unwind::OwnCache,
    read: impl Fn(u64) -> Result<u64, ()> + Copy,
) -> usize {
    let mut depth = 0;
    while depth < MAX_CALLS_BELOW {
        let Some(&(v, a)) = callees(slot, ret, lo, 1, cache, read).first() else {
            break;
        };
        depth += 1;
        (ret, slot) = (v, a);
    }
    depth
}

/// A few (return address, slot) pairs, without allocating.
mod arrayvec_like {
    #[derive(Default)]
    pub(super) struct Small {
        items: [(u64, u64); super::MAX_CANDIDATES],
        len: usize,
    }

    impl Small {
        pub(super) fn push(&mut self, item: (u64, u64)) {
            self.items[self.len] = item;
            self.len += 1;
        }

        pub(super) fn len(&self) -> usize {
            self.len
        }
    }

    impl std::ops::Deref for Small {
        type Target = [(u64, u64)];
        fn deref(&self) -> &[(u64, u64)] {
            &self.items[..self.len]
        }
    }
}

/// Most candidates weighed for one callee.
const MAX_CANDIDATES: usize = 4;

/// How far below a stale stack's leaf [`RemoteUnwinder::recent_calls`] looks for newer calls.
const SCAN_BYTES: usize = 32 * 1024;
/// How far below a caller's slot it looks for its callee's slot (the callee's frame size).
const FRAME_SCAN_WORDS: u64 = 1024;
/// Most calls it finds below the frame that changed.
const MAX_CALLS_BELOW: usize = 48;

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
        let n = u
            .unwind(sp, pc, &mut out, &mut [0; 128], &mut || true)
            .unwrap();
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
        assert_eq!(u.unwind(8, 0x1000, &mut out, &mut [], &mut || true), Ok(0));
    }

    #[inline(never)]
    fn recent_leaf_a(fd: libc::c_int) {
        remote_probe_leaf(fd);
        std::hint::black_box(fd);
    }

    #[inline(never)]
    fn recent_leaf_b(fd: libc::c_int) {
        let mut pad = [0u8; 200];
        std::hint::black_box(&mut pad);
        remote_probe_leaf(fd);
        std::hint::black_box(&pad);
    }

    #[inline(never)]
    fn recent_middle(a: libc::c_int, b: libc::c_int) {
        recent_leaf_a(a);
        recent_leaf_b(b);
        std::hint::black_box((a, b));
    }

    /// Where thread `tid` blocks in `poll` (other than at `not`). Only `poll` counts: the
    /// thread's `tx.send` wakes the test's `recv` from inside a futex call, and a read of
    /// /proc taken before that call returned gave a stack that was never blocked.
    /// Overwrites the 16 KiB of stack below the caller.
    #[inline(never)]
    fn scrub_stack() {
        let mut pad = [0u8; 16 * 1024];
        std::hint::black_box(&mut pad);
    }

    fn blocked_at(tid: i32, not: Option<(u64, u64)>) -> (u64, u64) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            if let TaskSyscall::InSyscall { nr, sp, pc } = task_syscall(None, tid) {
                if (nr == libc::SYS_poll || nr == libc::SYS_ppoll) && Some((sp, pc)) != not {
                    return (sp, pc);
                }
            }
            assert!(std::time::Instant::now() < deadline, "never blocked");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }

    /// A thread read blocked in one call, then blocked in another: the calls it made since
    /// lead from the old stack to the new one without its registers.
    #[test]
    fn finds_the_calls_a_thread_made_since_its_stack_was_read() {
        crate::unwind::init_pool();
        crate::unwind::refresh(true);
        let mut a = [0; 2];
        let mut b = [0; 2];
        // SAFETY: valid out arrays for two descriptors each.
        assert_eq!(
            unsafe { libc::pipe(a.as_mut_ptr()) + libc::pipe(b.as_mut_ptr()) },
            0
        );
        let (tx, rx) = mpsc::channel();
        let (ra, rb) = (a[0], b[0]);
        let h = std::thread::spawn(move || {
            // SAFETY: gettid has no preconditions.
            tx.send(unsafe { libc::gettid() }).unwrap();
            // The send left its calls' return addresses below this frame (deeper ones when the
            // receiver was already parked: a futex wake). A chain of returned calls deeper
            // than the live one checks out as well and wins ("the deepest chain"): a known limit
            // of `recent_calls`, which this test leaves out by clearing that memory first.
            scrub_stack();
            recent_middle(ra, rb);
        });
        let tid = rx.recv().unwrap();
        let mut u = RemoteUnwinder::new();
        let (mut old, mut old_sps) = ([0u64; 128], [0u64; 128]);
        let first = blocked_at(tid, None);
        let n_old = u
            .unwind(first.0, first.1, &mut old, &mut old_sps, &mut || true)
            .unwrap();
        let (old, old_sps) = (&old[..n_old], &old_sps[..n_old]);
        // Still blocked where it was read: nothing changed.
        let (mut out, mut out_sps) = ([0u64; 128], [0u64; 128]);
        assert_eq!(
            u.recent_calls(old, old_sps, &mut out, &mut out_sps, &mut || true),
            Ok(0)
        );
        // SAFETY: closing our own pipe's write end wakes the reader, which goes on to b.
        unsafe { libc::close(a[1]) };
        let second = blocked_at(tid, Some(first));
        let (mut now, mut now_sps) = ([0u64; 128], [0u64; 128]);
        let n_now = u
            .unwind(second.0, second.1, &mut now, &mut now_sps, &mut || true)
            .unwrap();
        let n = u
            .recent_calls(old, old_sps, &mut out, &mut out_sps, &mut || true)
            .unwrap();
        // SAFETY: as above, for b.
        unsafe { libc::close(b[1]) };
        h.join().unwrap();
        // SAFETY: our own descriptors.
        unsafe {
            libc::close(a[0]);
            libc::close(b[0]);
        }
        assert!(n > 0, "old {old:x?}");
        let (found, found_sps) = (&out[..n], &out_sps[..n]);
        // The same frames as a fresh walk of where it blocks now, but for the innermost: the
        // innermost function's latest call may have returned (libc's poll calls a helper
        // before its system call), its frame is then seen at that call.
        assert!(
            now[..n_now].ends_with(&found[1..]) && now_sps[..n_now].ends_with(&found_sps[1..]),
            "found {found:x?} at {found_sps:x?}, now {:x?}",
            &now[..n_now]
        );
        let leaf = now[n_now - n];
        assert!(
            found[0] <= leaf && leaf - found[0] < 256 && found_sps[0] == now_sps[n_now - n],
            "innermost {:x} at {:x}, now {leaf:x} at {:x}",
            found[0],
            found_sps[0],
            now_sps[n_now - n]
        );
        // It left leaf a's call and made leaf b's: frames of the old stack are gone, new ones
        // found.
        let gone: Vec<u64> = old
            .iter()
            .copied()
            .filter(|f| !now[..n_now].contains(f))
            .collect();
        assert!(!gone.is_empty(), "old {old:x?}");
        assert!(found.iter().all(|f| !gone.contains(f)), "{found:x?}");
        assert!(found[1..].iter().any(|f| !old.contains(f)), "{found:x?}");
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

    /// Reads the clock right before it sleeps and after: the clock calls leave their return
    /// addresses in the stack the sleep's frames then reuse.
    #[inline(never)]
    fn nap_between_polls(stop: &std::sync::atomic::AtomicBool) {
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            let t = std::time::Instant::now();
            std::thread::sleep(std::time::Duration::from_millis(20));
            std::hint::black_box(t.elapsed());
        }
    }

    #[inline(never)]
    fn nap_outer(tx: mpsc::Sender<i32>, stop: &std::sync::atomic::AtomicBool) {
        // SAFETY: gettid has no preconditions.
        tx.send(unsafe { libc::gettid() }).unwrap();
        nap_between_polls(stop);
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
        let (tx3, rx3) = mpsc::channel();
        let s3 = stop.clone();
        let h3 = std::thread::spawn(move || nap_outer(tx3, &s3));
        let tids = [
            rx1.recv().unwrap(),
            rx2.recv().unwrap(),
            rx3.recv().unwrap(),
        ];
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
            ["thread::functions::sleep", "nap_between_polls", "nap_outer"],
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
            let n = u
                .unwind(sp, pc, &mut out, &mut [0; 128], &mut || true)
                .unwrap();
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
        h3.join().unwrap();
    }
}
