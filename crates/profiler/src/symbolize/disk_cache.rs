//! Inflated DWARF sections kept on disk, by build id, for the next process to map.
//!
//! A distribution's separate debug files are zlib-compressed, and a zlib stream can only be
//! inflated from its start: naming a few addresses of libc inflates its `.debug_info` up to the
//! furthest unit they fall in (13–19 ms at every exit of a short `record`ed program). A pass
//! that inflates a large section writes what it inflated, a prefix of the section, to
//! `DIR/<build id>.<section>`; a later pass whose units lie within that prefix maps the file
//! instead of inflating. A pass that needs more inflates again and writes the longer prefix.
//!
//! The same directory keeps each object's unit digests (`digest`), in `DIR/<build id>.units`.
//!
//! Files are written under a temporary name and renamed, so a reader sees a whole file or none
//! (a mapping of a replaced file keeps the old one); digests are also appended to their file,
//! which readers that mapped it earlier see as it was. The directory must be the user's own and
//! not writable by others: what is read from it is trusted as the debug file's bytes (a garbled
//! unit reads as missing, as any malformed DWARF does). Its size is kept under
//! `MAX_DIR_BYTES` by removing the oldest files after each write.

use std::fs::{self, File};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use memmap2::Mmap;

/// Marks a cache file of an inflated prefix: magic, then the compressed section's length and
/// its inflated size (both little-endian u64), then the prefix.
pub(crate) const PREFIX: &[u8; 8] = b"FPDWARF1";
/// Marks a file of unit digests (see `digest`): magic, then the sizes of the `.debug_info` and
/// `.debug_line` they were made from (little-endian u64), then the digests.
pub(crate) const DIGESTS: &[u8; 8] = b"FPUNITS1";
/// Bytes before the prefix.
pub(crate) const HEADER: usize = 24;
/// Smallest prefix worth a file: below it inflating costs well under a millisecond.
pub(crate) const MIN_PREFIX: usize = 256 << 10;
/// In the names of files being written.
const TMP_MARK: &str = ".tmp";
/// The directory's budget; the oldest files go past it. libc's three sparse sections take
/// about 10 MB whole.
const MAX_DIR_BYTES: u64 = 256 << 20;

/// Where one section of one debug file is cached.
#[derive(Clone, Copy)]
pub(crate) struct Key<'a> {
    /// What the file holds: `PREFIX` or `DIGESTS`.
    pub magic: &'static [u8; 8],
    pub dir: &'a Path,
    /// Hex build id of the file holding the section.
    pub build_id: &'a str,
    /// The section's name (`.debug_info`), or `.units` for digests.
    pub section: &'a str,
    /// The compressed section's length and its inflated size (for digests: the sizes of the
    /// sections they were made from): a file for other bytes is not used.
    pub compressed_len: u64,
    pub size: u64,
}

impl Key<'_> {
    fn path(&self) -> PathBuf {
        self.dir.join(format!("{}{}", self.build_id, self.section))
    }

    fn header(&self) -> [u8; HEADER] {
        let mut h = [0u8; HEADER];
        h[..8].copy_from_slice(self.magic);
        h[8..16].copy_from_slice(&self.compressed_len.to_le_bytes());
        h[16..].copy_from_slice(&self.size.to_le_bytes());
        h
    }
}

/// The cached prefix of `key`'s section, mapped (its bytes start at `HEADER`), or `None` when
/// there is none, or the file is for other bytes or in a directory that is not safe to read.
pub(crate) fn open(key: Key<'_>) -> Option<Mmap> {
    let map = open_whole(key)?;
    ((map.len() - HEADER) as u64 <= key.size).then_some(map)
}

/// `key`'s file, mapped, when its header is `key`'s (its bytes start at `HEADER`).
pub(crate) fn open_whole(key: Key<'_>) -> Option<Mmap> {
    if !safe_dir(key.dir) {
        return None;
    }
    let file = File::open(key.path()).ok()?;
    // SAFETY: cache files are only ever replaced by rename or appended to, never rewritten or
    // truncated in place, so the mapped bytes do not change under the reader; the mapping is
    // private and read-only.
    let map = unsafe { Mmap::map(&file) }.ok()?;
    (map.get(..HEADER)? == key.header()).then_some(map)
}

/// Appends `bytes` to `key`'s file, which must exist (else nothing is written). Readers that
/// mapped the file earlier see it as it was: bytes are only added.
pub(crate) fn append(key: Key<'_>, bytes: &[u8]) {
    if !safe_dir(key.dir) {
        return;
    }
    let path = key.path();
    // One write: appends of two writers to a local file do not interleave.
    let appended = fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(bytes));
    if appended.is_ok() {
        trim(key.dir, &path);
    }
}

/// Writes `bytes` as `key`'s file (after its header), in place of any earlier one.
pub(crate) fn store(key: Key<'_>, bytes: &[u8]) {
    if let Some(mut w) = Writer::create(key) {
        w.min_len = 0;
        w.write(bytes);
        w.finish();
    }
}

/// A prefix being written: created before a section is inflated, fed every inflated piece in
/// order, put in place by [`Writer::finish`]. Dropped unfinished, it leaves nothing behind.
pub(crate) struct Writer {
    file: Option<File>,
    tmp: PathBuf,
    path: PathBuf,
    written: usize,
    /// Fewer bytes are not worth a file.
    min_len: usize,
}

impl Writer {
    /// `None` when the directory cannot be made or is not safe, or the file cannot be created.
    pub(crate) fn create(key: Key<'_>) -> Option<Writer> {
        if !key.dir.is_dir() {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(key.dir)
                .ok()?;
        }
        if !safe_dir(key.dir) {
            return None;
        }
        let path = key.path();
        // Unique to this writer: two threads (or processes) caching one section each write
        // their own file, and the last rename wins with a whole one.
        static WRITERS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = WRITERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut tmp = path.clone().into_os_string();
        tmp.push(format!("{TMP_MARK}{}.{n}", std::process::id()));
        let tmp = PathBuf::from(tmp);
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)
            .ok()?;
        let mut w = Writer {
            file: None,
            tmp,
            path,
            written: 0,
            min_len: MIN_PREFIX,
        };
        file.write_all(&key.header()).ok()?;
        w.file = Some(file);
        Some(w)
    }

    /// Appends the next inflated bytes; a failed write drops the file.
    pub(crate) fn write(&mut self, piece: &[u8]) {
        if let Some(f) = &mut self.file {
            if f.write_all(piece).is_ok() {
                self.written += piece.len();
            } else {
                self.file = None;
            }
        }
    }

    /// Puts the prefix in place if it is long enough to be worth it, then trims the directory.
    pub(crate) fn finish(mut self) {
        let Some(file) = self.file.take() else {
            return;
        };
        drop(file);
        if self.written >= self.min_len && fs::rename(&self.tmp, &self.path).is_ok() {
            if let Some(dir) = self.path.parent() {
                trim(dir, &self.path);
            }
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        // Not renamed (unfinished, failed or too short): nothing to keep.
        let _ = fs::remove_file(&self.tmp);
    }
}

/// Whether `dir` is a directory of this user that no one else may write to.
fn safe_dir(dir: &Path) -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    fs::metadata(dir).is_ok_and(|m| m.is_dir() && m.uid() == me && m.mode() & 0o022 == 0)
}

/// Removes the oldest files of `dir` (by modification time, `keep` excepted) until its files
/// take at most `MAX_DIR_BYTES`, and the temporary files of writers that died over an hour ago.
fn trim(dir: &Path, keep: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let mut files: Vec<(i64, u64, PathBuf)> = entries
        .filter_map(|e| {
            let e = e.ok()?;
            let m = e.metadata().ok()?;
            let stale =
                e.file_name().to_string_lossy().contains(TMP_MARK) && now - m.mtime() > 3600;
            if stale && fs::remove_file(e.path()).is_ok() {
                return None;
            }
            m.is_file().then(|| (m.mtime(), m.len(), e.path()))
        })
        .collect();
    let mut total: u64 = files.iter().map(|f| f.1).sum();
    files.sort();
    for (_, len, path) in files {
        if total <= MAX_DIR_BYTES {
            break;
        }
        if path != keep && fs::remove_file(&path).is_ok() {
            total -= len;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An empty directory of this test's own, removed when dropped.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(name: &str) -> Scratch {
            let p = std::env::temp_dir().join(format!(
                "ferroprof-disk-cache-{}-{name}",
                std::process::id()
            ));
            let _ = fs::remove_dir_all(&p);
            fs::DirBuilder::new().mode(0o700).create(&p).unwrap();
            Scratch(p)
        }

        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn key<'a>(dir: &'a Path, section: &'a str) -> Key<'a> {
        Key {
            magic: PREFIX,
            dir,
            build_id: "00ab",
            section,
            compressed_len: 10,
            size: (MIN_PREFIX * 2) as u64,
        }
    }

    #[test]
    fn a_written_prefix_is_mapped_back_and_only_for_the_same_bytes() {
        let tmp = Scratch::new("mapped");
        let dir = tmp.path().join("cache");
        let k = key(&dir, ".debug_info");
        assert!(open(k).is_none());
        let mut w = Writer::create(k).expect("a writer");
        let piece: Vec<u8> = (0..MIN_PREFIX).map(|i| (i % 251) as u8).collect();
        w.write(&piece);
        w.write(b"tail");
        w.finish();
        let m = open(k).expect("the prefix");
        assert_eq!(&m[HEADER..HEADER + MIN_PREFIX], &piece[..]);
        assert_eq!(&m[HEADER + MIN_PREFIX..], b"tail");
        // The directory is private to the user, and no temporary file is left.
        let mode = fs::metadata(&dir).unwrap().mode();
        assert_eq!(mode & 0o077, 0, "mode {mode:o}");
        assert_eq!(fs::read_dir(&dir).unwrap().count(), 1);
        // Another compressed length or size (another debug file with the same id): not used.
        assert!(open(Key {
            compressed_len: 11,
            ..k
        })
        .is_none());
        assert!(open(Key { size: 5, ..k }).is_none());
        assert!(open(key(&dir, ".debug_line")).is_none());
    }

    #[test]
    fn a_short_or_failed_prefix_leaves_nothing() {
        let tmp = Scratch::new("short");
        let k = key(tmp.path(), ".debug_line");
        let mut w = Writer::create(k).unwrap();
        w.write(&[1u8; 100]);
        w.finish();
        assert!(open(k).is_none());
        let w = Writer::create(k).unwrap();
        drop(w);
        assert_eq!(fs::read_dir(tmp.path()).unwrap().count(), 0);
    }

    #[test]
    fn a_directory_others_may_write_to_is_not_used() {
        let tmp = Scratch::new("unsafe");
        let k = key(tmp.path(), ".debug_info");
        let mut w = Writer::create(k).unwrap();
        w.write(&vec![7u8; MIN_PREFIX]);
        w.finish();
        assert!(open(k).is_some());
        fs::set_permissions(
            tmp.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o777),
        )
        .unwrap();
        assert!(open(k).is_none());
        assert!(Writer::create(k).is_none());
    }

    #[test]
    fn the_directory_is_trimmed_oldest_first() {
        let tmp = Scratch::new("trim");
        let old = tmp.path().join("old");
        let big = File::create(&old).unwrap();
        big.set_len(MAX_DIR_BYTES).unwrap();
        let t = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        big.set_modified(t).unwrap();
        drop(big);
        let stale = tmp.path().join("00ab.debug_line.tmp1.0");
        let fresh = tmp.path().join("00ab.debug_line.tmp2.0");
        for (p, age) in [(&stale, 7200), (&fresh, 10)] {
            let f = File::create(p).unwrap();
            f.set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(age))
                .unwrap();
        }
        let k = key(tmp.path(), ".debug_info");
        let mut w = Writer::create(k).unwrap();
        w.write(&vec![7u8; MIN_PREFIX]);
        w.finish();
        assert!(!old.exists(), "the oldest file goes past the budget");
        assert!(!stale.exists(), "a dead writer's file goes");
        assert!(fresh.exists(), "a live writer's file stays");
        assert!(open(k).is_some());
    }
}
