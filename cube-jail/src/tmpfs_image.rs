//! A sandbox's tmpfs mounts (`/dev`, `/dev/shm`, `/tmp`) in a checkpoint, kept by Cube
//! instead of CRIU.
//!
//! CRIU saves a tmpfs by running `tar --create --gzip` on it (two processes) and
//! restores it with `tar --extract --gzip`: six processes per dump and six per
//! restore for a jail's three tmpfs mounts, 30-80 ms of each operation on the measured
//! hosts, and gzip's time on whatever `/tmp` holds. Here the dump marks each tmpfs as
//! an external mount (`--external mnt[<target>]:<target>`), so CRIU records the mount
//! and not its contents, and Cube copies the tree itself while the sandbox is frozen
//! (the same instant as the processes and the layer). A restore makes a fresh tmpfs
//! with the same options, detached (`fsopen`/`fsmount`: it never appears in the
//! host's mount table), fills it from the copy, and criu attaches it where CRIU binds
//! the external mount from.
//!
//! What the copy keeps is what CRIU's tar kept: regular files (sparse), directories,
//! symlinks, hard links, FIFOs and device nodes, with owners, permission bits and
//! times; sockets are left out (a restored process binds its socket again), and so
//! are extended attributes. Mounts inside a tmpfs (`/dev/pts`, `/dev/shm` in `/dev`)
//! stay empty directories: they are mounts of their own.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use cube_storage::reflink::{clone_tree_into, clone_tree_with, CloneError, TreeOptions};
use serde::{Deserialize, Serialize};

/// Errors from saving and restoring tmpfs contents.
#[derive(Debug, thiserror::Error)]
pub enum TmpfsError {
    /// The tmpfs seen through the sandbox's root is not the mount its mount table
    /// names (the path was changed under it).
    #[error("{0} is not the sandbox's tmpfs")]
    NotTheMount(PathBuf),
    /// Inspecting the mount failed.
    #[error("cannot inspect {path}")]
    Inspect {
        /// The path.
        path: PathBuf,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// Copying the tree failed.
    #[error("cannot copy the tmpfs at {target}")]
    Copy {
        /// The tmpfs's mount point in the sandbox.
        target: PathBuf,
        /// The error.
        #[source]
        source: CloneError,
    },
    /// The options do not make a tmpfs (or the kernel has no `fsopen`).
    #[error("cannot make a tmpfs with options {options:?}: {step}")]
    Mount {
        /// The options.
        options: String,
        /// The step that failed.
        step: &'static str,
        /// The error.
        #[source]
        source: io::Error,
    },
}

/// One tmpfs mount of a checkpointed sandbox, as the manifest records it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct TmpfsMount {
    /// Mount point inside the sandbox.
    pub target: PathBuf,
    /// The filesystem's options as the mount table shows them (`size=64k,mode=755`),
    /// without `rw`/`ro`.
    pub options: String,
    /// Per-mount flags.
    pub nosuid: bool,
    /// Per-mount flags.
    pub nodev: bool,
    /// Per-mount flags.
    pub noexec: bool,
    /// Per-mount flags.
    pub read_only: bool,
}

/// How the copies are made: one filesystem, copying expected (sockets are always
/// left out).
const COPY: TreeOptions = TreeOptions {
    one_file_system: true,
    expect_copies: true,
};

impl TmpfsMount {
    /// The mount from its mount-table fields: per-mount options (`rw,nosuid,...`)
    /// and filesystem options (`rw,size=64k,...`).
    pub(crate) fn from_mountinfo(target: &Path, mount_options: &str, fs_options: &str) -> Self {
        let flags: Vec<&str> = mount_options.split(',').collect();
        let options = fs_options
            .split(',')
            .filter(|o| !o.is_empty() && *o != "rw" && *o != "ro")
            .collect::<Vec<_>>()
            .join(",");
        TmpfsMount {
            target: target.to_path_buf(),
            options,
            nosuid: flags.contains(&"nosuid"),
            nodev: flags.contains(&"nodev"),
            noexec: flags.contains(&"noexec"),
            read_only: flags.contains(&"ro"),
        }
    }

    /// Whether the options are ones a tmpfs takes, each `key` or `key=value` with
    /// nothing that could smuggle in another option.
    pub(crate) fn validate(&self) -> Result<(), String> {
        for option in self.options.split(',').filter(|o| !o.is_empty()) {
            let (key, value) = option.split_once('=').unwrap_or((option, ""));
            let key_ok =
                !key.is_empty() && key.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
            let value_ok = value
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"_:.-/%".contains(&b));
            if !key_ok || !value_ok {
                return Err(format!("bad tmpfs option {option:?}"));
            }
        }
        Ok(())
    }

    /// Copies the tmpfs that process `pid` has at [`TmpfsMount::target`] (device
    /// `dev` in its mount table, `major:minor`) into the new directory `dest`.
    pub(crate) fn save(&self, pid: i32, dev: &str, dest: &Path) -> Result<(), TmpfsError> {
        let relative = self.target.strip_prefix("/").unwrap_or(&self.target);
        let src = PathBuf::from(format!("/proc/{pid}/root")).join(relative);
        let meta = std::fs::symlink_metadata(&src).map_err(|source| TmpfsError::Inspect {
            path: src.clone(),
            source,
        })?;
        let expected = dev
            .split_once(':')
            .and_then(|(ma, mi)| Some(libc::makedev(ma.parse().ok()?, mi.parse().ok()?)));
        if !meta.is_dir() || expected != Some(meta.dev()) {
            return Err(TmpfsError::NotTheMount(self.target.clone()));
        }
        clone_tree_with(&src, dest, COPY)
            .map(|_| ())
            .map_err(|source| TmpfsError::Copy {
                target: self.target.clone(),
                source,
            })
    }

    /// A new tmpfs with these options and flags, filled from `saved` (what
    /// [`TmpfsMount::save`] wrote), attached nowhere: the descriptor holds it.
    pub(crate) fn restore(&self, saved: &Path) -> Result<OwnedFd, TmpfsError> {
        let fail = |step: &'static str| {
            let source = io::Error::last_os_error();
            TmpfsError::Mount {
                options: self.options.clone(),
                step,
                source,
            }
        };
        // SAFETY: fsopen reads the NUL-terminated name; the result is owned at once.
        let fs =
            unsafe { libc::syscall(libc::SYS_fsopen, c"tmpfs".as_ptr(), libc::FSOPEN_CLOEXEC) };
        if fs < 0 {
            return Err(fail("fsopen"));
        }
        // SAFETY: a descriptor fsopen just returned, owned by nothing else.
        let fs = unsafe { OwnedFd::from_raw_fd(fs as i32) };
        for option in self.options.split(',').filter(|o| !o.is_empty()) {
            let (key, value) = match option.split_once('=') {
                Some((k, v)) => (k, Some(v)),
                None => (option, None),
            };
            let key = CString::new(key).map_err(|e| TmpfsError::Mount {
                options: self.options.clone(),
                step: "option",
                source: e.into(),
            })?;
            let value = value
                .map(CString::new)
                .transpose()
                .map_err(|e| TmpfsError::Mount {
                    options: self.options.clone(),
                    step: "option",
                    source: e.into(),
                })?;
            let (cmd, value_ptr) = match &value {
                Some(v) => (libc::FSCONFIG_SET_STRING, v.as_ptr()),
                None => (libc::FSCONFIG_SET_FLAG, std::ptr::null()),
            };
            // SAFETY: key and value are NUL-terminated strings that outlive the call.
            let r = unsafe {
                libc::syscall(
                    libc::SYS_fsconfig,
                    fs.as_raw_fd(),
                    cmd,
                    key.as_ptr(),
                    value_ptr,
                    0,
                )
            };
            if r < 0 {
                return Err(fail("fsconfig"));
            }
        }
        let null = std::ptr::null::<libc::c_char>();
        // SAFETY: no pointers are read for FSCONFIG_CMD_CREATE.
        let r = unsafe {
            libc::syscall(
                libc::SYS_fsconfig,
                fs.as_raw_fd(),
                libc::FSCONFIG_CMD_CREATE,
                null,
                null,
                0,
            )
        };
        if r < 0 {
            return Err(fail("creating the filesystem"));
        }
        let mut attrs = 0u64;
        for (on, attr) in [
            (self.nosuid, libc::MOUNT_ATTR_NOSUID),
            (self.nodev, libc::MOUNT_ATTR_NODEV),
            (self.noexec, libc::MOUNT_ATTR_NOEXEC),
        ] {
            if on {
                attrs |= attr;
            }
        }
        // SAFETY: integer arguments only; the result is owned at once.
        let mount = unsafe {
            libc::syscall(
                libc::SYS_fsmount,
                fs.as_raw_fd(),
                libc::FSMOUNT_CLOEXEC,
                attrs,
            )
        };
        if mount < 0 {
            return Err(fail("fsmount"));
        }
        // SAFETY: a descriptor fsmount just returned, owned by nothing else.
        let mount = unsafe { OwnedFd::from_raw_fd(mount as i32) };
        // The detached mount's root, reached through its descriptor.
        let root = PathBuf::from(format!("/proc/self/fd/{}", mount.as_raw_fd()));
        clone_tree_into(saved, &root, COPY).map_err(|source| TmpfsError::Copy {
            target: self.target.clone(),
            source,
        })?;
        if self.read_only {
            set_read_only(&mount).map_err(|source| TmpfsError::Mount {
                options: self.options.clone(),
                step: "making it read-only",
                source,
            })?;
        }
        Ok(mount)
    }
}

/// Makes the detached mount `mount` read-only once it is filled.
fn set_read_only(mount: &OwnedFd) -> io::Result<()> {
    let attr = libc::mount_attr {
        attr_set: libc::MOUNT_ATTR_RDONLY,
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    // SAFETY: mount_setattr reads `attr` (of the size passed) during the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            mount.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const libc::mount_attr,
            std::mem::size_of::<libc::mount_attr>(),
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_mountinfo_options() {
        let m = TmpfsMount::from_mountinfo(
            Path::new("/dev"),
            "rw,nosuid,noexec,relatime",
            "rw,size=64k,mode=755,inode64",
        );
        assert_eq!(m.options, "size=64k,mode=755,inode64");
        assert!(m.nosuid && m.noexec && !m.nodev && !m.read_only);
        assert!(m.validate().is_ok());
        let mut bad = m.clone();
        bad.options = "size=1k\0x".into();
        assert!(bad.validate().is_err());
        bad.options = "a b".into();
        assert!(bad.validate().is_err());
    }

    #[test]
    fn a_saved_tree_comes_back_in_a_detached_tmpfs() {
        // SAFETY: geteuid has no failure mode.
        if unsafe { libc::geteuid() } != 0 {
            eprintln!("skipped: mounting a tmpfs needs root");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let saved = dir.path().join("saved");
        std::fs::create_dir(&saved).unwrap();
        std::fs::write(saved.join("f"), b"hello").unwrap();
        std::fs::create_dir(saved.join("d")).unwrap();
        std::os::unix::fs::symlink("f", saved.join("l")).unwrap();
        let m = TmpfsMount::from_mountinfo(
            Path::new("/tmp"),
            "rw,nosuid,nodev",
            "rw,size=1m,mode=1777",
        );
        let mount = m.restore(&saved).unwrap();
        let root = PathBuf::from(format!("/proc/self/fd/{}", mount.as_raw_fd()));
        assert_eq!(std::fs::read(root.join("f")).unwrap(), b"hello");
        assert!(root.join("d").is_dir());
        assert_eq!(std::fs::read_link(root.join("l")).unwrap(), Path::new("f"));
        let stat = nix::sys::statfs::statfs(&root).unwrap();
        assert_eq!(stat.filesystem_type(), nix::sys::statfs::TMPFS_MAGIC);
        // The root takes the saved directory's mode (over the options' mode=1777).
        use std::os::unix::fs::PermissionsExt;
        let saved_mode = std::fs::metadata(&saved).unwrap().permissions().mode();
        assert_eq!(
            std::fs::metadata(&root).unwrap().permissions().mode() & 0o7777,
            saved_mode & 0o7777
        );
        // Bad options are refused by the kernel, not mounted.
        let bad = TmpfsMount {
            options: "size=1m,not_an_option=1".into(),
            ..m
        };
        assert!(bad.restore(&saved).is_err());
    }
}
