//! What this host can do: which KVM it has (probed by [`cube_vmm::host`]), how its
//! cgroups are laid out, whether CRIU and eBPF work, how many CPUs and how much memory
//! it has.
//!
//! Everything is found by trying it on the running system, never assumed from the
//! distribution or kernel version: `cube doctor` prints it and the engine chooser
//! (`auto`) reads it.

use std::fs;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::Path;
use std::process::{Command, Stdio};

use cube_vmm::host::KvmProbe;
pub use cube_vmm::host::{KvmKind, PvmFlavour};
pub use cube_vmm::vstate::emulation::KernelMode;
use nix::sys::statfs::{statfs, CGROUP2_SUPER_MAGIC, CGROUP_SUPER_MAGIC};
use serde::{Deserialize, Serialize};

/// Where cgroup hierarchies are mounted.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// How the host's cgroup hierarchies are mounted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CgroupMode {
    /// Only per-controller v1 hierarchies.
    V1,
    /// The unified v2 hierarchy at the cgroup root.
    V2,
    /// v1 controllers plus a v2 hierarchy at `/sys/fs/cgroup/unified` (systemd's
    /// hybrid layout): v2 there usually has no memory or cpu controller.
    Hybrid,
}

/// The host's capabilities as far as Cube cares.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostCapabilities {
    /// Which KVM the host has.
    pub kvm: KvmKind,
    /// Which PVM, where `kvm` is PVM.
    pub pvm_flavour: Option<PvmFlavour>,
    /// How Cube's guest kernel (not PVM-enabled) runs here; `None` without KVM.
    pub linux_kernel: Option<KernelMode>,
    /// `KVM_GET_API_VERSION`, when `/dev/kvm` opens.
    pub kvm_api_version: Option<i32>,
    /// Whether KVM offers a dirty ring (`KVM_CAP_DIRTY_LOG_RING`).
    pub dirty_ring: bool,
    /// Whether KVM offers manual dirty-log protection (`KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2`),
    /// which lets a snapshot re-protect only the pages it has copied.
    pub manual_dirty_log_protect: bool,
    /// `criu --version`'s version, when CRIU is on `PATH`.
    pub criu: Option<String>,
    /// Whether `criu check` passes (CRIU can checkpoint on this kernel).
    pub criu_works: bool,
    /// Whether this process can load an eBPF program.
    pub ebpf: bool,
    /// The cgroup layout; `None` when no cgroup filesystem is mounted at
    /// `/sys/fs/cgroup`.
    pub cgroup: Option<CgroupMode>,
    /// Online CPUs.
    pub cpu_count: usize,
    /// Total memory in MiB.
    pub memory_mib: u64,
    /// The running kernel's release (`uname -r`).
    pub kernel_release: String,
    // Memory-tracking and storage capabilities (reflink, soft-dirty, uffd-wp) are
    // probed by cube-mem and cube-storage; their fields go here.
}

impl HostCapabilities {
    /// Probes the host. Takes a few ms, plus however long `criu check` runs when CRIU
    /// is installed; nothing it tries can fail the probe, a failure just means "no".
    pub fn probe() -> Self {
        let KvmProbe {
            kind: kvm,
            api_version: kvm_api_version,
            dirty_ring,
            manual_dirty_log_protect,
        } = KvmProbe::run();
        let pvm_flavour = (kvm == KvmKind::Pvm).then(PvmFlavour::probe);
        let criu = criu_version();
        let criu_works = criu.is_some() && criu_check();
        Self {
            kvm,
            pvm_flavour,
            linux_kernel: KernelMode::for_kvm(kvm),
            kvm_api_version,
            dirty_ring,
            manual_dirty_log_protect,
            criu,
            criu_works,
            ebpf: ebpf_available(),
            cgroup: cgroup_mode(Path::new(CGROUP_ROOT)),
            cpu_count: online_cpus(),
            memory_mib: memory_mib(),
            kernel_release: fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|r| r.trim().to_string())
                .unwrap_or_default(),
        }
    }
}

/// Reads the cgroup layout under `root`: v2 when `root` itself is cgroup2, hybrid when
/// `root/unified` is cgroup2 beside v1 controllers, v1 when only controllers are there.
fn cgroup_mode(root: &Path) -> Option<CgroupMode> {
    let fs_type = |p: &Path| statfs(p).ok().map(|s| s.filesystem_type());
    if fs_type(root) == Some(CGROUP2_SUPER_MAGIC) {
        return Some(CgroupMode::V2);
    }
    let has_v1 = fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .any(|entry| fs_type(&entry.path()) == Some(CGROUP_SUPER_MAGIC));
    let unified = fs_type(&root.join("unified")) == Some(CGROUP2_SUPER_MAGIC);
    match (has_v1, unified) {
        (true, true) => Some(CgroupMode::Hybrid),
        (true, false) => Some(CgroupMode::V1),
        // Only a v2 hierarchy, but not at the root: treat it as v2 mounted oddly.
        (false, true) => Some(CgroupMode::V2),
        (false, false) => None,
    }
}

/// The version `criu --version` reports ("Version: 4.1.1" gives "4.1.1"), or `None`
/// when CRIU is not on `PATH` or says something else.
pub fn criu_version() -> Option<String> {
    let output = Command::new("criu")
        .arg("--version")
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .ok()?;
    if !output.status.success() {
        return None;
    }
    parse_criu_version(&String::from_utf8_lossy(&output.stdout))
}

fn parse_criu_version(text: &str) -> Option<String> {
    text.lines()
        .find_map(|line| line.trim().strip_prefix("Version:"))
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

/// Whether `criu check` passes: CRIU installed is not CRIU working (Debian 12's 3.17
/// fails on newer kernels' vDSO layout).
pub fn criu_check() -> bool {
    Command::new("criu")
        .arg("check")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The `BPF_PROG_LOAD` part of `union bpf_attr` (the kernel zero-fills the rest).
#[repr(C)]
struct BpfProgLoadAttr {
    prog_type: u32,
    insn_cnt: u32,
    insns: u64,
    license: u64,
    log_level: u32,
    log_size: u32,
    log_buf: u64,
    kern_version: u32,
    prog_flags: u32,
}

/// `bpf(2)` command that loads a program.
const BPF_PROG_LOAD: libc::c_int = 5;
/// The simplest program type, needing no attach point.
const BPF_PROG_TYPE_SOCKET_FILTER: u32 = 1;

/// Whether this process can load an eBPF program: loads `r0 = 0; exit` as a socket
/// filter and closes it. Being root is not enough where the kernel lacks BPF or a LSM
/// forbids it, and unprivileged BPF may be enabled on other hosts, so try.
pub fn ebpf_available() -> bool {
    // Each instruction is 8 bytes: opcode, registers, offset, immediate (little-endian).
    // 0xb7 = BPF_ALU64 | BPF_MOV | BPF_K with dst r0 and imm 0; 0x95 = BPF_JMP | BPF_EXIT.
    let insns: [u64; 2] = [0xb7, 0x95];
    let license = c"GPL";
    let attr = BpfProgLoadAttr {
        prog_type: BPF_PROG_TYPE_SOCKET_FILTER,
        insn_cnt: insns.len() as u32,
        insns: insns.as_ptr() as u64,
        license: license.as_ptr() as u64,
        log_level: 0,
        log_size: 0,
        log_buf: 0,
        kern_version: 0,
        prog_flags: 0,
    };
    // SAFETY: `attr` and the instruction and license buffers it points to outlive the
    // call, and the size passed is `attr`'s own; the kernel only reads them.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            BPF_PROG_LOAD,
            &attr as *const BpfProgLoadAttr,
            std::mem::size_of::<BpfProgLoadAttr>() as libc::c_uint,
        )
    };
    match i32::try_from(fd) {
        Ok(fd) if fd >= 0 => {
            // SAFETY: the kernel just returned this fd to us and nothing else owns it;
            // dropping the `OwnedFd` closes it, unloading the program.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
            true
        }
        _ => false,
    }
}

fn online_cpus() -> usize {
    // SAFETY: sysconf reads a system value and has no memory-safety preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    usize::try_from(n).unwrap_or(1).max(1)
}

fn memory_mib() -> u64 {
    parse_mem_total_kib(&fs::read_to_string("/proc/meminfo").unwrap_or_default()) / 1024
}

fn parse_mem_total_kib(meminfo: &str) -> u64 {
    meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemTotal:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_describes_this_host() {
        let caps = HostCapabilities::probe();
        println!("{}", serde_json::to_string_pretty(&caps).unwrap());
        assert!(caps.cpu_count >= 1);
        assert!(caps.memory_mib > 0);
        assert!(!caps.kernel_release.is_empty());
        if Path::new("/dev/kvm").exists() {
            assert_eq!(caps.kvm_api_version, Some(12));
            assert_ne!(caps.kvm, KvmKind::None);
        } else {
            assert_eq!(caps.kvm, KvmKind::None);
        }
        if Path::new("/sys/module/kvm_pvm").exists() && caps.kvm_api_version.is_some() {
            assert_eq!(caps.kvm, KvmKind::Pvm);
        }
        assert_eq!(caps.pvm_flavour.is_some(), caps.kvm == KvmKind::Pvm);
        assert_eq!(caps.linux_kernel, KernelMode::for_kvm(caps.kvm));
        if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
            assert_eq!(caps.cgroup, Some(CgroupMode::V2));
        }
        assert_eq!(caps.criu_works, caps.criu.is_some() && criu_check());
        // unprivileged_bpf_disabled=2 here, so only root may load; elsewhere anyone may.
        if nix::unistd::geteuid().is_root() {
            assert!(
                caps.ebpf,
                "root could not load a two-instruction socket filter"
            );
        }
    }

    #[test]
    fn cgroup_modes_serialise_lowercase() {
        let json =
            serde_json::to_string(&[CgroupMode::V1, CgroupMode::V2, CgroupMode::Hybrid]).unwrap();
        assert_eq!(json, r#"["v1","v2","hybrid"]"#);
    }

    #[test]
    fn cgroup_mode_of_this_host_matches_its_layout() {
        let mode = cgroup_mode(Path::new(CGROUP_ROOT));
        let unified = statfs("/sys/fs/cgroup/unified")
            .is_ok_and(|s| s.filesystem_type() == CGROUP2_SUPER_MAGIC);
        let memory_v1 = statfs("/sys/fs/cgroup/memory")
            .is_ok_and(|s| s.filesystem_type() == CGROUP_SUPER_MAGIC);
        if unified && memory_v1 {
            assert_eq!(mode, Some(CgroupMode::Hybrid));
        }
        // A directory that is no cgroup mount at all.
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(cgroup_mode(dir.path()), None);
    }

    #[test]
    fn parsers_read_real_formats() {
        assert_eq!(
            parse_criu_version("Version: 3.17\n").as_deref(),
            Some("3.17")
        );
        assert_eq!(
            parse_criu_version("Version: 4.1.1\nGitID: v4.1.1-3-g0\n").as_deref(),
            Some("4.1.1")
        );
        assert_eq!(parse_criu_version("criu: command not found"), None);
        assert_eq!(
            parse_mem_total_kib("MemTotal:       24589432 kB\nMemFree: 1 kB\n"),
            24_589_432
        );
        assert_eq!(parse_mem_total_kib("garbage"), 0);
    }
}
