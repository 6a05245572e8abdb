//! A sandbox's resource use, read from its cgroups (v1 controllers or v2) into the
//! metrics message containerd's `ctr task metrics` and the CRI stats decode.

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
