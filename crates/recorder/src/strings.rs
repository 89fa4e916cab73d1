//! Refcounted string interning shared by the profiles and the heap recorder.
//!
//! Id 0 is the empty string: always present, never counted. `intern` of a known string returns its
//! id and bumps its count; `unintern` drops one count. Entries whose count reached zero stay
//! readable until [`StringStorage::advance_generation`], which frees them (and makes their ids
//! reusable). The batch calls take the lock once.
//!
//! CONTRACT (implementation pending, see issue 2): `Send + Sync`; all methods take `&self`.

use crate::error::StringError;

/// An interned string's id. `StringId::EMPTY` (0) is the empty string.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct StringId(pub(crate) u32);

impl StringId {
    pub const EMPTY: StringId = StringId(0);

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

/// Thread-safe refcounted string table.
#[derive(Debug, Default)]
pub struct StringStorage {
    _todo: (),
}

impl StringStorage {
    pub fn new() -> Self {
        todo!("issue 2")
    }

    /// Interns `s`, returning its id; `""` is always `StringId::EMPTY` and is not counted.
    pub fn intern(&self, _s: &str) -> Result<StringId, StringError> {
        todo!("issue 2")
    }

    /// Interns every string, writing ids into `out` (cleared first). One lock acquisition.
    pub fn intern_all(&self, _strs: &[&str], _out: &mut Vec<StringId>) -> Result<(), StringError> {
        todo!("issue 2")
    }

    /// Drops one reference. Unknown id or underflow is an error. `EMPTY` is a no-op.
    pub fn unintern(&self, _id: StringId) -> Result<(), StringError> {
        todo!("issue 2")
    }

    /// Drops one reference of each id. One lock acquisition; validates all ids before changing any.
    pub fn unintern_all(&self, _ids: &[StringId]) -> Result<(), StringError> {
        todo!("issue 2")
    }

    /// Calls `f` with the string behind `id` (errors on a released or unknown id).
    pub fn with_str<R>(&self, _id: StringId, _f: impl FnOnce(&str) -> R) -> Result<R, StringError> {
        todo!("issue 2")
    }

    /// Owned copy of the string behind `id`.
    pub fn get(&self, id: StringId) -> Result<String, StringError> {
        self.with_str(id, str::to_owned)
    }

    /// Frees every entry whose count is zero; returns the new generation number.
    pub fn advance_generation(&self) -> u64 {
        todo!("issue 2")
    }

    /// Current generation (starts at 0, +1 per `advance_generation`).
    pub fn generation(&self) -> u64 {
        todo!("issue 2")
    }

    /// Live entries, not counting the empty string.
    pub fn len(&self) -> usize {
        todo!("issue 2")
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Refcount of `id` (None if not live). For tests and stats.
    pub fn refcount(&self, _id: StringId) -> Option<u32> {
        todo!("issue 2")
    }

    /// Bytes held by the table (strings + index), for memory reporting.
    pub fn memory_bytes(&self) -> usize {
        todo!("issue 2")
    }
}
