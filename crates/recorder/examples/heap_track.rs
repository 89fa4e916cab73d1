//! Deterministic driver for instruction counts of the heap bench's hot path (track + untrack of
//! an object whose 32-frame stack is already known):
//! `valgrind --tool=callgrind target/release/examples/heap_track [address|symbol|alternate|alternate-lines] [iterations]`
//! (divide the counts by the iterations), or without valgrind for a quick ns/op.

use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use ferroprof_recorder::{Frame, HeapConfig, HeapRecorder, StringStorage};

const DEPTH: usize = 32;

fn main() {
    let mut args = std::env::args().skip(1);
    let mode = args.next().unwrap_or_else(|| "symbol".into());
    let iters: u64 = args.next().map_or(100_000, |s| s.parse().unwrap());
    let names: Vec<(String, String)> = (0..DEPTH)
        .map(|i| {
            (
                format!("my_crate::module_{i}::Type::function_{i}"),
                format!("/src/my_crate/src/module_{i}.rs"),
            )
        })
        .collect();
    let frames: Vec<Frame<'_>> = match mode.as_str() {
        "address" => (0..DEPTH as u64)
            .map(|i| Frame::Address(0x5555_0000_1000 + i * 0x40))
            .collect(),
        "symbol" | "alternate" | "alternate-lines" => names
            .iter()
            .enumerate()
            .map(|(i, (n, f))| Frame::sym(n, f, 10 + i as i64))
            .collect(),
        other => panic!("unknown mode {other}"),
    };
    let rec = HeapRecorder::new(HeapConfig::native(), Arc::new(StringStorage::new())).unwrap();
    // As in the bench: live objects around, the stack already known.
    for id in 0..10_000u64 {
        rec.track(0x7000_0000_0000 + id * 64, 1, 64, None, &frames)
            .unwrap();
    }
    // "alternate": one buffer switching between two stacks that differ in the last frame's
    // text only (same shape: they share a hint); "alternate-lines": ... and in its line.
    let mut frames = frames;
    let last = DEPTH - 1;
    let alt_line = if mode == "alternate" {
        10 + last as i64
    } else {
        99
    };
    let alt = Frame::sym("my_crate::main_alt", "/src/my_crate/src/alt.rs", alt_line);
    let stacks = [frames[last], alt];
    let alternate = mode.starts_with("alternate");
    if alternate {
        // Both stacks already seen (kept alive by an object each).
        for (i, f) in stacks.iter().enumerate() {
            frames[last] = *f;
            rec.track(1 + i as u64, 1, 64, None, &frames).unwrap();
        }
    }
    let mut id = 0x1000_0000_0000u64;
    let t = Instant::now();
    for i in 0..iters {
        id += 64;
        if alternate {
            frames[last] = stacks[(i & 1) as usize];
        }
        rec.track(black_box(id), 1, 64, None, black_box(&frames))
            .unwrap();
        black_box(rec.untrack(black_box(id)));
    }
    println!(
        "{mode}: {:.1} ns per track+untrack",
        t.elapsed().as_secs_f64() * 1e9 / iters as f64
    );
}
