//! Profiles of recorded processes, gzipped by `record` once the program ended.
//!
//! Under `record` the preload library writes profiles uncompressed: for the small profile of a
//! short process (a compiler run in a build), setting up a gzip stream costs more than
//! encoding the profile, and that is CPU spent after the profile's last booking, in every
//! process. `record` compresses the files afterwards, on its own clock, so what a user finds
//! is gzip as every exporter writes.

use std::io::Write;
use std::path::Path;

/// gzip's and zstd's magic numbers: files already compressed are left as they are.
const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xb5, 0x2f, 0xfd];

/// Compresses `path` in place (written aside, then renamed over it, so a reader sees the old
/// file or the new one). Returns whether it compressed; a file already compressed is left.
pub fn gzip_in_place(path: &Path) -> std::io::Result<bool> {
    let raw = std::fs::read(path)?;
    // Kept: `record` tells a process's last profile (its last image's) by the time it was
    // written.
    let written = std::fs::metadata(path)?.modified()?;
    if raw.starts_with(&GZIP_MAGIC) || raw.starts_with(&ZSTD_MAGIC) {
        return Ok(false);
    }
    let mut enc = flate2::write::GzEncoder::new(
        Vec::with_capacity(raw.len() / 3),
        flate2::Compression::default(),
    );
    enc.write_all(&raw)?;
    let gz = enc.finish()?;
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = path.with_file_name(format!(".{name}.gz.tmp"));
    let mut f = std::fs::File::create(&tmp)?;
    let kept = f
        .write_all(&gz)
        .and_then(|()| f.set_modified(written))
        .and_then(|()| std::fs::rename(&tmp, path));
    kept.inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_profile_is_gzipped_once_and_reads_the_same() {
        let dir = std::env::temp_dir().join(format!("ferroprof-gzip-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.1.1.pprof");
        let profile = ferroprof_pprof::ProfileBuilder::new(&[("cpu-time", "nanoseconds")])
            .sample(&["leaf", "main"], &[5], &[])
            .build();
        let plain = prost::Message::encode_to_vec(&profile);
        std::fs::write(&path, &plain).unwrap();
        let at = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1 << 30);
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(at)
            .unwrap();
        assert!(gzip_in_place(&path).unwrap());
        let bytes = std::fs::read(&path).unwrap();
        assert!(bytes.starts_with(&GZIP_MAGIC));
        let kept = std::fs::metadata(&path).unwrap().modified().unwrap();
        assert_eq!(kept, at, "the time it was written is kept");
        let back = ferroprof_pprof::decode(&bytes).unwrap();
        assert_eq!(back.total("cpu-time"), Some(5));
        assert!(!gzip_in_place(&path).unwrap(), "already gzip: left");
        assert_eq!(std::fs::read(&path).unwrap(), bytes);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
