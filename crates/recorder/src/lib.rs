//! The recording core of ferroprof.
//!
//! Pure Rust, no signals, no OS specifics: string interning ([`strings`]), the sample-type layout
//! ([`sample_types`]), profile aggregation and pprof encoding ([`profile`], [`pprof`]), the
//! two-slot [`stack_recorder`] that lets samplers record without ever waiting for a serialization,
//! and the [`heap`] recorder that tracks sampled live objects.

#![warn(missing_docs)]

pub mod error;
mod gate;
pub mod heap;
#[cfg(all(test, loom))]
mod loom_model;
pub mod pprof;
pub mod profile;
pub mod sample_types;
mod spin;
pub mod stack_recorder;
pub mod strings;
mod sync;

pub use error::{HeapError, ProfileError, RecorderError, StringError};
pub use heap::{HeapConfig, HeapRecorder, HeapStats, Liveness, LivenessSource};
pub use pprof::{Compression, EncodedProfile, MappingInfo, ResolvedFrame, Symbolizer};
pub use profile::{
    Frame, Label, LabelValue, Profile, ProfileMetadata, Sample, Str, DROPPED_STACKS_FRAME,
};
pub use sample_types::{
    ExtraValues, SampleLayout, SampleType, SampleTypeConfig, SampleTypeExtras, SampleValues,
};
pub use stack_recorder::{
    LateSamples, LifetimeStats, ProfileStats, RecorderConfig, RecorderExtras, RecorderStats,
    SerializedProfile, SharedStateGate, StackRecorder,
};
pub use strings::{StringId, StringStorage};
