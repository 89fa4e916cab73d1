//! One object's debug information: which file holds it (the object, a separate debug file, the
//! vDSO's image), its sections (inflated when compressed, cached on disk), the index of its
//! units, and the lookups of addresses in it.

use super::*;

pub(super) struct ObjectDebug {
    pub(super) obj: LoadedObject,
    /// `None` = not loaded yet; `Some(None)` = nothing usable.
    pub(super) debug: Option<Option<DebugInfo>>,
}

/// One object's ELF file and DWARF sections, for one pass. Field order matters: the borrowers
/// (`elf`, `sections`) are declared, hence dropped, before the memory they borrow (`_owned`,
/// `maps`).
pub(super) struct DebugInfo {
    pub(super) elf: object::File<'static, &'static [u8]>,
    /// The DWARF sections (empty when the object has none).
    pub(super) sections: Vec<(gimli::SectionId, &'static [u8])>,
    /// Compressed sections of which only the parts a pass needs are inflated (see `inflate`);
    /// their entries in `sections` are empty until then.
    pub(super) lazy: Vec<(gimli::SectionId, object::CompressedData<'static>)>,
    /// The units `lazy` sections were last inflated for (`Some(None)`: all of them).
    pub(super) inflated_for: Option<Option<Vec<usize>>>,
    pub(super) endian: gimli::RunTimeEndian,
    /// Hex build id of the file holding the DWARF, and where its inflated sections are cached
    /// (see `disk_cache`; no cache without either).
    pub(super) build_id: Option<String>,
    pub(super) cache_dir: Option<Arc<Path>>,
    /// Bytes of new unit digests a pass may hold (`DIGEST_PASS_BYTES`).
    pub(super) digest_budget: usize,
    /// Function symbols (address, name), sorted by address; read when a frame first needs
    /// one.
    /// (address, size, name); see `symbols`.
    pub(super) symbols: std::sync::OnceLock<Vec<(u64, u64, &'static str)>>,
    pub(super) _owned: Vec<Box<[u8]>>,
    pub(super) maps: Vec<Mmap>,
}

/// Where an object's compilation units are: built once per object (walking every unit's
/// header and root entry, or from `.debug_aranges`), kept across passes, a few bytes per unit
/// and code range.
pub(super) struct UnitIndex {
    /// (start, end, index into `units`), sorted by start, adjacent ranges of a unit merged.
    pub(super) ranges: Vec<(u64, u64, u32)>,
    pub(super) units: Vec<UnitSpan>,
    /// Read from `.debug_aranges` without inflating the compressed sections: the units' starts
    /// only (their lengths, abbreviations and line programs are read from their headers by the
    /// pass that inflates them, see `DebugInfo::inflate_units`).
    pub(super) from_aranges: bool,
    /// From `.debug_aranges` listing (nearly) all of the object's code: what it leaves out is
    /// code without debug info (`_start`, a C `main` shim, start files), not worth the full
    /// index.
    pub(super) complete: bool,
}

#[derive(Clone, Copy)]
pub(super) struct UnitSpan {
    /// The unit's bytes in `.debug_info`, header included.
    pub(super) offset: usize,
    pub(super) len: usize,
    /// Where its abbreviations and its line program start.
    pub(super) abbrev: usize,
    pub(super) line: Option<usize>,
}

impl UnitIndex {
    pub(super) fn to_heap(&self) -> UnitIndex {
        UnitIndex {
            ranges: self.ranges.to_vec(),
            units: self.units.to_vec(),
            from_aranges: self.from_aranges,
            complete: self.complete,
        }
    }

    /// The byte ranges of section `id` that the units starting at `units` read.
    pub(super) fn parts(
        &self,
        id: gimli::SectionId,
        units: &[usize],
        size: usize,
    ) -> Vec<(usize, usize)> {
        // A table or program runs to the next one's start (or the section's end).
        let until_next = |starts: &mut Vec<usize>, from: usize| {
            starts.sort_unstable();
            starts.dedup();
            let i = starts.partition_point(|&s| s <= from);
            (from, starts.get(i).copied().unwrap_or(size).min(size))
        };
        let spans = units.iter().filter_map(|&o| self.unit_at(o));
        let mut out: Vec<(usize, usize)> = match id {
            gimli::SectionId::DebugInfo => spans.map(|u| (u.offset, u.offset + u.len)).collect(),
            gimli::SectionId::DebugAbbrev => {
                let mut starts: Vec<usize> = self.units.iter().map(|u| u.abbrev).collect();
                spans.map(|u| until_next(&mut starts, u.abbrev)).collect()
            }
            gimli::SectionId::DebugLine => {
                let mut starts: Vec<usize> = self.units.iter().filter_map(|u| u.line).collect();
                spans
                    .filter_map(|u| Some(until_next(&mut starts, u.line?)))
                    .collect()
            }
            _ => vec![(0, size)],
        };
        out.sort_unstable();
        out
    }

    /// The unit holding `.debug_info` offset `offset` (`None` from an index read from
    /// `.debug_aranges`, which knows no unit's length: a reference into another unit then reads
    /// as missing, as into a unit not inflated).
    pub(super) fn unit_at(&self, offset: usize) -> Option<UnitSpan> {
        let i = self.units.partition_point(|u| u.offset <= offset);
        let u = *self.units.get(i.checked_sub(1)?)?;
        (offset < u.offset + u.len).then_some(u)
    }

    pub(super) fn unit_of(&self, probe: u64) -> Option<UnitSpan> {
        let i = self.ranges.partition_point(|r| r.0 <= probe);
        let &(_, end, u) = self.ranges.get(i.checked_sub(1)?)?;
        (probe < end).then(|| self.units[u as usize])
    }
}

#[derive(Debug)]
pub(super) struct LoadError;

/// Sections of which a pass inflates only the parts its units need, when zlib-compressed: a
/// unit's entries, its abbreviations, its line program. (libc's Debian debug file holds 8 MB of
/// them inflated.)
pub(super) const SPARSE: [gimli::SectionId; 3] = [
    gimli::SectionId::DebugInfo,
    gimli::SectionId::DebugAbbrev,
    gimli::SectionId::DebugLine,
];

/// The DWARF sections `dwarf_walk` and the unit index read.
pub(super) const READ_SECTIONS: [gimli::SectionId; 10] = [
    gimli::SectionId::DebugAranges,
    gimli::SectionId::DebugInfo,
    gimli::SectionId::DebugAbbrev,
    gimli::SectionId::DebugLine,
    gimli::SectionId::DebugStr,
    gimli::SectionId::DebugLineStr,
    gimli::SectionId::DebugStrOffsets,
    gimli::SectionId::DebugAddr,
    gimli::SectionId::DebugRanges,
    gimli::SectionId::DebugRngLists,
];

impl DebugInfo {
    /// Where the function holding `probe` starts, from the binary-search table of
    /// `.eh_frame_hdr` (every function with unwind info has an entry, stripped objects
    /// included). Only the encodings linkers write (4-byte pointers, the table relative to the
    /// section) are read; anything else is `None`.
    pub(super) fn function_start(&self, probe: u64) -> Option<u64> {
        let section = self.elf.section_by_name(".eh_frame_hdr")?;
        crate::unwind::hdr_function_start(section.data().ok()?, section.address(), probe)
    }

    pub(super) fn load(obj: &LoadedObject) -> Result<DebugInfo, LoadError> {
        let mut maps = Vec::new();
        let mut owned: Vec<Box<[u8]>> = Vec::new();
        let data: &'static [u8] = match &obj.path {
            Some(path) => {
                let m = map_file(path).ok_or(LoadError)?;
                // SAFETY: the mapping is kept in `maps`, dropped after every borrower (see the
                // struct's field order); a Mmap's bytes do not move when the Mmap value moves.
                let d = unsafe { extend(&m[..]) };
                maps.push(m);
                d
            }
            None => vdso_image(obj).ok_or(LoadError)?,
        };
        let elf = object::File::parse(data).map_err(|_| LoadError)?;
        let mut dwarf_file = None;
        if elf.section_by_name(".debug_info").is_none() {
            if let Some(p) = separate_debug_file(&elf, obj.path.as_deref()) {
                if let Some(m) = map_file(&p) {
                    // SAFETY: as above, kept in `maps`.
                    let d = unsafe { extend(&m[..]) };
                    maps.push(m);
                    dwarf_file = object::File::parse(d).ok();
                }
            }
        }
        let src = dwarf_file.as_ref().unwrap_or(&elf);
        let build_id = src.build_id().ok().flatten().map(hex);
        let endian = if src.is_little_endian() {
            gimli::RunTimeEndian::Little
        } else {
            gimli::RunTimeEndian::Big
        };
        let mut sections = Vec::new();
        let mut lazy = Vec::new();
        if src.section_by_name(".debug_info").is_some() {
            // The sections symbolization reads, found once (compressed ones inflated once: a
            // distribution's separate debug files are compressed, and location lists or
            // address tables would only cost inflating).
            let _ = gimli::DwarfSections::load(|id| -> Result<(), ()> {
                if !READ_SECTIONS.contains(&id) {
                    return Ok(());
                }
                if let Some(section) = src.section_by_name(id.name()) {
                    if let Ok(c) = section.compressed_data() {
                        if c.format == object::CompressionFormat::Zlib && SPARSE.contains(&id) {
                            // Inflated when a pass knows which units it needs.
                            lazy.push((id, c));
                            sections.push((id, &[][..]));
                            return Ok(());
                        }
                    }
                    let data: &'static [u8] = match section.uncompressed_data() {
                        Ok(Cow::Borrowed(b)) => b,
                        Ok(Cow::Owned(v)) => {
                            let b = v.into_boxed_slice();
                            // SAFETY: the box is kept in `_owned` (dropped after every
                            // borrower), and its heap bytes do not move when the box moves.
                            let r = unsafe { extend(&b[..]) };
                            owned.push(b);
                            r
                        }
                        Err(_) => &[],
                    };
                    sections.push((id, data));
                }
                Ok(())
            });
        }
        if sections.is_empty() && elf.symbol_table().or(elf.dynamic_symbol_table()).is_none() {
            return Err(LoadError);
        }
        Ok(DebugInfo {
            elf,
            sections,
            lazy,
            inflated_for: None,
            endian,
            build_id,
            cache_dir: None,
            digest_budget: DIGEST_PASS_BYTES,
            symbols: std::sync::OnceLock::new(),
            _owned: owned,
            maps,
        })
    }

    pub(super) fn section(&self, id: gimli::SectionId) -> &'static [u8] {
        self.sections
            .iter()
            .find(|(s, _)| *s == id)
            .map_or(&[], |(_, d)| *d)
    }

    pub(super) fn dwarf(&self) -> gimli::Dwarf<Reader> {
        let endian = self.endian;
        let loaded = gimli::Dwarf::load(|id| -> Result<Reader, ()> {
            Ok(gimli::EndianSlice::new(self.section(id), endian))
        });
        loaded.unwrap_or_default()
    }

    /// Inflates the lazy sections: with an index, only the bytes of the units starting at
    /// `units` (`.debug_info` offsets) and of their abbreviations and line programs, in buffers
    /// of the sections' full size of which only those parts are ever written (untouched pages
    /// cost nothing); without, whole. Units of other units' names (`DW_FORM_ref_addr`) are not
    /// inflated then: such a name reads as missing and the symbol table names the frame.
    pub(super) fn inflate(&mut self, index: Option<&UnitIndex>, units: &[usize]) {
        if self.lazy.is_empty() {
            return;
        }
        // `None`: whole.
        let key = index.map(|_| units.to_vec());
        match &self.inflated_for {
            Some(None) => return,
            Some(Some(k)) if Some(k) == key.as_ref() => return,
            _ if key.as_ref().is_some_and(|k| k.is_empty()) => return,
            _ => {}
        }
        if index.is_some_and(|i| i.from_aranges) {
            self.inflate_units(units);
            self.inflated_for = Some(key);
            return;
        }
        for k in 0..self.lazy.len() {
            let id = self.lazy[k].0;
            let Some(size) = self.lazy_size(id) else {
                continue;
            };
            let wanted: Vec<(usize, usize)> = match index {
                None => vec![(0, size)],
                Some(index) => index.parts(id, units, size),
            };
            let end = wanted.iter().map(|w| w.1).max().unwrap_or(0).min(size);
            self.inflate_lazy(
                id,
                |cached| end <= cached.len(),
                |data, tee| inflate_parts(data, size, &wanted, tee),
            );
        }
        self.inflated_for = Some(key);
    }

    /// Inflates, for an index read from `.debug_aranges`, the abbreviations whole (a table runs
    /// to an end mark, not for a length: libc's are 140 kB compressed), and of the unit entries
    /// and line programs only the units starting at `units` and their programs, each as long as
    /// its header says.
    pub(super) fn inflate_units(&mut self, units: &[usize]) {
        let little = matches!(self.endian, gimli::RunTimeEndian::Little);
        let abbrev = gimli::SectionId::DebugAbbrev;
        if let (true, Some(size)) = (self.section(abbrev).is_empty(), self.lazy_size(abbrev)) {
            self.inflate_lazy(
                abbrev,
                |cached| cached.len() == size,
                |data, tee| inflate_parts(data, size, &[(0, size)], tee),
            );
        }
        self.inflate_units_lazy(gimli::SectionId::DebugInfo, units, little);
        if self.is_sparse(gimli::SectionId::DebugLine) {
            let programs = self.line_programs(units);
            self.inflate_units_lazy(gimli::SectionId::DebugLine, &programs, little);
        }
    }

    /// Inflates of lazy section `id` the units (or line programs) starting at `starts`.
    pub(super) fn inflate_units_lazy(
        &mut self,
        id: gimli::SectionId,
        starts: &[usize],
        little: bool,
    ) {
        let Some(size) = self.lazy_size(id) else {
            return;
        };
        // A cached prefix serves if it holds every one of them whole.
        let holds = |cached: &[u8]| {
            starts.iter().all(|&s| {
                cached
                    .get(s..)
                    .and_then(|head| unit_extent(head, little))
                    .is_some_and(|len| s.saturating_add(len) <= cached.len())
            })
        };
        self.inflate_lazy(id, holds, |data, tee| {
            inflate_units_of(data, size, starts, little, tee)
        });
    }

    /// Inflated size of lazy section `id`.
    pub(super) fn lazy_size(&self, id: gimli::SectionId) -> Option<usize> {
        let (_, c) = self.lazy.iter().find(|(s, _)| *s == id)?;
        Some(usize::try_from(c.uncompressed_size).unwrap_or(usize::MAX))
    }

    /// Replaces compressed section `id`'s bytes with what `inflate` makes of its compressed
    /// bytes (nothing when it is not compressed), or with the prefix of it the disk cache
    /// holds when that `covers` what the pass needs. `inflate` hands every piece it inflates,
    /// in order, to its second argument: they are written to the cache.
    pub(super) fn inflate_lazy(
        &mut self,
        id: gimli::SectionId,
        covers: impl FnOnce(&[u8]) -> bool,
        inflate: impl FnOnce(&[u8], &mut dyn FnMut(&[u8])) -> Option<Box<[u8]>>,
    ) {
        let Some(&(_, c)) = self.lazy.iter().find(|(s, _)| *s == id) else {
            return;
        };
        let (dir, build_id) = (self.cache_dir.clone(), self.build_id.clone());
        let key = match (&dir, &build_id) {
            // A section too small to be worth a file is not looked for.
            _ if c.uncompressed_size < disk_cache::MIN_PREFIX as u64 => None,
            (Some(dir), Some(build_id)) => Some(disk_cache::Key {
                magic: disk_cache::PREFIX,
                dir,
                build_id,
                section: id.name(),
                compressed_len: c.data.len() as u64,
                size: c.uncompressed_size,
            }),
            _ => None,
        };
        if let Some(map) = key.and_then(disk_cache::open) {
            if covers(&map[disk_cache::HEADER..]) {
                // SAFETY: the mapping is kept in `maps`, dropped after every borrower; its
                // bytes do not move when the Mmap value moves.
                let data = unsafe { extend(&map[disk_cache::HEADER..]) };
                self.maps.push(map);
                self.set_section(id, data);
                return;
            }
        }
        let mut writer = key.and_then(disk_cache::Writer::create);
        let buf = inflate(c.data, &mut |piece| {
            if let Some(w) = &mut writer {
                w.write(piece);
            }
        });
        let Some(buf) = buf else {
            return;
        };
        if let Some(w) = writer {
            w.finish();
        }
        // SAFETY: the box is kept in `_owned` (dropped after every borrower) and its bytes do
        // not move when it is moved there.
        let data = unsafe { extend(&buf[..]) };
        self._owned.push(buf);
        self.set_section(id, data);
    }

    /// Makes `data` section `id`'s bytes.
    pub(super) fn set_section(&mut self, id: gimli::SectionId, data: &'static [u8]) {
        if let Some(e) = self.sections.iter_mut().find(|(s, _)| *s == id) {
            e.1 = data;
        }
    }

    /// Where the line programs of the units starting at `units` start (their root entries'
    /// `DW_AT_stmt_list`), sorted and distinct; the units must be inflated.
    pub(super) fn line_programs(&self, units: &[usize]) -> Vec<usize> {
        let dwarf = self.dwarf();
        let mut out: Vec<usize> = units
            .iter()
            .filter_map(|&o| {
                let header = dwarf
                    .debug_info
                    .header_from_offset(gimli::DebugInfoOffset(o))
                    .ok()?;
                let abbrevs = dwarf.abbreviations(&header).ok()?;
                let mut entries = header.entries(&abbrevs);
                let root = entries.next_dfs().ok()??;
                match root.attr_value(gimli::DW_AT_stmt_list)? {
                    gimli::AttributeValue::DebugLineRef(l) => Some(l.0),
                    _ => None,
                }
            })
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Hands the pages of the mapped files read so far back (they stay in the page cache; a
    /// later read maps them again), so that what a pass reads of a large file never adds up in
    /// the process's resident memory.
    pub(super) fn forget_pages(&self) {
        if crate::threads::PROCESS_ENDING.load(std::sync::atomic::Ordering::Relaxed) {
            return;
        }
        for m in &self.maps {
            // SAFETY: the range is exactly this private, read-only file mapping; dropping its
            // pages changes no content (they are read back from the file when touched again).
            unsafe {
                libc::madvise(
                    m.as_ptr() as *mut libc::c_void,
                    m.len(),
                    libc::MADV_DONTNEED,
                );
            }
        }
    }

    /// Where the units are: from `.debug_aranges` (see `aranges_index`), else by walking every
    /// unit once.
    pub(super) fn unit_index(&mut self) -> Option<UnitIndex> {
        if self.sections.is_empty() {
            return None;
        }
        self.aranges_index().or_else(|| self.full_unit_index())
    }

    /// A new index to resolve `probes` with and keep, or `None` to use `kept` (the object's
    /// index kept across passes, `None` when there is none yet): an index from
    /// `.debug_aranges` that leaves one of them out gives way to the full one.
    pub(super) fn index_to_build(
        &mut self,
        kept: Option<&Option<UnitIndex>>,
        probes: &[u64],
    ) -> Option<Option<UnitIndex>> {
        let misses = |i: &UnitIndex| {
            i.from_aranges && !i.complete && probes.iter().any(|&p| i.unit_of(p).is_none())
        };
        let built = match kept {
            None => self.unit_index(),
            Some(Some(i)) if misses(i) => self.full_unit_index(),
            Some(_) => return None,
        };
        Some(match built {
            Some(i) if misses(&i) => self.full_unit_index(),
            other => other,
        })
    }

    pub(super) fn is_sparse(&self, id: gimli::SectionId) -> bool {
        self.lazy.iter().any(|(s, _)| *s == id)
    }

    /// The units' code ranges from `.debug_aranges`. Walking every unit's root entry and
    /// ranges to index costs more than most passes spend resolving (rg's 939 units: 10 ms, a
    /// third of its symbolization), and a compressed `.debug_info` must be inflated whole for
    /// it (libc's 4,000 units: 40 ms) where a pass needs a few units, inflated only as far as
    /// they are. The units' extents come from their headers alone when uncompressed (so
    /// references across units resolve), are unknown when compressed. A compiler may leave code
    /// out of the table: an address it does not cover sends its object to the full index (see
    /// `index_to_build`). `None` without a usable table.
    pub(super) fn aranges_index(&self) -> Option<UnitIndex> {
        let data = self.section(gimli::SectionId::DebugAranges);
        if data.is_empty() {
            return None;
        }
        let aranges = gimli::DebugAranges::new(data, self.endian);
        let mut offsets = Vec::new();
        let mut raw = Vec::new();
        let mut headers = aranges.headers();
        while let Ok(Some(h)) = headers.next() {
            let at = h.debug_info_offset().0;
            let mut entries = h.entries();
            while let Ok(Some(e)) = entries.next() {
                let r = e.range();
                if r.begin < r.end {
                    raw.push((r.begin, r.end, at));
                }
            }
            offsets.push(at);
        }
        if raw.is_empty() {
            return None;
        }
        offsets.sort_unstable();
        offsets.dedup();
        let units: Vec<UnitSpan> = if self.is_sparse(gimli::SectionId::DebugInfo) {
            offsets
                .iter()
                .map(|&offset| UnitSpan {
                    offset,
                    len: 0,
                    abbrev: 0,
                    line: None,
                })
                .collect()
        } else {
            // Headers only: no entry, abbreviation or line program is read.
            let dwarf = self.dwarf();
            let mut units = Vec::new();
            let mut headers = dwarf.units();
            while let Ok(Some(h)) = headers.next() {
                if let Some(offset) = h.debug_info_offset() {
                    units.push(UnitSpan {
                        offset: offset.0,
                        len: h.unit_length() + h.format().initial_length_size() as usize,
                        abbrev: h.debug_abbrev_offset().0,
                        line: None,
                    });
                }
            }
            units
        };
        let mut ranges: Vec<(u64, u64, u32)> = raw
            .into_iter()
            .filter_map(|(b, e, at)| {
                let u = units.binary_search_by_key(&at, |u| u.offset).ok()?;
                Some((b, e, u as u32))
            })
            .collect();
        let ranges = merge_ranges(&mut ranges);
        let complete = self.covers_most_code(&ranges);
        Some(UnitIndex {
            ranges,
            units,
            from_aranges: true,
            complete,
        })
    }

    /// Whether `ranges` (sorted by start) cover at least 90% of the object's `.text`. rustc and GCC list every unit with code; clang lists none unless asked, and a
    /// program linking clang-built code next to rustc's covers only part of its code.
    pub(super) fn covers_most_code(&self, ranges: &[(u64, u64, u32)]) -> bool {
        let text: Vec<(u64, u64)> = self
            .elf
            .sections()
            .filter(|s| s.name().is_ok_and(|n| n.starts_with(".text")))
            .map(|s| (s.address(), s.address().saturating_add(s.size())))
            .collect();
        let total: u64 = text.iter().map(|t| t.1 - t.0).sum();
        let mut covered = 0u64;
        // The union of the ranges (those of different units may overlap), within the code.
        let mut reach = 0u64;
        for &(b, e, _) in ranges {
            let b = b.max(reach);
            if b >= e {
                continue;
            }
            covered += text
                .iter()
                .map(|t| e.min(t.1).saturating_sub(b.max(t.0)))
                .sum::<u64>();
            reach = e;
        }
        total > 0 && covered * 10 >= total * 9
    }

    /// Walks every unit once: its code ranges.
    pub(super) fn full_unit_index(&mut self) -> Option<UnitIndex> {
        self.inflate(None, &[]);
        let dwarf = self.dwarf();
        let mut units = Vec::new();
        let mut ranges = Vec::new();
        let mut headers = dwarf.units();
        while let Ok(Some(header)) = headers.next() {
            let Some(offset) = header.debug_info_offset() else {
                continue;
            };
            let len = header.unit_length() + header.format().initial_length_size() as usize;
            let Ok(unit) = dwarf.unit(header) else {
                continue;
            };
            let u = units.len() as u32;
            units.push(UnitSpan {
                offset: offset.0,
                len,
                abbrev: unit.header.debug_abbrev_offset().0,
                line: unit.line_program.as_ref().map(|p| p.header().offset().0),
            });
            let Ok(mut rs) = dwarf.unit_ranges(&unit) else {
                continue;
            };
            while let Ok(Some(r)) = rs.next() {
                if r.begin < r.end {
                    ranges.push((r.begin, r.end, u));
                }
            }
        }
        self.forget_pages();
        Some(UnitIndex {
            ranges: merge_ranges(&mut ranges),
            units,
            from_aranges: false,
            complete: false,
        })
    }

    /// `resolve_all_on` on one thread.
    #[cfg(test)]
    pub(super) fn resolve_all(
        &mut self,
        probes: &[u64],
        index: Option<&UnitIndex>,
    ) -> Vec<Vec<ResolvedFrame>> {
        self.resolve_all_on(probes, index, 1)
    }

    /// The frames of each of `probes` (sorted, distinct, relative to the object's base): its
    /// unit's DWARF when there is some, walked once per unit for all its probes (the units on
    /// up to `threads` threads); else its symbol. Empty for a probe nothing knows.
    pub(super) fn resolve_all_on(
        &mut self,
        probes: &[u64],
        index: Option<&UnitIndex>,
        threads: usize,
    ) -> Vec<Vec<ResolvedFrame>> {
        let mut out: Vec<Vec<ResolvedFrame>> = (0..probes.len()).map(|_| Vec::new()).collect();
        if let (Some(index), false) = (index, self.sections.is_empty()) {
            // Probes by unit, in probe order within each.
            let mut by_unit: Vec<(usize, usize)> = probes
                .iter()
                .enumerate()
                .filter_map(|(k, &p)| Some((index.unit_of(p)?.offset, k)))
                .collect();
            by_unit.sort_unstable();
            let mut needed: Vec<usize> = by_unit.iter().map(|u| u.0).collect();
            needed.dedup();
            self.inflate(Some(index), &needed);
            let groups: Vec<&[(usize, usize)]> = by_unit.chunk_by(|a, b| a.0 == b.0).collect();
            for (k, frames) in self.walk_units(index, probes, &groups, threads) {
                out[k] = frames;
            }
            self.forget_pages();
        }
        for (k, frames) in out.iter_mut().enumerate() {
            if frames.is_empty() {
                if let Some(name) = self.symbol(probes[k]) {
                    frames.push(ResolvedFrame {
                        name: demangle(name),
                        system_name: name.to_owned(),
                        ..ResolvedFrame::default()
                    });
                }
            }
        }
        out
    }

    /// Walks each unit of `groups` (the positions in `probes` of the probes of one unit, by
    /// unit offset) once for its probes: the raw frames of each position. With more than one
    /// thread, the units are taken largest first by the next free thread (ripgrep's few dozen
    /// units at exit took 13 ms on one); the mapped pages are handed back after every
    /// `FORGET_AFTER_BYTES` of units walked by any of them.
    pub(super) fn walk_units(
        &self,
        index: &UnitIndex,
        probes: &[u64],
        groups: &[&[(usize, usize)]],
        threads: usize,
    ) -> Vec<(usize, Vec<ResolvedFrame>)> {
        use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
        let mut order: Vec<usize> = (0..groups.len()).collect();
        let mut helpers = threads.min(groups.len()).saturating_sub(1);
        if helpers > 0 {
            let dwarf = self.dwarf();
            let size = |g: usize| {
                dwarf
                    .debug_info
                    .header_from_offset(gimli::DebugInfoOffset(groups[g][0].0))
                    .map_or(0, |h| h.length_including_self())
            };
            let sizes: Vec<usize> = order.iter().map(|&g| size(g)).collect();
            // Too little to share: a thread costs more than it saves.
            if sizes.iter().sum::<usize>() < PARALLEL_WALK_BYTES {
                helpers = 0;
            } else {
                order.sort_by_key(|&g| std::cmp::Reverse(sizes[g]));
                // The symbol table, which naming the frames needs, is read by one of the
                // threads while the others walk.
                order.insert(0, usize::MAX);
            }
        }
        let next = AtomicUsize::new(0);
        let read = AtomicUsize::new(0);
        // Units digested on an earlier pass or by an earlier process, and those digested now.
        let key = self.digests_key();
        let stored = key.and_then(disk_cache::open_whole);
        let stored_units = stored
            .as_ref()
            .map(|m| digest::Units::parse(&m[disk_cache::HEADER..]));
        let digested = std::sync::Mutex::new(Vec::new());
        let digested_bytes = AtomicUsize::new(0);
        let found = on_threads(helpers, "symu", || {
            let dwarf = self.dwarf();
            let unit_start = |o: usize| index.unit_at(o).map(|u| u.offset);
            let mut others = dwarf_walk::OtherUnits::new(&dwarf, &unit_start);
            let mut ps = Vec::new();
            let mut done = Vec::new();
            while let Some(&g) = order.get(next.fetch_add(1, Relaxed)) {
                let Some(&group) = groups.get(g) else {
                    self.symbols();
                    continue;
                };
                let unit = dwarf
                    .debug_info
                    .header_from_offset(gimli::DebugInfoOffset(group[0].0))
                    .and_then(|h| dwarf.unit(h));
                let Ok(unit) = unit else {
                    continue;
                };
                ps.clear();
                ps.extend(group.iter().map(|&(_, k)| probes[k]));
                let offset = group[0].0;
                // The stored digest, else one made now (within the pass's budget), else none.
                let stored = stored_units.as_ref().and_then(|u| u.get(offset));
                let made = key
                    .filter(|_| stored.is_none())
                    .filter(|_| digested_bytes.load(Relaxed) < self.digest_budget)
                    .and_then(|_| dwarf_walk::digest(&dwarf, &unit));
                let raw = match stored.or_else(|| made.as_deref().and_then(digest::Digest::parse)) {
                    Some(d) => dwarf_walk::resolve_with(&dwarf, &unit, &ps, &mut others, &d),
                    None => dwarf_walk::resolve(&dwarf, &unit, &ps, &mut others),
                };
                if let Some(bytes) = made {
                    digested_bytes.fetch_add(bytes.len(), Relaxed);
                    let mut new = digested.lock().unwrap_or_else(|e| e.into_inner());
                    new.push((offset, bytes));
                }
                for (&(_, k), frames) in group.iter().zip(raw) {
                    let named = frames.into_iter().map(|f| self.frame(probes[k], f));
                    done.push((k, named.collect()));
                }
                let len = unit.header.length_including_self();
                if read.fetch_add(len, Relaxed) + len >= FORGET_AFTER_BYTES {
                    read.store(0, Relaxed);
                    self.forget_pages();
                }
            }
            done
        });
        let new = digested.into_inner().unwrap_or_else(|e| e.into_inner());
        if let (Some(key), false) = (key, new.is_empty()) {
            // Added to a file that reads whole; else a new file with what did read.
            match &stored_units {
                Some(u) if u.clean => disk_cache::append(key, &digest::Units::records(&new)),
                Some(u) => disk_cache::store(key, &u.rewritten(&new)),
                None => disk_cache::store(key, &digest::Units::records(&new)),
            }
        }
        found
    }

    /// Where this object's unit digests are cached (see `digest`): by the build id of the file
    /// holding its DWARF and the sizes of the sections they are made from.
    pub(super) fn digests_key(&self) -> Option<disk_cache::Key<'_>> {
        let size = |id| self.lazy_size(id).unwrap_or_else(|| self.section(id).len()) as u64;
        Some(disk_cache::Key {
            magic: disk_cache::DIGESTS,
            dir: self.cache_dir.as_deref()?,
            build_id: self.build_id.as_deref()?,
            section: ".units",
            compressed_len: size(gimli::SectionId::DebugInfo),
            size: size(gimli::SectionId::DebugLine),
        })
    }

    /// A frame the walk found at `probe`.
    pub(super) fn frame(&self, probe: u64, f: dwarf_walk::RawFrame) -> ResolvedFrame {
        let (name, system_name) = match (f.name, f.entry) {
            (Some(n), _) if f.linkage => {
                let raw = n.to_string_lossy();
                (demangle(&raw), raw.into_owned())
            }
            // The physical frame: the symbol table knows the function's full name.
            (n, Some(entry)) => {
                let short = n.map(|n| demangle(&n.to_string_lossy()));
                self.physical_name(probe, entry, short)
            }
            (Some(n), None) => (demangle(&n.to_string_lossy()), String::new()),
            // A line-table row outside every function.
            (None, None) => match self.symbol(probe) {
                Some(raw) => (demangle(raw), raw.to_owned()),
                None => Default::default(),
            },
        };
        ResolvedFrame {
            name,
            system_name,
            filename: f.file,
            line: i64::from(f.line),
            start_line: i64::from(f.decl_line),
        }
    }

    /// (name, system name) of the physical frame at `probe`, in a function whose code range
    /// holding it starts at `entry`, which DWARF names `short` without a linkage name: the
    /// symbol starting there is the function's (of several there, one naming what DWARF
    /// names); without one, the symbol below `probe` if it names what DWARF names.
    pub(super) fn physical_name(
        &self,
        probe: u64,
        entry: u64,
        short: Option<String>,
    ) -> (String, String) {
        // The symbol's readable name, if it names what DWARF names.
        let agreeing = |raw: &str| {
            let full = demangle(raw);
            match &short {
                Some(d) if !names_agree(&full, d) => None,
                _ => Some(full),
            }
        };
        let symbols = self.symbols();
        let from = symbols.partition_point(|s| s.0 < entry);
        let to = from + symbols[from..].partition_point(|s| s.0 == entry);
        let at = &symbols[from..to];
        if let Some((full, raw)) = at.iter().find_map(|s| Some((agreeing(s.2)?, s.2))) {
            return (full, raw.to_owned());
        }
        if let Some(&(_, _, raw)) = at.first() {
            // No symbol there names what DWARF names: a Rust symbol still names the function
            // (DWARF calls closures and shims otherwise); a C alias (`__GI___clone3` for
            // `clone3`) leaves DWARF's name.
            let name = match short {
                Some(d) if rustc_demangle::try_demangle(raw).is_err() => d,
                _ => demangle(raw),
            };
            return (name, raw.to_owned());
        }
        if let Some(raw) = self.symbol(probe) {
            if let Some(full) = agreeing(raw) {
                return (full, raw.to_owned());
            }
        }
        (short.unwrap_or_default(), String::new())
    }

    /// The function symbols: (address, size, name), sorted by address, the preferred name first
    /// at each (see `symbol`).
    pub(super) fn symbols(&self) -> &[(u64, u64, &'static str)] {
        let elf = &self.elf;
        self.symbols.get_or_init(|| {
            // `symtab`, else the dynamic table (all a stripped object or the vDSO has).
            let Some(table) = elf.symbol_table().or_else(|| elf.dynamic_symbol_table()) else {
                return Vec::new();
            };
            let mut v: Vec<(u64, u8, usize, u64, &'static str)> = table
                .symbols()
                .filter(|s| s.is_definition())
                .filter_map(|s| {
                    let kind = match s.kind() {
                        object::SymbolKind::Text => 0,
                        object::SymbolKind::Unknown => 1,
                        _ => return None,
                    };
                    let scope = match s.scope() {
                        object::SymbolScope::Dynamic => 0,
                        object::SymbolScope::Linkage => 1,
                        object::SymbolScope::Compilation => 2,
                        object::SymbolScope::Unknown => 3,
                    };
                    let name = s.name().ok().filter(|n| !n.is_empty())?;
                    // Of symbols at one address: functions, exported, the later entry.
                    Some((
                        s.address(),
                        kind * 4 + scope,
                        usize::MAX - s.index().0,
                        s.size(),
                        name,
                    ))
                })
                .collect();
            v.sort_unstable();
            v.iter().map(|s| (s.0, s.3, s.4)).collect()
        })
    }

    /// The function symbol at or below `probe` (of several at one address, the preferred:
    /// functions, exported, the later entry), unless its size says `probe` lies past its end:
    /// in a stripped object (only exported symbols left) the nearest symbol below is mostly
    /// some other function, and `object+0xoffset` is then the honest name. Symbols of size 0
    /// (hand-written assembly) still name what follows them.
    pub(super) fn symbol(&self, probe: u64) -> Option<&'static str> {
        let symbols = self.symbols();
        let i = symbols.partition_point(|s| s.0 <= probe);
        let at = symbols.get(i.checked_sub(1)?)?.0;
        let first = symbols.partition_point(|s| s.0 < at);
        let size = symbols[first..i].iter().map(|s| s.1).max().unwrap_or(0);
        if size > 0 && probe - at >= size {
            return None;
        }
        Some(symbols[first].2)
    }
}

/// The vDSO's in-memory ELF image (it has no file). Its loadable segment ends before the
/// section headers, which hold the way to its symbol table: the image runs to the end of the
/// section header table, within the segment's last page (the kernel maps it whole).
pub(super) fn vdso_image(obj: &LoadedObject) -> Option<&'static [u8]> {
    let (start, end) = obj.range()?;
    let page_end = end.checked_add(4095)? & !4095;
    let header_len = 64u64;
    if page_end - start < header_len {
        return None;
    }
    // SAFETY: the vDSO's first page (its ELF header) is mapped readable for the life of the
    // process.
    let header = unsafe { std::slice::from_raw_parts(start as *const u8, header_len as usize) };
    if &header[..4] != b"\x7fELF" || header[4] != 2 {
        return None;
    }
    let shoff = u64::from_ne_bytes(header[0x28..0x30].try_into().ok()?);
    let shentsize = u64::from(u16::from_ne_bytes(header[0x3a..0x3c].try_into().ok()?));
    let shnum = u64::from(u16::from_ne_bytes(header[0x3c..0x3e].try_into().ok()?));
    let sections_end = start
        .checked_add(shoff)?
        .checked_add(shentsize.checked_mul(shnum)?)?;
    let image_end = end.max(sections_end);
    if image_end > page_end {
        return None;
    }
    // SAFETY: [start, image_end) lies within the vDSO's pages, mapped for the process's life.
    Some(unsafe { std::slice::from_raw_parts(start as *const u8, (image_end - start) as usize) })
}

pub(super) fn map_file(path: &Path) -> Option<Mmap> {
    let f = std::fs::File::open(path).ok()?;
    // SAFETY: the file is mapped read-only and private; a concurrent truncation of an object
    // file in use by this process is outside what any profiler can guard against.
    unsafe { Mmap::map(&f).ok() }
}

/// # Safety
/// The caller keeps the memory behind `b` alive and unmoved while the result is used.
pub(super) unsafe fn extend(b: &[u8]) -> &'static [u8] {
    // SAFETY: forwarded to the caller.
    unsafe { std::slice::from_raw_parts(b.as_ptr(), b.len()) }
}

/// Where distributions put an object's debug info: by build id, then by `.gnu_debuglink`.
pub(super) fn separate_debug_file(file: &object::File<'_>, path: Option<&Path>) -> Option<PathBuf> {
    if let Ok(Some(id)) = file.build_id() {
        if id.len() >= 2 {
            let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
            let p = PathBuf::from(format!(
                "/usr/lib/debug/.build-id/{}/{}.debug",
                &hex[..2],
                &hex[2..]
            ));
            if p.is_file() {
                return Some(p);
            }
        }
    }
    let (link, _crc) = file.gnu_debuglink().ok()??;
    let link = std::str::from_utf8(link).ok()?;
    let dir = path?.parent()?;
    let candidates = [
        dir.join(link),
        dir.join(".debug").join(link),
        Path::new("/usr/lib/debug")
            .join(dir.strip_prefix("/").unwrap_or(dir))
            .join(link),
    ];
    candidates
        .into_iter()
        .find(|p| p.is_file() && Some(p.as_path()) != path)
}
