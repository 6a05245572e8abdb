//! A VM supervisor's own seccomp filters (and its network keeper's): system calls the VMM never makes once the
//! sandbox is set up, each of which kills the supervisor (`SECCOMP_RET_KILL_PROCESS`),
//! installed on all its threads at once (`SECCOMP_FILTER_FLAG_TSYNC`) and inherited by
//! every thread started later.
//!
//! A jail supervisor gets none: it runs CRIU after set-up, and CRIU, which dumps
//! sandbox processes that have seccomp filters of their own, must suspend them
//! (`PTRACE_O_SUSPEND_SECCOMP`), which the kernel allows only to a tracer that is under
//! no seccomp filter itself (and a filter is inherited by every process started).
//!
//! A deny list, not an allow list: the VMM makes many distinct calls across its
//! devices, snapshot writers and live copies, and a missed one in an allow list would
//! kill sandboxes in use. What the lists take away is what an attacker who got code
//! execution in a supervisor would reach for: new programs and processes, other
//! processes' memory, mounts and namespaces, kernel modules, kexec, reboot, raw I/O
//! ports, keyrings and file handles that escape mount namespaces.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// Why a filter could not be built or installed.
#[derive(Debug, thiserror::Error)]
pub enum SyscallFilterError {
    /// seccompiler rejected the rules.
    #[error("building the supervisor's seccomp filter")]
    Build(#[source] seccompiler::BackendError),
    /// The kernel refused the filter.
    #[error("installing the supervisor's seccomp filter on all threads")]
    Install(#[source] seccompiler::Error),
    /// Filters are built for x86-64 only.
    #[error("the supervisor's seccomp filters are built for x86-64 only")]
    UnsupportedArch,
}

/// A system call on a filter's list, and why it is there (why a supervisor never
/// needs it, on a deny list; what for a thread makes it, on an allow list).
#[derive(Clone, Copy, Debug)]
pub struct ListedCall {
    /// Its name.
    pub name: &'static str,
    /// Its x86-64 number.
    pub nr: libc::c_long,
    /// Why it is on the list.
    pub why: &'static str,
}

/// A system call the filter kills on.
pub type Killed = ListedCall;

pub(super) const fn listed(name: &'static str, nr: libc::c_long, why: &'static str) -> ListedCall {
    ListedCall { name, nr, why }
}

const fn killed(name: &'static str, nr: libc::c_long, why: &'static str) -> Killed {
    listed(name, nr, why)
}

/// Calls that alter the host itself.
pub const HOST_ALTERING: &[Killed] = &[
    killed("init_module", libc::SYS_init_module, "kernel modules"),
    killed("finit_module", libc::SYS_finit_module, "kernel modules"),
    killed("delete_module", libc::SYS_delete_module, "kernel modules"),
    killed("kexec_load", libc::SYS_kexec_load, "replaces the kernel"),
    killed(
        "kexec_file_load",
        libc::SYS_kexec_file_load,
        "replaces the kernel",
    ),
    killed("reboot", libc::SYS_reboot, "host-global"),
    killed("swapon", libc::SYS_swapon, "host-global"),
    killed("swapoff", libc::SYS_swapoff, "host-global"),
    killed("acct", libc::SYS_acct, "host-global"),
    killed("iopl", libc::SYS_iopl, "raw hardware access"),
    killed("ioperm", libc::SYS_ioperm, "raw hardware access"),
    killed("uselib", libc::SYS_uselib, "obsolete loader"),
    killed(
        "lookup_dcookie",
        libc::SYS_lookup_dcookie,
        "kernel profiling",
    ),
];

/// Calls besides [`HOST_ALTERING`] a VMM makes no use of once the VM runs: it needs
/// KVM ioctls, memory, its files and sockets, and nothing of these.
pub const VM_ONLY: &[Killed] = &[
    killed("execve", libc::SYS_execve, "no new programs"),
    killed("execveat", libc::SYS_execveat, "no new programs"),
    killed("fork", libc::SYS_fork, "no new processes"),
    killed("vfork", libc::SYS_vfork, "no new processes"),
    killed("ptrace", libc::SYS_ptrace, "other processes"),
    killed(
        "process_vm_readv",
        libc::SYS_process_vm_readv,
        "other processes' memory",
    ),
    killed(
        "process_vm_writev",
        libc::SYS_process_vm_writev,
        "other processes' memory",
    ),
    killed(
        "pidfd_getfd",
        libc::SYS_pidfd_getfd,
        "other processes' descriptors",
    ),
    killed("kcmp", libc::SYS_kcmp, "other processes' descriptors"),
    killed(
        "open_by_handle_at",
        libc::SYS_open_by_handle_at,
        "opens files outside any mount namespace",
    ),
    killed(
        "name_to_handle_at",
        libc::SYS_name_to_handle_at,
        "file handles",
    ),
    killed("add_key", libc::SYS_add_key, "keyrings are host-wide"),
    killed(
        "request_key",
        libc::SYS_request_key,
        "keyrings are host-wide",
    ),
    killed("keyctl", libc::SYS_keyctl, "keyrings are host-wide"),
    killed("settimeofday", libc::SYS_settimeofday, "the clock"),
    killed("clock_settime", libc::SYS_clock_settime, "the clock"),
    killed("clock_adjtime", libc::SYS_clock_adjtime, "the clock"),
    killed("syslog", libc::SYS_syslog, "the kernel log"),
    killed(
        "perf_event_open",
        libc::SYS_perf_event_open,
        "side channels",
    ),
    killed("sethostname", libc::SYS_sethostname, "host identity"),
    killed("setdomainname", libc::SYS_setdomainname, "host identity"),
    killed("chroot", libc::SYS_chroot, "file system view"),
    killed("pivot_root", libc::SYS_pivot_root, "file system view"),
    killed("quotactl", libc::SYS_quotactl, "host-wide quotas"),
];

/// Calls besides [`VM_ONLY`] neither a VM supervisor nor a network keeper makes once
/// set up: the keeper works in the host's network namespace it started in, on pins
/// in a bpffs that is mounted already.
pub const MOUNTS_AND_NAMESPACES: &[Killed] = &[
    killed("mount", libc::SYS_mount, "mounts"),
    killed("umount2", libc::SYS_umount2, "mounts"),
    killed("open_tree", libc::SYS_open_tree, "mounts"),
    killed("move_mount", libc::SYS_move_mount, "mounts"),
    killed("fsopen", libc::SYS_fsopen, "mounts"),
    killed("fsmount", libc::SYS_fsmount, "mounts"),
    killed("fsconfig", libc::SYS_fsconfig, "mounts"),
    killed("fspick", libc::SYS_fspick, "mounts"),
    killed("mount_setattr", libc::SYS_mount_setattr, "mounts"),
    killed("unshare", libc::SYS_unshare, "namespaces"),
    killed("setns", libc::SYS_setns, "namespaces"),
];

/// Refused to VM supervisors, not to network keepers: a keeper changes and releases
/// its device's eBPF state (maps, link pins) in the host's pool.
pub const VM_WITHOUT_BPF: &[Killed] = &[killed("bpf", libc::SYS_bpf, "kernel attack surface")];

/// The rule set a VM supervisor or a network keeper installs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FilterSet {
    /// [`HOST_ALTERING`], [`VM_ONLY`], [`MOUNTS_AND_NAMESPACES`], and `clone`
    /// without `CLONE_THREAD` (a new process); `clone3` answered ENOSYS so that libc
    /// starts threads with `clone`, whose flags the filter can read; x32-ABI numbers
    /// (which alias the x86-64 calls past a deny list) kill too.
    NetworkKeeper,
    /// [`FilterSet::NetworkKeeper`] and [`VM_WITHOUT_BPF`].
    Vm,
}

impl FilterSet {
    /// Every system call the set kills on, by name (`clone` for new processes).
    pub fn killed(self) -> Vec<Killed> {
        let mut all: Vec<Killed> = HOST_ALTERING.to_vec();
        all.extend_from_slice(VM_ONLY);
        all.push(killed(
            "clone(new process)",
            libc::SYS_clone,
            "no new processes (threads only)",
        ));
        all.extend_from_slice(MOUNTS_AND_NAMESPACES);
        if self == FilterSet::Vm {
            all.extend_from_slice(VM_WITHOUT_BPF);
        }
        all
    }

    /// The BPF programs, in the order they are installed.
    pub fn build(self) -> Result<Vec<BpfProgram>, SyscallFilterError> {
        if std::env::consts::ARCH != "x86_64" {
            return Err(SyscallFilterError::UnsupportedArch);
        }
        let arch = TargetArch::x86_64;
        let mut rules: BTreeMap<i64, Vec<SeccompRule>> = self
            .killed()
            .into_iter()
            .filter(|k| k.nr != libc::SYS_clone)
            .map(|k| (k.nr, Vec::new()))
            .collect();
        // Flags are an unsigned long; a new thread always has CLONE_THREAD.
        let new_process = SeccompCondition::new(
            0,
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(libc::CLONE_THREAD as u64),
            0,
        )
        .and_then(|c| SeccompRule::new(vec![c]))
        .map_err(SyscallFilterError::Build)?;
        rules.insert(libc::SYS_clone, vec![new_process]);
        let deny: BpfProgram = SeccompFilter::new(
            rules,
            SeccompAction::Allow,
            SeccompAction::KillProcess,
            arch,
        )
        .and_then(TryInto::try_into)
        .map_err(SyscallFilterError::Build)?;
        let clone3 =
            cube_jail::seccomp::clone3_unsupported(arch).map_err(SyscallFilterError::Build)?;
        Ok(vec![
            cube_jail::seccomp::guard_x32(&deny, libc::SECCOMP_RET_KILL_PROCESS),
            clone3,
        ])
    }
}

/// Installs `programs` on every thread of this process (and so on every thread it
/// starts later); also sets no_new_privs, which the kernel spreads to all threads.
pub fn install_on_all_threads(programs: &[BpfProgram]) -> Result<(), SyscallFilterError> {
    for program in programs {
        seccompiler::apply_filter_all_threads(program).map_err(SyscallFilterError::Install)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_set_builds_and_names_each_call_once() {
        for set in [FilterSet::Vm, FilterSet::NetworkKeeper] {
            let programs = set.build().unwrap();
            let mut nrs: Vec<_> = set.killed().iter().map(|k| k.nr).collect();
            let n = nrs.len();
            nrs.sort();
            nrs.dedup();
            assert_eq!(nrs.len(), n, "{set:?} names a call twice");
            for k in set.killed() {
                assert!(
                    programs[0].iter().any(|i| i.k == k.nr as u32),
                    "{} missing from {set:?}",
                    k.name
                );
            }
        }
    }

    #[test]
    fn the_sets_nest() {
        let names = |s: FilterSet| -> Vec<&str> { s.killed().iter().map(|k| k.name).collect() };
        let keeper = names(FilterSet::NetworkKeeper);
        let vm = names(FilterSet::Vm);
        assert!(keeper.iter().all(|n| vm.contains(n)));
        assert!(vm.contains(&"execve") && keeper.contains(&"mount"));
        assert!(vm.contains(&"bpf") && !keeper.contains(&"bpf"));
    }
}
