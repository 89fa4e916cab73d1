//! The profile-local tables pprof needs (strings, functions, locations, stacks, labels and
//! label sets), each deduplicated through an id index, and the [`Tables`] that hold them.

use std::collections::HashMap;

use crate::error::ProfileError;
use crate::sample_types::SampleType;

use super::aggregate::TimedRec;
use super::bulk::{addr_cache_slot, prefetch_past_end, ADDR_CACHE_BITS};
use super::cap::{bytes_after, vec_bytes_after, Dropped};
use super::sample_key::{folded_multiply, KeyRec, K0, K1, K2};
use super::{Str, END_TIMESTAMP_LABEL, LOCAL_ROOT_SPAN_ID_LABEL, TRACE_ENDPOINT_LABEL};

/// Fixed-seed foldhash: deterministic, and the data is the process's own (no flooding concern).
fn hasher() -> foldhash::fast::FoldHasher<'static> {
    use std::hash::BuildHasher;
    foldhash::fast::FixedState::with_seed(0x5eed_f0f0_cafe_d00d).build_hasher()
}

pub(super) const NONE: u32 = u32::MAX;
/// No storage ids recorded for a function (two ids never both reach `u32::MAX`).
pub(super) const NO_SOURCE: u64 = u64::MAX;

/// The storage ids of a frame whose name and filename are both ids, packed in one word.
#[inline(always)]
pub(super) fn id_pair(name: Str<'_>, filename: Str<'_>) -> Option<u64> {
    match (name, filename) {
        (Str::Id(n), Str::Id(f)) => Some(((n.0 as u64) << 32) | f.0 as u64),
        _ => None,
    }
}
const EMPTY_SLOT: u64 = u64::MAX;

/// An open-addressing index from a 64-bit hash to dense ids `0..len`. The caller keeps the
/// entries in its own vectors (indexed by id) and decides equality, so one structure serves
/// strings, functions, locations, stacks, label sets and sample keys without storing keys twice.
/// Each slot holds the hash's upper half next to the id, so most mismatches are rejected without
/// touching the entry.
#[derive(Default)]
pub(super) struct IdIndex {
    pub(super) slots: Vec<u64>,
    /// Full hash of every id, for rehashing on growth.
    pub(super) hashes: Vec<u64>,
}

impl IdIndex {
    pub(super) fn len(&self) -> usize {
        self.hashes.len()
    }

    #[inline]
    pub(super) fn find(&self, hash: u64, mut eq: impl FnMut(u32) -> bool) -> Option<u32> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.slots.len() - 1;
        let tag = hash >> 32;
        let mut i = hash as usize & mask;
        loop {
            let s = self.slots[i];
            if s == EMPTY_SLOT {
                return None;
            }
            if s >> 32 == tag && eq(s as u32) {
                return Some(s as u32);
            }
            i = (i + 1) & mask;
        }
    }

    /// Adds a new id (the next dense one) under `hash`; the caller checked it is absent.
    pub(super) fn insert(&mut self, hash: u64) -> u32 {
        if (self.len() + 1) * 2 > self.slots.len() {
            self.grow();
        }
        let id = self.len() as u32;
        self.hashes.push(hash);
        self.place(hash, id);
        id
    }

    fn place(&mut self, hash: u64, id: u32) {
        let mask = self.slots.len() - 1;
        let mut i = hash as usize & mask;
        while self.slots[i] != EMPTY_SLOT {
            i = (i + 1) & mask;
        }
        self.slots[i] = (hash & !0xffff_ffff) | id as u64;
    }

    fn grow(&mut self) {
        self.rebuild((self.slots.len() * 2).max(16));
    }

    /// Makes room for `additional` more ids without growing on the way.
    pub(super) fn reserve(&mut self, additional: usize) {
        let need = ((self.len() + additional) * 2).next_power_of_two().max(16);
        if need > self.slots.len() {
            self.rebuild(need);
        }
        self.hashes.reserve(additional);
    }

    fn rebuild(&mut self, n: usize) {
        self.slots = vec![EMPTY_SLOT; n];
        self.replace_all();
    }

    /// Places every id again, into slots just emptied.
    fn replace_all(&mut self) {
        for id in 0..self.hashes.len() {
            self.place(self.hashes[id], id as u32);
        }
    }

    /// Moves into the allocations of an index used before (`slots` and `hashes`, taken) when
    /// they are larger than this one's, so growing up to their size allocates nothing.
    pub(super) fn adopt(&mut self, slots: &mut Vec<u64>, hashes: &mut Vec<u64>) {
        adopt(&mut self.hashes, hashes);
        // Slot tables are powers of two long, so a longer one is a valid table size.
        if slots.len() > self.slots.len() {
            self.slots = std::mem::take(slots);
            self.slots.fill(EMPTY_SLOT);
            self.replace_all();
        }
        *slots = Vec::new();
    }

    pub(super) fn memory_bytes(&self) -> usize {
        (self.slots.capacity() + self.hashes.capacity()) * 8
    }

    /// [`IdIndex::memory_bytes`] after `add` more ids at most: slot tables are powers of two,
    /// at least twice as long as the ids they hold.
    pub(super) fn bytes_after(&self, add: usize) -> usize {
        let need = (self.len() + add).saturating_mul(2);
        let slots = if need > self.slots.len() {
            need.next_power_of_two().max(16)
        } else {
            self.slots.capacity()
        };
        slots * 8 + bytes_after(&self.hashes, add)
    }
}

/// Ids must stay below `NONE` and fit the index's 32-bit id half.
const MAX_TABLE_LEN: usize = (u32::MAX - 1) as usize;

/// The profile's own string table (becomes the pprof string table as is). Id 0 is "".
#[derive(Default)]
pub(super) struct LocalStrings {
    pub(super) bytes: String,
    pub(super) spans: Vec<(u32, u32)>,
    pub(super) index: IdIndex,
}

impl LocalStrings {
    fn new() -> Self {
        let mut s = LocalStrings::default();
        s.intern("");
        s
    }

    #[inline]
    pub(super) fn get(&self, id: u32) -> &str {
        let (off, len) = self.spans[id as usize];
        &self.bytes[off as usize..(off + len) as usize]
    }

    /// Bytes of `id`, without the char-boundary checks of slicing a `str`.
    #[inline(always)]
    pub(super) fn bytes_of(&self, id: u32) -> &[u8] {
        let (off, len) = self.spans[id as usize];
        &self.bytes.as_bytes()[off as usize..(off + len) as usize]
    }

    fn hash(s: &str) -> u64 {
        use std::hash::Hasher;
        let mut h = hasher();
        h.write(s.as_bytes());
        h.finish()
    }

    pub(super) fn find(&self, s: &str) -> Option<u32> {
        self.index.find(Self::hash(s), |id| self.get(id) == s)
    }

    pub(super) fn intern(&mut self, s: &str) -> u32 {
        let hash = Self::hash(s);
        if let Some(id) = self.index.find(hash, |id| {
            let (off, len) = self.spans[id as usize];
            &self.bytes[off as usize..(off + len) as usize] == s
        }) {
            return id;
        }
        let off = self.bytes.len() as u32;
        self.bytes.push_str(s);
        self.spans.push((off, s.len() as u32));
        self.index.insert(hash)
    }

    pub(super) fn len(&self) -> usize {
        self.spans.len()
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) struct Function {
    pub(super) name: u32,
    pub(super) filename: u32,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Location {
    Symbol { function: u32, line: i64 },
    Address(u64),
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) struct LabelRec {
    pub(super) key: u32,
    /// String value id, or `NONE` for a numeric label.
    pub(super) str: u32,
    pub(super) num: i64,
}

/// Slices of ids stored back to back (stacks of location ids, sets of label ids).
#[derive(Default)]
pub(super) struct SliceSet {
    pub(super) items: Vec<u32>,
    pub(super) spans: Vec<(u32, u32)>,
    pub(super) index: IdIndex,
}

impl SliceSet {
    #[inline]
    pub(super) fn get(&self, id: u32) -> &[u32] {
        let (off, len) = self.spans[id as usize];
        &self.items[off as usize..(off + len) as usize]
    }

    pub(super) fn intern(&mut self, ids: &[u32]) -> Result<u32, ProfileError> {
        self.catch_up_index();
        let hash = hash_ids(ids);
        let (items, spans) = (&self.items, &self.spans);
        if let Some(id) = self.index.find(hash, |id| {
            let (off, len) = spans[id as usize];
            &items[off as usize..(off + len) as usize] == ids
        }) {
            return Ok(id);
        }
        check_table_len(self.spans.len(), "slice")?;
        if self.items.len() + ids.len() > u32::MAX as usize {
            return Err(ProfileError::Encode(format!(
                "profile holds too many stack/label entries ({})",
                self.items.len()
            )));
        }
        let off = self.items.len() as u32;
        self.items.extend_from_slice(ids);
        self.spans.push((off, ids.len() as u32));
        Ok(self.index.insert(hash))
    }

    /// The id of an entry equal to `ids`, without changing anything (entries appended by
    /// [`SliceSet::push_unindexed`] and not indexed yet are compared one by one).
    pub(super) fn find(&self, ids: &[u32]) -> Option<u32> {
        let (items, spans) = (&self.items, &self.spans);
        let eq = |id: u32| {
            let (off, len) = spans[id as usize];
            &items[off as usize..(off + len) as usize] == ids
        };
        self.index
            .find(hash_ids(ids), eq)
            .or_else(|| (self.index.len() as u32..spans.len() as u32).find(|&id| eq(id)))
    }

    /// Entries appended and not indexed yet.
    pub(super) fn unindexed(&self) -> usize {
        self.spans.len() - self.index.len()
    }

    /// Most bytes the items hold after [`SliceSet::push_unindexed`] of `add` items.
    pub(super) fn items_bytes_after_push(&self, add: usize, eager: bool) -> usize {
        let (len, cap) = (self.items.len(), self.items.capacity());
        let plain = vec_bytes_after(len, cap, add, 4);
        if eager && cap - len < add && !self.spans.is_empty() {
            (len + self.eager_reserve(add)).max(2 * cap) * 4
        } else {
            plain
        }
    }

    /// Items [`SliceSet::push_unindexed`] reserves at once when `add` more do not fit: room for
    /// the entries reserved in `spans`, as deep as those so far.
    fn eager_reserve(&self, add: usize) -> usize {
        let mean = self.items.len().div_ceil(self.spans.len());
        let expected = mean * (self.spans.capacity() - self.spans.len());
        expected.max(add)
    }

    /// Appends `ids` as a new entry without looking it up or indexing it: the entry may equal an
    /// existing one. The index catches up on the next [`SliceSet::intern`]. `eager` reserves
    /// room for the entries expected (see [`SliceSet::eager_reserve`]) when the items are full.
    pub(super) fn push_unindexed(&mut self, ids: &[u32], eager: bool) -> Result<u32, ProfileError> {
        check_table_len(self.spans.len(), "slice")?;
        if self.items.len() + ids.len() > u32::MAX as usize {
            return Err(ProfileError::Encode(format!(
                "profile holds too many stack/label entries ({})",
                self.items.len()
            )));
        }
        if eager && self.items.capacity() - self.items.len() < ids.len() && !self.spans.is_empty() {
            // Growing by doubling would copy (and page-fault) the whole table again and again:
            // make room at once for the entries expected.
            self.items.reserve(self.eager_reserve(ids.len()));
        }
        let id = self.spans.len() as u32;
        let off = self.items.len() as u32;
        self.items.extend_from_slice(ids);
        self.spans.push((off, ids.len() as u32));
        prefetch_past_end(&self.items);
        prefetch_past_end(&self.spans);
        Ok(id)
    }

    /// Indexes the entries appended by [`SliceSet::push_unindexed`] since the last lookup, so a
    /// lookup sees every entry (a duplicate entry is indexed too; either one matches).
    #[inline]
    fn catch_up_index(&mut self) {
        let indexed = self.index.len();
        if indexed < self.spans.len() {
            self.index.reserve(self.spans.len() - indexed);
            for id in indexed..self.spans.len() {
                let hash = hash_ids(self.get(id as u32));
                self.index.insert(hash);
            }
        }
    }
}

/// A generic dedup table of small `Copy` records.
pub(super) struct Dedup<T> {
    pub(super) items: Vec<T>,
    pub(super) index: IdIndex,
}

impl<T> Default for Dedup<T> {
    fn default() -> Self {
        Dedup {
            items: Vec::new(),
            index: IdIndex::default(),
        }
    }
}

impl<T: Copy + PartialEq> Dedup<T> {
    pub(super) fn intern(&mut self, item: T, hash: u64, what: &str) -> Result<u32, ProfileError> {
        let items = &self.items;
        if let Some(id) = self.index.find(hash, |id| items[id as usize] == item) {
            return Ok(id);
        }
        check_table_len(self.items.len(), what)?;
        self.items.push(item);
        Ok(self.index.insert(hash))
    }

    pub(super) fn find(&self, item: T, hash: u64) -> Option<u32> {
        self.index.find(hash, |id| self.items[id as usize] == item)
    }
}

/// Moves `v`'s items into `spare`'s allocation when that one is larger (so `v` can grow that far
/// without allocating), and frees whatever allocation is left over in `spare`.
pub(super) fn adopt<T: Copy>(v: &mut Vec<T>, spare: &mut Vec<T>) {
    if spare.capacity() > v.capacity() {
        spare.clear();
        spare.extend_from_slice(v);
        std::mem::swap(v, spare);
    }
    *spare = Vec::new();
}

/// The emptied allocation of `v`, for [`adopt`] later.
pub(super) fn recycle<T>(v: &mut Vec<T>) -> Vec<T> {
    let mut v = std::mem::take(v);
    v.clear();
    v
}

pub(super) fn check_table_len(len: usize, what: &str) -> Result<(), ProfileError> {
    if len >= MAX_TABLE_LEN {
        return Err(ProfileError::Encode(format!(
            "profile holds the maximum number of {what} entries ({len})"
        )));
    }
    Ok(())
}

/// Hash of a slice of ids: one folded multiply per four ids (stacks are long, and a new stack is
/// hashed once per lookup). Equality is always verified, so this only spreads ids over slots.
fn hash_ids(ids: &[u32]) -> u64 {
    let pair = |c: &[u32]| ((c[0] as u64) << 32) | c[1] as u64;
    let mut acc = K0 ^ ids.len() as u64;
    let mut quads = ids.chunks_exact(4);
    for q in &mut quads {
        acc = folded_multiply(acc ^ pair(&q[..2]), pair(&q[2..]) ^ K1);
    }
    let rest = quads.remainder();
    if !rest.is_empty() {
        let mut w = [0u32; 4];
        w[..rest.len()].copy_from_slice(rest);
        acc = folded_multiply(acc ^ pair(&w[..2]), pair(&w[2..]) ^ K2);
    }
    folded_multiply(acc, K1)
}

pub(super) fn hash_function(f: Function) -> u64 {
    use std::hash::Hasher;
    let mut h = hasher();
    h.write_u64(((f.name as u64) << 32) | f.filename as u64);
    h.finish()
}

pub(super) fn hash_location(l: Location) -> u64 {
    use std::hash::Hasher;
    let mut h = hasher();
    match l {
        Location::Symbol { function, line } => {
            h.write_u32(function);
            h.write_u64(line as u64);
        }
        Location::Address(a) => {
            h.write_u32(NONE);
            h.write_u64(a);
        }
    }
    h.finish()
}

pub(super) fn hash_label(l: LabelRec) -> u64 {
    use std::hash::Hasher;
    let mut h = hasher();
    h.write_u64(((l.key as u64) << 32) | l.str as u64);
    h.write_u64(l.num as u64);
    h.finish()
}

pub(super) fn hash_pair(a: u32, b: u32) -> u64 {
    use std::hash::Hasher;
    let mut h = hasher();
    h.write_u64(((a as u64) << 32) | b as u64);
    h.finish()
}

/// Ids of the strings every profile carries, interned first in this order.
pub(super) struct Preset {
    pub(super) end_timestamp: u32,
    pub(super) trace_endpoint: u32,
    pub(super) local_root_span_id: u32,
    /// (type, unit) per sample type.
    pub(super) types: Vec<(u32, u32)>,
}

/// Everything `reset` throws away.
pub(super) struct Tables {
    pub(super) strings: LocalStrings,
    pub(super) functions: Dedup<Function>,
    pub(super) locations: Dedup<Location>,
    pub(super) stacks: SliceSet,
    pub(super) labels: Dedup<LabelRec>,
    pub(super) label_sets: SliceSet,
    pub(super) keys: Vec<KeyRec>,
    pub(super) key_index: IdIndex,
    /// (stack, label set) per aggregated row.
    pub(super) agg: Vec<(u32, u32)>,
    pub(super) agg_index: IdIndex,
    pub(super) agg_values: Vec<i64>,
    pub(super) timed: Vec<TimedRec>,
    pub(super) timed_values: Vec<i64>,
    /// Local root span id -> endpoint string id, for the roots samples of this profile carry.
    pub(super) endpoints: HashMap<u64, u32, foldhash::fast::RandomState>,
    /// The same for the last [`LATE_ENDPOINTS`](super::LATE_ENDPOINTS) roots named before any
    /// sample carried them (samples recorded a little after their request ended); oldest first
    /// in `late_order`.
    pub(super) late_endpoints: HashMap<u64, u32, foldhash::fast::RandomState>,
    pub(super) late_order: std::collections::VecDeque<u64>,
    pub(super) endpoint_counts: HashMap<String, i64, foldhash::fast::RandomState>,
    /// Storage id -> local string id + 1 (0: not cached). Valid for `cache_generation` only.
    pub(super) id_cache: Vec<u32>,
    /// Per function: the storage ids (name << 32 | filename) it was last resolved from in
    /// `cache_generation`, or `NO_SOURCE`. Lets a known stack of id frames be verified with one
    /// comparison per frame.
    pub(super) function_src: Vec<u64>,
    pub(super) cache_generation: u64,
    pub(super) preset: Preset,
    /// Reused by the slow path so it does not allocate per sample.
    pub(super) scratch: Vec<u32>,
    /// Direct-mapped address -> location id cache of
    /// [`Profile::push_stack_unindexed`](super::Profile::push_stack_unindexed) (empty until
    /// first used). Location ids never change while the tables live, so entries stay valid.
    pub(super) addr_cache: Vec<(u64, u32)>,
    pub(super) dropped: Dropped,
}

impl Tables {
    pub(super) fn new(types: &[SampleType], generation: u64) -> Tables {
        let mut strings = LocalStrings::new();
        let end_timestamp = strings.intern(END_TIMESTAMP_LABEL);
        let trace_endpoint = strings.intern(TRACE_ENDPOINT_LABEL);
        let local_root_span_id = strings.intern(LOCAL_ROOT_SPAN_ID_LABEL);
        let types = types
            .iter()
            .map(|t| (strings.intern(t.name()), strings.intern(t.unit())))
            .collect();
        Tables {
            strings,
            functions: Dedup::default(),
            locations: Dedup::default(),
            stacks: SliceSet::default(),
            labels: Dedup::default(),
            label_sets: SliceSet::default(),
            keys: Vec::new(),
            key_index: IdIndex::default(),
            agg: Vec::new(),
            agg_index: IdIndex::default(),
            agg_values: Vec::new(),
            timed: Vec::new(),
            timed_values: Vec::new(),
            endpoints: HashMap::default(),
            late_endpoints: HashMap::default(),
            late_order: std::collections::VecDeque::new(),
            endpoint_counts: HashMap::default(),
            id_cache: Vec::new(),
            function_src: Vec::new(),
            cache_generation: generation,
            preset: Preset {
                end_timestamp,
                trace_endpoint,
                local_root_span_id,
                types,
            },
            scratch: Vec::new(),
            addr_cache: Vec::new(),
            dropped: Dropped::new(),
        }
    }

    /// Location id of an address frame, through the address cache.
    #[inline]
    pub(super) fn address_location(&mut self, a: u64) -> Result<u32, ProfileError> {
        if self.addr_cache.is_empty() {
            self.addr_cache = vec![(0, NONE); 1 << ADDR_CACHE_BITS];
        }
        let slot = addr_cache_slot(a);
        let (cached, id) = self.addr_cache[slot];
        if cached == a && id != NONE {
            return Ok(id);
        }
        let loc = Location::Address(a);
        let id = self.locations.intern(loc, hash_location(loc), "location")?;
        self.addr_cache[slot] = (a, id);
        Ok(id)
    }
}
