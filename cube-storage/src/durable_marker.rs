//! Making a snapshot durable off the critical path, and refusing one that may not be.
//!
//! A snapshot is written to the page cache only, which is enough for every process on
//! this host to restore it at once. A background flush then syncs its files and
//! directory and writes a marker. After a host restart the page cache is gone: a
//! snapshot from an earlier boot is accepted only with that marker, so a snapshot
//! interrupted by a crash is refused instead of restored from half-written files.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use crate::layout::SnapshotDir;
use crate::metadata::MetadataError;

/// Envelope kind of the marker.
const DURABLE_KIND: &str = "cube-durable";

/// Why durability could not be established or checked.
#[derive(Debug, thiserror::Error)]
pub enum DurabilityError {
    /// The kernel's boot id is unreadable.
    #[error("Reading the host boot id")]
    BootId(#[source] std::io::Error),
    /// Syncing a file failed.
    #[error("Syncing {0}")]
    Sync(String, #[source] std::io::Error),
    /// The empty marker could not be created in the staging directory.
    #[error("Creating the durability marker {0}")]
    CreateMarker(String, #[source] std::io::Error),
    /// Writing the marker failed.
    #[error("Writing the durability marker")]
    Marker(#[source] MetadataError),
    /// The snapshot was written before the host restarted and never flushed.
    #[error(
        "Snapshot was written in an earlier boot and never flushed to disk: it may be incomplete"
    )]
    NotDurable,
}

/// This boot's id (`/proc/sys/kernel/random/boot_id`).
pub fn boot_id() -> Result<String, DurabilityError> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .map_err(DurabilityError::BootId)
}

fn sync_path(path: &Path) -> Result<(), DurabilityError> {
    let describe = |e| DurabilityError::Sync(path.display().to_string(), e);
    // Not through a symlink: only what the snapshot itself holds is synced.
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .and_then(|f| f.sync_all())
        .map_err(describe)
}

/// Syncs every regular file and directory under `dir` (not `dir` itself), files
/// before the directory that names them. A VM's snapshot is a few flat files; a
/// jail's holds its writable layer (and CRIU's images) as whole trees. Symlinks,
/// FIFOs and device nodes have no data: their directory's sync keeps them. The
/// marker itself is left out, as it is written after.
fn sync_tree(dir: &Path, marker: &Path) -> Result<(), DurabilityError> {
    let describe = |e| DurabilityError::Sync(dir.display().to_string(), e);
    for entry in std::fs::read_dir(dir).map_err(describe)? {
        let entry = entry.map_err(describe)?;
        let path = entry.path();
        let kind = entry.file_type().map_err(describe)?;
        if kind.is_dir() {
            sync_tree(&path, marker)?;
            sync_path(&path)?;
        } else if kind.is_file() && path != marker {
            sync_path(&path)?;
        }
    }
    Ok(())
}

/// Flushes the snapshot in `dir` (every file under it), its directory entry and its
/// parent's to disk, then marks it durable.
pub fn make_durable(dir: &Path, written_in_boot: &str) -> Result<(), DurabilityError> {
    let marker = sync_all_but_marker(dir)?;
    crate::metadata::write_atomic_bytes(&marker, DURABLE_KIND, written_in_boot.as_bytes())
        .map_err(DurabilityError::Marker)
}

/// Syncs the snapshot in `dir` (every file under it but its marker), its directory
/// entry and its parent's; returns the marker's path, for the caller to write.
fn sync_all_but_marker(dir: &Path) -> Result<std::path::PathBuf, DurabilityError> {
    let marker = SnapshotDir::new(dir).durable_marker();
    sync_tree(dir, &marker)?;
    sync_path(dir)?;
    if let Some(parent) = dir.parent() {
        sync_path(parent)?;
    }
    Ok(marker)
}

/// Creates the empty durability marker of the snapshot being staged in `dir` and
/// returns it open for writing, for [`make_durable_through`]. A process that may read
/// the place the snapshot is then moved to, but not write it (a confined VM
/// supervisor), can still mark it durable through this descriptor. Empty, the marker
/// vouches for nothing.
pub fn create_marker(dir: &Path) -> Result<File, DurabilityError> {
    let path = SnapshotDir::new(dir).durable_marker();
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&path)
        .map_err(|e| DurabilityError::CreateMarker(path.display().to_string(), e))
}

/// [`make_durable`] for a snapshot whose marker was made by [`create_marker`]: once
/// everything else is synced, the marker is written in place through `marker` and
/// synced. A write cut short leaves an envelope whose length or checksum is wrong,
/// which vouches for nothing, as no marker would.
pub fn make_durable_through(
    dir: &Path,
    written_in_boot: &str,
    mut marker: File,
) -> Result<(), DurabilityError> {
    let marker_path = sync_all_but_marker(dir)?;
    let bytes = crate::metadata::encode_envelope(DURABLE_KIND, written_in_boot.as_bytes())
        .map_err(DurabilityError::Marker)?;
    let describe = |e| DurabilityError::Sync(marker_path.display().to_string(), e);
    marker.write_all(&bytes).map_err(describe)?;
    marker.sync_all().map_err(describe)
}

/// Whether the snapshot in `dir`, written during boot `written_in_boot`, can be used.
pub fn check_usable(dir: &Path, written_in_boot: &str) -> Result<(), DurabilityError> {
    if boot_id()? == written_in_boot {
        // Same boot: the page cache holds everything that was written.
        return Ok(());
    }
    if marked_durable(dir, written_in_boot) {
        Ok(())
    } else {
        Err(DurabilityError::NotDurable)
    }
}

/// Whether the snapshot in `dir` carries a whole marker saying it was flushed after
/// being written during boot `written_in_boot`.
pub fn marked_durable(dir: &Path, written_in_boot: &str) -> bool {
    let marker = SnapshotDir::new(dir).durable_marker();
    matches!(
        crate::metadata::read_verified_bytes(&marker, DURABLE_KIND, 64),
        Ok(marker) if marker == written_in_boot.as_bytes()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_boot_is_usable_and_other_boots_need_the_marker() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(SnapshotDir::new(dir.path()).memory(), b"m").unwrap();
        let now = boot_id().unwrap();
        assert!(check_usable(dir.path(), &now).is_ok());
        let other = "00000000-0000-0000-0000-000000000000";
        assert!(matches!(
            check_usable(dir.path(), other),
            Err(DurabilityError::NotDurable)
        ));
        make_durable(dir.path(), other).unwrap();
        assert!(check_usable(dir.path(), other).is_ok());
        // A marker for another boot does not vouch for this snapshot.
        make_durable(dir.path(), &now).unwrap();
        assert!(check_usable(dir.path(), other).is_err());
    }

    #[test]
    fn a_marker_made_while_staging_is_written_after_the_move_and_vouches_only_then() {
        let store = tempfile::tempdir().unwrap();
        let staging = store.path().join("snap.staging");
        std::fs::create_dir(&staging).unwrap();
        std::fs::write(SnapshotDir::new(&staging).memory(), b"m").unwrap();
        let marker = create_marker(&staging).unwrap();
        assert!(matches!(
            create_marker(&staging),
            Err(DurabilityError::CreateMarker(..))
        ));
        let dest = store.path().join("snap");
        std::fs::rename(&staging, &dest).unwrap();
        let other = "00000000-0000-0000-0000-000000000000";
        // Created but not yet written: it vouches for nothing.
        assert!(matches!(
            check_usable(&dest, other),
            Err(DurabilityError::NotDurable)
        ));
        make_durable_through(&dest, other, marker).unwrap();
        assert!(check_usable(&dest, other).is_ok());
    }

    #[test]
    fn a_jail_snapshots_whole_tree_is_flushed_and_links_are_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        let snapshot = SnapshotDir::new(dir.path().join("snap"));
        let deep = snapshot.layer().join("home/user");
        std::fs::create_dir_all(&deep).unwrap();
        std::fs::write(deep.join("notes.txt"), b"kept").unwrap();
        std::os::unix::fs::symlink(outside.path(), snapshot.layer().join("out")).unwrap();
        std::os::unix::fs::symlink("/nonexistent", deep.join("dangling")).unwrap();
        nix::unistd::mkfifo(&deep.join("pipe"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        let other = "00000000-0000-0000-0000-000000000000";
        make_durable(&snapshot, other).unwrap();
        assert!(check_usable(&snapshot, other).is_ok());
        // A file that cannot be read stops the flush short of the marker.
        let unreadable = tempfile::tempdir().unwrap();
        let missing = SnapshotDir::new(unreadable.path().join("gone"));
        assert!(matches!(
            make_durable(&missing, other),
            Err(DurabilityError::Sync(..))
        ));
        assert!(!missing.durable_marker().exists());
    }
}
