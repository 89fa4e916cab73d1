//! Fuzz harness `pprof_roundtrip`: random samples (symbol and address frames, string and numeric
//! labels, timestamps, endpoints) go through ferroprof's own aggregation and streaming encoder
//! (any compression, with or without a symbolizer) and come back through the independent prost
//! decoder of `ferroprof-pprof`. The decoded profile must validate and hold the same sample
//! types, times, endpoint counts and, per (stack, labels), the same value sums.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use ferroprof_recorder::pprof::EncodeOptions;
use ferroprof_recorder::profile::{
    END_TIMESTAMP_LABEL, LOCAL_ROOT_SPAN_ID_LABEL, TRACE_ENDPOINT_LABEL,
};
use ferroprof_recorder::{
    Compression, Frame, Label, LabelValue, Profile, ResolvedFrame, Sample, SampleType, Str,
    Symbolizer,
};

use crate::input::Input;

const NAMES: [&str; 6] = ["", "main", "<T as core::Trait>::run", "ünï", "f", "g"];
const FILES: [&str; 3] = ["", "src/main.rs", "/rustc/library/core/src/ops.rs"];
const KEYS: [&str; 6] = [
    "thread name",
    "thread id",
    LOCAL_ROOT_SPAN_ID_LABEL,
    "",
    END_TIMESTAMP_LABEL,
    "span id",
];
const VALUES: [&str; 4] = ["", "worker-1", "main", "ü"];
const ENDPOINTS: [&str; 3] = ["GET /", "POST /checkout", ""];

/// One frame of a decoded stack: (function, filename, line, address).
type Line = (String, String, i64, u64);
/// One decoded label: (key, string value, numeric value); pprof cannot tell `""` from 0.
type Lbl = (String, String, i64);
type Key = (Vec<Line>, Vec<Lbl>);
/// An accepted sample: labels, expected stack, values, timestamp.
type Accepted = (Vec<Lbl>, Vec<Line>, Vec<i64>, i64);

struct Sym;

impl Symbolizer for Sym {
    fn symbolize(&mut self, address: u64, out: &mut Vec<ResolvedFrame>) {
        for k in 0..address % 3 {
            out.push(ResolvedFrame {
                name: format!("inl{}_{k}", address % 5),
                filename: "x.rs".into(),
                line: k as i64 + 1,
                ..Default::default()
            });
        }
    }
}

/// What the decoder should show for `frames`, innermost first.
fn expected_stack(frames: &[Frame<'_>], symbolize: bool) -> Vec<Line> {
    let mut out = Vec::new();
    for f in frames {
        match *f {
            Frame::Symbol {
                name: Str::Lit(n),
                filename: Str::Lit(file),
                line,
            } => out.push((n.to_owned(), file.to_owned(), line, 0)),
            Frame::Address(a) => {
                let mut resolved = Vec::new();
                if symbolize {
                    Sym.symbolize(a, &mut resolved);
                }
                if resolved.is_empty() {
                    out.push((format!("{a:#x}"), String::new(), 0, a));
                }
                out.extend(
                    resolved
                        .into_iter()
                        .map(|r| (r.name, r.filename, r.line, a)),
                );
            }
            Frame::Symbol { .. } => unreachable!("the harness only makes literal frames"),
        }
    }
    out
}

fn label(l: &Label<'_>) -> Lbl {
    let Str::Lit(key) = l.key else {
        unreachable!("literal keys only")
    };
    match l.value {
        LabelValue::Num(n) => (key.to_owned(), String::new(), n),
        LabelValue::Str(Str::Lit(s)) => (key.to_owned(), s.to_owned(), 0),
        LabelValue::Str(Str::Id(_)) => unreachable!("literal values only"),
    }
}

fn add(sums: &mut BTreeMap<Key, Vec<i128>>, key: Key, values: &[i64]) {
    let acc = sums.entry(key).or_insert_with(|| vec![0; values.len()]);
    for (a, v) in acc.iter_mut().zip(values) {
        *a += i128::from(*v);
    }
}

/// Runs one fuzz input; returns how many decoded samples were compared.
pub fn run(data: &[u8]) -> usize {
    let mut input = Input::new(data);
    let types: Vec<SampleType> = SampleType::ALL
        .into_iter()
        .filter(|_| input.bool())
        .collect();
    let start = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    let end = start + Duration::from_millis(u64::from(input.u16()));
    let compression = match input.u8() % 3 {
        0 => Compression::Gzip,
        1 => Compression::None,
        _ if Compression::Zstd.is_available() => Compression::Zstd,
        _ => Compression::Gzip,
    };
    let symbolize = input.bool();
    // Extreme values saturate inside the profile: then only validity is checked.
    let extreme = input.u8() == 0xff;

    let mut profile = Profile::new(&types, None, start);
    let mut accepted: Vec<Accepted> = Vec::new();
    let mut endpoints: BTreeMap<u64, &str> = BTreeMap::new();
    let mut endpoint_counts: BTreeMap<String, i64> = BTreeMap::new();

    for _ in 0..input.below(40) + 1 {
        if input.u8() % 8 == 0 {
            let span = u64::from(input.u8() % 4);
            let ep = ENDPOINTS[input.below(ENDPOINTS.len())];
            profile.set_endpoint(span, ep).expect("set_endpoint");
            endpoints.insert(span, ep);
            *endpoint_counts.entry(ep.to_owned()).or_default() += 1;
            continue;
        }
        let frames: Vec<Frame<'static>> = (0..input.below(7))
            .map(|_| {
                if input.u8() % 4 == 0 {
                    Frame::Address(u64::from(input.u8()) * 16)
                } else {
                    Frame::sym(
                        NAMES[input.below(NAMES.len())],
                        FILES[input.below(FILES.len())],
                        i64::from(input.u8() % 4),
                    )
                }
            })
            .collect();
        let labels: Vec<Label<'static>> = (0..input.below(3))
            .map(|_| {
                let key = KEYS[input.below(KEYS.len())];
                if input.bool() {
                    Label::num(key, i64::from(input.u8() % 4))
                } else {
                    Label::str(key, VALUES[input.below(VALUES.len())])
                }
            })
            .collect();
        let values: Vec<i64> = types
            .iter()
            .map(|_| {
                if extreme {
                    input.int()
                } else {
                    i64::from(input.u32() as i32)
                }
            })
            .collect();
        let ts = if input.u8() % 4 == 0 {
            1_700_000_000_000_000_000 + i64::from(input.u8())
        } else {
            0
        };
        let sample = Sample {
            frames: &frames,
            values: &values,
            labels: &labels,
            end_timestamp_ns: ts,
        };
        if crate::recorder_ops::clear(profile.add(&sample)).is_some() {
            accepted.push((
                labels.iter().map(label).collect(),
                expected_stack(&frames, symbolize),
                values,
                ts,
            ));
        }
    }

    let mut sym = Sym;
    let symbolizer: Option<&mut dyn Symbolizer> = if symbolize { Some(&mut sym) } else { None };
    let encoded = profile
        .encode(end, &EncodeOptions { compression }, symbolizer)
        .expect("encoding a valid profile");
    let decoded = ferroprof_pprof::decode(&encoded.bytes).expect("our own output decodes");

    let want_types: Vec<(String, String)> = types
        .iter()
        .map(|t| (t.name().to_owned(), t.unit().to_owned()))
        .collect();
    assert_eq!(decoded.sample_types(), want_types);
    assert_eq!(decoded.time_nanos, 1_700_000_000 * 1_000_000_000);
    assert_eq!(
        decoded.duration_nanos,
        end.duration_since(start).unwrap().as_nanos() as i64
    );
    let mut got_counts = encoded.endpoint_counts.clone();
    got_counts.sort();
    let want_counts: Vec<(String, i64)> = endpoint_counts.into_iter().collect();
    assert_eq!(got_counts, want_counts);
    if extreme {
        return 0;
    }

    let mut want: BTreeMap<Key, Vec<i128>> = BTreeMap::new();
    for (mut labels, stack, values, ts) in accepted {
        let span = labels
            .iter()
            .find(|l| l.0 == LOCAL_ROOT_SPAN_ID_LABEL && l.1.is_empty())
            .map(|l| l.2);
        if let Some(ep) = span.and_then(|s| endpoints.get(&(s as u64))) {
            labels.push((TRACE_ENDPOINT_LABEL.to_owned(), (*ep).to_owned(), 0));
        }
        if ts != 0 {
            labels.push((END_TIMESTAMP_LABEL.to_owned(), String::new(), ts));
        }
        labels.sort();
        add(&mut want, (stack, labels), &values);
    }
    let mut got: BTreeMap<Key, Vec<i128>> = BTreeMap::new();
    for s in &decoded.sample {
        let stack = decoded
            .stack(s)
            .into_iter()
            .map(|l| (l.function, l.filename, l.line, l.address))
            .collect();
        let mut labels: Vec<Lbl> = s
            .label
            .iter()
            .map(|l| {
                (
                    decoded.str(l.key).to_owned(),
                    decoded.str(l.str).to_owned(),
                    l.num,
                )
            })
            .collect();
        labels.sort();
        add(&mut got, (stack, labels), &s.value);
    }
    // A sample whose values are all zero carries no information; either side may drop it.
    want.retain(|_, v| v.iter().any(|x| *x != 0));
    got.retain(|_, v| v.iter().any(|x| *x != 0));
    assert_eq!(got, want, "decoded (stack, labels) -> values");
    decoded.sample.len()
}
