//! `ferroprof record -p PID`: profiles a running process from outside (see
//! `ferroprof-attach`), writes its profiles as `record` names them and shows the same summary.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferroprof_attach::{AttachConfig, AttachError};

use crate::record::{self, RecordArgs};
use crate::report::CliError;

/// Attaches to `pid` with `args`' rate, period, duration and output; returns the exit status.
pub fn run(pid: i32, args: &RecordArgs) -> anyhow::Result<u8> {
    for (given, name) in [
        (args.alloc_interval.is_some(), "--alloc-interval"),
        (args.cpu_engine.is_some(), "--cpu-engine"),
    ] {
        if given {
            return Err(CliError(format!(
                "{name} does not apply to -p (a running process gets perf-event CPU samples)"
            ))
            .into());
        }
    }
    let duration = match args.duration {
        Some(d) if !(d.is_finite() && d > 0.0) => {
            return Err(CliError(format!("--duration {d}: more than 0 seconds")).into())
        }
        d => d.map(Duration::from_secs_f64),
    };
    let period = match args.period {
        Some(p) if !(p.is_finite() && p >= 1.0) => {
            return Err(CliError(format!("--period {p}: at least 1 second")).into())
        }
        p => p.map(Duration::from_secs_f64),
    };
    // Refused before the output directory is made.
    ferroprof_attach::check(pid).map_err(|e| CliError(refusal(e)))?;
    let (dir, file) = record::output_paths(&args.output)?;
    std::fs::create_dir_all(&dir)
        .map_err(|e| CliError(format!("cannot create {}: {e}", dir.display())))?;
    let dir = dir
        .canonicalize()
        .map_err(|e| CliError(format!("{}: {e}", dir.display())))?;
    let before = record::snapshot(&dir);

    // Ctrl-C and termination end the run (the target is left alone): blocked before any thread
    // starts, taken by one thread.
    let stop = Arc::new(AtomicBool::new(false));
    let mask = record::forwarded_set();
    // SAFETY: a valid, initialized signal set; no old mask wanted.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &mask, std::ptr::null_mut()) };
    {
        let stop = stop.clone();
        let _ = std::thread::Builder::new()
            .name("stop-on-signal".into())
            .spawn(move || {
                // SAFETY: a zeroed siginfo filled by sigwaitinfo; the set is initialized.
                let sig = unsafe {
                    let mut info: libc::siginfo_t = std::mem::zeroed();
                    libc::sigwaitinfo(&mask, &mut info)
                };
                if sig > 0 {
                    stop.store(true, Ordering::SeqCst);
                }
            });
    }

    // The network exporters the environment asks for, as a linked-in profiler's.
    let mut exporters = ferroprof::export::queue::network_exporters_from_env()
        .map_err(|e| CliError(format!("cannot attach: {e}")))?;
    let comm = ferroprof_attach::command_name(pid);
    let service = std::env::var("FERROPROF_SERVICE")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| comm.clone());
    let process_start =
        ferroprof_attach::process_start(pid).unwrap_or_else(std::time::SystemTime::now);
    let config = AttachConfig::new(pid)
        .hz(args.hz.unwrap_or(100))
        .duration(duration)
        .period(period)
        .stop_flag(stop);
    let started = Instant::now();
    let mut n = 0u32;
    let mut write_error = None;
    let announce = || {
        eprintln!(
            "ferroprof record: attached to pid {pid} ({comm}){}; profiles go to {}",
            match duration {
                Some(d) => format!(" for {:.1}s", d.as_secs_f64()),
                None => " until Ctrl-C or its end".to_owned(),
            },
            dir.display()
        );
    };
    let outcome = ferroprof_attach::attach(&config, announce, |p| {
        n += 1;
        let path = dir.join(format!("{comm}.{pid}.{n}.pprof"));
        if let Err(e) = std::fs::write(&path, &p.profile.encoded.bytes) {
            write_error.get_or_insert(format!("cannot write {}: {e}", path.display()));
        }
        let exported = ferroprof::export::ExportedProfile {
            encoded: p.profile.encoded,
            stats: p.profile.stats,
            service: service.clone(),
            tags: vec![("pid".to_owned(), pid.to_string())],
            sample_types: p.sample_types,
            process_start,
        };
        for e in exporters.iter_mut() {
            // Network exporters queue and return at once.
            if let Err(err) = e.export(&exported) {
                eprintln!("ferroprof record: {} exporter: {err}", e.name());
            }
        }
    });
    // What they still hold: up to 5 s to deliver.
    for e in exporters.iter_mut() {
        e.shutdown(Duration::from_secs(5));
    }
    let summary = match outcome {
        Ok(s) => s,
        Err(e) => return Err(CliError(refusal(e)).into()),
    };
    if let Some(e) = write_error {
        return Err(CliError(e).into());
    }
    eprintln!(
        "ferroprof record: {} after {:.1}s: {} samples of {} thread(s){}{}{}{}",
        if summary.process_ended {
            "the process ended"
        } else {
            "detached"
        },
        started.elapsed().as_secs_f64(),
        summary.samples,
        summary.threads,
        if summary.kernel_time {
            ""
        } else {
            "; samples in user space only (kernel.perf_event_paranoid): time in the kernel \
             goes to the stack that entered it"
        },
        if summary.lost > 0 {
            format!("; {} samples lost (ring buffers full)", summary.lost)
        } else {
            String::new()
        },
        if summary.threads_without_ring + summary.threads_refused > 0 {
            format!(
                "; {} thread(s) without CPU samples ({} past the locked-memory limit for perf \
                 buffers: kernel.perf_event_mlock_kb and ulimit -l; root has none)",
                summary.threads_without_ring + summary.threads_refused,
                summary.threads_without_ring
            )
        } else {
            String::new()
        },
        if summary.wall_of_waiting {
            ""
        } else {
            "; waiting threads' stacks unreadable (no right to trace the process: Yama's \
             ptrace_scope, or another user's), so the wall profile has running threads only"
        }
    );
    let written = record::new_profiles(&dir, &before);
    let profiles: ferroprof::Profiles = "cpu,wall"
        .parse()
        .map_err(|e| CliError(format!("profiles: {e}")))?;
    if let Err(e) = record::report(&written, pid, file.as_deref(), profiles, args.n, |_| None) {
        eprintln!("ferroprof record: {e:#}");
    }
    println!(
        "\nno allocation or heap profile: attaching injects nothing into the process \
         (start it under `ferroprof record -- CMD` for those)"
    );
    Ok(0)
}

/// One line per refusal, as the user can act on it.
fn refusal(e: AttachError) -> String {
    format!("cannot attach: {e}")
}
