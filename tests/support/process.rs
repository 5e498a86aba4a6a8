//! What /proc says about a process: its children, its resident memory, its CPU time. Shared by
//! the tests (`support::process`) and the bench (`#[path]`).

use std::time::Duration;

/// The direct children of `pid`.
pub fn children(pid: i32) -> Vec<i32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// Resident memory of `pid` in KiB; 0 once it has gone.
pub fn rss_kib(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .map(|v| v.trim().trim_end_matches(" kB").trim().parse().unwrap_or(0))
        })
        .unwrap_or(0)
}

/// User and kernel CPU time of `pid`; zero once it has gone.
pub fn cpu_time(pid: i32) -> (Duration, Duration) {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return (Duration::ZERO, Duration::ZERO);
    };
    // Fields 14 and 15 of stat(5), counted from the state field (3), after the name.
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap_or(0) + 2..]
        .split(' ')
        .collect();
    // SAFETY: sysconf has no memory-safety preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    let ticks =
        |field: &str| Duration::from_micros(field.parse::<u64>().unwrap_or(0) * 1_000_000 / hz);
    (ticks(fields[11]), ticks(fields[12]))
}

/// User and kernel CPU time of `pid`, together.
pub fn cpu_total(pid: i32) -> Duration {
    let (user, kernel) = cpu_time(pid);
    user + kernel
}
