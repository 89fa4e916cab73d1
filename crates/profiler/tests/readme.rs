//! The README stays true: each of its Rust code blocks is an excerpt of an example under
//! `examples/` (which `cargo test` and `cargo clippy --all-targets` build), its `Cargo.toml` line
//! names this crate's version, and its configuration tables (the README's and the full one in
//! `docs/configuration.md`) name every variable ferroprof reads.

use std::path::{Path, PathBuf};

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The repository's README (or, in the published crate, its copy next to `Cargo.toml`).
fn readme() -> String {
    let in_repo = manifest_dir().join("../../README.md");
    let path = if in_repo.exists() {
        in_repo
    } else {
        manifest_dir().join("README.md")
    };
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The fenced blocks of `text` whose info string is `lang`.
fn blocks(text: &str, lang: &str) -> Vec<String> {
    let mut out = Vec::new();
    // Inside a block: `Some(wanted)`, with the wanted block's text so far.
    let mut inside: Option<Option<String>> = None;
    for line in text.lines() {
        let fence = line.trim_start().strip_prefix("```");
        match (inside.take(), fence) {
            (None, Some(info)) => inside = Some((info.trim() == lang).then(String::new)),
            (None, None) => {}
            (Some(block), Some(_)) => out.extend(block),
            (Some(mut block), None) => {
                if let Some(b) = &mut block {
                    b.push_str(line);
                    b.push('\n');
                }
                inside = Some(block);
            }
        }
    }
    assert!(inside.is_none(), "a code block of the README is not closed");
    out
}

fn rust_files(dir: &Path) -> Vec<(PathBuf, String)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            let text = std::fs::read_to_string(&path).unwrap();
            out.push((path, text));
        }
    }
    out
}

#[test]
fn every_rust_block_of_the_readme_is_in_an_example() {
    let examples = rust_files(&manifest_dir().join("examples"));
    let rust = blocks(&readme(), "rust");
    assert!(
        rust.len() >= 4,
        "expected the README's Rust blocks, found {}",
        rust.len()
    );
    for block in rust {
        assert!(
            examples.iter().any(|(_, text)| text.contains(&block)),
            "this README block is in no file of crates/profiler/examples (copy it from one, or \
             change the example too):\n{block}"
        );
    }
}

#[test]
fn the_dependency_line_names_this_version() {
    let version = env!("CARGO_PKG_VERSION");
    let (major, rest) = version.split_once('.').unwrap();
    let minor = rest.split('.').next().unwrap();
    let line = if major == "0" {
        format!("ferroprof = \"0.{minor}\"")
    } else {
        format!("ferroprof = \"{major}\"")
    };
    let toml = blocks(&readme(), "toml").concat();
    assert!(
        toml.contains(&line),
        "the README's Cargo.toml block lacks {line:?}:\n{toml}"
    );
}

#[test]
fn the_configuration_table_names_every_variable() {
    // The full table is in docs/configuration.md (in the repository; the published crate has
    // the README only).
    let mut readme = readme();
    if let Ok(full) = std::fs::read_to_string(manifest_dir().join("../../docs/configuration.md")) {
        readme.push_str(&full);
    }
    let mut missing = Vec::new();
    for (path, text) in rust_files(&manifest_dir().join("src")) {
        for (i, _) in text.match_indices('"') {
            let rest = &text[i + 1..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                .collect();
            let known = name.starts_with("FERROPROF_") || name.starts_with("DD_");
            // A test hook of the symbolizer, described in docs/architecture.md.
            if !known || name == "FERROPROF_SYMBOLIZE_CHECK" || !rest[name.len()..].starts_with('"')
            {
                continue;
            }
            if !readme.contains(&format!("`{name}`")) {
                missing.push(format!("{name} ({})", path.display()));
            }
        }
    }
    missing.sort();
    missing.dedup();
    assert!(
        missing.is_empty(),
        "variables neither the README nor docs/configuration.md names: {missing:?}"
    );
}
