//! The ELF objects loaded in this process (executable, shared libraries, vDSO), as the dynamic
//! loader reports them through `dl_iterate_phdr`. Used to build the unwinder's module list and
//! to find the file to symbolize an address with. Never called from a signal handler.
//!
//! An object loaded with `dlopen` can be unmapped by `dlclose` at any moment, and another
//! object can be mapped where it was. Its memory is therefore only read inside the loader's
//! iteration callback (the loader holds its lock there, so nothing is unloaded meanwhile), and
//! the unwinder gets private copies of its unwind sections ([`UnwindCopy`]): a module snapshot
//! that lags behind an unload then describes the old object from memory that stays valid.

use std::ffi::CStr;
use std::path::PathBuf;
use std::sync::Arc;

/// One loaded ELF object.
#[derive(Debug, Clone)]
pub(crate) struct LoadedObject {
    /// File path; the executable's real path for the main program; `None` for the vDSO.
    pub path: Option<PathBuf>,
    /// Name the loader reports (for logs and the vDSO).
    pub name: String,
    /// Load bias: actual address = stated (ELF) address + `base`.
    pub base: u64,
    /// `PT_LOAD` segments as actual address ranges, with `p_flags`.
    pub segments: Vec<Segment>,
    /// `PT_GNU_EH_FRAME` (the `.eh_frame_hdr` section) as an actual address range.
    pub eh_frame_hdr: Option<(u64, u64)>,
    /// Private copies of the unwind sections, for objects that may be unloaded (all but the
    /// main program and the vDSO), when asked for ([`loaded_objects_for_unwind`]).
    pub unwind_copy: Option<Arc<UnwindCopy>>,
    /// The GNU build id, as the loaded image's notes carry it (empty: none, or not asked for:
    /// only [`loaded_objects`] reads it).
    pub build_id: Vec<u8>,
}

/// An object's `.eh_frame_hdr` and `.eh_frame`, copied while the object was surely mapped, with
/// the addresses they had in memory (the sections' encoded pointers are relative to those).
pub(crate) struct UnwindCopy {
    pub hdr: Box<[u8]>,
    pub hdr_addr: u64,
    pub eh_frame: Box<[u8]>,
    pub eh_frame_addr: u64,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Segment {
    pub start: u64,
    pub end: u64,
    pub flags: u32,
    /// Offset in the file of its first byte (`p_offset`).
    pub offset: u64,
}

impl LoadedObject {
    /// Whether `addr` is in one of the object's executable segments (past its first byte, so
    /// that `addr` can be a return address).
    pub fn executes(&self, addr: u64) -> bool {
        self.segments
            .iter()
            .any(|s| s.flags & libc::PF_X != 0 && s.start < addr && addr <= s.end)
    }

    /// Lowest to highest address covered by the object's segments.
    pub fn range(&self) -> Option<(u64, u64)> {
        let start = self.segments.iter().map(|s| s.start).min()?;
        let end = self.segments.iter().map(|s| s.end).max()?;
        Some((start, end))
    }

    /// Whether `addr` lies in one of the object's segments.
    pub fn contains(&self, addr: u64) -> bool {
        self.segments
            .iter()
            .any(|s| s.start <= addr && addr < s.end)
    }

    /// The segment containing `addr`.
    pub fn segment_of(&self, addr: u64) -> Option<Segment> {
        self.segments
            .iter()
            .copied()
            .find(|s| s.start <= addr && addr < s.end)
    }
}

struct Collect<'a> {
    out: Vec<LoadedObject>,
    adds: u64,
    subs: u64,
    /// Copy the unwind sections of objects that may be unloaded.
    copy: bool,
    /// Read the build ids.
    notes: bool,
    /// The previous list with its generation: copies reused when nothing was loaded or
    /// unloaded since.
    reuse: Option<(&'a [LoadedObject], (u64, u64))>,
}

unsafe extern "C" fn callback(
    info: *mut libc::dl_phdr_info,
    size: libc::size_t,
    data: *mut libc::c_void,
) -> libc::c_int {
    // SAFETY: `data` is the `&mut Collect` passed to dl_iterate_phdr below, alive for the whole
    // iteration; `info` is valid for this call and its phdr array has dlpi_phnum entries.
    unsafe {
        let c = &mut *(data as *mut Collect);
        let info = &*info;
        if size >= std::mem::size_of::<libc::dl_phdr_info>() {
            c.adds = info.dlpi_adds;
            c.subs = info.dlpi_subs;
        }
        let name = if info.dlpi_name.is_null() {
            String::new()
        } else {
            CStr::from_ptr(info.dlpi_name)
                .to_string_lossy()
                .into_owned()
        };
        let base = info.dlpi_addr;
        let mut segments = Vec::new();
        let mut eh_frame_hdr = None;
        let mut notes = Vec::new();
        let phdrs: &[libc::Elf64_Phdr] = if info.dlpi_phdr.is_null() {
            &[]
        } else {
            std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize)
        };
        for ph in phdrs {
            match ph.p_type {
                libc::PT_LOAD => segments.push(Segment {
                    start: base.wrapping_add(ph.p_vaddr),
                    end: base.wrapping_add(ph.p_vaddr).wrapping_add(ph.p_memsz),
                    flags: ph.p_flags,
                    offset: ph.p_offset,
                }),
                libc::PT_NOTE if c.notes => {
                    let start = base.wrapping_add(ph.p_vaddr);
                    notes.push((start, start.wrapping_add(ph.p_memsz), ph.p_align));
                }
                libc::PT_GNU_EH_FRAME => {
                    let start = base.wrapping_add(ph.p_vaddr);
                    eh_frame_hdr = Some((start, start.wrapping_add(ph.p_memsz)));
                }
                _ => {}
            }
        }
        if segments.is_empty() {
            return 0;
        }
        let first = c.out.is_empty();
        let vdso = name.starts_with("linux-vdso") || name.starts_with("linux-gate");
        let unwind_copy = if c.copy && !first && !vdso {
            copy_unwind_sections(&segments, eh_frame_hdr, reuse_candidate(c, base, &name))
        } else {
            None
        };
        let path = if first && name.is_empty() {
            // The first object is the main program; the loader gives it no name.
            std::fs::read_link("/proc/self/exe").ok()
        } else if name.is_empty() || vdso {
            None
        } else {
            Some(PathBuf::from(&name))
        };
        let build_id = notes
            .iter()
            .find_map(|&(start, end, align)| gnu_build_id(&segments, start, end, align))
            .unwrap_or_default();
        c.out.push(LoadedObject {
            path,
            name,
            base,
            segments,
            eh_frame_hdr,
            unwind_copy,
            build_id,
        });
        0
    }
}

/// `NT_GNU_BUILD_ID` in the notes at [start, end) of a loaded image. Runs inside the loader's
/// iteration callback (the object cannot be unloaded meanwhile); reads only within a readable
/// `PT_LOAD` segment.
fn gnu_build_id(segments: &[Segment], start: u64, end: u64, align: u64) -> Option<Vec<u8>> {
    const NT_GNU_BUILD_ID: u32 = 3;
    let readable = segments
        .iter()
        .any(|s| s.flags & libc::PF_R != 0 && s.start <= start && start <= end && end <= s.end);
    if !readable {
        return None;
    }
    // SAFETY: [start, end) lies within a readable segment of an object the loader cannot unload
    // while this callback runs.
    let notes = unsafe { std::slice::from_raw_parts(start as *const u8, (end - start) as usize) };
    // Name and descriptor are padded to the segment's alignment (4, or 8 for some GNU notes).
    let pad = |n: usize| {
        if align == 8 {
            n.next_multiple_of(8)
        } else {
            n.next_multiple_of(4)
        }
    };
    let word = |at: usize| -> Option<u32> {
        Some(u32::from_ne_bytes(notes.get(at..at + 4)?.try_into().ok()?))
    };
    let mut at = 0usize;
    while at + 12 <= notes.len() {
        let (namesz, descsz, kind) = (word(at)? as usize, word(at + 4)? as usize, word(at + 8)?);
        let name_at = at + 12;
        let desc_at = name_at.checked_add(pad(namesz))?;
        let next = desc_at.checked_add(pad(descsz))?;
        let desc = notes.get(desc_at..desc_at.checked_add(descsz)?)?;
        if kind == NT_GNU_BUILD_ID && notes.get(name_at..name_at + namesz) == Some(&b"GNU\0"[..]) {
            return (!desc.is_empty()).then(|| desc.to_vec());
        }
        at = next;
    }
    None
}

/// The copy the previous list made of the object at `base` with this name, if any, and
/// whether nothing was loaded or unloaded since (the loader's counters, as this very iteration
/// reports them): then it is the same object.
fn reuse_candidate(c: &Collect, base: u64, name: &str) -> Option<(Arc<UnwindCopy>, bool)> {
    let (prev, gen) = c.reuse?;
    let o = prev.iter().find(|o| o.base == base && o.name == name)?;
    Some((o.unwind_copy.clone()?, gen == (c.adds, c.subs)))
}

/// Copies an object's unwind sections, or returns `prev` when it holds the same bytes (an
/// object that stayed loaded while others came and went: no new allocation). Runs inside the
/// loader's iteration callback, where the object cannot be unloaded; reads only within its
/// `PT_LOAD` segments.
fn copy_unwind_sections(
    segments: &[Segment],
    eh_frame_hdr: Option<(u64, u64)>,
    prev: Option<(Arc<UnwindCopy>, bool)>,
) -> Option<Arc<UnwindCopy>> {
    if let Some((prev, true)) = prev {
        return Some(prev);
    }
    let (hdr_start, hdr_end) = eh_frame_hdr?;
    let seg_of = |a: u64| segments.iter().find(|s| s.start <= a && a < s.end);
    let hdr_seg = seg_of(hdr_start)?;
    if hdr_end > hdr_seg.end || hdr_end <= hdr_start {
        return None;
    }
    // SAFETY: the range lies within a loaded segment of an object the loader cannot unload
    // while this callback runs.
    let hdr = unsafe {
        std::slice::from_raw_parts(hdr_start as *const u8, (hdr_end - hdr_start) as usize)
    };
    let eh_frame_addr = eh_frame_address(hdr, hdr_start)?;
    let seg = seg_of(eh_frame_addr)?;
    let len = eh_frame_len(eh_frame_addr, seg.end);
    // SAFETY: as above: [eh_frame_addr, + len) ends within the segment.
    let eh_frame = unsafe { std::slice::from_raw_parts(eh_frame_addr as *const u8, len) };
    if let Some((prev, _)) = prev {
        if prev.hdr_addr == hdr_start
            && prev.eh_frame_addr == eh_frame_addr
            && *prev.hdr == *hdr
            && *prev.eh_frame == *eh_frame
        {
            return Some(prev);
        }
    }
    Some(Arc::new(UnwindCopy {
        hdr: hdr.into(),
        hdr_addr: hdr_start,
        eh_frame: eh_frame.into(),
        eh_frame_addr,
    }))
}

impl std::fmt::Debug for UnwindCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "UnwindCopy {{ hdr: {:#x}+{}, eh_frame: {:#x}+{} }}",
            self.hdr_addr,
            self.hdr.len(),
            self.eh_frame_addr,
            self.eh_frame.len()
        )
    }
}

/// Length of the `.eh_frame` section at `start`: its entries (CIEs and FDEs, each led by its
/// length) up to the zero terminator, or to `seg_end` when there is none.
fn eh_frame_len(start: u64, seg_end: u64) -> usize {
    let mut p = start;
    while p.saturating_add(4) <= seg_end {
        // SAFETY: [p, p+4) lies within the mapped segment (see the caller).
        let len = unsafe { std::ptr::read_unaligned(p as *const u32) };
        if len == 0 {
            p += 4;
            break;
        }
        let (head, body) = if len == u32::MAX {
            if p.saturating_add(12) > seg_end {
                break;
            }
            // SAFETY: [p+4, p+12) lies within the segment, checked above.
            (12, unsafe {
                std::ptr::read_unaligned((p + 4) as *const u64)
            })
        } else {
            (4, u64::from(len))
        };
        match p.checked_add(head).and_then(|q| q.checked_add(body)) {
            Some(next) if next <= seg_end => p = next,
            _ => {
                p = seg_end;
                break;
            }
        }
    }
    (p.min(seg_end) - start) as usize
}

/// Lists the loaded objects, main program first, with their build ids.
pub(crate) fn loaded_objects() -> Vec<LoadedObject> {
    iterate(false, true, None).0
}

/// Lists the loaded objects with private copies of the unwind sections of those that may be
/// unloaded, and the loader's (loads, unloads) counters that go with the list. Copies of
/// `reuse` (a previous list and its counters) are shared when nothing changed since.
pub(crate) fn loaded_objects_for_unwind(
    reuse: Option<(&[LoadedObject], (u64, u64))>,
) -> (Vec<LoadedObject>, (u64, u64)) {
    iterate(true, false, reuse)
}

fn iterate(
    copy: bool,
    notes: bool,
    reuse: Option<(&[LoadedObject], (u64, u64))>,
) -> (Vec<LoadedObject>, (u64, u64)) {
    let mut c = Collect {
        out: Vec::new(),
        adds: 0,
        subs: 0,
        copy,
        notes,
        reuse,
    };
    // SAFETY: the callback only touches `c` through the pointer we pass and the loader's info.
    crate::forkgate::outside_fork_walk_loader(|| unsafe {
        libc::dl_iterate_phdr(Some(callback), &mut c as *mut Collect as *mut libc::c_void);
    });
    let gen = (c.adds, c.subs);
    (c.out, gen)
}

/// The loader's (loads, unloads) counters: cheap to read, change whenever an object is added or
/// removed, so the module list is only rebuilt when it changed.
pub(crate) fn objects_generation() -> (u64, u64) {
    unsafe extern "C" fn first_only(
        info: *mut libc::dl_phdr_info,
        size: libc::size_t,
        data: *mut libc::c_void,
    ) -> libc::c_int {
        // SAFETY: `data` points to the (u64, u64) below; `info` is valid for this call.
        unsafe {
            if size >= std::mem::size_of::<libc::dl_phdr_info>() {
                let out = &mut *(data as *mut (u64, u64));
                *out = ((*info).dlpi_adds, (*info).dlpi_subs);
            }
        }
        1 // stop after the first object
    }
    let mut out = (0u64, 0u64);
    // SAFETY: as above.
    crate::forkgate::outside_fork_walk_loader(|| unsafe {
        libc::dl_iterate_phdr(
            Some(first_only),
            &mut out as *mut (u64, u64) as *mut libc::c_void,
        );
    });
    out
}

/// Runs `f` inside a walk of the loader's list, on its first object (tests: fork meanwhile).
pub(crate) fn walk_with(f: impl FnOnce()) {
    unsafe extern "C" fn call_once(
        _info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        data: *mut libc::c_void,
    ) -> libc::c_int {
        // SAFETY: `data` is the `&mut &mut dyn FnMut()` passed below, alive for the call.
        let f = unsafe { &mut *(data as *mut &mut dyn FnMut()) };
        f();
        1
    }
    let mut once = Some(f);
    let mut run = || {
        if let Some(f) = once.take() {
            f();
        }
    };
    let mut dynf: &mut dyn FnMut() = &mut run;
    // SAFETY: the callback only calls the closure behind the pointer we pass.
    crate::forkgate::outside_fork_walk_loader(|| unsafe {
        libc::dl_iterate_phdr(
            Some(call_once),
            &mut dynf as *mut &mut dyn FnMut() as *mut libc::c_void,
        );
    });
}

/// Decodes `eh_frame_ptr` from an `.eh_frame_hdr` mapped at `hdr_addr`.
pub(crate) fn eh_frame_address(hdr: &[u8], hdr_addr: u64) -> Option<u64> {
    if hdr.len() < 8 || hdr[0] != 1 {
        return None;
    }
    let enc = hdr[1];
    let field = &hdr[4..];
    let field_addr = hdr_addr + 4;
    let value: i128 = match enc & 0x0f {
        0x00 => u64::from_le_bytes(field.get(..8)?.try_into().ok()?) as i128,
        0x02 => u16::from_le_bytes(field.get(..2)?.try_into().ok()?) as i128,
        0x03 => u32::from_le_bytes(field.get(..4)?.try_into().ok()?) as i128,
        0x04 => u64::from_le_bytes(field.get(..8)?.try_into().ok()?) as i128,
        0x0a => i16::from_le_bytes(field.get(..2)?.try_into().ok()?) as i128,
        0x0b => i32::from_le_bytes(field.get(..4)?.try_into().ok()?) as i128,
        0x0c => i64::from_le_bytes(field.get(..8)?.try_into().ok()?) as i128,
        _ => return None,
    };
    let base: i128 = match enc & 0x70 {
        0x00 => 0,
        0x10 => field_addr as i128,
        0x30 => hdr_addr as i128,
        _ => return None,
    };
    u64::try_from(base + value).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_the_executable_first_with_unwind_info() {
        let objs = loaded_objects();
        assert!(!objs.is_empty());
        let exe = &objs[0];
        assert!(exe.path.is_some());
        assert!(exe.eh_frame_hdr.is_some());
        let f = lists_the_executable_first_with_unwind_info as *const () as usize as u64;
        assert!(exe.contains(f), "test function {f:#x} not in {exe:?}");
        let (adds, _) = objects_generation();
        assert!(adds >= 1);
    }

    /// The build id read from memory is the one in the files, for the program and libc.
    #[test]
    fn reads_build_ids_from_the_loaded_images() {
        use object::Object;
        let objs = loaded_objects();
        let libc_obj = objs.iter().find(|o| o.name.contains("libc.so")).unwrap();
        for o in [&objs[0], libc_obj] {
            let path = o.path.as_ref().unwrap();
            let data = std::fs::read(path).unwrap();
            let file = object::File::parse(&*data).unwrap();
            let want = file.build_id().unwrap().expect("the file has a build id");
            assert_eq!(o.build_id, want, "{}", path.display());
        }
        // The vDSO's too (the kernel builds it with one).
        let vdso = objs.iter().find(|o| o.name.contains("vdso")).unwrap();
        assert!(vdso.build_id.len() >= 8, "{vdso:?}");
        // The unwinder's list does not read them.
        assert!(loaded_objects_for_unwind(None).0[0].build_id.is_empty());
    }

    #[test]
    fn copies_the_unwind_sections_of_shared_libraries() {
        let (objs, gen) = loaded_objects_for_unwind(None);
        assert!(
            objs[0].unwind_copy.is_none(),
            "the executable is used in place"
        );
        let libc_obj = objs
            .iter()
            .find(|o| o.name.contains("libc.so"))
            .expect("libc is loaded");
        let copy = libc_obj
            .unwind_copy
            .as_ref()
            .expect("libc's sections copied");
        let (hdr_start, hdr_end) = libc_obj.eh_frame_hdr.unwrap();
        assert_eq!(copy.hdr.len() as u64, hdr_end - hdr_start);
        // The FDE table's entries point into the copied .eh_frame: it covers the section.
        assert!(copy.eh_frame.len() > 1024, "{}", copy.eh_frame.len());
        // The next list shares the copies, whether or not other objects came and went.
        for g in [gen, (u64::MAX, 0)] {
            let (again, _) = loaded_objects_for_unwind(Some((&objs, g)));
            let c2 = again
                .iter()
                .find(|o| o.name == libc_obj.name)
                .and_then(|o| o.unwind_copy.clone())
                .unwrap();
            assert!(Arc::ptr_eq(copy, &c2));
        }
    }
}
