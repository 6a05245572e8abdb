//! What a sandbox uses right now: CPU time, memory and processes, read from its jail's
//! cgroups (v1 or v2) or, for a VM, from its supervisor process. For services that
//! report per-sandbox metrics (`cube serve`) and dashboards.

use std::path::{Path, PathBuf};

/// A sandbox's resource use at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ResourceUsage {
    /// CPU time used since the sandbox (its current jail or VM) started, nanoseconds;
    /// None where no counter could be read. Sample twice to get a rate.
    pub cpu_time_ns: Option<u64>,
    /// Memory charged to the sandbox now, bytes (page cache included for a jail).
    pub memory_bytes: u64,
    /// Of which page cache (file-backed memory), bytes.
    pub memory_cache_bytes: u64,
    /// The memory limit, bytes; None when unlimited.
    pub memory_limit_bytes: Option<u64>,
    /// Processes and threads in the sandbox; None where no pids counter exists.
    pub tasks: Option<u64>,
    /// CPUs the sandbox may use: its VM's vCPUs, or the host's online CPUs for a jail.
    pub cpus: u32,
}

/// v1 reports "no limit" as the largest page-aligned i64.
const V1_UNLIMITED: u64 = 0x7FFF_FFFF_FFFF_F000;

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn read_stat_field(path: &Path, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    text.lines().find_map(|line| {
        let (k, v) = line.split_once(' ')?;
        (k == field).then(|| v.trim().parse().ok()).flatten()
    })
}

/// Reads a jail's usage from its cgroup directories (one per v1 controller, or the one
/// v2 directory): whichever counter files each holds.
pub(crate) fn from_cgroups(dirs: &[PathBuf]) -> ResourceUsage {
    let mut usage = ResourceUsage {
        cpus: std::thread::available_parallelism()
            .map(|n| n.get() as u32)
            .unwrap_or(1),
        ..ResourceUsage::default()
    };
    for dir in dirs {
        if let Some(ns) = read_u64(&dir.join("cpuacct.usage")) {
            usage.cpu_time_ns = Some(ns);
        } else if let Some(us) = read_stat_field(&dir.join("cpu.stat"), "usage_usec") {
            usage.cpu_time_ns = Some(us.saturating_mul(1000));
        }
        if let Some(b) = read_u64(&dir.join("memory.usage_in_bytes")) {
            usage.memory_bytes = b;
            usage.memory_cache_bytes =
                read_stat_field(&dir.join("memory.stat"), "total_cache").unwrap_or(0);
            usage.memory_limit_bytes =
                read_u64(&dir.join("memory.limit_in_bytes")).filter(|l| *l < V1_UNLIMITED);
        } else if let Some(b) = read_u64(&dir.join("memory.current")) {
            usage.memory_bytes = b;
            usage.memory_cache_bytes =
                read_stat_field(&dir.join("memory.stat"), "file").unwrap_or(0);
            // "max" does not parse: unlimited.
            usage.memory_limit_bytes = read_u64(&dir.join("memory.max"));
        }
        if let Some(n) = read_u64(&dir.join("pids.current")) {
            usage.tasks = Some(n);
        }
    }
    usage
}

/// Reads a VM's usage from its supervisor process: the guest's memory is the
/// supervisor's resident set, its CPU the supervisor's CPU time.
pub(crate) fn from_supervisor(pid: u32, rss_kib: u64, vcpus: u32) -> ResourceUsage {
    let cpu_time_ns = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            // Fields after the command name, which may hold spaces, inside parentheses.
            let rest = stat.rsplit_once(')')?.1;
            let fields: Vec<&str> = rest.split_whitespace().collect();
            let utime: u64 = fields.get(11)?.parse().ok()?;
            let stime: u64 = fields.get(12)?.parse().ok()?;
            // SAFETY: sysconf reads a constant of the C library.
            let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
            let hz = u64::try_from(hz).ok().filter(|h| *h > 0)?;
            Some((utime + stime).saturating_mul(1_000_000_000 / hz))
        });
    ResourceUsage {
        cpu_time_ns,
        memory_bytes: rss_kib.saturating_mul(1024),
        memory_cache_bytes: 0,
        memory_limit_bytes: None,
        tasks: None,
        cpus: vcpus,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v1_and_v2_counter_files_are_read() {
        let v1 = tempfile::tempdir().unwrap();
        std::fs::write(v1.path().join("cpuacct.usage"), "1500\n").unwrap();
        std::fs::write(v1.path().join("memory.usage_in_bytes"), "4096\n").unwrap();
        std::fs::write(v1.path().join("memory.stat"), "cache 1\ntotal_cache 1024\n").unwrap();
        std::fs::write(
            v1.path().join("memory.limit_in_bytes"),
            format!("{V1_UNLIMITED}\n"),
        )
        .unwrap();
        let u = from_cgroups(&[v1.path().to_path_buf()]);
        assert_eq!(u.cpu_time_ns, Some(1500));
        assert_eq!((u.memory_bytes, u.memory_cache_bytes), (4096, 1024));
        assert_eq!(u.memory_limit_bytes, None);

        let v2 = tempfile::tempdir().unwrap();
        std::fs::write(v2.path().join("cpu.stat"), "usage_usec 7\nuser_usec 5\n").unwrap();
        std::fs::write(v2.path().join("memory.current"), "8192\n").unwrap();
        std::fs::write(v2.path().join("memory.max"), "65536\n").unwrap();
        std::fs::write(v2.path().join("memory.stat"), "anon 1\nfile 2048\n").unwrap();
        std::fs::write(v2.path().join("pids.current"), "3\n").unwrap();
        let u = from_cgroups(&[v2.path().to_path_buf()]);
        assert_eq!(u.cpu_time_ns, Some(7000));
        assert_eq!(u.memory_limit_bytes, Some(65536));
        assert_eq!(
            (u.memory_bytes, u.memory_cache_bytes, u.tasks),
            (8192, 2048, Some(3))
        );
    }

    #[test]
    fn a_process_s_cpu_time_is_read() {
        let u = from_supervisor(std::process::id(), 10, 2);
        assert!(u.cpu_time_ns.is_some());
        assert_eq!((u.memory_bytes, u.cpus), (10240, 2));
    }
}
