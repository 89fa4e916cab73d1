//! The builder: validation with typed errors, environment configuration, the directory exporter,
//! flushing, and what stopping does.

mod profiler_support;

use std::sync::Mutex;
use std::time::Duration;

use ferroprof::{Profiler, ProfilerError, Profiles};
use profiler_support::*;

static LOCK: Mutex<()> = Mutex::new(());

fn cpu_only() -> Profiles {
    Profiles {
        cpu: true,
        wall: false,
        alloc: false,
        heap: false,
    }
}

#[test]
fn bad_settings_are_typed_errors_naming_the_value() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let c = || Box::new(Collect::default());
    let err = Profiler::builder()
        .cpu_hz(0)
        .exporter(c())
        .start()
        .err()
        .unwrap();
    assert!(
        matches!(err, ProfilerError::InvalidCpuHz { value: 0, .. }),
        "{err}"
    );
    let err = Profiler::builder()
        .cpu_hz(5000)
        .exporter(c())
        .start()
        .err()
        .unwrap();
    assert!(err.to_string().contains("5000"), "{err}");
    let err = Profiler::builder()
        .period(Duration::from_millis(1))
        .exporter(c())
        .start()
        .err()
        .unwrap();
    assert!(matches!(err, ProfilerError::InvalidPeriod { .. }), "{err}");
    let err = Profiler::builder()
        .service("  ")
        .exporter(c())
        .start()
        .err()
        .unwrap();
    assert!(matches!(err, ProfilerError::EmptyService), "{err}");
    let err = Profiler::builder()
        .tag("", "x")
        .exporter(c())
        .start()
        .err()
        .unwrap();
    assert!(matches!(err, ProfilerError::InvalidTag { .. }), "{err}");
    let err = Profiler::builder()
        .signal(libc::SIGSEGV)
        .exporter(c())
        .start()
        .err()
        .unwrap();
    assert!(matches!(err, ProfilerError::InvalidSignal { value } if value == libc::SIGSEGV));
    let err = Profiler::builder()
        .output_dir("/proc/self/no-such-dir")
        .start()
        .err()
        .unwrap();
    assert!(matches!(err, ProfilerError::OutputDir { .. }), "{err}");
    assert!(err.to_string().contains("/proc/self/no-such-dir"), "{err}");
    let err = Profiler::builder()
        .profiles(Profiles {
            cpu: false,
            wall: false,
            alloc: true,
            heap: true,
        })
        .alloc_interval_bytes(0)
        .exporter(c())
        .start()
        .err()
        .unwrap();
    assert!(matches!(err, ProfilerError::NoProfiles { .. }), "{err}");
}

#[test]
fn environment_variables_configure_and_bad_values_are_named() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let vars = |pairs: &'static [(&'static str, &'static str)]| {
        move |k: &str| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
    };
    for (var, value) in [
        ("FERROPROF_CPU_HZ", "-5"),
        ("FERROPROF_CPU_HZ", "fast"),
        ("FERROPROF_PERIOD_SECS", "0"),
        ("FERROPROF_ALLOC_INTERVAL", "-1"),
        ("FERROPROF_PROFILES", "cpu,gpu"),
        ("FERROPROF_TAGS", "a:b,broken"),
    ] {
        let pairs: &'static [(&'static str, &'static str)] =
            Box::leak(vec![(var, value)].into_boxed_slice());
        let err = Profiler::builder()
            .exporter(Box::new(Collect::default()))
            .from_vars(vars(pairs))
            .start()
            .err()
            .unwrap_or_else(|| panic!("{var}={value} accepted"));
        let msg = err.to_string();
        assert!(
            msg.contains(var) || msg.contains(value),
            "{var}={value}: {msg}"
        );
        if var == "FERROPROF_CPU_HZ" && value == "-5" {
            assert!(
                matches!(err, ProfilerError::InvalidCpuHz { value: -5, .. }),
                "{err}"
            );
        }
    }

    let dir = temp_dir("env");
    let dir_s: &'static str = Box::leak(dir.display().to_string().into_boxed_str());
    let pairs: &'static [(&'static str, &'static str)] = Box::leak(
        vec![
            ("FERROPROF_SERVICE", "env-svc"),
            ("FERROPROF_ENV", "staging"),
            ("FERROPROF_VERSION", "1.2.3"),
            ("FERROPROF_TAGS", "team:core, region:eu"),
            ("FERROPROF_PERIOD_SECS", "600"),
            ("FERROPROF_CPU_HZ", "50"),
            ("FERROPROF_PROFILES", "cpu,wall"),
            ("FERROPROF_OUTPUT_DIR", dir_s),
        ]
        .into_boxed_slice(),
    );
    let c = Collect::default();
    let guard = Profiler::builder()
        .exporter(Box::new(c.clone()))
        .from_vars(vars(pairs))
        .start()
        .expect("valid environment");
    guard.stop().unwrap();
    let got = c.0.lock().unwrap();
    assert_eq!(got.len(), 1);
    let p = &got[0];
    assert_eq!(p.service, "env-svc");
    let tags: Vec<(&str, &str)> = p
        .tags
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    assert_eq!(
        tags,
        [
            ("env", "staging"),
            ("version", "1.2.3"),
            ("team", "core"),
            ("region", "eu")
        ]
    );
    assert!(p.sample_types.contains(&"wall-time".to_owned()));
    assert!(!p.sample_types.contains(&"alloc-samples".to_owned()));
    // The directory exporter ran too (output dir given next to an exporter).
    let files = std::fs::read_dir(&dir).unwrap().count();
    assert_eq!(files, 1);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn one_profiler_at_a_time_flush_and_drop_export() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let dir = temp_dir("flush");
    let guard = Profiler::builder()
        .service("flush-svc")
        .profiles(cpu_only())
        .period(Duration::from_secs(600))
        .output_dir(&dir)
        .start()
        .unwrap();
    let second = Profiler::builder()
        .exporter(Box::new(Collect::default()))
        .start();
    assert!(matches!(second, Err(ProfilerError::AlreadyRunning)));
    guard.flush().expect("flush");
    guard.flush().expect("flush again");
    let n = std::fs::read_dir(&dir).unwrap().count();
    assert_eq!(n, 2, "one file per flush");
    // Dropping the guard stops and writes the last profile.
    drop(guard);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert_eq!(files.len(), 3, "{files:?}");
    for f in &files {
        let name = f.file_name().unwrap().to_string_lossy().into_owned();
        assert!(
            name.starts_with("flush-svc-") && name.ends_with(".pprof"),
            "{name}"
        );
        let p = ferroprof_pprof::decode(&std::fs::read(f).unwrap()).expect("decodes");
        assert!(p.value_index("cpu-time").is_some());
        assert!(p.duration_nanos >= 0);
    }
    // A new profiler can start once the previous one stopped.
    let g = Profiler::builder()
        .profiles(cpu_only())
        .exporter(Box::new(Collect::default()))
        .start()
        .expect("restart after stop");
    g.stop().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn periodic_export_runs_every_period() {
    let _l = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    let c = Collect::default();
    let guard = Profiler::builder()
        .profiles(cpu_only())
        .period(Duration::from_millis(300))
        .exporter(Box::new(c.clone()))
        .start()
        .unwrap();
    // Two periodic exports, waited for rather than timed: on a loaded machine the first one
    // (which loads debug info to symbolize) can run late.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while c.0.lock().unwrap().len() < 2 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    guard.stop().unwrap();
    let got = c.0.lock().unwrap();
    // Two periodic exports plus the final one.
    assert!(got.len() >= 3, "{} profiles", got.len());
    for p in &got[..2] {
        // A periodic profile is cut when its period is over, not before.
        let d = p.end().duration_since(p.start()).unwrap_or_default();
        assert!(d >= Duration::from_millis(250), "periodic profile of {d:?}");
    }
    for w in got.windows(2) {
        assert!(
            w[0].end() <= w[1].start() + Duration::from_millis(5),
            "profiles tile in time"
        );
    }
}
