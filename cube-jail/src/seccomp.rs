//! The seccomp filter of sandbox processes: a deny list of system calls a sandbox never
//! needs, each answered with EPERM, built with `seccompiler` in the parent and installed
//! in the child just before `execve`.
//!
//! A deny list (not an allow list) keeps arbitrary user programs working; what it refuses
//! is kernel attack surface and host-global state: modules, kexec, BPF, perf, keyrings,
//! the clock, swap, reboot, new mounts and namespaces, ptrace and reading or taking
//! another process's memory or descriptors, userfaultfd, io_uring and AIO, LDT entries,
//! secret memory, pushing input into a terminal (TIOCSTI, TIOCLINUX), and personas
//! other than plain Linux (which could turn off ASLR).
//! Sockets are limited to the families a sandbox needs ([`ALLOWED_FAMILIES`]: unix,
//! IPv4, IPv6, and netlink's routing protocol for `ip`); every other family (vsock,
//! whose port space is host-wide; packet; the kernel crypto API; other netlink
//! protocols...) is refused with EAFNOSUPPORT, as on a kernel without it, so programs
//! fall back. IPv4 and IPv6 stay allowed without a network: the sandbox's own network
//! namespace then has loopback only, which reaches nothing outside it.
//! x32-ABI numbers (which would alias the x86-64 calls past a deny list) are refused
//! with ENOSYS, and so is `clone3`, whose flags live in memory a filter cannot read, so
//! that libc falls back to `clone`, whose namespace flags the filter does check.

use std::collections::BTreeMap;

mod bpf;
#[cfg(test)]
mod bpf_interpreter;
pub mod fast_allow;

use bpf::{jump, stmt, JGE, LD_ABS, NR_OFFSET, RET};
use nix::errno::Errno;
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};

/// Errors from building the filter.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    /// seccompiler rejected the rules.
    #[error("cannot build the seccomp filter")]
    Build(#[source] seccompiler::BackendError),
    /// This CPU architecture is not supported by the filter.
    #[error("seccomp filters are built for x86-64 only")]
    UnsupportedArch,
    /// The deny list's fast path could not be built.
    #[error("cannot build the seccomp filter's fast path")]
    FastAllow(#[from] fast_allow::FastAllowError),
}

/// System calls refused with EPERM, with the reason they are refused.
pub const DENIED: &[(&str, libc::c_long, &str)] = &[
    ("init_module", libc::SYS_init_module, "kernel modules"),
    ("finit_module", libc::SYS_finit_module, "kernel modules"),
    ("delete_module", libc::SYS_delete_module, "kernel modules"),
    ("kexec_load", libc::SYS_kexec_load, "replaces the kernel"),
    (
        "kexec_file_load",
        libc::SYS_kexec_file_load,
        "replaces the kernel",
    ),
    ("bpf", libc::SYS_bpf, "kernel attack surface"),
    (
        "perf_event_open",
        libc::SYS_perf_event_open,
        "kernel attack surface, side channels",
    ),
    ("add_key", libc::SYS_add_key, "keyrings are not namespaced"),
    (
        "request_key",
        libc::SYS_request_key,
        "keyrings are not namespaced",
    ),
    ("keyctl", libc::SYS_keyctl, "keyrings are not namespaced"),
    ("reboot", libc::SYS_reboot, "host-global"),
    ("swapon", libc::SYS_swapon, "host-global"),
    ("swapoff", libc::SYS_swapoff, "host-global"),
    (
        "clock_settime",
        libc::SYS_clock_settime,
        "the clock is host-global",
    ),
    (
        "clock_adjtime",
        libc::SYS_clock_adjtime,
        "the clock is host-global",
    ),
    (
        "settimeofday",
        libc::SYS_settimeofday,
        "the clock is host-global",
    ),
    ("adjtimex", libc::SYS_adjtimex, "the clock is host-global"),
    ("mount", libc::SYS_mount, "no new mounts after set-up"),
    ("umount2", libc::SYS_umount2, "no new mounts after set-up"),
    (
        "pivot_root",
        libc::SYS_pivot_root,
        "no new mounts after set-up",
    ),
    ("chroot", libc::SYS_chroot, "no new mounts after set-up"),
    (
        "open_tree",
        libc::SYS_open_tree,
        "no new mounts after set-up",
    ),
    (
        "move_mount",
        libc::SYS_move_mount,
        "no new mounts after set-up",
    ),
    ("fsopen", libc::SYS_fsopen, "no new mounts after set-up"),
    ("fsconfig", libc::SYS_fsconfig, "no new mounts after set-up"),
    ("fsmount", libc::SYS_fsmount, "no new mounts after set-up"),
    ("fspick", libc::SYS_fspick, "no new mounts after set-up"),
    (
        "mount_setattr",
        libc::SYS_mount_setattr,
        "no new mounts after set-up",
    ),
    (
        "unshare",
        libc::SYS_unshare,
        "no new namespaces (user namespaces widen the attack surface)",
    ),
    ("setns", libc::SYS_setns, "no joining other namespaces"),
    (
        "open_by_handle_at",
        libc::SYS_open_by_handle_at,
        "bypasses the mount tree",
    ),
    (
        "name_to_handle_at",
        libc::SYS_name_to_handle_at,
        "file handles leak host inode identity",
    ),
    (
        "ptrace",
        libc::SYS_ptrace,
        "kernel attack surface; seccomp bypass on old kernels",
    ),
    (
        "process_vm_writev",
        libc::SYS_process_vm_writev,
        "pairs with ptrace",
    ),
    (
        "process_vm_readv",
        libc::SYS_process_vm_readv,
        "reads another process's memory (the agent's)",
    ),
    (
        "pidfd_getfd",
        libc::SYS_pidfd_getfd,
        "takes another process's descriptors (the agent's host streams)",
    ),
    (
        "modify_ldt",
        libc::SYS_modify_ldt,
        "16-bit segments: kernel attack surface",
    ),
    (
        "memfd_secret",
        libc::SYS_memfd_secret,
        "memory hidden from the kernel's own checks",
    ),
    ("io_setup", libc::SYS_io_setup, "AIO: kernel attack surface"),
    (
        "io_submit",
        libc::SYS_io_submit,
        "AIO: kernel attack surface",
    ),
    (
        "userfaultfd",
        libc::SYS_userfaultfd,
        "widens kernel race windows",
    ),
    (
        "io_uring_setup",
        libc::SYS_io_uring_setup,
        "bypasses seccomp, large attack surface",
    ),
    (
        "io_uring_enter",
        libc::SYS_io_uring_enter,
        "bypasses seccomp, large attack surface",
    ),
    (
        "io_uring_register",
        libc::SYS_io_uring_register,
        "bypasses seccomp, large attack surface",
    ),
    ("iopl", libc::SYS_iopl, "raw hardware access"),
    ("ioperm", libc::SYS_ioperm, "raw hardware access"),
    ("acct", libc::SYS_acct, "host-global"),
    ("quotactl", libc::SYS_quotactl, "host-global"),
    (
        "syslog",
        libc::SYS_syslog,
        "kernel log leaks host addresses",
    ),
    ("vhangup", libc::SYS_vhangup, "host terminals"),
    (
        "lookup_dcookie",
        libc::SYS_lookup_dcookie,
        "kernel profiling",
    ),
    (
        "fanotify_init",
        libc::SYS_fanotify_init,
        "host-wide file events",
    ),
    ("kcmp", libc::SYS_kcmp, "kernel pointer ordering leaks"),
    ("uselib", libc::SYS_uselib, "obsolete"),
    (
        "sethostname",
        libc::SYS_sethostname,
        "hostname is fixed at set-up",
    ),
    (
        "setdomainname",
        libc::SYS_setdomainname,
        "hostname is fixed at set-up",
    ),
];

/// Namespace flags whose use in `clone` is refused.
const NAMESPACE_FLAGS: &[u64] = &[
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWNET as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWCGROUP as u64,
];

/// Socket families a sandbox may create: unix, IPv4, IPv6 and netlink (whose protocol
/// must be [`libc::NETLINK_ROUTE`]); the rest are refused with EAFNOSUPPORT.
pub const ALLOWED_FAMILIES: &[libc::c_int] = &[
    libc::AF_UNIX,
    libc::AF_INET,
    libc::AF_INET6,
    libc::AF_NETLINK,
];

/// Terminal ioctls refused: TIOCSTI pushes bytes into a terminal's input as if typed,
/// TIOCLINUX does the same (and more) on a virtual console.
const DENIED_IOCTLS: &[u64] = &[libc::TIOCSTI, libc::TIOCLINUX];

/// `personality(0xffffffff)` reads the persona without changing it.
const PERSONALITY_QUERY: u64 = 0xffff_ffff;

/// First system call number of the x32 ABI.
const X32_SYSCALL_BIT: u32 = 0x4000_0000;

/// Compiled filters, ready to install in a child process without allocating.
#[derive(Debug)]
pub struct SeccompProgram {
    filters: Vec<Vec<libc::sock_filter>>,
}

impl SeccompProgram {
    /// Builds the sandbox filters.
    pub fn build() -> Result<Self, SeccompError> {
        Self::build_allowing(&[])
    }

    /// Builds the sandbox filters with the calls of [`DENIED`] numbered in `allowed`
    /// let through (a pod sandbox's agent needs `chroot`, see
    /// [`crate::JailConfig::pid1_may_chroot`]).
    pub fn build_allowing(allowed: &[libc::c_long]) -> Result<Self, SeccompError> {
        let arch = TargetArch::x86_64;
        if std::env::consts::ARCH != "x86_64" {
            return Err(SeccompError::UnsupportedArch);
        }
        let (deny, listed) = deny_list_program(allowed, arch)?;
        let families = family_filter(arch)?;
        let clone3 = clone3_unsupported(arch).map_err(SeccompError::Build)?;

        // Unlisted calls are let through first: the kernel emulates the filter for
        // every call number when it is attached (see `fast_allow`).
        let deny = fast_allow::allow_unlisted_first(&deny, &listed)?;
        // x32 numbers alias x86-64 system calls with the 0x40000000 bit set; a deny list
        // must refuse the whole range.
        let x32_guard = guard_x32(&deny, libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32);
        Ok(SeccompProgram {
            filters: vec![
                x32_guard.iter().map(convert).collect(),
                clone3.iter().map(convert).collect(),
                families.iter().map(convert).collect(),
            ],
        })
    }

    /// Total number of BPF instructions.
    pub fn len(&self) -> usize {
        self.filters.iter().map(Vec::len).sum()
    }

    /// Whether the program has no instructions (never true for a built program).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Installs the filters into the calling thread. no_new_privs must be set already.
    /// Async-signal-safe: raw system calls over memory prepared by [`Self::build`].
    pub fn install_in_child(&self) -> Result<(), Errno> {
        for filter in &self.filters {
            let prog = libc::sock_fprog {
                len: filter.len() as libc::c_ushort,
                filter: filter.as_ptr() as *mut libc::sock_filter,
            };
            // SAFETY: `prog` points at `filter`, which lives as long as `self`; the kernel
            // copies the program during the call and does not write through the pointer.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_seccomp,
                    libc::SECCOMP_SET_MODE_FILTER,
                    0,
                    &prog as *const libc::sock_fprog,
                )
            };
            if r != 0 {
                return Err(Errno::last());
            }
        }
        Ok(())
    }
}

/// The deny list compiled by seccompiler (EPERM for [`DENIED`] but `allowed`, and for
/// `clone`, `personality` and `ioctl` with the arguments refused), and the numbers it
/// has rules for.
fn deny_list_program(
    allowed: &[libc::c_long],
    arch: TargetArch,
) -> Result<(BpfProgram, Vec<i64>), SeccompError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = DENIED
        .iter()
        .filter(|(_, nr, _)| !allowed.contains(nr))
        .map(|(_, nr, _)| (*nr, Vec::new()))
        .collect();
    let clone_rules = NAMESPACE_FLAGS
        .iter()
        .map(|flag| {
            let cond = SeccompCondition::new(
                0,
                SeccompCmpArgLen::Qword,
                SeccompCmpOp::MaskedEq(*flag),
                *flag,
            )?;
            SeccompRule::new(vec![cond])
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(SeccompError::Build)?;
    rules.insert(libc::SYS_clone, clone_rules);
    // personality may only query (0xffffffff) or set plain PER_LINUX: other
    // personas can disable ASLR or map page zero.
    let personality = [PERSONALITY_QUERY, 0]
        .into_iter()
        .map(|v| SeccompCondition::new(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Ne, v))
        .collect::<Result<Vec<_>, _>>()
        .and_then(SeccompRule::new)
        .map_err(SeccompError::Build)?;
    rules.insert(libc::SYS_personality, vec![personality]);
    // The request is an `unsigned int` to the kernel: only its low 32 bits count,
    // so only they are compared (high bits set cannot slip past).
    let ioctls = DENIED_IOCTLS
        .iter()
        .map(|req| {
            SeccompCondition::new(1, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, *req)
                .and_then(|c| SeccompRule::new(vec![c]))
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(SeccompError::Build)?;
    rules.insert(libc::SYS_ioctl, ioctls);
    let listed: Vec<i64> = rules.keys().copied().collect();
    let deny: BpfProgram = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EPERM as u32),
        arch,
    )
    .and_then(TryInto::try_into)
    .map_err(SeccompError::Build)?;
    Ok((deny, listed))
}

/// The socket filter: `socket` of a family outside [`ALLOWED_FAMILIES`], or of netlink
/// with a protocol other than routing, and `socketpair` of anything but unix, fail with
/// EAFNOSUPPORT. The family and protocol are ints: their low 32 bits are compared.
fn family_filter(arch: TargetArch) -> Result<BpfProgram, SeccompError> {
    let dword = |arg: u8, op: SeccompCmpOp, value: libc::c_int| {
        SeccompCondition::new(arg, SeccompCmpArgLen::Dword, op, value as u32 as u64)
    };
    let build = || -> Result<BpfProgram, seccompiler::BackendError> {
        let other_family = ALLOWED_FAMILIES
            .iter()
            .map(|f| dword(0, SeccompCmpOp::Ne, *f))
            .collect::<Result<Vec<_>, _>>()
            .and_then(SeccompRule::new)?;
        let other_netlink = SeccompRule::new(vec![
            dword(0, SeccompCmpOp::Eq, libc::AF_NETLINK)?,
            dword(2, SeccompCmpOp::Ne, libc::NETLINK_ROUTE)?,
        ])?;
        let pair_not_unix = SeccompRule::new(vec![dword(0, SeccompCmpOp::Ne, libc::AF_UNIX)?])?;
        SeccompFilter::new(
            [
                (libc::SYS_socket, vec![other_family, other_netlink]),
                (libc::SYS_socketpair, vec![pair_not_unix]),
            ]
            .into_iter()
            .collect(),
            SeccompAction::Allow,
            SeccompAction::Errno(libc::EAFNOSUPPORT as u32),
            arch,
        )?
        .try_into()
    };
    build().map_err(SeccompError::Build)
}

/// A program that answers `clone3` with ENOSYS, as a kernel without it would: libc then
/// starts threads and processes with `clone`, whose flags a filter can read (`clone3`
/// keeps them in memory a filter cannot see).
pub fn clone3_unsupported(arch: TargetArch) -> Result<BpfProgram, seccompiler::BackendError> {
    SeccompFilter::new(
        [(libc::SYS_clone3, Vec::new())].into_iter().collect(),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
        arch,
    )
    .and_then(TryInto::try_into)
}

/// `program` behind a prefix that returns `action` (a `SECCOMP_RET_*` value) for every
/// x32-ABI system call number (0x40000000 and up). x32 numbers alias the x86-64 calls
/// with that bit set, so a deny list alone would let them past; the prefix loads the
/// number and decides before `program` runs (its jumps are relative, so prepending is
/// safe).
pub fn guard_x32(program: &BpfProgram, action: u32) -> BpfProgram {
    let mut guarded = vec![
        stmt(LD_ABS, NR_OFFSET),
        jump(JGE, X32_SYSCALL_BIT, 0, 1),
        stmt(RET, action),
    ];
    guarded.extend_from_slice(program);
    guarded
}

fn convert(i: &seccompiler::sock_filter) -> libc::sock_filter {
    libc::sock_filter {
        code: i.code,
        jt: i.jt,
        jf: i.jf,
        k: i.k,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_a_program_covering_every_denied_call() {
        let p = SeccompProgram::build().unwrap();
        assert!(!p.is_empty());
        // Every deny-list number must appear as a comparison constant in the filter.
        for (name, nr, _) in DENIED {
            assert!(
                p.filters[0].iter().any(|i| i.k == *nr as u32),
                "{name} missing from the filter"
            );
        }
        assert!(p.filters[1].iter().any(|i| i.k == libc::SYS_clone3 as u32));
        for req in DENIED_IOCTLS {
            assert!(p.filters[0].iter().any(|i| u64::from(i.k) == *req));
        }
        for family in ALLOWED_FAMILIES {
            assert!(p.filters[2].iter().any(|i| i.k == *family as u32));
        }
    }

    #[test]
    fn the_fast_path_decides_every_call_as_the_deny_list_does() {
        use bpf_interpreter::{run, SeccompData};
        let arch = TargetArch::x86_64;
        let (plain, listed) = deny_list_program(&[], arch).unwrap();
        let fast = fast_allow::allow_unlisted_first(&plain, &listed).unwrap();
        // Arguments the rules look at: each namespace flag of clone, personalities,
        // the refused ioctls, and plain values.
        let mut first_args: Vec<u64> = vec![0, 1, u64::MAX, PERSONALITY_QUERY, 0x0040_0000];
        first_args.extend(NAMESPACE_FLAGS);
        first_args.push(NAMESPACE_FLAGS.iter().fold(0, |a, f| a | f));
        let mut second_args: Vec<u64> = vec![0, u64::MAX, libc::TCGETS];
        second_args.extend(DENIED_IOCTLS);
        second_args.extend(DENIED_IOCTLS.iter().map(|r| r | 0xffff_ffff_0000_0000));
        let mut allowed_at_once = 0;
        for audit_arch in [
            fast_allow::AUDIT_ARCH_X86_64,
            bpf_interpreter::AUDIT_ARCH_I386,
        ] {
            for nr in 0..1024 {
                for a0 in &first_args {
                    for a1 in &second_args {
                        let data = SeccompData::call(audit_arch, nr, [*a0, *a1, 0, 0, 0, 0]);
                        let (action, steps) = bpf_interpreter::run_counting(&fast, &data);
                        assert_eq!(
                            action,
                            run(&plain, &data),
                            "nr {nr} arch {audit_arch:#x} args {a0:#x} {a1:#x}"
                        );
                        if steps <= 20 {
                            allowed_at_once += 1;
                        }
                    }
                }
            }
        }
        assert!(allowed_at_once > 0, "the fast path never decided alone");
    }

    #[test]
    fn deny_list_has_no_duplicates() {
        let mut nrs: Vec<_> = DENIED.iter().map(|d| d.1).collect();
        nrs.sort();
        nrs.dedup();
        assert_eq!(nrs.len(), DENIED.len());
    }
}
