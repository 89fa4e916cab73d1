//! Where another process's threads wait: a blocked thread's user stack pointer and program
//! counter at its system call (`/proc/PID/task/TID/syscall`) and a copy of its stack
//! (`process_vm_readv`), unwound as a CPU sample's. Both need the right to trace the process
//! (the same user where Yama's ptrace scope allows it, or root); without it there is no wall
//! profile and the summary says so.

/// The thread's scheduler state (`R` running or runnable, `S` and `D` waiting...), `None`
/// when it is gone.
pub fn state(pid: i32, tid: i32) -> Option<char> {
    crate::procfs::state(&format!("/proc/{pid}/task/{tid}/stat"))
}

/// Where a waiting thread entered the kernel: (sp, pc). `Err` when the file cannot be read
/// (no right to trace the process); `Ok(None)` when the thread is running.
pub fn blocked_at(pid: i32, tid: i32) -> std::io::Result<Option<(u64, u64)>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/syscall"))?;
    Ok(parse_syscall(&text))
}

/// `nr arg1 ... arg6 sp pc`, or `-1 sp pc` (in the kernel outside a system call), or
/// `running`.
fn parse_syscall(text: &str) -> Option<(u64, u64)> {
    let f: Vec<&str> = text.split_whitespace().collect();
    if f.first() == Some(&"running") || f.len() < 3 {
        return None;
    }
    let hex = |s: &str| u64::from_str_radix(s.trim_start_matches("0x"), 16).ok();
    let sp = hex(f[f.len() - 2])?;
    let pc = hex(f[f.len() - 1])?;
    (sp != 0 && pc != 0).then_some((sp, pc))
}

/// Copies up to `buf.len()` bytes of the process's memory from `addr`; the bytes read (fewer
/// at the end of a mapping, 0 on refusal).
pub fn read_memory(pid: i32, addr: u64, buf: &mut [u8]) -> usize {
    let mut got = 0;
    // Page by page past the first refusal is not needed: a stack is one mapping, and a read
    // stops at its end.
    while got < buf.len() {
        let local = libc::iovec {
            iov_base: buf[got..].as_mut_ptr() as *mut libc::c_void,
            iov_len: buf.len() - got,
        };
        let remote = libc::iovec {
            iov_base: (addr + got as u64) as *mut libc::c_void,
            iov_len: buf.len() - got,
        };
        // SAFETY: one local iovec over our own buffer, one remote iovec; the kernel checks
        // the remote range and our right to read it.
        let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
        if n <= 0 {
            break;
        }
        got += n as usize;
    }
    got
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn syscall_lines_parse() {
        assert_eq!(
            parse_syscall("230 0x1 0x0 0x7ffd0 0x0 0x0 0x0 0x7ffc1000 0x7f0012345678\n"),
            Some((0x7ffc1000, 0x7f0012345678))
        );
        assert_eq!(
            parse_syscall("-1 0x7ffc2000 0x55aa00001234\n"),
            Some((0x7ffc2000, 0x55aa00001234))
        );
        assert_eq!(parse_syscall("running\n"), None);
    }

    #[test]
    fn own_memory_reads_back() {
        let data = [7u8; 4096];
        let mut buf = [0u8; 4096];
        let n = read_memory(std::process::id() as i32, data.as_ptr() as u64, &mut buf);
        assert_eq!(n, 4096);
        assert_eq!(buf, data);
    }
}
