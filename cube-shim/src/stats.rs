//! A sandbox's resource use, read from its cgroups (v1 controllers or v2) into the
//! metrics message containerd's `ctr task metrics` and the CRI stats decode; for a VM
//! sandbox, what its supervisor process (the VMM with the guest's memory and vCPU
//! threads) uses on the host.

use std::path::{Path, PathBuf};

use containerd_shim::protos::cgroups::metrics::{
    CPUStat, CPUUsage, MemoryEntry, MemoryStat, Metrics, PidsStat,
};

fn read_u64(dir: &Path, file: &str) -> Option<u64> {
    std::fs::read_to_string(dir.join(file))
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

/// The first value of `file` found in `dirs`.
fn first(dirs: &[PathBuf], file: &str) -> Option<u64> {
    dirs.iter().find_map(|d| read_u64(d, file))
}

/// CPU time used, nanoseconds: `cpuacct.usage` (v1) or `cpu.stat`'s `usage_usec` (v2).
fn cpu_ns(dirs: &[PathBuf]) -> u64 {
    if let Some(ns) = first(dirs, "cpuacct.usage") {
        return ns;
    }
    dirs.iter()
        .find_map(|d| std::fs::read_to_string(d.join("cpu.stat")).ok())
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("usage_usec "))
                .and_then(|v| v.trim().parse::<u64>().ok())
        })
        .map_or(0, |us| us * 1000)
}

/// The metrics of the sandbox whose cgroup directories are `dirs`.
pub fn metrics(dirs: &[PathBuf]) -> Metrics {
    let usage = first(dirs, "memory.usage_in_bytes")
        .or_else(|| first(dirs, "memory.current"))
        .unwrap_or(0);
    let limit = first(dirs, "memory.limit_in_bytes")
        .or_else(|| first(dirs, "memory.max"))
        .unwrap_or(u64::MAX);
    let mut memory = MemoryStat::new();
    memory.usage = Some(MemoryEntry {
        usage,
        limit,
        max: first(dirs, "memory.max_usage_in_bytes").unwrap_or(0),
        ..Default::default()
    })
    .into();
    let mut cpu = CPUStat::new();
    cpu.usage = Some(CPUUsage {
        total: cpu_ns(dirs),
        ..Default::default()
    })
    .into();
    let pids = PidsStat {
        current: first(dirs, "pids.current").unwrap_or(0),
        limit: first(dirs, "pids.max").unwrap_or(0),
        ..Default::default()
    };
    let mut m = Metrics::new();
    m.memory = Some(memory).into();
    m.cpu = Some(cpu).into();
    m.pids = Some(pids).into();
    m
}

/// The metrics of a VM sandbox whose supervisor is `pid`: memory is the supervisor's
/// resident memory (`rss_bytes`, the guest's touched memory with the VMM's) against the
/// guest's size, CPU the supervisor's time (its vCPU threads included), pids the
/// container's processes that run (`processes`; the guest's own are not seen here).
pub fn vm_metrics(pid: u32, rss_bytes: u64, guest_bytes: u64, processes: u64) -> Metrics {
    let mut memory = MemoryStat::new();
    memory.usage = Some(MemoryEntry {
        usage: rss_bytes,
        limit: guest_bytes,
        ..Default::default()
    })
    .into();
    let mut cpu = CPUStat::new();
    cpu.usage = Some(CPUUsage {
        total: process_cpu_ns(pid).unwrap_or(0),
        ..Default::default()
    })
    .into();
    let pids = PidsStat {
        current: processes,
        ..Default::default()
    };
    let mut m = Metrics::new();
    m.memory = Some(memory).into();
    m.cpu = Some(cpu).into();
    m.pids = Some(pids).into();
    m
}

/// CPU time process `pid` (all its threads) used, nanoseconds: utime and stime of
/// `/proc/PID/stat`, in clock ticks.
fn process_cpu_ns(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name, in parentheses, may hold spaces: fields count from its end.
    let fields: Vec<&str> = stat.get(stat.rfind(')')? + 2..)?.split(' ').collect();
    let ticks = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf only reads a system constant.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let per_second = u64::try_from(per_second).ok().filter(|t| *t > 0)?;
    Some(ticks * (1_000_000_000 / per_second))
}

/// The host pids of every process in the sandbox.
pub fn pids(dirs: &[PathBuf]) -> Vec<u32> {
    let mut all: Vec<u32> = dirs
        .iter()
        .filter_map(|d| std::fs::read_to_string(d.join("cgroup.procs")).ok())
        .flat_map(|text| {
            text.lines()
                .filter_map(|l| l.trim().parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect();
    all.sort_unstable();
    all.dedup();
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vm_sandboxs_metrics_are_its_supervisors_use() {
        // This process stands for a supervisor: it has used some CPU by now.
        let spin = std::time::Instant::now();
        while spin.elapsed() < std::time::Duration::from_millis(30) {}
        let m = vm_metrics(std::process::id(), 5 << 20, 512 << 20, 2);
        let memory = m.memory.usage.as_ref().unwrap();
        assert_eq!((memory.usage, memory.limit), (5 << 20, 512 << 20));
        assert!(m.cpu.usage.total >= 10_000_000, "{}", m.cpu.usage.total);
        assert_eq!(m.pids.current, 2);
        // A process that is gone has used nothing that can be read.
        assert_eq!(process_cpu_ns(u32::MAX), None);
    }
}
