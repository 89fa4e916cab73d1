//! Resolving the addresses of one compilation unit in a single forward walk of its DWARF.
//!
//! A general-purpose resolver (addr2line) turns a unit into tables on first use: every row of
//! its line program, every function and every inlined call with their ranges. For a profiler
//! that meets a few dozen new addresses per export in a binary of hundreds of megabytes of
//! DWARF, those tables are most of an export's memory and they are thrown away after it. Here
//! the addresses of a unit are known up front (`prepare` hands all of a profile's addresses to
//! the symbolizer), so one pass over the unit's line program and one over its entries find
//! everything, keeping only what the addresses need: a few words per address.
//!
//! The answers are meant to be addr2line's (names through `DW_AT_linkage_name`, `DW_AT_name`,
//! `DW_AT_abstract_origin` and `DW_AT_specification`, inlined frames innermost first, call
//! sites as the outer frames' lines); the symbolizer's tests compare the two on whole binaries.
//! Beyond them, a frame says whether its name is a linkage name, where its function is declared
//! (`DW_AT_decl_line`), and for the physical frame where the function's code starts: with
//! `debug = "line-tables-only"` DWARF names functions without their path, and the symbolizer
//! then takes the symbol table's name of the function starting there.

use std::collections::HashMap;
use std::rc::Rc;

use gimli::AttributeValue;

use crate::symbolize::digest::Digest;

pub(crate) type Reader = gimli::EndianSlice<'static, gimli::RunTimeEndian>;

/// Deepest chain of `DW_AT_abstract_origin`/`DW_AT_specification` followed for a name.
const NAME_HOPS: usize = 16;

/// One frame of an address, innermost first: the function's raw (mangled) name when DWARF has
/// one, its file and line (0: unknown).
#[derive(Debug, Default)]
pub(crate) struct RawFrame {
    pub name: Option<Reader>,
    /// `name` is a linkage (mangled) name, not only `DW_AT_name`.
    pub linkage: bool,
    /// Line the function is declared at (0: unknown).
    pub decl_line: u32,
    /// The physical frame's: start of the function's code range holding the address.
    pub entry: Option<u64>,
    pub file: String,
    pub line: u32,
}

/// A function's name as its entries give it.
#[derive(Default)]
struct Named {
    name: Option<Reader>,
    linkage: bool,
    decl_line: u32,
}

/// Units other than the walked one, parsed when a name lives in them (`DW_FORM_ref_addr`).
pub(crate) struct OtherUnits<'a> {
    dwarf: &'a gimli::Dwarf<Reader>,
    /// Start of the unit holding a `.debug_info` offset.
    unit_start: &'a dyn Fn(usize) -> Option<usize>,
    parsed: HashMap<usize, Option<Rc<gimli::Unit<Reader>>>>,
}

impl<'a> OtherUnits<'a> {
    pub(crate) fn new(
        dwarf: &'a gimli::Dwarf<Reader>,
        unit_start: &'a dyn Fn(usize) -> Option<usize>,
    ) -> Self {
        OtherUnits {
            dwarf,
            unit_start,
            parsed: HashMap::new(),
        }
    }

    fn unit_at(&mut self, offset: usize) -> Option<Rc<gimli::Unit<Reader>>> {
        let start = (self.unit_start)(offset)?;
        let dwarf = self.dwarf;
        self.parsed
            .entry(start)
            .or_insert_with(|| {
                let header = dwarf
                    .debug_info
                    .header_from_offset(gimli::DebugInfoOffset(start))
                    .ok()?;
                dwarf.unit(header).ok().map(Rc::new)
            })
            .clone()
    }
}

/// What the walk found for one address.
#[derive(Default, Clone)]
struct Found {
    /// The subprogram holding it: (ordinal among the unit's subprograms, entry offset).
    function: Option<(u32, gimli::UnitOffset<usize>)>,
    /// Start of that subprogram's range holding it.
    entry: u64,
    /// Inlined calls holding it, outermost first.
    chain: Vec<Inlined>,
    /// Later subprograms holding it too (assembly gives each alias of a routine one).
    aliases: Vec<gimli::UnitOffset<usize>>,
    /// Line-table row: (file index, line).
    row: Option<(u64, u32)>,
}

#[derive(Clone)]
struct Inlined {
    entry: gimli::UnitOffset<usize>,
    call_file: Option<u64>,
    call_line: u32,
}

/// Ranges of an entry as its attributes give them.
#[derive(Default)]
struct Ranges {
    low: Option<u64>,
    high: Option<u64>,
    size: Option<u64>,
    list: Option<gimli::RangeListsOffset<usize>>,
}

impl Ranges {
    fn take(&mut self, unit: gimli::UnitRef<'_, Reader>, attr: &gimli::Attribute<Reader>) {
        match (attr.name(), attr.value()) {
            (gimli::DW_AT_low_pc, AttributeValue::Addr(a)) => self.low = Some(a),
            (gimli::DW_AT_low_pc, AttributeValue::DebugAddrIndex(i)) => {
                self.low = unit.address(i).ok()
            }
            (gimli::DW_AT_high_pc, AttributeValue::Addr(a)) => self.high = Some(a),
            (gimli::DW_AT_high_pc, AttributeValue::DebugAddrIndex(i)) => {
                self.high = unit.address(i).ok()
            }
            (gimli::DW_AT_high_pc, AttributeValue::Udata(n)) => self.size = Some(n),
            (gimli::DW_AT_ranges, v) => self.list = unit.attr_ranges_offset(v).ok().flatten(),
            _ => {}
        }
    }

    /// Calls `f` with each non-empty range.
    fn each(&self, unit: gimli::UnitRef<'_, Reader>, mut f: impl FnMut(u64, u64)) {
        if let Some(list) = self.list {
            if let Ok(mut it) = unit.ranges(list) {
                while let Ok(Some(r)) = it.next() {
                    if r.begin < r.end {
                        f(r.begin, r.end);
                    }
                }
            }
        } else if let (Some(b), Some(e)) = (self.low, self.high) {
            if b < e {
                f(b, e);
            }
        } else if let (Some(b), Some(n)) = (self.low, self.size) {
            // A -1 tombstone wraps around and reads as empty.
            let e = b.wrapping_add(n);
            if b < e {
                f(b, e);
            }
        }
    }
}

/// Indexes of the sorted `probes` in [begin, end).
fn probes_in(probes: &[u64], begin: u64, end: u64) -> std::ops::Range<usize> {
    let from = probes.partition_point(|&p| p < begin);
    let to = from + probes[from..].partition_point(|&p| p < end);
    from..to
}

/// Resolves `probes` (sorted, distinct, in the unit's address space) against `unit`: for each,
/// its frames innermost first, empty when the unit knows nothing of it.
pub(crate) fn resolve(
    dwarf: &gimli::Dwarf<Reader>,
    unit: &gimli::Unit<Reader>,
    probes: &[u64],
    others: &mut OtherUnits<'_>,
) -> Vec<Vec<RawFrame>> {
    let uref = gimli::UnitRef::new(dwarf, unit);
    let mut found = vec![Found::default(); probes.len()];
    walk_lines(unit, probes, &mut found);
    walk_entries(uref, probes, &mut found, None);
    found.iter().map(|f| frames_of(uref, f, others)).collect()
}

/// `resolve`, with the unit's `digest` in place of walking its line program and its entries:
/// only the entries of the subprograms holding a probe are read.
pub(crate) fn resolve_with(
    dwarf: &gimli::Dwarf<Reader>,
    unit: &gimli::Unit<Reader>,
    probes: &[u64],
    others: &mut OtherUnits<'_>,
    digest: &Digest<'_>,
) -> Vec<Vec<RawFrame>> {
    let uref = gimli::UnitRef::new(dwarf, unit);
    let mut found = vec![Found::default(); probes.len()];
    // The subprograms holding some probe: (entry offset, ordinal).
    let mut owners: Vec<(usize, u32)> = Vec::new();
    let mut held = Vec::new();
    for (f, &p) in found.iter_mut().zip(probes) {
        f.row = digest.row(p);
        digest.subprograms_at(p, &mut held);
        for &(_, begin, entry, ordinal) in &held {
            let Ok(entry) = usize::try_from(entry) else {
                continue;
            };
            if f.function.is_none() {
                f.function = Some((ordinal, gimli::UnitOffset(entry)));
                f.entry = begin;
                owners.push((entry, ordinal));
            } else {
                f.aliases.push(gimli::UnitOffset(entry));
            }
        }
    }
    owners.sort_unstable();
    owners.dedup();
    for (entry, ordinal) in owners {
        walk_entries(
            uref,
            probes,
            &mut found,
            Some((gimli::UnitOffset(entry), ordinal)),
        );
    }
    found.iter().map(|f| frames_of(uref, f, others)).collect()
}

/// The digest of `unit` (see `digest`): its whole line program and every subprogram's ranges.
/// `None` when the unit is too large for one.
pub(crate) fn digest(dwarf: &gimli::Dwarf<Reader>, unit: &gimli::Unit<Reader>) -> Option<Vec<u8>> {
    let uref = gimli::UnitRef::new(dwarf, unit);
    let mut segments = Vec::new();
    line_segments(unit, |from, to, file, line| {
        segments.push((from, to, file, line));
        false
    });
    let mut ranges = Vec::new();
    let mut entries = uref.entries_raw(None).ok()?;
    let mut ordinal = 0u32;
    while !entries.is_empty() {
        let offset = entries.next_offset();
        let abbrev = entries.read_abbreviation().ok()?;
        let Some(abbrev) = abbrev else {
            continue;
        };
        if abbrev.tag() == gimli::DW_TAG_subprogram {
            let r = subprogram_ranges(uref, &mut entries, abbrev.attributes())?;
            r.each(uref, |b, e| ranges.push((b, e, offset.0 as u64, ordinal)));
            ordinal += 1;
        } else {
            entries.skip_attributes(abbrev.attributes()).ok()?;
        }
    }
    crate::symbolize::digest::encode(&segments, &ranges)
}

/// The line program, row by row: an address takes the last row at or below it in the sequence
/// that spans it (of rows at one address, the last).
fn walk_lines(unit: &gimli::Unit<Reader>, probes: &[u64], found: &mut [Found]) {
    // A probe keeps the first row assigned to it, so the walk ends once every probe has one
    // (a unit with a few probes is read about half-way on average).
    let mut left = probes.len();
    line_segments(unit, |from, to, file, line| {
        for i in probes_in(probes, from, to) {
            if found[i].row.is_none() {
                found[i].row = Some((file, line));
                left -= 1;
            }
        }
        left == 0
    });
}

/// Hands `assign` each address range [from, to) of the line program with its row's (file,
/// line), in program order, until it returns true.
fn line_segments(unit: &gimli::Unit<Reader>, mut assign: impl FnMut(u64, u64, u64, u32) -> bool) {
    let Some(program) = unit.line_program.clone() else {
        return;
    };
    let mut rows = program.rows();
    // The row in force: (address, file, line).
    let mut current: Option<(u64, u64, u32)> = None;
    while let Ok(Some((_, row))) = rows.next_row() {
        let address = row.address();
        if row.end_sequence() {
            if let Some((at, file, line)) = current.take() {
                if assign(at, address, file, line) {
                    return;
                }
            }
            continue;
        }
        let line = row.line().map_or(0, |l| l.get() as u32);
        if let Some((at, file, l)) = current {
            if address > at && assign(at, address, file, l) {
                return;
            }
        }
        current = Some((address, row.file_index(), line));
    }
}

/// Reads a subprogram's ranges from its attributes (`specs`), skipping the others together,
/// most of them by their size. `None` on malformed DWARF.
fn subprogram_ranges(
    unit: gimli::UnitRef<'_, Reader>,
    entries: &mut gimli::EntriesRaw<'_, Reader>,
    specs: &[gimli::AttributeSpecification],
) -> Option<Ranges> {
    let mut ranges = Ranges::default();
    let mut from = 0;
    for (i, spec) in specs.iter().enumerate() {
        if !matches!(
            spec.name(),
            gimli::DW_AT_low_pc | gimli::DW_AT_high_pc | gimli::DW_AT_ranges
        ) {
            continue;
        }
        entries.skip_attributes(&specs[from..i]).ok()?;
        ranges.take(unit, &entries.read_attribute(*spec).ok()?);
        from = i + 1;
    }
    entries.skip_attributes(&specs[from..]).ok()?;
    Some(ranges)
}

/// What an open entry of the walk is to the entries under it.
enum Open {
    /// A subprogram; whether any probe is in it.
    Function {
        ordinal: u32,
        hit: bool,
    },
    Inlined,
}

/// The unit's entries, depth first: every subprogram (at any depth) claims the probes in its
/// ranges that no earlier one claimed; inlined calls under it extend those probes' chains.
/// With `subtree` (a subprogram's offset and ordinal), only that subprogram's entries, the
/// probes' subprograms being known already (from a digest).
fn walk_entries(
    unit: gimli::UnitRef<'_, Reader>,
    probes: &[u64],
    found: &mut [Found],
    subtree: Option<(gimli::UnitOffset<usize>, u32)>,
) {
    let Ok(mut entries) = unit.entries_raw(subtree.map(|s| s.0)) else {
        return;
    };
    let mut open: Vec<(isize, Open)> = Vec::new();
    let mut ordinal = subtree.map_or(0, |s| s.1);
    // For the walk's early end: probes no subprogram holds yet, open subprograms holding some.
    let mut unplaced = probes.len();
    let mut open_hits = 0usize;
    // Whether a later subprogram may still matter to a placed probe: an alias (C and assembly
    // name one routine several times); rustc gives each function one subprogram.
    let mut aliases_possible = true;
    let mut first = true;
    while !entries.is_empty() {
        let offset = entries.next_offset();
        let depth = entries.next_depth();
        if subtree.is_some() && !first && depth <= 0 {
            return; // past the subprogram's last child
        }
        first = false;
        let Ok(abbrev) = entries.read_abbreviation() else {
            return;
        };
        let Some(abbrev) = abbrev else {
            continue; // a null entry ends a list of children
        };
        while open.last().is_some_and(|(d, _)| *d >= depth) {
            if let Some((_, Open::Function { hit: true, .. })) = open.pop() {
                open_hits -= 1;
            }
        }
        if subtree.is_none() && unplaced == 0 && open_hits == 0 && !aliases_possible {
            // Every probe has its subprogram, and the entries under those (their inlined
            // calls) are behind: nothing further changes an answer.
            return;
        }
        match abbrev.tag() {
            gimli::DW_TAG_subprogram if subtree.is_some() => {
                if entries.skip_attributes(abbrev.attributes()).is_err() {
                    return;
                }
                let hit = found
                    .iter()
                    .any(|f| f.function.is_some_and(|(o, _)| o == ordinal));
                open_hits += usize::from(hit);
                open.push((depth, Open::Function { ordinal, hit }));
                ordinal += 1;
            }
            gimli::DW_TAG_subprogram => {
                let Some(ranges) = subprogram_ranges(unit, &mut entries, abbrev.attributes())
                else {
                    return;
                };
                let mut hit = false;
                ranges.each(unit, |b, e| {
                    for i in probes_in(probes, b, e) {
                        if found[i].function.is_none() {
                            found[i].function = Some((ordinal, offset));
                            found[i].entry = b;
                            hit = true;
                            unplaced -= 1;
                        } else {
                            found[i].aliases.push(offset);
                        }
                    }
                });
                open_hits += usize::from(hit);
                open.push((depth, Open::Function { ordinal, hit }));
                ordinal += 1;
            }
            gimli::DW_TAG_inlined_subroutine => {
                // The subprogram it belongs to, and how many inlined calls lie between.
                let mut level = 0usize;
                let mut owner = None;
                for (_, o) in open.iter().rev() {
                    match o {
                        Open::Inlined => level += 1,
                        Open::Function { ordinal, hit } => {
                            owner = hit.then_some(*ordinal);
                            break;
                        }
                    }
                }
                let Some(owner) = owner else {
                    if entries.skip_attributes(abbrev.attributes()).is_err() {
                        return;
                    }
                    open.push((depth, Open::Inlined));
                    continue;
                };
                let mut ranges = Ranges::default();
                let mut call_file = None;
                let mut call_line = 0;
                for spec in abbrev.attributes() {
                    let Ok(attr) = entries.read_attribute(*spec) else {
                        return;
                    };
                    match attr.name() {
                        gimli::DW_AT_call_file => {
                            if let AttributeValue::FileIndex(fi) = attr.value() {
                                // File 0 means "none" before DWARF 5.
                                if fi > 0 || unit.header.version() >= 5 {
                                    call_file = Some(fi);
                                }
                            }
                        }
                        gimli::DW_AT_call_line => {
                            call_line = attr.udata_value().unwrap_or(0) as u32;
                        }
                        _ => ranges.take(unit, &attr),
                    }
                }
                ranges.each(unit, |b, e| {
                    for i in probes_in(probes, b, e) {
                        let f = &mut found[i];
                        if f.function.is_some_and(|(o, _)| o == owner) && f.chain.len() == level {
                            f.chain.push(Inlined {
                                entry: offset,
                                call_file,
                                call_line,
                            });
                        }
                    }
                });
                open.push((depth, Open::Inlined));
            }
            gimli::DW_TAG_compile_unit if depth == 0 => {
                for spec in abbrev.attributes() {
                    let Ok(attr) = entries.read_attribute(*spec) else {
                        return;
                    };
                    if let (gimli::DW_AT_language, AttributeValue::Language(l)) =
                        (attr.name(), attr.value())
                    {
                        aliases_possible = l != gimli::DW_LANG_Rust;
                    }
                }
            }
            _ => {
                if entries.skip_attributes(abbrev.attributes()).is_err() {
                    return;
                }
            }
        }
    }
}

fn frames_of(
    unit: gimli::UnitRef<'_, Reader>,
    f: &Found,
    others: &mut OtherUnits<'_>,
) -> Vec<RawFrame> {
    let row_place = |row: Option<(u64, u32)>| match row {
        Some((file, line)) => (file_name(unit, file).unwrap_or_default(), line),
        None => (String::new(), 0),
    };
    let Some((_, mut function)) = f.function else {
        return match f.row {
            Some(_) => {
                let (file, line) = row_place(f.row);
                vec![RawFrame {
                    file,
                    line,
                    ..RawFrame::default()
                }]
            }
            None => Vec::new(),
        };
    };
    if f.chain.is_empty() && !f.aliases.is_empty() {
        // One routine under several names: the plainest (`clone3`, not `__GI___clone3`).
        let mut underscores = |at| {
            entry_name(unit, at, others).name.map_or(usize::MAX, |n| {
                n.slice().iter().take_while(|&&c| c == b'_').count()
            })
        };
        let mut best = underscores(function);
        for &a in &f.aliases {
            let u = underscores(a);
            if u < best {
                (function, best) = (a, u);
            }
        }
    }
    let mut out = Vec::with_capacity(f.chain.len() + 1);
    let mut place = row_place(f.row);
    for inl in f.chain.iter().rev() {
        let named = entry_name(unit, inl.entry, others);
        out.push(RawFrame {
            name: named.name,
            linkage: named.linkage,
            decl_line: named.decl_line,
            entry: None,
            file: place.0,
            line: place.1,
        });
        let file = inl
            .call_file
            .and_then(|fi| file_name(unit, fi))
            .unwrap_or_default();
        place = (file, inl.call_line);
    }
    let named = entry_name(unit, function, others);
    out.push(RawFrame {
        name: named.name,
        linkage: named.linkage,
        decl_line: named.decl_line,
        entry: Some(f.entry),
        file: place.0,
        line: place.1,
    });
    out
}

/// A subprogram's or inlined call's name: its linkage name, else its name, else its origin's
/// (as addr2line reads it: an origin met before a name is taken); its declaration line, else its
/// origin's.
fn entry_name(
    unit: gimli::UnitRef<'_, Reader>,
    at: gimli::UnitOffset<usize>,
    others: &mut OtherUnits<'_>,
) -> Named {
    let mut named = Named::default();
    let Ok(mut entries) = unit.entries_raw(Some(at)) else {
        return named;
    };
    let Ok(Some(abbrev)) = entries.read_abbreviation() else {
        return named;
    };
    // An origin not followed yet (its name was not needed).
    let mut origin = None;
    for spec in abbrev.attributes() {
        let Ok(attr) = entries.read_attribute(*spec) else {
            return named;
        };
        match attr.name() {
            gimli::DW_AT_linkage_name | gimli::DW_AT_MIPS_linkage_name => {
                if let Ok(v) = unit.attr_string(attr.value()) {
                    named.name = Some(v);
                    named.linkage = true;
                }
            }
            gimli::DW_AT_name if named.name.is_none() => {
                named.name = unit.attr_string(attr.value()).ok();
            }
            gimli::DW_AT_decl_line => {
                named.decl_line = attr.udata_value().unwrap_or(0) as u32;
            }
            gimli::DW_AT_abstract_origin | gimli::DW_AT_specification => {
                if named.name.is_none() {
                    let o = origin_name(unit, attr.value(), others, NAME_HOPS);
                    named.name = o.name;
                    named.linkage = o.linkage;
                    if named.decl_line == 0 {
                        named.decl_line = o.decl_line;
                    }
                } else {
                    origin = Some(attr.value());
                }
            }
            _ => {}
        }
    }
    if named.decl_line == 0 {
        if let Some(o) = origin {
            named.decl_line = origin_name(unit, o, others, NAME_HOPS).decl_line;
        }
    }
    named
}

/// The name an origin (`DW_AT_abstract_origin`/`DW_AT_specification` value) gives.
fn origin_name(
    unit: gimli::UnitRef<'_, Reader>,
    value: AttributeValue<Reader>,
    others: &mut OtherUnits<'_>,
    hops: usize,
) -> Named {
    if hops == 0 {
        return Named::default();
    }
    match value {
        AttributeValue::UnitRef(at) => declared_name(unit, at, others, hops),
        AttributeValue::DebugInfoRef(o) => {
            let Some(other) = others.unit_at(o.0) else {
                return Named::default();
            };
            let Some(at) = o.to_unit_offset(&other.header) else {
                return Named::default();
            };
            let r = gimli::UnitRef::new(unit.dwarf, &other);
            declared_name(r, at, others, hops)
        }
        _ => Named::default(),
    }
}

/// A declaration's name: its linkage name, else its name, else its own origin's; its
/// declaration line, else its origin's.
fn declared_name(
    unit: gimli::UnitRef<'_, Reader>,
    at: gimli::UnitOffset<usize>,
    others: &mut OtherUnits<'_>,
    hops: usize,
) -> Named {
    let mut named = Named::default();
    let Ok(mut entries) = unit.entries_raw(Some(at)) else {
        return named;
    };
    let Ok(Some(abbrev)) = entries.read_abbreviation() else {
        return named;
    };
    let mut name = None;
    let mut origin = None;
    for spec in abbrev.attributes() {
        let Ok(attr) = entries.read_attribute(*spec) else {
            return named;
        };
        match attr.name() {
            // The first linkage name wins (addr2line stops there).
            gimli::DW_AT_linkage_name | gimli::DW_AT_MIPS_linkage_name if !named.linkage => {
                if let Ok(v) = unit.attr_string(attr.value()) {
                    named.name = Some(v);
                    named.linkage = true;
                }
            }
            gimli::DW_AT_name => {
                if let Ok(v) = unit.attr_string(attr.value()) {
                    name = Some(v);
                }
            }
            gimli::DW_AT_decl_line => {
                named.decl_line = attr.udata_value().unwrap_or(0) as u32;
            }
            gimli::DW_AT_abstract_origin | gimli::DW_AT_specification => {
                origin = Some(attr.value())
            }
            _ => {}
        }
    }
    if !named.linkage {
        named.name = name;
    }
    let need_origin = named.name.is_none() || named.decl_line == 0;
    if let (true, Some(o)) = (need_origin, origin) {
        let o = origin_name(unit, o, others, hops - 1);
        if named.name.is_none() {
            named.name = o.name;
            named.linkage = o.linkage;
        }
        if named.decl_line == 0 {
            named.decl_line = o.decl_line;
        }
    }
    named
}

/// File `index` of the unit's line program as a path: the unit's directory, the file's
/// directory, the file's name, each later one replacing the path when absolute.
fn file_name(unit: gimli::UnitRef<'_, Reader>, index: u64) -> Option<String> {
    let header = unit.line_program.as_ref()?.header();
    let file = header.file(index)?;
    let text = |v: AttributeValue<Reader>| -> Option<String> {
        let s = unit.attr_string(v).ok()?;
        Some(s.to_string_lossy().into_owned())
    };
    let mut path = match &unit.comp_dir {
        Some(d) => d.to_string_lossy().into_owned(),
        None => String::new(),
    };
    // Directory 0 is the unit's own.
    if file.directory_index() != 0 {
        if let Some(dir) = file.directory(header) {
            join(&mut path, &text(dir)?);
        }
    }
    join(&mut path, &text(file.path_name())?);
    Some(path)
}

fn join(path: &mut String, part: &str) {
    let rooted = |p: &str| {
        p.starts_with('/')
            || p.starts_with('\\')
            || p.get(1..3) == Some(":/")
            || p.get(1..3) == Some(":\\")
    };
    if rooted(part) {
        path.clear();
        path.push_str(part);
        return;
    }
    let windows = path.starts_with('\\') || path.get(1..3) == Some(":\\");
    let sep = if windows { '\\' } else { '/' };
    if !path.is_empty() && !path.ends_with(sep) {
        path.push(sep);
    }
    path.push_str(part);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_join_like_the_compiler_wrote_them() {
        let mut p = String::from("/src/app");
        join(&mut p, "lib");
        join(&mut p, "x.rs");
        assert_eq!(p, "/src/app/lib/x.rs");
        join(&mut p, "/abs/y.rs");
        assert_eq!(p, "/abs/y.rs");
        let mut q = String::new();
        join(&mut q, "rel.rs");
        assert_eq!(q, "rel.rs");
    }

    #[test]
    fn probes_in_a_range() {
        let p = [1, 5, 9, 12];
        assert_eq!(probes_in(&p, 5, 12), 1..3);
        assert_eq!(probes_in(&p, 0, 1), 0..0);
        assert_eq!(probes_in(&p, 13, 20), 4..4);
    }
}
