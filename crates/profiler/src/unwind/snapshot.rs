//! The published view of the process a walk reads: unwind sections, stack mappings and the
//! compact rules, swapped by the sampler and freed once no reader is inside.

use super::*;

/// Bytes of a module's unwind sections: in place in the module (main program, vDSO) or in a
/// private copy kept alive by the snapshot or rule table that uses it.
#[derive(Clone, Copy)]
pub(crate) struct MemSlice {
    pub(super) ptr: *const u8,
    pub(super) len: usize,
}

impl Default for MemSlice {
    fn default() -> Self {
        MemSlice {
            ptr: std::ptr::NonNull::<u8>::dangling().as_ptr(),
            len: 0,
        }
    }
}

// SAFETY: MemSlice points into read-only segments of objects never unloaded, or into an
// immutable private copy; both are shared by every thread and only read.
unsafe impl Send for MemSlice {}
// SAFETY: as above.
unsafe impl Sync for MemSlice {}

impl Deref for MemSlice {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: built from a mapped, readable range of an object that is never unloaded, or
        // from a private copy that outlives every snapshot and rule table using it.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

pub(super) type NativeUnwinder = UnwinderNative<MemSlice, MustNotAllocateDuringUnwind>;
pub(super) type NativeCache = CacheNative<MustNotAllocateDuringUnwind>;

/// An immutable view of the process for handlers to unwind with.
pub(crate) struct Snapshot {
    pub(super) unwinder: NativeUnwinder,
    /// Sorted, non-overlapping readable+writable mappings: candidate stacks.
    pub(super) rw_maps: Vec<(u64, u64)>,
    /// The main thread's `[stack]` mapping, which grows down past its recorded start.
    pub(super) main_stack: Option<(u64, u64)>,
    /// Lowest address the main stack may grow to (its top minus the stack size limit).
    pub(super) main_stack_floor: u64,
    pub(super) objects_gen: (u64, u64),
    /// The objects (their unwind section copies are what `unwinder` and `rules` read).
    pub(super) objects: Vec<LoadedObject>,
    /// Compact rules for the fast path, shared by the snapshots of one set of loaded objects.
    #[cfg(target_arch = "x86_64")]
    pub(super) rules: Arc<RuleTable>,
    /// `rules`' entries, one pointer away for the handler.
    #[cfg(target_arch = "x86_64")]
    pub(super) rule_entries: rules::Entries,
    #[cfg(target_arch = "aarch64")]
    pub(super) ptr_auth_mask: framehop::aarch64::PtrAuthMask,
}

impl Snapshot {
    /// `prev`: the snapshot being replaced, whose learned rules carry over when the loaded
    /// objects did not change.
    pub(super) fn build(prev: Option<&Snapshot>) -> Snapshot {
        let (objects, objects_gen) =
            loaded_objects_for_unwind(prev.map(|p| (&p.objects[..], p.objects_gen)));
        let mut unwinder = NativeUnwinder::new();
        #[cfg(target_arch = "x86_64")]
        let mut rule_modules = Vec::new();
        for obj in &objects {
            if let Some(sections) = Sections::of(obj) {
                #[cfg(target_arch = "x86_64")]
                rule_modules.push(sections.rule_module());
                unwinder.add_module(sections.module(obj));
            }
        }
        #[cfg(target_arch = "x86_64")]
        let rules = match prev {
            Some(p) if p.objects_gen == objects_gen => Arc::clone(&p.rules),
            _ => Arc::new(RuleTable::new(
                rule_modules,
                objects
                    .iter()
                    .filter_map(|o| o.unwind_copy.clone())
                    .collect(),
            )),
        };
        #[cfg(not(target_arch = "x86_64"))]
        let _ = prev;
        let (rw_maps, main_stack) = read_rw_maps();
        let main_stack_floor = main_stack.map_or(0, |(_, hi)| hi.saturating_sub(stack_limit()));
        #[cfg(target_arch = "aarch64")]
        let ptr_auth_mask = framehop::aarch64::PtrAuthMask::from_max_known_address(
            unwinder.max_known_code_address(),
        );
        Snapshot {
            unwinder,
            rw_maps,
            main_stack,
            main_stack_floor,
            objects_gen,
            objects,
            #[cfg(target_arch = "x86_64")]
            rule_entries: rules.entries(),
            #[cfg(target_arch = "x86_64")]
            rules,
            #[cfg(target_arch = "aarch64")]
            ptr_auth_mask,
        }
    }

    /// Bounds of the stack mapping that contains `sp` (async-signal-safe).
    pub(super) fn stack_of(&self, sp: u64) -> Option<(u64, u64)> {
        if let Some((lo, hi)) = self.main_stack {
            // The main stack grows down on demand below the start we read.
            if sp < hi && sp >= lo.saturating_sub(MAIN_STACK_GROWTH) {
                return Some((sp, hi));
            }
        }
        let i = self.rw_maps.partition_point(|&(start, _)| start <= sp);
        if i == 0 {
            return None;
        }
        let (start, end) = self.rw_maps[i - 1];
        (start <= sp && sp < end).then_some((sp, end))
    }

    /// Lowest address usable by the stack that contains `sp`: the start of its mapping (a
    /// thread's guard page is a mapping of its own), or how far the main stack may grow.
    pub(super) fn stack_floor_of(&self, sp: u64) -> Option<u64> {
        if let Some((lo, hi)) = self.main_stack {
            if sp < hi && sp >= lo.saturating_sub(MAIN_STACK_GROWTH) {
                return Some(self.main_stack_floor.min(lo));
            }
        }
        let i = self.rw_maps.partition_point(|&(start, _)| start <= sp);
        let (start, end) = *self.rw_maps.get(i.checked_sub(1)?)?;
        (start <= sp && sp < end).then_some(start)
    }
}

/// How far below the recorded start the main stack may have grown (default stack rlimit).
pub(super) const MAIN_STACK_GROWTH: u64 = 8 << 20;

/// The main thread's stack size limit (`RLIMIT_STACK`), or [`MAIN_STACK_GROWTH`] when unlimited.
pub(super) fn stack_limit() -> u64 {
    // SAFETY: getrlimit only writes the out-struct.
    let mut rl: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::getrlimit(libc::RLIMIT_STACK, &mut rl) } != 0
        || rl.rlim_cur == libc::RLIM_INFINITY
    {
        return MAIN_STACK_GROWTH;
    }
    rl.rlim_cur
}

/// Where a loaded object's unwind sections are, in memory.
pub(super) struct Sections {
    pub(super) start: u64,
    pub(super) end: u64,
    pub(super) base: u64,
    pub(super) hdr: MemSlice,
    pub(super) hdr_addr: u64,
    pub(super) eh_frame: MemSlice,
    pub(super) eh_frame_addr: u64,
    /// The executable segment, relative to the object's base.
    pub(super) text: Option<std::ops::Range<u64>>,
}

impl Sections {
    pub(super) fn of(obj: &LoadedObject) -> Option<Sections> {
        let (start, end) = obj.range()?;
        let text = obj
            .segments
            .iter()
            .find(|s| s.flags & libc::PF_X != 0)
            .map(|s| (s.start - obj.base)..(s.end - obj.base));
        if let Some(c) = &obj.unwind_copy {
            // An object that may be unloaded: its copies only.
            return Some(Sections {
                start,
                end,
                base: obj.base,
                hdr: MemSlice {
                    ptr: c.hdr.as_ptr(),
                    len: c.hdr.len(),
                },
                hdr_addr: c.hdr_addr,
                eh_frame: MemSlice {
                    ptr: c.eh_frame.as_ptr(),
                    len: c.eh_frame.len(),
                },
                eh_frame_addr: c.eh_frame_addr,
                text,
            });
        }
        if obj.unwind_copy.is_none() && !never_unloaded(obj) {
            // Copying failed (no unwind sections): not in the unwinder at all.
            return None;
        }
        let (hdr_start, hdr_end) = obj.eh_frame_hdr?;
        let hdr_seg = obj.segment_of(hdr_start)?;
        if hdr_end > hdr_seg.end || hdr_end <= hdr_start {
            return None;
        }
        let hdr = MemSlice {
            ptr: hdr_start as *const u8,
            len: (hdr_end - hdr_start) as usize,
        };
        let eh_frame_start = crate::modules::eh_frame_address(&hdr, hdr_start)?;
        // The section's size is not recorded anywhere in memory; lookups go through the index
        // in `.eh_frame_hdr`, so the slice may extend to the end of the containing segment.
        let eh_seg = obj.segment_of(eh_frame_start)?;
        let eh_frame = MemSlice {
            ptr: eh_frame_start as *const u8,
            len: (eh_seg.end - eh_frame_start) as usize,
        };
        Some(Sections {
            start,
            end,
            base: obj.base,
            hdr,
            hdr_addr: hdr_start,
            eh_frame,
            eh_frame_addr: eh_frame_start,
            text,
        })
    }

    pub(super) fn module(&self, obj: &LoadedObject) -> Module<MemSlice> {
        let rel = |a: u64, len: usize| (a - self.base)..(a - self.base + len as u64);
        let info = ExplicitModuleSectionInfo {
            base_svma: 0,
            text_svma: self.text.clone(),
            eh_frame_svma: Some(rel(self.eh_frame_addr, self.eh_frame.len)),
            eh_frame: Some(self.eh_frame),
            eh_frame_hdr_svma: Some(rel(self.hdr_addr, self.hdr.len)),
            eh_frame_hdr: Some(self.hdr),
            ..Default::default()
        };
        Module::new(obj.name.clone(), self.start..self.end, self.base, info)
    }
}

#[cfg(target_arch = "x86_64")]
impl Sections {
    pub(super) fn rule_module(&self) -> RuleModule {
        RuleModule {
            start: self.start,
            end: self.end,
            text_addr: self.text.as_ref().map_or(0, |t| self.base + t.start),
            hdr: self.hdr,
            hdr_addr: self.hdr_addr,
            eh_frame: self.eh_frame,
            eh_frame_addr: self.eh_frame_addr,
        }
    }
}

/// The objects whose unwind sections are read in place: the main program (listed first, with
/// no name) and the vDSO. Everything else may be unloaded.
pub(super) fn never_unloaded(obj: &LoadedObject) -> bool {
    obj.name.is_empty() || obj.path.is_none()
}

/// The start of the function whose unwind entry covers `probe`, from the sorted table of an
/// `.eh_frame_hdr` at `hdr_addr` (the last entry starting at or below it).
pub(crate) fn hdr_function_start(hdr: &[u8], hdr_addr: u64, probe: u64) -> Option<u64> {
    const UDATA4: u8 = 0x03;
    const DATAREL_SDATA4: u8 = 0x3b;
    let (&[version, ptr_enc, count_enc, table_enc], rest) = hdr.split_first_chunk::<4>()?;
    if version != 1 || ![UDATA4, 0x0b, 0x13, 0x1b].contains(&ptr_enc) {
        return None;
    }
    if count_enc != UDATA4 || table_enc != DATAREL_SDATA4 || rest.len() < 8 {
        return None;
    }
    let count = u32::from_le_bytes(rest[4..8].try_into().ok()?) as usize;
    let table = rest.get(8..8 + count.checked_mul(8)?)?;
    let start_of = |i: usize| {
        let b = &table[i * 8..i * 8 + 4];
        let v = i32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        hdr_addr.wrapping_add_signed(i64::from(v))
    };
    let (mut lo, mut hi) = (0, count);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if start_of(mid) <= probe {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo.checked_sub(1).map(start_of)
}

/// The start of the function containing code address `addr`, from its object's unwind table.
#[cfg(target_arch = "x86_64")]
pub(super) fn function_start(snap: &Snapshot, addr: u64) -> Option<u64> {
    let obj = snap.objects.iter().find(|o| o.executes(addr))?;
    let sections = Sections::of(obj)?;
    hdr_function_start(&sections.hdr, sections.hdr_addr, addr)
}

/// Where the call instruction just before `ret` goes, when its target is fixed: a direct call
/// (`call rel32`), followed through a bound PLT stub (`jmp *GOT`), or a call through a GOT
/// entry (`call *GOT(%rip)`, how Rust calls into other crates); None for other indirect calls,
/// an unbound stub or unreadable code.
#[cfg(target_arch = "x86_64")]
pub(super) fn direct_call_target(snap: &Snapshot, ret: u64) -> Option<u64> {
    let mut call = [0u8; 6];
    if read_own_memory(ret.checked_sub(6)?, &mut call) != 6 {
        return None;
    }
    if call[..2] == [0xff, 0x15] {
        let disp = i32::from_le_bytes(call[2..6].try_into().ok()?);
        return bound_code(snap, ret.wrapping_add_signed(i64::from(disp)));
    }
    if call[1] != 0xe8 {
        return None;
    }
    let rel = i32::from_le_bytes(call[2..6].try_into().ok()?);
    let target = ret.wrapping_add_signed(i64::from(rel));
    let mut code = [0u8; 11];
    if read_own_memory(target, &mut code) != code.len() {
        return None;
    }
    // endbr64, then an optional bnd prefix.
    let mut at = if code[..4] == [0xf3, 0x0f, 0x1e, 0xfa] {
        4
    } else {
        0
    };
    if code[at] == 0xf2 {
        at += 1;
    }
    if code[at..at + 2] != [0xff, 0x25] {
        return Some(target);
    }
    let disp = i32::from_le_bytes(code[at + 2..at + 6].try_into().ok()?);
    bound_code(
        snap,
        (target + at as u64 + 6).wrapping_add_signed(i64::from(disp)),
    )
}

/// The function a GOT entry at `got` points to: a function's start in a loaded object.
#[cfg(target_arch = "x86_64")]
fn bound_code(snap: &Snapshot, got: u64) -> Option<u64> {
    let mut word = [0u8; 8];
    if read_own_memory(got, &mut word) != 8 {
        return None;
    }
    let bound = u64::from_ne_bytes(word);
    // Lazily bound stubs point back into the PLT, at code that is no function's start.
    (snap.objects.iter().any(|o| o.executes(bound)) && function_start(snap, bound) == Some(bound))
        .then_some(bound)
}

/// Readable+writable mappings from /proc/self/maps, and the main `[stack]`.
pub(super) type Range64 = (u64, u64);

pub(super) fn read_rw_maps() -> (Vec<Range64>, Option<Range64>) {
    let mut out = Vec::new();
    let mut main = None;
    let Ok(text) = std::fs::read_to_string("/proc/self/maps") else {
        return (out, main);
    };
    for line in text.lines() {
        let mut parts = line.split_ascii_whitespace();
        let (Some(range), Some(perms)) = (parts.next(), parts.next()) else {
            continue;
        };
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else {
            continue;
        };
        let p = perms.as_bytes();
        if p.len() < 2 || p[0] != b'r' || p[1] != b'w' {
            continue;
        }
        if line.ends_with("[stack]") {
            main = Some((start, end));
        }
        out.push((start, end));
    }
    out.sort_unstable();
    (out, main)
}

/// What every walk reads first, in one cache line: a handler finds it cold, and one miss is
/// cheaper than three.
#[repr(C, align(64))]
pub(super) struct Hot {
    /// The published snapshot (SNAPSHOT in the comments).
    pub(super) snapshot: AtomicPtr<Snapshot>,
    /// Number of readers currently inside some snapshot (READERS in the comments).
    pub(super) readers: AtomicUsize,
    /// The unwinder cache pool, allocated once and never freed (POOL in the comments).
    pub(super) pool: AtomicPtr<Box<[PoolEntry]>>,
}

pub(super) static HOT: Hot = Hot {
    snapshot: AtomicPtr::new(ptr::null_mut()),
    readers: AtomicUsize::new(0),
    pool: AtomicPtr::new(ptr::null_mut()),
};
/// Snapshots replaced but possibly still read by a handler.
pub(super) static RETIRED: crate::forklock::Mutex<Vec<usize>> =
    crate::forklock::Mutex::new(Vec::new());
/// Set by readers that found no stack mapping for their `sp`: the maps need a refresh.
pub(super) static MAPS_STALE: AtomicBool = AtomicBool::new(false);
/// Snapshots built so far (for stats).
pub(super) static BUILDS: AtomicUsize = AtomicUsize::new(0);

/// Number of snapshots built in this process.
pub(crate) fn snapshot_builds() -> usize {
    BUILDS.load(Ordering::Relaxed)
}

/// Rebuilds and publishes the snapshot when the loaded objects changed, when `maps_changed`
/// (new threads, hence new stacks) or when a reader asked for it. Returns whether it rebuilt.
/// Never call from a signal handler.
pub(crate) fn refresh(maps_changed: bool) -> bool {
    // Writers are serialized by this lock; only they free snapshots, so `current` stays valid.
    let mut retired = RETIRED.lock();
    let current = HOT.snapshot.load(Ordering::SeqCst);
    let stale = MAPS_STALE.swap(false, Ordering::SeqCst);
    // SAFETY: see above: a published snapshot is freed only by a writer holding the lock.
    let gen_changed =
        current.is_null() || unsafe { (*current).objects_gen } != objects_generation();
    if !(gen_changed || maps_changed || stale) {
        reclaim(&mut retired, Duration::ZERO);
        return false;
    }
    // SAFETY: as above.
    let prev = (!current.is_null()).then(|| unsafe { &*current });
    let new = Box::into_raw(Box::new(Snapshot::build(prev)));
    BUILDS.fetch_add(1, Ordering::Relaxed);
    let old = HOT.snapshot.swap(new, Ordering::SeqCst);
    if !old.is_null() {
        retired.push(old as usize);
    }
    reclaim(&mut retired, Duration::from_millis(2));
    true
}

/// Test support: holds the retired snapshots' lock while `f` runs (see `fork::__hold_lock`).
pub(crate) fn hold_retired_lock(f: &mut dyn FnMut()) {
    let _held = RETIRED.lock();
    f();
}

/// Frees retired snapshots once no reader is inside any snapshot, waiting at most `wait`.
pub(super) fn reclaim(retired: &mut Vec<usize>, wait: Duration) {
    if retired.is_empty() {
        return;
    }
    let deadline = Instant::now() + wait;
    loop {
        if HOT.readers.load(Ordering::SeqCst) == 0 {
            for p in retired.drain(..) {
                // SAFETY: `p` came from Box::into_raw, was swapped out of SNAPSHOT before the
                // reader count was seen at zero, so no reader holds it and none can load it.
                drop(unsafe { Box::from_raw(p as *mut Snapshot) });
            }
            return;
        }
        if Instant::now() >= deadline {
            return;
        }
        std::thread::yield_now();
    }
}

/// In a forked child only the forking thread survives: readers that were inside a snapshot
/// are gone, and so are cache borrowers.
pub(crate) fn after_fork_in_child() {
    HOT.readers.store(0, Ordering::SeqCst);
    if RETIRED.is_locked() {
        // Held by a refresh of the parent's sampler, which did not survive the fork: the child's
        // sampler would wait for it forever. The list may be half-updated: it is forgotten (the
        // snapshots in it leak, once).
        // SAFETY: this is the child's only thread, so the holder is gone; nothing else touches
        // the list until the unlock below.
        unsafe {
            std::ptr::write(RETIRED.data_ptr(), Vec::new());
            crate::forklock::reset_in_child(&RETIRED);
        }
    }
    #[cfg(target_arch = "x86_64")]
    {
        let snap = HOT.snapshot.load(Ordering::SeqCst);
        if !snap.is_null() {
            // SAFETY: the only thread left is this one, and it is not inside a reader: nothing
            // can free the snapshot meanwhile.
            unsafe { &*snap }.rules.after_fork_in_child();
        }
    }
    let pool = HOT.pool.load(Ordering::SeqCst);
    if !pool.is_null() {
        // SAFETY: the pool is never freed once published.
        for e in unsafe { (*pool).iter() } {
            e.busy.store(false, Ordering::SeqCst);
        }
    }
}

/// Lets the fast path learn the rules for `addrs` (lookup addresses of a captured stack).
/// Best effort and cheap when everything is known; allocates otherwise, so never call it from
/// a signal handler.
pub(crate) fn learn(addrs: &[u64]) {
    #[cfg(target_arch = "x86_64")]
    {
        let _reader = ReaderGuard::enter();
        let snap = HOT.snapshot.load(Ordering::SeqCst);
        if !snap.is_null() {
            // SAFETY: a published snapshot stays alive while READERS counts us.
            unsafe { &*snap }.rules.learn(addrs);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = addrs;
}

/// Whether the snapshot wants a refresh: a reader found no stack mapping for its `sp`, or an
/// object was loaded or unloaded since it was built. The sampler asks every tick, so a
/// snapshot lags an unload by one refresh interval (20 ms), not the once-a-second check:
/// until then, code loaded into an unloaded object's range is unwound with the old object's
/// (copied) rules, which costs wrong frames, never a fault.
pub(crate) fn maps_stale() -> bool {
    if MAPS_STALE.load(Ordering::Relaxed) {
        return true;
    }
    let _reader = ReaderGuard::enter();
    let snap = HOT.snapshot.load(Ordering::SeqCst);
    // SAFETY: a published snapshot stays alive while READERS counts us.
    !snap.is_null() && unsafe { (*snap).objects_gen } != objects_generation()
}

pub(super) struct ReaderGuard;

impl ReaderGuard {
    pub(super) fn enter() -> ReaderGuard {
        HOT.readers.fetch_add(1, Ordering::SeqCst);
        ReaderGuard
    }
}

impl Drop for ReaderGuard {
    fn drop(&mut self) {
        HOT.readers.fetch_sub(1, Ordering::SeqCst);
    }
}
