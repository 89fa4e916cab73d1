//! Allocation and heap stacks start at the allocating code: no frame of ferroprof's allocator
//! nor of the global-allocator shims (`__rust_alloc`, `__rdl_alloc`, `alloc::alloc::alloc`,
//! `Global::alloc_impl`) is written, whatever was inlined into what. Functions known by name
//! allocate known sizes (out of line, inlined into their caller, through `realloc` and
//! `alloc_zeroed`); the exported allocation profile, the heap profile and the
//! `/debug/pprof/heap` answer are read with the independent decoder and with
//! `go tool pprof -top`.
//!
//! The test binary is a debug build: there every allocator function is a real frame (nothing
//! is inlined), which the capture drops by address. Under `cargo test --release` the
//! allocator entry is inlined into `__rust_alloc` or into the caller and the leaf location's
//! inlined frames are stripped at symbolization: run both (`cargo test -p ferroprof --test
//! alloc_leaf` and the same with `--release`), and at the level services build with
//! (`CARGO_PROFILE_RELEASE_DEBUG=line-tables-only` and `--release`: inlined frames then have
//! short names, told apart by their files).
//!
//! One test in its own binary: the profiler is process-wide.

mod profiler_support;

use std::alloc::{Layout, System};
use std::hint::black_box;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use ferroprof::{Profiler, Profiles, SamplingAllocator};
use ferroprof_pprof::Profile;
use profiler_support::*;

#[global_allocator]
static GLOBAL: SamplingAllocator<System> = SamplingAllocator::new(System);

/// Small against the sizes below: every allocation of the test is sampled, nearly.
const INTERVAL: u64 = 4 * 1024;
const SIZE: usize = 48 * 1024;
const ROUNDS: usize = 64;

/// Asks for memory itself, through `std::alloc::alloc` (the allocation's leaf must be this
/// function: `alloc::alloc::alloc` is the allocator path's shim).
#[inline(never)]
fn leaf_direct_alloc(keep: &mut Vec<(usize, Layout)>) {
    let layout = Layout::from_size_align(SIZE, 16).unwrap();
    // SAFETY: a non-zero size; freed in `free_direct`.
    let p = unsafe { std::alloc::alloc(layout) };
    assert!(!p.is_null());
    keep.push((p as usize, layout));
}

/// The same through `alloc_zeroed`.
#[inline(never)]
fn leaf_direct_zeroed(keep: &mut Vec<(usize, Layout)>) {
    let layout = Layout::from_size_align(SIZE, 16).unwrap();
    // SAFETY: a non-zero size; freed in `free_direct`.
    let p = unsafe { std::alloc::alloc_zeroed(layout) };
    assert!(!p.is_null());
    keep.push((p as usize, layout));
}

fn free_direct(keep: Vec<(usize, Layout)>) {
    for (p, layout) in keep {
        // SAFETY: allocated above with this layout.
        unsafe { std::alloc::dealloc(p as *mut u8, layout) };
    }
}

/// Out of line, through `Vec` (`alloc::raw_vec` frames may stand between it and the leaf).
#[inline(never)]
fn leaf_vec_never() -> Vec<u8> {
    black_box(Vec::with_capacity(SIZE))
}

/// Inlined into its caller: the leaf location is `leaf_vec_outer`'s, with this function and
/// (in release) the allocator's inlined frames expanded from it.
#[inline(always)]
fn leaf_vec_inlined() -> Vec<u8> {
    black_box(Vec::with_capacity(SIZE))
}

#[inline(never)]
fn leaf_vec_outer() -> Vec<u8> {
    leaf_vec_inlined()
}

/// Grows a vector: the sampled allocation is a `realloc`.
#[inline(never)]
fn leaf_realloc() -> Vec<u8> {
    let mut v: Vec<u8> = Vec::with_capacity(8);
    v.push(1);
    v.reserve_exact(SIZE);
    black_box(v)
}

const TEST_FNS: &[&str] = &[
    "leaf_direct_alloc",
    "leaf_direct_zeroed",
    "leaf_vec_never",
    "leaf_vec_inlined",
    "leaf_vec_outer",
    "leaf_realloc",
];

/// A frame of the allocator path: ferroprof's allocator, the global-allocator shims and
/// `alloc::alloc`'s plumbing to them. (Other ferroprof frames are the caller's own: the test
/// calls `ferroprof::http::serve`, which allocates.) By file as well as by name: at
/// `debug = "line-tables-only"` inlined frames have short names (`alloc`, `allocate`).
fn is_allocator_frame(name: &str, file: &str) -> bool {
    let path = name.strip_prefix('<').unwrap_or(name);
    file.ends_with("/library/alloc/src/alloc.rs")
        || file.starts_with(concat!(env!("CARGO_MANIFEST_DIR"), "/src/alloc/"))
        || path.starts_with("ferroprof::alloc::")
        || name.contains("SamplingAllocator")
        || name.contains("__rust_alloc")
        || name.contains("__rust_realloc")
        || name.contains("__rdl_")
        || name.contains("__rg_")
        || path.starts_with("alloc::alloc::")
}

/// What may stand at the leaf of one of the test's allocations: the test function itself, or
/// `Vec`'s code called by it (by file too: short names at `line-tables-only`).
fn acceptable_leaf(name: &str, file: &str) -> bool {
    let path = name.strip_prefix('<').unwrap_or(name);
    TEST_FNS.iter().any(|f| name.ends_with(f))
        || file.contains("/library/alloc/src/raw_vec/")
        || file.contains("/library/alloc/src/vec/")
        || path.starts_with("alloc::raw_vec::")
        || path.starts_with("alloc::vec::")
        || name.contains(" as alloc::vec::")
        || name.contains(" as alloc::raw_vec::")
}

/// Checks every sample of `p` with a non-zero `value`; returns how many were the test's.
fn check(what: &str, p: &Profile, value: &str) -> usize {
    let i = p
        .value_index(value)
        .unwrap_or_else(|| panic!("{what}: no {value}"));
    let mut ours = 0;
    for s in p.sample.iter().filter(|s| s.value[i] != 0) {
        let lines = p.stack(s);
        let names = p.stack_names(s);
        assert!(!names.is_empty(), "{what}: a sample without frames");
        if let Some(bad) = lines
            .iter()
            .find(|l| is_allocator_frame(&l.function, &l.filename))
        {
            panic!(
                "{what}: allocator frame {} ({}) in a written stack:\n  {names:#?}",
                bad.function, bad.filename
            );
        }
        if let Some(pos) = names
            .iter()
            .position(|n| TEST_FNS.iter().any(|f| n.ends_with(f)))
        {
            ours += 1;
            assert!(
                acceptable_leaf(&lines[0].function, &lines[0].filename),
                "{what}: leaf {:?} is neither the allocating function nor Vec's code:\n  {names:#?}",
                names[0]
            );
            // Only `Vec`'s code stands between the leaf and the test function.
            assert!(
                lines[..pos]
                    .iter()
                    .all(|l| acceptable_leaf(&l.function, &l.filename)),
                "{what}: unexpected frames above the allocating function:\n  {names:#?}"
            );
        }
    }
    ours
}

/// GET `target`, the body of a 200 answer.
fn get(addr: SocketAddr, target: &str) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(s, "GET {target} HTTP/1.1\r\nHost: test\r\n\r\n").unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("head end");
    let head = String::from_utf8_lossy(&raw[..split]);
    assert!(head.starts_with("HTTP/1.1 200"), "{target}: {head}");
    raw[split + 4..].to_vec()
}

#[test]
fn allocation_and_heap_stacks_start_at_the_allocating_code() {
    let c = Collect::default();
    let guard = Profiler::builder()
        .service("alloc-leaf-test")
        .profiles(Profiles {
            cpu: false,
            wall: false,
            alloc: true,
            heap: true,
        })
        .alloc_interval_bytes(INTERVAL)
        .period(Duration::from_secs(3600))
        .exporter(Box::new(c.clone()))
        .start()
        .expect("profiler starts");
    assert!(guard.allocator_installed());
    let server = ferroprof::http::serve("127.0.0.1:0", guard.profile_source()).unwrap();

    // Half of each kind stays live for the heap profile.
    let mut live: Vec<Vec<u8>> = Vec::new();
    let mut direct = Vec::new();
    for r in 0..ROUNDS {
        let keep = r % 2 == 0;
        let mut d = Vec::new();
        leaf_direct_alloc(&mut d);
        leaf_direct_zeroed(&mut d);
        for v in [leaf_vec_never(), leaf_vec_outer(), leaf_realloc()] {
            if keep {
                live.push(v);
            }
        }
        if keep {
            direct.extend(d);
        } else {
            free_direct(d);
        }
    }

    let heap_bytes = get(server.addr(), "/debug/pprof/heap");
    server.stop();
    let served = ferroprof_pprof::decode(&heap_bytes).expect("/debug/pprof/heap decodes");
    guard.stop().expect("stop");
    let ps = c.decoded();
    assert_eq!(ps.len(), 1, "one profile, at stop");
    let p = &ps[0];

    let mut counts = Vec::new();
    for (what, prof, value) in [
        ("allocations", p, "alloc-samples"),
        ("heap", p, "heap-live-size"),
        ("/debug/pprof/heap live", &served, "heap-live-size"),
        ("/debug/pprof/heap allocs", &served, "alloc-space"),
    ] {
        let n = check(what, prof, value);
        eprintln!("{what}: {n} samples of the test's allocations");
        counts.push(n);
    }
    assert!(
        counts.iter().all(|&n| n >= 5),
        "too few samples: {counts:?}"
    );
    let i = p.value_index("alloc-samples").unwrap();
    // Every allocating function was sampled (each allocation is 12 intervals).
    for f in [
        "leaf_direct_alloc",
        "leaf_direct_zeroed",
        "leaf_vec_never",
        "leaf_vec_inlined",
        "leaf_realloc",
    ] {
        let seen = p.sample.iter().any(|s| s.value[i] != 0 && has_fn(p, s, f));
        assert!(seen, "no allocation sample of {f}");
    }
    for f in ["leaf_direct_alloc", "leaf_direct_zeroed"] {
        // These asked for memory themselves: they are the leaf.
        let at_leaf = p
            .sample
            .iter()
            .filter(|s| s.value[i] != 0)
            .any(|s| p.stack_names(s).first().is_some_and(|n| n.ends_with(f)));
        assert!(at_leaf, "{f} is never the leaf of an allocation stack");
    }

    if let Some(go) = ferroprof_pprof::go_tool::go_for_tests() {
        let file = temp_dir("alloc-leaf").join("heap.pb.gz");
        std::fs::write(&file, &heap_bytes).unwrap();
        let file = file.to_str().unwrap();
        for index in ["heap-live-size", "alloc-space"] {
            let top = ferroprof_pprof::go_tool::pprof_for_tests(
                &go,
                &[
                    "-top",
                    &format!("-sample_index={index}"),
                    "-nodecount=10",
                    file,
                ],
            );
            eprintln!("{top}");
            // The rows after the header (`flat flat% sum% cum cum%`).
            let rows: Vec<&str> = top
                .lines()
                .skip_while(|l| !l.trim_start().starts_with("flat"))
                .skip(1)
                .collect();
            assert!(!rows.is_empty(), "no rows in:\n{top}");
            for row in &rows {
                assert!(
                    !row.contains("SamplingAllocator")
                        && !row.contains("ferroprof::")
                        && !row.contains("__rust_alloc")
                        && !row.contains("__rdl_alloc"),
                    "go tool pprof -top ({index}) names the allocator:\n{top}"
                );
            }
        }
    }

    drop(live);
    free_direct(direct);
}
