//! Typed errors of the recording core. Every message names the offending value.

use thiserror::Error;

/// Errors of the [`crate::strings::StringStorage`].
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum StringError {
    #[error("string id {0} is not interned (never was, or was released by a generation advance)")]
    UnknownId(u32),
    #[error("string id {0} was uninterned more times than it was interned")]
    Underflow(u32),
    #[error("string of {len} bytes is longer than the limit of {limit} bytes")]
    TooLong { len: usize, limit: usize },
    #[error("string storage is full ({0} live strings)")]
    Full(usize),
}

/// Errors of a [`crate::profile::Profile`].
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ProfileError {
    #[error("sample has {got} values but the profile has {expected} sample types")]
    WrongValueCount { expected: usize, got: usize },
    #[error("label key {0:?} appears more than once in one sample")]
    DuplicateLabelKey(String),
    #[error("label \"local root span id\" must be numeric, got the string {0:?}")]
    StringLocalRootSpanId(String),
    #[error("sample has {got} frames, more than the limit of {limit}")]
    TooManyFrames { got: usize, limit: usize },
    #[error("label key must not be empty")]
    EmptyLabelKey,
    #[error("end timestamp {0} ns is negative")]
    NegativeTimestamp(i64),
    #[error(transparent)]
    String(#[from] StringError),
    #[error("encoding failed: {0}")]
    Encode(String),
    #[error("string id {0} used but this profile has no string storage to resolve it")]
    NoStringStorage(u32),
    #[error("label key {0:?} is reserved for timestamped samples; pass the timestamp instead")]
    ReservedLabelKey(String),
    #[error("compression {0:?} is not available in this build (enable the `zstd` feature)")]
    CompressionUnavailable(crate::pprof::Compression),
    #[error("default sample type {0:?} is not one of the profile's sample types")]
    DefaultTypeNotInProfile(&'static str),
    #[error("period {0} is negative")]
    NegativePeriod(i64),
}

/// Errors of the [`crate::heap::HeapRecorder`].
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum HeapError {
    #[error("heap sample_every must be a positive integer value but was {0}")]
    InvalidSampleEvery(i64),
    #[error("Detected consecutive heap allocation recording starts without end.")]
    StartWithoutEnd,
    #[error("Ended a heap recording that was not started")]
    EndWithoutStart,
    #[error("Object ids are supposed to be unique. We got 2 allocation recordings with the same id. previous={{{previous}}} new={{{new}}}")]
    DuplicateId { previous: String, new: String },
    #[error("New heap recorder iteration prepared without the previous one having been finished.")]
    PrepareTwice,
    #[error("Heap recorder iteration finished without having been prepared.")]
    FinishWithoutPrepare,
    #[error("stack has {got} frames, more than the limit of {limit}")]
    TooManyFrames { got: usize, limit: usize },
    #[error("heap record reached the maximum number of tracked objects ({0})")]
    TooManyObjects(u32),
    #[error("heap recorder holds the maximum number of distinct stacks ({limit})")]
    TooManyStacks { limit: usize },
    #[error("heap recorder iteration was not prepared (call prepare_iteration first)")]
    NotPrepared,
    #[error(transparent)]
    String(#[from] StringError),
}

/// Errors of the [`crate::stack_recorder::StackRecorder`].
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum RecorderError {
    #[error("failed to grab either profile slot in two rounds (active slot {active_slot}); sample dropped")]
    NoActiveSlot { active_slot: u8 },
    #[error("a serialization is already running; only one may run at a time")]
    ConcurrentSerialization,
    #[error("failed to record sample: {0}")]
    Profile(#[from] ProfileError),
    #[error("heap recorder: {0}")]
    Heap(#[from] HeapError),
    #[error("heap profiling is disabled in this recorder's configuration")]
    HeapDisabled,
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("heap iteration stopped after {visited} live objects, before visiting all of them")]
    HeapIterationIncomplete { visited: u64 },
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pprof::Compression;

    #[test]
    fn messages_name_the_bad_value() {
        let cases: Vec<(String, &str)> = vec![
            (StringError::UnknownId(42).to_string(), "42"),
            (StringError::Underflow(7).to_string(), "7"),
            (
                ProfileError::WrongValueCount {
                    expected: 8,
                    got: 3,
                }
                .to_string(),
                "3 values",
            ),
            (
                ProfileError::DuplicateLabelKey("thread id".into()).to_string(),
                "\"thread id\"",
            ),
            (
                ProfileError::StringLocalRootSpanId("123".into()).to_string(),
                "\"123\"",
            ),
            (
                ProfileError::TooManyFrames {
                    got: 5000,
                    limit: 3000,
                }
                .to_string(),
                "5000",
            ),
            (ProfileError::NegativeTimestamp(-9).to_string(), "-9"),
            (ProfileError::NoStringStorage(11).to_string(), "11"),
            (
                ProfileError::DefaultTypeNotInProfile("alloc-space").to_string(),
                "\"alloc-space\"",
            ),
            (ProfileError::NegativePeriod(-5).to_string(), "-5"),
            (
                ProfileError::CompressionUnavailable(Compression::Zstd).to_string(),
                "Zstd",
            ),
            (
                RecorderError::Profile(ProfileError::NegativeTimestamp(-1)).to_string(),
                "-1",
            ),
            (
                RecorderError::HeapIterationIncomplete { visited: 12 }.to_string(),
                "12",
            ),
        ];
        for (msg, want) in cases {
            assert!(msg.contains(want), "{msg:?} should contain {want:?}");
        }
    }
}
