//! `ferroprof demo` end to end: it runs the workload under the real profiler, writes a profile,
//! prints a table per profile type and a verdict; the known CPU split, the bytes allocated and
//! the live set are found.

use std::process::Command;

#[test]
fn demo_finds_the_known_cpu_split_and_live_set() {
    let out_dir = std::env::temp_dir().join(format!("ferroprof-demo-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out_dir);
    let o = Command::new(env!("CARGO_BIN_EXE_ferroprof"))
        .args(["demo", "--seconds", "3", "--out"])
        .arg(&out_dir)
        .output()
        .expect("run ferroprof demo");
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "demo failed:\n{stderr}\n{stdout}");

    // Progress on stderr (one line a second when not on a terminal), ending at 100 %.
    assert!(stderr.contains("cpu/wall samples"), "{stderr}");
    assert!(stderr.contains("[########################]"), "{stderr}");

    let files: Vec<_> = std::fs::read_dir(&out_dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .collect();
    assert_eq!(files.len(), 1, "one profile for the run: {files:?}");
    let written = files[0].path();
    assert!(
        stdout.contains(&format!("wrote {}", written.display())),
        "{stdout}"
    );
    let p =
        ferroprof_pprof::decode(&std::fs::read(&written).unwrap()).expect("the demo wrote pprof");
    for t in [
        "cpu-time",
        "wall-time",
        "alloc-samples",
        "alloc-space",
        "heap-live-size",
    ] {
        assert!(p.value_index(t).is_some(), "profile lacks {t}");
        assert!(
            stdout.contains(&format!(": {t} (")),
            "no {t} table:\n{stdout}"
        );
    }

    let verdict: Vec<&str> = stdout
        .lines()
        .skip_while(|l| !l.starts_with("verdict"))
        .collect();
    let line = |prefix: &str| {
        verdict
            .iter()
            .find(|l| l.contains(prefix))
            .unwrap_or_else(|| panic!("no verdict line for {prefix}:\n{stdout}"))
            .to_string()
    };
    for key in [
        "burn_hot / burn_cold",
        "heap-live-size: keep_live_set",
        "wall-time: wait_idle",
        // Estimated bytes allocated against the bytes the workload counted.
        "alloc-space: churn allocated",
    ] {
        let l = line(key);
        assert!(
            l.contains("[ ok ]"),
            "{l}\n\nfull output:\n{stdout}\n{stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&out_dir);
}
