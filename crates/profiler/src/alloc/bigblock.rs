//! The profiler's own large blocks, mapped and unmapped directly, never through the inner
//! allocator.
//!
//! glibc serves a block at or above its mmap threshold (128 KiB at first) with a mapping of its
//! own, and when it frees one it raises the threshold to that block's size, and the trim
//! threshold to twice that, for the whole process. From then on the application's blocks of
//! those sizes come from its arenas, and the arenas keep more free memory resident. An export
//! allocates and frees blocks of megabytes (grown tables, the encoded profile, compression
//! buffers): one export raised the threshold for good, and the soak service then kept 12-15 MB
//! more in its worker arenas than without the profiler, though the profiler itself held only
//! 2-3 MB of live heap. With the threshold pinned by hand the difference was within noise.
//!
//! So a block of [`BIG`] bytes or more that the profiler allocates (the calling thread is in
//! profiler code: see [`crate::tls::ThreadState::guard`]) is a private mapping of its own,
//! unmapped when freed. Any thread may free it (a table grown on an application thread during a
//! sampled allocation is freed by the export thread), so blocks are known by address, in a fixed
//! table of atomics: no lock, nothing to reset after a fork (the child inherits the mappings and
//! the table alike). When the table is full, blocks go to the inner allocator as before.

use std::alloc::Layout;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::filter::FILTER;

/// Blocks at least this large are the profiler's own mappings (glibc's initial mmap threshold).
pub(crate) const BIG: usize = 128 * 1024;
/// Most blocks mapped at once.
const SLOTS: usize = 256;
const PAGE: usize = 4096;
/// A slot whose block is being moved (no block is at address 1).
const MOVING: usize = 1;

/// Each slot: a block's address (0 = free) and its mapped length.
static ADDRS: [AtomicUsize; SLOTS] = [const { AtomicUsize::new(0) }; SLOTS];
static LENS: [AtomicUsize; SLOTS] = [const { AtomicUsize::new(0) }; SLOTS];
/// Blocks mapped now: frees of the application's large blocks skip the table when 0.
static LIVE: AtomicUsize = AtomicUsize::new(0);

fn mapped_len(size: usize) -> Option<usize> {
    size.checked_add(PAGE - 1).map(|s| s & !(PAGE - 1))
}

/// A fresh zeroed block for `layout` (at least [`BIG`] bytes), or None: alignment above a page,
/// the table full, or the kernel refused.
pub(crate) fn alloc(layout: Layout) -> Option<*mut u8> {
    if layout.align() > PAGE {
        return None;
    }
    let len = mapped_len(layout.size())?;
    let slot = ADDRS.iter().position(|a| a.load(Ordering::Relaxed) == 0)?;
    // SAFETY: a fresh anonymous private mapping; nothing else refers to it.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    let addr = p as usize;
    // Another thread may have taken the slot meanwhile: the next free one then.
    let taken = std::iter::once(slot).chain(0..SLOTS).find(|&i| {
        ADDRS[i]
            .compare_exchange(0, addr, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    });
    let Some(i) = taken else {
        // SAFETY: our own mapping, never handed out.
        unsafe { libc::munmap(p, len) };
        return None;
    };
    LENS[i].store(len, Ordering::Release);
    LIVE.fetch_add(1, Ordering::Relaxed);
    // Its free must take the allocator's slow path, which finds it here.
    FILTER.insert_own(addr);
    Some(p as *mut u8)
}

fn slot_of(ptr: *mut u8) -> Option<usize> {
    if LIVE.load(Ordering::Relaxed) == 0 {
        return None;
    }
    let addr = ptr as usize;
    ADDRS.iter().position(|a| a.load(Ordering::Acquire) == addr)
}

/// Unmaps `ptr` if it is one of these blocks; false when it is not (it came from the inner
/// allocator).
pub(crate) fn free(ptr: *mut u8) -> bool {
    let Some(i) = slot_of(ptr) else {
        return false;
    };
    let len = LENS[i].load(Ordering::Acquire);
    // Out of the table before the address can be mapped again for another block.
    ADDRS[i].store(0, Ordering::Release);
    LIVE.fetch_sub(1, Ordering::Relaxed);
    FILTER.remove_own(ptr as usize);
    // SAFETY: the block's whole mapping; its owner is freeing it, nobody uses it any more.
    unsafe { libc::munmap(ptr.cast(), len) };
    true
}

/// Whether `ptr` is one of these blocks.
pub(crate) fn owns(ptr: *mut u8) -> bool {
    slot_of(ptr).is_some()
}

/// Resizes block `ptr` (one of these: see [`owns`]) to `new_size` bytes, contents kept, moved
/// if need be; null on failure, the old block intact.
pub(crate) fn resize(ptr: *mut u8, new_size: usize) -> *mut u8 {
    let Some(i) = slot_of(ptr) else {
        return std::ptr::null_mut();
    };
    let old = LENS[i].load(Ordering::Acquire);
    let Some(len) = mapped_len(new_size) else {
        return std::ptr::null_mut();
    };
    // Only the block's owner resizes it, so the slot is ours to update. While the kernel may
    // move the block, the slot names no address (the old one may be mapped again for another
    // block at once).
    ADDRS[i].store(MOVING, Ordering::Release);
    // SAFETY: remaps the block's own mapping; the kernel keeps its contents.
    let p = unsafe { libc::mremap(ptr.cast(), old, len, libc::MREMAP_MAYMOVE) };
    if p == libc::MAP_FAILED {
        ADDRS[i].store(ptr as usize, Ordering::Release);
        return std::ptr::null_mut();
    }
    LENS[i].store(len, Ordering::Release);
    ADDRS[i].store(p as usize, Ordering::Release);
    if !std::ptr::eq(p.cast::<u8>(), ptr) {
        FILTER.insert_own(p as usize);
        FILTER.remove_own(ptr as usize);
    }
    p as *mut u8
}

/// Bytes mapped for blocks now (for stats).
pub(crate) fn mapped_bytes() -> usize {
    ADDRS
        .iter()
        .zip(&LENS)
        .filter(|(a, _)| a.load(Ordering::Relaxed) > MOVING)
        .map(|(_, l)| l.load(Ordering::Relaxed))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_mapped_resized_and_unmapped() {
        let layout = Layout::from_size_align(BIG + 10, 64).unwrap();
        let p = alloc(layout).expect("mapped");
        // SAFETY: the block is BIG + 10 bytes, ours.
        unsafe {
            assert_eq!(*p, 0);
            std::ptr::write_bytes(p, 7, BIG + 10);
        }
        assert!(owns(p));
        let q = resize(p, 4 * BIG);
        assert!(!q.is_null());
        // SAFETY: the first BIG + 10 bytes were kept, the block is now 4 * BIG bytes.
        unsafe {
            assert_eq!(*q.add(BIG + 9), 7);
            *q.add(4 * BIG - 1) = 1;
        }
        assert!(mapped_bytes() >= 4 * BIG);
        let other = Box::into_raw(Box::new([0u8; 16])) as *mut u8;
        assert!(!free(other), "not one of ours");
        assert!(!owns(other));
        // SAFETY: the box allocated above, untouched by the table.
        drop(unsafe { Box::from_raw(other as *mut [u8; 16]) });
        assert!(free(q));
        assert!(!free(q), "freed once");
        assert!(alloc(Layout::from_size_align(BIG, 2 * PAGE).unwrap()).is_none());
    }
}
