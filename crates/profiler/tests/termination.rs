//! Opt-in flush on SIGTERM/SIGINT: the last profile is written, then the process ends as it
//! would have (by the signal, or through the application's own handler).

mod child_support;
mod profiler_support;

use std::time::Duration;

use child_support::{is_child, run_child};
use ferroprof::{Profiler, Profiles};
use profiler_support::thread_cpu;

fn child_dir() -> std::path::PathBuf {
    std::path::PathBuf::from(std::env::var("FERROPROF_TERM_DIR").expect("the parent sets it"))
}

/// `ms` of the thread's own CPU: the last profile must hold samples.
#[inline(never)]
fn burn(ms: u64) -> u64 {
    let end = thread_cpu() + Duration::from_millis(ms);
    let mut x = 0u64;
    while thread_cpu() < end {
        for _ in 0..100_000 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
    }
    x
}

/// The child: profiles for a while (the period is an hour: nothing is written unless the
/// signal makes it), then sends itself `sig` and waits to be ended.
fn child_body(sig: libc::c_int) {
    let guard = Profiler::builder()
        .service("term")
        .profiles(Profiles {
            cpu: true,
            ..Profiles::none()
        })
        .period(Duration::from_secs(3600))
        .output_dir(child_dir())
        .flush_on_termination(true)
        .start()
        .unwrap();
    burn(400);
    // SAFETY: signalling our own process.
    unsafe { libc::kill(libc::getpid(), sig) };
    std::thread::sleep(Duration::from_secs(20));
    println!("still-alive=1");
    drop(guard);
}

fn profiles_in(dir: &std::path::Path) -> Vec<ferroprof_pprof::Profile> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter(|e| e.file_name().to_string_lossy().ends_with(".pprof"))
                .map(|e| {
                    let bytes = std::fs::read(e.path()).unwrap();
                    ferroprof_pprof::decode(&bytes).expect("the profile decodes")
                })
                .collect()
        })
        .unwrap_or_default()
}

fn run(test: &str, tag: &str) -> (child_support::ChildOutcome, Vec<ferroprof_pprof::Profile>) {
    let dir = std::env::temp_dir().join(format!("ferroprof-term-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let out = run_child(
        test,
        &[("FERROPROF_TERM_DIR", dir.to_str().unwrap())],
        Duration::from_secs(30),
    );
    let profiles = profiles_in(&dir);
    let _ = std::fs::remove_dir_all(&dir);
    (out, profiles)
}

#[test]
fn sigterm_writes_the_last_profile_then_ends_the_process() {
    const NAME: &str = "sigterm_writes_the_last_profile_then_ends_the_process";
    if is_child(NAME) {
        return child_body(libc::SIGTERM);
    }
    use std::os::unix::process::ExitStatusExt;
    let (out, profiles) = run(NAME, "default");
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGTERM),
        "{}",
        out.describe()
    );
    assert_eq!(profiles.len(), 1, "{}", out.describe());
    let samples: i64 = profiles[0].sample.iter().map(|s| s.value[0]).sum();
    assert!(samples > 0, "the last profile has no samples");
}

static APP_HANDLER_RAN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn app_handler(_sig: libc::c_int) {
    APP_HANDLER_RAN.store(true, std::sync::atomic::Ordering::SeqCst);
    let msg = b"app-handler=1\n";
    // SAFETY: write and _exit are async-signal-safe.
    unsafe {
        libc::write(1, msg.as_ptr() as *const libc::c_void, msg.len());
        libc::_exit(7);
    }
}

#[test]
fn the_applications_own_handler_still_runs_after_the_flush() {
    const NAME: &str = "the_applications_own_handler_still_runs_after_the_flush";
    if is_child(NAME) {
        // SAFETY: installs a handler that writes and exits (async-signal-safe calls only).
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = app_handler as *const () as usize;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(libc::SIGINT, &sa, std::ptr::null_mut());
        }
        return child_body(libc::SIGINT);
    }
    let (out, profiles) = run(NAME, "app");
    assert_eq!(out.status.code(), Some(7), "{}", out.describe());
    assert_eq!(out.value("app-handler"), Some(1), "{}", out.describe());
    assert_eq!(profiles.len(), 1, "{}", out.describe());
}
