//! Profiles a running Linux process from outside it, without stopping or restarting it:
//! CPU time through perf events on each of its threads (the user registers and a copy of the
//! top of the user stack with each sample), wall time from where each thread is at every tick
//! (a running thread at its last CPU sample, a waiting one at its system call, its stack copied
//! with `process_vm_readv`), all unwound with the process's own `.eh_frame` tables and
//! symbolized with ferroprof's symbolizer from the files it maps. Nothing is written into the
//! process and no signal is sent to it. No allocation or heap profile: nothing is injected.

#![warn(missing_docs)]

mod clock;
mod perf;
mod procfs;
mod unwind;
mod wall;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferroprof::ProcessSymbolizer;
use ferroprof_recorder::{
    Compression, Frame, Label, RecorderConfig, SampleTypeConfig, SampleValues, SerializedProfile,
    StackRecorder,
};

pub use perf::paranoid;
use procfs::{alive, is_root, list_threads, read_comm, thread_name};
pub use procfs::{command_name, process_start};

/// The frame of CPU time no sample caught on a thread with no stack seen.
const CPU_NOT_SAMPLED: &str = "[cpu not sampled]";

/// The label keys in-process profiles use for threads.
const THREAD_ID_LABEL: &str = "thread id";
const THREAD_NAME_LABEL: &str = "thread name";

/// How to attach.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct AttachConfig {
    /// The process.
    pub pid: i32,
    /// Samples per second of each thread's CPU time.
    pub hz: u32,
    /// How long to profile (`None`: until `stop` is set or the process ends).
    pub duration: Option<Duration>,
    /// One profile per period (`None`: one profile at the end).
    pub period: Option<Duration>,
    /// Set to end the run (Ctrl-C).
    pub stop: Arc<AtomicBool>,
}

impl AttachConfig {
    /// 100 Hz, until `stop` or the process's end, one profile.
    pub fn new(pid: i32) -> Self {
        AttachConfig {
            pid,
            hz: 100,
            duration: None,
            period: None,
            stop: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Samples per second (1-1000).
    pub fn hz(mut self, hz: u32) -> Self {
        self.hz = hz;
        self
    }

    /// How long to profile.
    pub fn duration(mut self, d: Option<Duration>) -> Self {
        self.duration = d;
        self
    }

    /// One profile per period.
    pub fn period(mut self, p: Option<Duration>) -> Self {
        self.period = p;
        self
    }

    /// The flag that ends the run when set.
    pub fn stop_flag(mut self, stop: Arc<AtomicBool>) -> Self {
        self.stop = stop;
        self
    }
}

/// Why attaching failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AttachError {
    /// No process has that id.
    #[error("no process with pid {pid}")]
    NoSuchProcess {
        /// The pid asked for.
        pid: i32,
    },
    /// The process is not ours to read.
    #[error("permission denied for pid {pid}: {}", if *as_root {
        "it holds capabilities this process lacks (a container's init, say), which tracing \
         it needs"
    } else {
        "another user's process (run as that user or as root)"
    })]
    PermissionDenied {
        /// The pid asked for.
        pid: i32,
        /// Whether this process runs as root (then the target holds more capabilities).
        as_root: bool,
    },
    /// The kernel refused perf events.
    #[error(
        "perf_event_open refused for pid {pid}: {source} (kernel.perf_event_paranoid is {}: \
         at 2 or below a user may profile their own processes, at -1 anyone's, and root \
         always may; a seccomp filter, as container runtimes install, denies it whatever \
         the setting)",
        paranoid.map_or("unreadable".to_owned(), |p| p.to_string())
    )]
    PerfRefused {
        /// The pid asked for.
        pid: i32,
        /// `/proc/sys/kernel/perf_event_paranoid`.
        paranoid: Option<i32>,
        /// The kernel's error.
        source: std::io::Error,
    },
    /// `hz` out of range.
    #[error("sampling rate {hz} Hz is not in 1-1000")]
    BadRate {
        /// The rate asked for.
        hz: u32,
    },
    /// Reading the process's files, or making the profile.
    #[error("{what}: {source}")]
    Io {
        /// What failed.
        what: String,
        /// The error.
        source: std::io::Error,
    },
    /// The recorder refused.
    #[error("recording: {0}")]
    Recorder(#[from] ferroprof_recorder::RecorderError),
}

/// One profile of the run.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct AttachProfile {
    /// The encoded profile (gzip pprof) and its recording figures.
    pub profile: SerializedProfile,
    /// Names of its sample types, in profile order (`cpu-time`...).
    pub sample_types: Vec<String>,
}

/// What a run saw.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct AttachSummary {
    /// Samples recorded.
    pub samples: u64,
    /// Samples the kernel lost (ring buffers full).
    pub lost: u64,
    /// Threads seen running.
    pub threads: usize,
    /// Threads no event could be opened on.
    pub threads_refused: usize,
    /// Threads whose event's ring buffer the locked-memory limit refused
    /// (`kernel.perf_event_mlock_kb` and `RLIMIT_MEMLOCK`, for an unprivileged user).
    pub threads_without_ring: usize,
    /// Whether the process ended during the run.
    pub process_ended: bool,
    /// Whether time in the kernel was counted (else user time only).
    pub kernel_time: bool,
    /// Whether waiting threads' stacks could be read (the wall profile); without the right to
    /// trace the process it has running threads only.
    pub wall_of_waiting: bool,
}

/// Profiles process `config.pid` until the duration passes, `stop` is set or the process
/// ends; calls `on_attached` once its threads' events are open, and hands each profile (one
/// per period, and the last one) to `on_profile`.
pub fn attach(
    config: &AttachConfig,
    on_attached: impl FnOnce(),
    mut on_profile: impl FnMut(AttachProfile),
) -> Result<AttachSummary, AttachError> {
    let pid = config.pid;
    if !(1..=1000).contains(&config.hz) {
        return Err(AttachError::BadRate { hz: config.hz });
    }
    check_access(pid)?;
    let period_ns = 1_000_000_000 / u64::from(config.hz);
    let ring_pages = perf::ring_pages(config.hz);
    let recorder = StackRecorder::new(RecorderConfig {
        sample_types: SampleTypeConfig {
            cpu_time: true,
            alloc_samples: false,
            heap_samples: false,
            heap_size: false,
            timeline: false,
        },
        compression: Compression::Gzip,
        ..RecorderConfig::default()
    })?;
    let mut symbolizer = ProcessSymbolizer::for_process(pid).map_err(|e| access_error(pid, e))?;
    let files = ferroprof::foreign::mapped_files(pid).map_err(|e| access_error(pid, e))?;
    let mut unwinder = unwind::RemoteUnwinder::new(&files);
    // By thread; `None`: no event could be opened on it.
    let mut events: HashMap<i32, Option<perf::ThreadEvent>> = HashMap::new();
    let mut names: HashMap<i32, String> = HashMap::new();
    // Per thread, the CPU time booked so far (its samples' weights and carries).
    let mut booked: HashMap<i32, u64> = HashMap::new();
    // Per thread with an event, its task clock against its runtime (see `clock`).
    let mut clocks: HashMap<i32, clock::ThreadClock> = HashMap::new();
    let mut next_clocks = Instant::now();
    // Threads met during the run (the summary's count).
    let mut seen = 0usize;
    let mut on_attached = Some(on_attached);
    let mut summary = AttachSummary {
        kernel_time: true,
        wall_of_waiting: true,
        ..AttachSummary::default()
    };
    let start = Instant::now();
    // Each thread's stack where it was last seen (its last CPU sample, or where it last
    // waited): where a running thread's wall time goes. A thread woken from a wait and not
    // yet back on a CPU (runnable, no sample since) is still at its waiting site.
    let mut last_stack: HashMap<i32, Vec<u64>> = HashMap::new();
    // Each thread's stack at its last CPU sample: where CPU no sample carried goes.
    let mut last_cpu_stack: HashMap<i32, Vec<u64>> = HashMap::new();
    let mut next_wall = start + Duration::from_nanos(period_ns);
    let mut last_wall = start;
    let mut stack_buf = vec![0u8; perf::STACK_BYTES as usize];
    let mut wall_frames: Vec<u64> = Vec::with_capacity(unwind::MAX_FRAMES);

    let mut next_profile = config.period.map(|p| start + p);
    let mut next_names = start;
    let mut next_maps = start + Duration::from_secs(1);
    let mut frames_buf: Vec<u64> = Vec::with_capacity(unwind::MAX_FRAMES);
    loop {
        let now = Instant::now();
        let ended = !alive(pid);
        let done = ended
            || config.stop.load(Ordering::SeqCst)
            || config.duration.is_some_and(|d| now >= start + d);
        let mut live: Vec<i32> = Vec::new();
        if !ended {
            live = list_threads(pid);
            // Threads started since the last look (every loop: a new thread's first CPU is
            // missed by one loop at most).
            for &tid in &live {
                if events.contains_key(&tid) {
                    continue;
                }
                let opened = match perf::ThreadEvent::open(
                    tid,
                    period_ns,
                    summary.kernel_time,
                    ring_pages,
                ) {
                    Err(perf::OpenError::Refused(_))
                        if summary.kernel_time && events.is_empty() =>
                    {
                        // Kernel time not allowed (perf_event_paranoid): user time only.
                        summary.kernel_time = false;
                        perf::ThreadEvent::open(tid, period_ns, false, ring_pages)
                    }
                    r => r,
                };
                seen += 1;
                match opened {
                    Ok(event) => {
                        events.insert(tid, Some(event));
                        clocks.insert(tid, clock::ThreadClock::new(pid, tid));
                    }
                    Err(perf::OpenError::Gone) => {}
                    Err(perf::OpenError::Refused(source)) if events.is_empty() => {
                        return Err(AttachError::PerfRefused {
                            pid,
                            paranoid: perf::paranoid(),
                            source,
                        });
                    }
                    Err(perf::OpenError::NoRing) => {
                        // Tried once.
                        events.insert(tid, None);
                        summary.threads_without_ring += 1;
                    }
                    Err(perf::OpenError::Refused(_)) | Err(perf::OpenError::Other) => {
                        events.insert(tid, None);
                        summary.threads_refused += 1;
                    }
                }
            }
            if let Some(f) = on_attached.take() {
                f();
            }
        }
        if now >= next_names && !ended {
            next_names = now + Duration::from_millis(200);
            for (tid, name) in names.iter_mut() {
                if let Some(n) = read_comm(pid, *tid) {
                    *name = n;
                }
            }
        }
        if now >= next_maps && !ended {
            next_maps = now + Duration::from_secs(1);
            if let Ok(f) = ferroprof::foreign::mapped_files(pid) {
                if !unwinder.is_for(&f) {
                    unwinder = unwind::RemoteUnwinder::new(&f);
                }
            }
        }
        if now >= next_clocks {
            // The share of each thread's task clock that was its CPU, for the weights of the
            // samples drained next (it moves slowly: a look every 100 ms is enough).
            next_clocks = now + Duration::from_millis(100);
            for (&tid, ev) in events.iter() {
                if let (Some(count), Some(c)) =
                    (ev.as_ref().and_then(|e| e.count()), clocks.get_mut(&tid))
                {
                    c.read(pid, tid, count);
                }
            }
        }
        // Drain every ring.
        for event in events.values_mut().flatten() {
            summary.lost += event.drain(|s| {
                if s.pid != pid {
                    // A forked child of the process: not the process profiled.
                    return;
                }
                let name = names
                    .entry(s.tid)
                    .or_insert_with(|| thread_name(pid, s.tid))
                    .clone();
                unwinder.unwind(s.ip, s.sp, s.bp, s.stack, &mut frames_buf);
                if !frames_buf.is_empty() {
                    for map in [&mut last_stack, &mut last_cpu_stack] {
                        let kept = map.entry(s.tid).or_default();
                        kept.clear();
                        kept.extend_from_slice(&frames_buf);
                    }
                }
                let frames: Vec<Frame<'_>> = if frames_buf.is_empty() {
                    // No user registers: the sample fell in the kernel (a kernel thread's
                    // time, or a thread's with no user context).
                    vec![Frame::sym("[kernel]", "", 0)]
                } else {
                    frames_buf.iter().map(|&a| Frame::Address(a)).collect()
                };
                let labels = [
                    Label::num(THREAD_ID_LABEL, i64::from(s.tid)),
                    Label::str(THREAD_NAME_LABEL, &name),
                ];
                let weight = clocks.get(&s.tid).map_or(s.period, |c| c.weight(s.period));
                let values = SampleValues {
                    cpu_time_ns: i64::try_from(weight).unwrap_or(i64::MAX),
                    cpu_or_wall_samples: 1,
                    ..Default::default()
                };
                if recorder.record_sample(&frames, &values, &labels, 0).is_ok() {
                    summary.samples += 1;
                }
                *booked.entry(s.tid).or_default() += weight;
            });
        }
        if now >= next_wall && !ended {
            // Every thread's wall time since the last tick, where it is now.
            let wall_ns = now.duration_since(last_wall).as_nanos() as i64;
            last_wall = now;
            next_wall = now + Duration::from_nanos(period_ns);
            for &tid in events.keys() {
                let Some(st) = wall::state(pid, tid) else {
                    continue;
                };
                wall_frames.clear();
                if st == 'R' {
                    if let Some(f) = last_stack.get(&tid) {
                        wall_frames.extend_from_slice(f);
                    }
                } else if summary.wall_of_waiting {
                    match wall::blocked_at(pid, tid) {
                        Ok(Some((sp, pc))) => {
                            let n = wall::read_memory(pid, sp, &mut stack_buf);
                            unwinder.unwind(pc, sp, 0, &stack_buf[..n], &mut wall_frames);
                            if !wall_frames.is_empty() {
                                let kept = last_stack.entry(tid).or_default();
                                kept.clear();
                                kept.extend_from_slice(&wall_frames);
                            }
                        }
                        Ok(None) => {
                            if let Some(f) = last_stack.get(&tid) {
                                wall_frames.extend_from_slice(f);
                            }
                        }
                        Err(_) => summary.wall_of_waiting = false,
                    }
                }
                if wall_frames.is_empty() {
                    continue;
                }
                let name = names
                    .entry(tid)
                    .or_insert_with(|| thread_name(pid, tid))
                    .clone();
                let frames: Vec<Frame<'_>> =
                    wall_frames.iter().map(|&a| Frame::Address(a)).collect();
                let labels = [
                    Label::num(THREAD_ID_LABEL, i64::from(tid)),
                    Label::str(THREAD_NAME_LABEL, &name),
                ];
                let values = SampleValues {
                    wall_time_ns: wall_ns,
                    ..Default::default()
                };
                let _ = recorder.record_sample(&frames, &values, &labels, 0);
            }
        }
        let period_due = next_profile.is_some_and(|t| now >= t);
        // CPU the threads' clocks counted that no sample carries (the time since a thread's
        // last sample when it ends or the run does; its time in the kernel when only user
        // samples are allowed): booked where the thread was last seen. At a period's end, all
        // but one period of it (the rest may still come as a sample).
        for (&tid, ev) in events.iter() {
            let Some(count) = ev.as_ref().and_then(|e| e.count()) else {
                continue;
            };
            let final_ = done || ended || !live.contains(&tid);
            if !(final_ || period_due) {
                continue;
            }
            let cpu = match clocks.get_mut(&tid) {
                Some(c) => c.read(pid, tid, count),
                None => count,
            };
            let keep = if final_ { 0 } else { period_ns };
            let b = booked.entry(tid).or_default();
            if cpu <= *b + keep {
                continue;
            }
            let carry = cpu - *b - keep;
            *b += carry;
            let name = names
                .entry(tid)
                .or_insert_with(|| thread_name(pid, tid))
                .clone();
            // Its last CPU sample's stack, else where it was last seen.
            let frames: Vec<Frame<'_>> = match last_cpu_stack.get(&tid).or(last_stack.get(&tid)) {
                Some(st) => st.iter().map(|&a| Frame::Address(a)).collect(),
                None => vec![Frame::sym(CPU_NOT_SAMPLED, "", 0)],
            };
            let labels = [
                Label::num(THREAD_ID_LABEL, i64::from(tid)),
                Label::str(THREAD_NAME_LABEL, &name),
            ];
            let values = SampleValues {
                cpu_time_ns: i64::try_from(carry).unwrap_or(i64::MAX),
                ..Default::default()
            };
            let _ = recorder.record_sample(&frames, &values, &labels, 0);
        }
        if !ended {
            // Threads that ended: their last samples are drained above; their events (a
            // descriptor and locked memory each) go, so a run of hours over a program that
            // starts and ends threads holds only the live ones'.
            events.retain(|tid, _| live.contains(tid));
            booked.retain(|tid, _| live.contains(tid));
            clocks.retain(|tid, _| live.contains(tid));
            last_stack.retain(|tid, _| live.contains(tid));
            last_cpu_stack.retain(|tid, _| live.contains(tid));
            names.retain(|tid, _| live.contains(tid));
        }
        if period_due || done {
            let p = symbolizer.pass(|sym| recorder.serialize(Some(sym)))?;
            on_profile(AttachProfile {
                profile: p,
                sample_types: recorder
                    .layout()
                    .types()
                    .iter()
                    .map(|t| t.name().to_owned())
                    .collect(),
            });
            if let (Some(t), Some(period)) = (&mut next_profile, config.period) {
                *t += period;
            }
        }
        if done {
            summary.process_ended = ended;
            summary.threads = seen;
            return Ok(summary);
        }
        let wake = next_wall.min(Instant::now() + Duration::from_millis(10));
        std::thread::sleep(wake.saturating_duration_since(Instant::now()));
    }
}

/// Whether process `pid` exists and is ours to read (what [`attach`] checks first): for a
/// caller to refuse before it prepares anything.
pub fn check(pid: i32) -> Result<(), AttachError> {
    check_access(pid)
}

/// The process exists and its maps are ours to read.
fn check_access(pid: i32) -> Result<(), AttachError> {
    if pid <= 0 || !std::path::Path::new(&format!("/proc/{pid}")).exists() {
        return Err(AttachError::NoSuchProcess { pid });
    }
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .map(|_| ())
        .map_err(|e| access_error(pid, e))?;
    // Readable maps of an empty file: a process of another user (no ptrace access).
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    if maps.is_empty() && alive(pid) {
        return Err(AttachError::PermissionDenied {
            pid,
            as_root: is_root(),
        });
    }
    Ok(())
}

fn access_error(pid: i32, e: std::io::Error) -> AttachError {
    match e.kind() {
        std::io::ErrorKind::NotFound => AttachError::NoSuchProcess { pid },
        std::io::ErrorKind::PermissionDenied => AttachError::PermissionDenied {
            pid,
            as_root: is_root(),
        },
        _ => AttachError::Io {
            what: format!("reading /proc/{pid}"),
            source: e,
        },
    }
}
