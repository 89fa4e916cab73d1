//! Sample counts for `ferroprof record`'s progress line: when `FERROPROF_RECORD_PROGRESS`
//! names a directory, a thread of ferroprof's own writes `<cpu samples> <alloc samples>` to
//! `<dir>/<pid>` twice a second. `record` sets it only when its stderr is a terminal.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use ferroprof::ProfilerStats;

pub(crate) const ENV: &str = "FERROPROF_RECORD_PROGRESS";

static STOPPING: AtomicBool = AtomicBool::new(false);

/// Starts the writer; `stats` reads the running profiler's counters (None once stopped).
pub(crate) fn start(dir: PathBuf, stats: impl Fn() -> Option<ProfilerStats> + Send + 'static) {
    let path = dir.join(std::process::id().to_string());
    let spawned = ferroprof::__spawn_own_thread("ferroprof-progress", move || {
        while !STOPPING.load(Ordering::SeqCst) {
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

/// Stops the writer (at exit, before the last profile).
pub(crate) fn stop() {
    STOPPING.store(true, Ordering::SeqCst);
}
