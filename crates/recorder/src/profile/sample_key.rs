//! The sample-key index: one hash over a raw sample leads to the (stack, label set) it resolved
//! to last time, verified field by field against the tables.

use crate::strings::StringId;

use super::tables::{Location, Tables, NONE};
use super::{Frame, Label, LabelValue, Str};

/// A raw sample shape seen before, and what it resolved to.
#[derive(Clone, Copy)]
pub(super) struct KeyRec {
    pub(super) stack: u32,
    pub(super) labels: u32,
    /// Row in the aggregated table, or `NONE` until an untimestamped sample used this key.
    pub(super) agg: u32,
    /// The label set has an `end_timestamp_ns` label: fine untimestamped, an error with a
    /// timestamp (checked here because a key hit skips the label validation).
    pub(super) has_ts_label: bool,
}

/// Byte equality for the short strings of symbol names: the length check rejects most
/// mismatches before any byte is read. (A hand-rolled 16-byte-chunk loop measured slower than
/// the libc `memcmp` this calls.)
#[inline(always)]
fn bytes_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a == b
}

/// Two words standing for a literal string in the sample-key hash. Strings up to 32 bytes are
/// covered whole; longer ones by their length, 16 bytes at each end and 8 in the middle. The
/// hash merely picks candidates (equality is always verified in full), and hashing every byte of
/// 36 symbol strings per sample would cost about as much as the rest of the add.
#[inline]
fn lit_words(s: &str) -> (u64, u64) {
    let b = s.as_bytes();
    let n = b.len();
    let word = |i: usize| -> u64 {
        let mut w = [0u8; 8];
        w.copy_from_slice(&b[i..i + 8]);
        u64::from_le_bytes(w)
    };
    let (x, y) = if n > 16 {
        // Overlapping reads cover every byte up to 32; beyond, the middle word adds coverage.
        let mid = if n > 32 { word(n / 2 - 4) } else { 0 };
        (
            word(0) ^ word(8).rotate_left(23) ^ mid.rotate_left(47),
            word(n - 8) ^ word(n - 16).rotate_left(41),
        )
    } else if n >= 8 {
        (word(0), word(n - 8))
    } else {
        let mut w = [0u8; 8];
        w[..n].copy_from_slice(b);
        (u64::from_le_bytes(w), 0)
    };
    (x, y ^ ((n as u64) << 56))
}

/// Two words standing for a string; ids differ from literals by a tag bit, so a literal and an
/// id of the same text are two keys (that resolve to the same aggregated row).
#[inline]
fn str_words(s: Str<'_>) -> (u64, u64) {
    match s {
        Str::Lit(s) => lit_words(s),
        Str::Id(id) => (id.0 as u64, 1 << 63),
    }
}

/// foldhash's mixing step: the two halves of a 64x64-bit product, folded together.
#[inline(always)]
pub(super) fn folded_multiply(x: u64, y: u64) -> u64 {
    let full = (x as u128) * (y as u128);
    (full as u64) ^ ((full >> 64) as u64)
}

/// Arbitrary odd constants (digits of pi) keeping the multiplier away from zero.
pub(super) const K0: u64 = 0x243f_6a88_85a3_08d3;
pub(super) const K1: u64 = 0x1319_8a2e_0370_7344;
pub(super) const K2: u64 = 0xa409_3822_299f_31d0;

/// The sample-key hash: one folded multiply per frame (two words) and per label part, without
/// a general-purpose hasher's buffering. Runs on every add, so it is kept this lean.
#[inline]
pub(super) fn sample_key_hash(frames: &[Frame<'_>], labels: &[Label<'_>]) -> u64 {
    let mut acc = K0 ^ ((frames.len() as u64) << 32) ^ labels.len() as u64;
    let mut mix = |a: u64, b: u64| acc = folded_multiply(acc ^ a, b ^ K1);
    for f in frames {
        match *f {
            Frame::Address(a) => mix(a, 0),
            // Both ids fit one word, the line the other.
            Frame::Symbol {
                name: Str::Id(name),
                filename: Str::Id(filename),
                line,
            } => mix(
                ((name.0 as u64) << 32) | filename.0 as u64,
                line as u64 ^ K2,
            ),
            Frame::Symbol {
                name,
                filename,
                line,
            } => {
                let (a, b) = str_words(name);
                mix(a, b);
                let (a, b) = str_words(filename);
                mix(a ^ (line as u64).rotate_left(29), b);
            }
        }
    }
    for l in labels {
        let (a, b) = str_words(l.key);
        mix(a, b);
        match l.value {
            LabelValue::Num(n) => mix(n as u64, K2),
            LabelValue::Str(s) => {
                let (a, b) = str_words(s);
                mix(a, b ^ K0);
            }
        }
    }
    folded_multiply(acc, K2)
}

impl Tables {
    /// Local id of the storage string `id`, if cached.
    #[inline]
    pub(super) fn cached(&self, id: StringId) -> Option<u32> {
        if id == StringId::EMPTY {
            return Some(0);
        }
        match self.id_cache.get(id.0 as usize) {
            Some(&v) if v != 0 => Some(v - 1),
            _ => None,
        }
    }

    #[inline(always)]
    fn str_matches(&self, s: Str<'_>, local: u32) -> bool {
        match s {
            Str::Lit(s) => bytes_eq(self.strings.bytes_of(local), s.as_bytes()),
            Str::Id(id) => self.cached(id) == Some(local),
        }
    }

    /// Whether the raw sample is exactly what `key` resolved to.
    #[inline]
    pub(super) fn key_matches(
        &self,
        key: &KeyRec,
        frames: &[Frame<'_>],
        labels: &[Label<'_>],
    ) -> bool {
        let stack = self.stacks.get(key.stack);
        let set = self.label_sets.get(key.labels);
        if stack.len() != frames.len() || set.len() != labels.len() {
            return false;
        }
        for (f, &loc) in frames.iter().zip(stack) {
            let ok = match (f, self.locations.items[loc as usize]) {
                (Frame::Address(a), Location::Address(b)) => *a == b,
                (
                    Frame::Symbol {
                        name: Str::Id(n),
                        filename: Str::Id(fi),
                        line,
                    },
                    Location::Symbol { function, line: l },
                ) => {
                    let src = ((n.0 as u64) << 32) | fi.0 as u64;
                    *line == l
                        && (self.function_src.get(function as usize) == Some(&src) || {
                            let func = self.functions.items[function as usize];
                            self.str_matches(Str::Id(*n), func.name)
                                && self.str_matches(Str::Id(*fi), func.filename)
                        })
                }
                (
                    Frame::Symbol {
                        name,
                        filename,
                        line,
                    },
                    Location::Symbol { function, line: l },
                ) => {
                    let func = self.functions.items[function as usize];
                    *line == l
                        && self.str_matches(*name, func.name)
                        && self.str_matches(*filename, func.filename)
                }
                _ => false,
            };
            if !ok {
                return false;
            }
        }
        for (l, &lid) in labels.iter().zip(set) {
            let rec = self.labels.items[lid as usize];
            let ok = self.str_matches(l.key, rec.key)
                && match l.value {
                    LabelValue::Num(n) => rec.str == NONE && rec.num == n,
                    LabelValue::Str(s) => rec.str != NONE && self.str_matches(s, rec.str),
                };
            if !ok {
                return false;
            }
        }
        true
    }
}
