//! Refcounted string interning shared by the profiles and the heap recorder.
//!
//! Id 0 is the empty string: always present, never counted. `intern` of a known string returns its
//! id and bumps its count; `unintern` drops one count. Entries whose count reached zero stay
//! readable until [`StringStorage::advance_generation`], which frees them (and makes their ids
//! reusable). The batch calls take the lock once.
//!
//! `Send + Sync`; all methods take `&self`. Closures passed to [`StringStorage::with_str`] run with
//! the table locked, so they must not call back into the same storage.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::spin::{SpinGuard, SpinLock};

use crate::error::StringError;

/// An interned string's id. `StringId::EMPTY` (0) is the empty string.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct StringId(pub(crate) u32);

impl StringId {
    /// The empty string's id.
    pub const EMPTY: StringId = StringId(0);

    /// The raw value (see [`Self::from_raw`]).
    pub fn value(self) -> u32 {
        self.0
    }

    /// Rebuilds an id from its raw value (e.g. stored by a caller); validity is checked on use.
    pub fn from_raw(v: u32) -> StringId {
        StringId(v)
    }
}

/// Longest string accepted by `intern`; longer input is an error, not a truncation.
pub const MAX_STRING_LEN: usize = 1 << 20;

/// Most live strings (ids must fit in a `u32`, and `u32::MAX` stays unused).
const MAX_LIVE_STRINGS: usize = (u32::MAX - 1) as usize;

type Map = HashMap<Arc<str>, u32, foldhash::fast::RandomState>;

#[derive(Debug)]
struct Entry {
    /// `None` once freed; the id then waits in the free list.
    s: Option<Arc<str>>,
    count: u32,
}

#[derive(Debug)]
pub(crate) struct Table {
    map: Map,
    /// Indexed by id; slot 0 is the empty string.
    entries: Vec<Entry>,
    /// Freed ids, reused oldest first so a stale id is less likely to alias a fresh string soon.
    free: VecDeque<u32>,
    /// Entries not yet freed (referenced or waiting for the next generation).
    live: usize,
    /// Entries with a count above zero.
    referenced: usize,
    string_bytes: usize,
}

impl Default for Table {
    fn default() -> Self {
        Table {
            map: Map::default(),
            entries: vec![Entry {
                s: Some(Arc::from("")),
                count: 0,
            }],
            free: VecDeque::new(),
            live: 0,
            referenced: 0,
            string_bytes: 0,
        }
    }
}

impl Table {
    fn intern_one(&mut self, s: &str) -> Result<StringId, StringError> {
        if s.is_empty() {
            return Ok(StringId::EMPTY);
        }
        if let Some(&id) = self.map.get(s) {
            let e = &mut self.entries[id as usize];
            if e.count == 0 {
                self.referenced += 1;
            }
            // A count cannot realistically reach u32::MAX; saturate rather than wrap so a bug
            // elsewhere can never make a live string look free.
            e.count = e.count.saturating_add(1);
            return Ok(StringId(id));
        }
        if s.len() > MAX_STRING_LEN {
            return Err(StringError::TooLong {
                len: s.len(),
                limit: MAX_STRING_LEN,
            });
        }
        if self.live >= MAX_LIVE_STRINGS {
            return Err(StringError::Full(self.live));
        }
        let arc: Arc<str> = Arc::from(s);
        let id = match self.free.pop_front() {
            Some(id) => {
                self.entries[id as usize] = Entry {
                    s: Some(arc.clone()),
                    count: 1,
                };
                id
            }
            None => {
                let id = self.entries.len() as u32;
                self.entries.push(Entry {
                    s: Some(arc.clone()),
                    count: 1,
                });
                id
            }
        };
        self.map.insert(arc, id);
        self.live += 1;
        self.referenced += 1;
        self.string_bytes += s.len();
        Ok(StringId(id))
    }

    /// Drops one count of an id already checked with `check_unintern`.
    fn release(&mut self, id: StringId) {
        if id == StringId::EMPTY {
            return;
        }
        let e = &mut self.entries[id.0 as usize];
        if e.count > 0 {
            e.count -= 1;
            if e.count == 0 {
                self.referenced -= 1;
            }
        }
    }

    fn check_unintern(&self, id: StringId) -> Result<(), StringError> {
        if id == StringId::EMPTY {
            return Ok(());
        }
        match self.entries.get(id.0 as usize) {
            Some(Entry { s: Some(_), count }) if *count > 0 => Ok(()),
            Some(Entry { s: Some(_), .. }) => Err(StringError::Underflow(id.0)),
            _ => Err(StringError::UnknownId(id.0)),
        }
    }

    /// The string behind `id`, if it is live (count zero but not yet freed counts as live).
    pub(crate) fn get(&self, id: StringId) -> Result<&str, StringError> {
        match self.entries.get(id.0 as usize) {
            Some(Entry { s: Some(s), .. }) => Ok(s),
            _ => Err(StringError::UnknownId(id.0)),
        }
    }
}

/// Byte equality for strings as short as symbol names: in 16-byte pieces, branch-free, without
/// a `memcmp` call (whose call and dispatch cost about as much as comparing a 40-byte name).
#[inline]
pub(crate) fn bytes_eq(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    if n != b.len() {
        return false;
    }
    if n < 8 {
        return a == b;
    }
    if n <= 16 {
        let word = |s: &[u8], i: usize| {
            // SAFETY: `i` is 0 or `n - 8`, so `i + 8 <= n`, and both slices are `n` bytes long.
            unsafe { s.as_ptr().add(i).cast::<u64>().read_unaligned() }
        };
        // Two words overlapping in the middle cover 8..=16 bytes.
        return (word(a, 0) ^ word(b, 0)) | (word(a, n - 8) ^ word(b, n - 8)) == 0;
    }
    long_eq(a, b)
}

/// `bytes_eq` for equal lengths above 16: 16-byte pieces xored and ored in one register.
#[cfg(target_arch = "x86_64")]
#[inline]
fn long_eq(a: &[u8], b: &[u8]) -> bool {
    use std::arch::x86_64::{
        _mm_cmpeq_epi8, _mm_loadu_si128, _mm_movemask_epi8, _mm_or_si128, _mm_setzero_si128,
        _mm_xor_si128,
    };
    let n = a.len();
    // SAFETY: SSE2 is part of the x86_64 baseline. Every load reads 16 bytes at an offset `i`
    // with `i + 16 <= n` (0, `n - 16` with `n > 16`, 16 with `n > 32`, or the loop's), inside
    // both slices, which are `n` bytes long; unaligned loads are what `loadu` is for.
    unsafe {
        let piece = |s: &[u8], i: usize| _mm_loadu_si128(s.as_ptr().add(i).cast());
        // The last piece covers the tail the whole pieces leave.
        let mut diff = _mm_xor_si128(piece(a, n - 16), piece(b, n - 16));
        diff = _mm_or_si128(diff, _mm_xor_si128(piece(a, 0), piece(b, 0)));
        // Up to 32 bytes the first and last pieces cover everything, up to 48 one more does
        // (most symbol names); only longer strings loop.
        if n > 32 {
            diff = _mm_or_si128(diff, _mm_xor_si128(piece(a, 16), piece(b, 16)));
            let mut i = 32;
            while i + 16 < n {
                diff = _mm_or_si128(diff, _mm_xor_si128(piece(a, i), piece(b, i)));
                i += 16;
            }
        }
        _mm_movemask_epi8(_mm_cmpeq_epi8(diff, _mm_setzero_si128())) == 0xffff
    }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn long_eq(a: &[u8], b: &[u8]) -> bool {
    let n = a.len();
    let piece = |s: &[u8], i: usize| {
        // SAFETY: `i` is 0, `n - 16` (with `n > 16`) or the loop's, with `i + 16 < n`; both
        // slices are `n` bytes long.
        unsafe { s.as_ptr().add(i).cast::<u128>().read_unaligned() }
    };
    let mut diff = (piece(a, n - 16) ^ piece(b, n - 16)) | (piece(a, 0) ^ piece(b, 0));
    let mut i = 16;
    while i + 16 < n {
        diff |= piece(a, i) ^ piece(b, i);
        i += 16;
    }
    diff == 0
}

/// `bytes_eq` in 32-byte pieces, for callers running with AVX2 enabled (symbol names are mostly
/// 32 to 64 bytes: two pieces instead of three, and one `vptest` instead of compare-and-mask).
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) unsafe fn bytes_eq_avx2(a: &[u8], b: &[u8]) -> bool {
    use std::arch::x86_64::{
        _mm256_loadu_si256, _mm256_or_si256, _mm256_testz_si256, _mm256_xor_si256, _mm_loadu_si128,
        _mm_or_si128, _mm_testz_si128, _mm_xor_si128,
    };
    let n = a.len();
    if n != b.len() {
        return false;
    }
    if n <= 16 {
        return bytes_eq(a, b);
    }
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    // SAFETY: AVX2 (and the SSE4.1 it implies) is enabled by our caller's contract. Every load
    // reads 16 or 32 bytes at an offset `i` with `i + width <= n`: 0 and `n - 16` for
    // `16 < n < 32`; 0, `n - 32` and the loop's `i` (`i + 32 < n`) otherwise. Both slices are
    // `n` bytes long; `loadu` takes unaligned addresses.
    unsafe {
        if n < 32 {
            let x = _mm_xor_si128(_mm_loadu_si128(pa.cast()), _mm_loadu_si128(pb.cast()));
            let y = _mm_xor_si128(
                _mm_loadu_si128(pa.add(n - 16).cast()),
                _mm_loadu_si128(pb.add(n - 16).cast()),
            );
            let d = _mm_or_si128(x, y);
            return _mm_testz_si128(d, d) == 1;
        }
        let mut d = _mm256_or_si256(
            _mm256_xor_si256(_mm256_loadu_si256(pa.cast()), _mm256_loadu_si256(pb.cast())),
            _mm256_xor_si256(
                _mm256_loadu_si256(pa.add(n - 32).cast()),
                _mm256_loadu_si256(pb.add(n - 32).cast()),
            ),
        );
        let mut i = 32;
        while i + 32 < n {
            d = _mm256_or_si256(
                d,
                _mm256_xor_si256(
                    _mm256_loadu_si256(pa.add(i).cast()),
                    _mm256_loadu_si256(pb.add(i).cast()),
                ),
            );
            i += 32;
        }
        _mm256_testz_si256(d, d) == 1
    }
}

/// Thread-safe refcounted string table.
pub struct StringStorage {
    /// A spin lock rather than a parking one so a forked child can always take it back (see
    /// `crate::spin`); it is held for one lookup or insert at a time.
    table: SpinLock<Table>,
    /// Mirrors the generation outside the lock so profiles can validate their id caches with a
    /// single atomic load.
    generation: AtomicU64,
}

impl Default for StringStorage {
    fn default() -> Self {
        StringStorage {
            table: SpinLock::new(Table::default()),
            generation: AtomicU64::new(0),
        }
    }
}

impl std::fmt::Debug for StringStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StringStorage")
            .field("len", &self.len())
            .field("generation", &self.generation())
            .finish()
    }
}

impl StringStorage {
    /// An empty storage (holding `""` as id 0).
    pub fn new() -> Self {
        Self::default()
    }

    /// Interns `s`, returning its id; `""` is always `StringId::EMPTY` and is not counted.
    pub fn intern(&self, s: &str) -> Result<StringId, StringError> {
        if s.is_empty() {
            return Ok(StringId::EMPTY);
        }
        self.table.lock().intern_one(s)
    }

    /// Interns every string, writing ids into `out` (cleared first). One lock acquisition.
    /// On error nothing stays interned and `out` is left empty.
    pub fn intern_all(&self, strs: &[&str], out: &mut Vec<StringId>) -> Result<(), StringError> {
        out.clear();
        out.reserve(strs.len());
        let mut t = self.table.lock();
        for s in strs {
            match t.intern_one(s) {
                Ok(id) => out.push(id),
                Err(e) => {
                    // Undo the counts taken so far; these ids were just validated as live.
                    for id in out.drain(..) {
                        t.release(id);
                    }
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Drops one reference. Unknown id or underflow is an error. `EMPTY` is a no-op.
    pub fn unintern(&self, id: StringId) -> Result<(), StringError> {
        if id == StringId::EMPTY {
            return Ok(());
        }
        let mut t = self.table.lock();
        t.check_unintern(id)?;
        t.release(id);
        Ok(())
    }

    /// Drops one reference of each id. One lock acquisition; validates all ids before changing any.
    pub fn unintern_all(&self, ids: &[StringId]) -> Result<(), StringError> {
        let mut t = self.table.lock();
        // An id listed k times needs a count of at least k: check per id, counting repeats.
        let mut seen: HashMap<u32, u32, foldhash::fast::RandomState> = HashMap::default();
        for &id in ids {
            t.check_unintern(id)?;
            if id == StringId::EMPTY {
                continue;
            }
            let n = seen.entry(id.0).or_insert(0);
            *n += 1;
            if *n > t.entries[id.0 as usize].count {
                return Err(StringError::Underflow(id.0));
            }
        }
        for &id in ids {
            t.release(id);
        }
        Ok(())
    }

    /// Releases one reference of each id, under one hold of the lock, without allocating (for
    /// the free path). Unlike [`Self::unintern_all`], ids before a bad one are released.
    pub fn unintern_each(&self, ids: impl Iterator<Item = StringId>) -> Result<(), StringError> {
        let mut t = self.table.lock();
        let mut first_err = None;
        for id in ids {
            if id == StringId::EMPTY {
                continue;
            }
            match t.check_unintern(id) {
                Ok(()) => t.release(id),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Calls `f` with the string behind `id` (errors on a released or unknown id).
    pub fn with_str<R>(&self, id: StringId, f: impl FnOnce(&str) -> R) -> Result<R, StringError> {
        if id == StringId::EMPTY {
            return Ok(f(""));
        }
        let t = self.table.lock();
        t.get(id).map(f)
    }

    /// Owned copy of the string behind `id`.
    pub fn get(&self, id: StringId) -> Result<String, StringError> {
        self.with_str(id, str::to_owned)
    }

    /// Frees every entry whose count is zero; returns the new generation number.
    pub fn advance_generation(&self) -> u64 {
        let mut t = self.table.lock();
        let t = &mut *t;
        for (id, e) in t.entries.iter_mut().enumerate().skip(1) {
            if e.count == 0 {
                if let Some(s) = e.s.take() {
                    t.map.remove(&*s);
                    t.free.push_back(id as u32);
                    t.live -= 1;
                    t.string_bytes -= s.len();
                }
            }
        }
        // Release: a profile that sees the new generation also sees the freed entries.
        self.generation.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// Current generation (starts at 0, +1 per `advance_generation`).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Strings currently referenced (count above zero), not counting the empty string. Strings
    /// whose count dropped to zero are not counted even while they stay readable until the next
    /// generation advance.
    pub fn len(&self) -> usize {
        self.table.lock().referenced
    }

    /// Whether no string is referenced.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Refcount of `id` (None if not live). The empty string is always live with count 0.
    pub fn refcount(&self, id: StringId) -> Option<u32> {
        let t = self.table.lock();
        match t.entries.get(id.0 as usize) {
            Some(Entry { s: Some(_), count }) => Some(*count),
            _ => None,
        }
    }

    /// Bytes held by the table (strings + index), for memory reporting.
    pub fn memory_bytes(&self) -> usize {
        let t = self.table.lock();
        // Each live string: its bytes plus the Arc header (two counters), a map slot (pointer,
        // length, id and a control byte) and an entry.
        let per_map_slot = std::mem::size_of::<(Arc<str>, u32)>() + 1;
        t.string_bytes
            + t.live * 2 * std::mem::size_of::<usize>()
            + t.map.capacity() * per_map_slot
            + t.entries.capacity() * std::mem::size_of::<Entry>()
            + t.free.capacity() * std::mem::size_of::<u32>()
    }

    /// The shared text of each id, for a holder of references to them that compares against
    /// them often without wanting the lock. An id that is not live (the caller holds no
    /// reference after all) gets an empty text.
    pub(crate) fn shared_texts(&self, ids: &[StringId]) -> Box<[Arc<str>]> {
        let t = self.table.lock();
        ids.iter()
            .map(|id| match t.entries.get(id.0 as usize) {
                Some(Entry { s: Some(s), .. }) => Arc::clone(s),
                _ => Arc::from(""),
            })
            .collect()
    }

    /// Locks the table for a batch of reads (profiles resolve many ids at once).
    pub(crate) fn lock(&self) -> SpinGuard<'_, Table> {
        self.table.lock()
    }

    /// Whether the table's lock is held (for a forked child, which must not wait on it).
    pub fn is_locked(&self) -> bool {
        self.table.is_locked()
    }

    /// Fork preparation: takes the lock and keeps it (no guard) until
    /// [`Self::unlock_after_fork`], so a fork never catches the table half-way through an update.
    pub(crate) fn lock_for_fork(&self) {
        std::mem::forget(self.table.lock());
    }

    /// Releases the lock taken by [`Self::lock_for_fork`], in the parent or in the child.
    pub(crate) fn unlock_after_fork(&self) {
        // SAFETY: `lock_for_fork` forgot its guard, so no guard of this lock exists; the
        // thread that took it (the forking one) is the one releasing it.
        unsafe { self.table.force_unlock() };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_string_is_id_zero_and_uncounted() {
        let s = StringStorage::new();
        assert_eq!(s.intern("").unwrap(), StringId::EMPTY);
        assert_eq!(s.intern("").unwrap(), StringId::EMPTY);
        assert_eq!(s.refcount(StringId::EMPTY), Some(0));
        assert_eq!(s.get(StringId::EMPTY).unwrap(), "");
        assert!(s.is_empty());
        s.unintern(StringId::EMPTY).unwrap();
        s.advance_generation();
        assert_eq!(s.get(StringId::EMPTY).unwrap(), "");
    }

    #[test]
    fn intern_of_existing_string_bumps_count() {
        let s = StringStorage::new();
        let a = s.intern("hello").unwrap();
        assert_ne!(a, StringId::EMPTY);
        assert_eq!(s.intern("hello").unwrap(), a);
        assert_eq!(s.refcount(a), Some(2));
        let b = s.intern("world").unwrap();
        assert_ne!(a, b);
        assert_eq!(s.len(), 2);
        assert_eq!(s.get(a).unwrap(), "hello");
        assert_eq!(s.with_str(b, |x| x.len()).unwrap(), 5);
    }

    #[test]
    fn unintern_errors_on_unknown_and_underflow() {
        let s = StringStorage::new();
        assert_eq!(
            s.unintern(StringId::from_raw(42)),
            Err(StringError::UnknownId(42))
        );
        let a = s.intern("x").unwrap();
        s.unintern(a).unwrap();
        assert_eq!(s.unintern(a), Err(StringError::Underflow(a.value())));
        // Count zero: still readable until the generation advances.
        assert_eq!(s.get(a).unwrap(), "x");
        assert_eq!(s.refcount(a), Some(0));
        assert_eq!(s.len(), 0, "an unreferenced string is not counted");
        assert_eq!(
            s.intern("x").unwrap(),
            a,
            "revived before the generation advance"
        );
        assert_eq!(s.len(), 1);
    }

    #[test]
    fn advance_generation_frees_unreferenced_entries_only() {
        let s = StringStorage::new();
        let keep = s.intern("keep").unwrap();
        let drop = s.intern("drop").unwrap();
        s.unintern(drop).unwrap();
        assert_eq!(s.generation(), 0);
        assert_eq!(s.advance_generation(), 1);
        assert_eq!(s.generation(), 1);
        assert_eq!(s.get(keep).unwrap(), "keep");
        assert_eq!(s.get(drop), Err(StringError::UnknownId(drop.value())));
        assert_eq!(s.refcount(drop), None);
        assert_eq!(s.unintern(drop), Err(StringError::UnknownId(drop.value())));
        assert_eq!(s.len(), 1);
        // The freed id is reused, and the string can be interned again.
        let again = s.intern("other").unwrap();
        assert_eq!(again, drop);
        assert_eq!(s.get(again).unwrap(), "other");
    }

    #[test]
    fn batch_calls() {
        let s = StringStorage::new();
        let mut ids = vec![StringId::from_raw(99)];
        s.intern_all(&["a", "", "b", "a"], &mut ids).unwrap();
        assert_eq!(ids.len(), 4);
        assert_eq!(ids[1], StringId::EMPTY);
        assert_eq!(ids[0], ids[3]);
        assert_eq!(s.refcount(ids[0]), Some(2));
        // Not enough references for three uninterns of "a": nothing changes.
        assert_eq!(
            s.unintern_all(&[ids[0], ids[2], ids[0], ids[0]]),
            Err(StringError::Underflow(ids[0].value()))
        );
        assert_eq!(s.refcount(ids[0]), Some(2));
        assert_eq!(s.refcount(ids[2]), Some(1));
        assert_eq!(
            s.unintern_all(&[ids[2], StringId::from_raw(77)]),
            Err(StringError::UnknownId(77))
        );
        assert_eq!(s.refcount(ids[2]), Some(1));
        s.unintern_all(&ids).unwrap();
        assert_eq!(s.refcount(ids[0]), Some(0));
        s.advance_generation();
        assert!(s.is_empty());
    }

    #[test]
    fn bytes_eq_sees_every_differing_byte_at_every_length() {
        check_byte_equality(bytes_eq);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_bytes_eq_sees_every_differing_byte_at_every_length() {
        if !std::arch::is_x86_feature_detected!("avx2") {
            eprintln!("no AVX2 on this CPU: the AVX2 comparison cannot run here");
            return;
        }
        // SAFETY: the CPU has AVX2 (checked above).
        check_byte_equality(|a, b| unsafe { super::bytes_eq_avx2(a, b) });
    }

    fn check_byte_equality(eq: impl Fn(&[u8], &[u8]) -> bool) {
        let base: Vec<u8> = (0..150u8).map(|i| i.wrapping_mul(37) ^ 0x5a).collect();
        for n in 0..=base.len() {
            // Offset copies: the comparison must not depend on alignment.
            for shift in 0..3 {
                let mut buf = vec![0u8; n + shift];
                buf[shift..].copy_from_slice(&base[..n]);
                let a = &base[..n];
                let b = &mut buf[shift..];
                assert!(eq(a, b), "equal, n={n}");
                for i in 0..n {
                    b[i] ^= 0x10;
                    assert!(!eq(a, b), "byte {i} differs, n={n}");
                    b[i] ^= 0x10;
                }
            }
            if n > 0 {
                assert!(!eq(&base[..n], &base[..n - 1]));
            }
        }
    }

    #[test]
    fn intern_all_rolls_back_on_error() {
        let s = StringStorage::new();
        let long = "x".repeat(MAX_STRING_LEN + 1);
        let mut ids = Vec::new();
        let err = s.intern_all(&["a", &long], &mut ids).unwrap_err();
        assert_eq!(
            err,
            StringError::TooLong {
                len: MAX_STRING_LEN + 1,
                limit: MAX_STRING_LEN
            }
        );
        assert!(ids.is_empty());
        let a = s.intern("a").unwrap();
        assert_eq!(s.refcount(a), Some(1));
    }

    #[test]
    fn too_long_is_an_error() {
        let s = StringStorage::new();
        let long = "y".repeat(MAX_STRING_LEN + 1);
        assert!(matches!(s.intern(&long), Err(StringError::TooLong { .. })));
        assert!(s.intern(&long[..MAX_STRING_LEN]).is_ok());
    }

    #[test]
    fn memory_stays_flat_over_generations() {
        let s = StringStorage::new();
        for round in 0..50 {
            let ids: Vec<StringId> = (0..100)
                .map(|i| s.intern(&format!("s{round}-{i}")).unwrap())
                .collect();
            s.unintern_all(&ids).unwrap();
            s.advance_generation();
        }
        assert!(s.is_empty());
        // Ids are recycled: never more than one round's worth of entries.
        assert!(s.lock().entries.len() <= 101);
        assert!(s.memory_bytes() > 0);
    }

    #[test]
    fn fork_lock_is_held_until_released() {
        let s = StringStorage::new();
        s.lock_for_fork();
        assert!(s.table.try_lock().is_none());
        s.unlock_after_fork();
        assert_eq!(s.intern("after").unwrap().value(), 1);
    }

    #[test]
    fn shared_across_threads() {
        let s = Arc::new(StringStorage::new());
        let handles: Vec<_> = (0..4)
            .map(|t| {
                let s = s.clone();
                std::thread::spawn(move || {
                    for i in 0..1000 {
                        let id = s.intern(&format!("k{}", i % 10)).unwrap();
                        assert_eq!(s.get(id).unwrap(), format!("k{}", i % 10));
                        if t % 2 == 0 {
                            s.unintern(id).unwrap();
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert_eq!(s.len(), 10);
        let total: u32 = (0..10)
            .map(|i| {
                let id = s.intern(&format!("k{i}")).unwrap();
                s.refcount(id).unwrap() - 1
            })
            .sum();
        assert_eq!(total, 2000);
    }
}
