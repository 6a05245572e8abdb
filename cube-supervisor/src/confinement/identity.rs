//! The unprivileged identity a VM supervisor runs as once confined: a uid of its own,
//! leased from the sandbox uid range ([`cube_jail::sandbox_uid`]) for the life of the
//! process, and the VM supervisors' group ([`SUPERVISOR_GID`]).
//!
//! Landlock, no capabilities and the seccomp filters already confine a VM supervisor
//! taken over by its guest; uid 0 still gave it what those leave to the owner of the
//! host's files and processes: other supervisors' staged snapshots to remove (Landlock
//! grants removal beneath a directory, for every entry alike), root's processes to
//! signal where the kernel does not scope signals, root's per-user kernel limits
//! (inotify, message queues, keys) to share with the host. As a uid of its own it owns
//! only its sandbox's directory (given to it here, before it drops root) and what it
//! writes there, among them the snapshots it stages; the store's shared areas let it
//! remove only those ([`cube_storage::supervisor_group`]). It keeps one capability,
//! `dac_read_search`: a rollback reads snapshots other uids wrote (the one a clone
//! came from, an imported one), which Landlock still limits to the store's snapshots
//! and templates. The vCPU threads confined ahead, before their sandbox is known, take
//! the same identity then: the lease is the process's, not the sandbox's.
//!
//! A process that is not root already runs unprivileged, and keeps its uid.

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cube_jail::capabilities::Identity;
use cube_jail::sandbox_uid::{SandboxUidError, UidLease};
use cube_storage::supervisor_group::SUPERVISOR_GID;

/// Why a VM supervisor could not take its own identity.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// No uid could be leased.
    #[error("leasing a uid of its own")]
    Lease(#[from] SandboxUidError),
    /// A file of its sandbox's directory could not be given to it.
    #[error("giving {path} to the supervisor's uid")]
    Give {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
}

/// This process's lease, held until it exits (the kernel drops the lock then).
static LEASE: OnceLock<UidLease> = OnceLock::new();

/// The identity a VM supervisor in this process runs as once confined, leased on the
/// first call and the same on every later one; `None` for a process that is not root.
pub fn vm_identity() -> Result<Option<Identity>, IdentityError> {
    if let Some(lease) = LEASE.get() {
        return Ok(Some(identity_of(lease)));
    }
    if !nix::unistd::geteuid().is_root() {
        return Ok(None);
    }
    let lease = UidLease::acquire()?;
    // Confinement runs on one thread at a time; were it raced, the loser's lease
    // drops here and both use the winner's.
    Ok(Some(identity_of(LEASE.get_or_init(|| lease))))
}

fn identity_of(lease: &UidLease) -> Identity {
    Identity {
        uid: lease.uid(),
        gid: SUPERVISOR_GID,
    }
}

/// Gives the sandbox directory `dir` and everything in it to `identity`, without
/// following symlinks: the supervisor goes on writing there (its memory image, its
/// staged snapshots, a rollback's disk) once it is no longer root. A file with more
/// than one link keeps its owner: its other names lie outside the directory (a
/// template's file linked in), which the supervisor must not come to own. Returns
/// how many entries changed owner.
pub fn give_own_dir(dir: &Path, identity: Identity) -> Result<usize, IdentityError> {
    let mut changed = 0;
    let mut pending = vec![dir.to_path_buf()];
    while let Some(path) = pending.pop() {
        let give_err = |source| IdentityError::Give {
            path: path.clone(),
            source,
        };
        let meta = std::fs::symlink_metadata(&path).map_err(give_err)?;
        if meta.is_dir() {
            for entry in std::fs::read_dir(&path).map_err(give_err)? {
                pending.push(entry.map_err(give_err)?.path());
            }
        } else if meta.nlink() > 1 {
            continue;
        }
        if (meta.uid(), meta.gid()) != (identity.uid, identity.gid) {
            std::os::unix::fs::lchown(&path, Some(identity.uid), Some(identity.gid))
                .map_err(give_err)?;
            changed += 1;
        }
    }
    Ok(changed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sandbox_directory_is_given_but_for_files_linked_from_elsewhere() {
        if !nix::unistd::geteuid().is_root() {
            println!("skipped: giving files to another uid needs root");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let template = tmp.path().join("template-disk");
        std::fs::write(&template, "base").unwrap();
        let dir = tmp.path().join("sb");
        std::fs::create_dir_all(dir.join("snap.staging")).unwrap();
        std::fs::write(dir.join("memory"), "m").unwrap();
        std::fs::write(dir.join("snap.staging/state"), "s").unwrap();
        std::fs::hard_link(&template, dir.join("linked")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", dir.join("link")).unwrap();
        let id = Identity {
            uid: cube_jail::sandbox_uid::RANGE.start + 9,
            gid: SUPERVISOR_GID,
        };
        assert_eq!(give_own_dir(&dir, id).unwrap(), 5);
        for p in ["", "snap.staging", "memory", "snap.staging/state", "link"] {
            let m = std::fs::symlink_metadata(dir.join(p)).unwrap();
            assert_eq!((m.uid(), m.gid()), (id.uid, id.gid), "{p}");
        }
        assert_eq!(std::fs::metadata(&template).unwrap().uid(), 0);
        assert_eq!(std::fs::metadata("/etc/passwd").unwrap().uid(), 0);
        assert_eq!(give_own_dir(&dir, id).unwrap(), 0);
    }
}
