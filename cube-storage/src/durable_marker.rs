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

/// Opens `path` to be synced. Not through a symlink: only what the snapshot itself
/// holds is synced.
fn open_no_follow(path: &Path) -> Result<File, DurabilityError> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| DurabilityError::Sync(path.display().to_string(), e))
}

fn sync_path(path: &Path) -> Result<(), DurabilityError> {
    open_no_follow(path)?
        .sync_all()
        .map_err(|e| DurabilityError::Sync(path.display().to_string(), e))
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
    let marker = SnapshotDir::new(dir).durable_marker();
    sync_tree(dir, &marker)?;
    sync_path(dir)?;
    if let Some(parent) = dir.parent() {
        sync_path(parent)?;
    }
    crate::metadata::write_atomic_bytes(&marker, DURABLE_KIND, written_in_boot.as_bytes())
        .map_err(DurabilityError::Marker)
}

/// A snapshot being staged, opened for its flush once it lies elsewhere: its empty
/// durability marker (open for writing), the files directly in its directory and the
/// directory itself. A process that may not open the place the snapshot is then
/// moved to (a confined VM supervisor: it neither writes nor reads the store's
/// snapshots) still syncs it and marks it durable through these descriptors, with
/// [`make_durable_through`]. Empty, the marker vouches for nothing. Deeper trees (a
/// jail's layer and checkpoint, whose supervisor reads the store) are synced by path
/// after the move, so that a layer of many files holds no descriptors meanwhile.
pub struct PendingFlush {
    marker: File,
    /// The files at the top of the snapshot, by name.
    files: Vec<(std::ffi::OsString, File)>,
    /// The directories at its top (a jail's trees), synced by path.
    subdirs: Vec<std::ffi::OsString>,
    dir: File,
    /// The directory the snapshot is moved into, where the caller opened it before.
    destination: Option<File>,
}

impl PendingFlush {
    /// Creates the empty marker in `dir` (the staging directory) and opens the
    /// rest; the snapshot's files must all be written by then.
    pub fn stage(dir: &Path) -> Result<Self, DurabilityError> {
        let path = SnapshotDir::new(dir).durable_marker();
        let marker = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|e| DurabilityError::CreateMarker(path.display().to_string(), e))?;
        let describe = |p: &Path, e| DurabilityError::Sync(p.display().to_string(), e);
        let mut files = Vec::new();
        let mut subdirs = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(|e| describe(dir, e))? {
            let entry = entry.map_err(|e| describe(dir, e))?;
            let file_path = entry.path();
            let kind = entry.file_type().map_err(|e| describe(&file_path, e))?;
            if kind.is_file() && file_path != path {
                files.push((entry.file_name(), open_no_follow(&file_path)?));
            } else if kind.is_dir() {
                subdirs.push(entry.file_name());
            }
        }
        Ok(PendingFlush {
            marker,
            files,
            subdirs,
            dir: open_no_follow(dir)?,
            destination: None,
        })
    }

    /// Has the flush sync `destination`, the directory the snapshot is moved into,
    /// through this descriptor rather than by path (a confined VM supervisor opened
    /// the store's areas before it was confined).
    pub fn with_destination(mut self, destination: File) -> Self {
        self.destination = Some(destination);
        self
    }

    /// Whether the snapshot's directory is still linked into the file system (not
    /// removed since it was staged), wherever it was moved.
    pub fn still_linked(&self) -> bool {
        self.dir.metadata().is_ok_and(|m| {
            use std::os::unix::fs::MetadataExt;
            m.nlink() > 0
        })
    }

    /// The snapshot's file `name` (a VM's memory file, the parent of its next diff).
    pub fn file(&self, name: &std::ffi::OsStr) -> Option<&File> {
        self.files.iter().find(|(n, _)| n == name).map(|(_, f)| f)
    }
}

/// [`make_durable`] for a snapshot staged as `pending` and now at `dir`: its
/// subdirectories' trees (by path), the files and directory opened while it was
/// staged and the directory naming it (through its descriptor where it has one) are
/// synced, then the marker is written in place through
/// its descriptor and synced. A write cut short leaves an envelope whose length or
/// checksum is wrong, which vouches for nothing, as no marker would.
pub fn make_durable_through(
    dir: &Path,
    written_in_boot: &str,
    pending: PendingFlush,
) -> Result<(), DurabilityError> {
    let describe =
        |name: &std::ffi::OsStr, e| DurabilityError::Sync(dir.join(name).display().to_string(), e);
    let PendingFlush {
        mut marker,
        files,
        subdirs,
        dir: dir_file,
        destination,
    } = pending;
    let marker_name = SnapshotDir::new(dir).durable_marker();
    for name in &subdirs {
        let path = dir.join(name);
        sync_tree(&path, &marker_name)?;
        sync_path(&path)?;
    }
    for (name, file) in &files {
        file.sync_all().map_err(|e| describe(name, e))?;
    }
    dir_file.sync_all().map_err(|e| describe("".as_ref(), e))?;
    match (destination, dir.parent()) {
        (Some(destination), _) => destination
            .sync_all()
            .map_err(|e| describe("..".as_ref(), e))?,
        (None, Some(parent)) => sync_path(parent)?,
        (None, None) => {}
    }
    let bytes = crate::metadata::encode_envelope(DURABLE_KIND, written_in_boot.as_bytes())
        .map_err(DurabilityError::Marker)?;
    let describe = |e| DurabilityError::Sync(marker_name.display().to_string(), e);
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
        let pending = PendingFlush::stage(&staging).unwrap();
        assert!(matches!(
            PendingFlush::stage(&staging),
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
        make_durable_through(&dest, other, pending).unwrap();
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
