//! CPU samples of another process's threads: per thread a software task-clock event of the
//! sampling period whose samples carry the thread's user registers and a copy of the top of its
//! user stack, read from a ring buffer the kernel fills. Nothing is sent to the target.

use std::io;

use ferroprof::perf_abi::{
    PerfEventAttr, COUNT_SW_TASK_CLOCK, FLAG_DISABLED, FLAG_EXCLUDE_HV, FLAG_EXCLUDE_KERNEL,
    FLAG_USE_CLOCKID, IOC_ENABLE as PERF_EVENT_IOC_ENABLE, RECORD_LOST,
    RECORD_SAMPLE as PERF_RECORD_SAMPLE, SAMPLE_PERIOD, SAMPLE_REGS_USER, SAMPLE_STACK_USER,
    SAMPLE_TID, SAMPLE_TIME, TYPE_SOFTWARE,
};

/// x86-64's perf register numbers of the three registers the unwinder starts from.
const REG_BP: u64 = 6;
const REG_SP: u64 = 7;
const REG_IP: u64 = 8;

/// Bytes of user stack each sample copies: deep enough for most stacks' frames past the
/// leaf (frames above the copy are cut; the rest of the profile stays right).
pub const STACK_BYTES: u32 = 32 << 10;
/// Fewest data pages of a ring: room for two samples.
const MIN_RING_PAGES: usize = 32;
/// Most data pages of a ring.
const MAX_RING_PAGES: usize = 256;

/// Data pages of each ring (a power of two) at `hz`: room for four 10 ms reads' worth of one
/// busy thread's samples. Rings are locked memory: an unprivileged user has
/// `kernel.perf_event_mlock_kb` plus `RLIMIT_MEMLOCK` for all of them, so they are no larger
/// than that needs (256 KiB a thread at 100 Hz).
pub fn ring_pages(hz: u32) -> usize {
    let per_sample = (STACK_BYTES as usize + 512).div_ceil(page());
    let samples = (hz as usize).div_ceil(100).max(1) * 4;
    (per_sample * samples)
        .next_power_of_two()
        .clamp(MIN_RING_PAGES, MAX_RING_PAGES)
}

/// One CPU sample.
pub struct Sample<'a> {
    /// The process.
    pub pid: i32,
    pub tid: i32,
    /// Task-clock nanoseconds since the thread's previous sample.
    pub period: u64,
    pub ip: u64,
    pub sp: u64,
    pub bp: u64,
    /// The user stack from `sp` up (empty when the thread was not in user space).
    pub stack: &'a [u8],
}

/// Why no event could be opened on a thread.
#[derive(Debug)]
pub enum OpenError {
    /// The thread ended meanwhile.
    Gone,
    /// `perf_event_open` refused (EACCES, EPERM): the kernel's policy or a seccomp filter.
    Refused(io::Error),
    /// The ring could not be mapped even at its smallest: past the locked-memory limit.
    NoRing,
    /// Anything else (out of descriptors).
    Other,
}

/// A thread's event and its ring buffer.
pub struct ThreadEvent {
    fd: libc::c_int,
    ring: *mut u8,
    ring_len: usize,
    /// Bytes consumed so far.
    tail: u64,
    /// Scratch: a record that wraps around the ring's end, made contiguous.
    scratch: Vec<u8>,
}

// SAFETY: the ring mapping is owned by this value and only touched through `&mut self`.
unsafe impl Send for ThreadEvent {}

fn page() -> usize {
    // SAFETY: sysconf has no preconditions.
    unsafe { libc::sysconf(libc::_SC_PAGESIZE) as usize }
}

impl ThreadEvent {
    /// Opens the event on thread `tid`, sampling every `period_ns` of its CPU time; with
    /// `kernel` false only time in user space is counted (what an unprivileged user may be
    /// allowed).
    /// `pages`: the ring's data pages ([`ring_pages`]); halved down to the smallest ring while
    /// the locked-memory limit refuses it.
    pub fn open(
        tid: i32,
        period_ns: u64,
        kernel: bool,
        pages: usize,
    ) -> Result<ThreadEvent, OpenError> {
        let mut flags = FLAG_DISABLED | FLAG_EXCLUDE_HV | FLAG_USE_CLOCKID;
        if !kernel {
            flags |= FLAG_EXCLUDE_KERNEL;
        }
        let attr = PerfEventAttr {
            kind: TYPE_SOFTWARE,
            config: COUNT_SW_TASK_CLOCK,
            sample_period: period_ns.max(1),
            sample_type: SAMPLE_TID
                | SAMPLE_TIME
                | SAMPLE_PERIOD
                | SAMPLE_REGS_USER
                | SAMPLE_STACK_USER,
            flags,
            wakeup_events: 1,
            sample_regs_user: (1 << REG_BP) | (1 << REG_SP) | (1 << REG_IP),
            sample_stack_user: STACK_BYTES,
            clockid: libc::CLOCK_MONOTONIC,
            ..PerfEventAttr::default()
        };
        // `tid` names a thread, any CPU.
        let fd = ferroprof::perf_abi::open(&attr, tid, -1).map_err(|e| match e.raw_os_error() {
            Some(libc::ESRCH) => OpenError::Gone,
            Some(libc::EACCES) | Some(libc::EPERM) => OpenError::Refused(e),
            _ => OpenError::Other,
        })?;
        let fd = fd as libc::c_int;
        let mut pages = pages
            .clamp(MIN_RING_PAGES, MAX_RING_PAGES)
            .next_power_of_two();
        let (ring, ring_len) = loop {
            let ring_len = (pages + 1) * page();
            // SAFETY: a shared read-write mapping of the event's ring (the kernel's required
            // shape: one metadata page and 2^n data pages); checked below.
            let ring = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    ring_len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd,
                    0,
                )
            };
            if ring != libc::MAP_FAILED {
                break (ring, ring_len);
            }
            if pages <= MIN_RING_PAGES {
                // SAFETY: our descriptor, closed once.
                unsafe { libc::close(fd) };
                return Err(OpenError::NoRing);
            }
            pages /= 2;
        };
        // SAFETY: our event's descriptor.
        if unsafe { libc::ioctl(fd, PERF_EVENT_IOC_ENABLE as _, 0) } != 0 {
            // SAFETY: our mapping and descriptor, released once.
            unsafe {
                libc::munmap(ring, ring_len);
                libc::close(fd);
            }
            return Err(OpenError::Other);
        }
        Ok(ThreadEvent {
            fd,
            ring: ring as *mut u8,
            ring_len,
            tail: 0,
            scratch: Vec::new(),
        })
    }

    /// The thread's CPU time since the event was enabled, in nanoseconds: all of it, also when
    /// only user-space samples are taken (the task clock counts kernel time regardless).
    pub fn count(&self) -> Option<u64> {
        let mut v = 0u64;
        // SAFETY: reading an event with no read_format flags gives one u64.
        let n = unsafe { libc::read(self.fd, (&mut v as *mut u64).cast(), 8) };
        (n == 8).then_some(v)
    }

    /// Hands every sample written since the last call to `f`. Returns the samples the
    /// kernel lost for want of room (`PERF_RECORD_LOST`).
    pub fn drain(&mut self, mut f: impl FnMut(&Sample<'_>)) -> u64 {
        let page = page();
        let data_len = (self.ring_len - page) as u64;
        // SAFETY: the metadata page is the mapping's first; `data_head` (offset 1024) is
        // written by the kernel, read with acquire ordering as its ABI asks.
        let head_ptr = unsafe { self.ring.add(1024) } as *const std::sync::atomic::AtomicU64;
        // SAFETY: as above, an aligned u64 inside the mapping.
        let head = unsafe { (*head_ptr).load(std::sync::atomic::Ordering::Acquire) };
        // SAFETY: the data pages follow the metadata page.
        let data = unsafe { std::slice::from_raw_parts(self.ring.add(page), data_len as usize) };
        let mut lost = 0;
        while self.tail + 8 <= head {
            let at = (self.tail % data_len) as usize;
            let header = read_wrapped(data, at, 8, &mut self.scratch).to_vec();
            let kind = u32::from_ne_bytes(header[0..4].try_into().unwrap_or_default());
            let size = u16::from_ne_bytes(header[6..8].try_into().unwrap_or_default()) as usize;
            if size < 8 || self.tail + size as u64 > head {
                break;
            }
            let rec = read_wrapped(data, at, size, &mut self.scratch);
            match kind {
                PERF_RECORD_SAMPLE => {
                    if let Some(s) = parse_sample(&rec[8..]) {
                        f(&s);
                    }
                }
                // id, count.
                RECORD_LOST if rec.len() >= 24 => {
                    lost += u64::from_ne_bytes(rec[16..24].try_into().unwrap_or_default());
                }
                _ => {}
            }
            self.tail += size as u64;
        }
        // SAFETY: `data_tail` (offset 1032) tells the kernel what we consumed; release
        // ordering, as the ABI asks.
        let tail_ptr = unsafe { self.ring.add(1032) } as *const std::sync::atomic::AtomicU64;
        // SAFETY: as above.
        unsafe { (*tail_ptr).store(self.tail, std::sync::atomic::Ordering::Release) };
        lost
    }
}

impl Drop for ThreadEvent {
    fn drop(&mut self) {
        // SAFETY: our mapping and descriptor, released once.
        unsafe {
            libc::munmap(self.ring as *mut libc::c_void, self.ring_len);
            libc::close(self.fd);
        }
    }
}

/// `len` bytes of the ring from `at`, copied into `scratch` when they wrap past its end.
fn read_wrapped<'a>(data: &'a [u8], at: usize, len: usize, scratch: &'a mut Vec<u8>) -> &'a [u8] {
    if at + len <= data.len() {
        return &data[at..at + len];
    }
    scratch.clear();
    let first = data.len() - at;
    scratch.extend_from_slice(&data[at..]);
    scratch.extend_from_slice(&data[..len - first]);
    scratch
}

/// A sample record's body, in the order the kernel writes the fields asked for: tid, time,
/// period, user registers (ABI, then bp, sp, ip), user stack (size, bytes, dynamic size).
fn parse_sample(b: &[u8]) -> Option<Sample<'_>> {
    let u64_at =
        |o: usize| -> Option<u64> { Some(u64::from_ne_bytes(b.get(o..o + 8)?.try_into().ok()?)) };
    let pid = u32::from_ne_bytes(b.get(0..4)?.try_into().ok()?) as i32;
    let tid = u32::from_ne_bytes(b.get(4..8)?.try_into().ok()?) as i32;
    let period = u64_at(16)?;
    let abi = u64_at(24)?;
    let mut o = 32;
    let (mut bp, mut sp, mut ip) = (0, 0, 0);
    if abi != 0 {
        bp = u64_at(o)?;
        sp = u64_at(o + 8)?;
        ip = u64_at(o + 16)?;
        o += 24;
    }
    let size = u64_at(o)? as usize;
    o += 8;
    let mut stack: &[u8] = &[];
    if size != 0 {
        let bytes = b.get(o..o + size)?;
        let dyn_size = u64_at(o + size)? as usize;
        stack = &bytes[..dyn_size.min(size)];
    }
    Some(Sample {
        pid,
        tid,
        period,
        ip,
        sp,
        bp,
        stack: if abi == 0 { &[] } else { stack },
    })
}

/// `/proc/sys/kernel/perf_event_paranoid`, when readable.
pub fn paranoid() -> Option<i32> {
    std::fs::read_to_string("/proc/sys/kernel/perf_event_paranoid")
        .ok()?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sample_body_parses_in_the_kernels_field_order() {
        let mut b = Vec::new();
        b.extend_from_slice(&7u32.to_ne_bytes()); // pid
        b.extend_from_slice(&9u32.to_ne_bytes()); // tid
        b.extend_from_slice(&100u64.to_ne_bytes()); // time
        b.extend_from_slice(&10_000_000u64.to_ne_bytes()); // period
        b.extend_from_slice(&2u64.to_ne_bytes()); // ABI 64
        for r in [0x1000u64, 0x2000, 0x3000] {
            b.extend_from_slice(&r.to_ne_bytes());
        }
        b.extend_from_slice(&16u64.to_ne_bytes());
        b.extend_from_slice(&[0xaa; 16]);
        b.extend_from_slice(&8u64.to_ne_bytes()); // dyn size
        let s = parse_sample(&b).unwrap();
        assert_eq!((s.pid, s.tid, s.period), (7, 9, 10_000_000));
        assert_eq!((s.bp, s.sp, s.ip), (0x1000, 0x2000, 0x3000));
        assert_eq!(s.stack, &[0xaa; 8]);
    }

    #[test]
    fn rings_hold_four_reads_of_samples_within_bounds() {
        // 32 KiB of stack and a header: 9 pages a sample; 4 samples at 100 Hz.
        assert_eq!(ring_pages(100), 64);
        assert_eq!(ring_pages(1), 64);
        assert_eq!(ring_pages(1000), MAX_RING_PAGES);
    }

    #[test]
    fn a_record_wrapping_the_rings_end_reads_whole() {
        let data: Vec<u8> = (0..16).collect();
        let mut scratch = Vec::new();
        assert_eq!(read_wrapped(&data, 14, 4, &mut scratch), &[14, 15, 0, 1]);
        assert_eq!(read_wrapped(&data, 2, 3, &mut scratch), &[2, 3, 4]);
    }
}
