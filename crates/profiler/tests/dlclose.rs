//! Plugin hot reload under CPU profiling: a library is unloaded, another one is loaded into the
//! address range it occupied, and code in the new one runs while sampled at 1 kHz. The unwinder's
//! module snapshot still describes the old library for a while; it must cost wrong or lost
//! frames at worst, never a read of memory that went away (the process dies of SIGSEGV).
//!
//! The big plugin's unwind sections lie 256 KiB above its base; the small one, loaded at the
//! same base, ends long before that, so a stale snapshot points the unwinder at unmapped memory.
//! The body runs in a child process, so a crash fails the test. `FERROPROF_DLCLOSE_RUNS`
//! (default 1) repeats the child for `scripts/reliability.sh`.

mod child_support;
mod profiler_support;

use std::ffi::{c_void, CString};
use std::time::{Duration, Instant};

use child_support::*;
use ferroprof::{Profiler, Profiles};
use profiler_support::Collect;

type Burn = unsafe extern "C" fn(u64) -> u64;

struct Plugin {
    handle: *mut c_void,
    burn: Burn,
    base: usize,
    /// One past the highest address of the plugin's segments.
    end: usize,
}

/// One past the highest segment address of the loaded object based at `base`.
fn object_end(base: usize) -> usize {
    unsafe extern "C" fn cb(
        info: *mut libc::dl_phdr_info,
        _size: libc::size_t,
        data: *mut c_void,
    ) -> libc::c_int {
        // SAFETY: `data` is the (base, end) pair below; `info` and its phdrs are valid here.
        unsafe {
            let want = &mut *(data as *mut (usize, usize));
            let info = &*info;
            if info.dlpi_addr as usize != want.0 {
                return 0;
            }
            let phdrs = std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize);
            for ph in phdrs.iter().filter(|p| p.p_type == libc::PT_LOAD) {
                want.1 = want.1.max(want.0 + (ph.p_vaddr + ph.p_memsz) as usize);
            }
            1
        }
    }
    let mut want = (base, 0usize);
    // SAFETY: the callback only touches `want` and the loader's info.
    unsafe { libc::dl_iterate_phdr(Some(cb), &mut want as *mut (usize, usize) as *mut c_void) };
    want.1
}

fn open(path: &std::path::Path) -> Plugin {
    let c = CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: a valid C string; the fixtures have no constructors.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!handle.is_null(), "dlopen {}", path.display());
    // SAFETY: a live handle and a C string literal.
    let sym = unsafe { libc::dlsym(handle, c"plugin_burn".as_ptr()) };
    assert!(!sym.is_null(), "plugin_burn in {}", path.display());
    // SAFETY: plain data out-struct.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: `sym` is an address in a loaded object.
    assert!(unsafe { libc::dladdr(sym, &mut info) } != 0);
    let base = info.dli_fbase as usize;
    Plugin {
        handle,
        end: object_end(base),
        // SAFETY: the fixtures define plugin_burn with this signature.
        burn: unsafe { std::mem::transmute::<*mut c_void, Burn>(sym) },
        base,
    }
}

/// Runs the plugin's loop for about `d`.
fn burn_for(p: &Plugin, d: Duration) -> u64 {
    let end = Instant::now() + d;
    let mut acc = 0u64;
    while Instant::now() < end {
        // SAFETY: the plugin is loaded.
        acc ^= unsafe { (p.burn)(20_000) };
    }
    acc
}

fn close(p: Plugin) {
    // SAFETY: a handle from dlopen, closed once; nothing of the plugin is used afterwards.
    assert_eq!(unsafe { libc::dlclose(p.handle) }, 0);
}

#[test]
fn reloaded_plugin_in_the_same_range_is_sampled_without_crashing() {
    const NAME: &str = "reloaded_plugin_in_the_same_range_is_sampled_without_crashing";
    if is_child(NAME) {
        return child_body();
    }
    let runs: usize = std::env::var("FERROPROF_DLCLOSE_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    for run in 0..runs {
        let out = run_child(NAME, &[], Duration::from_secs(120));
        assert!(
            out.status.success(),
            "run {run}: the profiled process died:\n{}",
            out.describe()
        );
        let same = out.value("same_base").unwrap_or(0);
        assert!(
            same >= 1,
            "run {run}: the small plugin never landed inside the big one's old range: the test \
             proved nothing\n{}",
            out.describe()
        );
        if run == 0 {
            eprintln!("{}", out.stdout);
        }
    }
}

fn child_body() {
    // Where the small plugin lands is the kernel's choice: rounds go on (up to a limit) until
    // one landed in the big one's old range. (The first round does, in practice; later big
    // plugins often land elsewhere, their old hole being too small for the kernel's 2 MiB
    // alignment padding.)
    let wanted = 1;
    let max_rounds = 10;
    let dir = profiler_support::temp_dir("dlclose");
    let big = build_c_library("plugin_big", &dir);
    let small = build_c_library("plugin_small", &dir);
    let collect = Collect::default();
    let guard = Profiler::builder()
        .cpu_hz(1000)
        .profiles(Profiles {
            cpu: true,
            wall: true,
            alloc: false,
            heap: false,
        })
        .period(Duration::from_secs(3600))
        .exporter(Box::new(collect.clone()))
        .start()
        .expect("start the profiler");
    let mut same_base = 0;
    let mut acc = 0u64;
    let mut rounds = 0;
    while same_base < wanted && rounds < max_rounds {
        rounds += 1;
        let a = open(&big);
        acc ^= burn_for(&a, Duration::from_millis(20));
        // A new thread makes the sampler rebuild its snapshot soon: it now lists the big plugin.
        std::thread::spawn(|| ()).join().unwrap();
        acc ^= burn_for(&a, Duration::from_millis(80));
        let (base_a, end_a) = (a.base, a.end);
        close(a);
        let b = open(&small);
        // Inside the big plugin's old range, above its unwind sections (its first 64 KiB).
        if b.base >= base_a + 0x10000 && b.end <= end_a {
            same_base += 1;
        }
        // Sampled while the snapshot may still describe the big plugin here.
        acc ^= burn_for(&b, Duration::from_millis(150));
        close(b);
    }
    let stats = guard.stats();
    guard.stop().expect("stop");
    std::hint::black_box(acc);
    println!("same_base={same_base}");
    println!("rounds={rounds}");
    println!("cpu_samples={}", stats.cpu_samples);
    println!("snapshot_builds={}", stats.snapshot_builds);
    let _ = std::fs::remove_dir_all(&dir);
}
