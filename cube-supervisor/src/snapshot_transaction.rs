//! The one way a snapshot or hibernation image comes into being, for every backend:
//! staged in a directory of its own, its record written, renamed into place, the
//! guest told it is committed, then flushed in the background (a jail's layer and
//! checkpoint as a VM's memory and disk).
//!
//! A snapshot is whole or absent: until the rename nothing is at `dest`, and a
//! failure anywhere before it removes the staging directory (on every path, by
//! [`Drop`]), so the sandbox's earlier snapshots stay as they were. A VM's diff
//! snapshot is two-phase: its dirty pages stay pending in the VM until the commit
//! step, after the rename, says the snapshot is in place. The record names the boot
//! it was written in; the flush leaves the boot-id durability marker (see
//! [`cube_storage::durable_marker`]) that restores check before they apply a snapshot
//! from another boot.

use std::path::{Path, PathBuf};

use cube_storage::durable_marker::boot_id;
use cube_storage::{Durability, SandboxDir, SnapshotDir};
use cube_vmm::persist::SnapshotStats;

use crate::error_report::chain as error_chain;
use crate::flush::Flushes;
use crate::protocol::{ErrorKind, Failure};
use crate::records::{now_unix, Engine, SnapshotKind, SnapshotMeta};

/// What a backend wrote into the staging directory, for the snapshot's record.
pub struct Staged {
    /// What writing it cost.
    pub stats: SnapshotStats,
    /// Whether it holds the processes or the files only.
    pub kind: SnapshotKind,
    /// Why a full snapshot fell back to the files, where it did.
    pub fallback: Option<String>,
}

impl Staged {
    /// A full snapshot (memory, devices, disk or processes) with these stats.
    pub fn full(stats: SnapshotStats) -> Self {
        Staged {
            stats,
            kind: SnapshotKind::Full,
            fallback: None,
        }
    }
}

/// A snapshot under way from `staging` to `dest`.
pub struct SnapshotTransaction {
    id: String,
    staging: PathBuf,
    dest: PathBuf,
    /// Renamed into place: nothing is left to clean up.
    committed: bool,
}

impl SnapshotTransaction {
    /// Begins a snapshot to be staged in `staging` and to end as `dest` (whose name
    /// is the snapshot's id); refuses a `dest` that exists.
    pub fn begin(staging: &Path, dest: &Path) -> Result<Self, Failure> {
        let id = dest
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .ok_or_else(|| format!("{} has no snapshot id", dest.display()))?;
        if dest.exists() {
            return Err(Failure::new(
                ErrorKind::AlreadyExists,
                format!("{} already exists", dest.display()),
            ));
        }
        Ok(SnapshotTransaction {
            id,
            staging: staging.to_path_buf(),
            dest: dest.to_path_buf(),
            committed: false,
        })
    }

    /// The snapshot's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Makes the empty staging directory, for the VMs' writers.
    pub fn create_staging(&self) -> Result<SnapshotDir, Failure> {
        std::fs::create_dir(&self.staging)
            .map_err(|e| format!("creating {}: {e}", self.staging.display()))?;
        Ok(SnapshotDir::new(&self.staging))
    }

    /// Writes the record of `sandbox`'s snapshot of `staged` (naming this boot) into
    /// the staging directory, renames it into place, runs `committed` (a VM forgets the
    /// dirty pages the snapshot now holds), then has it flushed into `flushes`.
    pub fn commit(
        mut self,
        sandbox: &str,
        engine: Engine,
        staged: Staged,
        committed: impl FnOnce(&Path) -> Result<(), Failure>,
        flushes: &mut Flushes,
    ) -> Result<SnapshotMeta, Failure> {
        let boot_id = boot_id().map_err(|e| error_chain(&e))?;
        let meta = SnapshotMeta {
            id: std::mem::take(&mut self.id),
            sandbox: sandbox.to_string(),
            created_unix: now_unix(),
            stats: staged.stats,
            kind: staged.kind,
            engine,
            fallback: staged.fallback,
            template: None,
            boot_id: Some(boot_id),
            rootfs: None,
        };
        let bytes = serde_json::to_vec(&meta).map_err(|e| e.to_string())?;
        cube_storage::write_atomic_bytes_with(
            &SnapshotDir::new(&self.staging).record(),
            SnapshotDir::RECORD_KIND,
            &bytes,
            Durability::Deferred,
        )
        .map_err(|e| error_chain(&e))?;
        std::fs::rename(&self.staging, &self.dest)
            .map_err(|e| format!("committing snapshot: {e}"))?;
        self.committed = true;
        committed(&self.dest)?;
        flushes.start(self.dest.clone());
        Ok(meta)
    }
}

impl Drop for SnapshotTransaction {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_dir_all(&self.staging);
        }
    }
}

/// Writes a VM's hibernation image: `write` fills a fresh staging directory, which
/// then takes the place of the sandbox's image (an old one is moved aside until the
/// new one is in place, then removed) and is flushed into `flushes`. On failure the
/// staging directory goes and any earlier image stays.
///
/// A jail hibernates otherwise: CRIU dumps straight into the sandbox's checkpoint
/// directory, and the jail is gone either way once it tried.
pub fn write_hibernation_image(
    dir: &SandboxDir,
    flushes: &mut Flushes,
    write: impl FnOnce(&Path) -> Result<(), Failure>,
) -> Result<(), Failure> {
    let image = dir.hibernation();
    let staging = dir.hibernation_staging();
    let old = dir.hibernation_old();
    let _ = std::fs::remove_dir_all(&staging);
    let _ = std::fs::remove_dir_all(&old);
    std::fs::create_dir(&staging).map_err(|e| format!("creating {}: {e}", staging.display()))?;
    let written = write(&staging).and_then(|()| {
        if image.exists() {
            std::fs::rename(&image, &old).map_err(|e| format!("moving old image: {e}"))?;
        }
        std::fs::rename(&staging, &image).map_err(|e| format!("committing image: {e}").into())
    });
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&staging);
        return Err(e);
    }
    let _ = std::fs::remove_dir_all(&old);
    flushes.start(image.into_path());
    Ok(())
}
