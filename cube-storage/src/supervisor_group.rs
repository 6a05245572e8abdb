//! The group VM supervisors run as, and the two store areas it may remove from.
//!
//! A confined VM supervisor gives up uid 0 for a uid of its own (see
//! `cube_supervisor::confinement::identity`) with this group as its gid. The areas
//! whose entries a supervisor removes itself when its sandbox ends without a library
//! present (its own directory among `sandboxes/`, the snapshots it owns among
//! `snapshots/`) are owned by root and this group, group-writable and sticky: a
//! supervisor may then remove the entries its own uid owns, and no other's (the
//! snapshots other sandboxes' supervisors staged, or root wrote), which Landlock alone
//! could not say: it grants removal beneath a directory, for every entry alike.
//! Landlock still keeps a supervisor from adding entries there. Every other area
//! stays root's alone. The store's root, where others may not search it, is opened
//! to the group for search: a supervisor reaches its own directory by path.

use std::fs;
use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

/// The gid VM supervisors run as: outside the sandbox uid range (so no sandbox's
/// processes ever hold it) and far above any account's.
pub const SUPERVISOR_GID: u32 = 0x6fff_ffff;

/// The mode of a shared area: owner and group may add and remove entries, the
/// sticky bit limits removal to an entry's owner (and root), others nothing.
pub const SHARED_AREA_MODE: u32 = 0o1770;

/// Gives area `dir`, whose metadata (not following a symlink) is `meta`, to root
/// and [`SUPERVISOR_GID`] with [`SHARED_AREA_MODE`] where it has another owner, group
/// or mode. Only root can; for another user (whose store has no supervisor of
/// another uid) nothing changes.
pub fn share_area(dir: &Path, meta: &fs::Metadata) -> io::Result<()> {
    if !nix::unistd::geteuid().is_root() {
        return Ok(());
    }
    if meta.uid() != 0 || meta.gid() != SUPERVISOR_GID {
        std::os::unix::fs::lchown(dir, Some(0), Some(SUPERVISOR_GID))?;
    }
    if meta.mode() & 0o7777 != SHARED_AREA_MODE {
        fs::set_permissions(dir, fs::Permissions::from_mode(SHARED_AREA_MODE))?;
    }
    Ok(())
}

/// Lets the supervisors' group search the store's root `dir` where others may not
/// (a store the library made is 0700): a VM supervisor reaches its own sandbox's
/// directory by path, through it. The group gets no listing. Only root can; for
/// another user nothing changes.
pub fn open_root_to_group(dir: &Path) -> io::Result<()> {
    if !nix::unistd::geteuid().is_root() {
        return Ok(());
    }
    let meta = fs::symlink_metadata(dir)?;
    if searchable_by(&meta, None, SUPERVISOR_GID) {
        return Ok(());
    }
    std::os::unix::fs::lchown(dir, None, Some(SUPERVISOR_GID))?;
    fs::set_permissions(
        dir,
        fs::Permissions::from_mode(meta.mode() & 0o7777 | 0o010),
    )
}

/// Whether the directory whose metadata is `meta` may be searched by a process of
/// group `gid` and uid `uid` (`None`: a uid that owns nothing, as any supervisor's
/// may be): others may search it, or it is that group's and the group may, or that
/// uid's and its owner may.
pub fn searchable_by(meta: &fs::Metadata, uid: Option<u32>, gid: u32) -> bool {
    let mode = meta.mode();
    mode & 0o001 != 0
        || (meta.gid() == gid && mode & 0o010 != 0)
        || (Some(meta.uid()) == uid && mode & 0o100 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_area_is_shared_with_the_group_and_sticky() {
        if !nix::unistd::geteuid().is_root() {
            println!("skipped: giving a directory to a group needs root");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let area = tmp.path().join("snapshots");
        fs::create_dir(&area).unwrap();
        share_area(&area, &fs::symlink_metadata(&area).unwrap()).unwrap();
        let meta = fs::metadata(&area).unwrap();
        assert_eq!((meta.uid(), meta.gid()), (0, SUPERVISOR_GID));
        assert_eq!(meta.mode() & 0o7777, SHARED_AREA_MODE);
        // Idempotent.
        share_area(&area, &meta).unwrap();
    }

    #[test]
    fn a_closed_store_root_is_opened_to_the_group_for_search_only() {
        if !nix::unistd::geteuid().is_root() {
            println!("skipped: giving a directory to a group needs root");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("store");
        fs::create_dir(&root).unwrap();
        fs::set_permissions(&root, fs::Permissions::from_mode(0o700)).unwrap();
        open_root_to_group(&root).unwrap();
        let meta = fs::metadata(&root).unwrap();
        assert_eq!((meta.uid(), meta.gid()), (0, SUPERVISOR_GID));
        assert_eq!(meta.mode() & 0o7777, 0o710);
        // One others may search already is left as it is.
        let open = tmp.path().join("open");
        fs::create_dir(&open).unwrap();
        fs::set_permissions(&open, fs::Permissions::from_mode(0o755)).unwrap();
        open_root_to_group(&open).unwrap();
        assert_eq!(fs::metadata(&open).unwrap().gid(), 0);
    }
}
