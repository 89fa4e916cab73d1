//! The running profiler's threads: starting them (also again in a forked child), the export
//! loop and one export.

use super::*;
use ferroprof_recorder::{Label, LateSamples};

pub(super) fn start_threads_if_stopped(sh: &Arc<Shared>) {
    let running = {
        let t = sh.threads.lock();
        t.sampler.is_some() || t.export.is_some()
    };
    if !running && !sh.stopping.load(Ordering::SeqCst) && spawn_threads(sh).is_ok() {
        // A child that lives on ends as its parent would: a SIGTERM writes its last profile.
        crate::termination::rearm_in_child(sh);
    }
}

/// Restarts profiling in a forked child now: when the profiler was built with
/// `restart_after_fork(false)`, or to start the child's profiler threads at once (by default
/// they start after the child's first period of CPU, or at its first sampled allocation or
/// profiler call). Does nothing when no profiler runs or its threads are alive.
pub fn after_fork() {
    // Takes over a pending restart, or waits for the thread doing one.
    crate::forkgate::begin_restart();
    crate::tls::with_guard(restart_threads);
    crate::forkgate::end_restart();
}

/// Starts the running profiler's threads unless they run (the restart hook of `forkgate`).
pub(super) fn restart_threads() {
    if let Some(sh) = state::active_arc() {
        start_threads_if_stopped(&sh);
    }
}

/// Starts the export thread, then the sampler (so the export thread is known not to sample).
pub(crate) fn spawn_threads(shared: &Arc<Shared>) -> Result<(), ProfilerError> {
    let (tx, rx) = std::sync::mpsc::channel();
    let sh = shared.clone();
    let export = crate::ownthread::spawn("ferroprof-export", 2 << 20, move || {
        crate::threads::enter_profiler_thread();
        sh.own_tids[1].store(crate::threads::current_tid(), Ordering::SeqCst);
        let _ = tx.send(());
        export_loop(&sh);
    })
    .map_err(|source| ProfilerError::Spawn {
        what: "export",
        source,
    })?;
    shared.threads.lock().export = Some(export);
    let _ = rx.recv();
    if shared.settings.profiles.needs_sampler() {
        let (tx, rx) = std::sync::mpsc::channel();
        let sh = shared.clone();
        let sampler = crate::ownthread::spawn("ferroprof-sampler", 512 << 10, move || {
            crate::threads::enter_profiler_thread();
            sh.own_tids[0].store(crate::threads::current_tid(), Ordering::SeqCst);
            // The threads are listed and armed before `start` returns: a process that lives
            // less than a period still has its CPU caught where it is spent.
            let mut sampler = Sampler::new(sh);
            sampler.list_at_start();
            let _ = tx.send(());
            sampler.run();
        })
        .map_err(|source| ProfilerError::Spawn {
            what: "sampler",
            source,
        })?;
        shared.threads.lock().sampler = Some(sampler);
        let _ = rx.recv();
    }
    Ok(())
}

pub(super) fn join_threads(shared: &Shared) {
    let (sampler, export) = {
        let mut t = shared.threads.lock();
        (t.sampler.take(), t.export.take())
    };
    if let Some(h) = sampler {
        let _ = h.join();
    }
    if let Some(h) = export {
        let _ = h.join();
    }
}

pub(super) fn export_loop(sh: &Arc<Shared>) {
    let period = sh.settings.period;
    let mut next = std::time::Instant::now() + period;
    loop {
        let now = std::time::Instant::now();
        let wait = next.saturating_duration_since(now);
        let stopping = sh.wait(wait);
        if stopping {
            break;
        }
        let requested = sh.flush_requested.load(Ordering::SeqCst);
        let flush = requested > sh.flush_done.load(Ordering::SeqCst);
        if flush || std::time::Instant::now() >= next {
            let round = export_once(sh);
            if flush {
                // The round to wait for (0: nothing was handed over), before the flush is done.
                sh.exporters
                    .lock()
                    .deliveries()
                    .flush_round
                    .store(round.unwrap_or(0), Ordering::SeqCst);
                sh.flush_done.store(requested, Ordering::SeqCst);
            }
            if std::time::Instant::now() >= next {
                next += period;
            }
        }
    }
    // The last profile once the sampler recorded what it still held (bounded: a sampler that
    // does not finish in time loses its last samples, never the export).
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while !sh.sampler_stopped.load(Ordering::SeqCst) && std::time::Instant::now() < deadline {
        std::thread::park_timeout(Duration::from_millis(5));
    }
    // Then give the exporters until the deadline to deliver what they hold.
    let _ = export_once(sh);
    sh.flush_done
        .store(sh.flush_requested.load(Ordering::SeqCst), Ordering::SeqCst);
    let mut outbox = sh.exporters.lock();
    let stuck = outbox.shutdown(sh.settings.stop_timeout);
    if !stuck.is_empty() {
        let mut names = outbox.deliveries().abandoned_names.lock();
        names.extend(stuck);
    }
}

/// Serializes the main recorder and hands the profile to every exporter, never waiting for one
/// (see `handoff`). Returns the export round of the profile, `None` when serializing
/// failed (counted and logged).
pub(super) fn export_once(sh: &Shared) -> Option<u64> {
    let exported = {
        let _s = sh.serialize_lock.lock();
        let mut sym = sh.symbolizer.lock();
        // Through the fork gate, step by step: a fork never catches a step that touches state
        // shared with application threads half-way, and waits for one such step at most, never
        // for symbolizing and encoding (see `crate::forkgate::SerializeSteps`).
        let steps = crate::forkgate::SerializeSteps::new();
        let (t0, c0) = (std::time::Instant::now(), crate::threads::own_cpu_ns());
        let mut own = book_own_cpu;
        let late: Option<&mut dyn FnMut(&mut LateSamples<'_>)> =
            (sh.settings.book_own_cpu && sh.settings.profiles.cpu).then_some(&mut own);
        let serialized = tls::in_recorder(|| {
            sym.pass(|sym| sh.recorder.serialize_with_late(Some(sym), &steps, late))
        });
        let st = &sh.stats;
        st.last_export_ns
            .store(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        st.last_export_cpu_ns.store(
            crate::threads::own_cpu_ns().saturating_sub(c0),
            Ordering::Relaxed,
        );
        st.symbolized_addresses
            .store(sym.resolved_from_debug_info(), Ordering::Relaxed);
        st.symbolizer_cached
            .store(sym.cached_addresses() as u64, Ordering::Relaxed);
        st.symbolizer_arena_bytes
            .store(crate::alloc::arena::last_pass_bytes(), Ordering::Relaxed);
        st.symbolizer_bytes
            .store(sym.kept_bytes() as u64, Ordering::Relaxed);
        if let Ok(p) = &serialized {
            st.last_profile_bytes
                .store(p.stats.profile_bytes, Ordering::Relaxed);
        }
        match serialized {
            Ok(p) => ExportedProfile {
                encoded: p.encoded,
                stats: p.stats,
                service: sh.settings.service.clone(),
                tags: sh.settings.tags.clone(),
                sample_types: sh
                    .recorder
                    .layout()
                    .types()
                    .iter()
                    .map(|t| t.name().to_owned())
                    .collect(),
                process_start: sh.process_start,
            },
            Err(e) => {
                sh.stats.serialize_errors.fetch_add(1, Ordering::Relaxed);
                // Counted and logged; the export loop carries on with the next period.
                log::warn!("ferroprof: serializing the profile failed: {e}");
                return None;
            }
        }
    };
    let (round, direct) = sh.exporters.lock().send(exported);
    for (name, result) in direct {
        if let Err(err) = result {
            sh.stats.export_errors.fetch_add(1, Ordering::Relaxed);
            log::warn!("ferroprof: {name} exporter: {err}");
        } else {
            sh.stats.exports.fetch_add(1, Ordering::Relaxed);
        }
    }
    sampler::trim_after_export();
    Some(round)
}

/// The frame (and thread name) of the profiler's own CPU time.
pub(crate) const OWN_CPU_FRAME: &str = "[ferroprof]";

/// Adds the profiler's own threads' CPU time since the last profile, this one's symbolizing
/// included, as one sample (see `ProfilerBuilder::book_own_cpu`).
fn book_own_cpu(late: &mut LateSamples<'_>) {
    let ns = crate::threads::take_unbooked_own_cpu();
    if ns == 0 {
        return;
    }
    let values = SampleValues {
        cpu_time_ns: i64::try_from(ns).unwrap_or(i64::MAX),
        ..Default::default()
    };
    let frames = [Frame::sym(OWN_CPU_FRAME, "", 0)];
    let labels = [Label::str(crate::threads::THREAD_NAME_LABEL, OWN_CPU_FRAME)];
    // A profile that cannot take it (over its memory cap) counts the sample as dropped.
    let _ = late.add(&frames, &values, &labels);
}
