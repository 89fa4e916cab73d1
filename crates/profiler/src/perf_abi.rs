//! The part of Linux's `perf_event_open` interface ferroprof uses, written once: the
//! in-process CPU engine (`sampler/perf.rs`) and `ferroprof-attach` (`record -p`) open their
//! task-clock events through it.

/// `struct perf_event_attr` up to `sample_max_stack` (its fifth version, 112 bytes; a kernel
/// reads the fields up to the `size` given).
#[repr(C)]
#[derive(Default, Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct PerfEventAttr {
    /// `type`.
    pub kind: u32,
    pub size: u32,
    pub config: u64,
    pub sample_period: u64,
    pub sample_type: u64,
    pub read_format: u64,
    /// The bit fields (`disabled`, `inherit`, `exclude_kernel`...): the `FLAG_` constants.
    pub flags: u64,
    pub wakeup_events: u32,
    pub bp_type: u32,
    pub config1: u64,
    pub config2: u64,
    pub branch_sample_type: u64,
    pub sample_regs_user: u64,
    pub sample_stack_user: u32,
    pub clockid: i32,
    pub sample_regs_intr: u64,
    pub aux_watermark: u32,
    pub sample_max_stack: u16,
    pub reserved: u16,
}

/// `PERF_TYPE_SOFTWARE`.
pub const TYPE_SOFTWARE: u32 = 1;
/// `PERF_COUNT_SW_TASK_CLOCK`: the thread's CPU time, on a high-resolution timer.
pub const COUNT_SW_TASK_CLOCK: u64 = 1;
/// `disabled`.
pub const FLAG_DISABLED: u64 = 1 << 0;
/// `exclude_kernel`.
pub const FLAG_EXCLUDE_KERNEL: u64 = 1 << 5;
/// `exclude_hv`.
pub const FLAG_EXCLUDE_HV: u64 = 1 << 6;
/// `use_clockid`.
pub const FLAG_USE_CLOCKID: u64 = 1 << 25;
/// `PERF_SAMPLE_TID`.
pub const SAMPLE_TID: u64 = 1 << 1;
/// `PERF_SAMPLE_TIME`.
pub const SAMPLE_TIME: u64 = 1 << 2;
/// `PERF_SAMPLE_PERIOD`.
pub const SAMPLE_PERIOD: u64 = 1 << 8;
/// `PERF_SAMPLE_REGS_USER`.
pub const SAMPLE_REGS_USER: u64 = 1 << 12;
/// `PERF_SAMPLE_STACK_USER`.
pub const SAMPLE_STACK_USER: u64 = 1 << 13;
/// `PERF_FLAG_FD_CLOEXEC`.
pub const FLAG_FD_CLOEXEC: libc::c_ulong = 1 << 3;
/// `PERF_EVENT_IOC_ENABLE`.
pub const IOC_ENABLE: libc::c_ulong = 0x2400;
/// `PERF_EVENT_IOC_DISABLE`.
pub const IOC_DISABLE: libc::c_ulong = 0x2401;
/// `PERF_RECORD_LOST`.
pub const RECORD_LOST: u32 = 2;
/// `PERF_RECORD_SAMPLE`.
pub const RECORD_SAMPLE: u32 = 9;

/// `perf_event_open(attr, pid, cpu, -1, PERF_FLAG_FD_CLOEXEC)` with `attr.size` set: the
/// descriptor, or the kernel's error.
pub fn open(attr: &PerfEventAttr, pid: i32, cpu: i32) -> std::io::Result<libc::c_int> {
    let attr = PerfEventAttr {
        size: std::mem::size_of::<PerfEventAttr>() as u32,
        ..*attr
    };
    // SAFETY: a valid attr of the size it declares; the kernel checks pid and cpu.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_perf_event_open,
            &attr as *const PerfEventAttr,
            pid as libc::pid_t,
            cpu as libc::c_int,
            -1 as libc::c_int,
            FLAG_FD_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(fd as libc::c_int)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_attr_has_the_kernels_fifth_size() {
        assert_eq!(std::mem::size_of::<super::PerfEventAttr>(), 112);
    }
}
