//! A unit's DWARF digested for looking addresses up: its line table as disjoint address
//! ranges, and its subprograms' code ranges. A pass that finds a unit's digest in the disk
//! cache resolves the unit's addresses with a binary search each, then reads the entries of the
//! subprograms hit (their inlined calls and names) instead of walking the whole unit.
//!
//! A digest answers exactly what the forward walk (`dwarf_walk`) answers: the line range
//! assigned first wins where a unit's sequences overlap, and subprograms' ranges are kept in the
//! walk's order (entry order, then range order), the first holding an address owning it and
//! the later ones its aliases.
//!
//! Layout (little-endian): `u32` segment count, `u32` range count, the segments
//! (`from`, `to`, `file`: u64; `line`: u32), then the ranges sorted by start (`begin`, `end`,
//! `reach` (the largest `end` of this range and all before it), `entry` (the subprogram's unit
//! offset): u64; `ordinal` (among the unit's subprograms), `order` (in the walk): u32).
//!
//! A file of digests (`DIR/<build id>.units`, see `disk_cache`) holds after its header one
//! record per digest: the unit's offset, the digest's length and a check (u64 each), then the
//! digest. A pass appends the digests it made; a file that does not read whole to its end
//! (a writer killed mid-record) is rewritten with what does. Anything malformed reads as "no
//! digest".

use std::cmp::Reverse;
use std::collections::BinaryHeap;

const SEG: usize = 28;
const RANGE: usize = 40;

/// A line-table range: [from, to) has the row (file, line).
pub(crate) type Segment = (u64, u64, u64, u32);
/// A subprogram's code range [begin, end), its entry's unit offset and its ordinal.
pub(crate) type SubRange = (u64, u64, u64, u32);

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// The digest of a unit whose line program assigned `segments` in this order and whose
/// subprograms have `ranges` in the walk's order. `None` when too large for its counts.
pub(crate) fn encode(segments: &[Segment], ranges: &[SubRange]) -> Option<Vec<u8>> {
    let segs = first_wins(segments);
    let nseg = u32::try_from(segs.len()).ok()?;
    let nrange = u32::try_from(ranges.len()).ok()?;
    let mut out = Vec::with_capacity(8 + segs.len() * SEG + ranges.len() * RANGE);
    out.extend_from_slice(&nseg.to_le_bytes());
    out.extend_from_slice(&nrange.to_le_bytes());
    for (from, to, file, line) in segs {
        out.extend_from_slice(&from.to_le_bytes());
        out.extend_from_slice(&to.to_le_bytes());
        out.extend_from_slice(&file.to_le_bytes());
        out.extend_from_slice(&line.to_le_bytes());
    }
    let mut sorted: Vec<(usize, &SubRange)> = ranges.iter().enumerate().collect();
    sorted.sort_by_key(|(order, r)| (r.0, *order));
    let mut reach = 0u64;
    for (order, &(begin, end, entry, ordinal)) in sorted {
        reach = reach.max(end);
        for v in [begin, end, reach, entry] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out.extend_from_slice(&ordinal.to_le_bytes());
        out.extend_from_slice(&u32::try_from(order).ok()?.to_le_bytes());
    }
    Some(out)
}

/// `segments` made disjoint, sorted by start: every address keeps the first segment (in the
/// given order) holding it; adjacent pieces of one segment are merged.
fn first_wins(segments: &[Segment]) -> Vec<Segment> {
    let mut by_start: Vec<usize> = (0..segments.len())
        .filter(|&i| segments[i].0 < segments[i].1)
        .collect();
    by_start.sort_by_key(|&i| (segments[i].0, i));
    let mut points: Vec<u64> = by_start
        .iter()
        .flat_map(|&i| [segments[i].0, segments[i].1])
        .collect();
    points.sort_unstable();
    points.dedup();
    // Open segments by their order (the first assigned on top), with their ends.
    let mut open: BinaryHeap<Reverse<(usize, u64)>> = BinaryHeap::new();
    let mut next = 0;
    let mut out: Vec<(Segment, usize)> = Vec::new();
    for w in points.windows(2) {
        let (x, y) = (w[0], w[1]);
        while next < by_start.len() && segments[by_start[next]].0 <= x {
            let i = by_start[next];
            open.push(Reverse((i, segments[i].1)));
            next += 1;
        }
        while open.peek().is_some_and(|Reverse((_, to))| *to <= x) {
            open.pop();
        }
        // Ends of segments under the top stay in the heap until they surface: a segment
        // below the top that ended is popped once it is on top.
        let Some(&Reverse((i, _))) = open.peek() else {
            continue;
        };
        let (_, _, file, line) = segments[i];
        match out.last_mut() {
            Some(((_, to, _, _), j)) if *j == i && *to == x => *to = y,
            _ => out.push(((x, y, file, line), i)),
        }
    }
    out.into_iter().map(|(s, _)| s).collect()
}

/// How many of the fixed-size `records` (each starting with its start address, sorted by it)
/// start at or below `p`.
fn starting_at_or_below(records: &[u8], size: usize, p: u64) -> usize {
    let (mut lo, mut hi) = (0, records.len() / size);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if u64_at(records, mid * size).is_some_and(|start| start <= p) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

/// A digest read from bytes.
#[derive(Clone, Copy)]
pub(crate) struct Digest<'a> {
    segs: &'a [u8],
    ranges: &'a [u8],
}

impl<'a> Digest<'a> {
    pub(crate) fn parse(b: &'a [u8]) -> Option<Digest<'a>> {
        let nseg = u32_at(b, 0)? as usize;
        let nrange = u32_at(b, 4)? as usize;
        let seg_end = 8usize.checked_add(nseg.checked_mul(SEG)?)?;
        let end = seg_end.checked_add(nrange.checked_mul(RANGE)?)?;
        (end == b.len()).then(|| Digest {
            segs: &b[8..seg_end],
            ranges: &b[seg_end..end],
        })
    }

    fn seg(&self, i: usize) -> Option<Segment> {
        let at = i * SEG;
        Some((
            u64_at(self.segs, at)?,
            u64_at(self.segs, at + 8)?,
            u64_at(self.segs, at + 16)?,
            u32_at(self.segs, at + 24)?,
        ))
    }

    /// The line-table row (file, line) in force at `p`.
    pub(crate) fn row(&self, p: u64) -> Option<(u64, u32)> {
        let below = starting_at_or_below(self.segs, SEG, p);
        let (_, to, file, line) = self.seg(below.checked_sub(1)?)?;
        (p < to).then_some((file, line))
    }

    fn range(&self, i: usize) -> Option<(u64, u64, u64, u64, u32, u32)> {
        let at = i * RANGE;
        Some((
            u64_at(self.ranges, at)?,
            u64_at(self.ranges, at + 8)?,
            u64_at(self.ranges, at + 16)?,
            u64_at(self.ranges, at + 24)?,
            u32_at(self.ranges, at + 32)?,
            u32_at(self.ranges, at + 36)?,
        ))
    }

    /// The subprogram ranges holding `p`, in the walk's order: (order in the walk, range
    /// start, entry offset, ordinal) each, in `out` (cleared first).
    pub(crate) fn subprograms_at(&self, p: u64, out: &mut Vec<(u32, u64, u64, u32)>) {
        out.clear();
        let lo = starting_at_or_below(self.ranges, RANGE, p);
        // Back from the last range starting at or below p, while one so far may reach it.
        for i in (0..lo).rev() {
            let Some((begin, end, reach, entry, ordinal, order)) = self.range(i) else {
                return;
            };
            if reach <= p {
                break;
            }
            if p < end {
                out.push((order, begin, entry, ordinal));
            }
        }
        out.sort_unstable_by_key(|r| r.0);
    }
}

/// Before each digest in a file: the unit's offset, the digest's length, and a check of both
/// and of the digest's first and last bytes (a record cut short, or followed by another
/// writer's, does not pass).
const RECORD_HEAD: usize = 24;
/// Bytes of each end of a digest in its record's check.
const CHECKED_ENDS: usize = 64;

fn check(offset: u64, body: &[u8]) -> u64 {
    let head = &body[..body.len().min(CHECKED_ENDS)];
    let tail = &body[body.len().saturating_sub(CHECKED_ENDS)..];
    let mut h = 0x9e37_79b9_7f4a_7c15u64 ^ offset;
    for &b in [&(body.len() as u64).to_le_bytes()[..], head, tail]
        .concat()
        .iter()
    {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// A file of digests, by unit offset: records appended one after another, the first record of
/// a unit being its digest.
pub(crate) struct Units<'a> {
    /// (unit offset, the digest's bytes), sorted by offset, one per unit.
    index: Vec<(u64, &'a [u8])>,
    /// Every record was read whole, up to the end: new ones can be appended.
    pub(crate) clean: bool,
}

impl<'a> Units<'a> {
    /// Reads the records after a cache file's header, up to the first one that does not read
    /// whole.
    pub(crate) fn parse(b: &'a [u8]) -> Units<'a> {
        let mut index = Vec::new();
        let mut at = 0;
        let clean = loop {
            if at == b.len() {
                break true;
            }
            let (Some(offset), Some(len), Some(sum)) =
                (u64_at(b, at), u64_at(b, at + 8), u64_at(b, at + 16))
            else {
                break false;
            };
            let start = at + RECORD_HEAD;
            let Some(body) = usize::try_from(len)
                .ok()
                .and_then(|len| b.get(start..start.checked_add(len)?))
            else {
                break false;
            };
            if check(offset, body) != sum {
                break false;
            }
            index.push((offset, body));
            at = start + body.len();
        };
        // Of records of one unit, the first (a stable sort keeps their order).
        index.sort_by_key(|e| e.0);
        index.dedup_by_key(|e| e.0);
        Units { index, clean }
    }

    /// How many units have a digest.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }

    /// The digest of the unit at `offset`.
    pub(crate) fn get(&self, offset: usize) -> Option<Digest<'a>> {
        let i = self
            .index
            .binary_search_by_key(&(offset as u64), |e| e.0)
            .ok()?;
        Digest::parse(self.index[i].1)
    }

    /// The records of `digests` (unit offset, digest), to append to a file.
    pub(crate) fn records(digests: &[(usize, Vec<u8>)]) -> Vec<u8> {
        let mut out = Vec::new();
        for (offset, d) in digests {
            let offset = *offset as u64;
            out.extend_from_slice(&offset.to_le_bytes());
            out.extend_from_slice(&(d.len() as u64).to_le_bytes());
            out.extend_from_slice(&check(offset, d).to_le_bytes());
            out.extend_from_slice(d);
        }
        out
    }

    /// The records of a file holding what `self` read and `digests`.
    pub(crate) fn rewritten(&self, digests: &[(usize, Vec<u8>)]) -> Vec<u8> {
        let old: Vec<(usize, Vec<u8>)> = self
            .index
            .iter()
            .map(|&(o, d)| (o as usize, d.to_vec()))
            .collect();
        let mut out = Units::records(&old);
        out.extend(Units::records(digests));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_segment_assigned_wins_where_sequences_overlap() {
        // Two sequences: the second overlaps the first's second row and runs beyond it.
        let segs = [
            (0x100, 0x110, 1, 10),
            (0x110, 0x120, 1, 11),
            (0x118, 0x130, 2, 20),
            (0x90, 0x100, 3, 30),
            (0x200, 0x200, 4, 40), // empty: never holds anything
        ];
        let d = encode(&segs, &[]).unwrap();
        let d = Digest::parse(&d).unwrap();
        assert_eq!(d.row(0x8f), None);
        assert_eq!(d.row(0x90), Some((3, 30)));
        assert_eq!(d.row(0x10f), Some((1, 10)));
        assert_eq!(d.row(0x118), Some((1, 11)));
        assert_eq!(d.row(0x11f), Some((1, 11)));
        assert_eq!(d.row(0x120), Some((2, 20)));
        assert_eq!(d.row(0x12f), Some((2, 20)));
        assert_eq!(d.row(0x130), None);
        assert_eq!(d.row(0x200), None);
        // A later segment covering an earlier one whole adds only what lies outside it.
        let segs = [(0x10, 0x20, 1, 1), (0x0, 0x40, 2, 2)];
        let d = encode(&segs, &[]).unwrap();
        let d = Digest::parse(&d).unwrap();
        assert_eq!(
            [0x0, 0xf, 0x10, 0x1f, 0x20, 0x3f, 0x40].map(|p| d.row(p)),
            [
                Some((2, 2)),
                Some((2, 2)),
                Some((1, 1)),
                Some((1, 1)),
                Some((2, 2)),
                Some((2, 2)),
                None
            ]
        );
    }

    #[test]
    fn subprogram_ranges_come_back_in_walk_order() {
        let ranges = [
            (0x100, 0x200, 10, 0), // a function
            (0x0, 0x20, 20, 1),    // a tombstoned one
            (0x150, 0x160, 30, 2), // an alias of part of the first
            (0x180, 0x1a0, 30, 2), // its second range
            (0x300, 0x400, 40, 3),
        ];
        let d = encode(&[], &ranges).unwrap();
        let d = Digest::parse(&d).unwrap();
        let mut out = Vec::new();
        d.subprograms_at(0x155, &mut out);
        assert_eq!(out, vec![(0, 0x100, 10, 0), (2, 0x150, 30, 2)]);
        d.subprograms_at(0x190, &mut out);
        assert_eq!(out, vec![(0, 0x100, 10, 0), (3, 0x180, 30, 2)]);
        d.subprograms_at(0x10, &mut out);
        assert_eq!(out, vec![(1, 0x0, 20, 1)]);
        d.subprograms_at(0x250, &mut out);
        assert!(out.is_empty());
        d.subprograms_at(0x3ff, &mut out);
        assert_eq!(out, vec![(4, 0x300, 40, 3)]);
    }

    #[test]
    fn a_file_of_digests_appends_and_stops_at_a_torn_record() {
        let a = encode(&[(0, 4, 1, 1)], &[]).unwrap();
        let b = encode(&[(8, 12, 2, 2)], &[]).unwrap();
        let b2 = encode(&[(8, 16, 3, 3)], &[]).unwrap();
        let mut file = Units::records(&[(200, b.clone()), (100, a.clone())]);
        let u = Units::parse(&file);
        assert!(u.clean);
        assert_eq!(u.get(100).unwrap().row(2), Some((1, 1)));
        assert_eq!(u.get(200).unwrap().row(9), Some((2, 2)));
        assert!(u.get(150).is_none());
        // Appended: a later record of a unit does not replace the first.
        file.extend(Units::records(&[(200, b2.clone()), (300, a.clone())]));
        let u = Units::parse(&file);
        assert!(u.clean);
        assert_eq!(u.get(200).unwrap().row(14), None);
        assert_eq!(u.get(300).unwrap().row(2), Some((1, 1)));
        // Cut anywhere: what comes before the cut reads, the rest does not, nothing panics.
        let mut ends = vec![0];
        for r in [(200, &b), (100, &a), (200, &b2), (300, &a)] {
            let len = Units::records(&[(r.0, r.1.clone())]).len();
            ends.push(ends.last().unwrap() + len);
        }
        for cut in 0..=file.len() {
            let u = Units::parse(&file[..cut]);
            assert_eq!(u.clean, ends.contains(&cut), "cut at {cut}");
            assert_eq!(u.get(100).is_some(), cut >= ends[2]);
        }
        // A record cut short and followed by another writer's: neither is read, nor anything
        // after; a rewrite keeps what did read.
        let mut torn = Units::records(&[(100, a.clone())]);
        let second = Units::records(&[(200, b.clone())]);
        torn.extend_from_slice(&second[..second.len() - 5]);
        torn.extend(Units::records(&[(300, b2.clone())]));
        let u = Units::parse(&torn);
        assert!(!u.clean);
        assert!(u.get(100).is_some() && u.get(200).is_none() && u.get(300).is_none());
        let fixed = u.rewritten(&[(400, b.clone())]);
        let u = Units::parse(&fixed);
        assert!(u.clean && u.get(100).is_some() && u.get(400).is_some());
        assert!(Digest::parse(&a[..a.len() - 1]).is_none());
    }
}
