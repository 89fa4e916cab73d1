//! One file per profile, named after the process that wrote it.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use ferroprof::export::{ExportError, ExportedProfile, Exporter};

/// Profiles this process wrote (a forked child carries on the count; its pid tells it apart).
static WRITTEN: AtomicU32 = AtomicU32::new(0);

/// Writes each profile to `<dir>/<command>.<pid>.<n>.pprof` (`n` from 1, the first unused),
/// atomically (a temporary file linked), so `ferroprof record` never reads half a profile. The
/// pid and command are read at each write: a forked child writes under its own pid.
pub(crate) struct PerProcessFiles {
    dir: PathBuf,
    /// Where `ferroprof record` reads each process's end figures (see [`SUMMARY_ENV`]).
    summary_dir: Option<PathBuf>,
}

/// Names a directory where each profile written also leaves `<pid>.summary`: figures for
/// `ferroprof record`'s end report that are not in the profile (the estimated peak of the live
/// heap, `heap_peak_estimate_bytes=N`). Set by `record`.
pub(crate) const SUMMARY_ENV: &str = "FERROPROF_RECORD_SUMMARY";

impl PerProcessFiles {
    pub(crate) fn new(dir: PathBuf) -> Result<Self, String> {
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("cannot create the output directory {}: {e}", dir.display()))?;
        let summary_dir = std::env::var_os(SUMMARY_ENV)
            .filter(|d| !d.is_empty())
            .map(PathBuf::from);
        Ok(PerProcessFiles { dir, summary_dir })
    }

    /// The figures as of this profile (the last profile's are the run's): written next to
    /// each profile, on the export thread, so every way the last profile is written (exit, a
    /// signal, an exec) leaves them. Renamed into place: `record` never reads half a file.
    fn write_summary(&self, pid: u32) {
        let Some(dir) = &self.summary_dir else { return };
        let text = format!(
            "heap_peak_estimate_bytes={}\n",
            ferroprof::internals::__heap_peak_estimate_bytes()
        );
        let tmp = dir.join(format!(".{pid}.tmp"));
        if std::fs::write(&tmp, text).is_ok() {
            let _ = std::fs::rename(&tmp, dir.join(format!("{pid}.summary")));
        }
    }
}

/// The process's command name (the kernel's `comm`), safe in a file name.
pub(crate) fn command_name() -> String {
    let comm = std::fs::read_to_string("/proc/self/comm").unwrap_or_default();
    ferroprof::export::dir::command_file_name(&comm)
}

impl Exporter for PerProcessFiles {
    fn name(&self) -> &str {
        "record-files"
    }

    fn export(&mut self, profile: &ExportedProfile) -> Result<(), ExportError> {
        let (command, pid) = (command_name(), std::process::id());
        let tmp = self.dir.join(format!(".{command}.{pid}.tmp"));
        let io = |p: &PathBuf| {
            let p = p.display().to_string();
            move |source| ExportError::Io { path: p, source }
        };
        let mut f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
        f.write_all(&profile.encoded.bytes).map_err(io(&tmp))?;
        drop(f);
        // Linked, not renamed, so a name in use is never replaced: an image exec'd by this
        // process has the same pid, maybe the same command, and counts from 1 again.
        let result = loop {
            let n = WRITTEN.fetch_add(1, Ordering::Relaxed) + 1;
            let path = self.dir.join(format!("{command}.{pid}.{n}.pprof"));
            match std::fs::hard_link(&tmp, &path) {
                Ok(()) => break Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                // A file system without hard links: renamed, as close as it gets.
                Err(_) => break std::fs::rename(&tmp, &path).map_err(io(&path)),
            }
        };
        let _ = std::fs::remove_file(&tmp);
        self.write_summary(pid);
        result
    }
}
