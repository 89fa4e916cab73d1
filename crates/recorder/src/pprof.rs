//! Streaming pprof (profile.proto) encoding and compression.
//!
//! The encoder writes protobuf straight into the compressor, without building an intermediate
//! copy of the whole profile: every nested message's length is computed arithmetically before
//! its fields are written, and bytes pass through a small staging buffer that is flushed into the
//! compressor as it fills. Functions, locations, label sets and stacks are deduplicated by the
//! profile before they get here. No mapping is emitted when the symbolizer gives none.

use std::io::{self, Write};
use std::time::SystemTime;

use crate::error::ProfileError;

/// Output compression.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compression {
    /// Plain profile.proto bytes.
    None,
    /// Readable by `go tool pprof`, Pyroscope and Datadog.
    #[default]
    Gzip,
    /// Needs the `zstd` feature.
    Zstd,
}

impl Compression {
    /// Whether this build can produce this compression.
    pub fn is_available(self) -> bool {
        match self {
            Compression::None | Compression::Gzip => true,
            Compression::Zstd => cfg!(feature = "zstd"),
        }
    }
}

/// Options of [`crate::profile::Profile::encode`].
#[derive(Debug, Clone, Default)]
pub struct EncodeOptions {
    /// How the encoded bytes are compressed.
    pub compression: Compression,
}

/// One encoded profile.
#[derive(Debug, Clone)]
pub struct EncodedProfile {
    /// When the profile's recording began.
    pub start: SystemTime,
    /// When it ended (the encoding time).
    pub end: SystemTime,
    /// The compressed (per `compression`) profile.proto bytes.
    pub bytes: Vec<u8>,
    /// How `bytes` are compressed.
    pub compression: Compression,
    /// Endpoint name -> count, as collected by `set_endpoint` / `add_endpoint_count`.
    pub endpoint_counts: Vec<(String, i64)>,
}

/// One frame produced by symbolizing an address.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ResolvedFrame {
    /// The function's readable name (demangled, fully qualified where known).
    pub name: String,
    /// The function's name as the system knows it (its linkage, mangled name); empty when
    /// unknown. pprof's `Function.system_name`.
    pub system_name: String,
    /// The source file (empty when unknown).
    pub filename: String,
    /// The line in `filename` (0: unknown).
    pub line: i64,
    /// Line where the function starts in `filename` (0: unknown). pprof's `Function.start_line`.
    pub start_line: i64,
}

/// Where an object (executable, shared library, vDSO) is loaded, as a pprof `Mapping`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MappingInfo {
    /// Address range the object's code occupies in memory: [memory_start, memory_limit).
    pub memory_start: u64,
    /// End of that range (exclusive).
    pub memory_limit: u64,
    /// Offset in the file that `memory_start` maps.
    pub file_offset: u64,
    /// The object's file (or a `[name]` for objects without one, like the vDSO).
    pub filename: String,
    /// The GNU build id, in lowercase hex; empty when there is none.
    pub build_id: String,
    /// Whether the frames of this mapping's locations carry function names (this and the next
    /// three flags say what they carry; a viewer re-symbolizes a mapping that lacks them).
    pub has_functions: bool,
    /// Whether they carry file names.
    pub has_filenames: bool,
    /// Whether they carry line numbers.
    pub has_line_numbers: bool,
    /// Whether they carry inlined frames.
    pub has_inline_frames: bool,
}

/// Turns addresses into frames at encoding time (off the hot path).
pub trait Symbolizer {
    /// Pushes the frames at `address`, innermost (most inlined) first and the physical function
    /// last. Pushes nothing when the address is unknown.
    fn symbolize(&mut self, address: u64, out: &mut Vec<ResolvedFrame>);

    /// Called once per profile, before any `symbolize`, with every address about to be asked
    /// for (in no order, possibly repeated), so that a symbolizer can resolve them together.
    fn prepare(&mut self, addresses: &[u64]) {
        let _ = addresses;
    }

    /// The mapping `address` lies in, asked once per address after its `symbolize`. `None`
    /// (the default): the location is written without a mapping.
    fn mapping(&mut self, address: u64) -> Option<&MappingInfo> {
        let _ = address;
        None
    }
}

/// gzip level 2: on profiles (measured on 1k-sample and 100k-stack ones) about 10-15% smaller
/// than level 1 for well under twice its time; higher levels cost several times more for a few
/// percent.
const GZIP_LEVEL: u32 = 2;
/// zstd level 2: on profiles as fast as level 1 and about 7% smaller; level 3 doubles the time.
#[cfg(feature = "zstd")]
const ZSTD_LEVEL: i32 = 2;
/// Staging buffer size: large enough that the compressor sees big writes, small enough to stay
/// in cache.
const STAGE_BYTES: usize = 32 * 1024;
/// Initial output capacity (a typical compressed profile is tens of KiB).
const INITIAL_OUTPUT_BYTES: usize = 32 * 1024;

/// Where encoded bytes end up.
enum Sink {
    Raw(Vec<u8>),
    // Boxed: the encoder's state is large (hundreds of bytes inline with zlib-rs).
    Gzip(Box<flate2::write::GzEncoder<Vec<u8>>>),
    #[cfg(feature = "zstd")]
    Zstd(zstd::stream::write::Encoder<'static, Vec<u8>>),
}

impl Sink {
    fn new(compression: Compression) -> Result<Sink, ProfileError> {
        let out = Vec::with_capacity(INITIAL_OUTPUT_BYTES);
        match compression {
            Compression::None => Ok(Sink::Raw(out)),
            Compression::Gzip => Ok(Sink::Gzip(Box::new(flate2::write::GzEncoder::new(
                out,
                flate2::Compression::new(GZIP_LEVEL),
            )))),
            #[cfg(feature = "zstd")]
            Compression::Zstd => zstd::stream::write::Encoder::new(out, ZSTD_LEVEL)
                .map(Sink::Zstd)
                .map_err(|e| ProfileError::Encode(format!("zstd encoder set-up failed: {e}"))),
            #[cfg(not(feature = "zstd"))]
            Compression::Zstd => Err(ProfileError::CompressionUnavailable(compression)),
        }
    }

    fn write_all(&mut self, bytes: &[u8]) -> io::Result<()> {
        match self {
            Sink::Raw(v) => {
                v.extend_from_slice(bytes);
                Ok(())
            }
            Sink::Gzip(g) => g.write_all(bytes),
            #[cfg(feature = "zstd")]
            Sink::Zstd(z) => z.write_all(bytes),
        }
    }

    fn finish(self) -> io::Result<Vec<u8>> {
        match self {
            Sink::Raw(v) => Ok(v),
            Sink::Gzip(g) => g.finish(),
            #[cfg(feature = "zstd")]
            Sink::Zstd(z) => z.finish(),
        }
    }
}

/// Protobuf wire types used by profile.proto.
const WIRE_VARINT: u8 = 0;
const WIRE_LEN: u8 = 2;

/// Bytes a varint of `v` takes.
#[inline]
pub(crate) fn varint_len(v: u64) -> usize {
    let bits = 64 - (v | 1).leading_zeros() as usize;
    bits.div_ceil(7)
}

/// Bytes of a varint field (tag + value), or 0 when `v` is 0 (proto3 default, omitted).
#[inline]
pub(crate) fn varint_field_len(v: u64) -> usize {
    if v == 0 {
        0
    } else {
        1 + varint_len(v)
    }
}

/// Bytes of a length-delimited field (tag + length + payload), for field numbers below 16.
#[inline]
pub(crate) fn len_field_len(payload: usize) -> usize {
    1 + varint_len(payload as u64) + payload
}

/// Appends protobuf wire data to a staging buffer that is flushed into the compressor.
pub(crate) struct PbWriter {
    stage: Vec<u8>,
    sink: Sink,
}

impl PbWriter {
    pub(crate) fn new(compression: Compression) -> Result<Self, ProfileError> {
        Ok(PbWriter {
            stage: Vec::with_capacity(STAGE_BYTES + 1024),
            sink: Sink::new(compression)?,
        })
    }

    #[inline]
    pub(crate) fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.stage.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.stage.push(v as u8);
    }

    /// Field tag; all profile.proto field numbers used here are below 16, so one byte.
    #[inline]
    fn tag(&mut self, field: u8, wire: u8) {
        self.stage.push((field << 3) | wire);
    }

    /// A varint field, omitted when zero.
    #[inline]
    pub(crate) fn uint_field(&mut self, field: u8, v: u64) {
        if v != 0 {
            self.tag(field, WIRE_VARINT);
            self.varint(v);
        }
    }

    /// An int64 field (two's complement varint), omitted when zero.
    #[inline]
    pub(crate) fn int_field(&mut self, field: u8, v: i64) {
        self.uint_field(field, v as u64);
    }

    /// Tag and length of a nested message or packed field whose payload follows.
    #[inline]
    pub(crate) fn len_header(&mut self, field: u8, len: usize) {
        self.tag(field, WIRE_LEN);
        self.varint(len as u64);
    }

    /// A length-delimited field with its payload.
    #[inline]
    pub(crate) fn bytes_field(&mut self, field: u8, bytes: &[u8]) {
        self.len_header(field, bytes.len());
        self.raw(bytes);
    }

    #[inline]
    pub(crate) fn raw(&mut self, bytes: &[u8]) {
        self.stage.extend_from_slice(bytes);
    }

    /// Hands the staged bytes to the compressor once enough have accumulated. Call between
    /// messages; a message is never split across calls in a way that matters to the output.
    #[inline]
    pub(crate) fn maybe_flush(&mut self) -> Result<(), ProfileError> {
        if self.stage.len() >= STAGE_BYTES {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<(), ProfileError> {
        self.sink
            .write_all(&self.stage)
            .map_err(|e| ProfileError::Encode(format!("compressor write failed: {e}")))?;
        self.stage.clear();
        Ok(())
    }

    pub(crate) fn finish(mut self) -> Result<Vec<u8>, ProfileError> {
        self.flush()?;
        self.sink
            .finish()
            .map_err(|e| ProfileError::Encode(format!("compressor finish failed: {e}")))
    }
}

/// profile.proto field numbers.
pub(crate) mod field {
    pub const PROFILE_SAMPLE_TYPE: u8 = 1;
    pub const PROFILE_SAMPLE: u8 = 2;
    pub const PROFILE_MAPPING: u8 = 3;
    pub const PROFILE_LOCATION: u8 = 4;
    pub const PROFILE_FUNCTION: u8 = 5;
    pub const PROFILE_STRING_TABLE: u8 = 6;
    pub const PROFILE_TIME_NANOS: u8 = 9;
    pub const PROFILE_DURATION_NANOS: u8 = 10;
    pub const PROFILE_PERIOD_TYPE: u8 = 11;
    pub const PROFILE_PERIOD: u8 = 12;
    pub const PROFILE_DEFAULT_SAMPLE_TYPE: u8 = 14;

    pub const VALUE_TYPE_TYPE: u8 = 1;
    pub const VALUE_TYPE_UNIT: u8 = 2;

    pub const SAMPLE_LOCATION_ID: u8 = 1;
    pub const SAMPLE_VALUE: u8 = 2;
    pub const SAMPLE_LABEL: u8 = 3;

    pub const LABEL_KEY: u8 = 1;
    pub const LABEL_STR: u8 = 2;
    pub const LABEL_NUM: u8 = 3;

    pub const MAPPING_ID: u8 = 1;
    pub const MAPPING_MEMORY_START: u8 = 2;
    pub const MAPPING_MEMORY_LIMIT: u8 = 3;
    pub const MAPPING_FILE_OFFSET: u8 = 4;
    pub const MAPPING_FILENAME: u8 = 5;
    pub const MAPPING_BUILD_ID: u8 = 6;
    pub const MAPPING_HAS_FUNCTIONS: u8 = 7;
    pub const MAPPING_HAS_FILENAMES: u8 = 8;
    pub const MAPPING_HAS_LINE_NUMBERS: u8 = 9;
    pub const MAPPING_HAS_INLINE_FRAMES: u8 = 10;

    pub const LOCATION_ID: u8 = 1;
    pub const LOCATION_MAPPING_ID: u8 = 2;
    pub const LOCATION_ADDRESS: u8 = 3;
    pub const LOCATION_LINE: u8 = 4;

    pub const LINE_FUNCTION_ID: u8 = 1;
    pub const LINE_LINE: u8 = 2;

    pub const FUNCTION_ID: u8 = 1;
    pub const FUNCTION_NAME: u8 = 2;
    pub const FUNCTION_SYSTEM_NAME: u8 = 3;
    pub const FUNCTION_FILENAME: u8 = 4;
    pub const FUNCTION_START_LINE: u8 = 5;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varint_lengths() {
        for (v, n) in [
            (0u64, 1usize),
            (1, 1),
            (127, 1),
            (128, 2),
            (16_383, 2),
            (16_384, 3),
            (u32::MAX as u64, 5),
            (u64::MAX, 10),
            (-1i64 as u64, 10),
        ] {
            assert_eq!(varint_len(v), n, "{v}");
            let mut w = PbWriter::new(Compression::None).unwrap();
            w.varint(v);
            assert_eq!(w.stage.len(), n, "{v}");
        }
        assert_eq!(varint_field_len(0), 0);
        assert_eq!(varint_field_len(300), 3);
        assert_eq!(len_field_len(3), 5);
    }

    #[test]
    fn writes_fields_in_wire_format() {
        let mut w = PbWriter::new(Compression::None).unwrap();
        w.uint_field(1, 150);
        w.uint_field(2, 0);
        w.bytes_field(6, b"hi");
        w.int_field(3, -1);
        let out = w.finish().unwrap();
        let mut want = vec![0x08, 0x96, 0x01, 0x32, 0x02, b'h', b'i', 0x18];
        want.extend([0xff; 9]);
        want.push(0x01);
        assert_eq!(out, want);
    }

    #[test]
    fn gzip_output_is_gzip() {
        let mut w = PbWriter::new(Compression::Gzip).unwrap();
        w.bytes_field(6, b"hello");
        let out = w.finish().unwrap();
        assert_eq!(&out[..2], &[0x1f, 0x8b]);
        assert_eq!(
            ferroprof_decompress(&out),
            vec![0x32, 5, b'h', b'e', b'l', b'l', b'o']
        );
    }

    #[test]
    fn zstd_availability_matches_feature() {
        assert_eq!(Compression::Zstd.is_available(), cfg!(feature = "zstd"));
        let r = PbWriter::new(Compression::Zstd);
        if cfg!(feature = "zstd") {
            assert!(r.is_ok());
        } else {
            assert!(matches!(
                r.err(),
                Some(ProfileError::CompressionUnavailable(Compression::Zstd))
            ));
        }
    }

    fn ferroprof_decompress(b: &[u8]) -> Vec<u8> {
        use std::io::Read;
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(b)
            .read_to_end(&mut out)
            .unwrap();
        out
    }
}
