//! Reading profiles and turning them into per-function tables, diffs and folded stacks.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::Read as _;
use std::ops::Range;
use std::path::Path;
use std::rc::Rc;

use ferroprof_pprof::{Profile, ReadError, Sample};

/// A user-facing error; the binary prints it and exits with status 2.
#[derive(Debug)]
pub struct CliError(pub String);

impl std::fmt::Display for CliError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CliError {}

fn err(msg: impl Into<String>) -> anyhow::Error {
    CliError(msg.into()).into()
}

/// The default for `--max-decompressed-size`: far above real profiles (tens of MB at most),
/// far below what a compression bomb would inflate to.
pub const DEFAULT_MAX_DECOMPRESSED_SIZE: u64 = 256 << 20;

/// Reads and decodes a pprof file with the default size cap.
pub fn load(path: &Path) -> anyhow::Result<Profile> {
    load_with_limit(path, DEFAULT_MAX_DECOMPRESSED_SIZE)
}

/// Reads and decodes a pprof file, with errors that name the file. Neither the file nor what it
/// decompresses to may exceed `max_size` bytes, both checked while reading, and the decoded
/// profile may take at most [`ferroprof_pprof::MAX_DECODED_PER_LIMIT`] times that, checked
/// before decoding: a hostile file costs at most about twice `max_size` (its bytes and their
/// inflated form) before the error.
pub fn load_with_limit(path: &Path, max_size: u64) -> anyhow::Result<Profile> {
    let too_large = |what: &str| {
        err(format!(
            "{}: {what} more than {} (the --max-decompressed-size cap); if the file is \
             trusted, raise the cap, e.g. --max-decompressed-size {}",
            path.display(),
            format_size(max_size),
            format_size(max_size.saturating_mul(4)),
        ))
    };
    let cannot_read = |e: std::io::Error| err(format!("cannot read {}: {e}", path.display()));
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(max_size.saturating_add(1)).read_to_end(&mut bytes))
        .map_err(cannot_read)?;
    if bytes.len() as u64 > max_size {
        return Err(too_large("the file is"));
    }
    if bytes.is_empty() {
        return Err(err(format!(
            "{} is empty, not a pprof profile",
            path.display()
        )));
    }
    ferroprof_pprof::decode_limited(&bytes, max_size).map_err(|e| match e {
        ReadError::TooLarge { .. } => too_large("it decompresses to"),
        // Found before decoding: a small file of many empty messages.
        ReadError::DecodedTooLarge { .. } => err(format!(
            "{}: decoding it would take more than {} of memory, {} times the \
             --max-decompressed-size cap ({}); if the file is trusted, raise the cap",
            path.display(),
            format_size(max_size.saturating_mul(ferroprof_pprof::MAX_DECODED_PER_LIMIT)),
            ferroprof_pprof::MAX_DECODED_PER_LIMIT,
            format_size(max_size),
        )),
        // The reader's messages already start with "not a pprof profile".
        e => err(format!("{}: {e}", path.display())),
    })
}

/// Parses a size for `--max-decompressed-size`: bytes, or a number with a binary-unit suffix
/// (`K`/`KiB`, `M`/`MiB`, `G`/`GiB`, case-insensitive; `KB` and the like mean the same).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, suffix) = t.split_at(digits);
    let shift = match suffix.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        _ => return Err(format!("{s:?} is not a size (e.g. 512M, 2G, 1048576)")),
    };
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (e.g. 512M, 2G, 1048576)"))?;
    match n.checked_mul(1 << shift) {
        Some(0) => Err("the size must be more than 0".to_owned()),
        Some(v) => Ok(v),
        None => Err(format!("{s:?} is too large")),
    }
}

/// A byte count in the largest binary unit that divides it exactly ("256 MiB", "1000 bytes").
pub fn format_size(v: u64) -> String {
    for (shift, unit) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if v >= 1 << shift && v % (1 << shift) == 0 {
            return format!("{} {unit}", v >> shift);
        }
    }
    format!("{v} bytes")
}

/// Sample types to show when a file names no default, best first: CPU time, then memory.
/// Not `cpu-samples` or `wall-time`: they count idle and blocked threads as much as busy ones.
const PREFERRED_TYPES: &[&str] = &[
    "cpu-time",
    "alloc-space",
    "heap-live-size",
    "alloc-samples",
    "heap-live-samples",
];

/// The sample type to show: `wanted`; else the file's `default_sample_type` when it names one
/// of its types; else the first of [`PREFERRED_TYPES`] with a non-zero value; else the first
/// type with a non-zero value; else (no data at all) the first preferred type, or the first.
pub fn pick_type(p: &Profile, wanted: Option<&str>, path: &Path) -> anyhow::Result<usize> {
    let types = p.sample_types();
    if types.is_empty() {
        return Err(err(format!("{} has no sample types", path.display())));
    }
    if let Some(name) = wanted {
        return p.value_index(name).ok_or_else(|| {
            let names: Vec<&str> = types.iter().map(|(t, _)| t.as_str()).collect();
            err(format!(
                "{} has no sample type {name:?}; it has: {}",
                path.display(),
                names.join(", ")
            ))
        });
    }
    let default = p.str(p.default_sample_type);
    if p.default_sample_type != 0 && !default.is_empty() {
        if let Some(i) = p.value_index(default) {
            return Ok(i);
        }
    }
    // A file can carry all-zero columns (an allocation profile with CPU types): showing one
    // would print an empty report while another type has the data.
    let mut non_zero = vec![false; types.len()];
    for s in &p.sample {
        for (seen, v) in non_zero.iter_mut().zip(&s.value) {
            *seen |= *v != 0;
        }
    }
    let mut preferred = PREFERRED_TYPES
        .iter()
        .filter_map(|name| types.iter().position(|(t, _)| t == name));
    Ok(preferred
        .clone()
        .find(|&i| non_zero[i])
        .or_else(|| non_zero.iter().position(|&nz| nz))
        .or_else(|| preferred.next())
        .unwrap_or(0))
}

/// A profile's frames, resolved once: each distinct function name stored once (borrowed from
/// the string table where it can be) and each location's frames as indices into them. A
/// sample's stack then costs one map lookup per location and no strings, whatever its names.
pub(crate) struct Frames<'p> {
    pub(crate) names: Vec<Cow<'p, str>>,
    /// Location id -> its frames in `frames`, innermost (inlined) first.
    locations: HashMap<u64, Range<usize>>,
    frames: Vec<usize>,
    /// The name standing for an empty stack.
    no_frames: usize,
}

impl<'p> Frames<'p> {
    pub(crate) fn new(p: &'p Profile) -> Self {
        let mut ids: HashMap<Cow<'p, str>, usize> = HashMap::new();
        let mut names: Vec<Cow<'p, str>> = Vec::new();
        let mut intern = |name: Cow<'p, str>| {
            *ids.entry(name).or_insert_with_key(|n| {
                names.push(n.clone());
                names.len() - 1
            })
        };
        let no_frames = intern(Cow::Borrowed(NO_FRAMES));
        // Later duplicates of an id win, as they would in any id -> item map.
        let mut functions: HashMap<u64, usize> = HashMap::with_capacity(p.function.len());
        for f in &p.function {
            functions.insert(f.id, intern(Cow::Borrowed(p.str(f.name))));
        }
        let unknown = intern(Cow::Borrowed(""));
        let mut locations = HashMap::with_capacity(p.location.len());
        let mut frames = Vec::with_capacity(p.location.len());
        for loc in &p.location {
            let start = frames.len();
            if loc.line.is_empty() {
                frames.push(intern(Cow::Owned(format!("{:#x}", loc.address))));
            }
            for line in &loc.line {
                frames.push(functions.get(&line.function_id).copied().unwrap_or(unknown));
            }
            locations.insert(loc.id, start..frames.len());
        }
        Frames {
            names,
            locations,
            frames,
            no_frames,
        }
    }

    /// Replaces `out` with the name ids of `s`'s stack, innermost first; an empty stack is
    /// `(no frames)`.
    pub(crate) fn stack(&self, s: &Sample, out: &mut Vec<usize>) {
        self.stack_of(&s.location_id, out)
    }

    fn stack_of(&self, location_ids: &[u64], out: &mut Vec<usize>) {
        out.clear();
        for id in location_ids {
            if let Some(r) = self.locations.get(id) {
                out.extend_from_slice(&self.frames[r.clone()]);
            }
        }
        if out.is_empty() {
            out.push(self.no_frames);
        }
    }
}

/// Names longer than this are cut for display (they stay whole as keys).
pub const MAX_DISPLAY_NAME: usize = 1024;

/// `name` as shown in reports: names over [`MAX_DISPLAY_NAME`] bytes are cut at a character
/// boundary and marked with an ellipsis and their full length, so a crafted megabyte name
/// cannot blow up a report (or a flame graph, once per frame).
pub fn display_name(name: &str) -> Cow<'_, str> {
    if name.len() <= MAX_DISPLAY_NAME {
        return Cow::Borrowed(name);
    }
    let mut end = MAX_DISPLAY_NAME;
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!("{}… ({} bytes)", &name[..end], name.len()))
}

/// Flat and cumulative value per function for one sample type.
#[derive(Debug, Clone, Default)]
pub struct FunctionTable {
    pub type_name: String,
    pub unit: String,
    pub total: i64,
    pub samples: usize,
    /// (function, flat, cum), unsorted; one row per distinct name.
    pub rows: Vec<(Rc<str>, i64, i64)>,
    /// Whether `flat` counts allocation sites rather than leaf frames.
    pub sites: bool,
}

const NO_FRAMES: &str = "(no frames)";

impl FunctionTable {
    /// Leaf frames as they are.
    pub fn build(p: &Profile, index: usize) -> Self {
        Self::build_with(p, index, false)
    }

    /// For allocation and heap types, `flat` goes to the allocation *site*: the first frame
    /// outside the allocator machinery (see [`is_alloc_machinery`]); `cum` is unchanged.
    pub fn build_sites(p: &Profile, index: usize) -> Self {
        let name = p.sample_types().swap_remove(index).0;
        Self::build_with(p, index, is_alloc_type(&name))
    }

    /// One pass over the samples, with per-name arrays instead of per-sample maps or strings:
    /// linear in the profile's size.
    fn build_with(p: &Profile, index: usize, sites: bool) -> Self {
        let (type_name, unit) = p.sample_types().swap_remove(index);
        let frames = Frames::new(p);
        let n = frames.names.len();
        // Once per name rather than once per frame: the test scans the whole name.
        let machinery: Vec<bool> = if sites {
            frames.names.iter().map(|n| is_alloc_machinery(n)).collect()
        } else {
            Vec::new()
        };
        let mut flat = vec![0i64; n];
        let mut cum = vec![0i64; n];
        // The last sample that added to each name's `cum` (usize::MAX: none yet), so a
        // recursive function counts once per sample without a set per sample.
        let mut last = vec![usize::MAX; n];
        let mut stack = Vec::new();
        let mut total = 0i64;
        let mut samples = 0;
        for (i, s) in p.sample.iter().enumerate() {
            let v = s.value.get(index).copied().unwrap_or(0);
            if v == 0 {
                continue;
            }
            samples += 1;
            total = total.saturating_add(v);
            frames.stack(s, &mut stack);
            let leaf_at = if sites {
                stack.iter().position(|&f| !machinery[f]).unwrap_or(0)
            } else {
                0
            };
            // Saturating: a crafted file's values must not overflow into a panic (or wrap).
            let f = &mut flat[stack[leaf_at]];
            *f = f.saturating_add(v);
            for &f in &stack {
                if last[f] != i {
                    last[f] = i;
                    cum[f] = cum[f].saturating_add(v);
                }
            }
        }
        let rows = (0..n)
            .filter(|&f| last[f] != usize::MAX)
            .map(|f| (Rc::from(&*frames.names[f]), flat[f], cum[f]))
            .collect();
        FunctionTable {
            type_name,
            unit,
            total,
            samples,
            rows,
            sites,
        }
    }

    /// Rows sorted by flat (or cum) value, largest first; ties by name for stable output.
    pub fn sorted(&self, by_cum: bool) -> Vec<(Rc<str>, i64, i64)> {
        let mut rows = self.rows.clone();
        rows.sort_by(|a, b| {
            let (ka, kb) = if by_cum { (a.2, b.2) } else { (a.1, b.1) };
            kb.unsigned_abs()
                .cmp(&ka.unsigned_abs())
                .then(b.2.cmp(&a.2))
                .then(a.0.cmp(&b.0))
        });
        rows
    }
}

/// Sample types whose samples are taken inside the allocator.
pub fn is_alloc_type(name: &str) -> bool {
    name.starts_with("alloc-") || name.starts_with("heap-")
}

/// Frames of the library code between the function that asked for memory and the allocator
/// (Rust's `alloc` collections, `core` iterator plumbing, `std`, C allocation calls). The
/// profiler's own allocator frames and the global-allocator shims are never written into an
/// allocation or heap stack, so they need no case here. C++ `operator new` and `new[]`
/// (Itanium-mangled `_Znw*`/`_Zna*`, or demangled) are machinery too: under `ferroprof record`
/// they are the frame between a C++ allocation site and `malloc`. So are the allocation
/// wrappers of common runtimes and libraries (CPython, Ruby, GLib, GNU `xmalloc`, SQLite): in
/// a program profiled with `record`, every large allocation passes through one of them, and
/// naming it as the site would tell the reader nothing.
pub fn is_alloc_machinery(name: &str) -> bool {
    const PREFIXES: &[&str] = &[
        "alloc::",
        "core::",
        "std::",
        "malloc",
        "calloc",
        "realloc",
        "_Znwm",
        "_Znam",
        "_Znwj",
        "_Znaj",
        "operator new",
        // CPython's object and raw allocators, and its small-object allocator.
        "PyObject_Malloc",
        "PyObject_Calloc",
        "PyObject_Realloc",
        "_PyObject_Malloc",
        "_PyObject_Calloc",
        "_PyObject_Realloc",
        "PyMem_",
        "_PyMem_",
        "pymalloc_",
        // Ruby's GC-accounted allocation.
        "ruby_xmalloc",
        "ruby_xcalloc",
        "ruby_xrealloc",
        "objspace_xmalloc",
        "objspace_xcalloc",
        "objspace_xrealloc",
        "rb_xmalloc_mul_add",
        "rb_xcalloc_mul_add",
        "rb_xrealloc_mul_add",
        // GLib.
        "g_malloc",
        "g_try_malloc",
        "g_realloc",
        "g_try_realloc",
        "g_slice_alloc",
        // SQLite's allocation layer.
        "sqlite3Malloc",
        "sqlite3MemMalloc",
        "sqlite3MemRealloc",
        "sqlite3Realloc",
        "sqlite3DbMalloc",
        "sqlite3DbRealloc",
        "mallocWithAlarm",
        "dbMallocRawFinish",
    ];
    // Exact names: as prefixes they would take in real sites (`xmallocarray_user`, say).
    const EXACT: &[&str] = &[
        // CPython: an object of a type, sized or GC-tracked; the caller is the site.
        "_PyObject_New",
        "_PyObject_NewVar",
        "_PyObject_GC_New",
        "_PyObject_GC_NewVar",
        "_PyObject_GC_Resize",
        "gc_alloc",
        // GNU's checked allocation (coreutils, xz, binutils, gcc).
        "xmalloc",
        "xcalloc",
        "xrealloc",
        "xzalloc",
        "xnmalloc",
        "xnrealloc",
        "ximalloc",
        "xicalloc",
        "xirealloc",
        "lzma_alloc",
    ];
    let path = name.strip_prefix('<').unwrap_or(name);
    PREFIXES.iter().any(|p| path.starts_with(p))
        || EXACT.contains(&name)
        || name.contains(" as alloc::")
        || name.contains(" as core::")
}

/// A value in its unit: nanoseconds as time, bytes in binary units, counts as integers.
pub fn format_value(v: i64, unit: &str) -> String {
    let sign = if v < 0 { "-" } else { "" };
    let a = v.unsigned_abs() as f64;
    let body = match unit {
        "nanoseconds" => {
            if a >= 1e9 {
                format!("{:.2}s", a / 1e9)
            } else if a >= 1e6 {
                format!("{:.2}ms", a / 1e6)
            } else if a >= 1e3 {
                format!("{:.2}us", a / 1e3)
            } else {
                format!("{a}ns")
            }
        }
        "bytes" => {
            const K: f64 = 1024.0;
            if a >= K * K * K {
                format!("{:.2}GiB", a / (K * K * K))
            } else if a >= K * K {
                format!("{:.2}MiB", a / (K * K))
            } else if a >= K {
                format!("{:.2}KiB", a / K)
            } else {
                format!("{a}B")
            }
        }
        _ => format!("{}", v.unsigned_abs()),
    };
    format!("{sign}{body}")
}

fn percent(v: i64, total: i64) -> String {
    if total == 0 {
        "-".to_owned()
    } else {
        format!("{:.2}%", v as f64 * 100.0 / total as f64)
    }
}

/// The `top` report: a header line and up to `n` rows.
pub fn top_text(t: &FunctionTable, n: usize, by_cum: bool, label: &str) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{label}: {} ({}), total {} in {} samples",
        t.type_name,
        t.unit,
        format_value(t.total, &t.unit),
        t.samples
    );
    if t.samples == 0 {
        let _ = writeln!(out, "  (no samples with a non-zero {} value)", t.type_name);
        return out;
    }
    if t.sites {
        let _ = writeln!(
            out,
            "flat = allocation site: first frame outside the allocator (--raw: leaf frames)"
        );
    }
    let rows = t.sorted(by_cum);
    let shown = rows.len().min(n);
    if shown < rows.len() {
        let _ = writeln!(
            out,
            "Showing top {shown} of {} functions, sorted by {}",
            rows.len(),
            if by_cum { "cum" } else { "flat" }
        );
    }
    let _ = writeln!(
        out,
        "{:>11} {:>7} {:>7} {:>11} {:>7}  function",
        "flat", "flat%", "sum%", "cum", "cum%"
    );
    let mut sum = 0i64;
    for (f, flat, cum) in rows.iter().take(shown) {
        sum = sum.saturating_add(*flat);
        let _ = writeln!(
            out,
            "{:>11} {:>7} {:>7} {:>11} {:>7}  {f}",
            format_value(*flat, &t.unit),
            percent(*flat, t.total),
            percent(sum, t.total),
            format_value(*cum, &t.unit),
            percent(*cum, t.total),
            f = display_name(f),
        );
    }
    out
}

/// The `diff` report: per-function flat values in A and B and their difference.
// The binary calls `diff_text_with`; the fuzz harness (fuzz/src/cli_top.rs) calls this one.
#[allow(dead_code)]
pub fn diff_text(a: &FunctionTable, b: &FunctionTable, n: usize) -> String {
    diff_text_with(a, b, n, None)
}

/// The `diff` report; with `per_second` (the seconds A and B cover), every value is divided by
/// its profile's duration, so profiles of different lengths compare as rates.
pub fn diff_text_with(
    a: &FunctionTable,
    b: &FunctionTable,
    n: usize,
    per_second: Option<(f64, f64)>,
) -> String {
    let unit = &b.unit;
    // Values stay exact integers unless divided by a duration.
    let (secs_a, secs_b) = per_second.unwrap_or((1.0, 1.0));
    let show = |v: f64| match per_second {
        Some(_) => format_rate(v, unit),
        None => format_value(v as i64, unit),
    };
    let show_signed = |v: f64| {
        if v > 0.0 {
            format!("+{}", show(v))
        } else {
            show(v)
        }
    };
    let mut out = String::new();
    let (total_a, total_b) = (a.total as f64 / secs_a, b.total as f64 / secs_b);
    let rel = if total_a != 0.0 {
        format!(" ({:+.1}%)", (total_b - total_a) * 100.0 / total_a)
    } else {
        String::new()
    };
    let per = match per_second {
        Some((x, y)) => format!(
            " per second (A covers {}, B {})",
            format_value((x * 1e9) as i64, "nanoseconds"),
            format_value((y * 1e9) as i64, "nanoseconds")
        ),
        None => String::new(),
    };
    let _ = writeln!(
        out,
        "{} ({unit}){per}: total A {} -> B {}, delta {}{rel}",
        b.type_name,
        show(total_a),
        show(total_b),
        show_signed(total_b - total_a),
    );
    // Flat values of A and B per name, in one map: linear in the two tables.
    let mut both: HashMap<&str, (i64, i64)> = HashMap::with_capacity(a.rows.len());
    for (f, flat, _) in &a.rows {
        both.entry(f).or_default().0 = *flat;
    }
    for (f, flat, _) in &b.rows {
        both.entry(f).or_default().1 = *flat;
    }
    let mut rows: Vec<(&str, f64, f64)> = both
        .into_iter()
        .map(|(f, (x, y))| (f, x as f64 / secs_a, y as f64 / secs_b))
        .filter(|(_, x, y)| x != y)
        .collect();
    let change = |r: &(&str, f64, f64)| (r.2 - r.1).abs();
    rows.sort_by(|x, y| change(y).total_cmp(&change(x)).then(x.0.cmp(y.0)));
    if rows.is_empty() {
        let _ = writeln!(out, "No per-function differences in flat {}.", b.type_name);
        return out;
    }
    let shown = rows.len().min(n);
    if shown < rows.len() {
        let _ = writeln!(
            out,
            "Showing top {shown} of {} changed functions, by size of change",
            rows.len()
        );
    }
    let _ = writeln!(
        out,
        "{:>11} {:>11} {:>12} {:>8}  function (flat)",
        "A", "B", "delta", "delta%"
    );
    for (f, x, y) in rows.into_iter().take(shown) {
        let pct = if x != 0.0 {
            format!("{:+.1}%", (y - x) * 100.0 / x)
        } else {
            "new".to_owned()
        };
        let _ = writeln!(
            out,
            "{:>11} {:>11} {:>12} {:>8}  {f}",
            show(x),
            show(y),
            show_signed(y - x),
            pct,
            f = display_name(f),
        );
    }
    out
}

/// Sample types that are a snapshot at the end of the profile (live memory), not a sum over
/// its duration: dividing them by the duration means nothing.
pub fn is_snapshot_type(name: &str) -> bool {
    name.starts_with("heap-live") || name.starts_with("inuse")
}

/// A rate in its unit per second: `250.00ms/s` of CPU, `1.50MiB/s`, `0.25/s` for counts.
pub fn format_rate(v: f64, unit: &str) -> String {
    let a = v.abs();
    let body = match unit {
        // Below one nanosecond or byte per second, fractions are what is left to show.
        "nanoseconds" | "bytes" if a >= 1.0 || a == 0.0 => format_value(a.round() as i64, unit),
        "nanoseconds" => format!("{a:.2}ns"),
        "bytes" => format!("{a:.2}B"),
        _ if a >= 100.0 || a == 0.0 => format!("{a:.0}"),
        _ => format!("{a:.2}"),
    };
    let sign = if v < 0.0 && body.chars().any(|c| matches!(c, '1'..='9')) {
        "-"
    } else {
        ""
    };
    format!("{sign}{body}/s")
}

/// Folded stacks (`root;...;leaf value`), one line per distinct stack, for flame graphs, within
/// the default budget (see [`folded_with_limit`]).
// The binary passes its own budget; the fuzz harness (fuzz/src/cli_top.rs) calls this one.
#[allow(dead_code)]
pub fn folded(p: &Profile, index: usize) -> Option<Vec<String>> {
    folded_with_limit(p, index, folded_budget(DEFAULT_MAX_DECOMPRESSED_SIZE))
}

/// The folded text allowed for a file cap: a quarter of it. The flame graph takes a few times
/// its folded text (frames, then the SVG with every name twice), and an 800-byte file with one
/// sample of 230k frames asks for 240 MB of it (590 MB peak, a 320 MB SVG).
pub fn folded_budget(max_size: u64) -> u64 {
    max_size / 4
}

/// Makes an inferno SVG fit its window: the root's fixed pixel width becomes `100%`, and the
/// drawing scales through its `viewBox` from the top. inferno's script makes the width fluid
/// too, but only where scripts run (not in an `<img>`, a previewer or a sandboxed viewer).
/// Returns `false`, leaving `svg` as it is, if the root element is not as expected.
pub fn fit_svg_to_window(svg: &mut String) -> bool {
    let Some(start) = svg.find("<svg ") else {
        return false;
    };
    let Some(len) = svg[start..].find('>') else {
        return false;
    };
    let root = &svg[start..start + len];
    if !root.contains(" viewBox=\"") {
        return false;
    }
    let Some(w) = root.find(" width=\"") else {
        return false;
    };
    let value = start + w + " width=\"".len();
    let Some(end) = svg[value..].find('"') else {
        return false;
    };
    let fit = if root.contains("preserveAspectRatio") {
        "100%"
    } else {
        "100%\" preserveAspectRatio=\"xMidYMin meet"
    };
    svg.replace_range(value..value + end, fit);
    true
}

/// Folded stacks, or `None` if their text would exceed `max_bytes`. Samples are summed by their
/// location ids first (borrowed, no strings), and each distinct stack is rendered once, from
/// names shared between frames and cut for display. The budget matters because a tiny file
/// can still ask for a huge text: one sample of a million frames of a long name.
pub fn folded_with_limit(p: &Profile, index: usize, max_bytes: u64) -> Option<Vec<String>> {
    let mut by_locations: HashMap<&[u64], i64> = HashMap::new();
    for s in &p.sample {
        let v = s.value.get(index).copied().unwrap_or(0);
        if v <= 0 {
            continue;
        }
        let a = by_locations.entry(&s.location_id).or_default();
        *a = a.saturating_add(v);
    }
    let frames = Frames::new(p);
    // `;` separates frames in the folded format; Rust names can contain it (`[u8; 4]`).
    let shown: Vec<String> = frames
        .names
        .iter()
        .map(|n| display_name(n).replace(';', ","))
        .collect();
    // Different locations can carry the same names: sum again by the rendered line.
    let mut by_line: HashMap<String, i64> = HashMap::with_capacity(by_locations.len());
    let mut stack = Vec::new();
    let mut left = usize::try_from(max_bytes).unwrap_or(usize::MAX);
    for (ids, v) in by_locations {
        frames.stack_of(ids, &mut stack);
        // Sized before it is built, so a line past the budget is never allocated: each frame
        // and its `;` (or the space before the value), and the value.
        let len = stack.iter().map(|&f| shown[f].len() + 1).sum::<usize>() + 20;
        left = left.checked_sub(len)?;
        let mut line = String::with_capacity(len);
        for (i, &f) in stack.iter().rev().enumerate() {
            if i > 0 {
                line.push(';');
            }
            line.push_str(&shown[f]);
        }
        let a = by_line.entry(line).or_default();
        *a = a.saturating_add(v);
    }
    let mut lines: Vec<String> = by_line
        .into_iter()
        .map(|(mut k, v)| {
            let _ = write!(k, " {v}");
            k
        })
        .collect();
    lines.sort();
    Some(lines)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile() -> Profile {
        ferroprof_pprof::ProfileBuilder::new(&[
            ("cpu-time", "nanoseconds"),
            ("heap-live-size", "bytes"),
        ])
        .sample(&["hot", "work", "main"], &[3_000_000_000, 0], &[])
        .sample(&["cold", "work", "main"], &[1_000_000_000, 0], &[])
        .sample(&["rec", "rec", "main"], &[500_000_000, 64 << 20], &[])
        .build()
    }

    #[test]
    fn runtime_allocators_are_machinery_and_their_callers_sites() {
        for name in [
            "_PyObject_Malloc",
            "PyMem_RawMalloc",
            "pymalloc_alloc",
            "_PyObject_GC_NewVar",
            "ruby_xmalloc2",
            "objspace_xmalloc0",
            "g_malloc0_n",
            "xmalloc",
            "lzma_alloc",
            "sqlite3DbMallocRawNN",
        ] {
            assert!(is_alloc_machinery(name), "{name}");
        }
        for name in [
            "PyBytes_FromStringAndSize",
            "_PyBytes_Resize",
            "rb_str_new",
            "xmemdup_site",
            "g_strdup",
            "sqlite3VdbeExec",
        ] {
            assert!(!is_alloc_machinery(name), "{name}");
        }
        let p = ferroprof_pprof::ProfileBuilder::new(&[("alloc-space", "bytes")])
            .sample(
                &[
                    "_PyObject_Malloc",
                    "_PyObject_NewVar",
                    "_PyCode_New",
                    "main",
                ],
                &[100],
                &[],
            )
            .build();
        let t = FunctionTable::build_sites(&p, 0);
        let flat = |f: &str| t.rows.iter().find(|r| &*r.0 == f).map_or(0, |r| r.1);
        assert_eq!((flat("_PyCode_New"), flat("_PyObject_Malloc")), (100, 0));
    }

    #[test]
    fn cpp_operator_new_is_machinery_and_the_caller_the_site() {
        for name in [
            "_Znwm",
            "_Znam",
            "_ZnwmRKSt9nothrow_t",
            "operator new(unsigned long)",
        ] {
            assert!(is_alloc_machinery(name), "{name}");
        }
        assert!(!is_alloc_machinery("_Z5buildB5cxx11i"));
        let p = ferroprof_pprof::ProfileBuilder::new(&[("alloc-space", "bytes")])
            .sample(&["_Znwm", "_Z5buildi", "main"], &[100], &[])
            .build();
        let t = FunctionTable::build_sites(&p, 0);
        let flat = |f: &str| t.rows.iter().find(|r| &*r.0 == f).map_or(0, |r| r.1);
        assert_eq!((flat("_Z5buildi"), flat("_Znwm")), (100, 0));
    }

    #[test]
    fn flat_and_cum() {
        let t = FunctionTable::build(&profile(), 0);
        assert_eq!(t.total, 4_500_000_000);
        let rows = t.sorted(false);
        assert_eq!(rows[0], ("hot".into(), 3_000_000_000, 3_000_000_000));
        let main = rows.iter().find(|r| &*r.0 == "main").unwrap();
        assert_eq!((main.1, main.2), (0, 4_500_000_000));
        let rec = rows.iter().find(|r| &*r.0 == "rec").unwrap();
        assert_eq!(
            (rec.1, rec.2),
            (500_000_000, 500_000_000),
            "recursion counted once"
        );
    }

    #[test]
    fn allocation_sites_skip_the_allocator() {
        let p = ferroprof_pprof::ProfileBuilder::new(&[("heap-live-size", "bytes")])
            .sample(
                &[
                    "alloc::raw_vec::RawVecInner<A>::try_allocate_in",
                    "<u8 as alloc::vec::spec_from_elem::SpecFromElem>::from_elem",
                    "app::load_cache",
                    "main",
                ],
                &[1 << 20],
                &[],
            )
            .build();
        let sites = FunctionTable::build_sites(&p, 0);
        assert_eq!(
            sites.sorted(false)[0],
            ("app::load_cache".into(), 1 << 20, 1 << 20)
        );
        let raw = FunctionTable::build(&p, 0);
        assert_eq!(
            &*raw.sorted(false)[0].0,
            "alloc::raw_vec::RawVecInner<A>::try_allocate_in"
        );
        // CPU types keep their leaf frames.
        let q = ferroprof_pprof::ProfileBuilder::new(&[("cpu-time", "nanoseconds")])
            .sample(&["core::ptr::drop_in_place", "app::f"], &[5], &[])
            .build();
        assert_eq!(
            &*FunctionTable::build_sites(&q, 0).sorted(false)[0].0,
            "core::ptr::drop_in_place"
        );
    }

    #[test]
    fn units() {
        assert_eq!(format_value(1_500_000_000, "nanoseconds"), "1.50s");
        assert_eq!(format_value(2_500_000, "nanoseconds"), "2.50ms");
        assert_eq!(format_value(999, "nanoseconds"), "999ns");
        assert_eq!(format_value(64 << 20, "bytes"), "64.00MiB");
        assert_eq!(format_value(-2048, "bytes"), "-2.00KiB");
        assert_eq!(format_value(42, "count"), "42");
    }

    #[test]
    fn folded_lines() {
        let lines = folded(&profile(), 1).unwrap();
        assert_eq!(lines, vec![format!("main;rec;rec {}", 64 << 20)]);
    }

    #[test]
    fn diff_orders_by_change() {
        let a = FunctionTable::build(&profile(), 0);
        let b_prof = ferroprof_pprof::ProfileBuilder::new(&[("cpu-time", "nanoseconds")])
            .sample(&["hot", "work", "main"], &[1_000_000_000], &[])
            .sample(&["new_fn", "main"], &[4_000_000_000], &[])
            .build();
        let b = FunctionTable::build(&b_prof, 0);
        let text = diff_text(&a, &b, 10);
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines[2].ends_with("new_fn") && lines[2].contains("+4.00s"),
            "{text}"
        );
        assert!(
            lines[3].ends_with("hot") && lines[3].contains("-2.00s"),
            "{text}"
        );
    }

    #[test]
    fn long_names_are_cut_for_display_at_a_char_boundary() {
        assert_eq!(display_name("main"), "main");
        let exact = "x".repeat(MAX_DISPLAY_NAME);
        assert_eq!(display_name(&exact), exact);
        // A 3-byte character straddles the cut: it goes whole or not at all.
        let long = format!("{}€{}", "a".repeat(MAX_DISPLAY_NAME - 1), "b".repeat(5000));
        let shown = display_name(&long);
        assert_eq!(
            shown,
            format!(
                "{}… ({} bytes)",
                "a".repeat(MAX_DISPLAY_NAME - 1),
                long.len()
            )
        );
    }

    #[test]
    fn long_names_stay_whole_as_keys_and_are_cut_in_reports() {
        let (a, b) = ("a".repeat(5000), "a".repeat(6000));
        let p = ferroprof_pprof::ProfileBuilder::new(&[("cpu-time", "nanoseconds")])
            .sample(&[&a, "main"], &[2], &[])
            .sample(&[&b, "main"], &[1], &[])
            .sample(&[&b, &b, &b], &[4], &[])
            .build();
        let t = FunctionTable::build(&p, 0);
        // Same 1 KiB prefix, still two functions.
        assert_eq!(t.rows.len(), 3);
        let rows = t.sorted(false);
        assert_eq!((&*rows[0].0, rows[0].1, rows[0].2), (b.as_str(), 5, 5));
        let text = top_text(&t, 10, false, "p");
        assert!(text.contains("… (6000 bytes)") && text.contains("… (5000 bytes)"));
        assert!(
            text.lines().all(|l| l.len() < 2 * MAX_DISPLAY_NAME),
            "{text}"
        );
        let cut = display_name(&b).into_owned();
        let lines = folded(&p, 0).unwrap();
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert!(lines.contains(&format!("{cut};{cut};{cut} 4")), "{lines:?}");
        assert!(lines.contains(&format!("main;{cut} 1")), "{lines:?}");
    }

    #[test]
    fn folded_sums_equal_stacks_and_keeps_inline_and_address_frames() {
        use ferroprof_pprof::{Function, Line, Location, Sample};
        let mut p = ferroprof_pprof::ProfileBuilder::new(&[("cpu-time", "nanoseconds")]).build();
        let s = |p: &mut Profile, v: &str| {
            p.string_table.push(v.to_owned());
            p.string_table.len() as i64 - 1
        };
        let (f1, f2) = (s(&mut p, "inlined"), s(&mut p, "outer; [u8; 4]"));
        for (id, name) in [(1, f1), (2, f2)] {
            p.function.push(Function {
                id,
                name,
                ..Default::default()
            });
        }
        let line = |function_id| Line {
            function_id,
            line: 1,
            column: 0,
        };
        p.location.push(Location {
            id: 10,
            line: vec![line(1), line(2)],
            ..Default::default()
        });
        p.location.push(Location {
            id: 11,
            address: 0xbeef,
            ..Default::default()
        });
        // Location 12 has the same frames as 10: its stacks sum with 10's.
        p.location.push(Location {
            id: 12,
            line: vec![line(1), line(2)],
            ..Default::default()
        });
        for (ids, v) in [(vec![11, 10], 5), (vec![11, 12], 2), (vec![], 1)] {
            p.sample.push(Sample {
                location_id: ids,
                value: vec![v],
                label: vec![],
            });
        }
        assert_eq!(
            folded(&p, 0).unwrap(),
            vec!["(no frames) 1", "outer, [u8, 4];inlined;0xbeef 7"]
        );
        let t = FunctionTable::build(&p, 0);
        let rows = t.sorted(false);
        assert_eq!((&*rows[0].0, rows[0].1, rows[0].2), ("0xbeef", 7, 7));
        assert!(rows.iter().any(|r| &*r.0 == "(no frames)" && r.1 == 1));
        assert!(rows.iter().any(|r| &*r.0 == "outer; [u8; 4]" && r.2 == 7));
    }

    #[test]
    fn folded_text_stays_within_its_budget() {
        let name = "n".repeat(3000);
        let deep: Vec<&str> = vec![&name; 1000];
        let p = ferroprof_pprof::ProfileBuilder::new(&[("cpu-time", "nanoseconds")])
            .sample(&deep, &[1], &[])
            .sample(&["f", "main"], &[1], &[])
            .build();
        // 1000 frames of a name cut to about 1 KiB: about 1 MB of text.
        let lines = folded_with_limit(&p, 0, 1_100_000).unwrap();
        assert_eq!(lines.len(), 2);
        let len: usize = lines.iter().map(String::len).sum();
        assert!((1_000_000..1_100_000).contains(&len), "{len}");
        assert!(folded_with_limit(&p, 0, 1_000_000).is_none());
        assert!(folded_with_limit(&p, 0, 10).is_none());
    }

    #[test]
    fn default_type_falls_back_past_a_missing_name_and_idle_counts() {
        let mut p = ferroprof_pprof::ProfileBuilder::new(&[
            ("cpu-samples", "count"),
            ("wall-time", "nanoseconds"),
            ("cpu-time", "nanoseconds"),
        ])
        .sample(&["idle"], &[9, 9, 0], &[])
        .sample(&["busy"], &[1, 1, 5], &[])
        .build();
        let path = Path::new("p");
        assert_eq!(pick_type(&p, None, path).unwrap(), 2);
        // A default naming no type of the file (or out of range) is passed over.
        p.string_table.push("alloc-space".into());
        p.default_sample_type = p.string_table.len() as i64 - 1;
        assert_eq!(pick_type(&p, None, path).unwrap(), 2);
        p.default_sample_type = 1_000;
        assert_eq!(pick_type(&p, None, path).unwrap(), 2);
        // A named default wins, even over cpu-time.
        p.default_sample_type = p
            .string_table
            .iter()
            .position(|s| s == "wall-time")
            .unwrap() as i64;
        assert_eq!(pick_type(&p, None, path).unwrap(), 1);
        // No data at all: cpu-time still, not the first type.
        p.default_sample_type = 0;
        p.sample.clear();
        assert_eq!(pick_type(&p, None, path).unwrap(), 2);
    }

    #[test]
    fn rates() {
        assert_eq!(format_rate(0.25e9, "nanoseconds"), "250.00ms/s");
        assert_eq!(format_rate(-1.5 * 1024.0 * 1024.0, "bytes"), "-1.50MiB/s");
        assert_eq!(format_rate(0.5, "nanoseconds"), "0.50ns/s");
        assert_eq!(format_rate(0.0, "nanoseconds"), "0ns/s");
        assert_eq!(format_rate(0.125, "count"), "0.12/s");
        assert_eq!(format_rate(-0.001, "count"), "0.00/s");
        assert_eq!(format_rate(1234.4, "count"), "1234/s");
        assert_eq!(format_rate(0.0, "count"), "0/s");
    }

    #[test]
    fn svg_root_gets_a_fluid_width() {
        let mut svg =
            r#"<?xml version="1.0"?><!DOCTYPE svg PUBLIC "x"><svg version="1.1" width="1200" height="90" viewBox="0 0 1200 90"><svg id="frames" width="1180"></svg></svg>"#
                .to_owned();
        assert!(fit_svg_to_window(&mut svg));
        assert!(svg.contains(
            r#"<svg version="1.1" width="100%" preserveAspectRatio="xMidYMin meet" height="90" viewBox="0 0 1200 90">"#
        ), "{svg}");
        assert!(svg.contains(r#"<svg id="frames" width="1180">"#), "{svg}");
        // Without a viewBox, a percent width would not scale the drawing: left alone.
        for odd in [
            "<svg width=\"10\">",
            "not svg",
            "<svg viewBox=\"0 0 1 1\"",
            "",
        ] {
            let mut s = odd.to_owned();
            assert!(!fit_svg_to_window(&mut s));
            assert_eq!(s, odd);
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("256M"), Ok(256 << 20));
        assert_eq!(parse_size("64KiB"), Ok(64 << 10));
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        assert_eq!(parse_size("1048576"), Ok(1 << 20));
        assert!(parse_size("0").is_err());
        assert!(parse_size("lots").is_err());
        assert!(parse_size("-1M").is_err());
        assert!(parse_size("99999999999999G").is_err());
        assert_eq!(format_size(DEFAULT_MAX_DECOMPRESSED_SIZE), "256 MiB");
        assert_eq!(format_size(1 << 30), "1 GiB");
        assert_eq!(format_size(1536), "1536 bytes");
        assert_eq!(format_size(1 << 10), "1 KiB");
    }
}
