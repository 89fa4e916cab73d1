//! What a walk starts from, reads and writes: the registers it starts from, this process's
//! memory read without faulting, the buffer it writes a stack into and its marker frames.

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
pub(super) const ROOT_SHARE: usize = 4;

/// Frames a walk may step through per frame of its buffer: past a full buffer it goes on, this
/// far, to find the stack's root end. Bounds a handler's time on a runaway recursion; a stack
/// deeper than that ends in the marker.
pub(super) const STEPS_PER_FRAME: usize = 4;

/// Marks the cut of a stack cut for length: a reserved address, never code on x86_64 nor
/// aarch64 (non-canonical; above any user-space address), whose low six bits hold
/// log2 of the number of frames left out. The symbolizer names it (see [`truncation_name`]):
/// every viewer shows the cut as a frame of its own.
pub(super) const TRUNCATED_MARKER: u64 = 0x7fff_ffff_ffff_ff00;

/// The marker for a cut that left out `dropped` frames (at least). Powers of two: stacks that
/// differ only a little in depth still merge in a flame graph.
pub(super) fn truncation_marker(dropped: usize) -> u64 {
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

/// Marks where the walk of another thread's stack could not prove the next caller (see
/// [`super::unwind_copied`]): the frames before it are the thread's, the rest of its stack is
/// unknown. A reserved address next to [`TRUNCATED_MARKER`], never code either.
pub(crate) const UNKNOWN_MARKER: u64 = 0x7fff_ffff_ffff_fe00;

/// Whether `addr` is one of the walk's marker frames (truncation or unknown caller).
pub(crate) fn is_marker(addr: u64) -> bool {
    is_truncation_marker(addr) || addr == UNKNOWN_MARKER
}

/// The function name of a marker frame: the truncation's, or `[stack unknown]`.
pub(crate) fn marker_name(addr: u64) -> Option<String> {
    if addr == UNKNOWN_MARKER {
        return Some("[stack unknown]".to_owned());
    }
    truncation_name(addr)
}

/// Where a walk writes a stack: one slice, or two used back to back (a CPU capture slot keeps
/// the first frames of every stack densely and the rest of deep ones apart).
pub(crate) struct FrameBuf<'a> {
    pub(super) head: &'a mut [u64],
    pub(super) tail: &'a mut [u64],
}

impl<'a> FrameBuf<'a> {
    pub(crate) fn new(head: &'a mut [u64], tail: &'a mut [u64]) -> Self {
        FrameBuf { head, tail }
    }

    pub(super) fn len(&self) -> usize {
        self.head.len() + self.tail.len()
    }

    /// Frame `i` (below the length written).
    #[inline]
    pub(crate) fn at(&self, i: usize) -> u64 {
        self.get(i)
    }

    #[inline]
    pub(super) fn get(&self, i: usize) -> u64 {
        match i.checked_sub(self.head.len()) {
            None => self.head[i],
            Some(j) => self.tail[j],
        }
    }

    #[inline]
    pub(super) fn set(&mut self, i: usize, v: u64) {
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

    pub(super) fn reverse(&mut self, mut a: usize, mut b: usize) {
        while a + 1 < b {
            b -= 1;
            let (x, y) = (self.get(a), self.get(b));
            self.set(a, y);
            self.set(b, x);
            a += 1;
        }
    }

    /// Rotates `[a, b)` left by `k`, in place (three reversals: no allocation).
    pub(super) fn rotate_left(&mut self, a: usize, b: usize, k: usize) {
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
pub(super) struct Sink<'b, 'a> {
    pub(super) buf: &'b mut FrameBuf<'a>,
    /// Where the stack pointer stood in each frame, for the first frames (a walk that wants
    /// them: see [`unwind_copied`]); unused past its length.
    pub(super) sps: &'b mut [u64],
    /// Frames pushed so far (the stack's depth, once the walk ended).
    pub(super) seen: usize,
    /// Steps the walk may still take.
    pub(super) steps: usize,
    /// Skipped frames (below the walk's `skip_to_sp`) that the compact rules did not know, the
    /// first few: a walk that skips learns them with the frames it keeps.
    pub(super) unknown_skipped: [u64; UNKNOWN_SKIPPED],
    pub(super) n_unknown_skipped: usize,
    /// Frames, kept or skipped, that the compact rules did not know: none, and there is nothing
    /// to learn.
    pub(super) unknown: usize,
}

/// Skipped frames a walk remembers for learning: a sampled allocation skips its own handful.
pub(super) const UNKNOWN_SKIPPED: usize = 8;

impl<'b, 'a> Sink<'b, 'a> {
    pub(super) fn new(buf: &'b mut FrameBuf<'a>) -> Self {
        let steps = buf.len() * STEPS_PER_FRAME + 64;
        Sink {
            buf,
            sps: &mut [],
            seen: 0,
            steps,
            unknown_skipped: [0; UNKNOWN_SKIPPED],
            n_unknown_skipped: 0,
            unknown: 0,
        }
    }

    /// Also records each frame's stack pointer into `sps`, for as many frames as it holds.
    pub(super) fn with_sps(mut self, sps: &'b mut [u64]) -> Self {
        self.sps = sps;
        self
    }

    /// Where the marker goes in a cut stack: the leaf part lies before it, the ring from it on.
    /// Only for buffers of two frames or more.
    pub(super) fn cut(&self) -> usize {
        let len = self.buf.len();
        len - len / ROOT_SHARE - 1
    }

    /// Whether another frame has somewhere to go (a buffer too small for a marker keeps the
    /// leaf end only, and the walk stops when it is full).
    pub(super) fn wants_more(&self) -> bool {
        self.seen < self.buf.len() || self.buf.len() >= 2
    }

    /// Takes one step of the budget; false when it is spent.
    pub(super) fn step(&mut self) -> bool {
        self.steps = self.steps.saturating_sub(1);
        self.steps > 0
    }

    /// Pushes a frame, and where the stack pointer stood in it.
    pub(super) fn push_at(&mut self, addr: u64, sp: u64) {
        if let Some(s) = self.sps.get_mut(self.seen) {
            *s = sp;
        }
        self.push(addr);
    }

    pub(super) fn push(&mut self, addr: u64) {
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

    /// Notes a frame the compact rules did not know; a skipped one is kept (the first few).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) fn note_unknown(&mut self, addr: u64, skipped: bool) {
        self.unknown += 1;
        if !skipped {
            return;
        }
        if let Some(slot) = self.unknown_skipped.get_mut(self.n_unknown_skipped) {
            *slot = addr;
            self.n_unknown_skipped += 1;
        }
    }

    /// The skipped frames noted by [`Self::note_unknown_skipped`].
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) fn unknown_skipped(&self) -> &[u64] {
        &self.unknown_skipped[..self.n_unknown_skipped]
    }

    /// Takes back the last frame pushed (the walk will write it again).
    pub(super) fn pop(&mut self) {
        self.seen = self.seen.saturating_sub(1);
    }

    /// Frames pushed so far.
    pub(super) fn depth(&self) -> usize {
        self.seen
    }

    /// The frame pushed `i`th, while the buffer still holds it in place (before its ring).
    pub(super) fn frame(&self, i: usize) -> Option<u64> {
        (i < self.seen && i < self.buf.len() && (self.seen <= self.buf.len() || i < self.cut()))
            .then(|| self.buf.get(i))
    }

    /// Takes back the frames pushed from the `keep`th on, when the buffer still holds them in
    /// place; whether it did.
    pub(super) fn keep_first(&mut self, keep: usize) -> bool {
        let len = self.buf.len();
        if keep > self.seen || (self.seen > len && keep >= self.cut().min(len)) {
            return false;
        }
        self.seen = keep;
        true
    }

    /// Ends the stack with [`UNKNOWN_MARKER`] as its outermost frame: the walk stopped at a
    /// caller it could not prove.
    pub(super) fn finish_unknown(mut self) -> usize {
        self.push(UNKNOWN_MARKER);
        self.finish(true)
    }

    /// Puts the frames in their final order and returns how many the buffer holds. `ended`:
    /// the walk reached the stack's end (or a frame it could not unwind), rather than running
    /// out of steps or of readable stack with more above.
    pub(super) fn finish(self, ended: bool) -> usize {
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

/// [`read_own_memory`] into a buffer that need not be initialised, with one remote piece per
/// page: the kernel never splits a piece, so an unmapped page ends the copy there and keeps the
/// pages before it (one piece for the whole range would keep nothing). Reads at most
/// [`PAGED_READ_PAGES`] pages' worth; the bytes written at the start of `buf`.
/// Async-signal-safe: one system call.
pub(crate) fn read_own_memory_paged(addr: u64, buf: &mut [std::mem::MaybeUninit<u8>]) -> usize {
    const PAGE: u64 = 4096;
    let mut remote = [libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    }; PAGED_READ_PAGES];
    let (mut at, end, mut n) = (addr, addr.saturating_add(buf.len() as u64), 0);
    while at < end && n < remote.len() {
        let piece_end = ((at + PAGE) & !(PAGE - 1)).min(end);
        remote[n] = libc::iovec {
            iov_base: at as usize as *mut libc::c_void,
            iov_len: (piece_end - at) as usize,
        };
        (at, n) = (piece_end, n + 1);
    }
    let local = libc::iovec {
        iov_base: buf.as_mut_ptr().cast::<libc::c_void>(),
        iov_len: (at - addr) as usize,
    };
    // SAFETY: `local` is within our own buffer (`at - addr <= buf.len()`); the kernel checks
    // every remote piece and only writes bytes it could read.
    let got =
        unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, remote.as_ptr(), n as _, 0) };
    usize::try_from(got).unwrap_or(0)
}

/// Remote pieces one [`read_own_memory_paged`] call can take: 16 KiB from any start, and more.
pub(crate) const PAGED_READ_PAGES: usize = 17;
