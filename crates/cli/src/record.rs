//! `ferroprof record -- CMD [ARGS...]`: runs a program with the preload library
//! (`libferroprof_preload.so`, see crates/preload and docs/record.md) injected through
//! `LD_PRELOAD`, forwards termination signals to it, waits for it, then says where the profiles
//! went and shows a short top table per profile type. Exits with the program's status.

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::{IsTerminal, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use std::os::unix::process::CommandExt;

use crate::report::{self, CliError, FunctionTable};

/// The preload library's file name, looked for next to the `ferroprof` binary.
pub const PRELOAD_NAME: &str = "libferroprof_preload.so";
/// Environment variable naming the preload library explicitly (overrides the search).
pub const PRELOAD_ENV: &str = "FERROPROF_PRELOAD";

/// Signals forwarded to the program (it flushes its last profile on each, then ends as the
/// signal says).
const FORWARDED: [libc::c_int; 4] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGQUIT];

/// Options of `ferroprof record`.
#[derive(clap::Args, Debug)]
pub struct RecordArgs {
    /// CPU and wall sampling rate, per second (1-1000) [default: 100].
    #[arg(long, value_name = "HZ")]
    pub hz: Option<u32>,
    /// Mean bytes between two sampled allocations (bytes, or with a K, M or G suffix)
    /// [default: 512K].
    #[arg(long, value_name = "SIZE", value_parser = report::parse_size)]
    pub alloc_interval: Option<u64>,
    /// What raises the CPU samples: perf (task-clock events, each sample where its CPU
    /// period ends), timer (POSIX CPU timers, samples at the kernel's tick), or auto (perf
    /// where the kernel allows it) [default: $FERROPROF_CPU_ENGINE, else auto].
    #[arg(long, value_name = "auto|perf|timer")]
    pub cpu_engine: Option<String>,
    /// Profiles to collect: a comma-separated list of cpu, wall, alloc, heap (or all).
    #[arg(long, value_name = "LIST", default_value = "all")]
    pub profiles: String,
    /// Where the profiles go: a directory (created if needed), or a FILE ending in .pprof that
    /// receives the program's last profile (other profiles go next to it).
    #[arg(
        short = 'o',
        long = "output",
        value_name = "FILE|DIR",
        default_value = "./profiles"
    )]
    pub output: PathBuf,
    /// Seconds between two profiles of a long run (each process writes one per period, and its
    /// last one at exit) [default: 60].
    #[arg(long, value_name = "SECONDS")]
    pub period: Option<f64>,
    /// Where inflated debug sections (compressed separate debug files, such as libc's) are
    /// kept for the next run to map instead of inflating again, or `off` [default:
    /// $FERROPROF_DEBUG_CACHE, else $XDG_CACHE_HOME/ferroprof/debug, else
    /// ~/.cache/ferroprof/debug].
    #[arg(long, value_name = "DIR|off")]
    pub debug_cache: Option<OsString>,
    /// Functions shown per profile type.
    #[arg(short = 'n', default_value_t = 8)]
    pub n: usize,
    /// Profile the running process PID instead of starting a command: CPU and wall time, from
    /// perf events and /proc (nothing is injected into it, so no allocation or heap profile).
    #[arg(
        short = 'p',
        long = "pid",
        value_name = "PID",
        conflicts_with = "command"
    )]
    pub pid: Option<i32>,
    /// With --pid: seconds to profile [default: until Ctrl-C or the process's end].
    #[arg(long, value_name = "SECONDS", requires = "pid")]
    pub duration: Option<f64>,
    /// The program and its arguments, after `--`.
    #[arg(last = true, value_name = "CMD")]
    pub command: Vec<OsString>,
}

/// Runs the command; returns the exit status `ferroprof` exits with.
pub fn run(args: RecordArgs) -> anyhow::Result<u8> {
    if let Some(pid) = args.pid {
        return crate::attach::run(pid, &args);
    }
    let Some((cmd, cmd_args)) = args.command.split_first() else {
        return Err(CliError(
            "no command to run: ferroprof record [OPTIONS] -- CMD [ARGS...] \
             (or record -p PID for a running process)"
                .to_owned(),
        )
        .into());
    };
    let profiles: ferroprof::Profiles = args
        .profiles
        .parse()
        .map_err(|e| CliError(format!("--profiles {}: {e}", args.profiles)))?;
    if let Some(hz) = args.hz {
        if !(1..=ferroprof::MAX_CPU_HZ).contains(&hz) {
            return Err(CliError(format!(
                "--hz {hz} is out of range (1-{})",
                ferroprof::MAX_CPU_HZ
            ))
            .into());
        }
    }
    if let Some(e) = &args.cpu_engine {
        e.parse::<ferroprof::CpuEngine>()
            .map_err(|reason| CliError(format!("--cpu-engine {e}: {reason}")))?;
    }
    if let Some(p) = args.period {
        if !(p.is_finite() && p >= 1.0) {
            return Err(CliError(format!("--period {p}: at least 1 second")).into());
        }
    }
    let program = resolve_command(cmd)?;
    check_injectable(&program, cmd)?;
    let pymalloc_note = (profiles.alloc || profiles.heap)
        && is_cpython(cmd, &program)
        && !matches!(
            std::env::var_os("PYTHONMALLOC")
                .as_deref()
                .and_then(|v| v.to_str()),
            Some("malloc" | "malloc_debug")
        );
    let preload = find_preload()?;

    let (dir, file) = output_paths(&args.output)?;
    std::fs::create_dir_all(&dir)
        .map_err(|e| CliError(format!("cannot create {}: {e}", dir.display())))?;
    let dir = dir
        .canonicalize()
        .map_err(|e| CliError(format!("{}: {e}", dir.display())))?;
    let before = snapshot(&dir);

    // Blocked before any thread starts (every thread inherits it), so the signal thread alone
    // receives them; the child unblocks them before exec (below).
    let mask = forwarded_set();
    // SAFETY: a valid, initialized signal set; no old mask wanted.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &mask, std::ptr::null_mut()) };

    let mut ld_preload = OsString::from(&preload);
    if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|v| !v.is_empty()) {
        ld_preload.push(" ");
        ld_preload.push(old);
    }
    let mut command = std::process::Command::new(&program);
    command
        .arg0(cmd)
        .args(cmd_args)
        .env("LD_PRELOAD", ld_preload)
        .env("FERROPROF_OUTPUT_DIR", &dir)
        .env("FERROPROF_PROFILES", &args.profiles);
    if let Some(hz) = args.hz {
        command.env("FERROPROF_CPU_HZ", hz.to_string());
    }
    if let Some(b) = args.alloc_interval {
        command.env("FERROPROF_ALLOC_INTERVAL", b.to_string());
    }
    if let Some(e) = &args.cpu_engine {
        command.env("FERROPROF_CPU_ENGINE", e);
    }
    if let Some(p) = args.period {
        command.env("FERROPROF_PERIOD_SECS", p.to_string());
    }
    if let Some(d) = debug_cache(args.debug_cache.as_deref())? {
        command.env("FERROPROF_DEBUG_CACHE", d);
    }
    // Sample counts for the progress line, written by each profiled process (see the preload
    // library's `progress`); only for a terminal.
    let tty = std::io::stderr().is_terminal();
    let progress_dir = dir.join(format!(".ferroprof-progress-{}", std::process::id()));
    if tty && std::fs::create_dir_all(&progress_dir).is_ok() {
        command.env("FERROPROF_RECORD_PROGRESS", &progress_dir);
    }
    // Figures for the end report that the profiles do not hold (the estimated peak of the live
    // heap), written by each profiled process with each profile (see the preload library's
    // exporter).
    let summary_dir = dir.join(format!(".ferroprof-summary-{}", std::process::id()));
    if std::fs::create_dir_all(&summary_dir).is_ok() {
        command.env("FERROPROF_RECORD_SUMMARY", &summary_dir);
    }
    // SAFETY: runs in the forked child before exec, and only calls sigprocmask
    // (async-signal-safe) on a set built before the fork.
    unsafe {
        command.pre_exec(move || {
            // The program starts with the signals deliverable, as without ferroprof.
            libc::sigprocmask(libc::SIG_UNBLOCK, &mask, std::ptr::null_mut());
            Ok(())
        });
    }
    let started = Instant::now();
    let mut child = command
        .spawn()
        .map_err(|e| CliError(format!("cannot run {}: {e}", Path::new(cmd).display())))?;
    let pid = child.id() as i32;
    eprintln!(
        "ferroprof record: profiling {} (pid {pid}); profiles go to {}",
        Path::new(cmd).display(),
        dir.display()
    );

    let exited = Arc::new(AtomicBool::new(false));
    forward_signals(pid, exited.clone());
    let progress = tty.then(|| {
        spawn_progress(
            dir.clone(),
            progress_dir.clone(),
            before.clone(),
            started,
            exited.clone(),
        )
    });

    // Waits without reaping first: the pid stays ours (a zombie) until the signal thread knows
    // the child is gone, so a late forward never reaches a recycled pid.
    wait_no_reap(pid);
    exited.store(true, Ordering::SeqCst);
    let status = child
        .wait()
        .map_err(|e| CliError(format!("waiting for {}: {e}", Path::new(cmd).display())))?;
    if let Some(h) = progress {
        let _ = h.join();
    }
    let _ = std::fs::remove_dir_all(&progress_dir);
    let code = exit_code(status);
    let how = match std::os::unix::process::ExitStatusExt::signal(&status) {
        Some(sig) => format!("was killed by signal {sig}"),
        None => format!("exited with status {}", status.code().unwrap_or(0)),
    };
    eprintln!(
        "ferroprof record: {} {how} after {:.1}s",
        Path::new(cmd).display(),
        started.elapsed().as_secs_f64()
    );

    let written = new_profiles(&dir, &before);
    for path in written.values().flatten() {
        if let Err(e) = crate::gzip_files::gzip_in_place(path) {
            eprintln!(
                "ferroprof record: left {} uncompressed: {e}",
                path.display()
            );
        }
    }
    let heap_peak = |p: i32| summary_field(&summary_dir, p, "heap_peak_estimate_bytes");
    // The program's status stands whatever the report meets (an unreadable profile...).
    if let Err(e) = report(&written, pid, file.as_deref(), profiles, args.n, heap_peak) {
        eprintln!("ferroprof record: {e:#}");
    }
    let _ = std::fs::remove_dir_all(&summary_dir);
    if pymalloc_note {
        println!("\n{PYMALLOC_NOTE}");
    }
    Ok(code)
}

/// CPython serves objects of 512 bytes and less from its own arenas (pymalloc), which it maps
/// with mmap: the preload library, which interposes malloc, never sees them.
/// `PYTHONMALLOC=malloc` sends every object to malloc.
const PYMALLOC_NOTE: &str = "python: objects of 512 bytes and less come from CPython's own \
    arenas (pymalloc), not from malloc, so the allocation and heap profiles miss them. To see \
    them, run with PYTHONMALLOC=malloc (slower):\n  \
    PYTHONMALLOC=malloc ferroprof record -- python3 ...";

/// Whether the command is CPython (`python`, `python3`, `python3.12`...): by the name it was
/// given, or by the file it resolves to (`/usr/bin/python3` links to `python3.12`).
fn is_cpython(cmd: &OsString, program: &Path) -> bool {
    let named = |p: &Path| {
        let Some(name) = p.file_name().and_then(|n| n.to_str()) else {
            return false;
        };
        let Some(version) = name.strip_prefix("python") else {
            return false;
        };
        // A free-threaded (`t`) or debug (`d`) build keeps pymalloc too.
        let version = version.trim_end_matches(['t', 'd']);
        version.is_empty()
            || version
                .split('.')
                .all(|part| !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()))
    };
    named(Path::new(cmd)) || named(program) || program.canonicalize().is_ok_and(|real| named(&real))
}

/// 128 + signal for a program killed by a signal, as shells report it.
fn exit_code(status: std::process::ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => (c & 0xff) as u8,
        (None, Some(sig)) => (128 + sig).clamp(0, 255) as u8,
        _ => 1,
    }
}

pub(crate) fn forwarded_set() -> libc::sigset_t {
    // SAFETY: sigemptyset initializes the zeroed set; sigaddset with valid signal numbers.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in FORWARDED {
            libc::sigaddset(&mut set, s);
        }
        set
    }
}

/// Forwards the signals sent to `ferroprof record` by another process (`kill`) to the child.
/// Signals from the terminal (Ctrl-C) reach the whole foreground process group, the child
/// included, and are not sent twice.
fn forward_signals(pid: i32, exited: Arc<AtomicBool>) {
    let set = forwarded_set();
    let spawned = std::thread::Builder::new()
        .name("forward-signals".into())
        .spawn(move || loop {
            // SAFETY: a zeroed siginfo filled by sigwaitinfo; the set is initialized.
            let (sig, from_process) = unsafe {
                let mut info: libc::siginfo_t = std::mem::zeroed();
                let sig = libc::sigwaitinfo(&set, &mut info);
                (sig, info.si_code <= 0)
            };
            if sig <= 0 {
                continue;
            }
            if from_process && !exited.load(Ordering::SeqCst) {
                // SAFETY: kill with our child's pid, not yet reaped (see `wait_no_reap`).
                unsafe { libc::kill(pid, sig) };
            }
        });
    if let Err(e) = spawned {
        eprintln!("ferroprof record: cannot forward signals ({e}); the program runs on");
    }
}

fn wait_no_reap(pid: i32) {
    loop {
        // SAFETY: a zeroed siginfo for waitid's out-parameter.
        let rc = unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOWAIT,
            )
        };
        if rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return;
        }
    }
}

fn spawn_progress(
    dir: PathBuf,
    progress_dir: PathBuf,
    before: Snapshot,
    started: Instant,
    exited: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut err = std::io::stderr();
        let mut tick = 0u32;
        while !exited.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(100));
            tick += 1;
            if tick % 5 != 0 {
                continue;
            }
            let (procs, cpu, alloc) = sample_counts(&progress_dir);
            let files: usize = new_profiles(&dir, &before).values().map(Vec::len).sum();
            let _ = write!(
                err,
                "\r  {:>6.1}s  {procs} process(es)  cpu/wall samples {cpu:>7}  alloc samples \
                 {alloc:>7}  profiles written {files}",
                started.elapsed().as_secs_f64(),
            );
            let _ = err.flush();
        }
        let _ = write!(err, "\r{:100}\r", "");
    })
}

/// Processes reporting, and their CPU/wall and allocation samples, summed.
fn sample_counts(progress_dir: &Path) -> (usize, u64, u64) {
    let (mut procs, mut cpu, mut alloc) = (0, 0, 0);
    for e in std::fs::read_dir(progress_dir)
        .into_iter()
        .flatten()
        .flatten()
    {
        let Ok(text) = std::fs::read_to_string(e.path()) else {
            continue;
        };
        let mut it = text.split_whitespace().map(str::parse::<u64>);
        if let (Some(Ok(c)), Some(Ok(a))) = (it.next(), it.next()) {
            procs += 1;
            cpu += c;
            alloc += a;
        }
    }
    (procs, cpu, alloc)
}

const NO_PROFILE: &str = "the command wrote no profile: it may have been killed (SIGKILL, a \
     crash), called _exit() from a signal handler, or not loaded the preload library (see the \
     messages above)";

/// Most profile files [`cpu_by_process`] reads: the largest ones, where busy processes are.
const CPU_SCAN_FILES: usize = 200;

/// Each process's last profile, with its command name: that of its last image when it
/// exec'd, written last.
fn last_profiles(
    written: &BTreeMap<(String, i32), Vec<PathBuf>>,
) -> BTreeMap<i32, (&str, &PathBuf)> {
    let mut lasts: BTreeMap<i32, (&str, &PathBuf, Option<std::time::SystemTime>)> = BTreeMap::new();
    for ((comm, p), files) in written {
        let Some(f) = files.last() else { continue };
        let at = std::fs::metadata(f).and_then(|m| m.modified()).ok();
        if lasts.get(p).is_none_or(|&(_, _, seen)| at > seen) {
            lasts.insert(*p, (comm.as_str(), f, at));
        }
    }
    lasts
        .into_iter()
        .map(|(p, (c, f, _))| (p, (c, f)))
        .collect()
}

/// The process whose profiles hold the most CPU time.
struct Busiest {
    pid: i32,
    comm: String,
    /// Its last profile.
    last: PathBuf,
}

/// Writes into `out` the CPU time of the busiest processes and returns the busiest one when
/// that is not the command `pid` (it used more CPU than the command). Reads at most [`CPU_SCAN_FILES`]
/// files, the largest; unreadable ones are skipped (the list above names them all). `moved`:
/// a file of `written` and where it is now (`-o FILE`).
fn cpu_by_process<'a>(
    written: &'a BTreeMap<(String, i32), Vec<PathBuf>>,
    lasts: &BTreeMap<i32, (&str, &PathBuf)>,
    pid: i32,
    moved: Option<(&'a Path, &'a Path)>,
    out: &mut String,
) -> Option<Busiest> {
    use std::fmt::Write as _;
    let mut files: Vec<(u64, i32, &Path)> = written
        .iter()
        .flat_map(|((_, p), fs)| fs.iter().map(move |f| (*p, f.as_path())))
        .map(|(p, f)| match moved {
            Some((from, to)) if from == f => (p, to),
            _ => (p, f),
        })
        .map(|(p, f)| (std::fs::metadata(f).map(|m| m.len()).unwrap_or(0), p, f))
        .collect();
    let scanned_all = files.len() <= CPU_SCAN_FILES;
    files.sort_by_key(|&(size, ..)| std::cmp::Reverse(size));
    files.truncate(CPU_SCAN_FILES);
    let mut by_pid: BTreeMap<i32, i64> = BTreeMap::new();
    for (_, p, f) in files {
        let Ok(prof) = report::load(f) else { continue };
        let Some(i) = prof.value_index("cpu-time") else {
            continue;
        };
        let cpu: i64 = prof
            .sample
            .iter()
            .filter_map(|s| s.value.get(i))
            .fold(0i64, |a, &v| a.saturating_add(v));
        let e = by_pid.entry(p).or_default();
        *e = e.saturating_add(cpu);
    }
    let comm = |p: i32| lasts.get(&p).map_or("?", |&(c, _)| c);
    let mut rows: Vec<(i32, i64)> = by_pid.into_iter().filter(|&(_, cpu)| cpu > 0).collect();
    if rows.is_empty() {
        return None;
    }
    rows.sort_by_key(|&(p, cpu)| (std::cmp::Reverse(cpu), p));
    let total: i64 = rows.iter().map(|&(_, cpu)| cpu).sum();
    let scope = if scanned_all {
        String::new()
    } else {
        format!(" (the {CPU_SCAN_FILES} largest files)")
    };
    let _ = writeln!(out, "\nCPU time by process{scope}:");
    const SHOWN: usize = 5;
    for &(p, cpu) in rows.iter().take(SHOWN) {
        let role = if p == pid { " (the command)" } else { "" };
        let _ = writeln!(
            out,
            "  {:>10}  {:>5.1}%  {} pid {p}{role}",
            report::format_value(cpu, "nanoseconds"),
            cpu as f64 * 100.0 / total as f64,
            comm(p)
        );
    }
    if rows.len() > SHOWN {
        let _ = writeln!(out, "  ... and {} more", rows.len() - SHOWN);
    }
    // Many processes of a few commands (a build's compilers): the sum per command says more.
    let mut by_comm: BTreeMap<&str, (i64, usize)> = BTreeMap::new();
    for &(p, cpu) in &rows {
        let e = by_comm.entry(comm(p)).or_default();
        e.0 = e.0.saturating_add(cpu);
        e.1 += 1;
    }
    if by_comm.len() < rows.len() {
        let mut comms: Vec<_> = by_comm.into_iter().collect();
        comms.sort_by_key(|&(c, (cpu, _))| (std::cmp::Reverse(cpu), c));
        let _ = writeln!(out, "by command:");
        for (comm, (cpu, n)) in comms.iter().take(SHOWN) {
            let _ = writeln!(
                out,
                "  {:>10}  {:>5.1}%  {comm} ({n} process{})",
                report::format_value(*cpu, "nanoseconds"),
                *cpu as f64 * 100.0 / total as f64,
                if *n == 1 { "" } else { "es" }
            );
        }
        if comms.len() > SHOWN {
            let _ = writeln!(out, "  ... and {} more", comms.len() - SHOWN);
        }
    }
    let top = rows[0].0;
    let &(name, last) = lasts.get(&top)?;
    (top != pid).then(|| Busiest {
        pid: top,
        comm: name.to_owned(),
        last: last.clone(),
    })
}

/// `key=N` from the summary process `pid` left in `summary_dir` (None when it left none: it
/// wrote no profile, or did not load the library).
fn summary_field(summary_dir: &Path, pid: i32, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(summary_dir.join(format!("{pid}.summary"))).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix('=')?.trim().parse().ok())
}

/// CMD as a path: as given when it holds a `/`, else the first match on `PATH`.
fn resolve_command(cmd: &OsString) -> anyhow::Result<PathBuf> {
    let p = Path::new(cmd);
    let found = if p.as_os_str().as_encoded_bytes().contains(&b'/') {
        p.exists().then(|| p.to_path_buf())
    } else {
        std::env::var_os("PATH").and_then(|path| {
            std::env::split_paths(&path)
                .map(|d| d.join(p))
                .find(|c| is_executable(c))
        })
    };
    let Some(found) = found else {
        return Err(CliError(format!("{}: command not found", p.display())).into());
    };
    if !is_executable(&found) {
        return Err(CliError(format!("{}: not an executable file", found.display())).into());
    }
    Ok(found)
}

fn is_executable(p: &Path) -> bool {
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.mode() & 0o111 != 0)
}

/// Refuses, with the reason, programs `LD_PRELOAD` cannot reach: statically linked ones (no
/// dynamic loader runs), setuid/setgid ones (the loader ignores `LD_PRELOAD` in secure mode),
/// 32-bit ones (the library is 64-bit). Scripts are judged by their interpreter.
fn check_injectable(program: &Path, cmd: &OsString) -> anyhow::Result<()> {
    let shown = Path::new(cmd).display();
    check_not_secure(program, &shown.to_string())?;
    match elf_kind(program)? {
        Binary::Dynamic => Ok(()),
        Binary::Static => Err(CliError(format!(
            "{shown} is statically linked: no dynamic loader runs for it, so LD_PRELOAD cannot \
             inject ferroprof, and none of its profiles (CPU and wall included) can be \
             recorded this way. Link ferroprof into the program, or use perf record."
        ))
        .into()),
        Binary::Elf32 => Err(CliError(format!(
            "{shown} is a 32-bit program; the preload library is 64-bit and the loader would \
             ignore it"
        ))
        .into()),
        Binary::Script(interp) => {
            let interp_path = PathBuf::from(&interp);
            if !interp_path.exists() {
                return Err(
                    CliError(format!("{shown}: its interpreter {interp} does not exist")).into(),
                );
            }
            match elf_kind(&interp_path)? {
                Binary::Static => Err(CliError(format!(
                    "{shown} runs under {interp}, which is statically linked: LD_PRELOAD \
                     cannot inject ferroprof into it"
                ))
                .into()),
                _ => Ok(()),
            }
        }
        Binary::Unknown => Ok(()),
    }
}

fn check_not_secure(program: &Path, shown: &str) -> anyhow::Result<()> {
    let m = std::fs::metadata(program).map_err(|e| CliError(format!("{shown}: {e}")))?;
    // SAFETY: getuid/getgid have no preconditions.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    let setuid = m.mode() & libc::S_ISUID != 0 && m.uid() != uid;
    let setgid = m.mode() & libc::S_ISGID != 0 && m.gid() != gid;
    if setuid || setgid {
        return Err(CliError(format!(
            "{shown} is set{}id: the dynamic loader runs it in secure mode and ignores \
             LD_PRELOAD, so ferroprof cannot be injected. Profile a copy without the set{}id \
             bit, or run it as its owner.",
            if setuid { "u" } else { "g" },
            if setuid { "u" } else { "g" },
        ))
        .into());
    }
    Ok(())
}

#[derive(Debug, PartialEq, Eq)]
enum Binary {
    Dynamic,
    Static,
    Elf32,
    Script(String),
    Unknown,
}

/// Whether `path` is a dynamically linked ELF (a `PT_INTERP` program header), a static one,
/// or a `#!` script (its interpreter).
fn elf_kind(path: &Path) -> anyhow::Result<Binary> {
    let mut f = std::fs::File::open(path)
        .map_err(|e| CliError(format!("cannot read {}: {e}", path.display())))?;
    let mut head = vec![0u8; 4096];
    let n = read_full(&mut f, &mut head);
    head.truncate(n);
    if head.starts_with(b"#!") {
        let line = head[2..].split(|&b| b == b'\n').next().unwrap_or(&[]);
        let line = String::from_utf8_lossy(line);
        let interp = line.split_whitespace().next().unwrap_or("").to_owned();
        return Ok(Binary::Script(interp));
    }
    if !head.starts_with(b"\x7fELF") || head.len() < 64 {
        return Ok(Binary::Unknown);
    }
    if head[4] != 2 {
        return Ok(Binary::Elf32);
    }
    if head[5] != 1 {
        // Big-endian: not a program for this machine anyway; let the kernel say so.
        return Ok(Binary::Unknown);
    }
    let u16_at = |b: &[u8], o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
    let phoff = u64::from_le_bytes(head[0x20..0x28].try_into().expect("8 bytes"));
    let phentsize = u16_at(&head, 0x36) as u64;
    let phnum = u16_at(&head, 0x38) as u64;
    if phentsize < 4 || phnum == 0 {
        return Ok(Binary::Unknown);
    }
    let mut table = vec![0u8; (phentsize * phnum).min(1 << 20) as usize];
    use std::io::Seek;
    if f.seek(std::io::SeekFrom::Start(phoff)).is_err() {
        return Ok(Binary::Unknown);
    }
    let got = read_full(&mut f, &mut table);
    let has_interp = table[..got]
        .chunks_exact(phentsize as usize)
        .any(|ph| u32::from_le_bytes(ph[0..4].try_into().expect("4 bytes")) == 3);
    Ok(if has_interp {
        Binary::Dynamic
    } else {
        Binary::Static
    })
}

fn read_full(f: &mut std::fs::File, buf: &mut [u8]) -> usize {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]) {
            Ok(0) | Err(_) => break,
            Ok(k) => n += k,
        }
    }
    n
}

/// The debug cache directory to give the program: `--debug-cache` (made absolute), else
/// `None` to leave `$FERROPROF_DEBUG_CACHE` as it is when set, else the user's cache directory
/// (`off` when there is none).
fn debug_cache(given: Option<&std::ffi::OsStr>) -> anyhow::Result<Option<OsString>> {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    let dir = match given {
        Some(g) if g == "off" => return Ok(Some(OsString::from("off"))),
        Some(g) => std::path::absolute(g)
            .map_err(|e| CliError(format!("--debug-cache {}: {e}", g.to_string_lossy())))?,
        None if env("FERROPROF_DEBUG_CACHE").is_some() => return Ok(None),
        None => {
            let xdg = env("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .filter(|p| p.is_absolute());
            let home = env("HOME").map(|h| PathBuf::from(h).join(".cache"));
            match xdg.or(home) {
                Some(base) => base.join("ferroprof").join("debug"),
                None => return Ok(Some(OsString::from("off"))),
            }
        }
    };
    Ok(Some(dir.into_os_string()))
}

/// The preload library: `$FERROPROF_PRELOAD`, else next to the `ferroprof` binary, else in
/// `../lib` from it (an installed layout), else the copy this binary carries, written to the
/// user's cache directory (see `embedded`): `cargo install` installs the binary alone.
fn find_preload() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os(PRELOAD_ENV).filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p.canonicalize().unwrap_or(p))
        } else {
            Err(CliError(format!("{PRELOAD_ENV}={}: no such file", p.display())).into())
        };
    }
    let exe = std::env::current_exe()
        .map_err(|e| CliError(format!("cannot locate the ferroprof binary: {e}")))?;
    let bin_dir = exe.parent().unwrap_or(Path::new("."));
    let candidates = [
        bin_dir.join(PRELOAD_NAME),
        bin_dir.join("../lib").join(PRELOAD_NAME),
    ];
    for c in &candidates {
        if c.is_file() {
            return Ok(c.canonicalize().unwrap_or_else(|_| c.clone()));
        }
    }
    if crate::embedded::available() {
        return crate::embedded::install();
    }
    Err(CliError(format!(
        "the preload library {PRELOAD_NAME} is not next to {} (nor in ../lib), and this \
         ferroprof does not carry one (it was built outside the ferroprof workspace); install \
         it from the repository (`cargo install --path crates/cli`), or name the library with \
         {PRELOAD_ENV}=/path/to/{PRELOAD_NAME}",
        exe.display()
    ))
    .into())
}

/// The directory the program writes into, and the file the main process's last profile is
/// renamed to (for an output ending in `.pprof`).
pub(crate) fn output_paths(out: &Path) -> anyhow::Result<(PathBuf, Option<PathBuf>)> {
    if out.extension().is_some_and(|e| e == "pprof") && !out.is_dir() {
        let parent = out
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        return Ok((parent.to_path_buf(), Some(out.to_path_buf())));
    }
    Ok((out.to_path_buf(), None))
}

/// Profile files in the directory and their modification times.
type Snapshot = BTreeMap<PathBuf, SystemTime>;

pub(crate) fn snapshot(dir: &Path) -> Snapshot {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let p = e.path();
            let m = e.metadata().ok()?.modified().ok()?;
            Some((p, m))
        })
        .collect()
}

/// Profiles written since `before`, by (command, pid), each process's in order.
pub(crate) fn new_profiles(dir: &Path, before: &Snapshot) -> BTreeMap<(String, i32), Vec<PathBuf>> {
    let mut out: BTreeMap<(String, i32), Vec<(u32, PathBuf)>> = BTreeMap::new();
    for (path, mtime) in snapshot(dir) {
        if before.get(&path) == Some(&mtime) {
            continue;
        }
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if let Some((comm, pid, n)) = parse_name(name) {
            out.entry((comm, pid)).or_default().push((n, path));
        }
    }
    out.into_iter()
        .map(|(k, mut v)| {
            v.sort();
            (k, v.into_iter().map(|(_, p)| p).collect())
        })
        .collect()
}

/// `<command>.<pid>.<n>.pprof`, as the preload library names profiles.
fn parse_name(name: &str) -> Option<(String, i32, u32)> {
    if name.starts_with('.') {
        return None;
    }
    let stem = name.strip_suffix(".pprof")?;
    let mut parts = stem.rsplitn(3, '.');
    let n = parts.next()?.parse().ok()?;
    let pid = parts.next()?.parse().ok()?;
    let comm = parts.next()?.to_owned();
    Some((comm, pid, n))
}

pub(crate) fn report(
    written: &BTreeMap<(String, i32), Vec<PathBuf>>,
    pid: i32,
    file: Option<&Path>,
    profiles: ferroprof::Profiles,
    n: usize,
    heap_peak: impl Fn(i32) -> Option<u64>,
) -> anyhow::Result<()> {
    // An exec keeps the pid under a new command name: processes are pids. Read before the
    // command's last profile moves to FILE.
    let lasts = last_profiles(written);
    let procs = lasts.len();
    let count: usize = written.values().map(Vec::len).sum();
    let original = lasts.get(&pid).map(|&(_, f)| f.clone());
    let main_last = match (&original, file) {
        (Some(last), Some(file)) => {
            std::fs::rename(last, file).map_err(|e| {
                CliError(format!(
                    "cannot move {} to {}: {e}",
                    last.display(),
                    file.display()
                ))
            })?;
            Some(file.to_path_buf())
        }
        (last, _) => last.clone(),
    };
    println!("profiles: {count} from {procs} process(es)");
    // The command's files first, then the others; past LIST_MAX processes, a count per command.
    const LIST_MAX: usize = 12;
    let mut order: Vec<_> = written.iter().collect();
    order.sort_by_key(|((_, p), _)| *p != pid);
    let mut rest: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, ((comm, p), files)) in order.into_iter().enumerate() {
        if i >= LIST_MAX {
            *rest.entry(comm.as_str()).or_default() += 1;
            continue;
        }
        for f in files {
            // The command's last profile is shown where it is now (FILE, when given).
            let shown = match (&original, &main_last) {
                (Some(o), Some(now)) if o == f => now,
                _ => f,
            };
            let role = if *p == pid { " (the command)" } else { "" };
            println!("  {}  {comm} pid {p}{role}", shown.display());
        }
    }
    if !rest.is_empty() {
        let more: Vec<String> = rest.iter().map(|(c, n)| format!("{c} x{n}")).collect();
        println!(
            "  ... and {} more process(es): {} (all in {})",
            rest.values().sum::<usize>(),
            more.join(", "),
            written
                .values()
                .flatten()
                .next()
                .and_then(|f| f.parent())
                .map(|d| d.display().to_string())
                .unwrap_or_default()
        );
    }
    // A command that hands its work to children (make, git, a shell script): the tables go to
    // the process that used the most CPU, so they show where the time went.
    let busiest = if profiles.cpu && procs > 1 {
        let moved = original.as_deref().zip(main_last.as_deref());
        let mut out = String::new();
        let busiest = cpu_by_process(written, &lasts, pid, moved, &mut out);
        print!("{out}");
        busiest
    } else {
        None
    };
    let (last, shown_pid) = match (busiest, main_last) {
        (Some(b), main) => {
            let command = match &main {
                Some(m) => format!("the command's own profile: {}", m.display()),
                None => NO_PROFILE.to_owned(),
            };
            println!(
                "\nthe tables below are for {} pid {}, which used the most CPU; {command}",
                b.comm, b.pid,
            );
            (b.last, b.pid)
        }
        (None, Some(main)) => (main, pid),
        (None, None) => {
            println!("{NO_PROFILE}");
            return Ok(());
        }
    };
    let heap_peak = heap_peak(shown_pid);
    let p = report::load(&last)?;
    let label = last.display().to_string();
    let wanted = [
        ("cpu-time", profiles.cpu),
        ("wall-time", profiles.wall && !profiles.cpu),
        ("alloc-space", profiles.alloc),
        ("heap-live-size", profiles.heap),
    ];
    for (name, on) in wanted {
        if !on {
            continue;
        }
        let Some(i) = p.value_index(name) else {
            continue;
        };
        let t = FunctionTable::build_sites(&p, i);
        println!("\n{}", report::top_text(&t, n, false, &label).trim_end());
    }
    if let Some(peak) = heap_peak.filter(|_| profiles.heap) {
        // Beside heap-live-size's table (the heap at the end): the largest it was.
        println!(
            "\npeak live heap ≈ {} ({peak} bytes, estimated from samples)",
            report::format_value(i64::try_from(peak).unwrap_or(i64::MAX), "bytes")
        );
    }
    if profiles.alloc || profiles.heap {
        let samples = p
            .value_index("alloc-samples")
            .or_else(|| p.value_index("heap-live-samples"))
            .map(|i| FunctionTable::build(&p, i).samples)
            .unwrap_or(0);
        if samples == 0 {
            println!(
                "\nno allocations seen: the program never called malloc (or no allocation \
                 reached a sampling point). A program with its own allocator linked in \
                 statically (e.g. jemalloc) bypasses the C allocation API; its CPU and wall \
                 profiles are unaffected."
            );
        }
    }
    println!(
        "\nExplore:\n  ferroprof top {label} --type wall-time\n  ferroprof flamegraph {label} -o cpu.svg"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A build's many short processes: the busiest process, and the sum per command.
    #[test]
    fn cpu_is_listed_by_process_and_by_command() {
        let dir = std::env::temp_dir().join(format!("ferroprof-cpu-by-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut written: BTreeMap<(String, i32), Vec<PathBuf>> = BTreeMap::new();
        for (comm, pid, ms) in [
            ("make", 10, 5),
            ("cc1", 11, 30),
            ("cc1", 12, 20),
            ("as", 13, 40),
        ] {
            let p = ferroprof_pprof::ProfileBuilder::new(&[("cpu-time", "nanoseconds")])
                .sample(&["work", "main"], &[ms * 1_000_000], &[])
                .build();
            let f = dir.join(format!("{comm}.{pid}.1.pprof"));
            std::fs::write(&f, p.encode_gzip()).unwrap();
            written.insert((comm.to_owned(), pid), vec![f]);
        }
        let lasts = last_profiles(&written);
        let mut out = String::new();
        let busiest =
            cpu_by_process(&written, &lasts, 10, None, &mut out).expect("a busiest process");
        assert_eq!((busiest.pid, busiest.comm.as_str()), (13, "as"), "{out}");
        let by_command = out.split("by command:").nth(1).expect(&out);
        let first = by_command.lines().nth(1).expect(&out);
        assert!(
            first.contains("50.00ms") && first.contains("cc1 (2 processes)"),
            "{out}"
        );
        // The command itself busiest: no other process's tables.
        let mut out = String::new();
        assert!(
            cpu_by_process(&written, &lasts, 13, None, &mut out).is_none(),
            "{out}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn cpython_is_known_by_its_name() {
        let no_file = Path::new("/nonexistent/x");
        for yes in [
            "python",
            "python3",
            "python3.12",
            "/usr/bin/python3.13t",
            "python3.11d",
        ] {
            assert!(is_cpython(&OsString::from(yes), no_file), "{yes}");
        }
        for no in [
            "pythonista",
            "python3.",
            "python3.x",
            "ipython3",
            "true",
            "py",
        ] {
            assert!(!is_cpython(&OsString::from(no), no_file), "{no}");
        }
    }

    #[test]
    fn profile_names_parse_from_the_right() {
        assert_eq!(
            parse_name("my.prog.1234.2.pprof"),
            Some(("my.prog".to_owned(), 1234, 2))
        );
        assert_eq!(parse_name(".x.1.1.pprof.tmp"), None);
        assert_eq!(parse_name("api-20250102T030405.678Z.pprof"), None);
    }

    #[test]
    fn static_and_dynamic_binaries_are_told_apart() {
        // This test binary is dynamically linked (glibc); /bin/sh is a script interpreter.
        let me = std::env::current_exe().unwrap();
        assert_eq!(elf_kind(&me).unwrap(), Binary::Dynamic);
        let dir = std::env::temp_dir().join(format!("ferroprof-elf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let script = dir.join("s");
        std::fs::write(&script, "#!/bin/sh -e\necho hi\n").unwrap();
        assert_eq!(
            elf_kind(&script).unwrap(),
            Binary::Script("/bin/sh".to_owned())
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
