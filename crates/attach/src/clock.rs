//! A thread's CPU time as its own CPU clock reads it, for the weights of its samples.
//!
//! The samples come from perf's task clock, which runs whenever the thread is on a CPU as the
//! kernel sees it. On a virtual machine that includes steal time: the hypervisor ran another
//! guest while the thread held the vCPU. The scheduler's runtime (`sum_exec_runtime`, what
//! `CLOCK_THREAD_CPUTIME_ID` and `/proc/PID/task/TID/schedstat` read) leaves steal out when the
//! kernel accounts for it, so a profile weighted by task-clock periods reads more CPU than the
//! thread used: 2% more over a second and a half on a busy host. Each thread's clock pairs the
//! two readings: a sample weighs its period times the runtime's share of the task clock lately,
//! and the CPU no sample carries is what the runtime counted beyond the weights.

/// The scheduler's runtime of thread `tid` of `pid`, in nanoseconds: the first field of its
/// `schedstat`. `None` once the thread is gone, or where the kernel has no `schedstat`.
pub(crate) fn runtime_ns(pid: i32, tid: i32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/schedstat")).ok()?;
    parse_schedstat(&s)
}

fn parse_schedstat(s: &str) -> Option<u64> {
    s.split_ascii_whitespace().next()?.parse().ok()
}

/// One thread's task clock against its runtime, both since its event was opened.
pub(crate) struct ThreadClock {
    /// The runtime when the event was opened (`None`: unreadable, the task clock is used).
    base: Option<u64>,
    /// The task clock at the last reading.
    count: u64,
    /// The runtime at the last reading (or its estimate), since `base`.
    runtime: u64,
    /// Runtime per task-clock nanosecond over the last reading's interval, at most 1.
    share: f64,
}

impl ThreadClock {
    /// A clock for an event opened just now on `tid`.
    pub(crate) fn new(pid: i32, tid: i32) -> ThreadClock {
        ThreadClock::with_base(runtime_ns(pid, tid))
    }

    fn with_base(base: Option<u64>) -> ThreadClock {
        ThreadClock {
            base,
            count: 0,
            runtime: 0,
            share: 1.0,
        }
    }

    /// The weight of a sample of `period` task-clock nanoseconds.
    pub(crate) fn weight(&self, period: u64) -> u64 {
        (period as f64 * self.share).round() as u64
    }

    /// Takes a reading: `count` is the event's task clock now. Returns the thread's runtime
    /// since the event opened.
    pub(crate) fn read(&mut self, pid: i32, tid: i32, count: u64) -> u64 {
        let now = self.base.and_then(|_| runtime_ns(pid, tid));
        self.advance(count, now)
    }

    /// [`Self::read`] with the runtime read (`None`: unreadable, e.g. the thread ended: the
    /// task clock's growth at the last share stands in for it).
    fn advance(&mut self, count: u64, now: Option<u64>) -> u64 {
        if count <= self.count {
            return self.runtime;
        }
        let d_count = count - self.count;
        let d_runtime = match (self.base, now) {
            (Some(base), Some(now)) => {
                let d = now.saturating_sub(base).saturating_sub(self.runtime);
                // Steal only ever takes away; a share above 1 is the two reads' skew.
                self.share = (d as f64 / d_count as f64).clamp(0.0, 1.0);
                d
            }
            (None, _) => d_count,
            (Some(_), None) => (d_count as f64 * self.share).round() as u64,
        };
        self.count = count;
        self.runtime += d_runtime;
        self.runtime
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedstat_gives_its_first_field() {
        assert_eq!(parse_schedstat("1504236577 8311 42\n"), Some(1_504_236_577));
        assert_eq!(parse_schedstat(""), None);
        assert_eq!(parse_schedstat("x 1 2"), None);
    }

    #[test]
    fn steal_lowers_the_weights_and_the_runtime_is_exact() {
        // Runtime 1,000 at the event's opening.
        let mut c = ThreadClock::with_base(Some(1_000));
        assert_eq!(c.weight(10_000_000), 10_000_000);
        // 100 ms of task clock, of which 2 ms stolen.
        assert_eq!(c.advance(100_000_000, Some(1_000 + 98_000_000)), 98_000_000);
        assert_eq!(c.weight(10_000_000), 9_800_000);
        // No steal for the next 100 ms: full weight again.
        assert_eq!(
            c.advance(200_000_000, Some(1_000 + 198_000_000)),
            198_000_000
        );
        assert_eq!(c.weight(10_000_000), 10_000_000);
        // A reading that went backwards changes nothing.
        assert_eq!(c.advance(150_000_000, Some(5)), 198_000_000);
    }

    #[test]
    fn an_ended_thread_continues_at_its_last_share() {
        let mut c = ThreadClock::with_base(Some(0));
        c.advance(100_000_000, Some(90_000_000));
        assert_eq!(c.advance(110_000_000, None), 99_000_000);
    }

    #[test]
    fn without_schedstat_the_task_clock_counts() {
        let mut c = ThreadClock::with_base(None);
        assert_eq!(c.advance(100_000_000, Some(5)), 100_000_000);
        assert_eq!(c.weight(10_000_000), 10_000_000);
    }

    #[test]
    fn this_threads_runtime_reads() {
        let pid = std::process::id() as i32;
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() };
        let before = runtime_ns(pid, tid).expect("schedstat of this thread");
        let mut x = 0u64;
        for i in 0..2_000_000u64 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
        }
        assert!(runtime_ns(pid, tid).unwrap() > before);
    }
}
