//! Helpers shared by the profiler's integration tests: an exporter that keeps what it gets, and
//! sums over decoded profiles.
#![allow(dead_code)]

use std::sync::{Arc, Mutex};

use ferroprof::export::{ExportError, ExportedProfile, Exporter};
use ferroprof::{Profiler, ProfilerGuard, Profiles};
use ferroprof_pprof::{decode, Profile, Sample};

/// Keeps every exported profile.
#[derive(Clone, Default)]
pub struct Collect(pub Arc<Mutex<Vec<ExportedProfile>>>);

impl Exporter for Collect {
    fn name(&self) -> &str {
        "collect"
    }

    fn export(&mut self, profile: &ExportedProfile) -> Result<(), ExportError> {
        self.0.lock().unwrap().push(profile.clone());
        Ok(())
    }
}

impl Collect {
    /// Every collected profile, decoded by the independent decoder.
    pub fn decoded(&self) -> Vec<Profile> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .map(|p| decode(&p.encoded.bytes).expect("exported profile decodes"))
            .collect()
    }
}

/// CPU and wall profiles only.
pub fn cpu_wall() -> Profiles {
    Profiles {
        cpu: true,
        wall: true,
        alloc: false,
        heap: false,
    }
}

/// A CPU and wall profiler at `hz` exporting into `c` (one profile, at stop); the CPU engine
/// from `FERROPROF_CPU_ENGINE` when set (e.g. `scripts/ground_truth.sh` with timers).
pub fn start_cpu_wall(service: &str, hz: u32, c: &Collect) -> ProfilerGuard {
    Profiler::builder()
        .service(service)
        .cpu_hz(hz)
        .profiles(cpu_wall())
        .period(std::time::Duration::from_secs(3600))
        .exporter(Box::new(c.clone()))
        .from_vars(|k| {
            (k == "FERROPROF_CPU_ENGINE")
                .then(|| std::env::var(k).ok())
                .flatten()
        })
        .start()
        .expect("profiler starts")
}

/// Sum of `value` over the samples of `p` for which `pred` holds.
pub fn sum_where(p: &Profile, value: &str, pred: impl Fn(&Profile, &Sample) -> bool) -> i64 {
    let Some(i) = p.value_index(value) else {
        return 0;
    };
    p.sample
        .iter()
        .filter(|s| pred(p, s))
        .map(|s| s.value[i])
        .sum()
}

/// Sum of `value` over all profiles for samples satisfying `pred`.
pub fn sum_all(ps: &[Profile], value: &str, pred: impl Fn(&Profile, &Sample) -> bool) -> i64 {
    ps.iter().map(|p| sum_where(p, value, &pred)).sum()
}

/// Whether a function whose name ends with `name` is on the sample's stack.
pub fn has_fn(p: &Profile, s: &Sample, name: &str) -> bool {
    p.stack(s).iter().any(|l| l.function.ends_with(name))
}

/// CPU time the calling thread has used. Busy loops run on it rather than on wall time: on a
/// loaded machine a thread gets only part of a core, and a test expecting an amount of CPU
/// must make sure the thread had it. No allocation or lock: usable in a forked child.
pub fn thread_cpu() -> std::time::Duration {
    cpu_clock(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// CPU time of the whole process (every thread), for work spread over threads the test does
/// not run itself (a runtime's workers).
pub fn process_cpu() -> std::time::Duration {
    cpu_clock(libc::CLOCK_PROCESS_CPUTIME_ID)
}

fn cpu_clock(clock: libc::clockid_t) -> std::time::Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer; these clocks exist on every Linux.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    std::time::Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// A fresh, empty directory under the target dir.
pub fn temp_dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("ferroprof-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Sleeps `ns` nanoseconds with one `nanosleep` call; whether it failed (an `EINTR`, here: the
/// tests that call it count interrupted system calls).
pub fn nanosleep_failed(ns: i64) -> bool {
    let req = libc::timespec {
        tv_sec: 0,
        tv_nsec: ns,
    };
    let mut rem = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid timespecs.
    unsafe { libc::nanosleep(&req, &mut rem) != 0 }
}
