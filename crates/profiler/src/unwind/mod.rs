//! Stack unwinding with DWARF CFI (`.eh_frame`), safe to run in a signal handler.
//!
//! Rust's std ships with frame pointers but user code is usually built without them, so a
//! frame-pointer walk loses the callers of every user function. This module unwinds with the
//! call frame information every Linux object carries in `.eh_frame` (indexed by
//! `.eh_frame_hdr`), using `framehop` under its "must not allocate during unwind" policy.
//!
//! What runs where:
//! * The sampler thread (never a handler) builds a [`Snapshot`]: the module list read from the
//!   dynamic loader plus the readable-writable mappings of `/proc/self/maps` (to bound stack
//!   reads). Unwind sections are used in place for the main program and the vDSO, which are
//!   never unloaded, and from private copies for every other object (made while the loader
//!   guarantees the object is mapped, see [`crate::modules`]): a snapshot that lags behind a
//!   `dlclose` never reads the unloaded object's memory, and an object later loaded into its
//!   range costs wrong or lost frames until the next snapshot, never a fault. It publishes the
//!   snapshot through an atomic pointer. An old snapshot is freed only once no reader is inside
//!   any snapshot (a global reader count observed at zero after the swap).
//! * [`unwind`] (signal handler or allocator) loads the snapshot, borrows a preallocated
//!   unwinder cache from a fixed pool with a compare-and-swap (no waiting: when all are busy
//!   the stack is cut to its leaf frame), and walks at most `out.len()` frames.
//! * Each pool entry also owns a spare stack: the handler and the allocation sampling path run
//!   their walk (and the allocation path its recording) on it ([`Spare::run`], x86_64), so a
//!   thread's own stack only carries a few hundred bytes of profiler frames. Before that they
//!   check the thread's headroom against what the path needs on the thread's stack, and skip
//!   the sample (counted) when it is short ([`headroom`], [`skipped_low_stack`]).
//! * Stack reads are bounded to `[sp, top of the stack mapping)`: the thread's own stack bounds
//!   when known (learned outside the handler), else the snapshot mapping that contains `sp`.
//!   Nothing outside that range is ever dereferenced, so a corrupt frame cannot fault.
//!
//! Supported: Linux x86_64 and aarch64 with glibc, code in objects listed by the dynamic loader.
//! Not supported: JIT code without registered unwind info (the frame-pointer fallback applies),
//! stacks of threads switched by user-space coroutines beyond the current stack.

#[cfg(target_arch = "x86_64")]
pub(crate) mod rules;

use std::cell::UnsafeCell;
use std::ops::Deref;
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use framehop::{
    CacheNative, ExplicitModuleSectionInfo, FrameAddress, Module, MustNotAllocateDuringUnwind,
    Unwinder, UnwinderNative,
};

use crate::modules::{loaded_objects_for_unwind, objects_generation, LoadedObject};
#[cfg(target_arch = "x86_64")]
use rules::{RuleModule, RuleTable, Step};

/// Most frames one stack keeps. Deep recursion (parsers, tree walks, async state machines
/// polled through many layers) runs to hundreds of frames; peers keep 512 to 2,048. 1,024 costs
/// 8 KiB per buffer: the allocation path's buffer lives on a spare stack, and a CPU capture
/// slot keeps the first frames densely and the rest in lazily backed memory, so shallow stacks
/// cost what they did. A deeper stack keeps its leaf and root ends around a marker frame,
/// `[truncated: N+ frames]`.
pub const MAX_FRAMES: usize = 1024;

/// A stack cut for length keeps this share (1/N) of its buffer for the outermost frames: a
/// thread's entry and its runtime's frames (tens), with room to spare, and three quarters for
/// the leaf end, where the time is spent.
const ROOT_SHARE: usize = 4;

/// Frames a walk may step through per frame of its buffer: past a full buffer it goes on, this
/// far, to find the stack's root end. Bounds a handler's time on a runaway recursion; a stack
/// deeper than that ends in the marker.
const STEPS_PER_FRAME: usize = 4;

/// Marks the cut of a stack cut for length: a reserved address, never code on x86_64 nor
/// aarch64 (non-canonical; above any user-space address), whose low six bits hold
/// log2 of the number of frames left out. The symbolizer names it (see [`truncation_name`]):
/// every viewer shows the cut as a frame of its own.
const TRUNCATED_MARKER: u64 = 0x7fff_ffff_ffff_ff00;

/// The marker for a cut that left out `dropped` frames (at least). Powers of two: stacks that
/// differ only a little in depth still merge in a flame graph.
fn truncation_marker(dropped: usize) -> u64 {
    TRUNCATED_MARKER | u64::from(usize::BITS - 1 - dropped.max(1).leading_zeros())
}

/// Whether `addr` is a truncation marker rather than a code address.
pub(crate) fn is_truncation_marker(addr: u64) -> bool {
    addr & !0x3f == TRUNCATED_MARKER
}

/// The function name of a truncation marker: `[truncated: 256+ frames]`.
pub(crate) fn truncation_name(addr: u64) -> Option<String> {
    is_truncation_marker(addr).then(|| format!("[truncated: {}+ frames]", 1u64 << (addr & 0x3f)))
}

/// Where a walk writes a stack: one slice, or two used back to back (a CPU capture slot keeps
/// the first frames of every stack densely and the rest of deep ones apart).
pub(crate) struct FrameBuf<'a> {
    head: &'a mut [u64],
    tail: &'a mut [u64],
}

impl<'a> FrameBuf<'a> {
    pub(crate) fn new(head: &'a mut [u64], tail: &'a mut [u64]) -> Self {
        FrameBuf { head, tail }
    }

    fn len(&self) -> usize {
        self.head.len() + self.tail.len()
    }

    #[inline]
    fn get(&self, i: usize) -> u64 {
        match i.checked_sub(self.head.len()) {
            None => self.head[i],
            Some(j) => self.tail[j],
        }
    }

    #[inline]
    fn set(&mut self, i: usize, v: u64) {
        match i.checked_sub(self.head.len()) {
            None => self.head[i] = v,
            Some(j) => self.tail[j] = v,
        }
    }

    /// Appends the first `n` frames (at most all) to `to`; how many.
    pub(crate) fn copy_to(&self, n: usize, to: &mut Vec<u64>) -> usize {
        let n = n.min(self.len());
        let h = n.min(self.head.len());
        to.extend_from_slice(&self.head[..h]);
        to.extend_from_slice(&self.tail[..n - h]);
        n
    }

    fn reverse(&mut self, mut a: usize, mut b: usize) {
        while a + 1 < b {
            b -= 1;
            let (x, y) = (self.get(a), self.get(b));
            self.set(a, y);
            self.set(b, x);
            a += 1;
        }
    }

    /// Rotates `[a, b)` left by `k`, in place (three reversals: no allocation).
    fn rotate_left(&mut self, a: usize, b: usize, k: usize) {
        if k == 0 || k >= b - a {
            return;
        }
        self.reverse(a, a + k);
        self.reverse(a + k, b);
        self.reverse(a, b);
    }
}

impl<'a> From<&'a mut [u64]> for FrameBuf<'a> {
    fn from(head: &'a mut [u64]) -> Self {
        FrameBuf {
            head,
            tail: Default::default(),
        }
    }
}

/// A walk's frames going into a [`FrameBuf`], innermost first. Until the buffer is full they
/// are written in order; past it the walk goes on and the frames beyond the leaf part (the
/// buffer less its root share and one slot) go round a ring over the rest, so that when the
/// walk ends the ring holds the outermost frames. [`Sink::finish`] puts them in order and the
/// marker at the cut: leaf frames, marker, root frames. A flame graph of a deep recursion then
/// still grows from the thread's entry, and shows where frames are missing.
struct Sink<'b, 'a> {
    buf: &'b mut FrameBuf<'a>,
    /// Where the stack pointer stood in each frame, for the first frames (a walk that wants
    /// them: see [`unwind_copied`]); unused past its length.
    sps: &'b mut [u64],
    /// Frames pushed so far (the stack's depth, once the walk ended).
    seen: usize,
    /// Steps the walk may still take.
    steps: usize,
}

impl<'b, 'a> Sink<'b, 'a> {
    fn new(buf: &'b mut FrameBuf<'a>) -> Self {
        let steps = buf.len() * STEPS_PER_FRAME + 64;
        Sink {
            buf,
            sps: &mut [],
            seen: 0,
            steps,
        }
    }

    /// Also records each frame's stack pointer into `sps`, for as many frames as it holds.
    fn with_sps(mut self, sps: &'b mut [u64]) -> Self {
        self.sps = sps;
        self
    }

    /// Where the marker goes in a cut stack: the leaf part lies before it, the ring from it on.
    /// Only for buffers of two frames or more.
    fn cut(&self) -> usize {
        let len = self.buf.len();
        len - len / ROOT_SHARE - 1
    }

    /// Whether another frame has somewhere to go (a buffer too small for a marker keeps the
    /// leaf end only, and the walk stops when it is full).
    fn wants_more(&self) -> bool {
        self.seen < self.buf.len() || self.buf.len() >= 2
    }

    /// Takes one step of the budget; false when it is spent.
    fn step(&mut self) -> bool {
        self.steps = self.steps.saturating_sub(1);
        self.steps > 0
    }

    /// Pushes a frame, and where the stack pointer stood in it.
    fn push_at(&mut self, addr: u64, sp: u64) {
        if let Some(s) = self.sps.get_mut(self.seen) {
            *s = sp;
        }
        self.push(addr);
    }

    fn push(&mut self, addr: u64) {
        let len = self.buf.len();
        let i = self.seen;
        self.seen += 1;
        let at = if i < len {
            i
        } else if len >= 2 {
            let cut = self.cut();
            cut + (i - cut) % (len - cut)
        } else {
            return;
        };
        self.buf.set(at, addr);
    }

    /// Takes back the last frame pushed (the walk will write it again).
    fn pop(&mut self) {
        self.seen = self.seen.saturating_sub(1);
    }

    /// Puts the frames in their final order and returns how many the buffer holds. `ended`:
    /// the walk reached the stack's end (or a frame it could not unwind), rather than running
    /// out of steps or of readable stack with more above.
    fn finish(self, ended: bool) -> usize {
        let len = self.buf.len();
        let seen = self.seen;
        if (ended && seen <= len) || len < 2 {
            return seen.min(len);
        }
        let cut = self.cut();
        if ended {
            // The ring holds the last `len - cut` frames, the oldest where the next would go.
            let oldest = (seen - cut) % (len - cut);
            self.buf.rotate_left(cut, len, oldest);
            self.buf.set(cut, truncation_marker(seen - (len - 1)));
            return len;
        }
        // Cut short of the end: the root end is unknown, and the marker is outermost (the
        // ring's frames from the middle of the stack would pose as its root).
        let keep = if seen <= len { seen.min(len - 1) } else { cut };
        self.buf.set(keep, truncation_marker(seen - keep));
        keep + 1
    }
}

/// Bytes of a module's unwind sections: in place in the module (main program, vDSO) or in a
/// private copy kept alive by the snapshot or rule table that uses it.
#[derive(Clone, Copy)]
pub(crate) struct MemSlice {
    ptr: *const u8,
    len: usize,
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

type NativeUnwinder = UnwinderNative<MemSlice, MustNotAllocateDuringUnwind>;
type NativeCache = CacheNative<MustNotAllocateDuringUnwind>;

/// Registers an unwind starts from.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct StartRegs {
    pub pc: u64,
    pub sp: u64,
    /// Frame pointer (rbp / x29).
    pub fp: u64,
    /// Link register (aarch64 only).
    #[allow(dead_code)]
    pub lr: u64,
}

/// An immutable view of the process for handlers to unwind with.
pub(crate) struct Snapshot {
    unwinder: NativeUnwinder,
    /// Sorted, non-overlapping readable+writable mappings: candidate stacks.
    rw_maps: Vec<(u64, u64)>,
    /// The main thread's `[stack]` mapping, which grows down past its recorded start.
    main_stack: Option<(u64, u64)>,
    /// Lowest address the main stack may grow to (its top minus the stack size limit).
    main_stack_floor: u64,
    objects_gen: (u64, u64),
    /// The objects (their unwind section copies are what `unwinder` and `rules` read).
    objects: Vec<LoadedObject>,
    /// Compact rules for the fast path, shared by the snapshots of one set of loaded objects.
    #[cfg(target_arch = "x86_64")]
    rules: Arc<RuleTable>,
    /// `rules`' entries, one pointer away for the handler.
    #[cfg(target_arch = "x86_64")]
    rule_entries: rules::Entries,
    #[cfg(target_arch = "aarch64")]
    ptr_auth_mask: framehop::aarch64::PtrAuthMask,
}

impl Snapshot {
    /// `prev`: the snapshot being replaced, whose learned rules carry over when the loaded
    /// objects did not change.
    fn build(prev: Option<&Snapshot>) -> Snapshot {
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
    fn stack_of(&self, sp: u64) -> Option<(u64, u64)> {
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
    fn stack_floor_of(&self, sp: u64) -> Option<u64> {
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
const MAIN_STACK_GROWTH: u64 = 8 << 20;

/// The main thread's stack size limit (`RLIMIT_STACK`), or [`MAIN_STACK_GROWTH`] when unlimited.
fn stack_limit() -> u64 {
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
struct Sections {
    start: u64,
    end: u64,
    base: u64,
    hdr: MemSlice,
    hdr_addr: u64,
    eh_frame: MemSlice,
    eh_frame_addr: u64,
    /// The executable segment, relative to the object's base.
    text: Option<std::ops::Range<u64>>,
}

impl Sections {
    fn of(obj: &LoadedObject) -> Option<Sections> {
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

    fn module(&self, obj: &LoadedObject) -> Module<MemSlice> {
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
    fn rule_module(&self) -> RuleModule {
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
fn never_unloaded(obj: &LoadedObject) -> bool {
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
fn function_start(snap: &Snapshot, addr: u64) -> Option<u64> {
    let obj = snap.objects.iter().find(|o| o.executes(addr))?;
    let sections = Sections::of(obj)?;
    hdr_function_start(&sections.hdr, sections.hdr_addr, addr)
}

/// Where the call instruction just before `ret` goes, when it is a direct call (`call rel32`),
/// followed through a bound PLT stub (`jmp *GOT`); None for an indirect call, an unbound stub
/// or unreadable code.
#[cfg(target_arch = "x86_64")]
fn direct_call_target(snap: &Snapshot, ret: u64) -> Option<u64> {
    let mut call = [0u8; 5];
    if read_own_memory(ret.checked_sub(5)?, &mut call) != 5 || call[0] != 0xe8 {
        return None;
    }
    let rel = i32::from_le_bytes(call[1..5].try_into().ok()?);
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
    let got = (target + at as u64 + 6).wrapping_add_signed(i64::from(disp));
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
type Range64 = (u64, u64);

fn read_rw_maps() -> (Vec<Range64>, Option<Range64>) {
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
struct Hot {
    /// The published snapshot (SNAPSHOT in the comments).
    snapshot: AtomicPtr<Snapshot>,
    /// Number of readers currently inside some snapshot (READERS in the comments).
    readers: AtomicUsize,
    /// The unwinder cache pool, allocated once and never freed (POOL in the comments).
    pool: AtomicPtr<Box<[PoolEntry]>>,
}

static HOT: Hot = Hot {
    snapshot: AtomicPtr::new(ptr::null_mut()),
    readers: AtomicUsize::new(0),
    pool: AtomicPtr::new(ptr::null_mut()),
};
/// Snapshots replaced but possibly still read by a handler.
static RETIRED: crate::forklock::Mutex<Vec<usize>> = crate::forklock::Mutex::new(Vec::new());
/// Set by readers that found no stack mapping for their `sp`: the maps need a refresh.
static MAPS_STALE: AtomicBool = AtomicBool::new(false);
/// Snapshots built so far (for stats).
static BUILDS: AtomicUsize = AtomicUsize::new(0);

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
fn reclaim(retired: &mut Vec<usize>, wait: Duration) {
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

struct PoolEntry {
    busy: AtomicBool,
    cache: UnsafeCell<NativeCache>,
    /// Top (16-byte aligned) of this entry's spare stack; 0 when it could not be mapped.
    stack_top: usize,
}

// SAFETY: `cache` and the spare stack are only used by the holder of `busy`, acquired with a
// compare-and-swap.
unsafe impl Sync for PoolEntry {}

/// Size of each spare stack. Only the pages a walk touches are ever backed (a release walk and
/// recording use a few KiB; debug builds several times more), so the reserve is generous.
const SPARE_STACK_BYTES: usize = 256 << 10;

/// Stack words read through the kernel (`process_vm_readv`), a small aligned window at a time:
/// a walk reads upward through a few frames, so one call serves several reads.
/// Async-signal-safe.
struct CheckedWindow {
    start: u64,
    len: usize,
    bytes: [u8; CheckedWindow::SIZE],
}

impl CheckedWindow {
    const SIZE: usize = 256;

    fn new() -> Self {
        CheckedWindow {
            start: 0,
            len: 0,
            bytes: [0; Self::SIZE],
        }
    }

    /// The word at `addr` (readable up to `hi`), or Err when the kernel cannot read it.
    fn read(&mut self, addr: u64, hi: u64) -> Result<u64, ()> {
        let inside = |w: &Self| addr >= w.start && addr + 8 <= w.start + w.len as u64;
        if !inside(self) {
            let start = addr & !7;
            let mut len = Self::SIZE.min((hi - start) as usize);
            // Never across a page boundary past the one `addr` needs: the next page may be
            // the one that is missing, and a failed read would lose this one too.
            let page_end = (addr + 8 + 4095) & !4095;
            len = len.min((page_end - start) as usize);
            let n = read_own_memory(start, &mut self.bytes[..len]);
            self.start = start;
            self.len = n;
            if !inside(self) {
                return Err(());
            }
        }
        let at = (addr - self.start) as usize;
        let mut w = [0u8; 8];
        w.copy_from_slice(&self.bytes[at..at + 8]);
        Ok(u64::from_ne_bytes(w))
    }
}

/// The spare stack of `pool` holding `sp`, as the range (sp, top). Async-signal-safe.
fn spare_stack_of(pool: &[PoolEntry], sp: u64) -> Option<(u64, u64)> {
    pool.iter().find_map(|e| {
        let top = e.stack_top as u64;
        (top != 0 && sp < top && sp >= top - SPARE_STACK_BYTES as u64).then_some((sp, top))
    })
}

/// Maps one spare stack with a guard page below it; its top, or 0 on failure.
fn map_spare_stack() -> usize {
    // SAFETY: sysconf has no preconditions.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) })
        .ok()
        .filter(|&p| p > 0)
        .unwrap_or(4096);
    let len = SPARE_STACK_BYTES + page;
    // SAFETY: a fresh anonymous private mapping; nothing else refers to it.
    let p = unsafe {
        libc::mmap(
            ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_STACK,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return 0;
    }
    // SAFETY: the first page of the mapping we own: an overflow faults there instead of
    // writing into whatever lies below.
    if unsafe { libc::mprotect(p, page, libc::PROT_NONE) } != 0 {
        // SAFETY: our own mapping, unused.
        unsafe { libc::munmap(p, len) };
        return 0;
    }
    (p as usize + len) & !15
}

/// Allocates the unwinder cache pool once (never freed: handlers may hold an entry at any time).
pub(crate) fn init_pool() {
    if !HOT.pool.load(Ordering::SeqCst).is_null() {
        return;
    }
    let n = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .clamp(1, 16)
        * 2
        + 2;
    let entries: Box<[PoolEntry]> = (0..n)
        .map(|_| PoolEntry {
            busy: AtomicBool::new(false),
            cache: UnsafeCell::new(NativeCache::new_in()),
            stack_top: map_spare_stack(),
        })
        .collect();
    let raw = Box::into_raw(Box::new(entries));
    if HOT
        .pool
        .compare_exchange(ptr::null_mut(), raw, Ordering::SeqCst, Ordering::SeqCst)
        .is_err()
    {
        // SAFETY: we lost the race; `raw` was never published.
        // Its spare stacks stay mapped (a few hundred KiB of address space, never touched):
        // this race happens at most once per process.
        drop(unsafe { Box::from_raw(raw) });
    }
}

/// Whether [`Spare::run`] switches stacks here (elsewhere it runs in place, and the paths need
/// the in-place room).
const SWITCHES_STACKS: bool = cfg!(target_arch = "x86_64");

/// Stack a path that switches to a spare stack may still use on the thread's own stack after
/// its headroom check (measured by `tests/small_stack.rs` for both paths, with room to spare).
const SWITCHED_STACK_NEED: u64 = if !SWITCHES_STACKS {
    IN_PLACE_STACK_NEED
} else if cfg!(debug_assertions) {
    2048
} else {
    512
};
/// Stack a signal handler may still use on the thread's stack after its headroom check, when
/// its walk runs on a spare stack (the rest of `handle`, `Spare::run`).
pub(crate) const HANDLER_STACK_NEED: u64 = SWITCHED_STACK_NEED;
/// Stack a sampled allocation may still use on the thread's stack after its headroom check,
/// when it walks and records on a spare stack.
pub(crate) const ALLOC_STACK_NEED: u64 = SWITCHED_STACK_NEED;
/// Stack a walk (framehop's CFI evaluation) and recording use when they run on the thread's
/// own stack: no spare stack free, or no stack switch on this architecture.
pub(crate) const IN_PLACE_STACK_NEED: u64 = 96 << 10;

/// Samples skipped because the thread's stack had less headroom than the path needs.
static SKIPPED_LOW_STACK: AtomicU64 = AtomicU64::new(0);
/// Signal samples skipped because the thread's stack bounds were not known yet (a thread
/// newer than the snapshot that never made a sampled allocation).
static SKIPPED_UNKNOWN_STACK: AtomicU64 = AtomicU64::new(0);

/// Counts a sample skipped for lack of stack. Async-signal-safe.
pub(crate) fn count_skipped_low_stack() {
    SKIPPED_LOW_STACK.fetch_add(1, Ordering::Relaxed);
}

/// Counts a sample skipped for unknown stack bounds. Async-signal-safe.
pub(crate) fn count_skipped_unknown_stack() {
    SKIPPED_UNKNOWN_STACK.fetch_add(1, Ordering::Relaxed);
}

/// Samples skipped for lack of stack in this process so far.
pub(crate) fn skipped_low_stack() -> u64 {
    SKIPPED_LOW_STACK.load(Ordering::Relaxed)
}

/// Samples skipped for unknown stack bounds in this process so far.
pub(crate) fn skipped_unknown_stack() -> u64 {
    SKIPPED_UNKNOWN_STACK.load(Ordering::Relaxed)
}

/// Bytes of stack left below `sp` (the caller's stack pointer), from `bounds` (the thread's
/// stack, when known and containing `sp`) or else the snapshot's mapping containing `sp`;
/// None when neither knows (a stack newer than the snapshot: a refresh is requested).
/// Async-signal-safe.
pub(crate) fn headroom(sp: u64, bounds: Option<(usize, usize)>) -> Option<u64> {
    if let Some((lo, hi)) = bounds {
        if lo as u64 <= sp && sp < hi as u64 {
            return Some(sp - lo as u64);
        }
    }
    let _reader = ReaderGuard::enter();
    let snap = HOT.snapshot.load(Ordering::SeqCst);
    if snap.is_null() {
        return None;
    }
    // SAFETY: a published snapshot stays alive while READERS counts us.
    let floor = unsafe { &*snap }.stack_floor_of(sp);
    if floor.is_none() {
        MAPS_STALE.store(true, Ordering::Relaxed);
    }
    floor.map(|f| sp.saturating_sub(f))
}

/// For a stack whose bounds nobody knows yet (a thread newer than the snapshot): `need` when
/// the `need` bytes below `sp` are readable, 0 when they are not, None when the kernel would
/// not say. Asks the kernel to read the lowest word of the range (`process_vm_readv` on our
/// own process fails with EFAULT instead of faulting); a guard page, at least a page below any
/// stack, cannot hide between it and `sp` when `need` is under a page. Async-signal-safe.
pub(crate) fn probe_room(sp: u64, need: u64) -> Option<u64> {
    if need >= 4096 {
        return None;
    }
    let Some(addr) = sp.checked_sub(need) else {
        return Some(0);
    };
    if read_own_memory(addr, &mut [0u8; 8]) == 8 {
        return Some(need);
    }
    // SAFETY: errno is thread-local (the handler restores it).
    match unsafe { *libc::__errno_location() } {
        libc::EFAULT => Some(0),
        _ => None,
    }
}

/// A pool entry held by the caller: an unwinder cache and a spare stack to run on.
pub(crate) struct Spare {
    entry: &'static PoolEntry,
}

impl Spare {
    /// Takes a free entry that has a spare stack, without waiting. Async-signal-safe.
    pub(crate) fn borrow() -> Option<Spare> {
        let pool = HOT.pool.load(Ordering::SeqCst);
        if pool.is_null() {
            return None;
        }
        // SAFETY: the pool is never freed once published.
        let pool: &'static [PoolEntry] = unsafe { &*pool };
        pool.iter()
            .find(|e| {
                e.stack_top != 0
                    && e.busy
                        .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                        .is_ok()
            })
            .map(|entry| Spare { entry })
    }

    fn cache(&mut self) -> &mut NativeCache {
        // SAFETY: we hold the entry's `busy` flag until drop; `&mut self` makes the borrow
        // exclusive within this holder.
        unsafe { &mut *self.entry.cache.get() }
    }

    /// Runs `f` on this entry's spare stack (x86_64; in place elsewhere), so that what `f`
    /// needs never comes out of the calling thread's stack. Async-signal-safe (a stack switch
    /// and a call). `f` must not unwind (a panic in it aborts).
    #[inline(never)]
    pub(crate) fn run<R, F: FnOnce(&mut Spare) -> R>(&mut self, f: F) -> Option<R> {
        #[cfg(target_arch = "x86_64")]
        {
            struct Job<'a, F, R> {
                f: Option<F>,
                out: Option<R>,
                spare: &'a mut Spare,
            }
            unsafe extern "C" fn trampoline<F: FnOnce(&mut Spare) -> R, R>(job: *mut u8) {
                // SAFETY: `job` is the live `Job` that `run` passed, used by nothing else
                // until this returns.
                let job = unsafe { &mut *(job as *mut Job<'_, F, R>) };
                if let Some(f) = job.f.take() {
                    job.out = Some(f(job.spare));
                }
            }
            let top = self.entry.stack_top;
            let mut job = Job {
                f: Some(f),
                out: None,
                spare: self,
            };
            // SAFETY: `top` is the 16-byte aligned top of a mapped stack that only the holder
            // of this entry uses (we do, through `&mut self`). The call pushes its return
            // address there (so the callee starts 8 below a 16-byte boundary, as the ABI
            // wants); r12 is callee-saved, so it still holds our stack pointer on return;
            // `clobber_abi("C")` covers everything the callee may change.
            unsafe {
                std::arch::asm!(
                    "mov r12, rsp",
                    "mov rsp, {top}",
                    "call {f}",
                    "mov rsp, r12",
                    top = in(reg) top,
                    f = in(reg) trampoline::<F, R> as unsafe extern "C" fn(*mut u8),
                    in("rdi") &mut job as *mut Job<'_, F, R> as *mut u8,
                    out("r12") _,
                    clobber_abi("C"),
                );
            }
            job.out
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            Some(f(self))
        }
    }
}

impl Drop for Spare {
    fn drop(&mut self) {
        self.entry.busy.store(false, Ordering::Release);
    }
}

/// Unwinds from `regs` into `out` (innermost first), returning the number of frames written.
/// Entries are the instruction pointer, then return addresses minus one (the call instruction),
/// ready for symbolization; a stack deeper than `out` is cut in the middle, at a truncation
/// marker (see [`Sink`]). `bounds` are the caller's stack bounds when known. Frames whose
/// stack pointer is below `skip_to_sp` are left out (the profiler's own frames on an allocation
/// stack, deeper than the function the allocator entry is inlined into; 0 keeps everything).
///
/// Async-signal-safe: no allocation, no lock, no waiting; memory reads stay within the stack
/// mapping containing `regs.sp`.
///
/// `stale`: how many entries of `out` still hold an earlier stack of the same thread (a
/// reused capture slot). Their rules are prefetched before the walk: a thread's stacks repeat
/// from one sample to the next, and a handler would otherwise meet each rule's cache miss
/// only when its frame comes up, one after the other.
pub(crate) fn unwind(
    regs: StartRegs,
    bounds: Option<(usize, usize)>,
    skip_to_sp: u64,
    out: &mut [u64],
    stale: usize,
) -> usize {
    unwind_counted(regs, bounds, skip_to_sp, &mut out.into(), true, stale, None).0
}

/// [`unwind`] into a [`FrameBuf`], with the unwinder cache of `spare` when given (normally
/// called on its stack, inside [`Spare::run`]).
pub(crate) fn unwind_into(
    spare: Option<&mut Spare>,
    regs: StartRegs,
    bounds: Option<(usize, usize)>,
    skip_to_sp: u64,
    out: &mut FrameBuf<'_>,
    stale: usize,
) -> usize {
    let cache = spare.map(|s| s.cache());
    unwind_counted(regs, bounds, skip_to_sp, out, true, stale, cache).0
}

/// [`unwind`] with the unwinder cache of `spare` (normally called on its stack, inside
/// [`Spare::run`]).
pub(crate) fn unwind_with(
    spare: &mut Spare,
    regs: StartRegs,
    bounds: Option<(usize, usize)>,
    skip_to_sp: u64,
    out: &mut [u64],
    stale: usize,
) -> usize {
    unwind_into(
        Some(spare),
        regs,
        bounds,
        skip_to_sp,
        &mut out.into(),
        stale,
    )
}

/// [`unwind`], also returning how many frames the compact rules handled; `fast` off
/// leaves every frame to framehop (tests compare the two). `own_cache`: a cache the caller
/// holds; without one, a pool entry is borrowed the first time a frame needs framehop.
fn unwind_counted(
    regs: StartRegs,
    bounds: Option<(usize, usize)>,
    skip_to_sp: u64,
    out: &mut FrameBuf<'_>,
    fast: bool,
    stale: usize,
    own_cache: Option<&mut NativeCache>,
) -> (usize, usize) {
    if out.len() == 0 {
        return (0, 0);
    }
    out.set(0, regs.pc);
    let sp = regs.sp;
    // Everything below is cold in a handler: start the stack's misses now, in parallel.
    let known = bounds.filter(|&(lo, hi)| (lo as u64) <= sp && sp < hi as u64);
    if let Some((_, hi)) = known {
        prefetch_stack(sp, hi as u64);
    }
    let _reader = ReaderGuard::enter();
    let snap = HOT.snapshot.load(Ordering::SeqCst);
    let pool = HOT.pool.load(Ordering::SeqCst);
    if snap.is_null() || pool.is_null() {
        return (1, 0);
    }
    // SAFETY: a published snapshot stays alive while READERS counts us (see `reclaim`); the
    // pool is never freed.
    let (snap, pool) = unsafe { (&*snap, &*pool) };
    #[cfg(target_arch = "x86_64")]
    if fast {
        rules::prefetch(&snap.rule_entries, regs.pc);
        // The first 128 at most: more would evict each other.
        for i in 1..stale.min(out.len()).min(128) {
            rules::prefetch(&snap.rule_entries, out.get(i));
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = stale;
    let range = match known {
        Some((_, hi)) => Some((sp, hi as u64)),
        // Interrupted while on one of our spare stacks (a sampled allocation's recording):
        // that stack alone, whatever the snapshot says of the memory around it (the fallback
        // below would read from the spare stack up to the thread's TLS, across other
        // mappings and their guard pages).
        None => spare_stack_of(pool, sp).or_else(|| {
            snap.stack_of(sp).or_else(|| {
                // A stack newer than the snapshot: ask for a refresh, use the fallback
                // meanwhile.
                MAPS_STALE.store(true, Ordering::Relaxed);
                thread_pointer_bound(sp)
            })
        }),
    };
    let Some((lo, hi)) = range else {
        MAPS_STALE.store(true, Ordering::Relaxed);
        return (1, 0);
    };
    // Bounds that are not the thread's own (a snapshot's mapping, which may have changed
    // since; the span up to the thread pointer) may hold a hole or a guard page: those reads
    // go through the kernel, which fails them instead of faulting.
    let mut window = CheckedWindow::new();
    let read_stack = |addr: u64| -> Result<u64, ()> {
        if addr < lo || addr.checked_add(8).is_none_or(|e| e > hi) {
            return Err(());
        }
        if known.is_none() {
            return window.read(addr, hi);
        }
        // SAFETY: [addr, addr+8) lies within this thread's own stack, below sp's frame.
        Ok(unsafe { ptr::read_volatile(addr as *const u64) })
    };
    let mut sink = Sink::new(out);
    let walked = walk(
        snap,
        pool,
        regs,
        FrameAddress::from_instruction_pointer(regs.pc),
        skip_to_sp,
        &mut sink,
        fast,
        own_cache,
        read_stack,
    );
    (sink.finish(!walked.out_of_steps), walked.fast_frames)
}

/// Where a walk stopped on a frame it could not unwind: the frame, and the stack and frame
/// pointers it had for it.
#[derive(Clone, Copy)]
struct Stuck {
    frame: FrameAddress,
    sp: u64,
    fp: u64,
    /// framehop said "end of stack" (a frame-pointer frame with a zero frame pointer says so
    /// too), rather than failing.
    ended: bool,
}

/// How a [`walk`] went.
struct Walked {
    /// Frames the compact rules handled.
    fast_frames: usize,
    /// Where it got stuck, if a frame could not be unwound.
    stuck: Option<Stuck>,
    /// It stopped for its step budget, with more stack to go.
    out_of_steps: bool,
}

/// Walks the stack from `regs` (its first frame `start`) with the snapshot's rules and framehop,
/// reading stack words through `read_stack`, into `sink`.
#[allow(clippy::too_many_arguments)]
fn walk(
    snap: &Snapshot,
    pool: &[PoolEntry],
    regs: StartRegs,
    start: FrameAddress,
    skip_to_sp: u64,
    sink: &mut Sink<'_, '_>,
    fast: bool,
    mut own_cache: Option<&mut NativeCache>,
    mut read_stack: impl FnMut(u64) -> Result<u64, ()>,
) -> Walked {
    #[cfg(target_arch = "x86_64")]
    let uregs = framehop::x86_64::UnwindRegsX86_64::new(regs.pc, regs.sp, regs.fp);
    #[cfg(target_arch = "aarch64")]
    let uregs = framehop::aarch64::UnwindRegsAarch64::new_with_ptr_auth_mask(
        snap.ptr_auth_mask,
        regs.lr,
        regs.sp,
        regs.fp,
    );
    #[cfg(not(target_arch = "x86_64"))]
    let _ = fast;
    let mut uregs = uregs;
    let mut fast_frames = 0;
    // A framehop cache, borrowed from the pool the first time a frame needs framehop.
    let mut entry: Option<&PoolEntry> = None;
    let mut frame = start;
    let mut stuck = None;
    let mut out_of_steps = false;
    let first = sink.seen;
    // Bounded by the sink's step budget (skipped frames count too).
    while sink.wants_more() {
        if !sink.step() {
            out_of_steps = true;
            break;
        }
        let lookup = frame.address_for_lookup();
        if uregs.sp() >= skip_to_sp {
            sink.push_at(lookup, uregs.sp());
        }
        #[cfg(target_arch = "x86_64")]
        if fast {
            if let Some(rule) = rules::rule(&snap.rule_entries, lookup) {
                match rules::step(rule, &mut uregs, &mut read_stack) {
                    Step::Next(ret) => {
                        fast_frames += 1;
                        match FrameAddress::from_return_address(ret) {
                            Some(f) => frame = f,
                            None => break,
                        }
                        continue;
                    }
                    Step::End => {
                        fast_frames += 1;
                        break;
                    }
                    Step::Fallback => {}
                }
            }
        }
        let cache: &mut NativeCache = match own_cache.as_deref_mut() {
            Some(c) => c,
            None => {
                let e = match entry {
                    Some(e) => e,
                    None => {
                        let Some(e) = pool.iter().find(|e| {
                            e.busy
                                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                                .is_ok()
                        }) else {
                            // Every cache is busy: the stack ends here.
                            break;
                        };
                        entry = Some(e);
                        e
                    }
                };
                // SAFETY: we own `e` (its `busy` flag) until it is released below.
                unsafe { &mut *e.cache.get() }
            }
        };
        match snap
            .unwinder
            .unwind_frame(frame, &mut uregs, cache, &mut read_stack)
        {
            Ok(Some(ret)) => match FrameAddress::from_return_address(ret) {
                Some(f) => frame = f,
                None => break,
            },
            result => {
                stuck = Some(Stuck {
                    frame,
                    sp: uregs.sp(),
                    #[cfg(target_arch = "x86_64")]
                    fp: uregs.bp(),
                    #[cfg(not(target_arch = "x86_64"))]
                    fp: uregs.fp(),
                    ended: result.is_ok(),
                });
                break;
            }
        }
    }
    if let Some(e) = entry {
        e.busy.store(false, Ordering::Release);
    }
    if sink.seen == first {
        sink.push_at(regs.pc, regs.sp);
    }
    Walked {
        fast_frames,
        stuck,
        out_of_steps,
    }
}

/// A framehop cache owned by a walker that is not a signal handler (see [`unwind_copied`]).
pub(crate) struct OwnCache(Box<NativeCache>);

impl OwnCache {
    pub(crate) fn new() -> OwnCache {
        OwnCache(Box::new(NativeCache::new_in()))
    }
}

/// Unwinds another thread of this process from its program counter and stack pointer, over
/// `stack`: a copy of its stack from `sp` up (the sampler thread, for a thread blocked in the
/// kernel). Its frame pointer is unknown: a frame whose rule needs it ends the walk. Reads
/// nothing of the other thread's memory; frames into `out`, their number returned.
/// `more_above`: the copy stops short of the stack's top, so a walk that runs off it was cut
/// (it ends in a truncation marker, as one deeper than `out` does). `sps` receives where the
/// stack pointer stood in each frame, for as many frames as it holds.
pub(crate) fn unwind_copied(
    pc: u64,
    sp: u64,
    stack: &[u8],
    more_above: bool,
    cache: &mut OwnCache,
    out: &mut [u64],
    sps: &mut [u64],
) -> usize {
    if out.is_empty() {
        return 0;
    }
    let _reader = ReaderGuard::enter();
    let snap = HOT.snapshot.load(Ordering::SeqCst);
    let pool = HOT.pool.load(Ordering::SeqCst);
    if snap.is_null() || pool.is_null() {
        out[0] = pc;
        return 1;
    }
    // SAFETY: as in `unwind_counted`.
    let (snap, pool) = unsafe { (&*snap, &*pool) };
    let end = sp.saturating_add(stack.len() as u64);
    let read = |addr: u64| -> Result<u64, ()> {
        if addr < sp || addr.checked_add(8).is_none_or(|e| e > end) {
            return Err(());
        }
        let off = (addr - sp) as usize;
        let word: [u8; 8] = stack[off..off + 8].try_into().map_err(|_| ())?;
        Ok(u64::from_ne_bytes(word))
    };
    // A walk that wanted a word past the copy, of a stack that goes on above it, stopped for
    // want of stack rather than at the stack's end.
    let past_end = std::cell::Cell::new(false);
    let walk_read = |addr: u64| {
        let r = read(addr);
        if r.is_err() && addr >= sp && addr.saturating_add(8) > end {
            past_end.set(true);
        }
        r
    };
    let mut buf = FrameBuf::from(out);
    let mut sink = Sink::new(&mut buf).with_sps(sps);
    // The frame pointer is unknown. Code built with frame pointers (Rust's std, between a
    // blocking libc call and the application) finds its frame through it: when the walk gets
    // stuck there, the frame pointer is guessed from the copy (the lowest word above the stack
    // pointer followed by a return address into a loaded object) and the walk goes on.
    let mut frame = FrameAddress::from_instruction_pointer(pc);
    let (mut at_sp, mut fp) = (sp, 0u64);
    let mut ended = true;
    for _ in 0..8 {
        let regs = StartRegs {
            pc: frame.address(),
            sp: at_sp,
            fp,
            lr: 0,
        };
        past_end.set(false);
        let walked = walk(
            snap,
            pool,
            regs,
            frame,
            0,
            &mut sink,
            true,
            Some(&mut cache.0),
            walk_read,
        );
        let Some(stuck) = walked.stuck else {
            ended = !walked.out_of_steps;
            break;
        };
        if more_above && past_end.get() && !stuck.ended {
            ended = false;
            break;
        }
        // Only a frame pointer nobody restored is guessed; a known one that fails is a real end.
        if stuck.fp != 0 {
            break;
        }
        let Some(guess) = guess_frame_pointer(snap, stuck.sp, &read) else {
            break;
        };
        if stuck.ended {
            // The outermost frame also ends the walk: only a frame whose unwinding depends on
            // the frame pointer (it does not end with a non-zero one) is worth the guess.
            #[cfg(target_arch = "x86_64")]
            let mut probe =
                framehop::x86_64::UnwindRegsX86_64::new(stuck.frame.address(), stuck.sp, guess);
            #[cfg(target_arch = "aarch64")]
            let mut probe = framehop::aarch64::UnwindRegsAarch64::new_with_ptr_auth_mask(
                snap.ptr_auth_mask,
                0,
                stuck.sp,
                guess,
            );
            let mut r = read;
            if matches!(
                snap.unwinder
                    .unwind_frame(stuck.frame, &mut probe, &mut cache.0, &mut r),
                Ok(None)
            ) {
                break;
            }
        }
        // The stuck frame is the first of the next walk: written again in place.
        sink.pop();
        frame = stuck.frame;
        at_sp = stuck.sp;
        fp = guess;
    }
    sink.finish(ended)
}

/// Whether `ret`, a word found in a thread's stack at `slot`, is the return address of a call
/// still in progress from a frame whose own stack pointer is `caller_sp`: it points into loaded
/// code right after a call instruction, and the frame it returns to (its stack pointer then
/// `slot + 8`) unwinds to `caller_sp`; when the caller's call (returning to `caller_ret`) is a
/// direct one, it points into the function called. Words left over from calls that returned
/// rarely pass: each must fit the unwind rules of the code it points into at exactly that
/// depth, and be in the function its caller calls. `read`
/// reads the thread's stack (a copy of it). x86_64 only (elsewhere return addresses are not
/// always on the stack): false.
pub(crate) fn returns_into(
    ret: u64,
    slot: u64,
    caller_sp: u64,
    caller_ret: u64,
    cache: &mut OwnCache,
    read: impl FnMut(u64) -> Result<u64, ()>,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let _reader = ReaderGuard::enter();
        let snap = HOT.snapshot.load(Ordering::SeqCst);
        if snap.is_null() {
            return false;
        }
        // SAFETY: as in `unwind_counted`: the reader guard keeps the snapshot alive.
        let snap = unsafe { &*snap };
        if !snap.objects.iter().any(|o| o.executes(ret)) || !follows_a_call(ret) {
            return false;
        }
        // A direct call from the caller says which function this frame must be in (a tail
        // call from it would fail this: the walk then stops one frame short, never wrong).
        if let Some(target) = direct_call_target(snap, caller_ret) {
            if function_start(snap, ret - 1) != Some(target) {
                return false;
            }
        }
        let Some(frame) = FrameAddress::from_return_address(ret) else {
            return false;
        };
        // A frame-pointer function's frame pointer sits 16 bytes below its caller's stack
        // pointer (return address, saved frame pointer); other code ignores it.
        let mut regs = framehop::x86_64::UnwindRegsX86_64::new(
            frame.address(),
            slot + 8,
            caller_sp.wrapping_sub(16),
        );
        let mut read = read;
        matches!(
            snap.unwinder.unwind_frame(frame, &mut regs, &mut cache.0, &mut read),
            Ok(Some(_)) if regs.sp() == caller_sp
        )
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ret, slot, caller_sp, caller_ret, cache, read);
        false
    }
}

/// The frame pointer of a frame-pointer function whose stack pointer is `sp`: the lowest
/// 8-aligned address at or above `sp` (within 4 KiB) whose next word is a return address: in
/// an executable segment of a loaded object, right after a call instruction.
fn guess_frame_pointer(
    snap: &Snapshot,
    sp: u64,
    read: &impl Fn(u64) -> Result<u64, ()>,
) -> Option<u64> {
    let base = sp.checked_add(7)? & !7;
    (0..512u64).map(|i| base + i * 8).find(|&at| {
        read(at + 8)
            .is_ok_and(|ret| snap.objects.iter().any(|o| o.executes(ret)) && follows_a_call(ret))
            && read(at).is_ok()
    })
}

/// Copies this process's memory from `addr` into `buf` as far as it is mapped; the bytes
/// copied. `process_vm_readv` on ourselves: an unmapped page ends the copy (the kernel checks),
/// where a plain read would fault. Async-signal-safe: one system call.
pub(crate) fn read_own_memory(addr: u64, buf: &mut [u8]) -> usize {
    let local = libc::iovec {
        iov_base: buf.as_mut_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    let remote = libc::iovec {
        iov_base: addr as usize as *mut libc::c_void,
        iov_len: buf.len(),
    };
    // SAFETY: `local` describes our own buffer; the kernel checks `remote`.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    usize::try_from(n).unwrap_or(0)
}

/// Whether the bytes before `ret` end with an x86_64 call: `call rel32`, or `call r/m64`
/// (opcode FF /2) with its register, displacement and SIB forms. Read with `process_vm_readv`:
/// the code may be unmapped meanwhile.
fn follows_a_call(ret: u64) -> bool {
    let mut b = [0u8; 7];
    let Some(from) = ret.checked_sub(7) else {
        return false;
    };
    if read_own_memory(from, &mut b) != b.len() {
        return false;
    }
    // b[7 - k] is the byte k before `ret`.
    let at = |k: usize| b[7 - k];
    let ff2 = |k: usize| at(k) == 0xff && at(k - 1) & 0x38 == 0x10;
    at(5) == 0xe8 || (ff2(2) && at(1) & 0xc0 == 0xc0) || ff2(3) || ff2(4) || ff2(6) || ff2(7)
}
/// How much of the stack above `sp` a walk prefetches: a handler finds the stack cold, and a walk
/// reads it as a chain of dependent loads (each frame's position comes from the previous one),
/// so without prefetching every cache miss is paid one after the other. 4 KiB covers a typical
/// walk; 8 KiB measured slower (its extra misses compete with the walk's own), 2 KiB no better.
const PREFETCH_BYTES: u64 = 4096;

/// Asks the CPU to fetch `[lo, min(hi, lo + PREFETCH_BYTES))` into the cache, all at once.
#[inline]
fn prefetch_stack(lo: u64, hi: u64) {
    #[cfg(target_arch = "x86_64")]
    {
        let end = hi.min(lo.saturating_add(PREFETCH_BYTES));
        let mut line = lo & !63;
        while line < end {
            // SAFETY: a prefetch is a hint: it never faults nor changes memory, whatever the
            // address (this one lies in the stack mapping anyway).
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    line as *const i8,
                )
            };
            line += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (lo, hi);
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

/// Stack bound for a thread created after the last maps snapshot: glibc places a thread's
/// control block (what `%fs:0` points to, per the x86_64 TLS ABI) at the top of the same
/// mapping as its stack, so `[sp, tp)` is mapped. Not when `sp` is on an alternate signal stack
/// (a different mapping), nor for the main thread (its control block is elsewhere, below).
#[cfg(target_arch = "x86_64")]
fn thread_pointer_bound(sp: u64) -> Option<(u64, u64)> {
    let tp: u64;
    // SAFETY: %fs:0 holds the thread pointer itself on x86_64 Linux (TLS ABI); a plain load.
    unsafe {
        std::arch::asm!(
            "mov {}, fs:0",
            out(reg) tp,
            options(nostack, readonly, preserves_flags)
        );
    }
    if tp <= sp || tp - sp > 64 << 20 {
        return None;
    }
    // SAFETY: sigaltstack only writes the out-struct; async-signal-safe.
    let mut ss: libc::stack_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::sigaltstack(std::ptr::null(), &mut ss) } != 0 {
        return None;
    }
    if ss.ss_flags & libc::SS_DISABLE == 0 {
        let lo = ss.ss_sp as u64;
        if sp >= lo && sp < lo + ss.ss_size as u64 {
            return None;
        }
    }
    Some((sp, tp))
}

#[cfg(not(target_arch = "x86_64"))]
fn thread_pointer_bound(_sp: u64) -> Option<(u64, u64)> {
    None
}

struct ReaderGuard;

impl ReaderGuard {
    fn enter() -> ReaderGuard {
        HOT.readers.fetch_add(1, Ordering::SeqCst);
        ReaderGuard
    }
}

impl Drop for ReaderGuard {
    fn drop(&mut self) {
        HOT.readers.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Whether the calling thread is running a signal handler: its stack holds a return address
/// into the signal-return trampoline (`__restore_rt`, which glibc's `sigaction` gives the
/// kernel as every handler's restorer). `None` when that cannot be told: no handler installed
/// through glibc to learn the trampoline from, no unwinder snapshot yet, a walk that stopped
/// at once, or not x86_64. Async-signal-safe and allocation-free: for `_exit`, which a handler
/// may call while it interrupted a lock holder, so that nothing there takes a lock. The walk
/// runs on a spare stack: a handler's own stack may be a small alternate one.
#[doc(hidden)]
#[inline(never)]
pub fn __in_signal_handler() -> Option<bool> {
    let restorer = signal_restorer()?;
    let regs = current_regs();
    let bounds = crate::tls::known_stack_bounds();
    let mut spare = Spare::borrow()?;
    spare
        .run(|s| {
            let mut frames = [0u64; 128];
            let n = unwind_with(s, regs, bounds, 0, &mut frames, 0);
            // A return address is the trampoline's first byte; one taken as address - 1 too.
            (n > 2).then(|| {
                frames[..n]
                    .iter()
                    .any(|&a| a.wrapping_sub(restorer).wrapping_add(1) <= 2)
            })
        })
        .flatten()
}

/// The restorer glibc gives the kernel with a handler (`SA_RESTORER`), read back from the
/// kernel for the first signal that has one.
#[cfg(target_arch = "x86_64")]
fn signal_restorer() -> Option<u64> {
    /// The kernel's `struct sigaction` on x86_64.
    #[repr(C)]
    struct KernelSigaction {
        handler: u64,
        flags: u64,
        restorer: u64,
        mask: u64,
    }
    const SA_RESTORER: u64 = 0x0400_0000;
    (1..=64).find_map(|sig: libc::c_long| {
        let mut k = KernelSigaction {
            handler: 0,
            flags: 0,
            restorer: 0,
            mask: 0,
        };
        // SAFETY: rt_sigaction with no new action only writes the current one into `k`, a
        // struct of the kernel's layout; the size argument is the kernel's sigset size.
        let r = unsafe {
            libc::syscall(
                libc::SYS_rt_sigaction,
                sig,
                std::ptr::null::<KernelSigaction>(),
                &mut k as *mut KernelSigaction,
                8usize,
            )
        };
        (r == 0 && k.flags & SA_RESTORER != 0 && k.restorer != 0).then_some(k.restorer)
    })
}

#[cfg(not(target_arch = "x86_64"))]
fn signal_restorer() -> Option<u64> {
    None
}

/// The current stack pointer.
#[inline(always)]
pub(crate) fn current_sp() -> u64 {
    let sp: u64;
    #[cfg(target_arch = "x86_64")]
    // SAFETY: reads rsp; touches no memory.
    unsafe {
        std::arch::asm!("mov {}, rsp", out(reg) sp, options(nomem, nostack, preserves_flags));
    }
    #[cfg(target_arch = "aarch64")]
    // SAFETY: reads sp; touches no memory.
    unsafe {
        std::arch::asm!("mov {}, sp", out(reg) sp, options(nomem, nostack, preserves_flags));
    }
    sp
}

/// Registers of the calling function's frame, for unwinding from normal (non-signal) code.
#[inline(always)]
pub(crate) fn current_regs() -> StartRegs {
    let pc: u64;
    let sp: u64;
    let fp: u64;
    #[cfg(target_arch = "x86_64")]
    // SAFETY: reads rip, rsp and rbp into registers; touches no memory.
    unsafe {
        std::arch::asm!(
            "lea {pc}, [rip]",
            "mov {sp}, rsp",
            "mov {fp}, rbp",
            pc = out(reg) pc,
            sp = out(reg) sp,
            fp = out(reg) fp,
            options(nomem, nostack, preserves_flags)
        );
        StartRegs { pc, sp, fp, lr: 0 }
    }
    #[cfg(target_arch = "aarch64")]
    // SAFETY: reads pc, sp, x29 and x30 into registers; touches no memory.
    unsafe {
        let lr: u64;
        std::arch::asm!(
            "adr {pc}, .",
            "mov {sp}, sp",
            "mov {fp}, x29",
            "mov {lr}, x30",
            pc = out(reg) pc,
            sp = out(reg) sp,
            fp = out(reg) fp,
            lr = out(reg) lr,
            options(nomem, nostack, preserves_flags)
        );
        StartRegs { pc, sp, fp, lr }
    }
}

/// Registers of the interrupted context of a signal handler.
///
/// # Safety
/// `ucontext` must be the third argument of an `SA_SIGINFO` handler.
pub(crate) unsafe fn regs_from_ucontext(ucontext: *const libc::c_void) -> StartRegs {
    // SAFETY: the kernel passes a valid ucontext_t to SA_SIGINFO handlers.
    let uc = unsafe { &*(ucontext as *const libc::ucontext_t) };
    #[cfg(target_arch = "x86_64")]
    {
        let g = &uc.uc_mcontext.gregs;
        StartRegs {
            pc: g[libc::REG_RIP as usize] as u64,
            sp: g[libc::REG_RSP as usize] as u64,
            fp: g[libc::REG_RBP as usize] as u64,
            lr: 0,
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        let m = &uc.uc_mcontext;
        StartRegs {
            pc: m.pc,
            sp: m.sp,
            fp: m.regs[29],
            lr: m.regs[30],
        }
    }
}

#[cfg(test)]
mod tests {
    /// A stack found through the snapshot (not the thread's own bounds) whose top page became
    /// inaccessible after the snapshot was taken: the walk follows a frame pointer into it and
    /// must stop there, not fault. (Before reads outside the thread's own bounds went through
    /// the kernel, this test died of SIGSEGV.)
    #[test]
    fn a_walk_on_a_stack_the_snapshot_knows_wrong_stops_instead_of_faulting() {
        init_pool();
        let page = 4096usize;
        // SAFETY: a fresh anonymous mapping of our own.
        let r = unsafe {
            libc::mmap(
                ptr::null_mut(),
                3 * page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(r, libc::MAP_FAILED);
        let base = r as u64;
        refresh(true);
        // SAFETY: the top page of our mapping; nothing uses it.
        let rc = unsafe {
            libc::mprotect(
                (base + 2 * page as u64) as *mut libc::c_void,
                page,
                libc::PROT_NONE,
            )
        };
        assert_eq!(rc, 0);
        let regs = StartRegs {
            // In no object: framehop walks by frame pointer.
            pc: 0x1000,
            sp: base + 64,
            fp: base + 2 * page as u64 + 64,
            lr: 0,
        };
        let mut out = [0u64; 16];
        let (n, _) = unwind_counted(
            regs,
            None,
            0,
            &mut FrameBuf::from(&mut out[..]),
            true,
            0,
            None,
        );
        assert!(n >= 1);
        let mut w = CheckedWindow::new();
        assert!(w
            .read(base + 2 * page as u64 - 8, base + 3 * page as u64)
            .is_ok());
        assert!(w
            .read(base + 2 * page as u64, base + 3 * page as u64)
            .is_err());
        // SAFETY: our own mapping, no longer used.
        unsafe { libc::munmap(r, 3 * page) };
    }

    use super::*;

    #[inline(never)]
    fn capture(out: &mut [u64]) -> usize {
        let regs = current_regs();
        unwind(regs, crate::tls::current_stack_bounds(), 0, out, 0)
    }

    #[inline(never)]
    fn level2(out: &mut [u64]) -> usize {
        let n = capture(out);
        std::hint::black_box(n)
    }

    #[inline(never)]
    fn level1(out: &mut [u64]) -> usize {
        let n = level2(out);
        std::hint::black_box(n)
    }

    #[test]
    fn unwinds_through_functions_without_frame_pointers() {
        init_pool();
        refresh(true);
        let mut out = [0u64; MAX_FRAMES];
        let n = level1(&mut out);
        assert!(n >= 4, "only {n} frames");
        // Frame 1 returns into level2, frame 2 into level1: both inside those functions.
        let l2 = level2 as *const () as usize as u64;
        let l1 = level1 as *const () as usize as u64;
        assert!(
            out[1] > l2 && out[1] < l2 + 4096,
            "{:#x} vs level2 {l2:#x}",
            out[1]
        );
        assert!(
            out[2] > l1 && out[2] < l1 + 4096,
            "{:#x} vs level1 {l1:#x}",
            out[2]
        );
        // The walk reaches the test harness and thread start, far beyond our frames.
        assert!(n > 6, "stack cut short at {n} frames");
    }

    #[test]
    fn spare_stack_runs_the_walk_off_the_thread_stack_with_the_same_result() {
        init_pool();
        refresh(true);
        let mut spare = Spare::borrow().expect("a free spare stack");
        let top = spare.entry.stack_top as u64;
        let bounds = crate::tls::current_stack_bounds();
        let regs = current_regs();
        let mut here = [0u64; MAX_FRAMES];
        let n_here = unwind(regs, bounds, 0, &mut here, 0);
        let mut there = [0u64; MAX_FRAMES];
        let (n_there, sp_there) = spare
            .run(|s| {
                let n = unwind_with(s, regs, bounds, 0, &mut there, 0);
                (n, current_sp())
            })
            .expect("the job ran");
        #[cfg(target_arch = "x86_64")]
        assert!(
            sp_there < top && sp_there > top - SPARE_STACK_BYTES as u64,
            "{sp_there:#x} not on the spare stack below {top:#x}"
        );
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (sp_there, top);
        assert!(n_here > 3, "only {n_here} frames");
        assert_eq!(&here[..n_here], &there[..n_there]);
        drop(spare);
    }

    #[test]
    fn a_pc_in_no_known_module_cuts_the_stack() {
        init_pool();
        refresh(true);
        let here = current_regs();
        let bounds = crate::tls::current_stack_bounds();
        let mut out = [0u64; MAX_FRAMES];
        // Unmapped code addresses (what a stale snapshot may meet): the leaf is kept, and the
        // walk goes no further than the frame pointer chain allows, reading only the stack.
        for pc in [0x1000, u64::MAX - 4096] {
            let regs = StartRegs { pc, ..here };
            let n = unwind(regs, bounds, 0, &mut out, 0);
            assert!(n >= 1);
            assert_eq!(out[0], pc);
        }
    }

    #[test]
    fn probing_tells_readable_stack_from_unmapped_memory() {
        assert_eq!(probe_room(current_sp(), 512), Some(512));
        // The first pages of the address space are never mapped.
        assert_eq!(probe_room(0x2000, 512), Some(0));
        assert_eq!(probe_room(100, 512), Some(0));
        assert_eq!(probe_room(current_sp(), 1 << 20), None, "past a guard page");
    }

    #[test]
    fn headroom_comes_from_the_bounds_or_the_mappings() {
        init_pool();
        refresh(true);
        let sp = current_sp();
        assert_eq!(
            headroom(sp, Some((0x1000, sp as usize + 8))),
            Some(sp - 0x1000)
        );
        // Bounds that do not contain sp: the mapping (a thread's stack) answers.
        let bounds = crate::tls::current_stack_bounds().expect("this thread's stack");
        let room = headroom(sp, Some((1, 2))).expect("the stack is in the snapshot's mappings");
        assert!(
            room <= sp - bounds.0 as u64 + 4096,
            "{room} vs {}",
            sp - bounds.0 as u64
        );
        assert!(room > 0);
    }

    #[test]
    fn decodes_pcrel_eh_frame_pointer() {
        // version 1, pcrel|sdata4, udata4, datarel|sdata4, then -0x20.
        let mut hdr = vec![1u8, 0x1b, 0x03, 0x3b];
        hdr.extend_from_slice(&(-0x20i32).to_le_bytes());
        assert_eq!(
            crate::modules::eh_frame_address(&hdr, 0x1000),
            Some(0x1000 + 4 - 0x20)
        );
        assert_eq!(
            crate::modules::eh_frame_address(&[2, 0, 0, 0, 0, 0, 0, 0], 0),
            None
        );
    }

    /// Recursion through a function compiled without frame pointers and through `level1`/
    /// `level2`, so the stack has many frames and several distinct rules.
    #[inline(never)]
    fn recurse(depth: u32, out: &mut [u64], fast: bool) -> (usize, usize) {
        if depth == 0 {
            let regs = current_regs();
            unwind_counted(
                regs,
                crate::tls::current_stack_bounds(),
                0,
                &mut out.into(),
                fast,
                0,
                None,
            )
        } else {
            let r = std::hint::black_box(recurse(depth - 1, out, fast));
            (r.0, std::hint::black_box(r.1))
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn compact_rules_unwind_exactly_like_framehop() {
        init_pool();
        refresh(true);
        // One call site for every walk, so all stacks are the same down to the thread's start:
        // framehop alone, fast path before learning (falls back everywhere), after learning.
        let mut stacks = Vec::new();
        for (round, fast) in [false, true, true].into_iter().enumerate() {
            let mut out = [0u64; MAX_FRAMES];
            let (n, used) = recurse(20, &mut out, fast);
            if round == 1 {
                learn(&out[..n]);
            }
            stacks.push((out[..n].to_vec(), used));
        }
        let (slow, fast_before, fast_after) = (&stacks[0], &stacks[1], &stacks[2]);
        assert!(
            slow.0.len() > 22,
            "framehop walked only {} frames",
            slow.0.len()
        );
        assert_eq!(slow.1, 0);
        assert_eq!(fast_before.0, slow.0);
        assert_eq!(
            fast_after.0, slow.0,
            "the compact rules must give framehop's stack"
        );
        // Every frame, down to the thread's entry (whose rule says the stack ends there), has a
        // compact rule: the walk never borrows a framehop cache.
        assert_eq!(
            fast_after.1,
            fast_after.0.len(),
            "only {} of {} frames took the fast path",
            fast_after.1,
            fast_after.0.len()
        );
    }

    /// Pushes `depth` frames 1..=depth into a buffer of `len` (split after `head`) and
    /// finishes it.
    fn sink_of(len: usize, head: usize, depth: usize, ended: bool) -> Vec<u64> {
        let mut store = vec![0u64; len];
        let (h, t) = store.split_at_mut(head);
        let mut buf = FrameBuf::new(h, t);
        let mut sink = Sink::new(&mut buf);
        for f in 1..=depth as u64 {
            sink.push(f);
        }
        let n = sink.finish(ended);
        store.truncate(n);
        store
    }

    #[test]
    fn a_stack_deeper_than_the_buffer_keeps_both_ends_around_a_marker() {
        // Fits: as walked.
        assert_eq!(sink_of(16, 16, 16, true), (1..=16).collect::<Vec<_>>());
        for head in [16, 5, 0, 13] {
            // 16 slots: 11 leaf frames, the marker, the 4 outermost of 100.
            let got = sink_of(16, head, 100, true);
            let mut want: Vec<u64> = (1..=11).collect();
            want.push(truncation_marker(100 - 15));
            want.extend(97..=100);
            assert_eq!(got, want, "head {head}");
            // One frame too many: it and the frame whose slot the marker takes give way.
            let got = sink_of(16, head, 17, true);
            assert_eq!(&got[..11], &(1..=11).collect::<Vec<_>>()[..]);
            assert_eq!(got[11], truncation_marker(2));
            assert_eq!(&got[12..], &[14, 15, 16, 17]);
        }
        // Stopped before the end (out of steps): no root end to show, the marker is outermost.
        let got = sink_of(16, 4, 100, false);
        assert_eq!(got.len(), 12);
        assert_eq!(&got[..11], &(1..=11).collect::<Vec<_>>()[..]);
        assert_eq!(got[11], truncation_marker(89));
        // Too small for a marker: the leaf end only.
        assert_eq!(sink_of(1, 1, 5, true), vec![1]);
    }

    #[test]
    fn markers_name_a_power_of_two_of_the_frames_left_out() {
        assert_eq!(
            truncation_name(truncation_marker(1)).as_deref(),
            Some("[truncated: 1+ frames]")
        );
        assert_eq!(
            truncation_name(truncation_marker(200)).as_deref(),
            Some("[truncated: 128+ frames]")
        );
        assert_eq!(
            truncation_name(truncation_marker(256)).as_deref(),
            Some("[truncated: 256+ frames]")
        );
        assert_eq!(truncation_name(0x5555_0000_1000), None);
        assert!(
            !is_truncation_marker(0xffff_ffff_ff60_0000),
            "the vsyscall page"
        );
    }

    /// Recursion `depth` deep, then a walk into `out`.
    #[inline(never)]
    fn deep(depth: u32, out: &mut FrameBuf<'_>) -> usize {
        if depth == 0 {
            let regs = current_regs();
            unwind_counted(
                regs,
                crate::tls::current_stack_bounds(),
                0,
                out,
                true,
                0,
                None,
            )
            .0
        } else {
            std::hint::black_box(deep(depth - 1, out))
        }
    }

    #[test]
    fn a_deep_recursion_keeps_its_leaf_and_its_thread_start() {
        init_pool();
        refresh(true);
        let depth = MAX_FRAMES as u32 + 200;
        // Run on a thread of known stack so that debug builds' frames fit. One call site for
        // every walk: the stacks are the same down to the thread's start. Buffers: room for the
        // whole stack; the limit; the limit split in two parts; 16 slots (128 steps: the walk
        // stops far from the end).
        let mut stacks = std::thread::Builder::new()
            .stack_size(64 << 20)
            .spawn(move || {
                let mut stacks = Vec::new();
                for (len, head) in [
                    (4 * MAX_FRAMES, 0),
                    (MAX_FRAMES, 0),
                    (MAX_FRAMES, 100),
                    (16, 0),
                ] {
                    let mut s = vec![0u64; len];
                    let (h, t) = s.split_at_mut(head);
                    let n = deep(depth, &mut FrameBuf::new(h, t));
                    s.truncate(n);
                    stacks.push(s);
                }
                stacks
            })
            .unwrap()
            .join()
            .unwrap();
        let short = stacks.pop().unwrap();
        let split = stacks.pop().unwrap();
        let cut = stacks.pop().unwrap();
        let whole = stacks.pop().unwrap();
        assert!(
            whole.len() > depth as usize,
            "walked {} frames",
            whole.len()
        );
        assert!(!whole.iter().any(|&a| is_truncation_marker(a)));
        let root = MAX_FRAMES / ROOT_SHARE;
        let leaf = MAX_FRAMES - root - 1;
        assert_eq!(cut.len(), MAX_FRAMES);
        assert_eq!(&cut[..leaf], &whole[..leaf], "the leaf end");
        assert_eq!(cut[leaf], truncation_marker(whole.len() - (MAX_FRAMES - 1)));
        assert_eq!(
            &cut[leaf + 1..],
            &whole[whole.len() - root..],
            "the root end"
        );
        assert_eq!(split, cut, "a split buffer holds the same stack");
        assert_eq!(short.len(), 12);
        assert_eq!(&short[..11], &whole[..11]);
        assert!(is_truncation_marker(short[11]));
    }
}
