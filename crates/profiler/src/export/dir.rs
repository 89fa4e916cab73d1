//! The default exporter: one `.pprof` file per profile in a directory.
//!
//! Files are named `<service>-<UTC end time>.pprof` (e.g. `api-20250102T030405.678Z.pprof`) and
//! written atomically: the bytes go to a hidden temporary file in the same directory, which is
//! then renamed, so a reader never sees a partial profile.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use super::{ExportError, ExportedProfile, Exporter};

/// Writes each profile to `<dir>/<service>-<timestamp>.pprof`.
#[derive(Debug, Clone)]
pub struct DirExporter {
    dir: PathBuf,
}

impl DirExporter {
    /// Creates the directory if needed and checks that files can be written in it.
    pub fn new(dir: impl Into<PathBuf>) -> Result<Self, ExportError> {
        let dir = dir.into();
        check_writable(&dir).map_err(|source| ExportError::Io {
            path: dir.display().to_string(),
            source,
        })?;
        Ok(DirExporter { dir })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file name a profile of `service` ending at `end` gets.
    pub fn file_name(service: &str, end: SystemTime) -> String {
        format!("{}-{}.pprof", sanitize(service), utc_timestamp(end))
    }
}

/// Creates `dir` and probes it with a temporary file.
///
/// The probe's name is unique to this call (process, thread, call counter) and it is created
/// with `create_new`: two callers probing the same directory at once (two `start()` racing)
/// never remove each other's probe.
pub(crate) fn check_writable(dir: &Path) -> std::io::Result<()> {
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
        })
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

    #[test]
    fn rejects_an_unwritable_directory() {
        let err = DirExporter::new("/proc/self/definitely-not-here").unwrap_err();
        assert!(err.to_string().contains("definitely-not-here"), "{err}");
    }
}
