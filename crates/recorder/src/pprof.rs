//! Streaming pprof (profile.proto) encoding and compression.
//!
//! CONTRACT (implementation pending, see issue 2): the encoder writes protobuf straight into the
//! compressor, without building an intermediate copy of the whole profile. Functions, locations,
//! label sets and stacks are deduplicated. No mapping is emitted when there is none.

use std::time::SystemTime;

/// Output compression.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compression {
    None,
    /// Readable by `go tool pprof`, Pyroscope and Datadog.
    #[default]
    Gzip,
    /// Needs the `zstd` feature.
    Zstd,
}

/// Options of [`crate::profile::Profile::encode`].
#[derive(Debug, Clone, Default)]
pub struct EncodeOptions {
    pub compression: Compression,
}

/// One encoded profile.
#[derive(Debug, Clone)]
pub struct EncodedProfile {
    pub start: SystemTime,
    pub end: SystemTime,
    /// The compressed (per `compression`) profile.proto bytes.
    pub bytes: Vec<u8>,
    pub compression: Compression,
    /// Endpoint name -> count, as collected by `set_endpoint` / `add_endpoint_count`.
    pub endpoint_counts: Vec<(String, i64)>,
}

/// One frame produced by symbolizing an address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedFrame {
    pub name: String,
    pub filename: String,
    pub line: i64,
}

/// Turns addresses into frames at encoding time (off the hot path).
pub trait Symbolizer {
    /// Pushes the frames at `address`, innermost (most inlined) first and the physical function
    /// last. Pushes nothing when the address is unknown.
    fn symbolize(&mut self, address: u64, out: &mut Vec<ResolvedFrame>);
}
