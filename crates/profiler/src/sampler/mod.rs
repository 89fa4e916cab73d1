//! CPU and wall-time sampling of every thread of the process.
//!
//! Two sources, neither of which ever interrupts a thread that is not running:
//!
//! * **CPU: a CPU engine per thread.** Every thread of the process (but ferroprof's own) is
//!   armed by the CPU engine (`engine.rs`): a perf task-clock event (`perf.rs`), which signals
//!   the thread at the CPU instant each sampling period of its CPU ends, or else a POSIX timer
//!   on its own CPU clock (`timer_create` with `SIGEV_THREAD_ID`), which the kernel signals at
//!   the thread's scheduler tick, on its way back to user mode. The handler (async-signal-safe: no
//!   allocation, no lock) unwinds the interrupted context into a capture slot taken from a
//!   shared pool and publishes it. The stack is therefore taken where the CPU was spent, for
//!   every thread that uses CPU, whatever the load (a thread waiting for a CPU uses none and is
//!   not signalled). A real-time signal, picked at start among those nobody handles, queues one
//!   signal per expiry: nothing coalesces, and a program's own `SIGPROF` user is left alone.
//!   On kernels that run CPU timers as task work on the way to user mode (x86_64 and arm64
//!   since Linux 5.11) the signal is raised only there, so it cannot interrupt a system call:
//!   a blocking call of the application never sees `EINTR` from us.
//! * **Wall: a visit per thread, without signals.** The sampler thread wakes `cpu_hz` times a
//!   second and visits threads. A thread whose CPU clock did not move since its stack was read
//!   is where it was: the elapsed wall time goes to that stack. One that ran is looked at
//!   again: its captures of the interval carry its on-CPU time; for the rest, where it
//!   is now: blocked in a system call, its stack pointer and program counter are read from
//!   `/proc/self/task/<tid>/syscall` and its stack is unwound from a copy
//!   ([`crate::sampler::remote`]), kept only if its CPU clock did not move while the copy was
//!   taken (else it is looked at again, up to three times); runnable after
//!   mostly running, it waits where its timer last caught it running; runnable after mostly
//!   waiting (woken, waiting for a CPU), it is where the calls it made since its stack was last
//!   read lead ([`RemoteUnwinder::recent_calls`]). Each visit weighs exactly the wall time since
//!   the previous one, so per-thread totals are exact whatever the visiting rate.
//! * **Cost follows the threads that ran.** Threads that ran recently are visited every tick;
//!   the others (idle for a while) a few per tick in turn, each about every two seconds,
//!   their samples weighted by the time since their last visit. Threads are listed from
//!   `/proc/self/task` at a rate bounded by what a listing costs.
//!
//! A thread the perf engine cannot arm gets a timer; one the kernel gives no timer either (out
//! of `RLIMIT_SIGPENDING`) still has wall samples; it is counted
//! ([`crate::ProfilerStats::threads_without_timer`]) and logged once. When another library
//! replaces our signal's handler, every thread is disarmed (nobody would handle their
//! signals), a warning is logged and counted; wall sampling goes on. Signals that are not
//! ours are passed on to the handler installed before ours.

pub(crate) mod remote;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use ferroprof_recorder::Frame;

use crate::labels::{self, Ctx};
use crate::state::Shared;
use crate::threads::{clock_ns, thread_cpu_ns};
use crate::unwind::{self, MAX_FRAMES};
use remote::{RemoteUnwinder, TaskSyscall};

mod capture;
pub(crate) mod child_trigger;
mod clock;
mod engine;
mod perf;
mod record;
mod tasks;
mod thread;

use capture::*;
pub(crate) use capture::{
    after_fork_in_child, install_handler, lost_captures, pick_signal, valid_signal,
};
use clock::*;
use engine::{CpuEngine, Engine};
pub(crate) use perf::{open_events as perf_events, probe as probe_perf};
use record::*;
use tasks::*;
use thread::ThreadInfo;

/// How long a thread that ran stays visited at every tick after it was last seen running.
const HOT_LINGER_NS: u64 = 250_000_000;
/// Idle threads are visited in turn so that each comes up about this often.
const COLD_REVISIT_NS: u64 = 2_000_000_000;
/// Least visits of idle threads per second (spread over ticks), so that a few idle threads are
/// seen often.
const COLD_VISITS_PER_SEC: u64 = 800;
/// Wall time an idle thread accumulates on one stack before it is recorded.
const IDLE_FLUSH_NS: u64 = 100_000_000;
/// Looks at a thread before it is left where its stack was last read: a thread that ran while
/// its stack was copied is looked at again. (Keeping the old stack booked the time to the wait
/// before the one it was in: a lag, which took about 1% of the wall time from each blocking
/// site and gave it to the site before.)
const LOOK_ATTEMPTS: usize = 3;
/// A thread is on probation (nothing of it recorded) until it used this much CPU or lived
/// PROBATION_MAX_NS: ferroprof's own threads register from the first lines they run, and one
/// listed before that must leave nothing in the profile.
const PROBATION_CPU_NS: u64 = 200_000;
const PROBATION_MAX_NS: u64 = 1_000_000_000;
/// Every thread ferroprof starts is named with this (Rust names a thread in the thread, before
/// the code it runs).
const OWN_NAME_PREFIX: &str = "ferroprof-";
/// A listing of `/proc/self/task` may take this share of the time between two listings (1/N).
const LIST_BUDGET: u64 = 1000;

/// Set by the sampler when threads exited since the last export.
static THREADS_EXITED: AtomicBool = AtomicBool::new(false);
/// Whether threads exited in the interval before the last export.
static EXITED_BEFORE: AtomicBool = AtomicBool::new(false);

/// Under thread churn, gives the memory the C allocator keeps free back to the system, once per
/// export, right after it (on the export thread). An export allocates and frees tens of
/// megabytes (symbolization, encoding); with steady threads the next export reuses that memory,
/// but short threads, each with its own allocations, arena and rows in the profile (its id and
/// name are labels), scatter what stays in use among it, so it stays resident and grows
/// (measured with 20,000 threads: +8 to +20 MB of RSS over the unprofiled run, the memory in
/// use flat; with `malloc_trim` after each export, +0.1 to +2 MB whatever the count). A process
/// whose threads live on is never trimmed. The export after the last exits trims too: its own
/// garbage lands among what the exited threads left (two exports in a row, e.g. a flush right
/// after a periodic one, left 8 MB behind otherwise).
pub(crate) fn trim_after_export() {
    let recent = THREADS_EXITED.swap(false, Ordering::Relaxed);
    let before = EXITED_BEFORE.swap(recent, Ordering::Relaxed);
    if recent || before {
        #[cfg(target_env = "gnu")]
        // SAFETY: malloc_trim has no preconditions; it takes the allocator's own locks.
        unsafe {
            libc::malloc_trim(0);
        }
    }
}

/// A capture taken out of the pool, waiting for its thread's visit in this tick.
struct Cap {
    idx: usize,
    weight: u32,
    at: u64,
    start: usize,
    len: usize,
    ctx: Ctx,
}

/// State of the sampler thread.
pub(crate) struct Sampler {
    shared: Arc<Shared>,
    signal: i32,
    epoch: u64,
    period: u64,
    cpu_hz: u64,
    wall_enabled: bool,
    threads: Vec<Option<ThreadInfo>>,
    /// Generation of each entry of `threads` (bumped when an entry is reused).
    gens: Vec<u16>,
    free: Vec<usize>,
    by_tid: HashMap<i32, usize, foldhash::fast::RandomState>,
    lister: Option<TaskLister>,
    tids: Vec<i32>,
    listing: u64,
    last_list_at: u64,
    /// When the first listing was taken (the profile's start for the threads it found).
    first_list_at: u64,
    last_tick_at: u64,
    next_list_at: u64,
    own_gen: u64,
    /// `/proc/self/task`'s link count when last looked at.
    listed_nlink: u64,
    remote: RemoteUnwinder,
    remote_frames: Vec<u64>,
    remote_sps: Vec<u64>,
    caps: Vec<Cap>,
    cap_frames: Vec<u64>,
    frames: Vec<Frame<'static>>,
    tick: u64,
    /// Entries that ran lately (visited every tick), and how many entries are not ours.
    hot: Vec<usize>,
    sampled: usize,
    cold_cursor: usize,
    last_refresh: u64,
    maps_wanted: bool,
    last_names: u64,
    /// Our signal's handler was replaced: no timers any more.
    timers_off: bool,
    /// What raises the CPU signal on each thread.
    engine: Engine,
    timer_failure_logged: bool,
    stamps: StampClock,
    /// Finds other threads' label slots.
    labels: labels::Finder,
    /// Threads seen exiting since the last [`Sampler::give_back_memory`].
    exited: u64,
    /// Threads listed at the start bring the CPU they used before it (see `add_thread`).
    cpu_before_start: bool,
}

impl Sampler {
    pub(crate) fn new(shared: Arc<Shared>) -> Sampler {
        let engine = Engine::new(shared.settings.cpu_engine_perf);
        let signal = shared.settings.signal;
        let wall_enabled = shared.settings.profiles.wall;
        let period = period_ns(&shared.settings);
        let cpu_hz = shared.settings.cpu_hz.max(1) as u64;
        if POOL_LEN.load(Ordering::Acquire) == 0 {
            add_chunk();
        }
        // A forked child's timer gives way to the engine's (its captures stay in the pool).
        child_trigger::disarm();
        child_trigger::learn_system_objects();
        let cpu_before_start =
            shared.settings.cpu_before_start || crate::forkgate::is_forked_child();
        Sampler {
            cpu_before_start,
            shared,
            signal,
            epoch: (EPOCH.fetch_add(1, Ordering::Relaxed) & 0xff) as u64,
            period,
            cpu_hz,
            wall_enabled,
            threads: Vec::new(),
            gens: Vec::new(),
            free: Vec::new(),
            by_tid: HashMap::default(),
            lister: TaskLister::open(),
            tids: Vec::new(),
            listing: 0,
            last_list_at: 0,
            first_list_at: 0,
            last_tick_at: 0,
            next_list_at: 0,
            own_gen: u64::MAX,
            listed_nlink: 0,
            remote: RemoteUnwinder::new(),
            remote_frames: vec![0; MAX_FRAMES],
            remote_sps: vec![0; MAX_FRAMES],
            caps: Vec::new(),
            cap_frames: Vec::new(),
            frames: Vec::with_capacity(MAX_FRAMES),
            tick: 0,
            hot: Vec::new(),
            sampled: 0,
            cold_cursor: 0,
            last_refresh: 0,
            maps_wanted: false,
            last_names: 0,
            timers_off: false,
            engine,
            timer_failure_logged: false,
            stamps: StampClock::new(),
            labels: labels::Finder::new(),
            exited: 0,
        }
    }

    /// The sampler thread's body.
    pub(crate) fn run(mut self) {
        crate::threads::enter_profiler_thread();
        ask_for_short_slice();
        // The snapshot was built by `start`; only changes are picked up from here on.
        unwind::refresh(false);
        let period = self.period;
        let mut next = monotonic_ns() + period;
        let mut rng = next | 1;
        loop {
            // Each tick at a random point of its period: visits on a fixed grid alias with
            // threads that block and wake on a cycle of their own (a 10 ms poll, a 5 ms feeder),
            // and book a whole run's wall time by a few phases of that cycle. One uniform point
            // per period keeps one visit per period; a visit books half of the time since the
            // previous visit and half of the time until the next one to what it sees (see
            // `visit`), a weight that does not depend on where in its period the visit fell.
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let seen = self.shared.sampler_wake.load(Ordering::SeqCst);
            if self.shared.stopping.load(Ordering::SeqCst) {
                break;
            }
            sleep_until(next + rng % period, &self.shared.sampler_wake, seen);
            if self.shared.stopping.load(Ordering::SeqCst) {
                break;
            }
            let now = monotonic_ns();
            self.stamps.update();
            let mut ticks = 0u64;
            while now >= next {
                next += period;
                ticks += 1;
                if ticks > 1000 {
                    // Suspended machine or a stopped process: start afresh.
                    next = now + period;
                    break;
                }
            }
            let ticks = ticks.max(1);
            let stats = &self.shared.stats;
            stats.sampler_ticks.fetch_add(1, Ordering::Relaxed);
            stats
                .sampler_late_ticks
                .fetch_add(ticks - 1, Ordering::Relaxed);
            self.run_tick(now, ticks);
        }
        self.finish();
    }

    /// Lists (and arms) the process's threads, before the first tick.
    pub(crate) fn list_at_start(&mut self) {
        self.list_threads(monotonic_ns());
    }

    fn task_dir(&self) -> Option<libc::c_int> {
        self.lister.as_ref().map(|l| l.fd)
    }

    pub(crate) fn run_tick(&mut self, now: u64, ticks: u64) {
        self.tick += ticks;
        self.check_handler();
        self.check_own_threads();
        // Captures first, before a listing finds their thread gone: they are its last CPU.
        self.drain();
        self.visit_captured(now);
        if now >= self.next_list_at || self.listing == 0 || self.thread_count_changed() {
            self.list_threads(now);
        }
        // Then the threads that ran recently, and a few idle ones in turn.
        if self.wall_enabled {
            self.visit_hot(now);
            self.visit_cold(now, ticks);
        }
        self.refresh_unwinder();
        if self.tick - self.last_names >= self.cpu_hz {
            self.last_names = self.tick;
            // Names of threads that ran lately (an idle thread's name is read when it runs).
            for i in 0..self.hot.len() {
                let idx = self.hot[i];
                if let Some(mut t) = self.threads[idx].take() {
                    self.rename(&mut t);
                    self.threads[idx] = Some(t);
                }
            }
        }
        self.give_back_memory();
        self.last_tick_at = now;
        let want = self.shared.settle_requested.load(Ordering::SeqCst);
        if self.shared.settled.load(Ordering::SeqCst) < want {
            self.settle(now);
            self.shared.settled.store(want, Ordering::SeqCst);
        }
    }

    /// Visits every application thread not visited in this tick.
    fn visit_the_rest(&mut self, now: u64) {
        for idx in 0..self.threads.len() {
            let due = self.threads[idx]
                .as_ref()
                .is_some_and(|t| !t.own && t.visited != self.tick);
            if due {
                self.visit(idx, now, &[]);
            }
        }
    }

    /// Books every thread's CPU up to now (see `Shared::settle_sampler`): what it used since its
    /// last capture, which would otherwise wait for the next one.
    fn settle(&mut self, now: u64) {
        self.visit_the_rest(now);
        for idx in 0..self.threads.len() {
            if let Some(mut t) = self.threads[idx].take() {
                if !t.own && !t.probation {
                    self.book_carry(&mut t);
                }
                self.threads[idx] = Some(t);
            }
        }
    }

    /// Whether the process's thread count changed since the last look: `/proc/self/task`'s link
    /// count is 2 + the number of threads, one `fstat` away (a listing costs about a
    /// microsecond per thread). New threads are then found within a tick.
    fn thread_count_changed(&mut self) -> bool {
        let Some(fd) = self.task_dir() else {
            return false;
        };
        // SAFETY: fstat on our open directory into a zeroed struct we own.
        let nlink = unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            if libc::fstat(fd, &mut st) != 0 {
                return false;
            }
            st.st_nlink as u64
        };
        // Compared with the count at the last listing: threads that come and go between two
        // ticks in equal numbers wait for the next regular listing.
        std::mem::replace(&mut self.listed_nlink, nlink) != nlink
    }

    /// Threads that registered as ferroprof's since the last look stop being sampled.
    fn check_own_threads(&mut self) {
        let own_gen = crate::threads::own_threads_generation();
        if own_gen == self.own_gen {
            return;
        }
        self.own_gen = own_gen;
        for idx in 0..self.threads.len() {
            let became_own = self.threads[idx]
                .as_ref()
                .is_some_and(|t| !t.own && crate::threads::is_own_tid(t.tid));
            if became_own {
                self.finish_thread(idx, false);
            }
        }
    }

    /// Deletes every timer when another library replaced our signal's handler: their signals
    /// would reach a handler that does not expect them. Warned once, counted.
    fn check_handler(&mut self) {
        // A sigaction call; ten times a second is soon enough.
        if self.timers_off
            || self.tick % (self.cpu_hz / 10).max(1) != 0
            || handler_in_place(self.signal)
        {
            return;
        }
        self.timers_off = true;
        self.shared
            .stats
            .signal_handler_replaced
            .fetch_add(1, Ordering::Relaxed);
        log::warn!(
            "ferroprof: another handler was installed for signal {} (ferroprof's CPU sampling \
             signal); CPU sampling stops, wall sampling goes on. Pick another signal with \
             FERROPROF_SIGNAL or ProfilerBuilder::signal",
            self.signal
        );
        for t in self.threads.iter_mut().flatten() {
            if let Some(armed) = t.timer.take() {
                self.engine.disarm(armed);
            }
        }
    }

    /// Lists the process's threads: new ones get an entry and a timer, missing ones are
    /// finished. A listing costs about a microsecond per thread, so with many threads it
    /// comes less often than every tick (at most 1/LIST_BUDGET of the time).
    fn list_threads(&mut self, now: u64) {
        let mut tids = std::mem::take(&mut self.tids);
        // The listing's cost in the sampler's own CPU time: time on the clock would count the
        // rest of the tick and any wait for a CPU (milliseconds on a busy machine, which put
        // the next listing seconds away).
        let cpu0 = clock_ns(libc::CLOCK_THREAD_CPUTIME_ID).unwrap_or(0);
        let listed = match self.lister.as_mut() {
            Some(l) => l.list(&mut tids),
            None => false,
        };
        let cost = clock_ns(libc::CLOCK_THREAD_CPUTIME_ID)
            .unwrap_or(0)
            .saturating_sub(cpu0);
        self.next_list_at = now + (cost * LIST_BUDGET).max(self.period / 2);
        if !listed {
            self.tids = tids;
            return;
        }
        let first = self.listing == 0;
        self.listing += 1;
        let mut new_threads = false;
        for &tid in &tids {
            match self.by_tid.get(&tid) {
                Some(&idx) => {
                    if let Some(t) = self.threads[idx].as_mut() {
                        t.listed = self.listing;
                    }
                }
                None => {
                    new_threads = true;
                    self.add_thread(tid, now, first);
                }
            }
        }
        for idx in 0..self.threads.len() {
            let gone = self.threads[idx]
                .as_ref()
                .is_some_and(|t| t.listed != self.listing);
            if gone {
                if let Some(t) = self.threads[idx].as_mut().filter(|_| self.wall_enabled) {
                    // Its wall time since the last visit: it lived up to the last listing,
                    // then ended at an unknown time since (half that), as for an exit found
                    // by a visit. (An idle thread's last visit may be seconds ago.)
                    let since = now.saturating_sub(t.last_wall);
                    let sure = self.last_list_at.saturating_sub(t.last_wall).min(since);
                    let lived = sure + (since - sure) / 2;
                    let pay = lived.min(t.wall_debt);
                    t.wall_debt -= pay;
                    t.idle_wall += lived - pay;
                    t.last_wall = t.last_wall.max(now);
                }
                self.finish_thread(idx, true);
            }
        }
        self.last_list_at = now;
        if first {
            self.first_list_at = now;
        }
        self.tids = tids;
        self.maps_wanted |= new_threads;
    }

    fn add_thread(&mut self, tid: i32, now: u64, first: bool) {
        let own = crate::threads::is_own_tid(tid);
        let cpu = if own { Some(0) } else { thread_cpu_ns(tid) };
        let Some(cpu) = cpu else {
            return; // gone already
        };
        let idx = match self.free.pop() {
            Some(i) => i,
            None => {
                self.threads.push(None);
                self.gens.push(0);
                self.threads.len() - 1
            }
        };
        if idx >= 1 << 24 {
            return;
        }
        self.gens[idx] = self.gens[idx].wrapping_add(1);
        let gen = self.gens[idx];
        let mut name = String::new();
        if !own {
            refresh_name(self.task_dir(), tid, &mut name);
        }
        // A thread found by a later listing started since the last listing: the CPU it used
        // so far is in this profile, and its wall time since it started, as the kernel says
        // (to a clock tick), else since half-way between the previous tick and now. (The
        // thread count, checked every tick, misses a thread that started in the tick another
        // ended; the regular listing finds it later.)
        let (cpu_carry, since) = if first {
            // Threads listed at the start: their CPU from before it counts only when asked
            // (a profiler started with the process) or in a forked child (its clocks started
            // at the fork, with the child's profile).
            (if self.cpu_before_start { cpu } else { 0 }, now)
        } else {
            let after = self.last_tick_at.max(self.last_list_at);
            let since = thread_start_ns(self.task_dir(), tid).map_or(
                now - now.saturating_sub(after) / 2,
                |s| {
                    // Not before the profile began. (Not before the last listing either, one
                    // would think; but a listing can miss a thread when another exits while
                    // `/proc/self/task` is read.)
                    s.clamp(self.first_list_at.min(now), now)
                },
            );
            (cpu, since)
        };
        let mut t = ThreadInfo {
            tid,
            own,
            name,
            name_checks_left: 100,
            timer: None,
            last_cpu: cpu,
            last_wall: since,
            cpu_carry,
            wall_debt: 0,
            stack: Vec::new(),
            stack_sps: Vec::new(),
            ran: Vec::new(),
            ran_ctx: Ctx::EMPTY,
            wall_ctx: Ctx::EMPTY,
            seen_ctx: Ctx::EMPTY,
            idle_wall: 0,
            tick_rest: 0,
            hot_until: now + HOT_LINGER_NS,
            in_hot: !own,
            probation: !own,
            born: now,
            listed: self.listing,
            visited: 0,
        };
        if !own && !self.timers_off {
            let value = (MAGIC << 48) | (self.epoch << 40) | ((gen as u64) << 24) | idx as u64;
            match self.engine.arm(tid, self.signal, value, self.period) {
                Ok(armed) => t.timer = Some(armed),
                Err(err) => {
                    self.shared
                        .stats
                        .threads_without_timer
                        .fetch_add(1, Ordering::Relaxed);
                    if !self.timer_failure_logged {
                        self.timer_failure_logged = true;
                        log::warn!(
                            "ferroprof: the kernel refused the {} CPU engine for thread {tid} \
                             ({err}); threads without one get wall samples only (see \
                             ProfilerStats::threads_without_timer; RLIMIT_SIGPENDING bounds \
                             timers)",
                            self.engine.name()
                        );
                    }
                }
            }
        }
        if !own {
            self.hot.push(idx);
            self.sampled += 1;
        }
        self.threads[idx] = Some(t);
        self.by_tid.insert(tid, idx);
    }

    /// Ends thread entry `idx`: deletes its timer, records what it still carries. `gone`: the
    /// thread exited (its entry is freed); else it became one of ferroprof's threads and stays
    /// listed as such.
    fn finish_thread(&mut self, idx: usize, gone: bool) {
        let Some(mut t) = self.threads[idx].take() else {
            return;
        };
        if let Some(armed) = t.timer.take() {
            self.engine.disarm(armed);
        }
        if !t.own {
            self.sampled -= 1;
        }
        // (A gone entry left in `hot` is dropped by the next `visit_hot`.)
        // A thread that turned out to be ferroprof's (it registers from its own start, the
        // listing may come first) leaves nothing in the profile.
        if !t.own && gone {
            self.flush_idle(&mut t);
            self.book_carry(&mut t);
        }
        if gone {
            self.by_tid.remove(&t.tid);
            self.free.push(idx);
            self.exited += 1;
        } else {
            t.own = true;
            self.threads[idx] = Some(t);
        }
    }

    /// Records the CPU `t` used since its captures last accounted for it: where it last ran;
    /// where it never was caught running (a short thread, a short process's main thread) under
    /// `[cpu not sampled]` (see `record`), not where a wall visit found it waiting. Its clock's
    /// time is never dropped.
    fn book_carry(&mut self, t: &mut ThreadInfo) {
        if t.cpu_carry > 0 {
            let cpu = std::mem::take(&mut t.cpu_carry) as i64;
            record(
                &self.shared,
                &mut self.frames,
                t,
                &t.ran,
                &t.ran_ctx,
                cpu,
                0,
                0,
            );
        }
    }

    /// Takes the timers' captures out of the pool, sorted by thread and time.
    fn drain(&mut self) {
        self.caps.clear();
        self.cap_frames.clear();
        let len = POOL_LEN.load(Ordering::Acquire);
        let mut waiting = 0;
        for k in 0..len {
            let Some(s) = pool_slot(k) else { continue };
            if s.state.load(Ordering::Acquire) != DONE {
                continue;
            }
            waiting += 1;
            let payload = s.payload.load(Ordering::Relaxed);
            let mut idx = (payload & 0xff_ffff) as usize;
            let gen = ((payload >> 24) & 0xffff) as u16;
            let epoch = (payload >> 40) & 0xff;
            let mut mine = epoch == self.epoch
                && self.gens.get(idx) == Some(&gen)
                && self.threads.get(idx).is_some_and(|t| t.is_some());
            if payload & 0xff_ffff == child_trigger::CHILD_IDX {
                // The forked child's timer ran on the thread that forked, whose tid is the pid.
                // SAFETY: getpid has no preconditions.
                let pid = unsafe { libc::getpid() };
                if let Some(&i) = self.by_tid.get(&pid) {
                    idx = i;
                    mine = true;
                }
            }
            if mine {
                // SAFETY: DONE was observed with acquire ordering: the handler finished writing.
                let n = unsafe { s.buf() }
                    .copy_to(s.len.load(Ordering::Relaxed) as usize, &mut self.cap_frames);
                let start = self.cap_frames.len() - n;
                crate::unwind::learn(&self.cap_frames[start..]);
                let stats = &self.shared.stats;
                stats.count_handler(
                    self.stamps
                        .duration_ns(s.handler_stamps.load(Ordering::Relaxed)),
                );
                stats
                    .handler_frames_total
                    .fetch_add(n as u64, Ordering::Relaxed);
                stats.handler_count.fetch_add(1, Ordering::Relaxed);
                self.caps.push(Cap {
                    idx,
                    weight: s.weight.load(Ordering::Relaxed).max(1),
                    at: self.stamps.wall_ns(s, s.wall_at.load(Ordering::Relaxed)),
                    start,
                    len: n,
                    ctx: Ctx {
                        words: std::array::from_fn(|i| s.labels[i].load(Ordering::Relaxed)),
                    },
                });
            }
            s.state.store(FREE, Ordering::Release);
        }
        if waiting * 4 > len {
            add_chunk();
        }
        self.caps.sort_unstable_by_key(|c| (c.idx, c.at));
    }

    /// Visits the threads whose timers captured stacks since the last tick.
    fn visit_captured(&mut self, now: u64) {
        let caps = std::mem::take(&mut self.caps);
        let mut i = 0;
        while i < caps.len() {
            let idx = caps[i].idx;
            let mut j = i;
            while j < caps.len() && caps[j].idx == idx {
                j += 1;
            }
            self.visit(idx, now, &caps[i..j]);
            i = j;
        }
        self.caps = caps;
        self.caps.clear();
    }

    /// Visits the threads that ran lately; those idle for HOT_LINGER_NS leave the list.
    fn visit_hot(&mut self, now: u64) {
        let mut i = 0;
        while i < self.hot.len() {
            let idx = self.hot[i];
            let state = self.threads[idx]
                .as_mut()
                .filter(|t| !t.own && t.in_hot)
                .map(|t| (t.hot_until > now, t.visited != self.tick));
            match state {
                Some((true, due)) => {
                    if due {
                        self.visit(idx, now, &[]);
                    }
                    i += 1;
                }
                Some((false, _)) => {
                    if let Some(t) = self.threads[idx].as_mut() {
                        t.in_hot = false;
                    }
                    self.hot.swap_remove(i);
                }
                None => {
                    self.hot.swap_remove(i);
                }
            }
        }
    }

    /// Visits idle threads in turn: enough per tick that each comes up about every
    /// COLD_REVISIT_NS, and at least COLD_VISITS_PER_SEC a second in all.
    fn visit_cold(&mut self, now: u64, ticks: u64) {
        let n = self.threads.len();
        if n == 0 {
            return;
        }
        let cold = self.sampled.saturating_sub(self.hot.len()) as u64;
        if cold == 0 {
            return;
        }
        let by_rate = (COLD_VISITS_PER_SEC * ticks).div_ceil(self.cpu_hz);
        let by_revisit = (cold * ticks * self.period).div_ceil(COLD_REVISIT_NS);
        let mut budget = by_rate.max(by_revisit);
        let mut steps = 0;
        while budget > 0 && steps < n {
            let idx = self.cold_cursor % n;
            self.cold_cursor = (idx + 1) % n;
            steps += 1;
            let due = self.threads[idx]
                .as_ref()
                .is_some_and(|t| !t.own && t.visited != self.tick && t.hot_until <= now);
            if due {
                budget -= 1;
                self.visit(idx, now, &[]);
            }
        }
    }

    /// Samples thread entry `idx`: its captures of this tick (`caps`) get the CPU time it used
    /// since the last visit, and the wall time since then goes to where it is.
    fn visit(&mut self, idx: usize, now: u64, caps: &[Cap]) {
        let Some(mut t) = self.threads[idx].take() else {
            return;
        };
        if t.own {
            self.threads[idx] = Some(t);
            return;
        }
        t.visited = self.tick;
        self.shared.stats.cpu_ticks.fetch_add(1, Ordering::Relaxed);
        let clock = thread_cpu_ns(t.tid);
        // The time of this look, not of the tick: the sampler may have waited for a CPU since
        // the tick began (it competes with the threads it samples), and a look booked at an
        // earlier time than it was taken shifts wall time toward what threads do later.
        let now = monotonic_ns().max(now);
        // Gone: its last captures still get their CPU (a period each, as the timer counted).
        let cpu = clock.unwrap_or_else(|| {
            let periods: u64 = caps.iter().map(|c| c.weight as u64).sum();
            t.last_cpu + periods * self.period
        });
        // Re-read a new thread's name (it starts with its creator's): at every visit after it
        // ran at first, then every tenth, whether or not it renamed itself already (std names
        // a thread as it starts, and the application may name it again later: stopping at the
        // first change kept a late name unseen until the thread was busy at a once-a-second
        // refresh). Only a thread that ran can have renamed itself; counting visits it spent
        // unscheduled (a new thread on a loaded machine) used the checks up, and its whole
        // life went under its creator's name.
        let ran_since = !caps.is_empty() || clock.is_some_and(|c| c != t.last_cpu);
        if t.name_checks_left > 0 && ran_since {
            t.name_checks_left -= 1;
            if t.name_checks_left > 90 || t.name_checks_left % 10 == 0 {
                self.rename(&mut t);
            }
        }
        if t.probation {
            if crate::threads::is_own_tid(t.tid) {
                // One of ours that registered after the listing found it: nothing recorded.
                self.threads[idx] = Some(t);
                self.finish_thread(idx, false);
                return;
            }
            // Registration comes before a thread of ours has used a few microseconds of CPU,
            // except where starting a thread is slow; one already named as ours waits out
            // PROBATION_MAX_NS whatever it used.
            let named_ours = t.name.starts_with(OWN_NAME_PREFIX);
            t.probation = (cpu < PROBATION_CPU_NS || named_ours)
                && now.saturating_sub(t.born) < PROBATION_MAX_NS;
        }
        let used = cpu.saturating_sub(t.last_cpu);
        t.last_cpu = t.last_cpu.max(cpu);
        let ran = used > 0 || !caps.is_empty();
        t.cpu_carry += used;
        if t.probation {
            // Its CPU stays in the carry, its last capture is where it ran.
            if let Some(c) = caps.last() {
                t.ran_ctx = c.ctx;
                t.ran.clear();
                t.ran
                    .extend_from_slice(&self.cap_frames[c.start..c.start + c.len]);
            }
        } else if !caps.is_empty() {
            // Each capture stands for its periods of CPU (1 + the timer's overruns): weights
            // fixed in advance keep the samples unbiased (weighing each by the CPU time since
            // the one before, as the clock would, favoured code where the timer's signal comes
            // late). The clock keeps the totals: what it ran ahead of the captures by more than
            // a period (captures lost to a full pool) is spread over these.
            self.flush_idle(&mut t);
            let weights: u64 = caps.iter().map(|c| c.weight as u64).sum();
            let base = weights * self.period;
            let extra = t.cpu_carry.saturating_sub(base).saturating_sub(self.period);
            let total = base + extra;
            t.cpu_carry = t.cpu_carry.saturating_sub(total);
            let mut before = 0u64;
            for c in caps {
                let share = total * (before + c.weight as u64) / weights - total * before / weights;
                before += c.weight as u64;
                t.ran_ctx = c.ctx;
                t.ran.clear();
                t.ran
                    .extend_from_slice(&self.cap_frames[c.start..c.start + c.len]);
                // With wall time on, `cpu-samples` counts ticks of wall time (as many per thread
                // as its lifetime has ticks); else periods of CPU.
                let (wall, count) = if self.wall_enabled {
                    (share, t.ticks_of(share, self.period))
                } else {
                    (0, c.weight as i64)
                };
                t.wall_debt += wall;
                record(
                    &self.shared,
                    &mut self.frames,
                    &t,
                    &t.ran,
                    &c.ctx,
                    share as i64,
                    wall as i64,
                    count,
                );
            }
            self.shared
                .stats
                .cpu_timer_samples
                .fetch_add(caps.len() as u64, Ordering::Relaxed);
        }
        if clock.is_none() {
            // It exited since the last visit, at an unknown time: half the interval, as for a
            // thread's start.
            if self.wall_enabled {
                let since = now.saturating_sub(t.last_wall);
                let pay = (since / 2).min(t.wall_debt);
                t.wall_debt -= pay;
                t.idle_wall += since / 2 - pay;
            }
            self.threads[idx] = Some(t);
            self.finish_thread(idx, true);
            return;
        }
        // The thread stopping the profiler: its wall time in there is the profiler's.
        if !self.wall_enabled || t.tid == crate::threads::stopper_tid() {
            t.last_wall = now;
            self.threads[idx] = Some(t);
            return;
        }
        let wall = now.saturating_sub(t.last_wall);
        t.last_wall = t.last_wall.max(now);
        // The interval's off-CPU time: its wall time less what the captures took.
        let pay = wall.min(t.wall_debt);
        t.wall_debt -= pay;
        let off = wall - pay;
        // Where it stands now, when it may have moved. When it did, the interval is split half
        // and half between where it was and where it is: the move happened at an unknown time
        // in between, and halves are unbiased with a third of the variance of booking the whole
        // interval to one side.
        let mut moved_to = Moved::Nowhere;
        // Its stack was read now (it stands still in a system call): `t.stack` is where it is.
        let mut read_now = false;
        if ran || t.stack.is_empty() {
            if ran {
                t.hot_until = now + HOT_LINGER_NS;
                if !t.in_hot {
                    t.in_hot = true;
                    self.hot.push(idx);
                }
            }
            // Runnable now: where it last ran, if it mostly ran since the last visit (else it
            // mostly waited where it was, and has just woken).
            let busy = !t.ran.is_empty() && (!caps.is_empty() || used * 2 >= wall);
            // A thread that used nearly all the interval's time on CPU is running or waiting
            // for a CPU: no need to ask /proc where it is.
            let where_now = if busy && used * 10 >= wall * 9 {
                Where::Ran
            } else {
                self.where_now(&t, cpu, busy)
            };
            match where_now {
                Where::Gone => {
                    // Gone between the clock read and now: it lived about the interval.
                    t.idle_wall += off;
                    self.threads[idx] = Some(t);
                    self.finish_thread(idx, true);
                    return;
                }
                Where::Read(n) if t.stack[..] != self.remote_frames[..n] => {
                    moved_to = Moved::Read(n);
                }
                Where::Read(_) => read_now = true,
                Where::Ran if t.stack != t.ran => moved_to = Moved::Ran,
                _ => {}
            }
        }
        // Labels changed since the last visit: the change is a move too (same split).
        let ctx = self.labels.read(t.tid);
        let relabelled = ctx != t.seen_ctx;
        t.seen_ctx = ctx;
        if moved_to == Moved::Nowhere && !relabelled {
            t.idle_wall += off;
        } else {
            t.idle_wall += off / 2;
            if !t.probation {
                self.flush_idle(&mut t);
            }
            // Each stack with the labels seen with it: a stack read now with the labels read
            // now (the thread stood still), where it last ran with its labels there. A thread
            // whose labels changed ran meanwhile: unless its stack was just read where it
            // stands, where it last ran, rather than an older stack under the new labels.
            match moved_to {
                Moved::Read(n) => {
                    t.stack.clear();
                    t.stack.extend_from_slice(&self.remote_frames[..n]);
                    t.stack_sps.clear();
                    t.stack_sps.extend_from_slice(&self.remote_sps[..n]);
                    t.wall_ctx = ctx;
                }
                Moved::Ran => {
                    t.stack.clone_from(&t.ran);
                    t.stack_sps.clear();
                    t.wall_ctx = t.ran_ctx;
                }
                Moved::Nowhere if ran && !read_now && !t.ran.is_empty() => {
                    if t.stack != t.ran {
                        t.stack.clone_from(&t.ran);
                        t.stack_sps.clear();
                    }
                    t.wall_ctx = t.ran_ctx;
                }
                Moved::Nowhere => t.wall_ctx = ctx,
            }
            t.idle_wall += off - off / 2;
        }
        if (ran || t.idle_wall >= IDLE_FLUSH_NS) && !t.probation {
            self.flush_idle(&mut t);
        }
        self.threads[idx] = Some(t);
    }

    /// Where thread `t` (that ran since its last visit, CPU clock `cpu`) stands now. `busy`:
    /// when it is runnable, it waits where its timer last caught it.
    fn where_now(&mut self, t: &ThreadInfo, cpu: u64, busy: bool) -> Where {
        let mut cpu = cpu;
        for _ in 0..LOOK_ATTEMPTS {
            match self.look(t, cpu, busy) {
                Ok(w) => return w,
                Err(moved_on) => {
                    self.shared
                        .stats
                        .wall_remote_retries
                        .fetch_add(1, Ordering::Relaxed);
                    cpu = moved_on;
                }
            }
        }
        if busy {
            Where::Ran
        } else {
            Where::Unchanged
        }
    }

    /// One look at thread `t` for [`Self::where_now`]: `Err` with its new CPU clock when it ran
    /// while its stack was copied (the copy may be torn).
    fn look(&mut self, t: &ThreadInfo, cpu: u64, busy: bool) -> Result<Where, u64> {
        let fallback = if busy { Where::Ran } else { Where::Unchanged };
        let mut moved_on = None;
        // Asked right after the copy: the walk goes over the copy, so only the copy must be
        // taken while the thread stands still.
        let mut stood_still = || match thread_cpu_ns(t.tid) {
            Some(c) if c != cpu => {
                moved_on = Some(c);
                false
            }
            _ => true,
        };
        let stats = &self.shared.stats;
        let (read, counter) = match remote::task_syscall(self.task_dir(), t.tid) {
            TaskSyscall::Gone => return Ok(Where::Gone),
            TaskSyscall::Running if busy || t.stack_sps.is_empty() => return Ok(fallback),
            // It mostly waited since the last visit, ran a little, and is runnable now: most
            // likely woken from a wait and waiting for a CPU. The calls it made since its
            // stack was read say where it waited.
            TaskSyscall::Running => (
                self.remote.recent_calls(
                    &t.stack,
                    &t.stack_sps,
                    &mut self.remote_frames,
                    &mut self.remote_sps,
                    &mut stood_still,
                ),
                &stats.wall_recent_calls,
            ),
            TaskSyscall::InSyscall { sp, pc, .. } | TaskSyscall::Stopped { sp, pc } => (
                self.remote.unwind(
                    sp,
                    pc,
                    &mut self.remote_frames,
                    &mut self.remote_sps,
                    &mut stood_still,
                ),
                &stats.wall_remote_stacks,
            ),
        };
        let Ok(n) = read else {
            return Err(moved_on.unwrap_or(cpu));
        };
        if n == 0 {
            return Ok(fallback);
        }
        counter.fetch_add(1, Ordering::Relaxed);
        Ok(Where::Read(n))
    }

    /// Re-reads thread `t`'s name. When it changed, the wall time it kept from before its
    /// last visit goes under the old name first; the interval since, in which it renamed
    /// itself, under the new one.
    fn rename(&mut self, t: &mut ThreadInfo) {
        let mut buf = [0u8; 64];
        let fresh = read_comm(self.task_dir(), t.tid, &mut buf);
        if fresh.is_empty() || fresh == t.name {
            return;
        }
        if !t.probation {
            self.flush_idle(t);
        }
        fresh.clone_into(&mut t.name);
    }

    /// Records the off-CPU wall time `t` accumulated, on its stack (or where it ran, when its
    /// stack was never read). Kept for later when neither is known.
    fn flush_idle(&mut self, t: &mut ThreadInfo) {
        if t.idle_wall == 0 || (t.stack.is_empty() && t.ran.is_empty()) {
            return;
        }
        let wall = std::mem::take(&mut t.idle_wall);
        let count = t.ticks_of(wall, self.period);
        // (Each stack with the labels seen with it: see `wall_ctx`.)
        let (stack, ctx) = if !t.stack.is_empty() {
            (&t.stack, &t.wall_ctx)
        } else {
            (&t.ran, &t.ran_ctx)
        };
        record(
            &self.shared,
            &mut self.frames,
            t,
            stack,
            ctx,
            0,
            wall as i64,
            count,
        );
    }

    /// New threads bring stacks the unwinder's snapshot does not know: refresh the maps, at
    /// most every 20 ms; check for newly loaded objects every second.
    fn refresh_unwinder(&mut self) {
        let since = self.tick - self.last_refresh;
        self.maps_wanted |= unwind::maps_stale();
        if (self.maps_wanted && since * 1000 >= 20 * self.cpu_hz) || since >= self.cpu_hz {
            unwind::refresh(self.maps_wanted);
            self.maps_wanted = false;
            self.last_refresh = self.tick;
        }
    }

    /// Tells the export thread that threads exited since its last export (see
    /// [`trim_after_export`]).
    fn give_back_memory(&mut self) {
        if self.exited != 0 {
            self.exited = 0;
            THREADS_EXITED.store(true, Ordering::Relaxed);
        }
    }

    /// On stop: the last captures and visits, then every timer deleted.
    fn finish(&mut self) {
        // The thread stopping the profiler counts as ferroprof's (see `ProfilerGuard::stop`).
        self.check_own_threads();
        self.stamps.update();
        let now = monotonic_ns();
        self.tick += 1;
        if self.listing == 0 {
            // Stopped before its first tick (a process that lived under a period, or a forked
            // child restarted at its exit): its threads, and their CPU, are found now.
            self.list_threads(now);
        }
        self.drain();
        self.visit_captured(now);
        // Every thread's clock is read a last time: the CPU since its last capture is booked.
        self.visit_the_rest(now);
        for idx in 0..self.threads.len() {
            self.finish_thread(idx, true);
        }
    }
}

/// Where a visit found a thread that is not where it was: its stack read into
/// `remote_frames[..n]`, or where its timer last caught it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Moved {
    Nowhere,
    Read(usize),
    Ran,
}

enum Where {
    Gone,
    /// Its stack was read into `remote_frames[..n]`.
    Read(usize),
    /// Runnable: where its timer last caught it.
    Ran,
    Unchanged,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn stamps_convert_to_monotonic_time() {
        let mut clock = StampClock::new();
        let (s0, m0) = (stamp(), monotonic_ns());
        std::thread::sleep(Duration::from_millis(30));
        let (s1, m1) = (stamp(), monotonic_ns());
        clock.update();
        // A 30 ms interval measured in stamps converts to within 2% of the monotonic clock's.
        let d = clock.duration_ns(s1.wrapping_sub(s0)) as f64;
        let truth = (m1 - m0) as f64;
        assert!((d / truth - 1.0).abs() < 0.02, "{d} ns vs {truth} ns");
        // A stamp taken as wall time lands within 1 ms of the monotonic reading beside it.
        let slot = Slot::new(std::ptr::null_mut());
        let at = clock.wall_ns(&slot, if slot.stamp_wall { s0 } else { m0 });
        assert!(at.abs_diff(m0) < 1_000_000, "{at} vs {m0}");
    }

    #[test]
    fn lists_own_threads() {
        let mut l = TaskLister::open().expect("open /proc/self/task");
        let mut out = Vec::new();
        assert!(l.list(&mut out));
        // SAFETY: no preconditions.
        let me = unsafe { libc::gettid() };
        assert!(out.contains(&me), "{out:?} lacks {me}");
    }

    #[test]
    fn reads_thread_names_with_and_without_the_task_directory() {
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let h = std::thread::Builder::new()
            .name("name-probe-123".into())
            .spawn(move || {
                // SAFETY: no preconditions.
                tx.send(unsafe { libc::gettid() }).unwrap();
                let _ = stop_rx.recv();
            })
            .unwrap();
        let tid = rx.recv().unwrap();
        let l = TaskLister::open().expect("open /proc/self/task");
        let mut buf = [0u8; 64];
        assert_eq!(read_comm(Some(l.fd), tid, &mut buf), "name-probe-123");
        assert_eq!(read_comm(None, tid, &mut buf), "name-probe-123");
        let mut name = String::from("old");
        assert!(refresh_name(Some(l.fd), tid, &mut name));
        assert_eq!(name, "name-probe-123");
        assert!(!refresh_name(Some(l.fd), tid, &mut name), "unchanged");
        stop_tx.send(()).unwrap();
        h.join().unwrap();
        assert!(
            eventually(|| read_comm(Some(l.fd), tid, &mut [0u8; 64]).is_empty()),
            "name of exited thread {tid} still readable"
        );
    }

    #[test]
    fn reads_another_threads_cpu_clock() {
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let h = std::thread::spawn(move || {
            // SAFETY: no preconditions.
            tx.send(unsafe { libc::gettid() }).unwrap();
            let mut x = 0u64;
            while stop_rx.try_recv().is_err() {
                x = std::hint::black_box(x.wrapping_add(1));
            }
        });
        let tid = rx.recv().unwrap();
        let a = thread_cpu_ns(tid).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        let b = thread_cpu_ns(tid).unwrap();
        stop_tx.send(()).unwrap();
        h.join().unwrap();
        assert!(b > a, "{a} -> {b}");
        // `join` returns when the thread cleared its tid word, which the kernel does before
        // the task is gone: its clock stays readable for a moment.
        assert!(
            eventually(|| thread_cpu_ns(tid).is_none()),
            "clock of exited thread {tid} still readable"
        );
    }

    #[test]
    fn handlers_claim_free_slots_and_a_full_pool_is_counted() {
        if POOL_LEN.load(Ordering::Acquire) == 0 {
            add_chunk();
        }
        let len = POOL_LEN.load(Ordering::Acquire);
        let mut claimed: Vec<&'static Slot> = Vec::new();
        while let Some(s) = claim_slot(0) {
            assert_eq!(s.state.load(Ordering::Acquire), CAPTURING);
            assert!(
                !claimed.iter().any(|&c| std::ptr::eq(c, s)),
                "a slot is never handed out twice"
            );
            claimed.push(s);
            assert!(claimed.len() <= len, "more slots than the pool has");
        }
        // The tries start at a moving cursor: nearly the whole pool is found before one fails.
        assert!(
            claimed.len() >= CLAIM_TRIES.min(len),
            "{} of {len}",
            claimed.len()
        );
        let lost = LOST.load(Ordering::Relaxed);
        assert!(claim_slot(0).is_none() || claimed.len() < len);
        assert!(
            LOST.load(Ordering::Relaxed) >= lost,
            "a failed claim is counted"
        );
        let first = claimed[0];
        first.state.store(FREE, Ordering::Release);
        let again = (0..len)
            .find_map(|_| claim_slot(0))
            .expect("the freed slot");
        assert!(std::ptr::eq(again, first));
        claimed.push(again);
        for s in claimed {
            s.state.store(FREE, Ordering::Release);
        }
    }

    /// Whether `cond` holds within a second (for what the kernel finishes after `join`).
    fn eventually(mut cond: impl FnMut() -> bool) -> bool {
        let deadline = std::time::Instant::now() + Duration::from_secs(1);
        while !cond() {
            if std::time::Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }
}
