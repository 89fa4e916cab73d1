//! Names and paths as the symbolizer writes them: demangling, comparing a full name with a
//! short one, path tails, merged address ranges.

/// Whether a demangled symbol and DWARF's short name name the same function: the same last path
/// segment, generic arguments and shim marks aside (`<app::Rle as app::Codec>::encode` and
/// `encode`, `alloc::vec::from_elem` and `from_elem<u8>`, `FnOnce::call_once{{vtable.shim}}`
/// and `call_once<F, ()>`); closures (`{{closure}}`, `{closure#0}`) agree with each other.
pub(super) fn names_agree(full: &str, short: &str) -> bool {
    let (a, b) = (last_segment(full), last_segment(short));
    a == b || (a.starts_with('{') && b.starts_with('{'))
}

/// The last `::`-separated segment of a name that names a function (a v0 `::{shim:...}` names
/// the one before it), outside angle brackets, without its generic arguments or a legacy
/// `{{...shim}}` mark.
pub(super) fn last_segment(s: &str) -> &str {
    let seg = path_tail(s);
    match s.len().checked_sub(seg.len() + 2) {
        Some(head) if seg.starts_with("{shim") && s[head..].starts_with("::") => {
            path_tail(&s[..head])
        }
        _ => seg,
    }
}

pub(super) fn path_tail(s: &str) -> &str {
    let b = s.as_bytes();
    let mut depth = 0u32;
    let (mut from, mut to) = (0usize, None);
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'<' => {
                if depth == 0 {
                    to.get_or_insert(i);
                }
                depth += 1;
            }
            // `call_once{{vtable.shim}}`; a segment that starts with `{` is a closure's.
            b'{' if depth == 0 && i > from => {
                to.get_or_insert(i);
            }
            // `->` in a function type closes nothing.
            b'>' if i > 0 && b[i - 1] == b'-' => {}
            b'>' => depth = depth.saturating_sub(1),
            b':' if depth == 0 && b.get(i + 1) == Some(&b':') => {
                if b.get(i + 2) == Some(&b'<') {
                    // `f::<T>`: generic arguments, not a path.
                    to.get_or_insert(i);
                } else {
                    (from, to) = (i + 2, None);
                }
                i += 2;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    &s[from..to.unwrap_or(b.len()).max(from)]
}

/// `ranges` sorted by start, adjacent or overlapping ranges of one unit merged.
pub(super) fn merge_ranges(ranges: &mut [(u64, u64, u32)]) -> Vec<(u64, u64, u32)> {
    ranges.sort_unstable_by_key(|r| r.0);
    let mut merged: Vec<(u64, u64, u32)> = Vec::with_capacity(ranges.len());
    for &r in ranges.iter() {
        match merged.last_mut() {
            Some(last) if last.2 == r.2 && last.1 >= r.0 => last.1 = last.1.max(r.1),
            _ => merged.push(r),
        }
    }
    merged
}

/// Rust names lose their hash (`{:#}`); other names pass through.
pub(super) fn demangle(raw: &str) -> String {
    match rustc_demangle::try_demangle(raw) {
        Ok(d) => format!("{d:#}"),
        Err(_) => raw.to_owned(),
    }
}
