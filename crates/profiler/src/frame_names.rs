//! Which frames of a stack are the allocator's own machinery, by name: the symbolizer drops a
//! location's innermost inlined frames of the allocator path, and the sampling allocator finds
//! the allocator-path functions' address ranges from the symbol table. Plain string policy, no
//! state: usable from any layer.

use ferroprof_recorder::ResolvedFrame;

/// Whether a function (its demangled name without hash, as the symbolizer writes it) belongs
/// to the allocator path: ferroprof's allocator, the global-allocator shims, or `alloc::alloc`'s
/// plumbing from the allocating code to them. `alloc::raw_vec`, `alloc::vec`, `hashbrown` and
/// `Box::new` are not: they are the allocating code's own call chain.
pub(crate) fn is_allocator_path(name: &str) -> bool {
    let path = name.strip_prefix('<').unwrap_or(name);
    if path.starts_with("ferroprof::alloc::")
        || path.starts_with("alloc::alloc::")
        || name == "ferroprof::unwind::arch::current_sp"
    {
        return true;
    }
    // The shims are free functions: `__rust_alloc`, `__rustc::__rust_alloc` (v0 mangling),
    // `std::alloc::__default_lib_allocator::__rdl_alloc`.
    if name.contains('<') {
        return false;
    }
    let last = name.rsplit("::").next().unwrap_or(name);
    matches!(
        last,
        "__rust_alloc" | "__rust_alloc_zeroed" | "__rust_realloc" | "__rust_dealloc"
    ) || last.starts_with("__rdl_")
        || last.starts_with("__rg_")
}

/// Whether a source file holds allocator-path functions only: `alloc::alloc` (std's
/// `library/alloc/src/alloc.rs`) and ferroprof's own `src/alloc/`. For inlined frames of code
/// built with `debug = "line-tables-only"`, whose DWARF names are short (`alloc`, `allocate`,
/// `alloc<std::alloc::System>`): their file says what their name cannot. Paths as the compiler
/// wrote them, so a build that remaps its source paths keeps the names' verdict only.
fn is_allocator_source(file: &str) -> bool {
    file.ends_with("/library/alloc/src/alloc.rs") || file.starts_with(OWN_ALLOC_SOURCES)
}

/// Where ferroprof's allocator sources were when this crate was built (DWARF names them so).
const OWN_ALLOC_SOURCES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src/alloc/");

/// Whether a resolved inlined frame is of the allocator path, by its name or its file.
fn is_allocator_frame(f: &ResolvedFrame) -> bool {
    is_allocator_path(&f.name) || is_allocator_source(&f.filename)
}

/// Leaves out a location's innermost (inlined) frames of the allocator path, keeping at least
/// its outermost frame (the function the address is in). Applied by the symbolizer to every
/// resolved location.
pub(crate) fn strip_inlined_allocator(frames: Box<[ResolvedFrame]>) -> Box<[ResolvedFrame]> {
    let n = inlined_allocator_frames(frames.iter().map(is_allocator_frame));
    if n == 0 {
        return frames;
    }
    let mut v = frames.into_vec();
    v.drain(..n);
    v.into_boxed_slice()
}

/// How many of a location's frames (innermost first, each whether it is of the allocator
/// path) [`strip_inlined_allocator`] leaves out.
fn inlined_allocator_frames(allocator: impl ExactSizeIterator<Item = bool>) -> usize {
    let len = allocator.len();
    allocator
        .take_while(|&a| a)
        .count()
        .min(len.saturating_sub(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocator_path_names() {
        for name in [
            "<ferroprof::alloc::SamplingAllocator<A> as core::alloc::global::GlobalAlloc>::alloc",
            "<ferroprof::alloc::SamplingAllocator<std::alloc::System> as core::alloc::global::GlobalAlloc>::realloc",
            "ferroprof::alloc::on_alloc_slow",
            "__rust_alloc",
            "__rustc::__rust_alloc_zeroed",
            "__rustc::__rust_realloc",
            "std::alloc::__default_lib_allocator::__rdl_alloc",
            "__rg_alloc",
            "alloc::alloc::alloc",
            "alloc::alloc::Global::alloc_impl",
            "<alloc::alloc::Global as core::alloc::Allocator>::allocate",
            "alloc::alloc::exchange_malloc",
        ] {
            assert!(is_allocator_path(name), "{name}");
        }
        for name in [
            "alloc::raw_vec::RawVecInner<A>::try_allocate_in",
            "<alloc::raw_vec::RawVecInner>::finish_grow",
            "alloc::boxed::Box<T>::new",
            "hashbrown::raw::RawTableInner::fallible_with_capacity",
            "ferroprof::http::serve",
            "app::__rust_alloc_helper<T>",
            "app::alloc",
            "malloc",
        ] {
            assert!(!is_allocator_path(name), "{name}");
        }
    }

    /// At `debug = "line-tables-only"` inlined frames have DWARF's short names; their files
    /// tell the allocator path (these frames stood at the leaf of 30% of a release program's
    /// allocation samples before).
    #[test]
    fn short_inlined_names_of_the_allocator_path_go_by_their_file() {
        let frame = |name: &str, filename: &str| ResolvedFrame {
            name: name.into(),
            filename: filename.into(),
            ..Default::default()
        };
        let std_alloc =
            "/rustc/59807616e1fa2540724bfbac14d7976d7e4a3860/library/alloc/src/alloc.rs";
        let frames: Box<[ResolvedFrame]> = vec![
            frame(
                "alloc<std::alloc::System>",
                concat!(env!("CARGO_MANIFEST_DIR"), "/src/alloc/mod.rs"),
            ),
            frame("__rust_alloc", ""),
            frame("alloc", std_alloc),
            frame("alloc_impl_runtime", std_alloc),
            frame("allocate", std_alloc),
            frame(
                "box_new_uninit",
                "/rustc/59807616e1fa2540724bfbac14d7976d7e4a3860/library/alloc/src/boxed.rs",
            ),
            frame("app::load", "/src/app/main.rs"),
        ]
        .into();
        let kept = strip_inlined_allocator(frames);
        let names: Vec<&str> = kept.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["box_new_uninit", "app::load"]);
        // The application's own short-named `alloc` stays.
        let own: Box<[ResolvedFrame]> = vec![
            frame("alloc", "/src/app/pool.rs"),
            frame("app::run", "/src/app/main.rs"),
        ]
        .into();
        assert_eq!(strip_inlined_allocator(own).len(), 2);
        assert!(!is_allocator_source("/src/app/alloc.rs"));
    }

    #[test]
    fn inlined_allocator_frames_go_and_the_outermost_stays() {
        let n =
            |names: &[&str]| inlined_allocator_frames(names.iter().map(|n| is_allocator_path(n)));
        assert_eq!(
            n(&[
                "<ferroprof::alloc::SamplingAllocator<A> as core::alloc::global::GlobalAlloc>::alloc",
                "__rustc::__rust_alloc",
                "alloc::alloc::alloc",
                "alloc::raw_vec::RawVecInner<A>::try_allocate_in",
                "alloc::alloc::alloc",
                "app::load",
            ]),
            3
        );
        // All of the allocator path (an address in a real `__rust_alloc`): the outermost stays.
        assert_eq!(
            n(&["ferroprof::alloc::on_alloc_slow", "__rustc::__rust_alloc"]),
            1
        );
        assert_eq!(n(&["app::load"]), 0);
        assert_eq!(n(&[]), 0);
    }
}
