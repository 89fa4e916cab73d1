//! ferroprof: profile a running Rust process (see the README).
pub use ferroprof_recorder as recorder;
