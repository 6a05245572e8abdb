//! A snapshot lent to a confined VM supervisor for a rollback.
//!
//! A confined VM supervisor reads none of the store's snapshots where they lie (one
//! taken over by its guest would otherwise read every other sandbox's memory), so
//! the library lends it the snapshot it rolls back to: hard links to the snapshot's
//! files in a directory of the supervisor's sandbox, which Landlock lets it read.
//! Links, not copies, so that the restored memory shares the page cache of the
//! snapshot's memory file with every other sandbox restored from it. The files are
//! first given to root and the supervisors' group, read-only: the supervisor reads
//! them through the links but cannot write them (a clone mapping the same memory
//! file would see the write) nor change their mode. Only regular files are lent:
//! the snapshot was staged by a supervisor, whose guest could have put a symlink
//! there, and each file linked is the one opened and checked.

use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::layout::SnapshotDir;
use crate::supervisor_group::SUPERVISOR_GID;

/// The mode of a lent file: root (its owner) reads and writes, as it may anyway; the
/// supervisors' group reads. A supervisor's clone of it (a rollback's disk) keeps the
/// owner's write bit, which the supervisor, its owner, needs.
pub const LENT_FILE_MODE: u32 = 0o640;

/// The mode of the directory the files are lent in: the group lists and reads it,
/// and adds or removes nothing.
const LENT_DIR_MODE: u32 = 0o750;

/// Why a snapshot could not be lent.
#[derive(Debug, thiserror::Error)]
pub enum LendError {
    /// The snapshot holds something other than a regular file.
    #[error("{0} is not a regular file, as every file of a VM snapshot is")]
    NotAFile(PathBuf),
    /// The snapshot's directory is not one (a symbolic link put in its place).
    #[error("{0} is not a directory (a symbolic link?): refused")]
    NotADirectory(PathBuf),
    /// A file system operation failed.
    #[error("{action} {path}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// On what.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

fn io_error(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> LendError {
    let path = path.to_path_buf();
    move |source| LendError::Io {
        action,
        path,
        source,
    }
}

/// Lends `snapshot` in `into` (replacing whatever was there), for the supervisor of
/// the sandbox whose directory holds `into`; on failure nothing is left at `into`.
/// The caller removes `into` once the supervisor is done with it ([`take_back`]).
pub fn lend(snapshot: &SnapshotDir, into: &SnapshotDir) -> Result<(), LendError> {
    take_back(into)?;
    let root = nix::unistd::geteuid().is_root();
    DirBuilder::new()
        .mode(LENT_DIR_MODE)
        .create(into)
        .map_err(io_error("creating", into.path()))?;
    let linked = link_files(snapshot, into.path(), root);
    if linked.is_err() {
        let _ = fs::remove_dir_all(into);
    }
    linked
}

/// Removes what [`lend`] left in `into`; nothing there is not an error.
pub fn take_back(into: &SnapshotDir) -> Result<(), LendError> {
    match fs::remove_dir_all(into) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_error("removing", into.path())(e)),
        _ => Ok(()),
    }
}

fn link_files(snapshot: &SnapshotDir, into: &Path, root: bool) -> Result<(), LendError> {
    // Everything below goes through this descriptor of the directory just made:
    // the sandbox's directory is its supervisor's, which could put a symlink in the
    // new directory's place, and root would link the files where it points.
    let dir = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(into)
        .map_err(io_error("opening", into))?;
    if root {
        std::os::unix::fs::fchown(&dir, Some(0), Some(SUPERVISOR_GID))
            .map_err(io_error("giving to the supervisors' group", into))?;
    }
    // The snapshot's directory is opened once, not through a link, and listed and
    // read through that descriptor: its directory is the uid's of the VM supervisor
    // that staged it, which (where the kernel has no Landlock) could swap it for a
    // link to another sandbox's snapshot once the library had read its record.
    let source = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(snapshot)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) | Some(libc::ENOTDIR) => {
                LendError::NotADirectory(snapshot.to_path_buf())
            }
            _ => io_error("opening", snapshot.path())(e),
        })?;
    let listing = source
        .try_clone()
        .map_err(io_error("listing", snapshot.path()))?;
    let mut listing = nix::dir::Dir::from_fd(listing.into())
        .map_err(|e| io_error("listing", snapshot.path())(e.into()))?;
    for entry in listing.iter() {
        let entry = entry.map_err(|e| io_error("listing", snapshot.path())(e.into()))?;
        let name = std::ffi::OsStr::from_bytes(entry.file_name().to_bytes());
        if name == "." || name == ".." {
            continue;
        }
        let path = snapshot.join(name);
        let file = open_regular(&source, name, &path)?;
        if root {
            make_lendable(&file, &path)?;
        }
        link(&file, &path, &dir, name, &into.join(name), root)?;
    }
    Ok(())
}

/// Opens `name` in the directory `dir` (`path` in messages) without following a
/// symlink or blocking on a FIFO, and checks it is a regular file.
fn open_regular(dir: &File, name: &std::ffi::OsStr, path: &Path) -> Result<File, LendError> {
    use nix::fcntl::OFlag;
    let file = nix::fcntl::openat(
        dir,
        name,
        OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map(File::from)
    .map_err(|e| match e {
        nix::errno::Errno::ELOOP => LendError::NotAFile(path.to_path_buf()),
        other => io_error("opening", path)(other.into()),
    })?;
    let meta = file.metadata().map_err(io_error("reading", path))?;
    if !meta.is_file() {
        return Err(LendError::NotAFile(path.to_path_buf()));
    }
    Ok(file)
}

/// Gives `file` to root and the supervisors' group, [`LENT_FILE_MODE`], where it is
/// not already.
fn make_lendable(file: &File, path: &Path) -> Result<(), LendError> {
    let meta = file.metadata().map_err(io_error("reading", path))?;
    if meta.uid() != 0 || meta.gid() != SUPERVISOR_GID {
        std::os::unix::fs::fchown(file, Some(0), Some(SUPERVISOR_GID))
            .map_err(io_error("giving to root", path))?;
    }
    if meta.mode() & 0o7777 != LENT_FILE_MODE {
        file.set_permissions(fs::Permissions::from_mode(LENT_FILE_MODE))
            .map_err(io_error("making read-only", path))?;
    }
    Ok(())
}

/// Links the file opened as `file` (from `path`) as `name` in the directory `dir`
/// (`link` in messages): as root, the very file opened (`AT_EMPTY_PATH`), whatever
/// has taken its name since.
fn link(
    file: &File,
    path: &Path,
    dir: &File,
    name: &std::ffi::OsStr,
    link: &Path,
    root: bool,
) -> Result<(), LendError> {
    let c_string = |bytes: &[u8]| {
        std::ffi::CString::new(bytes).map_err(|e| io_error("linking", link)(io::Error::other(e)))
    };
    let name = c_string(std::os::unix::ffi::OsStrExt::as_bytes(name))?;
    let (from_dir, from, flags) = if root {
        (file.as_raw_fd(), c_string(b"")?, libc::AT_EMPTY_PATH)
    } else {
        let from = c_string(std::os::unix::ffi::OsStrExt::as_bytes(path.as_os_str()))?;
        (libc::AT_FDCWD, from, 0)
    };
    // SAFETY: both descriptors are open for the call, both strings are NUL-terminated
    // and outlive it; linkat only reads them.
    let r = unsafe {
        libc::linkat(
            from_dir,
            from.as_ptr(),
            dir.as_raw_fd(),
            name.as_ptr(),
            flags,
        )
    };
    if r != 0 {
        return Err(io_error("linking", link)(io::Error::last_os_error()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(dir: &Path) -> SnapshotDir {
        let snapshot = SnapshotDir::new(dir.join("snap"));
        fs::create_dir(&snapshot).unwrap();
        fs::write(snapshot.memory(), b"memory").unwrap();
        fs::write(snapshot.state(), b"state").unwrap();
        snapshot
    }

    #[test]
    fn a_snapshot_is_lent_as_read_only_links_and_taken_back() {
        let tmp = tempfile::tempdir().unwrap();
        let snapshot = snapshot(tmp.path());
        let into = SnapshotDir::new(tmp.path().join("sandbox/rollback.source"));
        fs::create_dir(tmp.path().join("sandbox")).unwrap();
        // A leftover of an earlier lend is replaced.
        fs::create_dir(&into).unwrap();
        fs::write(into.join("stale"), b"x").unwrap();
        lend(&snapshot, &into).unwrap();
        assert!(!into.join("stale").exists());
        assert_eq!(fs::read(into.memory()).unwrap(), b"memory");
        let lent = fs::metadata(into.memory()).unwrap();
        // The same file, not a copy: one page cache for every sandbox restored.
        assert_eq!(lent.ino(), fs::metadata(snapshot.memory()).unwrap().ino());
        if nix::unistd::geteuid().is_root() {
            assert_eq!((lent.uid(), lent.gid()), (0, SUPERVISOR_GID));
            assert_eq!(lent.mode() & 0o7777, LENT_FILE_MODE);
            let dir = fs::metadata(&into).unwrap();
            assert_eq!((dir.uid(), dir.gid()), (0, SUPERVISOR_GID));
            assert_eq!(dir.mode() & 0o7777, LENT_DIR_MODE);
        }
        take_back(&into).unwrap();
        assert!(!into.exists() && snapshot.memory().exists());
        take_back(&into).unwrap();
    }

    #[test]
    fn a_snapshot_directory_that_is_a_link_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let other = snapshot(tmp.path());
        let linked = SnapshotDir::new(tmp.path().join("linked"));
        std::os::unix::fs::symlink(other.path(), &linked).unwrap();
        let into = SnapshotDir::new(tmp.path().join("rollback.source"));
        let err = lend(&linked, &into).unwrap_err();
        assert!(
            matches!(&err, LendError::NotADirectory(p) if *p == linked.path()),
            "{err}"
        );
        assert!(!into.exists());
    }

    #[test]
    fn a_symlink_or_a_directory_in_a_snapshot_is_refused_and_nothing_is_left() {
        let tmp = tempfile::tempdir().unwrap();
        let into = SnapshotDir::new(tmp.path().join("rollback.source"));
        let snapshot = snapshot(tmp.path());
        std::os::unix::fs::symlink("/etc/shadow", snapshot.rootfs()).unwrap();
        let err = lend(&snapshot, &into).unwrap_err();
        assert!(
            matches!(&err, LendError::NotAFile(p) if *p == snapshot.rootfs()),
            "{err}"
        );
        assert!(!into.exists());
        fs::remove_file(snapshot.rootfs()).unwrap();
        fs::create_dir(snapshot.layer()).unwrap();
        assert!(matches!(
            lend(&snapshot, &into),
            Err(LendError::NotAFile(_))
        ));
        assert!(!into.exists());
    }
}
