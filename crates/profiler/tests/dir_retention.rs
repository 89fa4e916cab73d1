//! The output directory keeps a bounded number of profiles.

use ferroprof::{Profiler, Profiles};
use std::sync::Mutex;

/// One profiler runs per process, and `start()` reports a running one before it validates the
/// settings: the tests here take turns.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

#[test]
fn the_output_directory_keeps_the_newest_profiles_only() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let dir = std::env::temp_dir().join(format!("ferroprof-retention-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // Someone else's file in the same directory stays.
    std::fs::write(dir.join("notes.txt"), b"keep me").unwrap();
    let guard = Profiler::builder()
        .service("retention")
        .profiles(Profiles {
            cpu: true,
            ..Profiles::none()
        })
        .output_dir(&dir)
        .keep_profiles(3, 0)
        .start()
        .unwrap();
    for _ in 0..6 {
        std::thread::sleep(std::time::Duration::from_millis(5));
        guard.flush().unwrap();
    }
    guard.stop().unwrap();
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    let _ = std::fs::remove_dir_all(&dir);
    let profiles: Vec<&String> = names.iter().filter(|n| n.ends_with(".pprof")).collect();
    assert_eq!(profiles.len(), 3, "{names:?}");
    assert!(names.iter().any(|n| n == "notes.txt"), "{names:?}");
}

#[test]
fn a_bad_retention_variable_names_itself() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    for (var, bad) in [
        ("FERROPROF_KEEP_FILES", "many"),
        ("FERROPROF_KEEP_MB", "-5"),
    ] {
        let err = Profiler::builder()
            .from_vars(move |k| (k == var).then(|| bad.into()))
            .start()
            .err()
            .unwrap_or_else(|| panic!("{var}={bad} accepted"));
        let msg = err.to_string();
        assert!(msg.contains(var) && msg.contains(bad), "{msg}");
    }
}
