//! The process's threads as `/proc/self/task` lists them: their ids, names and start times.

use super::clock::monotonic_ns;
use crate::threads::clock_ns;

/// Lists this process's thread ids with `getdents64` on an open `/proc/self/task`.
pub(super) struct TaskLister {
    pub(super) fd: libc::c_int,
    pub(super) buf: Vec<u8>,
}

impl TaskLister {
    pub(super) fn open() -> Option<TaskLister> {
        // SAFETY: NUL-terminated path literal.
        let fd = unsafe {
            libc::open(
                c"/proc/self/task".as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        (fd >= 0).then(|| TaskLister {
            fd,
            buf: vec![0u8; 16 * 1024],
        })
    }

    pub(super) fn list(&mut self, out: &mut Vec<i32>) -> bool {
        out.clear();
        // SAFETY: fd is our open directory.
        if unsafe { libc::lseek(self.fd, 0, libc::SEEK_SET) } < 0 {
            return false;
        }
        loop {
            // SAFETY: the buffer is valid for its length.
            let n = unsafe {
                libc::syscall(
                    libc::SYS_getdents64,
                    self.fd,
                    self.buf.as_mut_ptr(),
                    self.buf.len(),
                )
            };
            if n < 0 {
                return false;
            }
            if n == 0 {
                return true;
            }
            let mut off = 0usize;
            while off + 19 < n as usize {
                // linux_dirent64: u64 ino, i64 off, u16 reclen, u8 type, name...
                let reclen = u16::from_ne_bytes([self.buf[off + 16], self.buf[off + 17]]) as usize;
                if reclen == 0 {
                    break;
                }
                let name = &self.buf[off + 19..(off + reclen).min(n as usize)];
                let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
                if let Some(tid) = std::str::from_utf8(&name[..end])
                    .ok()
                    .and_then(|s| s.parse::<i32>().ok())
                {
                    out.push(tid);
                }
                off += reclen;
            }
        }
    }
}

impl Drop for TaskLister {
    fn drop(&mut self) {
        // SAFETY: we own the fd.
        unsafe { libc::close(self.fd) };
    }
}

/// Reads `/proc/self/task/<tid>/<file>` into `buf`, relative to the sampler's open
/// `/proc/self/task` when there is one (a path walk from the root and a `String` per read were
/// most of the cost of name checks). The bytes read; None when the file cannot be read (the
/// thread is gone). Allocates nothing.
pub(crate) fn read_task_file(
    dirfd: Option<libc::c_int>,
    tid: i32,
    file: &str,
    buf: &mut [u8],
) -> Option<usize> {
    use std::io::Write;
    let mut path = [0u8; 48];
    let mut w = &mut path[..];
    // Leaves at least one zero byte: the longest, "/proc/self/task/<tid>/syscall", is 34 bytes.
    let (base, written) = match dirfd {
        Some(fd) => (fd, write!(w, "{tid}/{file}")),
        None => (libc::AT_FDCWD, write!(w, "/proc/self/task/{tid}/{file}")),
    };
    if written.is_err() || w.is_empty() {
        return None;
    }
    // SAFETY: `path` is NUL-terminated (zero-filled beyond what was written); `base` is the
    // open task directory or AT_FDCWD (the path is absolute then).
    let fd = unsafe {
        libc::openat(
            base,
            path.as_ptr() as *const libc::c_char,
            libc::O_RDONLY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return None;
    }
    // SAFETY: the buffer is valid for its length; we own fd and close it once.
    let n = unsafe {
        let n = libc::read(fd, buf.as_mut_ptr() as *mut libc::c_void, buf.len());
        libc::close(fd);
        n
    };
    usize::try_from(n).ok()
}

/// Thread `tid`'s name (kernel `comm`, at most 15 bytes) into `buf`; empty when unreadable.
pub(super) fn read_comm(dirfd: Option<libc::c_int>, tid: i32, buf: &mut [u8; 64]) -> &str {
    let n = read_task_file(dirfd, tid, "comm", buf).unwrap_or(0);
    let name = buf[..n].strip_suffix(b"\n").unwrap_or(&buf[..n]);
    std::str::from_utf8(name).unwrap_or("")
}

/// When thread `tid` started, on the monotonic clock: its start time in
/// `/proc/self/task/<tid>/stat` (clock ticks since boot) moved from the boot-time clock, plus
/// half a tick (it started within that tick). `None` when the file cannot be read.
pub(super) fn thread_start_ns(dirfd: Option<libc::c_int>, tid: i32) -> Option<u64> {
    let mut buf = [0u8; 512];
    let n = read_task_file(dirfd, tid, "stat", &mut buf)?;
    let text = std::str::from_utf8(&buf[..n]).ok()?;
    // The name, in parentheses, may hold spaces and parentheses: fields follow the last ')'.
    // The start time is the 22nd field, the 20th after the name.
    let rest = &text[text.rfind(')')? + 1..];
    let ticks: u64 = rest.split_ascii_whitespace().nth(19)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let hz = u64::try_from(hz).ok().filter(|&h| h > 0)?;
    let tick = 1_000_000_000 / hz;
    let start_boot = ticks.checked_mul(tick)? + tick / 2;
    let since_start = clock_ns(libc::CLOCK_BOOTTIME)?.checked_sub(start_boot)?;
    Some(monotonic_ns().saturating_sub(since_start))
}

/// Replaces `name` with thread `tid`'s current name; whether it changed.
pub(super) fn refresh_name(dirfd: Option<libc::c_int>, tid: i32, name: &mut String) -> bool {
    let mut buf = [0u8; 64];
    let fresh = read_comm(dirfd, tid, &mut buf);
    if fresh == name.as_str() {
        return false;
    }
    fresh.clone_into(name);
    true
}
