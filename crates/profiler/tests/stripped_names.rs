//! A stripped object keeps only its exported symbols: an address in an internal function must
//! not be named after the exported function below it (the symbol's size says where that one
//! ends). Built with gcc and stripped with binutils' `strip`.

use std::path::PathBuf;
use std::process::Command;

use ferroprof::ProcessSymbolizer;

fn build_stripped_lib() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ferroprof-stripped-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/stripped_lib.c");
    let so = dir.join("libstripped.so");
    let st = Command::new("gcc")
        .args(["-O1", "-fno-toplevel-reorder", "-shared", "-fPIC", "-o"])
        .arg(&so)
        .arg(&src)
        .status()
        .expect("gcc runs (scripts/test-deps.sh installs it)");
    assert!(st.success(), "gcc failed");
    let st = Command::new("strip")
        .arg("--strip-all")
        .arg(&so)
        .status()
        .expect("strip runs");
    assert!(st.success(), "strip failed");
    so
}

#[test]
fn an_internal_function_of_a_stripped_object_is_not_named_after_an_exported_one() {
    let so = build_stripped_lib();
    let path = std::ffi::CString::new(so.to_str().unwrap()).unwrap();
    // SAFETY: loading our own fixture, whose constructors do nothing.
    let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW) };
    assert!(!handle.is_null(), "dlopen {}", so.display());
    let sym = |name: &std::ffi::CStr| {
        // SAFETY: a symbol lookup in a handle we hold, with a NUL-terminated name.
        let p = unsafe { libc::dlsym(handle, name.as_ptr()) };
        assert!(!p.is_null(), "{name:?} missing");
        p as u64
    };
    let exported = sym(c"exported_entry");
    // SAFETY: the fixture's function of this signature.
    let internal_address: extern "C" fn() -> *const u8 =
        unsafe { std::mem::transmute(sym(c"internal_address") as *const u8) };
    let internal = internal_address() as u64;
    // -fno-toplevel-reorder keeps source order: the internal function follows the exported one.
    assert!(internal > exported, "the fixture's layout changed");

    let mut s = ProcessSymbolizer::new();
    let name_at = |s: &mut ProcessSymbolizer, a: u64| {
        s.pass(|s| s.resolve(a))
            .iter()
            .map(|f| f.name.clone())
            .collect::<Vec<_>>()
    };
    // Inside the exported function: its name (the table still has it).
    assert_eq!(name_at(&mut s, exported + 1), vec!["exported_entry"]);
    // Inside the internal one: not the exported function's name.
    let inside = name_at(&mut s, internal + 8);
    assert!(
        !inside.iter().any(|n| n.contains("exported_entry")),
        "internal code named after the exported symbol below it: {inside:?}"
    );
    // Named by the function's entry (from the unwind table), so that its addresses add up.
    // SAFETY: Dl_info is plain data (pointers and integers): all zeroes is a valid value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: `internal` is code of the loaded fixture; `info` is ours to fill.
    assert_ne!(unsafe { libc::dladdr(internal as *const _, &mut info) }, 0);
    let entry = format!("libstripped.so+{:#x}", internal - info.dli_fbase as u64);
    assert_eq!(inside, vec![entry.clone()]);
    assert_eq!(name_at(&mut s, internal + 30), vec![entry]);
    let _ = std::fs::remove_dir_all(so.parent().unwrap());
}
