//! Turning sampled addresses into function names, files and lines, off the hot path.
//!
//! Samplers record bare addresses; the export thread symbolizes them while the recorder encodes
//! a profile (`StackRecorder::serialize(Some(&mut symbolizer))`), which hands over all of the
//! profile's addresses first (`Symbolizer::prepare`). For each loaded object the DWARF of its
//! file (or of its separate debug file, found by build id or `.gnu_debuglink`) is
//! memory-mapped; the addresses not in the cache are grouped by compilation unit and each unit
//! is walked once for all of them (`crate::symbolize::dwarf_walk`), inlined frames innermost first, Rust
//! names demangled without their hash. Frames DWARF does not name, and objects without DWARF,
//! take the symbol table's name (within the symbol's size); other addresses get
//! `object+0xoffset` of the entry of their function where the unwind table (`.eh_frame_hdr`)
//! knows it, else of themselves, or their address outside every object.
//!
//! Names are fully qualified at every debug level: a function's linkage name (`system_name`)
//! comes from DWARF when it has one; with `debug = "line-tables-only"` it has only the short
//! `DW_AT_name` (`encode`), and the physical frame takes the symbol table's name of the function
//! that starts where its code starts (`<app::Rle as app::Codec>::encode`). Inlined frames keep
//! what DWARF gives. Each address's object is a pprof mapping ([`Symbolizer::mapping`]): its
//! executable segment, file, build id, and what its frames could be given.
//!
//! Memory: no per-unit tables are built. The mapped files live for one *pass* (one
//! serialization) and their pages are handed back every few units walked; the little a pass
//! allocates lives in the profiler's private arena (see `crate::alloc::arena`), released at its
//! end. What stays is a per-address cache of resolved frames, bounded in entries and aged
//! (CACHE_PASSES), emptied when an object was unloaded (another may take its addresses), and each
//! object's unit index.

mod debug_info;
pub(crate) mod digest;
pub(crate) mod disk_cache;
pub(crate) mod dwarf_walk;
pub mod foreign;
mod inflate;
mod names;

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferroprof_recorder::{MappingInfo, ResolvedFrame, Symbolizer};
use memmap2::Mmap;
use object::{Object, ObjectSection, ObjectSymbol, ObjectSymbolTable};

use crate::modules::{loaded_objects, LoadedObject};
use dwarf_walk::Reader;

use debug_info::*;
use inflate::*;
use names::*;

/// Most addresses kept in the cache between passes.
const MAX_CACHED_ADDRESSES: usize = 16 * 1024;
/// Passes an address stays cached without being used. A pass that meets uncached addresses
/// walks the units they fall in, so addresses that come back now and then should stay: with an
/// aging of two passes a service resolved some 70 addresses again at every export.
const CACHE_PASSES: u64 = 120;

/// A [`Symbolizer`] for the current process: addresses to inlined frames, demangled names,
/// files and lines from each loaded object's DWARF (or its separate debug file, or its symbol
/// table), with a cache of resolved addresses kept between passes.
pub struct ProcessSymbolizer {
    cache: HashMap<u64, CacheEntry>,
    /// The cached frames' strings.
    strings: Strings,
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
    /// The loaded objects' code as pprof mappings, kept across passes.
    mappings: Mappings,
    /// Where inflated debug sections are kept for later processes (see `disk_cache`).
    debug_cache: Option<Arc<Path>>,
    /// Another process's objects, read again at each pass, for a symbolizer of that process
    /// (`for_process`); `None`: this process's, from the loader.
    foreign: Option<Foreign>,
}

/// The process a `for_process` symbolizer names addresses of, and its objects at the last pass.
struct Foreign {
    pid: i32,
    objects: Vec<LoadedObject>,
    /// The files `objects` name through `/proc/self/fd`, kept open.
    _files: Vec<foreign::MappedFile>,
}

/// One pprof mapping per executable segment of each loaded object, kept across passes and read
/// again when the loader's list changed.
#[derive(Default)]
struct Mappings {
    /// The loader's (loads, unloads) counters the list was read at; `None`: not read yet.
    generation: Option<(u64, u64)>,
    /// (object base, loader's name, mapping), sorted by memory start.
    list: Vec<(u64, String, MappingInfo)>,
}

impl Mappings {
    /// Reads the list again when the loader's changed; `foreign`: another process's objects
    /// instead (the list is cleared by the symbolizer when they change), named by their path in
    /// that process.
    fn refresh(&mut self, foreign: Option<&[LoadedObject]>) {
        let generation = match foreign {
            Some(_) => (u64::MAX, u64::MAX),
            None => crate::modules::objects_generation(),
        };
        if self.generation == Some(generation) {
            return;
        }
        let old = std::mem::take(&mut self.list);
        let objects = match foreign {
            Some(f) => f.to_vec(),
            None => loaded_objects(),
        };
        for obj in objects {
            let filename = match &obj.path {
                _ if foreign.is_some() => obj.name.clone(),
                Some(p) => p.to_string_lossy().into_owned(),
                // The vDSO: named as in /proc/self/maps, which viewers know not to open.
                None if obj.name.contains("vdso") => "[vdso]".to_owned(),
                None => format!("[{}]", obj.name),
            };
            let build_id = hex(&obj.build_id);
            for seg in obj.segments.iter().filter(|s| s.flags & libc::PF_X != 0) {
                // Page-aligned, as /proc/self/maps shows it (start and offset stay congruent).
                let lead = seg.start % PAGE;
                let mut info = MappingInfo {
                    memory_start: seg.start - lead,
                    memory_limit: seg.end.next_multiple_of(PAGE),
                    file_offset: seg.offset.saturating_sub(lead),
                    filename: filename.clone(),
                    build_id: build_id.clone(),
                    ..MappingInfo::default()
                };
                // What the symbolizer found for a surviving object stays known.
                if let Some((_, _, was)) = old.iter().find(|(b, n, m)| {
                    *b == obj.base && *n == obj.name && m.memory_start == info.memory_start
                }) {
                    info.has_functions = was.has_functions;
                    info.has_filenames = was.has_filenames;
                    info.has_line_numbers = was.has_line_numbers;
                    info.has_inline_frames = was.has_inline_frames;
                }
                self.list.push((obj.base, obj.name.clone(), info));
            }
        }
        self.list.sort_by_key(|m| m.2.memory_start);
        self.generation = Some(generation);
    }

    /// Records what the object at `base` named `name` gives its frames: names (`functions`),
    /// files, lines and inlined frames (`dwarf`).
    fn set_flags(&mut self, base: u64, name: &str, functions: bool, dwarf: bool) {
        for (_, _, m) in self
            .list
            .iter_mut()
            .filter(|(b, n, _)| *b == base && n == name)
        {
            m.has_functions = functions;
            m.has_filenames = dwarf;
            m.has_line_numbers = dwarf;
            m.has_inline_frames = dwarf;
        }
    }

    fn find(&self, address: u64) -> Option<&MappingInfo> {
        let i = self.list.partition_point(|m| m.2.memory_start <= address);
        let m = &self.list.get(i.checked_sub(1)?)?.2;
        (address < m.memory_limit).then_some(m)
    }

    fn bytes(&self) -> usize {
        self.list.capacity() * std::mem::size_of::<(u64, String, MappingInfo)>()
            + self
                .list
                .iter()
                .map(|(_, n, m)| n.capacity() + m.filename.capacity() + m.build_id.capacity())
                .sum::<usize>()
    }
}

/// Most threads resolving objects at once (see `resolve_objects`).
const MAX_SYMBOLIZE_THREADS: usize = 4;

/// Bytes of unit entries a pass walks before it hands the mapped files' pages back. Each
/// `madvise` scans the whole mapping and the next unit faults the shared sections (names,
/// abbreviations) in again: after every unit, that was about a sixth of ripgrep's walk. The
/// resident pages this leaves are those few units' entries, line programs and strings.
const FORGET_AFTER_BYTES: usize = 2 << 20;

/// Unit bytes below which one object's units are walked on one thread.
const PARALLEL_WALK_BYTES: usize = 256 << 10;

/// Bytes of new unit digests one pass of one object holds until it stores them: past them, its
/// further new units are walked as without a cache (a first run of a large program could
/// otherwise hold hundreds of megabytes of them).
const DIGEST_PASS_BYTES: usize = 64 << 20;

/// Alignment of the mappings: the smallest page size, so start and file offset stay congruent
/// whatever the system's.
const PAGE: u64 = 4096;

struct CacheEntry {
    frames: Box<[CachedFrame]>,
    last_pass: u64,
}

/// A resolved frame as the cache keeps it: its strings shared through [`Strings`]. The
/// addresses of one function share its names and file, and most frames share a few files: as
/// three owned strings per frame, the cache held about 1.2 KB per address.
struct CachedFrame {
    name: Arc<str>,
    system_name: Arc<str>,
    filename: Arc<str>,
    line: i64,
    start_line: i64,
}

impl CachedFrame {
    fn to_resolved(&self) -> ResolvedFrame {
        ResolvedFrame {
            name: self.name.as_ref().to_owned(),
            system_name: self.system_name.as_ref().to_owned(),
            filename: self.filename.as_ref().to_owned(),
            line: self.line,
            start_line: self.start_line,
        }
    }
}

/// The cache's strings, each kept once. A string no cached frame uses any more goes at the end
/// of the pass that dropped its last user.
#[derive(Default)]
struct Strings(HashSet<Arc<str>>);

impl Strings {
    fn get(&mut self, s: &str) -> Arc<str> {
        if let Some(a) = self.0.get(s) {
            return a.clone();
        }
        let a: Arc<str> = Arc::from(s);
        self.0.insert(a.clone());
        a
    }

    fn frame(&mut self, f: &ResolvedFrame) -> CachedFrame {
        CachedFrame {
            name: self.get(&f.name),
            system_name: self.get(&f.system_name),
            filename: self.get(&f.filename),
            line: f.line,
            start_line: f.start_line,
        }
    }

    fn entry(&mut self, frames: &[ResolvedFrame], last_pass: u64) -> CacheEntry {
        CacheEntry {
            frames: frames.iter().map(|f| self.frame(f)).collect(),
            last_pass,
        }
    }

    /// Drops the strings only this table still holds.
    fn trim(&mut self) {
        self.0.retain(|a| Arc::strong_count(a) > 1);
        if self.0.capacity() > 4 * self.0.len().max(64) {
            self.0.shrink_to_fit();
        }
    }

    fn bytes(&self) -> usize {
        // Each Arc<str> allocation: two counters and the bytes.
        self.0.capacity() * (std::mem::size_of::<Arc<str>>() + 1)
            + self.0.iter().map(|a| 16 + a.len()).sum::<usize>()
    }
}

impl Default for ProcessSymbolizer {
    fn default() -> Self {
        Self::new()
    }
}

impl ProcessSymbolizer {
    /// A symbolizer with an empty cache; objects are read at the first pass.
    pub fn new() -> Self {
        ProcessSymbolizer {
            cache: HashMap::new(),
            strings: Strings::default(),
            pass: 0,
            objects: None,
            max_entries: MAX_CACHED_ADDRESSES,
            resolved: 0,
            unloads: 0,
            arena_owner: crate::alloc::arena::new_owner(),
            indexes: HashMap::new(),
            kept_bytes: 0,
            mappings: Mappings::default(),
            debug_cache: None,
            foreign: None,
        }
    }

    /// A symbolizer of process `pid`'s addresses (the process keeps running): its objects are
    /// read from `/proc/PID/maps` and the files it maps, again at every pass (see `foreign`).
    pub fn for_process(pid: i32) -> std::io::Result<Self> {
        let files = foreign::mapped_files(pid)?;
        let objects = files.iter().map(foreign::MappedFile::to_loaded).collect();
        let mut s = Self::new();
        s.foreign = Some(Foreign {
            pid,
            objects,
            _files: files,
        });
        Ok(s)
    }

    /// Keeps inflated debug sections in `dir` (see `disk_cache`).
    pub fn with_debug_cache_dir(self, dir: Option<PathBuf>) -> Self {
        self.with_debug_cache(dir.map(Arc::from))
    }

    /// Keeps the compressed debug sections it inflates in `dir` (by build id) and maps them
    /// from there when a later pass or process needs them again (see `disk_cache`).
    pub(crate) fn with_debug_cache(mut self, dir: Option<Arc<Path>>) -> Self {
        self.debug_cache = dir;
        self
    }

    /// Runs `f` as one pass: debug info loaded during it is released when it returns.
    pub fn pass<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        if let Some(fo) = &mut self.foreign {
            // A process that ended keeps the objects it had (their files are still open).
            let files = foreign::mapped_files(fo.pid).unwrap_or_default();
            let now: Vec<LoadedObject> = files.iter().map(foreign::MappedFile::to_loaded).collect();
            let key = |v: &[LoadedObject]| -> Vec<(u64, String)> {
                v.iter().map(|o| (o.base, o.name.clone())).collect()
            };
            if key(&now) != key(&fo.objects) && !now.is_empty() {
                fo.objects = now;
                fo._files = files;
                self.cache.clear();
                self.strings = Strings::default();
                self.indexes.clear();
                self.mappings = Mappings::default();
            }
        }
        let unloads = crate::modules::objects_generation().1;
        if self.foreign.is_none() && unloads != self.unloads {
            self.unloads = unloads;
            self.cache.clear();
            self.strings = Strings::default();
            self.indexes.clear();
            // What was found of an unloaded object must not pass to another at its place.
            self.mappings = Mappings::default();
        }
        self.pass += 1;
        let r = f(self);
        self.end_pass();
        r
    }

    fn end_pass(&mut self) {
        // Arena memory (see `lookup`): dropped, then its pages handed back; left to the exit
        // of a process that ends now (unmapping the files, freeing the tables).
        if crate::threads::PROCESS_ENDING.load(std::sync::atomic::Ordering::Relaxed) {
            std::mem::forget(self.objects.take());
        }
        self.objects = None;
        crate::alloc::arena::release(self.arena_owner);
        let pass = self.pass;
        self.cache.retain(|_, e| e.last_pass + CACHE_PASSES > pass);
        if self.max_entries == 0 {
            // No budget (select_nth_unstable below needs an index inside the slice).
            self.cache.clear();
        } else if self.cache.len() > self.max_entries {
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
        self.strings.trim();
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
            n += e.frames.len() * size_of::<CachedFrame>();
        }
        n += self.strings.bytes();
        n += self.mappings.bytes();
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

    /// Resolves addresses not in the cache, all at once: the DWARF of each unit they fall in is
    /// walked once for all of them. What this loads and allocates meanwhile lives in the arena
    /// (released at the end of the pass, see `crate::alloc::arena`); the frames are copied out to the
    /// heap. `addresses` are sorted and distinct.
    fn lookup(&mut self, addresses: &[u64]) -> Vec<Box<[ResolvedFrame]>> {
        self.resolved += addresses.len() as u64;
        let owner = self.arena_owner;
        let found = crate::alloc::arena::with(owner, || self.lookup_in_arena(addresses));
        let owned: Vec<Box<[ResolvedFrame]>> = found
            .iter()
            .map(|frames| {
                frames
                    .iter()
                    .map(|f| ResolvedFrame {
                        name: f.name.as_str().to_owned(),
                        system_name: f.system_name.as_str().to_owned(),
                        filename: f.filename.as_str().to_owned(),
                        line: f.line,
                        start_line: f.start_line,
                    })
                    .collect()
            })
            .collect();
        drop(found);
        // A location's innermost frames of the allocator path go (see `crate::frame_names`).
        let owned: Vec<Box<[ResolvedFrame]>> = owned
            .into_iter()
            .map(crate::frame_names::strip_inlined_allocator)
            .collect();
        debug_assert!(owned
            .iter()
            .flatten()
            .all(|f| [&f.name, &f.system_name, &f.filename]
                .iter()
                .all(|s| !crate::alloc::arena::owns(s.as_ptr() as *mut u8))));
        owned
    }

    fn lookup_in_arena(&mut self, addresses: &[u64]) -> Vec<Vec<ResolvedFrame>> {
        let foreign = self.foreign.as_ref().map(|f| &f.objects);
        let objects = self.objects.get_or_insert_with(|| {
            foreign
                .cloned()
                .unwrap_or_else(loaded_objects)
                .into_iter()
                .map(|obj| ObjectDebug { obj, debug: None })
                .collect()
        });
        let mut out: Vec<Vec<ResolvedFrame>> = (0..addresses.len()).map(|_| Vec::new()).collect();
        // Addresses by object (sorted addresses stay sorted within each).
        let mut by_object: Vec<(usize, usize)> = Vec::with_capacity(addresses.len());
        for (k, &a) in addresses.iter().enumerate() {
            if let Some(name) = crate::unwind::marker_name(a) {
                // The unwinder's mark where it cut a stack too deep for its buffer.
                out[k].push(ResolvedFrame {
                    name,
                    ..ResolvedFrame::default()
                });
                continue;
            }
            match objects.iter().position(|o| o.obj.contains(a)) {
                Some(i) => by_object.push((i, k)),
                // In no loaded object (JIT code, an unloaded library, a bad frame): named by
                // its address, so that no viewer takes the location for one left to symbolize
                // (`go tool pprof` would ask the server's /debug/pprof/symbol for it).
                None => out[k].push(ResolvedFrame {
                    name: format!("{a:#x}"),
                    ..ResolvedFrame::default()
                }),
            }
        }
        by_object.sort_unstable();
        let mut jobs: Vec<Job<'_>> = Vec::new();
        let mut groups = by_object.chunk_by(|a, b| a.0 == b.0).peekable();
        for (i, od) in objects.iter_mut().enumerate() {
            let Some(group) = groups.next_if(|g| g[0].0 == i) else {
                continue;
            };
            let ks: Vec<usize> = group.iter().map(|&(_, k)| k).collect();
            let probes = ks
                .iter()
                .map(|&k| addresses[k].wrapping_sub(od.obj.base))
                .collect();
            jobs.push((od, ks, probes));
        }
        let indexes = &self.indexes;
        let cache = self.debug_cache.as_ref();
        // In parallel when the arena is off (the preload library, which symbolizes at exit with
        // the program's threads done): arena memory has one owner at a time.
        let parallel = !crate::alloc::arena::enabled();
        let threads = if parallel { symbolize_threads() } else { 1 };
        let answers = resolve_objects(jobs, parallel, |od, probes| {
            resolve_object(od, probes, threads, cache, |key| indexes.get(key))
        });
        for (od_key, ks, answer) in answers {
            let ObjectAnswer {
                frames,
                built,
                has_debug,
                has_index,
            } = answer;
            if let Some(built) = built {
                // Kept across passes: on the heap, not in the arena.
                crate::alloc::arena::outside(|| {
                    self.indexes
                        .insert((od_key.0, od_key.1.as_str().to_owned()), built);
                });
            }
            if has_debug {
                self.mappings
                    .set_flags(od_key.0, &od_key.2, true, has_index);
            }
            for (k, f) in ks.into_iter().zip(frames) {
                out[k] = f;
            }
        }
        out
    }
}

/// What [`resolve_object`] found for one object's addresses.
struct ObjectAnswer {
    /// Per address, innermost first (never empty).
    frames: Vec<Vec<ResolvedFrame>>,
    /// A unit index built for it, to keep (on the heap).
    built: Option<Option<UnitIndex>>,
    /// Whether it has debug info, and a unit index.
    has_debug: bool,
    has_index: bool,
}

/// The key of an object's kept unit index: (its base, its file).
type IndexKey = (u64, String);

fn index_key(obj: &LoadedObject) -> IndexKey {
    let file = match &obj.path {
        Some(p) => p.to_string_lossy().into_owned(),
        None => obj.name.clone(),
    };
    (obj.base, file)
}

/// One object's share of a pass: the object, the positions of its addresses among the
/// pass's, and those addresses relative to its base.
type Job<'a> = (&'a mut ObjectDebug, Vec<usize>, Vec<u64>);

/// A job done: the object's (base, file, name), the positions, the answer.
type JobDone = ((u64, String, String), Vec<usize>, ObjectAnswer);

/// Resolves `probes` (addresses relative to its base) in object `od`; `kept` finds its unit
/// index kept from earlier passes.
fn resolve_object<'k>(
    od: &mut ObjectDebug,
    probes: &[u64],
    threads: usize,
    cache: Option<&Arc<Path>>,
    kept: impl Fn(&IndexKey) -> Option<&'k Option<UnitIndex>>,
) -> ObjectAnswer {
    let debug = od.debug.get_or_insert_with(|| {
        let mut d = DebugInfo::load(&od.obj).ok()?;
        d.cache_dir = cache.cloned();
        Some(d)
    });
    let mut frames = Vec::new();
    let mut built = None;
    let mut has_index = false;
    if let Some(d) = debug.as_mut() {
        let kept = kept(&index_key(&od.obj));
        if let Some(b) = d.index_to_build(kept, probes) {
            built = Some(crate::alloc::arena::outside(|| b.map(|b| b.to_heap())));
        }
        let index = match &built {
            Some(b) => b.as_ref(),
            None => kept.and_then(Option::as_ref),
        };
        has_index = index.is_some();
        frames = d.resolve_all_on(probes, index, threads);
    }
    frames.resize_with(probes.len(), Vec::new);
    for (f, &probe) in frames.iter_mut().zip(probes) {
        if f.is_empty() {
            // Unnamed code (a stripped object's internal function) is named by its
            // function's entry where the unwind table knows it, so that the samples
            // of one function add up instead of spreading over its addresses.
            let at = debug
                .as_ref()
                .and_then(|d| d.function_start(probe))
                .unwrap_or(probe);
            // Another process's object is opened through /proc/self/fd: named by its path
            // in that process.
            let shown = match od.obj.path.as_deref() {
                Some(p) if p.starts_with(foreign::OPEN_DIR) => Some(Path::new(&od.obj.name)),
                p => p,
            };
            let module = shown
                .and_then(Path::file_name)
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| od.obj.name.clone());
            f.push(ResolvedFrame {
                name: format!("{module}+{at:#x}"),
                filename: shown
                    .map(|p| p.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                ..ResolvedFrame::default()
            });
        }
    }
    ObjectAnswer {
        frames,
        built,
        has_debug: debug.is_some(),
        has_index,
    }
}

/// Runs `resolve` over each object's job and returns, per job, the object's (base, file, name),
/// the job's positions and the answer; with `parallel`, objects go to up to one thread per CPU
/// (ferroprof's own threads, the caller among them).
fn resolve_objects(
    jobs: Vec<Job<'_>>,
    parallel: bool,
    resolve: impl Fn(&mut ObjectDebug, &[u64]) -> ObjectAnswer + Sync,
) -> Vec<JobDone> {
    let key = |od: &ObjectDebug| {
        let (base, file) = index_key(&od.obj);
        (base, file, od.obj.name.clone())
    };
    let workers = symbolize_threads().min(jobs.len());
    if workers <= 1 || !parallel {
        return jobs
            .into_iter()
            .map(|(od, ks, probes)| {
                let answer = resolve(od, &probes);
                (key(od), ks, answer)
            })
            .collect();
    }
    // The objects with the most addresses first, each taken by the next free thread.
    let mut jobs = jobs;
    jobs.sort_by_key(|j| std::cmp::Reverse(j.2.len()));
    let slots: Vec<std::sync::Mutex<Option<Job<'_>>>> = jobs
        .into_iter()
        .map(|j| std::sync::Mutex::new(Some(j)))
        .collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    on_threads(workers - 1, "sym-", || {
        let mut done = Vec::new();
        loop {
            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let Some(slot) = slots.get(i) else {
                return done;
            };
            let taken = slot.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some((od, ks, probes)) = taken {
                let answer = resolve(od, &probes);
                done.push((key(od), ks, answer));
            }
        }
    })
}

/// A build id as pprof mappings and the disk cache's file names write it.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Threads a pass may resolve on: one per CPU, at most `MAX_SYMBOLIZE_THREADS`.
fn symbolize_threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(MAX_SYMBOLIZE_THREADS)
}

/// Runs `work` on this thread and on up to `helpers` scoped threads of ferroprof's own (named
/// `ferroprof-<name>N`), and returns what they all returned, in no particular order. A helper
/// that cannot start leaves its share to the others.
fn on_threads<T: Send>(helpers: usize, name: &str, work: impl Fn() -> Vec<T> + Sync) -> Vec<T> {
    if helpers == 0 {
        return work();
    }
    // Not std::thread::scope: a forked child's export thread runs passes too (see
    // `crate::ownthread`).
    crate::ownthread::Scoped::run(helpers, &format!("ferroprof-{name}"), &work)
        .into_iter()
        .flatten()
        .collect()
}

impl Drop for ProcessSymbolizer {
    fn drop(&mut self) {
        // A symbolizer dropped in the middle of a pass hands the arena on.
        self.objects = None;
        crate::alloc::arena::release(self.arena_owner);
    }
}

impl Symbolizer for ProcessSymbolizer {
    fn mapping(&mut self, address: u64) -> Option<&MappingInfo> {
        if self.mappings.generation.is_none() {
            self.mappings
                .refresh(self.foreign.as_ref().map(|f| &f.objects[..]));
        }
        self.mappings.find(address)
    }

    fn prepare(&mut self, addresses: &[u64]) {
        // Outside the arena: the list is kept across passes.
        self.mappings
            .refresh(self.foreign.as_ref().map(|f| &f.objects[..]));
        let mut todo: Vec<u64> = addresses
            .iter()
            .copied()
            .filter(|a| !self.cache.contains_key(a))
            .collect();
        if todo.is_empty() {
            return;
        }
        todo.sort_unstable();
        todo.dedup();
        let pass = self.pass;
        let frames = self.lookup(&todo);
        // Kept for this pass at least, whatever the cache's budget (trimmed at its end).
        for (a, frames) in todo.into_iter().zip(frames) {
            let entry = self.strings.entry(&frames, pass);
            self.cache.insert(a, entry);
        }
    }

    fn symbolize(&mut self, address: u64, out: &mut Vec<ResolvedFrame>) {
        let pass = self.pass;
        if let Some(e) = self.cache.get_mut(&address) {
            e.last_pass = pass;
            out.extend(e.frames.iter().map(CachedFrame::to_resolved));
            return;
        }
        let frames = self.lookup(&[address]).pop().unwrap_or_default();
        if self.cache.len() < self.max_entries {
            let entry = self.strings.entry(&frames, pass);
            self.cache.insert(address, entry);
        }
        out.extend(frames.into_vec());
    }
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
        let (at, name) = symbol_names(&debug)
            .into_iter()
            .find(|(_, n)| n.contains("clock_gettime"))
            .expect("the vDSO has clock_gettime");
        let mut s = ProcessSymbolizer::new();
        let frames = s.pass(|s| s.resolve(vdso.base + at + 4));
        assert!(
            frames.iter().any(|f| f.name.contains("clock_gettime")),
            "{name} at {at:#x}: {frames:?}"
        );
    }

    /// One object's units walked on several threads (more than `PARALLEL_WALK_BYTES` of
    /// them) give what one thread gives.
    #[test]
    fn units_walked_on_several_threads_match_one_thread() {
        let me = a_known_function();
        let obj = loaded_objects()
            .into_iter()
            .find(|o| o.contains(me))
            .expect("this binary is loaded");
        let mut d = DebugInfo::load(&obj).expect("debug info");
        let index = d.unit_index().expect("an index");
        let mut probes: Vec<u64> = symbol_names(&d)
            .iter()
            .map(|s| s.0 + 1)
            .step_by(5)
            .collect();
        probes.sort_unstable();
        probes.dedup();
        let mut units: Vec<usize> = probes
            .iter()
            .filter_map(|&p| Some(index.unit_of(p)?.offset))
            .collect();
        units.sort_unstable();
        units.dedup();
        let dwarf = d.dwarf();
        let bytes: usize = units
            .iter()
            .filter_map(|&o| {
                let h = dwarf
                    .debug_info
                    .header_from_offset(gimli::DebugInfoOffset(o));
                Some(h.ok()?.length_including_self())
            })
            .sum();
        assert!(
            units.len() > 20 && bytes >= PARALLEL_WALK_BYTES,
            "{} units, {bytes} bytes: enough to share",
            units.len()
        );
        let one = d.resolve_all_on(&probes, Some(&index), 1);
        let many = d.resolve_all_on(&probes, Some(&index), 3);
        assert_eq!(one, many);
        assert!(one.iter().filter(|f| f.len() > 1).count() > 0);
    }

    /// Units resolved through their digests (made now, then read back from the disk cache)
    /// give what walking them gives, inlined frames and all; the digests of a later pass with
    /// other units are added to the same file.
    #[test]
    fn digested_units_resolve_as_walking_them_does() {
        let me = a_known_function();
        let obj = loaded_objects()
            .into_iter()
            .find(|o| o.contains(me))
            .expect("this binary is loaded");
        let dir = std::env::temp_dir().join(format!("ferroprof-digest-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut plain = DebugInfo::load(&obj).expect("debug info");
        let index = plain.unit_index().expect("an index");
        // Starts, middles and ends of functions: the middles hold most inlined calls.
        let mut probes: Vec<u64> = plain
            .symbols()
            .iter()
            .step_by(9)
            .flat_map(|&(at, size, _)| {
                let size = size.max(1);
                [at, at + size / 3, at + size / 2, at + size - 1]
            })
            .filter(|&p| index.unit_of(p).is_some())
            .collect();
        probes.sort_unstable();
        probes.dedup();
        let (first, second): (Vec<u64>, Vec<u64>) = probes
            .iter()
            .partition(|&&p| index.unit_of(p).unwrap().offset % 2 == 0);
        let want = plain.resolve_all(&probes, Some(&index));
        assert!(
            want.iter().filter(|f| f.len() > 2).count() > 20,
            "inlined frames"
        );
        let cached = || {
            let mut d = DebugInfo::load(&obj).unwrap();
            d.cache_dir = Some(Arc::from(dir.as_path()));
            d
        };
        let file = dir.join(format!(
            "{}.units",
            plain.build_id.as_deref().expect("a build id")
        ));
        let pick = |all: &[Vec<ResolvedFrame>], some: &[u64]| -> Vec<Vec<ResolvedFrame>> {
            some.iter()
                .map(|p| all[probes.binary_search(p).unwrap()].clone())
                .collect()
        };
        // Cold: the first half's units digested, resolved through their digests, stored.
        assert_eq!(
            cached().resolve_all(&first, Some(&index)),
            pick(&want, &first)
        );
        let len1 = std::fs::metadata(&file).expect("digests stored").len();
        // The second half's units added to the file; then everything read back from it.
        assert_eq!(
            cached().resolve_all(&second, Some(&index)),
            pick(&want, &second)
        );
        let len2 = std::fs::metadata(&file).unwrap().len();
        assert!(
            len2 > len1,
            "{len1} then {len2}: the second pass's digests added"
        );
        let mut warm = cached();
        assert_eq!(warm.resolve_all(&probes, Some(&index)), want);
        assert_eq!(
            std::fs::metadata(&file).unwrap().len(),
            len2,
            "nothing new to store"
        );
        // A garbled file is not trusted for anything it cannot hold.
        let mut bytes = std::fs::read(&file).unwrap();
        let n = bytes.len();
        for b in &mut bytes[disk_cache::HEADER + 4..n / 2] {
            *b = b.wrapping_mul(31).wrapping_add(7);
        }
        std::fs::write(&file, &bytes).unwrap();
        let _ = cached().resolve_all(&probes, Some(&index));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A pass holds at most its budget of new digests: past it, the rest of its units are
    /// walked as without a cache (and still resolve alike).
    #[test]
    fn a_pass_digests_units_up_to_its_budget() {
        let me = a_known_function();
        let obj = loaded_objects()
            .into_iter()
            .find(|o| o.contains(me))
            .expect("this binary is loaded");
        let dir = std::env::temp_dir().join(format!("ferroprof-budget-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut plain = DebugInfo::load(&obj).expect("debug info");
        let index = plain.unit_index().expect("an index");
        let mut probes: Vec<u64> = plain.symbols().iter().step_by(40).map(|s| s.0).collect();
        probes.sort_unstable();
        probes.dedup();
        let units = |ps: &[u64]| {
            let mut u: Vec<usize> = ps
                .iter()
                .filter_map(|&p| Some(index.unit_of(p)?.offset))
                .collect();
            u.sort_unstable();
            u.dedup();
            u.len()
        };
        assert!(units(&probes) > 3, "several units");
        let want = plain.resolve_all(&probes, Some(&index));
        let mut d = DebugInfo::load(&obj).unwrap();
        d.cache_dir = Some(Arc::from(dir.as_path()));
        d.digest_budget = 1;
        assert_eq!(d.resolve_all(&probes, Some(&index)), want);
        let file = dir.join(format!("{}.units", d.build_id.as_deref().unwrap()));
        let bytes = std::fs::read(&file).expect("the first unit's digest stored");
        let stored = digest::Units::parse(&bytes[disk_cache::HEADER..]);
        assert!(stored.clean);
        assert_eq!(
            stored.len(),
            1,
            "one unit digested, then the budget was spent"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Objects resolved on parallel threads give what one thread gives, each object on one of
    /// ferroprof's threads, and the jobs back with their positions.
    #[test]
    fn objects_resolved_in_parallel_match_one_thread() {
        let probes_of = |o: &LoadedObject| -> Vec<u64> {
            let Ok(d) = DebugInfo::load(o) else {
                return Vec::new();
            };
            let mut at: Vec<u64> = symbol_names(&d)
                .into_iter()
                .map(|(a, _)| a + 1)
                .step_by(7)
                .take(40)
                .collect();
            at.sort_unstable();
            at.dedup();
            at
        };
        let run = |parallel: bool| {
            let mut objects: Vec<ObjectDebug> = loaded_objects()
                .into_iter()
                .map(|obj| ObjectDebug { obj, debug: None })
                .collect();
            let mut jobs = Vec::new();
            let mut k = 0;
            for od in objects.iter_mut() {
                let probes = probes_of(&od.obj);
                if probes.is_empty() {
                    continue;
                }
                let ks: Vec<usize> = (k..k + probes.len()).collect();
                k += probes.len();
                jobs.push((od, ks, probes));
            }
            assert!(jobs.len() >= 2, "at least two objects with symbols");
            let threads = std::sync::Mutex::new(HashSet::new());
            let mut got = resolve_objects(jobs, parallel, |od, probes| {
                // The kernel's name: the helpers are not std threads (see `crate::ownthread`).
                let mut buf = [0u8; 16];
                let me = crate::threads::current_thread_name(&mut buf).to_owned();
                threads.lock().unwrap().insert(me.clone());
                if me.starts_with("ferroprof-sym") {
                    assert!(crate::threads::is_own_tid(crate::threads::current_tid()));
                }
                resolve_object(od, probes, 1, None, |_| None)
            });
            got.sort_by_key(|(_, ks, _)| ks[0]);
            let frames: Vec<Vec<Vec<ResolvedFrame>>> =
                got.into_iter().map(|(_, _, a)| a.frames).collect();
            (frames, threads.into_inner().unwrap())
        };
        let (one, one_threads) = run(false);
        let (many, many_threads) = run(true);
        assert_eq!(one_threads.len(), 1, "{one_threads:?}");
        if std::thread::available_parallelism().map_or(1, |n| n.get()) > 1 {
            assert!(
                many_threads.iter().any(|n| n.starts_with("ferroprof-sym")),
                "{many_threads:?}"
            );
        }
        assert_eq!(one, many);
        assert!(one.iter().flatten().all(|f| !f.is_empty()));
    }

    /// The line `fn a_known_function` is declared at.
    const KNOWN_FUNCTION_LINE: i64 = line!() as i64 + 2;
    #[inline(never)]
    fn a_known_function() -> u64 {
        std::hint::black_box(a_known_function as *const () as usize as u64)
    }

    /// Addresses of one function share its strings in the cache, cache hits give the same
    /// frames as the lookup did, and strings go with the last entry using them.
    #[test]
    fn cached_frames_share_their_strings_and_drop_them_with_the_entries() {
        let base = a_known_function();
        let addrs: Vec<u64> = (1..5).map(|k| base + k).collect();
        let mut s = ProcessSymbolizer::new();
        let first: Vec<Vec<ResolvedFrame>> =
            s.pass(|s| addrs.iter().map(|&a| s.resolve(a)).collect());
        assert_eq!(s.cached_addresses(), addrs.len());
        // One name, one linkage name, one file (and the empty string at most) for all four.
        assert!(s.strings.0.len() <= 4, "{} strings", s.strings.0.len());
        let again: Vec<Vec<ResolvedFrame>> =
            s.pass(|s| addrs.iter().map(|&a| s.resolve(a)).collect());
        assert_eq!(first, again);
        for _ in 0..CACHE_PASSES {
            s.pass(|_| ());
        }
        assert_eq!(s.cached_addresses(), 0);
        assert!(s.strings.0.is_empty(), "{} strings left", s.strings.0.len());
    }

    #[test]
    fn resolves_this_function_with_file_and_line() {
        let addr = a_known_function() + 1;
        let mut s = ProcessSymbolizer::new();
        let frames = s.pass(|s| s.resolve(addr));
        assert!(!frames.is_empty());
        let last = frames.last().unwrap();
        assert!(last.name.ends_with("a_known_function"), "got {frames:?}");
        assert!(last.filename.ends_with("mod.rs"), "got {frames:?}");
        assert!(last.line > 0);
        assert!(last.system_name.starts_with("_ZN"), "got {frames:?}");
        assert_eq!(demangle(&last.system_name), last.name);
        assert_eq!(last.start_line, KNOWN_FUNCTION_LINE, "got {frames:?}");
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

    /// The object's function symbols: (address, name).
    fn symbol_names(d: &DebugInfo) -> Vec<(u64, &'static str)> {
        let table = d
            .elf
            .symbol_table()
            .or_else(|| d.elf.dynamic_symbol_table());
        let mut v: Vec<(u64, &'static str)> = table
            .into_iter()
            .flat_map(|t| t.symbols())
            .filter(|s| s.is_definition() && s.kind() == object::SymbolKind::Text)
            .filter_map(|s| Some((s.address(), s.name().ok()?)))
            .collect();
        v.sort_unstable();
        v
    }

    /// What addr2line over the whole object reads at `probe`, in the symbolizer's terms: names,
    /// files and lines, and as system name the raw name when it is a Rust linkage name
    /// (addr2line gives no declaration lines).
    fn reference_frames(
        ctx: &addr2line::Context<Reader>,
        d: &mut DebugInfo,
        probe: u64,
    ) -> Vec<ResolvedFrame> {
        let mut out = Vec::new();
        let symbol = d.symbol(probe);
        if let Ok(mut iter) = ctx.find_frames(probe).skip_all_loads() {
            while let Ok(Some(frame)) = iter.next() {
                let raw = frame.function.as_ref().and_then(|f| f.raw_name().ok());
                let system_name = raw
                    .as_deref()
                    .filter(|r| rustc_demangle::try_demangle(r).is_ok())
                    .unwrap_or_default()
                    .to_owned();
                let name = raw
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
                    system_name,
                    filename,
                    line,
                    start_line: 0,
                });
            }
        }
        if out.is_empty() {
            if let Some(name) = symbol {
                out.push(ResolvedFrame {
                    name: demangle(name),
                    system_name: name.to_owned(),
                    ..ResolvedFrame::default()
                });
            }
        }
        out
    }

    /// Whether the walk's frames `got` read as addr2line's `want`: the same files, lines and
    /// names, where a name may also be an alias of the same routine (`aliases`: names by
    /// address) or, on the physical frame, DWARF's short name qualified by the symbol table;
    /// Rust linkage names the same.
    fn same_frames(got: &[ResolvedFrame], want: &[ResolvedFrame], aliases: &[Vec<&str>]) -> bool {
        got.len() == want.len()
            && got.iter().zip(want).enumerate().all(|(j, (x, y))| {
                let physical = j + 1 == got.len();
                let name = x.name == y.name
                    || aliases
                        .iter()
                        .any(|s| s.contains(&x.name.as_str()) && s.contains(&y.name.as_str()))
                    || (physical && !x.system_name.is_empty() && names_agree(&x.name, &y.name));
                let system = y.system_name.is_empty() || x.system_name == y.system_name;
                x.filename == y.filename && x.line == y.line && name && system
            })
    }

    /// Inlined even in a debug build (the always-inliner runs at every optimization level).
    #[inline(always)]
    fn an_inlined_leaf(x: u64) -> u64 {
        std::hint::black_box(x).wrapping_mul(3) ^ 0x5a
    }

    /// A call site of an inlined function: [`compare_with_addr2line`] probes inside it.
    #[inline(never)]
    fn calls_an_inlined_leaf(x: u64) -> u64 {
        an_inlined_leaf(x).wrapping_add(1)
    }

    /// Resolves addresses of `obj` (symbols and points inside them) by walking their units, all
    /// in one batch and one at a time, and through addr2line's context over the whole object;
    /// asserts all read the same, and returns (addresses compared, with lines, with inlined
    /// frames, resolved through the index read from `.debug_aranges`).
    fn compare_with_addr2line(obj: &LoadedObject) -> [usize; 4] {
        std::hint::black_box(calls_an_inlined_leaf(std::hint::black_box(1)));
        // Four loads: the full index (and addr2line) inflate compressed sections whole, the
        // batch side anew with only the parts its units need, the `.debug_aranges` side anew
        // with only its units' (as far as the stream goes to reach them).
        let mut whole = DebugInfo::load(obj).expect("debug info");
        let index = whole.full_unit_index().expect("a unit index");
        assert!(index.units.len() > 10, "{} units", index.units.len());
        let ctx = addr2line::Context::from_dwarf(whole.dwarf()).expect("addr2line reads it");
        let mut d = DebugInfo::load(obj).expect("debug info");
        let named = symbol_names(&d);
        // Names by address, for symbols sharing one.
        let aliases: Vec<Vec<&str>> = named
            .chunk_by(|a, b| a.0 == b.0)
            .filter(|g| g.len() > 1)
            .map(|g| g.iter().map(|s| s.1).collect())
            .collect();
        let symbols: Vec<u64> = named.iter().map(|s| s.0).collect();
        let step = (symbols.len() / 1500).max(1);
        let mut probes: Vec<u64> = symbols
            .iter()
            .enumerate()
            .step_by(step)
            .take(1500)
            .flat_map(|(k, &at)| [at, at + 1 + (k as u64 % 13)])
            .collect();
        // Symbol starts and the bytes after them seldom fall in inlined code, and a debug build
        // inlines little: which symbols the step above picks moves with every change to the
        // binary, and some picks held no inlined frame at all. In this test binary (or a copy
        // of it), an address inside the inlined call of `calls_an_inlined_leaf`, found by
        // asking the reference, always does.
        let inlined = named
            .iter()
            .find(|s| s.1.contains("calls_an_inlined_leaf"))
            .and_then(|&(at, _)| {
                (at..at + 512).find(|&p| reference_frames(&ctx, &mut d, p).len() > 1)
            });
        probes.extend(inlined);
        probes.sort_unstable();
        probes.dedup();
        let batch = d.resolve_all(&probes, Some(&index));
        // Only compressed objects are indexed from `.debug_aranges`, and only the addresses it
        // covers (others send the object to the full index).
        let mut through_aranges = DebugInfo::load(obj).expect("debug info");
        let (covered, by_aranges) = match through_aranges.unit_index().filter(|i| i.from_aranges) {
            Some(ar) => {
                let covered: Vec<u64> = probes
                    .iter()
                    .copied()
                    .filter(|&p| ar.unit_of(p).is_some())
                    .collect();
                let got = through_aranges.resolve_all(&covered, Some(&ar));
                (covered, got)
            }
            None => Default::default(),
        };
        let mut n = [0usize; 4];
        for (k, &probe) in probes.iter().enumerate() {
            let want = reference_frames(&ctx, &mut d, probe);
            // addr2line names a routine with several subprograms (assembly aliases) by any
            // of them; the walk by the plainest.
            let same = |a: &[ResolvedFrame]| same_frames(a, &want, &aliases);
            assert!(
                same(&batch[k]),
                "at {probe:#x} (batch): {:?} vs {want:?}",
                batch[k]
            );
            if k % 7 == 0 {
                let one = d.resolve_all(&[probe], Some(&index));
                assert!(
                    same(&one[0]),
                    "at {probe:#x} (alone): {:?} vs {want:?}",
                    one[0]
                );
            }
            if let Ok(i) = covered.binary_search(&probe) {
                assert!(
                    same(&by_aranges[i]),
                    "at {probe:#x} (units from .debug_aranges): {:?} vs {want:?}",
                    by_aranges[i]
                );
                n[3] += 1;
            }
            n[0] += 1;
            n[1] += usize::from(want.iter().any(|f| f.line > 0));
            n[2] += usize::from(want.len() > 1);
        }
        eprintln!(
            "{} addresses, {} with lines, {} with inlined frames, {} through .debug_aranges; \
             {} units, {} ranges",
            n[0],
            n[1],
            n[2],
            n[3],
            index.units.len(),
            index.ranges.len()
        );
        n
    }

    /// Addresses resolved by walking their units read exactly as through addr2line's context
    /// over the whole object (names, files, lines, inlined frames).
    #[test]
    fn unit_walks_resolve_like_addr2line() {
        let me = a_known_function();
        let obj = loaded_objects()
            .into_iter()
            .find(|o| o.contains(me))
            .expect("this binary is loaded");
        let n = compare_with_addr2line(&obj);
        assert!(n[1] > n[0] / 4 && n[2] > 0, "{n:?}");
    }

    /// The same on a copy of this binary with its debug sections compressed (as distributions
    /// ship separate debug files): only the parts of them that the units need are inflated.
    #[test]
    fn unit_walks_in_compressed_debug_info_resolve_like_addr2line() {
        let me = std::env::current_exe().expect("this test's path");
        let (obj, copy) = compressed_copy(&me, "zdebug");
        let d = DebugInfo::load(&obj).expect("debug info");
        assert!(!d.lazy.is_empty(), "objcopy compressed nothing");
        drop(d);
        let n = compare_with_addr2line(&obj);
        let _ = std::fs::remove_file(&copy);
        // rustc lists its units with code in `.debug_aranges`.
        assert!(n[1] > n[0] / 4 && n[2] > 0 && n[3] > 0, "{n:?}");
    }

    /// Compressed sections read through the disk cache resolve as inflated ones: a first pass
    /// writes the prefixes it inflated, a second maps them instead of inflating, a pass needing
    /// units past them inflates again and writes the longer prefix; a garbled cache file is
    /// read without a panic.
    #[test]
    fn a_disk_cached_prefix_resolves_as_inflating_does() {
        let me = std::env::current_exe().expect("this test's path");
        let (obj, copy) = compressed_copy(&me, "zcache");
        let dir = std::env::temp_dir().join(format!("ferroprof-zcache-dir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cache: Arc<Path> = Arc::from(dir.as_path());
        let mut plain = DebugInfo::load(&obj).expect("debug info");
        let index = plain.unit_index().expect("an index");
        assert!(index.from_aranges);
        let size = plain
            .lazy_size(gimli::SectionId::DebugInfo)
            .expect("compressed");
        let mut probes: Vec<u64> = symbol_names(&plain).iter().map(|s| s.0).collect();
        probes.sort_unstable();
        probes.dedup();
        let (early, late): (Vec<u64>, Vec<u64>) = probes
            .iter()
            .filter(|&&p| index.unit_of(p).is_some())
            .step_by(7)
            .partition(|&&p| index.unit_of(p).unwrap().offset < size / 2);
        assert!(early.len() > 50 && late.len() > 50, "{early:?} {late:?}");
        let all: Vec<u64> = early.iter().chain(&late).copied().collect();
        let want_early = plain.resolve_all(&early, Some(&index));
        let want_all = DebugInfo::load(&obj)
            .unwrap()
            .resolve_all(&all, Some(&index));
        let cached = || {
            let mut d = DebugInfo::load(&obj).unwrap();
            d.cache_dir = Some(cache.clone());
            d
        };
        let info = dir.join(format!(
            "{}.debug_info",
            plain.build_id.as_deref().expect("a build id")
        ));
        let files = plain.maps.len();

        let mut cold = cached();
        assert_eq!(cold.resolve_all(&early, Some(&index)), want_early);
        assert_eq!(cold.maps.len(), files, "nothing to map yet");
        let first = std::fs::metadata(&info).expect("the prefix written").len();
        assert!(first < size as u64, "{first} of {size}: a prefix");

        let mut warm = cached();
        assert_eq!(warm.resolve_all(&early, Some(&index)), want_early);
        assert!(warm.maps.len() > files, "the prefix is mapped");
        assert_eq!(std::fs::metadata(&info).unwrap().len(), first);

        let mut further = cached();
        assert_eq!(further.resolve_all(&all, Some(&index)), want_all);
        let longer = std::fs::metadata(&info).unwrap().len();
        assert!(longer > first, "{longer} after {first}");

        // Garbled after its header: read as malformed DWARF is.
        let mut bytes = std::fs::read(&info).unwrap();
        for (k, b) in bytes.iter_mut().enumerate().skip(disk_cache::HEADER) {
            *b = (k as u8).wrapping_mul(31) ^ 0x5a;
        }
        std::fs::write(&info, &bytes).unwrap();
        let got = cached().resolve_all(&all, Some(&index));
        assert_eq!(got.len(), all.len());
        let _ = std::fs::remove_file(&copy);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// `path` copied with its debug sections compressed, as an object to symbolize.
    fn compressed_copy(path: &Path, name: &str) -> (LoadedObject, PathBuf) {
        let copy = std::env::temp_dir().join(format!("ferroprof-{name}-{}", std::process::id()));
        let status = std::process::Command::new("objcopy")
            .arg("--compress-debug-sections=zlib")
            .arg(path)
            .arg(&copy)
            .status()
            .expect("objcopy (binutils) runs");
        assert!(status.success());
        let obj = LoadedObject {
            path: Some(copy.clone()),
            name: String::new(),
            base: 0,
            segments: Vec::new(),
            eh_frame_hdr: None,
            unwind_copy: None,
            build_id: Vec::new(),
        };
        (obj, copy)
    }

    /// Builds, in `dir`, a C program of 13 units with inlined calls across functions (enough
    /// code that the start files' few functions without debug info are under a tenth of it).
    fn c_program(dir: &Path) -> PathBuf {
        std::fs::create_dir_all(dir).unwrap();
        let mut files = Vec::new();
        let mut calls = String::new();
        for u in 0..12 {
            let src = dir.join(format!("u{u}.c"));
            std::fs::write(
                &src,
                format!(
                    "static inline int twice{u}(int x) {{ return x * 2 + {u}; }}\n\
                     static inline int shift{u}(int x) {{ return twice{u}(x) >> 1; }}\n\
                     int f{u}(int x) {{ int s = 0; for (int i = 0; i < x; i++) \
                     s += shift{u}(i) ^ twice{u}(s); return s; }}\n\
                     int h{u}(int x, int y) {{ switch (x & 7) {{ case 0: return y * 3; \
                     case 1: return y / (x | 1); case 2: return f{u}(y) - x; \
                     case 3: return shift{u}(y) * x; case 4: return y % (x | 3); \
                     case 5: return twice{u}(x + y); case 6: return y ^ (x << 3); \
                     default: return x - y; }} }}\n\
                     int k{u}(int x) {{ return shift{u}(x * x) + 1; }}\n\
                     int g{u}(int x) {{ int s = 0; for (int k = 0; k < x; k++) \
                     s += h{u}(k, x) + f{u}(k) * h{u}(x, k); return s + k{u}(x); }}\n"
                ),
            )
            .unwrap();
            files.push(src);
            calls.push_str(&format!("int g{u}(int); s += g{u}(c);\n"));
        }
        let main = dir.join("main.c");
        std::fs::write(
            &main,
            format!("int main(int c, char **v) {{ (void)v; int s = 0;\n{calls} return s; }}\n"),
        )
        .unwrap();
        files.push(main);
        let exe = dir.join("prog");
        let status = std::process::Command::new("gcc")
            .args(["-O2", "-g", "-o"])
            .arg(&exe)
            .args(&files)
            .status()
            .expect("gcc runs");
        assert!(status.success());
        exe
    }

    /// A C program's compressed debug info (as Debian's debug packages ship libc's): GCC lists
    /// every unit in `.debug_aranges`, so every address in one resolves through the units read
    /// from there, inflating the stream only as far as they are, exactly as through the full
    /// index and addr2line.
    #[test]
    fn units_from_debug_aranges_resolve_like_addr2line_in_a_compressed_c_program() {
        let dir = std::env::temp_dir().join(format!("ferroprof-aranges-{}", std::process::id()));
        let (obj, copy) = compressed_copy(&c_program(&dir), "aranges-c");
        let mut d = DebugInfo::load(&obj).expect("debug info");
        let index = d.unit_index().expect("an index");
        assert!(index.from_aranges && index.complete);
        // Code without debug info (`_start`) is left out of a complete table, and does not
        // send the object to the full index.
        let start = symbol_names(&d)
            .iter()
            .find(|s| s.1 == "_start")
            .map(|s| s.0)
            .expect("_start");
        assert!(index.unit_of(start).is_none());
        assert!(d.index_to_build(Some(&Some(index)), &[start]).is_none());
        let n = compare_with_addr2line(&obj);
        let _ = std::fs::remove_file(&copy);
        let _ = std::fs::remove_dir_all(&dir);
        // Every address in the program's own functions is in a listed unit; the start files'
        // code (`_start`, `_init`) has no unit.
        assert!(
            n[3] >= 25 && n[3] * 2 > n[0] && n[1] > 0 && n[2] > 0,
            "{n:?}"
        );
    }

    /// An address a table covering less than the object's code leaves out (clang writes none
    /// unless asked, so a program mixing its code with GCC's or rustc's has a partial one; here
    /// the table is cut to its first unit) makes the object's index the full one, which finds
    /// its unit.
    #[test]
    fn an_address_left_out_of_debug_aranges_sends_its_object_to_the_full_index() {
        let dir = std::env::temp_dir().join(format!("ferroprof-arangescut-{}", std::process::id()));
        let exe = c_program(&dir);
        let bytes = std::fs::read(&exe).unwrap();
        let elf = object::File::parse(&bytes[..]).unwrap();
        let table = elf.section_by_name(".debug_aranges").unwrap();
        let table = table.data().unwrap();
        let first = unit_extent(table, true).unwrap();
        let cut_table = dir.join("aranges.bin");
        std::fs::write(&cut_table, &table[..first]).unwrap();
        let cut = dir.join("prog-cut");
        let status = std::process::Command::new("objcopy")
            .arg(format!(
                "--update-section=.debug_aranges={}",
                cut_table.display()
            ))
            .arg(&exe)
            .arg(&cut)
            .status()
            .expect("objcopy runs");
        assert!(status.success());
        let (obj, copy) = compressed_copy(&cut, "aranges-cut");
        let mut d = DebugInfo::load(&obj).expect("debug info");
        let full = DebugInfo::load(&obj)
            .expect("debug info")
            .full_unit_index()
            .expect("a unit index");
        let ar = d.unit_index().expect("an index");
        assert!(
            ar.from_aranges,
            "a compressed object is indexed from .debug_aranges"
        );
        let addresses: Vec<u64> = symbol_names(&d).iter().map(|s| s.0).collect();
        let listed = *addresses
            .iter()
            .find(|&&a| ar.unit_of(a).is_some())
            .expect("an address in a listed unit");
        let left_out = *addresses
            .iter()
            .find(|&&a| ar.unit_of(a).is_none() && full.unit_of(a).is_some())
            .expect("an address in a unit .debug_aranges leaves out");
        let kept = Some(ar);
        assert!(d.index_to_build(Some(&kept), &[listed]).is_none());
        for kept in [Some(&kept), None] {
            let built = d.index_to_build(kept, &[listed, left_out]);
            let index = built.flatten().expect("a new index");
            assert!(!index.from_aranges && index.unit_of(left_out).is_some());
        }
        let _ = std::fs::remove_file(&copy);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The same on another binary: `FERROPROF_SYMBOLIZE_CHECK=path cargo test -p ferroprof
    /// --lib -- --ignored unit_walks_on_another` (e.g. the soak service, built with full debug
    /// info, whose units often name functions from other units).
    #[test]
    #[ignore = "needs FERROPROF_SYMBOLIZE_CHECK=<an ELF file with DWARF>"]
    fn unit_walks_on_another_binary() {
        let path = std::env::var_os("FERROPROF_SYMBOLIZE_CHECK").expect("a path");
        let obj = LoadedObject {
            path: Some(PathBuf::from(path)),
            name: String::new(),
            base: 0,
            segments: Vec::new(),
            eh_frame_hdr: None,
            unwind_copy: None,
            build_id: Vec::new(),
        };
        let n = compare_with_addr2line(&obj);
        assert!(n[1] > n[0] / 4, "{n:?}");
    }

    /// The mapping of an address of this binary: its executable segment, file and build id,
    /// and what the symbolizer found in it.
    #[test]
    fn maps_addresses_to_their_object() {
        use object::Object;
        let addr = a_known_function() + 1;
        let mut s = ProcessSymbolizer::new();
        let m = s
            .pass(|s| {
                s.prepare(&[addr, 1]);
                assert!(s.mapping(1).is_none(), "address 1 is in no object");
                s.mapping(addr).cloned()
            })
            .expect("this binary's code has a mapping");
        let exe = std::fs::canonicalize(std::env::current_exe().unwrap()).unwrap();
        assert_eq!(m.filename, exe.to_string_lossy());
        let data = std::fs::read(&exe).unwrap();
        let file = object::File::parse(&*data).unwrap();
        let id = file.build_id().unwrap().expect("a build id");
        let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(m.build_id, hex);
        assert!(m.memory_start <= addr && addr < m.memory_limit, "{m:?}");
        assert_eq!(m.memory_start % PAGE, 0);
        // The file offset the address maps to holds the instruction the file has there.
        let at = (addr - m.memory_start + m.file_offset) as usize;
        // SAFETY: `addr` is in this binary's mapped code, readable.
        let mem = unsafe { std::slice::from_raw_parts(addr as *const u8, 16) };
        assert_eq!(&data[at..at + 16], mem);
        assert!(m.has_functions && m.has_filenames && m.has_line_numbers && m.has_inline_frames);
        // Kept for the next pass, where everything comes from the cache.
        let again = s.pass(|s| {
            s.prepare(&[addr]);
            s.mapping(addr).cloned()
        });
        assert_eq!(again, Some(m));
    }

    #[test]
    fn names_agree_across_debug_levels() {
        for (full, short) in [
            ("<app::Rle as app::Codec>::encode", "encode"),
            ("alloc::vec::from_elem", "from_elem<u8>"),
            ("alloc::vec::from_elem::<u8>", "from_elem<u8>"),
            (
                "core::ops::function::FnOnce::call_once{{vtable.shim}}",
                "call_once<F, ()>",
            ),
            (
                "<fn() -> u8 as core::ops::function::FnOnce<()>>::call_once::{shim:vtable#0}",
                "call_once<fn() -> u8, ()>",
            ),
            ("app::main::{{closure}}", "{closure#0}"),
            ("memcpy", "memcpy"),
        ] {
            assert!(names_agree(full, short), "{full} / {short}");
        }
        for (full, short) in [
            ("app::encode", "decode"),
            ("__GI___clone3", "clone3"),
            ("<app::Rle as app::Codec>::encode", "Rle"),
        ] {
            assert!(!names_agree(full, short), "{full} / {short}");
        }
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
#[cfg(test)]
mod inflate_tests {
    /// The wanted parts read as the whole stream inflated; the rest stays zero.
    #[test]
    fn parts_of_a_stream_inflate_alone() {
        use std::io::Write;
        let raw: Vec<u8> = (0..3_000_000u32)
            .map(|i| (i * 7 % 251) as u8 ^ (i >> 13) as u8)
            .collect();
        let mut e = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(&raw).unwrap();
        let z = e.finish().unwrap();
        for (a, b) in [
            (0, 10),
            (0x90d, 0xd55),
            (100_000, 200_000),
            (2_999_000, 3_000_000),
        ] {
            let got = super::inflate_parts(&z, raw.len(), &[(a, b)], &mut |_| ()).unwrap();
            assert!(got[a..b] == raw[a..b], "{a:x}..{b:x}");
            assert!(got[..a].iter().chain(&got[b..]).all(|&x| x == 0));
        }
    }
}
