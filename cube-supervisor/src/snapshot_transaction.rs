//! The one way a snapshot or hibernation image comes into being, for every backend:
//! staged in a directory of its own, its record and an empty durability marker
//! written, moved into place, the guest told it is committed, then flushed in the
//! background (a jail's layer and checkpoint as a VM's memory and disk).
//!
//! A snapshot is whole or absent: until the move nothing is at `dest`, and a failure
//! before the staging directory is handed over removes it (on every path, by
//! [`Drop`]), so the sandbox's earlier snapshots stay as they were. The move itself
//! is the library's: a confined VM supervisor may read the store's snapshots but not
//! add to them, so it stages in its own sandbox directory, answers, and hears from
//! the library once the snapshot is in place ([`PendingCommit`]). A VM's diff
//! snapshot is two-phase: its dirty pages stay pending in the VM until then. The
//! record names the boot it was written in; the flush writes the durability marker
//! (see [`cube_storage::durable_marker`]), made while staging and kept open, that
//! restores check before they apply a snapshot from another boot.

use std::fs::File;
use std::path::{Path, PathBuf};

use cube_storage::durable_marker::{boot_id, PendingFlush};
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
    /// Handed over to the library to move into place: not ours to clean up.
    handed_over: bool,
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
            handed_over: false,
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

    /// Writes the record of `sandbox`'s snapshot of `staged` (naming this boot) and
    /// the empty durability marker into the staging directory, and hands it over: the
    /// library moves it to `dest`, then says so, and the backend finishes the
    /// returned [`PendingCommit`].
    pub fn stage(
        mut self,
        sandbox: &str,
        engine: Engine,
        staged: Staged,
    ) -> Result<(SnapshotMeta, PendingCommit), Failure> {
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
        let mut flush = PendingFlush::stage(&self.staging).map_err(|e| error_chain(&e))?;
        if let Some(area) = crate::flush::held_area_of(&self.dest) {
            flush = flush.with_destination(area);
        }
        self.handed_over = true;
        let pending = PendingCommit {
            dest: std::mem::take(&mut self.dest),
            flush,
        };
        Ok((meta, pending))
    }
}

/// A staged snapshot the library is moving into place: what is left to do once it
/// is there.
pub struct PendingCommit {
    dest: PathBuf,
    /// Its files, opened while staged: a confined VM supervisor opens none of the
    /// store's snapshots.
    flush: PendingFlush,
}

impl PendingCommit {
    /// Takes the snapshot pending in `pending` if it is the one for `dest`, which the
    /// library says now holds it.
    pub fn take_for(pending: &mut Option<PendingCommit>, dest: &Path) -> Result<Self, Failure> {
        match pending.take() {
            Some(p) if p.dest == dest => Ok(p),
            other => {
                *pending = other;
                Err(Failure::invalid(format!(
                    "no snapshot of this sandbox is waiting to be committed as {}",
                    dest.display()
                )))
            }
        }
    }

    /// Checks the snapshot was not removed, runs `committed` on its files as staged (a VM
    /// forgets the dirty pages the snapshot now holds, and keeps its memory file as
    /// the parent of its next diff) and has it flushed into `flushes`.
    pub fn finish(
        self,
        committed: impl FnOnce(&PendingFlush) -> Result<(), Failure>,
        flushes: &mut Flushes,
    ) -> Result<(), Failure> {
        // Through the staged directory's descriptor: a confined VM supervisor may not
        // look where it now lies.
        if !self.flush.still_linked() {
            return Err(format!("{} holds no snapshot", self.dest.display()).into());
        }
        committed(&self.flush)?;
        flushes.start(self.dest, self.flush);
        Ok(())
    }

    /// The memory file of a VM's snapshot, as staged, for the parent of its next
    /// diff.
    pub fn memory(staged: &PendingFlush) -> Result<File, Failure> {
        let memory = staged
            .file(SnapshotDir::MEMORY_NAME.as_ref())
            .ok_or("the snapshot has no memory file")?;
        Ok(memory
            .try_clone()
            .map_err(|e| format!("keeping the snapshot's memory file: {e}"))?)
    }
}

impl Drop for SnapshotTransaction {
    fn drop(&mut self) {
        if !self.handed_over {
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
        let flush = PendingFlush::stage(&staging).map_err(|e| error_chain(&e))?;
        if image.exists() {
            std::fs::rename(&image, &old).map_err(|e| format!("moving old image: {e}"))?;
        }
        std::fs::rename(&staging, &image).map_err(|e| format!("committing image: {e}"))?;
        Ok(flush)
    });
    let flush = match written {
        Ok(flush) => flush,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&staging);
            return Err(e);
        }
    };
    let _ = std::fs::remove_dir_all(&old);
    flushes.start(image.into_path(), flush);
    Ok(())
}
