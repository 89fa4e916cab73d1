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
}

impl RemoteUnwinder {
    pub fn new(files: &[MappedFile]) -> RemoteUnwinder {
        let mut unwinder = UnwinderX86_64::new();
        for f in files {
            if let Some(m) = module(f) {
                unwinder.add_module(m);
            }
        }
        RemoteUnwinder {
            unwinder,
            cache: CacheX86_64::new(),
            key: key(files),
        }
    }

    /// Whether `files` are the objects this unwinder knows.
    pub fn is_for(&self, files: &[MappedFile]) -> bool {
        self.key == key(files)
    }

    /// Unwinds from `ip`/`sp`/`bp` over `stack` (the bytes from `sp` up) into `out`: lookup
    /// addresses, leaf first (a return address minus one, so it names the call).
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
        let regs = UnwindRegsX86_64::new(ip, sp, bp);
        let mut it = self
            .unwinder
            .iter_frames(ip, regs, &mut self.cache, &mut read);
        while out.len() < MAX_FRAMES {
            match it.next() {
                Ok(Some(f)) => out.push(lookup(f)),
                Ok(None) | Err(_) => break,
            }
        }
    }
}

fn lookup(f: FrameAddress) -> u64 {
    f.address_for_lookup()
}

fn key(files: &[MappedFile]) -> Vec<(u64, String)> {
    files.iter().map(|f| (f.bias, f.name.clone())).collect()
}

/// The framehop module of one mapped file: its unwind sections and text, at its bias.
fn module(f: &MappedFile) -> Option<Module<Part>> {
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
    Some(Module::new(f.name.clone(), start..end, f.bias, info))
}
