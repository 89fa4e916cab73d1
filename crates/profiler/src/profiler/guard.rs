//! The guard of a running profiler and what it reports.

use super::*;

/// What the running profiler did so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProfilerStats {
    /// CPU samples recorded: sampling periods of CPU time covered by the recorded captures.
    pub cpu_samples: u64,
    /// Thread visits by the sampler (for wall time and to collect captures).
    pub cpu_ticks: u64,
    /// Sampler wake-ups.
    pub sampler_ticks: u64,
    /// Ticks whose time passed while the sampler waited for a CPU (covered by the next one).
    pub sampler_late_ticks: u64,
    /// Stacks captured by the threads' CPU-time timers (where they spent CPU).
    pub cpu_timer_samples: u64,
    /// Timer captures lost because every capture slot was waiting for a late sampler (their
    /// CPU time goes to the thread's other captures). Counted for the whole process.
    pub cpu_captures_lost: u64,
    /// Stacks of blocked threads read without a signal (from their stack pointer and program
    /// counter in `/proc/self/task/<tid>/syscall`), for wall time.
    pub wall_remote_stacks: u64,
    /// Such reads (or reads of a woken thread's recent calls) taken again because the thread
    /// ran while its stack was copied; after three, its previous stack is kept.
    pub wall_remote_retries: u64,
    /// Bytes of the profiler's own large blocks (128 KiB and up: grown tables, encoded
    /// profiles) mapped now. They are mapped and unmapped directly, never through the
    /// application's allocator (glibc would raise its mmap threshold for the whole process).
    pub large_block_bytes: u64,
    /// Stacks of runnable threads waiting for a CPU, found from the calls they made since
    /// their stack was last read (the return addresses those calls left on the stack).
    pub wall_recent_calls: u64,
    /// Threads the kernel gave no CPU-time timer (out of `RLIMIT_SIGPENDING`): they get wall
    /// samples only. Logged once.
    pub threads_without_timer: u64,
    /// Times another handler was found installed for the sampling signal (CPU sampling then
    /// stops; logged).
    pub signal_handler_replaced: u64,
    /// The signal the CPU-time timers raise (picked at start unless set).
    pub signal: i32,
    /// Samples (signal or allocation) skipped because the thread's stack had less room left
    /// than the sampling path needs on it. Counted for the whole process.
    pub skipped_low_stack: u64,
    /// Signal samples skipped because the thread's stack bounds were not known yet (a thread
    /// newer than the unwinder's last look at the mappings) and the kernel would not tell
    /// whether the room below its stack pointer is readable. Counted for the whole process.
    pub skipped_unknown_stack: u64,
    /// Average time a signal handler spent capturing its stack, in nanoseconds.
    pub handler_avg_ns: u64,
    /// Median time a signal handler spent capturing its stack (100 ns resolution): the mean
    /// also carries the first captures, which fill the unwinder's caches.
    pub handler_median_ns: u64,
    /// Average frames per captured stack.
    pub handler_avg_frames: u64,
    /// Unwinding snapshots (module list + stack mappings) built in this process so far.
    pub snapshot_builds: u64,
    /// CPU time the sampler thread used so far (listing threads, reading their clocks and
    /// stacks, recording), in nanoseconds; 0 when it does not run.
    pub sampler_cpu_ns: u64,
    /// Allocation samples taken.
    pub alloc_samples: u64,
    /// Samples the recorder refused (counted, never fatal).
    pub record_errors: u64,
    /// Profiles delivered (to exporters with a delivery thread) or queued (network exporters,
    /// which count their own uploads in their `ExportStats`).
    pub exports: u64,
    /// Exports an exporter failed (each is logged).
    pub export_errors: u64,
    /// Serializations that failed (each is logged).
    pub serialize_errors: u64,
    /// Profiles dropped because an exporter still held [`crate::export::HANDOFF_CAPACITY`]
    /// others (it is slower than the export period, or stuck).
    pub export_dropped: u64,
    /// Profiles left undelivered when `stop()`'s deadline passed.
    pub export_abandoned: u64,
    /// Samples folded into the `[stacks dropped: over memory cap]` frame because the profile
    /// being recorded was at its memory cap (see [`ProfilerBuilder::max_profile_bytes`]).
    pub dropped_stacks: u64,
    /// The last periodic export's serialization (symbolizing and encoding), wall and CPU time
    /// of the export thread.
    pub last_export_ns: u64,
    /// CPU time the export thread spent on the last periodic export's serialization.
    pub last_export_cpu_ns: u64,
    /// Addresses symbolized from debug info so far (the others came from the symbolizer's
    /// cache of resolved addresses), and the cache's size.
    pub symbolized_addresses: u64,
    /// Addresses in the symbolizer's cache of resolved addresses.
    pub symbolizer_cached_addresses: u64,
    /// Memory the profiler keeps between exports, in bytes (estimates from capacities): the
    /// symbolizer's cache of resolved addresses and its unit indexes; the tables of the last
    /// exported profile when it was serialized (the profile being recorded grows to about as
    /// much, and there are two: the one recorded and the one exported); the live-heap records
    /// the heap profile tracks (`heap_tracked_objects`, each a few dozen bytes plus its stack);
    /// the allocations since the start per stack that the heap profile carries (capped like a
    /// profile, see [`ProfilerBuilder::max_profile_bytes`]).
    pub symbolizer_bytes: u64,
    /// Bytes the tables of the last exported profile held when it was serialized.
    pub last_profile_bytes: u64,
    /// Live objects the heap profile tracks.
    pub heap_tracked_objects: u64,
    /// Estimated live heap bytes now: the heap profile's `heap-live-size` total, kept as a
    /// running sum of its tracked samples (0 without heap profiling).
    pub heap_live_estimate_bytes: u64,
    /// The largest `heap_live_estimate_bytes` since the start: an estimate of the peak of the
    /// live heap, from the sampled allocations only (its error is that of the heap profile at
    /// its peak, a standard deviation of at most `sqrt(peak x alloc interval)`; see
    /// `ferroprof::SamplingAllocator`).
    pub heap_peak_estimate_bytes: u64,
    /// Bytes the heap profile's allocation totals since the start take.
    pub alloc_totals_bytes: u64,
    /// Bytes of the profiler's private blocks in use: what recording allocation samples on
    /// application threads allocated (table growth of the recorder, the live-heap records and
    /// the totals), kept out of the application's allocator; 0 when the sampling allocator is
    /// not the global allocator.
    pub private_heap_bytes: u64,
    /// Perf events open now (one per thread the perf engine armed; each a file descriptor,
    /// at most a quarter of the soft `RLIMIT_NOFILE`: past that, threads get timers).
    pub perf_events: u64,
    /// The CPU engine in use: `"perf"` (perf task-clock events), `"timer"` (POSIX CPU
    /// timers), or `""` when no CPU or wall profile runs.
    pub cpu_engine: &'static str,
    /// Encoded profiles waiting in the exporters' queues, in bytes (a profile waiting for two
    /// exporters counts twice); more than a few profiles' worth means an exporter falls behind.
    pub export_queue_bytes: u64,
    /// Address space the last symbolization's private memory spanned while it ran (its debug
    /// info; only pages written were resident), handed back to the system at its end; 0 when
    /// the sampling allocator is not the global allocator or allocation profiling is off (the
    /// debug info is then parsed on the heap).
    pub symbolizer_arena_bytes: u64,
    /// What the bounds of request labels cost so far (process-wide; see [`crate::labels`]).
    pub labels: crate::labels::LabelStats,
    /// Request contexts (traces with live objects) the heap profile holds, each shared by its
    /// objects: never more than `heap_tracked_objects`.
    pub heap_contexts: u64,
}

/// The running profiler. Dropping it (or [`Self::stop`]) stops profiling and exports a last
/// profile.
pub struct ProfilerGuard {
    pub(super) shared: Arc<Shared>,
    pub(super) deliveries: Arc<Deliveries>,
    pub(super) stopped: bool,
}

impl ProfilerGuard {
    /// Stops profiling, exports the last profile and shuts the exporters down, waiting at most
    /// the stop timeout (see [`ProfilerBuilder::stop_timeout`]) for them. An exporter still busy
    /// then is left behind on its own thread: the error names it.
    pub fn stop(mut self) -> Result<(), ProfilerError> {
        self.stop_inner()
    }

    /// [`Self::stop`] for a process that exits or execs right after: the last export does not
    /// hand the memory it used back to the kernel (the pages of the debug files it read, its
    /// arena), which the exit does anyway (about 2 ms of `ferroprof record`'s exit on
    /// ripgrep).
    pub fn stop_at_exit(mut self) -> Result<(), ProfilerError> {
        crate::threads::PROCESS_ENDING.store(true, Ordering::SeqCst);
        self.stop_inner()
    }

    fn stop_inner(&mut self) -> Result<(), ProfilerError> {
        if self.stopped || state::abandoned() {
            // An abandoned profiler (a child forked from inside it) has nothing to stop that
            // this process could wait for.
            return Ok(());
        }
        self.stopped = true;
        // The sampler books this thread's CPU up to here, and leaves its wall time in here
        // alone (the profiler's).
        let stopped = tls::with_guard(|| {
            crate::threads::while_stopping(|| {
                let sh = &self.shared;
                let term = sh.threads.lock().termination.take();
                if let Some(t) = term {
                    crate::termination::disarm(t);
                }
                sh.stopping.store(true, Ordering::SeqCst);
                // A forked child's pending restart is dropped (or one under way finishes first).
                crate::forkgate::settle_restart();
                sh.wake_all();
                // Sampler first (it records its pending samples), then no new allocation samples,
                // then the export thread writes the last profile.
                let sampler = sh.threads.lock().sampler.take();
                if let Some(h) = sampler {
                    let _ = h.join();
                }
                sh.sampler_stopped.store(true, Ordering::SeqCst);
                sh.wake_all();
                alloc::set_interval(0);
                let export = sh.threads.lock().export.take();
                if let Some(h) = export {
                    let _ = h.join();
                }
                state::deactivate(sh);
                let ending = crate::threads::PROCESS_ENDING.load(Ordering::SeqCst);
                if sh.settings.profiles.heap && !ending {
                    // No recorder holds tracked addresses any more. Not at the process's exit:
                    // reading the whole table faults in its untouched pages (about 1 ms, as
                    // long as a short process's symbolizing) for a table nobody reads again.
                    FILTER.clear_tracked();
                    crate::alloc::tracked::TRACKED.clear();
                }
                let stuck = std::mem::take(&mut *self.deliveries.abandoned_names.lock());
                if stuck.is_empty() {
                    Ok(())
                } else {
                    Err(ProfilerError::Export(ExportError::Timeout {
                        backend: stuck.join(", "),
                        after: sh.settings.stop_timeout,
                    }))
                }
            })
        });
        // A termination signal that came meanwhile waited for the last profile.
        crate::termination::release_deferred();
        stopped
    }

    /// Serializes and exports a profile now (on the export thread), waiting for the
    /// serialization and, up to the stop timeout, for the exporters' delivery.
    pub fn flush(&self) -> Result<(), ProfilerError> {
        crate::forkgate::resume_if_pending();
        if self.stopped {
            return Err(ProfilerError::Stopped);
        }
        flush_with(&self.shared, &self.deliveries)
    }

    /// On-demand profiles for `/debug/pprof` (see [`ProfileSource`]).
    pub fn profile_source(&self) -> Arc<dyn ProfileSource> {
        crate::forkgate::resume_if_pending();
        // The profiler's own allocation, though made on the caller's thread: never sampled.
        tls::with_guard(|| {
            Arc::new(Source {
                shared: Arc::downgrade(&self.shared),
            }) as Arc<dyn ProfileSource>
        })
    }

    /// Counters of the running profiler.
    pub fn stats(&self) -> ProfilerStats {
        crate::forkgate::resume_if_pending();
        let s = &self.shared.stats;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let done = l(&s.handler_count).max(1);
        // The heap recorder's shard locks, briefly: inside the fork gate, as every lock a fork
        // must not catch.
        let heap =
            tls::with_guard(|| crate::forkgate::outside_fork(|| self.shared.recorder.stats().heap));
        ProfilerStats {
            cpu_samples: l(&s.cpu_samples),
            cpu_ticks: l(&s.cpu_ticks),
            sampler_ticks: l(&s.sampler_ticks),
            sampler_late_ticks: l(&s.sampler_late_ticks),
            cpu_timer_samples: l(&s.cpu_timer_samples),
            cpu_captures_lost: sampler::lost_captures(),
            wall_remote_stacks: l(&s.wall_remote_stacks),
            wall_remote_retries: l(&s.wall_remote_retries),
            wall_recent_calls: l(&s.wall_recent_calls),
            large_block_bytes: crate::alloc::bigblock::mapped_bytes() as u64,
            threads_without_timer: l(&s.threads_without_timer),
            signal_handler_replaced: l(&s.signal_handler_replaced),
            signal: self.shared.settings.signal,
            skipped_low_stack: unwind::skipped_low_stack(),
            skipped_unknown_stack: unwind::skipped_unknown_stack(),
            handler_avg_ns: l(&s.handler_ns_total) / done,
            handler_median_ns: s.handler_median_ns(),
            handler_avg_frames: l(&s.handler_frames_total) / done,
            snapshot_builds: unwind::snapshot_builds() as u64,
            sampler_cpu_ns: match self.shared.own_tids[0].load(Ordering::Relaxed) {
                0 => 0,
                tid => crate::threads::thread_cpu_ns(tid).unwrap_or(0),
            },
            alloc_samples: s.alloc_samples.total() as u64,
            record_errors: l(&s.record_errors),
            exports: l(&s.exports) + l(&self.deliveries.delivered),
            export_errors: l(&s.export_errors) + l(&self.deliveries.failed),
            serialize_errors: l(&s.serialize_errors),
            export_dropped: l(&self.deliveries.dropped),
            export_abandoned: l(&self.deliveries.abandoned),
            dropped_stacks: self.shared.recorder.dropped_stacks(),
            last_export_ns: l(&s.last_export_ns),
            last_export_cpu_ns: l(&s.last_export_cpu_ns),
            symbolized_addresses: l(&s.symbolized_addresses),
            symbolizer_cached_addresses: l(&s.symbolizer_cached),
            symbolizer_arena_bytes: l(&s.symbolizer_arena_bytes),
            symbolizer_bytes: l(&s.symbolizer_bytes),
            last_profile_bytes: l(&s.last_profile_bytes),
            export_queue_bytes: ferroprof_export::queued_bytes(),
            perf_events: crate::sampler::perf_events(),
            cpu_engine: match (
                self.shared.settings.profiles.needs_sampler(),
                self.shared.settings.cpu_engine_perf,
            ) {
                (false, _) => "",
                (true, true) => "perf",
                (true, false) => "timer",
            },
            // The heap recorder's shard locks, briefly: inside the fork gate, as every lock a
            // fork must not catch.
            heap_tracked_objects: heap.as_ref().map_or(0, |h| h.num_object_records),
            heap_contexts: heap.as_ref().map_or(0, |h| h.num_contexts),
            heap_live_estimate_bytes: alloc::peak::HEAP_ESTIMATE.live(),
            heap_peak_estimate_bytes: alloc::peak::HEAP_ESTIMATE.peak(),
            labels: crate::labels::stats(),
            private_heap_bytes: crate::alloc::keep::bytes_in_use(),
            alloc_totals_bytes: tls::with_guard(|| {
                crate::forkgate::outside_fork(|| self.shared.alloc_totals.bytes() as u64)
            }),
        }
    }

    /// Whether allocations go through a [`crate::SamplingAllocator`] (allocation and heap
    /// profiles are empty otherwise).
    pub fn allocator_installed(&self) -> bool {
        alloc::seen()
    }

    /// The shared recorder (for advanced use and tests).
    pub fn recorder(&self) -> &Arc<StackRecorder> {
        crate::forkgate::resume_if_pending();
        &self.shared.recorder
    }
}

impl Drop for ProfilerGuard {
    fn drop(&mut self) {
        let _ = self.stop_inner();
    }
}

/// Asks the export thread for a profile now and waits for its delivery (bounded by the stop
/// timeout): [`ProfilerGuard::flush`], and the flush on termination.
pub(super) fn flush_with(shared: &Shared, deliveries: &Deliveries) -> Result<(), ProfilerError> {
    if shared.stopping.load(Ordering::SeqCst) {
        return Err(ProfilerError::Stopped);
    }
    let errors_before = shared.stats.export_errors.load(Ordering::SeqCst)
        + shared.stats.serialize_errors.load(Ordering::SeqCst);
    let ticket = shared.flush_requested.fetch_add(1, Ordering::SeqCst) + 1;
    shared.wake_all();
    while shared.flush_done.load(Ordering::SeqCst) < ticket {
        if shared.stopping.load(Ordering::SeqCst) {
            return Err(ProfilerError::Stopped);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let round = deliveries.flush_round.load(Ordering::SeqCst);
    let timeout = shared.settings.stop_timeout;
    match deliveries.wait_round(round, std::time::Instant::now() + timeout) {
        // Round 0: serializing failed, nothing was handed over (counted below).
        _ if round == 0 => {}
        Ok(true) => {}
        Ok(false) => {
            return Err(ProfilerError::Export(ExportError::Config(
                "the flushed profile was dropped or refused by an exporter; see ProfilerStats"
                    .into(),
            )))
        }
        Err(()) => {
            return Err(ProfilerError::Export(ExportError::Timeout {
                backend: "flush".into(),
                after: timeout,
            }))
        }
    }
    let errors_after = shared.stats.export_errors.load(Ordering::SeqCst)
        + shared.stats.serialize_errors.load(Ordering::SeqCst);
    if errors_after > errors_before {
        return Err(ProfilerError::Export(
            ferroprof_export::ExportError::Config(
                "the flushed profile could not be serialized or exported; see ProfilerStats".into(),
            ),
        ));
    }
    Ok(())
}
