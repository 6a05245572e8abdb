//! Creating the sandbox's namespaces and configuring the ones that need it (UTS hostname,
//! loopback in the network namespace, cgroup namespace after the cgroup join).
//!
//! The sandbox process is made with a raw `clone3` system call (`CLONE_INTO_CGROUP`, so it
//! is born in its v2 cgroup; plain `clone` where `clone3` is refused) that creates the
//! mount, PID, network, IPC and UTS namespaces at once, so the child is PID 1 of its PID
//! namespace without a second fork. With a null stack pointer the call behaves like
//! `fork`: the child gets a copy-on-write copy of the calling thread only. Like after
//! `fork` in a multi-threaded program, the child may then only make async-signal-safe
//! calls until `execve`; see `jail.rs` for how that is kept.
//!
//! The cgroup namespace is created later, by `unshare`, once the child has joined the
//! sandbox cgroups, so that its cgroup root is the sandbox cgroup and not the host's.

use std::ffi::CString;
use std::os::fd::RawFd;

use nix::errno::Errno;

/// Errors from namespace creation in the parent.
#[derive(Debug, thiserror::Error)]
pub enum NamespaceError {
    /// The kernel refused to create the process with new namespaces.
    #[error("clone with new namespaces failed")]
    Clone(#[source] Errno),
    /// The hostname is empty, too long or holds a NUL.
    #[error("invalid hostname {0:?}")]
    InvalidHostname(String),
    /// A network namespace for a restore could not be made (unshare, loopback or
    /// opening it failed, or its thread could not start).
    #[error("cannot make a network namespace")]
    NetworkNamespace(#[source] std::io::Error),
}

/// A new network namespace with its loopback up, held by the returned descriptor: what
/// a jail's own namespace holds when it starts (Cube gives sandboxes no other device of
/// their own, and they cannot configure one), made for a restore to put a sandbox into.
/// It is made on a short-lived thread, so the caller's namespaces never change.
pub fn new_network_namespace() -> Result<std::os::fd::OwnedFd, NamespaceError> {
    let made = std::thread::Builder::new()
        .name("netns".into())
        .spawn(|| -> std::io::Result<std::os::fd::OwnedFd> {
            // Only this thread moves: network namespaces are per thread.
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)?;
            loopback_up_in_child()?;
            Ok(std::fs::File::open("/proc/thread-self/ns/net")?.into())
        })
        .map_err(NamespaceError::NetworkNamespace)?
        .join()
        .map_err(|_| {
            NamespaceError::NetworkNamespace(std::io::Error::other("its thread panicked"))
        })?;
    made.map_err(NamespaceError::NetworkNamespace)
}

/// Which namespaces a sandbox gets. All of them by default; network, IPC, UTS and cgroup
/// may be turned off (e.g. to diagnose), mount and PID may not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NamespaceSet {
    /// Own mount table.
    pub mount: bool,
    /// Own PID numbering; the sandbox's first process is PID 1.
    pub pid: bool,
    /// Own network stack with only a loopback device.
    pub net: bool,
    /// Own System V IPC and POSIX message queues.
    pub ipc: bool,
    /// Own hostname.
    pub uts: bool,
    /// Own view of the cgroup tree, rooted at the sandbox cgroup.
    pub cgroup: bool,
}

impl Default for NamespaceSet {
    fn default() -> Self {
        NamespaceSet {
            mount: true,
            pid: true,
            net: true,
            ipc: true,
            uts: true,
            cgroup: true,
        }
    }
}

impl NamespaceSet {
    /// Flags for the `clone` call (everything except the cgroup namespace).
    pub fn clone_flags(&self) -> libc::c_ulong {
        let mut flags = 0;
        for (on, flag) in [
            (self.mount, libc::CLONE_NEWNS),
            (self.pid, libc::CLONE_NEWPID),
            (self.net, libc::CLONE_NEWNET),
            (self.ipc, libc::CLONE_NEWIPC),
            (self.uts, libc::CLONE_NEWUTS),
        ] {
            if on {
                flags |= flag;
            }
        }
        flags as libc::c_ulong
    }
}

/// Validates a hostname and turns it into the bytes `sethostname` takes.
pub fn hostname_bytes(name: &str) -> Result<CString, NamespaceError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
    if !ok {
        return Err(NamespaceError::InvalidHostname(name.to_owned()));
    }
    CString::new(name).map_err(|_| NamespaceError::InvalidHostname(name.to_owned()))
}

/// Outcome of [`clone_into_namespaces`] in each of the two processes.
pub enum Cloned {
    /// In the parent: the child's host PID.
    Parent(libc::pid_t),
    /// In the child.
    Child,
}

/// `clone3` flag: the child starts in the cgroup `CloneArgs::cgroup` names (Linux 5.7).
const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

/// `struct clone_args` of `linux/sched.h`, up to `cgroup` (CLONE_ARGS_SIZE_VER2).
#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

/// Creates a child process in new namespaces, fork-style. With `cgroup` (an open v2
/// cgroup directory) the child is born in that cgroup through `clone3`'s
/// `CLONE_INTO_CGROUP`, which, unlike a later write to `cgroup.procs`, never takes the
/// write side of the kernel's global migration lock. The boolean says whether that
/// happened (in both processes): false without `cgroup`, or where the kernel (or a
/// seccomp filter around this process) has no `clone3`; the child must then join the
/// v2 cgroup itself.
///
/// # Safety
/// In a multi-threaded program the child may only make async-signal-safe calls (no
/// allocation, no locks) until it calls `execve` or `_exit`.
pub unsafe fn clone_into_namespaces(
    flags: libc::c_ulong,
    cgroup: Option<RawFd>,
) -> Result<(Cloned, bool), NamespaceError> {
    if let Some(fd) = cgroup {
        // `c_ulong` is narrower than u64 on 32-bit targets.
        #[allow(clippy::unnecessary_cast)]
        let args = CloneArgs {
            flags: flags as u64 | CLONE_INTO_CGROUP,
            exit_signal: libc::SIGCHLD as u64,
            cgroup: fd as u64,
            ..CloneArgs::default()
        };
        // SAFETY: `args` is a live, fully initialised clone_args of the size passed. A
        // zero stack and no CLONE_VM/CLONE_SETTLS duplicate the calling thread like
        // fork(); the pointer fields are zero and unused without their flags. The
        // caller upholds the child's async-signal-safety contract.
        let r = unsafe {
            libc::syscall(
                libc::SYS_clone3,
                &args as *const CloneArgs,
                std::mem::size_of::<CloneArgs>(),
            )
        };
        match r {
            -1 => match Errno::last() {
                Errno::ENOSYS | Errno::E2BIG => {}
                e => return Err(NamespaceError::Clone(e)),
            },
            0 => return Ok((Cloned::Child, true)),
            pid => return Ok((Cloned::Parent(pid as libc::pid_t), true)),
        }
    }
    // SAFETY: clone with a null stack and no CLONE_VM/CLONE_SETTLS duplicates the calling
    // thread like fork(); the null tid pointers are unused without the *_TID flags. The
    // caller upholds the child's async-signal-safety contract.
    let r = unsafe {
        libc::syscall(
            libc::SYS_clone,
            flags | libc::SIGCHLD as libc::c_ulong,
            0usize,
            0usize,
            0usize,
            0usize,
        )
    };
    match r {
        -1 => Err(NamespaceError::Clone(Errno::last())),
        0 => Ok((Cloned::Child, false)),
        pid => Ok((Cloned::Parent(pid as libc::pid_t), false)),
    }
}

/// Moves the calling process into a new cgroup namespace rooted at its current cgroups.
pub fn unshare_cgroup_in_child() -> Result<(), Errno> {
    // SAFETY: integer-only system call.
    if unsafe { libc::unshare(libc::CLONE_NEWCGROUP) } != 0 {
        return Err(Errno::last());
    }
    Ok(())
}

/// Sets the UTS hostname of the calling process's namespace.
pub fn set_hostname_in_child(name: &CString) -> Result<(), Errno> {
    let bytes = name.as_bytes();
    // SAFETY: pointer and length describe the live bytes of `name`.
    if unsafe { libc::sethostname(bytes.as_ptr().cast(), bytes.len()) } != 0 {
        return Err(Errno::last());
    }
    Ok(())
}

/// Layout of `struct ifreq` as far as SIOC[GS]IFFLAGS use it (40 bytes on Linux).
#[repr(C)]
struct IfreqFlags {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

/// Brings up `lo` in the calling process's network namespace; a fresh namespace has it
/// down.
pub fn loopback_up_in_child() -> Result<(), Errno> {
    // SAFETY: plain socket creation; the descriptor is closed below on every path.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(Errno::last());
    }
    let mut req = IfreqFlags {
        name: [0; libc::IFNAMSIZ],
        flags: 0,
        _pad: [0; 22],
    };
    req.name[..2].copy_from_slice(b"lo");
    // SAFETY: `req` is a correctly sized, live ifreq the kernel reads and writes.
    let mut r = unsafe { libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut req as *mut IfreqFlags) };
    if r == 0 {
        req.flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
        // SAFETY: as above.
        r = unsafe { libc::ioctl(fd, libc::SIOCSIFFLAGS, &mut req as *mut IfreqFlags) };
    }
    let err = Errno::last();
    // SAFETY: `fd` was opened above and is not used after this.
    unsafe { libc::close(fd) };
    if r != 0 {
        return Err(err);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validates_hostnames() {
        assert!(hostname_bytes("sandbox-1").is_ok());
        assert!(hostname_bytes("").is_err());
        assert!(hostname_bytes("a/b").is_err());
        assert!(hostname_bytes(&"x".repeat(65)).is_err());
    }

    #[test]
    fn default_set_has_every_namespace() {
        let f = NamespaceSet::default().clone_flags();
        for flag in [
            libc::CLONE_NEWNS,
            libc::CLONE_NEWPID,
            libc::CLONE_NEWNET,
            libc::CLONE_NEWIPC,
            libc::CLONE_NEWUTS,
        ] {
            assert_ne!(f & flag as libc::c_ulong, 0);
        }
        assert_eq!(f & libc::CLONE_NEWCGROUP as libc::c_ulong, 0);
    }

    #[test]
    fn a_new_network_namespace_is_not_ours() {
        // SAFETY: geteuid has no failure mode.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: network namespaces need root");
            return;
        }
        use std::os::unix::fs::MetadataExt;
        let fd = new_network_namespace().unwrap();
        let theirs = std::fs::metadata(format!(
            "/proc/self/fd/{}",
            std::os::fd::AsRawFd::as_raw_fd(&fd)
        ))
        .unwrap();
        let ours = std::fs::metadata("/proc/thread-self/ns/net").unwrap();
        assert_ne!(theirs.ino(), ours.ino());
        // Inside it, loopback is up.
        let flags = std::thread::scope(|s| {
            s.spawn(|| {
                nix::sched::setns(&fd, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
                // SAFETY: plain socket creation; closed below.
                let sock = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0) };
                assert!(sock >= 0);
                let mut req = IfreqFlags {
                    name: [0; libc::IFNAMSIZ],
                    flags: 0,
                    _pad: [0; 22],
                };
                req.name[..2].copy_from_slice(b"lo");
                // SAFETY: `req` is a live, correctly sized ifreq.
                let r =
                    unsafe { libc::ioctl(sock, libc::SIOCGIFFLAGS, &mut req as *mut IfreqFlags) };
                // SAFETY: `sock` is not used after this.
                unsafe { libc::close(sock) };
                assert_eq!(r, 0);
                req.flags
            })
            .join()
            .unwrap()
        });
        assert_ne!(flags & libc::IFF_UP as libc::c_short, 0, "loopback is up");
    }

    #[test]
    fn ifreq_has_the_kernel_size() {
        assert_eq!(std::mem::size_of::<IfreqFlags>(), 40);
    }
}
