//! What `/proc` says of the target process and its threads: whether it runs, its threads and
//! their names, when it started.

use std::time::Duration;

pub(crate) fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// The scheduler state (`R` running or runnable, `S` and `D` waiting, `Z` a zombie...) in a
/// `stat` file, `None` when it cannot be read (the task is gone).
pub(crate) fn state(stat_path: &str) -> Option<char> {
    let stat = std::fs::read_to_string(stat_path).ok()?;
    // The state follows the command's closing parenthesis.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Whether the process still runs (a zombie counts as ended).
pub(crate) fn alive(pid: i32) -> bool {
    !matches!(
        state(&format!("/proc/{pid}/stat")),
        Some('Z') | Some('X') | None
    )
}

pub(crate) fn list_threads(pid: i32) -> Vec<i32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect()
}

pub(crate) fn read_comm(pid: i32, tid: i32) -> Option<String> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")).ok()?;
    Some(s.trim_end_matches('\n').to_owned())
}

pub(crate) fn thread_name(pid: i32, tid: i32) -> String {
    read_comm(pid, tid).unwrap_or_default()
}

/// When the process started (from `/proc/PID/stat` and the boot time), for exporters.
pub fn process_start(pid: i32) -> Option<std::time::SystemTime> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Field 22, counted after the command's closing parenthesis (field 2).
    let ticks: u64 = stat
        .rsplit_once(')')?
        .1
        .split_whitespace()
        .nth(19)?
        .parse()
        .ok()?;
    let btime: u64 = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime ")?.trim().parse().ok())?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    let since_boot = Duration::from_nanos(ticks.saturating_mul(1_000_000_000) / hz);
    Some(std::time::UNIX_EPOCH + Duration::from_secs(btime) + since_boot)
}

/// The process's command name (its `comm`), safe in a file name (as `record` names files).
pub fn command_name(pid: i32) -> String {
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    ferroprof::export::dir::command_file_name(&comm)
}
