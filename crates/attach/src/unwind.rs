//! Unwinding another process's copied user stacks with its objects' `.eh_frame` tables, read
//! from the files it maps (framehop, as the in-process unwinder).

use framehop::x86_64::{CacheX86_64, UnwindRegsX86_64, UnwinderX86_64};
use framehop::{ExplicitModuleSectionInfo, FrameAddress, Module, Unwinder};
use std::sync::Arc;

use object::{Object, ObjectSection};

use ferroprof::foreign::MappedFile;

/// A section's bytes inside the mapping of its file (no copy of large `.text` sections).
#[derive(Clone)]
pub struct Part {
    map: Arc<memmap2::Mmap>,
    range: std::ops::Range<usize>,
}

impl std::ops::Deref for Part {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.map[self.range.clone()]
    }
}

/// Frames kept per stack; deeper stacks are cut at the root end.
pub const MAX_FRAMES: usize = 256;

/// The unwinder of one process's objects, rebuilt when its mappings change.
pub struct RemoteUnwinder {
    unwinder: UnwinderX86_64<Part>,
    cache: CacheX86_64,
    /// (bias, name) of the objects it was built from: the key to rebuild on.
    key: Vec<(u64, String)>,
    /// Each object's `.text` at its address in the process, by start.
    code: Vec<Code>,
}

/// How far above a frame's stack pointer its saved frame pointer is looked for.
const GUESS_WINDOW: u64 = 4096;

impl RemoteUnwinder {
    pub fn new(files: &[MappedFile]) -> RemoteUnwinder {
        let mut unwinder = UnwinderX86_64::new();
        let mut code = Vec::new();
        for f in files {
            if let Some((m, text)) = module(f) {
                unwinder.add_module(m);
                code.extend(text);
            }
        }
        code.sort_by_key(|c| c.0);
        RemoteUnwinder {
            unwinder,
            cache: CacheX86_64::new(),
            key: key(files),
            code,
        }
    }

    /// Whether `files` are the objects this unwinder knows.
    pub fn is_for(&self, files: &[MappedFile]) -> bool {
        self.key == key(files)
    }

    /// Unwinds from `ip`/`sp`/`bp` over `stack` (the bytes from `sp` up) into `out`: lookup
    /// addresses, leaf first (a return address minus one, so it names the call). `bp` 0: not
    /// known (a waiting thread, of which the kernel gives `sp` and `pc` only): a frame whose
    /// rule needs the frame pointer then gets it from the stack (see `guess_frame_pointer`).
    pub fn unwind(&mut self, ip: u64, sp: u64, bp: u64, stack: &[u8], out: &mut Vec<u64>) {
        out.clear();
        let end = sp.saturating_add(stack.len() as u64);
        let mut read = |addr: u64| -> Result<u64, ()> {
            if addr < sp || addr.checked_add(8).is_none_or(|e| e > end) {
                return Err(());
            }
            let off = (addr - sp) as usize;
            let word: [u8; 8] = stack[off..off + 8].try_into().map_err(|_| ())?;
            Ok(u64::from_ne_bytes(word))
        };
        let mut regs = UnwindRegsX86_64::new(ip, sp, bp);
        let mut frame = FrameAddress::from_instruction_pointer(ip);
        let mut may_guess = bp == 0;
        while out.len() < MAX_FRAMES {
            out.push(frame.address_for_lookup());
            let before = regs;
            let mut next = self
                .unwinder
                .unwind_frame(frame, &mut regs, &mut self.cache, &mut read);
            if !matches!(next, Ok(Some(_))) && may_guess {
                // Once per stack: the frame pointer the waiting thread's first frames left
                // untouched is its caller's, which no register read gave.
                may_guess = false;
                if let Some(fp) = self.guess_frame_pointer(&before, frame, &mut read) {
                    regs = before;
                    regs.set_bp(fp);
                    next = self
                        .unwinder
                        .unwind_frame(frame, &mut regs, &mut self.cache, &mut read);
                }
            }
            match next {
                Ok(Some(ret)) => match FrameAddress::from_return_address(ret) {
                    Some(f) => frame = f,
                    None => break,
                },
                Ok(None) | Err(_) => break,
            }
        }
    }

    /// Where `frame`'s saved frame pointer is, for a frame whose unwind rule needs it: the
    /// lowest slot above its stack pointer holding a frame pointer (0, or an address higher up
    /// the stack) followed by a return address, one that follows a call instruction and,
    /// when the call is direct, a call of code at or below `frame`'s address (its function).
    fn guess_frame_pointer(
        &self,
        regs: &UnwindRegsX86_64,
        frame: FrameAddress,
        read: &mut impl FnMut(u64) -> Result<u64, ()>,
    ) -> Option<u64> {
        let sp = regs.sp();
        let pc = frame.address_for_lookup();
        (0..GUESS_WINDOW / 8).map(|k| sp + 8 * k).find(|&slot| {
            let (Ok(saved), Ok(ret)) = (read(slot), read(slot + 8)) else {
                return false;
            };
            (saved == 0 || (saved > slot && saved - slot < (1 << 20)))
                && self.follows_call_to(ret, pc)
        })
    }

    /// Whether the instruction before `ret` is a call; for a direct call (`e8 rel32`), one of
    /// a function that can hold `callee_pc` (starting at or below it, within 1 MiB).
    fn follows_call_to(&self, ret: u64, callee_pc: u64) -> bool {
        let Some(bytes) = self.code_before(ret, 7) else {
            return false;
        };
        let b = |back: usize| bytes[7 - back];
        if b(5) == 0xe8 {
            let rel = i32::from_le_bytes([b(4), b(3), b(2), b(1)]);
            let target = ret.wrapping_add(rel as i64 as u64);
            return target <= callee_pc && callee_pc - target < (1 << 20);
        }
        // call r/m64: ff /2, with the ModRM (and SIB, displacement) forms of 2 to 7 bytes.
        (2..=7).any(|n| b(n) == 0xff && (b(n - 1) >> 3) & 7 == 2)
    }

    /// The `n` bytes of code before `addr`, when they lie in one object's `.text`.
    fn code_before(&self, addr: u64, n: usize) -> Option<[u8; 7]> {
        let first = addr.checked_sub(n as u64)?;
        let i = self.code.partition_point(|c| c.0 <= first);
        let (start, text) = self.code.get(i.checked_sub(1)?)?;
        let off = usize::try_from(addr.checked_sub(*start)?).ok()?;
        let bytes = text.get(off.checked_sub(n)?..off)?;
        let mut out = [0u8; 7];
        out[7 - n..].copy_from_slice(bytes);
        Some(out)
    }
}

fn key(files: &[MappedFile]) -> Vec<(u64, String)> {
    files.iter().map(|f| (f.bias, f.name.clone())).collect()
}

/// The framehop module of one mapped file: its unwind sections and text, at its bias.
/// An object's `.text` at its address in the process.
type Code = (u64, Part);

fn module(f: &MappedFile) -> Option<(Module<Part>, Option<Code>)> {
    let file = std::fs::File::open(&f.open_path).ok()?;
    // SAFETY: a read-only private mapping of a file we only read; kept by the module's
    // sections. A file truncated meanwhile can fault the reads, as for any mapped ELF file.
    let map = Arc::new(unsafe { memmap2::Mmap::map(&file) }.ok()?);
    let elf = object::File::parse(&map[..]).ok()?;
    let section = |name: &str| -> (Option<std::ops::Range<u64>>, Option<Part>) {
        let Some(s) = elf.section_by_name(name) else {
            return (None, None);
        };
        let svma = Some(s.address()..s.address() + s.size());
        // Bytes in the file (a NOBITS or compressed section has none to unwind with).
        let part = s.compressed_file_range().ok().and_then(|r| {
            let start = usize::try_from(r.offset).ok()?;
            let end = start.checked_add(usize::try_from(r.uncompressed_size).ok()?)?;
            (r.format == object::CompressionFormat::None && end <= map.len()).then(|| Part {
                map: map.clone(),
                range: start..end,
            })
        });
        (svma, part)
    };
    let (text_svma, text) = section(".text");
    let code = match (&text_svma, &text) {
        (Some(r), Some(t)) => Some((r.start.wrapping_add(f.bias), t.clone())),
        _ => None,
    };
    let (eh_frame_svma, eh_frame) = section(".eh_frame");
    let (eh_frame_hdr_svma, eh_frame_hdr) = section(".eh_frame_hdr");
    let (got_svma, _) = section(".got");
    let info = ExplicitModuleSectionInfo {
        base_svma: 0,
        text_svma,
        text,
        eh_frame_svma,
        eh_frame,
        eh_frame_hdr_svma,
        eh_frame_hdr,
        got_svma,
        stubs_svma: None,
        stub_helper_svma: None,
        unwind_info: None,
        debug_frame: None,
        text_segment_svma: None,
        text_segment: None,
    };
    let start = f.segments.iter().map(|s| s.0).min()?;
    let end = f.segments.iter().map(|s| s.1).max()?;
    Some((Module::new(f.name.clone(), start..end, f.bias, info), code))
}
