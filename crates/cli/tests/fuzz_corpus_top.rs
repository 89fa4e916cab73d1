//! Replays the committed `cli_top` fuzz corpus (fuzz/corpus/cli_top: real profiles, extreme
//! values, broken files) and deterministic pseudo-random bytes through the fuzz harness, which
//! drives this crate's own `report` module the way `ferroprof top/diff/flamegraph` do.

#[path = "../../../fuzz/src/cli_top.rs"]
mod cli_top;

#[test]
fn cli_top_corpus() {
    let dir =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/cli_top");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("corpus dir")
        .map(|e| e.expect("corpus entry").path())
        .collect();
    files.sort();
    let accepted = files
        .iter()
        .filter(|path| {
            eprintln!("{}", path.display());
            cli_top::run(&std::fs::read(path).expect("corpus file"))
        })
        .count();
    assert!(
        accepted > 0 && accepted < files.len(),
        "corpus has both profiles and garbage"
    );
}

#[test]
fn cli_top_pseudo_random() {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..300 {
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let len = (next() % 300) as usize;
        let bytes: Vec<u8> = (0..len).map(|_| next() as u8).collect();
        assert!(!cli_top::run(&bytes), "random bytes accepted as a profile");
    }
}
