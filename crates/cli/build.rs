//! Builds the preload library (`crates/preload`, a cdylib) so that the `ferroprof` binary carries
//! it: `cargo install` installs binaries only, and `record` needs the library (see
//! `record::find_preload` and docs/architecture.md, "The CLI carries the preload library").
//!
//! A nested `cargo build --release -p ferroprof-preload` with its own target directory (the
//! outer build holds the lock of its own), shared by every profile of the outer build so that
//! `cargo build`, `cargo test` and `cargo install --target-dir target` build it once. The library
//! is copied to `OUT_DIR` and embedded with `include_bytes!`; its SHA-256 names the directory it
//! is cached in at run time.
//!
//! Outside the ferroprof workspace (a packaged crate, e.g. from a registry) there is no
//! `crates/preload` to build: an empty file is embedded and `record` says so at run time.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

const LIB: &str = "libferroprof_preload.so";

fn main() {
    let manifest = PathBuf::from(env("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env("OUT_DIR"));
    let embedded = out_dir.join(LIB);
    let root = manifest.join("../..");
    let preload_manifest = root.join("crates/preload/Cargo.toml");
    println!("cargo:rerun-if-changed={}", preload_manifest.display());
    let in_workspace = std::fs::read_to_string(&preload_manifest)
        .is_ok_and(|t| t.contains("name = \"ferroprof-preload\""));
    if !in_workspace {
        write(&embedded, &[]);
        println!("cargo:rustc-env=FERROPROF_PRELOAD_SHA256=");
        println!(
            "cargo:warning=ferroprof-cli is built outside the ferroprof workspace: the preload \
             library is not embedded; `ferroprof record` needs $FERROPROF_PRELOAD or the library \
             next to the binary"
        );
        return;
    }
    // The nested build's inputs: the library and the crates it links (their sources, manifests
    // and build scripts), and the workspace's manifest and lock file.
    for dir in [
        "crates/preload",
        "crates/profiler/src",
        "crates/profiler/Cargo.toml",
        "crates/recorder/src",
        "crates/recorder/Cargo.toml",
        "crates/export/src",
        "crates/export/Cargo.toml",
        "Cargo.toml",
        "Cargo.lock",
    ] {
        println!("cargo:rerun-if-changed={}", root.join(dir).display());
    }

    let target = env("TARGET");
    let target_dir = nested_target_dir(&out_dir);
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = Command::new(cargo);
    build
        .current_dir(&root)
        .args([
            "build",
            "--release",
            "-p",
            "ferroprof-preload",
            "--target-dir",
        ])
        .arg(&target_dir)
        // Build-script output on stdout is read by cargo as instructions: keep it for ours.
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    if target != env("HOST") {
        build.args(["--target", &target]);
    }
    // The outer cargo's variables describe the outer package and build (its profile, features,
    // flags, a clippy or rustc wrapper for workspace members): the nested cargo would take them
    // for its own. Kept: the user's cargo settings (home, registries, network, profiles, build
    // and target settings; `--target-dir` overrides theirs) and the jobserver, so both builds
    // share the outer `-j`.
    for (k, _) in std::env::vars_os() {
        let Some(k) = k.to_str() else { continue };
        let keep = [
            "CARGO_HOME",
            "CARGO_MAKEFLAGS",
            "CARGO_NET_",
            "CARGO_HTTP_",
            "CARGO_REGISTRIES_",
            "CARGO_REGISTRY_",
            "CARGO_PROFILE_",
            "CARGO_TERM_",
            "CARGO_BUILD_",
            "CARGO_TARGET_",
        ]
        .iter()
        .any(|p| k.starts_with(p));
        let outer = (k.starts_with("CARGO_") && !keep)
            || k.starts_with("DEP_")
            || k.starts_with("__CARGO")
            || [
                "OUT_DIR",
                "TARGET",
                "HOST",
                "PROFILE",
                "OPT_LEVEL",
                "DEBUG",
                "NUM_JOBS",
                "RUSTC_WORKSPACE_WRAPPER",
                "CLIPPY_ARGS",
                "RUSTDOC",
                "RUSTC_LINKER",
            ]
            .contains(&k);
        if outer {
            build.env_remove(k);
        }
    }
    let status = build.status().unwrap_or_else(|e| {
        panic!("ferroprof-cli's build script could not run cargo to build the preload library: {e}")
    });
    if !status.success() {
        panic!(
            "building the preload library (cargo build --release -p ferroprof-preload \
             --target-dir {}) failed ({status}); its errors are above",
            target_dir.display()
        );
    }
    let mut built = target_dir;
    if target != env("HOST") {
        built.push(&target);
    }
    built.push("release");
    built.push(LIB);
    let bytes = std::fs::read(&built)
        .unwrap_or_else(|e| panic!("the preload library {}: {e}", built.display()));
    write(&embedded, &bytes);
    println!(
        "cargo:rustc-env=FERROPROF_PRELOAD_SHA256={}",
        hex(&sha256(&bytes))
    );
}

fn env(k: &str) -> String {
    std::env::var(k).unwrap_or_else(|_| panic!("cargo sets {k} for build scripts"))
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::write(path, bytes).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

/// `preload-embed` in the outer target directory (the ancestor of `OUT_DIR` holding cargo's
/// `.rustc_info.json` or `CACHEDIR.TAG`): one nested build for every outer profile and build
/// script hash (`cargo clippy`, `cargo test`, `cargo install --target-dir target` share it),
/// kept across builds so it stays incremental. Else (an unknown layout) under `OUT_DIR`.
fn nested_target_dir(out_dir: &Path) -> PathBuf {
    out_dir
        .ancestors()
        .skip(1)
        .find(|d| d.join(".rustc_info.json").is_file() || d.join("CACHEDIR.TAG").is_file())
        .map(|d| d.join("preload-embed"))
        .unwrap_or_else(|| out_dir.join("preload-embed"))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// SHA-256 (FIPS 180-4), here rather than a dependency: a build-time digest of one file, which
/// names the library's cache directory (the content itself is compared byte for byte at run
/// time).
fn sha256(data: &[u8]) -> [u8; 32] {
    const K: [u32; 64] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
        0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
        0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
        0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
        0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
        0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
        0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
        0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2,
    ];
    let mut h: [u32; 8] = [
        0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab,
        0x5be0cd19,
    ];
    let mut msg = data.to_vec();
    msg.push(0x80);
    while msg.len() % 64 != 56 {
        msg.push(0);
    }
    msg.extend_from_slice(&((data.len() as u64) * 8).to_be_bytes());
    for block in msg.chunks_exact(64) {
        let mut w = [0u32; 64];
        for (i, c) in block.chunks_exact(4).enumerate() {
            w[i] = u32::from_be_bytes([c[0], c[1], c[2], c[3]]);
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16]
                .wrapping_add(s0)
                .wrapping_add(w[i - 7])
                .wrapping_add(s1);
        }
        let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut hh] = h;
        for i in 0..64 {
            let s1 = e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25);
            let ch = (e & f) ^ (!e & g);
            let t1 = hh
                .wrapping_add(s1)
                .wrapping_add(ch)
                .wrapping_add(K[i])
                .wrapping_add(w[i]);
            let s0 = a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22);
            let maj = (a & b) ^ (a & c) ^ (b & c);
            let t2 = s0.wrapping_add(maj);
            hh = g;
            g = f;
            f = e;
            e = d.wrapping_add(t1);
            d = c;
            c = b;
            b = a;
            a = t1.wrapping_add(t2);
        }
        for (x, y) in h.iter_mut().zip([a, b, c, d, e, f, g, hh]) {
            *x = x.wrapping_add(y);
        }
    }
    let mut out = [0u8; 32];
    for (o, x) in out.chunks_exact_mut(4).zip(h) {
        o.copy_from_slice(&x.to_be_bytes());
    }
    out
}
