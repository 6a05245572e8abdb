//! A detached copy of a mount tree (the new mount API: `open_tree` with
//! `OPEN_TREE_CLONE`, `mount_setattr`), to be moved somewhere with `move_mount`: how
//! the shim places a container's root filesystem in its pod's sandbox and the spec's
//! binds in that root, without resolving a path of the container's as a string.

use std::ffi::CString;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

use nix::errno::Errno;

/// Why a tree could not be cloned or moved.
#[derive(Debug, thiserror::Error)]
pub enum TreeError {
    /// The mount could not be cloned.
    #[error("cloning the mount at {0}")]
    Clone(PathBuf, #[source] Errno),
    /// The clone's attributes could not be set.
    #[error("making the clone of {0} nosuid,nodev{1}")]
    Attributes(PathBuf, &'static str, #[source] Errno),
    /// The clone could not be moved onto its target.
    #[error("moving the clone of {0} in place")]
    Move(PathBuf, #[source] Errno),
}

/// A detached mount tree, `nosuid,nodev` (and read-only where asked).
#[derive(Debug)]
pub struct DetachedTree {
    fd: OwnedFd,
    source: PathBuf,
}

impl DetachedTree {
    /// Clones the mount at `source` and every mount under it.
    pub fn clone_of(source: &Path, read_only: bool) -> Result<DetachedTree, TreeError> {
        let path = CString::new(source.as_os_str().as_encoded_bytes())
            .map_err(|_| TreeError::Clone(source.to_path_buf(), Errno::EINVAL))?;
        // SAFETY: `path` is a live NUL-terminated string; the new descriptor is owned
        // below.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_open_tree,
                libc::AT_FDCWD,
                path.as_ptr(),
                libc::OPEN_TREE_CLONE
                    | libc::OPEN_TREE_CLOEXEC
                    | libc::AT_RECURSIVE as libc::c_uint,
            )
        };
        if fd < 0 {
            return Err(TreeError::Clone(source.to_path_buf(), Errno::last()));
        }
        // SAFETY: open_tree returned a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
        let mut set = libc::MOUNT_ATTR_NOSUID | libc::MOUNT_ATTR_NODEV;
        if read_only {
            set |= libc::MOUNT_ATTR_RDONLY;
        }
        let attr = libc::mount_attr {
            attr_set: set,
            attr_clr: 0,
            propagation: 0,
            userns_fd: 0,
        };
        // SAFETY: the empty path with AT_EMPTY_PATH names the descriptor itself; `attr`
        // is live and its size is passed.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_mount_setattr,
                fd.as_raw_fd(),
                c"".as_ptr(),
                libc::AT_EMPTY_PATH | libc::AT_RECURSIVE,
                &attr as *const libc::mount_attr,
                std::mem::size_of::<libc::mount_attr>(),
            )
        };
        if rc != 0 {
            let how = if read_only { ",ro" } else { "" };
            return Err(TreeError::Attributes(
                source.to_path_buf(),
                how,
                Errno::last(),
            ));
        }
        Ok(DetachedTree {
            fd,
            source: source.to_path_buf(),
        })
    }

    /// The tree's descriptor (for a helper process that moves it itself).
    pub fn as_raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Mounts the tree on the file or directory `target` is open on (`O_PATH`).
    pub fn move_onto(self, target: BorrowedFd<'_>) -> Result<(), TreeError> {
        // SAFETY: both paths are empty and the flags say so: the descriptors name the
        // source tree and the target.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_move_mount,
                self.fd.as_raw_fd(),
                c"".as_ptr(),
                target.as_raw_fd(),
                c"".as_ptr(),
                libc::MOVE_MOUNT_F_EMPTY_PATH | libc::MOVE_MOUNT_T_EMPTY_PATH,
            )
        };
        if rc != 0 {
            return Err(TreeError::Move(self.source, Errno::last()));
        }
        Ok(())
    }
}
