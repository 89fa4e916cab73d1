//! Fuzz harness `cli_top`: random bytes as a profile file through the code path of
//! `ferroprof top` / `flamegraph` / `diff` (the CLI's own `report` module, compiled in from
//! `crates/cli/src/report.rs`). Garbage must end in an error with a message, never a panic;
//! whatever decodes must render.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

#[allow(dead_code)]
#[path = "../../crates/cli/src/report.rs"]
mod report;

/// One scratch file per thread (`report::load` reads a path, like the CLI): the corpus replay
/// runs the harness from several test threads of one process at once.
fn scratch() -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static ID: usize = NEXT.fetch_add(1, Ordering::Relaxed);
    }
    let id = ID.with(|id| *id);
    std::env::temp_dir().join(format!(
        "ferroprof-fuzz-cli-top-{}-{id}.pprof",
        std::process::id()
    ))
}

fn message(e: &anyhow::Error) {
    let msg = format!("{e:#}");
    assert!(!msg.trim().is_empty(), "error without a message: {e:?}");
}

/// Runs one fuzz input; returns whether it was accepted as a profile.
pub fn run(data: &[u8]) -> bool {
    let path = &scratch();
    std::fs::write(path, data).expect("scratch file");
    let p = match report::load(path) {
        Ok(p) => p,
        Err(e) => {
            message(&e);
            return false;
        }
    };
    // Each sample type by name, the default choice, and a name the file does not have.
    let mut wanted: Vec<Option<String>> = p.sample_types().into_iter().map(|t| Some(t.0)).collect();
    wanted.push(None);
    wanted.push(Some("no-such-type".to_owned()));
    for w in wanted {
        let idx = match report::pick_type(&p, w.as_deref(), path) {
            Ok(i) => i,
            Err(e) => {
                message(&e);
                continue;
            }
        };
        let label = path.display().to_string();
        for table in [
            report::FunctionTable::build(&p, idx),
            report::FunctionTable::build_sites(&p, idx),
        ] {
            for by_cum in [false, true] {
                let text = report::top_text(&table, 20, by_cum, &label);
                assert!(!text.is_empty());
            }
            let _ = report::diff_text(&table, &report::FunctionTable::default(), 20);
            let _ = report::diff_text(&table, &table, 20);
        }
        let _ = report::folded(&p, idx);
    }
    true
}
