//! Turning sampled addresses into function names, files and lines, off the hot path.
//!
//! Samplers record bare addresses; the export thread symbolizes them while the recorder encodes
//! a profile (`StackRecorder::serialize(Some(&mut symbolizer))`). For each loaded object the
//! DWARF of its file (or of its separate debug file, found by build id or `.gnu_debuglink`) is
//! memory-mapped and parsed lazily with `addr2line`, inlined frames are expanded innermost first,
//! and Rust names are demangled without their hash. Objects without DWARF fall back to their
//! symbol table (name only); unknown addresses get `object+0xoffset`, or their address outside
//! every object.
//!
//! Memory: the mapped files and parsed DWARF live for one *pass* (one serialization), in the
//! profiler's private arena when it can (see `crate::arena`), and are dropped at its end, so no
//! multi-MB context stays resident between profiles. What stays is a per-address cache of
//! resolved frames, bounded in entries and aged (CACHE_PASSES), emptied when an object was
//! unloaded (another may take its addresses).

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use addr2line::gimli;
use ferroprof_recorder::{ResolvedFrame, Symbolizer};
use memmap2::Mmap;
use object::{Object, ObjectSection};

use crate::modules::{loaded_objects, LoadedObject};

type Reader = gimli::EndianSlice<'static, gimli::RunTimeEndian>;

/// Most addresses kept in the cache between passes.
const MAX_CACHED_ADDRESSES: usize = 16 * 1024;
/// Units resolved through contexts of their own in one pass before the whole object's context
/// takes over (see `DebugInfo::context`).
const UNITS_PER_PASS: usize = 24;
/// Passes an address stays cached without being used. A pass that meets one uncached address
/// loads the debug info of its object (for a large service binary about 100 ms of CPU and
/// 100 MB of transient memory), so addresses that come back now and then must stay: with an
/// aging of two passes a service resolved some 70 addresses again at every export.
const CACHE_PASSES: u64 = 120;

/// A [`Symbolizer`] for the current process. See the module docs.
pub struct ProcessSymbolizer {
    cache: HashMap<u64, CacheEntry>,
    pass: u64,
    objects: Option<Vec<ObjectDebug>>,
    max_entries: usize,
    /// Addresses resolved from debug info (cache misses), ever.
    resolved: u64,
    /// The loader's unload count when the cache was last checked.
    unloads: u64,
    /// This symbolizer's name as an owner of the private arena.
    arena_owner: u64,
    /// What the cache and the unit indexes held at the end of the last pass, in bytes.
    kept_bytes: usize,
    /// Where each object's compilation units are, kept across passes (by base and file): an
    /// uncached address then costs the parse of its own unit, not of the whole object.
    indexes: HashMap<(u64, String), Option<UnitIndex>>,
}

struct CacheEntry {
    frames: Box<[ResolvedFrame]>,
    last_pass: u64,
}

impl Default for ProcessSymbolizer {
    fn default() -> Self {
        Self::new()
    }
}

impl ProcessSymbolizer {
    pub fn new() -> Self {
        ProcessSymbolizer {
            cache: HashMap::new(),
            pass: 0,
            objects: None,
            max_entries: MAX_CACHED_ADDRESSES,
            resolved: 0,
            unloads: 0,
            arena_owner: crate::arena::new_owner(),
            indexes: HashMap::new(),
            kept_bytes: 0,
        }
    }

    /// Runs `f` as one pass: debug info loaded during it is released when it returns.
    pub fn pass<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let unloads = crate::modules::objects_generation().1;
        if unloads != self.unloads {
            self.unloads = unloads;
            self.cache.clear();
            self.indexes.clear();
        }
        self.pass += 1;
        let r = f(self);
        self.end_pass();
        r
    }

    fn end_pass(&mut self) {
        // Arena memory (see `lookup`): dropped, then its pages handed back.
        self.objects = None;
        crate::arena::release(self.arena_owner);
        let pass = self.pass;
        self.cache.retain(|_, e| e.last_pass + CACHE_PASSES > pass);
        if self.cache.len() > self.max_entries {
            // Over budget: the least recently used go (the oldest passes first).
            let mut ages: Vec<u64> = self.cache.values().map(|e| e.last_pass).collect();
            let cut = ages.len() - self.max_entries;
            let (_, &mut oldest_kept, _) = ages.select_nth_unstable(cut);
            self.cache.retain(|_, e| e.last_pass >= oldest_kept);
            if self.cache.len() > self.max_entries {
                self.cache.retain(|_, e| e.last_pass == pass);
            }
        }
        if self.cache.capacity() > 4 * self.cache.len().max(64) {
            self.cache.shrink_to_fit();
        }
        self.kept_bytes = self.estimate_kept_bytes();
    }

    /// Number of cached addresses (for tests and stats).
    pub fn cached_addresses(&self) -> usize {
        self.cache.len()
    }

    /// Bytes the symbolizer keeps between passes (its cache of resolved addresses and the
    /// objects' unit indexes), as of the end of the last pass; an estimate from capacities.
    pub fn kept_bytes(&self) -> usize {
        self.kept_bytes
    }

    fn estimate_kept_bytes(&self) -> usize {
        use std::mem::size_of;
        let slot = size_of::<u64>() + size_of::<CacheEntry>() + 1;
        let mut n = self.cache.capacity() * slot;
        for e in self.cache.values() {
            n += e.frames.len() * size_of::<ResolvedFrame>();
            n += e
                .frames
                .iter()
                .map(|f| f.name.capacity() + f.filename.capacity())
                .sum::<usize>();
        }
        for ((_, file), index) in &self.indexes {
            n += file.capacity() + size_of::<(u64, String)>() + size_of::<Option<UnitIndex>>();
            if let Some(i) = index {
                n += i.ranges.capacity() * size_of::<(u64, u64, u32)>();
                n += i.units.capacity() * size_of::<UnitSpan>();
            }
        }
        n
    }

    /// Addresses resolved from debug info so far (not from the cache).
    pub fn resolved_from_debug_info(&self) -> u64 {
        self.resolved
    }

    /// Whether debug info is currently loaded (only during a pass).
    pub fn holds_debug_info(&self) -> bool {
        self.objects.is_some()
    }

    /// Resolves `address` (an instruction address, or a return address minus one).
    pub fn resolve(&mut self, address: u64) -> Vec<ResolvedFrame> {
        let mut out = Vec::new();
        self.symbolize(address, &mut out);
        out
    }

    /// Resolves an address not in the cache. The debug info it loads and everything it
    /// allocates meanwhile live in the arena (released at the end of the pass, see
    /// `crate::arena`); the frames are copied out to the heap.
    fn lookup(&mut self, address: u64) -> Box<[ResolvedFrame]> {
        self.resolved += 1;
        let owner = self.arena_owner;
        let frames = crate::arena::with(owner, || self.lookup_in_arena(address));
        let owned: Box<[ResolvedFrame]> = frames
            .iter()
            .map(|f| ResolvedFrame {
                name: f.name.as_str().to_owned(),
                filename: f.filename.as_str().to_owned(),
                line: f.line,
            })
            .collect();
        drop(frames);
        debug_assert!(owned
            .iter()
            .all(|f| !crate::arena::owns(f.name.as_ptr() as *mut u8)
                && !crate::arena::owns(f.filename.as_ptr() as *mut u8)));
        owned
    }

    fn lookup_in_arena(&mut self, address: u64) -> Box<[ResolvedFrame]> {
        let objects = self.objects.get_or_insert_with(|| {
            loaded_objects()
                .into_iter()
                .map(|obj| ObjectDebug { obj, debug: None })
                .collect()
        });
        let Some(od) = objects.iter_mut().find(|o| o.obj.contains(address)) else {
            // In no loaded object (JIT code, an unloaded library, a bad frame): named by its
            // address, so that no viewer takes the location for one left to symbolize (`go tool
            // pprof` would ask the server's /debug/pprof/symbol for it).
            return Box::new([ResolvedFrame {
                name: format!("{address:#x}"),
                filename: String::new(),
                line: 0,
            }]);
        };
        let probe = address.wrapping_sub(od.obj.base);
        let debug = od
            .debug
            .get_or_insert_with(|| DebugInfo::load(&od.obj).ok());
        let mut frames = Vec::new();
        if let Some(d) = debug.as_mut() {
            let file = match &od.obj.path {
                Some(p) => p.to_string_lossy().into_owned(),
                None => od.obj.name.clone(),
            };
            let key = (od.obj.base, file);
            if !self.indexes.contains_key(&key) {
                let built = d.unit_index();
                // Kept across passes: on the heap, not in the arena.
                crate::arena::outside(|| {
                    let index = built.map(|b| b.to_heap());
                    self.indexes
                        .insert((key.0, key.1.as_str().to_owned()), index);
                });
            }
            let index = self.indexes.get(&key).and_then(Option::as_ref);
            d.frames(probe, index, &mut frames);
        }
        if frames.is_empty() {
            let module = od
                .obj
                .path
                .as_deref()
                .and_then(Path::file_name)
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| od.obj.name.clone());
            frames.push(ResolvedFrame {
                name: format!("{module}+{probe:#x}"),
                filename: od
                    .obj
                    .path
                    .as_deref()
                    .map(|p| p.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                line: 0,
            });
        }
        frames.into_boxed_slice()
    }
}

impl Drop for ProcessSymbolizer {
    fn drop(&mut self) {
        // A symbolizer dropped in the middle of a pass hands the arena on.
        self.objects = None;
        crate::arena::release(self.arena_owner);
    }
}

impl Symbolizer for ProcessSymbolizer {
    fn symbolize(&mut self, address: u64, out: &mut Vec<ResolvedFrame>) {
        let pass = self.pass;
        if let Some(e) = self.cache.get_mut(&address) {
            e.last_pass = pass;
            out.extend(e.frames.iter().cloned());
            return;
        }
        let frames = self.lookup(address);
        out.extend(frames.iter().cloned());
        if self.cache.len() < self.max_entries {
            self.cache.insert(
                address,
                CacheEntry {
                    frames,
                    last_pass: pass,
                },
            );
        }
    }
}

struct ObjectDebug {
    obj: LoadedObject,
    /// `None` = not loaded yet; `Some(None)` = nothing usable.
    debug: Option<Option<DebugInfo>>,
}

/// Parsed debug info of one object. Field order matters: the borrowers (the contexts,
/// `sections`, `symbols`) are declared, hence dropped, before the memory they borrow (`_owned`,
/// `_maps`).
struct DebugInfo {
    /// addr2line contexts over single compilation units (by `.debug_info` offset), made as
    /// addresses need them during the pass; `None`: that unit did not parse.
    unit_ctx: HashMap<usize, Option<addr2line::Context<Reader>>>,
    /// The whole object's context, for units that refer into other units.
    full_ctx: Option<Option<addr2line::Context<Reader>>>,
    /// Unit contexts allowed in a pass before the whole object's context takes over.
    unit_budget: usize,
    /// The DWARF sections (empty when the object has none).
    sections: Vec<(gimli::SectionId, &'static [u8])>,
    endian: gimli::RunTimeEndian,
    /// (address, name), sorted by address.
    symbols: Vec<(u64, &'static str)>,
    _owned: Vec<Box<[u8]>>,
    _maps: Vec<Mmap>,
}

/// Where an object's compilation units are: built once per object (walking every unit's
/// header and root entry), kept across passes, a few bytes per unit and code range.
struct UnitIndex {
    /// (start, end, index into `units`), sorted by start, adjacent ranges of a unit merged.
    ranges: Vec<(u64, u64, u32)>,
    units: Vec<UnitSpan>,
}

#[derive(Clone, Copy)]
struct UnitSpan {
    /// The unit's bytes in `.debug_info`, header included.
    offset: usize,
    len: usize,
    /// It refers to entries of other units (DW_FORM_ref_addr and kin): only a context over the
    /// whole object resolves it.
    whole: bool,
}

impl UnitIndex {
    fn to_heap(&self) -> UnitIndex {
        UnitIndex {
            ranges: self.ranges.to_vec(),
            units: self.units.to_vec(),
        }
    }

    /// The unit holding `.debug_info` offset `offset`.
    fn unit_at(&self, offset: usize) -> Option<UnitSpan> {
        let i = self.units.partition_point(|u| u.offset <= offset);
        let u = *self.units.get(i.checked_sub(1)?)?;
        (offset < u.offset + u.len).then_some(u)
    }

    fn unit_of(&self, probe: u64) -> Option<UnitSpan> {
        let i = self.ranges.partition_point(|r| r.0 <= probe);
        let &(_, end, u) = self.ranges.get(i.checked_sub(1)?)?;
        (probe < end).then(|| self.units[u as usize])
    }
}

#[derive(Debug)]
struct LoadError;

impl DebugInfo {
    fn load(obj: &LoadedObject) -> Result<DebugInfo, LoadError> {
        let mut maps = Vec::new();
        let mut owned: Vec<Box<[u8]>> = Vec::new();
        let data: &'static [u8] = match &obj.path {
            Some(path) => {
                let m = map_file(path).ok_or(LoadError)?;
                // SAFETY: the mapping is kept in `_maps`, dropped after every borrower (see the
                // struct's field order); a Mmap's bytes do not move when the Mmap value moves.
                let d = unsafe { extend(&m[..]) };
                maps.push(m);
                d
            }
            None => vdso_image(obj).ok_or(LoadError)?,
        };
        let file = object::File::parse(data).map_err(|_| LoadError)?;
        let mut symbols: Vec<(u64, &'static str)> = file
            .symbol_map()
            .symbols()
            .iter()
            .map(|s| (s.address(), s.name()))
            .collect();
        symbols.sort_unstable_by_key(|s| s.0);

        let mut dwarf_file = None;
        if file.section_by_name(".debug_info").is_none() {
            if let Some(p) = separate_debug_file(&file, obj.path.as_deref()) {
                if let Some(m) = map_file(&p) {
                    // SAFETY: as above, kept in `_maps`.
                    let d = unsafe { extend(&m[..]) };
                    maps.push(m);
                    dwarf_file = object::File::parse(d).ok();
                }
            }
        }
        let src = dwarf_file.as_ref().unwrap_or(&file);
        let endian = if src.is_little_endian() {
            gimli::RunTimeEndian::Little
        } else {
            gimli::RunTimeEndian::Big
        };
        let mut sections = Vec::new();
        if src.section_by_name(".debug_info").is_some() {
            // Every section gimli may read, found once (compressed ones inflated once).
            let _ = gimli::DwarfSections::load(|id| -> Result<(), ()> {
                if let Some(section) = src.section_by_name(id.name()) {
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
        if sections.is_empty() && symbols.is_empty() {
            return Err(LoadError);
        }
        Ok(DebugInfo {
            unit_ctx: HashMap::new(),
            full_ctx: None,
            unit_budget: UNITS_PER_PASS,
            sections,
            endian,
            symbols,
            _owned: owned,
            _maps: maps,
        })
    }

    fn section(&self, id: gimli::SectionId) -> &'static [u8] {
        self.sections
            .iter()
            .find(|(s, _)| *s == id)
            .map_or(&[], |(_, d)| *d)
    }

    /// The object's DWARF; with `info`, `.debug_info` is that slice alone (one unit, which
    /// must not refer into others) and `.debug_aranges` is left out (its offsets are the whole
    /// section's).
    fn dwarf(&self, info: Option<&'static [u8]>) -> gimli::Dwarf<Reader> {
        let endian = self.endian;
        let loaded = gimli::Dwarf::load(|id| -> Result<Reader, ()> {
            let data = match (id, info) {
                (gimli::SectionId::DebugInfo, Some(unit)) => unit,
                (gimli::SectionId::DebugAranges, Some(_)) => &[],
                _ => self.section(id),
            };
            Ok(gimli::EndianSlice::new(data, endian))
        });
        loaded.unwrap_or_default()
    }

    /// Walks every unit once: its code ranges and whether it refers into other units.
    fn unit_index(&self) -> Option<UnitIndex> {
        if self.sections.is_empty() {
            return None;
        }
        let dwarf = self.dwarf(None);
        let abbrev = self.section(gimli::SectionId::DebugAbbrev);
        let mut units = Vec::new();
        let mut ranges = Vec::new();
        let mut headers = dwarf.units();
        while let Ok(Some(header)) = headers.next() {
            let Some(offset) = header.debug_info_offset() else {
                continue;
            };
            let len = header.unit_length() + header.format().initial_length_size() as usize;
            let whole = refers_to_other_units(abbrev, header.debug_abbrev_offset().0);
            let Ok(unit) = dwarf.unit(header) else {
                continue;
            };
            let Ok(mut rs) = dwarf.unit_ranges(&unit) else {
                continue;
            };
            let u = units.len() as u32;
            units.push(UnitSpan {
                offset: offset.0,
                len,
                whole,
            });
            while let Ok(Some(r)) = rs.next() {
                if r.begin < r.end {
                    ranges.push((r.begin, r.end, u));
                }
            }
        }
        ranges.sort_unstable_by_key(|r| r.0);
        let mut merged: Vec<(u64, u64, u32)> = Vec::with_capacity(ranges.len());
        for r in ranges {
            match merged.last_mut() {
                Some(last) if last.2 == r.2 && last.1 >= r.0 => last.1 = last.1.max(r.1),
                _ => merged.push(r),
            }
        }
        Some(UnitIndex {
            ranges: merged,
            units,
        })
    }

    /// The context that resolves `probe`: its unit's alone when it can, else the object's.
    fn context(
        &mut self,
        probe: u64,
        index: Option<&UnitIndex>,
    ) -> Option<&addr2line::Context<Reader>> {
        if self.sections.is_empty() {
            return None;
        }
        // Past this many units in one pass (a first export, a burst of new code) the whole
        // object's context is cheaper than more contexts of a unit each.
        let many = self.unit_ctx.len() >= self.unit_budget || self.full_ctx.is_some();
        let span = index.and_then(|i| i.unit_of(probe)).filter(|_| !many);
        let partial = match (span, index) {
            (Some(u), Some(index)) if !self.unit_ctx.contains_key(&u.offset) => {
                let info = if u.whole {
                    self.units_in_place(u, index)
                } else {
                    let info = self.section(gimli::SectionId::DebugInfo);
                    info.get(u.offset..u.offset + u.len)
                };
                let ctx =
                    info.and_then(|i| addr2line::Context::from_dwarf(self.dwarf(Some(i))).ok());
                self.unit_ctx.insert(u.offset, ctx);
                Some(u.offset)
            }
            (Some(u), Some(_)) => Some(u.offset),
            _ => None,
        };
        match partial {
            Some(offset) if self.unit_ctx.get(&offset).is_some_and(Option::is_some) => {
                self.unit_ctx.get(&offset)?.as_ref()
            }
            _ => {
                if self.full_ctx.is_none() {
                    let ctx = addr2line::Context::from_dwarf(self.dwarf(None)).ok();
                    self.full_ctx = Some(ctx);
                }
                self.full_ctx.as_ref()?.as_ref()
            }
        }
    }

    /// A `.debug_info` for unit `u`, which names functions by entries of other units: those
    /// units (found by following `u`'s name sources, and theirs, a few levels deep) at their own
    /// offsets, every gap between them filled with one stand-in unit that no parser reads past
    /// its header (its abbreviation table does not exist). The buffer is as long as the section
    /// up to the last unit needed, but only the pages written are ever touched. None when the
    /// layout does not allow it (then the whole object's context is used).
    fn units_in_place(&mut self, u: UnitSpan, index: &UnitIndex) -> Option<&'static [u8]> {
        if self.endian != gimli::RunTimeEndian::Little {
            return None;
        }
        let info = self.section(gimli::SectionId::DebugInfo);
        let dwarf = self.dwarf(None);
        let mut needed: Vec<UnitSpan> = vec![u];
        // Entries whose name sources are yet to be followed, by unit: (unit, offsets or all).
        let mut todo: Vec<(UnitSpan, Option<Vec<usize>>)> = vec![(u, None)];
        for _round in 0..4 {
            let mut next: Vec<(UnitSpan, Option<Vec<usize>>)> = Vec::new();
            for (span, only) in todo.drain(..) {
                let header = dwarf
                    .debug_info
                    .header_from_offset(gimli::DebugInfoOffset(span.offset))
                    .ok()?;
                let unit = dwarf.unit(header).ok()?;
                let mut follow = |attr: gimli::AttributeValue<Reader>| {
                    if let gimli::AttributeValue::DebugInfoRef(o) = attr {
                        let target = index.unit_at(o.0)?;
                        if !needed.iter().any(|n| n.offset == target.offset) {
                            needed.push(target);
                        }
                        match next.iter_mut().find(|(s, _)| s.offset == target.offset) {
                            Some((_, Some(list))) => list.push(o.0),
                            Some((_, None)) => {}
                            None => next.push((target, Some(vec![o.0]))),
                        }
                    }
                    Some(())
                };
                let names = [gimli::DW_AT_abstract_origin, gimli::DW_AT_specification];
                match only {
                    None => {
                        let mut entries = unit.entries();
                        while let Ok(Some(entry)) = entries.next_dfs() {
                            for name in names {
                                if let Some(v) = entry.attr_value(name) {
                                    follow(v);
                                }
                            }
                        }
                    }
                    Some(offsets) => {
                        for o in offsets {
                            let at = gimli::DebugInfoOffset(o).to_unit_offset(&unit.header)?;
                            let Ok(entry) = unit.entry(at) else {
                                continue;
                            };
                            for name in names {
                                if let Some(v) = entry.attr_value(name) {
                                    follow(v);
                                }
                            }
                        }
                    }
                }
            }
            if next.is_empty() {
                break;
            }
            todo = next;
        }
        needed.sort_unstable_by_key(|n| n.offset);
        let end = needed.last().map(|n| n.offset + n.len)?;
        let mut buf = vec![0u8; end].into_boxed_slice();
        let mut at = 0;
        for n in &needed {
            // A stand-in unit over the gap: DWARF 4, 32-bit, an abbreviation offset past any
            // table, so parsers reject it and move on to the next header.
            let gap = n.offset - at;
            if gap > 0 {
                let len = u32::try_from(gap.checked_sub(4)?).ok()?;
                if gap < 12 {
                    return None;
                }
                buf[at..at + 4].copy_from_slice(&len.to_le_bytes());
                buf[at + 4..at + 6].copy_from_slice(&4u16.to_le_bytes());
                buf[at + 6..at + 10].copy_from_slice(&u32::MAX.to_le_bytes());
                buf[at + 10] = 8;
            }
            buf[n.offset..n.offset + n.len].copy_from_slice(info.get(n.offset..n.offset + n.len)?);
            at = n.offset + n.len;
        }
        // SAFETY: the box is kept in `_owned` (dropped after every borrower) and its bytes do
        // not move when it is moved there.
        let r = unsafe { extend(&buf[..]) };
        self._owned.push(buf);
        Some(r)
    }

    fn frames(&mut self, probe: u64, index: Option<&UnitIndex>, out: &mut Vec<ResolvedFrame>) {
        let symbol = self.symbol(probe);
        if let Some(ctx) = self.context(probe, index) {
            if let Ok(mut iter) = ctx.find_frames(probe).skip_all_loads() {
                while let Ok(Some(frame)) = iter.next() {
                    let name = frame
                        .function
                        .as_ref()
                        .and_then(|f| f.raw_name().ok())
                        .map(|n| demangle(&n))
                        .or_else(|| symbol.map(demangle))
                        .unwrap_or_default();
                    let (filename, line) = frame
                        .location
                        .as_ref()
                        .map(|l| (l.file.unwrap_or("").to_owned(), l.line.unwrap_or(0) as i64))
                        .unwrap_or_default();
                    out.push(ResolvedFrame {
                        name,
                        filename,
                        line,
                    });
                }
            }
        }
        if out.is_empty() {
            if let Some(name) = symbol {
                out.push(ResolvedFrame {
                    name: demangle(name),
                    filename: String::new(),
                    line: 0,
                });
            }
        }
    }

    fn symbol(&self, probe: u64) -> Option<&'static str> {
        let i = self.symbols.partition_point(|s| s.0 <= probe);
        (i > 0).then(|| self.symbols[i - 1].1)
    }
}

/// Whether the abbreviation table at `offset` of `.debug_abbrev` declares a function's name
/// source (`DW_AT_abstract_origin`, `DW_AT_specification`) in a form that refers outside its
/// unit (`DW_FORM_ref_addr`, supplementary files): symbolization follows those. (Types refer out
/// too, often; symbolization never reads them.) Unreadable tables count as referring out (the
/// whole object's context then resolves the unit).
fn refers_to_other_units(abbrev: &[u8], offset: usize) -> bool {
    const OUTSIDE: [u64; 5] = [0x10, 0x1c, 0x20, 0x24, 0x1f20];
    const NAME_SOURCES: [u64; 2] = [0x31, 0x47];
    const IMPLICIT_CONST: u64 = 0x21;
    use gimli::Reader as _;
    let scan = || -> Option<bool> {
        let mut r = gimli::EndianSlice::new(abbrev.get(offset..)?, gimli::LittleEndian);
        loop {
            if r.read_uleb128().ok()? == 0 {
                return Some(false);
            }
            r.read_uleb128().ok()?; // tag
            r.read_u8().ok()?; // children
            loop {
                let attr = r.read_uleb128().ok()?;
                let form = r.read_uleb128().ok()?;
                if attr == 0 && form == 0 {
                    break;
                }
                if OUTSIDE.contains(&form) && NAME_SOURCES.contains(&attr) {
                    return Some(true);
                }
                if form == IMPLICIT_CONST {
                    r.read_sleb128().ok()?;
                }
            }
        }
    };
    scan().unwrap_or(true)
}

/// The vDSO's in-memory ELF image (it has no file). Its loadable segment ends before the
/// section headers, which hold the way to its symbol table: the image runs to the end of the
/// section header table, within the segment's last page (the kernel maps it whole).
fn vdso_image(obj: &LoadedObject) -> Option<&'static [u8]> {
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

/// Rust names lose their hash (`{:#}`); other names pass through.
fn demangle(raw: &str) -> String {
    match rustc_demangle::try_demangle(raw) {
        Ok(d) => format!("{d:#}"),
        Err(_) => raw.to_owned(),
    }
}

fn map_file(path: &Path) -> Option<Mmap> {
    let f = std::fs::File::open(path).ok()?;
    // SAFETY: the file is mapped read-only and private; a concurrent truncation of an object
    // file in use by this process is outside what any profiler can guard against.
    unsafe { Mmap::map(&f).ok() }
}

/// # Safety
/// The caller keeps the memory behind `b` alive and unmoved while the result is used.
unsafe fn extend(b: &[u8]) -> &'static [u8] {
    // SAFETY: forwarded to the caller.
    unsafe { std::slice::from_raw_parts(b.as_ptr(), b.len()) }
}

/// Where distributions put an object's debug info: by build id, then by `.gnu_debuglink`.
fn separate_debug_file(file: &object::File<'_>, path: Option<&Path>) -> Option<PathBuf> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves_addresses_in_the_vdso() {
        let vdso = loaded_objects()
            .into_iter()
            .find(|o| o.path.is_none() && o.name.contains("vdso"))
            .expect("a vDSO is mapped");
        let debug = DebugInfo::load(&vdso).expect("the vDSO's symbol table loads");
        let &(at, name) = debug
            .symbols
            .iter()
            .find(|(_, n)| n.contains("clock_gettime"))
            .expect("the vDSO has clock_gettime");
        let mut s = ProcessSymbolizer::new();
        let frames = s.pass(|s| s.resolve(vdso.base + at + 4));
        assert!(
            frames.iter().any(|f| f.name.contains("clock_gettime")),
            "{name} at {at:#x}: {frames:?}"
        );
    }

    #[inline(never)]
    fn a_known_function() -> u64 {
        std::hint::black_box(a_known_function as *const () as usize as u64)
    }

    #[test]
    fn resolves_this_function_with_file_and_line() {
        let addr = a_known_function() + 1;
        let mut s = ProcessSymbolizer::new();
        let frames = s.pass(|s| s.resolve(addr));
        assert!(!frames.is_empty());
        let last = frames.last().unwrap();
        assert!(last.name.ends_with("a_known_function"), "got {frames:?}");
        assert!(last.filename.ends_with("symbolize.rs"), "got {frames:?}");
        assert!(last.line > 0);
        assert!(
            !s.holds_debug_info(),
            "debug info must be released after the pass"
        );
        assert_eq!(s.cached_addresses(), 1);
        // Aging: CACHE_PASSES passes without a hit drop the entry.
        for _ in 0..CACHE_PASSES - 1 {
            s.pass(|_| ());
        }
        assert_eq!(s.cached_addresses(), 1);
        s.pass(|_| ());
        assert_eq!(s.cached_addresses(), 0);
    }

    /// Resolves addresses of `obj` (symbols and points inside them) through the unit index
    /// and through the whole object's context, asserts they read the same, and returns
    /// (addresses compared, with lines, through a single unit, through units in place).
    fn compare_with_whole_context(obj: &LoadedObject, all_in_place: bool) -> [usize; 4] {
        let mut unit_side = DebugInfo::load(obj).expect("debug info");
        unit_side.unit_budget = usize::MAX;
        let mut whole_side = DebugInfo::load(obj).expect("debug info");
        let mut index = unit_side.unit_index().expect("a unit index");
        if all_in_place {
            // Every unit laid out at its own offset among stand-ins, as units that name
            // functions from other units are.
            for u in &mut index.units {
                u.whole = true;
            }
        }
        assert!(index.units.len() > 10, "{} units", index.units.len());
        let symbols: Vec<u64> = unit_side.symbols.iter().map(|s| s.0).collect();
        let step = (symbols.len() / 1500).max(1);
        let mut n = [0usize; 4];
        for (k, &at) in symbols.iter().enumerate().step_by(step).take(1500) {
            for probe in [at, at + 1 + (k as u64 % 13)] {
                let mut a = Vec::new();
                let mut b = Vec::new();
                unit_side.frames(probe, Some(&index), &mut a);
                whole_side.frames(probe, None, &mut b);
                assert_eq!(a, b, "at {probe:#x}");
                n[0] += 1;
                n[1] += usize::from(a.iter().any(|f| f.line > 0));
                let u = index.unit_of(probe);
                n[2] += usize::from(u.is_some_and(|u| !u.whole));
                n[3] += usize::from(u.is_some_and(|u| u.whole));
            }
        }
        eprintln!(
            "{} addresses, {} with lines, {} through a single unit, {} through a unit among \
             stand-ins; {} units, {} ranges",
            n[0],
            n[1],
            n[2],
            n[3],
            index.units.len(),
            index.ranges.len()
        );
        n
    }

    /// Addresses resolved through their unit's context alone, or through their unit laid out
    /// at its offset with the units it names functions from, read exactly as through the whole
    /// object's context (names, files, lines, inlined frames).
    #[test]
    fn unit_contexts_resolve_like_the_whole_objects() {
        let me = a_known_function();
        let obj = loaded_objects()
            .into_iter()
            .find(|o| o.contains(me))
            .expect("this binary is loaded");
        let n = compare_with_whole_context(&obj, false);
        assert!(n[1] > n[0] / 4 && n[2] > n[0] / 4, "{n:?}");
        let n = compare_with_whole_context(&obj, true);
        assert!(n[1] > n[0] / 4 && n[3] > n[0] / 4, "{n:?}");
    }

    /// The same on another binary: `FERROPROF_SYMBOLIZE_CHECK=path cargo test -p ferroprof
    /// --lib -- --ignored unit_contexts_on_another` (e.g. the soak service, built with full
    /// debug info, whose units often name functions from other units).
    #[test]
    #[ignore = "needs FERROPROF_SYMBOLIZE_CHECK=<an ELF file with DWARF>"]
    fn unit_contexts_on_another_binary() {
        let path = std::env::var_os("FERROPROF_SYMBOLIZE_CHECK").expect("a path");
        let obj = LoadedObject {
            path: Some(PathBuf::from(path)),
            name: String::new(),
            base: 0,
            segments: Vec::new(),
            eh_frame_hdr: None,
            unwind_copy: None,
        };
        let n = compare_with_whole_context(&obj, false);
        assert!(n[1] > n[0] / 4, "{n:?}");
    }

    #[test]
    fn demangles_without_hash() {
        assert_eq!(
            demangle("_ZN4core3ptr13drop_in_place17h0123456789abcdefE"),
            "core::ptr::drop_in_place"
        );
        assert_eq!(demangle("memcpy"), "memcpy");
    }
}
