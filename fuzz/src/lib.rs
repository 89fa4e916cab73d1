//! Harnesses of the fuzz targets in `fuzz_targets/`, kept in a library so a plain test can
//! replay the committed corpus through exactly the same code (see `crates/recorder/tests/
//! fuzz_corpus.rs` and `crates/cli/tests/fuzz_corpus_top.rs`).

pub mod cli_top;
pub mod input;
pub mod pprof_roundtrip;
pub mod recorder_ops;
