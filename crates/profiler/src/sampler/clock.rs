//! The sampler's clocks: its period, the monotonic and stamp clocks, and its sleep between
//! ticks (a futex wait that a stop ends early).

use std::sync::atomic::{AtomicU32, Ordering};

use super::capture::Slot;
use crate::threads::clock_ns;

/// The sampling period: one tick of the sampler, one period of a thread's CPU timer.
pub(super) fn period_ns(settings: &crate::settings::Settings) -> u64 {
    1_000_000_000 / settings.cpu_hz.max(1) as u64
}

pub(super) fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC).unwrap_or(0)
}

/// A handler's time stamp. On x86_64 the TSC: one instruction and no memory access, where the
/// vDSO's clock read cost a handler ~0.8 µs of cold page-table and cache misses on the first
/// call. The sampler converts stamps with a scale it measures against the monotonic clock
/// ([`StampClock`]). Elsewhere the monotonic clock itself.
#[inline(always)]
pub(super) fn stamp() -> u64 {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: rdtsc only reads the time-stamp counter, present on every x86_64 CPU.
    let t = unsafe { std::arch::x86_64::_rdtsc() };
    #[cfg(not(target_arch = "x86_64"))]
    let t = monotonic_ns();
    t
}

/// Whether [`stamp`]s can stand for wall-clock time: the kernel's clock source is the TSC (it
/// found it constant-rate and synchronized across CPUs), or stamps are the monotonic clock.
/// Read once, outside handlers.
pub(super) fn stamps_are_wall_clock() -> bool {
    // An atomic, not a `OnceLock`: a fork while the sampler is inside `get_or_init` would leave
    // the child's copy "being initialized" forever, and its sampler waiting for it. Two threads
    // reading the file at once get the same answer.
    static ANSWER: AtomicU32 = AtomicU32::new(0);
    const NO: u32 = 1;
    const YES: u32 = 2;
    match ANSWER.load(Ordering::Relaxed) {
        NO => return false,
        YES => return true,
        _ => {}
    }
    let yes = cfg!(not(target_arch = "x86_64"))
        || std::fs::read_to_string(
            "/sys/devices/system/clocksource/clocksource0/current_clocksource",
        )
        .is_ok_and(|s| s.trim() == "tsc");
    ANSWER.store(if yes { YES } else { NO }, Ordering::Relaxed);
    yes
}

/// Converts [`stamp`]s to nanoseconds: the scale is measured between a reading at the
/// sampler's start and the latest one (taken every tick), so it converges to the counter's
/// exact rate.
pub(super) struct StampClock {
    pub(super) base: (u64, u64),
    pub(super) last: (u64, u64),
}

impl StampClock {
    pub(super) fn new() -> StampClock {
        let now = (stamp(), monotonic_ns());
        StampClock {
            base: now,
            last: now,
        }
    }

    pub(super) fn update(&mut self) {
        self.last = (stamp(), monotonic_ns());
    }

    /// Nanoseconds per stamp; until 100 µs have passed, a typical 2.5 GHz counter's.
    pub(super) fn scale(&self) -> f64 {
        if cfg!(not(target_arch = "x86_64")) {
            return 1.0;
        }
        let stamps = self.last.0.wrapping_sub(self.base.0);
        let ns = self.last.1.saturating_sub(self.base.1);
        if ns < 100_000 || stamps == 0 {
            return 0.4;
        }
        ns as f64 / stamps as f64
    }

    pub(super) fn duration_ns(&self, stamps: u64) -> u64 {
        (stamps as f64 * self.scale()) as u64
    }

    /// The monotonic time of a handler's `wall_at` (which is one already unless stamps are).
    pub(super) fn wall_ns(&self, slot: &Slot, wall_at: u64) -> u64 {
        if cfg!(not(target_arch = "x86_64")) || !slot.stamp_wall {
            return wall_at;
        }
        let back = self.last.0 as i128 - wall_at as i128;
        let ns = self.last.1 as i128 - (back as f64 * self.scale()) as i128;
        ns.clamp(0, i128::from(u64::MAX)) as u64
    }
}

pub(super) fn timespec(ns: u64) -> libc::timespec {
    libc::timespec {
        tv_sec: (ns / 1_000_000_000) as libc::time_t,
        tv_nsec: (ns % 1_000_000_000) as libc::c_long,
    }
}

/// Sleeps until `deadline_ns` (monotonic), or until `wake` no longer holds `seen` (`stop`).
pub(super) fn sleep_until(deadline_ns: u64, wake: &AtomicU32, seen: u32) {
    let ts = timespec(deadline_ns);
    while wake.load(Ordering::SeqCst) == seen && monotonic_ns() < deadline_ns {
        // SAFETY: a process-private futex wait on a word of ours with a valid absolute
        // timeout (FUTEX_WAIT_BITSET measures it on CLOCK_MONOTONIC); it returns at the
        // deadline, at a wake, when the word moved, or on a signal (the loop looks again).
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                wake.as_ptr(),
                libc::FUTEX_WAIT_BITSET | libc::FUTEX_PRIVATE_FLAG,
                seen,
                &ts as *const libc::timespec,
                std::ptr::null::<u32>(),
                libc::FUTEX_BITSET_MATCH_ANY,
            );
        }
    }
}
