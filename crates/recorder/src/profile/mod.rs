//! Aggregation of samples into one profile, ready for pprof encoding.
//!
//! Samples without a timestamp aggregate by (stack, label set): values add up. Timestamped
//! samples are kept one by one and carry an `end_timestamp_ns` numeric label when encoded.
//! `set_endpoint` attaches a `trace endpoint` label at encoding time to every sample whose numeric
//! `local root span id` label matches, including samples recorded before the call.
//!
//! ## How `add` stays cheap for a stack seen before
//! Strings, functions, locations, stacks and label sets are deduplicated into tables local to the
//! profile (what pprof needs anyway). In front of them sits a *sample-key index*: one hash over
//! the raw sample (every frame and label as given) leads to the (stack, label set) it resolved to
//! last time. A hit is verified against the stored tables, field by field, so a hash collision
//! can never merge two different samples; a verified hit costs no table lookup, no allocation and
//! no [`StringStorage`] lock. Interned ids are mapped to the profile's own string ids through a
//! per-profile cache that is dropped whenever the storage's generation moves (ids may be reused
//! after a generation advance).
//!
//! ## The memory cap
//! [`Profile::set_max_bytes`] bounds the tables. Only paths that add entries check it (the slow
//! path of a new key, a new row or timestamped sample that needs a table to grow, the bulk
//! path's new stacks and rows), by an upper bound of the tables' size after the addition
//! computed from their lengths and capacities; a known sample pays nothing. Past it, samples
//! fold into one `[stacks dropped: over memory cap]` stack.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::error::{ProfileError, StringError};
use crate::pprof::{
    field, len_field_len, varint_field_len, varint_len, EncodeOptions, EncodedProfile, MappingInfo,
    PbWriter, ResolvedFrame, Symbolizer,
};
use crate::sample_types::SampleType;
use crate::strings::{StringId, StringStorage, Table as StorageTable};

/// Most frames one sample may carry.
pub const MAX_FRAMES: usize = 3000;

/// Label key whose numeric value links samples to an endpoint.
pub const LOCAL_ROOT_SPAN_ID_LABEL: &str = "local root span id";
/// Label key added at encoding for samples whose span has an endpoint.
pub const TRACE_ENDPOINT_LABEL: &str = "trace endpoint";
/// Distinct endpoint names a profile keeps: a name beyond them is counted (and labels its
/// samples) as [`OTHER_ENDPOINTS`], so a caller naming endpoints by raw path cannot grow a profile
/// without bound.
pub const MAX_ENDPOINT_NAMES: usize = 4096;
/// What endpoints past [`MAX_ENDPOINT_NAMES`] are counted as.
pub const OTHER_ENDPOINTS: &str = "[other endpoints]";
/// Endpoints kept for roots no sample of the profile carried yet when named
/// ([`Profile::set_endpoint`]): the most recent ones, for samples recorded after their request
/// ended (a sampler that waited for a CPU records a tick's captures late). About 2 MiB at most;
/// 65,536 requests are over 3 s of a service serving 20,000 a second.
pub const LATE_ENDPOINTS: usize = 65_536;
/// Numeric label carried by timestamped samples.
pub const END_TIMESTAMP_LABEL: &str = "end_timestamp_ns";

/// A string given either literally or as an id of the profile's [`StringStorage`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Str<'a> {
    /// The text itself.
    Lit(&'a str),
    /// An id of the profile's string storage.
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
        /// The function's name.
        name: Str<'a>,
        /// The source file (empty when unknown).
        filename: Str<'a>,
        /// The line (0: unknown).
        line: i64,
    },
    /// A return/instruction address, symbolized at encoding by the [`Symbolizer`] passed to
    /// [`Profile::encode`] (one address may expand to several inlined frames). Without a
    /// symbolizer, or when it knows nothing, the location carries the address alone.
    Address(u64),
}

impl<'a> Frame<'a> {
    /// A symbolized frame from text.
    pub fn sym(name: &'a str, filename: &'a str, line: i64) -> Self {
        Frame::Symbol {
            name: Str::Lit(name),
            filename: Str::Lit(filename),
            line,
        }
    }

    /// A frame whose strings are ids of the profile's [`StringStorage`].
    pub fn ids(name: StringId, filename: StringId, line: i64) -> Self {
        Frame::Symbol {
            name: Str::Id(name),
            filename: Str::Id(filename),
            line,
        }
    }
}

/// A label value: a string or a number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LabelValue<'a> {
    /// A string.
    Str(Str<'a>),
    /// A number.
    Num(i64),
}

/// A (key, value) label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Label<'a> {
    /// The label's key.
    pub key: Str<'a>,
    /// Its value.
    pub value: LabelValue<'a>,
}

impl<'a> Label<'a> {
    /// A string label.
    pub fn str(key: &'a str, value: &'a str) -> Self {
        Label {
            key: Str::Lit(key),
            value: LabelValue::Str(Str::Lit(value)),
        }
    }

    /// A numeric label.
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
    /// The sample's labels (distinct keys).
    pub labels: &'a [Label<'a>],
    /// Nanoseconds since the Unix epoch; 0 means "not timestamped" (aggregated).
    pub end_timestamp_ns: i64,
}

// ---------------------------------------------------------------------------------------------
// Hashing and the id index

/// Fixed-seed foldhash: deterministic, and the data is the process's own (no flooding concern).
fn hasher() -> foldhash::fast::FoldHasher<'static> {
    use std::hash::BuildHasher;
    foldhash::fast::FixedState::with_seed(0x5eed_f0f0_cafe_d00d).build_hasher()
}

const NONE: u32 = u32::MAX;
/// No storage ids recorded for a function (two ids never both reach `u32::MAX`).
const NO_SOURCE: u64 = u64::MAX;

/// The storage ids of a frame whose name and filename are both ids, packed in one word.
#[inline(always)]
fn id_pair(name: Str<'_>, filename: Str<'_>) -> Option<u64> {
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
struct IdIndex {
    slots: Vec<u64>,
    /// Full hash of every id, for rehashing on growth.
    hashes: Vec<u64>,
}

impl IdIndex {
    fn len(&self) -> usize {
        self.hashes.len()
    }

    #[inline]
    fn find(&self, hash: u64, mut eq: impl FnMut(u32) -> bool) -> Option<u32> {
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
    fn insert(&mut self, hash: u64) -> u32 {
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
    fn reserve(&mut self, additional: usize) {
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
    fn adopt(&mut self, slots: &mut Vec<u64>, hashes: &mut Vec<u64>) {
        adopt(&mut self.hashes, hashes);
        // Slot tables are powers of two long, so a longer one is a valid table size.
        if slots.len() > self.slots.len() {
            self.slots = std::mem::take(slots);
            self.slots.fill(EMPTY_SLOT);
            self.replace_all();
        }
        *slots = Vec::new();
    }

    fn memory_bytes(&self) -> usize {
        (self.slots.capacity() + self.hashes.capacity()) * 8
    }

    /// [`IdIndex::memory_bytes`] after `add` more ids at most: slot tables are powers of two,
    /// at least twice as long as the ids they hold.
    fn bytes_after(&self, add: usize) -> usize {
        let need = (self.len() + add).saturating_mul(2);
        let slots = if need > self.slots.len() {
            need.next_power_of_two().max(16)
        } else {
            self.slots.capacity()
        };
        slots * 8 + bytes_after(&self.hashes, add)
    }
}

/// Entries of the address cache: 4096 (64 KiB), enough for the frames many stacks share.
const ADDR_CACHE_BITS: u32 = 12;

#[inline(always)]
fn addr_cache_slot(a: u64) -> usize {
    (a.wrapping_mul(K0) >> (64 - ADDR_CACHE_BITS)) as usize
}

/// Ids must stay below `NONE` and fit the index's 32-bit id half.
const MAX_TABLE_LEN: usize = (u32::MAX - 1) as usize;

// ---------------------------------------------------------------------------------------------
// Profile-local tables

/// The profile's own string table (becomes the pprof string table as is). Id 0 is "".
#[derive(Default)]
struct LocalStrings {
    bytes: String,
    spans: Vec<(u32, u32)>,
    index: IdIndex,
}

impl LocalStrings {
    fn new() -> Self {
        let mut s = LocalStrings::default();
        s.intern("");
        s
    }

    #[inline]
    fn get(&self, id: u32) -> &str {
        let (off, len) = self.spans[id as usize];
        &self.bytes[off as usize..(off + len) as usize]
    }

    /// Bytes of `id`, without the char-boundary checks of slicing a `str`.
    #[inline(always)]
    fn bytes_of(&self, id: u32) -> &[u8] {
        let (off, len) = self.spans[id as usize];
        &self.bytes.as_bytes()[off as usize..(off + len) as usize]
    }

    fn hash(s: &str) -> u64 {
        use std::hash::Hasher;
        let mut h = hasher();
        h.write(s.as_bytes());
        h.finish()
    }

    fn find(&self, s: &str) -> Option<u32> {
        self.index.find(Self::hash(s), |id| self.get(id) == s)
    }

    fn intern(&mut self, s: &str) -> u32 {
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

    fn len(&self) -> usize {
        self.spans.len()
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
struct Function {
    name: u32,
    filename: u32,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Location {
    Symbol { function: u32, line: i64 },
    Address(u64),
}

#[derive(Clone, Copy, PartialEq, Eq)]
struct LabelRec {
    key: u32,
    /// String value id, or `NONE` for a numeric label.
    str: u32,
    num: i64,
}

/// Slices of ids stored back to back (stacks of location ids, sets of label ids).
#[derive(Default)]
struct SliceSet {
    items: Vec<u32>,
    spans: Vec<(u32, u32)>,
    index: IdIndex,
}

impl SliceSet {
    #[inline]
    fn get(&self, id: u32) -> &[u32] {
        let (off, len) = self.spans[id as usize];
        &self.items[off as usize..(off + len) as usize]
    }

    fn intern(&mut self, ids: &[u32]) -> Result<u32, ProfileError> {
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
    fn find(&self, ids: &[u32]) -> Option<u32> {
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
    fn unindexed(&self) -> usize {
        self.spans.len() - self.index.len()
    }

    /// Most bytes the items hold after [`SliceSet::push_unindexed`] of `add` items.
    fn items_bytes_after_push(&self, add: usize, eager: bool) -> usize {
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
    fn push_unindexed(&mut self, ids: &[u32], eager: bool) -> Result<u32, ProfileError> {
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
struct Dedup<T> {
    items: Vec<T>,
    index: IdIndex,
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
    fn intern(&mut self, item: T, hash: u64, what: &str) -> Result<u32, ProfileError> {
        let items = &self.items;
        if let Some(id) = self.index.find(hash, |id| items[id as usize] == item) {
            return Ok(id);
        }
        check_table_len(self.items.len(), what)?;
        self.items.push(item);
        Ok(self.index.insert(hash))
    }

    fn find(&self, item: T, hash: u64) -> Option<u32> {
        self.index.find(hash, |id| self.items[id as usize] == item)
    }
}

/// Moves `v`'s items into `spare`'s allocation when that one is larger (so `v` can grow that far
/// without allocating), and frees whatever allocation is left over in `spare`.
fn adopt<T: Copy>(v: &mut Vec<T>, spare: &mut Vec<T>) {
    if spare.capacity() > v.capacity() {
        spare.clear();
        spare.extend_from_slice(v);
        std::mem::swap(v, spare);
    }
    *spare = Vec::new();
}

/// The emptied allocation of `v`, for [`adopt`] later.
fn recycle<T>(v: &mut Vec<T>) -> Vec<T> {
    let mut v = std::mem::take(v);
    v.clear();
    v
}

fn check_table_len(len: usize, what: &str) -> Result<(), ProfileError> {
    if len >= MAX_TABLE_LEN {
        return Err(ProfileError::Encode(format!(
            "profile holds the maximum number of {what} entries ({len})"
        )));
    }
    Ok(())
}

/// Name of the one frame that samples over a profile's memory cap are folded into.
pub const DROPPED_STACKS_FRAME: &str = "[stacks dropped: over memory cap]";

/// Marks a [`RowId`] that is an index of the dropped-stacks rows, not of the aggregated rows.
/// (A profile never comes near 2^31 dropped-stacks rows: there is one per label set at most.)
const DROPPED_ROW: u32 = 1 << 31;

/// Part of the cap (1/32) that only rows of the dropped-stacks frame may use, so that samples
/// folded in over the cap keep their label sets (a thread's, say) for a while.
const DROPPED_ROWS_SHARE: usize = 32;

/// Most bytes a vector of `len` items with room for `cap` holds after `add` more items pushed,
/// extended or resized in: nothing moves when they fit; otherwise each growth step at most
/// doubles the room or sets it to the length needed, so the room ends below twice the final
/// length (and a first allocation reserves at most 8 items).
fn vec_bytes_after(len: usize, cap: usize, add: usize, size: usize) -> usize {
    let need = len.saturating_add(add);
    if need <= cap {
        cap * size
    } else {
        need.saturating_mul(2).max(8).saturating_mul(size)
    }
}

fn bytes_after<T>(v: &Vec<T>, add: usize) -> usize {
    vec_bytes_after(v.len(), v.capacity(), add, std::mem::size_of::<T>())
}

/// Upper bounds of what one operation may add to each table, for the memory cap's check.
#[derive(Clone, Copy, Default)]
struct Adds {
    strings: usize,
    string_bytes: usize,
    functions: usize,
    locations: usize,
    stacks: usize,
    stack_items: usize,
    labels: usize,
    label_sets: usize,
    label_items: usize,
    keys: usize,
    rows: usize,
    timed: usize,
    /// Length `id_cache` may be resized to (0: unchanged).
    id_cache_len: usize,
    /// New dropped-stacks rows.
    dropped_rows: usize,
    /// Length the label set -> dropped-stacks row map may be resized to (0: unchanged).
    dropped_map_len: usize,
    /// The address cache may be allocated.
    addr_cache: bool,
    /// Lookups follow, so the stack and row indexes catch up with unindexed entries (the bulk
    /// path appends without indexing; its entries are never looked up).
    indexed: bool,
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

fn hash_function(f: Function) -> u64 {
    use std::hash::Hasher;
    let mut h = hasher();
    h.write_u64(((f.name as u64) << 32) | f.filename as u64);
    h.finish()
}

fn hash_location(l: Location) -> u64 {
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

fn hash_label(l: LabelRec) -> u64 {
    use std::hash::Hasher;
    let mut h = hasher();
    h.write_u64(((l.key as u64) << 32) | l.str as u64);
    h.write_u64(l.num as u64);
    h.finish()
}

fn hash_pair(a: u32, b: u32) -> u64 {
    use std::hash::Hasher;
    let mut h = hasher();
    h.write_u64(((a as u64) << 32) | b as u64);
    h.finish()
}

/// A raw sample shape seen before, and what it resolved to.
#[derive(Clone, Copy)]
struct KeyRec {
    stack: u32,
    labels: u32,
    /// Row in the aggregated table, or `NONE` until an untimestamped sample used this key.
    agg: u32,
    /// The label set has an `end_timestamp_ns` label: fine untimestamped, an error with a
    /// timestamp (checked here because a key hit skips the label validation).
    has_ts_label: bool,
}

#[derive(Clone, Copy)]
struct TimedRec {
    stack: u32,
    labels: u32,
    ts: i64,
}

/// Ids of the strings every profile carries, interned first in this order.
struct Preset {
    end_timestamp: u32,
    trace_endpoint: u32,
    local_root_span_id: u32,
    /// (type, unit) per sample type.
    types: Vec<(u32, u32)>,
}

/// Everything `reset` throws away.
struct Tables {
    strings: LocalStrings,
    functions: Dedup<Function>,
    locations: Dedup<Location>,
    stacks: SliceSet,
    labels: Dedup<LabelRec>,
    label_sets: SliceSet,
    keys: Vec<KeyRec>,
    key_index: IdIndex,
    /// (stack, label set) per aggregated row.
    agg: Vec<(u32, u32)>,
    agg_index: IdIndex,
    agg_values: Vec<i64>,
    timed: Vec<TimedRec>,
    timed_values: Vec<i64>,
    /// Local root span id -> endpoint string id, for the roots samples of this profile carry.
    endpoints: HashMap<u64, u32, foldhash::fast::RandomState>,
    /// The same for the last [`LATE_ENDPOINTS`] roots named before any sample carried them
    /// (samples recorded a little after their request ended); oldest first in `late_order`.
    late_endpoints: HashMap<u64, u32, foldhash::fast::RandomState>,
    late_order: std::collections::VecDeque<u64>,
    endpoint_counts: HashMap<String, i64, foldhash::fast::RandomState>,
    /// Storage id -> local string id + 1 (0: not cached). Valid for `cache_generation` only.
    id_cache: Vec<u32>,
    /// Per function: the storage ids (name << 32 | filename) it was last resolved from in
    /// `cache_generation`, or `NO_SOURCE`. Lets a known stack of id frames be verified with one
    /// comparison per frame.
    function_src: Vec<u64>,
    cache_generation: u64,
    preset: Preset,
    /// Reused by the slow path so it does not allocate per sample.
    scratch: Vec<u32>,
    /// Direct-mapped address -> location id cache of [`Profile::push_stack_unindexed`] (empty until
    /// first used). Location ids never change while the tables live, so entries stay valid.
    addr_cache: Vec<(u64, u32)>,
    dropped: Dropped,
}

/// Where samples over the memory cap go: one stack of the [`DROPPED_STACKS_FRAME`] frame, with a
/// row per label set that already existed (or none). Its rows are kept apart from the
/// aggregated ones: they grow from nothing in a share of the cap of their own, where a row in
/// the aggregated table could need that (large) table to double.
struct Dropped {
    /// The dropped-stacks stack, `NONE` until the first sample over the cap.
    stack: u32,
    /// The empty label set (valid once `stack` is set).
    empty_labels: u32,
    /// Label set id -> its dropped-stacks row, `NONE` where there is none.
    map: Vec<u32>,
    /// Label set per row.
    labels: Vec<u32>,
    /// Values per row (one per sample type).
    values: Vec<i64>,
    /// Samples folded in.
    samples: u64,
}

impl Dropped {
    fn new() -> Self {
        Dropped {
            stack: NONE,
            empty_labels: NONE,
            map: Vec::new(),
            labels: Vec::new(),
            values: Vec::new(),
            samples: 0,
        }
    }

    fn row(&self, labels: u32) -> u32 {
        self.map.get(labels as usize).copied().unwrap_or(NONE)
    }

    fn memory_bytes(&self) -> usize {
        (self.map.capacity() + self.labels.capacity()) * 4 + self.values.capacity() * 8
    }
}

impl Tables {
    fn new(types: &[SampleType], generation: u64) -> Tables {
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

    /// Local id of the storage string `id`, if cached.
    #[inline]
    fn cached(&self, id: StringId) -> Option<u32> {
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
    fn key_matches(&self, key: &KeyRec, frames: &[Frame<'_>], labels: &[Label<'_>]) -> bool {
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

    fn memory_bytes(&self) -> usize {
        self.strings.bytes.capacity()
            + self.strings.spans.capacity() * 8
            + self.strings.index.memory_bytes()
            + self.functions.items.capacity() * std::mem::size_of::<Function>()
            + self.functions.index.memory_bytes()
            + self.locations.items.capacity() * std::mem::size_of::<Location>()
            + self.locations.index.memory_bytes()
            + (self.stacks.items.capacity() + self.stacks.spans.capacity() * 2) * 4
            + self.stacks.index.memory_bytes()
            + self.labels.items.capacity() * std::mem::size_of::<LabelRec>()
            + self.labels.index.memory_bytes()
            + (self.label_sets.items.capacity() + self.label_sets.spans.capacity() * 2) * 4
            + self.label_sets.index.memory_bytes()
            + self.keys.capacity() * std::mem::size_of::<KeyRec>()
            + self.key_index.memory_bytes()
            + self.agg.capacity() * 8
            + self.agg_index.memory_bytes()
            + self.agg_values.capacity() * 8
            + self.timed.capacity() * std::mem::size_of::<TimedRec>()
            + self.timed_values.capacity() * 8
            + self.id_cache.capacity() * 4
            + self.function_src.capacity() * 8
            + self.addr_cache.capacity() * std::mem::size_of::<(u64, u32)>()
            + self.dropped.memory_bytes()
    }

    /// An upper bound of [`Tables::memory_bytes`] after the additions `a` (values of `n` sample
    /// types per row), plus what the first sample over the cap adds (the dropped-stacks stack
    /// and its unlabeled row) while that is not there yet: whatever is let in under the cap,
    /// room for those remains. Mirrors `memory_bytes` term by term; reads lengths and
    /// capacities only.
    fn projected_bytes(&self, a: &Adds, n: usize) -> usize {
        let mut a = *a;
        let d = &self.dropped;
        if d.stack == NONE {
            a.strings += 1;
            a.string_bytes += DROPPED_STACKS_FRAME.len();
            a.functions += 1;
            a.locations += 1;
            a.stacks += 1;
            a.stack_items += 1;
            a.label_sets += 1;
        }
        if d.row(d.empty_labels) == NONE {
            a.dropped_rows += 1;
            a.dropped_map_len = a
                .dropped_map_len
                .max(self.label_sets.spans.len() + a.label_sets);
        }
        let (pending_stacks, pending_rows) = if a.indexed {
            (
                self.stacks.unindexed(),
                self.agg.len() - self.agg_index.len(),
            )
        } else {
            (0, 0)
        };
        let resized = |len: usize, cap: usize, to: usize, size: usize| {
            vec_bytes_after(len, cap, to.saturating_sub(len), size)
        };
        let s = &self.strings;
        vec_bytes_after(s.bytes.len(), s.bytes.capacity(), a.string_bytes, 1)
            + bytes_after(&s.spans, a.strings)
            + s.index.bytes_after(a.strings)
            + bytes_after(&self.functions.items, a.functions)
            + self.functions.index.bytes_after(a.functions)
            + bytes_after(&self.locations.items, a.locations)
            + self.locations.index.bytes_after(a.locations)
            + vec_bytes_after(
                self.stacks.items.len(),
                self.stacks.items.capacity(),
                a.stack_items,
                4,
            )
            + bytes_after(&self.stacks.spans, a.stacks)
            + self.stacks.index.bytes_after(if a.indexed {
                a.stacks + pending_stacks
            } else {
                0
            })
            + bytes_after(&self.labels.items, a.labels)
            + self.labels.index.bytes_after(a.labels)
            + bytes_after(&self.label_sets.items, a.label_items)
            + bytes_after(&self.label_sets.spans, a.label_sets)
            + self.label_sets.index.bytes_after(a.label_sets)
            + bytes_after(&self.keys, a.keys)
            + self.key_index.bytes_after(a.keys)
            + bytes_after(&self.agg, a.rows)
            + self
                .agg_index
                .bytes_after(if a.indexed { a.rows + pending_rows } else { 0 })
            + bytes_after(&self.agg_values, a.rows * n)
            + bytes_after(&self.timed, a.timed)
            + bytes_after(&self.timed_values, a.timed * n)
            + resized(
                self.id_cache.len(),
                self.id_cache.capacity(),
                a.id_cache_len,
                4,
            )
            + resized(
                self.function_src.len(),
                self.function_src.capacity(),
                self.functions.items.len() + a.functions,
                8,
            )
            + if a.addr_cache && self.addr_cache.is_empty() {
                (1 << ADDR_CACHE_BITS) * std::mem::size_of::<(u64, u32)>()
            } else {
                self.addr_cache.capacity() * std::mem::size_of::<(u64, u32)>()
            }
            + resized(d.map.len(), d.map.capacity(), a.dropped_map_len, 4)
            + bytes_after(&d.labels, a.dropped_rows)
            + bytes_after(&d.values, a.dropped_rows * n)
    }

    /// Row of (stack, labels) if there is one, without changing anything.
    fn find_agg_row(&self, stack: u32, labels: u32) -> Option<u32> {
        let agg = &self.agg;
        self.agg_index
            .find(hash_pair(stack, labels), |r| {
                agg[r as usize] == (stack, labels)
            })
            .or_else(|| {
                (self.agg_index.len()..agg.len())
                    .find(|&r| agg[r] == (stack, labels))
                    .map(|r| r as u32)
            })
    }

    /// Location id of an address frame, through the address cache.
    #[inline]
    fn address_location(&mut self, a: u64) -> Result<u32, ProfileError> {
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

    /// Row of the aggregated sample (stack, labels), added with zero values when new.
    #[inline]
    fn agg_row(&mut self, stack: u32, labels: u32, n: usize) -> Result<u32, ProfileError> {
        self.catch_up_agg_index();
        let hash = hash_pair(stack, labels);
        let agg = &self.agg;
        if let Some(r) = self
            .agg_index
            .find(hash, |r| agg[r as usize] == (stack, labels))
        {
            return Ok(r);
        }
        check_table_len(self.agg.len(), "aggregated sample")?;
        self.agg.push((stack, labels));
        self.agg_values.resize(self.agg_values.len() + n, 0);
        Ok(self.agg_index.insert(hash))
    }

    /// Indexes the rows appended by [`Profile::push_unindexed_row`] since the last lookup.
    #[inline]
    fn catch_up_agg_index(&mut self) {
        let indexed = self.agg_index.len();
        if indexed < self.agg.len() {
            self.agg_index.reserve(self.agg.len() - indexed);
            for &(stack, labels) in &self.agg[indexed..] {
                self.agg_index.insert(hash_pair(stack, labels));
            }
        }
    }
}

/// Byte equality for the short strings of symbol names: the length check rejects most
/// mismatches before any byte is read. (A hand-rolled 16-byte-chunk loop measured slower than
/// the libc `memcmp` this calls.)
#[inline(always)]
fn bytes_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a == b
}

/// Starts fetching, for writing, the memory 256 bytes past the end of `v`. A bulk add appends
/// to tables it has not touched lately, front to back: without this each new line is a store
/// miss met when the store comes, and they queue up.
#[inline(always)]
fn prefetch_past_end<T>(v: &[T]) {
    prefetch_line(v.as_ptr_range().end.cast::<u8>().wrapping_add(256), true);
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

/// Asks the CPU to start loading the cache line of `r`, without waiting for it: bulk loops call
/// this some iterations ahead of a random access so its cache miss overlaps with other work.
#[inline(always)]
pub(crate) fn prefetch<T>(r: &T) {
    prefetch_line((r as *const T).cast(), false);
}

/// One prefetch instruction for the line holding `p` (any address: a prefetch never faults),
/// `for_write` asking for it in a state ready to be written.
#[inline(always)]
fn prefetch_line(p: *const u8, for_write: bool) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is only a hint: it never faults nor changes memory, whatever the
    // address. SSE, the intrinsic's target feature, is part of the x86_64 baseline.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_ET0, _MM_HINT_T0};
        if for_write {
            _mm_prefetch::<_MM_HINT_ET0>(p.cast());
        } else {
            _mm_prefetch::<_MM_HINT_T0>(p.cast());
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, for_write);
}

/// foldhash's mixing step: the two halves of a 64x64-bit product, folded together.
#[inline(always)]
fn folded_multiply(x: u64, y: u64) -> u64 {
    let full = (x as u128) * (y as u128);
    (full as u64) ^ ((full >> 64) as u64)
}

/// Arbitrary odd constants (digits of pi) keeping the multiplier away from zero.
const K0: u64 = 0x243f_6a88_85a3_08d3;
const K1: u64 = 0x1319_8a2e_0370_7344;
const K2: u64 = 0xa409_3822_299f_31d0;

/// The sample-key hash: one folded multiply per frame (two words) and per label part, without
/// a general-purpose hasher's buffering. Runs on every add, so it is kept this lean.
#[inline]
fn sample_key_hash(frames: &[Frame<'_>], labels: &[Label<'_>]) -> u64 {
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

// ---------------------------------------------------------------------------------------------
// String resolution for the slow path

/// Resolves storage ids for the slow path. The storage is locked once, up front, and only when
/// the sample names an id the profile has not cached.
struct Resolver<'s> {
    has_storage: bool,
    guard: Option<crate::spin::SpinGuard<'s, StorageTable>>,
}

impl<'s> Resolver<'s> {
    fn new(storage: Option<&'s StringStorage>, t: &Tables, sample: &Sample<'_>) -> Self {
        let uncached = |s: Str<'_>| matches!(s, Str::Id(id) if t.cached(id).is_none());
        let needs_lock = sample.frames.iter().any(|f| match *f {
            Frame::Symbol { name, filename, .. } => uncached(name) || uncached(filename),
            Frame::Address(_) => false,
        }) || sample
            .labels
            .iter()
            .any(|l| uncached(l.key) || matches!(l.value, LabelValue::Str(s) if uncached(s)));
        Resolver {
            has_storage: storage.is_some(),
            guard: storage.filter(|_| needs_lock).map(|s| s.lock()),
        }
    }

    /// Text of a storage id that is not in the profile's cache.
    fn storage_text(&self, id: StringId) -> Result<&str, ProfileError> {
        match &self.guard {
            Some(g) => Ok(g.get(id)?),
            None if self.has_storage => Err(StringError::UnknownId(id.0).into()),
            None => Err(ProfileError::NoStringStorage(id.0)),
        }
    }
}

/// Text of `s`, from the literal, the profile's table (cached ids) or the storage.
fn text<'a>(t: &'a Tables, r: &'a Resolver<'_>, s: Str<'a>) -> Result<&'a str, ProfileError> {
    match s {
        Str::Lit(s) => Ok(s),
        Str::Id(id) => match t.cached(id) {
            Some(local) => Ok(t.strings.get(local)),
            None => r.storage_text(id),
        },
    }
}

/// Interns `s` into the profile's table, caching the id mapping.
fn intern_str(t: &mut Tables, r: &Resolver<'_>, s: Str<'_>) -> Result<u32, ProfileError> {
    match s {
        Str::Lit(s) => {
            check_table_len(t.strings.len(), "string")?;
            Ok(t.strings.intern(s))
        }
        Str::Id(id) => {
            if let Some(local) = t.cached(id) {
                return Ok(local);
            }
            check_table_len(t.strings.len(), "string")?;
            let local = t.strings.intern(r.storage_text(id)?);
            let i = id.0 as usize;
            if t.id_cache.len() <= i {
                t.id_cache.resize(i + 1, 0);
            }
            t.id_cache[i] = local + 1;
            Ok(local)
        }
    }
}

/// Appends the location id of every frame to `locs`, interning what is new.
fn intern_frames(
    t: &mut Tables,
    r: &Resolver<'_>,
    frames: &[Frame<'_>],
    locs: &mut Vec<u32>,
) -> Result<(), ProfileError> {
    for f in frames {
        let loc = match *f {
            Frame::Address(a) => Location::Address(a),
            Frame::Symbol {
                name,
                filename,
                line,
            } => {
                let src = id_pair(name, filename);
                let name = intern_str(t, r, name)?;
                let filename = intern_str(t, r, filename)?;
                let func = Function { name, filename };
                let function = t.functions.intern(func, hash_function(func), "function")?;
                if t.function_src.len() < t.functions.items.len() {
                    t.function_src.resize(t.functions.items.len(), NO_SOURCE);
                }
                if let Some(src) = src {
                    t.function_src[function as usize] = src;
                }
                Location::Symbol { function, line }
            }
        };
        locs.push(t.locations.intern(loc, hash_location(loc), "location")?);
    }
    Ok(())
}

/// Appends the label id of every label to `ids`, interning what is new.
fn intern_labels(
    t: &mut Tables,
    r: &Resolver<'_>,
    labels: &[Label<'_>],
    ids: &mut Vec<u32>,
) -> Result<(), ProfileError> {
    for l in labels {
        let key = intern_str(t, r, l.key)?;
        let rec = match l.value {
            LabelValue::Num(num) => LabelRec {
                key,
                str: NONE,
                num,
            },
            LabelValue::Str(s) => LabelRec {
                key,
                str: intern_str(t, r, s)?,
                num: 0,
            },
        };
        ids.push(t.labels.intern(rec, hash_label(rec), "label")?);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The memory cap's look-ups

impl Tables {
    /// What adding `sample` under a new key may add at most: every frame a new location (and
    /// function, and strings), every label new. Cached ids are in the string table already.
    fn new_key_adds(&self, r: &Resolver<'_>, sample: &Sample<'_>) -> Result<Adds, ProfileError> {
        let mut a = Adds {
            locations: sample.frames.len(),
            stacks: 1,
            stack_items: sample.frames.len(),
            labels: sample.labels.len(),
            label_sets: 1,
            label_items: sample.labels.len(),
            keys: 1,
            indexed: true,
            ..Adds::default()
        };
        if sample.end_timestamp_ns == 0 {
            a.rows = 1;
        } else {
            a.timed = 1;
        }
        let mut count = |s: Str<'_>| -> Result<(), ProfileError> {
            match s {
                Str::Id(id) if self.cached(id).is_some() => return Ok(()),
                Str::Id(id) => a.id_cache_len = a.id_cache_len.max(id.0 as usize + 1),
                Str::Lit(_) => {}
            }
            a.strings += 1;
            a.string_bytes += text(self, r, s)?.len();
            Ok(())
        };
        let mut functions = 0;
        for f in sample.frames {
            if let Frame::Symbol { name, filename, .. } = *f {
                functions += 1;
                count(name)?;
                count(filename)?;
            }
        }
        for l in sample.labels {
            count(l.key)?;
            if let LabelValue::Str(v) = l.value {
                count(v)?;
            }
        }
        a.functions = functions;
        Ok(a)
    }

    /// Local id of `s` if the string table holds it.
    fn find_str(&self, r: &Resolver<'_>, s: Str<'_>) -> Result<Option<u32>, ProfileError> {
        Ok(match s {
            Str::Lit(s) => self.strings.find(s),
            Str::Id(id) => match self.cached(id) {
                Some(local) => Some(local),
                None => self.strings.find(r.storage_text(id)?),
            },
        })
    }

    /// The stack and label set `sample` resolves to, where they exist, without adding anything.
    fn find_existing(
        &mut self,
        r: &Resolver<'_>,
        sample: &Sample<'_>,
    ) -> Result<(Option<u32>, Option<u32>), ProfileError> {
        let mut ids = std::mem::take(&mut self.scratch);
        let result = self
            .find_stack(r, sample.frames, &mut ids)
            .and_then(|stack| {
                let labels = self.find_label_set(r, sample.labels, &mut ids)?;
                Ok((stack, labels))
            });
        self.scratch = ids;
        result
    }

    /// The stack of `frames`, if the tables hold it (`ids`: scratch).
    fn find_stack(
        &self,
        r: &Resolver<'_>,
        frames: &[Frame<'_>],
        ids: &mut Vec<u32>,
    ) -> Result<Option<u32>, ProfileError> {
        ids.clear();
        for f in frames {
            let loc = match *f {
                Frame::Address(a) => Some(Location::Address(a)),
                Frame::Symbol {
                    name,
                    filename,
                    line,
                } => match (self.find_str(r, name)?, self.find_str(r, filename)?) {
                    (Some(name), Some(filename)) => {
                        let func = Function { name, filename };
                        self.functions
                            .find(func, hash_function(func))
                            .map(|function| Location::Symbol { function, line })
                    }
                    _ => None,
                },
            };
            match loc.and_then(|l| self.locations.find(l, hash_location(l))) {
                Some(id) => ids.push(id),
                None => return Ok(None),
            }
        }
        Ok(self.stacks.find(ids))
    }

    /// The label set of `labels`, if the tables hold it (`ids`: scratch).
    fn find_label_set(
        &self,
        r: &Resolver<'_>,
        labels: &[Label<'_>],
        ids: &mut Vec<u32>,
    ) -> Result<Option<u32>, ProfileError> {
        ids.clear();
        for l in labels {
            let Some(key) = self.find_str(r, l.key)? else {
                return Ok(None);
            };
            let rec = match l.value {
                LabelValue::Num(num) => LabelRec {
                    key,
                    str: NONE,
                    num,
                },
                LabelValue::Str(v) => match self.find_str(r, v)? {
                    Some(str) => LabelRec { key, str, num: 0 },
                    None => return Ok(None),
                },
            };
            match self.labels.find(rec, hash_label(rec)) {
                Some(id) => ids.push(id),
                None => return Ok(None),
            }
        }
        Ok(self.label_sets.find(ids))
    }
}

// ---------------------------------------------------------------------------------------------
// Profile

/// A stack interned in a profile, valid until its next reset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StackId(u32);

/// A label set interned in a profile, valid until its next reset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct LabelSetId(u32);

/// An aggregated row of a profile, valid until its next reset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RowId(u32);

/// An address stack looked up by [`Profile::prefetch_addresses`], for
/// [`Profile::push_address_stack_unindexed`].
#[derive(Default)]
pub(crate) struct PrefetchedStack {
    /// Location id per frame, `NONE` where the address cache did not know it.
    locs: Vec<u32>,
    /// (frame position, address, location hash) of each frame the cache did not know.
    misses: Vec<(u32, u64, u64)>,
}

/// The allocations a bulk add fills (rows, stacks, locations and the location index), handed
/// from one profile to the next: a heap profile's tables are many MB, and allocating them afresh
/// for every serialization means page-faulting all of it in again (and unmapping it after).
#[derive(Default)]
pub(crate) struct BulkBuffers {
    agg: Vec<(u32, u32)>,
    agg_values: Vec<i64>,
    stack_items: Vec<u32>,
    stack_spans: Vec<(u32, u32)>,
    locations: Vec<Location>,
    location_slots: Vec<u64>,
    location_hashes: Vec<u64>,
}

impl BulkBuffers {
    fn memory_bytes(&self) -> usize {
        self.agg.capacity() * 8
            + self.agg_values.capacity() * 8
            + self.stack_items.capacity() * 4
            + self.stack_spans.capacity() * 8
            + self.locations.capacity() * std::mem::size_of::<Location>()
            + (self.location_slots.capacity() + self.location_hashes.capacity()) * 8
    }
}

/// What a profile says about itself besides its samples: pprof's `default_sample_type`,
/// `period_type` and `period`. Nothing is written for what is `None` (the default).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProfileMetadata {
    /// The type a viewer shows unless told otherwise; one of the profile's sample types.
    pub default_sample_type: Option<SampleType>,
    /// What one sampling event stands for: a type (written as its name and unit, need not be
    /// one of the profile's) and how much of it (nanoseconds of CPU, bytes allocated, ...).
    pub period: Option<(SampleType, i64)>,
}

/// A profile being recorded.
pub struct Profile {
    types: Box<[SampleType]>,
    storage: Option<Arc<StringStorage>>,
    start: SystemTime,
    metadata: ProfileMetadata,
    t: Tables,
    /// Most bytes the tables may hold ([`Profile::set_max_bytes`]); `usize::MAX`: no cap.
    cap: usize,
}

impl Profile {
    /// `strings` resolves [`Str::Id`] values; without it, ids are an error.
    pub fn new(
        types: &[SampleType],
        strings: Option<Arc<StringStorage>>,
        start: SystemTime,
    ) -> Self {
        let generation = strings.as_ref().map_or(0, |s| s.generation());
        Profile {
            types: types.into(),
            storage: strings,
            start,
            metadata: ProfileMetadata::default(),
            t: Tables::new(types, generation),
            cap: usize::MAX,
        }
    }

    /// Sets what the encoded profile says about itself; kept across resets. A default type that
    /// is not one of the profile's types, or a negative period, is an error and changes nothing.
    pub fn set_metadata(&mut self, metadata: ProfileMetadata) -> Result<(), ProfileError> {
        if let Some(t) = metadata.default_sample_type {
            if !self.types.contains(&t) {
                return Err(ProfileError::DefaultTypeNotInProfile(t.name()));
            }
        }
        if let Some((_, period)) = metadata.period {
            if period < 0 {
                return Err(ProfileError::NegativePeriod(period));
            }
        }
        self.metadata = metadata;
        Ok(())
    }

    /// The metadata set by [`Profile::set_metadata`].
    pub fn metadata(&self) -> ProfileMetadata {
        self.metadata
    }

    /// Caps the memory of the profile's tables at `max_bytes` (`None`: no cap, the default).
    ///
    /// Under the cap the profile works as without one. A sample that would need new table
    /// entries (a new stack, location, function, string, label set or row) that could take the
    /// tables past the cap is folded instead into one stack of a single
    /// [`DROPPED_STACKS_FRAME`] frame (with the sample's labels when that label set already
    /// exists, else none) and counted ([`Profile::dropped_samples`]); samples of stacks already
    /// there keep aggregating into their own rows. Values are never lost.
    ///
    /// The check takes the tables' growth by doubling into account, so
    /// [`Profile::memory_bytes`] stays at or under the cap (a profile emptier than its cap may
    /// thus start folding when a large table would have to double: it typically holds half to
    /// three quarters of the cap then); the only exceptions are a cap smaller than an empty
    /// profile plus the dropped-stacks entries, the 64 KiB address cache of the bulk heap path,
    /// and endpoint names ([`Profile::set_endpoint`]), which are not capped. 1/32 of the cap is
    /// kept for the dropped-stacks rows (one per label set). The cap holds until the next
    /// reset, which keeps it.
    pub fn set_max_bytes(&mut self, max_bytes: Option<u64>) {
        self.cap = max_bytes.map_or(usize::MAX, |b| usize::try_from(b).unwrap_or(usize::MAX));
    }

    /// [`Profile::set_max_bytes`], builder style.
    pub fn with_max_bytes(mut self, max_bytes: Option<u64>) -> Self {
        self.set_max_bytes(max_bytes);
        self
    }

    /// The cap set by [`Profile::set_max_bytes`].
    pub fn max_bytes(&self) -> Option<u64> {
        (self.cap != usize::MAX).then_some(self.cap as u64)
    }

    /// Samples folded into the dropped-stacks frame since the last reset (a heap object added
    /// by the bulk path counts as one sample).
    pub fn dropped_samples(&self) -> u64 {
        self.t.dropped.samples
    }

    /// Whether the additions `a` keep the tables under the cap, less the share kept for
    /// dropped-stacks rows (which [`Profile::add_dropped`] alone may use).
    #[inline]
    fn fits(&self, a: &Adds) -> bool {
        self.cap == usize::MAX
            || self.t.projected_bytes(a, self.types.len())
                <= self.cap - self.cap / DROPPED_ROWS_SHARE
    }

    /// The profile's sample types, in the order of every sample's values.
    pub fn sample_types(&self) -> &[SampleType] {
        &self.types
    }

    /// When the profile's recording began.
    pub fn start(&self) -> SystemTime {
        self.start
    }

    /// Adds one sample; validation errors leave the profile unchanged.
    pub fn add(&mut self, sample: &Sample<'_>) -> Result<(), ProfileError> {
        if sample.values.len() != self.types.len() {
            return Err(ProfileError::WrongValueCount {
                expected: self.types.len(),
                got: sample.values.len(),
            });
        }
        if sample.frames.len() > MAX_FRAMES {
            return Err(ProfileError::TooManyFrames {
                got: sample.frames.len(),
                limit: MAX_FRAMES,
            });
        }
        if sample.end_timestamp_ns < 0 {
            return Err(ProfileError::NegativeTimestamp(sample.end_timestamp_ns));
        }
        self.sync_generation();

        let hash = sample_key_hash(sample.frames, sample.labels);
        let t = &self.t;
        let key = match t.key_index.find(hash, |k| {
            t.key_matches(&t.keys[k as usize], sample.frames, sample.labels)
        }) {
            Some(k) => k,
            None => match self.add_key(hash, sample)? {
                Some(k) => k,
                // Over the memory cap: already added where it belongs.
                None => return Ok(()),
            },
        };
        self.record(key, sample)
    }

    /// Drops the storage id mappings when the storage's generation moved.
    #[inline]
    fn sync_generation(&mut self) {
        if let Some(storage) = &self.storage {
            let g = storage.generation();
            if g != self.t.cache_generation {
                // Ids freed by the advance may now name other strings.
                self.t.id_cache.clear();
                self.t.function_src.fill(NO_SOURCE);
                self.t.cache_generation = g;
            }
        }
    }

    /// Pre-sizes the tables for `rows` more aggregated rows over at most `stacks` new stacks
    /// added through [`Profile::push_stack_unindexed`] and [`Profile::push_unindexed_row`], so a
    /// bulk add does not reallocate on the way. (Their indexes are left alone: those entries are
    /// only indexed if a later lookup needs them.)
    ///
    /// The tables move into the allocations in `spare` (left by [`Profile::reset_into`]) where
    /// those are larger; `spare` is emptied. Buffers far larger than this add needs are freed
    /// instead, so memory kept for a heap that shrank is given back.
    pub(crate) fn reserve_unindexed(
        &mut self,
        rows: usize,
        stacks: usize,
        spare: &mut BulkBuffers,
    ) {
        if self.cap != usize::MAX {
            let a = Adds {
                rows,
                stacks,
                locations: stacks,
                ..Adds::default()
            };
            // Adopting keeps the larger of two allocations: at most both.
            if self.t.projected_bytes(&a, self.types.len()) + spare.memory_bytes() > self.cap {
                // Too much for the cap: give the kept buffers back and let each push check
                // its own growth.
                *spare = BulkBuffers::default();
                return;
            }
        }
        let t = &mut self.t;
        if spare.agg.capacity() > 4 * (t.agg.len() + rows).max(1024) {
            *spare = BulkBuffers::default();
        }
        adopt(&mut t.agg, &mut spare.agg);
        adopt(&mut t.agg_values, &mut spare.agg_values);
        adopt(&mut t.stacks.items, &mut spare.stack_items);
        adopt(&mut t.stacks.spans, &mut spare.stack_spans);
        adopt(&mut t.locations.items, &mut spare.locations);
        t.locations
            .index
            .adopt(&mut spare.location_slots, &mut spare.location_hashes);
        t.agg.reserve(rows);
        t.agg_values.reserve(rows * self.types.len());
        t.stacks.spans.reserve(stacks);
        // Most new stacks bring at least one new location (their own call site).
        t.locations.items.reserve(stacks);
        t.locations.index.reserve(stacks);
    }

    /// Bulk path, part 1: appends a stack (innermost frame first) with the validation of
    /// [`Profile::add`]; a failed stack leaves the profile unchanged. The id is valid until the
    /// next [`Profile::reset`].
    ///
    /// Unlike `add`, this always appends a new stack entry, without looking it up or indexing it
    /// (the index catches up on the next lookup, so later lookups still see it; a later `add` of
    /// an equal stack may aggregate into a row of its own). It is for a caller
    /// whose stacks are distinct from each other and that only needs rows of its own on them: an
    /// equal stack already in the profile is merely stored twice, which the encoding does not
    /// show (samples list location ids, not stack ids). Locations are still deduplicated.
    ///
    /// `hints` is empty, or what [`Profile::prefetch_stack`] of `frames` gave since the last
    /// reset.
    pub(crate) fn push_stack_unindexed(
        &mut self,
        frames: &[Frame<'_>],
        hints: &[u32],
    ) -> Result<StackId, ProfileError> {
        if frames.len() > MAX_FRAMES {
            return Err(ProfileError::TooManyFrames {
                got: frames.len(),
                limit: MAX_FRAMES,
            });
        }
        self.sync_generation();
        let hint = |i: usize| hints.get(i).copied().unwrap_or(NONE);
        let mut locs = std::mem::take(&mut self.t.scratch);
        locs.clear();
        let result = if frames.iter().all(|f| matches!(f, Frame::Address(_))) {
            // Nothing to validate; locations come through the address cache.
            let adds = if self.cap == usize::MAX {
                Adds::default()
            } else {
                Adds {
                    locations: (0..frames.len()).filter(|&i| hint(i) == NONE).count(),
                    addr_cache: true,
                    ..Adds::default()
                }
            };
            let Some(eager) = self.bulk_stack_room(frames.len(), adds) else {
                self.t.scratch = locs;
                return self.dropped_stack_id();
            };
            let t = &mut self.t;
            frames
                .iter()
                .enumerate()
                .try_for_each(|(i, f)| {
                    if let Frame::Address(a) = *f {
                        locs.push(match hint(i) {
                            NONE => t.address_location(a)?,
                            id => id,
                        });
                    }
                    Ok(())
                })
                .and_then(|()| t.stacks.push_unindexed(&locs, eager))
        } else {
            let storage = self.storage.clone();
            let sample = Sample {
                frames,
                values: &[],
                labels: &[],
                end_timestamp_ns: 0,
            };
            let r = Resolver::new(storage.as_deref(), &self.t, &sample);
            let room = self.validate(&r, &sample).and_then(|()| {
                if self.cap == usize::MAX {
                    return Ok(Some(true));
                }
                let mut adds = self.t.new_key_adds(&r, &sample)?;
                (adds.stacks, adds.stack_items, adds.rows) = (0, 0, 0);
                (adds.label_sets, adds.keys, adds.indexed) = (0, 0, false);
                Ok(self.bulk_stack_room(frames.len(), adds))
            });
            match room {
                Ok(Some(eager)) => {
                    let t = &mut self.t;
                    intern_frames(t, &r, frames, &mut locs)
                        .and_then(|()| t.stacks.push_unindexed(&locs, eager))
                }
                Ok(None) => {
                    drop(r);
                    self.t.scratch = locs;
                    return self.dropped_stack_id();
                }
                Err(e) => Err(e),
            }
        };
        self.t.scratch = locs;
        result.map(StackId)
    }

    /// Whether the bulk path may append a stack of `items` frames whose other additions are `a`
    /// (and the row that follows it): `None` over the memory cap, else whether the stack table
    /// may reserve ahead ([`SliceSet::push_unindexed`]'s `eager`).
    fn bulk_stack_room(&self, items: usize, mut a: Adds) -> Option<bool> {
        if self.cap == usize::MAX {
            return Some(true);
        }
        (a.stacks, a.stack_items, a.rows) = (1, items, 1);
        let projected = self.t.projected_bytes(&a, self.types.len());
        if projected > self.cap {
            return None;
        }
        let s = &self.t.stacks;
        let eager_extra = s
            .items_bytes_after_push(items, true)
            .saturating_sub(s.items_bytes_after_push(items, false));
        Some(projected + eager_extra <= self.cap)
    }

    /// The dropped-stacks stack, for a bulk stack over the memory cap; rows on it go to the
    /// dropped-stacks rows (see [`Profile::push_unindexed_row`]).
    #[cold]
    fn dropped_stack_id(&mut self) -> Result<StackId, ProfileError> {
        self.ensure_dropped_stack()?;
        Ok(StackId(self.t.dropped.stack))
    }

    /// Looks `frames` up in the address cache ahead of [`Profile::push_stack_unindexed`]: sets
    /// `hints` to the location id of every cached address frame (`NONE` for the others) and
    /// prefetches the location-index slot of each uncached one, so a caller working one stack
    /// behind overlaps those cache misses with its work on the previous stack, and does not look
    /// the cached frames up twice. (Location ids never change until the next reset, so a hint
    /// stays right even if its cache entry is evicted in between.)
    pub(crate) fn prefetch_stack(&self, frames: &[Frame<'_>], hints: &mut Vec<u32>) {
        hints.clear();
        let t = &self.t;
        if t.addr_cache.is_empty() {
            return;
        }
        let slots = &t.locations.index.slots;
        hints.extend(frames.iter().map(|f| match *f {
            Frame::Address(a) => {
                let (cached, id) = t.addr_cache[addr_cache_slot(a)];
                if cached == a && id != NONE {
                    return id;
                }
                if !slots.is_empty() {
                    let hash = hash_location(Location::Address(a));
                    prefetch(&slots[hash as usize & (slots.len() - 1)]);
                }
                NONE
            }
            Frame::Symbol { .. } => NONE,
        }));
    }

    /// Like [`Profile::prefetch_stack`], for a stack of address frames given as bare addresses
    /// (innermost first): fills `out` with the location id of every address the cache knows and
    /// notes the others, prefetching their location-index slots, for
    /// [`Profile::push_address_stack_unindexed`] one stack later.
    pub(crate) fn prefetch_addresses(&mut self, addresses: &[u64], out: &mut PrefetchedStack) {
        let PrefetchedStack { locs, misses } = out;
        locs.clear();
        misses.clear();
        let t = &mut self.t;
        if t.addr_cache.is_empty() {
            t.addr_cache = vec![(0, NONE); 1 << ADDR_CACHE_BITS];
        }
        let (cache, slots) = (&t.addr_cache, &t.locations.index.slots);
        // One `extend` of known length: no capacity check per frame.
        locs.extend(addresses.iter().enumerate().map(|(i, &a)| {
            let (cached, id) = cache[addr_cache_slot(a)];
            if cached == a && id != NONE {
                return id;
            }
            let hash = hash_location(Location::Address(a));
            if !slots.is_empty() {
                prefetch(&slots[hash as usize & (slots.len() - 1)]);
            }
            misses.push((i as u32, a, hash));
            NONE
        }));
    }

    /// [`Profile::push_stack_unindexed`] of the address stack `prefetched` was filled from by
    /// [`Profile::prefetch_addresses`] since the last reset (same result, without going through
    /// [`Frame`]s: only the addresses the cache did not know are looked up).
    pub(crate) fn push_address_stack_unindexed(
        &mut self,
        prefetched: &mut PrefetchedStack,
    ) -> Result<StackId, ProfileError> {
        if prefetched.locs.len() > MAX_FRAMES {
            return Err(ProfileError::TooManyFrames {
                got: prefetched.locs.len(),
                limit: MAX_FRAMES,
            });
        }
        self.sync_generation();
        let adds = Adds {
            locations: prefetched.misses.len(),
            ..Adds::default()
        };
        let Some(eager) = self.bulk_stack_room(prefetched.locs.len(), adds) else {
            return self.dropped_stack_id();
        };
        let t = &mut self.t;
        for &(pos, a, hash) in &prefetched.misses {
            let id = t.locations.intern(Location::Address(a), hash, "location")?;
            t.addr_cache[addr_cache_slot(a)] = (a, id);
            prefetched.locs[pos as usize] = id;
        }
        t.stacks
            .push_unindexed(&prefetched.locs, eager)
            .map(StackId)
    }

    /// Bulk path, part 2: interns a label set as [`Profile::add`] would (same validation, for
    /// an untimestamped sample). The id is valid until the next [`Profile::reset`].
    pub(crate) fn intern_label_set(
        &mut self,
        labels: &[Label<'_>],
    ) -> Result<LabelSetId, ProfileError> {
        self.sync_generation();
        let storage = self.storage.clone();
        let sample = Sample {
            frames: &[],
            values: &[],
            labels,
            end_timestamp_ns: 0,
        };
        let r = Resolver::new(storage.as_deref(), &self.t, &sample);
        self.validate(&r, &sample)?;
        if self.cap != usize::MAX {
            let mut adds = self.t.new_key_adds(&r, &sample)?;
            (adds.stacks, adds.keys, adds.rows, adds.indexed) = (0, 0, 0, false);
            if !self.fits(&adds) {
                // Rows on an unknown set go to the unlabeled dropped-stacks row.
                let mut ids = std::mem::take(&mut self.t.scratch);
                let found = self.t.find_label_set(&r, labels, &mut ids);
                self.t.scratch = ids;
                return Ok(LabelSetId(found?.unwrap_or(NONE)));
            }
        }
        let t = &mut self.t;
        let mut ids = std::mem::take(&mut t.scratch);
        ids.clear();
        let result =
            intern_labels(t, &r, labels, &mut ids).and_then(|()| t.label_sets.intern(&ids));
        t.scratch = ids;
        result.map(LabelSetId)
    }

    /// Bulk path, part 3: appends the untimestamped row (stack, labels) holding `values`, as the
    /// first [`Profile::add`] of a sample resolving to them would, but without looking it up or
    /// indexing it (the index catches up on the next lookup). The caller guarantees no row for
    /// (stack, labels) exists yet: `stack` came from [`Profile::push_stack_unindexed`] and each
    /// (stack, labels) gets one call; further values go through [`Profile::add_to_row`].
    pub(crate) fn push_unindexed_row(
        &mut self,
        stack: StackId,
        labels: LabelSetId,
        values: &[i64],
    ) -> Result<RowId, ProfileError> {
        let n = self.types.len();
        if values.len() != n {
            return Err(ProfileError::WrongValueCount {
                expected: n,
                got: values.len(),
            });
        }
        if stack.0 == self.t.dropped.stack
            || labels.0 == NONE
            || !self.fits(&Adds {
                rows: 1,
                ..Adds::default()
            })
        {
            let row = self.add_dropped(labels.0, values)?;
            return Ok(RowId(row | DROPPED_ROW));
        }
        let t = &mut self.t;
        debug_assert!((stack.0 as usize) < t.stacks.spans.len());
        debug_assert!((labels.0 as usize) < t.label_sets.spans.len());
        check_table_len(t.agg.len(), "aggregated sample")?;
        let row = t.agg.len() as u32;
        t.agg.push((stack.0, labels.0));
        t.agg_values.extend_from_slice(values);
        prefetch_past_end(&t.agg);
        prefetch_past_end(&t.agg_values);
        Ok(RowId(row))
    }

    /// Adds `values` to a row made by [`Profile::push_unindexed_row`], as another
    /// [`Profile::add`] of a sample resolving to it would.
    pub(crate) fn add_to_row(&mut self, row: RowId, values: &[i64]) -> Result<(), ProfileError> {
        let n = self.types.len();
        if values.len() != n {
            return Err(ProfileError::WrongValueCount {
                expected: n,
                got: values.len(),
            });
        }
        let (table, row) = if row.0 & DROPPED_ROW != 0 {
            let d = &mut self.t.dropped;
            d.samples += 1;
            (&mut d.values, row.0 & !DROPPED_ROW)
        } else {
            (&mut self.t.agg_values, row.0)
        };
        let start = row as usize * n;
        for (acc, v) in table[start..start + n].iter_mut().zip(values) {
            *acc = acc.saturating_add(*v);
        }
        Ok(())
    }

    /// Applies the values of a sample whose key is known.
    #[inline]
    fn record(&mut self, key: u32, sample: &Sample<'_>) -> Result<(), ProfileError> {
        let n = self.types.len();
        let k = self.t.keys[key as usize];
        if sample.end_timestamp_ns != 0 {
            if k.has_ts_label {
                return Err(ProfileError::ReservedLabelKey(
                    END_TIMESTAMP_LABEL.to_owned(),
                ));
            }
            let t = &self.t;
            // Only a push that grows the tables needs the cap's check.
            if (t.timed.len() == t.timed.capacity()
                || t.timed_values.capacity() - t.timed_values.len() < n)
                && !self.fits(&Adds {
                    timed: 1,
                    ..Adds::default()
                })
            {
                self.add_dropped(k.labels, sample.values)?;
                return Ok(());
            }
            let t = &mut self.t;
            t.timed.push(TimedRec {
                stack: k.stack,
                labels: k.labels,
                ts: sample.end_timestamp_ns,
            });
            t.timed_values.extend_from_slice(sample.values);
            return Ok(());
        }
        let row = if k.agg != NONE {
            k.agg
        } else {
            let new_row = Adds {
                rows: 1,
                indexed: true,
                ..Adds::default()
            };
            let row = if self.fits(&new_row) {
                self.t.agg_row(k.stack, k.labels, n)?
            } else if let Some(row) = self.t.find_agg_row(k.stack, k.labels) {
                row
            } else {
                self.add_dropped(k.labels, sample.values)?;
                return Ok(());
            };
            self.t.keys[key as usize].agg = row;
            row
        };
        let t = &mut self.t;
        let start = row as usize * n;
        for (acc, v) in t.agg_values[start..start + n].iter_mut().zip(sample.values) {
            *acc = acc.saturating_add(*v);
        }
        Ok(())
    }

    /// Adds a sample's values to the dropped-stacks row of label set `labels` (`NONE`: no label
    /// set) and counts it; returns the index of the row. A label set gets a row of its own while
    /// the cap allows; otherwise (and for `NONE`) the unlabeled row takes the values, and the cap
    /// always keeps room for that one (see [`Tables::projected_bytes`]).
    #[cold]
    fn add_dropped(&mut self, labels: u32, values: &[i64]) -> Result<u32, ProfileError> {
        self.ensure_dropped_stack()?;
        let n = self.types.len();
        let empty = self.t.dropped.empty_labels;
        let want = if labels == NONE { empty } else { labels };
        let mut row = self.t.dropped.row(want);
        if row == NONE {
            let own_row = Adds {
                dropped_rows: 1,
                dropped_map_len: want as usize + 1,
                ..Adds::default()
            };
            let target = if want == empty || self.t.projected_bytes(&own_row, n) <= self.cap {
                want
            } else {
                empty
            };
            row = self.t.dropped.row(target);
            if row == NONE {
                let d = &mut self.t.dropped;
                row = d.labels.len() as u32;
                d.labels.push(target);
                d.values.resize(d.values.len() + n, 0);
                if d.map.len() <= target as usize {
                    d.map.resize(target as usize + 1, NONE);
                }
                d.map[target as usize] = row;
            }
        }
        let d = &mut self.t.dropped;
        let start = row as usize * n;
        for (acc, v) in d.values[start..start + n].iter_mut().zip(values) {
            *acc = acc.saturating_add(*v);
        }
        d.samples += 1;
        Ok(row)
    }

    /// Creates the dropped-stacks stack and the empty label set, once per profile.
    fn ensure_dropped_stack(&mut self) -> Result<(), ProfileError> {
        let t = &mut self.t;
        if t.dropped.stack != NONE {
            return Ok(());
        }
        check_table_len(t.strings.len(), "string")?;
        let name = t.strings.intern(DROPPED_STACKS_FRAME);
        let func = Function { name, filename: 0 };
        let function = t.functions.intern(func, hash_function(func), "function")?;
        if t.function_src.len() < t.functions.items.len() {
            t.function_src.resize(t.functions.items.len(), NO_SOURCE);
        }
        let loc = Location::Symbol { function, line: 0 };
        let loc = t.locations.intern(loc, hash_location(loc), "location")?;
        // Appended without indexing: indexing now would index the bulk path's pending stacks.
        let stack = t.stacks.push_unindexed(&[loc], false)?;
        let empty = t.label_sets.intern(&[])?;
        t.dropped.stack = stack;
        t.dropped.empty_labels = empty;
        Ok(())
    }

    /// Over the cap, a sample that needs a new key: adds it to its own row if its stack, label
    /// set and row all exist already (a key missed only because the sample spells them
    /// differently: literals vs ids, ids after a generation change), to the dropped-stacks
    /// row otherwise. Changes no table but rows.
    #[cold]
    fn add_over_cap(&mut self, r: &Resolver<'_>, sample: &Sample<'_>) -> Result<(), ProfileError> {
        let (stack, labels) = self.t.find_existing(r, sample)?;
        if let (Some(stack), Some(labels)) = (stack, labels) {
            let n = self.types.len();
            let t = &mut self.t;
            if sample.end_timestamp_ns == 0 {
                if let Some(row) = t.find_agg_row(stack, labels) {
                    let start = row as usize * n;
                    for (acc, v) in t.agg_values[start..start + n].iter_mut().zip(sample.values) {
                        *acc = acc.saturating_add(*v);
                    }
                    return Ok(());
                }
            } else if t.timed.len() < t.timed.capacity()
                && t.timed_values.capacity() - t.timed_values.len() >= n
            {
                t.timed.push(TimedRec {
                    stack,
                    labels,
                    ts: sample.end_timestamp_ns,
                });
                t.timed_values.extend_from_slice(sample.values);
                return Ok(());
            }
        }
        self.add_dropped(labels.unwrap_or(NONE), sample.values)?;
        Ok(())
    }

    /// Slow path: validates the sample, resolves it into the tables and indexes its key.
    /// `None` when the memory cap sent the sample elsewhere (already added).
    #[cold]
    fn add_key(&mut self, hash: u64, sample: &Sample<'_>) -> Result<Option<u32>, ProfileError> {
        let storage = self.storage.clone();
        let r = Resolver::new(storage.as_deref(), &self.t, sample);
        self.validate(&r, sample)?;
        if self.cap != usize::MAX {
            let adds = self.t.new_key_adds(&r, sample)?;
            if !self.fits(&adds) {
                self.add_over_cap(&r, sample)?;
                return Ok(None);
            }
        }

        let t = &mut self.t;
        let mut locs = std::mem::take(&mut t.scratch);
        locs.clear();
        let result = (|| {
            intern_frames(t, &r, sample.frames, &mut locs)?;
            let stack = t.stacks.intern(&locs)?;
            locs.clear();
            intern_labels(t, &r, sample.labels, &mut locs)?;
            let labels = t.label_sets.intern(&locs)?;
            // The key may already be indexed under this hash, missed only because its ids were
            // not cached yet; reuse it rather than indexing a twin.
            let keys = &t.keys;
            if let Some(k) = t.key_index.find(hash, |k| {
                let k = keys[k as usize];
                k.stack == stack && k.labels == labels
            }) {
                return Ok(k);
            }
            check_table_len(t.keys.len(), "sample key")?;
            let end_ts = t.preset.end_timestamp;
            let has_ts_label = locs
                .iter()
                .any(|&l| t.labels.items[l as usize].key == end_ts);
            t.keys.push(KeyRec {
                stack,
                labels,
                agg: NONE,
                has_ts_label,
            });
            Ok(t.key_index.insert(hash))
        })();
        t.scratch = locs;
        result.map(Some)
    }

    /// Checks done before anything is added, so a bad sample leaves no trace: every storage id
    /// resolves, and the labels are well formed.
    fn validate(&self, r: &Resolver<'_>, sample: &Sample<'_>) -> Result<(), ProfileError> {
        let t = &self.t;
        for f in sample.frames {
            if let Frame::Symbol { name, filename, .. } = *f {
                text(t, r, name)?;
                text(t, r, filename)?;
            }
        }
        let labels = sample.labels;
        for (i, l) in labels.iter().enumerate() {
            let key = text(t, r, l.key)?;
            if key.is_empty() {
                return Err(ProfileError::EmptyLabelKey);
            }
            if key == LOCAL_ROOT_SPAN_ID_LABEL {
                if let LabelValue::Str(v) = l.value {
                    let v = text(t, r, v)?.to_owned();
                    return Err(ProfileError::StringLocalRootSpanId(v));
                }
            }
            if key == END_TIMESTAMP_LABEL && sample.end_timestamp_ns != 0 {
                return Err(ProfileError::ReservedLabelKey(key.to_owned()));
            }
            if labels.len() <= 16 {
                for other in &labels[..i] {
                    if text(t, r, other.key)? == key {
                        return Err(ProfileError::DuplicateLabelKey(key.to_owned()));
                    }
                }
            }
        }
        if labels.len() > 16 {
            // Many labels: a set instead of comparing every pair.
            let mut seen = std::collections::HashSet::with_capacity(labels.len());
            for l in labels {
                let key = text(t, r, l.key)?;
                if !seen.insert(key) {
                    return Err(ProfileError::DuplicateLabelKey(key.to_owned()));
                }
            }
        }
        Ok(())
    }

    /// Associates an endpoint with a local root span id (last call wins) and counts it.
    ///
    /// The mapping is kept for a root that samples of this profile carry already, and for the
    /// last [`LATE_ENDPOINTS`] others (samples of a request may be recorded shortly after it
    /// ended): a service naming every request keeps memory in proportion to the requests it
    /// sampled, not to all it served.
    pub fn set_endpoint(
        &mut self,
        local_root_span_id: u64,
        endpoint: &str,
    ) -> Result<(), ProfileError> {
        check_table_len(self.t.strings.len(), "string")?;
        let endpoint = self.bounded_endpoint(endpoint);
        let id = self.t.strings.intern(endpoint);
        let t = &mut self.t;
        let rec = LabelRec {
            key: t.preset.local_root_span_id,
            str: NONE,
            num: local_root_span_id as i64,
        };
        if t.labels.find(rec, hash_label(rec)).is_some() {
            t.endpoints.insert(local_root_span_id, id);
        } else if t.late_endpoints.insert(local_root_span_id, id).is_none() {
            t.late_order.push_back(local_root_span_id);
            if t.late_order.len() > LATE_ENDPOINTS {
                if let Some(old) = t.late_order.pop_front() {
                    t.late_endpoints.remove(&old);
                }
            }
        }
        self.add_endpoint_count(endpoint, 1)
    }

    /// `endpoint`, or [`OTHER_ENDPOINTS`] when the profile holds [`MAX_ENDPOINT_NAMES`] others.
    fn bounded_endpoint<'e>(&self, endpoint: &'e str) -> &'e str {
        let counts = &self.t.endpoint_counts;
        if counts.len() >= MAX_ENDPOINT_NAMES && !counts.contains_key(endpoint) {
            OTHER_ENDPOINTS
        } else {
            endpoint
        }
    }

    /// Adds `value` to the endpoint's count (reported in `EncodedProfile::endpoint_counts`);
    /// past [`MAX_ENDPOINT_NAMES`] names, to [`OTHER_ENDPOINTS`].
    pub fn add_endpoint_count(&mut self, endpoint: &str, value: i64) -> Result<(), ProfileError> {
        let endpoint = self.bounded_endpoint(endpoint);
        match self.t.endpoint_counts.get_mut(endpoint) {
            Some(c) => *c = c.saturating_add(value),
            None => {
                self.t.endpoint_counts.insert(endpoint.to_owned(), value);
            }
        }
        Ok(())
    }

    /// Distinct aggregated samples plus timestamped samples held.
    pub fn sample_count(&self) -> usize {
        self.t.agg.len() + self.t.timed.len() + self.t.dropped.labels.len()
    }

    /// Bytes held by the profile's tables, for memory reporting.
    pub fn memory_bytes(&self) -> usize {
        self.t.memory_bytes()
    }

    /// Drops all samples, endpoints and interned data; the profile restarts at `start`.
    pub fn reset(&mut self, start: SystemTime) {
        let generation = self.storage.as_ref().map_or(0, |s| s.generation());
        self.t = Tables::new(&self.types, generation);
        self.start = start;
    }

    /// [`Profile::reset`], keeping the allocations a bulk add fills in `spare`, for the next
    /// [`Profile::reserve_unindexed`] (of this profile or another one).
    pub(crate) fn reset_into(&mut self, start: SystemTime, spare: &mut BulkBuffers) {
        let t = &mut self.t;
        *spare = BulkBuffers {
            agg: recycle(&mut t.agg),
            agg_values: recycle(&mut t.agg_values),
            stack_items: recycle(&mut t.stacks.items),
            stack_spans: recycle(&mut t.stacks.spans),
            locations: recycle(&mut t.locations.items),
            // Emptied (filled) when adopted.
            location_slots: std::mem::take(&mut t.locations.index.slots),
            location_hashes: recycle(&mut t.locations.index.hashes),
        };
        self.reset(start);
    }

    /// Encodes as pprof with `time_nanos` = start and `duration_nanos` = `end` - start.
    pub fn encode(
        &self,
        end: SystemTime,
        opts: &EncodeOptions,
        symbolizer: Option<&mut dyn Symbolizer>,
    ) -> Result<EncodedProfile, ProfileError> {
        let mut w = PbWriter::new(opts.compression)?;
        let t = &self.t;
        let mut extras = Extras::build(t, symbolizer)?;
        // Interned before the string table is written: the period type may be a type the
        // profile does not carry.
        let default_type = match self.metadata.default_sample_type {
            Some(ty) => extras.string(t, ty.name())?,
            None => 0,
        };
        let period = match self.metadata.period {
            Some((ty, period)) => Some((
                extras.string(t, ty.name())?,
                extras.string(t, ty.unit())?,
                period,
            )),
            None => None,
        };
        let label_bytes = encode_label_sets(t);

        for &(ty, unit) in &t.preset.types {
            let len = varint_field_len(ty as u64) + varint_field_len(unit as u64);
            w.len_header(field::PROFILE_SAMPLE_TYPE, len);
            w.uint_field(field::VALUE_TYPE_TYPE, ty as u64);
            w.uint_field(field::VALUE_TYPE_UNIT, unit as u64);
        }

        let ids = LocationIds::by_use(t);
        let n = self.types.len();
        for (row, &(stack, labels)) in t.agg.iter().enumerate() {
            let values = &t.agg_values[row * n..row * n + n];
            write_sample(&mut w, t, &ids, &label_bytes, stack, labels, values, None)?;
        }
        let d = &t.dropped;
        for (row, &labels) in d.labels.iter().enumerate() {
            let values = &d.values[row * n..row * n + n];
            write_sample(&mut w, t, &ids, &label_bytes, d.stack, labels, values, None)?;
        }
        for (i, rec) in t.timed.iter().enumerate() {
            let values = &t.timed_values[i * n..i * n + n];
            let ts_label = (t.preset.end_timestamp, rec.ts);
            let (stack, labels) = (rec.stack, rec.labels);
            write_sample(
                &mut w,
                t,
                &ids,
                &label_bytes,
                stack,
                labels,
                values,
                Some(ts_label),
            )?;
        }

        for (i, m) in extras.mappings.iter().enumerate() {
            write_mapping(&mut w, i as u64 + 1, m);
        }
        w.maybe_flush()?;

        for (pos, &i) in ids.order.iter().enumerate() {
            let id = pos as u64 + 1;
            let i = i as usize;
            match t.locations.items[i] {
                Location::Symbol { function, line } => {
                    write_location(&mut w, id, 0, 0, &[(function, line)]);
                }
                Location::Address(a) => {
                    let mapping = extras.mapping_of(i);
                    write_location(&mut w, id, mapping, a, extras.lines_of(i));
                }
            }
            w.maybe_flush()?;
        }

        let own = t.functions.items.iter().map(|f| ExtraFunction {
            name: f.name,
            system_name: 0,
            filename: f.filename,
            start_line: 0,
        });
        for (i, f) in own.chain(extras.functions.iter().copied()).enumerate() {
            write_function(&mut w, i as u64 + 1, f);
            w.maybe_flush()?;
        }

        for i in 0..t.strings.len() {
            w.bytes_field(
                field::PROFILE_STRING_TABLE,
                t.strings.get(i as u32).as_bytes(),
            );
            w.maybe_flush()?;
        }
        for s in &extras.strings {
            w.bytes_field(field::PROFILE_STRING_TABLE, s.as_bytes());
            w.maybe_flush()?;
        }

        let time_nanos = self
            .start
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or(Duration::ZERO);
        // A clock that went backwards gives a zero duration rather than a failed profile.
        let duration = end.duration_since(self.start).unwrap_or(Duration::ZERO);
        w.int_field(field::PROFILE_TIME_NANOS, saturating_nanos(time_nanos));
        w.int_field(field::PROFILE_DURATION_NANOS, saturating_nanos(duration));
        if let Some((ty, unit, period)) = period {
            let len = varint_field_len(ty as u64) + varint_field_len(unit as u64);
            w.len_header(field::PROFILE_PERIOD_TYPE, len);
            w.uint_field(field::VALUE_TYPE_TYPE, ty as u64);
            w.uint_field(field::VALUE_TYPE_UNIT, unit as u64);
            w.int_field(field::PROFILE_PERIOD, period);
        }
        w.uint_field(field::PROFILE_DEFAULT_SAMPLE_TYPE, default_type as u64);

        let bytes = w.finish()?;
        let mut endpoint_counts: Vec<(String, i64)> = t
            .endpoint_counts
            .iter()
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        endpoint_counts.sort();
        Ok(EncodedProfile {
            start: self.start,
            end,
            bytes,
            compression: opts.compression,
            endpoint_counts,
        })
    }
}

fn saturating_nanos(d: Duration) -> i64 {
    i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)
}

fn label_len(key: u32, str: u32, num: i64) -> usize {
    varint_field_len(key as u64) + varint_field_len(str as u64) + varint_field_len(num as u64)
}

fn push_label(out: &mut Vec<u8>, key: u32, str: u32, num: i64) {
    fn varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }
    let len = label_len(key, str, num);
    out.push((field::SAMPLE_LABEL << 3) | 2);
    varint(out, len as u64);
    for (f, v) in [
        (field::LABEL_KEY, key as u64),
        (field::LABEL_STR, str as u64),
        (field::LABEL_NUM, num as u64),
    ] {
        if v != 0 {
            out.push(f << 3);
            varint(out, v);
        }
    }
}

/// Encoded `Sample.label` fields of every label set (endpoint label included), back to back.
struct LabelBytes {
    bytes: Vec<u8>,
    spans: Vec<(u32, u32)>,
}

impl LabelBytes {
    fn get(&self, set: u32) -> &[u8] {
        let (off, len) = self.spans[set as usize];
        &self.bytes[off as usize..(off + len) as usize]
    }
}

fn encode_label_sets(t: &Tables) -> LabelBytes {
    let mut out = LabelBytes {
        bytes: Vec::new(),
        spans: Vec::with_capacity(t.label_sets.spans.len()),
    };
    for set in 0..t.label_sets.spans.len() {
        let start = out.bytes.len();
        let mut span_id = None;
        let mut has_endpoint = false;
        for &lid in t.label_sets.get(set as u32) {
            let l = t.labels.items[lid as usize];
            let str = if l.str == NONE { 0 } else { l.str };
            push_label(&mut out.bytes, l.key, str, l.num);
            if l.key == t.preset.local_root_span_id && l.str == NONE {
                span_id = Some(l.num as u64);
            }
            has_endpoint |= l.key == t.preset.trace_endpoint;
        }
        // A sample that already names its endpoint keeps it; never two `trace endpoint` labels.
        if let (Some(span), false) = (span_id, has_endpoint) {
            let ep = t
                .endpoints
                .get(&span)
                .or_else(|| t.late_endpoints.get(&span));
            if let Some(&ep) = ep {
                push_label(&mut out.bytes, t.preset.trace_endpoint, ep, 0);
            }
        }
        out.spans
            .push((start as u32, (out.bytes.len() - start) as u32));
    }
    out
}

#[allow(clippy::too_many_arguments)]
fn write_sample(
    w: &mut PbWriter,
    t: &Tables,
    ids: &LocationIds,
    label_bytes: &LabelBytes,
    stack: u32,
    labels: u32,
    values: &[i64],
    ts_label: Option<(u32, i64)>,
) -> Result<(), ProfileError> {
    let locs = t.stacks.get(stack);
    let labels = label_bytes.get(labels);
    let locs_len: usize = locs.iter().map(|&l| varint_len(ids.id(l) as u64)).sum();
    let values_len: usize = values.iter().map(|&v| varint_len(v as u64)).sum();
    let ts_len = ts_label.map_or(0, |(k, ts)| len_field_len(label_len(k, 0, ts)));
    let mut len = labels.len() + ts_len;
    if !locs.is_empty() {
        len += len_field_len(locs_len);
    }
    if !values.is_empty() {
        len += len_field_len(values_len);
    }
    w.len_header(field::PROFILE_SAMPLE, len);
    if !locs.is_empty() {
        w.len_header(field::SAMPLE_LOCATION_ID, locs_len);
        for &l in locs {
            w.varint(ids.id(l) as u64);
        }
    }
    if !values.is_empty() {
        w.len_header(field::SAMPLE_VALUE, values_len);
        for &v in values {
            w.varint(v as u64);
        }
    }
    w.raw(labels);
    if let Some((k, ts)) = ts_label {
        w.len_header(field::SAMPLE_LABEL, label_len(k, 0, ts));
        w.uint_field(field::LABEL_KEY, k as u64);
        w.int_field(field::LABEL_NUM, ts);
    }
    w.maybe_flush()
}

/// pprof ids of the locations, most used first: ids below 128 take one byte in every sample
/// that names them, which shrinks the samples (the bulk of a profile) noticeably. Locations no
/// sample uses are left out.
struct LocationIds {
    /// Location index -> pprof id (1-based; 0 = unused).
    id_of: Vec<u32>,
    /// pprof id - 1 -> location index.
    order: Vec<u32>,
}

impl LocationIds {
    fn by_use(t: &Tables) -> LocationIds {
        let mut stack_uses = vec![0u64; t.stacks.spans.len()];
        for &(stack, _) in &t.agg {
            stack_uses[stack as usize] += 1;
        }
        for rec in &t.timed {
            stack_uses[rec.stack as usize] += 1;
        }
        if t.dropped.stack != NONE {
            stack_uses[t.dropped.stack as usize] += t.dropped.labels.len() as u64;
        }
        let mut uses = vec![0u64; t.locations.items.len()];
        for (stack, &n) in stack_uses.iter().enumerate() {
            if n > 0 {
                for &l in t.stacks.get(stack as u32) {
                    uses[l as usize] += n;
                }
            }
        }
        let mut order: Vec<u32> = (0..uses.len() as u32)
            .filter(|&l| uses[l as usize] > 0)
            .collect();
        // Stable: equally used locations keep their first-seen order.
        order.sort_by_key(|&l| std::cmp::Reverse(uses[l as usize]));
        let mut id_of = vec![0u32; uses.len()];
        for (pos, &l) in order.iter().enumerate() {
            id_of[l as usize] = pos as u32 + 1;
        }
        LocationIds { id_of, order }
    }

    #[inline]
    fn id(&self, location: u32) -> u32 {
        self.id_of[location as usize]
    }
}

/// A location; `mapping` is its mapping's pprof id (0: none).
fn write_location(w: &mut PbWriter, id: u64, mapping: u64, address: u64, lines: &[(u32, i64)]) {
    let line_len = |&(f, l): &(u32, i64)| -> usize {
        varint_field_len(f as u64 + 1) + varint_field_len(l as u64)
    };
    let len = varint_field_len(id)
        + varint_field_len(mapping)
        + varint_field_len(address)
        + lines
            .iter()
            .map(|l| len_field_len(line_len(l)))
            .sum::<usize>();
    w.len_header(field::PROFILE_LOCATION, len);
    w.uint_field(field::LOCATION_ID, id);
    w.uint_field(field::LOCATION_MAPPING_ID, mapping);
    w.uint_field(field::LOCATION_ADDRESS, address);
    for l in lines {
        w.len_header(field::LOCATION_LINE, line_len(l));
        w.uint_field(field::LINE_FUNCTION_ID, l.0 as u64 + 1);
        w.int_field(field::LINE_LINE, l.1);
    }
}

fn write_function(w: &mut PbWriter, id: u64, f: ExtraFunction) {
    let len = varint_field_len(id)
        + varint_field_len(f.name as u64)
        + varint_field_len(f.system_name as u64)
        + varint_field_len(f.filename as u64)
        + varint_field_len(f.start_line as u64);
    w.len_header(field::PROFILE_FUNCTION, len);
    w.uint_field(field::FUNCTION_ID, id);
    w.uint_field(field::FUNCTION_NAME, f.name as u64);
    w.uint_field(field::FUNCTION_SYSTEM_NAME, f.system_name as u64);
    w.uint_field(field::FUNCTION_FILENAME, f.filename as u64);
    w.int_field(field::FUNCTION_START_LINE, f.start_line);
}

fn write_mapping(w: &mut PbWriter, id: u64, m: &MappingRec) {
    let flags = [
        (field::MAPPING_HAS_FUNCTIONS, m.info.has_functions),
        (field::MAPPING_HAS_FILENAMES, m.info.has_filenames),
        (field::MAPPING_HAS_LINE_NUMBERS, m.info.has_line_numbers),
        (field::MAPPING_HAS_INLINE_FRAMES, m.info.has_inline_frames),
    ];
    let len = varint_field_len(id)
        + varint_field_len(m.info.memory_start)
        + varint_field_len(m.info.memory_limit)
        + varint_field_len(m.info.file_offset)
        + varint_field_len(m.filename as u64)
        + varint_field_len(m.build_id as u64)
        + flags
            .iter()
            .map(|&(_, b)| varint_field_len(b as u64))
            .sum::<usize>();
    w.len_header(field::PROFILE_MAPPING, len);
    w.uint_field(field::MAPPING_ID, id);
    w.uint_field(field::MAPPING_MEMORY_START, m.info.memory_start);
    w.uint_field(field::MAPPING_MEMORY_LIMIT, m.info.memory_limit);
    w.uint_field(field::MAPPING_FILE_OFFSET, m.info.file_offset);
    w.uint_field(field::MAPPING_FILENAME, m.filename as u64);
    w.uint_field(field::MAPPING_BUILD_ID, m.build_id as u64);
    for (f, b) in flags {
        w.uint_field(f, b as u64);
    }
}

/// A function as written: the profile's own carry a name and a file only.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
struct ExtraFunction {
    name: u32,
    system_name: u32,
    filename: u32,
    start_line: i64,
}

/// A mapping as written, its strings interned.
struct MappingRec {
    info: MappingInfo,
    filename: u32,
    build_id: u32,
}

/// Functions, strings and mappings that only symbolization at encode time brings in. Their ids
/// continue after the profile's own tables.
#[derive(Default)]
struct Extras {
    strings: Vec<String>,
    string_ids: HashMap<String, u32, foldhash::fast::RandomState>,
    functions: Vec<ExtraFunction>,
    function_ids: HashMap<ExtraFunction, u32, foldhash::fast::RandomState>,
    /// (function id, line) of symbolized addresses, innermost first.
    lines: Vec<(u32, i64)>,
    /// Per location: span in `lines` (empty for symbol locations and unknown addresses).
    spans: Vec<(u32, u32)>,
    /// The mappings locations fall in, by memory start (the main program, loaded lowest in
    /// the usual layouts, comes first, where viewers look for it).
    mappings: Vec<MappingRec>,
    /// Per location: index in `mappings` + 1 (0: none).
    location_mappings: Vec<u32>,
}

impl Extras {
    fn build(t: &Tables, symbolizer: Option<&mut dyn Symbolizer>) -> Result<Extras, ProfileError> {
        let mut x = Extras::default();
        let Some(sym) = symbolizer else {
            return Ok(x);
        };
        let addresses: Vec<u64> = t
            .locations
            .items
            .iter()
            .filter_map(|l| match *l {
                Location::Address(a) => Some(a),
                _ => None,
            })
            .collect();
        sym.prepare(&addresses);
        drop(addresses);
        let mut out: Vec<ResolvedFrame> = Vec::new();
        x.spans = vec![(0, 0); t.locations.items.len()];
        x.location_mappings = vec![0; t.locations.items.len()];
        // (memory start, limit, file offset) -> index in `mappings` + 1.
        let mut mapping_ids: HashMap<(u64, u64, u64), u32, foldhash::fast::RandomState> =
            HashMap::default();
        for (i, loc) in t.locations.items.iter().enumerate() {
            let Location::Address(addr) = *loc else {
                continue;
            };
            out.clear();
            sym.symbolize(addr, &mut out);
            let start = x.lines.len();
            for f in &out {
                let function = ExtraFunction {
                    name: x.string(t, &f.name)?,
                    system_name: x.string(t, &f.system_name)?,
                    filename: x.string(t, &f.filename)?,
                    start_line: f.start_line,
                };
                let function = x.function(t, function)?;
                x.lines.push((function, f.line));
            }
            x.spans[i] = (start as u32, (x.lines.len() - start) as u32);
            if let Some(m) = sym.mapping(addr) {
                let key = (m.memory_start, m.memory_limit, m.file_offset);
                let id = match mapping_ids.get(&key) {
                    Some(&id) => id,
                    None => {
                        let m = m.clone();
                        let rec = MappingRec {
                            filename: x.string(t, &m.filename)?,
                            build_id: x.string(t, &m.build_id)?,
                            info: m,
                        };
                        x.mappings.push(rec);
                        mapping_ids.insert(key, x.mappings.len() as u32);
                        x.mappings.len() as u32
                    }
                };
                x.location_mappings[i] = id;
            }
        }
        if x.mappings.len() > 1 {
            let mut order: Vec<u32> = (0..x.mappings.len() as u32).collect();
            order.sort_by_key(|&k| x.mappings[k as usize].info.memory_start);
            let mut new_id = vec![0u32; order.len() + 1];
            for (pos, &k) in order.iter().enumerate() {
                new_id[k as usize + 1] = pos as u32 + 1;
            }
            for m in &mut x.location_mappings {
                *m = new_id[*m as usize];
            }
            // Stable, by the same key: the same permutation as `order`.
            x.mappings.sort_by_key(|m| m.info.memory_start);
        }
        Ok(x)
    }

    fn string(&mut self, t: &Tables, s: &str) -> Result<u32, ProfileError> {
        if let Some(id) = t.strings.find(s) {
            return Ok(id);
        }
        if let Some(&id) = self.string_ids.get(s) {
            return Ok(id);
        }
        let next = t.strings.len() + self.strings.len();
        check_table_len(next, "string")?;
        self.strings.push(s.to_owned());
        self.string_ids.insert(s.to_owned(), next as u32);
        Ok(next as u32)
    }

    fn function(&mut self, t: &Tables, f: ExtraFunction) -> Result<u32, ProfileError> {
        if f.system_name == 0 && f.start_line == 0 {
            // What the profile's own functions carry: the same function when it names one.
            let own = Function {
                name: f.name,
                filename: f.filename,
            };
            if let Some(id) = t.functions.find(own, hash_function(own)) {
                return Ok(id);
            }
        }
        if let Some(&id) = self.function_ids.get(&f) {
            return Ok(id);
        }
        let next = t.functions.items.len() + self.functions.len();
        check_table_len(next, "function")?;
        self.functions.push(f);
        self.function_ids.insert(f, next as u32);
        Ok(next as u32)
    }

    /// The pprof id of the mapping of location `location` (0: none).
    fn mapping_of(&self, location: usize) -> u64 {
        self.location_mappings
            .get(location)
            .map_or(0, |&m| m as u64)
    }

    fn lines_of(&self, location: usize) -> &[(u32, i64)] {
        match self.spans.get(location) {
            Some(&(off, len)) => &self.lines[off as usize..(off + len) as usize],
            None => &[],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pprof::Compression;

    const TYPES: [SampleType; 2] = [SampleType::CpuSamples, SampleType::WallTime];

    fn t0() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000)
    }

    fn profile() -> Profile {
        Profile::new(&TYPES, None, t0())
    }

    fn decode(p: &Profile) -> ferroprof_pprof::Profile {
        let opts = EncodeOptions {
            compression: Compression::None,
        };
        let enc = p
            .encode(t0() + Duration::from_secs(60), &opts, None)
            .unwrap();
        ferroprof_pprof::decode(&enc.bytes).unwrap()
    }

    fn add(p: &mut Profile, frames: &[Frame<'_>], values: &[i64], labels: &[Label<'_>], ts: i64) {
        p.add(&Sample {
            frames,
            values,
            labels,
            end_timestamp_ns: ts,
        })
        .unwrap();
    }

    #[test]
    fn aggregates_by_stack_and_labels() {
        let mut p = profile();
        let a = [Frame::sym("leaf", "a.rs", 1), Frame::sym("main", "m.rs", 9)];
        let b = [
            Frame::sym("other", "a.rs", 2),
            Frame::sym("main", "m.rs", 9),
        ];
        let l1 = [Label::num("thread id", 1)];
        let l2 = [Label::num("thread id", 2)];
        add(&mut p, &a, &[1, 10], &l1, 0);
        add(&mut p, &a, &[2, 20], &l1, 0);
        add(&mut p, &a, &[4, 40], &l2, 0);
        add(&mut p, &b, &[8, 80], &l1, 0);
        assert_eq!(p.sample_count(), 3);
        let d = decode(&p);
        assert_eq!(d.sample.len(), 3);
        assert_eq!(d.total("cpu-samples"), Some(15));
        assert_eq!(d.total("wall-time"), Some(150));
        let s0 = &d.sample[0];
        assert_eq!(d.stack_names(s0), vec!["leaf", "main"]);
        assert_eq!(s0.value, vec![3, 30]);
        assert_eq!(d.label_num(s0, "thread id"), Some(1));
        // "main" is one function and one location shared by both stacks.
        assert_eq!(d.function.len(), 3);
        assert_eq!(d.location.len(), 3);
        assert!(d.mapping.is_empty());
    }

    #[test]
    fn timestamped_samples_stay_separate() {
        let mut p = profile();
        let f = [Frame::sym("f", "f.rs", 1)];
        add(&mut p, &f, &[1, 1], &[], 100);
        add(&mut p, &f, &[1, 1], &[], 200);
        add(&mut p, &f, &[1, 1], &[], 0);
        assert_eq!(p.sample_count(), 3);
        let d = decode(&p);
        let ts: Vec<Option<i64>> = d
            .sample
            .iter()
            .map(|s| d.label_num(s, END_TIMESTAMP_LABEL))
            .collect();
        assert_eq!(ts, vec![None, Some(100), Some(200)]);
    }

    #[test]
    fn validation_errors_leave_profile_unchanged() {
        let mut p = profile();
        let f = [Frame::sym("f", "f.rs", 1)];
        add(&mut p, &f, &[1, 1], &[Label::str("k", "v")], 0);
        let before = decode(&p);
        let try_add = |p: &mut Profile, values: &[i64], labels: &[Label<'_>], ts: i64| {
            p.add(&Sample {
                frames: &f,
                values,
                labels,
                end_timestamp_ns: ts,
            })
        };
        assert_eq!(
            try_add(&mut p, &[1], &[], 0),
            Err(ProfileError::WrongValueCount {
                expected: 2,
                got: 1
            })
        );
        assert_eq!(
            try_add(
                &mut p,
                &[1, 1],
                &[Label::str("k", "a"), Label::num("k", 2)],
                0
            ),
            Err(ProfileError::DuplicateLabelKey("k".into()))
        );
        assert_eq!(
            try_add(
                &mut p,
                &[1, 1],
                &[Label::str(LOCAL_ROOT_SPAN_ID_LABEL, "12")],
                0
            ),
            Err(ProfileError::StringLocalRootSpanId("12".into()))
        );
        assert_eq!(
            try_add(&mut p, &[1, 1], &[Label::num("", 1)], 0),
            Err(ProfileError::EmptyLabelKey)
        );
        assert_eq!(
            try_add(&mut p, &[1, 1], &[], -5),
            Err(ProfileError::NegativeTimestamp(-5))
        );
        assert_eq!(
            try_add(&mut p, &[1, 1], &[Label::num(END_TIMESTAMP_LABEL, 1)], 7),
            Err(ProfileError::ReservedLabelKey(END_TIMESTAMP_LABEL.into()))
        );
        let many = vec![Frame::Address(1); MAX_FRAMES + 1];
        assert_eq!(
            p.add(&Sample {
                frames: &many,
                values: &[1, 1],
                labels: &[],
                end_timestamp_ns: 0
            }),
            Err(ProfileError::TooManyFrames {
                got: MAX_FRAMES + 1,
                limit: MAX_FRAMES
            })
        );
        assert_eq!(
            p.add(&Sample {
                frames: &[Frame::ids(StringId::from_raw(3), StringId::EMPTY, 1)],
                values: &[1, 1],
                labels: &[],
                end_timestamp_ns: 0
            }),
            Err(ProfileError::NoStringStorage(3))
        );
        assert_eq!(p.sample_count(), 1);
        assert_eq!(decode(&p), before);
    }

    #[test]
    fn reserved_timestamp_label_is_checked_on_known_keys_too() {
        let mut p = profile();
        let f = [Frame::sym("f", "f.rs", 1)];
        let l = [Label::num(END_TIMESTAMP_LABEL, 3)];
        // Untimestamped, the label is the caller's own business.
        add(&mut p, &f, &[1, 1], &l, 0);
        let timed = Sample {
            frames: &f,
            values: &[1, 1],
            labels: &l,
            end_timestamp_ns: 9,
        };
        assert_eq!(
            p.add(&timed),
            Err(ProfileError::ReservedLabelKey(END_TIMESTAMP_LABEL.into()))
        );
        assert_eq!(p.sample_count(), 1);
    }

    #[test]
    fn duplicate_keys_among_many_labels() {
        let keys: Vec<String> = (0..40).map(|i| format!("k{i}")).collect();
        let mut labels: Vec<Label<'_>> = keys.iter().map(|k| Label::num(k, 1)).collect();
        let mut p = profile();
        add(&mut p, &[], &[1, 1], &labels, 0);
        labels.push(Label::str("k7", "again"));
        assert_eq!(
            p.add(&Sample {
                frames: &[],
                values: &[1, 1],
                labels: &labels,
                end_timestamp_ns: 0
            }),
            Err(ProfileError::DuplicateLabelKey("k7".into()))
        );
    }

    #[test]
    fn ids_resolve_through_storage_and_aggregate_with_literals() {
        let st = Arc::new(StringStorage::new());
        let mut p = Profile::new(&TYPES, Some(st.clone()), t0());
        let name = st.intern("alloc_here").unwrap();
        let file = st.intern("alloc.rs").unwrap();
        let key = st.intern("thread name").unwrap();
        let val = st.intern("worker").unwrap();
        let id_frames = [Frame::ids(name, file, 3)];
        let id_labels = [Label {
            key: Str::Id(key),
            value: LabelValue::Str(Str::Id(val)),
        }];
        add(&mut p, &id_frames, &[1, 1], &id_labels, 0);
        add(&mut p, &id_frames, &[1, 1], &id_labels, 0);
        add(
            &mut p,
            &[Frame::sym("alloc_here", "alloc.rs", 3)],
            &[1, 1],
            &[Label::str("thread name", "worker")],
            0,
        );
        assert_eq!(p.sample_count(), 1);
        let d = decode(&p);
        assert_eq!(d.sample[0].value, vec![3, 3]);
        assert_eq!(d.stack(&d.sample[0])[0].filename, "alloc.rs");
        assert_eq!(d.label_str(&d.sample[0], "thread name"), Some("worker"));
        // Unknown id: a typed error naming it.
        // Unknown id after a good literal frame: nothing of the sample is kept.
        let before = decode(&p);
        let bad = [
            Frame::sym("fresh_literal", "fresh.rs", 1),
            Frame::ids(StringId::from_raw(999), file, 1),
        ];
        assert_eq!(
            p.add(&Sample {
                frames: &bad,
                values: &[1, 1],
                labels: &[],
                end_timestamp_ns: 0
            }),
            Err(ProfileError::String(StringError::UnknownId(999)))
        );
        assert_eq!(decode(&p), before);
    }

    #[test]
    fn reused_ids_after_generation_advance_resolve_to_the_new_string() {
        let st = Arc::new(StringStorage::new());
        let mut p = Profile::new(&TYPES, Some(st.clone()), t0());
        let old = st.intern("old_fn").unwrap();
        add(
            &mut p,
            &[Frame::ids(old, StringId::EMPTY, 1)],
            &[1, 0],
            &[],
            0,
        );
        st.unintern(old).unwrap();
        st.advance_generation();
        let new = st.intern("new_fn").unwrap();
        assert_eq!(new, old, "the test relies on id reuse");
        add(
            &mut p,
            &[Frame::ids(new, StringId::EMPTY, 1)],
            &[2, 0],
            &[],
            0,
        );
        let d = decode(&p);
        let mut got: Vec<(String, i64)> = d
            .sample
            .iter()
            .map(|s| (d.stack_names(s)[0].clone(), s.value[0]))
            .collect();
        got.sort();
        assert_eq!(got, vec![("new_fn".into(), 2), ("old_fn".into(), 1)]);
    }

    #[test]
    fn hash_collisions_never_merge_samples() {
        // 44 bytes differing only at byte 16, which the sample-key hash does not read.
        let a = format!("{}A{}", "p".repeat(16), "s".repeat(27));
        let b = format!("{}B{}", "p".repeat(16), "s".repeat(27));
        assert_eq!(
            sample_key_hash(&[Frame::sym(&a, "x.rs", 1)], &[]),
            sample_key_hash(&[Frame::sym(&b, "x.rs", 1)], &[]),
            "the test needs a real collision"
        );
        let mut p = profile();
        for _ in 0..3 {
            add(&mut p, &[Frame::sym(&a, "x.rs", 1)], &[1, 0], &[], 0);
            add(&mut p, &[Frame::sym(&b, "x.rs", 1)], &[10, 0], &[], 0);
        }
        let d = decode(&p);
        assert_eq!(d.sample.len(), 2);
        for s in &d.sample {
            let name = &d.stack_names(s)[0];
            assert_eq!(s.value[0], if *name == a { 3 } else { 30 });
        }
    }

    #[test]
    fn endpoints_of_unsampled_requests_are_bounded_and_late_samples_named() {
        let mut p = profile();
        let f = [Frame::sym("handler", "h.rs", 1)];
        // Named before any of its samples (recorded a little after the request ended).
        p.set_endpoint(1, "GET /late").unwrap();
        // Many requests nothing sampled: counted, their mappings not all kept.
        for root in 100..100 + 3 * LATE_ENDPOINTS as u64 {
            p.set_endpoint(root, "GET /busy").unwrap();
        }
        assert!(p.t.endpoints.is_empty());
        assert_eq!(p.t.late_endpoints.len(), LATE_ENDPOINTS);
        assert_eq!(p.t.late_order.len(), LATE_ENDPOINTS);
        // The most recent unsampled request's samples still get its endpoint; root 1 went.
        let last = 100 + 3 * LATE_ENDPOINTS as i64 - 1;
        for root in [1, last] {
            add(
                &mut p,
                &f,
                &[1, 0],
                &[Label::num(LOCAL_ROOT_SPAN_ID_LABEL, root)],
                0,
            );
        }
        let enc = p
            .encode(
                t0(),
                &EncodeOptions {
                    compression: Compression::None,
                },
                None,
            )
            .unwrap();
        assert_eq!(
            enc.endpoint_counts,
            vec![
                ("GET /busy".into(), 3 * LATE_ENDPOINTS as i64),
                ("GET /late".into(), 1)
            ]
        );
        let d = ferroprof_pprof::decode(&enc.bytes).unwrap();
        let eps: Vec<(i64, Option<&str>)> = d
            .sample
            .iter()
            .map(|s| {
                (
                    d.label_num(s, LOCAL_ROOT_SPAN_ID_LABEL).unwrap(),
                    d.label_str(s, TRACE_ENDPOINT_LABEL),
                )
            })
            .collect();
        assert_eq!(eps, vec![(1, None), (last, Some("GET /busy"))]);
        // A sampled root keeps its mapping in the profile's own table.
        p.set_endpoint(1, "GET /late").unwrap();
        assert_eq!(p.t.endpoints.len(), 1);
    }

    #[test]
    fn endpoint_names_are_bounded() {
        let mut p = profile();
        let n = MAX_ENDPOINT_NAMES + 10;
        for i in 0..n {
            p.set_endpoint(i as u64 + 1, &format!("GET /raw/{i}"))
                .unwrap();
        }
        // A name already kept still counts as itself.
        p.add_endpoint_count("GET /raw/0", 1).unwrap();
        let enc = p
            .encode(
                t0(),
                &EncodeOptions {
                    compression: Compression::None,
                },
                None,
            )
            .unwrap();
        assert_eq!(enc.endpoint_counts.len(), MAX_ENDPOINT_NAMES + 1);
        let count = |name: &str| {
            enc.endpoint_counts
                .iter()
                .find(|(e, _)| e == name)
                .map(|(_, c)| *c)
        };
        assert_eq!(count(OTHER_ENDPOINTS), Some(10));
        assert_eq!(count("GET /raw/0"), Some(2));
        let total: i64 = enc.endpoint_counts.iter().map(|(_, c)| c).sum();
        assert_eq!(total, n as i64 + 1);
    }

    #[test]
    fn endpoints_apply_to_earlier_and_later_samples() {
        let mut p = profile();
        let f = [Frame::sym("handler", "h.rs", 1)];
        add(
            &mut p,
            &f,
            &[1, 0],
            &[Label::num(LOCAL_ROOT_SPAN_ID_LABEL, 42)],
            0,
        );
        add(
            &mut p,
            &f,
            &[1, 0],
            &[Label::num(LOCAL_ROOT_SPAN_ID_LABEL, 7)],
            0,
        );
        p.set_endpoint(42, "GET /old").unwrap();
        p.set_endpoint(42, "GET /users").unwrap();
        add(
            &mut p,
            &f,
            &[1, 0],
            &[Label::num(LOCAL_ROOT_SPAN_ID_LABEL, 42)],
            5,
        );
        // A sample that already names its endpoint keeps its own.
        add(
            &mut p,
            &f,
            &[1, 0],
            &[
                Label::num(LOCAL_ROOT_SPAN_ID_LABEL, 42),
                Label::str(TRACE_ENDPOINT_LABEL, "mine"),
            ],
            0,
        );
        p.add_endpoint_count("GET /users", 10).unwrap();
        let enc = p
            .encode(
                t0(),
                &EncodeOptions {
                    compression: Compression::Gzip,
                },
                None,
            )
            .unwrap();
        assert_eq!(
            enc.endpoint_counts,
            vec![("GET /old".into(), 1), ("GET /users".into(), 11)]
        );
        let d = ferroprof_pprof::decode(&enc.bytes).unwrap();
        let eps: Vec<(i64, Option<&str>)> = d
            .sample
            .iter()
            .map(|s| {
                (
                    d.label_num(s, LOCAL_ROOT_SPAN_ID_LABEL).unwrap(),
                    d.label_str(s, TRACE_ENDPOINT_LABEL),
                )
            })
            .collect();
        assert_eq!(
            eps,
            vec![
                (42, Some("GET /users")),
                (7, None),
                (42, Some("mine")),
                (42, Some("GET /users")),
            ]
        );
        for s in &d.sample {
            let n = s
                .label
                .iter()
                .filter(|l| d.str(l.key) == TRACE_ENDPOINT_LABEL)
                .count();
            assert!(n <= 1);
        }
    }

    struct FakeSymbols;
    impl Symbolizer for FakeSymbols {
        fn symbolize(&mut self, address: u64, out: &mut Vec<ResolvedFrame>) {
            match address {
                0x1000 => {
                    out.push(ResolvedFrame {
                        name: "inlined".into(),
                        filename: "i.rs".into(),
                        line: 5,
                        ..Default::default()
                    });
                    out.push(ResolvedFrame {
                        name: "outer".into(),
                        filename: "o.rs".into(),
                        line: 50,
                        ..Default::default()
                    });
                }
                0x2000 => out.push(ResolvedFrame {
                    name: "main".into(),
                    filename: "m.rs".into(),
                    line: 1,
                    ..Default::default()
                }),
                _ => {}
            }
        }
    }

    #[test]
    fn address_frames_are_symbolized_at_encoding() {
        let mut p = profile();
        let frames = [
            Frame::Address(0x1000),
            Frame::Address(0x2000),
            Frame::Address(0x3000),
        ];
        add(&mut p, &frames, &[1, 0], &[], 0);
        add(&mut p, &[Frame::sym("main", "m.rs", 1)], &[1, 0], &[], 0);
        let opts = EncodeOptions {
            compression: Compression::Gzip,
        };
        let mut sym = FakeSymbols;
        let enc = p.encode(t0(), &opts, Some(&mut sym)).unwrap();
        let d = ferroprof_pprof::decode(&enc.bytes).unwrap();
        let stack = d.stack(&d.sample[0]);
        let names: Vec<&str> = stack.iter().map(|l| l.function.as_str()).collect();
        assert_eq!(names, vec!["inlined", "outer", "main", "0x3000"]);
        assert_eq!(stack[0].address, 0x1000);
        assert_eq!(stack[1].line, 50);
        // The inlined pair is one location with two lines.
        let loc = d.location.iter().find(|l| l.address == 0x1000).unwrap();
        assert_eq!(loc.line.len(), 2);
        // "main" from symbolization reuses the function of the literal frame.
        assert_eq!(
            d.function
                .iter()
                .filter(|f| d.str(f.name) == "main")
                .count(),
            1
        );

        // Without a symbolizer the addresses stand alone.
        let d = decode(&p);
        let names = d.stack_names(&d.sample[0]);
        assert_eq!(names, vec!["0x1000", "0x2000", "0x3000"]);
    }

    /// Frames with linkage names and start lines, and two objects' mappings.
    struct MappedSymbols {
        objects: [MappingInfo; 2],
    }

    impl Symbolizer for MappedSymbols {
        fn symbolize(&mut self, address: u64, out: &mut Vec<ResolvedFrame>) {
            let (name, system_name, start_line) = match address {
                0x7f00_0000_1010 => ("lib::f", "_ZN3lib1f17h0123456789abcdefE", 3),
                0x5500_0000_2010 => ("app::main", "_ZN3app4main17h0123456789abcdefE", 10),
                0x5500_0000_2020 => ("app::main", "_ZN3app4main17h0123456789abcdefE", 10),
                _ => return,
            };
            out.push(ResolvedFrame {
                name: name.into(),
                system_name: system_name.into(),
                filename: "src/x.rs".into(),
                line: 12,
                start_line,
            });
        }

        fn mapping(&mut self, address: u64) -> Option<&MappingInfo> {
            self.objects
                .iter()
                .find(|m| m.memory_start <= address && address < m.memory_limit)
        }
    }

    #[test]
    fn mappings_and_function_details_are_written() {
        let mut p = profile();
        let frames = [
            Frame::Address(0x7f00_0000_1010),
            Frame::Address(0x5500_0000_2010),
            Frame::Address(0x5500_0000_2020),
            Frame::Address(0x1234),
        ];
        add(&mut p, &frames, &[1, 0], &[], 0);
        add(
            &mut p,
            &[Frame::sym("app::main", "src/x.rs", 12)],
            &[1, 0],
            &[],
            0,
        );
        let lib = MappingInfo {
            memory_start: 0x7f00_0000_1000,
            memory_limit: 0x7f00_0000_2000,
            file_offset: 0x1000,
            filename: "/lib/libx.so".into(),
            build_id: "abcd".into(),
            has_functions: true,
            ..Default::default()
        };
        let app = MappingInfo {
            memory_start: 0x5500_0000_2000,
            memory_limit: 0x5500_0000_3000,
            file_offset: 0x2000,
            filename: "/bin/app".into(),
            build_id: "0123".into(),
            has_functions: true,
            has_filenames: true,
            has_line_numbers: true,
            has_inline_frames: true,
        };
        let mut sym = MappedSymbols {
            objects: [lib, app],
        };
        let opts = EncodeOptions {
            compression: Compression::None,
        };
        let enc = p.encode(t0(), &opts, Some(&mut sym)).unwrap();
        let d = ferroprof_pprof::decode(&enc.bytes).unwrap();
        // One mapping per object used, lowest first: the program before the library.
        let files: Vec<&str> = d.mapping.iter().map(|m| d.str(m.filename)).collect();
        assert_eq!(files, ["/bin/app", "/lib/libx.so"]);
        let m = &d.mapping[0];
        assert_eq!(m.id, 1);
        assert_eq!(
            (m.memory_start, m.memory_limit, m.file_offset),
            (0x5500_0000_2000, 0x5500_0000_3000, 0x2000)
        );
        assert_eq!(d.str(m.build_id), "0123");
        assert!(m.has_functions && m.has_filenames && m.has_line_numbers && m.has_inline_frames);
        let m = &d.mapping[1];
        assert_eq!(d.str(m.build_id), "abcd");
        assert!(m.has_functions && !m.has_filenames && !m.has_inline_frames);
        for l in &d.location {
            let want = match l.address {
                0x7f00_0000_1010 => 2,
                0x5500_0000_2010 | 0x5500_0000_2020 => 1,
                _ => 0,
            };
            assert_eq!(l.mapping_id, want, "location at {:#x}", l.address);
        }
        // Two addresses of one function: one function, with its linkage name and start line;
        // the literal frame without them stays a function of its own.
        let mains: Vec<_> = d
            .function
            .iter()
            .filter(|f| d.str(f.name) == "app::main")
            .collect();
        assert_eq!(mains.len(), 2, "{mains:?}");
        let full = mains.iter().find(|f| f.system_name != 0).unwrap();
        assert_eq!(d.str(full.system_name), "_ZN3app4main17h0123456789abcdefE");
        assert_eq!(full.start_line, 10);
        assert_eq!(d.str(full.filename), "src/x.rs");
    }

    #[test]
    fn times_and_reset() {
        let mut p = profile();
        add(&mut p, &[Frame::sym("f", "f.rs", 1)], &[1, 1], &[], 0);
        p.set_endpoint(1, "e").unwrap();
        let d = decode(&p);
        assert_eq!(d.time_nanos, 1_700_000_000 * 1_000_000_000);
        assert_eq!(d.duration_nanos, 60 * 1_000_000_000);
        assert_eq!(
            d.sample_types(),
            vec![
                ("cpu-samples".to_string(), "count".to_string()),
                ("wall-time".to_string(), "nanoseconds".to_string())
            ]
        );
        let later = t0() + Duration::from_secs(5);
        p.reset(later);
        assert_eq!(p.start(), later);
        assert_eq!(p.sample_count(), 0);
        let enc = p.encode(later, &EncodeOptions::default(), None).unwrap();
        assert!(enc.endpoint_counts.is_empty());
        let d = ferroprof_pprof::decode(&enc.bytes).unwrap();
        assert!(d.sample.is_empty());
        assert!(d.function.is_empty());
        assert_eq!(d.duration_nanos, 0);
        // A clock that went backwards: zero duration, not an error.
        let enc = p.encode(t0(), &EncodeOptions::default(), None).unwrap();
        assert_eq!(
            ferroprof_pprof::decode(&enc.bytes).unwrap().duration_nanos,
            0
        );
    }

    #[test]
    fn negative_values_and_big_numbers_round_trip() {
        let mut p = profile();
        add(
            &mut p,
            &[Frame::sym("f", "f.rs", -1), Frame::Address(u64::MAX)],
            &[-5, i64::MAX],
            &[Label::num("n", i64::MIN)],
            i64::MAX,
        );
        let d = decode(&p);
        let s = &d.sample[0];
        assert_eq!(s.value, vec![-5, i64::MAX]);
        assert_eq!(d.label_num(s, "n"), Some(i64::MIN));
        assert_eq!(d.label_num(s, END_TIMESTAMP_LABEL), Some(i64::MAX));
        assert_eq!(d.stack(s)[0].line, -1);
        assert_eq!(d.stack(s)[1].address, u64::MAX);
    }

    #[test]
    fn unindexed_stacks_and_rows_encode_like_added_ones() {
        let frames = [Frame::Address(0x10), Frame::sym("main", "m.rs", 1)];
        let other = [Frame::Address(0x20), Frame::sym("main", "m.rs", 1)];
        let heap = [Label::num("gc gen age", 1)];
        let mut p = profile();
        add(&mut p, &frames, &[1, 0], &[], 0);
        let mut spare = BulkBuffers::default();
        p.reserve_unindexed(2, 2, &mut spare);
        // An equal stack appended again, and a new one.
        let labels = p.intern_label_set(&heap).unwrap();
        let s1 = p.push_stack_unindexed(&frames, &[]).unwrap();
        let r1 = p.push_unindexed_row(s1, labels, &[0, 5]).unwrap();
        p.add_to_row(r1, &[0, 2]).unwrap();
        let mut hints = Vec::new();
        p.prefetch_stack(&other, &mut hints);
        let s2 = p.push_stack_unindexed(&other, &hints).unwrap();
        p.push_unindexed_row(s2, labels, &[0, 3]).unwrap();
        let mut q = profile();
        add(&mut q, &frames, &[1, 0], &[], 0);
        add(&mut q, &frames, &[0, 5], &heap, 0);
        add(&mut q, &frames, &[0, 2], &heap, 0);
        add(&mut q, &other, &[0, 3], &heap, 0);
        assert_eq!(decode(&p), decode(&q));
        // Lookups catch up with the appended entries.
        add(&mut p, &other, &[0, 1], &heap, 0);
        add(&mut q, &other, &[0, 1], &heap, 0);
        add(&mut p, &frames, &[4, 0], &[], 0);
        add(&mut q, &frames, &[4, 0], &[], 0);
        assert_eq!(decode(&p), decode(&q));

        // Another profile built in the first one's buffers, over samples (and locations) of its
        // own, then address stacks pushed as bare addresses.
        p.reset_into(t0(), &mut spare);
        assert!(spare.location_slots.len() >= 4 && spare.stack_items.capacity() >= 4);
        let mut r = profile();
        let addrs = [
            Frame::Address(0x30),
            Frame::Address(0x20),
            Frame::Address(0x30),
        ];
        add(&mut r, &other, &[1, 0], &[], 0);
        r.reserve_unindexed(1, 1, &mut spare);
        let labels = r.intern_label_set(&heap).unwrap();
        let mut ahead = PrefetchedStack::default();
        r.prefetch_addresses(&[0x30, 0x20, 0x30], &mut ahead);
        let s3 = r.push_address_stack_unindexed(&mut ahead).unwrap();
        r.push_unindexed_row(s3, labels, &[0, 7]).unwrap();
        add(&mut r, &addrs, &[2, 0], &[], 0);
        let mut q = profile();
        add(&mut q, &other, &[1, 0], &[], 0);
        add(&mut q, &addrs, &[0, 7], &heap, 0);
        add(&mut q, &addrs, &[2, 0], &[], 0);
        assert_eq!(decode(&r), decode(&q));
    }

    #[test]
    fn many_distinct_stacks_round_trip() {
        let mut p = profile();
        let names: Vec<String> = (0..2000).map(|i| format!("fn_{i}")).collect();
        for (i, n) in names.iter().enumerate() {
            let frames = [
                Frame::sym(n, "f.rs", i as i64),
                Frame::sym("root", "r.rs", 1),
            ];
            add(&mut p, &frames, &[i as i64, 1], &[], 0);
        }
        for (i, n) in names.iter().enumerate() {
            let frames = [
                Frame::sym(n, "f.rs", i as i64),
                Frame::sym("root", "r.rs", 1),
            ];
            add(&mut p, &frames, &[i as i64, 1], &[], 0);
        }
        assert_eq!(p.sample_count(), 2000);
        let d = decode(&p);
        for s in &d.sample {
            let names = d.stack_names(s);
            let i: i64 = names[0].trim_start_matches("fn_").parse().unwrap();
            assert_eq!(s.value, vec![2 * i, 2]);
            assert_eq!(names[1], "root");
        }
        assert!(p.memory_bytes() > 0);
    }
}

#[cfg(test)]
mod cap_tests {
    use super::*;
    use crate::pprof::Compression;

    const TYPES: [SampleType; 2] = [SampleType::CpuSamples, SampleType::WallTime];

    fn t0() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000)
    }

    fn decode(p: &Profile) -> ferroprof_pprof::Profile {
        let opts = EncodeOptions {
            compression: Compression::None,
        };
        let enc = p.encode(t0(), &opts, None).unwrap();
        ferroprof_pprof::decode(&enc.bytes).unwrap()
    }

    /// A stack distinct for every `i`: a recursion whose depth and entry frames follow `i`'s
    /// digits, as recursive code gives (few addresses, many stacks).
    fn distinct_stack(i: u64, out: &mut Vec<Frame<'static>>) {
        out.clear();
        out.push(Frame::Address(0x1000 + (i % 7) * 16));
        let mut x = i;
        loop {
            out.push(Frame::Address(0x2000 + (x % 10) * 16));
            x /= 10;
            if x == 0 {
                break;
            }
        }
        out.push(Frame::Address(0x9000));
    }

    /// (dropped-frame samples' values, all samples' values) of an encoded profile.
    fn totals(d: &ferroprof_pprof::Profile) -> ([i64; 2], [i64; 2]) {
        let (mut dropped, mut all) = ([0; 2], [0; 2]);
        for s in &d.sample {
            let names = d.stack_names(s);
            for k in 0..2 {
                all[k] += s.value[k];
                if names == [DROPPED_STACKS_FRAME] {
                    dropped[k] += s.value[k];
                }
            }
        }
        (dropped, all)
    }

    #[test]
    fn cap_holds_over_a_million_distinct_stacks_and_values_are_conserved() {
        const CAP: u64 = 2 << 20;
        let mut p = Profile::new(&TYPES, None, t0()).with_max_bytes(Some(CAP));
        assert_eq!(p.max_bytes(), Some(CAP));
        let mut frames = Vec::new();
        let (mut max_mem, mut sum) = (0, [0i64; 2]);
        for i in 0..1_000_000u64 {
            distinct_stack(i, &mut frames);
            let values = [1, i as i64 % 1000];
            p.add(&Sample {
                frames: &frames,
                values: &values,
                labels: &[],
                end_timestamp_ns: 0,
            })
            .unwrap();
            sum[0] += values[0];
            sum[1] += values[1];
            max_mem = max_mem.max(p.memory_bytes());
        }
        assert!(max_mem <= CAP as usize, "{max_mem} bytes over a {CAP} cap");
        // The cap is used, not merely respected (tables grow by doubling).
        assert!(max_mem >= CAP as usize / 4, "only {max_mem} bytes used");
        let dropped = p.dropped_samples();
        assert!(dropped > 500_000, "{dropped} dropped");
        let d = decode(&p);
        let (dropped_values, all) = totals(&d);
        assert_eq!(all, sum, "every value is in the profile");
        assert_eq!(dropped_values[0], dropped as i64);
        assert_eq!(
            d.sample
                .iter()
                .filter(|s| d.stack_names(s) == [DROPPED_STACKS_FRAME])
                .count(),
            1
        );
        // Kept stacks are whole, not truncated.
        assert_eq!(d.sample.len() as u64, 1_000_000 - dropped + 1);

        // A reset keeps the cap and forgets the drops.
        p.reset(t0());
        assert_eq!((p.dropped_samples(), p.max_bytes()), (0, Some(CAP)));
    }

    #[test]
    fn existing_stacks_keep_aggregating_over_the_cap() {
        let st = Arc::new(StringStorage::new());
        let mut p = Profile::new(&TYPES, Some(st.clone()), t0()).with_max_bytes(Some(256 << 10));
        let (name, file) = (st.intern("by_id").unwrap(), st.intern("id.rs").unwrap());
        let id_frames = [Frame::ids(name, file, 7), Frame::sym("main", "m.rs", 1)];
        let lit_frames = [Frame::sym("lit", "l.rs", 2), Frame::sym("main", "m.rs", 1)];
        let thread = [Label::num("thread id", 1)];
        let add = |p: &mut Profile, frames: &[Frame<'_>], labels: &[Label<'_>], v: i64| {
            p.add(&Sample {
                frames,
                values: &[v, 0],
                labels,
                end_timestamp_ns: 0,
            })
            .unwrap()
        };
        add(&mut p, &id_frames, &thread, 1);
        add(&mut p, &lit_frames, &[], 1);
        let mut frames = Vec::new();
        let mut i = 0;
        while p.dropped_samples() == 0 {
            assert!(
                i < 100_000,
                "{} bytes and no sample folded",
                p.memory_bytes()
            );
            distinct_stack(i, &mut frames);
            add(&mut p, &frames, &[], 1);
            i += 1;
        }
        let over = p.memory_bytes();
        // Known stacks keep their rows: through the key index, and when their key is missed
        // (the id cache is dropped by a generation change, or the literal spelling of an id
        // frame).
        add(&mut p, &lit_frames, &[], 10);
        st.advance_generation();
        add(&mut p, &id_frames, &thread, 100);
        let spelled = [
            Frame::sym("by_id", "id.rs", 7),
            Frame::sym("main", "m.rs", 1),
        ];
        add(&mut p, &spelled, &thread, 1000);
        // New stacks fold in: with their label set when it exists, without labels otherwise.
        distinct_stack(i + 1, &mut frames);
        add(&mut p, &frames, &thread, 10_000);
        distinct_stack(i + 2, &mut frames);
        add(&mut p, &frames, &[Label::num("thread id", 99)], 100_000);
        assert_eq!(p.dropped_samples(), 3);
        assert!(p.memory_bytes() <= 256 << 10, "{} > cap", p.memory_bytes());
        assert!(p.memory_bytes() >= over);

        let d = decode(&p);
        let value_of = |names: &[&str], thread: Option<i64>| -> i64 {
            d.sample
                .iter()
                .filter(|s| d.stack_names(s) == names && d.label_num(s, "thread id") == thread)
                .map(|s| s.value[0])
                .sum()
        };
        assert_eq!(value_of(&["by_id", "main"], Some(1)), 1101);
        assert_eq!(value_of(&["lit", "main"], None), 11);
        assert_eq!(value_of(&[DROPPED_STACKS_FRAME], Some(1)), 10_000);
        assert_eq!(value_of(&[DROPPED_STACKS_FRAME], None), 100_000 + 1);
    }

    #[test]
    fn timestamped_samples_fold_over_the_cap() {
        const CAP: u64 = 512 << 10;
        let mut p = Profile::new(&TYPES, None, t0()).with_max_bytes(Some(CAP));
        let frames = [Frame::sym("tick", "t.rs", 1)];
        let labels = [Label::str("thread name", "worker")];
        for ts in 1..=100_000 {
            p.add(&Sample {
                frames: &frames,
                values: &[1, 2],
                labels: &labels,
                end_timestamp_ns: ts,
            })
            .unwrap();
            assert!(p.memory_bytes() <= CAP as usize);
        }
        assert!(p.dropped_samples() > 0);
        let d = decode(&p);
        let (dropped, all) = totals(&d);
        assert_eq!(all, [100_000, 200_000]);
        assert_eq!(dropped[0], p.dropped_samples() as i64);
        // The folded samples keep their (existing) labels.
        let folded = d
            .sample
            .iter()
            .find(|s| d.stack_names(s) == [DROPPED_STACKS_FRAME])
            .unwrap();
        assert_eq!(d.label_str(folded, "thread name"), Some("worker"));
    }

    #[test]
    fn a_cap_below_an_empty_profile_keeps_only_the_dropped_row() {
        let mut p = Profile::new(&TYPES, None, t0()).with_max_bytes(Some(1));
        for i in 0..100 {
            let frames = [Frame::Address(i)];
            p.add(&Sample {
                frames: &frames,
                values: &[1, 1],
                labels: &[],
                end_timestamp_ns: 0,
            })
            .unwrap();
        }
        assert_eq!(p.dropped_samples(), 100);
        let d = decode(&p);
        assert_eq!(d.sample.len(), 1);
        assert_eq!(d.sample[0].value, vec![100, 100]);
        assert_eq!(d.stack_names(&d.sample[0]), vec![DROPPED_STACKS_FRAME]);
    }

    #[test]
    fn bulk_rows_respect_the_cap() {
        const CAP: u64 = 1 << 20;
        let types = [SampleType::HeapLiveSamples, SampleType::HeapLiveSize];
        let mut p = Profile::new(&types, None, t0()).with_max_bytes(Some(CAP));
        // Samplers filled part of the profile first.
        let mut frames = Vec::new();
        for i in 0..2000 {
            distinct_stack(i, &mut frames);
            p.add(&Sample {
                frames: &frames,
                values: &[1, 8],
                labels: &[],
                end_timestamp_ns: 0,
            })
            .unwrap();
        }
        // A spare buffer far larger than the cap is not adopted.
        let mut spare = BulkBuffers {
            agg: Vec::with_capacity(1 << 20),
            ..BulkBuffers::default()
        };
        p.reserve_unindexed(200_000, 200_000, &mut spare);
        assert_eq!(spare.agg.capacity(), 0);
        assert!(p.memory_bytes() <= CAP as usize);
        let (mut sum, mut ahead, mut hints) = ([0i64; 2], PrefetchedStack::default(), Vec::new());
        let mut addresses = Vec::new();
        for i in 0..200_000u64 {
            let labels = p
                .intern_label_set(&[Label::num("gc gen age", (i % 3) as i64)])
                .unwrap();
            distinct_stack(1_000_000 + i, &mut frames);
            let stack = if i % 2 == 0 {
                addresses.clear();
                addresses.extend(frames.iter().map(|f| match *f {
                    Frame::Address(a) => a,
                    Frame::Symbol { .. } => unreachable!(),
                }));
                p.prefetch_addresses(&addresses, &mut ahead);
                p.push_address_stack_unindexed(&mut ahead).unwrap()
            } else {
                p.prefetch_stack(&frames, &mut hints);
                p.push_stack_unindexed(&frames, &hints).unwrap()
            };
            let row = p.push_unindexed_row(stack, labels, &[1, 64]).unwrap();
            p.add_to_row(row, &[2, 128]).unwrap();
            sum[0] += 3;
            sum[1] += 192;
            assert!(p.memory_bytes() <= CAP as usize, "{}", p.memory_bytes());
        }
        let dropped = p.dropped_samples();
        assert!(dropped > 100_000, "{dropped}");
        let d = decode(&p);
        let (dropped_values, all) = totals(&d);
        assert_eq!(all, [sum[0] + 2000, sum[1] + 2000 * 8]);
        // Two samples per folded stack (row push, then add), of values 1 and 2.
        assert_eq!(dropped_values[0] * 2, dropped as i64 * 3);
        // Folded rows keep an existing label set when there is room for its row, else none.
        for s in d.sample.iter() {
            if d.stack_names(s) == [DROPPED_STACKS_FRAME] {
                assert!(matches!(d.label_num(s, "gc gen age"), None | Some(0..=2)));
            }
        }
    }
}
