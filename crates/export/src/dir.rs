//! The default exporter: one `.pprof` file per profile in a directory.
//!
//! Files are named `<service>-<UTC end time>.pprof` (e.g. `api-20250102T030405.678Z.pprof`) and
//! written atomically: the bytes go to a hidden temporary file in the same directory, which is
//! then renamed, so a reader never sees a partial profile.
//!
//! Retention: after each write, the service's oldest profiles in the directory are deleted
//! beyond a number of files and a total size (by default a day of profiles at the default
//! period, and 1 GiB). Only files named as this exporter names this service's profiles are
//! ever deleted.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use super::{ExportError, ExportedProfile, Exporter};

/// Profiles kept by default: a day at the default 60 s period.
pub const DEFAULT_KEEP_FILES: usize = 1440;
/// Bytes of profiles kept by default.
pub const DEFAULT_KEEP_BYTES: u64 = 1 << 30;

/// Writes each profile to `<dir>/<service>-<timestamp>.pprof`.
#[derive(Debug, Clone)]
pub struct DirExporter {
    dir: PathBuf,
    keep_files: usize,
    keep_bytes: u64,
}

impl DirExporter {
    /// Creates the directory if needed and checks that files can be written in it. Keeps the
    /// default number of profiles ([`DEFAULT_KEEP_FILES`], [`DEFAULT_KEEP_BYTES`]).
    pub fn new(dir: impl Into<PathBuf>) -> Result<Self, ExportError> {
        let dir = dir.into();
        check_writable(&dir).map_err(|source| ExportError::Io {
            path: dir.display().to_string(),
            source,
        })?;
        Ok(DirExporter {
            dir,
            keep_files: DEFAULT_KEEP_FILES,
            keep_bytes: DEFAULT_KEEP_BYTES,
        })
    }

    /// Keeps at most `files` of the service's profiles and `bytes` of them in all (0: no
    /// limit of that kind), deleting the oldest after each write.
    pub fn keep(mut self, files: usize, bytes: u64) -> Self {
        self.keep_files = files;
        self.keep_bytes = bytes;
        self
    }

    /// Deletes the service's oldest profiles beyond the limits. Names sort by time (UTC
    /// timestamps; a `-N` suffix for profiles ending in the same millisecond).
    fn prune(&self, service: &str) {
        if self.keep_files == 0 && self.keep_bytes == 0 {
            return;
        }
        let prefix = format!("{}-", sanitize(service));
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let mut ours: Vec<(String, u64)> = entries
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let rest = name.strip_prefix(&prefix)?.strip_suffix(".pprof")?;
                is_timestamp_name(rest).then_some(())?;
                let len = e.metadata().ok().filter(|m| m.is_file())?.len();
                Some((name, len))
            })
            .collect();
        ours.sort_unstable_by_key(|a| timestamp_key(&a.0));
        let mut total: u64 = ours.iter().map(|o| o.1).sum();
        let mut count = ours.len();
        for (name, len) in ours {
            let over_files = self.keep_files != 0 && count > self.keep_files;
            let over_bytes = self.keep_bytes != 0 && total > self.keep_bytes && count > 1;
            if !over_files && !over_bytes {
                break;
            }
            if std::fs::remove_file(self.dir.join(&name)).is_ok() {
                count -= 1;
                total = total.saturating_sub(len);
            }
        }
    }

    /// The directory profiles are written to.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file name a profile of `service` ending at `end` gets.
    pub fn file_name(service: &str, end: SystemTime) -> String {
        format!("{}-{}.pprof", sanitize(service), utc_timestamp(end))
    }
}

/// For the profiler, not API: creates `dir` and probes it with a temporary file.
///
/// The probe's name is unique to this call (process, thread, call counter) and it is created
/// with `create_new`: two callers probing the same directory at once (two `start()` racing)
/// never remove each other's probe.
#[doc(hidden)]
pub fn check_writable(dir: &Path) -> std::io::Result<()> {
    static PROBES: AtomicU64 = AtomicU64::new(0);
    std::fs::create_dir_all(dir)?;
    let probe = dir.join(format!(
        ".ferroprof-probe-{}-{}-{}",
        std::process::id(),
        // SAFETY: gettid has no preconditions.
        unsafe { libc::gettid() },
        PROBES.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)?;
    std::fs::remove_file(&probe)
}

impl Exporter for DirExporter {
    fn name(&self) -> &str {
        "dir"
    }

    fn export(&mut self, profile: &ExportedProfile) -> Result<(), ExportError> {
        let base = Self::file_name(&profile.service, profile.end());
        let mut path = self.dir.join(&base);
        let mut n = 1;
        while path.exists() {
            let stem = base.trim_end_matches(".pprof");
            path = self.dir.join(format!("{stem}-{n}.pprof"));
            n += 1;
        }
        let tmp = self.dir.join(format!(
            ".{}.tmp",
            path.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        ));
        let io_err = |p: &Path| {
            let p = p.display().to_string();
            move |source| ExportError::Io { path: p, source }
        };
        let mut f = std::fs::File::create(&tmp).map_err(io_err(&tmp))?;
        f.write_all(&profile.encoded.bytes)
            .and_then(|_| f.sync_data())
            .map_err(io_err(&tmp))?;
        drop(f);
        std::fs::rename(&tmp, &path).map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io_err(&path)(e)
        })?;
        self.prune(&profile.service);
        Ok(())
    }
}

/// `YYYYMMDDTHHMMSS.mmmZ`, optionally followed by `-N`.
fn is_timestamp_name(rest: &str) -> bool {
    let (ts, n) = match rest.split_once('-') {
        Some((ts, n)) => (ts, Some(n)),
        None => (rest, None),
    };
    let b = ts.as_bytes();
    b.len() == 20
        && b[..8].iter().all(u8::is_ascii_digit)
        && b[8] == b'T'
        && b[9..15].iter().all(u8::is_ascii_digit)
        && b[15] == b'.'
        && b[16..19].iter().all(u8::is_ascii_digit)
        && b[19] == b'Z'
        && n.is_none_or(|n| !n.is_empty() && n.bytes().all(|c| c.is_ascii_digit()))
}

/// Orders a profile's file name by its timestamp, then its `-N` suffix.
fn timestamp_key(name: &str) -> (String, u64) {
    let stem = name.trim_end_matches(".pprof");
    // The timestamp is the 20 characters after the service name (which may hold '-').
    match stem.rsplit_once('-') {
        Some((head, n)) if n.bytes().all(|c| c.is_ascii_digit()) && !n.is_empty() => {
            let ts = &head[head.len().saturating_sub(20)..];
            (ts.to_owned(), n.parse().unwrap_or(0))
        }
        _ => (stem[stem.len().saturating_sub(20)..].to_owned(), 0),
    }
}

/// The command part of the `<command>.<pid>.<n>.pprof` names `ferroprof record` writes (and
/// reads back): a process's `comm` (its trailing newline dropped) with every character but
/// letters, digits, `_`, `-` and `+` made `_` (no `.`: it separates the parts), `program` when
/// empty.
pub fn command_file_name(comm: &str) -> String {
    let name: String = comm
        .trim_end_matches('\n')
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '+') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if name.is_empty() {
        "program".to_owned()
    } else {
        name
    }
}

/// Keeps a service name file-name safe.
fn sanitize(service: &str) -> String {
    let s: String = service
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() || s.starts_with('.') {
        format!("profile{s}")
    } else {
        s
    }
}

/// `YYYYMMDDTHHMMSS.mmmZ` in UTC.
pub(crate) fn utc_timestamp(t: SystemTime) -> String {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs() as i64;
    let millis = d.subsec_millis();
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, day) = civil_from_days(days);
    format!(
        "{y:04}{m:02}{day:02}T{:02}{:02}{:02}.{millis:03}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// Gregorian (year, month, day) of a day count since 1970-01-01.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    // Shift to a calendar starting on 0000-03-01 so leap days end each 4/100/400-year cycle.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // day of era, 0..=146096
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // 0..=399
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // 0..=365, from March 1st
    let mp = (5 * doy + 2) / 153; // 0 = March
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + if month <= 2 { 1 } else { 0 };
    (year, month, day)
}

#[cfg(test)]
mod command_name_tests {
    #[test]
    fn command_names_keep_no_dot_and_name_the_nameless() {
        assert_eq!(super::command_file_name("python3.12\n"), "python3_12");
        assert_eq!(super::command_file_name("g++ x/y"), "g++_x_y");
        assert_eq!(super::command_file_name("\n"), "program");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn formats_utc_timestamps() {
        assert_eq!(utc_timestamp(UNIX_EPOCH), "19700101T000000.000Z");
        // 2000-02-29 12:34:56.789 UTC
        let t = UNIX_EPOCH + Duration::from_millis(951_827_696_789);
        assert_eq!(utc_timestamp(t), "20000229T123456.789Z");
        let t = UNIX_EPOCH + Duration::from_secs(1_735_689_599); // 2024-12-31 23:59:59
        assert_eq!(utc_timestamp(t), "20241231T235959.000Z");
    }

    #[test]
    fn sanitizes_service_names() {
        assert_eq!(sanitize("my svc/../x"), "my_svc_.._x");
        assert_eq!(sanitize(""), "profile");
        assert_eq!(
            DirExporter::file_name("api", UNIX_EPOCH),
            "api-19700101T000000.000Z.pprof"
        );
    }

    fn profile(service: &str, secs: u64) -> ExportedProfile {
        use ferroprof_recorder::{Compression, EncodedProfile, ProfileStats};
        let start = UNIX_EPOCH + Duration::from_secs(secs);
        ExportedProfile {
            encoded: EncodedProfile {
                start,
                end: start + Duration::from_secs(1),
                bytes: vec![7; 100],
                compression: Compression::default(),
                endpoint_counts: Vec::new(),
            },
            stats: ProfileStats::default(),
            service: service.into(),
            tags: Vec::new(),
            sample_types: Vec::new(),
            process_start: start,
        }
    }

    #[test]
    fn keeps_the_newest_profiles_and_leaves_other_files_alone() {
        let dir = std::env::temp_dir().join(format!("ferroprof-keep-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut e = DirExporter::new(&dir).unwrap().keep(3, 0);
        std::fs::write(dir.join("api-notes.txt"), b"mine").unwrap();
        std::fs::write(dir.join("other-19700101T000000.000Z.pprof"), b"x").unwrap();
        for t in 0..6 {
            e.export(&profile("api", 1_000 + t)).unwrap();
        }
        // Two profiles ending in the same millisecond: the second gets "-1".
        e.export(&profile("api", 1_005)).unwrap();
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(
            names,
            [
                "api-19700101T001645.000Z.pprof",
                "api-19700101T001646.000Z-1.pprof",
                "api-19700101T001646.000Z.pprof",
                "api-notes.txt",
                "other-19700101T000000.000Z.pprof",
            ]
        );
        // By size: 100 bytes each, 250 allowed -> the two newest.
        let mut e = e.keep(0, 250);
        e.export(&profile("api", 2_000)).unwrap();
        let count = std::fs::read_dir(&dir)
            .unwrap()
            .filter(|e| {
                let n = e.as_ref().unwrap().file_name();
                let n = n.to_string_lossy();
                n.starts_with("api-") && n.ends_with(".pprof")
            })
            .count();
        assert_eq!(count, 2);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn rejects_an_unwritable_directory() {
        let err = DirExporter::new("/proc/self/definitely-not-here").unwrap_err();
        assert!(err.to_string().contains("definitely-not-here"), "{err}");
    }
}
