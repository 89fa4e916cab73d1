//! Compiles `src/exec_variadic.c` (`execl`, `execlp`, `execle`: variadic functions, which stable
//! Rust cannot define) and exports its functions from the shared library: rustc's version
//! script exports only Rust's own `#[no_mangle]` items, so a second script names these.

fn main() {
    println!("cargo:rerun-if-changed=src/exec_variadic.c");
    cc::Build::new()
        .file("src/exec_variadic.c")
        .flag_if_supported("-fno-omit-frame-pointer")
        .compile("ferroprof_exec_variadic");
    let out = std::env::var("OUT_DIR").expect("OUT_DIR is set by cargo");
    let script = std::path::Path::new(&out).join("exec_variadic.map");
    std::fs::write(&script, "{ global: execl; execlp; execle; };\n")
        .expect("write the version script");
    println!(
        "cargo:rustc-cdylib-link-arg=-Wl,--version-script={}",
        script.display()
    );
}
