//! Writes the hand-made part of the `cli_top` seed corpus: real profiles (raw and gzip, from the
//! test builder and from ferroprof's own encoder), profiles at the edges of what the CLI must
//! survive (extreme values, no samples, no sample types) and broken files.
//!
//! `cargo run --manifest-path fuzz/Cargo.toml --example make_seeds` (from the repository root).

use std::path::Path;
use std::time::SystemTime;

use ferroprof_pprof::ProfileBuilder;
use ferroprof_recorder::pprof::EncodeOptions;
use ferroprof_recorder::{Compression, Frame, Label, Profile, Sample, SampleType};

fn raw(gzip: &[u8]) -> Vec<u8> {
    ferroprof_pprof::decompress(gzip).expect("gzip from the builder")
}

fn main() -> std::io::Result<()> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus/cli_top");
    std::fs::create_dir_all(&dir)?;
    let write = |name: &str, bytes: &[u8]| std::fs::write(dir.join(name), bytes);

    let cpu = ProfileBuilder::new(&[("cpu-time", "nanoseconds"), ("cpu-samples", "count")])
        .sample(
            &["hot", "work", "main"],
            &[3_000_000, 3],
            &[("thread name", "main")],
        )
        .sample(
            &["alloc::vec::Vec<T>::push", "work", "main"],
            &[1_000, 1],
            &[],
        )
        .sample(&["rec", "rec", "main"], &[-5, 0], &[]);
    let gz = cpu.gzip();
    write("cpu.pprof.gz", &gz)?;
    write("cpu.pprof", &raw(&gz))?;

    let heap = ProfileBuilder::new(&[("heap-live-size", "bytes"), ("alloc-samples", "count")])
        .sample(
            &["__rust_alloc", "alloc::raw_vec::finish_grow", "app::load"],
            &[64 << 20, 1],
            &[],
        )
        .sample(&[], &[1, 1], &[]);
    write("heap.pprof", &raw(&heap.gzip()))?;

    // Values at the edges of i64: sums and differences must not overflow into a panic.
    let extreme = ProfileBuilder::new(&[("cpu-time", "nanoseconds"), ("x", "bytes")])
        .sample(&["a", "b"], &[i64::MAX, i64::MIN], &[])
        .sample(&["a", "c"], &[i64::MAX, i64::MIN], &[])
        .sample(&["c", "a"], &[i64::MIN, i64::MAX], &[])
        .sample(&["d"], &[-1, i64::MIN], &[]);
    write("extreme.pprof", &raw(&extreme.gzip()))?;

    let empty = ProfileBuilder::new(&[("wall-time", "nanoseconds")]);
    write("no-samples.pprof", &raw(&empty.gzip()))?;
    write(
        "no-types.pprof",
        &raw(&ProfileBuilder::new(&[]).sample(&["f"], &[], &[]).gzip()),
    )?;

    // ferroprof's own encoder: address frames, numeric labels, timestamps.
    let types = [
        SampleType::CpuTime,
        SampleType::CpuSamples,
        SampleType::WallTime,
    ];
    let mut p = Profile::new(&types, None, SystemTime::UNIX_EPOCH);
    let frames = [
        Frame::sym("f", "f.rs", 3),
        Frame::Address(0x1000),
        Frame::sym("main", "m.rs", 1),
    ];
    let labels = [Label::num("thread id", 7), Label::str("thread name", "w")];
    for ts in [0, 1_700_000_000_000_000_000] {
        let sample = Sample {
            frames: &frames,
            values: &[10, 1, 20],
            labels: &labels,
            end_timestamp_ns: ts,
        };
        p.add(&sample).expect("valid sample");
    }
    let opts = EncodeOptions {
        compression: Compression::None,
    };
    write(
        "ferroprof.pprof",
        &p.encode(SystemTime::UNIX_EPOCH, &opts, None)
            .expect("encode")
            .bytes,
    )?;

    write("empty", b"")?;
    write("text", b"definitely not a profile\n")?;
    write("gzip-truncated", &gz[..gz.len() / 2])?;
    write("zstd-magic", &[0x28, 0xb5, 0x2f, 0xfd, 0, 0, 0])?;
    // A sample naming location 9 that does not exist, and a bad string index.
    write("bad-location", &[0x12, 0x02, 0x08, 0x09, 0x32, 0x00])?;
    write(
        "bad-string-index",
        &[0x0a, 0x04, 0x08, 0x05, 0x10, 0x06, 0x32, 0x00],
    )?;
    Ok(())
}
