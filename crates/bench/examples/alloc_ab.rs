//! The allocation workload's overhead measured A/B inside one process: each thread alternates
//! short chunks of the workload on plain `System` and on `SamplingAllocator(System)` (profiler
//! running at 512 KiB, heap tracking on), each with its own live set, and times every chunk with
//! its thread CPU clock. Adjacent chunks see the same machine load, so the median of the
//! per-pair ratios stays meaningful on a host whose speed drifts from one second to the next
//! (where separate processes per variant could not resolve a few percent).
//!
//! `alloc_ab [pairs per thread] [ops per chunk]`; prints a `RESULT` line.
use ferroprof::SamplingAllocator;
use std::alloc::{GlobalAlloc, Layout, System};

#[global_allocator]
static GLOBAL: SamplingAllocator<System> = SamplingAllocator::new(System);

fn thread_cpu_ns() -> u64 {
    ferroprof_bench::clock_ns(libc::CLOCK_THREAD_CPUTIME_ID)
}

/// A live set of blocks from one allocator, replaced at random like `alloc_thread`'s.
struct LiveSet<'a, A: GlobalAlloc> {
    alloc: &'a A,
    blocks: Vec<(*mut u8, Layout)>,
    rng: u64,
}

impl<'a, A: GlobalAlloc> LiveSet<'a, A> {
    fn new(alloc: &'a A, seed: u64) -> Self {
        LiveSet {
            alloc,
            blocks: vec![
                (std::ptr::null_mut(), Layout::new::<u8>());
                ferroprof_bench::LIVE_PER_THREAD
            ],
            rng: seed | 1,
        }
    }

    /// `ops` replacements (free + zeroed allocation of 16..=1040 bytes); returns CPU ns.
    #[inline(never)]
    fn run(&mut self, ops: u64) -> u64 {
        let t0 = thread_cpu_ns();
        for _ in 0..ops {
            let x = ferroprof_bench::next(&mut self.rng);
            let slot = (x as usize) % self.blocks.len();
            let size = 16 + ((x >> 32) % 1025) as usize;
            let layout = Layout::from_size_align(size, 1).expect("valid layout");
            // SAFETY: non-zero size; the block is written within its size and freed below with
            // the allocator and layout it came from.
            unsafe {
                let p = self.alloc.alloc_zeroed(layout);
                assert!(!p.is_null(), "allocation failed");
                *p = x as u8;
                let (old, old_layout) = std::mem::replace(&mut self.blocks[slot], (p, layout));
                if !old.is_null() {
                    std::hint::black_box(*old);
                    self.alloc.dealloc(old, old_layout);
                }
            }
        }
        thread_cpu_ns() - t0
    }
}

impl<A: GlobalAlloc> Drop for LiveSet<'_, A> {
    fn drop(&mut self) {
        for &(p, layout) in &self.blocks {
            if !p.is_null() {
                // SAFETY: allocated by `self.alloc` with this layout, freed once.
                unsafe { self.alloc.dealloc(p, layout) };
            }
        }
    }
}

/// Per-pair ratios (sampling / system) of one thread.
fn thread_pairs(pairs: usize, chunk: u64, seed: u64) -> Vec<f64> {
    let mut plain = LiveSet::new(&System, seed);
    let mut sampled = LiveSet::new(&GLOBAL, seed ^ 0x5555);
    // Warm both live sets up.
    plain.run(chunk * 4);
    sampled.run(chunk * 4);
    (0..pairs)
        .map(|i| {
            // Alternate which goes first, so a drift within a pair favours neither.
            let (s, f) = if i % 2 == 0 {
                let s = plain.run(chunk);
                (s, sampled.run(chunk))
            } else {
                let f = sampled.run(chunk);
                (plain.run(chunk), f)
            };
            f as f64 / s as f64
        })
        .collect()
}

fn main() {
    let pairs = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(400usize);
    let chunk = std::env::args()
        .nth(2)
        .and_then(|a| a.parse().ok())
        .unwrap_or(20_000u64);
    let dir = std::env::temp_dir().join(format!("ferroprof-bench-ab-{}", std::process::id()));
    let guard =
        ferroprof_bench::start_alloc_profiler(&dir, ferroprof::DEFAULT_SAMPLING_INTERVAL, true);
    let hs: Vec<_> = (0..ferroprof_bench::ALLOC_THREADS as u64)
        .map(|i| std::thread::spawn(move || thread_pairs(pairs, chunk, 0x9E37_79B9 + i)))
        .collect();
    let mut ratios: Vec<f64> = hs.into_iter().flat_map(|h| h.join().unwrap()).collect();
    let stats = guard.stats();
    guard.stop().expect("stop");
    let _ = std::fs::remove_dir_all(&dir);
    let n = ratios.len();
    let median = ferroprof_bench::median(&mut ratios);
    // Quartiles of the per-pair ratios, to show the spread.
    let q1 = ratios[n / 4];
    let q3 = ratios[3 * n / 4];
    println!(
        "RESULT overhead_pct={:.2} q1_pct={:.2} q3_pct={:.2} pairs={n} samples={}",
        (median - 1.0) * 100.0,
        (q1 - 1.0) * 100.0,
        (q3 - 1.0) * 100.0,
        stats.alloc_samples
    );
}
