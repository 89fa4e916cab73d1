//! How much memory a `profile.proto` message will take once decoded, from its wire bytes and
//! before decoding: an empty repeated message is two bytes on the wire but a whole struct in
//! memory (an empty `Sample` is 72 bytes), so a size cap on the bytes alone still lets a small
//! file ask for tens of times its size.
//!
//! The walk follows the wire format only (no allocation, no recursion past the schema's depth
//! plus groups, which are bounded like prost bounds them). Malformed input ends the walk with
//! the estimate so far: the decoder then rejects it without allocating past what was counted.

use std::mem::size_of;

use crate::{Function, Label, Line, Location, Mapping, Profile, Sample, ValueType};

/// The message types whose fields the estimate looks into.
#[derive(Clone, Copy)]
enum Kind {
    Profile,
    Sample,
    Location,
    /// ValueType, Mapping, Function, Label, Line: scalars only, nothing on the heap.
    Leaf,
}

/// What one occurrence of a field costs once decoded, for the fields that allocate.
enum Field {
    /// An element of a `Vec` of messages, which are walked in turn.
    Message(usize, Kind),
    /// An element of a `Vec<String>`: the `String` and its bytes.
    String,
    /// Elements of a `Vec` of 64-bit scalars, packed (one per varint) or not.
    Scalars,
}

fn field(kind: Kind, number: u64) -> Option<Field> {
    use Field::*;
    match (kind, number) {
        (Kind::Profile, 1) => Some(Message(size_of::<ValueType>(), Kind::Leaf)),
        (Kind::Profile, 2) => Some(Message(size_of::<Sample>(), Kind::Sample)),
        (Kind::Profile, 3) => Some(Message(size_of::<Mapping>(), Kind::Leaf)),
        (Kind::Profile, 4) => Some(Message(size_of::<Location>(), Kind::Location)),
        (Kind::Profile, 5) => Some(Message(size_of::<Function>(), Kind::Leaf)),
        (Kind::Profile, 6) => Some(String),
        (Kind::Profile, 13) | (Kind::Sample, 1 | 2) => Some(Scalars),
        (Kind::Sample, 3) => Some(Message(size_of::<Label>(), Kind::Leaf)),
        (Kind::Location, 4) => Some(Message(size_of::<Line>(), Kind::Leaf)),
        _ => None,
    }
}

/// Bytes the decoded [`Profile`] will hold on the heap (plus its own struct), estimated from
/// `raw`, its encoded form. The walk ends as soon as the sum passes `stop`, so refusing a
/// hostile input costs a walk over about `stop` bytes' worth of it, not all of it.
pub(crate) fn decoded_size(raw: &[u8], stop: u64) -> u64 {
    let mut total = size_of::<Profile>() as u64;
    walk(raw, Kind::Profile, &mut total, stop);
    total
}

/// Nesting allowed for groups (deprecated, skipped as unknown fields), as deep as prost allows.
const MAX_DEPTH: u32 = 100;

fn walk(mut buf: &[u8], kind: Kind, total: &mut u64, stop: u64) {
    while !buf.is_empty() && *total <= stop {
        let Some(key) = varint(&mut buf) else { return };
        let (number, wire) = (key >> 3, key & 7);
        let known = field(kind, number);
        let scalar = matches!(known, Some(Field::Scalars));
        let ok = match wire {
            0 => varint(&mut buf).is_some(),
            1 => skip(&mut buf, 8),
            5 => skip(&mut buf, 4),
            2 => {
                let Some(len) = varint(&mut buf) else { return };
                let Some(body) = usize::try_from(len).ok().and_then(|l| buf.get(..l)) else {
                    return;
                };
                buf = &buf[body.len()..];
                match known {
                    Some(Field::Message(size, inner)) => {
                        *total += size as u64;
                        walk(body, inner, total, stop);
                    }
                    Some(Field::String) => *total += (size_of::<String>() + body.len()) as u64,
                    // Packed: one element per varint, i.e. per byte without its high bit.
                    Some(Field::Scalars) => {
                        let n = body.iter().filter(|b| **b & 0x80 == 0).count();
                        *total += (n * 8) as u64;
                    }
                    None => {}
                }
                true
            }
            3 => skip_group(&mut buf, number, 1),
            _ => false,
        };
        if !ok {
            return;
        }
        // An unpacked element of a repeated scalar.
        if scalar && wire != 2 {
            *total += 8;
        }
    }
}

fn varint(buf: &mut &[u8]) -> Option<u64> {
    let mut v = 0u64;
    for (i, &b) in buf.iter().enumerate().take(10) {
        v |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            *buf = &buf[i + 1..];
            return Some(v);
        }
    }
    None
}

fn skip(buf: &mut &[u8], n: usize) -> bool {
    match buf.get(n..) {
        Some(rest) => {
            *buf = rest;
            true
        }
        None => false,
    }
}

/// Skips to the end of the group `number` began; nothing inside it is decoded.
fn skip_group(buf: &mut &[u8], number: u64, depth: u32) -> bool {
    if depth > MAX_DEPTH {
        return false;
    }
    loop {
        let Some(key) = varint(buf) else { return false };
        let ok = match key & 7 {
            0 => varint(buf).is_some(),
            1 => skip(buf, 8),
            5 => skip(buf, 4),
            2 => match varint(buf).and_then(|l| usize::try_from(l).ok()) {
                Some(len) => skip(buf, len),
                None => false,
            },
            3 => skip_group(buf, key >> 3, depth + 1),
            4 => return key >> 3 == number,
            _ => false,
        };
        if !ok {
            return false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[test]
    fn counts_what_decoding_allocates() {
        let p = crate::ProfileBuilder::new(&[("cpu-time", "nanoseconds")])
            .sample(&["f", "main"], &[1], &[("thread", "main")])
            .sample(&["g", "main"], &[2], &[])
            .build();
        let strings: usize = p.string_table.iter().map(|s| 24 + s.len()).sum();
        let want = size_of::<Profile>()
            + size_of::<ValueType>()
            + 2 * size_of::<Sample>()
            + 3 * 8 * 2 // two samples: two location ids and one value each
            + size_of::<Label>()
            + 3 * (size_of::<Location>() + size_of::<Line>() + size_of::<Function>())
            + strings;
        assert_eq!(decoded_size(&p.encode_to_vec(), u64::MAX), want as u64);
    }

    #[test]
    fn empty_messages_count_as_whole_structs() {
        // 1000 empty samples: 2000 bytes on the wire, 72 kB decoded.
        let raw = [0x12u8, 0x00].repeat(1000);
        let n = decoded_size(&raw, u64::MAX);
        assert_eq!(
            n,
            (size_of::<Profile>() + 1000 * size_of::<Sample>()) as u64
        );
        assert_eq!(Profile::decode(raw.as_slice()).unwrap().sample.len(), 1000);
        // With a stop, the walk ends just past it.
        let stop = 10 * size_of::<Sample>() as u64;
        let n = decoded_size(&raw, stop);
        assert!(n > stop && n <= stop + size_of::<Sample>() as u64, "{n}");
    }

    #[test]
    fn unpacked_scalars_and_groups() {
        // Sample { location_id: 1, location_id: 2 } unpacked, then an unknown group 15 holding
        // what would be a sample, then field 13 (comment) unpacked.
        let raw = [
            0x12, 0x04, 0x08, 0x01, 0x08, 0x02, // sample
            0x7b, 0x12, 0x00, 0x7c, // group 15 { sample {} }
            0x68, 0x05, // comment: 5
        ];
        let n = decoded_size(&raw, u64::MAX);
        assert_eq!(
            n,
            (size_of::<Profile>() + size_of::<Sample>() + 16 + 8) as u64
        );
        let p = Profile::decode(&raw[..]).unwrap();
        assert_eq!((p.sample.len(), p.comment.len()), (1, 1));
        // Malformed: the estimate stops, decoding fails.
        assert!(decoded_size(&[0x12, 0x7f], u64::MAX) >= size_of::<Profile>() as u64);
        assert!(Profile::decode(&[0x12u8, 0x7f][..]).is_err());
    }
}
