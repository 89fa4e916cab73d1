//! The ELF objects loaded in this process (executable, shared libraries, vDSO), as the dynamic
//! loader reports them through `dl_iterate_phdr`. Used to build the unwinder's module list and
//! to find the file to symbolize an address with. Never called from a signal handler.

use std::ffi::CStr;
use std::path::PathBuf;

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
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Segment {
    pub start: u64,
    pub end: u64,
    pub flags: u32,
}

impl LoadedObject {
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

struct Collect {
    out: Vec<LoadedObject>,
    adds: u64,
    subs: u64,
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
                }),
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
        let path = if first && name.is_empty() {
            // The first object is the main program; the loader gives it no name.
            std::fs::read_link("/proc/self/exe").ok()
        } else if name.is_empty()
            || name.starts_with("linux-vdso")
            || name.starts_with("linux-gate")
        {
            None
        } else {
            Some(PathBuf::from(&name))
        };
        c.out.push(LoadedObject {
            path,
            name,
            base,
            segments,
            eh_frame_hdr,
        });
        0
    }
}

/// Lists the loaded objects, main program first.
pub(crate) fn loaded_objects() -> Vec<LoadedObject> {
    let mut c = Collect {
        out: Vec::new(),
        adds: 0,
        subs: 0,
    };
    // SAFETY: the callback only touches `c` through the pointer we pass and the loader's info.
    unsafe {
        libc::dl_iterate_phdr(Some(callback), &mut c as *mut Collect as *mut libc::c_void);
    }
    c.out
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
    unsafe {
        libc::dl_iterate_phdr(
            Some(first_only),
            &mut out as *mut (u64, u64) as *mut libc::c_void,
        );
    }
    out
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
}
