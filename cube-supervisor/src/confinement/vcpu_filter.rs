//! The vCPU threads' own seccomp filter: an allow list, in the manner of Firecracker's
//! per-thread filters, on top of the VM supervisor's process-wide deny list
//! ([`super::syscall_filter`]). A vCPU thread is where the guest's MMIO, port I/O and
//! emulation assists reach host code, and what that code needs is small and known:
//! KVM's vCPU ioctls, writes to descriptors it holds (the console, eventfds), locks,
//! signals (the kick that stops it), memory for the allocator, and its own end. Any
//! other call (opening a file, a socket, another process's memory, a new thread or
//! process) kills the supervisor.
//!
//! Each vCPU thread applies it to itself before it serves its next exit
//! ([`cube_vmm::vcpu_confinement`]), after the process-wide filters are in place.
//!
//! The list was taken from `strace -f` of the VM tests (the test guest's and the Linux
//! guest's whole lifecycles, agent exec and files, and networking), by the calls of
//! the threads named `vcpuN`, and is checked by the VM tests, which run under it.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

use super::syscall_filter::SyscallFilterError;

use super::syscall_filter::{listed as allowed, ListedCall};

/// The calls a vCPU thread may make (`ioctl` only with the requests of
/// [`cube_vmm::vcpu_confinement::vcpu_ioctls`]).
pub const VCPU_ALLOWED: &[ListedCall] = &[
    allowed("ioctl", libc::SYS_ioctl, "KVM's vCPU ioctls only"),
    allowed("read", libc::SYS_read, "eventfds"),
    allowed("write", libc::SYS_write, "the console, eventfds, its log"),
    allowed("futex", libc::SYS_futex, "locks and condition variables"),
    allowed("sched_yield", libc::SYS_sched_yield, "spinning locks"),
    allowed(
        "rt_sigreturn",
        libc::SYS_rt_sigreturn,
        "the kick signal's return",
    ),
    allowed("rt_sigprocmask", libc::SYS_rt_sigprocmask, "signal masks"),
    allowed(
        "sigaltstack",
        libc::SYS_sigaltstack,
        "its signal stack, at its end",
    ),
    allowed("mmap", libc::SYS_mmap, "the allocator"),
    allowed(
        "munmap",
        libc::SYS_munmap,
        "the allocator, its stack at its end",
    ),
    allowed("mprotect", libc::SYS_mprotect, "the allocator's arenas"),
    allowed(
        "madvise",
        libc::SYS_madvise,
        "the allocator, its stack at its end",
    ),
    allowed("mremap", libc::SYS_mremap, "the allocator"),
    allowed("brk", libc::SYS_brk, "the allocator"),
    allowed("getrandom", libc::SYS_getrandom, "hash seeds"),
    allowed(
        "clock_gettime",
        libc::SYS_clock_gettime,
        "timestamps without the vDSO",
    ),
    allowed("gettid", libc::SYS_gettid, "log lines"),
    allowed("getpid", libc::SYS_getpid, "log lines"),
    allowed("exit", libc::SYS_exit, "its end"),
    allowed("exit_group", libc::SYS_exit_group, "the process's end"),
];

/// The vCPU threads' allow list as a BPF program; any call outside it kills the
/// process.
pub fn build() -> Result<BpfProgram, SyscallFilterError> {
    if std::env::consts::ARCH != "x86_64" {
        return Err(SyscallFilterError::UnsupportedArch);
    }
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = VCPU_ALLOWED
        .iter()
        .filter(|a| a.nr != libc::SYS_ioctl)
        .map(|a| (a.nr, Vec::new()))
        .collect();
    // The request is an unsigned int in the kernel: compare the low 32 bits.
    let ioctls = cube_vmm::vcpu_confinement::vcpu_ioctls()
        .into_iter()
        .map(|(_, request)| {
            SeccompCondition::new(1, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, request)
                .and_then(|c| SeccompRule::new(vec![c]))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(SyscallFilterError::Build)?;
    rules.insert(libc::SYS_ioctl, ioctls);
    SeccompFilter::new(
        rules,
        SeccompAction::KillProcess,
        SeccompAction::Allow,
        TargetArch::x86_64,
    )
    .and_then(TryInto::try_into)
    .map_err(SyscallFilterError::Build)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_list_builds_and_names_each_call_once() {
        let program = build().unwrap();
        assert!(!program.is_empty());
        let mut nrs: Vec<_> = VCPU_ALLOWED.iter().map(|a| a.nr).collect();
        nrs.sort();
        nrs.dedup();
        assert_eq!(nrs.len(), VCPU_ALLOWED.len());
        for forbidden in [
            libc::SYS_openat,
            libc::SYS_socket,
            libc::SYS_clone,
            libc::SYS_execve,
        ] {
            assert!(VCPU_ALLOWED.iter().all(|a| a.nr != forbidden));
        }
    }
}
