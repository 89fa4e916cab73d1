//! Sample counts for `ferroprof record`'s progress line: when `FERROPROF_RECORD_PROGRESS`
//! names a directory, a thread of ferroprof's own writes `<cpu samples> <alloc samples>` to
//! `<dir>/<pid>` twice a second. `record` sets it only when its stderr is a terminal.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use ferroprof::ProfilerStats;

pub(crate) const ENV: &str = "FERROPROF_RECORD_PROGRESS";

/// Bumped by [`stop`]: a writer runs while the generation it started in is current (a failed
/// exec stops the profiler and starts it again).
static GENERATION: AtomicU32 = AtomicU32::new(0);

/// Starts the writer; `stats` reads the running profiler's counters (None once stopped).
pub(crate) fn start(dir: PathBuf, stats: impl Fn() -> Option<ProfilerStats> + Send + 'static) {
    let path = dir.join(std::process::id().to_string());
    let generation = GENERATION.load(Ordering::SeqCst);
    let spawned = ferroprof::internals::__spawn_own_thread("ferroprof-progress", move || {
        while GENERATION.load(Ordering::SeqCst) == generation {
            std::thread::sleep(Duration::from_millis(500));
            let Some(s) = stats() else { break };
            // A torn read on the other side is skipped there; no need for a rename.
            let _ = std::fs::write(&path, format!("{} {}\n", s.cpu_samples, s.alloc_samples));
        }
    });
    if let Err(e) = spawned {
        eprintln!("ferroprof: no progress counts ({e}); profiling goes on");
    }
}

/// Stops the writer (at exit or exec, before the last profile).
pub(crate) fn stop() {
    GENERATION.fetch_add(1, Ordering::SeqCst);
}
