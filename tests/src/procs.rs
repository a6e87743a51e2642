//! Processes as `/proc` shows them (Linux): children of a process, members of a process group,
//! open descriptors. For tests that check which provider processes are alive.

use std::time::{Duration, Instant};

/// `(pid, ppid, pgrp, state)` of every process (zombies included).
pub fn processes() -> Vec<(u32, u32, u32, char)> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // `pid (comm) state ppid pgrp ...`; comm may contain spaces and parentheses.
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
            continue;
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        let (Some(state), Some(ppid), Some(pgrp)) = (
            f.first().and_then(|s| s.chars().next()),
            f.get(1).and_then(|s| s.parse().ok()),
            f.get(2).and_then(|s| s.parse().ok()),
        ) else {
            continue;
        };
        out.push((pid, ppid, pgrp, state));
    }
    out
}

/// Live (not zombie) children of `pid`.
pub fn children_of(pid: u32) -> Vec<u32> {
    processes()
        .into_iter()
        .filter(|p| p.1 == pid && p.3 != 'Z')
        .map(|p| p.0)
        .collect()
}

/// Live (not zombie) members of the process group `pgid`.
pub fn group_members(pgid: u32) -> Vec<u32> {
    processes()
        .into_iter()
        .filter(|p| p.2 == pgid && p.3 != 'Z')
        .map(|p| p.0)
        .collect()
}

/// Whether `pid` exists and is not a zombie.
pub fn alive(pid: u32) -> bool {
    processes().iter().any(|p| p.0 == pid && p.3 != 'Z')
}

/// Number of open descriptors of `pid`.
pub fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Polls `f` every 50 ms until it returns `Some`, or `None` after `secs` (a bound for a slow
/// machine, not a timed assertion).
pub fn poll<T>(secs: u64, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if start.elapsed() > Duration::from_secs(secs) {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
