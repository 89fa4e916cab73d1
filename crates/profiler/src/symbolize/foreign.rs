//! The ELF objects mapped in another process, read from its `/proc/PID/maps` and from the files
//! themselves: what `ferroprof record -p` symbolizes and unwinds a running process with.
//!
//! Nothing is read from the process's memory. Each file is opened through
//! `/proc/PID/map_files/START-END` (the very file mapped, also when it was deleted or replaced
//! since, or lies in another mount namespace), else through `/proc/PID/root/PATH`, and kept
//! open: it is read again through `/proc/self/fd/N`, also after the process ended.

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::Arc;

use object::{Object, ObjectSegment};

use crate::modules::{LoadedObject, Segment};

/// Where the files of another process's objects are opened from (they are kept open).
pub const OPEN_DIR: &str = "/proc/self/fd/";

/// One mapping line of `/proc/PID/maps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapsLine {
    /// First address.
    pub start: u64,
    /// One past the last address.
    pub end: u64,
    /// `rwxp` as the kernel shows it.
    pub perms: String,
    /// Offset in the file of the first byte.
    pub offset: u64,
    /// The path as the kernel shows it (` (deleted)` included), or a pseudo-name (`[stack]`).
    pub path: String,
}

/// Parses `/proc/PID/maps` text; lines that do not parse are skipped.
pub fn parse_maps(text: &str) -> Vec<MapsLine> {
    text.lines()
        .filter_map(|line| {
            let mut f = line.splitn(6, ' ');
            let range = f.next()?;
            let perms = f.next()?.to_owned();
            let offset = u64::from_str_radix(f.next()?, 16).ok()?;
            let _dev = f.next()?;
            let _inode = f.next()?;
            let path = f.next().unwrap_or("").trim_start().to_owned();
            let (s, e) = range.split_once('-')?;
            Some(MapsLine {
                start: u64::from_str_radix(s, 16).ok()?,
                end: u64::from_str_radix(e, 16).ok()?,
                perms,
                offset,
                path,
            })
        })
        .collect()
}

/// A file mapped in process `pid`, opened from outside it: its openable path and the name to
/// show (the path in the process's view).
#[derive(Debug, Clone)]
pub struct MappedFile {
    /// `/proc/self/fd/N` of `file`.
    pub open_path: PathBuf,
    /// The file, kept open.
    pub file: Arc<std::fs::File>,
    /// The path in the process's view (as its maps show it).
    pub name: String,
    /// The load bias: address in the process = address in the ELF file + `bias`.
    pub bias: u64,
    /// `PT_LOAD` segments as (start, end, `p_flags`, `p_offset`).
    pub segments: Vec<(u64, u64, u32, u64)>,
    /// The GNU build id (empty: none).
    pub build_id: Vec<u8>,
}

/// The ELF files with an executable mapping in process `pid`, by their name in its maps.
pub fn mapped_files(pid: i32) -> std::io::Result<Vec<MappedFile>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    let lines = parse_maps(&text);
    // Every mapping of each file (by name), in address order: the executable one says the
    // file is code; any of them (offset and start) gives the bias.
    let mut by_name: BTreeMap<&str, Vec<&MapsLine>> = BTreeMap::new();
    for l in &lines {
        if l.path.starts_with('/') {
            by_name.entry(l.path.as_str()).or_default().push(l);
        }
    }
    let mut out = Vec::new();
    if let (Some(line), Some(file)) = (lines.iter().find(|l| l.path == "[vdso]"), own_vdso()) {
        out.extend(describe(file, "[vdso]", &[line]));
    }
    for (name, maps) in by_name {
        // A file loaded twice (`dlmopen` into another namespace) is two objects: a mapping of
        // its start (offset 0) begins each.
        let mut loads: Vec<Vec<&MapsLine>> = Vec::new();
        for m in maps {
            match loads.last_mut() {
                Some(load) if m.offset != 0 => load.push(m),
                _ => loads.push(vec![m]),
            }
        }
        for load in loads {
            if !load.iter().any(|m| m.perms.contains('x')) {
                continue;
            }
            if let Some(f) = open_mapped(pid, name, &load) {
                out.push(f);
            }
        }
    }
    Ok(out)
}

fn open_mapped(pid: i32, name: &str, maps: &[&MapsLine]) -> Option<MappedFile> {
    let first = maps[0];
    let candidates = [
        PathBuf::from(format!(
            "/proc/{pid}/map_files/{:x}-{:x}",
            first.start, first.end
        )),
        PathBuf::from(format!(
            "/proc/{pid}/root{}",
            name.strip_suffix(" (deleted)").unwrap_or(name)
        )),
    ];
    candidates.iter().find_map(|path| {
        let file = std::fs::File::open(path).ok()?;
        describe(Arc::new(file), name, maps)
    })
}

/// This process's vDSO image in a memory file, made once: the kernel maps the same image into
/// every process (of one architecture), so another process's `[vdso]` is unwound and named
/// with it, at that process's address.
fn own_vdso() -> Option<Arc<std::fs::File>> {
    static VDSO: std::sync::OnceLock<Option<Arc<std::fs::File>>> = std::sync::OnceLock::new();
    VDSO.get_or_init(|| {
        let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
        let line = parse_maps(&maps).into_iter().find(|l| l.path == "[vdso]")?;
        let len = usize::try_from(line.end - line.start).ok()?;
        // SAFETY: the vDSO's pages are mapped readable for the life of the process.
        let image = unsafe { std::slice::from_raw_parts(line.start as *const u8, len) };
        // SAFETY: a NUL-terminated name and valid flags; the descriptor is owned below.
        let fd = unsafe { libc::memfd_create(c"ferroprof-vdso".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return None;
        }
        // SAFETY: a fresh descriptor we own.
        let mut file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
        std::io::Write::write_all(&mut file, image).ok()?;
        Some(Arc::new(file))
    })
    .clone()
}

/// The mapped file `file` of the load `maps` (its mappings, in address order), named `name`.
fn describe(file: Arc<std::fs::File>, name: &str, maps: &[&MapsLine]) -> Option<MappedFile> {
    {
        // SAFETY: a read-only private mapping of a file we only read; a file truncated
        // meanwhile can fault the reads (as for any mapped ELF file the symbolizer reads).
        let map = (unsafe { memmap2::Mmap::map(&*file) }).ok()?;
        let elf = object::File::parse(&map[..]).ok()?;
        let loads: Vec<(u64, u64, u64, u64, u32)> = elf
            .segments()
            .map(|s| {
                let (offset, filesz) = s.file_range();
                let flags = match s.flags() {
                    object::SegmentFlags::Elf { p_flags } => p_flags,
                    _ => 0,
                };
                (s.address(), s.size(), offset, filesz, flags)
            })
            .collect();
        // The bias from the mapping of a segment's start: the segment holding the mapped
        // offset, at the mapped address.
        let bias = maps.iter().find_map(|m| {
            loads
                .iter()
                .find(|&&(_, _, off, filesz, _)| {
                    off & !0xfff <= m.offset && m.offset < off + filesz.max(1)
                })
                .map(|&(vaddr, _, off, _, _)| {
                    m.start
                        .wrapping_sub(m.offset)
                        .wrapping_sub(vaddr.wrapping_sub(off))
                })
        })?;
        let segments = loads
            .iter()
            .map(|&(vaddr, size, off, _, flags)| {
                (
                    vaddr.wrapping_add(bias),
                    vaddr.wrapping_add(bias).wrapping_add(size),
                    flags,
                    off,
                )
            })
            .collect();
        let build_id = elf.build_id().ok().flatten().unwrap_or_default().to_vec();
        drop(elf);
        drop(map);
        Some(MappedFile {
            open_path: PathBuf::from(format!("{OPEN_DIR}{}", file.as_raw_fd())),
            file,
            name: name.to_owned(),
            bias,
            segments,
            build_id,
        })
    }
}

impl MappedFile {
    pub(crate) fn to_loaded(&self) -> LoadedObject {
        LoadedObject {
            path: Some(self.open_path.clone()),
            name: self.name.clone(),
            base: self.bias,
            segments: self
                .segments
                .iter()
                .map(|&(start, end, flags, offset)| Segment {
                    start,
                    end,
                    flags,
                    offset,
                })
                .collect(),
            eh_frame_hdr: None,
            unwind_copy: None,
            build_id: self.build_id.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines_parse_with_and_without_paths() {
        let text = "55d0c0a00000-55d0c0a28000 r--p 00000000 08:01 1311 /usr/bin/xz\n\
                    55d0c0a28000-55d0c0a4f000 r-xp 00028000 08:01 1311 /usr/bin/xz (deleted)\n\
                    7ffd1c7e0000-7ffd1c801000 rw-p 00000000 00:00 0                          [stack]\n\
                    7f0000000000-7f0000001000 rw-p 00000000 00:00 0\n\
                    garbage\n";
        let l = parse_maps(text);
        assert_eq!(l.len(), 4);
        assert_eq!(l[1].path, "/usr/bin/xz (deleted)");
        assert_eq!(l[1].offset, 0x28000);
        assert_eq!(l[1].perms, "r-xp");
        assert_eq!(l[2].path, "[stack]");
        assert_eq!(l[3].path, "");
    }

    /// This test process's own objects, read from outside as another process's are, have the
    /// biases and segments the loader reports.
    #[test]
    fn own_objects_read_from_maps_match_the_loaders() {
        let pid = std::process::id() as i32;
        let files = mapped_files(pid).unwrap();
        let loader = crate::modules::loaded_objects();
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let mine = files
            .iter()
            .find(|f| std::path::Path::new(&f.name) == exe)
            .expect("the test binary among the mapped files");
        let theirs = loader
            .iter()
            .find(|o| o.path.as_deref() == Some(exe.as_path()))
            .expect("the test binary among the loaded objects");
        assert_eq!(mine.bias, theirs.base);
        // libc, found by address (a test may have loaded another copy in another namespace,
        // and the loader and the maps may spell its path differently).
        let theirs = loader
            .iter()
            .find(|o| o.name.contains("libc.so"))
            .expect("libc among the loaded objects");
        let at = theirs.segments[0].start;
        let libc = files
            .iter()
            .find(|f| f.segments.iter().any(|s| s.0 <= at && at < s.1))
            .expect("libc's first segment among the mapped files");
        assert_eq!(libc.bias, theirs.base);
        assert_eq!(libc.build_id, theirs.build_id);
    }
}
