//! Reading profiles and turning them into per-function tables, diffs and folded stacks.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;
use std::io::Read as _;
use std::path::Path;

use ferroprof_pprof::{Profile, ReadError};

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
/// decompresses to may exceed `max_size` bytes; both are checked while reading, so a hostile
/// file costs at most about `max_size` bytes of memory before the error.
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

/// The sample type to show: `wanted`, else the profile's default, else the first.
pub fn pick_type(p: &Profile, wanted: Option<&str>, path: &Path) -> anyhow::Result<usize> {
    let types = p.sample_types();
    if types.is_empty() {
        return Err(err(format!("{} has no sample types", path.display())));
    }
    match wanted {
        Some(name) => p.value_index(name).ok_or_else(|| {
            let names: Vec<&str> = types.iter().map(|(t, _)| t.as_str()).collect();
            err(format!(
                "{} has no sample type {name:?}; it has: {}",
                path.display(),
                names.join(", ")
            ))
        }),
        None => {
            let default = p.str(p.default_sample_type);
            Ok(p.value_index(default)
                .filter(|_| !default.is_empty())
                .unwrap_or(0))
        }
    }
}

/// Flat and cumulative value per function for one sample type.
#[derive(Debug, Clone, Default)]
pub struct FunctionTable {
    pub type_name: String,
    pub unit: String,
    pub total: i64,
    pub samples: usize,
    /// (function, flat, cum), unsorted.
    pub rows: Vec<(String, i64, i64)>,
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

    fn build_with(p: &Profile, index: usize, sites: bool) -> Self {
        let (type_name, unit) = p.sample_types().swap_remove(index);
        let mut flat: HashMap<String, i64> = HashMap::new();
        let mut cum: HashMap<String, i64> = HashMap::new();
        let mut total = 0i64;
        let mut samples = 0;
        for s in &p.sample {
            let v = s.value.get(index).copied().unwrap_or(0);
            if v == 0 {
                continue;
            }
            samples += 1;
            total = total.saturating_add(v);
            let names = p.stack_names(s);
            let leaf_at = if sites {
                names
                    .iter()
                    .position(|n| !is_alloc_machinery(n))
                    .unwrap_or(0)
            } else {
                0
            };
            let leaf = names.get(leaf_at).map(String::as_str).unwrap_or(NO_FRAMES);
            // Saturating: a crafted file's values must not overflow into a panic (or wrap).
            let f = flat.entry(leaf.to_owned()).or_default();
            *f = f.saturating_add(v);
            // A recursive function counts once per sample in `cum`.
            let mut seen = HashSet::new();
            if names.is_empty() {
                let c = cum.entry(NO_FRAMES.to_owned()).or_default();
                *c = c.saturating_add(v);
            }
            for n in names {
                if seen.insert(n.clone()) {
                    let c = cum.entry(n).or_default();
                    *c = c.saturating_add(v);
                }
            }
        }
        let rows = cum
            .into_iter()
            .map(|(f, c)| {
                let fl = flat.get(&f).copied().unwrap_or(0);
                (f, fl, c)
            })
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
    pub fn sorted(&self, by_cum: bool) -> Vec<(String, i64, i64)> {
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

    /// Flat value of `function`.
    pub fn flat(&self, function: &str) -> i64 {
        self.rows
            .iter()
            .find(|r| r.0 == function)
            .map(|r| r.1)
            .unwrap_or(0)
    }
}

/// Sample types whose samples are taken inside the allocator.
pub fn is_alloc_type(name: &str) -> bool {
    name.starts_with("alloc-") || name.starts_with("heap-")
}

/// Frames of the allocation path itself (the profiler's allocator, Rust's `alloc`, `core`
/// iterator plumbing, `std`), which sit above the function that asked for the memory.
pub fn is_alloc_machinery(name: &str) -> bool {
    const PREFIXES: &[&str] = &[
        "ferroprof::alloc::",
        "alloc::",
        "core::",
        "std::",
        "__rust",
        "__rdl_",
        "__rg_",
        "malloc",
        "calloc",
        "realloc",
    ];
    let path = name.strip_prefix('<').unwrap_or(name);
    PREFIXES.iter().any(|p| path.starts_with(p))
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
        );
    }
    out
}

/// The `diff` report: per-function flat values in A and B and their difference.
pub fn diff_text(a: &FunctionTable, b: &FunctionTable, n: usize) -> String {
    let unit = &b.unit;
    let mut out = String::new();
    let delta_total = b.total.saturating_sub(a.total);
    let rel = if a.total != 0 {
        format!(" ({:+.1}%)", delta_total as f64 * 100.0 / a.total as f64)
    } else {
        String::new()
    };
    let _ = writeln!(
        out,
        "{} ({unit}): total A {} -> B {}, delta {}{rel}",
        b.type_name,
        format_value(a.total, unit),
        format_value(b.total, unit),
        signed(delta_total, unit),
    );
    let mut names: Vec<&str> = a.rows.iter().chain(&b.rows).map(|r| r.0.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    let mut rows: Vec<(&str, i64, i64)> = names
        .into_iter()
        .map(|f| (f, a.flat(f), b.flat(f)))
        .filter(|(_, x, y)| x != y)
        .collect();
    let change = |r: &(&str, i64, i64)| r.2.saturating_sub(r.1).unsigned_abs();
    rows.sort_by(|x, y| change(y).cmp(&change(x)).then(x.0.cmp(y.0)));
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
        let pct = if x != 0 {
            format!("{:+.1}%", (y as f64 - x as f64) * 100.0 / x as f64)
        } else {
            "new".to_owned()
        };
        let _ = writeln!(
            out,
            "{:>11} {:>11} {:>12} {:>8}  {f}",
            format_value(x, unit),
            format_value(y, unit),
            signed(y.saturating_sub(x), unit),
            pct
        );
    }
    out
}

fn signed(v: i64, unit: &str) -> String {
    if v > 0 {
        format!("+{}", format_value(v, unit))
    } else {
        format_value(v, unit)
    }
}

/// Folded stacks (`root;...;leaf value`), one line per distinct stack, for flame graphs.
pub fn folded(p: &Profile, index: usize) -> Vec<String> {
    let mut acc: HashMap<String, i64> = HashMap::new();
    for s in &p.sample {
        let v = s.value.get(index).copied().unwrap_or(0);
        if v <= 0 {
            continue;
        }
        let mut names = p.stack_names(s);
        if names.is_empty() {
            names.push(NO_FRAMES.to_owned());
        }
        // `;` separates frames in the folded format; Rust names can contain it (`[u8; 4]`).
        let line = names
            .iter()
            .rev()
            .map(|n| n.replace(';', ","))
            .collect::<Vec<_>>()
            .join(";");
        let a = acc.entry(line).or_default();
        *a = a.saturating_add(v);
    }
    let mut lines: Vec<String> = acc.into_iter().map(|(k, v)| format!("{k} {v}")).collect();
    lines.sort();
    lines
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
    fn flat_and_cum() {
        let t = FunctionTable::build(&profile(), 0);
        assert_eq!(t.total, 4_500_000_000);
        let rows = t.sorted(false);
        assert_eq!(rows[0], ("hot".to_owned(), 3_000_000_000, 3_000_000_000));
        let main = rows.iter().find(|r| r.0 == "main").unwrap();
        assert_eq!((main.1, main.2), (0, 4_500_000_000));
        let rec = rows.iter().find(|r| r.0 == "rec").unwrap();
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
                    "ferroprof::alloc::on_alloc",
                    "<ferroprof::alloc::SamplingAllocator<A> as core::alloc::global::GlobalAlloc>::alloc",
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
            ("app::load_cache".to_owned(), 1 << 20, 1 << 20)
        );
        let raw = FunctionTable::build(&p, 0);
        assert_eq!(raw.sorted(false)[0].0, "ferroprof::alloc::on_alloc");
        // CPU types keep their leaf frames.
        let q = ferroprof_pprof::ProfileBuilder::new(&[("cpu-time", "nanoseconds")])
            .sample(&["core::ptr::drop_in_place", "app::f"], &[5], &[])
            .build();
        assert_eq!(
            FunctionTable::build_sites(&q, 0).sorted(false)[0].0,
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
        let lines = folded(&profile(), 1);
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
