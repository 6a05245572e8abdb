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
//! remove only those ([`cube_storage::supervisor_group`]). It keeps no capability: the
//! snapshot a rollback reads is lent to it by the library, read-only to the
//! supervisors' group ([`cube_storage::lent_snapshot`]). The vCPU threads confined
//! ahead, before their sandbox is known, take the same identity then: the lease is
//! the process's, not the sandbox's.
//!
//! A process that is not root already runs unprivileged, and keeps its uid.

use std::path::Path;
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
    /// Its sandbox's directory could not be given to it.
    #[error("giving its sandbox's directory to the supervisor's uid")]
    Give(#[source] SandboxUidError),
    /// Its network record could not be kept root's.
    #[error("keeping the network record {0} root's")]
    KeepRecord(std::path::PathBuf, #[source] std::io::Error),
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

/// Whether `identity` may search every directory above `dir` (its sandbox's
/// directory, which it is given): each lets others search it, or is the
/// supervisors' group's and lets its group search it, or is its uid's. The store
/// opens its root to the group ([`cube_storage::supervisor_group`]); the host's
/// directories above it may be closed (a private temporary directory, a home).
pub fn reaches_by_path(dir: &Path, identity: Identity) -> bool {
    dir.ancestors().skip(1).all(|above| {
        std::fs::metadata(above).is_ok_and(|m| {
            cube_storage::supervisor_group::searchable_by(&m, Some(identity.uid), identity.gid)
        })
    })
}

/// The uid this process runs as, if it is one leased by [`vm_identity`] (a confined
/// VM supervisor's); `None` for root or a process that was never root.
pub fn running_as_own_uid() -> Option<u32> {
    let uid = LEASE.get()?.uid();
    (nix::unistd::geteuid().as_raw() == uid).then_some(uid)
}

fn identity_of(lease: &UidLease) -> Identity {
    Identity {
        uid: lease.uid(),
        gid: SUPERVISOR_GID,
    }
}

/// Gives the sandbox directory `dir` and everything in it to `identity` (see
/// [`cube_jail::sandbox_uid::give_whole_tree`]): the supervisor goes on writing there
/// (its memory image, its staged snapshots, a rollback's disk) once it is no longer
/// root. Returns how many entries changed owner. Its network record goes back to
/// root: the library releases the device a record names only where root wrote it
/// ([`crate::jail_network::release_recorded`]), and the supervisor needs to remove
/// it at most, which owning the directory lets it do.
pub fn give_own_dir(dir: &Path, identity: Identity) -> Result<u64, IdentityError> {
    let given =
        cube_jail::sandbox_uid::give_whole_tree(dir, identity).map_err(IdentityError::Give)?;
    let record = cube_storage::SandboxDir::new(dir).network_record();
    match std::os::unix::fs::lchown(&record, Some(0), Some(0)) {
        Ok(()) => Ok(given),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(given),
        Err(e) => Err(IdentityError::KeepRecord(record, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

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

    #[test]
    fn a_directory_is_reached_by_path_only_through_searchable_ones() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("store/sandboxes/sb");
        std::fs::create_dir_all(&dir).unwrap();
        let id = Identity {
            uid: cube_jail::sandbox_uid::RANGE.start + 9,
            gid: SUPERVISOR_GID,
        };
        let mode = |p: &Path, m: u32| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
        };
        for above in [tmp.path(), &tmp.path().join("store"), dir.parent().unwrap()] {
            mode(above, 0o711);
        }
        assert!(reaches_by_path(&dir, id));
        // Closed to others, and not the group's: out of reach.
        mode(&tmp.path().join("store"), 0o750);
        assert!(!reaches_by_path(&dir, id));
        if nix::unistd::geteuid().is_root() {
            // The supervisors' group's, searchable by it: reached again.
            std::os::unix::fs::lchown(tmp.path().join("store"), None, Some(SUPERVISOR_GID))
                .unwrap();
            assert!(reaches_by_path(&dir, id));
        }
    }
}
