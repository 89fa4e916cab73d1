//! Between the export thread and the exporters: a bounded hand-off per exporter.
//!
//! The export thread must serialize on schedule whatever an exporter does: a directory exporter
//! on a hung mount blocks in `write`/`fsync` for ever, and while the export thread waited the
//! active profile grew without bound. So every exporter whose `export` may block gets a thread of
//! its own and a queue of [`CAPACITY`] profiles in front of it: handing a profile over never
//! waits; when the queue is full the oldest queued profile is dropped and counted. Exporters that
//! already queue on their own thread ([`Exporter::queues_profiles`], the network exporters) are
//! called directly, so no profile is queued twice.
//!
//! At stop, the delivery threads get until a deadline to deliver what they hold and run their
//! exporter's `shutdown`; a thread still busy then is left behind (detached) and its exporter
//! named in `stop()`'s error.
//!
//! The queue (a `std` mutex and condvar: futex-based, nothing left in a global wait table by a
//! thread waiting at the fork) is shared only by the export thread and the delivery thread. In a
//! forked child neither thread exists any more: the child's first hand-off leaves the parent's
//! queue behind (those profiles are the parent's), takes the exporter back and starts a fresh
//! delivery thread for it. An exporter caught inside `export` by the fork is taken back too (its
//! lock forced open), as the export thread did when it called exporters itself: what an exporter
//! keeps across calls is its own to keep sane.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ferroprof_export::{ExportError, ExportedProfile, Exporter, QueuedShare};

/// Profiles waiting for one exporter, at most (the one being delivered not counted).
pub const CAPACITY: usize = 2;

/// Progress of one hand-off, for `flush()`: the newest export round whose profile this exporter
/// is done with (delivered, failed or dropped), and the newest one that did not get through.
#[derive(Default)]
struct Progress {
    resolved: AtomicU64,
    failed: AtomicU64,
}

/// Counters over all hand-offs, shared with the profiler's guard.
#[derive(Default)]
pub(crate) struct Deliveries {
    /// Profiles an exporter behind a hand-off accepted.
    pub delivered: AtomicU64,
    /// Profiles an exporter behind a hand-off returned an error for.
    pub failed: AtomicU64,
    /// Profiles dropped because the exporter's queue was full (it is slower than the period, or
    /// stuck).
    pub dropped: AtomicU64,
    /// Profiles left undelivered when a stop's deadline passed (queued or being delivered).
    pub abandoned: AtomicU64,
    /// The export round a flush was served by (see [`Outbox::send`]).
    pub flush_round: AtomicU64,
    /// Exporters still busy when a stop's deadline passed (a forked child resets it: see
    /// `Shared::after_fork_in_child`).
    pub abandoned_names: crate::forklock::Mutex<Vec<String>>,
    progress: Vec<Arc<Progress>>,
}

impl Deliveries {
    /// Waits until every hand-off is done with export round `round`, until `deadline` at most.
    /// `Ok(true)`: all delivered; `Ok(false)`: done, but an exporter failed or dropped it;
    /// `Err(())`: the deadline passed first.
    pub(crate) fn wait_round(&self, round: u64, deadline: Instant) -> Result<bool, ()> {
        loop {
            if self
                .progress
                .iter()
                .all(|p| p.resolved.load(Ordering::SeqCst) >= round)
            {
                return Ok(self
                    .progress
                    .iter()
                    .all(|p| p.failed.load(Ordering::SeqCst) < round));
            }
            if Instant::now() >= deadline {
                return Err(());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

struct Queue {
    items: VecDeque<(u64, Arc<ExportedProfile>)>,
    /// What `items` holds, in the process's total.
    share: QueuedShare,
    /// A profile is being delivered.
    busy: bool,
    /// Set at shutdown: deliver what is queued until then, then stop.
    closing: Option<Instant>,
    /// Stop without calling the exporter's `shutdown` (the profiler never started).
    discard: bool,
    /// The delivery thread is done.
    finished: bool,
}

impl Queue {
    fn recount(&mut self) {
        let bytes = self
            .items
            .iter()
            .map(|(_, p)| p.encoded.bytes.len() as u64)
            .sum();
        self.share.set(bytes);
    }
}

struct Chan {
    queue: Mutex<Queue>,
    wake: Condvar,
    /// Locked only by the delivery thread, and by a forked child taking the exporter back.
    exporter: crate::forklock::Mutex<Option<Box<dyn Exporter>>>,
}

impl Chan {
    fn new(exporter: Option<Box<dyn Exporter>>) -> Arc<Chan> {
        Arc::new(Chan {
            queue: Mutex::new(Queue {
                share: QueuedShare::default(),
                items: VecDeque::with_capacity(CAPACITY),
                busy: false,
                closing: None,
                discard: false,
                finished: exporter.is_none(),
            }),
            wake: Condvar::new(),
            exporter: crate::forklock::Mutex::new(exporter),
        })
    }

    fn queue(&self) -> MutexGuard<'_, Queue> {
        // A panicking exporter poisons nothing we rely on: the queue is updated in whole steps.
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One exporter on its own delivery thread.
struct HandOff {
    name: String,
    /// The process the delivery thread runs in (a forked child has to start its own).
    pid: u32,
    chan: Arc<Chan>,
    progress: Arc<Progress>,
    deliveries: Arc<Deliveries>,
    warned: AtomicBool,
}

impl HandOff {
    fn start(
        exporter: Box<dyn Exporter>,
        progress: Arc<Progress>,
        deliveries: Arc<Deliveries>,
    ) -> std::io::Result<HandOff> {
        let h = HandOff {
            name: exporter.name().to_owned(),
            pid: std::process::id(),
            chan: Chan::new(Some(exporter)),
            progress,
            deliveries,
            warned: AtomicBool::new(false),
        };
        h.spawn()?;
        Ok(h)
    }

    fn spawn(&self) -> std::io::Result<()> {
        let (chan, progress, deliveries) = (
            self.chan.clone(),
            self.progress.clone(),
            self.deliveries.clone(),
        );
        let name = self.name.clone();
        // Not std::thread: a forked child starts this thread again (see `crate::ownthread`).
        crate::ownthread::spawn(&format!("ferroprof-{}", self.name), 1 << 20, move || {
            crate::threads::enter_profiler_thread();
            deliver_loop(&name, &chan, &progress, &deliveries);
        })
        .map(drop)
    }

    /// In a forked child, before anything touches the channel: see the module docs.
    fn restart_if_forked(&mut self) {
        if self.pid == std::process::id() {
            return;
        }
        self.pid = std::process::id();
        // SAFETY: a holder is the parent's delivery thread, which does not exist in this child;
        // no guard of the lock will ever be used here, and nobody else takes it.
        unsafe { crate::forklock::reset_in_child(&self.chan.exporter) };
        let exporter = self.chan.exporter.lock().take();
        // The parent's queue is left as it is: its lock may be held by the vanished thread.
        std::mem::forget(std::mem::replace(&mut self.chan, Chan::new(exporter)));
        if !self.chan.queue().finished && self.spawn().is_err() {
            self.chan.queue().finished = true;
            log::warn!(
                "ferroprof: {} exporter: cannot start its delivery thread in this forked child",
                self.name
            );
        }
    }

    fn hand(&mut self, round: u64, profile: &Arc<ExportedProfile>) {
        self.restart_if_forked();
        let dropped = {
            let mut q = self.chan.queue();
            if q.finished || q.closing.is_some() {
                Some(round)
            } else {
                let old = if q.items.len() >= CAPACITY {
                    q.items.pop_front().map(|(r, _)| r)
                } else {
                    None
                };
                q.items.push_back((round, profile.clone()));
                q.recount();
                self.chan.wake.notify_all();
                old
            }
        };
        if let Some(r) = dropped {
            self.progress.failed.fetch_max(r, Ordering::SeqCst);
            self.progress.resolved.fetch_max(r, Ordering::SeqCst);
            let n = self.deliveries.dropped.fetch_add(1, Ordering::Relaxed) + 1;
            if !self.warned.swap(true, Ordering::Relaxed) {
                log::warn!(
                    "ferroprof: {} exporter: it holds {CAPACITY} profiles already (slow or \
                     stuck); dropping the oldest ({n} dropped so far, see ProfilerStats)",
                    self.name
                );
            }
        }
    }

    fn begin_shutdown(&mut self, until: Instant) {
        self.restart_if_forked();
        let mut q = self.chan.queue();
        q.closing.get_or_insert(until);
        self.chan.wake.notify_all();
    }

    /// Waits for the delivery thread to finish, until `until`. Returns `None` when it finished,
    /// else the profiles it still held (queued or being delivered; 0 when it is stuck in its
    /// exporter's `shutdown`).
    fn wait(&mut self, until: Instant) -> Option<u64> {
        self.restart_if_forked();
        let mut q = self.chan.queue();
        while !q.finished {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let n = q.items.len() as u64 + u64::from(q.busy);
                // Free what it holds; the thread, if it ever comes back, finds nothing to do.
                q.items.clear();
                q.recount();
                return Some(n);
            }
            q = self
                .chan
                .wake
                .wait_timeout(q, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        None
    }
}

impl Drop for HandOff {
    fn drop(&mut self) {
        if self.pid != std::process::id() {
            // A forked child's copy never used: the channel's locks may be held by the
            // parent's delivery thread, which does not exist here. Leave it.
            std::mem::forget(self.chan.clone());
            return;
        }
        // Not shut down (the profiler failed to start): let the thread go without waiting.
        let mut q = self.chan.queue();
        if q.closing.is_none() {
            q.closing = Some(Instant::now());
            q.discard = true;
        }
        self.chan.wake.notify_all();
    }
}

fn deliver_loop(name: &str, chan: &Chan, progress: &Progress, deliveries: &Deliveries) {
    loop {
        let next = {
            let mut q = chan.queue();
            loop {
                if q.discard {
                    break None;
                }
                if let Some(item) = q.items.pop_front() {
                    q.recount();
                    q.busy = true;
                    break Some(item);
                }
                if q.closing.is_some() {
                    break None;
                }
                q = chan.wake.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        let Some((round, profile)) = next else { break };
        let result = {
            let mut ex = chan.exporter.lock();
            match ex.as_mut() {
                Some(e) => e.export(&profile),
                None => Err(ExportError::Config("exporter lost".into())),
            }
        };
        drop(profile);
        match result {
            Ok(()) => {
                deliveries.delivered.fetch_add(1, Ordering::Relaxed);
            }
            Err(e) => {
                deliveries.failed.fetch_add(1, Ordering::Relaxed);
                progress.failed.fetch_max(round, Ordering::SeqCst);
                log::warn!("ferroprof: {name} exporter: {e}");
            }
        }
        progress.resolved.fetch_max(round, Ordering::SeqCst);
        chan.queue().busy = false;
    }
    let (closing, discard) = {
        let q = chan.queue();
        (q.closing, q.discard)
    };
    if !discard {
        let left = closing.map_or(Duration::ZERO, |c| {
            c.saturating_duration_since(Instant::now())
        });
        let mut ex = chan.exporter.lock();
        if let Some(e) = ex.as_mut() {
            e.shutdown(left);
        }
    }
    chan.queue().finished = true;
    chan.wake.notify_all();
}

enum Sink {
    /// Queues on its own thread already: called from the export thread.
    Direct(Box<dyn Exporter>),
    HandOff(HandOff),
}

/// What an exporter called directly said: its name and its `export` result.
pub(crate) type DirectResult = (String, Result<(), ExportError>);

/// The export thread's exporters.
pub(crate) struct Outbox {
    sinks: Vec<Sink>,
    deliveries: Arc<Deliveries>,
    round: u64,
}

impl Outbox {
    pub(crate) fn deliveries(&self) -> &Deliveries {
        &self.deliveries
    }

    /// Gives every exporter that may block a delivery thread (started here).
    pub(crate) fn new(
        exporters: Vec<Box<dyn Exporter>>,
    ) -> std::io::Result<(Outbox, Arc<Deliveries>)> {
        let progress: Vec<(bool, Arc<Progress>)> = exporters
            .iter()
            .map(|e| (e.queues_profiles(), Arc::default()))
            .collect();
        let deliveries = Arc::new(Deliveries {
            progress: progress
                .iter()
                .filter(|(direct, _)| !direct)
                .map(|(_, p)| p.clone())
                .collect(),
            ..Deliveries::default()
        });
        let mut sinks = Vec::with_capacity(exporters.len());
        for (e, (direct, p)) in exporters.into_iter().zip(progress) {
            sinks.push(if direct {
                Sink::Direct(e)
            } else {
                Sink::HandOff(HandOff::start(e, p, deliveries.clone())?)
            });
        }
        Ok((
            Outbox {
                sinks,
                deliveries: deliveries.clone(),
                round: 0,
            },
            deliveries,
        ))
    }

    /// Hands `profile` to every exporter, never waiting for one. Returns the export round (for
    /// [`Deliveries::wait_round`]) and what exporters called directly said.
    pub(crate) fn send(&mut self, profile: ExportedProfile) -> (u64, Vec<DirectResult>) {
        self.round += 1;
        let round = self.round;
        let profile = Arc::new(profile);
        let mut direct = Vec::new();
        for s in &mut self.sinks {
            match s {
                Sink::Direct(e) => direct.push((e.name().to_owned(), e.export(&profile))),
                Sink::HandOff(h) => h.hand(round, &profile),
            }
        }
        (round, direct)
    }

    /// Lets every exporter deliver what it holds and shut down, all together, within `timeout`.
    /// Returns the names of those still busy at the deadline (left behind).
    pub(crate) fn shutdown(&mut self, timeout: Duration) -> Vec<String> {
        let until = Instant::now() + timeout;
        for s in &mut self.sinks {
            if let Sink::HandOff(h) = s {
                h.begin_shutdown(until);
            }
        }
        for s in &mut self.sinks {
            if let Sink::Direct(e) = s {
                e.shutdown(until.saturating_duration_since(Instant::now()));
            }
        }
        let mut stuck = Vec::new();
        for s in &mut self.sinks {
            if let Sink::HandOff(h) = s {
                if let Some(left) = h.wait(until) {
                    self.deliveries.abandoned.fetch_add(left, Ordering::Relaxed);
                    log::warn!(
                        "ferroprof: {} exporter: still busy after the {timeout:?} stop deadline; \
                         left behind with {left} profile(s) undelivered",
                        h.name
                    );
                    stuck.push(h.name.clone());
                }
            }
        }
        stuck
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferroprof_recorder::{EncodedProfile, ProfileStats};
    use std::time::SystemTime;

    fn profile() -> ExportedProfile {
        ExportedProfile {
            encoded: EncodedProfile {
                bytes: vec![1, 2, 3],
                start: SystemTime::now(),
                end: SystemTime::now(),
                compression: ferroprof_recorder::Compression::None,
                endpoint_counts: Vec::new(),
            },
            stats: ProfileStats::default(),
            service: "t".into(),
            tags: Vec::new(),
            sample_types: Vec::new(),
            process_start: SystemTime::now(),
        }
    }

    /// Blocks in `export` until the test lets it go.
    struct Gate(Arc<(Mutex<bool>, Condvar)>, Arc<AtomicU64>);

    impl Exporter for Gate {
        fn name(&self) -> &str {
            "gate"
        }
        fn export(&mut self, _: &ExportedProfile) -> Result<(), ExportError> {
            let (m, c) = &*self.0;
            let mut open = m.lock().unwrap();
            while !*open {
                open = c.wait(open).unwrap();
            }
            self.1.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    }

    #[test]
    fn a_blocked_exporter_costs_a_bounded_queue_and_a_bounded_stop() {
        let gate = Arc::new((Mutex::new(false), Condvar::new()));
        let done = Arc::new(AtomicU64::new(0));
        let (mut out, d) = Outbox::new(vec![Box::new(Gate(gate.clone(), done.clone()))]).unwrap();
        let t = Instant::now();
        for _ in 0..10 {
            out.send(profile());
        }
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "handing over never waits"
        );
        // One in delivery, CAPACITY queued, the rest dropped (the first may not be taken yet).
        let dropped = d.dropped.load(Ordering::SeqCst);
        assert!((10 - CAPACITY as u64 - 1..=10 - CAPACITY as u64).contains(&dropped));
        assert_eq!(
            d.wait_round(10, Instant::now() + Duration::from_millis(50)),
            Err(())
        );
        let t = Instant::now();
        let stuck = out.shutdown(Duration::from_millis(200));
        assert!(t.elapsed() < Duration::from_secs(2));
        assert_eq!(stuck, vec!["gate".to_owned()]);
        assert!(d.abandoned.load(Ordering::SeqCst) >= 1);
        // Let it go: the thread comes back and ends without delivering the cleared queue.
        *gate.0.lock().unwrap() = true;
        gate.1.notify_all();
    }

    #[test]
    fn healthy_exporters_deliver_and_flush_rounds_resolve() {
        let gate = Arc::new((Mutex::new(true), Condvar::new()));
        let done = Arc::new(AtomicU64::new(0));
        let (mut out, d) = Outbox::new(vec![Box::new(Gate(gate, done.clone()))]).unwrap();
        let (round, direct) = out.send(profile());
        assert!(direct.is_empty());
        assert_eq!(
            d.wait_round(round, Instant::now() + Duration::from_secs(10)),
            Ok(true)
        );
        assert_eq!(done.load(Ordering::SeqCst), 1);
        assert!(out.shutdown(Duration::from_secs(10)).is_empty());
        assert_eq!(d.delivered.load(Ordering::SeqCst), 1);
    }
}
