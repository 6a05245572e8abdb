//! Confining a supervisor once its sandbox is set up, in the manner of Firecracker's
//! jailer: the supervisor starts as root (it opens KVM, builds jails, attaches
//! networks), and then gives up what its engine no longer needs, so that code that
//! takes it over (through a device model bug, a malformed snapshot, a crafted request)
//! holds little:
//!
//! - no_new_privs and capabilities dropped on every thread ([`all_threads`]): a VM
//!   supervisor keeps none, with a network or without (a networked
//!   VM's pool device is held by a process of its own, its network keeper, which
//!   keeps what changing and releasing that device needs: see
//!   [`crate::network_keeper`]); a jail supervisor keeps what building, snapshotting
//!   (CRIU) and restoring jails needs, without the host-altering ones;
//! - for a VM, a uid of its own instead of root's, on every thread ([`identity`]):
//!   it owns its sandbox's directory and what it writes there, and may remove from
//!   the store only what its uid owns;
//! - for a VM, seccomp filters on every thread ([`syscall_filter`]): a forbidden call
//!   kills this supervisor, and only it (each sandbox has its own); and on the
//!   threads where the guest reaches host code (its vCPU threads and its device
//!   event loop), an allow list per kind of thread ([`thread_filters`]). A jail
//!   supervisor gets none: CRIU, which it starts, must be under no filter (see
//!   there);
//! - for a VM, a core file limit of 0: a killed VMM leaves no copy of guest memory;
//! - for a VM, Landlock ([`filesystem`]): the host's files but its store's out of
//!   reach (a network keeper's: but its pool's lock file and pins).
//!
//! Left for later: an unprivileged uid for jail supervisors and network keepers (which
//! stay root: CRIU restores any uid, a keeper's pool pins are root's), Landlock for
//! jail supervisors (which mount, pin namespaces and run CRIU on host paths: a
//! Landlocked process may not mount at all), and allow lists for the VM supervisor's
//! host-facing threads (its clients, flushes, main thread).
//!
//! [`Profile::summary`] describes a profile for `cube doctor` and the docs; the
//! supervisor applies it with [`confine`] right after adopting its sandbox, before the
//! spawner hears the sandbox is ready.

pub mod all_threads;
pub mod filesystem;
pub mod identity;
pub mod syscall_filter;
pub mod thread_filters;

use std::os::fd::AsFd;
use std::path::Path;

use cube_devices::thread_confinement::{confine_threads, ThreadKind};
use serde::Serialize;

pub use all_threads::AllThreadsError;
pub use filesystem::FilesystemError;
pub use identity::IdentityError;
pub use syscall_filter::{FilterSet, SyscallFilterError};

/// Why a supervisor could not confine itself (the sandbox is then refused: it never
/// runs unconfined).
#[derive(Debug, thiserror::Error)]
pub enum ConfinementError {
    /// The kernel's capability count could not be read.
    #[error("reading the kernel's last capability")]
    LastCap(#[source] cube_jail::capabilities::CapabilityError),
    /// Capabilities or no_new_privs could not be set on every thread.
    #[error("dropping capabilities")]
    Capabilities(#[from] AllThreadsError),
    /// The seccomp filter could not be built or installed.
    #[error("seccomp")]
    Filter(#[from] SyscallFilterError),
    /// The Landlock ruleset could not be built.
    #[error("file-system confinement")]
    Filesystem(#[from] FilesystemError),
    /// The core file limit could not be lowered.
    #[error("setting the core file limit to 0")]
    CoreLimit(#[source] std::io::Error),
    /// A kind of thread's filter was handed to it before.
    #[error("confining the threads that serve the guest")]
    ThreadKind(#[from] cube_devices::thread_confinement::AlreadySet),
    /// The unprivileged identity could not be leased or its directory given to it.
    #[error("taking a uid of its own")]
    Identity(#[from] IdentityError),
}

/// What a supervisor holds, and so what it keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Profile {
    /// A VM supervisor (the test guest, or a Linux guest with a network or without).
    Vm,
    /// The network keeper of a Linux VM with a network device from the host's pool
    /// (see [`crate::network_keeper`]).
    NetworkKeeper,
    /// A jail.
    Jail,
}

/// Capability numbers (include/uapi/linux/capability.h) with their names.
const CAPABILITIES: &[(u32, &str)] = &[
    (0, "chown"),
    (1, "dac_override"),
    (2, "dac_read_search"),
    (3, "fowner"),
    (4, "fsetid"),
    (5, "kill"),
    (6, "setgid"),
    (7, "setuid"),
    (8, "setpcap"),
    (9, "linux_immutable"),
    (10, "net_bind_service"),
    (11, "net_broadcast"),
    (12, "net_admin"),
    (13, "net_raw"),
    (14, "ipc_lock"),
    (15, "ipc_owner"),
    (16, "sys_module"),
    (17, "sys_rawio"),
    (18, "sys_chroot"),
    (19, "sys_ptrace"),
    (20, "sys_pacct"),
    (21, "sys_admin"),
    (22, "sys_boot"),
    (23, "sys_nice"),
    (24, "sys_resource"),
    (25, "sys_time"),
    (26, "sys_tty_config"),
    (27, "mknod"),
    (28, "lease"),
    (29, "audit_write"),
    (30, "audit_control"),
    (31, "setfcap"),
    (32, "mac_override"),
    (33, "mac_admin"),
    (34, "syslog"),
    (35, "wake_alarm"),
    (36, "block_suspend"),
    (37, "audit_read"),
    (38, "perfmon"),
    (39, "bpf"),
    (40, "checkpoint_restore"),
];

/// What a VM supervisor keeps once it runs as a uid of its own: nothing. It reads no
/// snapshot or template where it lies: the library lends it the one it rolls back to
/// (see [`cube_storage::lent_snapshot`]), and the parent of its next diff stays open
/// from when it was staged.
const VM_KEEPS: &[&str] = &[];

/// What a VM supervisor keeps besides where a directory above its sandbox's lies
/// closed to its uid (a store in a private temporary directory, or under a home):
/// searching it, without which it could not reach its own directory by path. Where
/// the kernel has Landlock, what it may read with it stays what it reaches anyway.
const VM_KEEPS_UNDER_A_CLOSED_PATH: &[&str] = &["dac_read_search"];

/// What a network keeper keeps: the pool's netlink and eBPF work when it changes or
/// releases its device. (`sys_admin`, which entering namespaces takes, is not among
/// them: a keeper stays in the host's network namespace.)
const NETWORK_KEEPER_KEEPS: &[&str] = &["net_admin", "net_raw", "bpf", "perfmon"];

/// What a jail supervisor gives up: capabilities that change the host itself, which
/// neither jail set-up nor CRIU uses. (`sys_time` stays: CRIU's restore fails without
/// it, which the confinement test found.)
const JAIL_DROPS: &[&str] = &[
    "sys_module",
    "sys_rawio",
    "sys_boot",
    "sys_pacct",
    "sys_tty_config",
    "linux_immutable",
    "mac_override",
    "mac_admin",
    "syslog",
    "wake_alarm",
    "block_suspend",
];

/// Every capability up to `last_cap`.
fn all_up_to(last_cap: u32) -> u64 {
    if last_cap >= 63 {
        u64::MAX
    } else {
        (1u64 << (last_cap + 1)) - 1
    }
}

fn mask_of(names: &[&str]) -> u64 {
    CAPABILITIES
        .iter()
        .filter(|(_, name)| names.contains(name))
        .fold(0, |mask, (nr, _)| mask | 1 << nr)
}

fn names_of(mask: u64) -> Vec<&'static str> {
    CAPABILITIES
        .iter()
        .filter(|(nr, _)| mask & (1 << nr) != 0)
        .map(|(_, name)| *name)
        .collect()
}

/// A profile in words and lists, for `cube doctor --json` and the docs.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    /// The profile.
    pub profile: Profile,
    /// Capabilities kept (bounding, permitted and effective sets); all others dropped.
    pub capabilities_kept: Vec<&'static str>,
    /// Whether no_new_privs is set.
    pub no_new_privs: bool,
    /// System calls that kill the supervisor.
    pub syscalls_killed: Vec<&'static str>,
    /// The only system calls its vCPU threads may make (empty: no such list).
    pub vcpu_syscalls_allowed: Vec<&'static str>,
    /// The only system calls its device event loop may make (empty: no such list).
    pub device_loop_syscalls_allowed: Vec<&'static str>,
    /// What it may reach of the host's file system.
    pub filesystem: String,
    /// Whom it runs as.
    pub runs_as: String,
}

impl Profile {
    /// The capabilities kept (bit N = capability N) by a process that holds `held` (its
    /// permitted set: a host may withhold some even from root).
    pub fn kept(self, held: u64) -> u64 {
        match self {
            Profile::Vm => held & mask_of(VM_KEEPS),
            Profile::NetworkKeeper => held & mask_of(NETWORK_KEEPER_KEEPS),
            Profile::Jail => held & !mask_of(JAIL_DROPS),
        }
    }

    /// Its seccomp rule set (none for a jail: see [`syscall_filter`]).
    pub fn filters(self) -> Option<FilterSet> {
        match self {
            Profile::Vm => Some(FilterSet::Vm),
            Profile::NetworkKeeper => Some(FilterSet::NetworkKeeper),
            Profile::Jail => None,
        }
    }

    /// The kinds of thread with an allow list of their own under this profile.
    fn thread_kinds(self) -> &'static [ThreadKind] {
        match self {
            Profile::Vm => &[ThreadKind::Vcpu, ThreadKind::DeviceLoop],
            Profile::NetworkKeeper | Profile::Jail => &[],
        }
    }

    fn allow_list(self, kind: ThreadKind) -> Vec<&'static str> {
        if !self.thread_kinds().contains(&kind) {
            return Vec::new();
        }
        thread_filters::allowed_for(kind)
            .into_iter()
            .map(|a| a.name)
            .collect()
    }

    /// The profile in lists (capabilities by the names this kernel's numbers have).
    pub fn summary(self) -> Summary {
        let last_cap = cube_jail::capabilities::last_cap().unwrap_or(40);
        Summary {
            profile: self,
            capabilities_kept: names_of(self.kept(all_up_to(last_cap))),
            no_new_privs: true,
            syscalls_killed: self
                .filters()
                .map(|f| f.killed().iter().map(|k| k.name).collect())
                .unwrap_or_default(),
            vcpu_syscalls_allowed: self.allow_list(ThreadKind::Vcpu),
            device_loop_syscalls_allowed: self.allow_list(ThreadKind::DeviceLoop),
            filesystem: filesystem::describe(match self {
                Profile::Vm => filesystem::Reach::Vm,
                Profile::NetworkKeeper => filesystem::Reach::NetworkKeeper,
                Profile::Jail => filesystem::Reach::Jail,
            }),
            runs_as: match self {
                Profile::Vm => format!(
                    "a uid of its own, leased from {:#x}..{:#x} (root's where it was not \
                     started as root), gid {:#x}; where a directory above its store is \
                     closed to that uid it keeps dac_read_search to reach its own",
                    cube_jail::sandbox_uid::RANGE.start,
                    cube_jail::sandbox_uid::RANGE.end,
                    cube_storage::supervisor_group::SUPERVISOR_GID
                ),
                Profile::NetworkKeeper | Profile::Jail => {
                    "the uid it was started as (root)".to_string()
                }
            },
        }
    }
}

/// Gives up every capability (and sets no_new_privs) on this process's vCPU threads
/// while they are idle, with Landlock all file-system access, and root's uid for the
/// one this process's VM supervisor will run as ([`identity::vm_identity`]): a VM
/// built ahead in the pool runs guest code and device emulation on them, which need
/// none of it, and [`confine`] then need not interrupt them once they run a guest (the
/// wait for them was most of its cost). Returns how many.
pub fn confine_vcpu_threads() -> Result<usize, ConfinementError> {
    let last_cap = cube_jail::capabilities::last_cap().map_err(ConfinementError::LastCap)?;
    let rules = filesystem::no_files()?;
    let identity = identity::vm_identity()?;
    Ok(all_threads::restrict_threads_named(
        "vcpu",
        0,
        last_cap,
        rules.as_ref().map(AsFd::as_fd),
        identity,
    )?)
}

/// Confines this process, all its threads included, to `profile`: capabilities,
/// no_new_privs, (for a VM) a uid of its own and (for a VM or a network keeper)
/// Landlock first, then the seccomp filters if it has any. `sandbox_dir` is its
/// sandbox's directory: with the parts of its store [`filesystem::vm_rules`] names,
/// all of the host's file system a VM supervisor keeps (a network keeper:
/// [`filesystem::keeper_rules`]), and given to the VM supervisor's uid.
pub fn confine(profile: Profile, sandbox_dir: &Path) -> Result<(), ConfinementError> {
    let start = std::time::Instant::now();
    let last_cap = cube_jail::capabilities::last_cap().map_err(ConfinementError::LastCap)?;
    // Built before anything is dropped: building allocates and may read /proc.
    let programs = match profile.filters() {
        Some(set) => set.build()?,
        None => Vec::new(),
    };
    let thread_programs = profile
        .thread_kinds()
        .iter()
        .map(|kind| Ok((*kind, thread_filters::build(*kind)?)))
        .collect::<Result<Vec<_>, ConfinementError>>()?;
    let rules = match profile {
        Profile::Vm => filesystem::vm_rules(sandbox_dir)?,
        Profile::NetworkKeeper => {
            let pool = filesystem::PoolPaths::of_host_pool()?;
            filesystem::keeper_rules(sandbox_dir, &pool)?
        }
        Profile::Jail => None,
    };
    if profile != Profile::Jail {
        no_core_files()?;
    }
    let identity = match profile {
        Profile::Vm => identity::vm_identity()?,
        Profile::NetworkKeeper | Profile::Jail => None,
    };
    if let Some(id) = identity {
        identity::give_own_dir(sandbox_dir, id)?;
    }
    if profile == Profile::Vm {
        crate::flush::hold_store_areas(sandbox_dir);
    }
    let built = start.elapsed();
    let held = all_threads::held_capabilities()?;
    let mut kept = profile.kept(held);
    if let Some(id) = identity.filter(|id| !identity::reaches_by_path(sandbox_dir, *id)) {
        tracing::warn!(
            uid = id.uid,
            dir = %sandbox_dir.display(),
            "a directory above the sandbox's is closed to the supervisor's uid: it keeps dac_read_search"
        );
        kept |= held & mask_of(VM_KEEPS_UNDER_A_CLOSED_PATH);
    }
    all_threads::restrict_all_threads(kept, last_cap, rules.as_ref().map(AsFd::as_fd), identity)?;
    let dropped = start.elapsed();
    syscall_filter::install_on_all_threads(&programs)?;
    // After the process-wide filters: the kernel refuses those (TSYNC) while a thread
    // has a filter of its own.
    for (kind, program) in thread_programs {
        confine_threads(
            kind,
            Box::new(move || seccompiler::apply_filter(&program).map_err(|e| e.to_string())),
        )?;
    }
    tracing::debug!(?profile, ?built, ?dropped, total = ?start.elapsed(), "confined");
    Ok(())
}

/// A VM supervisor killed by its filter (or anything else) leaves no core file: it
/// would hold the guest's memory.
fn no_core_files() -> Result<(), ConfinementError> {
    let none = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `none` is a live rlimit the call only reads.
    if unsafe { libc::setrlimit(libc::RLIMIT_CORE, &none) } != 0 {
        return Err(ConfinementError::CoreLimit(std::io::Error::last_os_error()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_keep_what_they_say() {
        let all = all_up_to(40);
        assert_eq!(Profile::Vm.kept(all), 0, "a VM supervisor keeps nothing");
        assert_eq!(Profile::Vm.kept(0), 0);
        let keeper = Profile::NetworkKeeper.summary();
        assert!(keeper.capabilities_kept.contains(&"net_admin"));
        assert!(!keeper.capabilities_kept.contains(&"sys_ptrace"));
        let jail = Profile::Jail.kept(all);
        assert_eq!(jail & (1 << 16), 0, "a jail supervisor keeps sys_module");
        assert_ne!(jail & (1 << 21), 0, "a jail supervisor needs sys_admin");
        // Capabilities past the kernel's last, or withheld from this process, are never
        // asked for.
        assert_eq!(Profile::Jail.kept(all) >> 41, 0);
        let without_sys_resource = all & !(1 << 24);
        assert_eq!(Profile::Jail.kept(without_sys_resource) & (1 << 24), 0);
        assert_eq!(Profile::NetworkKeeper.kept(1 << 12), 1 << 12);
        assert_eq!(names_of(mask_of(JAIL_DROPS)).len(), JAIL_DROPS.len());
        assert_eq!(
            names_of(mask_of(NETWORK_KEEPER_KEEPS)).len(),
            NETWORK_KEEPER_KEEPS.len()
        );
    }
}
