//! ferroprof: profile a running Rust process (see the README).
pub mod export;

pub use ferroprof_recorder as recorder;
