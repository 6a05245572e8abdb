//! Seccomp allow lists per kind of thread, in the manner of Firecracker's per-thread
//! filters, on top of the VM supervisor's process-wide deny list
//! ([`super::syscall_filter`]), for the threads where the guest reaches host code:
//!
//! - a vCPU thread serves the guest's MMIO, port I/O and emulation assists: KVM's vCPU
//!   ioctls, writes to descriptors it holds (the console, eventfds), locks, signals
//!   (the kick that stops it), memory for the allocator, and its end;
//! - the device event loop serves the virtio queues and the devices' host sides: the
//!   disk (positioned reads and writes, flushes), the TAP and eventfds, the vsock
//!   device's unix streams (accepting, and connecting for a guest's connection, unix
//!   sockets only), epoll, `getrandom` for the entropy device.
//!
//! Any other call (opening a file, a socket of another family, another process's
//! memory, a new thread or process) kills the supervisor. Each thread applies its
//! list to itself before it serves the guest again
//! ([`cube_devices::thread_confinement`]), after the process-wide filters are in place.
//!
//! The lists were taken from `strace -f` of the VM tests (the test guest's and the
//! Linux guest's whole lifecycles, agent exec and files, networking), by the calls of
//! the threads named `vcpuN` and `cube-devices`, plus the calls of the same family
//! the code can make on paths those tests did not take (vectored I/O, a guest's vsock
//! connection); the VM tests run under them. `scripts/trace-thread-calls.sh` traces
//! them again after a change to the VMM or its devices.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

use super::syscall_filter::SyscallFilterError;

use cube_devices::thread_confinement::ThreadKind;

use super::syscall_filter::{listed as allowed, ListedCall};

/// What every thread that serves the guest may do besides its own work: read and
/// write what it holds (eventfds, the console, the TAP, its log), locks, signals, the
/// allocator's memory, random bytes (hash seeds, the entropy device), time and its
/// end.
pub const THREAD_BASICS: &[ListedCall] = &[
    allowed("read", libc::SYS_read, "eventfds, the TAP"),
    allowed(
        "write",
        libc::SYS_write,
        "the console, eventfds, the TAP, its log",
    ),
    allowed("futex", libc::SYS_futex, "locks and condition variables"),
    allowed("sched_yield", libc::SYS_sched_yield, "spinning locks"),
    allowed(
        "rt_sigreturn",
        libc::SYS_rt_sigreturn,
        "signal returns (the kick)",
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
    allowed(
        "getrandom",
        libc::SYS_getrandom,
        "hash seeds, the entropy device",
    ),
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

/// What a vCPU thread may make besides [`THREAD_BASICS`] (`ioctl` only with the
/// requests of [`cube_vmm::vcpu_ioctls::requests`]).
pub const VCPU_ALLOWED: &[ListedCall] =
    &[allowed("ioctl", libc::SYS_ioctl, "KVM's vCPU ioctls only")];

/// What the device event loop may make besides [`THREAD_BASICS`] (`socket` for unix
/// sockets only, `ioctl` only to make a stream non-blocking).
pub const DEVICE_LOOP_ALLOWED: &[ListedCall] = &[
    allowed("epoll_wait", libc::SYS_epoll_wait, "its wait"),
    allowed("epoll_pwait", libc::SYS_epoll_pwait, "its wait"),
    allowed("epoll_ctl", libc::SYS_epoll_ctl, "streams coming and going"),
    allowed("readv", libc::SYS_readv, "the TAP"),
    allowed("writev", libc::SYS_writev, "the TAP"),
    allowed("pread64", libc::SYS_pread64, "the disk"),
    allowed("pwrite64", libc::SYS_pwrite64, "the disk"),
    allowed("preadv", libc::SYS_preadv, "the disk"),
    allowed("pwritev", libc::SYS_pwritev, "the disk"),
    allowed("fdatasync", libc::SYS_fdatasync, "the disk's flush"),
    allowed("fsync", libc::SYS_fsync, "the disk's flush"),
    allowed(
        "accept4",
        libc::SYS_accept4,
        "host connections to the guest",
    ),
    allowed(
        "socket",
        libc::SYS_socket,
        "a guest's connection (unix only)",
    ),
    allowed("connect", libc::SYS_connect, "a guest's connection"),
    allowed("sendto", libc::SYS_sendto, "vsock streams"),
    allowed("recvfrom", libc::SYS_recvfrom, "vsock streams"),
    allowed("sendmsg", libc::SYS_sendmsg, "vsock streams"),
    allowed("recvmsg", libc::SYS_recvmsg, "vsock streams"),
    allowed("shutdown", libc::SYS_shutdown, "vsock streams"),
    allowed("ioctl", libc::SYS_ioctl, "FIONBIO only"),
    allowed("fcntl", libc::SYS_fcntl, "descriptor flags"),
    allowed("close", libc::SYS_close, "streams that ended"),
];

/// The whole allow list of a kind of thread: [`THREAD_BASICS`] and its own.
pub fn allowed_for(kind: ThreadKind) -> Vec<ListedCall> {
    let own = match kind {
        ThreadKind::Vcpu => VCPU_ALLOWED,
        ThreadKind::DeviceLoop => DEVICE_LOOP_ALLOWED,
    };
    THREAD_BASICS.iter().chain(own).copied().collect()
}

/// The allow list of threads of `kind` as a BPF program; any call outside it kills
/// the process.
pub fn build(kind: ThreadKind) -> Result<BpfProgram, SyscallFilterError> {
    if std::env::consts::ARCH != "x86_64" {
        return Err(SyscallFilterError::UnsupportedArch);
    }
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = allowed_for(kind)
        .into_iter()
        .map(|a| (a.nr, Vec::new()))
        .collect();
    // Arguments an allowed call is limited to (ioctl's request is an unsigned int in
    // the kernel, a socket's domain an int: the low 32 bits are compared).
    let limited: Vec<(i64, u8, Vec<u64>)> = match kind {
        ThreadKind::Vcpu => vec![(
            libc::SYS_ioctl,
            1,
            cube_vmm::vcpu_ioctls::requests()
                .into_iter()
                .map(|(_, request)| request)
                .collect(),
        )],
        ThreadKind::DeviceLoop => vec![
            (libc::SYS_ioctl, 1, vec![libc::FIONBIO]),
            (libc::SYS_socket, 0, vec![libc::AF_UNIX as u64]),
        ],
    };
    for (nr, arg, values) in limited {
        let conditions = values
            .into_iter()
            .map(|value| {
                SeccompCondition::new(arg, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, value)
                    .and_then(|c| SeccompRule::new(vec![c]))
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(SyscallFilterError::Build)?;
        rules.insert(nr, conditions);
    }
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
    fn each_list_builds_and_names_each_call_once() {
        for kind in [ThreadKind::Vcpu, ThreadKind::DeviceLoop] {
            let program = build(kind).unwrap();
            assert!(!program.is_empty());
            let list = allowed_for(kind);
            let mut nrs: Vec<_> = list.iter().map(|a| a.nr).collect();
            nrs.sort();
            nrs.dedup();
            assert_eq!(nrs.len(), list.len(), "{kind:?}");
            for forbidden in [
                libc::SYS_openat,
                libc::SYS_clone,
                libc::SYS_execve,
                libc::SYS_bind,
            ] {
                assert!(list.iter().all(|a| a.nr != forbidden), "{kind:?}");
            }
        }
        assert!(allowed_for(ThreadKind::Vcpu)
            .iter()
            .all(|a| a.nr != libc::SYS_socket));
    }
}
