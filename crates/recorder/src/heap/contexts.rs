//! Request contexts: the local root span id (and endpoint, once named) of the trace that
//! allocated an object, refcounted and shared by the objects of one trace.

use super::HeapRecorder;
use crate::error::HeapError;
use crate::strings::StringId;

/// Request contexts held at once (each has at least one tracked object); objects tracked past
/// that have none (counted in
/// [`HeapStats::lifetime_contexts_refused`](super::HeapStats::lifetime_contexts_refused)).
pub const MAX_CONTEXTS: usize = 1 << 24;

#[derive(Debug, Clone, Copy, Default)]
pub(super) struct ContextEntry {
    /// Local root span id of the trace.
    pub(super) root: u64,
    /// The trace's endpoint (one reference held), `StringId::EMPTY` until named.
    pub(super) endpoint: StringId,
    /// Objects (committed or being committed) with this context.
    refs: u32,
}

/// The contexts of tracked objects (see the module docs). Context ids are positions in
/// `entries` plus one; 0 is none.
#[derive(Default)]
pub(super) struct Contexts {
    /// Live entries by root: a root whose entry went (even one quarantined) gets a new entry.
    pub(super) by_root: std::collections::HashMap<u64, u32, foldhash::fast::FixedState>,
    pub(super) entries: Vec<ContextEntry>,
    free: Vec<u32>,
    /// Set while a snapshot exists: released entries keep their root and endpoint until
    /// `finish_iteration`, as the snapshot may refer to them.
    pub(super) pinned: bool,
    quarantine: Vec<u32>,
    pub(super) refused: u64,
}

impl Contexts {
    /// Takes one reference on the context of `root`, made if new; 0 when none can be made.
    pub(super) fn acquire(&mut self, root: u64) -> u32 {
        if let Some(&id) = self.by_root.get(&root) {
            self.entries[id as usize - 1].refs += 1;
            return id;
        }
        let pos = match self.free.pop() {
            Some(pos) => pos as usize,
            None if self.entries.len() < MAX_CONTEXTS => {
                self.entries.push(ContextEntry::default());
                // Room for every entry on the free and quarantine lists, so that a release
                // (on the application's `free`) never grows them.
                let n = self.entries.len();
                self.free.reserve(n.saturating_sub(self.free.len()));
                self.quarantine
                    .reserve(n.saturating_sub(self.quarantine.len()));
                n - 1
            }
            None => {
                self.refused += 1;
                return 0;
            }
        };
        self.entries[pos] = ContextEntry {
            root,
            endpoint: StringId::EMPTY,
            refs: 1,
        };
        let id = pos as u32 + 1;
        self.by_root.insert(root, id);
        id
    }

    /// Drops one reference on `id`; returns the endpoint string to release when the entry went.
    pub(super) fn release(&mut self, id: u32) -> Option<StringId> {
        let pos = (id as usize).checked_sub(1)?;
        let e = self.entries.get_mut(pos)?;
        if e.refs == 0 {
            debug_assert!(false, "context released more often than acquired");
            return None;
        }
        e.refs -= 1;
        if e.refs > 0 {
            return None;
        }
        let (root, endpoint) = (e.root, e.endpoint);
        if self.by_root.get(&root) == Some(&id) {
            self.by_root.remove(&root);
        }
        if self.pinned {
            self.quarantine.push(pos as u32);
            return None;
        }
        self.entries[pos] = ContextEntry::default();
        self.free.push(pos as u32);
        self.maybe_shrink();
        Some(endpoint)
    }

    /// Gives memory back once most contexts went.
    fn maybe_shrink(&mut self) {
        if self.by_root.is_empty() && self.quarantine.is_empty() && self.entries.len() > 64 {
            self.entries = Vec::new();
            self.free = Vec::new();
            self.by_root = Default::default();
        }
    }

    /// Ends a snapshot: quarantined entries are freed; returns their endpoints to release.
    pub(super) fn unpin(&mut self, out: &mut Vec<StringId>) {
        self.pinned = false;
        // Its capacity is kept: a release while pinned must not grow it.
        let mut quarantined = std::mem::take(&mut self.quarantine);
        for &pos in &quarantined {
            let pos = pos as usize;
            if self.entries[pos].refs == 0 {
                if self.entries[pos].endpoint != StringId::EMPTY {
                    out.push(self.entries[pos].endpoint);
                }
                self.entries[pos] = ContextEntry::default();
                self.free.push(pos as u32);
            }
        }
        quarantined.clear();
        self.quarantine = quarantined;
        self.maybe_shrink();
    }
}

impl HeapRecorder {
    /// Names the endpoint of the trace rooted at `local_root_span_id`: the heap samples of its
    /// objects still tracked carry it (last call wins). Nothing is kept for a trace without
    /// tracked objects.
    pub fn name_context(&self, local_root_span_id: u64, endpoint: &str) -> Result<(), HeapError> {
        if local_root_span_id == 0 || endpoint.is_empty() {
            return Ok(());
        }
        let current = {
            let c = self.contexts.lock();
            let Some(&id) = c.by_root.get(&local_root_span_id) else {
                return Ok(());
            };
            c.entries[id as usize - 1].endpoint
        };
        // The usual case, a trace named once: nothing to intern.
        if current != StringId::EMPTY
            && self.strings.with_str(current, |t| t == endpoint) == Ok(true)
        {
            return Ok(());
        }
        // Interned outside the contexts' lock (the string table has its own).
        let name = self.strings.intern(endpoint)?;
        let old = {
            let mut c = self.contexts.lock();
            match c.by_root.get(&local_root_span_id).copied() {
                Some(id) => {
                    let e = &mut c.entries[id as usize - 1];
                    std::mem::replace(&mut e.endpoint, name)
                }
                // Its objects went meanwhile.
                None => name,
            }
        };
        self.release_class(old);
        Ok(())
    }
}
