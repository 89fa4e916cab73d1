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

/// Leaves out a location's innermost (inlined) frames of the allocator path, keeping at least
/// its outermost frame (the function the address is in). Applied by the symbolizer to every
/// resolved location.
pub(crate) fn strip_inlined_allocator(frames: Box<[ResolvedFrame]>) -> Box<[ResolvedFrame]> {
    let n = inlined_allocator_frames(frames.iter().map(|f| f.name.as_str()));
    if n == 0 {
        return frames;
    }
    let mut v = frames.into_vec();
    v.drain(..n);
    v.into_boxed_slice()
}

/// How many of a location's frames (innermost first) [`strip_inlined_allocator`] leaves out.
fn inlined_allocator_frames<'a>(names: impl ExactSizeIterator<Item = &'a str>) -> usize {
    let len = names.len();
    names
        .take_while(|n| is_allocator_path(n))
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

    #[test]
    fn inlined_allocator_frames_go_and_the_outermost_stays() {
        let n = |names: &[&str]| inlined_allocator_frames(names.iter().copied());
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
