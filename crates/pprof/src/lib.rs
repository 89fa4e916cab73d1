//! Reading pprof files: a `prost` model of `profile.proto` (written from the published schema,
//! independent of ferroprof's own streaming encoder, so tests can check one against the other)
//! plus helpers to resolve strings, stacks and labels.

use std::collections::HashMap;
use std::io::Read;

use prost::Message;

pub mod go_tool;
mod wire;
use thiserror::Error;

/// Errors reading a pprof file.
#[derive(Debug, Error)]
pub enum ReadError {
    #[error("not a pprof profile: gzip data is corrupt ({0})")]
    Gzip(std::io::Error),
    #[error("not a pprof profile: zstd data is corrupt ({0})")]
    Zstd(String),
    #[error("zstd-compressed profile, but this build has no zstd support")]
    ZstdUnsupported,
    #[error("not a pprof profile: protobuf decoding failed ({0})")]
    Decode(#[from] prost::DecodeError),
    #[error("not a pprof profile: {0}")]
    Invalid(String),
    /// The input, or what it decompresses to, is larger than the caller's limit.
    #[error("profile is larger than the {limit}-byte limit once decompressed")]
    TooLarge { limit: u64 },
    /// Decoding would take more memory than [`MAX_DECODED_PER_LIMIT`] times the caller's limit
    /// (a small file of many empty messages), estimated before decoding. `estimate` is where
    /// the estimate stopped, just past that: a lower bound.
    #[error(
        "profile would take over {estimate} bytes in memory once decoded, more than \
         {MAX_DECODED_PER_LIMIT} times the {limit}-byte limit"
    )]
    DecodedTooLarge { estimate: u64, limit: u64 },
}

/// With a size limit, the decoded profile may take at most this many times the limit in
/// memory. Real profiles take about 3 times their encoded size (8-byte ids from 1-byte varints,
/// a 24-byte header per string); a file of empty messages up to 36 times.
pub const MAX_DECODED_PER_LIMIT: u64 = 2;

#[derive(Clone, PartialEq, Message)]
pub struct Profile {
    #[prost(message, repeated, tag = "1")]
    pub sample_type: Vec<ValueType>,
    #[prost(message, repeated, tag = "2")]
    pub sample: Vec<Sample>,
    #[prost(message, repeated, tag = "3")]
    pub mapping: Vec<Mapping>,
    #[prost(message, repeated, tag = "4")]
    pub location: Vec<Location>,
    #[prost(message, repeated, tag = "5")]
    pub function: Vec<Function>,
    #[prost(string, repeated, tag = "6")]
    pub string_table: Vec<String>,
    #[prost(int64, tag = "7")]
    pub drop_frames: i64,
    #[prost(int64, tag = "8")]
    pub keep_frames: i64,
    #[prost(int64, tag = "9")]
    pub time_nanos: i64,
    #[prost(int64, tag = "10")]
    pub duration_nanos: i64,
    #[prost(message, optional, tag = "11")]
    pub period_type: Option<ValueType>,
    #[prost(int64, tag = "12")]
    pub period: i64,
    #[prost(int64, repeated, tag = "13")]
    pub comment: Vec<i64>,
    #[prost(int64, tag = "14")]
    pub default_sample_type: i64,
}

#[derive(Clone, PartialEq, Message)]
pub struct ValueType {
    #[prost(int64, tag = "1")]
    pub r#type: i64,
    #[prost(int64, tag = "2")]
    pub unit: i64,
}

#[derive(Clone, PartialEq, Message)]
pub struct Sample {
    #[prost(uint64, repeated, tag = "1")]
    pub location_id: Vec<u64>,
    #[prost(int64, repeated, tag = "2")]
    pub value: Vec<i64>,
    #[prost(message, repeated, tag = "3")]
    pub label: Vec<Label>,
}

#[derive(Clone, PartialEq, Message)]
pub struct Label {
    #[prost(int64, tag = "1")]
    pub key: i64,
    #[prost(int64, tag = "2")]
    pub str: i64,
    #[prost(int64, tag = "3")]
    pub num: i64,
    #[prost(int64, tag = "4")]
    pub num_unit: i64,
}

#[derive(Clone, PartialEq, Message)]
pub struct Mapping {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    #[prost(uint64, tag = "2")]
    pub memory_start: u64,
    #[prost(uint64, tag = "3")]
    pub memory_limit: u64,
    #[prost(uint64, tag = "4")]
    pub file_offset: u64,
    #[prost(int64, tag = "5")]
    pub filename: i64,
    #[prost(int64, tag = "6")]
    pub build_id: i64,
    #[prost(bool, tag = "7")]
    pub has_functions: bool,
    #[prost(bool, tag = "8")]
    pub has_filenames: bool,
    #[prost(bool, tag = "9")]
    pub has_line_numbers: bool,
    #[prost(bool, tag = "10")]
    pub has_inline_frames: bool,
}

#[derive(Clone, PartialEq, Message)]
pub struct Location {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    #[prost(uint64, tag = "2")]
    pub mapping_id: u64,
    #[prost(uint64, tag = "3")]
    pub address: u64,
    #[prost(message, repeated, tag = "4")]
    pub line: Vec<Line>,
    #[prost(bool, tag = "5")]
    pub is_folded: bool,
}

#[derive(Clone, PartialEq, Message)]
pub struct Line {
    #[prost(uint64, tag = "1")]
    pub function_id: u64,
    #[prost(int64, tag = "2")]
    pub line: i64,
    #[prost(int64, tag = "3")]
    pub column: i64,
}

#[derive(Clone, PartialEq, Message)]
pub struct Function {
    #[prost(uint64, tag = "1")]
    pub id: u64,
    #[prost(int64, tag = "2")]
    pub name: i64,
    #[prost(int64, tag = "3")]
    pub system_name: i64,
    #[prost(int64, tag = "4")]
    pub filename: i64,
    #[prost(int64, tag = "5")]
    pub start_line: i64,
}

/// Decompresses (gzip, zstd or none, detected by magic bytes) and decodes a pprof profile.
/// No size limit: for untrusted input use [`decode_limited`].
pub fn decode(bytes: &[u8]) -> Result<Profile, ReadError> {
    decode_limited(bytes, u64::MAX)
}

/// Like [`decode`], but fails with [`ReadError::TooLarge`] once the profile's decompressed size
/// exceeds `max_size` bytes, and with [`ReadError::DecodedTooLarge`] if decoding would take more
/// than [`MAX_DECODED_PER_LIMIT`] times `max_size` in memory. The first check runs while
/// inflating and the second before decoding, so a compression bomb costs at most `max_size`
/// bytes of memory before the error.
pub fn decode_limited(bytes: &[u8], max_size: u64) -> Result<Profile, ReadError> {
    let raw = decompress_limited(bytes, max_size)?;
    if max_size != u64::MAX {
        let most = max_size.saturating_mul(MAX_DECODED_PER_LIMIT);
        let estimate = wire::decoded_size(&raw, most);
        if estimate > most {
            return Err(ReadError::DecodedTooLarge {
                estimate,
                limit: max_size,
            });
        }
    }
    let p = Profile::decode(raw.as_slice())?;
    p.validate()?;
    Ok(p)
}

/// About how many bytes the [`Profile`] encoded in `raw` (uncompressed) will take in memory
/// once decoded, found by walking its wire format without decoding (linear, no allocation).
/// Empty repeated messages cost two bytes on the wire but a whole struct in memory, so this can
/// be tens of times `raw.len()`; malformed input gives the estimate up to the fault.
pub fn decoded_size_estimate(raw: &[u8]) -> u64 {
    wire::decoded_size(raw, u64::MAX)
}

/// Undoes gzip or zstd compression, detected by magic bytes; other input is returned as is.
/// No size limit: for untrusted input use [`decompress_limited`].
pub fn decompress(bytes: &[u8]) -> Result<Vec<u8>, ReadError> {
    decompress_limited(bytes, u64::MAX)
}

/// Like [`decompress`], but never produces more than `max_size` bytes: inflation stops one byte
/// past the limit and fails with [`ReadError::TooLarge`]. Uncompressed input larger than the
/// limit fails the same way.
pub fn decompress_limited(bytes: &[u8], max_size: u64) -> Result<Vec<u8>, ReadError> {
    let too_large = ReadError::TooLarge { limit: max_size };
    if bytes.starts_with(&[0x1f, 0x8b]) {
        let gz = flate2::read::MultiGzDecoder::new(bytes);
        read_limited(gz, max_size)
            .map_err(ReadError::Gzip)?
            .ok_or(too_large)
    } else if bytes.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        #[cfg(feature = "zstd")]
        {
            let zst = zstd::stream::read::Decoder::new(bytes)
                .map_err(|e| ReadError::Zstd(e.to_string()))?;
            read_limited(zst, max_size)
                .map_err(|e| ReadError::Zstd(e.to_string()))?
                .ok_or(too_large)
        }
        #[cfg(not(feature = "zstd"))]
        {
            Err(ReadError::ZstdUnsupported)
        }
    } else if bytes.len() as u64 > max_size {
        Err(too_large)
    } else {
        Ok(bytes.to_vec())
    }
}

/// Reads `r` to the end, or `None` as soon as it yields more than `max_size` bytes: reading
/// stops at `max_size + 1`, so the output never grows past the limit.
fn read_limited(r: impl Read, max_size: u64) -> std::io::Result<Option<Vec<u8>>> {
    let mut out = Vec::new();
    r.take(max_size.saturating_add(1)).read_to_end(&mut out)?;
    Ok((out.len() as u64 <= max_size).then_some(out))
}

/// One frame of a resolved stack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedLine {
    pub function: String,
    pub filename: String,
    pub line: i64,
    pub address: u64,
}

impl Profile {
    /// Checks the cross references a reader relies on (string indexes, ids).
    pub fn validate(&self) -> Result<(), ReadError> {
        let nstr = self.string_table.len() as i64;
        if nstr == 0 {
            if self.sample_type.is_empty() && self.sample.is_empty() {
                return Err(ReadError::Invalid("empty message".into()));
            }
            return Err(ReadError::Invalid("string table is empty".into()));
        }
        if !self.string_table[0].is_empty() {
            return Err(ReadError::Invalid(format!(
                "string_table[0] must be \"\", got {:?}",
                self.string_table[0]
            )));
        }
        let s_ok = |i: i64| (0..nstr).contains(&i);
        for vt in &self.sample_type {
            if !s_ok(vt.r#type) || !s_ok(vt.unit) {
                return Err(ReadError::Invalid(
                    "sample_type string index out of range".into(),
                ));
            }
        }
        let locs: HashMap<u64, &Location> = self.location.iter().map(|l| (l.id, l)).collect();
        let funcs: HashMap<u64, &Function> = self.function.iter().map(|f| (f.id, f)).collect();
        for f in &self.function {
            if !s_ok(f.name) || !s_ok(f.system_name) || !s_ok(f.filename) {
                return Err(ReadError::Invalid(format!(
                    "function {} has a bad string index",
                    f.id
                )));
            }
        }
        for l in &self.location {
            for line in &l.line {
                if !funcs.contains_key(&line.function_id) {
                    return Err(ReadError::Invalid(format!(
                        "location {} names unknown function {}",
                        l.id, line.function_id
                    )));
                }
            }
        }
        for (i, s) in self.sample.iter().enumerate() {
            if s.value.len() != self.sample_type.len() {
                return Err(ReadError::Invalid(format!(
                    "sample {i} has {} values for {} sample types",
                    s.value.len(),
                    self.sample_type.len()
                )));
            }
            for id in &s.location_id {
                if !locs.contains_key(id) {
                    return Err(ReadError::Invalid(format!(
                        "sample {i} names unknown location {id}"
                    )));
                }
            }
            for l in &s.label {
                if !s_ok(l.key) || !s_ok(l.str) || !s_ok(l.num_unit) {
                    return Err(ReadError::Invalid(format!(
                        "sample {i} has a bad label string index"
                    )));
                }
            }
        }
        Ok(())
    }

    /// String at `i` (empty for out-of-range).
    pub fn str(&self, i: i64) -> &str {
        usize::try_from(i)
            .ok()
            .and_then(|i| self.string_table.get(i))
            .map(String::as_str)
            .unwrap_or("")
    }

    /// (type, unit) of every sample type, in order.
    pub fn sample_types(&self) -> Vec<(String, String)> {
        self.sample_type
            .iter()
            .map(|v| (self.str(v.r#type).to_owned(), self.str(v.unit).to_owned()))
            .collect()
    }

    /// Index of the sample type named `name`.
    pub fn value_index(&self, name: &str) -> Option<usize> {
        self.sample_type
            .iter()
            .position(|v| self.str(v.r#type) == name)
    }

    /// The frames of `sample`, innermost first, inlined frames expanded.
    pub fn stack(&self, sample: &Sample) -> Vec<ResolvedLine> {
        let locs: HashMap<u64, &Location> = self.location.iter().map(|l| (l.id, l)).collect();
        let funcs: HashMap<u64, &Function> = self.function.iter().map(|f| (f.id, f)).collect();
        let mut out = Vec::new();
        for id in &sample.location_id {
            let Some(loc) = locs.get(id) else { continue };
            if loc.line.is_empty() {
                out.push(ResolvedLine {
                    function: format!("{:#x}", loc.address),
                    filename: String::new(),
                    line: 0,
                    address: loc.address,
                });
            }
            for line in &loc.line {
                let (function, filename) = funcs
                    .get(&line.function_id)
                    .map(|f| (self.str(f.name).to_owned(), self.str(f.filename).to_owned()))
                    .unwrap_or_default();
                out.push(ResolvedLine {
                    function,
                    filename,
                    line: line.line,
                    address: loc.address,
                });
            }
        }
        out
    }

    /// Function names of `sample`'s stack, innermost first.
    pub fn stack_names(&self, sample: &Sample) -> Vec<String> {
        self.stack(sample).into_iter().map(|l| l.function).collect()
    }

    /// String value of the label `key` on `sample`.
    pub fn label_str<'a>(&'a self, sample: &Sample, key: &str) -> Option<&'a str> {
        sample
            .label
            .iter()
            .find(|l| self.str(l.key) == key && l.str != 0)
            .map(|l| self.str(l.str))
    }

    /// Numeric value of the label `key` on `sample`.
    pub fn label_num(&self, sample: &Sample, key: &str) -> Option<i64> {
        sample
            .label
            .iter()
            .find(|l| self.str(l.key) == key && l.str == 0)
            .map(|l| l.num)
    }

    /// Sum of the values of sample type `name` over all samples.
    pub fn total(&self, name: &str) -> Option<i64> {
        let i = self.value_index(name)?;
        Some(self.sample.iter().map(|s| s.value[i]).sum())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_a_hand_built_profile() {
        let p = Profile {
            sample_type: vec![ValueType { r#type: 1, unit: 2 }],
            sample: vec![Sample {
                location_id: vec![1],
                value: vec![42],
                label: vec![Label {
                    key: 3,
                    str: 4,
                    num: 0,
                    num_unit: 0,
                }],
            }],
            location: vec![Location {
                id: 1,
                line: vec![Line {
                    function_id: 1,
                    line: 7,
                    column: 0,
                }],
                ..Default::default()
            }],
            function: vec![Function {
                id: 1,
                name: 5,
                system_name: 5,
                filename: 6,
                start_line: 0,
            }],
            string_table: [
                "",
                "cpu-time",
                "nanoseconds",
                "thread name",
                "main",
                "f",
                "f.rs",
            ]
            .map(String::from)
            .to_vec(),
            ..Default::default()
        };
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &p.encode_to_vec()).unwrap();
        let back = decode(&gz.finish().unwrap()).unwrap();
        assert_eq!(back, p);
        assert_eq!(back.stack_names(&back.sample[0]), vec!["f"]);
        assert_eq!(back.label_str(&back.sample[0], "thread name"), Some("main"));
        assert_eq!(back.total("cpu-time"), Some(42));
    }

    #[test]
    fn rejects_garbage() {
        assert!(decode(b"definitely not a profile").is_err());
        assert!(decode(&[0x1f, 0x8b, 0, 1, 2]).is_err());
        assert!(decode(&[]).is_err());
    }

    #[test]
    fn limits_the_decompressed_size() {
        let p = crate::ProfileBuilder::new(&[("cpu-time", "nanoseconds")])
            .sample(&["f", "main"], &[1], &[])
            .build();
        let raw = p.encode_to_vec();
        let n = raw.len() as u64;
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &raw).unwrap();
        let gz = gz.finish().unwrap();
        for bytes in [&raw, &gz] {
            assert_eq!(
                decompress_limited(bytes, n).unwrap(),
                raw,
                "exactly at the limit"
            );
            assert_eq!(decode_limited(bytes, 1 << 20).unwrap(), p);
            assert!(matches!(
                decode_limited(bytes, n - 1),
                Err(ReadError::TooLarge { limit }) if limit == n - 1
            ));
        }
        // A bomb stops at the limit: a megabyte of zeros inflates no further than 1 KiB + 1.
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &vec![0u8; 1 << 20]).unwrap();
        let bomb = gz.finish().unwrap();
        assert!(matches!(
            decompress_limited(&bomb, 1024),
            Err(ReadError::TooLarge { limit: 1024 })
        ));
        assert_eq!(decompress(&bomb).unwrap().len(), 1 << 20);
    }

    #[cfg(feature = "zstd")]
    #[test]
    fn limits_zstd_too() {
        let bomb = zstd::encode_all(&vec![0u8; 1 << 20][..], 3).unwrap();
        assert!(matches!(
            decompress_limited(&bomb, 1024),
            Err(ReadError::TooLarge { limit: 1024 })
        ));
        assert_eq!(decompress_limited(&bomb, 1 << 20).unwrap().len(), 1 << 20);
    }

    #[test]
    fn limits_the_decoded_size() {
        // 100 empty samples: 200 bytes, 7200 decoded.
        let raw = [0x12u8, 0x00].repeat(100);
        let est = decoded_size_estimate(&raw);
        assert!(est > 7200, "{est}");
        assert!(matches!(
            decode_limited(&raw, 1000),
            Err(ReadError::DecodedTooLarge { estimate, limit: 1000 })
                if estimate > 2000 && estimate < est
        ));
        // Within the limit the decoder runs (and rejects it for having no string table).
        assert!(matches!(
            decode_limited(&raw, est),
            Err(ReadError::Invalid(_))
        ));
    }
}

/// Builds small profiles from function names, for tests and tools that need real pprof bytes
/// without running a recorder. Each distinct function gets one location.
#[derive(Debug, Default)]
pub struct ProfileBuilder {
    profile: Profile,
    strings: HashMap<String, i64>,
    functions: HashMap<String, u64>,
}

impl ProfileBuilder {
    /// A profile with the given `(type, unit)` sample types, in order.
    pub fn new(sample_types: &[(&str, &str)]) -> Self {
        let mut b = ProfileBuilder::default();
        b.intern("");
        for (t, u) in sample_types {
            let vt = ValueType {
                r#type: b.intern(t),
                unit: b.intern(u),
            };
            b.profile.sample_type.push(vt);
        }
        b
    }

    fn intern(&mut self, s: &str) -> i64 {
        if let Some(&i) = self.strings.get(s) {
            return i;
        }
        let i = self.profile.string_table.len() as i64;
        self.profile.string_table.push(s.to_owned());
        self.strings.insert(s.to_owned(), i);
        i
    }

    fn location_for(&mut self, function: &str) -> u64 {
        if let Some(&id) = self.functions.get(function) {
            return id;
        }
        let id = self.profile.function.len() as u64 + 1;
        let name = self.intern(function);
        let filename = self.intern("src/lib.rs");
        self.profile.function.push(Function {
            id,
            name,
            system_name: name,
            filename,
            start_line: 0,
        });
        self.profile.location.push(Location {
            id,
            line: vec![Line {
                function_id: id,
                line: 1,
                column: 0,
            }],
            ..Default::default()
        });
        self.functions.insert(function.to_owned(), id);
        id
    }

    /// Start time and duration (`time_nanos`, `duration_nanos`).
    pub fn time(mut self, time_nanos: i64, duration_nanos: i64) -> Self {
        self.profile.time_nanos = time_nanos;
        self.profile.duration_nanos = duration_nanos;
        self
    }

    /// Adds a sample; `stack` is innermost first, `labels` are string labels.
    pub fn sample(mut self, stack: &[&str], values: &[i64], labels: &[(&str, &str)]) -> Self {
        let location_id = stack.iter().map(|f| self.location_for(f)).collect();
        let label = labels
            .iter()
            .map(|(k, v)| Label {
                key: self.intern(k),
                str: self.intern(v),
                num: 0,
                num_unit: 0,
            })
            .collect();
        self.profile.sample.push(Sample {
            location_id,
            value: values.to_vec(),
            label,
        });
        self
    }

    pub fn build(self) -> Profile {
        self.profile
    }

    /// The profile encoded and gzip-compressed, as profilers write it.
    pub fn gzip(self) -> Vec<u8> {
        self.profile.encode_gzip()
    }
}

impl Profile {
    /// Encodes and gzip-compresses this profile.
    pub fn encode_gzip(&self) -> Vec<u8> {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        // Writing into a Vec cannot fail.
        let _ = std::io::Write::write_all(&mut gz, &self.encode_to_vec());
        gz.finish().unwrap_or_default()
    }
}

#[cfg(test)]
mod builder_tests {
    use super::*;

    #[test]
    fn builder_output_decodes() {
        let bytes = ProfileBuilder::new(&[("cpu-time", "nanoseconds"), ("cpu-samples", "count")])
            .time(1_000, 2_000)
            .sample(&["leaf", "main"], &[30, 3], &[("thread name", "main")])
            .sample(&["other", "main"], &[10, 1], &[])
            .gzip();
        let p = decode(&bytes).unwrap();
        assert_eq!(p.total("cpu-time"), Some(40));
        assert_eq!(p.stack_names(&p.sample[0]), vec!["leaf", "main"]);
        assert_eq!(p.label_str(&p.sample[0], "thread name"), Some("main"));
        assert_eq!(p.function.len(), 3);
    }
}
