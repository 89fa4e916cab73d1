//! One visit's sample into the recorder (and the taps), under the thread's labels.

use std::sync::atomic::Ordering;

use ferroprof_recorder::{Frame, Label, SampleValues};

use super::thread::ThreadInfo;
use crate::labels::{self, Ctx};
use crate::state::{Shared, TapKind};
use crate::threads::{THREAD_ID_LABEL, THREAD_NAME_LABEL};
use crate::tls;

/// The frame of CPU time no capture caught on a thread whose stack was never read.
pub(super) const CPU_NOT_SAMPLED: &str = "[cpu not sampled]";

/// Records one sample of thread `t` on `stack` under labels `ctx`. An empty stack records
/// nothing, but CPU time: that goes under [`CPU_NOT_SAMPLED`].
#[allow(clippy::too_many_arguments)]
pub(super) fn record(
    sh: &Shared,
    frames: &mut Vec<Frame<'static>>,
    t: &ThreadInfo,
    stack: &[u64],
    ctx: &Ctx,
    cpu_ns: i64,
    wall_ns: i64,
    count: i64,
) {
    if (stack.is_empty() && cpu_ns == 0) || (cpu_ns == 0 && wall_ns == 0 && count == 0) {
        return;
    }
    frames.clear();
    if stack.is_empty() {
        frames.push(Frame::sym(CPU_NOT_SAMPLED, "", 0));
    } else {
        frames.extend(stack.iter().map(|&a| Frame::Address(a)));
    }
    let mut labels = [Label::num("", 0); 2 + labels::WORDS];
    labels[0] = Label::num(THREAD_ID_LABEL, t.tid as i64);
    labels[1] = Label::str(THREAD_NAME_LABEL, &t.name);
    let n = 2 + labels[2..]
        .first_chunk_mut::<{ labels::WORDS }>()
        .map_or(0, |w| ctx.fill(w));
    let labels = &labels[..n];
    let values = SampleValues {
        cpu_time_ns: cpu_ns,
        cpu_or_wall_samples: count,
        wall_time_ns: wall_ns,
        ..Default::default()
    };
    let frames = &*frames;
    tls::in_recorder(|| {
        // Never inside the recorder while a fork is under way (see `fork`); taps outside.
        crate::forkgate::outside_fork(|| {
            if sh
                .recorder
                .record_sample(frames, &values, labels, 0)
                .is_err()
            {
                sh.stats.record_errors.fetch_add(1, Ordering::Relaxed);
            } else {
                sh.stats
                    .cpu_samples
                    .fetch_add(count as u64, Ordering::Relaxed);
            }
        });
        sh.for_each_tap(TapKind::Cpu, |r| {
            let _ = r.record_sample(frames, &values, labels, 0);
        });
    });
}

/// Asks the scheduler for a short time slice for the calling (sampler) thread, so that it runs
/// as soon as its timer wakes it rather than when a CPU happens to free up. On a machine with
/// more runnable threads than cores, a sampler that waits for a CPU runs mostly when some thread
/// blocks: its visits then fall at moments tied to the workload (a mutex waiter waking, a
/// holder going to sleep) instead of at random times, and under-counted a contended mutex by
/// about 9% in the ground-truth harness. EEVDF (Linux 6.12 and later) lets an unprivileged
/// thread ask for a slice shorter than the default, and a thread with a shorter slice preempts
/// on wake-up; older kernels ignore the request. Best effort: the nice value is kept, and a
/// refusal changes nothing else.
pub(super) fn ask_for_short_slice() {
    // SAFETY: plain query of the calling thread's policy.
    let policy = unsafe { libc::sched_getscheduler(0) };
    // Only within the fair class, as the thread already is (a real-time or idle policy the
    // application chose is left alone).
    if policy != libc::SCHED_OTHER && policy != libc::SCHED_BATCH {
        return;
    }
    // SAFETY: getpriority on the calling thread; errno is not consulted (a nice of -1 and an
    // error both fall back to what the call returned, which sched_setattr validates).
    let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
    let attr = libc::sched_attr {
        size: std::mem::size_of::<libc::sched_attr>() as u32,
        sched_policy: policy as u32,
        sched_flags: 0,
        sched_nice: nice,
        sched_priority: 0,
        // The shortest slice the kernel accepts: 100 µs.
        sched_runtime: 100_000,
        sched_deadline: 0,
        sched_period: 0,
    };
    // SAFETY: a valid sched_attr of the size it declares, for the calling thread (pid 0).
    unsafe {
        libc::syscall(
            libc::SYS_sched_setattr,
            0,
            &attr as *const libc::sched_attr,
            0,
        )
    };
}
