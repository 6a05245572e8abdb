//! A jail snapshot on disk, checked before anything is restored from it (rollback,
//! clone): its record must be whole and a jail's, its files must have reached the
//! disk (see [`cube_storage::durable_marker`]: a snapshot written in an earlier boot
//! and never flushed may hold half-written files after a host crash, and is refused
//! as a VM snapshot would be), and its layer and tmpfs contents must be what they were
//! when it was written (see [`cube_storage::tree_manifest`]: sizes and CRC32s, bound
//! to the snapshot's id). CRIU's images are checked by
//! [`cube_jail::checkpoint::Checkpoint::open`].
//!
//! A jail's hibernation checkpoint is recorded the same way ([`record_hibernation`])
//! and flushed in the background like a snapshot, so that a wake checks it as a
//! rollback checks a snapshot: one interrupted by a host crash, or damaged on disk, is
//! refused and left where it is, never restored from half-written files.

use std::path::Path;

use cube_storage::durable_marker::{boot_id, check_usable, DurabilityError};
use cube_storage::tree_manifest::{self, TreeManifestError};
use cube_storage::{Durability, MetadataError, SnapshotDir};
use cube_vmm::persist::SnapshotStats;

use crate::error_report::chain as error_chain;
use crate::protocol::{ErrorKind, Failure};
use crate::records::{now_unix, Engine, SnapshotKind, SnapshotMeta};

/// Why a jail snapshot is not restored.
#[derive(Debug, thiserror::Error)]
pub enum JailSnapshotError {
    /// The snapshot's record is missing or damaged.
    #[error("Snapshot record {0} is unreadable")]
    Record(String, #[source] MetadataError),
    /// The record is another engine's.
    #[error("Snapshot {id} is a {engine} snapshot; this is a jail sandbox")]
    WrongEngine {
        /// The snapshot.
        id: String,
        /// Its engine.
        engine: Engine,
    },
    /// The record names no boot: an older build wrote it without flushing it.
    #[error(
        "Snapshot {0} records no boot id (written before jail snapshots were flushed): \
         its files may never have reached the disk"
    )]
    NoBootId(String),
    /// The snapshot may be incomplete.
    #[error("Snapshot {0} cannot be trusted")]
    NotDurable(String, #[source] DurabilityError),
    /// The manifest of its files could not be written.
    #[error("Recording the files of snapshot {0}")]
    Manifest(String, #[source] TreeManifestError),
    /// Its files are not those it was written with.
    #[error("Snapshot {0} is damaged")]
    Damaged(String, #[source] TreeManifestError),
    /// This host's boot id, which a record names, could not be read.
    #[error("Reading this host's boot id")]
    Boot(#[source] DurabilityError),
    /// The record could not be written.
    #[error("Writing the record of snapshot {0}")]
    WriteRecord(String, #[source] MetadataError),
}

/// The id a jail's hibernation checkpoint is recorded, and its files listed, under.
pub const HIBERNATION_ID: &str = "hibernation";

/// The trees of a jail snapshot its manifest covers: the writable layer, and the
/// tmpfs contents of a full-state one.
const TREES: &[&str] = &[
    cube_storage::layout::LAYER_DIR,
    cube_jail::checkpoint::TMPFS,
];

/// Records what the trees of jail snapshot `id`, staged in `dir`, hold.
pub fn record_files(dir: &Path, id: &str) -> Result<(), JailSnapshotError> {
    tree_manifest::write(dir, id, TREES).map_err(|e| JailSnapshotError::Manifest(id.to_string(), e))
}

/// Records the hibernation checkpoint of `sandbox` in `dir` as a jail snapshot of
/// `kind` is recorded: the manifest of its files, then (last) a record naming this
/// boot. A full one is CRIU's dump; a filesystem one is the layer alone, kept where
/// CRIU could not dump (`fallback` says why). The caller has it flushed; [`open`]
/// checks it before a wake.
pub fn record_hibernation(
    dir: &Path,
    sandbox: &str,
    stats: SnapshotStats,
    kind: SnapshotKind,
    fallback: Option<String>,
) -> Result<(), JailSnapshotError> {
    record_files(dir, HIBERNATION_ID)?;
    let meta = SnapshotMeta {
        id: HIBERNATION_ID.to_string(),
        sandbox: sandbox.to_string(),
        created_unix: now_unix(),
        stats,
        kind,
        engine: Engine::Jail,
        fallback,
        template: None,
        boot_id: Some(boot_id().map_err(JailSnapshotError::Boot)?),
        rootfs: None,
    };
    let written = serde_json::to_vec(&meta)
        .map_err(|source| MetadataError::Serialize { source })
        .and_then(|bytes| {
            cube_storage::write_atomic_bytes_with(
                &SnapshotDir::new(dir).record(),
                SnapshotDir::RECORD_KIND,
                &bytes,
                // The background flush syncs it with the rest.
                Durability::Deferred,
            )
        });
    written.map_err(|e| JailSnapshotError::WriteRecord(HIBERNATION_ID.to_string(), e))
}

impl From<JailSnapshotError> for Failure {
    fn from(e: JailSnapshotError) -> Self {
        let kind = match e {
            JailSnapshotError::WrongEngine { .. } => ErrorKind::InvalidArgument,
            _ => ErrorKind::SnapshotFailed,
        };
        Failure::new(kind, error_chain(&e))
    }
}

/// Reads the record of the jail snapshot in `dir` and checks that the snapshot may be
/// restored, before anything of the running sandbox is touched.
pub fn open(dir: &Path) -> Result<SnapshotMeta, JailSnapshotError> {
    let snapshot = SnapshotDir::new(dir);
    let record = snapshot.record();
    let meta: SnapshotMeta = cube_storage::read_verified(&record, SnapshotDir::RECORD_KIND)
        .map_err(|e| JailSnapshotError::Record(record.display().to_string(), e))?;
    if meta.engine != Engine::Jail {
        return Err(JailSnapshotError::WrongEngine {
            id: meta.id,
            engine: meta.engine,
        });
    }
    let Some(boot) = meta.boot_id.as_deref() else {
        return Err(JailSnapshotError::NoBootId(meta.id));
    };
    check_usable(dir, boot).map_err(|e| JailSnapshotError::NotDurable(meta.id.clone(), e))?;
    tree_manifest::verify(dir, &meta.id, TREES)
        .map_err(|e| JailSnapshotError::Damaged(meta.id.clone(), e))?;
    Ok(meta)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cube_storage::durable_marker::make_durable;

    fn record(dir: &Path, engine: Engine, boot: Option<&str>) {
        let meta = SnapshotMeta {
            id: "snap-1".into(),
            sandbox: "sb-1".into(),
            created_unix: 1,
            stats: SnapshotStats::default(),
            kind: SnapshotKind::Filesystem,
            engine,
            fallback: None,
            template: None,
            boot_id: boot.map(str::to_string),
            rootfs: None,
        };
        let snapshot = SnapshotDir::new(dir);
        std::fs::create_dir_all(snapshot.layer()).unwrap();
        std::fs::write(snapshot.layer().join("notes"), b"kept").unwrap();
        cube_storage::write_atomic(&snapshot.record(), SnapshotDir::RECORD_KIND, &meta).unwrap();
        record_files(dir, "snap-1").unwrap();
    }

    #[test]
    fn damaged_layer_files_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        record(dir.path(), Engine::Jail, Some(&boot_id().unwrap()));
        open(dir.path()).unwrap();
        std::fs::write(SnapshotDir::new(dir.path()).layer().join("notes"), b"lost").unwrap();
        let err = error_chain(&open(dir.path()).unwrap_err());
        assert!(
            err.contains("snap-1 is damaged") && err.contains("layer/notes is damaged"),
            "{err}"
        );
    }

    #[test]
    fn a_snapshot_of_an_earlier_boot_needs_its_marker() {
        let dir = tempfile::tempdir().unwrap();
        let now = boot_id().unwrap();
        record(dir.path(), Engine::Jail, Some(&now));
        assert_eq!(open(dir.path()).unwrap().id, "snap-1");

        // Written before a host restart, the flush never done: refused.
        let earlier = "00000000-0000-0000-0000-000000000000";
        record(dir.path(), Engine::Jail, Some(earlier));
        let err = open(dir.path()).unwrap_err();
        assert!(matches!(err, JailSnapshotError::NotDurable(..)), "{err}");
        assert!(error_chain(&err).contains("never flushed"), "{err}");
        // Flushed in that boot: its marker vouches for it.
        make_durable(dir.path(), earlier).unwrap();
        assert!(open(dir.path()).is_ok());
    }

    /// A hibernation checkpoint is recorded and checked as a snapshot is: whole, it
    /// opens; with a layer file changed, or written in an earlier boot and never
    /// flushed, it is refused.
    #[test]
    fn a_hibernation_checkpoint_is_recorded_and_checked_like_a_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let layer = SnapshotDir::new(dir.path()).layer();
        std::fs::create_dir_all(&layer).unwrap();
        std::fs::write(layer.join("notes"), b"kept").unwrap();
        record_hibernation(
            dir.path(),
            "sb-1",
            SnapshotStats::default(),
            SnapshotKind::Full,
            None,
        )
        .unwrap();
        let meta = open(dir.path()).unwrap();
        assert_eq!(
            (meta.id.as_str(), meta.sandbox.as_str()),
            (HIBERNATION_ID, "sb-1")
        );
        assert_eq!(meta.kind, SnapshotKind::Full);

        std::fs::write(layer.join("notes"), b"lost").unwrap();
        let err = error_chain(&open(dir.path()).unwrap_err());
        assert!(err.contains("hibernation is damaged"), "{err}");

        std::fs::write(layer.join("notes"), b"kept").unwrap();
        open(dir.path()).unwrap();
        let mut meta: SnapshotMeta = cube_storage::read_verified(
            &SnapshotDir::new(dir.path()).record(),
            SnapshotDir::RECORD_KIND,
        )
        .unwrap();
        meta.boot_id = Some("00000000-0000-0000-0000-000000000000".into());
        cube_storage::write_atomic(
            &SnapshotDir::new(dir.path()).record(),
            SnapshotDir::RECORD_KIND,
            &meta,
        )
        .unwrap();
        assert!(matches!(
            open(dir.path()),
            Err(JailSnapshotError::NotDurable(..))
        ));
    }

    #[test]
    fn records_without_a_boot_or_of_a_vm_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        record(dir.path(), Engine::Jail, None);
        assert!(matches!(
            open(dir.path()),
            Err(JailSnapshotError::NoBootId(_))
        ));
        record(dir.path(), Engine::Vm, Some(&boot_id().unwrap()));
        let err = open(dir.path()).unwrap_err();
        assert_eq!(Failure::from(err).kind, ErrorKind::InvalidArgument);
        std::fs::write(SnapshotDir::new(dir.path()).record(), b"garbage").unwrap();
        assert!(matches!(
            open(dir.path()),
            Err(JailSnapshotError::Record(..))
        ));
    }
}
