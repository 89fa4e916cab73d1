//! Typed errors of the recording core. Every message names the offending value.

use thiserror::Error;

/// Errors of the [`crate::strings::StringStorage`].
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum StringError {
    /// The id is not interned.
    #[error("string id {0} is not interned (never was, or was released by a generation advance)")]
    UnknownId(u32),
    /// The id was released more often than it was interned.
    #[error("string id {0} was uninterned more times than it was interned")]
    Underflow(u32),
    /// The string is longer than the storage accepts.
    #[error("string of {len} bytes is longer than the limit of {limit} bytes")]
    TooLong {
        /// Its length in bytes.
        len: usize,
        /// The longest accepted.
        limit: usize,
    },
    /// No id is left for a new string.
    #[error("string storage is full ({0} live strings)")]
    Full(usize),
}

/// Errors of a [`crate::profile::Profile`].
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum ProfileError {
    /// A sample's values do not match the profile's sample types.
    #[error("sample has {got} values but the profile has {expected} sample types")]
    WrongValueCount {
        /// The profile's number of sample types.
        expected: usize,
        /// The number of values given.
        got: usize,
    },
    /// Two labels of one sample have the same key.
    #[error("label key {0:?} appears more than once in one sample")]
    DuplicateLabelKey(String),
    /// The `local root span id` label was given as a string.
    #[error("label \"local root span id\" must be numeric, got the string {0:?}")]
    StringLocalRootSpanId(String),
    /// A sample's stack is deeper than the profile accepts.
    #[error("sample has {got} frames, more than the limit of {limit}")]
    TooManyFrames {
        /// The stack's depth.
        got: usize,
        /// The deepest accepted.
        limit: usize,
    },
    /// A label's key is empty.
    #[error("label key must not be empty")]
    EmptyLabelKey,
    /// A sample's end timestamp is negative.
    #[error("end timestamp {0} ns is negative")]
    NegativeTimestamp(i64),
    /// Interning or resolving a string failed.
    #[error(transparent)]
    String(#[from] StringError),
    /// Writing the encoded profile failed.
    #[error("encoding failed: {0}")]
    Encode(String),
    /// A string id was given to a profile without string storage.
    #[error("string id {0} used but this profile has no string storage to resolve it")]
    NoStringStorage(u32),
    /// A label key reserved for timestamped samples was given as a label.
    #[error("label key {0:?} is reserved for timestamped samples; pass the timestamp instead")]
    ReservedLabelKey(String),
    /// The compression was not compiled in.
    #[error("compression {0:?} is not available in this build (enable the `zstd` feature)")]
    CompressionUnavailable(crate::pprof::Compression),
    /// The default sample type is not one of the profile's.
    #[error("default sample type {0:?} is not one of the profile's sample types")]
    DefaultTypeNotInProfile(&'static str),
    /// The profile's period is negative.
    #[error("period {0} is negative")]
    NegativePeriod(i64),
}

/// Errors of the [`crate::heap::HeapRecorder`].
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum HeapError {
    /// `sample_every` is not positive.
    #[error("heap sample_every must be a positive integer value but was {0}")]
    InvalidSampleEvery(i64),
    /// A recording started while the previous one was not ended.
    #[error("Detected consecutive heap allocation recording starts without end.")]
    StartWithoutEnd,
    /// A recording ended that was not started.
    #[error("Ended a heap recording that was not started")]
    EndWithoutStart,
    /// Two recordings have the same object id.
    #[error("Object ids are supposed to be unique. We got 2 allocation recordings with the same id. previous={{{previous}}} new={{{new}}}")]
    DuplicateId {
        /// The record already there.
        previous: String,
        /// The new one.
        new: String,
    },
    /// An iteration was prepared while the previous one was not finished.
    #[error("New heap recorder iteration prepared without the previous one having been finished.")]
    PrepareTwice,
    /// An iteration was finished without being prepared.
    #[error("Heap recorder iteration finished without having been prepared.")]
    FinishWithoutPrepare,
    /// A stack is deeper than the heap recorder accepts.
    #[error("stack has {got} frames, more than the limit of {limit}")]
    TooManyFrames {
        /// The stack's depth.
        got: usize,
        /// The deepest accepted.
        limit: usize,
    },
    /// A heap record tracks as many objects as it can.
    #[error("heap record reached the maximum number of tracked objects ({0})")]
    TooManyObjects(u32),
    /// The heap recorder holds as many distinct stacks as it can.
    #[error("heap recorder holds the maximum number of distinct stacks ({limit})")]
    TooManyStacks {
        /// The limit.
        limit: usize,
    },
    /// An iteration ran without being prepared.
    #[error("heap recorder iteration was not prepared (call prepare_iteration first)")]
    NotPrepared,
    /// Interning or resolving a string failed.
    #[error(transparent)]
    String(#[from] StringError),
}

/// Errors of the [`crate::stack_recorder::StackRecorder`].
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum RecorderError {
    /// Neither profile slot could be entered in two rounds; the sample is dropped (a sampler never
    /// waits for a serialization).
    #[error("failed to grab either profile slot in two rounds (active slot {active_slot}); sample dropped")]
    NoActiveSlot {
        /// The slot that was active.
        active_slot: u8,
    },
    /// Two serializations ran at once.
    #[error("a serialization is already running; only one may run at a time")]
    ConcurrentSerialization,
    /// Recording into the profile failed.
    #[error("failed to record sample: {0}")]
    Profile(#[from] ProfileError),
    /// The heap recorder failed.
    #[error("heap recorder: {0}")]
    Heap(#[from] HeapError),
    /// A heap call on a recorder configured without heap profiling.
    #[error("heap profiling is disabled in this recorder's configuration")]
    HeapDisabled,
    /// The configuration is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// A heap iteration ended before visiting every live object.
    #[error("heap iteration stopped after {visited} live objects, before visiting all of them")]
    HeapIterationIncomplete {
        /// The live objects visited.
        visited: u64,
    },
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
