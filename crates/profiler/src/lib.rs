//! ferroprof: profile a running Rust process (see the README).
pub mod export;
pub mod http;

pub use ferroprof_recorder as recorder;
