//! Memory the profiler adds right after start (budget: 10 MB of RSS).

use std::time::Duration;

use ferroprof::{Profiler, Profiles, SamplingAllocator};

#[global_allocator]
static GLOBAL: SamplingAllocator<std::alloc::System> = SamplingAllocator::new(std::alloc::System);

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    // SAFETY: sysconf has no preconditions.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64
}

#[test]
fn starting_the_profiler_adds_less_than_10_mb_of_rss() {
    let before = rss_bytes();
    let dir = std::env::temp_dir().join(format!("ferroprof-rss-{}", std::process::id()));
    let guard = Profiler::builder()
        .profiles(Profiles::all())
        .output_dir(&dir)
        .start()
        .unwrap();
    // Let the sampler run a few ticks (first stack captures, maps snapshot).
    std::thread::sleep(Duration::from_millis(300));
    let after = rss_bytes();
    let added = after.saturating_sub(before);
    eprintln!(
        "RSS before {before} after {after}: +{:.2} MB",
        added as f64 / 1e6
    );
    guard.stop().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(added < 10_000_000, "profiler added {added} bytes of RSS");
}
