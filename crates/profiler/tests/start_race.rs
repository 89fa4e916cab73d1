//! Two threads calling `start()` at the same moment: one profiler starts, the other caller gets
//! `AlreadyRunning`, never an error about the output directory (both used to probe it with the
//! same file name, so one could remove the other's probe).
//!
//! One test in its own binary: the profiler is process-wide.

use std::sync::{Arc, Barrier};

use ferroprof::{Profiler, ProfilerError, Profiles};

mod profiler_support;

#[test]
fn simultaneous_starts_give_one_profiler_and_one_already_running() {
    let rounds: usize = std::env::var("FERROPROF_START_RACE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let dir = profiler_support::temp_dir("start-race");
    let barrier = Arc::new(Barrier::new(2));
    for round in 0..rounds {
        let starters: Vec<_> = (0..2)
            .map(|_| {
                let (barrier, dir) = (barrier.clone(), dir.clone());
                std::thread::spawn(move || {
                    let builder = Profiler::builder()
                        .service("start-race")
                        // No sampler thread and no signals: only the start path is raced.
                        .profiles(Profiles {
                            cpu: false,
                            wall: false,
                            alloc: true,
                            heap: false,
                        })
                        .period(std::time::Duration::from_secs(3600))
                        .output_dir(&dir);
                    barrier.wait();
                    builder.start()
                })
            })
            .collect();
        let results: Vec<_> = starters.into_iter().map(|t| t.join().unwrap()).collect();
        let mut started = 0;
        for r in &results {
            match r {
                Ok(_) => started += 1,
                Err(ProfilerError::AlreadyRunning) => {}
                Err(e) => panic!("round {round}: start failed with {e} instead of AlreadyRunning"),
            }
        }
        assert_eq!(started, 1, "round {round}: {started} profilers started");
        for g in results.into_iter().flatten() {
            g.stop().unwrap();
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
