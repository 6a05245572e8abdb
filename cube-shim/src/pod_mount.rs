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
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;

use nix::errno::Errno;

use crate::detached_tree::{DetachedTree, TreeError};
use crate::mount_helper::{check, join, open_namespace, HelperError};

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
    /// The mount helper failed.
    #[error("Showing the container's root")]
    Helper(#[from] HelperError),
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
        crate::mount_helper::run(&STEPS, || {
            attach_in_child(ns.as_raw_fd(), tree.as_raw_fd(), &paths)
        })?;
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
            Err(e) => return Err(e.into()),
        };
        let paths = Paths::new(&self.inner)?;
        Ok(crate::mount_helper::run(&STEPS, || {
            detach_in_child(ns.as_raw_fd(), &paths)
        })?)
    }
}

impl Drop for PodMount {
    fn drop(&mut self) {
        if let Err(e) = self.detach() {
            log::warn!("taking {} out of the pod's sandbox: {e}", self.inner);
        }
    }
}

/// Where container `id`'s root goes in its pod's sandbox (jail or guest); refused for
/// an id that cannot name one directory.
pub fn inner_path(id: &str) -> Result<String, PodMountError> {
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
    join(0, ns)?;
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
    join(0, ns)?;
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
