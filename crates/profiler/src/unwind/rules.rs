//! The handler's fast path through a frame (x86_64): a table from code address to a compact
//! unwind rule, filled outside the handler from the module's `.eh_frame` and read inside it with
//! two loads.
//!
//! Why: a handler samples a thread that has been running something else for 10 ms, so every
//! cache it touches is cold. framehop's own rule cache costs a 64-bit division, a large enum
//! dispatch and its module bookkeeping per frame; this table costs a multiply, one cache line
//! and the stack reads. Addresses the table does not know (yet), or whose rule does not fit the
//! compact form (CFA not `rsp`/`rbp` + offset, return address or `rbp` not at a CFA offset), are
//! unwound by framehop as before, so the fast path never changes a result: it only skips work
//! for rules framehop would have derived the same way (a test checks both agree).
//!
//! Who writes: [`RuleTable::learn`] runs in the sampler thread with the frames of each capture
//! (the lookup addresses the handler saw), derives what is missing with gimli, and publishes each
//! entry with a release store of its key after its rule. Entries are written once; the table
//! belongs to one set of loaded objects and is replaced with them.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use framehop::x86_64::UnwindRegsX86_64;
// gimli as re-exported by addr2line: the same version framehop uses, no new dependency.
use gimli::{
    BaseAddresses, CfaRule, EhFrame, EhFrameHdr, LittleEndian, RegisterRule, UnwindContext,
    UnwindSection, X86_64,
};

use crate::modules::UnwindCopy;
use crate::unwind::MemSlice;

/// log2 of the number of entries: 2048 entries of 16 bytes, 32 KiB per table.
const TABLE_BITS: u32 = 11;
/// Rule word of an address known to need framehop.
const NO_RULE: u64 = 1;
/// Set in every compact rule, so a rule is never 0 (empty) nor `NO_RULE`.
const VALID: u64 = 1 << 63;
/// CFA is `rbp` + offset (else `rsp` + offset).
const CFA_FROM_BP: u64 = 1 << 32;
/// The caller's `rbp` is saved at CFA + offset (else `rbp` is unchanged).
const BP_SAVED: u64 = 1 << 33;
/// The return address is undefined here: the outermost frame (a thread's entry, e.g. the
/// child side of `clone3`). Every walk of a thread's stack ends at one; without this rule each
/// would borrow a framehop cache for that last frame alone, the coldest work of a walk.
const OUTERMOST: u64 = VALID | 1 << 34;

/// One module's unwind sections, in place in memory or in a private copy (see `unwind`).
pub(crate) struct RuleModule {
    pub start: u64,
    pub end: u64,
    pub hdr: MemSlice,
    pub hdr_addr: u64,
    pub eh_frame: MemSlice,
    pub eh_frame_addr: u64,
    pub text_addr: u64,
}

pub(crate) struct Entry {
    key: AtomicU64,
    rule: AtomicU64,
}

/// The entries, as the handler reads them: behind one pointer (an `Arc<[Entry]>` keeps them
/// right after its counts), so a walk pays one cache miss to reach them, not three.
pub(crate) type Entries = Arc<[Entry]>;

/// Address -> compact rule, two-way set associative; see the module docs.
pub(crate) struct RuleTable {
    entries: Entries,
    /// Sorted by start, non-overlapping.
    modules: Vec<RuleModule>,
    /// Held by the one writer (try-lock only, so nobody ever waits); a plain flag rather than a
    /// mutex so a forked child can clear it when the holder did not survive the fork.
    writing: AtomicBool,
    /// gimli's evaluation state, used by the holder of `writing`.
    ctx: UnsafeCell<Box<UnwindContext<usize>>>,
    /// The private section copies `modules` point into: alive as long as the table, which may
    /// outlive the snapshot that built it.
    _copies: Vec<Arc<UnwindCopy>>,
}

// SAFETY: `ctx` is only touched by the holder of `writing` (taken with a compare-and-swap);
// everything else is atomics or immutable after construction (`modules` points at read-only
// sections of objects never unloaded, or at copies the table keeps alive).
unsafe impl Sync for RuleTable {}
// SAFETY: as above; nothing in the table is tied to the thread that built it.
unsafe impl Send for RuleTable {}

/// What one fast step did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Unwound to the caller; its return address.
    Next(u64),
    /// The return address is 0: the outermost frame.
    End,
    /// The rule does not apply here (a bad read, a CFA that does not move up): framehop decides.
    Fallback,
}

impl RuleTable {
    pub(crate) fn new(mut modules: Vec<RuleModule>, copies: Vec<Arc<UnwindCopy>>) -> RuleTable {
        modules.sort_unstable_by_key(|m| m.start);
        RuleTable {
            entries: (0..1usize << TABLE_BITS)
                .map(|_| Entry {
                    key: AtomicU64::new(0),
                    rule: AtomicU64::new(0),
                })
                .collect(),
            modules,
            writing: AtomicBool::new(false),
            ctx: UnsafeCell::new(Box::new(UnwindContext::new())),
            _copies: copies,
        }
    }

    /// In a forked child: a learner that held the table did not survive the fork.
    pub(crate) fn after_fork_in_child(&self) {
        self.writing.store(false, Ordering::Release);
    }

    /// The entries, for [`rule`].
    pub(crate) fn entries(&self) -> Entries {
        Arc::clone(&self.entries)
    }

    fn known(&self, addr: u64) -> bool {
        entry_of(&self.entries, addr).is_some()
    }

    /// Derives and publishes rules for the addresses not in the table yet. Best effort: skips
    /// everything when another thread is learning, and addresses whose set is full. Allocates;
    /// never call from a signal handler.
    pub(crate) fn learn(&self, addrs: &[u64]) {
        let skip = |a: u64| a == 0 || crate::unwind::is_marker(a);
        if addrs.iter().all(|&a| skip(a) || self.known(a)) {
            return;
        }
        if self
            .writing
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            return;
        }
        // SAFETY: `writing` is ours until released below; only its holder touches `ctx`.
        let ctx = unsafe { &mut *self.ctx.get() };
        for &addr in addrs {
            if skip(addr) || self.known(addr) {
                continue;
            }
            let rule = self.derive(ctx, addr).unwrap_or(NO_RULE);
            if let Some(e) =
                set_of(&self.entries, addr).find(|e| e.key.load(Ordering::Relaxed) == 0)
            {
                // Rule first, then the key with release: a reader that sees the key sees the rule.
                e.rule.store(rule, Ordering::Relaxed);
                e.key.store(addr, Ordering::Release);
            }
        }
        self.writing.store(false, Ordering::Release);
    }

    /// The compact form of the CFI row for `addr`, when the row has one.
    fn derive(&self, ctx: &mut UnwindContext<usize>, addr: u64) -> Option<u64> {
        let i = self.modules.partition_point(|m| m.start <= addr);
        let m = self.modules.get(i.checked_sub(1)?)?;
        if addr >= m.end {
            return None;
        }
        let bases = BaseAddresses::default()
            .set_eh_frame_hdr(m.hdr_addr)
            .set_eh_frame(m.eh_frame_addr)
            .set_text(m.text_addr);
        let hdr = EhFrameHdr::new(&m.hdr, LittleEndian)
            .parse(&bases, 8)
            .ok()?;
        let table = hdr.table()?;
        let eh_frame = EhFrame::new(&m.eh_frame, LittleEndian);
        let row = table
            .unwind_info_for_address(&eh_frame, &bases, ctx, addr, EhFrame::cie_from_offset)
            .ok()?;
        let (from_bp, cfa_offset) = match *row.cfa() {
            CfaRule::RegisterAndOffset { register, offset } if register == X86_64::RSP => {
                (false, offset)
            }
            CfaRule::RegisterAndOffset { register, offset } if register == X86_64::RBP => {
                (true, offset)
            }
            _ => return None,
        };
        let ra = match row.register(X86_64::RA) {
            Some(RegisterRule::Offset(o)) => o,
            Some(RegisterRule::Undefined) => return Some(OUTERMOST),
            _ => return None,
        };
        // No rule: the ABI's default for a callee-saved register, unchanged.
        let bp = match row.register(X86_64::RBP) {
            None | Some(RegisterRule::Undefined | RegisterRule::SameValue) => None,
            Some(RegisterRule::Offset(o)) => Some(o),
            _ => return None,
        };
        encode(from_bp, cfa_offset, ra, bp)
    }
}

#[inline]
fn home(addr: u64) -> usize {
    (addr.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - TABLE_BITS)) as usize
}

/// The two entries (one set) where `addr` may be kept; the ways are neighbours, most often in
/// one cache line.
#[inline]
fn set_of(entries: &[Entry], addr: u64) -> impl Iterator<Item = &Entry> {
    let home = home(addr);
    [home, home ^ 1]
        .into_iter()
        .filter_map(move |i| entries.get(i))
}

/// The published entry for `addr` (acquire: its rule is visible).
#[inline]
fn entry_of(entries: &[Entry], addr: u64) -> Option<&Entry> {
    set_of(entries, addr).find(|e| e.key.load(Ordering::Acquire) == addr)
}

/// The compact rule for lookup address `addr`, if it has one. Async-signal-safe.
#[inline]
pub(crate) fn rule(entries: &[Entry], addr: u64) -> Option<u64> {
    let r = entry_of(entries, addr)?.rule.load(Ordering::Relaxed);
    (r & VALID != 0).then_some(r)
}

/// Starts fetching the entries `addr` would use, so the miss overlaps other work.
#[inline]
pub(crate) fn prefetch(entries: &[Entry], addr: u64) {
    if let Some(e) = entries.get(home(addr)) {
        // SAFETY: a prefetch is a hint that never faults nor writes; `e` is a live entry anyway.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                (e as *const Entry).cast(),
            )
        };
    }
}

/// Packs a rule: CFA offset as i32 in bits 0..32, flags in 32..35, the return address's and
/// saved `rbp`'s CFA offsets in 8-byte units as i8 in bits 40..48 and 48..56.
fn encode(from_bp: bool, cfa_offset: i64, ra_offset: i64, bp_offset: Option<i64>) -> Option<u64> {
    let units = |o: i64| -> Option<u64> {
        if o % 8 != 0 {
            return None;
        }
        Some(u64::from(i8::try_from(o / 8).ok()? as u8))
    };
    let mut r =
        VALID | u64::from(i32::try_from(cfa_offset).ok()? as u32) | (units(ra_offset)? << 40);
    if from_bp {
        r |= CFA_FROM_BP;
    }
    if let Some(o) = bp_offset {
        r |= BP_SAVED | (units(o)? << 48);
    }
    Some(r)
}

/// Unwinds one frame by a compact rule. Changes `regs` only on [`Step::Next`].
/// Async-signal-safe: reads memory only through `read`.
#[inline]
pub(crate) fn step(
    rule: u64,
    regs: &mut UnwindRegsX86_64,
    read: &mut impl FnMut(u64) -> Result<u64, ()>,
) -> Step {
    if rule & OUTERMOST == OUTERMOST {
        return Step::End;
    }
    let sp = regs.sp();
    let base = if rule & CFA_FROM_BP != 0 {
        regs.bp()
    } else {
        sp
    };
    let Some(cfa) = base.checked_add_signed(i64::from(rule as u32 as i32)) else {
        return Step::Fallback;
    };
    if cfa <= sp {
        return Step::Fallback;
    }
    let at = |units: u64| cfa.wrapping_add_signed(i64::from(units as u8 as i8) * 8);
    let Ok(ra) = read(at(rule >> 40)) else {
        return Step::Fallback;
    };
    let bp = if rule & BP_SAVED != 0 {
        match read(at(rule >> 48)) {
            Ok(bp) => bp,
            Err(()) => return Step::Fallback,
        }
    } else {
        regs.bp()
    };
    if ra == 0 {
        return Step::End;
    }
    regs.set_ip(ra);
    regs.set_sp(cfa);
    regs.set_bp(bp);
    Step::Next(ra)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake stack: word i at address 0x1000 + 8 i.
    fn reader(words: &[u64]) -> impl FnMut(u64) -> Result<u64, ()> + '_ {
        move |a| {
            let i = a.checked_sub(0x1000).ok_or(())? / 8;
            words.get(i as usize).copied().ok_or(())
        }
    }

    #[test]
    fn steps_by_sp_and_by_bp_rules() {
        //          0x1000  0x1008  0x1010  0x1018
        let words = [7, 0x1028, 0x4444, 0];
        let mut read = reader(&words);
        // CFA = rsp + 16, return address at CFA - 8, rbp unchanged.
        let r = encode(false, 16, -8, None).unwrap();
        let mut regs = UnwindRegsX86_64::new(0x10, 0x1000, 0x55);
        assert_eq!(step(r, &mut regs, &mut read), Step::Next(0x1028));
        assert_eq!((regs.sp(), regs.bp(), regs.ip()), (0x1010, 0x55, 0x1028));
        // CFA = rbp + 16, rbp saved at CFA - 16, return address at CFA - 8.
        let r = encode(true, 16, -8, Some(-16)).unwrap();
        let mut regs = UnwindRegsX86_64::new(0x10, 0x1000, 0x1008);
        assert_eq!(step(r, &mut regs, &mut read), Step::Next(0x4444));
        assert_eq!((regs.sp(), regs.bp()), (0x1018, 0x1028));
    }

    #[test]
    fn odd_cases_leave_the_frame_to_framehop() {
        let words = [0u64; 4];
        let mut read = reader(&words);
        let before = |bp| UnwindRegsX86_64::new(0x10, 0x1000, bp);
        // A CFA that does not move up.
        let r = encode(false, 0, -8, None).unwrap();
        let mut regs = before(0);
        assert_eq!(step(r, &mut regs, &mut read), Step::Fallback);
        // A return address outside the readable stack.
        let r = encode(false, 0x100, -8, None).unwrap();
        assert_eq!(step(r, &mut regs, &mut read), Step::Fallback);
        // A return address of 0 ends the walk.
        let r = encode(false, 16, -8, None).unwrap();
        assert_eq!(step(r, &mut regs, &mut read), Step::End);
        assert_eq!(
            regs.sp(),
            0x1000,
            "registers untouched unless the step succeeds"
        );
        // The outermost frame's rule ends the walk without reading anything.
        let mut regs = before(0x77);
        assert_eq!(step(OUTERMOST, &mut regs, &mut |_| Err(())), Step::End);
        assert_eq!((regs.sp(), regs.bp()), (0x1000, 0x77));
        // Offsets that are not whole words, or too far, have no compact form.
        assert_eq!(encode(false, 16, -4, None), None);
        assert_eq!(encode(false, 16, -8, Some(8 * 200)), None);
        assert_eq!(encode(false, 1 << 40, -8, None), None);
    }
}
