//! The profiler crate's layers: a module imports only from its own layer or the layers below.
//!
//! The layer of every module of `crates/profiler/src` is written down once, here (and drawn in
//! `docs/architecture.md`). The check reads each source file's `crate::` paths (comments left
//! out) and fails on an import from a lower layer into a higher one, and on a module missing
//! from the table. Upward communication goes through hooks or traits defined low (for example
//! `forkgate::set_restart_hook`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Bottom up. A module is a file's path under `src/` without `.rs` (`mod.rs` names its folder).
const LAYERS: &[(&str, &[&str])] = &[
    (
        "1 runtime primitives (async-signal-safe, know nothing of profiles)",
        &[
            "tls",
            "perf_abi",
            "threads",
            "sharded",
            "forklock",
            "forkgate",
            "ownthread",
        ],
    ),
    ("2 plain policies", &["frame_names"]),
    (
        "3 private memory and loaded objects",
        &[
            "alloc/arena",
            "alloc/keep",
            "alloc/bigblock",
            "alloc/filter",
            "alloc/tracked",
            "alloc/peak",
            "alloc/totals",
            "modules",
        ],
    ),
    (
        "4 libraries usable without a running profiler",
        &[
            "unwind",
            "unwind/rules",
            "unwind/frames",
            "unwind/snapshot",
            "unwind/spare",
            "unwind/x86_64",
            "unwind/aarch64",
            "symbolize",
            "symbolize/debug_info",
            "symbolize/inflate",
            "symbolize/names",
            "symbolize/digest",
            "symbolize/disk_cache",
            "symbolize/dwarf_walk",
            "symbolize/foreign",
            "http",
            "error",
        ],
    ),
    (
        "5 the running profiler's state and settings",
        &["settings", "notice", "handoff", "state"],
    ),
    (
        "6 capture",
        &[
            "labels",
            "alloc",
            "sampler",
            "sampler/capture",
            "sampler/child_trigger",
            "sampler/clock",
            "sampler/engine",
            "sampler/perf",
            "sampler/thread",
            "sampler/record",
            "sampler/tasks",
            "sampler/remote",
        ],
    ),
    (
        "7 the public face",
        &[
            "profiler",
            "profiler/guard",
            "profiler/run",
            "profiler/source",
            "fork",
            "termination",
            "tracing",
            "internals",
            "lib",
        ],
    ),
];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("read src") {
        let p = e.expect("entry").path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// `alloc/mod.rs` -> `alloc`, `alloc/arena.rs` -> `alloc/arena`.
fn module_of(file: &Path) -> String {
    let rel = file.strip_prefix(src()).expect("under src");
    let s = rel.with_extension("").to_string_lossy().replace('\\', "/");
    s.strip_suffix("/mod").map(str::to_owned).unwrap_or(s)
}

/// The modules a source text imports through `crate::` and `super::` paths, longest known
/// module first (`crate::alloc::arena::x` is `alloc/arena`, `crate::alloc::x` is `alloc`).
fn imports(
    module: &str,
    is_folder: bool,
    text: &str,
    known: &BTreeMap<String, usize>,
) -> Vec<String> {
    let mut out = Vec::new();
    for line in text.lines() {
        let code = line.trim_start();
        if code.starts_with("//") {
            continue;
        }
        // `super::` in `a/b.rs` is `a`; in `a/mod.rs` (a folder's module) it is the crate.
        let parent: Vec<&str> = if is_folder {
            Vec::new()
        } else {
            let mut p: Vec<&str> = module.split('/').collect();
            p.pop();
            p
        };
        for (prefix, base) in [("crate::", Vec::new()), ("super::", parent)] {
            let mut rest = code;
            while let Some(i) = rest.find(prefix) {
                let after = &rest[i + prefix.len()..];
                let path: String = after
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                    .collect();
                let mut parts: Vec<&str> = base.clone();
                parts.extend(path.split("::").filter(|p| !p.is_empty()));
                for n in (1..=parts.len().min(2)).rev() {
                    let m = parts[..n].join("/");
                    if known.contains_key(&m) {
                        out.push(m);
                        break;
                    }
                }
                rest = after;
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

fn layer_table() -> BTreeMap<String, usize> {
    let mut t = BTreeMap::new();
    for (i, (_, mods)) in LAYERS.iter().enumerate() {
        for m in *mods {
            assert!(t.insert((*m).to_owned(), i).is_none(), "{m} listed twice");
        }
    }
    t
}

/// Imports from a lower layer into a higher one, as `importer -> imported (layers)`.
fn upward_imports(
    files: &[(String, bool, String)],
    table: &BTreeMap<String, usize>,
) -> Vec<String> {
    let mut bad = Vec::new();
    for (module, is_folder, text) in files {
        let Some(&mine) = table.get(module) else {
            continue;
        };
        for dep in imports(module, *is_folder, text, table) {
            let theirs = table[&dep];
            if theirs > mine {
                bad.push(format!(
                    "{module} (layer {}) imports {dep} (layer {})",
                    mine + 1,
                    theirs + 1
                ));
            }
        }
    }
    bad
}

/// Each source file's module, whether it is a folder's `mod.rs`, and its text.
fn sources() -> Vec<(String, bool, String)> {
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    files
        .into_iter()
        .map(|f| {
            let mut text = std::fs::read_to_string(&f).expect("read source");
            // Unit tests (a nested `mod tests`, whose `super::` is the file itself) are not the
            // module's imports.
            if let Some(i) = text.find("#[cfg(test)]\nmod ") {
                text.truncate(i);
            }
            let is_folder = f.file_name().is_some_and(|n| n == "mod.rs");
            (module_of(&f), is_folder, text)
        })
        .collect()
}

#[test]
fn every_module_imports_only_from_its_layer_or_below() {
    let table = layer_table();
    let files = sources();
    let missing: Vec<&String> = files
        .iter()
        .map(|(m, _, _)| m)
        .filter(|m| !table.contains_key(*m))
        .collect();
    assert!(
        missing.is_empty(),
        "modules without a layer in tests/layers.rs: {missing:?}"
    );
    let bad = upward_imports(&files, &table);
    assert!(bad.is_empty(), "upward imports:\n{}", bad.join("\n"));
}

/// The check sees an upward import when one is added (here, into a copy of a bottom module's
/// text), and does not see imports in comments.
#[test]
fn an_added_upward_import_is_caught() {
    let table = layer_table();
    let mut files = sources();
    let i = files
        .iter()
        .position(|(m, _, _)| m == "tls")
        .expect("tls.rs");
    files[i]
        .2
        .push_str("\n// crate::profiler in a comment is no import\n");
    assert!(upward_imports(&files, &table).is_empty());
    files[i]
        .2
        .push_str("\nfn f() { let _ = crate::state::active_arc(); }\n");
    let bad = upward_imports(&files, &table);
    assert_eq!(
        bad,
        vec!["tls (layer 1) imports state (layer 5)".to_owned()]
    );
    // A sibling reached through `super::` counts as well.
    let k = files
        .iter()
        .position(|(m, _, _)| m == "alloc/keep")
        .expect("alloc/keep.rs");
    files[k]
        .2
        .push_str("\nfn g() { super::sample_weight(1, 1); }\n");
    let bad = upward_imports(&files, &table);
    assert_eq!(
        bad,
        vec![
            "alloc/keep (layer 3) imports alloc (layer 6)".to_owned(),
            "tls (layer 1) imports state (layer 5)".to_owned()
        ]
    );
}
