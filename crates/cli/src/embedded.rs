//! The preload library the `ferroprof` binary carries (built by build.rs), written to the
//! user's cache directory when `record` finds no library on disk: `cargo install` installs the
//! binary alone.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::record::PRELOAD_NAME;
use crate::report::CliError;

/// The library's bytes; empty when ferroprof-cli was built outside the ferroprof workspace
/// (see build.rs).
static LIBRARY: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/libferroprof_preload.so"));
/// Its SHA-256 in hex, computed by build.rs: names the cache directory, so that two ferroprof
/// builds never share (or fight over) one file.
const SHA256: &str = env!("FERROPROF_PRELOAD_SHA256");

/// Whether this binary carries the library.
pub fn available() -> bool {
    !LIBRARY.is_empty()
}

/// The carried library as a file: `<cache>/ferroprof/preload-<sha256 prefix>/` +
/// [`PRELOAD_NAME`], with `<cache>` `$XDG_CACHE_HOME`, else `~/.cache`, else
/// `/tmp/ferroprof-<uid>` for the `ferroprof` directory. Written when missing or different
/// from the carried bytes (compared in full before every use: a truncated or edited file is
/// replaced, never preloaded).
pub fn install() -> anyhow::Result<PathBuf> {
    let dir = cache_root()?.join(format!("preload-{}", &SHA256[..SHA256.len().min(16)]));
    private_dir(&dir)?;
    let lib = dir.join(PRELOAD_NAME);
    // The size first: a file of another size is not read at all.
    let same_size = std::fs::metadata(&lib).is_ok_and(|m| m.len() == LIBRARY.len() as u64);
    if same_size && std::fs::read(&lib).is_ok_and(|b| b == LIBRARY) {
        return Ok(lib);
    }
    // A temporary file renamed over the library: a program starting meanwhile (another
    // `record`) maps either the old file or the complete new one, never a partial write.
    let tmp = dir.join(format!(".{PRELOAD_NAME}.{}.tmp", std::process::id()));
    let written = (|| {
        let _ = std::fs::remove_file(&tmp);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o700)
            .open(&tmp)?;
        f.write_all(LIBRARY)?;
        f.sync_all()?;
        std::fs::rename(&tmp, &lib)
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(CliError(format!(
            "cannot write the preload library to {}: {e} (or name one with \
             FERROPROF_PRELOAD=/path/to/{PRELOAD_NAME})",
            lib.display()
        ))
        .into());
    }
    Ok(lib)
}

/// `$XDG_CACHE_HOME/ferroprof` (absolute paths only, as the XDG spec says), else
/// `$HOME/.cache/ferroprof`, else `/tmp/ferroprof-<uid>`; created private (0700) and checked.
fn cache_root() -> anyhow::Result<PathBuf> {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    let xdg = env("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute());
    let home = env("HOME")
        .map(|h| PathBuf::from(h).join(".cache"))
        .filter(|p| p.is_absolute());
    let root = match xdg.or(home) {
        Some(base) => {
            std::fs::create_dir_all(&base)
                .map_err(|e| CliError(format!("cannot create {}: {e}", base.display())))?;
            base.join("ferroprof")
        }
        // SAFETY: geteuid has no preconditions and cannot fail.
        None => PathBuf::from(format!("/tmp/ferroprof-{}", unsafe { libc::geteuid() })),
    };
    private_dir(&root)?;
    Ok(root)
}

/// Creates `dir` (mode 0700) when missing; refuses one that is a symbolic link, not a
/// directory, not the user's, or writable by everyone: whoever can write there chooses the code
/// every recorded program runs. (Group-writable passes: a umask of 002 with a group of one's
/// own is common.)
fn private_dir(dir: &Path) -> anyhow::Result<()> {
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(CliError(format!("cannot create {}: {e}", dir.display())).into()),
    }
    let m =
        std::fs::symlink_metadata(dir).map_err(|e| CliError(format!("{}: {e}", dir.display())))?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    let refuse = if !m.is_dir() {
        Some("is not a directory".to_owned())
    } else if m.uid() != uid {
        Some(format!(
            "belongs to uid {}, not to you (uid {uid})",
            m.uid()
        ))
    } else if m.permissions().mode() & 0o002 != 0 {
        Some(format!(
            "is writable by everyone (mode {:o})",
            m.permissions().mode() & 0o7777
        ))
    } else {
        None
    };
    match refuse {
        Some(why) => Err(CliError(format!(
            "refusing the preload library's cache directory {}: it {why}; fix it, or name the \
             library with FERROPROF_PRELOAD=/path/to/{PRELOAD_NAME}",
            dir.display()
        ))
        .into()),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("ferroprof-embedded-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn the_cache_directory_is_created_private_and_reused() {
        let d = scratch("ok").join("ferroprof");
        private_dir(&d).unwrap();
        let mode = std::fs::metadata(&d).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        private_dir(&d).unwrap();
        let _ = std::fs::remove_dir_all(d.parent().unwrap());
    }

    #[test]
    fn unsafe_cache_directories_are_refused_with_their_path() {
        let base = scratch("refused");
        let open = base.join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        let link = base.join("link");
        std::os::unix::fs::symlink(&open, &link).unwrap();
        let file = base.join("file");
        std::fs::write(&file, b"").unwrap();
        for (dir, why) in [
            (&open, "writable by everyone"),
            (&link, "not a directory"),
            (&file, "not a directory"),
        ] {
            let e = private_dir(dir).unwrap_err().to_string();
            assert!(
                e.contains(why) && e.contains(&dir.display().to_string()),
                "{e}"
            );
        }
        // Another user's directory (only root can make one here).
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } == 0 {
            let theirs = base.join("theirs");
            std::fs::create_dir(&theirs).unwrap();
            std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
            let e = private_dir(&theirs).unwrap_err().to_string();
            assert!(e.contains("belongs to uid 65534"), "{e}");
        }
        let _ = std::fs::remove_dir_all(&base);
    }
}
