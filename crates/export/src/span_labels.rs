//! The span labels Grafana's span profiles read, added to a profile for the Pyroscope exporter.
//!
//! Pyroscope links a trace's span to profile samples through a `span_id` label holding the span
//! id as 16 lowercase hex digits, and names it with `span_name` (what the OpenTelemetry
//! integration of its Go client writes on the local root span of each trace). The profiler
//! writes the numeric `local root span id` (and `trace endpoint`) that Datadog reads, so this
//! module adds, to every sample with a `local root span id`, `span_id` = that id in hex and, when
//! the sample has a `trace endpoint`, `span_name` = the endpoint. The rest of the profile is
//! copied byte for byte: samples are messages, and fields appended to a message extend it; new
//! strings go at the end of the string table, so existing indexes keep their meaning.

use std::collections::HashMap;
use std::io::{Read, Write};

use ferroprof_recorder::profile::{LOCAL_ROOT_SPAN_ID_LABEL, TRACE_ENDPOINT_LABEL};
use ferroprof_recorder::Compression;

/// The label Pyroscope's span profiles select samples of a span by (16 hex digits).
pub const SPAN_ID: &str = "span_id";
/// The label naming the span (here: the trace's endpoint).
pub const SPAN_NAME: &str = "span_name";

// pprof field numbers.
const PROFILE_SAMPLE: u64 = 2;
const PROFILE_STRING_TABLE: u64 = 6;
const SAMPLE_LABEL: u64 = 3;
const LABEL_KEY: u64 = 1;
const LABEL_STR: u64 = 2;
const LABEL_NUM: u64 = 3;

const VARINT: u64 = 0;
const I64: u64 = 1;
const LEN: u64 = 2;
const I32: u64 = 5;

/// `bytes` (compressed as `compression` says) with the span labels added; `None` when there is
/// nothing to add (no sample has a `local root span id`) or the profile cannot be read (it is
/// then sent as it is).
pub fn add(bytes: &[u8], compression: Compression) -> Option<Vec<u8>> {
    let raw = match compression {
        Compression::None => std::borrow::Cow::Borrowed(bytes),
        Compression::Gzip => {
            let mut out = Vec::with_capacity(bytes.len() * 4);
            flate2::read::GzDecoder::new(bytes)
                .read_to_end(&mut out)
                .ok()?;
            std::borrow::Cow::Owned(out)
        }
        // Not ours to decode without the zstd feature's decoder: sent as it is.
        Compression::Zstd => return None,
    };
    let out = add_raw(&raw)?;
    match compression {
        Compression::None => Some(out),
        _ => {
            let mut e = flate2::write::GzEncoder::new(
                Vec::with_capacity(bytes.len() + bytes.len() / 4),
                flate2::Compression::default(),
            );
            e.write_all(&out).ok()?;
            e.finish().ok()
        }
    }
}

/// [`add`] on an uncompressed profile.
pub fn add_raw(profile: &[u8]) -> Option<Vec<u8>> {
    // The string table first: the label keys' indexes.
    let mut strings = 0i64;
    let (mut root_key, mut endpoint_key) = (None, None);
    for field in Fields(profile) {
        let (num, value) = field?;
        if num == PROFILE_STRING_TABLE {
            let Value::Len(s) = value else { return None };
            if s == LOCAL_ROOT_SPAN_ID_LABEL.as_bytes() {
                root_key = Some(strings);
            } else if s == TRACE_ENDPOINT_LABEL.as_bytes() {
                endpoint_key = Some(strings);
            }
            strings += 1;
        }
    }
    let root_key = root_key?;
    let (span_id_key, span_name_key) = (strings, strings + 1);
    let mut new_strings: Vec<String> = vec![SPAN_ID.into(), SPAN_NAME.into()];
    let mut hex_index: HashMap<u64, i64> = HashMap::new();

    let mut out = Vec::with_capacity(profile.len() + profile.len() / 8);
    let mut sample = Vec::new();
    let mut added = false;
    for field in Fields(profile) {
        let (num, value) = field?;
        let Value::Len(payload) = value else {
            copy_field(&mut out, num, value);
            continue;
        };
        if num != PROFILE_SAMPLE {
            copy_field(&mut out, num, value);
            continue;
        }
        let (mut root, mut endpoint) = (None, None);
        for f in Fields(payload) {
            let (n, v) = f?;
            if n != SAMPLE_LABEL {
                continue;
            }
            let Value::Len(label) = v else { return None };
            let (mut key, mut str_, mut num_) = (0i64, 0i64, 0i64);
            for lf in Fields(label) {
                match lf? {
                    (LABEL_KEY, Value::Varint(k)) => key = k as i64,
                    (LABEL_STR, Value::Varint(s)) => str_ = s as i64,
                    (LABEL_NUM, Value::Varint(x)) => num_ = x as i64,
                    _ => {}
                }
            }
            if key == root_key {
                root = Some(num_ as u64);
            } else if Some(key) == endpoint_key && str_ != 0 {
                endpoint = Some(str_);
            }
        }
        let Some(root) = root.filter(|&r| r != 0) else {
            copy_field(&mut out, num, value);
            continue;
        };
        let hex = *hex_index.entry(root).or_insert_with(|| {
            new_strings.push(format!("{root:016x}"));
            strings + new_strings.len() as i64 - 1
        });
        sample.clear();
        sample.extend_from_slice(payload);
        push_label(&mut sample, span_id_key, hex);
        if let Some(e) = endpoint {
            push_label(&mut sample, span_name_key, e);
        }
        put_key(&mut out, PROFILE_SAMPLE, LEN);
        put_varint(&mut out, sample.len() as u64);
        out.extend_from_slice(&sample);
        added = true;
    }
    if !added {
        return None;
    }
    for s in &new_strings {
        put_key(&mut out, PROFILE_STRING_TABLE, LEN);
        put_varint(&mut out, s.len() as u64);
        out.extend_from_slice(s.as_bytes());
    }
    Some(out)
}

fn push_label(out: &mut Vec<u8>, key: i64, str_: i64) {
    let mut label = Vec::with_capacity(8);
    put_key(&mut label, LABEL_KEY, VARINT);
    put_varint(&mut label, key as u64);
    put_key(&mut label, LABEL_STR, VARINT);
    put_varint(&mut label, str_ as u64);
    put_key(out, SAMPLE_LABEL, LEN);
    put_varint(out, label.len() as u64);
    out.extend_from_slice(&label);
}

#[derive(Clone, Copy)]
enum Value<'a> {
    Varint(u64),
    Fixed64(&'a [u8]),
    Len(&'a [u8]),
    Fixed32(&'a [u8]),
}

fn copy_field(out: &mut Vec<u8>, num: u64, value: Value<'_>) {
    match value {
        Value::Varint(v) => {
            put_key(out, num, VARINT);
            put_varint(out, v);
        }
        Value::Fixed64(b) => {
            put_key(out, num, I64);
            out.extend_from_slice(b);
        }
        Value::Len(b) => {
            put_key(out, num, LEN);
            put_varint(out, b.len() as u64);
            out.extend_from_slice(b);
        }
        Value::Fixed32(b) => {
            put_key(out, num, I32);
            out.extend_from_slice(b);
        }
    }
}

fn put_key(out: &mut Vec<u8>, num: u64, wire: u64) {
    put_varint(out, num << 3 | wire);
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn varint(b: &[u8]) -> Option<(u64, usize)> {
    let mut v = 0u64;
    for (i, &byte) in b.iter().enumerate().take(10) {
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte < 0x80 {
            return Some((v, i + 1));
        }
    }
    None
}

/// The fields of a message: `(field number, value)`, `None` at a malformed one.
struct Fields<'a>(&'a [u8]);

impl<'a> Iterator for Fields<'a> {
    type Item = Option<(u64, Value<'a>)>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.0.is_empty() {
            return None;
        }
        let parsed = (|| {
            let (key, n) = varint(self.0)?;
            let rest = &self.0[n..];
            let (value, used) = match key & 7 {
                VARINT => {
                    let (v, m) = varint(rest)?;
                    (Value::Varint(v), m)
                }
                I64 => (Value::Fixed64(rest.get(..8)?), 8),
                LEN => {
                    let (len, m) = varint(rest)?;
                    let end = m.checked_add(usize::try_from(len).ok()?)?;
                    (Value::Len(rest.get(m..end)?), end)
                }
                I32 => (Value::Fixed32(rest.get(..4)?), 4),
                _ => return None,
            };
            self.0 = &rest[used..];
            Some((key >> 3, value))
        })();
        if parsed.is_none() {
            self.0 = &[];
        }
        Some(parsed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_without_spans_are_left_alone() {
        let mut p = Vec::new();
        for s in ["", "cpu-time", "thread id"] {
            put_key(&mut p, PROFILE_STRING_TABLE, LEN);
            put_varint(&mut p, s.len() as u64);
            p.extend_from_slice(s.as_bytes());
        }
        assert!(add_raw(&p).is_none());
        assert!(add_raw(b"\xff\xff\xff").is_none());
    }

    #[test]
    fn samples_of_traces_get_span_id_in_hex_and_span_name() {
        use ferroprof_recorder::pprof::EncodeOptions;
        use ferroprof_recorder::{Frame, Label, Profile, Sample, SampleType};
        let t0 = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000);
        let mut p = Profile::new(&[SampleType::CpuTime], None, t0);
        let push = |p: &mut Profile, f: &str, v: i64, labels: &[Label<'_>]| {
            let frames = [Frame::sym(f, "x.rs", 1)];
            p.add(&Sample {
                frames: &frames,
                values: &[v],
                labels,
                end_timestamp_ns: 0,
            })
            .unwrap();
        };
        // A trace with an endpoint, one without, a sample outside any.
        let big = 0xfedc_ba98_7654_3210u64;
        push(
            &mut p,
            "a",
            10,
            &[Label::num(LOCAL_ROOT_SPAN_ID_LABEL, big as i64)],
        );
        push(&mut p, "b", 20, &[Label::num(LOCAL_ROOT_SPAN_ID_LABEL, 7)]);
        push(&mut p, "c", 30, &[Label::str("thread name", "main")]);
        p.set_endpoint(big, "GET /users").unwrap();
        for compression in [Compression::None, Compression::Gzip] {
            let enc = p.encode(t0, &EncodeOptions { compression }, None).unwrap();
            let out = add(&enc.bytes, compression).expect("labels added");
            let before = ferroprof_pprof::decode(&enc.bytes).unwrap();
            let after = ferroprof_pprof::decode(&out).unwrap();
            assert_eq!(after.sample.len(), 3);
            for (s0, s) in before.sample.iter().zip(&after.sample) {
                assert_eq!(s0.value, s.value);
                assert_eq!(before.stack_names(s0), after.stack_names(s));
                let span_id = after.label_str(s, SPAN_ID);
                let span_name = after.label_str(s, SPAN_NAME);
                match after.stack_names(s)[0].as_str() {
                    "a" => {
                        assert_eq!(span_id, Some("fedcba9876543210"));
                        assert_eq!(span_name, Some("GET /users"));
                        assert_eq!(after.label_str(s, "trace endpoint"), Some("GET /users"));
                    }
                    "b" => {
                        assert_eq!(span_id, Some("0000000000000007"));
                        assert_eq!(span_name, None);
                    }
                    _ => {
                        assert_eq!((span_id, span_name), (None, None));
                        assert_eq!(after.label_str(s, "thread name"), Some("main"));
                    }
                }
            }
        }
    }
}
