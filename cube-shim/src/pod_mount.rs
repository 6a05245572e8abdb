//! A pod container's root filesystem shown inside its pod's sandbox: containerd's
//! snapshot, mounted on the host at the container's bundle, is cloned (with its
//! submounts) and moved into the sandbox's mount namespace at
//! `/.cube-containers/<id>`, with the sandbox's `/proc` and `/dev` bound into it; the
//! agent then runs the container's processes chrooted there
//! (`RequestBody::ExecInRoot`).
//!
//! The host side does the mounting (the sandbox cannot mount): a forked child joins
//! the sandbox's mount namespace, whose root is the sandbox's root, so every path it
//! resolves there stays inside the sandbox, whatever links the sandbox planted. The
//! clone is `nosuid,nodev`: an image's setuid files and devices mean nothing inside.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use nix::errno::Errno;

use crate::detached_tree::{DetachedTree, TreeError};

/// Where container roots go in a pod's sandbox.
pub const CONTAINERS_DIR: &str = "/.cube-containers";

/// Why a container's root could not be shown in (or taken out of) its pod's sandbox.
#[derive(Debug, thiserror::Error)]
pub enum PodMountError {
    /// The container id cannot name a directory.
    #[error("container id {0:?} cannot name a directory")]
    BadId(String),
    /// The host-side root could not be cloned.
    #[error("Cloning the container's root")]
    Tree(#[from] TreeError),
    /// The sandbox's mount namespace could not be opened (the sandbox ended).
    #[error("opening the mount namespace of the pod's sandbox (pid {0})")]
    Namespace(u32, #[source] std::io::Error),
    /// The helper process could not be forked or waited for.
    #[error("forking the mount helper")]
    Fork(#[source] Errno),
    /// A step inside the sandbox failed.
    #[error("{step} in the pod's sandbox")]
    InSandbox {
        /// What was being done.
        step: &'static str,
        /// Why.
        #[source]
        errno: Errno,
    },
}

/// The steps the helper takes, numbered for its report.
const STEPS: [&str; 7] = [
    "joining the mount namespace",
    "creating /.cube-containers",
    "creating the container's directory",
    "moving the root filesystem in",
    "binding /proc",
    "binding /dev",
    "unmounting the root filesystem",
];

/// A container's root inside its pod's sandbox; taken out on drop.
#[derive(Debug)]
pub struct PodMount {
    jail_pid: u32,
    inner: String,
    detached: bool,
}

/// Paths the helper uses, made before the fork (the child must not allocate).
struct Paths {
    parent: CString,
    inner: CString,
    proc_target: CString,
    dev_target: CString,
}

impl PodMount {
    /// Shows the host mount `host_root` (with its submounts) in the sandbox whose
    /// PID 1 is `jail_pid`, as the root of container `id`.
    pub fn attach(jail_pid: u32, host_root: &Path, id: &str) -> Result<PodMount, PodMountError> {
        let inner = inner_path(id)?;
        let paths = Paths::new(&inner)?;
        let tree = DetachedTree::clone_of(host_root, false)?;
        let ns = open_namespace(jail_pid)?;
        run_helper(|| attach_in_child(ns.as_raw_fd(), tree.as_raw_fd(), &paths))?;
        Ok(PodMount {
            jail_pid,
            inner,
            detached: false,
        })
    }

    /// The container's root as the sandbox sees it.
    pub fn inner(&self) -> &str {
        &self.inner
    }

    /// Unmounts the container's root inside the sandbox (idempotent; nothing to do
    /// once the sandbox ended, its mounts went with it).
    pub fn detach(&mut self) -> Result<(), PodMountError> {
        if self.detached {
            return Ok(());
        }
        self.detached = true;
        let ns = match open_namespace(self.jail_pid) {
            Ok(ns) => ns,
            Err(_) if !Path::new(&format!("/proc/{}", self.jail_pid)).exists() => return Ok(()),
            Err(e) => return Err(e),
        };
        let paths = Paths::new(&self.inner)?;
        run_helper(|| detach_in_child(ns.as_raw_fd(), &paths))
    }
}

impl Drop for PodMount {
    fn drop(&mut self) {
        if let Err(e) = self.detach() {
            log::warn!("taking {} out of the pod's sandbox: {e}", self.inner);
        }
    }
}

fn inner_path(id: &str) -> Result<String, PodMountError> {
    let usable = !id.is_empty()
        && id.len() <= 128
        && id != "."
        && id != ".."
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if !usable {
        return Err(PodMountError::BadId(id.to_string()));
    }
    Ok(format!("{CONTAINERS_DIR}/{id}"))
}

impl Paths {
    fn new(inner: &str) -> Result<Paths, PodMountError> {
        let c = |s: String| CString::new(s).map_err(|_| PodMountError::BadId(inner.to_string()));
        Ok(Paths {
            parent: c(CONTAINERS_DIR.to_string())?,
            inner: c(inner.to_string())?,
            proc_target: c(format!("{inner}/proc"))?,
            dev_target: c(format!("{inner}/dev"))?,
        })
    }
}

fn open_namespace(jail_pid: u32) -> Result<File, PodMountError> {
    File::open(format!("/proc/{jail_pid}/ns/mnt"))
        .map_err(|e| PodMountError::Namespace(jail_pid, e))
}

/// Forks a child that runs `step` (raw system calls only: the shim has threads) and
/// reports which step failed and why.
fn run_helper(step: impl Fn() -> Result<(), (usize, Errno)>) -> Result<(), PodMountError> {
    let mut pipe = [0 as RawFd; 2];
    // SAFETY: `pipe` has room for the two descriptors.
    if unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(PodMountError::Fork(Errno::last()));
    }
    // SAFETY: both descriptors are new and owned here.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(pipe[0]), OwnedFd::from_raw_fd(pipe[1])) };
    // SAFETY: the child only makes raw system calls over memory prepared before the
    // fork and ends with _exit; it neither allocates nor takes locks.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(PodMountError::Fork(Errno::last()));
    }
    if pid == 0 {
        // The record says how it went, success included: the shim reaps its children
        // on SIGCHLD (containerd-shim does), so the exit status may never reach us.
        let (record, code) = match step() {
            Ok(()) => ([-1i32, 0], 0),
            Err((index, errno)) => ([index as i32, errno as i32], 1),
        };
        // SAFETY: writes the 8 bytes of `record` to the pipe.
        unsafe { libc::write(write.as_raw_fd(), record.as_ptr().cast(), 8) };
        // SAFETY: ends the child without running the parent's exit handlers.
        unsafe { libc::_exit(code) };
    }
    drop(write);
    let mut record = [0i32; 2];
    let n = loop {
        // SAFETY: reads at most 8 bytes into `record`; returns once the child wrote
        // its record or ended (the pipe's only write end closes with it).
        let n = unsafe { libc::read(read.as_raw_fd(), record.as_mut_ptr().cast(), 8) };
        if n >= 0 || Errno::last() != Errno::EINTR {
            break n;
        }
    };
    let mut status = 0;
    // SAFETY: reaps the child forked above if nobody else did; `status` is live.
    // ECHILD (reaped elsewhere) is fine: the record carries the outcome.
    while unsafe { libc::waitpid(pid, &mut status, 0) } < 0 && Errno::last() == Errno::EINTR {}
    match (n, record) {
        (8, [-1, _]) => Ok(()),
        (8, [index, errno]) => Err(PodMountError::InSandbox {
            step: STEPS.get(index as usize).copied().unwrap_or("a step"),
            errno: Errno::from_raw(errno),
        }),
        _ => Err(PodMountError::InSandbox {
            step: "the mount helper, which ended without a word",
            errno: Errno::ECHILD,
        }),
    }
}

fn check(index: usize, rc: libc::c_int) -> Result<(), (usize, Errno)> {
    if rc == 0 {
        Ok(())
    } else {
        Err((index, Errno::last()))
    }
}

fn mkdir_existing_ok(
    index: usize,
    path: &CString,
    mode: libc::mode_t,
) -> Result<(), (usize, Errno)> {
    // SAFETY: live NUL-terminated string.
    if unsafe { libc::mkdir(path.as_ptr(), mode) } == 0 || Errno::last() == Errno::EEXIST {
        Ok(())
    } else {
        Err((index, Errno::last()))
    }
}

fn bind(index: usize, source: &std::ffi::CStr, target: &CString) -> Result<(), (usize, Errno)> {
    mkdir_existing_ok(index, target, 0o555)?;
    // SAFETY: live NUL-terminated strings; no data argument.
    check(index, unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            std::ptr::null(),
            libc::MS_BIND | libc::MS_REC,
            std::ptr::null(),
        )
    })
}

/// In the forked child: into the sandbox, then the tree in, then /proc and /dev.
fn attach_in_child(ns: RawFd, tree: RawFd, p: &Paths) -> Result<(), (usize, Errno)> {
    // SAFETY: integer arguments; after this the child's root is the sandbox's.
    check(0, unsafe { libc::setns(ns, libc::CLONE_NEWNS) })?;
    mkdir_existing_ok(1, &p.parent, 0o711)?;
    mkdir_existing_ok(2, &p.inner, 0o755)?;
    // SAFETY: the empty path with MOVE_MOUNT_F_EMPTY_PATH names the detached tree;
    // the target is a live NUL-terminated string.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_move_mount,
            tree,
            c"".as_ptr(),
            libc::AT_FDCWD,
            p.inner.as_ptr(),
            libc::MOVE_MOUNT_F_EMPTY_PATH,
        )
    };
    check(3, rc as libc::c_int)?;
    bind(4, c"/proc", &p.proc_target)?;
    bind(5, c"/dev", &p.dev_target)
}

/// In the forked child: into the sandbox, then the container's root out.
fn detach_in_child(ns: RawFd, p: &Paths) -> Result<(), (usize, Errno)> {
    // SAFETY: integer arguments.
    check(0, unsafe { libc::setns(ns, libc::CLONE_NEWNS) })?;
    // SAFETY: live NUL-terminated string.
    match unsafe { libc::umount2(p.inner.as_ptr(), libc::MNT_DETACH) } {
        0 => {}
        _ if Errno::last() == Errno::EINVAL || Errno::last() == Errno::ENOENT => {}
        _ => return Err((6, Errno::last())),
    }
    // SAFETY: live NUL-terminated string; an error leaves an empty directory behind.
    unsafe { libc::rmdir(p.inner.as_ptr()) };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn container_ids_name_one_directory() {
        assert_eq!(
            inner_path("abc-1_2.x").unwrap(),
            "/.cube-containers/abc-1_2.x"
        );
        for bad in ["", ".", "..", "a/b", "a\0b", &"x".repeat(129)] {
            assert!(inner_path(bad).is_err(), "{bad:?}");
        }
    }
}
