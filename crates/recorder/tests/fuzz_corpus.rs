//! Replays the committed fuzz corpora of `recorder_ops` and `pprof_roundtrip` (fuzz/corpus/) and a
//! batch of deterministic pseudo-random inputs through the very harness functions the fuzz
//! targets call, so every `cargo test` exercises them even where cargo-fuzz is not installed.

#[allow(dead_code)]
#[path = "../../../fuzz/src/input.rs"]
mod input;
#[path = "../../../fuzz/src/pprof_roundtrip.rs"]
mod pprof_roundtrip;
#[allow(dead_code)]
#[path = "../../../fuzz/src/recorder_ops.rs"]
mod recorder_ops;

use std::path::PathBuf;

fn corpus(target: &str) -> Vec<(PathBuf, Vec<u8>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target);
    let mut files: Vec<(PathBuf, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
        .map(|e| {
            let path = e.expect("corpus entry").path();
            let bytes = std::fs::read(&path).expect("corpus file");
            (path, bytes)
        })
        .collect();
    files.sort();
    assert!(!files.is_empty(), "empty corpus {}", dir.display());
    files
}

/// Inputs of 0..512 bytes from a fixed xorshift stream.
fn pseudo_random(count: usize) -> Vec<Vec<u8>> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    (0..count)
        .map(|_| {
            let len = (next() % 512) as usize;
            (0..len).map(|_| next() as u8).collect()
        })
        .collect()
}

#[test]
fn recorder_ops_corpus() {
    let mut serialized = 0;
    for (path, bytes) in corpus("recorder_ops") {
        eprintln!("{}", path.display());
        serialized += recorder_ops::run(&bytes);
    }
    assert!(
        serialized > 0,
        "the corpus never reached a successful serialization"
    );
}

#[test]
fn recorder_ops_pseudo_random() {
    for bytes in pseudo_random(200) {
        recorder_ops::run(&bytes);
    }
}

#[test]
fn pprof_roundtrip_corpus() {
    let mut compared = 0;
    for (path, bytes) in corpus("pprof_roundtrip") {
        eprintln!("{}", path.display());
        compared += pprof_roundtrip::run(&bytes);
    }
    assert!(compared > 0, "the corpus never compared a decoded sample");
}

#[test]
fn pprof_roundtrip_pseudo_random() {
    for bytes in pseudo_random(300) {
        pprof_roundtrip::run(&bytes);
    }
}
