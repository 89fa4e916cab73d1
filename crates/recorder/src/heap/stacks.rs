//! Deduplicated, refcounted stack records (heap records): stack words and references, content
//! hashing, the hint table, and stacks found or stored without interning a seen one.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::error::{HeapError, StringError};
use crate::profile::{Frame, Str, MAX_FRAMES};
#[cfg(target_arch = "x86_64")]
use crate::strings::bytes_eq_avx2;
use crate::strings::{bytes_eq, StringId, Table};

use super::{mix64, probe_delete, probe_place, shard_of, HeapRecorder, MIN_INDEX_SLOTS};

pub(super) const STACK_SHARDS: usize = 16;
/// Stack references: slot in the low 27 bits, shard in the next 4, bit 31 free for `FROZEN_BIT`.
const STACK_SLOT_BITS: u32 = 27;
const STACK_SLOT_LIMIT: usize = 1 << STACK_SLOT_BITS;
pub(super) const STACK_REF_MASK: u32 = !FROZEN_BIT;
pub(super) const FROZEN_BIT: u32 = 1 << 31;
/// Second word of an address frame in a stack with symbols; symbol frames keep the top half of
/// that word zero.
const ADDRESS_TAG: u64 = 1 << 32;
/// Set in the hash word of a stack whose frames are all addresses: it stores one word per frame.
/// (Bit 63: neither shard choice nor index positions use it.)
const ADDRESS_STACK: u64 = 1 << 63;
/// Stacks up to this many frames are encoded in a stack buffer (no allocation on the hot path).
const INLINE_FRAMES: usize = 64;
/// Entries of the symbol-stack hint table (see [`HeapRecorder::hinted_stack`]).
pub(super) const STACK_HINTS: usize = 64;

/// The hint-table entry for a caller's frames buffer (its address and length) holding a stack
/// of `shape`.
#[inline]
fn hint_slot(frames: &[Frame<'_>], shape: u32) -> usize {
    let key = frames.as_ptr() as u64 ^ (frames.len() as u64).rotate_left(48) ^ u64::from(shape);
    (mix64(key) as usize) & (STACK_HINTS - 1)
}

/// A stack's shape: its frames' lines and addresses folded as the stack hashes fold frames (no
/// text is read). Equal stacks have equal shapes; stacks from different call sites mostly do
/// not.
#[inline]
fn shape_of(frames: &[Frame<'_>]) -> u32 {
    let line_or_address = |f: &Frame<'_>| {
        Ok::<u64, std::convert::Infallible>(match f {
            Frame::Address(a) => *a,
            Frame::Symbol { line, .. } => *line as u64,
        })
    };
    let Ok(h) = fold_frames(frames, HK[0], line_or_address);
    (h >> 32) as u32
}

pub(super) struct StackSlot {
    /// The stack's words (see the module docs), `None` while the slot is free.
    pub(super) words: Option<Arc<[u64]>>,
    /// A symbol stack's interned strings (name then filename per frame, empty for address
    /// frames), shared with the string table: a stack seen again is compared against them
    /// without locking the table.
    pub(super) texts: Box<[Arc<str>]>,
    /// Objects (committed, pending or being committed) using this stack.
    pub(super) refs: u32,
}

#[derive(Default)]
pub(super) struct StackShard {
    /// Linear-probing index of the live stacks, a power of two long, at most half full. An entry
    /// is the low 32 bits of the stack's hash (its home slot, and a filter before the words are
    /// touched) over the slot number plus one; 0 is empty.
    index: Vec<u64>,
    /// Stacks in `index`.
    pub(super) indexed: usize,
    pub(super) slots: Vec<StackSlot>,
    pub(super) free: Vec<u32>,
    /// Set while a snapshot exists: released stacks keep their slot and strings until
    /// `finish_iteration`, as the snapshot may refer to them.
    pub(super) pinned: bool,
    pub(super) quarantine: Vec<u32>,
}

impl StackShard {
    /// The slot of the live stack with hash word `hash` for which `eq` holds.
    fn find(&self, hash: u64, mut eq: impl FnMut(&[u64], &[Arc<str>]) -> bool) -> Option<usize> {
        if self.index.is_empty() {
            return None;
        }
        let mask = self.index.len() - 1;
        let mut i = hash as usize & mask;
        loop {
            let e = self.index[i];
            if e == 0 {
                return None;
            }
            if (e >> 32) as u32 == hash as u32 {
                let slot = (e as u32 - 1) as usize;
                let s = &self.slots[slot];
                if let Some(words) = s.words.as_deref() {
                    if words[0] == hash && eq(words, &s.texts) {
                        return Some(slot);
                    }
                }
            }
            i = (i + 1) & mask;
        }
    }

    fn place(&mut self, entry: u64) {
        probe_place(&mut self.index, (entry >> 32) as usize, entry);
    }

    fn rebuild_index(&mut self, len: usize) {
        let old = std::mem::replace(&mut self.index, vec![0; len]);
        for e in old.into_iter().filter(|&e| e != 0) {
            self.place(e);
        }
    }

    fn index_insert(&mut self, hash: u64, slot: usize) {
        if (self.indexed + 1) * 2 > self.index.len() {
            self.rebuild_index((self.index.len() * 2).max(MIN_INDEX_SLOTS));
        } else if self.index.len() > MIN_INDEX_SLOTS && (self.indexed + 1) * 8 < self.index.len() {
            // Shrunk here, not in `index_remove`: a release must not allocate.
            self.rebuild_index((self.index.len() / 2).max(MIN_INDEX_SLOTS));
        }
        self.place((hash << 32) | (slot as u64 + 1));
        self.indexed += 1;
    }

    /// Removes `slot` (whose hash word is `hash`) from the index.
    fn index_remove(&mut self, hash: u64, slot: usize) {
        let mask = self.index.len() - 1;
        let target = (hash << 32) | (slot as u64 + 1);
        let mut hole = hash as usize & mask;
        while self.index[hole] != target {
            if self.index[hole] == 0 {
                debug_assert!(false, "stack index lost a stack");
                return;
            }
            hole = (hole + 1) & mask;
        }
        probe_delete(&mut self.index, hole, |e| (e >> 32) as usize);
        self.indexed -= 1;
    }

    /// Drops one reference; returns the words whose strings must now be released.
    fn release(&mut self, slot: usize) -> Option<Arc<[u64]>> {
        let s = self.slots.get_mut(slot)?;
        if s.refs == 0 {
            debug_assert!(false, "heap record released more often than acquired");
            return None;
        }
        s.refs -= 1;
        if s.refs > 0 {
            return None;
        }
        let words = s.words.clone()?;
        self.index_remove(words[0], slot);
        if self.pinned {
            self.quarantine.push(slot as u32);
            return None;
        }
        self.slots[slot].words = None;
        self.slots[slot].texts = Box::default();
        self.free.push(slot as u32);
        Some(words)
    }
}

fn stack_ref(shard: usize, slot: usize) -> u32 {
    ((shard as u32) << STACK_SLOT_BITS) | slot as u32
}

pub(super) fn split_stack_ref(r: u32) -> (usize, usize) {
    let r = r & STACK_REF_MASK;
    (
        (r >> STACK_SLOT_BITS) as usize,
        (r as usize) & (STACK_SLOT_LIMIT - 1),
    )
}

/// The frames of an address-only stack (empty for no words), `None` for a stack with symbols.
pub(super) fn address_frames(words: &[u64]) -> Option<&[u64]> {
    match words.split_first() {
        None => Some(&[]),
        Some((&hash, frames)) => (hash & ADDRESS_STACK != 0).then_some(frames),
    }
}

pub(super) fn first_frame(words: &[u64]) -> Option<Frame<'static>> {
    match address_frames(words) {
        Some(addrs) => addrs.first().map(|&a| Frame::Address(a)),
        None => words.get(1..3).map(|w| decode_frame(w[0], w[1])),
    }
}

pub(super) fn decode_frame(a: u64, b: u64) -> Frame<'static> {
    if b & ADDRESS_TAG != 0 {
        Frame::Address(a)
    } else {
        Frame::Symbol {
            name: Str::Id(StringId(a as u32)),
            filename: Str::Id(StringId((a >> 32) as u32)),
            line: i64::from(b as u32 as i32),
        }
    }
}

/// Lines are kept as i32 (saturated): no source file gets near 2^31 lines.
#[inline]
fn line_word(line: i64) -> u64 {
    // Branch-free: this runs once per frame on every comparison.
    u64::from(line.clamp(i64::from(i32::MIN), i64::from(i32::MAX)) as i32 as u32)
}

/// Appends the interned ids a stack holds (empty strings are not counted, so not listed).
pub(super) fn push_string_ids(words: &[u64], out: &mut Vec<StringId>) {
    if address_frames(words).is_some() {
        return;
    }
    for f in words[1..].chunks_exact(2) {
        if f[1] & ADDRESS_TAG == 0 {
            for id in [f[0] as u32, (f[0] >> 32) as u32] {
                if id != 0 {
                    out.push(StringId(id));
                }
            }
        }
    }
}

// Stack hashing. The hash is a function of the frames' content (addresses, text, lines), so a
// stack given as text and the same stack stored as interned ids hash alike, and a stack seen
// before is found without interning. Equal hashes are always confirmed by comparing content.

const HK: [u64; 4] = [
    0x243f_6a88_85a3_08d3,
    0x1319_8a2e_0370_7344,
    0xa409_3822_299f_31d0,
    0x082e_fa98_ec4e_6c89,
];

/// 64x64 -> 128 multiply, halves xored (foldhash's and wyhash's mixing step).
#[inline]
fn fold(a: u64, b: u64) -> u64 {
    let p = u128::from(a) * u128::from(b);
    (p as u64) ^ ((p >> 64) as u64)
}

/// A string's contribution to a stack hash: its length and its first and last 8 bytes rather
/// than every byte. Symbol names are long (hashing 64 of them in full costs more than the rest
/// of a track), and names that agree there are still told apart by the content comparison that
/// confirms every hash match. Mixed by the stack hash's multiply, not here.
#[inline]
fn str_key(s: &str) -> u64 {
    let b = s.as_bytes();
    let n = b.len();
    let (first, last) = match (b.first_chunk::<8>(), b.last_chunk::<8>()) {
        (Some(f), Some(l)) => (u64::from_le_bytes(*f), u64::from_le_bytes(*l)),
        _ => {
            let mut w = [0u8; 8];
            w[..n].copy_from_slice(b);
            (u64::from_le_bytes(w), 0)
        }
    };
    first ^ last.rotate_left(29) ^ ((n as u64) << 48)
}

/// Folds per-frame keys into a stack hash, two frames per multiply; stops at the first error.
#[inline]
fn fold_frames<E>(
    frames: &[Frame<'_>],
    seed: u64,
    key: impl Fn(&Frame<'_>) -> Result<u64, E>,
) -> Result<u64, E> {
    let mut h = seed ^ frames.len() as u64;
    let mut pairs = frames.chunks_exact(2);
    for p in &mut pairs {
        h = fold(h ^ key(&p[0])?, key(&p[1])? ^ HK[1]);
    }
    if let [last] = pairs.remainder() {
        h = fold(h ^ key(last)?, HK[0]);
    }
    Ok(fold(h, HK[3]))
}

/// Hash word of an address-only stack (`ADDRESS_STACK` set); `None` when a frame is a symbol.
#[inline]
fn address_stack_hash(frames: &[Frame<'_>]) -> Option<u64> {
    let addr = |f: &Frame<'_>| match f {
        Frame::Address(a) => Ok(*a),
        Frame::Symbol { .. } => Err(()),
    };
    fold_frames(frames, HK[2], addr)
        .ok()
        .map(|h| h | ADDRESS_STACK)
}

/// The text of a frame string; ids are read from `table` (locked by the caller when needed).
fn text<'s>(s: &'s Str<'_>, table: Option<&'s Table>) -> Result<&'s str, StringError> {
    match (s, table) {
        (Str::Lit(t), _) => Ok(t),
        (Str::Id(id), Some(t)) => t.get(*id),
        (Str::Id(id), None) => Err(StringError::UnknownId(id.0)),
    }
}

/// Hash word of a stack with at least one symbol frame (`ADDRESS_STACK` clear). It covers
/// addresses, names and lines: filenames seldom tell apart stacks that agree on those, and the
/// comparison confirming every match includes them.
pub(super) fn symbol_stack_hash(
    frames: &[Frame<'_>],
    table: Option<&Table>,
) -> Result<u64, StringError> {
    let key = |f: &Frame<'_>| -> Result<u64, StringError> {
        Ok(match f {
            Frame::Address(a) => *a ^ HK[2],
            Frame::Symbol { name, line, .. } => {
                str_key(text(name, table)?) ^ (*line as u64).wrapping_mul(HK[3])
            }
        })
    };
    Ok(fold_frames(frames, HK[3], key)? & !ADDRESS_STACK)
}

/// Whether a frame string equals the stored string `id` whose text is `text` (ids compare as
/// ids: a live string has one id).
#[inline(always)]
fn same_str(s: &Str<'_>, id: u32, text: &str, eq: impl Fn(&[u8], &[u8]) -> bool) -> bool {
    match s {
        Str::Id(i) => i.0 == id,
        Str::Lit(t) => eq(text.as_bytes(), t.as_bytes()),
    }
}

/// Whether a stored stack (`words`, and `texts` for its symbol frames) holds exactly `frames`,
/// comparing text with the widest vectors the CPU has.
#[inline]
fn frames_match(words: &[u64], texts: &[Arc<str>], frames: &[Frame<'_>]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked just above).
        return unsafe { frames_match_avx2(words, texts, frames) };
    }
    frames_match_sse(words, texts, frames)
}

/// Out of line: inlined into its caller the comparison runs short of registers and spills.
#[inline(never)]
pub(super) fn frames_match_sse(words: &[u64], texts: &[Arc<str>], frames: &[Frame<'_>]) -> bool {
    frames_match_with(words, texts, frames, bytes_eq)
}

/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline(never)]
pub(super) unsafe fn frames_match_avx2(
    words: &[u64],
    texts: &[Arc<str>],
    frames: &[Frame<'_>],
) -> bool {
    // SAFETY: AVX2 is supported, by this function's contract.
    frames_match_with(words, texts, frames, |a, b| unsafe { bytes_eq_avx2(a, b) })
}

#[inline(always)]
fn frames_match_with(
    words: &[u64],
    texts: &[Arc<str>],
    frames: &[Frame<'_>],
    eq: impl Fn(&[u8], &[u8]) -> bool + Copy,
) -> bool {
    if let Some(addrs) = address_frames(words) {
        return addrs.len() == frames.len()
            && frames
                .iter()
                .zip(addrs)
                .all(|(f, &w)| matches!(f, Frame::Address(a) if *a == w));
    }
    let pairs = words[1..].chunks_exact(2);
    let text_pairs = texts.chunks_exact(2);
    if pairs.len() != frames.len() || text_pairs.len() != frames.len() {
        return false;
    }
    for ((f, w), t) in frames.iter().zip(pairs).zip(text_pairs) {
        let (a, b, name_text, file_text) = (w[0], w[1], &t[0], &t[1]);
        let same = match f {
            Frame::Address(x) => a == *x && b == ADDRESS_TAG,
            Frame::Symbol {
                name,
                filename,
                line,
            } => {
                // The stored line is `line_word(line)`; a line outside i32 never matches here
                // and is found by the exact word comparison of the insert path instead.
                i64::from(b as u32 as i32) == *line
                    && b & ADDRESS_TAG == 0
                    && same_str(name, a as u32, name_text, eq)
                    && same_str(filename, (a >> 32) as u32, file_text, eq)
            }
        };
        if !same {
            return false;
        }
    }
    true
}

impl HeapRecorder {
    /// Finds or creates the heap record for `frames` and takes one reference on it.
    ///
    /// A stack seen before is found by its content hash and a content comparison (a symbol stack
    /// first tries the hint for its caller's buffer), without interning anything (the record
    /// already holds its strings); only a new stack interns.
    pub(super) fn acquire_stack(&self, frames: &[Frame<'_>]) -> Result<u32, HeapError> {
        if frames.len() > MAX_FRAMES {
            return Err(HeapError::TooManyFrames {
                got: frames.len(),
                limit: MAX_FRAMES,
            });
        }
        if let Some(hash) = address_stack_hash(frames) {
            return self.find_or_insert_stack(frames, hash);
        }
        // Symbol stacks are costly to hash (their text): a caller that fills one buffer per
        // thread and allocates repeatedly from one site presents the same stack again and
        // again, so first try the stack last seen from this buffer with this shape (lines, no
        // text). The shape keeps a hint per stack for a buffer alternating between stacks, and
        // turns most wrong hints away before the comparison.
        let shape = shape_of(frames);
        let hint = &self.stack_hints[hint_slot(frames, shape)];
        let hinted = hint.load(Ordering::Relaxed);
        if (hinted >> 32) as u32 == shape {
            if let Some(r) = self.hinted_stack(hinted as u32, frames) {
                return Ok(r);
            }
        }
        // Ids handed in by the caller are hashed through their text: without the table an id
        // fails the first try, which then runs again with the table locked.
        let hash = match symbol_stack_hash(frames, None) {
            Ok(h) => h,
            Err(_) => symbol_stack_hash(frames, Some(&self.strings.lock()))?,
        };
        let r = self.find_or_insert_stack(frames, hash)?;
        hint.store(u64::from(shape) << 32 | u64::from(r + 1), Ordering::Relaxed);
        Ok(r)
    }

    /// Takes a reference on stack `hint - 1` when it is live and holds exactly `frames`.
    fn hinted_stack(&self, hint: u32, frames: &[Frame<'_>]) -> Option<u32> {
        let r = hint.checked_sub(1)?;
        let (shard_idx, slot) = split_stack_ref(r);
        let mut shard = self.stacks.get(shard_idx)?.lock();
        let s = shard.slots.get_mut(slot)?;
        // No reference: free, or released and kept only for a snapshot (no longer indexed):
        // never revive it.
        if s.refs == 0 || s.refs == u32::MAX {
            return None;
        }
        if !frames_match(s.words.as_deref()?, &s.texts, frames) {
            return None;
        }
        s.refs += 1;
        Some(r)
    }

    /// Finds the heap record for `frames` by its hash word, or creates it; takes one reference.
    fn find_or_insert_stack(&self, frames: &[Frame<'_>], hash: u64) -> Result<u32, HeapError> {
        let shard_idx = shard_of(hash, STACK_SHARDS);
        {
            let mut shard = self.stacks[shard_idx].lock();
            if let Some(slot) = shard.find(hash, |words, texts| frames_match(words, texts, frames))
            {
                let s = &mut shard.slots[slot];
                if s.refs == u32::MAX {
                    return Err(HeapError::TooManyObjects(u32::MAX));
                }
                s.refs += 1;
                return Ok(stack_ref(shard_idx, slot));
            }
        }
        self.insert_stack(frames, hash)
    }

    /// The miss path of [`Self::acquire_stack`]: interns the strings, stores the stack (unless
    /// another thread stored it meanwhile) and takes one reference on it.
    fn insert_stack(&self, frames: &[Frame<'_>], hash: u64) -> Result<u32, HeapError> {
        let len = if hash & ADDRESS_STACK != 0 {
            1 + frames.len()
        } else {
            1 + 2 * frames.len()
        };
        let mut inline = [0u64; 1 + 2 * INLINE_FRAMES];
        let mut spilled = Vec::new();
        let words: &mut [u64] = if frames.len() <= INLINE_FRAMES {
            &mut inline[..len]
        } else {
            spilled.resize(len, 0);
            &mut spilled
        };
        let texts = self.encode_stack(frames, hash, words)?;
        let interned = texts.is_some();
        let result = self.acquire_words(words, texts.unwrap_or_default());
        let extra_refs = match result {
            // The record already holds references to these strings: drop the ones just taken.
            Ok((_, existed)) => interned && existed,
            Err(_) => interned,
        };
        if extra_refs {
            let mut ids = Vec::with_capacity(2 * frames.len());
            push_string_ids(words, &mut ids);
            if let Err(e) = self.strings.unintern_all(&ids) {
                // Fail as a whole: give back the reference just taken on the record too.
                if let Ok((r, _)) = result {
                    let _ = self.release_stack(r);
                }
                return Err(e.into());
            }
        }
        result.map(|(r, _)| r)
    }

    /// Fills `words` with the compact stack (see the module docs) under the hash word `hash`.
    /// When strings were interned (one reference each, owned by the caller now), returns their
    /// shared texts in frame order.
    fn encode_stack(
        &self,
        frames: &[Frame<'_>],
        hash: u64,
        words: &mut [u64],
    ) -> Result<Option<Box<[Arc<str>]>>, HeapError> {
        words[0] = hash;
        if hash & ADDRESS_STACK != 0 {
            for (w, f) in words[1..].iter_mut().zip(frames) {
                if let Frame::Address(a) = f {
                    *w = *a;
                }
            }
            return Ok(None);
        }
        let mut ids = Vec::new();
        // Ids handed in by the caller are turned back into text: the record needs references
        // of its own, and interning is the only way to take one.
        let mut owned = Vec::new();
        for f in frames {
            if let Frame::Symbol { name, filename, .. } = f {
                for s in [name, filename] {
                    if let Str::Id(id) = s {
                        owned.push(self.strings.get(*id)?);
                    }
                }
            }
        }
        let mut owned_iter = owned.iter();
        let mut strs: Vec<&str> = Vec::with_capacity(2 * frames.len());
        for f in frames {
            if let Frame::Symbol { name, filename, .. } = f {
                for s in [name, filename] {
                    strs.push(match s {
                        Str::Lit(t) => t,
                        Str::Id(_) => owned_iter.next().map_or("", String::as_str),
                    });
                }
            }
        }
        self.strings.intern_all(&strs, &mut ids)?;
        // Two texts per frame (empty ones for address frames), so a comparison walks frames,
        // words and texts in step.
        let mut text_ids = Vec::with_capacity(2 * frames.len());
        let mut symbol_ids = ids.iter();
        for f in frames {
            match f {
                Frame::Symbol { .. } => text_ids.extend(symbol_ids.by_ref().take(2)),
                Frame::Address(_) => text_ids.extend([StringId::EMPTY; 2]),
            }
        }
        let texts = self.strings.shared_texts(&text_ids);
        let mut ids = ids.into_iter();
        for (i, f) in frames.iter().enumerate() {
            let (a, b) = match f {
                Frame::Symbol { line, .. } => {
                    let name = ids.next().unwrap_or_default();
                    let file = ids.next().unwrap_or_default();
                    (
                        u64::from(name.0) | (u64::from(file.0) << 32),
                        line_word(*line),
                    )
                }
                Frame::Address(addr) => (*addr, ADDRESS_TAG),
            };
            words[1 + 2 * i] = a;
            words[2 + 2 * i] = b;
        }
        Ok(Some(texts))
    }

    /// Returns the stack reference and whether the stack was already known. Stored words compare
    /// exactly: the strings of both are live interned ids, equal exactly when the text is.
    fn acquire_words(
        &self,
        words: &[u64],
        texts: Box<[Arc<str>]>,
    ) -> Result<(u32, bool), HeapError> {
        let shard_idx = shard_of(words[0], STACK_SHARDS);
        let mut shard = self.stacks[shard_idx].lock();
        if let Some(slot) = shard.find(words[0], |w, _| w == words) {
            let s = &mut shard.slots[slot];
            if s.refs == u32::MAX {
                return Err(HeapError::TooManyObjects(u32::MAX));
            }
            s.refs += 1;
            return Ok((stack_ref(shard_idx, slot), true));
        }
        let slot = match shard.free.pop() {
            Some(slot) => slot as usize,
            None if shard.slots.len() < STACK_SLOT_LIMIT => {
                shard.slots.push(StackSlot {
                    words: None,
                    texts: Box::default(),
                    refs: 0,
                });
                // Room for every slot on the free and quarantine lists, so that releasing a
                // stack (on the application's `free`) never grows them.
                let sh = &mut *shard;
                let n = sh.slots.len();
                sh.free.reserve(n.saturating_sub(sh.free.len()));
                sh.quarantine.reserve(n.saturating_sub(sh.quarantine.len()));
                n - 1
            }
            None => {
                return Err(HeapError::TooManyStacks {
                    limit: STACK_SLOT_LIMIT * STACK_SHARDS,
                })
            }
        };
        shard.slots[slot] = StackSlot {
            words: Some(Arc::from(words)),
            texts,
            refs: 1,
        };
        shard.index_insert(words[0], slot);
        Ok((stack_ref(shard_idx, slot), false))
    }

    pub(super) fn stack_words(&self, stack: u32) -> Option<Arc<[u64]>> {
        let (shard, slot) = split_stack_ref(stack);
        self.stacks[shard].lock().slots.get(slot)?.words.clone()
    }

    pub(super) fn release_stack(&self, stack: u32) -> Result<(), StringError> {
        let (shard, slot) = split_stack_ref(stack);
        let freed = self.stacks[shard].lock().release(slot);
        match freed {
            // Address frames hold no strings: nothing to release, nothing to allocate.
            Some(words) if address_frames(&words).is_none() => {
                let ids = words[1..]
                    .chunks_exact(2)
                    .filter(|f| f[1] & ADDRESS_TAG == 0)
                    .flat_map(|f| [f[0] as u32, (f[0] >> 32) as u32])
                    .filter(|&id| id != 0)
                    .map(StringId);
                self.strings.unintern_each(ids)
            }
            _ => Ok(()),
        }
    }
}
