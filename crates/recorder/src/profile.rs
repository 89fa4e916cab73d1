//! Aggregation of samples into one profile, ready for pprof encoding.
//!
//! Samples without a timestamp aggregate by (stack, label set): values add up. Timestamped
//! samples are kept one by one and carry an `end_timestamp_ns` numeric label when encoded.
//! `set_endpoint` attaches a `trace endpoint` label at encoding time to every sample whose numeric
//! `local root span id` label matches, including samples recorded before the call.
//!
//! CONTRACT (implementation pending, see issue 2).

use std::sync::Arc;
use std::time::SystemTime;

use crate::error::ProfileError;
use crate::pprof::{EncodeOptions, EncodedProfile, Symbolizer};
use crate::sample_types::SampleType;
use crate::strings::{StringId, StringStorage};

/// Most frames one sample may carry.
pub const MAX_FRAMES: usize = 3000;

/// Label key whose numeric value links samples to an endpoint.
pub const LOCAL_ROOT_SPAN_ID_LABEL: &str = "local root span id";
/// Label key added at encoding for samples whose span has an endpoint.
pub const TRACE_ENDPOINT_LABEL: &str = "trace endpoint";
/// Numeric label carried by timestamped samples.
pub const END_TIMESTAMP_LABEL: &str = "end_timestamp_ns";

/// A string given either literally or as an id of the profile's [`StringStorage`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Str<'a> {
    Lit(&'a str),
    Id(StringId),
}

impl<'a> From<&'a str> for Str<'a> {
    fn from(s: &'a str) -> Self {
        Str::Lit(s)
    }
}

impl From<StringId> for Str<'_> {
    fn from(id: StringId) -> Self {
        Str::Id(id)
    }
}

/// One stack frame, innermost first in a sample's frame slice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Frame<'a> {
    /// Already symbolized.
    Symbol {
        name: Str<'a>,
        filename: Str<'a>,
        line: i64,
    },
    /// A return/instruction address, symbolized at encoding by the [`Symbolizer`] passed to
    /// [`Profile::encode`] (one address may expand to several inlined frames). Without a
    /// symbolizer, or when it knows nothing, the location carries the address alone.
    Address(u64),
}

impl<'a> Frame<'a> {
    pub fn sym(name: &'a str, filename: &'a str, line: i64) -> Self {
        Frame::Symbol {
            name: Str::Lit(name),
            filename: Str::Lit(filename),
            line,
        }
    }
}

/// A label value: a string or a number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LabelValue<'a> {
    Str(Str<'a>),
    Num(i64),
}

/// A (key, value) label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Label<'a> {
    pub key: Str<'a>,
    pub value: LabelValue<'a>,
}

impl<'a> Label<'a> {
    pub fn str(key: &'a str, value: &'a str) -> Self {
        Label {
            key: Str::Lit(key),
            value: LabelValue::Str(Str::Lit(value)),
        }
    }

    pub fn num(key: &'a str, value: i64) -> Self {
        Label {
            key: Str::Lit(key),
            value: LabelValue::Num(value),
        }
    }
}

/// One sample as handed to [`Profile::add`].
#[derive(Debug, Clone, Copy)]
pub struct Sample<'a> {
    /// Innermost frame first.
    pub frames: &'a [Frame<'a>],
    /// Exactly one value per sample type of the profile.
    pub values: &'a [i64],
    pub labels: &'a [Label<'a>],
    /// Nanoseconds since the Unix epoch; 0 means "not timestamped" (aggregated).
    pub end_timestamp_ns: i64,
}

/// A profile being recorded.
pub struct Profile {
    _todo: (),
}

impl Profile {
    /// `strings` resolves [`Str::Id`] values; without it, ids are an error.
    pub fn new(_types: &[SampleType], _strings: Option<Arc<StringStorage>>, _start: SystemTime) -> Self {
        todo!("issue 2")
    }

    pub fn sample_types(&self) -> &[SampleType] {
        todo!("issue 2")
    }

    pub fn start(&self) -> SystemTime {
        todo!("issue 2")
    }

    /// Adds one sample; validation errors leave the profile unchanged.
    pub fn add(&mut self, _sample: &Sample<'_>) -> Result<(), ProfileError> {
        todo!("issue 2")
    }

    /// Associates an endpoint with a local root span id (last call wins) and counts it.
    pub fn set_endpoint(&mut self, _local_root_span_id: u64, _endpoint: &str) -> Result<(), ProfileError> {
        todo!("issue 2")
    }

    /// Adds `value` to the endpoint's count (reported in `EncodedProfile::endpoint_counts`).
    pub fn add_endpoint_count(&mut self, _endpoint: &str, _value: i64) -> Result<(), ProfileError> {
        todo!("issue 2")
    }

    /// Distinct aggregated samples plus timestamped samples held.
    pub fn sample_count(&self) -> usize {
        todo!("issue 2")
    }

    /// Drops all samples, endpoints and interned data; the profile restarts at `start`.
    pub fn reset(&mut self, _start: SystemTime) {
        todo!("issue 2")
    }

    /// Encodes as pprof with `time_nanos` = start and `duration_nanos` = `end` - start.
    pub fn encode(
        &self,
        _end: SystemTime,
        _opts: &EncodeOptions,
        _symbolizer: Option<&mut dyn Symbolizer>,
    ) -> Result<EncodedProfile, ProfileError> {
        todo!("issue 2")
    }
}
